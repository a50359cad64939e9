//! Turns each sample's registers and copied stack into frames.
//!
//! Owns the glue between the process table (which file is mapped where), the
//! unwind tables (one per object, shared by every process that maps it, in a
//! cache bounded by bytes, compiled by a pool of threads and kept on disk:
//! [`DiskCache`]) and the unwinder, plus the statistics on how far walks get.
//! It does not compile tables or step frames itself ([`crate::table`],
//! [`crate::unwinder`]), does not read `/proc` itself
//! (`stackscope-process-table`) and does not touch BPF maps (the sampler
//! writes the copy plans [`stitching`] queues).
//!
//! Each process has one record in the process table, which the walker's
//! owner keeps and lends it for each call ([`StackWalker::process_table`]
//! makes one); the walker's part of the record ([`ProcessState`], in any
//! [`WalkerRecord`]) is a sorted list of the modules its samples have
//! touched, its identity, and the copy size the planner learned for it,
//! found once per sample. A walk runs against that
//! list; when it reaches an address outside it, the
//! address is resolved after the walk (process table lookup, then the
//! object's table from the cache, compiled on a miss) and the walk runs
//! again. Once a process's hot modules are known, a sample costs one walk.
//!
//! Every delivered walk also says, per frame, which object the address is in
//! and where in it ([`FrameObject`]): frames leave the node as (object, file
//! offset), so the modules the walk resolved anyway are what normalizes them.
//!
//! A walk reads the sample's copy and its stack tail (words of deep frames
//! read at the same tick, see [`stitching`]); how each walk went feeds the
//! planner that decides how much the sampler reads next time.
//!
//! Executable memory no file backs is JIT code, walked by its frame
//! pointers ([`FrameObject::Jit`]). What processes fork, exec and map comes
//! in from the mapping feed ([`StackWalker::process_forked`] and the like, applied
//! in time order with the samples); a process that exits while samples of
//! its wait for a table is kept until they are walked.

mod compiler;
mod process_state;
mod remembered;
pub mod stitching;

use foldhash::HashMap;
use std::{
    cell::{Cell, RefCell},
    collections::VecDeque,
    path::{Path, PathBuf},
    sync::Arc,
};

pub use compiler::DiskCache;
use compiler::{Compiled, Compiler};

use crate::{
    DEFAULT_MAX_DEPTH, ModuleAt, ModuleLookup, Registers, RuleCache, RuntimeCode, SampledStack,
    StackMemory, TailSpan, UnsupportedCfi, UnwindEnd, UnwindTable, table::DirectCfi, unwind_memory,
};
use agent_common::{SampleHeader, sample_flags};
use process_state::WalkerTable;
pub use process_state::{ProcessState, WalkerRecord};
use stackscope_process_table::{
    BuildId, Location, Mapping, MappingPath, ModuleFile, ObjectId, ProcessError, ProcessTable,
    ReadAnswer, Slot, TableConfig, maps::own_vdso_image, table,
};
use stitching::{PlanStats, PlanUpdate, Planner, RemoteStack, WalkReport};

use stackscope_telemetry::StateSize;

/// How the walker caches tables and holds samples that wait for one.
#[derive(Debug, Clone)]
pub struct WalkerConfig {
    /// Bytes of unwind tables kept in memory for objects no tracked process
    /// maps any more (tables of mapped objects are always kept). Beyond,
    /// they are read back from the disk cache when needed again.
    pub table_cache_bytes: usize,
    /// The on-disk table cache; `None` keeps tables in memory only.
    pub disk_cache: Option<DiskCache>,
    /// Threads compiling tables.
    pub compile_threads: usize,
    /// Bytes of samples held while their tables compile; beyond, a sample is
    /// walked as far as it can go at once (counted as dropped from the queue).
    pub max_waiting_bytes: usize,
    /// Most frames a walk returns.
    pub max_depth: usize,
    /// The sampler's copy ceiling (`--stack-bytes`), which adaptive copies
    /// never exceed.
    pub stack_bytes: u32,
    /// The sampler's most bytes of a deep copy (a thread's whole stack);
    /// 0: none are planned.
    pub deep_stack_bytes: u32,
    /// Learn per-process copy sizes and per-thread stack tails (the
    /// sampler reads what walks need); off, every tick copies the ceiling.
    pub adaptive: bool,
    /// The process table's reads of maps (with the identities of the files
    /// they list) are handed to the owner
    /// ([`ProcessTable::take_read_requests`], answered through
    /// [`StackWalker::apply_reads`]) instead of done on the walking
    /// thread; the samples that need a read (a first-seen process, a file
    /// mapped while the agent ran and not identified yet) are held
    /// meanwhile.
    pub defer_reads: bool,
}

impl Default for WalkerConfig {
    fn default() -> Self {
        Self {
            table_cache_bytes: 64 << 20,
            disk_cache: None,
            compile_threads: 2,
            max_waiting_bytes: 64 << 20,
            max_depth: DEFAULT_MAX_DEPTH,
            stack_bytes: agent_common::DEFAULT_USER_STACK_BYTES,
            deep_stack_bytes: agent_common::MAX_DEEP_STACK_BYTES,
            adaptive: true,
            defer_reads: false,
        }
    }
}

/// A sample's user stack as read at the tick: the copy from `rsp` and the
/// stack tail (spans indexing into `tail`).
#[derive(Debug, Clone, Copy, Default)]
pub struct UserStack<'a> {
    pub copy: &'a [u8],
    pub spans: &'a [TailSpan],
    pub tail: &'a [u8],
}

impl<'a> UserStack<'a> {
    /// A stack with no tail.
    pub fn copy_only(copy: &'a [u8]) -> Self {
        Self {
            copy,
            ..Self::default()
        }
    }
}

/// The binary JIT frames are counted under in [`WalkStats::by_binary`].
pub const JIT_BINARY: &str = "[jit]";

/// Modules resolved per walk at most: bounds the re-walks a single sample can
/// cause (a stack through many not-yet-seen libraries).
const MAX_RESOLVES_PER_WALK: usize = 16;

/// What resolving an address found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Resolved {
    /// The module holding it, added to the process's list.
    Module,
    /// No module: not executable memory, or the process is gone.
    Nothing,
    /// A read of the process is awaited (deferred reads): the walk waits,
    /// as for a table.
    Pending,
}

/// Binaries tracked individually in [`WalkStats::by_binary`].
const MAX_BINARIES_TRACKED: usize = 1024;

/// Processes the walker keeps a record of (in the process table); beyond,
/// the least recently used one is forgotten (its maps are read and its
/// modules resolved again if it returns).
const MAX_PROCESSES: usize = table::MAX_PROCESSES;
/// Modules one process keeps; beyond, its list starts over (a process that
/// maps thousands of files is rare, and one that keeps mapping new ones
/// must not grow the walker without bound).
const MAX_MODULES_PER_PROCESS: usize = 2048;

/// The result of walking one sample's user stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Walk<'a> {
    /// Absolute addresses, innermost first; frame 0 is the sampled rip, the
    /// others are return addresses (the instruction after the call; above a
    /// signal frame, the interrupted address).
    pub frames: &'a [u64],
    /// Where each frame is, index for index with `frames`.
    pub objects: &'a [FrameObject],
    pub outcome: WalkOutcome,
    /// The walk went past the copy through the stack tail.
    pub stitched: bool,
    /// The version of the process's module list the frames were placed
    /// with: no other process and no other version has the same number, so
    /// equal frames in the same space are named the same. `None` when
    /// nothing vouches for that: a walk through JIT code, whose frames are
    /// named from perf maps, which change.
    pub space: Option<u64>,
}

/// Which object a frame's address is in, and the address in that object's
/// own terms: what the frame is shipped as.
///
/// A return address is placed by the byte before it (the call instruction):
/// a call can be the last instruction of a function, or of a mapping, and
/// the address after it is then in the next one. The offsets themselves are
/// those of the addresses as walked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameObject {
    /// In a mapping of an identified file: `file_offset = pc - mapping.start
    /// + mapping.offset`.
    File {
        file: Arc<ModuleFile>,
        file_offset: u64,
    },
    /// In the vDSO: `offset = pc - start of the [vdso] mapping`, an address
    /// in its image (the same image in every process on this kernel).
    Vdso { offset: u64 },
    /// In executable memory no file backs (JIT code): the absolute
    /// address, which the process's perf map may name.
    Jit { address: u64 },
    /// In a HotSpot interpreter frame (JIT code too): the absolute address
    /// and the `Method*` the frame ran, as its stack held it.
    JavaInterpreted { address: u64, method: u64 },
    /// In a file that could not be reached (its process exited and no
    /// root holds it): the path it was mapped from and the file offset.
    Unreadable { path: Arc<str>, file_offset: u64 },
    /// In no module the walker knows (a garbage return address, code
    /// mapped after the process's maps were read): the absolute address,
    /// meaningful only as a hint.
    Anonymous { address: u64 },
}

impl FrameObject {
    pub fn is_jit(&self) -> bool {
        matches!(
            self,
            FrameObject::Jit { .. } | FrameObject::JavaInterpreted { .. }
        )
    }
}

/// One walk as handed to the callback of [`StackWalker::push`],
/// [`StackWalker::poll`] and [`StackWalker::flush`]: the sample it belongs
/// to and the kernel frames pushed with it (kept while the sample waited for
/// a table).
#[derive(Debug)]
pub struct Walked<'a, R = ProcessState> {
    pub header: &'a SampleHeader,
    /// Kernel addresses, innermost first, as pushed.
    pub kernel_frames: &'a [u64],
    pub walk: Walk<'a>,
    /// The process's record in the table the walker was lent, if it still
    /// has one: what the owner keeps of the process beside the walker.
    pub record: Option<&'a mut R>,
}

/// How a walk ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WalkOutcome {
    /// The unwinder stopped for this reason.
    Ended(UnwindEnd),
    /// The walk reached a module whose table is still being compiled (or,
    /// with deferred reads, an address whose process is being read); the
    /// frames so far are correct but incomplete.
    TablePending,
}

/// How walks ended: all of them, and those of one binary.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct WalkEnds {
    pub walks: u64,
    /// Walks that reached the outermost frame (`_start`, a thread's entry),
    /// stitched ones included.
    pub outermost: u64,
    /// Walks that reached it through the stack tail (past the copy).
    pub stitched: u64,
    /// Walks that ran out of stack bytes.
    pub truncated: u64,
}

impl WalkEnds {
    fn add(&mut self, outcome: WalkOutcome, stitched: bool) {
        let outermost = outcome == WalkOutcome::Ended(UnwindEnd::Outermost);
        self.walks += 1;
        self.outermost += u64::from(outermost);
        self.stitched += u64::from(outermost && stitched);
        self.truncated += u64::from(outcome == WalkOutcome::Ended(UnwindEnd::StackTruncated));
    }

    fn percent(&self, n: u64) -> f64 {
        if self.walks == 0 {
            0.0
        } else {
            100.0 * n as f64 / self.walks as f64
        }
    }

    /// Share of walks that reached the outermost frame, in percent.
    pub fn outermost_percent(&self) -> f64 {
        self.percent(self.outermost)
    }

    /// Share of walks that reached it through the stack tail, in percent.
    pub fn stitched_percent(&self) -> f64 {
        self.percent(self.stitched)
    }

