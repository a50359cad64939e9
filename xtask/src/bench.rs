//! Benchmarks: they print figures and compare them with the targets; they never
//! fail on a figure (timing belongs in reports, not in tests). `sampler` drives
//! the agent; `unwind` runs the unwinder's criterion benches; `collector`
//! loads the collector's storage with a synthetic fleet.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
};

use anyhow::{Context as _, bail};
use clap::Subcommand;

use crate::{cargo, run_checked, workspace_root};

#[derive(Debug, Subcommand)]
pub enum Bench {
    /// BPF cost per sample at 4, 16 and 32 KiB stack copies (kernel bpf_stats),
    /// and the drop rate at 997 Hz with every CPU busy.
    Sampler {
        /// How long each measurement runs.
        #[arg(long, default_value = "10s")]
        duration: String,
    },
    /// Unwind table compile time and heap bytes (libc, and the nightly
    /// toolchain's librustc_driver and libLLVM), and the cost per stack of
    /// unwinding recorded samples of a deep-stack program, side by side with
    /// framehop 0.16 on the same inputs (criterion, `unwind/benches/`).
    Unwind,
    /// Collector ingest rate (samples/s and batches/s on one core) and
    /// flamegraph query latency (p50, p95) over an hour of synthetic fleet
    /// data: 100 nodes, 2,000 stacks of depth 30 each per 10 s.
    Collector {
        /// Simulated nodes.
        #[arg(long, default_value_t = 100)]
        nodes: u32,
        /// Minutes of data to ingest before querying.
        #[arg(long, default_value_t = 60)]
        minutes: u32,
    },
}

pub fn run(which: Bench) -> anyhow::Result<()> {
    match which {
        Bench::Sampler { duration } => sampler(&duration),
        Bench::Unwind => unwind(),
        Bench::Collector { nodes, minutes } => run_checked(
            Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
                .args([
                    "bench",
                    "--package",
                    "stackscope-collector",
                    "--bench",
                    "collector",
                ])
                .current_dir(workspace_root())
                .env("STACKSCOPE_BENCH_NODES", nodes.to_string())
                .env("STACKSCOPE_BENCH_MINUTES", minutes.to_string()),
        ),
    }
}

/// Runs the criterion benches of `stackscope-unwind` with their output passed
/// through, then prints the headlines they wrote to `STACKSCOPE_BENCH_REPORT`.
fn unwind() -> anyhow::Result<()> {
    // Per process, so two runs at once do not read each other's summary.
    let summary = std::env::temp_dir().join(format!(
        "stackscope-unwind-bench-{}.txt",
        std::process::id()
    ));
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let result = run_checked(
        Command::new(cargo)
            // Every bench target, not the library: its unit tests would only
            // print themselves as ignored.
            .args(["bench", "--package", "stackscope-unwind", "--bench", "*"])
            .current_dir(workspace_root())
            .env("STACKSCOPE_BENCH_REPORT", &summary),
    );
    let text = std::fs::read_to_string(&summary);
    let _ = std::fs::remove_file(&summary);
    result?;
    let text = text.with_context(|| {
        format!(
            "the benchmark wrote no summary to {} (criterion filtered or in --test mode?)",
            summary.display()
        )
    })?;
    println!("\nunwind benchmark summary:");
    for line in text.lines() {
        println!("  {line}");
    }
    Ok(())
}

/// Recursion depth of the fixture: deep enough (about 100 KiB of stack) that
/// every copy limit is reached, so the figures compare full copies.
const DEEP_STACK_DEPTH: &str = "2000";

