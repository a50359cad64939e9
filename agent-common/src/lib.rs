//! Types shared by the BPF sampler (`agent-ebpf`) and the userspace agent.
//!
//! This crate owns the byte layout of everything that crosses the kernel/user
//! boundary: the sample record written to the ring buffer, the per-CPU counter
//! indices, and the limits both sides must agree on. It owns no logic: the BPF
//! side fills these types, `stackscope_sampler::record` decodes them.
//!
//! Every type is `#[repr(C)]` with its padding written out, and a `const`
//! assertion pins its size, so a field added on one side cannot silently shift
//! the layout the other side reads.
#![no_std]

#[cfg(feature = "alloc")]
extern crate alloc;

/// Kinds of records in the sample ring buffer. The first `u32` of every record.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordKind {
    /// A [`SampleHeader`] followed by the kernel stack, the user stack bytes,
    /// then the stack tail (packed [`tail_span`]s each followed by its bytes).
    Sample = 1,
    /// A [`ProcessEvent`]: the process replaced its image (`execve`); what was
    /// known of its mappings is stale.
    Exec = 2,
    /// A [`ProcessEvent`]: the process's main thread exited; its tgid may be
    /// reused by an unrelated process.
    Exit = 3,
    /// A [`PythonStackHeader`] followed by its [`PythonFrame`]s: the CPython
    /// frames of the thread whose sample record comes next from the same
    /// CPU (written just before it, in the same run of the program).
    PythonStack = 4,
    /// A [`SwitchIn`]: a thread whose off-CPU sample (see
    /// [`sample_flags::OFF_CPU`]) was written came back onto a CPU.
    SwitchIn = 5,
    /// A [`Doorbell`]: wakes the reader for a CPU's [`SampleArea`]. The
    /// reader of the rings drops it; nothing else sees it.
    Doorbell = 6,
}

/// Bit flags in [`SampleHeader::flags`].
pub mod sample_flags {
    /// The tick interrupted user mode: `user_rip/rsp/rbp` are the exact
    /// interrupted registers. When clear, they come from the task's saved user
    /// registers (the thread was in a syscall, fault or interrupt).
    pub const TICK_IN_USER: u32 = 1 << 0;
    /// `user_rip`, `user_rsp` and `user_rbp` are valid. Clear for kernel
    /// threads and for the idle task, which have no user context.
    pub const USER_REGS: u32 = 1 << 1;
    /// The stack copy stopped before the configured limit because a read
    /// faulted: the end of the stack mapping (or an unmapped page) was reached.
    /// Without it, a copy shorter than the limit cannot happen.
    pub const USER_STACK_FAULTED: u32 = 1 << 2;
    /// `bpf_get_stack` failed for a tick in kernel mode.
    pub const KERNEL_STACK_FAILED: u32 = 1 << 3;
    /// The thread's plan asked for its whole stack ([`super::StackPlan::stack_end`]),
    /// or it is a deep program's thread without a plan or a stack top: the
    /// user stack is one read from `rsp` up to the end of the thread's stack
    /// (or its thread pointer, or [`super::MAX_DEEP_STACK_BYTES`]), there is
    /// no tail, and the
    /// record is a fixed-size reservation: bytes after the announced
    /// lengths are padding.
    pub const DEEP_COPY: u32 = 1 << 4;
    /// The copy stopped at the thread's [`super::StackTop`]: where its
    /// walks reached the root before. A walk of such a copy that runs out of
    /// stack means that top is stale (the agent drops it).
    pub const COPY_AT_TOP: u32 = 1 << 5;
    /// The stacks were read straight into the record: in its CPU's
    /// [`super::SampleArea`] (exactly their bytes), or else in a ring
    /// buffer reservation of one of the [`super::DIRECT_COPY_CLASSES`]
    /// (see [`super::reserved_record_bytes`]), where bytes after the
    /// announced lengths are padding. Only ticks of a thread with a stack
    /// top and no plan, so there is no tail.
    pub const DIRECT_COPY: u32 = 1 << 6;
    /// An off-CPU sample: written at `sched_switch` as the thread blocked
    /// (it left the CPU without being runnable), not at a tick. `ktime_ns`
    /// is when it left; the [`super::SwitchIn`] record with its `tid` and
    /// that time says when it came back, and so how long the stack waited.
    /// The registers are the ones it saved on entering the kernel.
    pub const OFF_CPU: u32 = 1 << 7;
    /// A deep copy read page by page because its one read faulted: pages
    /// it could not read (never touched: a large local array's untouched
    /// part) hold zeros. A page that held a return address or a saved
    /// register was written, so it was read; the walker treats an all-zero
    /// page of such a copy as unread.
    pub const COPY_HOLES: u32 = 1 << 8;
}

/// User stack bytes a direct record (see [`sample_flags::DIRECT_COPY`]) has
/// room for, smallest first, in steps of 1.5x and 1.33x: a copy takes the
/// smallest class that holds it, so a copy of more than 1 KiB pads its
/// class by at most a third (a kernel-mode tick's record also keeps room
/// for the longest kernel stack).
pub const DIRECT_COPY_CLASSES: [u32; 11] = [
    1024,
    1536,
    2048,
    3072,
    4096,
    6144,
    8192,
    12288,
    16384,
    24576,
    MAX_USER_STACK_BYTES,
];

/// Ring buffer bytes a deep or direct record reserves for a class of
/// `user_class` stack bytes: the header, room for the kernel stack as the
/// program bounds it when `kernel_room` (always for a deep record, for a
/// direct one when the tick hit kernel mode), the class.
pub const fn reserved_record_bytes(user_class: u32, kernel_room: bool) -> u32 {
    let kernel_room = if kernel_room {
        KERNEL_STACK_MASK as u32 + 1
    } else {
        0
    };
    SAMPLE_HEADER_SIZE as u32 + kernel_room + user_class
}

/// Length of `comm` as the kernel keeps it (`TASK_COMM_LEN`).
pub const COMM_LEN: usize = 16;

/// A `comm` as text: up to its first NUL (the kernel pads with NULs and
/// leaves whatever followed a shorter name after it), lossily as UTF-8.
#[cfg(feature = "alloc")]
pub fn comm_str(comm: &[u8]) -> alloc::string::String {
    let end = comm.iter().position(|&b| b == 0).unwrap_or(comm.len());
    alloc::string::String::from_utf8_lossy(&comm[..end]).into_owned()
}

