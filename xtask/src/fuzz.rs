//! `cargo xtask fuzz`: the cargo-fuzz targets of every parser that reads
//! untrusted bytes, built and run one after the other (one core each: the
//! machine is shared), with libFuzzer's final figures per target.
//!
//! Each target lives in the fuzz crate of the crate that owns its parser
//! (`<crate>/fuzz/`, an empty workspace of its own so the sanitizer flags
//! stay out of the main build). Corpora, artifacts and logs stay under
//! that folder and out of git; seeds are written into a corpus at run time,
//! from this machine's own files (`/proc/self/maps`, a real ELF's
//! `.eh_frame`) or built here, never checked in.
//!
//! Owns: the list of targets, their seeds, driving cargo-fuzz and reading
//! libFuzzer's output. Does not own the targets (they are in the fuzz
//! crates) nor the fixes (in the parsers, with regression tests).

mod seeds;

use std::{
    io::{BufRead as _, BufReader, Write as _},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{Context as _, bail};

use crate::{run_checked, setup, workspace_root};

/// What `cargo xtask fuzz` takes.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// How long each target runs, in seconds (libFuzzer's `-max_total_time`).
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// Longest one input may take, in seconds, before it counts as a hang
    /// (libFuzzer's `-timeout`; its default of 20 minutes hides them).
    #[arg(long, default_value_t = 10)]
    timeout: u64,
    /// Memory one run may use, in MiB (libFuzzer's `-rss_limit_mb`, which
    /// also bounds a single allocation).
    #[arg(long, default_value_t = 2048)]
    rss_limit_mb: u64,
    /// List the targets and stop.
    #[arg(long)]
    list: bool,
    /// Build the targets without running them.
    #[arg(long, conflicts_with = "list")]
    build_only: bool,
    /// Targets to run, by name (`table_cache`) or as `<crate folder>/<name>`;
    /// every target when none is given.
    targets: Vec<String>,
}

/// One cargo-fuzz target.
#[derive(Debug)]
pub(crate) struct Target {
    /// The folder of the crate that owns the parser; the fuzz crate is its
    /// `fuzz/` subfolder.
    krate: &'static str,
    /// The target's name (`fuzz_targets/<name>.rs`).
    name: &'static str,
    /// What it reads, for the listing.
    what: &'static str,
    /// Seeds: (file name, bytes) written into the corpus when absent.
    seeds: fn() -> seeds::Seeds,
}

impl Target {
    fn fuzz_dir(&self) -> PathBuf {
        workspace_root().join(self.krate).join("fuzz")
    }

    fn corpus(&self) -> PathBuf {
        self.fuzz_dir().join("corpus").join(self.name)
    }
}

/// Every target, in the order they run.
pub(crate) const TARGETS: &[Target] = &[
    Target {
        krate: "unwind",
        name: "table_compiler",
        what: "CFI table compiler: ELF files, raw .eh_frame and .debug_frame",
        seeds: seeds::table_compiler,
    },
    Target {
        krate: "unwind",
        name: "table_cache",
        what: "on-disk unwind table reader",
        seeds: seeds::table_cache,
    },
    Target {
        krate: "gopclntab",
        name: "gopclntab",
        what: "Go function table (.gopclntab) reader",
        seeds: seeds::gopclntab,
    },
    Target {
        krate: "sampler",
        name: "sample_record",
        what: "ring-buffer records of the BPF sampler (samples, exec, exit)",
        seeds: seeds::sample_record,
    },
    Target {
        krate: "process-events",
        name: "perf_record",
        what: "perf side-band records (mmap, comm, fork, exit, lost)",
        seeds: seeds::perf_record,
    },
    Target {
        krate: "process-table",
        name: "proc_maps",
        what: "/proc/<pid>/maps parser",
        seeds: seeds::proc_maps,
    },
    Target {
        krate: "metadata",
        name: "proc_cgroup",
        what: "/proc/<pid>/cgroup parser and container identity from the path",
        seeds: seeds::proc_cgroup,
    },
    Target {
        krate: "metadata",
        name: "mountinfo",
        what: "/proc/self/mountinfo: the cgroup2 mount point",
        seeds: seeds::mountinfo,
    },
    Target {
        krate: "symbolize",
        name: "perf_map",
        what: "perf map reader (/tmp/perf-<pid>.map, read as it grows)",
        seeds: seeds::perf_map,
    },
    Target {
        krate: "symbolize",
        name: "jitdump",
        what: "jitdump reader (jit-<pid>.dump, fed in chunks)",
        seeds: seeds::jitdump,
    },
    Target {
        krate: "collector",
        name: "ingest_batch",
        what: "collector ingest: protobuf batch decode and validation",
        seeds: seeds::ingest_batch,
    },
    Target {
        krate: "profile",
        name: "selector",
        what: "label selectors and time specifications as people type them",
        seeds: seeds::selector,
    },
];

