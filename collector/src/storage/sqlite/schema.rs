//! The SQLite engine's schema and connections: the tables (below), the
//! migrations from older versions, the pragmas every connection gets, and
//! opening the writer (which creates or checks the schema) and the query
//! connections. Owns no ingest (`write`) and no queries (`read`).
//!
//! # Schema (version 7, in `PRAGMA user_version`)
//!
//! * `meta(key, value)`: settings the data depends on (`bucket_nanos`).
//! * `batches(id, received_unix_nanos, end_unix_nanos)`: ids of stored
//!   batches, so a retried batch is not counted twice.
//! * `mappings`, `locations`, `stacks`, `label_sets` (+ `labels`): the
//!   dictionaries. A sample's profile type is part of its label set: the
//!   label `__type__` names any type but CPU (whose sets have none, as
//!   before types existed). Each row is content-addressed by a 128-bit xxh3 `hash`
//!   (UNIQUE) of its content, so an identical item sent by any agent, in any
//!   batch, before or after a restart, is stored once, and the in-memory
//!   caches and the database share one key. Locations keep their lines inline
//!   in a compact blob rather than in a separate string table: dictionaries
//!   grow with the fleet's code, not with time, so the saving would be small
//!   next to the samples, and a self-contained row resolves in one lookup
//!   and needs no string garbage collection. Stacks keep their location ids
//!   as a varint blob, leaf first. Ids are `AUTOINCREMENT`, so an id is never
//!   reused after a delete and the query side may cache by id.
//! * `samples(bucket_start, label_set_id, stacks)`: per time bucket and
//!   label set, the summed weight of each stack, in one blob (see
//!   [`sums`]: queries read a label set's sums whole, and a row per stack
//!   cost them most of their time); `WITHOUT ROWID` with that primary key
//!   so a bucket is one contiguous range (cheap range scans and prefix
//!   deletes).
//! * `label_set_buckets(bucket_start, label_set_id, sample_period_nanos,
//!   weight)`: one row per label set and bucket with samples: the sample
//!   period they agree on (0 when batches disagree) and their total weight.
//!   It is small next to `samples`, answers `series`, `label_names` and
//!   `label_values` without touching samples, and tells a label-filtered
//!   `stacks` query exactly which (bucket, label set) rows of `samples` to
//!   read.
//! * Every dictionary row carries `last_bucket`, a bucket at or after the
//!   newest bucket of a batch that contained it: the last bucket of that
//!   batch's dictionary epoch (an hour by default), so an item in use is
//!   written once an epoch, not once a bucket. Buckets are only ever deleted
//!   oldest first, so once every bucket up to `b` is gone, rows with
//!   `last_bucket <= b` are referenced by nothing: retention finds orphans
//!   without scanning (or indexing) billions of sample rows; `last_bucket`
//!   is indexed so that costs what it deletes.
//! * `rollups`, `label_rollups`, `label_rollup_sets`, `rollup_spans`,
//!   `pending_spans`, `abandoned_spans`: sums of closed spans of 1 bucket, 10 min, 1 h and 1
//!   day, without labels and per label set, which queries read instead of
//!   `samples` and `label_set_buckets` (see [`rollup`]), their sums in
//!   blobs as `samples`'.

use std::path::Path;

use rusqlite::{Connection, OptionalExtension as _, TransactionBehavior};

use super::{SqliteOptions, StorageError, rollup, sums};
use crate::storage::tiers::Tiers;

/// The schema this code reads and writes. Bump it (and migrate) on any
/// change; an older collector refuses a newer database instead of
/// misreading it.
const SCHEMA_VERSION: i32 = 7;

/// The samples, apart from [`SCHEMA`]: version 6's step creates it too.
const SAMPLES_TABLE: &str = "
-- stacks: the label set's summed weight per stack in the bucket (see
-- `sums`).
CREATE TABLE samples (
    bucket_start INTEGER NOT NULL,
    label_set_id INTEGER NOT NULL,
    stacks BLOB NOT NULL,
    PRIMARY KEY (bucket_start, label_set_id)
) STRICT, WITHOUT ROWID;
";

