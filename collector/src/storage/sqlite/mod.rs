//! The default storage engine: one embedded SQLite database file, in WAL
//! mode with `synchronous=FULL`, so an acknowledged batch survives a crash
//! or power loss. Owns the schema, the interning of batches' dictionaries
//! (mappings, locations, stacks, label sets) into content-addressed tables,
//! the per-bucket sums of samples, and the queries over them. Does not own
//! validation (`ingest`) or symbolization.
//!
//! # Schema (version 4, in `PRAGMA user_version`)
//!
//! * `meta(key, value)`: settings the data depends on (`bucket_nanos`).
//! * `batches(id, received_unix_nanos, end_unix_nanos)`: ids of stored
//!   batches, so a retried batch is not counted twice.
//! * `mappings`, `locations`, `stacks`, `label_sets` (+ `labels`): the
//!   dictionaries. Each row is content-addressed by a 128-bit xxh3 `hash`
//!   (UNIQUE) of its content, so an identical item sent by any agent, in any
//!   batch, before or after a restart, is stored once, and the in-memory
//!   caches and the database share one key. Locations keep their lines inline
//!   in a compact blob rather than in a separate string table: dictionaries
//!   grow with the fleet's code, not with time, so the saving would be small
//!   next to the samples, and a self-contained row resolves in one lookup
//!   and needs no string garbage collection. Stacks keep their location ids
//!   as a varint blob, leaf first. Ids are `AUTOINCREMENT`, so an id is never
//!   reused after a delete and the query side may cache by id.
//! * `samples(bucket_start, label_set_id, stack_id, weight)`: sums
//!   per time bucket, `WITHOUT ROWID` with that primary key so a bucket is
//!   one contiguous range (cheap upserts within a batch, cheap range scans
//!   and prefix deletes).
//! * `label_set_buckets(bucket_start, label_set_id, sample_period_nanos,
//!   weight)`: one row per label set and bucket with samples: the sample
//!   period they agree on (0 when batches disagree) and their total weight.
//!   It is small next to `samples`, answers `series`, `label_names` and
//!   `label_values` without touching samples, and tells a label-filtered
//!   `stacks` query exactly which (bucket, label set) prefixes of `samples`
//!   to read.
//! * Every dictionary row carries `last_bucket`, the newest bucket of a batch
//!   that contained it. Buckets are only ever deleted oldest first, so once
//!   every bucket up to `b` is gone, rows with `last_bucket <= b` are
//!   referenced by nothing: retention finds orphans without scanning (or
//!   indexing) billions of sample rows; `last_bucket` is indexed so that
//!   costs what it deletes.
//! * `rollups`, `rollup_spans`, `pending_spans`: label-free sums of closed
//!   spans of 1 bucket, 10 min, 1 h and 1 day, which fleet-wide queries read
//!   instead of `samples` (see [`rollup`]).
//!
//! Matchers are evaluated in Rust over an in-memory copy of the label sets
//! (they are few; regexes and absent labels do not map onto an index), so
//! `labels` needs no `(name, value)` index that would only slow ingest.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    hash::{BuildHasherDefault, Hasher},
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, SystemTime},
};

use rusqlite::{
    CachedStatement, Connection, OptionalExtension as _, Statement, Transaction,
    TransactionBehavior,
};
use stackscope_profile::model::{
    CodeAddress, Frame, PeriodAgreement, Selection, StackSamples, WeightedStack, unix_nanos,
};

use stackscope_telemetry::StateSize;

use super::{IngestOutcome, Storage, StorageError};
use crate::ingest::{CodeSegment, LineRecord, MappingKind, MappingRecord, ValidBatch};
use rollup::Tiers;

mod rollup;

/// The schema this code reads and writes. Bump it (and migrate) on any
/// change; an older collector refuses a newer database instead of
/// misreading it.
const SCHEMA_VERSION: i32 = 4;

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
-- per item and bucket, so keeping the indexes up costs little.
CREATE INDEX mappings_last_bucket ON mappings (last_bucket);
CREATE INDEX locations_last_bucket ON locations (last_bucket);
CREATE INDEX stacks_last_bucket ON stacks (last_bucket);
CREATE INDEX label_sets_last_bucket ON label_sets (last_bucket);

CREATE TABLE samples (
    bucket_start INTEGER NOT NULL,
    label_set_id INTEGER NOT NULL,
    stack_id INTEGER NOT NULL,
    weight INTEGER NOT NULL,
    PRIMARY KEY (bucket_start, label_set_id, stack_id)
) STRICT, WITHOUT ROWID;

CREATE TABLE label_set_buckets (
    bucket_start INTEGER NOT NULL,
    label_set_id INTEGER NOT NULL,
    sample_period_nanos INTEGER NOT NULL,
    weight INTEGER NOT NULL,
    PRIMARY KEY (bucket_start, label_set_id)
) STRICT, WITHOUT ROWID;
";

/// Spans one `compact` call rolls up at most, so a backlog (a database
/// upgraded with days of history) is worked off in bounded calls the
/// collector can stop between.
pub const COMPACTION_SPANS_PER_CALL: u64 = 64;

/// Sample rows one upsert statement carries: one statement per row spends
/// a good part of ingest in statement overhead rather than in the B-tree.
const SAMPLES_PER_STATEMENT: usize = 64;

/// An upsert of `rows` sample rows, 4 parameters each: bucket, label set,
/// stack, weight.
fn upsert_samples_sql(rows: usize) -> String {
    let values = vec!["(?, ?, ?, ?)"; rows].join(", ");
    // Sums saturate at i64::MAX: SQLite would turn an overflowing integer
    // sum into a float, which would then fail to read back as an integer.
    format!(
        "INSERT INTO samples (bucket_start, label_set_id, stack_id, weight) VALUES {values}
         ON CONFLICT (bucket_start, label_set_id, stack_id) DO UPDATE SET
             weight = CASE WHEN weight > 9223372036854775807 - excluded.weight
                 THEN 9223372036854775807 ELSE weight + excluded.weight END"
    )
}

const UPSERT_LABEL_SET_BUCKET: &str = "
INSERT INTO label_set_buckets (bucket_start, label_set_id, sample_period_nanos, weight)
VALUES (?1, ?2, ?3, ?4)
ON CONFLICT (bucket_start, label_set_id) DO UPDATE SET
    sample_period_nanos = CASE WHEN sample_period_nanos = excluded.sample_period_nanos
        THEN sample_period_nanos ELSE 0 END,
    weight = CASE WHEN weight > 9223372036854775807 - excluded.weight
        THEN 9223372036854775807 ELSE weight + excluded.weight END";

/// The statements of one dictionary table. A stored item's `last_bucket`
/// moves forward by id (`bump`, when the caches know the id) or by hash
/// (`touch`, which gives the id); only an item `touch` does not find is
/// inserted. An upsert (`INSERT .. ON CONFLICT DO UPDATE`) would do both in
/// one statement, but one that hits a stored row still uses up an
/// AUTOINCREMENT id (SQLite draws it before the uniqueness check), so the
/// ids of a long-lived database would climb with every cache miss.
struct DictionarySql {
    bump: &'static str,
    touch: &'static str,
    insert: &'static str,
}

/// [`DictionarySql`] of `table`, whose new rows take `columns` (the first
/// `hash`, one `?` parameter each, in order).
macro_rules! dictionary_sql {
    ($table:literal, $columns:literal, $parameters:literal) => {
        DictionarySql {
            bump: concat!(
                "UPDATE ",
                $table,
                " SET last_bucket = max(last_bucket, ?2) WHERE id = ?1"
            ),
            touch: concat!(
                "UPDATE ",
                $table,
                " SET last_bucket = max(last_bucket, ?2) WHERE hash = ?1 RETURNING id"
            ),
            insert: concat!(
                "INSERT INTO ",
                $table,
                " (",
                $columns,
                ") VALUES (",
                $parameters,
                ") RETURNING id"
            ),
        }
    };
}

const MAPPINGS: DictionarySql = dictionary_sql!(
    "mappings",
    "hash, kind, build_id, path, last_bucket, code_segments",
    "?1, ?2, ?3, ?4, ?5, ?6"
);
const LOCATIONS: DictionarySql = dictionary_sql!(
    "locations",
    "hash, mapping_id, address, lines, last_bucket",
    "?1, ?2, ?3, ?4, ?5"
);
const STACKS: DictionarySql =
    dictionary_sql!("stacks", "hash, locations, last_bucket", "?1, ?2, ?3");
const LABEL_SETS: DictionarySql = dictionary_sql!("label_sets", "hash, last_bucket", "?1, ?2");

