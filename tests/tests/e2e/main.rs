//! The end-to-end tests (root: real kernel, real processes), one module per
//! part of the product, linked into one test binary: one link step after a
//! change instead of one per file. Tests that sample, or that keep the
//! CPUs busy, take `stackscope_tests::exclusive()`.
//!
//! The kernel matrix (`cargo xtask test`'s last step) runs the `sampler`
//! and `unwinding` modules in virtual machines, filtered by module path.

mod aggregation;
mod containers;
mod debuginfo;
mod deep_stacks;
mod deploy;
mod faults;
mod go;
mod hostile;
mod jit;
mod jvm;
mod memory_limit;
mod metrics;
mod off_cpu;
mod pipeline;
mod process_identity;
mod pyroscope;
mod python;
mod sampler;
mod short_lived;
mod ui;
mod unwinding;
