//! Tables of real binaries: glibc's libc.so.6 as Debian ships it, and the
//! fixtures compiled at test time. Checks the table's invariants and rules at
//! places whose CFI is known without reading it (every function entry has
//! cfa = rsp + 8), and the errors of `from_elf` on files that are not usable.

mod common;

use std::{path::Path, process::Command, time::Instant};

use common::Module;
use object::{Object as _, ObjectSection as _, ObjectSymbol as _, SymbolKind};
use stackscope_test_fixtures::Fixture;
use stackscope_unwind::{
    TableError, UnsupportedCfi, UnwindRule, UnwindTable,
    table::{DirectCfi, DirectCfiError},
};

const LIBC: &str = "/lib/x86_64-linux-gnu/libc.so.6";

/// Rows strictly sorted, a gap terminator, and `lookup` agreeing with every
/// row at its first and last byte.
fn assert_invariants(table: &UnwindTable) {
    let rows: Vec<(u64, Option<UnwindRule>)> = table.rows().collect();
    assert!(!rows.is_empty());
    assert!(
        rows.windows(2).all(|pair| pair[0].0 < pair[1].0),
        "rows not sorted"
    );
    assert!(
        rows.windows(2).all(|pair| pair[0].1 != pair[1].1),
        "consecutive rows with the same rule were not merged"
    );
    assert_eq!(rows.last().map(|row| row.1), Some(None), "no terminator");
    for pair in rows.windows(2) {
        let ((start, rule), (next, _)) = (pair[0], pair[1]);
        assert_eq!(table.lookup(start), rule, "at {start:#x}");
        assert_eq!(table.lookup(next - 1), rule, "at {:#x}", next - 1);
    }
    assert_eq!(table.lookup(rows[0].0 - 1), None);
}

/// Exported function symbols of a file: `(name, address)`.
fn functions(path: &str) -> Vec<(String, u64)> {
    let data = std::fs::read(path).expect("reading the file");
    let file = object::File::parse(&*data).expect("parsing ELF");
    file.dynamic_symbols()
        .chain(file.symbols())
        .filter(|symbol| symbol.kind() == SymbolKind::Text && symbol.is_definition())
        .filter_map(|symbol| Some((symbol.name().ok()?.to_owned(), symbol.address())))
        .collect()
}

#[test]
fn the_loaders_entry_point_without_cfi_is_outermost() {
    // glibc's ld.so starts at `_start`, which has no FDE and calls
    // `_dl_start` in its first bytes: a walk that returns there is whole.
    const LOADER: &str = "/lib64/ld-linux-x86-64.so.2";
    let data = std::fs::read(LOADER).expect("reading the loader");
    let entry = object::File::parse(&*data).expect("parsing ELF").entry();
    let table = UnwindTable::from_elf(&data).expect("compiling the loader's table");
    assert_invariants(&table);
    assert_eq!(table.lookup(entry), Some(UnwindRule::Outermost));
    assert_eq!(table.lookup(entry + 7), Some(UnwindRule::Outermost));
    // Only its first bytes: whatever follows keeps its own rows or none.
    assert_ne!(table.lookup(entry + 64), Some(UnwindRule::Outermost));
    // A raw .eh_frame knows no entry point: nothing is added.
    let file = object::File::parse(&*data).expect("parsing ELF");
    let eh_frame = file.section_by_name(".eh_frame").expect(".eh_frame");
    let raw = UnwindTable::from_eh_frame(eh_frame.data().expect("data"), eh_frame.address())
        .expect("compiling .eh_frame alone");
    assert_eq!(raw.lookup(entry), None);
}

