//! Runs the collector: the gRPC server (ingest, query, debuginfo, health),
//! the HTTP server (queries, Pyroscope's querier and push APIs, debuginfod's
//! API, Prometheus metrics and the health probes; over TLS when gRPC is),
//! and the retention task,
//! until asked to stop.

mod auth;
mod connect;
mod debuginfo;
mod grpc;
mod http;
mod otlp;
mod pyroscope;
mod store;

use std::{net::SocketAddr, sync::Arc, time::Duration};

use opentelemetry_proto::tonic::collector::profiles::v1development::profiles_service_server::ProfilesServiceServer;
use stackscope_profile::model::unix_nanos;
use stackscope_proto::v1::{
    debuginfo_server::DebuginfoServer, ingest_server::IngestServer, query_server::QueryServer,
};
use tokio::{net::TcpListener, sync::watch, task::JoinSet};
use tonic::{
    codec::CompressionEncoding,
    transport::{Identity, ServerTlsConfig},
};

use stackscope_telemetry::Health;

use crate::{
    debuginfo::Debuginfo,
    ingest::IngestLimits,
    metrics::CollectorMetrics,
    query::QueryEngine,
    storage::{Storage, StorageError},
};

/// How the collector serves.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub grpc_listen: SocketAddr,
    /// `None`: no HTTP API.
    pub http_listen: Option<SocketAddr>,
    /// Largest encoded (decompressed) gRPC message accepted, and largest
    /// `PushRequest` a `PushCompressed` frame may hold; larger batches are
    /// refused with RESOURCE_EXHAUSTED before they are decoded.
    pub max_message_bytes: usize,
    pub limits: IngestLimits,
    /// Samples older than this are deleted in the background.
    pub retention: Duration,
    /// How often the retention task runs.
    pub retention_interval: Duration,
    /// How often the compaction task rolls up what ingest changed (see
    /// [`Storage::compact`]).
    pub compaction_interval: Duration,
    /// PEM certificate chain and key: serve gRPC over TLS.
    pub tls: Option<TlsFiles>,
    /// Agents must send `authorization: Bearer <token>` to push (and to
    /// upload debuginfo).
    pub ingest_token: Option<String>,
    /// Queries must carry this token, on gRPC and on the HTTP API (which
    /// also takes it as an HTTP Basic password); probes and metrics stay
    /// open.
    pub query_token: Option<String>,
    /// The debuginfo store and query-time symbolizer; `None`: frames are
    /// shown with the names agents sent, and uploads are refused.
    pub debuginfo: Option<Debuginfo>,
}

