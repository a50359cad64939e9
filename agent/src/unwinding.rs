//! Turns each sample's registers and copied stack into frames.
//!
//! Owns the glue between the process table (which file is mapped where), the
//! unwind tables (one per object, shared by every process that maps it, in a
//! cache bounded by bytes) and the unwinder, plus the statistics on how far
//! walks get. It does not compile tables or step frames (`stackscope-unwind`)
//! and does not read `/proc` itself (`stackscope-process-table`).
//!
//! Each process has a sorted list of the modules its samples have touched.
//! A walk runs against that list; when it reaches an address outside it, the
//! address is resolved after the walk (process table lookup, then the
//! object's table from the cache, compiled on a miss) and the walk runs
//! again. Once a process's hot modules are known, a sample costs one walk.

use std::{cell::Cell, collections::HashMap, path::Path, sync::Arc};

use agent_common::{SampleHeader, sample_flags};
use stackscope_process_table::{
    Location, MappingPath, ObjectId, ProcessTable, TableConfig, maps::read_maps,
};
use stackscope_unwind::{
    DEFAULT_MAX_DEPTH, ModuleAt, ModuleLookup, Registers, TableError, UnwindEnd, UnwindTable,
    unwind,
};

/// Default bound on the bytes of unwind tables kept for objects no tracked
/// process maps any more (tables of mapped objects are always kept).
pub const DEFAULT_TABLE_CACHE_BYTES: usize = 256 << 20;

/// Modules resolved per walk at most: bounds the re-walks a single sample can
/// cause (a stack through many not-yet-seen libraries).
const MAX_RESOLVES_PER_WALK: usize = 16;

/// Binaries tracked individually in [`WalkStats::by_binary`].
const MAX_BINARIES_TRACKED: usize = 1024;

/// The result of walking one sample's user stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Walk<'a> {
    /// Absolute addresses, innermost first; frame 0 is the sampled rip.
    pub frames: &'a [u64],
    pub outcome: WalkOutcome,
}

/// How a walk ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WalkOutcome {
    /// The unwinder stopped for this reason.
    Ended(UnwindEnd),
    /// The walk reached a module whose table is still being compiled; the
    /// frames so far are correct but incomplete.
    TablePending,
}

/// How walks ended, overall and per binary of the sampled instruction.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WalkStats {
    pub walks: u64,
    /// Walks that reached the outermost frame (`_start`, a thread's entry).
    pub outermost: u64,
    /// (walks, outermost) per binary holding frame 0.
    pub by_binary: HashMap<Arc<str>, (u64, u64)>,
    /// Tables compiled, and objects whose table could not be built (they are
    /// walked with frame pointers).
    pub tables_compiled: u64,
    pub tables_failed: u64,
    /// Walks cut short by a table still being compiled.
    pub table_pending: u64,
}

impl WalkStats {
    /// Share of walks that reached the outermost frame, in percent.
    pub fn outermost_percent(&self) -> f64 {
        if self.walks == 0 {
            0.0
        } else {
            100.0 * self.outermost as f64 / self.walks as f64
        }
    }
}

/// One module of a process: an executable mapping and how to unwind it.
#[derive(Debug, Clone)]
struct Module {
    start: u64,
    end: u64,
    /// `pc - bias` is the address in the file's ELF virtual address space.
    bias: u64,
    table: ModuleTable,
    name: Arc<str>,
}

#[derive(Debug, Clone)]
enum ModuleTable {
    Ready(Arc<UnwindTable>),
    /// No usable CFI: walk with frame pointers.
    NoCfi,
    /// Being compiled in the background.
    Pending(ObjectId),
}

/// The modules of one process, sorted by start address, non-overlapping.
#[derive(Debug, Default)]
struct ProcessModules {
    modules: Vec<Module>,
}

impl ProcessModules {
    fn find(&self, pc: u64) -> Option<&Module> {
        let at = self.modules.partition_point(|m| m.start <= pc);
        let module = self.modules.get(at.checked_sub(1)?)?;
        (pc < module.end).then_some(module)
    }

