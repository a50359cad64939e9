//! Debuginfo for the whole fleet, by GNU build-id: what the collector names
//! stored frames with when profiles are read.
//!
//! Owns the store ([`DebuginfoStore`], on disk beside the database by
//! default: [`DiskStore`]), the checks a file passes before it is stored
//! ([`check_elf`]: ELF, the claimed build-id, symbols or DWARF inside), the
//! debuginfod client ([`debuginfod`]) and naming at query time
//! ([`symbolize`]). Does not own the upload protocol (the gRPC service in
//! `server`) or which frames need names (storage marks them).

pub mod debuginfod;
pub mod symbolize;

use std::{
    fs::File,
    io::Write as _,
    path::{Path, PathBuf},
    sync::atomic::{AtomicU64, Ordering},
};

pub use stackscope_collector_client::{ElfCheckError, ElfContent, check_elf, read_build_id};
use std::sync::Arc;

/// The collector's debuginfo: its store and the symbolizer that reads it.
#[derive(Clone)]
pub struct Debuginfo {
    pub store: Arc<dyn DebuginfoStore>,
    pub symbolizer: Arc<symbolize::Symbolizer>,
    /// Largest upload accepted, in bytes.
    pub max_upload_bytes: u64,
}

impl std::fmt::Debug for Debuginfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Debuginfo")
            .field("max_upload_bytes", &self.max_upload_bytes)
            .finish_non_exhaustive()
    }
}

/// A build-id as stored and asked for: lower-case hex, 2 to 128 digits.
pub fn is_valid_build_id(build_id: &str) -> bool {
    (2..=128).contains(&build_id.len())
        && build_id.len().is_multiple_of(2)
        && build_id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Why a file was not stored.
#[derive(Debug, thiserror::Error)]
pub enum DebuginfoError {
    #[error("{0:?} is not a build-id (2 to 128 lower-case hex digits)")]
    InvalidBuildId(String),
    #[error(transparent)]
    Elf(#[from] ElfCheckError),
    /// Storing the file would take the store past its size limit.
    #[error(
        "the debuginfo store holds {stored} bytes; {size} more would pass its limit of {limit} \
         (--max-debuginfo-store-bytes)"
    )]
    StoreFull { stored: u64, size: u64, limit: u64 },
    #[error("debuginfo store I/O at {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> DebuginfoError + '_ {
    move |source| DebuginfoError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Where debuginfo files are kept, by build-id. A distributed backend
/// implements this over its object store and hands the symbolizer local
/// copies.
pub trait DebuginfoStore: Send + Sync + 'static {
    /// A local path to the file stored for `build_id`, if any.
    fn get(&self, build_id: &str) -> Option<PathBuf>;

    /// A new file for the store, written by the caller before [`Self::commit`].
    fn stage(&self) -> Result<StagedFile, DebuginfoError>;

    /// Checks `staged` ([`check_elf`]) and stores it as `build_id`'s file;
    /// `Ok(false)` when the build-id was stored before (and is kept as it
    /// is). On any error nothing is stored.
    fn commit(&self, build_id: &str, staged: StagedFile) -> Result<bool, DebuginfoError>;
}

/// A file being written for the store; deleted unless committed.
#[derive(Debug)]
pub struct StagedFile {
    path: PathBuf,
    file: Option<File>,
}

