//! Helpers for stackscope's end-to-end tests: sampling with the real BPF
//! program for a while, cgroups made for a test, `/proc/<pid>/maps` and
//! kallsyms lookups, a collector process and the CLI run against it. Fixture programs and child processes come from
//! `stackscope-test-fixtures`, shared with the unwinder's offline tests.
//!
//! The tests themselves live in `tests/`; they need root and a kernel with BPF.

pub mod debian_python;
pub mod sdk;

/// `dir` under the target directory this test binary runs from
/// (`target/<profile>/deps/<test>`): what tests install or build once per
/// target directory lives there.
pub fn in_target_dir(dir: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.ancestors().nth(3).expect("target directory").join(dir)
}

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    io::{BufRead as _, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::{Duration, Instant},
};

use agent_common::{
    DIRECT_COPY_CLASSES, ProcessEvent, SAMPLE_HEADER_SIZE, StackTop, area_record_bytes,
};
pub use stackscope_process_table::maps::{Mapping, MappingPath};
use stackscope_process_table::{Location, ProcessTable};
use stackscope_sampler::mapping_feed::monotonic_ns;
use stackscope_sampler::{Counters, ProgramStats};
use stackscope_sampler::{
    Sampler, SamplerConfig, Woken,
    record::{DecodeError, OwnedSample, Record},
};
pub use stackscope_test_fixtures::{
    ElfSymbols, Fixture, RunningProcess, fixture_source, free_port, http_get, http_post,
    workspace_binary,
};
use stackscope_unwind::walker::{
    ProcessState, StackWalker, UserStack, WalkOutcome, Walked, WalkerConfig, stitching::PlanUpdate,
};

/// Fails the test with a clear message unless it runs as root.
pub fn require_root() {
    stackscope_test_fixtures::require_root("end-to-end tests load BPF programs");
}

/// Serialises the tests that sample: concurrent runs would compete for the
/// two CPUs and make sample counts depend on scheduling.
pub fn exclusive() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A cgroup made for one test (cgroup v2 unless said); on drop, whatever
/// still runs in it is killed and the cgroup removed.
pub struct TempCgroup {
    pub path: PathBuf,
}

impl TempCgroup {
    pub fn create(name: &str) -> Self {
        let mount = stackscope_metadata::cgroups::cgroup2_mount().expect("a cgroup2 mount");
        Self::create_in(&mount, name)
    }

    /// One at the top of the hierarchy mounted at `mount` (a cgroup v1
    /// controller's, say).
    pub fn create_in(mount: &Path, name: &str) -> Self {
        let path = mount.join(format!("stackscope-test-{name}-{}", std::process::id()));
        std::fs::create_dir(&path)
            .unwrap_or_else(|err| panic!("creating {}: {err}", path.display()));
        Self { path }
    }

    /// A cgroup inside this one, removed on drop (drop it before this one).
    pub fn child(&self, name: &str) -> Self {
        let path = self.path.join(name);
        std::fs::create_dir(&path)
            .unwrap_or_else(|err| panic!("creating {}: {err}", path.display()));
        Self { path }
    }

    /// Moves a process into this cgroup.
    pub fn add(&self, pid: u32) {
        std::fs::write(self.path.join("cgroup.procs"), pid.to_string())
            .expect("moving a process into the cgroup");
    }

    /// This cgroup's path below the hierarchy root, as /proc/<pid>/cgroup shows it.
    pub fn relative_path(&self) -> String {
        let name = self.path.file_name().expect("cgroup directory name");
        format!("/{}", name.to_string_lossy())
    }
}