pub fn run(args: &Args) -> anyhow::Result<()> {
    let targets = select(&args.targets)?;
    if args.list {
        for target in targets {
            let name = format!("{}/{}", target.krate, target.name);
            println!("{name:<30} {}", target.what);
        }
        return Ok(());
    }
    setup::ensure_cargo_fuzz()?;
    let mut outcomes = Vec::new();
    for target in targets {
        ensure_lock_file(target)?;
        build(target).with_context(|| format!("building {}/{}", target.krate, target.name))?;
        if args.build_only {
            continue;
        }
        write_seeds(target)?;
        let outcome = fuzz(target, args)?;
        remove_scratch();
        outcome.print(target);
        outcomes.push((target, outcome));
    }
    if outcomes.is_empty() {
        return Ok(());
    }
    eprintln!();
    eprintln!(
        "{:<30} {:>12} {:>8} {:>7} {:>8} {:>8} {:>6}  result",
        "target", "executions", "exec/s", "cov", "ft", "corpus", "secs"
    );
    for (target, outcome) in &outcomes {
        eprintln!(
            "{:<30} {:>12} {:>8} {:>7} {:>8} {:>8} {:>6}  {}",
            format!("{}/{}", target.krate, target.name),
            show(outcome.executions),
            show(outcome.exec_per_sec),
            show(outcome.cov),
            show(outcome.ft),
            outcome.corpus_files,
            outcome.seconds,
            outcome.result(),
        );
    }
    let failed: Vec<String> = outcomes
        .iter()
        .filter(|(_, outcome)| !outcome.success)
        .map(|(target, _)| target.name.to_string())
        .collect();
    if !failed.is_empty() {
        bail!("fuzzing found problems in: {}", failed.join(", "));
    }
    Ok(())
}

fn show(value: Option<u64>) -> String {
    value.map_or_else(|| "-".to_string(), |v| v.to_string())
}

/// Type-checks every fuzz crate with the workspace's toolchain (no
/// sanitizer, no nightly): `cargo xtask test` runs it, so a target that an
/// API change broke fails the tests instead of the next fuzzing run (one
/// did, unnoticed, for sessions). Shares one target directory under the
/// workspace's.
pub fn check() -> anyhow::Result<()> {
    let mut crates: Vec<&Target> = Vec::new();
    for target in TARGETS {
        if !crates.iter().any(|seen| seen.krate == target.krate) {
            crates.push(target);
        }
    }
    let target_dir = workspace_root().join("target").join("fuzz-check");
    for target in crates {
        ensure_lock_file(target)?;
        let manifest = target.fuzz_dir().join("Cargo.toml");
        crate::cargo(&[
            "check",
            "--bins",
            "--manifest-path",
            &manifest.to_string_lossy(),
            "--target-dir",
            &target_dir.to_string_lossy(),
        ])
        .with_context(|| format!("the fuzz targets of {} do not build", target.krate))?;
    }
    Ok(())
}

/// The targets `names` asks for, in [`TARGETS`] order; all when empty.
fn select(names: &[String]) -> anyhow::Result<Vec<&'static Target>> {
    if names.is_empty() {
        return Ok(TARGETS.iter().collect());
    }
    for name in names {
        if !TARGETS.iter().any(|target| matches(target, name)) {
            let known: Vec<&str> = TARGETS.iter().map(|t| t.name).collect();
            bail!(
                "no fuzz target {name:?}; the targets are {}",
                known.join(", ")
            );
        }
    }
    Ok(TARGETS
        .iter()
        .filter(|target| names.iter().any(|name| matches(target, name)))
        .collect())
}

fn matches(target: &Target, name: &str) -> bool {
    name == target.name || name == format!("{}/{}", target.krate, target.name)
}

