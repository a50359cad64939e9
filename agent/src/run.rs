//! The agent's main loop: read records until a signal or the deadline, keep
//! the per-process tally and print the status line every interval.

use std::{io, time::Duration};

use tokio::{
    signal::unix::{SignalKind, signal},
    time::{Instant, MissedTickBehavior},
};

use crate::{
    sampler::{Counters, ProgramStats, Sampler, SamplerConfig, SamplerError, record::Record},
    status::{ReaderTotals, Snapshot, StatusLine},
    tally::ProcessTally,
    unwinding::{StackWalker, WalkStats, WalkerConfig},
};

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
}

/// What a run saw, for the final report.
#[derive(Debug)]
pub struct RunSummary {
    pub tally: ProcessTally,
    pub reader: ReaderTotals,
    pub kernel: Counters,
    pub program: ProgramStats,
    pub unwinding: WalkStats,
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
}

enum Event {
    Records,
    StatusDue,
    Stop,
}

/// Samples until SIGINT/SIGTERM or `config.duration`, then detaches (by
/// dropping the sampler) and returns what was seen.
pub async fn run(config: &AgentConfig) -> Result<RunSummary, RunError> {
    let mut sigint = signal(SignalKind::interrupt()).map_err(RunError::Signals)?;
    let mut sigterm = signal(SignalKind::terminate()).map_err(RunError::Signals)?;

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
    };

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
            _ = sigint.recv() => Event::Stop,
            _ = sigterm.recv() => Event::Stop,
            _ = sleep_until(deadline) => Event::Stop,
        };
        match event {
            Event::Records => records.walker.poll(|_, _| {}),
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
                tracing::info!(
                    "{}; unwinding: {:.1}% of {} stacks to the outermost frame (least: {}), \
                     tables {} compiled + {} from disk, {} samples waiting, {} found the queue full",
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
                );
                (last, last_at) = (snapshot, now);
            }
            Event::Stop => break,
        }
    }

    // Take what is still queued, then read the final counters before the
    // program is detached.
    sampler.drain_records(|bytes| records.add(bytes));
    records.walker.flush(|_, _| {});
    let summary = RunSummary {
        kernel: sampler.counters()?,
        program: sampler.program_stats()?,
        elapsed: started.elapsed(),
        reader: records.totals,
        tally: records.processes,
        unwinding: records.walker.stats().clone(),
    };
    drop(sampler);
    Ok(summary)
}

/// What the reader keeps of each record.
struct RecordTally {
    processes: ProcessTally,
    totals: ReaderTotals,
    walker: StackWalker,
}

impl RecordTally {
    fn add(&mut self, bytes: &[u8]) {
        self.totals.records += 1;
        self.totals.bytes += bytes.len() as u64;
        match Record::decode(bytes) {
            Ok(Record::Sample(sample)) => {
                self.processes.add(sample.header.tgid, || sample.comm());
                // The frames go nowhere yet: aggregation and export come next.
                self.walker
                    .push(&sample.header, sample.user_stack, |_, _| {});
            }
            Ok(Record::Exec(event)) => {
                self.totals.process_events += 1;
                self.walker.on_exec(event.tgid);
            }
            Ok(Record::Exit(event)) => {
                self.totals.process_events += 1;
                self.walker.on_exit(event.tgid);
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
