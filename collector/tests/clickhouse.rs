//! The ClickHouse storage engine against real `clickhouse-server`s: two
//! shards of a cluster behind `Distributed` tables (and one server alone),
//! started by the tests, and a current release (chdb's engine). The same
//! batches give the same answers as SQLite's engine on each; retried
//! batches count once; a database of the first schema is upgraded;
//! retention deletes old data; two collectors in front of the cluster each
//! answer for the whole fleet; and failures are errors that say what
//! happened.
//!
//! Needs `clickhouse-server` (`cargo xtask setup` installs it), and PyPI
//! the first time (chdb, into the target directory); fails, not skips,
//! without them.

#[path = "support/batches.rs"]
mod batches;
#[path = "support/clickhouse_servers.rs"]
mod clickhouse_servers;

use std::{
    collections::BTreeMap,
    sync::Arc,
    time::{Duration, SystemTime},
};

use batches::*;
use clickhouse_servers::{current_sql, current_url, servers};
use stackscope_collector::{
    ingest::ValidBatch,
    storage::{
        IngestOutcome, Storage, StorageError,
        clickhouse::{ClickhouseConfig, ClickhouseOptions, ClickhouseStorage},
        sqlite::{SqliteOptions, SqliteStorage},
    },
};
use stackscope_profile::{
    model::{CodeAddress, Frame, MatchOp, ProfileType, Selection, StackSamples, unix_nanos},
    render::top_functions,
    tree::CallTree,
};
use stackscope_proto::v1;

fn open_url(url: &str, options: ClickhouseOptions) -> Result<ClickhouseStorage, StorageError> {
    ClickhouseStorage::open(ClickhouseConfig::from_url(url)?, options)
}

/// The two-shard cluster, database `db` (created on first use).
fn cluster(db: &str) -> ClickhouseStorage {
    open_url(&servers().cluster_url(db), ClickhouseOptions::default()).expect("open ClickHouse")
}

fn ingest_all(storage: &dyn Storage, batches: &[ValidBatch]) {
    for batch in batches {
        assert_eq!(
            storage.ingest(batch).expect("ingest"),
            IngestOutcome::Stored {
                samples: batch.samples.len() as u64
            }
        );
    }
}

fn weights(storage: &dyn Storage, selection: &Selection) -> BTreeMap<String, u64> {
    folded(&storage.stacks(selection).expect("query stacks"))
}

/// Rows of `db.table` on one server (0 or 1).
fn rows_on(server: usize, db: &str, table: &str) -> u64 {
    servers()
        .sql(server, &format!("SELECT count() FROM {db}.{table}"))
        .trim()
        .parse()
        .expect("a count")
}

/// The stacks with their whole frames, in a fixed order: engines may
/// order them differently.
fn sorted(samples: &StackSamples) -> Vec<(Vec<Frame>, u64)> {
    let mut stacks: Vec<(Vec<Frame>, u64)> = samples
        .stacks
        .iter()
        .map(|s| (s.frames.iter().map(|f| (**f).clone()).collect(), s.weight))
        .collect();
    stacks.sort();
    stacks
}

/// Every summed weight capped at i64::MAX, as both engines return them
/// now; SQLite's engine before that change saturated per stored row and
/// added in u64, which capping turns into the same answers.
fn capped(mut samples: StackSamples) -> StackSamples {
    for stack in &mut samples.stacks {
        stack.weight = stack.weight.min(i64::MAX as u64);
    }
    samples
}

fn capped_series(series: Vec<(i64, u64)>) -> Vec<(i64, u64)> {
    series
        .into_iter()
        .map(|(point, weight)| (point, weight.min(i64::MAX as u64)))
        .collect()
}

/// Batches whose weights make the sums pass i64::MAX: three of i64::MAX / 2
/// + 1 on one (bucket, label set, stack), one more in the next bucket.
fn huge_batches() -> Vec<ValidBatch> {
    let half = (i64::MAX / 2 + 1) as u64;
    (0..4u8)
        .map(|i| {
            let start = if i < 3 { T0 } else { T0 + MINUTE };
            let mut b = Builder::new(100 + i, "node-h", start, PERIOD_100HZ);
            let s1 = b.standard_stack(1);
            let set = b.label_set(&[("comm", "huge")]);
            b.sample(s1, set, half, 0);
            b.validate()
        })
        .collect()
}

/// A batch whose unnamed frame's file came with code segments: its frame
/// carries a virtual address as well as the file offset.
fn segments_batch() -> ValidBatch {
    let mut b = Builder::new(120, "node-s", T0, PERIOD_100HZ);
    let lib = b.mapping(v1::MappingKind::User, "ef01", "/usr/lib/libseg.so");
    b.batch.mappings[lib as usize].load_segments = vec![v1::LoadSegment {
        file_offset: 0x1000,
        vaddr: 0x401000,
        file_size: 0x2000,
    }];
    let unknown = b.location(lib, 0x1a2b, &[]);
    let main = b.standard_stack(1);
    let main_location = b.batch.stacks[main as usize].locations[1];
    let stack = b.stack(&[unknown, main_location]);
    let set = b.label_set(&[("comm", "seg")]);
    b.sample(stack, set, 9, 0);
    b.validate()
}

/// Off-CPU time on node-a at T0, beside batch 1's CPU ticks on the same
/// labels and stack, and on labels of its own.
fn off_cpu_batch() -> ValidBatch {
    let mut b = Builder::new(121, "node-a", T0 + 30 * SECOND, PERIOD_100HZ);
    let [s0, _, s2] = b.standard_stacks(false);
    let app = b.label_set(&[("comm", "app"), ("exe", "/usr/bin/app")]);
    let waiter = b.label_set(&[("comm", "waiter")]);
    b.off_cpu_sample(s0, app, 3_000_000);
    b.off_cpu_sample(s2, waiter, 90_000_000);
    b.validate()
}

