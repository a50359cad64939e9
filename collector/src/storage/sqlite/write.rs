//! The SQLite engine's write side: the one writer connection and what it
//! does. Ingest interns a batch's dictionaries (mappings, locations, stacks,
//! label sets) by content hash through bounded caches and sums its samples
//! into their bucket, in one transaction; retention deletes old buckets and
//! the dictionary rows only they referenced; compaction brings the rollups
//! up to date (the sums themselves are `rollup`'s). Batches that arrive
//! together share one transaction ([`group`](super::group)). Owns no schema
//! (`schema`) and no queries (`read`).

use std::{
    collections::HashMap,
    hash::{BuildHasherDefault, Hasher},
    sync::{MutexGuard, atomic::Ordering},
    time::SystemTime,
};

use crate::storage::tiers::Tiers;
use rusqlite::{
    CachedStatement, Connection, OptionalExtension as _, Statement, Transaction,
    TransactionBehavior,
};
use stackscope_profile::model::unix_nanos;
use stackscope_telemetry::StateSize;

use super::{
    CacheStats, CommitStats, IngestOutcome, SqliteStorage, StorageError, group::OpenGroup,
    page_cache_used, rollup, saturate, sums,
};
use crate::{
    ingest::ValidBatch,
    storage::{
        codec::{encode_code_segments, encode_lines, kind_code, put_varint},
        hash::{label_set_hash, location_hash, mapping_hash, stack_hash},
    },
};

/// Spans one `compact` call rolls up at most, so a backlog (a database
/// upgraded with days of history) is worked off in bounded calls the
/// collector can stop between.
pub const COMPACTION_SPANS_PER_CALL: u64 = 64;

// Sums saturate at i64::MAX: SQLite would turn an overflowing integer sum
// into a float, which would then fail to read back as an integer.
const UPSERT_LABEL_SET_BUCKET: &str = "
INSERT INTO label_set_buckets (bucket_start, label_set_id, sample_period_nanos, weight)
VALUES (?1, ?2, ?3, ?4)
ON CONFLICT (bucket_start, label_set_id) DO UPDATE SET
    sample_period_nanos = CASE WHEN sample_period_nanos = excluded.sample_period_nanos
        THEN sample_period_nanos ELSE 0 END,
    weight = CASE WHEN weight > 9223372036854775807 - excluded.weight
        THEN 9223372036854775807 ELSE weight + excluded.weight END";

