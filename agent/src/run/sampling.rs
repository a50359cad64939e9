//! The sampling thread: an OS thread of its own that reads the ring buffers
//! and the mapping feed, walks and aggregates every sample, ends each
//! aggregation interval and hands it to the batch worker. It owns all the
//! state a sample touches (sampler, walker, aggregator, tally), so a sample
//! waits for no lock and no other work: export, uploads, the kubelet and
//! the HTTP endpoints run on the tokio runtime, and what reads `/proc`, the
//! cgroup tree or a container runtime's state (what a process's labels are
//! made of, the container selection, which processes are gone) runs on the
//! metadata worker, whose answers come back here as [`Command`]s.
//!
//! It talks to the others only through bounded queues: a message that finds
//! its queue full is dropped and counted ([`Handoffs`]), never waited for.

use std::{
    collections::HashMap as StdHashMap,
    io,
    path::Path,
    sync::Arc,
    thread::JoinHandle,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use agent_common::{CgroupPolicy, SampleHeader, sample_flags};
use tokio::{
    sync::{mpsc, oneshot},
    time::{Instant, MissedTickBehavior},
};

use super::{
    AgentConfig, FEED_DRAIN_INTERVAL, Handoffs, MAX_TRACKED_PROCESSES, RunError, RunSummary,
    jvm::{FoundJvm, JvmProcesses},
    metadata::MetadataJobs,
    off_cpu::{OffCpuJoin, OffCpuStats, OffCpuWeights},
    process::{ProcessRecord, WalkSink},
    python::{self, PythonProcesses},
    wakeups::{Wake, WakeupTally},
};
use crate::{
    aggregate::{Aggregator, BatchWorker, WorkerStats},
    stats::RunTotals,
    status::ReaderTotals,
};
use stackscope_metadata::{describe::Description, kubelet::PodList};
use stackscope_process_table::{ProcessTable, ReadAnswer, ReadRequest};
use stackscope_python::{FoundInterpreter, named_like_interpreter};
use stackscope_sampler::{
    Counters, ProgramStats, Sampler, SamplerConfig, SamplerError, Woken,
    mapping_feed::{MappingFeed, monotonic_ns},
    record::{Record, Sample},
};
use stackscope_symbolize::node::perf_map::JitUpdate;
use stackscope_telemetry::tally::ProcessTally;
use stackscope_telemetry::{StateSize, probes::ProbeTotals};
use stackscope_unwind::{
    RuntimeCode, TailSpan,
    walker::{StackWalker, UserStack, WalkerConfig},
};

/// Room in the sampling thread's command queue: pod lists, policies and
/// totals asked for come a few a minute; a full queue means the thread is
/// stuck, and then waiting would not help.
pub(super) const COMMAND_QUEUE: usize = 64;
/// Room in the queue of what the thread reports to the runtime.
pub(super) const REPORT_QUEUE: usize = 16;

/// How long the end of an interval waits for what the metadata worker was
/// asked for its samples: the descriptions of the processes first sampled
/// in it, so that their label sets go out with their exe and container (a
/// description takes a few reads), and the perf map and jitdump reads its
/// unnamed JIT frames asked for. Samples read meanwhile join the interval.
const ANSWERS_WAIT: Duration = Duration::from_millis(500);

/// How soon the next drain comes while the walker meets processes it has
/// no maps of: their maps are read on the metadata worker after the drain
/// that meets them, and one that exits before that read loses its samples
/// (with the feed's 500 ms base period, a loop of one-second sqlite3 runs that
/// predate the agent lost the first run's samples, 2% of the bench's walks).
const QUICK_DRAIN: Duration = Duration::from_millis(50);

/// For this long after the start every drain is quick: every process
/// sampled then predates the agent and is met without its maps.
const QUICK_START: Duration = Duration::from_secs(1);

/// The longest drain period on a host with little to sample, with the
/// mapping feed: half the default interval, whose end drains anyway. On
/// a near-idle host each wake-up costs the same whatever it finds (at
/// 2 s, timed drains were over half the sampling thread's wake-ups and
/// CPU); new processes still wake the thread with their first ticks, and
/// a ring past its wake-up mark with its records.
const IDLE_DRAIN_INTERVAL: Duration = Duration::from_secs(5);

/// What the runtime and the metadata worker ask of the sampling thread.
#[derive(Debug)]
pub(super) enum Command {
    /// A new pod list: samples of its pods are named by it from now on.
    Pods(Arc<PodList>),
    /// The cgroup policies the container selection resolves to now.
    Policies(StdHashMap<u64, CgroupPolicy>),
    /// Tracked processes whose `/proc` entry was gone at `checked_at`
    /// (`CLOCK_MONOTONIC` ns, the clock of the samples' process start
    /// times): a process with one of these pids that started since is
    /// another one.
    Gone { tgids: Vec<u32>, checked_at: u64 },
    /// What the processes the aggregator asked about are: their labels.
    Described(Vec<Description>),
    /// The process table's reads the walker asked for.
    Read(Vec<ReadAnswer>),
    /// What the perf maps and jitdump files asked for added.
    JitNames(Vec<JitUpdate>),
    /// The CPython interpreters found in the processes asked about (None:
    /// none the sampler reads).
    Python(Vec<(u32, Option<FoundInterpreter>)>),
    /// The JVMs read in the processes asked about (`Ok(None)`: not
    /// HotSpot; an error: not readable yet, or at all).
    Jvm(Vec<(u32, FoundJvm)>),
    /// The totals now, for the status line.
    Totals,
}

impl Command {
    /// The cause it is counted under when it wakes the thread.
    fn wake(&self) -> Wake {
        match self {
            Command::Pods(_) => Wake::Pods,
            Command::Policies(_) => Wake::Policies,
            Command::Gone { .. } => Wake::Gone,
            Command::Described(_) => Wake::Described,
            Command::Read(_) => Wake::Read,
            Command::JitNames(_) => Wake::JitNames,
            Command::Python(_) => Wake::Python,
            Command::Jvm(_) => Wake::Jvm,
            Command::Totals => Wake::Totals,
        }
    }
}

/// What totals are for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Purpose {
    /// The status line, which asks for them.
    Status,
    /// `/metrics` and the liveness beat: sent unasked (see `publish_every`).
    Publish,
}

