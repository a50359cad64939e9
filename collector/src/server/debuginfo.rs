//! The gRPC `Debuginfo` service (whether a build-id is stored, and uploads)
//! and debuginfod's HTTP API over the same store.
//! An upload is written to a staged file as it streams in, with its size
//! and SHA-256 checked against its header, and stored only when every check
//! passed ([`DebuginfoStore::commit`]); a refused upload leaves nothing.

use std::sync::Arc;

use sha2::{Digest as _, Sha256};
use stackscope_proto::v1::{
    DebuginfoExistsRequest, DebuginfoExistsResponse, DebuginfoUploadRequest,
    DebuginfoUploadResponse, debuginfo_server, debuginfo_upload_request::Part,
};
use tonic::{Request, Response, Status, Streaming};

use crate::debuginfo::{DebuginfoError, DebuginfoStore, check_elf, is_valid_build_id};

pub struct DebuginfoService {
    store: Arc<dyn DebuginfoStore>,
    max_bytes: u64,
}

impl DebuginfoService {
    pub fn new(store: Arc<dyn DebuginfoStore>, max_bytes: u64) -> Self {
        Self { store, max_bytes }
    }
}

fn refused(what: impl std::fmt::Display) -> Status {
    Status::invalid_argument(format!("debuginfo upload refused, nothing stored: {what}"))
}

fn checked_build_id(build_id: &str) -> Result<(), Status> {
    if is_valid_build_id(build_id) {
        Ok(())
    } else {
        Err(Status::invalid_argument(format!(
            "{build_id:?} is not a build-id (2 to 128 lower-case hex digits)"
        )))
    }
}

#[tonic::async_trait]
impl debuginfo_server::Debuginfo for DebuginfoService {
    async fn exists(
        &self,
        request: Request<DebuginfoExistsRequest>,
    ) -> Result<Response<DebuginfoExistsResponse>, Status> {
        let build_id = request.into_inner().build_id;
        checked_build_id(&build_id)?;
        Ok(Response::new(DebuginfoExistsResponse {
            exists: self.store.get(&build_id).is_some(),
        }))
    }

    async fn upload(
        &self,
        request: Request<Streaming<DebuginfoUploadRequest>>,
    ) -> Result<Response<DebuginfoUploadResponse>, Status> {
        let mut stream = request.into_inner();
        let header = match stream.message().await?.and_then(|first| first.part) {
            Some(Part::Header(header)) => header,
            _ => return Err(refused("the first message must be the header")),
        };
        checked_build_id(&header.build_id)?;
        if header.size > self.max_bytes {
            return Err(Status::resource_exhausted(format!(
                "debuginfo upload refused, nothing stored: {} bytes is more than the {} this \
                 collector accepts (--max-debuginfo-bytes)",
                header.size, self.max_bytes
            )));
        }
        if header.sha256.len() != 32 {
            return Err(refused("the header's sha256 is not 32 bytes"));
        }
        if self.store.get(&header.build_id).is_some() {
            return Ok(Response::new(DebuginfoUploadResponse {
                already_stored: true,
            }));
        }
        let internal = |err: DebuginfoError| {
            tracing::error!("storing debuginfo: {:#}", anyhow::Error::from(err));
            Status::unavailable("the collector could not store the file; retry later")
        };
        let mut staged = self.store.stage().map_err(internal)?;
        let mut hasher = Sha256::new();
        let mut received = 0u64;
        while let Some(message) = stream.message().await? {
            let Some(Part::Chunk(chunk)) = message.part else {
                return Err(refused("a second header"));
            };
            received += chunk.len() as u64;
            if received > header.size {
                return Err(refused(format!(
                    "more bytes than the {} the header announced",
                    header.size
                )));
            }
            hasher.update(&chunk);
            staged.write_all(&chunk).map_err(internal)?;
        }
        if received != header.size {
            return Err(refused(format!(
                "truncated: {received} of {} bytes arrived",
                header.size
            )));
        }
        if hasher.finalize()[..] != header.sha256[..] {
            return Err(refused("the bytes do not match the header's sha256"));
        }
        let store = Arc::clone(&self.store);
        let build_id = header.build_id.clone();
        let stored = tokio::task::spawn_blocking(move || store.commit(&build_id, staged))
            .await
            .map_err(|_| Status::internal("the debuginfo task failed"))?;
        match stored {
            Ok(new) => {
                if new {
                    tracing::info!(
                        build_id = header.build_id,
                        file = header.file_name,
                        bytes = header.size,
                        "debuginfo stored"
                    );
                }
                Ok(Response::new(DebuginfoUploadResponse {
                    already_stored: !new,
                }))
            }
            Err(err @ DebuginfoError::Io { .. }) => Err(internal(err)),
            Err(err @ DebuginfoError::StoreFull { .. }) => Err(Status::resource_exhausted(
                format!("debuginfo upload refused, nothing stored: {err}"),
            )),
            Err(err) => Err(refused(err)),
        }
    }
}

/// debuginfod's HTTP API over the store (`GET /buildid/<id>/debuginfo` and
/// `/executable`), so `debuginfod-find`, gdb, perf and other collectors
/// (`--debuginfod-urls`) can read what the fleet uploaded. A stored debug
/// file is served as debuginfo only; a stored binary as both.
pub fn debuginfod_router(store: Arc<dyn DebuginfoStore>) -> axum::Router {
    use axum::routing::get;
    axum::Router::new()
        .route(
            "/buildid/{build_id}/debuginfo",
            get(|state, path| serve_file(state, path, false)),
        )
        .route(
            "/buildid/{build_id}/executable",
            get(|state, path| serve_file(state, path, true)),
        )
        .with_state(store)
}

async fn serve_file(
    axum::extract::State(store): axum::extract::State<Arc<dyn DebuginfoStore>>,
    axum::extract::Path(build_id): axum::extract::Path<String>,
    executable: bool,
) -> axum::response::Response {
    use axum::{
        http::{StatusCode, header},
        response::IntoResponse as _,
    };
    let not_found = || (StatusCode::NOT_FOUND, "not found\n").into_response();
    let Some(path) = store.get(&build_id) else {
        return not_found();
    };
    let checked = {
        let (path, build_id) = (path.clone(), build_id.clone());
        tokio::task::spawn_blocking(move || {
            let file = std::fs::File::open(&path).ok()?;
            let content = check_elf(&file, &build_id).ok()?;
            let size = file.metadata().ok()?.len();
            Some((content, size))
        })
        .await
    };
    let Ok(Some((content, size))) = checked else {
        return not_found();
    };
    if executable && !content.holds_code {
        return not_found();
    }
    let Ok(file) = tokio::fs::File::open(&path).await else {
        return not_found();
    };
    let body = axum::body::Body::from_stream(tokio_util::io::ReaderStream::new(file));
    (
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_owned()),
            (header::CONTENT_LENGTH, size.to_string()),
        ],
        body,
    )
        .into_response()
}
