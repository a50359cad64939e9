//! `cargo xtask bench collector`: ingest rate and flamegraph query latency of
//! the embedded SQLite storage and of ClickHouse (a two-shard cluster of real
//! servers) under the same synthetic fleet, side by side (a report, not a
//! test: it prints figures, it never fails on them).
//!
//! The load: `NODES` nodes (default 100), each sending every 10 s a batch of
//! 2,000 distinct stacks of depth 30 with 1-8 samples each, for `MINUTES`
//! (default 60) of simulated time. Nodes run overlapping sets of services,
//! so stacks repeat across the fleet as they do in real fleets. Ingest is
//! validate + commit on one thread (one core); queries run the collector's
//! own path: `QueryEngine::flamegraph` (storage, query-time naming, call
//! tree merge), proto encoding. Each query runs once on SQLite before the
//! compactor rolls the data up (the answer from the base rows, the
//! reference) and then timed after it; every timed answer, on either engine,
//! must be that same tree. `STACKSCOPE_BENCH_CLICKHOUSE=0` leaves ClickHouse
//! out; `STACKSCOPE_BENCH_KEEP_DATA_DIR=DIR` keeps the compacted SQLite
//! database as a collector's data directory;
//! `STACKSCOPE_BENCH_DICTIONARY_EPOCH_SECS=60` writes dictionary rows again
//! in every bucket, as the collector did before it kept them per hour (the
//! ingest line after it says how much it writes to disk).

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

#[path = "../tests/support/clickhouse_servers.rs"]
mod clickhouse_servers;

use prost::Message as _;
use rand::{Rng as _, SeedableRng as _, rngs::StdRng};
use stackscope_collector::{
    debuginfo::{DiskStore, symbolize::Symbolizer},
    ingest::{IngestLimits, validate},
    query::QueryEngine,
    storage::{
        Storage,
        clickhouse::{ClickhouseConfig, ClickhouseOptions, ClickhouseStorage},
        sqlite::{CommitStats, SqliteOptions, SqliteStorage},
    },
};
use stackscope_profile::model::{LabelMatcher, MatchOp, Selection, TimeRange, unix_nanos};
use stackscope_proto::v1::FlamegraphResponse;
use stackscope_proto::v1::{
    Batch, Label, LabelSet, Line, Location, Mapping, MappingKind, Node, Sample, Stack,
};

const STACKS_PER_NODE: usize = 2_000;
const DEPTH: usize = 30;
/// How often each node sends a batch, unless `STACKSCOPE_BENCH_INTERVAL_SECS`
/// says otherwise: a day of data at 60 s holds the same rows per bucket as at
/// 10 s (each node sends the same 2,000 stacks every interval) and ingests
/// six times faster.
const INTERVAL: Duration = Duration::from_secs(10);
/// Distinct stacks in the whole fleet; each node uses a window of them.
const FLEET_STACKS: usize = 20_000;
const SERVICES: usize = 20;
const FUNCTIONS: usize = 10_000;
const BINARIES: usize = 50;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A seeded generator: every run sees the same data.
struct Rng(StdRng);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(StdRng::seed_from_u64(seed))
    }

    fn below(&mut self, n: usize) -> usize {
        self.0.random_range(0..n)
    }
}

/// A fleet-wide stack: function ids, root first. The first third is the
/// service's own call path, so stacks share prefixes like real ones.
fn fleet_stacks() -> Vec<[u32; DEPTH]> {
    let mut rng = Rng::new(7);
    let prefixes: Vec<[u32; DEPTH / 3]> = (0..SERVICES)
        .map(|_| std::array::from_fn(|_| rng.below(FUNCTIONS) as u32))
        .collect();
    (0..FLEET_STACKS)
        .map(|k| {
            let prefix = &prefixes[k % SERVICES];
            std::array::from_fn(|i| {
                if i < prefix.len() {
                    prefix[i]
                } else {
                    rng.below(FUNCTIONS) as u32
                }
            })
        })
        .collect()
}

