//! CPython processes on the sampling thread: which processes to look for an
//! interpreter in, what the sampler is told of those that have one, and
//! their Python stacks paired with the samples they go with
//! (`stackscope_python::pairing`).

use std::collections::{HashMap, HashSet, hash_map::Entry};

use agent_common::{PythonProcess, SampleHeader};
use stackscope_process_table::ProcessTable;
use stackscope_python::{
    CodeCache, FoundInterpreter, PythonRecord, PythonState, ReadStack, StackPairing,
    code::MAX_CACHE_BYTES,
};
use stackscope_telemetry::StateSize;

use super::process::ProcessRecord;
use stackscope_sampler::{Sampler, record::PythonStack};

/// The code objects CPython processes' records keep together when memory
/// is plentiful: [`MAX_CACHE_BYTES`] each for 32 processes.
pub const DEFAULT_CODE_BYTES: usize = 32 * MAX_CACHE_BYTES;

/// The code objects every CPython process's record keeps, in bytes,
/// against what they may hold together.
pub(super) fn code_cache_size(
    processes: &ProcessTable<ProcessRecord>,
    max_bytes: usize,
) -> StateSize {
    let bytes = processes
        .states()
        .map(|(_, record)| match &record.python {
            PythonRecord::Found(state) => state.codes.bytes(),
            _ => 0,
        })
        .sum();
    StateSize::bytes("python_code_objects", bytes, Some(max_bytes))
}

/// See the module documentation.
#[derive(Debug, Default)]
pub(super) struct PythonProcesses {
    /// Python frames are read (`--no-python-frames` turns them off).
    enabled: bool,
    pairing: StackPairing,
    /// Processes described to the sampler (removed at exec and exit).
    described: HashSet<u32>,
    /// Processes to look for an interpreter in.
    wanted: Vec<u32>,
    /// Processes looked at from their first read, for the program they
    /// exec'd (removed at exec and exit): true until the answer comes.
    probed_early: HashMap<u32, bool>,
    /// Processes whose sampler entries go (exec, exit, gone).
    forget: Vec<u32>,
    /// What the records' code objects may hold together.
    pub code_bytes: usize,
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
    /// Processes' code objects dropped for the bound over all of them.
    pub code_caches_cleared: u64,
}

impl PythonProcesses {
    pub fn new(enabled: bool, code_bytes: usize) -> Self {
        Self {
            enabled,
            code_bytes,
            ..Self::default()
        }
    }

    /// Keeps a Python stack for the next sample of its CPU.
    pub fn stack(&mut self, stack: &PythonStack<'_>) {
        self.stats.stacks += 1;
        self.pairing.keep(&stack.header, stack.frames());
    }

    /// The Python stack taken for the sample with `header`, if any.
    pub fn for_sample(&mut self, header: &SampleHeader) -> Option<ReadStack> {
        self.pairing.for_sample(header)
    }

    /// Keeps `stack` in `record` for the walk of the sample with `header`.
    pub fn wait_for_walk(
        &mut self,
        record: &mut PythonRecord,
        header: &SampleHeader,
        stack: ReadStack,
    ) {
        if let PythonRecord::Found(state) = record {
            state.wait_for_walk(header, stack);
            self.stats.paired += 1;
        }
    }

    /// Process `tgid` maps a file named like an interpreter: look for one
    /// in it unless its record has.
    pub fn maybe_python(&mut self, tgid: u32, record: &mut PythonRecord) {
        if self.enabled && matches!(record, PythonRecord::Unknown) {
            *record = PythonRecord::Asked;
            self.wanted.push(tgid);
        }
    }

    /// Process `tgid` exec'd a program named like an interpreter: look for
    /// one in it now, once, rather than when its walks reach the
    /// interpreter's file. Those walks wait for the tables of every module
    /// on the way (seconds, on a busy host with cold tables), and a short
    /// script's code objects can be read only while it runs. An early look
    /// that finds nothing (an interpreter whose libpython is not mapped
    /// yet) leaves the record to be asked about again by the walks.
    pub fn probe_early(&mut self, tgid: u32, record: &mut PythonRecord) {
        if self.enabled
            && matches!(record, PythonRecord::Unknown)
            && let Entry::Vacant(probe) = self.probed_early.entry(tgid)
        {
            probe.insert(true);
            self.maybe_python(tgid, record);
        }
    }

