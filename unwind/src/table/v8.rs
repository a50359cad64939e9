//! Rows for V8's embedded builtins, which have no CFI.
//!
//! A program that embeds V8 (node, Electron apps, Chromium) links the
//! builtins as one blob of generated code inside its `.text`, each builtin
//! a `Builtins_*` function symbol, none covered by `.eh_frame`. V8 keeps a
//! frame pointer in every frame of its own that calls out: its stack
//! walker (garbage collection, exceptions, its own profiler) steps through
//! them by rbp. A walk that returns into a builtin (the C++ runtime called
//! through `Builtins_CEntry_*`, JavaScript entered through
//! `Builtins_JSEntry*`) can therefore step out of it by rbp; one that
//! starts inside a builtin cannot know whether its frame is set up yet,
//! and stops ([`UnwindRule::FramePointerAtCalls`]).

use object::{Object as _, ObjectSymbol as _, SymbolKind, read::elf::ElfFile64};

use super::{TableError, UnwindRule, compile::Builder};

/// The prefix of V8's embedded builtins' symbols (`embedded.S`).
const BUILTIN_PREFIX: &str = "Builtins_";

/// Adds a span for every builtin no other source has rows for; the number
/// added (0 for a program without V8, or one stripped of its symbols).
pub(super) fn add_builtins(
    file: &ElfFile64<'_, object::Endianness>,
    builder: &mut Builder,
) -> Result<usize, TableError> {
    let mut builtins: Vec<(u64, u64)> = file
        .symbols()
        .filter(|symbol| symbol.kind() == SymbolKind::Text && symbol.size() > 0)
        .filter(|symbol| {
            symbol
                .name()
                .is_ok_and(|name| name.starts_with(BUILTIN_PREFIX))
        })
        .filter_map(|symbol| {
            let start = symbol.address();
            Some((start, start.checked_add(symbol.size())?))
        })
        .collect();
    if builtins.is_empty() {
        return Ok(0);
    }
    builtins.sort_unstable();
    builtins.dedup();
    let covered = builder.covered_ranges();
    let mut added = 0;
    let mut last_end = 0;
    for (start, end) in builtins {
        // Aliases and overlapping symbols: the first one's span stands.
        if start < last_end {
            continue;
        }
        let i = covered.partition_point(|range| range.end <= start);
        if covered.get(i).is_some_and(|range| range.start < end) {
            // CFI (or another source) describes it: that wins.
            continue;
        }
        builder.push_whole(start, end, UnwindRule::FramePointerAtCalls)?;
        last_end = end;
        added += 1;
    }
    Ok(added)
}
