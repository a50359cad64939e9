//! Samples counted per process, with bounded memory.
//!
//! A long-running agent sees pids come and go without end, so the table has a
//! fixed capacity; once full, samples of processes not yet in it are counted
//! as `other` rather than growing the table.
//!
//! Entries are never removed (a later process with the same pid adds to the
//! same one), so where an entry is stays true: a thread's next sample finds
//! its process's entry through the thread's slot, without a lookup.

use foldhash::{HashMap, HashMapExt as _};

use stackscope_telemetry::StateSize;

use stackscope_telemetry::probes::{self, Probe};

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

/// Slots of recently counted threads, by thread id.
const THREAD_SLOTS: usize = 64;

/// A thread counted recently: its process and that process's entry.
#[derive(Debug, Clone, Copy)]
struct CountedThread {
    tid: u32,
    tgid: u32,
    entry: u32,
}

/// Per-process sample counts.
#[derive(Debug)]
pub struct ProcessTally {
    entries: Vec<ProcessSamples>,
    by_tgid: HashMap<u32, u32>,
    threads: [Option<CountedThread>; THREAD_SLOTS],
    capacity: usize,
    other: u64,
    /// Processes sampled that exited while the agent ran, and their samples.
    exited_processes: u64,
    exited_samples: u64,
}

impl ProcessTally {
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            entries: Vec::new(),
            by_tgid: HashMap::new(),
            threads: [None; THREAD_SLOTS],
            capacity,
            other: 0,
            exited_processes: 0,
            exited_samples: 0,
        }
    }

    /// Process `tgid` exited: the samples it had count as a gone process's
    /// (a later process with the same pid adds to the same entry).
    pub fn exited(&mut self, tgid: u32) {
        if let Some(&at) = self.by_tgid.get(&tgid)
            && let entry = &mut self.entries[at as usize]
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

    /// Counts one sample of thread `tid` of `tgid`; `comm` is only called
    /// for a new process.
    pub fn add(&mut self, tid: u32, tgid: u32, comm: impl FnOnce() -> String) {
        let slot = &mut self.threads[tid as usize % THREAD_SLOTS];
        if let Some(counted) = slot
            && counted.tid == tid
            && counted.tgid == tgid
        {
            self.entries[counted.entry as usize].samples += 1;
            return;
        }
        probes::count(Probe::Process);
        let entry = match self.by_tgid.get(&tgid) {
            Some(&at) => at,
            None if self.entries.len() < self.capacity => {
                let at = self.entries.len() as u32;
                self.entries.push(ProcessSamples {
                    tgid,
                    comm: comm(),
                    samples: 0,
                    exited: false,
                });
                self.by_tgid.insert(tgid, at);
                at
            }
            None => {
                self.other += 1;
                return;
            }
        };
        self.entries[entry as usize].samples += 1;
        *slot = Some(CountedThread { tid, tgid, entry });
    }

    /// The `n` processes with the most samples, most first (ties by tgid).
    pub fn top(&self, n: usize) -> Vec<ProcessSamples> {
        let mut all = self.entries.clone();
        all.sort_by(|a, b| b.samples.cmp(&a.samples).then(a.tgid.cmp(&b.tgid)));
        all.truncate(n);
        all
    }

    /// Processes counted, against the table's capacity.
    pub fn state_size(&self) -> StateSize {
        StateSize::entries("sampled_processes", self.entries.len(), Some(self.capacity))
    }

    /// Samples of processes that arrived after the table was full.
    pub fn other(&self) -> u64 {
        self.other
    }

    /// All samples counted.
    pub fn total(&self) -> u64 {
        self.other + self.entries.iter().map(|p| p.samples).sum::<u64>()
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
                tally.add(tgid, tgid, || format!("p{tgid}"));
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
            tally.add(tgid, tgid, String::new);
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
            tally.add(tgid, tgid, String::new);
        }
        tally.add(0, 0, String::new);
        assert_eq!(tally.top(usize::MAX).len(), 2);
        assert_eq!(tally.other(), 98);
        assert_eq!(tally.total(), 101);
    }

    #[test]
    fn a_threads_slot_counts_for_its_process_only() {
        let mut tally = ProcessTally::with_capacity(10);
        tally.add(100, 1, || "a".into());
        tally.add(100, 1, || "a".into());
        // Another thread in the same slot, and the first thread's id reused
        // by another process: each counts for its own process.
        tally.add(100 + THREAD_SLOTS as u32, 2, || "b".into());
        tally.add(100, 3, || "c".into());
        tally.add(100, 3, || "c".into());
        tally.add(101, 1, || "a".into());
        let counts: Vec<_> = tally.top(9).iter().map(|p| (p.tgid, p.samples)).collect();
        assert_eq!(counts, [(1, 3), (3, 2), (2, 1)]);
        tally.exited(3);
        assert_eq!(tally.exited_counts(), (1, 2));
    }
}
