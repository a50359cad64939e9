//! Helpers for the unwinder's tests on real binaries: a ptrace snapshot of a
//! stopped thread (registers + stack bytes, like the BPF sampler's record)
//! and a `ModuleLookup` over `/proc/<pid>/maps` that names frames with each
//! file's symbols. Fixture programs and processes killed on drop come from
//! `stackscope-test-fixtures`, shared with the end-to-end tests.
#![allow(dead_code)] // Each test binary uses its own subset.

use std::{
    collections::HashMap,
    fs::File,
    os::unix::fs::FileExt as _,
    path::{Path, PathBuf},
};

use stackscope_process_table::{
    elf::read_summary,
    maps::{Mapping, parse_maps},
    table::bias,
};
use stackscope_test_fixtures::ElfSymbols;
use stackscope_unwind::{ModuleAt, ModuleLookup, Registers, TableError, UnwindTable};

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
pub fn snapshot(tid: u32, max_stack: usize) -> Snapshot {
    let tid = i32::try_from(tid).expect("a tid fits pid_t");
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
    pub symbols: ElfSymbols,
}

impl Module {
    pub fn load(path: &Path) -> Self {
        let data = std::fs::read(path).expect("reading a mapped file");
        let table = UnwindTable::from_elf(&data);
        let symbols = ElfSymbols::parse(&data);
        Self {
            path: path.to_owned(),
            table,
            symbols,
        }
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
        let mut by_path: HashMap<PathBuf, usize> = HashMap::new();
        let mut mappings = Vec::new();
        for mapping in parse_maps(maps.as_bytes()).expect("parsing maps") {
            // The vDSO and anonymous memory have no file to read CFI from.
            let Some(path) = mapping.path.file_path() else {
                continue;
            };
            let index = *by_path.entry(path.to_owned()).or_insert_with(|| {
                modules.push(Module::load(path));
                modules.len() - 1
            });
            if let Some(bias) = mapping_bias(&mapping) {
                mappings.push((mapping.start, mapping.end, bias, index));
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
                        .symbols
                        .name_at(pc - bias)
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
                Ok(table) => ModuleAt::Table {
                    table,
                    bias,
                    frame_pointer_gaps: false,
                },
                Err(_) => ModuleAt::NoCfi,
            },
        }
    }
}

/// The bias of a file mapping (file virtual address = runtime address -
/// bias), from the file's PT_LOAD segments, as the agent's process table
/// computes it.
pub fn mapping_bias(mapping: &Mapping) -> Option<u64> {
    let file = File::open(mapping.path.file_path()?).ok()?;
    let summary = read_summary(&file).ok()?;
    bias(mapping, &summary.load_segments, 0x1000)
}
