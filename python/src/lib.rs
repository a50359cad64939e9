//! CPython frames for the profiler (issue 33).
//!
//! The sampler reads, at each tick of a CPython process's thread, which code
//! objects its frames run and where (`agent_common::PythonFrame`). This
//! crate owns what it needs to do that and to name what it read:
//! - [`interpreter`]: whether an ELF file is a CPython interpreter (a
//!   `python3.X` with libpython linked in, or a `libpython3.X.so`), its
//!   version and where `_PyRuntime` lies;
//! - [`eval_parts`]: the parts of the evaluation loop a compiler split off
//!   its symbol;
//! - [`layout`]: the offsets of the structures the sampler follows, per
//!   CPython version, as the `agent_common::PythonProcess` the sampler reads;
//! - [`process`]: the interpreter mapped in a running process;
//! - [`pairing`]: a Python stack paired with its tick's sample, kept in
//!   the process's state until the sample's walk;
//! - [`merge`]: where a sample's Python frames go in its native walk;
//! - [`code`]: a code object read from the process (qualified name, file,
//!   first line, location table), checked against the first line the
//!   sampler saw, and the line of an instruction offset.

pub mod code;
pub mod eval_parts;
pub mod interpreter;
pub mod layout;
pub mod merge;
pub mod pairing;
pub mod process;

pub use code::{CodeCache, CodeError, CodeObject, Unnamed};
pub use interpreter::{DebugOffsets, Interpreter, InterpreterError};
pub use layout::Layout;
pub use pairing::{PythonRecord, PythonState, ReadStack, StackPairing};
pub use process::{FindError, FoundInterpreter, find_in_process, named_like_interpreter};
