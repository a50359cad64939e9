//! The stackscope node agent.
//!
//! [`cgroups`] turns the user's selections into cgroup ids. Then data flows
//! through the modules in this order: [`sampler`] loads the BPF
//! program and yields raw ring buffer records, [`sampler::record`] decodes them,
//! [`unwinding`] turns each sample's copied stack into frames, [`tally`] counts
//! samples per process, and [`run`] drives the loop, prints the periodic
//! [`status`] line and stops on a signal or after a duration. Aggregation and
//! export arrive in later stages of the pipeline (see `shared/DESIGN.md`).

pub mod cgroups;
pub mod run;
pub mod sampler;
pub mod status;
pub mod tally;
pub mod unwinding;
