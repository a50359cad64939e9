//! How much of each thread's stack the sampler reads, learned from the
//! thread's own walks: adaptive copies and stack tails.
//!
//! Owns the agent's side of the sampler's `COPY_BYTES` (per process),
//! `STACK_PLANS` (per thread) and `DEEP_PROGRAMS` (per thread name) maps:
//! the sizes, spans and programs it wants there, the updates it queues for
//! the sampling thread to write, and learning where a deep thread's frames lie by
//! reading the rest of its stack with `process_vm_readv`. It does not walk
//! stacks (the walker does, and tells it how each walk went) and does not
//! touch BPF maps itself.
//!
//! A thread gets a stack tail when its deep frames stay where they were
//! learned. When they do not (a compiler's stack, hundreds of KB of frames
//! reshaped every millisecond, makes a tail stale again and again) or are
//! too many for a tail, it gets a deep copy instead: the sampler copies its
//! whole stack, from `rsp` to the stack's end learned here, in one read.
//! So does a thread whose program's threads (by thread name) had two tails
//! go stale between them shortly before (a compiler's threads are gone
//! before a tail of their own goes stale twice), or were gone, in two of
//! its processes, before they could be learned at all (a compiler run that
//! lives 170 ms).
//! That costs more per tick (about a microsecond per 10 KB) but is the only
//! way such a stack reaches its root.
//!
//! Why this is never a wrong frame: what is learned here only chooses which
//! addresses the sampler reads on later ticks. Every byte a walk uses was
//! read at its own tick, so a plan gone stale (the thread returned and
//! called elsewhere) can only make a walk stop short, never walk a frame
//! that was not on the stack.

use foldhash::{HashMap, HashMapExt as _, HashSet, HashSetExt as _};
use stackscope_telemetry::probes::{self, Probe};
use std::io;

use crate::{StackMemory, UnwindEnd};
use agent_common::{
    COMM_LEN, MAX_SPAN_BYTES, MAX_STACK_PLANS, MAX_STACK_TOPS, MAX_TAIL_BYTES, MAX_TAIL_SPANS,
    MIN_USER_STACK_BYTES, PAGE_SIZE, StackPlan, StackTop, TAIL_SPAN_HEADER_SIZE, tail_span,
};

use stackscope_telemetry::StateSize;

/// A change for the sampler's maps, queued for the sampling thread.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanUpdate {
    /// Set (or with `None`, remove) the copy size of a process's threads
    /// that have no plan.
    ProcessCopy { tgid: u32, bytes: Option<u32> },
    /// Set (or remove) one thread's plan.
    Thread {
        tid: u32,
        plan: Option<Box<StackPlan>>,
    },
    /// Set (or remove) how far up one thread's stack its copies go.
    ThreadTop { tid: u32, top: Option<StackTop> },
    /// Add (or remove) a program, by thread name, whose unlearned threads
    /// wake the reader at once.
    DeepProgram { comm: [u8; COMM_LEN], deep: bool },
}

/// Bytes copied above the highest word a learned plan's copy must hold,
/// so a tick a little deeper than the learning one still reaches the spans.
const PLAN_SLACK_BYTES: u32 = 1024;
/// The copy a plan keeps at least: the frames that change from tick to tick.
const PLAN_MIN_COPY_BYTES: u32 = 1024;
/// Slots closer than this go into one span.
const MERGE_GAP_BYTES: u64 = 64;
/// Most stack a learning read fetches (a default main-thread stack limit).
const MAX_LEARN_BYTES: usize = 8 << 20;
/// A learning read fetches this much at a time, as the walk needs it.
const LEARN_CHUNK_BYTES: usize = 64 << 10;
/// One thread is learned at most this often (ns of sample time).
const LEARN_INTERVAL_NS: u64 = 250_000_000;
/// ... except when its tail just went stale: then a deep copy is likely
/// the answer, and every tick until it is written is a truncated walk.
const STALE_RELEARN_NS: u64 = 50_000_000;
/// A thread copied deep before it was learned (see [`Planner::learn`]) is
/// walked again at most this often (ns of sample time): long enough apart
/// for a compiler's stack to have changed shape (it does every millisecond)
/// when a tail from the first walk is checked against the second.
const CHECK_INTERVAL_NS: u64 = 100_000_000;
/// Checks in a row a tail learned from a deep copy must pass before it is
/// written: a compiler's deep frames may keep still for one check (a long
/// query) and move at the next, and every tick after a tail goes stale is
/// cut short until the agent, often seconds behind such a compile, sees it.
const TAIL_CHECKS: u8 = 2;
/// Walks of a thread's deep copies that ended before the root for another
/// reason (no unwind information, code on another stack) after which the
/// thread gets the usual copy: its walks do not use a deep one. Not one:
/// a compiler's thread whose walk once met a stub without unwind
/// information is still deep, and each of its ticks after the usual copy
/// was planned ran out (a rustc compile: 87 walks of 768).
const EARLY_ENDS_FOR_USUAL_COPY: u8 = 3;
/// Learning reads at most this many per second for all threads.
const LEARNS_PER_SECOND: u32 = 50;
/// A tail plan that runs out again within this long of being learned has
/// gone stale (ns of sample time).
const STALE_WINDOW_NS: u64 = 2_000_000_000;
/// Stale tails in a row after which a thread gets a deep copy instead. Two,
/// not one: a thread first learned while still descending to a stable
/// depth has one stale tail, and then keeps the next.
const STALE_TAILS_FOR_DEEP: u8 = 2;
/// Two stale tails of a program's threads (by thread name, in any of its
/// processes) make its threads deep when they came within this of each
/// other (ns of sample time): so do a compiler's, run after run, and not
/// two stray ones of a long-lived program hours apart.
const PROGRAM_STALE_WINDOW_NS: u64 = 10_000_000_000;
/// Programs (thread names) remembered as needing deep copies: their new
/// threads and processes (a compiler runs once per file) wake the reader at
/// their first tick and go deep at their first learning instead of after a
/// stale tail.
const MAX_DEEP_PROGRAMS: usize = agent_common::MAX_DEEP_PROGRAMS as usize;
/// A process's copy size follows the largest need seen over this window
/// and the one before it (ns of sample time).
const COPY_WINDOW_NS: u64 = 10_000_000_000;

/// What one delivered walk tells the planner.
#[derive(Debug, Clone, Copy)]
pub struct WalkReport {
    pub tgid: u32,
    pub tid: u32,
    /// The thread's name.
    pub comm: [u8; COMM_LEN],
    pub ktime_ns: u64,
    /// The thread's stack pointer at the tick.
    pub rsp: u64,
    /// Bytes of contiguous copy the tick had.
    pub copied: u32,
    /// The copy stopped at the thread's stack top (`COPY_AT_TOP`).
    pub copy_at_top: bool,
    /// The tick copied the whole stack (`DEEP_COPY`).
    pub deep_copy: bool,
    /// The copy stopped at a page it could not read (`USER_STACK_FAULTED`),
    /// or, a deep copy, has pages it could not read (`COPY_HOLES`).
    pub copy_faulted: bool,
    /// Bytes of the copy the walk read.
    pub copy_bytes_read: u64,
    /// Words the walk read from the tail.
    pub tail_reads: u32,
    pub end: UnwindEnd,
}

/// Counters of the planner, for the status line and the report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PlanStats {
    /// Threads whose deep frames were learned into a plan.
    pub plans_learned: u64,
    /// Of those, deep copies (the whole stack each tick).
    pub deep_plans_learned: u64,
    /// Learning reads that could not give a plan (the thread was gone,
    /// the walk did not reach the root, or the stack was too deep).
    pub learn_failed: u64,
    /// Of those, reads that found the thread's process exited: it lived
    /// shorter than the reader took to get to its tick.
    pub learn_too_late: u64,
    /// Learning reads skipped by the rate limits.
    pub learn_throttled: u64,
    /// Copy size changes written for processes.
    pub copy_updates: u64,
    /// Stack tops written for threads (their copies stop where their
    /// walks reach the root, not at a fault past the stack's end).
    pub tops_written: u64,
    /// Stack tops dropped because a copy that stopped there ran out.
    pub tops_dropped: u64,
    /// Stack tops a full set of the sampler's table gave up for another
    /// thread's: each is written again at its thread's next walk to the
    /// root. Many mean more live threads than the table holds.
    pub tops_evicted: u64,
    /// Plans in use now.
    pub thread_plans: usize,
    /// Of those, deep copies.
    pub thread_deep_plans: usize,
    /// Walks that ran out of stack, by what their copy was.
    pub truncated_by: TruncatedBy,
    /// Programs known to need deep copies from the start, remembered by
    /// an earlier agent beside the table cache.
    pub deep_programs_remembered: u64,
    /// Of that memory's files, those refused (damaged, or of another
    /// format) and removed.
    pub deep_programs_refused: u64,
}

/// Walks that ran out of stack, by what the tick copied: where a deep
/// program's samples are lost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct TruncatedBy {
    /// A process's adaptive copy, smaller than the ceiling: its walks
    /// needed less until then.
    pub short_copy: u64,
    /// The whole ceiling, with no plan: the thread is deeper than any
    /// copy and not learned yet.
    pub ceiling: u64,
    /// A copy up to the thread's learned stack top, which the thread had
    /// left (it ran on another stack).
    pub stack_top: u64,
    /// A plan's copy and tail, gone stale (the deep frames moved).
    pub stale_tail: u64,
    /// A deep copy: the stack was deeper than the deep size, or the copy
    /// missed its start.
    pub deep_copy: u64,
    /// A copy that stopped at a page it could not read before the stack's
    /// end (a page not in memory: the BPF program cannot fault it in).
    pub faulted: u64,
}

/// A process's copy size as the planner learns it; kept in the process's
/// record (see `process_state`).
#[derive(Debug)]
pub(super) struct ProcessCopy {
    window_start_ns: u64,
    max_now: u32,
    max_before: u32,
    /// What the map holds for the process (the ceiling when unset).
    written: u32,
}

/// Stale tails of a program's threads in a row: `count`, the last at
/// `last_ns` (sample time).
struct StaleProgram {
    count: u8,
    last_ns: u64,
    /// The process of the last learn that came too late: the threads of
    /// one process, gone with it, count once.
    late_tgid: u32,
}

struct ThreadPlan {
    tgid: u32,
    last_learn_ns: u64,
    /// What the map holds for the thread.
    planned: Planned,
    /// Tail plans that went stale in a row (see [`STALE_WINDOW_NS`]), or,
    /// for a thread copied deep before it was learned, tails that would
    /// have (see `candidate`).
    stale_tails: u8,
    /// A tail learned from a deep copy of the thread before it was learned,
    /// written only once later walks show it would have held
    /// ([`TAIL_CHECKS`] in a row), and how many have so far.
    candidate: Option<Box<StackPlan>>,
    held: u8,
    /// Walks of the thread's deep copies that ended before the root for
    /// another reason than the copy (see [`EARLY_ENDS_FOR_USUAL_COPY`]).
    early_ends: u8,
}

