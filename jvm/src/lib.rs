//! HotSpot JVMs seen from outside: a process that maps `libjvm.so` is read
//! through the tables the JVM exports about itself ([`vmstructs`]), which
//! give the code cache ([`code_cache`]: which blob holds an address, its
//! frame size and kind) and method names ([`names`]). The unwinder asks a
//! [`Jvm`] how to step out of a frame in JIT code ([`Jvm::step_at`]); the
//! aggregator asks it for the frame's name ([`Jvm::compiled_name`],
//! [`Jvm::method_name`]).
//!
//! What is read lives long (blobs, methods) but not forever: a blob whose
//! method was deoptimized is freed and its memory reused. Blobs are read
//! again once a second and names checked against the blob they came from,
//! so a reused address is read as what it holds now.

pub mod code_cache;
pub mod layout;
pub mod memory;
pub mod names;
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

/// How long blobs read from the code cache are trusted before they are
/// read again.
const BLOB_LIFETIME: Duration = Duration::from_secs(1);

/// Blobs and method names kept per process at most (each cache is emptied
/// when full: a JVM with this many hot methods is rare).
const MAX_CACHED: usize = 16_384;

/// x86_64's interpreter frame: the `Method*` is at `rbp - 24`
/// (`frame::interpreter_frame_method_offset`, -3 words; the same from JDK
/// 8 to 25, and not among the exported constants).
pub const INTERPRETER_METHOD_OFFSET: i64 = -24;

/// How to step out of a frame in the code cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JavaStep {
    /// The frame is `bytes` long above rsp, the return address in its last
    /// word and the caller's rbp below it (compiled methods and stubs
    /// that say their frame size).
    Frame { bytes: u32 },
    /// Interrupted in an epilogue after the frame was freed and before rbp
    /// was popped: cfa = rsp + 16, rbp saved at rsp.
    BeforePopRbp,
    /// Interrupted after the epilogue's `pop rbp`: cfa = rsp + 8.
    AfterPopRbp,
    /// A template interpreter frame: linked by rbp; the caller's stack
    /// pointer is saved at rbp - 8 (the interpreter's sender sp).
    Interpreter,
    /// A return address in a blob without a frame size of its own (the
    /// call stub Java is entered through): rbp is its frame pointer.
    FramePointer,
}

/// What one JVM process is read with.
pub struct Jvm<M = ProcessMemory> {
    memory: M,
    layout: Layout,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    heaps: Vec<CodeHeap>,
    read_at: Option<Instant>,
    /// By start address.
    blobs: BTreeMap<u64, CodeBlob>,
    /// By `Method*`, with the `ConstMethod*` it had.
    names: HashMap<u64, Arc<str>>,
    pub stats: JvmStats,
}

