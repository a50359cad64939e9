//! The benchmark's report: criterion's estimates read back from its output
//! directory, the lines printed after criterion's own output, and the
//! headlines written to `$STACKSCOPE_BENCH_REPORT` for `cargo xtask bench
//! unwind` to print as its summary.
//!
//! It owns no measurement: every time here is criterion's estimate.

use std::{
    path::{Path, PathBuf},
    time::SystemTime,
};

/// Where criterion writes, resolved the way criterion resolves its default
/// (minus its `cargo metadata` call), so the summary reads the same files.
pub fn criterion_dir() -> PathBuf {
    if let Some(home) = std::env::var_os("CRITERION_HOME") {
        return home.into();
    }
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"),
        PathBuf::from,
    );
    target.join("criterion")
}

/// criterion's estimates of the benchmarks this process ran.
pub struct Estimates {
    dir: PathBuf,
    started: SystemTime,
}

impl Estimates {
    /// Estimates written after `started`; older files are from earlier runs
    /// (e.g. benchmarks filtered out of this one) and are not reported.
    pub fn new(dir: PathBuf, started: SystemTime) -> Self {
        Self { dir, started }
    }

    /// Nanoseconds per iteration of `group/id`: the regression slope for
    /// linearly sampled benchmarks, the mean for flat-sampled ones (criterion
    /// computes no slope for those).
    pub fn ns(&self, group: &str, id: &str) -> Option<f64> {
        let path = self.dir.join(group).join(id).join("new/estimates.json");
        let modified = std::fs::metadata(&path).ok()?.modified().ok()?;
        if modified < self.started {
            return None;
        }
        let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).ok()?).ok()?;
        json["slope"]["point_estimate"]
            .as_f64()
            .or_else(|| json["mean"]["point_estimate"].as_f64())
    }
}

/// `12.3 ms`, `456 ns`, or `not measured` (a filtered-out benchmark, or
/// criterion's `--test` mode).
pub fn duration(ns: Option<f64>) -> String {
    match ns {
        None => "not measured".to_owned(),
        Some(ns) if ns >= 1e6 => format!("{:.1} ms", ns / 1e6),
        Some(ns) if ns >= 1e3 => format!("{:.1} µs", ns / 1e3),
        Some(ns) => format!("{ns:.0} ns"),
    }
}

/// The report, printed in one piece at the end so it is not lost in
/// criterion's output, and a few headline lines for `cargo xtask bench
/// unwind` to repeat.
#[derive(Default)]
pub struct Report {
    lines: Vec<String>,
    headlines: Vec<String>,
}

impl Report {
    pub fn line(&mut self, line: impl Into<String>) {
        self.lines.push(line.into());
    }

    /// A one-line summary of a section, for the xtask's summary only (the
    /// report shows the same figures in its tables).
    pub fn headline(&mut self, line: impl Into<String>) {
        self.headlines.push(line.into());
    }

    /// Prints the report and, when `STACKSCOPE_BENCH_REPORT` names a file,
    /// writes the headlines there.
    pub fn finish(self) {
        println!("\n{}", self.lines.join("\n"));
        if let Some(path) = std::env::var_os("STACKSCOPE_BENCH_REPORT")
            && let Err(error) = std::fs::write(&path, self.headlines.join("\n") + "\n")
        {
            eprintln!("writing {}: {error}", Path::new(&path).display());
        }
    }
}
