//! The agent's one memory budget (`--memory-limit`; the limit and where it
//! came from are `stackscope_metadata::memory_limit`'s): its split among
//! the caches and queues that grow with the workload.
//!
//! Each of them has a size of its own when memory is plentiful; when their
//! sizes and the agent's baseline add up to more than the limit, they give
//! way in a fixed order, each down to a floor before the next is cut: first
//! what only costs work to rebuild (files the symbolizer holds open, then
//! perf maps, Python code objects and JVM code, Go tables), then what holds
//! samples (the export queue and the samples waiting for their tables, cut
//! together in proportion: both are empty most of the time), last the
//! unwind tables no live process uses. Those cost more than work: a
//! process that lives less than its tables take to load (a build's
//! compilers) is walked after it exits, when what its deep stacks need can
//! no longer be read (a rustc loop under the 192 MiB default reached the
//! root on 80-85% of its samples with them at their floor, 90-92% with them
//! whole). An agent killed for memory on a busy node loses exactly the
//! profile that was wanted: a smaller cache costs re-reads instead.
//!
//! One share is lent while it goes unused: the export queue's room, to the
//! symbolizer's files (see `aggregate::worker`).

use std::fmt;

pub use stackscope_metadata::memory_limit::{
    DEFAULT_LIMIT, LimitSource, parse_size, resolve_limit,
};
use stackscope_symbolize::node;
use stackscope_unwind::walker::WalkerConfig;

/// Allocations from which glibc's malloc maps memory of their own rather
/// than carving it from its heaps: a freed table compile's rows (tens of
/// MiB for a compiler's libLLVM) go back to the system at once, and a
/// growing one is moved by remapping, not copied.
const MMAP_THRESHOLD: libc::c_int = 256 << 10;

/// Heaps glibc's malloc keeps: by default eight per CPU, each holding on to
/// what its threads freed.
const MALLOC_ARENAS: libc::c_int = 2;

/// Tells glibc's malloc to give memory back: by default its threshold for
/// mapping large allocations rises to the largest freed one (up to 32 MiB),
/// so after the first table compile every later one, and every batch, is
/// carved from heaps that keep what was freed. Under a build machine's
/// load (parallel gcc and rustc compiles, the whole host at 99 Hz) this
/// took the release agent's resident memory after 40 s from 110 to 62 MB,
/// and its peak from 183 to 142 MB. Call before other threads start. Not
/// glibc: nothing to do.
pub fn return_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt takes plain integers; called before other threads
    // allocate.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
        libc::mallopt(libc::M_ARENA_MAX, MALLOC_ARENAS);
    }
}

/// What the agent holds outside the budgeted caches: its code, the
/// runtime's threads, the interval being built, the BPF maps it reads
/// (besides the ring buffer, counted apart).
pub const BASELINE: u64 = 32 << 20;

/// What holds memory within the budget, in the order they give way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Consumer {
    /// Files blazesym keeps open and parsed (by what it holds of them).
    SymbolizerFiles,
    /// JIT perf maps and jitdump names.
    PerfMaps,
    /// Code objects read from CPython processes (their frames' names).
    PythonCode,
    /// Code blobs, method names and inlining read from JVMs.
    JvmCode,
    /// Go function tables of stripped Go binaries.
    GoTables,
    /// Unwind tables no live process uses, kept for the next one.
    UnusedUnwindTables,
    /// Batches waiting for the collector.
    ExportQueue,
    /// Samples waiting for their unwind table or their process's maps.
    HeldSamples,
}

impl Consumer {
    /// Every consumer, the first to give way first.
    pub const ALL: [Consumer; 8] = [
        Consumer::SymbolizerFiles,
        Consumer::PerfMaps,
        Consumer::PythonCode,
        Consumer::JvmCode,
        Consumer::GoTables,
        Consumer::ExportQueue,
        Consumer::HeldSamples,
        Consumer::UnusedUnwindTables,
    ];

