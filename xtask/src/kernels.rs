//! The kernels fleets run: the end-to-end sampler and unwinding tests, run
//! again inside virtual machines booting Debian's Linux 6.1 and 6.12 over
//! this machine's root filesystem (virtme-ng, qemu without KVM: under KVM
//! qemu fails here on an MSR, see `shared/ENVIRONMENT.md`).
//!
//! Owns installing the kernels and virtme-ng (idempotently), finding the
//! end-to-end test binary cargo built, and booting each kernel once to run them.

use std::{
    io::{BufRead as _, BufReader},
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context as _, bail};

use crate::{setup, workspace_root};

/// A family of Debian kernel images: releases `<prefix><number><suffix>`.
struct KernelFamily {
    name: &'static str,
    prefix: &'static str,
    suffix: &'static str,
}

impl KernelFamily {
    fn has(&self, release: &str) -> bool {
        release
            .strip_prefix(self.prefix)
            .and_then(|rest| rest.strip_suffix(self.suffix))
            .is_some_and(|number| !number.is_empty() && number.bytes().all(|b| b.is_ascii_digit()))
    }
}

/// The kernels tested besides this machine's own: the newest image of each
/// family, installed unless one is there already.
const KERNELS: &[KernelFamily] = &[
    // Debian 12's own kernel.
    KernelFamily {
        name: "6.1",
        prefix: "6.1.0-",
        suffix: "-amd64",
    },
    // The 6.12 LTS Debian 12 carries (Debian 13's kernel).
    KernelFamily {
        name: "6.12",
        prefix: "6.12.",
        suffix: "+deb12-amd64",
    },
];

/// virtme-ng release known to boot these kernels here.
const VIRTME_NG: &str = "virtme-ng==1.42";

/// The end-to-end test binary (`tests/tests/e2e`), and the tests of it run
/// in each kernel (name filters): what the kernel can change. Those that
/// load the BPF program and check what it records (CPython's frames of
/// every version included), and the unwinding of what it copied where the
/// kernel wrote part of the stack: a plain call chain from the saved
/// registers, a thread's stack from clone, a signal frame. The other
/// unwinding tests (C++, Rust, PLT, dlopen, static PIE, libc's frame
/// pointers, the depth limit) read only user space and stay on the host,
/// as do the Python tests that run the agent or feed the program a forged
/// interpreter (its bound is the program's, the same on every kernel).
/// Each test takes 12-20 s in an emulated guest.
const TEST_BINARY: &str = "e2e";
const TEST_FILTERS: &[&str] = &[
    "sampler::",
    "unwinding::unwinds_a_call_chain_without_frame_pointers_down_to_main",
    "unwinding::unwinds_a_thread_down_to_its_entry",
    "unwinding::unwinds_a_signal_handler_through_the_signal_frame",
    "python::the_sampler_reads",
];

/// Names the directory of fixtures compiled in this run (test-fixtures'
/// `RunCache`).
pub const FIXTURE_CACHE: &str = "STACKSCOPE_FIXTURE_CACHE";