/// Most kernel frames recorded per sample: the default of
/// `kernel.perf_event_max_stack`, the kernel's own cap for `bpf_get_stack`.
pub const MAX_KERNEL_FRAMES: usize = 127;
/// Bytes reserved for the kernel stack in a record.
pub const MAX_KERNEL_STACK_BYTES: usize = MAX_KERNEL_FRAMES * 8;

/// Default ceiling of the user stack bytes copied per sample: the most.
/// Copies follow what each process's walks need, so a shallow program
/// copies far less; a compiler's stacks are often 16-32 KiB deep and, in a
/// process that lives half a second, gone before a tail can be learned
/// (rustc runs: 72% of samples reach the root at 32 KiB, 50% at 16 KiB).
pub const DEFAULT_USER_STACK_BYTES: u32 = 32 * 1024;
/// Upper bound for the contiguous user stack copy (the ceiling of the
/// adaptive copy). Deeper stacks reach their root through the stack tail.
pub const MAX_USER_STACK_BYTES: u32 = 32 * 1024;

/// Most bytes of a deep copy: one read of a thread's whole stack, for
/// threads whose deep frames change too fast (or are too many) for a stack
/// tail, such as compilers. A deep record is reserved in the ring buffer at
/// its class's size and read into directly (no scratch slot, no second copy).
pub const MAX_DEEP_STACK_BYTES: u32 = 2 << 20;
/// User stack bytes a deep record has room for, smallest first, doubling:
/// a deep copy takes the smallest class that holds it (see
/// [`reserved_record_bytes`]), so at most half of its ring space is padding.
pub const DEEP_COPY_CLASSES: [u32; 8] = [
    16 << 10,
    32 << 10,
    64 << 10,
    128 << 10,
    256 << 10,
    512 << 10,
    1 << 20,
    MAX_DEEP_STACK_BYTES,
];

/// Smallest adaptive copy the agent asks for: a leaf's frame and its
/// caller's, even when the thread's walks have needed less.
pub const MIN_USER_STACK_BYTES: u32 = 512;

/// Most spans in a thread's [`StackPlan`]: one per deep frame whose return
/// address (and saved rbp) the walk needs beyond the contiguous copy.
pub const MAX_TAIL_SPANS: usize = 512;
/// Longest span: slots closer than this are read as one span rather than
/// two (a helper call costs about as much as copying a few hundred bytes).
pub const MAX_SPAN_BYTES: u32 = 256;
/// Most bytes of tail (span headers plus data) in one record.
pub const MAX_TAIL_BYTES: u32 = 16 * 1024;

/// The copy reads page by page so that it stops at the first page that is not
/// mapped (the end of the stack mapping) instead of failing as a whole.
pub const PAGE_SIZE: u32 = 4096;

/// Size of one per-CPU scratch slot in which the BPF program assembles a
/// record before handing it to the ring buffer in one variable-length write.
/// One page more than the largest record: the page-sized read that ends the
/// copy must fit even when the verifier cannot prove it is shorter.
///
/// The stack tail goes after the copy at an offset the program bounds with
/// [`KERNEL_STACK_MASK`] and [`USER_STACK_MASK`] (the verifier cannot follow
/// the copy loop's arithmetic), so the slot has room for the masks' reach.
pub const SCRATCH_BYTES: usize = SAMPLE_HEADER_SIZE
    + KERNEL_STACK_MASK as usize
    + 1
    + USER_STACK_MASK as usize
    + 1
    + MAX_TAIL_BYTES as usize
    + TAIL_SPAN_HEADER_SIZE
    + MAX_SPAN_BYTES as usize;

/// A power of two minus one at or above [`MAX_KERNEL_STACK_BYTES`].
pub const KERNEL_STACK_MASK: u64 = 1023;
/// A power of two minus one at or above the largest copy (which may end a
/// page past [`MAX_USER_STACK_BYTES`] in the verifier's view).
pub const USER_STACK_MASK: u64 = 2 * MAX_USER_STACK_BYTES as u64 - 1;
const _: () = assert!(MAX_KERNEL_STACK_BYTES as u64 <= KERNEL_STACK_MASK);
const _: () = assert!((MAX_USER_STACK_BYTES + PAGE_SIZE) as u64 <= USER_STACK_MASK);

/// The fixed part of a sample record. The record continues with
/// `kernel_stack_len` bytes of kernel return addresses (`u64`, innermost
/// first), then `user_stack_len` bytes copied from `user_rsp` upwards, then
/// `tail_len` bytes of stack tail: words further up the stack, read at the
/// same instant, that the thread's [`StackPlan`] asked for.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SampleHeader {
    /// [`RecordKind::Sample`].
    pub kind: u32,
    /// Bit set of [`sample_flags`].
    pub flags: u32,
    /// Process id (thread group id).
    pub tgid: u32,
    /// Thread id.
    pub tid: u32,
    /// CPU the tick fired on.
    pub cpu: u32,
    /// Bytes of kernel stack that follow the header, a multiple of 8.
    pub kernel_stack_len: u32,
    /// Bytes of user stack that follow the kernel stack.
    pub user_stack_len: u32,
    /// How many ticks this sample stands for: the 1-in-N budget of the
    /// task's cgroup ([`CgroupPolicy::divisor`]), 1 when none applies.
    /// Also keeps the `u64` fields 8-aligned.
    pub sampling_divisor: u32,
    /// `bpf_ktime_get_ns()`: CLOCK_MONOTONIC nanoseconds.
    pub ktime_ns: u64,
    /// cgroup v2 id of the task (`bpf_get_current_cgroup_id`).
    pub cgroup_id: u64,
    /// User instruction pointer (see [`sample_flags::USER_REGS`]).
    pub user_rip: u64,
    /// User stack pointer: the address of the first copied byte.
    pub user_rsp: u64,
    /// User frame pointer, used when a module has no CFI.
    pub user_rbp: u64,
    /// Thread name, NUL padded.
    pub comm: [u8; COMM_LEN],
    /// Bytes of stack tail after the user stack: spans, each a packed
    /// [`tail_span`] and its bytes.
    pub tail_len: u32,
    /// Spans in the tail.
    pub tail_spans: u32,
    /// When the process (its thread group leader) started, in kernel
    /// monotonic nanoseconds: with `tgid`, the process's identity, so state
    /// kept for an exited process is never used for one that reuses its
    /// pid. 0 when the kernel's layout is unknown.
    pub process_start_ns: u64,
}

