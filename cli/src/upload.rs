//! `stackscope debuginfo upload`: checks each file as the collector will
//! (ELF, a build-id, a symbol table or DWARF) and sends it once per
//! build-id (`stackscope-collector-client`).

use std::{
    fs::File,
    path::{Path, PathBuf},
};

use anyhow::Context as _;
use stackscope_collector_client::{ElfCheckError, Uploaded, check_elf, read_build_id, upload};
use stackscope_proto::v1::debuginfo_client::DebuginfoClient;
use tonic::{metadata::MetadataValue, transport::Channel};

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

/// A file's build-id (lower-case hex), checked to carry symbols or DWARF
/// as the collector will check it.
fn build_id_of(path: &Path) -> anyhow::Result<String> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let checked =
        read_build_id(&file).and_then(|build_id| check_elf(&file, &build_id).map(|_| build_id));
    match checked {
        Err(ElfCheckError::NoBuildId) => anyhow::bail!(
            "{} has no build-id note (link with -Wl,--build-id): the collector could not match \
             it to any frame",
            path.display()
        ),
        checked => Ok(checked.with_context(|| path.display().to_string())?),
    }
}

/// Uploads `files`, printing what happened to each; stops at the first
/// file that cannot be sent.
pub async fn upload_files(
    channel: Channel,
    token: Option<String>,
    files: &[PathBuf],
    address: &str,
) -> anyhow::Result<()> {
    let authorization = token
        .map(|token| MetadataValue::try_from(format!("Bearer {token}")))
        .transpose()
        .context("the token is not a valid header value")?;
    let mut client = DebuginfoClient::new(channel);
    for path in files {
        let build_id = build_id_of(path)?;
        let name = path.display().to_string();
        let outcome = upload(&mut client, authorization.as_ref(), &build_id, path, &name)
            .await
            .with_context(|| format!("uploading {name} to the collector at {address}"))?;
        match outcome {
            Uploaded::AlreadyStored => println!("{name}: build-id {build_id} already stored"),
            Uploaded::Stored { bytes } => {
                println!("{name}: build-id {build_id} uploaded ({bytes} bytes)")
            }
        }
    }
    Ok(())
}
