//! The process records, kept in slots and indexed by pid: the stages of one
//! sample (its walk, the placing of its frames, the planning of its next
//! copy) find the record once and reach it again by [`Slot`].

use std::collections::{HashMap, hash_map::Entry};

use stackscope_telemetry::probes::{self, Probe};

/// Where a record is: valid until that record is removed (a freed slot
/// reused by another pid does not answer to it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    index: usize,
    tgid: u32,
}

/// See the module documentation.
#[derive(Debug)]
pub(super) struct Slots<P> {
    by_tgid: HashMap<u32, usize>,
    slots: Vec<Option<(u32, P)>>,
    free: Vec<usize>,
}

impl<P> Default for Slots<P> {
    fn default() -> Self {
        Self {
            by_tgid: HashMap::new(),
            slots: Vec::new(),
            free: Vec::new(),
        }
    }
}

impl<P> Slots<P> {
    pub(super) fn len(&self) -> usize {
        self.by_tgid.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.by_tgid.is_empty()
    }

    pub(super) fn contains(&self, tgid: u32) -> bool {
        self.by_tgid.contains_key(&tgid)
    }

    pub(super) fn get(&self, tgid: u32) -> Option<&P> {
        probes::count(Probe::Process);
        let &index = self.by_tgid.get(&tgid)?;
        self.slots[index].as_ref().map(|(_, record)| record)
    }

    pub(super) fn get_mut(&mut self, tgid: u32) -> Option<&mut P> {
        probes::count(Probe::Process);
        let &index = self.by_tgid.get(&tgid)?;
        self.slots[index].as_mut().map(|(_, record)| record)
    }

    /// The record in `slot`, if it is still that process's.
    pub(super) fn at(&mut self, slot: Slot) -> Option<&mut P> {
        match self.slots.get_mut(slot.index)? {
            Some((tgid, record)) if *tgid == slot.tgid => Some(record),
            _ => None,
        }
    }

    /// The record of `tgid`, made by `make` if it has none; one lookup.
    pub(super) fn entry(&mut self, tgid: u32, make: impl FnOnce() -> P) -> (Slot, &mut P) {
        probes::count(Probe::Process);
        let index = match self.by_tgid.entry(tgid) {
            Entry::Occupied(found) => *found.get(),
            Entry::Vacant(vacant) => {
                let record = Some((tgid, make()));
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
        let record = &mut self.slots[index]
            .as_mut()
            .expect("an indexed slot holds its record")
            .1;
        (Slot { index, tgid }, record)
    }

    pub(super) fn remove(&mut self, tgid: u32) -> Option<P> {
        let index = self.by_tgid.remove(&tgid)?;
        self.free.push(index);
        self.slots[index].take().map(|(_, record)| record)
    }

    /// Every record, taken out.
    pub(super) fn drain(&mut self) -> impl Iterator<Item = (u32, P)> {
        self.by_tgid.clear();
        self.free.clear();
        std::mem::take(&mut self.slots).into_iter().flatten()
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (u32, &P)> {
        self.slots
            .iter()
            .flatten()
            .map(|(tgid, record)| (*tgid, record))
    }

    pub(super) fn values_mut(&mut self) -> impl Iterator<Item = &mut P> {
        self.slots.iter_mut().flatten().map(|(_, record)| record)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_finds_its_record_until_the_record_goes() {
        let mut slots = Slots::default();
        let (first, _) = slots.entry(10, || 100);
        let (second, _) = slots.entry(20, || 200);
        assert_eq!(slots.entry(10, || 0), (first, &mut 100), "found, not made");
        assert_eq!(slots.at(first).copied(), Some(100));
        assert_eq!(slots.len(), 2);

        assert_eq!(slots.remove(10), Some(100));
        assert!(slots.at(first).is_none(), "its record went");
        // The freed slot is reused by the next process: the old slot does
        // not find that one's record.
        let (third, _) = slots.entry(30, || 300);
        assert!(slots.at(first).is_none());
        assert_eq!(slots.at(third).copied(), Some(300));
        assert!(slots.at(second).is_some());
        let mut tgids: Vec<u32> = slots.iter().map(|(tgid, _)| tgid).collect();
        tgids.sort_unstable();
        assert_eq!(tgids, [20, 30]);

        assert_eq!(slots.drain().count(), 2);
        assert_eq!(slots.len(), 0);
        assert!(slots.get(20).is_none());
    }
}
