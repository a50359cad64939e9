//! CPython processes on the sampling thread: which processes to look for an
//! interpreter in, what the sampler is told of those that have one, and
//! the Python stack records paired with the samples they go with.
//!
//! The BPF program writes a process's Python stack just before the tick's
//! sample, from the same CPU; the reader keeps it as that CPU's pending
//! stack and hands it to the next sample from the CPU (same thread, taken
//! within a millisecond; anything else is a stack whose sample was lost).
//! The pair then waits in the process's record until the walk of the
//! sample comes (a walk can wait for a table), and is merged there.

use std::collections::{HashSet, VecDeque};
use std::ops::Range;

use agent_common::{PythonFrame, PythonProcess, SampleHeader, python_stack_flags};
use stackscope_process_table::ProcessTable;
use stackscope_python::{CodeCache, FoundInterpreter, code::MAX_CACHE_BYTES};
use stackscope_telemetry::StateSize;

use super::process::ProcessRecord;
use stackscope_sampler::{Sampler, record::PythonStack};

/// Samples of one process whose Python stacks wait for their walk at most:
/// walks wait for their tables for tens of milliseconds, a few hundred
/// samples at most at the highest rates.
const MAX_WAITING_STACKS: usize = 1024;

/// How long after its Python stack a sample may be taken and still be its
/// tick's: one run of the program takes microseconds, the next tick on the
/// CPU comes a millisecond later at the highest rate.
const PAIRING_WINDOW_NS: u64 = 1_000_000;

/// The code objects every CPython process's record keeps, in bytes,
/// against what they may hold together: [`MAX_CACHE_BYTES`] a record, as
/// many records as the process table keeps (the default table's bound).
pub(super) fn code_cache_size(processes: &ProcessTable<ProcessRecord>) -> StateSize {
    let bytes = processes
        .states()
        .map(|(_, record)| match &record.python {
            PythonRecord::Found(state) => state.codes.bytes(),
            _ => 0,
        })
        .sum();
    StateSize::bytes(
        "python_code_objects",
        bytes,
        Some(MAX_CACHE_BYTES * stackscope_process_table::table::MAX_PROCESSES),
    )
}

/// What a process record knows of its interpreter.
#[derive(Debug, Default)]
pub(super) enum PythonRecord {
    /// Not looked for (no file of the process named like an interpreter
    /// seen yet).
    #[default]
    Unknown,
    /// Asked of the metadata worker.
    Asked,
    /// Looked for: none, or one this profiler does not read.
    None,
    Found(Box<PythonState>),
}

/// A Python stack as the sampler read it.
#[derive(Debug, Default)]
pub(super) struct ReadStack {
    /// Innermost first.
    pub frames: Box<[PythonFrame]>,
    /// The read stopped before the outermost frame (the sampler's frame
    /// limit, or a read that failed).
    pub cut: bool,
}

/// A CPython process the sampler reads the frames of.
#[derive(Debug)]
pub(super) struct PythonState {
    pub eval: Range<u64>,
    pub codes: CodeCache,
    /// Python stacks by the (thread, time) of their sample, oldest first.
    pub waiting: VecDeque<(u32, u64, ReadStack)>,
}

impl PythonState {
    /// The Python stack of the sample with `header`, if one came with it.
    pub fn take_stack(&mut self, header: &SampleHeader) -> Option<ReadStack> {
        if self.waiting.is_empty() {
            return None;
        }
        let at = self
            .waiting
            .iter()
            .position(|(tid, ktime, _)| *tid == header.tid && *ktime == header.ktime_ns)?;
        // Older ones had their samples walked without them (dropped).
        self.waiting.drain(..at);
        self.waiting.pop_front().map(|(_, _, stack)| stack)
    }
}

/// A Python stack waiting for the next sample of its CPU.
#[derive(Debug)]
struct Pending {
    tid: u32,
    ktime_ns: u64,
    stack: ReadStack,
}

/// See the module documentation.
#[derive(Debug, Default)]
pub(super) struct PythonProcesses {
    /// Python frames are read (`--no-python-frames` turns them off).
    enabled: bool,
    /// By CPU.
    pending: Vec<Option<Pending>>,
    /// Processes described to the sampler (removed at exec and exit).
    described: HashSet<u32>,
    /// Processes to look for an interpreter in.
    wanted: Vec<u32>,
    /// Processes whose sampler entries go (exec, exit, gone).
    forget: Vec<u32>,
    pub stats: PythonStats,
}

/// What the pairing saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PythonStats {
    /// Processes found to run a CPython the sampler reads.
    pub processes: u64,
    /// Python stacks read, and those paired with their sample.
    pub stacks: u64,
    pub paired: u64,
}

impl PythonProcesses {
    pub fn new(enabled: bool) -> Self {
        Self {
            enabled,
            ..Self::default()
        }
    }

