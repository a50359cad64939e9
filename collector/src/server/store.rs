//! Stores a validated batch for every way one arrives (agents' gRPC
//! batches; SDKs' pushes and OTLP exports, whose profiles become one batch
//! here): refusals sorted by what the sender should do, the full-disk
//! state logged once when it starts and once when it ends, each request
//! counted in the ingest metrics.

use std::{sync::Arc, time::Instant};

use stackscope_profile::model::unix_nanos;

use crate::{
    ingest::{
        IngestLimits, ValidBatch,
        pprof::{SentProfile, sent_profiles_batch},
    },
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

/// What storing profiles applications sent needs.
#[derive(Clone)]
pub struct SentIngest {
    pub storage: Arc<dyn Storage>,
    pub limits: Arc<IngestLimits>,
    pub metrics: CollectorMetrics,
    /// Largest request, and most bytes its profiles take decompressed,
    /// all together.
    pub max_bytes: usize,
}

/// Why sent profiles were not stored; nothing of them was.
#[derive(Debug)]
pub(super) enum SentRefusal {
    /// Malformed: sending them again fails the same.
    Invalid(String),
    /// Larger than the collector takes: send less at once.
    TooLarge(String),
    /// The collector cannot store now (full disk, failed storage): retry.
    Unavailable(String),
}

impl SentIngest {
    /// Stores `profiles` as one batch (off the async workers).
    pub(super) async fn store(
        &self,
        profiles: Vec<SentProfile>,
    ) -> Result<IngestOutcome, SentRefusal> {
        let started = Instant::now();
        let state = self.clone();
        let outcome = tokio::task::spawn_blocking(move || {
            let now = unix_nanos(std::time::SystemTime::now());
            let batch = sent_profiles_batch(&profiles, &state.limits, state.max_bytes, now)
                .map_err(|err| {
                    let message = format!("profiles refused, nothing stored: {err}");
                    let refusal = if err.is_too_large() {
                        SentRefusal::TooLarge(message)
                    } else {
                        SentRefusal::Invalid(message)
                    };
                    (refusal, IngestResult::Rejected)
                })?;
            store(&*state.storage, &state.metrics, &batch).map_err(|refusal| {
                let result = refusal.result();
                let refusal = match refusal {
                    Refusal::TooLarge(message) => SentRefusal::TooLarge(message),
                    Refusal::DiskFull => SentRefusal::Unavailable(
                        "profiles not stored: the collector's disk is full; retry later".into(),
                    ),
                    Refusal::Failed => SentRefusal::Unavailable(
                        "the collector could not store the profiles; retry later".into(),
                    ),
                };
                (refusal, result)
            })
        })
        .await;
        let (answer, result, samples) = match outcome {
            Ok(Ok(outcome @ IngestOutcome::Stored { samples })) => {
                (Ok(outcome), IngestResult::Stored, samples)
            }
            Ok(Ok(outcome)) => (Ok(outcome), IngestResult::Duplicate, 0),
            Ok(Err((refusal, result))) => (Err(refusal), result, 0),
            Err(_) => (
                Err(SentRefusal::Unavailable("the ingest task failed".into())),
                IngestResult::Failed,
                0,
            ),
        };
        self.metrics.ingested(result, samples, started.elapsed());
        answer
    }
}