/// What the sampling thread tells the runtime.
#[derive(Debug)]
pub(super) enum Report {
    /// The totals asked for, or sent for `/metrics`. The agent's CPU and
    /// memory are left out: the status line reads them from `/proc/self`,
    /// `/metrics` at each scrape.
    Totals(Purpose, Box<RunTotals>),
    /// A sample came from a pod the pod list does not know yet: time to
    /// fetch it again.
    UnknownPod,
}

/// What the sampling thread starts with.
pub(super) struct Setup {
    pub config: AgentConfig,
    pub sampler: SamplerConfig,
    pub worker: BatchWorker,
    pub pods: Option<Arc<PodList>>,
    pub metadata: MetadataJobs,
    pub reports: mpsc::Sender<Report>,
    pub handoffs: Arc<Handoffs>,
    /// How often to send the totals for `/metrics` (`None`: no metrics):
    /// at the first wake-up from four fifths of this after the last send.
    pub publish_every: Option<Duration>,
}

/// The runtime's handle on the sampling thread.
pub(super) struct SamplingThread {
    /// The sampler's counters once it is attached, or why it is not.
    pub started: oneshot::Receiver<Result<Counters, RunError>>,
    /// What the run saw, once stopped (or why it ended early).
    pub finished: oneshot::Receiver<Result<RunSummary, RunError>>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl SamplingThread {
    /// Starts the thread; it attaches the sampler (the mapping feed
    /// first) and says so through [`SamplingThread::started`]. It takes
    /// its commands from `commands` (whose senders the caller hands to
    /// whoever answers into it).
    pub fn spawn(setup: Setup, commands: mpsc::Receiver<Command>) -> io::Result<Self> {
        let (started_tx, started) = oneshot::channel();
        let (finished_tx, finished) = oneshot::channel();
        let (stop, stop_rx) = oneshot::channel();
        let thread = std::thread::Builder::new()
            .name("stackscope-sampling".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime,
                    Err(err) => {
                        let _ = started_tx.send(Err(RunError::Runtime(err)));
                        return;
                    }
                };
                let result = runtime.block_on(sample(setup, started_tx, commands, stop_rx));
                if let Some(result) = result {
                    let _ = finished_tx.send(result);
                }
            })?;
        Ok(Self {
            started,
            finished,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Asks the thread to take what is queued, flush the last interval and
    /// end; the summary comes through [`SamplingThread::finished`].
    pub fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }

    /// Waits for the thread to end (after [`SamplingThread::finished`]
    /// has answered, it is ending or gone).
    pub fn join(mut self) {
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::error!("the sampling thread panicked");
        }
    }
}

impl Drop for SamplingThread {
    fn drop(&mut self) {
        // Never joined here: dropping must not block the runtime.
        self.stop();
    }
}

/// The thread's life: attach, sample until told to stop, flush. `None`
/// when it never started (the reason went through `started`).
async fn sample(
    setup: Setup,
    started: oneshot::Sender<Result<Counters, RunError>>,
    mut commands: mpsc::Receiver<Command>,
    mut stop: oneshot::Receiver<()>,
) -> Option<Result<RunSummary, RunError>> {
    let Setup {
        config,
        sampler: mut sampler_config,
        mut worker,
        pods,
        metadata,
        reports,
        handoffs,
        publish_every,
    } = setup;
    // Before the sampler: a process that starts between the two is still
    // seen mapping its files.
    let feed = if config.mapping_events {
        MappingFeed::open(&config.sampler.pids)
    } else {
        MappingFeed::disabled()
    };
    if feed.stats().open {
        // Processes are learned from their mmap events, not read from
        // `/proc` while they live, and the feed wakes the loop before its
        // rings fill: the timer only bounds how long samples wait.
        sampler_config.drain_interval = FEED_DRAIN_INTERVAL;
        // So samples may wait longer on a quiet host; without the feed
        // their maps are read while they live, and the period stays.
        sampler_config.idle_drain_interval = IDLE_DRAIN_INTERVAL;
    }
    let mut sampler = match Sampler::start(&sampler_config).and_then(|sampler| {
        let counters = sampler.counters()?;
        Ok((sampler, counters))
    }) {
        Ok((sampler, counters)) => {
            let _ = started.send(Ok(counters));
            sampler
        }
        Err(err) => {
            let _ = started.send(Err(err.into()));
            return None;
        }
    };
    let began = Instant::now();
    let walker_config = WalkerConfig {
        stack_bytes: config.sampler.user_stack_bytes,
        deep_stack_bytes: config.sampler.deep_stack_bytes,
        // The metadata worker reads maps: this thread does not wait on
        // /proc/<pid>/maps.
        defer_reads: true,
        ..config.walker.clone()
    };
    let mut records = RecordTally {
        totals: ReaderTotals::default(),
        processes: StackWalker::process_table(&walker_config),
        walker: StackWalker::new(walker_config),
        sink: WalkSink {
            aggregator: Aggregator::new(config.aggregation.clone()),
            tally: ProcessTally::with_capacity(MAX_TRACKED_PROCESSES),
            off_cpu: OffCpuWeights::default(),
        },
        off_cpu: config
            .sampler
            .off_cpu
            .map(|_| OffCpuJoin::new(config.off_cpu_held_bytes)),
        kernel_frames: Vec::with_capacity(agent_common::MAX_KERNEL_FRAMES),
        tail_spans: Vec::with_capacity(agent_common::MAX_TAIL_SPANS),
        feed,
        python: PythonProcesses::new(config.python_frames, config.python_code_bytes),
        jvms: JvmProcesses::default(),
        wakeups: WakeupTally::new(),
    };
    if let Some(pods) = pods {
        records.sink.aggregator.set_pods(pods);
    }
    let interval = config.interval.max(Duration::from_millis(1));
    let mut intervals = tokio::time::interval_at(next_boundary(interval), interval);
    // A late tick must not shift the boundaries.
    intervals.set_missed_tick_behavior(MissedTickBehavior::Skip);

    let mut ending = IntervalEnd::default();
    let mut published: Option<Instant> = None;
    let ended = loop {
        let labels_deadline = ending.deadline().unwrap_or_else(Instant::now);
        // Set by every arm but the labels' deadline.
        let mut wake = Wake::AnswersWait;
        let step = tokio::select! {
            ready = records_ready(&mut sampler, &mut records.feed) => ready
                .map_err(RunError::Read)
                .map(|woken| {
                    wake = woken;
                    drain(&mut records, &mut sampler, &reports, &handoffs, &metadata, began)
                }),
            _ = intervals.tick() => {
                wake = Wake::IntervalEnd;
                // What was sampled up to now belongs to this interval, not
                // to the next one: the last drain may be up to a drain
                // period old.
                drain(&mut records, &mut sampler, &reports, &handoffs, &metadata, began);
                metadata.find_gone(records.tracked_processes());
                records.walker.trim_tables();
                records.python.trim_codes(&mut records.processes);
                records.sink.aggregator.trim_jvms();
                let end = nearest_boundary(SystemTime::now(), interval);
                // An interval that still waits ends now, or runs on to
                // `end` if the worker is still busy.
                if let Some(earlier) = ending.tick(end, Instant::now()) {
                    worker.try_submit(|spare| {
                        records.sink.aggregator.finish_interval_into(earlier, spare)
                    });
                }
                Ok(())
            }
            () = tokio::time::sleep_until(labels_deadline), if ending.deadline().is_some() => Ok(()),
            Some(command) = commands.recv() => {
                wake = command.wake();
                let sampling = Sampling { sampler: &mut sampler, worker: &worker, began };
                let applied = records.apply(command, sampling, &reports, &handoffs);
                // Samples a read let through may want descriptions, files
                // opened, or another read.
                if records.ask_metadata(&metadata).new_processes {
                    sampler.met_new_processes();
                }
                applied
            }
            _ = &mut stop => break Ok(()),
        };
        if let Err(err) = step {
            break Err(err);
        }
        // A worker still busy when the interval is due: it runs on to the
        // next boundary, which ends it.
        let now = Instant::now();
        if let Some(end) = ending.due(|| records.awaits_answers(now), now) {
            worker.try_submit(|spare| records.sink.aggregator.finish_interval_into(end, spare));
        }
        records.wakeups.handled(wake);
        // Due a fifth early: the wake-ups it waits for come every 5 s on a
        // quiet host, a few milliseconds either side.
        if publish_every
            .is_some_and(|every| published.is_none_or(|at| now + every / 5 >= at + every))
        {
            published = Some(now);
            match records.totals(&sampler, &worker, &handoffs, began.elapsed()) {
                Ok(totals) => {
                    handoffs.report(&reports, Report::Totals(Purpose::Publish, Box::new(totals)))
                }
                Err(err) => break Err(err.into()),
            }
            records.wakeups.handled(Wake::Publish);
        }
    };
    if ended.is_ok() {
        last_labels(&mut records, &mut sampler, &metadata, &mut commands).await;
    }
    // With the worker busy, its samples go with the last interval.
    if let Some(end) = ending.take() {
        worker.try_submit(|spare| records.sink.aggregator.finish_interval_into(end, spare));
    }
    Some(match ended {
        Ok(()) => finish(records, sampler, worker, &handoffs, began),
        Err(err) => {
            // What was read before the error still goes out.
            drop(sampler);
            records.flush(worker);
            Err(err)
        }
    })
}

