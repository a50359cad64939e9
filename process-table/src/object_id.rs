//! Which object file a mapping is: the key unwind tables, debuginfo and
//! symbols are filed under.
//!
//! Owns: [`ObjectId`] (the GNU build-id when the file has one, else a
//! [`FileKey`] built from the file's device, inode, size and mtime), its hex
//! form, and [`identify`], which computes it together with the load segments
//! from an open file.
//!
//! Does not own: finding and opening the file ([`open`](crate::open)),
//! caching identities ([`table`](crate::table)), or parsing anything in the
//! ELF file beyond the headers ([`elf`]).
//!
//! A build-id names the contents, so the same library in a hundred containers
//! is one object, and a library rebuilt and reinstalled is a new one. Files
//! without a build-id get a key that changes whenever the file is replaced
//! (new inode) or rewritten (new mtime or size), so a stale table is never
//! used for a new version; the price is that the same file on two
//! filesystems is two objects.

use std::{
    fmt,
    fs::{File, Metadata},
    os::unix::fs::MetadataExt as _,
};

use thiserror::Error;

use crate::elf::{self, ElfError, LoadSegment};

/// A GNU build-id: the descriptor of the `NT_GNU_BUILD_ID` note, 1 to
/// [`BuildId::MAX_LEN`] bytes (20 for the usual SHA-1, 16 for MD5/UUID,
/// anything the linker was told with `--build-id=0x...`).
///
/// Stored inline so the type is `Copy` and hashing it touches no pointer.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BuildId {
    len: u8,
    bytes: [u8; BuildId::MAX_LEN],
}

impl BuildId {
    /// The longest build-id accepted. Linkers produce at most 32 bytes
    /// (sha256 in lld); a longer one is more likely garbage than a key.
    pub const MAX_LEN: usize = 64;

    /// `None` when `bytes` is empty or longer than [`Self::MAX_LEN`].
    pub fn new(bytes: &[u8]) -> Option<Self> {
        if bytes.is_empty() || bytes.len() > Self::MAX_LEN {
            return None;
        }
        let mut stored = [0u8; Self::MAX_LEN];
        stored[..bytes.len()].copy_from_slice(bytes);
        Some(Self {
            // Cannot truncate: checked against MAX_LEN (64) above.
            len: bytes.len() as u8,
            bytes: stored,
        })
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

impl fmt::Display for BuildId {
    /// Lower-case hex, the form `readelf -n`, `file` and debuginfod use.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for byte in self.as_bytes() {
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for BuildId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BuildId({self})")
    }
}

/// Identifies one version of one file on this machine without reading it:
/// `stat(2)` fields that change when the file is replaced or rewritten.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FileKey {
    /// `st_dev`, the kernel's encoding (not the `major:minor` of maps).
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    /// Modification time in nanoseconds since the epoch (saturating).
    ///
    /// The kernel stamps writes with a coarse clock (one tick, 1-10 ms), so
    /// two same-size rewrites of one inode within a tick keep the key; tools
    /// that install binaries write a new file and rename it, which changes
    /// the inode instead.
    pub mtime_ns: i64,
}

impl FileKey {
    pub fn from_metadata(metadata: &Metadata) -> Self {
        Self {
            dev: metadata.dev(),
            ino: metadata.ino(),
            size: metadata.size(),
            mtime_ns: metadata
                .mtime()
                .saturating_mul(1_000_000_000)
                .saturating_add(metadata.mtime_nsec()),
        }
    }
}

impl fmt::Display for FileKey {
    /// `file-<dev>-<ino>-<size>-<mtime_ns>`, each in hex. The prefix keeps
    /// it apart from any build-id, which is bare hex.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "file-{:x}-{:x}-{:x}-{:x}",
            self.dev, self.ino, self.size, self.mtime_ns
        )
    }
}

/// The identity of an object file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ObjectId {
    /// The file's GNU build-id: the same for every copy of the same build.
    BuildId(BuildId),
    /// The file has no build-id (or is not ELF): this version of this file.
    FileKey(FileKey),
}