/// How the SQLite engine stores and caches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SqliteOptions {
    /// Samples are summed per bucket of this many nanoseconds (aligned to
    /// multiples of it): the finest time resolution queries get. Fixed when
    /// the database is created.
    pub bucket_nanos: i64,
    /// Entries each ingest dictionary cache (mappings, locations, stacks,
    /// label sets) holds before it is cleared. A hit saves the SQL lookup
    /// of an item a previous batch already stored.
    pub cache_entries: usize,
    /// Locations, and stacks, whose resolved frames the query side keeps.
    pub frame_cache_entries: usize,
    /// How long a statement waits for a lock another connection holds.
    pub busy_timeout: Duration,
    /// SQLite page cache per connection, in KiB.
    pub page_cache_kib: u32,
}

impl Default for SqliteOptions {
    fn default() -> Self {
        Self {
            bucket_nanos: 60_000_000_000,
            cache_entries: 1 << 20,
            frame_cache_entries: 1 << 18,
            busy_timeout: Duration::from_secs(10),
            page_cache_kib: 64 << 10,
        }
    }
}

/// Hit and miss counts of the ingest dictionary caches, summed over
/// mappings, locations, stacks and label sets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
    /// Entries held now.
    pub entries: usize,
}

/// Storage in one SQLite database file.
///
/// One connection writes (ingest, retention) and another reads (queries),
/// each behind its own mutex: in WAL mode readers see the last commit and
/// neither blocks the other.
pub struct SqliteStorage {
    path: PathBuf,
    bucket_nanos: i64,
    tiers: Tiers,
    writer: Mutex<Writer>,
    reader: Mutex<Reader>,
    /// Bumped after retention deleted dictionary rows, so the reader drops
    /// its caches of them.
    generation: AtomicU64,
    /// SQLite's page cache bound, per connection.
    page_cache_bytes: usize,
}

impl std::fmt::Debug for SqliteStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStorage")
            .field("path", &self.path)
            .field("bucket_nanos", &self.bucket_nanos)
            .finish_non_exhaustive()
    }
}

impl SqliteStorage {
    /// Opens (creating if needed) the database at `path` and its directory.
    pub fn open(path: &Path, options: SqliteOptions) -> Result<Self, StorageError> {
        if options.bucket_nanos <= 0 {
            return Err(StorageError::InvalidOptions(format!(
                "bucket_nanos must be positive, got {}",
                options.bucket_nanos
            )));
        }
        if let Some(dir) = path.parent().filter(|dir| !dir.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|source| StorageError::CreateDir {
                path: dir.to_owned(),
                source,
            })?;
        }
        let open_error = |source| StorageError::Open {
            path: path.to_owned(),
            source,
        };

        let mut conn = Connection::open(path).map_err(open_error)?;
        configure(&conn, &options).map_err(open_error)?;
        let mode: String = conn
            .query_row("PRAGMA journal_mode = WAL", [], |row| row.get(0))
            .map_err(open_error)?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(StorageError::Incompatible {
                path: path.to_owned(),
                reason: format!("it cannot use a write-ahead log (journal mode stays {mode:?})"),
            });
        }
        let tiers = Tiers::new(options.bucket_nanos);
        init_schema(&mut conn, path, options.bucket_nanos, &tiers)?;

        let reader = Connection::open(path).map_err(open_error)?;
        configure(&reader, &options).map_err(open_error)?;
        // The query side never writes; make that a guarantee.
        reader
            .pragma_update(None, "query_only", true)
            .map_err(open_error)?;

        Ok(Self {
            path: path.to_owned(),
            bucket_nanos: options.bucket_nanos,
            tiers,
            writer: Mutex::new(Writer::new(conn, options.cache_entries)),
            reader: Mutex::new(Reader::new(reader, options.frame_cache_entries)),
            generation: AtomicU64::new(0),
            page_cache_bytes: options.page_cache_kib as usize * 1024,
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// How well the ingest dictionary caches are doing.
    pub fn cache_stats(&self) -> CacheStats {
        let writer = self.writer();
        [
            &writer.mappings,
            &writer.locations,
            &writer.stacks,
            &writer.label_sets,
        ]
        .iter()
        .fold(CacheStats::default(), |sum, dict| CacheStats {
            hits: sum.hits + dict.hits,
            misses: sum.misses + dict.misses,
            entries: sum.entries + dict.entries.len(),
        })
    }

    /// The start of the bucket holding `unix_nanos`.
    fn bucket_of(&self, unix_nanos: i64) -> i64 {
        // Saturates only for times near i64::MIN, which validation rejects.
        unix_nanos.saturating_sub(unix_nanos.rem_euclid(self.bucket_nanos))
    }

    fn writer(&self) -> MutexGuard<'_, Writer> {
        // A panic while the lock was held rolled its transaction back (the
        // Transaction's drop) but may have left a cache half updated: start
        // the caches afresh, the database is the truth.
        self.writer.lock().unwrap_or_else(|poisoned| {
            let mut writer = poisoned.into_inner();
            writer.forget_through(i64::MAX);
            writer
        })
    }

    fn reader(&self) -> MutexGuard<'_, Reader> {
        let mut reader = self.reader.lock().unwrap_or_else(|poisoned| {
            let mut reader = poisoned.into_inner();
            reader.clear_caches();
            reader
        });
        let generation = self.generation.load(Ordering::Acquire);
        if reader.generation != generation {
            reader.clear_caches();
            reader.generation = generation;
        }
        reader
    }

    /// Buckets `(lo, hi)` (both exclusive) that overlap the selection's
    /// range, or `None` when the range is empty.
    fn bucket_bounds(&self, selection: &Selection) -> Option<(i64, i64)> {
        let range = selection.range;
        (range.start_unix_nanos < range.end_unix_nanos).then(|| {
            // Bucket b covers [b, b + width): it overlaps [start, end) iff
            // b < end and b > start - width.
            (
                range.start_unix_nanos.saturating_sub(self.bucket_nanos),
                range.end_unix_nanos,
            )
        })
    }

    /// Runs `query` in one read transaction (one consistent snapshot) with
    /// the label sets brought up to date.
    fn read<T>(
        &self,
        query: impl FnOnce(&mut ReadCaches, &Transaction<'_>) -> Result<T, StorageError>,
    ) -> Result<T, StorageError> {
        let mut reader = self.reader();
        let Reader { conn, caches, .. } = &mut *reader;
        let tx = conn.transaction()?;
        caches.label_sets.refresh(&tx)?;
        let result = query(caches, &tx)?;
        tx.finish()?;
        Ok(result)
    }

    /// Calls `each(bucket_start, label_set_id, sample_period_nanos, weight)`
    /// for every label set with samples in a bucket overlapping the range
    /// that the selection's matchers select.
    fn for_each_label_set_bucket(
        &self,
        tx: &Transaction<'_>,
        selection: &Selection,
        selected: &Selected,
        each: impl FnMut(i64, i64, i64, u64) -> Result<(), StorageError>,
    ) -> Result<(), StorageError> {
        let Some(bounds) = self.bucket_bounds(selection) else {
            return Ok(());
        };
        label_set_buckets_in(tx, bounds, selected, each)
    }

    /// Label sets with samples in the selection.
    fn selected_label_sets(
        &self,
        caches: &ReadCaches,
        tx: &Transaction<'_>,
        selection: &Selection,
    ) -> Result<BTreeSet<i64>, StorageError> {
        let selected = caches.label_sets.select(selection);
        let mut ids = BTreeSet::new();
        self.for_each_label_set_bucket(tx, selection, &selected, |_, label_set, _, _| {
            ids.insert(label_set);
            Ok(())
        })?;
        Ok(ids)
    }
}

impl Storage for SqliteStorage {
    fn ingest(&self, batch: &ValidBatch) -> Result<IngestOutcome, StorageError> {
        let bucket = self.bucket_of(batch.range.start_unix_nanos);
        self.writer().ingest(batch, bucket, &self.tiers)
    }

