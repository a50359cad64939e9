//! What the walker keeps of each process it walks, in one record per
//! process ([`ProcessState`]): the modules its walks resolved, its identity
//! (start time), and the copy size the planner learned for it. A sample finds
//! its record with one lookup by pid ([`Processes::entry`]); the stages of
//! that sample (the walk, placing its frames, planning its next copy) then
//! reach it by slot, without another lookup. A record goes in one place
//! ([`Processes::remove`] and [`Processes::drain`]), and what goes with it
//! (the copy size in the sampler's map) goes with the record.

use foldhash::HashMap;

use super::{MAX_MODULES_PER_PROCESS, Module, stitching::ProcessCopy};
use stackscope_telemetry::probes::{self, Probe};

/// One process's record; see the module documentation.
#[derive(Debug, Default)]
pub(super) struct ProcessState {
    /// The modules its walks reached, sorted by start address,
    /// non-overlapping.
    pub(super) modules: Vec<Module>,
    /// Names this version of the list in the walker's rule cache; renewed
    /// on every change, so cached rules of a stale version never match.
    pub(super) space: u64,
    /// The walker's walk count when the process was last walked.
    pub(super) last_walked: u64,
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

/// Where a sample's record is, found once per sample: valid until a record
/// is removed (nothing removes one between a sample's walk and its
/// planning).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Slot {
    index: usize,
    tgid: u32,
}

/// The records by pid, kept in slots so that a sample's stages share one
/// lookup.
#[derive(Debug, Default)]
pub(super) struct Processes {
    by_tgid: HashMap<u32, usize>,
    slots: Vec<Option<(u32, ProcessState)>>,
    free: Vec<usize>,
}

impl Processes {
    pub(super) fn len(&self) -> usize {
        self.by_tgid.len()
    }

    pub(super) fn contains(&self, tgid: u32) -> bool {
        self.by_tgid.contains_key(&tgid)
    }

    pub(super) fn get(&self, tgid: u32) -> Option<&ProcessState> {
        probes::count(Probe::Process);
        let &index = self.by_tgid.get(&tgid)?;
        self.slots[index].as_ref().map(|(_, state)| state)
    }

    pub(super) fn get_mut(&mut self, tgid: u32) -> Option<&mut ProcessState> {
        probes::count(Probe::Process);
        let &index = self.by_tgid.get(&tgid)?;
        self.slots[index].as_mut().map(|(_, state)| state)
    }

    /// The record in `slot`, if it is still that process's.
    pub(super) fn at(&mut self, slot: Slot) -> Option<&mut ProcessState> {
        match self.slots.get_mut(slot.index)? {
            Some((tgid, state)) if *tgid == slot.tgid => Some(state),
            _ => None,
        }
    }

    /// The record of `tgid`, made empty if it has none; one lookup.
    pub(super) fn entry(&mut self, tgid: u32) -> (Slot, &mut ProcessState) {
        probes::count(Probe::Process);
        let index = match self.by_tgid.entry(tgid) {
            std::collections::hash_map::Entry::Occupied(found) => *found.get(),
            std::collections::hash_map::Entry::Vacant(vacant) => {
                let record = Some((tgid, ProcessState::default()));
                let index = match self.free.pop() {
                    Some(index) => {
                        self.slots[index] = record;
                        index
                    }
                    None => {
                        self.slots.push(record);
                        self.slots.len() - 1
                    }
                };
                *vacant.insert(index)
            }
        };
        let state = &mut self.slots[index]
            .as_mut()
            .expect("an indexed slot holds its record")
            .1;
        (Slot { index, tgid }, state)
    }

    pub(super) fn remove(&mut self, tgid: u32) -> Option<ProcessState> {
        let index = self.by_tgid.remove(&tgid)?;
        self.free.push(index);
        self.slots[index].take().map(|(_, state)| state)
    }

    /// Every record, taken out.
    pub(super) fn drain(&mut self) -> Vec<(u32, ProcessState)> {
        self.by_tgid.clear();
        self.free.clear();
        std::mem::take(&mut self.slots)
            .into_iter()
            .flatten()
            .collect()
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (u32, &ProcessState)> {
        self.slots
            .iter()
            .flatten()
            .map(|(tgid, state)| (*tgid, state))
    }

    pub(super) fn values_mut(&mut self) -> impl Iterator<Item = &mut ProcessState> {
        self.slots.iter_mut().flatten().map(|(_, state)| state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_finds_its_record_until_the_record_goes() {
        let mut processes = Processes::default();
        let (first, state) = processes.entry(10);
        state.started = 100;
        let (second, _) = processes.entry(20);
        assert_eq!(processes.entry(10).0, first, "found again, not made");
        assert_eq!(processes.at(first).map(|s| s.started), Some(100));
        assert_eq!(processes.len(), 2);

        assert_eq!(processes.remove(10).map(|s| s.started), Some(100));
        assert!(processes.at(first).is_none(), "its record went");
        // The freed slot is reused by the next process: the old slot does
        // not find that one's record.
        let (third, _) = processes.entry(30);
        assert!(processes.at(first).is_none());
        assert!(processes.at(third).is_some());
        assert!(processes.at(second).is_some());
        let mut tgids: Vec<u32> = processes.iter().map(|(tgid, _)| tgid).collect();
        tgids.sort_unstable();
        assert_eq!(tgids, [20, 30]);

        let drained: Vec<u32> = processes.drain().into_iter().map(|(t, _)| t).collect();
        assert_eq!(drained.len(), 2);
        assert_eq!(processes.len(), 0);
        assert!(processes.get(20).is_none());
    }
}
