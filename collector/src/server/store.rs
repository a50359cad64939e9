//! Stores a validated batch for every way one arrives (agents' gRPC
//! batches, SDKs' pushes): refusals sorted by what the sender should do,
//! the full-disk state logged once when it starts and once when it ends.

use crate::{
    ingest::ValidBatch,
    metrics::{CollectorMetrics, IngestResult},
    storage::{IngestOutcome, Storage, StorageError},
};

/// Why a valid batch was not stored; nothing of it was.
#[derive(Debug)]
pub(super) enum Refusal {
    /// Larger than storage takes at once: sending it again fails the same.
    TooLarge(String),
    /// The disk holding the database is full: keep it, retry later.
    DiskFull,
    /// Storage failed: retry.
    Failed,
}

impl Refusal {
    pub(super) fn result(&self) -> IngestResult {
        match self {
            Refusal::TooLarge(_) => IngestResult::Rejected,
            Refusal::DiskFull => IngestResult::DiskFull,
            Refusal::Failed => IngestResult::Failed,
        }
    }
}

/// Stores `batch` (blocking: call it off the async workers).
pub(super) fn store(
    storage: &dyn Storage,
    metrics: &CollectorMetrics,
    batch: &ValidBatch,
) -> Result<IngestOutcome, Refusal> {
    let stored = storage.ingest(batch).map_err(|err| match err {
        StorageError::TooLarge(_) => {
            let message = format!("batch rejected, nothing stored: {err}");
            tracing::warn!("{message}");
            Refusal::TooLarge(message)
        }
        err if err.is_disk_full() => {
            // Said once when it happens, not once per refused push of
            // every sender retrying.
            if !metrics.set_storage_full(true) {
                tracing::error!(
                    "the disk holding the database is full ({:#}): refusing batches \
                     (agents and SDKs keep them and retry) until space is freed",
                    anyhow::Error::from(err)
                );
            }
            Refusal::DiskFull
        }
        err => {
            tracing::error!("storing a batch failed: {:#}", anyhow::Error::from(err));
            Refusal::Failed
        }
    })?;
    if matches!(stored, IngestOutcome::Stored { .. }) && metrics.set_storage_full(false) {
        tracing::info!("there is room on the disk again: storing batches");
    }
    Ok(stored)
}
