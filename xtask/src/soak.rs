//! `cargo xtask soak --minutes N`: the agent and the collector under a mixed
//! load for N minutes, watched for anything that keeps growing.
//!
//! The agent samples only the load (its cgroup and the containers'), so
//! whatever else the machine runs meanwhile does not change its state.
//! The load: a long-lived deep program (`deep_frames`, 256 KiB of stack), a
//! shallow busy one (`busy`), a JIT (node running `json_runtime.js` with its
//! perf map), short-lived process churn (`spawner` starting `short_lived`
//! 50 times a second) and containers started and removed every 20 s. The
//! collector is restarted a third of the way in; the agent must keep what
//! it could not deliver meanwhile and deliver it after.
//!
//! Every few seconds it samples both processes' resident memory and open
//! descriptors (files apart from the rest), and every `state_*` gauge
//! (caches, per-process maps, queues) their metrics endpoints publish.
//! Growth that a bounded cache accounts for is reported as such: anonymous
//! memory filled by SQLite's page caches, files opened by the symbolizer.
//! The heap's breakdown (glibc's bytes in use and free, SQLite's own, the
//! collector's in use less SQLite's) is shown beside the resident memory
//! to explain it, and is not judged itself.
//! It prints one row per series with values at evenly spaced times, the
//! series' bound, and the slope of a least-squares fit over the second half
//! (the first is warm-up). It fails when a series
//! exceeds its bound, when one without a bound keeps growing after warm-up
//! beyond its tolerance, or when the agent lost batches or did not deliver
//! what it had queued.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use stackscope_telemetry::status_kib;
use stackscope_test_fixtures::{
    Fixture, RunningProcess,
    containers::{Container, Image},
    free_port, http_get, metric_value,
};

use crate::{KillOnDrop, bench::Cgroup, wait_for_listener, workspace_root};

/// How often the series are sampled.
const SAMPLE_EVERY: Duration = Duration::from_secs(5);

/// Columns of values printed per series.
const COLUMNS: usize = 7;

/// The agent's sampling rate: high enough that the per-interval tables and
/// the export queue see real traffic.
const HZ: &str = "199";

/// The agent's memory limit (MiB): the DaemonSet's default budget, which
/// its peak RSS over the whole soak must stay within.
const AGENT_MEMORY_LIMIT_MIB: u64 = 192;

