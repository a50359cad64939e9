//! Ships finished [`Batch`]es to the collector's `Ingest` service over gRPC
//! (`PushCompressed`, or `Push`; see [`stackscope_collector_client::ingest::push`]).
//!
//! Owns the connection to the collector (plain or TLS, optional mTLS and
//! bearer token, compression), a queue bounded in bytes, retries with
//! backoff, and the delivery statistics. Does not build batches (the
//! aggregator does) and does not decide when to stop (the run calls
//! [`Exporter::shutdown`]).
//!
//! Delivery is at least once and in order: one push at a time; a transient
//! failure retries the same batch, unchanged, so its `batch_id` lets the
//! collector drop the duplicate when an acknowledgement was lost on the way
//! back. Answers about the batch itself (invalid, too large, not
//! authenticated) drop it and move on, since sending it again would get the
//! same answer; a collector whose disk is full says so with a server
//! pushback, and the batch is kept and retried. While the collector is away
//! (or full) the queue keeps the newest `max_queue_bytes` of data and drops
//! the oldest.
//!
//! The exporter runs as one task on the caller's tokio runtime (a
//! current-thread runtime is enough) and connects lazily, so a collector
//! that is down when the agent starts only delays delivery.

pub mod debuginfo;

use std::{
    fmt,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::{Duration, Instant},
};

use stackscope_proto::v1::{Batch, PushResponse};
use tokio::{
    sync::{Notify, watch},
    task::JoinHandle,
};
use tonic::{
    Status,
    codec::CompressionEncoding,
    metadata::{Ascii, MetadataValue},
    transport::Endpoint,
};
use tracing::{debug, error, info, warn};

pub use stackscope_collector_client::connect::TlsConfig;
use stackscope_collector_client::connect::{self, ConnectError};

use stackscope_collector_client::ingest::{
    push::{
        ASK_AGAIN_AFTER, CollectorSupport, EncodedRequest, IngestPusher, PushOptions,
        RequestEncoder,
    },
    retry::{Backoff, is_retryable, pushback},
};

use stackscope_telemetry::log_limit::LogLimiter;

use stackscope_collector_client::ingest::queue::{Evicted, Pending, Queue};

/// At most one line per this interval for each kind of repeated trouble
/// (queue full, rejections, retries): a collector that is down or refuses
/// every batch must not flood the node's log.
const LOG_EVERY: Duration = Duration::from_secs(30);

/// The longest accepted `request_timeout`: a push that has not been answered
/// in an hour will not be, and the bound keeps the gRPC timeout header
/// representable.
const MAX_REQUEST_TIMEOUT: Duration = Duration::from_secs(3600);

/// How batches are compressed on the wire. Profiles are repetitive (string
/// tables, similar stacks), so compression typically shrinks them several
/// times; zstd does so at less CPU than gzip, and the agent compresses each
/// batch once, when it is queued, so the queue holds it compressed
/// (`Ingest.PushCompressed`; gzip is gRPC's, per attempt).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    None,
    Gzip,
    #[default]
    Zstd,
}

impl Compression {
    pub fn as_str(self) -> &'static str {
        match self {
            Compression::None => "none",
            Compression::Gzip => "gzip",
            Compression::Zstd => "zstd",
        }
    }

    fn encoding(self) -> Option<CompressionEncoding> {
        match self {
            Compression::None => None,
            Compression::Gzip => Some(CompressionEncoding::Gzip),
            Compression::Zstd => Some(CompressionEncoding::Zstd),
        }
    }
}

impl fmt::Display for Compression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where and how to ship batches.
#[derive(Clone, PartialEq, Eq)]
pub struct ExportConfig {
    /// `http://host:port` or `https://host:port`.
    pub endpoint: String,
    pub tls: Option<TlsConfig>,
    /// Sent as `authorization: Bearer <token>` with every push.
    pub bearer_token: Option<String>,
    pub compression: Compression,
    /// Upper bound on the encoded (and compressed) size of the batches
    /// waiting to be sent (the one being pushed comes on top).
    pub max_queue_bytes: usize,
    /// How long one push may take, connecting included, before it counts
    /// as a transient failure.
    pub request_timeout: Duration,
    /// Longest wait before the first retry; doubles per consecutive failure.
    pub initial_backoff: Duration,
    /// Cap on the wait between retries.
    pub max_backoff: Duration,
}

