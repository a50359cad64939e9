//! The table compiler on arbitrary bytes, as an ELF file and as raw
//! `.eh_frame`/`.debug_frame` sections: it must return a table or an error,
//! never panic, and any table it returns must satisfy the invariants lookups
//! rely on and survive the cache round trip.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stackscope_unwind::UnwindTable;

fn check(table: &UnwindTable) {
    let rows: Vec<_> = table.rows().collect();
    assert!(rows.windows(2).all(|pair| pair[0].0 < pair[1].0));
    assert!(rows.last().is_none_or(|row| row.1.is_none()));
    for &(address, rule) in &rows {
        assert_eq!(table.lookup(address), rule);
    }
    let decoded = UnwindTable::from_bytes(&table.to_bytes());
    assert_eq!(decoded.as_ref(), Ok(table));
}

fuzz_target!(|data: &[u8]| {
    if let Ok(table) = UnwindTable::from_elf(data) {
        check(&table);
    }
    if let Ok(table) = UnwindTable::from_eh_frame(data, 0x1000) {
        check(&table);
    }
    if let Ok(table) = UnwindTable::from_debug_frame(data) {
        check(&table);
    }
});
