//! Compiles the unwind table of each ELF file given on the command line and
//! prints its size, compile time and rule mix, e.g.
//!
//! ```sh
//! cargo run --release -p stackscope-unwind --example table_stats -- /lib/x86_64-linux-gnu/libc.so.6
//! ```
use std::{collections::BTreeMap, process::ExitCode, time::Instant};

use stackscope_unwind::{UnwindRule, UnwindTable};

fn kind(rule: Option<UnwindRule>) -> String {
    match rule {
        None => "gap".to_owned(),
        Some(UnwindRule::Unsupported(reason)) => format!("unsupported: {reason:?}"),
        Some(rule) => {
            let debug = format!("{rule:?}");
            debug
                .split([' ', '('])
                .next()
                .unwrap_or_default()
                .to_owned()
        }
    }
}

fn main() -> ExitCode {
    let mut status = ExitCode::SUCCESS;
    for path in std::env::args().skip(1) {
        let data = match std::fs::read(&path) {
            Ok(data) => data,
            Err(error) => {
                eprintln!("{path}: {error}");
                status = ExitCode::FAILURE;
                continue;
            }
        };
        let started = Instant::now();
        let table = match UnwindTable::from_elf(&data) {
            Ok(table) => table,
            Err(error) => {
                eprintln!("{path}: {error}");
                status = ExitCode::FAILURE;
                continue;
            }
        };
        let compiled = started.elapsed();
        let started = Instant::now();
        let bytes = table.to_bytes();
        let encoded = started.elapsed();
        let started = Instant::now();
        let decoded = UnwindTable::from_bytes(&bytes);
        let decoded_in = started.elapsed();
        println!(
            "{path}: {} rows, {} rules, {} heap bytes, compiled in {compiled:.1?}; \
             cache {} bytes, written in {encoded:.1?}, read in {decoded_in:.1?} ({})",
            table.len(),
            table.rule_count(),
            table.heap_bytes(),
            bytes.len(),
            if decoded.as_ref() == Ok(&table) {
                "identical"
            } else {
                "MISMATCH"
            },
        );
        let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
        for (_, rule) in table.rows() {
            *kinds.entry(kind(rule)).or_default() += 1;
        }
        for (kind, count) in kinds {
            println!("  {count:>9}  {kind}");
        }
    }
    status
}