/// Size of [`SampleHeader`] in bytes.
pub const SAMPLE_HEADER_SIZE: usize = 104;
const _: () = assert!(core::mem::size_of::<SampleHeader>() == SAMPLE_HEADER_SIZE);
const _: () = assert!(SAMPLE_HEADER_SIZE.is_multiple_of(8));

/// Stack tail spans, each one `u64`: in a [`StackPlan`] what to read, in a
/// sample record the header before the bytes read. User addresses on
/// x86_64 fit in 48 bits; the length (in words) and a fault flag go above.
pub mod tail_span {
    use super::MAX_SPAN_BYTES;

    const ADDR_MASK: u64 = (1 << 48) - 1;
    const WORDS_SHIFT: u32 = 48;
    const WORDS_MASK: u64 = 0x7fff;
    /// In a record: the read faulted (the address is no longer mapped);
    /// the bytes that follow are zeros, not stack.
    pub const FAULTED: u64 = 1 << 63;

    /// `len` bytes (a multiple of 8, at most [`MAX_SPAN_BYTES`]) at `addr`
    /// (below 2^48); `None` for anything else.
    pub const fn pack(addr: u64, len: u32) -> Option<u64> {
        if addr > ADDR_MASK || len == 0 || len > MAX_SPAN_BYTES || !len.is_multiple_of(8) {
            return None;
        }
        Some(addr | ((len as u64 / 8) << WORDS_SHIFT))
    }

    pub const fn addr(span: u64) -> u64 {
        span & ADDR_MASK
    }

    /// The length in bytes (not checked against the limit).
    pub const fn len(span: u64) -> u32 {
        (((span >> WORDS_SHIFT) & WORDS_MASK) * 8) as u32
    }
}

/// Size of a span's header in a sample record (one packed [`tail_span`]).
pub const TAIL_SPAN_HEADER_SIZE: usize = 8;

/// How much of one thread's stack to read per tick: the value of the
/// `STACK_PLANS` map, keyed by thread id, written by the agent from what the
/// thread's earlier walks needed.
///
/// The copy covers the frames that change from tick to tick; the spans are
/// the return-address (and saved-rbp) slots of the deep frames below them,
/// read word for word instead of copied with everything around them. Every
/// byte in the record is read at the tick, so a walk through the spans is
/// as right as one through a full copy: a span whose frame has gone only
/// makes the walk stop short (its slot no longer lies where the walk looks).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StackPlan {
    /// The plan applies only while the thread belongs to this process (a
    /// reused thread id in another process gets the defaults).
    pub tgid: u32,
    /// Bytes of contiguous copy from `rsp`, at most the configured ceiling.
    pub copy_bytes: u32,
    /// Spans in use, at most [`MAX_TAIL_SPANS`], in ascending address order.
    pub span_count: u32,
    pub _padding: u32,
    /// When not 0, a deep copy instead of copy and spans: the end of the
    /// thread's stack mapping, so a tick reads from `rsp` up to it (at most
    /// the configured deep size) in one read that stays inside the mapping.
    /// `copy_bytes` is then the copy of a tick the deep read fails for.
    pub stack_end: u64,
    /// Packed spans ([`tail_span::pack`]).
    pub spans: [u64; MAX_TAIL_SPANS],
}

const _: () = assert!(core::mem::size_of::<StackPlan>() == 24 + 8 * MAX_TAIL_SPANS);

impl StackPlan {
    /// A plan with no spans.
    pub const fn copy_only(tgid: u32, copy_bytes: u32) -> Self {
        Self {
            tgid,
            copy_bytes,
            span_count: 0,
            _padding: 0,
            stack_end: 0,
            spans: [0; MAX_TAIL_SPANS],
        }
    }

    /// A deep copy from `rsp` to `stack_end`, or `copy_bytes` when that
    /// read fails.
    pub const fn deep(tgid: u32, copy_bytes: u32, stack_end: u64) -> Self {
        let mut plan = Self::copy_only(tgid, copy_bytes);
        plan.stack_end = stack_end;
        plan
    }
}

// SAFETY: `repr(C)`, integers only, padding written out: every byte pattern
// is a value.
#[cfg(feature = "user")]
unsafe impl aya::Pod for StackPlan {}

/// Threads with a [`StackPlan`] at most (an LRU map: the least recently
/// sampled thread's plan goes first).
pub const MAX_STACK_PLANS: u32 = 1024;

/// Processes with an adaptive copy size (`COPY_BYTES`, LRU).
pub const MAX_COPY_SIZES: u32 = 16384;

/// Where a thread's walks last reached the root, written by the agent for
/// each thread it learned (see [`StackTopSet`] for how the program finds
/// it). The sampler copies no further than `top`, so a copy sized for the
/// thread's deepest tick does not run past the end of the stack mapping on
/// its shallow ones: a read that faults there costs more than the copy
/// itself (a page fault and its exception fixup, about 0.7 us here).
///
/// It is also looked up first, and spares a learned thread two lookups: a
/// thread with a top has no plan (the agent removes the top when it writes
/// a plan), and its top says whether its process's CPython frames are read
/// ([`stack_top_flags::PYTHON`]). A thread of a process that is not
/// CPython's makes one lookup where it made three (the plan's and the
/// process's were misses): 0.2-0.4 us less per tick at 19 Hz here, where a
/// tick meets cold memory (about 11 us). A planned thread makes one more
/// (its top's, a miss).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StackTop {
    /// The thread's process: an entry left over from a thread whose id was
    /// reused by another process is not used.
    pub tgid: u32,
    /// [`stack_top_flags`].
    pub flags: u32,
    /// First stack address the thread's walks did not need.
    pub top: u64,
}

/// [`StackTop::flags`].
pub mod stack_top_flags {
    /// The process is in `PYTHON_PROCESSES`: its ticks read its CPython
    /// frames. Without it the program does not look the process up. The
    /// agent sets it as it writes the top; when it describes a process, it
    /// removes the tops it knows of the process's threads, and one it
    /// forgot is written again (flagged) by the thread's next walk to the
    /// root.
    pub const PYTHON: u32 = 1 << 0;
}

