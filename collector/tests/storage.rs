//! The SQLite storage engine against a real database file: what goes in
//! through `ingest::validate` comes out of every query with exactly the
//! ingested weights, survives reopening, is not double counted on retry,
//! and retention removes old data and what only it referenced.

#[path = "support/batches.rs"]
mod batches;

use std::{collections::BTreeMap, path::Path, sync::Arc};

use batches::*;
use stackscope_collector::{
    ingest::{self, IngestLimits, LineRecord, LocationRecord, MappingKind, MappingRecord},
    ingest::{SampleRecord, ValidBatch},
    storage::{
        IngestOutcome, Storage, StorageError,
        sqlite::{COMPACTION_SPANS_PER_CALL, CacheStats, SqliteOptions, SqliteStorage},
    },
};
use stackscope_profile::model::{CodeAddress, Frame, MatchOp, ProfileType, Selection, TimeRange};

fn open(path: &Path) -> SqliteStorage {
    SqliteStorage::open(path, SqliteOptions::default()).expect("open the database")
}

fn ingest_all(storage: &SqliteStorage, batches: &[ValidBatch]) {
    for batch in batches {
        let outcome = storage.ingest(batch).expect("ingest");
        assert_eq!(
            outcome,
            IngestOutcome::Stored {
                samples: batch.samples.len() as u64
            }
        );
    }
}

fn weights(storage: &SqliteStorage, selection: &Selection) -> BTreeMap<String, u64> {
    folded(&storage.stacks(selection).expect("query stacks"))
}

/// Rows of a table, read with a connection of the test's own.
fn rows(path: &Path, table: &str) -> i64 {
    let conn = rusqlite::Connection::open(path).expect("open for counting");
    conn.query_row(&format!("SELECT count(*) FROM {table}"), [], |row| {
        row.get(0)
    })
    .expect("count rows")
}

#[test]
fn queries_return_exactly_the_ingested_weights() {
    let dir = tempfile::tempdir().expect("tempdir");
    let storage = open(&dir.path().join("db/stackscope.db"));
    ingest_all(&storage, &[batch1(), batch2(), batch3()]);

    use MatchOp::*;
    let cases: [(&[Matcher], BTreeMap<String, u64>); 9] = [
        (&[], expect(&[(S0, 7), (S1, 14), (S2, 20)])),
        (
            &[("comm", Equal, "app")],
            expect(&[(S0, 7), (S1, 14), (S2, 13)]),
        ),
        (&[("comm", NotEqual, "app")], expect(&[(S2, 7)])),
        (
            &[("node", Regex, "node-a|x")],
            expect(&[(S0, 7), (S1, 3), (S2, 7)]),
        ),
        (
            &[("exe", NotRegex, ".*/app")],
            expect(&[(S1, 11), (S2, 13)]),
        ),
        // Absent labels read as empty, as in PromQL.
        (
            &[("pod", Equal, "")],
            expect(&[(S0, 7), (S1, 14), (S2, 20)]),
        ),
        (&[("pod", Regex, ".+")], expect(&[])),
        // The node label sent by node-b was replaced with its real name.
        (&[("node", Equal, "spoofed")], expect(&[])),
        (
            &[("comm", Equal, "app"), ("node", Equal, "node-b")],
            expect(&[(S1, 11), (S2, 13)]),
        ),
    ];
    for (matchers, expected) in cases {
        assert_eq!(
            weights(&storage, &all(matchers)),
            expected,
            "matchers {matchers:?}"
        );
    }

    // Time ranges select whole buckets: T0's holds B1 and B3, the next B2.
    assert_eq!(
        weights(&storage, &select(T0, T0 + MINUTE, &[])),
        expect(&[(S0, 5), (S1, 14), (S2, 20)])
    );
    assert_eq!(
        weights(&storage, &select(T0 + MINUTE, T0 + MINUTE + 1, &[])),
        expect(&[(S0, 2)])
    );
    assert_eq!(
        weights(&storage, &select(T0 + 2 * MINUTE, T0 + 3 * MINUTE, &[])),
        expect(&[])
    );
    assert_eq!(
        weights(&storage, &select(T0 + MINUTE, T0, &[])),
        expect(&[])
    );

    // Frames: one per line, innermost first, only the outermost of a
    // location not inlined; a location without lines is named after its
    // binary and address.
    let samples = storage.stacks(&all(&[])).expect("stacks");
    let frames_of = |wanted: &str| -> Vec<Frame> {
        samples
            .stacks
            .iter()
            .find(|s| name(s) == wanted)
            .expect("stack present")
            .frames
            .iter()
            .map(|f| (**f).clone())
            .collect()
    };
    // Its code address travels with it, to be named from debuginfo; with
    // no code segments from the node, only as a file offset.
    let unknown = Frame {
        unnamed_code: Some(CodeAddress {
            file_offset: 0x1a2b,
            vaddr: None,
        }),
        ..frame(
            "[unknown] libfoo.so+0x1a2b",
            "libfoo.so",
            "abcd01",
            "",
            0,
            false,
        )
    };
    assert_eq!(
        frames_of(S0),
        [
            unknown,
            frame("inlined_helper", "app", "", "util.h", 3, true),
            frame("work", "app", "", "app.c", 10, false),
            frame("main", "app", "", "app.c", 20, false),
        ]
    );
    assert_eq!(
        frames_of(S2),
        [
            frame("do_syscall_64", "[kernel]", "", "", 0, false),
            frame("main", "app", "", "app.c", 20, false),
        ]
    );
    // A location's frames are shared between the stacks that hold it.
    let main_frames: Vec<&Arc<Frame>> = samples
        .stacks
        .iter()
        .filter_map(|s| s.frames.last())
        .collect();
    assert_eq!(main_frames.len(), 3);
    assert!(main_frames.windows(2).all(|w| Arc::ptr_eq(w[0], w[1])));

    // The sample period is known only where the batches agree on it.
    let period = |matchers: &[Matcher<'_>]| {
        storage
            .stacks(&all(matchers))
            .expect("stacks")
            .sample_period_nanos
    };
    assert_eq!(period(&[]), 0);
    assert_eq!(period(&[("node", Equal, "node-a")]), PERIOD_100HZ);
    assert_eq!(period(&[("node", Equal, "node-b")]), PERIOD_99HZ);
    // In units, each sample counts its own period, agreeing or not.
    let ticks = |matchers: &[Matcher<'_>]| {
        storage
            .stacks(&all(matchers))
            .expect("stacks")
            .total_weight()
    };
    let expected = ticks(&[("node", Equal, "node-a")]) * PERIOD_100HZ
        + ticks(&[("node", Equal, "node-b")]) * PERIOD_99HZ;
    let in_units = storage.stacks_in_units(&all(&[])).expect("stacks");
    assert_eq!(
        (in_units.total_weight(), in_units.sample_period_nanos),
        (expected, 1)
    );
    let series: u64 = storage
        .series_in_units(&all(&[]), 0)
        .expect("series")
        .iter()
        .map(|(_, w)| w)
        .sum();
    assert_eq!(series, expected);
    assert_eq!(
        storage.stacks(&all(&[])).expect("stacks").total_weight(),
        41
    );

    // One stored copy of each dictionary item, whichever batch sent it.
    let path = storage.path().to_owned();
    assert_eq!(rows(&path, "mappings"), 3);
    assert_eq!(rows(&path, "locations"), 4);
    assert_eq!(rows(&path, "stacks"), 3);
    assert_eq!(rows(&path, "label_sets"), 3);
    // Six (bucket, label set, stack) sums, in a row per (bucket, label set).
    assert_eq!(rows(&path, "samples"), 4);
}