/// cargo-fuzz with the nightly toolchain, in the crate's folder, one build
/// job (the machine is shared), and the toolchain `cargo xtask` runs with
/// not leaking into it. Builds go to `<crate>/fuzz/target`, or under
/// `CARGO_TARGET_DIR` when it is set (the sanitizer builds then share
/// their dependencies across fuzz crates).
fn cargo_fuzz(target: &Target) -> Command {
    let mut cmd = Command::new("cargo");
    cmd.args(["+nightly", "fuzz"])
        .current_dir(workspace_root().join(target.krate))
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("RUSTC")
        .env_remove("RUSTFLAGS")
        .env("CARGO_BUILD_JOBS", "1");
    cmd
}

/// A fuzz crate has no lock file in git (it would go stale beside the
/// workspace's): it starts from the workspace's, so the fuzzed code is
/// built with the versions the workspace tests, and cargo adds what only
/// the fuzz crate uses.
fn ensure_lock_file(target: &Target) -> anyhow::Result<()> {
    let lock = target.fuzz_dir().join("Cargo.lock");
    if !lock.exists() {
        std::fs::copy(workspace_root().join("Cargo.lock"), &lock)
            .with_context(|| format!("writing {}", lock.display()))?;
    }
    Ok(())
}

fn build(target: &Target) -> anyhow::Result<()> {
    eprintln!("fuzz: building {}/{}", target.krate, target.name);
    run_checked(cargo_fuzz(target).args(["build", target.name]))
}

fn write_seeds(target: &Target) -> anyhow::Result<()> {
    let corpus = target.corpus();
    std::fs::create_dir_all(&corpus).with_context(|| format!("creating {}", corpus.display()))?;
    for (name, bytes) in (target.seeds)()? {
        let path = corpus.join(format!("seed-{name}"));
        if !path.exists() {
            std::fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))?;
        }
    }
    Ok(())
}

/// What one run of a target came to.
#[derive(Debug, Default)]
struct Outcome {
    success: bool,
    executions: Option<u64>,
    exec_per_sec: Option<u64>,
    cov: Option<u64>,
    ft: Option<u64>,
    peak_rss_mb: Option<u64>,
    corpus_files: usize,
    corpus_bytes: u64,
    seconds: u64,
    /// libFuzzer's name for what went wrong (`deadly signal`, `timeout`,
    /// `out-of-memory`, ...), and the input it saved.
    problem: Option<String>,
    artifact: Option<PathBuf>,
    log: PathBuf,
    command: String,
}

impl Outcome {
    fn result(&self) -> String {
        match (&self.problem, &self.artifact) {
            _ if self.success => "ok".to_string(),
            (Some(problem), Some(artifact)) => format!("{problem}: {}", artifact.display()),
            (Some(problem), None) => problem.clone(),
            (None, _) => format!("failed (see {})", self.log.display()),
        }
    }

    fn print(&self, target: &Target) {
        eprintln!("fuzz: {}/{}: {}", target.krate, target.name, self.result());
        eprintln!("  command:    {}", self.command);
        eprintln!(
            "  executions: {} in {} s ({} exec/s)",
            show(self.executions),
            self.seconds,
            show(self.exec_per_sec)
        );
        eprintln!(
            "  coverage:   cov: {} ft: {}",
            show(self.cov),
            show(self.ft)
        );
        eprintln!(
            "  corpus:     {} inputs, {} bytes ({})",
            self.corpus_files,
            self.corpus_bytes,
            target.corpus().display()
        );
        eprintln!("  peak RSS:   {} MB", show(self.peak_rss_mb));
        eprintln!("  log:        {}", self.log.display());
    }
}