/// What [`RecordTally::ask_metadata`] asked for that hurries the drains.
#[derive(Debug, Clone, Copy)]
struct Asked {
    /// A process's maps: its samples wait for them, and the process may
    /// exit (the next drain comes within [`QUICK_DRAIN`]).
    maps: bool,
    /// Descriptions or interpreters of processes met for the first time:
    /// what the agent learns from a process (a Python process's names) it
    /// learns while the process runs, from drains that come while it does
    /// (the drain period goes back to its base).
    new_processes: bool,
}

/// The end of an interval, once its tick came: it waits up to
/// [`ANSWERS_WAIT`] for the answers its samples wait for.
#[derive(Debug, Default)]
struct IntervalEnd {
    waiting: Option<(SystemTime, Instant)>,
}

impl IntervalEnd {
    /// The tick of the interval ending at `end`; returns the end of one
    /// still waiting, which must end first.
    fn tick(&mut self, end: SystemTime, now: Instant) -> Option<SystemTime> {
        let earlier = self.take();
        self.waiting = Some((end, now + ANSWERS_WAIT));
        earlier
    }

    /// When the waiting interval ends at the latest.
    fn deadline(&self) -> Option<Instant> {
        self.waiting.map(|(_, deadline)| deadline)
    }

    /// The end of the waiting interval if it ends now: no answer is
    /// awaited any more, or the wait is over. `awaits_answers` is asked
    /// only while an interval waits.
    fn due(&mut self, awaits_answers: impl FnOnce() -> bool, now: Instant) -> Option<SystemTime> {
        let (_, deadline) = self.waiting?;
        (now >= deadline || !awaits_answers())
            .then(|| self.take())
            .flatten()
    }

    fn take(&mut self) -> Option<SystemTime> {
        self.waiting.take().map(|(end, _)| end)
    }
}

/// What a [`Command`] may act on besides the records.
struct Sampling<'a> {
    sampler: &'a mut Sampler,
    worker: &'a BatchWorker,
    began: Instant,
}

/// At the stop: takes what is queued, and waits up to [`ANSWERS_WAIT`] for
/// the descriptions the last label sets lack (the processes first met in
/// the last drains; a short run's last half second can be a tenth of its
/// samples) and the JIT names its last frames asked for. Other commands
/// are moot by now.
async fn last_labels(
    records: &mut RecordTally,
    sampler: &mut Sampler,
    metadata: &MetadataJobs,
    commands: &mut mpsc::Receiver<Command>,
) {
    records.drain(sampler);
    records.ask_metadata(metadata);
    let deadline = Instant::now() + ANSWERS_WAIT;
    // Reads matter here only for held samples: a re-read holds none.
    while records.awaits_answers(Instant::now())
        || (records.walker.waiting() > 0 && records.processes.awaits_reads())
    {
        match tokio::time::timeout_at(deadline, commands.recv()).await {
            Ok(Some(Command::Described(descriptions))) => {
                records
                    .sink
                    .aggregator
                    .describe(descriptions, &mut records.processes);
            }
            Ok(Some(Command::Read(answers))) => {
                records.walk_after_reads(answers, sampler);
                records.ask_metadata(metadata);
            }
            Ok(Some(Command::JitNames(updates))) => records.sink.aggregator.add_jit_names(updates),
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => break,
        }
    }
}