    fn stacks(&self, selection: &Selection) -> Result<StackSamples, StorageError> {
        self.read(|caches, tx| {
            let selected = caches.label_sets.select(selection);
            let mut period = PeriodAgreement::default();
            let mut weights = StackWeights::default();
            let mut add = |stack: i64, weight: i64| -> Result<(), StorageError> {
                weights.add(stack, non_negative(weight, "sample weight")?);
                Ok(())
            };
            match &selected {
                Selected::All => {
                    // Every label set counts: whole spans from their
                    // rollups, the buckets between them in one sequential
                    // pass each over their rows (which beats a seek per
                    // label set).
                    let cover = match self.bucket_bounds(selection) {
                        Some((lo, hi)) => rollup::cover(tx, &self.tiers, lo, hi)?,
                        None => rollup::Cover::default(),
                    };
                    let mut spans = tx.prepare_cached(
                        "SELECT stack_id, weight FROM rollups
                         WHERE width = ?1 AND span_start = ?2",
                    )?;
                    for span in &cover.spans {
                        period.add(u64::try_from(span.sample_period_nanos).unwrap_or(0));
                        let mut rows = spans.query((span.width, span.start))?;
                        while let Some(row) = rows.next()? {
                            add(row.get(0)?, row.get(1)?)?;
                        }
                    }
                    let mut samples = tx.prepare_cached(
                        "SELECT stack_id, weight FROM samples
                         WHERE bucket_start > ?1 AND bucket_start < ?2",
                    )?;
                    for &gap in &cover.gaps {
                        label_set_buckets_in(tx, gap, &selected, |_, _, p, _| {
                            period.add(u64::try_from(p).unwrap_or(0));
                            Ok(())
                        })?;
                        let mut rows = samples.query(gap)?;
                        while let Some(row) = rows.next()? {
                            add(row.get(0)?, row.get(1)?)?;
                        }
                    }
                }
                Selected::Some(ids) if ids.is_empty() => {}
                Selected::Some(_) => {
                    // Read exactly the (bucket, label set) prefixes of the
                    // samples key that hold selected samples.
                    let mut samples = tx.prepare_cached(
                        "SELECT stack_id, weight FROM samples
                         WHERE bucket_start = ?1 AND label_set_id = ?2",
                    )?;
                    self.for_each_label_set_bucket(
                        tx,
                        selection,
                        &selected,
                        |bucket, label_set, p, _| {
                            period.add(u64::try_from(p).unwrap_or(0));
                            let mut rows = samples.query((bucket, label_set))?;
                            while let Some(row) = rows.next()? {
                                add(row.get(0)?, row.get(1)?)?;
                            }
                            Ok(())
                        },
                    )?;
                }
            }

            let ids = weights.into_sorted();
            let mut stacks = Vec::with_capacity(ids.len());
            for (stack, weight) in ids {
                stacks.push(WeightedStack {
                    frames: caches.stack_frames(tx, stack)?,
                    weight,
                });
            }
            Ok(StackSamples {
                stacks,
                sample_period_nanos: period.result(),
            })
        })
    }

    fn label_names(&self, selection: &Selection) -> Result<Vec<String>, StorageError> {
        self.read(|caches, tx| {
            let ids = self.selected_label_sets(caches, tx, selection)?;
            let mut names = BTreeSet::new();
            for id in ids {
                for (name, _) in caches.label_sets.get(id)? {
                    names.insert(name.as_str());
                }
            }
            Ok(names.into_iter().map(str::to_owned).collect())
        })
    }

    fn label_values(&self, selection: &Selection, name: &str) -> Result<Vec<String>, StorageError> {
        self.read(|caches, tx| {
            let ids = self.selected_label_sets(caches, tx, selection)?;
            let mut values = BTreeSet::new();
            for id in ids {
                let labels = caches.label_sets.get(id)?;
                if let Ok(i) = labels.binary_search_by(|(n, _)| n.as_str().cmp(name)) {
                    values.insert(labels[i].1.as_str());
                }
            }
            Ok(values.into_iter().map(str::to_owned).collect())
        })
    }

    /// Points are aligned to multiples of `step_nanos`; a storage bucket
    /// overlapping the range counts whole. `step_nanos <= 0` means one point
    /// per storage bucket.
    fn series(
        &self,
        selection: &Selection,
        step_nanos: i64,
    ) -> Result<Vec<(i64, u64)>, StorageError> {
        self.read(|caches, tx| {
            let selected = caches.label_sets.select(selection);
            let mut points: BTreeMap<i64, u64> = BTreeMap::new();
            self.for_each_label_set_bucket(tx, selection, &selected, |bucket, _, _, weight| {
                let point = super::series_point(bucket, step_nanos, self.bucket_nanos);
                let sum = points.entry(point).or_default();
                *sum = add_capped(*sum, weight);
                Ok(())
            })?;
            Ok(points.into_iter().filter(|(_, w)| *w > 0).collect())
        })
    }

    fn delete_before(&self, cutoff_unix_nanos: i64) -> Result<u64, StorageError> {
        // Buckets starting at or before `last` end at or before the cutoff.
        let last = cutoff_unix_nanos.saturating_sub(self.bucket_nanos);
        let mut deleted = 0u64;
        // One bucket per transaction so ingest waits for one bucket's
        // delete at a time, not for the whole backlog.
        loop {
            let mut writer = self.writer();
            let tx = writer
                .conn
                .transaction_with_behavior(TransactionBehavior::Immediate)?;
            let oldest: Option<i64> =
                tx.query_row("SELECT min(bucket_start) FROM samples", [], |row| {
                    row.get(0)
                })?;
            let Some(bucket) = oldest.filter(|b| *b <= last) else {
                break;
            };
            let rows = tx.execute("DELETE FROM samples WHERE bucket_start = ?1", [bucket])?;
            tx.execute(
                "DELETE FROM label_set_buckets WHERE bucket_start = ?1",
                [bucket],
            )?;
            // No query may use a span summing the deleted bucket.
            rollup::forget_through(&tx, &self.tiers, bucket)?;
            tx.commit()?;
            deleted = deleted.saturating_add(rows as u64);
        }

        let mut writer = self.writer();
        let tx = writer
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)?;
        // Again in this transaction: a late batch may have added to an old
        // bucket since, and the orphan deletes below rely on every bucket up
        // to `last` being gone.
        let rows = tx.execute("DELETE FROM samples WHERE bucket_start <= ?1", [last])?;
        deleted = deleted.saturating_add(rows as u64);
        tx.execute(
            "DELETE FROM label_set_buckets WHERE bucket_start <= ?1",
            [last],
        )?;
        rollup::forget_through(&tx, &self.tiers, last)?;
        tx.execute(
            "DELETE FROM labels WHERE label_set_id IN
                (SELECT id FROM label_sets WHERE last_bucket <= ?1)",
            [last],
        )?;
        let mut orphans = 0;
        for table in ["label_sets", "stacks", "locations", "mappings"] {
            orphans += tx.execute(
                &format!("DELETE FROM {table} WHERE last_bucket <= ?1"),
                [last],
            )?;
        }
        // A batch id is kept while a retry may still come (received after
        // the cutoff) or its samples may still be stored.
        tx.execute(
            "DELETE FROM batches WHERE received_unix_nanos < ?1 AND end_unix_nanos <= ?1",
            [cutoff_unix_nanos],
        )?;
        tx.commit()?;
        if orphans > 0 {
            // Cached ids may name deleted rows now: those whose cached
            // last_bucket is at most `last`. A cached last_bucket is never
            // newer than the stored one, so every entry kept names a row
            // that retention kept. Clearing instead would send a whole
            // working set through SQL (and id allocation) every pass.
            writer.forget_through(last);
            self.generation.fetch_add(1, Ordering::Release);
        }
        Ok(deleted)
    }

    /// Rolls up at most [`COMPACTION_SPANS_PER_CALL`] pending spans that
    /// ended at or before `closed_before`, one span per write transaction so
    /// ingest waits for one span at a time.
    fn compact(&self, closed_before_unix_nanos: i64) -> Result<u64, StorageError> {
        let mut spans = 0u64;
        while spans < COMPACTION_SPANS_PER_CALL {
            {
                let mut writer = self.writer();
                let tx = writer
                    .conn
                    .transaction_with_behavior(TransactionBehavior::Immediate)?;
                let Some((width, start)) =
                    rollup::next_pending(&tx, &self.tiers, closed_before_unix_nanos)?
                else {
                    break;
                };
                rollup::recompute(&tx, &self.tiers, width, start)?;
                tx.commit()?;
            }
            spans += 1;
            // The mutex is not fair: let a waiting ingest take it first.
            std::thread::yield_now();
        }
        Ok(spans)
    }

    fn state_sizes(&self, out: &mut Vec<StateSize>) {
        // SAFETY: sqlite3_memory_used reads SQLite's own counter of the
        // heap it holds (every connection's page cache, statements, schema).
        let sqlite_heap = unsafe { rusqlite::ffi::sqlite3_memory_used() };
        out.push(StateSize::bytes(
            "sqlite_memory",
            sqlite_heap.max(0) as usize,
            None,
        ));
        // A scrape must not wait behind an ingest or a query.
        if let Ok(writer) = self.writer.try_lock() {
            out.push(page_cache(
                "writer_page_cache",
                &writer.conn,
                self.page_cache_bytes,
            ));
            for (name, dictionary) in [
                ("ingest_mappings", &writer.mappings),
                ("ingest_locations", &writer.locations),
                ("ingest_stacks", &writer.stacks),
                ("ingest_label_sets", &writer.label_sets),
            ] {
                out.push(StateSize::entries(
                    name,
                    dictionary.entries.len(),
                    Some(dictionary.capacity),
                ));
            }
        }
        if let Ok(reader) = self.reader.try_lock() {
            out.push(page_cache(
                "reader_page_cache",
                &reader.conn,
                self.page_cache_bytes,
            ));
            let caches = &reader.caches;
            let capacity = Some(caches.frame_capacity);
            out.push(StateSize::entries(
                "query_frames",
                caches.frames.len(),
                capacity,
            ));
            out.push(StateSize::entries(
                "query_stacks",
                caches.stacks.len(),
                capacity,
            ));
            // Every stored label set: bounded by what retention keeps.
            out.push(StateSize::entries(
                "query_label_sets",
                caches.label_sets.sets.len(),
                None,
            ));
        }
    }

    /// The database file with its write-ahead log and shared-memory index.
    fn disk_bytes(&self) -> Option<u64> {
        let size = |suffix: &str| {
            let mut path = self.path.clone().into_os_string();
            path.push(suffix);
            std::fs::metadata(path).map_or(0, |meta| meta.len())
        };
        Some(size("") + size("-wal") + size("-shm"))
    }
}

