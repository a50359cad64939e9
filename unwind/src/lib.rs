//! User-stack unwinding for x86_64 Linux programs built without frame pointers.
//!
//! This crate owns two things:
//!
//! - [`table`]: compiling a binary's call frame information (`.eh_frame`, or
//!   `.debug_frame`, compressed or not, when there is no `.eh_frame`), and
//!   for a Go binary the Go runtime's function table (`.gopclntab`), into a
//!   compact, sorted [`UnwindTable`] of 8-byte rows, and persisting it in a
//!   versioned, checksummed on-disk format.
//! - [`unwinder`]: walking one sample (`rip`/`rsp`/`rbp` plus a copy of the
//!   stack bytes at `rsp`) with those tables into a list of return addresses,
//!   ending every walk with an explicit [`UnwindEnd`] reason.
//!
//! It does not own finding binaries, parsing `/proc/<pid>/maps`, computing
//! load biases, caching tables by build-id, or symbolization: callers provide
//! the address-to-module mapping through [`ModuleLookup`] and turn the
//! returned absolute addresses into whatever they ship.

pub mod table;
pub mod unwinder;

pub use table::{
    CacheError, CfiSection, MAX_DECOMPRESSED_BYTES, TableError, UnsupportedCfi, UnwindRule,
    UnwindTable,
};
pub use unwinder::{
    DEFAULT_MAX_DEPTH, ModuleAt, ModuleLookup, RULE_CACHE_SLOTS, Registers, RuleCache,
    SampledStack, StackMemory, TailSpan, UnwindEnd, unwind, unwind_cached, unwind_memory,
};
