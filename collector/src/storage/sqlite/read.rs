//! The SQLite engine's query side: a bounded pool of read-only connections,
//! the caches they share (every stored label set, the frames of locations
//! and stacks), and the queries. In WAL mode each connection reads its own
//! consistent snapshot while the writer commits, so queries run side by
//! side: a one-node query is not queued behind a fleet-wide one. Owns no
//! schema (`schema`) and no writes (`write`); the rollups it reads are
//! `rollup`'s.
//!
//! Matchers are evaluated in Rust over an in-memory copy of the label sets
//! (they are few; regexes and absent labels do not map onto an index), so
//! `labels` needs no `(name, value)` index that would only slow ingest.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    path::PathBuf,
    sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, atomic::Ordering},
};

use rusqlite::{Connection, OptionalExtension as _, Transaction};
use stackscope_profile::model::{
    Frame, PROFILE_TYPE_LABEL, PeriodAgreement, ProfileType, Selection, StackSamples, WeightedStack,
};
use stackscope_telemetry::StateSize;

use super::{
    SqliteOptions, SqliteStorage, StackWeights, StorageError, add_capped, non_negative,
    page_cache_used, rollup, schema, sums,
};
use crate::{
    ingest::MappingRecord,
    storage::{
        codec::{BlobReader, decode_code_segments, decode_lines, kind_from_code, resolve_frames},
        point_width, series_point, tiers,
    },
};

/// The query connections, opened as queries need them up to a bound, and
/// the caches they share. A query holds one connection for its whole
/// transaction; it waits only when every connection is answering another.
pub(super) struct Readers {
    path: PathBuf,
    options: SqliteOptions,
    pool: Mutex<Pool>,
    /// Signalled when a connection goes back to the pool, or when opening
    /// one failed (its slot is free again).
    returned: Condvar,
    caches: QueryCaches,
    #[cfg(test)]
    hooks: tests::Hooks,
}

struct Pool {
    /// The most recently returned last: its page cache is the warmest.
    idle: Vec<Connection>,
    /// Connections open, idle or answering a query; at most
    /// `SqliteOptions::readers`.
    open: usize,
}

/// A connection checked out of the pool for one query; it goes back when
/// this is dropped, also when the query failed or panicked (its open
/// transaction is rolled back first, by the transaction's drop).
struct Checkout<'a> {
    readers: &'a Readers,
    conn: Option<Connection>,
}

impl std::ops::Deref for Checkout<'_> {
    type Target = Connection;

    fn deref(&self) -> &Connection {
        self.conn
            .as_ref()
            .expect("a checked-out connection is only taken back by drop")
    }
}

impl std::ops::DerefMut for Checkout<'_> {
    fn deref_mut(&mut self) -> &mut Connection {
        self.conn
            .as_mut()
            .expect("a checked-out connection is only taken back by drop")
    }
}

impl Drop for Checkout<'_> {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            self.readers.pool().idle.push(conn);
            self.readers.returned.notify_one();
        }
    }
}

impl Readers {
    /// A pool holding `first`, opened by the caller so that a database the
    /// query side cannot open fails at start, not at the first query.
    pub(super) fn new(path: PathBuf, options: SqliteOptions, first: Connection) -> Self {
        let caches = QueryCaches {
            label_sets: Mutex::new(SharedLabelSets::default()),
            frames: Mutex::new(FrameCache {
                generation: 0,
                locations: HashMap::new(),
                stacks: HashMap::new(),
                capacity: options.frame_cache_entries,
            }),
        };
        Self {
            path,
            options,
            pool: Mutex::new(Pool {
                idle: vec![first],
                open: 1,
            }),
            returned: Condvar::new(),
            caches,
            #[cfg(test)]
            hooks: tests::Hooks::default(),
        }
    }

