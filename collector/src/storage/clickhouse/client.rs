//! Talking to ClickHouse servers over their HTTP interface: one blocking
//! HTTP client, statements sent as the request body (or as the `query`
//! parameter with RowBinary rows in the body, for inserts), server errors
//! turned into [`ClickhouseError`]s with ClickHouse's own message. Owns no
//! SQL of the storage engine and no row layout (see `codec`).
//!
//! Blocking, because the `Storage` trait is: the collector calls storage
//! from tokio's blocking threads.

use std::{io::Read as _, sync::Arc, time::Duration};

use bytes::Bytes;

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
///
/// And per client (`Client::new`): `max_execution_time` a little below the
/// request timeout, so a statement the client gives up on stops on the
/// server too, and `max_result_bytes` with `result_overflow_mode=throw`,
/// so an answer larger than the client reads fails on the server (18.16
/// accepts both).
const SETTINGS: &[(&str, &str)] = &[
    ("insert_distributed_sync", "1"),
    ("max_query_size", "67108864"),
    ("wait_end_of_query", "1"),
];

/// Most bytes of a server's error body read and kept in an error.
const MAX_ERROR_BYTES: u64 = 2048;

/// How long an idle connection is kept for reuse: ClickHouse 18.16 closes
/// its side after 3 s (`keep_alive_timeout`), and a request sent on a
/// connection the server is closing fails.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(2);

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
    /// Reading the answer's body failed half-way.
    #[error("reading the answer of {endpoint} failed")]
    Read {
        endpoint: String,
        #[source]
        source: std::io::Error,
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
    /// The answer is longer than the client reads.
    #[error(
        "the answer of {endpoint} is larger than {limit} bytes (the engine's max_response_bytes); \
         select a shorter range or fewer label sets"
    )]
    TooLarge { endpoint: String, limit: u64 },
}

impl ClickhouseError {
    /// Whether the statement ran out of time (the client's request
    /// timeout): the same statement would take as long on another server.
    pub fn is_timeout(&self) -> bool {
        let mut source: Option<&(dyn std::error::Error + 'static)> = Some(self);
        while let Some(err) = source {
            if err
                .downcast_ref::<reqwest::Error>()
                .is_some_and(reqwest::Error::is_timeout)
                || err
                    .downcast_ref::<std::io::Error>()
                    .is_some_and(|e| e.kind() == std::io::ErrorKind::TimedOut)
            {
                return true;
            }
            source = err.source();
        }
        false
    }

    /// Whether the statement never reached the server (no connection was
    /// made): sending it elsewhere cannot run it twice.
    pub fn never_sent(&self) -> bool {
        matches!(self, Self::Transport { source, .. } if source.is_connect())
    }

    /// Whether another server may succeed: the server could not be reached
    /// or dropped the connection, and not because the statement was too
    /// slow (another server would run the same heavy statement again).
    pub fn fails_over(&self) -> bool {
        matches!(self, Self::Transport { .. } | Self::Read { .. }) && !self.is_timeout()
    }
}

/// One ClickHouse server's HTTP endpoint.
#[derive(Clone)]
pub struct Endpoint {
    /// `http://host:port/`
    pub url: String,
    pub user: Option<String>,
    pub password: Option<String>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("url", &self.url)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "…"))
            .finish()
    }
}

/// A blocking HTTP client for a set of servers (the shards); clones share
/// its connections.
#[derive(Clone)]
pub struct Client {
    http: reqwest::blocking::Client,
    /// Settings sent with every statement: `SETTINGS` and the limits.
    settings: Vec<(&'static str, String)>,
    max_response_bytes: u64,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").finish_non_exhaustive()
    }
}

/// The server's own limit on a statement's run time for a client that
/// waits `request_timeout`: a little less, so the server stops the work
/// (and says so) before the client gives up on it. Whole seconds, at least
/// one (0 would mean no limit).
pub fn max_execution_secs(request_timeout: Duration) -> u64 {
    let secs = request_timeout.as_secs();
    secs.saturating_sub((secs / 10).max(1)).max(1)
}

