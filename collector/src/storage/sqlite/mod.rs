//! The default storage engine: one embedded SQLite database file, in WAL
//! mode with `synchronous=FULL`, so an acknowledged batch survives a crash
//! or power loss. Owns the schema, the interning of batches' dictionaries
//! (mappings, locations, stacks, label sets) into content-addressed tables,
//! the per-bucket sums of samples, and the queries over them. Does not own
//! validation (`ingest`) or symbolization; the content hashes and blob
//! encodings it shares with the ClickHouse engine are `storage`'s (`hash`,
//! `codec`).
//!
//! This module ties the parts together: [`schema`] (tables, migrations,
//! opening connections), [`write`] (the one writer: ingest, retention,
//! compaction), [`group`] (batches that arrive together share a
//! transaction), [`read`] (a pool of query connections and their caches),
//! [`rollup`] (the sums fleet-wide queries read) and [`sums`] (the blob of
//! (stack, weight) sums every bucket and span keeps per label set).

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{Mutex, atomic::AtomicU64},
    time::Duration,
};

use rusqlite::Connection;
use stackscope_profile::model::{ProfileType, Selection, StackSamples};
use stackscope_telemetry::StateSize;

use super::{IngestOutcome, Storage, StorageError};
use crate::ingest::ValidBatch;
use crate::storage::tiers::Tiers;

mod group;
mod read;
mod rollup;
mod schema;
mod sums;
mod write;

pub use write::COMPACTION_SPANS_PER_CALL;

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
    /// Locations, and stacks, whose resolved frames the query side keeps
    /// (one cache every query connection shares).
    pub frame_cache_entries: usize,
    /// Queries answered at once, each on a connection of its own (opened
    /// as queries need them); one more waits for a connection to be free.
    /// At least 1. Each connection has a page cache of its own.
    pub readers: usize,
    /// How long a statement waits for a lock another connection holds.
    pub busy_timeout: Duration,
    /// SQLite page cache per connection (the writer and each reader), in
    /// KiB.
    pub page_cache_kib: u32,
    /// Batches stored at the same time that share one transaction at most
    /// (see `group`); 1 commits each alone.
    pub max_group_batches: usize,
    /// Dictionary rows (mappings, locations, stacks, label sets) are kept
    /// through the last bucket of the epoch of this many nanoseconds
    /// (rounded up to whole buckets, aligned to multiples of it) in which a
    /// batch last used them, not just through that batch's bucket: an item
    /// used all the time is written once an epoch instead of once a bucket,
    /// for rows that outlive their last use by less than an epoch. The
    /// bucket width (or less) keeps them through their last bucket only.
    pub dictionary_epoch_nanos: i64,
}

impl Default for SqliteOptions {
    fn default() -> Self {
        Self {
            bucket_nanos: 60_000_000_000,
            cache_entries: 1 << 20,
            frame_cache_entries: 1 << 18,
            readers: 4,
            busy_timeout: Duration::from_secs(10),
            page_cache_kib: 64 << 10,
            max_group_batches: group::MAX_GROUP_BATCHES,
            dictionary_epoch_nanos: 3_600_000_000_000,
        }
    }
}

/// Hit and miss counts of the ingest dictionary caches, summed over
/// mappings, locations, stacks and label sets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
    /// Of the misses: items inserted first (see the writer's
    /// `Dictionary::insert_first`) that the table held already, then found
    /// by their hash.
    pub insert_conflicts: u64,
    /// Entries held now.
    pub entries: usize,
}

/// Ingest's commits (see [`SqliteStorage::commit_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommitStats {
    pub commits: u64,
    /// Batches those commits stored.
    pub batches: u64,
}

