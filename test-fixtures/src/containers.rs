//! Real podman containers for tests: images imported from a rootfs built at
//! test time (a static busybox plus the test's own binaries, no registry),
//! and containers started detached and removed on drop, so a failing test
//! leaves neither behind.
//!
//! This host needs particular podman flags (runc, because crun refuses hybrid
//! cgroups; the cgroupfs manager; ulimits below the hard limit; see
//! `shared/ENVIRONMENT.md`). They live in [`PODMAN_GLOBAL_FLAGS`] and
//! [`PODMAN_RUN_FLAGS`], used through [`podman`] and [`podman_run`], and
//! nowhere else.
//!
//! Everything here needs root (podman's system storage, cgroups): call
//! [`require_root`] first. Failures panic with podman's stderr.

use std::{
    ffi::OsStr,
    path::{Path, PathBuf},
    process::{Command, Output},
    sync::atomic::{AtomicUsize, Ordering},
    time::{Duration, Instant},
};

/// Options given to podman before the subcommand.
pub const PODMAN_GLOBAL_FLAGS: &[&str] = &["--runtime", "runc", "--cgroup-manager", "cgroupfs"];

/// Options given to `podman run`: detached, removed when it exits, no
/// network, and ulimits within this host's hard limits (podman's defaults
/// exceed them and runc refuses to start).
pub const PODMAN_RUN_FLAGS: &[&str] = &[
    "-d",
    "--rm",
    "--network=none",
    "--ulimit",
    "nofile=1024:1024",
    "--ulimit",
    "nproc=1024:1024",
];

/// The static busybox (Debian's `busybox-static`) copied into every image.
const HOST_BUSYBOX: &str = "/bin/busybox";

/// How long [`Container::run`] waits for the container's command to start.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// Fails the test unless it runs as root: podman runs with the system's
/// storage here.
pub fn require_root() {
    crate::require_root("container tests run podman with system storage");
}

/// `podman` with [`PODMAN_GLOBAL_FLAGS`], ready for a subcommand.
pub fn podman() -> Command {
    let mut command = Command::new("podman");
    command.args(PODMAN_GLOBAL_FLAGS);
    command
}

/// `podman run` with [`PODMAN_RUN_FLAGS`]; append `--name`, the image and
/// the command.
pub fn podman_run() -> Command {
    let mut command = podman();
    command.arg("run").args(PODMAN_RUN_FLAGS);
    command
}

/// Runs `podman <args>` and returns its output, panicking with podman's
/// stderr when it fails.
pub fn podman_ok<I, S>(args: I) -> Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut command = podman();
    command.args(args);
    checked(&mut command)
}

fn checked(command: &mut Command) -> Output {
    let output = command
        .output()
        .unwrap_or_else(|err| panic!("running {command:?}: {err}"));
    assert!(
        output.status.success(),
        "{command:?} failed ({}): {}",
        output.status,
        String::from_utf8_lossy(&output.stderr).trim()
    );
    output
}

/// A name no other test, or concurrent test run, uses:
/// `stackscope-test-<hint>-<pid>-<n>`.
fn unique_name(hint: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("stackscope-test-{hint}-{}-{n}", std::process::id())
}

/// A podman image imported from a rootfs tarball; removed on drop.
pub struct Image {
    /// The full reference, `localhost/stackscope-test-<hint>-<pid>-<n>:latest`.
    pub name: String,
}

