//! The node's pods, as the local kubelet reports them.
//!
//! The agent runs as a DaemonSet; to label samples with pod, namespace and
//! container names and to select pods by namespace or label, it reads the
//! kubelet's pod list (`GET https://<node>:10250/pods`, a JSON `v1.PodList`,
//! authenticated with the agent's service-account token; or the deprecated
//! plain-HTTP read-only port 10255, which takes no token).
//!
//! This module owns: the connection settings ([`KubeletConfig`]), the HTTP
//! client ([`KubeletClient`]: TLS, bearer token, timeout, body cap), and the
//! parsed, indexed snapshot ([`PodList`]: pod by uid, container by runtime id,
//! selection by namespace and labels).
//!
//! It does not own: mapping a sampled process to its container id (that comes
//! from the process's cgroup path, see [`crate::container`]), deciding how often
//! to refresh, or talking to the API server (the kubelet is node-local, needs
//! no watch, and only knows this node's pods, which is exactly what we want).

use std::{
    collections::{BTreeMap, HashMap},
    ffi::OsString,
    fmt, io,
    net::Ipv6Addr,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use reqwest::header::{AUTHORIZATION, HeaderValue};
use rustls::{
    ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
    client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
    crypto::WebPkiSupportedAlgorithms,
    pki_types::{CertificateDer, ServerName, UnixTime, pem::PemObject},
};
use serde::{Deserialize, Deserializer};

/// Where the kubelet serves its authenticated API.
pub const KUBELET_PORT: u16 = 10250;

/// The token Kubernetes mounts into every pod that automounts its service
/// account. A projected, rotating token: read it per request, never cache it.
pub const SERVICE_ACCOUNT_TOKEN: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";

/// The largest pod-list body accepted. A node runs at most a few hundred pods
/// (110 by default) and a full `v1.Pod` is a few tens of KiB, so a real list
/// stays far below this; the cap exists so that a wrong URL or a broken proxy
/// cannot make the agent buffer an unbounded body.
pub const MAX_POD_LIST_BYTES: usize = 64 << 20;

/// How much of an error response's body goes into [`KubeletError::Status`].
/// The kubelet's 403 body names the user, verb and subresource that RBAC
/// refused, which is the most useful part of the message.
const MAX_ERROR_BODY_BYTES: usize = 512;

/// How long one pod list fetch may take.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

/// How to reach the kubelet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeletConfig {
    /// The pod-list URL, e.g. `https://10.0.0.7:10250/pods` or, for the
    /// deprecated read-only port, `http://127.0.0.1:10255/pods`.
    pub url: String,
    /// A file holding a bearer token, re-read on every fetch (projected
    /// service-account tokens rotate, hourly by default). Leave it `None` for
    /// the read-only port, which ignores authentication.
    pub token_file: Option<PathBuf>,
    /// PEM file with the CA(s) that sign the kubelet's serving certificate.
    /// When given it wins over `insecure_skip_tls_verify`: verification is
    /// always preferred when it is possible.
    pub ca_cert: Option<PathBuf>,
    /// Accept any server certificate (the handshake signature is still
    /// checked). Needed on most clusters: kubelets serve a self-signed
    /// certificate unless `serverTLSBootstrap` is enabled, so there is no CA
    /// to trust. The token still only travels to the URL configured here.
    pub insecure_skip_tls_verify: bool,
    /// Limit for the whole request: connect, TLS, headers and body.
    pub timeout: Duration,
}

