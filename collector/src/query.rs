//! Answers queries over a [`Storage`]: the one place the gRPC and HTTP
//! servers share, so both give the same answers. Storage calls are
//! synchronous and run on blocking threads.

use std::sync::Arc;

use stackscope_profile::{
    model::{
        Frame, LabelMatcher, MatchOp, PROFILE_TYPE_LABEL, PeriodAgreement, ProfileType, Selection,
        StackSamples,
    },
    selector::is_valid_label_name,
    tree::CallTree,
};

use crate::{
    debuginfo::symbolize::{Symbolizer, SymbolizerGone},
    metrics::CollectorMetrics,
    storage::{Storage, StorageError, series_step},
};

/// A query failed.
#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    #[error(transparent)]
    Storage(#[from] StorageError),
    #[error("the storage task stopped before answering")]
    TaskFailed(#[source] tokio::task::JoinError),
    #[error(transparent)]
    Symbolizer(#[from] SymbolizerGone),
    /// The client asked to group by something that cannot be a label name.
    #[error(
        "group_by {0:?} is not a label name (letters, digits and _, not starting with a digit)"
    )]
    InvalidGroupLabel(String),
    /// `min_share` is not a share of the total.
    #[error("min_share {0} is not a share between 0 and 1 (0.05 = 5%)")]
    InvalidMinShare(f64),
    /// Grouping would draw more side-by-side flamegraphs than anyone can read
    /// (and cost one storage query each).
    #[error(
        "label {label:?} has {count} values in the selection, more than the {max} a grouped \
         flamegraph shows; narrow the selection (label matchers, a shorter time range) or \
         group by another label"
    )]
    TooManyGroups {
        label: String,
        count: usize,
        max: usize,
    },
}

/// Who a failed query is on, for the servers' status codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// The request itself was wrong; the client can fix it.
    Request,
    /// The collector failed.
    Collector,
}

impl QueryError {
    /// Whether the request itself was wrong (the client can fix it), as
    /// opposed to the collector failing.
    fn is_invalid_request(&self) -> bool {
        matches!(
            self,
            Self::InvalidGroupLabel(_) | Self::InvalidMinShare(_) | Self::TooManyGroups { .. }
        )
    }

    /// Whose fault it is and what the client is told: the error itself for
    /// a wrong request; for a collector failure, a generic message (the
    /// failure, with its causes, is logged here, not sent).
    pub(crate) fn into_public(self) -> (Fault, String) {
        if self.is_invalid_request() {
            return (Fault::Request, self.to_string());
        }
        tracing::error!("query failed: {:#}", anyhow::Error::from(self));
        (
            Fault::Collector,
            "the query failed in the collector's storage; see the collector's log".to_owned(),
        )
    }
}

/// Top functions answered when a request does not say how many.
pub(crate) const DEFAULT_TOP_LIMIT: usize = 50;

/// Series longer than this are answered with a wider step: a client asking
/// for a year at 1 s resolution gets a readable answer, not an out-of-memory.
const MAX_SERIES_POINTS: i64 = 11_000;

/// Most values a grouped flamegraph splits into: each is one storage query
/// and one column people have to read; beyond this the selection is too broad
/// for a side-by-side view.
pub const MAX_GROUPS: usize = 200;

/// Binary of the synthetic group frames, so they cannot be mistaken for code.
pub const GROUP_BINARY: &str = "[group]";

/// The query side of the collector.
#[derive(Clone)]
pub struct QueryEngine {
    storage: Arc<dyn Storage>,
    /// Names frames stored without names, as they are read.
    symbolizer: Option<Arc<Symbolizer>>,
    /// Where query latency is counted.
    metrics: CollectorMetrics,
}

/// A merged call tree and what one unit of its weight stands for.
pub struct Flamegraph {
    pub tree: CallTree,
    pub sample_period_nanos: u64,
}

impl QueryEngine {
    pub fn new(storage: Arc<dyn Storage>) -> Self {
        Self {
            storage,
            symbolizer: None,
            metrics: CollectorMetrics::default(),
        }
    }

