//! The `STACK_TOPS` table (see [`StackTopSet`]), written in place: the
//! agent maps the array, finds a thread's entry in its set and writes it
//! with plain stores in the order the program's reads rely on. No system
//! call per top, and no lookup structure of the kernel's between the
//! program and the entry.
//!
//! Owns which way of a full set gives way; not what a top
//! is (the walker's planner decides that, and writes a top a full set gave
//! up again at the thread's next walk to the root).

use std::{
    io,
    sync::atomic::{AtomicU32, AtomicU64, Ordering, fence},
};

use agent_common::{
    STACK_TOP_SETS, STACK_TOP_WAYS, StackTop, StackTopEntry, StackTopSet, stack_top_set,
};
use aya::maps::MapData;

use crate::mapped::MappedValues;

/// `STACK_TOPS`, mapped for reading and writing.
pub(crate) struct StackTops {
    sets: MappedValues<StackTopSet>,
    /// Per set, the way the next eviction from it takes, in turn.
    next_victim: Vec<u8>,
}

impl StackTops {
    /// Maps `map`, an array of [`STACK_TOP_SETS`] sets created with
    /// `BPF_F_MMAPABLE`.
    pub(crate) fn map(map: MapData) -> io::Result<Self> {
        MappedValues::map(map, STACK_TOP_SETS as usize).map(Self::new)
    }

    fn new(sets: MappedValues<StackTopSet>) -> Self {
        Self {
            sets,
            next_victim: vec![0; STACK_TOP_SETS as usize],
        }
    }

    /// Writes thread `tid`'s top: over its entry, else in an empty way of
    /// its set, else over the way whose turn it is. Returns the thread
    /// whose top that took, if any.
    pub(crate) fn insert(&mut self, tid: u32, top: StackTop) -> Option<u32> {
        if tid == 0 {
            // Id 0 marks an empty entry; the idle task is never sampled.
            return None;
        }
        let set = stack_top_set(tid) as usize;
        let (way, evicted) = match self.find(set, tid).or_else(|| self.find(set, 0)) {
            Some(way) => (way, None),
            None => {
                let victim = &mut self.next_victim[set];
                let way = usize::from(*victim);
                *victim = ((way + 1) % STACK_TOP_WAYS) as u8;
                (way, Some(self.fields(set, way).0.load(Ordering::Acquire)))
            }
        };
        let entry = StackTopEntry::new(tid, top);
        let (tid_field, tgid_field, top_field) = self.fields(set, way);
        // Emptied first and named last: a tick that reads the entry
        // meanwhile reads its tid changed, or 0, and uses none of it. The
        // top before the process: a tick that reads an entry rewritten in
        // place (the same tid, reused by another process) and finds the new
        // process finds the new top too.
        tid_field.store(0, Ordering::Relaxed);
        fence(Ordering::Release);
        top_field.store(entry.top_and_flags, Ordering::Relaxed);
        tgid_field.store(entry.tgid, Ordering::Release);
        tid_field.store(tid, Ordering::Release);
        evicted
    }

    /// Empties thread `tid`'s entry, if it has one.
    pub(crate) fn remove(&mut self, tid: u32) {
        if tid == 0 {
            return;
        }
        let set = stack_top_set(tid) as usize;
        if let Some(way) = self.find(set, tid) {
            self.fields(set, way).0.store(0, Ordering::Release);
        }
    }

    /// Thread `tid`'s top as the table holds it (rounded up to 8 bytes).
    #[cfg(test)]
    fn get(&self, tid: u32) -> Option<StackTop> {
        let set = stack_top_set(tid) as usize;
        let way = self.find(set, tid).filter(|_| tid != 0)?;
        let (_, tgid, top) = self.fields(set, way);
        let entry = StackTopEntry {
            tid,
            tgid: tgid.load(Ordering::Acquire),
            top_and_flags: top.load(Ordering::Acquire),
        };
        Some(entry.top())
    }

    fn find(&self, set: usize, tid: u32) -> Option<usize> {
        (0..STACK_TOP_WAYS).find(|&way| self.fields(set, way).0.load(Ordering::Acquire) == tid)
    }

