//! Statistics described once, rendered everywhere: a binary lists what it
//! counts as [`Group`]s of [`Stat`]s, each with its name, help text, kind,
//! unit and label and, for each of its series, where the JSON report has it
//! and how it is read from the binary's totals (`T`). A [`Description`]
//! renders them all as `/metrics` families ([`Description::write_metrics`]),
//! a JSON report ([`Description::json`]) and a text report
//! ([`Description::write_text`]), and finds one by name for a status line
//! ([`Description::find`]): a figure described appears in every rendering,
//! and one not described in none.
//!
//! Owns the shapes and the renderings; which figures exist, and how they
//! are counted, is the binary's business.

use std::{fmt::Write as _, io};

use prometheus_client::{metrics::MetricType, registry::Unit as MetricUnit};
use serde_json::Value as Json;

use crate::{ConstMetrics, Number};

/// What a binary describes: its groups, in the order of the reports, and
/// the prefix its registry puts on `/metrics` names.
#[derive(Debug)]
pub struct Description<T: 'static> {
    pub prefix: &'static str,
    pub groups: &'static [Group<T>],
}

/// A group of statistics: one heading of the text report.
#[derive(Debug)]
pub struct Group<T: 'static> {
    pub title: &'static str,
    /// The JSON object holding the group's figures, written `null` when
    /// the run does not have them; `None`: they are spread over the report.
    pub json: Option<&'static str>,
    /// Whether the run has these figures (an exporter, uploads): absent
    /// ones are left out of `/metrics` and the text report rather than
    /// shown as zeros that look healthy.
    pub present: fn(&T) -> bool,
    pub stats: &'static [Stat<T>],
}

/// One statistic: a `/metrics` family, a line of the text report and one
/// JSON key per series.
#[derive(Debug)]
pub struct Stat<T: 'static> {
    /// The family's name under the description's prefix, without the unit's
    /// suffix or a counter's `_total`; the text report's name for it.
    pub name: &'static str,
    pub help: &'static str,
    pub kind: Kind,
    pub unit: StatUnit,
    /// The label telling the series apart; `None`: one series.
    pub label: Option<&'static str>,
    pub series: &'static [Series<T>],
    pub shown: Shown,
}

/// One series of a statistic.
#[derive(Debug)]
pub struct Series<T> {
    /// Its label's value (unused without a label).
    pub label: &'static str,
    /// Where the JSON report has it, a JSON pointer.
    pub json: &'static str,
    pub read: fn(&T) -> Value,
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

    /// As the JSON report has it.
    pub fn json(self) -> Json {
        match self {
            Value::Int(n) => n.into(),
            // Not finite: null.
            Value::Real(x) => x.into(),
            Value::Flag(flag) => flag.into(),
            Value::Unknown => Json::Null,
        }
    }
}