const SCHEMA: &str = "
CREATE TABLE meta (
    key TEXT PRIMARY KEY,
    value ANY NOT NULL
) STRICT, WITHOUT ROWID;

CREATE TABLE batches (
    id BLOB PRIMARY KEY,
    received_unix_nanos INTEGER NOT NULL,
    end_unix_nanos INTEGER NOT NULL
) STRICT, WITHOUT ROWID;

-- code_segments: per executable segment, varint file offset, vaddr and
-- file size (empty when the node did not send them).
CREATE TABLE mappings (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    hash BLOB NOT NULL UNIQUE,
    kind INTEGER NOT NULL,
    build_id TEXT NOT NULL,
    path TEXT NOT NULL,
    last_bucket INTEGER NOT NULL,
    code_segments BLOB NOT NULL DEFAULT x''
) STRICT;

-- address: the u64 stored as the i64 with the same bits.
-- lines: per line, innermost first: varint length + function, varint
-- length + file, varint line.
CREATE TABLE locations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    hash BLOB NOT NULL UNIQUE,
    mapping_id INTEGER NOT NULL,
    address INTEGER NOT NULL,
    lines BLOB NOT NULL,
    last_bucket INTEGER NOT NULL
) STRICT;

-- locations: varint location ids, leaf first.
CREATE TABLE stacks (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    hash BLOB NOT NULL UNIQUE,
    locations BLOB NOT NULL,
    last_bucket INTEGER NOT NULL
) STRICT;

CREATE TABLE label_sets (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    hash BLOB NOT NULL UNIQUE,
    last_bucket INTEGER NOT NULL
) STRICT;

CREATE TABLE labels (
    label_set_id INTEGER NOT NULL,
    name TEXT NOT NULL,
    value TEXT NOT NULL,
    PRIMARY KEY (label_set_id, name)
) STRICT, WITHOUT ROWID;

-- Retention deletes dictionary rows by last_bucket: an index makes that
-- proportional to what it deletes. Ingest moves last_bucket at most once
-- per item and dictionary epoch, so keeping the indexes up costs little.
CREATE INDEX mappings_last_bucket ON mappings (last_bucket);
CREATE INDEX locations_last_bucket ON locations (last_bucket);
CREATE INDEX stacks_last_bucket ON stacks (last_bucket);
CREATE INDEX label_sets_last_bucket ON label_sets (last_bucket);
-- The label sets of profile types other than CPU, which rollups leave
-- out, are found by their type's label. Labels are written only with a
-- new set.
CREATE INDEX labels_by_name ON labels (name);

CREATE TABLE label_set_buckets (
    bucket_start INTEGER NOT NULL,
    label_set_id INTEGER NOT NULL,
    sample_period_nanos INTEGER NOT NULL,
    weight INTEGER NOT NULL,
    PRIMARY KEY (bucket_start, label_set_id)
) STRICT, WITHOUT ROWID;
";

/// Opens the connection that writes (ingest, retention, compaction): in
/// WAL mode, with the schema created or checked.
pub(super) fn open_writer(
    path: &Path,
    options: &SqliteOptions,
    tiers: &Tiers,
) -> Result<Connection, StorageError> {
    let open_error = |source| StorageError::Open {
        path: path.to_owned(),
        source,
    };
    let mut conn = Connection::open(path).map_err(open_error)?;
    configure(&conn, options).map_err(open_error)?;
    let mode: String = conn
        .query_row("PRAGMA journal_mode = WAL", [], |row| row.get(0))
        .map_err(open_error)?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(StorageError::Incompatible {
            path: path.to_owned(),
            reason: format!("it cannot use a write-ahead log (journal mode stays {mode:?})"),
        });
    }
    init_schema(&mut conn, path, options.bucket_nanos, tiers)?;
    Ok(conn)
}