impl KubeletConfig {
    /// `url` with no token, the system's roots and the default timeout.
    pub fn new(url: &str) -> Self {
        Self {
            url: url.to_owned(),
            token_file: None,
            ca_cert: None,
            insecure_skip_tls_verify: false,
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// The settings for an agent running in a pod of the cluster, or `None`
    /// outside Kubernetes (no `KUBERNETES_SERVICE_HOST` in the environment).
    ///
    /// The kubelet is reached at `NODE_IP` (which the DaemonSet sets from the
    /// downward API's `status.hostIP`), else at 127.0.0.1 (right for
    /// host-network pods). TLS verification is off because kubelet serving
    /// certificates are usually self-signed (see
    /// [`KubeletConfig::insecure_skip_tls_verify`]).
    pub fn in_cluster_default() -> Option<Self> {
        Self::in_cluster_from(
            std::env::var_os("KUBERNETES_SERVICE_HOST"),
            std::env::var("NODE_IP").ok(),
            Path::new(SERVICE_ACCOUNT_TOKEN),
        )
    }

    /// [`Self::in_cluster_default`] with its inputs passed in, so tests need
    /// not mutate the process environment.
    fn in_cluster_from(
        service_host: Option<OsString>,
        node_ip: Option<String>,
        token_path: &Path,
    ) -> Option<Self> {
        service_host.filter(|host| !host.is_empty())?;
        let host = node_ip
            .as_deref()
            .map(str::trim)
            .filter(|ip| !ip.is_empty())
            .unwrap_or("127.0.0.1");
        Some(Self {
            url: pods_url(host, KUBELET_PORT),
            token_file: token_path.exists().then(|| token_path.to_owned()),
            ca_cert: None,
            insecure_skip_tls_verify: true,
            timeout: DEFAULT_TIMEOUT,
        })
    }
}

/// `https://host:port/pods`, bracketing IPv6 literals (dual-stack and
/// IPv6-only clusters give the node an IPv6 `hostIP`).
fn pods_url(host: &str, port: u16) -> String {
    if host.parse::<Ipv6Addr>().is_ok() {
        format!("https://[{host}]:{port}/pods")
    } else {
        format!("https://{host}:{port}/pods")
    }
}

/// Why reading or parsing the kubelet's pod list failed.
#[derive(Debug, thiserror::Error)]
pub enum KubeletError {
    /// The configured URL does not parse, or is neither http nor https.
    #[error("invalid kubelet URL {url:?}: {reason}")]
    InvalidUrl { url: String, reason: String },
    /// An https URL with neither a CA nor insecure mode: kubelet certificates
    /// are never signed by public roots, so every handshake would fail.
    #[error(
        "kubelet URL {url} is https but neither a CA certificate nor \
         insecure_skip_tls_verify is configured"
    )]
    NoTlsTrust { url: String },
    /// The CA file could not be read.
    #[error("reading the kubelet CA certificate {path}")]
    CaCertRead {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The CA file is not usable PEM, or holds no certificate.
    #[error("kubelet CA certificate {path}: {reason}")]
    CaCertInvalid { path: PathBuf, reason: String },
    /// rustls refused the TLS settings.
    #[error("kubelet TLS settings")]
    Tls(#[source] rustls::Error),
    /// reqwest could not build the client.
    #[error("building the kubelet HTTP client")]
    Client(#[source] reqwest::Error),
    /// The bearer token file could not be read.
    #[error("reading the kubelet bearer token {path}")]
    TokenRead {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The token file is empty or holds bytes not allowed in an HTTP header.
    #[error("the kubelet bearer token in {path} is empty or not a valid header value")]
    TokenInvalid { path: PathBuf },
    /// Connecting, the TLS handshake, the timeout, or reading the body failed.
    #[error("kubelet request to {url} failed ({what})")]
    Request {
        url: String,
        /// What kind of failure, so that a log line printing only this
        /// error (not its sources) still says whether it timed out, could
        /// not connect or broke off.
        what: &'static str,
        #[source]
        source: reqwest::Error,
    },
    /// The kubelet answered with a non-2xx status.
    #[error("kubelet {url} answered {status}{hint}: {body:?}")]
    Status {
        url: String,
        status: reqwest::StatusCode,
        /// Extra advice for statuses that have a usual cause (401/403: RBAC).
        hint: &'static str,
        /// The start of the response body, lossily decoded.
        body: String,
    },
    /// The body is larger than the cap (see [`MAX_POD_LIST_BYTES`]).
    #[error("kubelet {url} sent a pod list larger than {limit} bytes")]
    BodyTooLarge { url: String, limit: usize },
    /// The body is not JSON of the expected shape.
    #[error("malformed kubelet pod list")]
    Json(#[source] serde_json::Error),
    /// Valid JSON, but not a `v1.PodList` (e.g. a `v1.Status`, or a wrong path
    /// answering JSON). Kept apart from an empty list so that a wrong URL is
    /// an error instead of silently unlabelling every sample.
    #[error("kubelet answer is not a v1.PodList (kind {kind:?})")]
    NotAPodList { kind: Option<String> },
}

/// The advice attached to a status error.
fn status_hint(status: reqwest::StatusCode) -> &'static str {
    match status.as_u16() {
        401 => {
            " (unauthenticated: check the service-account token; with RBAC the agent's \
             service account needs `get` on `nodes/proxy` or `nodes/pods`)"
        }
        403 => {
            " (forbidden by RBAC: the agent's service account needs `get` on \
             `nodes/proxy` or `nodes/pods`)"
        }
        _ => "",
    }
}

/// One pod on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodInfo {
    pub uid: String,
    pub name: String,
    pub namespace: String,
    pub labels: BTreeMap<String, String>,
    /// The controller that made the pod (`ReplicaSet`, `DaemonSet`, ...)
    /// and its name, when one did.
    pub owner: Option<(String, String)>,
    /// Started containers (regular, init and ephemeral), in that order.
    pub containers: Vec<PodContainer>,
}

impl PodInfo {
    /// The service the pod is part of, as Pyroscope and Grafana name
    /// services (`service_name`): its `app.kubernetes.io/name` or `app`
    /// label, else its controller's workload (a Deployment's name, from its
    /// ReplicaSet's; a DaemonSet's, StatefulSet's or Job's own), else
    /// nothing.
    pub fn service_name(&self) -> Option<&str> {
        for key in ["app.kubernetes.io/name", "app"] {
            if let Some(name) = self.labels.get(key).filter(|v| !v.is_empty()) {
                return Some(name);
            }
        }
        let (kind, name) = self.owner.as_ref()?;
        let deployment = (kind == "ReplicaSet")
            .then(|| {
                let hash = self.labels.get("pod-template-hash")?;
                name.strip_suffix(hash.as_str())?.strip_suffix('-')
            })
            .flatten();
        Some(deployment.unwrap_or(name)).filter(|name| !name.is_empty())
    }
}

/// One started container of a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodContainer {
    /// The bare 64-hex runtime id, lowercase, with the runtime scheme
    /// (`containerd://`, `cri-o://`, `docker://`) stripped: the same form the
    /// id takes in cgroup paths, so the two can be joined.
    pub id: String,
    /// The container's name in the pod spec.
    pub name: String,
}

/// A parsed pod list with lookups by container id and pod uid.
#[derive(Debug, Clone, Default)]
pub struct PodList {
    pods: Vec<PodInfo>,
    /// container id -> (index into `pods`, index into its `containers`).
    by_container: HashMap<String, (usize, usize)>,
    /// pod uid -> index into `pods`.
    by_uid: HashMap<String, usize>,
}

impl PodList {
    /// Parses a `v1.PodList` JSON document.
    ///
    /// Unknown fields are ignored and missing optional ones tolerated (the
    /// kubelet and API versions vary). Pods without a uid are skipped, as are
    /// container statuses without a container id (not started yet) or with
    /// one that is not 64 hex digits (it could never match a cgroup path).
    pub fn parse(json: &[u8]) -> Result<PodList, KubeletError> {
        let wire: WirePodList = serde_json::from_slice(json).map_err(KubeletError::Json)?;
        if wire.kind.as_deref().is_some_and(|kind| kind != "PodList") {
            return Err(KubeletError::NotAPodList { kind: wire.kind });
        }
        // The kubelet always writes `items` (as `null` when there are no
        // pods); its absence means this is some other JSON document.
        let Some(items) = wire.items else {
            return Err(KubeletError::NotAPodList { kind: wire.kind });
        };
        let mut list = PodList::default();
        for pod in items.unwrap_or_default() {
            list.push(pod);
        }
        Ok(list)
    }

    fn push(&mut self, pod: WirePod) {
        let meta = pod.metadata.unwrap_or_default();
        let Some(uid) = meta.uid.filter(|uid| !uid.is_empty()) else {
            return;
        };
        if self.by_uid.contains_key(&uid) {
            return;
        }
        let status = pod.status.unwrap_or_default();
        let containers: Vec<PodContainer> = [
            status.container_statuses,
            status.init_container_statuses,
            status.ephemeral_container_statuses,
        ]
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|c| {
            Some(PodContainer {
                id: normalize_container_id(c.container_id.as_deref()?)?,
                name: c.name.unwrap_or_default(),
            })
        })
        .collect();

        let pod_index = self.pods.len();
        for (i, container) in containers.iter().enumerate() {
            // An id cannot belong to two live pods; if a stale entry ever
            // repeats one, the first pod listed keeps it.
            self.by_container
                .entry(container.id.clone())
                .or_insert((pod_index, i));
        }
        self.by_uid.insert(uid.clone(), pod_index);
        self.pods.push(PodInfo {
            uid,
            name: meta.name.unwrap_or_default(),
            namespace: meta.namespace.unwrap_or_default(),
            labels: meta.labels.unwrap_or_default(),
            owner: meta.owner_references.and_then(|owners| {
                // The controller if one is marked, else the first owner.
                let at = owners
                    .iter()
                    .position(|o| o.controller == Some(true))
                    .unwrap_or(0);
                let owner = owners.into_iter().nth(at)?;
                Some((owner.kind?, owner.name?))
            }),
            containers,
        });
    }

    /// Every pod, in the kubelet's order.
    pub fn pods(&self) -> &[PodInfo] {
        &self.pods
    }

    /// The pod and container with this runtime id. Takes the bare id or the
    /// kubelet's `scheme://id` form, in either case.
    pub fn by_container_id(&self, id: &str) -> Option<(&PodInfo, &PodContainer)> {
        let &(pod, container) = match self.by_container.get(id) {
            Some(hit) => hit,
            None => self.by_container.get(&normalize_container_id(id)?)?,
        };
        let pod = &self.pods[pod];
        Some((pod, &pod.containers[container]))
    }

    /// The pod with this uid (`metadata.uid`, also found in cgroup paths).
    pub fn by_uid(&self, uid: &str) -> Option<&PodInfo> {
        self.by_uid.get(uid).map(|&i| &self.pods[i])
    }

    /// The pods selected by namespace and labels, in the kubelet's order.
    ///
    /// A pod is selected when `namespaces` is empty or contains its
    /// namespace, AND it carries every `(key, value)` pair of `labels` with
    /// exactly that value (an empty `labels` selects every pod). This is
    /// Kubernetes' equality-based selector: namespaces are alternatives,
    /// labels all have to hold.
    pub fn matching(&self, namespaces: &[String], labels: &[(String, String)]) -> Vec<&PodInfo> {
        self.pods
            .iter()
            .filter(|pod| namespaces.is_empty() || namespaces.contains(&pod.namespace))
            .filter(|pod| {
                labels
                    .iter()
                    .all(|(key, value)| pod.labels.get(key) == Some(value))
            })
            .collect()
    }
}

/// `containerd://ABC…` -> `abc…`; `None` unless the id is 64 hex digits.
fn normalize_container_id(raw: &str) -> Option<String> {
    let bare = raw.rsplit_once("://").map_or(raw, |(_, id)| id).trim();
    (bare.len() == 64 && bare.bytes().all(|b| b.is_ascii_hexdigit()))
        .then(|| bare.to_ascii_lowercase())
}

// The subset of `v1.PodList` read here. Every field is optional: the kubelet
// omits empty ones and Go writes nil slices and maps as `null`.

#[derive(Deserialize)]
struct WirePodList {
    kind: Option<String>,
    /// Outer `None`: no `items` key; inner `None`: `"items": null`.
    #[serde(default, deserialize_with = "present")]
    items: Option<Option<Vec<WirePod>>>,
}

/// Marks a field as present even when its value is `null`.
fn present<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    T::deserialize(deserializer).map(Some)
}

