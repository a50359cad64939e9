//! Walking one sampled user stack with precompiled tables.
//!
//! This module owns the x86_64 frame-stepping loop: which address to look up
//! for each frame, applying an [`UnwindRule`] (or the frame-pointer fallback)
//! to the registers, bounds-checked reads from the copied stack bytes, and the
//! reason every walk ends. It does not own finding the module of an address,
//! load biases or table caching (the caller's [`ModuleLookup`]), nor
//! symbolization: it returns absolute addresses.
//!
//! A walk allocates nothing per frame: frames go into the caller's reused
//! `Vec`, which is reserved once up to the depth limit.

use crate::table::{
    SIGFRAME_RBP, SIGFRAME_RIP, SIGFRAME_RSP, UnsupportedCfi, UnwindRule, UnwindTable,
};

/// Default bound on the number of frames a walk returns.
pub const DEFAULT_MAX_DEPTH: usize = 1024;

/// The registers a walk starts from, as sampled (frame 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Registers {
    /// The instruction pointer.
    pub rip: u64,
    /// The stack pointer: the address of the first byte of the stack copy.
    pub rsp: u64,
    /// The frame pointer, or whatever the code keeps in rbp.
    pub rbp: u64,
}

/// What the caller knows about the code at one address.
#[derive(Clone, Copy, Debug)]
pub enum ModuleAt<'a> {
    /// No file mapping contains the address (anonymous memory, JIT code, a
    /// corrupt return address).
    Unmapped,
    /// A mapped module without CFI: walk it with frame pointers.
    NoCfi,
    /// A mapped module and its table; the file virtual address of `pc` is
    /// `pc - bias`. `frame_pointer_gaps`: the module's code that no row
    /// covers keeps frame pointers ([`UnwindTable::frame_pointer_gaps`]),
    /// so it is walked by them; otherwise only where rbp is known to be
    /// one.
    Table {
        table: &'a UnwindTable,
        bias: u64,
        frame_pointer_gaps: bool,
    },
    /// A mapped module whose table is not ready, and the rule at `pc` read
    /// from its CFI directly ([`crate::table::DirectCfi`]).
    Rule(UnwindRule),
    /// JIT code whose runtime says how to step out of its frames (HotSpot's
    /// code cache): asked at every frame and never cached, as the runtime
    /// may put other code there at any time.
    Runtime(&'a dyn RuntimeCode),
}

/// A runtime that describes the frames of its JIT code.
pub trait RuntimeCode: std::fmt::Debug {
    /// How to step out of the frame at `pc` (`interrupted`: the sampled
    /// instruction, else the byte before a return address); `None` where
    /// the runtime cannot say: the walk ends there rather than guess.
    fn step_at(&self, pc: u64, interrupted: bool) -> Option<RuntimeStep>;
}

/// What a [`RuntimeCode`] says of one frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuntimeStep {
    /// As a CFI row would (a compiled method's frame size).
    Rule(UnwindRule),
    /// cfa = rbp + 16; ra = *(cfa - 8); rbp = *(cfa - 16).
    FramePointer,
    /// HotSpot's template interpreter: rbp links the frames as
    /// [`RuntimeStep::FramePointer`], but the caller's stack pointer is the
    /// one saved at rbp - 8 (the interpreter's sender sp): a compiled caller
    /// that called it through an adapter has its frame above what the
    /// adapter pushed. The `Method*` the frame runs is at rbp - 24.
    JavaInterpreter,
}

/// The `Method*` slot of HotSpot's x86_64 interpreter frame, from rbp
/// (`frame::interpreter_frame_method_offset`: -3 words).
const INTERPRETER_METHOD_SLOT: u64 = 24;
/// The interpreter's sender sp, from rbp (-1 word).
const INTERPRETER_SENDER_SP_SLOT: u64 = 8;
/// The most an adapter extends a compiled caller's frame by for the
/// arguments of an interpreted callee; a sender sp further away is not one.
const MAX_INTERPRETER_EXTENSION: u64 = 1 << 20;

/// Maps a code address of the sampled process to its module.
pub trait ModuleLookup {
    /// The table of the module mapped at `pc` and the bias to subtract from
    /// `pc` to get a file address; [`ModuleAt::Unmapped`] if `pc` is in no
    /// mapping; [`ModuleAt::NoCfi`] for a module without CFI (then the
    /// frame-pointer fallback is used).
    fn module_for(&self, pc: u64) -> ModuleAt<'_>;

    /// Frame `frame` of the walk is a HotSpot interpreter frame running the
    /// `Method*` `method`, as the sampled stack holds it.
    fn interpreted_frame(&self, _frame: usize, _method: u64) {}
}

/// Why a walk stopped. Every walk ends with exactly one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnwindEnd {
    /// The last frame is the outermost one: its CFI says the return address
    /// is undefined (`_start`, a `clone`d thread's entry), the return
    /// address read is 0 (which some runtimes use to end the chain), or a
    /// frame-pointer walk reached rbp = 0 (the psABI's mark).
    Outermost,
    /// A read went past the end of the copied stack bytes: the copy was too
    /// short for the whole stack (or a corrupt CFA pointed above it).
    StackTruncated,
    /// A read below the start of the copy (a corrupt rbp or CFA), or an
    /// address computation overflowed.
    BadStackAddress,
    /// The frame's address is in no mapping.
    Unmapped,
    /// The frame's module has a table but no FDE covers the address.
    NoUnwindInfo,
    /// The frame's row holds CFI the unwinder cannot evaluate.
    Unsupported(UnsupportedCfi),
    /// The walk reached `max_depth` frames.
    DepthLimit,
    /// The caller's stack pointer would not be above the callee's: the
    /// frames would loop (or the CFI or stack is corrupt).
    CfaNotIncreasing,
}

/// The stack memory a walk reads: the sample's copy, and whatever else the
/// caller read at the same instant. Reads come in rising address order
/// within a frame step and from frame to frame (the CFA only grows), which
/// [`SampledStack`] relies on to find tail spans without a search.
pub trait StackMemory {
    /// The 8 bytes at `address`, or why there are none:
    /// [`UnwindEnd::BadStackAddress`] below the start of the stack,
    /// [`UnwindEnd::StackTruncated`] where nothing was read.
    fn read_u64(&mut self, address: u64) -> Result<u64, UnwindEnd>;
}

/// The copied stack: `bytes[i]` is the byte at address `start + i`.
#[derive(Clone, Copy)]
struct Stack<'a> {
    start: u64,
    bytes: &'a [u8],
}

impl Stack<'_> {
    #[inline]
    fn read_u64(&self, address: u64) -> Result<u64, UnwindEnd> {
        let offset = address
            .checked_sub(self.start)
            .ok_or(UnwindEnd::BadStackAddress)?;
        let word = usize::try_from(offset)
            .ok()
            .and_then(|offset| self.bytes.get(offset..)?.first_chunk::<8>())
            .ok_or(UnwindEnd::StackTruncated)?;
        Ok(u64::from_le_bytes(*word))
    }
}

impl StackMemory for Stack<'_> {
    #[inline(always)]
    fn read_u64(&mut self, address: u64) -> Result<u64, UnwindEnd> {
        Stack::read_u64(self, address)
    }
}

/// One span of a sample's stack tail: `len` bytes at `addr`, found at
/// `offset` in the tail's data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TailSpan {
    pub addr: u64,
    pub offset: u32,
    pub len: u32,
}

/// How much of a copy [`SampledStack::prefetch`] asks for: more than most
/// walks read (a deep copy's megabyte is read only as far as its frames go).
#[cfg(target_arch = "x86_64")]
const PREFETCH_BYTES: usize = 16 * 1024;
#[cfg(target_arch = "x86_64")]
const CACHE_LINE: usize = 64;

/// A sample's stack as read at the tick: the contiguous copy from `rsp` and
/// the stack tail, spans further up read in the same tick (sorted by
/// address, not overlapping). A walk through the tail is as right as one
/// through a full copy: every byte is what the stack held at the tick.
pub struct SampledStack<'a> {
    copy: Stack<'a>,
    spans: &'a [TailSpan],
    data: &'a [u8],
    /// The span the last tail read hit: reads go up the stack.
    cursor: usize,
    tail_reads: u32,
    /// One past the highest copy byte read.
    copy_reach: u64,
    /// The copy has pages that could not be read, left as zeros (see
    /// [`SampledStack::with_holes`]).
    holes: bool,
}

