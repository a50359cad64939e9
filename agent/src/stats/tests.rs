//! Every described statistic appears in every rendering it is meant for,
//! reads its own figure, and every figure the stages count is described.

use std::{collections::HashMap, fmt, sync::Arc, time::Duration};

use stackscope_telemetry::{
    ConstMetrics, ProcessUsage, StateSize,
    prometheus_client::{collector::Collector, encoding::DescriptorEncoder, registry::Registry},
};

use super::*;
use crate::export::ExportStats;
use stackscope_symbolize::node::SymbolizeStats;
use stackscope_telemetry::tally::{Counted, ProcessTally, TallyTotals};
use stackscope_unwind::walker::{
    EarlyEnds, WalkEnds,
    stitching::{PlanStats, TruncatedBy},
};

/// Totals whose every figure is set, nearly all to distinct values, so a
/// statistic reading the wrong field shows. Each struct is written out
/// field by field: a field added to one fails to compile here, and is to
/// be described in `described.rs` too.
pub(crate) fn every_figure_distinct() -> RunTotals {
    let mut next = 0u64;
    let mut n = || {
        next += 1;
        next
    };
    RunTotals {
        elapsed: Duration::from_millis(1500),
        kernel: Counters {
            samples: n(),
            ring_buffer_full: n(),
            copy_failed: n(),
            address_space_gone: n(),
            filtered: n(),
            idle: n(),
            budgeted: n(),
            user_stack_bytes: n(),
            tail_spans: n(),
            deep_copies: n(),
            deep_copies_with_holes: n(),
            deep_copy_fallbacks: n(),
            early_wakeups: n(),
            direct_copy_fallbacks: n(),
            bad_area_records: n(),
            python_stacks: n(),
            python_frames: n(),
            off_cpu_switches: n(),
            off_cpu_skipped: n(),
            off_cpu_samples: n(),
            off_cpu_failed: n(),
            switch_ins: n(),
        },
        program: ProgramStats {
            run_time: Duration::from_nanos(4_001 * 3_333),
            run_count: 4_001,
        },
        reader: ReaderTotals {
            records: 100_000,
            bytes: n(),
            decode_errors: n(),
            process_events: 777,
        },
        probes: ProbeTotals {
            process: n(),
            thread: n(),
            derived: n(),
            content: n(),
        },
        walks: WalkStats {
            walks: 10_000,
            outermost: 7_000,
            stitched: 2_000,
            truncated: 2_500,
            kernel_ticks_unplaced: n(),
            jit_walks: n(),
            jit_outermost: n(),
            early_ends: EarlyEnds {
                unmapped: n(),
                no_unwind_info: n(),
                unsupported: n(),
                stack_switch: n(),
                corrupt: n(),
                depth_limit: n(),
                table_pending: n(),
            },
            by_binary: vec![(
                Arc::from("busy"),
                WalkEnds {
                    walks: 10_000,
                    outermost: 7_000,
                    stitched: 2_000,
                    truncated: 2_500,
                },
            )],
            plans: PlanStats {
                plans_learned: n(),
                deep_plans_learned: n(),
                learn_failed: n(),
                learn_too_late: n(),
                learn_throttled: n(),
                copy_updates: n(),
                tops_written: n(),
                tops_dropped: n(),
                tops_evicted: n(),
                thread_plans: n() as usize,
                thread_deep_plans: n() as usize,
                truncated_by: TruncatedBy {
                    short_copy: n(),
                    ceiling: n(),
                    stack_top: n(),
                    stale_tail: n(),
                    deep_copy: n(),
                    faulted: n(),
                },
                deep_programs_remembered: n(),
                deep_programs_refused: n(),
            },
            state_resets: n(),
            processes_replaced: n(),
            tables_compiled: n(),
            tables_from_disk: n(),
            tables_failed: n(),
            tables_evicted: n(),
            table_cache_hits: n(),
            table_pending: n(),
            rules_read_directly: n(),
            samples_queued: n(),
            queue_full: n(),
        },
        mapping_feed: FeedStats {
            open: true,
            forks: n(),
            execs: n(),
            mmaps: n(),
            lost: n(),
            malformed: n(),
            resyncs: n(),
            applied_early: n(),
        },
        process_table: TableStats {
            lookups: n(),
            maps_reads: n(),
            rereads_rate_limited: n(),
            objects_identified: n(),
            build_ids_unverified: n(),
            object_cache_hits: n(),
            evictions: n(),
            mappings_learned: n(),
            learned_unidentified: n(),
            answered_after_exit: n(),
            reads_deferred: n(),
        },
        processes: TallyTotals {
            exited_processes: n(),
            exited_samples: n(),
            untracked_samples: n(),
        },
        aggregation: AggregateStats {
            samples: n(),
            kernel_only: n(),
            empty: n(),
            truncated: n(),
            dropped: n(),
            intervals: n(),
            distinct: n(),
            max_distinct: n(),
            files_opened: n(),
            files_failed: n(),
            labels_undescribed: n(),
            python_named: n(),
            python_stale: n(),
            python_unreadable: n(),
            python_unplaced: n(),
            python_cut: n(),
        },
        python: PythonStats {
            processes: n(),
            stacks: n(),
            paired: n(),
            code_caches_cleared: n(),
        },
        jvm: crate::run::JvmStats {
            processes: n(),
            unreadable: n(),
            blobs_read: n(),
            blob_errors: n(),
            blobs_replaced: n(),
            names_read: n(),
            name_errors: n(),
            scopes_read: n(),
            scope_errors: n(),
            caches_cleared: n(),
        },
        off_cpu: Some(crate::run::OffCpuStats {
            samples: n(),
            joined: n(),
            blocked_nanos: n(),
            weighted_blocked_nanos: n(),
            ended_by_exit: n(),
            replaced: n(),
            dropped_full: n(),
            unmatched_switch_ins: n(),
            weight_missing: n(),
            bpf_runs: 1_000,
            bpf_run_nanos: 250_000,
        }),
        jit_names: PerfMapStats {
            named: n(),
            unnamed: n(),
            lines: n(),
            malformed: n(),
            over_budget: n(),
            evicted: n(),
        },
        batches: WorkerStats {
            batches_built: n(),
            intervals_dropped: n(),
            intervals_extended: n(),
            intervals_empty: n(),
            samples_in_batches: n(),
            build_micros_last: n(),
            build_micros_max: n(),
            build_micros_total: n(),
            heap_trims: n(),
            last_batch_bytes: n(),
            last_batch_locations: n(),
            last_batch_stacks: n(),
            last_batch_samples: n(),
            symbolize: SymbolizeStats {
                cache_hits: n(),
                cache_misses: n(),
                named: n(),
                no_symbol: n(),
                errors: n(),
                debug_files: n(),
                go_named: n(),
                left_to_collector: n(),
                deferred: n(),
                kernel_named: n(),
                kernel_unnamed: n(),
                kernel_reloads: n(),
                objects_opened: n(),
                objects_evicted: n(),
                rebuilds: n(),
                panics: n(),
                kernel_symbols: n(),
            },
        },
        handoffs: crate::run::HandoffTotals {
            commands_dropped: n(),
            reports_dropped: n(),
            jobs_dropped: n(),
        },
        export: Some(ExportStats {
            batches_sent: 40_000,
            samples_sent: n(),
            batches_duplicate: 3_000,
            batches_dropped_queue_full: n(),
            samples_dropped_queue_full: n(),
            batches_rejected: n(),
            samples_rejected: n(),
            retries: n(),
            queued_batches: n(),
            queued_bytes: n(),
            queued_samples: n(),
            last_error: Some("Unavailable: down".into()),
        }),
        uploads: Some(UploadStats {
            uploaded: n(),
            uploaded_bytes: n(),
            already_stored: n(),
            without_symbols: n(),
            failed: n(),
            queue_full: n(),
        }),
        process: ProcessUsage {
            cpu_seconds: Some(0.75),
            resident_bytes: Some(48 << 20),
            peak_resident_bytes: Some(50 << 20),
        },
        state: vec![StateSize::entries("processes", 7, Some(4096))],
        wakeups: crate::run::WakeupTotals {
            wakeups: std::array::from_fn(|_| n()),
            cpu_seconds: std::array::from_fn(|_| n() as f64 / 1e3),
        },
    }
}