/// The bytes of SQLite's page cache `conn` uses, against its bound.
fn page_cache(name: &'static str, conn: &Connection, max_bytes: usize) -> StateSize {
    let (mut used, mut highwater) = (0, 0);
    // SAFETY: the handle is the open connection's, used by the thread that
    // holds its mutex; sqlite3_db_status only reads the connection's
    // counters into the two integers.
    let status = unsafe {
        rusqlite::ffi::sqlite3_db_status(
            conn.handle(),
            rusqlite::ffi::SQLITE_DBSTATUS_CACHE_USED,
            &mut used,
            &mut highwater,
            0,
        )
    };
    let used = if status == rusqlite::ffi::SQLITE_OK {
        used.max(0) as usize
    } else {
        0
    };
    StateSize::bytes(name, used, Some(max_bytes))
}

/// Calls `each(bucket_start, label_set_id, sample_period_nanos, weight)`
/// for every label set in `selected` with samples in a bucket `b` with
/// `lo < b < hi`.
fn label_set_buckets_in(
    tx: &Transaction<'_>,
    (lo, hi): (i64, i64),
    selected: &Selected,
    mut each: impl FnMut(i64, i64, i64, u64) -> Result<(), StorageError>,
) -> Result<(), StorageError> {
    let mut stmt = tx.prepare_cached(
        "SELECT bucket_start, label_set_id, sample_period_nanos, weight
         FROM label_set_buckets WHERE bucket_start > ?1 AND bucket_start < ?2",
    )?;
    let mut rows = stmt.query((lo, hi))?;
    while let Some(row) = rows.next()? {
        let (bucket, label_set, period, weight): (i64, i64, i64, i64) =
            (row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?);
        if selected.contains(label_set) {
            each(
                bucket,
                label_set,
                period,
                non_negative(weight, "label set weight")?,
            )?;
        }
    }
    Ok(())
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
        for &width in tiers.widths() {
            tx.execute(
                "INSERT OR IGNORE INTO pending_spans (width, span_start)
                 SELECT DISTINCT ?1, bucket_start - (bucket_start % ?1 + ?1) % ?1
                 FROM label_set_buckets",
                [width],
            )?;
        }
        tx.pragma_update(None, "user_version", SCHEMA_VERSION)?;
        version = SCHEMA_VERSION;
    }
    match version {
        0 => {
            tx.execute_batch(SCHEMA)?;
            tx.execute_batch(rollup::SCHEMA)?;
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

/// A sum as stored: saturated at `i64::MAX`.
fn saturate(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// Adds weights the way every answer sums them: capped at `i64::MAX`, as
/// stored rows are. Capped addition of non-negative numbers is associative,
/// so a sum is `min(exact total, i64::MAX)` however rows were grouped on the
/// way (per bucket, per rollup span, per engine).
fn add_capped(sum: u64, weight: u64) -> u64 {
    sum.saturating_add(weight).min(i64::MAX as u64)
}

/// A weight read back from the database, which only ever stores
/// non-negative ones.
fn non_negative(value: i64, what: &str) -> Result<u64, StorageError> {
    u64::try_from(value).map_err(|_| StorageError::Corrupt(format!("negative {what} {value}")))
}

// ---------------------------------------------------------------------------
// Ingest side

/// What the ingest caches know about a stored dictionary item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    id: i64,
    /// The item's `last_bucket` as of the commit that cached it.
    last_bucket: i64,
}

/// Content hashes are uniformly distributed already: use their bits as the
/// hash map's hash instead of hashing them again.
#[derive(Default)]
struct ContentHashHasher(u64);

impl Hasher for ContentHashHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only reached for keys other than u128; fold them in FNV-1a style
        // so the hasher stays correct for any key.
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }

    fn write_u128(&mut self, value: u128) {
        self.0 = (value as u64) ^ ((value >> 64) as u64);
    }
}

type ContentHashMap<V> = HashMap<u128, V, BuildHasherDefault<ContentHashHasher>>;

/// A bounded cache of content hash -> stored item, cleared when full.
struct Dictionary {
    entries: ContentHashMap<Entry>,
    capacity: usize,
    hits: u64,
    misses: u64,
}

impl Dictionary {
    fn new(capacity: usize) -> Self {
        Self {
            entries: ContentHashMap::default(),
            capacity,
            hits: 0,
            misses: 0,
        }
    }

    fn get(&mut self, hash: u128) -> Option<Entry> {
        let entry = self.entries.get(&hash).copied();
        if entry.is_some() {
            self.hits += 1;
        } else {
            self.misses += 1;
        }
        entry
    }

    /// Adds entries of a committed transaction.
    fn publish(&mut self, pending: &mut ContentHashMap<Entry>) {
        for (hash, entry) in pending.drain() {
            if self.entries.len() >= self.capacity && !self.entries.contains_key(&hash) {
                // Clearing beats LRU bookkeeping on every hit: the working
                // set refills within a few batches.
                self.entries.clear();
            }
            if self.capacity > 0 {
                self.entries.insert(hash, entry);
            }
        }
    }
}

/// Reused per batch so steady-state ingest allocates little.
#[derive(Default)]
struct Scratch {
    bytes: Vec<u8>,
    blob: Vec<u8>,
    mapping_hashes: Vec<u128>,
    mapping_ids: Vec<i64>,
    location_hashes: Vec<u128>,
    location_ids: Vec<i64>,
    /// Location ids of the stack being interned.
    stack: Vec<i64>,
    stack_ids: Vec<i64>,
    label_set_ids: Vec<i64>,
    /// (label set id, stack id, weight)
    samples: Vec<(i64, i64, u64)>,
    /// Items first stored or moved to a newer bucket by the open
    /// transaction: published to the caches only after it commits, so a
    /// rollback cannot leave ids in the caches that the database lacks.
    /// One map each for mappings, locations, stacks and label sets.
    pending: [ContentHashMap<Entry>; 4],
}

struct Writer {
    conn: Connection,
    /// `upsert_samples_sql` for a full chunk and for a single row.
    upsert_samples: String,
    upsert_sample: String,
    mappings: Dictionary,
    locations: Dictionary,
    stacks: Dictionary,
    label_sets: Dictionary,
    scratch: Scratch,
}

/// What the caches know about a dictionary item.
enum Known {
    /// Stored, with a `last_bucket` at or after the batch's bucket.
    Current(i64),
    /// Stored, but its `last_bucket` has to move forward to the batch's.
    Stale(i64),
    /// Not cached: stored before (by a batch before a restart, say) or not.
    Unknown,
}

/// Interns one kind of dictionary item in the open transaction.
struct Table<'a, 'conn> {
    dict: &'a mut Dictionary,
    pending: &'a mut ContentHashMap<Entry>,
    /// The statements of [`DictionarySql`].
    bump: CachedStatement<'conn>,
    touch: CachedStatement<'conn>,
    insert: CachedStatement<'conn>,
    bucket: i64,
}

