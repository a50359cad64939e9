//! The per-CPU side-band events and draining them.
//!
//! Owns: [`MappingEvents`] (one dummy perf event and ring per CPU, opened
//! with the attr of [`side_band_attr`]), its [`Config`], why opening
//! fails ([`OpenError`]), and what a drain saw ([`DrainStats`]).
//!
//! Does not own: the ring protocol ([`sys`](crate::sys)), record framing
//! ([`walk`](crate::walk)) and decoding ([`record`](crate::record)), or what
//! the events mean for a process table (the agent's business). It does not
//! poll or wait: the agent drains these rings right before each drain of its
//! sample ring, so every mapping a sample can hit is known when the sample
//! is unwound; [`MappingEvents::as_fds`] is there for callers that prefer to
//! poll (a ring signals readiness when a quarter of it is full).

use std::{io, os::fd::BorrowedFd, path::Path};

use thiserror::Error;

use crate::{
    attr::side_band_attr,
    cpus::{CpuListError, ONLINE_CPUS, read_cpu_list},
    record::{Event, EventKind, RecordError, parse_record},
    sys::{Ring, page_size, perf_event_open},
};

/// The largest ring [`Config::data_pages`] accepts per CPU (1 GiB with 4 KiB
/// pages): far beyond any useful size, it bounds the arithmetic.
pub const MAX_DATA_PAGES: usize = 1 << 18;

/// Whether to ask the kernel for build-ids in mmap records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BuildIds {
    /// Ask, and fall back to device and inode on kernels before 5.12
    /// ([`MappingEvents::build_ids`] says which it got).
    #[default]
    IfSupported,
    /// Ask, and fail with [`OpenError::NoBuildIdSupport`] if the kernel
    /// cannot.
    Required,
    /// Do not ask: every mmap record carries device and inode. Saves the
    /// kernel reading the ELF note at every mmap.
    Never,
}

/// How to open [`MappingEvents`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Pages in each CPU's data area; a power of two. The default, 64 (256
    /// KiB with 4 KiB pages), holds about 400 fork+exec+exit cycles of a
    /// small dynamically linked program per CPU between two drains
    /// (`/bin/true` costs 7 records, 656 bytes: fork, comm, mmaps of the
    /// binary, ld.so, vDSO and libc, exit). The mappings count against
    /// `kernel.perf_event_mlock_kb` unless the process has `CAP_IPC_LOCK`.
    pub data_pages: usize,
    pub build_ids: BuildIds,
    /// The CPUs to open events on; `None` reads
    /// `/sys/devices/system/cpu/online`.
    pub cpus: Option<Vec<u32>>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            data_pages: 64,
            build_ids: BuildIds::default(),
            cpus: None,
        }
    }
}

/// Why [`MappingEvents::open`] failed.
#[derive(Debug, Error)]
pub enum OpenError {
    /// [`Config::data_pages`] is 0, not a power of two, or above
    /// [`MAX_DATA_PAGES`].
    #[error("data_pages {pages} is not a power of two between 1 and {MAX_DATA_PAGES}")]
    BadDataPages { pages: usize },
    /// `/sys/devices/system/cpu/online` could not be read.
    #[error("reading {ONLINE_CPUS}")]
    OnlineCpus {
        #[source]
        source: io::Error,
    },
    /// The online CPU list (or [`Config::cpus`], when empty) is unusable.
    #[error("the list of CPUs to open events on")]
    CpuList(#[source] CpuListError),
    /// `perf_event_open` said `EACCES`/`EPERM`: a system-wide event needs
    /// `CAP_PERFMON` (or `CAP_SYS_ADMIN`, or root), or
    /// `kernel.perf_event_paranoid` at 0 or below.
    #[error(
        "not allowed to open a system-wide perf event on CPU {cpu} (needs CAP_PERFMON or root, \
         or kernel.perf_event_paranoid <= 0)"
    )]
    Permission {
        cpu: u32,
        #[source]
        source: io::Error,
    },
    /// [`BuildIds::Required`], and the kernel rejected `build_id` (it
    /// needs Linux 5.12).
    #[error("the kernel cannot put build-ids in mmap records (needs Linux 5.12)")]
    NoBuildIdSupport {
        #[source]
        source: io::Error,
    },
    /// The process or the system is out of file descriptors (one per CPU is
    /// needed).
    #[error("out of file descriptors opening the perf event of CPU {cpu}")]
    TooManyFiles {
        cpu: u32,
        #[source]
        source: io::Error,
    },
    /// The kernel has no perf events, or no software events
    /// (`ENOSYS`/`ENOENT`/`EOPNOTSUPP`).
    #[error("perf events are not supported by this kernel")]
    Unsupported {
        cpu: u32,
        #[source]
        source: io::Error,
    },
    /// The kernel rejected the attr (`EINVAL`/`E2BIG`) even without
    /// `build_id`: a kernel older than `use_clockid` (4.1) or `comm_exec`
    /// (3.16), or a CPU number it does not have.
    #[error("the kernel rejected the side-band perf event on CPU {cpu}")]
    InvalidAttr {
        cpu: u32,
        #[source]
        source: io::Error,
    },
    /// Any other `perf_event_open` failure (e.g. `ENODEV`: the CPU is offline).
    #[error("perf_event_open on CPU {cpu}")]
    Open {
        cpu: u32,
        #[source]
        source: io::Error,
    },
    /// Mapping the ring buffer failed: `EPERM` when the rings exceed
    /// `kernel.perf_event_mlock_kb` (and `RLIMIT_MEMLOCK`) without
    /// `CAP_IPC_LOCK`, `ENOMEM` when memory is short.
    #[error("mapping the perf ring buffer of CPU {cpu}")]
    Mmap {
        cpu: u32,
        #[source]
        source: io::Error,
    },
}

