//! Toolchain bootstrap: everything a fresh machine of the project's kind lacks
//! (see `shared/ENVIRONMENT.md`). Each step checks before it acts, so a second
//! run does nothing and prints nothing.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context as _, bail};

use crate::run_checked;

/// bpf-linker release known to build against the nightly toolchain's LLVM.
const BPF_LINKER_VERSION: &str = "0.13.0";

/// cargo-fuzz release `cargo xtask fuzz` drives (its output format is parsed
/// for nothing but libFuzzer's own lines, so a newer one would do; pinned so
/// a fresh machine builds what was tried).
const CARGO_FUZZ_VERSION: &str = "0.13.2";

/// Debian packages the tests and benchmarks use: `bpftool` checks that
/// nothing stays loaded; `gcc` and `g++` compile the fixture programs;
/// `golang-go` provides `go tool pprof`, the real pprof reader the export
/// tests check against; `podman` and `runc` run real containers (crun refuses
/// hybrid cgroups), from images built around `busybox-static`; `nodejs` is
/// the JIT the JIT unwinding test samples (`--perf-basic-prof`), and its
/// `npm` installs Pyroscope's Node SDK for the SDK tests, as `python3-venv`
/// lets them install its Python SDK and a Connect client from PyPI;
/// `debuginfod` is the real server the collector fetches debuginfo from in
/// the naming tests, `elfutils` and `binutils` make and read their debug
/// files, `libc6-dbg` is the Debian debug package the agent's local lookup
/// is tested with; `prometheus` is the real server that scrapes the agent's
/// and the collector's metrics in their test; `catatonit` is the pause
/// process `podman kube play` builds its pods' infra image from;
/// `clickhouse-server` (18.16, started by the tests as plain processes, not
/// the systemd unit) is the real two-shard cluster the collector's
/// ClickHouse storage is tested against; `chromium` and `chromium-driver` are
/// the real browser (headless, driven over WebDriver) the web UI is tested in;
/// `mmdebstrap` builds the trixie and sid root filesystems whose own CPython
/// builds (3.13, 3.14) the Python frame tests run in containers;
/// `openjdk-17-jdk-headless` is the HotSpot JVM (`java`, `javac`, `jcmd`)
/// the Java frame tests compile their fixture for and sample.
const DEBIAN_PACKAGES: &[&str] = &[
    "binutils",
    "bpftool",
    "busybox-static",
    "catatonit",
    "chromium",
    "chromium-driver",
    "clickhouse-server",
    "debuginfod",
    "elfutils",
    "gcc",
    "g++",
    "golang-go",
    "libc6-dbg",
    "mmdebstrap",
    "nodejs",
    "openjdk-17-jdk-headless",
    "podman",
    "prometheus",
    "python3-venv",
    "runc",
];

pub fn ensure_all() -> anyhow::Result<()> {
    ensure_dev_null()?;
    ensure_nightly_rust_src()?;
    ensure_bpf_linker()?;
    ensure_debian_packages(DEBIAN_PACKAGES)?;
    Ok(())
}

/// What `cargo xtask test --fast` may do as a normal user: nightly's
/// `rust-src` and `bpf-linker` (rustup and cargo install into the user's
/// own toolchain), and /dev/null checked (recreated only by root).
pub fn ensure_user_level() -> anyhow::Result<()> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        ensure_dev_null()?;
    } else if !dev_null_is_the_device() {
        bail!(
            "/dev/null is not the null device (children would read whatever was last written \
             to it): `sudo cargo xtask setup` recreates it"
        );
    }
    ensure_nightly_rust_src()?;
    ensure_bpf_linker()
}

fn dev_null_is_the_device() -> bool {
    use std::os::unix::fs::FileTypeExt as _;
    std::fs::metadata("/dev/null").is_ok_and(|meta| meta.file_type().is_char_device())
}

/// Machines of this kind have been seen with `/dev/null` deleted and
/// recreated as a regular file by the next `> /dev/null`. It then holds
/// whatever was last thrown away, and every `Stdio::null()` child reads it:
/// cargo's rustc probe failed on a gcc error message as its source. Recreate
/// the device (character device 1:3, as the kernel's devtmpfs makes it).
fn ensure_dev_null() -> anyhow::Result<()> {
    let dev_null = Path::new("/dev/null");
    if dev_null_is_the_device() {
        return Ok(());
    }
    eprintln!("setup: /dev/null is not the null device; recreating it");
    match std::fs::remove_file(dev_null) {
        Ok(()) => {}
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
        Err(err) => return Err(err).context("removing the /dev/null impostor (needs root)"),
    }
    // SAFETY: the path is a NUL-terminated literal; mknod has no other
    // memory-safety preconditions.
    let made = unsafe {
        libc::mknod(
            c"/dev/null".as_ptr(),
            libc::S_IFCHR | 0o666,
            libc::makedev(1, 3),
        )
    };
    if made != 0 {
        return Err(std::io::Error::last_os_error()).context("mknod /dev/null c 1 3 (needs root)");
    }
    // mknod's mode is masked by the umask; the null device is for everyone.
    std::fs::set_permissions(
        dev_null,
        std::os::unix::fs::PermissionsExt::from_mode(0o666),
    )
    .context("chmod 666 /dev/null")?;
    Ok(())
}

