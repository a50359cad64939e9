//! Rows for Go functions from the Go runtime's function table
//! (`.gopclntab`), which every Go binary keeps, stripped or not.
//!
//! This module owns turning each Go function's stack-pointer table
//! (`pcsp`) into rows, and which Go functions end a walk: the roots of
//! goroutine and thread stacks, and the functions that switch stacks. It
//! does not own parsing the table (`stackscope_gopclntab`) nor laying rows
//! out (`super::compile`).
//!
//! Why these rows are right, at every instruction of every Go function,
//! assembly included (`crypto/sha256.block`, which uses rbp as a general
//! register, or a frameless leaf):
//! - On amd64 a Go function is entered by `call` (the return address at
//!   rsp) and moves rsp only by constant amounts the assembler tracks: the
//!   prologue's `sub $n, rsp` (its frame, and the slot where the frame
//!   pointer is saved), `push`/`pop`, and the epilogue. The assembler
//!   records, for every instruction, how far rsp is below its value at the
//!   entry (the `pcsp` table); the Go runtime's own traceback, its
//!   garbage collector's stack scans and its panics depend on that table
//!   being exact. So `cfa = rsp + pcsp + 8` and the return address is at
//!   `cfa - 8`, with nothing read from rbp (which assembly may use for
//!   anything).
//! - A function that writes rsp any other way (switching to the system
//!   stack, `runtime.systemstack`, `runtime.mcall`, `runtime.morestack`,
//!   ...) is flagged `SPWRITE` by the assembler (Go 1.17 and later): its
//!   table does not lead to its caller, and the walk stops there (Go's
//!   traceback does too), as [`UnsupportedCfi::StackSwitch`]. So does a
//!   function entered other than by a call: by the kernel on a signal
//!   (`runtime.sigtramp`), or by a preemption signal pushing the
//!   interrupted pc as if it were a return address (`runtime.asyncPreempt`).
//! - `runtime.goexit` (where every goroutine returns to), `runtime.mstart`
//!   (where every thread's system stack starts) and `runtime.rt0_go` (the
//!   program's first Go code) are the tops of stacks (`TOPFRAME`, Go's
//!   traceback ends there as complete): a walk reaching them ends as
//!   [`UnwindRule::Outermost`]. They are recognised by name in the
//!   binary's own function table, which is also where the address ranges
//!   come from. So are the process's entry (`_rt0_amd64_linux`,
//!   `_rt0_amd64`), which nothing called.
//! - `runtime.sigreturn`, the signal restorer, is returned into by the
//!   handler with rsp at the kernel's `ucontext`: a signal frame, as
//!   glibc's `__restore_rt` is.
//!
//! Go's linker also writes `.debug_frame` (compressed) from the same
//! `pcsp` tables, with the same CFA rule; where both exist, the rows from
//! `.gopclntab` replace it over Go functions, since only the function table
//! says which functions end a walk. Tests compare the two rule by rule.

use object::{Object as _, ObjectSection as _, read::elf::ElfFile64};
use stackscope_gopclntab::{FLAG_SPWRITE, FLAG_TOPFRAME, Func, Table};

use super::compile::Builder;
use super::{TableError, UnsupportedCfi, UnwindRule};

/// The functions at the top of every Go stack (the ones the runtime marks
/// `TOPFRAME` other than `runtime.sigtramp`, which a signal enters).
pub(crate) const GO_ROOTS: [&str; 3] = ["runtime.goexit", "runtime.mstart", "runtime.rt0_go"];

/// The process's first code on linux/amd64: the ELF entry point jumps
/// to `_rt0_amd64`, which jumps to `runtime.rt0_go`. Nothing called them
/// (the word at rsp is `argc`): a walk reaching them is complete. The
/// function holding the ELF entry point is taken as such too, whatever
/// its name.
const PROCESS_ENTRY: [&str; 2] = ["_rt0_amd64_linux", "_rt0_amd64"];

/// Go's signal restorer (`sa_restorer`): the signal handler `runtime.sigtramp`
/// returns into it with rsp at the kernel's `ucontext`, exactly as glibc's
/// `__restore_rt`, so it steps as a signal frame (the interrupted
/// registers from the `ucontext`). `runtime.sigreturn__sigaction` is its
/// name from Go 1.20 on.
const SIGNAL_RETURNS: [&str; 2] = ["runtime.sigreturn", "runtime.sigreturn__sigaction"];

