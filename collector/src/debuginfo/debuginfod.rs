//! A debuginfod client: fetches debuginfo by build-id from the servers in
//! `--debuginfod-urls` (`GET <url>/buildid/<id>/debuginfo`, then
//! `/executable`) into the store, so a build-id is fetched once for the
//! whole fleet and for every later query.
//!
//! Owns what keeps a slow or absent server from hurting queries: a query
//! waits for its fetches at most [`DebuginfodConfig::query_wait`] (a
//! download still running goes on in the background and serves later
//! queries), one build-id is fetched once at a time however many queries
//! want it, at most [`DebuginfodConfig::max_concurrent`] downloads run at
//! once, each is bounded in time and size, and a build-id no server has is
//! not asked for again for [`DebuginfodConfig::negative_ttl`].

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use stackscope_telemetry::StateSize;
use tokio::sync::{Semaphore, watch};

use super::{DebuginfoError, DebuginfoStore, ElfCheckError};

/// How the client reaches debuginfod and bounds itself.
#[derive(Debug, Clone)]
pub struct DebuginfodConfig {
    /// Server base URLs, tried in order.
    pub urls: Vec<String>,
    /// How long a query waits for the fetches it needs.
    pub query_wait: Duration,
    /// How long one download may take in all.
    pub download_timeout: Duration,
    /// How long a build-id no server had is not asked for again.
    pub negative_ttl: Duration,
    /// Downloads at once.
    pub max_concurrent: usize,
    /// Largest file accepted.
    pub max_bytes: u64,
}

impl DebuginfodConfig {
    /// The servers in a `DEBUGINFOD_URLS`-style list (space-separated),
    /// with default bounds.
    pub fn from_url_list(list: &str) -> Self {
        Self {
            urls: list
                .split_whitespace()
                .map(|url| url.trim_end_matches('/').to_owned())
                .collect(),
            query_wait: Duration::from_secs(5),
            download_timeout: Duration::from_secs(300),
            negative_ttl: Duration::from_secs(600),
            max_concurrent: 4,
            max_bytes: 2 << 30,
        }
    }
}

/// Build-ids remembered as missing, before the map is cleared.
const MAX_REMEMBERED_MISSING: usize = 100_000;