/// The export queue's bound when memory is plentiful.
pub const DEFAULT_MAX_QUEUE_BYTES: usize = 64 << 20;

impl ExportConfig {
    /// The defaults: zstd, a 64 MiB queue, 30 s per push, backoff from
    /// 500 ms up to 60 s, no TLS options, no token.
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            tls: None,
            bearer_token: None,
            compression: Compression::default(),
            max_queue_bytes: DEFAULT_MAX_QUEUE_BYTES,
            request_timeout: Duration::from_secs(30),
            initial_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(60),
        }
    }
}

// Written by hand so the bearer token never reaches a log line.
impl fmt::Debug for ExportConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExportConfig")
            .field("endpoint", &self.endpoint)
            .field("tls", &self.tls)
            .field(
                "bearer_token",
                &self.bearer_token.as_ref().map(|_| "<redacted>"),
            )
            .field("compression", &self.compression)
            .field("max_queue_bytes", &self.max_queue_bytes)
            .field("request_timeout", &self.request_timeout)
            .field("initial_backoff", &self.initial_backoff)
            .field("max_backoff", &self.max_backoff)
            .finish()
    }
}

/// Why the exporter could not start. Nothing after the start is an error of
/// this kind: delivery problems are retried or counted in [`ExportStats`].
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// The endpoint, TLS settings or token are not usable.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// A size or duration outside what the exporter can work with.
    #[error("invalid export setting: {0}")]
    InvalidSetting(&'static str),
    /// Called outside a tokio runtime: the exporter needs one for its task.
    #[error("the exporter must be started from within a tokio runtime")]
    NoRuntime,
}

/// Delivery counters since the start, plus what is still waiting.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ExportStats {
    /// Batches the collector acknowledged (duplicates included).
    pub batches_sent: u64,
    /// Ticks (sum of `Sample.count`) in those batches.
    pub samples_sent: u64,
    /// Of `batches_sent`, those the collector had already stored: a retry
    /// after an acknowledgement that was lost.
    pub batches_duplicate: u64,
    /// Batches dropped by the queue bound (oldest first), or because one
    /// batch alone was larger than the bound.
    pub batches_dropped_queue_full: u64,
    pub samples_dropped_queue_full: u64,
    /// Batches the collector refused with a non-retryable answer.
    pub batches_rejected: u64,
    pub samples_rejected: u64,
    /// Push attempts that failed transiently and were kept for another try.
    pub retries: u64,
    /// Batches not delivered yet: waiting in the queue plus the one being
    /// pushed. After [`Exporter::shutdown`]: what was left unsent.
    pub queued_batches: u64,
    pub queued_bytes: u64,
    pub queued_samples: u64,
    /// The most recent failure (kept after later successes), as
    /// `Code: message: cause`.
    pub last_error: Option<String>,
}

/// See [`Exporter::stats_reader`].
#[derive(Clone)]
pub struct ExportStatsReader(Arc<Shared>);

impl ExportStatsReader {
    pub fn stats(&self) -> ExportStats {
        self.0.stats()
    }
}

impl fmt::Debug for ExportStatsReader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("ExportStatsReader")
            .field(&self.0.endpoint)
            .finish()
    }
}

/// Sends batches to the collector from a background task; see the module
/// documentation.
pub struct Exporter {
    shared: Arc<Shared>,
    /// Encodes (and compresses) batches as they are queued; behind a lock
    /// only because `enqueue` takes `&self` (one thread queues).
    encoder: Mutex<RequestEncoder>,
    /// `true` once [`Exporter::shutdown`] runs: the task drains the queue
    /// and ends.
    closing: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
}

