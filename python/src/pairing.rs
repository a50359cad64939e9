//! Python stacks and the samples they go with.
//!
//! The BPF program writes a process's Python stack just before the tick's
//! sample, from the same CPU, both with the tick's time; [`StackPairing`]
//! keeps it as that CPU's pending stack and hands it to the next sample
//! from the CPU when it is its tick's (same thread, same time; anything
//! else is a stack whose sample was lost). The pair then waits in the
//! process's [`PythonState`] until the walk of the sample comes (a walk can
//! wait for a table), and is merged there ([`crate::merge`]).

use std::{collections::VecDeque, ops::Range};

use agent_common::{PythonFrame, PythonStackHeader, SampleHeader, python_stack_flags};

use crate::CodeCache;

/// Samples of one process whose Python stacks wait for their walk at most:
/// walks wait for their tables for tens of milliseconds, a few hundred
/// samples at most at the highest rates.
pub const MAX_WAITING_STACKS: usize = 1024;

/// A CPU number past any plausible machine's: a record that carries one is
/// bad (and would grow the pending stacks without bound).
const MAX_CPUS: usize = 4096;

/// What a process's record knows of its interpreter.
#[derive(Debug, Default)]
pub enum PythonRecord {
    /// Not looked for (no file of the process named like an interpreter
    /// seen yet).
    #[default]
    Unknown,
    /// Being looked for.
    Asked,
    /// Looked for: none, or one this profiler does not read.
    None,
    Found(Box<PythonState>),
}

/// A Python stack as the sampler read it.
#[derive(Debug, Default)]
pub struct ReadStack {
    /// Innermost first.
    pub frames: Box<[PythonFrame]>,
    /// The read stopped before the outermost frame (the sampler's frame
    /// limit, or a read that failed).
    pub cut: bool,
}

/// A CPython process the sampler reads the frames of.
#[derive(Debug)]
pub struct PythonState {
    /// Where the interpreter's frame evaluation function lies.
    pub eval: Vec<Range<u64>>,
    pub codes: CodeCache,
    /// Python stacks by the (thread, time) of their sample, oldest first.
    pub waiting: VecDeque<Waiting>,
}

/// A Python stack waiting for its sample's walk.
#[derive(Debug)]
pub struct Waiting {
    tid: u32,
    ktime_ns: u64,
    /// Its sample is an off-CPU one, walked at its switch-in, after ticks
    /// taken later: their walks do not drop it as stale.
    walked_late: bool,
    stack: ReadStack,
}

impl PythonState {
    pub fn new(eval: Vec<Range<u64>>, codes: CodeCache) -> Self {
        Self {
            eval,
            codes,
            waiting: VecDeque::new(),
        }
    }

    /// Keeps `stack` for the walk of the sample with `header` (the oldest
    /// waiting one goes when [`MAX_WAITING_STACKS`] wait), its code objects
    /// read now: the walk may wait for the process's maps, and a
    /// short-lived process, its code objects with it, may be gone by then.
    pub fn wait_for_walk(&mut self, header: &SampleHeader, stack: ReadStack) {
        for frame in &stack.frames {
            // Kept in the cache, named or not, for the walk.
            let _ = self
                .codes
                .get(frame.code, frame.first_line & !PythonFrame::ENTRY);
        }
        if self.waiting.len() >= MAX_WAITING_STACKS {
            self.waiting.pop_front();
        }
        self.waiting.push_back(Waiting {
            tid: header.tid,
            ktime_ns: header.ktime_ns,
            walked_late: header.flags & agent_common::sample_flags::OFF_CPU != 0,
            stack,
        });
    }

    /// The Python stack of the sample with `header`, if one came with it.
    pub fn take_stack(&mut self, header: &SampleHeader) -> Option<ReadStack> {
        if self.waiting.is_empty() {
            return None;
        }
        let at = self
            .waiting
            .iter()
            .position(|w| w.tid == header.tid && w.ktime_ns == header.ktime_ns)?;
        let stack = self.waiting.remove(at)?.stack;
        // Older ones had their samples walked without them (dropped),
        // unless theirs are walked late.
        let mut index = 0;
        self.waiting.retain(|waiting| {
            index += 1;
            index > at || waiting.walked_late
        });
        Some(stack)
    }
}

/// A Python stack waiting for the next sample of its CPU.
#[derive(Debug)]
struct Pending {
    tid: u32,
    ktime_ns: u64,
    stack: ReadStack,
}

/// Each CPU's Python stack waiting for its sample (see the module
/// documentation).
#[derive(Debug, Default)]
pub struct StackPairing {
    /// By CPU.
    pending: Vec<Option<Pending>>,
}

impl StackPairing {
    /// Keeps a Python stack (`header` and its `frames`) for the next sample
    /// of its CPU.
    pub fn keep(&mut self, header: &PythonStackHeader, frames: impl Iterator<Item = PythonFrame>) {
        let cpu = header.cpu as usize;
        if cpu >= MAX_CPUS {
            return;
        }
        if self.pending.len() <= cpu {
            self.pending.resize_with(cpu + 1, || None);
        }
        self.pending[cpu] = Some(Pending {
            tid: header.tid,
            ktime_ns: header.ktime_ns,
            stack: ReadStack {
                frames: frames.collect(),
                cut: header.flags
                    & (python_stack_flags::TRUNCATED | python_stack_flags::READ_FAILED)
                    != 0,
            },
        });
    }