impl<'a> SampledStack<'a> {
    /// `copy` holds the bytes at `rsp..`; `spans` index into `data`. Spans
    /// that lie outside `data` are never read from.
    pub fn new(rsp: u64, copy: &'a [u8], spans: &'a [TailSpan], data: &'a [u8]) -> Self {
        Self {
            copy: Stack {
                start: rsp,
                bytes: copy,
            },
            spans,
            data,
            cursor: 0,
            tail_reads: 0,
            copy_reach: rsp,
            holes: false,
        }
    }

    /// Marks a copy whose unreadable pages were left as zeros (a deep
    /// copy read page by page: `COPY_HOLES`): a zero word read in a page
    /// that is all zeros is not trusted, as if it were past the copy. A
    /// page holding a return address or a saved register was written by
    /// the thread, so it was readable and is not all zeros.
    pub fn with_holes(mut self, holes: bool) -> Self {
        self.holes = holes;
        self
    }

    /// Whether the copy's page (by address) around `address` is all zeros.
    fn in_zero_page(&self, address: u64) -> bool {
        const PAGE: u64 = 4096;
        let page = address & !(PAGE - 1);
        let from = page.saturating_sub(self.copy.start) as usize;
        let to = (page + PAGE).saturating_sub(self.copy.start) as usize;
        let bytes =
            &self.copy.bytes[from.min(self.copy.bytes.len())..to.min(self.copy.bytes.len())];
        bytes.iter().all(|&byte| byte == 0)
    }

    /// Starts loading the first [`PREFETCH_BYTES`] of the copy into the
    /// cache, all lines at once. A walk reads the copy as a chain (each
    /// return address says where the next frame is), so without this every
    /// frame waits for its own cache miss in turn: the copy sits in a ring
    /// buffer that another CPU wrote milliseconds ago, and the agent's own
    /// profile showed a third of a walk's time on that one load.
    pub fn prefetch(&self) {
        #[cfg(target_arch = "x86_64")]
        {
            use core::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
            let bytes = &self.copy.bytes[..self.copy.bytes.len().min(PREFETCH_BYTES)];
            for line in bytes.chunks(CACHE_LINE) {
                // SAFETY: a prefetch is a hint that reads nothing (SSE,
                // which every x86_64 CPU has); the address lies in the copy.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast()) };
            }
        }
    }

    /// Forgets what earlier walks read, for a walk made again.
    pub fn restart(&mut self) {
        self.cursor = 0;
        self.tail_reads = 0;
        self.copy_reach = self.copy.start;
    }

    /// Words the walk read from the tail: more than 0 means the walk went
    /// past the copy (it was stitched).
    pub fn tail_reads(&self) -> u32 {
        self.tail_reads
    }

    /// Bytes of the copy, from its start, that the walk read.
    pub fn copy_bytes_read(&self) -> u64 {
        self.copy_reach - self.copy.start
    }

    fn read_tail(&mut self, address: u64) -> Option<u64> {
        self.cursor = self.cursor.min(self.spans.len().saturating_sub(1));
        while self.cursor > 0 && self.spans[self.cursor].addr > address {
            self.cursor -= 1;
        }
        while let Some(span) = self.spans.get(self.cursor) {
            let end = span.addr.saturating_add(u64::from(span.len));
            if address < span.addr {
                return None;
            }
            if address.checked_add(8).is_some_and(|last| last <= end) {
                let at = span.offset as usize + (address - span.addr) as usize;
                let word = self.data.get(at..)?.first_chunk::<8>()?;
                return Some(u64::from_le_bytes(*word));
            }
            self.cursor += 1;
        }
        None
    }
}

impl StackMemory for SampledStack<'_> {
    #[inline(always)]
    fn read_u64(&mut self, address: u64) -> Result<u64, UnwindEnd> {
        match self.copy.read_u64(address) {
            Ok(0) if self.holes && self.in_zero_page(address) => Err(UnwindEnd::StackTruncated),
            Ok(word) => {
                self.copy_reach = self.copy_reach.max(address + 8);
                Ok(word)
            }
            Err(UnwindEnd::StackTruncated) => {
                let word = self.read_tail(address).ok_or(UnwindEnd::StackTruncated)?;
                self.tail_reads += 1;
                Ok(word)
            }
            Err(end) => Err(end),
        }
    }
}

/// How the registers of one frame are recovered.
#[derive(Clone, Copy)]
enum Step {
    Rule(UnwindRule),
    /// See [`RuntimeStep::JavaInterpreter`].
    JavaInterpreter,
    /// No CFI: cfa = rbp + 16; ra = *(rbp + 8); rbp = *rbp
    FramePointer,
    /// The module has a table but no row covers the address (code
    /// generated at build time without CFI, such as V8's builtins, or
    /// hand-written assembly): [`Step::FramePointer`] where rbp is known to
    /// be a frame pointer (the frame was reached through one), else the
    /// walk ends.
    NoRow,
}

/// Walks the stack of one sample, writing each frame's absolute address into
/// `frames` (cleared first): frame 0 is `regs.rip`, the others are return
/// addresses (or the interrupted address, above a signal frame).
///
/// `stack` holds the bytes at `[regs.rsp, regs.rsp + stack.len())`. At most
/// `max_depth` frames are returned.
pub fn unwind(
    regs: Registers,
    stack: &[u8],
    modules: &impl ModuleLookup,
    max_depth: usize,
    frames: &mut Vec<u64>,
) -> UnwindEnd {
    let mut stack = Stack {
        start: regs.rsp,
        bytes: stack,
    };
    walk(regs, &mut stack, modules, &mut NoCache, max_depth, frames)
}

/// [`unwind`], remembering the rule found for each code address in `cache`
/// so that hot code skips the module and table lookups. `space` names the
/// address space (the process, and a version of its mappings): entries of
/// another space never match, so a process whose mappings change takes a
/// new `space` instead of clearing the cache.
pub fn unwind_cached(
    regs: Registers,
    stack: &[u8],
    modules: &impl ModuleLookup,
    cache: &mut RuleCache,
    space: u64,
    max_depth: usize,
    frames: &mut Vec<u64>,
) -> UnwindEnd {
    let mut stack = Stack {
        start: regs.rsp,
        bytes: stack,
    };
    unwind_memory(regs, &mut stack, modules, cache, space, max_depth, frames)
}

/// [`unwind_cached`] over any [`StackMemory`]: a [`SampledStack`] with its
/// tail, or memory the caller reads some other way.
pub fn unwind_memory(
    regs: Registers,
    stack: &mut impl StackMemory,
    modules: &impl ModuleLookup,
    cache: &mut RuleCache,
    space: u64,
    max_depth: usize,
    frames: &mut Vec<u64>,
) -> UnwindEnd {
    let mut walk_cache = SpaceCache {
        slots: &mut cache.slots,
        space,
        hits: 0,
        misses: 0,
    };
    let end = walk(regs, stack, modules, &mut walk_cache, max_depth, frames);
    // Counted in the walk's locals, added once: a store per frame to the
    // shared counters was measurable.
    let (hits, misses) = (walk_cache.hits, walk_cache.misses);
    cache.hits += hits;
    cache.misses += misses;
    end
}

/// Remembers how to step from a code address.
trait StepCache {
    fn get(&mut self, pc: u64) -> Option<Step>;
    fn put(&mut self, pc: u64, step: Step);
}

struct NoCache;

impl StepCache for NoCache {
    #[inline]
    fn get(&mut self, _pc: u64) -> Option<Step> {
        None
    }
    #[inline]
    fn put(&mut self, _pc: u64, _step: Step) {}
}

/// Slots in a [`RuleCache`]: 32 bytes each, 128 KiB in all, about the hot
/// code of a few busy processes (the agent shares one cache between all).
pub const RULE_CACHE_SLOTS: usize = 4096;

/// A direct-mapped cache from (address space, code address) to the way to
/// step that frame, shared by every walk of a walker. Bounded: a new entry
/// replaces whatever its slot held.
pub struct RuleCache {
    slots: Box<[Slot]>,
    hits: u64,
    misses: u64,
}

#[derive(Clone, Copy)]
struct Slot {
    space: u64,
    pc: u64,
    /// `None`: empty.
    step: Option<Step>,
}

