//! The stackscope node agent: the run and its threads, aggregation,
//! export and the agent's statistics. What a sample passes through before
//! and beside these lives in crates of its own, one job each (see
//! `shared/DESIGN.md`).
//!
//! `stackscope_metadata::selection` turns the user's selections
//! (containers, pods, cgroups, budgets) into the BPF program's cgroup
//! policies, again while running. Then data flows in this order:
//! `stackscope_sampler` loads the BPF program, reads the ring buffer's
//! records and decodes them; the walker (`stackscope_unwind::walker`)
//! turns each sample's copied stack into frames, each placed in its object
//! at its file offset; `stackscope_telemetry::tally` counts samples per
//! process; [`aggregate`]
//! labels each sample (its container from `stackscope_metadata`), sums
//! identical (labels, stack) pairs per interval and builds one
//! `stackscope.v1.Batch` per interval, naming frames with
//! `stackscope_symbolize::node`; [`export`] ships the batches; and [`run`]
//! drives the loop, prints the periodic [`status`] line and stops on a
//! signal or after a duration. [`memory`] splits the agent's memory limit
//! among its caches and queues. [`stats`] describes once what the loop, the
//! exporter and the uploader count; [`metrics`] serves it to Prometheus,
//! the status line and the final report render it too.

pub mod aggregate;
pub mod export;
pub mod memory;
pub mod metrics;
pub mod run;
pub mod stats;
pub mod status;
