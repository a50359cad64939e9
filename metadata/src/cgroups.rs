//! The cgroup2 hierarchy as the BPF program sees it: finds its mount,
//! resolves a `--cgroup` selection to its cgroup v2 id, and walks the tree
//! for the container selection ([`crate::selection`]). A cgroup
//! v2 id is the inode number of its directory in the cgroup2 filesystem,
//! which is what `bpf_get_current_cgroup_id()` returns.
//!
//! Works on unified (v2 at `/sys/fs/cgroup`) and hybrid hosts (v2 at
//! `/sys/fs/cgroup/unified`): the cgroup2 mount is found in mountinfo.
//! Descendants need no enumeration here: the program checks a task's
//! cgroup and all its ancestors, so cgroups created later are covered.

use std::{
    fs::File,
    io,
    os::{
        fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
        unix::fs::MetadataExt as _,
    },
    path::{Path, PathBuf},
};

/// Why a `--cgroup` selection could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("reading {path} failed")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("no cgroup2 filesystem is mounted (see /proc/self/mountinfo)")]
    NoCgroup2Mount,
    #[error(
        "cgroup {0} does not exist; give a directory of the cgroup2 hierarchy \
         (e.g. /sys/fs/cgroup/system.slice/foo.service) or a path inside it \
         as /proc/<pid>/cgroup shows it (e.g. /system.slice/foo.service)"
    )]
    NotFound(String),
    #[error("{0} is not a directory of the cgroup2 hierarchy mounted at {1}")]
    NotCgroup2(PathBuf, PathBuf),
}

/// The cgroup2 mount point, from the mount table of this process.
pub fn cgroup2_mount() -> Result<PathBuf, CgroupError> {
    let path = Path::new("/proc/self/mountinfo");
    let mountinfo = std::fs::read_to_string(path).map_err(|source| CgroupError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    cgroup2_mount_in(&mountinfo).ok_or(CgroupError::NoCgroup2Mount)
}

/// Finds the cgroup2 mount point in mountinfo text: field 5 is the mount
/// point, and the filesystem type follows the ` - ` separator. (Public for
/// the fuzz target.)
pub fn cgroup2_mount_in(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        let (mount, fs) = line.split_once(" - ")?;
        (fs.split_whitespace().next()? == "cgroup2")
            .then(|| mount.split_whitespace().nth(4).map(unescape_mount_field))
            .flatten()
            .map(PathBuf::from)
    })
}

/// A mountinfo field as the path it names: the kernel writes a space, a
/// tab, a newline and a backslash in a path as `\040`, `\011`, `\012` and
/// `\134` (anything else stays as written). (Public for the fuzz target.)
pub fn unescape_mount_field(field: &str) -> String {
    let mut path = String::with_capacity(field.len());
    let mut rest = field;
    while let Some(at) = rest.find('\\') {
        path.push_str(&rest[..at]);
        let escaped = match rest.get(at + 1..at + 4) {
            Some("040") => Some(' '),
            Some("011") => Some('\t'),
            Some("012") => Some('\n'),
            Some("134") => Some('\\'),
            _ => None,
        };
        match escaped {
            Some(c) => {
                path.push(c);
                rest = &rest[at + 4..];
            }
            None => {
                path.push('\\');
                rest = &rest[at + 1..];
            }
        }
    }
    path.push_str(rest);
    path
}

/// The id of the cgroup `selection`: a directory under the cgroup2 mount,
/// or a path relative to the hierarchy's root as `/proc/<pid>/cgroup`
/// prints it.
pub fn resolve(selection: &str) -> Result<u64, CgroupError> {
    let mount = cgroup2_mount()?;
    let given = Path::new(selection);
    let dir = if given.starts_with(&mount) {
        given.to_path_buf()
    } else {
        mount.join(selection.trim_start_matches('/'))
    };
    if !dir.is_dir() {
        return Err(CgroupError::NotFound(selection.to_string()));
    }
    let read_error = |source| CgroupError::Read {
        path: dir.clone(),
        source,
    };
    let canonical = dir.canonicalize().map_err(read_error)?;
    if !canonical.starts_with(&mount) {
        return Err(CgroupError::NotCgroup2(canonical, mount));
    }
    Ok(std::fs::metadata(&canonical).map_err(read_error)?.ino())
}

/// The path (relative to the hierarchy's root, as `/proc/<pid>/cgroup`
/// prints it) of the cgroup whose id is `id`, for a process gone before
/// its cgroup file was read: the cgroup usually outlives it (its container
/// runs on). A cgroup2 id is also the directory's file handle in the
/// cgroup2 filesystem (kernfs), so the directory is opened by handle, in
/// constant time whatever the size of the tree. Needs
/// `CAP_DAC_READ_SEARCH`, which the agent has.
pub fn path_of_id(mount: &Path, id: u64) -> io::Result<String> {
    /// `struct file_handle` with kernfs's 8-byte handle: the id.
    #[repr(C)]
    struct KernfsHandle {
        handle_bytes: u32,
        handle_type: i32,
        id: [u8; 8],
    }
    /// `FILEID_KERNFS` in include/linux/exportfs.h.
    const FILEID_KERNFS: i32 = 0xfe;
    let root = File::open(mount)?;
    let mut handle = KernfsHandle {
        handle_bytes: 8,
        handle_type: FILEID_KERNFS,
        id: id.to_ne_bytes(),
    };
    // SAFETY: `handle` is a valid `struct file_handle` of `handle_bytes`
    // bytes of handle, alive for the call; `root` is an open descriptor.
    let fd = unsafe {
        libc::open_by_handle_at(
            root.as_raw_fd(),
            (&raw mut handle).cast(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and is owned by nothing else.
    let dir = unsafe { OwnedFd::from_raw_fd(fd) };
    let path = std::fs::read_link(format!("/proc/self/fd/{}", dir.as_raw_fd()))?;
    let relative = path.strip_prefix(mount).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "cgroup {id} is at {}, outside {}",
                path.display(),
                mount.display()
            ),
        )
    })?;
    Ok(format!("/{}", relative.display()))
}