    /// The processes to look for an interpreter in, for the metadata worker.
    pub fn take_wanted(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.wanted)
    }

    /// What the worker found in `tgid`: the record keeps it and the
    /// sampler reads the process's frames from its next tick (of threads
    /// without a stack top: the caller has the walker forget the tops
    /// written before). A record that did not ask (the process exec'd
    /// since: a new record) takes nothing: the answer may be the old
    /// image's. Whether the sampler was told.
    #[must_use]
    pub fn found(
        &mut self,
        tgid: u32,
        record: &mut PythonRecord,
        started: u64,
        found: Option<FoundInterpreter>,
        sampler: &mut Sampler,
    ) -> bool {
        if !matches!(record, PythonRecord::Asked) {
            return false;
        }
        let Some(found) = found else {
            self.not_found(tgid, record);
            return false;
        };
        let entry: PythonProcess = found.layout.sampler_entry(found.runtime, started);
        if let Err(err) = sampler.set_python_process(tgid, Some(&entry)) {
            tracing::debug!("python process {tgid} not described to the sampler: {err}");
            *record = PythonRecord::None;
            return false;
        }
        tracing::debug!(
            tgid,
            path = %found.path.display(),
            version = ?found.interpreter.version(),
            "reading the process's Python frames"
        );
        self.stats.processes += 1;
        self.described.insert(tgid);
        *record = PythonRecord::Found(Box::new(PythonState::new(
            found.eval.clone(),
            CodeCache::new(tgid, found.layout),
        )));
        true
    }

    /// No interpreter the sampler reads in `tgid`, as its record asked.
    fn not_found(&mut self, tgid: u32, record: &mut PythonRecord) {
        // The first answer to an early look: the walks may ask again.
        let early = self.probed_early.get_mut(&tgid).is_some_and(std::mem::take);
        *record = match early {
            true => PythonRecord::Unknown,
            false => PythonRecord::None,
        };
    }

    /// Empties the largest processes' code caches until they all hold at
    /// most [`Self::code_bytes`] (asked at each interval's end: between,
    /// they grow by what one interval's samples name).
    pub fn trim_codes(&mut self, processes: &mut ProcessTable<ProcessRecord>) {
        let sizes = processes
            .states()
            .filter_map(|(tgid, record)| match &record.python {
                PythonRecord::Found(state) => Some((tgid, state.codes.bytes())),
                _ => None,
            })
            .collect();
        for tgid in crate::memory::caches_to_clear(sizes, self.code_bytes) {
            if let Some(PythonRecord::Found(state)) = processes
                .state_of_mut(tgid)
                .map(|record| &mut record.python)
            {
                state.codes.clear();
                self.stats.code_caches_cleared += 1;
            }
        }
    }

    /// Process `tgid` exec'd or exited: its sampler entry goes (the record
    /// goes with the process table's).
    pub fn gone(&mut self, tgid: u32) {
        self.probed_early.remove(&tgid);
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
    use super::*;

    #[test]
    fn a_process_is_asked_about_once_and_forgotten_only_if_described() {
        let mut python = PythonProcesses::new(false, DEFAULT_CODE_BYTES);
        let mut record = PythonRecord::default();
        python.maybe_python(5, &mut record);
        assert!(python.take_wanted().is_empty(), "turned off");
        let mut python = PythonProcesses::new(true, DEFAULT_CODE_BYTES);
        python.maybe_python(5, &mut record);
        python.maybe_python(5, &mut record);
        assert_eq!(python.take_wanted(), [5]);
        assert!(python.take_wanted().is_empty());
        python.gone(5);
        assert!(python.forget.is_empty(), "never described to the sampler");
    }

    #[test]
    fn an_early_look_is_taken_once_and_its_empty_answer_leaves_the_walks_to_ask() {
        let mut python = PythonProcesses::new(true, DEFAULT_CODE_BYTES);
        let mut record = PythonRecord::default();
        python.probe_early(7, &mut record);
        python.probe_early(7, &mut record);
        assert_eq!(python.take_wanted(), [7]);
        python.not_found(7, &mut record);
        assert!(matches!(record, PythonRecord::Unknown));
        python.probe_early(7, &mut record);
        assert!(python.take_wanted().is_empty(), "looked at early once");
        // The walks reach a file named like an interpreter: asked again,
        // and this answer is the last.
        python.maybe_python(7, &mut record);
        assert_eq!(python.take_wanted(), [7]);
        python.not_found(7, &mut record);
        assert!(matches!(record, PythonRecord::None));
        // A new image (exec) is looked at early again.
        python.gone(7);
        let mut record = PythonRecord::default();
        python.probe_early(7, &mut record);
        assert_eq!(python.take_wanted(), [7]);
    }
}