#[derive(Deserialize)]
struct WirePod {
    metadata: Option<WireMeta>,
    status: Option<WireStatus>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct WireMeta {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    labels: Option<BTreeMap<String, String>>,
    owner_references: Option<Vec<WireOwner>>,
}

#[derive(Deserialize)]
struct WireOwner {
    kind: Option<String>,
    name: Option<String>,
    controller: Option<bool>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct WireStatus {
    container_statuses: Option<Vec<WireContainerStatus>>,
    init_container_statuses: Option<Vec<WireContainerStatus>>,
    ephemeral_container_statuses: Option<Vec<WireContainerStatus>>,
}

#[derive(Deserialize)]
struct WireContainerStatus {
    name: Option<String>,
    #[serde(rename = "containerID")]
    container_id: Option<String>,
}

/// Fetches the pod list from the kubelet.
#[derive(Debug, Clone)]
pub struct KubeletClient {
    http: reqwest::Client,
    url: String,
    token_file: Option<PathBuf>,
    max_body: usize,
}

impl KubeletClient {
    /// Checks the URL, loads the CA (once: it does not rotate like the
    /// token) and builds the HTTP client. Does not contact the kubelet.
    pub fn new(config: KubeletConfig) -> Result<Self, KubeletError> {
        let url = reqwest::Url::parse(&config.url).map_err(|e| KubeletError::InvalidUrl {
            url: config.url.clone(),
            reason: e.to_string(),
        })?;
        let https = match url.scheme() {
            "https" => true,
            "http" => false,
            other => {
                return Err(KubeletError::InvalidUrl {
                    url: config.url,
                    reason: format!("scheme {other:?} is neither http nor https"),
                });
            }
        };
        let tls = tls_config(&config, https)?;
        let http = reqwest::Client::builder()
            // Always our own ring-backed rustls config: the crate is built
            // without a default crypto provider and would panic otherwise.
            .tls_backend_preconfigured(tls)
            // The kubelet is node-local; an HTTPS_PROXY meant for the
            // collector upload must not capture it (nor see the token).
            .no_proxy()
            .timeout(config.timeout)
            .connect_timeout(config.timeout)
            .build()
            .map_err(KubeletError::Client)?;
        Ok(Self {
            http,
            url: config.url,
            token_file: config.token_file,
            max_body: MAX_POD_LIST_BYTES,
        })
    }

    /// A smaller body cap, so tests need not send 64 MiB.
    #[cfg(test)]
    fn with_max_body(mut self, max_body: usize) -> Self {
        self.max_body = max_body;
        self
    }