/// A finished run's summary with `totals`' figures, one busy process and
/// the binary of its walks.
pub(crate) fn summary_of(totals: &RunTotals) -> RunSummary {
    let mut spinner = Counted::default();
    for _ in 0..3 {
        spinner.add(|| "spinner".into());
    }
    let mut tally = ProcessTally::with_capacity(4);
    tally.keep(42, &spinner);
    RunSummary {
        tally,
        reader: totals.reader,
        kernel: totals.kernel,
        program: totals.program,
        unwinding: WalkStats {
            by_binary: vec![(
                Arc::from("busy"),
                WalkEnds {
                    walks: 10,
                    outermost: 7,
                    stitched: 2,
                    truncated: 2,
                },
            )],
            ..totals.walks.clone()
        },
        aggregation: totals.aggregation,
        jit_names: totals.jit_names,
        python: totals.python,
        jvm: totals.jvm,
        off_cpu: totals.off_cpu,
        mapping_feed: totals.mapping_feed,
        process_table: totals.process_table,
        batches: totals.batches,
        probes: totals.probes,
        handoffs: totals.handoffs,
        wakeups: totals.wakeups,
        elapsed: totals.elapsed,
    }
}

#[derive(Debug)]
struct Published(RunTotals);

impl Collector for Published {
    fn encode(&self, encoder: DescriptorEncoder<'_>) -> fmt::Result {
        write_metrics(&self.0, &mut ConstMetrics::new(encoder))
    }
}

