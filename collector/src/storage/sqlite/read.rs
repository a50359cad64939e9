//! The SQLite engine's query side: the reader connection, its caches
//! (every stored label set, the frames of locations and stacks), and the
//! queries. In WAL mode it reads a consistent snapshot while the writer
//! commits. Owns no schema (`schema`) and no writes (`write`); the rollups
//! it reads are `rollup`'s.
//!
//! Matchers are evaluated in Rust over an in-memory copy of the label sets
//! (they are few; regexes and absent labels do not map onto an index), so
//! `labels` needs no `(name, value)` index that would only slow ingest.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    sync::{Arc, MutexGuard, atomic::Ordering},
};

use rusqlite::{Connection, OptionalExtension as _, Transaction};
use stackscope_profile::model::{Frame, PeriodAgreement, Selection, StackSamples, WeightedStack};
use stackscope_telemetry::StateSize;

use super::{
    SqliteStorage, StackWeights, StorageError, add_capped, non_negative, page_cache_used, rollup,
};
use crate::{
    ingest::MappingRecord,
    storage::{
        codec::{BlobReader, decode_code_segments, decode_lines, kind_from_code, resolve_frames},
        series_point,
    },
};

/// The query connection and the caches of what it read.
pub(super) struct Reader {
    conn: Connection,
    /// The `SqliteStorage::generation` the caches belong to.
    generation: u64,
    caches: ReadCaches,
}

impl Reader {
    pub(super) fn new(conn: Connection, frame_cache_entries: usize) -> Self {
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

    /// The reader's page cache and query caches against their bounds.
    pub(super) fn state_sizes(&self, out: &mut Vec<StateSize>, page_cache_bytes: usize) {
        out.push(StateSize::bytes(
            "reader_page_cache",
            page_cache_used(&self.conn),
            Some(page_cache_bytes),
        ));
        let caches = &self.caches;
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

impl SqliteStorage {
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

    pub(super) fn query_stacks(&self, selection: &Selection) -> Result<StackSamples, StorageError> {
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

    pub(super) fn query_label_names(
        &self,
        selection: &Selection,
    ) -> Result<Vec<String>, StorageError> {
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

    pub(super) fn query_label_values(
        &self,
        selection: &Selection,
        name: &str,
    ) -> Result<Vec<String>, StorageError> {
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
    pub(super) fn query_series(
        &self,
        selection: &Selection,
        step_nanos: i64,
    ) -> Result<Vec<(i64, u64)>, StorageError> {
        self.read(|caches, tx| {
            let selected = caches.label_sets.select(selection);
            let mut points: BTreeMap<i64, u64> = BTreeMap::new();
            self.for_each_label_set_bucket(tx, selection, &selected, |bucket, _, _, weight| {
                let point = series_point(bucket, step_nanos, self.bucket_nanos);
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
mod tests {
    use super::*;

    #[test]
    fn corrupt_location_blobs_are_errors() {
        assert_eq!(decode_ids(&[]), Err("no locations"));
        // u64::MAX does not fit an id.
        let mut buf = Vec::new();
        crate::storage::codec::put_varint(&mut buf, u64::MAX);
        assert_eq!(decode_ids(&buf), Err("id overflows i64"));
    }
}