    /// Reads the current pod list.
    pub async fn fetch(&self) -> Result<PodList, KubeletError> {
        let mut request = self.http.get(&self.url);
        if let Some(path) = &self.token_file {
            request = request.header(AUTHORIZATION, bearer(path)?);
        }
        let request_error = |source: reqwest::Error| KubeletError::Request {
            url: self.url.clone(),
            what: if source.is_timeout() {
                "timed out"
            } else if source.is_connect() {
                "connecting or the TLS handshake failed"
            } else if source.is_body() || source.is_decode() {
                "reading the body"
            } else {
                "sending the request"
            },
            source,
        };
        let mut response = request.send().await.map_err(request_error)?;

        let status = response.status();
        if !status.is_success() {
            // Best effort: the status alone is the error if the body fails.
            let mut body = Vec::new();
            while body.len() < MAX_ERROR_BODY_BYTES {
                match response.chunk().await {
                    Ok(Some(chunk)) => body.extend_from_slice(&chunk),
                    _ => break,
                }
            }
            body.truncate(MAX_ERROR_BODY_BYTES);
            return Err(KubeletError::Status {
                url: self.url.clone(),
                status,
                hint: status_hint(status),
                body: String::from_utf8_lossy(&body).trim().to_owned(),
            });
        }

        let too_large = || KubeletError::BodyTooLarge {
            url: self.url.clone(),
            limit: self.max_body,
        };
        // Refuse early when the length is announced; still count while
        // reading, since chunked and close-delimited bodies announce nothing.
        let announced = response.content_length().unwrap_or(0);
        if announced > self.max_body as u64 {
            return Err(too_large());
        }
        let mut body = Vec::with_capacity(announced as usize);
        while let Some(chunk) = response.chunk().await.map_err(request_error)? {
            if body.len() + chunk.len() > self.max_body {
                return Err(too_large());
            }
            body.extend_from_slice(&chunk);
        }
        PodList::parse(&body)
    }
}

/// The `Authorization` header from the token file, read now: projected
/// tokens are rewritten in place by the kubelet before they expire. A
/// blocking read is fine here: it is a small file on tmpfs, read once per
/// fetch.
fn bearer(path: &Path) -> Result<HeaderValue, KubeletError> {
    let token = std::fs::read_to_string(path).map_err(|source| KubeletError::TokenRead {
        path: path.to_owned(),
        source,
    })?;
    let token = token.trim();
    let invalid = || KubeletError::TokenInvalid {
        path: path.to_owned(),
    };
    if token.is_empty() {
        return Err(invalid());
    }
    let mut value = HeaderValue::from_str(&format!("Bearer {token}")).map_err(|_| invalid())?;
    // Keeps the token out of reqwest's and hyper's debug output.
    value.set_sensitive(true);
    Ok(value)
}

/// The rustls client settings: the given CA, else no verification when
/// allowed, else (plain http only) an empty trust store that is never used.
fn tls_config(config: &KubeletConfig, https: bool) -> Result<ClientConfig, KubeletError> {
    // ring, like tonic elsewhere in the agent; passed explicitly so that no
    // process-wide default provider has to be installed.
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(KubeletError::Tls)?;
    let config = if let Some(path) = &config.ca_cert {
        builder
            .with_root_certificates(load_roots(path)?)
            .with_no_client_auth()
    } else if config.insecure_skip_tls_verify {
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyServerCert {
                algorithms: provider.signature_verification_algorithms,
            }))
            .with_no_client_auth()
    } else if https {
        return Err(KubeletError::NoTlsTrust {
            url: config.url.clone(),
        });
    } else {
        builder
            .with_root_certificates(RootCertStore::empty())
            .with_no_client_auth()
    };
    Ok(config)
}

fn load_roots(path: &Path) -> Result<RootCertStore, KubeletError> {
    let pem = std::fs::read(path).map_err(|source| KubeletError::CaCertRead {
        path: path.to_owned(),
        source,
    })?;
    let invalid = |reason: String| KubeletError::CaCertInvalid {
        path: path.to_owned(),
        reason,
    };
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&pem) {
        let cert = cert.map_err(|e| invalid(e.to_string()))?;
        roots.add(cert).map_err(|e| invalid(e.to_string()))?;
    }
    if roots.is_empty() {
        return Err(invalid("no certificate in the file".to_owned()));
    }
    Ok(roots)
}

/// Accepts any server certificate but still verifies the handshake
/// signatures, so the peer must at least hold the key of the certificate it
/// shows (for `insecure_skip_tls_verify`).
struct AnyServerCert {
    algorithms: WebPkiSupportedAlgorithms,
}

impl fmt::Debug for AnyServerCert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AnyServerCert")
    }
}

