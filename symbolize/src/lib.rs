//! Names of code addresses, the same on the node and in the collector: the
//! agent names frames as it ships them, the collector names what the node
//! could not at query time, and both go through this crate, so a frame
//! reads the same wherever it was named.
//!
//! Owns:
//! - blazesym's set-up and its recovery from a panic ([`Reader`]: blazesym's
//!   state is dropped and built afresh, the call is an error);
//! - turning blazesym's answers into [`Lines`]: one [`FrameLine`] per
//!   function at an address, inlined functions first, with file and line
//!   where DWARF has them, at most [`MAX_LINES`], names cut to a bound;
//! - the fallback for Go binaries stripped of symbols: the addresses
//!   blazesym leaves unnamed, named from the Go runtime's function table
//!   ([`go`], `.gopclntab`);
//! - demangling ([`demangle`]);
//! - kernel symbols from kallsyms and the kernel's build-ids ([`kernel`]);
//! - decoding jitdump files as they grow ([`jitdump`]);
//! - behind the `node` feature, naming on the node (`node`): mapped files
//!   opened through `/proc`, separate debug files found on the node, the
//!   name cache by object identity, the vDSO, perf maps read per process.
//!
//! Does not own which addresses are named or when (the agent's batch
//! builder, the collector's queries), nor where the collector's files come
//! from (its debuginfo store and debuginfod). Nor the wire format or the profile model: callers turn
//! [`Lines`] into their own frames.

pub mod demangle;
pub mod go;
pub mod jitdump;
pub mod kernel;
#[cfg(feature = "node")]
pub mod node;
mod reader;

use std::sync::Arc;

pub use blazesym;
pub use demangle::demangle;
pub use reader::{ReadError, Reader, ReaderOptions};

/// Functions kept per address: inlining deeper than this keeps the
/// innermost functions and the one that holds the code.
pub const MAX_LINES: usize = 64;

/// One name of a frame: a function, and where in its source the address is.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FrameLine {
    /// Demangled (see [`demangle`]).
    pub function: Box<str>,
    /// The source file, or empty when unknown.
    pub file: Box<str>,
    /// 0 when unknown.
    pub line: u32,
}

/// The names found for one address, innermost (inlined) function first and
/// the function that holds the code last; empty when none was found.
pub type Lines = Arc<[FrameLine]>;

/// `text` cut to at most `max` bytes, on a character boundary.
pub fn truncate_str(text: &str, max: usize) -> &str {
    &text[..text.floor_char_boundary(max)]
}