#[test]
fn label_names_values_and_series() {
    let dir = tempfile::tempdir().expect("tempdir");
    let storage = open(&dir.path().join("stackscope.db"));
    ingest_all(&storage, &[batch1(), batch2(), batch3()]);
    use MatchOp::*;

    assert_eq!(
        storage.label_names(&all(&[])).expect("names"),
        ["comm", "exe", "node"]
    );
    assert_eq!(
        storage
            .label_names(&all(&[("comm", Equal, "nothing")]))
            .expect("names"),
        Vec::<String>::new()
    );
    assert_eq!(
        storage.label_values(&all(&[]), "comm").expect("values"),
        ["app", "worker"]
    );
    assert_eq!(
        storage
            .label_values(&all(&[("node", Equal, "node-b")]), "comm")
            .expect("values"),
        ["app"]
    );
    assert_eq!(
        storage.label_values(&all(&[]), "exe").expect("values"),
        ["/usr/bin/app", "/usr/bin/other"]
    );
    assert_eq!(
        storage
            .label_values(&select(T0 + MINUTE, T0 + 2 * MINUTE, &[]), "exe")
            .expect("values"),
        ["/usr/bin/app"]
    );
    assert_eq!(
        storage.label_values(&all(&[]), "node").expect("values"),
        ["node-a", "node-b"]
    );
    assert_eq!(
        storage.label_values(&all(&[]), "pod").expect("values"),
        Vec::<String>::new()
    );

    assert_eq!(
        storage.series(&all(&[]), MINUTE).expect("series"),
        [(T0, 5 + 3 + 7 + 11 + 13), (T0 + MINUTE, 2)]
    );
    assert_eq!(
        storage.series(&all(&[]), 2 * MINUTE).expect("series"),
        [(T0, 41)]
    );
    assert_eq!(
        storage
            .series(
                &all(&[("comm", Equal, "app"), ("node", Equal, "node-a")]),
                MINUTE
            )
            .expect("series"),
        [(T0, 8), (T0 + MINUTE, 2)]
    );
    // Steps finer than a bucket put the bucket's weight at its start.
    assert_eq!(
        storage
            .series(&select(T0 + MINUTE, T0 + 2 * MINUTE, &[]), SECOND)
            .expect("series"),
        [(T0 + MINUTE, 2)]
    );
    assert_eq!(
        storage.series(&all(&[]), 0).expect("series"),
        storage.series(&all(&[]), MINUTE).expect("series"),
        "a step of 0 means one point per bucket"
    );
}

/// Off-CPU samples on the same labels and stacks as CPU ticks: each type's
/// queries see only their own weights and period, before and after the
/// compactor rolls the CPU samples up.
#[test]
fn profile_types_are_stored_and_queried_apart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let storage = open(&dir.path().join("stackscope.db"));
    let mut b = Builder::new(9, "node-a", T0 + 20 * SECOND, PERIOD_100HZ);
    let [s0, _, s2] = b.standard_stacks(false);
    let app = b.label_set(&[("comm", "app"), ("exe", "/usr/bin/app")]);
    b.sample(s0, app, 4, 0);
    b.off_cpu_sample(s0, app, 3_000_000);
    b.off_cpu_sample(s2, app, 40_000_000);
    ingest_all(&storage, &[batch1(), b.validate()]);
    use MatchOp::*;
    let off_cpu = |matchers: &[Matcher<'_>]| Selection {
        profile_type: ProfileType::OffCpu,
        ..all(matchers)
    };
    let check = |when: &str| {
        // CPU answers are those of the CPU samples alone.
        assert_eq!(
            weights(&storage, &all(&[])),
            expect(&[(S0, 9), (S1, 3), (S2, 7)]),
            "{when}"
        );
        assert_eq!(
            weights(&storage, &all(&[("comm", Equal, "app")])),
            expect(&[(S0, 9), (S1, 3)]),
            "{when}"
        );
        let blocked = expect(&[(S0, 3_000_000), (S2, 40_000_000)]);
        assert_eq!(weights(&storage, &off_cpu(&[])), blocked, "{when}");
        assert_eq!(
            weights(&storage, &off_cpu(&[("comm", Equal, "app")])),
            blocked,
            "{when}"
        );
        assert_eq!(
            weights(&storage, &off_cpu(&[("comm", Equal, "worker")])),
            expect(&[]),
            "{when}"
        );
        let periods =
            |selection: &Selection| storage.stacks(selection).unwrap().sample_period_nanos;
        assert_eq!(periods(&all(&[])), PERIOD_100HZ, "{when}");
        assert_eq!(periods(&off_cpu(&[])), 1, "{when}");
        // In units: CPU ticks as nanoseconds, off-CPU time as it is.
        let in_units =
            |selection: &Selection| storage.stacks_in_units(selection).unwrap().total_weight();
        assert_eq!(in_units(&all(&[])), 19 * PERIOD_100HZ, "{when}");
        assert_eq!(in_units(&off_cpu(&[])), 43_000_000, "{when}");
        let total = |selection: &Selection| -> u64 {
            storage
                .series(selection, 0)
                .unwrap()
                .iter()
                .map(|(_, w)| w)
                .sum()
        };
        assert_eq!(total(&all(&[])), 19, "{when}");
        assert_eq!(total(&off_cpu(&[])), 43_000_000, "{when}");
        // The type's label is not one of the CPU samples' labels.
        assert_eq!(
            storage.label_names(&all(&[])).unwrap(),
            ["comm", "exe", "node"],
            "{when}"
        );
    };
    check("as stored");
    assert!(storage.compact(T0 + DAY).expect("compaction") > 0);
    check("rolled up");
}

#[test]
fn a_retried_batch_is_not_counted_twice() {
    let dir = tempfile::tempdir().expect("tempdir");
    let storage = open(&dir.path().join("stackscope.db"));
    ingest_all(&storage, &[batch1()]);
    let before = weights(&storage, &all(&[]));
    assert_eq!(
        storage.ingest(&batch1()).expect("retry"),
        IngestOutcome::Duplicate
    );
    assert_eq!(weights(&storage, &all(&[])), before);
    assert_eq!(before, expect(&[(S0, 5), (S1, 3), (S2, 7)]));
    assert_eq!(rows(storage.path(), "batches"), 1);
}

#[test]
fn data_survives_reopening() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("stackscope.db");
    let (before, names) = {
        let storage = open(&path);
        ingest_all(&storage, &[batch1(), batch3()]);
        (
            weights(&storage, &all(&[])),
            storage.label_names(&all(&[])).expect("names"),
        )
    };
    let storage = open(&path);
    assert_eq!(weights(&storage, &all(&[])), before);
    assert_eq!(storage.label_names(&all(&[])).expect("names"), names);
    // Dedup and dictionaries survive too: the retry is refused, and a new
    // batch with known stacks adds no dictionary rows.
    assert_eq!(
        storage.ingest(&batch1()).expect("retry"),
        IngestOutcome::Duplicate
    );
    ingest_all(&storage, &[batch2()]);
    assert_eq!(rows(&path, "stacks"), 3);
    assert_eq!(rows(&path, "locations"), 4);
    assert_eq!(
        weights(&storage, &all(&[])),
        expect(&[(S0, 7), (S1, 14), (S2, 20)])
    );
}

