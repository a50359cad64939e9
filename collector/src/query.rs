//! Answers queries over a [`Storage`]: the one place the gRPC and HTTP
//! servers share, so both give the same answers. Storage calls are
//! synchronous and run on blocking threads.

use std::sync::Arc;

use stackscope_profile::{
    model::{Selection, StackSamples},
    tree::CallTree,
};

use crate::storage::{Storage, StorageError};

/// A query failed.
#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    #[error(transparent)]
    Storage(#[from] StorageError),
    #[error("the storage task stopped before answering")]
    TaskFailed(#[source] tokio::task::JoinError),
}

/// Series longer than this are answered with a wider step: a client asking
/// for a year at 1 s resolution gets a readable answer, not an out-of-memory.
const MAX_SERIES_POINTS: i64 = 11_000;

/// The query side of the collector.
#[derive(Clone)]
pub struct QueryEngine {
    storage: Arc<dyn Storage>,
}

/// A merged call tree and what one unit of its weight stands for.
pub struct Flamegraph {
    pub tree: CallTree,
    pub sample_period_nanos: u64,
}

impl QueryEngine {
    pub fn new(storage: Arc<dyn Storage>) -> Self {
        Self { storage }
    }

    async fn blocking<T: Send + 'static>(
        &self,
        work: impl FnOnce(&dyn Storage) -> Result<T, StorageError> + Send + 'static,
    ) -> Result<T, QueryError> {
        let storage = Arc::clone(&self.storage);
        tokio::task::spawn_blocking(move || work(&*storage))
            .await
            .map_err(QueryError::TaskFailed)?
            .map_err(QueryError::from)
    }

    /// The selected stacks, as stored.
    pub async fn stacks(&self, selection: Selection) -> Result<StackSamples, QueryError> {
        self.blocking(move |storage| storage.stacks(&selection))
            .await
    }

    /// The merged call tree of the selection, without subtrees below
    /// `min_share` of the total.
    pub async fn flamegraph(
        &self,
        selection: Selection,
        min_share: f64,
    ) -> Result<Flamegraph, QueryError> {
        let samples = self.stacks(selection).await?;
        let mut tree = CallTree::from_stacks(&samples);
        if min_share > 0.0 {
            tree = tree.prune(min_share);
        }
        Ok(Flamegraph {
            tree,
            sample_period_nanos: samples.sample_period_nanos,
        })
    }

    pub async fn label_names(&self, selection: Selection) -> Result<Vec<String>, QueryError> {
        self.blocking(move |storage| storage.label_names(&selection))
            .await
    }

    pub async fn label_values(
        &self,
        selection: Selection,
        name: String,
    ) -> Result<Vec<String>, QueryError> {
        self.blocking(move |storage| storage.label_values(&selection, &name))
            .await
    }

    /// Weight over time; `step_nanos <= 0` picks about 100 points. Returns
    /// the step used with the points.
    pub async fn series(
        &self,
        selection: Selection,
        step_nanos: i64,
    ) -> Result<(i64, Vec<(i64, u64)>), QueryError> {
        let span = (selection.range.end_unix_nanos - selection.range.start_unix_nanos).max(1);
        let step = if step_nanos > 0 {
            step_nanos.max(span / MAX_SERIES_POINTS)
        } else {
            (span / 100).max(1_000_000_000)
        };
        let points = self
            .blocking(move |storage| storage.series(&selection, step))
            .await?;
        Ok((step, points))
    }
}
