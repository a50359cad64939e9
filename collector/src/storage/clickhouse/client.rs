//! Talking to ClickHouse servers over their HTTP interface: one blocking
//! HTTP client, statements sent as the request body (or as the `query`
//! parameter with RowBinary rows in the body, for inserts), server errors
//! turned into [`ClickhouseError`]s with ClickHouse's own message. Owns no
//! SQL of the storage engine and no row layout (see `codec`).
//!
//! Blocking, because the `Storage` trait is: the collector calls storage
//! from tokio's blocking threads.

use std::{sync::Arc, time::Duration};

/// Settings every statement runs with.
///
/// * `insert_distributed_sync=1`: an insert into a `Distributed` table
///   returns only after every shard has written its rows, so ingest's ack
///   means the shards have them (not a queue on the node that took them).
/// * `max_query_size`: a query names the selected label sets and stacks in
///   `IN (...)` lists; the default 256 KiB would cap them at a few thousand.
/// * `wait_end_of_query=1`: the server buffers the answer, so an error
///   half-way through comes back as an HTTP error, not as a 200 whose body
///   ends in an error message.
const SETTINGS: &[(&str, &str)] = &[
    ("insert_distributed_sync", "1"),
    ("max_query_size", "67108864"),
    ("wait_end_of_query", "1"),
];

/// Most bytes of a server's error body kept in an error.
const MAX_ERROR_BYTES: usize = 2048;

/// Why a statement failed.
#[derive(Debug, thiserror::Error)]
pub enum ClickhouseError {
    /// Connecting, sending or reading failed (server down, timeout, ...).
    #[error("HTTP request to {endpoint} failed")]
    Transport {
        endpoint: String,
        #[source]
        source: reqwest::Error,
    },
    /// The server refused the statement; `message` is its own explanation
    /// (`Code: 60, e.displayText() = DB::Exception: Table ... doesn't exist`).
    #[error("{endpoint} answered HTTP {status}: {message}")]
    Server {
        endpoint: String,
        status: u16,
        message: String,
    },
    /// The server answered with rows this code cannot read.
    #[error("reading the answer of {endpoint}: {message}")]
    Decode { endpoint: String, message: String },
}

/// One ClickHouse server's HTTP endpoint.
#[derive(Debug, Clone)]
pub struct Endpoint {
    /// `http://host:port/`
    pub url: String,
    pub user: Option<String>,
    pub password: Option<String>,
}

/// A blocking HTTP client for a set of servers (the shards).
pub struct Client {
    http: reqwest::blocking::Client,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").finish_non_exhaustive()
    }
}

impl Client {
    pub fn new(
        connect_timeout: Duration,
        request_timeout: Duration,
    ) -> Result<Self, Box<dyn std::error::Error + Send + Sync>> {
        // reqwest is built without a default TLS provider (the workspace
        // keeps aws-lc-rs out); it needs one even for plain HTTP.
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let http = reqwest::blocking::Client::builder()
            .tls_backend_preconfigured(tls)
            .connect_timeout(connect_timeout)
            .timeout(request_timeout)
            // Plain HTTP only (see `ClickhouseConfig`): no TLS stack to
            // configure, and no proxy from the environment in between.
            .no_proxy()
            .build()?;
        Ok(Self { http })
    }

    /// Runs a statement that answers nothing (DDL, ALTER).
    pub fn execute(&self, endpoint: &Endpoint, sql: &str) -> Result<(), ClickhouseError> {
        self.send(endpoint, None, sql.as_bytes().to_vec())
            .map(|_| ())
    }

    /// Runs a query and returns its answer's bytes; the query should end
    /// in `FORMAT RowBinary` for `codec::RowReader`.
    pub fn query(&self, endpoint: &Endpoint, sql: &str) -> Result<Vec<u8>, ClickhouseError> {
        self.send(endpoint, None, sql.as_bytes().to_vec())
    }

    /// `INSERT INTO table (columns) FORMAT RowBinary` with `rows` encoded
    /// by `codec::RowWriter`.
    pub fn insert(
        &self,
        endpoint: &Endpoint,
        table: &str,
        columns: &str,
        rows: Vec<u8>,
    ) -> Result<(), ClickhouseError> {
        let statement = format!("INSERT INTO {table} ({columns}) FORMAT RowBinary");
        self.send(endpoint, Some(&statement), rows).map(|_| ())
    }

    fn send(
        &self,
        endpoint: &Endpoint,
        query_param: Option<&str>,
        body: Vec<u8>,
    ) -> Result<Vec<u8>, ClickhouseError> {
        let transport = |source| ClickhouseError::Transport {
            endpoint: endpoint.url.clone(),
            source,
        };
        let mut url =
            reqwest::Url::parse(&endpoint.url).map_err(|err| ClickhouseError::Decode {
                endpoint: endpoint.url.clone(),
                message: format!("not a URL: {err}"),
            })?;
        url.query_pairs_mut()
            .extend_pairs(SETTINGS)
            .extend_pairs(query_param.map(|query| ("query", query)));
        let mut request = self.http.post(url).body(body);
        if let Some(user) = &endpoint.user {
            request = request.basic_auth(user, endpoint.password.as_deref());
        }
        let response = request.send().map_err(transport)?;
        let status = response.status();
        let bytes = response.bytes().map_err(transport)?;
        if !status.is_success() {
            let end = bytes.len().min(MAX_ERROR_BYTES);
            let message = String::from_utf8_lossy(&bytes[..end]).trim().to_owned();
            return Err(ClickhouseError::Server {
                endpoint: endpoint.url.clone(),
                status: status.as_u16(),
                message,
            });
        }
        Ok(bytes.to_vec())
    }
}
