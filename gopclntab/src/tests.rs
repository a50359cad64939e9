//! Hand-built tables of each layout (gimli's habit: parsers tested with
//! bytes written by the test, truncated and corrupted input expecting
//! errors), and the table of a Go program built here when `go` is installed.

use super::*;

/// One function of a hand-built table.
struct TestFunc {
    name: &'static str,
    /// Offset from the start of text.
    entry: u32,
    /// `(value, bytes it lasts)` pairs of its pcsp table.
    sp: Vec<(i32, u32)>,
    flags: u8,
    /// File index in its CU, and a line, for the whole function.
    line: u32,
}

fn varint(out: &mut Vec<u8>, mut value: u32) {
    loop {
        let byte = (value & 0x7f) as u8;
        value >>= 7;
        if value == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

/// A pc-value table: each value for some bytes, then the terminator.
fn pc_values(out: &mut Vec<u8>, values: &[(i32, u32)]) -> u32 {
    let offset = out.len() as u32;
    let mut previous = -1i32;
    for &(value, bytes) in values {
        let delta = value - previous;
        varint(out, ((delta << 1) ^ (delta >> 31)) as u32);
        varint(out, bytes);
        previous = value;
    }
    out.push(0);
    offset
}

const TEXT: u64 = 0x40_1000;

/// Writes a table of `version` (8-byte pointers) for `funcs`, the last
/// one ending `last_size` bytes after its entry.
fn build(version: Version, funcs: &[TestFunc], last_size: u32) -> Vec<u8> {
    let mut names = Vec::new();
    let mut name_offsets = Vec::new();
    for func in funcs {
        name_offsets.push(names.len() as u32);
        names.extend_from_slice(func.name.as_bytes());
        names.push(0);
    }
    let filetab = b"\0main.go\0".to_vec();
    // One CU, file 0 at filetab offset 1.
    let cutab = 1u32.to_le_bytes().to_vec();
    // Offset 0 of pctab means "no table": start with a pad byte.
    let mut pctab = vec![0u8];
    let mut tables = Vec::new();
    for (i, func) in funcs.iter().enumerate() {
        let size = funcs
            .get(i + 1)
            .map_or(last_size, |next| next.entry - func.entry);
        let pcsp = pc_values(&mut pctab, &func.sp);
        let pcfile = pc_values(&mut pctab, &[(0, size)]);
        let pcln = pc_values(&mut pctab, &[(func.line as i32, size)]);
        tables.push((pcsp, pcfile, pcln));
    }

    let field = if version == Version::Go1_16 { 8 } else { 4 };
    let index_bytes = (funcs.len() + 1) * 2 * field;
    let mut records = Vec::new();
    let mut record_offsets = Vec::new();
    for (i, func) in funcs.iter().enumerate() {
        record_offsets.push(index_bytes + records.len());
        let (pcsp, pcfile, pcln) = tables[i];
        match version {
            Version::Go1_16 => {
                records.extend_from_slice(&(TEXT + u64::from(func.entry)).to_le_bytes())
            }
            _ => records.extend_from_slice(&func.entry.to_le_bytes()),
        }
        for word in [name_offsets[i], 0, 0, pcsp, pcfile, pcln, 0, 0] {
            records.extend_from_slice(&word.to_le_bytes());
        }
        if version == Version::Go1_20 {
            records.extend_from_slice(&func.line.to_le_bytes());
        }
        records.extend_from_slice(&[0, func.flags, 0, 0]);
    }
    let mut functab = Vec::new();
    let put = |functab: &mut Vec<u8>, value: u64| {
        if field == 8 {
            functab.extend_from_slice(&value.to_le_bytes());
        } else {
            functab.extend_from_slice(&(value as u32).to_le_bytes());
        }
    };
    let base = if version == Version::Go1_16 { TEXT } else { 0 };
    for (i, func) in funcs.iter().enumerate() {
        put(&mut functab, base + u64::from(func.entry));
        put(&mut functab, record_offsets[i] as u64);
    }
    let end = funcs.last().map_or(0, |f| f.entry + last_size);
    put(&mut functab, base + u64::from(end));
    put(&mut functab, 0);
    functab.extend_from_slice(&records);

    let magic = match version {
        Version::Go1_16 => MAGIC_GO1_16,
        Version::Go1_18 => MAGIC_GO1_18,
        Version::Go1_20 => MAGIC_GO1_20,
    };
    let words = if version == Version::Go1_16 { 7 } else { 8 };
    let header = 8 + 8 * words;
    let mut offsets = Vec::new();
    let mut at = header;
    for part in [&names, &cutab, &filetab, &pctab, &functab] {
        offsets.push(at as u64);
        at += part.len();
    }
    let mut out = Vec::new();
    out.extend_from_slice(&magic.to_le_bytes());
    out.extend_from_slice(&[0, 0, 1, 8]);
    out.extend_from_slice(&(funcs.len() as u64).to_le_bytes());
    out.extend_from_slice(&1u64.to_le_bytes());
    if version != Version::Go1_16 {
        out.extend_from_slice(&TEXT.to_le_bytes());
    }
    for offset in offsets {
        out.extend_from_slice(&offset.to_le_bytes());
    }
    for part in [&names, &cutab, &filetab, &pctab, &functab] {
        out.extend_from_slice(part);
    }
    out
}

fn sample_funcs() -> Vec<TestFunc> {
    vec![
        TestFunc {
            name: "runtime.goexit",
            entry: 0,
            sp: vec![(0, 0x20)],
            flags: FLAG_TOPFRAME,
            line: 10,
        },
        TestFunc {
            name: "main.work",
            entry: 0x20,
            sp: vec![(0, 4), (0x28, 0x30), (0, 0x0c)],
            flags: 0,
            line: 20,
        },
        TestFunc {
            name: "crypto/sha256.block",
            entry: 0x60,
            sp: vec![(0, 1), (8, 0x100)],
            flags: FLAG_ASM,
            line: 30,
        },
    ]
}

#[test]
fn reads_every_layout() {
    for version in [Version::Go1_16, Version::Go1_18, Version::Go1_20] {
        let bytes = build(version, &sample_funcs(), 0x101);
        let table = Table::parse(&bytes, 0).unwrap_or_else(|e| panic!("{version:?}: {e}"));
        assert_eq!(table.version(), version);
        assert_eq!(table.len(), 3);
        assert_eq!(table.range(), TEXT..TEXT + 0x161);
        let names: Vec<&str> = table.funcs().map(|f| f.unwrap().name).collect();
        assert_eq!(
            names,
            ["runtime.goexit", "main.work", "crypto/sha256.block"]
        );

        let work = table.func_at(TEXT + 0x30).unwrap().unwrap();
        assert_eq!(
            (work.name, work.entry, work.end),
            ("main.work", TEXT + 0x20, TEXT + 0x60)
        );
        let deltas: Vec<_> = table.sp_deltas(&work).map(Result::unwrap).collect();
        assert_eq!(
            deltas,
            [
                (TEXT + 0x20..TEXT + 0x24, 0),
                (TEXT + 0x24..TEXT + 0x54, 0x28),
                (TEXT + 0x54..TEXT + 0x60, 0),
            ]
        );
        assert_eq!(
            table.file_line(&work, TEXT + 0x30).unwrap(),
            Some(("main.go", 20))
        );
        let goexit = table.func_at(TEXT).unwrap().unwrap();
        assert_eq!(goexit.flags, FLAG_TOPFRAME);
        assert_eq!(table.func_at(TEXT - 1).unwrap(), None);
        for index in [3, usize::MAX] {
            assert!(matches!(table.func(index), Err(Error::Truncated { .. })));
            assert!(matches!(
                table.func_range(index),
                Err(Error::Truncated { .. })
            ));
        }
        assert_eq!(table.func_at(TEXT + 0x161).unwrap(), None);
        assert_eq!(
            table.func_at(TEXT + 0x160).unwrap().map(|f| f.name),
            Some("crypto/sha256.block")
        );
    }
}

#[test]
fn a_position_independent_table_takes_the_text_address_given() {
    let mut bytes = build(Version::Go1_18, &sample_funcs(), 0x10);
    // The header's start of text, relocated only at load time: 0 on disk.
    bytes[24..32].fill(0);
    let table = Table::parse(&bytes, 0x9000).unwrap();
    assert_eq!(table.range(), 0x9000..0x9000 + 0x70);
}

#[test]
fn refuses_other_magics_and_bad_headers() {
    let bytes = build(Version::Go1_18, &sample_funcs(), 0x10);
    let mut old = bytes.clone();
    old[..4].copy_from_slice(&0xffff_fffbu32.to_le_bytes());
    assert_eq!(
        Table::parse(&old, 0).unwrap_err(),
        Error::UnknownMagic(0xffff_fffb)
    );
    let mut bad = bytes.clone();
    bad[7] = 3;
    assert_eq!(
        Table::parse(&bad, 0).unwrap_err(),
        Error::BadHeader {
            quantum: 1,
            ptr_size: 3
        }
    );
    assert!(matches!(
        Table::parse(&bytes[..6], 0),
        Err(Error::Truncated { .. })
    ));
    assert!(matches!(Table::parse(&[], 0), Err(Error::Truncated { .. })));
}

#[test]
fn refuses_an_unsorted_index() {
    let mut bytes = build(Version::Go1_18, &sample_funcs(), 0x10);
    // Function 1's entry (index entry 1, after function 0's two fields)
    // moved past function 2's.
    let functab = u64::from_le_bytes(bytes[64..72].try_into().unwrap()) as usize;
    bytes[functab + 8..functab + 12].copy_from_slice(&0x100u32.to_le_bytes());
    assert_eq!(
        Table::parse(&bytes, 0).unwrap_err(),
        Error::Unsorted { index: 2 }
    );
}

#[test]
fn a_huge_function_count_is_an_error_not_an_allocation() {
    let mut bytes = build(Version::Go1_20, &sample_funcs(), 0x10);
    bytes[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(
        Table::parse(&bytes, 0),
        Err(Error::Truncated {
            what: "function index",
            ..
        })
    ));
}

/// Everything a user does with a table, errors ignored.
fn exercise(bytes: &[u8]) {
    let Ok(table) = Table::parse(bytes, TEXT) else {
        return;
    };
    for func in table.funcs().flatten() {
        for delta in table.sp_deltas(&func) {
            if delta.is_err() {
                break;
            }
        }
        let _ = table.file_line(&func, func.entry);
    }
    for pc in (TEXT - 8..TEXT + 0x170).step_by(7) {
        if let Ok(Some(func)) = table.func_at(pc) {
            assert!(func.contains(pc));
        }
    }
}

#[test]
fn truncations_and_bit_flips_never_panic() {
    for version in [Version::Go1_16, Version::Go1_18, Version::Go1_20] {
        let bytes = build(version, &sample_funcs(), 0x101);
        for len in 0..bytes.len() {
            exercise(&bytes[..len]);
        }
        // Every bit of every byte, one at a time.
        let mut flipped = bytes.clone();
        for at in 0..bytes.len() {
            for bit in 0..8 {
                flipped[at] ^= 1 << bit;
                exercise(&flipped);
                flipped[at] ^= 1 << bit;
            }
        }
        // Whole bytes set to extremes.
        for at in 0..bytes.len() {
            for value in [0x00, 0x7f, 0x80, 0xff] {
                flipped[at] = value;
                exercise(&flipped);
                flipped[at] = bytes[at];
            }
        }
    }
}

#[test]
fn truncated_tables_say_what_is_missing() {
    let bytes = build(Version::Go1_18, &sample_funcs(), 0x10);
    // Cut inside the function records: the index parses, a record not.
    let cut = &bytes[..bytes.len() - 10];
    match Table::parse(cut, 0) {
        Ok(table) => {
            assert!(matches!(
                table.func(2),
                Err(Error::Truncated {
                    what: "function record",
                    ..
                })
            ));
        }
        Err(err) => panic!("{err}"),
    }
}

#[test]
fn pc_value_varints_longer_than_32_bits_are_errors() {
    let func = Func {
        index: 0,
        entry: 0x1000,
        end: 0x2000,
        name: "f",
        func_id: 0,
        flags: 0,
        pcsp: 1,
        pcfile: 0,
        pcln: 0,
        cu_offset: 0,
        pcdata: &[],
    };
    let pctab = [0u8, 0xff, 0xff, 0xff, 0xff, 0x7f, 0x01];
    let table = Table {
        version: Version::Go1_18,
        quantum: 1,
        ptr_size: 8,
        nfunc: 0,
        text_start: 0,
        funcnametab: &[],
        cutab: &[],
        filetab: &[],
        pctab: &pctab,
        functab: &[],
        field: 4,
    };
    let mut values = table.sp_deltas(&func);
    assert_eq!(values.next(), Some(Err(Error::BadPcValue { offset: 1 })));
    assert_eq!(values.next(), None);
}

/// The table of a real Go program (the end-to-end tests build one too, and
/// assert more).
#[test]
#[ignore = "needs go (cargo xtask setup installs golang-go): run by `cargo xtask test`"]
fn reads_the_table_of_a_go_binary() {
    use std::process::Command;
    if let Err(err) = Command::new("go").arg("version").output() {
        panic!("running `go version`: {err} (cargo xtask setup installs golang-go)");
    }
    let dir = std::env::temp_dir().join(format!("gopclntab-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("main.go"),
        "package main\n\n//go:noinline\nfunc leaf(n int) int { return n * 3 }\n\nfunc main() { println(leaf(4)) }\n",
    )
    .unwrap();
    let binary = dir.join("prog");
    let status = Command::new("go")
        .args(["build", "-ldflags=-s -w", "-o"])
        .arg(&binary)
        .arg("main.go")
        .current_dir(&dir)
        .env("GOCACHE", dir.join("cache"))
        .env("GOPATH", dir.join("gopath"))
        .env("GO111MODULE", "off")
        .env("GOFLAGS", "")
        .status()
        .unwrap();
    assert!(status.success());
    let elf = std::fs::read(&binary).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    let (pclntab, text) = sections(&elf, ".gopclntab", ".text");
    let table = Table::parse(pclntab, text).unwrap();
    let leaf = table
        .funcs()
        .map(Result::unwrap)
        .find(|f| f.name == "main.leaf")
        .expect("main.leaf listed");
    assert_eq!(table.func_at(leaf.entry).unwrap(), Some(leaf));
    let (file, line) = table.file_line(&leaf, leaf.entry).unwrap().unwrap();
    assert!(file.ends_with("main.go"), "{file}");
    assert_eq!(line, 4);
    // A leaf without a frame: its stack pointer never moves.
    assert!(table.sp_deltas(&leaf).all(|d| d.unwrap().1 == 0));
    for name in ["runtime.goexit", "runtime.mstart", "runtime.rt0_go"] {
        let func = table.funcs().map(Result::unwrap).find(|f| f.name == name);
        assert_eq!(
            func.map(|f| f.flags & FLAG_TOPFRAME),
            Some(FLAG_TOPFRAME),
            "{name}"
        );
    }
    let systemstack = table
        .funcs()
        .map(Result::unwrap)
        .find(|f| f.name == "runtime.systemstack")
        .unwrap();
    assert_ne!(systemstack.flags & FLAG_SPWRITE, 0);
}

/// Two sections' bytes and addresses from a 64-bit little-endian ELF
/// file: enough of ELF for one test, without a dependency.
fn sections<'a>(elf: &'a [u8], data_name: &str, address_name: &str) -> (&'a [u8], u64) {
    let u16_at = |at: usize| u16::from_le_bytes(elf[at..at + 2].try_into().unwrap());
    let u32_at = |at: usize| u32::from_le_bytes(elf[at..at + 4].try_into().unwrap());
    let u64_at = |at: usize| u64::from_le_bytes(elf[at..at + 8].try_into().unwrap());
    let shoff = u64_at(0x28) as usize;
    let (shentsize, shnum, shstrndx) = (u16_at(0x3a) as usize, u16_at(0x3c), u16_at(0x3e));
    let header = |i: u16| shoff + usize::from(i) * shentsize;
    let strtab = u64_at(header(shstrndx) + 0x18) as usize;
    let name_of = |i: u16| {
        let at = strtab + u32_at(header(i)) as usize;
        let len = elf[at..].iter().position(|&b| b == 0).unwrap();
        std::str::from_utf8(&elf[at..at + len]).unwrap()
    };
    let find = |name: &str| (0..shnum).find(|&i| name_of(i) == name).unwrap();
    let data = header(find(data_name));
    let (offset, size) = (u64_at(data + 0x18) as usize, u64_at(data + 0x20) as usize);
    let address = u64_at(header(find(address_name)) + 0x10);
    (&elf[offset..offset + size], address)
}

#[cfg(feature = "elf")]
#[test]
fn elf_files_without_a_go_table_have_none() {
    use crate::elf::{ElfError, GoFunctions};
    let c_program = std::fs::File::open("/bin/true").unwrap();
    assert!(GoFunctions::read(&c_program).unwrap().is_none());
    let dir = std::env::temp_dir().join(format!("gopclntab-elf-{}", std::process::id()));
    std::fs::write(&dir, b"not an ELF file").unwrap();
    let result = GoFunctions::read(&std::fs::File::open(&dir).unwrap());
    std::fs::remove_file(&dir).ok();
    assert!(matches!(result, Err(ElfError::Elf(_))));
}

#[cfg(feature = "elf")]
#[test]
#[ignore = "needs Debian's Go 1.19 in /usr/lib/go-1.19 (cargo xtask setup installs golang-go): run by `cargo xtask test`"]
fn the_table_cache_stays_within_its_entries_and_bytes() {
    use crate::elf::{GoFunctions, GoTableCache};
    use std::sync::Arc;
    // Real Go programs: Debian's Go toolchain (a setup package).
    let read = |path: &str| {
        let file = std::fs::File::open(path).unwrap_or_else(|err| panic!("{path}: {err}"));
        Arc::new(GoFunctions::read(&file).unwrap().expect("a Go table"))
    };
    let go = read("/usr/lib/go-1.19/bin/go");
    let gofmt = read("/usr/lib/go-1.19/bin/gofmt");
    let (big, small) = (go.heap_bytes(), gofmt.heap_bytes());
    assert!(big > small && small > 0);

    // Room for the big table and not both.
    let mut cache = GoTableCache::new(10, big + small - 1);
    cache.insert("go", Some(Arc::clone(&go)));
    cache.insert("none", None);
    assert_eq!(cache.bytes(), big);
    assert!(cache.get("go").unwrap().is_some());
    assert!(
        cache.get("none").unwrap().is_none(),
        "known to have no table"
    );
    assert!(cache.get("other").is_none(), "never read");
    cache.insert("gofmt", Some(Arc::clone(&gofmt)));
    assert_eq!(cache.bytes(), small, "over the bytes: started over");
    assert!(cache.get("go").is_none());
    // The same key again replaces its bytes.
    cache.insert("gofmt", Some(gofmt));
    assert_eq!(cache.bytes(), small);

    // And over the entries.
    let mut cache = GoTableCache::new(2, usize::MAX);
    for key in ["a", "b", "c"] {
        cache.insert(key, None);
    }
    assert!(cache.get("a").is_none() && cache.get("c").is_some());
}
