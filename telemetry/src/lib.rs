//! What a stackscope process tells the people who run it: its Prometheus
//! metrics (`GET /metrics`, OpenMetrics text) and its health
//! (`GET /healthz`: the process is alive and its main loop turns;
//! `GET /readyz`: it is doing its job), served over HTTP.
//!
//! Owns the endpoints, the [`Health`] state, the process-level metrics every
//! stackscope binary exports ([`ProcessMetrics`]: memory, CPU, descriptors;
//! [`ProcessUsage`] reads the CPU and memory for a binary's own reports)
//! and [`ConstMetrics`], the writer binaries use to export the counters they
//! already keep, [`described`], the statistics a binary describes once and
//! renders as `/metrics`, JSON and text reports, [`log_limit`], which keeps
//! repeated trouble to a log line per interval, [`probes`], the hash lookups a sample costs, counted
//! where each is made, and [`tally`], the samples counted per process for
//! a run's report. Which metrics a binary has is the binary's business: it
//! registers them in the [`Registry`](prometheus_client::registry::Registry)
//! it hands to [`router`] or [`serve`].
//!
//! The HTTP side (the endpoints, [`Health`], [`ConstMetrics`],
//! [`ProcessMetrics`]) is behind the `http` feature, on by default: the
//! crates a sample passes through (unwind, sampler, metadata, symbolize)
//! only count ([`probes`]) and report their state's size ([`StateSize`]),
//! and leave it off.

pub mod log_limit;
pub mod probes;
pub mod tally;

/// `err` and its sources, `: `-separated: one log line, or one message to
/// pass on.
pub fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(feature = "http")]
pub mod described;

#[cfg(feature = "http")]
mod http;

#[cfg(feature = "http")]
pub use http::{ConstMetrics, Health, Number, ProcessMetrics, prometheus_client, router, serve};

/// One piece of state: entries now, heap bytes where they are counted, and
/// the bounds it is kept within (`None`: bounded by something else, such as
/// the processes that hold it, which is itself listed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateSize {
    pub name: &'static str,
    pub entries: Option<usize>,
    pub max_entries: Option<usize>,
    pub bytes: Option<usize>,
    pub max_bytes: Option<usize>,
}

impl StateSize {
    pub fn entries(name: &'static str, entries: usize, max_entries: Option<usize>) -> Self {
        Self {
            name,
            entries: Some(entries),
            max_entries,
            bytes: None,
            max_bytes: None,
        }
    }

    /// State measured in bytes only.
    pub fn bytes(name: &'static str, bytes: usize, max_bytes: Option<usize>) -> Self {
        Self {
            name,
            entries: None,
            max_entries: None,
            bytes: Some(bytes),
            max_bytes,
        }
    }

    pub fn with_bytes(mut self, bytes: usize, max_bytes: Option<usize>) -> Self {
        self.bytes = Some(bytes);
        self.max_bytes = max_bytes;
        self
    }
}

/// The process's CPU time and memory at one instant, as [`ProcessMetrics`]
/// exports them; figures that could not be read are `None`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ProcessUsage {
    /// User and system CPU time of every thread, exited ones included.
    pub cpu_seconds: Option<f64>,
    pub resident_bytes: Option<u64>,
    /// The highest resident size since the process started.
    pub peak_resident_bytes: Option<u64>,
}

impl ProcessUsage {
    /// Read from `getrusage` and `/proc/self/status`.
    pub fn now() -> Self {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let bytes = |field: &str| status_kib(&status, field).map(|kib| kib * 1024);
        Self {
            cpu_seconds: cpu_seconds(),
            resident_bytes: bytes("VmRSS:"),
            peak_resident_bytes: bytes("VmHWM:"),
        }
    }
}

/// What the C allocator holds, over all its arenas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeapBytes {
    /// Handed out and not yet freed (small chunks and mmapped blocks).
    pub in_use: usize,
    /// Free chunks kept in the arenas for reuse.
    pub free: usize,
}

/// The allocator's figures, where it is glibc's (`mallinfo2`, which walks
/// every arena under its lock: a scrape's cost, not a sample's).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn heap_bytes() -> Option<HeapBytes> {
    // SAFETY: mallinfo2 takes no arguments and returns a plain struct.
    let info = unsafe { libc::mallinfo2() };
    Some(HeapBytes {
        in_use: info.uordblks + info.hblkhd,
        free: info.fordblks,
    })
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn heap_bytes() -> Option<HeapBytes> {
    None
}

/// A `Name:   1234 kB` field of `/proc/<pid>/status`, in KiB.
pub fn status_kib(status: &str, field: &str) -> Option<u64> {
    let line = status.lines().find(|line| line.starts_with(field))?;
    line[field.len()..].split_whitespace().next()?.parse().ok()
}

/// User plus system CPU time of every thread, exited ones included, in
/// seconds (`getrusage`: microseconds, where `/proc/self/stat` counts in
/// clock ticks of 10 ms, too coarse for a status line's few seconds).
fn cpu_seconds() -> Option<f64> {
    // SAFETY: an all-zero rusage is a valid value of the plain C struct.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes into the struct it is given.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return None;
    }
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    Some(seconds(usage.ru_utime) + seconds(usage.ru_stime))
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    #[test]
    fn cpu_time_is_counted_finer_than_clock_ticks() {
        let cpu = || ProcessUsage::now().cpu_seconds.unwrap();
        let before = cpu();
        let started = Instant::now();
        let mut after = cpu();
        while after == before {
            assert!(started.elapsed() < Duration::from_secs(10), "{before}");
            after = cpu();
        }
        // Clock ticks (`/proc/self/stat`) would step by 10 ms.
        assert!(after - before < 0.005, "{before} -> {after}");
    }

    #[test]
    fn status_fields_are_read_in_kib() {
        let status = "Name:\tagent\nVmHWM:\t   61288 kB\nVmRSS:\t   60880 kB\n";
        assert_eq!(status_kib(status, "VmRSS:"), Some(60880));
        assert_eq!(status_kib(status, "VmHWM:"), Some(61288));
        assert_eq!(status_kib(status, "VmSwap:"), None);
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn the_heap_in_use_counts_what_is_allocated() {
        const BYTES: usize = 64 << 20;
        let before = heap_bytes().unwrap();
        let held = vec![1u8; BYTES];
        let during = heap_bytes().unwrap();
        drop(std::hint::black_box(held));
        let after = heap_bytes().unwrap();
        // Other tests allocate and free meanwhile, but not tens of MiB.
        assert!(
            during.in_use > before.in_use + BYTES / 2,
            "{before:?} {during:?}"
        );
        assert!(
            after.in_use + BYTES / 2 < during.in_use,
            "{during:?} {after:?}"
        );
    }
}
