//! `stackscope debuginfo upload`: sends files to the collector's
//! `Debuginfo` service, each once per build-id: the collector is asked
//! first, and a file it already holds (from any node) is not sent.

use std::{
    fs::File,
    io::Read as _,
    path::{Path, PathBuf},
};

use anyhow::Context as _;
use sha2::{Digest as _, Sha256};
use stackscope_collector::debuginfo::check_elf;
use stackscope_proto::v1::{
    DebuginfoExistsRequest, DebuginfoUploadHeader, DebuginfoUploadRequest,
    debuginfo_client::DebuginfoClient, debuginfo_upload_request::Part,
};
use tonic::{
    Request,
    metadata::MetadataValue,
    service::{Interceptor, interceptor::InterceptedService},
    transport::Channel,
};

/// Bytes per upload message.
const CHUNK_BYTES: usize = 1 << 20;

/// Reads a bearer token file (surrounding white space trimmed).
pub fn read_token(path: &Path) -> anyhow::Result<String> {
    let token = std::fs::read_to_string(path)
        .with_context(|| format!("reading the token file {}", path.display()))?;
    let token = token.trim().to_owned();
    anyhow::ensure!(
        !token.is_empty(),
        "the token file {} is empty",
        path.display()
    );
    Ok(token)
}

/// Adds `authorization: Bearer <token>` when there is a token.
#[derive(Clone)]
struct Bearer(Option<MetadataValue<tonic::metadata::Ascii>>);

impl Interceptor for Bearer {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, tonic::Status> {
        if let Some(token) = &self.0 {
            request
                .metadata_mut()
                .insert("authorization", token.clone());
        }
        Ok(request)
    }
}

/// A file's build-id (lower-case hex), checked to carry symbols or DWARF
/// as the collector will check it.
fn build_id_of(path: &Path) -> anyhow::Result<String> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let data = object::ReadCache::new(&file);
    let elf = object::File::parse(&data)
        .with_context(|| format!("{} is not an ELF file", path.display()))?;
    use object::Object as _;
    let build_id = elf
        .build_id()
        .with_context(|| format!("reading the notes of {}", path.display()))?
        .with_context(|| {
            format!(
                "{} has no build-id note (link with -Wl,--build-id): the collector could not \
                 match it to any frame",
                path.display()
            )
        })?;
    let build_id: String = build_id.iter().map(|b| format!("{b:02x}")).collect();
    check_elf(&file, &build_id).with_context(|| format!("{}", path.display()))?;
    Ok(build_id)
}

/// Size and SHA-256 of a file, read once.
fn digest_of(path: &Path) -> anyhow::Result<(u64, Vec<u8>)> {
    let mut file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; CHUNK_BYTES];
    let mut size = 0u64;
    loop {
        let read = file
            .read(&mut buffer)
            .with_context(|| format!("reading {}", path.display()))?;
        if read == 0 {
            break;
        }
        size += read as u64;
        hasher.update(&buffer[..read]);
    }
    Ok((size, hasher.finalize().to_vec()))
}

/// Uploads `files`, printing what happened to each; fails on the first
/// file that cannot be sent, after saying so.
pub async fn upload_files(
    channel: Channel,
    token: Option<String>,
    files: &[PathBuf],
    address: &str,
) -> anyhow::Result<()> {
    let token = token
        .map(|token| MetadataValue::try_from(format!("Bearer {token}")))
        .transpose()
        .context("the token is not a valid header value")?;
    let mut client = DebuginfoClient::new(InterceptedService::new(channel, Bearer(token)));
    let failed = |status: tonic::Status| {
        anyhow::anyhow!(
            "the collector at {address} answered {:?}: {}",
            status.code(),
            status.message()
        )
    };
    for path in files {
        let build_id = build_id_of(path)?;
        let exists = client
            .exists(DebuginfoExistsRequest {
                build_id: build_id.clone(),
            })
            .await
            .map_err(failed)?
            .into_inner()
            .exists;
        if exists {
            println!("{}: build-id {build_id} already stored", path.display());
            continue;
        }
        let (size, sha256) = digest_of(path)?;
        let header = DebuginfoUploadHeader {
            build_id: build_id.clone(),
            size,
            sha256,
            file_name: path.display().to_string(),
        };
        let (send, receive) = tokio::sync::mpsc::channel(4);
        let reader_path = path.clone();
        // Reads the file as the stream is sent: a large debug file is never
        // held in memory whole.
        let reader = tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
            let header = DebuginfoUploadRequest {
                part: Some(Part::Header(header)),
            };
            if send.blocking_send(header).is_err() {
                return Ok(());
            }
            let mut file = File::open(&reader_path)?;
            loop {
                let mut chunk = vec![0u8; CHUNK_BYTES];
                let read = file.read(&mut chunk)?;
                if read == 0 {
                    return Ok(());
                }
                chunk.truncate(read);
                let message = DebuginfoUploadRequest {
                    part: Some(Part::Chunk(chunk)),
                };
                if send.blocking_send(message).is_err() {
                    return Ok(());
                }
            }
        });
        let response = client
            .upload(tokio_stream::wrappers::ReceiverStream::new(receive))
            .await
            .map_err(failed);
        reader
            .await
            .context("the file reader stopped")?
            .with_context(|| format!("reading {}", path.display()))?;
        if response?.into_inner().already_stored {
            println!("{}: build-id {build_id} already stored", path.display());
        } else {
            println!(
                "{}: build-id {build_id} uploaded ({size} bytes)",
                path.display()
            );
        }
    }
    Ok(())
}
