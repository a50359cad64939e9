//! Which object file a mapping is: the key unwind tables, debuginfo and
//! symbols are filed under.
//!
//! Owns: [`ObjectId`] (the GNU build-id with a digest of the file's
//! contents when the file has one, else a [`FileKey`] built from the file's
//! device, inode, size and mtime), its hex forms, the [`DigestBudget`], and
//! [`identify`], which computes it together with the load segments from an
//! open file.
//!
//! Does not own: finding and opening the file ([`open`](crate::open)),
//! caching identities ([`table`](crate::table)), or parsing anything in the
//! ELF file beyond the headers ([`elf`]).
//!
//! A build-id names the contents, so the same library in a hundred containers
//! is one object, and a library rebuilt and reinstalled is a new one. But any
//! process can map a file that claims another's build-id (`ld
//! --build-id=0x...` writes any bytes): keyed by the build-id alone, its
//! unwind tables and names would be used for the real library in every
//! other process, and the real one's for it. So the identity also carries
//! a digest of the whole file ([`ContentDigest`]): every cache on the node
//! that is shared between files is shared only between identical files,
//! and the build-id alone goes on the wire, where the collector names it.
//!
//! Files without a build-id (and those not digested: too large, or past
//! the budget) get a key that changes whenever the file is replaced (new
//! inode) or rewritten (new mtime or size), so a stale table is never used
//! for a new version; the price is that the same file on two
//! filesystems is two objects.

use std::{
    fmt,
    fs::{File, Metadata},
    io,
    os::unix::fs::{FileExt as _, MetadataExt as _},
    time::Instant,
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

/// The first 128 bits of the BLAKE3 hash of a whole file: equal digests
/// are equal contents. Making a file with the digest of a given one (the
/// library it would pass for) takes 2^128 work. BLAKE3 rather than SHA-256:
/// 2.3 times as fast here (981 against 386 MB/s on a 146 MB library, both
/// CPUs busy), and files are digested on the sampling loop's thread.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContentDigest([u8; 16]);

impl ContentDigest {
    /// Files larger than this are not digested: a hostile process must not
    /// be able to make the agent read gigabytes per file it maps. Such a
    /// file is identified by its [`FileKey`] instead
    /// ([`ObjectId::UnverifiedBuildId`]). The largest libraries in common
    /// use (LLVM, the Rust compiler's driver) are well under it.
    pub const MAX_FILE_BYTES: u64 = 1 << 30;

    /// Digests `file` (`len` bytes) from its start; `None` when it is larger
    /// than [`Self::MAX_FILE_BYTES`].
    pub fn of_file(file: &File, len: u64) -> io::Result<Option<Self>> {
        if len > Self::MAX_FILE_BYTES {
            return Ok(None);
        }
        let mut hasher = blake3::Hasher::new();
        let mut buffer = vec![0u8; 256 << 10];
        let mut at = 0u64;
        loop {
            // Reads at offsets, so a descriptor shared with other readers
            // keeps its position.
            let read = file.read_at(&mut buffer, at)?;
            if read == 0 {
                break;
            }
            hasher.update(&buffer[..read]);
            at += read as u64;
            if at > Self::MAX_FILE_BYTES {
                // It grew past the limit while being read.
                return Ok(None);
            }
        }
        let digest = hasher.finalize();
        let mut bytes = [0u8; 16];
        bytes.copy_from_slice(&digest.as_bytes()[..16]);
        Ok(Some(Self(bytes)))
    }

    #[cfg(test)]
    pub(crate) const fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(bytes)
    }
}

impl fmt::Display for ContentDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for byte in self.0 {
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for ContentDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ContentDigest({self})")
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
    /// The file's GNU build-id, and the digest of its contents: the same
    /// for every copy of the same file, and only for those (see the module
    /// documentation).
    BuildId(BuildId, ContentDigest),
    /// The file claims a build-id but was not digested (it is larger than
    /// [`ContentDigest::MAX_FILE_BYTES`], or the [`DigestBudget`] was
    /// spent): this version of this file, as for [`Self::FileKey`], with
    /// the build-id kept for the collector.
    UnverifiedBuildId(BuildId, FileKey),
    /// The file has no build-id (or is not ELF): this version of this file.
    FileKey(FileKey),
}

impl ObjectId {
    /// The build-id the file claims, which is what the collector knows it
    /// by; `None` for a [`FileKey`] identity.
    pub fn build_id(&self) -> Option<BuildId> {
        match self {
            Self::BuildId(id, _) | Self::UnverifiedBuildId(id, _) => Some(*id),
            Self::FileKey(_) => None,
        }
    }

    /// A name for this identity that differs whenever the identity does
    /// (the build-id with the digest after it), for files kept across
    /// restarts. [`Display`](fmt::Display) shows what people look up: the
    /// build-id alone.
    pub fn unique_name(&self) -> String {
        match self {
            Self::BuildId(id, digest) => format!("{id}-{digest}"),
            Self::UnverifiedBuildId(id, key) => format!("{id}-{key}"),
            Self::FileKey(key) => key.to_string(),
        }
    }
}