    fn pool(&self) -> MutexGuard<'_, Pool> {
        // Pushes and pops leave the pool consistent whatever panicked.
        self.pool.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// An idle connection, a new one while fewer than the bound are open,
    /// or else the next one another query returns.
    fn checkout(&self) -> Result<Checkout<'_>, StorageError> {
        let mut pool = self.pool();
        loop {
            if let Some(conn) = pool.idle.pop() {
                return Ok(Checkout {
                    readers: self,
                    conn: Some(conn),
                });
            }
            if pool.open < self.options.readers {
                pool.open += 1;
                drop(pool);
                return match schema::open_reader(&self.path, &self.options) {
                    Ok(conn) => Ok(Checkout {
                        readers: self,
                        conn: Some(conn),
                    }),
                    Err(err) => {
                        self.pool().open -= 1;
                        self.returned.notify_one();
                        Err(err)
                    }
                };
            }
            #[cfg(test)]
            self.hooks.checkout_waits();
            pool = self
                .returned
                .wait(pool)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// The page caches of the connections (left out while any of them
    /// answers a query: a connection in use cannot be measured from another
    /// thread, and a sum without it would read low) and the shared caches.
    pub(super) fn state_sizes(&self, out: &mut Vec<StateSize>, page_cache_bytes: usize) {
        {
            let pool = self.pool();
            if pool.idle.len() == pool.open {
                let used = pool.idle.iter().map(page_cache_used).sum();
                out.push(StateSize::bytes(
                    "reader_page_cache",
                    used,
                    Some(self.options.readers.saturating_mul(page_cache_bytes)),
                ));
            }
        }
        {
            // Held only for a lookup or an insert at a time.
            let frames = self
                .caches
                .frames
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let capacity = Some(frames.capacity);
            out.push(StateSize::entries(
                "query_frames",
                frames.locations.len(),
                capacity,
            ));
            out.push(StateSize::entries(
                "query_stacks",
                frames.stacks.len(),
                capacity,
            ));
        }
        // Held while a query reads new label sets: not waited for.
        if let Ok(shared) = self.caches.label_sets.try_lock() {
            // Every stored label set: bounded by what retention keeps. A
            // query started before new sets arrived may still hold the
            // previous copy of the map (its entries are shared).
            out.push(StateSize::entries(
                "query_label_sets",
                shared.sets.sets.len(),
                None,
            ));
        }
    }
}

/// What queries on every connection share. Every key is an id, which is
/// never reused and whose row never changes, so an entry is right for
/// every snapshot that has the row, whichever query cached it; retention
/// (a new `SqliteStorage::generation`) empties them to free what it
/// deleted.
struct QueryCaches {
    label_sets: Mutex<SharedLabelSets>,
    frames: Mutex<FrameCache>,
}

/// The label sets as of the newest snapshot that read them. A query takes
/// its own reference (`Arc`), so it reads one consistent map however long
/// it runs; new sets go into a copy when a running query holds the map
/// (a copy of ids and pointers: the labels themselves are shared).
#[derive(Default)]
struct SharedLabelSets {
    generation: u64,
    sets: Arc<LabelSets>,
}

struct FrameCache {
    /// The `SqliteStorage::generation` the entries belong to.
    generation: u64,
    /// Frames per location id.
    locations: HashMap<i64, Arc<[Arc<Frame>]>>,
    /// Frames per stack id: a fleet-wide query resolves tens of thousands
    /// of stacks, each a lookup of its blob otherwise.
    stacks: HashMap<i64, Arc<[Arc<Frame>]>>,
    /// Entries each of `locations` and `stacks` holds before it is cleared.
    capacity: usize,
}

impl FrameCache {
    /// Adds an entry, clearing the map first when it is full.
    fn insert(
        map: &mut HashMap<i64, Arc<[Arc<Frame>]>>,
        capacity: usize,
        id: i64,
        frames: Arc<[Arc<Frame>]>,
    ) {
        if map.len() >= capacity && !map.contains_key(&id) {
            // Clearing beats LRU bookkeeping on every hit.
            map.clear();
        }
        if capacity > 0 {
            map.insert(id, frames);
        }
    }
}

impl QueryCaches {
    /// The label sets with those stored since the last query added, read in
    /// `tx`. Its snapshot begins here, under the lock, so the shared map is
    /// always the newest snapshot's (retention aside: sets it deleted stay
    /// until a query sees its new generation, and select no samples).
    fn label_sets(
        &self,
        tx: &Transaction<'_>,
        generation: u64,
    ) -> Result<Arc<LabelSets>, StorageError> {
        let mut shared = self.label_sets.lock().unwrap_or_else(|poisoned| {
            // A panic while reading new sets may have left the map half
            // updated: start afresh, once.
            let mut shared = poisoned.into_inner();
            shared.sets = Arc::default();
            self.label_sets.clear_poison();
            shared
        });
        if generation > shared.generation {
            shared.sets = Arc::default();
            shared.generation = generation;
        }
        let new = LabelSets::stored_after(tx, shared.sets.max_id)?;
        if !new.is_empty() {
            let sets = Arc::make_mut(&mut shared.sets);
            for (id, labels) in new {
                sets.max_id = sets.max_id.max(id);
                if labels.iter().any(|(name, _)| name == PROFILE_TYPE_LABEL) {
                    sets.typed.insert(id);
                }
                sets.sets.insert(id, labels);
            }
        }
        Ok(Arc::clone(&shared.sets))
    }