    fn insert(&mut self, module: Module) {
        // A stale module overlapping the new one (the process remapped the
        // range) goes: the new one is what the process maps now.
        self.modules
            .retain(|m| m.end <= module.start || m.start >= module.end);
        let at = self.modules.partition_point(|m| m.start < module.start);
        self.modules.insert(at, module);
    }
}

/// The unwinder's view of one process during a walk: answers from the known
/// modules and remembers the first address it could not place.
struct KnownModules<'a> {
    process: &'a ProcessModules,
    unknown: Cell<Option<u64>>,
    /// The walk reached a module whose table is still being compiled.
    pending: Cell<bool>,
}

impl ModuleLookup for KnownModules<'_> {
    fn module_for(&self, pc: u64) -> ModuleAt<'_> {
        let Some(module) = self.process.find(pc) else {
            if self.unknown.get().is_none() {
                self.unknown.set(Some(pc));
            }
            return ModuleAt::Unmapped;
        };
        match &module.table {
            ModuleTable::Ready(table) => ModuleAt::Table {
                table,
                bias: module.bias,
            },
            ModuleTable::NoCfi => ModuleAt::NoCfi,
            ModuleTable::Pending(_) => {
                self.pending.set(true);
                ModuleAt::Unmapped
            }
        }
    }
}

/// Tables by object identity, bounded by bytes over the tables that no
/// process module holds any more.
#[derive(Default)]
struct TableCache {
    by_object: HashMap<ObjectId, CachedTable>,
    tick: u64,
}

struct CachedTable {
    table: ModuleTable,
    last_used: u64,
}

impl CachedTable {
    /// The table, if it is ready and only this cache holds it.
    fn unused_table(&self) -> Option<&Arc<UnwindTable>> {
        match &self.table {
            ModuleTable::Ready(table) if Arc::strong_count(table) == 1 => Some(table),
            _ => None,
        }
    }
}

impl TableCache {
    fn get(&mut self, id: &ObjectId) -> Option<ModuleTable> {
        self.tick += 1;
        let entry = self.by_object.get_mut(id)?;
        entry.last_used = self.tick;
        Some(entry.table.clone())
    }

    fn insert(&mut self, id: ObjectId, table: ModuleTable, max_bytes: usize) {
        self.tick += 1;
        self.by_object.insert(
            id,
            CachedTable {
                table,
                last_used: self.tick,
            },
        );
        self.evict_unused(max_bytes);
    }

    /// Drops the least recently used tables that no process holds (their
    /// `Arc` is only ours) until the unused ones fit in `max_bytes`.
    fn evict_unused(&mut self, max_bytes: usize) {
        let unused_bytes = |cache: &Self| -> usize {
            cache
                .by_object
                .values()
                .filter_map(CachedTable::unused_table)
                .map(|t| t.heap_bytes())
                .sum()
        };
        while unused_bytes(self) > max_bytes {
            let oldest = self
                .by_object
                .iter()
                .filter(|(_, e)| e.unused_table().is_some())
                .min_by_key(|(_, e)| e.last_used)
                .map(|(id, _)| *id);
            match oldest {
                Some(id) => {
                    self.by_object.remove(&id);
                }
                None => break,
            }
        }
    }
}

/// Walks samples' user stacks; keeps what it learns about processes between
/// samples.
pub struct StackWalker {
    processes: ProcessTable,
    modules: HashMap<u32, ProcessModules>,
    tables: TableCache,
    table_cache_bytes: usize,
    /// The vDSO's table, built from this agent's own vDSO: every process on
    /// the host maps the same image (same kernel).
    vdso: ModuleTable,
    compiler: Compiler,
    frames: Vec<u64>,
    stats: WalkStats,
}

impl Default for StackWalker {
    fn default() -> Self {
        Self::new(DEFAULT_TABLE_CACHE_BYTES)
    }
}

