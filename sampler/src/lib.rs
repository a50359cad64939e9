//! The sampler: loads the BPF program, attaches it to a cpu-clock event on
//! every online CPU and hands the raw records of its ring buffers (one per
//! CPU, see [`rings`]) to a callback, oldest first.
//!
//! It owns the kernel side of the agent's lifetime: everything it loads or
//! attaches is released when the [`Sampler`] is dropped (aya closes the program,
//! link and map file descriptors), so no program of ours outlives the agent.
//! It does not interpret records beyond the framing: see [`record`].
//!
//! The crate is what the agent reads from the kernel: the BPF object (built
//! from `agent-ebpf` by this crate's `build.rs`) and its maps, the records
//! ([`record`], decoded as untrusted input), the kernel's task layout the
//! program is told ([`task_layout`]), and the mapping events applied to the
//! walker in time order with the samples ([`mapping_feed`]). It writes the
//! copy plans to the program's maps but does not make them: the walker's
//! planner (`stackscope_unwind::walker::stitching`) learns them from walks.

mod areas;
mod cpu_clock;
mod losses;
mod mapped;
pub mod mapping_feed;
pub mod record;
mod rings;
mod stack_tops;
pub mod task_layout;

use std::{
    collections::{HashMap as StdHashMap, HashSet as StdHashSet},
    io,
    os::fd::{AsFd as _, AsRawFd, OwnedFd},
    time::{Duration, Instant},
};

use agent_common::{
    COMM_LEN, COUNTER_SLOTS, CgroupPolicy, Counter, MAX_ALLOW_ENTRIES, MAX_DEEP_STACK_BYTES,
    MAX_USER_STACK_BYTES, PAGE_SIZE, PythonProcess, StackPlan, names, stack_top_flags,
};
use aya::{
    Btf, Ebpf, EbpfLoader,
    maps::{Array, HashMap, MapData, PerCpuArray},
    programs::{BtfTracePoint, PerfEvent, RawTracePoint},
    util::{nr_cpus, online_cpus},
};
use tokio::io::unix::AsyncFd;

use stackscope_telemetry::error_chain;
use stackscope_unwind::walker::stitching::PlanUpdate;

use losses::LostRecords;
use record::SampleTally;
pub use rings::RingsError;
use rings::{RingLayout, Rings};
use stack_tops::StackTops;

/// The BPF object built by `build.rs`.
static BPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/agent-ebpf"));

/// Highest sampling frequency accepted. The kernel throttles perf events above
/// `kernel.perf_event_max_sample_rate` anyway; a profiler has no use for more.
pub const MAX_FREQUENCY_HZ: u64 = 10_000;

/// The BPF program wakes the reader once this fraction of a ring is
/// unread (it does not wake it per record, see the program). Few large
/// drains cost less than many small ones: each wake-up finds the walker's
/// caches cold. On busy.c at 997 Hz (2 CPUs, one 4 MiB ring then), a
/// quarter took the agent 5.4 us per sample against 6.3 for an eighth.
const WAKEUP_FRACTION: u32 = 4;
/// Below that, the reader drains the ring buffer on this period (the
/// default of [`SamplerConfig::drain_interval`]).
pub const DRAIN_INTERVAL: Duration = Duration::from_millis(100);

/// What to sample and how.
#[derive(Debug, Clone)]
pub struct SamplerConfig {
    /// Ticks per second per CPU.
    pub frequency_hz: u64,
    /// User stack bytes copied per sample, at most [`MAX_USER_STACK_BYTES`].
    pub user_stack_bytes: u32,
    /// Most bytes of a deep copy (a thread's whole stack, for threads the
    /// agent gives a deep plan), at most [`MAX_DEEP_STACK_BYTES`]; 0: none.
    pub deep_stack_bytes: u32,
    /// Only these processes (tgids); empty means all.
    pub pids: Vec<u32>,
    /// Only tasks in a cgroup marked selected in the policies, or below
    /// one. When `pids` is set too, a task must pass both.
    pub filter_cgroups: bool,
    /// Whether the policies may carry budgets: without budgets or a
    /// cgroup filter, the program skips its cgroup lookups altogether.
    pub cgroup_budgets: bool,
    /// The cgroup policies to start with (v2 id → policy); see
    /// [`Sampler::set_cgroup_policies`] to change them while running.
    pub cgroup_policies: StdHashMap<u64, CgroupPolicy>,
    /// Level passed to the BPF-side logger (aya-log).
    pub bpf_log_level: tracing::Level,
    /// The longest [`Sampler::wait`] waits when the rings stay below their
    /// wake-up mark: the latency of a sample, and the period of a reader's
    /// wake-ups when samples come slowly (each costs a few hundred
    /// microseconds of CPU under virtualisation).
    pub drain_interval: Duration,
    /// The longest the drain period grows to on a quiet host (see
    /// [`DrainPace`]); zero (the default), or at most `drain_interval`,
    /// keeps the period fixed.
    pub idle_drain_interval: Duration,
    /// Off-CPU samples (see [`OffCpuConfig`]); `None`: CPU samples only.
    pub off_cpu: Option<OffCpuConfig>,
}

/// Off-CPU sampling: a sample of each selected user thread's stacks as it
/// blocks (on `sched_switch`), and the time until it runs again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OffCpuConfig {
    /// Samples per second per CPU the program aims at: a CPU that sees more
    /// blocking switches keeps one in N of them (N from the last 100 ms),
    /// and each kept one stands for N.
    pub samples_per_sec: u32,
}

/// The default [`OffCpuConfig::samples_per_sec`]: a stack copy costs about
/// what a tick's does, so this keeps the off-CPU samples' cost near a 200 Hz
/// CPU profile's on a CPU that blocks often, and writes every blocking
/// switch of one that blocks less.
pub const DEFAULT_OFF_CPU_SAMPLES_PER_SEC: u32 = 200;

impl Default for OffCpuConfig {
    fn default() -> Self {
        Self {
            samples_per_sec: DEFAULT_OFF_CPU_SAMPLES_PER_SEC,
        }
    }
}