#[test]
fn sampling_divisor_scales_weight() {
    let dir = tempfile::tempdir().expect("tempdir");
    let storage = open(&dir.path().join("stackscope.db"));
    let mut b = Builder::new(9, "node-a", T0, PERIOD_100HZ);
    let [s0, s1, _] = b.standard_stacks(false);
    let budgeted = b.label_set(&[("comm", "busy")]);
    b.sample(s0, budgeted, 6, 4);
    b.sample(s1, budgeted, 6, 1);
    let batch = b.validate();
    ingest_all(&storage, &[batch]);
    assert_eq!(weights(&storage, &all(&[])), expect(&[(S0, 24), (S1, 6)]));
    assert_eq!(
        storage.series(&all(&[]), MINUTE).expect("series"),
        [(T0, 30)]
    );
}

#[test]
fn delete_before_removes_old_data_and_orphans() {
    let dir = tempfile::tempdir().expect("tempdir");
    let storage = open(&dir.path().join("stackscope.db"));
    // Old: B1 at T0 (S0, S1, S2; comm=app and comm=worker). New, an hour
    // later: S1 only, comm=app.
    let new = {
        let mut b = Builder::new(7, "node-a", T0 + 3600 * SECOND, PERIOD_100HZ);
        let s1 = b.standard_stack(1);
        let app = b.label_set(&[("comm", "app"), ("exe", "/usr/bin/app")]);
        b.sample(s1, app, 4, 0);
        b.validate()
    };
    ingest_all(&storage, &[batch1(), new]);
    let path = storage.path().to_owned();
    assert_eq!(
        (
            rows(&path, "stacks"),
            rows(&path, "locations"),
            rows(&path, "mappings")
        ),
        (3, 4, 3)
    );

    // T0's bucket ends at T0 + 60 s: not before T0 + 30 s.
    assert_eq!(storage.delete_before(T0 + 30 * SECOND).expect("delete"), 0);
    assert_eq!(
        storage.delete_before(T0 + 1800 * SECOND).expect("delete"),
        3
    );
    // The items T0's samples used are kept through the last bucket of
    // T0's dictionary epoch (the hour from T0 - 14 min): orphans once it
    // is gone.
    assert_eq!(storage.delete_before(T0 + 45 * MINUTE).expect("delete"), 0);
    assert_eq!(rows(&path, "stacks"), 3);
    assert_eq!(storage.delete_before(T0 + 46 * MINUTE).expect("delete"), 0);

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
    // Orphans: S0 and S2 with the libfoo and kernel locations and mappings,
    // and the comm=worker label set.
    assert_eq!(rows(&path, "samples"), 1);
    assert_eq!(rows(&path, "label_set_buckets"), 1);
    assert_eq!(rows(&path, "stacks"), 1);
    assert_eq!(rows(&path, "locations"), 2);
    assert_eq!(rows(&path, "mappings"), 1);
    assert_eq!(rows(&path, "label_sets"), 1);
    assert_eq!(rows(&path, "labels"), 3);
    // Batch ids received recently stay, so a late retry is still refused.
    assert_eq!(rows(&path, "batches"), 2);
    assert_eq!(
        storage.ingest(&batch1()).expect("retry"),
        IngestOutcome::Duplicate
    );

    // Deleted items come back under new ids (B2 carries all three stacks):
    // the caches forgot the old ones.
    ingest_all(&storage, &[batch2()]);
    assert_eq!(weights(&storage, &everything), expect(&[(S0, 2), (S1, 4)]));
    assert_eq!(rows(&path, "stacks"), 3);

    // A cutoff past everything (and past now) empties the database.
    assert_eq!(storage.delete_before(i64::MAX).expect("delete"), 2);
    for table in [
        "samples",
        "stacks",
        "locations",
        "mappings",
        "label_sets",
        "labels",
        "batches",
    ] {
        assert_eq!(rows(&path, table), 0, "{table}");
    }
    assert_eq!(weights(&storage, &everything), expect(&[]));
}

/// The last id SQLite handed out in `table` (AUTOINCREMENT's counter).
fn last_id(path: &Path, table: &str) -> i64 {
    let conn = rusqlite::Connection::open(path).expect("open for the sequence");
    conn.query_row(
        "SELECT seq FROM sqlite_sequence WHERE name = ?1",
        [table],
        |row| row.get(0),
    )
    .expect("read the sequence")
}

/// Retention forgets only the cached items it deleted, and items already
/// stored keep their ids when the caches miss them (after reopening): ids
/// count items, not cache misses, so they stay dense on a database that
/// lives for months.
#[test]
fn retention_and_cold_caches_keep_ids_dense() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("stackscope.db");
    // S1 for comm=app, `minutes` after T0, in a batch of its own.
    let later = |id: u8, minutes: i64| {
        let mut b = Builder::new(id, "node-a", T0 + minutes * MINUTE, PERIOD_100HZ);
        let s1 = b.standard_stack(1);
        let app = b.label_set(&[("comm", "app"), ("exe", "/usr/bin/app")]);
        b.sample(s1, app, 4, 0);
        b.validate()
    };
    let tables = ["stacks", "locations", "mappings", "label_sets"];
    let last_ids = || tables.map(|table| last_id(&path, table));
    {
        let storage = open(&path);
        ingest_all(&storage, &[batch1(), later(7, 60)]);
        // Deletes T0's orphans (S0, S2, comm=worker; kept through the end
        // of T0's dictionary epoch, T0 + 45 min) and keeps S1.
        assert_eq!(storage.delete_before(T0 + 46 * MINUTE).expect("delete"), 3);
        let before = storage.cache_stats();
        ingest_all(&storage, &[later(8, 61)]);
        let after = storage.cache_stats();
        assert_eq!(
            after.misses, before.misses,
            "retention kept S1 and its label set cached"
        );
        assert!(after.hits > before.hits);
        // A late batch at T0 again, with the stacks retention deleted: they
        // are stored anew, not referenced by the ids the caches forgot.
        let mut late = batch1();
        late.batch_id = [0x77; 16];
        ingest_all(&storage, &[late]);
        assert_eq!(
            weights(&storage, &select(0, T0 + MINUTE, &[])),
            expect(&[(S0, 5), (S1, 3), (S2, 7)]),
        );
    }
    let ids = last_ids();
    let storage = open(&path);
    // In the next dictionary epoch (the hour from T0 + 106 min).
    ingest_all(&storage, &[later(9, 110)]);
    assert!(storage.cache_stats().misses > 0, "the caches start cold");
    assert_eq!(last_ids(), ids, "known items took no new ids");
    // Found by their hash, they moved to the end of the batch's epoch, so
    // retention keeps them as long as the samples that use them.
    let conn = rusqlite::Connection::open(&path).expect("open for last buckets");
    for table in tables {
        let latest: i64 = conn
            .query_row(
                &format!("SELECT max(last_bucket) FROM {table}"),
                [],
                |row| row.get(0),
            )
            .expect("read last buckets");
        assert_eq!(latest, T0 + 165 * MINUTE, "{table}");
    }
    // S1: 4 in each later batch, 3 in the late one.
    assert_eq!(
        weights(&storage, &select(0, i64::MAX, &[])),
        expect(&[(S0, 5), (S1, 15), (S2, 7)])
    );
}