impl Image {
    /// Imports an image holding `/bin/busybox`, `/bin/sh` (a link to it) and
    /// `files`, each `(host file, absolute path inside the image)`, mode
    /// 0755. Binaries must be static: the image has no libc.
    pub fn build(tag_hint: &str, files: &[(&Path, &str)]) -> Image {
        let work = tempfile::tempdir().expect("creating a temporary directory");
        let rootfs = work.path().join("rootfs");
        for dir in ["bin", "dev", "proc", "sys", "tmp", "etc"] {
            create_dir(&rootfs.join(dir));
        }
        copy_executable(Path::new(HOST_BUSYBOX), &rootfs.join("bin/busybox"));
        std::os::unix::fs::symlink("busybox", rootfs.join("bin/sh"))
            .expect("linking /bin/sh to busybox");
        for &(host, inside) in files {
            let relative = inside.trim_start_matches('/');
            assert!(
                !relative.is_empty() && !relative.split('/').any(|part| part == ".."),
                "{inside:?} is not a file path inside the image"
            );
            let target = rootfs.join(relative);
            if let Some(parent) = target.parent() {
                create_dir(parent);
            }
            copy_executable(host, &target);
        }

        let tarball = work.path().join("rootfs.tar");
        checked(
            Command::new("tar")
                .arg("-C")
                .arg(&rootfs)
                .args(["--numeric-owner", "--owner=0", "--group=0", "-cf"])
                .arg(&tarball)
                .arg("."),
        );
        Self::import(tag_hint, &tarball)
    }

    /// Imports the root filesystem `tarball` (a whole distribution's, say)
    /// as an image.
    pub fn import(tag_hint: &str, tarball: &Path) -> Image {
        let name = format!("localhost/{}:latest", unique_name(tag_hint));
        podman_ok([OsStr::new("import"), tarball.as_os_str(), OsStr::new(&name)]);
        Image { name }
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        // Errors are ignored: a panic in drop would hide the test's own failure.
        let _ = podman().args(["rmi", "-f", &self.name]).output();
    }
}

fn create_dir(path: &Path) {
    std::fs::create_dir_all(path)
        .unwrap_or_else(|err| panic!("creating {}: {err}", path.display()));
}

fn copy_executable(from: &Path, to: &Path) {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::copy(from, to)
        .unwrap_or_else(|err| panic!("copying {} to {}: {err}", from.display(), to.display()));
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o755))
        .unwrap_or_else(|err| panic!("chmod 0755 {}: {err}", to.display()));
}

/// A detached podman container, force-removed on drop.
pub struct Container {
    /// The full container id, 64 hex digits.
    pub id: String,
    /// The name given with `--name`, `stackscope-test-<hint>-<pid>-<n>`.
    pub name: String,
    /// The host pid of the container's init process (its command).
    pub pid: u32,
}

impl Container {
    /// Starts `command` in `image` and waits until the command itself runs
    /// (runc's init has exec'd it).
    pub fn run(image: &Image, name_hint: &str, command: &[&str]) -> Container {
        Self::run_with(image, name_hint, &[], command)
    }

    /// [`Container::run`] with more `podman run` options (e.g.
    /// `--cgroup-parent`).
    pub fn run_with(
        image: &Image,
        name_hint: &str,
        options: &[&str],
        command: &[&str],
    ) -> Container {
        let name = unique_name(name_hint);
        let output = checked(
            podman_run()
                .args(options)
                .args(["--name", &name, &image.name])
                .args(command),
        );
        let id = String::from_utf8_lossy(&output.stdout).trim().to_owned();
        // Removed on drop from here on, whatever fails next.
        let mut container = Container { id, name, pid: 0 };
        assert!(
            container.id.len() == 64 && container.id.bytes().all(|b| b.is_ascii_hexdigit()),
            "podman run printed {:?}, not a container id",
            container.id
        );
        let inspect = podman_ok(["inspect", "--format", "{{.State.Pid}}", &container.id]);
        let pid = String::from_utf8_lossy(&inspect.stdout).trim().to_owned();
        container.pid = pid
            .parse()
            .unwrap_or_else(|_| panic!("podman inspect gave pid {pid:?}"));
        assert_ne!(
            container.pid, 0,
            "container {} is not running",
            container.name
        );
        container.wait_for_exec();
        container
    }

