//! Test-only helpers shared by the end-to-end tests (`tests/`) and the
//! unwinder's offline tests and benchmarks (`unwind/`): fixture programs
//! compiled from the workspace's `tests/fixtures/` at test time (never
//! checked-in binaries), child processes killed on drop, naming code
//! addresses with an ELF file's own function symbols, and programs split
//! into a stripped binary and a debug file.
//!
//! It owns no knowledge of stackscope itself: what a test samples, unwinds
//! or asserts stays in the test.

use std::{
    io::{BufRead as _, BufReader, Read as _},
    path::{Path, PathBuf},
    process::{Child, ChildStdout, Command, Output, Stdio},
};

use object::{Object as _, ObjectSymbol as _, SymbolKind};
use stackscope_symbolize::demangle;

pub mod batches;
pub mod containers;
pub mod split_debug;
pub mod tls;

/// Flags C fixtures are built with: optimised code without frame pointers,
/// so only the CFI can unwind it.
pub const C_FLAGS: &[&str] = &["-O2", "-fomit-frame-pointer"];

/// Fails the test with a clear message unless it runs as root; `why` says
/// what needs it.
pub fn require_root(why: &str) {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(euid, 0, "{why}: run as root (cargo xtask test)");
}

/// A binary of this workspace (`stackscope-agent`, `stackscope-collector`,
/// `stackscope`) from the same target profile as the running test: the test
/// binary lives in target/<profile>/deps, the binaries in target/<profile>.
/// `cargo xtask test` builds them before the tests.
pub fn workspace_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let binary = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>")
        .join(name);
    assert!(
        binary.exists(),
        "{} is missing: run `cargo xtask test`, or build it first \
         (`cargo build -p stackscope-agent -p stackscope-collector --bins`)",
        binary.display()
    );
    binary
}

/// The workspace's fixture sources.
fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

/// The source file `name` under `tests/fixtures/` (a script run as it is).
pub fn fixture_source(name: &str) -> PathBuf {
    fixtures_dir().join(name)
}

/// A temporary directory fixtures are compiled into, removed on drop: a
/// program and the shared libraries it links live side by side.
pub struct BuildDir(tempfile::TempDir);

impl Default for BuildDir {
    fn default() -> Self {
        Self::new()
    }
}

impl BuildDir {
    pub fn new() -> Self {
        Self(tempfile::tempdir().expect("creating a temporary directory"))
    }

    pub fn path(&self) -> &Path {
        self.0.path()
    }

    /// Runs `compiler <sources> <args> -o <dir>/<output>` in this directory
    /// (so `-L.` finds what was built here before) and returns the output's
    /// path. `sources` are file names under `tests/fixtures/`, placed first
    /// so that `-l` options follow the objects that need them.
    pub fn compile(
        &self,
        compiler: &str,
        sources: &[&str],
        args: &[&str],
        output: &str,
    ) -> PathBuf {
        let fixtures = fixtures_dir();
        let path = self.path().join(output);
        let cached = RunCache::from_env().map(|cache| {
            let key = cache.key(compiler, sources, args, output);
            (cache, key)
        });
        if let Some((cache, key)) = &cached
            && cache.copy_out(key, &path)
        {
            return path;
        }
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
        if let Some((cache, key)) = &cached {
            cache.keep(key, &path);
        }
        path
    }
}

/// Fixtures already compiled in this test run, shared between test
/// binaries and with the kernel matrix's virtual machines, which see the
/// host's files: under qemu without KVM one gcc run takes 4 s and rustc
/// 16 s, most of those machines' time. `cargo xtask test` empties the
/// directory named by [`RunCache::ENV`] when it starts, so every fixture
/// is still compiled from source in every run, once.
struct RunCache {
    dir: PathBuf,
}

impl RunCache {
    const ENV: &str = "STACKSCOPE_FIXTURE_CACHE";

    fn from_env() -> Option<Self> {
        let dir = PathBuf::from(std::env::var_os(Self::ENV)?);
        dir.is_dir().then_some(Self { dir })
    }