/// The statements of one dictionary table. A stored item's `last_bucket`
/// moves forward by id (`bump`); an item the caches do not know is looked
/// up by hash (`find`) and inserted only when not found, or, while most
/// such items are new, inserted and looked up only when its hash turns out
/// taken (see `Dictionary::insert_first`). An upsert
/// (`INSERT .. ON CONFLICT DO UPDATE`) would do both in one statement, but
/// one that hits a stored row still uses up an AUTOINCREMENT id (SQLite
/// draws it before the uniqueness check), so the ids of a long-lived
/// database would climb with every cache miss. No statement has a
/// `RETURNING` clause: SQLite gathers its rows in a temporary B-tree opened
/// and closed at every run, which was about half of what storing a batch
/// of new stacks cost (the new row's id is the connection's last rowid
/// instead).
struct DictionarySql {
    bump: &'static str,
    find: &'static str,
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
            find: concat!("SELECT id, last_bucket FROM ", $table, " WHERE hash = ?1"),
            insert: concat!(
                "INSERT INTO ",
                $table,
                " (",
                $columns,
                ") VALUES (",
                $parameters,
                ")"
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

impl SqliteStorage {
    /// [`super::Storage::ingest`]: the batch goes to the bucket its range
    /// starts in.
    pub(super) fn store_batch(&self, batch: &ValidBatch) -> Result<IngestOutcome, StorageError> {
        let buckets = self.buckets_of(batch.range.start_unix_nanos);
        let joining = self.groups.join();
        let mut writer = self.lock_writer();
        drop(joining);
        let group = writer.join_group()?;
        let stored = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            writer.ingest(batch, buckets, &self.tiers)
        })) {
            Ok(stored) => stored,
            Err(panic) => {
                // The members waiting for this group must not wait for a
                // commit nobody will make. The caches are whole (they
                // change only when a group commits), so the writer is let
                // go unpoisoned.
                let _ = self.end_group(&mut writer, Some(&panicked()));
                drop(writer);
                std::panic::resume_unwind(panic);
            }
        };
        if let Err(err) = &stored
            && writer.group_lost()
        {
            // The failure took the group's transaction with it: the
            // members before it are not stored either.
            let _ = self.end_group(&mut writer, Some(err));
            return stored;
        }
        let members = writer.group_members();
        if members < self.max_group_batches && self.groups.someone_joining() {
            // The next batch stores into this transaction and commits it,
            // or leaves it to the one after. A batch that failed has
            // nothing in it to wait for.
            let outcome = stored?;
            writer.wait_in_group();
            drop(writer);
            self.groups.wait_for(group)?;
            return Ok(outcome);
        }
        let committed = self.end_group(&mut writer, None);
        drop(writer);
        match (stored, committed) {
            (Ok(outcome), Ok(())) => Ok(outcome),
            (Ok(_), Err(err)) | (Err(err), _) => Err(err),
        }
    }

    /// Commits the open group, if any, or rolls it back for `abandon`,
    /// and tells its waiting members how that went.
    fn end_group(
        &self,
        writer: &mut Writer,
        abandon: Option<&StorageError>,
    ) -> Result<(), StorageError> {
        let Some((group, result)) = writer.end_group(abandon.is_none()) else {
            return Ok(());
        };
        let told = match abandon {
            Some(reason) => Err(reason),
            None => result.as_ref().map(|_| ()),
        };
        self.groups.finished(&group, told);
        result
    }

    /// The start of the bucket holding `unix_nanos`.
    fn bucket_of(&self, unix_nanos: i64) -> i64 {
        // Saturates only for times near i64::MIN, which validation rejects.
        unix_nanos.saturating_sub(unix_nanos.rem_euclid(self.bucket_nanos))
    }

    /// The buckets of a batch starting at `unix_nanos`: its own, and the
    /// last of its dictionary epoch.
    fn buckets_of(&self, unix_nanos: i64) -> Buckets {
        let samples = self.bucket_of(unix_nanos);
        let epoch_start = samples.saturating_sub(samples.rem_euclid(self.dictionary_epoch_nanos));
        Buckets {
            samples,
            items_kept_through: epoch_start
                .saturating_add(self.dictionary_epoch_nanos - self.bucket_nanos)
                .max(samples),
        }
    }

    /// The writer for anything but ingest, with no group open: what it
    /// does is its own transaction's.
    pub(super) fn writer(&self) -> MutexGuard<'_, Writer> {
        let mut writer = self.lock_writer();
        // Its own members report a failed commit; this caller has nothing
        // in it.
        let _ = self.end_group(&mut writer, None);
        writer
    }

    /// The writer as it is, a group perhaps open: for ingest, and for
    /// reading its counters.
    pub(super) fn lock_writer(&self) -> MutexGuard<'_, Writer> {
        // A panic while the lock was held rolled its transaction back (the
        // Transaction's drop) but may have left a cache half updated: start
        // the caches afresh, the database is the truth.
        self.writer.lock().unwrap_or_else(|poisoned| {
            let mut writer = poisoned.into_inner();
            let _ = self.end_group(&mut writer, Some(&panicked()));
            writer.forget_through(i64::MAX);
            self.writer.clear_poison();
            writer
        })
    }

    /// [`super::Storage::delete_before`]: deletes whole buckets, oldest
    /// first, then the dictionary rows only they referenced.
    pub(super) fn delete_buckets_before(
        &self,
        cutoff_unix_nanos: i64,
    ) -> Result<u64, StorageError> {
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
            let rows = delete_samples(&tx, bucket, bucket)?;
            tx.execute(
                "DELETE FROM label_set_buckets WHERE bucket_start = ?1",
                [bucket],
            )?;
            // No query may use a span summing the deleted bucket.
            rollup::forget_through(&tx, &self.tiers, bucket)?;
            tx.commit()?;
            deleted = deleted.saturating_add(rows);
        }

        let mut writer = self.writer();
        let tx = writer
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)?;
        // Again in this transaction: a late batch may have added to an old
        // bucket since, and the orphan deletes below rely on every bucket up
        // to `last` being gone.
        let rows = delete_samples(&tx, i64::MIN, last)?;
        deleted = deleted.saturating_add(rows);
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
    pub(super) fn roll_up(&self, closed_before_unix_nanos: i64) -> Result<u64, StorageError> {
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
                match rollup::recompute(&tx, &self.tiers, width, start) {
                    Ok(_) => tx.commit()?,
                    Err(StorageError::Corrupt(reason)) => {
                        // One damaged span must not stop every later one.
                        drop(tx);
                        let tx = writer
                            .conn
                            .transaction_with_behavior(TransactionBehavior::Immediate)?;
                        rollup::abandon(&tx, width, start)?;
                        tx.commit()?;
                        tracing::warn!(
                            width_nanos = width,
                            span_start_unix_nanos = start,
                            "compaction: the span's samples cannot be read ({reason}); queries \
                             read its buckets instead"
                        );
                    }
                    Err(other) => return Err(other),
                }
            }
            spans += 1;
            // The mutex is not fair: let a waiting ingest take it first.
            std::thread::yield_now();
        }
        Ok(spans)
    }
}