    /// Keeps a Python stack for the next sample of its CPU.
    pub fn stack(&mut self, stack: &PythonStack<'_>) {
        self.stats.stacks += 1;
        let cpu = stack.header.cpu as usize;
        // The CPU count bounds it; a CPU number past any plausible one is
        // a bad record.
        if cpu >= 4096 {
            return;
        }
        if self.pending.len() <= cpu {
            self.pending.resize_with(cpu + 1, || None);
        }
        self.pending[cpu] = Some(Pending {
            tid: stack.header.tid,
            ktime_ns: stack.header.ktime_ns,
            stack: ReadStack {
                frames: stack.frames().collect(),
                cut: stack.header.flags
                    & (python_stack_flags::TRUNCATED | python_stack_flags::READ_FAILED)
                    != 0,
            },
        });
    }

    /// The Python stack taken for the sample with `header`, if any: the
    /// pending stack of its CPU, when it is its tick's.
    pub fn for_sample(&mut self, header: &SampleHeader) -> Option<ReadStack> {
        let pending = self.pending.get_mut(header.cpu as usize)?.take()?;
        let ours = pending.tid == header.tid
            && header.ktime_ns.wrapping_sub(pending.ktime_ns) < PAIRING_WINDOW_NS;
        ours.then_some(pending.stack)
    }

    /// Keeps `stack` in `record` for the walk of the sample with `header`.
    pub fn wait_for_walk(
        &mut self,
        record: &mut PythonRecord,
        header: &SampleHeader,
        stack: ReadStack,
    ) {
        let PythonRecord::Found(state) = record else {
            return;
        };
        if state.waiting.len() >= MAX_WAITING_STACKS {
            state.waiting.pop_front();
        }
        state
            .waiting
            .push_back((header.tid, header.ktime_ns, stack));
        self.stats.paired += 1;
    }

    /// Process `tgid` maps a file named like an interpreter: look for one
    /// in it unless its record has.
    pub fn maybe_python(&mut self, tgid: u32, record: &mut PythonRecord) {
        if self.enabled && matches!(record, PythonRecord::Unknown) {
            *record = PythonRecord::Asked;
            self.wanted.push(tgid);
        }
    }