/// The batch a node sends every interval, with counts filled in per
/// interval by [`interval_batch`].
fn node_template(node: usize, fleet: &[[u32; DEPTH]]) -> Batch {
    let mut strings = vec![String::new()];
    let mut string_ids: HashMap<String, u32> = HashMap::new();
    let mut intern = |s: String, strings: &mut Vec<String>| -> u32 {
        *string_ids.entry(s.clone()).or_insert_with(|| {
            strings.push(s);
            (strings.len() - 1) as u32
        })
    };
    let node_name = intern(format!("node-{node:03}"), &mut strings);
    let version = intern("bench".into(), &mut strings);
    let mappings: Vec<Mapping> = (0..BINARIES)
        .map(|b| Mapping {
            kind: MappingKind::User as i32,
            build_id: intern(
                format!("{:040x}", b as u128 * 0x1234_5678_9abc),
                &mut strings,
            ),
            path: intern(format!("/usr/lib/libservice{b}.so"), &mut strings),
            load_segments: Vec::new(),
        })
        .collect();
    let file = intern("src/service.rs".into(), &mut strings);
    let comm_name = intern("comm".into(), &mut strings);
    let mut locations = Vec::new();
    let mut location_ids: HashMap<u32, u32> = HashMap::new();
    let mut stacks = Vec::with_capacity(STACKS_PER_NODE);
    let mut label_set_of_stack = Vec::with_capacity(STACKS_PER_NODE);
    let mut label_sets: Vec<LabelSet> = Vec::new();
    let mut label_set_ids: HashMap<usize, u32> = HashMap::new();
    let first = node * 997 % FLEET_STACKS;
    for k in 0..STACKS_PER_NODE {
        let index = (first + k) % FLEET_STACKS;
        let functions = &fleet[index];
        let ids: Vec<u32> = functions
            .iter()
            .rev() // leaf first on the wire
            .map(|&function| {
                *location_ids.entry(function).or_insert_with(|| {
                    let name = intern(
                        format!("service::module{}::function_{function}", function % 97),
                        &mut strings,
                    );
                    locations.push(Location {
                        mapping: function % BINARIES as u32,
                        address: 0x1000 + u64::from(function) * 0x40,
                        lines: vec![Line {
                            function: name,
                            file,
                            line: function % 500,
                        }],
                    });
                    (locations.len() - 1) as u32
                })
            })
            .collect();
        stacks.push(Stack { locations: ids });
        let service = index % SERVICES;
        let set = *label_set_ids.entry(service).or_insert_with(|| {
            let value = intern(format!("svc-{service}"), &mut strings);
            label_sets.push(LabelSet {
                labels: vec![Label {
                    name: comm_name,
                    value,
                }],
            });
            (label_sets.len() - 1) as u32
        });
        label_set_of_stack.push(set);
    }
    Batch {
        batch_id: Vec::new(),
        node: Some(Node {
            name: node_name,
            agent_version: version,
        }),
        start_unix_nanos: 0,
        end_unix_nanos: 0,
        sample_period_nanos: 10_101_010,
        strings,
        mappings,
        locations,
        stacks,
        label_sets,
        samples: label_set_of_stack
            .into_iter()
            .enumerate()
            .map(|(stack, label_set)| Sample {
                stack: stack as u32,
                label_set,
                count: 0,
                sampling_divisor: 0,
            })
            .collect(),
        typed_samples: Vec::new(),
    }
}

fn interval_batch(
    template: &Batch,
    id: u64,
    (start, end): (i64, i64),
    rng: &mut Rng,
) -> (Batch, u64) {
    let mut batch = template.clone();
    let mut id_bytes = id.to_le_bytes().to_vec();
    id_bytes.extend_from_slice(&0xbe9c_u64.to_le_bytes());
    batch.batch_id = id_bytes;
    batch.start_unix_nanos = start;
    batch.end_unix_nanos = end;
    let mut samples = 0;
    for sample in &mut batch.samples {
        sample.count = 1 + rng.below(8) as u64;
        samples += sample.count;
    }
    (batch, samples)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let at = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[at.min(sorted.len() - 1)]
}

/// The simulated fleet: what every engine ingests, batch for batch.
struct Fleet {
    templates: Vec<Batch>,
    /// How often each node sends a batch, and how many times.
    interval: Duration,
    intervals: usize,
    first_start: i64,
}

/// What ingesting the fleet cost one engine.
struct Ingested {
    seconds: f64,
    batches: u64,
    rows: u64,
    samples: u64,
    wire_bytes: u64,
    first_interval_rate: f64,
}

