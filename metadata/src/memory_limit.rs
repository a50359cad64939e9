//! The agent's memory limit ([`resolve_limit`]): `--memory-limit` (a size
//! as people write it, [`parse_size`]), else a share of the memory limit
//! of the cgroup it runs in, else a default. The cgroup's limit is
//! cgroup2's `memory.max` (the least of a cgroup's and its ancestors'),
//! else cgroup v1's `hierarchical_memory_limit`; the memory controller
//! found in mountinfo, the cgroup's directory below the root its mount
//! shows (a container without a cgroup namespace sees its own cgroup
//! mounted).

use std::{
    fmt,
    path::{Path, PathBuf},
};

use crate::cgroups::unescape_mount_field;

/// The limit when neither the flag nor a cgroup sets one: it fits the
/// DaemonSet's 256 MiB with room for the kernel's share.
pub const DEFAULT_LIMIT: u64 = 192 << 20;

/// Of a cgroup's memory limit, the share the agent takes as its own (the
/// rest is for page cache the cgroup is charged with, and headroom).
const CGROUP_SHARE: (u64, u64) = (3, 4);

/// Where the limit came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LimitSource {
    Flag,
    /// A share of this cgroup's limit (its path, and the limit).
    Cgroup {
        path: String,
        limit: u64,
    },
    Default,
}

impl fmt::Display for LimitSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LimitSource::Flag => f.write_str("--memory-limit"),
            LimitSource::Cgroup { path, limit } => write!(
                f,
                "{}/{} of the limit of cgroup {path} ({:.1} MiB)",
                CGROUP_SHARE.0,
                CGROUP_SHARE.1,
                *limit as f64 / f64::from(1 << 20)
            ),
            LimitSource::Default => f.write_str("the default"),
        }
    }
}

/// The limit: `flag` when given, else a share of the agent's cgroup's
/// memory limit when one is set, else [`DEFAULT_LIMIT`].
pub fn resolve_limit(flag: Option<u64>) -> (u64, LimitSource) {
    if let Some(limit) = flag {
        return (limit, LimitSource::Flag);
    }
    match cgroup_memory_limit(
        Path::new("/proc/self/cgroup"),
        Path::new("/proc/self/mountinfo"),
    ) {
        Some((path, limit)) => (
            limit / CGROUP_SHARE.1 * CGROUP_SHARE.0,
            LimitSource::Cgroup { path, limit },
        ),
        None => (DEFAULT_LIMIT, LimitSource::Default),
    }
}

/// A size as people write it: `96MiB`, `96Mi`, `96M` (binary units, as
/// Kubernetes' `Mi`), `1G`, or bytes.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let digits = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(digits);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size such as 96MiB or 1GiB"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "ki" | "kib" | "kb" => 10,
        "m" | "mi" | "mib" | "mb" => 20,
        "g" | "gi" | "gib" | "gb" => 30,
        _ => return Err(format!("unknown unit in {text:?}: use KiB, MiB or GiB")),
    };
    number
        .checked_mul(1 << shift)
        .ok_or_else(|| format!("{text:?} is too large"))
}

/// Limits at or above this are no limit (cgroup v1 writes "unlimited" as
/// the largest page-aligned `i64`).
const UNLIMITED: u64 = 1 << 62;

/// The memory limit of the cgroup a process runs in (as `cgroup_file`, its
/// `/proc/<pid>/cgroup`, names it; `mountinfo_file` is its mountinfo), and
/// the cgroup's path: cgroup2's `memory.max` (the least of its and its
/// ancestors'), or else cgroup v1's `hierarchical_memory_limit`; `None`
/// when no limit is set or none can be read.
pub fn cgroup_memory_limit(cgroup_file: &Path, mountinfo_file: &Path) -> Option<(String, u64)> {
    let cgroups = std::fs::read_to_string(cgroup_file).ok()?;
    let mountinfo = std::fs::read_to_string(mountinfo_file).ok()?;
    let mounts = memory_mounts(&mountinfo);
    let v2 = cgroups.lines().find_map(|line| line.strip_prefix("0::"));
    if let (Some(path), Some(mount)) = (v2, &mounts.v2) {
        // Walk up to the mount: a parent's limit binds its children too.
        let mut dir = mount.dir_of(path);
        let mut least: Option<u64> = None;
        while dir.starts_with(&mount.point) {
            if let Some(limit) = std::fs::read_to_string(dir.join("memory.max"))
                .ok()
                .and_then(|text| text.trim().parse::<u64>().ok())
            {
                least = Some(least.map_or(limit, |least| least.min(limit)));
            }
            if !dir.pop() {
                break;
            }
        }
        if let Some(limit) = least.filter(|&limit| limit < UNLIMITED) {
            return Some((path.to_owned(), limit));
        }
    }
    let v1 = cgroups.lines().find_map(|line| {
        let mut fields = line.splitn(3, ':');
        let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
        controllers
            .split(',')
            .any(|c| c == "memory")
            .then_some(path)
    })?;
    let stat = std::fs::read_to_string(mounts.v1.as_ref()?.dir_of(v1).join("memory.stat")).ok()?;
    let limit = stat.lines().find_map(|line| {
        line.strip_prefix("hierarchical_memory_limit ")?
            .trim()
            .parse::<u64>()
            .ok()
    })?;
    (limit < UNLIMITED).then(|| (v1.to_owned(), limit))
}

