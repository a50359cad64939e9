//! The stackscope sampler: a `perf_event` program on `PERF_COUNT_SW_CPU_CLOCK`,
//! two raw tracepoints reporting process exec and exit, and, for off-CPU
//! profiles, one on `sched_switch` (see `on_switch`) that writes the same
//! sample records when a thread blocks, and a switch-in record when it
//! runs again.
//!
//! On each tick it writes one variable-length record to its CPU's ring
//! buffer (`SAMPLE_RINGS`) or sample area (`SAMPLE_AREAS`): a [`SampleHeader`] (ids, cgroup, comm, user
//! registers), the kernel stack when the tick hit kernel mode, and a copy of
//! the user stack from `rsp` upwards. It does no unwinding: that happens in user space, where any DWARF
//! rule is cheap to evaluate (see `shared/DESIGN.md`).
//!
//! How much user stack a tick reads follows what the thread's walks need
//! (maps the agent writes): a contiguous copy from `rsp`, up to the thread's
//! stack top once the agent has learned it, or else of the thread's or
//! process's adaptive size (at most the configured ceiling), then, for a
//! thread with deep frames, the few words of each deep frame the walk reads
//! (its stack tail), so a deep stack reaches its root without being copied.
//!
//! A thread the agent has learned (its stack top is known) and that has no
//! tail is read straight into its CPU's sample area (see [`area_copy`]),
//! the copy in one helper call (it ends below the top, inside the stack
//! mapping); when the area has no room, or the tick also wrote a Python
//! record or is an off-CPU sample, into a ring buffer reservation: the
//! smallest of the size classes that holds its copy (a reservation's size
//! must be a constant), the rest of the class padding the agent skips. Any
//! other record is assembled in a per-CPU scratch slot, its copy read page
//! by page (so it stops at the end of the stack mapping, wherever that is),
//! and handed to the ring buffer with one `bpf_ringbuf_output` of its real
//! length: one more copy of the record, which the direct path spares (a
//! fifth of the program's time on busy.c).
//!
//! Such a thread costs one map lookup before its copy: its stack top says
//! too that it has no plan and whether its process's CPython frames are
//! read (see [`StackTop`]).
//!
//! A thread whose deep frames change too fast for a tail (a compiler's
//! stack, hundreds of KB deep and reshaped every millisecond) gets a deep
//! copy instead: its whole stack, up to the stack's end the agent learned,
//! read in one helper call straight into a reservation in the deep ring
//! (shared by the CPUs, see `deep_ring`) of the
//! smallest deep class (16 KiB to 2 MiB, doubling) that holds it. The
//! reservation spares a megabyte-sized scratch slot per CPU and the second
//! copy; its unused end is padding the agent skips. A thread deeper than
//! the usual copy that the agent has not learned yet is copied deep up to
//! its thread pointer or its process's stack start (see
//! `first_ticks_stack_end`), and one learned while it was shallow up to
//! its stack top, so a compiler reaches its root from its first tick; where that fails, a thread of a program known to be deep wakes
//! the reader at once (see `early_wakeup`), so it is learned at its first
//! tick.
#![no_std]
#![no_main]

use core::ffi::c_void;

use agent_common::{
    COMM_LEN, COUNTER_SLOTS, CgroupPolicy, Counter, DEEP_COPY_CLASSES, DEFAULT_USER_STACK_BYTES,
    DIRECT_COPY_CLASSES, Doorbell, EARLY_WAKEUP_INTERVAL_NS, MAX_ALLOW_ENTRIES, MAX_CGROUP_DEPTH,
    MAX_COPY_SIZES, MAX_DEEP_PROGRAMS, MAX_DEEP_STACK_BYTES, MAX_KERNEL_STACK_BYTES,
    MAX_NEW_PROCESS_WAKEUPS, MAX_OFF_CPU_PENDING, MAX_PYTHON_FRAMES, MAX_PYTHON_PROCESSES,
    MAX_SPAN_BYTES, MAX_STACK_PLANS, MAX_TAIL_BYTES, MAX_TAIL_SPANS, MAX_USER_STACK_BYTES,
    OFF_CPU_WINDOW_NS, OffCpuPending, OffCpuRate, PAGE_SIZE, PYTHON_FRAME_READ_BYTES,
    PYTHON_STACK_HEADER_SIZE, PYTHON_STACK_MAX_BYTES, ProcessEvent, PythonFrame, PythonProcess,
    PythonStackHeader, RecordKind, SAMPLE_AREA_BYTES, SAMPLE_AREA_WAKEUP_BYTES, SAMPLE_HEADER_SIZE,
    SCRATCH_BYTES, STACK_TOP_SETS, STACK_TOP_WAYS, SWITCH_IN_SIZE, SampleArea, SampleHeader,
    StackPlan, StackTop, StackTopEntry, StackTopSet, SwitchIn, TAIL_SPAN_HEADER_SIZE,
    area_has_room, area_record_bytes, policy_flags, python_stack_flags, reserved_record_bytes,
    sample_flags, stack_top_flags, stack_top_set, tail_span,
};
use aya_ebpf::{
    EbpfContext, Global,
    bindings::{BPF_F_MMAPABLE, BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP, pt_regs},
    btf_maps::{self, ArrayOfMaps},
    helpers::{
        bpf_get_current_cgroup_id, bpf_get_current_pid_tgid, bpf_get_smp_processor_id,
        bpf_ktime_get_ns, bpf_probe_read_kernel, bpf_probe_read_user as read_user_value,
        generated::{
            bpf_get_current_ancestor_cgroup_id, bpf_get_current_comm as gen_get_current_comm,
            bpf_get_current_task, bpf_get_current_task_btf, bpf_get_prandom_u32, bpf_get_stack,
            bpf_loop, bpf_probe_read_kernel as gen_probe_read_kernel, bpf_probe_read_user,
            bpf_ringbuf_query, bpf_task_pt_regs,
        },
    },
    macros::{btf_map, btf_tracepoint, map, perf_event, raw_tracepoint},
    maps::{Array, HashMap, LruHashMap, PerCpuArray},
    programs::{BtfTracePointContext, PerfEventContext, RawTracePointContext},
};
use aya_log_ebpf::debug;

/// A ring buffer of records. Its size here is the template's only: the
/// agent creates the rings (their size is not part of a ring's type for
/// the kernel, so every ring the agent makes fits the slot).
type SampleRing = btf_maps::RingBuf<u8, { 64 << 10 }>;

/// The record rings: slot 0 holds the deep ring (see [`deep_ring`]), slot
/// `1 + cpu` each CPU's (the agent sets `max_entries` to the CPU count
/// plus one and gives every slot a ring: one per CPU, or one per group of
/// CPUs on hosts too large for that). A ring shared by every CPU made each
/// reservation take a lock and write a position that the other CPUs'
/// ticks wrote too (about 200 ns of a 1.8 µs tick on two CPUs, more on a
/// loaded host); a ring of its own keeps those lines in the CPU's cache.
/// Records of one CPU stay in order in its ring; the agent merges the
/// rings by time.
#[btf_map]
static SAMPLE_RINGS: ArrayOfMaps<SampleRing, 1> = ArrayOfMaps::new();

/// This CPU's ring: `None` only if the agent left its slot empty, which
/// the program counts as a full ring.
#[inline(always)]
fn sample_ring() -> Option<&'static SampleRing> {
    SAMPLE_RINGS.get(unsafe { bpf_get_smp_processor_id() }.wrapping_add(1))
}

/// The ring of deep copies, shared by every CPU: a deep record reserves a
/// whole class (up to 2 MiB), and a ring must have room for a few of them
/// while the reader catches up, which would make every CPU's ring that
/// large. Deep copies are rare (a compiler's main thread, a deep program's
/// first ticks), so their lock is rarely contended. `None` when deep copies
/// are off.
#[inline(always)]
fn deep_ring() -> Option<&'static SampleRing> {
    SAMPLE_RINGS.get(0)
}

/// Each CPU's [`SampleArea`], where its ticks' direct records go (see
/// [`area_copy`]). The agent sets `max_entries` (at most one per CPU: a
/// CPU without one writes to its ring) and maps the array to read them.
#[map(name = "SAMPLE_AREAS")]
static SAMPLE_AREAS: Array<SampleArea> = Array::with_max_entries(1, BPF_F_MMAPABLE);

/// One scratch slot per CPU (the agent sets `max_entries` to the CPU count).
/// A plain array rather than a per-CPU one: per-CPU values are capped at 32 KiB,
/// which would leave less than 32 KiB for the stack once the header is in.
/// The program runs with preemption off and does not nest on a CPU, so the
/// slot of the current CPU is ours for the duration of the tick.
#[map(name = "SCRATCH")]
static SCRATCH: Array<[u8; SCRATCH_BYTES]> = Array::with_max_entries(1, 0);

/// What the program did that its records do not say (see [`Counter`]):
/// ticks it left out or could not copy as planned. A tick that writes its
/// sample as planned adds to none of them.
#[map(name = "COUNTERS")]
static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(COUNTER_SLOTS, 0);

/// Records lost to a full ring, a slot per CPU (the agent sets
/// `max_entries` to the CPU count), as `COUNTERS` counts them too. The
/// reader checks for losses before every drain (a lost exec or exit leaves
/// its state stale); this array it maps and reads in place, where a look
/// at the per-CPU counter is a system call and a copy per CPU each time (3%
/// of the agent's CPU at 99 Hz).
#[map(name = "RECORDS_LOST")]
static RECORDS_LOST: Array<u64> = Array::with_max_entries(1, BPF_F_MMAPABLE);

/// Allow-listed tgids, consulted only when `FILTER_TGIDS` is set.
#[map(name = "TGID_ALLOW")]
static TGID_ALLOW: HashMap<u32, u8> = HashMap::with_max_entries(MAX_ALLOW_ENTRIES, 0);

/// What the agent asks of each selected or budgeted cgroup (by v2 id) and
/// its descendants; consulted only when `CGROUP_POLICIES` is set. The agent
/// rewrites it while running as containers come and go.
#[map(name = "CGROUP_POLICY")]
static CGROUP_POLICY: HashMap<u64, CgroupPolicy> = HashMap::with_max_entries(MAX_ALLOW_ENTRIES, 0);

/// Per thread (by tid): the adaptive copy size and the stack tail to read.
#[map(name = "STACK_PLANS")]
static STACK_PLANS: LruHashMap<u32, StackPlan> = LruHashMap::with_max_entries(MAX_STACK_PLANS, 0);

/// Per process (by tgid): the adaptive copy size of threads without a plan.
#[map(name = "COPY_BYTES")]
static COPY_BYTES: LruHashMap<u32, u32> = LruHashMap::with_max_entries(MAX_COPY_SIZES, 0);

/// Per thread: how far up its stack a copy needs to go at most, in the set
/// `stack_top_set(tid)` (see [`StackTopSet`]; the agent maps the array).
#[map(name = "STACK_TOPS")]
static STACK_TOPS: Array<StackTopSet> = Array::with_max_entries(STACK_TOP_SETS, BPF_F_MMAPABLE);

/// Thread names of programs whose threads needed deep copies (see
/// `MAX_DEEP_PROGRAMS`): their unlearned threads' ticks that could not be
/// copied deep wake the reader early.
#[map(name = "DEEP_PROGRAMS")]
static DEEP_PROGRAMS: LruHashMap<[u8; COMM_LEN], u8> =
    LruHashMap::with_max_entries(MAX_DEEP_PROGRAMS, 0);

/// Per CPU: when it last woke the reader early (`bpf_ktime_get_ns`).
#[map(name = "EARLY_WAKEUPS")]
static EARLY_WAKEUPS: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// 1 while the reader's timed drains come less often than their base
/// period (few records to read), written by the agent: a new process's first tick
/// then wakes it (see `MAX_NEW_PROCESS_WAKEUPS`).
#[map(name = "PACED_DRAINS")]
static PACED_DRAINS: Array<u32> = Array::with_max_entries(1, 0);

/// Processes (by tgid) that woke the reader while drains were paced.
#[map(name = "NEW_PROCESS_WAKEUPS")]
static NEW_PROCESS_WAKEUPS: LruHashMap<u32, u8> =
    LruHashMap::with_max_entries(MAX_NEW_PROCESS_WAKEUPS, 0);

/// Sampled blocking threads (by tid) waiting to be switched back in: what
/// their switch-in record names (see `on_switch`). A plain hash, not an
/// LRU one, which may evict live entries before it is full (its free
/// nodes sit in per-CPU lists): an entry goes at its thread's switch-in,
/// or else at its exit (`on_process_exit`), so none stays behind.
#[map(name = "OFF_CPU_PENDING")]
static OFF_CPU_PENDING: HashMap<u32, OffCpuPending> =
    HashMap::with_max_entries(MAX_OFF_CPU_PENDING, 0);

/// Per CPU: the off-CPU sampling rate's window (see `off_cpu_divisor`).
#[map(name = "OFF_CPU_RATE")]
static OFF_CPU_RATE: PerCpuArray<OffCpuRate> = PerCpuArray::with_max_entries(1, 0);

/// CPython processes (by tgid) whose frames each tick reads, and how.
#[map(name = "PYTHON_PROCESSES")]
static PYTHON_PROCESSES: HashMap<u32, PythonProcess> =
    HashMap::with_max_entries(MAX_PYTHON_PROCESSES, 0);