impl Client {
    /// A client whose requests give up after `request_timeout` (and ask
    /// the server to stop a little before, `max_execution_time`) and that
    /// reads answers of at most `max_response_bytes` (also sent as
    /// `max_result_bytes`, so the server stops building a larger one).
    pub fn new(
        connect_timeout: Duration,
        request_timeout: Duration,
        max_response_bytes: u64,
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
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            // A ClickHouse server never redirects; whatever does is not one
            // to send credentials and statements on to.
            .redirect(reqwest::redirect::Policy::none())
            // Plain HTTP only (see `ClickhouseConfig`): no TLS stack to
            // configure, and no proxy from the environment in between.
            .no_proxy()
            .build()?;
        let mut settings: Vec<(&'static str, String)> = SETTINGS
            .iter()
            .map(|&(name, value)| (name, value.to_owned()))
            .collect();
        settings.extend([
            (
                "max_execution_time",
                max_execution_secs(request_timeout).to_string(),
            ),
            ("max_result_bytes", max_response_bytes.to_string()),
            ("result_overflow_mode", "throw".to_owned()),
        ]);
        Ok(Self {
            http,
            settings,
            max_response_bytes,
        })
    }

    /// Runs a statement that answers nothing (DDL, ALTER).
    pub fn execute(&self, endpoint: &Endpoint, sql: &str) -> Result<(), ClickhouseError> {
        self.send(endpoint, None, sql.to_owned()).map(|_| ())
    }

    /// Runs a query and returns its answer's bytes; the query should end
    /// in `FORMAT RowBinary` for `codec::RowReader`.
    pub fn query(&self, endpoint: &Endpoint, sql: &str) -> Result<Vec<u8>, ClickhouseError> {
        self.send(endpoint, None, sql.to_owned())
    }

    /// `INSERT INTO table (columns) FORMAT RowBinary` with `rows` encoded
    /// by `codec::RowWriter` (shared, not copied, when an insert is sent
    /// to another server after a failure).
    pub fn insert(
        &self,
        endpoint: &Endpoint,
        table: &str,
        columns: &str,
        rows: Bytes,
    ) -> Result<(), ClickhouseError> {
        let statement = format!("INSERT INTO {table} ({columns}) FORMAT RowBinary");
        self.send(endpoint, Some(&statement), rows).map(|_| ())
    }

    fn send(
        &self,
        endpoint: &Endpoint,
        query_param: Option<&str>,
        body: impl Into<reqwest::blocking::Body>,
    ) -> Result<Vec<u8>, ClickhouseError> {
        let transport = |source| ClickhouseError::Transport {
            endpoint: endpoint.url.clone(),
            source,
        };
        let read = |source| ClickhouseError::Read {
            endpoint: endpoint.url.clone(),
            source,
        };
        let mut url =
            reqwest::Url::parse(&endpoint.url).map_err(|err| ClickhouseError::Decode {
                endpoint: endpoint.url.clone(),
                message: format!("not a URL: {err}"),
            })?;
        url.query_pairs_mut()
            .extend_pairs(
                self.settings
                    .iter()
                    .map(|(name, value)| (*name, value.as_str())),
            )
            .extend_pairs(query_param.map(|query| ("query", query)));
        let mut request = self.http.post(url).body(body);
        if let Some(user) = &endpoint.user {
            request = request.basic_auth(user, endpoint.password.as_deref());
        }
        let response = request.send().map_err(transport)?;
        let status = response.status();
        let mut bytes = Vec::new();
        if !status.is_success() {
            response
                .take(MAX_ERROR_BYTES)
                .read_to_end(&mut bytes)
                .map_err(read)?;
            let message = String::from_utf8_lossy(&bytes).trim().to_owned();
            return Err(ClickhouseError::Server {
                endpoint: endpoint.url.clone(),
                status: status.as_u16(),
                message,
            });
        }
        response
            .take(self.max_response_bytes.saturating_add(1))
            .read_to_end(&mut bytes)
            .map_err(read)?;
        if bytes.len() as u64 > self.max_response_bytes {
            return Err(ClickhouseError::TooLarge {
                endpoint: endpoint.url.clone(),
                limit: self.max_response_bytes,
            });
        }
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::{
        io::{BufRead as _, BufReader, Write as _},
        net::TcpListener,
    };

    /// A one-shot HTTP server on 127.0.0.1 that reads a request and
    /// answers `answer` (or nothing, holding the connection, when `None`).
    fn server(answer: Option<Vec<u8>>) -> Endpoint {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}/", listener.local_addr().expect("addr"));
        std::thread::spawn(move || {
            let (stream, _) = listener.accept().expect("accept");
            let mut reader = BufReader::new(stream);
            let mut length = 0;
            loop {
                let mut line = String::new();
                reader.read_line(&mut line).expect("a header");
                if let Some(value) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    length = value.trim().parse().expect("a length");
                }
                if line == "\r\n" {
                    break;
                }
            }
            let mut body = vec![0; length];
            std::io::Read::read_exact(&mut reader, &mut body).expect("the body");
            let mut stream = reader.into_inner();
            match answer {
                Some(answer) => {
                    let _ = stream.write_all(&answer);
                }
                None => std::thread::sleep(Duration::from_secs(5)),
            }
        });
        Endpoint {
            url,
            user: Some("u".into()),
            password: Some("secret".into()),
        }
    }

