//! Rollups: sums of closed spans of time at coarser widths, so a query
//! over an hour or a day reads the sums of each span, or of each (span,
//! label set), instead of each (bucket, label set). A hundred nodes that
//! run the same services send the same stacks: an hour of them is 12M
//! samples but 20k distinct stacks, and 200k distinct (label set, stack)
//! pairs.
//!
//! Owns the rollup tables, the compactor that fills them, and the choice of
//! which spans answer a range. Rollups are a cache of `samples`, never the
//! truth: a span is used only while its marker row exists, and ingest
//! removes the markers of every span its bucket falls in (in the batch's own
//! transaction), so a late batch can never be missed by a query; the
//! compactor redoes those spans later.
//!
//! # Tables
//!
//! * `rollups(width, span_start, stacks)`: per span of `width`
//!   nanoseconds (the bucket width, then 10 min, 1 h, 1 day) the summed
//!   weight of each stack over every label set of CPU samples (the sets of
//!   other profile types, which carry the type's label, are left out), in
//!   one blob (see [`sums`]): what a fleet-wide flamegraph reads.
//! * `label_rollups(width, span_start, label_set_id, stacks)`: the same
//!   per label set, every profile type, for the widths above the bucket (at
//!   the bucket width, `samples` is that already): what a query with
//!   matchers reads, for the label sets they select.
//! * `label_rollup_sets(width, span_start, label_set_id,
//!   sample_period_nanos, weight)`: per span, each label set with samples
//!   in it, the period its buckets agreed on (0 when they did not: an
//!   agreement of agreements is the agreement of the whole) and its total
//!   weight, as `label_set_buckets` per bucket: series, label names and
//!   values, and which `label_rollups` rows to read.
//! * `rollup_spans(width, span_start, sample_period_nanos, has_cpu)`: the
//!   marker: the span's rows (in `rollups`, and above the bucket width in
//!   the two label tables) are complete and current.
//!   `has_cpu`: whether it holds CPU samples; if so, the period their
//!   buckets agreed on (0 when they did not).
//! * `pending_spans(width, span_start)`: spans whose data changed since they
//!   were last rolled up (written by ingest, cleared by the compactor).
//! * `abandoned_spans(width, span_start)`: spans the compactor could not
//!   sum (a damaged blob of sums in them, see [`abandon`]), until a write
//!   pends them again.
//!
//! Empty spans get no marker: a query reads their (absent) base rows, which
//! costs nothing.

use std::collections::{BTreeMap, HashMap, HashSet};

use rusqlite::{Connection, Transaction};
use stackscope_profile::model::{PROFILE_TYPE_LABEL, PeriodAgreement};

use super::{StackWeights, StorageError, add_capped, non_negative, saturate, sums};
use crate::storage::tiers::{Tiers, span_start};

/// The markers and pending spans (schema version 4).
pub(super) const SCHEMA: &str = "
CREATE TABLE rollup_spans (
    width INTEGER NOT NULL,
    span_start INTEGER NOT NULL,
    sample_period_nanos INTEGER NOT NULL,
    PRIMARY KEY (width, span_start)
) STRICT, WITHOUT ROWID;

CREATE TABLE pending_spans (
    width INTEGER NOT NULL,
    span_start INTEGER NOT NULL,
    PRIMARY KEY (width, span_start)
) STRICT, WITHOUT ROWID;
";

/// What schema version 6 added to [`SCHEMA`] (a new database gets both).
pub(super) const LABEL_SCHEMA: &str = "
ALTER TABLE rollup_spans ADD COLUMN has_cpu INTEGER NOT NULL DEFAULT 1;

CREATE TABLE label_rollup_sets (
    width INTEGER NOT NULL,
    span_start INTEGER NOT NULL,
    label_set_id INTEGER NOT NULL,
    sample_period_nanos INTEGER NOT NULL,
    weight INTEGER NOT NULL,
    PRIMARY KEY (width, span_start, label_set_id)
) STRICT, WITHOUT ROWID;
";

/// The sums, in blobs of (stack, weight) pairs (see [`sums`]) since schema
/// version 7.
pub(super) const SUMS_SCHEMA: &str = "
CREATE TABLE rollups (
    width INTEGER NOT NULL,
    span_start INTEGER NOT NULL,
    stacks BLOB NOT NULL,
    PRIMARY KEY (width, span_start)
) STRICT, WITHOUT ROWID;

CREATE TABLE label_rollups (
    width INTEGER NOT NULL,
    span_start INTEGER NOT NULL,
    label_set_id INTEGER NOT NULL,
    stacks BLOB NOT NULL,
    PRIMARY KEY (width, span_start, label_set_id)
) STRICT, WITHOUT ROWID;