impl OpenError {
    fn from_open(cpu: u32, source: io::Error) -> Self {
        match source.raw_os_error() {
            Some(libc::EACCES | libc::EPERM) => Self::Permission { cpu, source },
            Some(libc::EMFILE | libc::ENFILE) => Self::TooManyFiles { cpu, source },
            Some(libc::ENOSYS | libc::ENOENT | libc::EOPNOTSUPP) => {
                Self::Unsupported { cpu, source }
            }
            Some(libc::EINVAL | libc::E2BIG) => Self::InvalidAttr { cpu, source },
            _ => Self::Open { cpu, source },
        }
    }
}

/// What one drain read, over all CPUs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DrainStats {
    /// MMAP and MMAP2 records.
    pub mmap: u64,
    /// COMM records (exec or rename).
    pub comm: u64,
    /// FORK records (processes and threads).
    pub fork: u64,
    /// EXIT records (threads, leaders included).
    pub exit: u64,
    /// LOST records (see [`lost`](Self::lost) for how many they stand for).
    pub lost_records: u64,
    /// Records of other kinds.
    pub other: u64,
    /// Records that could not be decoded (skipped, not delivered).
    pub parse_errors: u64,
    /// Records the kernel dropped because a ring was full: the sum of the
    /// LOST records' counts. The kernel writes a LOST record only once
    /// there is room again, so a loss shows in the drain *after* the one
    /// that emptied the full ring. Processes whose records were lost are not
    /// known from events; the agent falls back to `/proc` for them.
    pub lost: u64,
    /// Bytes of records read.
    pub bytes: u64,
    /// Times a ring's framing was lost (an impossible record header) and
    /// its published bytes were discarded.
    pub resyncs: u64,
    /// Bytes discarded by those resyncs.
    pub discarded_bytes: u64,
}

impl DrainStats {
    /// Records read, decoded or not (resyncs aside).
    pub fn records(&self) -> u64 {
        self.mmap
            + self.comm
            + self.fork
            + self.exit
            + self.lost_records
            + self.other
            + self.parse_errors
    }

    fn count(&mut self, event: &Result<Event, RecordError>) {
        match event {
            Ok(event) => match &event.kind {
                EventKind::Mmap(_) => self.mmap += 1,
                EventKind::Comm(_) => self.comm += 1,
                EventKind::Fork(_) => self.fork += 1,
                EventKind::Exit(_) => self.exit += 1,
                EventKind::Lost { count } => {
                    self.lost_records += 1;
                    self.lost = self.lost.saturating_add(*count);
                }
                EventKind::Other { .. } => self.other += 1,
            },
            Err(_) => self.parse_errors += 1,
        }
    }
}

impl std::ops::AddAssign for DrainStats {
    fn add_assign(&mut self, o: Self) {
        self.mmap += o.mmap;
        self.comm += o.comm;
        self.fork += o.fork;
        self.exit += o.exit;
        self.lost_records += o.lost_records;
        self.other += o.other;
        self.parse_errors += o.parse_errors;
        self.lost = self.lost.saturating_add(o.lost);
        self.bytes += o.bytes;
        self.resyncs += o.resyncs;
        self.discarded_bytes += o.discarded_bytes;
    }
}

