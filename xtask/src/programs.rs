//! `cargo xtask bench programs`: the product on real programs, the way a user
//! meets it. Each program (Debian's python3, node, sqlite3, xz, gcc and rustc,
//! a Go program and a deep C fixture) runs in a cgroup of its own; the release
//! agent samples only that cgroup for a while and ships to a release
//! collector; the report says, per program, what share of samples unwound to
//! the root (and how many of those through a stack tail), what share were cut
//! short, and what share of their frames carry a name in the collector. The
//! Python rows run the same program on each CPython installed (Debian's and
//! pyenv's) and say what share of samples name its Python function; the
//! java row runs a chain of Java methods on Debian's OpenJDK, as services
//! start it (no flag), and says the share naming its hot method. The agent's
//! CPU per sample is its whole run's (start-up included) over its walks.
//!
//! A report, not a test: the figures depend on the machine and its load.
//! The short-lived programs (gcc, rustc) are loops of compiler runs, which is
//! where the first samples of every new process count most.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, bail};
use stackscope_test_fixtures::free_port;

use crate::{
    KillOnDrop,
    bench::{Cgroup, cgroup2_mount, compile_fixture_in, remove_cgroup, stop_child},
    build_binaries, run_checked, wait_for_listener, workspace_root,
};

/// Sampling frequency of each agent run.
const HZ: &str = "199";
/// How long a program runs before the agent starts (its start-up is not
/// what is measured).
const WARM_UP: Duration = Duration::from_secs(2);

/// One program: a shell script that keeps it busy until killed.
struct Program {
    name: &'static str,
    script: String,
    /// A function of the program's own (not of its runtime) that most of
    /// its samples should show: for a Python program, its hot Python
    /// function, which without Python frames no sample carries.
    own_function: Option<&'static str>,
}

/// The CPython interpreters the Python rows run, besides Debian's
/// `python3`: pyenv's builds, those installed.
const PYENV_PYTHONS: &[(&str, &str)] = &[
    ("py3.10-pyenv", "3.10.13/bin/python3.10"),
    ("py3.11-pyenv", "3.11.7/bin/python3.11"),
    ("py3.12-pyenv", "3.12.1/bin/python3.12"),
    ("py3.13-pyenv", "3.13.0/bin/python3.13"),
];

/// The Java row's hot method (tests/fixtures/Chain.java), inlined into its
/// callers by C2: named through the compiled methods' scopes.
const JAVA_METHOD: &str = "Chain.leaf";

/// The Python programs' hot function (see `PYTHON_WORK`).
const PYTHON_FUNCTION: &str = "work";

/// What every Python row runs: JSON and regular expressions (C code)
/// called from a Python function.
const PYTHON_WORK: &str = "import json, re\n\
    def work(n):\n    return [re.sub('[0-9]', 'x', json.dumps({'k': i, 'v': [i] * 20})) for i in range(n)]\n\
    while True:\n    work(2000)\n";

pub fn run(seconds: u64, only: &[String]) -> anyhow::Result<()> {
    if seconds == 0 {
        bail!("--seconds must be at least 1");
    }
    let release = build_binaries(true)?;
    let scratch = Scratch::new()?;
    let mut programs = programs(&scratch.dir)?;
    if let Some(unknown) = only
        .iter()
        .find(|name| !programs.iter().any(|program| program.name == name.as_str()))
    {
        let known: Vec<&str> = programs.iter().map(|program| program.name).collect();
        bail!("no program named {unknown:?} (known: {})", known.join(", "));
    }
    if !only.is_empty() {
        programs.retain(|program| only.iter().any(|name| name == program.name));
    }

    let grpc = format!("127.0.0.1:{}", free_port());
    let http = format!("127.0.0.1:{}", free_port());
    let mut collector = KillOnDrop(
        Command::new(release.join("stackscope-collector"))
            .arg("--data-dir")
            .arg(scratch.dir.join("data"))
            .args(["--grpc-listen", &grpc, "--http-listen", &http])
            .args(["--log-level", "warn"])
            .stdout(Stdio::null())
            .spawn()
            .context("starting the collector")?,
    );
    wait_for_listener(&grpc, &mut collector.0)?;

    println!(
        "{:<12} {:>8} {:>10} {:>12} {:>10} {:>12} {:>16} {:>18}",
        "program",
        "samples",
        "to root",
        "(via tail)",
        "truncated",
        "frames named",
        "agent µs/sample",
        "own function"
    );
    for program in &programs {
        let cgroup = scratch.cgroup(program.name)?;
        let _load = Load::start(&program.script, &cgroup.0, &scratch.dir)?;
        std::thread::sleep(WARM_UP);
        let node = format!("programs-{}", program.name);
        let report = agent_run(&release, &grpc, &cgroup.0, &node, seconds)?;
        let shipped = shipped_names(&release, &grpc, &node, program.own_function)?;
        let share = |n: u64| 100.0 * n as f64 / report.walks.max(1) as f64;
        let own = match (program.own_function, shipped.own_function) {
            (Some(function), Some(share)) => format!("{share:.1}% {function}"),
            _ => "-".into(),
        };
        println!(
            "{:<12} {:>8} {:>9.1}% {:>11.1}% {:>9.1}% {:>11.1}% {:>16.1} {:>18}",
            program.name,
            report.walks,
            share(report.outermost),
            share(report.stitched),
            share(report.truncated),
            shipped.frames_named,
            report.agent_cpu.as_secs_f64() * 1e6 / report.walks.max(1) as f64,
            own,
        );
    }
    println!(
        "({seconds} s per program at {HZ} Hz; 'via tail': walks that reached the root through \
         a stack tail; frames named: of every frame in the collector, kernel frames included; \
         own function: the samples in the collector that carry it)"
    );
    Ok(())
}