impl StackWalker {
    pub fn new(table_cache_bytes: usize) -> Self {
        Self {
            processes: ProcessTable::new(TableConfig::default()),
            modules: HashMap::new(),
            tables: TableCache::default(),
            table_cache_bytes,
            vdso: own_vdso_table().map_or(ModuleTable::NoCfi, ModuleTable::Ready),
            compiler: Compiler::start(),
            frames: Vec::with_capacity(DEFAULT_MAX_DEPTH),
            stats: WalkStats::default(),
        }
    }

    pub fn stats(&self) -> &WalkStats {
        &self.stats
    }

    /// The process replaced its image: forget its mappings.
    pub fn on_exec(&mut self, tgid: u32) {
        self.processes.exec(tgid);
        self.modules.remove(&tgid);
    }

    /// The process exited: forget it, so a reused pid starts afresh.
    pub fn on_exit(&mut self, tgid: u32) {
        self.processes.remove(tgid);
        self.modules.remove(&tgid);
    }

    /// Walks the user stack of a sample (its header and the copied stack
    /// bytes); `None` when it has no user part (a kernel thread).
    pub fn walk(&mut self, header: &SampleHeader, user_stack: &[u8]) -> Option<Walk<'_>> {
        if header.flags & sample_flags::USER_REGS == 0 {
            return None;
        }
        let tgid = header.tgid;
        let regs = Registers {
            rip: header.user_rip,
            rsp: header.user_rsp,
            rbp: header.user_rbp,
        };
        self.take_compiled_tables();
        let mut resolves = 0;
        let (end, pending) = loop {
            let process = self.modules.entry(tgid).or_default();
            let known = KnownModules {
                process,
                unknown: Cell::new(None),
                pending: Cell::new(false),
            };
            let end = unwind(
                regs,
                user_stack,
                &known,
                DEFAULT_MAX_DEPTH,
                &mut self.frames,
            );
            let (unknown, pending) = (known.unknown.get(), known.pending.get());
            let retry = end == UnwindEnd::Unmapped
                && !pending
                && resolves < MAX_RESOLVES_PER_WALK
                && unknown.is_some_and(|pc| self.resolve(tgid, pc));
            if !retry {
                break (end, pending);
            }
            resolves += 1;
        };
        let outcome = if pending {
            WalkOutcome::TablePending
        } else {
            WalkOutcome::Ended(end)
        };
        self.record(tgid, outcome);
        Some(Walk {
            frames: &self.frames,
            outcome,
        })
    }

    /// Installs the tables the background compiler has finished.
    fn take_compiled_tables(&mut self) {
        while let Some((id, result)) = self.compiler.finished() {
            let table = match result {
                Compiled::Table(table) => {
                    self.stats.tables_compiled += 1;
                    ModuleTable::Ready(table)
                }
                Compiled::NoCfi => {
                    self.stats.tables_failed += 1;
                    ModuleTable::NoCfi
                }
                Compiled::Unreadable => {
                    // Transient (the process exited before its file was
                    // opened): forget it, so a later sample retries.
                    self.tables.by_object.remove(&id);
                    for process in self.modules.values_mut() {
                        process
                            .modules
                            .retain(|m| !matches!(m.table, ModuleTable::Pending(p) if p == id));
                    }
                    continue;
                }
            };
            for module in self.modules.values_mut().flat_map(|p| p.modules.iter_mut()) {
                if matches!(module.table, ModuleTable::Pending(p) if p == id) {
                    module.table = table.clone();
                }
            }
            self.tables.insert(id, table, self.table_cache_bytes);
        }
    }

    /// Adds the module holding `pc` to the process's list; false when `pc`
    /// is in no module (or the process is gone).
    fn resolve(&mut self, tgid: u32, pc: u64) -> bool {
        let module = match self.processes.lookup(tgid, pc) {
            Ok(Some(Location::Object(object))) => {
                let Some(vaddr) = object.elf_vaddr else {
                    return false;
                };
                let id = *object.id;
                let table = match self.tables.get(&id) {
                    Some(table) => table,
                    None => {
                        if !self.compiler.submit(object.clone()) {
                            // The compiler's queue is full: a later sample retries.
                            return false;
                        }
                        let pending = ModuleTable::Pending(id);
                        self.tables
                            .insert(id, pending.clone(), self.table_cache_bytes);
                        pending
                    }
                };
                let mapping = &object.region.mapping;
                Module {
                    start: mapping.start,
                    end: mapping.end,
                    bias: pc - vaddr,
                    table,
                    name: binary_name(object.path()),
                }
            }
            Ok(Some(Location::Unbacked(region))) if region.mapping.path == MappingPath::Vdso => {
                // The vDSO image is linked at address 0.
                Module {
                    start: region.mapping.start,
                    end: region.mapping.end,
                    bias: region.mapping.start,
                    table: self.vdso.clone(),
                    name: "[vdso]".into(),
                }
            }
            Ok(_) => return false,
            Err(err) => {
                tracing::debug!("process {tgid}: {err}");
                return false;
            }
        };
        self.modules.entry(tgid).or_default().insert(module);
        true
    }

    fn record(&mut self, tgid: u32, outcome: WalkOutcome) {
        let outermost = u64::from(outcome == WalkOutcome::Ended(UnwindEnd::Outermost));
        self.stats.walks += 1;
        self.stats.outermost += outermost;
        self.stats.table_pending += u64::from(outcome == WalkOutcome::TablePending);
        let name = self
            .frames
            .first()
            .and_then(|&rip| self.modules.get(&tgid)?.find(rip))
            .map_or_else(|| Arc::<str>::from("[unknown]"), |m| Arc::clone(&m.name));
        let by_binary = &mut self.stats.by_binary;
        if by_binary.len() < MAX_BINARIES_TRACKED || by_binary.contains_key(&name) {
            let entry = by_binary.entry(name).or_default();
            entry.0 += 1;
            entry.1 += outermost;
        }
    }
}

