//! What the walker keeps of each process it walks ([`ProcessState`]): the
//! modules its walks resolved, its identity (start time), and the copy size
//! the planner learned for it. It lives in the process's record in the
//! process table, beside the mappings the modules were resolved from and
//! whatever else the table's owner keeps of the process (the record is any
//! [`WalkerRecord`]): a sample finds the record with one lookup by pid
//! ([`stackscope_process_table::ProcessTable::state`]), the stages of that
//! sample (the walk, placing its frames, planning its next copy) reach it
//! again by slot, and it goes when the record goes, whatever removes it
//! (the walker then clears what the planner wrote for it in the sampler's
//! maps).

use std::sync::Arc;

use crate::RuntimeCode;
use stackscope_process_table::{ProcessTable, Slot};

use super::{MAX_MODULES_PER_PROCESS, Module, stitching::ProcessCopy};

/// A process table record that holds the walker's state of its process
/// (and whatever else its owner keeps there).
pub trait WalkerRecord: Default {
    fn walker_state(&self) -> &ProcessState;
    fn walker_state_mut(&mut self) -> &mut ProcessState;
}

impl WalkerRecord for ProcessState {
    fn walker_state(&self) -> &ProcessState {
        self
    }

    fn walker_state_mut(&mut self) -> &mut ProcessState {
        self
    }
}

/// The walker's view of a table of [`WalkerRecord`]s: the table's
/// accessors, narrowed to the walker's part of each record.
pub(super) trait WalkerTable {
    fn walker(&mut self, tgid: u32) -> (Slot, &mut ProcessState);
    fn walker_at(&mut self, slot: Slot) -> Option<&mut ProcessState>;
    fn walker_of(&self, tgid: u32) -> Option<&ProcessState>;
    fn walker_of_mut(&mut self, tgid: u32) -> Option<&mut ProcessState>;
    fn walkers(&self) -> impl Iterator<Item = &ProcessState>;
    fn walkers_mut(&mut self) -> impl Iterator<Item = &mut ProcessState>;
}

impl<R: WalkerRecord> WalkerTable for ProcessTable<R> {
    fn walker(&mut self, tgid: u32) -> (Slot, &mut ProcessState) {
        let (slot, record) = self.state(tgid);
        (slot, record.walker_state_mut())
    }

    fn walker_at(&mut self, slot: Slot) -> Option<&mut ProcessState> {
        self.state_at(slot).map(WalkerRecord::walker_state_mut)
    }

    fn walker_of(&self, tgid: u32) -> Option<&ProcessState> {
        self.state_of(tgid).map(WalkerRecord::walker_state)
    }

    fn walker_of_mut(&mut self, tgid: u32) -> Option<&mut ProcessState> {
        self.state_of_mut(tgid).map(WalkerRecord::walker_state_mut)
    }

    fn walkers(&self) -> impl Iterator<Item = &ProcessState> {
        self.states().map(|(_, record)| record.walker_state())
    }

    fn walkers_mut(&mut self) -> impl Iterator<Item = &mut ProcessState> {
        self.states_mut().map(WalkerRecord::walker_state_mut)
    }
}

/// One process's record; see the module documentation.
#[derive(Debug, Default)]
pub struct ProcessState {
    /// The modules its walks reached, sorted by start address,
    /// non-overlapping.
    pub(super) modules: Vec<Module>,
    /// Names this version of the list in the walker's rule cache; renewed
    /// on every change, so cached rules of a stale version never match.
    pub(super) space: u64,
    /// The process's start time (0: unknown): with the pid, its identity.
    pub(super) started: u64,
    /// The copy size the planner keeps for it (`None`: the ceiling, nothing
    /// written to the sampler's map).
    pub(super) copy: Option<ProcessCopy>,
    /// The runtime that describes the process's JIT code (a HotSpot JVM),
    /// asked at each of its frames instead of frame pointers.
    pub(super) runtime: Option<Arc<dyn RuntimeCode + Send + Sync>>,
    /// A runtime is being read: walks that reach its JIT code wait for it
    /// (held, as for a table) rather than go by frame pointers.
    pub(super) runtime_pending: bool,
}

impl ProcessState {
    /// The process's start time (`CLOCK_MONOTONIC` ns, as samples carry
    /// it; 0: unknown).
    pub fn started(&self) -> u64 {
        self.started
    }

    /// Whether this is another process's record than one started at
    /// `started` (0: unknown, no verdict).
    pub(super) fn is_other_process(&self, started: u64) -> bool {
        started != 0 && self.started != 0 && self.started != started
    }

    pub(super) fn find(&self, pc: u64) -> Option<&Module> {
        let at = self.modules.partition_point(|m| m.start <= pc);
        let module = self.modules.get(at.checked_sub(1)?)?;
        module.contains(pc).then_some(module)
    }

    pub(super) fn insert(&mut self, module: Module, space: u64) {
        self.space = space;
        if self.modules.len() >= MAX_MODULES_PER_PROCESS {
            self.modules.clear();
        }
        // A stale module overlapping the new one (the process remapped the
        // range) goes: the new one is what the process maps now.
        self.modules
            .retain(|m| m.end <= module.start || m.start >= module.end);
        let at = self.modules.partition_point(|m| m.start < module.start);
        self.modules.insert(at, module);
    }
}
