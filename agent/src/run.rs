//! The agent's run: starts the sampling thread, the metadata worker and
//! the batch worker, and on the tokio runtime it runs on, keeps what needs
//! the network or the clock: the kubelet's pod list, the selection's
//! refresh, the status line, the metrics' totals, signals and the
//! deadline. Each thread has one job; they talk through bounded queues
//! whose drops are counted ([`Handoffs`]):
//!
//! - [`sampling`]: drains the ring buffer, walks, aggregates, ends
//!   intervals; never waits for the network or another thread (what it
//!   still reads, on a process's first samples: a perf map,
//!   `/proc/<pid>/maps` and ELF headers the mapping feed did not supply);
//! - [`metadata`]: the reads that describe a process for its labels (exe
//!   link, cgroup, container runtime's record), the opens of the files
//!   frames are named in, and the cgroup tree and `/proc` reads the
//!   selection and the process sweep need;
//! - the batch worker ([`crate::aggregate::BatchWorker`]): names frames,
//!   builds each batch and hands it to the sink (the exporter's queue).

mod jvm;
mod metadata;
mod off_cpu;
mod process;
mod python;

pub use jvm::{DEFAULT_CODE_BYTES as DEFAULT_JVM_CODE_BYTES, JvmStats};
pub use off_cpu::{DEFAULT_MAX_HELD_BYTES as DEFAULT_OFF_CPU_HELD_BYTES, OffCpuStats};
pub use python::{DEFAULT_CODE_BYTES as DEFAULT_PYTHON_CODE_BYTES, PythonStats};
mod sampling;
mod wakeups;

pub use wakeups::{Wake, WakeupTotals};

use std::{
    io,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use stackscope_proto::v1::Batch;
use tokio::{
    signal::unix::{SignalKind, signal},
    sync::mpsc,
    time::{Instant, MissedTickBehavior},
};

use crate::{
    aggregate::{
        AggregateStats, AggregatorConfig, BatchOptions, BatchWorker, DEFAULT_INTERVAL, WorkerStats,
    },
    export::debuginfo::UploadQueue,
    metrics::{AgentTelemetry, PUBLISH_EVERY},
    stats::RunTotals,
    status::{ReaderTotals, StatusLine},
};
use sampling::{Command, Purpose, REPORT_QUEUE, Report, SamplingThread, Setup};
use stackscope_metadata::{
    kubelet::{KubeletClient, KubeletConfig, KubeletError},
    pod_watch::PodWatch,
    selection::{Resolver, SelectionConfig, SelectionError},
};
use stackscope_process_table::table::TableStats;
use stackscope_sampler::mapping_feed::FeedStats;
use stackscope_sampler::{Counters, ProgramStats, SamplerConfig, SamplerError};
use stackscope_symbolize::node::{SymbolizerConfig, perf_map::PerfMapStats};
use stackscope_telemetry::tally::ProcessTally;
use stackscope_telemetry::{ProcessUsage, probes::ProbeTotals};
use stackscope_unwind::walker::{WalkStats, WalkerConfig};

/// Where finished batches go: the exporter's queue, or a test's list.
/// Called on the batch worker's thread, once per aggregation interval (and
/// once more at shutdown for the last, partial one).
pub trait BatchSink: Send {
    fn send(&mut self, batch: Batch);

    /// Bytes the sink could still take before it is full, less room for
    /// the next batches: what the files the symbolizer keeps open may use
    /// meanwhile (only the batch worker fills the sink, one batch per
    /// interval, and it closes files before it sends).
    fn spare_bytes(&self) -> u64 {
        0
    }
}

/// The exporter as a sink: its queue's room is lent to the symbolizer.
pub struct ExportSink(pub Arc<crate::export::Exporter>);

impl BatchSink for ExportSink {
    fn send(&mut self, batch: Batch) {
        self.0.enqueue(batch);
    }

    fn spare_bytes(&self) -> u64 {
        self.0.spare_bytes()
    }
}

impl<F: FnMut(Batch) + Send> BatchSink for F {
    fn send(&mut self, batch: Batch) {
        self(batch)
    }
}

/// Processes tracked individually before new ones are counted as "other".
const MAX_TRACKED_PROCESSES: usize = 65_536;

/// How the agent runs.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub sampler: SamplerConfig,
    /// Stop after this long; `None` runs until SIGINT or SIGTERM.
    pub duration: Option<Duration>,
    /// How often the status line is logged.
    pub status_interval: Duration,
    pub walker: WalkerConfig,
    /// Length of an aggregation interval: one batch each. Intervals end on
    /// multiples of it in Unix time, so the batches of every node cover the
    /// same windows.
    pub interval: Duration,
    pub aggregation: AggregatorConfig,
    pub symbolizer: SymbolizerConfig,
    /// Which containers, pods and cgroups to sample, and their budgets.
    pub selection: SelectionConfig,
    /// How often the selection is resolved again (new containers).
    pub selection_refresh: Duration,
    /// Where pod names, namespaces and labels come from; `None` outside
    /// Kubernetes.
    pub kubelet: Option<KubeletConfig>,
    /// How often the pod list is fetched (and, at most, how often a sample
    /// of an unknown pod triggers an early fetch).
    pub kubelet_refresh: Duration,
    /// Learn mappings from the kernel's mmap events as they are made (so
    /// short-lived processes are unwound and named), not only from `/proc`.
    pub mapping_events: bool,
    /// Read CPython processes' Python frames and put them in place of the
    /// evaluation loop's.
    pub python_frames: bool,
    /// Bytes of code objects (Python frames' names) every CPython
    /// process's record keeps together.
    pub python_code_bytes: usize,
    /// Bytes of off-CPU sample records waiting for their thread's
    /// switch-in kept at most (with `sampler.off_cpu`).
    pub off_cpu_held_bytes: usize,
    /// Where binaries carrying symbols are offered for upload to the
    /// collector (`--upload-debuginfo`); `None`: no uploads.
    pub debuginfo_uploads: Option<UploadQueue>,
    /// Where the loop publishes its totals and its heartbeat for the
    /// metrics and health endpoints; `None`: nothing is served.
    pub telemetry: Option<AgentTelemetry>,
}