impl Default for RuleCache {
    fn default() -> Self {
        Self {
            slots: vec![
                Slot {
                    space: 0,
                    pc: 0,
                    step: None,
                };
                RULE_CACHE_SLOTS
            ]
            .into_boxed_slice(),
            hits: 0,
            misses: 0,
        }
    }
}

impl RuleCache {
    /// Lookups answered by the cache, and those that were not.
    pub fn hits_and_misses(&self) -> (u64, u64) {
        (self.hits, self.misses)
    }

    #[inline]
    fn slot(space: u64, pc: u64) -> usize {
        // Fibonacci hashing: consecutive addresses spread over the slots.
        let key = (pc ^ space.rotate_left(29)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        (key >> (64 - RULE_CACHE_SLOTS.trailing_zeros())) as usize
    }
}

struct SpaceCache<'a> {
    slots: &'a mut [Slot],
    space: u64,
    hits: u64,
    misses: u64,
}

impl StepCache for SpaceCache<'_> {
    #[inline(always)]
    fn get(&mut self, pc: u64) -> Option<Step> {
        let slot = self.slots[RuleCache::slot(self.space, pc)];
        if slot.pc == pc && slot.space == self.space && slot.step.is_some() {
            self.hits += 1;
            slot.step
        } else {
            self.misses += 1;
            None
        }
    }

    #[inline(always)]
    fn put(&mut self, pc: u64, step: Step) {
        self.slots[RuleCache::slot(self.space, pc)] = Slot {
            space: self.space,
            pc,
            step: Some(step),
        };
    }
}

fn walk(
    regs: Registers,
    stack: &mut impl StackMemory,
    modules: &impl ModuleLookup,
    cache: &mut impl StepCache,
    max_depth: usize,
    frames: &mut Vec<u64>,
) -> UnwindEnd {
    frames.clear();
    // Once per walk, and a no-op once the caller's Vec has grown: no
    // allocation per frame. Capped so a huge `max_depth` does not reserve
    // memory the stack could never fill.
    frames.reserve(max_depth.min(4096));
    let mut regs = regs;
    // Where the current rbp was saved, when it has not been read yet: a
    // saved rbp is read only when a rule uses it, so a walk reads (and a
    // stack tail needs) no slot whose value nothing uses.
    let mut rbp_saved_at = None;
    // Frame 0's rip is the interrupted instruction; a return address is the
    // instruction after a call, possibly already in the next function (calls
    // to noreturn functions end functions), so its frame is looked up at
    // rip - 1. Frames above a signal frame hold an interrupted rip again.
    let mut exact = true;
    // The current frame's address came from a frame-pointer step: without
    // CFI to vouch for the slot, it is a frame only if it lands in code.
    let mut via_frame_pointer = false;
    loop {
        if frames.len() >= max_depth {
            return UnwindEnd::DepthLimit;
        }
        frames.push(regs.rip);
        let pc = if exact {
            regs.rip
        } else {
            regs.rip.wrapping_sub(1)
        };
        let step = match cache.get(pc) {
            Some(step) => step,
            None => {
                let mut cacheable = true;
                let step = match modules.module_for(pc) {
                    ModuleAt::Runtime(code) => {
                        // Not cached: see `ModuleAt::Runtime`.
                        cacheable = false;
                        match code.step_at(pc, exact) {
                            Some(RuntimeStep::Rule(rule)) => Step::Rule(rule),
                            Some(RuntimeStep::FramePointer) => Step::FramePointer,
                            Some(RuntimeStep::JavaInterpreter) => Step::JavaInterpreter,
                            None => return UnwindEnd::NoUnwindInfo,
                        }
                    }
                    ModuleAt::Unmapped => {
                        if via_frame_pointer {
                            // rbp was not a frame pointer (or the chain is
                            // broken): what it led to is not a frame.
                            frames.pop();
                        }
                        return UnwindEnd::Unmapped;
                    }
                    ModuleAt::NoCfi => Step::FramePointer,
                    ModuleAt::Table {
                        table,
                        bias,
                        frame_pointer_gaps,
                    } => {
                        match pc
                            .checked_sub(bias)
                            .and_then(|address| table.lookup(address))
                        {
                            Some(rule) => Step::Rule(rule),
                            None if frame_pointer_gaps => Step::FramePointer,
                            None => Step::NoRow,
                        }
                    }
                    ModuleAt::Rule(rule) => Step::Rule(rule),
                };
                if cacheable {
                    cache.put(pc, step);
                }
                step
            }
        };
        let step = match step {
            // rbp is a frame pointer as far as anything can tell when the
            // frame was reached through one (JIT code calling V8's
            // builtins); interrupted there, or after a CFI step, it may be
            // any callee-saved value (code without CFI need not keep a
            // frame pointer), and a guess could invent a caller.
            Step::NoRow if via_frame_pointer => Step::FramePointer,
            Step::NoRow => return UnwindEnd::NoUnwindInfo,
            // Interrupted inside it, the frame may not be set up.
            Step::Rule(UnwindRule::FramePointerAtCalls) if exact => {
                return UnwindEnd::NoUnwindInfo;
            }
            // At a return address, it is: the call was made from the frame.
            Step::Rule(UnwindRule::FramePointerAtCalls) => Step::FramePointer,
            step => step,
        };
        let next = match step {
            Step::JavaInterpreter => {
                step_interpreter(&regs, rbp_saved_at, stack).map(|(caller, method)| {
                    modules.interpreted_frame(frames.len() - 1, method);
                    (caller, None, false)
                })
            }
            step => step_frame(step, &regs, rbp_saved_at, stack),
        };
        let (caller, caller_rbp_at, signal) = match next {
            Ok(next) => next,
            Err(end) => return end,
        };
        if caller.rsp <= regs.rsp {
            return UnwindEnd::CfaNotIncreasing;
        }
        if caller.rip == 0 {
            return UnwindEnd::Outermost;
        }
        regs = caller;
        rbp_saved_at = caller_rbp_at;
        exact = signal;
        // An interpreter frame is linked by rbp too: what its rbp led to
        // is a frame only if it lands in code.
        via_frame_pointer = matches!(step, Step::FramePointer | Step::JavaInterpreter);
    }
}

/// The caller of a HotSpot interpreter frame (see
/// [`RuntimeStep::JavaInterpreter`]) and the `Method*` the frame runs; its
/// slots are read in rising order, as [`StackMemory`] expects.
fn step_interpreter(
    regs: &Registers,
    rbp_saved_at: Option<u64>,
    stack: &mut impl StackMemory,
) -> Result<(Registers, u64), UnwindEnd> {
    let rbp = match rbp_saved_at {
        Some(slot) => stack.read_u64(slot)?,
        None => regs.rbp,
    };
    let method_slot = rbp
        .checked_sub(INTERPRETER_METHOD_SLOT)
        .ok_or(UnwindEnd::BadStackAddress)?;
    // The frame's slots lie at or above the stack pointer.
    if method_slot < regs.rsp || rbp % 8 != 0 {
        return Err(UnwindEnd::BadStackAddress);
    }
    let method = stack.read_u64(method_slot)?;
    let sender_sp = stack.read_u64(rbp - INTERPRETER_SENDER_SP_SLOT)?;
    let caller_rbp = stack.read_u64(rbp)?;
    let cfa = rbp.checked_add(16).ok_or(UnwindEnd::BadStackAddress)?;
    let rip = stack.read_u64(cfa - 8)?;
    if sender_sp < cfa || sender_sp - cfa > MAX_INTERPRETER_EXTENSION || sender_sp % 8 != 0 {
        return Err(UnwindEnd::BadStackAddress);
    }
    let caller = Registers {
        rip,
        rsp: sender_sp,
        rbp: caller_rbp,
    };
    Ok((caller, method))
}

