//! The agent's Prometheus metrics: what the run loop counts (published by it
//! about once a second, [`AgentMetrics::publish`]) and what the exporter
//! counts (read at scrape time), written out at every scrape of `/metrics`.
//! Serving them, the process metrics and the health endpoints belong to
//! `stackscope-telemetry`; this module only says what the agent's numbers
//! are called and mean.

use std::{
    fmt,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use stackscope_telemetry::{
    ConstMetrics, Health, StateSize,
    prometheus_client::{
        collector::Collector,
        encoding::DescriptorEncoder,
        registry::{Registry, Unit},
    },
};

use crate::{
    aggregate::WorkerStats, export::ExportStatsReader, probes::ProbeTotals, sampler::Counters,
    status::ReaderTotals, unwinding::WalkStats,
};

/// Health probes fail when the run loop has not turned for this long.
pub const STALE_AFTER: Duration = Duration::from_secs(30);

/// How often the run loop publishes its totals and beats.
pub const PUBLISH_EVERY: Duration = Duration::from_secs(1);

/// The run loop's totals at one instant.
#[derive(Debug, Clone, Default)]
pub struct RunTotals {
    pub kernel: Counters,
    pub reader: ReaderTotals,
    pub walks: WalkStats,
    pub batches: WorkerStats,
    /// Hash-table lookups made by the run loop.
    pub probes: ProbeTotals,
    /// What the agent keeps, against its bounds.
    pub state: Vec<StateSize>,
}

/// What the metrics endpoint reads; shared between the run loop, the
/// exporter's owner and the HTTP server.
#[derive(Debug, Default)]
pub struct AgentMetrics {
    run: Mutex<RunTotals>,
    export: Mutex<Option<ExportStatsReader>>,
}

/// What the agent hands the run loop when metrics are served.
#[derive(Debug, Clone)]
pub struct AgentTelemetry {
    pub metrics: Arc<AgentMetrics>,
    pub health: Arc<Health>,
}

impl AgentTelemetry {
    pub fn new() -> Self {
        Self {
            metrics: Arc::default(),
            health: Health::with_heartbeat(STALE_AFTER),
        }
    }

    /// The registry to serve: process metrics, and the agent's under
    /// `stackscope_agent_`.
    pub fn registry(&self) -> Registry {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(stackscope_telemetry::ProcessMetrics));
        registry
            .sub_registry_with_prefix("stackscope_agent")
            .register_collector(Box::new(Arc::clone(&self.metrics)));
        registry
    }
}

impl Default for AgentTelemetry {
    fn default() -> Self {
        Self::new()
    }
}

impl AgentMetrics {
    pub fn publish(&self, totals: RunTotals) {
        *self.run.lock().unwrap_or_else(PoisonError::into_inner) = totals;
    }

    /// Where the delivery counters come from once an exporter runs.
    pub fn set_export(&self, reader: ExportStatsReader) {
        *self.export.lock().unwrap_or_else(PoisonError::into_inner) = Some(reader);
    }

    fn write(&self, out: &mut ConstMetrics<'_>) -> fmt::Result {
        let run = self
            .run
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let k = &run.kernel;
        out.counters(
            "ticks",
            "Timer ticks on the CPUs, by what became of them.",
            "outcome",
            &[
                ("sampled", k.samples),
                ("idle", k.idle),
                ("filtered", k.filtered),
                ("budgeted", k.budgeted),
                ("ring_buffer_full", k.ring_buffer_full),
            ],
        )?;
        out.counters(
            "samples_lost",
            "Samples lost, by cause.",
            "cause",
            &[
                ("ring_buffer_full", k.ring_buffer_full),
                ("decode_error", run.reader.decode_errors),
            ],
        )?;
        out.counter(
            "stack_copy_failures",
            "Samples whose user stack copy read no byte.",
            k.copy_failed,
        )?;
        out.counter(
            "samples_read",
            "Sample records read from the ring buffer.",
            run.reader.records - run.reader.process_events.min(run.reader.records),
        )?;
        out.counters(
            "hash_probes",
            "Hash-table lookups of the run loop, by key: per process, per thread, \
             derived from a process (binary name, label set), or an interval's \
             dictionaries. Divided by samples_read: the lookups a sample costs.",
            "kind",
            &run.probes.by_kind(),
        )?;
        out.counter(
            "stack_bytes_copied",
            "User stack bytes the BPF program copied (copies and tails).",
            k.user_stack_bytes,
        )?;
        out.counter(
            "deep_copies",
            "Whole-stack copies of threads with a deep plan.",
            k.deep_copies,
        )?;
        out.counter(
            "deep_copy_fallbacks",
            "Ticks of deep-plan threads that fell back to the usual copy.",
            k.deep_copy_fallbacks,
        )?;
        out.counter(
            "direct_copy_fallbacks",
            "Ticks of learned threads whose copy straight into the ring buffer \
             failed (no room, or a faulting read) and took the usual copy.",
            k.direct_copy_fallbacks,
        )?;
        out.counter(
            "early_wakeups",
            "Records that woke the reader at once: ticks of threads not learned yet \
             of programs whose threads needed deep copies.",
            k.early_wakeups,
        )?;

        let w = &run.walks;
        let reached = w.outermost.min(w.walks);
        out.counters(
            "walks",
            "User stack walks, by how they ended: at the root from the copied bytes, \
             at the root through a stitched tail, out of stack bytes, or otherwise \
             (unknown code, a bad rule, the depth limit).",
            "end",
            &[
                ("root", reached - w.stitched.min(reached)),
                ("stitched", w.stitched.min(reached)),
                ("truncated", w.truncated),
                (
                    "other",
                    w.walks.saturating_sub(reached).saturating_sub(w.truncated),
                ),
            ],
        )?;
        out.counter(
            "jit_walks",
            "Walks with at least one frame in JIT code.",
            w.jit_walks,
        )?;
        out.counters(
            "unwind_tables",
            "Unwind tables made ready, by where they came from; failed: walked with frame pointers.",
            "source",
            &[
                ("compiled", w.tables_compiled),
                ("disk", w.tables_from_disk),
                ("failed", w.tables_failed),
            ],
        )?;
        out.counter(
            "table_queue_full",
            "Samples walked without waiting because the queue was full.",
            w.queue_full,
        )?;
        out.counter(
            "state_resets",
            "Times every process's state was dropped after lost exec or exit records.",
            w.state_resets,
        )?;
        // Samples waiting for tables, stack plans and every other piece of
        // state the agent keeps, with their bounds.
        out.state(&run.state)?;

        let b = &run.batches;
        out.counter(
            "batches_built",
            "Aggregated batches built.",
            b.batches_built,
        )?;
        out.counter(
            "intervals_dropped",
            "Aggregation intervals dropped because the batch builder was busy.",
            b.intervals_dropped,
        )?;
        out.counter(
            "heap_trims",
            "Times the heap's free pages were handed back to the kernel (more than 16 MiB free).",
            b.heap_trims,
        )?;
        out.gauge(
            "last_batch",
            "Encoded size of the last batch built.",
            Some(Unit::Bytes),
            b.last_batch_bytes as f64,
        )?;

        let export = self
            .export
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if let Some(export) = export {
            let e = export.stats();
            out.counters(
                "export_batches",
                "Batches leaving for the collector, by result.",
                "result",
                &[
                    ("stored", e.batches_sent.saturating_sub(e.batches_duplicate)),
                    ("duplicate", e.batches_duplicate),
                    ("dropped_queue_full", e.batches_dropped_queue_full),
                    ("rejected", e.batches_rejected),
                ],
            )?;
            out.counters(
                "export_samples",
                "Samples leaving for the collector, by result.",
                "result",
                &[
                    ("sent", e.samples_sent),
                    ("dropped_queue_full", e.samples_dropped_queue_full),
                    ("rejected", e.samples_rejected),
                ],
            )?;
            out.counter(
                "export_retries",
                "Pushes that failed transiently and were tried again.",
                e.retries,
            )?;
            out.gauge(
                "export_queue",
                "Bytes of batches not delivered yet.",
                Some(Unit::Bytes),
                e.queued_bytes as f64,
            )?;
            out.gauge(
                "export_queue_batches",
                "Batches not delivered yet.",
                None,
                e.queued_batches as f64,
            )?;
        }
        Ok(())
    }
}