// SAFETY: `repr(C)`, integers only, padding written out: every byte pattern
// is a value.
#[cfg(feature = "user")]
unsafe impl aya::Pod for StackTop {}

const _: () = assert!(core::mem::size_of::<StackTop>() == 16);

/// Threads whose [`StackTop`] the agent's planner keeps in mind at most.
/// The table has twice as many entries, in sets of four (see
/// [`StackTopSet`]): a set can still fill, and then gives a way up, whose
/// thread's next walk to the root writes its top again.
pub const MAX_STACK_TOPS: u32 = 16384;

/// Sets of the `STACK_TOPS` table: `1 << STACK_TOP_SET_BITS`.
pub const STACK_TOP_SET_BITS: u32 = 13;
pub const STACK_TOP_SETS: u32 = 1 << STACK_TOP_SET_BITS;
/// Entries per set: one cache line of [`StackTopEntry`]s.
pub const STACK_TOP_WAYS: usize = 4;

/// One set of the `STACK_TOPS` table, an array of [`STACK_TOP_SETS`] sets
/// the agent writes in place (it maps the array) and the program reads.
/// A thread's top is in the set [`stack_top_set`] names, in any of its
/// ways, or nowhere.
///
/// Why not a hash map keyed by thread id: a lookup there reads the map,
/// its bucket and the element, each cold on a tick at fleet rates. A set
/// is one cache line at an address the program computes (the array is
/// mapped, so its values start page-aligned and no set straddles two
/// lines), and the agent writes it without a system call. On `xz -9` at
/// 99 Hz, with timing marks, the lookup took 1.7-2.3 us of an 11-12 us
/// tick as a hash map's, 0.74-0.77 us as a set's.
///
/// How a reader does not take one thread's top for another's: the agent
/// empties an entry (`tid` 0), writes the top, then the process, and `tid`
/// last; the program reads `tid`, the process, the top, then `tid` again,
/// and uses the entry only if `tid` did not change and the process is the
/// thread's (x86-64 keeps stores, and loads, in program order). An entry
/// rewritten in place for the same thread id, reused by another process,
/// is read with the old process (not used) or with the new top.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackTopSet {
    pub entries: [StackTopEntry; STACK_TOP_WAYS],
}

const _: () = assert!(core::mem::size_of::<StackTopSet>() == 64);

// SAFETY: `repr(C)`, integers only, no padding: every byte pattern is a
// value.
#[cfg(feature = "user")]
unsafe impl aya::Pod for StackTopSet {}

/// A [`StackTop`] in the table: the thread's id, its process, and its top
/// with the flags in the low bits (a top is written rounded up to 8 bytes,
/// which keeps it within the stack mapping, whose end is page-aligned).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackTopEntry {
    /// 0: empty (no thread the program samples has id 0).
    pub tid: u32,
    pub tgid: u32,
    pub top_and_flags: u64,
}

/// The bits of [`StackTopEntry::top_and_flags`] that hold the flags.
pub const STACK_TOP_FLAG_BITS: u64 = 0b111;
const _: () = assert!(stack_top_flags::PYTHON as u64 & !STACK_TOP_FLAG_BITS == 0);

impl StackTopEntry {
    /// The entry for `tid`'s `top`.
    pub const fn new(tid: u32, top: StackTop) -> Self {
        Self {
            tid,
            tgid: top.tgid,
            top_and_flags: (top.top.saturating_add(7) & !STACK_TOP_FLAG_BITS)
                | (top.flags as u64 & STACK_TOP_FLAG_BITS),
        }
    }

    /// The top it holds (rounded up to 8 bytes).
    pub const fn top(&self) -> StackTop {
        StackTop {
            tgid: self.tgid,
            flags: (self.top_and_flags & STACK_TOP_FLAG_BITS) as u32,
            top: self.top_and_flags & !STACK_TOP_FLAG_BITS,
        }
    }
}

/// The set of the `STACK_TOPS` table that holds thread `tid`'s top:
/// Fibonacci hashing, so threads whose ids differ by a power of two (a
/// pool started in a burst) spread over the sets.
pub const fn stack_top_set(tid: u32) -> u32 {
    tid.wrapping_mul(0x9E37_79B9) >> (32 - STACK_TOP_SET_BITS)
}

/// Thread names (`comm`) of programs whose threads needed deep copies (or
/// twice exited before the agent could learn them): the keys of the
/// `DEEP_PROGRAMS` map (LRU), written by the agent. A tick of
/// such a program's thread that has neither a plan nor a stack top (a
/// thread the agent has not learned yet, as every thread of a compiler
/// run once per file is) and that could not be copied deep to its stack's
/// end wakes the reader at once, so the thread is learned within
/// milliseconds instead of at the next timed drain.
pub const MAX_DEEP_PROGRAMS: u32 = 256;

/// A CPU wakes the reader early (see [`MAX_DEEP_PROGRAMS`]) at most once per
/// this long: a thread that cannot be learned must not cost a wake-up per
/// tick.
pub const EARLY_WAKEUP_INTERVAL_NS: u64 = 5_000_000;

/// Processes (by tgid) that woke the reader for their first unlearned tick
/// while its drains were paced (the keys of the `NEW_PROCESS_WAKEUPS` map,
/// LRU, written by the program; an exec removes its process). While few
/// records come (a quiet host, or a small one at 19 Hz) the agent drains
/// up to 5 s apart instead of 500 ms; a process met only at
/// the next drain would lose what the agent learns from it at once (a
/// Python process's first seconds of Python frames, a short one's maps).
/// One wake-up per new process, not per tick: a thread the agent cannot
/// learn keeps being unlearned.
pub const MAX_NEW_PROCESS_WAKEUPS: u32 = 4096;

/// An exec or exit of a process, in the same ring buffer as the samples so
/// that it is read in order with them: samples taken after an exec are never
/// unwound with the mappings from before it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessEvent {
    /// [`RecordKind::Exec`] or [`RecordKind::Exit`].
    pub kind: u32,
    pub tgid: u32,
    /// `bpf_ktime_get_ns()` at the event.
    pub ktime_ns: u64,
}