impl Drop for TempCgroup {
    fn drop(&mut self) {
        let procs = std::fs::read_to_string(self.path.join("cgroup.procs")).unwrap_or_default();
        for pid in procs
            .lines()
            .filter_map(|line| line.trim().parse::<i32>().ok())
        {
            // SAFETY: kill(2) on processes this test put in its own cgroup.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        // The cgroup is busy until its last process has been reaped.
        for _ in 0..100 {
            if std::fs::remove_dir(&self.path).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!("could not remove test cgroup {}", self.path.display());
    }
}

/// The mappings of process `pid`, parsed by the agent's own maps parser.
pub fn read_maps(pid: u32) -> Vec<Mapping> {
    stackscope_process_table::maps::read_maps(pid).expect("reading the fixture's maps")
}

/// What a sampling run read from the ring buffer.
#[derive(Debug, Default)]
pub struct Recorded {
    pub samples: Vec<OwnedSample>,
    /// The ring buffer bytes of each sample's record, index for index
    /// (padding included).
    pub sample_record_bytes: Vec<usize>,
    pub execs: Vec<ProcessEvent>,
    pub exits: Vec<ProcessEvent>,
    pub decode_errors: Vec<DecodeError>,
    pub python_stacks: Vec<PythonStackRecord>,
    /// Switch-in records (off-CPU samples' threads running again).
    pub switch_ins: Vec<agent_common::SwitchIn>,
    /// The sampling program's run time and runs over the whole run (the
    /// kernel's accounting is on while it samples).
    pub program: ProgramStats,
    /// The off-CPU program's, when it was attached.
    pub off_cpu_program: Option<ProgramStats>,
    /// The program's counters at the end of the run.
    pub counters: Counters,
    /// Each record's time (`record::record_time`), in the order read.
    pub read_order: Vec<u64>,
}

/// A Python stack record as read.
#[derive(Debug, Clone)]
pub struct PythonStackRecord {
    pub header: agent_common::PythonStackHeader,
    pub frames: Vec<agent_common::PythonFrame>,
}

/// Runs the real sampler for `duration` and returns every record it read.
pub fn sample_for(config: &SamplerConfig, duration: Duration) -> Recorded {
    sample_while(config, duration, || {})
}

/// Like [`sample_for`], calling `during` once the sampler is attached.
pub fn sample_while(config: &SamplerConfig, duration: Duration, during: impl FnOnce()) -> Recorded {
    sample_with(config, duration, |_| during())
}

/// Like [`sample_for`], with the sampler's maps set by `updates` (as the
/// walker's planner would) before the first tick is read.
pub fn sample_planned(
    config: &SamplerConfig,
    duration: Duration,
    updates: Vec<PlanUpdate>,
) -> Recorded {
    let mut maps_set_ns = 0;
    let mut recorded = sample_with(config, duration, |sampler| {
        apply_each(sampler, updates);
        maps_set_ns = monotonic_ns();
    });
    // Ticks from before the maps were set are not what is tested. Draining
    // the ring is not enough: a tick that looked the maps up just before
    // they were set can still be copying on the other CPU, and commits its
    // record after the drain. Its header's time is taken at the end of the
    // copy, microseconds later, with interrupts off; the margin is
    // thousands of times that.
    recorded.drop_ticks_before(maps_set_ns + IN_FLIGHT_MARGIN.as_nanos() as u64);
    recorded
}

/// Writes each of `updates` to the sampler's maps; a write that fails
/// would leave the test sampling without it.
fn apply_each(sampler: &mut Sampler, updates: Vec<PlanUpdate>) {
    for update in updates {
        let written = format!("{update:?}");
        sampler
            .apply_plan_update(update)
            .unwrap_or_else(|err| panic!("writing {written}: {err}"));
    }
}

/// A wait of the sampler that ended ([`Sampler::wait`]), and the samples
/// the drain after it read.
#[derive(Debug)]
pub struct Wake {
    pub woken: Woken,
    /// Bytes of each CPU's sample area its samples from there had taken
    /// ([`area_record_bytes`]), by CPU. A sample from an area is exactly
    /// its header and stacks long; one from a ring has a class's size or
    /// room for tail spans, so a record of exactly a class's size with no
    /// kernel stack could be either, and counts as from a ring.
    pub area_bytes_by_cpu: BTreeMap<u32, u64>,
    /// Samples from a ring (and the ambiguous ones above).
    pub ring_samples: usize,
}

/// Applies `updates` and drains once, then waits and drains until
/// `duration` is over: each wait's end, with what its drain read.
pub fn wakes_planned(
    config: &SamplerConfig,
    duration: Duration,
    updates: Vec<PlanUpdate>,
) -> Vec<Wake> {
    with_sampler(config, async |sampler| {
        apply_each(sampler, updates);
        // Ticks that looked the maps up before they were set are read here.
        tokio::time::sleep(IN_FLIGHT_MARGIN).await;
        sampler.drain_records(|_| {});
        let deadline = tokio::time::Instant::now() + duration;
        let mut wakes = Vec::new();
        while let Ok(woken) = tokio::time::timeout_at(deadline, sampler.wait()).await {
            let mut wake = Wake {
                woken: woken.expect("waiting for the rings"),
                area_bytes_by_cpu: BTreeMap::new(),
                ring_samples: 0,
            };
            sampler.drain_records(|bytes| {
                let sample = match Record::decode(bytes) {
                    Ok(Record::Sample(sample)) => sample,
                    // Other processes' execs and exits, for one.
                    Ok(_) => return,
                    Err(err) => panic!("a malformed record: {err}"),
                };
                let h = &sample.header;
                let exact =
                    SAMPLE_HEADER_SIZE + h.kernel_stack_len as usize + sample.user_stack.len();
                let class_sized = h.kernel_stack_len == 0
                    && DIRECT_COPY_CLASSES.contains(&(sample.user_stack.len() as u32));
                if bytes.len() == exact && !class_sized {
                    *wake.area_bytes_by_cpu.entry(h.cpu).or_default() +=
                        area_record_bytes(bytes.len() as u64);
                } else {
                    wake.ring_samples += 1;
                }
            });
            wakes.push(wake);
        }
        wakes
    })
}

impl Recorded {
    /// Keeps a record read from the ring buffer.
    fn keep(&mut self, bytes: &[u8]) {
        self.read_order
            .push(stackscope_sampler::record::record_time(bytes));
        match Record::decode(bytes) {
            Ok(Record::Sample(sample)) => {
                self.samples.push(sample.to_owned_sample());
                self.sample_record_bytes.push(bytes.len());
            }
            Ok(Record::Exec(event)) => self.execs.push(event),
            Ok(Record::Exit(event)) => self.exits.push(event),
            Ok(Record::PythonStack(stack)) => self.python_stacks.push(PythonStackRecord {
                header: stack.header,
                frames: stack.frames().collect(),
            }),
            Ok(Record::SwitchIn(switch)) => self.switch_ins.push(switch),
            Err(err) => self.decode_errors.push(err),
        }
    }

    /// Leaves out the records of ticks before `first_tick_ns`.
    fn drop_ticks_before(&mut self, first_tick_ns: u64) {
        let (samples, record_bytes) = std::mem::take(&mut self.samples)
            .into_iter()
            .zip(std::mem::take(&mut self.sample_record_bytes))
            .filter(|(s, _)| s.header.ktime_ns >= first_tick_ns)
            .unzip();
        self.samples = samples;
        self.sample_record_bytes = record_bytes;
        self.python_stacks
            .retain(|s| s.header.ktime_ns >= first_tick_ns);
    }
}

/// Like [`sample_for`], with each process of `tgids` described to the
/// sampler as CPython: the sampler runs until each process's first sample
/// says its start time (the entry's identity), is then told of it by the
/// entry `python` makes of its tgid and that time, and samples `duration`
/// more; samples and Python stacks from ticks before the entries are left
/// out. Each process's main thread is learned too, as the walker learns a
/// thread that reaches its root: its stack top at the end of its stack
/// mapping. Its ticks then read its CPython frames only if the sampler
/// flagged the top as its process's (`stack_top_flags::PYTHON`). One
/// sampler for all (loading it takes seconds in the kernel matrix's
/// emulated machines). The program's statistics are those of the ticks
/// after the entries.
pub fn sample_python(
    config: &SamplerConfig,
    duration: Duration,
    tgids: &[u32],
    python: impl Fn(u32, u64) -> agent_common::PythonProcess,
) -> Recorded {
    with_sampler(config, async |sampler| {
        let mut recorded = Recorded::default();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let mut started: HashMap<u32, u64> = HashMap::new();
        loop {
            for sample in &recorded.samples {
                if tgids.contains(&sample.header.tgid) {
                    started
                        .entry(sample.header.tgid)
                        .or_insert(sample.header.process_start_ns);
                }
            }
            if started.len() == tgids.len() {
                break;
            }
            tokio::select! {
                read = sampler.read_records(|bytes| recorded.keep(bytes)) => {
                    read.expect("reading the ring buffer");
                }
                _ = tokio::time::sleep_until(deadline) => {
                    let unseen: Vec<_> = tgids.iter().filter(|t| !started.contains_key(t)).collect();
                    panic!("no sample of processes {unseen:?} in 30 s");
                }
            }
        }
        let before = sampler.program_stats().expect("the program's statistics");
        for (&tgid, &process_start_ns) in &started {
            sampler
                .set_python_process(tgid, Some(&python(tgid, process_start_ns)))
                .expect("describing the Python process");
            let stack = stackscope_process_table::maps::read_maps(tgid)
                .expect("reading the Python process's maps")
                .into_iter()
                .find(|mapping| mapping.path == MappingPath::Stack)
                .expect("the Python process's stack mapping");
            let top = StackTop {
                tgid,
                flags: 0,
                top: stack.end,
            };
            sampler
                .apply_plan_update(PlanUpdate::ThreadTop {
                    tid: tgid,
                    top: Some(top),
                })
                .expect("writing the main thread's stack top");
        }
        let set_ns = monotonic_ns();
        let mut recorded = record_until(sampler, tokio::time::Instant::now() + duration).await;
        recorded.program.run_time = recorded.program.run_time.saturating_sub(before.run_time);
        recorded.program.run_count = recorded.program.run_count.saturating_sub(before.run_count);
        recorded.drop_ticks_before(set_ns + IN_FLIGHT_MARGIN.as_nanos() as u64);
        recorded
    })
}

/// How long after the sampler's maps are set a tick may still have read
/// them as they were: far longer than one run of the BPF program.
const IN_FLIGHT_MARGIN: Duration = Duration::from_millis(20);

fn sample_with(
    config: &SamplerConfig,
    duration: Duration,
    started: impl FnOnce(&mut Sampler),
) -> Recorded {
    with_sampler(config, async |sampler| {
        started(sampler);
        record_until(sampler, tokio::time::Instant::now() + duration).await
    })
}

/// Runs `run` with a loaded and attached sampler (the kernel's accounting
/// of the program's run time on), in a runtime of its own.
fn with_sampler<T>(config: &SamplerConfig, run: impl AsyncFnOnce(&mut Sampler) -> T) -> T {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async {
        let _run_time_stats = Sampler::enable_run_time_stats().expect("BPF run-time statistics");
        let mut sampler = Sampler::start(config).expect("starting the sampler");
        run(&mut sampler).await
    })
}

/// Every record `sampler` reads until `deadline`, with its counters and
/// the program's statistics then.
async fn record_until(sampler: &mut Sampler, deadline: tokio::time::Instant) -> Recorded {
    let mut recorded = Recorded::default();
    loop {
        tokio::select! {
            read = sampler.read_records(|bytes| recorded.keep(bytes)) => {
                read.expect("reading the ring buffer");
            }
            _ = tokio::time::sleep_until(deadline) => break,
        }
    }
    sampler.drain_records(|bytes| recorded.keep(bytes));
    assert!(
        recorded.decode_errors.is_empty(),
        "malformed records: {:?}",
        recorded.decode_errors
    );
    recorded.counters = sampler.counters().expect("reading the sampler's counters");
    recorded.program = sampler.program_stats().expect("the program's statistics");
    recorded.off_cpu_program = sampler
        .off_cpu_program_stats()
        .expect("the off-CPU program's statistics");
    recorded
}

/// Names the frames of one process: the symbol covering the address in
/// whichever file the process table says is mapped there, or that file's
/// name when no symbol covers it.
pub struct FrameNames {
    pid: u32,
    processes: ProcessTable,
    files: HashMap<PathBuf, ElfSymbols>,
    /// Names by looked-up address: samples repeat the same frames.
    names: HashMap<u64, String>,
}

impl FrameNames {
    pub fn new(pid: u32) -> Self {
        Self {
            pid,
            processes: ProcessTable::default(),
            files: HashMap::new(),
            names: HashMap::new(),
        }
    }