impl Collector for AgentMetrics {
    fn encode(&self, encoder: DescriptorEncoder<'_>) -> fmt::Result {
        self.write(&mut ConstMetrics::new(encoder))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walk_ends_partition_the_walks() {
        let telemetry = AgentTelemetry::new();
        telemetry.metrics.publish(RunTotals {
            walks: WalkStats {
                walks: 100,
                outermost: 80,
                stitched: 30,
                truncated: 15,
                ..WalkStats::default()
            },
            kernel: Counters {
                samples: 100,
                idle: 7,
                ring_buffer_full: 3,
                ..Counters::default()
            },
            reader: ReaderTotals {
                records: 104,
                process_events: 4,
                decode_errors: 1,
                ..ReaderTotals::default()
            },
            ..RunTotals::default()
        });
        let mut text = String::new();
        stackscope_telemetry::prometheus_client::encoding::text::encode(
            &mut text,
            &telemetry.registry(),
        )
        .unwrap();
        for line in [
            "stackscope_agent_walks_total{end=\"root\"} 50",
            "stackscope_agent_walks_total{end=\"stitched\"} 30",
            "stackscope_agent_walks_total{end=\"truncated\"} 15",
            "stackscope_agent_walks_total{end=\"other\"} 5",
            "stackscope_agent_ticks_total{outcome=\"sampled\"} 100",
            "stackscope_agent_ticks_total{outcome=\"idle\"} 7",
            "stackscope_agent_samples_lost_total{cause=\"ring_buffer_full\"} 3",
            "stackscope_agent_samples_lost_total{cause=\"decode_error\"} 1",
            "stackscope_agent_samples_read_total 100",
        ] {
            assert!(text.lines().any(|l| l == line), "{line:?} missing:\n{text}");
        }
        // No exporter: no export metrics rather than zeros that look like
        // a healthy export.
        assert!(!text.contains("export_"), "{text}");
    }

    #[test]
    fn state_sizes_are_gauges_by_name_without_unknown_figures() {
        let telemetry = AgentTelemetry::new();
        telemetry.metrics.publish(RunTotals {
            state: vec![
                StateSize::entries("tables", 3, None).with_bytes(4096, Some(65536)),
                StateSize::entries("processes", 7, Some(4096)),
            ],
            ..RunTotals::default()
        });
        let mut text = String::new();
        stackscope_telemetry::prometheus_client::encoding::text::encode(
            &mut text,
            &telemetry.registry(),
        )
        .unwrap();
        let state_lines: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("stackscope_agent_state") && !l.contains("resets"))
            .collect();
        assert_eq!(
            state_lines,
            [
                "stackscope_agent_state_entries{state=\"tables\"} 3.0",
                "stackscope_agent_state_entries{state=\"processes\"} 7.0",
                "stackscope_agent_state_max_entries{state=\"processes\"} 4096.0",
                "stackscope_agent_state_bytes{state=\"tables\"} 4096.0",
                "stackscope_agent_state_max_bytes{state=\"tables\"} 65536.0",
            ],
            "{text}"
        );
        assert!(text.contains("\nprocess_resident_memory_bytes "), "{text}");
    }
}
