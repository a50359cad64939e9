//! The Go function table reader on arbitrary bytes: parsing, every
//! function's record, its stack-pointer deltas and lines, and lookups by
//! address must return values or errors, never panic, and a lookup must
//! only ever answer with a function that contains the address.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stackscope_gopclntab::Table;

fuzz_target!(|data: &[u8]| {
    let Ok(table) = Table::parse(data, 0x40_1000) else {
        return;
    };
    for func in table.funcs().take(4096).flatten() {
        for delta in table.sp_deltas(&func).take(4096) {
            if delta.is_err() {
                break;
            }
        }
        let _ = table.file_line(&func, func.entry);
    }
    let range = table.range();
    let step = ((range.end - range.start) / 64).max(1);
    for pc in (range.start..range.end).step_by(step as usize) {
        if let Ok(Some(func)) = table.func_at(pc) {
            assert!(func.contains(pc));
        }
    }
});
