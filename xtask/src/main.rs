//! `cargo xtask`: the project's two front doors (`run`, `test`) plus the
//! toolchain bootstrap they share (`setup`), the benchmarks (`bench`), the
//! container images (`image`) and the parsers' fuzz targets (`fuzz`).
//! It owns no product logic: it builds, installs and runs things.

mod bench;
mod fuzz;
mod image;
mod kernels;
mod mappings;
mod off_cpu;
mod overhead;
mod programs;
mod setup;
mod soak;
mod test_failures;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    command: Task,
}

#[derive(Debug, Subcommand)]
enum Task {
    /// Install what the build and the tests need (idempotent).
    Setup,
    /// Build, start the collector (data in ./stackscope-data) and the agent,
    /// and on Ctrl-C write flamegraph.svg and print the top functions; extra
    /// arguments go to the agent (e.g. `cargo xtask run -- --duration 30s`).
    Run {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        agent_args: Vec<String>,
    },
    /// Format check, clippy, unit tests and the privileged end-to-end
    /// tests, on this kernel and (sampler and unwinding) on Linux 6.1 and
    /// 6.12 in virtual machines (root).
    Test {
        /// Only the fast tier, as a normal user: format check, then the unit
        /// and parser tests, the collector on SQLite and gRPC, the CLI, the
        /// export and the unwinder on fixtures; no root, no servers but the
        /// tests' own on 127.0.0.1, nothing installed by apt-get.
        #[arg(long)]
        fast: bool,
    },
    /// Benchmarks that print figures (reports, not pass/fail tests).
    Bench {
        #[command(subcommand)]
        which: bench::Bench,
    },
    /// Only the kernel matrix: the sampler and unwinding tests on Linux 6.1
    /// and 6.12 in virtual machines (part of `test`).
    Kernels,
    /// Build the agent's and the collector's container images with podman
    /// (no registry) and print their sizes.
    Image,
    /// The agent and the collector (release builds) under a mixed load for
    /// N minutes, with a collector restart: prints every cache's and
    /// queue's size over time and fails if one keeps growing.
    Soak {
        #[arg(long, default_value_t = 60.0)]
        minutes: f64,
        /// Soak the debug builds (as `cargo xtask test` does).
        #[arg(long)]
        debug: bool,
    },
    /// Run the parsers' cargo-fuzz targets one after the other (installing
    /// cargo-fuzz if missing) and print each one's executions, coverage and
    /// crashes.
    Fuzz(fuzz::Args),
}

fn main() -> std::process::ExitCode {
    match run_task(Cli::parse().command) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            // The causes, innermost last, and no backtrace (xtask's own is
            // of no use): what a failing step says is then the log's last
            // lines.
            eprintln!("Error: {error}");
            for cause in error.chain().skip(1) {
                eprintln!("caused by: {cause}");
            }
            std::process::ExitCode::FAILURE
        }
    }
}

fn run_task(task: Task) -> anyhow::Result<()> {
    match task {
        Task::Setup => setup::ensure_all(),
        Task::Run { agent_args } => run(&agent_args),
        Task::Test { fast: false } => test(),
        Task::Test { fast: true } => test_fast(),
        Task::Bench { which } => {
            setup::ensure_all()?;
            bench::run(which)
        }
        Task::Kernels => {
            setup::ensure_all()?;
            require_root("the tests in the virtual machines load BPF programs")?;
            cargo(&["build", "--package", "stackscope-agent", "--bins"])?;
            kernels::test()
        }
        Task::Image => {
            setup::ensure_all()?;
            image::build()
        }
        Task::Soak { minutes, debug } => {
            setup::ensure_all()?;
            soak::run(minutes, !debug)
        }
        Task::Fuzz(args) => fuzz::run(&args),
    }
}

/// Where `cargo xtask run` keeps the collector's database.
const RUN_DATA_DIR: &str = "stackscope-data";
const RUN_GRPC: &str = "127.0.0.1:7070";
const RUN_HTTP: &str = "127.0.0.1:7071";