#[test]
fn the_same_batches_give_the_same_answers_as_sqlite() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sqlite = SqliteStorage::open(&dir.path().join("stackscope.db"), SqliteOptions::default())
        .expect("open SQLite");
    let clustered = cluster("cross_cluster");
    let single = open_url(
        &servers().single_url("cross_single"),
        ClickhouseOptions::default(),
    )
    .expect("open one server");
    // Every query chunked per label set and stack, caches of one entry.
    let tiny = open_url(
        &servers().cluster_url("cross_tiny"),
        ClickhouseOptions {
            stack_fetch_chunk: 1,
            cache_entries: 1,
            query_cache_entries: 1,
            ..ClickhouseOptions::default()
        },
    )
    .expect("open with tiny chunks");
    // The same statements on a current release (chdb's engine).
    let current = open_url(&current_url("cross_current"), ClickhouseOptions::default())
        .expect("open the current engine");
    let mut batches = vec![batch1(), batch2(), batch3()];
    batches.extend(huge_batches());
    batches.push(segments_batch());
    batches.push(off_cpu_batch());
    for storage in [
        &sqlite as &dyn Storage,
        &clustered,
        &single,
        &tiny,
        &current,
    ] {
        ingest_all(storage, &batches);
    }
    // Two of them rolled up (the current engine runs the builds too): the
    // answers from rollups must be the same.
    for storage in [&tiny, &current] {
        assert!(storage.compact(T0 + DAY).expect("compaction") > 0);
    }

    use MatchOp::*;
    let matchers: [&[Matcher]; 13] = [
        &[],
        &[("comm", Equal, "app")],
        &[("comm", NotEqual, "app")],
        &[("node", Regex, "node-a|x")],
        &[("exe", NotRegex, ".*/app")],
        &[("pod", Equal, "")],
        &[("pod", Regex, ".+")],
        &[("node", Equal, "spoofed")],
        &[("comm", Equal, "app"), ("node", Equal, "node-b")],
        &[("node", Equal, "node-a")],
        &[("node", Equal, "node-b")],
        &[("comm", Equal, "huge")],
        &[("comm", Equal, "seg")],
    ];
    let ranges = [
        (T0 - 3600 * SECOND, T0 + 3600 * SECOND),
        (T0, T0 + MINUTE),
        (T0 + MINUTE, T0 + MINUTE + 1),
        (T0 + 2 * MINUTE, T0 + 3 * MINUTE),
        (T0 + MINUTE, T0),
        (T0 + 59 * SECOND, T0 + 61 * SECOND),
    ];
    let mut compared = 0;
    for (matchers, (start, end), profile_type) in matchers.iter().flat_map(|matchers| {
        ranges.iter().flat_map(move |&range| {
            [ProfileType::Cpu, ProfileType::OffCpu]
                .into_iter()
                .map(move |profile_type| (matchers, range, profile_type))
        })
    }) {
        {
            let selection = Selection {
                profile_type: profile_type.clone(),
                ..select(start, end, matchers)
            };
            let context = format!("{profile_type}, matchers {matchers:?}, range {start}..{end}");
            let expected = capped(sqlite.stacks(&selection).expect("SQLite stacks"));
            let expected_tree = CallTree::from_stacks(&expected);
            for (engine, storage) in [
                ("cluster", &clustered),
                ("single", &single),
                ("tiny chunks", &tiny),
                ("current", &current),
            ] {
                let got = storage.stacks(&selection).expect("ClickHouse stacks");
                assert_eq!(sorted(&got), sorted(&expected), "{engine}: {context}");
                assert_eq!(
                    got.sample_period_nanos, expected.sample_period_nanos,
                    "{engine}: period, {context}"
                );
                assert_eq!(
                    sorted(&storage.stacks_in_units(&selection).expect("in units")),
                    sorted(&capped(
                        sqlite.stacks_in_units(&selection).expect("in units")
                    )),
                    "{engine}: stacks in units, {context}"
                );
                let tree = CallTree::from_stacks(&got);
                assert_eq!(tree, expected_tree, "{engine}: tree, {context}");
                assert_eq!(
                    top_functions(&tree, 50),
                    top_functions(&expected_tree, 50),
                    "{engine}: top, {context}"
                );
                assert_eq!(
                    storage.label_names(&selection).expect("names"),
                    sqlite.label_names(&selection).expect("names"),
                    "{engine}: label names, {context}"
                );
                assert_eq!(
                    storage.profile_types(&selection).expect("types"),
                    sqlite.profile_types(&selection).expect("types"),
                    "{engine}: profile types, {context}"
                );
                for name in ["comm", "exe", "node", "pod"] {
                    assert_eq!(
                        storage.label_values(&selection, name).expect("values"),
                        sqlite.label_values(&selection, name).expect("values"),
                        "{engine}: values of {name}, {context}"
                    );
                }
                for step in [0, SECOND, MINUTE, 2 * MINUTE, 3600 * SECOND] {
                    assert_eq!(
                        storage.series(&selection, step).expect("series"),
                        capped_series(sqlite.series(&selection, step).expect("series")),
                        "{engine}: series by {step}, {context}"
                    );
                    assert_eq!(
                        storage.series_in_units(&selection, step).expect("series"),
                        capped_series(sqlite.series_in_units(&selection, step).expect("series")),
                        "{engine}: series in units by {step}, {context}"
                    );
                }
                compared += 1;
            }
        }
    }
    assert_eq!(compared, 13 * 6 * 2 * 4);
    assert!(tiny.rollup_spans_read() > 0 && current.rollup_spans_read() > 0);

    // What the comparisons compared is what the SQLite tests pin down, so
    // agreeing is not agreeing on nothing.
    assert_eq!(
        weights(&clustered, &all(&[("node", Regex, "node-a|node-b")])),
        expect(&[(S0, 7), (S1, 14), (S2, 20)])
    );
    assert_eq!(
        weights(&clustered, &all(&[("comm", Equal, "app")])),
        expect(&[(S0, 7), (S1, 14), (S2, 13)])
    );
    let off_cpu = Selection {
        profile_type: ProfileType::OffCpu,
        ..all(&[])
    };
    assert_eq!(
        weights(&clustered, &off_cpu),
        expect(&[(S0, 3_000_000), (S2, 90_000_000)])
    );
    assert_eq!(
        clustered
            .stacks(&off_cpu)
            .expect("stacks")
            .sample_period_nanos,
        1
    );
    let samples = clustered
        .stacks(&all(&[("node", Equal, "node-a")]))
        .expect("stacks");
    assert_eq!(samples.sample_period_nanos, PERIOD_100HZ);
    let unknown = samples
        .stacks
        .iter()
        .find(|s| name(s) == S0)
        .and_then(|s| s.frames.first())
        .expect("S0's leaf");
    assert_eq!(
        unknown.unnamed_code.map(|c| c.file_offset),
        Some(0x1a2b),
        "an unnamed frame keeps its code address"
    );
    let seg = clustered
        .stacks(&all(&[("comm", Equal, "seg")]))
        .expect("stacks");
    let leaf = seg
        .stacks
        .first()
        .and_then(|s| s.frames.first())
        .expect("a leaf");
    assert_eq!(
        (
            leaf.function.as_str(),
            leaf.build_id.as_str(),
            leaf.unnamed_code
        ),
        (
            "[unknown] libseg.so+0x1a2b",
            "ef01",
            Some(CodeAddress {
                file_offset: 0x1a2b,
                vaddr: Some(0x401a2b)
            })
        )
    );
    // Capped: four rows of i64::MAX / 2 + 1 sum to twice i64::MAX; the
    // answer is i64::MAX.
    assert_eq!(
        weights(&clustered, &all(&[("comm", Equal, "huge")])),
        expect(&[(S1, i64::MAX as u64)])
    );
    // One bucket of them alone is capped too, and the next holds one row.
    assert_eq!(
        clustered
            .series(&all(&[("comm", Equal, "huge")]), MINUTE)
            .expect("series"),
        [
            (T0, i64::MAX as u64),
            (T0 + MINUTE, (i64::MAX / 2 + 1) as u64)
        ]
    );
    // The hour from T0 - 840 s holds both buckets (and the segments
    // batch's 9): capped once, at the end.
    assert_eq!(
        clustered.series(&all(&[]), 3600 * SECOND).expect("series"),
        [(T0 - 840 * SECOND, i64::MAX as u64)]
    );
    // Both shards hold some of it: the Distributed tables spread rows.
    for server in [0, 1] {
        assert!(
            rows_on(server, "cross_cluster", "samples_local") > 0,
            "shard {} holds no samples",
            server + 1
        );
    }
}