/// Storage in one SQLite database file.
///
/// One connection writes (ingest, retention, compaction), behind a mutex;
/// queries run on a pool of read-only connections, one each. In WAL mode
/// every reader sees the last commit as of its query's start, and neither
/// side blocks the other.
pub struct SqliteStorage {
    path: PathBuf,
    bucket_nanos: i64,
    /// [`SqliteOptions::dictionary_epoch_nanos`], in whole buckets.
    dictionary_epoch_nanos: i64,
    tiers: Tiers,
    writer: Mutex<write::Writer>,
    /// What batches stored together share (see [`group`]).
    groups: group::Groups,
    readers: read::Readers,
    /// Bumped after retention deleted dictionary rows, so the query side
    /// drops its caches of them.
    generation: AtomicU64,
    /// SQLite's page cache bound, per connection.
    page_cache_bytes: usize,
    max_group_batches: usize,
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
        if options.dictionary_epoch_nanos <= 0 {
            return Err(StorageError::InvalidOptions(format!(
                "dictionary_epoch_nanos must be positive, got {}",
                options.dictionary_epoch_nanos
            )));
        }
        if options.readers == 0 {
            return Err(StorageError::InvalidOptions(
                "readers must be at least 1".into(),
            ));
        }
        if let Some(dir) = path.parent().filter(|dir| !dir.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|source| StorageError::CreateDir {
                path: dir.to_owned(),
                source,
            })?;
        }
        let tiers = Tiers::new(options.bucket_nanos);
        let writer = schema::open_writer(path, &options, &tiers)?;
        let reader = schema::open_reader(path, &options)?;
        Ok(Self {
            path: path.to_owned(),
            bucket_nanos: options.bucket_nanos,
            dictionary_epoch_nanos: whole_buckets(
                options.dictionary_epoch_nanos,
                options.bucket_nanos,
            ),
            tiers,
            writer: Mutex::new(write::Writer::new(writer, options.cache_entries)),
            groups: group::Groups::default(),
            page_cache_bytes: options.page_cache_kib as usize * 1024,
            max_group_batches: options.max_group_batches.max(1),
            readers: read::Readers::new(path.to_owned(), options, reader),
            generation: AtomicU64::new(0),
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// How well the ingest dictionary caches are doing.
    pub fn cache_stats(&self) -> CacheStats {
        self.lock_writer().cache_stats()
    }

    /// Write transactions that stored batches, and the batches they stored
    /// (more than one each when batches arrived together).
    pub fn commit_stats(&self) -> CommitStats {
        self.lock_writer().commit_stats()
    }
}

/// `nanos` (positive) rounded up to whole buckets.
fn whole_buckets(nanos: i64, bucket_nanos: i64) -> i64 {
    let buckets = nanos / bucket_nanos + i64::from(nanos % bucket_nanos != 0);
    buckets.saturating_mul(bucket_nanos)
}

impl Storage for SqliteStorage {
    fn bucket_nanos(&self) -> i64 {
        self.bucket_nanos
    }

    fn ingest(&self, batch: &ValidBatch) -> Result<IngestOutcome, StorageError> {
        self.store_batch(batch)
    }

    fn stacks(&self, selection: &Selection) -> Result<StackSamples, StorageError> {
        self.query_stacks(selection, false)
    }

    fn stacks_in_units(&self, selection: &Selection) -> Result<StackSamples, StorageError> {
        self.query_stacks(selection, true)
    }

    fn label_names(&self, selection: &Selection) -> Result<Vec<String>, StorageError> {
        self.query_label_names(selection)
    }

    fn label_values(&self, selection: &Selection, name: &str) -> Result<Vec<String>, StorageError> {
        self.query_label_values(selection, name)
    }

    fn profile_types(&self, selection: &Selection) -> Result<Vec<ProfileType>, StorageError> {
        self.query_profile_types(selection)
    }

    /// Points are aligned to multiples of `step_nanos`; a storage bucket
    /// overlapping the range counts whole. `step_nanos <= 0` means one point
    /// per storage bucket.
    fn series(
        &self,
        selection: &Selection,
        step_nanos: i64,
    ) -> Result<Vec<(i64, u64)>, StorageError> {
        self.query_series(selection, step_nanos, false)
    }

    fn series_in_units(
        &self,
        selection: &Selection,
        step_nanos: i64,
    ) -> Result<Vec<(i64, u64)>, StorageError> {
        self.query_series(selection, step_nanos, true)
    }

    fn delete_before(&self, cutoff_unix_nanos: i64) -> Result<u64, StorageError> {
        self.delete_buckets_before(cutoff_unix_nanos)
    }

    /// Rolls up at most [`COMPACTION_SPANS_PER_CALL`] pending spans that
    /// ended at or before `closed_before`, one span per write transaction so
    /// ingest waits for one span at a time.
    fn compact(&self, closed_before_unix_nanos: i64) -> Result<u64, StorageError> {
        self.roll_up(closed_before_unix_nanos)
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
            writer.state_sizes(out, self.page_cache_bytes);
        }
        self.readers.state_sizes(out, self.page_cache_bytes);
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

/// The bytes of SQLite's page cache `conn` uses.
fn page_cache_used(conn: &Connection) -> usize {
    let (mut used, mut highwater) = (0, 0);
    // SAFETY: the handle is the open connection's, which the caller has to
    // itself (it holds the writer's mutex, or the reader pool's with the
    // connection idle in it); sqlite3_db_status only reads the connection's
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
    if status == rusqlite::ffi::SQLITE_OK {
        used.max(0) as usize
    } else {
        0
    }
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
}