/// Validates and stores every batch of the fleet on one thread, as one
/// collector's ingest does.
fn ingest_fleet(storage: &dyn Storage, fleet: &Fleet, progress: bool) -> Ingested {
    let limits = IngestLimits::default();
    let nodes = fleet.templates.len();
    // The same seed for every engine: the same counts.
    let mut rng = Rng::new(42);
    let mut ingest_time = Duration::ZERO;
    let (mut batches, mut rows, mut samples, mut wire_bytes) = (0u64, 0u64, 0u64, 0u64);
    let mut first_interval_rate = 0.0;
    for interval in 0..fleet.intervals {
        let start = fleet.first_start + interval as i64 * fleet.interval.as_nanos() as i64;
        let interval_began = (ingest_time, samples);
        for (node, template) in fleet.templates.iter().enumerate() {
            let id = (interval * nodes + node) as u64;
            let range = (start, start + fleet.interval.as_nanos() as i64);
            let (batch, batch_samples) = interval_batch(template, id, range, &mut rng);
            wire_bytes += batch.encoded_len() as u64;
            let began = Instant::now();
            let valid = validate(batch, &limits).expect("a valid batch");
            storage.ingest(&valid).expect("ingest");
            ingest_time += began.elapsed();
            batches += 1;
            rows += STACKS_PER_NODE as u64;
            samples += batch_samples;
        }
        if interval == 0 {
            let spent = (ingest_time - interval_began.0).as_secs_f64();
            first_interval_rate = (samples - interval_began.1) as f64 / spent;
        }
        // A line per hour of data.
        let minutes = (interval + 1) as u64 * fleet.interval.as_secs() / 60;
        let hour = (3600 / fleet.interval.as_secs()).max(1) as usize;
        if progress && (interval + 1) % hour == 0 {
            println!(
                "  {minutes:>4} min ingested: {:.0} samples/s so far",
                samples as f64 / ingest_time.as_secs_f64()
            );
        }
    }
    let ingested = Ingested {
        seconds: ingest_time.as_secs_f64(),
        batches,
        rows,
        samples,
        wire_bytes,
        first_interval_rate,
    };
    println!(
        "  {:.0} samples/s, {:.0} sample rows/s, {:.1} batches/s ({} batches, {:.1} s); \
         first interval (empty database): {:.0} samples/s; target >= 1,000,000 samples/s",
        ingested.samples as f64 / ingested.seconds,
        ingested.rows as f64 / ingested.seconds,
        ingested.batches as f64 / ingested.seconds,
        ingested.batches,
        ingested.seconds,
        ingested.first_interval_rate,
    );
    ingested
}

/// The fleet's first `intervals` intervals stored by `senders` threads at
/// once, as a collector's gRPC handlers store batches that arrive together
/// (agents end their intervals on the same boundaries), into a new
/// database of `options` whose transactions hold `max_group_batches`
/// batches at most: the seconds spent storing, and the commits made.
fn ingest_together(
    fleet: &Fleet,
    intervals: usize,
    senders: usize,
    max_group_batches: usize,
    options: &SqliteOptions,
) -> (f64, CommitStats) {
    let dir = tempfile::tempdir().expect("temp dir");
    let storage = SqliteStorage::open(
        &dir.path().join("together.db"),
        SqliteOptions {
            max_group_batches,
            ..options.clone()
        },
    )
    .expect("database");
    let limits = IngestLimits::default();
    let nodes = fleet.templates.len();
    let mut rng = Rng::new(42);
    let mut spent = Duration::ZERO;
    for interval in 0..intervals {
        let start = fleet.first_start + interval as i64 * fleet.interval.as_nanos() as i64;
        let range = (start, start + fleet.interval.as_nanos() as i64);
        let batches: Vec<_> = fleet
            .templates
            .iter()
            .enumerate()
            .map(|(node, template)| {
                let id = (interval * nodes + node) as u64;
                let (batch, _) = interval_batch(template, id, range, &mut rng);
                validate(batch, &limits).expect("a valid batch")
            })
            .collect();
        let next = std::sync::atomic::AtomicUsize::new(0);
        let began = Instant::now();
        std::thread::scope(|scope| {
            for _ in 0..senders {
                scope.spawn(|| {
                    while let Some(batch) =
                        batches.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
                    {
                        storage.ingest(batch).expect("ingest");
                    }
                });
            }
        });
        spent += began.elapsed();
    }
    (spent.as_secs_f64(), storage.commit_stats())
}

/// The collector's query path over `storage`: every profile read passes
/// the query-time symbolizer (the fleet's frames carry names, so it only
/// looks).
/// The compactor as the collector runs it, until nothing closed before
/// `now` is left: the spans it built and the seconds it took.
fn compact_all(storage: &dyn Storage, now: i64) -> (u64, f64) {
    let began = Instant::now();
    let mut spans = 0;
    loop {
        match storage.compact(now).expect("compaction") {
            0 => return (spans, began.elapsed().as_secs_f64()),
            done => spans += done,
        }
    }
}

