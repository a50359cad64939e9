//! How a client reaches a collector: its endpoint (`http(s)://host[:port]`,
//! checked before anything is sent), TLS (the system's roots, or a CA file;
//! optional mutual TLS) and the bearer token the collector may ask for.
//!
//! Owns turning those settings into a tonic [`Endpoint`] and an
//! `authorization` header, and refusing settings that would misbehave
//! later (TLS options with a plain-text endpoint, a file that holds no PEM
//! block of the kind it is given as, half a client identity), with errors
//! that name the setting or file. Does not connect or retry: the callers
//! (the agent's exporter and uploader, the CLI) decide when.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use tonic::{
    metadata::{Ascii, MetadataValue},
    transport::{Certificate, ClientTlsConfig, Endpoint, Identity, Uri},
};

/// TLS towards the collector. Only valid with an `https://` endpoint; an
/// `https://` endpoint without one uses the default roots.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsConfig {
    /// PEM file with the CA certificate(s) the collector's certificate must
    /// chain to. `None`: the system's roots, or the bundled webpki roots
    /// where the system has none.
    pub ca_cert: Option<PathBuf>,
    /// The name the collector's certificate must carry, when it differs
    /// from the endpoint's host (e.g. the endpoint is an IP address).
    pub domain: Option<String>,
    /// PEM client certificate chain for mutual TLS; needs `client_key`.
    pub client_cert: Option<PathBuf>,
    /// PEM private key of `client_cert`.
    pub client_key: Option<PathBuf>,
}

/// Why the collector cannot be reached with these settings.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The endpoint does not parse as a URI.
    #[error("collector endpoint {endpoint:?}: invalid URI")]
    InvalidUri {
        endpoint: String,
        #[source]
        source: tonic::codegen::http::uri::InvalidUri,
    },
    /// The endpoint parses but is not `http(s)://host[:port]`.
    #[error(
        "collector endpoint {endpoint:?}: {problem} (expected http://host:port or https://host:port)"
    )]
    BadEndpoint {
        endpoint: String,
        problem: &'static str,
    },
    /// TLS options with an `http://` endpoint: tonic would silently talk
    /// plain text, which is never what the options meant.
    #[error("collector endpoint {endpoint:?}: TLS options need an https:// endpoint")]
    TlsWithoutHttps { endpoint: String },
    /// A certificate or key file could not be read.
    #[error("reading {what} {}", path.display())]
    ReadFile {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A certificate or key file holds no PEM block of the expected kind.
    #[error("{what} {}: no PEM {expected} found", path.display())]
    NotPem {
        what: &'static str,
        path: PathBuf,
        expected: &'static str,
    },
    /// Only one of the client certificate and key was given.
    #[error("mutual TLS needs both a client certificate and its key; only the {given} was given")]
    IncompleteClientIdentity { given: &'static str },
    /// tonic/rustls refused the TLS settings (e.g. an unusable key).
    #[error("collector endpoint {endpoint:?}: the TLS settings are not usable")]
    Tls {
        endpoint: String,
        #[source]
        source: tonic::transport::Error,
    },
    /// The token cannot be sent as an HTTP header value.
    #[error("the bearer token must be printable ASCII without line breaks")]
    InvalidToken,
}

/// The collector at `endpoint`, over TLS with `tls` (or the default roots
/// for an `https://` endpoint without it), connecting within
/// `connect_timeout`.
pub fn endpoint(
    endpoint: &str,
    tls: Option<&TlsConfig>,
    connect_timeout: Duration,
) -> Result<Endpoint, ConnectError> {
    let uri = parse_endpoint(endpoint)?;
    let https = uri.scheme_str() == Some("https");
    let channel = Endpoint::from(uri)
        .connect_timeout(connect_timeout)
        // Notices a collector that vanished without closing the connection
        // (a node that lost power) between requests.
        .tcp_keepalive(Some(Duration::from_secs(60)));
    let tls_error = |source| ConnectError::Tls {
        endpoint: endpoint.to_owned(),
        source,
    };
    match (tls, https) {
        (None, false) => Ok(channel),
        (Some(_), false) => Err(ConnectError::TlsWithoutHttps {
            endpoint: endpoint.to_owned(),
        }),
        (None, true) => with_default_roots(channel, ClientTlsConfig::new()).map_err(tls_error),
        (Some(tls), true) => {
            let mut client_tls = ClientTlsConfig::new();
            if let Some(domain) = &tls.domain {
                client_tls = client_tls.domain_name(domain.clone());
            }
            match (&tls.client_cert, &tls.client_key) {
                (Some(cert), Some(key)) => {
                    let cert = read_pem(cert, "client certificate", "CERTIFICATE")?;
                    let key = read_pem(key, "client key", "PRIVATE KEY")?;
                    client_tls = client_tls.identity(Identity::from_pem(cert, key));
                }
                (Some(_), None) => {
                    return Err(ConnectError::IncompleteClientIdentity {
                        given: "certificate",
                    });
                }
                (None, Some(_)) => {
                    return Err(ConnectError::IncompleteClientIdentity { given: "key" });
                }
                (None, None) => {}
            }
            match &tls.ca_cert {
                Some(ca) => {
                    let pem = read_pem(ca, "CA certificate", "CERTIFICATE")?;
                    channel
                        .tls_config(client_tls.ca_certificate(Certificate::from_pem(pem)))
                        .map_err(tls_error)
                }
                None => with_default_roots(channel, client_tls).map_err(tls_error),
            }
        }
    }
}

/// The `authorization` header `token` asks for, if one.
pub fn authorization(token: Option<&str>) -> Result<Option<MetadataValue<Ascii>>, ConnectError> {
    token
        .map(|token| {
            MetadataValue::try_from(format!("Bearer {token}"))
                .map_err(|_| ConnectError::InvalidToken)
        })
        .transpose()
}

fn parse_endpoint(endpoint: &str) -> Result<Uri, ConnectError> {
    let bad = |problem| ConnectError::BadEndpoint {
        endpoint: endpoint.to_owned(),
        problem,
    };
    let uri: Uri = endpoint
        .parse()
        .map_err(|source| ConnectError::InvalidUri {
            endpoint: endpoint.to_owned(),
            source,
        })?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        Some(_) => return Err(bad("the scheme must be http or https")),
        None => return Err(bad("no scheme")),
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err(bad("no host"));
    }
    // tonic would ignore a path and send to the service's path anyway;
    // refusing it avoids a silently misrouted endpoint.
    if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
        return Err(bad("a gRPC endpoint has no path or query"));
    }
    Ok(uri)
}