impl Default for SamplerConfig {
    fn default() -> Self {
        Self {
            frequency_hz: 19,
            user_stack_bytes: agent_common::DEFAULT_USER_STACK_BYTES,
            deep_stack_bytes: MAX_DEEP_STACK_BYTES,
            pids: Vec::new(),
            filter_cgroups: false,
            cgroup_budgets: false,
            cgroup_policies: StdHashMap::new(),
            bpf_log_level: tracing::Level::INFO,
            drain_interval: DRAIN_INTERVAL,
            idle_drain_interval: Duration::ZERO,
            off_cpu: None,
        }
    }
}

/// A host whose drains read fewer records than this per base drain period
/// (judged over a window of drains, see [`DrainPace`]) is quiet. A drain
/// costs the agent about as much as 25-30 records walked whatever it
/// finds (its code and tables are cold again after half a second of other
/// work). On 2 CPUs at the default 19 Hz (19 records a period) the drains
/// 2 s apart instead of 0.5 s made the agent's steady CPU per sample
/// 0.73-0.84x (`cargo xtask bench overhead`, 2026-12-06). At 99 Hz (99 a
/// period) a drain's own cost was still a fifth of the agent's: below 256
/// a period, fewer and larger drains are worth the samples' wait (the idle
/// period at most, 5 s in the agent, and the ring's wake-up mark comes
/// first when they are large).
/// Processes met for the first time still bring the period back at once.
const FEW_RECORDS: f64 = 256.0;

/// How often the rings are drained when they stay below their wake-up
/// mark. Each wake-up costs the same whatever it finds: on a near-idle
/// host (a few samples a minute at 19 Hz) two a second were the larger
/// part of the agent's CPU. Over a window of drains at least `base` long,
/// fewer than [`FEW_RECORDS`] records a `base` period double the period,
/// up to `max`; more bring it back to `base`. Over a window, not per
/// drain: the reader also drains between timed drains (quick drains for
/// new processes, the interval's end), and those find fewer records only
/// for coming sooner. A process met for the first time brings the period
/// back to `base` ([`Self::restart`]): what the agent learns from a
/// process (its maps, a Python process's names) it learns only while the
/// process runs, from drains that come while it does.
#[derive(Debug, Clone, Copy)]
struct DrainPace {
    base: Duration,
    max: Duration,
    now: Duration,
    window_start: Instant,
    window_records: usize,
}

impl DrainPace {
    fn new(base: Duration, max: Duration, at: Instant) -> Self {
        Self {
            base,
            max: max.max(base),
            now: base,
            window_start: at,
            window_records: 0,
        }
    }

    /// Whether the period is above its base: the host is quiet.
    fn paced(&self) -> bool {
        self.now > self.base
    }

    /// The period after a drain at `at` that read `records`.
    fn after(&mut self, records: usize, at: Instant) -> Duration {
        self.window_records = self.window_records.saturating_add(records);
        let span = at.saturating_duration_since(self.window_start);
        if span >= self.base {
            let per_base =
                self.window_records as f64 * self.base.as_secs_f64() / span.as_secs_f64();
            self.now = if per_base < FEW_RECORDS {
                self.now.saturating_mul(2).min(self.max)
            } else {
                self.base
            };
            self.window_start = at;
            self.window_records = 0;
        }
        self.now
    }

    /// The base period again, and a new window from `at`.
    fn restart(&mut self, at: Instant) {
        self.now = self.base;
        self.window_start = at;
        self.window_records = 0;
    }
}

/// What ended a [`Sampler::wait`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Woken {
    /// The program signalled records.
    Signalled,
    /// The drain period was over.
    DrainPeriod,
}

