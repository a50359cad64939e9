//! `cargo xtask bench off-cpu`: what off-CPU profiling costs the profiled,
//! and how true its estimated totals stay.
//!
//! Two context-switch-heavy workloads (`tests/fixtures/switch_heavy.c`): a
//! pipe ping-pong between two processes and a mutex-contended thread pool.
//! Each runs alone, under the agent sampling CPU only (19 Hz, the
//! DaemonSet's rate), and under the agent with `--off-cpu` at its default
//! rate, in alternating order; the throughput of each against the runs
//! alone is the cost. Then the off-CPU program's own cost per context
//! switch (kernel BPF statistics) with the workload's threads selected and
//! with another process selected, and the blocked time the agent estimates
//! at its default rate for `tests/fixtures/off_cpu.c` against what the
//! fixture measured itself.

use std::{
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, bail};

use crate::{KillOnDrop, bench::compile_fixture, cargo, workspace_root};

/// How long the agent runs before a workload starts (it loads and
/// attaches its programs meanwhile).
const AGENT_WARMUP: Duration = Duration::from_secs(3);

pub fn run(seconds: u64, repeats: usize) -> anyhow::Result<()> {
    cargo(&["build", "--release", "--package", "stackscope-agent"])?;
    let agent = workspace_root().join("target/release/stackscope-agent");
    let workload = compile_fixture("switch_heavy")?;
    let fixture = compile_fixture("off_cpu")?;
    let seconds_arg = seconds.to_string();
    let threads = (2 * std::thread::available_parallelism().map_or(2, |n| n.get())).to_string();
    let workloads: [(&str, Vec<&str>); 2] = [
        (
            "pipe ping-pong (round trips/s)",
            vec!["pingpong", &seconds_arg],
        ),
        (
            "mutex pool (acquisitions/s)",
            vec!["mutex", &threads, &seconds_arg],
        ),
    ];
    println!("off-CPU benchmark: {seconds} s per run, {repeats} runs per configuration");
    println!(
        "{:<32}  {:>12}  {:>12}  {:>8}  {:>12}  {:>8}",
        "workload", "alone", "CPU only", "vs alone", "--off-cpu", "vs alone"
    );
    for (name, args) in &workloads {
        let (mut alone, mut cpu, mut off_cpu) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..repeats {
            alone.push(throughput(&workload, args, None)?);
            cpu.push(throughput(&workload, args, Some((&agent, &[][..])))?);
            off_cpu.push(throughput(
                &workload,
                args,
                Some((&agent, &["--off-cpu"][..])),
            )?);
        }
        let (alone, cpu, off_cpu) = (median(alone), median(cpu), median(off_cpu));
        println!(
            "{name:<32}  {alone:>12.0}  {cpu:>12.0}  {:>7.1}%  {off_cpu:>12.0}  {:>7.1}%",
            100.0 * (cpu / alone - 1.0),
            100.0 * (off_cpu / alone - 1.0),
        );
    }

    println!();
    println!("the off-CPU program's cost per context switch (ping-pong, --bpf-stats)");
    // An idle process: selecting it leaves every switch of the workload
    // unselected, but the program still runs on each.
    let mut idle = KillOnDrop(
        Command::new("sleep")
            .arg("1000")
            .spawn()
            .context("starting sleep")?,
    );
    let idle_pid = idle.0.id().to_string();
    for (selection, extra) in [
        ("every thread selected", vec!["--off-cpu"]),
        (
            "no thread selected",
            vec!["--off-cpu", "--pid", idle_pid.as_str()],
        ),
    ] {
        let report = under_agent(&workload, &workloads[0].1, &agent, &extra, true)?.1;
        let off = &report["off_cpu"];
        let kernel = &report["kernel"];
        println!(
            "  {selection:<24} {:>6} ns per switch ({} runs), {} blocking switches seen, {} sampled",
            off["bpf_ns_per_switch"],
            off["bpf_runs"],
            kernel["off_cpu_switches"],
            kernel["off_cpu_samples"],
        );
    }
    let _ = idle.0.kill();

    println!();
    println!("estimated blocked time at the default rate (tests/fixtures/off_cpu.c, 5 s)");
    let (estimated, measured, report) = estimate(&agent, &fixture)?;
    println!(
        "  agent {:.3} s, fixture {:.3} s: {:+.1}% ({} of {} blocking switches sampled)",
        estimated / 1e9,
        measured / 1e9,
        100.0 * (estimated / measured - 1.0),
        report["kernel"]["off_cpu_samples"],
        report["kernel"]["off_cpu_switches"],
    );
    Ok(())
}

