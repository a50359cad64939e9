//! The HTTP side of telemetry, behind the `http` feature (on by default):
//! the `/metrics`, `/healthz` and `/readyz` endpoints, the [`Health`] state
//! behind the last two, [`ConstMetrics`] and the process-level metrics
//! ([`ProcessMetrics`]). Crates that only count ([`crate::probes`]) or
//! report their state's size ([`crate::StateSize`]) leave it off, and so
//! do not build axum, tokio and prometheus-client.

use std::{
    fmt,
    future::Future,
    io,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{
    Router,
    extract::State,
    http::{StatusCode, header},
    response::IntoResponse,
    routing::get,
};
pub use prometheus_client;
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric as _, MetricEncoder},
    metrics::{MetricType, counter::ConstCounter, gauge::ConstGauge},
    registry::{Registry, Unit},
};

use crate::{ProcessUsage, StateSize, heap_bytes};

/// The content type of the OpenMetrics text `prometheus-client` writes.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Whether a process is alive and whether it is ready, as its probes see it.
#[derive(Debug)]
pub struct Health {
    started: Instant,
    ready: AtomicBool,
    /// Live only while [`Health::beat`] was called within this long;
    /// `None`: live while it answers.
    stale_after: Option<Duration>,
    /// Milliseconds after `started` of the last beat.
    last_beat_ms: AtomicU64,
}

impl Health {
    /// Live as long as it answers; not ready until [`Health::set_ready`].
    pub fn new() -> Arc<Self> {
        Arc::new(Self::build(None, Instant::now()))
    }

    /// Live only while the owner calls [`Health::beat`] at least every
    /// `stale_after` (a wedged main loop then fails its liveness probe and
    /// is restarted); not ready until [`Health::set_ready`].
    pub fn with_heartbeat(stale_after: Duration) -> Arc<Self> {
        Arc::new(Self::build(Some(stale_after), Instant::now()))
    }

    fn build(stale_after: Option<Duration>, now: Instant) -> Self {
        Self {
            started: now,
            ready: AtomicBool::new(false),
            stale_after,
            last_beat_ms: AtomicU64::new(0),
        }
    }

    /// The main loop is turning.
    pub fn beat(&self) {
        self.beat_at(Instant::now());
    }

    fn beat_at(&self, now: Instant) {
        let ms = now.saturating_duration_since(self.started).as_millis();
        self.last_beat_ms
            .fetch_max(u64::try_from(ms).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    /// `Err` says why the process is not live.
    fn liveness_at(&self, now: Instant) -> Result<(), String> {
        let Some(stale_after) = self.stale_after else {
            return Ok(());
        };
        let last = self.started + Duration::from_millis(self.last_beat_ms.load(Ordering::Relaxed));
        let silent = now.saturating_duration_since(last);
        if silent > stale_after {
            Err(format!(
                "the main loop has not turned for {:.1} s (limit {:.1} s)",
                silent.as_secs_f64(),
                stale_after.as_secs_f64()
            ))
        } else {
            Ok(())
        }
    }
}

/// What the endpoints read.
#[derive(Clone)]
struct Served {
    registry: Arc<Registry>,
    health: Arc<Health>,
}

/// The `/metrics`, `/healthz` and `/readyz` routes, to merge into a router
/// of the binary's own or to [`serve`] alone.
pub fn router(registry: Arc<Registry>, health: Arc<Health>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(Served { registry, health })
}

/// Serves [`router`] on `listener` until `shutdown` completes.
pub async fn serve(
    listener: tokio::net::TcpListener,
    registry: Arc<Registry>,
    health: Arc<Health>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    axum::serve(listener, router(registry, health))
        .with_graceful_shutdown(shutdown)
        .await
}

async fn metrics(State(served): State<Served>) -> impl IntoResponse {
    let mut text = String::with_capacity(16 << 10);
    match prometheus_client::encoding::text::encode(&mut text, &served.registry) {
        Ok(()) => (StatusCode::OK, [(header::CONTENT_TYPE, OPENMETRICS)], text),
        Err(fmt::Error) => {
            tracing::warn!("encoding the metrics failed");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
                "encoding the metrics failed\n".to_string(),
            )
        }
    }
}

async fn healthz(State(served): State<Served>) -> (StatusCode, String) {
    match served.health.liveness_at(Instant::now()) {
        Ok(()) => (StatusCode::OK, "ok\n".into()),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
    }
}

async fn readyz(State(served): State<Served>) -> (StatusCode, &'static str) {
    if served.health.is_ready() {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}

/// Writes metrics whose values a binary already counts (as plain totals in
/// its own structures) without keeping a second set of atomics: a
/// [`Collector`] reads its totals at scrape time and hands them here.
pub struct ConstMetrics<'a> {
    encoder: DescriptorEncoder<'a>,
}

impl<'a> ConstMetrics<'a> {
    pub fn new(encoder: DescriptorEncoder<'a>) -> Self {
        Self { encoder }
    }

