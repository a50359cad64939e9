//! Benchmarks: they print figures and compare them with the targets; they never
//! fail on a figure (timing belongs in reports, not in tests). `sampler` drives
//! the agent; `mappings` (in `mappings.rs`) costs the mapping events; `filter` measures the agent's in-kernel cgroup filter on busy
//! processes in cgroups of their own; `unwind` runs the unwinder's criterion
//! benches; `collector` loads the collector's storage with a synthetic fleet;
//! `programs` (in `programs.rs`) runs the product on real programs.

use std::{
    io::Read as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use clap::Subcommand;

use crate::{KillOnDrop, cargo, run_checked, workspace_root};

#[derive(Debug, Subcommand)]
pub enum Bench {
    /// BPF cost per sampled tick (kernel bpf_stats) and user stack bytes
    /// read per sample, adaptive copies and stack tails against the fixed
    /// 16 KiB copy, on a shallow (busy.c) and a deep (1 MiB) workload; the
    /// fixed cost of a tick, and the drop rate at 997 Hz with every CPU busy.
    Sampler {
        /// How long each measurement runs.
        #[arg(long, default_value = "10s")]
        duration: String,
    },
    /// What profiling costs the profiled: a CPU-bound workload (busy.c, one
    /// thread per CPU, no frame pointers; or `xz -9`, one per CPU) alone,
    /// under stackscope (agent + collector) and under `perf record
    /// --call-graph dwarf` + `perf report`, at 19, 99 and 997 Hz: throughput
    /// loss, CPU per sample, peak RSS, share reaching the root, top
    /// functions; then the agent's cost on an idle host over 60 s.
    Overhead {
        /// How long the workload runs each time (at least 25: the steady
        /// window starts after the agent's first 10 s batch).
        #[arg(long, default_value_t = 30)]
        seconds: u64,
        /// Runs per configuration (medians and spread are reported).
        #[arg(long, default_value_t = 3)]
        repeats: usize,
        /// Another build's release binaries (a `target/release` folder):
        /// compares this build's agent against that one's, run after run
        /// in alternating order, instead of against perf.
        #[arg(long, value_name = "DIR")]
        baseline: Option<std::path::PathBuf>,
        /// busy: deep stacks, nearly all new (busy.c); xz: shallow ones that
        /// repeat, in a compressor that sweeps hundreds of MB.
        #[arg(long, value_enum, default_value_t = crate::overhead::WorkloadKind::Busy)]
        workload: crate::overhead::WorkloadKind,
        /// The sampling rates compared, in Hz (the idle figure is measured
        /// only with all three).
        #[arg(long, value_delimiter = ',', default_values_t = crate::overhead::RATES)]
        rates: Vec<u32>,
    },
    /// What off-CPU profiling costs the profiled: a pipe ping-pong between
    /// two processes and a mutex-contended thread pool alone, under the
    /// agent sampling CPU only and with `--off-cpu` at its default rate;
    /// the off-CPU program's cost per context switch, selected and not; and
    /// the blocked time estimated at the default rate against a fixture's
    /// own measure.
    OffCpu {
        /// How long each workload runs.
        #[arg(long, default_value_t = 10)]
        seconds: u64,
        /// Runs per configuration (medians are reported).
        #[arg(long, default_value_t = 3)]
        repeats: usize,
    },
    /// What learning mappings as they are made costs: per fork+exec and
    /// per executable mmap with the agent's mapping events on, off, and no
    /// agent; the agent's CPU per sample on short-lived processes (200 a
    /// second) against long-running ones.
    Mappings {
        /// How long each agent CPU run samples.
        #[arg(long, default_value_t = 10)]
        seconds: u64,
        /// Runs per configuration (medians and spread are reported).
        #[arg(long, default_value_t = 3)]
        repeats: usize,
    },
    /// In-kernel cgroup filtering: 20 busy processes, each in its own cgroup2
    /// child of one parent; the agent at 997 Hz selecting 1 of 20 cgroups,
    /// all of them, and an empty cgroup (every tick filtered out). Reports
    /// the BPF program's cost per run and the agent's own CPU time.
    Filter {
        /// How long each of the three agent runs samples.
        #[arg(long, default_value_t = 20)]
        seconds: u64,
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
        /// The storage's bucket width in seconds (the collector's
        /// --bucket): the finest a timeline shows, against more rows.
        #[arg(long, default_value_t = 60)]
        bucket_secs: u32,
    },
    /// The product on real programs (python3, java, node, sqlite3, xz, a
    /// stripped Go program, a deep C program, and loops of gcc and rustc
    /// runs), each in a cgroup of its own: the share of samples unwound to
    /// the root, cut short, and of frames named, the agent's CPU per sample,
    /// and the share naming the program's own function.
    Programs {
        /// How long the agent samples each program.
        #[arg(long, default_value_t = 20)]
        seconds: u64,
        /// Only these programs (by the name in the first column), to chase
        /// one row; all of them when none is named.
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
    },
    /// Query-time naming in the collector: frames/s cold (debuginfo parsed)
    /// and warm (cached), and a whole flamegraph of 10,000 distinct stacks
    /// named from librustc_driver (148 MB), side by side with eu-addr2line
    /// and addr2line on the same addresses.
    Symbolize {
        /// Distinct stacks of depth 30 in the profile.
        #[arg(long, default_value_t = 10_000)]
        stacks: u32,
        /// Distinct code addresses among them.
        #[arg(long, default_value_t = 20_000)]
        addresses: u32,
    },
}

pub fn run(which: Bench) -> anyhow::Result<()> {
    match which {
        Bench::Sampler { duration } => sampler(&duration),
        Bench::Filter { seconds } => filter(seconds),
        Bench::Unwind => unwind(),
        Bench::Overhead {
            seconds,
            repeats,
            baseline,
            workload,
            rates,
        } => match baseline {
            Some(baseline) => {
                crate::overhead::against_baseline(seconds, repeats, &baseline, workload, &rates)
            }
            None => crate::overhead::run(seconds, repeats, workload, &rates),
        },
        Bench::Mappings { seconds, repeats } => crate::mappings::run(seconds, repeats),
        Bench::OffCpu { seconds, repeats } => crate::off_cpu::run(seconds, repeats),
        Bench::Programs { seconds, only } => crate::programs::run(seconds, &only),
        Bench::Symbolize { stacks, addresses } => collector_bench(
            "symbolize",
            &[
                ("STACKSCOPE_BENCH_STACKS", stacks),
                ("STACKSCOPE_BENCH_ADDRESSES", addresses),
            ],
        ),
        Bench::Collector {
            nodes,
            minutes,
            bucket_secs,
        } => collector_bench(
            "collector",
            &[
                ("STACKSCOPE_BENCH_NODES", nodes),
                ("STACKSCOPE_BENCH_MINUTES", minutes),
                ("STACKSCOPE_BENCH_BUCKET_SECS", bucket_secs),
            ],
        ),
    }
}

/// Runs `cargo bench` on the collector's bench `name` with its settings in
/// the environment.
fn collector_bench(name: &str, settings: &[(&str, u32)]) -> anyhow::Result<()> {
    let mut command = crate::cargo_command(&[
        "bench",
        "--package",
        "stackscope-collector",
        "--bench",
        name,
    ]);
    for (variable, value) in settings {
        command.env(variable, value.to_string());
    }
    run_checked(&mut command)
}

/// Runs the criterion benches of `stackscope-unwind` with their output passed
/// through, then prints the headlines they wrote to `STACKSCOPE_BENCH_REPORT`.
fn unwind() -> anyhow::Result<()> {
    // Per process, so two runs at once do not read each other's summary.
    let summary = std::env::temp_dir().join(format!(
        "stackscope-unwind-bench-{}.txt",
        std::process::id()
    ));
    // Every bench target, not the library: its unit tests would only print
    // themselves as ignored.
    let result = run_checked(
        crate::cargo_command(&["bench", "--package", "stackscope-unwind", "--bench", "*"])
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

fn sampler(duration: &str) -> anyhow::Result<()> {
    cargo(&["build", "--release", "--package", "stackscope-agent"])?;
    let agent = workspace_root().join("target/release/stackscope-agent");
    let busy = compile_fixture("busy")?;
    let deep = compile_fixture("deep_frames")?;
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());

    println!(
        "sampler benchmark: {cpus} CPUs, one spinning process per CPU, 997 Hz, {duration} per run"
    );
    println!(
        "{:<28}  {:<22}  {:>8}  {:>10}  {:>11}  {:>10}  {:>6}  {:>8}  {:>7}",
        "workload",
        "copy",
        "samples",
        "ns/BPF run",
        "user B/smpl",
        "record B",
        "root",
        "stitched",
        "dropped"
    );
    let workloads: [(&str, &Path, &[&str]); 2] = [
        ("busy.c (depth 30-60 + libc)", &busy, &[]),
        ("deep_frames (1 MiB deep)", &deep, &["1048576"]),
    ];
    let mut busy_ns = [0u64; 2];
    for (name, fixture, args) in workloads {
        // One spinning process per CPU, so (almost) every tick samples one.
        let spinners: Vec<KillOnDrop> = (0..cpus)
            .map(|_| {
                Command::new(fixture)
                    .args(args)
                    .stdout(Stdio::null())
                    .spawn()
                    .map(KillOnDrop)
                    .context("starting the fixture")
            })
            .collect::<anyhow::Result<_>>()?;
        let pids: Vec<String> = spinners.iter().map(|s| s.0.id().to_string()).collect();
        for (i, (copy, extra)) in [
            ("adaptive (ceiling 16 KiB)", &[][..]),
            ("fixed 16 KiB", &["--fixed-stack-copy"][..]),
        ]
        .into_iter()
        .enumerate()
        {
            let report = run_agent(&agent, &pids, 997, 16384, duration, extra)?;
            if name.starts_with("busy") {
                busy_ns[i] = report.ns_per_run;
            }
            println!(
                "{name:<28}  {copy:<22}  {:>8}  {:>10}  {:>11.0}  {:>10.0}  {:>5.1}%  {:>7.1}%  {:>7}",
                report.samples,
                report.ns_per_run,
                report.user_bytes as f64 / report.samples.max(1) as f64,
                report.bytes as f64 / report.records.max(1) as f64,
                100.0 * report.outermost as f64 / report.walks.max(1) as f64,
                100.0 * report.stitched as f64 / report.walks.max(1) as f64,
                report.dropped,
            );
        }
    }
    // 8 bytes: the fixed cost of a sampled tick, with next to nothing
    // copied; then every process on the host, with a spinner per CPU.
    let spinners: Vec<KillOnDrop> = (0..cpus)
        .map(|_| {
            Command::new(&busy)
                .stdout(Stdio::null())
                .spawn()
                .map(KillOnDrop)
                .context("starting the fixture")
        })
        .collect::<anyhow::Result<_>>()?;
    let minimal = run_agent(
        &agent,
        &[spinners[0].0.id().to_string()],
        997,
        8,
        duration,
        &["--fixed-stack-copy"],
    )?;
    println!(
        "fixed cost of a sampled tick (8-byte copy): {} ns per BPF run",
        minimal.ns_per_run
    );
    let unfiltered = run_agent(&agent, &[], 997, 16384, duration, &[])?;
    let drop_rate =
        unfiltered.dropped as f64 / (unfiltered.samples + unfiltered.dropped).max(1) as f64;
    println!(
        "unfiltered, 997 Hz, adaptive: {} samples, {} dropped ({:.3}%), {} ns per BPF run",
        unfiltered.samples,
        unfiltered.dropped,
        100.0 * drop_rate,
        unfiltered.ns_per_run
    );
    drop(spinners);
    println!(
        "busy.c: adaptive {} ns vs fixed 16 KiB {} ns per sampled tick (ratio {:.2}); \
         target: at most 2000 ns adaptive; no drops at 997 Hz on {cpus} CPUs",
        busy_ns[0],
        busy_ns[1],
        busy_ns[0] as f64 / busy_ns[1].max(1) as f64
    );
    python_frames(&agent, cpus, duration)
}

/// Interpreters the Python rows run, first found first: Debian's (a user's
/// `python3`), else pyenv's.
const PYTHONS: [&str; 2] = [
    "/usr/bin/python3.11",
    "/root/.pyenv/versions/3.12.1/bin/python3.12",
];

/// What reading CPython's frames adds to the BPF program: one Python
/// process per CPU at depths 10, 30 and 100, every frame a function of its
/// own (as in an application) or one function recursing, the agent with
/// its Python frames on and off (`--no-python-frames`), alternately, twice
/// each.
fn python_frames(agent: &Path, cpus: usize, duration: &str) -> anyhow::Result<()> {
    let Some(python) = PYTHONS.iter().map(Path::new).find(|path| path.exists()) else {
        println!("python frames: skipped, none of {PYTHONS:?} is installed");
        return Ok(());
    };
    let script = workspace_root().join("tests/fixtures/python_depth.py");
    println!(
        "python frames ({}, one process per CPU, 997 Hz): ns per BPF run with the frames read \
         and without (--no-python-frames), two runs each, alternately",
        python.display()
    );
    println!(
        "{:>6}  {:<9}  {:>14}  {:>14}  {:>10}  {:>13}",
        "depth", "functions", "ns/run frames", "ns/run without", "added ns", "frames/stack"
    );
    for (depth, functions) in [10, 30, 100]
        .into_iter()
        .flat_map(|depth| [(depth, "distinct"), (depth, "recursive")])
    {
        let spinners: Vec<KillOnDrop> = (0..cpus)
            .map(|_| {
                Command::new(python)
                    .arg(&script)
                    .args([depth.to_string().as_str(), functions])
                    .stdout(Stdio::null())
                    .spawn()
                    .map(KillOnDrop)
                    .context("starting python")
            })
            .collect::<anyhow::Result<_>>()?;
        let pids: Vec<String> = spinners.iter().map(|s| s.0.id().to_string()).collect();
        let (mut with, mut without, mut frames_per_stack) = (Vec::new(), Vec::new(), 0.0);
        for _ in 0..2 {
            let off = run_agent(agent, &pids, 997, 16384, duration, &["--no-python-frames"])?;
            without.push(off.ns_per_run as f64);
            let on = run_agent(agent, &pids, 997, 16384, duration, &[])?;
            with.push(on.ns_per_run as f64);
            frames_per_stack = on.python_frames as f64 / on.python_stacks.max(1) as f64;
        }
        let mean = |runs: &[f64]| runs.iter().sum::<f64>() / runs.len() as f64;
        println!(
            "{depth:>6}  {functions:<9}  {:>14.0}  {:>14.0}  {:>10.0}  {frames_per_stack:>13.1}",
            mean(&with),
            mean(&without),
            mean(&with) - mean(&without),
        );
    }
    println!("target: at most 1000 ns added per Python sample at depth 30");
    Ok(())
}

#[derive(Debug)]
struct AgentReport {
    samples: u64,
    dropped: u64,
    records: u64,
    bytes: u64,
    ns_per_run: u64,
    /// User stack bytes the program read (copies plus tails).
    user_bytes: u64,
    walks: u64,
    outermost: u64,
    stitched: u64,
    /// Python stack records the program wrote, and their frames.
    python_stacks: u64,
    python_frames: u64,
}

fn run_agent(
    agent: &Path,
    pids: &[String],
    hz: u32,
    stack_bytes: u32,
    duration: &str,
    extra: &[&str],
) -> anyhow::Result<AgentReport> {
    let mut cmd = Command::new(agent);
    cmd.args(extra);
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
        user_bytes: field("kernel", "user_stack_bytes")?,
        walks: field("unwinding", "walks")?,
        outermost: field("unwinding", "outermost")?,
        stitched: field("unwinding", "stitched")?,
        python_stacks: field("kernel", "python_stacks")?,
        python_frames: field("kernel", "python_frames")?,
    })
}

