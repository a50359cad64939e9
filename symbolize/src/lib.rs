//! Names of code addresses, the same on the node and in the collector: the
//! agent names frames as it ships them, the collector names what the node
//! could not at query time, and both go through this crate, so a frame
//! reads the same wherever it was named.
//!
//! Owns:
//! - demangling ([`demangle`]);
//! - kernel symbols from kallsyms and the kernel's build-ids ([`kernel`]);
//! - decoding jitdump files as they grow ([`jitdump`]).
//!
//! Does not own which addresses are named, when, or where the files come
//! from: the agent opens mapped files through `/proc`, finds separate debug
//! files on the node, keeps its name cache by its own object ids and
//! reads perf maps per process; the collector reads its debuginfo store
//! and debuginfod.

pub mod demangle;
pub mod jitdump;
pub mod kernel;

pub use demangle::demangle;
