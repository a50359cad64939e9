//! Mappings as events: what every process forks, execs and maps executable,
//! applied to the process table (lent to the walker) in time order with
//! the samples.
//!
//! Owns: opening the kernel's side-band records
//! ([`stackscope_process_events`]), holding them until the samples before
//! them have been walked (bounded by [`MAX_PENDING`]), turning each into a
//! process-table update, and the counters. Does not own the process table
//! or what a mapping is worth (`stackscope-process-table` through the
//! walker), nor exits (the sampler's exit records, which are in the same
//! ring as the samples, end a process).
//!
//! Order: the sampling thread drains these records first, then the sample ring,
//! and drains them again whenever it reads a sample written after the last
//! drain ([`MappingFeed::catch_up_to`]). Every mmap a sampled thread could
//! have run code from was recorded before the thread ran it, so it is in
//! hand when the sample is read; applying only the events older than each
//! record keeps a sample taken before an exec or a remap from being walked
//! with the mappings made after it. Records the kernel lost leave that
//! incomplete, so the sampling thread then starts every process over (from
//! `/proc`), as it does when the sample ring loses records.

use std::{
    collections::{HashSet, VecDeque},
    os::fd::{AsRawFd as _, RawFd},
    task::Poll,
};

use tokio::io::{Interest, unix::AsyncFd};

use stackscope_process_events::{
    BuildIds, Config, Event, EventKind, FileRef, MappingEvents, Mmap, OpenError,
};
use stackscope_process_table::{
    BuildId, Mapping, MappingPath, ProcessTable,
    maps::{Dev, Perms},
};

use stackscope_telemetry::StateSize;
use stackscope_unwind::walker::{StackWalker, Walked, WalkerRecord};

/// Events held for samples not yet read, at most (a few MB; a fork+exec
/// brings about seven, and the sampling thread drains whenever a CPU's ring is a
/// quarter full and every 500 ms (up to 5 s while few samples come), so this is thousands of execs a second
/// at the least); beyond, the oldest are applied at once (a little early
/// rather than never).
pub const MAX_PENDING: usize = 1 << 16;

/// How long after a drain started a sample taken before it may still be
/// on its way into the ring (written by a program that read the clock just
/// before): events newer than the drain's start minus this wait for the
/// next drain.
const IN_FLIGHT_NS: u64 = 10_000_000;

/// Counters since the feed opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct FeedStats {
    /// Whether the events could be opened (else mappings come from `/proc`
    /// only, as for processes that existed before the agent).
    pub open: bool,
    pub forks: u64,
    pub execs: u64,
    pub mmaps: u64,
    /// Records the kernel lost (its ring was full), ones that did not
    /// parse, and times the reader skipped a ring's contents as corrupt.
    pub lost: u64,
    pub malformed: u64,
    pub resyncs: u64,
    /// Events applied before their time because too many were pending.
    pub applied_early: u64,
}

/// See the module documentation.
pub struct MappingFeed {
    /// The rings' descriptors registered with the runtime, made on the
    /// first [`MappingFeed::readable`] (which runs inside it). Declared
    /// before `events`: dropped (deregistered) before the descriptors close.
    wakers: Option<Vec<AsyncFd<RawFd>>>,
    events: Option<MappingEvents>,
    pending: VecDeque<Event>,
    /// When the kernel's rings were last read (CLOCK_MONOTONIC ns).
    collected_at: u64,
    lost_since_taken: bool,
    /// The processes whose events apply; empty: all.
    only: HashSet<u32>,
    stats: FeedStats,
}

impl MappingFeed {
    /// Opens the events on every CPU. Failing (no perf events, not
    /// permitted), the agent still works for processes it finds in
    /// `/proc`: the failure is logged and the feed stays empty. With
    /// `pids` (the sampler's `--pid` selection), only their events are
    /// applied: no other process is ever sampled.
    pub fn open(pids: &[u32]) -> Self {
        let events = match MappingEvents::open(&Config {
            build_ids: BuildIds::IfSupported,
            ..Config::default()
        }) {
            Ok(events) => Some(events),
            Err(err) => {
                warn_unavailable(&err);
                None
            }
        };
        Self::with(events, pids)
    }

    /// A feed with no events (`--no-mapping-events`).
    pub fn disabled() -> Self {
        Self::with(None, &[])
    }

    fn with(events: Option<MappingEvents>, pids: &[u32]) -> Self {
        Self {
            stats: FeedStats {
                open: events.is_some(),
                ..FeedStats::default()
            },
            wakers: None,
            events,
            pending: VecDeque::new(),
            collected_at: 0,
            lost_since_taken: false,
            only: pids.iter().copied().collect(),
        }
    }

    /// Events read and waiting for the samples before them.
    pub fn state_size(&self) -> StateSize {
        StateSize::entries(
            "mapping_events_pending",
            self.pending.len(),
            Some(MAX_PENDING),
        )
    }

    pub fn stats(&self) -> FeedStats {
        self.stats
    }

