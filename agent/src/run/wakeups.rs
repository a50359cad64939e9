//! Why the sampling thread woke, and what each cause cost it: the count of
//! wake-ups and the thread's CPU time by cause. On a quiet host the
//! thread's cost is its wake-ups, not its samples; these figures say which
//! timer or message to cut.

use std::time::Duration;

/// What woke the sampling thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// The BPF program signalled records (a new process's first tick, a
    /// thread not learned yet, a ring filling up).
    Records,
    /// The drain period was over.
    DrainTimer,
    /// The mapping feed had events.
    MappingFeed,
    /// An aggregation interval ended.
    IntervalEnd,
    /// An ended interval's wait for its labels was over.
    AnswersWait,
    /// A message from the runtime or the metadata worker.
    Pods,
    Policies,
    Gone,
    Described,
    Read,
    JitNames,
    Python,
    Jvm,
    Totals,
    /// Not a wake-up of its own: the totals sent for `/metrics` at a
    /// wake-up of another cause, counted with the CPU they took.
    Publish,
}

impl Wake {
    pub const ALL: [Wake; 15] = [
        Wake::Records,
        Wake::DrainTimer,
        Wake::MappingFeed,
        Wake::IntervalEnd,
        Wake::AnswersWait,
        Wake::Pods,
        Wake::Policies,
        Wake::Gone,
        Wake::Described,
        Wake::Read,
        Wake::JitNames,
        Wake::Python,
        Wake::Jvm,
        Wake::Totals,
        Wake::Publish,
    ];
    pub const COUNT: usize = Self::ALL.len();
}

/// Wake-ups and CPU time by [`Wake`] (indexed by `Wake as usize`).
#[derive(Debug, Clone, Copy, Default)]
pub struct WakeupTotals {
    pub wakeups: [u64; Wake::COUNT],
    pub cpu_seconds: [f64; Wake::COUNT],
}

/// Counts the sampling thread's wake-ups, with the thread CPU time from
/// the end of one to the end of the next (the wait's own system calls
/// are paid for the wake-up that ends it).
#[derive(Debug)]
pub struct WakeupTally {
    totals: WakeupTotals,
    last_cpu: Duration,
}

impl WakeupTally {
    pub fn new() -> Self {
        Self {
            totals: WakeupTotals::default(),
            last_cpu: thread_cpu_time(),
        }
    }

    /// The thread is done with a wake-up caused by `wake` (or with the
    /// [`Wake::Publish`] that followed one).
    pub fn handled(&mut self, wake: Wake) {
        let now = thread_cpu_time();
        let index = wake as usize;
        self.totals.wakeups[index] += 1;
        self.totals.cpu_seconds[index] += now.saturating_sub(self.last_cpu).as_secs_f64();
        self.last_cpu = now;
    }

    pub fn totals(&self) -> WakeupTotals {
        self.totals
    }
}

/// The calling thread's CPU time (user and system) so far; zero if the
/// clock cannot be read (then the tally counts wake-ups only).
fn thread_cpu_time() -> Duration {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec to a valid pointer.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) } != 0 {
        return Duration::ZERO;
    }
    Duration::new(now.tv_sec as u64, now.tv_nsec as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wake_up_is_counted_under_its_cause_with_the_cpu_spent_since_the_last() {
        let mut tally = WakeupTally::new();
        tally.handled(Wake::DrainTimer);
        // Spin until the thread's own clock has moved by a millisecond.
        let from = thread_cpu_time();
        let mut spins = 0u64;
        while thread_cpu_time().saturating_sub(from) < Duration::from_millis(1) {
            spins = std::hint::black_box(spins + 1);
        }
        tally.handled(Wake::Records);
        tally.handled(Wake::Records);
        let totals = tally.totals();
        assert_eq!(totals.wakeups[Wake::DrainTimer as usize], 1);
        assert_eq!(totals.wakeups[Wake::Records as usize], 2);
        assert_eq!(totals.wakeups.iter().sum::<u64>(), 3);
        let records = totals.cpu_seconds[Wake::Records as usize];
        assert!(records >= 0.001, "records cost {records} s, spun 1 ms");
        assert!(totals.cpu_seconds[Wake::Totals as usize] == 0.0);
    }

    #[test]
    fn every_cause_is_listed_once_at_its_index() {
        for (index, wake) in Wake::ALL.into_iter().enumerate() {
            assert_eq!(wake as usize, index, "{wake:?}");
        }
    }
}
