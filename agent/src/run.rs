//! The agent's main loop: read records until a signal or the deadline, walk
//! and aggregate every sample, end an aggregation interval on every
//! boundary and hand its batch to the sink, keep the per-process tally and
//! print the status line every status interval.

use std::{
    io,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use agent_common::sample_flags;
use stackscope_proto::v1::Batch;
use tokio::{
    signal::unix::{SignalKind, signal},
    time::{Instant, MissedTickBehavior},
};

use crate::{
    aggregate::{
        AggregateStats, Aggregator, AggregatorConfig, BatchOptions, BatchWorker, DEFAULT_INTERVAL,
        WorkerStats,
    },
    sampler::{Counters, ProgramStats, Sampler, SamplerConfig, SamplerError, record::Record},
    status::{ReaderTotals, Snapshot, StatusLine},
    symbolize::SymbolizerConfig,
    tally::ProcessTally,
    unwinding::{StackWalker, WalkStats, WalkerConfig},
};

/// Where finished batches go: the exporter's queue, or a test's list.
/// Called on the run loop's thread, once per aggregation interval (and once
/// more at shutdown for the last, partial one).
pub trait BatchSink: Send {
    fn send(&mut self, batch: Batch);
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
        }
    }
}

/// What a run saw, for the final report.
#[derive(Debug)]
pub struct RunSummary {
    pub tally: ProcessTally,
    pub reader: ReaderTotals,
    pub kernel: Counters,
    pub program: ProgramStats,
    pub unwinding: WalkStats,
    pub aggregation: AggregateStats,
    pub batches: WorkerStats,
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
    #[error("starting the batch worker thread failed")]
    Worker(#[source] io::Error),
}

enum Event {
    Records,
    StatusDue,
    IntervalDue,
    Built(Box<Batch>),
    Stop,
}

/// Samples until SIGINT/SIGTERM or `config.duration`, handing one batch per
/// aggregation interval to `sink` (none: batches are built and dropped),
/// then detaches (by dropping the sampler), flushes the last partial
/// interval and returns what was seen. `sink` is dropped before returning.
pub async fn run(
    config: &AgentConfig,
    mut sink: Option<Box<dyn BatchSink>>,
) -> Result<RunSummary, RunError> {
    let mut sigint = signal(SignalKind::interrupt()).map_err(RunError::Signals)?;
    let mut sigterm = signal(SignalKind::terminate()).map_err(RunError::Signals)?;

    let mut worker = BatchWorker::start(
        config.symbolizer.clone(),
        BatchOptions::for_frequency(config.sampler.frequency_hz),
    )
    .map_err(RunError::Worker)?;
    let mut sampler = Sampler::start(&config.sampler)?;
    let started = Instant::now();
    let deadline = config.duration.map(|d| started + d);
    tracing::info!(
        frequency_hz = config.sampler.frequency_hz,
        stack_bytes = config.sampler.user_stack_bytes,
        pids = ?config.sampler.pids,
        cgroups = config.sampler.cgroup_ids.len(),
        "sampling every online CPU"
    );

    let mut records = RecordTally {
        processes: ProcessTally::with_capacity(MAX_TRACKED_PROCESSES),
        totals: ReaderTotals::default(),
        walker: StackWalker::new(config.walker.clone()),
        aggregator: Aggregator::new(config.aggregation.clone()),
        kernel_frames: Vec::with_capacity(agent_common::MAX_KERNEL_FRAMES),
    };
    let interval = config.interval.max(Duration::from_millis(1));
    let mut intervals = tokio::time::interval_at(next_boundary(interval), interval);
    // A late tick must not shift the boundaries.
    intervals.set_missed_tick_behavior(MissedTickBehavior::Skip);

    let mut status =
        tokio::time::interval_at(started + config.status_interval, config.status_interval);
    status.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut last = Snapshot {
        reader: ReaderTotals::default(),
        kernel: sampler.counters()?,
    };
    let mut last_at = started;

    loop {
        let event = tokio::select! {
            read = sampler.read_records(|bytes| records.add(bytes)) => {
                read.map_err(RunError::Read)?;
                Event::Records
            }
            _ = status.tick() => Event::StatusDue,
            _ = intervals.tick() => Event::IntervalDue,
            batch = worker.next_batch() => Event::Built(Box::new(batch)),
            _ = sigint.recv() => Event::Stop,
            _ = sigterm.recv() => Event::Stop,
            _ = sleep_until(deadline) => Event::Stop,
        };
        match event {
            Event::Records => {
                let RecordTally {
                    walker, aggregator, ..
                } = &mut records;
                walker.poll(|w| aggregator.add(w.header, w.kernel_frames, Some(&w.walk)));
            }
            Event::IntervalDue => {
                let end = nearest_boundary(SystemTime::now(), interval);
                worker.submit(records.aggregator.finish_interval(end));
            }
            Event::Built(batch) => {
                if let Some(sink) = sink.as_mut() {
                    sink.send(*batch);
                }
            }
            Event::StatusDue => {
                let now = Instant::now();
                let snapshot = Snapshot {
                    reader: records.totals,
                    kernel: sampler.counters()?,
                };
                let walks = records.walker.stats();
                let worst: Vec<String> = walks
                    .worst_binaries(3)
                    .into_iter()
                    .map(|(binary, walks, outermost)| {
                        format!("{binary} {:.0}%", 100.0 * outermost as f64 / walks as f64)
                    })
                    .collect();
                let aggregation = records.aggregator.stats();
                let batches = worker.stats();
                tracing::info!(
                    "{}; unwinding: {:.1}% of {} stacks to the outermost frame (least: {}), \
                     tables {} compiled + {} from disk, {} samples waiting, {} found the queue full; \
                     aggregation: {} distinct stacks this interval, {} batches built \
                     (last: {} stacks, {} KiB, built in {:.1} ms; {} intervals dropped), \
                     naming {:.0}% cache hits",
                    StatusLine::between(&last, &snapshot, now - last_at),
                    walks.outermost_percent(),
                    walks.walks,
                    if worst.is_empty() {
                        "none".to_string()
                    } else {
                        worst.join(", ")
                    },
                    walks.tables_compiled,
                    walks.tables_from_disk,
                    records.walker.waiting(),
                    walks.queue_full,
                    aggregation.distinct,
                    batches.batches_built,
                    batches.last_batch_stacks,
                    batches.last_batch_bytes / 1024,
                    batches.build_micros_last as f64 / 1000.0,
                    batches.intervals_dropped,
                    batches.symbolize.cache_hit_percent(),
                );
                (last, last_at) = (snapshot, now);
            }
            Event::Stop => break,
        }
    }

    // Take what is still queued, then read the final counters before the
    // program is detached.
    sampler.drain_records(|bytes| records.add(bytes));
    let kernel = sampler.counters()?;
    let program = sampler.program_stats()?;
    drop(sampler);
    let RecordTally {
        walker, aggregator, ..
    } = &mut records;
    walker.flush(|w| aggregator.add(w.header, w.kernel_frames, Some(&w.walk)));
    let last = records.aggregator.finish_interval(SystemTime::now());
    // Blocks until the last batches are built: nothing else is left to run.
    let (batches, batch_stats) = worker.finish(last);
    if let Some(sink) = sink.as_mut() {
        batches.into_iter().for_each(|batch| sink.send(batch));
    }
    drop(sink);
    Ok(RunSummary {
        kernel,
        program,
        elapsed: started.elapsed(),
        reader: records.totals,
        tally: records.processes,
        unwinding: records.walker.stats().clone(),
        aggregation: records.aggregator.stats(),
        batches: batch_stats,
    })
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

/// What the reader keeps of each record.
struct RecordTally {
    processes: ProcessTally,
    totals: ReaderTotals,
    walker: StackWalker,
    aggregator: Aggregator,
    /// The kernel frames of the sample being read, copied out of the ring
    /// buffer record once.
    kernel_frames: Vec<u64>,
}

impl RecordTally {
    fn add(&mut self, bytes: &[u8]) {
        self.totals.records += 1;
        self.totals.bytes += bytes.len() as u64;
        match Record::decode(bytes) {
            Ok(Record::Sample(sample)) => {
                self.processes.add(sample.header.tgid, || sample.comm());
                let Self {
                    walker,
                    aggregator,
                    kernel_frames,
                    ..
                } = self;
                kernel_frames.clear();
                kernel_frames.extend(sample.kernel_frames());
                if sample.header.flags & sample_flags::USER_REGS == 0 {
                    // A kernel thread: nothing to walk.
                    aggregator.add(&sample.header, kernel_frames, None);
                } else {
                    walker.push(&sample.header, kernel_frames, sample.user_stack, |w| {
                        aggregator.add(w.header, w.kernel_frames, Some(&w.walk))
                    });
                }
            }
            Ok(Record::Exec(event)) => {
                self.totals.process_events += 1;
                self.walker.on_exec(event.tgid);
                self.aggregator.on_exec(event.tgid);
            }
            Ok(Record::Exit(event)) => {
                self.totals.process_events += 1;
                self.walker.on_exit(event.tgid);
                self.aggregator.on_exit(event.tgid);
            }
            Err(err) => {
                self.totals.decode_errors += 1;
                if self.totals.decode_errors == 1 {
                    tracing::warn!("skipping a malformed sample record: {err}");
                }
            }
        }
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