    /// Waits until the init process is no longer runc's (`runc:[2:INIT]`),
    /// which execs the command only after `podman run -d` may have returned.
    fn wait_for_exec(&self) {
        let comm = format!("/proc/{}/comm", self.pid);
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            match std::fs::read_to_string(&comm) {
                Ok(name) if !name.starts_with("runc") => return,
                Ok(_) => {}
                Err(err) => panic!(
                    "container {} (pid {}) exited before it ran its command: {err}",
                    self.name, self.pid
                ),
            }
            assert!(
                Instant::now() < deadline,
                "container {} did not start its command within {START_TIMEOUT:?}",
                self.name
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits until the container's output (`podman logs`) holds `text`.
    pub fn wait_for_output(&self, text: &str) {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let logs = podman_ok(["logs", &self.id]);
            if String::from_utf8_lossy(&logs.stdout).contains(text) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "container {} did not print {text:?} within {START_TIMEOUT:?}",
                self.name
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The process's cgroup v2 path (the `0::` line of `/proc/<pid>/cgroup`),
    /// e.g. `/libpod_parent/libpod-<id>`.
    pub fn cgroup_path(&self) -> String {
        let path = format!("/proc/{}/cgroup", self.pid);
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("reading {path}: {err}"));
        text.lines()
            .find_map(|line| line.strip_prefix("0::"))
            .unwrap_or_else(|| panic!("{path} has no cgroup v2 line: {text:?}"))
            .to_owned()
    }

    /// `/proc/<pid>` of the container's init process.
    pub fn proc_dir(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}", self.pid))
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        // `--rm` may race us to it; errors are ignored.
        let _ = podman().args(["rm", "-f", "-t", "0", &self.id]).output();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Fixture;

    fn podman_lines(args: &[&str]) -> Vec<String> {
        let output = podman_ok(args);
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .map(str::to_owned)
            .collect()
    }

    #[test]
    #[ignore = "needs root and podman: run by `cargo xtask test`"]
    fn runs_a_fixture_in_a_container_and_cleans_up() {
        require_root();
        let fixture = Fixture::compile("call_chain", &["-static"]);
        let image = Image::build("call-chain", &[(&fixture.path, "/app/call_chain")]);
        let image_name = image.name.clone();
        let container = Container::run(&image, "call-chain", &["/app/call_chain"]);
        let id = container.id.clone();

        let exe = std::fs::read_link(container.proc_dir().join("exe")).expect("reading exe");
        assert_eq!(exe, Path::new("/app/call_chain"));
        let cgroup = container.cgroup_path();
        assert!(
            cgroup.contains(&format!("libpod-{id}")),
            "cgroup {cgroup:?} does not name container {id}"
        );
        let running = podman_lines(&["ps", "--no-trunc", "--format", "{{.ID}} {{.Names}}"]);
        assert!(
            running.contains(&format!("{id} {}", container.name)),
            "podman ps: {running:?}"
        );

        // Asked of this container and image alone: a listing of all of
        // them fails when another test removes its image meanwhile
        // ("image not known", seen in a whole-suite run).
        let exists = |what: &str, name: &str| {
            let status = podman()
                .args([what, "exists", name])
                .status()
                .unwrap_or_else(|err| panic!("running podman {what} exists: {err}"));
            match status.code() {
                Some(0) => true,
                Some(1) => false,
                _ => panic!("podman {what} exists {name} failed: {status}"),
            }
        };
        assert!(exists("container", &id) && exists("image", &image_name));
        drop(container);
        drop(image);
        assert!(!exists("container", &id), "{id} left behind");
        assert!(!exists("image", &image_name), "{image_name} left behind");
    }

    #[test]
    #[ignore = "needs root and podman: run by `cargo xtask test`"]
    fn busybox_shell_runs_in_an_image_without_files() {
        require_root();
        let image = Image::build("busybox", &[]);
        let container = Container::run(&image, "busybox", &["/bin/sh", "-c", "exec sleep 300"]);
        let exe = std::fs::read_link(container.proc_dir().join("exe")).expect("reading exe");
        assert_eq!(exe, Path::new("/bin/busybox"));
    }
}
