//! The periodic status line: a few described statistics ([`crate::stats`])
//! over the last status interval, in at most [`MAX_STATUS_CHARS`]
//! characters: samples read per second, samples lost, the share of walks
//! that reached the root, the agent's CPU and its resident memory. The
//! details are in `/metrics` and the final report.

use std::{fmt, time::Duration};

use crate::stats::{self, RunTotals};

/// Running totals kept by the reader (user space side of the ring buffer).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ReaderTotals {
    pub records: u64,
    pub bytes: u64,
    pub decode_errors: u64,
    /// Process exec and exit events among the records.
    pub process_events: u64,
}

/// The longest the status line may be: one line of a log, read at a glance.
pub const MAX_STATUS_CHARS: usize = 200;

/// One figure of the status line: statistic `stat` of the description
/// (the sum of its series, or of those labelled `of`), shown as `show`,
/// in `text` with `{}` standing for the figure.
#[derive(Debug)]
pub struct Figure {
    pub stat: &'static str,
    pub of: &'static [&'static str],
    pub show: Show,
    pub text: &'static str,
}

/// How a figure is computed from the totals at the interval's ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Show {
    /// Its growth per second.
    PerSecond,
    /// Its growth.
    Growth,
    /// The growth of the series `of`, as a share of the statistic's growth.
    Share,
    /// Its growth as a share of the interval's time (seconds a second).
    ShareOfTime,
    /// Its value at the end.
    Now,
}

/// What the status line shows, in order.
pub const FIGURES: [Figure; 5] = [
    Figure {
        stat: "samples_read",
        of: &[],
        show: Show::PerSecond,
        text: "{} samples/s",
    },
    Figure {
        stat: "samples_lost",
        of: &[],
        show: Show::Growth,
        text: "{} dropped",
    },
    Figure {
        stat: "walks",
        of: &["root", "stitched"],
        show: Show::Share,
        text: "{} to root",
    },
    Figure {
        stat: "process_cpu",
        of: &[],
        show: Show::ShareOfTime,
        text: "CPU {}",
    },
    Figure {
        stat: "process_resident_memory",
        of: &[],
        show: Show::Now,
        text: "RSS {}",
    },
];

/// The status line between two readings of the totals.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusLine(String);

impl StatusLine {
    pub fn between(before: &RunTotals, after: &RunTotals, elapsed: Duration) -> Self {
        let secs = elapsed.as_secs_f64().max(1e-9);
        let figures: Vec<String> = FIGURES
            .iter()
            .map(|figure| {
                let shown = stats::DESCRIPTION.find(figure.stat).and_then(|stat| {
                    let growth = |labels: &[&str]| {
                        Some(
                            stat.total(after, labels).as_f64()?
                                - stat.total(before, labels).as_f64()?,
                        )
                    };
                    Some(match figure.show {
                        Show::PerSecond => rate(growth(figure.of)? / secs),
                        Show::Growth => format!("{:.0}", growth(figure.of)?),
                        Show::Share => {
                            let all = growth(&[])?;
                            if all <= 0.0 {
                                return None;
                            }
                            format!("{:.1}%", 100.0 * growth(figure.of)? / all)
                        }
                        Show::ShareOfTime => format!("{:.1}%", 100.0 * growth(figure.of)? / secs),
                        Show::Now => match stat.total(after, figure.of) {
                            stats::Value::Unknown => return None,
                            value => stat.format(value),
                        },
                    })
                });
                figure.text.replace("{}", shown.as_deref().unwrap_or("-"))
            })
            .collect();
        Self(figures.join(", "))
    }
}

/// A rate: whole above 100, one decimal below.
fn rate(per_second: f64) -> String {
    if per_second.abs() >= 100.0 {
        format!("{per_second:.0}")
    } else {
        format!("{per_second:.1}")
    }
}

impl fmt::Display for StatusLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use stackscope_telemetry::ProcessUsage;

    use super::*;
    use stackscope_sampler::Counters;
    use stackscope_unwind::walker::WalkStats;

    fn totals(records: u64, lost: u64, walks: (u64, u64), cpu: f64, rss: u64) -> RunTotals {
        RunTotals {
            reader: ReaderTotals {
                records,
                process_events: records / 100,
                decode_errors: lost / 4,
                ..ReaderTotals::default()
            },
            kernel: Counters {
                ring_buffer_full: lost - lost / 4,
                ..Counters::default()
            },
            walks: WalkStats {
                walks: walks.0,
                outermost: walks.1,
                ..WalkStats::default()
            },
            process: ProcessUsage {
                cpu_seconds: Some(cpu),
                resident_bytes: Some(rss),
                peak_resident_bytes: Some(rss),
            },
            ..RunTotals::default()
        }
    }

    #[test]
    fn figures_are_growths_over_the_interval() {
        let before = totals(1_000, 8, (900, 800), 1.0, 40 << 20);
        // 10,000 records more, of which 100 process events, in 2 s; 12
        // samples lost; 1,000 walks, 950 to the root; 0.1 s of CPU.
        let after = totals(11_000, 20, (1_900, 1_750), 1.1, 47 << 20);
        let line = StatusLine::between(&before, &after, Duration::from_secs(2));
        assert_eq!(
            line.to_string(),
            "4950 samples/s, 12 dropped, 95.0% to root, CPU 5.0%, RSS 47.0 MiB"
        );
    }

    #[test]
    fn figures_not_measured_show_a_dash() {
        let mut before = totals(0, 0, (10, 10), 0.0, 0);
        let mut after = before.clone();
        after.process = ProcessUsage::default();
        before.process = ProcessUsage::default();
        let line = StatusLine::between(&before, &after, Duration::from_secs(5));
        assert_eq!(
            line.to_string(),
            "0.0 samples/s, 0 dropped, - to root, CPU -, RSS -"
        );
    }

    #[test]
    fn the_line_stays_short_with_the_largest_figures() {
        // A node of 512 CPUs at 10 kHz for a day, with every sample lost
        // twice over and a terabyte resident: far past any real run.
        let before = totals(0, 0, (0, 0), 0.0, 0);
        let after = totals(
            u64::MAX / 2,
            u64::MAX / 2,
            (u64::MAX / 2, u64::MAX / 4),
            512.0 * 86_400.0,
            u64::MAX / 2,
        );
        for elapsed in [Duration::from_millis(1), Duration::from_secs(86_400)] {
            let line = StatusLine::between(&before, &after, elapsed).to_string();
            assert!(
                line.chars().count() <= MAX_STATUS_CHARS,
                "{} characters: {line}",
                line.chars().count()
            );
            for figure in ["samples/s", "dropped", "to root", "CPU", "RSS"] {
                assert!(line.contains(figure), "{figure} missing: {line}");
            }
        }
    }

    #[test]
    fn every_figure_names_a_described_statistic_and_its_series() {
        for figure in &FIGURES {
            let stat = stats::DESCRIPTION
                .find(figure.stat)
                .unwrap_or_else(|| panic!("{} is not described", figure.stat));
            for label in figure.of {
                assert!(
                    stat.series.iter().any(|s| s.label == *label),
                    "{} has no series {label}",
                    figure.stat
                );
            }
            assert_eq!(figure.text.matches("{}").count(), 1, "{}", figure.text);
        }
    }
}