    /// Frame 0 is looked up at its address, the others (return addresses)
    /// one byte back: a call may be the last instruction of its function.
    /// The frame above a signal frame is an interrupted address, not a
    /// return address; looking it up one byte back too only matters when it
    /// is a function's first byte, which the fixtures' spinning loops never
    /// are.
    pub fn names(&mut self, frames: &[u64]) -> Vec<String> {
        frames
            .iter()
            .enumerate()
            .map(|(i, &addr)| self.name(if i == 0 { addr } else { addr - 1 }))
            .collect()
    }

    pub fn name(&mut self, addr: u64) -> String {
        if let Some(name) = self.names.get(&addr) {
            return name.clone();
        }
        let name = match self.processes.lookup(self.pid, addr) {
            Ok(Some(Location::Object(object))) => {
                let path = object.path().file_path().expect("a file").to_path_buf();
                let file_name = path
                    .file_name()
                    .map_or_else(|| path.display().to_string(), |n| n.display().to_string());
                // map_files opens the very file mapped, whatever its path says.
                let map_files = object.region.map_files_path();
                let symbols = self
                    .files
                    .entry(path)
                    .or_insert_with(|| ElfSymbols::read(&map_files));
                let vaddr = object.elf_vaddr.expect("an ELF address");
                symbols.name_at(vaddr).unwrap_or(file_name)
            }
            Ok(Some(Location::Unbacked(region))) => region.mapping.path.to_string(),
            other => format!("{addr:#x}: {other:?}"),
        };
        self.names.insert(addr, name.clone());
        name
    }
}

/// One sample walked by [`walk_live`].
#[derive(Debug, Clone)]
pub struct LiveWalk {
    pub tgid: u32,
    pub tid: u32,
    pub process_start_ns: u64,
    pub frames: Vec<u64>,
    /// The path of the file each frame was placed in (None: no file).
    pub files: Vec<Option<PathBuf>>,
    pub outcome: WalkOutcome,
    pub stitched: bool,
    /// The tick's copy went to the stack's end or the thread's learned top
    /// (`DEEP_COPY` or `COPY_AT_TOP`): what it held was the whole stack.
    pub whole_copy: bool,
}

/// How [`walk_live_with`] treats the ring buffer's records.
#[derive(Debug, Clone, Copy, Default)]
pub struct LiveOptions {
    /// Drop exec and exit records instead of handing them to the walker,
    /// as if the ring buffer had been full when they were written.
    pub withhold_process_events: bool,
}

/// Samples with the real sampler for `duration` and walks each sample as
/// it arrives, writing the walker's copy sizes and stack plans back into
/// the sampler as the agent does (adaptive copies and stack tails, with
/// the walker's defaults and `config`'s copy ceiling). Returns every
/// walk in order, and the kernel's counters.
pub fn walk_live(config: &SamplerConfig, duration: Duration) -> (Vec<LiveWalk>, Counters) {
    walk_live_with(config, duration, LiveOptions::default(), || {})
}

/// [`walk_live`] with `options`, calling `sampling` once the sampler runs
/// (its program loaded and attached), before `duration` starts.
pub fn walk_live_with(
    config: &SamplerConfig,
    duration: Duration,
    options: LiveOptions,
    sampling: impl FnOnce(),
) -> (Vec<LiveWalk>, Counters) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async {
        let mut sampler = Sampler::start(config).expect("starting the sampler");
        sampling();
        let walker_config = WalkerConfig {
            stack_bytes: config.user_stack_bytes,
            deep_stack_bytes: config.deep_stack_bytes,
            ..WalkerConfig::default()
        };
        let mut table: ProcessTable<ProcessState> = StackWalker::process_table(&walker_config);
        let mut walker = StackWalker::new(walker_config);
        let mut walks = Vec::new();
        let mut spans = Vec::new();
        let deadline = tokio::time::Instant::now() + duration;
        loop {
            tokio::select! {
                result = sampler.read_records(|bytes| walk_record(&mut walker, &mut table, &mut spans, &mut walks, options, bytes)) => {
                    result.expect("reading the ring buffer");
                }
                _ = tokio::time::sleep_until(deadline) => break,
            }
            walker.poll(&mut table, |w| walks.push(LiveWalk::of(&w)));
            sampler.apply_plan_updates(walker.take_plan_updates());
        }
        sampler.drain_records(|bytes| walk_record(&mut walker, &mut table, &mut spans, &mut walks, options, bytes));
        let counters = sampler.counters().expect("counters");
        drop(sampler);
        let started = Instant::now();
        while walker.waiting() > 0 && started.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(20));
            walker.poll(&mut table, |w| walks.push(LiveWalk::of(&w)));
        }
        walker.flush(&mut table, |w| walks.push(LiveWalk::of(&w)));
        (walks, counters)
    })
}