/// Size of [`ProcessEvent`] in bytes.
pub const PROCESS_EVENT_SIZE: usize = 16;
const _: () = assert!(core::mem::size_of::<ProcessEvent>() == PROCESS_EVENT_SIZE);

/// A thread whose off-CPU sample was written is back on a CPU: the record
/// that ends its blocked time. Written at the `sched_switch` that runs it
/// again, from the `OFF_CPU_PENDING` entry its switch-out left.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SwitchIn {
    /// [`RecordKind::SwitchIn`].
    pub kind: u32,
    pub tid: u32,
    pub tgid: u32,
    /// Keeps the `u64` fields 8-aligned.
    pub _pad: u32,
    /// When it left the CPU: its off-CPU sample's `ktime_ns`.
    pub out_ns: u64,
    /// When it was switched back in (`bpf_ktime_get_ns()`).
    pub in_ns: u64,
}

impl SwitchIn {
    pub const fn new(tid: u32, tgid: u32, out_ns: u64, in_ns: u64) -> Self {
        Self {
            kind: RecordKind::SwitchIn as u32,
            tid,
            tgid,
            _pad: 0,
            out_ns,
            in_ns,
        }
    }
}

/// Size of [`SwitchIn`] in bytes.
pub const SWITCH_IN_SIZE: usize = 32;

/// Data bytes of a CPU's [`SampleArea`]: a power of two, so that a
/// position masks to an offset.
pub const SAMPLE_AREA_BYTES: usize = 1 << 20;
/// Bytes after the data that a record starting near its end runs on
/// into: at least the largest direct record (see [`area_record_bytes`]).
/// Sized so that an area is a whole number of pages.
pub const SAMPLE_AREA_SLACK: usize = (64 << 10) - 128;
const _: () = assert!(SAMPLE_AREA_BYTES.is_power_of_two());
const _: () = assert!(
    SAMPLE_AREA_SLACK as u64
        >= area_record_bytes(reserved_record_bytes(MAX_USER_STACK_BYTES, true) as u64)
);
/// Unread bytes of an area past which the program rings the reader's
/// [`Doorbell`]: half, the bytes of a 2 MiB ring's mark (a quarter), so
/// the reader is woken no more often than when the rings took these
/// records (few large drains cost it less per sample). An area has one
/// writer, which always sees its own crossing: the rings' second mark,
/// at twice the first, is not needed here.
pub const SAMPLE_AREA_WAKEUP_BYTES: u64 = SAMPLE_AREA_BYTES as u64 / 2;

/// A CPU's sample area: where the program writes that CPU's direct
/// records (see [`sample_flags::DIRECT_COPY`]) without a ring buffer's
/// lock, helpers or record header. The agent maps the array of areas
/// (one per CPU, `BPF_F_MMAPABLE`) and reads them as it reads the rings.
///
/// Positions count bytes since the area was made; a position's offset in
/// `data` is it modulo [`SAMPLE_AREA_BYTES`]. A record is a `u64` length
/// (of the record proper: header and stacks) followed by the record, the
/// whole [`area_record_bytes`] long, written at its start's offset even
/// when it runs past the data's end into the slack: the reader reads it
/// there. The program writes a record only if `producer - consumer` plus
/// its most bytes stays within [`SAMPLE_AREA_BYTES`], so it never writes
/// over an unread record, slack included; otherwise it takes the ring.
///
/// One writer per area: the program on its CPU (which does not nest
/// there), storing `producer` after the record. BPF has no store-release
/// on every kernel the agent supports (Linux 6.1 has none); x86-64, the
/// only architecture the program is built for, keeps stores in order.
/// One reader: the agent, storing `consumer` after reading.
#[repr(C)]
pub struct SampleArea {
    /// Bytes written; only the program stores it.
    pub producer: u64,
    /// Keeps the two positions on cache lines of their own.
    pub _producer_line: [u64; 7],
    /// Bytes read; only the reader stores it.
    pub consumer: u64,
    pub _consumer_line: [u64; 7],
    pub data: [u8; SAMPLE_AREA_BYTES + SAMPLE_AREA_SLACK],
}
const _: () = assert!(core::mem::size_of::<SampleArea>().is_multiple_of(4096));
const _: () = assert!(core::mem::offset_of!(SampleArea, consumer) == 64);
const _: () = assert!(core::mem::offset_of!(SampleArea, data) == 128);

/// Whether a record of at most `most` bytes (see [`area_record_bytes`])
/// may be written at position `producer` of an area read up to `consumer`:
/// it must not reach unread bytes. A consumer past the producer, which
/// only a bad write makes, reads as full.
pub const fn area_has_room(producer: u64, consumer: u64, most: u64) -> bool {
    let unread = producer.wrapping_sub(consumer);
    unread <= SAMPLE_AREA_BYTES as u64 && most <= SAMPLE_AREA_BYTES as u64 - unread
}

/// Bytes a record of `record_len` bytes takes of a [`SampleArea`]: its
/// length word, and the record rounded up to 8 bytes (so every length
/// word and header is 8-aligned).
pub const fn area_record_bytes(record_len: u64) -> u64 {
    8 + record_len.next_multiple_of(8)
}

/// Wakes the reader for the areas (see [`SampleArea`]): an area has no
/// descriptor to poll, so the program writes this to its CPU's ring with
/// a wake-up when the area's unread bytes pass
/// [`SAMPLE_AREA_WAKEUP_BYTES`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Doorbell {
    /// [`RecordKind::Doorbell`].
    pub kind: u32,
    /// The CPU whose area rang.
    pub cpu: u32,
}
const _: () = assert!(core::mem::size_of::<SwitchIn>() == SWITCH_IN_SIZE);

/// What the switch-out of a sampled blocking thread leaves for its
/// switch-in: the value of `OFF_CPU_PENDING`, keyed by tid.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OffCpuPending {
    pub tgid: u32,
    pub _pad: u32,
    /// The off-CPU sample's `ktime_ns`.
    pub out_ns: u64,
}

const _: () = assert!(core::mem::size_of::<OffCpuPending>() == 16);

// SAFETY: `repr(C)`, integers only, padding written out: every byte
// pattern is a value.
#[cfg(feature = "user")]
unsafe impl aya::Pod for OffCpuPending {}

