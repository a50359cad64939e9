//! Tables of Go programs (built at test time with the installed Go
//! toolchain) and of CFI sections compressed each way toolchains compress
//! them: the rows Go's function table gives agree with the `.debug_frame`
//! Go's linker writes from the same data, a stripped build gets the same
//! table, the roots and stack switches end walks, and a compression header
//! that lies about its size is a clear error.

use std::process::Command;

use stackscope_test_fixtures::split_debug::run_tool;

use object::{Object as _, ObjectSection as _, ObjectSymbol as _};
use stackscope_test_fixtures::Fixture;
use stackscope_unwind::{CfiSection, TableError, UnsupportedCfi, UnwindRule, UnwindTable};

/// Function symbols of an ELF file: `(name, start, end)`.
fn symbols(data: &[u8]) -> Vec<(String, u64, u64)> {
    let file = object::File::parse(data).expect("parsing ELF");
    file.symbols()
        .filter(|s| s.kind() == object::SymbolKind::Text && s.size() > 0)
        .filter_map(|s| {
            Some((
                s.name().ok()?.to_owned(),
                s.address(),
                s.address() + s.size(),
            ))
        })
        .collect()
}

fn symbol(symbols: &[(String, u64, u64)], name: &str) -> (u64, u64) {
    symbols
        .iter()
        .find(|(n, _, _)| n == name)
        .map(|&(_, start, end)| (start, end))
        .unwrap_or_else(|| panic!("no symbol {name}"))
}

#[test]
fn go_tables_agree_with_gos_own_debug_frame_and_survive_stripping() {
    let full = Fixture::go("go_chain", &[]);
    let stripped = Fixture::go("go_chain", &["-ldflags=-s -w"]);
    let full_data = std::fs::read(&full.path).unwrap();
    let stripped_data = std::fs::read(&stripped.path).unwrap();
    let table = UnwindTable::from_elf(&full_data).expect("table of the Go binary");
    let stripped_table =
        UnwindTable::from_elf(&stripped_data).expect("table of the stripped Go binary");
    // Stripping drops symbols and DWARF, not code nor .gopclntab.
    assert_eq!(
        table.rows().collect::<Vec<_>>(),
        stripped_table.rows().collect::<Vec<_>>()
    );

    // Go's linker derives .debug_frame (zlib-compressed) from the same
    // stack-pointer tables: rule for rule, the same CFA, except where the
    // function table says a walk ends.
    let elf = object::File::parse(&*full_data).unwrap();
    let debug_frame = elf.section_by_name(".debug_frame").expect(".debug_frame");
    assert_ne!(
        debug_frame.compressed_file_range().unwrap().format,
        object::CompressionFormat::None,
        "Go 1.19's linker compresses .debug_frame"
    );
    let bytes = debug_frame.uncompressed_data().unwrap();
    let from_dwarf = UnwindTable::from_debug_frame(&bytes).unwrap();
    let mut compared = 0;
    for (address, rule) in table.rows() {
        match rule {
            Some(rule @ UnwindRule::Rsp { .. }) => {
                assert_eq!(from_dwarf.lookup(address), Some(rule), "at {address:#x}");
                compared += 1;
            }
            Some(
                UnwindRule::Outermost
                | UnwindRule::SignalFrame
                | UnwindRule::Unsupported(UnsupportedCfi::StackSwitch),
            ) => {}
            None => {}
            other => panic!("unexpected rule {other:?} at {address:#x}"),
        }
    }
    assert!(compared > 1000, "only {compared} rows compared");

    let symbols = symbols(&full_data);
    // The roots of goroutine and thread stacks end walks as complete.
    for root in [
        "runtime.goexit.abi0",
        "runtime.mstart.abi0",
        "runtime.rt0_go.abi0",
    ] {
        let (start, end) = symbol(&symbols, root);
        for address in start..end {
            assert_eq!(table.lookup(address), Some(UnwindRule::Outermost), "{root}");
        }
    }
    // The process's entry, which the kernel jumps to, too.
    let entry = elf.entry();
    assert_eq!(table.lookup(entry), Some(UnwindRule::Outermost));
    let (start, _) = symbol(&symbols, "_rt0_amd64");
    assert_eq!(table.lookup(start), Some(UnwindRule::Outermost));
    // The signal restorer steps as a signal frame.
    let (start, end) = symbol(&symbols, "runtime.sigreturn.abi0");
    assert_eq!(table.lookup(start), Some(UnwindRule::SignalFrame));
    assert_eq!(table.lookup(end - 1), Some(UnwindRule::SignalFrame));
    // Stack switches end them as such.
    let (start, _) = symbol(&symbols, "runtime.systemstack.abi0");
    assert_eq!(
        table.lookup(start),
        Some(UnwindRule::Unsupported(UnsupportedCfi::StackSwitch))
    );
    // Assembly with a frame (and rbp used as a general register): its
    // CFA follows rsp through the function.
    let (start, end) = symbol(&symbols, "crypto/sha256.block.abi0");
    assert_eq!(table.lookup(start), Some(UnwindRule::Rsp { cfa_off: 8 }));
    let offsets: Vec<i32> = (start..end)
        .map(|address| match table.lookup(address) {
            Some(UnwindRule::Rsp { cfa_off }) => cfa_off,
            other => panic!("{other:?} in crypto/sha256.block"),
        })
        .collect();
    assert!(offsets.iter().any(|&off| off > 500), "{offsets:?}");
    // Every Go function of the program has rows.
    for name in [
        "main.alpha",
        "main.beta",
        "main.gamma",
        "main.leafWork",
        "main.worker",
    ] {
        let (start, _) = symbol(&symbols, name);
        assert_eq!(
            table.lookup(start),
            Some(UnwindRule::Rsp { cfa_off: 8 }),
            "{name}"
        );
    }
}