    /// What the output depends on: the command and the sources' bytes
    /// (a path in `args`, such as an rpath into a temporary directory,
    /// makes the key that build's alone). The hash is the same in every
    /// process running the same test binary.
    fn key(&self, compiler: &str, sources: &[&str], args: &[&str], output: &str) -> String {
        use std::hash::{DefaultHasher, Hash as _, Hasher as _};
        let mut hasher = DefaultHasher::new();
        (compiler, sources, args, output).hash(&mut hasher);
        for source in sources {
            std::fs::read(fixtures_dir().join(source))
                .unwrap_or_default()
                .hash(&mut hasher);
        }
        format!("{output}-{:016x}", hasher.finish())
    }

    /// Copies the cached build of `key` to `path`; false when there is none.
    /// The copy is made by `cp`, as gcc writes its output, in a process of
    /// its own: a file this process wrote could be held open for writing by
    /// a child another test thread forked meanwhile, and running it would
    /// then fail with ETXTBSY (a whole-suite run saw it).
    fn copy_out(&self, key: &str, path: &Path) -> bool {
        let cached = self.dir.join(key);
        cached.is_file()
            && Command::new("cp")
                .arg(&cached)
                .arg(path)
                .status()
                .is_ok_and(|status| status.success())
    }

    /// Keeps a copy of `path` as `key`, atomically (tests compile in
    /// parallel). Best effort: a guest may see the directory read-only.
    fn keep(&self, key: &str, path: &Path) {
        let Ok(partial) = tempfile::NamedTempFile::new_in(&self.dir) else {
            return;
        };
        if std::fs::copy(path, partial.path()).is_ok() {
            let _ = partial.persist(self.dir.join(key));
        }
    }
}

/// A fixture program compiled into a temporary directory, removed on drop.
pub struct Fixture {
    pub path: PathBuf,
    dir: BuildDir,
}

impl Fixture {
    /// Compiles `tests/fixtures/<name>.c` with gcc, [`C_FLAGS`] and `extra`.
    pub fn compile(name: &str, extra: &[&str]) -> Self {
        let args = [C_FLAGS, extra].concat();
        Self::compile_with(name, "gcc", &[&format!("{name}.c")], &args)
    }