    /// When it gives way: consumers of one rank are cut together, in
    /// proportion to what each holds above its floor.
    fn rank(self) -> u8 {
        match self {
            Consumer::SymbolizerFiles => 0,
            Consumer::PerfMaps => 1,
            Consumer::PythonCode | Consumer::JvmCode => 2,
            Consumer::GoTables => 3,
            Consumer::ExportQueue | Consumer::HeldSamples => 4,
            Consumer::UnusedUnwindTables => 5,
        }
    }

    /// Its name in the report and in `/metrics`.
    pub fn name(self) -> &'static str {
        match self {
            Consumer::SymbolizerFiles => "symbolizer_files",
            Consumer::PerfMaps => "perf_maps",
            Consumer::PythonCode => "python_code_objects",
            Consumer::JvmCode => "jvm_code",
            Consumer::GoTables => "go_tables",
            Consumer::UnusedUnwindTables => "unwind_tables_unused",
            Consumer::ExportQueue => "export_queue",
            Consumer::HeldSamples => "samples_waiting",
        }
    }

    /// Its size when memory is plentiful.
    pub fn full(self) -> u64 {
        let walker = WalkerConfig::default();
        let bytes = match self {
            Consumer::SymbolizerFiles => return node::DEFAULT_MAX_OPEN_BYTES,
            Consumer::GoTables => node::DEFAULT_MAX_GO_TABLE_BYTES,
            Consumer::PerfMaps => node::perf_map::MAX_TOTAL_BYTES,
            Consumer::PythonCode => crate::run::DEFAULT_PYTHON_CODE_BYTES,
            Consumer::JvmCode => crate::run::DEFAULT_JVM_CODE_BYTES,
            Consumer::UnusedUnwindTables => walker.table_cache_bytes,
            Consumer::ExportQueue => crate::export::DEFAULT_MAX_QUEUE_BYTES,
            Consumer::HeldSamples => walker.max_waiting_bytes,
        };
        bytes as u64
    }

    /// The least it is cut to: below, it would stop working (one file
    /// open at a time, one batch queued) rather than work with less.
    pub fn floor(self) -> u64 {
        match self {
            Consumer::SymbolizerFiles => 8 << 20,
            _ => 4 << 20,
        }
    }
}

/// Why a limit cannot be kept.
#[derive(Debug, thiserror::Error)]
pub enum BudgetError {
    #[error(
        "memory limit {limit} (from {from}) is below what the agent needs at the least: \
         {needed} (its baseline {baseline}, the ring buffer {ring}, and every cache at its floor)"
    )]
    TooLow {
        limit: Bytes,
        from: LimitSource,
        needed: Bytes,
        baseline: Bytes,
        ring: Bytes,
    },
}

/// The budget: the limit and each consumer's share of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryBudget {
    pub limit: u64,
    pub source: LimitSource,
    /// The baseline and the ring buffer: what the shares leave room for.
    pub reserved: u64,
    shares: [u64; Consumer::ALL.len()],
}