#[test]
fn a_retried_batch_is_not_counted_twice() {
    let db = "retried";
    let storage = cluster(db);
    ingest_all(&storage, &[batch1()]);
    let before = weights(&storage, &all(&[]));
    assert_eq!(before, expect(&[(S0, 5), (S1, 3), (S2, 7)]));
    assert_eq!(
        storage.ingest(&batch1()).expect("retry"),
        IngestOutcome::Duplicate
    );
    // Another collector sees the id once it is written (behind ingest,
    // within about 100 ms; at once when flushed).
    storage.flush_batch_ids();
    assert_eq!(
        rows_on(0, db, "batches_local") + rows_on(1, db, "batches_local"),
        1
    );
    assert_eq!(
        cluster(db).ingest(&batch1()).expect("retry elsewhere"),
        IngestOutcome::Duplicate
    );
    assert_eq!(weights(&storage, &all(&[])), before);

    // A first attempt that stored its samples but failed before its id:
    // the retry stores them again, and they still count once.
    // Merges stopped: one would collapse the two copies before they are
    // counted on disk.
    for server in [0, 1] {
        servers().sql(server, &format!("DROP TABLE {db}.batches_local"));
        servers().sql(server, &format!("SYSTEM STOP MERGES {db}.samples_local"));
    }
    let storage = cluster(db);
    assert_eq!(
        rows_on(0, db, "batches_local") + rows_on(1, db, "batches_local"),
        0
    );
    ingest_all(&storage, &[batch1()]);
    let stored: u64 = (0..2).map(|s| rows_on(s, db, "samples_local")).sum();
    assert_eq!(stored, 6, "both copies are on disk");
    assert_eq!(weights(&storage, &all(&[])), before);
    assert_eq!(
        storage.series(&all(&[]), MINUTE).expect("series"),
        [(T0, 15)]
    );
    assert_eq!(
        storage.merged_sums(),
        0,
        "the copies counted once without FINAL"
    );
}

#[test]
fn batch_ids_are_written_behind_ingest_many_per_insert() {
    let db = "behind";
    let open = |max_queued| {
        open_url(
            &servers().cluster_url(db),
            ClickhouseOptions {
                // Written only when flushed, the queue full, or dropped.
                batch_id_linger: Duration::from_secs(3600),
                max_queued_batch_ids: max_queued,
                ..ClickhouseOptions::default()
            },
        )
        .expect("open")
    };
    let ids_on = |server| rows_on(server, db, "batches_local");
    let ids = || ids_on(0) + ids_on(1);
    let storage = open(100);
    for server in [0, 1] {
        servers().sql(server, &format!("SYSTEM STOP MERGES {db}.batches_local"));
    }
    let batches: Vec<ValidBatch> = (0..8)
        .map(|i| fleet_batch(10 + i, "node-a", T0, PERIOD_100HZ, 7919 * u64::from(i)))
        .collect();
    ingest_all(&storage, &batches);
    let stored = weights(&storage, &all(&[]));
    assert_eq!(ids(), 0, "the ids wait behind ingest");
    // A retry to this collector is a duplicate meanwhile.
    for batch in &batches {
        assert_eq!(
            storage.ingest(batch).expect("retry"),
            IngestOutcome::Duplicate
        );
    }
    assert_eq!(weights(&storage, &all(&[])), stored);

    // Written together: one insert on each server that holds some, so
    // one part per partition (ids are partitioned by day received: one,
    // unless the test runs across midnight); then another collector
    // finds them.
    storage.flush_batch_ids();
    assert_eq!(ids(), 8);
    for server in [0, 1] {
        let answer = servers().sql(
            server,
            &format!(
                "SELECT count(), uniqExact(partition) FROM system.parts \
                 WHERE database = '{db}' AND table = 'batches_local' AND active FORMAT CSV"
            ),
        );
        let (parts, partitions) = answer.trim().split_once(',').expect("two counts");
        assert_eq!(
            parts, partitions,
            "one part per partition on server {server}"
        );
        assert_eq!(
            parts != "0",
            ids_on(server) > 0,
            "server {server}: {parts} parts"
        );
    }
    assert_eq!(
        cluster(db).ingest(&batches[3]).expect("retry elsewhere"),
        IngestOutcome::Duplicate
    );

    // A full queue: ingest writes the ids past it itself.
    let storage = open(2);
    let more: Vec<ValidBatch> = (0..5)
        .map(|i| fleet_batch(30 + i, "node-b", T0, PERIOD_100HZ, 31 * u64::from(i)))
        .collect();
    ingest_all(&storage, &more);
    assert_eq!(ids(), 8 + 3, "two queued, three written by ingest");

    // Servers refusing them lose none: they stay queued, and their
    // batches duplicates, until a write succeeds.
    for server in [0, 1] {
        servers().sql(server, &format!("DROP TABLE {db}.batches_local"));
    }
    storage.flush_batch_ids();
    for batch in &more[..2] {
        assert_eq!(
            storage.ingest(batch).expect("retry"),
            IngestOutcome::Duplicate
        );
    }
    drop(open(100)); // makes the table anew
    assert_eq!(ids(), 0);
    storage.flush_batch_ids();
    assert_eq!(ids(), 2);

    // Dropping the storage writes what is queued.
    let storage = open(100);
    ingest_all(&storage, &[fleet_batch(50, "node-c", T0, PERIOD_100HZ, 1)]);
    assert_eq!(ids(), 2);
    drop(storage);
    assert_eq!(ids(), 3);
}

#[test]
fn a_database_of_the_first_schema_is_upgraded_and_its_unmerged_copies_count_once() {
    upgrade_then_retry(&servers().single_url("upgraded"), &|statement| {
        servers().sql(0, statement)
    });
    // The same statements on a current release.
    upgrade_then_retry(&current_url("upgraded"), &current_sql);
}