    /// Compiles the program `name` from `sources` (under `tests/fixtures/`)
    /// with any compiler that takes `-o` (gcc, g++, rustc) and exactly `args`.
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
        Self { path, dir }
    }

    /// `call_chain.c` as a static-pie: libc's start code in the one binary.
    pub fn static_pie_call_chain() -> Self {
        let args = [C_FLAGS, &["-static-pie"]].concat();
        Self::compile_with("call_chain", "gcc", &["call_chain.c"], &args)
    }

    /// `template_chain.cpp`: C++ templates spinning inside a `try` block.
    pub fn cpp_template_chain() -> Self {
        Self::compile_with("template_chain", "g++", &["template_chain.cpp"], C_FLAGS)
    }

    /// `rust_chain.rs`: a Rust program built without frame pointers.
    pub fn rust_chain() -> Self {
        Self::rust("rust_chain")
    }

    /// `deep_rust.rs`: a Rust thread with a 16 MiB stack recursing through
    /// 4 KiB frames, built without frame pointers.
    pub fn deep_rust() -> Self {
        Self::rust("deep_rust")
    }

    /// `tests/fixtures/<name>.go` built with the installed Go toolchain
    /// (`go build`, no cgo, offline: its build cache in the build
    /// directory, the standard library only), with `build_args` added
    /// (`-ldflags=-s -w`: stripped of symbols and DWARF, as Go services
    /// usually ship; `-buildmode=pie`).
    pub fn go(name: &str, build_args: &[&str]) -> Self {
        let dir = BuildDir::new();
        let path = dir.path().join(name);
        let out = Command::new("go")
            .current_dir(dir.path())
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", dir.path())
            .env("GOCACHE", dir.path().join("gocache"))
            .env("GOPATH", dir.path().join("gopath"))
            .env("GO111MODULE", "off")
            .env("CGO_ENABLED", "0")
            .arg("build")
            .args(build_args)
            .arg("-o")
            .arg(&path)
            .arg(fixtures_dir().join(format!("{name}.go")))
            .output()
            .unwrap_or_else(|err| panic!("running go (Debian's golang-go): {err}"));
        assert!(
            out.status.success(),
            "go build failed on {name}.go: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Self { path, dir }
    }

    /// `<name>.rs` built optimised, without frame pointers or debuginfo.
    fn rust(name: &str) -> Self {
        let args = [
            "--crate-name",
            name,
            "-O",
            "-C",
            "force-frame-pointers=no",
            "-C",
            "debuginfo=0",
        ];
        Self::compile_with(name, "rustc", &[&format!("{name}.rs")], &args)
    }

    /// `dlopen_call.c`, which `dlopen`s `libspin.so` built next to it.
    pub fn dlopen_call() -> Self {
        Self::compile_in(
            spin_library(),
            "dlopen_call",
            "gcc",
            &["dlopen_call.c"],
            C_FLAGS,
        )
    }

    /// `plt_call.c`, linked against `libspin.so` built next to it and
    /// calling into it through the PLT.
    pub fn plt_call() -> Self {
        let dir = spin_library();
        let rpath = format!("-Wl,-rpath,{}", dir.path().display());
        let args = [C_FLAGS, &["-L.", "-lspin", &rpath]].concat();
        Self::compile_in(dir, "plt_call", "gcc", &["plt_call.c"], &args)
    }

    /// The directory the fixture was built in.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Starts the fixture with an empty environment and waits for it to
    /// print `ready`, i.e. to have reached its final spin loop.
    pub fn start(&self, args: &[&str]) -> RunningProcess {
        self.start_command(Command::new(&self.path).args(args))
    }

    /// [`Self::start`] with address space randomisation off: every run of
    /// a fixture, and fixtures of the same size, map at the same addresses.
    pub fn start_without_aslr(&self, args: &[&str]) -> RunningProcess {
        use std::os::unix::process::CommandExt as _;
        let mut command = Command::new(&self.path);
        command.args(args);
        // SAFETY: personality(2) only changes this child's exec behaviour
        // and is async-signal-safe.
        unsafe {
            command.pre_exec(|| {
                libc::personality(libc::ADDR_NO_RANDOMIZE as libc::c_ulong);
                Ok(())
            });
        }
        self.start_command(&mut command)
    }

    fn start_command(&self, command: &mut Command) -> RunningProcess {
        RunningProcess::start_ready(command.env_clear())
    }
}

/// A new build directory holding `libspin.so` (from `spin_lib.c`), which the
/// dlopen and PLT fixtures call into.
fn spin_library() -> BuildDir {
    let dir = BuildDir::new();
    let args = [&["-shared", "-fPIC"], C_FLAGS].concat();
    dir.compile("gcc", &["spin_lib.c"], &args, "libspin.so");
    dir
}

/// A child process killed (and reaped) when dropped, so a failing test never
/// leaves a spinning fixture behind.
pub struct RunningProcess {
    pub child: Child,
    stdout: Option<BufReader<ChildStdout>>,
}

impl RunningProcess {
    /// Takes charge of an already spawned child.
    pub fn adopt(child: Child) -> Self {
        Self {
            child,
            stdout: None,
        }
    }