    fn frames(&self, generation: u64) -> MutexGuard<'_, FrameCache> {
        let mut frames = self.frames.lock().unwrap_or_else(|poisoned| {
            let mut frames = poisoned.into_inner();
            frames.locations.clear();
            frames.stacks.clear();
            self.frames.clear_poison();
            frames
        });
        if generation > frames.generation {
            frames.locations.clear();
            frames.stacks.clear();
            frames.generation = generation;
        }
        frames
    }
}

/// One query's view: the label sets as of its snapshot and the shared
/// frame caches.
struct Snapshot<'a> {
    label_sets: Arc<LabelSets>,
    caches: &'a QueryCaches,
    generation: u64,
}

/// Which label sets a selection covers.
enum Selected<'a> {
    /// A CPU selection without matchers: every label set but those of
    /// the other profile types (which the rollups leave out too).
    EveryCpu {
        typed: &'a HashSet<i64>,
    },
    Some(HashSet<i64>),
}

impl Selected<'_> {
    fn contains(&self, id: i64) -> bool {
        match self {
            // Most stores hold CPU samples alone: no hashing per row.
            Selected::EveryCpu { typed } => typed.is_empty() || !typed.contains(&id),
            Selected::Some(ids) => ids.contains(&id),
        }
    }
}

/// A label set's samples over a stretch of time: one bucket, or a span of
/// its label rollups.
struct Run {
    start: i64,
    width: i64,
    label_set: i64,
    /// The period its samples agree on (0 when they do not).
    period: i64,
    weight: u64,
}

/// Every stored label set, loaded incrementally: ids only grow, so each
/// query reads just the sets created since the last one.
#[derive(Default, Clone)]
struct LabelSets {
    max_id: i64,
    sets: HashMap<i64, Labels>,
    /// The sets of profile types other than CPU (with the type's label).
    typed: HashSet<i64>,
}

/// A label set's labels, sorted by name; shared by every copy of the map.
type Labels = Arc<[(String, String)]>;