/// Resolves when there are records to read (samples in the ring buffer or
/// mapping events in the feed) or the drain period is over, with which.
async fn records_ready(sampler: &mut Sampler, feed: &mut MappingFeed) -> io::Result<Wake> {
    tokio::select! {
        woken = sampler.wait() => woken.map(|woken| match woken {
            Woken::Signalled => Wake::Records,
            Woken::DrainPeriod => Wake::DrainTimer,
        }),
        () = feed.readable() => Ok(Wake::MappingFeed),
    }
}

/// Drains the records queued, asks the metadata worker to describe the
/// processes met for the first time, and tells the runtime when a sample
/// came from a pod its list does not know yet.
fn drain(
    records: &mut RecordTally,
    sampler: &mut Sampler,
    reports: &mpsc::Sender<Report>,
    handoffs: &Handoffs,
    metadata: &MetadataJobs,
    began: Instant,
) {
    records.drain(sampler);
    let asked = records.ask_metadata(metadata);
    if asked.new_processes {
        sampler.met_new_processes();
    }
    if asked.maps || began.elapsed() < QUICK_START {
        sampler.drain_within(QUICK_DRAIN);
    }
    if records.sink.aggregator.take_unknown_pod_seen() {
        handoffs.report(reports, Report::UnknownPod);
    }
}

/// Takes what is still queued, reads the final counters, detaches the
/// sampler, flushes the last partial interval and waits for its batch.
fn finish(
    mut records: RecordTally,
    mut sampler: Sampler,
    worker: BatchWorker,
    handoffs: &Handoffs,
    began: Instant,
) -> Result<RunSummary, RunError> {
    records.drain(&mut sampler);
    let kernel = sampler.counters()?;
    let program = sampler.program_stats()?;
    let off_cpu_program = sampler.off_cpu_program_stats()?;
    drop(sampler);
    // Threads still blocked have waited until now so far.
    records.end_blocked(monotonic_ns());
    let batches = records.flush(worker);
    // The report counts the processes still running too.
    records.let_go_of_released();
    for (tgid, record) in records.processes.states() {
        records.sink.tally.keep(tgid, &record.samples);
    }
    let off_cpu = records.off_cpu_stats(off_cpu_program);
    Ok(RunSummary {
        kernel,
        program,
        elapsed: began.elapsed(),
        reader: records.totals,
        tally: records.sink.tally,
        unwinding: records.walker.stats(),
        aggregation: records.sink.aggregator.stats(),
        jit_names: records.sink.aggregator.jit_stats(),
        python: records.python.stats,
        jvm: records
            .jvms
            .stats
            .with_reads(records.sink.aggregator.jvm_stats()),
        off_cpu,
        mapping_feed: records.feed.stats(),
        process_table: records.processes.stats(),
        batches,
        probes: ProbeTotals::now(),
        handoffs: handoffs.totals(),
        wakeups: records.wakeups.totals(),
    })
}

/// Writes the policies the selection resolves to now. A failure keeps the
/// previous policies: sampling goes on with a selection a little stale.
fn update_policies(sampler: &mut Sampler, wanted: &StdHashMap<u64, CgroupPolicy>) {
    match sampler.set_cgroup_policies(wanted) {
        Ok(0) => {}
        Ok(changed) => tracing::info!(changed, "container selection updated"),
        Err(err) => tracing::warn!("updating the container selection failed: {err}"),
    }
}

/// Writes the walker's plan decisions into the sampler's maps, and tells
/// the walker of the stack tops the table gave up for them.
fn write_plans(walker: &mut StackWalker, sampler: &mut Sampler) {
    sampler.apply_plan_updates(walker.take_plan_updates());
    for tid in sampler.take_evicted_tops() {
        walker.top_evicted(tid);
    }
}

/// The multiple of `interval` in Unix time nearest to `now`: the boundary
/// a tick stands for, whether the timer fired a little late or the
/// monotonic clock it runs on drifted a little ahead of the wall clock.
fn nearest_boundary(now: SystemTime, interval: Duration) -> SystemTime {
    let period = interval.as_nanos().max(1);
    let Ok(since_epoch) = now.duration_since(UNIX_EPOCH) else {
        return now;
    };
    let nanos = since_epoch.as_nanos();
    let rounded = (nanos + period / 2) / period * period;
    u64::try_from(rounded).map_or(now, |nanos| UNIX_EPOCH + Duration::from_nanos(nanos))
}

/// The next multiple of `interval` in Unix time, as an `Instant`.
fn next_boundary(interval: Duration) -> Instant {
    let period = interval.as_nanos().max(1);
    let since_epoch = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    let wait = period - since_epoch % period;
    Instant::now() + Duration::from_nanos(u64::try_from(wait).unwrap_or(u64::MAX))
}

/// Puts the Python stack read with the sample with `header`, if any, in
/// its process's record, where it waits for the sample's walk.
fn pair_python_stack(
    python: &mut PythonProcesses,
    processes: &mut ProcessTable<ProcessRecord>,
    header: &SampleHeader,
) {
    if let Some(stack) = python.for_sample(header) {
        let (_, record) = processes.state(header.tgid);
        python.wait_for_walk(&mut record.python, header, stack);
    }
}

/// What the reader keeps of each record.
struct RecordTally {
    totals: ReaderTotals,
    /// One record per process (see [`ProcessRecord`]), lent to the walker
    /// for each walk and each process event.
    processes: ProcessTable<ProcessRecord>,
    walker: StackWalker,
    /// What the walks add to.
    sink: WalkSink,
    /// The kernel frames of the sample being read, copied out of the ring
    /// buffer record once.
    kernel_frames: Vec<u64>,
    /// The spans of the sample's stack tail.
    tail_spans: Vec<TailSpan>,
    /// What processes fork, exec and map, applied in order with the records.
    feed: MappingFeed,
    /// CPython processes: which to look at, their sampler entries, their
    /// Python stacks paired with samples.
    python: PythonProcesses,
    /// HotSpot JVMs: which to read, and asking again while one starts.
    jvms: JvmProcesses,
    /// Off-CPU samples waiting for their switch-in; `None`: off-CPU
    /// sampling is off.
    off_cpu: Option<OffCpuJoin>,
    /// Why the thread woke, and what each cause cost.
    wakeups: WakeupTally,
}

