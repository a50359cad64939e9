//! The cache reader on arbitrary bytes: an error or a table, never a panic;
//! and since the format has exactly one encoding per table, an accepted input
//! must be what `to_bytes` writes for the table it decoded to.
//!
//! The checksum stops almost every mutation at the door, so the input is
//! also read with its last 8 bytes replaced by the checksum of the rest
//! (FNV-1a 64, as the writer computes it): that is what reaches the
//! decoding of the header, rules and rows.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stackscope_unwind::UnwindTable;

fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn check(data: &[u8]) {
    if let Ok(table) = UnwindTable::from_bytes(data) {
        assert_eq!(table.to_bytes(), data);
        let _ = table.lookup(0x1000);
        for (address, rule) in table.rows() {
            assert_eq!(table.lookup(address), rule);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    check(data);
    if let Some(split) = data.len().checked_sub(8) {
        let mut fixed = data.to_vec();
        let checksum = fnv1a64(&fixed[..split]);
        fixed[split..].copy_from_slice(&checksum.to_le_bytes());
        check(&fixed);
    }
});