impl LiveWalk {
    fn of(walked: &Walked<'_>) -> Self {
        let files = walked
            .walk
            .objects
            .iter()
            .map(|object| match object {
                stackscope_unwind::walker::FrameObject::File { file, .. } => {
                    file.path().file_path().map(Path::to_path_buf)
                }
                _ => None,
            })
            .collect();
        Self {
            tgid: walked.header.tgid,
            tid: walked.header.tid,
            process_start_ns: walked.header.process_start_ns,
            frames: walked.walk.frames.to_vec(),
            files,
            outcome: walked.walk.outcome,
            stitched: walked.walk.stitched,
            whole_copy: walked.header.flags
                & (agent_common::sample_flags::DEEP_COPY | agent_common::sample_flags::COPY_AT_TOP)
                != 0,
        }
    }
}

fn walk_record(
    walker: &mut StackWalker,
    table: &mut ProcessTable<ProcessState>,
    spans: &mut Vec<stackscope_unwind::TailSpan>,
    walks: &mut Vec<LiveWalk>,
    options: LiveOptions,
    bytes: &[u8],
) {
    match Record::decode(bytes).expect("a well-formed record") {
        Record::Sample(sample) => {
            sample.tail_spans(spans);
            let stack = UserStack {
                copy: sample.user_stack,
                spans,
                tail: sample.tail_data(),
            };
            walker.push(table, &sample.header, &[], stack, |w| {
                walks.push(LiveWalk::of(&w))
            });
        }
        Record::Exec(_) | Record::Exit(_) if options.withhold_process_events => {}
        Record::Exec(event) => walker.on_exec(table, event.tgid, event.ktime_ns, |_| {}),
        Record::Exit(event) => {
            walker.on_exit(table, event.tgid);
        }
        Record::PythonStack(_) | Record::SwitchIn(_) => {}
    }
}