    /// Share of walks that ran out of stack bytes, in percent.
    pub fn truncated_percent(&self) -> f64 {
        self.percent(self.truncated)
    }
}

/// Walks that stopped before the outermost frame with stack bytes left, by
/// reason: what to look at when a program's share reaching the root is low.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct EarlyEnds {
    /// A return address in no known mapping (or a frame-pointer chain that
    /// led nowhere).
    pub unmapped: u64,
    /// Code whose module has CFI, but none for that address.
    pub no_unwind_info: u64,
    /// CFI the unwinder cannot evaluate.
    pub unsupported: u64,
    /// Code that switches stacks (Go's `systemstack`, `morestack`, ...):
    /// the caller is on another stack, which the sample did not copy.
    pub stack_switch: u64,
    /// Corrupt frames: a CFA not above the previous one, or an address
    /// below the copy.
    pub corrupt: u64,
    pub depth_limit: u64,
    /// A table was still being compiled.
    pub table_pending: u64,
}

impl EarlyEnds {
    /// Each count with what it means, for the report.
    pub fn by_reason(&self) -> [(u64, &'static str); 7] {
        [
            (self.unmapped, "at an address in no known mapping"),
            (self.no_unwind_info, "in code without unwind info"),
            (self.unsupported, "at CFI the unwinder cannot evaluate"),
            (self.stack_switch, "where the code switches stacks"),
            (self.corrupt, "at a corrupt frame"),
            (self.depth_limit, "at --max-depth"),
            (self.table_pending, "waiting for a table"),
        ]
    }

    fn add(&mut self, outcome: WalkOutcome) {
        let counter = match outcome {
            WalkOutcome::TablePending => &mut self.table_pending,
            WalkOutcome::Ended(end) => match end {
                UnwindEnd::Outermost | UnwindEnd::StackTruncated => return,
                UnwindEnd::Unmapped => &mut self.unmapped,
                UnwindEnd::NoUnwindInfo => &mut self.no_unwind_info,
                UnwindEnd::Unsupported(UnsupportedCfi::StackSwitch) => &mut self.stack_switch,
                UnwindEnd::Unsupported(_) => &mut self.unsupported,
                UnwindEnd::CfaNotIncreasing | UnwindEnd::BadStackAddress => &mut self.corrupt,
                UnwindEnd::DepthLimit => &mut self.depth_limit,
            },
        };
        *counter += 1;
    }
}

/// How walks ended, overall and per binary of the sampled instruction.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WalkStats {
    pub walks: u64,
    /// Walks that reached the outermost frame (`_start`, a thread's entry).
    pub outermost: u64,
    /// Of those, walks that reached it through the stack tail.
    pub stitched: u64,
    /// Walks that ran out of stack bytes (copy and tail).
    pub truncated: u64,
    /// Kernel ticks whose saved user instruction pointer is in no mapping
    /// the walker knows (inside execve after the old image went, in exit
    /// after the memory was torn down, or in a process whose mappings were
    /// never learned): counted as kernel samples, not as walks.
    pub kernel_ticks_unplaced: u64,
    /// Walks with at least one frame in JIT code, and of those, walks
    /// that reached the outermost frame.
    pub jit_walks: u64,
    pub jit_outermost: u64,
    /// Why the walks that neither reached the outermost frame nor ran out
    /// of stack bytes stopped.
    pub early_ends: EarlyEnds,
    /// Per binary holding frame 0, by the slot the walker gave its name
    /// when it first resolved a module of it (see [`BinarySlots`]); binaries
    /// without walks yet have empty ends. [`Self::binaries`] lists those
    /// with walks.
    pub by_binary: Vec<(Arc<str>, WalkEnds)>,
    /// Adaptive copies and learned stack tails.
    pub plans: PlanStats,
    /// Times every process's state was dropped because exec or exit
    /// records were lost.
    pub state_resets: u64,
    /// Processes whose state was dropped because a sample showed their pid
    /// in use by a process that started later (the exit record was lost).
    pub processes_replaced: u64,
    /// Tables compiled, read back from the disk cache, and objects whose
    /// table could not be built (they are walked with frame pointers).
    pub tables_compiled: u64,
    pub tables_from_disk: u64,
    pub tables_failed: u64,
    /// Tables no live process used, dropped for their bound (the unused
    /// tables' share of the memory budget): compiled again, or read from
    /// the disk cache, when a process maps the file again.
    pub tables_evicted: u64,
    /// Module resolutions answered by the in-memory table cache.
    pub table_cache_hits: u64,
    /// Walks that ended short because a table was still being compiled.
    pub table_pending: u64,
    /// Rules read from a binary's CFI directly while its table compiled
    /// (one per address a walk's step cache did not hold).
    pub rules_read_directly: u64,
    /// Samples held for a table being compiled, and those that found the
    /// queue full.
    pub samples_queued: u64,
    pub queue_full: u64,
}

impl WalkStats {
    /// All walks' ends.
    pub fn ends(&self) -> WalkEnds {
        WalkEnds {
            walks: self.walks,
            outermost: self.outermost,
            stitched: self.stitched,
            truncated: self.truncated,
        }
    }

    /// Share of walks that reached the outermost frame, in percent.
    pub fn outermost_percent(&self) -> f64 {
        self.ends().outermost_percent()
    }

    /// The binaries of frame 0 with their walks' ends, those with walks only.
    pub fn binaries(&self) -> impl Iterator<Item = (&str, WalkEnds)> {
        self.by_binary
            .iter()
            .filter(|(_, ends)| ends.walks > 0)
            .map(|(name, ends)| (&**name, *ends))
    }
}

/// Slots of binary names in [`WalkStats::by_binary`], given when a module
/// of the binary is first resolved, so a walk counts its frame 0's binary by
/// index instead of hashing its name. At most [`MAX_BINARIES_TRACKED`]
/// names get one; later ones share [`Self::UNTRACKED`] and are not counted.
#[derive(Debug, Default)]
struct BinarySlots {
    by_name: HashMap<Arc<str>, u32>,
}

impl BinarySlots {
    const UNTRACKED: u32 = u32::MAX;

    /// The slot of `name`, given now (with an empty entry in `by_binary`)
    /// if it has none yet.
    fn slot(&mut self, name: Arc<str>, by_binary: &mut Vec<(Arc<str>, WalkEnds)>) -> u32 {
        if let Some(&slot) = self.by_name.get(&name) {
            return slot;
        }
        if by_binary.len() >= MAX_BINARIES_TRACKED {
            return Self::UNTRACKED;
        }
        let slot = by_binary.len() as u32;
        by_binary.push((Arc::clone(&name), WalkEnds::default()));
        self.by_name.insert(name, slot);
        slot
    }
}

/// One module of a process: an executable mapping and how to unwind it.
#[derive(Debug, Clone)]
struct Module {
    start: u64,
    end: u64,
    /// `pc - bias` is the address in the file's ELF virtual address space.
    bias: u64,
    /// `pc - file_base` is the offset in the file (in the vDSO image for the
    /// vDSO): `start - mapping offset`, wrapping.
    file_base: u64,
    table: ModuleTable,
    /// Its binary's slot in [`WalkStats::by_binary`].
    binary: u32,
    object: ModuleObject,
}

/// What a module's frames are reported as.
#[derive(Debug, Clone)]
enum ModuleObject {
    File(Arc<ModuleFile>),
    Vdso,
    Jit,
    /// A file that could not be reached, by the path the process mapped.
    Unreadable(Arc<str>),
}

impl Module {
    fn contains(&self, pc: u64) -> bool {
        self.start <= pc && pc < self.end
    }

    /// Makes `object` this module's object for `pc`, keeping its `Arc`
    /// when it already names this module's file.
    fn place(&self, pc: u64, object: &mut FrameObject) {
        match (&self.object, object) {
            (
                ModuleObject::File(file),
                FrameObject::File {
                    file: placed,
                    file_offset,
                },
            ) if Arc::ptr_eq(file, placed) => *file_offset = pc.wrapping_sub(self.file_base),
            (_, object) => *object = self.frame_object(pc),
        }
    }

    fn frame_object(&self, pc: u64) -> FrameObject {
        let offset = pc.wrapping_sub(self.file_base);
        match &self.object {
            ModuleObject::File(file) => FrameObject::File {
                file: Arc::clone(file),
                file_offset: offset,
            },
            ModuleObject::Vdso => FrameObject::Vdso { offset },
            ModuleObject::Jit => FrameObject::Jit { address: pc },
            ModuleObject::Unreadable(path) => FrameObject::Unreadable {
                path: Arc::clone(path),
                file_offset: offset,
            },
        }
    }
}

#[derive(Debug, Clone)]
enum ModuleTable {
    /// A module whose table says its code without rows keeps frame
    /// pointers is walked by them there (see [`ModuleAt::Table`]).
    Ready(Arc<UnwindTable>),
    /// No usable CFI: walk with frame pointers.
    NoCfi,
    /// Being compiled in the background; a large object's rules meanwhile
    /// read from its CFI directly, where it has them.
    Pending(ObjectId, Option<Arc<DirectCfi>>),
    /// The file could not be reached or identified (its process is gone
    /// and no root holds it): nothing to unwind with.
    Unreadable,
}

/// The unwinder's view of one process during a walk: answers from the known
/// modules and remembers the first address it could not place.
struct KnownModules<'a> {
    process: &'a ProcessState,
    unknown: Cell<Option<u64>>,
    /// The walk reached a module whose table is still being compiled, at
    /// an address its CFI could not answer directly.
    pending: Cell<bool>,
    /// Rules read from a compiling module's CFI directly.
    read_directly: Cell<u64>,
    /// The walk's HotSpot interpreter frames: (frame, `Method*`).
    interpreted: RefCell<Vec<(usize, u64)>>,
}

impl<'a> KnownModules<'a> {
    fn new(process: &'a ProcessState) -> Self {
        Self {
            process,
            unknown: Cell::new(None),
            pending: Cell::new(false),
            read_directly: Cell::new(0),
            interpreted: RefCell::new(Vec::new()),
        }
    }
}

impl ModuleLookup for KnownModules<'_> {
    fn module_for(&self, pc: u64) -> ModuleAt<'_> {
        let Some(module) = self.process.find(pc) else {
            if self.unknown.get().is_none() {
                self.unknown.set(Some(pc));
            }
            return ModuleAt::Unmapped;
        };
        if let ModuleObject::Jit = module.object {
            if let Some(runtime) = &self.process.runtime {
                return ModuleAt::Runtime(&**runtime);
            }
            if self.process.runtime_pending {
                self.pending.set(true);
                return ModuleAt::Unmapped;
            }
        }
        match &module.table {
            ModuleTable::Ready(table) => ModuleAt::Table {
                table,
                bias: module.bias,
                frame_pointer_gaps: table.frame_pointer_gaps(),
            },
            ModuleTable::NoCfi => ModuleAt::NoCfi,
            ModuleTable::Pending(_, direct) => {
                let rule = direct
                    .as_ref()
                    .and_then(|direct| direct.rule_at(pc.checked_sub(module.bias)?));
                if let Some(rule) = rule {
                    self.read_directly.set(self.read_directly.get() + 1);
                    return ModuleAt::Rule(rule);
                }
                self.pending.set(true);
                ModuleAt::Unmapped
            }
            // Its frames are placed and named by path, but how to step
            // out of them is unknown: the walk ends there.
            ModuleTable::Unreadable => ModuleAt::Unmapped,
        }
    }

    fn interpreted_frame(&self, frame: usize, method: u64) {
        self.interpreted.borrow_mut().push((frame, method));
    }
}