/// cargo-fuzz, for `cargo xtask fuzz` only (the tests do not need it, so
/// [`ensure_all`] does not build it). Built from crates.io with `--locked`;
/// it drives the nightly toolchain, which is already there for the BPF crate.
pub(crate) fn ensure_cargo_fuzz() -> anyhow::Result<()> {
    let installed = Command::new("cargo")
        .args(["fuzz", "--version"])
        .stderr(Stdio::null())
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map(|out| String::from_utf8_lossy(&out.stdout).into_owned());
    if installed
        .is_some_and(|version| version.split_whitespace().nth(1) == Some(CARGO_FUZZ_VERSION))
    {
        return Ok(());
    }
    eprintln!(
        "setup: installing cargo-fuzz {CARGO_FUZZ_VERSION} from crates.io (about two minutes)"
    );
    run_checked(Command::new("cargo").args([
        "install",
        "cargo-fuzz",
        "--version",
        CARGO_FUZZ_VERSION,
        "--locked",
    ]))
}

fn ensure_nightly_rust_src() -> anyhow::Result<()> {
    let installed = output(Command::new("rustup").args([
        "component",
        "list",
        "--installed",
        "--toolchain",
        "nightly",
    ]))
    .context("the nightly toolchain is needed to build the BPF programs")?;
    if installed.lines().any(|line| line.starts_with("rust-src")) {
        return Ok(());
    }
    eprintln!("setup: adding rust-src to the nightly toolchain");
    run_checked(Command::new("rustup").args([
        "component",
        "add",
        "rust-src",
        "--toolchain",
        "nightly",
    ]))
}

fn ensure_bpf_linker() -> anyhow::Result<()> {
    let works = Command::new("bpf-linker")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success());
    if works {
        return Ok(());
    }
    // Prebuilt bpf-linker downloads are unreachable here, and Debian's LLVM is
    // older than nightly's: build it against the LLVM the nightly toolchain
    // ships (a shared library in its sysroot), and bake that path in as rpath.
    let sysroot = PathBuf::from(
        output(Command::new("rustc").args(["+nightly", "--print", "sysroot"]))?.trim(),
    );
    let version_info = output(Command::new("rustc").args(["+nightly", "-vV"]))?;
    let llvm_major = llvm_major(&version_info)?;
    let lib_dir = sysroot.join("lib");
    let libllvm = find_libllvm(&lib_dir)?;

    let prefix = std::env::temp_dir().join(format!("stackscope-llvm-{llvm_major}"));
    std::fs::create_dir_all(prefix.join("lib"))?;
    let link = prefix.join("lib/libLLVM.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&libllvm, &link)
        .with_context(|| format!("linking {} to {}", link.display(), libllvm.display()))?;

    eprintln!(
        "setup: building bpf-linker {BPF_LINKER_VERSION} against nightly's LLVM {llvm_major} (about a minute)"
    );
    let result = run_checked(
        Command::new("cargo")
            .args([
                "install",
                "bpf-linker",
                "--version",
                BPF_LINKER_VERSION,
                "--no-default-features",
                "--features",
                &format!("llvm-{llvm_major}"),
            ])
            .env("LLVM_PREFIX", &prefix)
            .env(
                "RUSTFLAGS",
                format!("-C link-arg=-Wl,-rpath,{}", lib_dir.display()),
            ),
    );
    let _ = std::fs::remove_dir_all(&prefix);
    result
}

/// The LLVM major version from `rustc -vV` ("LLVM version: 22.1.4" → 22).
fn llvm_major(version_info: &str) -> anyhow::Result<u32> {
    version_info
        .lines()
        .find_map(|line| line.strip_prefix("LLVM version: "))
        .and_then(|version| version.split('.').next())
        .and_then(|major| major.trim().parse().ok())
        .with_context(|| format!("no LLVM version in `rustc +nightly -vV`:\n{version_info}"))
}

/// The versioned `libLLVM.so.<ver>-rust-<ver>-nightly` in the sysroot.
fn find_libllvm(lib_dir: &Path) -> anyhow::Result<PathBuf> {
    for entry in
        std::fs::read_dir(lib_dir).with_context(|| format!("reading {}", lib_dir.display()))?
    {
        let path = entry?.path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if name.starts_with("libLLVM.so.") {
            return Ok(path);
        }
    }
    bail!(
        "no libLLVM.so.* in {}; is the nightly toolchain complete?",
        lib_dir.display()
    )
}

pub(crate) fn ensure_debian_packages(packages: &[&str]) -> anyhow::Result<()> {
    let missing: Vec<&str> = packages
        .iter()
        .copied()
        .filter(|package| !debian_package_installed(package))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("setup: installing Debian packages {}", missing.join(" "));
    run_checked(Command::new("apt-get").args(["update", "-qq"]))?;
    run_checked(
        Command::new("apt-get")
            .args(["install", "-y", "-qq", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
}

fn debian_package_installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", package])
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).contains("install ok installed"))
}

fn output(cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd.output().with_context(|| format!("starting {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8(out.stdout)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_llvm_major_from_rustc_version_info() {
        let info = "rustc 1.97.0-nightly (e50aa6fba 2026-05-19)\nbinary: rustc\nhost: x86_64-unknown-linux-gnu\nLLVM version: 22.1.4\n";
        assert_eq!(llvm_major(info).unwrap(), 22);
        assert!(llvm_major("rustc 1.95.0\n").is_err());
    }
}
