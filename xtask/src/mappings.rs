//! `cargo xtask bench mappings`: what learning mappings as they are made
//! costs. The agent (release build, 99 Hz) runs with its mapping events and
//! without them (`--no-mapping-events`), and nothing runs beside the
//! workload for the baseline:
//!
//! - per fork+exec and per executable mmap: `churn.c` forks and execs
//!   `/bin/true` (each exec maps the program, ld.so, the vDSO and libc), and
//!   maps and unmaps a file executable, timed in the process itself;
//! - the agent's CPU per sample on a node busy with short processes
//!   (`spawner.c` starting `short_lived.c` 200 times a second) against the
//!   same node busy with long-running ones (`busy.c`, a thread per CPU).
//!
//! Each figure is the median of `repeats` runs with its spread. It prints
//! figures and never fails on them.

use std::{
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use crate::{
    KillOnDrop,
    bench::compile_fixture,
    cargo,
    overhead::{show, spread, wait_rusage},
    workspace_root,
};

/// Sampling rate of the agent in every run.
const HZ: &str = "99";

/// Fork+execs and mmaps timed per run.
const EXECS: &str = "2000";
const MMAPS: &str = "200000";

/// How the agent runs beside the workload.
#[derive(Clone, Copy, PartialEq)]
enum Agent {
    None,
    Events,
    ProcOnly,
}

impl Agent {
    fn name(self) -> &'static str {
        match self {
            Self::None => "no agent",
            Self::Events => "agent, mapping events",
            Self::ProcOnly => "agent, /proc only",
        }
    }
}

/// Starts the agent for `seconds` (none for [`Agent::None`]) and gives it
/// time to attach.
fn start_agent(agent: &Path, which: Agent, seconds: u64) -> anyhow::Result<Option<Child>> {
    if which == Agent::None {
        return Ok(None);
    }
    let mut command = Command::new(agent);
    command
        .args(["--frequency", HZ, "--duration", &format!("{seconds}s")])
        .args(["--status-interval", "1h", "--log-level", "error"])
        .args(["--json", "--no-table-cache"])
        .stdout(Stdio::piped());
    if which == Agent::ProcOnly {
        command.arg("--no-mapping-events");
    }
    let child = command.spawn().context("starting the agent")?;
    // Loading and attaching the program takes well under a second here;
    // what is timed must run while the agent samples.
    std::thread::sleep(Duration::from_millis(1500));
    Ok(Some(child))
}

/// The agent's CPU time and samples, once it has stopped on its own.
fn finish_agent(mut child: Child) -> anyhow::Result<(Duration, u64)> {
    let mut stdout = String::new();
    std::io::Read::read_to_string(child.stdout.as_mut().context("stdout")?, &mut stdout)?;
    let exit = wait_rusage(&mut child)?;
    if !exit.success {
        bail!("the agent failed");
    }
    let report: serde_json::Value =
        serde_json::from_str(&stdout).context("the agent's JSON report")?;
    let samples = report["kernel"]["samples"]
        .as_u64()
        .context("no kernel.samples in the report")?;
    Ok((exit.cpu, samples))
}

/// Runs `churn ARGS` under `which` and returns the cost it printed.
fn churn(agent: &Path, churn: &Path, which: Agent, args: &[&str]) -> anyhow::Result<f64> {
    let running = start_agent(agent, which, 3600)?.map(KillOnDrop);
    let out = Command::new(churn)
        .args(args)
        .output()
        .context("running churn")?;
    drop(running);
    if !out.status.success() {
        bail!("churn {args:?} failed");
    }
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .context("churn printed no figure")
}