pub fn run(minutes: f64, release: bool) -> anyhow::Result<()> {
    if !(minutes > 0.0 && minutes.is_finite()) {
        bail!("--minutes must be a positive number, not {minutes}");
    }
    crate::require_root("the agent loads BPF programs and the load includes containers")?;
    let bin = crate::build_binaries(release)?;
    let scratch = tempfile::Builder::new()
        .prefix("stackscope-soak-")
        .tempdir()
        .context("creating the soak's directory")?;
    let total = Duration::from_secs_f64(minutes * 60.0);

    eprintln!("soak: building the load");
    let cgroups = SoakCgroups::create()?;
    let load = Load::start(total, scratch.path(), &cgroups)?;

    let grpc = format!("127.0.0.1:{}", free_port());
    let collector_http = format!("127.0.0.1:{}", free_port());
    let agent_metrics = format!("127.0.0.1:{}", free_port());
    let data_dir = scratch.path().join("data");
    let collector_log = scratch.path().join("collector.log");
    let start_collector = || -> anyhow::Result<KillOnDrop> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&collector_log)
            .context("opening the collector's log")?;
        let mut child = KillOnDrop(
            Command::new(bin.join("stackscope-collector"))
                .arg("--data-dir")
                .arg(&data_dir)
                .args(["--grpc-listen", &grpc, "--http-listen", &collector_http])
                // Short enough that retention's deletions are part of the
                // soak (and the label set index levels off), not the week
                // of a fleet.
                .args(["--retention", "10m", "--retention-interval", "1m"])
                .args(["--log-level", "info"])
                .stderr(log)
                .spawn()
                .context("starting the collector")?,
        );
        wait_for_listener(&grpc, &mut child.0)?;
        Ok(child)
    };
    let mut collector = Some(start_collector()?);
    let mut agent = KillOnDrop(
        Command::new(bin.join("stackscope-agent"))
            .args(["--collector", &format!("http://{grpc}")])
            .args(["--frequency", HZ, "--metrics-address", &agent_metrics])
            .args(["--memory-limit", &format!("{AGENT_MEMORY_LIMIT_MIB}MiB")])
            .arg("--cgroup")
            .arg(&cgroups.load.0)
            .arg("--cgroup")
            .arg(&cgroups.containers)
            .arg("--table-cache-dir")
            .arg(scratch.path().join("tables"))
            .args(["--status-interval", "1h", "--log-level", "warn"])
            .stdout(Stdio::null())
            .spawn()
            .context("starting the agent")?,
    );

    eprintln!(
        "soak: {minutes} min; sampling every {} s; the collector restarts at {:.1} min",
        SAMPLE_EVERY.as_secs(),
        minutes / 3.0
    );
    let started = Instant::now();
    let mut series = Series::default();
    let mut restarted = false;
    while started.elapsed() < total {
        std::thread::sleep(SAMPLE_EVERY.min(total.saturating_sub(started.elapsed())));
        if let Some(status) = agent.0.try_wait()? {
            bail!("the agent exited with {status} during the soak");
        }
        let at = started.elapsed().as_secs_f64() / 60.0;
        if !restarted && at >= minutes / 3.0 {
            restarted = true;
            eprintln!("soak: restarting the collector at {at:.1} min");
            let took = stop(
                collector.take().expect("the collector runs"),
                "the collector",
            )
            .with_context(|| log_tail(&collector_log))?;
            eprintln!("soak: the collector stopped in {:.1} s", took.as_secs_f64());
            // Long enough for the agent's pushes to fail and queue.
            std::thread::sleep(Duration::from_secs(5));
            collector = Some(start_collector()?);
        }
        let collector_pid = collector.as_ref().map(|c| c.0.id());
        series.sample(at, "agent", agent.0.id(), &agent_metrics);
        if let Some(pid) = collector_pid {
            series.sample(at, "collector", pid, &collector_http);
        }
        load.check()?;
    }
    load.stop()?;
    // What the agent still holds is delivered before it is asked to stop.
    let delivery = Delivery::when_delivered(&agent_metrics);
    // The whole run's peak, not the samples': a spike between two is what
    // would get the agent killed.
    let agent_peak = std::fs::read_to_string(format!("/proc/{}/status", agent.0.id()))
        .ok()
        .and_then(|status| status_kib(&status, "VmHWM:"))
        .map(|kib| kib << 10);
    stop(agent, "the agent")?;
    stop(
        collector.take().expect("the collector runs"),
        "the collector",
    )
    .with_context(|| log_tail(&collector_log))?;

    let verdicts = series.report(minutes);
    let delivery = delivery?;
    println!(
        "agent delivery: {} batches stored, {} dropped (queue full), {} rejected, {} retries; \
         {} bytes still queued at the end",
        delivery.stored, delivery.dropped, delivery.rejected, delivery.retries, delivery.queued
    );
    let mut failures = verdicts;
    if !series.saw_containers() {
        failures.push("the agent never sampled one of the load's containers".into());
    }
    match agent_peak {
        Some(peak) => {
            println!(
                "agent peak RSS: {:.1} MiB of its {AGENT_MEMORY_LIMIT_MIB} MiB limit",
                peak as f64 / f64::from(1 << 20)
            );
            if peak > AGENT_MEMORY_LIMIT_MIB << 20 {
                failures.push("the agent's peak RSS was over its --memory-limit".into());
            }
        }
        None => failures.push("the agent's peak RSS could not be read".into()),
    }
    if delivery.stored == 0 {
        failures.push("the agent stored no batch".into());
    }
    if delivery.queued > 0 {
        failures.push(format!(
            "{} bytes were still queued a minute after the load stopped",
            delivery.queued
        ));
    }
    if delivery.dropped + delivery.rejected > 0 {
        failures.push(format!(
            "the agent lost {} batches across the collector's restart",
            delivery.dropped + delivery.rejected
        ));
    }
    if !failures.is_empty() {
        bail!("the soak failed:\n  {}", failures.join("\n  "));
    }
    println!("soak: nothing kept growing past warm-up and every series held its bound");
    Ok(())
}