impl<'a, 'conn> Table<'a, 'conn> {
    fn new(
        tx: &'conn Transaction<'_>,
        sql: &DictionarySql,
        dict: &'a mut Dictionary,
        pending: &'a mut ContentHashMap<Entry>,
        bucket: i64,
    ) -> rusqlite::Result<Self> {
        Ok(Self {
            dict,
            pending,
            bump: tx.prepare_cached(sql.bump)?,
            touch: tx.prepare_cached(sql.touch)?,
            insert: tx.prepare_cached(sql.insert)?,
            bucket,
        })
    }

    fn lookup(&mut self, hash: u128) -> Known {
        if let Some(entry) = self.pending.get(&hash) {
            return Known::Current(entry.id);
        }
        match self.dict.get(hash) {
            Some(entry) if entry.last_bucket >= self.bucket => Known::Current(entry.id),
            Some(entry) => Known::Stale(entry.id),
            None => Known::Unknown,
        }
    }

    /// The id of a looked-up item, after moving its `last_bucket` forward
    /// or storing it (`store` runs the insert with the item's columns) as
    /// needed.
    fn finish(
        &mut self,
        hash: u128,
        known: Known,
        store: impl FnOnce(&mut Statement<'_>) -> rusqlite::Result<i64>,
    ) -> Result<i64, StorageError> {
        let id = match known {
            Known::Current(id) => return Ok(id),
            Known::Stale(id) if self.bump.execute((id, self.bucket))? == 1 => id,
            // Unknown, or stale and gone (which retention pruning the
            // caches rules out): found by its hash if stored, else stored,
            // rather than reference a missing row.
            Known::Stale(_) | Known::Unknown => {
                let found = self
                    .touch
                    .query_row((&hash.to_le_bytes()[..], self.bucket), |row| row.get(0))
                    .optional()?;
                match found {
                    Some(id) => id,
                    None => store(&mut self.insert)?,
                }
            }
        };
        self.pending.insert(
            hash,
            Entry {
                id,
                last_bucket: self.bucket,
            },
        );
        Ok(id)
    }

    fn intern(
        &mut self,
        hash: u128,
        store: impl FnOnce(&mut Statement<'_>) -> rusqlite::Result<i64>,
    ) -> Result<i64, StorageError> {
        let known = self.lookup(hash);
        self.finish(hash, known, store)
    }
}

/// The batch's mappings and locations: content hashes of all of them, and
/// ids of those interned so far (0: not yet; ids start at 1).
struct BatchItems<'s> {
    mapping_hashes: &'s [u128],
    mapping_ids: &'s mut [i64],
    location_hashes: &'s [u128],
    location_ids: &'s mut [i64],
    blob: &'s mut Vec<u8>,
}

impl BatchItems<'_> {
    /// The id of the batch's location `index`, interned (with its mapping)
    /// at the batch's bucket.
    fn location(
        &mut self,
        batch: &ValidBatch,
        index: u32,
        locations: &mut Table<'_, '_>,
        mappings: &mut Table<'_, '_>,
    ) -> Result<i64, StorageError> {
        let out_of_range = || invalid(format!("location {index} out of range"));
        let i = usize::try_from(index).map_err(|_| out_of_range())?;
        let (Some(location), Some(&hash), Some(&known_id)) = (
            batch.locations.get(i),
            self.location_hashes.get(i),
            self.location_ids.get(i),
        ) else {
            return Err(out_of_range());
        };
        if known_id != 0 {
            return Ok(known_id);
        }
        // One bucket for the whole batch: both tables carry it.
        let bucket = locations.bucket;
        let mapping_out_of_range = || {
            invalid(format!(
                "location {index}: mapping {} out of range",
                location.mapping
            ))
        };
        let m = usize::try_from(location.mapping).map_err(|_| mapping_out_of_range())?;
        let (Some(mapping), Some(&mapping_hash), Some(mapping_id)) = (
            batch.mappings.get(m),
            self.mapping_hashes.get(m),
            self.mapping_ids.get_mut(m),
        ) else {
            return Err(mapping_out_of_range());
        };
        if *mapping_id == 0 {
            let mut segments = Vec::new();
            encode_code_segments(&mut segments, &mapping.code_segments);
            *mapping_id = mappings.intern(mapping_hash, |insert| {
                insert.query_row(
                    (
                        &mapping_hash.to_le_bytes()[..],
                        kind_code(mapping.kind),
                        &mapping.build_id,
                        &mapping.path,
                        bucket,
                        &segments,
                    ),
                    |row| row.get(0),
                )
            })?;
        }
        let mapping_id = *mapping_id;
        let blob = &mut *self.blob;
        let id = locations.intern(hash, |insert| {
            blob.clear();
            encode_lines(blob, &location.lines);
            insert.query_row(
                (
                    &hash.to_le_bytes()[..],
                    mapping_id,
                    // Same bits: addresses use the full u64 range.
                    location.address as i64,
                    &blob[..],
                    bucket,
                ),
                |row| row.get(0),
            )
        })?;
        if let Some(slot) = self.location_ids.get_mut(i) {
            *slot = id;
        }
        Ok(id)
    }
}

fn invalid(message: String) -> StorageError {
    StorageError::InvalidBatch(message)
}

/// `items[index]`, or an error naming what referenced it.
fn item<T>(items: &[T], index: u32, what: impl FnOnce() -> String) -> Result<&T, StorageError> {
    usize::try_from(index)
        .ok()
        .and_then(|i| items.get(i))
        .ok_or_else(|| invalid(format!("{} out of range ({} items)", what(), items.len())))
}

impl Writer {
    fn new(conn: Connection, cache_entries: usize) -> Self {
        Self {
            conn,
            upsert_samples: upsert_samples_sql(SAMPLES_PER_STATEMENT),
            upsert_sample: upsert_samples_sql(1),
            mappings: Dictionary::new(cache_entries),
            locations: Dictionary::new(cache_entries),
            stacks: Dictionary::new(cache_entries),
            label_sets: Dictionary::new(cache_entries),
            scratch: Scratch::default(),
        }
    }

    /// Drops the cached items whose `last_bucket` is at most `last`.
    fn forget_through(&mut self, last: i64) {
        for dict in [
            &mut self.mappings,
            &mut self.locations,
            &mut self.stacks,
            &mut self.label_sets,
        ] {
            dict.entries.retain(|_, entry| entry.last_bucket > last);
        }
        for pending in &mut self.scratch.pending {
            pending.clear();
        }
    }