impl ServerCertVerifier for AnyServerCert {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use rustls::{
        ServerConfig,
        pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer},
    };
    use stackscope_test_fixtures::tls::TestPki;
    use tokio::{
        io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt},
        net::TcpListener,
        sync::oneshot,
        task::JoinHandle,
    };
    use tokio_rustls::TlsAcceptor;

    const NGINX: &str = "3f1b2c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f809";
    const SIDECAR: &str = "a0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1";
    const INIT: &str = "0011223344556677889900aabbccddeeff00112233445566778899aabbccddee";
    const DEBUG: &str = "ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100";
    const ETCD: &str = "5a5b5c5d5e5f505152535455565758595a5b5c5d5e5f50515253545556575859";

    /// A kubelet `/pods` answer, following `v1.PodList`: a Deployment pod
    /// with a sidecar, an init container and an ephemeral debug container; a
    /// pod still pulling its image; a static (mirror) pod; a pod without a
    /// uid. Fields this module ignores are kept to prove they are ignored.
    fn pod_list_json() -> String {
        format!(
            r#"{{
  "kind": "PodList",
  "apiVersion": "v1",
  "metadata": {{}},
  "items": [
    {{
      "metadata": {{
        "name": "web-7d4b9c8f6-x2k9p",
        "generateName": "web-7d4b9c8f6-",
        "namespace": "shop",
        "uid": "0b9d4c5e-1a2b-4c3d-9e8f-001122334455",
        "resourceVersion": "81233",
        "creationTimestamp": "2025-01-07T10:00:00Z",
        "labels": {{"app": "web", "pod-template-hash": "7d4b9c8f6", "tier": "frontend"}},
        "annotations": {{"kubernetes.io/config.seen": "2025-01-07T10:00:00.1Z"}},
        "ownerReferences": [{{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-7d4b9c8f6", "uid": "9f0e", "controller": true}}]
      }},
      "spec": {{
        "containers": [{{"name": "nginx", "image": "nginx:1.27"}}, {{"name": "envoy", "image": "envoy:1.31"}}],
        "initContainers": [{{"name": "migrate", "image": "web-migrate:3"}}],
        "nodeName": "node-1"
      }},
      "status": {{
        "phase": "Running",
        "hostIP": "10.0.0.7",
        "podIP": "10.244.1.12",
        "initContainerStatuses": [{{
          "name": "migrate",
          "state": {{"terminated": {{"exitCode": 0, "reason": "Completed"}}}},
          "ready": true, "restartCount": 0,
          "image": "web-migrate:3", "imageID": "sha256:1234",
          "containerID": "containerd://{INIT}"
        }}],
        "containerStatuses": [
          {{
            "name": "nginx",
            "state": {{"running": {{"startedAt": "2025-01-07T10:00:05Z"}}}},
            "ready": true, "restartCount": 0, "started": true,
            "image": "docker.io/library/nginx:1.27", "imageID": "docker.io/library/nginx@sha256:abcd",
            "containerID": "containerd://{NGINX}"
          }},
          {{
            "name": "envoy",
            "state": {{"running": {{"startedAt": "2025-01-07T10:00:06Z"}}}},
            "ready": true, "restartCount": 2,
            "containerID": "CONTAINERD://{sidecar_upper}"
          }}
        ],
        "ephemeralContainerStatuses": [{{
          "name": "debugger-abc12",
          "state": {{"running": {{}}}},
          "containerID": "containerd://{DEBUG}"
        }}]
      }}
    }},
    {{
      "metadata": {{
        "name": "batch-job-q8z7w",
        "namespace": "jobs",
        "uid": "7c1d2e3f-4a5b-6c7d-8e9f-a0b1c2d3e4f5",
        "labels": {{"app": "batch"}}
      }},
      "spec": {{"containers": [{{"name": "worker", "image": "worker:9"}}]}},
      "status": {{
        "phase": "Pending",
        "containerStatuses": [{{
          "name": "worker",
          "state": {{"waiting": {{"reason": "ContainerCreating"}}}},
          "ready": false, "restartCount": 0, "image": "worker:9", "imageID": ""
        }}, {{
          "name": "shim",
          "state": {{"waiting": {{"reason": "ContainerCreating"}}}},
          "containerID": ""
        }}]
      }}
    }},
    {{
      "metadata": {{
        "name": "etcd-node-1",
        "namespace": "kube-system",
        "uid": "d41d8cd98f00b204e9800998ecf8427e",
        "labels": {{"component": "etcd", "tier": "control-plane"}},
        "annotations": {{
          "kubernetes.io/config.source": "file",
          "kubernetes.io/config.mirror": "d41d8cd98f00b204e9800998ecf8427e",
          "kubernetes.io/config.hash": "d41d8cd98f00b204e9800998ecf8427e"
        }}
      }},
      "spec": {{"containers": [{{"name": "etcd"}}], "hostNetwork": true, "priorityClassName": "system-node-critical"}},
      "status": {{
        "phase": "Running",
        "containerStatuses": [{{"name": "etcd", "containerID": "cri-o://{ETCD}", "ready": true}}]
      }}
    }},
    {{
      "metadata": {{"name": "no-uid", "namespace": "shop", "labels": {{"app": "web"}}}},
      "status": {{"containerStatuses": [{{"name": "ghost", "containerID": "docker://{ghost}"}}]}}
    }}
  ]
}}"#,
            sidecar_upper = SIDECAR.to_ascii_uppercase(),
            ghost = "1".repeat(64),
        )
    }

    fn parsed() -> PodList {
        PodList::parse(pod_list_json().as_bytes()).expect("a valid pod list")
    }

    fn names<'a>(pods: impl IntoIterator<Item = &'a PodInfo>) -> Vec<&'a str> {
        pods.into_iter().map(|pod| pod.name.as_str()).collect()
    }

    #[test]
    fn parses_a_realistic_pod_list() {
        let list = parsed();
        assert_eq!(
            names(list.pods()),
            ["web-7d4b9c8f6-x2k9p", "batch-job-q8z7w", "etcd-node-1"],
            "the pod without a uid is skipped"
        );

        let web = &list.pods()[0];
        assert_eq!(web.uid, "0b9d4c5e-1a2b-4c3d-9e8f-001122334455");
        assert_eq!(web.namespace, "shop");
        assert_eq!(web.labels["app"], "web");
        assert_eq!(web.labels.len(), 3);
        assert_eq!(
            web.owner,
            Some(("ReplicaSet".to_owned(), "web-7d4b9c8f6".to_owned()))
        );
        assert_eq!(list.pods()[2].owner, None);
        let container = |id: &str, name: &str| PodContainer {
            id: id.to_owned(),
            name: name.to_owned(),
        };
        assert_eq!(
            web.containers,
            [
                container(NGINX, "nginx"),
                container(SIDECAR, "envoy"),
                container(INIT, "migrate"),
                container(DEBUG, "debugger-abc12"),
            ],
            "regular, then init, then ephemeral; scheme stripped, lowercase"
        );

        let pending = &list.pods()[1];
        assert!(pending.containers.is_empty(), "{pending:?}");

        let etcd = list
            .by_uid("d41d8cd98f00b204e9800998ecf8427e")
            .expect("static pod");
        assert_eq!(
            (etcd.name.as_str(), etcd.namespace.as_str()),
            ("etcd-node-1", "kube-system")
        );
        assert_eq!(etcd.containers, [container(ETCD, "etcd")]);
    }

    #[test]
    fn looks_containers_up_by_id_in_any_form() {
        let list = parsed();
        let (pod, container) = list.by_container_id(SIDECAR).expect("sidecar");
        assert_eq!(
            (pod.name.as_str(), container.name.as_str()),
            ("web-7d4b9c8f6-x2k9p", "envoy")
        );
        for form in [
            format!("containerd://{INIT}"),
            INIT.to_ascii_uppercase(),
            format!("docker://{}", INIT.to_ascii_uppercase()),
        ] {
            let (_, container) = list.by_container_id(&form).expect(&form);
            assert_eq!(container.name, "migrate");
        }
        let (pod, _) = list.by_container_id(ETCD).expect("static pod container");
        assert_eq!(pod.name, "etcd-node-1");
        assert!(
            list.by_container_id(&"1".repeat(64)).is_none(),
            "pod without uid"
        );
        assert!(list.by_container_id("").is_none());
        assert!(list.by_container_id("containerd://").is_none());
        assert!(list.by_container_id(&NGINX[..63]).is_none());
        assert!(list.by_uid("nope").is_none());
    }

    #[test]
    fn tolerates_missing_and_null_fields() {
        for (json, pods) in [
            (
                r#"{"kind":"PodList","apiVersion":"v1","metadata":{},"items":null}"#,
                0,
            ),
            (r#"{"items":[]}"#, 0),
            (r#"{"items":[{}]}"#, 0),
            (r#"{"items":[{"metadata":{"uid":"u1"}}]}"#, 1),
            (
                r#"{"items":[{"metadata":{"uid":"u1","name":null,"labels":null},
                    "status":{"containerStatuses":null,"initContainerStatuses":[{"name":"x"}]}}]}"#,
                1,
            ),
            // A repeated uid keeps the first pod.
            (
                r#"{"items":[{"metadata":{"uid":"u1","name":"a"}},{"metadata":{"uid":"u1","name":"b"}}]}"#,
                1,
            ),
        ] {
            let list = PodList::parse(json.as_bytes()).expect(json);
            assert_eq!(list.pods().len(), pods, "{json}");
        }
        let list = PodList::parse(br#"{"items":[{"metadata":{"uid":"u1"}}]}"#).expect("valid");
        let pod = list.by_uid("u1").expect("pod");
        assert_eq!((pod.name.as_str(), pod.namespace.as_str()), ("", ""));
        assert!(pod.labels.is_empty() && pod.containers.is_empty());
    }

    #[test]
    fn malformed_or_foreign_json_is_an_error() {
        let full = pod_list_json();
        // Every proper prefix of the document is invalid JSON.
        for cut in (0..full.len()).step_by(97).chain([full.len() - 1]) {
            let err = PodList::parse(&full.as_bytes()[..cut]).expect_err("truncated");
            assert!(
                matches!(err, KubeletError::Json(_)),
                "cut at {cut}: {err:?}"
            );
        }
        for json in [
            &b""[..],
            b"null",
            b"[]",
            b"\xff\xfe",
            br#"{"items": {}}"#,
            br#"{"items": [{"metadata": {"uid": 7}}]}"#,
            br#"{"items": [{"metadata": {"uid": "u", "labels": {"a": 1}}}]}"#,
        ] {
            let err = PodList::parse(json).expect_err("malformed");
            assert!(matches!(err, KubeletError::Json(_)), "{json:?}: {err:?}");
            assert_eq!(err.to_string(), "malformed kubelet pod list");
        }
        let status = br#"{"kind":"Status","apiVersion":"v1","status":"Failure","code":401}"#;
        let err = PodList::parse(status).expect_err("a v1.Status");
        assert!(matches!(&err, KubeletError::NotAPodList { kind: Some(k) } if k == "Status"));
        let err = PodList::parse(b"{}").expect_err("no items");
        assert!(matches!(err, KubeletError::NotAPodList { kind: None }));
    }

    #[test]
    fn matching_is_namespaces_or_and_labels_and() {
        let list = parsed();
        let ns = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        let labels = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            names(list.matching(&[], &[])).len(),
            3,
            "no selector: every pod"
        );
        assert_eq!(
            names(list.matching(&ns(&["shop"]), &[])),
            ["web-7d4b9c8f6-x2k9p"]
        );
        assert_eq!(
            names(list.matching(&ns(&["kube-system", "jobs"]), &[])),
            ["batch-job-q8z7w", "etcd-node-1"],
            "any listed namespace, in the kubelet's order"
        );
        assert!(list.matching(&ns(&["nowhere"]), &[]).is_empty());
        assert_eq!(
            names(list.matching(&[], &labels(&[("tier", "frontend")]))),
            ["web-7d4b9c8f6-x2k9p"]
        );
        assert_eq!(
            names(list.matching(&[], &labels(&[("app", "web"), ("tier", "frontend")]))),
            ["web-7d4b9c8f6-x2k9p"],
            "every pair must hold"
        );
        assert!(
            list.matching(&[], &labels(&[("app", "web"), ("tier", "control-plane")]))
                .is_empty()
        );
        assert!(
            list.matching(&[], &labels(&[("app", "Web")])).is_empty(),
            "exact values"
        );
        assert!(
            list.matching(&[], &labels(&[("missing", "")])).is_empty(),
            "absent != empty"
        );
        assert!(
            list.matching(&ns(&["jobs"]), &labels(&[("tier", "frontend")]))
                .is_empty(),
            "namespace AND labels"
        );
    }

    #[test]
    fn in_cluster_defaults() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let token = dir.path().join("token");
        assert_eq!(KubeletConfig::in_cluster_from(None, None, &token), None);
        assert_eq!(
            KubeletConfig::in_cluster_from(Some("".into()), None, &token),
            None
        );

        let config = KubeletConfig::in_cluster_from(Some("10.96.0.1".into()), None, &token)
            .expect("in a cluster");
        assert_eq!(
            config,
            KubeletConfig {
                url: "https://127.0.0.1:10250/pods".to_owned(),
                token_file: None,
                ca_cert: None,
                insecure_skip_tls_verify: true,
                timeout: Duration::from_secs(5),
            }
        );
        std::fs::write(&token, "t").expect("token");
        let config = KubeletConfig::in_cluster_from(
            Some("10.96.0.1".into()),
            Some("10.0.0.7".into()),
            &token,
        )
        .expect("in a cluster");
        assert_eq!(config.url, "https://10.0.0.7:10250/pods");
        assert_eq!(config.token_file.as_deref(), Some(token.as_path()));
        let config = KubeletConfig::in_cluster_from(
            Some("fd00::1".into()),
            Some("fd00:10::7".into()),
            &token,
        )
        .expect("in a cluster");
        assert_eq!(config.url, "https://[fd00:10::7]:10250/pods");
        KubeletClient::new(config).expect("the default settings build a client");
    }

    #[test]
    fn a_pods_service_is_its_app_label_else_its_workload() {
        let pod = |labels: &[(&str, &str)], owner: Option<(&str, &str)>| PodInfo {
            uid: "u".into(),
            name: "p".into(),
            namespace: "n".into(),
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            owner: owner.map(|(kind, name)| (kind.to_owned(), name.to_owned())),
            containers: Vec::new(),
        };
        let parsed = parsed();
        assert_eq!(parsed.pods()[0].service_name(), Some("web"));
        assert_eq!(parsed.pods()[2].service_name(), None, "a static pod");
        assert_eq!(
            pod(&[("app.kubernetes.io/name", "shop"), ("app", "web")], None).service_name(),
            Some("shop")
        );
        assert_eq!(
            pod(
                &[("pod-template-hash", "7d4b9c8f6")],
                Some(("ReplicaSet", "checkout-7d4b9c8f6"))
            )
            .service_name(),
            Some("checkout"),
            "a Deployment's pods"
        );
        assert_eq!(
            pod(&[], Some(("DaemonSet", "node-agent"))).service_name(),
            Some("node-agent")
        );
        assert_eq!(
            pod(&[("app", "")], Some(("StatefulSet", "db"))).service_name(),
            Some("db")
        );
    }

    #[test]
    fn refuses_unusable_settings() {
        let config = |url: &str| KubeletConfig {
            url: url.to_owned(),
            token_file: None,
            ca_cert: None,
            insecure_skip_tls_verify: false,
            timeout: Duration::from_secs(1),
        };
        let err = KubeletClient::new(config("not a url")).expect_err("bad url");
        assert!(matches!(err, KubeletError::InvalidUrl { .. }), "{err:?}");
        let err = KubeletClient::new(config("ftp://node/pods")).expect_err("bad scheme");
        assert!(matches!(err, KubeletError::InvalidUrl { .. }), "{err:?}");
        let err = KubeletClient::new(config("https://node:10250/pods")).expect_err("no trust");
        assert!(matches!(err, KubeletError::NoTlsTrust { .. }), "{err:?}");
        KubeletClient::new(config("http://127.0.0.1:10255/pods")).expect("read-only port");

        let dir = tempfile::tempdir().expect("temporary directory");
        let missing = dir.path().join("missing.pem");
        let err = KubeletClient::new(KubeletConfig {
            ca_cert: Some(missing.clone()),
            ..config("https://node:10250/pods")
        })
        .expect_err("missing CA");
        assert!(matches!(&err, KubeletError::CaCertRead { path, .. } if *path == missing));
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "not pem\n").expect("file");
        let err = KubeletClient::new(KubeletConfig {
            ca_cert: Some(empty),
            ..config("https://node:10250/pods")
        })
        .expect_err("no certificate");
        assert!(matches!(err, KubeletError::CaCertInvalid { .. }), "{err:?}");
    }

    /// The test PKI, with a kubelet serving certificate for 127.0.0.1 (and
    /// `node-1`), and the fake kubelet's rustls side built from it.
    struct Pki {
        pki: TestPki,
        server: Arc<ServerConfig>,
    }

    impl Pki {
        fn new() -> Self {
            let pki = TestPki::new(&["127.0.0.1", "node-1"]);
            let server = ServerConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_no_client_auth()
            .with_single_cert(
                vec![CertificateDer::from(pki.server_cert_der.clone())],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(pki.server_key_der.clone())),
            )
            .expect("server TLS");
            Self {
                pki,
                server: Arc::new(server),
            }
        }

        fn ca(&self) -> PathBuf {
            self.pki.path("ca.pem")
        }

        fn token(&self, token: &str) -> PathBuf {
            let path = self.pki.path("token");
            // A trailing newline, as `kubectl create token > file` leaves.
            std::fs::write(&path, format!("{token}\n")).expect("token file");
            path
        }
    }

    const TOKEN: &str = "eyJhbGciOiJSUzI1NiJ9.test-token";
    /// The body cap the tests' clients use.
    const TEST_CAP: usize = 64 << 10;

    /// A fake kubelet: one HTTP/1.1 request per connection, routed by path.
    /// Written by hand so that tests control framing exactly (announced
    /// length or close-delimited body).
    struct FakeKubelet {
        addr: std::net::SocketAddr,
        stop: Option<oneshot::Sender<()>>,
        task: JoinHandle<()>,
    }

    impl FakeKubelet {
        async fn start(tls: Option<Arc<ServerConfig>>) -> Self {
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let addr = listener.local_addr().expect("address");
            let (stop, mut stopped) = oneshot::channel();
            let acceptor = tls.map(TlsAcceptor::from);
            let task = tokio::spawn(async move {
                loop {
                    let (tcp, _) = tokio::select! {
                        accepted = listener.accept() => accepted.expect("accept"),
                        _ = &mut stopped => return,
                    };
                    let acceptor = acceptor.clone();
                    tokio::spawn(async move {
                        match acceptor {
                            // A client refusing the certificate aborts the
                            // handshake; that is the client's error to report.
                            Some(acceptor) => {
                                if let Ok(tls) = acceptor.accept(tcp).await {
                                    serve(tls).await;
                                }
                            }
                            None => serve(tcp).await,
                        }
                    });
                }
            });
            Self {
                addr,
                stop: Some(stop),
                task,
            }
        }

        fn url(&self, scheme: &str, path: &str) -> String {
            format!("{scheme}://{}{path}", self.addr)
        }

        async fn stop(mut self) {
            let _ = self.stop.take().expect("running").send(());
            self.task.await.expect("server task");
        }
    }

    async fn serve<S: AsyncRead + AsyncWrite + Unpin>(mut stream: S) {
        let mut request = Vec::new();
        let mut buf = [0u8; 1024];
        while !request.windows(4).any(|w| w == b"\r\n\r\n") {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => request.extend_from_slice(&buf[..n]),
            }
            assert!(request.len() < 16 << 10, "request headers too long");
        }
        let request = String::from_utf8_lossy(&request).into_owned();
        let path = request.split_whitespace().nth(1).unwrap_or("").to_owned();
        let authorized = request.lines().any(|line| {
            line.split_once(':').is_some_and(|(name, value)| {
                name.eq_ignore_ascii_case("authorization")
                    && value.trim() == format!("Bearer {TOKEN}")
            })
        });
        let (status, body, announce) = if !authorized && path != "/open" {
            ("401 Unauthorized", b"Unauthorized\n".to_vec(), true)
        } else {
            match path.as_str() {
                "/pods" | "/open" => ("200 OK", pod_list_json().into_bytes(), true),
                "/forbidden" => (
                    "403 Forbidden",
                    b"Forbidden (user=system:serviceaccount:profiling:stackscope, verb=get, resource=nodes, subresource=proxy)".to_vec(),
                    true,
                ),
                "/big" => ("200 OK", vec![b' '; TEST_CAP + 1], true),
                "/big-unannounced" => ("200 OK", vec![b' '; TEST_CAP + 1], false),
                _ => ("404 Not Found", b"404 page not found\n".to_vec(), true),
            }
        };
        let mut head =
            format!("HTTP/1.1 {status}\r\nContent-Type: application/json\r\nConnection: close\r\n");
        if announce {
            head.push_str(&format!("Content-Length: {}\r\n", body.len()));
        }
        head.push_str("\r\n");
        // The client may hang up early (the body cap); that is fine.
        let _ = stream.write_all(head.as_bytes()).await;
        let _ = stream.write_all(&body).await;
        let _ = stream.shutdown().await;
    }

    fn client(url: String, token_file: Option<PathBuf>, ca: Option<PathBuf>) -> KubeletClient {
        KubeletClient::new(KubeletConfig {
            url,
            token_file,
            insecure_skip_tls_verify: ca.is_none(),
            ca_cert: ca,
            timeout: Duration::from_secs(5),
        })
        .expect("client")
        .with_max_body(TEST_CAP)
    }

    #[tokio::test]
    async fn fetches_over_tls_with_the_bearer_token() {
        let pki = Pki::new();
        let kubelet = FakeKubelet::start(Some(pki.server.clone())).await;
        let token = pki.token(TOKEN);

        // Verified against the CA.
        let verified = client(
            kubelet.url("https", "/pods"),
            Some(token.clone()),
            Some(pki.ca()),
        );
        let list = verified.fetch().await.expect("pod list");
        assert_eq!(list.pods().len(), 3);
        assert_eq!(list.by_container_id(NGINX).expect("nginx").1.name, "nginx");

        // The token is read again per fetch: a rotated token is used at once.
        pki.token("rotated-but-wrong");
        let err = verified.fetch().await.expect_err("wrong token");
        let KubeletError::Status { status, .. } = &err else {
            panic!("{err:?}");
        };
        assert_eq!(status.as_u16(), 401);
        let message = err.to_string();
        assert!(message.contains("RBAC"), "{message}");
        assert!(message.contains("nodes/proxy"), "{message}");
        assert!(
            message.contains(&kubelet.url("https", "/pods")),
            "{message}"
        );
        assert!(message.contains("Unauthorized"), "{message}");
        pki.token(TOKEN);

        // Insecure mode: no CA, any certificate.
        let insecure = client(kubelet.url("https", "/pods"), Some(token.clone()), None);
        assert_eq!(insecure.fetch().await.expect("pod list").pods().len(), 3);

        // A CA that did not sign the kubelet's certificate is refused.
        let other = Pki::new();
        let err = client(
            kubelet.url("https", "/pods"),
            Some(token.clone()),
            Some(other.ca()),
        )
        .fetch()
        .await
        .expect_err("unknown issuer");
        assert!(matches!(err, KubeletError::Request { .. }), "{err:?}");

        let err = client(
            kubelet.url("https", "/forbidden"),
            Some(token.clone()),
            None,
        )
        .fetch()
        .await
        .expect_err("forbidden");
        let message = err.to_string();
        assert!(
            message.contains("403") && message.contains("RBAC"),
            "{message}"
        );
        assert!(message.contains("subresource=proxy"), "{message}");

        let err = client(kubelet.url("https", "/nope"), Some(token.clone()), None)
            .fetch()
            .await
            .expect_err("not found");
        assert!(!err.to_string().contains("RBAC"), "{err}");

        kubelet.stop().await;
    }

    #[tokio::test]
    async fn caps_the_body() {
        let pki = Pki::new();
        let kubelet = FakeKubelet::start(Some(pki.server.clone())).await;
        let token = pki.token(TOKEN);
        for path in ["/big", "/big-unannounced"] {
            let err = client(kubelet.url("https", path), Some(token.clone()), None)
                .fetch()
                .await
                .expect_err("too large");
            assert!(
                matches!(
                    err,
                    KubeletError::BodyTooLarge {
                        limit: TEST_CAP,
                        ..
                    }
                ),
                "{path}: {err:?}"
            );
        }
        kubelet.stop().await;
    }

    #[tokio::test]
    async fn token_and_plain_http_errors() {
        let kubelet = FakeKubelet::start(None).await;
        // The read-only port: plain HTTP, no token.
        let list = client(kubelet.url("http", "/open"), None, None)
            .fetch()
            .await
            .expect("pod list");
        assert_eq!(list.pods().len(), 3);

        let dir = tempfile::tempdir().expect("temporary directory");
        let missing = dir.path().join("token");
        let err = client(kubelet.url("http", "/pods"), Some(missing.clone()), None)
            .fetch()
            .await
            .expect_err("no token file");
        assert!(matches!(&err, KubeletError::TokenRead { path, .. } if *path == missing));
        assert!(
            err.to_string().contains(&missing.display().to_string()),
            "{err}"
        );
        for bad in ["", "\n", "a\u{1}b"] {
            std::fs::write(&missing, bad).expect("token file");
            let err = client(kubelet.url("http", "/pods"), Some(missing.clone()), None)
                .fetch()
                .await
                .expect_err("bad token");
            assert!(
                matches!(err, KubeletError::TokenInvalid { .. }),
                "{bad:?}: {err:?}"
            );
        }
        let gone = kubelet.url("http", "/open");
        kubelet.stop().await;

        // Nobody listening any more.
        let err = client(gone, None, None).fetch().await.expect_err("refused");
        assert!(
            matches!(err, KubeletError::Request { .. }) && err.to_string().contains("connect"),
            "{err}"
        );
    }
}
