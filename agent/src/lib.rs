//! The stackscope node agent.
//!
//! `stackscope_metadata::selection` turns the user's selections (containers, pods,
//! cgroups, budgets) into the BPF program's cgroup policies, through
//! its view of the cgroup2 hierarchy, again while running. Then data flows
//! through the crates and modules in this order: `stackscope_sampler` loads the BPF
//! program and yields raw ring buffer records and decodes them,
//! the walker (`stackscope_unwind::walker`) turns each sample's copied stack into frames, each placed in
//! its object at its file offset, [`tally`] counts samples per process,
//! [`aggregate`] labels each sample (its container from `stackscope_metadata`),
//! sums identical (labels, stack) pairs per interval and builds
//! one `stackscope.v1.Batch` per interval, naming frames with `stackscope_symbolize::node`,
//! [`export`] ships the batches, and [`run`] drives the loop, prints the
//! periodic [`status`] line and stops on a signal or after a duration (see
//! `shared/DESIGN.md`). [`stats`] describes once what the loop, the exporter
//! and the uploader count; [`metrics`] serves it to Prometheus, the status
//! line and the final report render it too.

pub mod aggregate;
pub mod export;
pub mod metrics;
pub mod run;
pub mod stats;
pub mod status;
pub mod tally;