/// The kernel's symbol table from `/proc/kallsyms`, sorted by address.
pub fn kernel_symbols() -> Vec<(u64, String)> {
    let kallsyms = std::fs::read_to_string("/proc/kallsyms").expect("reading /proc/kallsyms");
    let mut symbols: Vec<(u64, String)> = kallsyms
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let addr = u64::from_str_radix(fields.next()?, 16).ok()?;
            let name = fields.nth(1)?;
            (addr != 0).then(|| (addr, name.to_string()))
        })
        .collect();
    assert!(
        !symbols.is_empty(),
        "/proc/kallsyms shows no addresses (kptr_restrict?)"
    );
    symbols.sort();
    symbols
}

/// The symbol whose range holds `addr`, from a sorted [`kernel_symbols`] table.
pub fn kernel_symbol(symbols: &[(u64, String)], addr: u64) -> Option<&str> {
    let at = symbols.partition_point(|(start, _)| *start <= addr);
    at.checked_sub(1).map(|i| symbols[i].1.as_str())
}

/// Positions of 8-aligned occurrences of `word` in `bytes`.
pub fn find_word(bytes: &[u8], word: u64) -> impl Iterator<Item = usize> + '_ {
    bytes
        .chunks_exact(8)
        .enumerate()
        .filter(move |(_, chunk)| u64::from_ne_bytes((*chunk).try_into().unwrap()) == word)
        .map(|(i, _)| i * 8)
}