    /// Waits until a CPU's ring is a quarter full, when the caller should
    /// [`Self::collect`] before the ring overflows; never, without events.
    /// Cancel safe.
    pub async fn readable(&mut self) {
        let Some(events) = &self.events else {
            return std::future::pending().await;
        };
        let wakers = self.wakers.get_or_insert_with(|| {
            events
                .as_fds()
                .filter_map(|fd| {
                    // SAFETY: the descriptor stays open while it is
                    // registered: `wakers` is dropped before `events`.
                    unsafe { AsyncFd::register_with_interest(fd.as_raw_fd(), Interest::READABLE) }
                        .map_err(|err| err.into_parts().1)
                        .inspect_err(|err| {
                            // The drain timer still reads the ring, only
                            // not early.
                            tracing::warn!("cannot wait on a mapping event ring: {err}")
                        })
                        .ok()
                })
                .collect()
        });
        std::future::poll_fn(|cx| {
            for waker in wakers.iter() {
                if let Poll::Ready(Ok(mut guard)) = waker.poll_read_ready(cx) {
                    // The kernel reports a ring once per crossing of its
                    // mark: the collect that follows reads it.
                    guard.clear_ready();
                    return Poll::Ready(());
                }
            }
            Poll::Pending
        })
        .await
    }

    /// Takes what the kernel recorded since the last call; call it before
    /// draining the sample ring. Returns the time (CLOCK_MONOTONIC ns)
    /// up to which, once that ring is drained, every sample has been read.
    pub fn collect(&mut self) -> u64 {
        let now = monotonic_ns();
        self.collected_at = now;
        let horizon = now.saturating_sub(IN_FLIGHT_NS);
        let Some(events) = self.events.as_mut() else {
            return horizon;
        };
        let (pending, only) = (&mut self.pending, &self.only);
        let drained = events.drain_sorted(|event| {
            if only.is_empty() || event.pid().is_some_and(|pid| only.contains(&pid)) {
                pending.push_back(event);
            }
        });
        self.stats.lost += drained.lost;
        self.stats.malformed += drained.parse_errors;
        self.stats.resyncs += drained.resyncs;
        if drained.lost > 0 || drained.resyncs > 0 {
            self.lost_since_taken = true;
        }
        // Each drain is sorted; one that brings an event older than the
        // last one held (a record that was late into its CPU's ring) is
        // merged in place.
        if !self.pending.iter().is_sorted_by_key(|event| event.time_ns) {
            self.pending
                .make_contiguous()
                .sort_by_key(|event| event.time_ns);
        }
        horizon
    }

    /// Whether records were lost (or skipped as corrupt) since the last
    /// call: what was learned may miss a remap, so the caller starts over.
    pub fn take_losses(&mut self) -> bool {
        std::mem::take(&mut self.lost_since_taken)
    }

    /// Makes sure every event that can precede a record written at
    /// `time_ns` is in hand: a record written after the last
    /// [`Self::collect`] (the sample ring is read while the program writes)
    /// may follow events that came after it too.
    pub fn catch_up_to(&mut self, time_ns: u64) {
        if self.events.is_some() && time_ns > self.collected_at {
            self.collect();
        }
    }