impl fmt::Display for ObjectId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BuildId(id, _) | Self::UnverifiedBuildId(id, _) => id.fmt(f),
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
    /// Reading the file to digest it failed.
    #[error("reading the file to digest it")]
    Digest(#[source] io::Error),
}

/// How many bytes may be digested, refilled over time: what a process
/// that maps ever new large files (new copies, new inodes) can make the
/// agent read. Past it, files with a build-id are identified without a
/// digest ([`ObjectId::UnverifiedBuildId`]): correct, only not shared.
#[derive(Debug, Clone)]
pub struct DigestBudget {
    available: u64,
    capacity: u64,
    per_second: u64,
    refilled_at: Instant,
}

impl DigestBudget {
    /// `capacity` bytes at once (a start-up among many libraries), then
    /// `per_second` on average.
    pub fn new(capacity: u64, per_second: u64) -> Self {
        Self {
            available: capacity,
            capacity,
            per_second,
            refilled_at: Instant::now(),
        }
    }

    /// No limit: for tools and tests that identify a file or two.
    pub fn unlimited() -> Self {
        Self::new(u64::MAX, 0)
    }

    /// Takes `bytes` if they are available.
    fn take(&mut self, bytes: u64) -> bool {
        let now = Instant::now();
        let refill = now.duration_since(self.refilled_at).as_secs_f64() * self.per_second as f64;
        if refill >= 1.0 {
            self.available = self
                .available
                .saturating_add(refill as u64)
                .min(self.capacity);
            self.refilled_at = now;
        }
        let taken = bytes <= self.available;
        if taken {
            self.available -= bytes;
        }
        taken
    }
}

impl Default for DigestBudget {
    /// 256 MiB at once (a compiler's libraries: a quarter of a second of
    /// the sampling loop at start), then 64 MiB a second (under 10% of a
    /// core at the rate measured for [`ContentDigest`]).
    fn default() -> Self {
        Self::new(256 << 20, 64 << 20)
    }
}

/// Identifies an open file whose `metadata` was taken from the same file
/// descriptor (so the key and the contents belong to the same version),
/// digesting it without a limit.
pub fn identify(file: &File, metadata: &Metadata) -> Result<Identity, IdentityError> {
    identify_within(file, metadata, &mut DigestBudget::unlimited())
}

/// [`identify`], digesting only within `budget`.
pub fn identify_within(
    file: &File,
    metadata: &Metadata,
    budget: &mut DigestBudget,
) -> Result<Identity, IdentityError> {
    let file_key = FileKey::from_metadata(metadata);
    match elf::read_summary(file) {
        Ok(summary) => {
            let digest = match summary.build_id {
                Some(_)
                    if metadata.size() <= ContentDigest::MAX_FILE_BYTES
                        && budget.take(metadata.size()) =>
                {
                    ContentDigest::of_file(file, metadata.size()).map_err(IdentityError::Digest)?
                }
                _ => None,
            };
            let id = match (summary.build_id, digest) {
                (Some(build_id), Some(digest)) => ObjectId::BuildId(build_id, digest),
                (Some(build_id), None) => ObjectId::UnverifiedBuildId(build_id, file_key),
                (None, _) => ObjectId::FileKey(file_key),
            };
            Ok(Identity {
                id,
                file_key,
                load_segments: Some(summary.load_segments),
            })
        }
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
        let digest = ContentDigest::from_bytes([0xcd; 16]);
        assert_eq!(ObjectId::BuildId(id, digest).to_string(), "001fa0ff");
        assert_eq!(
            ObjectId::BuildId(id, digest).unique_name(),
            format!("001fa0ff-{}", "cd".repeat(16))
        );
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
            std::mem::size_of::<ObjectId>() <= 128,
            "{}",
            std::mem::size_of::<ObjectId>()
        );
    }

    #[test]
    fn digests_tell_contents_apart_and_skip_files_too_large() {
        let digest = |bytes: &[u8]| {
            let mut file = tempfile::tempfile().expect("temporary file");
            file.write_all(bytes).expect("writing");
            ContentDigest::of_file(&file, bytes.len() as u64).expect("reading")
        };
        let one = digest(&[1u8; 300 << 10]).expect("small enough");
        assert_eq!(digest(&[1u8; 300 << 10]), Some(one));
        let mut other = vec![1u8; 300 << 10];
        // Past the first read's buffer: the whole file counts.
        *other.last_mut().unwrap() = 2;
        assert_ne!(digest(&other), Some(one));
        // A sparse file one byte past the limit is refused unread.
        let large = tempfile::tempfile().expect("temporary file");
        large
            .set_len(ContentDigest::MAX_FILE_BYTES + 1)
            .expect("sparse file");
        assert_eq!(
            ContentDigest::of_file(&large, ContentDigest::MAX_FILE_BYTES + 1).expect("no read"),
            None
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
