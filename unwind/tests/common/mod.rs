//! Helpers for the unwinder's tests on real binaries: fixtures compiled from
//! the workspace's `tests/fixtures/*` (C, C++, Rust, shared libraries) at test time,
//! processes killed on drop, a ptrace snapshot of a stopped thread
//! (registers + stack bytes, like the BPF sampler's record), a
//! `ModuleLookup` over `/proc/<pid>/maps`, and a small ELF-symbol symbolizer
//! that demangles C++ and Rust names.
#![allow(dead_code)] // Each test binary uses its own subset.

use std::{
    collections::HashMap,
    fs::File,
    io::{BufRead as _, BufReader},
    os::unix::fs::FileExt as _,
    path::{Path, PathBuf},
    process::{Child, ChildStdout, Command, Stdio},
};

use object::{Object as _, ObjectSegment as _, ObjectSymbol as _, SymbolKind};
use stackscope_unwind::{ModuleAt, ModuleLookup, Registers, TableError, UnwindTable};

/// Flags every fixture is built with: optimised, no frame pointers.
pub const CFLAGS: &[&str] = &["-O2", "-fomit-frame-pointer"];

/// A temporary directory that fixtures and the libraries they link are
/// compiled into, removed on drop.
pub struct BuildDir(tempfile::TempDir);

impl BuildDir {
    pub fn new() -> Self {
        Self(tempfile::tempdir().expect("creating a temporary directory"))
    }

    pub fn path(&self) -> &Path {
        self.0.path()
    }