/// Why a group was rolled back after a panic, for its waiting members.
fn panicked() -> StorageError {
    StorageError::Corrupt("storing a batch of the same transaction panicked".into())
}

/// Where a batch's rows go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Buckets {
    /// The bucket its samples are summed in.
    samples: i64,
    /// The `last_bucket` the dictionary rows it uses get at least: the
    /// last bucket of the samples' dictionary epoch (see
    /// [`super::SqliteOptions::dictionary_epoch_nanos`]). Items whose rows
    /// have it already are not written again.
    items_kept_through: i64,
}

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
    insert_conflicts: u64,
    /// Whether an item the cache does not know is inserted first (and
    /// looked up only when the table turns out to hold it) rather than
    /// looked up first: chosen from how such items turned out in the last
    /// batch (see [`Dictionary::publish`]). Either way gives the same ids;
    /// the better guess saves a lookup per item. A profile whose stacks
    /// hardly repeat (a deep recursion) makes nearly every stack new, and
    /// its lookups were a ninth of the collector's CPU; after a restart,
    /// or once the cache was cleared, most are stored already.
    insert_first: bool,
    /// Such items of the batches since the last choice: found stored, and
    /// new.
    unknown_stored: u64,
    unknown_new: u64,
}

impl Dictionary {
    fn new(capacity: usize) -> Self {
        Self {
            entries: ContentHashMap::default(),
            capacity,
            hits: 0,
            misses: 0,
            insert_conflicts: 0,
            insert_first: false,
            unknown_stored: 0,
            unknown_new: 0,
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

    /// Adds entries of a committed transaction, and chooses how the next
    /// batch stores the items it does not know.
    fn publish(&mut self, pending: &mut ContentHashMap<Entry>) {
        if self.unknown_stored + self.unknown_new > 0 {
            self.insert_first = self.unknown_new > self.unknown_stored;
            (self.unknown_stored, self.unknown_new) = (0, 0);
        }
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
    /// Per label set of the batch: its period (0: unknown).
    label_set_periods: Vec<i64>,
    /// (label set id, stack id, weight, the label set's period)
    samples: Vec<(i64, i64, u64, i64)>,
    /// One label set's (stack id, weight) pairs of the batch; room for the
    /// pairs its bucket held and for the merged ones; the blob of those
    /// (see `sums`).
    set_pairs: Vec<(i64, u64)>,
    merge_pairs: [Vec<(i64, u64)>; 2],
    sums: Vec<u8>,
    /// Items first stored or moved to a newer epoch by the open
    /// transaction: published to the caches only after it commits, so a
    /// rollback cannot leave ids in the caches that the database lacks.
    /// One map each for mappings, locations, stacks and label sets.
    pending: [ContentHashMap<Entry>; 4],
}

pub(super) struct Writer {
    conn: Connection,
    mappings: Dictionary,
    locations: Dictionary,
    stacks: Dictionary,
    label_sets: Dictionary,
    scratch: Scratch,
    /// The transaction batches are being stored in, when one is open.
    group: Option<OpenGroup>,
    last_group: u64,
    /// Groups committed, and batches stored in them.
    commits: u64,
    committed_batches: u64,
}

/// What the caches know about a dictionary item.
enum Known {
    /// Stored, with a `last_bucket` at or after the batch's
    /// [`Buckets::items_kept_through`].
    Current(i64),
    /// Stored, but its `last_bucket` has to move forward to that.
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
    find: CachedStatement<'conn>,
    insert: CachedStatement<'conn>,
    /// Gives an inserted row's id.
    conn: &'conn Connection,
    /// The batch's [`Buckets::items_kept_through`].
    kept_through: i64,
}

impl<'a, 'conn> Table<'a, 'conn> {
    fn new(
        tx: &'conn Connection,
        sql: &DictionarySql,
        dict: &'a mut Dictionary,
        pending: &'a mut ContentHashMap<Entry>,
        kept_through: i64,
    ) -> rusqlite::Result<Self> {
        Ok(Self {
            dict,
            pending,
            bump: tx.prepare_cached(sql.bump)?,
            find: tx.prepare_cached(sql.find)?,
            insert: tx.prepare_cached(sql.insert)?,
            conn: tx,
            kept_through,
        })
    }

    fn lookup(&mut self, hash: u128) -> Known {
        // Stored by this transaction: by this batch, or by an earlier one
        // of its group, whose epoch may be older.
        let entry = match self.pending.get(&hash) {
            Some(&entry) => Some(entry),
            None => self.dict.get(hash),
        };
        match entry {
            Some(entry) if entry.last_bucket >= self.kept_through => Known::Current(entry.id),
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
        store: impl FnOnce(NewRow<'_, '_>) -> rusqlite::Result<i64>,
    ) -> Result<i64, StorageError> {
        let id = match known {
            Known::Current(id) => return Ok(id),
            Known::Stale(id) if self.bump.execute((id, self.kept_through))? == 1 => id,
            // Unknown, or stale and gone (which retention pruning the
            // caches rules out): found by its hash if stored, else stored,
            // rather than reference a missing row.
            Known::Stale(_) | Known::Unknown if self.dict.insert_first => {
                let mut hash_taken = false;
                let new_row = NewRow {
                    insert: &mut self.insert,
                    conn: self.conn,
                    hash_taken: &mut hash_taken,
                };
                match store(new_row) {
                    Ok(id) => {
                        self.dict.unknown_new += 1;
                        id
                    }
                    // The table holds the item. The failed statement left
                    // nothing behind: SQLite writes AUTOINCREMENT's counter
                    // at a statement's end, which a constraint failure
                    // never reaches (a behaviour, not a documented promise:
                    // the storage tests check that no id is used up).
                    Err(_) if hash_taken => {
                        self.dict.unknown_stored += 1;
                        self.dict.insert_conflicts += 1;
                        self.find_stored(hash)?.ok_or_else(|| {
                            StorageError::Corrupt(format!(
                                "a dictionary item's hash is taken, but no row has it: {hash:032x}"
                            ))
                        })?
                    }
                    Err(error) => return Err(error.into()),
                }
            }
            Known::Stale(_) | Known::Unknown => match self.find_stored(hash)? {
                Some(id) => {
                    self.dict.unknown_stored += 1;
                    id
                }
                None => {
                    self.dict.unknown_new += 1;
                    store(NewRow {
                        insert: &mut self.insert,
                        conn: self.conn,
                        hash_taken: &mut false,
                    })?
                }
            },
        };
        self.pending.insert(
            hash,
            Entry {
                id,
                last_bucket: self.kept_through,
            },
        );
        Ok(id)
    }

    /// The id of the stored item of `hash`, its `last_bucket` moved
    /// forward to the batch's `kept_through`; `None` when the table has
    /// none.
    fn find_stored(&mut self, hash: u128) -> Result<Option<i64>, StorageError> {
        let found: Option<(i64, i64)> = self
            .find
            .query_row([&hash.to_le_bytes()[..]], |row| {
                Ok((row.get(0)?, row.get(1)?))
            })
            .optional()?;
        let Some((id, last_bucket)) = found else {
            return Ok(None);
        };
        if last_bucket < self.kept_through {
            self.bump.execute((id, self.kept_through))?;
        }
        Ok(Some(id))
    }

    fn intern(
        &mut self,
        hash: u128,
        store: impl FnOnce(NewRow<'_, '_>) -> rusqlite::Result<i64>,
    ) -> Result<i64, StorageError> {
        let known = self.lookup(hash);
        self.finish(hash, known, store)
    }
}

/// Inserts a dictionary item the caches and the table do not have.
struct NewRow<'s, 'conn> {
    insert: &'s mut Statement<'conn>,
    conn: &'conn Connection,
    /// Set when the insert failed because the table holds the item's hash
    /// already (its only unique column), and only then: an error of any
    /// other statement the caller runs stays an error.
    hash_taken: &'s mut bool,
}

impl NewRow<'_, '_> {
    /// Inserts the row of `params` (the insert's columns) and gives its id.
    fn insert(self, params: impl rusqlite::Params) -> rusqlite::Result<i64> {
        if let Err(error) = self.insert.execute(params) {
            *self.hash_taken = matches!(
                &error,
                rusqlite::Error::SqliteFailure(failure, _)
                    if failure.extended_code == rusqlite::ffi::SQLITE_CONSTRAINT_UNIQUE
            );
            return Err(error);
        }
        Ok(self.conn.last_insert_rowid())
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
    /// and kept through the batch's `kept_through`.
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
        // One for the whole batch: both tables carry it.
        let kept_through = locations.kept_through;
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
            *mapping_id = mappings.intern(mapping_hash, |row| {
                row.insert((
                    &mapping_hash.to_le_bytes()[..],
                    kind_code(mapping.kind),
                    &mapping.build_id,
                    &mapping.path,
                    kept_through,
                    &segments,
                ))
            })?;
        }
        let mapping_id = *mapping_id;
        let blob = &mut *self.blob;
        let id = locations.intern(hash, |row| {
            blob.clear();
            encode_lines(blob, &location.lines);
            row.insert((
                &hash.to_le_bytes()[..],
                mapping_id,
                // Same bits: addresses use the full u64 range.
                location.address as i64,
                &blob[..],
                kept_through,
            ))
        })?;
        if let Some(slot) = self.location_ids.get_mut(i) {
            *slot = id;
        }
        Ok(id)
    }
}

/// Deletes the samples of the buckets from `first` to `last`; returns how
/// many (bucket, label set, stack) sums they held.
fn delete_samples(tx: &Transaction<'_>, first: i64, last: i64) -> Result<u64, StorageError> {
    let mut count = tx.prepare_cached(
        "SELECT stacks FROM samples WHERE bucket_start >= ?1 AND bucket_start <= ?2",
    )?;
    let mut rows = count.query((first, last))?;
    let mut sums = 0u64;
    while let Some(row) = rows.next()? {
        // A blob that cannot be read is deleted all the same: retention
        // must not stall on it.
        let held = sums::column(row, 0).and_then(sums::count).unwrap_or(0);
        sums = sums.saturating_add(held);
    }
    tx.prepare_cached("DELETE FROM samples WHERE bucket_start >= ?1 AND bucket_start <= ?2")?
        .execute((first, last))?;
    Ok(sums)
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
    pub(super) fn new(conn: Connection, cache_entries: usize) -> Self {
        Self {
            conn,
            mappings: Dictionary::new(cache_entries),
            locations: Dictionary::new(cache_entries),
            stacks: Dictionary::new(cache_entries),
            label_sets: Dictionary::new(cache_entries),
            scratch: Scratch::default(),
            group: None,
            last_group: 0,
            commits: 0,
            committed_batches: 0,
        }
    }

    /// The open group's id, after opening one if none is.
    pub(super) fn join_group(&mut self) -> Result<u64, StorageError> {
        if let Some(group) = &self.group {
            return Ok(group.id);
        }
        if !self.conn.is_autocommit() {
            // A transaction whose rollback failed once: every BEGIN would
            // fail while it stays.
            self.conn.execute_batch("ROLLBACK")?;
        }
        self.conn.execute_batch("BEGIN IMMEDIATE")?;
        self.forget_pending();
        self.last_group += 1;
        self.group = Some(OpenGroup {
            id: self.last_group,
            members: 0,
            stored: 0,
            waiting: 0,
            lost: false,
        });
        Ok(self.last_group)
    }

    /// Whether the open group's transaction is gone or holds part of a
    /// failed batch: SQLite rolls a whole transaction back on some errors
    /// (a full disk, out of memory), and a savepoint that could not be
    /// rolled back leaves what its batch wrote.
    pub(super) fn group_lost(&self) -> bool {
        self.group.as_ref().is_some_and(|group| group.lost)
    }

    /// Batches the open group has stored or tried to.
    pub(super) fn group_members(&self) -> usize {
        self.group.as_ref().map_or(0, |group| group.members)
    }

    /// Counts a member that waits for the open group's commit.
    pub(super) fn wait_in_group(&mut self) {
        if let Some(group) = &mut self.group {
            group.waiting += 1;
        }
    }

    /// Commits the open group (or rolls it back), publishing what it
    /// stored to the caches only once it is committed; `None` when no
    /// group was open.
    pub(super) fn end_group(
        &mut self,
        commit: bool,
    ) -> Option<(OpenGroup, Result<(), StorageError>)> {
        let group = self.group.take()?;
        let committed = if commit {
            self.conn
                .execute_batch("COMMIT")
                .map_err(StorageError::from)
        } else {
            Err(StorageError::Corrupt(
                "the transaction was rolled back".into(),
            ))
        };
        // A failed COMMIT may leave the transaction open (SQLITE_BUSY);
        // nothing of the group may stay.
        if committed.is_err()
            && !self.conn.is_autocommit()
            && let Err(err) = self.conn.execute_batch("ROLLBACK")
        {
            // Every later BEGIN fails while it stays open.
            tracing::error!("rolling back the writer's transaction failed: {err}");
        }
        if committed.is_ok() {
            let [mappings, locations, stacks, label_sets] = &mut self.scratch.pending;
            self.mappings.publish(mappings);
            self.locations.publish(locations);
            self.stacks.publish(stacks);
            self.label_sets.publish(label_sets);
            self.commits += 1;
            self.committed_batches += group.stored as u64;
        } else {
            self.forget_pending();
        }
        Some((group, committed))
    }

    pub(super) fn commit_stats(&self) -> CommitStats {
        CommitStats {
            commits: self.commits,
            batches: self.committed_batches,
        }
    }

    /// How well the dictionary caches are doing.
    pub(super) fn cache_stats(&self) -> CacheStats {
        [
            &self.mappings,
            &self.locations,
            &self.stacks,
            &self.label_sets,
        ]
        .iter()
        .fold(CacheStats::default(), |sum, dict| CacheStats {
            hits: sum.hits + dict.hits,
            misses: sum.misses + dict.misses,
            insert_conflicts: sum.insert_conflicts + dict.insert_conflicts,
            entries: sum.entries + dict.entries.len(),
        })
    }

    /// The writer's page cache and dictionary caches against their bounds.
    pub(super) fn state_sizes(&self, out: &mut Vec<StateSize>, page_cache_bytes: usize) {
        out.push(StateSize::bytes(
            "writer_page_cache",
            page_cache_used(&self.conn),
            Some(page_cache_bytes),
        ));
        for (name, dictionary) in [
            ("ingest_mappings", &self.mappings),
            ("ingest_locations", &self.locations),
            ("ingest_stacks", &self.stacks),
            ("ingest_label_sets", &self.label_sets),
        ] {
            out.push(StateSize::entries(
                name,
                dictionary.entries.len(),
                Some(dictionary.capacity),
            ));
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
        self.forget_pending();
    }

    /// Stores `batch` in the open group (see [`Writer::join_group`]), whole
    /// or not at all: under a savepoint of its own, or, as the group's
    /// first batch, as the transaction itself.
    fn ingest(
        &mut self,
        batch: &ValidBatch,
        buckets: Buckets,
        tiers: &Tiers,
    ) -> Result<IngestOutcome, StorageError> {
        let stored = self.ingest_member(batch, buckets, tiers);
        if let (Ok(IngestOutcome::Stored { .. }), Some(group)) = (&stored, &mut self.group) {
            group.stored += 1;
        }
        stored
    }

    fn ingest_member(
        &mut self,
        batch: &ValidBatch,
        buckets: Buckets,
        tiers: &Tiers,
    ) -> Result<IngestOutcome, StorageError> {
        let Some(group) = &mut self.group else {
            return Err(StorageError::Corrupt(
                "a batch was stored with no transaction open".into(),
            ));
        };
        group.members += 1;
        if group.members == 1 {
            // The first batch needs no savepoint: the group holds nothing
            // else, so a failure rolls the whole transaction back. A
            // savepoint copies every page it first changes, which cost a
            // batch of new stacks about as much again as storing it.
            let stored = self.store_in_transaction(batch, buckets, tiers);
            if stored.is_err() {
                self.lose_group();
            }
            return stored;
        }
        let stored = self
            .conn
            .execute_batch("SAVEPOINT batch")
            .map_err(StorageError::from)
            .and_then(|()| self.store_in_transaction(batch, buckets, tiers));
        let ended = match &stored {
            Ok(_) => self.conn.execute_batch("RELEASE batch"),
            Err(_) => self
                .conn
                .execute_batch("ROLLBACK TO batch; RELEASE batch")
                .inspect_err(|err| {
                    tracing::warn!(
                        "rolling back a failed batch failed ({err}): \
                         the batches stored with it are rolled back too"
                    );
                }),
        };
        let lost = ended.is_err() || self.conn.is_autocommit();
        if lost {
            self.lose_group();
        } else if stored.is_err() {
            self.forget_pending();
        }
        match (stored, ended) {
            (Ok(_), Err(err)) => Err(err.into()),
            (Ok(_), Ok(())) if lost => Err(StorageError::Corrupt(
                "the write transaction ended while a batch was stored".into(),
            )),
            (stored, _) => stored,
        }
    }

    /// The open group can only be rolled back now.
    fn lose_group(&mut self) {
        if let Some(group) = &mut self.group {
            group.lost = true;
        }
        self.forget_pending();
    }

    /// After a failed batch: its items may be among the pending ones. The
    /// earlier members' go too: an item missing from the caches costs a
    /// lookup, one cached but not stored would be referenced by later
    /// batches.
    fn forget_pending(&mut self) {
        for pending in &mut self.scratch.pending {
            pending.clear();
        }
    }

    fn store_in_transaction(
        &mut self,
        batch: &ValidBatch,
        buckets: Buckets,
        tiers: &Tiers,
    ) -> Result<IngestOutcome, StorageError> {
        let Buckets {
            samples: bucket,
            items_kept_through: kept_through,
        } = buckets;
        let Writer {
            conn,
            mappings,
            locations,
            stacks,
            label_sets,
            scratch,
            ..
        } = self;
        let tx: &Connection = conn;
        let duplicate = tx
            .prepare_cached("SELECT 1 FROM batches WHERE id = ?1")?
            .exists([&batch.batch_id[..]])?;
        if duplicate {
            // Nothing was written.
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
            label_set_periods,
            samples,
            set_pairs,
            merge_pairs,
            sums: sums_blob,
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
            let mut mapping_table =
                Table::new(tx, &MAPPINGS, mappings, pending_mappings, kept_through)?;
            let mut location_table =
                Table::new(tx, &LOCATIONS, locations, pending_locations, kept_through)?;
            let mut stack_table = Table::new(tx, &STACKS, stacks, pending_stacks, kept_through)?;
            let mut items = BatchItems {
                mapping_hashes,
                mapping_ids,
                location_hashes,
                location_ids,
                blob,
            };
            stack_ids.clear();
            for (index, stack) in batch.stacks.iter().enumerate() {
                let hash = stack_hash(
                    bytes,
                    stack.iter().map(|&location| {
                        item(items.location_hashes, location, || {
                            format!("stack {index}: location {location}")
                        })
                        .copied()
                    }),
                )?;
                let id = match stack_table.lookup(hash) {
                    // The common case once a fleet's stacks are known: no
                    // location of the stack needs looking at.
                    Known::Current(id) => id,
                    known => {
                        // A stack stored or moved to this epoch takes its
                        // locations (and their mappings) along: retention
                        // relies on those being kept at least as long as
                        // the stacks that use them.
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
                        stack_table.finish(hash, known, |row| {
                            blob.clear();
                            for &id in stack_locations.iter() {
                                put_varint(blob, id as u64);
                            }
                            row.insert((&hash.to_le_bytes()[..], &blob[..], kept_through))
                        })?
                    }
                };
                stack_ids.push(id);
            }

            let mut label_set_table = Table::new(
                tx,
                &LABEL_SETS,
                label_sets,
                pending_label_sets,
                kept_through,
            )?;
            let mut insert_label = tx.prepare_cached(
                "INSERT OR IGNORE INTO labels (label_set_id, name, value) VALUES (?1, ?2, ?3)",
            )?;
            if batch.label_set_periods.len() != batch.label_sets.len() {
                return Err(invalid(format!(
                    "{} label sets but {} periods",
                    batch.label_sets.len(),
                    batch.label_set_periods.len()
                )));
            }
            label_set_ids.clear();
            label_set_periods.clear();
            for (labels, &period) in batch.label_sets.iter().zip(&batch.label_set_periods) {
                // 0 stands for "unknown"; validation keeps real periods in
                // range.
                label_set_periods.push(i64::try_from(period).unwrap_or(0));
                let hash = label_set_hash(bytes, labels);
                let id = label_set_table.intern(hash, |row| {
                    let id = row.insert((&hash.to_le_bytes()[..], kept_through))?;
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

        // Samples, sorted by key: each label set's in a run, ascending by
        // stack, the sets' rows met in the bucket's B-tree in order, and
        // duplicates within the batch merged here.
        samples.clear();
        for (index, sample) in batch.samples.iter().enumerate() {
            let stack = *item(stack_ids, sample.stack, || {
                format!("sample {index}: stack {}", sample.stack)
            })?;
            let label_set = *item(label_set_ids, sample.label_set, || {
                format!("sample {index}: label set {}", sample.label_set)
            })?;
            let period = *item(label_set_periods, sample.label_set, || {
                format!(
                    "sample {index}: the period of label set {}",
                    sample.label_set
                )
            })?;
            if sample.weight == 0 || i64::try_from(sample.weight).is_err() {
                return Err(invalid(format!(
                    "sample {index}: weight {} is not in 1..=i64::MAX",
                    sample.weight
                )));
            }
            samples.push((label_set, stack, sample.weight, period));
        }
        samples.sort_unstable();
        samples.dedup_by(|next, kept| {
            let same = (next.0, next.1) == (kept.0, kept.1);
            if same {
                kept.2 = kept.2.saturating_add(next.2);
            }
            same
        });
        {
            // Per label set: its sums merged into its bucket's blob, and
            // its total and period into `label_set_buckets`.
            let mut stored = tx.prepare_cached(
                "SELECT stacks FROM samples WHERE bucket_start = ?1 AND label_set_id = ?2",
            )?;
            let mut upsert_samples = tx.prepare_cached(
                "INSERT INTO samples (bucket_start, label_set_id, stacks) VALUES (?1, ?2, ?3)
                 ON CONFLICT (bucket_start, label_set_id) DO UPDATE SET stacks = excluded.stacks",
            )?;
            let mut upsert_label_set_bucket = tx.prepare_cached(UPSERT_LABEL_SET_BUCKET)?;
            for run in samples.chunk_by(|a, b| a.0 == b.0) {
                let (label_set, period) = (run[0].0, run[0].3);
                set_pairs.clear();
                set_pairs.extend(run.iter().map(|&(_, stack, weight, _)| (stack, weight)));
                let mut rows = stored.query((bucket, label_set))?;
                let stored_blob = match rows.next()? {
                    Some(row) => Some(sums::column(row, 0)?),
                    None => None,
                };
                sums::merge(stored_blob, set_pairs, merge_pairs, sums_blob)?;
                drop(rows);
                upsert_samples.execute((bucket, label_set, &sums_blob[..]))?;
                let total = run
                    .iter()
                    .fold(0u64, |sum, &(_, _, weight, _)| sum.saturating_add(weight));
                upsert_label_set_bucket.execute((bucket, label_set, period, saturate(total)))?;
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
        rollup::invalidate(tx, tiers, bucket)?;
        Ok(IngestOutcome::Stored {
            samples: batch.samples.len() as u64,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hot ingest types stay small: the caches hold millions of them.
    #[test]
    fn entry_size() {
        assert_eq!(std::mem::size_of::<Entry>(), 16);
    }

    /// An item a group's earlier batch stored in an older epoch moves to
    /// the later batch's: retention deletes by `last_bucket`.
    #[test]
    fn a_group_moves_what_an_earlier_batch_stored_to_a_later_epoch() {
        let dir = tempfile::tempdir().expect("tempdir");
        let storage = SqliteStorage::open(
            &dir.path().join("stackscope.db"),
            super::super::SqliteOptions::default(),
        )
        .expect("open");
        let (bucket, epoch) = (storage.bucket_nanos, storage.dictionary_epoch_nanos);
        let mut writer = storage.lock_writer();
        writer.join_group().expect("begin");
        for (id, at) in [(1, epoch), (2, 3 * epoch + bucket), (3, 2 * epoch)] {
            let batch = super::super::read::tests::batch(id, "node-a", "f", 1);
            let buckets = storage.buckets_of(at);
            writer
                .ingest(&batch, buckets, &storage.tiers)
                .expect("ingest");
        }
        storage.end_group(&mut writer, None).expect("commit");
        for table in ["mappings", "locations", "stacks", "label_sets"] {
            let last: i64 = writer
                .conn
                .query_row(&format!("SELECT last_bucket FROM {table}"), [], |row| {
                    row.get(0)
                })
                .expect("one row");
            assert_eq!(last, 4 * epoch - bucket, "{table}");
        }
        assert_eq!(
            writer.commit_stats(),
            CommitStats {
                commits: 1,
                batches: 3
            }
        );
    }

    /// Rows are kept through the last bucket of the batch's epoch, which
    /// is whole buckets long; an epoch of one bucket keeps them through
    /// the batch's own.
    #[test]
    fn items_are_kept_through_the_last_bucket_of_their_epoch() {
        let dir = tempfile::tempdir().expect("tempdir");
        let open = |bucket_nanos, dictionary_epoch_nanos, name: &str| {
            SqliteStorage::open(
                &dir.path().join(name),
                super::super::SqliteOptions {
                    bucket_nanos,
                    dictionary_epoch_nanos,
                    ..Default::default()
                },
            )
            .expect("open")
        };
        let minute = 60_000_000_000;
        let hour = 60 * minute;
        let storage = open(minute, hour, "hour.db");
        let kept = |at| storage.buckets_of(at);
        assert_eq!(
            kept(5 * hour + 7 * minute + 3),
            Buckets {
                samples: 5 * hour + 7 * minute,
                items_kept_through: 5 * hour + 59 * minute
            }
        );
        assert_eq!(kept(5 * hour).items_kept_through, 5 * hour + 59 * minute);
        assert_eq!(kept(-1).items_kept_through, -minute);
        // 90 s rounds up to 2 minutes.
        let storage = open(minute, 90_000_000_000, "ninety.db");
        assert_eq!(storage.dictionary_epoch_nanos, 2 * minute);
        assert_eq!(
            storage.buckets_of(3 * minute).items_kept_through,
            3 * minute
        );
        assert_eq!(
            storage.buckets_of(4 * minute).items_kept_through,
            5 * minute
        );
        let storage = open(minute, minute, "minute.db");
        assert_eq!(
            storage.buckets_of(7 * minute + 1).items_kept_through,
            7 * minute
        );
        // Near the end of time, the epoch's end saturates.
        let storage = open(minute, hour, "late.db");
        let samples = i64::MAX - i64::MAX.rem_euclid(minute);
        assert_eq!(
            storage.buckets_of(i64::MAX),
            Buckets {
                samples,
                items_kept_through: i64::MAX
            }
        );
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