/// A database of the first schema (at `url`, database `upgraded`, whose
/// server runs `sql`) with a retried batch's copies on disk, upgraded; then
/// a retry after a first attempt that stored its samples but not its id.
fn upgrade_then_retry(url: &str, sql: &dyn Fn(&str) -> String) {
    let db = "upgraded";
    let open = || open_url(url, ClickhouseOptions::default());
    let count = |table: &str| -> u64 {
        sql(&format!("SELECT count() FROM {db}.{table}"))
            .trim()
            .parse()
            .expect("a count")
    };
    let storage = open().expect("open");
    ingest_all(&storage, &[batch1()]);
    let before = weights(&storage, &all(&[]));
    assert_eq!(before, expect(&[(S0, 5), (S1, 3), (S2, 7)]));
    drop(storage);

    // The first schema: no `attempts`, and a retried batch's second copy
    // of its rows left on disk unregistered (merges stopped, or they
    // would collapse the copies).
    sql(&format!("DROP TABLE {db}.attempts_local"));
    sql(&format!("SYSTEM STOP MERGES {db}.samples_local"));
    sql(&format!(
        "INSERT INTO {db}.samples_local SELECT * FROM {db}.samples_local"
    ));
    sql(&format!(
        "INSERT INTO {db}.meta (key, value) VALUES ('schema_version', 1)"
    ));
    assert_eq!(count("samples_local"), 6, "both copies are on disk");

    let storage = open().expect("upgrade");
    assert_eq!(
        sql(&format!(
            "SELECT value FROM {db}.meta FINAL WHERE key = 'schema_version'"
        ))
        .trim(),
        "3"
    );
    assert_eq!(count("attempts_local"), 2, "the copies registered");
    assert_eq!(weights(&storage, &all(&[])), before);
    assert_eq!(
        storage.series(&all(&[]), MINUTE).expect("series"),
        [(T0, 15)]
    );

    // On a single server too, a first attempt that stored its samples but
    // not its id: the retry stores them a third time, counted once.
    sql(&format!("DROP TABLE {db}.batches_local"));
    let storage = open().expect("reopen");
    ingest_all(&storage, &[batch1()]);
    assert_eq!(count("samples_local"), 9);
    assert_eq!(weights(&storage, &all(&[])), before);
    // Another batch alongside, tried once, counts whole.
    ingest_all(&storage, &[batch2()]);
    let dir = tempfile::tempdir().expect("temp dir");
    let sqlite = SqliteStorage::open(&dir.path().join("stackscope.db"), SqliteOptions::default())
        .expect("open SQLite");
    ingest_all(&sqlite, &[batch1(), batch2()]);
    assert_eq!(weights(&storage, &all(&[])), weights(&sqlite, &all(&[])));
    assert_eq!(
        storage.merged_sums(),
        0,
        "the copies counted once without FINAL"
    );
}

/// Schema version 2 kept no time with a try: on every shard, the local
/// and the `Distributed` table of `attempts` get it, and ingest and
/// compaction go on.
#[test]
fn a_cluster_of_the_second_schema_is_upgraded() {
    let db = "second";
    let storage = cluster(db);
    ingest_all(&storage, &[batch1()]);
    drop(storage);
    for server in [0, 1] {
        for table in ["attempts", "attempts_local"] {
            servers().sql(
                server,
                &format!("ALTER TABLE {db}.{table} DROP COLUMN at_unix_nanos"),
            );
        }
        servers().sql(
            server,
            &format!("INSERT INTO {db}.meta (key, value) VALUES ('schema_version', 2)"),
        );
    }
    let storage = cluster(db);
    for server in [0, 1] {
        let columns = servers().sql(
            server,
            &format!(
                "SELECT count() FROM system.columns WHERE database = '{db}' \
                 AND table LIKE 'attempts%' AND name = 'at_unix_nanos'"
            ),
        );
        assert_eq!(columns.trim(), "2", "server {server}: both tables have it");
    }
    ingest_all(&storage, &[batch2()]);
    assert!(storage.compact(T0 + DAY).expect("compaction") > 0);
    assert_eq!(
        weights(&storage, &all(&[])),
        expect(&[(S0, 7), (S1, 3), (S2, 7)])
    );
    assert!(storage.rollup_spans_read() > 0);
}

/// Label sets stored under the ids a former collector gave them (the
/// content hash: the same last 12 bytes, other first 4) are read beside
/// the same labels under their node-clustered ids, and a batch that such a
/// collector stored but failed to mark, retried by this one, counts once:
/// before and after compaction.
#[test]
fn label_sets_under_their_former_ids_answer_with_the_new_ones() {
    let db = "former_ids";
    let sql = |statement: &str| servers().sql(0, statement);
    let open = || open_url(&servers().single_url(db), ClickhouseOptions::default());
    ingest_all(&open().expect("open"), &[batch1()]);
    let former = "toFixedString(concat(substring(MD5(toString(label_set)), 1, 4), \
                  substring(label_set, 5, 12)), 16)";
    for (table, columns) in [
        (
            "samples_local",
            format!("bucket, {former}, stack, batch, sample_period, weight"),
        ),
        (
            "label_sets_local",
            format!("{former}, bucket, label_names, label_values"),
        ),
    ] {
        sql(&format!("CREATE TABLE {db}.former AS {db}.{table}"));
        sql(&format!(
            "INSERT INTO {db}.former SELECT {columns} FROM {db}.{table}"
        ));
        sql(&format!("DROP TABLE {db}.{table}"));
        sql(&format!("RENAME TABLE {db}.former TO {db}.{table}"));
    }
    // Batch 1's id was never written: it is tried again.
    sql(&format!("DROP TABLE {db}.batches_local"));
    let storage = open().expect("reopen");
    ingest_all(&storage, &[batch1(), batch2()]);
    assert_eq!(
        sql(&format!(
            "SELECT uniqExact(label_set) FROM {db}.label_sets_local"
        ))
        .trim(),
        "4",
        "both of batch 1's sets under their former ids and their new ones"
    );
    assert_eq!(rows_on(0, db, "attempts_local"), 3, "batch 1 tried twice");
    let dir = tempfile::tempdir().expect("temp dir");
    let sqlite = SqliteStorage::open(&dir.path().join("stackscope.db"), SqliteOptions::default())
        .expect("open SQLite");
    ingest_all(&sqlite, &[batch1(), batch2()]);
    let app = all(&[("comm", MatchOp::Equal, "app")]);
    let same_answers = |when: &str| {
        for selection in [all(&[]), app.clone()] {
            assert_eq!(
                weights(&storage, &selection),
                weights(&sqlite, &selection),
                "{when}"
            );
            assert_eq!(
                storage.series(&selection, MINUTE).expect("series"),
                sqlite.series(&selection, MINUTE).expect("series"),
                "{when}"
            );
        }
        assert_eq!(
            storage.label_values(&all(&[]), "comm").expect("values"),
            ["app", "worker"],
            "{when}"
        );
    };
    same_answers("from the samples");
    assert!(storage.compact(T0 + DAY).expect("compaction") > 0);
    same_answers("from the rollups");
    assert!(storage.rollup_spans_read() > 0);
}

