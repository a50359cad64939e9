//! OTLP profiles ingest (alpha: the spec's profiles signal is
//! `v1development`): `ProfilesService/Export` on the gRPC port and
//! `POST /v1development/profiles` (protobuf, optionally gzipped) on the
//! HTTP port, both behind the ingest token. An export is stored whole or
//! not at all, as one batch (`ingest::otlp` turns its profiles into what
//! an SDK would have sent).

use axum::{
    Router,
    body::Bytes,
    extract::{DefaultBodyLimit, State},
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
    routing::post,
};
use opentelemetry_proto::tonic::collector::profiles::v1development::{
    ExportProfilesServiceRequest, ExportProfilesServiceResponse,
    profiles_service_server::ProfilesService,
};
use prost::Message as _;
use stackscope_profile::model::unix_nanos;
use tonic::{Request, Status};

use super::{
    connect::decompressed,
    store::{SentIngest, SentRefusal},
};
use crate::ingest::otlp::otlp_profiles;

/// Where OTLP/HTTP exporters send profiles.
pub const HTTP_PATH: &str = "/v1development/profiles";

/// Stores an export; the refusal, if any, as a gRPC status (what OTLP's
/// HTTP answers are mapped from, too).
async fn export(state: &SentIngest, request: &ExportProfilesServiceRequest) -> Result<(), Status> {
    let now = unix_nanos(std::time::SystemTime::now());
    let profiles = otlp_profiles(request, &state.limits, state.max_bytes, now).map_err(|err| {
        Status::invalid_argument(format!("export refused, nothing stored: {err}"))
    })?;
    if profiles.is_empty() {
        return Ok(());
    }
    state
        .store(profiles)
        .await
        .map(|_| ())
        .map_err(|refusal| match refusal {
            SentRefusal::Invalid(message) => Status::invalid_argument(message),
            // OTLP: RESOURCE_EXHAUSTED is retried; a request too large is not.
            SentRefusal::TooLarge(message) => Status::invalid_argument(message),
            SentRefusal::Unavailable(message) => Status::unavailable(message),
        })
}

/// The gRPC service.
pub struct OtlpProfiles(pub SentIngest);

#[tonic::async_trait]
impl ProfilesService for OtlpProfiles {
    async fn export(
        &self,
        request: Request<ExportProfilesServiceRequest>,
    ) -> Result<tonic::Response<ExportProfilesServiceResponse>, Status> {
        export(&self.0, request.get_ref()).await?;
        Ok(tonic::Response::new(
            ExportProfilesServiceResponse::default(),
        ))
    }
}

/// The HTTP route (behind the ingest token).
pub fn http_router(state: SentIngest) -> Router {
    let max_bytes = state.max_bytes;
    Router::new()
        .route(HTTP_PATH, post(export_http))
        .layer(DefaultBodyLimit::max(max_bytes))
        .with_state(state)
}

async fn export_http(State(state): State<SentIngest>, headers: HeaderMap, body: Bytes) -> Response {
    let text =
        |status: StatusCode, message: String| (status, format!("{message}\n")).into_response();
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if !content_type.starts_with("application/x-protobuf") {
        return text(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!(
                "content type {content_type:?}: OTLP profiles are taken as application/x-protobuf \
                 (OTLP/JSON is not)"
            ),
        );
    }
    let body = match decompressed(&headers, body, state.max_bytes) {
        Ok(body) => body,
        Err(err) => return text(StatusCode::BAD_REQUEST, err.message),
    };
    let request = match ExportProfilesServiceRequest::decode(body) {
        Ok(request) => request,
        Err(err) => return text(StatusCode::BAD_REQUEST, format!("the export: {err}")),
    };
    match export(&state, &request).await {
        Ok(()) => (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/x-protobuf"),
            )],
            ExportProfilesServiceResponse::default().encode_to_vec(),
        )
            .into_response(),
        Err(status) => {
            let code = match status.code() {
                tonic::Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
                _ => StatusCode::BAD_REQUEST,
            };
            text(code, status.message().to_owned())
        }
    }
}