/// Functions entered other than by a call, whose return address slot
/// holds an interrupted instruction's address: `runtime.asyncPreempt`,
/// which a preemption signal makes the goroutine "call" by pushing the
/// interrupted pc (Go's traceback treats it specially). Stepping past it
/// as a call would look the caller up one byte early, possibly in the
/// wrong function, so the walk stops there, whatever the Go version.
const NOT_CALLED: [&str; 1] = ["runtime.asyncPreempt"];

/// The functions that switch stacks or are entered by the kernel, for Go
/// 1.16 tables, which carry no flags (later ones flag them `SPWRITE` or
/// `TOPFRAME`).
const STACK_SWITCHES: [&str; 9] = [
    "runtime.systemstack",
    "runtime.mcall",
    "runtime.morestack",
    "runtime.morestack_noctxt",
    "runtime.asmcgocall",
    "runtime.cgocallback",
    "runtime.gogo",
    "runtime.sigtramp",
    "runtime.cgoSigtramp",
];

/// Adds a span for every function of the binary's `.gopclntab` (replacing
/// spans added before that overlap Go functions). False when the binary
/// has no such section (it is not a Go binary, or an externally linked
/// one whose linker merged the table into another section).
pub(super) fn add_functions(
    file: &ElfFile64<'_, object::Endianness>,
    builder: &mut Builder,
    entry: Option<u64>,
) -> Result<bool, TableError> {
    let Some(section) = stackscope_gopclntab::SECTION_NAMES
        .iter()
        .find_map(|name| file.section_by_name(name))
    else {
        return Ok(false);
    };
    let data = section.data().map_err(TableError::Elf)?;
    let text = file
        .section_by_name(".text")
        .map_or(0, |text| text.address());
    let table = Table::parse(data, text).map_err(TableError::GoFunctionTable)?;
    let ranges: Vec<std::ops::Range<u64>> = (0..table.len())
        .filter_map(|index| table.func_range(index).ok())
        .filter(|range| !range.is_empty())
        .collect();
    builder.drop_spans_overlapping(&ranges);
    for index in 0..table.len() {
        let Ok(range) = table.func_range(index) else {
            continue;
        };
        if range.is_empty() {
            continue;
        }
        match table.func(index) {
            Ok(func) => {
                let holds_entry = entry.is_some_and(|entry| func.contains(entry));
                add_function(builder, &table, &func, holds_entry)?
            }
            // A damaged record: the range is known (from the checked
            // index), how to step out of it is not.
            Err(_) => builder.push_whole(
                range.start,
                range.end,
                UnwindRule::Unsupported(UnsupportedCfi::Program),
            )?,
        }
    }
    Ok(true)
}

fn add_function(
    builder: &mut Builder,
    table: &Table<'_>,
    func: &Func<'_>,
    holds_entry: bool,
) -> Result<(), TableError> {
    if GO_ROOTS.contains(&func.name) || PROCESS_ENTRY.contains(&func.name) || holds_entry {
        return builder.push_whole(func.entry, func.end, UnwindRule::Outermost);
    }
    if SIGNAL_RETURNS.contains(&func.name) {
        return builder.push_whole(func.entry, func.end, UnwindRule::SignalFrame);
    }
    if func.flags & (FLAG_SPWRITE | FLAG_TOPFRAME) != 0
        || STACK_SWITCHES.contains(&func.name)
        || NOT_CALLED.contains(&func.name)
    {
        return builder.push_whole(
            func.entry,
            func.end,
            UnwindRule::Unsupported(UnsupportedCfi::StackSwitch),
        );
    }
    let mut rows = Vec::new();
    let mut covered = func.entry;
    for delta in table.sp_deltas(func) {
        let Ok((range, delta)) = delta else {
            return builder.push_whole(
                func.entry,
                func.end,
                UnwindRule::Unsupported(UnsupportedCfi::Program),
            );
        };
        if range.is_empty() {
            continue;
        }
        // rsp never rises above its value at the entry (where the return
        // address is): a negative delta is a table this does not trust.
        let rule = match u32::try_from(delta)
            .ok()
            .and_then(|delta| i32::try_from(u64::from(delta) + 8).ok())
        {
            Some(cfa_off) => UnwindRule::Rsp { cfa_off },
            None => UnwindRule::Unsupported(UnsupportedCfi::OffsetRange),
        };
        rows.push((range.start, rule));
        covered = range.end;
    }
    // Addresses past the end of the function's table (none in what Go's
    // linker writes) stay without a row.
    builder.push_rows(rows, covered)
}