/// A child process killed (and reaped) when dropped, so an early error does
/// not leave the collector running.
pub(crate) struct KillOnDrop(pub(crate) std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The whole product on this machine: the collector on its embedded
/// database, the agent shipping to it, and on Ctrl-C (or the agent's
/// `--duration`) a flamegraph and the top functions of the run.
fn run(agent_args: &[String]) -> anyhow::Result<()> {
    use std::os::unix::process::CommandExt as _;

    setup::ensure_all()?;
    require_root("the agent loads BPF programs")?;
    let release = build_binaries(true)?;
    let root = workspace_root();
    let bin = |name: &str| release.join(name);
    let started = std::time::SystemTime::now();

    // The collector gets its own process group: Ctrl-C in the terminal must
    // stop the agent (which then flushes its last interval) but not the
    // collector that has to receive it.
    let mut collector = KillOnDrop(
        Command::new(bin("stackscope-collector"))
            .args(["--data-dir", RUN_DATA_DIR, "--grpc-listen", RUN_GRPC])
            .args(["--http-listen", RUN_HTTP])
            .current_dir(&root)
            .process_group(0)
            .spawn()
            .context("starting stackscope-collector")?,
    );
    wait_for_listener(RUN_GRPC, &mut collector.0)?;

    let mut agent = Command::new(bin("stackscope-agent"));
    agent.args(["--collector", &format!("http://{RUN_GRPC}")]);
    if !agent_args.iter().any(|arg| arg.starts_with("--frequency")) {
        agent.args(["--frequency", "99"]);
    }
    agent.args(agent_args);
    let mut agent = agent.spawn().context("starting stackscope-agent")?;
    eprintln!(
        "profiling this host into the collector (data in ./{RUN_DATA_DIR}).\n\
         the web UI: http://{RUN_HTTP}/ (one SVG of the last 15 minutes: \
         http://{RUN_HTTP}/flamegraph.svg)\n\
         press Ctrl-C to stop and write flamegraph.svg"
    );
    let status = with_sigint_ignored(|| agent.wait())?;
    if !status.success() {
        bail!("the agent exited with {status}");
    }

    let start = started
        .duration_since(std::time::UNIX_EPOCH)
        .context("the clock is before 1970")?
        .as_secs()
        .to_string();
    let collector_url = format!("http://{RUN_GRPC}");
    let query = |args: &[&str]| {
        run_checked(
            Command::new(bin("stackscope"))
                .args(["--collector", &collector_url])
                .args(args)
                .args(["--start", &start])
                .current_dir(&root),
        )
    };
    query(&["flamegraph", "--output", "flamegraph.svg"])?;
    eprintln!("top functions of this run:");
    query(&["top", "--limit", "15"])?;
    eprintln!(
        "open {} in a browser; the collector kept the data in ./{RUN_DATA_DIR}",
        root.join("flamegraph.svg").display()
    );

    // SAFETY: kill has no memory-safety preconditions; SIGTERM lets the
    // collector finish requests in flight and close the database.
    unsafe { libc::kill(collector.0.id() as i32, libc::SIGTERM) };
    let status = collector.0.wait().context("waiting for the collector")?;
    if !status.success() {
        bail!("the collector exited with {status}");
    }
    Ok(())
}

/// Waits until the collector accepts connections, or fails if it exits.
pub(crate) fn wait_for_listener(addr: &str, child: &mut std::process::Child) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        if std::net::TcpStream::connect(addr).is_ok() {
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            bail!("the collector exited with {status} before listening on {addr}");
        }
        if std::time::Instant::now() > deadline {
            bail!("the collector did not listen on {addr} within 30 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// How long `cargo xtask test` soaks: the collector restarts 30 s in, and
/// the load's containers are replaced four times.
const SOAK_TEST_MINUTES: f64 = 1.5;

fn test() -> anyhow::Result<()> {
    let mut steps = Steps::new();
    steps.run("setup", setup::ensure_all)?;
    require_root("the end-to-end tests load BPF programs")?;
    fresh_fixture_cache()?;
    steps.run("fmt", || {
        cargo(&["fmt", "--all", "--", "--check"])
            .context("formatting differs: run `cargo fmt --all`")
    })?;
    // Host crates are the default members; the BPF crate only builds for the
    // BPF target, so it is linted there.
    steps.run("clippy", || {
        cargo(&["clippy", "--all-targets", "--", "-D", "warnings"])?;
        run_checked(
            Command::new("cargo")
                .args(["+nightly", "clippy", "--package", "agent-ebpf", "--release"])
                .args(["--target", "bpfel-unknown-none", "-Z", "build-std=core"])
                .args(["--", "-D", "warnings"])
                .current_dir(workspace_root())
                .env_remove("RUSTUP_TOOLCHAIN")
                .env_remove("RUSTC"),
        )
    })?;
    // The end-to-end tests run the agent binary; build it first so they test
    // the current sources.
    steps.run("binaries", || build_binaries(false).map(drop))?;
    // The deployment tests run the images, built from the current sources.
    steps.run("images", image::build)?;
    // Also the tests `#[ignore]`d as needing root, podman, go, node or
    // libc6-dbg (left out of `test --fast`), but not the measurement run by
    // hand.
    steps.run("cargo test", || {
        let mut args = vec![
            "test",
            "--",
            "--include-ignored",
            "--skip",
            HAND_RUN_MEASUREMENT,
        ];
        // The tests' output reaches the terminal through a pipe now.
        if std::io::IsTerminal::is_terminal(&std::io::stdout()) {
            args.extend(["--color", "always"]);
        }
        test_failures::run(&mut cargo_command(&args))
    })?;
    // The fuzz targets still build against the parsers' current APIs.
    steps.run("fuzz targets", fuzz::check)?;
    // One tiny round of each collector bench: the collector bench's
    // synthetic fleet and queries stay correct between the (long) benchmark
    // runs, and the symbolization bench names every frame right.
    steps.run("bench rounds", || {
        for bench in ["collector", "symbolize"] {
            cargo(&[
                "test",
                "--package",
                "stackscope-collector",
                "--bench",
                bench,
            ])?;
        }
        Ok(())
    })?;
    // A short soak (debug builds): every state gauge within its bound,
    // the load's containers sampled and nothing lost across a collector
    // restart. Growth is judged only by soaks of 10 minutes or more
    // (`cargo xtask soak --minutes 60`, by hand).
    steps.run("soak", || soak::run(SOAK_TEST_MINUTES, false))?;
    // The BPF program and the unwinder on the older kernels fleets run.
    steps.run("kernels", kernels::test)?;
    eprintln!("all tests passed in {}", steps.summary());
    Ok(())
}

/// An empty directory for the fixtures this run compiles, named to the
/// tests by `STACKSCOPE_FIXTURE_CACHE` (see test-fixtures' `RunCache`): the
/// host's tests compile each fixture once and the kernel matrix's virtual
/// machines reuse them.
fn fresh_fixture_cache() -> anyhow::Result<()> {
    let dir = workspace_root().join("target/fixture-cache");
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("emptying {}", dir.display()))?;
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    // SAFETY: xtask is single-threaded here; the variable is read by the
    // children it starts.
    unsafe { std::env::set_var(kernels::FIXTURE_CACHE, &dir) };
    Ok(())
}

/// Below this much free space, a failed step is likely the disk's fault:
/// the linker dies of a bus error and rustc of "No space left on device",
/// deep in a step's output. A fresh clone's whole suite writes about 20 GiB
/// into `target/`.
const NEARLY_FULL_BYTES: u64 = 2 << 30;

/// Says so when the disk holding `target/` is nearly full.
fn disk_nearly_full() -> Option<String> {
    let target = workspace_root().join("target");
    let path = std::ffi::CString::new(target.as_os_str().as_encoded_bytes()).ok()?;
    let mut stats = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `path` is NUL-terminated and `stats` is written by the call
    // before it is read, only when the call succeeds.
    let stats = unsafe {
        if libc::statvfs(path.as_ptr(), stats.as_mut_ptr()) != 0 {
            return None;
        }
        stats.assume_init()
    };
    let free = stats.f_bavail.saturating_mul(stats.f_frsize);
    (free < NEARLY_FULL_BYTES).then(|| {
        format!(
            "the disk holding {} has {:.1} GiB free: a full disk fails builds \
             (`cargo clean` frees what earlier builds left)",
            target.display(),
            free as f64 / f64::from(1u32 << 30)
        )
    })
}

/// The whole suite's steps and how long each took, so a slow step shows in
/// every run's log.
struct Steps {
    started: std::time::Instant,
    took: Vec<(&'static str, f64)>,
}

impl Steps {
    fn new() -> Self {
        Self {
            started: std::time::Instant::now(),
            took: Vec::new(),
        }
    }

    fn run(
        &mut self,
        name: &'static str,
        step: impl FnOnce() -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        let started = std::time::Instant::now();
        let result = step();
        let seconds = started.elapsed().as_secs_f64();
        eprintln!("step {name}: {seconds:.0} s");
        self.took.push((name, seconds));
        result
            .map_err(|error| match disk_nearly_full() {
                Some(hint) => error.context(hint),
                None => error,
            })
            .with_context(|| format!("step {name} failed after {seconds:.0} s"))
    }

    /// `812 s (setup 3 s, fmt 1 s, ...)`.
    fn summary(&self) -> String {
        let steps: Vec<String> = self
            .took
            .iter()
            .map(|(name, seconds)| format!("{name} {seconds:.0} s"))
            .collect();
        format!(
            "{:.0} s ({})",
            self.started.elapsed().as_secs_f64(),
            steps.join(", ")
        )
    }
}

/// The one `#[ignore]`d test `cargo xtask test` does not run: a measurement
/// (tests/tests/e2e/ui.rs) that needs a collector holding the collector bench's
/// fleet, started by hand.
const HAND_RUN_MEASUREMENT: &str = "the_fleet_hour_time_to_first_flamegraph";

/// The fast tier's integration test targets (`--test NAME`; each name is in
/// one selected package only): the collector's gRPC API, Pyroscope's APIs, OTLP profiles, storage on SQLite
/// and debuginfo store; the CLI against a collector it starts; the agent's
/// aggregator and its export to a fake collector; the process table on fixture processes; the
/// unwinder on real binaries and on stopped fixture processes; HotSpot's
/// code cache and names read from a running JVM.
const FAST_TESTS: &[&str] = &[
    "grpc",
    "pyroscope",
    "otlp",
    "storage",
    "debuginfo",
    "queries",
    "aggregator",
    "export",
    "processes",
    "identity",
    "real_binaries",
    "end_to_end",
    "hotspot",
];

/// Commands the fast tier's tests run (fixtures are compiled at test time;
/// split debug files made and read with binutils and xz), and where each
/// comes from.
const FAST_TOOLS: &[(&str, &str)] = &[
    ("gcc", "Debian's gcc"),
    ("g++", "Debian's g++"),
    ("objcopy", "Debian's binutils"),
    ("strip", "Debian's binutils"),
    ("readelf", "Debian's binutils"),
    ("xz", "Debian's xz-utils"),
    ("rustc", "rustup's stable toolchain"),
    ("javac", "Debian's openjdk-17-jdk-headless"),
    ("jcmd", "Debian's openjdk-17-jdk-headless"),
    ("true", "coreutils"),
    ("sleep", "coreutils"),
];

/// `cargo xtask test --fast`: the tier a developer runs between edits, as a
/// normal user. It installs nothing with apt-get (the user-level part of
/// setup, nightly's rust-src and bpf-linker, is installed if missing: the
/// agent's build script builds the BPF object) and checks for the commands
/// the tests run. Leaves out the tests that need root, BPF, containers,
/// ClickHouse or a browser; `cargo xtask test` runs them.
fn test_fast() -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    setup::ensure_user_level()?;
    check_fast_tools()?;
    // A formatting difference fails the tier after the tests have run, so
    // one run reports both.
    let formatted = cargo(&["fmt", "--all", "--", "--check"]);
    // Explicit targets: no doc-test pass (there are no doc tests), no
    // examples, no empty test harnesses of binaries.
    let mut args = vec!["test", "--no-fail-fast", "--workspace"];
    // The BPF crate builds only for its target; the end-to-end crate needs
    // root and BPF throughout.
    args.extend(["--exclude", "agent-ebpf", "--exclude", "stackscope-tests"]);
    args.extend(["--lib", "--bin", "xtask"]);
    for name in FAST_TESTS {
        args.extend(["--test", name]);
    }
    cargo(&args)?;
    formatted.context("formatting differs: run `cargo fmt --all`")?;
    eprintln!(
        "fast tier passed in {:.0} s (`cargo xtask test` runs the whole suite, as root)",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Fails naming every missing command the fast tier's tests run, and what
/// provides it.
fn check_fast_tools() -> anyhow::Result<()> {
    let mut missing: Vec<String> = FAST_TOOLS
        .iter()
        .filter(|(command, _)| !on_path(command))
        .map(|(command, from)| format!("`{command}` ({from})"))
        .collect();
    // The unwinder's static-pie fixture links glibc statically.
    if on_path("gcc") && !gcc_finds("libc.a") {
        missing.push("glibc's static library libc.a (Debian's libc6-dev)".to_string());
    }
    // The sampler's layout test reads the running kernel's BTF.
    if !Path::new("/sys/kernel/btf/vmlinux").exists() {
        missing.push("the kernel's BTF, /sys/kernel/btf/vmlinux (a kernel built with it)".into());
    }
    if !missing.is_empty() {
        bail!(
            "the fast tier's tests need {}; `sudo cargo xtask setup` installs Debian's packages",
            missing.join(", ")
        );
    }
    // The unwinder's end-to-end tests ptrace their own fixture processes;
    // Yama's scope 2 and 3 keep that to root.
    let ptrace_scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()
        .and_then(|scope| scope.trim().parse::<u32>().ok());
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    if ptrace_scope.is_some_and(|scope| scope >= 2) && !root {
        bail!(
            "kernel.yama.ptrace_scope is {}: the unwinder's tests ptrace their fixture processes, \
             which needs scope 0 or 1 (`sudo sysctl kernel.yama.ptrace_scope=1`) or root",
            ptrace_scope.unwrap_or_default()
        );
    }
    Ok(())
}

/// Whether `command` is an executable file in a directory of `$PATH`.
fn on_path(command: &str) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path).any(|dir| {
            std::fs::metadata(dir.join(command))
                .is_ok_and(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0)
        })
    })
}