/// The caller's registers, where its rbp is saved if it has not been read
/// (then `rbp` is meaningless), and whether they come from a signal frame.
/// `rbp_saved_at` says the same of `regs`.
// Inlined into the walk loop: as a call, the `Step` it takes by value went
// through the stack with partial writes and wide reads (store-forwarding
// stalls), a third of the walk's time.
#[inline(always)]
fn step_frame(
    step: Step,
    regs: &Registers,
    rbp_saved_at: Option<u64>,
    stack: &mut impl StackMemory,
) -> Result<(Registers, Option<u64>, bool), UnwindEnd> {
    let offset = |base: u64, off: i32| {
        base.checked_add_signed(i64::from(off))
            .ok_or(UnwindEnd::BadStackAddress)
    };
    let live_rbp = |stack: &mut _| match rbp_saved_at {
        Some(slot) => StackMemory::read_u64(stack, slot),
        None => Ok(regs.rbp),
    };
    let (cfa, rbp_slot) = match step {
        // Taken by `step_interpreter`.
        Step::NoRow | Step::JavaInterpreter => return Err(UnwindEnd::NoUnwindInfo),
        Step::FramePointer => {
            let rbp = live_rbp(stack)?;
            // The psABI has _start clear rbp to mark the outermost frame.
            if rbp == 0 {
                return Err(UnwindEnd::Outermost);
            }
            // A frame record lies in the frame, at or above the stack
            // pointer, and is word-aligned; anything else means rbp is not
            // a frame pointer here.
            if rbp < regs.rsp {
                return Err(UnwindEnd::CfaNotIncreasing);
            }
            if rbp % 8 != 0 {
                return Err(UnwindEnd::BadStackAddress);
            }
            let cfa = rbp.checked_add(16).ok_or(UnwindEnd::BadStackAddress)?;
            (cfa, Some(rbp))
        }
        Step::Rule(rule) => match rule {
            UnwindRule::Rsp { cfa_off } => (offset(regs.rsp, cfa_off)?, None),
            UnwindRule::RspRbpSaved { cfa_off, rbp_off } => {
                let cfa = offset(regs.rsp, cfa_off)?;
                (cfa, Some(offset(cfa, rbp_off)?))
            }
            UnwindRule::Rbp { cfa_off } => (offset(live_rbp(stack)?, cfa_off)?, None),
            UnwindRule::RbpRbpSaved { cfa_off, rbp_off } => {
                let cfa = offset(live_rbp(stack)?, cfa_off)?;
                (cfa, Some(offset(cfa, rbp_off)?))
            }
            UnwindRule::Plt { threshold } => {
                let pushed = if regs.rip & 15 >= u64::from(threshold) {
                    8
                } else {
                    0
                };
                (offset(regs.rsp, 8 + pushed)?, None)
            }
            UnwindRule::Outermost => return Err(UnwindEnd::Outermost),
            UnwindRule::SignalFrame => {
                // rsp points at the kernel's ucontext (the handler's `ret`
                // popped rt_sigframe.pretcode), whose sigcontext holds the
                // interrupted registers.
                let mut at = |off: u64| {
                    regs.rsp
                        .checked_add(off)
                        .ok_or(UnwindEnd::BadStackAddress)
                        .and_then(|address| stack.read_u64(address))
                };
                let caller = Registers {
                    rip: at(SIGFRAME_RIP)?,
                    rsp: at(SIGFRAME_RSP)?,
                    rbp: at(SIGFRAME_RBP)?,
                };
                return Ok((caller, None, true));
            }
            UnwindRule::Unsupported(reason) => return Err(UnwindEnd::Unsupported(reason)),
            // Made a frame-pointer step (or the end) by the walk loop.
            UnwindRule::FramePointerAtCalls => return Err(UnwindEnd::NoUnwindInfo),
        },
    };
    // Checked here, before reading, so a CFA at or below rsp cannot make the
    // reads below look at the callee's own frame.
    if cfa <= regs.rsp {
        return Err(UnwindEnd::CfaNotIncreasing);
    }
    let ra_slot = cfa.checked_sub(8).ok_or(UnwindEnd::BadStackAddress)?;
    let rip = stack.read_u64(ra_slot)?;
    let (rbp, rbp_at) = match rbp_slot {
        // A slot below the stack pointer is no longer part of the frame: in
        // an epilogue after `pop rbp`, CFI that does not restore rbp still
        // names the slot the value was popped from. The value is back in rbp.
        Some(slot) if slot < regs.rsp => (regs.rbp, rbp_saved_at),
        Some(slot) => (0, Some(slot)),
        None => (regs.rbp, rbp_saved_at),
    };
    Ok((Registers { rip, rsp: cfa, rbp }, rbp_at, false))
}

#[cfg(test)]
mod tests {
    use super::*;
    use UnwindRule::{Outermost, Plt, Rbp, Rsp, RspRbpSaved, SignalFrame, Unsupported};
    use std::cell::Cell;

    /// Synthetic stacks start here.
    const SP: u64 = 0x7fff_0000_1000;

