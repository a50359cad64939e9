//! The report printed when the agent stops (`--json`, or text): the
//! described statistics ([`super::DESCRIPTION`]: JSON and text) over the
//! whole run, plus what is not a count: the walks per binary, the busiest
//! processes and the export's last error.

use std::io;

use serde_json::json;
use stackscope_telemetry::ProcessUsage;

use super::RunTotals;
use crate::{
    export::{ExportStats, debuginfo::UploadStats},
    run::RunSummary,
    status::StatusLine,
};

/// The JSON report; `top` processes are listed.
pub fn json(
    summary: &RunSummary,
    exported: Option<&ExportStats>,
    uploaded: Option<&UploadStats>,
    top: usize,
) -> serde_json::Value {
    json_of(
        &RunTotals::of_run(summary, exported, uploaded),
        summary,
        top,
    )
}

fn json_of(totals: &RunTotals, summary: &RunSummary, top: usize) -> serde_json::Value {
    let mut report = super::DESCRIPTION.json(totals);
    report["unwinding"]["by_binary"] = summary
        .unwinding
        .binaries()
        .map(|(name, ends)| {
            json!({
                "binary": name,
                "walks": ends.walks,
                "outermost": ends.outermost,
                "stitched": ends.stitched,
                "truncated": ends.truncated,
            })
        })
        .collect();
    report["top"] = json!(summary.tally.top(top));
    if let Some(export) = &totals.export {
        report["export"]["last_error"] = json!(export.last_error);
    }
    report
}

/// The text report: the status line's figures over the whole run, every
/// statistic by group, then the walks of the `top` binaries and the `top`
/// processes.
pub fn write_text(
    out: &mut impl io::Write,
    summary: &RunSummary,
    exported: Option<&ExportStats>,
    uploaded: Option<&UploadStats>,
    top: usize,
) -> io::Result<()> {
    write_text_of(
        out,
        &RunTotals::of_run(summary, exported, uploaded),
        summary,
        top,
    )
}

