//! Counts the hash-table lookups the agent's sampling thread makes, by what they
//! are keyed by, so the bench and `/metrics` can say how many a sample costs
//! (issue 32 asks for at most 3 in steady state). Every lookup on the
//! per-sample path calls [`count`] next to it; a change that removes a
//! lookup removes its call, so the figure always describes the code it sits
//! in. It lives here, not in the agent, because the lookups are made in
//! every crate a sample passes through (sampler, unwind, metadata,
//! symbolize), and each counts its own.
//!
//! The counters are thread-local: only the sampling thread samples, and
//! the batch worker's lookups (symbolization, per batch) stay out of the
//! figure. A count is one add to a thread-local (about a nanosecond).

use std::cell::Cell;

/// What a lookup is keyed by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// A process id: state kept per process.
    Process = 0,
    /// A thread id: state kept per thread.
    Thread = 1,
    /// A key derived from a process's state (its binary's name, its
    /// label set).
    Derived = 2,
    /// An interval's dictionaries (stacks, locations, samples), keyed by
    /// content.
    Content = 3,
}

const KINDS: usize = 4;

thread_local! {
    static COUNTS: Cell<[u64; KINDS]> = const { Cell::new([0; KINDS]) };
}

/// Counts one lookup of `kind` on this thread.
#[inline(always)]
pub fn count(kind: Probe) {
    COUNTS.with(|counts| {
        let mut now = counts.get();
        now[kind as usize] += 1;
        counts.set(now);
    });
}

/// The lookups counted on this thread so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ProbeTotals {
    pub process: u64,
    pub thread: u64,
    pub derived: u64,
    pub content: u64,
}

impl ProbeTotals {
    /// This thread's counts now.
    pub fn now() -> Self {
        let [process, thread, derived, content] = COUNTS.with(Cell::get);
        Self {
            process,
            thread,
            derived,
            content,
        }
    }

    pub fn total(&self) -> u64 {
        self.process + self.thread + self.derived + self.content
    }

    /// The counts since `earlier`.
    pub fn since(&self, earlier: &Self) -> Self {
        Self {
            process: self.process.saturating_sub(earlier.process),
            thread: self.thread.saturating_sub(earlier.thread),
            derived: self.derived.saturating_sub(earlier.derived),
            content: self.content.saturating_sub(earlier.content),
        }
    }

    /// Each kind with its label, for reports and metrics.
    pub fn by_kind(&self) -> [(&'static str, u64); KINDS] {
        [
            ("process", self.process),
            ("thread", self.thread),
            ("derived", self.derived),
            ("content", self.content),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_each_kind_on_this_thread_only() {
        let before = ProbeTotals::now();
        count(Probe::Process);
        count(Probe::Process);
        count(Probe::Content);
        std::thread::spawn(|| count(Probe::Thread)).join().unwrap();
        let counted = ProbeTotals::now().since(&before);
        assert_eq!(
            counted,
            ProbeTotals {
                process: 2,
                thread: 0,
                derived: 0,
                content: 1
            }
        );
        assert_eq!(counted.total(), 3);
    }
}