/// A mount of a cgroup hierarchy: which of its directories (`root`) is
/// mounted where (`point`).
#[derive(Debug, PartialEq, Eq)]
struct CgroupMount {
    root: String,
    point: PathBuf,
}

impl CgroupMount {
    /// The directory of cgroup `path` (as `/proc/self/cgroup` names it).
    /// In a container without a cgroup namespace the path is the host's
    /// (`/kubepods/.../<id>`) while the mount's root is that cgroup
    /// already.
    fn dir_of(&self, path: &str) -> PathBuf {
        let below = path
            .strip_prefix(self.root.as_str())
            .filter(|rest| rest.is_empty() || rest.starts_with('/') || self.root == "/")
            .unwrap_or(path);
        self.point.join(below.trim_start_matches('/'))
    }
}

/// Where the memory controller is mounted.
#[derive(Debug, Default, PartialEq, Eq)]
struct MemoryMounts {
    /// The cgroup2 hierarchy, if its memory controller is enabled.
    v2: Option<CgroupMount>,
    /// cgroup v1's memory hierarchy.
    v1: Option<CgroupMount>,
}

fn memory_mounts(mountinfo: &str) -> MemoryMounts {
    let mut mounts = MemoryMounts::default();
    for line in mountinfo.lines() {
        let Some((before, after)) = line.split_once(" - ") else {
            continue;
        };
        let mut fields = before.split_whitespace().skip(3);
        let (Some(root), Some(point)) = (fields.next(), fields.next()) else {
            continue;
        };
        let mount = CgroupMount {
            root: unescape_mount_field(root),
            point: PathBuf::from(unescape_mount_field(point)),
        };
        let mut after = after.split_whitespace();
        match (after.next(), after.nth(1)) {
            (Some("cgroup2"), _) => {
                let enabled = std::fs::read_to_string(mount.point.join("cgroup.controllers"))
                    .is_ok_and(|controllers| controllers.split_whitespace().any(|c| c == "memory"));
                if enabled {
                    mounts.v2 = Some(mount);
                }
            }
            (Some("cgroup"), Some(options)) if options.split(',').any(|o| o == "memory") => {
                mounts.v1 = Some(mount);
            }
            _ => {}
        }
    }
    mounts
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn sizes_are_read_as_people_write_them() {
        assert_eq!(parse_size("96MiB"), Ok(96 * MIB));
        assert_eq!(parse_size("96Mi"), Ok(96 * MIB));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("96 parsecs").is_err());
        assert!(parse_size("MiB").is_err());
        assert!(parse_size("99999999999999GiB").is_err());
    }

    #[test]
    fn the_memory_controller_is_found_in_v1_mounts() {
        let mountinfo = "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n\
                         36 31 0:33 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n";
        assert_eq!(
            memory_mounts(mountinfo),
            MemoryMounts {
                v2: None,
                v1: Some(CgroupMount {
                    root: "/".into(),
                    point: "/sys/fs/cgroup/memory".into()
                })
            }
        );
    }

    #[test]
    fn a_containers_cgroup_is_found_below_the_root_its_mount_shows() {
        // Without a cgroup namespace: the host's path, and the container's
        // own cgroup mounted.
        let mount = CgroupMount {
            root: "/kubepods/pod1/abc".into(),
            point: "/sys/fs/cgroup/memory".into(),
        };
        assert_eq!(
            mount.dir_of("/kubepods/pod1/abc"),
            PathBuf::from("/sys/fs/cgroup/memory")
        );
        assert_eq!(
            mount.dir_of("/kubepods/pod1/abcdef"),
            PathBuf::from("/sys/fs/cgroup/memory/kubepods/pod1/abcdef"),
            "a prefix of a name is not a parent"
        );
        let host = CgroupMount {
            root: "/".into(),
            point: "/sys/fs/cgroup".into(),
        };
        assert_eq!(host.dir_of("/a/b"), PathBuf::from("/sys/fs/cgroup/a/b"));
        assert_eq!(host.dir_of("/"), PathBuf::from("/sys/fs/cgroup"));
    }

    #[test]
    fn a_cgroups_limit_is_read_and_unlimited_is_none() {
        let dir = tempfile::tempdir().unwrap();
        let memory = dir.path().join("memory");
        let group = memory.join("pods/agent");
        std::fs::create_dir_all(&group).unwrap();
        let mountinfo = dir.path().join("mountinfo");
        std::fs::write(
            &mountinfo,
            format!(
                "35 31 0:32 / {} rw,relatime - cgroup cgroup rw,memory\n",
                memory.display()
            ),
        )
        .unwrap();
        let cgroup = dir.path().join("cgroup");
        std::fs::write(&cgroup, "4:memory:/pods/agent\n0::/\n").unwrap();
        std::fs::write(
            group.join("memory.stat"),
            "cache 0\nhierarchical_memory_limit 268435456\n",
        )
        .unwrap();
        assert_eq!(
            cgroup_memory_limit(&cgroup, &mountinfo),
            Some(("/pods/agent".into(), 256 * MIB))
        );
        std::fs::write(
            group.join("memory.stat"),
            "hierarchical_memory_limit 9223372036854771712\n",
        )
        .unwrap();
        assert_eq!(cgroup_memory_limit(&cgroup, &mountinfo), None);
    }
}