    /// Applies the events older than `time_ns` to the process table the
    /// walker is lent. Samples the walker still holds from before a change
    /// to their process are walked first and go to `on_walk`.
    pub fn apply_until<R: WalkerRecord>(
        &mut self,
        time_ns: u64,
        walker: &mut StackWalker,
        processes: &mut ProcessTable<R>,
        on_walk: &mut impl FnMut(Walked<'_, R>),
    ) {
        while self.pending.len() > MAX_PENDING {
            if let Some(event) = self.pending.pop_front() {
                self.stats.applied_early += 1;
                self.apply(event, walker, processes, on_walk);
            }
        }
        while self
            .pending
            .front()
            .is_some_and(|event| event.time_ns <= time_ns)
        {
            if let Some(event) = self.pending.pop_front() {
                self.apply(event, walker, processes, on_walk);
            }
        }
    }

    fn apply<R: WalkerRecord>(
        &mut self,
        event: Event,
        walker: &mut StackWalker,
        processes: &mut ProcessTable<R>,
        on_walk: &mut impl FnMut(Walked<'_, R>),
    ) {
        match event.kind {
            EventKind::Fork(fork) if fork.is_new_process() => {
                self.stats.forks += 1;
                walker.process_forked(processes, fork.ppid, fork.pid, on_walk);
            }
            EventKind::Comm(comm) if comm.exec => {
                self.stats.execs += 1;
                walker.process_exec_learned(processes, comm.pid, event.time_ns, on_walk);
            }
            EventKind::Mmap(mmap) if mmap.exec => {
                self.stats.mmaps += 1;
                let (mapping, build_id) = mapping_of(&mmap);
                walker.process_mapped(processes, mmap.pid, mapping, build_id, on_walk);
            }
            _ => {}
        }
    }
}

/// The maps line an mmap record stands for, and the build-id the kernel
/// read from the file.
fn mapping_of(mmap: &Mmap) -> (Mapping, Option<BuildId>) {
    let prot = mmap
        .prot
        .unwrap_or(libc::PROT_READ as u32 | libc::PROT_EXEC as u32);
    let perms = Perms {
        read: prot & libc::PROT_READ as u32 != 0,
        write: prot & libc::PROT_WRITE as u32 != 0,
        exec: mmap.exec,
        private: mmap
            .flags
            .is_none_or(|flags| flags & libc::MAP_SHARED as u32 == 0),
    };
    // The kernel names anonymous executable memory `//anon`; maps shows
    // no name for it.
    let path = match mmap.path.as_slice() {
        b"//anon" => MappingPath::Anonymous,
        name => MappingPath::parse(name),
    };
    let (dev, inode, build_id) = match &mmap.file {
        FileRef::BuildId(id) => (Dev::default(), 0, BuildId::new(id.as_bytes())),
        FileRef::Inode {
            major, minor, ino, ..
        } => (
            Dev {
                major: *major,
                minor: *minor,
            },
            *ino,
            None,
        ),
        FileRef::Unknown => (Dev::default(), 0, None),
    };
    let mapping = Mapping {
        start: mmap.start,
        end: mmap.start.saturating_add(mmap.len),
        perms,
        offset: mmap.pgoff,
        dev,
        inode,
        path,
    };
    (mapping, build_id)
}

fn warn_unavailable(err: &OpenError) {
    tracing::warn!(
        "mapping events are not available ({err}): processes are read from /proc when first \
         sampled, so ones that exit within milliseconds lose their names"
    );
}

/// CLOCK_MONOTONIC in nanoseconds: the clock of the samples and events.
pub fn monotonic_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into `now`, which lives
    // for the call; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    (now.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(now.tv_nsec as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use stackscope_process_events::Fork;

    fn mmap(path: &[u8], file: FileRef) -> Mmap {
        Mmap {
            pid: 42,
            tid: 42,
            start: 0x5555_0000_1000,
            len: 0x3000,
            pgoff: 0x1000,
            prot: Some((libc::PROT_READ | libc::PROT_EXEC) as u32),
            flags: Some(libc::MAP_PRIVATE as u32),
            exec: true,
            file,
            path: path.to_vec(),
        }
    }

    #[test]
    fn an_mmap_record_reads_as_its_maps_line() {
        let id = stackscope_process_events::BuildId::new(&[0xab; 20]).expect("a build-id");
        let (mapping, build_id) = mapping_of(&mmap(b"/usr/bin/sort", FileRef::BuildId(id)));
        assert_eq!(
            (mapping.start, mapping.end, mapping.offset),
            (0x5555_0000_1000, 0x5555_0000_4000, 0x1000)
        );
        assert_eq!(mapping.perms.to_string(), "r-xp");
        assert_eq!(mapping.path.file_path(), Some("/usr/bin/sort".as_ref()));
        assert_eq!(build_id, BuildId::new(&[0xab; 20]));

        let inode = FileRef::Inode {
            major: 8,
            minor: 1,
            ino: 1234,
            ino_generation: 0,
        };
        let (mapping, build_id) = mapping_of(&mmap(b"/lib/libz.so.1 (deleted)", inode));
        assert_eq!(
            (mapping.dev, mapping.inode),
            (Dev { major: 8, minor: 1 }, 1234)
        );
        assert!(mapping.path.is_deleted() && build_id.is_none());

        let (mapping, _) = mapping_of(&mmap(b"//anon", FileRef::Unknown));
        assert_eq!(mapping.path, MappingPath::Anonymous);
        let (mapping, _) = mapping_of(&mmap(b"[vdso]", FileRef::Unknown));
        assert_eq!(mapping.path, MappingPath::Vdso);
    }

    #[test]
    fn events_wait_for_the_samples_before_them_and_stay_bounded() {
        let mut feed = MappingFeed::disabled();
        let mut walker = StackWalker::default();
        let mut table: ProcessTable<stackscope_unwind::walker::ProcessState> =
            StackWalker::process_table(&Default::default());
        let fork = |time_ns, pid| Event {
            time_ns,
            cpu: 0,
            kind: EventKind::Fork(Fork {
                pid,
                ppid: 1,
                tid: pid,
                ptid: 1,
            }),
        };
        feed.pending
            .extend([fork(10, 100), fork(20, 101), fork(30, 102)]);
        feed.apply_until(20, &mut walker, &mut table, &mut |_| {});
        assert_eq!(feed.pending.len(), 1, "the event at 30 waits");
        assert_eq!(feed.stats().forks, 2);
        feed.pending
            .extend((0..MAX_PENDING as u32 + 5).map(|i| fork(1_000 + u64::from(i), 200)));
        feed.apply_until(0, &mut walker, &mut table, &mut |_| {});
        assert_eq!(feed.pending.len(), MAX_PENDING);
        assert_eq!(feed.stats().applied_early, 6);
    }
}