#[test]
fn libc() {
    let data = std::fs::read(LIBC).expect("reading libc");
    let started = Instant::now();
    let table = UnwindTable::from_elf(&data).expect("compiling libc's table");
    let elapsed = started.elapsed();
    eprintln!(
        "{LIBC}: {} rows, {} rules, {} bytes, compiled in {elapsed:?}",
        table.len(),
        table.rule_count(),
        table.heap_bytes()
    );
    assert!(table.len() > 5000, "{} rows", table.len());
    assert!(table.heap_bytes() < table.len() * 8 + table.rule_count() * 12 + 64);
    assert_invariants(&table);

    // Every function starts with cfa = rsp + 8 (only the return address on
    // the stack), whatever its CFI says later.
    let functions = functions(LIBC);
    assert!(functions.len() > 2000);
    let mut covered = 0;
    for (name, address) in &functions {
        match table.lookup(*address) {
            Some(rule) => {
                covered += 1;
                assert_eq!(
                    rule,
                    UnwindRule::Rsp { cfa_off: 8 },
                    "at the entry of {name}"
                );
            }
            None => eprintln!("no CFI for {name} at {address:#x}"),
        }
    }
    assert!(
        covered * 100 >= functions.len() * 99,
        "{covered} of {} exported functions have CFI",
        functions.len()
    );
    for name in [
        "malloc",
        "free",
        "printf",
        "__libc_start_main",
        "pthread_create",
        "clone",
    ] {
        let (_, address) = functions
            .iter()
            .find(|(symbol, _)| symbol == name)
            .unwrap_or_else(|| panic!("{name} is exported"));
        assert!(table.lookup(*address).is_some(), "{name} has no rows");
    }

    // __restore_rt is libc's only signal trampoline; clone and clone3 mark
    // their child's entry as outermost.
    let rules: Vec<UnwindRule> = table.rows().filter_map(|(_, rule)| rule).collect();
    let count = |wanted: fn(&UnwindRule) -> bool| rules.iter().filter(|rule| wanted(rule)).count();
    assert_eq!(count(|rule| *rule == UnwindRule::SignalFrame), 1);
    assert!(count(|rule| *rule == UnwindRule::Outermost) >= 2);
    // Hand-written assembly and stack realignment are rare: less than 1%.
    let unsupported = count(|rule| matches!(rule, UnwindRule::Unsupported(_)));
    eprintln!("{unsupported} unsupported rows");
    assert!(
        unsupported * 100 < rules.len(),
        "{unsupported} unsupported rows"
    );

    // The on-disk form reproduces the table exactly.
    let bytes = table.to_bytes();
    assert_eq!(
        bytes.len(),
        32 + 12 * table.rule_count() + 8 * table.len() + 8
    );
    assert_eq!(UnwindTable::from_bytes(&bytes).as_ref(), Ok(&table));
}

#[test]
fn code_without_rows_keeps_frame_pointers_only_where_it_does() {
    // A program that is mostly its own code, built without unwind tables:
    // judged by its symbols, and with `-s` (no symbols) by its code alone.
    let table_of = |args: &[&str]| {
        let args = [
            &[
                "-O2",
                "-fno-asynchronous-unwind-tables",
                "-fno-unwind-tables",
            ],
            args,
        ]
        .concat();
        let fixture = Fixture::compile_with("many_functions", "gcc", &["many_functions.c"], &args);
        let data = std::fs::read(&fixture.path).expect("reading the program");
        UnwindTable::from_elf(&data).expect("compiling the program's table")
    };
    // With frame pointers: only the C runtime's functions have rows, and
    // the rest opens frames.
    assert!(table_of(&["-fno-omit-frame-pointer"]).frame_pointer_gaps());
    assert!(table_of(&["-fno-omit-frame-pointer", "-s"]).frame_pointer_gaps());
    // Without them: rbp means nothing there, and a walk must stop rather
    // than follow it.
    assert!(!table_of(&["-fomit-frame-pointer"]).frame_pointer_gaps());
    assert!(!table_of(&["-fomit-frame-pointer", "-s"]).frame_pointer_gaps());
    // With unwind tables (the usual build), the rows cover the code.
    let fixture = Fixture::compile("fp_callback", &["-fno-omit-frame-pointer"]);
    let data = std::fs::read(&fixture.path).expect("reading the fixture");
    assert!(
        !UnwindTable::from_elf(&data)
            .expect("table")
            .frame_pointer_gaps()
    );
    let libc = std::fs::read(LIBC).expect("reading libc");
    assert!(
        !UnwindTable::from_elf(&libc)
            .expect("table")
            .frame_pointer_gaps()
    );
}

