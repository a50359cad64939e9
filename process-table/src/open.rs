//! Reaching the file behind a mapping of another process.
//!
//! Owns: opening (or `stat`ing) the exact file a process has mapped, first
//! through `/proc/<pid>/map_files/<start>-<end>`, then through
//! `/proc/<pid>/root/<path>`, and telling "the process is gone" and "the
//! mapping is gone" apart from other failures.
//!
//! Does not own: reading the file ([`elf`](crate::elf),
//! [`object_id`](crate::object_id)) or deciding which mappings to open
//! ([`table`](crate::table)).
//!
//! `map_files` is a magic link to the mapped file itself: it works for files
//! deleted or replaced since they were mapped, for memfds, and for binaries
//! inside containers whose paths mean nothing in our mount namespace. It
//! needs `CAP_SYS_ADMIN` (or `CAP_CHECKPOINT_RESTORE`) and ptrace access to
//! the process, which the agent has as root. The path fallback serves
//! unprivileged use; since a path can lead to a different file than the one
//! mapped, the fallback checks the device and inode against the maps line
//! and refuses a mismatch (this also refuses files on overlayfs, where the
//! mapped inode is the underlying one: a missing object is better than the
//! wrong one).
//!
//! A mapping learned from an mmap event outlives its process: its file is
//! then reached by its path under the roots of a list of processes in turn
//! (its own, its parent's, the agent's, init's). [`open_learned`] keeps the
//! first that is the file mapped: of the build-id the kernel read when it
//! reported one (the event then carries no device and inode), else of the
//! device and inode. [`stat_learned`] gives their metadata, for a cache of
//! file versions.

use std::{
    fs::{File, Metadata},
    io,
    os::unix::{ffi::OsStrExt as _, fs::MetadataExt as _},
    path::{Path, PathBuf},
};

use thiserror::Error;

use crate::{
    maps::{self, Dev, Mapping, MappingPath},
    object_id::BuildId,
};

/// An open mapped file.
#[derive(Debug)]
pub struct OpenedFile {
    pub file: File,
    /// `fstat` of `file`: describes exactly the version that was opened.
    pub metadata: Metadata,
    /// The path that worked (a `map_files` link or a path under `root`).
    pub path: PathBuf,
}

/// Why the file behind a mapping could not be reached.
#[derive(Debug, Error)]
pub enum OpenError {
    /// The process exited.
    #[error("process {pid} is gone")]
    ProcessGone { pid: u32 },
    /// The process is alive but no longer has this mapping (unmapped, or the
    /// process called `exec`) since its maps were read.
    #[error("mapping {start:#x}-{end:#x} of process {pid} is gone")]
    MappingGone { pid: u32, start: u64, end: u64 },
    /// Opening through `map_files` failed and the mapping has no path worth
    /// trying (deleted, memfd), or the failure was not about privileges.
    #[error("opening {}", path.display())]
    MapFiles {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// `map_files` was not usable and opening by path failed too.
    #[error("opening {} (after map_files failed)", path.display())]
    Path {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The mapping has no path to follow (a deleted file, a memfd).
    #[error("the mapping has no path to open")]
    NoPath,
    /// The path leads to another file than the one mapped (replaced on
    /// disk, or on a filesystem such as overlayfs that reports another inode).
    #[error(
        "{} is {found_dev} inode {found_inode}, but the mapping is {expected_dev} inode {expected_inode}",
        path.display()
    )]
    Replaced {
        path: PathBuf,
        expected_dev: Dev,
        expected_inode: u64,
        found_dev: Dev,
        found_inode: u64,
    },
}

/// `/proc/<pid>/map_files/<start>-<end>`, in the kernel's spelling
/// (lower-case hex, no padding).
pub fn map_files_path(proc_root: &Path, pid: u32, start: u64, end: u64) -> PathBuf {
    proc_root
        .join(pid.to_string())
        .join("map_files")
        .join(format!("{start:x}-{end:x}"))
}

/// Opens the file `mapping` (a line of `pid`'s maps) refers to.
pub fn open_mapped(proc_root: &Path, pid: u32, mapping: &Mapping) -> Result<OpenedFile, OpenError> {
    let (file, metadata, path) = reach(proc_root, pid, mapping, |path| {
        let file = File::open(path)?;
        let metadata = file.metadata()?;
        Ok((file, metadata))
    })?;
    Ok(OpenedFile {
        file,
        metadata,
        path,
    })
}

/// `stat`s the file `mapping` refers to without opening it: enough to look
/// an identity up in a cache keyed by [`FileKey`](crate::object_id::FileKey).
pub fn stat_mapped(
    proc_root: &Path,
    pid: u32,
    mapping: &Mapping,
) -> Result<(Metadata, PathBuf), OpenError> {
    let ((), metadata, path) = reach(proc_root, pid, mapping, |path| {
        Ok(((), std::fs::metadata(path)?))
    })?;
    Ok((metadata, path))
}