pub fn run(seconds: u64, repeats: usize) -> anyhow::Result<()> {
    if seconds < 3 || repeats == 0 {
        bail!("--seconds must be at least 3 and --repeats at least 1");
    }
    cargo(&["build", "--release", "--package", "stackscope-agent"])?;
    let agent = workspace_root().join("target/release/stackscope-agent");
    let churn_bin = compile_fixture("churn")?;
    let spawner = compile_fixture("spawner")?;
    let short_lived = compile_fixture("short_lived")?;
    let busy = compile_fixture("busy")?;
    let libc_path = own_libc()?;
    let libc_path = libc_path.as_str();
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());

    println!("mapping events benchmark: {repeats} runs each, agent at {HZ} Hz on {cpus} CPUs");
    let agents = [Agent::None, Agent::Events, Agent::ProcOnly];
    let mut exec_costs = Vec::new();
    let mut mmap_costs = Vec::new();
    for which in agents {
        let mut execs = Vec::new();
        let mut mmaps = Vec::new();
        for _ in 0..repeats {
            execs.push(churn(&agent, &churn_bin, which, &["exec", EXECS])?);
            mmaps.push(churn(
                &agent,
                &churn_bin,
                which,
                &["mmap", MMAPS, libc_path],
            )?);
        }
        exec_costs.push(spread(execs));
        mmap_costs.push(spread(mmaps));
    }
    println!(
        "\n{:<24}  {:>28}  {:>28}",
        "", "fork+exec+wait", "mmap+munmap (exec)"
    );
    for (i, which) in agents.iter().enumerate() {
        println!(
            "{:<24}  {:>28}  {:>28}",
            which.name(),
            show(exec_costs[i], " µs"),
            show(mmap_costs[i], " ns"),
        );
    }
    let events_exec = exec_costs[1].0 - exec_costs[2].0;
    let events_mmap = mmap_costs[1].0 - mmap_costs[2].0;
    println!(
        "mapping events cost (events minus /proc only, medians): {events_exec:+.1} µs per \
         fork+exec, {events_mmap:+.0} ns per executable mmap"
    );

    println!(
        "\nagent CPU per sample, {seconds} s runs: short processes (spawner: short_lived \
         200/s, 2-20 ms each) vs long-running ones (busy, {cpus} threads)"
    );
    for which in [Agent::Events, Agent::ProcOnly] {
        let mut short = Vec::new();
        let mut long = Vec::new();
        for _ in 0..repeats {
            short.push(agent_cpu_per_sample(&agent, which, seconds, || {
                Command::new(&spawner)
                    .arg(&short_lived)
                    .args(["200", &(seconds + 3).to_string()])
                    .stdout(Stdio::null())
                    .spawn()
                    .context("starting the spawner")
            })?);
            long.push(agent_cpu_per_sample(&agent, which, seconds, || {
                Command::new(&busy)
                    .args([cpus.to_string(), (seconds + 3).to_string()])
                    .stdout(Stdio::null())
                    .spawn()
                    .context("starting busy")
            })?);
        }
        let (short, long) = (spread(short), spread(long));
        println!(
            "{:<24}  short-lived {}  long-running {}  ratio {:.2}",
            which.name(),
            show(short, " µs"),
            show(long, " µs"),
            short.0 / long.0.max(1e-9)
        );
    }
    println!(
        "(µs per sample: the agent's user + system time over its whole run, start-up \
         included, divided by the samples the kernel took)"
    );
    Ok(())
}

/// Runs the agent for `seconds` beside the workload `start` starts and
/// returns the agent's CPU per sample in µs.
fn agent_cpu_per_sample(
    agent: &Path,
    which: Agent,
    seconds: u64,
    start: impl FnOnce() -> anyhow::Result<Child>,
) -> anyhow::Result<f64> {
    let workload = KillOnDrop(start()?);
    let started = Instant::now();
    let child = start_agent(agent, which, seconds)?.context("an agent")?;
    let (cpu, samples) = finish_agent(child)?;
    drop(workload);
    if started.elapsed() < Duration::from_secs(seconds) {
        bail!("the agent stopped early");
    }
    Ok(cpu.as_secs_f64() * 1e6 / samples.max(1) as f64)
}

/// The C library this process maps: an executable file churn can map too.
fn own_libc() -> anyhow::Result<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").context("reading own maps")?;
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| path.contains("/libc.so"))
        .map(str::to_string)
        .context("no libc in this process's maps")
}