#[test]
fn fixture_functions_plt_and_start() {
    let fixture = Fixture::compile("chain", &[]);
    let module = Module::load(&fixture.path);
    let table = module
        .table
        .as_ref()
        .expect("compiling the fixture's table");
    assert_invariants(table);

    for name in ["main", "a", "b", "c", "spin", "on_alarm", "handler_spin"] {
        let address = module
            .symbols
            .address_of(name)
            .unwrap_or_else(|| panic!("{name} in .symtab"));
        assert_eq!(
            table.lookup(address),
            Some(UnwindRule::Rsp { cfa_off: 8 }),
            "at {name}"
        );
        // The first instruction (`sub $n, %rsp`, 4 bytes, or a push) grows
        // the frame by whole words.
        let Some(UnwindRule::Rsp { cfa_off }) = table.lookup(address + 4) else {
            panic!("{name} + 4: {:?}", table.lookup(address + 4));
        };
        assert!(cfa_off >= 16 && cfa_off % 8 == 0, "{name} + 4: {cfa_off}");
        // a, b and c only keep the stack aligned for their call.
        if ["a", "b", "c"].contains(&name) {
            assert_eq!(cfa_off, 16, "{name} + 4");
        }
    }
    let start = module.symbols.address_of("_start").expect("_start");
    assert_eq!(table.lookup(start), Some(UnwindRule::Outermost));

    // The lazy .plt: PLT0 pushes, then 16-byte entries use the expression.
    let data = std::fs::read(&fixture.path).expect("reading the fixture");
    let file = object::File::parse(&*data).expect("parsing the fixture");
    let plt = file.section_by_name(".plt").expect("a .plt section");
    assert_eq!(
        table.lookup(plt.address()),
        Some(UnwindRule::Rsp { cfa_off: 16 })
    );
    assert_eq!(
        table.lookup(plt.address() + 16),
        Some(UnwindRule::Plt { threshold: 11 })
    );
}

#[test]
fn from_elf_errors() {
    let fixture = Fixture::compile("chain", &[]);
    let data = std::fs::read(&fixture.path).expect("reading the fixture");

    assert!(matches!(
        UnwindTable::from_elf(b"not an ELF file"),
        Err(TableError::Elf(_))
    ));
    // Section headers live at the end of the file.
    assert!(matches!(
        UnwindTable::from_elf(&data[..data.len() / 2]),
        Err(TableError::Elf(_))
    ));

    let mut aarch64 = data.clone();
    aarch64[18..20].copy_from_slice(&183u16.to_le_bytes()); // EM_AARCH64
    assert!(matches!(
        UnwindTable::from_elf(&aarch64),
        Err(TableError::UnsupportedArchitecture { machine: 183 })
    ));

    // No .eh_frame and, without -g, no .debug_frame either.
    let stripped = fixture.dir().join("stripped");
    let out = Command::new("objcopy")
        .args([
            "--remove-section=.eh_frame",
            "--remove-section=.eh_frame_hdr",
        ])
        .arg(&fixture.path)
        .arg(&stripped)
        .output()
        .expect("running objcopy");
    assert!(out.status.success());
    let stripped = std::fs::read(&stripped).expect("reading the stripped copy");
    assert!(matches!(
        UnwindTable::from_elf(&stripped),
        Err(TableError::NoCfi)
    ));

    // Damage anywhere in the file: an error or a table, never a panic.
    for step in [7919usize, 104_729] {
        for at in (0..data.len()).step_by(step) {
            let mut damaged = data.clone();
            damaged[at] ^= 0x5a;
            if let Ok(table) = UnwindTable::from_elf(&damaged) {
                let _ = table.lookup(0x1000);
            }
            let _ = UnwindTable::from_elf(&data[..at]);
        }
    }
}