fn fuzz(target: &Target, args: &Args) -> anyhow::Result<Outcome> {
    let logs = target.fuzz_dir().join("logs");
    std::fs::create_dir_all(&logs)?;
    let log_path = logs.join(format!("{}.log", target.name));
    let mut log = std::fs::File::create(&log_path)
        .with_context(|| format!("creating {}", log_path.display()))?;

    let corpus = target.corpus();
    let libfuzzer_args = [
        format!("-max_total_time={}", args.seconds),
        format!("-timeout={}", args.timeout),
        format!("-rss_limit_mb={}", args.rss_limit_mb),
        "-print_final_stats=1".to_string(),
    ];
    let mut cmd = cargo_fuzz(target);
    cmd.args(["run", target.name])
        .arg(&corpus)
        .arg("--")
        .args(&libfuzzer_args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let command = format!(
        "cd {} && cargo +nightly fuzz run {} {} -- {}",
        target.krate,
        target.name,
        corpus
            .strip_prefix(workspace_root().join(target.krate))
            .unwrap_or(&corpus)
            .display(),
        libfuzzer_args.join(" ")
    );
    eprintln!(
        "fuzz: running {}/{} for {} s (log: {})",
        target.krate,
        target.name,
        args.seconds,
        log_path.display()
    );
    let started = Instant::now();
    let mut child = cmd.spawn().with_context(|| format!("starting {cmd:?}"))?;
    let stderr = child.stderr.take().context("piped stderr")?;
    let mut outcome = Outcome {
        log: log_path.clone(),
        command,
        ..Outcome::default()
    };
    for line in BufReader::new(stderr).split(b'\n') {
        let line = line?;
        log.write_all(&line)?;
        log.write_all(b"\n")?;
        outcome.read_line(&String::from_utf8_lossy(&line));
    }
    let status = child.wait()?;
    if outcome.seconds == 0 {
        // Stopped early (a crash): no `Done` line, so the time since the
        // start, build check included.
        outcome.seconds = started.elapsed().as_secs();
    }
    outcome.success = status.success() && outcome.problem.is_none();
    if !status.success() && outcome.problem.is_none() {
        outcome.problem = Some(format!("exited with {status}"));
    }
    (outcome.corpus_files, outcome.corpus_bytes) = corpus_size(&corpus)?;
    Ok(outcome)
}

impl Outcome {
    /// Takes what it can from one line of libFuzzer's (or cargo-fuzz's)
    /// output: status lines (`#1234 NEW cov: 56 ft: 78 corp: ...`), the
    /// final statistics (`stat::number_of_executed_units: 1234`), what went
    /// wrong (`==1== ERROR: libFuzzer: timeout after 10 seconds`) and where
    /// the input was saved (`Test unit written to <path>`).
    fn read_line(&mut self, line: &str) {
        let line = line.trim();
        if let Some(hash) = line.strip_prefix('#')
            && let Some(executions) = hash.split_whitespace().next().and_then(|n| n.parse().ok())
        {
            self.executions = Some(executions);
            let mut words = line.split_whitespace();
            while let Some(word) = words.next() {
                let value = || words.clone().next().and_then(|v| v.parse().ok());
                match word {
                    "cov:" => self.cov = value().or(self.cov),
                    "ft:" => self.ft = value().or(self.ft),
                    _ => {}
                }
            }
        }
        if let Some(stat) = line.strip_prefix("stat::")
            && let Some((stat, value)) = stat.split_once(':')
            && let Ok(value) = value.trim().parse::<u64>()
        {
            match stat {
                "number_of_executed_units" => self.executions = Some(value),
                "average_exec_per_sec" => self.exec_per_sec = Some(value),
                "peak_rss_mb" => self.peak_rss_mb = Some(value),
                _ => {}
            }
        }
        // `Done 123456 runs in 601 second(s)`: the fuzzing time, without
        // the build and the wait for cargo's lock.
        if let Some(rest) = line.strip_prefix("Done ")
            && let Some((_, secs)) = rest.split_once(" runs in ")
            && let Some(secs) = secs.split_whitespace().next().and_then(|s| s.parse().ok())
        {
            self.seconds = secs;
        }
        if let Some((_, error)) = line.split_once("ERROR: libFuzzer: ") {
            self.problem.get_or_insert_with(|| error.to_string());
        }
        if let Some((_, error)) = line.split_once("ERROR: AddressSanitizer: ") {
            self.problem.get_or_insert_with(|| error.to_string());
        }
        if line.starts_with("thread '") && line.contains("panicked at") {
            self.problem
                .get_or_insert_with(|| line.trim_end_matches(':').to_string());
        }
        if let Some((_, path)) = line.split_once("Test unit written to ") {
            self.artifact = Some(PathBuf::from(path.trim()));
        }
    }
}

/// Targets that need files (the perf map reader's fake procfs) make them
/// as `stackscope-fuzz-*-<pid>` under `/dev/shm` or `$TMPDIR`; libFuzzer
/// exits without unwinding, so they are removed here: those of processes
/// that are gone, not those of a target another `cargo xtask fuzz` is
/// running (removing them made its target fail on its own fake files).
fn remove_scratch() {
    let dirs = [PathBuf::from("/dev/shm"), std::env::temp_dir()];
    for entry in dirs
        .iter()
        .filter_map(|dir| std::fs::read_dir(dir).ok())
        .flatten()
        .flatten()
    {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("stackscope-fuzz-") && !owner_is_running(&name) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Whether the process whose id ends a scratch folder's name still runs.
fn owner_is_running(name: &str) -> bool {
    name.rsplit_once('-')
        .and_then(|(_, pid)| pid.parse::<u32>().ok())
        .is_some_and(|pid| Path::new(&format!("/proc/{pid}")).exists())
}

/// Files and bytes in a corpus folder.
fn corpus_size(dir: &Path) -> anyhow::Result<(usize, u64)> {
    let mut files = 0;
    let mut bytes = 0;
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let meta = entry?.metadata()?;
        if meta.is_file() {
            files += 1;
            bytes += meta.len();
        }
    }
    Ok((files, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scratch_folders_of_running_fuzzers_are_kept() {
        let own = format!("stackscope-fuzz-perf-map-{}", std::process::id());
        assert!(owner_is_running(&own));
        // Beyond pid_max (at most 2^22): never a running process.
        assert!(!owner_is_running("stackscope-fuzz-perf-map-4294967295"));
        assert!(!owner_is_running("stackscope-fuzz-perf-map"));
    }

    /// Every target's source exists and its fuzz crate declares it, and
    /// every target a fuzz crate declares is listed here.
    #[test]
    fn the_list_matches_the_fuzz_crates() {
        let root = workspace_root();
        let mut crates: Vec<&str> = TARGETS.iter().map(|t| t.krate).collect();
        crates.dedup();
        for krate in crates {
            let manifest = std::fs::read_to_string(root.join(krate).join("fuzz/Cargo.toml"))
                .unwrap_or_else(|err| panic!("{krate}/fuzz/Cargo.toml: {err}"));
            let declared: Vec<&str> = manifest
                .lines()
                .filter_map(|line| line.strip_prefix("name = \""))
                .filter_map(|rest| rest.strip_suffix('"'))
                .skip(1)
                .collect();
            let listed: Vec<&str> = TARGETS
                .iter()
                .filter(|t| t.krate == krate)
                .map(|t| t.name)
                .collect();
            assert_eq!(declared, listed, "{krate}/fuzz/Cargo.toml");
            for name in listed {
                let source = root
                    .join(krate)
                    .join(format!("fuzz/fuzz_targets/{name}.rs"));
                assert!(source.exists(), "{} is missing", source.display());
            }
        }
    }

    #[test]
    fn reads_libfuzzer_output() {
        let mut outcome = Outcome::default();
        for line in [
            "#2\tINITED cov: 10 ft: 11 corp: 1/1b exec/s: 0 rss: 30Mb",
            "#4096\tpulse  cov: 120 ft: 300 corp: 20/400b lim: 40 exec/s: 2048 rss: 40Mb",
            "#123456\tDONE   cov: 130 ft: 310 corp: 22/410b lim: 4096 exec/s: 2057 rss: 41Mb",
            "Done 123456 runs in 60 second(s)",
            "stat::number_of_executed_units: 123456",
            "stat::average_exec_per_sec:     2057",
            "stat::peak_rss_mb:              41",
        ] {
            outcome.read_line(line);
        }
        assert_eq!(outcome.executions, Some(123456));
        assert_eq!(outcome.exec_per_sec, Some(2057));
        assert_eq!((outcome.cov, outcome.ft), (Some(130), Some(310)));
        assert_eq!(outcome.peak_rss_mb, Some(41));
        assert_eq!(outcome.seconds, 60);
        assert_eq!(outcome.problem, None);

        let mut crashed = Outcome::default();
        for line in [
            "#77\tNEW    cov: 50 ft: 60 corp: 3/30b lim: 4 exec/s: 0 rss: 30Mb L: 4/4 MS: 1 ChangeBit-",
            "thread '<unnamed>' panicked at src/lib.rs:10:5:",
            "==12== ERROR: libFuzzer: deadly signal",
            "artifact_prefix='/w/fuzz/artifacts/t/'; Test unit written to /w/fuzz/artifacts/t/crash-abc",
        ] {
            crashed.read_line(line);
        }
        assert_eq!(crashed.cov, Some(50));
        assert_eq!(
            crashed.problem.as_deref(),
            Some("thread '<unnamed>' panicked at src/lib.rs:10:5")
        );
        assert_eq!(
            crashed.artifact,
            Some(PathBuf::from("/w/fuzz/artifacts/t/crash-abc"))
        );
    }
}
