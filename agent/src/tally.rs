//! Samples counted per process, with bounded memory.
//!
//! A long-running agent sees pids come and go without end, so the table has a
//! fixed capacity; once full, samples of processes not yet in it are counted
//! as `other` rather than growing the table.

use foldhash::{HashMap, HashMapExt as _};

use stackscope_telemetry::StateSize;

use crate::probes::{self, Probe};

/// One process's share of the samples.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ProcessSamples {
    pub tgid: u32,
    /// Thread name of the first sample seen (the main thread's name is
    /// usually the process name).
    pub comm: String,
    pub samples: u64,
    /// The process exited while the agent ran.
    pub exited: bool,
}

/// Per-process sample counts.
#[derive(Debug)]
pub struct ProcessTally {
    by_tgid: HashMap<u32, ProcessSamples>,
    capacity: usize,
    other: u64,
    /// Processes sampled that exited while the agent ran, and their samples.
    exited_processes: u64,
    exited_samples: u64,
}

impl ProcessTally {
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            by_tgid: HashMap::new(),
            capacity,
            other: 0,
            exited_processes: 0,
            exited_samples: 0,
        }
    }

    /// Process `tgid` exited: the samples it had count as a gone process's
    /// (a later process with the same pid adds to the same entry).
    pub fn exited(&mut self, tgid: u32) {
        if let Some(entry) = self.by_tgid.get_mut(&tgid)
            && !entry.exited
        {
            entry.exited = true;
            self.exited_processes += 1;
            self.exited_samples += entry.samples;
        }
    }

    /// Sampled processes that exited while the agent ran, and the samples
    /// they had by then.
    pub fn exited_counts(&self) -> (u64, u64) {
        (self.exited_processes, self.exited_samples)
    }

    /// Counts one sample of `tgid`; `comm` is only called for a new process.
    pub fn add(&mut self, tgid: u32, comm: impl FnOnce() -> String) {
        probes::count(Probe::Process);
        if let Some(entry) = self.by_tgid.get_mut(&tgid) {
            entry.samples += 1;
        } else if self.by_tgid.len() < self.capacity {
            let comm = comm();
            self.by_tgid.insert(
                tgid,
                ProcessSamples {
                    tgid,
                    comm,
                    samples: 1,
                    exited: false,
                },
            );
        } else {
            self.other += 1;
        }
    }

    /// The `n` processes with the most samples, most first (ties by tgid).
    pub fn top(&self, n: usize) -> Vec<ProcessSamples> {
        let mut all: Vec<_> = self.by_tgid.values().cloned().collect();
        all.sort_by(|a, b| b.samples.cmp(&a.samples).then(a.tgid.cmp(&b.tgid)));
        all.truncate(n);
        all
    }

    /// Processes counted, against the table's capacity.
    pub fn state_size(&self) -> StateSize {
        StateSize::entries("sampled_processes", self.by_tgid.len(), Some(self.capacity))
    }

    /// Samples of processes that arrived after the table was full.
    pub fn other(&self) -> u64 {
        self.other
    }

    /// All samples counted.
    pub fn total(&self) -> u64 {
        self.other + self.by_tgid.values().map(|p| p.samples).sum::<u64>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_processes_by_samples() {
        let mut tally = ProcessTally::with_capacity(10);
        for (tgid, n) in [(1, 3), (2, 7), (3, 7), (4, 1)] {
            for _ in 0..n {
                tally.add(tgid, || format!("p{tgid}"));
            }
        }
        let top = tally.top(3);
        assert_eq!(
            top.iter().map(|p| (p.tgid, p.samples)).collect::<Vec<_>>(),
            [(2, 7), (3, 7), (1, 3)]
        );
        assert_eq!(top[0].comm, "p2");
        assert_eq!(tally.total(), 18);
    }

    #[test]
    fn counts_the_samples_of_processes_that_exited() {
        let mut tally = ProcessTally::with_capacity(10);
        for tgid in [1, 1, 2, 3, 3, 3] {
            tally.add(tgid, String::new);
        }
        tally.exited(1);
        tally.exited(3);
        tally.exited(3);
        tally.exited(99);
        assert_eq!(tally.exited_counts(), (2, 5));
    }

    #[test]
    fn stays_bounded_and_counts_the_overflow() {
        let mut tally = ProcessTally::with_capacity(2);
        for tgid in 0..100 {
            tally.add(tgid, String::new);
        }
        tally.add(0, String::new);
        assert_eq!(tally.top(usize::MAX).len(), 2);
        assert_eq!(tally.other(), 98);
        assert_eq!(tally.total(), 101);
    }
}
