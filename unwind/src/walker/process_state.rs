//! What the walker keeps of each process it walks ([`ProcessState`]): the
//! modules its walks resolved, its identity (start time), and the copy size
//! the planner learned for it. It lives in the process's record in the
//! process table (`ProcessTable<ProcessState>`), beside the mappings the
//! modules were resolved from: a sample finds the record with one lookup by
//! pid ([`stackscope_process_table::ProcessTable::state`]), the stages of that
//! sample (the walk, placing its frames, planning its next copy) reach it
//! again by slot, and it goes when the record goes, whatever removes it
//! (the walker then clears what the planner wrote for it in the sampler's
//! maps).

use super::{MAX_MODULES_PER_PROCESS, Module, stitching::ProcessCopy};

/// One process's record; see the module documentation.
#[derive(Debug, Default)]
pub(super) struct ProcessState {
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
}

impl ProcessState {
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