    fn ingest(
        &mut self,
        batch: &ValidBatch,
        bucket: i64,
        tiers: &Tiers,
    ) -> Result<IngestOutcome, StorageError> {
        for pending in &mut self.scratch.pending {
            pending.clear();
        }
        let Writer {
            conn,
            upsert_samples,
            upsert_sample,
            mappings,
            locations,
            stacks,
            label_sets,
            scratch,
        } = self;
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let duplicate = tx
            .prepare_cached("SELECT 1 FROM batches WHERE id = ?1")?
            .exists([&batch.batch_id[..]])?;
        if duplicate {
            // Dropping the transaction rolls back; nothing was written.
            return Ok(IngestOutcome::Duplicate);
        }
        let Scratch {
            bytes,
            blob,
            mapping_hashes,
            mapping_ids,
            location_hashes,
            location_ids,
            stack: stack_locations,
            stack_ids,
            label_set_ids,
            samples,
            pending,
        } = scratch;
        let [
            pending_mappings,
            pending_locations,
            pending_stacks,
            pending_label_sets,
        ] = pending;

        // Content hashes of every mapping and location: stack hashes are
        // made of them, and they cost no database work.
        mapping_hashes.clear();
        for mapping in &batch.mappings {
            mapping_hashes.push(mapping_hash(bytes, mapping));
        }
        location_hashes.clear();
        for (index, location) in batch.locations.iter().enumerate() {
            let mapping_hash = *item(mapping_hashes, location.mapping, || {
                format!("location {index}: mapping {}", location.mapping)
            })?;
            location_hashes.push(location_hash(
                bytes,
                mapping_hash,
                location.address,
                &location.lines,
            ));
        }
        mapping_ids.clear();
        mapping_ids.resize(batch.mappings.len(), 0);
        location_ids.clear();
        location_ids.resize(batch.locations.len(), 0);

        {
            let mut mapping_table = Table::new(&tx, &MAPPINGS, mappings, pending_mappings, bucket)?;
            let mut location_table =
                Table::new(&tx, &LOCATIONS, locations, pending_locations, bucket)?;
            let mut stack_table = Table::new(&tx, &STACKS, stacks, pending_stacks, bucket)?;
            let mut items = BatchItems {
                mapping_hashes,
                mapping_ids,
                location_hashes,
                location_ids,
                blob,
            };
            stack_ids.clear();
            for (index, stack) in batch.stacks.iter().enumerate() {
                bytes.clear();
                bytes.push(b's');
                for &location in stack {
                    let hash = item(items.location_hashes, location, || {
                        format!("stack {index}: location {location}")
                    })?;
                    bytes.extend_from_slice(&hash.to_le_bytes());
                }
                let hash = xxhash_rust::xxh3::xxh3_128(bytes);
                let id = match stack_table.lookup(hash) {
                    // The common case once a fleet's stacks are known: no
                    // location of the stack needs looking at.
                    Known::Current(id) => id,
                    known => {
                        // A stack stored or moved to this bucket takes its
                        // locations (and their mappings) along: retention
                        // relies on those being at least as recent as the
                        // stacks that use them.
                        stack_locations.clear();
                        for &location in stack {
                            stack_locations.push(items.location(
                                batch,
                                location,
                                &mut location_table,
                                &mut mapping_table,
                            )?);
                        }
                        let blob = &mut *items.blob;
                        stack_table.finish(hash, known, |insert| {
                            blob.clear();
                            for &id in stack_locations.iter() {
                                put_varint(blob, id as u64);
                            }
                            insert.query_row((&hash.to_le_bytes()[..], &blob[..], bucket), |row| {
                                row.get(0)
                            })
                        })?
                    }
                };
                stack_ids.push(id);
            }

            let mut label_set_table =
                Table::new(&tx, &LABEL_SETS, label_sets, pending_label_sets, bucket)?;
            let mut insert_label = tx.prepare_cached(
                "INSERT OR IGNORE INTO labels (label_set_id, name, value) VALUES (?1, ?2, ?3)",
            )?;
            label_set_ids.clear();
            for labels in &batch.label_sets {
                let hash = label_set_hash(bytes, labels);
                let id = label_set_table.intern(hash, |insert| {
                    let id: i64 =
                        insert.query_row((&hash.to_le_bytes()[..], bucket), |row| row.get(0))?;
                    // A new set: a stored one is found by its hash first
                    // (retention deletes a set's labels with it).
                    for (name, value) in labels {
                        insert_label.execute((id, name, value))?;
                    }
                    Ok(id)
                })?;
                label_set_ids.push(id);
            }
        }

        // Samples, sorted by key: the upserts then walk the bucket's B-tree
        // in order, and duplicates within the batch merge here.
        samples.clear();
        for (index, sample) in batch.samples.iter().enumerate() {
            let stack = *item(stack_ids, sample.stack, || {
                format!("sample {index}: stack {}", sample.stack)
            })?;
            let label_set = *item(label_set_ids, sample.label_set, || {
                format!("sample {index}: label set {}", sample.label_set)
            })?;
            if sample.weight == 0 || i64::try_from(sample.weight).is_err() {
                return Err(invalid(format!(
                    "sample {index}: weight {} is not in 1..=i64::MAX",
                    sample.weight
                )));
            }
            samples.push((label_set, stack, sample.weight));
        }
        samples.sort_unstable();
        samples.dedup_by(|next, kept| {
            let same = (next.0, next.1) == (kept.0, kept.1);
            if same {
                kept.2 = kept.2.saturating_add(next.2);
            }
            same
        });
        // 0 stands for "unknown"; validation keeps real periods in range.
        let period = i64::try_from(batch.sample_period_nanos).unwrap_or(0);
        {
            let mut upsert_many = tx.prepare_cached(upsert_samples)?;
            let mut upsert_one = tx.prepare_cached(upsert_sample)?;
            for chunk in samples.chunks(SAMPLES_PER_STATEMENT) {
                if chunk.len() == SAMPLES_PER_STATEMENT {
                    let mut param = 0;
                    for &(label_set, stack, weight) in chunk {
                        for value in [bucket, label_set, stack, saturate(weight)] {
                            param += 1;
                            upsert_many.raw_bind_parameter(param, value)?;
                        }
                    }
                    upsert_many.raw_execute()?;
                } else {
                    for &(label_set, stack, weight) in chunk {
                        upsert_one.execute((bucket, label_set, stack, saturate(weight)))?;
                    }
                }
            }

            let mut upsert_label_set_bucket = tx.prepare_cached(UPSERT_LABEL_SET_BUCKET)?;
            let mut current: Option<(i64, u64)> = None;
            for &(label_set, _, weight) in samples.iter() {
                current = match current {
                    Some((id, sum)) if id == label_set => Some((id, sum.saturating_add(weight))),
                    Some((id, sum)) => {
                        upsert_label_set_bucket.execute((bucket, id, period, saturate(sum)))?;
                        Some((label_set, weight))
                    }
                    None => Some((label_set, weight)),
                };
            }
            if let Some((id, sum)) = current {
                upsert_label_set_bucket.execute((bucket, id, period, saturate(sum)))?;
            }
            tx.prepare_cached(
                "INSERT INTO batches (id, received_unix_nanos, end_unix_nanos) VALUES (?1, ?2, ?3)",
            )?
            .execute((
                &batch.batch_id[..],
                unix_nanos(SystemTime::now()),
                batch.range.end_unix_nanos,
            ))?;
        }
        rollup::invalidate(&tx, tiers, bucket)?;
        tx.commit()?;

        mappings.publish(pending_mappings);
        locations.publish(pending_locations);
        stacks.publish(pending_stacks);
        label_sets.publish(pending_label_sets);
        Ok(IngestOutcome::Stored {
            samples: batch.samples.len() as u64,
        })
    }
}

pub(super) fn kind_code(kind: MappingKind) -> i64 {
    // The wire format's numbers, so the column reads the same as the proto.
    match kind {
        MappingKind::User => 1,
        MappingKind::Kernel => 2,
        MappingKind::Vdso => 3,
        MappingKind::Anonymous => 4,
    }
}

pub(super) fn kind_from_code(code: i64) -> Option<MappingKind> {
    match code {
        1 => Some(MappingKind::User),
        2 => Some(MappingKind::Kernel),
        3 => Some(MappingKind::Vdso),
        4 => Some(MappingKind::Anonymous),
        _ => None,
    }
}

// Content hashes: a tag byte per kind of item, then every field, strings
// length-prefixed so no two different items serialize alike. Shared with the
// ClickHouse engine (`pub(super)`), so both name an item by the same hash and
// encode lines and code segments alike.

fn put_str(bytes: &mut Vec<u8>, s: &str) {
    bytes.extend_from_slice(&(s.len() as u64).to_le_bytes());
    bytes.extend_from_slice(s.as_bytes());
}

pub(super) fn mapping_hash(bytes: &mut Vec<u8>, mapping: &MappingRecord) -> u128 {
    bytes.clear();
    bytes.push(b'm');
    bytes.push(kind_code(mapping.kind) as u8);
    put_str(bytes, &mapping.build_id);
    put_str(bytes, &mapping.path);
    // Nothing for no segments: mappings stored before segments were sent
    // keep their hashes.
    for segment in &mapping.code_segments {
        for value in [segment.file_offset, segment.vaddr, segment.file_size] {
            bytes.extend_from_slice(&value.to_le_bytes());
        }
    }
    xxhash_rust::xxh3::xxh3_128(bytes)
}

pub(super) fn location_hash(
    bytes: &mut Vec<u8>,
    mapping: u128,
    address: u64,
    lines: &[LineRecord],
) -> u128 {
    bytes.clear();
    bytes.push(b'l');
    bytes.extend_from_slice(&mapping.to_le_bytes());
    bytes.extend_from_slice(&address.to_le_bytes());
    for line in lines {
        put_str(bytes, &line.function);
        put_str(bytes, &line.file);
        bytes.extend_from_slice(&line.line.to_le_bytes());
    }
    xxhash_rust::xxh3::xxh3_128(bytes)
}

pub(super) fn label_set_hash(bytes: &mut Vec<u8>, labels: &[(String, String)]) -> u128 {
    bytes.clear();
    bytes.push(b'L');
    for (name, value) in labels {
        put_str(bytes, name);
        put_str(bytes, value);
    }
    xxhash_rust::xxh3::xxh3_128(bytes)
}

// Blobs: LEB128 varints and length-prefixed UTF-8.

pub(super) fn put_varint(buf: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        buf.push((value as u8) | 0x80);
        value >>= 7;
    }
    buf.push(value as u8);
}

pub(super) fn encode_lines(buf: &mut Vec<u8>, lines: &[LineRecord]) {
    for line in lines {
        put_varint(buf, line.function.len() as u64);
        buf.extend_from_slice(line.function.as_bytes());
        put_varint(buf, line.file.len() as u64);
        buf.extend_from_slice(line.file.as_bytes());
        put_varint(buf, u64::from(line.line));
    }
}