/// `/metrics` as the agent serves it, for `totals`.
pub(crate) fn metrics_text(totals: &RunTotals) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(stackscope_telemetry::ProcessMetrics));
    registry
        .sub_registry_with_prefix("stackscope_agent")
        .register_collector(Box::new(Published(totals.clone())));
    let mut text = String::new();
    stackscope_telemetry::prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    text
}

/// The value of the series `name{labels}` in OpenMetrics `text`.
fn metric_value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|value| value.parse().ok())
}

fn series_name(stat: &Stat, series: &Series) -> String {
    match stat.label {
        Some(label) => format!(
            "{}{{{label}=\"{}\"}}",
            DESCRIPTION.metric_name(stat),
            series.label
        ),
        None => DESCRIPTION.metric_name(stat),
    }
}

#[test]
fn every_statistic_is_in_metrics_with_its_value() {
    let totals = every_figure_distinct();
    let text = metrics_text(&totals);
    for (_, stat) in DESCRIPTION.all() {
        for series in stat.series {
            let name = series_name(stat, series);
            let found = metric_value(&text, &name);
            match stat.shown {
                Shown::Everywhere => {
                    let value = (series.read)(&totals).as_f64().unwrap();
                    let factor = stat.metric_unit().1;
                    let found = found.unwrap_or_else(|| panic!("{name} missing:\n{text}"));
                    assert!(
                        (found - value * factor).abs() <= 1e-9 * value.abs().max(1.0),
                        "{name}: {found}, not {value} x {factor}"
                    );
                }
                // The process's own figures, not the totals'.
                Shown::ProcessMetrics => {
                    assert!(found.is_some(), "{name} missing:\n{text}")
                }
                Shown::Reports => assert!(found.is_none(), "{name} is a report's only"),
            }
        }
    }
    // And the state sizes after them.
    assert!(
        text.lines()
            .any(|l| l == "stackscope_agent_state_entries{state=\"processes\"} 7.0"),
        "{text}"
    );
}

#[test]
fn every_statistic_is_in_the_json_report_at_its_pointer() {
    let totals = every_figure_distinct();
    let report = DESCRIPTION.json(&totals);
    for (_, stat) in DESCRIPTION.all() {
        for series in stat.series {
            let value = (series.read)(&totals);
            assert_ne!(value, Value::Unknown, "{}", series.json);
            assert_eq!(
                report.pointer(series.json),
                Some(&value.json()),
                "{} of {}",
                series.json,
                stat.name
            );
        }
    }
}

#[test]
fn every_statistic_is_in_the_text_report() {
    let totals = every_figure_distinct();
    let mut text = Vec::new();
    DESCRIPTION.write_text(&totals, &mut text).unwrap();
    let text = String::from_utf8(text).unwrap();
    for (group, stat) in DESCRIPTION.all() {
        assert!(text.lines().any(|l| l == group.title), "{}", group.title);
        let line = text
            .lines()
            .find(|l| l.split_whitespace().next() == Some(stat.name))
            .unwrap_or_else(|| panic!("no line for {}:\n{text}", stat.name));
        for series in stat.series {
            let value = stat.format((series.read)(&totals));
            let shown = match stat.label {
                Some(_) => format!("{} {value}", series.label),
                None => value,
            };
            assert!(line.contains(&shown), "{shown:?} not in {line:?}");
        }
    }
}