impl MemoryBudget {
    /// Splits `limit` (from `source`) among the consumers, `ring` bytes of
    /// ring buffer and the baseline set aside; `fixed` consumers keep the
    /// size given (a flag of their own), and are never cut. A limit below
    /// [`Self::least`] is refused when the flag set it; one from a cgroup or
    /// the default (too small for a host with many CPUs, whose ring buffer
    /// is larger) leaves every consumer at its floor, and says so.
    pub fn split(
        limit: u64,
        source: LimitSource,
        ring: u64,
        fixed: &[(Consumer, u64)],
    ) -> Result<Self, BudgetError> {
        let fixed_size = |consumer| {
            fixed
                .iter()
                .find(|(which, _)| *which == consumer)
                .map(|&(_, bytes)| bytes)
        };
        let mut shares =
            Consumer::ALL.map(|consumer| fixed_size(consumer).unwrap_or(consumer.full()));
        let floors = Consumer::ALL.map(|consumer| fixed_size(consumer).unwrap_or(consumer.floor()));
        let reserved = BASELINE.saturating_add(ring);
        let least = floors
            .iter()
            .fold(reserved, |sum, &floor| sum.saturating_add(floor));
        if limit < least {
            let err = BudgetError::TooLow {
                limit: Bytes(limit),
                from: source.clone(),
                needed: Bytes(least),
                baseline: Bytes(BASELINE),
                ring: Bytes(ring),
            };
            if source == LimitSource::Flag {
                return Err(err);
            }
            tracing::warn!("{err}: every cache and queue is kept at its floor");
        }
        let total = shares
            .iter()
            .fold(reserved, |sum, &share| sum.saturating_add(share));
        let mut over = total.saturating_sub(limit);
        let mut first = 0;
        for rank in Consumer::ALL.chunk_by(|a, b| a.rank() == b.rank()) {
            let group = first..first + rank.len();
            first = group.end;
            let above: u64 = group
                .clone()
                .map(|i| shares[i].saturating_sub(floors[i]))
                .sum();
            let cut = over.min(above);
            if cut == 0 {
                continue;
            }
            // In proportion to what each holds above its floor; the last
            // takes what rounding left.
            let mut left = cut;
            for i in group.clone() {
                let room = shares[i].saturating_sub(floors[i]);
                let part = if i + 1 == group.end {
                    left.min(room)
                } else {
                    (u128::from(cut) * u128::from(room) / u128::from(above)) as u64
                };
                shares[i] -= part;
                left -= part;
            }
            over -= cut - left;
        }
        Ok(Self {
            limit,
            source,
            reserved,
            shares,
        })
    }

    /// `consumer`'s share.
    pub fn share(&self, consumer: Consumer) -> u64 {
        let at = Consumer::ALL
            .iter()
            .position(|&which| which == consumer)
            .unwrap_or_default();
        self.shares[at]
    }

    /// Each consumer and its share, the first to give way first.
    pub fn shares(&self) -> impl Iterator<Item = (Consumer, u64)> + '_ {
        Consumer::ALL.into_iter().zip(self.shares)
    }

    /// The budget in the report: the limit, its source, what is set aside
    /// and each share, in the order they give way.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "limit_bytes": self.limit,
            "source": self.source.to_string(),
            "reserved_bytes": self.reserved,
            "shares": self
                .shares()
                .map(|(consumer, bytes)| serde_json::json!({
                    "consumer": consumer.name(),
                    "bytes": bytes,
                }))
                .collect::<Vec<_>>(),
        })
    }
}

/// Which of the caches (`sizes`: each process's, in bytes) to empty for
/// the rest to hold at most `max_bytes` together: the largest first (the
/// process with the most code sampled is the one whose names come back
/// soonest). For the caches of runtime code kept per process (Python code
/// objects, JVM code), asked at each interval's end: between, they grow by
/// what one interval's samples name.
pub fn caches_to_clear(mut sizes: Vec<(u32, usize)>, max_bytes: usize) -> Vec<u32> {
    let mut total: usize = sizes.iter().map(|&(_, bytes)| bytes).sum();
    sizes.sort_unstable_by_key(|&(_, bytes)| std::cmp::Reverse(bytes));
    let mut cleared = Vec::new();
    for (tgid, bytes) in sizes {
        if total <= max_bytes {
            break;
        }
        total -= bytes;
        cleared.push(tgid);
    }
    cleared
}

