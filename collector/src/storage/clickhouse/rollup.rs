//! Rollups in ClickHouse: sums of closed spans of time (the bucket width,
//! 10 min, 1 h, 1 day: `tiers`), per label set and stack, so a query over an
//! hour reads a few hundred thousand rows however many batches sent them,
//! not the tens of millions of per-batch sample rows. Owns the rollup tables'
//! rows, the compactor that builds them, and the choice of which spans answer
//! a range.
//!
//! # A cache, never the truth, without writes at ingest
//!
//! Collectors are stateless and many; ingest cannot afford to invalidate a
//! span (a mutation in ClickHouse). Instead a span's rollup is valid while
//! nothing was stored in it since it was built, which `attempts` tells: every
//! try at storing a batch's samples registers (batch, bucket) before its
//! rows, and that table only grows (retention aside, which drops spans with
//! it). A build records the span's tries (their number and a checksum) in its
//! marker; a query uses a build only while the span's tries are still those.
//! A late batch, a retry, a duplicate: each adds a try, so the span is read
//! from its base rows until the compactor builds it again.
//!
//! A build is made only when no try in the span may still be storing rows (a
//! try without its batch id, registered less than `in_flight_nanos` ago):
//! rows landing after the sum would be missed while the tries stay the same.
//! A try older than that without its id is over: it failed, or stored its
//! rows and its id was lost (written behind ingest: a collector that died
//! with it queued, servers that kept refusing it). Its rows, if any, count
//! as base reads count them; a retry registers a try of its own, and so
//! does a resend to another server. Collectors of schema version 2 register
//! tries without a time: stop them before a version-3 collector starts.
//!
//! # Tables (each `MergeTree`, partitioned by `span_start` like the samples)
//!
//! * `rollups(width, span_start, build, label_set, stack, sample_period,
//!   weight0..2)`: a build's sums per label set, stack and period, the weight
//!   in the three 21-bit parts reads sum (exact, whatever the totals), plus
//!   the sums over every CPU label set under [`EVERY_CPU`], which fleet-wide
//!   queries read.
//! * `rollup_sets(...)`: the same per label set and period alone: which sets
//!   a span holds (matchers, label names and values) and series.
//! * `rollup_spans(width, span_start, build, tries, tries_checksum,
//!   built_unix_nanos)`: the marker, written after the build's rows.
//!
//! Two collectors may build the same span at once: each build has its own
//! id, and a query reads one. A build made obsolete by a late batch stays on
//! disk, unread, until retention drops its partition.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::atomic::{AtomicU64, Ordering},
    time::SystemTime,
};

use stackscope_profile::model::{PROFILE_TYPE_LABEL, unix_nanos};

use super::{ClickhouseStorage, ROW_COPY_KEY, WEIGHT_PARTS, hash_list};
use crate::storage::{StorageError, tiers::span_start};

/// The label set of the rows that sum every CPU label set of a span (the
/// sets of other profile types, which carry the type's label, left out).
/// No stored set has it for id: that would take 96 bits of its content's
/// xxh3 and 32 of its node's all zero (see `clustered_label_set_id`).
pub(super) const EVERY_CPU: u128 = 0;

/// How long a try without its batch id may still be storing its samples, at
/// least: its samples go in one statement after it (and after the id lookup
/// begun before it), each taking at most `request_timeout` (see
/// `in_flight_nanos`). Measured
/// on the collectors' clocks, which must agree to within a few minutes.
const MIN_IN_FLIGHT_NANOS: i64 = 10 * 60 * 1_000_000_000;

/// Spans built per `compact` call: each is a few statements.
const SPANS_PER_CALL: u64 = 32;

/// Most spans a query reads rollups of: each is named in its statements.
/// Finer ones give way to base rows first.
const MAX_COVER_SPANS: usize = 2_000;

/// The tries registered in some buckets: how many, and the wrapping sum of
/// a hash of each (batch, bucket).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Tries {
    count: u64,
    checksum: u64,
}

impl Tries {
    fn add(&mut self, other: Tries) {
        self.count = self.count.saturating_add(other.count);
        self.checksum = self.checksum.wrapping_add(other.checksum);
    }

    /// The tries of the buckets `b` with `start <= b < end`.
    fn within(per_bucket: &BTreeMap<i64, Tries>, start: i64, end: i64) -> Tries {
        let mut sum = Tries::default();
        for tries in per_bucket.range(start..end).map(|(_, t)| t) {
            sum.add(*tries);
        }
        sum
    }
}

