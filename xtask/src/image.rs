//! `cargo xtask image`: the agent's and the collector's container images,
//! built locally with podman from a root filesystem assembled here: the
//! release binaries, exactly the shared libraries they link (as `ldd`
//! resolves them on this Debian), the CA bundle, and passwd/group entries
//! for the collector's unprivileged user. No base image, no registry.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};
use stackscope_test_fixtures::containers::podman;

use crate::run_checked;

/// Tags the manifests in `deploy/` refer to.
pub const AGENT_IMAGE: &str = concat!("localhost/stackscope-agent:", env!("CARGO_PKG_VERSION"));
pub const COLLECTOR_IMAGE: &str =
    concat!("localhost/stackscope-collector:", env!("CARGO_PKG_VERSION"));

/// The collector's user and group (the "nonroot" id distroless images use).
pub const COLLECTOR_UID: u32 = 65532;

/// Where the collector keeps its database inside the image (a volume).
const COLLECTOR_DATA: &str = "var/lib/stackscope";

/// The CA bundle of Debian's `ca-certificates`, for TLS to a collector or a
/// kubelet whose CA is public.
const CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

struct ImageSpec {
    tag: &'static str,
    binaries: &'static [&'static str],
    /// `podman import --change` instructions.
    changes: Vec<String>,
    /// Runs as this uid/gid, owning the data directory; `None`: root.
    user: Option<u32>,
}

/// Builds both images and prints their sizes.
pub fn build() -> anyhow::Result<()> {
    crate::require_root("podman imports images into the system's storage")?;
    let release = crate::build_binaries(true)?;
    let specs = [
        ImageSpec {
            tag: AGENT_IMAGE,
            binaries: &["stackscope-agent"],
            changes: vec![
                r#"ENTRYPOINT ["/usr/bin/stackscope-agent"]"#.into(),
                // The run loop flushes its last interval on SIGTERM.
                "STOPSIGNAL SIGTERM".into(),
            ],
            user: None,
        },
        ImageSpec {
            tag: COLLECTOR_IMAGE,
            binaries: &["stackscope-collector", "stackscope"],
            changes: vec![
                r#"ENTRYPOINT ["/usr/bin/stackscope-collector"]"#.into(),
                format!(
                    r#"CMD ["--data-dir", "/{COLLECTOR_DATA}", "--grpc-listen", "0.0.0.0:7070", "--http-listen", "0.0.0.0:7071"]"#
                ),
                format!("USER {COLLECTOR_UID}:{COLLECTOR_UID}"),
                "EXPOSE 7070".into(),
                "EXPOSE 7071".into(),
                format!("VOLUME /{COLLECTOR_DATA}"),
                "STOPSIGNAL SIGTERM".into(),
            ],
            user: Some(COLLECTOR_UID),
        },
    ];
    for spec in &specs {
        let size = build_one(spec, &release)?;
        eprintln!(
            "image {}: {:.1} MB ({})",
            spec.tag,
            size as f64 / 1e6,
            spec.binaries.join(", ")
        );
    }
    Ok(())
}

fn build_one(spec: &ImageSpec, release: &Path) -> anyhow::Result<u64> {
    let work = tempfile::tempdir().context("creating a temporary directory")?;
    let rootfs = work.path().join("rootfs");
    for dir in ["usr/bin", "etc", "tmp", "proc", "sys", "dev"] {
        std::fs::create_dir_all(rootfs.join(dir))?;
    }
    set_mode(&rootfs.join("tmp"), 0o1777)?;
    let mut libraries = Vec::new();
    for name in spec.binaries {
        let binary = release.join(name);
        copy_into(&rootfs, &binary, Path::new("/usr/bin").join(name).as_path())?;
        for library in linked_libraries(&binary)? {
            if !libraries.contains(&library) {
                libraries.push(library);
            }
        }
    }
    for library in &libraries {
        copy_into(&rootfs, library, library)?;
    }
    if Path::new(CA_BUNDLE).exists() {
        copy_into(&rootfs, Path::new(CA_BUNDLE), Path::new(CA_BUNDLE))?;
    }
    let (passwd, group) = match spec.user {
        Some(id) => (
            format!(
                "root:x:0:0:root:/root:/sbin/nologin\nstackscope:x:{id}:{id}:stackscope:/{COLLECTOR_DATA}:/sbin/nologin\n"
            ),
            format!("root:x:0:\nstackscope:x:{id}:\n"),
        ),
        None => (
            "root:x:0:0:root:/root:/sbin/nologin\n".to_string(),
            "root:x:0:\n".to_string(),
        ),
    };
    std::fs::write(rootfs.join("etc/passwd"), passwd)?;
    std::fs::write(rootfs.join("etc/group"), group)?;
    if let Some(id) = spec.user {
        let data = rootfs.join(COLLECTOR_DATA);
        std::fs::create_dir_all(&data)?;
        std::os::unix::fs::chown(&data, Some(id), Some(id))
            .with_context(|| format!("chown {}", data.display()))?;
        set_mode(&data, 0o750)?;
    }

    let tarball = work.path().join("rootfs.tar");
    run_checked(
        Command::new("tar")
            .arg("-C")
            .arg(&rootfs)
            .args(["--numeric-owner", "-cf"])
            .arg(&tarball)
            .arg("."),
    )?;
    // A rebuilt image takes the tag; the one it replaces goes with it
    // unless a container still uses it.
    let previous = image_id(spec.tag);
    let mut import = podman();
    import.arg("import");
    for change in &spec.changes {
        import.args(["--change", change]);
    }
    import.arg(&tarball).arg(spec.tag);
    run_checked(import.stdout(std::process::Stdio::null()))?;
    if let Some(previous) = previous.filter(|id| Some(id) != image_id(spec.tag).as_ref()) {
        let _ = podman().args(["rmi", &previous]).output();
    }
    let size = podman()
        .args(["image", "inspect", "--format", "{{.Size}}", spec.tag])
        .output()
        .context("podman image inspect")?;
    String::from_utf8_lossy(&size.stdout)
        .trim()
        .parse()
        .with_context(|| format!("the size of {}", spec.tag))
}

fn image_id(tag: &str) -> Option<String> {
    let out = podman()
        .args(["image", "inspect", "--format", "{{.Id}}", tag])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The shared libraries (and the dynamic loader) `binary` loads, as paths
/// on this machine, from `ldd`.
fn linked_libraries(binary: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .context("running ldd")?;
    if !out.status.success() {
        bail!("ldd {} failed", binary.display());
    }
    let text = String::from_utf8(out.stdout).context("ldd's output")?;
    let mut libraries = Vec::new();
    for line in text.lines() {
        // `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)` or
        // `/lib64/ld-linux-x86-64.so.2 (0x...)`; the vDSO has no file.
        let path = match line.split_once("=>") {
            Some((_, right)) => right.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        match path {
            Some(path) if path.starts_with('/') => libraries.push(PathBuf::from(path)),
            _ if line.contains("not found") => bail!("{}: {line}", binary.display()),
            _ => {}
        }
    }
    Ok(libraries)
}

/// Copies the file `host` (following links) to `inside` under `rootfs`.
fn copy_into(rootfs: &Path, host: &Path, inside: &Path) -> anyhow::Result<()> {
    let target = rootfs.join(inside.strip_prefix("/").unwrap_or(inside));
    if let Some(parent) = target.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::copy(host, &target)
        .with_context(|| format!("copying {} into the image", host.display()))?;
    Ok(())
}

fn set_mode(path: &Path, mode: u32) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("chmod {mode:o} {}", path.display()))
}