fn sampler(duration: &str) -> anyhow::Result<()> {
    cargo(&["build", "--release", "--package", "stackscope-agent"])?;
    let agent = workspace_root().join("target/release/stackscope-agent");
    let fixture = compile_fixture("deep_stack")?;
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());

    // One spinning deep-stack process per CPU, so (almost) every tick samples one.
    let spinners: Vec<KillOnDrop> = (0..cpus)
        .map(|_| {
            Command::new(&fixture)
                .arg(DEEP_STACK_DEPTH)
                .stdout(Stdio::null())
                .spawn()
                .map(KillOnDrop)
                .context("starting the fixture")
        })
        .collect::<anyhow::Result<_>>()?;
    let pids: Vec<String> = spinners.iter().map(|s| s.0.id().to_string()).collect();

    println!(
        "sampler benchmark: {cpus} CPUs, {cpus} spinning processes of stack depth {DEEP_STACK_DEPTH}, {duration} per run"
    );
    println!(
        "{:>12}  {:>9}  {:>9}  {:>12}  {:>11}  {:>8}",
        "stack limit", "frequency", "samples", "bytes/sample", "ns/BPF run", "dropped"
    );
    // 8 bytes: the fixed cost of a sampled tick, with next to nothing copied.
    for stack_bytes in [8, 4096, 16384, 32768] {
        let report = run_agent(&agent, &pids, 997, stack_bytes, duration)?;
        println!(
            "{:>9} B    {:>6} Hz  {:>9}  {:>12.0}  {:>11}  {:>8}",
            stack_bytes,
            997,
            report.samples,
            report.bytes as f64 / report.records.max(1) as f64,
            report.ns_per_run,
            report.dropped,
        );
    }
    let unfiltered = run_agent(&agent, &[], 997, 16384, duration)?;
    let drop_rate =
        unfiltered.dropped as f64 / (unfiltered.samples + unfiltered.dropped).max(1) as f64;
    println!(
        "unfiltered, 997 Hz, 16 KiB: {} samples, {} dropped ({:.3}%), {} ns per BPF run",
        unfiltered.samples,
        unfiltered.dropped,
        100.0 * drop_rate,
        unfiltered.ns_per_run
    );
    println!("targets: at most 2000 ns per sample at 16 KiB; no drops at 997 Hz on {cpus} CPUs");
    Ok(())
}

#[derive(Debug)]
struct AgentReport {
    samples: u64,
    dropped: u64,
    records: u64,
    bytes: u64,
    ns_per_run: u64,
}

fn run_agent(
    agent: &Path,
    pids: &[String],
    hz: u32,
    stack_bytes: u32,
    duration: &str,
) -> anyhow::Result<AgentReport> {
    let mut cmd = Command::new(agent);
    cmd.args([
        "--frequency",
        &hz.to_string(),
        "--stack-bytes",
        &stack_bytes.to_string(),
    ])
    .args([
        "--duration",
        duration,
        "--status-interval",
        "1h",
        "--bpf-stats",
        "--json",
        "--log-level",
        "warn",
    ]);
    for pid in pids {
        cmd.args(["--pid", pid]);
    }
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed with {}", out.status);
    }
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "the agent's --json report is not JSON: {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })?;
    let field = |section: &str, name: &str| -> anyhow::Result<u64> {
        report[section][name]
            .as_u64()
            .with_context(|| format!("no {section}.{name} in the agent's report: {report}"))
    };
    Ok(AgentReport {
        samples: field("kernel", "samples")?,
        dropped: field("kernel", "ring_buffer_full")?,
        records: field("reader", "records")?,
        bytes: field("reader", "bytes")?,
        ns_per_run: field("bpf", "ns_per_run")?,
    })
}

/// Compiles `tests/fixtures/<name>.c` without frame pointers into `target/fixtures/`.
fn compile_fixture(name: &str) -> anyhow::Result<PathBuf> {
    let root = workspace_root();
    let source = root.join(format!("tests/fixtures/{name}.c"));
    let out_dir = root.join("target/fixtures");
    std::fs::create_dir_all(&out_dir)?;
    let binary = out_dir.join(name);
    run_checked(
        Command::new("gcc")
            .args(["-O2", "-g", "-fomit-frame-pointer", "-o"])
            .arg(&binary)
            .arg(&source),
    )?;
    Ok(binary)
}

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