/// Busy processes of the filter benchmark, each in a cgroup of its own.
const FILTER_PROCESSES: usize = 20;
/// Sampling frequency of the filter benchmark's agent runs.
const FILTER_HZ: &str = "997";

/// Set by SIGINT/SIGTERM while the filter benchmark runs, so it stops
/// between steps and its guard still cleans up.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn note_interrupt(_signal: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

fn check_interrupted() -> anyhow::Result<()> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        bail!("interrupted");
    }
    Ok(())
}

/// Catches SIGINT and SIGTERM (setting [`INTERRUPTED`]) while it lives and
/// restores the previous handlers when dropped. Handlers reset to the default
/// across exec, so the agent still stops (and reports) on Ctrl-C.
struct InterruptGuard {
    previous: Vec<(libc::c_int, libc::sighandler_t)>,
}

impl InterruptGuard {
    fn install() -> Self {
        let handler = note_interrupt as extern "C" fn(libc::c_int) as libc::sighandler_t;
        let previous = [libc::SIGINT, libc::SIGTERM]
            .into_iter()
            // SAFETY: the handler only stores to an atomic, which is
            // async-signal-safe.
            .map(|signal| (signal, unsafe { libc::signal(signal, handler) }))
            .collect();
        Self { previous }
    }
}

impl Drop for InterruptGuard {
    fn drop(&mut self) {
        for &(signal, previous) in &self.previous {
            // SAFETY: restores the disposition that was there before.
            unsafe { libc::signal(signal, previous) };
        }
    }
}