impl LabelSets {
    /// The sets with an id above `max_id`, ascending.
    fn stored_after(tx: &Transaction<'_>, max_id: i64) -> Result<Vec<(i64, Labels)>, StorageError> {
        // LEFT JOIN: a set without labels still exists (and matches
        // matchers that accept an absent label).
        let mut stmt = tx.prepare_cached(
            "SELECT s.id, l.name, l.value FROM label_sets s
             LEFT JOIN labels l ON l.label_set_id = s.id
             WHERE s.id > ?1 ORDER BY s.id, l.name",
        )?;
        let mut rows = stmt.query([max_id])?;
        let mut sets = Vec::new();
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
                        sets.push((done, labels.into()));
                    }
                    current = Some((id, label.into_iter().collect()));
                }
            }
        }
        if let Some((done, labels)) = current {
            sets.push((done, labels.into()));
        }
        Ok(sets)
    }

    fn select(&self, selection: &Selection) -> Selected<'_> {
        if selection.selects_every_cpu_sample() {
            return Selected::EveryCpu { typed: &self.typed };
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

    /// The sets the selection's matchers select, whatever their type.
    fn select_any_type(&self, selection: &Selection) -> Selected<'_> {
        Selected::Some(
            self.sets
                .iter()
                .filter(|(_, labels)| {
                    selection.matches_labels_of_any_type(
                        labels.iter().map(|(n, v)| (n.as_str(), v.as_str())),
                    )
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

impl Snapshot<'_> {
    /// The frames of a stored stack, leaf first.
    fn stack_frames(
        &self,
        tx: &Transaction<'_>,
        stack: i64,
    ) -> Result<Vec<Arc<Frame>>, StorageError> {
        let cached = self
            .caches
            .frames(self.generation)
            .stacks
            .get(&stack)
            .cloned();
        if let Some(frames) = cached {
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
        let mut cache = self.caches.frames(self.generation);
        let capacity = cache.capacity;
        FrameCache::insert(&mut cache.stacks, capacity, stack, frames.as_slice().into());
        Ok(frames)
    }

    fn location_frames(
        &self,
        tx: &Transaction<'_>,
        stack: i64,
        location: i64,
    ) -> Result<Arc<[Arc<Frame>]>, StorageError> {
        let cached = self
            .caches
            .frames(self.generation)
            .locations
            .get(&location)
            .cloned();
        if let Some(frames) = cached {
            return Ok(frames);
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
        let mut cache = self.caches.frames(self.generation);
        let capacity = cache.capacity;
        FrameCache::insert(
            &mut cache.locations,
            capacity,
            location,
            Arc::clone(&frames),
        );
        Ok(frames)
    }
}

impl SqliteStorage {
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

    /// Runs `query` in one read transaction (one consistent snapshot) on
    /// a connection of its own, with the label sets brought up to date.
    fn read<T>(
        &self,
        query: impl FnOnce(&Snapshot<'_>, &Transaction<'_>) -> Result<T, StorageError>,
    ) -> Result<T, StorageError> {
        let mut conn = self.readers.checkout()?;
        let tx = conn.transaction()?;
        // Loaded before the snapshot begins: a generation is bumped only
        // after retention committed, so a query that sees the new one
        // cannot read a snapshot from before the delete.
        let generation = self.generation.load(Ordering::Acquire);
        let caches = &self.readers.caches;
        let snapshot = Snapshot {
            label_sets: caches.label_sets(&tx, generation)?,
            caches,
            generation,
        };
        #[cfg(test)]
        self.readers.hooks.query_runs();
        let result = query(&snapshot, &tx)?;
        tx.finish()?;
        Ok(result)
    }

    /// Calls `each` for every label set the selection's matchers select, per
    /// stretch of time it has samples in: the current label rollup spans
    /// that cover the range (see [`rollup`]), and the buckets between them.
    /// `series_step`: only spans each wholly inside one point of a series of
    /// points that wide. `whole_periods`: a span in which a selected set's
    /// buckets disagree on its period is given bucket by bucket (a weight
    /// in units needs one period).
    fn for_each_label_set_run(
        &self,
        tx: &Transaction<'_>,
        selection: &Selection,
        selected: &Selected,
        series_step: Option<i64>,
        whole_periods: bool,
        mut each: impl FnMut(Run) -> Result<(), StorageError>,
    ) -> Result<(), StorageError> {
        let Some((lo, hi)) = self.bucket_bounds(selection) else {
            return Ok(());
        };
        let widths = match series_step {
            Some(step) => tiers::fitting(self.tiers.label_widths(), step),
            None => self.tiers.label_widths().to_vec(),
        };
        let cover = rollup::cover(tx, &self.tiers, &widths, lo, hi)?;
        let mut sets = tx.prepare_cached(
            "SELECT label_set_id, sample_period_nanos, weight FROM label_rollup_sets
             WHERE width = ?1 AND span_start = ?2",
        )?;
        let mut gaps = cover.gaps.clone();
        let mut runs = Vec::new();
        for span in &cover.spans {
            runs.clear();
            let mut mixed = false;
            let mut rows = sets.query((span.width, span.start))?;
            while let Some(row) = rows.next()? {
                let (label_set, period, weight): (i64, i64, i64) =
                    (row.get(0)?, row.get(1)?, row.get(2)?);
                if !selected.contains(label_set) {
                    continue;
                }
                if whole_periods && period == 0 {
                    mixed = true;
                    break;
                }
                runs.push(Run {
                    start: span.start,
                    width: span.width,
                    label_set,
                    period,
                    weight: non_negative(weight, "label set weight")?,
                });
            }
            if mixed {
                // A selected set's buckets disagree on its period: the
                // span's buckets are read one by one, in one pass.
                gaps.push((span.start - 1, span.start.saturating_add(span.width)));
                continue;
            }
            for run in runs.drain(..) {
                each(run)?;
            }
        }
        for gap in gaps {
            label_set_buckets_in(tx, gap, selected, |start, label_set, period, weight| {
                each(Run {
                    start,
                    width: self.bucket_nanos,
                    label_set,
                    period,
                    weight,
                })
            })?;
        }
        Ok(())
    }

    /// Label sets with samples in the selection.
    fn selected_label_sets(
        &self,
        tx: &Transaction<'_>,
        selection: &Selection,
        selected: &Selected,
    ) -> Result<BTreeSet<i64>, StorageError> {
        let mut ids = BTreeSet::new();
        self.for_each_label_set_run(tx, selection, selected, None, false, |run| {
            ids.insert(run.label_set);
            Ok(())
        })?;
        Ok(ids)
    }

    /// The selected stacks; `in_units`: each row's weight times its period
    /// (see [`Storage::stacks_in_units`]).
    pub(super) fn query_stacks(
        &self,
        selection: &Selection,
        in_units: bool,
    ) -> Result<StackSamples, StorageError> {
        self.read(|snapshot, tx| {
            let selected = snapshot.label_sets.select(selection);
            let mut period = PeriodAgreement::default();
            let mut weights = StackWeights::default();
            // A row's sums (the blob in its column `column`), each times
            // the row's period when asked in units.
            let mut add = |row: &rusqlite::Row<'_>,
                           column: usize,
                           row_period: i64|
             -> Result<(), StorageError> {
                let factor = if in_units {
                    non_negative(row_period, "sample period")?
                } else {
                    1
                };
                sums::for_each(sums::column(row, column)?, |stack, weight| {
                    weights.add(stack, weight.saturating_mul(factor));
                    Ok(())
                })
            };
            match &selected {
                Selected::EveryCpu { .. } => {
                    // Every label set counts: whole spans from their
                    // rollups, the buckets between them in one sequential
                    // pass each over their rows (which beats a seek per
                    // label set).
                    let mut cover = match self.bucket_bounds(selection) {
                        Some((lo, hi)) => {
                            rollup::cover(tx, &self.tiers, self.tiers.widths(), lo, hi)?
                        }
                        None => rollup::Cover::default(),
                    };
                    if in_units {
                        // A span summed over several periods cannot be
                        // scaled: its buckets are read row by row.
                        let (kept, mixed): (Vec<_>, Vec<_>) = std::mem::take(&mut cover.spans)
                            .into_iter()
                            .partition(|span| span.sample_period_nanos > 0 || !span.has_cpu);
                        cover.gaps.extend(
                            mixed
                                .iter()
                                .map(|span| (span.start - 1, span.start + span.width)),
                        );
                        cover.spans = kept;
                    }
                    let mut spans = tx.prepare_cached(
                        "SELECT stacks FROM rollups WHERE width = ?1 AND span_start = ?2",
                    )?;
                    // Spans of other profile types' samples alone hold no rows.
                    for span in cover.spans.iter().filter(|span| span.has_cpu) {
                        period.add(u64::try_from(span.sample_period_nanos).unwrap_or(0));
                        let mut rows = spans.query((span.width, span.start))?;
                        while let Some(row) = rows.next()? {
                            add(row, 0, span.sample_period_nanos)?;
                        }
                    }
                    let mut samples = tx.prepare_cached(
                        "SELECT bucket_start, label_set_id, stacks FROM samples
                         WHERE bucket_start > ?1 AND bucket_start < ?2",
                    )?;
                    for &gap in &cover.gaps {
                        let mut periods: HashMap<(i64, i64), i64> = HashMap::new();
                        label_set_buckets_in(tx, gap, &selected, |bucket, label_set, p, _| {
                            period.add(u64::try_from(p).unwrap_or(0));
                            if in_units {
                                periods.insert((bucket, label_set), p);
                            }
                            Ok(())
                        })?;
                        let mut rows = samples.query(gap)?;
                        while let Some(row) = rows.next()? {
                            let (bucket, label_set): (i64, i64) = (row.get(0)?, row.get(1)?);
                            if selected.contains(label_set) {
                                let row_period = periods.get(&(bucket, label_set)).copied();
                                add(row, 2, row_period.unwrap_or(1))?;
                            }
                        }
                    }
                }
                Selected::Some(ids) if ids.is_empty() => {}
                Selected::Some(_) => {
                    // Read exactly the (span or bucket, label set) rows of
                    // the label rollups or samples that hold selected
                    // samples.
                    let mut samples = tx.prepare_cached(
                        "SELECT stacks FROM samples WHERE bucket_start = ?1 AND label_set_id = ?2",
                    )?;
                    let mut rolled = tx.prepare_cached(
                        "SELECT stacks FROM label_rollups
                         WHERE width = ?1 AND span_start = ?2 AND label_set_id = ?3",
                    )?;
                    self.for_each_label_set_run(tx, selection, &selected, None, in_units, |run| {
                        period.add(u64::try_from(run.period).unwrap_or(0));
                        let mut rows = if run.width == self.bucket_nanos {
                            samples.query((run.start, run.label_set))?
                        } else {
                            rolled.query((run.width, run.start, run.label_set))?
                        };
                        while let Some(row) = rows.next()? {
                            add(row, 0, run.period)?;
                        }
                        Ok(())
                    })?;
                }
            }

            let ids = weights.into_sorted();
            let mut stacks = Vec::with_capacity(ids.len());
            for (stack, weight) in ids {
                stacks.push(WeightedStack {
                    frames: snapshot.stack_frames(tx, stack)?,
                    weight,
                });
            }
            Ok(StackSamples {
                stacks,
                sample_period_nanos: if in_units { 1 } else { period.result() },
            })
        })
    }

    pub(super) fn query_label_names(
        &self,
        selection: &Selection,
    ) -> Result<Vec<String>, StorageError> {
        self.read(|snapshot, tx| {
            let selected = snapshot.label_sets.select(selection);
            let ids = self.selected_label_sets(tx, selection, &selected)?;
            let mut names = BTreeSet::new();
            for id in ids {
                for (name, _) in snapshot.label_sets.get(id)? {
                    names.insert(name.as_str());
                }
            }
            Ok(names.into_iter().map(str::to_owned).collect())
        })
    }

    pub(super) fn query_label_values(
        &self,
        selection: &Selection,
        name: &str,
    ) -> Result<Vec<String>, StorageError> {
        self.read(|snapshot, tx| {
            let selected = snapshot.label_sets.select(selection);
            let ids = self.selected_label_sets(tx, selection, &selected)?;
            let mut values = BTreeSet::new();
            for id in ids {
                let labels = snapshot.label_sets.get(id)?;
                if let Ok(i) = labels.binary_search_by(|(n, _)| n.as_str().cmp(name)) {
                    values.insert(labels[i].1.as_str());
                }
            }
            Ok(values.into_iter().map(str::to_owned).collect())
        })
    }

    pub(super) fn query_profile_types(
        &self,
        selection: &Selection,
    ) -> Result<Vec<ProfileType>, StorageError> {
        self.read(|snapshot, tx| {
            let selected = snapshot.label_sets.select_any_type(selection);
            let ids = self.selected_label_sets(tx, selection, &selected)?;
            let mut types = BTreeSet::new();
            for id in ids {
                let labels = snapshot.label_sets.get(id)?;
                let value = labels
                    .binary_search_by(|(n, _)| n.as_str().cmp(PROFILE_TYPE_LABEL))
                    .map_or("", |i| labels[i].1.as_str());
                // A value no type has (stored by hand) selects nothing.
                types.extend(ProfileType::from_label_value(value));
            }
            Ok(types.into_iter().collect())
        })
    }

    /// Points are aligned to multiples of `step_nanos`; a storage bucket
    /// overlapping the range counts whole. `step_nanos <= 0` means one point
    /// per storage bucket.
    /// `in_units`: each label set's weight times its period.
    pub(super) fn query_series(
        &self,
        selection: &Selection,
        step_nanos: i64,
        in_units: bool,
    ) -> Result<Vec<(i64, u64)>, StorageError> {
        self.read(|snapshot, tx| {
            let selected = snapshot.label_sets.select(selection);
            let mut points: BTreeMap<i64, u64> = BTreeMap::new();
            let step = point_width(step_nanos, self.bucket_nanos);
            self.for_each_label_set_run(tx, selection, &selected, Some(step), in_units, |run| {
                let weight = if in_units {
                    run.weight
                        .saturating_mul(non_negative(run.period, "sample period")?)
                } else {
                    run.weight
                };
                let point = series_point(run.start, step_nanos, self.bucket_nanos);
                let sum = points.entry(point).or_default();
                *sum = add_capped(*sum, weight);
                Ok(())
            })?;
            Ok(points.into_iter().filter(|(_, w)| *w > 0).collect())
        })
    }
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

#[cfg(test)]
pub(super) mod tests {
    use std::{
        sync::{OnceLock, mpsc},
        thread,
    };

    use stackscope_profile::model::{LabelMatcher, MatchOp, TimeRange};

    use super::*;
    use crate::{
        ingest::{LineRecord, LocationRecord, MappingKind, SampleRecord, ValidBatch},
        storage::Storage,
    };

    /// Where a test sees into the pool: each hook is set once, before the
    /// queries it watches start.
    #[derive(Default)]
    pub(super) struct Hooks {
        /// Called by every query once it holds a connection and its snapshot.
        query_runs: OnceLock<Box<dyn Fn() + Send + Sync>>,
        /// Called by a checkout that found every connection busy, before it
        /// waits for one.
        checkout_waits: OnceLock<Box<dyn Fn() + Send + Sync>>,
    }

    impl Hooks {
        pub(super) fn query_runs(&self) {
            if let Some(hook) = self.query_runs.get() {
                hook();
            }
        }

        pub(super) fn checkout_waits(&self) {
            if let Some(hook) = self.checkout_waits.get() {
                hook();
            }
        }
    }

    const T0: i64 = 1_700_000_000_000_000_000;

    /// A batch from `node`: `weight` samples of a one-frame stack in
    /// `function`.
    pub(in crate::storage::sqlite) fn batch(
        id: u8,
        node: &str,
        function: &str,
        weight: u64,
    ) -> ValidBatch {
        ValidBatch {
            batch_id: [id; 16],
            node: node.into(),
            range: TimeRange {
                start_unix_nanos: T0,
                end_unix_nanos: T0 + 10_000_000_000,
            },
            sample_period_nanos: 10_000_000,
            mappings: vec![MappingRecord {
                kind: MappingKind::User,
                build_id: "ab".into(),
                path: "/usr/bin/app".into(),
                code_segments: Vec::new(),
            }],
            locations: vec![LocationRecord {
                mapping: 0,
                address: 0x1000,
                lines: vec![LineRecord {
                    function: function.into(),
                    file: "app.c".into(),
                    line: 1,
                }],
            }],
            stacks: vec![vec![0]],
            label_sets: vec![vec![("node".into(), node.into())]],
            label_set_periods: vec![10_000_000],
            samples: vec![SampleRecord {
                stack: 0,
                label_set: 0,
                weight,
            }],
        }
    }

    fn selection(node: Option<&str>) -> Selection {
        Selection {
            range: TimeRange {
                start_unix_nanos: T0 - 3_600_000_000_000,
                end_unix_nanos: T0 + 3_600_000_000_000,
            },
            matchers: node
                .map(|node| LabelMatcher::new("node", MatchOp::Equal, node).expect("matcher"))
                .into_iter()
                .collect(),
            profile_type: Default::default(),
        }
    }

    /// (leaf function, weight) of an answer.
    fn weights(answer: Result<StackSamples, StorageError>) -> Vec<(String, u64)> {
        let mut weights: Vec<_> = answer
            .expect("query")
            .stacks
            .iter()
            .map(|stack| (stack.frames[0].function.clone(), stack.weight))
            .collect();
        weights.sort();
        weights
    }

    /// What the test sees while the fleet-wide query holds its connection.
    enum Event {
        /// The one-node query found every connection busy and waits.
        CheckoutWaits,
        NodeAnswered(Result<StackSamples, StorageError>),
    }

    /// Which event came first.
    #[derive(Debug, PartialEq, Eq)]
    enum First {
        Waited,
        Answered,
    }

    struct Run {
        first: First,
        /// State sizes taken while the fleet-wide query still held its
        /// connection, and after both queries were answered.
        sizes_while_held: Vec<StateSize>,
        sizes_after: Vec<StateSize>,
        fleet: Vec<(String, u64)>,
        node: Vec<(String, u64)>,
    }

    /// Stores two nodes' samples, starts a fleet-wide query that holds its
    /// connection (mid-query, its snapshot taken) until the test releases
    /// it, then a one-node query, and records which happened first: the
    /// one-node query's answer or its wait for a connection. Only then is
    /// the fleet-wide query released. Synchronised by channels throughout,
    /// so the outcome depends on the pool alone, not on timing.
    fn one_node_query_during_fleet_wide_query(options: SqliteOptions) -> Run {
        let dir = tempfile::tempdir().expect("tempdir");
        let storage = Arc::new(
            SqliteStorage::open(&dir.path().join("stackscope.db"), options).expect("open"),
        );
        for batch in [batch(1, "node-a", "a", 3), batch(2, "node-b", "b", 5)] {
            storage.ingest(&batch).expect("ingest");
        }

        let (running, fleet_runs) = mpsc::channel();
        let (release, released) = mpsc::channel::<()>();
        // Only the first query (the fleet-wide one) takes the receiver and
        // waits on it.
        let released = Mutex::new(Some(released));
        let hooks = &storage.readers.hooks;
        let set = hooks.query_runs.set(Box::new(move || {
            let first = released.lock().expect("hook lock").take();
            if let Some(released) = first {
                running.send(()).expect("test listens");
                released.recv().expect("test releases");
            }
        }));
        assert!(set.is_ok());
        let (events, seen) = mpsc::channel();
        let waits = events.clone();
        let set = hooks.checkout_waits.set(Box::new(move || {
            // The test may be past listening (an answer came first).
            let _ = waits.send(Event::CheckoutWaits);
        }));
        assert!(set.is_ok());

        let fleet = thread::spawn({
            let storage = Arc::clone(&storage);
            move || storage.stacks(&selection(None))
        });
        fleet_runs.recv().expect("the fleet-wide query runs");
        let node = thread::spawn({
            let storage = Arc::clone(&storage);
            move || {
                let answer = storage.stacks(&selection(Some("node-a")));
                let _ = events.send(Event::NodeAnswered(answer));
            }
        });
        let first = seen.recv().expect("an event");
        // Held until released below, whatever came first.
        assert!(!fleet.is_finished());
        let mut sizes_while_held = Vec::new();
        storage.state_sizes(&mut sizes_while_held);

        release.send(()).expect("the fleet-wide query waits");
        let fleet = weights(fleet.join().expect("fleet-wide query thread"));
        let (first, node_answer) = match first {
            Event::NodeAnswered(answer) => (First::Answered, answer),
            Event::CheckoutWaits => loop {
                if let Event::NodeAnswered(answer) = seen.recv().expect("the node's answer") {
                    break (First::Waited, answer);
                }
            },
        };
        node.join().expect("one-node query thread");
        let mut sizes_after = Vec::new();
        storage.state_sizes(&mut sizes_after);
        Run {
            first,
            sizes_while_held,
            sizes_after,
            fleet,
            node: weights(node_answer),
        }
    }

    fn find<'a>(sizes: &'a [StateSize], name: &str) -> Option<&'a StateSize> {
        sizes.iter().find(|size| size.name == name)
    }

    #[test]
    fn a_one_node_query_is_answered_while_a_fleet_wide_one_holds_a_connection() {
        let options = SqliteOptions::default();
        let page_cache_bytes = options.page_cache_kib as usize * 1024;
        let readers = options.readers;
        let run = one_node_query_during_fleet_wide_query(options);
        assert_eq!(
            run.first,
            First::Answered,
            "the one-node query waited for the fleet-wide one's connection"
        );
        assert_eq!(run.node, [("a".to_string(), 3)]);
        assert_eq!(run.fleet, [("a".to_string(), 3), ("b".to_string(), 5)]);

        // A connection in use cannot be measured: no partial sum while the
        // fleet-wide query holds one; all of them once both are done.
        assert!(find(&run.sizes_while_held, "reader_page_cache").is_none());
        let page_caches = find(&run.sizes_after, "reader_page_cache").expect("measured");
        assert!(page_caches.bytes > Some(0), "{page_caches:?}");
        assert_eq!(page_caches.max_bytes, Some(readers * page_cache_bytes));
        // The frame caches are shared, and measured whatever runs.
        let stacks = find(&run.sizes_while_held, "query_stacks").expect("shared");
        assert_eq!(stacks.entries, Some(1), "the one-node query's stack");
        let stacks = find(&run.sizes_after, "query_stacks").expect("shared");
        assert_eq!(stacks.entries, Some(2));
    }

    /// The check above tells a pool from a single connection: with one,
    /// the one-node query waits until the fleet-wide one is done.
    #[test]
    fn with_one_reader_a_one_node_query_waits_for_the_fleet_wide_one() {
        let run = one_node_query_during_fleet_wide_query(SqliteOptions {
            readers: 1,
            ..SqliteOptions::default()
        });
        assert_eq!(run.first, First::Waited);
        assert_eq!(run.node, [("a".to_string(), 3)]);
        assert_eq!(run.fleet, [("a".to_string(), 3), ("b".to_string(), 5)]);
    }

    #[test]
    fn no_readers_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let options = SqliteOptions {
            readers: 0,
            ..SqliteOptions::default()
        };
        let err = SqliteStorage::open(&dir.path().join("stackscope.db"), options)
            .expect_err("no readers");
        assert!(matches!(err, StorageError::InvalidOptions(_)), "{err:?}");
    }

    #[test]
    fn corrupt_location_blobs_are_errors() {
        assert_eq!(decode_ids(&[]), Err("no locations"));
        // u64::MAX does not fit an id.
        let mut buf = Vec::new();
        crate::storage::codec::put_varint(&mut buf, u64::MAX);
        assert_eq!(decode_ids(&buf), Err("id overflows i64"));
    }
}