/// Per CPU: how far a paged deep copy got (see [`paged_copy`]): bytes
/// done and pages not read. In a map, not on the stack, so the verifier
/// sees no new state in each step of the loop (it would follow all 513).
#[map(name = "PAGED_COPY")]
static PAGED_COPY: PerCpuArray<[u32; 2]> = PerCpuArray::with_max_entries(1, 0);

/// Per CPU: a Python stack record being assembled, and the frame read last.
#[map(name = "PYTHON_SCRATCH")]
static PYTHON_SCRATCH: PerCpuArray<PythonScratch> = PerCpuArray::with_max_entries(1, 0);

/// 8-aligned (a map value is), so the record's header and frames and the
/// frame buffer's words are read and written whole: unaligned, the BPF
/// target does each byte apart, and the values kept meanwhile took the
/// stack past what Linux 6.1 allows the program's calls together.
#[repr(C, align(8))]
struct PythonScratch {
    record: [u8; PYTHON_STACK_MAX_BYTES],
    /// Twice the bytes read, so that a field at any offset below
    /// `PYTHON_FRAME_MASK` lies inside for the verifier.
    frame: [u8; 2 * PYTHON_FRAME_READ_BYTES as usize],
    /// Bytes of the thread's frame stack read at once (see
    /// `python_window`), with room past them for a field read of a frame
    /// at the window's end.
    window: [u8; PYTHON_WINDOW_BYTES + 2 * PYTHON_FRAME_READ_BYTES as usize],
    /// Where the window starts in the process, and how many offsets from
    /// there a frame can start at and lie whole in it (0: no window).
    window_start: u64,
    window_frame_starts: u64,
    /// The thread whose thread-state slot (its TSD entry for the
    /// interpreter's key) the walk on this CPU found last, the address of
    /// its interpreter's key, and where that slot is: a CPU that keeps
    /// running one thread finds it without reading the thread pointer and
    /// the key again (see `thread_state_slot`).
    slot_tgid: u32,
    slot_tid: u32,
    slot_process_start_ns: u64,
    slot_key: u64,
    slot: u64,
    /// The last frame written that lies in the data stack (0: none yet):
    /// the frame its caller called, right after it (see `python_frame`).
    inner_frame: u64,
    /// The walk's state (see `python_frame`): the next frame to read, the
    /// frames written and the record's flags; the last code object read
    /// and its first line (a recursion's frames share one: read once).
    next: u64,
    frames: u32,
    flags: u32,
    last_code: u64,
    last_first_line: u32,
    _pad: u32,
}

/// Most bytes of a thread's frame stack read in one go. From 3.11 on,
/// CPython allocates a thread's frames one after the other in its data
/// stack (the innermost last), so a read below a frame holds the frames
/// it was called from: a few reads instead of one per frame. A window
/// reads from the frame's end down to the start of its page: the frames
/// of a page in one read. A read's cost is mostly its own, not its
/// bytes': whole pages cost no more than 512-byte windows doubling from
/// the first at depth 3, and saved a read or two at depths 10 and 30
/// (`bench sampler`'s fixture, python3.11). Frames elsewhere (a
/// generator's, 3.12+'s entry shims on the C stack) start windows of
/// their own, or are read alone when no window can be.
const PYTHON_WINDOW_BYTES: usize = 4096;
/// Largest frame size taken for a fingerprint (a function of 100,000
/// locals); a larger distance is no caller's and callee's.
const PYTHON_MAX_FRAME_BYTES: u64 = 1 << 20;
/// Where the first frame of a data stack chunk lies in its page: after
/// the chunk's header (`_PyStackChunk`: previous, size, top), and in a
/// thread's first chunk after one more word CPython leaves unused.
const PYTHON_CHUNK_FIRST_FRAME: u64 = 24;
const PYTHON_ROOT_CHUNK_FIRST_FRAME: u64 = 32;
const _: () = assert!(PYTHON_WINDOW_BYTES.is_power_of_two());

/// Low bits of a frame's code object reference that tag it rather than
/// address it: 3.14's `_PyStackRef` marks a reference it does not own
/// there. Masked in every version: an object is at least 8-aligned.
const PYTHON_CODE_TAG_BITS: u64 = 0b11;

/// Bounds a field's offset into `PythonScratch::frame` for the verifier.
const PYTHON_FRAME_MASK: u32 = 127;
const _: () = assert!(PYTHON_FRAME_MASK as usize + 8 <= 2 * PYTHON_FRAME_READ_BYTES as usize);
const _: () = assert!(MAX_PYTHON_FRAMES.is_power_of_two());

// Load-time constants, patched by the agent. Being read-only globals, the
// verifier sees their values and prunes the branches they disable.
#[unsafe(no_mangle)]
static AGENT_TGID: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static USER_STACK_BYTES: Global<u32> = Global::new(DEFAULT_USER_STACK_BYTES);
/// Most bytes of a deep copy; 0 turns deep copies off. Being a load-time
/// constant, it also sizes the deep record's reservation, which the
/// verifier needs to know.
#[unsafe(no_mangle)]
static DEEP_STACK_BYTES: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static FILTER_TGIDS: Global<u8> = Global::new(0);
/// Only tasks whose cgroup (or an ancestor) is `SELECTED` in `CGROUP_POLICY`.
#[unsafe(no_mangle)]
static FILTER_CGROUPS: Global<u8> = Global::new(0);
/// `CGROUP_POLICY` is in use (a cgroup filter or budgets): without it, the
/// ancestor walk is pruned and a tick costs nothing more.
#[unsafe(no_mangle)]
static CGROUP_POLICIES: Global<u8> = Global::new(0);
/// Byte offsets of `group_leader` and `start_time` in the running kernel's
/// `task_struct`, found by the agent in the kernel's BTF; 0 when unknown
/// (then samples carry no process start time).
#[unsafe(no_mangle)]
static TASK_GROUP_LEADER_OFFSET: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static TASK_START_TIME_OFFSET: Global<u32> = Global::new(0);
/// Byte offset of the user thread pointer (`thread.fsbase` on x86-64) in
/// `task_struct`, from the kernel's BTF; 0 when unknown (then a thread's
/// first ticks get no deep copy, see `first_ticks_stack_end`).
#[unsafe(no_mangle)]
static TASK_FSBASE_OFFSET: Global<u32> = Global::new(0);
/// Byte offsets of `mm` in `task_struct` and of `start_stack` in
/// `mm_struct`, from the kernel's BTF; 0 when unknown (then a main thread's
/// first ticks get no deep copy, see `first_ticks_stack_end`).
#[unsafe(no_mangle)]
static TASK_MM_OFFSET: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static MM_START_STACK_OFFSET: Global<u32> = Global::new(0);
/// Off-CPU samples per second per CPU the sampling rate aims at (see
/// `off_cpu_divisor`).
#[unsafe(no_mangle)]
static OFF_CPU_SAMPLES_PER_SEC: Global<u32> = Global::new(200);
/// Byte offsets of `pid` (the thread id) in `task_struct`, from the
/// kernel's BTF: how a switch names the task it runs next. 0 when unknown
/// (the agent does not attach the off-CPU program then).
#[unsafe(no_mangle)]
static TASK_PID_OFFSET: Global<u32> = Global::new(0);
/// Byte offset of `comm` (the thread's name) in `task_struct`, from the
/// kernel's BTF; 0 when unknown (then `bpf_get_current_comm` reads it, see
/// `write_current_comm`).
#[unsafe(no_mangle)]
static TASK_COMM_OFFSET: Global<u32> = Global::new(0);
/// Unread bytes in a ring at which a record wakes the reader (the agent
/// sets a quarter of a CPU's ring at load; the deep ring, which holds only
/// a few of the largest copies, uses the same mark).
#[unsafe(no_mangle)]
static WAKEUP_BYTES: Global<u64> = Global::new(1 << 20);

/// Page-sized reads needed to cover the largest copy when `rsp` is not page
/// aligned: a partial first page, then whole pages.
const MAX_COPY_READS: u32 = MAX_USER_STACK_BYTES / PAGE_SIZE + 1;

/// Masks bounding lengths read back from the scratch slot for the verifier
/// (see `SCRATCH_BYTES`); the lengths themselves are always below them.
const KERNEL_STACK_MASK: u64 = agent_common::KERNEL_STACK_MASK;
const USER_STACK_MASK: u64 = agent_common::USER_STACK_MASK;

/// Privilege level of user mode in the low bits of `cs`.
const USER_RPL: u64 = 3;

#[perf_event]
pub fn sample_cpu_clock(ctx: PerfEventContext) -> u32 {
    match try_sample_cpu_clock(&ctx) {
        Ok(ret) | Err(ret) => ret,
    }
}

fn try_sample_cpu_clock(ctx: &PerfEventContext) -> Result<u32, u32> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    let tid = pid_tgid as u32;

    if tgid == 0 {
        // The idle task: the CPU had nothing to run.
        count(Counter::Idle);
        return Ok(0);
    }
    let Some((cgroup_id, budget)) = selected(tgid) else {
        count(Counter::Filtered);
        return Ok(0);
    };
    if !kept(budget) {
        count(Counter::Budgeted);
        return Ok(0);
    }

    let mut ids = SampleIds {
        tgid,
        tid,
        cpu: unsafe { bpf_get_smp_processor_id() },
        cgroup_id,
        sampling_divisor: budget,
        stack_top: 0,
        copy_limit: 0,
        ktime_ns: unsafe { bpf_ktime_get_ns() },
        process_start_ns: process_start_ns(tid == tgid),
        python_bytes: 0,
    };

    // SAFETY: perf_event programs get a `bpf_perf_event_data` context whose
    // `regs` are the registers at the tick.
    let tick_regs: &pt_regs = unsafe { &(*ctx.ctx).regs };
    let tick_in_user = tick_regs.cs & 3 == USER_RPL;

    let mut flags = 0u32;
    let user_regs = if tick_in_user {
        flags |= sample_flags::TICK_IN_USER;
        Some(UserRegs::from(tick_regs))
    } else {
        saved_user_regs()
    };
    // Without user registers (a kernel thread, a task whose memory is
    // gone) there are neither user stacks nor CPython frames to read.
    // Before the sample's record, with the same CPU, thread and time: the
    // agent pairs the two by them.
    if user_regs.is_some() && look_up_top(&mut ids) {
        python_stack(&mut ids);
    }
    stack_sample(ctx, &mut ids, flags, user_regs);
    Ok(0)
}

/// The current task's cgroup id and its cgroup's budget (keep 1 in N)
/// when the agent's filters select it (never the agent itself); `None`
/// when they leave it out.
#[inline(always)]
fn selected(tgid: u32) -> Option<(u64, u32)> {
    if tgid == AGENT_TGID.load() {
        return None;
    }
    if FILTER_TGIDS.load() != 0 && unsafe { TGID_ALLOW.get(tgid) }.is_none() {
        return None;
    }
    let cgroup_id = unsafe { bpf_get_current_cgroup_id() };
    let mut budget = 1;
    if CGROUP_POLICIES.load() != 0 {
        let policy = cgroup_policy(cgroup_id);
        if FILTER_CGROUPS.load() != 0 && policy.flags & policy_flags::SELECTED == 0 {
            return None;
        }
        budget = policy.divisor.max(1);
    }
    Some((cgroup_id, budget))
}

/// One time in `divisor`, at random rather than every N-th time: a
/// counter would alias with work whose period is a multiple of N.
#[inline(always)]
fn kept(divisor: u32) -> bool {
    divisor <= 1 || unsafe { bpf_get_prandom_u32() } % divisor == 0
}

/// Looks up the current thread's stack top (see [`StackTop`]) into
/// `ids.stack_top`. Whether its process's CPython frames are to be read:
/// always for a thread without a top, whose process is looked up.
#[inline(always)]
fn look_up_top(ids: &mut SampleIds) -> bool {
    let Some(top) = stack_top(ids.tid).filter(|top| top.tgid == ids.tgid) else {
        return true;
    };
    ids.stack_top = top.top;
    top.flags & stack_top_flags::PYTHON != 0
}

/// Thread `tid`'s entry in `STACK_TOPS`, if its set holds one that did not
/// change while it was read (see [`StackTopSet`]).
#[inline(always)]
fn stack_top(tid: u32) -> Option<StackTop> {
    let set = STACK_TOPS.get_ptr(stack_top_set(tid))?;
    for way in 0..STACK_TOP_WAYS {
        // SAFETY: inside the set the lookup returned; volatile, so the
        // loads stay in this order (the agent writes the entry in place).
        unsafe {
            let entry = core::ptr::addr_of!((*set).entries[way]);
            let tid_field = core::ptr::addr_of!((*entry).tid);
            if tid_field.read_volatile() != tid {
                continue;
            }
            let read = StackTopEntry {
                tid,
                tgid: core::ptr::addr_of!((*entry).tgid).read_volatile(),
                top_and_flags: core::ptr::addr_of!((*entry).top_and_flags).read_volatile(),
            };
            return (tid_field.read_volatile() == tid).then(|| read.top());
        }
    }
    None
}

/// Empties thread `tid`'s entry in `STACK_TOPS`, if there is one.
#[inline(always)]
fn remove_stack_top(tid: u32) {
    let Some(set) = STACK_TOPS.get_ptr_mut(stack_top_set(tid)) else {
        return;
    };
    for way in 0..STACK_TOP_WAYS {
        // SAFETY: inside the set the lookup returned. An entry the agent
        // rewrites meanwhile for another thread is emptied too: that
        // thread takes the unlearned path until the agent writes it again.
        unsafe {
            let tid_field = core::ptr::addr_of_mut!((*set).entries[way].tid);
            if tid_field.read_volatile() == tid {
                tid_field.write_volatile(0);
            }
        }
    }
}

