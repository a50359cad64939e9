//! Uploads a debuginfo file to a collector's `Debuginfo` service, once per
//! build-id for the whole fleet: the collector is asked first, and a file it
//! already holds (sent by any node or fetched from debuginfod) is not sent.
//! The file streams in chunks as it is read, after its size and SHA-256
//! (which the collector checks before storing) were taken in a first read.
//!
//! Owns the client side of the protocol, and the one rule both sides share
//! on what is worth sending: an ELF file with the build-id it is sent as
//! and symbols of its own ([`check_elf`], [`carries_symbols`]), which the
//! collector requires and the agent and the CLI check before they send.

use std::{
    fs::File,
    io::Read as _,
    path::{Path, PathBuf},
};

use sha2::{Digest as _, Sha256};
use stackscope_proto::v1::{
    DebuginfoExistsRequest, DebuginfoUploadHeader, DebuginfoUploadRequest,
    debuginfo_client::DebuginfoClient, debuginfo_upload_request::Part,
};
use tonic::{
    Request,
    metadata::{Ascii, MetadataValue},
    transport::Channel,
};

/// Whether section `name` of `elf` holds bytes (a debug file made with
/// `objcopy --only-keep-debug` keeps the code sections' headers as NOBITS).
pub fn holds_section<'data, R: object::ReadRef<'data>>(
    elf: &object::File<'data, R>,
    name: &str,
) -> bool {
    use object::{Object as _, ObjectSection as _};
    elf.section_by_name(name)
        .is_some_and(|section| section.kind() != object::SectionKind::UninitializedData)
}

/// Whether `elf` carries names of its own: a symbol table, DWARF, or the
/// Go runtime's function table (`.gopclntab`, which a Go binary keeps when
/// stripped of the other two, and which names every Go function).
pub fn carries_symbols<'data, R: object::ReadRef<'data>>(elf: &object::File<'data, R>) -> bool {
    holds_section(elf, ".symtab")
        || holds_section(elf, ".debug_info")
        || holds_section(elf, ".gopclntab")
}

/// Why a file is no debuginfo for a build-id.
#[derive(Debug, thiserror::Error)]
pub enum ElfCheckError {
    #[error("the file is not ELF or its headers are malformed")]
    NotElf(#[source] object::Error),
    #[error("the file carries no build-id note")]
    NoBuildId,
    #[error("the file's build-id is {found}, not the {claimed} it was sent as")]
    BuildIdMismatch { claimed: String, found: String },
    #[error(
        "the file carries no symbol table, DWARF or Go function table (a stripped binary names nothing)"
    )]
    NoSymbols,
}

/// What a checked ELF file holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ElfContent {
    /// Its executable segments hold the code (a binary, not a separate
    /// debug file whose sections are `NOBITS`): file offsets can be read
    /// in it directly.
    pub holds_code: bool,
}

/// The build-id `elf` carries, as lower-case hex.
fn build_id_of<'data, R: object::ReadRef<'data>>(
    elf: &object::File<'data, R>,
) -> Result<String, ElfCheckError> {
    use object::Object as _;
    let found = elf
        .build_id()
        .map_err(ElfCheckError::NotElf)?
        .ok_or(ElfCheckError::NoBuildId)?;
    Ok(found.iter().map(|b| format!("{b:02x}")).collect())
}

/// The build-id the ELF `file` carries, as lower-case hex.
pub fn read_build_id(file: &File) -> Result<String, ElfCheckError> {
    let cache = object::ReadCache::new(file);
    build_id_of(&object::File::parse(&cache).map_err(ElfCheckError::NotElf)?)
}

/// Checks that `file` is ELF, carries `build_id` and has a symbol table or
/// DWARF: what a collector stores, and so what is worth sending.
pub fn check_elf(file: &File, build_id: &str) -> Result<ElfContent, ElfCheckError> {
    let cache = object::ReadCache::new(file);
    let elf = object::File::parse(&cache).map_err(ElfCheckError::NotElf)?;
    let found = build_id_of(&elf)?;
    if found != build_id {
        return Err(ElfCheckError::BuildIdMismatch {
            claimed: build_id.to_owned(),
            found,
        });
    }
    if !carries_symbols(&elf) {
        return Err(ElfCheckError::NoSymbols);
    }
    Ok(ElfContent {
        holds_code: holds_section(&elf, ".text"),
    })
}