pub(super) fn encode_code_segments(buf: &mut Vec<u8>, segments: &[CodeSegment]) {
    for segment in segments {
        for value in [segment.file_offset, segment.vaddr, segment.file_size] {
            put_varint(buf, value);
        }
    }
}

pub(super) fn decode_code_segments(blob: &[u8]) -> Result<Vec<CodeSegment>, &'static str> {
    let mut reader = BlobReader { bytes: blob };
    let mut segments = Vec::new();
    while !reader.is_empty() {
        segments.push(CodeSegment {
            file_offset: reader.varint()?,
            vaddr: reader.varint()?,
            file_size: reader.varint()?,
        });
    }
    Ok(segments)
}

/// Reads a blob written by `put_varint` and friends; errors say what is
/// wrong with it, never panic.
pub(super) struct BlobReader<'a> {
    pub(super) bytes: &'a [u8],
}

impl<'a> BlobReader<'a> {
    pub(super) fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    pub(super) fn varint(&mut self) -> Result<u64, &'static str> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let (&byte, rest) = self.bytes.split_first().ok_or("truncated varint")?;
            self.bytes = rest;
            let part = u64::from(byte & 0x7f);
            if shift == 63 && part > 1 {
                return Err("varint overflows 64 bits");
            }
            value |= part << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err("varint longer than 10 bytes")
    }

    pub(super) fn str(&mut self) -> Result<&'a str, &'static str> {
        let len = usize::try_from(self.varint()?).map_err(|_| "string length overflows")?;
        let (s, rest) = self
            .bytes
            .split_at_checked(len)
            .ok_or("string runs past the end")?;
        self.bytes = rest;
        std::str::from_utf8(s).map_err(|_| "string is not UTF-8")
    }
}

pub(super) fn decode_lines(blob: &[u8]) -> Result<Vec<LineRecord>, &'static str> {
    let mut reader = BlobReader { bytes: blob };
    let mut lines = Vec::new();
    while !reader.is_empty() {
        let function = reader.str()?.to_owned();
        let file = reader.str()?.to_owned();
        let line = u32::try_from(reader.varint()?).map_err(|_| "line number overflows u32")?;
        lines.push(LineRecord {
            function,
            file,
            line,
        });
    }
    Ok(lines)
}

fn decode_ids(blob: &[u8]) -> Result<Vec<i64>, &'static str> {
    let mut reader = BlobReader { bytes: blob };
    let mut ids = Vec::new();
    while !reader.is_empty() {
        let id = i64::try_from(reader.varint()?).map_err(|_| "id overflows i64")?;
        ids.push(id);
    }
    if ids.is_empty() {
        return Err("no locations");
    }
    Ok(ids)
}

// ---------------------------------------------------------------------------
// Query side

struct Reader {
    conn: Connection,
    /// The `SqliteStorage::generation` the caches belong to.
    generation: u64,
    caches: ReadCaches,
}

impl Reader {
    fn new(conn: Connection, frame_cache_entries: usize) -> Self {
        Self {
            conn,
            generation: 0,
            caches: ReadCaches {
                label_sets: LabelSets::default(),
                frames: HashMap::new(),
                stacks: HashMap::new(),
                frame_capacity: frame_cache_entries,
            },
        }
    }

    fn clear_caches(&mut self) {
        self.caches.label_sets = LabelSets::default();
        self.caches.frames.clear();
        self.caches.stacks.clear();
    }
}

struct ReadCaches {
    label_sets: LabelSets,
    /// Frames per location id. Ids are never reused, so an entry stays
    /// right as long as the location exists.
    frames: HashMap<i64, Arc<[Arc<Frame>]>>,
    /// Frames per stack id (same reasoning): a fleet-wide query resolves
    /// tens of thousands of stacks, each a lookup of its blob otherwise.
    stacks: HashMap<i64, Arc<[Arc<Frame>]>>,
    /// Entries each of `frames` and `stacks` holds before it is cleared.
    frame_capacity: usize,
}

/// Which label sets a selection covers.
enum Selected {
    /// No matchers: every label set, including ones not loaded yet.
    All,
    Some(HashSet<i64>),
}

impl Selected {
    fn contains(&self, id: i64) -> bool {
        match self {
            Selected::All => true,
            Selected::Some(ids) => ids.contains(&id),
        }
    }
}

/// Every stored label set, loaded incrementally: ids only grow, so each
/// query reads just the sets created since the last one.
#[derive(Default)]
struct LabelSets {
    max_id: i64,
    /// Labels sorted by name.
    sets: HashMap<i64, Box<[(String, String)]>>,
}

impl LabelSets {
    fn refresh(&mut self, tx: &Transaction<'_>) -> Result<(), StorageError> {
        // LEFT JOIN: a set without labels still exists (and matches
        // matchers that accept an absent label).
        let mut stmt = tx.prepare_cached(
            "SELECT s.id, l.name, l.value FROM label_sets s
             LEFT JOIN labels l ON l.label_set_id = s.id
             WHERE s.id > ?1 ORDER BY s.id, l.name",
        )?;
        let mut rows = stmt.query([self.max_id])?;
        let mut current: Option<(i64, Vec<(String, String)>)> = None;
        while let Some(row) = rows.next()? {
            let id: i64 = row.get(0)?;
            let label: Option<(String, String)> = match (row.get(1)?, row.get(2)?) {
                (Some(name), Some(value)) => Some((name, value)),
                _ => None,
            };
            match &mut current {
                Some((current_id, labels)) if *current_id == id => labels.extend(label),
                _ => {
                    if let Some((done, labels)) = current.take() {
                        self.sets.insert(done, labels.into_boxed_slice());
                    }
                    current = Some((id, label.into_iter().collect()));
                }
            }
            self.max_id = self.max_id.max(id);
        }
        if let Some((done, labels)) = current {
            self.sets.insert(done, labels.into_boxed_slice());
        }
        Ok(())
    }

    fn select(&self, selection: &Selection) -> Selected {
        if selection.matchers.is_empty() {
            return Selected::All;
        }
        Selected::Some(
            self.sets
                .iter()
                .filter(|(_, labels)| {
                    selection.matches_labels(labels.iter().map(|(n, v)| (n.as_str(), v.as_str())))
                })
                .map(|(id, _)| *id)
                .collect(),
        )
    }

    fn get(&self, id: i64) -> Result<&[(String, String)], StorageError> {
        self.sets.get(&id).map(|labels| &labels[..]).ok_or_else(|| {
            StorageError::Corrupt(format!(
                "samples reference label set {id}, which does not exist"
            ))
        })
    }
}

impl ReadCaches {
    /// The frames of a stored stack, leaf first.
    fn stack_frames(
        &mut self,
        tx: &Transaction<'_>,
        stack: i64,
    ) -> Result<Vec<Arc<Frame>>, StorageError> {
        if let Some(frames) = self.stacks.get(&stack) {
            return Ok(frames.to_vec());
        }
        let blob: Vec<u8> = tx
            .prepare_cached("SELECT locations FROM stacks WHERE id = ?1")?
            .query_row([stack], |row| row.get(0))
            .optional()?
            .ok_or_else(|| {
                StorageError::Corrupt(format!(
                    "samples reference stack {stack}, which does not exist"
                ))
            })?;
        let locations = decode_ids(&blob).map_err(|err| {
            StorageError::Corrupt(format!("stack {stack}: locations blob: {err}"))
        })?;
        let mut frames = Vec::with_capacity(locations.len());
        for location in locations {
            frames.extend(self.location_frames(tx, stack, location)?.iter().cloned());
        }
        if self.stacks.len() >= self.frame_capacity {
            self.stacks.clear();
        }
        if self.frame_capacity > 0 {
            self.stacks.insert(stack, frames.as_slice().into());
        }
        Ok(frames)
    }