    /// A counter; `name` without the `_total` the encoder appends.
    pub fn counter(&mut self, name: &str, help: &str, value: u64) -> fmt::Result {
        let metric = ConstCounter::new(value);
        let encoder = self
            .encoder
            .encode_descriptor(name, help, None, metric.metric_type())?;
        metric.encode(encoder)
    }

    /// One counter per value of `label`.
    pub fn counters(
        &mut self,
        name: &str,
        help: &str,
        label: &str,
        values: &[(&str, u64)],
    ) -> fmt::Result {
        let mut family = self
            .encoder
            .encode_descriptor(name, help, None, MetricType::Counter)?;
        for &(value, count) in values {
            let labels = [(label, value)];
            ConstCounter::new(count).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }

    /// One family of `kind`, each value a series: labelled `label` by its
    /// first member, or, without a label, the one series of the family (its
    /// first member unused). Gauges are written as floats, counters as
    /// given.
    pub fn family(
        &mut self,
        name: &str,
        help: &str,
        unit: Option<Unit>,
        kind: MetricType,
        label: Option<&str>,
        values: &[(&str, Number)],
    ) -> fmt::Result {
        let mut family = self
            .encoder
            .encode_descriptor(name, help, unit.as_ref(), kind)?;
        for &(label_value, value) in values {
            match label {
                Some(label) => {
                    let labels = [(label, label_value)];
                    value.encode(kind, family.encode_family(&labels)?)?;
                }
                None => return value.encode(kind, family),
            }
        }
        Ok(())
    }

    /// Each piece of state's size and bounds (`<prefix>_state_entries`,
    /// `_state_max_entries`, `_state_bytes`, `_state_max_bytes`), labelled
    /// `state` by the piece's name; figures not known are left out.
    pub fn state(&mut self, state: &[StateSize]) -> fmt::Result {
        type Figure = fn(&StateSize) -> Option<usize>;
        let families: [(&str, &str, Option<Unit>, Figure); 4] = [
            (
                "state_entries",
                "Entries held by each piece of long-lived state (caches, per-process maps, queues).",
                None,
                |s| s.entries,
            ),
            (
                "state_max_entries",
                "The most entries each piece of state keeps.",
                None,
                |s| s.max_entries,
            ),
            (
                "state",
                "Heap bytes held by each piece of state, where counted.",
                Some(Unit::Bytes),
                |s| s.bytes,
            ),
            (
                "state_max",
                "The most heap bytes each piece of state keeps.",
                Some(Unit::Bytes),
                |s| s.max_bytes,
            ),
        ];
        for (name, help, unit, figure) in families {
            let values: Vec<(&str, f64)> = state
                .iter()
                .filter_map(|s| Some((s.name, figure(s)? as f64)))
                .collect();
            self.gauges(name, help, unit, "state", &values)?;
        }
        Ok(())
    }

    /// One gauge per value of `label`.
    pub fn gauges(
        &mut self,
        name: &str,
        help: &str,
        unit: Option<Unit>,
        label: &str,
        values: &[(&str, f64)],
    ) -> fmt::Result {
        let mut family =
            self.encoder
                .encode_descriptor(name, help, unit.as_ref(), MetricType::Gauge)?;
        for &(value, gauge) in values {
            let labels = [(label, value)];
            ConstGauge::new(gauge).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }

    pub fn gauge(&mut self, name: &str, help: &str, unit: Option<Unit>, value: f64) -> fmt::Result {
        let metric = ConstGauge::new(value);
        let encoder =
            self.encoder
                .encode_descriptor(name, help, unit.as_ref(), metric.metric_type())?;
        metric.encode(encoder)
    }
}

/// A series' value for [`ConstMetrics::family`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Number {
    Int(u64),
    Real(f64),
}

impl Number {
    fn encode(self, kind: MetricType, encoder: MetricEncoder<'_>) -> fmt::Result {
        match (kind, self) {
            (MetricType::Counter, Number::Int(n)) => ConstCounter::new(n).encode(encoder),
            (MetricType::Counter, Number::Real(x)) => ConstCounter::new(x).encode(encoder),
            (_, Number::Int(n)) => ConstGauge::new(n as f64).encode(encoder),
            (_, Number::Real(x)) => ConstGauge::new(x).encode(encoder),
        }
    }
}

/// The process's own resource use, read from `/proc/self` at every scrape,
/// under the names Prometheus's client libraries use
/// (`process_resident_memory_bytes`, `process_cpu_seconds_total`, ...),
/// plus the peak resident memory, the figure to set a memory limit from.
#[derive(Debug, Default)]
pub struct ProcessMetrics;

impl Collector for ProcessMetrics {
    fn encode(&self, encoder: DescriptorEncoder<'_>) -> fmt::Result {
        let mut out = ConstMetrics::new(encoder);
        let usage = ProcessUsage::now();
        if let Some(rss) = usage.resident_bytes {
            out.gauge(
                "process_resident_memory",
                "Resident memory size.",
                Some(Unit::Bytes),
                rss as f64,
            )?;
        }
        if let Some(peak) = usage.peak_resident_bytes {
            out.gauge(
                "process_peak_resident_memory",
                "Highest resident memory size since the process started.",
                Some(Unit::Bytes),
                peak as f64,
            )?;
        }
        if let Some(seconds) = usage.cpu_seconds {
            let metric = ConstCounter::new(seconds);
            let unit = Unit::Seconds;
            metric.encode(out.encoder.encode_descriptor(
                "process_cpu",
                "User and system CPU time spent.",
                Some(&unit),
                metric.metric_type(),
            )?)?;
        }
        if let Some(heap) = heap_bytes() {
            out.gauges(
                "process_heap",
                "The C allocator's heap: bytes handed out (in_use) and bytes it holds \
                 free for reuse (free), whose growth with a flat in_use is fragmentation.",
                Some(Unit::Bytes),
                "use",
                &[("in_use", heap.in_use as f64), ("free", heap.free as f64)],
            )?;
        }
        if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
            out.gauge(
                "process_open_fds",
                "Open file descriptors.",
                None,
                fds.count() as f64,
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_heartbeat_older_than_its_limit_is_not_live() {
        let start = Instant::now();
        let health = Health::build(Some(Duration::from_secs(10)), start);
        health.beat_at(start + Duration::from_secs(5));
        assert_eq!(health.liveness_at(start + Duration::from_secs(14)), Ok(()));
        let err = health
            .liveness_at(start + Duration::from_secs(16))
            .unwrap_err();
        assert!(err.contains("11.0 s"), "{err}");
        // A late beat from another thread never moves the time back.
        health.beat_at(start + Duration::from_secs(20));
        health.beat_at(start + Duration::from_secs(1));
        assert_eq!(health.liveness_at(start + Duration::from_secs(29)), Ok(()));
    }

    #[test]
    fn without_a_heartbeat_it_is_live_while_it_answers() {
        let start = Instant::now();
        let health = Health::build(None, start);
        assert_eq!(
            health.liveness_at(start + Duration::from_secs(3600)),
            Ok(())
        );
        assert!(!health.is_ready());
        health.set_ready(true);
        assert!(health.is_ready());
    }

    #[derive(Debug)]
    struct Totals;

    impl Collector for Totals {
        fn encode(&self, encoder: DescriptorEncoder<'_>) -> fmt::Result {
            let mut out = ConstMetrics::new(encoder);
            out.counter("samples", "Samples read.", 7)?;
            out.counters(
                "drops",
                "Samples lost, by cause.",
                "cause",
                &[("ring_buffer_full", 2), ("decode_error", 1)],
            )?;
            out.gauge("queue", "Bytes queued.", Some(Unit::Bytes), 512.0)?;
            out.family(
                "busy",
                "Time busy, by task.",
                Some(Unit::Seconds),
                MetricType::Counter,
                Some("task"),
                &[("read", Number::Real(1.5)), ("write", Number::Int(2))],
            )?;
            out.family(
                "depth",
                "Queue depth.",
                None,
                MetricType::Gauge,
                None,
                &[("", Number::Int(3))],
            )
        }
    }

    #[tokio::test]
    async fn the_endpoints_answer_over_http() {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(ProcessMetrics));
        registry
            .sub_registry_with_prefix("stackscope_test")
            .register_collector(Box::new(Totals));
        let health = Health::new();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(
            listener,
            Arc::new(registry),
            Arc::clone(&health),
            async {
                let _ = stopped.await;
            },
        ));

        let (status, body) = get_http(addr, "/metrics").await;
        assert_eq!(status, 200, "{body}");
        for line in [
            "stackscope_test_samples_total 7",
            "stackscope_test_drops_total{cause=\"ring_buffer_full\"} 2",
            "stackscope_test_drops_total{cause=\"decode_error\"} 1",
            "stackscope_test_queue_bytes 512.0",
            "stackscope_test_busy_seconds_total{task=\"read\"} 1.5",
            "stackscope_test_busy_seconds_total{task=\"write\"} 2",
            "stackscope_test_depth 3.0",
            "# EOF",
        ] {
            assert!(body.lines().any(|l| l == line), "{line:?} missing:\n{body}");
        }
        let rss = body
            .lines()
            .find_map(|l| l.strip_prefix("process_resident_memory_bytes "))
            .unwrap_or_else(|| panic!("no RSS:\n{body}"));
        assert!(rss.parse::<f64>().unwrap() > 1e6, "{rss}");
        assert!(body.contains("process_cpu_seconds_total "), "{body}");
        if cfg!(target_env = "gnu") {
            assert!(
                body.contains("process_heap_bytes{use=\"in_use\"} "),
                "{body}"
            );
        }

        assert_eq!(get_http(addr, "/healthz").await.0, 200);
        assert_eq!(get_http(addr, "/readyz").await, (503, "not ready\n".into()));
        health.set_ready(true);
        assert_eq!(get_http(addr, "/readyz").await, (200, "ready\n".into()));
        assert_eq!(get_http(addr, "/nothing").await.0, 404);

        stop.send(()).unwrap();
        server.await.unwrap().unwrap();
    }

    /// A plain HTTP/1.0 GET: status and body.
    async fn get_http(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(format!("GET {path} HTTP/1.0\r\nHost: test\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        let status = response[9..12].parse().unwrap();
        let body = response
            .split_once("\r\n\r\n")
            .map_or("", |(_, body)| body)
            .to_string();
        (status, body)
    }
}