/// Why a debuginfod client could not be made.
#[derive(Debug, thiserror::Error)]
pub enum DebuginfodError {
    #[error("debuginfod URL {url:?}: {reason}")]
    InvalidUrl { url: String, reason: String },
    #[error("setting up TLS for debuginfod")]
    Tls(#[source] rustls::Error),
    #[error("building the debuginfod HTTP client")]
    Client(#[source] reqwest::Error),
}

/// See the module documentation.
pub struct Debuginfod {
    http: reqwest::Client,
    config: DebuginfodConfig,
    permits: Arc<Semaphore>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    missing: HashMap<String, Instant>,
    /// Fetches under way: done when the value turns true.
    in_flight: HashMap<String, watch::Receiver<bool>>,
}

impl Debuginfod {
    pub fn new(config: DebuginfodConfig) -> Result<Self, DebuginfodError> {
        for url in &config.urls {
            match reqwest::Url::parse(url) {
                Ok(parsed) if matches!(parsed.scheme(), "http" | "https") => {}
                Ok(parsed) => {
                    return Err(DebuginfodError::InvalidUrl {
                        url: url.clone(),
                        reason: format!("scheme {:?} is neither http nor https", parsed.scheme()),
                    });
                }
                Err(err) => {
                    return Err(DebuginfodError::InvalidUrl {
                        url: url.clone(),
                        reason: err.to_string(),
                    });
                }
            }
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(DebuginfodError::Tls)?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let http = reqwest::Client::builder()
            .tls_backend_preconfigured(tls)
            .connect_timeout(config.query_wait.max(Duration::from_secs(1)))
            .timeout(config.download_timeout)
            .build()
            .map_err(DebuginfodError::Client)?;
        Ok(Self {
            http,
            permits: Arc::new(Semaphore::new(config.max_concurrent.max(1))),
            config,
            state: Mutex::new(State::default()),
        })
    }

    /// Build-ids remembered as missing, and fetches under way.
    pub fn state_sizes(&self, out: &mut Vec<StateSize>) {
        let state = self.lock();
        out.push(StateSize::entries(
            "debuginfod_missing",
            state.missing.len(),
            Some(MAX_REMEMBERED_MISSING),
        ));
        // One per build-id a query waits for: bounded by the queries.
        out.push(StateSize::entries(
            "debuginfod_fetches",
            state.in_flight.len(),
            None,
        ));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Fetches `build_ids` into `store` (those not missing a short while
    /// ago), waiting at most [`DebuginfodConfig::query_wait`].
    pub async fn fetch_into(
        self: &Arc<Self>,
        store: &Arc<dyn DebuginfoStore>,
        build_ids: Vec<String>,
    ) {
        let mut waits = tokio::task::JoinSet::new();
        {
            let mut state = self.lock();
            for build_id in build_ids {
                if let Some(since) = state.missing.get(&build_id) {
                    if since.elapsed() < self.config.negative_ttl {
                        continue;
                    }
                    state.missing.remove(&build_id);
                }
                let mut done = match state.in_flight.get(&build_id) {
                    Some(done) => done.clone(),
                    None => {
                        let (tell, done) = watch::channel(false);
                        state.in_flight.insert(build_id.clone(), done.clone());
                        let this = Arc::clone(self);
                        let store = Arc::clone(store);
                        tokio::spawn(async move {
                            let found = tokio::time::timeout(
                                this.config.download_timeout,
                                this.fetch(&store, &build_id),
                            )
                            .await
                            .unwrap_or(false);
                            let mut state = this.lock();
                            state.in_flight.remove(&build_id);
                            if !found {
                                if state.missing.len() >= MAX_REMEMBERED_MISSING {
                                    state.missing.clear();
                                }
                                state.missing.insert(build_id, Instant::now());
                            }
                            drop(state);
                            let _ = tell.send(true);
                        });
                        done
                    }
                };
                waits.spawn(async move {
                    let _ = done.wait_for(|done| *done).await;
                });
            }
        }
        let _ = tokio::time::timeout(self.config.query_wait, async {
            while waits.join_next().await.is_some() {}
        })
        .await;
    }

    /// Tries every server for the debuginfo, then the executable; true
    /// once one is stored.
    async fn fetch(&self, store: &Arc<dyn DebuginfoStore>, build_id: &str) -> bool {
        let Ok(_permit) = self.permits.acquire().await else {
            return false;
        };
        for url in &self.config.urls {
            for what in ["debuginfo", "executable"] {
                let from = format!("{url}/buildid/{build_id}/{what}");
                match self.download(store, build_id, &from).await {
                    Ok(true) => {
                        tracing::info!(build_id, from, "debuginfo fetched from debuginfod");
                        return true;
                    }
                    Ok(false) => {}
                    Err(err) => tracing::debug!("{from}: {err:#}"),
                }
            }
        }
        false
    }

    /// One GET into the store: `Ok(false)` when the server has no such file.
    async fn download(
        &self,
        store: &Arc<dyn DebuginfoStore>,
        build_id: &str,
        url: &str,
    ) -> anyhow::Result<bool> {
        let mut response = self.http.get(url).send().await?;
        if response.status() == reqwest::StatusCode::NOT_FOUND {
            return Ok(false);
        }
        if !response.status().is_success() {
            anyhow::bail!("status {}", response.status());
        }
        if response
            .content_length()
            .is_some_and(|len| len > self.config.max_bytes)
        {
            anyhow::bail!("larger than the {} bytes accepted", self.config.max_bytes);
        }
        let mut staged = store.stage()?;
        let mut received = 0u64;
        while let Some(chunk) = response.chunk().await? {
            received += chunk.len() as u64;
            if received > self.config.max_bytes {
                anyhow::bail!("larger than the {} bytes accepted", self.config.max_bytes);
            }
            staged.write_all(&chunk)?;
        }
        // The checks parse the file and the commit waits for fsync.
        let (store, id) = (Arc::clone(store), build_id.to_owned());
        match tokio::task::spawn_blocking(move || store.commit(&id, staged)).await? {
            Ok(_) => Ok(true),
            // A stripped executable names nothing: try the next source.
            Err(DebuginfoError::Elf(ElfCheckError::NoSymbols)) => Ok(false),
            Err(err) => Err(err.into()),
        }
    }
}