/// One CPU's event and ring.
struct CpuRing {
    cpu: u32,
    ring: Ring,
}

/// Every executable mmap, comm change, fork and exit on the host, from one
/// dummy perf event per CPU.
///
/// Records of one CPU come out in the order they were written, which is time
/// order; records of different CPUs interleave arbitrarily, so a process's
/// Fork (written on the parent's CPU) can come out after its Mmap (written on
/// the child's). [`drain_sorted`](Self::drain_sorted) merges them by time and
/// is what a process table wants.
///
/// Times are `CLOCK_MONOTONIC` nanoseconds, the clock of `bpf_ktime_get_ns()`.
/// Pids are as seen from the pid namespace of the process that opened the
/// events.
pub struct MappingEvents {
    rings: Vec<CpuRing>,
    build_ids: bool,
    /// Holds one record that wraps around the end of a ring; never larger
    /// than a record (at most 64 KiB, `header.size` being a `u16`).
    scratch: Vec<u8>,
    /// Reused by `drain_sorted`; bounded by what the rings hold.
    sorted: Vec<Event>,
}

impl MappingEvents {
    /// Opens one event and maps one ring per CPU. Needs `CAP_PERFMON` (or
    /// root); see [`OpenError`].
    pub fn open(config: &Config) -> Result<Self, OpenError> {
        let pages = config.data_pages;
        if !pages.is_power_of_two() || pages > MAX_DATA_PAGES {
            return Err(OpenError::BadDataPages { pages });
        }
        let cpus = match &config.cpus {
            Some(cpus) => {
                let mut cpus = cpus.clone();
                cpus.sort_unstable();
                cpus.dedup();
                cpus
            }
            None => read_cpu_list(Path::new(ONLINE_CPUS))
                .map_err(|source| OpenError::OnlineCpus { source })?
                .map_err(OpenError::CpuList)?,
        };
        if cpus.is_empty() {
            return Err(OpenError::CpuList(CpuListError::Empty));
        }
        let page_size = page_size();
        let data_size = pages.saturating_mul(page_size);
        // Wake a poller when a quarter of the ring is full: early enough to
        // drain before the ring overflows, late enough not to wake per record.
        let watermark = u32::try_from(data_size / 4).unwrap_or(u32::MAX);

        let mut build_ids = config.build_ids != BuildIds::Never;
        let mut rings = Vec::with_capacity(cpus.len());
        for cpu in cpus {
            let fd = match perf_event_open(&side_band_attr(watermark, build_ids), cpu) {
                Ok(fd) => fd,
                // Only the first open tells whether `build_id` is the
                // problem: once one CPU accepted it, they all do.
                Err(e)
                    if e.raw_os_error() == Some(libc::EINVAL) && build_ids && rings.is_empty() =>
                {
                    if config.build_ids == BuildIds::Required {
                        return Err(OpenError::NoBuildIdSupport { source: e });
                    }
                    let fd = perf_event_open(&side_band_attr(watermark, false), cpu)
                        .map_err(|source| OpenError::from_open(cpu, source))?;
                    tracing::info!(
                        "the kernel cannot put build-ids in mmap records (before Linux 5.12?): \
                         mappings will be identified by device and inode"
                    );
                    build_ids = false;
                    fd
                }
                Err(source) => return Err(OpenError::from_open(cpu, source)),
            };
            let ring = Ring::map(fd, page_size, pages)
                .map_err(|source| OpenError::Mmap { cpu, source })?;
            rings.push(CpuRing { cpu, ring });
        }
        Ok(Self {
            rings,
            build_ids,
            scratch: Vec::new(),
            sorted: Vec::new(),
        })
    }

    /// Whether mmap records carry build-ids (the kernel may still fall back
    /// to device and inode for a file whose build-id it cannot read; see
    /// [`FileRef`](crate::FileRef)).
    pub fn build_ids(&self) -> bool {
        self.build_ids
    }