impl RecordTally {
    fn apply(
        &mut self,
        command: Command,
        sampling: Sampling<'_>,
        reports: &mpsc::Sender<Report>,
        handoffs: &Handoffs,
    ) -> Result<(), RunError> {
        match command {
            Command::Pods(list) => self.sink.aggregator.set_pods(list),
            Command::Policies(wanted) => update_policies(sampling.sampler, &wanted),
            Command::Gone { tgids, checked_at } => self.forget(&tgids, checked_at),
            Command::Described(descriptions) => self
                .sink
                .aggregator
                .describe(descriptions, &mut self.processes),
            Command::Read(answers) => self.walk_after_reads(answers, sampling.sampler),
            Command::JitNames(updates) => self.sink.aggregator.add_jit_names(updates),
            Command::Python(found) => {
                // The first Python stacks of a process come at its next
                // ticks, and their code objects can be read only while it
                // runs: a paced drain (up to 5 s away) would meet a short
                // script's stacks after its exit, none of them named.
                if found.iter().any(|(_, found)| found.is_some()) {
                    sampling.sampler.met_new_processes();
                }
                for (tgid, found) in found {
                    if let Some(record) = self.processes.state_of_mut(tgid) {
                        let started = record.started();
                        if self.python.found(
                            tgid,
                            &mut record.python,
                            started,
                            found,
                            sampling.sampler,
                        ) {
                            self.walker.forget_tops(tgid);
                        }
                    }
                }
                write_plans(&mut self.walker, sampling.sampler);
            }
            Command::Jvm(found) => {
                let now = std::time::Instant::now();
                for (tgid, found) in found {
                    let Some(record) = self.processes.state_of_mut(tgid) else {
                        continue;
                    };
                    let started = record.started();
                    let Some(jvm) = self.jvms.found(tgid, &mut record.jvm, found, now) else {
                        continue;
                    };
                    if let Some(jvm) = &jvm {
                        self.sink.aggregator.add_jvm(tgid, started, Arc::clone(jvm));
                    }
                    let runtime = jvm.map(|jvm| jvm as Arc<dyn RuntimeCode + Send + Sync>);
                    self.walker.set_runtime(&mut self.processes, tgid, runtime);
                }
                // The samples that waited for these answers.
                self.walker
                    .poll(&mut self.processes, self.sink.add_walked());
                write_plans(&mut self.walker, sampling.sampler);
            }
            Command::Totals => {
                let elapsed = sampling.began.elapsed();
                let totals = self.totals(sampling.sampler, sampling.worker, handoffs, elapsed)?;
                handoffs.report(reports, Report::Totals(Purpose::Status, Box::new(totals)));
            }
        }
        Ok(())
    }

    /// Whether the interval's samples wait for answers from the metadata
    /// worker (see [`ANSWERS_WAIT`]).
    fn awaits_answers(&self, now: Instant) -> bool {
        self.sink.aggregator.has_pending_labels()
            || self.sink.aggregator.awaits_jit_names(now.into_std())
    }

    /// Applies the process table's reads and walks the samples that waited
    /// for them. The plans those walks teach go to the sampler now, not at
    /// the next drain: a short process would be gone by then.
    fn walk_after_reads(&mut self, answers: Vec<ReadAnswer>, sampler: &mut Sampler) {
        // A process that maps a file named like an interpreter is looked
        // at for one (on the metadata worker).
        for answer in &answers {
            if answer.file_paths().into_iter().any(named_like_interpreter)
                && let Some(record) = self.processes.state_of_mut(answer.tgid())
            {
                self.python.maybe_python(answer.tgid(), &mut record.python);
            }
            if answer
                .file_paths()
                .into_iter()
                .any(stackscope_jvm::named_like_libjvm)
                && let Some(record) = self.processes.state_of_mut(answer.tgid())
                && self
                    .jvms
                    .maybe_jvm(answer.tgid(), &mut record.jvm, std::time::Instant::now())
            {
                self.walker
                    .await_runtime(&mut self.processes, answer.tgid());
            }
        }
        let walker = &mut self.walker;
        walker.apply_reads(&mut self.processes, answers);
        walker.poll(&mut self.processes, self.sink.add_walked());
        write_plans(walker, sampler);
    }

    /// Hands the metadata worker what the walks and labels since the last
    /// call need: the process table's reads, interpreters to look for,
    /// files to open while their processes run, processes to describe,
    /// perf maps to read on.
    /// Returns what was asked that hurries the drains. A perf map read
    /// asked for does not: the frames that missed it are named when their
    /// interval ends.
    fn ask_metadata(&mut self, metadata: &MetadataJobs) -> Asked {
        let requests = self.processes.take_read_requests();
        for request in &requests {
            let tgid = request.tgid();
            if self
                .processes
                .learned_exe(tgid)
                .is_some_and(named_like_interpreter)
                && let Some(record) = self.processes.state_of_mut(tgid)
            {
                self.python.probe_early(tgid, &mut record.python);
            }
        }
        let maps_asked = requests
            .iter()
            .any(|request| matches!(request, ReadRequest::Maps { .. }));
        if !requests.is_empty() {
            metadata.read(self.processes.reader(), requests);
        }
        // The worker answers in order: what the samples' content waits
        // for (maps, interpreters: the Python frames of the ticks before
        // are lost) before what their names and labels need (files held
        // open for a process that may exit soon, which a lookup of a few
        // milliseconds rarely outruns; descriptions, which the interval's
        // end waits for).
        let python = self.python.take_wanted();
        let new_processes = !python.is_empty() || self.sink.aggregator.take_first_descriptions();
        metadata.find_python(python);
        let now = std::time::Instant::now();
        let jvms = self.jvms.take_wanted(now);
        if !metadata.find_jvm(jvms.clone()) {
            self.jvms.not_asked(jvms);
        }
        for tgid in self.jvms.overdue(now) {
            self.walker.set_runtime(&mut self.processes, tgid, None);
        }
        metadata.open(self.sink.aggregator.take_to_open());
        metadata.describe(self.sink.aggregator.take_wanted());
        metadata.read_jit(self.sink.aggregator.take_jit_requests());
        Asked {
            maps: maps_asked,
            new_processes,
        }
    }