/// After batches whose stacks were all new, items the caches do not know
/// are inserted first; those the table holds already (the caches, far too
/// small here, forgot them) are found when their insert meets them: same
/// ids, no id used up, weights added to the stored stacks.
#[test]
fn items_inserted_first_but_stored_already_keep_their_ids() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("stackscope.db");
    let storage = SqliteStorage::open(
        &path,
        SqliteOptions {
            cache_entries: 2,
            ..SqliteOptions::default()
        },
    )
    .expect("open the database");
    // Ten stacks of two frames: one of its own at `first + i`, under a
    // shared one, weighed 1 + i, each under a label set of its own.
    let batch = |id: u8, first: u64| {
        let mut b = Builder::new(id, "node-a", T0, PERIOD_100HZ);
        let app = b.mapping(
            stackscope_proto::v1::MappingKind::User,
            "ab12",
            "/usr/bin/app",
        );
        let outer = b.location(app, 0x9000, &[("main", "app.c", 1)]);
        for i in 0..10 {
            let leaf = b.location(app, first + i, &[("leaf", "app.c", 2)]);
            let stack = b.stack(&[leaf, outer]);
            let labels = b.label_set(&[("comm", &format!("app{}", first + i))]);
            b.sample(stack, labels, 1 + i, 0);
        }
        b.validate()
    };
    ingest_all(
        &storage,
        &[batch(1, 0x1000), batch(2, 0x2000), batch(3, 0x3000)],
    );
    // The shared outer frame of batches 2 and 3 already: the caches forgot it.
    let conflicts = storage.cache_stats().insert_conflicts;
    let tables = ["stacks", "locations", "mappings", "label_sets"];
    let last_ids = || tables.map(|table| last_id(&path, table));
    let before = last_ids();
    assert_eq!(before, [30, 31, 1, 30]);
    let labels = rows(&path, "labels");

    // The first batch's stacks again.
    ingest_all(&storage, &[batch(4, 0x1000)]);
    assert!(
        storage.cache_stats().insert_conflicts >= conflicts + 30,
        "the stacks, their leaf locations and label sets were inserted first: {:?}",
        storage.cache_stats()
    );
    assert_eq!(last_ids(), before, "no id used up");
    assert_eq!((rows(&path, "stacks"), rows(&path, "locations")), (30, 31));
    assert_eq!(rows(&path, "labels"), labels);
    let everything = storage.stacks(&all(&[])).expect("stacks");
    let mut weights: Vec<u64> = everything.stacks.iter().map(|s| s.weight).collect();
    weights.sort_unstable();
    let mut expected: Vec<u64> = (1..=10).flat_map(|w| [w, w, 2 * w]).collect();
    expected.sort_unstable();
    assert_eq!(weights, expected);

    // New stacks after that take the next ids.
    ingest_all(&storage, &[batch(5, 0x5000)]);
    assert_eq!(last_ids(), [40, 41, 1, 40]);
}

#[test]
fn a_rejected_batch_stores_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let storage = open(&dir.path().join("stackscope.db"));

    // Rejected by validation: never reaches storage.
    let mut b = Builder::new(4, "node-a", T0, PERIOD_100HZ);
    let [s0, _, _] = b.standard_stacks(false);
    let set = b.label_set(&[("comm", "app")]);
    b.sample(s0, set, 1, 0);
    b.sample(900, set, 1, 0);
    let err = ingest::validate(b.batch, &IngestLimits::default()).expect_err("bad batch");
    assert_eq!(
        err.to_string(),
        "sample 1: stack index 900 out of range (batch has 3 stacks)"
    );

    // Fails inside the storage transaction, after the dictionaries were
    // written: everything is rolled back, and the caches do not keep ids of
    // rows that were never committed.
    let mut broken = batch1();
    broken.samples.push(SampleRecord {
        stack: 900,
        label_set: 0,
        weight: 1,
    });
    match storage.ingest(&broken) {
        Err(StorageError::InvalidBatch(message)) => {
            assert_eq!(message, "sample 3: stack 900 out of range (3 items)");
        }
        other => panic!("expected InvalidBatch, got {other:?}"),
    }
    let path = storage.path().to_owned();
    for table in [
        "batches",
        "mappings",
        "locations",
        "stacks",
        "label_sets",
        "labels",
        "samples",
    ] {
        assert_eq!(rows(&path, table), 0, "{table}");
    }

    // The same batch, well formed, is stored (its id was not recorded) and
    // reads back whole, also after another batch with the same stacks: had
    // the caches kept the rolled-back ids, both would reference missing rows.
    ingest_all(&storage, &[batch3(), batch1()]);
    assert_eq!(
        weights(&storage, &all(&[])),
        expect(&[(S0, 5), (S1, 14), (S2, 20)])
    );
}

#[test]
fn hand_built_batches_and_cache_hits() {
    let dir = tempfile::tempdir().expect("tempdir");
    let storage = open(&dir.path().join("stackscope.db"));
    let batch = |id: u8, start: i64| ValidBatch {
        batch_id: [id; 16],
        node: "n".into(),
        range: TimeRange {
            start_unix_nanos: start,
            end_unix_nanos: start + SECOND,
        },
        sample_period_nanos: 1,
        mappings: vec![MappingRecord {
            kind: MappingKind::Vdso,
            build_id: "00ff".into(),
            path: "[vdso]".into(),
            code_segments: Vec::new(),
        }],
        locations: vec![LocationRecord {
            mapping: 0,
            address: 0x9f0,
            lines: vec![LineRecord {
                function: String::new(),
                file: String::new(),
                line: 0,
            }],
        }],
        stacks: vec![vec![0, 0]],
        label_sets: vec![vec![("node".into(), "n".into())]],
        label_set_periods: vec![1],
        samples: vec![SampleRecord {
            stack: 0,
            label_set: 0,
            weight: 2,
        }],
    };
    ingest_all(&storage, &[batch(1, T0)]);
    let first = storage.cache_stats();
    assert_eq!((first.hits, first.misses, first.entries), (0, 4, 4));
    // Same bucket: the stack and the label set are cache hits, and a known
    // stack's locations and mappings are not even looked up.
    ingest_all(&storage, &[batch(2, T0 + SECOND)]);
    assert_eq!(
        storage.cache_stats(),
        CacheStats {
            hits: 2,
            misses: 4,
            insert_conflicts: 0,
            entries: 4
        }
    );
    // A later bucket of the same dictionary epoch (an hour): nothing is
    // written again, so again only the stack and the label set are looked
    // at.
    ingest_all(&storage, &[batch(3, T0 + 2 * MINUTE)]);
    assert_eq!(storage.cache_stats().hits, 4);
    // The next epoch (from T0 + 46 min): the stack's locations and
    // mappings move on with it, still from the caches.
    ingest_all(&storage, &[batch(4, T0 + 50 * MINUTE)]);
    assert_eq!(
        storage.cache_stats(),
        CacheStats {
            hits: 8,
            misses: 4,
            insert_conflicts: 0,
            entries: 4
        }
    );

    let samples = storage.stacks(&all(&[])).expect("stacks");
    assert_eq!(samples.sample_period_nanos, 1);
    assert_eq!(samples.stacks.len(), 1);
    assert_eq!(samples.stacks[0].weight, 8);
    // A line without a function is named like a location without lines;
    // a recursive stack keeps both frames.
    let vdso = frame("[unknown] [vdso]+0x9f0", "[vdso]", "00ff", "", 0, false);
    assert_eq!(
        samples.stacks[0]
            .frames
            .iter()
            .map(|f| (**f).clone())
            .collect::<Vec<_>>(),
        [vdso.clone(), vdso]
    );
}