CREATE TABLE abandoned_spans (
    width INTEGER NOT NULL,
    span_start INTEGER NOT NULL,
    PRIMARY KEY (width, span_start)
) STRICT, WITHOUT ROWID;
";

/// Every table a span's rows live in.
const SPAN_TABLES: [&str; 6] = [
    "rollups",
    "label_rollups",
    "label_rollup_sets",
    "rollup_spans",
    "pending_spans",
    "abandoned_spans",
];

/// Ingest, in the batch's transaction: `bucket` changes, so every span
/// holding it is no longer current; queries stop using them now and the
/// compactor redoes them.
pub(super) fn invalidate(tx: &Connection, tiers: &Tiers, bucket: i64) -> Result<(), StorageError> {
    let mut unmark =
        tx.prepare_cached("DELETE FROM rollup_spans WHERE width = ?1 AND span_start = ?2")?;
    for &width in tiers.widths() {
        let start = span_start(bucket, width);
        unmark.execute((width, start))?;
        pend(tx, width, start)?;
    }
    Ok(())
}

/// Retention, in its transaction, after every bucket up to `last` was
/// deleted: spans starting at or before `last` lose their rollups, and the
/// spans that also hold later buckets are redone from what is left of them.
/// They must be: a coarser span is summed from the spans one width finer
/// only, so a cut 10 minutes without a marker would leave its later buckets
/// out of its hour the next time a late batch makes the hour be redone.
/// (Retention runs every few minutes; redoing the day span each time costs
/// one sum over its hours.)
pub(super) fn forget_through(
    tx: &Transaction<'_>,
    tiers: &Tiers,
    last: i64,
) -> Result<(), StorageError> {
    for table in SPAN_TABLES {
        // Per width, so each delete is a range of the primary key.
        let mut delete = tx.prepare_cached(&format!(
            "DELETE FROM {table} WHERE width = ?1 AND span_start <= ?2"
        ))?;
        for &width in tiers.widths() {
            delete.execute((width, last))?;
        }
    }
    for &width in tiers.widths() {
        let start = span_start(last, width);
        if start.saturating_add(width - tiers.bucket()) > last {
            pend(tx, width, start)?;
        }
    }
    Ok(())
}

/// Marks the span for the compactor to redo.
fn pend(tx: &Connection, width: i64, start: i64) -> Result<(), StorageError> {
    tx.prepare_cached("INSERT OR IGNORE INTO pending_spans (width, span_start) VALUES (?1, ?2)")?
        .execute((width, start))?;
    Ok(())
}

/// The pending span the compactor should do next: the finest first, so a
/// coarser span is always summed from finer spans that are current (every
/// write pends all the spans around its bucket, and a span inside a closed
/// one is closed too). One seek per width: spans still open are never read.
pub(super) fn next_pending(
    tx: &Transaction<'_>,
    tiers: &Tiers,
    closed_before: i64,
) -> Result<Option<(i64, i64)>, StorageError> {
    let mut stmt = tx.prepare_cached(
        "SELECT span_start FROM pending_spans WHERE width = ?1 AND span_start <= ?2 - ?1
         ORDER BY span_start LIMIT 1",
    )?;
    for &width in tiers.widths() {
        let mut rows = stmt.query((width, closed_before))?;
        if let Some(row) = rows.next()? {
            return Ok(Some((width, row.get(0)?)));
        }
    }
    Ok(None)
}