/// Threads whose off-CPU sample waits for their switch-in
/// (`OFF_CPU_PENDING`): a node's sampled threads blocked at once. Past
/// it, a blocking thread's sample is not written (counted as failed).
pub const MAX_OFF_CPU_PENDING: u32 = 16_384;

/// Per CPU, the state of the off-CPU sampling rate (`OFF_CPU_RATE`): the
/// blocking switches of the current window, and the 1-in-N the last
/// window's count set for this one.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OffCpuRate {
    pub window_start_ns: u64,
    pub switches: u32,
    /// Keep one blocking switch in `divisor` (0 and 1: every one).
    pub divisor: u32,
}

const _: () = assert!(core::mem::size_of::<OffCpuRate>() == 16);

/// How long a window of [`OffCpuRate`] lasts: the divisor follows a change
/// of load within this long.
pub const OFF_CPU_WINDOW_NS: u64 = 100_000_000;

/// Processes whose CPython frames the sampler reads (`PYTHON_PROCESSES`).
pub const MAX_PYTHON_PROCESSES: u32 = 4096;

/// Most Python frames read per sample; deeper frames (the outermost) are
/// left out and the stack is marked [`python_stack_flags::TRUNCATED`].
pub const MAX_PYTHON_FRAMES: usize = 128;

/// Most bytes of a frame the sampler reads in one go
/// ([`PythonProcess::frame_bytes`]): every field it uses lies below this
/// in CPython 3.10 to 3.14 (the largest, 3.10's `f_lasti`, at byte 96).
pub const PYTHON_FRAME_READ_BYTES: u32 = 104;

/// How the sampler finds and reads a CPython process's frames: the value of
/// the `PYTHON_PROCESSES` map, keyed by tgid, written by the agent when it
/// finds an interpreter in a process's mappings. Every address is in the
/// process; every offset is in bytes and below [`PYTHON_FRAME_READ_BYTES`]
/// where it is one into a frame.
///
/// The walk: the thread's `PyThreadState` is the value of the pthread key
/// stored at `tss_key` (glibc keeps key `k` < 32 at `fs_base + tsd_base +
/// tsd_stride * k`); from it `tstate_frame` (3.13: `current_frame`), or,
/// when `cframe_frame` is not [`PythonProcess::NO_CFRAME`], the
/// `_PyCFrame*` at `tstate_frame` and the frame at `cframe_frame` in it
/// (3.11, 3.12); then each frame's code object, instruction pointer and
/// `previous` link. In 3.10 (`frame_objects`) the frames are
/// `PyFrameObject`s: `tstate->frame`, then `f_back`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PythonProcess {
    /// The process's start time ([`SampleHeader::process_start_ns`]): an
    /// entry left for an exited process is not used for one that reuses
    /// its pid.
    pub process_start_ns: u64,
    /// Address of the interpreter's `Py_tss_t` (`{int initialized;
    /// pthread_key_t key}`) holding the thread-state key.
    pub tss_key: u64,
    pub tsd_base: u32,
    pub tsd_stride: u32,
    pub tstate_frame: u32,
    pub cframe_frame: u32,
    /// In a frame: the code object (`f_code`, `f_executable`), the
    /// `previous` link, the instruction pointer (`prev_instr`,
    /// `instr_ptr`) and the byte that marks an entry from C.
    pub frame_code: u32,
    pub frame_previous: u32,
    pub frame_instr: u32,
    pub frame_entry: u32,
    /// The value of that byte at an entry. With `entry_is_shim` (3.12+) the
    /// marked frame is a shim CPython puts on the C stack: it is left out
    /// and the frame it called is the entry; without (3.11's `is_entry`),
    /// the marked frame itself is.
    pub entry_value: u32,
    pub entry_is_shim: u32,
    /// In a code object: `co_firstlineno` (a fingerprint the agent checks,
    /// see [`PythonFrame::first_line`]) and where the bytecode starts
    /// (`co_code_adaptive`).
    pub code_first_line: u32,
    pub code_bytecode: u32,
    /// Nonzero for CPython 3.10's frame objects: each frame is one
    /// `_PyEval_EvalFrameDefault` activation of its own (an entry), and
    /// `frame_instr` is the `int f_lasti`, an index of 2-byte code units
    /// (the bytecode is not in the code object: `code_bytecode` is unused).
    pub frame_objects: u32,
    /// Bytes read of each frame: at most [`PYTHON_FRAME_READ_BYTES`], no
    /// more than the version's fields need (a frame can be the last thing
    /// in its memory).
    pub frame_bytes: u32,
    /// In a frame: its `owner` byte, 0 (`FRAME_OWNED_BY_THREAD`) for a
    /// frame in the thread's data stack.
    pub frame_owner: u32,
    /// Nonzero (3.11+) when a frame in the data stack is fingerprinted by
    /// its size ([`PythonFrame::FRAME_SIZE`]) where the frame it called
    /// lies right after it: no read of its code object.
    pub frame_sizes: u32,
}

impl PythonProcess {
    /// [`PythonProcess::cframe_frame`] when the thread state points at the
    /// frame itself.
    pub const NO_CFRAME: u32 = u32::MAX;
}

const _: () = assert!(core::mem::size_of::<PythonProcess>() == 80);

// SAFETY: `repr(C)`, integers only, no padding: every byte pattern is a
// value.
#[cfg(feature = "user")]
unsafe impl aya::Pod for PythonProcess {}

/// Bit flags in [`PythonStackHeader::flags`].
pub mod python_stack_flags {
    /// The walk stopped at [`super::MAX_PYTHON_FRAMES`] with frames left.
    pub const TRUNCATED: u32 = 1 << 0;
    /// A read failed mid-walk (a frame freed under the walk, a bad link):
    /// the frames before it are whole.
    pub const READ_FAILED: u32 = 1 << 1;
}

/// The fixed part of a [`RecordKind::PythonStack`] record, followed by
/// `frames` [`PythonFrame`]s, innermost first.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PythonStackHeader {
    /// [`RecordKind::PythonStack`].
    pub kind: u32,
    pub cpu: u32,
    pub tgid: u32,
    pub tid: u32,
    pub frames: u32,
    /// Bit set of [`python_stack_flags`].
    pub flags: u32,
    /// The tick's `bpf_ktime_get_ns()`, taken before the frames were read:
    /// the sample's record written right after carries the same.
    pub ktime_ns: u64,
}