#[test]
fn concurrent_ingest_and_queries() {
    let dir = tempfile::tempdir().expect("tempdir");
    let storage = Arc::new(open(&dir.path().join("stackscope.db")));
    let threads: Vec<_> = (0..4u8)
        .map(|t| {
            let storage = Arc::clone(&storage);
            std::thread::spawn(move || {
                for i in 0..10u8 {
                    let mut b =
                        Builder::new(t * 10 + i + 1, &format!("node-{t}"), T0, PERIOD_100HZ);
                    let [s0, s1, s2] = b.standard_stacks(i % 2 == 0);
                    let set = b.label_set(&[("comm", "app")]);
                    b.sample(s0, set, 1, 0);
                    b.sample(s1, set, 2, 0);
                    b.sample(s2, set, 3, 0);
                    storage.ingest(&b.validate()).expect("ingest");
                    storage.stacks(&all(&[])).expect("query while ingesting");
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().expect("thread");
    }
    assert_eq!(
        weights(&storage, &all(&[])),
        expect(&[(S0, 40), (S1, 80), (S2, 120)])
    );
    assert_eq!(
        storage.label_values(&all(&[]), "node").expect("values"),
        ["node-0", "node-1", "node-2", "node-3"]
    );
}

/// Batches stored at the same time share commits, and one that fails
/// inside the shared transaction, after writing its dictionaries, is
/// rolled back alone: every other batch is stored whole, and no cache keeps
/// an id of its rows.
#[test]
fn batches_arriving_together_share_commits_and_a_broken_one_fails_alone() {
    const THREADS: u8 = 6;
    const BATCHES: u8 = 12;
    let dir = tempfile::tempdir().expect("tempdir");
    let storage = Arc::new(open(&dir.path().join("stackscope.db")));
    let start = Arc::new(std::sync::Barrier::new(THREADS as usize));
    // Batch `n` holds one stack of its own (leaf at 0x1000 + n under a
    // shared frame) weighing n; every fifth one of thread 0 is broken.
    let batch = |n: u32, broken: bool| {
        let mut b = Builder::new(0, "node-a", T0, PERIOD_100HZ);
        b.batch.batch_id = n.to_le_bytes().repeat(4);
        let app = b.mapping(
            stackscope_proto::v1::MappingKind::User,
            "ab12",
            "/usr/bin/app",
        );
        let outer = b.location(app, 0x9000, &[("main", "app.c", 1)]);
        let leaf = b.location(app, 0x1000 + u64::from(n), &[("leaf", "app.c", 2)]);
        let stack = b.stack(&[leaf, outer]);
        let labels = b.label_set(&[("comm", "app")]);
        b.sample(stack, labels, u64::from(n), 0);
        let mut valid = b.validate();
        if broken {
            valid.samples.push(SampleRecord {
                stack: 900,
                label_set: 0,
                weight: 1,
            });
        }
        valid
    };
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (storage, start) = (Arc::clone(&storage), Arc::clone(&start));
            std::thread::spawn(move || {
                start.wait();
                let mut stored = Vec::new();
                for i in 0..BATCHES {
                    let n = u32::from(t) * 100 + u32::from(i) + 1;
                    let broken = t == 0 && i % 5 == 0;
                    match storage.ingest(&batch(n, broken)) {
                        Ok(IngestOutcome::Stored { samples: 1 }) if !broken => stored.push(n),
                        Err(StorageError::InvalidBatch(_)) if broken => {}
                        other => panic!("batch {n} (broken: {broken}): {other:?}"),
                    }
                }
                stored
            })
        })
        .collect();
    let stored: Vec<u32> = threads
        .into_iter()
        .flat_map(|thread| thread.join().expect("thread"))
        .collect();
    let broken = (0..BATCHES).filter(|i| i % 5 == 0).count();
    assert_eq!(stored.len(), THREADS as usize * BATCHES as usize - broken);

    let commits = storage.commit_stats();
    assert_eq!(commits.batches, stored.len() as u64);
    assert!(
        commits.commits < commits.batches,
        "batches stored at the same time shared no commit: {commits:?}"
    );
    let path = storage.path().to_owned();
    assert_eq!(rows(&path, "batches"), stored.len() as i64);
    assert_eq!(rows(&path, "stacks"), stored.len() as i64);
    assert_eq!(rows(&path, "locations"), stored.len() as i64 + 1);
    let weights = || -> Vec<u64> {
        let mut weights: Vec<u64> = (storage.stacks(&all(&[])).expect("stacks").stacks)
            .iter()
            .map(|stack| stack.weight)
            .collect();
        weights.sort_unstable();
        weights
    };
    let mut expected: Vec<u64> = stored.iter().map(|&n| u64::from(n)).collect();
    expected.sort_unstable();
    assert_eq!(weights(), expected);

    // The broken batches again, well formed: stored under the ids of
    // stacks no cache remembers.
    for i in (0..BATCHES).filter(|i| i % 5 == 0) {
        let n = u32::from(i) + 1;
        ingest_all(&storage, &[batch(n, false)]);
    }
    assert_eq!(
        rows(&path, "stacks"),
        THREADS as i64 * BATCHES as i64,
        "every stack stored once"
    );
    let mut all_weights: Vec<u64> = (0..THREADS)
        .flat_map(|t| (0..BATCHES).map(move |i| u64::from(t) * 100 + u64::from(i) + 1))
        .collect();
    all_weights.sort_unstable();
    assert_eq!(weights(), all_weights);
}

/// Rewrites the samples of a database this collector wrote as versions 1
/// to 6 kept them: a row per (bucket, label set, stack), not a blob per
/// (bucket, label set) of (stack id step, weight) varints after their count.
fn samples_as_rows(conn: &rusqlite::Connection) -> rusqlite::Result<()> {
    conn.execute_batch(
        "ALTER TABLE samples RENAME TO samples_blobs;
         CREATE TABLE samples (
             bucket_start INTEGER NOT NULL,
             label_set_id INTEGER NOT NULL,
             stack_id INTEGER NOT NULL,
             weight INTEGER NOT NULL,
             PRIMARY KEY (bucket_start, label_set_id, stack_id)
         ) STRICT, WITHOUT ROWID;",
    )?;
    let blobs: Vec<(i64, i64, Vec<u8>)> = conn
        .prepare("SELECT bucket_start, label_set_id, stacks FROM samples_blobs")?
        .query_map([], |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)))?
        .collect::<Result<_, _>>()?;
    for (bucket, label_set, blob) in blobs {
        let mut bytes = blob.iter();
        let mut varint = || {
            let (mut value, mut shift) = (0u64, 0);
            for &byte in bytes.by_ref() {
                value |= u64::from(byte & 0x7f) << shift;
                if byte & 0x80 == 0 {
                    break;
                }
                shift += 7;
            }
            value
        };
        let (pairs, mut stack) = (varint(), 0);
        for _ in 0..pairs {
            stack += varint() as i64;
            conn.execute(
                "INSERT INTO samples VALUES (?1, ?2, ?3, ?4)",
                (bucket, label_set, stack, varint() as i64),
            )?;
        }
    }
    conn.execute_batch("DROP TABLE samples_blobs")
}