    /// Counts query latency in `metrics` (the served ones).
    pub fn with_metrics(mut self, metrics: CollectorMetrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Names unnamed frames from debuginfo as profiles are read.
    pub fn with_symbolizer(mut self, symbolizer: Arc<Symbolizer>) -> Self {
        self.symbolizer = Some(symbolizer);
        self
    }

    /// `samples` with what debuginfo names of their unnamed frames.
    async fn named(&self, samples: StackSamples) -> Result<StackSamples, QueryError> {
        match &self.symbolizer {
            Some(symbolizer) => Ok(symbolizer.name(samples).await?),
            None => Ok(samples),
        }
    }

    /// Runs `work` on a blocking thread (storage calls are synchronous).
    async fn blocking<T, E>(
        &self,
        work: impl FnOnce(&dyn Storage) -> Result<T, E> + Send + 'static,
    ) -> Result<T, QueryError>
    where
        T: Send + 'static,
        E: Send + 'static,
        QueryError: From<E>,
    {
        let storage = Arc::clone(&self.storage);
        tokio::task::spawn_blocking(move || work(&*storage))
            .await
            .map_err(QueryError::TaskFailed)?
            .map_err(QueryError::from)
    }

    /// The selected stacks, named from debuginfo where storage has no
    /// names.
    pub async fn stacks(&self, selection: Selection) -> Result<StackSamples, QueryError> {
        self.metrics
            .time_query("stacks", self.named_stacks(selection))
            .await
    }

    async fn named_stacks(&self, selection: Selection) -> Result<StackSamples, QueryError> {
        let samples = self
            .blocking(move |storage| storage.stacks(&selection))
            .await?;
        self.named(samples).await
    }

    /// The merged call tree of the selection, without subtrees below
    /// `min_share` of the total (refused outside 0..=1).
    ///
    /// With `group_by` (an empty label name counts as none), the root has one child per value of that label, a
    /// synthetic frame named `<label>=<value>` (binary [`GROUP_BINARY`]),
    /// holding that value's stacks; samples without the label go under
    /// `<label> (none)`. Refused when the label name is invalid or has more
    /// than [`MAX_GROUPS`] values in the selection.
    pub async fn flamegraph(
        &self,
        selection: Selection,
        min_share: f64,
        group_by: Option<&str>,
    ) -> Result<Flamegraph, QueryError> {
        self.metrics
            .time_query("flamegraph", self.merged(selection, min_share, group_by))
            .await
    }

    /// The merged call tree of the selection with each sample's weight
    /// times its period (CPU time in nanoseconds whatever rate each sample
    /// was taken at; a period of 1 in the answer).
    pub async fn flamegraph_in_units(
        &self,
        selection: Selection,
    ) -> Result<Flamegraph, QueryError> {
        let work = async move {
            let samples = self
                .blocking(move |storage| storage.stacks_in_units(&selection))
                .await?;
            let samples = self.named(samples).await?;
            Ok(Flamegraph {
                tree: CallTree::from_stacks(&samples),
                sample_period_nanos: samples.sample_period_nanos,
            })
        };
        self.metrics.time_query("flamegraph", work).await
    }

    async fn merged(
        &self,
        selection: Selection,
        min_share: f64,
        group_by: Option<&str>,
    ) -> Result<Flamegraph, QueryError> {
        if !(0.0..=1.0).contains(&min_share) {
            return Err(QueryError::InvalidMinShare(min_share));
        }
        let samples = match group_by.filter(|label| !label.is_empty()) {
            None => self.named_stacks(selection).await?,
            Some(label) => {
                let grouped = self.grouped_stacks(selection, label.to_owned()).await?;
                self.named(grouped).await?
            }
        };
        let mut tree = CallTree::from_stacks(&samples);
        if min_share > 0.0 {
            tree = tree.prune(min_share);
        }
        Ok(Flamegraph {
            tree,
            sample_period_nanos: samples.sample_period_nanos,
        })
    }

    /// The selection's stacks, each with a group frame for its value of
    /// `label` appended root-most. Done here over plain equality queries (one
    /// per value, one for samples without the label) so every storage gets
    /// grouping for free. The queries are not one snapshot: a batch committed
    /// meanwhile may show in some groups only, as it would in a later query.
    async fn grouped_stacks(
        &self,
        selection: Selection,
        label: String,
    ) -> Result<StackSamples, QueryError> {
        if !is_valid_label_name(&label) {
            return Err(QueryError::InvalidGroupLabel(label));
        }
        let max = MAX_GROUPS;
        self.blocking(move |storage| {
            let values = storage.label_values(&selection, &label)?;
            // An empty value is the same as no label (PromQL): the `(none)`
            // group covers it.
            let values: Vec<String> = values.into_iter().filter(|v| !v.is_empty()).collect();
            if values.len() > max {
                return Err(QueryError::TooManyGroups {
                    count: values.len(),
                    label,
                    max,
                });
            }
            let groups = values
                .into_iter()
                .map(|value| (format!("{label}={value}"), value))
                .chain([(format!("{label} (none)"), String::new())]);
            let mut merged = StackSamples::default();
            // As storage does across batches: the period only when every
            // group agreed on it.
            let mut period = PeriodAgreement::default();
            for (name, value) in groups {
                let mut narrowed = selection.clone();
                narrowed.matchers.push(
                    LabelMatcher::new(label.as_str(), MatchOp::Equal, value)
                        .expect("equality matchers have no pattern to fail"),
                );
                let samples = storage.stacks(&narrowed)?;
                if samples.stacks.is_empty() {
                    continue;
                }
                period.add(samples.sample_period_nanos);
                let frame = Arc::new(Frame::synthetic(name, GROUP_BINARY));
                merged
                    .stacks
                    .extend(samples.stacks.into_iter().map(|mut stack| {
                        stack.frames.push(Arc::clone(&frame));
                        stack
                    }));
            }
            merged.sample_period_nanos = period.result();
            Ok(merged)
        })
        .await
    }

    pub async fn label_names(&self, selection: Selection) -> Result<Vec<String>, QueryError> {
        // The profile type's label is the selection's `profile_type`, not a
        // label people match on.
        let work = self.blocking(move |storage| {
            let mut names = storage.label_names(&selection)?;
            names.retain(|name| name != PROFILE_TYPE_LABEL);
            Ok::<_, StorageError>(names)
        });
        self.metrics.time_query("label_names", work).await
    }

    /// The profile types with samples in the selection (its own type
    /// aside), sorted (CPU, off-CPU, then the sent types by id).
    pub async fn profile_types(
        &self,
        selection: Selection,
    ) -> Result<Vec<ProfileType>, QueryError> {
        let work = self.blocking(move |storage| storage.profile_types(&selection));
        self.metrics.time_query("profile_types", work).await
    }

    pub async fn label_values(
        &self,
        selection: Selection,
        name: String,
    ) -> Result<Vec<String>, QueryError> {
        let work = self.blocking(move |storage| storage.label_values(&selection, &name));
        self.metrics.time_query("label_values", work).await
    }

    /// Weight over time; `step_nanos <= 0` picks about 100 points. Returns
    /// the step used with the points.
    pub async fn series(
        &self,
        selection: Selection,
        step_nanos: i64,
    ) -> Result<(i64, Vec<(i64, u64)>), QueryError> {
        self.series_of(selection, step_nanos, false).await
    }

    /// [`QueryEngine::series`] with each sample's weight times its period
    /// (CPU time in nanoseconds whatever rate each sample was taken at).
    pub async fn series_in_units(
        &self,
        selection: Selection,
        step_nanos: i64,
    ) -> Result<(i64, Vec<(i64, u64)>), QueryError> {
        self.series_of(selection, step_nanos, true).await
    }

    async fn series_of(
        &self,
        selection: Selection,
        step_nanos: i64,
        in_units: bool,
    ) -> Result<(i64, Vec<(i64, u64)>), QueryError> {
        let span = (selection.range.end_unix_nanos - selection.range.start_unix_nanos).max(1);
        let step = if step_nanos > 0 {
            step_nanos.max(span / MAX_SERIES_POINTS)
        } else {
            (span / 100).max(1_000_000_000)
        };
        // The step answered is the one drawn: whole storage buckets.
        let work = self.blocking(move |storage| {
            let step = series_step(step, storage.bucket_nanos());
            let points = if in_units {
                storage.series_in_units(&selection, step)
            } else {
                storage.series(&selection, step)
            };
            points.map(|points| (step, points))
        });
        self.metrics.time_query("series", work).await
    }
}