#[test]
fn a_damaged_gopclntab_is_an_error_or_a_table_never_a_panic() {
    let fixture = Fixture::go("go_chain", &["-ldflags=-s -w"]);
    let data = std::fs::read(&fixture.path).unwrap();
    let (offset, size) = {
        let elf = object::File::parse(&*data).unwrap();
        elf.section_by_name(".gopclntab")
            .unwrap()
            .file_range()
            .unwrap()
    };
    let (offset, size) = (offset as usize, size as usize);
    // A wrong magic: the binary's Go table is refused, by name.
    let mut bad = data.clone();
    bad[offset] ^= 0xff;
    assert!(matches!(
        UnwindTable::from_elf(&bad),
        Err(TableError::GoFunctionTable(
            stackscope_gopclntab::Error::UnknownMagic(_)
        ))
    ));
    // Damage through the table: an error or a table, never a panic.
    for at in (offset..offset + size).step_by(997) {
        let mut damaged = data.clone();
        damaged[at] ^= 0xa5;
        if let Ok(table) = UnwindTable::from_elf(&damaged) {
            let _ = table.lookup(0x40_1000);
        }
    }
}

/// `debug_frame_only.c` built without `.eh_frame`, its `.debug_frame`
/// uncompressed, then compressed by objcopy with zlib, zstd and the old
/// `.zdebug_` form.
fn compressed_variants() -> (Fixture, Vec<(&'static str, Vec<u8>)>) {
    let fixture = Fixture::compile_with(
        "debug_frame_only",
        "gcc",
        &["debug_frame_only.c"],
        &[
            "-O1",
            "-g",
            "-nostdlib",
            "-static",
            "-fno-asynchronous-unwind-tables",
            "-fno-unwind-tables",
        ],
    );
    let mut variants = vec![("none", std::fs::read(&fixture.path).unwrap())];
    for (name, how) in [("zlib", "zlib"), ("zstd", "zstd"), ("zlib-gnu", "zlib-gnu")] {
        let out_path = fixture.dir().join(name);
        run_tool(
            Command::new("objcopy")
                .arg(format!("--compress-debug-sections={how}"))
                .arg(&fixture.path)
                .arg(&out_path),
        );
        variants.push((name, std::fs::read(&out_path).unwrap()));
    }
    (fixture, variants)
}

fn section_names(data: &[u8]) -> Vec<String> {
    let elf = object::File::parse(data).unwrap();
    elf.sections()
        .filter_map(|s| s.name().ok().map(str::to_owned))
        .collect()
}

#[test]
fn compressed_debug_frame_reads_like_the_uncompressed_one() {
    let (_fixture, variants) = compressed_variants();
    let (_, plain) = &variants[0];
    assert!(!section_names(plain).iter().any(|n| n == ".eh_frame"));
    let expected = UnwindTable::from_elf(plain).expect("table of the plain file");
    assert!(expected.len() > 2);
    for (name, data) in &variants[1..] {
        if *name == "zlib-gnu" {
            assert!(section_names(data).iter().any(|n| n == ".zdebug_frame"));
        }
        let table = UnwindTable::from_elf(data).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(
            table.rows().collect::<Vec<_>>(),
            expected.rows().collect::<Vec<_>>(),
            "{name}"
        );
    }
}

/// Where the `Elf64_Chdr` of `.debug_frame` is in `data`.
fn chdr_offset(data: &[u8]) -> usize {
    let elf = object::File::parse(data).unwrap();
    let section = elf.section_by_name(".debug_frame").unwrap();
    section.file_range().unwrap().0 as usize
}

#[test]
fn a_compression_header_that_lies_about_its_size_is_a_clear_error() {
    let (_fixture, variants) = compressed_variants();
    for (name, data) in &variants[1..3] {
        let chdr = chdr_offset(data);
        // ch_size: 8 bytes after ch_type and ch_reserved.
        let size_at = chdr + 8;
        let size = u64::from_le_bytes(data[size_at..size_at + 8].try_into().unwrap());

        let mut huge = data.clone();
        huge[size_at..size_at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
        match UnwindTable::from_elf(&huge) {
            Err(TableError::DecompressedTooLarge {
                section: CfiSection::DebugFrame,
                size,
                ..
            }) => assert_eq!(size, 1 << 40),
            other => panic!("{name}: {other:?}"),
        }

        let mut more = data.clone();
        more[size_at..size_at + 8].copy_from_slice(&(size + 100).to_le_bytes());
        assert!(
            matches!(
                UnwindTable::from_elf(&more),
                Err(TableError::Decompress {
                    section: CfiSection::DebugFrame,
                    ..
                })
            ),
            "{name}"
        );

        // Fewer bytes than the stream holds, and a damaged stream: errors
        // (or, cut short, the CFI of what was decompressed), never a panic.
        let mut less = data.clone();
        less[size_at..size_at + 8].copy_from_slice(&(size / 2).to_le_bytes());
        let _ = UnwindTable::from_elf(&less);
        for at in (chdr + 24..chdr + 24 + 64).step_by(3) {
            let mut damaged = data.clone();
            damaged[at] ^= 0x5a;
            let _ = UnwindTable::from_elf(&damaged);
        }
    }
}

#[test]
fn a_go_binary_whose_debug_frame_header_lies_fails_clearly() {
    let fixture = Fixture::go("go_chain", &[]);
    let mut data = std::fs::read(&fixture.path).unwrap();
    let size_at = chdr_offset(&data) + 8;
    data[size_at..size_at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(
        UnwindTable::from_elf(&data),
        Err(TableError::DecompressedTooLarge { .. })
    ));
}