#[test]
fn debug_frame_matches_eh_frame() {
    // The same code described twice: .eh_frame with unwind tables, and
    // .debug_frame (for a copy without .eh_frame) with -g and no unwind tables.
    let eh = Fixture::compile("chain", &[]);
    let debug = Fixture::compile("chain", &["-g", "-fno-asynchronous-unwind-tables"]);
    let stripped = debug.dir().join("stripped");
    let out = Command::new("objcopy")
        .args([
            "--remove-section=.eh_frame",
            "--remove-section=.eh_frame_hdr",
        ])
        .arg(&debug.path)
        .arg(&stripped)
        .output()
        .expect("running objcopy");
    assert!(out.status.success());

    let eh = Module::load(&eh.path);
    let debug = Module::load(Path::new(&stripped));
    let eh_table = eh.table.as_ref().expect("the .eh_frame table");
    let debug_table = debug.table.as_ref().expect("the .debug_frame table");
    assert_invariants(debug_table);
    for name in ["main", "a", "b", "c", "spin", "on_alarm", "handler_spin"] {
        let eh_start = eh.symbols.address_of(name).expect("symbol");
        let debug_start = debug.symbols.address_of(name).expect("symbol");
        // -g does not change code generation: same offsets, same rules.
        for offset in 0..8 {
            assert_eq!(
                eh_table.lookup(eh_start + offset),
                debug_table.lookup(debug_start + offset),
                "{name} + {offset}"
            );
        }
    }
}

#[test]
#[ignore = "needs node (cargo xtask setup installs nodejs): run by `cargo xtask test`"]
fn v8s_embedded_builtins_are_stepped_by_frame_pointer_at_calls() {
    // Debian's node (a setup package): its builtins are `Builtins_*`
    // function symbols in .text that no FDE covers.
    let path = "/usr/bin/node";
    let data = std::fs::read(path).expect("reading node (cargo xtask setup installs nodejs)");
    let table = UnwindTable::from_elf(&data).expect("node's table");
    assert_invariants(&table);
    let file = object::File::parse(&*data).expect("node is ELF");
    let symbol = |name: &str| {
        file.symbols()
            .find(|symbol| symbol.name() == Ok(name))
            .unwrap_or_else(|| panic!("{name} in node's symbols"))
            .address()
    };
    let centry = symbol("Builtins_CEntry_Return1_ArgvOnStack_BuiltinExit");
    assert_eq!(
        table.lookup(centry + 1),
        Some(UnwindRule::FramePointerAtCalls)
    );
    let builtins = file
        .symbols()
        .filter(|s| s.kind() == SymbolKind::Text && s.size() > 0)
        .filter(|s| s.name().is_ok_and(|name| name.starts_with("Builtins_")))
        .filter(|s| table.lookup(s.address()) == Some(UnwindRule::FramePointerAtCalls))
        .count();
    assert!(builtins > 1000, "only {builtins} builtins have rows");
    // C++ keeps its CFI: a function's entry has cfa = rsp + 8.
    let main = symbol("main");
    assert_eq!(table.lookup(main), Some(UnwindRule::Rsp { cfa_off: 8 }));
}

