//! Helpers for the unwinder's tests on real binaries: fixtures compiled from
//! `tests/fixtures/*.c` at test time, processes killed on drop, a ptrace
//! snapshot of a stopped process (registers + stack bytes, like the BPF
//! sampler's record), a `ModuleLookup` over `/proc/<pid>/maps`, and a small
//! ELF-symbol symbolizer.
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

/// A fixture compiled into a temporary directory, removed on drop.
pub struct Fixture {
    pub path: PathBuf,
    dir: tempfile::TempDir,
}

impl Fixture {
    /// Compiles `tests/fixtures/<name>.c` with [`CFLAGS`] plus `extra` flags.
    pub fn compile(name: &str, extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("creating a temporary directory");
        let source = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/{name}.c"));
        let path = dir.path().join(name);
        let out = Command::new("gcc")
            .args(CFLAGS)
            .args(extra)
            .arg("-o")
            .arg(&path)
            .arg(&source)
            .output()
            .expect("running gcc");
        assert!(
            out.status.success(),
            "gcc failed on {}: {}",
            source.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        Self { path, dir }
    }

    /// A path for a derived file next to the binary.
    pub fn sibling(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
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

/// Stops `pid` with ptrace, reads its registers and up to `max_stack` bytes
/// of stack at rsp (bounded by the end of the `[stack]` mapping), and lets it
/// run again. Must be called from one thread throughout: ptrace tracers are
/// threads.
pub fn snapshot(pid: i32, max_stack: usize) -> Snapshot {
    // SAFETY: PTRACE_ATTACH takes no pointers.
    let rc = unsafe { libc::ptrace(libc::PTRACE_ATTACH, pid, 0usize, 0usize) };
    assert_eq!(rc, 0, "PTRACE_ATTACH: {}", std::io::Error::last_os_error());
    let _attached = Attached(pid);
    let mut status = 0;
    // SAFETY: `status` is a valid out pointer.
    let waited = unsafe { libc::waitpid(pid, &mut status, libc::__WALL) };
    assert_eq!(waited, pid, "waitpid: {}", std::io::Error::last_os_error());
    assert!(libc::WIFSTOPPED(status), "not stopped: status {status:#x}");

    // SAFETY: user_regs_struct is plain integers; zero is a valid value.
    let mut regs: libc::user_regs_struct = unsafe { std::mem::zeroed() };
    // SAFETY: PTRACE_GETREGS writes one user_regs_struct to the pointer.
    let rc = unsafe {
        libc::ptrace(
            libc::PTRACE_GETREGS,
            pid,
            0usize,
            &mut regs as *mut libc::user_regs_struct,
        )
    };
    assert_eq!(rc, 0, "PTRACE_GETREGS: {}", std::io::Error::last_os_error());

    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("reading maps");
    let stack_end = maps
        .lines()
        .find(|line| line.ends_with("[stack]"))
        .and_then(|line| line.split(['-', ' ']).nth(1))
        .and_then(|end| u64::from_str_radix(end, 16).ok())
        .expect("a [stack] mapping");
    let len = (stack_end - regs.rsp).min(max_stack as u64) as usize;
    let mut stack = vec![0; len];
    File::open(format!("/proc/{pid}/mem"))
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

    /// The function containing file address `address`.
    pub fn symbol(&self, address: u64) -> Option<&str> {
        let index = self
            .symbols
            .partition_point(|&(start, _, _)| start <= address);
        let (_, end, name) = self.symbols.get(index.checked_sub(1)?)?;
        (address < *end).then_some(name.as_str())
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
            if let Some(bias) = load_bias(&modules[index].path, start, offset) {
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

    /// `name` for a frame in a module with that symbol, `file?` otherwise.
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
                        .map(str::to_owned)
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

/// The bias of a mapping of `path` at `start` from file offset `offset`:
/// file virtual address = runtime address - bias.
fn load_bias(path: &Path, start: u64, offset: u64) -> Option<u64> {
    let data = std::fs::read(path).ok()?;
    let file = object::File::parse(&*data).ok()?;
    // The PT_LOAD segment this mapping comes from: mappings start at the
    // page holding the segment's first byte.
    file.segments().find_map(|segment| {
        let (file_offset, file_size) = segment.file_range();
        let page_start = file_offset & !0xfff;
        (page_start..file_offset + file_size.max(1))
            .contains(&offset)
            .then(|| {
                // Offset x of the file is at runtime address start + (x - offset)
                // and at file virtual address vaddr + (x - file_offset).
                start
                    .wrapping_add(file_offset)
                    .wrapping_sub(offset)
                    .wrapping_sub(segment.address())
            })
    })
}