impl AgentConfig {
    /// The defaults around a sampler configuration.
    pub fn new(sampler: SamplerConfig) -> Self {
        Self {
            sampler,
            duration: None,
            status_interval: Duration::from_secs(5),
            walker: WalkerConfig::default(),
            interval: DEFAULT_INTERVAL,
            aggregation: AggregatorConfig::default(),
            symbolizer: SymbolizerConfig::default(),
            selection: SelectionConfig::default(),
            selection_refresh: DEFAULT_SELECTION_REFRESH,
            kubelet: None,
            kubelet_refresh: DEFAULT_KUBELET_REFRESH,
            mapping_events: true,
            python_frames: true,
            python_code_bytes: DEFAULT_PYTHON_CODE_BYTES,
            off_cpu_held_bytes: DEFAULT_OFF_CPU_HELD_BYTES,
            debuginfo_uploads: None,
            telemetry: None,
        }
    }
}

/// The sampler's drain period when the mapping feed is open (see
/// [`SamplerConfig::drain_interval`]): a fifth of the wake-ups of the
/// default, which dominate the agent's CPU at low sampling rates. It is the
/// base: while few records come the period grows up to 5 s (see
/// `SamplerConfig::idle_drain_interval`).
pub const FEED_DRAIN_INTERVAL: Duration = Duration::from_millis(500);

/// Default period of [`AgentConfig::selection_refresh`].
pub const DEFAULT_SELECTION_REFRESH: Duration = Duration::from_secs(5);
/// Default period of [`AgentConfig::kubelet_refresh`].
pub const DEFAULT_KUBELET_REFRESH: Duration = Duration::from_secs(15);