/// The system's roots carry a site's private CAs, so they come first; a
/// minimal container image may have none, which tonic refuses, and then the
/// bundled webpki roots still reach a collector with a public certificate.
fn with_default_roots(
    endpoint: Endpoint,
    tls: ClientTlsConfig,
) -> Result<Endpoint, tonic::transport::Error> {
    match endpoint
        .clone()
        .tls_config(tls.clone().with_enabled_roots())
    {
        Ok(endpoint) => Ok(endpoint),
        Err(_) => endpoint.tls_config(tls.with_webpki_roots()),
    }
}

/// Reads a PEM file and checks it holds a block of the expected kind, so a
/// wrong file is reported at start, naming the file, rather than as a
/// handshake failure on every request.
fn read_pem(
    path: &Path,
    what: &'static str,
    expected: &'static str,
) -> Result<Vec<u8>, ConnectError> {
    let pem = std::fs::read(path).map_err(|source| ConnectError::ReadFile {
        what,
        path: path.to_owned(),
        source,
    })?;
    let text = String::from_utf8_lossy(&pem);
    // "PRIVATE KEY" also matches "RSA PRIVATE KEY" and "EC PRIVATE KEY".
    let found = text.lines().any(|line| {
        line.strip_prefix("-----BEGIN ")
            .and_then(|rest| rest.strip_suffix("-----"))
            .is_some_and(|label| label.ends_with(expected))
    });
    if !found {
        return Err(ConnectError::NotPem {
            what,
            path: path.to_owned(),
            expected,
        });
    }
    Ok(pem)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_must_be_http_or_https_with_a_host() {
        assert!(parse_endpoint("http://127.0.0.1:7070").is_ok());
        assert!(parse_endpoint("https://collector.example:443/").is_ok());
        for (endpoint, expected) in [
            ("foo", "no scheme"),
            ("ftp://host:21", "the scheme must be http or https"),
            ("http://host:7070/v1", "no path or query"),
            ("grpc://host:7070", "the scheme must be http or https"),
        ] {
            let err = parse_endpoint(endpoint).unwrap_err().to_string();
            assert!(err.contains(expected), "{endpoint}: {err}");
            assert!(
                err.starts_with(&format!("collector endpoint {endpoint:?}: ")),
                "{err}"
            );
        }
        let err = parse_endpoint("http://[::1").unwrap_err();
        assert!(matches!(err, ConnectError::InvalidUri { .. }), "{err:?}");
        assert!(err.to_string().contains("invalid URI"));
    }

    #[test]
    fn pem_check_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ca.pem");
        std::fs::write(&path, "not a certificate\n").unwrap();
        let err = read_pem(&path, "CA certificate", "CERTIFICATE").unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "CA certificate {}: no PEM CERTIFICATE found",
                path.display()
            )
        );
        std::fs::write(
            &path,
            "-----BEGIN EC PRIVATE KEY-----\nAA==\n-----END EC PRIVATE KEY-----\n",
        )
        .unwrap();
        assert!(read_pem(&path, "client key", "PRIVATE KEY").is_ok());
    }
}