/// Whether gcc finds `file` in its library search path (it prints the bare
/// name when it does not).
fn gcc_finds(file: &str) -> bool {
    Command::new("gcc")
        .arg(format!("-print-file-name={file}"))
        .output()
        .is_ok_and(|out| {
            out.status.success()
                && Path::new(String::from_utf8_lossy(&out.stdout).trim()).is_absolute()
        })
}

fn require_root(why: &str) -> anyhow::Result<()> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!("this needs root: {why}. Run it as root (e.g. `sudo -E cargo xtask ...`).");
    }
    Ok(())
}

pub(crate) fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

/// Builds the agent's, the collector's and the CLI's binaries (in release
/// mode, or the dev profile); returns where they are.
pub(crate) fn build_binaries(release: bool) -> anyhow::Result<PathBuf> {
    let mut args = vec!["build", "--bins"];
    for package in ["stackscope-agent", "stackscope-collector", "stackscope-cli"] {
        args.extend(["--package", package]);
    }
    if release {
        args.push("--release");
    }
    cargo(&args)?;
    Ok(workspace_root()
        .join("target")
        .join(if release { "release" } else { "debug" }))
}

/// Runs cargo (the same one that runs xtask) in the workspace root.
pub(crate) fn cargo(args: &[&str]) -> anyhow::Result<()> {
    run_checked(&mut cargo_command(args))
}