fn programs(scratch: &Path) -> anyhow::Result<Vec<Program>> {
    let fixtures = workspace_root().join("tests/fixtures");
    let fixture = |name: &str| fixtures.join(name).display().to_string();
    let deep = compile_fixture_in("deep_frames", scratch)?;
    let go = scratch.join("go_chain");
    run_checked(
        Command::new("go")
            .args(["build", "-ldflags=-s -w", "-o"])
            .arg(&go)
            .arg(fixture("go_chain.go"))
            .env("GO111MODULE", "off")
            .env("GOCACHE", scratch.join("go-cache")),
    )
    .context("building the Go program (stripped, as Go services ship)")?;
    let input = scratch.join("xz-input");
    std::fs::write(
        &input,
        (0..1_500_000u32)
            .map(|n| format!("{n}\n"))
            .collect::<String>(),
    )
    .context("writing xz's input")?;
    let python = |program: &str| Program {
        name: "",
        script: format!("exec {program} -c \"{PYTHON_WORK}\""),
        own_function: Some(PYTHON_FUNCTION),
    };
    let mut programs = vec![Program {
        name: "python3",
        ..python("python3")
    }];
    for (name, version) in PYENV_PYTHONS {
        let program = Path::new("/root/.pyenv/versions").join(version);
        if program.exists() {
            programs.push(Program {
                name,
                ..python(&program.display().to_string())
            });
        } else {
            println!("{name}: skipped, {} is not installed", program.display());
        }
    }
    let java_classes = scratch.join("java");
    run_checked(
        Command::new("javac")
            // Its own JVM would leave /tmp/hsperfdata_<user> behind.
            .arg("-J-XX:-UsePerfData")
            .args(["--release", "17", "-d"])
            .arg(&java_classes)
            .arg(fixture("Chain.java")),
    )
    .context("compiling the Java program (openjdk-17-jdk-headless)")?;
    programs.extend([
        Program {
            name: "java",
            script: format!(
                "exec java -cp {} Chain 1000000000 0",
                java_classes.display()
            ),
            own_function: Some(JAVA_METHOD),
        },
        Program {
            name: "node",
            script: format!("exec node --perf-basic-prof {}", fixture("json_runtime.js")),
            own_function: None,
        },
        Program {
            name: "sqlite3",
            script: "while :; do sqlite3 :memory: 'WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL \
                     SELECT x + 1 FROM c WHERE x < 3000000) SELECT sum(x) FROM c;' >/dev/null; done"
                .into(),
            own_function: None,
        },
        Program {
            name: "xz",
            script: format!(
                "while :; do xz -6 -T1 -c {} >/dev/null; done",
                input.display()
            ),
            own_function: None,
        },
        Program {
            name: "go",
            script: format!("exec {} 2", go.display()),
            own_function: None,
        },
        Program {
            name: "deep C",
            script: format!("exec {} 1048576 262144 65536", deep.display()),
            own_function: None,
        },
        Program {
            name: "gcc",
            script: format!(
                "while :; do gcc -O2 -c -o /dev/null {}; done",
                fixture("many_functions.c")
            ),
            own_function: None,
        },
        Program {
            name: "rustc",
            script: format!(
                "while :; do rustc -O -o {} {}; done",
                scratch.join("rust_chain").display(),
                fixture("rust_chain.rs")
            ),
            own_function: None,
        },
    ]);
    Ok(programs)
}

/// What one agent run reported.
struct Walks {
    walks: u64,
    outermost: u64,
    stitched: u64,
    truncated: u64,
    /// The agent's CPU time (user and system), start-up included.
    agent_cpu: Duration,
}

/// The CPU time of this process's children waited for so far.
fn children_cpu() -> Duration {
    // SAFETY: getrusage writes one struct rusage, which we own.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage);
        usage
    };
    let time = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    time(usage.ru_utime) + time(usage.ru_stime)
}