fn query_engine(storage: Arc<dyn Storage>, debuginfo_dir: &std::path::Path) -> QueryEngine {
    let debuginfo = DiskStore::open(debuginfo_dir, u64::MAX).expect("store");
    let symbolizer = Symbolizer::start(Arc::new(debuginfo), None).expect("symbolizer");
    QueryEngine::new(storage).with_symbolizer(Arc::new(symbolizer))
}

/// One flamegraph query as the servers answer it: storage, naming, merge,
/// proto encoding.
fn flamegraph(
    runtime: &tokio::runtime::Runtime,
    engine: &QueryEngine,
    selection: &Selection,
) -> (FlamegraphResponse, Duration) {
    let began = Instant::now();
    let flamegraph = runtime
        .block_on(engine.flamegraph(selection.clone(), 0.0, None))
        .expect("query");
    let response = flamegraph.tree.to_proto(flamegraph.sample_period_nanos);
    (response, began.elapsed())
}

/// Runs each query `runs` times, checks every answer against the
/// reference, prints p50 and p95, and returns the p50s.
fn time_queries(
    runtime: &tokio::runtime::Runtime,
    engine: &QueryEngine,
    selections: &[(&str, Selection)],
    reference: &[FlamegraphResponse],
    runs: usize,
    ingested_samples: u64,
) -> Vec<Duration> {
    let mut p50s = Vec::new();
    for ((name, selection), reference) in selections.iter().zip(reference) {
        let mut times = Vec::with_capacity(runs);
        for _ in 0..runs {
            let (response, took) = flamegraph(runtime, engine, selection);
            times.push(took);
            assert!(
                response == *reference,
                "query {name} answered differently from the reference (SQLite's base rows)"
            );
        }
        times.sort();
        println!(
            "  {name:<20} p50 {:>8.1} ms  p95 {:>8.1} ms  ({} tree nodes, {} frames, {:.1} MB \
             encoded, {} samples)",
            percentile(&times, 0.5).as_secs_f64() * 1e3,
            percentile(&times, 0.95).as_secs_f64() * 1e3,
            reference.nodes.len(),
            reference.frames.len(),
            reference.encoded_len() as f64 / 1e6,
            reference.total,
        );
        assert!(reference.total > 0, "query {name} found no samples");
        if selection.matchers.is_empty() {
            // Every batch falls in the range and weighs its sample count
            // (no sampling divisor).
            assert_eq!(
                reference.total, ingested_samples,
                "query {name} lost or invented samples"
            );
        }
        p50s.push(percentile(&times, 0.5));
    }
    p50s
}

/// Copies the compacted database into `data_dir` as a collector's data
/// directory, for `stackscope-collector --data-dir` (the web UI's time to
/// first flamegraph on the fleet, measured by hand).
fn keep_database(sqlite: &SqliteStorage, data_dir: &std::path::Path) {
    std::fs::create_dir_all(data_dir).expect("creating the kept data directory");
    let target = data_dir.join("stackscope.db");
    let _ = std::fs::remove_file(&target);
    // A consistent copy while the storage still holds its connections.
    rusqlite::Connection::open(sqlite.path())
        .and_then(|conn| conn.execute("VACUUM INTO ?1", [target.to_str().expect("a UTF-8 path")]))
        .expect("copying the database into the kept data directory");
    println!("kept the database in {}", data_dir.display());
}

/// The start of the clock hour holding `unix_nanos`: the data starts there,
/// so that which dictionary epochs (an hour by default) a run crosses does
/// not depend on when it runs.
fn hour_start(unix_nanos: i64) -> i64 {
    unix_nanos - unix_nanos.rem_euclid(3_600_000_000_000)
}