/// Marks every span of `widths` that holds stored buckets for the
/// compactor to redo.
fn pend_every_span_with_data(
    tx: &rusqlite::Transaction<'_>,
    widths: &[i64],
) -> rusqlite::Result<()> {
    for &width in widths {
        tx.execute(
            "INSERT OR IGNORE INTO pending_spans (width, span_start)
             SELECT DISTINCT ?1, bucket_start - (bucket_start % ?1 + ?1) % ?1
             FROM label_set_buckets",
            [width],
        )?;
    }
    Ok(())
}

/// Version 6's step: `samples` rows, one per (bucket, label set, stack),
/// become one blob per (bucket, label set). Read in key order, so each
/// blob's pairs come in a run, ascending by stack id.
fn samples_into_blobs(tx: &rusqlite::Transaction<'_>) -> Result<(), StorageError> {
    tx.execute_batch("ALTER TABLE samples RENAME TO samples_version_6")?;
    tx.execute_batch(SAMPLES_TABLE)?;
    let mut read = tx.prepare(
        "SELECT bucket_start, label_set_id, stack_id, weight FROM samples_version_6
         ORDER BY bucket_start, label_set_id, stack_id",
    )?;
    let mut insert =
        tx.prepare("INSERT INTO samples (bucket_start, label_set_id, stacks) VALUES (?1, ?2, ?3)")?;
    let mut pairs: Vec<(i64, u64)> = Vec::new();
    let mut blob = Vec::new();
    let mut current: Option<(i64, i64)> = None;
    let mut flush = |key: (i64, i64), pairs: &mut Vec<(i64, u64)>| -> Result<(), StorageError> {
        if pairs.is_empty() {
            return Ok(());
        }
        blob.clear();
        sums::encode(&mut blob, pairs);
        insert.execute((key.0, key.1, &blob[..]))?;
        pairs.clear();
        Ok(())
    };
    let mut rows = read.query([])?;
    let mut unreadable = 0u64;
    while let Some(row) = rows.next()? {
        let key: (i64, i64) = (row.get(0)?, row.get(1)?);
        let (stack, weight): (i64, i64) = (row.get(2)?, row.get(3)?);
        if let Some(previous) = current.filter(|&previous| previous != key) {
            flush(previous, &mut pairs)?;
        }
        current = Some(key);
        // Never written by a collector (weights are at least 1): a damaged
        // row, left out rather than refusing the whole database.
        match u64::try_from(weight) {
            Ok(weight) if weight > 0 => pairs.push((stack, weight)),
            _ => unreadable += 1,
        }
    }
    if let Some(key) = current {
        flush(key, &mut pairs)?;
    }
    drop(rows);
    drop(read);
    tx.execute_batch("DROP TABLE samples_version_6")?;
    if unreadable > 0 {
        tracing::warn!(
            rows = unreadable,
            "upgrading the database: sample rows with a weight below 1 were left out"
        );
    }
    Ok(())
}

/// Opens a query connection, of a database `open_writer` has set up.
pub(super) fn open_reader(
    path: &Path,
    options: &SqliteOptions,
) -> Result<Connection, StorageError> {
    let open_error = |source| StorageError::Open {
        path: path.to_owned(),
        source,
    };
    let reader = Connection::open(path).map_err(open_error)?;
    configure(&reader, options).map_err(open_error)?;
    // The query side never writes; make that a guarantee.
    reader
        .pragma_update(None, "query_only", true)
        .map_err(open_error)?;
    Ok(reader)
}

fn configure(conn: &Connection, options: &SqliteOptions) -> rusqlite::Result<()> {
    conn.busy_timeout(options.busy_timeout)?;
    // FULL: in WAL mode the log is synced on every commit, so a batch is
    // acknowledged only once it would survive a power loss.
    conn.pragma_update(None, "synchronous", "FULL")?;
    conn.pragma_update(None, "cache_size", -i64::from(options.page_cache_kib))?;
    conn.pragma_update(None, "temp_store", "MEMORY")?;
    // Ingest holds about a dozen statements at once; queries a few more.
    conn.set_prepared_statement_cache_capacity(64);
    Ok(())
}