/// Writes a sample record of the current task's stacks, taken with
/// `user_regs` (its user registers, `None` for a kernel thread): the deep,
/// direct or usual copy its thread's plan or stack top (looked up by
/// [`look_up_top`]) call for (see the module doc). Whether a record was
/// written.
#[inline(always)]
fn stack_sample<C: EbpfContext>(
    ctx: &C,
    ids: &mut SampleIds,
    mut flags: u32,
    user_regs: Option<UserRegs>,
) -> bool {
    let (tgid, tid) = (ids.tgid, ids.tid);
    if user_regs.is_some() {
        flags |= sample_flags::USER_REGS;
    }
    let stack_top = ids.stack_top;
    // A thread with a top has no plan (see `StackTop`); one without user
    // registers has no use for it.
    // SAFETY: values are only read; a plan the agent rewrites meanwhile
    // can only make the tail read other (real) stack words.
    let plan = match user_regs {
        Some(_) if stack_top == 0 => {
            unsafe { STACK_PLANS.get(tid) }.filter(|plan| plan.tgid == tgid)
        }
        _ => None,
    };
    if let Some(regs) = user_regs
        && DEEP_STACK_BYTES.load() != 0
    {
        let stack_end = match plan {
            Some(plan) => plan.stack_end,
            None if stack_top == 0 => first_ticks_stack_end(regs.rsp, tid == tgid),
            // A thread learned while it was shallow (its walks reached the
            // root within the usual copy), deeper now: copied to its top,
            // where those walks ended, until the agent learns it again.
            None => deep_copy_end(regs.rsp, stack_top),
        };
        if stack_end != 0 {
            if deep_sample(ctx, ids, flags, regs, stack_end) {
                return true;
            }
            count(Counter::DeepCopyFallbacks);
        }
    }

    if let Some(regs) = user_regs {
        let ceiling = USER_STACK_BYTES.load().min(MAX_USER_STACK_BYTES);
        let mut limit = match plan {
            Some(plan) => plan.copy_bytes,
            // A learned thread's copy ends at its top: all a walk to the
            // root reads, and no more. The process's adaptive size would
            // only cut it short when the thread runs deeper than its
            // earlier ticks (a short compiler run's did, every run).
            None if stack_top > regs.rsp => ceiling,
            None => unsafe { COPY_BYTES.get(tgid) }.copied().unwrap_or(ceiling),
        }
        .min(ceiling);
        if stack_top > regs.rsp && stack_top - regs.rsp < u64::from(limit) {
            limit = (stack_top - regs.rsp) as u32;
            flags |= sample_flags::COPY_AT_TOP;
        }
        ids.copy_limit = limit;
        // A learned thread's copy ends below its stack top, inside its
        // stack mapping: one read of it cannot run off the mapping's end.
        // (Above its top, the thread runs on another stack: a signal's, a
        // coroutine's.)
        if plan.is_none() && stack_top > regs.rsp {
            if direct_sample(ctx, ids, flags, regs) {
                return true;
            }
            count(Counter::DirectCopyFallbacks);
        }
    }
    usual_sample(ctx, ids, flags, user_regs, plan)
}

/// `$copy`, with `$class` the smallest of `$classes` (whose indexes are
/// listed) that holds `$len` bytes, as a constant: a ring buffer
/// reservation's size must be one, so each class is a call of its own.
/// False when none holds them.
macro_rules! in_smallest_class {
    ($len:expr, $classes:expr, [$($i:literal),+], |$class:ident| $copy:expr) => {{
        // Every class listed, none left out.
        const _: () = assert!($classes.len() == [$($i),+].len());
        let len: u32 = $len;
        $(
            if len <= $classes[$i] {
                const $class: u32 = $classes[$i];
                $copy
            } else
        )+
        { false }
    }};
}

/// A direct record (`sample_flags::DIRECT_COPY`): in the CPU's sample area
/// ([`area_copy`]), or else in a reservation of the smallest class that
/// holds the copy (and the kernel stack, for a tick in kernel mode), the
/// kernel stack written and the user stack read into it in one helper
/// call. Spares the usual path's second copy
/// (scratch slot to ring) and its page-by-page reads. False, with nothing
/// written, when the copy is empty, there is no room, or the read faults (a
/// page of the stack was never touched, or the top is stale): the tick then
/// takes the usual path.
///
/// Not inlined: its frame stays out of the entry's (see `usual_sample`).
#[inline(never)]
fn direct_sample<C: EbpfContext>(ctx: &C, ids: &SampleIds, flags: u32, regs: UserRegs) -> bool {
    if flags & sample_flags::TICK_IN_USER != 0 {
        direct_class::<C, false>(ctx, ids, flags, regs)
    } else {
        direct_class::<C, true>(ctx, ids, flags, regs)
    }
}

#[inline(always)]
fn direct_class<C: EbpfContext, const KERNEL: bool>(
    ctx: &C,
    ids: &SampleIds,
    flags: u32,
    regs: UserRegs,
) -> bool {
    // A tick with a Python record goes to the ring that holds that
    // record, which the agent pairs with the next sample of its CPU; an
    // off-CPU sample's switch can come from a program other than the tick
    // (see `SampleArea`: one writer per area).
    if flags & sample_flags::OFF_CPU == 0 && ids.python_bytes == 0 {
        match area_copy::<C, KERNEL>(ctx, ids, flags, regs) {
            AreaCopy::Written => return true,
            AreaCopy::Faulted => return false,
            AreaCopy::NoRoom => {}
        }
    }
    in_smallest_class!(
        ids.copy_limit,
        DIRECT_COPY_CLASSES,
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
        |CLASS| reserved_copy::<C, CLASS, KERNEL, false>(ctx, ids, flags, regs, ids.copy_limit)
    )
}

/// How [`area_copy`] ended.
enum AreaCopy {
    Written,
    /// No area, or not room enough in it: the ring may have some.
    NoRoom,
    /// The stack could not be read: the ring's copy would fail too.
    Faulted,
}

/// A direct record written to this CPU's [`SampleArea`]: the kernel stack
/// (when `KERNEL_ROOM` and the tick hit kernel mode) and `copy_limit`
/// bytes of user stack read into place, the header, the length word, and
/// then the producer position. A ring buffer's reservation took a lock,
/// helpers and positions in cache lines of their own (its lookup,
/// reservation, unread count and submit took 2.0-2.4 us of a cold tick at
/// 99 Hz, see the README); this reads two positions and writes one.
/// The reader is woken by a [`Doorbell`] when the area's unread bytes
/// pass the mark.
#[inline(always)]
fn area_copy<C: EbpfContext, const KERNEL_ROOM: bool>(
    ctx: &C,
    ids: &SampleIds,
    mut flags: u32,
    regs: UserRegs,
) -> AreaCopy {
    let Some(area) = SAMPLE_AREAS.get_ptr_mut(ids.cpu) else {
        return AreaCopy::NoRoom;
    };
    // Through `opaque`, and checked: the verifier bounds the read by it.
    let len = opaque(ids.copy_limit);
    if len == 0 || len > MAX_USER_STACK_BYTES {
        return AreaCopy::NoRoom;
    }
    // SAFETY: `area` is this CPU's value; the positions are plain words
    // the agent also reads and writes (the consumer), each whole.
    let (producer, consumer) = unsafe {
        (
            core::ptr::addr_of!((*area).producer).read_volatile(),
            core::ptr::addr_of!((*area).consumer).read_volatile(),
        )
    };
    let most = area_record_bytes(u64::from(reserved_record_bytes(len, KERNEL_ROOM)));
    if !area_has_room(producer, consumer, most) {
        return AreaCopy::NoRoom;
    }
    let unread = producer.wrapping_sub(consumer);
    let start = (producer & (SAMPLE_AREA_BYTES as u64 - 1)) as usize;
    // SAFETY: `start` < SAMPLE_AREA_BYTES, and the slack after the data
    // holds the largest record (`SAMPLE_AREA_SLACK`).
    let (data, record) = unsafe {
        let data = core::ptr::addr_of_mut!((*area).data).cast::<u8>();
        (data, data.add(start + 8))
    };
    // SAFETY: room for the header, the kernel stack and `len`, as above.
    let stacks = unsafe { read_stacks::<C, KERNEL_ROOM>(ctx, record, &mut flags, regs.rsp, len) };
    if !stacks.read {
        return AreaCopy::Faulted;
    }
    let (kernel_stack_len, offset) = (stacks.kernel_stack_len, stacks.offset);
    // SAFETY: the record's start is 8-aligned (positions move by
    // multiples of 8) with room for the header.
    unsafe {
        ids.write_header(
            record,
            flags | sample_flags::DIRECT_COPY,
            kernel_stack_len,
            len,
            Some(&regs),
        );
    }
    let record_len = offset as u64 + u64::from(len);
    let bytes = area_record_bytes(record_len);
    // SAFETY: the length word lies at the record's start, inside the data.
    // Volatile, and stored in this order after the record's stores: the
    // reader trusts what lies below the producer.
    unsafe {
        data.add(start).cast::<u64>().write_volatile(record_len);
        core::ptr::addr_of_mut!((*area).producer).write_volatile(producer + bytes);
    }
    if wakeup_flag_at(SAMPLE_AREA_WAKEUP_BYTES, unread, bytes) == u64::from(BPF_RB_FORCE_WAKEUP) {
        ring_doorbell(ids.cpu);
    }
    AreaCopy::Written
}

/// Wakes the reader for `cpu`'s area through its ring. A full ring loses
/// the doorbell: the reader then comes at its timed drain, and the area,
/// once full, sends its records to the ring.
#[inline(never)]
fn ring_doorbell(cpu: u32) {
    let doorbell = Doorbell {
        kind: RecordKind::Doorbell as u32,
        cpu,
    };
    if let Some(ring) = sample_ring() {
        let _ = ring.output_untyped::<Doorbell>(doorbell, u64::from(BPF_RB_FORCE_WAKEUP));
    }
}

/// The usual record (see the module doc): the kernel stack, a bounded copy
/// of the user stack (as much as the thread's copy size, its stack top or
/// the ceiling allow), and the plan's tail spans, assembled in the CPU's
/// scratch slot and output to the ring buffer.
///
/// Not inlined: the verifier allows a program and the calls it makes 512
/// bytes of stack together, counted along each call chain. Apart, the
/// entry's small frame plus this one, or plus [`deep_sample`]'s, fit;
/// inlined, the entry's frame would hold this path's locals while calling
/// `deep_sample` (Linux 6.1 refuses that program).
/// Whether the record was written (a `Result` would take a sixth argument,
/// its return slot: BPF calls pass five).
#[inline(never)]
fn usual_sample<C: EbpfContext>(
    ctx: &C,
    ids: &SampleIds,
    flags: u32,
    user_regs: Option<UserRegs>,
    plan: Option<&StackPlan>,
) -> bool {
    try_usual_sample(ctx, ids, flags, user_regs, plan).is_ok()
}

#[inline(always)]
fn try_usual_sample<C: EbpfContext>(
    ctx: &C,
    ids: &SampleIds,
    mut flags: u32,
    user_regs: Option<UserRegs>,
    plan: Option<&StackPlan>,
) -> Result<(), ()> {
    let tick_in_user = flags & sample_flags::TICK_IN_USER != 0;
    let scratch = SCRATCH.get_ptr_mut(ids.cpu).ok_or(())?.cast::<u8>();
    let mut kernel_stack_len = 0u32;
    if !tick_in_user {
        // SAFETY: the destination lies inside the scratch slot, right after
        // the header, and MAX_KERNEL_STACK_BYTES fits there by construction.
        kernel_stack_len =
            unsafe { kernel_stack(ctx, scratch.add(SAMPLE_HEADER_SIZE), &mut flags) };
    }

    let mut user_stack_len = 0u32;
    let mut tail_plan = None;
    // Neither a plan nor a stack top: the agent has not learned the thread.
    let mut unlearned = false;
    if let Some(regs) = user_regs {
        // Through `opaque`: LLVM would test both at once by or-ing the
        // plan's pointer with the top, which the verifier refuses.
        unlearned = opaque(u32::from(plan.is_some())) == 0 && ids.stack_top == 0;
        let copy = copy_user_stack(scratch, kernel_stack_len, regs.rsp, ids.copy_limit);
        user_stack_len = copy.len;
        if copy.faulted {
            flags |= sample_flags::USER_STACK_FAULTED;
        }
        if copy.len == 0 {
            count(Counter::CopyFailed);
        }
        // A copy that reached the end of the stack mapping has every frame.
        if !copy.faulted {
            tail_plan = plan;
        }
    }

    // SAFETY: scratch slots are 8-aligned map values larger than the header.
    unsafe {
        ids.write_header(
            scratch,
            flags,
            kernel_stack_len,
            user_stack_len,
            user_regs.as_ref(),
        )
    };
    // From here on, lengths are read back from the header in the slot
    // (volatile, so the compiler cannot reuse the registers). The verifier
    // then sees the same unknown lengths whichever way the copy loop ended,
    // and verifies the tail loop and the output once instead of once per
    // way: without this, the program exceeds its million-instruction budget.
    if let Some(plan) = tail_plan {
        read_tail(scratch, plan);
    }
    // SAFETY: the header was written above; the slot is ours for the tick.
    let written = unsafe { WrittenLengths::read(scratch) };
    // A tail may take MAX_TAIL_BYTES exactly (`read_tail_step` fills it
    // up to there): bounded by a minimum, not a mask of MAX_TAIL_BYTES - 1,
    // which cut such a tail to nothing while its header still announced it.
    let user_bytes = (u64::from(written.user_stack_len) & USER_STACK_MASK)
        + u64::from(written.tail_len).min(u64::from(MAX_TAIL_BYTES));
    let len = SAMPLE_HEADER_SIZE as u64
        + (u64::from(written.kernel_stack_len) & KERNEL_STACK_MASK)
        + user_bytes;
    if len > SCRATCH_BYTES as u64 {
        return Err(());
    }
    // SAFETY: the first `len` bytes of the scratch slot were written above.
    let record = unsafe { core::slice::from_raw_parts(scratch, len as usize) };
    let Some(ring) = sample_ring() else {
        count_lost_record();
        return Err(());
    };
    let wakeup = if unlearned && early_wakeup(scratch, ids.tgid) {
        u64::from(BPF_RB_FORCE_WAKEUP)
    } else {
        ids.wakeup_flag(unread_bytes(ring), len)
    };
    if ring.output_untyped::<[u8]>(record, wakeup).is_err() {
        count_lost_record();
        debug!(ctx, "ring buffer full, dropped a {} byte record", len);
        return Err(());
    }
    Ok(())
}

