//! Resolves `--cgroup` selections into the cgroup v2 ids the BPF allow-list
//! holds. A cgroup v2 id is the inode number of its directory in the cgroup2
//! filesystem, which is what `bpf_get_current_cgroup_id()` returns.
//!
//! Works on unified (v2 at `/sys/fs/cgroup`) and hybrid hosts (v2 at
//! `/sys/fs/cgroup/unified`): the cgroup2 mount is found in mountinfo. This
//! module does not follow cgroups created after start-up.

use std::{
    io,
    os::unix::fs::MetadataExt as _,
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
/// point, and the filesystem type follows the ` - ` separator.
fn cgroup2_mount_in(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        let (mount, fs) = line.split_once(" - ")?;
        (fs.split_whitespace().next()? == "cgroup2")
            .then(|| mount.split_whitespace().nth(4).map(PathBuf::from))
            .flatten()
    })
}

/// The ids of the cgroup `selection` and of all its current descendants.
/// `selection` is a directory under the cgroup2 mount, or a path relative to
/// the hierarchy's root as `/proc/<pid>/cgroup` prints it.
pub fn resolve(selection: &str) -> Result<Vec<u64>, CgroupError> {
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
    let canonical = dir.canonicalize().map_err(|source| CgroupError::Read {
        path: dir.clone(),
        source,
    })?;
    if !canonical.starts_with(&mount) {
        return Err(CgroupError::NotCgroup2(canonical, mount));
    }
    let mut ids = Vec::new();
    collect_ids(&canonical, &mut ids)?;
    Ok(ids)
}

fn collect_ids(dir: &Path, ids: &mut Vec<u64>) -> Result<(), CgroupError> {
    let read_error = |source| CgroupError::Read {
        path: dir.to_path_buf(),
        source,
    };
    ids.push(std::fs::metadata(dir).map_err(read_error)?.ino());
    for entry in std::fs::read_dir(dir).map_err(read_error)? {
        let entry = entry.map_err(read_error)?;
        // A cgroup that disappears while we walk is simply not selected.
        match entry.file_type() {
            Ok(kind) if kind.is_dir() => match collect_ids(&entry.path(), ids) {
                Err(CgroupError::Read { source, .. })
                    if source.kind() == io::ErrorKind::NotFound => {}
                other => other?,
            },
            _ => {}
        }
    }
    Ok(())
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
    fn a_missing_cgroup_is_a_clear_error() {
        let err = resolve("/stackscope-no-such-cgroup").unwrap_err();
        assert!(
            matches!(err, CgroupError::NotFound(ref s) if s == "/stackscope-no-such-cgroup"),
            "{err}"
        );
    }
}