/// Runs [`TEST_FILTERS`] in each kernel. When [`FIXTURE_CACHE`] is set (as
/// `cargo xtask test` sets it), the guests copy the fixtures the host's
/// tests compiled from there instead of compiling them again: one gcc run
/// takes 4 s in a guest.
pub fn test() -> anyhow::Result<()> {
    let kernels: Vec<(&str, PathBuf)> = KERNELS
        .iter()
        .map(|family| Ok((family.name, ensure_kernel(family)?)))
        .collect::<anyhow::Result<_>>()?;
    let vng = ensure_virtme_ng()?;
    // The optimised test binary runs the release agent (up to date already
    // when `cargo xtask test` built the images).
    crate::build_binaries(true)?;
    let binary = test_binary()?;
    let root = workspace_root();
    // The guest runs a shell over the host's files; it has the host's
    // tools (gcc, rustc for the fixtures) once PATH says where they are.
    let path = std::env::var("PATH").unwrap_or_default();
    let mut script = format!(
        "set -e; export PATH='{path}'; cd '{}'; echo \"kernel $(uname -r)\"",
        root.join("tests").display()
    );
    if let Some(cache) = std::env::var_os(FIXTURE_CACHE) {
        script.push_str(&format!(
            "; export {FIXTURE_CACHE}='{}'",
            Path::new(&cache).display()
        ));
    }
    // Filtered by path: `sampler::` matches that module's tests only.
    script.push_str(&format!("; '{}' --test-threads 1", binary.display()));
    for filter in TEST_FILTERS {
        script.push_str(&format!(" {filter}"));
    }
    for (name, vmlinuz) in &kernels {
        eprintln!("kernel {name}: {} in a virtual machine", vmlinuz.display());
        let started = std::time::Instant::now();
        let mut guest = run_guest(&vng, vmlinuz, &script, &path)?;
        if guest.timed_out {
            bail!(
                "the tests on Linux {name} ({}) ran past {} minutes and were killed: a test hangs \
                 (the last one named above)",
                vmlinuz.display(),
                GUEST_DEADLINE.as_secs() / 60
            );
        }
        if !guest.status.success() && guest.lines == 0 {
            // Nothing at all, not even the kernel's release: the machine
            // never booted (seen once on 6.12 after 6.1 had passed; the
            // next run passed). Tests that fail print their failures.
            eprintln!(
                "kernel {name}: the virtual machine printed nothing and ended with {}; \
                 starting it once more",
                guest.status
            );
            guest = run_guest(&vng, vmlinuz, &script, &path)?;
        }
        if !guest.status.success() {
            bail!(
                "the tests failed on Linux {name} ({}): {}",
                vmlinuz.display(),
                guest.status
            );
        }
        eprintln!(
            "kernel {name}: passed in {:.0} s",
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// How a virtual machine's run ended, and how many lines it printed.
struct GuestRun {
    status: std::process::ExitStatus,
    lines: usize,
    /// Whether it ran past [`GUEST_DEADLINE`] and was killed.
    timed_out: bool,
}

/// The longest a guest may run. Its tests take 3-4 minutes under emulation
/// (no KVM here); one that hangs (seen once: a 6.1 guest spinning for 17
/// minutes in the address-space test) would otherwise hold the whole suite
/// past CI's limit, with no word of which kernel.
const GUEST_DEADLINE: std::time::Duration = std::time::Duration::from_secs(15 * 60);

/// Boots `vmlinuz` and runs `script` in it, printing what it prints.
fn run_guest(vng: &Path, vmlinuz: &Path, script: &str, path: &str) -> anyhow::Result<GuestRun> {
    // The guest's output comes through pipes: given a file, qemu rewinds
    // it and a second kernel's run overwrites everything written before
    // (and pads its lines with the console's blanks).
    let mut guest = Command::new(vng)
        .arg("-r")
        .arg(vmlinuz)
        .args(["--memory", "2G", "--cpus", "2", "--disable-kvm", "--"])
        .arg(script)
        .env(
            "PATH",
            format!("{}:{path}", vng.parent().unwrap().display()),
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own group: qemu, which vng starts, goes with it on a timeout.
        .process_group(0)
        .spawn()
        .with_context(|| format!("running {}", vng.display()))?;
    let (finished, finish) = std::sync::mpsc::channel::<()>();
    let group = guest.id() as libc::pid_t;
    let watchdog = std::thread::spawn(move || {
        // Nothing sent, only the sender dropped: the guest ended in time.
        let timed_out = matches!(
            finish.recv_timeout(GUEST_DEADLINE),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout)
        );
        if timed_out {
            // SAFETY: kill has no memory preconditions; the group is the
            // guest's, not yet reaped (the main thread waits for it).
            unsafe { libc::kill(-group, libc::SIGKILL) };
        }
        timed_out
    });
    let errors = guest.stderr.take().map(|errors| {
        std::thread::spawn(move || {
            let mut lines = 0;
            for line in BufReader::new(errors).lines().map_while(Result::ok) {
                eprintln!("{}", line.trim_end());
                lines += 1;
            }
            lines
        })
    });
    let mut lines = 0;
    if let Some(console) = guest.stdout.take() {
        for line in BufReader::new(console).lines().map_while(Result::ok) {
            println!("{}", line.trim_end());
            lines += 1;
        }
    }
    let status = guest.wait().context("waiting for the guest")?;
    drop(finished);
    let timed_out = watchdog.join().unwrap_or(false);
    if let Some(errors) = errors {
        lines += errors.join().unwrap_or(0);
    }
    Ok(GuestRun {
        status,
        lines,
        timed_out,
    })
}

/// The newest installed kernel image of the family, installing the newest
/// package of it first when there is none.
fn ensure_kernel(family: &KernelFamily) -> anyhow::Result<PathBuf> {
    let image = |release: &str| Path::new("/boot").join(format!("vmlinuz-{release}"));
    // An image of the family already in /boot: use it, offline.
    let mut present: Vec<String> = std::fs::read_dir("/boot")
        .map(|dir| {
            dir.flatten()
                .filter_map(|entry| {
                    let name = entry.file_name().to_string_lossy().into_owned();
                    name.strip_prefix("vmlinuz-").map(str::to_owned)
                })
                .filter(|release| family.has(release))
                .collect()
        })
        .unwrap_or_default();
    present.sort_by(|a, b| version_order(a, b));
    if let Some(release) = present.last() {
        return Ok(image(release));
    }
    let escape = |text: &str| text.replace('.', r"\.").replace('+', r"\+");
    let pattern = format!(
        "^linux-image-{}[0-9]+{}$",
        escape(family.prefix),
        escape(family.suffix)
    );
    let out = Command::new("apt-cache")
        .args(["search", "--names-only", &pattern])
        .output()
        .context("running apt-cache")?;
    let mut releases: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| line.split_whitespace().next()?.strip_prefix("linux-image-"))
        .filter(|release| family.has(release))
        .map(str::to_owned)
        .collect();
    releases.sort_by(|a, b| version_order(a, b));
    let Some(release) = releases.last() else {
        bail!(
            "no Debian package of Linux {} (apt-get update?)",
            family.name
        );
    };
    setup::ensure_debian_packages(&[format!("linux-image-{release}").as_str()])?;
    let image = image(release);
    if !image.exists() {
        bail!(
            "linux-image-{release} is installed but {} is missing",
            image.display()
        );
    }
    Ok(image)
}

/// Orders names by their numbers (`6.1.0-9` before `6.1.0-56`).
fn version_order(a: &str, b: &str) -> std::cmp::Ordering {
    let numbers = |s: &str| -> Vec<u64> {
        s.split(|c: char| !c.is_ascii_digit())
            .filter(|part| !part.is_empty())
            .map(|part| part.parse().unwrap_or(u64::MAX))
            .collect()
    };
    numbers(a).cmp(&numbers(b))
}

/// virtme-ng in a virtual environment under `target/`; its `vng`.
fn ensure_virtme_ng() -> anyhow::Result<PathBuf> {
    setup::ensure_debian_packages(&["qemu-system-x86"])?;
    let venv = workspace_root().join("target/virtme-ng");
    let vng = venv.join("bin/vng");
    if vng.exists() {
        return Ok(vng);
    }
    crate::run_checked(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
    crate::run_checked(Command::new(venv.join("bin/pip")).args(["install", "--quiet", VIRTME_NG]))?;
    Ok(vng)
}

/// The end-to-end test executable (the tests `cargo test` just ran on this
/// kernel), built now, optimised: a guest emulates every instruction. With
/// it a guest takes 177 s here (157 s of tests; the step took 440 s with
/// the debug build). Its dependencies are the release binaries' that the
/// images were built from.
fn test_binary() -> anyhow::Result<PathBuf> {
    let out = crate::cargo_command(&["test", "--release", "--package", "stackscope-tests"])
        .args([
            "--no-run",
            "--test",
            TEST_BINARY,
            "--message-format",
            "json",
        ])
        .output()
        .context("building the test binary")?;
    if !out.status.success() {
        bail!(
            "building the test binary failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .find(|message| message["target"]["name"] == TEST_BINARY)
        .and_then(|message| Some(PathBuf::from(message["executable"].as_str()?)))
        .with_context(|| format!("cargo built no test binary named {TEST_BINARY}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_releases_belong_to_their_family() {
        let [six_one, six_twelve] = [&KERNELS[0], &KERNELS[1]];
        assert!(six_one.has("6.1.0-56-amd64"));
        assert!(!six_one.has("6.1.0-56-cloud-amd64"));
        assert!(!six_one.has("6.1.0--amd64"));
        assert!(!six_one.has("6.12.117+deb12-amd64"));
        assert!(six_twelve.has("6.12.117+deb12-amd64"));
        assert!(!six_twelve.has("6.12.117+deb12-rt-amd64"));
        assert!(!six_twelve.has("6.1.0-56-amd64"));
    }

    #[test]
    fn versions_order_by_their_numbers() {
        let mut releases = vec!["6.1.0-56-amd64", "6.1.0-9-amd64", "6.1.0-47-amd64"];
        releases.sort_by(|a, b| version_order(a, b));
        assert_eq!(
            releases,
            ["6.1.0-9-amd64", "6.1.0-47-amd64", "6.1.0-56-amd64"]
        );
    }
}
