//! What every process on the host maps executable, forks, execs and exits,
//! in order and timestamped.
//!
//! The agent learns mappings as events so that a process living a few
//! milliseconds can still be unwound and named; reading `/proc/<pid>/maps`
//! when a sample arrives loses it. The events are the kernel's perf
//! side-band records, not BPF: one dummy software event per CPU
//! (`perf_event_open`, system-wide) with `mmap2`, `comm`/`comm_exec`, `task`
//! and `build_id`, every record followed by `{pid, tid, time, cpu}` on
//! `CLOCK_MONOTONIC`, so the times compare with the sampler's
//! `bpf_ktime_get_ns()`.
//!
//! - [`MappingEvents`] opens the events and drains their rings
//!   ([`MappingEvents::drain_sorted`] in time order across CPUs);
//! - [`parse_record`] decodes one record into an [`Event`]: an executable
//!   [`Mmap`] (with the file's build-id, or device and inode), a [`Comm`]
//!   (exec or rename), a [`Fork`], an [`Exit`], or lost records;
//! - [`parse_cpu_list`] reads the kernel's CPU list format.
//!
//! It does not keep a process table, read `/proc` for processes that
//! existed before it opened, follow CPU hotplug, or see data (non-executable)
//! mappings. All of its `unsafe` is in one module (`sys`: the syscall, the
//! mapping, the head/tail protocol); everything else works on byte slices.

#![deny(unsafe_code)]

mod attr;
pub mod cpus;
mod events;
pub mod record;
mod sys;
mod walk;

pub use cpus::{CpuListError, parse_cpu_list};

/// For the fuzz targets (`fuzz/`) only: the private ring walk, so the
/// decoder is fuzzed on what the walk hands it.
#[doc(hidden)]
pub mod fuzzing {
    /// [`walk_records`](crate::walk::walk_records): each record of
    /// `first ++ second` to `on_record`; returns (records, bytes of them,
    /// bytes discarded by a resync).
    pub fn walk_records(
        first: &[u8],
        second: &[u8],
        scratch: &mut Vec<u8>,
        on_record: impl FnMut(&[u8]),
    ) -> (u64, u64, Option<u64>) {
        let walk = crate::walk::walk_records(first, second, scratch, on_record);
        (walk.records, walk.bytes, walk.discarded)
    }
}
pub use events::{BuildIds, Config, DrainStats, MAX_DATA_PAGES, MappingEvents, OpenError};
pub use record::{
    BuildId, Comm, Event, EventKind, Exit, FileRef, Fork, Mmap, RecordError, TaskName, parse_record,
};