    /// Runs `compiler sources... args... -o <dir>/<output>` with the sources
    /// taken from the workspace's `tests/fixtures/` (first, so that `-l` options follow the
    /// objects that need them) and the directory as working directory
    /// (so `-L.` finds libraries built into it). Returns the output's path.
    pub fn compile(
        &self,
        compiler: &str,
        sources: &[&str],
        args: &[&str],
        output: &str,
    ) -> PathBuf {
        // One fixture directory for the whole workspace: the same programs
        // are unwound here offline and end to end through the sampler.
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
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

/// A fixture compiled into a temporary directory, removed on drop.
pub struct Fixture {
    pub path: PathBuf,
    dir: BuildDir,
}

impl Fixture {
    /// Compiles the workspace's `tests/fixtures/<name>.c` with [`CFLAGS`] plus `extra` flags.
    pub fn compile(name: &str, extra: &[&str]) -> Self {
        let args = [CFLAGS, extra].concat();
        Self::compile_with(name, "gcc", &[&format!("{name}.c")], &args)
    }

    /// Compiles `sources` (in the workspace's `tests/fixtures/`) with `compiler` and exactly
    /// `args` into an executable `name` in a new directory.
    pub fn compile_with(name: &str, compiler: &str, sources: &[&str], args: &[&str]) -> Self {
        Self::compile_in(BuildDir::new(), name, compiler, sources, args)
    }

    /// Like [`Fixture::compile_with`], into `dir`, which may already hold
    /// the libraries the fixture links or loads.
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

    /// A path for a derived file next to the binary.
    pub fn sibling(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The directory the fixture was built in.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Starts the fixture and waits for it to print `ready`, i.e. to reach
    /// its final spin loop.
    pub fn start(&self, args: &[&str]) -> Running {
        let mut child = Command::new(&self.path)
            .args(args)
            .env_clear()
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting the fixture");
        let mut stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        // Adopted before reading, so a fixture that fails to start is still reaped.
        let mut running = Running {
            child,
            _stdout: None,
        };
        let mut line = String::new();
        stdout.read_line(&mut line).expect("reading the fixture");
        assert_eq!(line.trim(), "ready", "fixture did not start");
        // Kept open so the fixture never writes to a closed pipe.
        running._stdout = Some(stdout);
        running
    }
}

/// A child process killed and reaped when dropped, so a failing test never
/// leaves a spinning fixture behind.
pub struct Running {
    child: Child,
    _stdout: Option<BufReader<ChildStdout>>,
}

impl Running {
    pub fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).expect("pid fits i32")
    }

    /// The ids of the process's threads other than the main one.
    pub fn other_threads(&self) -> Vec<i32> {
        let pid = self.pid();
        let mut tids: Vec<i32> = std::fs::read_dir(format!("/proc/{pid}/task"))
            .expect("listing the process's threads")
            .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
            .filter(|&tid| tid != pid)
            .collect();
        tids.sort_unstable();
        tids
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // SIGKILL works on a ptrace-stopped process too; both calls fail
        // harmlessly if the child is already gone.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What the BPF sampler would have recorded: registers and the stack bytes
/// from rsp up, plus the process's mappings at that moment.
pub struct Snapshot {
    pub regs: Registers,
    pub stack: Vec<u8>,
    pub maps: String,
}

/// Detaches on drop, so a failed assertion does not leave the process stopped.
struct Attached(i32);

impl Drop for Attached {
    fn drop(&mut self) {
        // SAFETY: PTRACE_DETACH takes no pointers.
        unsafe {
            libc::ptrace(libc::PTRACE_DETACH, self.0, 0usize, 0usize);
        }
    }
}

/// Stops thread `tid` with ptrace, reads its registers and up to
/// `max_stack` bytes of stack at rsp (bounded by the end of the mapping rsp
/// is in: `[stack]` for a main thread, an anonymous mapping for the others),
/// and lets it run again. Must be called from one thread throughout: ptrace
/// tracers are threads.
///
/// PTRACE_SEIZE + PTRACE_INTERRUPT rather than PTRACE_ATTACH: ATTACH's
/// SIGSTOP would put every other thread of the process into a group stop
/// that outlives the detach.
pub fn snapshot(tid: i32, max_stack: usize) -> Snapshot {
    // SAFETY: PTRACE_SEIZE takes no pointers.
    let rc = unsafe { libc::ptrace(libc::PTRACE_SEIZE, tid, 0usize, 0usize) };
    assert_eq!(rc, 0, "PTRACE_SEIZE: {}", std::io::Error::last_os_error());
    let _attached = Attached(tid);
    // SAFETY: PTRACE_INTERRUPT takes no pointers.
    let rc = unsafe { libc::ptrace(libc::PTRACE_INTERRUPT, tid, 0usize, 0usize) };
    assert_eq!(
        rc,
        0,
        "PTRACE_INTERRUPT: {}",
        std::io::Error::last_os_error()
    );
    let mut status = 0;
    // SAFETY: `status` is a valid out pointer.
    let waited = unsafe { libc::waitpid(tid, &mut status, libc::__WALL) };
    assert_eq!(waited, tid, "waitpid: {}", std::io::Error::last_os_error());
    assert!(libc::WIFSTOPPED(status), "not stopped: status {status:#x}");

    // SAFETY: user_regs_struct is plain integers; zero is a valid value.
    let mut regs: libc::user_regs_struct = unsafe { std::mem::zeroed() };
    // SAFETY: PTRACE_GETREGS writes one user_regs_struct to the pointer.
    let rc = unsafe {
        libc::ptrace(
            libc::PTRACE_GETREGS,
            tid,
            0usize,
            &mut regs as *mut libc::user_regs_struct,
        )
    };
    assert_eq!(rc, 0, "PTRACE_GETREGS: {}", std::io::Error::last_os_error());

    let maps = std::fs::read_to_string(format!("/proc/{tid}/maps")).expect("reading maps");
    let stack_end = maps
        .lines()
        .filter_map(|line| {
            let (start, end) = line.split(' ').next()?.split_once('-')?;
            let start = u64::from_str_radix(start, 16).ok()?;
            let end = u64::from_str_radix(end, 16).ok()?;
            Some((start, end))
        })
        .find(|&(start, end)| (start..end).contains(&regs.rsp))
        .map(|(_, end)| end)
        .expect("a mapping holding rsp");
    let len = (stack_end - regs.rsp).min(max_stack as u64) as usize;
    let mut stack = vec![0; len];
    File::open(format!("/proc/{tid}/mem"))
        .and_then(|mem| mem.read_exact_at(&mut stack, regs.rsp))
        .expect("reading the stack from /proc/<pid>/mem");
    Snapshot {
        regs: Registers {
            rip: regs.rip,
            rsp: regs.rsp,
            rbp: regs.rbp,
        },
        stack,
        maps,
    }
}

/// One mapped ELF file: its table (or why it has none) and its function symbols.
pub struct Module {
    pub path: PathBuf,
    pub table: Result<UnwindTable, TableError>,
    /// `(start, end, name)` by file virtual address, sorted by start.
    symbols: Vec<(u64, u64, String)>,
}

impl Module {
    pub fn load(path: &Path) -> Self {
        let data = std::fs::read(path).expect("reading a mapped file");
        let table = UnwindTable::from_elf(&data);
        let file = object::File::parse(&*data).expect("parsing a mapped ELF file");
        // .symtab when present, else the exported .dynsym (stripped libc).
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
        Self {
            path: path.to_owned(),
            table,
            symbols,
        }
    }

    /// The function containing file address `address`. Aliases (static
    /// glibc's `__libc_start_main` and `__libc_start_main_impl`) cover the
    /// same range: the shortest name wins, usually the public one.
    pub fn symbol(&self, address: u64) -> Option<&str> {
        let candidates = self
            .symbols
            .partition_point(|&(start, _, _)| start <= address);
        self.symbols[..candidates]
            .iter()
            .filter(|&&(_, end, _)| address < end)
            .map(|(_, _, name)| name.as_str())
            .min_by_key(|name| (name.len(), *name))
    }

    /// The file address of symbol `name`.
    pub fn symbol_address(&self, name: &str) -> Option<u64> {
        self.symbols
            .iter()
            .find(|(_, _, symbol)| symbol == name)
            .map(|&(start, _, _)| start)
    }

    fn file_name(&self) -> String {
        self.path
            .file_name()
            .map(|name| name.to_string_lossy().into_owned())
            .unwrap_or_default()
    }
}

/// The loaded ELF files of one process, from its `/proc/<pid>/maps`: the
/// `ModuleLookup` an agent would implement with its process table.
pub struct ProcessModules {
    /// `(start, end, bias, index into modules)`.
    mappings: Vec<(u64, u64, u64, usize)>,
    pub modules: Vec<Module>,
}

impl ProcessModules {
    pub fn from_maps(maps: &str) -> Self {
        let mut modules: Vec<Module> = Vec::new();
        let mut by_path: HashMap<String, usize> = HashMap::new();
        let mut mappings = Vec::new();
        for line in maps.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [range, _perms, offset, _dev, _inode, path] = fields[..] else {
                continue;
            };
            if !path.starts_with('/') {
                continue;
            }
            let (start, end) = range.split_once('-').expect("maps range");
            let start = u64::from_str_radix(start, 16).expect("maps start");
            let end = u64::from_str_radix(end, 16).expect("maps end");
            let offset = u64::from_str_radix(offset, 16).expect("maps offset");
            let index = *by_path.entry(path.to_owned()).or_insert_with(|| {
                modules.push(Module::load(Path::new(path)));
                modules.len() - 1
            });
            if let Some(bias) = load_bias(&modules[index].path, start..end, offset) {
                mappings.push((start, end, bias, index));
            }
        }
        Self { mappings, modules }
    }

    fn mapping(&self, address: u64) -> Option<(u64, &Module)> {
        self.mappings
            .iter()
            .find(|&&(start, end, _, _)| (start..end).contains(&address))
            .map(|&(_, _, bias, index)| (bias, &self.modules[index]))
    }

    /// `name` (demangled) for a frame in a module with that symbol, `file?`
    /// otherwise.
    /// Frames above frame 0 hold return addresses: symbolized at `pc - 1`,
    /// like the unwinder looks them up.
    pub fn symbolize(&self, frames: &[u64]) -> Vec<String> {
        frames
            .iter()
            .enumerate()
            .map(|(i, &pc)| {
                let pc = if i == 0 { pc } else { pc - 1 };
                match self.mapping(pc) {
                    Some((bias, module)) => module
                        .symbol(pc - bias)
                        .map(demangle)
                        .unwrap_or_else(|| format!("{}?", module.file_name())),
                    None => format!("{pc:#x}?"),
                }
            })
            .collect()
    }
}

impl ModuleLookup for ProcessModules {
    fn module_for(&self, pc: u64) -> ModuleAt<'_> {
        match self.mapping(pc) {
            None => ModuleAt::Unmapped,
            Some((bias, module)) => match &module.table {
                Ok(table) => ModuleAt::Table { table, bias },
                Err(_) => ModuleAt::NoCfi,
            },
        }
    }
}

/// A readable name for a symbol: Rust (legacy or v0, without the hash),
/// else C++ (without parameters or return type), else as it is (C). Only
/// names with a mangling prefix are tried: cpp_demangle also reads bare type
/// codes, and would turn the C function `c` into `char`.
pub fn demangle(name: &str) -> String {
    if !(name.starts_with("_Z") || name.starts_with("_R")) {
        return name.to_owned();
    }
    if let Ok(rust) = rustc_demangle::try_demangle(name) {
        return format!("{rust:#}");
    }
    let options = cpp_demangle::DemangleOptions::new()
        .no_params()
        .no_return_type();
    cpp_demangle::Symbol::new(name)
        .ok()
        .and_then(|symbol| symbol.demangle_with_options(&options).ok())
        .unwrap_or_else(|| name.to_owned())
}

/// The bias of the mapping `range` of `path` from file offset `offset`:
/// file virtual address = runtime address - bias.
fn load_bias(path: &Path, range: std::ops::Range<u64>, offset: u64) -> Option<u64> {
    const PAGE: u64 = 0x1000;
    let data = std::fs::read(path).ok()?;
    let file = object::File::parse(&*data).ok()?;
    // The PT_LOAD segment this mapping comes from. Its file range (from the
    // page holding its first byte) must hold `offset`, but that is not
    // enough: when a segment's file offset and address differ by more than
    // a page (rustc's executables: text at offset 0x13770, address
    // 0x14770), the page a segment starts in is also the last page of the
    // segment before. The one whose runtime pages, at the bias the mapping
    // implies, hold the whole mapping is the one.
    file.segments().find_map(|segment| {
        let (file_offset, file_size) = segment.file_range();
        if !(file_offset & !(PAGE - 1)..file_offset + file_size.max(1)).contains(&offset) {
            return None;
        }
        // Offset x of the file is at runtime address start + (x - offset)
        // and at file virtual address vaddr + (x - file_offset).
        let bias = range
            .start
            .wrapping_add(file_offset)
            .wrapping_sub(offset)
            .wrapping_sub(segment.address());
        let first = segment.address().wrapping_add(bias) & !(PAGE - 1);
        let last = segment
            .address()
            .wrapping_add(bias)
            .wrapping_add(segment.size())
            .next_multiple_of(PAGE);
        (first <= range.start && range.end <= last).then_some(bias)
    })
}