/// What the filter benchmark creates, torn down on drop (error, Ctrl-C or
/// success alike): kills and reaps the busy processes, then removes the
/// cgroups (children before the parent) and the temporary directory.
struct FilterScene {
    temp_dir: PathBuf,
    /// Created cgroup directories, the parent first.
    cgroups: Vec<PathBuf>,
    busy: Vec<Child>,
}

impl FilterScene {
    fn new() -> anyhow::Result<Self> {
        let temp_dir =
            std::env::temp_dir().join(format!("stackscope-filter-bench-{}", std::process::id()));
        std::fs::create_dir_all(&temp_dir)
            .with_context(|| format!("creating {}", temp_dir.display()))?;
        Ok(Self {
            temp_dir,
            cgroups: Vec::new(),
            busy: Vec::new(),
        })
    }

    fn create_cgroup(&mut self, dir: PathBuf) -> anyhow::Result<PathBuf> {
        std::fs::create_dir(&dir).with_context(|| format!("creating cgroup {}", dir.display()))?;
        self.cgroups.push(dir.clone());
        Ok(dir)
    }

    /// Starts `program` and moves it into `cgroup` right away.
    fn spawn_in(&mut self, program: &Path, cgroup: &Path) -> anyhow::Result<()> {
        let child = Command::new(program)
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", program.display()))?;
        let pid = child.id();
        self.busy.push(child);
        let procs = cgroup.join("cgroup.procs");
        std::fs::write(&procs, pid.to_string())
            .with_context(|| format!("moving process {pid} into {}", procs.display()))
    }
}