/// Cargo (the same one that runs xtask) with `args`, in the workspace root,
/// in the environment a build from a shell would have.
pub(crate) fn cargo_command(args: &[&str]) -> Command {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(args).current_dir(workspace_root());
    // What `cargo run` set for xtask itself is not the build's environment:
    // ring's build script reruns when CARGO_MANIFEST_DIR changes, so
    // inheriting it rebuilt ring and everything above it (rustls, tonic,
    // reqwest, the agent, the collector: 25-60 s here) at every switch
    // between `cargo xtask test --fast` and a plain `cargo test` (and in
    // every whole suite, when the kernel matrix built its test binary).
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if name.starts_with("CARGO_PKG_")
            || [
                "CARGO_MANIFEST_DIR",
                "CARGO_MANIFEST_PATH",
                "CARGO_CRATE_NAME",
                "CARGO_BIN_NAME",
                "CARGO_PRIMARY_PACKAGE",
            ]
            .contains(&&*name)
        {
            cmd.env_remove(&*name);
        }
    }
    cmd
}

pub(crate) fn run_checked(cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd.status().with_context(|| format!("starting {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed with {status}");
    }
    Ok(())
}

/// Runs `f` (waiting for a child) with SIGINT ignored: on Ctrl-C the child
/// handles the signal (the agent detaches and reports) and xtask must outlive
/// it to return its status. Spawn the child before calling this, since an
/// ignored disposition would be inherited across exec.
pub(crate) fn with_sigint_ignored<T>(f: impl FnOnce() -> T) -> T {
    // SAFETY: swapping the disposition of SIGINT between SIG_IGN and the
    // previous handler has no memory-safety preconditions.
    let previous = unsafe { libc::signal(libc::SIGINT, libc::SIG_IGN) };
    let result = f();
    // SAFETY: as above.
    unsafe { libc::signal(libc::SIGINT, previous) };
    result
}