#[test]
fn a_batch_whose_dictionary_rows_pass_the_cap_is_refused_whole() {
    let db = "dictionary_cap";
    let storage = open_url(
        &servers().cluster_url(db),
        ClickhouseOptions {
            max_batch_dictionary_bytes: 8192,
            ..ClickhouseOptions::default()
        },
    )
    .expect("open");
    // One label set of 12 KB: its row alone passes 8 KiB.
    let mut big = Builder::new(40, "node-a", T0, PERIOD_100HZ);
    let s1 = big.standard_stack(1);
    let long = "v".repeat(4000);
    let set = big.label_set(&[("a", &long), ("b", &long), ("c", &long)]);
    big.sample(s1, set, 1, 0);
    let big = big.validate();
    for _ in 0..2 {
        match storage.ingest(&big) {
            Err(err @ StorageError::TooLarge(_)) => assert_eq!(
                err.to_string(),
                "the batch is too large to store: its new stacks and label sets take more than \
                 8192 bytes as ClickHouse rows (max_batch_dictionary_bytes); send smaller batches"
            ),
            other => panic!("expected TooLarge, got {other:?}"),
        }
    }
    // No try either: one would keep the span's rollups from being read.
    let tables = [
        "samples_local",
        "stacks_local",
        "label_sets_local",
        "batches_local",
        "attempts_local",
    ];
    for table in tables {
        assert_eq!(rows_on(0, db, table) + rows_on(1, db, table), 0, "{table}");
    }
    // A batch under the cap is stored, and only it.
    ingest_all(&storage, &[batch1()]);
    assert_eq!(
        weights(&storage, &all(&[])),
        expect(&[(S0, 5), (S1, 3), (S2, 7)])
    );
    storage.flush_batch_ids();
    assert_eq!(
        rows_on(0, db, "batches_local") + rows_on(1, db, "batches_local"),
        1
    );
}

#[test]
fn bucket_widths_that_do_not_divide_a_day_work() {
    for (db, bucket, partition_minutes) in [
        ("bucket_7m", 7 * MINUTE, 1442),
        ("bucket_2d", 2 * 1440 * MINUTE, 2 * 1440),
    ] {
        let options = ClickhouseOptions {
            bucket_nanos: bucket,
            ..ClickhouseOptions::default()
        };
        let storage = open_url(&servers().cluster_url(db), options.clone()).expect(db);
        ingest_all(&storage, &[batch1()]);
        assert_eq!(
            weights(&storage, &all(&[])),
            expect(&[(S0, 5), (S1, 3), (S2, 7)]),
            "{db}"
        );
        // The rounded width is what the database keeps, and a collector
        // started the same way opens it again.
        assert_eq!(
            servers()
                .sql(
                    0,
                    &format!("SELECT value FROM {db}.meta FINAL WHERE key = 'partition_nanos'")
                )
                .trim(),
            (partition_minutes * MINUTE).to_string(),
            "{db}"
        );
        open_url(&servers().cluster_url(db), options).expect("reopen");
    }
}