    /// A fake process: `(start, end, module)` mappings.
    struct Modules<'a>(Vec<(u64, u64, ModuleAt<'a>)>);

    impl ModuleLookup for Modules<'_> {
        fn module_for(&self, pc: u64) -> ModuleAt<'_> {
            self.0
                .iter()
                .find(|(start, end, _)| (*start..*end).contains(&pc))
                .map_or(ModuleAt::Unmapped, |&(_, _, module)| module)
        }
    }

    /// Stack bytes built word by word at absolute addresses from `SP` up.
    struct StackImage(Vec<u8>);

    impl StackImage {
        fn new(len: usize) -> Self {
            Self(vec![0; len])
        }
        fn word(mut self, address: u64, value: u64) -> Self {
            let at = (address - SP) as usize;
            self.0[at..at + 8].copy_from_slice(&value.to_le_bytes());
            self
        }
    }

    /// A module at file addresses 0x1000..0x1400, loaded with bias 0x5550_0000_0000:
    /// f (rsp-based), g (saves rbp), h (outermost), a gap, then odd rows.
    fn table() -> UnwindTable {
        UnwindTable::from_rows(&[
            (0x1000, Some(Rsp { cfa_off: 16 })),
            (
                0x1100,
                Some(RspRbpSaved {
                    cfa_off: 32,
                    rbp_off: -16,
                }),
            ),
            (0x1200, Some(Outermost)),
            (0x1280, None),
            (0x1300, Some(Unsupported(UnsupportedCfi::CfaRegister))),
            (0x1310, Some(Rsp { cfa_off: 0 })),
            (0x1320, Some(Rbp { cfa_off: 16 })),
            (0x1330, Some(Plt { threshold: 11 })),
            (0x1340, Some(SignalFrame)),
            (0x1350, Some(Rsp { cfa_off: 4 })),
            // An epilogue after `pop rbp` whose CFI still names rbp's slot.
            (
                0x1360,
                Some(RspRbpSaved {
                    cfa_off: 8,
                    rbp_off: -16,
                }),
            ),
            (0x1370, None),
        ])
    }

    const BIAS: u64 = 0x5550_0000_0000;
    const F: u64 = BIAS + 0x1000;
    const G: u64 = BIAS + 0x1100;
    const H: u64 = BIAS + 0x1200;
    const GAP: u64 = BIAS + 0x1280;
    const UNSUPPORTED: u64 = BIAS + 0x1300;
    const CFA_EQUALS_RSP: u64 = BIAS + 0x1310;
    const RBP_BASED: u64 = BIAS + 0x1320;
    const PLT: u64 = BIAS + 0x1330;
    const TRAMPOLINE: u64 = BIAS + 0x1340;
    const SHORT_CFA: u64 = BIAS + 0x1350;
    const EPILOGUE: u64 = BIAS + 0x1360;
    /// A module without CFI.
    const NO_CFI: u64 = 0x4000_0000;

    fn modules(table: &UnwindTable) -> Modules<'_> {
        Modules(vec![
            (
                BIAS + 0x1000,
                BIAS + 0x2000,
                ModuleAt::Table {
                    table,
                    bias: BIAS,
                    frame_pointer_gaps: false,
                },
            ),
            (NO_CFI, NO_CFI + 0x1000, ModuleAt::NoCfi),
        ])
    }

    fn walk(regs: Registers, stack: &StackImage, max_depth: usize) -> (Vec<u64>, UnwindEnd) {
        let table = table();
        let mut frames = vec![0xdead; 3]; // a reused Vec: cleared by the walk
        let end = unwind(regs, &stack.0, &modules(&table), max_depth, &mut frames);
        (frames, end)
    }

    fn regs(rip: u64) -> Registers {
        Registers {
            rip,
            rsp: SP,
            rbp: 0x1111,
        }
    }

    #[test]
    fn rsp_and_saved_rbp_rules_to_the_outermost_frame() {
        // f: cfa = SP + 16, ra at SP + 8 -> g. g: rsp = SP + 16, cfa = SP + 48,
        // rbp saved at SP + 32, ra at SP + 40 -> h, which is outermost.
        let stack = StackImage::new(64)
            .word(SP + 8, G + 0x50)
            .word(SP + 32, 0x2222)
            .word(SP + 40, H + 0x10);
        let (frames, end) = walk(regs(F + 0x10), &stack, DEFAULT_MAX_DEPTH);
        assert_eq!(frames, [F + 0x10, G + 0x50, H + 0x10]);
        assert_eq!(end, UnwindEnd::Outermost);
    }

    #[test]
    fn code_that_keeps_frame_pointers_at_calls_is_stepped_by_rbp_only_at_a_return_address() {
        // f (rsp-based) was called from a V8-style builtin, which set up its
        // frame (rbp = SP + 32) before the call and was called by h.
        let table = UnwindTable::from_rows(&[
            (0x1000, Some(Rsp { cfa_off: 16 })),
            (0x1100, Some(UnwindRule::FramePointerAtCalls)),
            (0x1200, Some(Outermost)),
            (0x1300, None),
        ]);
        const BUILTIN: u64 = BIAS + 0x1100;
        let stack = StackImage::new(64)
            .word(SP + 8, BUILTIN + 0x20)
            .word(SP + 32, 0x7777)
            .word(SP + 40, H + 0x10);
        let regs = Registers {
            rip: F + 0x10,
            rsp: SP,
            rbp: SP + 32,
        };
        let mut frames = Vec::new();
        let end = unwind(regs, &stack.0, &modules(&table), 64, &mut frames);
        assert_eq!(frames, [F + 0x10, BUILTIN + 0x20, H + 0x10]);
        assert_eq!(end, UnwindEnd::Outermost);

        // Interrupted inside the builtin: its frame may not be set up yet
        // (rbp would name its caller's frame and skip the caller).
        let inside = Registers {
            rip: BUILTIN + 0x4,
            ..regs
        };
        let end = unwind(inside, &stack.0, &modules(&table), 64, &mut frames);
        assert_eq!(
            (frames.as_slice(), end),
            (&[BUILTIN + 0x4][..], UnwindEnd::NoUnwindInfo)
        );
    }

    #[test]
    fn a_cached_walk_matches_the_uncached_one_and_keeps_spaces_apart() {
        let table = table();
        let stack = StackImage::new(64)
            .word(SP + 8, G + 0x50)
            .word(SP + 32, 0x2222)
            .word(SP + 40, H + 0x10);
        let mut cache = RuleCache::default();
        let mut cached = Vec::new();
        for round in 0..2 {
            let end = unwind_cached(
                regs(F + 0x10),
                &stack.0,
                &modules(&table),
                &mut cache,
                1,
                DEFAULT_MAX_DEPTH,
                &mut cached,
            );
            assert_eq!(
                (cached.as_slice(), end),
                (&[F + 0x10, G + 0x50, H + 0x10][..], UnwindEnd::Outermost),
                "round {round}"
            );
        }
        // Three lookups missed in round 0 and hit in round 1.
        assert_eq!(cache.hits_and_misses(), (3, 3));

        // Another space with other code at the same addresses: no stale hit.
        let other = UnwindTable::from_rows(&[(0x1000, Some(Outermost)), (0x2000, None)]);
        let end = unwind_cached(
            regs(F + 0x10),
            &stack.0,
            &modules(&other),
            &mut cache,
            2,
            DEFAULT_MAX_DEPTH,
            &mut cached,
        );
        assert_eq!(
            (cached.as_slice(), end),
            (&[F + 0x10][..], UnwindEnd::Outermost)
        );
    }

    /// The stack of `rsp_and_saved_rbp_rules_to_the_outermost_frame` with
    /// only its first `copy` bytes copied and the rest of the image given
    /// as the tail spans `spans` (start, len relative to SP).
    fn sampled_walk(copy: usize, spans: &[(u64, u32)]) -> (Vec<u64>, UnwindEnd, u32, u64) {
        let stack = StackImage::new(64)
            .word(SP + 8, G + 0x50)
            .word(SP + 32, 0x2222)
            .word(SP + 40, H + 0x10);
        let mut data = Vec::new();
        let spans: Vec<TailSpan> = spans
            .iter()
            .map(|&(start, len)| {
                let offset = data.len() as u32;
                data.extend_from_slice(&stack.0[start as usize..][..len as usize]);
                TailSpan {
                    addr: SP + start,
                    offset,
                    len,
                }
            })
            .collect();
        let table = table();
        let mut memory = SampledStack::new(SP, &stack.0[..copy], &spans, &data);
        let mut frames = Vec::new();
        let end = unwind_memory(
            regs(F + 0x10),
            &mut memory,
            &modules(&table),
            &mut RuleCache::default(),
            1,
            DEFAULT_MAX_DEPTH,
            &mut frames,
        );
        (frames, end, memory.tail_reads(), memory.copy_bytes_read())
    }

    #[test]
    fn a_walk_continues_through_the_tail_spans_past_the_copy() {
        // The copy holds f's frame; g's return address comes from a span.
        // g's saved rbp is never read: no rule uses it.
        let (frames, end, tail_reads, copy_read) = sampled_walk(16, &[(32, 16)]);
        assert_eq!(frames, [F + 0x10, G + 0x50, H + 0x10]);
        assert_eq!(end, UnwindEnd::Outermost);
        assert_eq!((tail_reads, copy_read), (1, 16));
        // A span of just the return address does as well.
        let (frames, end, tail_reads, _) = sampled_walk(16, &[(40, 8)]);
        assert_eq!(
            (frames.len(), end, tail_reads),
            (3, UnwindEnd::Outermost, 1)
        );
        // A whole copy reads no tail.
        let (_, end, tail_reads, copy_read) = sampled_walk(64, &[(32, 16)]);
        assert_eq!((end, tail_reads, copy_read), (UnwindEnd::Outermost, 0, 48));
    }

    #[test]
    fn a_zero_word_in_an_all_zero_page_of_a_copy_with_holes_is_not_trusted() {
        // Three pages from a page-aligned rsp: words in the first and
        // last, the middle one all zeros (a page the sampler could not
        // read), and a zero word in the first.
        const START: u64 = 0x7ffd_0000_0000;
        let mut copy = vec![0u8; 3 * 4096];
        copy[8..16].copy_from_slice(&0x1234u64.to_le_bytes());
        copy[2 * 4096 + 8..2 * 4096 + 16].copy_from_slice(&0x5678u64.to_le_bytes());
        let read = |holes: bool, address: u64| {
            SampledStack::new(START, &copy, &[], &[])
                .with_holes(holes)
                .read_u64(address)
        };
        assert_eq!(read(true, START + 8), Ok(0x1234));
        assert_eq!(read(true, START + 16), Ok(0), "a zero in a page with words");
        assert_eq!(
            read(true, START + 4096 + 64),
            Err(UnwindEnd::StackTruncated),
            "the unread page"
        );
        assert_eq!(read(true, START + 2 * 4096 + 8), Ok(0x5678));
        // Without holes, zeros are what the stack held.
        assert_eq!(read(false, START + 4096 + 64), Ok(0));
    }

    #[test]
    fn a_word_neither_copied_nor_in_the_tail_truncates_the_walk() {
        // The return address slot (SP + 40) is missing: stop after g.
        // (A saved rbp that is missing only matters once a rule uses it:
        // see `a_saved_rbp_is_read_when_a_rule_uses_it`.)
        let (frames, end, _, _) = sampled_walk(16, &[(32, 8)]);
        assert_eq!(frames, [F + 0x10, G + 0x50]);
        assert_eq!(end, UnwindEnd::StackTruncated);
        // No tail at all.
        let (frames, end, tail_reads, _) = sampled_walk(16, &[]);
        assert_eq!(
            (frames.len(), end, tail_reads),
            (2, UnwindEnd::StackTruncated, 0)
        );
    }

    #[test]
    fn a_saved_rbp_is_read_when_a_rule_uses_it() {
        // g saves rbp at SP + 32; h is walked with frame pointers, so its
        // CFA needs that rbp. Without the slot the walk stops at h.
        let table = table();
        let stack = StackImage::new(64)
            .word(SP + 8, G + 0x50)
            .word(SP + 32, SP + 48)
            .word(SP + 40, NO_CFI + 0x10)
            .word(SP + 56, H + 0x10);
        let walk = |copy: usize| {
            let mut memory = SampledStack::new(SP, &stack.0[..copy], &[], &[]);
            let mut frames = Vec::new();
            let end = unwind_memory(
                regs(F + 0x10),
                &mut memory,
                &modules(&table),
                &mut RuleCache::default(),
                1,
                DEFAULT_MAX_DEPTH,
                &mut frames,
            );
            (frames, end)
        };
        assert_eq!(
            walk(64),
            (
                vec![F + 0x10, G + 0x50, NO_CFI + 0x10, H + 0x10],
                UnwindEnd::Outermost
            )
        );
        // The rbp slot (SP + 32) cut off, the return address kept: stop
        // where rbp is needed, not where it was saved.
        let mut cut = stack.0.clone();
        cut[32..40].fill(0);
        let spans = [TailSpan {
            addr: SP + 40,
            offset: 0,
            len: 8,
        }];
        let data = (NO_CFI + 0x10).to_le_bytes();
        let mut memory = SampledStack::new(SP, &cut[..32], &spans, &data);
        let mut frames = Vec::new();
        let end = unwind_memory(
            regs(F + 0x10),
            &mut memory,
            &modules(&table),
            &mut RuleCache::default(),
            1,
            DEFAULT_MAX_DEPTH,
            &mut frames,
        );
        assert_eq!(frames, [F + 0x10, G + 0x50, NO_CFI + 0x10]);
        assert_eq!(end, UnwindEnd::StackTruncated);
    }

    #[test]
    fn spans_pointing_outside_their_data_are_not_read() {
        let data = [0u8; 8];
        let spans = [TailSpan {
            addr: SP + 32,
            offset: 4,
            len: 16,
        }];
        let mut memory = SampledStack::new(SP, &[0; 16], &spans, &data);
        assert_eq!(memory.read_u64(SP + 32), Err(UnwindEnd::StackTruncated));
        assert_eq!(memory.read_u64(SP + 40), Err(UnwindEnd::StackTruncated));
        assert_eq!(memory.read_u64(SP - 8), Err(UnwindEnd::BadStackAddress));
        assert_eq!(
            memory.read_u64(u64::MAX - 3),
            Err(UnwindEnd::StackTruncated)
        );
        assert_eq!(memory.tail_reads(), 0);
    }

    #[test]
    fn an_rbp_slot_below_rsp_keeps_the_live_rbp() {
        // At EPILOGUE rbp was popped already: its slot (cfa - 16 = SP - 8) is
        // below rsp and outside the copy. The walk goes on with rbp as it is.
        // f then runs with rsp = SP + 8: cfa = SP + 24, ra at SP + 16.
        let stack = StackImage::new(32)
            .word(SP, F + 0x10)
            .word(SP + 16, H + 0x10);
        let (frames, end) = walk(regs(EPILOGUE), &stack, DEFAULT_MAX_DEPTH);
        assert_eq!(frames, [EPILOGUE, F + 0x10, H + 0x10]);
        assert_eq!(end, UnwindEnd::Outermost);
    }

    #[test]
    fn return_addresses_are_looked_up_one_byte_back() {
        // The return address is G exactly (f ends in a call to a noreturn
        // function): the caller is f itself, whose rule applies, not g's.
        let stack = StackImage::new(64).word(SP + 8, G).word(SP + 24, H + 0x10);
        let (frames, end) = walk(regs(F + 0x10), &stack, DEFAULT_MAX_DEPTH);
        assert_eq!(frames, [F + 0x10, G, H + 0x10]);
        assert_eq!(end, UnwindEnd::Outermost);

        // Frame 0 is exact: at G, g's rule applies.
        let stack = StackImage::new(64)
            .word(SP + 24, H + 0x10)
            .word(SP + 16, 0x3333);
        let (frames, end) = walk(regs(G), &stack, DEFAULT_MAX_DEPTH);
        assert_eq!(frames, [G, H + 0x10]);
        assert_eq!(end, UnwindEnd::Outermost);
    }

    #[test]
    fn a_null_return_address_ends_the_walk() {
        let stack = StackImage::new(16);
        let (frames, end) = walk(regs(F), &stack, DEFAULT_MAX_DEPTH);
        assert_eq!(frames, [F]);
        assert_eq!(end, UnwindEnd::Outermost);
    }

    #[test]
    fn copy_exhausted() {
        // g's return address is at SP + 40, past the 32 copied bytes.
        let stack = StackImage::new(32).word(SP + 8, G + 0x50);
        let (frames, end) = walk(regs(F + 0x10), &stack, DEFAULT_MAX_DEPTH);
        assert_eq!(frames, [F + 0x10, G + 0x50]);
        assert_eq!(end, UnwindEnd::StackTruncated);

        // Nothing copied at all.
        let (frames, end) = walk(regs(F), &StackImage::new(0), DEFAULT_MAX_DEPTH);
        assert_eq!(frames, [F]);
        assert_eq!(end, UnwindEnd::StackTruncated);
    }

    #[test]
    fn address_in_no_mapping() {
        let stack = StackImage::new(16).word(SP + 8, 0x1234);
        let (frames, end) = walk(regs(F), &stack, DEFAULT_MAX_DEPTH);
        assert_eq!(frames, [F, 0x1234]);
        assert_eq!(end, UnwindEnd::Unmapped);
    }

    #[test]
    fn address_no_fde_covers() {
        let stack = StackImage::new(16).word(SP + 8, GAP + 8);
        let (frames, end) = walk(regs(F), &stack, DEFAULT_MAX_DEPTH);
        assert_eq!(frames, [F, GAP + 8]);
        assert_eq!(end, UnwindEnd::NoUnwindInfo);

        // Mapped beyond the table's last FDE, interrupted there.
        let (frames, end) = walk(regs(BIAS + 0x1f00), &stack, DEFAULT_MAX_DEPTH);
        assert_eq!(frames, [BIAS + 0x1f00]);
        assert_eq!(end, UnwindEnd::NoUnwindInfo);
    }

    #[test]
    fn code_without_rows_is_walked_by_frame_pointer_only_where_rbp_is_one() {
        // JIT code calls into a builtin without CFI (reached by a frame
        // pointer step: rbp is the chain), which was called by f (CFI).
        let rbp0 = SP + 0x20;
        let rbp1 = SP + 0x40;
        let stack = StackImage::new(0x80)
            .word(rbp0, rbp1)
            .word(rbp0 + 8, GAP + 0x10)
            .word(rbp1, 0x7777)
            .word(rbp1 + 8, F + 0x30)
            .word(rbp1 + 16 + 8, H + 8);
        let in_jit = Registers {
            rip: NO_CFI + 0x100,
            rsp: SP,
            rbp: rbp0,
        };
        let (frames, end) = walk(in_jit, &stack, DEFAULT_MAX_DEPTH);
        assert_eq!(frames, [NO_CFI + 0x100, GAP + 0x10, F + 0x30, H + 8]);
        assert_eq!(end, UnwindEnd::Outermost);

        // Interrupted in the builtin itself, rbp may be anything: the walk
        // stops rather than guess.
        let in_builtin = Registers {
            rip: GAP + 0x8,
            rsp: SP,
            rbp: rbp1,
        };
        let (frames, end) = walk(in_builtin, &stack, DEFAULT_MAX_DEPTH);
        assert_eq!(frames, [GAP + 0x8]);
        assert_eq!(end, UnwindEnd::NoUnwindInfo);

        // Reached by a CFI step, rbp is whatever the callee-saved register
        // holds: the walk stops rather than trust it.
        let stack = StackImage::new(0x80)
            .word(SP + 8, GAP + 0x10)
            .word(SP + 0x20, SP + 0x40)
            .word(SP + 0x28, F + 0x30);
        let cfi_then_gap = Registers {
            rip: F,
            rsp: SP,
            rbp: SP + 0x20,
        };
        let (frames, end) = walk(cfi_then_gap, &stack, DEFAULT_MAX_DEPTH);
        assert_eq!(frames, [F, GAP + 0x10]);
        assert_eq!(end, UnwindEnd::NoUnwindInfo);
    }

    #[test]
    fn unsupported_rule() {
        let (frames, end) = walk(regs(UNSUPPORTED), &StackImage::new(64), DEFAULT_MAX_DEPTH);
        assert_eq!(frames, [UNSUPPORTED]);
        assert_eq!(end, UnwindEnd::Unsupported(UnsupportedCfi::CfaRegister));
    }

    #[test]
    fn depth_limit() {
        // f calling itself: every 16 bytes a return address into f.
        let stack = (0..8).fold(StackImage::new(128), |stack, i| {
            stack.word(SP + 8 + 16 * i, F + 0x20)
        });
        let (frames, end) = walk(regs(F), &stack, 5);
        assert_eq!(frames, [F, F + 0x20, F + 0x20, F + 0x20, F + 0x20]);
        assert_eq!(end, UnwindEnd::DepthLimit);

        let (frames, end) = walk(regs(F), &stack, 0);
        assert_eq!(frames, [0u64; 0]);
        assert_eq!(end, UnwindEnd::DepthLimit);

        // Without a limit in the way, the copy runs out.
        let (frames, end) = walk(regs(F), &stack, DEFAULT_MAX_DEPTH);
        assert_eq!(frames.len(), 9);
        assert_eq!(end, UnwindEnd::StackTruncated);
    }

    #[test]
    fn cfa_must_increase() {
        // cfa = rsp + 0.
        let (frames, end) = walk(
            regs(CFA_EQUALS_RSP),
            &StackImage::new(64),
            DEFAULT_MAX_DEPTH,
        );
        assert_eq!(frames, [CFA_EQUALS_RSP]);
        assert_eq!(end, UnwindEnd::CfaNotIncreasing);

        // cfa = rbp + 16 with rbp far below rsp.
        let regs = Registers {
            rip: RBP_BASED,
            rsp: SP,
            rbp: SP - 0x100,
        };
        let (frames, end) = walk(regs, &StackImage::new(64), DEFAULT_MAX_DEPTH);
        assert_eq!(frames, [RBP_BASED]);
        assert_eq!(end, UnwindEnd::CfaNotIncreasing);
    }

    #[test]
    fn reads_below_the_copy() {
        // cfa = rsp + 4: the return address would be at SP - 4.
        let (frames, end) = walk(regs(SHORT_CFA), &StackImage::new(64), DEFAULT_MAX_DEPTH);
        assert_eq!(frames, [SHORT_CFA]);
        assert_eq!(end, UnwindEnd::BadStackAddress);
    }

    #[test]
    fn rbp_based_cfa() {
        let regs = Registers {
            rip: RBP_BASED,
            rsp: SP,
            rbp: SP + 32,
        };
        // cfa = rbp + 16 = SP + 48; ra at SP + 40.
        let stack = StackImage::new(64).word(SP + 40, H + 8);
        let (frames, end) = walk(regs, &stack, DEFAULT_MAX_DEPTH);
        assert_eq!(frames, [RBP_BASED, H + 8]);
        assert_eq!(end, UnwindEnd::Outermost);
    }

    #[test]
    fn plt_cfa_depends_on_the_position_in_the_entry() {
        // Bytes 0..11 of an entry: only the return address is on the stack.
        let stack = StackImage::new(32).word(SP, H + 1).word(SP + 8, H + 2);
        let (frames, _) = walk(regs(PLT + 3), &stack, DEFAULT_MAX_DEPTH);
        assert_eq!(frames, [PLT + 3, H + 1]);
        // From byte 11 on, the relocation index was pushed too.
        let (frames, _) = walk(regs(PLT + 12), &stack, DEFAULT_MAX_DEPTH);
        assert_eq!(frames, [PLT + 12, H + 2]);
    }

    #[test]
    fn signal_frame_restores_the_interrupted_registers() {
        // The trampoline's rsp points at the ucontext; the interrupted
        // frame was at G's very first byte with its own rsp and rbp.
        let interrupted_sp = SP + 0x200;
        let stack = StackImage::new(0x300)
            .word(SP + 120, 0x4444)
            .word(SP + 160, interrupted_sp)
            .word(SP + 168, G)
            // g's rule: cfa = rsp + 32, rbp at cfa - 16, ra at cfa - 8.
            .word(interrupted_sp + 16, 0x5555)
            .word(interrupted_sp + 24, H + 4);
        let (frames, end) = walk(regs(TRAMPOLINE + 1), &stack, DEFAULT_MAX_DEPTH);
        // G is looked up exactly (g's rule), not as G - 1 (f's rule, which
        // would read the return address at interrupted_sp + 8 = 0).
        assert_eq!(frames, [TRAMPOLINE + 1, G, H + 4]);
        assert_eq!(end, UnwindEnd::Outermost);

        // A sigcontext outside the copy.
        let (frames, end) = walk(regs(TRAMPOLINE), &StackImage::new(64), DEFAULT_MAX_DEPTH);
        assert_eq!(frames, [TRAMPOLINE]);
        assert_eq!(end, UnwindEnd::StackTruncated);

        // A saved rsp below the trampoline's is a loop, not a frame.
        let stack = StackImage::new(0x300)
            .word(SP + 160, SP - 0x100)
            .word(SP + 168, G);
        let (frames, end) = walk(regs(TRAMPOLINE), &stack, DEFAULT_MAX_DEPTH);
        assert_eq!(frames, [TRAMPOLINE]);
        assert_eq!(end, UnwindEnd::CfaNotIncreasing);
    }

    #[test]
    fn frame_pointer_fallback_for_modules_without_cfi() {
        // Two frames of a no-CFI module linked by rbp, then f, then h.
        let rbp0 = SP + 0x20;
        let rbp1 = SP + 0x40;
        let stack = StackImage::new(0x80)
            .word(rbp0, rbp1)
            .word(rbp0 + 8, NO_CFI + 0x200)
            .word(rbp1, 0x7777)
            .word(rbp1 + 8, F + 0x30)
            // f: cfa = rsp + 16 where rsp = rbp1 + 16.
            .word(rbp1 + 16 + 8, H + 8);
        let regs = Registers {
            rip: NO_CFI + 0x100,
            rsp: SP,
            rbp: rbp0,
        };
        let (frames, end) = walk(regs, &stack, DEFAULT_MAX_DEPTH);
        assert_eq!(frames, [NO_CFI + 0x100, NO_CFI + 0x200, F + 0x30, H + 8]);
        assert_eq!(end, UnwindEnd::Outermost);

        // A null frame pointer marks the outermost frame.
        let regs = Registers {
            rip: NO_CFI + 0x100,
            rsp: SP,
            rbp: 0,
        };
        let (frames, end) = walk(regs, &stack, DEFAULT_MAX_DEPTH);
        assert_eq!(frames, [NO_CFI + 0x100]);
        assert_eq!(end, UnwindEnd::Outermost);

        // A frame pointer below the stack pointer is not a frame.
        let regs = Registers {
            rip: NO_CFI + 0x100,
            rsp: SP,
            rbp: SP - 0x40,
        };
        let (frames, end) = walk(regs, &stack, DEFAULT_MAX_DEPTH);
        assert_eq!(frames, [NO_CFI + 0x100]);
        assert_eq!(end, UnwindEnd::CfaNotIncreasing);

        // Nor is a misaligned one.
        let regs = Registers {
            rip: NO_CFI + 0x100,
            rsp: SP,
            rbp: rbp0 + 3,
        };
        let (frames, end) = walk(regs, &stack, DEFAULT_MAX_DEPTH);
        assert_eq!(frames, [NO_CFI + 0x100]);
        assert_eq!(end, UnwindEnd::BadStackAddress);
    }

    #[test]
    fn a_frame_pointer_that_leads_out_of_code_adds_no_frame() {
        // rbp holds data, not a frame pointer: the word above it is no
        // return address, and must not show up as a frame.
        let rbp = SP + 0x20;
        let stack = StackImage::new(0x80)
            .word(rbp, SP + 0x40)
            .word(rbp + 8, 0x1234_5678);
        let in_jit = Registers {
            rip: NO_CFI + 0x100,
            rsp: SP,
            rbp,
        };
        let (frames, end) = walk(in_jit, &stack, DEFAULT_MAX_DEPTH);
        assert_eq!(frames, [NO_CFI + 0x100]);
        assert_eq!(end, UnwindEnd::Unmapped);

        // A CFI step that reads an unmapped return address keeps it: the
        // CFI says that slot holds the return address, so it is a frame of
        // code the caller may not know yet (it resolves and walks again).
        let stack = StackImage::new(64).word(SP + 8, 0x1234_5678);
        let (frames, end) = walk(regs(F + 0x10), &stack, DEFAULT_MAX_DEPTH);
        assert_eq!(frames, [F + 0x10, 0x1234_5678]);
        assert_eq!(end, UnwindEnd::Unmapped);
    }

    #[test]
    fn address_arithmetic_never_overflows() {
        let regs = Registers {
            rip: RBP_BASED,
            rsp: SP,
            rbp: u64::MAX - 4,
        };
        let (_, end) = walk(regs, &StackImage::new(64), DEFAULT_MAX_DEPTH);
        assert_eq!(end, UnwindEnd::BadStackAddress);
        let regs = Registers {
            rip: NO_CFI,
            rsp: u64::MAX - 8,
            rbp: u64::MAX - 8,
        };
        let (_, end) = walk(regs, &StackImage::new(64), DEFAULT_MAX_DEPTH);
        assert_eq!(end, UnwindEnd::BadStackAddress);
    }

    #[test]
    fn walks_reuse_the_callers_vec() {
        let table = table();
        let modules = modules(&table);
        let stack = StackImage::new(64)
            .word(SP + 8, G + 0x50)
            .word(SP + 40, H + 0x10);
        let mut frames = Vec::new();
        assert_eq!(
            unwind(regs(F), &stack.0, &modules, DEFAULT_MAX_DEPTH, &mut frames),
            UnwindEnd::Outermost
        );
        let capacity = frames.capacity();
        let pointer = frames.as_ptr();
        for _ in 0..3 {
            unwind(regs(F), &stack.0, &modules, DEFAULT_MAX_DEPTH, &mut frames);
            assert_eq!(frames.len(), 3);
        }
        assert_eq!((frames.capacity(), frames.as_ptr()), (capacity, pointer));
    }

    /// JIT code a runtime describes: compiled code with 48-byte frames, an
    /// interpreter, and a stub entered by a call (the call stub); `moved`
    /// makes the compiled code's frames 64 bytes (the runtime put other
    /// code there).
    #[derive(Debug, Default)]
    struct FakeRuntime {
        moved: Cell<bool>,
    }

    const JIT: u64 = 0x6000_0000;
    const COMPILED: u64 = JIT + 0x100;
    const INTERPRETER: u64 = JIT + 0x1000;
    const CALL_STUB: u64 = JIT + 0x3000;

    impl RuntimeCode for FakeRuntime {
        fn step_at(&self, pc: u64, interrupted: bool) -> Option<RuntimeStep> {
            let cfa_off = if self.moved.get() { 64 } else { 48 };
            match pc {
                pc if (COMPILED..COMPILED + 0x100).contains(&pc) => {
                    Some(RuntimeStep::Rule(RspRbpSaved {
                        cfa_off,
                        rbp_off: -16,
                    }))
                }
                pc if (INTERPRETER..INTERPRETER + 0x100).contains(&pc) => {
                    Some(RuntimeStep::JavaInterpreter)
                }
                pc if (CALL_STUB..CALL_STUB + 0x100).contains(&pc) && !interrupted => {
                    Some(RuntimeStep::FramePointer)
                }
                _ => None,
            }
        }
    }

    /// The fake process with the runtime's JIT code, keeping the
    /// interpreter frames the walk reports.
    struct WithRuntime<'a> {
        modules: Modules<'a>,
        runtime: &'a FakeRuntime,
        interpreted: std::cell::RefCell<Vec<(usize, u64)>>,
    }

    impl<'a> WithRuntime<'a> {
        fn new(table: &'a UnwindTable, runtime: &'a FakeRuntime) -> Self {
            Self {
                modules: modules(table),
                runtime,
                interpreted: Default::default(),
            }
        }
    }

    impl ModuleLookup for WithRuntime<'_> {
        fn module_for(&self, pc: u64) -> ModuleAt<'_> {
            if (JIT..JIT + 0x10000).contains(&pc) {
                return ModuleAt::Runtime(self.runtime);
            }
            self.modules.module_for(pc)
        }

        fn interpreted_frame(&self, frame: usize, method: u64) {
            self.interpreted.borrow_mut().push((frame, method));
        }
    }

    /// Compiled code called by the interpreter, called through an adapter
    /// (its sender sp 0x30 above its frame) by compiled code, called by the
    /// call stub, called by `h` (outermost).
    fn java_stack(interpreter_sender_sp: u64) -> StackImage {
        let interpreter_rbp = SP + 0x100;
        let stub_rbp = SP + 0x300;
        StackImage::new(0x400)
            // Compiled, 48 bytes: caller's rbp and the return address.
            .word(SP + 32, interpreter_rbp)
            .word(SP + 40, INTERPRETER + 0x20)
            // The interpreter frame.
            .word(interpreter_rbp - 24, 0xa11_3e7d)
            .word(interpreter_rbp - 8, interpreter_sender_sp)
            .word(interpreter_rbp, 0x2222)
            .word(interpreter_rbp + 8, COMPILED + 0x50)
            // Compiled, 48 bytes from the sender sp.
            .word(SP + 0x140 + 32, stub_rbp)
            .word(SP + 0x140 + 40, CALL_STUB + 8)
            // The call stub's frame record.
            .word(stub_rbp, 0)
            .word(stub_rbp + 8, H)
    }

    #[test]
    fn java_frames_step_by_what_their_runtime_says() {
        let (table, runtime) = (table(), FakeRuntime::default());
        let lookup = WithRuntime::new(&table, &runtime);
        let stack = java_stack(SP + 0x140);
        let mut frames = Vec::new();
        let end = unwind(regs(COMPILED + 0x10), &stack.0, &lookup, 64, &mut frames);
        assert_eq!(end, UnwindEnd::Outermost);
        assert_eq!(
            frames,
            [
                COMPILED + 0x10,
                INTERPRETER + 0x20,
                COMPILED + 0x50,
                CALL_STUB + 8,
                H
            ]
        );
        assert_eq!(*lookup.interpreted.borrow(), [(1, 0xa11_3e7d)]);

        // The compiled caller's frame is where the sender sp says: with it
        // 0x30 lower (no adapter between), its return address slot there
        // holds nothing.
        let low = java_stack(SP + 0x110).word(SP + 0x110 + 40, 0);
        let end = unwind(regs(COMPILED + 0x10), &low.0, &lookup, 64, &mut frames);
        assert_eq!((end, frames.len()), (UnwindEnd::Outermost, 3));

        // A sender sp below the frame's own end is not one.
        let bad = java_stack(SP + 0x108);
        let end = unwind(regs(COMPILED + 0x10), &bad.0, &lookup, 64, &mut frames);
        assert_eq!((end, frames.len()), (UnwindEnd::BadStackAddress, 2));

        // Interrupted in the call stub: the runtime cannot say, the walk ends.
        let end = unwind(regs(CALL_STUB + 4), &stack.0, &lookup, 64, &mut frames);
        assert_eq!(
            (end, frames.as_slice()),
            (UnwindEnd::NoUnwindInfo, &[CALL_STUB + 4][..])
        );
    }

    #[test]
    fn runtime_steps_are_never_cached() {
        let (table, runtime) = (table(), FakeRuntime::default());
        let lookup = WithRuntime::new(&table, &runtime);
        let mut cache = RuleCache::default();
        let mut frames = Vec::new();
        let stack = java_stack(SP + 0x140);
        let end = unwind_cached(
            regs(COMPILED + 0x10),
            &stack.0,
            &lookup,
            &mut cache,
            1,
            64,
            &mut frames,
        );
        assert_eq!((end, frames.len()), (UnwindEnd::Outermost, 5));
        // The runtime replaced the code: 64-byte frames, return address at
        // 56 (a cached 48-byte step would find the interpreter at 40).
        runtime.moved.set(true);
        let moved = StackImage::new(0x400)
            .word(SP + 56, 0)
            .word(SP + 40, INTERPRETER + 0x20);
        let end = unwind_cached(
            regs(COMPILED + 0x10),
            &moved.0,
            &lookup,
            &mut cache,
            1,
            64,
            &mut frames,
        );
        assert_eq!(
            (end, frames.as_slice()),
            (UnwindEnd::Outermost, &[COMPILED + 0x10][..])
        );
    }
}
