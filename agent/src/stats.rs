//! The agent's statistics, described once. Every figure the sampling thread, the
//! exporter and the uploader count is a [`Stat`] in [`GROUPS`]: its name,
//! help text, kind, unit and label, and for each of its series where it
//! sits in the JSON report and how it is read from the run's totals
//! ([`RunTotals`]). `/metrics` ([`write_metrics`], served by
//! [`crate::metrics`]), the final report ([`report`]: JSON and text) and the
//! status line ([`crate::status`]: a few figures named here) are rendered
//! from it, so a figure described here appears in all of them (the tests
//! check each rendering) and a figure not described appears in none.
//!
//! Counting stays with each stage (plain totals in its own structures,
//! read at publish, status and report time); the process's CPU and memory
//! are read by `stackscope_telemetry`, whose `ProcessMetrics` serves them.

mod described;
pub mod report;

use std::{fmt::Write as _, io, time::Duration};

use serde_json::Value as Json;
use stackscope_telemetry::{
    ConstMetrics, Number, ProcessUsage, StateSize,
    prometheus_client::{metrics::MetricType, registry::Unit as MetricUnit},
};

pub use described::GROUPS;

use crate::{
    aggregate::{AggregateStats, WorkerStats},
    export::{ExportStats, debuginfo::UploadStats},
    run::{HandoffTotals, RunSummary},
    status::ReaderTotals,
};
use stackscope_process_table::table::TableStats;
use stackscope_sampler::mapping_feed::FeedStats;
use stackscope_sampler::{Counters, ProgramStats};
use stackscope_symbolize::node::perf_map::PerfMapStats;
use stackscope_telemetry::probes::ProbeTotals;
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
    pub batches: WorkerStats,
    /// Messages between the agent's threads dropped on a full queue.
    pub handoffs: HandoffTotals,
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

/// The per-process tally's totals.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TallyTotals {
    /// Sampled processes that exited while the agent ran, and their samples.
    pub exited_processes: u64,
    pub exited_samples: u64,
    /// Samples of processes beyond the tally's bound.
    pub untracked_samples: u64,
}

impl RunTotals {
    /// The totals a finished run reports, with the exporter's and the
    /// uploader's final figures and the agent's CPU and memory now.
    pub fn of_run(
        summary: &RunSummary,
        export: Option<&ExportStats>,
        uploads: Option<&UploadStats>,
    ) -> Self {
        let (exited_processes, exited_samples) = summary.tally.exited_counts();
        Self {
            elapsed: summary.elapsed,
            kernel: summary.kernel,
            program: summary.program,
            reader: summary.reader,
            probes: summary.probes,
            walks: summary.unwinding.clone(),
            mapping_feed: summary.mapping_feed,
            process_table: summary.process_table,
            processes: TallyTotals {
                exited_processes,
                exited_samples,
                untracked_samples: summary.tally.other(),
            },
            aggregation: summary.aggregation,
            jit_names: summary.jit_names,
            batches: summary.batches,
            handoffs: summary.handoffs,
            export: export.cloned(),
            uploads: uploads.copied(),
            process: ProcessUsage::now(),
            state: Vec::new(),
        }
    }
}

/// A group of statistics: one heading of the text report.
#[derive(Debug)]
pub struct Group {
    pub title: &'static str,
    /// The JSON object holding the group's figures, written `null` when
    /// the run does not have them; `None`: they are spread over the report.
    pub json: Option<&'static str>,
    /// Whether the run has these figures (an exporter, uploads): absent
    /// ones are left out of `/metrics` and the text report rather than
    /// shown as zeros that look healthy.
    pub present: fn(&RunTotals) -> bool,
    pub stats: &'static [Stat],
}

/// One statistic: a `/metrics` family, a line of the text report and one
/// JSON key per series.
#[derive(Debug)]
pub struct Stat {
    /// The family's name under `stackscope_agent_`, without the unit's
    /// suffix or a counter's `_total`; the text report's name for it.
    pub name: &'static str,
    pub help: &'static str,
    pub kind: Kind,
    pub unit: StatUnit,
    /// The label telling the series apart; `None`: one series.
    pub label: Option<&'static str>,
    pub series: &'static [Series],
    pub shown: Shown,
}

/// One series of a statistic.
#[derive(Debug)]
pub struct Series {
    /// Its label's value (unused without a label).
    pub label: &'static str,
    /// Where the JSON report has it, a JSON pointer.
    pub json: &'static str,
    pub read: fn(&RunTotals) -> Value,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Only grows (from the start of the run).
    Counter,
    /// Goes up and down: a size, a level, the last or the largest.
    Gauge,
}

/// What a statistic's numbers measure. Each rendering follows its own
/// convention: `/metrics` in bytes and seconds, the JSON report the
/// figure as counted, the text report for reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatUnit {
    Count,
    Bytes,
    Seconds,
    Micros,
    Nanos,
    Percent,
}