/// What a JVM's reads found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct JvmStats {
    pub blobs_read: u64,
    pub blob_errors: u64,
    pub names_read: u64,
    pub name_errors: u64,
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
        let layout = Layout::new(&vm)?;
        let heaps = code_cache::read_heaps(&memory, &layout)?;
        Ok(Self {
            memory,
            layout,
            state: Mutex::new(State {
                heaps,
                read_at: Some(Instant::now()),
                ..State::default()
            }),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic elsewhere with the lock held leaves caches only.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The blob holding `pc`, read now or within the last second.
    pub fn blob_at(&self, pc: u64) -> Option<CodeBlob> {
        let mut state = self.state();
        self.blob_in(&mut state, pc)
    }

    fn blob_in(&self, state: &mut State, pc: u64) -> Option<CodeBlob> {
        let now = Instant::now();
        if state
            .read_at
            .is_none_or(|at| now.duration_since(at) > BLOB_LIFETIME)
        {
            state.blobs.clear();
            state.read_at = Some(now);
            match code_cache::read_heaps(&self.memory, &self.layout) {
                Ok(heaps) => state.heaps = heaps,
                Err(_) => state.stats.blob_errors += 1,
            }
        }
        if let Some((_, blob)) = state.blobs.range(..=pc).next_back()
            && pc < blob.end
        {
            return Some(blob.clone());
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
                state.blobs.insert(blob.start, blob.clone());
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
    pub fn step_at(&self, pc: u64, interrupted: bool) -> Option<JavaStep> {
        let blob = self.blob_at(pc)?;
        match blob.kind {
            BlobKind::Interpreter => Some(JavaStep::Interpreter),
            _ if blob.frame_bytes > 0 => {
                if !interrupted {
                    return u32::try_from(blob.frame_bytes)
                        .ok()
                        .map(|bytes| JavaStep::Frame { bytes });
                }
                if pc < blob.frame_complete {
                    return None;
                }
                self.epilogue_step(pc).or(u32::try_from(blob.frame_bytes)
                    .ok()
                    .map(|bytes| JavaStep::Frame { bytes }))
            }
            _ if !interrupted => Some(JavaStep::FramePointer),
            _ => None,
        }
    }

    /// Where an interrupted compiled frame is in its epilogue (`add rsp,
    /// N; pop rbp; <safepoint poll>; ret`), by the instruction at `pc`.
    fn epilogue_step(&self, pc: u64) -> Option<JavaStep> {
        let mut code = [0u8; 4];
        self.memory.read(pc, &mut code).ok()?;
        match code {
            // pop rbp
            [0x5d, ..] => Some(JavaStep::BeforePopRbp),
            // ret; cmp rsp, [r15 + disp32] (the poll since JDK 16); ja
            // (its branch); mov r10, [r15 + disp32] and test [r10], eax
            // (the polling page before)
            [0xc3, ..]
            | [0x49, 0x3b, 0xa7, _]
            | [0x0f, 0x87, ..]
            | [0x4d, 0x8b, 0x97, _]
            | [0x41, 0x85, 0x02, _] => Some(JavaStep::AfterPopRbp),
            _ => None,
        }
    }

    /// The name of the compiled method whose code holds `pc`, or `None`
    /// for code that is not a compiled method.
    pub fn compiled_name(&self, pc: u64) -> Option<Arc<str>> {
        let mut state = self.state();
        let blob = self.blob_in(&mut state, pc)?;
        if blob.kind != BlobKind::Nmethod {
            return None;
        }
        self.name_in(&mut state, blob.method)
    }

    /// The name of the method at `method` (an interpreter frame's).
    pub fn method_name(&self, method: u64) -> Option<Arc<str>> {
        let mut state = self.state();
        self.name_in(&mut state, method)
    }

    fn name_in(&self, state: &mut State, method: u64) -> Option<Arc<str>> {
        if let Some(name) = state.names.get(&method) {
            return Some(Arc::clone(name));
        }
        match names::method_name(&self.memory, &self.layout, method) {
            Ok(name) => {
                state.stats.names_read += 1;
                if state.names.len() >= MAX_CACHED {
                    state.names.clear();
                }
                let name: Arc<str> = name.into();
                state.names.insert(method, Arc::clone(&name));
                Some(name)
            }
            Err(_) => {
                state.stats.name_errors += 1;
                None
            }
        }
    }

    /// The name of a stub or the interpreter's blob holding `pc`
    /// (`StubRoutines (1)`, `Interpreter`).
    pub fn blob_name(&self, pc: u64) -> Option<String> {
        self.blob_at(pc).map(|blob| blob.name)
    }

    pub fn stats(&self) -> JvmStats {
        self.state().stats
    }
}

impl<M> std::fmt::Debug for Jvm<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Jvm").finish_non_exhaustive()
    }
}

impl<M: Memory> RuntimeCode for Jvm<M> {
    fn step_at(&self, pc: u64, interrupted: bool) -> Option<RuntimeStep> {
        let saved_rbp = |cfa_off: u32| {
            RuntimeStep::Rule(UnwindRule::RspRbpSaved {
                cfa_off: i32::try_from(cfa_off).ok()?,
                rbp_off: -16,
            })
            .into()
        };
        match Jvm::step_at(self, pc, interrupted)? {
            JavaStep::Frame { bytes } => saved_rbp(bytes),
            JavaStep::BeforePopRbp => saved_rbp(16),
            JavaStep::AfterPopRbp => Some(RuntimeStep::Rule(UnwindRule::Rsp { cfa_off: 8 })),
            JavaStep::Interpreter => Some(RuntimeStep::JavaInterpreter),
            JavaStep::FramePointer => Some(RuntimeStep::FramePointer),
        }
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