/// What the background compiler made of one object.
enum Compiled {
    Table(Arc<UnwindTable>),
    /// No usable CFI (none at all, or malformed): frame pointers.
    NoCfi,
    /// The file could not be opened or mapped; worth retrying later.
    Unreadable,
}

/// Objects queued for compilation at most; beyond, resolution is retried
/// with a later sample.
const COMPILE_QUEUE: usize = 256;

/// Compiles tables on a thread of its own, so a 150 MB library never stalls
/// the ring buffer reader.
struct Compiler {
    requests: std::sync::mpsc::SyncSender<stackscope_process_table::MappedObject>,
    results: std::sync::mpsc::Receiver<(ObjectId, Compiled)>,
}

impl Compiler {
    fn start() -> Self {
        let (requests, queue) = std::sync::mpsc::sync_channel(COMPILE_QUEUE);
        let (done, results) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("table-compiler".into())
            .spawn(move || {
                for object in queue {
                    let compiled = compile(&object);
                    if done.send((*object.id, compiled)).is_err() {
                        break;
                    }
                }
            })
            .expect("spawning the table compiler thread");
        Self { requests, results }
    }

    /// Queues `object`; false when the queue is full.
    fn submit(&self, object: stackscope_process_table::MappedObject) -> bool {
        self.requests.try_send(object).is_ok()
    }

    fn finished(&self) -> Option<(ObjectId, Compiled)> {
        self.results.try_recv().ok()
    }
}