/// Bytes this process has caused to be written to storage
/// (`/proc/self/io`), when the kernel tells.
fn bytes_written() -> Option<u64> {
    std::fs::read_to_string("/proc/self/io")
        .ok()?
        .lines()
        .find_map(|line| line.strip_prefix("write_bytes:")?.trim().parse().ok())
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --bench collector` (run by
    // `cargo xtask test`) does not: do one tiny round then, so the bench's
    // data and queries are checked on every test run in seconds.
    let full = std::env::args().any(|arg| arg == "--bench");
    let nodes = env_or("STACKSCOPE_BENCH_NODES", if full { 100 } else { 2 });
    let minutes = env_or("STACKSCOPE_BENCH_MINUTES", if full { 60 } else { 1 });
    let query_runs = env_or("STACKSCOPE_BENCH_QUERY_RUNS", if full { 15 } else { 1 });
    let with_clickhouse = env_or("STACKSCOPE_BENCH_CLICKHOUSE", 1) != 0;
    // The storage's bucket width (the collector's --bucket): the finest
    // time a timeline can show, against more rows per hour.
    let bucket_nanos = env_or("STACKSCOPE_BENCH_BUCKET_SECS", 60) as i64 * 1_000_000_000;
    // How long dictionary rows are kept past their last use (the bucket
    // width: written again in every bucket that uses them).
    let dictionary_epoch_nanos = std::env::var("STACKSCOPE_BENCH_DICTIONARY_EPOCH_SECS")
        .ok()
        .and_then(|secs| secs.parse::<i64>().ok())
        .map_or(SqliteOptions::default().dictionary_epoch_nanos, |secs| {
            secs * 1_000_000_000
        });

    let options = SqliteOptions {
        bucket_nanos,
        dictionary_epoch_nanos,
        ..SqliteOptions::default()
    };

    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("bench.db");
    let sqlite = Arc::new(SqliteStorage::open(&path, options.clone()).expect("database"));
    let fleet_stacks = fleet_stacks();
    let interval = Duration::from_secs(env_or(
        "STACKSCOPE_BENCH_INTERVAL_SECS",
        INTERVAL.as_secs() as usize,
    ) as u64)
    .max(Duration::from_secs(1));
    let intervals = minutes * 60 / interval.as_secs() as usize;
    let now = unix_nanos(SystemTime::now());
    let fleet = Fleet {
        templates: (0..nodes)
            .map(|n| node_template(n, &fleet_stacks))
            .collect(),
        intervals,
        first_start: hour_start(now - (intervals as i64) * interval.as_nanos() as i64),
        interval,
    };
    println!(
        "collector bench: {nodes} nodes x {STACKS_PER_NODE} stacks of depth {DEPTH} per {}s, \
         {minutes} min of data ({} batches), buckets of {} s, dictionary epochs of {} s",
        interval.as_secs(),
        nodes * intervals,
        bucket_nanos / 1_000_000_000,
        dictionary_epoch_nanos / 1_000_000_000
    );

    println!("SQLite ingest (validate + durable commit, one thread):");
    let written_before = bytes_written();
    let ingested = ingest_fleet(&*sqlite, &fleet, full);
    let written = bytes_written().zip(written_before).map(|(a, b)| a - b);
    let db_bytes: u64 = std::fs::read_dir(dir.path())
        .expect("listing the database dir")
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.len())
        .sum();
    println!(
        "  wire size {:.1} MB uncompressed; database {:.1} MB ({:.1} bytes per ingested sample row)",
        ingested.wire_bytes as f64 / 1e6,
        db_bytes as f64 / 1e6,
        db_bytes as f64 / ingested.rows as f64
    );
    if let Some(written) = written {
        println!(
            "  written to disk while ingesting (log and checkpoints): {:.1} MB, {:.1} KB per batch",
            written as f64 / 1e6,
            written as f64 / 1e3 / ingested.batches as f64
        );
    }

    // Group commit against one commit per batch, alternating, on the
    // same batches.
    let together_minutes = env_or(
        "STACKSCOPE_BENCH_TOGETHER_MINUTES",
        if full { 5 } else { 1 },
    );
    let together_intervals = (together_minutes * 60 / interval.as_secs() as usize).min(intervals);
    let senders = 8;
    println!(
        "SQLite ingest, the fleet's batches arriving together ({senders} senders at once, \
         {together_minutes} min of data):"
    );
    let mut runs: [Vec<f64>; 2] = Default::default();
    for round in 0..2 {
        for (which, max_group) in [(0, 1), (1, SqliteOptions::default().max_group_batches)] {
            let (seconds, commits) =
                ingest_together(&fleet, together_intervals, senders, max_group, &options);
            let rate = commits.batches as f64 / seconds;
            println!(
                "  round {round}, at most {max_group:>2} batches per commit: {rate:.1} batches/s \
                 ({} batches in {} commits, {seconds:.1} s)",
                commits.batches, commits.commits
            );
            runs[which].push(rate);
        }
    }
    let mean = |rates: &[f64]| (rates[0] + rates[1]) / 2.0;
    println!(
        "  group commit / one commit per batch: {:.2}x batches/s (mean of two rounds)",
        mean(&runs[1]) / mean(&runs[0])
    );

    let range = TimeRange {
        start_unix_nanos: fleet.first_start,
        end_unix_nanos: now,
    };
    // A node every fleet size has (the 8th of the default 100).
    let one_node = format!("node-{:03}", 7.min(nodes.saturating_sub(1)));
    let queries = [
        ("everything", Vec::new()),
        (
            "one node",
            vec![LabelMatcher::new("node", MatchOp::Equal, &one_node).expect("matcher")],
        ),
        (
            "one service (regex)",
            vec![LabelMatcher::new("comm", MatchOp::Regex, "svc-1[0-4]").expect("matcher")],
        ),
    ];
    let selections: Vec<(&str, Selection)> = queries
        .into_iter()
        .map(|(name, matchers)| {
            (
                name,
                Selection {
                    range,
                    matchers,
                    profile_type: Default::default(),
                },
            )
        })
        .collect();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("tokio runtime");
    let engine = query_engine(sqlite.clone(), &dir.path().join("debuginfo"));

    println!(
        "SQLite flamegraph query over {minutes} min before the compactor ran (base rows, one run):"
    );
    let mut reference = Vec::new();
    for (name, selection) in &selections {
        let (response, took) = flamegraph(&runtime, &engine, selection);
        println!("  {name:<20}      {:>8.1} ms", took.as_secs_f64() * 1e3);
        reference.push(response);
    }

    // The compactor as the collector runs it, all at once here: every span
    // the data closed.
    let (spans, compaction) = compact_all(&*sqlite, now);
    println!(
        "SQLite compaction (rollups of every closed span, one thread): {spans} spans in \
         {compaction:.1} s ({:.0}% of the ingest time)",
        100.0 * compaction / ingested.seconds
    );
    println!(
        "SQLite flamegraph query over {minutes} min ({query_runs} runs each; storage + merge + \
         encode; target p50 <= 200 ms for 1 h, <= 1 s for 24 h):"
    );
    let sqlite_p50s = time_queries(
        &runtime,
        &engine,
        &selections,
        &reference,
        query_runs,
        ingested.samples,
    );
    drop(engine);
    if let Ok(keep) = std::env::var("STACKSCOPE_BENCH_KEEP_DATA_DIR") {
        keep_database(&sqlite, &std::path::PathBuf::from(keep));
    }

    if !with_clickhouse {
        return;
    }
    let servers = clickhouse_servers::servers();
    let config = ClickhouseConfig::from_url(&servers.cluster_url("bench")).expect("the URL");
    let clickhouse = Arc::new(
        ClickhouseStorage::open(
            config,
            ClickhouseOptions {
                bucket_nanos,
                ..ClickhouseOptions::default()
            },
        )
        .expect("ClickHouse"),
    );
    println!(
        "ClickHouse ingest (two shards on this machine, insert_distributed_sync; validate + \
         insert, one thread):"
    );
    let ch_ingested = ingest_fleet(&*clickhouse, &fleet, full);
    let (spans, compaction) = compact_all(&*clickhouse, now);
    println!(
        "ClickHouse compaction (rollups of every closed span, built by the servers): {spans} \
         spans in {compaction:.1} s ({:.0}% of the ingest time)",
        100.0 * compaction / ch_ingested.seconds
    );
    let engine = query_engine(clickhouse.clone(), &dir.path().join("debuginfo"));
    println!("ClickHouse flamegraph query over {minutes} min ({query_runs} runs each):");
    let ch_p50s = time_queries(
        &runtime,
        &engine,
        &selections,
        &reference,
        query_runs,
        ingested.samples,
    );

    println!(
        "  rollup spans read by ClickHouse queries: {}",
        clickhouse.rollup_spans_read()
    );
    println!("side by side ({nodes} nodes, {minutes} min):");
    println!("  {:<32} {:>14} {:>14}", "", "SQLite", "ClickHouse");
    println!(
        "  {:<32} {:>14.0} {:>14.0}",
        "ingest samples/s (one thread)",
        ingested.samples as f64 / ingested.seconds,
        ch_ingested.samples as f64 / ch_ingested.seconds
    );
    for (((name, _), sqlite), clickhouse) in selections.iter().zip(&sqlite_p50s).zip(&ch_p50s) {
        println!(
            "  {:<32} {:>11.1} ms {:>11.1} ms",
            format!("{name} p50"),
            sqlite.as_secs_f64() * 1e3,
            clickhouse.as_secs_f64() * 1e3
        );
    }
}