#[test]
fn a_version_1_database_is_upgraded_and_keeps_its_samples() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("stackscope.db");
    let storage = open(&path);
    storage.ingest(&batch1()).expect("ingest");
    let before = weights(&storage, &all(&[]));
    drop(storage);
    // What version 1 looked like: the same tables plus samples.count,
    // mappings without code segments, and no rollups.
    rusqlite::Connection::open(&path)
        .and_then(|conn| {
            samples_as_rows(&conn)?;
            conn.execute_batch(
                "ALTER TABLE samples ADD COLUMN count INTEGER NOT NULL DEFAULT 1;
                 ALTER TABLE mappings DROP COLUMN code_segments;
                 DROP TABLE rollups; DROP TABLE rollup_spans; DROP TABLE pending_spans;
                 DROP TABLE label_rollups; DROP TABLE label_rollup_sets;
                 DROP TABLE abandoned_spans; DROP INDEX labels_by_name;
                 PRAGMA user_version = 1;",
            )
        })
        .expect("making a version 1 database");

    let storage = open(&path);
    assert_eq!(weights(&storage, &all(&[])), before, "samples kept");
    // The history is pending: the compactor rolls it up (bucket, 10 min,
    // 1 h and 1 day spans of batch 1's bucket), and the answer stays.
    assert_eq!(storage.compact(T0 + DAY).expect("compaction"), 4);
    assert_eq!(weights(&storage, &all(&[])), before, "same after rollups");
    storage.ingest(&batch2()).expect("ingest after the upgrade");
    assert_ne!(weights(&storage, &all(&[])), before, "batch 2 stored");
    drop(storage);
    let conn = rusqlite::Connection::open(&path).expect("reopen");
    let version: i32 = conn
        .query_row("PRAGMA user_version", [], |row| row.get(0))
        .expect("version");
    let has_column = |table: &str, column: &str| -> bool {
        conn.query_row(
            "SELECT count(*) FROM pragma_table_info(?1) WHERE name = ?2",
            [table, column],
            |row| row.get(0),
        )
        .expect("columns")
    };
    let has_index = |name: &str| -> bool {
        conn.query_row(
            "SELECT count(*) FROM sqlite_schema WHERE type = 'index' AND name = ?1",
            [name],
            |row| row.get(0),
        )
        .expect("indexes")
    };
    assert_eq!(
        (
            version,
            has_column("samples", "count"),
            has_column("samples", "stacks"),
            has_column("mappings", "code_segments"),
            has_index("labels_by_name"),
            has_column("rollup_spans", "has_cpu"),
        ),
        (7, false, true, true, true, true)
    );
}

/// Version 5 rolled spans up without their labels: upgraded, its spans
/// are redone with them (and, as from version 6, into blobs), and answers
/// stay the same.
#[test]
fn a_version_5_database_rolls_its_history_up_again_with_labels() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("stackscope.db");
    let storage = open(&path);
    ingest_all(&storage, &[batch1(), batch3()]);
    assert_eq!(storage.compact(T0 + DAY).expect("compaction"), 4);
    let node = all(&[("node", MatchOp::Equal, "node-a")]);
    let (everything, one_node) = (weights(&storage, &all(&[])), weights(&storage, &node));
    assert!(!one_node.is_empty() && one_node != everything);
    drop(storage);
    rusqlite::Connection::open(&path)
        .and_then(|conn| {
            samples_as_rows(&conn)?;
            conn.execute_batch(
                "DROP TABLE label_rollups; DROP TABLE label_rollup_sets;
                 DROP TABLE abandoned_spans; ALTER TABLE rollup_spans DROP COLUMN has_cpu;
                 PRAGMA user_version = 5;",
            )
        })
        .expect("making a version 5 database");

    let storage = open(&path);
    assert_eq!(rows(&path, "rollup_spans"), 0);
    assert_eq!(rows(&path, "pending_spans"), 4, "every span redone");
    assert_eq!(weights(&storage, &all(&[])), everything);
    assert_eq!(weights(&storage, &node), one_node);
    assert_eq!(storage.compact(T0 + DAY).expect("compaction"), 4);
    assert!(rows(&path, "label_rollups") > 0, "rolled up with labels");
    assert_eq!(weights(&storage, &all(&[])), everything);
    assert_eq!(weights(&storage, &node), one_node);
}

/// Version 6 kept a row per (bucket, label set, stack) and rolled spans
/// up likewise: upgraded, its samples are one blob per (bucket, label set)
/// with the same sums, its rollups are redone, and answers stay the same
/// before and after.
#[test]
fn a_version_6_database_moves_its_samples_into_blobs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("stackscope.db");
    let storage = open(&path);
    ingest_all(&storage, &[batch1(), batch2(), batch3()]);
    let node = all(&[("node", MatchOp::Equal, "node-a")]);
    let (everything, one_node) = (weights(&storage, &all(&[])), weights(&storage, &node));
    assert!(!one_node.is_empty() && one_node != everything);
    let blob_rows = rows(&path, "samples");
    drop(storage);
    let sample_rows = rusqlite::Connection::open(&path)
        .and_then(|conn| {
            samples_as_rows(&conn)?;
            // A damaged row (no collector writes a weight below 1, nor a
            // stack that is not stored): left out, not the whole database.
            conn.execute("INSERT INTO samples VALUES (?1, 1, 999, -5)", [T0])?;
            // Version 6's rollups, with a span marked current whose rows
            // the upgrade must not trust.
            conn.execute_batch(
                "DROP TABLE rollups; DROP TABLE label_rollups; DROP TABLE abandoned_spans;
                 CREATE TABLE rollups (width INTEGER NOT NULL, span_start INTEGER NOT NULL,
                     stack_id INTEGER NOT NULL, weight INTEGER NOT NULL,
                     PRIMARY KEY (width, span_start, stack_id)) STRICT, WITHOUT ROWID;
                 CREATE TABLE label_rollups (width INTEGER NOT NULL,
                     span_start INTEGER NOT NULL, label_set_id INTEGER NOT NULL,
                     stack_id INTEGER NOT NULL, weight INTEGER NOT NULL,
                     PRIMARY KEY (width, span_start, label_set_id, stack_id))
                     STRICT, WITHOUT ROWID;
                 INSERT INTO rollups VALUES (60000000000, 0, 1, 1);
                 INSERT INTO rollup_spans VALUES (60000000000, 0, 0, 1);
                 PRAGMA user_version = 6;",
            )?;
            conn.query_row("SELECT count(*) FROM samples", [], |row| {
                row.get::<_, i64>(0)
            })
        })
        .expect("making a version 6 database");
    assert!(
        sample_rows > blob_rows,
        "{sample_rows} rows, {blob_rows} blobs"
    );

    let storage = open(&path);
    assert_eq!(rows(&path, "samples"), blob_rows);
    assert_eq!(
        (rows(&path, "rollups"), rows(&path, "rollup_spans")),
        (0, 0)
    );
    assert_eq!(weights(&storage, &all(&[])), everything);
    assert_eq!(weights(&storage, &node), one_node);
    let spans = storage.compact(T0 + DAY).expect("compaction");
    assert_eq!(rows(&path, "rollup_spans") as u64, spans);
    assert!(rows(&path, "label_rollups") > 0, "rolled up with labels");
    assert_eq!(weights(&storage, &all(&[])), everything);
    assert_eq!(weights(&storage, &node), one_node);
}