impl fmt::Debug for Exporter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Exporter")
            .field("endpoint", &self.shared.endpoint)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl Exporter {
    /// Checks the configuration, reads the certificate files and starts the
    /// sending task on the current tokio runtime. Does not connect: the
    /// first push does, and a collector that is down then is retried like
    /// any other transient failure.
    pub fn start(config: ExportConfig) -> Result<Self, ExportError> {
        validate(&config)?;
        let (endpoint, authorization) = connection(&config)?;
        // connect_lazy and spawn both need a runtime and would panic
        // without one.
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| ExportError::NoRuntime)?;
        let _entered = runtime.enter();

        let support = CollectorSupport::default();
        let client = IngestPusher::new(
            endpoint.connect_lazy(),
            config.compression.encoding(),
            support.clone(),
        );
        let encoder = match config.compression {
            Compression::Zstd => RequestEncoder::zstd(support).unwrap_or_else(|err| {
                warn!("zstd could not start ({err}): batches are sent with gRPC's zstd instead");
                RequestEncoder::plain()
            }),
            Compression::Gzip | Compression::None => RequestEncoder::plain(),
        };
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                queue: Queue::new(config.max_queue_bytes),
                in_flight: None,
                totals: ExportStats::default(),
                last_queued_bytes: 0,
                queue_full_log: LogLimiter::new(LOG_EVERY),
                too_large_log: LogLimiter::new(LOG_EVERY),
                rejected_log: LogLimiter::new(LOG_EVERY),
                retry_log: LogLimiter::new(LOG_EVERY),
            }),
            wake: Notify::new(),
            endpoint: config.endpoint.clone(),
            max_queue_bytes: config.max_queue_bytes,
        });
        let settings = Settings {
            request_timeout: config.request_timeout,
            push: PushOptions {
                timeout: Some(config.request_timeout),
                authorization,
            },
            initial_backoff: config.initial_backoff,
            max_backoff: config.max_backoff,
        };
        let (closing, closing_rx) = watch::channel(false);
        let task = runtime.spawn(deliver(Arc::clone(&shared), client, settings, closing_rx));
        debug!(endpoint = %config.endpoint, compression = %config.compression, "exporter started");
        Ok(Self {
            shared,
            encoder: Mutex::new(encoder),
            closing,
            task: Some(task),
        })
    }

    /// Queues a batch for sending and returns at once. When the queue would
    /// exceed `max_queue_bytes`, the oldest waiting batches are dropped
    /// (counted in [`ExportStats`] and logged at most every 30 s); a batch
    /// larger than the whole bound is dropped itself.
    pub fn enqueue(&self, batch: Batch) {
        let pending = {
            let mut encoder = self.encoder.lock().unwrap_or_else(PoisonError::into_inner);
            Pending::new(batch, &mut encoder)
        };
        let now = Instant::now();
        let mut state = self.shared.lock();
        state.last_queued_bytes = pending.bytes;
        match state.queue.push_back(pending) {
            Ok(evicted) => {
                if evicted.batches > 0 {
                    state.count_queue_drop(evicted);
                    if state.queue_full_log.allow(now).is_some() {
                        let total = state.totals.batches_dropped_queue_full;
                        drop(state);
                        warn!(
                            "export queue full ({} bytes): dropped the {} oldest batch(es) \
                             ({} samples) to make room, {total} so far; the collector {} is \
                             unreachable or not keeping up",
                            self.shared.max_queue_bytes,
                            evicted.batches,
                            evicted.samples,
                            self.shared.endpoint,
                        );
                    }
                }
                self.shared.wake.notify_one();
            }
            Err(refused) => {
                state.count_queue_drop(Evicted {
                    batches: 1,
                    samples: refused.samples,
                });
                if state.too_large_log.allow(now).is_some() {
                    drop(state);
                    error!(
                        "dropped a batch of {} bytes ({} samples): larger than the whole \
                         export queue ({} bytes); raise the queue size or shorten the \
                         aggregation interval",
                        refused.bytes, refused.samples, self.shared.max_queue_bytes,
                    );
                }
            }
        }
    }

    /// The counters so far; cheap (one short lock).
    pub fn stats(&self) -> ExportStats {
        self.shared.stats()
    }

    /// Bytes the queue could take before it is full (the batch being sent
    /// counted as queued), less room for the next two batches, each about
    /// as large as the last one queued: what it can lend.
    pub fn spare_bytes(&self) -> u64 {
        let kept = 2 * self.shared.lock().last_queued_bytes as u64;
        (self.shared.max_queue_bytes as u64)
            .saturating_sub(self.stats().queued_bytes)
            .saturating_sub(kept)
    }

    /// Reads [`Exporter::stats`] from elsewhere (the metrics endpoint)
    /// without holding on to the exporter, whose shutdown needs it alone.
    pub fn stats_reader(&self) -> ExportStatsReader {
        ExportStatsReader(Arc::clone(&self.shared))
    }

    /// Stops the exporter: tries to deliver everything still queued
    /// (including what was just enqueued) until `deadline` has passed, then
    /// gives up. Returns the final counters; `queued_*` is what was left
    /// unsent. Returns within `deadline` (plus scheduling) even when the
    /// collector is unreachable.
    pub async fn shutdown(mut self, deadline: Duration) -> ExportStats {
        self.closing.send_replace(true);
        if let Some(mut task) = self.task.take() {
            match tokio::time::timeout(deadline, &mut task).await {
                Ok(Ok(())) => {}
                Ok(Err(join)) => error!("the export task failed: {join}"),
                Err(_elapsed) => {
                    // The push in progress, if any, is abandoned with the
                    // task; its batch stays counted in `queued_*`.
                    task.abort();
                    let _ = task.await;
                }
            }
        }
        let stats = self.stats();
        if stats.queued_batches > 0 {
            warn!(
                "exporter stopped with {} batch(es) ({} samples) not delivered to {} within {}{}",
                stats.queued_batches,
                stats.queued_samples,
                self.shared.endpoint,
                humantime::format_duration(deadline),
                stats
                    .last_error
                    .as_deref()
                    .map(|e| format!("; last error: {e}"))
                    .unwrap_or_default(),
            );
        } else {
            debug!(?stats, "exporter stopped with everything delivered");
        }
        stats
    }
}