/// Runs `access` on the `map_files` link, then on the path under the
/// process's root, and returns the first success with the path used.
fn reach<T>(
    proc_root: &Path,
    pid: u32,
    mapping: &Mapping,
    access: impl Fn(&Path) -> io::Result<(T, Metadata)>,
) -> Result<(T, Metadata, PathBuf), OpenError> {
    let map_files = map_files_path(proc_root, pid, mapping.start, mapping.end);
    let map_files_err = match access(&map_files) {
        Ok((value, metadata)) => return Ok((value, metadata, map_files)),
        Err(err) => err,
    };
    let process_dir = proc_root.join(pid.to_string());
    if maps::is_gone(&map_files_err) {
        if !process_dir.exists() {
            return Err(OpenError::ProcessGone { pid });
        }
        // Without CONFIG_CHECKPOINT_RESTORE there is no map_files directory at
        // all; with it, a missing entry means the mapping itself is gone.
        if process_dir.join("map_files").exists() {
            return Err(OpenError::MappingGone {
                pid,
                start: mapping.start,
                end: mapping.end,
            });
        }
    } else if !is_denied(&map_files_err) {
        return Err(OpenError::MapFiles {
            path: map_files,
            source: map_files_err,
        });
    }
    // The name of a deleted file now leads elsewhere or nowhere; memfds and
    // special areas have no name to follow.
    let name = match &mapping.path {
        MappingPath::File {
            path,
            deleted: false,
        } => path,
        _ => {
            return Err(OpenError::MapFiles {
                path: map_files,
                source: map_files_err,
            });
        }
    };
    tracing::debug!(
        pid,
        error = %map_files_err,
        path = %name.display(),
        "map_files not usable, opening by path"
    );
    let path = under_root_of(proc_root, pid, name);
    let (value, metadata) = access(&path).map_err(|source| {
        if maps::is_gone(&source) && !process_dir.exists() {
            OpenError::ProcessGone { pid }
        } else {
            OpenError::Path {
                path: path.clone(),
                source,
            }
        }
    })?;
    if !is_mapped_file(&metadata, mapping) {
        return Err(OpenError::Replaced {
            path,
            expected_dev: mapping.dev,
            expected_inode: mapping.inode,
            found_dev: Dev::from_st_dev(metadata.dev()),
            found_inode: metadata.ino(),
        });
    }
    Ok((value, metadata, path))
}

/// The `stat` of the file a learned mapping names under the root of each
/// process in `roots`, in turn, where there is one (as [`open_learned`]
/// reaches it): a file version identified before is known again without
/// being opened and read, and a shell's every command maps the same few
/// binaries. Which of them is the file mapped is the caller's to decide,
/// as [`open_learned`] decides it.
pub fn stat_learned<'a>(
    proc_root: &'a Path,
    roots: &'a [u32],
    mapping: &'a Mapping,
) -> impl Iterator<Item = Metadata> + 'a {
    let name = match &mapping.path {
        MappingPath::File {
            path,
            deleted: false,
        } => Some(path),
        _ => None,
    };
    // No path (deleted, memfd, anonymous): nothing to look for.
    name.into_iter().flat_map(move |name| {
        roots
            .iter()
            .filter_map(move |&pid| std::fs::metadata(under_root_of(proc_root, pid, name)).ok())
    })
}

/// Whether `metadata` is of the file `mapping` names by device and inode.
pub fn is_mapped_file(metadata: &Metadata, mapping: &Mapping) -> bool {
    Dev::from_st_dev(metadata.dev()) == mapping.dev && metadata.ino() == mapping.inode
}

/// Path `name` (as process `pid` sees it) under that process's root.
fn under_root_of(proc_root: &Path, pid: u32, name: &Path) -> PathBuf {
    proc_root
        .join(pid.to_string())
        .join("root")
        .join(under_root(name))
}

/// `name` (a path the process sees) relative to its root: `join` with an
/// absolute path would replace the root.
fn under_root(name: &Path) -> &Path {
    Path::new(std::ffi::OsStr::from_bytes(
        name.as_os_str()
            .as_bytes()
            .strip_prefix(b"/")
            .unwrap_or(name.as_os_str().as_bytes()),
    ))
}

fn is_denied(err: &io::Error) -> bool {
    matches!(err.raw_os_error(), Some(libc::EPERM | libc::EACCES))
}