/// Size of [`PythonStackHeader`] in bytes.
pub const PYTHON_STACK_HEADER_SIZE: usize = 32;
const _: () = assert!(core::mem::size_of::<PythonStackHeader>() == PYTHON_STACK_HEADER_SIZE);

/// One Python frame as read at the tick: which code object ran and where
/// in it. The agent names the code object later, from the process, and
/// refuses it when its first line no longer matches (the object was freed
/// and its address reused).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PythonFrame {
    /// Address of the code object.
    pub code: u64,
    /// Byte offset of the instruction pointer from the start of the
    /// bytecode: negative before the first instruction (-2 in 3.11 and
    /// 3.12) or below the code, past its end when the pointer is; or
    /// [`PythonFrame::NO_OFFSET`] when the distance does not fit. The
    /// agent takes a negative offset for the first instruction's, and
    /// finds no line past the code's table.
    pub instr_offset: i32,
    /// The code object's fingerprint, which the agent checks the object it
    /// names against (a freed object's address reused): `co_firstlineno`
    /// read at the tick, or with [`PythonFrame::FRAME_SIZE`] the frame's
    /// size in 8-byte words, as the distance to the frame it called shows
    /// (a function's frames all take `co_framesize` words). The top bit
    /// ([`PythonFrame::ENTRY`]) marks the outermost frame of one
    /// `_PyEval_EvalFrameDefault` activation (a frame entered from C).
    pub first_line: u32,
}

impl PythonFrame {
    pub const ENTRY: u32 = 1 << 31;
    pub const FRAME_SIZE: u32 = 1 << 30;
    pub const NO_OFFSET: i32 = i32::MIN;
}

/// Size of one [`PythonFrame`] in bytes.
pub const PYTHON_FRAME_SIZE: usize = 16;
const _: () = assert!(core::mem::size_of::<PythonFrame>() == PYTHON_FRAME_SIZE);

/// Bytes of a Python stack record with every frame.
pub const PYTHON_STACK_MAX_BYTES: usize =
    PYTHON_STACK_HEADER_SIZE + MAX_PYTHON_FRAMES * PYTHON_FRAME_SIZE;

/// Indices into the per-CPU `COUNTERS` array: what the program's records
/// do not say (ticks left out, copies that fell back, wake-ups, off-CPU
/// choices). What they do say (samples, their user stack bytes, tail
/// spans, deep copies and those with holes, Python stacks and frames) the
/// sampler counts as it reads them (`record::SampleTally`): at fleet rates
/// each per-CPU counter a tick adds to is a cache line or two met cold.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    /// Records (samples or process events) lost because the ring buffer was full.
    RingBufferFull = 0,
    /// Ticks whose user stack copy read no byte at all.
    CopyFailed = 1,
    /// Ticks skipped by a filter (the agent itself, the tgid or cgroup allow-lists).
    Filtered = 2,
    /// Ticks that found the CPU idle (tgid 0); they produce no record. The
    /// sampler's events leave the idle task out (`exclude_idle`), so the
    /// kernel skips such ticks before the program runs: none, on a kernel
    /// that honours it.
    Idle = 3,
    /// Ticks of a selected task skipped by its cgroup's 1-in-N budget.
    Budgeted = 4,
    /// Deep copies that could not be made (the read faulted: the thread is
    /// on another stack; or the ring buffer had no room for one): the tick
    /// fell back to the usual copy.
    DeepCopyFallbacks = 5,
    /// Records that woke the reader early: ticks of a thread the agent has
    /// not learned yet, of a program known to need deep copies or of a
    /// process new while drains are paced (see [`MAX_NEW_PROCESS_WAKEUPS`]).
    EarlyWakeups = 6,
    /// Direct copies (see [`sample_flags::DIRECT_COPY`]) that could not be
    /// made (the ring buffer had no room, or the read faulted: a stack page
    /// never touched): the tick fell back to the usual copy.
    DirectCopyFallbacks = 7,
    /// Blocking switches of selected user threads (the thread left the
    /// CPU without being runnable), with the agent's off-CPU sampling on.
    OffCpuSwitches = 8,
    /// Of those, the ones the rate (see [`OffCpuRate`]) or a cgroup budget
    /// left out.
    OffCpuSkipped = 9,
    /// Off-CPU samples written.
    OffCpuSamples = 10,
    /// Off-CPU samples chosen but not written (no room in the ring, or
    /// no user stack read).
    OffCpuFailed = 11,
    /// Switch-in records written (an off-CPU sample's thread ran again).
    SwitchIns = 12,
    /// Ticks in kernel mode of a thread whose process has no address space
    /// any more (it is exiting and its memory is being freed): no user
    /// stack is left to read, so they are sampled as a kernel thread's
    /// (kernel stack alone).
    AddressSpaceGone = 13,
}

impl Counter {
    /// Every counter, in index order.
    pub const ALL: [Counter; 14] = [
        Counter::RingBufferFull,
        Counter::CopyFailed,
        Counter::Filtered,
        Counter::Idle,
        Counter::Budgeted,
        Counter::DeepCopyFallbacks,
        Counter::EarlyWakeups,
        Counter::DirectCopyFallbacks,
        Counter::OffCpuSwitches,
        Counter::OffCpuSkipped,
        Counter::OffCpuSamples,
        Counter::OffCpuFailed,
        Counter::SwitchIns,
        Counter::AddressSpaceGone,
    ];
}

/// Number of slots in the `COUNTERS` map.
pub const COUNTER_SLOTS: u32 = Counter::ALL.len() as u32;

