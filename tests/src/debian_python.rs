//! Debian's own CPython builds from suites newer than this host's:
//! trixie's 3.13 and sid's 3.14, each a stripped `python3.X` with libpython
//! linked in, built by Debian's compiler of the day (GCC 14 and 16, which
//! split the evaluation loop). They need their suite's libc, so each runs
//! in a podman image of its suite's root filesystem, built with
//! `mmdebstrap` from the Debian registry this machine reaches, once per
//! target directory (about 20 s and 140 MB each).
//!
//! A suite that cannot be built here (no `mmdebstrap`, no registry) is
//! not a failure: the tests skip it and say why.

use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::{Mutex, PoisonError},
};

/// Where the root filesystems come from.
const REGISTRY: &str = "http://deb.debian.org/debian";

/// A Debian CPython build, its suite's root filesystem built.
pub struct DebianPython {
    /// For reports: `Debian sid python3.14`.
    pub name: String,
    pub version: (u8, u8),
    /// The interpreter's path inside the root filesystem.
    pub program: String,
    /// The root filesystem, a tarball for `podman import`.
    pub root: PathBuf,
}

/// The suites and their interpreters.
const BUILDS: &[(&str, &str, (u8, u8))] = &[
    ("trixie", "python3.13", (3, 13)),
    ("sid", "python3.14", (3, 14)),
];

/// Each build whose root filesystem is (or could now be) built; the others
/// are reported as skipped, with the reason.
pub fn debian_pythons() -> Vec<DebianPython> {
    static BUILDING: Mutex<()> = Mutex::new(());
    let _one_at_a_time = BUILDING.lock().unwrap_or_else(PoisonError::into_inner);
    let dir = crate::in_target_dir("debian-roots");
    BUILDS
        .iter()
        .filter_map(|&(suite, package, version)| {
            let name = format!("Debian {suite} {package}");
            match root_filesystem(&dir, suite, package) {
                Ok(root) => Some(DebianPython {
                    name,
                    version,
                    program: format!("/usr/bin/{package}"),
                    root,
                }),
                Err(reason) => {
                    eprintln!("python frames: {name} skipped: {reason}");
                    None
                }
            }
        })
        .collect()
}

/// The root filesystem of `suite` with `package`, built into `dir` unless
/// it is there.
fn root_filesystem(dir: &Path, suite: &str, package: &str) -> Result<PathBuf, String> {
    let root = dir.join(format!("{suite}-{package}.tar"));
    if root.exists() {
        return Ok(root);
    }
    std::fs::create_dir_all(dir).map_err(|err| format!("creating {}: {err}", dir.display()))?;
    let partial = root.with_extension("tar.partial");
    let output = Command::new("mmdebstrap")
        .args(["--variant=essential", "--format=tar", "--quiet"])
        // The registry's Release files carry the date they were taken:
        // past it, apt would refuse the suite.
        .arg("--aptopt=Acquire::Check-Valid-Until \"false\"")
        .arg(format!("--include={package}"))
        .arg(suite)
        .arg(&partial)
        .arg(REGISTRY)
        .output()
        .map_err(|err| format!("running mmdebstrap (setup installs it): {err}"))?;
    if !output.status.success() {
        let _ = std::fs::remove_file(&partial);
        return Err(format!(
            "mmdebstrap {suite} with {package} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    // Whole or absent: a build cut short is not taken for a root.
    std::fs::rename(&partial, &root)
        .map_err(|err| format!("renaming {}: {err}", partial.display()))?;
    Ok(root)
}