fn write_text_of(
    out: &mut impl io::Write,
    totals: &RunTotals,
    summary: &RunSummary,
    top: usize,
) -> io::Result<()> {
    // From the start: nothing counted, no CPU spent.
    let start = RunTotals {
        process: ProcessUsage {
            cpu_seconds: Some(0.0),
            ..ProcessUsage::default()
        },
        ..RunTotals::default()
    };
    writeln!(
        out,
        "{:.1}s: {}",
        totals.elapsed.as_secs_f64(),
        StatusLine::between(&start, totals, totals.elapsed)
    )?;
    super::DESCRIPTION.write_text(totals, out)?;
    if let Some(error) = totals.export.as_ref().and_then(|e| e.last_error.as_ref()) {
        writeln!(out, "last export error: {error}")?;
    }

    let mut by_binary: Vec<_> = summary.unwinding.binaries().collect();
    by_binary.sort_by(|a, b| b.1.walks.cmp(&a.1.walks).then(a.0.cmp(b.0)));
    if !by_binary.is_empty() {
        writeln!(
            out,
            "{:>9}  {:>6}  {:>8}  {:>9}  BINARY (of the sampled instruction)",
            "STACKS", "ROOT", "STITCHED", "TRUNCATED"
        )?;
    }
    for (binary, ends) in by_binary.into_iter().take(top) {
        writeln!(
            out,
            "{:>9}  {:>5.1}%  {:>7.1}%  {:>8.1}%  {binary}",
            ends.walks,
            ends.outermost_percent(),
            ends.stitched_percent(),
            ends.truncated_percent(),
        )?;
    }
    let total = summary.tally.total();
    if total == 0 {
        return Ok(());
    }
    writeln!(out, "{:>9}  {:>6}  {:>8}  COMM", "SAMPLES", "SHARE", "PID")?;
    for process in summary.tally.top(top) {
        writeln!(
            out,
            "{:>9}  {:>5.1}%  {:>8}  {}",
            process.samples,
            100.0 * process.samples as f64 / total as f64,
            process.tgid,
            process.comm
        )?;
    }
    if summary.tally.other() > 0 {
        writeln!(
            out,
            "{:>9}  (processes beyond the tracking limit)",
            summary.tally.other()
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::tests::{every_figure_distinct, summary_of};

    /// Every pointer into the JSON report that the benches, the tests and
    /// the report before the statistics were described once had: none may
    /// go (`xtask/src/*.rs` and `tests/` read them).
    const POINTERS: &[&str] = &[
        "/elapsed_secs",
        "/reader/records",
        "/reader/bytes",
        "/reader/decode_errors",
        "/reader/process_events",
        "/kernel/samples",
        "/kernel/ring_buffer_full",
        "/kernel/copy_failed",
        "/kernel/address_space_gone",
        "/kernel/filtered",
        "/kernel/idle",
        "/kernel/budgeted",
        "/kernel/user_stack_bytes",
        "/kernel/tail_spans",
        "/kernel/deep_copies",
        "/kernel/deep_copies_with_holes",
        "/kernel/deep_copy_fallbacks",
        "/kernel/early_wakeups",
        "/kernel/direct_copy_fallbacks",
        "/bpf/run_count",
        "/bpf/ns_per_run",
        "/unwinding/walks",
        "/unwinding/outermost",
        "/unwinding/stitched",
        "/unwinding/truncated",
        "/unwinding/early_ends/unmapped",
        "/unwinding/early_ends/no_unwind_info",
        "/unwinding/early_ends/unsupported",
        "/unwinding/early_ends/stack_switch",
        "/unwinding/early_ends/corrupt",
        "/unwinding/early_ends/depth_limit",
        "/unwinding/early_ends/table_pending",
        "/unwinding/plans/plans_learned",
        "/unwinding/plans/deep_plans_learned",
        "/unwinding/plans/learn_failed",
        "/unwinding/plans/learn_too_late",
        "/unwinding/plans/learn_throttled",
        "/unwinding/plans/copy_updates",
        "/unwinding/plans/tops_written",
        "/unwinding/plans/tops_dropped",
        "/unwinding/plans/tops_evicted",
        "/unwinding/plans/truncated_by/short_copy",
        "/unwinding/plans/truncated_by/ceiling",
        "/unwinding/plans/truncated_by/stack_top",
        "/unwinding/plans/truncated_by/stale_tail",
        "/unwinding/plans/truncated_by/deep_copy",
        "/unwinding/plans/truncated_by/faulted",
        "/unwinding/plans/deep_programs_remembered",
        "/unwinding/plans/deep_programs_refused",
        "/unwinding/plans/thread_plans",
        "/unwinding/plans/thread_deep_plans",
        "/unwinding/state_resets",
        "/unwinding/processes_replaced",
        "/unwinding/tables_compiled",
        "/unwinding/tables_from_disk",
        "/unwinding/table_cache_hits",
        "/unwinding/samples_queued",
        "/unwinding/queue_full",
        "/unwinding/table_pending",
        "/unwinding/rules_read_directly",
        "/unwinding/tables_failed",
        "/unwinding/kernel_ticks_unplaced",
        "/unwinding/jit_walks",
        "/unwinding/jit_outermost",
        "/unwinding/by_binary/0/binary",
        "/unwinding/by_binary/0/walks",
        "/unwinding/by_binary/0/outermost",
        "/unwinding/by_binary/0/stitched",
        "/unwinding/by_binary/0/truncated",
        "/probes/by_kind/process",
        "/probes/by_kind/thread",
        "/probes/by_kind/derived",
        "/probes/by_kind/content",
        "/probes/per_sample",
        "/aggregation/samples",
        "/aggregation/kernel_only",
        "/aggregation/empty",
        "/aggregation/truncated",
        "/aggregation/dropped",
        "/aggregation/intervals",
        "/aggregation/distinct",
        "/aggregation/max_distinct",
        "/aggregation/files_opened",
        "/aggregation/files_failed",
        "/aggregation/labels_undescribed",
        "/jit_names/named",
        "/jit_names/unnamed",
        "/jit_names/lines",
        "/jit_names/malformed",
        "/jit_names/over_budget",
        "/jit_names/evicted",
        "/mapping_feed/open",
        "/mapping_feed/forks",
        "/mapping_feed/execs",
        "/mapping_feed/mmaps",
        "/mapping_feed/lost",
        "/mapping_feed/malformed",
        "/mapping_feed/resyncs",
        "/mapping_feed/applied_early",
        "/exited_processes",
        "/exited_samples",
        "/process_table/maps_reads",
        "/process_table/reads_deferred",
        "/process_table/mappings_learned",
        "/process_table/learned_unidentified",
        "/process_table/answered_after_exit",
        "/process_table/objects_identified",
        "/process_table/build_ids_unverified",
        "/batches/built",
        "/batches/intervals_dropped",
        "/batches/intervals_extended",
        "/batches/intervals_empty",
        "/batches/samples",
        "/batches/build_micros_last",
        "/batches/build_micros_max",
        "/batches/build_micros_total",
        "/batches/last_batch_bytes",
        "/batches/last_batch_locations",
        "/batches/last_batch_stacks",
        "/batches/last_batch_samples",
        "/batches/heap_trims",
        "/symbolization/cache_hit_percent",
        "/symbolization/counts/cache_hits",
        "/symbolization/counts/cache_misses",
        "/symbolization/counts/named",
        "/symbolization/counts/no_symbol",
        "/symbolization/counts/errors",
        "/symbolization/counts/debug_files",
        "/symbolization/counts/go_named",
        "/symbolization/counts/left_to_collector",
        "/symbolization/counts/deferred",
        "/symbolization/counts/kernel_named",
        "/symbolization/counts/kernel_unnamed",
        "/symbolization/counts/kernel_reloads",
        "/symbolization/counts/objects_opened",
        "/symbolization/counts/rebuilds",
        "/symbolization/counts/panics",
        "/symbolization/counts/kernel_symbols",
        "/export/batches_sent",
        "/export/samples_sent",
        "/export/batches_duplicate",
        "/export/batches_dropped_queue_full",
        "/export/samples_dropped_queue_full",
        "/export/batches_rejected",
        "/export/samples_rejected",
        "/export/retries",
        "/export/queued_batches",
        "/export/queued_bytes",
        "/export/queued_samples",
        "/export/last_error",
        "/debuginfo_upload/uploaded",
        "/debuginfo_upload/uploaded_bytes",
        "/debuginfo_upload/already_stored",
        "/debuginfo_upload/without_symbols",
        "/debuginfo_upload/failed",
        "/debuginfo_upload/queue_full",
        "/top/0/tgid",
        "/top/0/comm",
        "/top/0/samples",
        "/top/0/exited",
        "/other",
    ];

    #[test]
    fn the_json_report_keeps_every_pointer_it_had() {
        let totals = every_figure_distinct();
        let summary = summary_of(&totals);
        let report = json_of(&totals, &summary, 5);
        let missing: Vec<_> = POINTERS
            .iter()
            .filter(|pointer| report.pointer(pointer).is_none())
            .collect();
        assert!(missing.is_empty(), "{missing:?} missing from {report:#}");
        // Figures are numbers where they were.
        assert_eq!(report["kernel"]["samples"], 1);
        assert_eq!(report["unwinding"]["by_binary"][0]["binary"], "busy");
        assert_eq!(report["top"][0]["samples"], 3);
        assert_eq!(report["export"]["last_error"], "Unavailable: down");
        assert!(report["bpf"]["ns_per_run"].as_u64().is_some(), "{report}");
        assert!(report["mapping_feed"]["open"].is_boolean(), "{report}");
    }

    #[test]
    fn without_an_exporter_or_uploads_their_sections_are_null() {
        let totals = RunTotals::default();
        let summary = summary_of(&totals);
        let report = json_of(&totals, &summary, 5);
        assert_eq!(report["export"], serde_json::Value::Null, "{report}");
        assert_eq!(report["debuginfo_upload"], serde_json::Value::Null);
        assert_eq!(report["bpf"]["ns_per_run"], serde_json::Value::Null);
        let mut text = Vec::new();
        write_text_of(&mut text, &totals, &summary, 5).unwrap();
        let text = String::from_utf8(text).unwrap();
        assert!(!text.contains("export"), "{text}");
    }

    #[test]
    fn the_text_report_opens_with_the_run_and_lists_the_tables() {
        let totals = every_figure_distinct();
        let summary = summary_of(&totals);
        let mut text = Vec::new();
        write_text_of(&mut text, &totals, &summary, 5).unwrap();
        let text = String::from_utf8(text).unwrap();
        let first = text.lines().next().unwrap();
        assert!(first.starts_with("1.5s: "), "{text}");
        // 0.75 s of CPU in 1.5 s.
        assert!(first.contains(" samples/s, "), "{text}");
        assert!(first.contains(", CPU 50.0%, RSS 48.0 MiB"), "{text}");
        assert!(
            text.contains("last export error: Unavailable: down\n"),
            "{text}"
        );
        assert!(text.contains("  busy\n"), "{text}");
        assert!(text.contains("  spinner\n"), "{text}");
    }
}