    /// Walks the samples still held, ends the last partial interval and
    /// waits for the worker to build and hand over its batches: nothing
    /// else is left to run on this thread.
    fn flush(&mut self, worker: BatchWorker) -> WorkerStats {
        self.walker
            .flush(&mut self.processes, self.sink.add_walked());
        worker.finish(self.sink.aggregator.finish_interval(SystemTime::now()))
    }

    /// Reads every record queued (the mapping events first, so that each
    /// sample finds the mappings it was taken with), walks and counts them,
    /// and hands the sampler the copy plans the walks taught.
    fn drain(&mut self, sampler: &mut Sampler) {
        let horizon = self.feed.collect();
        // Before the drain: a lost exit or exec record may have left a
        // process's state stale for the records about to be read.
        if sampler.take_new_losses() > 0 || self.feed.take_losses() {
            self.walker.forget_all_processes(&mut self.processes);
            self.sink.aggregator.forget_all_processes();
        }
        sampler.drain_records(|bytes| self.add(bytes));
        self.python.apply(sampler);
        self.catch_up(horizon);
        self.walker
            .poll(&mut self.processes, self.sink.add_walked());
        write_plans(&mut self.walker, sampler);
        self.let_go_of_exited();
        // The exits just applied may have left tables unused: trimmed now,
        // they never stay past their bound until the interval ends (the
        // hour's soak saw 69 MB of a 64 MiB bound between two trims).
        self.walker.trim_tables();
    }

    /// Applies the mapping events up to `horizon` (a record's time, or one
    /// every sample before which has been read), and lets go of the
    /// processes whose last held samples have been walked.
    fn catch_up(&mut self, horizon: u64) {
        self.feed.apply_until(
            horizon,
            &mut self.walker,
            &mut self.processes,
            &mut self.sink.add_walked(),
        );
        self.let_go_of_exited();
    }

    /// The one exit path: a process goes from the walker (at its exit, or
    /// once its held samples are walked), and then what the aggregator
    /// keeps of it.
    fn exited(&mut self, tgid: u32) {
        self.python.gone(tgid);
        self.walker.on_exit(&mut self.processes, tgid);
        self.let_go_of_exited();
    }

    fn let_go_of_exited(&mut self) {
        for tgid in self.walker.take_completed_exits() {
            self.sink.aggregator.on_exit(tgid);
        }
        self.let_go_of_released();
    }

    /// Keeps what the records the walker let go of counted (whatever
    /// removed them).
    fn let_go_of_released(&mut self) {
        for (tgid, record) in self.processes.take_released() {
            self.sink.tally.let_go(tgid, &record.samples);
        }
    }

    /// What the statistics are read from now (the batch worker's figures
    /// as of its last batch); the agent's CPU and memory are left out.
    fn totals(
        &self,
        sampler: &Sampler,
        worker: &BatchWorker,
        handoffs: &Handoffs,
        elapsed: Duration,
    ) -> Result<RunTotals, SamplerError> {
        Ok(RunTotals {
            elapsed,
            kernel: sampler.counters()?,
            // Only counted with --bpf-stats; never worth stopping for.
            program: sampler.program_stats().unwrap_or_default(),
            reader: self.totals,
            probes: ProbeTotals::now(),
            walks: self.walker.stats(),
            mapping_feed: self.feed.stats(),
            process_table: self.processes.stats(),
            processes: self.sink.tally.totals(),
            aggregation: self.sink.aggregator.stats(),
            jit_names: self.sink.aggregator.jit_stats(),
            python: self.python.stats,
            jvm: self.jvms.stats.with_reads(self.sink.aggregator.jvm_stats()),
            // Only counted with --bpf-stats, as the sampling program's.
            off_cpu: self.off_cpu_stats(sampler.off_cpu_program_stats().unwrap_or_default()),
            batches: worker.stats(),
            handoffs: handoffs.totals(),
            // The exporter's are read at scrape time; the uploader's at
            // the end.
            export: None,
            uploads: None,
            process: Default::default(),
            state: self.state_sizes(worker),
            wakeups: self.wakeups.totals(),
        })
    }

    /// Everything the sampling thread keeps, against its bounds (the batch
    /// worker's as of its last batch).
    fn state_sizes(&self, worker: &BatchWorker) -> Vec<StateSize> {
        let mut sizes = vec![self.sink.tally.state_size(), self.feed.state_size()];
        sizes.extend(self.off_cpu.as_ref().map(OffCpuJoin::state_size));
        self.walker.state_sizes(&self.processes, &mut sizes);
        sizes.push(python::code_cache_size(
            &self.processes,
            self.python.code_bytes,
        ));
        self.sink.aggregator.state_sizes(&mut sizes);
        worker.state_sizes(&mut sizes);
        sizes
    }

    /// The processes anything here keeps state for, each once.
    fn tracked_processes(&self) -> Vec<u32> {
        let mut tracked = Vec::new();
        self.walker
            .tracked_processes_into(&self.processes, &mut tracked);
        self.sink.aggregator.tracked_processes_into(&mut tracked);
        tracked.sort_unstable();
        tracked.dedup();
        tracked
    }

    /// Forgets processes that exited without their exit being applied:
    /// its record was lost, or a sample read after it (records of
    /// different CPUs interleave) made their state again. Without this
    /// they stay until evicted at each map's bound. `gone` were found gone
    /// at `checked_at`: a process sampled since under one of those pids
    /// that started later is another one, and stays.
    fn forget(&mut self, gone: &[u32], checked_at: u64) {
        for &tgid in gone {
            if self
                .walker
                .process_started(&self.processes, tgid)
                .is_some_and(|started| started >= checked_at)
            {
                continue;
            }
            self.exited(tgid);
        }
    }