/// Opens the file a process mapped once the process may be gone: the same
/// path under the root of each process in `roots` in turn (the process
/// itself while it lives, its parent, which shares its mount namespace
/// unless it made a new one, the host's init), keeping the first file that
/// is the one mapped: the same build-id when the kernel reported one, else
/// the same device and inode.
pub fn open_learned(
    proc_root: &Path,
    roots: &[u32],
    mapping: &Mapping,
    build_id: Option<BuildId>,
) -> Result<OpenedFile, OpenError> {
    let MappingPath::File {
        path: name,
        deleted: false,
    } = &mapping.path
    else {
        return Err(OpenError::NoPath);
    };
    let mut last = OpenError::NoPath;
    for &pid in roots {
        let path = under_root_of(proc_root, pid, name);
        let opened = File::open(&path).and_then(|file| {
            let metadata = file.metadata()?;
            Ok((file, metadata))
        });
        let (file, metadata) = match opened {
            Ok(opened) => opened,
            Err(source) => {
                last = OpenError::Path { path, source };
                continue;
            }
        };
        let same = match build_id {
            Some(expected) => {
                crate::elf::read_summary(&file)
                    .ok()
                    .and_then(|summary| summary.build_id)
                    == Some(expected)
            }
            None => is_mapped_file(&metadata, mapping),
        };
        if same {
            return Ok(OpenedFile {
                file,
                metadata,
                path,
            });
        }
        last = OpenError::Replaced {
            path,
            expected_dev: mapping.dev,
            expected_inode: mapping.inode,
            found_dev: Dev::from_st_dev(metadata.dev()),
            found_inode: metadata.ino(),
        };
    }
    Err(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_files_spelling() {
        assert_eq!(
            map_files_path(Path::new("/proc"), 42, 0x55d0c8a00000, 0x55d0c8a01000),
            PathBuf::from("/proc/42/map_files/55d0c8a00000-55d0c8a01000")
        );
    }

    fn own_exec_mapping() -> Mapping {
        let exe = std::fs::read_link("/proc/self/exe").expect("our executable");
        maps::read_maps(std::process::id())
            .expect("our maps")
            .into_iter()
            .find(|m| m.perms.exec && m.path.file_path() == Some(exe.as_path()))
            .expect("our executable's code mapping")
    }

    #[test]
    fn opens_own_executable() {
        let mapping = own_exec_mapping();
        let opened =
            open_mapped(Path::new("/proc"), std::process::id(), &mapping).expect("opening");
        assert_eq!(opened.metadata.ino(), mapping.inode);
        assert_eq!(Dev::from_st_dev(opened.metadata.dev()), mapping.dev);
    }

    #[test]
    fn unmapped_range_is_mapping_gone() {
        let mut mapping = own_exec_mapping();
        // A range that is certainly not a mapping of ours: page 1.
        mapping.start = 0x1000;
        mapping.end = 0x2000;
        let pid = std::process::id();
        match stat_mapped(Path::new("/proc"), pid, &mapping) {
            // As root, map_files answers ENOENT for the missing range.
            Err(OpenError::MappingGone { start: 0x1000, .. }) => {}
            // Unprivileged, map_files is denied and the path fallback finds
            // the (still existing) executable, whose inode matches.
            Ok(_) if !is_root() => {}
            other => panic!("unexpected result {other:?}"),
        }
    }

    #[test]
    fn missing_process_is_gone() {
        let mapping = own_exec_mapping();
        let err = stat_mapped(Path::new("/proc"), u32::MAX, &mapping).expect_err("no process");
        assert!(
            matches!(err, OpenError::ProcessGone { pid: u32::MAX }),
            "{err:?}"
        );
    }

    #[test]
    fn fallback_refuses_another_inode() {
        let mut mapping = own_exec_mapping();
        mapping.inode = mapping.inode.wrapping_add(1);
        // Force the fallback: a proc root whose map_files entry is missing
        // but whose pid directory has no map_files directory at all.
        let root = tempfile::tempdir().expect("temporary directory");
        let pid_dir = root.path().join("7");
        std::fs::create_dir_all(pid_dir.join("root")).expect("fake pid dir");
        let exe = mapping.path.file_path().expect("a path").to_path_buf();
        let target = pid_dir
            .join("root")
            .join(exe.strip_prefix("/").expect("absolute"));
        std::fs::create_dir_all(target.parent().expect("parent")).expect("dirs");
        std::os::unix::fs::symlink(&exe, &target).expect("symlink to our exe");
        let err = stat_mapped(root.path(), 7, &mapping).expect_err("wrong inode");
        assert!(matches!(err, OpenError::Replaced { .. }), "{err:?}");
        mapping.inode = mapping.inode.wrapping_sub(1);
        let (metadata, path) = stat_mapped(root.path(), 7, &mapping).expect("right inode");
        assert_eq!(metadata.ino(), mapping.inode);
        assert_eq!(path, target);
    }

    fn is_root() -> bool {
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() == 0 }
    }
}