#[test]
fn batches_dated_more_than_a_day_ahead_are_refused() {
    let storage = cluster("future");
    let now = stackscope_profile::model::unix_nanos(std::time::SystemTime::now());
    let day = 1440 * MINUTE;
    let batch = |id: u8, start: i64| {
        let mut b = Builder::new(id, "node-a", start, PERIOD_100HZ);
        let s1 = b.standard_stack(1);
        let set = b.label_set(&[("comm", "app")]);
        b.sample(s1, set, 1, 0);
        b.validate()
    };
    match storage.ingest(&batch(1, now + 2 * day)) {
        Err(StorageError::InvalidBatch(message)) => {
            assert!(message.ends_with("more than a day after now; is the node's clock right?"))
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_eq!(
        rows_on(0, "future", "samples_local") + rows_on(1, "future", "samples_local"),
        0
    );
    // An hour ahead is a clock a little off: stored.
    ingest_all(&storage, &[batch(2, now + 60 * MINUTE)]);
}

#[test]
fn retention_deletes_old_data() {
    let db = "retention";
    // Half-hour partitions: T0's is wholly before T0 + 30 min's cutoff.
    let options = ClickhouseOptions {
        partition_nanos: 1800 * SECOND,
        ..ClickhouseOptions::default()
    };
    let storage = open_url(&servers().cluster_url(db), options.clone()).expect("open");
    let new = {
        let mut b = Builder::new(7, "node-a", T0 + 3600 * SECOND, PERIOD_100HZ);
        let s1 = b.standard_stack(1);
        let app = b.label_set(&[("comm", "app"), ("exe", "/usr/bin/app")]);
        b.sample(s1, app, 4, 0);
        b.validate()
    };
    ingest_all(&storage, &[batch1(), new]);
    let partitions = |table: &str| -> u64 {
        (0..2)
            .map(|server| {
                servers()
                    .sql(
                        server,
                        &format!(
                            "SELECT uniqExact(partition) FROM system.parts \
                             WHERE database = '{db}' AND table = '{table}' AND active"
                        ),
                    )
                    .trim()
                    .parse::<u64>()
                    .expect("a count")
            })
            .sum()
    };
    assert_eq!(partitions("samples_local"), 2);

    // T0's bucket ends at T0 + 60 s: not before T0 + 30 s.
    assert_eq!(storage.delete_before(T0 + 30 * SECOND).expect("delete"), 0);
    assert_eq!(weights(&storage, &all(&[])).len(), 3);
    assert_eq!(
        storage.delete_before(T0 + 1800 * SECOND).expect("delete"),
        3
    );
    let everything = select(0, i64::MAX, &[]);
    assert_eq!(weights(&storage, &everything), expect(&[(S1, 4)]));
    assert_eq!(
        storage.label_values(&everything, "comm").expect("values"),
        ["app"]
    );
    assert_eq!(
        storage.series(&everything, MINUTE).expect("series"),
        [(T0 + 3600 * SECOND, 4)]
    );
    // T0's partitions are gone from disk, dictionaries too.
    assert_eq!(partitions("samples_local"), 1);
    assert_eq!(partitions("stacks_local"), 1);
    assert_eq!(partitions("label_sets_local"), 1);
    // Another collector hides the same (the mark is in ClickHouse).
    let other = open_url(&servers().cluster_url(db), options).expect("open");
    assert_eq!(weights(&other, &everything), expect(&[(S1, 4)]));
    // Batch ids received recently stay: a late retry is still refused.
    assert_eq!(
        storage.ingest(&batch1()).expect("retry"),
        IngestOutcome::Duplicate
    );
    // A late batch for a deleted bucket stays hidden.
    ingest_all(&other, &[batch2()]);
    // Its id written, before the other collector's retention.
    other.flush_batch_ids();
    assert_eq!(weights(&storage, &everything), expect(&[(S1, 4)]));

    // A cutoff past everything (and past now) empties the database.
    assert_eq!(storage.delete_before(i64::MAX).expect("delete"), 1);
    assert_eq!(weights(&storage, &everything), expect(&[]));
    for table in [
        "samples_local",
        "stacks_local",
        "label_sets_local",
        "batches_local",
    ] {
        assert_eq!(partitions(table), 0, "{table}");
    }
}

#[test]
fn two_collectors_share_one_cluster() {
    let db = "fleet";
    let [a, b] = servers().http_ports;
    // The second collector lists the shards the other way round: it reads
    // and inserts through shard 2 first.
    let first = Arc::new(cluster(db));
    let second = Arc::new(
        open_url(
            &format!("clickhouse://127.0.0.1:{b},127.0.0.1:{a}/{db}?cluster=two"),
            ClickhouseOptions::default(),
        )
        .expect("open"),
    );
    // Each collector takes one node's batches, 20 each, concurrently.
    let threads: Vec<_> = [
        (Arc::clone(&first), "node-a", 0u8),
        (Arc::clone(&second), "node-b", 100),
    ]
    .into_iter()
    .map(|(storage, node, first_id)| {
        std::thread::spawn(move || {
            for i in 0..20u8 {
                let mut batch = Builder::new(first_id + i + 1, node, T0, PERIOD_100HZ);
                let [s0, s1, s2] = batch.standard_stacks(i % 2 == 0);
                let set = batch.label_set(&[("comm", "app")]);
                batch.sample(s0, set, 1, 0);
                batch.sample(s1, set, 2, 0);
                batch.sample(s2, set, 3, 0);
                ingest_all(&*storage, &[batch.validate()]);
            }
        })
    })
    .collect();
    for thread in threads {
        thread.join().expect("ingest thread");
    }
    for storage in [&first, &second] {
        assert_eq!(
            weights(&**storage, &all(&[])),
            expect(&[(S0, 40), (S1, 80), (S2, 120)])
        );
        assert_eq!(
            storage.label_values(&all(&[]), "node").expect("values"),
            ["node-a", "node-b"]
        );
        assert_eq!(
            weights(&**storage, &all(&[("node", MatchOp::Equal, "node-b")])),
            expect(&[(S0, 20), (S1, 40), (S2, 60)])
        );
        assert_eq!(
            storage.series(&all(&[]), MINUTE).expect("series"),
            [(T0, 240)]
        );
    }
    // The stacks were written by both collectors, in both shards' tables;
    // the samples spread over both shards.
    for server in [0, 1] {
        assert!(rows_on(server, db, "samples_local") > 0, "shard {server}");
    }
    // A retry through the other collector is a duplicate, once the id
    // is written.
    first.flush_batch_ids();
    let mut retry = Builder::new(1, "node-a", T0, PERIOD_100HZ);
    let [s0, _, _] = retry.standard_stacks(true);
    let set = retry.label_set(&[("comm", "app")]);
    retry.sample(s0, set, 1, 0);
    assert_eq!(
        second.ingest(&retry.validate()).expect("retry"),
        IngestOutcome::Duplicate
    );
}

#[test]
fn failures_are_clear_errors() {
    // Nothing listens on a port just freed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let err = open_url(
        &format!("clickhouse://127.0.0.1:{port}/db"),
        ClickhouseOptions::default(),
    )
    .expect_err("unreachable");
    let chain = format!("{:#}", anyhow::Error::from(err));
    assert!(
        chain.starts_with(&format!(
            "ClickHouse: creating the schema on http://127.0.0.1:{port}/: HTTP request to \
             http://127.0.0.1:{port}/ failed"
        )),
        "{chain}"
    );

    let err = open_url(
        "clickhouse://127.0.0.1/db;drop",
        ClickhouseOptions::default(),
    )
    .expect_err("bad URL");
    assert!(matches!(err, StorageError::InvalidOptions(_)), "{err:?}");

    let [a, _] = servers().http_ports;
    let err = open_url(
        &format!("clickhouse://127.0.0.1:{a}/errors?cluster=nosuch"),
        ClickhouseOptions::default(),
    )
    .expect_err("unknown cluster");
    assert_eq!(
        err.to_string(),
        format!(
            "invalid storage options: http://127.0.0.1:{a}/ has no cluster \"nosuch\" in its \
             remote_servers configuration"
        )
    );

    // Settings the data depends on are kept.
    let storage = cluster("errors");
    ingest_all(&storage, &[batch1()]);
    let err = open_url(
        &servers().cluster_url("errors"),
        ClickhouseOptions {
            bucket_nanos: 10 * SECOND,
            ..ClickhouseOptions::default()
        },
    )
    .expect_err("another bucket width");
    assert_eq!(
        err.to_string(),
        format!(
            "the database at http://127.0.0.1:{a}/errors cannot be used: it was created with \
             bucket_nanos = 60000000000, not the 10000000000 asked for; a database keeps the \
             settings it was created with"
        )
    );

    // An answer larger than max_response_bytes is an error, not memory:
    // the server is told the limit too (max_result_bytes) and refuses
    // first. (The client's own cap is tested in the client's unit tests.)
    let small = open_url(
        &servers().cluster_url("errors"),
        ClickhouseOptions {
            max_response_bytes: 4096,
            ..ClickhouseOptions::default()
        },
    )
    .expect("open with a small answer limit");
    let mut big = Builder::new(30, "node-a", T0, PERIOD_100HZ);
    let s1 = big.standard_stack(1);
    let long = "v".repeat(4000);
    let set = big.label_set(&[("a", &long), ("b", &long), ("c", &long)]);
    big.sample(s1, set, 1, 0);
    ingest_all(&small, &[big.validate()]);
    let err = small.label_names(&all(&[])).expect_err("too large");
    let chain = format!("{:#}", anyhow::Error::from(err));
    assert!(
        chain.starts_with("ClickHouse: reading label sets: "),
        "{chain}"
    );
    assert!(chain.contains("Limit for result exceeded"), "{chain}");

    // One shard of the cluster's database, without ?cluster=: refused.
    let err = open_url(
        &servers().single_url("errors"),
        ClickhouseOptions::default(),
    )
    .expect_err("one shard alone");
    assert_eq!(
        err.to_string(),
        format!(
            "the database at http://127.0.0.1:{a}/errors cannot be used: it was created for \
             cluster \"two\" (?cluster=two), not for a single server (no ?cluster=) as asked; \
             list every shard with ?cluster=NAME, as when it was created"
        )
    );

    // Rows no collector wrote: errors, not panics or wrong frames. First
    // the stacks are gone (the tables dropped and made anew, empty).
    for server in [0, 1] {
        servers().sql(server, "DROP TABLE errors.stacks_local");
    }
    let other = cluster("errors");
    match other.stacks(&all(&[])) {
        Err(StorageError::Corrupt(message)) => {
            assert!(message.starts_with("samples reference stack "), "{message}");
            assert!(message.ends_with(", which does not exist"), "{message}");
        }
        answer => panic!("expected a missing stack, got {answer:?}"),
    }
    // Then one is there with frames that are not a stack blob.
    servers().sql(
        0,
        "INSERT INTO errors.stacks_local (stack, bucket, frames) \
         SELECT stack, bucket, 'x' FROM errors.samples LIMIT 1",
    );
    match other.stacks(&all(&[])) {
        Err(StorageError::Corrupt(message)) => assert!(
            message.ends_with(": frames blob: stack blob version 120, this collector reads 1"),
            "{message}"
        ),
        answer => panic!("expected a corrupt stack, got {answer:?}"),
    }

    // The database gone under a running collector: the server's message.
    for server in [0, 1] {
        servers().sql(server, "DROP DATABASE errors");
    }
    let err = other.label_names(&all(&[])).expect_err("no tables");
    let chain = format!("{:#}", anyhow::Error::from(err));
    assert!(chain.contains("doesn't exist"), "{chain}");
}

/// Rollups are a cache of the samples, in ClickHouse as in SQLite: after
/// the compactor built them, with late batches, a retried batch's copies,
/// a try still in flight and retention through the middle of spans, every
/// answer is the one a SQLite database never compacted gives, and queries
/// read the rollups when they are current.
#[test]
fn rollups_answer_exactly_as_the_samples_they_sum() {
    let db = "rollups";
    let rolled = cluster(db);
    let dir = tempfile::tempdir().expect("temp dir");
    let base = SqliteStorage::open(&dir.path().join("base.db"), SqliteOptions::default())
        .expect("open SQLite");
    let mut next = seeded(0x2545_f491_4f6c_dd1d);
    let day_start = T0 - T0.rem_euclid(DAY);
    let mut id = 0u8;
    let mut ingest = |at: i64, seed: u64| -> u8 {
        id += 1;
        let period = if seed.is_multiple_of(10) {
            PERIOD_99HZ
        } else {
            PERIOD_100HZ
        };
        let batch = fleet_batch(id, &format!("node-{}", seed % 3), at, period, seed);
        ingest_all(&rolled, std::slice::from_ref(&batch));
        ingest_all(&base, &[batch]);
        id
    };
    let at = |seed: u64| {
        let at = day_start + (seed >> 8) as i64 % (2 * DAY);
        at - at.rem_euclid(10 * SECOND)
    };
    for _ in 0..60 {
        let seed = next();
        ingest(at(seed), seed);
    }
    let check = |start: i64, end: i64, what: &str| {
        let whole = |matchers: &[(&str, MatchOp, &str)]| select(start, end, matchers);
        let context = |query: &str, selection: &Selection| {
            format!(
                "{what}: {query}, range {start}..{end}, {:?}",
                selection.matchers
            )
        };
        for matchers in [
            &[][..],
            &[("node", MatchOp::Equal, "node-1")],
            &[("comm", MatchOp::Regex, "app|wor.*")],
            &[
                ("node", MatchOp::NotEqual, "node-0"),
                ("comm", MatchOp::Equal, "worker"),
            ],
        ] {
            let selection = whole(matchers);
            let (a, b) = (
                rolled.stacks(&selection).expect("query"),
                base.stacks(&selection).expect("query"),
            );
            assert_eq!(sorted(&a), sorted(&b), "{}", context("stacks", &selection));
            assert_eq!(
                a.sample_period_nanos,
                b.sample_period_nanos,
                "{}",
                context("period", &selection)
            );
            assert_eq!(
                sorted(&rolled.stacks_in_units(&selection).expect("query")),
                sorted(&base.stacks_in_units(&selection).expect("query")),
                "{}",
                context("in units", &selection)
            );
            assert_eq!(
                rolled.label_values(&selection, "node").expect("query"),
                base.label_values(&selection, "node").expect("query"),
                "{}",
                context("node values", &selection)
            );
            for step in [0, 10 * MINUTE, 2 * 60 * MINUTE] {
                assert_eq!(
                    rolled.series(&selection, step).expect("query"),
                    base.series(&selection, step).expect("query"),
                    "{}",
                    context(&format!("series by {step}"), &selection)
                );
            }
        }
        let selection = whole(&[]);
        let off_cpu = Selection {
            profile_type: ProfileType::OffCpu,
            ..selection.clone()
        };
        assert_eq!(
            sorted(&rolled.stacks(&off_cpu).expect("query")),
            sorted(&base.stacks(&off_cpu).expect("query")),
            "{}",
            context("off-CPU stacks", &off_cpu)
        );
        assert_eq!(
            rolled.series_in_units(&selection, DAY).expect("query"),
            base.series_in_units(&selection, DAY).expect("query"),
            "{}",
            context("series in units", &selection)
        );
        assert_eq!(
            rolled.label_names(&selection).expect("query"),
            base.label_names(&selection).expect("query"),
            "{}",
            context("label names", &selection)
        );
        assert_eq!(
            rolled.profile_types(&selection).expect("query"),
            base.profile_types(&selection).expect("query"),
            "{}",
            context("profile types", &selection)
        );
    };
    let compare = |next: &mut dyn FnMut() -> u64, what: &str| {
        check(day_start - DAY, day_start + 3 * DAY, what);
        for _ in 0..3 {
            let (a, b) = (next(), next());
            let start = day_start - MINUTE + (a >> 8) as i64 % (2 * DAY + 2 * MINUTE);
            let length =
                1 + (b >> 8) as i64 % [30 * MINUTE, 5 * 60 * MINUTE, DAY][(b % 3) as usize];
            check(start, start + length, what);
        }
        // On and next to span edges.
        let c = next();
        let hour = day_start + (c >> 8) as i64 % (2 * DAY) / (60 * MINUTE) * (60 * MINUTE);
        check(hour, hour + 60 * MINUTE, what);
        check(hour - 1, hour + 10 * MINUTE + 1, what);
    };
    let compact_all = |closed_before: i64| {
        let mut total = 0;
        loop {
            match rolled.compact(closed_before).expect("compaction") {
                0 => return total,
                spans => total += spans,
            }
        }
    };

    compare(&mut next, "nothing rolled up yet");
    assert_eq!(rolled.rollup_spans_read(), 0);
    assert_eq!(compact_all(day_start), 0, "nothing closed");
    let spans = compact_all(day_start + 3 * DAY);
    assert!(
        spans > 60,
        "every width of two days rolls up: {spans} spans"
    );
    assert_eq!(compact_all(day_start + 3 * DAY), 0, "nothing left");
    compare(&mut next, "rolled up");
    assert!(rolled.rollup_spans_read() > 0, "queries read the rollups");

    // Late batches into rolled-up spans: those spans are read from their
    // samples until they are built again.
    for _ in 0..8 {
        let seed = next();
        ingest(at(seed), seed);
    }
    compare(&mut next, "late batches");
    assert!(compact_all(day_start + 3 * DAY) > 0);
    compare(&mut next, "late batches rolled up");

    // A batch tried twice (its first try stored its samples, not its id):
    // both copies on disk, its spans built again from them, counted once.
    for server in [0, 1] {
        servers().sql(server, &format!("SYSTEM STOP MERGES {db}.samples_local"));
    }
    let retried = format!("unhex('{}')", "05".repeat(16));
    servers().sql(
        0,
        &format!(
            "INSERT INTO {db}.attempts (batch, bucket, at_unix_nanos) \
             SELECT batch, bucket, 0 FROM {db}.attempts WHERE batch = {retried}"
        ),
    );
    servers().sql(
        0,
        &format!("INSERT INTO {db}.samples SELECT * FROM {db}.samples WHERE batch = {retried}"),
    );
    compare(&mut next, "a retried batch");
    assert!(compact_all(day_start + 3 * DAY) > 0);
    compare(&mut next, "a retried batch rolled up");

    // A try begun a moment ago, its samples not stored yet: its bucket is
    // not rolled up (they could land after the sum).
    let in_flight = day_start + DAY + 7 * MINUTE;
    servers().sql(
        0,
        &format!(
            "INSERT INTO {db}.attempts (batch, bucket, at_unix_nanos) VALUES \
             (unhex('{}'), {in_flight}, {})",
            "ee".repeat(16),
            unix_nanos(SystemTime::now())
        ),
    );
    compact_all(day_start + 3 * DAY);
    let built = servers().sql(
        0,
        &format!(
            "SELECT count() FROM {db}.rollup_spans WHERE span_start = {in_flight} \
             AND width = {MINUTE} AND built_unix_nanos > {}",
            unix_nanos(SystemTime::now()) - 60 * SECOND
        ),
    );
    assert_eq!(
        built.trim(),
        "0",
        "a bucket with a try in flight is not built"
    );
    compare(&mut next, "a try in flight");

    // Retention through the middle of spans.
    let mut cutoff = day_start + 13 * 60 * MINUTE + 25 * MINUTE + 17 * SECOND;
    for step in 0..2 {
        rolled.delete_before(cutoff).expect("retention");
        base.delete_before(cutoff).expect("retention");
        compare(&mut next, &format!("retention step {step}"));
        compact_all(day_start + 3 * DAY);
        compare(
            &mut next,
            &format!("retention step {step}, rolled up again"),
        );
        cutoff += 7 * 60 * MINUTE + 3 * SECOND;
    }
    assert_eq!(rolled.merged_sums(), 0);
}

/// A TCP forwarder to a server's HTTP port that can be closed and opened
/// again on the same port: closed, connections are refused and those open
/// are cut, as when the server is down (its shard stays up behind the
/// other server's `Distributed` tables, which reach it directly).
struct Door {
    port: u16,
    target: u16,
    open: Arc<std::sync::atomic::AtomicBool>,
    connections: Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
    accepting: Option<std::thread::JoinHandle<()>>,
}

impl Door {
    fn to(target: u16) -> Door {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("an address").port();
        let mut door = Door {
            port,
            target,
            open: Arc::default(),
            connections: Arc::default(),
            accepting: None,
        };
        door.open_with(listener);
        door
    }

    fn open_with(&mut self, listener: std::net::TcpListener) {
        use std::sync::atomic::Ordering;
        listener.set_nonblocking(true).expect("nonblocking");
        self.open.store(true, Ordering::SeqCst);
        let (open, connections, target) = (
            Arc::clone(&self.open),
            Arc::clone(&self.connections),
            self.target,
        );
        self.accepting = Some(std::thread::spawn(move || {
            while open.load(Ordering::SeqCst) {
                let client = match listener.accept() {
                    Ok((client, _)) => client,
                    Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(std::time::Duration::from_millis(2));
                        continue;
                    }
                    Err(err) => panic!("accept: {err}"),
                };
                client.set_nonblocking(false).expect("blocking");
                let server =
                    std::net::TcpStream::connect(("127.0.0.1", target)).expect("the server");
                let mut held = connections.lock().expect("lock");
                for (from, to) in [(&client, &server), (&server, &client)] {
                    let (mut from, mut to) = (
                        from.try_clone().expect("clone"),
                        to.try_clone().expect("clone"),
                    );
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(std::net::Shutdown::Both);
                    });
                }
                held.extend([client, server]);
            }
        }));
    }

    /// Refuses new connections and cuts the open ones.
    fn close(&mut self) {
        self.open.store(false, std::sync::atomic::Ordering::SeqCst);
        if let Some(accepting) = self.accepting.take() {
            // Its panic (a failed accept or connect) fails the test
            // through the statements it cut; not a second panic in drop.
            let _ = accepting.join();
        }
        for stream in self.connections.lock().expect("lock").drain(..) {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
    }

    fn reopen(&mut self) {
        let listener = std::net::TcpListener::bind(("127.0.0.1", self.port)).expect("bind again");
        self.open_with(listener);
    }
}