    /// Walks and counts one sample (a tick's, or an off-CPU one at its
    /// switch-in).
    fn add_sample(&mut self, sample: &Sample<'_>) {
        let Self {
            processes,
            walker,
            sink,
            kernel_frames,
            tail_spans,
            python,
            ..
        } = self;
        pair_python_stack(python, processes, &sample.header);
        kernel_frames.clear();
        kernel_frames.extend(sample.kernel_frames());
        if sample.header.flags & sample_flags::USER_REGS == 0 {
            // A kernel thread: nothing to walk, but a record for
            // its labels.
            let (_, record) = processes.state(sample.header.tgid);
            record.samples.add(|| sample.comm());
            sink.aggregator.add(
                &sample.header,
                kernel_frames,
                None,
                Some(&mut record.labels),
            );
        } else {
            sample.tail_spans(tail_spans);
            let stack = UserStack {
                copy: sample.user_stack,
                spans: tail_spans,
                tail: sample.tail_data(),
            };
            walker.push(
                processes,
                &sample.header,
                kernel_frames,
                stack,
                sink.add_walked(),
            );
        }
    }

    /// Counts the off-CPU samples still waiting for their switch-in as
    /// blocked until `now_ns` (the run ends).
    fn end_blocked(&mut self, now_ns: u64) {
        let Some(off_cpu) = &mut self.off_cpu else {
            return;
        };
        for held in off_cpu.end_all(now_ns, &mut self.sink.off_cpu) {
            if let Ok(sample) = Sample::decode(&held) {
                self.add_sample(&sample);
            }
        }
    }

    /// The off-CPU figures, with the off-CPU program's cost.
    fn off_cpu_stats(&self, program: Option<ProgramStats>) -> Option<OffCpuStats> {
        let off_cpu = self.off_cpu.as_ref()?;
        let program = program.unwrap_or_default();
        Some(OffCpuStats {
            weight_missing: self.sink.off_cpu.missing,
            bpf_runs: program.run_count,
            bpf_run_nanos: u64::try_from(program.run_time.as_nanos()).unwrap_or(u64::MAX),
            ..off_cpu.stats
        })
    }