    /// Starts `command` and waits for it to print `ready` (a fixture that
    /// has reached its final loop).
    pub fn start_ready(command: &mut Command) -> Self {
        let mut child = command
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting the fixture");
        let stdout = child.stdout.take().expect("piped stdout");
        // Adopted before reading, so a fixture that fails to start is still reaped.
        let mut running = RunningProcess::adopt(child);
        let mut stdout = BufReader::new(stdout);
        let mut line = String::new();
        stdout.read_line(&mut line).expect("reading the fixture");
        assert_eq!(line.trim(), "ready", "fixture did not start");
        // Kept open so the fixture never writes to a closed pipe.
        running.stdout = Some(stdout);
        running
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The ids of the process's threads other than the main one.
    pub fn other_threads(&self) -> Vec<u32> {
        let pid = self.pid();
        let mut tids: Vec<u32> = std::fs::read_dir(format!("/proc/{pid}/task"))
            .expect("listing the process's threads")
            .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
            .filter(|&tid| tid != pid)
            .collect();
        tids.sort_unstable();
        tids
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
        // SIGKILL works on a ptrace-stopped process too; both calls fail
        // harmlessly if the child is already gone.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The function symbols of one ELF file, by file virtual address.
pub struct ElfSymbols {
    /// `(start, end, name)`, sorted by start.
    symbols: Vec<(u64, u64, String)>,
}

impl ElfSymbols {
    /// `.symtab` and the exported `.dynsym` of `data` (stripped libraries,
    /// like Debian's libc, still export theirs).
    pub fn parse(data: &[u8]) -> Self {
        let file = object::File::parse(data).expect("parsing an ELF file");
        let mut symbols: Vec<(u64, u64, String)> = file
            .symbols()
            .chain(file.dynamic_symbols())
            .filter(|symbol| symbol.kind() == SymbolKind::Text && symbol.size() > 0)
            .filter_map(|symbol| {
                let name = symbol.name().ok()?.to_owned();
                Some((symbol.address(), symbol.address() + symbol.size(), name))
            })
            .collect();
        symbols.sort();
        Self { symbols }
    }

    pub fn read(path: &Path) -> Self {
        let data =
            std::fs::read(path).unwrap_or_else(|err| panic!("reading {}: {err}", path.display()));
        Self::parse(&data)
    }

    /// The function containing `address`, demangled. Aliases (static
    /// glibc's `__libc_start_main` and `__libc_start_main_impl`) cover the
    /// same range: the shortest name wins, usually the public one.
    pub fn name_at(&self, address: u64) -> Option<String> {
        let candidates = self
            .symbols
            .partition_point(|&(start, _, _)| start <= address);
        self.symbols[..candidates]
            .iter()
            .filter(|&&(_, end, _)| address < end)
            .map(|(_, _, name)| name.as_str())
            .min_by_key(|name| (name.len(), *name))
            .map(demangle)
    }

    /// The address of the function `name` (as spelled in the file).
    pub fn address_of(&self, name: &str) -> Option<u64> {
        self.symbols
            .iter()
            .find(|(_, _, symbol)| symbol == name)
            .map(|&(start, _, _)| start)
    }
}

/// The file offset of symbol `name` (plus `delta`) in the ELF file at
/// `path`: where a symbolizer that reads by file offset looks it up.
pub fn symbol_file_offset(path: &Path, name: &str, delta: u64) -> u64 {
    use object::ObjectSegment as _;
    let data =
        std::fs::read(path).unwrap_or_else(|err| panic!("reading {}: {err}", path.display()));
    let elf = object::File::parse(&*data).expect("parsing an ELF file");
    let vaddr = elf
        .symbols()
        .find(|symbol| symbol.name() == Ok(name))
        .unwrap_or_else(|| panic!("no symbol {name}"))
        .address()
        + delta;
    let segment = elf
        .segments()
        .find(|s| (s.address()..s.address() + s.size()).contains(&vaddr))
        .expect("a segment holding the symbol");
    vaddr - segment.address() + segment.file_range().0
}

/// A port nothing listens on now (for servers that cannot be told to pick
/// one and say which).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port()
}

/// `GET path` on `address` (`host:port`) over plain HTTP/1.0: the status
/// and the body, if it answers within a few seconds.
pub fn http_get(address: &str, path: &str) -> Option<(u16, String)> {
    http_request(address, "GET", path, b"")
}

/// `POST path` with `body` on `address` over plain HTTP/1.0, as
/// [`http_get`].
pub fn http_post(address: &str, path: &str, body: &[u8]) -> Option<(u16, String)> {
    http_request(address, "POST", path, body)
}

fn http_request(address: &str, method: &str, path: &str, body: &[u8]) -> Option<(u16, String)> {
    use std::io::{Read as _, Write as _};
    let mut stream = std::net::TcpStream::connect(address).ok()?;
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .ok()?;
    write!(
        stream,
        "{method} {path} HTTP/1.0\r\nHost: {address}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .ok()?;
    stream.write_all(body).ok()?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).ok()?;
    let response = String::from_utf8_lossy(&response);
    let status = response.get(9..12)?.parse().ok()?;
    let body = response.split_once("\r\n\r\n").map_or("", |(_, body)| body);
    Some((status, body.to_string()))
}

/// The value of one series (`name{labels}` exactly as exposed) in a
/// Prometheus text exposition.
pub fn metric_value(exposition: &str, series: &str) -> Option<f64> {
    exposition.lines().find_map(|line| {
        line.strip_prefix(series)?
            .strip_prefix(' ')?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    })
}

/// The value of one series on the `/metrics` endpoint at `address`
/// (`host:port`); `None` if it does not answer 200 or lacks the series.
pub fn metric(address: &str, series: &str) -> Option<f64> {
    match http_get(address, "/metrics")? {
        (200, body) => metric_value(&body, series),
        _ => None,
    }
}

/// The high-water mark of a live process's resident memory (`VmHWM`, its
/// own since its exec), in KiB; `None` once it is gone. Not `wait4`'s
/// `ru_maxrss`: a child that exec'd keeps the high-water mark its parent
/// held at the fork.
pub fn peak_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    stackscope_telemetry::status_kib(&status, "VmHWM:")
}

/// Every JDK home under /usr/lib/jvm with `bin/java` and `bin/jcmd`, one
/// per real directory (Debian's `java-17-openjdk-amd64` and its
/// `java-1.17.0-openjdk-amd64` link are one); says so when there is none.
pub fn jdk_homes() -> Vec<PathBuf> {
    let mut homes: Vec<PathBuf> = std::fs::read_dir("/usr/lib/jvm")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| entry.path().canonicalize().ok())
        .filter(|home| home.join("bin/java").exists() && home.join("bin/jcmd").exists())
        .collect();
    homes.sort();
    homes.dedup();
    if homes.is_empty() {
        eprintln!(
            "skipped: no JDK under /usr/lib/jvm (`cargo xtask setup` installs openjdk-17-jdk-headless)"
        );
    }
    homes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peak_rss_of_this_process_is_at_least_its_rss() {
        // One read of both: the kernel's RSS counters are batched per
        // CPU, so two reads can see the resident size shrink a little.
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let now = stackscope_telemetry::status_kib(&status, "VmRSS:").unwrap();
        let peak = stackscope_telemetry::status_kib(&status, "VmHWM:").unwrap();
        assert!(peak >= now && now > 0, "VmHWM {peak} KiB, VmRSS {now} KiB");
        assert!(peak_rss_kib(std::process::id()).is_some_and(|peak| peak > 0));
        assert_eq!(peak_rss_kib(u32::MAX), None);
    }

    #[test]
    fn metric_values_are_read_by_their_whole_series() {
        let text = "# TYPE a counter\na_total 3\na_total_more 5\nb{x=\"1\"} 2.5 1700000000\n";
        assert_eq!(metric_value(text, "a_total"), Some(3.0));
        assert_eq!(metric_value(text, "b{x=\"1\"}"), Some(2.5));
        assert_eq!(metric_value(text, "a"), None);
        assert_eq!(metric_value(text, "c"), None);
    }

    #[test]
    fn names_addresses_of_a_compiled_fixture() {
        let fixture = Fixture::compile("call_chain", &[]);
        let symbols = ElfSymbols::read(&fixture.path);
        let main = symbols.address_of("main").expect("main");
        assert_eq!(symbols.name_at(main).as_deref(), Some("main"));
        assert_eq!(symbols.name_at(0), None);
    }
}