/// A span whose rollup a query reads: one build of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Span {
    pub width: i64,
    pub start: i64,
    pub build: u128,
}

/// How a range of buckets is read: current spans, and the buckets between
/// them from the sample rows.
#[derive(Debug, Default)]
pub(super) struct Cover {
    pub spans: Vec<Span>,
    /// Runs of buckets no span covers, as exclusive bounds `(lo, hi)`.
    pub gaps: Vec<(i64, i64)>,
    /// The retention mark the range was bounded by (see
    /// `summed_sample_rows`).
    pub retention_mark: i64,
}

impl Cover {
    /// The condition on rollup rows of the spans; `None` without spans.
    pub(super) fn spans_condition(&self) -> Option<String> {
        if self.spans.is_empty() {
            return None;
        }
        let list = |values: BTreeSet<i64>| {
            let values: Vec<String> = values.iter().map(i64::to_string).collect();
            values.join(",")
        };
        // Build ids are unique: widths and starts only let the key's index
        // skip to them.
        Some(format!(
            "width IN ({}) AND span_start IN ({}) AND build IN ({})",
            list(self.spans.iter().map(|span| span.width).collect()),
            list(self.spans.iter().map(|span| span.start).collect()),
            hash_list(self.spans.iter().map(|span| span.build))
        ))
    }

    /// The condition on sample rows of the gaps; `None` without gaps.
    pub(super) fn gaps_condition(&self) -> Option<String> {
        if self.gaps.is_empty() {
            return None;
        }
        let gaps: Vec<String> = self
            .gaps
            .iter()
            .map(|(lo, hi)| format!("(bucket > {lo} AND bucket < {hi})"))
            .collect();
        Some(format!("({})", gaps.join(" OR ")))
    }
}

/// Where a build sums from.
enum Source {
    /// The sample rows of the span's buckets.
    Samples,
    /// The current builds of the spans one width finer.
    Finer { width: i64, spans: Vec<(i64, u128)> },
}