/// The workload's throughput, alone or under `agent` with `extra` args.
fn throughput(
    workload: &Path,
    args: &[&str],
    agent: Option<(&Path, &[&str])>,
) -> anyhow::Result<f64> {
    match agent {
        None => run_workload(workload, args),
        Some((agent, extra)) => Ok(under_agent(workload, args, agent, extra, false)?.0),
    }
}

/// Runs the workload under the agent (whole host, 19 Hz, no collector):
/// its throughput and the agent's report.
fn under_agent(
    workload: &Path,
    args: &[&str],
    agent: &Path,
    extra: &[&str],
    bpf_stats: bool,
) -> anyhow::Result<(f64, serde_json::Value)> {
    let seconds: u64 = args.last().and_then(|s| s.parse().ok()).unwrap_or(10);
    let duration = AGENT_WARMUP.as_secs() + seconds + 2;
    let mut command = Command::new(agent);
    command
        .args(["--duration", &format!("{duration}s"), "--json"])
        .args(["--log-level", "warn", "--status-interval", "1h"])
        .args(extra)
        .stdout(Stdio::piped());
    if bpf_stats {
        command.arg("--bpf-stats");
    }
    let child = KillOnDrop(command.spawn().context("starting the agent")?);
    std::thread::sleep(AGENT_WARMUP);
    let throughput = run_workload(workload, args)?;
    let report = agent_report(child)?;
    Ok((throughput, report))
}

fn run_workload(workload: &Path, args: &[&str]) -> anyhow::Result<f64> {
    let out = Command::new(workload)
        .args(args)
        .output()
        .with_context(|| format!("running {}", workload.display()))?;
    if !out.status.success() {
        bail!("{} {args:?} failed with {}", workload.display(), out.status);
    }
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .context("the workload's throughput")
}

/// Waits for the agent to end and parses its `--json` report.
fn agent_report(mut child: KillOnDrop) -> anyhow::Result<serde_json::Value> {
    let mut stdout = child.0.stdout.take().context("the agent's stdout")?;
    let mut text = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut text)?;
    let status = child.0.wait()?;
    if !status.success() {
        bail!("the agent exited with {status}");
    }
    serde_json::from_str(&text).context("the agent's --json report")
}

/// The blocked time the agent (default rate, the fixture selected)
/// counts for the off_cpu fixture, what the fixture measured, and the
/// agent's report.
fn estimate(agent: &Path, fixture: &Path) -> anyhow::Result<(f64, f64, serde_json::Value)> {
    let mut child = Command::new(fixture)
        .arg("5")
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the off_cpu fixture")?;
    let stdout = child.stdout.take().context("the fixture's stdout")?;
    let fixture_process = KillOnDrop(child);
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stdout));
    if lines.next().transpose()?.as_deref() != Some("ready") {
        bail!("the off_cpu fixture did not start");
    }
    let pid = fixture_process.0.id();
    let agent = KillOnDrop(
        Command::new(agent)
            .args(["--off-cpu", "--pid", &pid.to_string()])
            .args(["--duration", "10s", "--json", "--log-level", "warn"])
            .args(["--status-interval", "1h"])
            .stdout(Stdio::piped())
            .spawn()
            .context("starting the agent")?,
    );
    std::thread::sleep(AGENT_WARMUP);
    // SAFETY: a signal to our own child.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGUSR1) };
    let mut measured = 0u64;
    for line in lines {
        let line = line?;
        if line == "done" {
            break;
        }
        if let Some((_, nanos)) = line.split_once(' ') {
            measured += nanos.parse::<u64>().context("the fixture's figures")?;
        }
    }
    let report = agent_report(agent)?;
    // Weighed by their divisor, as the collector counts them.
    let estimated = report["off_cpu"]["weighted_blocked_ns"]
        .as_u64()
        .context("no off_cpu.weighted_blocked_ns in the agent's report")?;
    drop(fixture_process);
    Ok((estimated as f64, measured as f64, report))
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}