/// Calls `visit` with the path (relative to the hierarchy's root, as
/// `/proc/<pid>/cgroup` prints it) and id of each cgroup under `mount`,
/// parents before children, `max` cgroups at most. Cgroups that disappear
/// during the walk are skipped; an unreadable root is an error.
pub fn walk(
    mount: &Path,
    max: usize,
    mut visit: impl FnMut(&str, u64),
) -> Result<usize, CgroupError> {
    let root = std::fs::metadata(mount).map_err(|source| CgroupError::Read {
        path: mount.to_path_buf(),
        source,
    })?;
    visit("/", root.ino());
    let mut visited = 1;
    let mut pending = vec![(mount.to_path_buf(), String::new())];
    while let Some((dir, relative)) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            if visited >= max {
                return Ok(visited);
            }
            let Ok(metadata) = entry.metadata() else {
                continue;
            };
            if !metadata.is_dir() {
                continue;
            }
            let path = format!("{relative}/{}", entry.file_name().to_string_lossy());
            visit(&path, metadata.ino());
            visited += 1;
            pending.push((entry.path(), path));
        }
    }
    Ok(visited)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_cgroup2_mount_on_hybrid_and_unified_hosts() {
        let hybrid = "\
25 30 0:22 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
26 25 0:23 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw,nsdelegate
27 25 0:24 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:11 - cgroup cgroup rw,cpu,cpuacct";
        assert_eq!(
            cgroup2_mount_in(hybrid),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        let unified = "35 24 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:5 - cgroup2 cgroup2 rw";
        assert_eq!(
            cgroup2_mount_in(unified),
            Some(PathBuf::from("/sys/fs/cgroup"))
        );
        let v1_only = "27 25 0:24 / /sys/fs/cgroup/cpu rw shared:11 - cgroup cgroup rw,cpu";
        assert_eq!(cgroup2_mount_in(v1_only), None);
    }

    #[test]
    fn a_mount_point_with_spaces_is_unescaped() {
        let spaced = "35 24 0:30 / /run/my\\040cgroups\\134v2 rw shared:5 - cgroup2 cgroup2 rw";
        assert_eq!(
            cgroup2_mount_in(spaced),
            Some(PathBuf::from("/run/my cgroups\\v2"))
        );
        // An escaped backslash followed by digits is a backslash, then the
        // digits; a backslash starting no escape stays.
        assert_eq!(unescape_mount_field("a\\134040b"), "a\\040b");
        assert_eq!(unescape_mount_field("a\\b\\04"), "a\\b\\04");
        assert_eq!(unescape_mount_field("tab\\011nl\\012"), "tab\tnl\n");
    }

    #[test]
    fn walks_a_tree_parents_first_with_ids_and_relative_paths() {
        let root = tempfile::tempdir().expect("temporary directory");
        std::fs::create_dir_all(root.path().join("a/b/c")).expect("directories");
        std::fs::create_dir_all(root.path().join("d")).expect("directories");
        std::fs::write(root.path().join("a/cgroup.procs"), "").expect("a file");
        let mut seen = Vec::new();
        let count = walk(root.path(), 100, |path, id| {
            seen.push((path.to_string(), id))
        })
        .expect("walking");
        assert_eq!(count, 5);
        let paths: Vec<&str> = seen.iter().map(|(path, _)| path.as_str()).collect();
        assert_eq!(paths[0], "/");
        for expected in ["/a", "/a/b", "/a/b/c", "/d"] {
            assert!(paths.contains(&expected), "{expected} not in {paths:?}");
        }
        let position = |p: &str| paths.iter().position(|x| *x == p).unwrap();
        assert!(position("/a") < position("/a/b") && position("/a/b") < position("/a/b/c"));
        let ino = std::fs::metadata(root.path().join("a/b")).unwrap().ino();
        assert!(seen.contains(&("/a/b".to_string(), ino)));
        // The bound holds.
        assert_eq!(walk(root.path(), 2, |_, _| {}).expect("walking"), 2);
    }

    #[test]
    #[ignore = "needs root (creates a cgroup, opens it by handle): run by `cargo xtask test`"]
    fn a_cgroup_is_found_by_its_id() {
        stackscope_test_fixtures::require_root("creating a cgroup and opening it by handle");
        let mount = cgroup2_mount().expect("a cgroup2 mount");
        let name = format!("stackscope-test-{}", std::process::id());
        let dir = mount.join(&name).join("inner");
        std::fs::create_dir_all(&dir).expect("creating a cgroup");
        let id = std::fs::metadata(&dir).expect("the cgroup").ino();
        let found = path_of_id(&mount, id);
        let root = path_of_id(&mount, std::fs::metadata(&mount).expect("root").ino());
        std::fs::remove_dir(&dir).expect("removing the cgroup");
        std::fs::remove_dir(mount.join(&name)).expect("removing the cgroup");
        assert_eq!(found.expect("found by id"), format!("/{name}/inner"));
        assert_eq!(root.expect("the root"), "/");
        // Gone: a clear error, not another cgroup.
        assert!(path_of_id(&mount, id).is_err());
    }

    #[test]
    fn a_missing_cgroup_is_a_clear_error() {
        let err = resolve("/stackscope-no-such-cgroup").unwrap_err();
        assert!(
            matches!(err, CgroupError::NotFound(ref s) if s == "/stackscope-no-such-cgroup"),
            "{err}"
        );
    }
}