/// A build id no other build has: the time, this process, a counter.
fn new_build_id(width: i64, start: i64) -> u128 {
    static BUILDS: AtomicU64 = AtomicU64::new(0);
    let mut seed = Vec::with_capacity(40);
    seed.extend_from_slice(&unix_nanos(SystemTime::now()).to_le_bytes());
    seed.extend_from_slice(&std::process::id().to_le_bytes());
    seed.extend_from_slice(&BUILDS.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    seed.extend_from_slice(&width.to_le_bytes());
    seed.extend_from_slice(&start.to_le_bytes());
    match xxhash_rust::xxh3::xxh3_128(&seed) {
        EVERY_CPU => 1,
        id => id,
    }
}

impl ClickhouseStorage {
    /// The tries registered per bucket `b` with `lo < b < hi`.
    fn tries_per_bucket(&self, lo: i64, hi: i64) -> Result<BTreeMap<i64, Tries>, StorageError> {
        let sql = format!(
            "SELECT bucket, count(), sum(sipHash64(batch, bucket)) FROM {} \
             WHERE bucket > {lo} AND bucket < {hi} GROUP BY bucket FORMAT RowBinary",
            self.tables.table("attempts")
        );
        let rows = self.select("counting tries", &sql, |r| {
            Ok((
                r.i64()?,
                Tries {
                    count: r.u64()?,
                    checksum: r.u64()?,
                },
            ))
        })?;
        Ok(rows.into_iter().collect())
    }

    /// The markers of the builds of spans starting at `s` with
    /// `lo < s < hi`: (width, start, build, the tries it summed).
    fn build_markers(
        &self,
        lo: i64,
        hi: i64,
    ) -> Result<Vec<(i64, i64, u128, Tries)>, StorageError> {
        let sql = format!(
            "SELECT width, span_start, build, tries, tries_checksum FROM {} \
             WHERE span_start > {lo} AND span_start < {hi} FORMAT RowBinary",
            self.tables.table("rollup_spans")
        );
        self.select("reading rollup markers", &sql, |r| {
            Ok((
                r.i64()?,
                r.i64()?,
                r.hash()?,
                Tries {
                    count: r.u64()?,
                    checksum: r.u64()?,
                },
            ))
        })
    }

    /// The current build of every span of `markers` ending by `hi` whose
    /// tries are all in `tries`: a build whose recorded tries are those
    /// (the smallest id when several are).
    fn current_builds(
        &self,
        hi: i64,
        tries: &BTreeMap<i64, Tries>,
        markers: Vec<(i64, i64, u128, Tries)>,
    ) -> BTreeMap<(i64, i64), u128> {
        let mut current: BTreeMap<(i64, i64), u128> = BTreeMap::new();
        for (width, start, build, recorded) in markers {
            let Some(end) = start
                .checked_add(width)
                .filter(|&end| width > 0 && end <= hi)
            else {
                continue;
            };
            if recorded.count > 0
                && self.tiers.widths().contains(&width)
                && Tries::within(tries, start, end) == recorded
            {
                current
                    .entry((width, start))
                    .and_modify(|kept| *kept = (*kept).min(build))
                    .or_insert(build);
            }
        }
        current
    }

    /// The cover of the buckets `b` with `lo < b < hi` by current spans of
    /// the given widths (some of the tiers', finest first).
    pub(super) fn cover(&self, lo: i64, hi: i64, widths: &[i64]) -> Result<Cover, StorageError> {
        let bucket = self.tiers.bucket();
        // The first bucket after lo and the end of the last one before hi.
        let first = span_start(lo, bucket).saturating_add(bucket);
        let end = span_start(hi.saturating_sub(1), bucket).saturating_add(bucket);
        if first >= end {
            return Ok(Cover::default());
        }
        let mut chosen: BTreeMap<i64, Span> = BTreeMap::new();
        if !widths.is_empty() {
            let (tries, markers) = super::both(
                || self.tries_per_bucket(first - 1, end),
                || self.build_markers(first - 1, end),
            );
            let current = self.current_builds(end, &tries?, markers?);
            // Coarsest first; spans nest, so one either lies inside a
            // chosen coarser span or misses them all.
            for &width in widths.iter().rev() {
                for (&(_, start), &build) in current.range((width, first)..(width, end)) {
                    let inside = chosen
                        .range(..=start)
                        .next_back()
                        .is_some_and(|(_, span)| span.start + span.width > start);
                    if !inside {
                        chosen.insert(
                            start,
                            Span {
                                width,
                                start,
                                build,
                            },
                        );
                    }
                }
            }
            // Too many spans to name: the finest give way to base rows.
            for &width in widths {
                if chosen.len() <= MAX_COVER_SPANS {
                    break;
                }
                chosen.retain(|_, span| span.width != width);
            }
        }
        let mut cover = Cover::default();
        let mut next = first;
        for (start, span) in chosen {
            if start > next {
                cover.gaps.push((next - 1, start));
            }
            next = start + span.width;
            cover.spans.push(span);
        }
        if next < end {
            cover.gaps.push((next - 1, end));
        }
        Ok(cover)
    }

    /// Builds rollups of closed spans (ending at or before `closed_before`)
    /// that have none current, finest first, at most [`SPANS_PER_CALL`];
    /// returns how many it built (0 also while the spans left wait for
    /// tries in flight: the next call, a compaction interval later, sees
    /// them again).
    pub(super) fn roll_up(&self, closed_before: i64) -> Result<u64, StorageError> {
        let widths = self.tiers.widths();
        let lo = self.retention_mark()?;
        if lo >= closed_before {
            return Ok(0);
        }
        let (tries, markers) = super::both(
            || self.tries_per_bucket(lo, closed_before),
            || self.build_markers(lo, closed_before),
        );
        let tries = tries?;
        let mut current = self.current_builds(closed_before, &tries, markers?);
        let mut built = 0;
        for (i, &width) in widths.iter().enumerate() {
            let starts: BTreeSet<i64> = tries
                .keys()
                .map(|&bucket| span_start(bucket, width))
                .filter(|&start| start > lo && start.saturating_add(width) <= closed_before)
                .collect();
            for start in starts {
                if current.contains_key(&(width, start)) {
                    continue;
                }
                if built >= SPANS_PER_CALL {
                    return Ok(built);
                }
                let end = start + width;
                let source = match i.checked_sub(1).map(|finer| widths[finer]) {
                    None => Source::Samples,
                    Some(finer) => {
                        // Every finer span with tries must be current.
                        let mut spans = Vec::new();
                        let mut ready = true;
                        for sub in (start..end).step_by(finer as usize) {
                            if Tries::within(&tries, sub, sub + finer).count == 0 {
                                continue;
                            }
                            match current.get(&(finer, sub)) {
                                Some(&build) => spans.push((sub, build)),
                                None => ready = false,
                            }
                        }
                        if !ready {
                            continue;
                        }
                        Source::Finer {
                            width: finer,
                            spans,
                        }
                    }
                };
                let expected = Tries::within(&tries, start, end);
                if let Some(build) = self.build(width, start, expected, &source)? {
                    current.insert((width, start), build);
                    built += 1;
                }
            }
        }
        Ok(built)
    }

    /// The tries of the buckets `b` with `start <= b < end`, read now.
    fn tries_now(&self, start: i64, end: i64) -> Result<Tries, StorageError> {
        Ok(Tries::within(
            &self.tries_per_bucket(start - 1, end)?,
            start,
            end,
        ))
    }

    /// How long a try may still be storing its samples: four request
    /// timeouts, at least [`MIN_IN_FLIGHT_NANOS`].
    fn in_flight_nanos(&self) -> i64 {
        let timeouts = self.options.request_timeout.saturating_mul(4).as_nanos();
        i64::try_from(timeouts)
            .unwrap_or(i64::MAX)
            .max(MIN_IN_FLIGHT_NANOS)
    }

    /// Whether a try in the buckets `b` with `start <= b < end` may still
    /// be storing its samples: it has no batch id, and was registered less
    /// than `in_flight_nanos` ago.
    fn try_in_flight(&self, start: i64, end: i64) -> Result<bool, StorageError> {
        let recent = unix_nanos(SystemTime::now()).saturating_sub(self.in_flight_nanos());
        let sql = format!(
            "SELECT DISTINCT batch FROM {} \
             WHERE bucket >= {start} AND bucket < {end} AND at_unix_nanos > {recent} \
             FORMAT RowBinary",
            self.tables.table("attempts")
        );
        let tried: Vec<u128> = self.select("finding recent tries", &sql, |r| r.hash())?;
        for chunk in tried.chunks(self.options.stack_fetch_chunk.max(1)) {
            let sql = format!(
                "SELECT count(DISTINCT batch) FROM {} WHERE batch IN ({}) FORMAT RowBinary",
                self.tables.table("batches"),
                hash_list(chunk.iter().copied())
            );
            let stored = self.select("finding stored batches", &sql, |r| r.u64())?;
            if stored.first().copied().unwrap_or(0) < chunk.len() as u64 {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Builds the rollup of the span `(width, start)` whose tries were
    /// `expected`; `None` when it cannot be built now (a try in flight, or
    /// the tries changed: the next call sees the new ones).
    fn build(
        &self,
        width: i64,
        start: i64,
        expected: Tries,
        source: &Source,
    ) -> Result<Option<u128>, StorageError> {
        let end = start + width;
        if matches!(source, Source::Samples) && self.try_in_flight(start, end)? {
            return Ok(None);
        }
        if self.tries_now(start, end)? != expected {
            return Ok(None);
        }
        let build = new_build_id(width, start);
        let (rollups, samples) = (self.tables.table("rollups"), self.tables.table("samples"));
        let this = format!(
            "width = {width} AND span_start = {start} AND build IN ({})",
            hash_list([build])
        );
        let head = format!(
            "INSERT INTO {rollups} (width, span_start, build, label_set, stack, sample_period, \
             weight0, weight1, weight2) SELECT {width}, {start}, {}",
            hash_list([build])
        );
        let action = "building a rollup";
        match source {
            Source::Samples => {
                let buckets = format!("bucket >= {start} AND bucket < {end}");
                let retried = self.retried_batches_query(&buckets);
                // A retried batch's copies are the same rows: one of each
                // (`UNION ALL` matches columns by position).
                self.execute_once(
                    action,
                    &format!(
                        "{head}, label_set, stack, sample_period, {WEIGHT_PARTS} FROM \
                         (SELECT label_set, stack, sample_period, weight FROM {samples} \
                         WHERE {buckets} AND batch GLOBAL NOT IN ({retried}) \
                         UNION ALL \
                         SELECT any(label_set) AS copied_set, stack, sample_period, \
                         any(weight) AS weight \
                         FROM {samples} WHERE {buckets} AND batch GLOBAL IN ({retried}) \
                         GROUP BY {ROW_COPY_KEY}) \
                         GROUP BY label_set, stack, sample_period"
                    ),
                )?;
                self.execute_once(
                    action,
                    &format!(
                        "{head}, {every}, stack, sample_period, sum(weight0), sum(weight1), \
                         sum(weight2) FROM {rollups} WHERE {this} AND label_set GLOBAL NOT IN \
                         (SELECT label_set FROM {sets} WHERE has(label_names, \
                         '{PROFILE_TYPE_LABEL}')) GROUP BY stack, sample_period",
                        every = hash_list([EVERY_CPU]),
                        sets = self.tables.table("label_sets"),
                    ),
                )?;
            }
            Source::Finer {
                width: finer,
                spans,
            } => {
                let starts: Vec<String> = spans.iter().map(|(s, _)| s.to_string()).collect();
                self.execute_once(
                    action,
                    &format!(
                        "{head}, label_set, stack, sample_period, sum(weight0), sum(weight1), \
                         sum(weight2) FROM {rollups} WHERE width = {finer} \
                         AND span_start IN ({}) AND build IN ({}) \
                         GROUP BY label_set, stack, sample_period",
                        starts.join(","),
                        hash_list(spans.iter().map(|(_, build)| *build))
                    ),
                )?;
            }
        }
        self.execute_once(
            action,
            &format!(
                "INSERT INTO {} (width, span_start, build, label_set, sample_period, weight0, \
                 weight1, weight2) SELECT {width}, {start}, {}, label_set, sample_period, \
                 sum(weight0), sum(weight1), sum(weight2) FROM {rollups} WHERE {this} \
                 GROUP BY label_set, sample_period",
                self.tables.table("rollup_sets"),
                hash_list([build])
            ),
        )?;
        // Nothing stored in the span meanwhile: the sums are its truth.
        if self.tries_now(start, end)? != expected {
            return Ok(None);
        }
        let mut marker = super::codec::RowWriter::default();
        marker.i64(width);
        marker.i64(start);
        marker.hash(build);
        marker.u64(expected.count);
        marker.u64(expected.checksum);
        marker.i64(unix_nanos(SystemTime::now()));
        self.insert(
            "marking a rollup",
            "rollup_spans",
            "width, span_start, build, tries, tries_checksum, built_unix_nanos",
            marker,
        )?;
        Ok(Some(build))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tries_add_up_per_range() {
        let per_bucket: BTreeMap<i64, Tries> = [
            (
                0,
                Tries {
                    count: 1,
                    checksum: u64::MAX,
                },
            ),
            (
                60,
                Tries {
                    count: 2,
                    checksum: 3,
                },
            ),
            (
                120,
                Tries {
                    count: 4,
                    checksum: 5,
                },
            ),
        ]
        .into_iter()
        .collect();
        assert_eq!(
            Tries::within(&per_bucket, 0, 120),
            Tries {
                count: 3,
                checksum: 2
            },
            "the checksum wraps"
        );
        assert_eq!(Tries::within(&per_bucket, 61, 120), Tries::default());
        assert_eq!(Tries::within(&per_bucket, 120, 121).count, 4);
    }

    #[test]
    fn build_ids_differ_and_are_never_the_every_cpu_set() {
        let a = new_build_id(60, 0);
        let b = new_build_id(60, 0);
        assert_ne!(a, b);
        assert_ne!(a, EVERY_CPU);
    }

    #[test]
    fn conditions_name_spans_and_gaps() {
        let cover = Cover {
            spans: vec![
                Span {
                    width: 600,
                    start: 0,
                    build: 7,
                },
                Span {
                    width: 60,
                    start: 600,
                    build: 9,
                },
            ],
            gaps: vec![(-1, 0), (659, 720)],
            ..Cover::default()
        };
        let spans = cover.spans_condition().expect("spans");
        assert!(
            spans
                .starts_with("width IN (60,600) AND span_start IN (0,600) AND build IN (unhex('07"),
            "{spans}"
        );
        assert_eq!(
            cover.gaps_condition().as_deref(),
            Some("((bucket > -1 AND bucket < 0) OR (bucket > 659 AND bucket < 720))")
        );
        assert_eq!(Cover::default().spans_condition(), None);
        assert_eq!(Cover::default().gaps_condition(), None);
    }
}