/// SIGTERM, then wait up to a minute (the agent flushes its last
/// interval); returns how long it took.
fn stop(mut child: KillOnDrop, what: &str) -> anyhow::Result<Duration> {
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(child.0.id() as i32, libc::SIGTERM) };
    let asked = Instant::now();
    let deadline = asked + Duration::from_secs(60);
    loop {
        if let Some(status) = child.0.try_wait()? {
            if !status.success() {
                bail!("{what} exited with {status} on SIGTERM");
            }
            return Ok(asked.elapsed());
        }
        if Instant::now() > deadline {
            bail!("{what} did not stop within 60 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The last lines of a log, to explain a failure.
fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    format!(
        "the last lines of {}:\n{}",
        path.display(),
        lines[lines.len().saturating_sub(20)..].join("\n")
    )
}

/// The cgroups the agent samples: the load's own, and podman's parent of
/// every container (`/libpod_parent`, with the cgroupfs manager). Whatever
/// else runs on the machine meanwhile (a build, other tests) then leaves
/// the agent's state alone, and one soak's figures compare with another's.
struct SoakCgroups {
    load: Cgroup,
    containers: PathBuf,
    /// podman's parent did not exist before the soak: removed if empty.
    made_containers: bool,
}

impl SoakCgroups {
    fn create() -> anyhow::Result<Self> {
        let mount = crate::bench::cgroup2_mount()?;
        let load = Cgroup::create(mount.join(format!("stackscope-soak-{}", std::process::id())))?;
        let containers = mount.join("libpod_parent");
        let made_containers = !containers.exists();
        std::fs::create_dir_all(&containers)
            .with_context(|| format!("creating cgroup {}", containers.display()))?;
        Ok(Self {
            load,
            containers,
            made_containers,
        })
    }
}

impl Drop for SoakCgroups {
    fn drop(&mut self) {
        if self.made_containers {
            let _ = std::fs::remove_dir(&self.containers);
        }
    }
}

/// The programs the agent profiles during the soak; all stopped on drop.
struct Load {
    _deep: RunningProcess,
    _busy: RunningProcess,
    _spawner: RunningProcess,
    node: RunningProcess,
    _fixtures: Vec<Fixture>,
    containers: Option<std::thread::JoinHandle<()>>,
    stop_containers: Arc<AtomicBool>,
}

impl Load {
    /// `scratch`: node's working directory (V8 writes its logs there).
    fn start(total: Duration, scratch: &Path, cgroups: &SoakCgroups) -> anyhow::Result<Self> {
        let deep = Fixture::compile("deep_frames", &[]);
        let busy = Fixture::compile("busy", &[]);
        let spawner = Fixture::compile("spawner", &[]);
        let short_lived = Fixture::compile("short_lived", &[]);
        let churned = Fixture::compile("call_chain", &["-static"]);
        let running_deep = deep.start(&["262144"]);
        let running_busy = busy.start(&[]);
        let seconds = (total.as_secs() + 60).to_string();
        let short_lived_path = short_lived.path.to_str().context("fixture path")?;
        let running_spawner = spawner.start(&[short_lived_path, "50", &seconds]);
        let node = RunningProcess::start_ready(
            Command::new("node")
                .arg("--perf-basic-prof")
                .arg(workspace_root().join("tests/fixtures/json_runtime.js"))
                .current_dir(scratch),
        );

        // The spawner's children from here on are born in its cgroup.
        for process in [&running_deep, &running_busy, &running_spawner, &node] {
            cgroups.load.enter(process.pid())?;
        }

        let image = Image::build("soak", &[(churned.path.as_path(), "/app/call_chain")]);
        let stop_containers = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop_containers);
        let containers = std::thread::Builder::new()
            .name("soak-containers".into())
            .spawn(move || {
                // Each container runs 10 s and is removed; one starts every
                // 20 s, so the agent sees container ids come and go.
                while !stopping.load(Ordering::Relaxed) {
                    let container = Container::run(&image, "soak", &["/app/call_chain"]);
                    sleep_unless(&stopping, Duration::from_secs(10));
                    drop(container);
                    sleep_unless(&stopping, Duration::from_secs(10));
                }
            })
            .context("starting the container churn")?;
        Ok(Self {
            _deep: running_deep,
            _busy: running_busy,
            _spawner: running_spawner,
            node,
            _fixtures: vec![deep, busy, spawner, short_lived, churned],
            containers: Some(containers),
            stop_containers,
        })
    }

    /// Fails when the container churn has stopped (podman failed).
    fn check(&self) -> anyhow::Result<()> {
        if self.containers.as_ref().is_some_and(|t| t.is_finished()) {
            bail!("the container churn stopped early (see its panic above)");
        }
        Ok(())
    }

    fn stop(mut self) -> anyhow::Result<()> {
        self.stop_containers.store(true, Ordering::Relaxed);
        if let Some(thread) = self.containers.take()
            && thread.join().is_err()
        {
            bail!("the container churn failed (see its panic above)");
        }
        Ok(())
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop_containers.store(true, Ordering::Relaxed);
        if let Some(thread) = self.containers.take() {
            let _ = thread.join();
        }
        // node writes its perf map to /tmp for the profiler; not ours to keep.
        let _ = std::fs::remove_file(format!("/tmp/perf-{}.map", self.node.pid()));
    }
}

fn sleep_unless(stop: &AtomicBool, duration: Duration) {
    let until = Instant::now() + duration;
    while !stop.load(Ordering::Relaxed) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// One measured quantity over time.
#[derive(Default)]
struct Track {
    /// (minutes since the start, value)
    points: Vec<(f64, f64)>,
    bound: Option<f64>,
    kind: Kind,
}

#[derive(Default, Clone, Copy, PartialEq)]
enum Kind {
    #[default]
    Entries,
    Bytes,
    /// Resident file pages: reported, not judged.
    FileBytes,
    /// What the heap holds, split (in use, free, SQLite's): reported to
    /// explain the resident memory, which is what is judged.
    HeapBytes,
    Files,
}

impl Kind {
    /// Growth over the second half below this is noise, whatever the
    /// relative figure says.
    fn floor(self) -> f64 {
        match self {
            Kind::Entries => 64.0,
            Kind::Bytes | Kind::FileBytes | Kind::HeapBytes => 4.0 * 1024.0 * 1024.0,
            Kind::Files => 8.0,
        }
    }

    fn show(self, value: f64) -> String {
        match self {
            Kind::Bytes | Kind::FileBytes | Kind::HeapBytes => {
                format!("{:.1}M", value / (1024.0 * 1024.0))
            }
            _ => format!("{value:.0}"),
        }
    }
}

/// Shorter soaks are still warming up in their second half (tables
/// compiling, caches filling): they judge bounds and delivery, and report
/// growth without failing on it.
const JUDGE_GROWTH_FROM_MINUTES: f64 = 10.0;

/// Growth over the second half above this share of the series' mean there
/// (and above its kind's floor) is growth, not noise.
const GROWTH_TOLERANCE: f64 = 0.10;

#[derive(Default)]
struct Series(BTreeMap<String, Track>);

impl Series {
    fn point(&mut self, name: String, kind: Kind, at: f64, value: f64) {
        let track = self.0.entry(name).or_default();
        track.kind = kind;
        track.points.push((at, value));
    }

    fn bound(&mut self, name: String, bound: f64) {
        self.0.entry(name).or_default().bound = Some(bound);
    }

    /// The process's memory and open files, and what its metrics say of
    /// its state (a failed scrape leaves a gap, not a zero).
    fn sample(&mut self, at: f64, who: &str, pid: u32, metrics: &str) {
        // Anonymous memory is what leaks; file pages (the binary, mapped
        // files) are shown but come and go with the page cache.
        if let Some((anon, file)) = resident_bytes(pid) {
            self.point(format!("{who} rss anon"), Kind::Bytes, at, anon);
            self.point(format!("{who} rss file"), Kind::FileBytes, at, file);
        }
        if let Some((files, other)) = open_descriptors(pid) {
            // Files on disk are the naming caches' (bounded by
            // symbolizer_files and the interval's objects); growth of the
            // rest (BPF objects, sockets, pipes) would be a leak of its own.
            self.point(format!("{who} open files"), Kind::Files, at, files);
            self.point(
                format!("{who} open descriptors (other)"),
                Kind::Files,
                at,
                other,
            );
        }
        if let Some((200, text)) = http_get(metrics, "/metrics") {
            self.read_metrics(at, who, &text);
        }
        self.anon_less_page_caches(at, who);
        self.heap_less_sqlite(at, who);
    }

    /// The heap in use less SQLite's own (its page caches, statements and
    /// schemas): what the collector's own structures hold.
    fn heap_less_sqlite(&mut self, at: f64, who: &str) {
        if let (Some(in_use), Some(sqlite)) = (
            self.value_at(&format!("{who} heap in use"), at),
            self.value_at(&format!("{who} sqlite_memory bytes"), at),
        ) {
            self.point(
                format!("{who} heap in use less sqlite"),
                Kind::HeapBytes,
                at,
                in_use - sqlite,
            );
        }
    }

    /// RssAnon less what SQLite's page caches (heap memory within their
    /// own bound) held at the same moment: what is left grows only by a
    /// leak. Nothing when a cache's gauge was skipped at this scrape.
    fn anon_less_page_caches(&mut self, at: f64, who: &str) {
        let caches: Vec<Option<f64>> = self
            .0
            .iter()
            .filter(|(name, _)| name.starts_with(who) && name.ends_with("page_cache bytes"))
            .map(|(_, track)| track.value_at(at))
            .collect();
        if caches.is_empty() {
            return;
        }
        let (Some(anon), Some(caches)) = (
            self.value_at(&format!("{who} rss anon"), at),
            caches.into_iter().sum::<Option<f64>>(),
        ) else {
            return;
        };
        self.point(
            format!("{who} {ANON_LESS_PAGE_CACHES}"),
            Kind::Bytes,
            at,
            anon - caches,
        );
    }

    /// The value series `name` took at the scrape at `at`, if it has one.
    fn value_at(&self, name: &str, at: f64) -> Option<f64> {
        self.0.get(name)?.value_at(at)
    }

    /// The export queue and the `state_*` gauges of `who`'s metrics text.
    fn read_metrics(&mut self, at: f64, who: &str, text: &str) {
        let prefix = format!("stackscope_{who}_");
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            // The allocator's heap, split in what is handed out and what
            // it keeps free: fragmentation grows the second alone.
            if let Some((use_, value)) = line
                .strip_prefix("process_heap_bytes{use=\"")
                .and_then(|rest| rest.split_once("\"} "))
                && let Ok(value) = value.parse::<f64>()
            {
                let use_ = use_.replace('_', " ");
                self.point(format!("{who} heap {use_}"), Kind::HeapBytes, at, value);
                continue;
            }
            let Some(rest) = line.strip_prefix(&prefix) else {
                continue;
            };
            let Some((metric, value)) = rest.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            if metric == "export_queue_bytes" {
                self.point(format!("{who} export queue"), Kind::Bytes, at, value);
                continue;
            }
            let Some((family, state)) = metric
                .strip_suffix("\"}")
                .and_then(|m| m.split_once("{state=\""))
            else {
                continue;
            };
            match family {
                "state_entries" => self.point(format!("{who} {state}"), Kind::Entries, at, value),
                // SQLite's whole heap, page caches included: a breakdown.
                "state_bytes" if state == "sqlite_memory" => {
                    self.point(format!("{who} {state} bytes"), Kind::HeapBytes, at, value);
                }
                "state_bytes" => self.point(format!("{who} {state} bytes"), Kind::Bytes, at, value),
                "state_max_entries" => self.bound(format!("{who} {state}"), value),
                "state_max_bytes" => self.bound(format!("{who} {state} bytes"), value),
                _ => {}
            }
        }
    }

    /// Whether the agent ever held a container's labels.
    fn saw_containers(&self) -> bool {
        self.0
            .get("agent containers")
            .is_some_and(|track| track.points.iter().any(|&(_, n)| n > 0.0))
    }

    /// Prints the table; returns what failed.
    fn report(&self, minutes: f64) -> Vec<String> {
        let times: Vec<f64> = (0..COLUMNS)
            .map(|i| minutes * (i + 1) as f64 / COLUMNS as f64)
            .collect();
        print!("{:<36}", "series");
        for t in &times {
            print!("{:>9}", format!("{t:.1}m"));
        }
        println!("{:>10} {:>14}  verdict", "bound", "slope/min");
        let mut failures = Vec::new();
        for (name, track) in &self.0 {
            if track.points.is_empty() {
                continue;
            }
            let kind = track.kind;
            print!("{name:<36}");
            for &t in &times {
                // The last point at or before t.
                let value = track
                    .value_at_or_before(t)
                    .map_or("-".to_string(), |v| kind.show(v));
                print!("{value:>9}");
            }
            let bound = track.bound.map_or("-".into(), |b| kind.show(b));
            // Entries of state bounded by its bytes hold that bound too.
            let bytes_bound = self
                .0
                .get(&format!("{name} bytes"))
                .and_then(|bytes| bytes.bound);
            let (mut verdict, mut failed) = track.verdict(minutes, bytes_bound.is_some());
            // Anonymous memory that grew by no more than the page caches
            // filled (within their bound) is explained.
            if failed
                && let Some(less) = name
                    .strip_suffix("rss anon")
                    .and_then(|who| self.0.get(&format!("{who}{ANON_LESS_PAGE_CACHES}")))
                && !less.verdict(minutes, false).1
            {
                verdict = format!("{verdict}: all of it the page caches (bounded)");
                failed = false;
            }
            // The symbolizer keeps one file open whatever its size (below
            // its bytes' bound it could name nothing): over the bound only
            // at scrapes where it held that one file is its design.
            if failed
                && let Some(files) = name
                    .strip_suffix("symbolizer_files bytes")
                    .and_then(|who| self.0.get(&format!("{who}symbolizer_files")))
                && track.bound.is_some_and(|bound| {
                    track.points.iter().all(|&(at, bytes)| {
                        bytes <= bound || files.value_at_or_before(at) == Some(1.0)
                    })
                })
            {
                verdict = format!("{verdict}: one file at a time (larger than the bound)");
                failed = false;
            }
            // Each file the symbolizer keeps open (bounded in count and
            // bytes) holds at most three descriptors: the object's, its
            // separate debug file's and blazesym's own.
            if failed
                && let Some(naming) = name
                    .strip_suffix("open files")
                    .and_then(|who| self.0.get(&format!("{who}symbolizer_files")))
                && let (Some(files), Some(fds)) = (
                    naming.second_half_slope(minutes),
                    track.second_half_slope(minutes),
                )
                && fds <= 3.0 * files
            {
                verdict = format!("{verdict}: the symbolizer's files (bounded)");
                failed = false;
            }
            let slope = track.second_half_slope(minutes).unwrap_or(0.0);
            println!("{bound:>10} {:>14}  {verdict}", kind.show(slope));
            if failed {
                failures.push(format!("{name}: {verdict}"));
            }
        }
        failures
    }
}

impl Track {
    /// The last value taken at or before `at`.
    fn value_at_or_before(&self, at: f64) -> Option<f64> {
        self.points
            .iter()
            .take_while(|(when, _)| *when <= at + 1e-9)
            .last()
            .map(|&(_, value)| value)
    }

    /// The value taken at the scrape at `at` (a failed scrape left none).
    fn value_at(&self, at: f64) -> Option<f64> {
        self.points
            .last()
            .filter(|(when, _)| *when == at)
            .map(|&(_, value)| value)
    }

    fn second_half(&self, minutes: f64) -> Vec<(f64, f64)> {
        self.points
            .iter()
            .copied()
            .filter(|(at, _)| *at >= minutes / 2.0)
            .collect()
    }

    /// Least-squares slope over the second half, per minute.
    fn second_half_slope(&self, minutes: f64) -> Option<f64> {
        let points = self.second_half(minutes);
        if points.len() < 3 {
            return None;
        }
        let n = points.len() as f64;
        let mean_t = points.iter().map(|p| p.0).sum::<f64>() / n;
        let mean_v = points.iter().map(|p| p.1).sum::<f64>() / n;
        let covariance: f64 = points
            .iter()
            .map(|(t, v)| (t - mean_t) * (v - mean_v))
            .sum();
        let variance: f64 = points.iter().map(|(t, _)| (t - mean_t).powi(2)).sum();
        (variance > 0.0).then(|| covariance / variance)
    }

    /// What the series did, and whether that is a failure. `bytes_bound`:
    /// the series counts entries of state whose bytes are bounded.
    fn verdict(&self, minutes: f64, bytes_bound: bool) -> (String, bool) {
        let max = self.points.iter().map(|p| p.1).fold(f64::MIN, f64::max);
        if let Some(bound) = self.bound
            && max > bound
        {
            return (
                format!("FAIL: {} over its bound", self.kind.show(max)),
                true,
            );
        }
        let points = self.second_half(minutes);
        let Some(slope) = self.second_half_slope(minutes) else {
            return ("too few samples".into(), false);
        };
        match self.kind {
            Kind::FileBytes => return ("(page cache: not judged)".into(), false),
            Kind::HeapBytes => return ("(heap breakdown: not judged)".into(), false),
            _ => {}
        }
        let mean = points.iter().map(|p| p.1).sum::<f64>() / points.len() as f64;
        let growth = slope * minutes / 2.0;
        let tolerance = (GROWTH_TOLERANCE * mean).max(self.kind.floor());
        if growth <= tolerance {
            return match self.bound {
                Some(bound) if max >= 0.9 * bound => ("holds at its bound".into(), false),
                _ => ("flat".into(), false),
            };
        }
        match self.bound {
            Some(bound) => (
                format!(
                    "growing toward its bound ({:.0}% of it)",
                    100.0 * max / bound.max(1.0)
                ),
                false,
            ),
            None if bytes_bound => ("growing toward its bytes' bound".into(), false),
            None if minutes < JUDGE_GROWTH_FROM_MINUTES => (
                format!(
                    "grew {} over the second half (judged from {JUDGE_GROWTH_FROM_MINUTES} min)",
                    self.kind.show(growth)
                ),
                false,
            ),
            None => (
                format!(
                    "FAIL: grew {} over the second half (tolerance {})",
                    self.kind.show(growth),
                    self.kind.show(tolerance)
                ),
                true,
            ),
        }
    }
}

/// The agent's delivery counters at the end of the load.
struct Delivery {
    stored: u64,
    dropped: u64,
    rejected: u64,
    retries: u64,
    queued: u64,
}

impl Delivery {
    /// The counters once the export queue is empty (or after a minute).
    fn when_delivered(address: &str) -> anyhow::Result<Self> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let delivery = Self::scrape(address);
            if delivery.as_ref().is_ok_and(|d| d.queued == 0) || Instant::now() > deadline {
                return delivery;
            }
            std::thread::sleep(Duration::from_secs(1));
        }
    }

    fn scrape(address: &str) -> anyhow::Result<Self> {
        let Some((200, text)) = http_get(address, "/metrics") else {
            bail!("the agent's metrics did not answer");
        };
        let value = |name: &str| metric_value(&text, name).unwrap_or(0.0) as u64;
        Ok(Self {
            stored: value("stackscope_agent_export_batches_total{result=\"stored\"}"),
            dropped: value("stackscope_agent_export_batches_total{result=\"dropped_queue_full\"}"),
            rejected: value("stackscope_agent_export_batches_total{result=\"rejected\"}"),
            retries: value("stackscope_agent_export_retries_total"),
            queued: value("stackscope_agent_export_queue_bytes"),
        })
    }
}