/// The lengths of the header in a scratch slot, read back one field at a
/// time: a whole header read back would take another 100 bytes of the 512
/// the verifier allows a program and the calls it makes (Linux 6.1 refuses
/// the program past them).
struct WrittenLengths {
    kernel_stack_len: u32,
    user_stack_len: u32,
    tail_len: u32,
}

impl WrittenLengths {
    /// # Safety
    /// `scratch` must hold a header.
    #[inline(always)]
    unsafe fn read(scratch: *mut u8) -> Self {
        let header = scratch.cast::<SampleHeader>();
        // SAFETY: the fields lie inside the header the caller vouches for.
        unsafe {
            Self {
                kernel_stack_len: core::ptr::addr_of!((*header).kernel_stack_len).read_volatile(),
                user_stack_len: core::ptr::addr_of!((*header).user_stack_len).read_volatile(),
                tail_len: core::ptr::addr_of!((*header).tail_len).read_volatile(),
            }
        }
    }
}

/// What identifies a sample, the same in every kind of record, and how much
/// of its user stack a copy reads.
struct SampleIds {
    tgid: u32,
    tid: u32,
    cpu: u32,
    cgroup_id: u64,
    sampling_divisor: u32,
    /// The thread's stack top (`STACK_TOPS`, see [`look_up_top`]); 0 when
    /// it has none (or no user registers).
    stack_top: u64,
    /// Bytes a usual or direct copy reads from `rsp` (the plan's, the
    /// process's, or the ceiling, and at most up to the stack top).
    copy_limit: u32,
    /// When the sample was taken (`bpf_ktime_get_ns`): an off-CPU
    /// sample's switch-in record names it by this time, and the agent
    /// pairs a Python stack with its sample by it.
    ktime_ns: u64,
    /// [`SampleHeader::process_start_ns`], read once for the sample and
    /// its Python stack.
    process_start_ns: u64,
    /// Bytes of the Python stack record written for the sample (0: none).
    python_bytes: u32,
}

impl SampleIds {
    /// Ring buffer flags for the sample's record of `len` bytes, written
    /// when `unread` bytes were: as [`wakeup_flag`], the sample's Python
    /// stack record (written before it without a decision of its own)
    /// counted with it. Its look comes after the Python record, so records
    /// that CPUs sharing the ring write in between can hide a crossing of
    /// the mark from both ticks: that wake-up then waits for twice the mark
    /// or the timed drain, as a crossing that two CPUs' ticks both miss
    /// always did.
    #[inline(always)]
    fn wakeup_flag(&self, unread: u64, len: u64) -> u64 {
        let python = u64::from(self.python_bytes);
        wakeup_flag(unread.saturating_sub(python), len + python)
    }

    /// Writes a sample's header field by field where it goes (a scratch
    /// slot or a reservation), the comm straight from the task: a header
    /// built on the stack first took 104 of the 512 bytes a chain of calls
    /// may use on Linux 6.1.
    ///
    /// # Safety
    /// `dest` must be 8-aligned with room for a header.
    #[inline(always)]
    unsafe fn write_header(
        &self,
        dest: *mut u8,
        flags: u32,
        kernel_stack_len: u32,
        user_stack_len: u32,
        user_regs: Option<&UserRegs>,
    ) {
        let h = dest.cast::<SampleHeader>();
        // SAFETY: every field lies inside the header the caller vouches
        // for; `write_current_comm` writes COMM_LEN bytes into `comm`.
        unsafe {
            (*h).kind = RecordKind::Sample as u32;
            (*h).flags = flags;
            (*h).tgid = self.tgid;
            (*h).tid = self.tid;
            (*h).cpu = self.cpu;
            (*h).kernel_stack_len = kernel_stack_len;
            (*h).user_stack_len = user_stack_len;
            (*h).sampling_divisor = self.sampling_divisor;
            (*h).ktime_ns = self.ktime_ns;
            (*h).cgroup_id = self.cgroup_id;
            (*h).user_rip = user_regs.map_or(0, |r| r.rip);
            (*h).user_rsp = user_regs.map_or(0, |r| r.rsp);
            (*h).user_rbp = user_regs.map_or(0, |r| r.rbp);
            write_current_comm(core::ptr::addr_of_mut!((*h).comm).cast());
            // Volatile, like the length word and the producer that follow
            // on the sample area's path: a store after the helper call
            // could otherwise sink below them, and the reader trusts a
            // record the producer has passed. (The helper call keeps the
            // stores before it in place.)
            core::ptr::addr_of_mut!((*h).tail_len).write_volatile(0);
            core::ptr::addr_of_mut!((*h).tail_spans).write_volatile(0);
            core::ptr::addr_of_mut!((*h).process_start_ns).write_volatile(self.process_start_ns);
        }
    }
}

/// Writes the current thread's name (`comm`, `COMM_LEN` bytes) to `dest`,
/// read straight from its task with the fault-tolerant kernel probe: the
/// helper every tick has just run for its process's start time, so its
/// code is still in the cache. `bpf_get_current_comm`, a helper of its
/// own, cost a tick in cold caches about twice as much (see the README).
/// `comm` always ends in a NUL; the agent reads up to it and zeroes what
/// follows (see `Sample::decode`). Without the offset, the helper reads it.
///
/// Both zero the buffer themselves when they fail. Zeroing it here too
/// took a byte-by-byte `memset` the verifier followed at each of the 30
/// places a header is written: 7,400 of the instructions it checked.
///
/// # Safety
/// `dest` must have room for `COMM_LEN` bytes.
#[inline(always)]
unsafe fn write_current_comm(dest: *mut u8) {
    let offset = TASK_COMM_OFFSET.load();
    // SAFETY: both write at most COMM_LEN bytes to `dest` (the caller's);
    // the probe reads kernel memory fault-tolerantly: a wrong offset yields
    // a wrong name, never a crash.
    unsafe {
        if offset == 0 {
            gen_get_current_comm(dest.cast(), COMM_LEN as u32);
        } else {
            let task = bpf_get_current_task() as *const u8;
            gen_probe_read_kernel(
                dest.cast(),
                COMM_LEN as u32,
                task.add(offset as usize).cast(),
            );
        }
    }
}

/// Writes the kernel stack of a tick in kernel mode to `dest` (room for
/// `MAX_KERNEL_STACK_BYTES`) and returns its length; flags a failure.
///
/// # Safety
/// `dest` must have room for `MAX_KERNEL_STACK_BYTES`.
#[inline(always)]
unsafe fn kernel_stack<C: EbpfContext>(ctx: &C, dest: *mut u8, flags: &mut u32) -> u32 {
    let ret = unsafe { bpf_get_stack(ctx.as_ptr(), dest.cast(), MAX_KERNEL_STACK_BYTES as u32, 0) };
    if ret < 0 {
        *flags |= sample_flags::KERNEL_STACK_FAILED;
        0
    } else {
        (ret as u32).min(MAX_KERNEL_STACK_BYTES as u32) & !7
    }
}

/// Ring buffer flags for a record of `len` bytes written when `unread`
/// bytes were (taken before the record is output, or after its
/// reservation less the reservation: a reservation counts as unread at
/// once). Waking the reader on
/// every record costs an irq_work self-interrupt per tick (about 1.5 us
/// under virtualisation, most of the program's cost), so records go in
/// silently until a batch is pending; the reader also drains on a timer,
/// which covers low sample rates.
///
/// The record that takes the unread bytes past `WAKEUP_BYTES` wakes the
/// reader; the records after it, written while the woken reader waits for
/// a CPU, do not (each would pay the self-interrupt again for a wake-up
/// already on its way), until twice the mark is unread: two CPUs sharing
/// a ring can pass the mark together with neither seeing itself cross it.
#[inline(always)]
fn wakeup_flag(unread: u64, len: u64) -> u64 {
    wakeup_flag_at(WAKEUP_BYTES.load(), unread, len)
}

/// [`wakeup_flag`] with its mark at `mark` unread bytes.
#[inline(always)]
fn wakeup_flag_at(mark: u64, unread: u64, len: u64) -> u64 {
    let after = unread + len;
    u64::from(if (unread < mark && after >= mark) || after >= 2 * mark {
        BPF_RB_FORCE_WAKEUP
    } else {
        BPF_RB_NO_WAKEUP
    })
}

/// What a reservation of `size` bytes takes of a ring buffer: the
/// kernel's 8-byte record header, and the whole rounded up to 8 bytes.
#[inline(always)]
const fn ring_record_bytes(size: u64) -> u64 {
    (size + 8).next_multiple_of(8)
}

/// Bytes written to `ring` and not yet consumed.
#[inline(always)]
fn unread_bytes(ring: &SampleRing) -> u64 {
    let map = core::ptr::from_ref(ring).cast_mut().cast();
    // SAFETY: `ring` is a ring buffer map the outer map's lookup returned.
    unsafe { bpf_ringbuf_query(map, u64::from(BPF_RB_AVAIL_DATA)) }
}

/// Whether a tick of a thread the agent has not learned yet (no plan, and
/// no stack top: a thread whose walks reach the root within the usual copy
/// has one) that took the usual path (no copy to its thread pointer, see
/// `first_ticks_stack_end`) wakes the reader at once, so the thread is
/// learned within milliseconds instead of at the next timed drain:
/// - its program (by thread name, from the header in `scratch`) needed
///   deep copies: until the reader learns the thread, each of its ticks is
///   a truncated walk, and a timed drain comes only every half second, most
///   of a compiler process's life;
/// - or drains are paced (few records to read, up to 5 s apart) and its process `tgid`
///   has not woken the reader yet.
///
/// Either way at most once per `EARLY_WAKEUP_INTERVAL_NS` per CPU.
#[inline(always)]
fn early_wakeup(scratch: *mut u8, tgid: u32) -> bool {
    // SAFETY: the caller wrote the header to the slot; a map value may be
    // a lookup key.
    let comm = unsafe { &*core::ptr::addr_of!((*scratch.cast::<SampleHeader>()).comm) };
    let deep_program = DEEP_STACK_BYTES.load() != 0 && unsafe { DEEP_PROGRAMS.get(comm) }.is_some();
    let new_process = !deep_program
        && PACED_DRAINS.get(0).is_some_and(|&paced| paced != 0)
        && unsafe { NEW_PROCESS_WAKEUPS.get(tgid) }.is_none();
    if !deep_program && !new_process {
        return false;
    }
    let Some(last) = EARLY_WAKEUPS.get_ptr_mut(0) else {
        return false;
    };
    let now = unsafe { bpf_ktime_get_ns() };
    // SAFETY: this CPU's slot; the program does not nest on a CPU.
    unsafe {
        if now.wrapping_sub(*last) < EARLY_WAKEUP_INTERVAL_NS {
            return false;
        }
        *last = now;
    }
    // A full map evicts its oldest entry: that process may wake the reader
    // once more.
    if new_process && NEW_PROCESS_WAKEUPS.insert(tgid, 1, 0).is_err() {
        return false;
    }
    count(Counter::EarlyWakeups);
    true
}

/// Where a deep copy of a thread the agent has not learned yet (no plan, no
/// stack top) ends, or 0 for none. A thread deeper than the usual copy
/// would otherwise spend its first ticks truncated until the agent learns
/// its stack (half a second at the timed drain): most of a compiler run's
/// life, and every deep program's first ticks after the agent starts.
/// Where that end lies is known without learning it:
/// - glibc and musl keep a thread's descriptor, which the thread pointer
///   (`fs_base`) points at, right above the thread's stack (its static TLS
///   in between);
/// - a main thread's outermost frame lies below where the kernel put
///   `argc` at exec (`mm->start_stack`); its thread pointer is elsewhere,
///   in the mappings.
///
/// A copy from `rsp` up to that end holds every frame. Only an end above
/// `rsp` by more than the usual copy and within the deep size is taken
/// (see `deep_copy_end`), so a shallow thread never pays for it; whatever
/// the guess (a Go thread's
/// pointer is on its heap), the walk uses only the bytes read at this tick,
/// and the agent ends these copies once it has seen the thread's walks (a
/// stack top, a tail or a deep plan).
///
/// Not inlined: its locals stay out of the entry's frame (see
/// `usual_sample`).
#[inline(never)]
fn first_ticks_stack_end(rsp: u64, main_thread: bool) -> u64 {
    let end = if main_thread {
        process_stack_start()
    } else {
        thread_pointer()
    };
    deep_copy_end(rsp, end)
}

