//! The cache reader on arbitrary bytes: an error or a table, never a panic;
//! and since the format has exactly one encoding per table, an accepted input
//! must be what `to_bytes` writes for the table it decoded to.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stackscope_unwind::UnwindTable;

fuzz_target!(|data: &[u8]| {
    if let Ok(table) = UnwindTable::from_bytes(data) {
        assert_eq!(table.to_bytes(), data);
        let _ = table.lookup(0x1000);
    }
});