    fn answer(status: &str, headers: &str, body: &[u8]) -> Option<Vec<u8>> {
        let mut answer = format!(
            "HTTP/1.1 {status}\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        )
        .into_bytes();
        answer.extend_from_slice(body);
        Some(answer)
    }

    fn client() -> Client {
        Client::new(Duration::from_secs(1), Duration::from_millis(500), 1000).expect("client")
    }

    #[test]
    fn answers_are_read_up_to_the_limit() {
        let at = server(answer("200 OK", "", &[7; 1000]));
        assert_eq!(
            client().query(&at, "SELECT 1").expect("1000 bytes").len(),
            1000
        );
        let at = server(answer("200 OK", "", &[7; 1001]));
        let err = client().query(&at, "SELECT 1").expect_err("too large");
        assert!(
            matches!(err, ClickhouseError::TooLarge { limit: 1000, .. }),
            "{err:?}"
        );
        assert!(!err.fails_over());
        // An error body is cut at 2 KiB.
        let at = server(answer("500 Internal Server Error", "", &[b'x'; 100_000]));
        match client().query(&at, "SELECT 1") {
            Err(ClickhouseError::Server {
                status: 500,
                message,
                ..
            }) => assert_eq!(message.len(), 2048),
            other => panic!("expected a server error, got {other:?}"),
        }
        // A redirect is not followed.
        let at = server(answer(
            "302 Found",
            "Location: http://127.0.0.1:1/\r\n",
            b"",
        ));
        match client().query(&at, "SELECT 1") {
            Err(ClickhouseError::Server { status: 302, .. }) => {}
            other => panic!("expected the redirect as an error, got {other:?}"),
        }
    }

    #[test]
    fn timeouts_do_not_fail_over() {
        let at = server(None);
        let err = client().query(&at, "SELECT 1").expect_err("no answer");
        assert!(err.is_timeout(), "{err:?}");
        assert!(!err.fails_over(), "{err:?}");
        // Nothing listens on a port just freed: another server may answer.
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let down = Endpoint {
            url: format!("http://127.0.0.1:{port}/"),
            user: None,
            password: None,
        };
        let err = client().query(&down, "SELECT 1").expect_err("refused");
        assert!(!err.is_timeout() && err.fails_over(), "{err:?}");
        assert!(!format!("{at:?}").contains("secret"));
    }

    #[test]
    fn the_server_stops_before_the_client() {
        assert_eq!(max_execution_secs(Duration::from_secs(120)), 108);
        assert_eq!(max_execution_secs(Duration::from_secs(5)), 4);
        assert_eq!(max_execution_secs(Duration::from_millis(500)), 1);
    }
}