/// `end` if a deep copy from `rsp` to it is worth taking, else 0: only
/// above `rsp` by more than the usual copy (a stack the usual copy holds
/// costs less that way: a deep record reserves a whole class in the ring,
/// with room for a kernel stack) and within the deep size.
#[inline(always)]
fn deep_copy_end(rsp: u64, end: u64) -> u64 {
    let usual = u64::from(USER_STACK_BYTES.load().min(MAX_USER_STACK_BYTES));
    let limit = u64::from(DEEP_STACK_BYTES.load().min(MAX_DEEP_STACK_BYTES));
    match end.checked_sub(rsp) {
        Some(len) if len > usual && len <= limit => end,
        _ => 0,
    }
}

/// The current thread's user thread pointer, or 0 when unknown.
#[inline(always)]
fn thread_pointer() -> u64 {
    let offset = TASK_FSBASE_OFFSET.load();
    if offset == 0 {
        return 0;
    }
    // SAFETY: read through the fault-tolerant kernel probe; a wrong offset
    // yields a wrong address, which the caller's range check or the copy
    // refuses.
    unsafe {
        let task = bpf_get_current_task() as *const u8;
        bpf_probe_read_kernel(task.add(offset as usize).cast::<u64>()).unwrap_or(0)
    }
}

/// A deep copy (see the module doc): reserves a record of the smallest deep
/// class that holds the stack from `rsp` to `stack_end` (at most the
/// configured size), writes the kernel stack and then that stack with one
/// read, and submits it. False, with nothing written, when there is no
/// room or the read faults (the thread runs on another stack than the one
/// learned, the plan is stale, or a page of the stack was never touched):
/// the tick then takes the usual path.
///
/// Not inlined: a BPF-to-BPF call keeps the verifier's view of the usual
/// path (which then uses the same plan pointer) as simple as it was.
#[inline(never)]
fn deep_sample<C: EbpfContext>(
    ctx: &C,
    ids: &SampleIds,
    flags: u32,
    regs: UserRegs,
    stack_end: u64,
) -> bool {
    let limit = DEEP_STACK_BYTES.load().min(MAX_DEEP_STACK_BYTES);
    if regs.rsp >= stack_end {
        return false;
    }
    let len = (stack_end - regs.rsp).min(u64::from(limit)) as u32;
    // Classes above the configured size are never taken (the verifier,
    // which sees that size, skips them).
    in_smallest_class!(len, DEEP_COPY_CLASSES, [0, 1, 2, 3, 4, 5, 6, 7], |CLASS| {
        reserved_copy::<C, CLASS, true, true>(ctx, ids, flags, regs, len)
    })
}

/// A deep or a direct record of class `BYTES` (see [`deep_sample`] and
/// [`direct_sample`]): reserves it, with room for a kernel stack when
/// `KERNEL_ROOM` (written if the tick hit kernel mode), reads `len` bytes
/// of user stack from `rsp` after it in one helper call, writes the header
/// and submits it. False, with nothing written, when `len` is 0 or past
/// the class, there is no room, or the read faults.
#[inline(always)]
fn reserved_copy<C: EbpfContext, const BYTES: u32, const KERNEL_ROOM: bool, const DEEP: bool>(
    ctx: &C,
    ids: &SampleIds,
    mut flags: u32,
    regs: UserRegs,
    len: u32,
) -> bool {
    let size = reserved_record_bytes(BYTES, KERNEL_ROOM) as usize;
    // Checked on a value LLVM cannot see through: the class match implies
    // it, and the verifier needs the check itself.
    let len = opaque(len);
    if len == 0 || len > BYTES {
        return false;
    }
    let Some(ring) = (if DEEP { deep_ring() } else { sample_ring() }) else {
        return false;
    };
    // No room is not a lost record: the usual path may still fit one.
    let Some(mut entry) = ring.reserve_bytes(size, 0) else {
        return false;
    };
    let record = entry.as_mut_ptr();
    // SAFETY: the reservation has room for the header, the kernel stack
    // and the class (reserved_record_bytes).
    let stacks = unsafe { read_stacks::<C, KERNEL_ROOM>(ctx, record, &mut flags, regs.rsp, len) };
    let (kernel_stack_len, offset) = (stacks.kernel_stack_len, stacks.offset);
    let mut len = len;
    if !stacks.read {
        // A deep copy's one read fails whole on any page it cannot read:
        // read it again page by page around those (see `paged_copy`).
        // SAFETY: `offset` is where the user stack goes in the record.
        let paged = if DEEP {
            unsafe { paged_copy::<BYTES>(record.add(offset), regs.rsp, len) }
        } else {
            None
        };
        let Some(read) = paged else {
            entry.discard(u64::from(BPF_RB_NO_WAKEUP));
            return false;
        };
        if read.holes > 0 {
            flags |= sample_flags::COPY_HOLES;
        }
        len = read.len;
    }
    let kind = if DEEP {
        sample_flags::DEEP_COPY
    } else {
        sample_flags::DIRECT_COPY
    };
    // SAFETY: the reservation is 8-aligned and larger than the header.
    unsafe { ids.write_header(record, flags | kind, kernel_stack_len, len, Some(&regs)) };
    // Looked at after the reserve, which read the same positions: before
    // it, at 19 Hz, the look met them cold, and the two together cost
    // 0.2 us more here. The reservation is unread already.
    let unread = unread_bytes(ring).saturating_sub(ring_record_bytes(size as u64));
    // A deep record's look was at the deep ring, so it decides for itself
    // alone; the tick's Python stack record, in the CPU's ring, waits for
    // that ring's next record past twice the mark, or the timed drain.
    entry.submit(if DEEP {
        wakeup_flag(unread, size as u64)
    } else {
        ids.wakeup_flag(unread, size as u64)
    });
    true
}

/// Where [`read_stacks`] put a record's stacks.
struct StacksRead {
    kernel_stack_len: u32,
    /// Where the user stack starts in the record.
    offset: usize,
    /// Whether the user stack could be read (in one read).
    read: bool,
}

/// Writes the kernel stack after the header at `record` (when
/// `KERNEL_ROOM` and the tick hit kernel mode; a failure is flagged in
/// `flags`), then reads `len` bytes of user stack from `rsp` after it, in
/// one helper call: a direct or deep record's stacks.
///
/// # Safety
/// `record` must have room for the header, `KERNEL_STACK_MASK + 1` bytes
/// of kernel stack when `KERNEL_ROOM`, and `len` bytes.
#[inline(always)]
unsafe fn read_stacks<C: EbpfContext, const KERNEL_ROOM: bool>(
    ctx: &C,
    record: *mut u8,
    flags: &mut u32,
    rsp: u64,
    len: u32,
) -> StacksRead {
    let mut kernel_stack_len = 0;
    if KERNEL_ROOM && *flags & sample_flags::TICK_IN_USER == 0 {
        // SAFETY: room for the kernel stack after the header (the caller's).
        kernel_stack_len = unsafe { kernel_stack(ctx, record.add(SAMPLE_HEADER_SIZE), flags) };
    }
    let offset = SAMPLE_HEADER_SIZE + (u64::from(kernel_stack_len) & KERNEL_STACK_MASK) as usize;
    // SAFETY: offset + len fit the record (the caller's); the source is
    // user memory read with the fault-tolerant helper.
    let ret = unsafe {
        bpf_probe_read_user(
            record.add(offset).cast::<c_void>(),
            len,
            rsp as *const c_void,
        )
    };
    StacksRead {
        kernel_stack_len,
        offset,
        read: ret >= 0,
    }
}

/// What [`paged_copy`]'s steps read, and where they are: the same at
/// every step.
struct PagedCopy {
    /// Where the user stack goes in the reservation.
    dst: *mut u8,
    rsp: u64,
    len: u32,
    /// This CPU's `PAGED_COPY` slot: bytes done so far (read or not), and
    /// pages (or parts) that could not be read (the helper zeroed them).
    progress: *mut [u32; 2],
}

/// How a paged copy ended: `len` bytes from `rsp` (a page at the class's
/// very end may be left out), `holes` of their pages zeros.
struct PagedRead {
    len: u32,
    holes: u32,
}

/// Reads `len` bytes of user stack from `rsp` into `dst` (a class-`BYTES`
/// deep record's stack area) page by page, each page that cannot be read
/// left zeroed (pages inside the live stack that the thread never touched
/// are not present, and the fault-tolerant read cannot bring them in).
/// `None` when `rsp`'s own page cannot be read: the walk would have
/// nothing. Through `bpf_loop`, so the verifier checks one step, not 513.
///
/// # Safety
/// `dst` must have room for `BYTES` bytes.
#[inline(always)]
unsafe fn paged_copy<const BYTES: u32>(dst: *mut u8, rsp: u64, len: u32) -> Option<PagedRead> {
    let progress = PAGED_COPY.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot; the program does not nest on a CPU.
    unsafe { progress.write_volatile([0, 0]) };
    let mut copy = PagedCopy {
        dst,
        rsp,
        len,
        progress,
    };
    // SAFETY: the callback is a function of the program; `copy` outlives
    // the call.
    unsafe {
        bpf_loop(
            MAX_DEEP_STACK_BYTES / PAGE_SIZE + 1,
            paged_copy_step::<BYTES> as *mut c_void,
            core::ptr::addr_of_mut!(copy).cast(),
            0,
        )
    };
    // SAFETY: as above.
    let [done, holes] = unsafe { progress.read_volatile() };
    // The first page read: a step that fails there stops with nothing done.
    (done > 0).then_some(PagedRead { len: done, holes })
}

/// One page of [`paged_copy`]: 0 to go on, 1 to stop.
extern "C" fn paged_copy_step<const BYTES: u32>(_index: u32, copy: *mut c_void) -> i64 {
    // SAFETY: `paged_copy` passes its `PagedCopy`.
    let copy = unsafe { &*copy.cast::<PagedCopy>() };
    // SAFETY: `paged_copy`'s slot of this CPU.
    let [done, holes] = unsafe { copy.progress.read_volatile() };
    if done >= copy.len {
        return 1;
    }
    let addr = copy.rsp + u64::from(done);
    let to_page_end = PAGE_SIZE - (addr as u32 & (PAGE_SIZE - 1));
    // Bounds the verifier can use, as in `copy_user_stack`: at most a
    // page, at most `BYTES` in all (a class is a power of two). The last
    // page of a copy that ends within a page of its class's end is left
    // out: the verifier cannot relate the two bounds.
    let chunk = opaque(to_page_end.min(copy.len - done)) & (2 * PAGE_SIZE - 1);
    let at = opaque(done) & (BYTES - 1);
    if chunk == 0 || chunk > PAGE_SIZE || at > BYTES - PAGE_SIZE {
        return 1;
    }
    // SAFETY: at + chunk <= BYTES, the room `dst` has; the source is user
    // memory read with the fault-tolerant helper, which zeroes the
    // destination when it fails.
    let ret = unsafe {
        bpf_probe_read_user(
            copy.dst.add(at as usize).cast::<c_void>(),
            chunk,
            addr as *const c_void,
        )
    };
    let holes = if ret < 0 {
        if done == 0 {
            return 1;
        }
        holes + 1
    } else {
        holes
    };
    // SAFETY: as above.
    unsafe { copy.progress.write_volatile([done + chunk, holes]) };
    0
}