/// The series of RssAnon less the SQLite page caches.
const ANON_LESS_PAGE_CACHES: &str = "rss anon less page caches";

/// `pid`'s descriptors: (files on disk, everything else).
fn open_descriptors(pid: u32) -> Option<(f64, f64)> {
    let (mut files, mut other) = (0.0, 0.0);
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.flatten() {
        // A link to a file names its path; sockets, pipes and anonymous
        // inodes (BPF maps, programs, links, perf events) do not. Devices
        // (/dev/null) are neither cache nor leak: counted with the rest.
        match std::fs::read_link(entry.path()) {
            Ok(target) if target.starts_with("/") && !target.starts_with("/dev/") => files += 1.0,
            Ok(_) => other += 1.0,
            // Closed since the directory was read.
            Err(_) => {}
        }
    }
    Some((files, other))
}

/// RssAnon and RssFile of `pid`, in bytes.
fn resident_bytes(pid: u32) -> Option<(f64, f64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let bytes = |field| Some(status_kib(&status, field)? as f64 * 1024.0);
    Some((bytes("RssAnon:")?, bytes("RssFile:")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn track(kind: Kind, bound: Option<f64>, values: impl Fn(f64) -> f64) -> Track {
        Track {
            points: (0..=120)
                .map(|i| i as f64 / 12.0)
                .map(|t| (t, values(t)))
                .collect(),
            bound,
            kind,
        }
    }

    #[test]
    fn a_series_that_keeps_growing_without_a_bound_fails() {
        let leak = track(Kind::Bytes, None, |t| 50e6 + t * 2e6);
        let (verdict, failed) = leak.verdict(10.0, false);
        assert!(failed, "{verdict}");
        let slope = leak.second_half_slope(10.0).unwrap();
        assert!((slope - 2e6).abs() < 1.0, "{slope}");
    }

    #[test]
    fn short_soaks_and_byte_bounded_entries_report_growth_without_failing() {
        let leak = track(Kind::Bytes, None, |t| 50e6 + t * 20e6);
        let (verdict, failed) = leak.verdict(2.0, false);
        assert!(!failed && verdict.contains("judged from"), "{verdict}");
        let waiting = track(Kind::Entries, None, |t| t * 100.0);
        assert!(!waiting.verdict(10.0, true).1);
        assert!(waiting.verdict(10.0, false).1);
    }

    #[test]
    fn warm_up_growth_then_flat_passes() {
        let warm = track(Kind::Bytes, None, |t| 20e6 + 40e6 * (t.min(3.0) / 3.0));
        assert_eq!(warm.verdict(10.0, false), ("flat".into(), false));
    }

    #[test]
    fn bounded_series_may_fill_but_not_pass_their_bound() {
        let filling = track(Kind::Entries, Some(4096.0), |t| t * 300.0);
        let (verdict, failed) = filling.verdict(10.0, false);
        assert!(
            !failed && verdict.starts_with("growing toward"),
            "{verdict}"
        );
        let at_bound = track(Kind::Entries, Some(4096.0), |t| (t * 2000.0).min(4096.0));
        assert_eq!(
            at_bound.verdict(10.0, false),
            ("holds at its bound".into(), false)
        );
        let over = track(Kind::Entries, Some(4096.0), |t| t * 500.0);
        assert!(over.verdict(10.0, false).1);
    }

    fn series(tracks: Vec<(&str, Track)>) -> Series {
        Series(
            tracks
                .into_iter()
                .map(|(name, track)| (name.to_string(), track))
                .collect(),
        )
    }

    #[test]
    fn growth_is_explained_only_by_caches_that_grew_as_much() {
        let anon = |t: f64| 30e6 + t * 2e6;
        let filling_cache = |t: f64| 10e6 + t * 2e6;
        let less = |cache: fn(f64) -> f64| track(Kind::Bytes, None, move |t| anon(t) - cache(t));
        let explained = series(vec![
            ("collector rss anon", track(Kind::Bytes, None, anon)),
            ("collector rss anon less page caches", less(filling_cache)),
        ]);
        assert!(explained.report(10.0).is_empty());
        let leaking = series(vec![
            ("collector rss anon", track(Kind::Bytes, None, anon)),
            ("collector rss anon less page caches", less(|_| 10e6)),
        ]);
        assert_eq!(leaking.report(10.0).len(), 2);

        let fds = |t: f64| 20.0 + t * 5.0;
        let opened =
            |per_minute: f64| track(Kind::Entries, Some(64.0), move |t| 5.0 + t * per_minute);
        let naming = series(vec![
            ("agent open files", track(Kind::Files, None, fds)),
            ("agent symbolizer_files", opened(2.0)),
        ]);
        assert!(naming.report(10.0).is_empty());
        let leaking = series(vec![
            ("agent open files", track(Kind::Files, None, fds)),
            ("agent symbolizer_files", opened(1.0)),
        ]);
        assert_eq!(leaking.report(10.0).len(), 1);
    }

    #[test]
    fn the_symbolizer_may_pass_its_bytes_bound_with_one_file_open() {
        let mib = 1024.0 * 1024.0;
        // One 100 MiB file at minute 4, alone; small files otherwise.
        let bytes = |big_alone_at: f64| {
            track(Kind::Bytes, Some(8.0 * mib), move |t| {
                if t == big_alone_at {
                    100.0 * mib
                } else {
                    4.0 * mib
                }
            })
        };
        // One file open at minute 4, three otherwise.
        let judged = |big_at| {
            let files = track(
                Kind::Entries,
                Some(64.0),
                |t| if t == 4.0 { 1.0 } else { 3.0 },
            );
            series(vec![
                ("agent symbolizer_files bytes", bytes(big_at)),
                ("agent symbolizer_files", files),
            ])
            .report(10.0)
        };
        assert!(judged(4.0).is_empty());
        // Over the bound with three files open: a failure.
        assert_eq!(judged(6.0).len(), 1);
    }

    #[test]
    fn the_page_caches_are_taken_from_anonymous_memory_at_the_same_scrape() {
        let mut series = Series::default();
        series.point("collector rss anon".into(), Kind::Bytes, 1.0, 50e6);
        series.point(
            "collector writer_page_cache bytes".into(),
            Kind::Bytes,
            1.0,
            8e6,
        );
        series.point(
            "collector reader_page_cache bytes".into(),
            Kind::Bytes,
            1.0,
            2e6,
        );
        series.anon_less_page_caches(1.0, "collector");
        // The reader's gauge was skipped (its lock was busy) at 2.0.
        series.point("collector rss anon".into(), Kind::Bytes, 2.0, 60e6);
        series.point(
            "collector writer_page_cache bytes".into(),
            Kind::Bytes,
            2.0,
            9e6,
        );
        series.anon_less_page_caches(2.0, "collector");
        assert_eq!(
            series.0["collector rss anon less page caches"].points,
            [(1.0, 40e6)]
        );
    }

    #[test]
    fn the_heap_breakdown_is_shown_not_judged() {
        let filling = track(Kind::HeapBytes, None, |t| 10e6 + t * 2e6);
        let (verdict, failed) = filling.verdict(10.0, false);
        assert!(!failed, "{verdict}");
        assert_eq!(verdict, "(heap breakdown: not judged)");
        // The same growth as resident memory fails.
        let resident = track(Kind::Bytes, None, |t| 10e6 + t * 2e6);
        assert!(resident.verdict(10.0, false).1);
    }

    #[test]
    fn sqlite_is_taken_from_the_heap_in_use_at_the_same_scrape() {
        let mut series = Series::default();
        series.point("collector heap in use".into(), Kind::Bytes, 1.0, 30e6);
        series.point(
            "collector sqlite_memory bytes".into(),
            Kind::Bytes,
            1.0,
            12e6,
        );
        series.heap_less_sqlite(1.0, "collector");
        // SQLite's gauge was skipped at 2.0; the agent has no SQLite.
        series.point("collector heap in use".into(), Kind::Bytes, 2.0, 31e6);
        series.heap_less_sqlite(2.0, "collector");
        series.point("agent heap in use".into(), Kind::Bytes, 2.0, 9e6);
        series.heap_less_sqlite(2.0, "agent");
        let derived: Vec<&str> = series
            .0
            .keys()
            .filter(|name| name.ends_with("less sqlite"))
            .map(String::as_str)
            .collect();
        assert_eq!(derived, ["collector heap in use less sqlite"]);
        assert_eq!(
            series.0["collector heap in use less sqlite"].points,
            [(1.0, 18e6)]
        );
    }

    #[test]
    fn reads_state_gauges_their_bounds_and_the_queue() {
        let mut series = Series::default();
        let text = "# HELP stackscope_agent_state_entries Entries.\n\
                    stackscope_agent_state_entries{state=\"process_table\"} 12.0\n\
                    stackscope_agent_state_max_entries{state=\"process_table\"} 4096.0\n\
                    stackscope_agent_state_bytes{state=\"unwind_tables\"} 1048576.0\n\
                    stackscope_agent_export_queue_bytes 300\n\
                    stackscope_collector_state_entries{state=\"query_frames\"} 5.0\n\
                    stackscope_agent_walks_total{end=\"root\"} 50\n\
                    process_heap_bytes{use=\"in_use\"} 2048.0\n\
                    process_heap_bytes{use=\"free\"} 512.0\n";
        series.read_metrics(1.0, "agent", text);
        let names: Vec<&str> = series.0.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            [
                "agent export queue",
                "agent heap free",
                "agent heap in use",
                "agent process_table",
                "agent unwind_tables bytes"
            ]
        );
        assert_eq!(series.0["agent heap in use"].points, [(1.0, 2048.0)]);
        assert_eq!(series.0["agent heap free"].points, [(1.0, 512.0)]);
        assert_eq!(series.0["agent process_table"].bound, Some(4096.0));
        assert_eq!(series.0["agent process_table"].points, [(1.0, 12.0)]);
        assert_eq!(
            series.0["agent unwind_tables bytes"].points,
            [(1.0, 1048576.0)]
        );
        assert_eq!(series.0["agent export queue"].points, [(1.0, 300.0)]);
    }
}