fn agent_run(
    release: &Path,
    grpc: &str,
    cgroup: &Path,
    node: &str,
    seconds: u64,
) -> anyhow::Result<Walks> {
    let mut command = Command::new(release.join("stackscope-agent"));
    command
        .arg("--cgroup")
        .arg(cgroup)
        .args([
            "--collector",
            &format!("http://{grpc}"),
            "--node-name",
            node,
        ])
        .args(["--frequency", HZ, "--duration", &format!("{seconds}s")])
        .args(["--json", "--log-level", "warn", "--status-interval", "1h"])
        .stderr(Stdio::inherit());
    let cpu_before = children_cpu();
    let out = command
        .output()
        .with_context(|| format!("running {command:?}"))?;
    let agent_cpu = children_cpu().saturating_sub(cpu_before);
    if !out.status.success() {
        bail!("{command:?} failed with {}", out.status);
    }
    let report: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("the agent's --json report")?;
    let field = |name: &str| {
        report["unwinding"][name]
            .as_u64()
            .with_context(|| format!("no unwinding.{name} in the agent's report"))
    };
    Ok(Walks {
        walks: field("walks")?,
        outermost: field("outermost")?,
        stitched: field("stitched")?,
        truncated: field("truncated")?,
        agent_cpu,
    })
}

/// What `node` shipped, from the collector's folded export.
struct Shipped {
    /// The share of frames with a name (an unnamed frame reads
    /// `[unknown] file+0x..`).
    frames_named: f64,
    /// The share of samples that carry the program's own function, when
    /// it has one.
    own_function: Option<f64>,
}

fn shipped_names(
    release: &Path,
    grpc: &str,
    node: &str,
    own_function: Option<&str>,
) -> anyhow::Result<Shipped> {
    let mut command = Command::new(release.join("stackscope"));
    command
        .args(["--collector", &format!("http://{grpc}")])
        .args(["export", "--format", "folded", "--since", "1h"])
        .args(["--match", &format!("node=\"{node}\"")]);
    let out = command
        .output()
        .with_context(|| format!("running {command:?}"))?;
    if !out.status.success() {
        bail!(
            "{command:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let (mut frames, mut named, mut samples, mut own) = (0u64, 0u64, 0u64, 0u64);
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some((stack, count)) = line.rsplit_once(' ') else {
            continue;
        };
        let count: u64 = count.parse().context("a folded line's count")?;
        samples += count;
        if own_function.is_some_and(|function| stack.split(';').any(|frame| frame == function)) {
            own += count;
        }
        for frame in stack.split(';') {
            frames += count;
            if !frame.starts_with("[unknown]") {
                named += count;
            }
        }
    }
    let share = |part: u64, whole: u64| 100.0 * part as f64 / whole.max(1) as f64;
    Ok(Shipped {
        frames_named: share(named, frames),
        own_function: own_function.map(|_| share(own, samples)),
    })
}

/// The bench's temporary directory and cgroups, removed on drop.
struct Scratch {
    dir: PathBuf,
    cgroup_parent: PathBuf,
}

impl Scratch {
    fn new() -> anyhow::Result<Self> {
        let id = std::process::id();
        let dir = std::env::temp_dir().join(format!("stackscope-programs-{id}"));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let cgroup_parent = cgroup2_mount()?.join(format!("stackscope-programs-{id}"));
        std::fs::create_dir(&cgroup_parent)
            .with_context(|| format!("creating cgroup {}", cgroup_parent.display()))?;
        Ok(Self { dir, cgroup_parent })
    }

    fn cgroup(&self, program: &str) -> anyhow::Result<Cgroup> {
        Cgroup::create(self.cgroup_parent.join(program.replace(' ', "-")))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        remove_cgroup(&self.cgroup_parent);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A program's shell script, started in its cgroup (before it runs
/// anything: it waits for a line on stdin) and stopped on drop.
struct Load {
    child: Child,
}

impl Load {
    fn start(script: &str, cgroup: &Path, dir: &Path) -> anyhow::Result<Self> {
        use std::io::Write as _;
        // `read` holds the shell until it is in the cgroup, so every
        // process of the program starts there.
        let child = Command::new("bash")
            .args(["-c", &format!("read -r _; {script}")])
            .current_dir(dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .context("starting bash")?;
        let mut load = Self { child };
        std::fs::write(cgroup.join("cgroup.procs"), load.child.id().to_string())
            .with_context(|| format!("moving the program into {}", cgroup.display()))?;
        writeln!(load.child.stdin.take().context("bash's stdin")?)
            .context("starting the program")?;
        Ok(load)
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        // Not killed outright: the shell may have exec'd the program (a
        // JVM, which then leaves its /tmp/hsperfdata file behind).
        stop_child(&mut self.child);
        // node's perf map, named by the pid it ran as (it exec'd the shell).
        let _ = std::fs::remove_file(format!("/tmp/perf-{}.map", self.child.id()));
    }
}