/// Writes the CPython frames of the current thread as a Python stack
/// record, when the agent described its process (`PYTHON_PROCESSES`) and
/// the thread has a thread state. Written before the tick's sample record,
/// from the same CPU, so the reader meets it first.
///
/// Frames are read by windows of the thread's data stack (see
/// [`PYTHON_WINDOW_BYTES`]), others alone; each frame carries a
/// fingerprint of its code object (the agent's check that the object it
/// names later is the one that ran): its size where the frame it called
/// shows it, else the object's first line, one more read. Not inlined: its
/// locals stay out of the entry's frame.
#[inline(never)]
fn python_stack(ids: &mut SampleIds) {
    // SAFETY: read only; the agent replaces entries whole.
    let Some(process) = (unsafe { PYTHON_PROCESSES.get(ids.tgid) }) else {
        return;
    };
    if process.process_start_ns != ids.process_start_ns {
        return;
    }
    let Some(scratch) = PYTHON_SCRATCH.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: this CPU's slot; the program does not nest on a CPU.
    let Some(frame) = (unsafe { top_python_frame(process, scratch, ids) }) else {
        return;
    };
    // SAFETY: this CPU's slot; the program does not nest on a CPU.
    // Volatile: LLVM would merge the stores into a call of `memset`, one
    // more level of calls, whose frame Linux 6.1 counts (with the entry's
    // and this one's, past the 512 bytes a chain of calls may use).
    unsafe {
        core::ptr::addr_of_mut!((*scratch).next).write_volatile(frame);
        core::ptr::addr_of_mut!((*scratch).frames).write_volatile(0);
        core::ptr::addr_of_mut!((*scratch).flags).write_volatile(0);
        core::ptr::addr_of_mut!((*scratch).last_code).write_volatile(0);
        core::ptr::addr_of_mut!((*scratch).window_frame_starts).write_volatile(0);
        core::ptr::addr_of_mut!((*scratch).inner_frame).write_volatile(0);
    }
    // `bpf_loop`, not a bounded loop: the verifier checks the callback
    // until its states repeat, where it followed a bounded loop's every
    // iteration (each way through the body 128 times over).
    let mut walk = PythonWalk { scratch, process };
    // SAFETY: the callback is a function of the program; `walk` outlives
    // the call.
    unsafe {
        bpf_loop(
            (MAX_PYTHON_FRAMES / PYTHON_FRAMES_PER_STEP) as u32,
            python_walk_step as *mut c_void,
            core::ptr::addr_of_mut!(walk).cast(),
            0,
        )
    };
    // SAFETY: as above; read back through memory, as in the loop.
    let (frames, mut flags, next) = unsafe {
        (
            core::ptr::addr_of!((*scratch).frames).read_volatile() as usize,
            core::ptr::addr_of!((*scratch).flags).read_volatile(),
            core::ptr::addr_of!((*scratch).next).read_volatile(),
        )
    };
    if next != 0 && flags & python_stack_flags::READ_FAILED == 0 {
        flags |= python_stack_flags::TRUNCATED;
    }
    if frames == 0 && flags == 0 {
        return;
    }
    let frames = frames.min(MAX_PYTHON_FRAMES);
    // SAFETY: the record is this CPU's slot's.
    let record = unsafe { (*scratch).record.as_mut_ptr() };
    // SAFETY: the header lies at the start of the record.
    unsafe {
        record
            .cast::<PythonStackHeader>()
            .write_unaligned(PythonStackHeader {
                kind: RecordKind::PythonStack as u32,
                cpu: ids.cpu,
                tgid: ids.tgid,
                tid: ids.tid,
                frames: frames as u32,
                flags,
                ktime_ns: ids.ktime_ns,
            })
    };
    let len = PYTHON_STACK_HEADER_SIZE + frames * size_of::<PythonFrame>();
    // SAFETY: the first `len` bytes of the record were written above.
    let bytes = unsafe { core::slice::from_raw_parts(record, len) };
    // The sample's record, right after, decides whether to wake the
    // reader for both (`SampleIds::wakeup_flag`; a deep one, in the deep
    // ring, for itself): one look at the reader's position a tick, not
    // two (each reads a line the reader writes).
    let written = sample_ring().is_some_and(|ring| {
        ring.output_untyped::<[u8]>(bytes, u64::from(BPF_RB_NO_WAKEUP))
            .is_ok()
    });
    if !written {
        count_lost_record();
    } else {
        ids.python_bytes = len as u32;
    }
}

/// What each step of a Python walk needs (see [`python_walk_step`]).
struct PythonWalk {
    scratch: *mut PythonScratch,
    process: *const PythonProcess,
}

/// Frames read by one step of the walk. A step is a call, and its return
/// goes through the kernel's return thunk (a mitigation of speculative
/// returns, on AMD's Zen): two frames a step took the walk of 30 frames
/// from 940-1,000 to 830-890 ns (python3.11, `bench sampler`'s fixture,
/// timed with `bpf_ktime_get_ns` around the walk in a throw-away build),
/// for 2,500 more instructions verified (57,001 in all).
const PYTHON_FRAMES_PER_STEP: usize = 2;
const _: () = assert!(MAX_PYTHON_FRAMES.is_multiple_of(PYTHON_FRAMES_PER_STEP));

/// One step of `bpf_loop`'s walk ([`PYTHON_FRAMES_PER_STEP`] frames): 0
/// to go on, 1 to stop.
extern "C" fn python_walk_step(_index: u32, walk: *mut c_void) -> i64 {
    // SAFETY: `python_stack` passes its `PythonWalk`, whose scratch slot
    // is this CPU's and whose process entry stays alive for the call.
    let more = unsafe {
        let walk = &*walk.cast::<PythonWalk>();
        let process = &*walk.process;
        // Unrolled: a constant count.
        (0..PYTHON_FRAMES_PER_STEP).all(|_| python_frame(walk.scratch, process))
    };
    if more { 0 } else { 1 }
}

/// Reads the next window of the thread's frame stack (see
/// [`PYTHON_WINDOW_BYTES`]): the bytes of the frame at `frame` and below
/// it down to the start of its page, at most a window's. Returns the
/// frame's offset in the window; None when no window could be read.
///
/// # Safety
/// `scratch` must be this CPU's `PYTHON_SCRATCH` slot.
#[inline(always)]
unsafe fn python_window(scratch: *mut PythonScratch, frame: u64, frame_bytes: u32) -> Option<u64> {
    let end = frame.checked_add(u64::from(frame_bytes))?;
    // Not below the frame's page: the page before may not be mapped (the
    // start of a data stack chunk), and a read that faults costs more
    // than a few reads that do not.
    let start = end
        .wrapping_sub(PYTHON_WINDOW_BYTES as u64)
        .max(frame & !(PAGE_SIZE as u64 - 1));
    let len = end.wrapping_sub(start);
    if len < u64::from(frame_bytes) || len > PYTHON_WINDOW_BYTES as u64 {
        return None;
    }
    // SAFETY: reads into the slot's window, which has room for the masked
    // length; a bad address only fails the read.
    let failed = unsafe {
        bpf_probe_read_user(
            (*scratch).window.as_mut_ptr().cast(),
            // 1 to PYTHON_WINDOW_BYTES, as the verifier sees it too.
            ((len as u32 - 1) & (PYTHON_WINDOW_BYTES as u32 - 1)) + 1,
            start as *const c_void,
        )
    } != 0;
    if failed {
        return None;
    }
    let frame_at = len - u64::from(frame_bytes);
    unsafe {
        core::ptr::addr_of_mut!((*scratch).window_start).write_volatile(start);
        core::ptr::addr_of_mut!((*scratch).window_frame_starts).write_volatile(frame_at + 1);
    }
    Some(frame_at)
}

/// Reads the frame at `scratch.next` into the record (or, for a shim
/// frame, marks the one before it as the entry) and moves `next` to the
/// frame's caller. False when the walk is over: no frame left, a read
/// failed, or the record is full.
///
/// The walk's state lives in the scratch slot, not in registers: the
/// verifier then sees every step start alike (unknown counts and
/// addresses), so the states of `bpf_loop`'s callback repeat at once.
///
/// # Safety
/// `scratch` must be this CPU's `PYTHON_SCRATCH` slot.
#[inline(always)]
unsafe fn python_frame(scratch: *mut PythonScratch, process: &PythonProcess) -> bool {
    let (frame, frames) = unsafe {
        (
            core::ptr::addr_of!((*scratch).next).read_volatile(),
            core::ptr::addr_of!((*scratch).frames).read_volatile() as usize,
        )
    };
    if frame == 0 || frames >= MAX_PYTHON_FRAMES {
        return false;
    }
    let frame_bytes = layout(&process.frame_bytes) & PYTHON_FRAME_MASK;
    // A frame inside the window is read from it; another starts a window
    // of its own; 3.10's frame objects (each allocated apart), or a frame
    // no window holds, are read alone.
    let in_window = unsafe {
        let at = frame.wrapping_sub(core::ptr::addr_of!((*scratch).window_start).read_volatile());
        (at < core::ptr::addr_of!((*scratch).window_frame_starts).read_volatile()).then_some(at)
    }
    .or_else(|| {
        if layout(&process.frame_objects) != 0 {
            return None;
        }
        // SAFETY: as for the walk.
        unsafe { python_window(scratch, frame, frame_bytes) }
    });
    let buffer = if let Some(at) = in_window {
        // SAFETY: the mask keeps the offset inside the window, which has
        // room past it for any field's read.
        unsafe {
            (*scratch)
                .window
                .as_mut_ptr()
                .add(at as usize & (PYTHON_WINDOW_BYTES - 1))
        }
    } else {
        let buffer = unsafe { (*scratch).frame.as_mut_ptr() };
        // SAFETY: reads into the slot's frame buffer, which has room for
        // any size the mask lets through; a bad address only fails the
        // read.
        let failed =
            unsafe { bpf_probe_read_user(buffer.cast(), frame_bytes, frame as *const c_void) } != 0;
        if failed {
            unsafe { (*scratch).flags |= python_stack_flags::READ_FAILED };
            return false;
        }
        buffer
    };
    // SAFETY: offsets are masked into the buffer. The layout's fields are
    // read here, each time (volatile): hoisted out of the loop, LLVM kept
    // them all on the stack, and the program's calls together went past
    // the 512 bytes Linux 6.1 allows them.
    let (code, previous, instr, marker, owner) = unsafe {
        (
            frame_field::<u64>(buffer, layout(&process.frame_code)) & !PYTHON_CODE_TAG_BITS,
            frame_field::<u64>(buffer, layout(&process.frame_previous)),
            frame_field::<u64>(buffer, layout(&process.frame_instr)),
            frame_field::<u8>(buffer, layout(&process.frame_entry)),
            frame_field::<u8>(buffer, layout(&process.frame_owner)),
        )
    };
    unsafe { (*scratch).next = previous };
    let frames_at = unsafe { (*scratch).record.as_mut_ptr().add(PYTHON_STACK_HEADER_SIZE) }
        .cast::<PythonFrame>();
    let frame_objects = layout(&process.frame_objects) != 0;
    let entry = frame_objects || u32::from(marker) == layout(&process.entry_value);
    if entry && !frame_objects && layout(&process.entry_is_shim) != 0 {
        // The shim between C and the frame it called: that frame, the last
        // one written, is the entry.
        if let Some(last) = frames.checked_sub(1) {
            // SAFETY: the mask keeps the index inside the record's frames.
            unsafe {
                let first_line = core::ptr::addr_of_mut!(
                    (*frames_at.add(last & (MAX_PYTHON_FRAMES - 1))).first_line
                );
                first_line.write(first_line.read() | PythonFrame::ENTRY);
            }
        }
        return true;
    }
    // A frame in the data stack is followed there by the frame it called
    // (frames are pushed on top, and the caller was the top): the
    // distance is its size, which its code object fixes. Not when the
    // frame it called starts a chunk of the data stack (its first frame
    // lies 24 bytes into a page, 32 in a thread's first chunk), which can
    // be anywhere; nor for the innermost frame or a generator's (outside
    // the data stack): their code object's first line is read.
    let in_stack = layout(&process.frame_sizes) != 0 && owner == 0;
    // SAFETY: the slot is this CPU's.
    let inner = unsafe { core::ptr::addr_of!((*scratch).inner_frame).read_volatile() };
    let size = inner.wrapping_sub(frame);
    let starts_chunk = matches!(
        inner & 4095,
        PYTHON_CHUNK_FIRST_FRAME | PYTHON_ROOT_CHUNK_FIRST_FRAME
    );
    // Whole words, at least one: `size - 8` wraps for a size of 0.
    let fingerprint = if in_stack
        && !starts_chunk
        && size.wrapping_sub(8) <= PYTHON_MAX_FRAME_BYTES - 8
        && size % 8 == 0
    {
        (size / 8) as u32 | PythonFrame::FRAME_SIZE
    } else {
        // SAFETY: the slot is this CPU's.
        unsafe {
            if code != 0 && code == core::ptr::addr_of!((*scratch).last_code).read_volatile() {
                core::ptr::addr_of!((*scratch).last_first_line).read_volatile()
            } else {
                let first_line =
                    user_value::<u32>(code + u64::from(layout(&process.code_first_line)))
                        .unwrap_or(0)
                        & !(PythonFrame::ENTRY | PythonFrame::FRAME_SIZE);
                (*scratch).last_code = code;
                (*scratch).last_first_line = first_line;
                first_line
            }
        }
    };
    if in_stack {
        // SAFETY: the slot is this CPU's.
        unsafe { core::ptr::addr_of_mut!((*scratch).inner_frame).write_volatile(frame) };
    }
    let offset = if frame_objects {
        // `f_lasti`: the low half of the word read (the high one is
        // `f_lineno`), -1 before the first instruction.
        i64::from(instr as u32 as i32) * 2
    } else {
        instr.wrapping_sub(code + u64::from(layout(&process.code_bytecode))) as i64
    };
    let instr_offset = i32::try_from(offset).unwrap_or(PythonFrame::NO_OFFSET);
    // SAFETY: the mask keeps the index inside the record's frames.
    unsafe {
        frames_at
            .add(frames & (MAX_PYTHON_FRAMES - 1))
            .write(PythonFrame {
                code,
                instr_offset,
                first_line: fingerprint | if entry { PythonFrame::ENTRY } else { 0 },
            });
        (*scratch).frames = frames as u32 + 1;
    }
    true
}

/// The innermost `_PyInterpreterFrame` of the current thread (0: none
/// running), through its thread state; None when the thread has none.
///
/// # Safety
/// `scratch` must be this CPU's `PYTHON_SCRATCH` slot.
#[inline(always)]
unsafe fn top_python_frame(
    process: &PythonProcess,
    scratch: *mut PythonScratch,
    ids: &SampleIds,
) -> Option<u64> {
    let slot = unsafe { thread_state_slot(process, scratch, ids) }?;
    let frame = frame_through_slot(process, slot);
    if frame.is_none() {
        // No thread state there, or a read through it failed: the slot
        // is forgotten (no thread has id 0) and found again on the next
        // tick, as it may be a former interpreter's (see
        // `thread_state_slot`).
        // SAFETY: the caller's slot.
        unsafe { (*scratch).slot_tid = 0 };
    }
    frame
}