#[test]
fn each_series_reads_its_own_figure() {
    let totals = every_figure_distinct();
    let mut seen: HashMap<u64, &str> = HashMap::new();
    for (_, stat) in DESCRIPTION.all() {
        for series in stat.series {
            let Value::Int(n) = (series.read)(&totals) else {
                continue;
            };
            if let Some(other) = seen.insert(n, series.json) {
                // One figure shown twice (ticks and samples_lost share
                // the ring buffer's losses) is one pointer.
                assert_eq!(other, series.json, "both read {n}");
            }
        }
    }
}

#[test]
fn names_and_pointers_are_unique_and_well_formed() {
    let mut names = HashMap::new();
    let mut pointers: HashMap<&str, &str> = HashMap::new();
    for (group, stat) in DESCRIPTION.all() {
        assert!(
            names
                .insert(DESCRIPTION.metric_name(stat), group.title)
                .is_none(),
            "{} twice",
            stat.name
        );
        assert!(
            stat.name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
            "{}",
            stat.name
        );
        assert!(stat.help.ends_with('.'), "{}: {}", stat.name, stat.help);
        assert_eq!(stat.label.is_some(), stat.series.len() > 1, "{}", stat.name);
        for series in stat.series {
            assert!(series.json.starts_with('/'), "{}", series.json);
            if let Some(root) = group.json {
                assert!(series.json.starts_with(root), "{} in {root}", series.json);
            }
            // The same pointer only for the same figure.
            if let Some(other) = pointers.insert(series.json, stat.name) {
                assert_eq!(
                    (series.json, other),
                    ("/kernel/ring_buffer_full", "ticks"),
                    "{}",
                    stat.name
                );
            }
        }
    }
}

/// Series every `/metrics` reader (dashboards, `xtask`, `tests/`) had
/// before the statistics were described once: none may go or change.
const METRIC_SERIES: &[&str] = &[
    "stackscope_agent_ticks_total{outcome=\"sampled\"}",
    "stackscope_agent_ticks_total{outcome=\"idle\"}",
    "stackscope_agent_ticks_total{outcome=\"filtered\"}",
    "stackscope_agent_ticks_total{outcome=\"budgeted\"}",
    "stackscope_agent_ticks_total{outcome=\"ring_buffer_full\"}",
    "stackscope_agent_samples_lost_total{cause=\"ring_buffer_full\"}",
    "stackscope_agent_samples_lost_total{cause=\"decode_error\"}",
    "stackscope_agent_stack_copy_failures_total",
    "stackscope_agent_samples_read_total",
    "stackscope_agent_hash_probes_total{kind=\"process\"}",
    "stackscope_agent_hash_probes_total{kind=\"thread\"}",
    "stackscope_agent_hash_probes_total{kind=\"derived\"}",
    "stackscope_agent_hash_probes_total{kind=\"content\"}",
    "stackscope_agent_stack_bytes_copied_total",
    "stackscope_agent_deep_copies_total",
    "stackscope_agent_deep_copy_fallbacks_total",
    "stackscope_agent_direct_copy_fallbacks_total",
    "stackscope_agent_bad_area_records_total",
    "stackscope_agent_early_wakeups_total",
    "stackscope_agent_walks_total{end=\"root\"}",
    "stackscope_agent_walks_total{end=\"stitched\"}",
    "stackscope_agent_walks_total{end=\"truncated\"}",
    "stackscope_agent_walks_total{end=\"other\"}",
    "stackscope_agent_jit_walks_total",
    "stackscope_agent_unwind_tables_total{source=\"compiled\"}",
    "stackscope_agent_unwind_tables_total{source=\"disk\"}",
    "stackscope_agent_unwind_tables_total{source=\"failed\"}",
    "stackscope_agent_table_queue_full_total",
    "stackscope_agent_state_resets_total",
    "stackscope_agent_batches_built_total",
    "stackscope_agent_intervals_dropped_total",
    "stackscope_agent_intervals_extended_total",
    "stackscope_agent_heap_trims_total",
    "stackscope_agent_last_batch_bytes",
    "stackscope_agent_export_batches_total{result=\"stored\"}",
    "stackscope_agent_export_batches_total{result=\"duplicate\"}",
    "stackscope_agent_export_batches_total{result=\"dropped_queue_full\"}",
    "stackscope_agent_export_batches_total{result=\"rejected\"}",
    "stackscope_agent_export_samples_total{result=\"sent\"}",
    "stackscope_agent_export_samples_total{result=\"dropped_queue_full\"}",
    "stackscope_agent_export_samples_total{result=\"rejected\"}",
    "stackscope_agent_export_retries_total",
    "stackscope_agent_export_queue_bytes",
    "stackscope_agent_export_queue_batches",
    "stackscope_agent_state_entries{state=\"processes\"}",
    "stackscope_agent_state_max_entries{state=\"processes\"}",
    "process_resident_memory_bytes",
    "process_peak_resident_memory_bytes",
    "process_cpu_seconds_total",
];