/// Tables by object identity, bounded by bytes over the tables that no
/// process module holds any more.
#[derive(Default)]
struct TableCache {
    by_object: HashMap<ObjectId, CachedTable>,
    tick: u64,
    /// Bytes of every ready table held, used or not: while they fit the
    /// bound, the unused ones do, and no pass over the tables is needed.
    ready_bytes: usize,
}

struct CachedTable {
    table: ModuleTable,
    last_used: u64,
}

impl CachedTable {
    fn ready_bytes(table: &ModuleTable) -> usize {
        match table {
            ModuleTable::Ready(table) => table.heap_bytes(),
            _ => 0,
        }
    }

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

    /// Returns how many unused tables went for it.
    fn insert(&mut self, id: ObjectId, table: ModuleTable, max_bytes: usize) -> u64 {
        self.tick += 1;
        self.ready_bytes += CachedTable::ready_bytes(&table);
        let replaced = self.by_object.insert(
            id,
            CachedTable {
                table,
                last_used: self.tick,
            },
        );
        if let Some(replaced) = replaced {
            self.ready_bytes -= CachedTable::ready_bytes(&replaced.table);
        }
        self.evict_unused(max_bytes)
    }

    fn remove(&mut self, id: &ObjectId) {
        if let Some(removed) = self.by_object.remove(id) {
            self.ready_bytes -= CachedTable::ready_bytes(&removed.table);
        }
    }

    /// Drops the least recently used tables that no process holds (their
    /// `Arc` is only ours) until the unused ones fit in `max_bytes`.
    /// Returns how many went.
    fn evict_unused(&mut self, max_bytes: usize) -> u64 {
        // Runs after every drain: no pass while every table fits, one when
        // the unused ones do.
        if self.ready_bytes <= max_bytes {
            return 0;
        }
        let mut unused_bytes: usize = self
            .by_object
            .values()
            .filter_map(CachedTable::unused_table)
            .map(|t| t.heap_bytes())
            .sum();
        let mut evicted = 0;
        while unused_bytes > max_bytes {
            let oldest = self
                .by_object
                .iter()
                .filter_map(|(id, e)| Some((id, e.last_used, e.unused_table()?.heap_bytes())))
                .min_by_key(|&(_, last_used, _)| last_used)
                .map(|(id, _, bytes)| (*id, bytes));
            let Some((id, bytes)) = oldest else {
                break;
            };
            self.remove(&id);
            unused_bytes -= bytes;
            evicted += 1;
        }
        evicted
    }
}

/// Walks samples' user stacks; keeps what it learns about processes between
/// samples.
pub struct StackWalker {
    /// The record of the sample being walked, for its planning.
    last_process: Option<Slot>,
    tables: TableCache,
    table_cache_bytes: usize,
    /// The vDSO's table, built from this agent's own vDSO: every process on
    /// the host maps the same image (same kernel).
    vdso: ModuleTable,
    compiler: Compiler,
    /// A table was installed since the waiting samples were last retried.
    tables_changed: bool,
    waiting: VecDeque<WaitingSample>,
    waiting_bytes: usize,
    max_waiting_bytes: usize,
    frames: Vec<u64>,
    /// Index for index with `frames`, filled after each walk; entries past
    /// the walk's frames are kept from deeper walks (see `placed`).
    objects: Vec<FrameObject>,
    rules: RuleCache,
    /// The last address-space number handed out (see `ProcessState::space`).
    spaces: u64,
    max_depth: usize,
    planner: Planner,
    /// Where deep programs are remembered across restarts (see
    /// `remembered`); `None`: not at all.
    remembered_dir: Option<PathBuf>,
    /// The last walk: whether it read the tail, how much copy it read,
    /// and its `Walk::space` (`None`: it went through JIT code).
    last_tail_reads: u32,
    last_copy_read: u64,
    last_space: Option<u64>,
    /// Frames of learning walks (kept apart from the delivered walk's).
    learn_frames: Vec<u64>,
    /// The binary of the last walk's frame 0 (found while placing frames),
    /// and the name of none, shared rather than allocated per sample.
    frame0_binary: u32,
    /// The slots of the binary name of frames in no module, and of JIT
    /// modules.
    unknown_binary: u32,
    /// The binary name of JIT modules, shared by all of them.
    jit_binary: u32,
    binary_slots: BinarySlots,
    /// Processes that exited while samples of theirs waited for a table.
    exited: Vec<u32>,
    /// Processes let go of since the owner last asked
    /// ([`Self::take_completed_exits`]).
    completed_exits: Vec<u32>,
    stats: WalkStats,
}

/// A sample held until the table it needs is compiled.
struct WaitingSample {
    header: SampleHeader,
    kernel_frames: Vec<u64>,
    copy: Vec<u8>,
    spans: Vec<TailSpan>,
    tail: Vec<u8>,
}

impl WaitingSample {
    /// What holding it costs, for the `max_waiting_bytes` bound.
    fn bytes(&self) -> usize {
        self.copy.len()
            + self.tail.len()
            + self.spans.len() * std::mem::size_of::<TailSpan>()
            + self.kernel_frames.len() * 8
    }

    fn stack(&self) -> UserStack<'_> {
        UserStack {
            copy: &self.copy,
            spans: &self.spans,
            tail: &self.tail,
        }
    }
}

/// A learning walk's memory, or a sample's: both can be walked again after
/// a module was resolved.
trait WalkMemory: StackMemory {
    fn restart(&mut self);
}

impl WalkMemory for SampledStack<'_> {
    fn restart(&mut self) {
        SampledStack::restart(self);
    }
}

impl WalkMemory for RemoteStack<'_> {
    fn restart(&mut self) {
        RemoteStack::restart(self);
    }
}

impl Default for StackWalker {
    fn default() -> Self {
        Self::new(WalkerConfig::default())
    }
}

impl StackWalker {
    /// A process table for a walker made with `config` (reads deferred
    /// or not, bounded as the walker's state is), whose records are `R`.
    pub fn process_table<R: WalkerRecord>(config: &WalkerConfig) -> ProcessTable<R> {
        ProcessTable::with_owner_state(TableConfig {
            defer_reads: config.defer_reads,
            max_processes: MAX_PROCESSES,
            ..TableConfig::default()
        })
    }

    pub fn new(config: WalkerConfig) -> Self {
        let mut planner =
            Planner::new(config.stack_bytes, config.deep_stack_bytes, config.adaptive);
        // Deep programs are remembered only where tables are, and only
        // when deep copies are made at all.
        let remembered_dir = config
            .disk_cache
            .as_ref()
            .filter(|_| config.adaptive && config.deep_stack_bytes > 0)
            .map(|cache| cache.dir.clone());
        if let Some(dir) = &remembered_dir {
            let loaded = remembered::load(dir);
            planner.remember_deep_programs(&loaded.comms, loaded.refused);
        }
        let mut stats = WalkStats::default();
        let mut binary_slots = BinarySlots::default();
        let unknown_binary = binary_slots.slot("[unknown]".into(), &mut stats.by_binary);
        let jit_binary = binary_slots.slot(JIT_BINARY.into(), &mut stats.by_binary);
        Self {
            last_process: None,
            tables: TableCache::default(),
            table_cache_bytes: config.table_cache_bytes,
            vdso: own_vdso_table().map_or(ModuleTable::NoCfi, ModuleTable::Ready),
            compiler: Compiler::start(config.compile_threads, config.disk_cache),
            tables_changed: false,
            waiting: VecDeque::new(),
            waiting_bytes: 0,
            max_waiting_bytes: config.max_waiting_bytes,
            frames: Vec::with_capacity(config.max_depth.min(4096)),
            objects: Vec::with_capacity(config.max_depth.min(4096)),
            rules: RuleCache::default(),
            spaces: 0,
            max_depth: config.max_depth,
            planner,
            remembered_dir,
            last_tail_reads: 0,
            last_space: None,
            last_copy_read: 0,
            learn_frames: Vec::new(),
            frame0_binary: unknown_binary,
            unknown_binary,
            jit_binary,
            binary_slots,
            exited: Vec::new(),
            completed_exits: Vec::new(),
            stats,
        }
    }

    /// The one way a process's record goes: whatever removed it from the
    /// process table (an exit, an exec, a fork over its pid, a read that
    /// found it gone, the table's bound), what the planner wrote for it
    /// (its copy size and its threads' plans, in the sampler's maps too)
    /// goes with it. The record is then handed on to the table's owner
    /// ([`ProcessTable::take_released`]), for what else it held.
    fn let_go_of_dropped<R: WalkerRecord>(&mut self, processes: &mut ProcessTable<R>) {
        for (tgid, mut record) in processes.take_dropped() {
            let copy = record.walker_state_mut().copy.take();
            self.planner.forget_process(tgid, copy);
            processes.release(tgid, record);
        }
    }

    fn binary_slot(&mut self, name: Arc<str>) -> u32 {
        self.binary_slots.slot(name, &mut self.stats.by_binary)
    }

    /// A runtime that describes process `tgid`'s JIT code is being read:
    /// its samples that reach that code are held until
    /// [`Self::set_runtime`] says what came of it.
    pub fn await_runtime<R: WalkerRecord>(&mut self, processes: &mut ProcessTable<R>, tgid: u32) {
        if let Some(process) = processes.walker_of_mut(tgid) {
            process.runtime_pending = true;
        }
    }

    /// Has the walks of process `tgid`'s JIT code ask `runtime` how to step
    /// out of its frames (`None`: there is none to ask, they go by frame
    /// pointers), and walks its held samples again. A process given a
    /// runtime takes a new space: the rule cache's steps for its code until
    /// now (frame pointers) no longer apply.
    pub fn set_runtime<R: WalkerRecord>(
        &mut self,
        processes: &mut ProcessTable<R>,
        tgid: u32,
        runtime: Option<Arc<dyn RuntimeCode + Send + Sync>>,
    ) {
        let space = self.next_space();
        if let Some(process) = processes.walker_of_mut(tgid) {
            if runtime.is_some() {
                process.space = space;
            }
            process.runtime = runtime;
            process.runtime_pending = false;
            self.tables_changed = true;
        }
    }

    fn next_space(&mut self) -> u64 {
        self.spaces += 1;
        self.spaces
    }