/// The innermost frame through the thread state in `slot` (0: none
/// running); None when the slot holds no thread state or a read fails.
#[inline(always)]
fn frame_through_slot(process: &PythonProcess, slot: u64) -> Option<u64> {
    let tstate = user_value::<u64>(slot)?;
    if tstate == 0 {
        return None;
    }
    let frame = user_value::<u64>(tstate + u64::from(process.tstate_frame))?;
    if process.cframe_frame == PythonProcess::NO_CFRAME || frame == 0 {
        return Some(frame);
    }
    user_value::<u64>(frame + u64::from(process.cframe_frame))
}

/// Where the current thread keeps its thread state: its TSD entry for the
/// interpreter's key. Neither the thread pointer nor the key changes while
/// a thread runs one interpreter, so the slot of the thread this CPU ran
/// last is kept (two reads fewer, the key's a read of the process's
/// memory). It is known by its ids, its process's start (a reused pid is
/// not it) and where its interpreter's key lies. An exec keeps the ids
/// and the start and moves the thread pointer, and a position-independent
/// interpreter's key; a fixed-address one's key stays where it was, so a
/// slot that yields no thread state is forgotten too (see
/// `top_python_frame`).
///
/// # Safety
/// `scratch` must be this CPU's `PYTHON_SCRATCH` slot.
#[inline(always)]
unsafe fn thread_state_slot(
    process: &PythonProcess,
    scratch: *mut PythonScratch,
    ids: &SampleIds,
) -> Option<u64> {
    unsafe {
        if (*scratch).slot_tid == ids.tid
            && (*scratch).slot_tgid == ids.tgid
            && (*scratch).slot_process_start_ns == ids.process_start_ns
            && (*scratch).slot_key == process.tss_key
        {
            return Some((*scratch).slot);
        }
    }
    let fs_base = thread_pointer();
    if fs_base == 0 {
        return None;
    }
    let [initialized, key] = user_value::<[u32; 2]>(process.tss_key)?;
    // glibc's first-level keys only; the interpreter takes one of the first.
    if initialized == 0 || key >= 32 {
        return None;
    }
    let slot =
        fs_base + u64::from(process.tsd_base) + u64::from(process.tsd_stride) * u64::from(key);
    unsafe {
        (*scratch).slot_tgid = ids.tgid;
        (*scratch).slot_tid = ids.tid;
        (*scratch).slot_process_start_ns = ids.process_start_ns;
        (*scratch).slot_key = process.tss_key;
        (*scratch).slot = slot;
    }
    Some(slot)
}

/// The value at `addr` in the current process; None when the read faults.
#[inline(always)]
fn user_value<T>(addr: u64) -> Option<T> {
    // SAFETY: the fault-tolerant probe reads into a value of its own.
    unsafe { read_user_value(addr as *const T) }.ok()
}

/// A field of the process's layout (a map value), read where it is used
/// (see `python_frame`).
#[inline(always)]
fn layout(field: &u32) -> u32 {
    // SAFETY: a reference to a live map value's field.
    unsafe { core::ptr::read_volatile(field) }
}

/// A field at `offset` of the frame read into `buffer`. CPython's frame
/// fields are naturally aligned: the offset is taken down to a multiple of
/// the field's size, so the read is one aligned load.
///
/// # Safety
/// `buffer` must be a `PythonScratch::frame`, or lie in a
/// `PythonScratch::window` at most [`PYTHON_WINDOW_BYTES`] from its start.
#[inline(always)]
unsafe fn frame_field<T: Copy>(buffer: *const u8, offset: u32) -> T {
    let aligned = offset & PYTHON_FRAME_MASK & !(size_of::<T>() as u32 - 1);
    unsafe { buffer.add(aligned as usize).cast::<T>().read() }
}

/// When the current process's thread group leader started (its
/// `start_time`), or 0 when unknown. A process's main thread is its
/// leader (an exec by another thread makes that thread the leader, with
/// the leader's start time): its own field, one read instead of two
/// through `group_leader`, each about half a microsecond in a tick's cold
/// memory.
#[inline(always)]
fn process_start_ns(main_thread: bool) -> u64 {
    let start_time = TASK_START_TIME_OFFSET.load();
    if main_thread {
        if start_time == 0 || TASK_GROUP_LEADER_OFFSET.load() == 0 {
            return 0;
        }
        // SAFETY: the fault-tolerant kernel probe; a wrong offset yields a
        // wrong number, never a crash.
        return unsafe {
            let task = bpf_get_current_task() as *const u8;
            bpf_probe_read_kernel(task.add(start_time as usize).cast::<u64>()).unwrap_or(0)
        };
    }
    read_through_task(TASK_GROUP_LEADER_OFFSET.load(), start_time)
}

/// Where the current process's stack started at exec (`mm->start_stack`),
/// or 0 when unknown.
#[inline(always)]
fn process_stack_start() -> u64 {
    read_through_task(TASK_MM_OFFSET.load(), MM_START_STACK_OFFSET.load())
}

/// The word at byte `field` of the struct the current task points to at
/// byte `pointer` (its group leader, its mm), through offsets the agent
/// found in BTF; 0 when either is unknown (0), the pointer is null or a
/// read fails.
#[inline(always)]
fn read_through_task(pointer: u32, field: u32) -> u64 {
    if pointer == 0 || field == 0 {
        return 0;
    }
    // SAFETY: both reads go through the fault-tolerant kernel probe; a
    // wrong offset yields a wrong number, never a crash.
    unsafe {
        let task = bpf_get_current_task() as *const u8;
        let Ok(target) = bpf_probe_read_kernel(task.add(pointer as usize).cast::<*const u8>())
        else {
            return 0;
        };
        if target.is_null() {
            return 0;
        }
        bpf_probe_read_kernel(target.add(field as usize).cast::<u64>()).unwrap_or(0)
    }
}

/// The policy of the current task: the entries of its cgroup and of every
/// ancestor, from the root down. Selection adds up; the deepest budget wins.
#[inline(always)]
fn cgroup_policy(leaf: u64) -> CgroupPolicy {
    let mut policy = CgroupPolicy {
        flags: 0,
        divisor: 0,
    };
    let mut merge = |id: u64| {
        // SAFETY: the value is only read, and entries are plain integers.
        if let Some(entry) = unsafe { CGROUP_POLICY.get(id) } {
            policy.flags |= entry.flags;
            if entry.divisor != 0 {
                policy.divisor = entry.divisor;
            }
        }
    };
    let mut reached_leaf = false;
    for level in 0..MAX_CGROUP_DEPTH {
        // Level 0 is the root; a level below the task's own cgroup gives 0.
        let id = unsafe { bpf_get_current_ancestor_cgroup_id(level) };
        if id == 0 {
            break;
        }
        merge(id);
        if id == leaf {
            reached_leaf = true;
            break;
        }
    }
    if !reached_leaf {
        merge(leaf);
    }
    policy
}

/// `execve` replaced the current process's image.
///
/// What the agent learned of the old image's stack (its copy size, the
/// plan and stack top of the thread that is now the only one) does not hold
/// for the new image: it goes here, at the exec, rather than when the agent
/// reads this record and updates the maps a drain later. A rustup proxy
/// that execs rustc left its own 1.8 KB copy size and stale deep plan to the
/// compiler's first ticks, which then ran short.
#[raw_tracepoint(tracepoint = "sched_process_exec")]
pub fn on_process_exec(_ctx: RawTracePointContext) -> i32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    // After the exec the thread has the process's id (de_thread ran).
    let (tgid, tid) = ((pid_tgid >> 32) as u32, pid_tgid as u32);
    // Absent entries are the usual case, not an error.
    let _ = COPY_BYTES.remove(tgid);
    let _ = STACK_PLANS.remove(tid);
    remove_stack_top(tid);
    // Another program: its first tick may wake the reader again.
    let _ = NEW_PROCESS_WAKEUPS.remove(tgid);
    emit_process_event(RecordKind::Exec);
    0
}

/// A task exited. Only the thread group leader's exit is reported: that is
/// when the tgid can be reused. (A leader that exits before its threads is
/// rare; the agent re-reads the mappings of a tgid it still sees sampled.)
#[raw_tracepoint(tracepoint = "sched_process_exit")]
pub fn on_process_exit(_ctx: RawTracePointContext) -> i32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    // A thread whose switch-in was never seen leaves no entry behind (the
    // offset is set only with off-CPU sampling on).
    if TASK_PID_OFFSET.load() != 0 {
        let _ = OFF_CPU_PENDING.remove(pid_tgid as u32);
    }
    if pid_tgid >> 32 == pid_tgid & 0xffff_ffff {
        // A process that reuses the tgid is new: its first tick may wake
        // the reader.
        let _ = NEW_PROCESS_WAKEUPS.remove((pid_tgid >> 32) as u32);
        emit_process_event(RecordKind::Exit);
    }
    0
}

/// Task states (`prev_state`, from `include/linux/sched.h`): waiting for
/// an event (interruptible or not), and the last switch of an exiting task.
const TASK_INTERRUPTIBLE: u64 = 0x1;
const TASK_UNINTERRUPTIBLE: u64 = 0x2;
const TASK_DEAD: u64 = 0x80;

/// Off-CPU sampling, on `sched_switch` (with the agent's `--off-cpu`), as a
/// BTF tracepoint.
#[btf_tracepoint(function = "sched_switch")]
pub fn on_sched_switch(ctx: BtfTracePointContext) -> i32 {
    on_switch(&ctx);
    0
}

/// [`on_sched_switch`] as a raw tracepoint, for a kernel that will not
/// load the BTF one. Both get the tracepoint's arguments as `u64`s.
#[raw_tracepoint(tracepoint = "sched_switch")]
pub fn on_sched_switch_raw(ctx: RawTracePointContext) -> i32 {
    on_switch(&ctx);
    0
}

/// `sched_switch(bool preempt, struct task_struct *prev, struct
/// task_struct *next, unsigned int prev_state)` (Linux 5.18 and later),
/// run on `prev`, still current:
/// - `next`, when its off-CPU sample waits for it, gets its switch-in
///   record;
/// - `prev`, when it blocks (it leaves the CPU waiting for an event, not
///   preempted and not exiting) and the agent's filters select it, gets
///   an off-CPU sample, one in the divisor the rate and its cgroup's
///   budget set: the stacks it blocked with, through the same copies as a
///   tick's. A preempted thread is runnable, waiting for a CPU rather than
///   for an event: that is not off-CPU time here.
#[inline(always)]
fn on_switch<C: EbpfContext>(ctx: &C) {
    let args = ctx.as_ptr().cast::<u64>();
    // SAFETY: both kinds of tracepoint context are the arguments, one u64
    // each; sched_switch has four.
    let (preempt, next, prev_state) =
        unsafe { (*args & 0xff != 0, *args.add(2), *args.add(3) & 0xffff_ffff) };
    switched_in(next);
    if !preempt
        && prev_state & (TASK_INTERRUPTIBLE | TASK_UNINTERRUPTIBLE) != 0
        && prev_state & TASK_DEAD == 0
    {
        switched_out(ctx);
    }
}

/// Writes the switch-in record of `next` (a `task_struct` pointer) when
/// its off-CPU sample waits for one.
#[inline(always)]
fn switched_in(next: u64) {
    let offset = TASK_PID_OFFSET.load();
    if offset == 0 || next == 0 {
        return;
    }
    // SAFETY: a fault-tolerant read of a kernel pointer the tracepoint
    // passed; a wrong offset names a wrong tid, which finds no entry or
    // one whose record the agent refuses (its time does not match).
    let Ok(tid) =
        (unsafe { bpf_probe_read_kernel((next as *const u8).add(offset as usize).cast::<u32>()) })
    else {
        return;
    };
    // SAFETY: copied out before the entry goes.
    let Some(pending) = (unsafe { OFF_CPU_PENDING.get(tid) }).copied() else {
        return;
    };
    let _ = OFF_CPU_PENDING.remove(tid);
    let Some(ring) = sample_ring() else {
        count_lost_record();
        return;
    };
    let unread = unread_bytes(ring);
    let Some(mut entry) = ring.reserve_untyped::<SwitchIn>(0) else {
        count_lost_record();
        return;
    };
    entry.write(SwitchIn::new(tid, pending.tgid, pending.out_ns, unsafe {
        bpf_ktime_get_ns()
    }));
    entry.submit(wakeup_flag(unread, SWITCH_IN_SIZE as u64));
    count(Counter::SwitchIns);
}