impl Drop for Door {
    fn drop(&mut self) {
        self.close();
    }
}

/// A server that cannot be reached: the batches whose home shard it is go
/// to the other, registered as tries there, and every sample counts once,
/// also when they are sent again once it is back (its lookup does not know
/// them: they are stored again there, and counted once by their tries).
#[test]
fn a_batch_whose_home_server_is_down_is_stored_on_another() {
    let db = "failover";
    let [a, b] = servers().http_ports;
    let mut doors = [Door::to(a), Door::to(b)];
    let storage = open_url(
        &format!(
            "clickhouse://127.0.0.1:{},127.0.0.1:{}/{db}?cluster=two",
            doors[0].port, doors[1].port
        ),
        ClickhouseOptions::default(),
    )
    .expect("open");
    doors[1].close();
    let batches: Vec<ValidBatch> = (0..16u8)
        .map(|i| {
            let mut batch = Builder::new(i + 1, "node-a", T0, PERIOD_100HZ);
            let [s0, s1, s2] = batch.standard_stacks(true);
            let set = batch.label_set(&[("comm", "app")]);
            batch.sample(s0, set, 1, 0);
            batch.sample(s1, set, 2, 0);
            batch.sample(s2, set, 3, 0);
            batch.validate()
        })
        .collect();
    ingest_all(&storage, &batches);
    let expected = expect(&[(S0, 16), (S1, 32), (S2, 48)]);
    assert_eq!(weights(&storage, &all(&[])), expected);
    assert_eq!(
        rows_on(0, db, "samples_local"),
        48,
        "every batch on shard 1"
    );
    assert_eq!(rows_on(1, db, "samples_local"), 0);
    // Their ids written, all on shard 1 (while queued, this collector
    // knows every one).
    storage.flush_batch_ids();
    assert_eq!(rows_on(0, db, "batches_local"), 16);

    doors[1].reopen();
    let duplicates = batches
        .iter()
        .filter(|batch| storage.ingest(batch).expect("again") == IngestOutcome::Duplicate)
        .count();
    assert!(
        (1..16).contains(&duplicates),
        "those at home on shard 1 are known there, the others not on shard 2: {duplicates}"
    );
    assert_eq!(
        rows_on(1, db, "samples_local"),
        3 * (16 - duplicates) as u64
    );
    assert_eq!(weights(&storage, &all(&[])), expected);
    assert_eq!(
        storage.series(&all(&[]), MINUTE).expect("series"),
        [(T0, 96)]
    );
    assert_eq!(storage.merged_sums(), 0);
}