impl Drop for FilterScene {
    fn drop(&mut self) {
        for child in &mut self.busy {
            let _ = child.kill();
        }
        for child in &mut self.busy {
            let _ = child.wait();
        }
        for dir in self.cgroups.iter().rev() {
            remove_cgroup(dir);
        }
        let _ = std::fs::remove_dir_all(&self.temp_dir);
    }
}

/// Removes an empty cgroup, waiting a little for its last tasks to go (it
/// reports EBUSY until they have); says so if it could not.
pub(crate) fn remove_cgroup(dir: &Path) {
    for attempt in 0.. {
        match std::fs::remove_dir(dir) {
            Ok(()) => return,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && attempt < 100 => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => {
                eprintln!("removing cgroup {}: {e}", dir.display());
                return;
            }
        }
    }
}

/// A cgroup made for a run: whatever is left in it is killed and it is
/// removed on drop.
pub(crate) struct Cgroup(pub(crate) PathBuf);

impl Cgroup {
    pub(crate) fn create(path: PathBuf) -> anyhow::Result<Self> {
        std::fs::create_dir(&path)
            .with_context(|| format!("creating cgroup {}", path.display()))?;
        Ok(Self(path))
    }

    /// Moves `pid` in; its children from then on are born there.
    pub(crate) fn enter(&self, pid: u32) -> anyhow::Result<()> {
        std::fs::write(self.0.join("cgroup.procs"), pid.to_string())
            .with_context(|| format!("moving {pid} into {}", self.0.display()))
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        stop_cgroup(&self.0);
        remove_cgroup(&self.0);
    }
}