/// The off-CPU sample of the current task, which is blocking (see
/// [`on_switch`]).
#[inline(always)]
fn switched_out<C: EbpfContext>(ctx: &C) {
    let pid_tgid = bpf_get_current_pid_tgid();
    let (tgid, tid) = ((pid_tgid >> 32) as u32, pid_tgid as u32);
    if tgid == 0 {
        return;
    }
    let Some((cgroup_id, budget)) = selected(tgid) else {
        return;
    };
    // A kernel thread has no user stack to show where it waits.
    let Some(regs) = saved_user_regs() else {
        return;
    };
    count(Counter::OffCpuSwitches);
    let divisor = off_cpu_divisor(unsafe { bpf_ktime_get_ns() }).saturating_mul(budget);
    if !kept(divisor) {
        count(Counter::OffCpuSkipped);
        return;
    }
    let ktime_ns = unsafe { bpf_ktime_get_ns() };
    let mut ids = SampleIds {
        tgid,
        tid,
        cpu: unsafe { bpf_get_smp_processor_id() },
        cgroup_id,
        sampling_divisor: divisor,
        stack_top: 0,
        copy_limit: 0,
        ktime_ns,
        process_start_ns: process_start_ns(tid == tgid),
        python_bytes: 0,
    };
    // A CPython thread's frames, as a tick reads them: where it waits in
    // Python. Before the sample's record, with the same CPU, thread and
    // time: the agent pairs the two by them.
    if look_up_top(&mut ids) {
        python_stack(&mut ids);
    }
    if !stack_sample(ctx, &mut ids, sample_flags::OFF_CPU, Some(regs)) {
        count(Counter::OffCpuFailed);
        return;
    }
    let pending = OffCpuPending {
        tgid,
        _pad: 0,
        out_ns: ktime_ns,
    };
    // A full map (as many sampled threads blocked at once) refuses the
    // entry: that sample's time is lost (the agent lets its record go when
    // the thread blocks again), not misplaced.
    if OFF_CPU_PENDING.insert(tid, pending, 0).is_err() {
        count(Counter::OffCpuFailed);
        return;
    }
    count(Counter::OffCpuSamples);
}

/// This CPU's off-CPU divisor (keep 1 blocking switch in N) for a switch
/// at `now`, counting it: each window of `OFF_CPU_WINDOW_NS` sets the next
/// window's divisor from its own rate of switches, so about
/// `OFF_CPU_SAMPLES_PER_SEC` samples a second are written whatever the
/// load, and each stands for the N switches it was chosen among (the
/// agent weighs its blocked time by N: totals stay true).
#[inline(always)]
fn off_cpu_divisor(now: u64) -> u32 {
    let Some(rate) = OFF_CPU_RATE.get_ptr_mut(0) else {
        return 1;
    };
    // SAFETY: this CPU's slot; the program does not nest on a CPU.
    unsafe {
        let elapsed = now.wrapping_sub((*rate).window_start_ns);
        if elapsed >= OFF_CPU_WINDOW_NS {
            let per_sec = u64::from((*rate).switches) * 1_000_000_000 / elapsed;
            let target = u64::from(OFF_CPU_SAMPLES_PER_SEC.load().max(1));
            (*rate).divisor = (per_sec / target).clamp(1, u64::from(u32::MAX)) as u32;
            (*rate).window_start_ns = now;
            (*rate).switches = 0;
        }
        (*rate).switches += 1;
        (*rate).divisor.max(1)
    }
}

fn emit_process_event(kind: RecordKind) {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    if tgid == AGENT_TGID.load() {
        return;
    }
    let Some(mut entry) = sample_ring().and_then(|ring| ring.reserve_untyped::<ProcessEvent>(0))
    else {
        count_lost_record();
        return;
    };
    entry.write(ProcessEvent {
        kind: kind as u32,
        tgid,
        ktime_ns: unsafe { bpf_ktime_get_ns() },
    });
    // Events are rare and never urgent: the reader picks them up with the
    // next batch of samples or on its drain timer.
    entry.submit(u64::from(BPF_RB_NO_WAKEUP));
}

#[derive(Clone, Copy)]
struct UserRegs {
    rip: u64,
    rsp: u64,
    rbp: u64,
}

impl From<&pt_regs> for UserRegs {
    fn from(regs: &pt_regs) -> Self {
        Self {
            rip: regs.rip,
            rsp: regs.rsp,
            rbp: regs.rbp,
        }
    }
}

/// The user registers the current task saved on kernel entry, when the tick
/// hit kernel mode. `None` for kernel threads: their saved frame is not a user
/// one (its `cs` is not user mode); and for a thread whose process has let
/// go of its address space (`task->mm` is null: it is exiting, its memory
/// being freed, a large share of a loop of short compiles' ticks), whose
/// saved frame points into memory that is gone.
fn saved_user_regs() -> Option<UserRegs> {
    // SAFETY: both helpers take and return pointers owned by the kernel; the
    // saved frame is read with a fault-tolerant probe read.
    let regs = unsafe {
        let task = bpf_get_current_task_btf();
        let regs = bpf_task_pt_regs(task) as *const pt_regs;
        bpf_probe_read_kernel(regs).ok()?
    };
    if regs.cs & 3 != USER_RPL {
        return None;
    }
    if address_space_gone() {
        count(Counter::AddressSpaceGone);
        return None;
    }
    Some(UserRegs::from(&regs))
}

/// Whether the current task's `mm` is null (known only when the agent
/// found its offset in BTF).
#[inline(always)]
fn address_space_gone() -> bool {
    let offset = TASK_MM_OFFSET.load();
    if offset == 0 {
        return false;
    }
    // SAFETY: a fault-tolerant kernel read of the current task's field.
    unsafe {
        let task = bpf_get_current_task() as *const u8;
        matches!(
            bpf_probe_read_kernel(task.add(offset as usize).cast::<u64>()),
            Ok(0)
        )
    }
}

struct StackCopy {
    len: u32,
    faulted: bool,
}

/// Copies up to `limit` bytes of user stack from `rsp` into the scratch
/// slot after the header and `kernel_stack_len` bytes of kernel stack.
///
/// A single large `bpf_probe_read_user` fails as a whole whenever fewer bytes
/// than asked remain above `rsp` in the stack mapping, which is the common case
/// for a thread near the top of its stack. Reading page by page instead stops
/// at the first page that is not mapped, i.e. at the end of the stack mapping,
/// and keeps everything before it.
#[inline(always)]
fn copy_user_stack(scratch: *mut u8, kernel_stack_len: u32, rsp: u64, limit: u32) -> StackCopy {
    // The masks restate bounds the code already guarantees, in a form the
    // verifier can use to prove every read stays inside the scratch slot.
    let base = SAMPLE_HEADER_SIZE + (kernel_stack_len as usize).min(MAX_KERNEL_STACK_BYTES);
    let mut copied = 0u32;
    let mut addr = rsp;
    for _ in 0..MAX_COPY_READS {
        if copied >= limit {
            break;
        }
        let to_page_end = PAGE_SIZE - (addr as u32 & (PAGE_SIZE - 1));
        // At most a page, but older verifiers cannot see it: 6.1 learns no
        // bound from the min (a compare of two registers) and loses a
        // compare's bound on a copy spilled before it. A mask bounds the
        // very register the helper gets; LLVM, which knows the mask changes
        // nothing, keeps it only on a value it cannot see through.
        let chunk = opaque(to_page_end.min(limit - copied)) & (2 * PAGE_SIZE - 1);
        if chunk > PAGE_SIZE {
            break;
        }
        let offset = base + (copied & (MAX_USER_STACK_BYTES - 1)) as usize;
        // SAFETY: offset + chunk <= header + kernel stack + MAX_USER_STACK_BYTES
        // + PAGE_SIZE = SCRATCH_BYTES; the source is user memory read with the
        // fault-tolerant helper.
        let ret = unsafe {
            bpf_probe_read_user(
                scratch.add(offset).cast::<c_void>(),
                chunk,
                addr as *const c_void,
            )
        };
        if ret < 0 {
            return StackCopy {
                len: copied,
                faulted: true,
            };
        }
        copied += chunk;
        addr += u64::from(chunk);
    }
    StackCopy {
        len: copied,
        faulted: false,
    }
}

/// `value`, which LLVM can no longer reason about: a bound the verifier
/// needs is then checked in the code, not folded away as always true.
#[inline(always)]
fn opaque(value: u32) -> u32 {
    let mut slot = 0u32;
    // SAFETY: `slot` is a live local.
    unsafe {
        core::ptr::write_volatile(&mut slot, value);
        core::ptr::read_volatile(&slot)
    }
}

/// Reads the plan's spans into the scratch slot after the copy, each
/// behind its packed [`tail_span`] header, until the spans or
/// [`MAX_TAIL_BYTES`] run out, and records their length and count in the
/// slot's header. Through `bpf_loop`: as a bounded loop, the verifier
/// followed each of its 512 iterations, over a third of the instructions
/// it checked in the whole program (and of the agent's start-up CPU).
#[inline(always)]
fn read_tail(scratch: *mut u8, plan: &StackPlan) {
    // SAFETY: the header was written by the caller.
    let written = unsafe { WrittenLengths::read(scratch) };
    // The masks do not change the lengths (both are below them); they
    // bound them for the verifier, with SCRATCH_BYTES sized to match.
    let base = SAMPLE_HEADER_SIZE as u64
        + (u64::from(written.kernel_stack_len) & KERNEL_STACK_MASK)
        + (u64::from(written.user_stack_len) & USER_STACK_MASK);
    let mut read = TailRead {
        scratch,
        plan,
        base,
    };
    // SAFETY: the callback is a function of the program; `read` outlives
    // the call.
    unsafe {
        bpf_loop(
            MAX_TAIL_SPANS as u32,
            read_tail_step as *mut c_void,
            core::ptr::addr_of_mut!(read).cast(),
            0,
        )
    };
}

/// What each step of [`read_tail`] needs. Its progress (bytes and spans
/// written) lives in the slot's header, read back at each step, so the
/// verifier sees every step start alike.
struct TailRead {
    scratch: *mut u8,
    plan: *const StackPlan,
    /// Where the tail starts in the slot: after the header and both stacks.
    base: u64,
}

/// One span of [`read_tail`]: 0 to go on, 1 to stop. A span whose read
/// faults is still written (zeroed, flagged), so the spans keep their order
/// and count.
extern "C" fn read_tail_step(_index: u32, read: *mut c_void) -> i64 {
    // SAFETY: `read_tail` passes its `TailRead`, whose slot is this CPU's
    // and holds a header written by the caller, and whose plan is a live
    // map value.
    let (read, plan) = unsafe {
        let read = &*read.cast::<TailRead>();
        (read, &*read.plan)
    };
    let header = read.scratch.cast::<SampleHeader>();
    // SAFETY: fields of the slot's header (see above).
    let (tail_len, spans) = unsafe {
        (
            core::ptr::addr_of!((*header).tail_len).read_volatile(),
            core::ptr::addr_of!((*header).tail_spans).read_volatile(),
        )
    };
    if spans >= plan.span_count || spans as usize >= MAX_TAIL_SPANS {
        return 1;
    }
    let span = plan.spans[spans as usize & (MAX_TAIL_SPANS - 1)];
    let len = tail_span::len(span);
    if len == 0 || len > MAX_SPAN_BYTES || tail_len >= MAX_TAIL_BYTES {
        return 1;
    }
    if tail_len + (TAIL_SPAN_HEADER_SIZE as u32) + len > MAX_TAIL_BYTES {
        return 1;
    }
    // The mask restates `tail_len < MAX_TAIL_BYTES` for the verifier.
    let offset = (read.base + (u64::from(tail_len) & u64::from(MAX_TAIL_BYTES - 1))) as usize;
    // SAFETY: offset + header + len <= base + MAX_TAIL_BYTES +
    // TAIL_SPAN_HEADER_SIZE + MAX_SPAN_BYTES, inside SCRATCH_BYTES; the
    // source is user memory read with the fault-tolerant helper (which
    // zeroes the destination when it faults).
    let ret = unsafe {
        bpf_probe_read_user(
            read.scratch
                .add(offset + TAIL_SPAN_HEADER_SIZE)
                .cast::<c_void>(),
            len,
            tail_span::addr(span) as *const c_void,
        )
    };
    // The sign bit of the result (set when the read faulted) is the
    // FAULTED bit of the span.
    let span_header = span | (ret as u64 & tail_span::FAULTED);
    // SAFETY: inside the slot (see above); only the header's tail fields
    // change.
    unsafe {
        read.scratch
            .add(offset)
            .cast::<u64>()
            .write_unaligned(span_header);
        core::ptr::addr_of_mut!((*header).tail_len)
            .write_volatile(tail_len + TAIL_SPAN_HEADER_SIZE as u32 + len);
        core::ptr::addr_of_mut!((*header).tail_spans).write_volatile(spans + 1);
    }
    0
}

fn count(counter: Counter) {
    if let Some(value) = COUNTERS.get_ptr_mut(counter as u32) {
        // SAFETY: this CPU's slot. A tick can interrupt the exec and exit
        // programs' counts on the same CPU, which at worst loses one count
        // (see `count_lost_record`).
        unsafe { *value += 1 };
    }
}

/// A record the ring had no room for.
fn count_lost_record() {
    count(Counter::RingBufferFull);
    // SAFETY: a plain helper call.
    let cpu = unsafe { bpf_get_smp_processor_id() };
    if let Some(lost) = RECORDS_LOST.get_ptr_mut(cpu) {
        // SAFETY: this CPU's slot; the reader only loads it. Not atomic
        // (the BPF target has no read-modify-write atomics in Rust): a tick
        // can interrupt the exec and exit programs between their load and
        // store on the same CPU (the cpu-clock event fires from a timer
        // interrupt, they run with interrupts on), and one of the two
        // losses is then not counted. The count still moves past what the
        // reader last saw, which is all it looks for; it may step back by
        // one, which the reader reads as no new loss.
        unsafe { *lost += 1 };
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