#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            grpc_listen: SocketAddr::from(([127, 0, 0, 1], 7070)),
            http_listen: Some(SocketAddr::from(([127, 0, 0, 1], 7071))),
            max_message_bytes: 64 << 20,
            limits: IngestLimits::default(),
            retention: Duration::from_secs(7 * 24 * 3600),
            retention_interval: Duration::from_secs(600),
            compaction_interval: Duration::from_secs(15),
            tls: None,
            ingest_token: None,
            query_token: None,
            debuginfo: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("listening on {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("the TLS certificate or key is not usable")]
    Tls(#[source] tonic::transport::Error),
    #[error("a token is not a valid HTTP header value")]
    Token,
    #[error("the gRPC server failed")]
    Grpc(#[source] tonic::transport::Error),
    #[error("the HTTP server failed")]
    Http(#[source] std::io::Error),
    #[error("the TLS certificate or key is not usable for the HTTP API: {0}")]
    HttpTls(String),
    #[error("a server task panicked")]
    Task(#[source] tokio::task::JoinError),
}

/// A running collector; [`RunningCollector::shutdown`] stops it.
pub struct RunningCollector {
    pub grpc_addr: SocketAddr,
    pub http_addr: Option<SocketAddr>,
    stop: watch::Sender<bool>,
    tasks: JoinSet<Result<(), ServerError>>,
}

impl RunningCollector {
    /// Stops accepting, lets requests in flight finish, and waits.
    pub async fn shutdown(self) -> Result<(), ServerError> {
        let _ = self.stop.send(true);
        self.wait().await
    }

    /// Waits until a server fails or the collector is stopped.
    pub async fn wait(mut self) -> Result<(), ServerError> {
        while let Some(done) = self.tasks.join_next().await {
            let failure = match done {
                Ok(Ok(())) => continue,
                Ok(Err(err)) => err,
                Err(join) => ServerError::Task(join),
            };
            // One server failing stops the others: a collector that takes
            // batches it can no longer be queried for (or the reverse) is
            // worse than one that exits and gets restarted.
            let _ = self.stop.send(true);
            while self.tasks.join_next().await.is_some() {}
            return Err(failure);
        }
        Ok(())
    }

    /// A sender that stops the collector (for signal handlers).
    pub fn stopper(&self) -> watch::Sender<bool> {
        self.stop.clone()
    }
}

async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|stop| *stop).await;
}

/// How long the servers wait for clients to finish once asked to stop.
const GRACEFUL_SHUTDOWN: Duration = Duration::from_secs(10);

/// Binds the listeners and starts serving in the background.
pub async fn start(
    config: ServerConfig,
    storage: Arc<dyn Storage>,
) -> Result<RunningCollector, ServerError> {
    let (stop, stop_rx) = watch::channel(false);
    let metrics = CollectorMetrics::default();
    let health = Health::new();
    let mut engine = QueryEngine::new(Arc::clone(&storage)).with_metrics(metrics.clone());
    if let Some(debuginfo) = &config.debuginfo {
        engine = engine.with_symbolizer(Arc::clone(&debuginfo.symbolizer));
    }
    let mut tasks = JoinSet::new();

    let grpc_listener = TcpListener::bind(config.grpc_listen)
        .await
        .map_err(|source| ServerError::Bind {
            addr: config.grpc_listen,
            source,
        })?;
    let grpc_addr = grpc_listener
        .local_addr()
        .map_err(|source| ServerError::Bind {
            addr: config.grpc_listen,
            source,
        })?;

    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<IngestServer<grpc::IngestService>>()
        .await;
    health_reporter
        .set_serving::<QueryServer<grpc::QueryService>>()
        .await;

    let ingest_token = auth::Token::new(config.ingest_token.as_deref(), "ingest")?;
    let query_token = auth::Token::new(config.query_token.as_deref(), "queries")?;
    let check_token = ingest_token.interceptor();
    let debuginfo = config.debuginfo.as_ref().map(|debuginfo| {
        tonic::service::interceptor::InterceptedService::new(
            DebuginfoServer::new(debuginfo::DebuginfoService::new(
                Arc::clone(&debuginfo.store),
                debuginfo.max_upload_bytes,
            )),
            check_token.clone(),
        )
    });
    // Profiles applications send: Pyroscope's SDKs on HTTP, OTLP on both.
    let sent_ingest = store::SentIngest {
        storage: Arc::clone(&storage),
        limits: Arc::new(config.limits.clone()),
        metrics: metrics.clone(),
        max_bytes: config.max_message_bytes,
    };
    let otlp_profiles = tonic::service::interceptor::InterceptedService::new(
        ProfilesServiceServer::new(otlp::OtlpProfiles(sent_ingest.clone()))
            .accept_compressed(CompressionEncoding::Gzip)
            .max_decoding_message_size(config.max_message_bytes),
        check_token.clone(),
    );
    let ingest = IngestServer::new(grpc::IngestService::new(
        Arc::clone(&storage),
        config.limits.clone(),
        metrics.clone(),
        config.max_message_bytes,
    ))
    .accept_compressed(CompressionEncoding::Gzip)
    .accept_compressed(CompressionEncoding::Zstd)
    .max_decoding_message_size(config.max_message_bytes);
    let query = tonic::service::interceptor::InterceptedService::new(
        QueryServer::new(grpc::QueryService::new(engine.clone()))
            .accept_compressed(CompressionEncoding::Gzip)
            .accept_compressed(CompressionEncoding::Zstd)
            .send_compressed(CompressionEncoding::Zstd)
            .send_compressed(CompressionEncoding::Gzip),
        query_token.interceptor(),
    );

    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = &config.tls {
        builder = builder
            .tls_config(
                ServerTlsConfig::new().identity(Identity::from_pem(&tls.cert_pem, &tls.key_pem)),
            )
            .map_err(ServerError::Tls)?;
    }
    let router = builder
        .add_service(health_service)
        .add_service(tonic::service::interceptor::InterceptedService::new(
            ingest,
            check_token,
        ))
        .add_service(query)
        .add_service(otlp_profiles)
        .add_optional_service(debuginfo);
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(grpc_listener);
    let grpc_stop = stopped(stop_rx.clone());
    let grpc_deadline = stop_rx.clone();
    tasks.spawn(async move {
        let serve = router.serve_with_incoming_shutdown(incoming, grpc_stop);
        // Graceful shutdown waits for every client to close its connection;
        // one that does not (a stalled agent) must not keep the collector
        // from stopping. Dropping the server closes what is left; a batch
        // committed whose answer is lost is retried and found a duplicate.
        tokio::select! {
            served = serve => served.map_err(ServerError::Grpc),
            () = async {
                stopped(grpc_deadline).await;
                tokio::time::sleep(GRACEFUL_SHUTDOWN).await;
            } => {
                tracing::warn!(
                    "gRPC clients still connected {} s after the stop: closing their connections",
                    GRACEFUL_SHUTDOWN.as_secs()
                );
                Ok(())
            }
        }
    });

    let http_addr = match config.http_listen {
        Some(addr) => {
            let listener = TcpListener::bind(addr)
                .await
                .map_err(|source| ServerError::Bind { addr, source })?;
            let bound = listener
                .local_addr()
                .map_err(|source| ServerError::Bind { addr, source })?;
            // Queries and debug files need the query token; probes,
            // metrics and the web UI's files (which hold no data) do not.
            let mut app = http::router(engine.clone()).merge(pyroscope::querier_router(engine));
            if let Some(debuginfo) = &config.debuginfo {
                app = app.merge(debuginfo::debuginfod_router(Arc::clone(&debuginfo.store)));
            }
            // Pyroscope's SDKs push here, with the ingest token.
            let sdk_ingest = pyroscope::ingest_router(sent_ingest.clone())
                .merge(otlp::http_router(sent_ingest.clone()))
                .layer(axum::middleware::from_fn_with_state(
                    ingest_token.clone(),
                    auth::require_http,
                ));
            let app = app
                .layer(axum::middleware::from_fn_with_state(
                    query_token.clone(),
                    auth::require_http,
                ))
                .merge(sdk_ingest)
                .merge(http::ui_router())
                .merge(stackscope_telemetry::router(
                    Arc::new(metrics.registry(
                        Arc::clone(&storage),
                        config.debuginfo.as_ref().map(|d| Arc::clone(&d.symbolizer)),
                    )),
                    Arc::clone(&health),
                ));
            let http_stop = stopped(stop_rx.clone());
            match &config.tls {
                // The same certificate as gRPC: one name, one identity.
                Some(tls) => {
                    let rustls = axum_server::tls_rustls::RustlsConfig::from_config(Arc::new(
                        https_config(tls)?,
                    ));
                    let listener = listener.into_std().map_err(ServerError::Http)?;
                    let handle = axum_server::Handle::new();
                    let stopping = handle.clone();
                    tokio::spawn(async move {
                        http_stop.await;
                        stopping.graceful_shutdown(Some(GRACEFUL_SHUTDOWN));
                    });
                    tasks.spawn(async move {
                        axum_server::from_tcp_rustls(listener, rustls)
                            .handle(handle)
                            .serve(app.into_make_service())
                            .await
                            .map_err(ServerError::Http)
                    });
                }
                None => {
                    tasks.spawn(async move {
                        axum::serve(listener, app)
                            .with_graceful_shutdown(http_stop)
                            .await
                            .map_err(ServerError::Http)
                    });
                }
            }
            Some(bound)
        }
        None => None,
    };

    tasks.spawn(compaction(
        Arc::clone(&storage),
        config.compaction_interval,
        stop_rx.clone(),
    ));
    tasks.spawn(retention(
        storage,
        config.retention,
        config.retention_interval,
        stop_rx.clone(),
    ));
    // Ready from here on; not ready once asked to stop (the servers finish
    // what is in flight meanwhile).
    health.set_ready(true);
    tasks.spawn(async move {
        stopped(stop_rx).await;
        health.set_ready(false);
        Ok(())
    });

    Ok(RunningCollector {
        grpc_addr,
        http_addr,
        stop,
        tasks,
    })
}

/// The HTTP API's TLS settings (rustls with ring, as tonic's): HTTP/2 and
/// HTTP/1.1, the certificate chain and key from the PEM files.
fn https_config(tls: &TlsFiles) -> Result<rustls::ServerConfig, ServerError> {
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject as _};

    let invalid = |what: &str| ServerError::HttpTls(what.to_string());
    let chain = CertificateDer::pem_slice_iter(&tls.cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| invalid(&format!("the certificate PEM: {err}")))?;
    let key = PrivateKeyDer::from_pem_slice(&tls.key_pem)
        .map_err(|err| invalid(&format!("the key PEM: {err}")))?;
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|err| invalid(&err.to_string()))?
    .with_no_client_auth()
    .with_single_cert(chain, key)
    .map_err(|err| invalid(&err.to_string()))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

/// How long after a span of time ends the compactor waits for its batches:
/// agents ship each interval (10 s by default) when it ends, and a batch
/// that comes later still is not lost, it only makes the compactor redo the
/// span.
const COMPACTION_GRACE: Duration = Duration::from_secs(30);

/// Rolls up what ingest changed every `interval` (and once at start, so the
/// history of a database from an older collector is rolled up).
async fn compaction(
    storage: Arc<dyn Storage>,
    interval: Duration,
    stop: watch::Receiver<bool>,
) -> Result<(), ServerError> {
    let mut ticks = ticker(interval);
    while next_tick(&mut ticks, &stop).await {
        let closed_before = unix_nanos(std::time::SystemTime::now() - COMPACTION_GRACE);
        // A call does a bounded amount of work; a backlog takes several,
        // with a chance to stop between them.
        while !*stop.borrow() {
            match in_background(&storage, "compaction", move |s| s.compact(closed_before)).await {
                None | Some(0) => break,
                Some(spans) => tracing::debug!(spans, "compaction: rolled up"),
            }
        }
    }
    Ok(())
}

/// Deletes samples older than `retention` every `interval` (and once at
/// start, so a collector restarted after a long pause catches up).
async fn retention(
    storage: Arc<dyn Storage>,
    retention: Duration,
    interval: Duration,
    stop: watch::Receiver<bool>,
) -> Result<(), ServerError> {
    let mut ticks = ticker(interval);
    while next_tick(&mut ticks, &stop).await {
        let cutoff = unix_nanos(std::time::SystemTime::now() - retention);
        if let Some(deleted) =
            in_background(&storage, "retention", move |s| s.delete_before(cutoff)).await
            && deleted > 0
        {
            tracing::info!(deleted, "retention: deleted old sample rows");
        }
    }
    Ok(())
}

/// Ticks every `interval`, the first at once; a late tick is not caught up.
fn ticker(interval: Duration) -> tokio::time::Interval {
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks
}

/// Waits for the next tick; false once the collector is asked to stop.
async fn next_tick(ticks: &mut tokio::time::Interval, stop: &watch::Receiver<bool>) -> bool {
    tokio::select! {
        _ = ticks.tick() => true,
        _ = stopped(stop.clone()) => false,
    }
}

/// Runs storage work on a blocking thread; a failure is logged as `what`'s
/// (the task goes on with its next tick) and gives `None`.
async fn in_background<T: Send + 'static>(
    storage: &Arc<dyn Storage>,
    what: &'static str,
    work: impl FnOnce(&dyn Storage) -> Result<T, StorageError> + Send + 'static,
) -> Option<T> {
    let storage = Arc::clone(storage);
    match tokio::task::spawn_blocking(move || work(&*storage)).await {
        Ok(Ok(value)) => Some(value),
        Ok(Err(err)) => {
            tracing::warn!("{what}: {:#}", anyhow::Error::from(err));
            None
        }
        Err(err) => {
            tracing::warn!("{what} task failed: {err}");
            None
        }
    }
}