impl fmt::Display for ObjectId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BuildId(id) => id.fmt(f),
            Self::FileKey(key) => key.fmt(f),
        }
    }
}

/// Everything this crate learns about an object file, computed once per
/// [`FileKey`] and shared by every mapping of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub id: ObjectId,
    /// The `stat(2)` key of the file the identity was read from.
    pub file_key: FileKey,
    /// `Some` with the `PT_LOAD` segments for ELF files, `None` for files
    /// that are not ELF (their addresses have file offsets but no ELF
    /// virtual addresses).
    pub load_segments: Option<Vec<LoadSegment>>,
}

/// Why a file could not be identified.
#[derive(Debug, Error)]
pub enum IdentityError {
    /// The file is ELF but its headers could not be read: using a key for it
    /// would hand the unwinder a file it cannot use either.
    #[error("reading the ELF headers")]
    Elf(#[source] ElfError),
}

/// Identifies an open file whose `metadata` was taken from the same file
/// descriptor (so the key and the contents belong to the same version).
pub fn identify(file: &File, metadata: &Metadata) -> Result<Identity, IdentityError> {
    let file_key = FileKey::from_metadata(metadata);
    match elf::read_summary(file) {
        Ok(summary) => Ok(Identity {
            id: summary
                .build_id
                .map_or(ObjectId::FileKey(file_key), ObjectId::BuildId),
            file_key,
            load_segments: Some(summary.load_segments),
        }),
        Err(ElfError::NotElf) => Ok(Identity {
            id: ObjectId::FileKey(file_key),
            file_key,
            load_segments: None,
        }),
        Err(err) => Err(IdentityError::Elf(err)),
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;

    #[test]
    fn build_id_bounds() {
        assert_eq!(BuildId::new(&[]), None);
        assert_eq!(BuildId::new(&[7; 65]), None);
        let longest = BuildId::new(&[0xab; 64]).expect("64 bytes is allowed");
        assert_eq!(longest.as_bytes(), &[0xab; 64]);
        assert_eq!(longest.to_string(), "ab".repeat(64));
    }

    #[test]
    fn build_id_hex() {
        let id = BuildId::new(&[0x00, 0x1f, 0xa0, 0xff]).expect("valid");
        assert_eq!(id.to_string(), "001fa0ff");
        assert_eq!(format!("{id:?}"), "BuildId(001fa0ff)");
        assert_eq!(ObjectId::BuildId(id).to_string(), "001fa0ff");
        // Padding bytes never leak into equality.
        assert_ne!(
            id,
            BuildId::new(&[0x00, 0x1f, 0xa0, 0xff, 0x00]).expect("valid")
        );
    }

    #[test]
    fn file_key_hex() {
        let key = FileKey {
            dev: 0xfe01,
            ino: 1837004,
            size: 0x1d4a80,
            mtime_ns: 1_700_000_000_123_456_789,
        };
        assert_eq!(
            ObjectId::FileKey(key).to_string(),
            "file-fe01-1c07cc-1d4a80-17979cfe3d85cd15"
        );
    }

    #[test]
    fn object_id_is_small() {
        // Held in an Arc per object and compared on every cache lookup:
        // keep it within two cache lines.
        assert!(
            std::mem::size_of::<ObjectId>() <= 72,
            "{}",
            std::mem::size_of::<ObjectId>()
        );
    }

    #[test]
    fn non_elf_file_gets_a_file_key() {
        let mut file = tempfile::tempfile().expect("temporary file");
        file.write_all(b"#!/bin/sh\n").expect("writing");
        let metadata = file.metadata().expect("fstat");
        let identity = identify(&file, &metadata).expect("identifies");
        assert_eq!(
            identity.id,
            ObjectId::FileKey(FileKey::from_metadata(&metadata))
        );
        assert_eq!(identity.load_segments, None);
    }
}
