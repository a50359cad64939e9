//! The kubelet's pod list kept fresh: fetched on a period, or sooner when
//! a sample comes from a pod the last list did not have, on a tokio task
//! of its own, each new list handed to whoever watches. A kubelet that is
//! down is retried on the period and logged once, then every 20th failure.

use std::{sync::Arc, time::Duration};

use tokio::time::Instant;

use crate::kubelet::{KubeletClient, PodList};

/// Fetches the kubelet's pod list on a period, or sooner when asked, on a
/// task of its own, and hands each new list to whoever watches.
pub struct PodWatch {
    lists: tokio::sync::mpsc::Receiver<Arc<PodList>>,
    soon: Arc<tokio::sync::Notify>,
    task: tokio::task::JoinHandle<()>,
}

impl PodWatch {
    pub fn start(client: KubeletClient, period: Duration) -> Self {
        let (sender, lists) = tokio::sync::mpsc::channel(1);
        let soon = Arc::new(tokio::sync::Notify::new());
        let wake = Arc::clone(&soon);
        let period = period.max(Duration::from_secs(1));
        let task = tokio::spawn(async move {
            let mut failures = 0u32;
            loop {
                let fetched = Instant::now();
                match client.fetch().await {
                    Ok(list) => {
                        if failures > 0 {
                            tracing::info!(
                                "the kubelet's pod list is back after {failures} failed fetches"
                            );
                        }
                        failures = 0;
                        if sender.send(Arc::new(list)).await.is_err() {
                            return;
                        }
                    }
                    Err(err) => {
                        failures += 1;
                        // Once, then every 20th: a kubelet down for an hour
                        // must not flood the log.
                        if failures == 1 || failures.is_multiple_of(20) {
                            tracing::warn!(
                                "fetching the kubelet's pod list failed ({failures} in a row): {err}"
                            );
                        }
                    }
                }
                // At most one fetch a second, however often we are asked.
                tokio::time::sleep_until(fetched + Duration::from_secs(1)).await;
                tokio::select! {
                    _ = tokio::time::sleep_until(fetched + period) => {}
                    _ = wake.notified() => {}
                }
            }
        });
        Self { lists, soon, task }
    }

    /// The first list, waiting up to a few seconds for it.
    pub async fn first(&mut self) -> Option<Arc<PodList>> {
        match tokio::time::timeout(Duration::from_secs(5), self.lists.recv()).await {
            Ok(list) => list,
            Err(_) => {
                tracing::warn!(
                    "no pod list from the kubelet yet: pods are selected and named once it answers"
                );
                None
            }
        }
    }

    /// Fetches again soon (at most one fetch a second, however often asked).
    pub fn refresh_soon(&self) {
        self.soon.notify_one();
    }

    /// The next list of `watch`; pending forever without one (so a
    /// `select!` branch on it simply never fires).
    pub async fn next(watch: &mut Option<PodWatch>) -> Option<Arc<PodList>> {
        match watch {
            Some(watch) => watch.lists.recv().await,
            None => std::future::pending().await,
        }
    }
}

impl Drop for PodWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}