    /// Walks a sample, or holds a copy of it (with its kernel frames) while
    /// a table it needs compiles. Every finished walk (this sample's, or
    /// earlier held ones whose tables are now ready) goes to `on_walk`;
    /// kernel-only samples produce none.
    pub fn push<R: WalkerRecord>(
        &mut self,
        processes: &mut ProcessTable<R>,
        header: &SampleHeader,
        kernel_frames: &[u64],
        stack: UserStack<'_>,
        mut on_walk: impl FnMut(Walked<'_, R>),
    ) {
        // Held samples first: they are older, and walking them reuses the
        // frame buffers, so this sample's walk must come after.
        self.take_compiled_tables(processes);
        if self.tables_changed {
            self.retry_waiting(processes, &mut on_walk);
        }
        let mut walked = self
            .walk_sample(processes, header, stack, Identity::Checked)
            .map(|walk| walk.map(|walk| walk.outcome));
        if walked.is_err() {
            // The pid now names another process (its exit record was lost):
            // the old one's held samples go as far as its state takes them,
            // then that state goes.
            self.flush_process(processes, header.tgid, &mut on_walk);
            self.forget_process(processes, header.tgid);
            walked = self
                .walk_sample(processes, header, stack, Identity::Unchecked)
                .map(|walk| walk.map(|walk| walk.outcome));
        }
        match walked.ok().flatten() {
            None => {}
            Some(WalkOutcome::TablePending) if self.hold(header, kernel_frames, stack) => {}
            Some(outcome) => self.deliver(
                processes,
                header,
                kernel_frames,
                stack,
                outcome,
                &mut on_walk,
            ),
        }
    }

    /// The changes for the sampler's copy-size and stack-plan maps decided
    /// since the last call; the sampling thread writes them.
    pub fn take_plan_updates(&mut self) -> Vec<PlanUpdate> {
        self.planner.take_updates()
    }

    /// Thread `tid`'s stack top is no longer in the sampler's table (a
    /// full set gave it up): its next walk to the root writes it again.
    pub fn top_evicted(&mut self, tid: u32) {
        self.planner.top_evicted(tid);
    }

    /// Process `tgid`'s CPython frames are read from now on: the stack
    /// tops written for its threads go (see [`Planner::forget_tops`]).
    pub fn forget_tops(&mut self, tgid: u32) {
        self.planner.forget_tops(tgid);
    }

    /// Walks held samples whose tables have become ready; call it now and
    /// then, so samples do not wait for the next sample to arrive.
    pub fn poll<R: WalkerRecord>(
        &mut self,
        processes: &mut ProcessTable<R>,
        mut on_walk: impl FnMut(Walked<'_, R>),
    ) {
        self.take_compiled_tables(processes);
        if self.tables_changed {
            self.retry_waiting(processes, &mut on_walk);
        }
    }

    fn flush_process<R: WalkerRecord>(
        &mut self,
        processes: &mut ProcessTable<R>,
        tgid: u32,
        on_walk: &mut impl FnMut(Walked<'_, R>),
    ) {
        if !self.waiting.iter().any(|held| held.header.tgid == tgid) {
            return;
        }
        let (theirs, others) = std::mem::take(&mut self.waiting)
            .into_iter()
            .partition(|held| held.header.tgid == tgid);
        self.waiting = others;
        // What the process maps is about to be forgotten (it exec'd, or
        // its pid is another process's): a read asked for would come too
        // late for these, so they read on this thread, this once.
        let deferred = processes.set_defer_reads(false);
        for held in theirs {
            self.waiting_bytes -= held.bytes();
            self.walk_as_far_as_it_goes(processes, &held, on_walk);
        }
        processes.set_defer_reads(deferred);
    }

    /// Walks a held sample with what is known now, pending tables or not.
    fn walk_as_far_as_it_goes<R: WalkerRecord>(
        &mut self,
        processes: &mut ProcessTable<R>,
        held: &WaitingSample,
        on_walk: &mut impl FnMut(Walked<'_, R>),
    ) {
        if let Ok(Some(outcome)) = self
            .walk_sample(processes, &held.header, held.stack(), Identity::Unchecked)
            .map(|w| w.map(|w| w.outcome))
        {
            self.deliver(
                processes,
                &held.header,
                &held.kernel_frames,
                held.stack(),
                outcome,
                on_walk,
            );
        }
    }

    fn forget_process<R: WalkerRecord>(&mut self, processes: &mut ProcessTable<R>, tgid: u32) {
        self.exited.retain(|&exited| exited != tgid);
        self.forget_exited(processes, tgid);
        self.stats.processes_replaced += 1;
    }

    /// Walks every held sample as far as it goes now (at shutdown).
    pub fn flush<R: WalkerRecord>(
        &mut self,
        processes: &mut ProcessTable<R>,
        mut on_walk: impl FnMut(Walked<'_, R>),
    ) {
        self.poll(processes, &mut on_walk);
        for held in std::mem::take(&mut self.waiting) {
            self.walk_as_far_as_it_goes(processes, &held, &mut on_walk);
        }
        self.waiting_bytes = 0;
        self.forget_walked_exits(processes);
    }

    /// Samples held for a table right now.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    fn hold(&mut self, header: &SampleHeader, kernel_frames: &[u64], stack: UserStack<'_>) -> bool {
        let held = WaitingSample {
            header: *header,
            kernel_frames: kernel_frames.to_vec(),
            copy: stack.copy.to_vec(),
            spans: stack.spans.to_vec(),
            tail: stack.tail.to_vec(),
        };
        if self.waiting_bytes + held.bytes() > self.max_waiting_bytes {
            self.stats.queue_full += 1;
            return false;
        }
        self.stats.samples_queued += 1;
        self.waiting_bytes += held.bytes();
        self.waiting.push_back(held);
        true
    }

    fn retry_waiting<R: WalkerRecord>(
        &mut self,
        processes: &mut ProcessTable<R>,
        on_walk: &mut impl FnMut(Walked<'_, R>),
    ) {
        self.tables_changed = false;
        for held in std::mem::take(&mut self.waiting) {
            match self
                .walk_sample(processes, &held.header, held.stack(), Identity::Unchecked)
                .ok()
                .flatten()
                .map(|w| w.outcome)
            {
                Some(WalkOutcome::TablePending) => self.waiting.push_back(held),
                Some(outcome) => {
                    self.waiting_bytes -= held.bytes();
                    self.deliver(
                        processes,
                        &held.header,
                        &held.kernel_frames,
                        held.stack(),
                        outcome,
                        on_walk,
                    );
                }
                None => self.waiting_bytes -= held.bytes(),
            }
        }
        self.forget_walked_exits(processes);
    }

    /// Processes that exited while samples of theirs were held go once
    /// none is held any more.
    fn forget_walked_exits<R: WalkerRecord>(&mut self, processes: &mut ProcessTable<R>) {
        if self.exited.is_empty() {
            return;
        }
        let exited = std::mem::take(&mut self.exited);
        for tgid in exited {
            if self.waiting.iter().any(|held| held.header.tgid == tgid) {
                self.exited.push(tgid);
            } else {
                self.forget_exited(processes, tgid);
            }
        }
    }

    /// Counts the walk just made, hands it to `on_walk`, then tells the
    /// planner how it went (which may learn the thread's deep frames).
    fn deliver<R: WalkerRecord>(
        &mut self,
        processes: &mut ProcessTable<R>,
        header: &SampleHeader,
        kernel_frames: &[u64],
        stack: UserStack<'_>,
        outcome: WalkOutcome,
        on_walk: &mut impl FnMut(Walked<'_, R>),
    ) {
        let stitched = self.last_tail_reads > 0;
        if self.frames.is_empty() {
            self.stats.kernel_ticks_unplaced += 1;
        } else {
            self.record(outcome, stitched);
        }
        on_walk(Walked {
            header,
            kernel_frames,
            record: self.last_process.and_then(|slot| processes.state_at(slot)),
            walk: Walk {
                frames: &self.frames,
                objects: self.placed(),
                outcome,
                stitched,
                space: self.last_space,
            },
        });
        let WalkOutcome::Ended(end) = outcome else {
            return;
        };
        let report = WalkReport {
            tgid: header.tgid,
            tid: header.tid,
            comm: header.comm,
            ktime_ns: header.ktime_ns,
            rsp: header.user_rsp,
            copied: stack.copy.len() as u32,
            copy_at_top: header.flags & sample_flags::COPY_AT_TOP != 0,
            deep_copy: header.flags & sample_flags::DEEP_COPY != 0,
            // A copy with unread pages is one that faulted, for the counts
            // of truncated walks and for learning (see `learn`).
            copy_faulted: header.flags
                & (sample_flags::USER_STACK_FAULTED | sample_flags::COPY_HOLES)
                != 0,
            copy_bytes_read: self.last_copy_read,
            tail_reads: self.last_tail_reads,
            end,
        };
        let copy = self
            .last_process
            .and_then(|slot| processes.walker_at(slot))
            .map(|process| &mut process.copy);
        if self.planner.observe(&report, copy) {
            self.learn(processes, header, stack.copy, &report);
            self.remember_deep_programs(processes);
        }
    }

    /// Keeps the programs just found to need deep copies beside the table
    /// cache, by their executable's build-id (read from the file the
    /// process ran, which outlives a compiler's process), for the next
    /// agent. Once per program and agent: at most `MAX_DEEP_PROGRAMS`
    /// small writes in an agent's life.
    fn remember_deep_programs<R: WalkerRecord>(&mut self, processes: &ProcessTable<R>) {
        let newly_deep = self.planner.take_newly_deep();
        let Some(dir) = &self.remembered_dir else {
            return;
        };
        for (tgid, comm) in newly_deep {
            let exe = processes
                .learned_exe(tgid)
                .map_or_else(|| format!("/proc/{tgid}/exe").into(), Path::to_path_buf);
            let build_id = std::fs::File::open(exe)
                .ok()
                .and_then(|file| stackscope_process_table::elf::read_summary(&file).ok())
                .and_then(|summary| summary.build_id);
            remembered::save(dir, &comm, build_id.as_ref());
        }
    }

    /// Reads the rest of the sampled thread's stack from the live process
    /// and walks it, so the planner learns which deep words to ask for.
    fn learn<R: WalkerRecord>(
        &mut self,
        processes: &mut ProcessTable<R>,
        header: &SampleHeader,
        copy: &[u8],
        report: &WalkReport,
    ) {
        let mut planner = std::mem::replace(&mut self.planner, Planner::new(0, 0, false));
        planner.learn(report, copy, |memory| {
            let mut frames = std::mem::take(&mut self.learn_frames);
            let (end, _) = self
                .walk_memory(processes, header, memory, &mut frames, WalkUse::Learn)
                .unwrap_or((UnwindEnd::Unmapped, false));
            self.learn_frames = frames;
            end
        });
        self.planner = planner;
    }

    pub fn stats(&self) -> WalkStats {
        WalkStats {
            plans: self.planner.stats(),
            ..self.stats.clone()
        }
    }

    /// The process replaced its image (the sampler's record, once the new
    /// image is mapped): its held samples are walked with what was known
    /// of the old one, then its mappings and plans go, unless the mapping
    /// feed already saw the exec itself.
    pub fn on_exec<R: WalkerRecord>(
        &mut self,
        processes: &mut ProcessTable<R>,
        tgid: u32,
        time_ns: u64,
        mut on_walk: impl FnMut(Walked<'_, R>),
    ) {
        self.flush_process(processes, tgid, &mut on_walk);
        processes.exec(tgid, time_ns);
        self.let_go_of_dropped(processes);
    }

    /// The process exited: forget it, so a reused pid starts afresh. While
    /// samples of it wait for a table, what is known of it stays, so they
    /// can still be walked (it goes once they are). Either way
    /// [`Self::take_completed_exits`] says when it went.
    pub fn on_exit<R: WalkerRecord>(&mut self, processes: &mut ProcessTable<R>, tgid: u32) {
        if self.waiting.iter().any(|held| held.header.tgid == tgid) {
            // Once: the sweep of gone processes asks again every
            // interval while they wait.
            if !self.exited.contains(&tgid) {
                self.exited.push(tgid);
            }
            return;
        }
        self.forget_exited(processes, tgid);
    }

    /// When the process the walker knows by `tgid` started (the samples'
    /// `process_start_ns`, on `CLOCK_MONOTONIC`), if it knows one.
    pub fn process_started<R: WalkerRecord>(
        &self,
        processes: &ProcessTable<R>,
        tgid: u32,
    ) -> Option<u64> {
        processes.walker_of(tgid).map(|state| state.started)
    }

    /// The processes whose exit the walker applied since the last call
    /// (at once, or once their held samples were walked): what else is
    /// kept of them (labels, names) can go now. The owner takes them after
    /// every exit it applies; at most
    /// [`stackscope_process_table::table::MAX_PROCESSES`] wait.
    pub fn take_completed_exits(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.completed_exits)
    }

    fn forget_exited<R: WalkerRecord>(&mut self, processes: &mut ProcessTable<R>, tgid: u32) {
        processes.remove(tgid);
        self.let_go_of_dropped(processes);
        if self.completed_exits.len() < stackscope_process_table::table::MAX_PROCESSES {
            self.completed_exits.push(tgid);
        }
    }

    /// From the mapping feed: `child` forked from `parent` and maps what it
    /// maps. Samples still held for a process that had `child`'s pid are
    /// walked first.
    pub fn process_forked<R: WalkerRecord>(
        &mut self,
        processes: &mut ProcessTable<R>,
        parent: u32,
        child: u32,
        mut on_walk: impl FnMut(Walked<'_, R>),
    ) {
        // A new process: whatever is kept under its pid (an exited one
        // whose held samples kept it) is walked, then goes.
        self.flush_process(processes, child, &mut on_walk);
        if self.exited.contains(&child) {
            self.exited.retain(|&tgid| tgid != child);
            self.forget_exited(processes, child);
        }
        processes.forked(parent, child);
        self.let_go_of_dropped(processes);
    }

    /// From the mapping feed: the process called exec at `time_ns`; its
    /// mappings from now on are the events'. Samples held from before are
    /// walked first.
    pub fn process_exec_learned<R: WalkerRecord>(
        &mut self,
        processes: &mut ProcessTable<R>,
        tgid: u32,
        time_ns: u64,
        mut on_walk: impl FnMut(Walked<'_, R>),
    ) {
        self.flush_process(processes, tgid, &mut on_walk);
        self.exited.retain(|&exited| exited != tgid);
        processes.exec_learned(tgid, None, time_ns);
        self.let_go_of_dropped(processes);
    }

    /// From the mapping feed: the process mapped code. A module it replaces
    /// goes (samples held from before are walked with it first).
    pub fn process_mapped<R: WalkerRecord>(
        &mut self,
        processes: &mut ProcessTable<R>,
        tgid: u32,
        mapping: Mapping,
        build_id: Option<BuildId>,
        mut on_walk: impl FnMut(Walked<'_, R>),
    ) {
        let (start, end) = (mapping.start, mapping.end);
        let overlaps = |m: &Module| m.start < end && start < m.end;
        // JIT code remapped as JIT code (V8 flips code pages between
        // writable and executable all the time) is walked the same way:
        // nothing to forget.
        let jit_over_jit =
            |m: &Module| mapping.path.is_jit_code() && matches!(m.object, ModuleObject::Jit);
        if processes
            .walker_of(tgid)
            .is_some_and(|p| p.modules.iter().any(|m| overlaps(m) && !jit_over_jit(m)))
        {
            self.flush_process(processes, tgid, &mut on_walk);
            let space = self.next_space();
            if let Some(process) = processes.walker_of_mut(tgid) {
                process.modules.retain(|m| !overlaps(m));
                process.space = space;
            }
        }
        processes.mapped(tgid, mapping, build_id);
    }

    /// Sizes of what the walker keeps between samples.
    pub fn state_sizes<R: WalkerRecord>(
        &self,
        processes: &ProcessTable<R>,
        out: &mut Vec<StateSize>,
    ) {
        out.push(StateSize::entries(
            "process_table",
            processes.len(),
            Some(MAX_PROCESSES),
        ));
        out.push(StateSize::entries(
            "file_identities",
            processes.cached_objects(),
            Some(table::MAX_CACHED_OBJECTS),
        ));
        out.push(StateSize::entries(
            "copy_sizes",
            processes.walkers().filter(|p| p.copy.is_some()).count(),
            Some(MAX_PROCESSES),
        ));
        // Tables some process holds are bounded by the processes and their
        // modules; the rest by the cache's byte budget.
        let (mut used, mut used_bytes, mut unused, mut unused_bytes) = (0, 0, 0, 0);
        for cached in self.tables.by_object.values() {
            if let Some(table) = cached.unused_table() {
                unused += 1;
                unused_bytes += table.heap_bytes();
            } else if let ModuleTable::Ready(table) = &cached.table {
                used += 1;
                used_bytes += table.heap_bytes();
            }
        }
        out.push(StateSize::entries("unwind_tables_used", used, None).with_bytes(used_bytes, None));
        out.push(
            StateSize::entries("unwind_tables_unused", unused, None)
                .with_bytes(unused_bytes, Some(self.table_cache_bytes)),
        );
        out.push(
            StateSize::entries("samples_waiting", self.waiting.len(), None)
                .with_bytes(self.waiting_bytes, Some(self.max_waiting_bytes)),
        );
        self.planner.state_sizes(out);
    }

    /// Drops unused tables past the cache's byte bound. Tables become
    /// unused when their last process goes, not only when one is added, so
    /// this runs after every drain and every sweep as well as on each
    /// insert.
    pub fn trim_tables(&mut self) {
        self.stats.tables_evicted += self.tables.evict_unused(self.table_cache_bytes);
    }

    /// Every process something is kept for (a process whose exit record
    /// was lost, or whose late sample came after it, stays until evicted
    /// unless the sweep of gone processes finds it gone).
    pub fn tracked_processes_into<R: WalkerRecord>(
        &self,
        processes: &ProcessTable<R>,
        out: &mut Vec<u32>,
    ) {
        out.extend(processes.tgids());
        self.planner.tracked_processes_into(out);
    }

    /// Exec or exit records were lost (the ring buffer was full): any
    /// process's state may be another's now, so all of it goes and is
    /// learned again. Tables stay: they belong to files, not processes.
    pub fn forget_all_processes<R: WalkerRecord>(&mut self, processes: &mut ProcessTable<R>) {
        processes.forget_processes();
        self.let_go_of_dropped(processes);
        self.exited.clear();
        self.planner.forget_all();
        self.stats.state_resets += 1;
    }

    /// Applies the answers to reads asked for; the samples held for them
    /// are walked again on the next [`Self::poll`] or [`Self::push`].
    pub fn apply_reads<R: WalkerRecord>(
        &mut self,
        processes: &mut ProcessTable<R>,
        answers: Vec<ReadAnswer>,
    ) {
        for answer in answers {
            self.tables_changed |= processes.apply(answer);
        }
    }

    /// Walks the user stack of a sample (its header, the copied stack
    /// bytes and the tail) with what is known now; `None` when it has no
    /// user part (a kernel thread). Does not hold or count the sample:
    /// [`Self::push`] does both.
    pub fn walk<R: WalkerRecord>(
        &mut self,
        processes: &mut ProcessTable<R>,
        header: &SampleHeader,
        stack: UserStack<'_>,
    ) -> Option<Walk<'_>> {
        self.take_compiled_tables(processes);
        self.walk_sample(processes, header, stack, Identity::Unchecked)
            .ok()
            .flatten()
    }

    /// [`Self::walk`] without installing finished tables first (the
    /// callers that walk many samples do that once). With
    /// [`Identity::Checked`], an error when the walker's state for the pid
    /// is another process's (an earlier one that had the same pid).
    fn walk_sample<R: WalkerRecord>(
        &mut self,
        processes: &mut ProcessTable<R>,
        header: &SampleHeader,
        stack: UserStack<'_>,
        identity: Identity,
    ) -> Result<Option<Walk<'_>>, OtherProcess> {
        if header.flags & sample_flags::USER_REGS == 0 {
            return Ok(None);
        }
        let regs = registers(header);
        let mut memory = SampledStack::new(regs.rsp, stack.copy, stack.spans, stack.tail)
            .with_holes(header.flags & sample_flags::COPY_HOLES != 0);
        memory.prefetch();
        let mut frames = std::mem::take(&mut self.frames);
        let walked = self.walk_memory(
            processes,
            header,
            &mut memory,
            &mut frames,
            WalkUse::Sample(identity),
        );
        self.frames = frames;
        let (end, pending) = walked?;
        self.last_tail_reads = memory.tail_reads();
        self.last_copy_read = memory.copy_bytes_read();
        let outcome = if pending {
            WalkOutcome::TablePending
        } else {
            WalkOutcome::Ended(end)
        };
        let stack_unreadable = stack.copy.is_empty()
            && stack.tail.is_empty()
            && header.flags & sample_flags::USER_STACK_FAULTED != 0;
        if header.flags & sample_flags::TICK_IN_USER == 0
            && (stack_unreadable || matches!(self.placed(), [FrameObject::Anonymous { .. }]))
        {
            // A tick in the kernel whose saved user registers point into
            // nothing known to be mapped, or whose user stack could not be
            // read at all: inside execve after the old image was dropped, in
            // exit after the memory was torn down (or, with mapping events
            // off, a process gone before it was read). The sample is the
            // kernel's alone: the user part would have been one bare
            // address, which may not even be the process's now. (Whether the
            // address is still known depends on when its file was
            // identified; the unreadable stack does not.)
            self.frames.clear();
        }
        Ok(Some(Walk {
            frames: &self.frames,
            objects: self.placed(),
            outcome,
            stitched: self.last_tail_reads > 0,
            space: self.last_space,
        }))
    }

    /// Walks `memory` from `regs` into `frames`, resolving the modules the
    /// walk reaches and walking again; returns how it ended and whether a
    /// table it needs is still being compiled. A sample's walk also places
    /// its frames (see [`Self::place_frames`]). The process's modules are
    /// looked up once, unless a module has to be resolved.
    fn walk_memory<R: WalkerRecord>(
        &mut self,
        processes: &mut ProcessTable<R>,
        header: &SampleHeader,
        memory: &mut impl WalkMemory,
        frames: &mut Vec<u64>,
        used: WalkUse,
    ) -> Result<(UnwindEnd, bool), OtherProcess> {
        let (tgid, started, regs) = (header.tgid, header.process_start_ns, registers(header));
        let mut resolves = 0;
        // Records the table let go of since (to make room, or a read that
        // found a process gone) take their plans with them first.
        self.let_go_of_dropped(processes);
        loop {
            let Self {
                last_process,
                rules,
                max_depth,
                objects,
                frame0_binary,
                unknown_binary,
                last_space,
                stats,
                ..
            } = self;
            let (slot, process) = processes.walker(tgid);
            if used == WalkUse::Sample(Identity::Checked)
                && resolves == 0
                && process.is_other_process(started)
            {
                return Err(OtherProcess);
            }
            if process.started == 0 {
                process.started = started;
            }
            if matches!(used, WalkUse::Sample(_)) {
                *last_process = Some(slot);
            }
            let known = KnownModules::new(process);
            memory.restart();
            let end = unwind_memory(
                regs,
                memory,
                &known,
                rules,
                process.space,
                *max_depth,
                frames,
            );
            let (unknown, pending) = (known.unknown.get(), known.pending.get());
            let interpreted = known.interpreted.take();
            stats.rules_read_directly += known.read_directly.get();
            let resolvable = end == UnwindEnd::Unmapped
                && !pending
                && resolves < MAX_RESOLVES_PER_WALK
                && unknown.is_some();
            if !resolvable {
                if matches!(used, WalkUse::Sample(_)) {
                    *last_space = place_frames(
                        Some(process),
                        frames,
                        objects,
                        frame0_binary,
                        *unknown_binary,
                    );
                    mark_interpreted(objects, &interpreted);
                }
                return Ok((end, pending));
            }
            let resolved =
                unknown.map_or(Resolved::Nothing, |pc| self.resolve(processes, tgid, pc));
            if resolved != Resolved::Module {
                if matches!(used, WalkUse::Sample(_)) {
                    self.place_frames_of(processes, tgid, frames);
                    mark_interpreted(&mut self.objects, &interpreted);
                }
                return Ok((end, resolved == Resolved::Pending));
            }
            resolves += 1;
        }
    }

    /// Places the frames of a walk of `tgid` made outside
    /// [`Self::walk_memory`]'s lookup (see [`place_frames`]).
    fn place_frames_of<R: WalkerRecord>(
        &mut self,
        processes: &mut ProcessTable<R>,
        tgid: u32,
        frames: &[u64],
    ) {
        self.last_space = place_frames(
            processes.walker_of(tgid),
            frames,
            &mut self.objects,
            &mut self.frame0_binary,
            self.unknown_binary,
        );
    }

    /// The objects of the last walk's frames.
    fn placed(&self) -> &[FrameObject] {
        // `place_frames` placed every frame: the slice is whole.
        debug_assert!(self.objects.len() >= self.frames.len());
        self.objects.get(..self.frames.len()).unwrap_or_default()
    }

    /// Installs the tables the background compiler has finished.
    fn take_compiled_tables<R: WalkerRecord>(&mut self, processes: &mut ProcessTable<R>) {
        while let Some((id, result)) = self.compiler.finished() {
            let table = match result {
                Compiled::Table { table, from_disk } => {
                    if from_disk {
                        self.stats.tables_from_disk += 1;
                    } else {
                        self.stats.tables_compiled += 1;
                    }
                    ModuleTable::Ready(table)
                }
                Compiled::NoCfi => {
                    self.stats.tables_failed += 1;
                    ModuleTable::NoCfi
                }
                Compiled::Unreadable => {
                    // Transient (the process exited before its file was
                    // opened): forget it, so a later sample retries.
                    self.tables.remove(&id);
                    for process in processes.walkers_mut() {
                        let before = process.modules.len();
                        process
                            .modules
                            .retain(|m| !matches!(m.table, ModuleTable::Pending(p, _) if p == id));
                        if process.modules.len() != before {
                            // A changed list is a new space (see `Walk::space`).
                            self.spaces += 1;
                            process.space = self.spaces;
                        }
                    }
                    // Samples held for it are walked again (and resolve anew).
                    self.tables_changed = true;
                    continue;
                }
            };
            for module in processes.walkers_mut().flat_map(|p| p.modules.iter_mut()) {
                if matches!(module.table, ModuleTable::Pending(p, _) if p == id) {
                    module.table = table.clone();
                }
            }
            self.stats.tables_evicted += self.tables.insert(id, table, self.table_cache_bytes);
            self.tables_changed = true;
        }
    }

    /// Adds the module holding `pc` to the process's list, if it is in
    /// one (and the process is not gone), or says a read is awaited.
    fn resolve<R: WalkerRecord>(
        &mut self,
        processes: &mut ProcessTable<R>,
        tgid: u32,
        pc: u64,
    ) -> Resolved {
        let module = match processes.lookup(tgid, pc) {
            Ok(Some(Location::Object(object))) => {
                let Some(vaddr) = object.elf_vaddr else {
                    return Resolved::Nothing;
                };
                let id = *object.id;
                let table = match self.tables.get(&id) {
                    Some(table) => {
                        self.stats.table_cache_hits += 1;
                        table
                    }
                    None => {
                        if !self.compiler.submit(object.clone()) {
                            // The compiler's queue is full: a later sample retries.
                            return Resolved::Nothing;
                        }
                        let pending = ModuleTable::Pending(id, compiler::direct_cfi(&object));
                        self.tables
                            .insert(id, pending.clone(), self.table_cache_bytes);
                        pending
                    }
                };
                let mapping = &object.region.mapping;
                Module {
                    start: mapping.start,
                    end: mapping.end,
                    bias: pc.wrapping_sub(vaddr),
                    file_base: mapping.start.wrapping_sub(mapping.offset),
                    table,
                    binary: self.binary_slot(binary_name(object.path())),
                    object: ModuleObject::File(Arc::new(ModuleFile {
                        id: Arc::clone(&object.id),
                        region: Arc::clone(&object.region),
                    })),
                }
            }
            Ok(Some(Location::Unbacked(region))) if region.mapping.path == MappingPath::Vdso => {
                // The vDSO image is linked at address 0.
                Module {
                    start: region.mapping.start,
                    end: region.mapping.end,
                    bias: region.mapping.start,
                    file_base: region.mapping.start,
                    table: self.vdso.clone(),
                    binary: self.binary_slot("[vdso]".into()),
                    object: ModuleObject::Vdso,
                }
            }
            Ok(Some(Location::Unbacked(region))) if region.mapping.path.is_jit_code() => {
                // Executable memory no file backs: JIT code, which keeps
                // frame pointers (V8, HotSpot with -XX:+PreserveFramePointer,
                // .NET, LuaJIT). Walked by the validated frame-pointer step
                // until a return address lands in a module with CFI again.
                Module {
                    start: region.mapping.start,
                    end: region.mapping.end,
                    bias: 0,
                    file_base: 0,
                    table: ModuleTable::NoCfi,
                    binary: self.jit_binary,
                    object: ModuleObject::Jit,
                }
            }
            Ok(_) => return Resolved::Nothing,
            Err(ProcessError::ReadPending { .. }) => return Resolved::Pending,
            Err(ProcessError::Unidentified { region, .. })
                if !Path::new(&format!("/proc/{tgid}")).exists() =>
            {
                // The process is gone and no root holds the file (counted
                // by the process table): its frames ship with the path and
                // file offset, never as anonymous memory. A live process's
                // file is retried by later samples instead.
                let mapping = &region.mapping;
                Module {
                    start: mapping.start,
                    end: mapping.end,
                    bias: 0,
                    file_base: mapping.start.wrapping_sub(mapping.offset),
                    table: ModuleTable::Unreadable,
                    binary: self.binary_slot(binary_name(&mapping.path)),
                    object: ModuleObject::Unreadable(Arc::from(mapping.path.shipped_name())),
                }
            }
            Err(err) => {
                tracing::debug!("process {tgid}: {err}");
                return Resolved::Nothing;
            }
        };
        let space = self.next_space();
        process_modules(processes, tgid, 0).insert(module, space);
        Resolved::Module
    }

    fn record(&mut self, outcome: WalkOutcome, stitched: bool) {
        let mut all = self.stats.ends();
        all.add(outcome, stitched);
        (
            self.stats.walks,
            self.stats.outermost,
            self.stats.stitched,
            self.stats.truncated,
        ) = (all.walks, all.outermost, all.stitched, all.truncated);
        self.stats.table_pending += u64::from(outcome == WalkOutcome::TablePending);
        self.stats.early_ends.add(outcome);
        // Only walks through JIT code have no space.
        if self.last_space.is_none() {
            self.stats.jit_walks += 1;
            self.stats.jit_outermost +=
                u64::from(outcome == WalkOutcome::Ended(UnwindEnd::Outermost));
        }
        if let Some((_, ends)) = self.stats.by_binary.get_mut(self.frame0_binary as usize) {
            ends.add(outcome, stitched);
        }
    }
}

/// The record of `tgid`, made when first walked; the least recently used
/// process goes when there are too many.
fn process_modules<R: WalkerRecord>(
    processes: &mut ProcessTable<R>,
    tgid: u32,
    started: u64,
) -> &mut ProcessState {
    let (_, process) = processes.walker(tgid);
    if process.started == 0 {
        process.started = started;
    }
    process
}

/// Fills `objects` for `frames`, a walk of `process` just made, and names
/// its frame 0's binary; returns the walk's space (`None`: it went through
/// JIT code). A return address is placed by the byte before it (see
/// [`FrameObject`]).
///
/// Earlier samples' objects are overwritten in place, and those past
/// this walk's depth are kept, not dropped: consecutive samples mostly
/// have the same files at the same depths, and keeping their `Arc`s
/// spares two atomic operations per frame (dropping the deeper ones and
/// cloning them back was a fifth of `walk_sample` on a workload whose
/// depth varies). At most `max_depth` of them are kept.
fn place_frames(
    process: Option<&ProcessState>,
    frames: &[u64],
    objects: &mut Vec<FrameObject>,
    frame0_binary: &mut u32,
    unknown_binary: u32,
) -> Option<u64> {
    // A process without an entry has no modules, as one with an entry
    // whose list is still empty (space 0): every frame is anonymous.
    let space = process.map_or(0, |p| p.space);
    let frame0 = process.and_then(|p| p.find(*frames.first()?));
    *frame0_binary = frame0.map_or(unknown_binary, |m| m.binary);
    // Callers are mostly in the module of the frame above them: that
    // one is tried before a search of the process's modules.
    let mut last: Option<&Module> = None;
    for (i, &pc) in frames.iter().enumerate() {
        let module = if i == 0 {
            frame0
        } else {
            let at = pc.wrapping_sub(1);
            match last {
                Some(module) if module.contains(at) => last,
                _ => process.and_then(|p| p.find(at)),
            }
        };
        last = module.or(last);
        match objects.get_mut(i) {
            Some(object) => match module {
                Some(module) => module.place(pc, object),
                None => *object = FrameObject::Anonymous { address: pc },
            },
            None => objects.push(module.map_or(FrameObject::Anonymous { address: pc }, |m| {
                m.frame_object(pc)
            })),
        }
    }
    let through_jit = objects[..frames.len()].iter().any(FrameObject::is_jit);
    (!through_jit).then_some(space)
}

/// Makes the walk's HotSpot interpreter frames (placed as JIT code) say the
/// method each ran.
fn mark_interpreted(objects: &mut [FrameObject], interpreted: &[(usize, u64)]) {
    for &(frame, method) in interpreted {
        if let Some(object) = objects.get_mut(frame)
            && let FrameObject::Jit { address } = *object
        {
            *object = FrameObject::JavaInterpreted { address, method };
        }
    }
}

/// Whether a walk checks that the walker's state for its pid is its
/// process's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Identity {
    /// A new sample: its process may have replaced the one the walker
    /// knows under its pid.
    Checked,
    /// A held sample, or one walked after its pid's state was replaced.
    Unchecked,
}

/// The walker's state for a sample's pid belongs to an earlier process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct OtherProcess;

/// What [`StackWalker::walk_memory`] walks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WalkUse {
    /// A sample to deliver: its frames are placed.
    Sample(Identity),
    /// The planner's learning read of a live stack.
    Learn,
}

fn registers(header: &SampleHeader) -> Registers {
    Registers {
        rip: header.user_rip,
        rsp: header.user_rsp,
        rbp: header.user_rbp,
    }
}

/// The table of this process's own vDSO.
fn own_vdso_table() -> Option<Arc<UnwindTable>> {
    let (_, image) = own_vdso_image()?;
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

/// What other crates' tests build on (the `test-support` feature).
#[cfg(any(test, feature = "test-support"))]
pub mod test_support {
    use agent_common::{SampleHeader, sample_flags};

    /// A sample of this very process: rip in its own code, and a zeroed
    /// stack, so the walk reads a zero return address and ends there.
    pub fn own_sample() -> (SampleHeader, Vec<u8>) {
        let header = SampleHeader {
            kind: agent_common::RecordKind::Sample as u32,
            flags: sample_flags::USER_REGS,
            tgid: std::process::id(),
            tid: std::process::id(),
            cpu: 0,
            kernel_stack_len: 0,
            user_stack_len: 256,
            sampling_divisor: 1,
            ktime_ns: 0,
            cgroup_id: 0,
            // The entry of a function: its CFA rule is rsp + 8.
            user_rip: own_sample as fn() -> (SampleHeader, Vec<u8>) as usize as u64,
            user_rsp: 0x7fff_0000_0000,
            user_rbp: 0,
            comm: [0; 16],
            tail_len: 0,
            tail_spans: 0,
            process_start_ns: 0,
        };
        (header, vec![0; 256])
    }
}

#[cfg(test)]
mod tests {
    use super::{test_support::own_sample, *};

    /// The table a walker made with the default configuration is lent.
    fn test_table() -> ProcessTable<ProcessState> {
        StackWalker::process_table(&WalkerConfig::default())
    }

    fn module(start: u64, end: u64) -> Module {
        Module {
            start,
            end,
            bias: 0,
            file_base: start,
            table: ModuleTable::NoCfi,
            binary: BinarySlots::UNTRACKED,
            object: ModuleObject::Vdso,
        }
    }

    #[test]
    fn unused_tables_past_the_bound_go_least_recently_used_first() {
        let id = |ino| {
            ObjectId::FileKey(stackscope_process_table::FileKey {
                dev: 1,
                ino,
                size: 0,
                mtime_ns: 0,
            })
        };
        let table = || Arc::new(UnwindTable::from_rows(&[(0, None); 64]));
        let bytes = table().heap_bytes();
        let mut cache = TableCache::default();
        let held = table();
        // Two unused tables fit; a process holds the first table, which
        // is not counted.
        for (ino, table) in [(1, Arc::clone(&held)), (2, table()), (3, table())] {
            assert_eq!(
                cache.insert(id(ino), ModuleTable::Ready(table), 2 * bytes),
                0
            );
        }
        cache.get(&id(2));
        // A third unused one: the least recently used unused table (3)
        // goes, not the held one, older still.
        assert_eq!(
            cache.insert(id(4), ModuleTable::Ready(table()), 2 * bytes),
            1
        );
        assert!(cache.get(&id(3)).is_none());
        assert_eq!(cache.ready_bytes, 3 * bytes);
        // Replacing a table counts its bytes once.
        assert_eq!(
            cache.insert(id(4), ModuleTable::Ready(table()), 2 * bytes),
            0
        );
        assert_eq!(cache.ready_bytes, 3 * bytes);
        // Once the process lets go, a tighter bound takes the held table
        // too, least recently used first.
        drop(held);
        assert_eq!(cache.evict_unused(bytes), 2);
        assert!(cache.get(&id(1)).is_none() && cache.get(&id(2)).is_none());
        assert!(cache.get(&id(4)).is_some());
        assert_eq!(cache.ready_bytes, bytes);
    }

    #[test]
    fn a_walker_on_a_table_cache_knows_the_deep_programs_an_earlier_agent_remembered() {
        let dir = tempfile::tempdir().expect("a directory");
        let mut rustc = [0; agent_common::COMM_LEN];
        rustc[..5].copy_from_slice(b"rustc");
        remembered::save(dir.path(), &rustc, None);
        std::fs::write(
            dir.path().join("damaged.deep"),
            "stackscope deep program v1\n",
        )
        .expect("writing");
        let config = |deep_stack_bytes| WalkerConfig {
            disk_cache: Some(DiskCache {
                dir: dir.path().to_path_buf(),
                max_bytes: 1 << 20,
            }),
            deep_stack_bytes,
            ..WalkerConfig::default()
        };
        let mut walker = StackWalker::new(config(1 << 20));
        // The sampler is told at once: the program's first ticks wake the
        // reader, and its threads are planned deep at their first learning.
        assert_eq!(
            walker.take_plan_updates(),
            [PlanUpdate::DeepProgram {
                comm: rustc,
                deep: true
            }]
        );
        let plans = walker.stats().plans;
        assert_eq!(
            (plans.deep_programs_remembered, plans.deep_programs_refused),
            (1, 1)
        );
        // Without deep copies, the memory is neither read nor written.
        let mut walker = StackWalker::new(config(0));
        assert!(walker.take_plan_updates().is_empty());
    }

    #[test]
    fn a_walk_through_jit_code_has_no_space_to_be_remembered_by() {
        let mut walker = StackWalker::default();
        let mut table = test_table();
        let mut jit = module(0x4000, 0x5000);
        jit.object = ModuleObject::Jit;
        let space = walker.next_space();
        let process = process_modules(&mut table, 7, 1);
        process.insert(module(0x1000, 0x2000), space);
        process.insert(jit, space);
        walker.frames = vec![0x1010, 0x1020];
        place(&mut walker, &mut table, 7);
        assert_eq!(walker.last_space, Some(space));
        walker.frames = vec![0x1010, 0x4020, 0x1020];
        place(&mut walker, &mut table, 7);
        assert_eq!(walker.last_space, None, "JIT frames are named by perf maps");
        // A shallower walk: the JIT object kept from the deeper one is not
        // this walk's.
        walker.frames = vec![0x1010];
        place(&mut walker, &mut table, 7);
        assert_eq!(walker.last_space, Some(space));
        assert!(matches!(
            walker.placed(),
            [FrameObject::Vdso { offset: 0x10 }]
        ));
        // A process the walker has no modules for: every frame anonymous.
        place(&mut walker, &mut table, 8);
        assert_eq!(walker.last_space, Some(0));
    }

    fn place(walker: &mut StackWalker, table: &mut ProcessTable<ProcessState>, tgid: u32) {
        let frames = std::mem::take(&mut walker.frames);
        walker.place_frames_of(table, tgid, &frames);
        walker.frames = frames;
    }

    #[test]
    fn early_ends_count_only_walks_stopped_with_bytes_left() {
        let mut early = EarlyEnds::default();
        for end in [
            UnwindEnd::Outermost,
            UnwindEnd::StackTruncated,
            UnwindEnd::Unmapped,
            UnwindEnd::NoUnwindInfo,
            UnwindEnd::NoUnwindInfo,
            UnwindEnd::CfaNotIncreasing,
            UnwindEnd::BadStackAddress,
            UnwindEnd::DepthLimit,
            UnwindEnd::Unsupported(UnsupportedCfi::StackSwitch),
            UnwindEnd::Unsupported(UnsupportedCfi::CfaRegister),
        ] {
            early.add(WalkOutcome::Ended(end));
        }
        early.add(WalkOutcome::TablePending);
        assert_eq!(
            early,
            EarlyEnds {
                unmapped: 1,
                no_unwind_info: 2,
                unsupported: 1,
                stack_switch: 1,
                corrupt: 2,
                depth_limit: 1,
                table_pending: 1,
            }
        );
        let total: u64 = early.by_reason().iter().map(|(count, _)| count).sum();
        assert_eq!(total, 9, "every early end has a reason in the report");
    }

    #[test]
    fn the_least_recently_walked_process_goes_beyond_the_bound() {
        let mut walker = StackWalker::default();
        let mut table = test_table();
        for tgid in 0..MAX_PROCESSES as u32 {
            process_modules(&mut table, tgid, 1);
            walker.stats.walks += 1;
        }
        process_modules(&mut table, 0, 1);
        walker.stats.walks += 1;
        process_modules(&mut table, u32::MAX, 1);
        assert_eq!(table.len(), MAX_PROCESSES);
        assert!(table.contains(0), "walked again: kept");
        assert!(!table.contains(1), "least recently walked: gone");
        walker.forget_all_processes(&mut table);
        assert_eq!(table.len(), 0);
        assert_eq!(walker.stats().state_resets, 1);
    }

    #[test]
    fn a_kernel_tick_whose_user_context_is_gone_has_no_user_frames() {
        let mut walker = StackWalker::default();
        let mut table = test_table();
        let (header, stack) = own_sample();
        // In the kernel (no TICK_IN_USER), the saved rip in nothing mapped:
        // inside execve or exit, the user memory is gone.
        let gone = SampleHeader {
            user_rip: 0x10,
            ..header
        };
        let mut frames = Vec::new();
        walker.push(&mut table, &gone, &[], UserStack::copy_only(&stack), |w| {
            frames.push(w.walk.frames.to_vec())
        });
        assert_eq!(frames, [Vec::<u64>::new()]);
        let stats = walker.stats();
        assert_eq!((stats.kernel_ticks_unplaced, stats.walks), (1, 0));
        // Interrupted in user mode there, the address is where the CPU was.
        let in_user = SampleHeader {
            flags: gone.flags | sample_flags::TICK_IN_USER,
            ..gone
        };
        walker.push(
            &mut table,
            &in_user,
            &[],
            UserStack::copy_only(&stack),
            |w| frames.push(w.walk.frames.to_vec()),
        );
        assert_eq!(frames[1], [0x10]);
        assert_eq!(walker.stats().walks, 1);
    }

    #[test]
    fn a_kernel_tick_whose_user_stack_is_unreadable_has_no_user_frames() {
        let mut walker = StackWalker::default();
        let mut table = test_table();
        let (header, _) = own_sample();
        // In the kernel, its saved rip in this binary, but not one byte of
        // its stack readable: exit tearing the memory down.
        let torn = SampleHeader {
            flags: (header.flags & !sample_flags::TICK_IN_USER) | sample_flags::USER_STACK_FAULTED,
            ..header
        };
        let mut frames = Vec::new();
        walker.push(&mut table, &torn, &[], UserStack::copy_only(&[]), |w| {
            frames.push(w.walk.frames.to_vec())
        });
        let started = std::time::Instant::now();
        while frames.is_empty() {
            assert!(started.elapsed() < std::time::Duration::from_secs(60));
            // The binary's table compiles on the compiler's threads.
            std::thread::sleep(std::time::Duration::from_millis(5));
            walker.poll(&mut table, |w| frames.push(w.walk.frames.to_vec()));
        }
        assert_eq!(frames, [Vec::<u64>::new()]);
        assert_eq!(walker.stats().kernel_ticks_unplaced, 1);
    }

    #[test]
    fn an_exit_waits_for_held_samples() {
        let mut walker = StackWalker::default();
        let mut table = test_table();
        let (header, stack) = own_sample();
        let mut delivered = Vec::new();
        walker.push(
            &mut table,
            &header,
            &[],
            UserStack::copy_only(&stack),
            |w| delivered.push(w.walk.outcome),
        );
        assert_eq!(walker.waiting(), 1);
        walker.on_exit(&mut table, header.tgid);
        assert!(
            walker.take_completed_exits().is_empty(),
            "held samples keep the process"
        );
        assert!(table.contains(header.tgid));
        let started = std::time::Instant::now();
        while delivered.is_empty() {
            assert!(started.elapsed() < std::time::Duration::from_secs(60));
            std::thread::sleep(std::time::Duration::from_millis(5));
            walker.poll(&mut table, |w| delivered.push(w.walk.outcome));
        }
        // Walked with what was known of it, then it went.
        assert_eq!(delivered, [WalkOutcome::Ended(UnwindEnd::Outermost)]);
        assert_eq!(walker.take_completed_exits(), [header.tgid]);
        assert!(!table.contains(header.tgid));
        // An exit with nothing held goes at once.
        walker.on_exit(&mut table, header.tgid);
        assert_eq!(walker.take_completed_exits(), [header.tgid]);
    }

    #[test]
    fn with_deferred_reads_a_sample_waits_for_its_process_to_be_read_elsewhere() {
        let config = WalkerConfig {
            defer_reads: true,
            ..WalkerConfig::default()
        };
        let mut table: ProcessTable<ProcessState> = StackWalker::process_table(&config);
        let mut walker = StackWalker::new(config);
        let (header, stack) = own_sample();
        let mut delivered = Vec::new();
        walker.push(
            &mut table,
            &header,
            &[],
            UserStack::copy_only(&stack),
            |w| delivered.push(w.walk.outcome),
        );
        assert_eq!((walker.waiting(), table.stats().maps_reads), (1, 0));
        let requests = table.take_read_requests();
        assert_eq!(requests.len(), 1);
        let reader = table.reader();
        let answers = std::thread::spawn(move || {
            requests
                .into_iter()
                .map(|request| reader.read(request))
                .collect()
        })
        .join()
        .expect("the reading thread");
        walker.apply_reads(&mut table, answers);
        let started = std::time::Instant::now();
        while delivered.is_empty() {
            assert!(started.elapsed() < std::time::Duration::from_secs(60));
            // Files identified on the reading thread, tables compiled on
            // the compiler's; this one only waits for them.
            std::thread::sleep(std::time::Duration::from_millis(5));
            walker.poll(&mut table, |w| delivered.push(w.walk.outcome));
            for request in table.take_read_requests() {
                let answer = table.reader().read(request);
                walker.apply_reads(&mut table, vec![answer]);
            }
        }
        assert_eq!(delivered, [WalkOutcome::Ended(UnwindEnd::Outermost)]);
        assert_eq!(table.stats().maps_reads, 1);
    }

    #[test]
    fn a_fork_reusing_the_pid_of_an_exited_process_starts_afresh() {
        let mut walker = StackWalker::default();
        let mut table = test_table();
        let (header, stack) = own_sample();
        let mut delivered = 0;
        walker.push(
            &mut table,
            &header,
            &[],
            UserStack::copy_only(&stack),
            |_| delivered += 1,
        );
        walker.on_exit(&mut table, header.tgid);
        // The pid is a new process's now: the held sample is walked as far
        // as it goes, and nothing of the old process stays for the new one.
        walker.process_forked(&mut table, 1, header.tgid, |_| delivered += 1);
        assert_eq!((delivered, walker.waiting()), (1, 0));
        assert!(walker.exited.is_empty());
        assert!(!table.contains(header.tgid), "untracked parent");
        // The old process's exit is applied: what else is kept of it goes.
        assert_eq!(walker.take_completed_exits(), [header.tgid]);
    }

    #[test]
    fn a_pid_reused_by_a_later_process_starts_afresh() {
        let mut walker = StackWalker::default();
        let mut table = test_table();
        let (header, stack) = own_sample();
        let first = SampleHeader {
            process_start_ns: 100,
            ..header
        };
        let is_new = |table: &ProcessTable<ProcessState>, header: &SampleHeader| {
            table
                .state_of(header.tgid)
                .unwrap()
                .is_other_process(header.process_start_ns)
        };
        process_modules(&mut table, first.tgid, 100);
        assert!(!is_new(&table, &first));
        let unknown = SampleHeader {
            process_start_ns: 0,
            ..header
        };
        assert!(!is_new(&table, &unknown), "no start time: no verdict");
        let later = SampleHeader {
            process_start_ns: 200,
            ..header
        };
        assert!(is_new(&table, &later));
        walker.push(
            &mut table,
            &later,
            &[],
            UserStack::copy_only(&stack),
            |_| {},
        );
        assert_eq!(walker.stats().processes_replaced, 1);
        assert_eq!(walker.process_started(&table, later.tgid), Some(200));
        assert!(!is_new(&table, &later));
    }

    #[test]
    fn a_process_mapping_too_many_modules_starts_over() {
        let mut process = ProcessState::default();
        for i in 0..MAX_MODULES_PER_PROCESS as u64 + 1 {
            process.insert(module(0x1000 * (i + 1), 0x1000 * (i + 1) + 0x800), i);
        }
        assert_eq!(process.modules.len(), 1);
    }

    #[test]
    fn finds_the_module_holding_an_address() {
        let mut process = ProcessState::default();
        process.insert(module(0x3000, 0x4000), 1);
        process.insert(module(0x1000, 0x2000), 1);
        assert_eq!(process.find(0x1000).map(|m| m.start), Some(0x1000));
        assert_eq!(process.find(0x1fff).map(|m| m.start), Some(0x1000));
        assert!(process.find(0x2000).is_none());
        assert!(process.find(0xfff).is_none());
        assert_eq!(process.find(0x3abc).map(|m| m.start), Some(0x3000));
        assert!(process.find(0x4000).is_none());
    }

    #[test]
    fn a_remapped_range_replaces_the_stale_module() {
        let mut process = ProcessState::default();
        process.insert(module(0x1000, 0x3000), 1);
        process.insert(module(0x5000, 0x6000), 1);
        process.insert(module(0x2000, 0x5800), 1);
        let starts: Vec<u64> = process.modules.iter().map(|m| m.start).collect();
        assert_eq!(starts, [0x2000]);
    }

    #[test]
    fn unknown_addresses_are_remembered_for_resolution() {
        let mut process = ProcessState::default();
        process.insert(module(0x1000, 0x2000), 1);
        let known = KnownModules::new(&process);
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
    fn holds_a_sample_until_its_table_is_compiled() {
        let mut walker = StackWalker::default();
        let mut table = test_table();
        let (header, stack) = own_sample();
        let mut walks = Vec::new();
        let kernel = [0xffff_ffff_8100_1234, 0xffff_ffff_8100_5678];
        type Kept = (u32, Vec<u64>, Vec<u64>, Vec<FrameObject>, WalkOutcome);
        fn keep(walks: &mut Vec<Kept>) -> impl FnMut(Walked<'_>) + '_ {
            move |w| {
                walks.push((
                    w.header.tgid,
                    w.kernel_frames.to_vec(),
                    w.walk.frames.to_vec(),
                    w.walk.objects.to_vec(),
                    w.walk.outcome,
                ))
            }
        }
        walker.push(
            &mut table,
            &header,
            &kernel,
            UserStack::copy_only(&stack),
            keep(&mut walks),
        );
        assert!(
            walks.is_empty(),
            "walked before the table was ready: {walks:?}"
        );
        assert_eq!(walker.waiting(), 1);

        let started = std::time::Instant::now();
        while walks.is_empty() {
            assert!(
                started.elapsed() < std::time::Duration::from_secs(60),
                "the held sample was never walked"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
            walker.poll(&mut table, keep(&mut walks));
        }
        assert_eq!(walks.len(), 1);
        // Re-walks while the table compiled are not counted: one sample, one walk.
        assert_eq!((walker.stats().walks, walker.stats().outermost), (1, 1));
        let (tgid, kernel_frames, frames, objects, outcome) = &walks[0];
        assert_eq!(*tgid, header.tgid);
        assert_eq!(kernel_frames, &kernel, "the kernel frames were held too");
        assert_eq!(frames.first(), Some(&header.user_rip));
        assert_eq!(*outcome, WalkOutcome::Ended(UnwindEnd::Outermost));
        // The frame is this test binary, at its file offset.
        match objects.as_slice() {
            [FrameObject::File { file, file_offset }] => {
                let mapping = &file.region.mapping;
                assert_eq!(
                    *file_offset,
                    header.user_rip - mapping.start + mapping.offset
                );
                let exe = std::fs::read_link("/proc/self/exe").expect("own exe");
                assert_eq!(file.path().file_path(), Some(exe.as_path()));
            }
            other => panic!("expected one file frame, got {other:?}"),
        }
        assert_eq!(walker.waiting(), 0);
        let stats = walker.stats();
        assert_eq!(
            (
                stats.samples_queued,
                stats.queue_full,
                stats.tables_compiled
            ),
            (1, 0, 1)
        );

        // The table is known now: the next sample is walked at once.
        let mut immediate = 0;
        walker.push(
            &mut table,
            &header,
            &[],
            UserStack::copy_only(&stack),
            |w| {
                assert_eq!(w.walk.outcome, WalkOutcome::Ended(UnwindEnd::Outermost));
                assert!(w.kernel_frames.is_empty());
                immediate += 1;
            },
        );
        assert_eq!(immediate, 1);
    }

    #[test]
    fn a_sample_pushed_after_held_ones_is_delivered_with_its_own_frames() {
        let mut walker = StackWalker::default();
        let mut table = test_table();
        let (held, stack) = own_sample();
        let mut delivered = Vec::new();
        walker.push(&mut table, &held, &[1], UserStack::copy_only(&stack), |w| {
            delivered.push((w.kernel_frames.to_vec(), w.walk.frames.to_vec()))
        });
        assert_eq!(walker.waiting(), 1);
        let started = std::time::Instant::now();
        while !walker.tables_changed {
            assert!(started.elapsed() < std::time::Duration::from_secs(60));
            std::thread::sleep(std::time::Duration::from_millis(5));
            walker.take_compiled_tables(&mut table);
        }
        // Another function's entry: the held sample is walked first, and
        // this one's frames must not be the held one's.
        let next = SampleHeader {
            user_rip: a_full_queue_walks_the_sample_as_far_as_it_goes as fn() as usize as u64,
            ..held
        };
        walker.push(&mut table, &next, &[2], UserStack::copy_only(&stack), |w| {
            delivered.push((w.kernel_frames.to_vec(), w.walk.frames.to_vec()))
        });
        assert_eq!(
            delivered,
            [
                (vec![1], vec![held.user_rip]),
                (vec![2], vec![next.user_rip])
            ]
        );
    }

    #[test]
    fn a_full_queue_walks_the_sample_as_far_as_it_goes() {
        let config = WalkerConfig {
            max_waiting_bytes: 0,
            ..WalkerConfig::default()
        };
        let mut table: ProcessTable<ProcessState> = StackWalker::process_table(&config);
        let mut walker = StackWalker::new(config);
        let (header, stack) = own_sample();
        let mut outcomes = Vec::new();
        walker.push(
            &mut table,
            &header,
            &[],
            UserStack::copy_only(&stack),
            |w| outcomes.push(w.walk.outcome),
        );
        assert_eq!(outcomes, [WalkOutcome::TablePending]);
        let stats = walker.stats();
        assert_eq!(
            (stats.queue_full, stats.walks, stats.table_pending),
            (1, 1, 1)
        );
        assert_eq!(walker.waiting(), 0);
    }

    #[test]
    fn the_agents_own_vdso_has_a_table() {
        let table = own_vdso_table().expect("a vDSO table");
        assert!(!table.is_empty());
    }
}