/// Bytes per upload message (the collector's default message limit is
/// well above).
pub const CHUNK_BYTES: usize = 1 << 20;

/// What an upload did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Uploaded {
    /// The collector held the build-id already; nothing was sent.
    AlreadyStored,
    /// Sent and stored.
    Stored { bytes: u64 },
}

/// Why an upload failed.
#[derive(Debug, thiserror::Error)]
pub enum UploadError {
    #[error("reading {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The collector refused the file or could not be reached.
    #[error("the collector answered {:?}: {}", .0.code(), .0.message())]
    Collector(#[source] tonic::Status),
    #[error("the file reader task failed")]
    Task(#[source] tokio::task::JoinError),
}

/// A request carrying the bearer token, when there is one.
fn request<T>(message: T, authorization: Option<&MetadataValue<Ascii>>) -> Request<T> {
    let mut request = Request::new(message);
    if let Some(authorization) = authorization {
        request
            .metadata_mut()
            .insert("authorization", authorization.clone());
    }
    request
}

/// Uploads `path` as `build_id`'s debuginfo unless the collector holds it.
/// `file_name` is what the collector's log shows for it.
pub async fn upload(
    client: &mut DebuginfoClient<Channel>,
    authorization: Option<&MetadataValue<Ascii>>,
    build_id: &str,
    path: &Path,
    file_name: &str,
) -> Result<Uploaded, UploadError> {
    let exists = client
        .exists(request(
            DebuginfoExistsRequest {
                build_id: build_id.to_owned(),
            },
            authorization,
        ))
        .await
        .map_err(UploadError::Collector)?
        .into_inner()
        .exists;
    if exists {
        return Ok(Uploaded::AlreadyStored);
    }
    let digest_path = path.to_owned();
    let (size, sha256) = tokio::task::spawn_blocking(move || digest_of(&digest_path))
        .await
        .map_err(UploadError::Task)??;
    let header = DebuginfoUploadRequest {
        part: Some(Part::Header(DebuginfoUploadHeader {
            build_id: build_id.to_owned(),
            size,
            sha256,
            file_name: file_name.to_owned(),
        })),
    };
    let (send, receive) = tokio::sync::mpsc::channel(4);
    let reader_path = path.to_owned();
    // Reads the file as the stream is sent: a large debug file is never
    // held in memory whole.
    let reader = tokio::task::spawn_blocking(move || -> Result<(), UploadError> {
        if send.blocking_send(header).is_err() {
            return Ok(());
        }
        let read_error = |source| UploadError::Read {
            path: reader_path.clone(),
            source,
        };
        let mut file = File::open(&reader_path).map_err(read_error)?;
        loop {
            let mut chunk = vec![0u8; CHUNK_BYTES];
            let read = file.read(&mut chunk).map_err(read_error)?;
            if read == 0 {
                return Ok(());
            }
            chunk.truncate(read);
            let message = DebuginfoUploadRequest {
                part: Some(Part::Chunk(chunk)),
            };
            // The call ended early (refused): nothing more to send.
            if send.blocking_send(message).is_err() {
                return Ok(());
            }
        }
    });
    let response = client
        .upload(request(
            tokio_stream::wrappers::ReceiverStream::new(receive),
            authorization,
        ))
        .await;
    reader.await.map_err(UploadError::Task)??;
    let already_stored = response
        .map_err(UploadError::Collector)?
        .into_inner()
        .already_stored;
    Ok(if already_stored {
        Uploaded::AlreadyStored
    } else {
        Uploaded::Stored { bytes: size }
    })
}

/// Size and SHA-256 of a file, read once.
fn digest_of(path: &Path) -> Result<(u64, Vec<u8>), UploadError> {
    let read_error = |source| UploadError::Read {
        path: path.to_owned(),
        source,
    };
    let mut file = File::open(path).map_err(read_error)?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; CHUNK_BYTES];
    let mut size = 0u64;
    loop {
        let read = file.read(&mut buffer).map_err(read_error)?;
        if read == 0 {
            break;
        }
        size += read as u64;
        hasher.update(&buffer[..read]);
    }
    Ok((size, hasher.finalize().to_vec()))
}