/// Sums the span `(width, start)` afresh and marks it current: from the
/// base rows for the bucket width and the width above it, from the label
/// rollups one width finer above that. Returns the (stack, weight) pairs
/// written.
pub(super) fn recompute(
    tx: &Transaction<'_>,
    tiers: &Tiers,
    width: i64,
    start: i64,
) -> Result<u64, StorageError> {
    for table in SPAN_TABLES {
        tx.prepare_cached(&format!(
            "DELETE FROM {table} WHERE width = ?1 AND span_start = ?2"
        ))?
        .execute((width, start))?;
    }
    let end = start.saturating_add(width);
    if let Some(finer) = tiers.finer(width).filter(|&finer| finer != tiers.bucket()) {
        // Summed from the finer spans, every one of which must be there.
        let abandoned = tx
            .prepare_cached(
                "SELECT 1 FROM abandoned_spans WHERE width = ?1 AND span_start >= ?2
                 AND span_start < ?3",
            )?
            .exists((finer, start, end))?;
        if abandoned {
            return Err(StorageError::Corrupt(
                "a finer span inside it could not be summed".into(),
            ));
        }
    }
    let (sets_sql, stacks_sql, params) = match tiers.finer(width) {
        Some(finer) if finer != tiers.bucket() => (
            "SELECT label_set_id, sample_period_nanos, weight FROM label_rollup_sets
             WHERE width = ?3 AND span_start >= ?1 AND span_start < ?2",
            "SELECT label_set_id, stacks FROM label_rollups
             WHERE width = ?3 AND span_start >= ?1 AND span_start < ?2",
            vec![start, end, finer],
        ),
        _ => (
            "SELECT label_set_id, sample_period_nanos, weight FROM label_set_buckets
             WHERE bucket_start >= ?1 AND bucket_start < ?2",
            "SELECT label_set_id, stacks FROM samples
             WHERE bucket_start >= ?1 AND bucket_start < ?2",
            vec![start, end],
        ),
    };
    let params = rusqlite::params_from_iter(params);

    // Per label set: the periods its rows agreed on, and its weight.
    let mut sets: BTreeMap<i64, (PeriodAgreement, u64)> = BTreeMap::new();
    let mut stmt = tx.prepare_cached(sets_sql)?;
    let mut rows = stmt.query(params.clone())?;
    while let Some(row) = rows.next()? {
        let (set, period, weight): (i64, i64, i64) = (row.get(0)?, row.get(1)?, row.get(2)?);
        let (agreement, sum) = sets.entry(set).or_default();
        agreement.add(u64::try_from(period).unwrap_or(0));
        *sum = add_capped(*sum, non_negative(weight, "label set weight")?);
    }
    if sets.is_empty() {
        // No data: no marker, queries read the (empty) base rows.
        return Ok(0);
    }
    // CPU samples are those of sets without a profile type's label.
    let typed = typed_label_sets(tx)?;
    let mut cpu_period: Option<PeriodAgreement> = None;
    for (set, (agreement, _)) in &sets {
        if !typed.contains(set) {
            cpu_period.get_or_insert_default().add(agreement.result());
        }
    }

    let per_set = width != tiers.bucket();
    let mut label_free = StackWeights::default();
    let mut set_stacks: HashMap<(i64, i64), u64> = HashMap::new();
    let mut stmt = tx.prepare_cached(stacks_sql)?;
    let mut rows = stmt.query(params)?;
    while let Some(row) = rows.next()? {
        let set: i64 = row.get(0)?;
        let typed = typed.contains(&set);
        sums::for_each(sums::column(row, 1)?, |stack, weight| {
            if !typed {
                label_free.add(stack, weight);
            }
            if per_set {
                let sum = set_stacks.entry((set, stack)).or_default();
                *sum = add_capped(*sum, weight);
            }
            Ok(())
        })?;
    }

    let mut blob = Vec::new();
    let label_free = label_free.into_sorted();
    let mut written = label_free.len() as u64;
    if !label_free.is_empty() {
        sums::encode(&mut blob, &label_free);
        tx.prepare_cached("INSERT INTO rollups (width, span_start, stacks) VALUES (?1, ?2, ?3)")?
            .execute((width, start, &blob[..]))?;
    }
    if per_set {
        let mut insert = tx.prepare_cached(
            "INSERT INTO label_rollup_sets
             (width, span_start, label_set_id, sample_period_nanos, weight)
             VALUES (?1, ?2, ?3, ?4, ?5)",
        )?;
        for (set, (agreement, weight)) in &sets {
            insert.execute((
                width,
                start,
                set,
                saturate(agreement.result()),
                saturate(*weight),
            ))?;
        }
        let mut set_stacks: Vec<_> = set_stacks.into_iter().collect();
        // In key order: each set's pairs in a run, ascending by stack, and
        // the sets appended to the table's b-tree in order.
        set_stacks.sort_unstable();
        written += set_stacks.len() as u64;
        let mut insert = tx.prepare_cached(
            "INSERT INTO label_rollups (width, span_start, label_set_id, stacks)
             VALUES (?1, ?2, ?3, ?4)",
        )?;
        let mut pairs = Vec::new();
        for run in set_stacks.chunk_by(|a, b| a.0.0 == b.0.0) {
            pairs.clear();
            pairs.extend(run.iter().map(|&((_, stack), weight)| (stack, weight)));
            blob.clear();
            sums::encode(&mut blob, &pairs);
            insert.execute((width, start, run[0].0.0, &blob[..]))?;
        }
    }
    tx.prepare_cached(
        "INSERT INTO rollup_spans (width, span_start, sample_period_nanos, has_cpu)
         VALUES (?1, ?2, ?3, ?4)",
    )?
    .execute((
        width,
        start,
        saturate(cpu_period.map_or(0, |p| p.result())),
        cpu_period.is_some(),
    ))?;
    Ok(written)
}

