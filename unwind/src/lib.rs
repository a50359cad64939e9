//! User-stack unwinding for x86_64 Linux programs built without frame pointers.
//!
//! This crate owns three things:
//!
//! - [`table`]: compiling a binary's call frame information (`.eh_frame`, or
//!   `.debug_frame`, compressed or not, when there is no `.eh_frame`), and
//!   for a Go binary the Go runtime's function table (`.gopclntab`), into a
//!   compact, sorted [`UnwindTable`] of 8-byte rows, and persisting it in a
//!   versioned, checksummed on-disk format.
//! - [`unwinder`]: walking one sample (`rip`/`rsp`/`rbp` plus a copy of the
//!   stack bytes at `rsp`) with those tables into a list of return addresses,
//!   ending every walk with an explicit [`UnwindEnd`] reason.
//! - [`walker`]: the agent's stack walker, which applies both to samples:
//!   the modules each process's walks touched, tables by object identity
//!   (compile pool, bounded memory cache, on-disk cache), frames placed in
//!   their objects, walk statistics, and the copy planner ([`walker::stitching`])
//!   that learns how much of each thread's stack the sampler should read.
//!
//! [`table`] and [`unwinder`] do not own finding binaries, parsing
//! `/proc/<pid>/maps`, computing load biases, caching tables by build-id, or
//! symbolization: callers provide the address-to-module mapping through
//! [`ModuleLookup`] and turn the returned absolute addresses into whatever
//! they ship. The walker is such a caller: it finds modules through
//! `stackscope-process-table`. Neither loads BPF programs nor decodes their
//! records (`stackscope-sampler`), nor names frames (`stackscope-symbolize`).

pub mod table;
pub mod unwinder;
pub mod walker;

pub use table::{
    CacheError, CfiSection, MAX_DECOMPRESSED_BYTES, TableError, UnsupportedCfi, UnwindRule,
    UnwindTable,
};
pub use unwinder::{
    DEFAULT_MAX_DEPTH, ModuleAt, ModuleLookup, RULE_CACHE_SLOTS, Registers, RuleCache, RuntimeCode,
    RuntimeStep, SampledStack, StackMemory, TailSpan, UnwindEnd, unwind, unwind_cached,
    unwind_memory,
};