impl<T> Stat<T> {
    /// The sum of the series labelled `labels` (all of them when empty):
    /// whole when they all are; unknown when one is or none matches.
    pub fn total(&self, totals: &T, labels: &[&str]) -> Value {
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
    pub fn metric_unit(&self) -> (Option<MetricUnit>, f64) {
        match self.unit {
            StatUnit::Count | StatUnit::Percent => (None, 1.0),
            StatUnit::Bytes => (Some(MetricUnit::Bytes), 1.0),
            StatUnit::Seconds => (Some(MetricUnit::Seconds), 1.0),
            StatUnit::Micros => (Some(MetricUnit::Seconds), 1e-6),
            StatUnit::Nanos => (Some(MetricUnit::Seconds), 1e-9),
        }
    }

    /// The name `/metrics` shows its series under (registered under
    /// `prefix`), without labels.
    pub fn metric_name(&self, prefix: &str) -> String {
        let mut name = match self.shown {
            Shown::ProcessMetrics => self.name.to_string(),
            _ => format!("{prefix}_{}", self.name),
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

impl<T> Description<T> {
    /// Every described statistic with its group, in order.
    pub fn all(&self) -> impl Iterator<Item = (&'static Group<T>, &'static Stat<T>)> {
        self.groups
            .iter()
            .flat_map(|group| group.stats.iter().map(move |stat| (group, stat)))
    }

    /// The name `/metrics` shows `stat`'s series under, without labels.
    pub fn metric_name(&self, stat: &Stat<T>) -> String {
        stat.metric_name(self.prefix)
    }

    /// The statistic named `name`.
    pub fn find(&self, name: &str) -> Option<&'static Stat<T>> {
        self.all()
            .map(|(_, stat)| stat)
            .find(|stat| stat.name == name)
    }

    /// Writes every statistic `/metrics` shows under the description's
    /// prefix (the groups `totals` has, the series it knows).
    pub fn write_metrics(&self, totals: &T, out: &mut ConstMetrics<'_>) -> std::fmt::Result {
        for group in self.groups.iter().filter(|group| (group.present)(totals)) {
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
        Ok(())
    }

    /// The JSON report's figures: every series at its pointer, and `null` for
    /// the groups the run does not have.
    pub fn json(&self, totals: &T) -> Json {
        let mut report = Json::Object(serde_json::Map::new());
        for group in self.groups {
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

    /// The text report's figures: a heading per group the run has, then a
    /// line per statistic (`name  value`, or `name  label value, ...`).
    pub fn write_text(&self, totals: &T, out: &mut impl io::Write) -> io::Result<()> {
        let width = self
            .all()
            .map(|(_, stat)| stat.name.len())
            .max()
            .unwrap_or(0);
        for group in self.groups.iter().filter(|group| (group.present)(totals)) {
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

impl<T> Stat<T> {
    /// A counter with one series or several, counted as is.
    pub const fn counter(
        name: &'static str,
        help: &'static str,
        series: &'static [Series<T>],
    ) -> Self {
        Self {
            name,
            help,
            kind: Kind::Counter,
            unit: StatUnit::Count,
            label: None,
            series,
            shown: Shown::Everywhere,
        }
    }

    /// A gauge, likewise.
    pub const fn gauge(
        name: &'static str,
        help: &'static str,
        series: &'static [Series<T>],
    ) -> Self {
        Self {
            kind: Kind::Gauge,
            ..Self::counter(name, help, series)
        }
    }

    /// Series told apart by `label`.
    pub const fn by(self, label: &'static str) -> Self {
        Self {
            label: Some(label),
            ..self
        }
    }

    pub const fn unit(self, unit: StatUnit) -> Self {
        Self { unit, ..self }
    }

    /// In the reports only.
    pub const fn reports(self) -> Self {
        Self {
            shown: Shown::Reports,
            ..self
        }
    }

    /// Served by `stackscope_telemetry::ProcessMetrics`.
    pub const fn process_metrics(self) -> Self {
        Self {
            shown: Shown::ProcessMetrics,
            ..self
        }
    }
}

impl<T> Series<T> {
    /// A series labelled `label`, at `json` in the report.
    pub const fn labelled(label: &'static str, json: &'static str, read: fn(&T) -> Value) -> Self {
        Self { label, json, read }
    }

    /// The one series of an unlabelled statistic.
    pub const fn one(json: &'static str, read: fn(&T) -> Value) -> Self {
        Self::labelled("", json, read)
    }
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
mod tests {
    use super::*;

    struct Totals {
        hits: u64,
        misses: u64,
        bytes: Option<u64>,
        exporting: bool,
    }

    fn present(t: &Totals) -> bool {
        t.exporting
    }

    const DESCRIPTION: Description<Totals> = Description {
        prefix: "test",
        groups: &[
            Group {
                title: "lookups",
                json: None,
                present: |_| true,
                stats: &[Stat::counter(
                    "lookups",
                    "Lookups by outcome.",
                    &[
                        Series::labelled("hit", "/lookups/hits", |t: &Totals| t.hits.into()),
                        Series::labelled("miss", "/lookups/misses", |t: &Totals| t.misses.into()),
                    ],
                )
                .by("outcome")],
            },
            Group {
                title: "export",
                json: Some("/export"),
                present,
                stats: &[Stat::gauge(
                    "queued",
                    "Bytes queued.",
                    &[Series::one("/export/queued", |t: &Totals| t.bytes.into())],
                )
                .unit(StatUnit::Bytes)],
            },
        ],
    };

    #[test]
    fn series_add_up_render_as_json_and_text_and_absent_groups_are_null() {
        let lookups = DESCRIPTION.find("lookups").expect("described");
        let totals = Totals {
            hits: 3,
            misses: 4,
            bytes: None,
            exporting: true,
        };
        assert_eq!(lookups.total(&totals, &[]), Value::Int(7));
        assert_eq!(lookups.total(&totals, &["miss"]), Value::Int(4));
        assert_eq!(DESCRIPTION.metric_name(lookups), "test_lookups_total");
        let queued = DESCRIPTION.find("queued").expect("described");
        assert_eq!(DESCRIPTION.metric_name(queued), "test_queued_bytes");
        assert_eq!(queued.total(&totals, &[]), Value::Unknown);
        assert_eq!(queued.format(Value::Int(1536)), "1.5 KiB");

        let json = DESCRIPTION.json(&totals);
        assert_eq!(
            json,
            serde_json::json!({"lookups": {"hits": 3, "misses": 4}, "export": {"queued": null}})
        );
        let mut text = Vec::new();
        DESCRIPTION.write_text(&totals, &mut text).unwrap();
        assert_eq!(
            String::from_utf8(text).unwrap(),
            "lookups\n  lookups  hit 3, miss 4\nexport\n  queued   -\n"
        );

        let idle = Totals {
            exporting: false,
            ..totals
        };
        assert_eq!(DESCRIPTION.json(&idle)["export"], serde_json::Value::Null);
        let mut text = Vec::new();
        DESCRIPTION.write_text(&idle, &mut text).unwrap();
        assert!(!String::from_utf8(text).unwrap().contains("export"));
    }
}