/// What the planner keeps of one thread: its plan, and the stack top
/// written for it (with the process it was written for), found together by
/// one lookup.
#[derive(Default)]
struct ThreadState {
    plan: Option<ThreadPlan>,
    top: Option<(u32, u64)>,
}

/// The threads' plans and stack tops in one map by thread id, each kind
/// counted against its own bound.
#[derive(Default)]
struct Threads {
    by_tid: HashMap<u32, ThreadState>,
    plans: usize,
    tops: usize,
}

impl Threads {
    fn get(&self, tid: u32) -> Option<&ThreadState> {
        probes::count(Probe::Thread);
        self.by_tid.get(&tid)
    }

    fn plan(&self, tid: u32) -> Option<&ThreadPlan> {
        self.get(tid)?.plan.as_ref()
    }

    fn plan_mut(&mut self, tid: u32) -> Option<&mut ThreadPlan> {
        self.by_tid.get_mut(&tid)?.plan.as_mut()
    }

    fn plans(&self) -> impl Iterator<Item = (u32, &ThreadPlan)> {
        self.by_tid
            .iter()
            .filter_map(|(&tid, t)| Some((tid, t.plan.as_ref()?)))
    }

    fn tops(&self) -> impl Iterator<Item = (u32, u32, u64)> + '_ {
        self.by_tid
            .iter()
            .filter_map(|(&tid, t)| t.top.map(|(tgid, top)| (tid, tgid, top)))
    }

    fn set_plan(&mut self, tid: u32, plan: ThreadPlan) {
        let thread = self.by_tid.entry(tid).or_default();
        self.plans += usize::from(thread.plan.is_none());
        thread.plan = Some(plan);
    }

    fn set_top(&mut self, tid: u32, tgid: u32, top: u64) {
        let thread = self.by_tid.entry(tid).or_default();
        self.tops += usize::from(thread.top.is_none());
        thread.top = Some((tgid, top));
    }

    /// Takes the thread's plan; `None` if it had none.
    fn take_plan(&mut self, tid: u32) -> Option<ThreadPlan> {
        let thread = self.by_tid.get_mut(&tid)?;
        let plan = thread.plan.take()?;
        self.plans -= 1;
        if thread.top.is_none() {
            self.by_tid.remove(&tid);
        }
        Some(plan)
    }

    fn remove_top(&mut self, tid: u32) {
        if let Some(thread) = self.by_tid.get_mut(&tid)
            && thread.top.take().is_some()
        {
            self.tops -= 1;
            if thread.plan.is_none() {
                self.by_tid.remove(&tid);
            }
        }
    }

    fn clear_tops(&mut self) {
        self.by_tid.retain(|_, thread| {
            thread.top = None;
            thread.plan.is_some()
        });
        self.tops = 0;
    }

    /// Drops every plan and top kept for process `tgid`, handing each
    /// thread's id and what it had (a plan, a top) to `dropped`.
    fn forget_process(
        &mut self,
        tgid: u32,
        mut dropped: impl FnMut(u32, Option<ThreadPlan>, bool),
    ) {
        let (plans, tops) = (&mut self.plans, &mut self.tops);
        self.by_tid.retain(|&tid, thread| {
            let plan = thread.plan.take_if(|plan| plan.tgid == tgid);
            let top = thread.top.take_if(|&mut (top_tgid, _)| top_tgid == tgid);
            *plans -= usize::from(plan.is_some());
            *tops -= usize::from(top.is_some());
            if plan.is_some() || top.is_some() {
                dropped(tid, plan, top.is_some());
            }
            thread.plan.is_some() || thread.top.is_some()
        });
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Planned {
    Nothing,
    Tail,
    Deep,
}

/// Learns and keeps the copy sizes and stack plans; see the module doc.
pub struct Planner {
    ceiling: u32,
    /// Most bytes of a deep copy; 0: none.
    deep_limit: u32,
    adaptive: bool,
    threads: Threads,
    /// Thread names whose threads needed deep copies.
    deep_programs: HashSet<[u8; COMM_LEN]>,
    /// Programs added to `deep_programs` by this agent's learning (with
    /// the process each was learned from), not yet remembered on disk.
    newly_deep: Vec<(u32, [u8; COMM_LEN])>,
    /// Per thread name: tails of its threads that went stale, and learns
    /// of its threads that came too late (the process had exited), each
    /// within `PROGRAM_STALE_WINDOW_NS` of the one before. A program whose
    /// threads live shorter than two stale tails each (a compiler run) is
    /// never caught by `ThreadPlan::stale_tails`, so its threads would be
    /// planned tails, one after the other, none of which keeps up. At most
    /// `MAX_DEEP_PROGRAMS` names (emptied when full).
    stale_programs: HashMap<[u8; COMM_LEN], StaleProgram>,
    updates: Vec<PlanUpdate>,
    /// Learning budget: the second (of sample time) it counts, and how
    /// many were spent in it.
    budget_second: u64,
    budget_spent: u32,
    remote: Vec<u8>,
    reads: Vec<u64>,
    stats: PlanStats,
}

impl Planner {
    /// `ceiling`: the configured copy size, which plans never exceed;
    /// `deep_limit`: the most a deep copy reads (0: no deep copies).
    /// Without `adaptive`, every tick copies the ceiling and nothing is
    /// learned (the behaviour to compare against).
    pub fn new(ceiling: u32, deep_limit: u32, adaptive: bool) -> Self {
        Self {
            ceiling,
            deep_limit,
            adaptive,
            threads: Threads::default(),
            deep_programs: HashSet::new(),
            newly_deep: Vec::new(),
            stale_programs: HashMap::new(),
            updates: Vec::new(),
            budget_second: 0,
            budget_spent: 0,
            remote: Vec::new(),
            reads: Vec::new(),
            stats: PlanStats::default(),
        }
    }

    /// Processes with a thread plan.
    pub fn tracked_processes_into(&self, out: &mut Vec<u32>) {
        out.extend(self.threads.plans().map(|(_, plan)| plan.tgid));
    }

    /// Sizes of what the planner keeps per process and per thread.
    pub fn state_sizes(&self, out: &mut Vec<StateSize>) {
        out.push(StateSize::entries(
            "stack_plans",
            self.threads.plans,
            Some(2 * MAX_STACK_PLANS as usize),
        ));
        out.push(StateSize::entries(
            "stack_tops",
            self.threads.tops,
            Some(MAX_STACK_TOPS as usize),
        ));
        out.push(StateSize::entries(
            "deep_programs",
            self.deep_programs.len(),
            Some(MAX_DEEP_PROGRAMS),
        ));
        out.push(StateSize::entries(
            "stale_programs",
            self.stale_programs.len(),
            Some(MAX_DEEP_PROGRAMS),
        ));
    }

    pub fn stats(&self) -> PlanStats {
        let planned = |kind| {
            self.threads
                .plans()
                .filter(|(_, t)| t.planned == kind)
                .count()
        };
        PlanStats {
            thread_plans: planned(Planned::Tail) + planned(Planned::Deep),
            thread_deep_plans: planned(Planned::Deep),
            ..self.stats
        }
    }

    /// The map changes queued since the last call.
    pub fn take_updates(&mut self) -> Vec<PlanUpdate> {
        std::mem::take(&mut self.updates)
    }

    /// Adjusts the process's copy size to what its walks need; says
    /// whether the thread's deep frames should be learned (the walk ran
    /// out of stack with the whole ceiling copied, or a plan's tail).
    /// `copy`: the copy size kept in the process's record (`None`: no
    /// record, nothing to adjust).
    pub(super) fn observe(
        &mut self,
        walk: &WalkReport,
        copy: Option<&mut Option<ProcessCopy>>,
    ) -> bool {
        if !self.adaptive {
            return false;
        }
        let truncated = walk.end == UnwindEnd::StackTruncated;
        let ceiling = self.ceiling;
        let needed = if truncated {
            ceiling
        } else {
            u32::try_from(walk.copy_bytes_read).unwrap_or(ceiling)
        };
        let thread = self.threads.get(walk.tid);
        let planned = thread
            .and_then(|t| t.plan.as_ref())
            .is_some_and(|t| t.planned != Planned::Nothing);
        let top = thread.and_then(|t| t.top);
        if truncated {
            let by = &mut self.stats.truncated_by;
            *(if walk.deep_copy {
                &mut by.deep_copy
            } else if planned {
                &mut by.stale_tail
            } else if walk.copy_at_top {
                &mut by.stack_top
            } else if walk.copy_faulted {
                &mut by.faulted
            } else if walk.copied >= ceiling {
                &mut by.ceiling
            } else {
                &mut by.short_copy
            }) += 1;
        }
        if !planned {
            if let Some(copy) = copy {
                self.observe_process(copy, walk.tgid, walk.ktime_ns, needed);
            }
            // A deep copy of a thread without a plan is the sampler's own,
            // to the thread pointer (its first ticks). A stack top ends
            // those: it is for a thread the usual copy holds, not one that
            // needed more.
            if !walk.deep_copy || walk.copy_bytes_read <= u64::from(ceiling) {
                self.observe_top(walk, top);
            }
        }
        // The sampler's own copy to the stack's end, of a thread deeper
        // than the ceiling (or whose walk ended for another reason): that
        // copy holds every word a plan needs, so the thread is learned from
        // it at once (see `learn`), and the sampler's deep copies end.
        let copied_deep = !planned
            && !truncated
            && walk.deep_copy
            && (walk.copy_bytes_read > u64::from(ceiling) || walk.end != UnwindEnd::Outermost);
        // Deeper than any copy: only a tail can help. A shorter copy that
        // ran out is fixed by the copy size above.
        copied_deep || (truncated && (planned || walk.copied >= ceiling))
    }

    /// Keeps the thread's stack top at the highest address its rooted walks
    /// read; drops it when a copy that stopped there was not enough.
    /// `written`: the top written for the thread id (and its process).
    fn observe_top(&mut self, walk: &WalkReport, written: Option<(u32, u64)>) {
        let known = written.filter(|(tgid, _)| *tgid == walk.tgid);
        match walk.end {
            UnwindEnd::Outermost if walk.tail_reads == 0 => {
                let reach = walk
                    .rsp
                    .saturating_add(walk.copy_bytes_read.next_multiple_of(8));
                if known.is_some_and(|(_, top)| top >= reach) {
                    return;
                }
                if self.threads.tops >= MAX_STACK_TOPS as usize {
                    // This side only needs to know what it wrote recently:
                    // a top it forgets is written again at the thread's
                    // next walk to the root, and one the table gives up
                    // is reported (`top_evicted`).
                    self.threads.clear_tops();
                }
                self.threads.set_top(walk.tid, walk.tgid, reach);
                self.stats.tops_written += 1;
                self.updates.push(PlanUpdate::ThreadTop {
                    tid: walk.tid,
                    // The sampler adds the flags: it knows the processes
                    // it reads CPython frames of.
                    top: Some(StackTop {
                        tgid: walk.tgid,
                        flags: 0,
                        top: reach,
                    }),
                });
            }
            // Whether or not this side still knows the entry: a stale one
            // in the map (its thread id reused within the process) would
            // keep cutting that thread's copies short.
            UnwindEnd::StackTruncated if walk.copy_at_top => {
                self.threads.remove_top(walk.tid);
                self.stats.tops_dropped += 1;
                self.updates.push(PlanUpdate::ThreadTop {
                    tid: walk.tid,
                    top: None,
                });
            }
            _ => {}
        }
    }

    fn observe_process(
        &mut self,
        copy: &mut Option<ProcessCopy>,
        tgid: u32,
        now: u64,
        needed: u32,
    ) {
        let ceiling = self.ceiling;
        let process = copy.get_or_insert(ProcessCopy {
            window_start_ns: now,
            max_now: 0,
            max_before: 0,
            written: ceiling,
        });
        if now.saturating_sub(process.window_start_ns) > COPY_WINDOW_NS {
            process.max_before = process.max_now;
            process.max_now = 0;
            process.window_start_ns = now;
        }
        process.max_now = process.max_now.max(needed);
        let wanted = copy_size_for(process.max_now.max(process.max_before), ceiling);
        // Up at once (a walk ran short); down only by a quarter or more,
        // so the map is not rewritten for every small wobble.
        if wanted > process.written || wanted < process.written - process.written / 4 {
            process.written = wanted;
            self.stats.copy_updates += 1;
            self.updates.push(PlanUpdate::ProcessCopy {
                tgid,
                bytes: Some(wanted),
            });
        }
    }

    /// Learns a plan for the thread of a walk that `observe` flagged: reads
    /// the stack above the copy from the live process, walks it with
    /// `walk_again` (which must walk from the sample's registers over the
    /// memory it is given), and turns the words that walk read into a plan.
    pub fn learn(
        &mut self,
        walk: &WalkReport,
        copy: &[u8],
        walk_again: impl FnOnce(&mut RemoteStack<'_>) -> UnwindEnd,
    ) {
        // A deep copy with pages it could not read holds zeros a learning
        // walk could take for words: nothing is learned from it.
        if walk.deep_copy && walk.copy_faulted {
            return;
        }
        if walk.deep_copy && walk.end != UnwindEnd::StackTruncated {
            self.learn_from_deep_copy(walk, copy, walk_again);
            return;
        }
        let thread = self.threads.plan(walk.tid).filter(|t| t.tgid == walk.tgid);
        if thread.is_some_and(|t| {
            let interval = match t.planned {
                Planned::Tail => STALE_RELEARN_NS,
                _ => LEARN_INTERVAL_NS,
            };
            walk.ktime_ns.saturating_sub(t.last_learn_ns) < interval
        }) {
            return;
        }
        // The thread's tail went stale soon after it was learned.
        let mut went_stale = false;
        let (was_planned, stale_tails) = match thread {
            Some(t) if t.planned == Planned::Tail => {
                went_stale = walk.ktime_ns.saturating_sub(t.last_learn_ns) < STALE_WINDOW_NS;
                let stale = if went_stale {
                    t.stale_tails.saturating_add(1)
                } else {
                    1
                };
                (Planned::Tail, stale)
            }
            Some(t) => (t.planned, t.stale_tails),
            None => (Planned::Nothing, 0),
        };
        if !self.spend_budget(walk.ktime_ns) {
            return;
        }
        // Counted only now: a throttled learn leaves the thread's last
        // learning time as it was, and would count the same tail again.
        // The program's later threads need no count: the deep plan this
        // one gets puts the program in `deep_programs`.
        let program_stale = went_stale && self.program_went_stale(walk.comm, walk.ktime_ns);
        if self.threads.plans >= 2 * MAX_STACK_PLANS as usize
            && self.threads.plan(walk.tid).is_none()
        {
            self.forget_oldest_thread();
        }
        self.threads.set_plan(
            walk.tid,
            ThreadPlan {
                tgid: walk.tgid,
                last_learn_ns: walk.ktime_ns,
                planned: was_planned,
                stale_tails,
                candidate: None,
                held: 0,
                early_ends: 0,
            },
        );

        self.reads.clear();
        let rsp = walk.rsp;
        let mut remote = RemoteStack::new(walk.tgid, rsp, copy, &mut self.remote, &mut self.reads);
        let end = walk_again(&mut remote);
        let gone = remote.gone;
        let reach = remote.reads.iter().max().map_or(0, |&a| a + 8 - rsp);
        let outermost = end == UnwindEnd::Outermost;
        tracing::debug!(
            tid = walk.tid,
            ?end,
            reach,
            reads = remote.reads.len(),
            "learning a stack tail"
        );
        // Tails while they keep up with the thread; a deep copy once they
        // do not, or when its frames are too many for a tail.
        let deep_fits = outermost && self.deep_limit > 0 && reach <= u64::from(self.deep_limit);
        // The program's word is taken only where a deep copy can follow:
        // a thread of its own is still planned a tail otherwise.
        let tails_fell_behind = was_planned == Planned::Deep
            || stale_tails >= STALE_TAILS_FOR_DEEP
            || self.deep_programs.contains(&walk.comm)
            || (program_stale && deep_fits);
        let tail = (outermost && !tails_fell_behind)
            .then(|| plan_for(walk.tgid, rsp, remote.reads, self.ceiling))
            .flatten();
        let deep_plan = |end| {
            let plan = StackPlan::deep(walk.tgid, self.ceiling, end);
            (Box::new(plan), Planned::Deep)
        };
        let plan = match tail {
            Some(tail) => Some((tail, Planned::Tail)),
            None if deep_fits => remote.stack_end().map(deep_plan),
            // A thread to be copied deep whose learning walk lost its way:
            // the stack above the tick's copy was read now, and a
            // compiler's changes within a millisecond (a loop of rustc
            // runs: a third of its threads were never learned so). A deep
            // copy needs only the stack's end; each tick's walk uses only
            // that tick's bytes.
            // Not a deep-planned thread's relearn: its walk may have failed
            // on another stack (a signal's), whose end would replace a plan
            // that works.
            None if tails_fell_behind
                && was_planned != Planned::Deep
                && !gone
                && self.deep_limit > 0 =>
            {
                remote
                    .stack_end()
                    .filter(|end| end.saturating_sub(rsp) <= u64::from(self.deep_limit))
                    .map(deep_plan)
            }
            None => None,
        };
        // The buffer may have grown to megabytes for one deep thread.
        self.remote.clear();
        self.remote.shrink_to(LEARN_CHUNK_BYTES);
        let Some((plan, kind)) = plan else {
            self.stats.learn_failed += 1;
            // The thread's process exited before the reader got to this
            // tick, as a compiler run's threads do, one after the other.
            // Counted as a stale tail (unless this learn's own stale tail
            // was): the program goes deep, so that its next threads are
            // copied deep from their first tick, or wake the reader then
            // and are learned while they live. Deep, not only woken
            // early: a tail learned from one walk of a compiler's stack
            // goes stale within a tick (a loop of rustc runs: 3% of
            // librustc_driver's samples reached the root with early tails,
            // 58-61% with deep copies).
            if gone {
                self.stats.learn_too_late += 1;
                if !went_stale && self.program_learned_too_late(walk.comm, walk.tgid, walk.ktime_ns)
                {
                    self.add_deep_program(walk.comm, walk.tgid);
                }
            }
            return;
        };
        if let Some(thread) = self.threads.plan_mut(walk.tid) {
            thread.planned = kind;
        }
        self.write_plan(walk, plan, kind);
    }

    /// Queues the plan learned for the walk's thread, in place of its
    /// stack top: the program does not look up the plan of a thread with a
    /// top (see [`StackTop`]). The top goes from the map even when this
    /// side no longer knows it (`clear_tops`), and after the plan is in:
    /// a tick between the two writes still finds the thread learned.
    fn write_plan(&mut self, walk: &WalkReport, plan: Box<StackPlan>, kind: Planned) {
        self.stats.plans_learned += 1;
        if kind == Planned::Deep {
            self.stats.deep_plans_learned += 1;
            self.add_deep_program(walk.comm, walk.tgid);
        }
        self.threads.remove_top(walk.tid);
        self.updates.push(PlanUpdate::Thread {
            tid: walk.tid,
            plan: Some(plan),
        });
        self.updates.push(PlanUpdate::ThreadTop {
            tid: walk.tid,
            top: None,
        });
    }

    /// Thread `tid`'s top is no longer in the sampler's table: forgotten
    /// here too, so the thread's next walk to the root writes it again.
    pub fn top_evicted(&mut self, tid: u32) {
        self.stats.tops_evicted += 1;
        self.threads.remove_top(tid);
    }

    /// Process `tgid` is read for CPython frames from now on: the stack
    /// tops of its threads, written before without
    /// [`agent_common::stack_top_flags::PYTHON`], go (in the map too), so
    /// its ticks look the process up until later walks write them again.
    /// A top this side no longer knows (`clear_tops`) is written again, as
    /// such, by the thread's next walk to the root.
    pub fn forget_tops(&mut self, tgid: u32) {
        let tids: Vec<u32> = self
            .threads
            .tops()
            .filter(|&(_, top_tgid, _)| top_tgid == tgid)
            .map(|(tid, _, _)| tid)
            .collect();
        for tid in tids {
            self.threads.remove_top(tid);
            self.updates.push(PlanUpdate::ThreadTop { tid, top: None });
        }
    }

    /// One learning read from the budget of the second of `now`; false
    /// (counted) when it is spent.
    fn spend_budget(&mut self, now: u64) -> bool {
        let second = now / 1_000_000_000;
        if second != self.budget_second {
            (self.budget_second, self.budget_spent) = (second, 0);
        }
        if self.budget_spent >= LEARNS_PER_SECOND {
            self.stats.learn_throttled += 1;
            return false;
        }
        self.budget_spent += 1;
        true
    }

    /// Learns a thread the sampler copied deep before it was learned (to
    /// its stack's end: see `first_ticks_stack_end` in the BPF program),
    /// from that copy alone: it holds every word the walk read.
    /// - Walks that ended early (no unwind information, another stack),
    ///   [`EARLY_ENDS_FOR_USUAL_COPY`] of them: the usual copy is all its
    ///   walks use.
    /// - A program known to need deep copies: a deep plan at once.
    /// - Otherwise a tail, but written only once walks at least
    ///   [`CHECK_INTERVAL_NS`] apart read no deep word outside it
    ///   ([`TAIL_CHECKS`] in a row): a compiler's frames move every
    ///   millisecond, and a tail written at once would cut its next walks
    ///   short. A second tail that would
    ///   not have held (two, for a thread still descending to a stable
    ///   depth) makes the plan a deep copy.
    ///
    /// Until then the sampler keeps copying the thread deep, so nothing is
    /// lost while this decides.
    fn learn_from_deep_copy(
        &mut self,
        walk: &WalkReport,
        copy: &[u8],
        walk_again: impl FnOnce(&mut RemoteStack<'_>) -> UnwindEnd,
    ) {
        let thread = self.threads.plan(walk.tid).filter(|t| t.tgid == walk.tgid);
        if thread.is_some_and(|t| {
            t.planned != Planned::Nothing
                || walk.ktime_ns.saturating_sub(t.last_learn_ns) < CHECK_INTERVAL_NS
        }) {
            return;
        }
        let known = thread.is_some();
        if !self.spend_budget(walk.ktime_ns) {
            return;
        }
        if self.threads.plans >= 2 * MAX_STACK_PLANS as usize && !known {
            self.forget_oldest_thread();
        }
        let (mut candidate, mut misses, mut held, mut early_ends) =
            match self.threads.plan_mut(walk.tid) {
                Some(thread) if known => (
                    thread.candidate.take(),
                    thread.stale_tails,
                    thread.held,
                    thread.early_ends,
                ),
                _ => (None, 0, 0, 0),
            };
        self.reads.clear();
        let mut memory =
            RemoteStack::copy_only(walk.tgid, walk.rsp, copy, &mut self.remote, &mut self.reads);
        let end = walk_again(&mut memory);
        let reads = &mut self.reads;
        let deep_plan = || {
            let stack_end = walk.rsp + copy.len() as u64;
            Box::new(StackPlan::deep(walk.tgid, self.ceiling, stack_end))
        };
        let decided = if end != UnwindEnd::Outermost {
            early_ends = early_ends.saturating_add(1);
            let usual = || Box::new(StackPlan::copy_only(walk.tgid, self.ceiling));
            (early_ends >= EARLY_ENDS_FOR_USUAL_COPY).then(|| (usual(), Planned::Tail))
        } else if candidate
            .as_deref()
            .is_some_and(|tail| tail_holds(tail, walk.rsp, reads))
        {
            held += 1;
            if held < TAIL_CHECKS {
                None
            } else {
                candidate.take().map(|tail| (tail, Planned::Tail))
            }
        } else {
            held = 0;
            misses += u8::from(candidate.is_some());
            let deep = self.deep_programs.contains(&walk.comm) || misses >= STALE_TAILS_FOR_DEEP;
            candidate = (!deep)
                .then(|| plan_for(walk.tgid, walk.rsp, reads, self.ceiling))
                .flatten();
            // Too many deep words for a tail, too.
            candidate.is_none().then(|| (deep_plan(), Planned::Deep))
        };
        let kind = decided.as_ref().map_or(Planned::Nothing, |(_, kind)| *kind);
        tracing::debug!(
            tid = walk.tid,
            ?end,
            ?kind,
            misses,
            "learning from a deep copy"
        );
        self.threads.set_plan(
            walk.tid,
            ThreadPlan {
                tgid: walk.tgid,
                last_learn_ns: walk.ktime_ns,
                planned: kind,
                stale_tails: misses,
                candidate,
                held,
                early_ends,
            },
        );
        let Some((plan, kind)) = decided else {
            return;
        };
        self.write_plan(walk, plan, kind);
    }

    /// Puts `comm` among the programs whose new threads wake the reader
    /// at their first tick and are planned deep copies; a program new to
    /// the set (learned from process `tgid`) is also queued to be
    /// remembered across restarts (see [`Self::take_newly_deep`]).
    fn add_deep_program(&mut self, comm: [u8; COMM_LEN], tgid: u32) {
        if self.insert_deep_program(comm) {
            self.newly_deep.push((tgid, comm));
        }
    }

    /// Programs a previous agent learned needed deep copies (see
    /// `remembered`), and how many of its files were refused.
    pub(super) fn remember_deep_programs(&mut self, comms: &[[u8; COMM_LEN]], refused: usize) {
        for &comm in comms {
            self.insert_deep_program(comm);
        }
        self.stats.deep_programs_remembered = self.deep_programs.len() as u64;
        self.stats.deep_programs_refused = refused as u64;
    }

    /// The programs found to need deep copies since the last call, each
    /// with the process it was learned from.
    pub(super) fn take_newly_deep(&mut self) -> Vec<(u32, [u8; COMM_LEN])> {
        std::mem::take(&mut self.newly_deep)
    }

    /// Adds `comm` to the deep programs (and the sampler's map); false if
    /// it was there.
    fn insert_deep_program(&mut self, comm: [u8; COMM_LEN]) -> bool {
        if self.deep_programs.contains(&comm) {
            return false;
        }
        if self.deep_programs.len() >= MAX_DEEP_PROGRAMS {
            for comm in self.deep_programs.drain() {
                self.updates
                    .push(PlanUpdate::DeepProgram { comm, deep: false });
            }
        }
        self.deep_programs.insert(comm);
        self.updates
            .push(PlanUpdate::DeepProgram { comm, deep: true });
        true
    }

    /// Counts, as a stale tail, a learn of a thread of `comm` that found its
    /// process `tgid` gone; once per process.
    fn program_learned_too_late(&mut self, comm: [u8; COMM_LEN], tgid: u32, now: u64) -> bool {
        if self
            .stale_programs
            .get(&comm)
            .is_some_and(|program| program.late_tgid == tgid)
        {
            return false;
        }
        let deep = self.program_went_stale(comm, now);
        if let Some(program) = self.stale_programs.get_mut(&comm) {
            program.late_tgid = tgid;
        }
        deep
    }

    /// Counts a stale tail of a thread of `comm` at `now`; true when its
    /// program's tails went stale often enough, recently enough, for its
    /// threads to be copied deep.
    fn program_went_stale(&mut self, comm: [u8; COMM_LEN], now: u64) -> bool {
        if !self.stale_programs.contains_key(&comm)
            && self.stale_programs.len() >= MAX_DEEP_PROGRAMS
        {
            self.stale_programs.clear();
        }
        let program = self.stale_programs.entry(comm).or_insert(StaleProgram {
            count: 0,
            last_ns: now,
            late_tgid: 0,
        });
        if now.saturating_sub(program.last_ns) >= PROGRAM_STALE_WINDOW_NS {
            program.count = 0;
        }
        program.count = program.count.saturating_add(1);
        program.last_ns = now;
        program.count >= STALE_TAILS_FOR_DEEP
    }

    fn forget_oldest_thread(&mut self) {
        let oldest = self
            .threads
            .plans()
            .min_by_key(|(_, t)| t.last_learn_ns)
            .map(|(tid, _)| tid);
        if let Some(tid) = oldest
            && self
                .threads
                .take_plan(tid)
                .is_some_and(|plan| plan.planned != Planned::Nothing)
        {
            self.updates.push(PlanUpdate::Thread { tid, plan: None });
        }
    }

    /// Exec or exit records were lost: every plan and top goes (a reused
    /// id must not inherit them), from the maps too (the processes' copy
    /// sizes go with their records, through [`Self::forget_process`]).
    pub fn forget_all(&mut self) {
        let tgids: HashSet<u32> = self
            .threads
            .plans()
            .map(|(_, t)| t.tgid)
            .chain(self.threads.tops().map(|(_, tgid, _)| tgid))
            .collect();
        for tgid in tgids {
            self.forget_process(tgid, None);
        }
    }

    /// The process's record went (it exited, replaced its image, or was
    /// evicted): its copy size, taken from the record, and its threads'
    /// plans go, in the maps too, so a reused id starts afresh.
    pub(super) fn forget_process(&mut self, tgid: u32, copy: Option<ProcessCopy>) {
        if let Some(process) = copy
            && process.written != self.ceiling
        {
            self.updates
                .push(PlanUpdate::ProcessCopy { tgid, bytes: None });
        }
        let updates = &mut self.updates;
        self.threads.forget_process(tgid, |tid, plan, top| {
            if plan.is_some_and(|plan| plan.planned != Planned::Nothing) {
                updates.push(PlanUpdate::Thread { tid, plan: None });
            }
            if top {
                updates.push(PlanUpdate::ThreadTop { tid, top: None });
            }
        });
    }
}

/// The copy a process gets for walks that needed `needed` bytes: a quarter
/// more and a little, in 256-byte steps, within the limits.
fn copy_size_for(needed: u32, ceiling: u32) -> u32 {
    let padded = needed.saturating_add(needed / 4).saturating_add(256);
    padded
        .div_ceil(256)
        .saturating_mul(256)
        .clamp(MIN_USER_STACK_BYTES, ceiling.max(MIN_USER_STACK_BYTES))
        .min(ceiling)
}

/// A plan whose copy holds the top of the stack and whose spans hold the
/// words a walk from `rsp` read further up (`reads`: their addresses).
/// Spans are taken from the root down, so the frames that move least are
/// the ones read word by word; the copy covers what the spans cannot.
/// `None` when even the ceiling copy could not close the gap.
pub fn plan_for(tgid: u32, rsp: u64, reads: &mut Vec<u64>, ceiling: u32) -> Option<Box<StackPlan>> {
    reads.sort_unstable();
    reads.dedup();
    let copy_floor = rsp + u64::from(PLAN_MIN_COPY_BYTES);
    /// (address, length) of a span being built.
    struct PlannedSpan {
        addr: u64,
        len: u32,
    }
    let mut spans: Vec<PlannedSpan> = Vec::new();
    let mut tail_bytes = 0u32;
    // Addresses from the highest down; the first that fits no span (or
    // lies in the copy anyway) ends the tail, and the copy takes the rest.
    let mut copy_end = rsp;
    for &address in reads.iter().rev() {
        if address < copy_floor {
            copy_end = address + 8;
            break;
        }
        if let Some(span) = spans.last_mut() {
            let new_len = span.addr + u64::from(span.len) - address;
            if span.addr.saturating_sub(address + 8) <= MERGE_GAP_BYTES
                && new_len <= u64::from(MAX_SPAN_BYTES)
            {
                let grown = new_len as u32 - span.len;
                if tail_bytes + grown > MAX_TAIL_BYTES {
                    copy_end = address + 8;
                    break;
                }
                span.addr = address;
                span.len = new_len as u32;
                tail_bytes += grown;
                continue;
            }
        }
        let cost = TAIL_SPAN_HEADER_SIZE as u32 + 8;
        if spans.len() == MAX_TAIL_SPANS || tail_bytes + cost > MAX_TAIL_BYTES {
            copy_end = address + 8;
            break;
        }
        spans.push(PlannedSpan {
            addr: address,
            len: 8,
        });
        tail_bytes += cost;
    }
    let needed = u32::try_from(copy_end - rsp).ok()?;
    let copy_bytes = needed
        .max(PLAN_MIN_COPY_BYTES)
        .saturating_add(PLAN_SLACK_BYTES)
        .div_ceil(256)
        .saturating_mul(256);
    if needed > ceiling {
        return None;
    }
    let mut plan = Box::new(StackPlan::copy_only(tgid, copy_bytes.min(ceiling)));
    spans.reverse();
    // Spans the copy holds whole are not read twice.
    let copy_top = rsp + u64::from(plan.copy_bytes);
    spans.retain(|span| span.addr + u64::from(span.len) > copy_top);
    let packed: Vec<u64> = spans
        .iter()
        .map(|span| tail_span::pack(span.addr, span.len))
        .collect::<Option<_>>()?;
    plan.span_count = packed.len() as u32;
    plan.spans[..packed.len()].copy_from_slice(&packed);
    Some(plan)
}

/// Whether `tail` (a plan learned from an earlier walk of the thread)
/// would have held for a tick at `rsp` whose walk to the root read the
/// words at `reads`: every one lies in the tail's copy from `rsp` or in one
/// of its spans. The walk over the tail's bytes reads the same words as
/// the walk over the whole stack as long as each is there, so this is
/// exactly whether the tail would have reached the root.
fn tail_holds(tail: &StackPlan, rsp: u64, reads: &[u64]) -> bool {
    let copy_end = rsp.saturating_add(u64::from(tail.copy_bytes));
    let spans = &tail.spans[..(tail.span_count as usize).min(MAX_TAIL_SPANS)];
    reads.iter().all(|&address| {
        address.saturating_add(8) <= copy_end
            || spans.iter().any(|&span| {
                let start = tail_span::addr(span);
                address >= start && address + 8 <= start + u64::from(tail_span::len(span))
            })
    })
}

/// A thread's stack for a learning walk: the sample's copy, then what
/// `process_vm_readv` finds above it in the live process now, fetched as
/// the walk goes. Remembers the address of every word the walk reads.
pub struct RemoteStack<'a> {
    tgid: u32,
    rsp: u64,
    copy: &'a [u8],
    /// Bytes fetched from the end of the copy upwards.
    fetched: &'a mut Vec<u8>,
    exhausted: bool,
    /// The process had exited when its stack was read.
    gone: bool,
    reads: &'a mut Vec<u64>,
}

impl<'a> RemoteStack<'a> {
    fn new(
        tgid: u32,
        rsp: u64,
        copy: &'a [u8],
        fetched: &'a mut Vec<u8>,
        reads: &'a mut Vec<u64>,
    ) -> Self {
        fetched.clear();
        Self {
            tgid,
            rsp,
            copy,
            fetched,
            exhausted: false,
            gone: false,
            reads,
        }
    }

    /// The sample's copy alone (a deep copy to the stack's end): nothing is
    /// read from the process.
    fn copy_only(
        tgid: u32,
        rsp: u64,
        copy: &'a [u8],
        fetched: &'a mut Vec<u8>,
        reads: &'a mut Vec<u64>,
    ) -> Self {
        Self {
            exhausted: true,
            ..Self::new(tgid, rsp, copy, fetched, reads)
        }
    }

    /// The end of the stack mapping the walk read: fetches up to it (not
    /// remembered as reads). `None` when it lies beyond what a learning
    /// read may fetch, or nothing could be read at all.
    fn stack_end(&mut self) -> Option<u64> {
        while self.fetch_more() {}
        (self.exhausted && !self.fetched.is_empty())
            .then(|| self.remote_start() + self.fetched.len() as u64)
    }

    /// Forgets the reads of a walk that is about to be made again.
    pub fn restart(&mut self) {
        self.reads.clear();
    }

    fn remote_start(&self) -> u64 {
        self.rsp + self.copy.len() as u64
    }

    /// Fetches the next chunk; false when nothing more can be read (the
    /// end of the stack mapping, the cap, or the process is gone).
    fn fetch_more(&mut self) -> bool {
        if self.exhausted || self.fetched.len() >= MAX_LEARN_BYTES {
            return false;
        }
        let from = self.remote_start() + self.fetched.len() as u64;
        let have = self.fetched.len();
        self.fetched.resize(have + LEARN_CHUNK_BYTES, 0);
        let got = match read_remote(self.tgid, from, &mut self.fetched[have..]) {
            Ok(got) => got,
            Err(error) => {
                // ESRCH for a zombie too: its memory went before it.
                self.gone = error.raw_os_error() == Some(libc::ESRCH);
                0
            }
        };
        self.fetched.truncate(have + got);
        if got < LEARN_CHUNK_BYTES {
            self.exhausted = true;
        }
        got > 0
    }
}

impl StackMemory for RemoteStack<'_> {
    fn read_u64(&mut self, address: u64) -> Result<u64, UnwindEnd> {
        let offset = address
            .checked_sub(self.rsp)
            .ok_or(UnwindEnd::BadStackAddress)?;
        let offset = usize::try_from(offset).map_err(|_| UnwindEnd::StackTruncated)?;
        // Beyond what a learning read may fetch: not read, and not
        // remembered (so planning never sees an address near the top of
        // the address space, whatever a corrupt stack pointed at).
        if offset >= self.copy.len() + MAX_LEARN_BYTES {
            return Err(UnwindEnd::StackTruncated);
        }
        self.reads.push(address);
        if let Some(word) = self.copy.get(offset..).and_then(|b| b.first_chunk::<8>()) {
            return Ok(u64::from_le_bytes(*word));
        }
        let at = offset
            .checked_sub(self.copy.len())
            .ok_or(UnwindEnd::StackTruncated)?;
        while self.fetched.len() < at + 8 {
            if !self.fetch_more() {
                return Err(UnwindEnd::StackTruncated);
            }
        }
        let word = self.fetched[at..]
            .first_chunk::<8>()
            .ok_or(UnwindEnd::StackTruncated)?;
        Ok(u64::from_le_bytes(*word))
    }
}

/// Reads `out.len()` bytes of process `tgid` at `address`, page by page so
/// that the read stops at the first unmapped page (the end of the stack
/// mapping) with everything before it; returns the bytes read.
fn read_remote(tgid: u32, address: u64, out: &mut [u8]) -> io::Result<usize> {
    const MAX_IOVECS: usize = LEARN_CHUNK_BYTES / PAGE_SIZE as usize + 1;
    let page = u64::from(PAGE_SIZE);
    let mut remote = [libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    }; MAX_IOVECS];
    let mut count = 0;
    let mut at = address;
    let end = address + out.len() as u64;
    while at < end && count < MAX_IOVECS {
        let next = ((at / page) + 1) * page;
        let len = next.min(end) - at;
        remote[count] = libc::iovec {
            iov_base: at as *mut libc::c_void,
            iov_len: len as usize,
        };
        count += 1;
        at += len;
    }
    let local = libc::iovec {
        iov_base: out.as_mut_ptr().cast(),
        iov_len: (at - address) as usize,
    };
    // SAFETY: `local` is `out` (or a prefix of it); the remote iovecs name
    // another process's memory, which the kernel reads with its checks.
    let read = unsafe {
        libc::process_vm_readv(
            tgid as libc::pid_t,
            &local,
            1,
            remote.as_ptr(),
            count as libc::c_ulong,
            0,
        )
    };
    if read < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(read as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A planner with the process records the walker keeps for it (their
    /// copy sizes), as the walker hands them over.
    struct Planning {
        planner: Planner,
        copies: HashMap<u32, Option<ProcessCopy>>,
    }

    impl Planning {
        fn new(ceiling: u32, deep_limit: u32, adaptive: bool) -> Self {
            Self {
                planner: Planner::new(ceiling, deep_limit, adaptive),
                copies: HashMap::new(),
            }
        }

        fn observe(&mut self, walk: &WalkReport) -> bool {
            let copy = self.copies.entry(walk.tgid).or_default();
            self.planner.observe(walk, Some(copy))
        }

        fn forget_process(&mut self, tgid: u32) {
            let copy = self.copies.remove(&tgid).flatten();
            self.planner.forget_process(tgid, copy);
        }
    }

    impl std::ops::Deref for Planning {
        type Target = Planner;
        fn deref(&self) -> &Planner {
            &self.planner
        }
    }

    impl std::ops::DerefMut for Planning {
        fn deref_mut(&mut self) -> &mut Planner {
            &mut self.planner
        }
    }

    const RSP: u64 = 0x7ffd_0000_0000;

    fn spans(plan: &StackPlan) -> Vec<(u64, u32)> {
        plan.spans[..plan.span_count as usize]
            .iter()
            .map(|&s| (tail_span::addr(s), tail_span::len(s)))
            .map(|(addr, len)| (addr - RSP, len))
            .collect()
    }

    #[test]
    fn deep_frames_become_spans_and_the_top_stays_a_copy() {
        // A frame every 4 KiB for 1 MiB: saved rbp and return address.
        let reads: Vec<u64> = (1..=256u64)
            .flat_map(|frame| [RSP + frame * 4096 - 16, RSP + frame * 4096 - 8])
            .collect();
        let plan = plan_for(7, RSP, &mut reads.clone(), 16 * 1024).expect("a plan");
        assert_eq!(plan.tgid, 7);
        // The minimal copy and its slack: every frame is a span.
        assert_eq!(plan.copy_bytes, 2048);
        let spans = spans(&plan);
        assert_eq!(spans.len(), 256);
        assert!(spans.len() < MAX_TAIL_SPANS);
        assert_eq!(spans[0], (4096 - 16, 16));
        assert_eq!(spans[255], (256 * 4096 - 16, 16));
        assert!(spans.windows(2).all(|w| w[0].0 < w[1].0), "ascending");
        assert_covered(&plan, &reads);
    }

    #[test]
    fn dense_slots_share_spans_up_to_the_span_limit() {
        // A word every 32 bytes from 2 KiB to 6 KiB.
        let reads: Vec<u64> = (64..192u64).map(|i| RSP + i * 32).collect();
        let plan = plan_for(1, RSP, &mut reads.clone(), 16 * 1024).expect("a plan");
        let spans = spans(&plan);
        assert!(spans.iter().all(|&(_, len)| len <= MAX_SPAN_BYTES));
        assert!(spans.len() < 128 / 4, "merged: {spans:?}");
        assert_covered(&plan, &reads);
    }

    /// Every read is in the copy or in a span.
    fn assert_covered(plan: &StackPlan, reads: &[u64]) {
        let copy_bytes = u64::from(plan.copy_bytes);
        let spans = spans(plan);
        for &address in reads {
            let offset = address - RSP;
            assert!(
                offset + 8 <= copy_bytes
                    || spans.iter().any(
                        |&(start, len)| offset >= start && offset + 8 <= start + u64::from(len)
                    ),
                "{address:#x} is neither copied nor in a span"
            );
        }
    }

    #[test]
    fn too_many_slots_leave_the_top_to_the_copy_or_give_no_plan() {
        // 2,000 frames 64 bytes apart (128 KiB): the spans take the deepest
        // ones up to the limits, the copy would have to hold the rest.
        let mut reads: Vec<u64> = (1..=2000u64).map(|i| RSP + i * 64 - 8).collect();
        assert!(plan_for(1, RSP, &mut reads, 32 * 1024).is_none());
        // With a lower reach the same layout fits.
        let reads: Vec<u64> = (1..=300u64).map(|i| RSP + i * 64 - 8).collect();
        let plan = plan_for(1, RSP, &mut reads.clone(), 32 * 1024).expect("a plan");
        assert_covered(&plan, &reads);
    }

    #[test]
    fn a_shallow_walk_needs_no_spans() {
        let mut reads = vec![RSP + 8, RSP + 40, RSP + 200];
        let plan = plan_for(1, RSP, &mut reads, 16 * 1024).expect("a plan");
        assert_eq!((plan.copy_bytes, plan.span_count), (2048, 0));
    }

    #[test]
    fn copy_sizes_follow_needs_with_headroom_within_limits() {
        assert_eq!(copy_size_for(0, 16384), MIN_USER_STACK_BYTES);
        assert_eq!(copy_size_for(1000, 16384), 1536);
        assert_eq!(copy_size_for(16384, 16384), 16384);
        assert_eq!(copy_size_for(u32::MAX, 16384), 16384);
        assert_eq!(copy_size_for(100, 256), 256);
    }

    fn report(tid: u32, ktime_ns: u64, copied: u32, read: u64, end: UnwindEnd) -> WalkReport {
        WalkReport {
            tgid: 10,
            tid,
            comm: [0; COMM_LEN],
            ktime_ns,
            rsp: 0x7000_0000,
            copied,
            copy_at_top: false,
            deep_copy: false,
            copy_faulted: false,
            copy_bytes_read: read,
            tail_reads: 0,
            end,
        }
    }

    /// The process copy-size updates among the queued ones.
    fn copy_updates(planner: &mut Planner) -> Vec<PlanUpdate> {
        planner
            .take_updates()
            .into_iter()
            .filter(|update| matches!(update, PlanUpdate::ProcessCopy { .. }))
            .collect()
    }

    /// The stack-top updates among the queued ones.
    fn top_updates(planner: &mut Planner) -> Vec<(u32, Option<u64>)> {
        planner
            .take_updates()
            .into_iter()
            .filter_map(|update| match update {
                PlanUpdate::ThreadTop { tid, top } => Some((tid, top.map(|t| t.top))),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_thread_top_follows_the_highest_word_its_rooted_walks_read() {
        let mut planner = Planning::new(16384, 0, true);
        let rsp = 0x7000_0000;
        planner.observe(&report(7, 0, 16384, 1003, UnwindEnd::Outermost));
        assert_eq!(top_updates(&mut planner), [(7, Some(rsp + 1008))]);
        // Lower reaches (and walks that did not reach the root) keep it.
        planner.observe(&report(7, 1, 16384, 900, UnwindEnd::Outermost));
        planner.observe(&report(7, 2, 16384, 16384, UnwindEnd::StackTruncated));
        assert_eq!(top_updates(&mut planner), []);
        planner.observe(&report(7, 3, 16384, 2000, UnwindEnd::Outermost));
        assert_eq!(top_updates(&mut planner), [(7, Some(rsp + 2000))]);
        assert_eq!(planner.stats().tops_written, 2);

        // A copy cut at the top ran out: the top goes, then comes back
        // from the next rooted walk.
        let cut = WalkReport {
            copy_at_top: true,
            ..report(7, 4, 2000, 2000, UnwindEnd::StackTruncated)
        };
        planner.observe(&cut);
        assert_eq!(top_updates(&mut planner), [(7, None)]);
        assert_eq!(planner.stats().tops_dropped, 1);
        planner.observe(&report(7, 5, 16384, 3000, UnwindEnd::Outermost));
        assert_eq!(top_updates(&mut planner), [(7, Some(rsp + 3000))]);

        // Even one this side no longer knows is dropped from the map.
        planner.observe(&WalkReport { tid: 8, ..cut });
        assert_eq!(top_updates(&mut planner), [(8, None)]);

        // The process's exit takes its threads' tops.
        planner.observe(&report(9, 6, 16384, 500, UnwindEnd::Outermost));
        planner.take_updates();
        planner.forget_process(10);
        let mut gone = top_updates(&mut planner);
        gone.sort_unstable();
        assert_eq!(gone, [(7, None), (9, None)]);
    }

    #[test]
    fn a_process_read_for_cpython_frames_from_now_on_loses_its_threads_tops() {
        let mut planner = Planning::new(16384, 0, true);
        let rsp = 0x7000_0000;
        planner.observe(&report(7, 0, 16384, 1000, UnwindEnd::Outermost));
        planner.observe(&report(8, 0, 16384, 1000, UnwindEnd::Outermost));
        let other_process = WalkReport {
            tgid: 11,
            ..report(9, 0, 16384, 1000, UnwindEnd::Outermost)
        };
        planner.observe(&other_process);
        planner.take_updates();
        planner.forget_tops(10);
        let mut gone = top_updates(&mut planner);
        gone.sort_unstable();
        assert_eq!(gone, [(7, None), (8, None)]);
        // The next rooted walk writes the top again (the sampler flags it).
        planner.observe(&report(7, 1, 16384, 1000, UnwindEnd::Outermost));
        assert_eq!(top_updates(&mut planner), [(7, Some(rsp + 1000))]);
        planner.forget_tops(11);
        assert_eq!(top_updates(&mut planner), [(9, None)]);
    }

    #[test]
    fn a_top_the_table_gave_up_is_written_again_at_the_next_rooted_walk() {
        let mut planner = Planning::new(16384, 0, true);
        let rooted = report(7, 0, 16384, 1000, UnwindEnd::Outermost);
        planner.observe(&rooted);
        assert_eq!(top_updates(&mut planner), [(7, Some(0x7000_0000 + 1000))]);
        planner.observe(&rooted);
        assert_eq!(top_updates(&mut planner), [], "written already");
        planner.top_evicted(7);
        assert_eq!(planner.stats().tops_evicted, 1);
        planner.observe(&rooted);
        assert_eq!(top_updates(&mut planner), [(7, Some(0x7000_0000 + 1000))]);
    }

    #[test]
    fn a_deep_copy_of_an_unplanned_thread_leaves_it_no_top_unless_it_was_shallow() {
        let mut planner = Planning::new(16384, 1 << 20, true);
        let deep = |tid, read| WalkReport {
            deep_copy: true,
            copy_faulted: false,
            ..report(tid, 0, 600_000, read, UnwindEnd::Outermost)
        };
        // The sampler's own deep copies to the thread pointer: a top would
        // end them, which only a stack the usual copy holds can afford.
        planner.observe(&deep(7, 590_000));
        assert_eq!(top_updates(&mut planner), []);
        planner.observe(&deep(8, 3000));
        assert_eq!(top_updates(&mut planner), [(8, Some(0x7000_0000 + 3000))]);
    }

    #[test]
    fn fixed_copies_write_no_tops() {
        let mut planner = Planning::new(16384, 0, false);
        planner.observe(&report(7, 0, 16384, 1000, UnwindEnd::Outermost));
        assert_eq!(top_updates(&mut planner), []);
    }

    #[test]
    fn a_process_copy_shrinks_to_its_need_and_grows_back_at_once() {
        let mut planner = Planning::new(16384, 0, true);
        assert!(!planner.observe(&report(10, 0, 16384, 1000, UnwindEnd::Outermost)));
        assert_eq!(
            copy_updates(&mut planner),
            [PlanUpdate::ProcessCopy {
                tgid: 10,
                bytes: Some(1536)
            }]
        );
        // The same need again: nothing to write.
        planner.observe(&report(10, 1, 1536, 900, UnwindEnd::Outermost));
        assert!(copy_updates(&mut planner).is_empty());
        // A walk ran out of a short copy: back to the ceiling, no learning.
        assert!(!planner.observe(&report(10, 2, 1536, 1536, UnwindEnd::StackTruncated)));
        assert_eq!(
            copy_updates(&mut planner),
            [PlanUpdate::ProcessCopy {
                tgid: 10,
                bytes: Some(16384)
            }]
        );
        // Out of the whole ceiling: learn the thread's tail.
        assert!(planner.observe(&report(11, 3, 16384, 16384, UnwindEnd::StackTruncated)));
        // Two windows later the need is small again.
        planner.observe(&report(10, 21_000_000_000, 1536, 900, UnwindEnd::Outermost));
        planner.observe(&report(10, 32_000_000_000, 1536, 900, UnwindEnd::Outermost));
        assert_eq!(
            copy_updates(&mut planner).last(),
            Some(&PlanUpdate::ProcessCopy {
                tgid: 10,
                bytes: Some(1536)
            })
        );
        planner.forget_process(10);
        assert_eq!(
            copy_updates(&mut planner),
            [PlanUpdate::ProcessCopy {
                tgid: 10,
                bytes: None
            }]
        );
    }

    #[test]
    fn without_adaptive_copies_nothing_is_planned() {
        let mut planner = Planning::new(16384, 0, false);
        assert!(!planner.observe(&report(10, 0, 16384, 16384, UnwindEnd::StackTruncated)));
        assert!(planner.take_updates().is_empty());
    }

    #[test]
    fn learning_reads_this_process_and_is_rate_limited() {
        // Learn from this very process: a "stack" that is a buffer of ours.
        let stack: Vec<u64> = (0..4096u64).collect();
        let rsp = stack.as_ptr() as u64;
        let copy: Vec<u8> = stack[..16].iter().flat_map(|w| w.to_le_bytes()).collect();
        let mut planner = Planning::new(16384, 0, true);
        let walk = WalkReport {
            tgid: std::process::id(),
            tid: 1,
            comm: [0; COMM_LEN],
            ktime_ns: 1_000,
            rsp,
            copied: 128,
            copy_at_top: false,
            deep_copy: false,
            copy_faulted: false,
            copy_bytes_read: 128,
            tail_reads: 0,
            end: UnwindEnd::StackTruncated,
        };
        let target = rsp + 8 * 3000;
        let mut seen = None;
        planner.learn(&walk, &copy, |memory| {
            // Words past the copy come from the live buffer.
            seen = Some(memory.read_u64(rsp + 8 * 20).unwrap());
            assert_eq!(memory.read_u64(target), Ok(3000));
            UnwindEnd::Outermost
        });
        assert_eq!(seen, Some(20));
        let updates = planner.take_updates();
        // The top goes after it: the sampler would not look the plan up.
        let [
            PlanUpdate::Thread {
                tid: 1,
                plan: Some(plan),
            },
            PlanUpdate::ThreadTop { tid: 1, top: None },
        ] = updates.as_slice()
        else {
            panic!("expected a plan, got {updates:?}");
        };
        assert_eq!(plan.span_count, 1);
        assert_eq!(tail_span::addr(plan.spans[0]), target);
        assert_eq!(planner.stats().plans_learned, 1);
        // Again within the interval: not learned.
        planner.learn(&walk, &copy, |_| panic!("learned twice"));
        // A walk that does not reach the root gives no plan.
        let later = WalkReport {
            ktime_ns: 1_000 + LEARN_INTERVAL_NS,
            ..walk
        };
        planner.learn(&later, &copy, |_| UnwindEnd::StackTruncated);
        assert_eq!(planner.stats().learn_failed, 1);
        planner.forget_process(std::process::id());
        assert_eq!(
            planner.take_updates(),
            [PlanUpdate::Thread { tid: 1, plan: None }]
        );
        // Far past any stack: refused without being remembered.
        let mut far = None;
        let later_still = WalkReport { tid: 2, ..walk };
        planner.learn(&later_still, &copy, |memory| {
            far = Some(memory.read_u64(u64::MAX - 7));
            UnwindEnd::Outermost
        });
        assert_eq!(far, Some(Err(UnwindEnd::StackTruncated)));
        assert!(planner.reads.is_empty(), "{:?}", planner.reads);
    }

    /// A fake thread stack in this process: `pages` readable pages with an
    /// inaccessible page above them, where a stack mapping would end.
    struct FakeStack {
        base: *mut u8,
        len: usize,
    }

    impl FakeStack {
        fn new(pages: usize) -> Self {
            let len = (pages + 1) * PAGE_SIZE as usize;
            // SAFETY: a fresh anonymous mapping, unmapped on drop.
            let base = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            assert_ne!(base, libc::MAP_FAILED);
            let guard = len - PAGE_SIZE as usize;
            // SAFETY: the last page of the mapping made above.
            let ret = unsafe {
                libc::mprotect(
                    base.cast::<u8>().add(guard).cast(),
                    PAGE_SIZE as usize,
                    libc::PROT_NONE,
                )
            };
            assert_eq!(ret, 0);
            Self {
                base: base.cast(),
                len,
            }
        }

        fn rsp(&self) -> u64 {
            self.base as u64
        }

        /// Where the readable part ends.
        fn end(&self) -> u64 {
            self.base as u64 + (self.len - PAGE_SIZE as usize) as u64
        }
    }

    impl Drop for FakeStack {
        fn drop(&mut self) {
            // SAFETY: the mapping made in `new`.
            unsafe { libc::munmap(self.base.cast(), self.len) };
        }
    }

    /// What `learn` queued for thread `tid`: its plan, if one.
    fn learned(planner: &mut Planner, tid: u32) -> Option<Box<StackPlan>> {
        learned_and_programs(planner, tid).0
    }

    /// A program marked (true) or unmarked as deep in the sampler's map.
    type DeepProgram = ([u8; COMM_LEN], bool);

    /// The same, and the programs it marked or unmarked as deep.
    fn learned_and_programs(
        planner: &mut Planner,
        tid: u32,
    ) -> (Option<Box<StackPlan>>, Vec<DeepProgram>) {
        let mut plan = None;
        let mut programs = Vec::new();
        for update in planner.take_updates() {
            match update {
                PlanUpdate::Thread { tid: t, plan: p } if t == tid => plan = p,
                PlanUpdate::DeepProgram { comm, deep } => programs.push((comm, deep)),
                _ => {}
            }
        }
        (plan, programs)
    }

    /// A truncated walk of a thread of `rustc` on `rsp`.
    fn rustc_walk(rsp: u64, tid: u32, ktime_ns: u64) -> WalkReport {
        let mut comm = [0; COMM_LEN];
        comm[..5].copy_from_slice(b"rustc");
        WalkReport {
            tgid: std::process::id(),
            tid,
            comm,
            ktime_ns,
            rsp,
            copied: 16384,
            copy_at_top: false,
            deep_copy: false,
            copy_faulted: false,
            copy_bytes_read: 16384,
            tail_reads: 0,
            end: UnwindEnd::StackTruncated,
        }
    }

    /// A learning walk that reads one word 40,000 bytes above `rsp` and
    /// reaches the root, or ends where that read fails.
    fn to_the_root_past(rsp: u64) -> impl Fn(&mut RemoteStack<'_>) -> UnwindEnd + Copy {
        move |memory| {
            memory
                .read_u64(rsp + 40_000)
                .map_or_else(|end| end, |_| UnwindEnd::Outermost)
        }
    }

    #[test]
    fn a_tail_that_goes_stale_becomes_a_deep_copy_for_the_thread_and_its_program() {
        let stack = FakeStack::new(16);
        let rsp = stack.rsp();
        let copy = [0u8; 128];
        let walk_to_the_root = to_the_root_past(rsp);
        let walk = rustc_walk(rsp, 1, 1_000);
        let comm = walk.comm;
        let mut planner = Planning::new(16384, 1 << 20, true);
        // First a tail, as for any deep thread.
        planner.learn(&walk, &copy, walk_to_the_root);
        let tail = learned(&mut planner, 1).expect("a tail plan");
        assert_eq!((tail.stack_end, tail.span_count), (0, 1));
        // It ran out again soon after: stale once, a tail again; stale
        // twice, the whole stack is copied, up to the end of the mapping the
        // learning read found.
        let soon = WalkReport {
            ktime_ns: walk.ktime_ns + STALE_RELEARN_NS,
            ..walk
        };
        planner.learn(&soon, &copy, walk_to_the_root);
        assert_eq!(learned(&mut planner, 1).expect("a plan").stack_end, 0);
        let soon = WalkReport {
            ktime_ns: soon.ktime_ns + STALE_RELEARN_NS,
            ..soon
        };
        planner.learn(&soon, &copy, walk_to_the_root);
        let (deep, programs) = learned_and_programs(&mut planner, 1);
        let deep = deep.expect("a deep plan");
        assert_eq!(deep.stack_end, stack.end());
        assert_eq!((deep.copy_bytes, deep.span_count), (16384, 0));
        // The program goes into the sampler's map, where its threads not
        // learned yet wake the reader at their first tick.
        assert_eq!(programs, [(comm, true)]);
        // Another thread of the same program goes deep at once, and the
        // program is not written again.
        let sibling = WalkReport { tid: 2, ..soon };
        planner.learn(&sibling, &copy, walk_to_the_root);
        let (plan, programs) = learned_and_programs(&mut planner, 2);
        assert_eq!(plan.expect("a plan").stack_end, stack.end());
        assert_eq!(programs, []);
        let stats = planner.stats();
        assert_eq!((stats.plans_learned, stats.deep_plans_learned), (4, 2));
        assert_eq!((stats.thread_plans, stats.thread_deep_plans), (2, 2));

        // Without deep copies a stale tail is learned again as a tail ...
        let mut planner = Planning::new(16384, 0, true);
        planner.learn(&walk, &copy, walk_to_the_root);
        planner.learn(&soon, &copy, walk_to_the_root);
        let plans: Vec<_> = planner
            .take_updates()
            .into_iter()
            .filter(|u| !matches!(u, PlanUpdate::ThreadTop { top: None, .. }))
            .collect();
        assert_eq!(plans.len(), 2);
        assert!(
            plans
                .iter()
                .all(|u| matches!(u, PlanUpdate::Thread { plan: Some(p), .. } if p.stack_end == 0))
        );
        // ... as it is when the stack is deeper than the deep limit.
        let mut planner = Planning::new(16384, 32 * 1024, true);
        planner.learn(&walk, &copy, walk_to_the_root);
        planner.learn(&soon, &copy, walk_to_the_root);
        assert_eq!(planner.stats().deep_plans_learned, 0);
        assert_eq!(planner.stats().plans_learned, 2);
    }

    #[test]
    fn threads_of_one_program_whose_tails_each_go_stale_once_make_the_next_deep() {
        let stack = FakeStack::new(16);
        let rsp = stack.rsp();
        let copy = [0u8; 128];
        let walk_to_the_root = to_the_root_past(rsp);
        let first = rustc_walk(rsp, 1, 1_000);
        let comm = first.comm;
        let mut planner = Planning::new(16384, 1 << 20, true);
        // Short-lived threads, one after the other: each is planned a
        // tail, which goes stale once before the thread is gone.
        let mut at = first.ktime_ns;
        for tid in 1..=STALE_TAILS_FOR_DEEP as u32 {
            let walk = WalkReport {
                tid,
                ktime_ns: at,
                ..first
            };
            planner.learn(&walk, &copy, walk_to_the_root);
            assert_eq!(learned(&mut planner, tid).expect("a tail").stack_end, 0);
            let stale = WalkReport {
                ktime_ns: at + STALE_RELEARN_NS,
                ..walk
            };
            planner.learn(&stale, &copy, walk_to_the_root);
            let (plan, programs) = learned_and_programs(&mut planner, tid);
            if tid < STALE_TAILS_FOR_DEEP as u32 {
                assert_eq!(plan.expect("a tail again").stack_end, 0);
                assert_eq!(programs, []);
            } else {
                // Enough of the program's tails went stale: deep, and the
                // program with it.
                assert_eq!(plan.expect("a deep plan").stack_end, stack.end());
                assert_eq!(programs, [(comm, true)]);
            }
            at += LEARN_INTERVAL_NS;
        }
        // The program's next thread is copied deep from its first learn;
        // another program's is not.
        let next = WalkReport {
            tid: 100,
            ktime_ns: at,
            ..first
        };
        planner.learn(&next, &copy, walk_to_the_root);
        assert_eq!(
            learned(&mut planner, 100).expect("a plan").stack_end,
            stack.end()
        );
        let mut other = [0; COMM_LEN];
        other[..3].copy_from_slice(b"gcc");
        let other = WalkReport {
            tid: 101,
            comm: other,
            ..next
        };
        planner.learn(&other, &copy, walk_to_the_root);
        assert_eq!(learned(&mut planner, 101).expect("a tail").stack_end, 0);
    }

    #[test]
    fn a_programs_threads_gone_before_they_are_learned_make_it_deep() {
        let copy = [0u8; 128];
        let exited = || {
            let mut process = std::process::Command::new("true")
                .spawn()
                .expect("running true");
            process.wait().expect("waiting for true");
            process.id()
        };
        let (gone, gone_too) = (exited(), exited());
        let mut planner = Planning::new(16384, 1 << 20, true);
        // A thread of this process whose stack ends before the walk needs
        // it: a failed learn, but not a late one.
        let stack = FakeStack::new(4);
        let short = rustc_walk(stack.rsp(), 1, 1_000);
        let comm = short.comm;
        planner.learn(&short, &copy, to_the_root_past(stack.rsp()));
        let sibling = WalkReport { tid: 2, ..short };
        planner.learn(&sibling, &copy, to_the_root_past(stack.rsp()));
        assert_eq!(learned_and_programs(&mut planner, 1), (None, vec![]));
        assert_eq!(planner.stats().learn_too_late, 0);
        // Threads of a process that exited before they were learned count
        // once; one of a second such process makes the program deep.
        let late = WalkReport {
            tgid: gone,
            tid: 3,
            rsp: RSP,
            ktime_ns: 2_000,
            ..short
        };
        planner.learn(&late, &copy, to_the_root_past(RSP));
        planner.learn(&WalkReport { tid: 4, ..late }, &copy, to_the_root_past(RSP));
        assert_eq!(learned_and_programs(&mut planner, 4), (None, vec![]));
        let other = WalkReport {
            tgid: gone_too,
            tid: 5,
            ..late
        };
        planner.learn(&other, &copy, to_the_root_past(RSP));
        assert_eq!(
            learned_and_programs(&mut planner, 5),
            (None, vec![(comm, true)])
        );
        let stats = planner.stats();
        assert_eq!((stats.learn_failed, stats.learn_too_late), (5, 3));
        // The program's next thread, learned while it lives, is copied
        // deep at once.
        let stack = FakeStack::new(16);
        let next = rustc_walk(stack.rsp(), 6, 3_000);
        planner.learn(&next, &copy, to_the_root_past(stack.rsp()));
        let plan = learned(&mut planner, 6).expect("a plan");
        assert_eq!(plan.stack_end, stack.end());
    }

    #[test]
    fn a_deep_programs_thread_whose_learning_walk_lost_its_way_is_copied_deep() {
        let stack = FakeStack::new(16);
        let rsp = stack.rsp();
        let copy = [0u8; 128];
        // The stack above the tick's copy changed before it was read: the
        // walk through it ends at an address in no mapping.
        let lost = move |memory: &mut RemoteStack<'_>| {
            memory.read_u64(rsp + 40_000).expect("readable");
            UnwindEnd::Unmapped
        };
        let mut planner = Planning::new(16384, 1 << 20, true);
        let walk = rustc_walk(rsp, 1, 1_000);
        planner.learn(&walk, &copy, lost);
        assert!(learned(&mut planner, 1).is_none(), "any program's thread");
        planner.add_deep_program(walk.comm, walk.tgid);
        let walk = rustc_walk(rsp, 2, 2_000);
        planner.learn(&walk, &copy, lost);
        let plan = learned(&mut planner, 2).expect("a deep program's thread");
        assert_eq!(plan.stack_end, stack.end());
        // Its relearn losing its way (on another stack, a signal's) keeps
        // the plan it has.
        let later = WalkReport {
            ktime_ns: walk.ktime_ns + LEARN_INTERVAL_NS,
            ..walk
        };
        planner.learn(&later, &copy, lost);
        assert!(learned(&mut planner, 2).is_none(), "the plan stays");
        // Not when the stack is longer than a deep copy.
        let mut planner = Planning::new(16384, 32768, true);
        planner.add_deep_program(walk.comm, walk.tgid);
        planner.learn(&walk, &copy, lost);
        assert!(learned(&mut planner, 2).is_none(), "past the deep limit");
    }

    #[test]
    fn a_programs_stale_tails_count_once_each_and_only_close_together() {
        let stack = FakeStack::new(16);
        let rsp = stack.rsp();
        let copy = [0u8; 128];
        let walk_to_the_root = to_the_root_past(rsp);
        let walk = |tid, ktime_ns| rustc_walk(rsp, tid, ktime_ns);
        let deep = |planner: &mut Planner, tid| {
            learned(planner, tid).expect("a plan").stack_end == stack.end()
        };
        let second = 1_000_000_000;
        let mut planner = Planning::new(16384, 1 << 20, true);
        // One stale tail of thread 1.
        planner.learn(&walk(1, second), &copy, walk_to_the_root);
        planner.learn(&walk(1, second + STALE_RELEARN_NS), &copy, walk_to_the_root);
        assert!(!deep(&mut planner, 1));
        // Thread 2's tail goes stale while the learning budget is spent:
        // its relearns are throttled, and count nothing, however many.
        planner.learn(&walk(2, 2 * second), &copy, walk_to_the_root);
        assert!(!deep(&mut planner, 2));
        for tid in 1001..1000 + LEARNS_PER_SECOND {
            planner.learn(&walk(tid, 2 * second + 1), &copy, |_| UnwindEnd::Unmapped);
        }
        for tick in 1..=5 {
            let at = 2 * second + tick * STALE_RELEARN_NS;
            planner.learn(&walk(2, at), &copy, walk_to_the_root);
        }
        assert_eq!(planner.stats().learn_throttled, 5);
        // One stale tail so far: thread 3 gets a tail.
        planner.learn(&walk(3, 3 * second), &copy, walk_to_the_root);
        assert!(!deep(&mut planner, 3));
        // A stale tail long after the program's last one starts the count
        // again: thread 4 keeps a tail; the next one within the window
        // makes thread 5 deep.
        let late = second + STALE_RELEARN_NS + PROGRAM_STALE_WINDOW_NS + second;
        planner.learn(&walk(4, late), &copy, walk_to_the_root);
        assert!(!deep(&mut planner, 4));
        planner.learn(&walk(4, late + STALE_RELEARN_NS), &copy, walk_to_the_root);
        assert!(!deep(&mut planner, 4));
        planner.learn(&walk(5, late + second), &copy, walk_to_the_root);
        assert!(!deep(&mut planner, 5));
        planner.learn(
            &walk(5, late + second + STALE_RELEARN_NS),
            &copy,
            walk_to_the_root,
        );
        assert!(deep(&mut planner, 5), "two stale tails within the window");

        // Without deep copies the program's threads keep their tails.
        let mut planner = Planning::new(16384, 0, true);
        for tid in 1..=3 {
            let at = u64::from(tid) * second;
            planner.learn(&walk(tid, at), &copy, walk_to_the_root);
            planner.learn(&walk(tid, at + STALE_RELEARN_NS), &copy, walk_to_the_root);
        }
        planner.learn(&walk(9, 4 * second), &copy, walk_to_the_root);
        assert_eq!(learned(&mut planner, 9).expect("a tail").span_count, 1);
    }

    /// A walk that reads the words at `offsets` above `rsp`, then is at
    /// the root.
    fn reading(rsp: u64, offsets: &'static [u64]) -> impl Fn(&mut RemoteStack<'_>) -> UnwindEnd {
        move |memory| {
            for &offset in offsets {
                if let Err(end) = memory.read_u64(rsp + offset) {
                    return end;
                }
            }
            UnwindEnd::Outermost
        }
    }

    /// The sampler's own deep copy (to the thread's stack end, 100 KB up)
    /// of thread `tid` of a process that is not this one (nothing may be
    /// read from it), at `ktime_ns`.
    fn deep_copy_walk(tid: u32, ktime_ns: u64) -> WalkReport {
        WalkReport {
            tgid: u32::MAX,
            rsp: RSP,
            deep_copy: true,
            ..report(tid, ktime_ns, 100_000, 90_000, UnwindEnd::Outermost)
        }
    }

    const DEEP_WORDS: &[u64] = &[100, 20_000, 20_008, 60_000, 60_008, 89_992];
    const MOVED_WORDS: &[u64] = &[100, 24_000, 24_008, 61_000, 61_008, 89_992];

    #[test]
    fn a_thread_copied_deep_before_it_was_learned_gets_a_tail_once_a_later_walk_shows_it_holds() {
        let mut planner = Planning::new(16384, 1 << 20, true);
        let copy = vec![0u8; 100_000];
        let first = deep_copy_walk(7, 0);
        assert!(planner.observe(&first), "learned from the copy");
        planner.learn(&first, &copy, reading(RSP, DEEP_WORDS));
        // Nothing written yet: the sampler keeps copying it deep.
        assert!(learned(&mut planner, 7).is_none());
        // Too soon for the check.
        let soon = deep_copy_walk(7, CHECK_INTERVAL_NS / 2);
        planner.learn(&soon, &copy, reading(RSP, DEEP_WORDS));
        assert!(learned(&mut planner, 7).is_none());
        let later = deep_copy_walk(7, CHECK_INTERVAL_NS);
        planner.learn(&later, &copy, reading(RSP, DEEP_WORDS));
        assert!(
            learned(&mut planner, 7).is_none(),
            "one check is not enough"
        );
        let later_still = deep_copy_walk(7, 2 * CHECK_INTERVAL_NS);
        planner.learn(&later_still, &copy, reading(RSP, DEEP_WORDS));
        let tail = learned(&mut planner, 7).expect("the tail, which held");
        assert_eq!(tail.stack_end, 0, "a tail, not a deep copy");
        assert_eq!(spans(&tail), [(20_000, 16), (60_000, 16), (89_992, 8)]);
        assert_eq!(planner.stats().thread_plans, 1);
        assert_eq!(planner.stats().thread_deep_plans, 0);
        // Planned now: its next walks are not learned from again.
        assert!(!planner.observe(&deep_copy_walk(7, 3 * CHECK_INTERVAL_NS)));
    }

    #[test]
    fn a_thread_copied_deep_whose_frames_keep_moving_gets_a_deep_copy_and_marks_its_program() {
        let mut planner = Planning::new(16384, 1 << 20, true);
        let copy = vec![0u8; 100_000];
        let mut comm = [0; COMM_LEN];
        comm[..5].copy_from_slice(b"rustc");
        let walk = |at| WalkReport {
            comm,
            ..deep_copy_walk(7, at)
        };
        planner.learn(&walk(0), &copy, reading(RSP, DEEP_WORDS));
        // The frames moved: the first tail would not have held.
        planner.learn(&walk(CHECK_INTERVAL_NS), &copy, reading(RSP, MOVED_WORDS));
        assert!(learned(&mut planner, 7).is_none(), "one miss is not enough");
        planner.learn(
            &walk(2 * CHECK_INTERVAL_NS),
            &copy,
            reading(RSP, DEEP_WORDS),
        );
        let (plan, programs) = learned_and_programs(&mut planner, 7);
        let plan = plan.expect("a deep copy");
        assert_eq!(plan.stack_end, RSP + 100_000, "to the end of the deep copy");
        assert_eq!(programs, [(comm, true)]);
        assert_eq!(planner.stats().thread_deep_plans, 1);

        // Another thread of the program: deep at its first walk.
        planner.learn(
            &WalkReport { tid: 8, ..walk(0) },
            &copy,
            reading(RSP, DEEP_WORDS),
        );
        assert!(learned(&mut planner, 8).is_some_and(|plan| plan.stack_end != 0));
        // To be remembered across restarts, once.
        assert_eq!(planner.take_newly_deep(), [(u32::MAX, comm)]);

        // A program an earlier agent remembered: deep at its first walk,
        // and not remembered again.
        let mut planner = Planning::new(16384, 1 << 20, true);
        planner.remember_deep_programs(&[comm], 0);
        planner.learn(&walk(0), &copy, reading(RSP, DEEP_WORDS));
        assert!(learned(&mut planner, 7).is_some_and(|plan| plan.stack_end != 0));
        assert!(planner.take_newly_deep().is_empty());
    }

    #[test]
    fn a_thread_copied_deep_whose_walk_ends_early_gets_the_usual_copy() {
        let mut planner = Planning::new(16384, 1 << 20, true);
        let copy = vec![0u8; 100_000];
        let early = WalkReport {
            copy_bytes_read: 2_000,
            end: UnwindEnd::NoUnwindInfo,
            ..deep_copy_walk(7, 0)
        };
        assert!(planner.observe(&early));
        planner.learn(&early, &copy, |_| UnwindEnd::NoUnwindInfo);
        assert!(
            learned(&mut planner, 7).is_none(),
            "one early end is not enough"
        );
        for at in 1..EARLY_ENDS_FOR_USUAL_COPY {
            let later = WalkReport {
                ktime_ns: u64::from(at) * CHECK_INTERVAL_NS,
                ..early
            };
            planner.learn(&later, &copy, |_| UnwindEnd::NoUnwindInfo);
        }
        let plan = learned(&mut planner, 7).expect("a plan");
        assert_eq!(
            (plan.copy_bytes, plan.span_count, plan.stack_end),
            (16384, 0, 0)
        );
    }

    #[test]
    fn a_tail_holds_when_every_word_read_is_in_its_copy_or_spans() {
        let mut reads: Vec<u64> = DEEP_WORDS.iter().map(|offset| RSP + offset).collect();
        let tail = plan_for(1, RSP, &mut reads, 16384).expect("a tail");
        assert!(tail_holds(&tail, RSP, &reads));
        // A tick a little deeper: its copy starts lower, the spans stay.
        assert!(tail_holds(&tail, RSP - 512, &reads));
        let moved: Vec<u64> = MOVED_WORDS.iter().map(|offset| RSP + offset).collect();
        assert!(!tail_holds(&tail, RSP, &moved));
        // One word past a span's end.
        assert!(!tail_holds(&tail, RSP, &[RSP + 60_016]));
    }
}