#[test]
fn metrics_keep_every_series_they_had() {
    let text = metrics_text(&every_figure_distinct());
    for series in METRIC_SERIES {
        assert!(
            metric_value(&text, series).is_some(),
            "{series} missing:\n{text}"
        );
    }
}

#[test]
fn a_run_without_an_exporter_or_uploads_leaves_them_out_of_metrics() {
    let text = metrics_text(&RunTotals {
        export: None,
        uploads: None,
        ..every_figure_distinct()
    });
    assert!(!text.contains("export_"), "{text}");
    assert!(!text.contains("debuginfo_"), "{text}");
    assert!(text.contains("stackscope_agent_walks_total"), "{text}");
}

/// Every field of the stages' serializable counters, by the JSON object
/// the report keeps it in: a field added to one of them without a
/// description fails here.
#[test]
fn every_counted_field_is_described() {
    let totals = every_figure_distinct();
    let report = DESCRIPTION.json(&totals);
    let sections: [(&str, serde_json::Value); 11] = [
        ("/kernel", serde_json::to_value(totals.kernel).unwrap()),
        ("/reader", serde_json::to_value(totals.reader).unwrap()),
        (
            "/probes/by_kind",
            serde_json::to_value(totals.probes).unwrap(),
        ),
        (
            "/unwinding/early_ends",
            serde_json::to_value(totals.walks.early_ends).unwrap(),
        ),
        (
            "/unwinding/plans",
            serde_json::to_value(totals.walks.plans).unwrap(),
        ),
        (
            "/mapping_feed",
            serde_json::to_value(totals.mapping_feed).unwrap(),
        ),
        (
            "/aggregation",
            serde_json::to_value(totals.aggregation).unwrap(),
        ),
        (
            "/jit_names",
            serde_json::to_value(totals.jit_names).unwrap(),
        ),
        (
            "/symbolization/counts",
            serde_json::to_value(totals.batches.symbolize).unwrap(),
        ),
        ("/export", serde_json::to_value(&totals.export).unwrap()),
        (
            "/debuginfo_upload",
            serde_json::to_value(totals.uploads).unwrap(),
        ),
    ];
    for (section, fields) in sections {
        for (field, value) in fields.as_object().unwrap() {
            // Not a count: the report adds it as it is.
            if field == "last_error" {
                continue;
            }
            let pointer = format!("{section}/{field}");
            assert_eq!(
                report.pointer(&pointer),
                Some(value),
                "{pointer} is not described (stats/described.rs)"
            );
        }
    }
}

/// Each of the sampling thread's figures by cause has one series per
/// cause, each reading its own.
#[test]
fn the_sampling_threads_figures_have_a_series_for_every_cause() {
    let totals = every_figure_distinct();
    for (name, figures) in [
        (
            "sampling_thread_wakeups",
            totals.wakeups.wakeups.map(Value::from),
        ),
        (
            "sampling_thread_cpu",
            totals.wakeups.cpu_seconds.map(Value::from),
        ),
    ] {
        let (_, stat) = DESCRIPTION
            .all()
            .find(|(_, stat)| stat.name == name)
            .expect("described");
        let read: Vec<Value> = stat.series.iter().map(|s| (s.read)(&totals)).collect();
        assert_eq!(read, figures.to_vec(), "{name}");
    }
}
