//! Helpers for the process-table tests: fixtures compiled from
//! `tests/fixtures/*.c` with gcc into temporary directories, processes
//! killed and reaped on drop, and independent readings of ELF files
//! (`object`'s full symbol reader, `readelf -n`) to compare against.

// Each test binary uses a different subset of these helpers.
#![allow(dead_code)]

use std::{
    io::{BufRead as _, BufReader, Write as _},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, ChildStdout, Command, Stdio},
    time::{Duration, Instant},
};

use object::{Object as _, ObjectSymbol as _};

/// Fails the test with a clear message unless it runs as root
/// (`/proc/<pid>/map_files` needs it).
pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "this test opens /proc/<pid>/map_files and must run as root"
    );
}

fn fixture_source(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/{name}.c"))
}

/// Runs gcc on `fixtures/<name>.c` with `args`, writing `out`.
pub fn gcc(name: &str, out: &Path, args: &[&str]) {
    let source = fixture_source(name);
    let output = Command::new("gcc")
        .args(["-O2", "-g"])
        .args(args)
        .arg("-o")
        .arg(out)
        .arg(&source)
        .output()
        .expect("running gcc");
    assert!(
        output.status.success(),
        "gcc {args:?} {} failed: {}",
        source.display(),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// `-Wl,--build-id=...` for an explicit build-id given as hex.
pub fn build_id_flag(hex: &str) -> String {
    format!("-Wl,--build-id=0x{hex}")
}

/// Builds `fixtures/lib.c` as a shared library with `-DVALUE=<value>`.
pub fn build_lib(out: &Path, value: u32, build_id: &str) {
    gcc(
        "lib",
        out,
        &[
            "-shared",
            "-fPIC",
            &format!("-DVALUE={value}"),
            &format!("-Wl,--build-id={build_id}"),
        ],
    );
}

/// Builds `fixtures/target.c` as a PIE with the given build-id (hex).
pub fn build_target(out: &Path, build_id_hex: &str) {
    gcc(
        "target",
        out,
        &["-fPIE", "-pie", &build_id_flag(build_id_hex)],
    );
}

/// The build-id as `readelf -n` prints it, if any.
pub fn readelf_build_id(path: &Path) -> Option<String> {
    let output = Command::new("readelf")
        .arg("-n")
        .arg(path)
        .output()
        .expect("running readelf");
    assert!(
        output.status.success(),
        "readelf -n {} failed",
        path.display()
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .find_map(|line| line.trim().strip_prefix("Build ID: ").map(str::to_owned))
}

/// The value (ELF virtual address) of a symbol in `path`'s symbol table.
pub fn symbol_value(path: &Path, name: &str) -> u64 {
    let data = std::fs::read(path).expect("reading the fixture");
    let file = object::read::elf::ElfFile64::<object::Endianness>::parse(&*data)
        .expect("the fixture is a 64-bit ELF file");
    file.symbols()
        .chain(file.dynamic_symbols())
        .find(|symbol| symbol.name() == Ok(name))
        .unwrap_or_else(|| panic!("{name} not in the symbol table of {}", path.display()))
        .address()
}

/// The file offset holding ELF virtual address `vaddr`, from the segments.
pub fn file_offset_of(path: &Path, vaddr: u64) -> u64 {
    let data = std::fs::read(path).expect("reading the fixture");
    let file = object::read::elf::ElfFile64::<object::Endianness>::parse(&*data)
        .expect("the fixture is a 64-bit ELF file");
    use object::ObjectSegment as _;
    let segment = file
        .segments()
        .find(|segment| (segment.address()..segment.address() + segment.size()).contains(&vaddr))
        .unwrap_or_else(|| panic!("no segment holds {vaddr:#x}"));
    let (file_start, _) = segment.file_range();
    vaddr - segment.address() + file_start
}

/// A running `target` fixture, killed and reaped on drop so a failing test
/// never leaves a process behind.
pub struct Target {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    /// Runtime address of `target_marker`.
    pub marker: u64,
    /// Runtime address of the library's `lib_marker`, if one was loaded.
    pub lib_marker: Option<u64>,
}

impl Target {
    /// Starts `exe` (optionally dlopening `lib`) and waits for "ready".
    pub fn start(exe: &Path, lib: Option<&Path>) -> Self {
        let mut command = Command::new(exe);
        if let Some(lib) = lib {
            command.arg(lib);
        }
        command
            .env_clear()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        // A test thread that just wrote an executable can race a fork in
        // another test thread: the child inherits the write descriptor until
        // it execs, and exec of the file fails with ETXTBSY meanwhile. The
        // window is short; retry rather than fail.
        let mut attempts = 0;
        let mut child = loop {
            match command.spawn() {
                Err(err)
                    if err.kind() == std::io::ErrorKind::ExecutableFileBusy && attempts < 100 =>
                {
                    attempts += 1;
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                result => {
                    break result.unwrap_or_else(|err| panic!("starting {}: {err}", exe.display()));
                }
            }
        };
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        let mut target = Self {
            child,
            stdin,
            stdout,
            marker: 0,
            lib_marker: None,
        };
        target.wait_ready();
        target
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Reads the "ready <marker> <lib_marker>" line.
    fn wait_ready(&mut self) {
        let mut line = String::new();
        self.stdout
            .read_line(&mut line)
            .expect("reading the fixture");
        let mut fields = line.split_whitespace();
        assert_eq!(fields.next(), Some("ready"), "fixture printed {line:?}");
        let mut address = || {
            let field = fields.next().expect("an address");
            u64::from_str_radix(field, 16).expect("a hex address")
        };
        self.marker = address();
        self.lib_marker = Some(address()).filter(|&addr| addr != 0);
    }

    /// Makes the process exec `exe` and waits until the new program is ready.
    pub fn exec(&mut self, exe: &Path) {
        let stdin = self.stdin.as_mut().expect("stdin still open");
        writeln!(stdin, "exec {}", exe.display()).expect("writing the command");
        stdin.flush().expect("flushing the command");
        self.wait_ready();
    }

    /// Closes stdin, so the fixture exits, and reaps it.
    pub fn exit(&mut self) {
        drop(self.stdin.take());
        let status = self.child.wait().expect("waiting for the fixture");
        assert!(status.success(), "fixture exited with {status}");
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        // Both fail harmlessly on an already reaped child.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `[start, end)` of the first line of `/proc/<pid>/maps` whose name is
/// `name`, parsed by hand (not with the crate under test).
pub fn maps_range(pid: u32, name: &str) -> (u64, u64) {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("reading maps");
    let line = maps
        .lines()
        .find(|line| line.split_whitespace().nth(5) == Some(name))
        .unwrap_or_else(|| panic!("no {name} in\n{maps}"));
    let range = line.split_whitespace().next().expect("range");
    let (start, end) = range.split_once('-').expect("start-end");
    (
        u64::from_str_radix(start, 16).expect("hex start"),
        u64::from_str_radix(end, 16).expect("hex end"),
    )
}

/// The start of the executable mapping of the library whose path ends in
/// `suffix` (e.g. `/libc.so.6`), parsed by hand.
pub fn exec_mapping_of(pid: u32, suffix: &str) -> u64 {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("reading maps");
    let line = maps
        .lines()
        .find(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            fields.get(1).is_some_and(|perms| perms.contains('x'))
                && fields.get(5).is_some_and(|path| path.ends_with(suffix))
        })
        .unwrap_or_else(|| panic!("no executable {suffix} in\n{maps}"));
    let range = line.split_whitespace().next().expect("range");
    let (start, _) = range.split_once('-').expect("start-end");
    u64::from_str_radix(start, 16).expect("hex start")
}

/// Polls `condition` for up to five seconds.
pub fn wait_for(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}
