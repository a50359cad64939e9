//! Where batches go: a trait so fleets can swap the embedded default
//! (`sqlite`) for a distributed engine (`clickhouse`) without touching
//! ingest or queries.
//!
//! Implementations are synchronous; the servers call them from blocking
//! tasks. What both engines must agree on lives here: the content hashes
//! that name stored items (`hash`) and the encodings of what they store
//! (`codec`).

pub mod clickhouse;
mod codec;
mod hash;
pub mod sqlite;
pub(crate) mod tiers;

use stackscope_profile::model::{ProfileType, Selection, StackSamples};

use stackscope_telemetry::StateSize;

use crate::ingest::ValidBatch;

/// What storing a batch did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IngestOutcome {
    /// Committed durably; this many sample rows were added.
    Stored { samples: u64 },
    /// A batch with the same id was stored before; nothing changed.
    Duplicate,
}

/// A failure of the storage engine itself (not of the caller's input).
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    #[error("opening the database at {path}")]
    Open {
        path: std::path::PathBuf,
        #[source]
        source: rusqlite::Error,
    },
    #[error("the database failed")]
    Database(#[from] rusqlite::Error),
    #[error("the database holds inconsistent data: {0}")]
    Corrupt(String),
    /// The directory the database lives in could not be created.
    #[error("creating the database directory {path}")]
    CreateDir {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The database was written by a newer collector, or with settings this
    /// one cannot honour (such as another bucket width).
    #[error("the database at {path} cannot be used: {reason}")]
    Incompatible {
        path: std::path::PathBuf,
        reason: String,
    },
    /// The engine was configured with values it cannot work with.
    #[error("invalid storage options: {0}")]
    InvalidOptions(String),
    /// A remote engine (ClickHouse) could not be reached, refused a
    /// statement, or answered something unreadable, while doing `action`.
    /// The source holds the server's own message.
    #[error("ClickHouse: {action}")]
    Remote {
        action: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A `ValidBatch` built by hand (not by `ingest::validate`) broke one of
    /// its documented invariants, such as an index out of range.
    #[error("the batch is inconsistent: {0}")]
    InvalidBatch(String),
    /// The batch is valid but larger than the engine stores at once (its
    /// rows would take more memory than configured); nothing of it was
    /// stored, and a retry would fail the same way.
    #[error("the batch is too large to store: {0}")]
    TooLarge(String),
}

impl StorageError {
    /// Whether a write failed because the disk holding the database is full
    /// (SQLite's `SQLITE_FULL`, which is what it makes of `ENOSPC`). SQLite
    /// rolled the transaction back (or the transaction's drop did), so
    /// nothing of it was kept, and the connection stays usable: the same
    /// write succeeds once space is freed.
    pub fn is_disk_full(&self) -> bool {
        matches!(self, Self::Database(err)
            if err.sqlite_error_code() == Some(rusqlite::ErrorCode::DiskFull))
    }
}

/// The point of a `series` answer a bucket's weight goes to: points are
/// aligned to multiples of `step_nanos`, or one per bucket when it is not
/// positive. Shared so every engine draws the same points.
pub(crate) fn series_point(bucket: i64, step_nanos: i64, bucket_nanos: i64) -> i64 {
    let step = point_width(step_nanos, bucket_nanos);
    bucket.saturating_sub(bucket.rem_euclid(step))
}

/// The width of the points `series_point` draws.
pub(crate) fn point_width(step_nanos: i64, bucket_nanos: i64) -> i64 {
    if step_nanos > 0 {
        step_nanos
    } else {
        bucket_nanos
    }
}

/// The width of a series' points for an asked width: whole storage buckets
/// (a bucket is the finest the data is: a narrower point would draw a
/// minute's samples as a sliver), one bucket when none is asked.
pub fn series_step(step_nanos: i64, bucket_nanos: i64) -> i64 {
    let bucket = bucket_nanos.max(1);
    if step_nanos <= bucket {
        return bucket;
    }
    let buckets = step_nanos / bucket + i64::from(step_nanos % bucket != 0);
    buckets
        .checked_mul(bucket)
        .unwrap_or(i64::MAX / bucket * bucket)
}

/// Stores validated batches and answers queries over them.
pub trait Storage: Send + Sync + 'static {
    /// The width of the buckets samples are summed in: the finest time
    /// resolution a query can have.
    fn bucket_nanos(&self) -> i64;

    /// Stores one batch atomically and durably, or not at all. A batch
    /// whose id is already stored is not counted again.
    fn ingest(&self, batch: &ValidBatch) -> Result<IngestOutcome, StorageError>;

    /// The distinct stacks of the selected samples with their summed weights.
    fn stacks(&self, selection: &Selection) -> Result<StackSamples, StorageError>;

    /// [`Storage::stacks`] with each sample's weight times its period
    /// (CPU ticks as nanoseconds, whatever rate each was taken at; the other
    /// types' weights are stored in their unit already), and a
    /// `sample_period_nanos` of 1: what Pyroscope's API answers, where
    /// samples of several rates are one selection.
    fn stacks_in_units(&self, selection: &Selection) -> Result<StackSamples, StorageError>;

    /// Label names present on the selected samples, sorted.
    fn label_names(&self, selection: &Selection) -> Result<Vec<String>, StorageError>;

    /// Values of `name` on the selected samples, sorted.
    fn label_values(&self, selection: &Selection, name: &str) -> Result<Vec<String>, StorageError>;

    /// The profile types with samples in the selection's range on which its
    /// matchers hold (its own type aside), sorted.
    fn profile_types(&self, selection: &Selection) -> Result<Vec<ProfileType>, StorageError>;

    /// Weight of the selected samples per `step_nanos` wide bucket, as
    /// (bucket start, weight), ascending, empty buckets left out.
    fn series(
        &self,
        selection: &Selection,
        step_nanos: i64,
    ) -> Result<Vec<(i64, u64)>, StorageError>;

    /// [`Storage::series`] with each sample's weight times its period, as
    /// [`Storage::stacks_in_units`].
    fn series_in_units(
        &self,
        selection: &Selection,
        step_nanos: i64,
    ) -> Result<Vec<(i64, u64)>, StorageError>;

    /// Deletes samples (and what only they referenced) older than the cutoff;
    /// returns the sample rows deleted (SQLite: the (bucket, label set,
    /// stack) sums).
    fn delete_before(&self, cutoff_unix_nanos: i64) -> Result<u64, StorageError>;

    /// Brings precomputed summaries (rollups) up to date for data that
    /// ended at or before `closed_before_unix_nanos`, a bounded amount of
    /// work per call: returns how many units of work (spans) it did, and 0
    /// once nothing more can be done now, so callers call again until
    /// then. Queries are
    /// right whether or not it ran; they are faster after. Engines without
    /// summaries do nothing.
    fn compact(&self, closed_before_unix_nanos: i64) -> Result<u64, StorageError> {
        let _ = closed_before_unix_nanos;
        Ok(0)
    }

    /// Bytes the stored profiles take on this machine's disk; `None` when
    /// the engine keeps them elsewhere.
    fn disk_bytes(&self) -> Option<u64> {
        None
    }

    /// The sizes of the engine's in-memory caches against their bounds
    /// (left out while a long ingest or query holds them).
    fn state_sizes(&self, out: &mut Vec<StateSize>) {
        let _ = out;
    }
}

#[cfg(test)]
mod tests {
    use super::series_step;

    const MINUTE: i64 = 60_000_000_000;

    #[test]
    fn a_series_step_is_whole_storage_buckets() {
        assert_eq!(series_step(0, MINUTE), MINUTE, "none asked: one bucket");
        assert_eq!(
            series_step(2_301_250_001, MINUTE),
            MINUTE,
            "finer than the data"
        );
        assert_eq!(series_step(MINUTE, MINUTE), MINUTE);
        assert_eq!(series_step(MINUTE + 1, MINUTE), 2 * MINUTE, "rounded up");
        assert_eq!(series_step(36 * MINUTE, MINUTE), 36 * MINUTE);
        assert_eq!(series_step(i64::MAX, MINUTE) % MINUTE, 0, "no overflow");
        assert_eq!(series_step(5, 0), 5, "a zero bucket width counts as 1 ns");
    }
}
