//! Helpers for stackscope's end-to-end tests: fixture programs compiled from
//! `fixtures/*.c` at test time, processes killed on drop, `/proc/<pid>/maps`
//! lookups, and sampling with the real BPF program for a while.
//!
//! The tests themselves live in `tests/`; they need root and a kernel with BPF.

use std::{
    io::{BufRead as _, BufReader, Read as _},
    path::{Path, PathBuf},
    process::{Child, ChildStdout, Command, Output, Stdio},
    sync::{Mutex, MutexGuard},
    time::Duration,
};

use agent_common::ProcessEvent;
use stackscope_agent::sampler::{
    Sampler, SamplerConfig,
    record::{DecodeError, OwnedSample, Record},
};

/// Fails the test with a clear message unless it runs as root.
pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "end-to-end tests load BPF programs and must run as root (cargo xtask test)"
    );
}

/// Serialises the tests that sample: concurrent runs would compete for the
/// two CPUs and make sample counts depend on scheduling.
pub fn exclusive() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Flags C fixtures are compiled with: optimised code without frame
/// pointers, so only the CFI can unwind it.
pub const C_FLAGS: &[&str] = &["-O2", "-g", "-fomit-frame-pointer"];

/// A temporary directory fixtures are compiled into, removed on drop: a
/// program and the shared libraries it links live side by side.
pub struct BuildDir(tempfile::TempDir);

impl BuildDir {
    pub fn new() -> Self {
        Self(tempfile::tempdir().expect("creating a temporary directory"))
    }

    pub fn path(&self) -> &Path {
        self.0.path()
    }

    /// Runs `compiler <fixtures/sources> <args> -o <dir>/<output>` in this
    /// directory (so `-L.` finds what was built here before) and returns the
    /// output's path. `sources` are file names under `fixtures/`.
    pub fn compile(
        &self,
        compiler: &str,
        sources: &[&str],
        args: &[&str],
        output: &str,
    ) -> PathBuf {
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures");
        let path = self.path().join(output);
        let out = Command::new(compiler)
            .current_dir(self.path())
            .args(sources.iter().map(|source| fixtures.join(source)))
            .args(args)
            .arg("-o")
            .arg(&path)
            .output()
            .unwrap_or_else(|err| panic!("running {compiler}: {err}"));
        assert!(
            out.status.success(),
            "{compiler} failed on {sources:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        path
    }
}

impl Default for BuildDir {
    fn default() -> Self {
        Self::new()
    }
}

/// A fixture program compiled into a temporary directory, removed on drop.
pub struct Fixture {
    pub path: PathBuf,
    _dir: BuildDir,
}

impl Fixture {
    /// Compiles `fixtures/<name>.c` with gcc and [`C_FLAGS`].
    pub fn compile(name: &str) -> Self {
        Self::compile_with(name, "gcc", &[&format!("{name}.c")], C_FLAGS)
    }

    /// Compiles the program `name` from `sources` (file names under
    /// `fixtures/`) with any compiler that takes `-o` (gcc, g++, rustc).
    pub fn compile_with(name: &str, compiler: &str, sources: &[&str], args: &[&str]) -> Self {
        Self::compile_in(BuildDir::new(), name, compiler, sources, args)
    }

    /// Like [`Fixture::compile_with`], into `dir`, next to the libraries
    /// already built there; they are removed with the fixture.
    pub fn compile_in(
        dir: BuildDir,
        name: &str,
        compiler: &str,
        sources: &[&str],
        args: &[&str],
    ) -> Self {
        let path = dir.compile(compiler, sources, args, name);
        Self { path, _dir: dir }
    }

