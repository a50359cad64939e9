//! The gRPC services: `Ingest` (agents push batches, plain or compressed by
//! the agent) and `Query` (the CLI and other clients). Maps input errors to
//! precise statuses; a batch is acknowledged only after storage committed
//! it, and one the full disk cannot take is refused in a way agents know to
//! retry.

use std::{cell::RefCell, sync::Arc, time::Instant};

use prost::{Message as _, bytes::Bytes};
use stackscope_profile::{render, selector};
use stackscope_proto::v1::{
    CompressedPushRequest, FlamegraphRequest, FlamegraphResponse, FunctionCost, LabelNamesRequest,
    LabelNamesResponse, LabelValuesRequest, LabelValuesResponse, ProfileTypesRequest,
    ProfileTypesResponse, PushRequest, PushResponse, SampleSeriesRequest, SampleSeriesResponse,
    SeriesPoint, TopFunctionsRequest, TopFunctionsResponse, ingest_server, query_server,
};
use tonic::{Request, Response, Status, metadata::MetadataValue};

use crate::{
    ingest::{IngestLimits, validate},
    metrics::{CollectorMetrics, IngestResult},
    query::{DEFAULT_TOP_LIMIT, Fault, QueryEngine, QueryError},
    storage::{IngestOutcome, Storage},
};

use super::store::{Refusal, store};

pub struct IngestService {
    storage: Arc<dyn Storage>,
    limits: Arc<IngestLimits>,
    metrics: CollectorMetrics,
    /// The largest `PushRequest` taken, decompressed: gRPC's message limit
    /// for `Push`, checked here for `PushCompressed`.
    max_request_bytes: usize,
}

/// A push as it arrived.
enum Incoming {
    Plain(PushRequest),
    /// A `CompressedPushRequest`'s zstd frame.
    Zstd(Bytes),
}

impl IngestService {
    pub fn new(
        storage: Arc<dyn Storage>,
        limits: IngestLimits,
        metrics: CollectorMetrics,
        max_request_bytes: usize,
    ) -> Self {
        Self {
            storage,
            limits: Arc::new(limits),
            metrics,
            max_request_bytes,
        }
    }

    /// Validates and stores one batch: the answer, and what it came to.
    async fn store(&self, incoming: Incoming) -> (Result<PushResponse, Status>, IngestResult) {
        let storage = Arc::clone(&self.storage);
        let limits = Arc::clone(&self.limits);
        let metrics = self.metrics.clone();
        let max_request_bytes = self.max_request_bytes;
        // Decompression, validation (which walks every index of a possibly
        // large batch) and the commit (which waits for fsync) stay off the
        // async workers.
        let outcome = tokio::task::spawn_blocking(move || {
            let request = match incoming {
                Incoming::Plain(request) => request,
                Incoming::Zstd(frame) => decompress(&frame, max_request_bytes)
                    .map_err(|status| (status, IngestResult::Rejected))?,
            };
            let batch = request.batch.ok_or((
                Status::invalid_argument("PushRequest.batch is missing"),
                IngestResult::Rejected,
            ))?;
            let batch = validate(batch, &limits).map_err(|err| {
                let message = format!("batch rejected, nothing stored: {err}");
                let status = if err.is_too_large() {
                    Status::resource_exhausted(message)
                } else {
                    Status::invalid_argument(message)
                };
                (status, IngestResult::Rejected)
            })?;
            store(&*storage, &metrics, &batch).map_err(|refusal| {
                let result = refusal.result();
                let status = match refusal {
                    Refusal::TooLarge(message) => Status::resource_exhausted(message),
                    Refusal::DiskFull => disk_full(),
                    Refusal::Failed => {
                        Status::unavailable("the collector could not store the batch; retry later")
                    }
                };
                (status, result)
            })
        })
        .await;
        match outcome {
            Ok(Ok(IngestOutcome::Stored { samples })) => (
                Ok(PushResponse {
                    samples_stored: samples,
                    duplicate: false,
                }),
                IngestResult::Stored,
            ),
            Ok(Ok(IngestOutcome::Duplicate)) => (
                Ok(PushResponse {
                    samples_stored: 0,
                    duplicate: true,
                }),
                IngestResult::Duplicate,
            ),
            Ok(Err((status, result))) => (Err(status), result),
            Err(_) => (
                Err(Status::internal("the ingest task failed")),
                IngestResult::Failed,
            ),
        }
    }
}