impl Drop for Exporter {
    // Without a shutdown the task would outlive its owner and keep retrying.
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// What the sending task needs from the configuration.
struct Settings {
    request_timeout: Duration,
    push: PushOptions,
    initial_backoff: Duration,
    max_backoff: Duration,
}

/// State shared by the handle and the sending task.
struct Shared {
    state: Mutex<State>,
    /// Wakes the sending task when a batch is queued.
    wake: Notify,
    endpoint: String,
    max_queue_bytes: usize,
}

struct State {
    queue: Queue,
    /// Bytes and samples of the batch being pushed: it left the queue and
    /// goes back in front only if the push fails transiently.
    in_flight: Option<(usize, u64)>,
    /// Counters; the `queued_*` fields are filled in by [`Shared::stats`].
    totals: ExportStats,
    /// What the last batch took in the queue, encoded and compressed.
    last_queued_bytes: usize,
    queue_full_log: LogLimiter,
    too_large_log: LogLimiter,
    rejected_log: LogLimiter,
    retry_log: LogLimiter,
}

impl State {
    fn count_queue_drop(&mut self, evicted: Evicted) {
        let totals = &mut self.totals;
        totals.batches_dropped_queue_full += evicted.batches;
        totals.samples_dropped_queue_full = totals
            .samples_dropped_queue_full
            .saturating_add(evicted.samples);
    }
}

impl Shared {
    // A panic while the lock was held cannot leave the counters or the
    // queue half-updated in a way that matters more than losing export
    // altogether, so a poisoned lock is used as is.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn stats(&self) -> ExportStats {
        let state = self.lock();
        let (flying, flying_bytes, flying_samples) = match state.in_flight {
            Some((bytes, samples)) => (1, bytes, samples),
            None => (0, 0, 0),
        };
        ExportStats {
            queued_batches: (state.queue.len() + flying) as u64,
            queued_bytes: (state.queue.bytes() + flying_bytes) as u64,
            queued_samples: state.queue.samples().saturating_add(flying_samples),
            ..state.totals.clone()
        }
    }

    fn take_next(&self) -> Option<Pending> {
        let mut state = self.lock();
        let pending = state.queue.pop_front()?;
        state.in_flight = Some((pending.bytes, pending.samples));
        Some(pending)
    }

    fn delivered(&self, pending: &Pending, response: PushResponse) {
        let mut state = self.lock();
        state.in_flight = None;
        let totals = &mut state.totals;
        totals.batches_sent += 1;
        totals.samples_sent = totals.samples_sent.saturating_add(pending.samples);
        if response.duplicate {
            totals.batches_duplicate += 1;
        }
    }