/// What a run saw, for the final report.
#[derive(Debug)]
pub struct RunSummary {
    pub tally: ProcessTally,
    pub reader: ReaderTotals,
    pub kernel: Counters,
    pub program: ProgramStats,
    pub unwinding: WalkStats,
    pub aggregation: AggregateStats,
    /// How JIT frames were named.
    pub jit_names: PerfMapStats,
    /// CPython processes found, and their Python stacks.
    pub python: PythonStats,
    /// HotSpot JVMs read, and what their reads found.
    pub jvm: JvmStats,
    /// Off-CPU samples joined with their blocked time; `None`: off-CPU
    /// sampling was off.
    pub off_cpu: Option<OffCpuStats>,
    /// Mappings learned as they were made.
    pub mapping_feed: FeedStats,
    pub process_table: TableStats,
    pub batches: WorkerStats,
    /// Hash-table lookups the sampling thread made.
    pub probes: ProbeTotals,
    /// Messages between the threads dropped on a full queue.
    pub handoffs: HandoffTotals,
    /// Why the sampling thread woke, and what each cause cost it.
    pub wakeups: WakeupTotals,
    pub elapsed: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Sampler(#[from] SamplerError),
    #[error("reading the sample ring buffer failed")]
    Read(#[source] io::Error),
    #[error("installing the signal handlers failed")]
    Signals(#[source] io::Error),
    #[error("starting the {0} thread failed")]
    Thread(&'static str, #[source] io::Error),
    #[error("starting the sampling thread's runtime failed")]
    Runtime(#[source] io::Error),
    #[error("the sampling thread ended without a summary (it panicked)")]
    SamplingLost,
    #[error("resolving the container selection failed")]
    Selection(#[from] SelectionError),
    #[error("setting up the kubelet client failed")]
    Kubelet(#[from] KubeletError),
}

/// Messages dropped between the threads because their queue was full.
#[derive(Debug, Default)]
pub struct Handoffs {
    commands: AtomicU64,
    reports: AtomicU64,
    jobs: AtomicU64,
    /// The metadata worker's queue was found closed (it panicked), and
    /// said so once.
    metadata_lost: AtomicBool,
}

/// [`Handoffs`] at one instant.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HandoffTotals {
    /// Commands to the sampling thread (pod lists, policies, gone
    /// processes, totals asked for).
    pub commands_dropped: u64,
    /// The sampling thread's reports to the runtime (totals, unknown pods).
    pub reports_dropped: u64,
    /// Jobs for the metadata worker.
    pub jobs_dropped: u64,
}

impl Handoffs {
    pub fn totals(&self) -> HandoffTotals {
        HandoffTotals {
            commands_dropped: self.commands.load(Ordering::Relaxed),
            reports_dropped: self.reports.load(Ordering::Relaxed),
            jobs_dropped: self.jobs.load(Ordering::Relaxed),
        }
    }

    /// Sends a command to the sampling thread without waiting.
    fn command(&self, to: &mpsc::Sender<Command>, command: Command) {
        offer(to, command, &self.commands);
    }

    /// Sends a report to the runtime without waiting.
    fn report(&self, to: &mpsc::Sender<Report>, report: Report) {
        offer(to, report, &self.reports);
    }

    fn count_job_dropped(&self) {
        self.jobs.fetch_add(1, Ordering::Relaxed);
    }
}

/// Sends without waiting: a full queue drops the message, counted in
/// `dropped`; a closed one means the receiver is gone (the run is ending).
fn offer<T>(to: &mpsc::Sender<T>, message: T, dropped: &AtomicU64) {
    if let Err(mpsc::error::TrySendError::Full(_)) = to.try_send(message) {
        dropped.fetch_add(1, Ordering::Relaxed);
    }
}

/// Samples until SIGINT/SIGTERM or `config.duration`, handing one batch per
/// aggregation interval to `sink` (none: batches are built and dropped),
/// then detaches the sampler, flushes the last partial interval and returns
/// what was seen. `sink` is dropped before returning.
pub async fn run(
    config: &AgentConfig,
    sink: Option<Box<dyn BatchSink>>,
) -> Result<RunSummary, RunError> {
    let mut sigint = signal(SignalKind::interrupt()).map_err(RunError::Signals)?;
    let mut sigterm = signal(SignalKind::terminate()).map_err(RunError::Signals)?;

    let worker = BatchWorker::start(
        config.symbolizer.clone(),
        BatchOptions::for_frequency(config.sampler.frequency_hz),
        config.debuginfo_uploads.clone(),
        sink,
    )
    .map_err(|err| RunError::Thread("batch worker", err))?;

    // The pod list first: a --namespace selection is resolved from it.
    let mut pods = match &config.kubelet {
        Some(kubelet) => Some(PodWatch::start(
            KubeletClient::new(kubelet.clone())?,
            config.kubelet_refresh,
        )),
        None => None,
    };
    let mut latest_pods = match pods.as_mut() {
        Some(watch) => watch.first().await,
        None => None,
    };
    let resolver = Resolver::new(config.selection.clone(), pods.is_some())?;
    // Names containers for the selection and the labels, on the metadata
    // worker once it runs.
    let mut describer = config.aggregation.describer();
    let mut sampler_config = config.sampler.clone();
    sampler_config.filter_cgroups |= config.selection.filters();
    sampler_config.cgroup_budgets |= !config.selection.budgets.is_empty();
    if sampler_config.filter_cgroups || sampler_config.cgroup_budgets {
        sampler_config
            .cgroup_policies
            .extend(resolver.policies(latest_pods.as_deref(), describer.runtime_names())?);
    }
    let refresh_selection = resolver.config().changes();

    let handoffs = Arc::new(Handoffs::default());
    let (reports_tx, mut reports) = mpsc::channel(REPORT_QUEUE);
    // The sampling thread's command queue, made before the thread so the
    // metadata worker can answer into it.
    let (commands, commands_rx) = mpsc::channel(sampling::COMMAND_QUEUE);
    let metadata = metadata::start(
        resolver,
        describer,
        config.aggregation.perf_map_reader(),
        config.aggregation.proc_root.clone(),
        commands.clone(),
        Arc::clone(&handoffs),
    )
    .map_err(|err| RunError::Thread("metadata", err))?;
    let mut sampling = SamplingThread::spawn(
        Setup {
            config: config.clone(),
            sampler: sampler_config.clone(),
            worker,
            pods: latest_pods.clone(),
            metadata: metadata.clone(),
            reports: reports_tx,
            handoffs: Arc::clone(&handoffs),
            publish_every: config.telemetry.is_some().then_some(PUBLISH_EVERY),
        },
        commands_rx,
    )
    .map_err(|err| RunError::Thread("sampling", err))?;
    let kernel = match (&mut sampling.started).await {
        Ok(Ok(kernel)) => kernel,
        Ok(Err(err)) => {
            sampling.join();
            return Err(err);
        }
        Err(_) => {
            sampling.join();
            return Err(RunError::SamplingLost);
        }
    };

    let telemetry = config.telemetry.as_ref();
    if let Some(telemetry) = telemetry {
        telemetry.health.beat();
        telemetry.health.set_ready(true);
    }
    let started = Instant::now();
    let deadline = config.duration.map(|d| started + d);
    tracing::info!(
        frequency_hz = config.sampler.frequency_hz,
        stack_bytes = config.sampler.user_stack_bytes,
        pids = ?config.sampler.pids,
        cgroup_policies = sampler_config.cgroup_policies.len(),
        "sampling every online CPU"
    );

    let mut selection_timer =
        tokio::time::interval(config.selection_refresh.max(Duration::from_millis(100)));
    selection_timer.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut status =
        tokio::time::interval_at(started + config.status_interval, config.status_interval);
    status.set_missed_tick_behavior(MissedTickBehavior::Delay);
    // The first line's figures leave out the loading.
    let mut last = RunTotals {
        kernel,
        process: ProcessUsage::now(),
        ..RunTotals::default()
    };
    let mut last_at = started;

    let mut stopping = false;
    let ended = loop {
        if stopping {
            // Idempotent: the first asks the thread to flush and end.
            sampling.stop();
            // No longer taking part in the fleet's profiles, from the
            // moment the flush begins.
            if let Some(telemetry) = telemetry {
                telemetry.health.set_ready(false);
            }
        }
        tokio::select! {
            result = &mut sampling.finished => break result,
            _ = status.tick() => handoffs.command(&commands, Command::Totals),
            Some(report) = reports.recv() => match report {
                Report::Totals(Purpose::Status, totals) => {
                    let now = Instant::now();
                    let totals = RunTotals { process: ProcessUsage::now(), ..*totals };
                    tracing::info!("{}", StatusLine::between(&last, &totals, now - last_at));
                    (last, last_at) = (totals, now);
                }
                Report::Totals(Purpose::Publish, totals) => {
                    if let Some(telemetry) = telemetry {
                        // The beat comes from the sampling thread's answer:
                        // a stuck thread fails the liveness probe.
                        telemetry.health.beat();
                        // Without the agent's CPU and memory: `/metrics`
                        // has them from `ProcessMetrics`, read at the
                        // scrape (reading `/proc/self/status` at each
                        // publish was a fifth of an idle runtime's CPU).
                        telemetry.metrics.publish(*totals);
                    }
                }
                Report::UnknownPod => {
                    if let Some(watch) = &pods {
                        watch.refresh_soon();
                    }
                }
            },
            Some(list) = PodWatch::next(&mut pods) => {
                handoffs.command(&commands, Command::Pods(Arc::clone(&list)));
                latest_pods = Some(list);
                if refresh_selection {
                    metadata.resolve(latest_pods.clone());
                }
            }
            _ = selection_timer.tick(), if refresh_selection => metadata.resolve(latest_pods.clone()),
            _ = sigint.recv() => stopping = true,
            _ = sigterm.recv() => stopping = true,
            _ = sleep_until(deadline), if !stopping => stopping = true,
        }
    };
    if let Some(telemetry) = telemetry {
        telemetry.health.set_ready(false);
    }
    sampling.join();
    ended.unwrap_or(Err(RunError::SamplingLost))
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}
