//! Samples counted per process, with bounded memory.
//!
//! Each process counts its samples in its own record of the run loop's
//! process table ([`Counted`]): a sample counts through the record its walk
//! found, without a lookup of its own, and a later process under the same
//! pid (or the same process after an exec) starts from zero. When a record
//! goes, what it counted is kept by the [`ProcessTally`] for the run's
//! report. A long-running agent sees pids come and go without end, so the
//! tally keeps a bounded number of them: once full, the half with the
//! fewest samples makes room and their samples count as `other`.

use crate::StateSize;

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

/// The tally's totals.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TallyTotals {
    /// Sampled processes that exited while the agent ran, and their samples.
    pub exited_processes: u64,
    pub exited_samples: u64,
    /// Samples of processes beyond the tally's bound.
    pub untracked_samples: u64,
}

/// What one process's record counted.
#[derive(Debug, Default)]
pub struct Counted {
    /// The thread name of its first sample.
    comm: String,
    samples: u64,
    exited: bool,
}

impl Counted {
    /// Counts one sample; `comm` is only called for the first.
    pub fn add(&mut self, comm: impl FnOnce() -> String) {
        if self.samples == 0 {
            self.comm = comm();
        }
        self.samples += 1;
    }

    /// The process exited (its record goes soon after).
    pub fn exited(&mut self) {
        self.exited = true;
    }

    fn of(&self, tgid: u32) -> ProcessSamples {
        ProcessSamples {
            tgid,
            comm: self.comm.clone(),
            samples: self.samples,
            exited: self.exited,
        }
    }
}

/// The samples of processes whose records went, and of those that had
/// none; see the module documentation.
#[derive(Debug)]
pub struct ProcessTally {
    gone: Vec<ProcessSamples>,
    capacity: usize,
    other: u64,
    /// Processes sampled that exited while the agent ran, and their samples.
    exited_processes: u64,
    exited_samples: u64,
}

impl ProcessTally {
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            gone: Vec::new(),
            capacity: capacity.max(1),
            other: 0,
            exited_processes: 0,
            exited_samples: 0,
        }
    }

    /// The record of process `tgid` went with what it had counted.
    pub fn let_go(&mut self, tgid: u32, counted: &Counted) {
        if counted.exited {
            self.exited_processes += 1;
            self.exited_samples += counted.samples;
        }
        self.keep(tgid, counted);
    }

    /// Keeps what `tgid`'s record counted so far, its record staying: for
    /// the run's summary, at its end.
    pub fn keep(&mut self, tgid: u32, counted: &Counted) {
        if counted.samples == 0 {
            return;
        }
        if self.gone.len() >= self.capacity {
            self.gone.sort_unstable_by(most_samples_first);
            for fewest in self.gone.drain(self.capacity / 2..) {
                self.other += fewest.samples;
            }
        }
        self.gone.push(counted.of(tgid));
    }

    /// A sample whose process had no record (it went before the sample's
    /// walk).
    pub fn add_other(&mut self) {
        self.other += 1;
    }

    /// The tally's totals, for the statistics.
    pub fn totals(&self) -> TallyTotals {
        TallyTotals {
            exited_processes: self.exited_processes,
            exited_samples: self.exited_samples,
            untracked_samples: self.other,
        }
    }

    /// The `n` processes kept with the most samples, most first (ties by
    /// tgid).
    pub fn top(&self, n: usize) -> Vec<ProcessSamples> {
        let mut all = self.gone.clone();
        all.sort_unstable_by(most_samples_first);
        all.truncate(n);
        all
    }

    /// Processes kept, against the bound.
    pub fn state_size(&self) -> StateSize {
        StateSize::entries("sampled_processes", self.gone.len(), Some(self.capacity))
    }

    /// Samples of processes not kept: made room for, or without a record.
    pub fn other(&self) -> u64 {
        self.other
    }

    /// All samples counted.
    pub fn total(&self) -> u64 {
        self.other + self.gone.iter().map(|p| p.samples).sum::<u64>()
    }
}

fn most_samples_first(a: &ProcessSamples, b: &ProcessSamples) -> std::cmp::Ordering {
    b.samples.cmp(&a.samples).then(a.tgid.cmp(&b.tgid))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counted(comm: &str, samples: u64) -> Counted {
        let mut counted = Counted::default();
        for _ in 0..samples {
            counted.add(|| comm.into());
        }
        counted
    }

    #[test]
    fn ranks_processes_by_samples() {
        let mut tally = ProcessTally::with_capacity(10);
        for (tgid, n) in [(1, 3), (2, 7), (3, 7), (4, 1)] {
            tally.keep(tgid, &counted(&format!("p{tgid}"), n));
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
    fn a_record_names_its_process_by_its_first_sample() {
        let mut record = Counted::default();
        record.add(|| "first".into());
        record.add(|| unreachable!("asked for a name once"));
        let mut tally = ProcessTally::with_capacity(10);
        tally.keep(7, &record);
        assert_eq!(tally.top(1)[0].comm, "first");
        assert_eq!(tally.top(1)[0].samples, 2);
    }

    #[test]
    fn counts_the_samples_of_processes_that_exited() {
        let mut tally = ProcessTally::with_capacity(10);
        let mut one = counted("one", 2);
        one.exited();
        let two = counted("two", 1);
        let mut three = counted("three", 3);
        three.exited();
        tally.let_go(1, &one);
        tally.let_go(2, &two);
        tally.let_go(3, &three);
        // What a run's end keeps of a live process is not an exit.
        tally.keep(4, &counted("four", 5));
        let totals = tally.totals();
        assert_eq!((totals.exited_processes, totals.exited_samples), (2, 5));
        let exited: Vec<_> = tally.top(9).iter().map(|p| (p.tgid, p.exited)).collect();
        assert_eq!(exited, [(4, false), (3, true), (1, true), (2, false)]);
    }

    #[test]
    fn a_pid_reused_counts_as_another_process() {
        let mut tally = ProcessTally::with_capacity(10);
        tally.let_go(5, &counted("make", 4));
        tally.keep(5, &counted("cc1", 2));
        let counts: Vec<_> = tally
            .top(9)
            .into_iter()
            .map(|p| (p.tgid, p.comm, p.samples))
            .collect();
        assert_eq!(counts, [(5, "make".into(), 4), (5, "cc1".into(), 2)]);
    }

    #[test]
    fn stays_bounded_keeping_the_busiest_and_counts_the_rest() {
        let mut tally = ProcessTally::with_capacity(4);
        for tgid in 0..100 {
            tally.let_go(tgid, &counted("p", 1 + u64::from(tgid == 3) * 50));
        }
        tally.add_other();
        assert!(tally.top(usize::MAX).len() <= 4);
        assert_eq!(tally.top(1)[0].tgid, 3, "the busiest stays");
        assert_eq!(tally.total(), 99 + 51 + 1);
        assert_eq!(
            tally.other() + tally.top(usize::MAX).iter().map(|p| p.samples).sum::<u64>(),
            tally.total()
        );
        assert!(tally.other() >= 95);
    }

    #[test]
    fn a_process_without_samples_is_not_kept() {
        let mut tally = ProcessTally::with_capacity(4);
        tally.let_go(1, &Counted::default());
        assert!(tally.top(9).is_empty());
        assert_eq!(tally.state_size().entries, Some(0));
    }
}