    fn rejected(&self, pending: Pending, status: &Status) {
        let description = describe(status);
        let mut state = self.lock();
        state.in_flight = None;
        let totals = &mut state.totals;
        totals.batches_rejected += 1;
        totals.samples_rejected = totals.samples_rejected.saturating_add(pending.samples);
        totals.last_error = Some(description.clone());
        let total = totals.batches_rejected;
        if let Some(held_back) = state.rejected_log.allow(Instant::now()) {
            drop(state);
            error!(
                "the collector {} rejected a batch ({} samples), which is dropped: {description} \
                 ({total} rejected so far, {held_back} more since the last line like this)",
                self.endpoint, pending.samples,
            );
        }
    }

    /// Puts a transiently failed batch back in front, unless newer batches
    /// took its room meanwhile (then the bound drops it, being the oldest).
    fn failed_transiently(&self, pending: Pending, status: &Status, delay: Duration) {
        let description = describe(status);
        let attempts = pending.failed_attempts;
        let mut state = self.lock();
        state.in_flight = None;
        state.totals.last_error = Some(description.clone());
        match state.queue.push_front(pending) {
            Ok(()) => state.totals.retries += 1,
            Err(refused) => state.count_queue_drop(Evicted {
                batches: 1,
                samples: refused.samples,
            }),
        }
        if state.retry_log.allow(Instant::now()).is_some() {
            let queued = state.queue.len();
            drop(state);
            warn!(
                "pushing to the collector {} failed ({description}); retrying in {} \
                 (attempt {attempts} of this batch, {queued} batch(es) waiting)",
                self.endpoint,
                humantime::format_duration(round_to_millis(delay)),
            );
        }
    }
}

/// The sending task: one push at a time, in queue order, until shutdown
/// finds the queue empty.
async fn deliver(
    shared: Arc<Shared>,
    mut client: IngestPusher,
    settings: Settings,
    mut closing: watch::Receiver<bool>,
) {
    let mut backoff = Backoff::new(settings.initial_backoff, settings.max_backoff);
    let mut failing = false;
    while let Some(mut pending) = next_batch(&shared, &mut closing).await {
        let answer = push(&mut client, &pending.request, &settings).await;
        // At most once per ASK_AGAIN_AFTER.
        if let Some(refusal) = client.take_compressed_refusal() {
            warn!(
                "the collector {} does not take batches compressed by the agent ({}): a \
                 collector from before Ingest.PushCompressed, or a proxy that does not route \
                 it; sending them with gRPC's zstd, which costs the agent more CPU, and \
                 asking again in {}",
                shared.endpoint,
                describe(&refusal),
                humantime::format_duration(ASK_AGAIN_AFTER),
            );
        }
        match answer {
            Ok(response) => {
                backoff.reset();
                if std::mem::take(&mut failing) {
                    info!("the collector {} accepts batches again", shared.endpoint);
                }
                shared.delivered(&pending, response);
            }
            Err(status) if is_retryable(&status) => {
                failing = true;
                pending.failed_attempts = pending.failed_attempts.saturating_add(1);
                let delay = backoff.next_delay_after(pushback(&status));
                shared.failed_transiently(pending, &status, delay);
                wait_before_retry(delay, &mut closing, &mut backoff).await;
            }
            Err(status) => shared.rejected(pending, &status),
        }
    }
}

/// The oldest queued batch, waiting for one if the queue is empty; `None`
/// once shutdown has begun and nothing is left.
async fn next_batch(shared: &Shared, closing: &mut watch::Receiver<bool>) -> Option<Pending> {
    loop {
        if let Some(pending) = shared.take_next() {
            return Some(pending);
        }
        if *closing.borrow_and_update() {
            return None;
        }
        tokio::select! {
            () = shared.wake.notified() => {}
            changed = closing.changed() => {
                // The handle is gone without a shutdown; its Drop aborts
                // this task anyway.
                if changed.is_err() {
                    return None;
                }
            }
        }
    }
}

