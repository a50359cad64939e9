//! Faults a fleet meets, with real parts only (root): the collector's disk
//! fills up, the collector is killed with SIGKILL while agents push, and an
//! agent is killed with SIGKILL. The real collector binary on a real SQLite
//! file, the real agent with its BPF program, gRPC on 127.0.0.1.
//!
//! What a fault must not lose is counted exactly: every batch the collector
//! acknowledged is stored, whole, once; an agent's report of what it had
//! acknowledged equals what the collector holds for its node.

use std::{
    collections::{HashMap, HashSet},
    fs::File,
    io::Write as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use stackscope_proto::v1::{
    Batch, Location, PushRequest, Sample, Stack, ingest_client::IngestClient,
};
use stackscope_test_fixtures::{C_FLAGS, batches::batch, metric, workspace_binary};
use stackscope_tests::{
    Collector, Fixture, RunningProcess, exclusive, free_port, http_get, require_root,
    wait_until_loaded,
};
use tonic::{Code, Status, transport::Channel};

/// The metadata a collector sends with a refusal that a later retry may
/// overcome (gRFC A6's server pushback).
const PUSHBACK: &str = "grpc-retry-pushback-ms";

/// A tmpfs of a fixed size, mounted for one test and unmounted on drop
/// (lazily, if something still has a file open in it), the mount point
/// removed after.
struct Tmpfs {
    mount_point: tempfile::TempDir,
}

impl Tmpfs {
    fn mount(size: &str) -> Self {
        let mount_point = tempfile::tempdir().expect("a mount point");
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0700")])
            .arg("stackscope-faults")
            .arg(mount_point.path())
            .status()
            .expect("running mount");
        assert!(status.success(), "mounting a tmpfs failed: {status}");
        Self { mount_point }
    }

    fn path(&self) -> &Path {
        self.mount_point.path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let unmounted = Command::new("umount")
            .arg(self.path())
            .status()
            .is_ok_and(|s| s.success())
            || Command::new("umount")
                .arg("--lazy")
                .arg(self.path())
                .status()
                .is_ok_and(|s| s.success());
        if !unmounted {
            eprintln!("could not unmount the test tmpfs {}", self.path().display());
        }
    }
}

/// Writes `path` until the filesystem has no room left; returns the bytes
/// written.
fn fill_up(path: &Path) -> u64 {
    let mut file = File::create(path).expect("creating the filler file");
    let mut chunk = vec![0xa5u8; 1 << 20];
    let mut written = 0u64;
    loop {
        match file.write(&chunk) {
            Ok(0) => break,
            Ok(n) => written += n as u64,
            Err(err) if err.raw_os_error() == Some(libc::ENOSPC) => {
                // tmpfs hands out pages: end with page-sized writes.
                if chunk.len() <= 4096 {
                    break;
                }
                chunk.truncate(chunk.len() / 2);
            }
            Err(err) => panic!("filling {}: {err}", path.display()),
        }
    }
    written
}

/// Waits up to `limit` for `done`, failing with `what` and `context()`.
fn wait_for(
    what: &str,
    limit: Duration,
    mut done: impl FnMut() -> bool,
    context: impl Fn() -> String,
) {
    let started = Instant::now();
    while !done() {
        assert!(
            started.elapsed() < limit,
            "{what}: not within {limit:?}\n{}",
            context()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `host:port` of an `http://host:port` address.
fn host_port(url: &str) -> &str {
    url.trim_start_matches("http://")
}

/// Total weight the collector holds for samples matching `matchers` in the
/// last 10 minutes (0 when none match yet).
fn stored_weight(collector: &Collector, matchers: &str) -> u64 {
    let out = Command::new(workspace_binary("stackscope"))
        .args(["--collector", &collector.grpc])
        .args([
            "export", "--format", "folded", "--since", "10m", "--match", matchers,
        ])
        .output()
        .expect("running stackscope");
    let error = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() && error.contains("no samples match") {
        return 0;
    }
    assert!(out.status.success(), "stackscope export failed: {error}");
    stackscope_tests::folded(&out.stdout)
        .iter()
        .map(|(_, n)| n)
        .sum()
}

/// A running agent binary whose standard error goes to a file, killed on
/// drop.
struct Agent {
    process: RunningProcess,
    log: PathBuf,
    metrics: String,
}

impl Agent {
    /// Starts the agent on `pid` only, with its metrics on a free port and
    /// `args` besides.
    fn start(pid: u32, log_dir: &Path, name: &str, args: &[&str]) -> Self {
        let log = log_dir.join(format!("{name}.log"));
        let metrics = format!("127.0.0.1:{}", free_port());
        let child = Command::new(workspace_binary("stackscope-agent"))
            .args(["--pid", &pid.to_string(), "--metrics-address", &metrics])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(File::create(&log).expect("the agent's log file"))
            .spawn()
            .expect("starting the agent");
        Self {
            process: RunningProcess::adopt(child),
            log,
            metrics,
        }
    }

    fn metric(&self, series: &str) -> Option<f64> {
        metric(&self.metrics, &format!("stackscope_agent_{series}"))
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Stops the agent with SIGTERM and returns its JSON report.
    fn stop(self) -> serde_json::Value {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.process.pid() as i32, libc::SIGTERM) };
        self.report()
    }

    /// Waits (up to a minute) for the agent to exit successfully and
    /// returns its JSON report.
    fn report(mut self) -> serde_json::Value {
        let started = Instant::now();
        while self
            .process
            .child
            .try_wait()
            .expect("polling the agent")
            .is_none()
        {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "the agent did not stop; its log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let out = self.process.wait_with_output();
        assert!(
            out.status.success(),
            "the agent exited with {}; its log:\n{}",
            out.status,
            self.log()
        );
        serde_json::from_slice(&out.stdout).expect("the agent's JSON report")
    }
}

/// What a test-side pusher sent: every batch id with its weight, and which
/// ones the collector acknowledged.
#[derive(Debug, Default)]
struct Ledger {
    weights: HashMap<Vec<u8>, u64>,
    acked: HashSet<Vec<u8>>,
}

impl Ledger {
    fn acked_weight(&self) -> u64 {
        self.acked.iter().map(|id| self.weights[id]).sum()
    }
}

/// A 16-byte batch id no other run or test uses: a tag, this process, a
/// sequence number.
fn batch_id(tag: u8, seq: u64) -> Vec<u8> {
    let mut id = vec![tag, 0xfa, 0x17];
    id.extend_from_slice(&std::process::id().to_le_bytes());
    id.extend_from_slice(&seq.to_le_bytes());
    id.push(0x5);
    id
}

/// A batch from `node` with `stacks` stacks no other batch has (a new leaf
/// location each), one sample each: every one of them takes new rows, so
/// pushing such batches fills a disk quickly.
fn bulky_batch(tag: u8, seq: u64, node: &str, stacks: u32) -> Batch {
    let mut bulky = batch(0, node, "bulky", 1, 0);
    bulky.batch_id = batch_id(tag, seq);
    let base = bulky.locations.len() as u32;
    for i in 0..stacks {
        bulky.locations.push(Location {
            mapping: 0,
            address: 0x10_0000 + (seq << 24) + u64::from(i) * 16,
            lines: Vec::new(),
        });
        bulky.stacks.push(Stack {
            locations: vec![base + i, 1, 0],
        });
        bulky.samples.push(Sample {
            stack: bulky.stacks.len() as u32 - 1,
            label_set: 0,
            count: 1,
            sampling_divisor: 0,
        });
    }
    bulky
}

fn weight(batch: &Batch) -> u64 {
    batch.samples.iter().map(|s| s.count.max(1)).sum()
}

fn client(grpc: &str) -> IngestClient<Channel> {
    // Lazy: it reconnects by itself to a collector that went away and came back.
    IngestClient::new(
        tonic::transport::Endpoint::from_shared(grpc.to_string())
            .expect("the collector's address")
            .timeout(Duration::from_secs(20))
            .connect_lazy(),
    )
}

async fn push(client: &mut IngestClient<Channel>, batch: &Batch) -> Result<(), Status> {
    client
        .push(PushRequest {
            batch: Some(batch.clone()),
        })
        .await
        .map(|_| ())
}

/// Batch ids the database at `path` holds, read with a connection of our
/// own, after checking the file is intact.
fn stored_batch_ids(path: &Path) -> HashSet<Vec<u8>> {
    let db =
        rusqlite::Connection::open_with_flags(path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .expect("opening the collector's database");
    let check: String = db
        .query_row("PRAGMA integrity_check", [], |row| row.get(0))
        .expect("checking the database");
    assert_eq!(check, "ok", "the database at {} is damaged", path.display());
    let mut ids = db
        .prepare("SELECT id FROM batches")
        .expect("reading batch ids");
    ids.query_map([], |row| row.get::<_, Vec<u8>>(0))
        .expect("reading batch ids")
        .collect::<Result<_, _>>()
        .expect("reading batch ids")
}

#[test]
fn a_full_disk_refuses_batches_until_space_returns_and_loses_nothing() {
    require_root();
    let _serial = exclusive();
    let work = tempfile::tempdir().expect("temp dir");
    let disk = Tmpfs::mount("24m");
    let data = disk.path().join("data");
    let collector = Collector::start(&data);
    let collector_http = host_port(&collector.http).to_string();
    let spinner = Fixture::compile("call_chain", C_FLAGS).start(&[]);
    let node = format!("faults-full-{}", std::process::id());
    let agent = Agent::start(
        spinner.pid(),
        work.path(),
        "agent",
        &[
            "--collector",
            &collector.grpc,
            "--frequency",
            "199",
            "--interval",
            "1s",
            "--node-name",
            &node,
            "--no-table-cache",
            "--json",
        ],
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let mut client = runtime.block_on(async { client(&collector.grpc) });
    let pusher_node = format!("faults-full-pusher-{}", std::process::id());
    let mut ledger = Ledger::default();
    let mut seq = 0u64;
    let mut next_batch = |ledger: &mut Ledger| {
        seq += 1;
        let batch = bulky_batch(1, seq, &pusher_node, 1000);
        ledger
            .weights
            .insert(batch.batch_id.clone(), weight(&batch));
        batch
    };

    // Before: batches are stored as usual.
    for _ in 0..3 {
        let batch = next_batch(&mut ledger);
        runtime
            .block_on(push(&mut client, &batch))
            .expect("a push with room on the disk");
        ledger.acked.insert(batch.batch_id);
    }
    wait_for(
        "the agent's first batches stored",
        Duration::from_secs(60),
        || agent.metric("export_batches_total{result=\"stored\"}") >= Some(2.0),
        || agent.log(),
    );

    // The disk fills up (a filler file takes every free page). The
    // database's log may still have room it allocated before, so batches
    // go on until one needs a page the disk no longer has.
    let filler = disk.path().join("filler");
    let filled = fill_up(&filler);
    eprintln!("filler: {filled} bytes");
    let mut attempts = 0;
    let (refused, status) = loop {
        attempts += 1;
        assert!(
            attempts <= 300,
            "300 batches of new rows fit on a full disk"
        );
        let batch = next_batch(&mut ledger);
        match runtime.block_on(push(&mut client, &batch)) {
            Ok(()) => {
                ledger.acked.insert(batch.batch_id);
            }
            Err(status) => break (batch, status),
        }
    };
    eprintln!(
        "refused after {} batches acknowledged: {status:?}",
        ledger.acked.len()
    );
    assert_eq!(
        status.code(),
        Code::ResourceExhausted,
        "a full disk's answer: {status:?}; the collector's log:\n{}",
        collector.log().join("\n")
    );
    assert!(
        status.message().contains("disk is full"),
        "the refusal says why: {:?}",
        status.message()
    );
    assert!(
        status.metadata().get(PUSHBACK).is_some(),
        "the refusal tells agents to retry ({PUSHBACK}): {status:?}"
    );

    // While it is full: the collector is alive, says its disk is full,
    // answers queries, and holds everything it acknowledged.
    assert_eq!(
        http_get(&collector_http, "/healthz").map(|(s, _)| s),
        Some(200)
    );
    assert_eq!(
        metric(&collector_http, "stackscope_collector_storage_full"),
        Some(1.0),
        "the collector's metrics say the disk is full"
    );
    assert!(
        metric(
            &collector_http,
            "stackscope_collector_ingest_batches_total{result=\"disk_full\"}"
        ) >= Some(1.0)
    );
    let pusher_match = format!("node=\"{pusher_node}\"");
    assert_eq!(
        stored_weight(&collector, &pusher_match),
        ledger.acked_weight(),
        "what was acknowledged before the disk filled"
    );
    // The agent keeps its batches and retries them: none is rejected.
    let retries_before = agent.metric("export_retries_total").unwrap_or(0.0);
    wait_for(
        "the agent retrying while the disk is full",
        Duration::from_secs(60),
        || {
            agent.metric("export_retries_total").unwrap_or(0.0) >= retries_before + 2.0
                && agent.metric("export_queue_batches") >= Some(1.0)
        },
        || agent.log(),
    );
    assert_eq!(
        agent.metric("export_batches_total{result=\"rejected\"}"),
        Some(0.0),
        "the agent dropped batches as rejected:\n{}",
        agent.log()
    );
    assert!(
        agent.log().contains("the collector's disk is full"),
        "the agent says why it retries:\n{}",
        agent.log()
    );

    // Space returns: ingest resumes by itself, the refused batch and the
    // agent's queue land.
    std::fs::remove_file(&filler).expect("removing the filler");
    let started = Instant::now();
    loop {
        match runtime.block_on(push(&mut client, &refused)) {
            Ok(()) => break,
            Err(status) => assert!(
                started.elapsed() < Duration::from_secs(60),
                "ingest did not resume once space returned: {status:?}"
            ),
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    ledger.acked.insert(refused.batch_id.clone());
    wait_for(
        "the agent's queue delivered",
        Duration::from_secs(120),
        || agent.metric("export_queue_batches") == Some(0.0),
        || agent.log(),
    );
    assert_eq!(
        metric(&collector_http, "stackscope_collector_storage_full"),
        Some(0.0),
        "the collector's metrics say there is room again"
    );

    let report = agent.stop();
    let export = &report["export"];
    eprintln!("agent export: {export}");
    assert_eq!(export["batches_rejected"], 0, "{export}");
    assert_eq!(export["batches_dropped_queue_full"], 0, "{export}");
    assert_eq!(export["queued_batches"], 0, "{export}");
    assert!(export["retries"].as_u64() >= Some(2), "{export}");
    // Everything the agent got an OK for is there, once.
    let sent = export["samples_sent"].as_u64().expect("samples_sent");
    assert!(sent > 0);
    assert_eq!(stored_weight(&collector, &format!("node=\"{node}\"")), sent);
    assert_eq!(
        stored_weight(&collector, &pusher_match),
        ledger.acked_weight()
    );

    // A clean stop, an intact database holding every acknowledged batch.
    // (Our connection goes first: the collector's graceful stop waits for
    // its clients to close theirs, and nothing would drive this one.)
    drop(client);
    drop(runtime);
    collector.stop();
    let stored = stored_batch_ids(&data.join("stackscope.db"));
    let lost: Vec<_> = ledger.acked.difference(&stored).collect();
    assert!(lost.is_empty(), "acknowledged batches missing: {lost:?}");
}

/// Test-side pushers on a thread of their own, stopped on drop (also when
/// the test fails).
struct Pushers {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Pushers {
    /// Stops pushing and waits for the pushes in flight.
    fn stop(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            thread.join().expect("the pushers");
        }
    }
}

impl Drop for Pushers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Pushes small batches from `tasks` concurrent clients as fast as the
/// collector takes them, until stopped; every batch gets a new id, whether
/// the last one was acknowledged or not.
fn push_continuously(
    grpc: String,
    node: String,
    tasks: u8,
    ledger: Arc<Mutex<Ledger>>,
    in_flight: Arc<AtomicUsize>,
) -> Pushers {
    let stop = Arc::new(AtomicBool::new(false));
    let stopping = Arc::clone(&stop);
    let thread = std::thread::spawn(move || {
        let stop = stopping;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime");
        runtime.block_on(async move {
            let mut set = tokio::task::JoinSet::new();
            for task in 0..tasks {
                let (grpc, node) = (grpc.clone(), node.clone());
                let (ledger, in_flight, stop) = (
                    Arc::clone(&ledger),
                    Arc::clone(&in_flight),
                    Arc::clone(&stop),
                );
                set.spawn(async move {
                    let mut client = client(&grpc);
                    let mut seq = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        seq += 1;
                        let count = 1 + seq % 7;
                        let mut batch = batch(0, &node, "pusher", count, 1);
                        batch.batch_id = batch_id(0x10 + task, seq);
                        ledger
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .weights
                            .insert(batch.batch_id.clone(), weight(&batch));
                        in_flight.fetch_add(1, Ordering::SeqCst);
                        let result = push(&mut client, &batch).await;
                        in_flight.fetch_sub(1, Ordering::SeqCst);
                        match result {
                            Ok(()) => {
                                ledger
                                    .lock()
                                    .unwrap_or_else(PoisonError::into_inner)
                                    .acked
                                    .insert(batch.batch_id);
                            }
                            // The collector is down: try again shortly.
                            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                        }
                    }
                });
            }
            while set.join_next().await.is_some() {}
        });
    });
    Pushers {
        stop,
        thread: Some(thread),
    }
}

#[test]
fn a_collector_killed_mid_transaction_loses_nothing_acknowledged() {
    require_root();
    let _serial = exclusive();
    let work = tempfile::tempdir().expect("temp dir");
    let data = work.path().join("data");
    // A fixed port, so agents find the restarted collector where they left it.
    let grpc_listen = format!("127.0.0.1:{}", free_port());
    let collector = Collector::start_listening(&data, &grpc_listen, &[]);
    let spinner = Fixture::compile("call_chain", C_FLAGS).start(&[]);
    let node = format!("faults-kill-{}", std::process::id());
    let agent = Agent::start(
        spinner.pid(),
        work.path(),
        "agent",
        &[
            "--collector",
            &collector.grpc,
            "--frequency",
            "997",
            "--interval",
            "1s",
            "--node-name",
            &node,
            "--no-table-cache",
            "--json",
        ],
    );
    let pusher_node = format!("faults-kill-pusher-{}", std::process::id());
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let in_flight = Arc::new(AtomicUsize::new(0));
    let pushers = push_continuously(
        collector.grpc.clone(),
        pusher_node.clone(),
        4,
        Arc::clone(&ledger),
        Arc::clone(&in_flight),
    );
    let acked = || {
        ledger
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .acked
            .len()
    };
    wait_for(
        "batches stored before the kill",
        Duration::from_secs(60),
        || acked() >= 300 && agent.metric("export_batches_total{result=\"stored\"}") >= Some(2.0),
        || format!("{} pushed; agent:\n{}", acked(), agent.log()),
    );

    let pushing = in_flight.load(Ordering::SeqCst);
    let acked_at_kill = acked();
    collector.kill();
    eprintln!("killed with {pushing} pushes in flight, {acked_at_kill} acknowledged");
    // Agents and pushers find nobody for a moment.
    std::thread::sleep(Duration::from_secs(1));

    // The same data directory: SQLite recovers its write-ahead log, and the
    // database is intact.
    let collector = Collector::start_listening(&data, &grpc_listen, &[]);
    let database = data.join("stackscope.db");
    stored_batch_ids(&database);
    wait_for(
        "batches stored after the restart",
        Duration::from_secs(60),
        || acked() >= acked_at_kill + 100,
        || {
            format!(
                "{} pushed; collector:\n{}",
                acked(),
                collector.log().join("\n")
            )
        },
    );
    pushers.stop();

    let report = agent.stop();
    let export = &report["export"];
    eprintln!("agent export: {export}");
    assert_eq!(export["batches_rejected"], 0, "{export}");
    assert_eq!(export["batches_dropped_queue_full"], 0, "{export}");
    assert_eq!(export["queued_batches"], 0, "{export}");
    let sent = export["samples_sent"].as_u64().expect("samples_sent");
    assert!(sent > 0);
    // Acknowledged before the kill, retried across it (a commit whose
    // answer was lost comes back as a duplicate), after it: each once.
    assert_eq!(stored_weight(&collector, &format!("node=\"{node}\"")), sent);

    // Every batch acknowledged is stored, and every batch stored is whole:
    // the stored weight is exactly that of the batch ids the database has.
    let ledger = ledger.lock().unwrap_or_else(PoisonError::into_inner);
    let stored_weight_now = stored_weight(&collector, &format!("node=\"{pusher_node}\""));
    collector.stop();
    let stored = stored_batch_ids(&database);
    let lost: Vec<_> = ledger.acked.difference(&stored).collect();
    assert!(
        lost.is_empty(),
        "{} acknowledged batches missing",
        lost.len()
    );
    let stored_of_ours: u64 = ledger
        .weights
        .iter()
        .filter(|(id, _)| stored.contains(*id))
        .map(|(_, w)| w)
        .sum();
    assert_eq!(stored_weight_now, stored_of_ours);
    eprintln!(
        "{} batches acknowledged, {} stored, {} sent",
        ledger.acked.len(),
        ledger
            .weights
            .keys()
            .filter(|id| stored.contains(*id))
            .count(),
        ledger.weights.len()
    );
}

/// The `.table` files of the unwind table cache in `dir`, sorted.
fn table_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|entry| entry.path())
                .filter(|path| path.extension().is_some_and(|ext| ext == "table"))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

#[test]
fn an_agent_killed_leaves_nothing_loaded_and_the_next_reuses_its_tables() {
    require_root();
    let _serial = exclusive();
    let work = tempfile::tempdir().expect("temp dir");
    let cache = work.path().join("tables");
    let spinner = Fixture::compile("call_chain", C_FLAGS).start(&[]);
    let cache_arg = cache.to_str().expect("a UTF-8 path");
    let mut agent = Agent::start(
        spinner.pid(),
        work.path(),
        "killed",
        &["--frequency", "199", "--table-cache-dir", cache_arg],
    );
    let pid = agent.process.pid();
    let held = wait_until_loaded(&mut agent.process);
    eprintln!("the agent holds {held:?}");
    assert!(!held.maps.is_empty() && !held.links.is_empty(), "{held:?}");
    // Its tables are compiled and cached: the fixture's binary and libc.
    wait_for(
        "tables compiled",
        Duration::from_secs(60),
        || agent.metric("unwind_tables_total{source=\"compiled\"}") >= Some(2.0),
        || agent.log(),
    );
    let tables = table_files(&cache);
    assert!(tables.len() >= 2, "{tables:?}");

    // SIGKILL: no exit path runs. The kernel drops what only the agent's
    // descriptors held; nothing is pinned (a pinned object would stay
    // loaded).
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    let status = agent.process.child.wait().expect("waiting for the agent");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGKILL)
    );
    held.assert_released("after SIGKILL");

    // What a write cut short leaves: the killed agent's temporary file
    // (half a table, next to a whole one), and a table file cut in half
    // under its final name (a power cut before the data reached the disk).
    let (cut, kept) = (&tables[0], &tables[1]);
    let whole = std::fs::read(cut).expect("reading a cached table");
    std::fs::write(cut, &whole[..whole.len() / 2]).expect("cutting a table file");
    let stem = kept.file_stem().expect("a file name").to_string_lossy();
    let leftover = cache.join(format!("{stem}.tmp.{pid}"));
    let kept_bytes = std::fs::read(kept).expect("reading a cached table");
    std::fs::write(&leftover, &kept_bytes[..kept_bytes.len() / 2]).expect("a leftover");

    // The next agent starts cleanly, reads the whole tables from disk and
    // compiles the cut one again rather than trust it.
    let next = Agent::start(
        spinner.pid(),
        work.path(),
        "next",
        &[
            "--frequency",
            "199",
            "--table-cache-dir",
            cache_arg,
            "--duration",
            "4s",
            "--json",
        ],
    );
    let report = next.report();
    let unwinding = &report["unwinding"];
    eprintln!("the next agent's unwinding: {unwinding}");
    assert!(report["kernel"]["samples"].as_u64() > Some(0), "{report}");
    assert!(
        unwinding["tables_from_disk"].as_u64() >= Some(1),
        "{unwinding}"
    );
    assert!(
        unwinding["tables_compiled"].as_u64() >= Some(1),
        "{unwinding}"
    );
    assert_eq!(unwinding["tables_failed"], 0, "{unwinding}");
    assert_eq!(
        std::fs::read(cut).expect("the rewritten table"),
        whole,
        "the cut table is compiled and written again, whole"
    );
    assert_eq!(std::fs::read(kept).expect("the kept table"), kept_bytes);
    assert!(
        !leftover.exists(),
        "the killed agent's temporary file is left behind"
    );
    // And its walks are right: the fixture's own chain, to the root.
    let walks = unwinding["walks"].as_u64().unwrap_or(0);
    let outermost = unwinding["outermost"].as_u64().unwrap_or(0);
    assert!(walks > 0 && outermost * 10 >= walks * 9, "{unwinding}");
}

/// A client that opens a connection and then says nothing (a stalled or
/// hung agent) does not keep the collector from stopping on SIGTERM: it
/// waits for clients a while, then closes what is left and exits cleanly.
#[test]
fn a_stalled_client_does_not_keep_the_collector_from_stopping() {
    let data = tempfile::tempdir().expect("temp dir");
    let grpc = format!("127.0.0.1:{}", stackscope_tests::free_port());
    let mut collector = stackscope_test_fixtures::RunningProcess::adopt(
        Command::new(workspace_binary("stackscope-collector"))
            .arg("--data-dir")
            .arg(data.path())
            .args(["--grpc-listen", &grpc, "--no-http"])
            .spawn()
            .expect("starting the collector"),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut stalled = loop {
        match std::net::TcpStream::connect(&grpc) {
            Ok(stream) => break stream,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
            Err(err) => panic!("the collector never listened on {grpc}: {err}"),
        }
    };
    // An HTTP/2 client's preface, then silence.
    stalled
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .expect("writing the preface");
    std::thread::sleep(Duration::from_millis(500));
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(collector.pid() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = collector
            .child
            .try_wait()
            .expect("waiting for the collector")
        {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the collector still runs a minute after SIGTERM with a stalled client"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(status.success(), "the collector exited with {status}");
    drop(stalled);
}