thread_local! {
    /// One decompression context per blocking thread, kept between batches.
    static DECOMPRESSOR: RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { RefCell::new(None) };
}

/// The `PushRequest` in a `PushCompressed` frame. The frame must state its
/// size, and that size must be within `max_bytes`, before anything is
/// decompressed: a small frame cannot make the collector allocate more than
/// it takes from a plain push.
fn decompress(frame: &[u8], max_bytes: usize) -> Result<PushRequest, Status> {
    let refused = |why: String| {
        Status::invalid_argument(format!("compressed batch rejected, nothing stored: {why}"))
    };
    let size = match zstd::zstd_safe::get_frame_content_size(frame) {
        Ok(Some(size)) => size,
        Ok(None) => return Err(refused("the zstd frame does not state its size".into())),
        Err(_) => return Err(refused("not a zstd frame".into())),
    };
    if size > max_bytes as u64 {
        return Err(Status::resource_exhausted(format!(
            "batch rejected, nothing stored: {size} bytes decompressed, more than the \
             {max_bytes} this collector takes (--max-batch-bytes)"
        )));
    }
    let size = size as usize;
    let request = DECOMPRESSOR.with_borrow_mut(|decompressor| {
        let decompressor = match decompressor {
            Some(decompressor) => decompressor,
            None => decompressor.insert(zstd::bulk::Decompressor::new()?),
        };
        decompressor.decompress(frame, size)
    });
    // zstd checks the frame's content against its stated size, and refuses
    // further frames that would exceed it.
    let request =
        request.map_err(|err| refused(format!("the zstd frame does not decompress: {err}")))?;
    PushRequest::decode(&request[..]).map_err(|err| refused(format!("not a PushRequest: {err}")))
}

/// How long agents wait at least before retrying a batch refused for a full
/// disk: freeing space takes an operator, so retrying sooner only costs the
/// collector decoding batches it cannot store.
const DISK_FULL_PUSHBACK_MS: u32 = 1000;

/// The answer to a batch the full disk cannot take: RESOURCE_EXHAUSTED, as
/// for a batch too large, but with gRPC's server pushback, which tells an
/// agent to keep the batch and retry it rather than drop it.
fn disk_full() -> Status {
    let mut status =
        Status::resource_exhausted("batch not stored: the collector's disk is full; retry later");
    status.metadata_mut().insert(
        stackscope_proto::RETRY_PUSHBACK_KEY,
        MetadataValue::from(DISK_FULL_PUSHBACK_MS),
    );
    status
}

#[tonic::async_trait]
impl ingest_server::Ingest for IngestService {
    async fn push(&self, request: Request<PushRequest>) -> Result<Response<PushResponse>, Status> {
        self.answer(Incoming::Plain(request.into_inner())).await
    }

    async fn push_compressed(
        &self,
        request: Request<CompressedPushRequest>,
    ) -> Result<Response<PushResponse>, Status> {
        self.answer(Incoming::Zstd(request.into_inner().zstd_push_request))
            .await
    }
}

impl IngestService {
    async fn answer(&self, incoming: Incoming) -> Result<Response<PushResponse>, Status> {
        let started = Instant::now();
        let (answer, result) = self.store(incoming).await;
        let stored = answer
            .as_ref()
            .map_or(0, |response| response.samples_stored);
        self.metrics.ingested(result, stored, started.elapsed());
        answer.map(Response::new)
    }
}

pub struct QueryService {
    engine: QueryEngine,
}

impl QueryService {
    pub fn new(engine: QueryEngine) -> Self {
        Self { engine }
    }
}

fn query_status(err: QueryError) -> Status {
    match err.into_public() {
        (Fault::Request, message) => Status::invalid_argument(message),
        (Fault::Collector, message) => Status::internal(message),
    }
}