impl StagedFile {
    pub fn write_all(&mut self, bytes: &[u8]) -> Result<(), DebuginfoError> {
        match &mut self.file {
            Some(file) => file.write_all(bytes).map_err(io_error(&self.path)),
            None => Ok(()),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for StagedFile {
    fn drop(&mut self) {
        if self.file.take().is_some() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// The default store: one file per build-id in a directory (the data
/// directory's `debuginfo/`), staged in `debuginfo/.incoming/` and renamed
/// into place, so a file is either whole or absent, also across crashes.
#[derive(Debug)]
pub struct DiskStore {
    dir: PathBuf,
    incoming: PathBuf,
    staged: AtomicU64,
    /// Bytes of the files stored, and the most they may take.
    stored: std::sync::Mutex<u64>,
    max_bytes: u64,
}

impl DiskStore {
    /// Opens (creating) the store in `dir`, removing uploads a crash left
    /// half written; it holds at most `max_bytes` of files (new ones are
    /// refused beyond).
    pub fn open(dir: &Path, max_bytes: u64) -> Result<Self, DebuginfoError> {
        let incoming = dir.join(".incoming");
        if incoming.exists() {
            std::fs::remove_dir_all(&incoming).map_err(io_error(&incoming))?;
        }
        std::fs::create_dir_all(&incoming).map_err(io_error(&incoming))?;
        let mut stored = 0;
        for entry in std::fs::read_dir(dir).map_err(io_error(dir))? {
            let entry = entry.map_err(io_error(dir))?;
            let metadata = entry.metadata().map_err(io_error(&entry.path()))?;
            if metadata.is_file() {
                stored += metadata.len();
            }
        }
        Ok(Self {
            dir: dir.to_owned(),
            incoming,
            staged: AtomicU64::new(0),
            stored: std::sync::Mutex::new(stored),
            max_bytes,
        })
    }

    /// Bytes of the files stored.
    pub fn stored_bytes(&self) -> u64 {
        *self
            .stored
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn path_of(&self, build_id: &str) -> PathBuf {
        self.dir.join(build_id)
    }
}

impl DebuginfoStore for DiskStore {
    fn get(&self, build_id: &str) -> Option<PathBuf> {
        if !is_valid_build_id(build_id) {
            return None;
        }
        let path = self.path_of(build_id);
        path.is_file().then_some(path)
    }

    fn stage(&self) -> Result<StagedFile, DebuginfoError> {
        let n = self.staged.fetch_add(1, Ordering::Relaxed);
        let path = self.incoming.join(format!("{}-{n}", std::process::id()));
        // Read too: the checks parse what was written.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(io_error(&path))?;
        Ok(StagedFile {
            path,
            file: Some(file),
        })
    }

    fn commit(&self, build_id: &str, mut staged: StagedFile) -> Result<bool, DebuginfoError> {
        if !is_valid_build_id(build_id) {
            return Err(DebuginfoError::InvalidBuildId(build_id.to_owned()));
        }
        let Some(file) = staged.file.as_ref() else {
            return Err(DebuginfoError::Io {
                path: staged.path.clone(),
                source: std::io::Error::other("the staged file was already committed"),
            });
        };
        file.sync_all().map_err(io_error(&staged.path))?;
        check_elf(file, build_id)?;
        let size = file.metadata().map_err(io_error(&staged.path))?.len();
        let target = self.path_of(build_id);
        // Held across the rename: two commits cannot both fit in the room
        // left for one.
        let mut stored = self
            .stored
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if target.exists() {
            return Ok(false);
        }
        if stored.saturating_add(size) > self.max_bytes {
            return Err(DebuginfoError::StoreFull {
                stored: *stored,
                size,
                limit: self.max_bytes,
            });
        }
        std::fs::rename(&staged.path, &target).map_err(io_error(&target))?;
        *stored += size;
        // Renamed: nothing for the drop to remove.
        staged.file = None;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use stackscope_test_fixtures::split_debug::SplitDebug;

    use super::*;

    /// A program built with `-g`, and its debug file made apart.
    fn build() -> SplitDebug {
        SplitDebug::from_source("prog", "int main(void) { return 0; }\n", &["-O1"])
    }

    fn stage_copy(store: &DiskStore, path: &Path) -> StagedFile {
        let mut staged = store.stage().expect("staging");
        staged
            .write_all(&std::fs::read(path).expect("reading"))
            .expect("writing");
        staged
    }

    #[test]
    fn build_ids_are_lower_case_hex_bytes() {
        assert!(is_valid_build_id("0a1b"));
        for bad in ["", "0", "0A", "xy", "../etc", &"ab".repeat(65)] {
            assert!(!is_valid_build_id(bad), "{bad}");
        }
    }

    #[test]
    fn debug_files_and_binaries_with_symbols_are_stored_once() {
        let built = build();
        let data = tempfile::tempdir().expect("temp dir");
        let store = DiskStore::open(data.path(), u64::MAX).expect("store");
        assert_eq!(store.get(&built.build_id), None);

        let content = check_elf(&File::open(&built.debug).expect("open"), &built.build_id)
            .expect("a debug file passes");
        assert!(!content.holds_code);
        let content = check_elf(&File::open(&built.full).expect("open"), &built.build_id)
            .expect("a binary with symbols passes");
        assert!(content.holds_code);

        let staged = stage_copy(&store, &built.debug);
        let staged_path = staged.path().to_owned();
        assert!(store.commit(&built.build_id, staged).expect("stored"));
        assert!(!staged_path.exists());
        let stored = store.get(&built.build_id).expect("stored file");
        assert_eq!(
            std::fs::read(stored).expect("read"),
            std::fs::read(&built.debug).expect("read")
        );
        // Again: kept as it is, and the second copy is gone.
        let staged = stage_copy(&store, &built.full);
        let staged_path = staged.path().to_owned();
        assert!(!store.commit(&built.build_id, staged).expect("known"));
        assert!(!staged_path.exists());
    }

    #[test]
    fn the_store_refuses_files_past_its_size_limit() {
        let first = build();
        let second = SplitDebug::from_source("other", "int main(void) { return 1; }\n", &["-O1"]);
        let size = std::fs::metadata(&first.debug).expect("size").len();
        let data = tempfile::tempdir().expect("temp dir");
        let store = DiskStore::open(data.path(), size + 100).expect("store");
        assert!(
            store
                .commit(&first.build_id, stage_copy(&store, &first.debug))
                .expect("fits")
        );
        let err = store
            .commit(&second.build_id, stage_copy(&store, &second.debug))
            .expect_err("past the limit");
        assert!(
            matches!(err, DebuginfoError::StoreFull { stored, limit, .. }
            if stored == size && limit == size + 100),
            "{err}"
        );
        assert_eq!(store.get(&second.build_id), None);
        assert_eq!(
            std::fs::read_dir(data.path().join(".incoming"))
                .expect("incoming")
                .count(),
            0
        );
        // Counted again when the store is opened again.
        drop(store);
        let store = DiskStore::open(data.path(), u64::MAX).expect("store");
        assert_eq!(store.stored_bytes(), size);
    }

    #[test]
    fn refused_files_store_nothing() {
        let built = build();
        let data = tempfile::tempdir().expect("temp dir");
        let store = DiskStore::open(data.path(), u64::MAX).expect("store");
        let debug = std::fs::read(&built.debug).expect("read");
        let other_id = "00".repeat(20);
        let cases: [(&str, &[u8], &str, String); 4] = [
            (
                "truncated",
                &debug[..debug.len() / 3],
                &built.build_id,
                String::new(),
            ),
            (
                "garbage",
                b"not an elf file at all",
                &built.build_id,
                String::new(),
            ),
            (
                "mismatched",
                &debug,
                &other_id,
                format!(
                    "the file's build-id is {}, not the {other_id} it was sent as",
                    built.build_id
                ),
            ),
            (
                "stripped",
                &std::fs::read(&built.stripped).expect("read"),
                &built.build_id,
                "the file carries no symbol table, DWARF or Go function table (a stripped \
                 binary names nothing)"
                    .to_owned(),
            ),
        ];
        for (what, bytes, claim, message) in cases {
            let mut staged = store.stage().expect("staging");
            staged.write_all(bytes).expect("writing");
            let err = store.commit(claim, staged).expect_err(what);
            if !message.is_empty() {
                assert_eq!(err.to_string(), message, "{what}");
            }
            assert_eq!(store.get(claim), None, "{what}");
        }
        let left: Vec<_> = std::fs::read_dir(data.path().join(".incoming"))
            .expect("incoming")
            .collect();
        assert!(left.is_empty(), "staged files left behind: {left:?}");
        assert_eq!(
            std::fs::read_dir(data.path()).expect("store dir").count(),
            1,
            "only .incoming"
        );
    }
}