/// How long a process, or what is left in a cgroup, has to exit on SIGTERM.
const STOP_GRACE: Duration = Duration::from_secs(3);

/// Stops `child` as [`stop_cgroup`] stops a cgroup's processes (SIGTERM,
/// then SIGKILL after [`STOP_GRACE`]) and reaps it.
pub(crate) fn stop_child(child: &mut Child) {
    let deadline = Instant::now() + STOP_GRACE;
    if let Ok(pid) = libc::pid_t::try_from(child.id()) {
        // SAFETY: plain syscall on our own unreaped child.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
    while Instant::now() < deadline {
        if !matches!(child.try_wait(), Ok(None)) {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Stops every process in the cgroup at `dir`: SIGTERM first, so that a
/// compiler deletes its temporary files and a JVM its
/// `/tmp/hsperfdata_<user>/<pid>` (killed outright, both left them behind),
/// then `cgroup.kill` (Linux 5.14) for whatever is still there after
/// [`STOP_GRACE`], a loop's or spawner's last child too.
fn stop_cgroup(dir: &Path) {
    let deadline = Instant::now() + STOP_GRACE;
    while Instant::now() < deadline {
        let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs")) else {
            return;
        };
        let pids: Vec<libc::pid_t> = procs.lines().filter_map(|pid| pid.parse().ok()).collect();
        if pids.is_empty() {
            return;
        }
        for pid in pids {
            // SAFETY: plain syscall; a pid that exited meanwhile fails it.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = std::fs::write(dir.join("cgroup.kill"), "1");
}

/// The cgroup2 mount point from this process's mount table: field 5 is the
/// mount point, and the filesystem type follows the ` - ` separator.
pub(crate) fn cgroup2_mount() -> anyhow::Result<PathBuf> {
    let mountinfo =
        std::fs::read_to_string("/proc/self/mountinfo").context("reading /proc/self/mountinfo")?;
    mountinfo
        .lines()
        .find_map(|line| {
            let (mount, fs) = line.split_once(" - ")?;
            (fs.split_whitespace().next()? == "cgroup2")
                .then(|| mount.split_whitespace().nth(4).map(PathBuf::from))
                .flatten()
        })
        .context("no cgroup2 filesystem is mounted (see /proc/self/mountinfo)")
}

/// One agent run of the filter benchmark.
#[derive(Debug)]
struct FilterRun {
    /// Mean BPF program run time in ns; `None` if it never ran.
    ns_per_run: Option<f64>,
    runs: u64,
    samples: u64,
    filtered: u64,
    idle: u64,
    /// The agent's user + system CPU time.
    cpu: Duration,
    /// From spawn to exit.
    wall: Duration,
}

impl FilterRun {
    /// The agent's CPU time as a percentage of one core over its lifetime.
    fn cpu_percent(&self) -> f64 {
        100.0 * self.cpu.as_secs_f64() / self.wall.as_secs_f64().max(1e-9)
    }
}

fn filter(seconds: u64) -> anyhow::Result<()> {
    if seconds == 0 {
        bail!("--seconds must be at least 1");
    }
    cargo(&["build", "--release", "--package", "stackscope-agent"])?;
    let agent = workspace_root().join("target/release/stackscope-agent");
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());

    // Declared before the scene so that it is dropped after it: a Ctrl-C
    // during the cleanup is caught too.
    let _interrupts = InterruptGuard::install();
    let mut scene = FilterScene::new()?;
    let busy = compile_fixture_in("busy", &scene.temp_dir)?;
    let parent = scene
        .create_cgroup(cgroup2_mount()?.join(format!("stackscope-bench-{}", std::process::id())))?;
    for i in 0..FILTER_PROCESSES {
        let child = scene.create_cgroup(parent.join(format!("p{i:02}")))?;
        scene.spawn_in(&busy, &child)?;
        check_interrupted()?;
    }
    let empty = scene.create_cgroup(parent.join("none"))?;
    let selected = parent.join("p00");

    println!(
        "filter benchmark: {FILTER_PROCESSES} busy processes, each in its own cgroup under {}; \
         {cpus} CPUs, {FILTER_HZ} Hz, {seconds} s per run",
        parent.display()
    );
    println!(
        "{:<3}  {:<26}  {:>10}  {:>9}  {:>9}  {:>9}  {:>7}  {:>9}  {:>7}",
        "run",
        "selection",
        "ns/BPF run",
        "BPF runs",
        "samples",
        "filtered",
        "idle",
        "agent CPU",
        "CPU %"
    );
    let runs = [
        (
            "A",
            format!("1 of {FILTER_PROCESSES} (p00)"),
            Some(&selected),
        ),
        ("B", format!("all {FILTER_PROCESSES} (no --cgroup)"), None),
        ("C", "none (empty cgroup)".to_string(), Some(&empty)),
    ];
    let mut results = Vec::new();
    for (name, selection, cgroup) in runs {
        let run = run_filter_agent(&agent, cgroup.map(PathBuf::as_path), seconds)?;
        // A run cut short by Ctrl-C is no figure.
        check_interrupted()?;
        println!(
            "{:<3}  {:<26}  {:>10}  {:>9}  {:>9}  {:>9}  {:>7}  {:>7.2} s  {:>6.1}%",
            name,
            selection,
            run.ns_per_run
                .map_or("-".to_string(), |ns| format!("{ns:.0}")),
            run.runs,
            run.samples,
            run.filtered,
            run.idle,
            run.cpu.as_secs_f64(),
            run.cpu_percent(),
        );
        results.push(run);
    }
    let [a, b, c] = &results[..] else {
        unreachable!("three runs");
    };
    let ns = |run: &FilterRun| {
        run.ns_per_run
            .map_or("-".to_string(), |ns| format!("{ns:.0}"))
    };
    println!(
        "BPF cost per tick: filtered-out {} ns (run C) vs sampled {} ns (run B); \
         agent CPU: filter 1-of-{FILTER_PROCESSES} {:.1}% vs no filter {:.1}% (ratio {:.2})",
        ns(c),
        ns(b),
        a.cpu_percent(),
        b.cpu_percent(),
        a.cpu_percent() / b.cpu_percent().max(1e-9),
    );
    println!(
        "(CPU % is the agent's user + system time over its whole life, start-up included, \
         as a share of one core; ns/BPF run is the kernel's run_time / run_count with \
         bpf_stats on)"
    );
    Ok(())
}

/// Runs the agent for `seconds` (on `cgroup` if given) and returns its
/// report's figures with the CPU time it used (from `wait4`).
fn run_filter_agent(
    agent: &Path,
    cgroup: Option<&Path>,
    seconds: u64,
) -> anyhow::Result<FilterRun> {
    let mut cmd = Command::new(agent);
    cmd.args(["--frequency", FILTER_HZ])
        .args(["--duration", &format!("{seconds}s")])
        .args(["--status-interval", "1h", "--log-level", "error"])
        .args(["--bpf-stats", "--json", "--no-table-cache"]);
    if let Some(cgroup) = cgroup {
        cmd.arg("--cgroup").arg(cgroup);
    }
    let started = Instant::now();
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("starting {cmd:?}"))?;
    let mut stdout = Vec::new();
    let read = child
        .stdout
        .take()
        .expect("stdout is piped")
        .read_to_end(&mut stdout);
    // Reaps the child here (std's Child does nothing more on drop).
    let (status, usage) = wait_with_rusage(child.id())?;
    let wall = started.elapsed();
    read.context("reading the agent's report")?;
    if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
        bail!("{cmd:?} failed (wait status {status:#x})");
    }
    let report: serde_json::Value = serde_json::from_slice(&stdout).with_context(|| {
        format!(
            "the agent's --json report is not JSON: {}",
            String::from_utf8_lossy(&stdout)
        )
    })?;
    let field = |section: &str, name: &str| -> anyhow::Result<u64> {
        report[section][name]
            .as_u64()
            .with_context(|| format!("no {section}.{name} in the agent's report: {report}"))
    };
    let runs = field("bpf", "run_count")?;
    // The agent's own run_time / run_count, in whole nanoseconds.
    let ns_per_run = report["bpf"]["ns_per_run"].as_u64().map(|ns| ns as f64);
    let timeval = |tv: libc::timeval| {
        Duration::from_secs(tv.tv_sec as u64) + Duration::from_micros(tv.tv_usec as u64)
    };
    Ok(FilterRun {
        ns_per_run,
        runs,
        samples: field("kernel", "samples")?,
        filtered: field("kernel", "filtered")?,
        idle: field("kernel", "idle")?,
        cpu: timeval(usage.ru_utime) + timeval(usage.ru_stime),
        wall,
    })
}

/// Waits for child `pid` and returns its wait status and resource usage.
fn wait_with_rusage(pid: u32) -> anyhow::Result<(libc::c_int, libc::rusage)> {
    let pid = libc::pid_t::try_from(pid).context("pid out of range")?;
    let mut status = 0;
    // SAFETY: rusage is plain old data; all zeroes is a valid value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: both pointers are to live locals of the right types.
        let reaped = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
        if reaped == pid {
            return Ok((status, usage));
        }
        let error = std::io::Error::last_os_error();
        if error.kind() != std::io::ErrorKind::Interrupted {
            return Err(error).with_context(|| format!("waiting for process {pid}"));
        }
    }
}

/// Compiles `tests/fixtures/<name>.c` without frame pointers into `target/fixtures/`.
pub(crate) fn compile_fixture(name: &str) -> anyhow::Result<PathBuf> {
    compile_fixture_in(name, &workspace_root().join("target/fixtures"))
}

/// Compiles `tests/fixtures/<name>.c` without frame pointers into `out_dir`.
pub(crate) fn compile_fixture_in(name: &str, out_dir: &Path) -> anyhow::Result<PathBuf> {
    let source = workspace_root().join(format!("tests/fixtures/{name}.c"));
    std::fs::create_dir_all(out_dir)?;
    let binary = out_dir.join(name);
    run_checked(
        Command::new("gcc")
            .args(["-O2", "-g", "-fomit-frame-pointer", "-pthread", "-o"])
            .arg(&binary)
            .arg(&source),
    )?;
    Ok(binary)
}