/// Where a statistic is rendered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shown {
    /// `/metrics` and the reports.
    Everywhere,
    /// The reports only: a sum or a share of other statistics, which
    /// `/metrics` leaves to the queries.
    Reports,
    /// The reports; `/metrics` has it without the agent's prefix from
    /// `stackscope_telemetry::ProcessMetrics` (`{name}_{unit}`, plus
    /// `_total` for a counter), read at each scrape.
    ProcessMetrics,
}

/// A series' value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value {
    Int(u64),
    Real(f64),
    Flag(bool),
    /// Not measured in this run (such as the BPF program's cost without
    /// `--bpf-stats`): `null` in JSON, left out of `/metrics`.
    Unknown,
}

impl From<u64> for Value {
    fn from(n: u64) -> Self {
        Value::Int(n)
    }
}

impl From<usize> for Value {
    fn from(n: usize) -> Self {
        Value::Int(n as u64)
    }
}

impl From<f64> for Value {
    fn from(x: f64) -> Self {
        Value::Real(x)
    }
}

impl From<bool> for Value {
    fn from(flag: bool) -> Self {
        Value::Flag(flag)
    }
}

impl<T: Into<Value>> From<Option<T>> for Value {
    fn from(value: Option<T>) -> Self {
        value.map_or(Value::Unknown, Into::into)
    }
}

impl Value {
    /// As a number (a flag is 0 or 1).
    pub fn as_f64(self) -> Option<f64> {
        match self {
            Value::Int(n) => Some(n as f64),
            Value::Real(x) => Some(x),
            Value::Flag(flag) => Some(f64::from(u8::from(flag))),
            Value::Unknown => None,
        }
    }

    fn json(self) -> Json {
        match self {
            Value::Int(n) => n.into(),
            // Not finite: null.
            Value::Real(x) => x.into(),
            Value::Flag(flag) => flag.into(),
            Value::Unknown => Json::Null,
        }
    }
}

impl Stat {
    /// The sum of the series labelled `labels` (all of them when empty):
    /// whole when they all are; unknown when one is or none matches.
    pub fn total(&self, totals: &RunTotals, labels: &[&str]) -> Value {
        let mut total = None;
        for series in self.series {
            if !labels.is_empty() && !labels.contains(&series.label) {
                continue;
            }
            let value = (series.read)(totals);
            total = Some(match (total, value) {
                (_, Value::Unknown) => return Value::Unknown,
                (None, value) => value,
                (Some(Value::Int(a)), Value::Int(b)) => Value::Int(a.saturating_add(b)),
                (Some(sum), value) => match (sum.as_f64(), value.as_f64()) {
                    (Some(a), Some(b)) => Value::Real(a + b),
                    _ => return Value::Unknown,
                },
            });
        }
        total.unwrap_or(Value::Unknown)
    }

    /// Its value as the text report and the status line show it.
    pub fn format(&self, value: Value) -> String {
        let number = match value {
            Value::Unknown => return "-".into(),
            Value::Flag(flag) => return if flag { "yes" } else { "no" }.into(),
            Value::Int(n) if self.unit == StatUnit::Count => return n.to_string(),
            Value::Int(n) => n as f64,
            Value::Real(x) => x,
        };
        match self.unit {
            StatUnit::Count => format!("{number:.2}"),
            StatUnit::Bytes => format_bytes(number),
            StatUnit::Seconds => format_seconds(number),
            StatUnit::Micros => format_seconds(number * 1e-6),
            StatUnit::Nanos => format_seconds(number * 1e-9),
            StatUnit::Percent => format!("{number:.1}%"),
        }
    }

    /// `/metrics`' unit and the factor from the described unit to it.
    fn metric_unit(&self) -> (Option<MetricUnit>, f64) {
        match self.unit {
            StatUnit::Count | StatUnit::Percent => (None, 1.0),
            StatUnit::Bytes => (Some(MetricUnit::Bytes), 1.0),
            StatUnit::Seconds => (Some(MetricUnit::Seconds), 1.0),
            StatUnit::Micros => (Some(MetricUnit::Seconds), 1e-6),
            StatUnit::Nanos => (Some(MetricUnit::Seconds), 1e-9),
        }
    }

    /// The name `/metrics` shows its series under, without labels.
    pub fn metric_name(&self) -> String {
        let mut name = match self.shown {
            Shown::ProcessMetrics => self.name.to_string(),
            _ => format!("stackscope_agent_{}", self.name),
        };
        if let (Some(unit), _) = self.metric_unit() {
            name = format!("{name}_{}", unit.as_str());
        }
        if self.kind == Kind::Counter {
            name.push_str("_total");
        }
        name
    }
}