    /// The Python stack taken for the sample with `header`, if any: the
    /// pending stack of its CPU, when it is its tick's.
    pub fn for_sample(&mut self, header: &SampleHeader) -> Option<ReadStack> {
        let pending = self.pending.get_mut(header.cpu as usize)?.take()?;
        let ours = pending.tid == header.tid && header.ktime_ns == pending.ktime_ns;
        ours.then_some(pending.stack)
    }
}

#[cfg(test)]
mod tests {
    use agent_common::{COMM_LEN, RecordKind};

    use super::*;
    use crate::Layout;

    fn frame(code: u64) -> PythonFrame {
        PythonFrame {
            code,
            instr_offset: 0,
            first_line: 1 | PythonFrame::ENTRY,
        }
    }

    /// Keeps a one-frame stack (code `code`) read on `cpu` by thread `tid`
    /// at `ktime_ns`, with the sampler's `flags`.
    fn keep(pairing: &mut StackPairing, cpu: u32, tid: u32, ktime_ns: u64, code: u64, flags: u32) {
        let header = PythonStackHeader {
            kind: RecordKind::PythonStack as u32,
            cpu,
            tgid: tid,
            tid,
            frames: 1,
            flags,
            ktime_ns,
        };
        pairing.keep(&header, std::iter::once(frame(code)));
    }

    fn sample(cpu: u32, tid: u32, ktime_ns: u64) -> SampleHeader {
        SampleHeader {
            kind: RecordKind::Sample as u32,
            flags: 0,
            tgid: tid,
            tid,
            cpu,
            kernel_stack_len: 0,
            user_stack_len: 0,
            sampling_divisor: 1,
            ktime_ns,
            cgroup_id: 0,
            user_rip: 0,
            user_rsp: 0,
            user_rbp: 0,
            comm: [0; COMM_LEN],
            tail_len: 0,
            tail_spans: 0,
            process_start_ns: 0,
        }
    }

    #[test]
    fn a_stack_goes_with_the_next_sample_of_its_cpu_and_thread_only() {
        let mut pairing = StackPairing::default();
        keep(&mut pairing, 1, 7, 1_000, 0xa, 0);
        keep(&mut pairing, 0, 8, 1_000, 0xb, 0);
        // CPU 0's next sample is another thread's: its stack was its own
        // sample's, which was lost; it goes.
        assert!(pairing.for_sample(&sample(0, 9, 1_000)).is_none());
        assert!(pairing.for_sample(&sample(0, 8, 1_000)).is_none());
        // CPU 1's is the same thread's tick.
        let stack = pairing.for_sample(&sample(1, 7, 1_000)).expect("paired");
        assert_eq!(stack.frames[0].code, 0xa);
        assert!(!stack.cut);
        // Taken once.
        assert!(pairing.for_sample(&sample(1, 7, 1_000)).is_none());
        // The same thread's sample of a later tick (the stack's own was
        // lost) is not the stack's, however soon.
        keep(&mut pairing, 1, 7, 10_000, 0xc, 0);
        assert!(pairing.for_sample(&sample(1, 7, 10_001)).is_none());
        // A read the sampler cut short (its frame limit, a failed read)
        // says so.
        for flags in [
            python_stack_flags::TRUNCATED,
            python_stack_flags::READ_FAILED,
        ] {
            keep(&mut pairing, 1, 7, 20_000, 0xe, flags);
            let stack = pairing.for_sample(&sample(1, 7, 20_000)).expect("paired");
            assert!(stack.cut, "flags {flags:#x}");
        }
        // A CPU number no machine has is a bad record, not a huge vector.
        keep(&mut pairing, u32::MAX, 7, 1, 0xd, 0);
        assert!(pairing.pending.len() <= 2);
    }

    #[test]
    fn a_walk_finds_its_samples_stack_and_drops_older_ones() {
        // No process has this id (above the kernel's PID_MAX_LIMIT, 2^22): the
        // code objects read as the stacks wait are unreadable.
        let codes = CodeCache::new(1 << 23, Layout::of((3, 12)).expect("3.12"));
        let mut state = PythonState::new(Vec::new(), codes);
        for (ktime, code) in [(100, 0x1), (200, 0x2), (300, 0x3)] {
            let stack = ReadStack {
                frames: vec![frame(code)].into(),
                cut: false,
            };
            state.wait_for_walk(&sample(0, 7, ktime), stack);
        }
        // The walk of the second sample: the first one's stack is stale.
        let stack = state.take_stack(&sample(0, 7, 200)).expect("its stack");
        assert_eq!(stack.frames[0].code, 0x2);
        assert_eq!(state.waiting.len(), 1);
        assert!(
            state.take_stack(&sample(0, 8, 300)).is_none(),
            "another thread"
        );
        let stack = state.take_stack(&sample(0, 7, 300)).expect("its stack");
        assert_eq!(stack.frames[0].code, 0x3);
        // An off-CPU sample's stack waits for its walk past later ticks'.
        let mut off_cpu = sample(0, 7, 400);
        off_cpu.flags |= agent_common::sample_flags::OFF_CPU;
        state.wait_for_walk(&off_cpu, ReadStack::default());
        for ktime in [500, 600] {
            state.wait_for_walk(&sample(0, 7, ktime), ReadStack::default());
        }
        assert!(state.take_stack(&sample(0, 7, 600)).is_some());
        assert_eq!(state.waiting.len(), 1, "the tick at 500 is stale");
        assert!(state.take_stack(&off_cpu).is_some());
        assert!(state.waiting.is_empty());
        // Bounded.
        for ktime in 0..MAX_WAITING_STACKS as u64 + 10 {
            state.wait_for_walk(&sample(0, 7, ktime), ReadStack::default());
        }
        assert_eq!(state.waiting.len(), MAX_WAITING_STACKS);
    }
}