/// The compactor, after `recompute` of `(width, start)` found data it
/// cannot read (in its own transaction, the failed one rolled back): the
/// span is left without rows or marker and off the pending list, so the
/// compaction of every other span goes on and queries read its finer spans
/// and buckets (failing only where they read the damage). Marked
/// abandoned, so no coarser span is summed without it; a write into it
/// pends it again, and retention forgets it with its buckets.
pub(super) fn abandon(tx: &Transaction<'_>, width: i64, start: i64) -> Result<(), StorageError> {
    for table in SPAN_TABLES {
        tx.prepare_cached(&format!(
            "DELETE FROM {table} WHERE width = ?1 AND span_start = ?2"
        ))?
        .execute((width, start))?;
    }
    tx.prepare_cached("INSERT INTO abandoned_spans (width, span_start) VALUES (?1, ?2)")?
        .execute((width, start))?;
    Ok(())
}

/// The label sets of profile types other than CPU (with the type's label).
fn typed_label_sets(tx: &Transaction<'_>) -> Result<HashSet<i64>, StorageError> {
    let mut stmt = tx.prepare_cached("SELECT label_set_id FROM labels WHERE name = ?1")?;
    let ids = stmt
        .query_map([PROFILE_TYPE_LABEL], |row| row.get(0))?
        .collect::<Result<_, _>>()?;
    Ok(ids)
}

/// A current span a query reads instead of its buckets' rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Span {
    pub width: i64,
    pub start: i64,
    /// The period the span's CPU samples agree on (0 when they do not).
    pub sample_period_nanos: i64,
    /// Whether it holds CPU samples (else only other profile types').
    pub has_cpu: bool,
}

/// How a range of buckets is read: whole current spans (by start), and the
/// buckets between them from the base tables.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Cover {
    pub spans: Vec<Span>,
    /// Runs of buckets no span covers, as exclusive bounds `(lo, hi)`: the
    /// buckets `b` with `lo < b < hi`.
    pub gaps: Vec<(i64, i64)>,
}

/// The cover of the buckets `b` with `lo < b < hi` (the bounds
/// `SqliteStorage::bucket_bounds` gives) by current spans of the given
/// widths (some of `tiers`', finest first).
pub(super) fn cover(
    tx: &Transaction<'_>,
    tiers: &Tiers,
    widths: &[i64],
    lo: i64,
    hi: i64,
) -> Result<Cover, StorageError> {
    let bucket = tiers.bucket();
    // The first bucket after lo and the end of the last one before hi.
    let first = span_start(lo, bucket).saturating_add(bucket);
    let end = span_start(hi.saturating_sub(1), bucket).saturating_add(bucket);
    let mut cover = Cover::default();
    if first >= end {
        return Ok(cover);
    }
    // Chosen spans by start: (end, span). Spans nest (each width is a
    // multiple of the one below, aligned to it), so a span either lies
    // inside a chosen coarser one or misses all of them.
    let mut chosen: BTreeMap<i64, (i64, Span)> = BTreeMap::new();
    let mut stmt = tx.prepare_cached(
        "SELECT span_start, sample_period_nanos, has_cpu FROM rollup_spans
         WHERE width = ?1 AND span_start >= ?2 AND span_start <= ?3 - ?1
         ORDER BY span_start",
    )?;
    for &width in widths.iter().rev() {
        let mut rows = stmt.query((width, first, end))?;
        while let Some(row) = rows.next()? {
            let (start, sample_period_nanos, has_cpu): (i64, i64, bool) =
                (row.get(0)?, row.get(1)?, row.get(2)?);
            let inside = chosen
                .range(..=start)
                .next_back()
                .is_some_and(|(_, (chosen_end, _))| *chosen_end > start);
            if !inside {
                let span = Span {
                    width,
                    start,
                    sample_period_nanos,
                    has_cpu,
                };
                chosen.insert(start, (start.saturating_add(width), span));
            }
        }
    }
    let mut next = first;
    for (start, (span_end, span)) in chosen {
        if start > next {
            cover.gaps.push((next - 1, start));
        }
        cover.spans.push(span);
        next = span_end;
    }
    if next < end {
        cover.gaps.push((next - 1, end));
    }
    Ok(cover)
}