/// Every described statistic with its group, in order.
pub fn all() -> impl Iterator<Item = (&'static Group, &'static Stat)> {
    GROUPS
        .iter()
        .flat_map(|group| group.stats.iter().map(move |stat| (group, stat)))
}

/// The statistic named `name`.
pub fn find(name: &str) -> Option<&'static Stat> {
    all().map(|(_, stat)| stat).find(|stat| stat.name == name)
}

/// Writes every statistic `/metrics` shows under the agent's prefix (the
/// groups the run has, the series it knows), then the state sizes.
pub fn write_metrics(totals: &RunTotals, out: &mut ConstMetrics<'_>) -> std::fmt::Result {
    for group in GROUPS.iter().filter(|group| (group.present)(totals)) {
        for stat in group.stats {
            if stat.shown != Shown::Everywhere {
                continue;
            }
            let (unit, factor) = stat.metric_unit();
            let values: Vec<(&str, Number)> = stat
                .series
                .iter()
                .filter_map(|series| {
                    let number = match (series.read)(totals) {
                        Value::Int(n) if factor == 1.0 => Number::Int(n),
                        Value::Flag(flag) => Number::Int(u64::from(flag)),
                        Value::Unknown => return None,
                        value => Number::Real(value.as_f64()? * factor),
                    };
                    Some((series.label, number))
                })
                .collect();
            if values.is_empty() {
                continue;
            }
            let kind = match stat.kind {
                Kind::Counter => MetricType::Counter,
                Kind::Gauge => MetricType::Gauge,
            };
            out.family(stat.name, stat.help, unit, kind, stat.label, &values)?;
        }
    }
    // Samples waiting for tables, stack plans and every other piece of
    // state the agent keeps, with their bounds.
    out.state(&totals.state)
}

/// The JSON report's figures: every series at its pointer, and `null` for
/// the groups the run does not have.
pub fn json(totals: &RunTotals) -> Json {
    let mut report = Json::Object(serde_json::Map::new());
    for group in GROUPS {
        if !(group.present)(totals) {
            if let Some(pointer) = group.json {
                *slot(&mut report, pointer) = Json::Null;
            }
            continue;
        }
        for stat in group.stats {
            for series in stat.series {
                *slot(&mut report, series.json) = (series.read)(totals).json();
            }
        }
    }
    report
}

/// The value at `pointer` (`/a/b`), made with the objects on its way.
fn slot<'a>(root: &'a mut Json, pointer: &str) -> &'a mut Json {
    pointer.split('/').skip(1).fold(root, |node, key| {
        if !node.is_object() {
            *node = Json::Object(serde_json::Map::new());
        }
        match node {
            Json::Object(map) => map.entry(key).or_insert(Json::Null),
            _ => unreachable!("made an object above"),
        }
    })
}

/// The text report's figures: a heading per group the run has, then a
/// line per statistic (`name  value`, or `name  label value, ...`).
pub fn write_text(totals: &RunTotals, out: &mut impl io::Write) -> io::Result<()> {
    let width = all().map(|(_, stat)| stat.name.len()).max().unwrap_or(0);
    for group in GROUPS.iter().filter(|group| (group.present)(totals)) {
        writeln!(out, "{}", group.title)?;
        for stat in group.stats {
            let mut line = String::new();
            for (i, series) in stat.series.iter().enumerate() {
                let value = stat.format((series.read)(totals));
                let separator = if i == 0 { "" } else { ", " };
                match stat.label {
                    Some(_) => write!(line, "{separator}{} {value}", series.label),
                    None => write!(line, "{separator}{value}"),
                }
                .expect("writing to a String");
            }
            writeln!(out, "  {:width$}  {line}", stat.name)?;
        }
    }
    Ok(())
}

/// `512 B`, `4.0 KiB`, `1.5 GiB`.
pub fn format_bytes(bytes: f64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes.abs() < 1024.0 {
        return format!("{bytes:.0} B");
    }
    let mut scaled = bytes / 1024.0;
    let mut unit = 0;
    while scaled.abs() >= 1024.0 && unit + 1 < UNITS.len() {
        scaled /= 1024.0;
        unit += 1;
    }
    format!("{scaled:.1} {}", UNITS[unit])
}

/// `850 ns`, `12.5 us`, `3.2 ms`, `1.25 s`.
fn format_seconds(seconds: f64) -> String {
    let magnitude = seconds.abs();
    if magnitude >= 1.0 || magnitude == 0.0 {
        format!("{seconds:.2} s")
    } else if magnitude >= 1e-3 {
        format!("{:.1} ms", seconds * 1e3)
    } else if magnitude >= 1e-6 {
        format!("{:.1} us", seconds * 1e6)
    } else {
        format!("{:.0} ns", seconds * 1e9)
    }
}

#[cfg(test)]
pub(crate) mod tests;
