//! The collector's Prometheus metrics: batches ingested by result, samples
//! stored, ingest and query latency, the size of the storage on disk, and
//! whether that disk is full.
//! Counted where the work is done (the ingest service, the query engine);
//! served with the process metrics and the health probes by
//! `stackscope-telemetry` on the HTTP address.

use std::{
    fmt,
    sync::Arc,
    time::{Duration, Instant},
};

use stackscope_telemetry::{
    ConstMetrics,
    prometheus_client::{
        collector::Collector,
        encoding::DescriptorEncoder,
        metrics::{
            counter::Counter,
            family::Family,
            gauge::Gauge,
            histogram::{Histogram, exponential_buckets},
        },
        registry::{Registry, Unit},
    },
};

use crate::{debuginfo::symbolize::Symbolizer, storage::Storage};

type Labels = [(&'static str, &'static str); 1];
type QueryLabels = [(&'static str, &'static str); 2];

/// What a pushed batch came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IngestResult {
    Stored,
    Duplicate,
    /// Refused as invalid or too large: the agent drops it.
    Rejected,
    /// Storage failed: the agent retries.
    Failed,
    /// The disk holding the database is full: the agent keeps the batch
    /// and retries.
    DiskFull,
}

impl IngestResult {
    fn label(self) -> &'static str {
        match self {
            Self::Stored => "stored",
            Self::Duplicate => "duplicate",
            Self::Rejected => "rejected",
            Self::Failed => "failed",
            Self::DiskFull => "disk_full",
        }
    }
}

/// The collector's counters and histograms; cheap to clone (shared
/// inside).
#[derive(Debug, Clone)]
pub struct CollectorMetrics {
    batches: Family<Labels, Counter>,
    samples_stored: Counter,
    ingest_seconds: Histogram,
    query_seconds: Family<QueryLabels, Histogram, fn() -> Histogram>,
    /// 1 from a batch refused for a full disk until one is stored again.
    storage_full: Gauge,
}

/// 1 ms to about 65 s, doubling.
fn latency_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

impl Default for CollectorMetrics {
    fn default() -> Self {
        Self {
            batches: Family::default(),
            samples_stored: Counter::default(),
            ingest_seconds: latency_buckets(),
            query_seconds: Family::new_with_constructor(latency_buckets),
            storage_full: Gauge::default(),
        }
    }
}

impl CollectorMetrics {
    /// A batch pushed: what it came to, its stored sample rows, and how
    /// long it took from receipt to the answer.
    pub fn ingested(&self, result: IngestResult, samples: u64, took: Duration) {
        self.batches
            .get_or_create(&[("result", result.label())])
            .inc();
        self.samples_stored.inc_by(samples);
        self.ingest_seconds.observe(took.as_secs_f64());
    }

    /// Whether storing batches fails for lack of disk space now; returns
    /// what it was before, so a change can be logged once.
    pub fn set_storage_full(&self, full: bool) -> bool {
        self.storage_full.set(i64::from(full)) != 0
    }

    /// A query answered (`ok`) or refused or failed.
    pub fn queried(&self, query: &'static str, ok: bool, took: Duration) {
        let outcome = if ok { "ok" } else { "error" };
        self.query_seconds
            .get_or_create(&[("query", query), ("outcome", outcome)])
            .observe(took.as_secs_f64());
    }

    /// Times `work` as a query of kind `query`.
    pub async fn time_query<T, E>(
        &self,
        query: &'static str,
        work: impl Future<Output = Result<T, E>>,
    ) -> Result<T, E> {
        let started = Instant::now();
        let result = work.await;
        self.queried(query, result.is_ok(), started.elapsed());
        result
    }

    /// The registry to serve: process metrics, and the collector's under
    /// `stackscope_collector_`, storage size included.
    pub fn registry(
        &self,
        storage: Arc<dyn Storage>,
        symbolizer: Option<Arc<Symbolizer>>,
    ) -> Registry {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(stackscope_telemetry::ProcessMetrics));
        let own = registry.sub_registry_with_prefix("stackscope_collector");
        own.register(
            "ingest_batches",
            "Batches pushed by agents, by result.",
            self.batches.clone(),
        );
        own.register(
            "ingest_sample_rows",
            "Sample rows stored (one per distinct labels and stack in a batch).",
            self.samples_stored.clone(),
        );
        own.register_with_unit(
            "ingest_duration",
            "Time from a push's receipt to its answer (validation and commit).",
            Unit::Seconds,
            self.ingest_seconds.clone(),
        );
        own.register_with_unit(
            "query_duration",
            "Time to answer a query, by kind and outcome.",
            Unit::Seconds,
            self.query_seconds.clone(),
        );
        own.register(
            "storage_full",
            "1 while batches are refused because the disk holding the database is full \
             (from the first refusal until a batch is stored again), else 0.",
            self.storage_full.clone(),
        );
        own.register_collector(Box::new(Sizes {
            storage,
            symbolizer,
        }));
        registry
    }
}

/// The storage's size on disk and the sizes of the collector's caches
/// (the storage engine's and naming's), read at scrape time.
struct Sizes {
    storage: Arc<dyn Storage>,
    symbolizer: Option<Arc<Symbolizer>>,
}

impl fmt::Debug for Sizes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Sizes")
    }
}

impl Collector for Sizes {
    fn encode(&self, encoder: DescriptorEncoder<'_>) -> fmt::Result {
        let mut out = ConstMetrics::new(encoder);
        if let Some(bytes) = self.storage.disk_bytes() {
            out.gauge(
                "storage",
                "Size of the stored profiles on disk.",
                Some(Unit::Bytes),
                bytes as f64,
            )?;
        }
        let mut state = Vec::new();
        self.storage.state_sizes(&mut state);
        if let Some(symbolizer) = &self.symbolizer {
            symbolizer.state_sizes(&mut state);
        }
        out.state(&state)
    }
}