/// A sums blob that does not decode (a damaged file) fails the queries and
/// the ingest that read it with an error that says so, never a wrong
/// answer, and only those: other buckets, label sets and the compaction of
/// other spans go on, and retention deletes it like any other.
#[test]
fn a_damaged_sums_blob_is_an_error_and_only_where_it_is_read() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("stackscope.db");
    let storage = open(&path);
    let batch = |id: u8, minutes: i64, comm: &str| {
        let mut b = Builder::new(id, "node-a", T0 + minutes * MINUTE, PERIOD_100HZ);
        let s1 = b.standard_stack(1);
        let labels = b.label_set(&[("comm", comm)]);
        b.sample(s1, labels, 4, 0);
        b.validate()
    };
    ingest_all(&storage, &[batch(1, 0, "app"), batch(2, 60, "app")]);
    // Its count of pairs breaks off.
    rusqlite::Connection::open(&path)
        .and_then(|conn| {
            conn.execute(
                "UPDATE samples SET stacks = x'ff' WHERE bucket_start = ?1",
                [T0],
            )
        })
        .expect("damaging the first bucket's blob");
    let damaged = "a blob of stack sums holds truncated varint";
    let first_bucket = select(T0, T0 + MINUTE, &[]);
    let app_first_bucket = select(T0, T0 + MINUTE, &[("comm", MatchOp::Equal, "app")]);
    for selection in [&first_bucket, &app_first_bucket] {
        match storage.stacks(selection) {
            Err(StorageError::Corrupt(message)) => assert_eq!(message, damaged),
            other => panic!("expected Corrupt, got {other:?}"),
        }
    }
    match storage.ingest(&batch(3, 0, "app")) {
        Err(StorageError::Corrupt(message)) => assert_eq!(message, damaged),
        other => panic!("expected Corrupt, got {other:?}"),
    }
    ingest_all(&storage, &[batch(4, 0, "worker")]);
    let later = select(T0 + 60 * MINUTE, T0 + 61 * MINUTE, &[]);
    assert_eq!(weights(&storage, &later), expect(&[(S1, 4)]));

    // Compaction goes on past it: the spans holding the damaged bucket (the
    // bucket's, its 10 minutes, hour and day) are left to their buckets, the
    // later bucket's, 10 minutes and hour are built, and nothing is retried
    // until written again.
    assert_eq!(storage.compact(T0 + DAY).expect("compaction"), 7);
    assert_eq!(
        (rows(&path, "abandoned_spans"), rows(&path, "rollup_spans")),
        (4, 3)
    );
    assert_eq!(storage.compact(T0 + DAY).expect("compaction"), 0);
    assert_eq!(weights(&storage, &later), expect(&[(S1, 4)]));
    for selection in [&first_bucket, &all(&[])] {
        match storage.stacks(selection) {
            Err(StorageError::Corrupt(message)) => assert_eq!(message, damaged),
            other => panic!("expected Corrupt, got {other:?}"),
        }
    }

    // The worker's sum is counted; the damaged blob, unreadable, is not.
    assert_eq!(storage.delete_before(T0 + 30 * MINUTE).expect("delete"), 1);
    assert_eq!(
        weights(&storage, &select(0, i64::MAX, &[])),
        expect(&[(S1, 4)])
    );
}

#[test]
fn incompatible_databases_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("stackscope.db");
    drop(open(&path));

    let other_width = SqliteOptions {
        bucket_nanos: 10 * SECOND,
        ..SqliteOptions::default()
    };
    let err = SqliteStorage::open(&path, other_width).expect_err("other bucket width");
    assert_eq!(
        err.to_string(),
        format!(
            "the database at {} cannot be used: it sums samples into buckets of 60000000000 ns, \
             not the 10000000000 ns asked for; a database keeps the bucket width it was created \
             with",
            path.display()
        )
    );

    rusqlite::Connection::open(&path)
        .and_then(|conn| conn.pragma_update(None, "user_version", 8))
        .expect("set a newer version");
    let err = SqliteStorage::open(&path, SqliteOptions::default()).expect_err("newer schema");
    assert_eq!(
        err.to_string(),
        format!(
            "the database at {} cannot be used: its schema version 8 is newer than the 7 this \
             collector knows; run a newer collector",
            path.display()
        )
    );

    let err = SqliteStorage::open(
        &dir.path().join("other.db"),
        SqliteOptions {
            bucket_nanos: 0,
            ..SqliteOptions::default()
        },
    )
    .expect_err("zero width");
    assert_eq!(
        err.to_string(),
        "invalid storage options: bucket_nanos must be positive, got 0"
    );
    let err = SqliteStorage::open(
        &dir.path().join("other.db"),
        SqliteOptions {
            dictionary_epoch_nanos: -1,
            ..SqliteOptions::default()
        },
    )
    .expect_err("a negative epoch");
    assert_eq!(
        err.to_string(),
        "invalid storage options: dictionary_epoch_nanos must be positive, got -1"
    );
}

