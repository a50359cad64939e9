//! The agent's Prometheus metrics: what the sampling thread counts (its
//! totals asked for and published every few seconds, [`AgentMetrics::publish`]) and what the exporter
//! counts (read at scrape time), written out at every scrape of `/metrics`
//! as [`crate::stats`] describes them. Serving them, the process metrics
//! and the health endpoints belong to `stackscope-telemetry`.

use std::{
    fmt,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use stackscope_telemetry::{
    ConstMetrics, Health,
    prometheus_client::{
        collector::Collector,
        encoding::DescriptorEncoder,
        registry::{Registry, Unit},
    },
};

use crate::{export::ExportStatsReader, memory::MemoryBudget, stats::RunTotals};

/// Health probes fail when the sampling thread has not answered for this
/// long.
pub const STALE_AFTER: Duration = Duration::from_secs(30);

/// How often the sampling thread's totals are published and beaten on:
/// well within a scrape interval (15-60 s) and [`STALE_AFTER`]. The
/// sampling thread sends them at its first wake-up from a fifth before
/// this after the last (it wakes at least every 5 s, its longest drain
/// period: they come 4-9 s apart), so a publish wakes it for nothing;
/// asked for by a timer, they were a fifth of an idle sampling thread's
/// wake-ups. Each reads a score of BPF maps.
pub const PUBLISH_EVERY: Duration = Duration::from_secs(5);

/// What the metrics endpoint reads; shared between the run, the
/// exporter's owner and the HTTP server.
#[derive(Debug, Default)]
pub struct AgentMetrics {
    run: Mutex<RunTotals>,
    export: Mutex<Option<ExportStatsReader>>,
    memory: Mutex<Option<MemoryBudget>>,
}

/// What the agent hands the run when metrics are served.
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

    /// The memory budget the caches' bounds come from.
    pub fn set_memory(&self, budget: MemoryBudget) {
        *self.memory.lock().unwrap_or_else(PoisonError::into_inner) = Some(budget);
    }

    /// Where the delivery counters come from once an exporter runs.
    pub fn set_export(&self, reader: ExportStatsReader) {
        *self.export.lock().unwrap_or_else(PoisonError::into_inner) = Some(reader);
    }

    fn write(&self, out: &mut ConstMetrics<'_>) -> fmt::Result {
        let mut totals = self
            .run
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        totals.export = self
            .export
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map(ExportStatsReader::stats);
        crate::stats::write_metrics(&totals, out)?;
        if let Some(budget) = &*self.memory.lock().unwrap_or_else(PoisonError::into_inner) {
            write_memory(budget, out)?;
        }
        Ok(())
    }
}

/// The budget's limit and shares; what each cache holds is in the
/// `state_bytes` gauges, under the same names.
fn write_memory(budget: &MemoryBudget, out: &mut ConstMetrics<'_>) -> fmt::Result {
    out.gauge(
        "memory_limit",
        "Memory the agent keeps within (--memory-limit, else its cgroup's, else the default)",
        Some(Unit::Bytes),
        budget.limit as f64,
    )?;
    let shares: Vec<_> = budget
        .shares()
        .map(|(consumer, bytes)| (consumer.name(), bytes as f64))
        .collect();
    out.gauges(
        "memory_share",
        "Each cache's and queue's share of the memory limit",
        Some(Unit::Bytes),
        "state",
        &shares,
    )
}

impl Collector for AgentMetrics {
    fn encode(&self, encoder: DescriptorEncoder<'_>) -> fmt::Result {
        self.write(&mut ConstMetrics::new(encoder))
    }
}

#[cfg(test)]
mod tests {
    use stackscope_telemetry::StateSize;

    use super::*;
    use crate::status::ReaderTotals;
    use stackscope_sampler::Counters;
    use stackscope_unwind::walker::WalkStats;

    /// What a scrape of `/metrics` reads.
    fn scrape(telemetry: &AgentTelemetry) -> String {
        let mut text = String::new();
        stackscope_telemetry::prometheus_client::encoding::text::encode(
            &mut text,
            &telemetry.registry(),
        )
        .expect("encodes");
        text
    }

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
        let text = scrape(&telemetry);
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
        let text = scrape(&telemetry);
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
