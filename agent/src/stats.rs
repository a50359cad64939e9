//! The agent's statistics, described once. Every figure the sampling thread, the
//! exporter and the uploader count is a [`Stat`] in [`GROUPS`]: its name,
//! help text, kind, unit and label, and for each of its series where it
//! sits in the JSON report and how it is read from the run's totals
//! ([`RunTotals`]). `/metrics` ([`write_metrics`], served by
//! [`crate::metrics`]), the final report ([`report`]: JSON and text) and the
//! status line ([`crate::status`]: a few figures named here) are rendered
//! from it by `stackscope_telemetry::described`, so a figure described
//! here appears in all of them (the tests check each rendering) and a
//! figure not described appears in none.
//!
//! Counting stays with each stage (plain totals in its own structures,
//! read at publish, status and report time); the process's CPU and memory
//! are read by `stackscope_telemetry`, whose `ProcessMetrics` serves them.

mod groups;
pub mod report;

use std::time::Duration;

use stackscope_telemetry::{
    ConstMetrics, ProcessUsage, StateSize,
    described::{self, Description},
};

pub use stackscope_telemetry::described::{Kind, Shown, StatUnit, Value, format_bytes};

pub use groups::GROUPS;

use crate::{
    aggregate::{AggregateStats, WorkerStats},
    export::{ExportStats, debuginfo::UploadStats},
    run::{HandoffTotals, RunSummary, WakeupTotals},
    run::{JvmStats, OffCpuStats, PythonStats},
    status::ReaderTotals,
};
use stackscope_process_table::table::TableStats;
use stackscope_sampler::mapping_feed::FeedStats;
use stackscope_sampler::{Counters, ProgramStats};
use stackscope_symbolize::node::perf_map::PerfMapStats;
use stackscope_telemetry::probes::ProbeTotals;
use stackscope_telemetry::tally::TallyTotals;
use stackscope_unwind::walker::WalkStats;

/// What the statistics are read from: the run's totals at one instant.
#[derive(Debug, Clone, Default)]
pub struct RunTotals {
    /// Since the sampling thread started.
    pub elapsed: Duration,
    pub kernel: Counters,
    pub program: ProgramStats,
    pub reader: ReaderTotals,
    /// Hash-table lookups made by the sampling thread.
    pub probes: ProbeTotals,
    pub walks: WalkStats,
    /// Mappings learned as they were made.
    pub mapping_feed: FeedStats,
    pub process_table: TableStats,
    pub processes: TallyTotals,
    pub aggregation: AggregateStats,
    /// How JIT frames were named.
    pub jit_names: PerfMapStats,
    /// CPython processes found, and their Python stacks.
    pub python: PythonStats,
    /// HotSpot JVMs read, and what their reads found.
    pub jvm: JvmStats,
    /// `None`: off-CPU sampling is off.
    pub off_cpu: Option<OffCpuStats>,
    pub batches: WorkerStats,
    /// Messages between the agent's threads dropped on a full queue.
    pub handoffs: HandoffTotals,
    /// Why the sampling thread woke, and what each cause cost it.
    pub wakeups: WakeupTotals,
    /// `None`: no exporter (its statistics are left out, not zero).
    pub export: Option<ExportStats>,
    /// `None`: no debuginfo uploads.
    pub uploads: Option<UploadStats>,
    /// The agent's own CPU time and memory.
    pub process: ProcessUsage,
    /// What the agent keeps, against its bounds (`/metrics` only, as
    /// `state_*` gauges by name: see `ConstMetrics::state`).
    pub state: Vec<StateSize>,
}

impl RunTotals {
    /// The totals a finished run reports, with the exporter's and the
    /// uploader's final figures and the agent's CPU and memory now.
    pub fn of_run(
        summary: &RunSummary,
        export: Option<&ExportStats>,
        uploads: Option<&UploadStats>,
    ) -> Self {
        Self {
            elapsed: summary.elapsed,
            kernel: summary.kernel,
            program: summary.program,
            reader: summary.reader,
            probes: summary.probes,
            walks: summary.unwinding.clone(),
            mapping_feed: summary.mapping_feed,
            process_table: summary.process_table,
            processes: summary.tally.totals(),
            aggregation: summary.aggregation,
            jit_names: summary.jit_names,
            python: summary.python,
            jvm: summary.jvm,
            off_cpu: summary.off_cpu,
            batches: summary.batches,
            handoffs: summary.handoffs,
            wakeups: summary.wakeups,
            export: export.cloned(),
            uploads: uploads.copied(),
            process: ProcessUsage::now(),
            state: Vec::new(),
        }
    }
}

/// The agent's statistics, under `/metrics`' `stackscope_agent_` prefix.
pub const DESCRIPTION: Description<RunTotals> = Description {
    prefix: "stackscope_agent",
    groups: GROUPS,
};

pub type Group = described::Group<RunTotals>;
pub type Stat = described::Stat<RunTotals>;
pub type Series = described::Series<RunTotals>;

/// Writes every statistic `/metrics` shows under the agent's prefix (the
/// groups the run has, the series it knows), then the state sizes.
pub fn write_metrics(totals: &RunTotals, out: &mut ConstMetrics<'_>) -> std::fmt::Result {
    DESCRIPTION.write_metrics(totals, out)?;
    // Samples waiting for tables, stack plans and every other piece of
    // state the agent keeps, with their bounds.
    out.state(&totals.state)
}

#[cfg(test)]
pub(crate) mod tests;