    /// The fields of entry `way` of `set`, as atomics: the program reads
    /// them while this side writes.
    fn fields(&self, set: usize, way: usize) -> (&AtomicU32, &AtomicU32, &AtomicU64) {
        debug_assert!(set < STACK_TOP_SETS as usize && way < STACK_TOP_WAYS);
        // SAFETY: `set` < STACK_TOP_SETS and `way` < STACK_TOP_WAYS (the
        // set comes from `stack_top_set`, the way from a range): inside the
        // table, aligned as its `repr(C)` fields are. The memory is shared
        // with the program, which accesses it with single loads and
        // stores of the same widths.
        unsafe {
            let entry = &raw mut (*self.sets.as_ptr().add(set)).entries[way];
            (
                AtomicU32::from_ptr(&raw mut (*entry).tid),
                AtomicU32::from_ptr(&raw mut (*entry).tgid),
                AtomicU64::from_ptr(&raw mut (*entry).top_and_flags),
            )
        }
    }

    #[cfg(test)]
    fn in_memory() -> Self {
        let sets = vec![StackTopSet::default(); STACK_TOP_SETS as usize].into_boxed_slice();
        Self::new(MappedValues::in_memory(sets))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn top(tgid: u32, top: u64) -> StackTop {
        StackTop {
            tgid,
            flags: 0,
            top,
        }
    }

    /// Thread ids that share one set, the first `n` of them.
    fn same_set(n: usize) -> Vec<u32> {
        let set = stack_top_set(1000);
        (1000..)
            .filter(|&tid| stack_top_set(tid) == set)
            .take(n)
            .collect()
    }

    #[test]
    fn a_top_is_found_by_its_thread_and_rounded_up_to_eight_bytes_with_its_flags() {
        let mut tops = StackTops::in_memory();
        assert_eq!(tops.get(7), None);
        let written = StackTop {
            tgid: 5,
            flags: agent_common::stack_top_flags::PYTHON,
            top: 0x7ffd_0000_1003,
        };
        tops.insert(7, written);
        assert_eq!(
            tops.get(7),
            Some(StackTop {
                top: 0x7ffd_0000_1008,
                ..written
            })
        );
        tops.insert(7, top(5, 0x7ffd_0000_2000));
        assert_eq!(
            tops.get(7),
            Some(top(5, 0x7ffd_0000_2000)),
            "rewritten in place"
        );
        assert_eq!(tops.get(8), None);
        tops.remove(7);
        assert_eq!(tops.get(7), None);
        tops.remove(7);
        tops.insert(0, top(1, 0x1000));
        assert_eq!(tops.get(0), None, "id 0 marks an empty entry");
    }

    #[test]
    fn a_full_set_gives_up_a_way_in_turn_and_names_the_thread_it_was() {
        let tids = same_set(STACK_TOP_WAYS + 2);
        let mut tops = StackTops::in_memory();
        for (n, &tid) in tids.iter().take(STACK_TOP_WAYS).enumerate() {
            assert_eq!(tops.insert(tid, top(1, 0x1000 * (n as u64 + 1))), None);
        }
        // Rewriting a thread that has an entry takes no other's.
        assert_eq!(tops.insert(tids[1], top(1, 0x9000)), None);
        assert!(
            tids[..STACK_TOP_WAYS]
                .iter()
                .all(|&tid| tops.get(tid).is_some())
        );
        assert_eq!(
            tops.insert(tids[STACK_TOP_WAYS], top(2, 0x5000)),
            Some(tids[0])
        );
        assert_eq!(tops.get(tids[0]), None);
        assert_eq!(tops.get(tids[STACK_TOP_WAYS]), Some(top(2, 0x5000)));
        assert_eq!(tops.get(tids[1]), Some(top(1, 0x9000)));
        // A removal leaves a way empty, which the next thread takes.
        tops.remove(tids[2]);
        assert_eq!(tops.insert(tids[STACK_TOP_WAYS + 1], top(3, 0x6000)), None);
        for &tid in [
            tids[1],
            tids[3],
            tids[STACK_TOP_WAYS],
            tids[STACK_TOP_WAYS + 1],
        ]
        .iter()
        {
            assert!(tops.get(tid).is_some(), "thread {tid} kept its top");
        }
        // Full again: the next way in turn.
        assert_eq!(tops.insert(tids[0], top(1, 0x1000)), Some(tids[1]));
    }

    #[test]
    fn threads_started_together_spread_over_the_sets() {
        // 4,096 consecutive ids, and ids 64 apart: no set over its ways.
        for stride in [1u32, 64] {
            let mut per_set = vec![0usize; STACK_TOP_SETS as usize];
            for n in 0..4096u32 {
                per_set[stack_top_set(100_000 + n * stride) as usize] += 1;
            }
            let fullest = per_set.iter().max().copied().unwrap_or(0);
            assert!(
                fullest <= STACK_TOP_WAYS,
                "stride {stride}: a set of {fullest}"
            );
        }
    }
}
