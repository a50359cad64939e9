//! `--upload-debuginfo`: sends the collector what binaries carry of their
//! own symbols (`.symtab`, DWARF), once per build-id for the whole fleet,
//! so frames of the same binary on nodes that ship them unnamed (or whose
//! copies are stripped) get names at query time.
//!
//! Owns the upload queue (bounded; offers beyond it wait for the build-id's
//! next batch), the set of build-ids offered already (bounded), the rate
//! limit (one upload at a time, at most one start per
//! [`UploadConfig::min_interval`]) and the upload statistics. The batch
//! worker offers files ([`UploadQueue::offer`]) off the sampling loop; the
//! uploads run as one task on the agent's runtime.

use std::{
    collections::HashSet,
    fs::File,
    os::fd::AsRawFd as _,
    sync::{Arc, Mutex},
    time::Duration,
};

use stackscope_collector_client::{Uploaded, upload};
use stackscope_process_table::BuildId;
use stackscope_proto::v1::debuginfo_client::DebuginfoClient;
use tokio::{
    sync::{mpsc, watch},
    task::JoinHandle,
};

use super::{ExportConfig, ExportError, connection};
use stackscope_symbolize::node::debug_files;

/// Files waiting for the uploader.
const QUEUE_LEN: usize = 64;

/// Build-ids remembered as offered, before the set is cleared (and each is
/// asked about once more).
const MAX_OFFERED: usize = 65_536;

/// How uploads are paced.
#[derive(Debug, Clone)]
pub struct UploadConfig {
    /// Least time between the starts of two uploads.
    pub min_interval: Duration,
    /// Longest one upload may take.
    pub timeout: Duration,
}

impl Default for UploadConfig {
    fn default() -> Self {
        Self {
            min_interval: Duration::from_secs(1),
            timeout: Duration::from_secs(300),
        }
    }
}

/// What the uploader did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct UploadStats {
    /// Files sent and stored.
    pub uploaded: u64,
    pub uploaded_bytes: u64,
    /// Build-ids the collector held already.
    pub already_stored: u64,
    /// Binaries that carry no symbols of their own (nothing to send).
    pub without_symbols: u64,
    /// Uploads that failed (refused, unreachable collector, read error).
    pub failed: u64,
    /// Offers dropped because the queue was full.
    pub queue_full: u64,
}

struct Candidate {
    build_id: String,
    /// Kept open: read through `/proc/self/fd`, so a binary inside a
    /// container or deleted since is still the very file mapped.
    file: File,
    name: String,
}

/// The worker's side: offers binaries as batches name them.
#[derive(Debug, Clone)]
pub struct UploadQueue {
    sender: mpsc::Sender<Candidate>,
    offered: Arc<Mutex<HashSet<BuildId>>>,
    stats: Arc<Mutex<UploadStats>>,
}

impl std::fmt::Debug for Candidate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Candidate")
            .field("build_id", &self.build_id)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl UploadQueue {
    /// Offers the binary `open` gives (build-id `build_id`, mapped as
    /// `name`) unless it was offered before; only then is it opened. Reads
    /// its section headers (on the worker's thread, never the sampling
    /// loop's).
    pub fn offer(&self, build_id: BuildId, open: impl FnOnce() -> Option<File>, name: &str) {
        {
            let mut offered = lock(&self.offered);
            if offered.contains(&build_id) {
                return;
            }
            if offered.len() >= MAX_OFFERED {
                offered.clear();
            }
            offered.insert(build_id);
        }
        let Some(file) = open() else {
            // Offered again with the build-id's next batch.
            lock(&self.offered).remove(&build_id);
            return;
        };
        if debug_files::name_source(&file) != Some(debug_files::NameSource::Symbols) {
            lock(&self.stats).without_symbols += 1;
            return;
        }
        let candidate = Candidate {
            build_id: build_id.to_string(),
            file,
            name: name.to_owned(),
        };
        if self.sender.try_send(candidate).is_err() {
            lock(&self.stats).queue_full += 1;
            // Offered again with the build-id's next batch.
            lock(&self.offered).remove(&build_id);
        }
    }
}

/// The uploading task; see the module documentation.
pub struct DebuginfoUploader {
    queue: UploadQueue,
    closing: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl DebuginfoUploader {
    /// Starts the task on the current runtime, reaching the collector as
    /// the exporter does (same endpoint, TLS and token). Does not connect
    /// until the first upload.
    pub fn start(export: &ExportConfig, config: UploadConfig) -> Result<Self, ExportError> {
        let (endpoint, authorization) = connection(export)?;
        let channel = endpoint.connect_lazy();
        let (sender, mut receiver) = mpsc::channel::<Candidate>(QUEUE_LEN);
        let stats = Arc::new(Mutex::new(UploadStats::default()));
        let queue = UploadQueue {
            sender,
            offered: Arc::new(Mutex::new(HashSet::new())),
            stats: Arc::clone(&stats),
        };
        let (closing, mut closing_rx) = watch::channel(false);
        let task = tokio::spawn(async move {
            let mut client = DebuginfoClient::new(channel);
            let mut closed = false;
            loop {
                let candidate = tokio::select! {
                    candidate = receiver.recv() => candidate,
                    // Shutting down: what is queued is still sent, then
                    // `recv` ends.
                    _ = closing_rx.wait_for(|closing| *closing), if !closed => {
                        receiver.close();
                        closed = true;
                        continue;
                    }
                };
                let Some(candidate) = candidate else {
                    break;
                };
                let path = format!("/proc/self/fd/{}", candidate.file.as_raw_fd());
                let result = tokio::time::timeout(
                    config.timeout,
                    upload(
                        &mut client,
                        authorization.as_ref(),
                        &candidate.build_id,
                        path.as_ref(),
                        &candidate.name,
                    ),
                )
                .await;
                {
                    let mut stats = lock(&stats);
                    match result {
                        Ok(Ok(Uploaded::Stored { bytes })) => {
                            stats.uploaded += 1;
                            stats.uploaded_bytes += bytes;
                            tracing::info!(
                                build_id = candidate.build_id,
                                file = candidate.name,
                                bytes,
                                "debuginfo uploaded"
                            );
                        }
                        Ok(Ok(Uploaded::AlreadyStored)) => stats.already_stored += 1,
                        Ok(Err(err)) => {
                            stats.failed += 1;
                            tracing::debug!("uploading {}: {err}", candidate.name);
                        }
                        Err(_) => {
                            stats.failed += 1;
                            tracing::debug!("uploading {}: timed out", candidate.name);
                        }
                    }
                }
                if !closed {
                    tokio::time::sleep(config.min_interval).await;
                }
            }
        });
        Ok(Self {
            queue,
            closing,
            task,
        })
    }

    /// Where the batch worker offers files.
    pub fn queue(&self) -> UploadQueue {
        self.queue.clone()
    }

    /// Lets the uploads queued so far finish for at most `timeout`, then
    /// stops.
    pub async fn shutdown(self, timeout: Duration) -> UploadStats {
        let Self {
            queue,
            closing,
            mut task,
        } = self;
        let _ = closing.send(true);
        if tokio::time::timeout(timeout, &mut task).await.is_err() {
            task.abort();
        }
        *lock(&queue.stats)
    }
}