async fn wait_before_retry(
    delay: Duration,
    closing: &mut watch::Receiver<bool>,
    backoff: &mut Backoff,
) {
    if *closing.borrow() {
        tokio::time::sleep(delay).await;
        return;
    }
    tokio::select! {
        () = tokio::time::sleep(delay) => {}
        // Shutdown has a short deadline: rather than sleep through a long
        // backoff, try again at once and start the backoff over.
        Ok(_) = closing.wait_for(|&closing| closing) => backoff.reset(),
    }
}

async fn push(
    client: &mut IngestPusher,
    request: &EncodedRequest,
    settings: &Settings,
) -> Result<PushResponse, Status> {
    // Our own timer also covers connecting and a collector that never
    // answers at all.
    let push = client.push(request, &settings.push);
    match tokio::time::timeout(settings.request_timeout, push).await {
        Ok(result) => result,
        Err(_elapsed) => Err(Status::deadline_exceeded(format!(
            "no answer within {}",
            humantime::format_duration(settings.request_timeout)
        ))),
    }
}

/// `Code: message: cause: cause…`, skipping causes the text already holds
/// (tonic repeats a transport error's text in the status message).
fn describe(status: &Status) -> String {
    let mut text = format!("{:?}: {}", status.code(), status.message());
    let mut source = std::error::Error::source(status);
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

fn round_to_millis(duration: Duration) -> Duration {
    Duration::from_millis(u64::try_from(duration.as_millis()).unwrap_or(u64::MAX))
}

fn validate(config: &ExportConfig) -> Result<(), ExportError> {
    let problem = if config.max_queue_bytes == 0 {
        "max_queue_bytes must be greater than 0"
    } else if config.request_timeout.is_zero() || config.request_timeout > MAX_REQUEST_TIMEOUT {
        "request_timeout must be greater than 0 and at most one hour"
    } else if config.initial_backoff.is_zero() {
        // A zero backoff would retry a down collector in a busy loop.
        "initial_backoff must be greater than 0"
    } else if config.max_backoff < config.initial_backoff {
        "max_backoff must be at least initial_backoff"
    } else {
        return Ok(());
    };
    Err(ExportError::InvalidSetting(problem))
}

/// The collector's endpoint and `authorization` header, as configured.
pub(crate) fn connection(
    config: &ExportConfig,
) -> Result<(Endpoint, Option<MetadataValue<Ascii>>), ConnectError> {
    let endpoint = connect::endpoint(
        &config.endpoint,
        config.tls.as_ref(),
        config.request_timeout,
    )?;
    Ok((
        endpoint,
        connect::authorization(config.bearer_token.as_deref())?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compression_is_a_clap_value() {
        use clap::ValueEnum;
        let names: Vec<_> = Compression::value_variants()
            .iter()
            .filter_map(|v| v.to_possible_value())
            .map(|v| v.get_name().to_owned())
            .collect();
        assert_eq!(names, ["none", "gzip", "zstd"]);
    }

    #[test]
    fn settings_that_would_misbehave_are_refused() {
        let ok = ExportConfig::new("http://127.0.0.1:1");
        assert!(validate(&ok).is_ok());
        let cases = [
            ExportConfig {
                max_queue_bytes: 0,
                ..ok.clone()
            },
            ExportConfig {
                request_timeout: Duration::ZERO,
                ..ok.clone()
            },
            ExportConfig {
                initial_backoff: Duration::ZERO,
                ..ok.clone()
            },
            ExportConfig {
                max_backoff: Duration::from_millis(1),
                ..ok.clone()
            },
        ];
        for config in cases {
            assert!(
                matches!(validate(&config), Err(ExportError::InvalidSetting(_))),
                "{config:?}"
            );
        }
    }

    #[test]
    fn debug_output_hides_the_token() {
        let config = ExportConfig {
            bearer_token: Some("s3cret".into()),
            ..ExportConfig::new("http://127.0.0.1:1")
        };
        let text = format!("{config:?}");
        assert!(!text.contains("s3cret"), "{text}");
        assert!(text.contains("<redacted>"), "{text}");
    }

    #[test]
    fn status_description_has_code_message_and_new_causes() {
        let status = Status::unavailable("collector restarting");
        assert_eq!(describe(&status), "Unavailable: collector restarting");
    }
}