fn selection(
    selection: Option<stackscope_proto::v1::Selection>,
) -> Result<stackscope_profile::model::Selection, Status> {
    let selection = selection.ok_or_else(|| Status::invalid_argument("selection is missing"))?;
    let selection = selector::selection_from_proto(&selection)
        .map_err(|err| Status::invalid_argument(format!("selection: {err}")))?;
    if selection.range.end_unix_nanos <= selection.range.start_unix_nanos {
        return Err(Status::invalid_argument(
            "selection: the time range is empty (end must be after start)",
        ));
    }
    Ok(selection)
}

#[tonic::async_trait]
impl query_server::Query for QueryService {
    async fn flamegraph(
        &self,
        request: Request<FlamegraphRequest>,
    ) -> Result<Response<FlamegraphResponse>, Status> {
        let request = request.into_inner();
        let selection = selection(request.selection)?;
        let profile_type = selection.profile_type.clone();
        let flamegraph = self
            .engine
            .flamegraph(selection, request.min_share, Some(&request.group_by))
            .await
            .map_err(query_status)?;
        let mut response = flamegraph.tree.to_proto(flamegraph.sample_period_nanos);
        response.profile_type = profile_type.name().to_owned();
        Ok(Response::new(response))
    }

    async fn top_functions(
        &self,
        request: Request<TopFunctionsRequest>,
    ) -> Result<Response<TopFunctionsResponse>, Status> {
        let request = request.into_inner();
        let selection = selection(request.selection)?;
        let limit = match request.limit {
            0 => DEFAULT_TOP_LIMIT,
            limit => limit as usize,
        };
        let flamegraph = self
            .engine
            .flamegraph(selection, 0.0, None)
            .await
            .map_err(query_status)?;
        let functions = render::top_functions(&flamegraph.tree, limit)
            .into_iter()
            .map(|stat| FunctionCost {
                function: stat.function,
                binary: stat.binary,
                self_: stat.self_weight,
                total: stat.total_weight,
            })
            .collect();
        Ok(Response::new(TopFunctionsResponse {
            functions,
            total: flamegraph.tree.total(),
        }))
    }

    async fn label_names(
        &self,
        request: Request<LabelNamesRequest>,
    ) -> Result<Response<LabelNamesResponse>, Status> {
        let selection = selection(request.into_inner().selection)?;
        let names = self
            .engine
            .label_names(selection)
            .await
            .map_err(query_status)?;
        Ok(Response::new(LabelNamesResponse { names }))
    }

    async fn profile_types(
        &self,
        request: Request<ProfileTypesRequest>,
    ) -> Result<Response<ProfileTypesResponse>, Status> {
        let selection = selection(request.into_inner().selection)?;
        let types = self
            .engine
            .profile_types(selection)
            .await
            .map_err(query_status)?;
        Ok(Response::new(ProfileTypesResponse {
            types: types.iter().map(|t| t.name().to_owned()).collect(),
        }))
    }

    async fn label_values(
        &self,
        request: Request<LabelValuesRequest>,
    ) -> Result<Response<LabelValuesResponse>, Status> {
        let request = request.into_inner();
        if request.name.is_empty() {
            return Err(Status::invalid_argument("label name is missing"));
        }
        let selection = selection(request.selection)?;
        let values = self
            .engine
            .label_values(selection, request.name)
            .await
            .map_err(query_status)?;
        Ok(Response::new(LabelValuesResponse { values }))
    }

    async fn sample_series(
        &self,
        request: Request<SampleSeriesRequest>,
    ) -> Result<Response<SampleSeriesResponse>, Status> {
        let request = request.into_inner();
        let selection = selection(request.selection)?;
        let (step, points) = self
            .engine
            .series(selection, request.step_nanos)
            .await
            .map_err(query_status)?;
        Ok(Response::new(SampleSeriesResponse {
            points: points
                .into_iter()
                .map(|(start, weight)| SeriesPoint {
                    start_unix_nanos: start,
                    weight,
                })
                .collect(),
            step_nanos: step,
        }))
    }
}
