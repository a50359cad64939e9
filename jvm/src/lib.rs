//! HotSpot JVMs seen from outside: a process that maps `libjvm.so` is read
//! through the tables the JVM exports about itself ([`vmstructs`]), which
//! give the code cache ([`code_cache`]: which blob holds an address, its
//! frame size and kind) and method names ([`names`]). The unwinder asks a
//! [`Jvm`] how to step out of a frame in JIT code ([`Jvm::step_at`]); the
//! aggregator asks it for the frame's names ([`Jvm::compiled_frames`]:
//! a compiled method and those it inlined; [`Jvm::method_name`]: an
//! interpreted method).
//!
//! What is read lives long (blobs, methods) but not forever: a blob whose
//! method was deoptimized is freed and its memory reused, a class unloaded
//! frees its methods. A cached nmethod is checked again (its compile id and
//! method) when last checked more than 50 ms before, a cached name (its
//! method's `ConstMethod*`) after a second, so a reused address is read as
//! what it holds now. What remains is the time between a sample and its walk
//! (at most the drain period): code replaced in between is read as it is at
//! the walk.

pub mod code_cache;
pub mod layout;
pub mod memory;
pub mod names;
pub mod scopes;
pub mod vmstructs;

use std::{
    collections::{BTreeMap, HashMap},
    io,
    path::Path,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

pub use code_cache::{BlobKind, CodeBlob, CodeHeap};
use layout::Layout;
pub use memory::{Memory, ProcessMemory};
use scopes::Scopes;
use stackscope_unwind::{RuntimeCode, RuntimeStep, UnwindRule};
use vmstructs::{LibJvm, VmStructs};

/// Why a JVM's state could not be read.
#[derive(Debug, thiserror::Error)]
pub enum JvmError {
    #[error("opening libjvm.so: {0}")]
    Open(#[source] io::Error),
    #[error("reading libjvm.so's dynamic symbols: {0}")]
    Elf(#[source] object::Error),
    #[error("reading {len} bytes at {addr:#x}: {source}")]
    Read {
        addr: u64,
        len: usize,
        #[source]
        source: io::Error,
    },
    #[error("the JVM's structures do not say where {0} is")]
    Missing(String),
    #[error("not what HotSpot writes: {0}")]
    Malformed(&'static str),
}

/// How long a cached blob is used before its compile id and method are
/// read again (a blob freed and its memory reused holds another's).
const BLOB_RECHECK: Duration = Duration::from_millis(50);

/// How long a cached method name is used before the method's
/// `ConstMethod*` is read again (a class unloaded and its metadata reused
/// holds another method there).
const NAME_RECHECK: Duration = Duration::from_secs(1);

/// How often the code heaps' bounds are read again (they grow as code is
/// compiled).
const HEAPS_LIFETIME: Duration = Duration::from_secs(1);

/// Blobs, names and compiled frames kept per process at most (each cache is
/// emptied when full: a JVM with this many hot methods is rare).
const MAX_CACHED: usize = 16_384;

/// Bytes of nmethods' debug information kept per process at most (most
/// hold a few KiB; one may hold up to 768 KiB).
const MAX_SCOPES_BYTES: usize = 8 << 20;

/// What one JVM process is read with.
pub struct Jvm<M = ProcessMemory> {
    memory: M,
    layout: Layout,
    state: Mutex<State>,
}

/// The names of one compiled frame, inlined methods first.
pub type Frames = Arc<[Arc<str>]>;

/// A cached value and when it was last checked.
struct Checked<T> {
    value: T,
    at: Instant,
}

struct State {
    heaps: Vec<CodeHeap>,
    heaps_read_at: Instant,
    /// The return address of the call stub (0: not known yet).
    call_stub_return: u64,
    /// The interpreter's codelets where rbp is always its frame's (`None`:
    /// not read yet, or the layout does not say).
    templates: Option<Vec<std::ops::Range<u64>>>,
    /// By start address.
    blobs: BTreeMap<u64, Checked<CodeBlob>>,
    /// By `Method*`, with its `ConstMethod*`.
    names: HashMap<u64, Checked<(u64, Arc<str>)>>,
    /// Nmethods' debug information, by blob start and compile id, and the
    /// bytes it holds.
    scopes: HashMap<(u64, i32), Arc<Scopes>>,
    scopes_bytes: usize,
    /// The names at compiled code addresses (and whether interrupted there),
    /// inlined methods first, with the blob (start, compile id) they are of.
    frames: HashMap<(u64, bool), (u64, i32, Frames)>,
    stats: JvmStats,
}

/// What a JVM's reads found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct JvmStats {
    pub blobs_read: u64,
    pub blob_errors: u64,
    /// Cached blobs found replaced when checked again.
    pub blobs_replaced: u64,
    pub names_read: u64,
    pub name_errors: u64,
    /// Nmethods whose inlining was read, and those whose could not be.
    pub scopes_read: u64,
    pub scope_errors: u64,
    /// Times its caches were emptied (for the memory budget).
    pub caches_cleared: u64,
}

impl JvmStats {
    /// Adds another JVM's.
    pub fn add(&mut self, other: &Self) {
        self.blobs_read += other.blobs_read;
        self.blob_errors += other.blob_errors;
        self.blobs_replaced += other.blobs_replaced;
        self.names_read += other.names_read;
        self.name_errors += other.name_errors;
        self.scopes_read += other.scopes_read;
        self.scope_errors += other.scope_errors;
        self.caches_cleared += other.caches_cleared;
    }
}

impl Jvm<ProcessMemory> {
    /// Reads process `pid`'s JVM, whose `libjvm.so` (at `path`, as this
    /// process can reach it) is loaded at `bias`; `Ok(None)` when the
    /// library is not HotSpot's.
    pub fn attach(pid: u32, path: &Path, bias: u64) -> Result<Option<Self>, JvmError> {
        let Some(lib) = LibJvm::read(path)? else {
            return Ok(None);
        };
        Self::read(ProcessMemory { pid }, &lib, bias).map(Some)
    }
}

impl<M: Memory> Jvm<M> {
    pub fn read(memory: M, lib: &LibJvm, bias: u64) -> Result<Self, JvmError> {
        let vm = VmStructs::read(&memory, lib, bias)?;
        let mut major = [0; 4];
        memory.read(
            vm.address("Abstract_VM_Version", "_vm_major_version")?,
            &mut major,
        )?;
        let layout = Layout::new(&vm, u32::from_le_bytes(major))?;
        let heaps = code_cache::read_heaps(&memory, &layout)?;
        let call_stub_return = call_stub_return(&memory, &layout);
        let templates = layout
            .interpreter
            .as_ref()
            .and_then(|interpreter| code_cache::interpreter_templates(&memory, interpreter));
        Ok(Self {
            memory,
            layout,
            state: Mutex::new(State {
                heaps,
                heaps_read_at: Instant::now(),
                call_stub_return,
                templates,
                blobs: BTreeMap::new(),
                names: HashMap::new(),
                scopes: HashMap::new(),
                scopes_bytes: 0,
                frames: HashMap::new(),
                stats: JvmStats::default(),
            }),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic elsewhere with the lock held leaves caches only.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The blob holding `pc`, as it is now.
    pub fn blob_at(&self, pc: u64) -> Option<CodeBlob> {
        let mut state = self.state();
        self.blob_in(&mut state, pc)
    }

    fn blob_in(&self, state: &mut State, pc: u64) -> Option<CodeBlob> {
        let now = Instant::now();
        if now.duration_since(state.heaps_read_at) > HEAPS_LIFETIME {
            state.heaps_read_at = now;
            match code_cache::read_heaps(&self.memory, &self.layout) {
                Ok(heaps) => state.heaps = heaps,
                Err(_) => state.stats.blob_errors += 1,
            }
            if state.call_stub_return == 0 {
                state.call_stub_return = call_stub_return(&self.memory, &self.layout);
            }
            if state.templates.is_none()
                && let Some(interpreter) = &self.layout.interpreter
            {
                state.templates = code_cache::interpreter_templates(&self.memory, interpreter);
            }
        }
        if let Some((&start, cached)) = state.blobs.range_mut(..=pc).next_back()
            && pc < cached.value.end
        {
            let fresh = now.duration_since(cached.at) <= BLOB_RECHECK
                || !matches!(
                    cached.value.kind,
                    BlobKind::Nmethod | BlobKind::NativeNmethod
                );
            if fresh || code_cache::still_there(&self.memory, &self.layout, &cached.value) {
                cached.at = now;
                return Some(cached.value.clone());
            }
            state.blobs.remove(&start);
            state.stats.blobs_replaced += 1;
        }
        let heap = *state.heaps.iter().find(|heap| heap.contains(pc))?;
        let read =
            code_cache::blob_start(&self.memory, &self.layout, &heap, pc).and_then(|start| {
                start
                    .map(|start| code_cache::read_blob(&self.memory, &self.layout, start))
                    .transpose()
            });
        match read {
            Ok(Some(blob)) if (blob.start..blob.end).contains(&pc) => {
                state.stats.blobs_read += 1;
                if state.blobs.len() >= MAX_CACHED {
                    state.blobs.clear();
                }
                // Blobs it overlaps are gone (their memory holds it now).
                let overlapped: Vec<u64> = state
                    .blobs
                    .range(..blob.end)
                    .rev()
                    .take_while(|(_, cached)| cached.value.end > blob.start)
                    .map(|(&start, _)| start)
                    .collect();
                for start in overlapped {
                    state.blobs.remove(&start);
                }
                state.blobs.insert(
                    blob.start,
                    Checked {
                        value: blob.clone(),
                        at: now,
                    },
                );
                Some(blob)
            }
            Ok(_) => None,
            Err(_) => {
                state.stats.blob_errors += 1;
                None
            }
        }
    }

    /// How to step out of the frame at `pc` (`interrupted`: the sampled
    /// instruction, else a return address's byte before), or `None` where
    /// nothing safe is known: the walk ends there rather than guess.
    pub fn step_at(&self, pc: u64, interrupted: bool) -> Option<RuntimeStep> {
        let mut state = self.state();
        let blob = self.blob_in(&mut state, pc)?;
        let frame = RuntimeStep::Rule(UnwindRule::RspRbpSaved {
            cfa_off: i32::try_from(blob.frame_bytes).ok()?,
            rbp_off: -16,
        });
        match (blob.kind, interrupted) {
            (BlobKind::Interpreter, false) => Some(RuntimeStep::JavaInterpreter),
            // Interrupted: only in a bytecode's template is rbp surely the
            // running frame's (a method's entry runs before `enter`, a
            // return after `leave`). A JVM whose codelets are not known
            // (its layout does not list them) is trusted everywhere.
            (BlobKind::Interpreter, true) => match (&state.templates, &self.layout.interpreter) {
                (Some(templates), _) => {
                    let at = templates.partition_point(|template| template.start <= pc);
                    at.checked_sub(1)
                        .and_then(|at| templates.get(at))
                        .is_some_and(|template| template.contains(&pc))
                        .then_some(RuntimeStep::JavaInterpreter)
                }
                (None, None) => Some(RuntimeStep::JavaInterpreter),
                (None, Some(_)) => None,
            },
            // A call is made from a built frame.
            (_, false) if blob.frame_bytes > 0 => Some(frame),
            // The call stub, the one frameless blob a Java frame returns
            // to, keeps a frame pointer.
            (_, false) => {
                (pc.wrapping_add(1) == state.call_stub_return).then_some(RuntimeStep::FramePointer)
            }
            (BlobKind::Nmethod, true) => {
                if blob.frame_bytes == 0 || blob.stubs.is_some_and(|stubs| pc >= stubs) {
                    return None;
                }
                let complete = blob.frame_complete?;
                drop(state);
                if pc < complete {
                    return self.prologue_step(&blob, pc);
                }
                match self.epilogue_at(&blob, pc) {
                    Some(Epilogue::BeforePopRbp) => {
                        Some(RuntimeStep::Rule(UnwindRule::RspRbpSaved {
                            cfa_off: 16,
                            rbp_off: -16,
                        }))
                    }
                    Some(Epilogue::AfterPopRbp) => {
                        Some(RuntimeStep::Rule(UnwindRule::Rsp { cfa_off: 8 }))
                    }
                    None => Some(frame),
                }
            }
            // Vtable and itable stubs push nothing: they load the target
            // and jump.
            (BlobKind::Stub, true) if &*blob.name == "vtable chunks" => {
                Some(RuntimeStep::Rule(UnwindRule::Rsp { cfa_off: 8 }))
            }
            // Other stubs and native wrappers build and tear down their
            // frames in ways their sizes do not say.
            (_, true) => None,
        }
    }

    /// How to step out of a compiled frame interrupted before its frame is
    /// complete: in its inline cache check (before the verified entry)
    /// nothing is pushed; from the verified entry, the prologue's
    /// instructions up to `pc` say what is (`push rbp; sub rsp, N` after a
    /// stack bang, as C1 and C2 with one build it; `sub rsp, N; mov [rsp +
    /// N - 8], rbp`, as C2 builds a frame without a bang; alignment nops).
    /// An instruction the decoder does not know ends the walk.
    fn prologue_step(&self, blob: &CodeBlob, pc: u64) -> Option<RuntimeStep> {
        let entry = blob.verified_entry?;
        if pc < entry {
            return Some(RuntimeStep::Rule(UnwindRule::Rsp { cfa_off: 8 }));
        }
        let mut code = [0u8; 64];
        let len = usize::try_from(pc - entry)
            .ok()
            .filter(|&len| len <= code.len() - 16)?;
        self.memory.read(entry, &mut code[..len + 16]).ok()?;
        let rule = prologue_rule(&code, len)?;
        Some(RuntimeStep::Rule(rule))
    }

    /// Whether an interrupted compiled frame `blob` is past its frame's
    /// teardown, by the instructions from `pc`: at `pop rbp`; or after it,
    /// where only the return's checks remain (`cmp rsp, [r15 + d]`: the
    /// safepoint poll or the reserved stack check, which appear nowhere
    /// else; a jump taken to one of them or to `ret`), or a jump out of the
    /// blob (C2's rethrow after its epilogue), or the poll's stub (`lea r10,
    /// [rip + d]; mov [r15 + d], r10`: the return address saved for the
    /// safepoint handler).
    fn epilogue_at(&self, blob: &CodeBlob, pc: u64) -> Option<Epilogue> {
        let mut code = [0u8; 16];
        self.memory.read(pc, &mut code).ok()?;
        let after_pop = |code: &[u8]| matches!(code, [0xc3, ..] | [0x49, 0x3b, 0xa7, ..]);
        match code {
            [0x5d, ..] => Some(Epilogue::BeforePopRbp),
            _ if after_pop(&code) => Some(Epilogue::AfterPopRbp),
            [0x4c, 0x8d, 0x15, ..] | [0x4d, 0x89, 0x97, ..] => Some(Epilogue::AfterPopRbp),
            // jb, jbe, ja rel32 (the return checks' branches): where they
            // go (a check, `ret`, the poll's stub) and where they fall
            // through (the same, or the reserved zone's call) must both be
            // the epilogue's.
            [0x0f, 0x82 | 0x86 | 0x87, a, b, c, d, ref rest @ ..] => {
                let target =
                    (pc + 6).wrapping_add_signed(i64::from(i32::from_le_bytes([a, b, c, d])));
                let mut at_target = [0u8; 4];
                self.memory.read(target, &mut at_target).ok()?;
                let goes = after_pop(&at_target) || matches!(at_target, [0x4c, 0x8d, 0x15, ..]);
                let falls = after_pop(rest) || matches!(rest, [0xe8, ..]);
                (goes && falls).then_some(Epilogue::AfterPopRbp)
            }
            // jmp rel32 out of the blob.
            [0xe9, a, b, c, d, ..] => {
                let target =
                    (pc + 5).wrapping_add_signed(i64::from(i32::from_le_bytes([a, b, c, d])));
                (!(blob.start..blob.end).contains(&target)).then_some(Epilogue::AfterPopRbp)
            }
            _ => None,
        }
    }

    /// The methods a compiled frame runs at `address` (a return address,
    /// or the `interrupted` instruction), inlined ones first, out to the
    /// compiled method; its blob is looked up at `lookup` (a return
    /// address's byte before). `None` for code that is not a compiled
    /// method; the compiled method alone where its inlining is unknown.
    pub fn compiled_frames(
        &self,
        address: u64,
        lookup: u64,
        interrupted: bool,
    ) -> Option<Arc<[Arc<str>]>> {
        let mut state = self.state();
        let blob = self.blob_in(&mut state, lookup)?;
        if !matches!(blob.kind, BlobKind::Nmethod | BlobKind::NativeNmethod) {
            return None;
        }
        if let Some((start, id, frames)) = state.frames.get(&(address, interrupted))
            && (*start, *id) == (blob.start, blob.compile_id)
        {
            return Some(Arc::clone(frames));
        }
        let methods = self
            .inlined_at(&mut state, &blob, address, interrupted)
            .filter(|methods| !methods.is_empty())
            .unwrap_or_else(|| vec![blob.method]);
        // A method that cannot be named (its class unloaded since) leaves
        // its frame out: a missing frame, not a wrong one.
        let names: Vec<Arc<str>> = methods
            .into_iter()
            .filter_map(|method| self.name_in(&mut state, method))
            .collect();
        if names.is_empty() {
            return None;
        }
        let frames: Frames = names.into();
        if state.frames.len() >= MAX_CACHED {
            state.frames.clear();
        }
        state.frames.insert(
            (address, interrupted),
            (blob.start, blob.compile_id, Arc::clone(&frames)),
        );
        Some(frames)
    }

    /// The methods at `address` of `blob` by its scopes, or `None` when
    /// they are unknown (a build whose scopes the reader does not know, or
    /// debug information that could not be read).
    fn inlined_at(
        &self,
        state: &mut State,
        blob: &CodeBlob,
        address: u64,
        interrupted: bool,
    ) -> Option<Vec<u64>> {
        let layout = self.layout.scopes.as_ref()?;
        let key = (blob.start, blob.compile_id);
        let scopes = match state.scopes.get(&key) {
            Some(scopes) => Arc::clone(scopes),
            None => match Scopes::read(&self.memory, layout, blob) {
                Ok(Some(scopes)) => {
                    state.stats.scopes_read += 1;
                    if state.scopes_bytes + scopes.bytes() > MAX_SCOPES_BYTES {
                        state.scopes.clear();
                        state.scopes_bytes = 0;
                    }
                    state.scopes_bytes += scopes.bytes();
                    let scopes = Arc::new(scopes);
                    state.scopes.insert(key, Arc::clone(&scopes));
                    scopes
                }
                Ok(None) => return None,
                Err(_) => {
                    state.stats.scope_errors += 1;
                    return None;
                }
            },
        };
        let offset = address.checked_sub(blob.code.start)?;
        match scopes.methods_at(offset, interrupted, blob.method) {
            Ok(methods) => Some(methods),
            Err(_) => {
                state.stats.scope_errors += 1;
                None
            }
        }
    }

    /// The name of the method at `method` (an interpreter frame's).
    pub fn method_name(&self, method: u64) -> Option<Arc<str>> {
        let mut state = self.state();
        self.name_in(&mut state, method)
    }

    fn name_in(&self, state: &mut State, method: u64) -> Option<Arc<str>> {
        let now = Instant::now();
        let const_method = |memory: &M| {
            memory
                .u64_at(method.wrapping_add(self.layout.method_const))
                .ok()
        };
        if let Some(cached) = state.names.get_mut(&method) {
            if now.duration_since(cached.at) <= NAME_RECHECK {
                return Some(Arc::clone(&cached.value.1));
            }
            if const_method(&self.memory) == Some(cached.value.0) {
                cached.at = now;
                return Some(Arc::clone(&cached.value.1));
            }
            state.names.remove(&method);
        }
        let read = const_method(&self.memory)
            .ok_or(JvmError::Malformed("a method that cannot be read"))
            .and_then(|const_method| {
                names::method_name(&self.memory, &self.layout, method)
                    .map(|name| (const_method, name))
            });
        match read {
            Ok((const_method, name)) => {
                state.stats.names_read += 1;
                if state.names.len() >= MAX_CACHED {
                    state.names.clear();
                }
                let name: Arc<str> = name.into();
                state.names.insert(
                    method,
                    Checked {
                        value: (const_method, Arc::clone(&name)),
                        at: now,
                    },
                );
                Some(name)
            }
            Err(_) => {
                state.stats.name_errors += 1;
                None
            }
        }
    }

    /// The name of the stub holding `pc` (`StubRoutines (1)`,
    /// `Interpreter`), as in HotSpot's own perf map: what a frame in code
    /// that is not a compiled method shows (`None` for a compiled method's
    /// code, whose name is its method's).
    pub fn blob_name(&self, pc: u64) -> Option<Arc<str>> {
        self.blob_at(pc)
            .filter(|blob| !matches!(blob.kind, BlobKind::Nmethod | BlobKind::NativeNmethod))
            .map(|blob| blob.name)
    }

    pub fn stats(&self) -> JvmStats {
        self.state().stats
    }

    /// What its caches of blobs, names, inlining and compiled frames hold,
    /// in bytes: each entry's size, the names it holds alone and a word
    /// or two of its table's own per entry (the code heaps and the
    /// interpreter's codelets, a few hundred bytes, are left out).
    pub fn cached_bytes(&self) -> usize {
        /// A hash or B-tree's own bytes per entry, about.
        const TABLE_PER_ENTRY: usize = 16;
        let state = self.state();
        let blobs: usize = state
            .blobs
            .values()
            .map(|cached| size_of::<(u64, Checked<CodeBlob>)>() + cached.value.name.len())
            .sum();
        let names: usize = state
            .names
            .values()
            .map(|cached| size_of::<(u64, Checked<(u64, Arc<str>)>)>() + cached.value.1.len())
            .sum();
        // The frames' names are the names cache's, shared.
        let frames: usize = state
            .frames
            .values()
            .map(|(_, _, frames)| {
                size_of::<((u64, bool), (u64, i32, Frames))>()
                    + frames.len() * size_of::<Arc<str>>()
            })
            .sum();
        let entries =
            state.blobs.len() + state.names.len() + state.frames.len() + state.scopes.len();
        blobs + names + frames + state.scopes_bytes + entries * TABLE_PER_ENTRY
    }

    /// Empties the caches [`Self::cached_bytes`] counts: what a later
    /// sample needs is read again.
    pub fn clear_caches(&self) {
        let mut state = self.state();
        state.blobs = BTreeMap::new();
        state.names = HashMap::new();
        state.scopes = HashMap::new();
        state.scopes_bytes = 0;
        state.frames = HashMap::new();
        state.stats.caches_cleared += 1;
    }
}

/// The rule at byte `len` of a prologue whose code (from the verified
/// entry) is `code`, by the instructions before it; `None` where one is not
/// known (or `len` is not at an instruction's start).
fn prologue_rule(code: &[u8], len: usize) -> Option<UnwindRule> {
    // Bytes below the entry's stack pointer, and where rbp was stored
    // (from the CFA: the return address is at cfa - 8).
    let (mut pushed, mut rbp_off) = (0i32, None);
    let mut at = 0;
    while at < len {
        let step = match code[at..] {
            // mov [rsp - disp32], eax: the stack bang.
            [0x89, 0x84, 0x24, ..] => 7,
            // push rbp
            [0x55, ..] => {
                pushed = pushed.checked_add(8)?;
                rbp_off = Some((-8i32).checked_sub(pushed)?);
                1
            }
            // sub rsp, imm8 | imm32 (sign-extended)
            [0x48, 0x83, 0xec, imm, ..] => {
                pushed = pushed.checked_add(i32::from(imm as i8))?;
                4
            }
            [0x48, 0x81, 0xec, a, b, c, d, ..] => {
                pushed = pushed.checked_add(i32::from_le_bytes([a, b, c, d]))?;
                7
            }
            // mov [rsp + disp8], rbp
            [0x48, 0x89, 0x6c, 0x24, disp, ..] => {
                rbp_off = Some(i32::from(disp as i8).checked_sub(8)?.checked_sub(pushed)?);
                5
            }
            // cmp dword [r15 + disp8], imm32; jne rel32 | rel8: the nmethod
            // entry barrier's check (where it comes before the frame is
            // complete; other shapes of it are not decoded).
            [0x41, 0x81, 0x7f, ..] => 8,
            [0x0f, 0x85, ..] => 6,
            [0x75, ..] => 2,
            // Alignment: nop, xchg ax, ax, and the long nops.
            [0x90, ..] => 1,
            [0x66, 0x90, ..] => 2,
            [0x0f, 0x1f, 0x00, ..] => 3,
            [0x0f, 0x1f, 0x40, ..] => 4,
            [0x0f, 0x1f, 0x44, 0x00, ..] => 5,
            [0x66, 0x0f, 0x1f, 0x44, 0x00, ..] => 6,
            [0x0f, 0x1f, 0x80, ..] => 7,
            [0x0f, 0x1f, 0x84, 0x00, ..] => 8,
            [0x66, 0x0f, 0x1f, 0x84, 0x00, ..] => 9,
            _ => return None,
        };
        at += step;
    }
    // A frame of more than 8 MiB is no frame HotSpot builds.
    if at != len || !(0..=(8 << 20)).contains(&pushed) {
        return None;
    }
    let cfa_off = 8 + pushed;
    Some(match rbp_off {
        // A slot the frame holds (below the return address).
        Some(rbp_off) if rbp_off < -8 && rbp_off >= -cfa_off => {
            UnwindRule::RspRbpSaved { cfa_off, rbp_off }
        }
        Some(_) => return None,
        None => UnwindRule::Rsp { cfa_off },
    })
}

/// Where an interrupted compiled frame is in its epilogue.
enum Epilogue {
    /// Its frame freed, rbp not popped yet: cfa = rsp + 16, rbp saved at rsp.
    BeforePopRbp,
    /// After `pop rbp`: cfa = rsp + 8.
    AfterPopRbp,
}

/// The call stub's return address, once the JVM has generated it (0
/// before, or where the layout does not say).
fn call_stub_return(memory: &impl Memory, layout: &Layout) -> u64 {
    layout
        .call_stub_return
        .and_then(|at| memory.u64_at(at).ok())
        .unwrap_or(0)
}

impl<M> std::fmt::Debug for Jvm<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Jvm").finish_non_exhaustive()
    }
}

impl<M: Memory> RuntimeCode for Jvm<M> {
    fn step_at(&self, pc: u64, interrupted: bool) -> Option<RuntimeStep> {
        Jvm::step_at(self, pc, interrupted)
    }
}

/// The JVM process `pid` runs (under `proc_root`, e.g. `/proc`), read
/// through the `libjvm.so` it maps (reached through its root, so a
/// container's JDK is read from the container's files); `Ok(None)` when it
/// maps none, or one that is not HotSpot's.
pub fn find_in_process(proc_root: &Path, pid: u32) -> Result<Option<Jvm>, JvmError> {
    let maps = std::fs::read_to_string(proc_root.join(pid.to_string()).join("maps"))
        .map_err(JvmError::Open)?;
    let Some((path, bias)) = maps.lines().find_map(libjvm_mapping) else {
        return Ok(None);
    };
    let reachable = proc_root
        .join(pid.to_string())
        .join("root")
        .join(path.trim_start_matches('/'));
    Jvm::attach(pid, &reachable, bias)
}

/// The path and load bias of a maps line of `libjvm.so`.
fn libjvm_mapping(line: &str) -> Option<(&str, u64)> {
    let mut fields = line.split_whitespace();
    let range = fields.next()?;
    let offset = fields.nth(1)?;
    let path = fields.nth(2)?;
    if !path.ends_with("/libjvm.so") {
        return None;
    }
    let start = u64::from_str_radix(range.split('-').next()?, 16).ok()?;
    let offset = u64::from_str_radix(offset, 16).ok()?;
    Some((path, start.checked_sub(offset)?))
}

/// Whether a mapped file is HotSpot's library (worth a [`find_in_process`]).
pub fn named_like_libjvm(path: &Path) -> bool {
    path.file_name().is_some_and(|name| name == "libjvm.so")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{code_cache::CodeHeap, vmstructs::LibJvm};

    /// Memory of `bytes` at `base`; reads elsewhere fail.
    struct Bytes {
        base: u64,
        bytes: Vec<u8>,
    }

    impl Memory for Bytes {
        fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), JvmError> {
            let error = || JvmError::Read {
                addr,
                len: buf.len(),
                source: io::ErrorKind::UnexpectedEof.into(),
            };
            let at = usize::try_from(addr.checked_sub(self.base).ok_or_else(error)?)
                .map_err(|_| error())?;
            let bytes = self.bytes.get(at..at + buf.len()).ok_or_else(error)?;
            buf.copy_from_slice(bytes);
            Ok(())
        }
    }

    /// A small deterministic generator: memory that holds garbage.
    fn garbage(seed: u64, len: usize) -> Vec<u8> {
        let mut state = seed | 1;
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect()
    }

    #[test]
    fn garbage_where_the_tables_should_be_is_an_error_not_a_panic() {
        const BASE: u64 = 0x10_0000;
        for seed in 0..200 {
            let mut bytes = garbage(seed, 1 << 16);
            // Half the runs point the symbols at words that point back into
            // the garbage, so reads go on past the first.
            if seed % 2 == 0 {
                for word in bytes.chunks_exact_mut(8).step_by(3) {
                    let target = BASE + u64::from(word[0]) * 64;
                    word.copy_from_slice(&target.to_le_bytes());
                }
            }
            // The symbols say where tables of sane layouts are: the tables'
            // entries are garbage.
            let header: [u64; 20] = [
                BASE + 0x1000,
                48,
                0,
                8,
                16,
                24,
                32,
                40, // fields
                BASE + 0x2000,
                32,
                0,
                8, // types
                BASE + 0x3000,
                16,
                0,
                8, // int constants
                BASE + 0x4000,
                16,
                0,
                8, // long constants
            ];
            for (i, value) in header.iter().enumerate() {
                bytes[0x100 + i * 8..][..8].copy_from_slice(&value.to_le_bytes());
            }
            let memory = Bytes { base: BASE, bytes };
            let lib = LibJvm::at(std::array::from_fn(|i| 0x100 + i as u64 * 8));
            assert!(Jvm::read(memory, &lib, BASE).is_err(), "seed {seed}");
        }
    }

    #[test]
    fn prologues_are_read_up_to_the_interrupted_instruction() {
        use UnwindRule::{Rsp, RspRbpSaved};
        // C2 (JDK 17): sub rsp, 0x18; mov [rsp + 0x10], rbp; imul ...
        let c2 = [
            0x48, 0x81, 0xec, 0x18, 0, 0, 0, 0x48, 0x89, 0x6c, 0x24, 0x10, 0x48, 0x0f, 0xaf, 0xd2,
        ];
        assert_eq!(prologue_rule(&c2, 0), Some(Rsp { cfa_off: 8 }));
        assert_eq!(prologue_rule(&c2, 7), Some(Rsp { cfa_off: 0x20 }));
        assert_eq!(
            prologue_rule(&c2, 12),
            Some(RspRbpSaved {
                cfa_off: 0x20,
                rbp_off: -16
            })
        );
        assert_eq!(prologue_rule(&c2, 3), None, "inside an instruction");
        // C1: the stack bang, push rbp, sub rsp, 0x30.
        let c1 = [
            0x89, 0x84, 0x24, 0, 0xc0, 0xfe, 0xff, 0x55, 0x48, 0x83, 0xec, 0x30, 0x90, 0, 0, 0,
        ];
        assert_eq!(prologue_rule(&c1, 7), Some(Rsp { cfa_off: 8 }));
        assert_eq!(
            prologue_rule(&c1, 8),
            Some(RspRbpSaved {
                cfa_off: 16,
                rbp_off: -16
            })
        );
        assert_eq!(
            prologue_rule(&c1, 12),
            Some(RspRbpSaved {
                cfa_off: 0x40,
                rbp_off: -16
            })
        );
        // Anything else: not known.
        assert_eq!(prologue_rule(&[0x48, 0x8b, 0x45, 0x10, 0, 0], 4), None);
    }

    #[test]
    fn a_segment_map_that_leads_nowhere_is_refused_in_bounded_steps() {
        const LOW: u64 = 0x7000_0000;
        const SEGMAP: u64 = 0x10_0000;
        let heap = CodeHeap {
            low: LOW,
            high: LOW + (1 << 24),
            segmap: SEGMAP,
            log2_segment_size: 7,
        };
        // Every segment says "one back": from the last one, back to 0 and
        // past it.
        let memory = Bytes {
            base: SEGMAP,
            bytes: vec![1; 1 << 17],
        };
        let layout = test_layout();
        let at = LOW + (((1 << 17) - 1) << 7);
        assert!(code_cache::blob_start(&memory, &layout, &heap, at).is_err());
        // Free segments say so.
        let free = Bytes {
            base: SEGMAP,
            bytes: vec![0xff; 1 << 17],
        };
        assert!(matches!(
            code_cache::blob_start(&free, &layout, &heap, at),
            Ok(None)
        ));
    }

    /// JDK 17's layout, as its tables state it.
    fn test_layout() -> Layout {
        Layout {
            heaps: 0,
            array_len: 0,
            array_data: 8,
            heap_memory: 8,
            heap_segmap: 0x78,
            heap_log2_segment_size: 0x100,
            space_low: 0x10,
            space_high: 0x18,
            heap_block_size: 16,
            block_used: Some(8),
            blob_name: 0x60,
            blob_size: 0xc,
            blob_frame_complete: (0x14, false),
            blob_frame_size: 0x1c,
            blob_code: layout::CodeRange::Pointers {
                begin: 0x20,
                end: 0x28,
            },
            blob_kind: None,
            blob_header_bytes: 352,
            nmethod_method: 0x70,
            nmethod_compile_id: 0x130,
            nmethod_stub_offset: Some(0xfc),
            nmethod_verified_entry: Some(layout::VerifiedEntry::Pointer(0xe0)),
            call_stub_return: None,
            interpreter: None,
            scopes: None,
            method_const: 8,
            const_method_constants: 8,
            const_method_name_index: 0x22,
            pool_holder: 0x18,
            pool_size: 72,
            pool_length: 0x3c,
            klass_name: 0x18,
            symbol_length: 4,
            symbol_body: 6,
        }
    }
}
