//! `stackscope-collector`: receives agents' batches over gRPC, stores them in
//! an embedded SQLite database (or ClickHouse, `--storage clickhouse://…`),
//! and serves queries over gRPC and HTTP.
//! The command line lives here; the work is in the `stackscope_collector`
//! library.

use std::{io::IsTerminal as _, net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use anyhow::Context as _;
use clap::Parser;
use stackscope_collector::{
    debuginfo::{
        Debuginfo, DebuginfoStore, DiskStore,
        debuginfod::{Debuginfod, DebuginfodConfig},
        symbolize::Symbolizer,
    },
    server::{self, ServerConfig, TlsFiles},
    storage::{
        Storage,
        clickhouse::{self, ClickhouseConfig, ClickhouseOptions, ClickhouseStorage},
        sqlite::{SqliteOptions, SqliteStorage},
    },
};
use tokio::signal::unix::{SignalKind, signal};
use tracing_subscriber::EnvFilter;

/// The stackscope collector.
#[derive(Debug, Parser)]
#[command(name = "stackscope-collector", version)]
struct Args {
    /// Directory of the database (created if missing) and of the debuginfo
    /// store.
    #[arg(long, default_value = "/var/lib/stackscope")]
    data_dir: PathBuf,
    /// Where profiles are stored: `sqlite` (DATA_DIR/stackscope.db), or a
    /// ClickHouse database:
    /// `clickhouse://[USER[:PASSWORD]@]HOST:PORT[,HOST:PORT...]/DATABASE[?cluster=NAME]`
    /// (HTTP ports; with several servers, NAME is the remote_servers
    /// cluster they form and each is one shard). Tables are created if
    /// missing; any number of collectors may share one database.
    #[arg(long, env = "STACKSCOPE_STORAGE", default_value = "sqlite")]
    storage: String,
    /// Address of the gRPC server (ingest, query, health).
    #[arg(long, default_value = "127.0.0.1:7070")]
    grpc_listen: SocketAddr,
    /// Address of the HTTP API.
    #[arg(long, default_value = "127.0.0.1:7071")]
    http_listen: SocketAddr,
    /// Serve no HTTP API.
    #[arg(long)]
    no_http: bool,
    /// Delete samples older than this.
    #[arg(long, default_value = "7d", value_parser = humantime::parse_duration)]
    retention: Duration,
    /// How often samples past the retention are deleted.
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    retention_interval: Duration,
    /// Largest batch accepted, in bytes (decompressed).
    #[arg(long, default_value_t = 64 << 20)]
    max_batch_bytes: usize,
    /// Samples are summed per bucket of this width: smaller buckets give finer
    /// time resolution and a larger database. With ClickHouse, the daily
    /// retention partitions are rounded up to whole buckets (7m: 1442 minutes;
    /// 2d: 2 days).
    #[arg(long, default_value = "1m", value_parser = humantime::parse_duration)]
    bucket: Duration,
    /// PEM certificate chain for gRPC over TLS (with --tls-key).
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// PEM private key for gRPC over TLS (with --tls-cert).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// File holding the bearer token agents must send to push batches.
    #[arg(long)]
    ingest_token_file: Option<PathBuf>,
    /// File holding the bearer token queries must carry (gRPC, and the HTTP
    /// API, where a browser may give it as the password of HTTP Basic
    /// authentication). Health probes and /metrics stay open.
    #[arg(long)]
    query_token_file: Option<PathBuf>,
    /// debuginfod servers to fetch debuginfo from by build-id, space
    /// separated (as `DEBUGINFOD_URLS`); fetched files are kept with the
    /// uploaded ones in DATA_DIR/debuginfo.
    #[arg(long, env = "DEBUGINFOD_URLS", default_value = "")]
    debuginfod_urls: String,
    /// How long a query waits for debuginfod before it answers with the
    /// names at hand (a download still running names later queries).
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    debuginfod_timeout: Duration,
    /// How long a build-id no debuginfod server had is not asked for again.
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    debuginfod_retry_after: Duration,
    /// Largest debuginfo file accepted, uploaded or fetched, in bytes.
    #[arg(long, default_value_t = 2 << 30)]
    max_debuginfo_bytes: u64,
    /// Most bytes the debuginfo store may hold; uploads and fetches beyond
    /// are refused (RESOURCE_EXHAUSTED) until files are removed from
    /// DATA_DIR/debuginfo.
    #[arg(long, default_value_t = 64 << 30)]
    max_debuginfo_store_bytes: u64,
    /// Log level: error, warn, info, debug or trace.
    #[arg(long, default_value = "info")]
    log_level: tracing::Level,
}

fn read(path: &PathBuf, what: &str) -> anyhow::Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("reading the {what} {}", path.display()))
}

/// A token file's contents, surrounding white space trimmed; an empty one
/// is an error (it would let everyone in).
fn read_token(path: Option<&PathBuf>, what: &str) -> anyhow::Result<Option<String>> {
    let Some(path) = path else {
        return Ok(None);
    };
    let token = String::from_utf8(read(path, what)?)
        .with_context(|| format!("{} is not UTF-8", path.display()))?;
    let token = token.trim().to_string();
    if token.is_empty() {
        anyhow::bail!("the {what} {} is empty", path.display());
    }
    Ok(Some(token))
}

/// How long SQLite's dictionary rows may outlive the samples that used
/// them (see [`SqliteOptions::dictionary_epoch_nanos`]): the default, but
/// at most a quarter of the retention, so that a short retention does not
/// keep them several times as long as the samples.
fn dictionary_epoch_nanos(retention: Duration) -> i64 {
    let quarter = i64::try_from(retention.as_nanos() / 4).unwrap_or(i64::MAX);
    quarter.clamp(1, SqliteOptions::default().dictionary_epoch_nanos)
}