/// Why the sampler could not start or answer.
#[derive(Debug, thiserror::Error)]
pub enum SamplerError {
    #[error("sampling frequency {0} Hz is outside 1..={MAX_FREQUENCY_HZ}")]
    BadFrequency(u64),
    #[error("stack copy size {0} is outside 8..={MAX_USER_STACK_BYTES} bytes")]
    BadStackBytes(u32),
    #[error(
        "deep copy size {0} is neither 0 nor a multiple of 8 in {PAGE_SIZE}..={MAX_DEEP_STACK_BYTES} bytes"
    )]
    BadDeepStackBytes(u32),
    #[error("could not list the CPUs ({what})")]
    Cpus {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("loading the BPF object failed (the agent needs root or CAP_BPF + CAP_PERFMON)")]
    Load(#[source] aya::EbpfError),
    #[error("BPF object has no {0}")]
    Missing(&'static str),
    #[error("BPF program {name} could not be loaded or attached")]
    Program {
        name: &'static str,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("BPF map RECORDS_LOST could not be mapped into memory")]
    MapLostRecords {
        #[source]
        source: io::Error,
    },
    #[error("BPF map STACK_TOPS could not be mapped into memory")]
    MapStackTops {
        #[source]
        source: io::Error,
    },
    #[error("BPF map {name} could not be used")]
    Map {
        name: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("{count} entries for {name}; at most {MAX_ALLOW_ENTRIES} fit")]
    TooManyFilters { name: &'static str, count: usize },
    #[error("attaching the sampling program to CPU {cpu}'s cpu-clock failed")]
    Attach {
        cpu: u32,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Rings(#[from] RingsError),
    #[error("off-CPU profiles cannot run on this kernel: {0}")]
    OffCpuUnsupported(String),
}

/// What the sampling program did since the sampler started: its counters
/// summed over CPUs, and what the records read so far say
/// (`record::SampleTally`: samples, stack bytes, tails, deep copies,
/// Python stacks).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counters {
    pub samples: u64,
    pub ring_buffer_full: u64,
    pub copy_failed: u64,
    /// Kernel-mode ticks of a thread whose process had no address space
    /// left (exiting), sampled by their kernel stack alone.
    pub address_space_gone: u64,
    pub filtered: u64,
    pub idle: u64,
    pub budgeted: u64,
    /// User stack bytes in the records read (copies and tails).
    pub user_stack_bytes: u64,
    /// Tail spans read.
    pub tail_spans: u64,
    /// Whole-stack copies of threads with a deep plan, or of deep
    /// programs' threads not learned yet.
    pub deep_copies: u64,
    /// Of those, the ones read page by page around pages that could not
    /// be read (see `sample_flags::COPY_HOLES`).
    pub deep_copies_with_holes: u64,
    /// Ticks of such threads that fell back to the usual copy.
    pub deep_copy_fallbacks: u64,
    /// Records that woke the reader early (unlearned threads of programs
    /// needing deep copies).
    pub early_wakeups: u64,
    /// Ticks of learned threads whose direct copy could not be made (no
    /// room in the area or the ring, or a faulting read): they took the
    /// usual copy.
    pub direct_copy_fallbacks: u64,
    /// Records the reader found bad in a sample area (see
    /// `areas::AreaError`): each time, the area's unread records were
    /// given up.
    pub bad_area_records: u64,
    /// Python stack records read, and the frames in them.
    pub python_stacks: u64,
    pub python_frames: u64,
    /// Blocking switches of selected user threads seen (off-CPU sampling
    /// on), those the rate or a budget left out, the samples written, the
    /// ones chosen but not written, and the switch-in records written.
    pub off_cpu_switches: u64,
    pub off_cpu_skipped: u64,
    pub off_cpu_samples: u64,
    pub off_cpu_failed: u64,
    pub switch_ins: u64,
}

impl Counters {
    /// Mean user stack bytes per sample (copy plus tail).
    pub fn user_bytes_per_sample(&self) -> f64 {
        self.user_stack_bytes as f64 / self.samples.max(1) as f64
    }
}

/// Kernel-measured cost of the BPF program, available while stats are enabled
/// (`kernel.bpf_stats_enabled`, or [`Sampler::enable_run_time_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProgramStats {
    pub run_time: Duration,
    pub run_count: u64,
}

impl ProgramStats {
    /// Mean cost of one run, if the program ran at all.
    pub fn per_run(&self) -> Option<Duration> {
        let count = u32::try_from(self.run_count).ok().filter(|&c| c > 0)?;
        Some(self.run_time / count)
    }
}

/// A loaded and attached sampler. Dropping it detaches and unloads everything.
pub struct Sampler {
    rings: Rings,
    drain_timer: tokio::time::Interval,
    pace: DrainPace,
    counters: PerCpuArray<MapData, u64>,
    /// The `CGROUP_POLICY` map and what we last wrote into it.
    policy_map: HashMap<MapData, u64, CgroupPolicy>,
    policies: StdHashMap<u64, CgroupPolicy>,
    /// Per-thread stack plans and per-process copy sizes (LRU maps).
    plan_map: HashMap<MapData, u32, StackPlan>,
    copy_map: HashMap<MapData, u32, u32>,
    /// Per-thread stack tops, mapped.
    stack_tops: StackTops,
    /// Threads whose tops a full set gave up since the last
    /// [`Self::take_evicted_tops`].
    evicted_tops: Vec<u32>,
    /// Thread names of programs needing deep copies (LRU).
    deep_program_map: HashMap<MapData, [u8; COMM_LEN], u8>,
    python_map: HashMap<MapData, u32, PythonProcess>,
    /// The processes `python_map` holds (at most `MAX_PYTHON_PROCESSES`:
    /// the map refuses more), whose threads' tops get
    /// [`stack_top_flags::PYTHON`].
    python_tgids: StdHashSet<u32>,
    /// `PACED_DRAINS`: whether the program wakes the reader for new
    /// processes, and what we last wrote.
    paced_map: Array<MapData, u32>,
    paced: bool,
    /// What the records read so far say (the program counts the rest).
    records_read: SampleTally,
    /// Records lost to full rings, as the program counts them (mapped).
    records_lost: LostRecords,
    /// Ring buffer losses already reported by `take_new_losses`.
    losses_seen: u64,
    /// The off-CPU program attached, if any (see [`OffCpuConfig`]).
    off_cpu_program: Option<&'static str>,
    log_task: Option<tokio::task::JoinHandle<()>>,
    /// The sampling program's cpu-clock event on each online CPU (see
    /// [`cpu_clock`]), held open: closing one detaches the program there.
    _cpu_clock_events: Vec<OwnedFd>,
    // Owns the programs and their links; declared last so it drops last.
    ebpf: Ebpf,
}

impl Sampler {
    /// Loads the program, fills the allow-lists and attaches to every online
    /// CPU. Must be called inside a tokio runtime.
    pub fn start(config: &SamplerConfig) -> Result<Self, SamplerError> {
        if !(1..=MAX_FREQUENCY_HZ).contains(&config.frequency_hz) {
            return Err(SamplerError::BadFrequency(config.frequency_hz));
        }
        if !(8..=MAX_USER_STACK_BYTES).contains(&config.user_stack_bytes) {
            return Err(SamplerError::BadStackBytes(config.user_stack_bytes));
        }
        let deep = config.deep_stack_bytes;
        if deep != 0
            && (!(PAGE_SIZE..=MAX_DEEP_STACK_BYTES).contains(&deep) || !deep.is_multiple_of(8))
        {
            return Err(SamplerError::BadDeepStackBytes(deep));
        }
        let cpu_slots = nr_cpus().map_err(|(what, source)| SamplerError::Cpus { what, source })?;
        let online = online_cpus().map_err(|(what, source)| SamplerError::Cpus { what, source })?;

        let agent_tgid = std::process::id();
        let filter_tgids = u8::from(!config.pids.is_empty());
        let filter_cgroups = u8::from(config.filter_cgroups);
        let cgroup_policies = u8::from(config.filter_cgroups || config.cgroup_budgets);
        let log_level = bpf_log_level(config.bpf_log_level);
        let ring_layout = RingLayout::for_host(cpu_slots, deep);
        // Without the layout samples carry no process start time; process
        // identity then rests on the exec and exit records alone.
        let layout = task_layout::TaskLayout::of_running_kernel()
            .inspect_err(|err| tracing::warn!("samples will carry no process start time: {err}"))
            .ok();
        let (leader_offset, start_offset) =
            layout.map_or((0, 0), |layout| (layout.group_leader, layout.start_time));
        let fsbase_offset = layout.and_then(|layout| layout.fsbase).unwrap_or(0);
        let comm_offset = layout.and_then(|layout| layout.comm).unwrap_or(0);
        let (mm_offset, start_stack_offset) = layout
            .and_then(|layout| layout.stack_start)
            .map_or((0, 0), |stack_start| {
                (stack_start.mm, stack_start.start_stack)
            });
        let wakeup_bytes = u64::from(ring_layout.ring_bytes / WAKEUP_FRACTION);
        let pid_offset = match config.off_cpu {
            Some(_) => off_cpu_pid_offset(layout.as_ref())?,
            None => 0,
        };
        let off_cpu_rate = config.off_cpu.unwrap_or_default().samples_per_sec.max(1);
        let mut ebpf = EbpfLoader::new()
            // The kernel's BTF is only for CO-RE relocations, which a Rust
            // program has none of; parsed by default, it cost about 20 ms
            // of start-up and its whole type graph in memory.
            .btf(None)
            .override_global(names::AGENT_TGID, &agent_tgid, true)
            .override_global(names::USER_STACK_BYTES, &config.user_stack_bytes, true)
            .override_global(names::DEEP_STACK_BYTES, &config.deep_stack_bytes, true)
            .override_global(names::FILTER_TGIDS, &filter_tgids, true)
            .override_global(names::FILTER_CGROUPS, &filter_cgroups, true)
            .override_global(names::CGROUP_POLICIES, &cgroup_policies, true)
            .override_global(names::WAKEUP_BYTES, &wakeup_bytes, true)
            .override_global(names::TASK_GROUP_LEADER_OFFSET, &leader_offset, true)
            .override_global(names::TASK_START_TIME_OFFSET, &start_offset, true)
            .override_global(names::TASK_FSBASE_OFFSET, &fsbase_offset, true)
            .override_global(names::TASK_MM_OFFSET, &mm_offset, true)
            .override_global(names::MM_START_STACK_OFFSET, &start_stack_offset, true)
            .override_global(names::TASK_PID_OFFSET, &pid_offset, true)
            .override_global(names::TASK_COMM_OFFSET, &comm_offset, true)
            .override_global(names::OFF_CPU_SAMPLES_PER_SEC, &off_cpu_rate, true)
            .override_global(aya_log::LEVEL, &log_level, false)
            .map_max_entries(names::SCRATCH, cpu_slots as u32)
            .map_max_entries(names::RECORDS_LOST, cpu_slots as u32)
            // The deep ring's slot, then one per CPU.
            .map_max_entries(names::SAMPLE_RINGS, cpu_slots as u32 + 1)
            .map_max_entries(names::SAMPLE_AREAS, ring_layout.sample_areas)
            .load(BPF_OBJECT)
            .map_err(SamplerError::Load)?;

        let log_task = start_bpf_logger(&mut ebpf);

        // Maps must stay open until the program is loaded: loading resolves
        // the program's map references to their descriptors. Fill the
        // allow-lists after that and before attaching, so no tick is missed.
        let loading = std::time::Instant::now();
        let program = perf_program(&mut ebpf)?;
        program.load().map_err(program_error)?;
        // The verifier's work grows with the paths through the program: a
        // change that multiplies them shows here first (a slow start).
        tracing::debug!(
            program = names::PROGRAM,
            verified_instructions = program
                .info()
                .ok()
                .and_then(|info| info.verified_instruction_count()),
            load_ms = loading.elapsed().as_millis() as u64,
            "loaded"
        );
        // Every CPU's slot holds its ring before any program is attached:
        // a tick that finds none loses its record.
        let areas = match ebpf.take_map(names::SAMPLE_AREAS) {
            Some(aya::maps::Map::Array(map)) => map,
            _ => return Err(SamplerError::Missing(names::SAMPLE_AREAS)),
        };
        let rings = Rings::create(
            ring_layout,
            take_map(&mut ebpf, names::SAMPLE_RINGS)?,
            areas,
        )?;
        let off_cpu_program = match config.off_cpu {
            Some(_) => Some(load_off_cpu(&mut ebpf)?),
            None => None,
        };
        fill_allow_list(&mut ebpf, names::TGID_ALLOW, &config.pids)?;
        let mut policy_map = take_map(&mut ebpf, names::CGROUP_POLICY)?;
        let mut policies = StdHashMap::new();
        apply_policies(&mut policy_map, &mut policies, &config.cgroup_policies)?;
        let program = perf_program(&mut ebpf)?;
        let program_fd = program.fd().map_err(program_error)?.as_fd();
        let cpu_clock_events = online
            .into_iter()
            .map(|cpu| {
                cpu_clock::attach(program_fd, cpu, config.frequency_hz)
                    .map_err(|source| SamplerError::Attach { cpu, source })
            })
            .collect::<Result<Vec<_>, _>>()?;

        // Process lifecycle events keep the agent's view of each process's
        // mappings current; they travel in the sample rings, read in time
        // order with the samples.
        for (name, tracepoint) in [
            (names::EXEC_PROGRAM, names::EXEC_TRACEPOINT),
            (names::EXIT_PROGRAM, names::EXIT_TRACEPOINT),
        ] {
            let error = |source| SamplerError::Program { name, source };
            let program: &mut RawTracePoint = ebpf
                .program_mut(name)
                .ok_or(SamplerError::Missing(name))?
                .try_into()
                .map_err(error)?;
            program.load().map_err(error)?;
            program.attach(tracepoint).map_err(error)?;
        }

        if let Some(name) = off_cpu_program {
            attach_off_cpu(&mut ebpf, name)?;
        }

        let counters = take_map(&mut ebpf, names::COUNTERS)?;
        let records_lost = match ebpf.take_map(names::RECORDS_LOST) {
            Some(aya::maps::Map::Array(map)) => LostRecords::map(map, cpu_slots)
                .map_err(|source| SamplerError::MapLostRecords { source })?,
            _ => return Err(SamplerError::Missing(names::RECORDS_LOST)),
        };
        let plan_map = take_map(&mut ebpf, names::STACK_PLANS)?;
        let copy_map = take_map(&mut ebpf, names::COPY_BYTES)?;
        let stack_tops = match ebpf.take_map(names::STACK_TOPS) {
            Some(aya::maps::Map::Array(map)) => {
                StackTops::map(map).map_err(|source| SamplerError::MapStackTops { source })?
            }
            _ => return Err(SamplerError::Missing(names::STACK_TOPS)),
        };
        let deep_program_map = take_map(&mut ebpf, names::DEEP_PROGRAMS)?;
        let python_map = take_map(&mut ebpf, names::PYTHON_PROCESSES)?;
        let paced_map = take_map(&mut ebpf, names::PACED_DRAINS)?;
        let drain_interval = config.drain_interval.max(Duration::from_millis(1));
        let mut drain_timer = tokio::time::interval(drain_interval);
        drain_timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Ok(Self {
            rings,
            drain_timer,
            pace: DrainPace::new(drain_interval, config.idle_drain_interval, Instant::now()),
            counters,
            records_read: SampleTally::default(),
            records_lost,
            policy_map,
            policies,
            plan_map,
            copy_map,
            stack_tops,
            evicted_tops: Vec::new(),
            deep_program_map,
            python_map,
            python_tgids: StdHashSet::new(),
            paced_map,
            paced: false,
            losses_seen: 0,
            off_cpu_program,
            log_task,
            _cpu_clock_events: cpu_clock_events,
            ebpf,
        })
    }

    /// Writes the walker's copy-size and stack-plan decisions into the maps.
    /// A failed write costs that plan only (the program keeps its defaults
    /// for the thread), so it is logged, not returned.
    pub fn apply_plan_updates(&mut self, updates: impl IntoIterator<Item = PlanUpdate>) {
        for update in updates {
            if let Err(err) = self.apply_plan_update(update) {
                tracing::debug!("stack plan not written: {err}");
            }
        }
    }

    /// Writes one of the walker's decisions into its map.
    pub fn apply_plan_update(&mut self, update: PlanUpdate) -> Result<(), SamplerError> {
        match update {
            PlanUpdate::ProcessCopy { tgid, bytes } => self.set_copy_bytes(tgid, bytes),
            PlanUpdate::Thread { tid, plan } => self.set_stack_plan(tid, plan.as_deref()),
            PlanUpdate::ThreadTop { tid, top } => {
                match top {
                    Some(mut top) => {
                        // Without the flag, the thread's ticks would not
                        // look its process up (see `StackTop`).
                        if self.python_tgids.contains(&top.tgid) {
                            top.flags |= stack_top_flags::PYTHON;
                        }
                        self.evicted_tops.extend(self.stack_tops.insert(tid, top));
                    }
                    None => self.stack_tops.remove(tid),
                }
                Ok(())
            }
            PlanUpdate::DeepProgram { comm, deep } => {
                let result = if deep {
                    self.deep_program_map.insert(comm, 1, 0)
                } else {
                    self.deep_program_map.remove(&comm)
                };
                map_result(names::DEEP_PROGRAMS, result)
            }
        }
    }

    /// The threads whose stack tops a full set of the table gave up for
    /// other threads' since the last call: the walker writes each again at
    /// the thread's next walk to the root.
    pub fn take_evicted_tops(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.evicted_tops)
    }

    /// Sets (or removes) how much of thread `tid`'s stack each tick reads.
    pub fn set_stack_plan(
        &mut self,
        tid: u32,
        plan: Option<&StackPlan>,
    ) -> Result<(), SamplerError> {
        let result = match plan {
            Some(plan) => self.plan_map.insert(tid, plan, 0),
            None => self.plan_map.remove(&tid),
        };
        map_result(names::STACK_PLANS, result)
    }

    /// Sets (or removes) the copy size of process `tgid`'s threads that
    /// have no plan.
    pub fn set_copy_bytes(&mut self, tgid: u32, bytes: Option<u32>) -> Result<(), SamplerError> {
        let result = match bytes {
            Some(bytes) => self.copy_map.insert(tgid, bytes, 0),
            None => self.copy_map.remove(&tgid),
        };
        map_result(names::COPY_BYTES, result)
    }

    /// Has each tick of process `tgid` read its CPython frames as
    /// `python` says (a [`record::PythonStack`] before its sample), or
    /// stops that (None). Threads of the process with a stack top written
    /// before it was described are not read until their tops go or are
    /// written again: the caller sees to that (see
    /// [`stack_top_flags::PYTHON`]).
    pub fn set_python_process(
        &mut self,
        tgid: u32,
        python: Option<&PythonProcess>,
    ) -> Result<(), SamplerError> {
        let result = match python {
            Some(python) => self
                .python_map
                .insert(tgid, python, 0)
                .inspect(|()| _ = self.python_tgids.insert(tgid)),
            None => {
                self.python_tgids.remove(&tgid);
                self.python_map.remove(&tgid)
            }
        };
        map_result(names::PYTHON_PROCESSES, result)
    }

    /// Makes the program's cgroup policies `wanted`: entries no longer
    /// wanted are removed, new or changed ones written. Returns how many
    /// entries changed. Takes effect on the next tick of every CPU.
    pub fn set_cgroup_policies(
        &mut self,
        wanted: &StdHashMap<u64, CgroupPolicy>,
    ) -> Result<usize, SamplerError> {
        apply_policies(&mut self.policy_map, &mut self.policies, wanted)
    }

    /// Drains on `period` from now on: the next timed drain comes one
    /// period from now. The same period again changes nothing.
    fn set_drain_period(&mut self, period: Duration) {
        if period != self.drain_timer.period() {
            tracing::debug!("drain period now {period:?}");
            let mut timer = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
            timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            self.drain_timer = timer;
        }
    }

    /// Brings the drain period back to its base (see `DrainPace`): the
    /// reader met processes for the first time, and learns what it wants
    /// of them only while they run.
    pub fn met_new_processes(&mut self) {
        self.pace.restart(Instant::now());
        self.set_drain_period(self.pace.now);
        self.set_paced(false);
    }

    /// Brings the next timed drain forward to `within` from now (if that
    /// is sooner than the period): samples of processes the reader has not
    /// met yet need their maps read while the processes still run, and a
    /// process may exit within one drain period.
    pub fn drain_within(&mut self, within: Duration) {
        if within < self.drain_timer.period() {
            self.drain_timer.reset_after(within);
        }
    }

    /// Waits until the program signals a batch or the drain period is over,
    /// then passes every queued record to `on_record` and returns how many
    /// there were. Cancel safe: records are only taken once the wait is over.
    pub async fn read_records(&mut self, on_record: impl FnMut(&[u8])) -> io::Result<usize> {
        self.wait().await?;
        Ok(self.drain_records(on_record))
    }

    /// Waits until the program signals a batch or the drain period is over,
    /// and says which; [`Self::drain_records`] then takes what is queued.
    /// Cancel safe.
    pub async fn wait(&mut self) -> io::Result<Woken> {
        tokio::select! {
            ready = self.rings.readable() => ready.map(|()| Woken::Signalled),
            _ = self.drain_timer.tick() => Ok(Woken::DrainPeriod),
        }
    }

    /// Records lost because the ring buffer was full since the last call
    /// (the first call counts from the start). A lost exec or exit record
    /// leaves per-process state stale, so the reader checks this before
    /// each drain. (A sample area holds samples only: its losses are
    /// [`Counters::bad_area_records`].)
    ///
    /// Reads mapped memory: no system call, so it can come before every
    /// drain.
    pub fn take_new_losses(&mut self) -> u64 {
        let total = self.records_lost.total();
        let new = total.saturating_sub(self.losses_seen);
        self.losses_seen = total;
        new
    }

    /// Passes the records queued right now to `on_record`, without waiting,
    /// and paces the timed drains by how many there were ([`DrainPace`]):
    /// the next timed drain comes one period after this one, whatever
    /// called it (the interval's end, a signal from the program, a
    /// message), so that a timed drain never follows another drain by
    /// less than a period unless [`Self::drain_within`] brings it forward.
    pub fn drain_records(&mut self, mut on_record: impl FnMut(&[u8])) -> usize {
        let tally = &mut self.records_read;
        let read = self.rings.drain(|record| {
            tally.count(record);
            on_record(record);
        });
        let period = self.pace.after(read, Instant::now());
        self.set_drain_period(period);
        self.drain_timer.reset();
        self.set_paced(self.pace.paced());
        read
    }

    /// Tells the program whether drains are paced: while they are, a new
    /// process's first tick wakes the reader (see
    /// [`agent_common::MAX_NEW_PROCESS_WAKEUPS`]). A failed write leaves
    /// new processes waiting for the timed drain, so it is logged only.
    fn set_paced(&mut self, paced: bool) {
        if paced == self.paced {
            return;
        }
        match self.paced_map.set(0, u32::from(paced), 0) {
            Ok(()) => self.paced = paced,
            Err(err) => tracing::debug!("{} not written: {err}", names::PACED_DRAINS),
        }
    }

    /// Counters summed over CPUs, with what the records read so far say.
    pub fn counters(&self) -> Result<Counters, SamplerError> {
        let mut totals = [0u64; COUNTER_SLOTS as usize];
        for counter in Counter::ALL {
            let per_cpu =
                self.counters
                    .get(&(counter as u32), 0)
                    .map_err(|source| SamplerError::Map {
                        name: names::COUNTERS,
                        source,
                    })?;
            totals[counter as usize] = per_cpu.iter().sum();
        }
        Ok(Counters {
            samples: self.records_read.samples,
            ring_buffer_full: totals[Counter::RingBufferFull as usize],
            copy_failed: totals[Counter::CopyFailed as usize],
            address_space_gone: totals[Counter::AddressSpaceGone as usize],
            filtered: totals[Counter::Filtered as usize],
            idle: totals[Counter::Idle as usize],
            budgeted: totals[Counter::Budgeted as usize],
            user_stack_bytes: self.records_read.user_stack_bytes,
            tail_spans: self.records_read.tail_spans,
            deep_copies: self.records_read.deep_copies,
            deep_copies_with_holes: self.records_read.deep_copies_with_holes,
            deep_copy_fallbacks: totals[Counter::DeepCopyFallbacks as usize],
            early_wakeups: totals[Counter::EarlyWakeups as usize],
            direct_copy_fallbacks: totals[Counter::DirectCopyFallbacks as usize],
            bad_area_records: self.rings.bad_area_records(),
            python_stacks: self.records_read.python_stacks,
            python_frames: self.records_read.python_frames,
            off_cpu_switches: totals[Counter::OffCpuSwitches as usize],
            off_cpu_skipped: totals[Counter::OffCpuSkipped as usize],
            off_cpu_samples: totals[Counter::OffCpuSamples as usize],
            off_cpu_failed: totals[Counter::OffCpuFailed as usize],
            switch_ins: totals[Counter::SwitchIns as usize],
        })
    }

    /// Run time and count of the sampling program as the kernel accounts them.
    /// Both stay zero unless run-time stats are enabled.
    pub fn program_stats(&self) -> Result<ProgramStats, SamplerError> {
        let program: &PerfEvent = self
            .ebpf
            .program(names::PROGRAM)
            .ok_or(SamplerError::Missing(names::PROGRAM))?
            .try_into()
            .map_err(program_error)?;
        let info = program.info().map_err(program_error)?;
        Ok(ProgramStats {
            run_time: info.run_time(),
            run_count: info.run_count(),
        })
    }

    /// Run time and count of the off-CPU program (one run per context
    /// switch), when it is attached. Zero unless run-time stats are enabled.
    pub fn off_cpu_program_stats(&self) -> Result<Option<ProgramStats>, SamplerError> {
        let Some(name) = self.off_cpu_program else {
            return Ok(None);
        };
        let info = self
            .ebpf
            .program(name)
            .ok_or(SamplerError::Missing(name))?
            .info()
            .map_err(|source| SamplerError::Program { name, source })?;
        Ok(Some(ProgramStats {
            run_time: info.run_time(),
            run_count: info.run_count(),
        }))
    }

    /// Turns on the kernel's BPF run-time accounting for as long as the
    /// returned descriptor is open (`BPF_ENABLE_STATS`), without touching the
    /// `kernel.bpf_stats_enabled` sysctl.
    pub fn enable_run_time_stats() -> io::Result<OwnedFd> {
        aya::sys::enable_stats(aya::sys::Stats::RunTime).map_err(io::Error::other)
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        if let Some(task) = self.log_task.take() {
            task.abort();
        }
    }
}

/// Where `task_struct.pid` is, which the off-CPU program needs, or why
/// off-CPU sampling cannot run here.
fn off_cpu_pid_offset(layout: Option<&task_layout::TaskLayout>) -> Result<u32, SamplerError> {
    // `sched_switch` passes `prev_state` from Linux 5.18 on. A version
    // that cannot be read is not refused: the BTF read below still is.
    if let Ok(version) = aya::util::KernelVersion::current()
        && version < aya::util::KernelVersion::new(5, 18, 0)
    {
        return Err(SamplerError::OffCpuUnsupported(format!(
            "Linux {version:?} is older than 5.18, whose sched_switch tracepoint first passes the task's state"
        )));
    }
    layout
        .and_then(|layout| layout.pid)
        .filter(|&offset| offset != 0)
        .ok_or_else(|| {
            SamplerError::OffCpuUnsupported(format!(
                "task_struct.pid was not found in {}",
                task_layout::VMLINUX_BTF
            ))
        })
}

/// Loads the off-CPU program for `sched_switch`: the BTF tracepoint, or
/// where the kernel refuses it, the raw one. Returns the one loaded. (Before
/// the sampler hands its maps' descriptors back: loading resolves them.)
fn load_off_cpu(ebpf: &mut Ebpf) -> Result<&'static str, SamplerError> {
    let err = match load_off_cpu_btf(ebpf) {
        Ok(()) => return Ok(names::OFF_CPU_PROGRAM),
        Err(err) => err,
    };
    tracing::warn!(
        "off-CPU samples through the raw sched_switch tracepoint: the BTF one failed: {}",
        error_chain(&err)
    );
    let name = names::OFF_CPU_RAW_PROGRAM;
    let program: &mut RawTracePoint = ebpf
        .program_mut(name)
        .ok_or(SamplerError::Missing(name))?
        .try_into()
        .map_err(|source| SamplerError::Program { name, source })?;
    program
        .load()
        .map_err(|source| SamplerError::Program { name, source })?;
    Ok(name)
}

fn load_off_cpu_btf(ebpf: &mut Ebpf) -> Result<(), SamplerError> {
    let name = names::OFF_CPU_PROGRAM;
    let btf = Btf::from_sys_fs().map_err(|err| {
        SamplerError::OffCpuUnsupported(format!("reading the kernel's BTF: {err}"))
    })?;
    let program: &mut BtfTracePoint = ebpf
        .program_mut(name)
        .ok_or(SamplerError::Missing(name))?
        .try_into()
        .map_err(|source| SamplerError::Program { name, source })?;
    program
        .load(names::SWITCH_TRACEPOINT, &btf)
        .map_err(|source| SamplerError::Program { name, source })
}

/// Attaches the off-CPU program `name` that [`load_off_cpu`] loaded.
fn attach_off_cpu(ebpf: &mut Ebpf, name: &'static str) -> Result<(), SamplerError> {
    let error = |source| SamplerError::Program { name, source };
    let program = ebpf.program_mut(name).ok_or(SamplerError::Missing(name))?;
    if name == names::OFF_CPU_PROGRAM {
        let program: &mut BtfTracePoint = program.try_into().map_err(error)?;
        program.attach().map_err(error)?;
    } else {
        let program: &mut RawTracePoint = program.try_into().map_err(error)?;
        program.attach(names::SWITCH_TRACEPOINT).map_err(error)?;
    }
    Ok(())
}

/// Registers a ring buffer's descriptor (the BPF-side logger's) with the
/// tokio reactor.
fn register_readable<T: AsRawFd>(inner: T) -> io::Result<AsyncFd<T>> {
    // SAFETY: aya's ring buffers own their map descriptor for their whole
    // lifetime and always return that same descriptor from `as_raw_fd`.
    unsafe { AsyncFd::register_with_interest(inner, tokio::io::Interest::READABLE) }
        .map_err(|err| err.into_parts().1)
}

/// Writes `keys` into the allow-list map `name`. Our handle is dropped
/// afterwards; the loaded program keeps the map alive.
fn fill_allow_list<K: aya::Pod>(
    ebpf: &mut Ebpf,
    name: &'static str,
    keys: &[K],
) -> Result<(), SamplerError> {
    if keys.is_empty() {
        return Ok(());
    }
    if keys.len() > MAX_ALLOW_ENTRIES as usize {
        return Err(SamplerError::TooManyFilters {
            name,
            count: keys.len(),
        });
    }
    let mut allow: HashMap<_, K, u8> = take_map(ebpf, name)?;
    for key in keys {
        allow
            .insert(key, 1, 0)
            .map_err(|source| SamplerError::Map { name, source })?;
    }
    Ok(())
}

/// Brings `map` (whose content is `written`) to `wanted`; see
/// [`Sampler::set_cgroup_policies`].
fn apply_policies(
    map: &mut HashMap<MapData, u64, CgroupPolicy>,
    written: &mut StdHashMap<u64, CgroupPolicy>,
    wanted: &StdHashMap<u64, CgroupPolicy>,
) -> Result<usize, SamplerError> {
    if wanted.len() > MAX_ALLOW_ENTRIES as usize {
        return Err(SamplerError::TooManyFilters {
            name: names::CGROUP_POLICY,
            count: wanted.len(),
        });
    }
    let error = |source| SamplerError::Map {
        name: names::CGROUP_POLICY,
        source,
    };
    let stale: Vec<u64> = written
        .keys()
        .filter(|id| !wanted.contains_key(id))
        .copied()
        .collect();
    let mut changed = stale.len();
    for id in stale {
        match map.remove(&id) {
            Err(source) if !key_absent(&source) => return Err(error(source)),
            _ => {}
        }
        written.remove(&id);
    }
    for (&id, &policy) in wanted {
        if written.get(&id) != Some(&policy) {
            map.insert(id, policy, 0).map_err(error)?;
            written.insert(id, policy);
            changed += 1;
        }
    }
    Ok(changed)
}

/// A removed entry that was not there (the LRU map evicted it, or it was
/// never written: the planner removes a thread's top with each plan) is
/// fine.
fn map_result(
    name: &'static str,
    result: Result<(), aya::maps::MapError>,
) -> Result<(), SamplerError> {
    match result {
        Err(source) if !key_absent(&source) => Err(SamplerError::Map { name, source }),
        _ => Ok(()),
    }
}

/// Whether `error` says the key was not in the map: aya reports a delete's
/// `ENOENT` as a failed syscall, not as `KeyNotFound`.
fn key_absent(error: &aya::maps::MapError) -> bool {
    match error {
        aya::maps::MapError::KeyNotFound => true,
        aya::maps::MapError::SyscallError(aya::sys::SyscallError { io_error, .. }) => {
            io_error.kind() == io::ErrorKind::NotFound
        }
        _ => false,
    }
}

fn perf_program(ebpf: &mut Ebpf) -> Result<&mut PerfEvent, SamplerError> {
    ebpf.program_mut(names::PROGRAM)
        .ok_or(SamplerError::Missing(names::PROGRAM))?
        .try_into()
        .map_err(program_error)
}

fn program_error(source: aya::programs::ProgramError) -> SamplerError {
    SamplerError::Program {
        name: names::PROGRAM,
        source,
    }
}

fn take_map<M>(ebpf: &mut Ebpf, name: &'static str) -> Result<M, SamplerError>
where
    M: TryFrom<aya::maps::Map, Error = aya::maps::MapError>,
{
    let map = ebpf.take_map(name).ok_or(SamplerError::Missing(name))?;
    M::try_from(map).map_err(|source| SamplerError::Map { name, source })
}

/// What the record rings and sample areas add to the agent's RSS on this
/// host with deep copies of at most `deep_stack_bytes`: a ring's data
/// pages are mapped twice, and each has a page of positions for either
/// side; an area is mapped once. `None` when the CPUs cannot be listed.
pub fn ring_buffer_rss(deep_stack_bytes: u32) -> Option<u64> {
    let cpus = nr_cpus().ok()?;
    let layout = RingLayout::for_host(cpus, deep_stack_bytes);
    // SAFETY: sysconf has no preconditions.
    let page = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    Some(2 * layout.total_bytes() + 2 * page * u64::from(layout.rings()) + layout.area_bytes())
}

/// aya-log level numbers: error = 1 … trace = 5.
fn bpf_log_level(level: tracing::Level) -> u8 {
    match level {
        tracing::Level::ERROR => 1,
        tracing::Level::WARN => 2,
        tracing::Level::INFO => 3,
        tracing::Level::DEBUG => 4,
        tracing::Level::TRACE => 5,
    }
}

/// Forwards BPF-side log records (aya-log) to the `log` facade, which
/// tracing-subscriber bridges into the agent's own log.
fn start_bpf_logger(ebpf: &mut Ebpf) -> Option<tokio::task::JoinHandle<()>> {
    let logger = match aya_log::EbpfLogger::init(ebpf) {
        Ok(logger) => logger,
        Err(err) => {
            tracing::warn!("BPF-side logging unavailable: {err}");
            return None;
        }
    };
    let mut logger = match register_readable(logger) {
        Ok(logger) => logger,
        Err(err) => {
            tracing::warn!("BPF-side logging unavailable: {err}");
            return None;
        }
    };
    Some(tokio::spawn(async move {
        while let Ok(mut guard) = logger.readable_mut().await {
            guard.get_inner_mut().flush();
            guard.clear_ready();
        }
    }))
}

#[cfg(test)]
mod tests {
    #[test]
    fn quiet_drains_come_less_often_and_a_busy_one_brings_the_period_back() {
        let ms = Duration::from_millis;
        let start = Instant::now();
        let at = |millis| start + ms(millis);
        let mut pace = DrainPace::new(ms(500), ms(2000), start);
        assert!(!pace.paced());
        assert_eq!(pace.after(0, at(500)), ms(1000));
        assert!(pace.paced());
        assert_eq!(pace.after(15, at(1500)), ms(2000));
        assert_eq!(pace.after(3, at(3500)), ms(2000), "never past the most");
        // 1,000 records in 2 s is 250 a period: still quiet.
        assert_eq!(pace.after(1000, at(5500)), ms(2000));
        assert_eq!(pace.after(1100, at(7500)), ms(500));
        assert!(!pace.paced());
        // Quick drains 50 ms apart, 30 records each: no judgement until
        // the window is a base period long, and then 300 a period, the
        // rate of a busy host.
        for step in 1..10 {
            assert_eq!(pace.after(30, at(7500 + step * 50)), ms(500));
        }
        assert_eq!(pace.after(30, at(8000)), ms(500));
        // A process met for the first time: the base again, and a window
        // from then.
        pace.after(0, at(8500));
        assert!(pace.paced());
        pace.restart(at(8600));
        assert!(!pace.paced());
        assert_eq!(
            pace.after(0, at(9000)),
            ms(500),
            "the window is 400 ms long"
        );
        assert_eq!(pace.after(0, at(9100)), ms(1000));
        // A most below the base keeps the period fixed.
        let mut fixed = DrainPace::new(ms(100), ms(50), start);
        assert_eq!(fixed.after(0, at(100)), ms(100));
    }

    use super::*;
}
