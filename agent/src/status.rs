//! The periodic status line: rates over the last interval of what the reader
//! received and what the BPF counters say happened in the kernel.

use std::{fmt, time::Duration};

use crate::sampler::Counters;

/// Running totals kept by the reader (user space side of the ring buffer).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ReaderTotals {
    pub records: u64,
    pub bytes: u64,
    pub decode_errors: u64,
    /// Process exec and exit events among the records.
    pub process_events: u64,
}

/// Everything the status line is computed from, at one instant.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub reader: ReaderTotals,
    pub kernel: Counters,
}

/// Rates between two snapshots.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StatusLine {
    pub samples_per_sec: f64,
    pub bytes_per_sec: f64,
    pub dropped: u64,
    pub copy_failed: u64,
    pub decode_errors: u64,
    pub filtered: u64,
    /// Ticks skipped by a cgroup's 1-in-N budget.
    pub budgeted: u64,
    /// Share of ticks that found the CPU idle, in percent.
    pub idle_percent: f64,
}

impl StatusLine {
    pub fn between(before: &Snapshot, after: &Snapshot, elapsed: Duration) -> Self {
        let secs = elapsed.as_secs_f64().max(1e-9);
        let delta = |a: u64, b: u64| b.saturating_sub(a);
        let records = delta(before.reader.records, after.reader.records).saturating_sub(delta(
            before.reader.process_events,
            after.reader.process_events,
        ));
        let bytes = delta(before.reader.bytes, after.reader.bytes);
        let idle = delta(before.kernel.idle, after.kernel.idle);
        let filtered = delta(before.kernel.filtered, after.kernel.filtered);
        let sampled = delta(before.kernel.samples, after.kernel.samples);
        let dropped = delta(
            before.kernel.ring_buffer_full,
            after.kernel.ring_buffer_full,
        );
        let budgeted = delta(before.kernel.budgeted, after.kernel.budgeted);
        let ticks = idle + filtered + budgeted + sampled + dropped;
        Self {
            samples_per_sec: records as f64 / secs,
            bytes_per_sec: bytes as f64 / secs,
            dropped,
            copy_failed: delta(before.kernel.copy_failed, after.kernel.copy_failed),
            decode_errors: delta(before.reader.decode_errors, after.reader.decode_errors),
            filtered,
            budgeted,
            idle_percent: if ticks == 0 {
                0.0
            } else {
                100.0 * idle as f64 / ticks as f64
            },
        }
    }
}

impl fmt::Display for StatusLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:.1} samples/s, {:.1} KiB/s, {} dropped (ring buffer full), {} copy failures, \
             {} decode errors, {} filtered, {} skipped by budgets, {:.0}% idle",
            self.samples_per_sec,
            self.bytes_per_sec / 1024.0,
            self.dropped,
            self.copy_failed,
            self.decode_errors,
            self.filtered,
            self.budgeted,
            self.idle_percent,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_deltas_over_elapsed_time() {
        let before = Snapshot {
            reader: ReaderTotals {
                records: 100,
                bytes: 1 << 20,
                decode_errors: 1,
                process_events: 3,
            },
            kernel: Counters {
                samples: 100,
                ring_buffer_full: 0,
                copy_failed: 2,
                filtered: 10,
                idle: 50,
                budgeted: 0,
                ..Counters::default()
            },
        };
        let after = Snapshot {
            reader: ReaderTotals {
                records: 300,
                bytes: 3 << 20,
                decode_errors: 1,
                process_events: 9,
            },
            kernel: Counters {
                samples: 300,
                ring_buffer_full: 5,
                copy_failed: 3,
                filtered: 15,
                idle: 90,
                budgeted: 150,
                ..Counters::default()
            },
        };
        let line = StatusLine::between(&before, &after, Duration::from_secs(2));
        // 200 records, of which 6 were process events, in 2 s.
        assert_eq!(line.samples_per_sec, 97.0);
        assert_eq!(line.bytes_per_sec, 1048576.0);
        assert_eq!(
            (line.dropped, line.copy_failed, line.decode_errors),
            (5, 1, 0)
        );
        // 40 idle of 40 + 5 + 150 + 200 + 5 ticks.
        assert_eq!(line.idle_percent, 10.0);
        assert_eq!(
            line.to_string(),
            "97.0 samples/s, 1024.0 KiB/s, 5 dropped (ring buffer full), 1 copy failures, \
             0 decode errors, 5 filtered, 150 skipped by budgets, 10% idle"
        );
    }
}