    /// The processes to look for an interpreter in, for the metadata worker.
    pub fn take_wanted(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.wanted)
    }

    /// What the worker found in `tgid`: the record keeps it and the
    /// sampler reads the process's frames from its next tick. A record that
    /// did not ask (the process exec'd since: a new record) takes nothing:
    /// the answer may be the old image's.
    pub fn found(
        &mut self,
        tgid: u32,
        record: &mut PythonRecord,
        started: u64,
        found: Option<FoundInterpreter>,
        sampler: &mut Sampler,
    ) {
        if !matches!(record, PythonRecord::Asked) {
            return;
        }
        let Some(found) = found else {
            *record = PythonRecord::None;
            return;
        };
        let entry: PythonProcess = found.layout.sampler_entry(found.runtime, started);
        if let Err(err) = sampler.set_python_process(tgid, Some(&entry)) {
            tracing::debug!("python process {tgid} not described to the sampler: {err}");
            *record = PythonRecord::None;
            return;
        }
        tracing::debug!(
            tgid,
            path = %found.path.display(),
            version = ?found.interpreter.version(),
            "reading the process's Python frames"
        );
        self.stats.processes += 1;
        self.described.insert(tgid);
        *record = PythonRecord::Found(Box::new(PythonState {
            eval: found.eval.clone(),
            codes: CodeCache::new(tgid, found.layout),
            waiting: VecDeque::new(),
        }));
    }

    /// Process `tgid` exec'd or exited: its sampler entry goes (the record
    /// goes with the process table's).
    pub fn gone(&mut self, tgid: u32) {
        if self.described.remove(&tgid) {
            self.forget.push(tgid);
        }
    }

    /// Removes the entries of processes gone since the last call.
    pub fn apply(&mut self, sampler: &mut Sampler) {
        for tgid in self.forget.drain(..) {
            if let Err(err) = sampler.set_python_process(tgid, None) {
                tracing::debug!("python process {tgid} still described to the sampler: {err}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use agent_common::{
        PYTHON_FRAME_SIZE, PYTHON_STACK_HEADER_SIZE, PythonStackHeader, RecordKind,
    };
    use stackscope_python::Layout;

    use super::*;
    use crate::aggregate::test_support::header;

    /// A Python stack record of one frame (code `code`) read on `cpu` by
    /// thread `tid` at `ktime_ns`.
    fn stack_record(cpu: u32, tid: u32, ktime_ns: u64, code: u64) -> Vec<u8> {
        stack_record_with_flags(cpu, tid, ktime_ns, code, 0)
    }

    /// [`stack_record`] with the sampler's `flags`.
    fn stack_record_with_flags(
        cpu: u32,
        tid: u32,
        ktime_ns: u64,
        code: u64,
        flags: u32,
    ) -> Vec<u8> {
        let header = PythonStackHeader {
            kind: RecordKind::PythonStack as u32,
            cpu,
            tgid: tid,
            tid,
            frames: 1,
            flags,
            ktime_ns,
        };
        let frame = PythonFrame {
            code,
            instr_offset: 0,
            first_line: 1 | PythonFrame::ENTRY,
        };
        let mut bytes = Vec::new();
        // SAFETY: plain integers, read as bytes.
        unsafe {
            bytes.extend_from_slice(std::slice::from_raw_parts(
                (&raw const header).cast::<u8>(),
                PYTHON_STACK_HEADER_SIZE,
            ));
            bytes.extend_from_slice(std::slice::from_raw_parts(
                (&raw const frame).cast::<u8>(),
                PYTHON_FRAME_SIZE,
            ));
        }
        bytes
    }

    fn sample(cpu: u32, tid: u32, ktime_ns: u64) -> SampleHeader {
        SampleHeader {
            cpu,
            tid,
            ktime_ns,
            ..header(tid, "python3", true)
        }
    }

    fn read(python: &mut PythonProcesses, record: &[u8]) {
        python.stack(&PythonStack::decode(record).expect("a python stack"));
    }

    fn found_record() -> PythonRecord {
        PythonRecord::Found(Box::new(PythonState {
            eval: 0..0,
            codes: CodeCache::new(1, Layout::of((3, 12)).expect("3.12")),
            waiting: VecDeque::new(),
        }))
    }

    #[test]
    fn a_stack_goes_with_the_next_sample_of_its_cpu_and_thread_only() {
        let mut python = PythonProcesses::default();
        read(&mut python, &stack_record(1, 7, 1_000, 0xa));
        read(&mut python, &stack_record(0, 8, 1_000, 0xb));
        // CPU 0's next sample is another thread's: its stack was its own
        // sample's, which was lost; it goes.
        assert!(python.for_sample(&sample(0, 9, 1_500)).is_none());
        assert!(python.for_sample(&sample(0, 8, 1_600)).is_none());
        // CPU 1's is the same thread's, a few microseconds later.
        let stack = python.for_sample(&sample(1, 7, 5_000)).expect("paired");
        assert_eq!(stack.frames[0].code, 0xa);
        assert!(!stack.cut);
        // Taken once.
        assert!(python.for_sample(&sample(1, 7, 5_000)).is_none());
        // A sample a tick later is not the stack's.
        read(&mut python, &stack_record(1, 7, 10_000, 0xc));
        assert!(
            python
                .for_sample(&sample(1, 7, 10_000 + PAIRING_WINDOW_NS))
                .is_none()
        );
        // A read the sampler cut short (its frame limit, a failed read)
        // says so.
        for flags in [
            python_stack_flags::TRUNCATED,
            python_stack_flags::READ_FAILED,
        ] {
            read(
                &mut python,
                &stack_record_with_flags(1, 7, 20_000, 0xe, flags),
            );
            let stack = python.for_sample(&sample(1, 7, 20_100)).expect("paired");
            assert!(stack.cut, "flags {flags:#x}");
        }
        // A CPU number no machine has is a bad record, not a huge vector.
        read(&mut python, &stack_record(u32::MAX, 7, 1, 0xd));
        assert!(python.pending.len() <= 2);
    }

    #[test]
    fn a_walk_finds_its_samples_stack_and_drops_older_ones() {
        let mut python = PythonProcesses::default();
        let mut record = found_record();
        for (ktime, code) in [(100, 0x1), (200, 0x2), (300, 0x3)] {
            let stack = ReadStack {
                frames: vec![PythonFrame {
                    code,
                    instr_offset: 0,
                    first_line: 1,
                }]
                .into(),
                cut: false,
            };
            python.wait_for_walk(&mut record, &sample(0, 7, ktime), stack);
        }
        let PythonRecord::Found(state) = &mut record else {
            unreachable!()
        };
        // The walk of the second sample: the first one's stack is stale.
        let stack = state.take_stack(&sample(0, 7, 200)).expect("its stack");
        assert_eq!(stack.frames[0].code, 0x2);
        assert_eq!(state.waiting.len(), 1);
        assert!(
            state.take_stack(&sample(0, 8, 300)).is_none(),
            "another thread"
        );
        assert_eq!(
            state
                .take_stack(&sample(0, 7, 300))
                .expect("its stack")
                .frames[0]
                .code,
            0x3
        );
        // Bounded.
        for ktime in 0..MAX_WAITING_STACKS as u64 + 10 {
            python.wait_for_walk(&mut record, &sample(0, 7, ktime), ReadStack::default());
        }
        let PythonRecord::Found(state) = &record else {
            unreachable!()
        };
        assert_eq!(state.waiting.len(), MAX_WAITING_STACKS);
    }

    #[test]
    fn a_process_is_asked_about_once_and_forgotten_only_if_described() {
        let mut python = PythonProcesses::new(false);
        let mut record = PythonRecord::default();
        python.maybe_python(5, &mut record);
        assert!(python.take_wanted().is_empty(), "turned off");
        let mut python = PythonProcesses::new(true);
        python.maybe_python(5, &mut record);
        python.maybe_python(5, &mut record);
        assert_eq!(python.take_wanted(), [5]);
        assert!(python.take_wanted().is_empty());
        python.gone(5);
        assert!(python.forget.is_empty(), "never described to the sampler");
    }
}