    /// The CPUs with an event, ascending.
    pub fn cpus(&self) -> impl Iterator<Item = u32> + '_ {
        self.rings.iter().map(|r| r.cpu)
    }

    /// Size of each CPU's data area in bytes.
    pub fn ring_size(&self) -> usize {
        self.rings.first().map_or(0, |r| r.ring.data_size())
    }

    /// The event fds, one per CPU (in [`cpus`](Self::cpus) order), for a
    /// caller that wants to `poll` them: each becomes readable when a quarter
    /// of its ring is full.
    pub fn as_fds(&self) -> impl Iterator<Item = BorrowedFd<'_>> + '_ {
        self.rings.iter().map(|r| r.ring.fd())
    }

    /// Hands every record written since the last drain to `on_event`, CPU by
    /// CPU: in time order within a CPU, not across CPUs (see
    /// [`drain_sorted`](Self::drain_sorted)). Records that cannot be decoded
    /// are counted and skipped.
    pub fn drain(&mut self, mut on_event: impl FnMut(Event)) -> DrainStats {
        let mut stats = DrainStats::default();
        for CpuRing { cpu, ring } in &mut self.rings {
            let walk = ring.read(&mut self.scratch, |bytes| {
                let event = parse_record(bytes, true);
                stats.count(&event);
                match event {
                    Ok(event) => on_event(event),
                    Err(error) => tracing::debug!(cpu = *cpu, %error, "undecodable perf record"),
                }
            });
            stats.bytes += walk.bytes;
            if let Some(discarded) = walk.discarded {
                stats.resyncs += 1;
                stats.discarded_bytes += discarded;
                tracing::warn!(
                    cpu = *cpu,
                    discarded,
                    "impossible record header in a perf ring: discarded its unread records"
                );
            }
        }
        stats
    }

    /// [`drain`](Self::drain), with every CPU's records merged into one time
    /// order (records with equal times keep their per-CPU order).
    ///
    /// The order is exact within one drain. Across drains it almost is: a
    /// record is timestamped a moment before it is published, so one written
    /// on another CPU just as this drain reads its ring can come out in the
    /// next drain with a time slightly (microseconds) before the last event
    /// of this one.
    pub fn drain_sorted(&mut self, mut on_event: impl FnMut(Event)) -> DrainStats {
        let mut events = std::mem::take(&mut self.sorted);
        let stats = self.drain(|event| events.push(event));
        events.sort_by_key(|event| event.time_ns);
        for event in events.drain(..) {
            on_event(event);
        }
        self.sorted = events;
        stats
    }
}

impl std::fmt::Debug for MappingEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappingEvents")
            .field("cpus", &self.cpus().collect::<Vec<_>>())
            .field("ring_size", &self.ring_size())
            .field("build_ids", &self.build_ids)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_data_pages() {
        for pages in [0, 3, 100, MAX_DATA_PAGES * 2] {
            let config = Config {
                data_pages: pages,
                ..Config::default()
            };
            assert!(matches!(
                MappingEvents::open(&config),
                Err(OpenError::BadDataPages { pages: p }) if p == pages
            ));
        }
    }

    #[test]
    fn empty_cpu_list() {
        let config = Config {
            cpus: Some(vec![]),
            ..Config::default()
        };
        assert!(matches!(
            MappingEvents::open(&config),
            Err(OpenError::CpuList(CpuListError::Empty))
        ));
    }

    #[test]
    fn open_errors_by_errno() {
        let e = |errno| OpenError::from_open(1, io::Error::from_raw_os_error(errno));
        assert!(matches!(
            e(libc::EACCES),
            OpenError::Permission { cpu: 1, .. }
        ));
        assert!(matches!(e(libc::EPERM), OpenError::Permission { .. }));
        assert!(matches!(e(libc::EMFILE), OpenError::TooManyFiles { .. }));
        assert!(matches!(e(libc::ENOSYS), OpenError::Unsupported { .. }));
        assert!(matches!(e(libc::EINVAL), OpenError::InvalidAttr { .. }));
        assert!(matches!(e(libc::ENODEV), OpenError::Open { .. }));
    }

    #[test]
    fn stats_add_up() {
        let mut a = DrainStats {
            mmap: 1,
            lost: 5,
            bytes: 100,
            ..DrainStats::default()
        };
        a += DrainStats {
            mmap: 2,
            parse_errors: 1,
            lost: 1,
            ..DrainStats::default()
        };
        assert_eq!(
            (a.mmap, a.parse_errors, a.lost, a.bytes, a.records()),
            (3, 1, 6, 100, 4)
        );
    }
}