/// Rollups are a cache of the samples: whatever the compactor has done, a
/// late batch in a rolled-up span and retention through the middle of spans
/// included, every fleet-wide answer is the one the base rows give (a second
/// database that is never compacted).
#[test]
fn rollups_answer_exactly_as_the_samples_they_sum() {
    let dir = tempfile::tempdir().expect("tempdir");
    let rolled = open(&dir.path().join("rolled.db"));
    let base = open(&dir.path().join("base.db"));
    let mut next = seeded(0x9e37_79b9_7f4a_7c15);
    let day_start = T0 - T0.rem_euclid(DAY);
    let mut id = 0u8;
    let mut ingest = |at: i64, seed: u64| {
        id += 1;
        let node = format!("node-{}", seed % 3);
        // One batch in ten at 99 Hz: spans whose buckets disagree on the
        // period must say so as the buckets do.
        let period = if seed.is_multiple_of(10) {
            PERIOD_99HZ
        } else {
            PERIOD_100HZ
        };
        let batch = fleet_batch(id, &node, at, period, seed);
        rolled.ingest(&batch).expect("ingest");
        base.ingest(&batch).expect("ingest");
    };
    // Two days of batches, so spans of every width close.
    for _ in 0..150 {
        let seed = next();
        let at = day_start + (seed >> 8) as i64 % (2 * DAY);
        ingest(at - at.rem_euclid(10 * SECOND), seed);
    }
    // Every answer three ways: the rolled-up database with no matchers (its
    // rollups), the same with a matcher every label set passes (which never
    // reads rollups), and the twin that is never compacted.
    let check = |start: i64, end: i64, what: &str| {
        let selection = select(start, end, &[]);
        let off_cpu = Selection {
            profile_type: ProfileType::OffCpu,
            ..selection.clone()
        };
        assert_eq!(
            rolled.stacks(&off_cpu).expect("query"),
            base.stacks(&off_cpu).expect("query"),
            "{what}: range {start}..{end}, off-CPU time"
        );
        let answer = rolled.stacks(&selection).expect("query");
        let everyone = select(start, end, &[("comm", MatchOp::Regex, ".*")]);
        assert_eq!(
            answer,
            rolled.stacks(&everyone).expect("query"),
            "{what}: range {start}..{end}, rollups against the label sets' rows"
        );
        assert_eq!(
            answer,
            base.stacks(&selection).expect("query"),
            "{what}: range {start}..{end}, against the database never compacted"
        );
        // In units: spans of one rate scaled by it, spans of two read from
        // their rows.
        assert_eq!(
            rolled.stacks_in_units(&selection).expect("query"),
            base.stacks_in_units(&selection).expect("query"),
            "{what}: range {start}..{end}, in units"
        );
        // Matchers: the label rollups of the sets they select.
        let matched: [&[(&str, MatchOp, &str)]; 4] = [
            &[("node", MatchOp::Equal, "node-1")],
            &[("comm", MatchOp::Regex, "app|wor.*")],
            &[
                ("node", MatchOp::NotEqual, "node-0"),
                ("comm", MatchOp::Equal, "worker"),
            ],
            &[("comm", MatchOp::Regex, ".*")],
        ];
        for matchers in matched {
            let selection = select(start, end, matchers);
            let with = |what: &str| format!("{what}: range {start}..{end}, {matchers:?}");
            assert_eq!(
                rolled.stacks(&selection).expect("query"),
                base.stacks(&selection).expect("query"),
                "{}",
                with("stacks")
            );
            assert_eq!(
                rolled.stacks_in_units(&selection).expect("query"),
                base.stacks_in_units(&selection).expect("query"),
                "{}",
                with("in units")
            );
            assert_eq!(
                rolled.label_values(&selection, "node").expect("query"),
                base.label_values(&selection, "node").expect("query"),
                "{}",
                with("node values")
            );
            assert_eq!(
                rolled.profile_types(&selection).expect("query"),
                base.profile_types(&selection).expect("query"),
                "{}",
                with("profile types")
            );
        }
        assert_eq!(
            rolled.label_names(&selection).expect("query"),
            base.label_names(&selection).expect("query"),
            "{what}: range {start}..{end}, label names"
        );
        // Series whose points hold whole spans read them; others the buckets.
        let node = select(start, end, matched[0]);
        for step in [0, MINUTE, 7 * MINUTE, 20 * MINUTE, 2 * 60 * MINUTE, DAY] {
            for selection in [&selection, &node] {
                assert_eq!(
                    rolled.series(selection, step).expect("query"),
                    base.series(selection, step).expect("query"),
                    "{what}: range {start}..{end}, series by {step}, {:?}",
                    selection.matchers
                );
            }
            assert_eq!(
                rolled.series_in_units(&selection, step).expect("query"),
                base.series_in_units(&selection, step).expect("query"),
                "{what}: range {start}..{end}, series in units by {step}"
            );
        }
    };
    let compare = |next: &mut dyn FnMut() -> u64, what: &str| {
        for _ in 0..120 {
            let (a, b) = (next(), next());
            let start = day_start - MINUTE + (a >> 8) as i64 % (2 * DAY + 2 * MINUTE);
            // Lengths from seconds to the whole two days.
            let length = 1
                + (b >> 8) as i64
                    % [MINUTE, 30 * MINUTE, 5 * 60 * MINUTE, 2 * DAY][(b % 4) as usize];
            check(start, start + length, what);
        }
        // Ranges on and next to span edges, where off-by-one errors live.
        for width in [MINUTE, 10 * MINUTE, 60 * MINUTE, DAY] {
            let c = next();
            let span = day_start + (c >> 8) as i64 % (2 * DAY) / width * width;
            for (start, end) in [
                (span, span + width),
                (span - 1, span + width + 1),
                (span + 1, span + width),
                (span, span + width - 1),
                (span - MINUTE, span + width),
                (span, span + width + MINUTE),
            ] {
                check(start, end, what);
            }
        }
    };
    // The compactor until nothing closed is left.
    let compact_all = |closed_before: i64| {
        let mut total = 0;
        loop {
            let spans = rolled.compact(closed_before).expect("compaction");
            total += spans;
            if spans < COMPACTION_SPANS_PER_CALL {
                return total;
            }
        }
    };
    compare(&mut next, "nothing rolled up yet");
    assert_eq!(compact_all(day_start), 0, "nothing closed");
    let spans = compact_all(day_start + DAY + 3 * 60 * MINUTE);
    assert!(
        spans > 40,
        "the first day and three hours roll up: {spans} spans"
    );
    compare(&mut next, "first day rolled up");
    let path = dir.path().join("rolled.db");
    let widths = |path: &Path| -> Vec<i64> {
        let conn = rusqlite::Connection::open(path).expect("open");
        let mut stmt = conn
            .prepare("SELECT DISTINCT width FROM rollup_spans ORDER BY width")
            .expect("prepare");
        stmt.query_map([], |row| row.get(0))
            .expect("widths")
            .collect::<Result<_, _>>()
            .expect("widths")
    };
    assert_eq!(
        widths(&path),
        [MINUTE, 10 * MINUTE, 60 * MINUTE, DAY],
        "spans of every width"
    );

    // Late batches into rolled-up spans, and new ones after them.
    for _ in 0..20 {
        let seed = next();
        let at = day_start + (seed >> 8) as i64 % (2 * DAY);
        ingest(at - at.rem_euclid(10 * SECOND), seed);
    }
    compare(&mut next, "late batches, not rolled up again yet");
    compact_all(day_start + 3 * DAY);
    compare(&mut next, "everything rolled up");

    // Retention a few minutes at a time (cutoffs off the bucket grid, through
    // the middle of 10-minute spans and hours), compacting between steps.
    let mut cutoff = day_start + 13 * 60 * MINUTE + 25 * MINUTE + 17 * SECOND;
    let whole = |what: &str| check(day_start - DAY, day_start + 3 * DAY, what);
    for step in 0..4 {
        // Data in the bucket just after the cutoff, rolled up before
        // retention cuts its spans.
        let seed = next();
        let kept = cutoff + MINUTE;
        ingest(kept - kept.rem_euclid(MINUTE), seed);
        compact_all(day_start + 3 * DAY);
        assert_eq!(
            rolled.delete_before(cutoff).expect("retention"),
            base.delete_before(cutoff).expect("retention")
        );
        compare(&mut next, &format!("after retention step {step}"));
        compact_all(day_start + 3 * DAY);
        compare(
            &mut next,
            &format!("after retention step {step}, rolled up again"),
        );
        // A late batch in the same hour as the cutoff but another 10
        // minutes: the hour is redone, and must still hold what is left of
        // the 10 minutes retention cut.
        let seed = next();
        let late = cutoff + 15 * MINUTE;
        ingest(late - late.rem_euclid(MINUTE), seed);
        compact_all(day_start + 3 * DAY);
        whole(&format!("a late batch after retention step {step}"));
        compare(
            &mut next,
            &format!("a late batch after retention step {step}"),
        );
        cutoff += 7 * MINUTE + 3 * SECOND;
    }
    assert!(rows(&path, "rollup_spans") > 20, "rollups in use");
    assert_eq!(rows(&path, "pending_spans"), 0, "every closed span done");
}

/// Sums saturate at i64::MAX however they are grouped: per bucket, per
/// rollup span, across label sets.
#[test]
fn weights_saturate_alike_with_and_without_rollups() {
    let dir = tempfile::tempdir().expect("tempdir");
    let storage = open(&dir.path().join("stackscope.db"));
    for (id, comm) in [(1, "app"), (2, "worker"), (3, "app")] {
        let mut b = Builder::new(id, "node-a", T0 + i64::from(id) * MINUTE, PERIOD_100HZ);
        let [s0, _, _] = b.standard_stacks(false);
        let labels = b.label_set(&[("comm", comm)]);
        b.sample(s0, labels, i64::MAX as u64, 0);
        storage.ingest(&b.validate()).expect("ingest");
    }
    let everything = select(T0, T0 + DAY, &[]);
    let expected = expect(&[(S0, i64::MAX as u64)]);
    assert_eq!(weights(&storage, &everything), expected);
    assert!(storage.compact(T0 + 2 * DAY).expect("compaction") > 0);
    assert_eq!(weights(&storage, &everything), expected, "after rollups");
    assert_eq!(
        storage.series(&everything, DAY).expect("series"),
        [(T0 - T0.rem_euclid(DAY), i64::MAX as u64)]
    );
}

#[test]
fn sqlite_memory_is_published_with_the_page_caches_inside_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let storage = open(&dir.path().join("stackscope.db"));
    ingest_all(&storage, &[batch1()]);
    weights(&storage, &all(&[]));
    let mut state = Vec::new();
    storage.state_sizes(&mut state);
    let bytes = |name: &str| {
        state
            .iter()
            .find(|s| s.name == name)
            .and_then(|s| s.bytes)
            .unwrap_or_else(|| panic!("no {name} in {state:?}"))
    };
    let page_caches = bytes("writer_page_cache") + bytes("reader_page_cache");
    // SQLite's whole heap holds both connections' page caches and more
    // (schemas, statements): what the soak subtracts from the heap.
    assert!(page_caches > 0, "{state:?}");
    assert!(bytes("sqlite_memory") > page_caches, "{state:?}");
}