    fn location_frames(
        &mut self,
        tx: &Transaction<'_>,
        stack: i64,
        location: i64,
    ) -> Result<Arc<[Arc<Frame>]>, StorageError> {
        if let Some(frames) = self.frames.get(&location) {
            return Ok(Arc::clone(frames));
        }
        let corrupt = |what: String| StorageError::Corrupt(format!("location {location}: {what}"));
        type Row = (i64, Vec<u8>, i64, String, String, Vec<u8>);
        let row: Option<Row> = tx
            .prepare_cached(
                "SELECT l.address, l.lines, m.kind, m.build_id, m.path, m.code_segments
                 FROM locations l JOIN mappings m ON m.id = l.mapping_id WHERE l.id = ?1",
            )?
            .query_row([location], |row| {
                Ok((
                    row.get(0)?,
                    row.get(1)?,
                    row.get(2)?,
                    row.get(3)?,
                    row.get(4)?,
                    row.get(5)?,
                ))
            })
            .optional()?;
        let Some((address, lines, kind, build_id, path, segments)) = row else {
            return Err(corrupt(format!(
                "referenced by stack {stack}, but it or its mapping does not exist"
            )));
        };
        let kind =
            kind_from_code(kind).ok_or_else(|| corrupt(format!("unknown mapping kind {kind}")))?;
        let lines = decode_lines(&lines).map_err(|err| corrupt(format!("lines blob: {err}")))?;
        let segments = decode_code_segments(&segments)
            .map_err(|err| corrupt(format!("code segments blob: {err}")))?;
        let mapping = MappingRecord {
            kind,
            build_id,
            path,
            code_segments: segments,
        };
        let frames: Arc<[Arc<Frame>]> = resolve_frames(&mapping, address as u64, lines).into();
        if self.frames.len() >= self.frame_capacity {
            self.frames.clear();
        }
        if self.frame_capacity > 0 {
            self.frames.insert(location, Arc::clone(&frames));
        }
        Ok(frames)
    }
}

/// The name people know a mapping by in a frame.
fn binary_name(kind: MappingKind, path: &str) -> String {
    match kind {
        MappingKind::Kernel => "[kernel]".into(),
        MappingKind::Vdso => "[vdso]".into(),
        MappingKind::User | MappingKind::Anonymous => {
            match path.rsplit('/').find(|part| !part.is_empty()) {
                Some(name) => name.into(),
                None if kind == MappingKind::Anonymous => "[anonymous]".into(),
                None => "[unknown]".into(),
            }
        }
    }
}

/// One frame per line, innermost first (all but the outermost inlined), or
/// one unnamed frame when the location has no lines (with where its code
/// is, for a file with a build-id, so debuginfo can name it later).
pub(super) fn resolve_frames(
    mapping: &MappingRecord,
    address: u64,
    lines: Vec<LineRecord>,
) -> Vec<Arc<Frame>> {
    let (kind, build_id) = (mapping.kind, mapping.build_id.as_str());
    let binary = binary_name(kind, &mapping.path);
    if lines.is_empty() {
        let unnamed_code =
            (kind == MappingKind::User && !build_id.is_empty()).then(|| CodeAddress {
                file_offset: address,
                vaddr: CodeSegment::vaddr_of(&mapping.code_segments, address),
            });
        return vec![Arc::new(Frame {
            build_id: build_id.to_owned(),
            unnamed_code,
            ..Frame::synthetic(Frame::unknown_function(&binary, address), binary)
        })];
    }
    let count = lines.len();
    lines
        .into_iter()
        .enumerate()
        .map(|(i, line)| {
            Arc::new(Frame {
                function: if line.function.is_empty() {
                    Frame::unknown_function(&binary, address)
                } else {
                    line.function
                },
                binary: binary.clone(),
                build_id: build_id.to_owned(),
                file: line.file,
                line: line.line,
                inlined: i + 1 < count,
                unnamed_code: None,
            })
        })
        .collect()
}

/// Summed weight per stack id. Ids are small and dense (they count up from
/// 1), so a vector indexed by id does the summing; ids past
/// `DENSE_STACK_IDS` (a database with much churn behind it) go to a map.
#[derive(Default)]
struct StackWeights {
    dense: Vec<u64>,
    sparse: HashMap<i64, u64>,
}

/// 4M ids: 32 MiB of weights at most.
const DENSE_STACK_IDS: usize = 1 << 22;

impl StackWeights {
    fn add(&mut self, stack: i64, weight: u64) {
        let sum = match usize::try_from(stack) {
            Ok(i) if i < DENSE_STACK_IDS => {
                if i >= self.dense.len() {
                    self.dense.resize(i + 1, 0);
                }
                match self.dense.get_mut(i) {
                    Some(sum) => sum,
                    None => return,
                }
            }
            _ => self.sparse.entry(stack).or_default(),
        };
        *sum = add_capped(*sum, weight);
    }

    /// (stack id, weight) of the stacks with weight, ascending by id. A
    /// stored weight is never 0, so 0 means "no samples".
    fn into_sorted(self) -> Vec<(i64, u64)> {
        let mut sorted: Vec<(i64, u64)> = self
            .dense
            .into_iter()
            .enumerate()
            .filter(|&(_, weight)| weight > 0)
            .map(|(id, weight)| (id as i64, weight))
            .collect();
        if !self.sparse.is_empty() {
            sorted.extend(self.sparse);
            sorted.sort_unstable();
        }
        sorted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_round_trip() {
        let mut buf = Vec::new();
        let values = [0, 1, 127, 128, 300, u64::from(u32::MAX), u64::MAX];
        for v in values {
            put_varint(&mut buf, v);
        }
        let mut reader = BlobReader { bytes: &buf };
        for v in values {
            assert_eq!(reader.varint(), Ok(v));
        }
        assert!(reader.is_empty());
    }

    #[test]
    fn corrupt_blobs_are_errors() {
        assert_eq!(
            BlobReader { bytes: &[0x80] }.varint(),
            Err("truncated varint")
        );
        assert_eq!(
            BlobReader { bytes: &[0xff; 10] }.varint(),
            Err("varint overflows 64 bits")
        );
        assert_eq!(
            BlobReader { bytes: &[0x80; 11] }.varint(),
            Err("varint longer than 10 bytes")
        );
        assert_eq!(decode_lines(&[5, b'a']), Err("string runs past the end"));
        assert_eq!(decode_lines(&[1, 0xff, 0, 0]), Err("string is not UTF-8"));
        assert_eq!(decode_ids(&[]), Err("no locations"));
        // u64::MAX does not fit an id.
        let mut buf = Vec::new();
        put_varint(&mut buf, u64::MAX);
        assert_eq!(decode_ids(&buf), Err("id overflows i64"));
    }

    #[test]
    fn lines_round_trip() {
        let lines = vec![
            LineRecord {
                function: "inlined".into(),
                file: "a.h".into(),
                line: 3,
            },
            LineRecord {
                function: String::new(),
                file: String::new(),
                line: u32::MAX,
            },
        ];
        let mut buf = Vec::new();
        encode_lines(&mut buf, &lines);
        assert_eq!(decode_lines(&buf), Ok(lines));
    }

    #[test]
    fn binary_names() {
        assert_eq!(
            binary_name(MappingKind::User, "/usr/lib/libfoo.so"),
            "libfoo.so"
        );
        assert_eq!(binary_name(MappingKind::User, "/opt/app/"), "app");
        assert_eq!(binary_name(MappingKind::User, ""), "[unknown]");
        assert_eq!(binary_name(MappingKind::Anonymous, ""), "[anonymous]");
        assert_eq!(binary_name(MappingKind::Kernel, "vmlinux"), "[kernel]");
        assert_eq!(binary_name(MappingKind::Vdso, "[vdso]"), "[vdso]");
    }

    #[test]
    fn hashes_separate_fields() {
        let mut bytes = Vec::new();
        let a = label_set_hash(&mut bytes, &[("ab".into(), "c".into())]);
        let b = label_set_hash(&mut bytes, &[("a".into(), "bc".into())]);
        assert_ne!(a, b);
    }

    #[test]
    fn stack_weights_sum_dense_and_sparse_ids() {
        let mut weights = StackWeights::default();
        let far = DENSE_STACK_IDS as i64 + 5;
        for (id, weight) in [(3, 1), (far, 2), (1, 4), (3, 8), (far, 16), (-1, 32)] {
            weights.add(id, weight);
        }
        // Capped at i64::MAX, as stored sums are.
        weights.add(7, i64::MAX as u64 - 1);
        weights.add(7, 2);
        weights.add(7, 3);
        assert_eq!(
            weights.into_sorted(),
            [(-1, 32), (1, 4), (3, 9), (7, i64::MAX as u64), (far, 18)]
        );
    }

    /// Hot ingest types stay small: the caches hold millions of them.
    #[test]
    fn entry_size() {
        assert_eq!(std::mem::size_of::<Entry>(), 16);
    }

    #[test]
    fn dictionary_is_bounded() {
        let mut dict = Dictionary::new(2);
        let mut pending = ContentHashMap::default();
        for hash in 0..3u128 {
            pending.insert(
                hash,
                Entry {
                    id: hash as i64,
                    last_bucket: 0,
                },
            );
            dict.publish(&mut pending);
        }
        assert_eq!(dict.entries.len(), 1);
        assert_eq!(dict.get(2).map(|e| e.id), Some(2));
        assert_eq!(dict.get(0), None);
        assert_eq!((dict.hits, dict.misses), (1, 1));
    }
}