    fn add(&mut self, bytes: &[u8]) {
        self.totals.records += 1;
        self.totals.bytes += bytes.len() as u64;
        let record = Record::decode(bytes);
        if let Ok(record) = &record {
            // What processes mapped before this record, and only that.
            self.feed.catch_up_to(record.ktime_ns());
            self.catch_up(record.ktime_ns());
        }
        match record {
            Ok(Record::Sample(sample)) => {
                let header = &sample.header;
                match &mut self.off_cpu {
                    // Walked at its switch-in, when its weight is known;
                    // its Python stack waits in its process's record (its
                    // code objects read now, while the process runs).
                    Some(off_cpu) if header.flags & sample_flags::OFF_CPU != 0 => {
                        off_cpu.hold(header, bytes);
                        pair_python_stack(&mut self.python, &mut self.processes, header);
                    }
                    _ => self.add_sample(&sample),
                }
            }
            Ok(Record::SwitchIn(switch)) => {
                let Some(off_cpu) = &mut self.off_cpu else {
                    return;
                };
                if let Some(held) = off_cpu.switched_in(&switch, &mut self.sink.off_cpu)
                    // Decoded when it was held.
                    && let Ok(sample) = Sample::decode(&held)
                {
                    self.add_sample(&sample);
                }
            }
            Ok(Record::Exec(event)) => {
                self.totals.process_events += 1;
                self.python.gone(event.tgid);
                if let Some(off_cpu) = &mut self.off_cpu {
                    off_cpu.process_ended(event.tgid);
                }
                self.walker.on_exec(
                    &mut self.processes,
                    event.tgid,
                    event.ktime_ns,
                    self.sink.add_walked(),
                );
                let learned = self
                    .processes
                    .learned_exe(event.tgid)
                    .map(Path::to_path_buf);
                let (_, record) = self.processes.state(event.tgid);
                self.sink
                    .aggregator
                    .on_exec(&mut record.labels, learned.as_deref());
                // The new image's JIT code is no JVM's until found again.
                self.sink.aggregator.forget_jvm(event.tgid);
            }
            Ok(Record::Exit(event)) => {
                self.totals.process_events += 1;
                if let Some(off_cpu) = &mut self.off_cpu {
                    off_cpu.process_ended(event.tgid);
                }
                if let Some(record) = self.processes.state_of_mut(event.tgid) {
                    record.samples.exited();
                }
                // Samples of it still waiting for a table keep its labels
                // until they are walked.
                self.exited(event.tgid);
            }
            Ok(Record::PythonStack(stack)) => self.python.stack(&stack),
            Err(err) => {
                self.totals.decode_errors += 1;
                if self.totals.decode_errors == 1 {
                    tracing::warn!("skipping a malformed sample record: {err}");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::aggregate::AggregatorConfig;
    use stackscope_proto::v1::ProfileType;

    /// Hash-table lookups a sample may cost the sampling thread once its
    /// process, thread and stack are known (issue 32 asks for at most 3).
    const MAX_STEADY_LOOKUPS: f64 = 3.0;

    /// A tally fed with a record of this test's own stack, whose first
    /// sample has been walked (it waits for its table first).
    fn walked_own_sample() -> (RecordTally, Vec<u8>, u32) {
        let (header, stack) = stackscope_unwind::walker::test_support::own_sample();
        let record = stackscope_sampler::record::test_support::encode(&header, &[], &stack);
        let mut records = RecordTally {
            totals: ReaderTotals::default(),
            processes: StackWalker::process_table(&WalkerConfig::default()),
            walker: StackWalker::default(),
            sink: WalkSink {
                aggregator: Aggregator::new(AggregatorConfig::default()),
                tally: ProcessTally::with_capacity(16),
                off_cpu: OffCpuWeights::default(),
            },
            kernel_frames: Vec::new(),
            tail_spans: Vec::new(),
            feed: MappingFeed::disabled(),
            python: PythonProcesses::default(),
            jvms: JvmProcesses::default(),
            wakeups: WakeupTally::new(),
            off_cpu: Some(OffCpuJoin::new(1 << 20)),
        };
        records.add(&record);
        let started = std::time::Instant::now();
        while records.walker.stats().walks == 0 {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "the first sample was never walked"
            );
            std::thread::sleep(Duration::from_millis(5));
            records
                .walker
                .poll(&mut records.processes, records.sink.add_walked());
        }
        // The metadata worker's answer.
        let config = AggregatorConfig::default();
        let (mut describer, mut perf_maps) = (config.describer(), config.perf_map_reader());
        records.sink.aggregator.serve_metadata(
            &mut describer,
            &mut perf_maps,
            &mut records.processes,
        );
        (records, record, header.tgid)
    }

    /// A switch-in record's bytes.
    fn switch_in_record(tgid: u32, tid: u32, out_ns: u64, in_ns: u64) -> Vec<u8> {
        stackscope_sampler::record::test_support::encode_switch_in(&agent_common::SwitchIn::new(
            tid, tgid, out_ns, in_ns,
        ))
    }

    #[test]
    fn an_off_cpu_sample_is_walked_at_its_switch_in_and_weighed_by_its_time_blocked() {
        let (mut records, _, tgid) = walked_own_sample();
        let (mut header, stack) = stackscope_unwind::walker::test_support::own_sample();
        header.flags |= sample_flags::OFF_CPU;
        header.ktime_ns += 1_000;
        let off_cpu = stackscope_sampler::record::test_support::encode(&header, &[], &stack);
        let walks = records.walker.stats().walks;
        records.add(&off_cpu);
        assert_eq!(records.walker.stats().walks, walks, "held, not walked");
        // Another switch-out's switch-in leaves it held.
        records.add(&switch_in_record(
            tgid,
            header.tid,
            header.ktime_ns - 1,
            header.ktime_ns + 5,
        ));
        assert_eq!(records.walker.stats().walks, walks);
        records.add(&switch_in_record(
            tgid,
            header.tid,
            header.ktime_ns,
            header.ktime_ns + 2_500_000,
        ));
        assert_eq!(records.walker.stats().walks, walks + 1);
        let interval = records.sink.aggregator.finish_interval(SystemTime::now());
        let off_cpu: Vec<_> = interval
            .samples
            .iter()
            .filter(|sample| sample.profile_type == ProfileType::OffCpu)
            .collect();
        assert_eq!(off_cpu.len(), 1);
        assert_eq!(off_cpu[0].count, 2_500_000);
        // The tick's sample was counted apart, as one tick.
        assert_eq!(interval.sample_count(), 1);
        let stats = records.off_cpu_stats(None).expect("off-CPU on");
        assert_eq!((stats.samples, stats.joined), (1, 1));
        assert_eq!(stats.unmatched_switch_ins, 1);
    }

    #[test]
    fn a_steady_sample_costs_a_bounded_number_of_lookups() {
        let (mut records, record, _) = walked_own_sample();
        records.add(&record);

        const SAMPLES: u32 = 100;
        let before = ProbeTotals::now();
        for _ in 0..SAMPLES {
            records.add(&record);
        }
        let counted = ProbeTotals::now().since(&before);
        let walks = records.walker.stats();
        assert_eq!(walks.walks, u64::from(SAMPLES) + 2);
        // Counted under the test's own binary, by its slot.
        let binaries: Vec<_> = walks
            .binaries()
            .map(|(name, ends)| (name, ends.walks))
            .collect();
        let own = std::env::current_exe().unwrap();
        let own = own.file_name().unwrap().to_str().unwrap();
        assert_eq!(binaries, [(own, walks.walks)]);
        let per_sample = counted.total() as f64 / f64::from(SAMPLES);
        eprintln!("lookups per steady sample: {per_sample} ({counted:?})");
        assert!(
            per_sample <= MAX_STEADY_LOOKUPS,
            "{per_sample} lookups per sample, over {MAX_STEADY_LOOKUPS}: {counted:?}"
        );
    }

    #[test]
    fn a_gone_process_is_forgotten_by_the_walker_and_the_labels_unless_its_pid_was_reused_and_its_samples_kept()
     {
        let (mut records, _, tgid) = walked_own_sample();
        assert_eq!(records.tracked_processes(), [tgid]);
        let started = records
            .walker
            .process_started(&records.processes, tgid)
            .expect("walked");
        records.forget(&[tgid + 1], u64::MAX);
        assert_eq!(records.tracked_processes(), [tgid]);
        // Found gone before this process started: its pid was another's.
        records.forget(&[tgid], started);
        assert_eq!(records.tracked_processes(), [tgid]);
        assert!(
            records.sink.tally.top(9).is_empty(),
            "its samples are in its record"
        );
        records.forget(&[tgid], started + 1);
        assert_eq!(records.tracked_processes(), Vec::<u32>::new());
        // What its record counted stays for the run's report.
        let kept: Vec<_> = records
            .sink
            .tally
            .top(9)
            .into_iter()
            .map(|process| (process.tgid, process.samples))
            .collect();
        assert_eq!(kept, [(tgid, 1)]);
    }

    #[test]
    fn an_interval_ends_when_its_answers_are_in_or_its_wait_is_over() {
        let now = Instant::now();
        let end = UNIX_EPOCH + Duration::from_secs(10);
        let mut ending = IntervalEnd::default();
        let unasked = || -> bool { panic!("asked with no interval waiting") };
        assert_eq!(ending.due(unasked, now), None, "no tick yet");
        // Nothing pending: it ends at once.
        assert_eq!(ending.tick(end, now), None);
        assert_eq!(ending.due(|| false, now), Some(end));
        assert_eq!(ending.deadline(), None);
        // Answers awaited: it waits, up to ANSWERS_WAIT.
        ending.tick(end, now);
        assert_eq!(ending.deadline(), Some(now + ANSWERS_WAIT));
        assert_eq!(ending.due(|| true, now), None);
        assert_eq!(ending.due(|| true, now + ANSWERS_WAIT), Some(end));
        // The next tick ends a still waiting one first.
        ending.tick(end, now);
        let next = end + Duration::from_secs(10);
        assert_eq!(ending.tick(next, now), Some(end));
        assert_eq!(ending.due(|| false, now), Some(next));
    }

    #[test]
    fn ticks_stand_for_the_nearest_boundary() {
        let second = Duration::from_secs(1);
        let at = |nanos: u64| UNIX_EPOCH + Duration::from_nanos(nanos);
        assert_eq!(
            nearest_boundary(at(10_000_300_000), second),
            at(10_000_000_000)
        );
        assert_eq!(
            nearest_boundary(at(9_999_999_000), second),
            at(10_000_000_000)
        );
        let ten = Duration::from_secs(10);
        assert_eq!(
            nearest_boundary(at(1_700_000_012_345_678_900), ten),
            at(1_700_000_010_000_000_000)
        );
    }
}