/// The storage `--storage` names: SQLite in the data directory, or
/// ClickHouse.
async fn open_storage(
    spec: &str,
    data_dir: &std::path::Path,
    bucket_nanos: i64,
    retention: Duration,
) -> anyhow::Result<Arc<dyn Storage>> {
    if spec == "sqlite" {
        let database = data_dir.join("stackscope.db");
        return tokio::task::spawn_blocking(move || -> anyhow::Result<Arc<dyn Storage>> {
            let storage = SqliteStorage::open(
                &database,
                SqliteOptions {
                    bucket_nanos,
                    dictionary_epoch_nanos: dictionary_epoch_nanos(retention),
                    ..SqliteOptions::default()
                },
            )
            .with_context(|| format!("opening the database in {}", database.display()))?;
            Ok(Arc::new(storage))
        })
        .await?;
    }
    if !spec.starts_with(clickhouse::URL_SCHEME) {
        anyhow::bail!(
            "--storage {spec:?}: expected `sqlite` or a {}… URL",
            clickhouse::URL_SCHEME
        );
    }
    let config = ClickhouseConfig::from_url(spec).context("--storage")?;
    tracing::info!(servers = ?config.servers, database = %config.database,
        cluster = ?config.cluster, "storing profiles in ClickHouse");
    tokio::task::spawn_blocking(move || -> anyhow::Result<Arc<dyn Storage>> {
        let what = format!("opening the ClickHouse database {}", config.database);
        let storage = ClickhouseStorage::open(
            config,
            ClickhouseOptions {
                bucket_nanos,
                ..ClickhouseOptions::default()
            },
        )
        .context(what)?;
        Ok(Arc::new(storage))
    })
    .await?
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::new(args.log_level.as_str()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();

    let bucket_nanos = i64::try_from(args.bucket.as_nanos()).unwrap_or(i64::MAX);
    if bucket_nanos < 1_000_000_000 {
        anyhow::bail!("--bucket must be at least 1s");
    }
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(TlsFiles {
            cert_pem: read(cert, "TLS certificate")?,
            key_pem: read(key, "TLS key")?,
        }),
        _ => None,
    };
    let ingest_token = read_token(args.ingest_token_file.as_ref(), "ingest token file")?;
    let query_token = read_token(args.query_token_file.as_ref(), "query token file")?;

    let storage = open_storage(&args.storage, &args.data_dir, bucket_nanos, args.retention).await?;

    let debuginfo_dir = args.data_dir.join("debuginfo");
    let store: Arc<dyn DebuginfoStore> = Arc::new(
        DiskStore::open(&debuginfo_dir, args.max_debuginfo_store_bytes)
            .with_context(|| format!("opening the debuginfo store {}", debuginfo_dir.display()))?,
    );
    let debuginfod = if args.debuginfod_urls.trim().is_empty() {
        None
    } else {
        let config = DebuginfodConfig {
            query_wait: args.debuginfod_timeout,
            negative_ttl: args.debuginfod_retry_after,
            max_bytes: args.max_debuginfo_bytes,
            ..DebuginfodConfig::from_url_list(&args.debuginfod_urls)
        };
        tracing::info!(urls = ?config.urls, "names missing debuginfo from debuginfod");
        Some(Arc::new(
            Debuginfod::new(config).context("--debuginfod-urls")?,
        ))
    };
    if args.retention_interval < Duration::from_secs(1) {
        anyhow::bail!(
            "--retention-interval {:?} is too short: at least 1s",
            args.retention_interval
        );
    }
    let symbolizer = Symbolizer::start(Arc::clone(&store), debuginfod)
        .context("starting the symbolizer thread")?;
    let config = ServerConfig {
        grpc_listen: args.grpc_listen,
        http_listen: (!args.no_http).then_some(args.http_listen),
        max_message_bytes: args.max_batch_bytes,
        retention: args.retention,
        retention_interval: args.retention_interval,
        tls,
        ingest_token,
        query_token,
        debuginfo: Some(Debuginfo {
            store,
            symbolizer: Arc::new(symbolizer),
            max_upload_bytes: args.max_debuginfo_bytes,
        }),
        ..ServerConfig::default()
    };
    let scheme = if config.tls.is_some() {
        "https"
    } else {
        "http"
    };
    let collector = server::start(config, storage)
        .await
        .context("starting the collector")?;
    tracing::info!(
        grpc = %collector.grpc_addr,
        http = ?collector.http_addr.map(|a| format!("{scheme}://{a}/")),
        data_dir = %args.data_dir.display(),
        "collector ready"
    );

    let stop = collector.stopper();
    let mut sigint = signal(SignalKind::interrupt()).context("installing a SIGINT handler")?;
    let mut sigterm = signal(SignalKind::terminate()).context("installing a SIGTERM handler")?;
    tokio::spawn(async move {
        tokio::select! {
            _ = sigint.recv() => {}
            _ = sigterm.recv() => {}
        }
        tracing::info!("stopping");
        let _ = stop.send(true);
    });
    collector.wait().await.context("the collector failed")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dictionary_rows_outlive_their_samples_by_at_most_a_quarter_of_the_retention() {
        let hour = 3_600_000_000_000;
        assert_eq!(
            dictionary_epoch_nanos(Duration::from_secs(7 * 86_400)),
            hour
        );
        assert_eq!(dictionary_epoch_nanos(Duration::from_secs(4 * 3600)), hour);
        assert_eq!(
            dictionary_epoch_nanos(Duration::from_secs(600)),
            150_000_000_000
        );
        assert_eq!(dictionary_epoch_nanos(Duration::ZERO), 1);
        assert_eq!(dictionary_epoch_nanos(Duration::MAX), hour);
    }
}