fn compile(object: &stackscope_process_table::MappedObject) -> Compiled {
    let opened = match object.open() {
        Ok(opened) => opened,
        Err(err) => {
            tracing::debug!("cannot open {}: {err}", object.path());
            return Compiled::Unreadable;
        }
    };
    // SAFETY: the mapping is read-only and private to this function; a file
    // truncated underneath it could fault (SIGBUS), the accepted risk of
    // every mmap-based ELF reader: files mapped by running processes are not
    // truncated in practice.
    let bytes = match unsafe { memmap2::Mmap::map(&opened.file) } {
        Ok(bytes) => bytes,
        Err(err) => {
            tracing::debug!("cannot map {}: {err}", object.path());
            return Compiled::Unreadable;
        }
    };
    match UnwindTable::from_elf(&bytes) {
        Ok(table) => Compiled::Table(Arc::new(table)),
        Err(TableError::NoCfi) => Compiled::NoCfi,
        Err(err) => {
            tracing::warn!(
                "no unwind table for {}: {err}; using frame pointers",
                object.path()
            );
            Compiled::NoCfi
        }
    }
}

/// The table of this process's own vDSO, which is the same image in every
/// process on this kernel.
fn own_vdso_table() -> Option<Arc<UnwindTable>> {
    let maps = read_maps(std::process::id()).ok()?;
    let vdso = maps.iter().find(|m| m.path == MappingPath::Vdso)?;
    let len = usize::try_from(vdso.end - vdso.start).ok()?;
    // SAFETY: the kernel maps the vDSO readable in every process for its
    // whole lifetime; `start..end` is that mapping in ours.
    let image = unsafe { std::slice::from_raw_parts(vdso.start as *const u8, len) };
    match UnwindTable::from_elf(image) {
        Ok(table) => Some(Arc::new(table)),
        Err(err) => {
            tracing::warn!("no unwind table for the vDSO: {err}");
            None
        }
    }
}

fn binary_name(path: &MappingPath) -> Arc<str> {
    match path.file_path() {
        Some(path) => Path::new(path)
            .file_name()
            .map_or_else(|| path.to_string_lossy(), |name| name.to_string_lossy())
            .into(),
        None => path.to_string().into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn module(start: u64, end: u64) -> Module {
        Module {
            start,
            end,
            bias: 0,
            table: ModuleTable::NoCfi,
            name: format!("m{start:x}").into(),
        }
    }

    #[test]
    fn finds_the_module_holding_an_address() {
        let mut process = ProcessModules::default();
        process.insert(module(0x3000, 0x4000));
        process.insert(module(0x1000, 0x2000));
        assert_eq!(process.find(0x1000).map(|m| m.start), Some(0x1000));
        assert_eq!(process.find(0x1fff).map(|m| m.start), Some(0x1000));
        assert!(process.find(0x2000).is_none());
        assert!(process.find(0xfff).is_none());
        assert_eq!(process.find(0x3abc).map(|m| m.start), Some(0x3000));
        assert!(process.find(0x4000).is_none());
    }

    #[test]
    fn a_remapped_range_replaces_the_stale_module() {
        let mut process = ProcessModules::default();
        process.insert(module(0x1000, 0x3000));
        process.insert(module(0x5000, 0x6000));
        process.insert(module(0x2000, 0x5800));
        let starts: Vec<u64> = process.modules.iter().map(|m| m.start).collect();
        assert_eq!(starts, [0x2000]);
    }

    #[test]
    fn unknown_addresses_are_remembered_for_resolution() {
        let mut process = ProcessModules::default();
        process.insert(module(0x1000, 0x2000));
        let known = KnownModules {
            process: &process,
            unknown: Cell::new(None),
            pending: Cell::new(false),
        };
        assert!(matches!(known.module_for(0x1800), ModuleAt::NoCfi));
        assert!(matches!(known.module_for(0x9000), ModuleAt::Unmapped));
        assert!(matches!(known.module_for(0xa000), ModuleAt::Unmapped));
        assert_eq!(
            known.unknown.get(),
            Some(0x9000),
            "the first unknown address"
        );
    }

    #[test]
    fn the_agents_own_vdso_has_a_table() {
        let table = own_vdso_table().expect("a vDSO table");
        assert!(!table.is_empty());
    }
}