/// Creates the schema in a new database, or checks that an existing one was
/// written by this schema version and with this bucket width.
fn init_schema(
    conn: &mut Connection,
    path: &Path,
    bucket_nanos: i64,
    tiers: &Tiers,
) -> Result<(), StorageError> {
    let incompatible = |reason: String| StorageError::Incompatible {
        path: path.to_owned(),
        reason,
    };
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let mut version: i32 = tx.query_row("PRAGMA user_version", [], |row| row.get(0))?;
    // Version 1 also kept each row's raw sample count, which no query
    // read; the weight (count × divisor) is what flamegraphs sum.
    if version == 1 {
        tx.execute_batch("ALTER TABLE samples DROP COLUMN count")?;
        version = 2;
    }
    // Version 2 had no code segments: its mappings keep none (their frames
    // are named from debuginfo that holds the code, not from debug files).
    if version == 2 {
        tx.execute_batch(
            "ALTER TABLE mappings ADD COLUMN code_segments BLOB NOT NULL DEFAULT x''",
        )?;
        version = 3;
    }
    // Version 3 had no rollups: every stored bucket is pending, so the
    // compactor rolls the history up once.
    if version == 3 {
        tx.execute_batch(rollup::SCHEMA)?;
        pend_every_span_with_data(&tx, tiers.widths())?;
        version = 4;
    }
    // Version 4 had one profile type (CPU): the sets of other types are
    // found by their label through an index of their own.
    if version == 4 {
        tx.execute_batch("CREATE INDEX labels_by_name ON labels (name)")?;
        version = 5;
    }
    // Version 5 rolled up CPU samples without their labels alone: the
    // label tables are added here, and filled by redoing every span at
    // version 6's step.
    if version == 5 {
        tx.execute_batch(rollup::LABEL_SCHEMA)?;
        version = 6;
    }
    // Version 6 kept a row per (bucket, label set, stack), and rollups
    // likewise: samples move into one blob per (bucket, label set), the
    // rollups are dropped, and every span with data is pending, so the
    // compactor rolls the history up again.
    if version == 6 {
        samples_into_blobs(&tx)?;
        tx.execute_batch(
            "DROP TABLE IF EXISTS rollups;
             DROP TABLE IF EXISTS label_rollups;
             DELETE FROM rollup_spans;
             DELETE FROM label_rollup_sets;",
        )?;
        tx.execute_batch(rollup::SUMS_SCHEMA)?;
        pend_every_span_with_data(&tx, tiers.widths())?;
        tx.pragma_update(None, "user_version", SCHEMA_VERSION)?;
        version = SCHEMA_VERSION;
    }
    match version {
        0 => {
            tx.execute_batch(SCHEMA)?;
            tx.execute_batch(SAMPLES_TABLE)?;
            tx.execute_batch(rollup::SCHEMA)?;
            tx.execute_batch(rollup::LABEL_SCHEMA)?;
            tx.execute_batch(rollup::SUMS_SCHEMA)?;
            tx.execute(
                "INSERT INTO meta (key, value) VALUES ('bucket_nanos', ?1)",
                [bucket_nanos],
            )?;
            tx.pragma_update(None, "user_version", SCHEMA_VERSION)?;
        }
        SCHEMA_VERSION => {}
        newer if newer > SCHEMA_VERSION => {
            return Err(incompatible(format!(
                "its schema version {newer} is newer than the {SCHEMA_VERSION} this collector \
                 knows; run a newer collector"
            )));
        }
        other => return Err(incompatible(format!("unknown schema version {other}"))),
    }
    let stored: Option<i64> = tx
        .query_row(
            "SELECT value FROM meta WHERE key = 'bucket_nanos'",
            [],
            |row| row.get(0),
        )
        .optional()?;
    match stored {
        Some(stored) if stored == bucket_nanos => {}
        Some(stored) if stored > 0 => {
            return Err(incompatible(format!(
                "it sums samples into buckets of {stored} ns, not the {bucket_nanos} ns asked \
                 for; a database keeps the bucket width it was created with"
            )));
        }
        _ => {
            return Err(StorageError::Corrupt(format!(
                "meta.bucket_nanos is missing or not positive: {stored:?}"
            )));
        }
    }
    tx.commit()?;
    Ok(())
}