/// What `DirectCfi` answers at every row of a compiled table (its first
/// byte and its last): the table's rule, or nothing where the table's rule
/// is not the CFI's own (the entry point made outermost, an FDE whose
/// program fails). Returns the rows answered and those not.
fn compare_direct_with_compiled(path: &Path, every_nth_row: usize) -> (usize, usize) {
    let data = std::fs::read(path).expect("reading the file");
    let table = UnwindTable::from_elf(&data).expect("compiling the table");
    let direct = DirectCfi::new(data).expect("reading the CFI directly");
    let rows: Vec<(u64, Option<UnwindRule>)> = table.rows().collect();
    let (mut answered, mut unanswered) = (0, 0);
    for pair in rows.windows(2).step_by(every_nth_row) {
        let ((start, rule), (next, _)) = (pair[0], pair[1]);
        for address in [start, next - 1] {
            match (rule, direct.rule_at(address)) {
                (None, found) => assert_eq!(found, None, "{path:?} at {address:#x}, a gap"),
                (Some(rule), Some(found)) => {
                    assert_eq!(found, rule, "{path:?} at {address:#x}");
                    answered += 1;
                }
                (Some(rule), None) => {
                    assert!(
                        matches!(
                            rule,
                            UnwindRule::Outermost
                                | UnwindRule::Unsupported(UnsupportedCfi::Program)
                        ),
                        "{path:?} at {address:#x}: the table has {rule:?}, direct CFI nothing"
                    );
                    unanswered += 1;
                }
            }
        }
    }
    (answered, unanswered)
}

#[test]
fn rules_read_directly_are_the_compiled_tables_rules() {
    for path in [LIBC, "/lib64/ld-linux-x86-64.so.2"] {
        let (answered, unanswered) = compare_direct_with_compiled(Path::new(path), 1);
        eprintln!("{path}: {answered} row ends answered directly, {unanswered} not");
        assert!(
            answered > 1000 && unanswered <= 2,
            "{path}: {answered} / {unanswered}"
        );
    }
    // A compiler's driver, what the direct rules are for: every 53rd row
    // of the 100 MB library (all of them take minutes in a debug build).
    let sysroot = Command::new("rustc")
        .args(["--print", "sysroot"])
        .output()
        .expect("running rustc --print sysroot");
    let lib = Path::new(String::from_utf8_lossy(&sysroot.stdout).trim()).join("lib");
    let driver = std::fs::read_dir(&lib)
        .expect("reading the toolchain's lib directory")
        .filter_map(|entry| Some(entry.ok()?.path()))
        .find(|path| {
            path.file_name()
                .and_then(|name| name.to_str())
                .is_some_and(|name| name.starts_with("librustc_driver-"))
        })
        .expect("the toolchain's librustc_driver");
    let (answered, unanswered) = compare_direct_with_compiled(&driver, 53);
    eprintln!("{driver:?}: {answered} row ends answered directly, {unanswered} not");
    assert!(
        answered > 10_000 && unanswered <= 2,
        "{answered} / {unanswered}"
    );
}

#[test]
fn direct_cfi_refuses_what_it_cannot_read() {
    assert!(matches!(
        DirectCfi::new(b"not an ELF file".to_vec()),
        Err(DirectCfiError::Elf(_))
    ));
    // An object file has .eh_frame but no search table over it.
    let dir = tempfile::tempdir().expect("a temporary directory");
    let object = dir.path().join("chain.o");
    let out = Command::new("gcc")
        .args(["-O2", "-c", "-o"])
        .arg(&object)
        .arg(stackscope_test_fixtures::fixture_source("chain.c"))
        .output()
        .expect("running gcc");
    assert!(out.status.success(), "{out:?}");
    assert!(matches!(
        DirectCfi::new(std::fs::read(&object).expect("reading chain.o")),
        Err(DirectCfiError::Missing(".eh_frame_hdr"))
    ));

    // Damage anywhere in a library: an error or answers, never a panic.
    let data = std::fs::read("/lib64/ld-linux-x86-64.so.2").expect("reading the loader");
    let table = UnwindTable::from_elf(&data).expect("compiling the loader's table");
    let addresses: Vec<u64> = table
        .rows()
        .map(|(address, _)| address)
        .step_by(7)
        .collect();
    for at in (0..data.len()).step_by(4099) {
        let mut damaged = data.clone();
        damaged[at] ^= 0x5a;
        if let Ok(direct) = DirectCfi::new(damaged) {
            for &address in &addresses {
                let _ = direct.rule_at(address);
            }
        }
    }
}