    /// Starts the fixture with an empty environment and waits for it to print
    /// `ready`, i.e. to have built its stack.
    pub fn start(&self, args: &[&str]) -> RunningProcess {
        let mut child = Command::new(&self.path)
            .args(args)
            .env_clear()
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting the fixture");
        let mut stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        let mut line = String::new();
        stdout.read_line(&mut line).expect("reading the fixture");
        assert_eq!(line.trim(), "ready", "fixture did not start");
        RunningProcess {
            child,
            _stdout: Some(stdout),
        }
    }
}

/// A child process killed (and reaped) when dropped, so a failing test never
/// leaves a spinning fixture behind.
pub struct RunningProcess {
    pub child: Child,
    _stdout: Option<BufReader<ChildStdout>>,
}

impl RunningProcess {
    /// Takes charge of an already spawned child.
    pub fn adopt(child: Child) -> Self {
        Self {
            child,
            _stdout: None,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the process to exit on its own and collects its stdout.
    pub fn wait_with_output(&mut self) -> Output {
        let mut stdout = Vec::new();
        if let Some(mut pipe) = self.child.stdout.take() {
            pipe.read_to_end(&mut stdout)
                .expect("reading the child's stdout");
        }
        let status = self.child.wait().expect("waiting for the child");
        Output {
            status,
            stdout,
            stderr: Vec::new(),
        }
    }
}

impl Drop for RunningProcess {
    fn drop(&mut self) {
        // Already reaped children make both calls fail harmlessly.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A cgroup v2 made for one test; on drop, whatever still runs in it is
/// killed and the cgroup removed.
pub struct TempCgroup {
    pub path: PathBuf,
}

impl TempCgroup {
    pub fn create(name: &str) -> Self {
        let mount = stackscope_agent::cgroups::cgroup2_mount().expect("a cgroup2 mount");
        let path = mount.join(format!("stackscope-test-{name}-{}", std::process::id()));
        std::fs::create_dir(&path)
            .unwrap_or_else(|err| panic!("creating {}: {err}", path.display()));
        Self { path }
    }

    /// Moves a process into this cgroup.
    pub fn add(&self, pid: u32) {
        std::fs::write(self.path.join("cgroup.procs"), pid.to_string())
            .expect("moving a process into the cgroup");
    }

    /// This cgroup's path below the hierarchy root, as /proc/<pid>/cgroup shows it.
    pub fn relative_path(&self) -> String {
        let name = self.path.file_name().expect("cgroup directory name");
        format!("/{}", name.to_string_lossy())
    }
}

impl Drop for TempCgroup {
    fn drop(&mut self) {
        let procs = std::fs::read_to_string(self.path.join("cgroup.procs")).unwrap_or_default();
        for pid in procs
            .lines()
            .filter_map(|line| line.trim().parse::<i32>().ok())
        {
            // SAFETY: kill(2) on processes this test put in its own cgroup.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        // The cgroup is busy until its last process has been reaped.
        for _ in 0..100 {
            if std::fs::remove_dir(&self.path).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!("could not remove test cgroup {}", self.path.display());
    }
}

/// One line of `/proc/<pid>/maps`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    pub perms: String,
    pub path: String,
}

impl Mapping {
    pub fn contains(&self, addr: u64) -> bool {
        (self.start..self.end).contains(&addr)
    }
}

pub fn read_maps(pid: u32) -> Vec<Mapping> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("reading maps");
    maps.lines()
        .map(|line| {
            let mut fields = line.split_whitespace();
            let range = fields.next().expect("address range");
            let perms = fields.next().expect("permissions").to_string();
            let path = fields.nth(3).unwrap_or_default().to_string();
            let (start, end) = range.split_once('-').expect("start-end");
            Mapping {
                start: u64::from_str_radix(start, 16).expect("hex start"),
                end: u64::from_str_radix(end, 16).expect("hex end"),
                perms,
                path,
            }
        })
        .collect()
}

/// What a sampling run read from the ring buffer.
#[derive(Debug, Default)]
pub struct Recorded {
    pub samples: Vec<OwnedSample>,
    pub execs: Vec<ProcessEvent>,
    pub exits: Vec<ProcessEvent>,
    pub decode_errors: Vec<DecodeError>,
}

/// Runs the real sampler for `duration` and returns every record it read.
pub fn sample_for(config: &SamplerConfig, duration: Duration) -> Recorded {
    sample_while(config, duration, || {})
}

/// Like [`sample_for`], calling `during` once the sampler is attached.
pub fn sample_while(config: &SamplerConfig, duration: Duration, during: impl FnOnce()) -> Recorded {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async {
        let mut sampler = Sampler::start(config).expect("starting the sampler");
        let mut recorded = Recorded::default();
        let mut keep = |bytes: &[u8]| match Record::decode(bytes) {
            Ok(Record::Sample(sample)) => recorded.samples.push(sample.to_owned_sample()),
            Ok(Record::Exec(event)) => recorded.execs.push(event),
            Ok(Record::Exit(event)) => recorded.exits.push(event),
            Err(err) => recorded.decode_errors.push(err),
        };
        let deadline = tokio::time::Instant::now() + duration;
        during();
        loop {
            tokio::select! {
                read = sampler.read_records(&mut keep) => { read.expect("reading the ring buffer"); }
                _ = tokio::time::sleep_until(deadline) => break,
            }
        }
        sampler.drain_records(&mut keep);
        assert!(recorded.decode_errors.is_empty(), "malformed records: {:?}", recorded.decode_errors);
        recorded
    })
}

/// The kernel's symbol table from `/proc/kallsyms`, sorted by address.
pub fn kernel_symbols() -> Vec<(u64, String)> {
    let kallsyms = std::fs::read_to_string("/proc/kallsyms").expect("reading /proc/kallsyms");
    let mut symbols: Vec<(u64, String)> = kallsyms
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let addr = u64::from_str_radix(fields.next()?, 16).ok()?;
            let name = fields.nth(1)?;
            (addr != 0).then(|| (addr, name.to_string()))
        })
        .collect();
    assert!(
        !symbols.is_empty(),
        "/proc/kallsyms shows no addresses (kptr_restrict?)"
    );
    symbols.sort();
    symbols
}

/// The symbol whose range holds `addr`, from a sorted [`kernel_symbols`] table.
pub fn kernel_symbol(symbols: &[(u64, String)], addr: u64) -> Option<&str> {
    let at = symbols.partition_point(|(start, _)| *start <= addr);
    at.checked_sub(1).map(|i| symbols[i].1.as_str())
}

/// Positions of 8-aligned occurrences of `word` in `bytes`.
pub fn find_word(bytes: &[u8], word: u64) -> impl Iterator<Item = usize> + '_ {
    bytes
        .chunks_exact(8)
        .enumerate()
        .filter(move |(_, chunk)| u64::from_ne_bytes((*chunk).try_into().unwrap()) == word)
        .map(|(i, _)| i * 8)
}