/// Names of the maps and globals, shared so a rename breaks the build rather
/// than the loader.
pub mod names {
    pub const PROGRAM: &str = "sample_cpu_clock";
    pub const EXEC_PROGRAM: &str = "on_process_exec";
    pub const EXIT_PROGRAM: &str = "on_process_exit";
    pub const EXEC_TRACEPOINT: &str = "sched_process_exec";
    pub const EXIT_TRACEPOINT: &str = "sched_process_exit";
    pub const SAMPLE_RINGS: &str = "SAMPLE_RINGS";
    pub const SCRATCH: &str = "SCRATCH";
    pub const COUNTERS: &str = "COUNTERS";
    pub const RECORDS_LOST: &str = "RECORDS_LOST";
    pub const TGID_ALLOW: &str = "TGID_ALLOW";
    pub const CGROUP_POLICY: &str = "CGROUP_POLICY";
    pub const AGENT_TGID: &str = "AGENT_TGID";
    pub const USER_STACK_BYTES: &str = "USER_STACK_BYTES";
    pub const DEEP_STACK_BYTES: &str = "DEEP_STACK_BYTES";
    pub const FILTER_TGIDS: &str = "FILTER_TGIDS";
    pub const FILTER_CGROUPS: &str = "FILTER_CGROUPS";
    pub const CGROUP_POLICIES: &str = "CGROUP_POLICIES";
    pub const WAKEUP_BYTES: &str = "WAKEUP_BYTES";
    pub const STACK_PLANS: &str = "STACK_PLANS";
    pub const COPY_BYTES: &str = "COPY_BYTES";
    pub const STACK_TOPS: &str = "STACK_TOPS";
    pub const DEEP_PROGRAMS: &str = "DEEP_PROGRAMS";
    pub const EARLY_WAKEUPS: &str = "EARLY_WAKEUPS";
    pub const PACED_DRAINS: &str = "PACED_DRAINS";
    pub const NEW_PROCESS_WAKEUPS: &str = "NEW_PROCESS_WAKEUPS";
    pub const TASK_GROUP_LEADER_OFFSET: &str = "TASK_GROUP_LEADER_OFFSET";
    pub const TASK_START_TIME_OFFSET: &str = "TASK_START_TIME_OFFSET";
    pub const TASK_FSBASE_OFFSET: &str = "TASK_FSBASE_OFFSET";
    pub const TASK_MM_OFFSET: &str = "TASK_MM_OFFSET";
    pub const MM_START_STACK_OFFSET: &str = "MM_START_STACK_OFFSET";
    pub const PYTHON_PROCESSES: &str = "PYTHON_PROCESSES";
    pub const PYTHON_SCRATCH: &str = "PYTHON_SCRATCH";
    /// The off-CPU program, as a BTF tracepoint and as a raw one (for a
    /// kernel that refuses the first).
    pub const OFF_CPU_PROGRAM: &str = "on_sched_switch";
    pub const OFF_CPU_RAW_PROGRAM: &str = "on_sched_switch_raw";
    pub const SWITCH_TRACEPOINT: &str = "sched_switch";
    pub const OFF_CPU_PENDING: &str = "OFF_CPU_PENDING";
    pub const OFF_CPU_RATE: &str = "OFF_CPU_RATE";
    pub const OFF_CPU_SAMPLES_PER_SEC: &str = "OFF_CPU_SAMPLES_PER_SEC";
    pub const TASK_PID_OFFSET: &str = "TASK_PID_OFFSET";
    pub const TASK_COMM_OFFSET: &str = "TASK_COMM_OFFSET";
    pub const SAMPLE_AREAS: &str = "SAMPLE_AREAS";
}

/// Capacity of the tgid allow-list and of the cgroup policy map.
pub const MAX_ALLOW_ENTRIES: u32 = 4096;

/// What the agent asks of the tasks in one cgroup and its descendants: the
/// value of the `CGROUP_POLICY` map, keyed by cgroup v2 id.
///
/// The program looks up the task's cgroup and each of its ancestors, so an
/// entry for a container's cgroup also covers cgroups created under it
/// later. Flags of all matching entries add up; the deepest entry with a
/// non-zero divisor sets the budget.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CgroupPolicy {
    /// Bit set of [`policy_flags`].
    pub flags: u32,
    /// Keep one tick in `divisor` (chosen at random, so periodic work does
    /// not alias with the timer); 0 or 1: keep every tick.
    pub divisor: u32,
}

const _: () = assert!(core::mem::size_of::<CgroupPolicy>() == 8);

// SAFETY: `repr(C)`, two `u32`s, no padding: every byte pattern is a value.
#[cfg(feature = "user")]
unsafe impl aya::Pod for CgroupPolicy {}

/// Bit flags in [`CgroupPolicy::flags`].
pub mod policy_flags {
    /// Tasks in the cgroup (or below it) pass the cgroup filter.
    pub const SELECTED: u32 = 1 << 0;
}

/// Cgroup levels the program checks, from the root down (a container is
/// typically 2 to 5 levels deep). Below this, only the task's own cgroup is
/// looked up.
pub const MAX_CGROUP_DEPTH: i32 = 16;

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(feature = "alloc")]
    #[test]
    fn comm_stops_at_the_first_nul() {
        assert_eq!(comm_str(b"redis\0\0\0garbage\0"), "redis");
        assert_eq!(comm_str(b"exactly-16-bytes"), "exactly-16-bytes");
    }

    #[test]
    fn header_fields_are_where_the_decoder_expects_them() {
        assert_eq!(core::mem::offset_of!(SampleHeader, ktime_ns), 32);
        assert_eq!(core::mem::offset_of!(SampleHeader, user_rip), 48);
        assert_eq!(core::mem::offset_of!(SampleHeader, comm), 72);
        assert_eq!(core::mem::offset_of!(SampleHeader, tail_len), 88);
        assert_eq!(core::mem::offset_of!(SampleHeader, process_start_ns), 96);
        assert_eq!(core::mem::offset_of!(StackPlan, stack_end), 16);
        assert_eq!(core::mem::offset_of!(StackPlan, spans), 24);
    }

    #[test]
    fn spans_pack_and_unpack() {
        let span = tail_span::pack(0x7ffd_1234_5678, 256).unwrap();
        assert_eq!(tail_span::addr(span), 0x7ffd_1234_5678);
        assert_eq!(tail_span::len(span), 256);
        assert_eq!(tail_span::addr(span | tail_span::FAULTED), 0x7ffd_1234_5678);
        assert_eq!(tail_span::len(span | tail_span::FAULTED), 256);
        assert_eq!(tail_span::pack(1 << 48, 8), None);
        assert_eq!(tail_span::pack(0x1000, 0), None);
        assert_eq!(tail_span::pack(0x1000, 12), None);
        assert_eq!(tail_span::pack(0x1000, MAX_SPAN_BYTES + 8), None);
    }
}