/// A collector process on a temporary database, stopped on drop.
pub struct Collector {
    process: RunningProcess,
    pub grpc: String,
    /// `http://127.0.0.1:<port>` of its HTTP API.
    pub http: String,
    /// Every line the collector has logged so far.
    log: Arc<Mutex<Vec<String>>>,
}

impl Collector {
    /// Starts `stackscope-collector` on free ports and waits until it says
    /// where it listens.
    pub fn start(data_dir: &Path) -> Self {
        Self::start_with(data_dir, &[])
    }

    /// [`Collector::start`] with more arguments. No debuginfod server is
    /// asked unless `args` name one (a `DEBUGINFOD_URLS` in the test's
    /// environment is not passed on).
    pub fn start_with(data_dir: &Path, args: &[&str]) -> Self {
        Self::start_listening(data_dir, "127.0.0.1:0", args)
    }

    /// [`Collector::start_with`] with gRPC on `grpc_listen` (`host:port`),
    /// so that agents find a restarted collector where they left it.
    pub fn start_listening(data_dir: &Path, grpc_listen: &str, args: &[&str]) -> Self {
        let mut child = Command::new(workspace_binary("stackscope-collector"))
            .args(["--data-dir".as_ref(), data_dir.as_os_str()])
            .args(["--grpc-listen", grpc_listen, "--http-listen", "127.0.0.1:0"])
            .args(args)
            .env_remove("DEBUGINFOD_URLS")
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting stackscope-collector");
        let stderr = child.stderr.take().expect("piped stderr");
        let process = RunningProcess::adopt(child);
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut lines = BufReader::new(stderr).lines();
        let (grpc, http) = loop {
            let line = lines
                .next()
                .unwrap_or_else(|| {
                    panic!(
                        "the collector exited before it was ready:\n{}",
                        log.lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .join("\n")
                    )
                })
                .expect("reading the collector's log");
            log.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(line.clone());
            if let Some(at) = line.find("grpc=") {
                let addr = line[at + 5..].split_whitespace().next().unwrap_or_default();
                // `http=Some("http://127.0.0.1:PORT/")`
                let http = line
                    .split("http=Some(\"")
                    .nth(1)
                    .and_then(|rest| rest.split('"').next())
                    .expect("the collector logs its HTTP address as http=Some(\"...\")")
                    .trim_end_matches('/')
                    .to_owned();
                break (format!("http://{addr}"), http);
            }
        };
        // Keep draining the log so the collector never blocks on a full pipe.
        let kept = Arc::clone(&log);
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                kept.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(line);
            }
        });
        Self {
            process,
            grpc,
            http,
            log,
        }
    }

    /// What the collector has logged so far, one line per entry.
    pub fn log(&self) -> Vec<String> {
        self.log
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Kills the collector with SIGKILL, as the OOM killer or a power cut
    /// would stop it: no shutdown code runs.
    pub fn kill(mut self) {
        // SAFETY: kill has no memory-safety preconditions.
        unsafe { libc::kill(self.process.pid() as i32, libc::SIGKILL) };
        let status = self
            .process
            .child
            .wait()
            .expect("waiting for the collector");
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(libc::SIGKILL),
            "the collector exited with {status} before the kill"
        );
    }

    /// Stops the collector with SIGTERM, as a service manager would.
    pub fn stop(mut self) {
        // SAFETY: kill has no memory-safety preconditions.
        unsafe { libc::kill(self.process.pid() as i32, libc::SIGTERM) };
        let status = self
            .process
            .child
            .wait()
            .expect("waiting for the collector");
        assert!(
            status.success(),
            "the collector exited with {status}; its log:\n{}",
            self.log().join("\n")
        );
    }

    /// The folded stacks of the last 10 minutes' samples matching
    /// `matchers`, as the CLI exports them.
    pub fn folded_stacks(&self, matchers: &str) -> Vec<(String, u64)> {
        folded(&self.cli(&[
            "export", "--format", "folded", "--since", "10m", "--match", matchers,
        ]))
    }

    /// Runs the `stackscope` CLI against this collector.
    pub fn cli(&self, args: &[&str]) -> Vec<u8> {
        let out = Command::new(workspace_binary("stackscope"))
            .args(["--collector", &self.grpc])
            .args(args)
            .output()
            .expect("running stackscope");
        assert!(
            out.status.success(),
            "stackscope {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    }
}

/// Parses folded stacks into (stack, count).
pub fn folded(text: &[u8]) -> Vec<(String, u64)> {
    String::from_utf8(text.to_vec())
        .expect("folded stacks are UTF-8")
        .lines()
        .map(|line| {
            let (stack, count) = line.rsplit_once(' ').expect("`stack count` lines");
            (stack.to_string(), count.parse().expect("a count"))
        })
        .collect()
}

/// Runs the agent binary for `duration` at 199 Hz, shipping to `collector`
/// every 2 s, with `args` besides, and returns its JSON report.
pub fn run_agent_for(collector: &Collector, duration: &str, args: &[&str]) -> serde_json::Value {
    let agent = Command::new(workspace_binary("stackscope-agent"))
        .args(["--collector", &collector.grpc])
        .args([
            "--frequency",
            "199",
            "--duration",
            duration,
            "--interval",
            "2s",
        ])
        .args(["--no-table-cache", "--json"])
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .expect("starting the agent");
    wait_success(agent)
}

/// The CPU time process `pid` has had so far: user and system, all its
/// threads.
pub fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .unwrap_or_else(|err| panic!("reading /proc/{pid}/stat: {err}"));
    // After the command name, which may hold spaces and parentheses:
    // utime and stime are fields 14 and 15 of proc(5), the 12th and 13th
    // after it.
    let after_name = &stat[stat.rfind(')').expect("a command name") + 1..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let ticks: u64 = fields[11..13]
        .iter()
        .map(|field| field.parse::<u64>().expect("a tick count"))
        .sum();
    // SAFETY: sysconf reads a constant of the system.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Duration::from_nanos(ticks * 1_000_000_000 / per_second)
}

/// Waits (up to a minute) for an agent started with `--json` to exit
/// successfully and returns its report.
///
/// Its output is read while it runs: a report larger than the pipe's
/// buffer (64 KiB; the per-binary tables of a whole busy machine) would
/// otherwise block the agent's last write until the deadline.
pub fn wait_success(mut agent: Child) -> serde_json::Value {
    let mut stdout = agent.stdout.take().expect("the agent's stdout is piped");
    let reader = std::thread::spawn(move || {
        let mut out = Vec::new();
        std::io::Read::read_to_end(&mut stdout, &mut out).map(|_| out)
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = agent.try_wait().expect("waiting for the agent") {
            assert!(status.success(), "the agent exited with {status}");
            break;
        }
        if Instant::now() >= deadline {
            let _ = agent.kill();
            let _ = agent.wait();
            panic!("the agent did not stop within a minute");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = reader
        .join()
        .expect("the output reader")
        .expect("reading the agent's output");
    serde_json::from_slice(&out).expect("the agent's JSON report")
}

/// Ids of every loaded BPF object of `kind` (`prog`, `map` or `link`), per
/// bpftool.
pub fn bpf_ids_loaded(kind: &str) -> BTreeSet<u64> {
    let out = Command::new("bpftool")
        .args(["--json", kind, "show"])
        .output()
        .expect("running bpftool");
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).expect("bpftool JSON");
    list.as_array()
        .expect("a list")
        .iter()
        .filter_map(|entry| entry["id"].as_u64())
        .collect()
}

/// The BPF programs, maps and links one process holds open.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BpfIds {
    pub programs: BTreeSet<u64>,
    pub maps: BTreeSet<u64>,
    pub links: BTreeSet<u64>,
}

impl BpfIds {
    /// What process `pid` holds, read from `/proc/<pid>/fdinfo` (Debian's
    /// bpftool cannot name a program's owner); empty once it is gone.
    pub fn held_by(pid: u32) -> Self {
        let mut held = Self::default();
        let Ok(entries) = std::fs::read_dir(format!("/proc/{pid}/fdinfo")) else {
            return held;
        };
        for entry in entries.flatten() {
            let info = std::fs::read_to_string(entry.path()).unwrap_or_default();
            for line in info.lines() {
                let id = |prefix| {
                    line.strip_prefix(prefix)
                        .and_then(|v: &str| v.trim().parse::<u64>().ok())
                };
                // A link's fdinfo names its program too.
                if let Some(id) = id("prog_id:") {
                    held.programs.insert(id);
                } else if let Some(id) = id("map_id:") {
                    held.maps.insert(id);
                } else if let Some(id) = id("link_id:") {
                    held.links.insert(id);
                }
            }
        }
        held
    }

    /// Those of these objects the kernel still has loaded, per bpftool.
    pub fn still_loaded(&self) -> Self {
        let left =
            |kind, ids: &BTreeSet<u64>| ids.intersection(&bpf_ids_loaded(kind)).copied().collect();
        Self {
            programs: left("prog", &self.programs),
            maps: left("map", &self.maps),
            links: left("link", &self.links),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.programs.is_empty() && self.maps.is_empty() && self.links.is_empty()
    }

    /// Waits until the kernel has released every one of these objects,
    /// failing the test with what `after` (say, "after SIGKILL") left.
    /// Closing the last descriptor unloads a program and its links at once;
    /// the maps a program referenced go after an RCU grace period, so the
    /// kernel gets a few seconds before anything counts as a leak.
    pub fn assert_released(&self, after: &str) {
        let started = Instant::now();
        loop {
            let left = self.still_loaded();
            if left.is_empty() {
                return;
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "{after}, still loaded: {left:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Waits (up to 2 minutes: a nested VM under load takes long to verify
/// the program) until `agent` has loaded its BPF program, and returns
/// what it holds then; fails the test if it exits first.
pub fn wait_until_loaded(agent: &mut RunningProcess) -> BpfIds {
    let started = Instant::now();
    loop {
        let held = BpfIds::held_by(agent.pid());
        // Loaded as bpftool sees it, and attached (its tracepoint links
        // exist): a running agent's, not one still loading or making its
        // rings.
        if !held.programs.is_empty()
            && !held.links.is_empty()
            && bpf_ids_loaded("prog").is_superset(&held.programs)
        {
            return held;
        }
        if let Some(status) = agent.child.try_wait().expect("polling the agent") {
            panic!("the agent exited with {status} before loading its program");
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the agent never loaded its program"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The `off_cpu` fixture (`tests/fixtures/off_cpu.c`): blocks in known
/// chains once told to start, measuring each block itself, and reports
/// what it measured by leaf function.
pub struct OffCpuFixture {
    process: RunningProcess,
    stdout: BufReader<std::process::ChildStdout>,
    _fixture: Fixture,
}

/// The leaf functions the `off_cpu` fixture blocks in.
pub const OFF_CPU_LEAVES: [&str; 10] = [
    "sleep_leaf",
    "pipe_read_leaf",
    "mutex_lock_leaf",
    "epoll_leaf",
    "answer_wait_leaf",
    "answer_sleep_leaf",
    "holder_lock_leaf",
    "holder_sleep_leaf",
    "holder_idle_leaf",
    "join_leaf",
];

impl OffCpuFixture {
    /// Starts it, to block for `seconds` once [`OffCpuFixture::go`] is
    /// called.
    pub fn start(seconds: f64) -> Self {
        let fixture = Fixture::compile("off_cpu", &["-pthread"]);
        let mut child = Command::new(&fixture.path)
            .arg(seconds.to_string())
            .env_clear()
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting the off_cpu fixture");
        let stdout = child.stdout.take().expect("piped stdout");
        let process = RunningProcess::adopt(child);
        let mut stdout = BufReader::new(stdout);
        let mut line = String::new();
        stdout.read_line(&mut line).expect("reading the fixture");
        assert_eq!(line.trim(), "ready", "the off_cpu fixture did not start");
        Self {
            process,
            stdout,
            _fixture: fixture,
        }
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Starts its threads and its blocking (the blocks before, waiting for
    /// this, are not measured).
    pub fn go(&self) {
        // SAFETY: a signal to our own child, which is alive (adopted).
        let sent = unsafe { libc::kill(self.pid() as libc::pid_t, libc::SIGUSR1) };
        assert_eq!(sent, 0, "signalling the off_cpu fixture");
    }

    /// Waits for it to finish: the nanoseconds it measured blocked in each
    /// leaf function.
    pub fn measured(mut self) -> HashMap<String, u64> {
        let mut measured = HashMap::new();
        let mut line = String::new();
        loop {
            line.clear();
            let read = self
                .stdout
                .read_line(&mut line)
                .expect("reading the fixture");
            assert!(read > 0, "the off_cpu fixture ended without its figures");
            let line = line.trim();
            if line == "done" {
                break;
            }
            let (leaf, nanos) = line.split_once(' ').expect("`leaf nanoseconds` lines");
            measured.insert(leaf.to_string(), nanos.parse().expect("nanoseconds"));
        }
        let status = self.process.child.wait().expect("waiting for the fixture");
        assert!(status.success(), "the off_cpu fixture exited with {status}");
        measured
    }
}