/// Bytes, shown in MiB.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bytes(pub u64);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.1} MiB", self.0 as f64 / f64::from(1 << 20))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn the_largest_code_caches_go_first_until_the_rest_fit() {
        let sizes = vec![(1, 100), (2, 700), (3, 300), (4, 50)];
        assert_eq!(caches_to_clear(sizes.clone(), 2000), Vec::<u32>::new());
        assert_eq!(caches_to_clear(sizes.clone(), 450), vec![2]);
        assert_eq!(caches_to_clear(sizes.clone(), 149), vec![2, 3, 1]);
        assert_eq!(caches_to_clear(sizes, 0), vec![2, 3, 1, 4]);
    }

    #[test]
    fn plenty_of_memory_leaves_every_consumer_its_full_size() {
        let budget = MemoryBudget::split(4 << 30, LimitSource::Flag, 4 * MIB, &[]).unwrap();
        for (consumer, share) in budget.shares() {
            assert_eq!(share, consumer.full(), "{consumer:?}");
        }
    }

    #[test]
    fn what_gives_way_first_is_cut_to_its_floor_before_the_next_is_cut() {
        // 96 MiB: 36 MiB set aside, 60 MiB for the consumers, whose full
        // sizes add up to 1,024 MiB.
        let budget = MemoryBudget::split(96 * MIB, LimitSource::Flag, 4 * MIB, &[]).unwrap();
        let shares: Vec<_> = budget.shares().map(|(_, share)| share / MIB).collect();
        assert_eq!(shares, [8, 4, 4, 4, 4, 4, 4, 28]);
        assert_eq!(Consumer::ALL[7], Consumer::UnusedUnwindTables);
        assert_eq!(
            budget.reserved + budget.shares().map(|(_, share)| share).sum::<u64>(),
            96 * MIB
        );
        // More room goes to what gives way last first; the two queues
        // share theirs.
        let budget = MemoryBudget::split(200 * MIB, LimitSource::Flag, 4 * MIB, &[]).unwrap();
        let shares: Vec<_> = budget.shares().map(|(_, share)| share / MIB).collect();
        assert_eq!(shares, [8, 4, 4, 4, 4, 38, 38, 64]);
        // The default limit, 8 MiB of rings.
        let budget =
            MemoryBudget::split(DEFAULT_LIMIT, LimitSource::Default, 8 * MIB, &[]).unwrap();
        let shares: Vec<_> = budget.shares().map(|(_, share)| share / MIB).collect();
        assert_eq!(shares, [8, 4, 4, 4, 4, 32, 32, 64]);
    }

    #[test]
    fn a_size_given_by_its_own_flag_is_kept_and_counted() {
        let fixed = [(Consumer::ExportQueue, 16 * MIB)];
        let budget = MemoryBudget::split(96 * MIB, LimitSource::Flag, 4 * MIB, &fixed).unwrap();
        assert_eq!(budget.share(Consumer::ExportQueue), 16 * MIB);
        assert_eq!(budget.share(Consumer::HeldSamples), 4 * MIB);
        assert_eq!(budget.share(Consumer::UnusedUnwindTables), 16 * MIB);
    }

    #[test]
    fn a_limit_below_the_floors_is_refused_and_says_what_it_needs() {
        let err = MemoryBudget::split(48 * MIB, LimitSource::Flag, 4 * MIB, &[]).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("48.0 MiB (from --memory-limit)"), "{text}");
        assert!(text.contains("72.0 MiB"), "{text}");
    }

    #[test]
    fn a_cgroups_limit_too_low_for_this_host_leaves_every_cache_at_its_floor() {
        let source = LimitSource::Cgroup {
            path: "/pods/agent".into(),
            limit: 64 * MIB,
        };
        // A host with many CPUs: a 128 MiB ring buffer, mapped twice.
        let budget = MemoryBudget::split(48 * MIB, source, 256 * MIB, &[]).unwrap();
        for (consumer, share) in budget.shares() {
            assert_eq!(share, consumer.floor(), "{consumer:?}");
        }
        // A flag of its own no sum can overflow.
        let fixed = [(Consumer::ExportQueue, u64::MAX)];
        assert!(MemoryBudget::split(96 * MIB, LimitSource::Flag, 4 * MIB, &fixed).is_err());
    }
}
