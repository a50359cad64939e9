//! Names for Go binaries stripped of their symbol table and DWARF, from the
//! Go runtime's function table (`.gopclntab`), which such binaries keep.
//!
//! Go's function table lists every function of the binary, so a frame it
//! names is named right; blazesym's answer comes first all the same (it
//! has DWARF's inlined functions), and only the addresses it leaves
//! unnamed are looked up here.
//!
//! Owns looking addresses up in a table and the frames made of what it
//! says. Does not own reading the tables or keeping them (the caller's
//! [`GoTableCache`], keyed by its own ids), nor placing file offsets at
//! addresses (the caller knows the file's segments).

use std::sync::Arc;

pub use stackscope_gopclntab::elf::{GoFunctions, GoTableCache};
use stackscope_gopclntab::{Table, elf::lookup};

use crate::{FrameLine, Lines, truncate_str};

/// One Go function table, parsed for a batch of lookups.
#[derive(Debug)]
pub struct GoNames<'a> {
    table: Table<'a>,
    max_name_bytes: usize,
}

impl<'a> GoNames<'a> {
    /// `functions`' table, names cut to `max_name_bytes`; `None` when the
    /// table does not parse.
    pub fn new(functions: &'a GoFunctions, max_name_bytes: usize) -> Option<Self> {
        Some(Self {
            table: functions.table().ok()?,
            max_name_bytes,
        })
    }

    /// The function at `address` (an ELF virtual address), with its file
    /// and line when the table has them; `None` where no function covers it.
    pub fn name(&self, address: u64) -> Option<Lines> {
        let named = lookup(&self.table, address)?;
        let (file, line) = named.file_line.unwrap_or(("", 0));
        Some(Arc::new([FrameLine {
            function: truncate_str(named.function, self.max_name_bytes).into(),
            file: truncate_str(file, self.max_name_bytes).into(),
            line,
        }]))
    }

    /// Names the entries of `found` that are empty (blazesym found no
    /// symbol), the `i`-th at `address(i)` (`None`: outside the binary's
    /// code); returns how many it named.
    pub fn fill(&self, found: &mut [Lines], mut address: impl FnMut(usize) -> Option<u64>) -> u64 {
        let mut named = 0;
        for (i, slot) in found.iter_mut().enumerate() {
            if !slot.is_empty() {
                continue;
            }
            if let Some(lines) = address(i).and_then(|address| self.name(address)) {
                *slot = lines;
                named += 1;
            }
        }
        named
    }
}
