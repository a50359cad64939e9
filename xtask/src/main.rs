//! `cargo xtask`: the project's two front doors (`run`, `test`) plus the
//! toolchain bootstrap they share (`setup`) and the benchmarks (`bench`).
//! It owns no product logic: it builds, installs and runs things.

mod bench;
mod setup;

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
    /// Build and profile this host until Ctrl-C; extra arguments go to the agent
    /// (e.g. `cargo xtask run -- --duration 30s --frequency 99`).
    Run {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        agent_args: Vec<String>,
    },
    /// Format check, clippy, unit tests and the privileged end-to-end tests.
    Test,
    /// Benchmarks that print figures (reports, not pass/fail tests).
    Bench {
        #[command(subcommand)]
        which: bench::Bench,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Task::Setup => setup::ensure_all(),
        Task::Run { agent_args } => run(&agent_args),
        Task::Test => test(),
        Task::Bench { which } => {
            setup::ensure_all()?;
            bench::run(which)
        }
    }
}

fn run(agent_args: &[String]) -> anyhow::Result<()> {
    setup::ensure_all()?;
    require_root("the agent loads BPF programs")?;
    cargo(&["build", "--release", "--package", "stackscope-agent"])?;
    let agent = workspace_root().join("target/release/stackscope-agent");
    let mut cmd = Command::new(&agent);
    if agent_args.is_empty() {
        cmd.args(["--frequency", "99"]);
    }
    cmd.args(agent_args);
    eprintln!("profiling this host; press Ctrl-C to stop and see the top processes");
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting {}", agent.display()))?;
    let status = with_sigint_ignored(|| child.wait())?;
    if !status.success() {
        bail!("the agent exited with {status}");
    }
    Ok(())
}

fn test() -> anyhow::Result<()> {
    setup::ensure_all()?;
    require_root("the end-to-end tests load BPF programs")?;
    cargo(&["fmt", "--all", "--", "--check"])
        .context("formatting differs: run `cargo fmt --all`")?;
    // Host crates are the default members; the BPF crate only builds for the
    // BPF target, so it is linted there.
    cargo(&["clippy", "--all-targets", "--", "-D", "warnings"])?;
    run_checked(
        Command::new("cargo")
            .args(["+nightly", "clippy", "--package", "agent-ebpf", "--release"])
            .args(["--target", "bpfel-unknown-none", "-Z", "build-std=core"])
            .args(["--", "-D", "warnings"])
            .current_dir(workspace_root())
            .env_remove("RUSTUP_TOOLCHAIN")
            .env_remove("RUSTC"),
    )?;
    // The end-to-end tests run the agent binary; build it first so they test
    // the current sources.
    cargo(&["build", "--package", "stackscope-agent", "--bins"])?;
    cargo(&["test"])?;
    eprintln!("all tests passed");
    Ok(())
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

/// Runs cargo (the same one that runs xtask) in the workspace root.
pub(crate) fn cargo(args: &[&str]) -> anyhow::Result<()> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(args).current_dir(workspace_root());
    run_checked(&mut cmd)
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
