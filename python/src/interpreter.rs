//! Whether an ELF file is a CPython interpreter, and which.
//!
//! Distributions link libpython into `python3.X` (Debian's binary is
//! stripped but exports `_PyRuntime`); pyenv and others build a small
//! launcher and a `libpython3.X.so`. Either way the file that holds the
//! interpreter exports `_PyRuntime` (the runtime state every walk starts
//! from) and, since 3.11, `Py_Version` (`PY_VERSION_HEX`; before, the
//! version is the one in the file's name, `python3.10` or
//! `libpython3.10.so.1.0`, as the build names it); every build
//! also keeps `_PyRuntime` alone in a section named `.PyRuntime`, the
//! fallback when its symbol is gone. Since 3.13 `_PyRuntime` starts with
//! `_Py_DebugOffsets`, the interpreter's own statement of where its fields
//! are; its initial value is in the file.

use std::{fs::File, ops::Range, path::Path};

use object::elf::FileHeader64;

use crate::eval_parts::{CallFrameSections, split_parts};
use object::{
    Endianness, ReadCache, SectionIndex, elf,
    read::elf::{FileHeader as _, SectionHeader as _, SectionTable},
};

/// A CPython interpreter found in an ELF file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interpreter {
    /// `PY_VERSION_HEX`: major, minor, micro, release level and serial.
    pub version_hex: u32,
    /// Address of `_PyRuntime` in the file's virtual address space (add
    /// the mapping's bias for its address in a process).
    pub runtime: u64,
    /// The code of `_PyEval_EvalFrameDefault`, the evaluation loop whose
    /// native frames the Python frames replace (exported by every build
    /// read here): its symbol's range first, then the parts a compiler
    /// split off it (see [`crate::eval_parts`]). Empty when the file has
    /// no such symbol.
    pub eval: Vec<Range<u64>>,
    /// What `_Py_DebugOffsets` says (3.13+; None before, or when the file
    /// holds no such table).
    pub debug_offsets: Option<DebugOffsets>,
}

/// The offsets of `_Py_DebugOffsets` (CPython 3.13+) that the profiler's
/// layout also states: thread state, frame and code object fields; and
/// whether the build is free-threaded (3.14 says; 3.13's table does not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DebugOffsets {
    pub free_threaded: bool,
    pub tstate_current_frame: u64,
    pub frame_previous: u64,
    pub frame_executable: u64,
    pub frame_instr_ptr: u64,
    pub frame_owner: u64,
    pub code_filename: u64,
    pub code_qualname: u64,
    pub code_linetable: u64,
    pub code_firstlineno: u64,
    pub code_bytecode: u64,
}

/// `_Py_DebugOffsets` starts with this cookie, then 8-byte words: the
/// version and `free_threaded` (3.13.0 has it too, as gdb shows its
/// `struct _Py_DebugOffsets`), then the offsets, grouped by structure.
/// Which word holds which offset changes between minor versions (3.14 adds
/// fields to the interpreter state, the frame and the code object groups),
/// never within one.
const DEBUG_COOKIE: &[u8; 8] = b"xdebugpy";
const DEBUG_VERSION: usize = 1;
/// Bytes read at `_PyRuntime`: every version's words below lie within.
const DEBUG_BYTES: usize = 49 * 8;

/// Word indexes of the fields read, in one minor version's table.
struct DebugWords {
    free_threaded: usize,
    tstate_current_frame: usize,
    frame_previous: usize,
    frame_executable: usize,
    frame_instr_ptr: usize,
    frame_owner: usize,
    code_filename: usize,
    code_qualname: usize,
    code_linetable: usize,
    code_firstlineno: usize,
    code_bytecode: usize,
}

impl DebugWords {
    /// The table of CPython `major.minor`, if this profiler knows it.
    fn of(version: (u8, u8)) -> Option<Self> {
        match version {
            (3, 13) => Some(Self {
                free_threaded: 2,
                tstate_current_frame: 23,
                frame_previous: 29,
                frame_executable: 30,
                frame_instr_ptr: 31,
                frame_owner: 33,
                code_filename: 35,
                code_qualname: 37,
                code_linetable: 38,
                code_firstlineno: 39,
                code_bytecode: 43,
            }),
            (3, 14) => Some(Self {
                free_threaded: 2,
                tstate_current_frame: 26,
                frame_previous: 32,
                frame_executable: 33,
                frame_instr_ptr: 34,
                frame_owner: 36,
                code_filename: 40,
                code_qualname: 42,
                code_linetable: 43,
                code_firstlineno: 44,
                code_bytecode: 48,
            }),
            _ => None,
        }
    }
}

impl DebugOffsets {
    /// Parses the start of a 3.13+ `_PyRuntime`; None without the cookie,
    /// when its version is not `version_hex` or is one whose table this
    /// profiler does not know.
    pub fn parse(bytes: &[u8], version_hex: u32) -> Option<Self> {
        if bytes.len() < DEBUG_BYTES || &bytes[..8] != DEBUG_COOKIE {
            return None;
        }
        let word =
            |index: usize| u64::from_le_bytes(bytes[index * 8..][..8].try_into().expect("8 bytes"));
        if word(DEBUG_VERSION) != u64::from(version_hex) {
            return None;
        }
        let words = DebugWords::of(((version_hex >> 24) as u8, (version_hex >> 16) as u8))?;
        Some(Self {
            free_threaded: word(words.free_threaded) != 0,
            tstate_current_frame: word(words.tstate_current_frame),
            frame_previous: word(words.frame_previous),
            frame_executable: word(words.frame_executable),
            frame_instr_ptr: word(words.frame_instr_ptr),
            frame_owner: word(words.frame_owner),
            code_filename: word(words.code_filename),
            code_qualname: word(words.code_qualname),
            code_linetable: word(words.code_linetable),
            code_firstlineno: word(words.code_firstlineno),
            code_bytecode: word(words.code_bytecode),
        })
    }
}

/// Why a file could not be read as an interpreter.
#[derive(Debug, thiserror::Error)]
pub enum InterpreterError {
    #[error("not a 64-bit ELF file: {0}")]
    Malformed(#[source] object::Error),
    #[error(
        "`_PyRuntime` is there but neither `Py_Version` (3.11+) nor a version before 3.11 in \
         the file's name"
    )]
    NoVersion,
}

impl Interpreter {
    /// Major and minor version, as in `(3, 12)`.
    pub fn version(&self) -> (u8, u8) {
        (
            (self.version_hex >> 24) as u8,
            (self.version_hex >> 16) as u8,
        )
    }

    /// Reads `file` (named `path`); None when it holds no interpreter (no
    /// `_PyRuntime`). Only the headers, the symbol tables and the bytes of
    /// `Py_Version` and `_Py_DebugOffsets` are read, not the whole (often
    /// 20 MB) file, each table with one read: through a cache of small
    /// reads every symbol name was a read of its own (a pyenv
    /// libpython3.10, whose full table is searched, took 630 ms in a debug
    /// build, while the process's samples waited for their Python frames).
    /// Not mapped: the file comes from a container, which could truncate
    /// it under the mapping and fault the agent.
    pub fn read(file: &File, path: &Path) -> Result<Option<Self>, InterpreterError> {
        // Only the file and section headers through the cache: parsing the
        // whole file (`ElfFile64`) would read every symbol table whole,
        // however large a file in a container makes them.
        let cache = ReadCache::new(file);
        let header =
            FileHeader64::<Endianness>::parse(&cache).map_err(InterpreterError::Malformed)?;
        let endian = header.endian().map_err(InterpreterError::Malformed)?;
        let sections = header
            .sections(endian, &cache)
            .map_err(InterpreterError::Malformed)?;
        let elf = Elf {
            file,
            endian,
            sections: &sections,
        };
        let [runtime, version, eval] =
            elf.find_symbols(["_PyRuntime", "Py_Version", "_PyEval_EvalFrameDefault"]);
        let runtime = runtime.map(|range| range.start).or_else(|| {
            let (_, section) = sections.section_by_name(endian, b".PyRuntime")?;
            Some(section.sh_addr(endian))
        });
        let Some(runtime) = runtime else {
            return Ok(None);
        };
        let version_hex = version
            .and_then(|range| {
                let bytes = elf.read_at_address(range.start, 4)?;
                Some(u32::from_le_bytes(bytes.try_into().ok()?))
            })
            .or_else(|| {
                // Before 3.11 only the name says; a name that claims a
                // later version without `Py_Version` is not believed.
                let (major, minor) = version_in_name(path).filter(|&v| v < (3, 11))?;
                Some((u32::from(major) << 24) | (u32::from(minor) << 16))
            })
            .ok_or(InterpreterError::NoVersion)?;
        let eval = eval
            .filter(|range| !range.is_empty())
            .map(|range| elf.eval_code(range))
            .unwrap_or_default();
        let debug_offsets = elf
            .read_at_address(runtime, DEBUG_BYTES)
            .and_then(|bytes| DebugOffsets::parse(&bytes, version_hex));
        Ok(Some(Self {
            version_hex,
            runtime,
            eval,
            debug_offsets,
        }))
    }
}

/// An interpreter's ELF file: its section headers, and the file for the
/// sections' bytes.
struct Elf<'data> {
    file: &'data File,
    endian: Endianness,
    sections: &'data SectionTable<'data, FileHeader64<Endianness>, &'data ReadCache<&'data File>>,
}

/// Symbol tables (and their names) larger than this are not read: a
/// libpython's full table and names are under 1 MB (3.12's: 359 KiB and
/// 386 KiB), and both are held at once, outside the agent's memory budget.
const MAX_TABLE_BYTES: u64 = 16 << 20;

/// `Elf64_Sym`'s size.
const SYMBOL_SIZE: usize = 24;

impl Elf<'_> {
    /// The evaluation loop's code: `symbol`'s range, then the parts split
    /// off it that `.eh_frame` shows.
    fn eval_code(&self, symbol: Range<u64>) -> Vec<Range<u64>> {
        let mut code = vec![symbol.clone()];
        let (Some((hdr, hdr_address)), Some((eh_frame, eh_frame_address))) =
            (self.section(b".eh_frame_hdr"), self.section(b".eh_frame"))
        else {
            return code;
        };
        let sections = CallFrameSections {
            hdr: &hdr,
            hdr_address,
            eh_frame: &eh_frame,
            eh_frame_address,
        };
        let read = |range: &Range<u64>| {
            let len = usize::try_from(range.end.checked_sub(range.start)?).ok()?;
            self.read_at_address(range.start, len)
        };
        code.extend(split_parts(symbol, read, &sections));
        code
    }

    /// The bytes of the section `name` (read whole, bounded) and its
    /// address.
    fn section(&self, name: &[u8]) -> Option<(Vec<u8>, u64)> {
        let endian = self.endian;
        let (_, header) = self.sections.section_by_name(endian, name)?;
        let size = header.sh_size(endian);
        if size > MAX_TABLE_BYTES || header.sh_type(endian) == elf::SHT_NOBITS {
            return None;
        }
        let bytes = read_exact_at(self.file, header.sh_offset(endian), size as usize)?;
        Some((bytes, header.sh_addr(endian)))
    }

    /// `len` bytes of the file's contents at virtual `address`, from the
    /// loaded section that holds them; `None` when none holds them all (or
    /// their read fails).
    fn read_at_address(&self, address: u64, len: usize) -> Option<Vec<u8>> {
        let endian = self.endian;
        let end = address.checked_add(len as u64)?;
        let section = self.sections.iter().find(|section| {
            let start = section.sh_addr(endian);
            section.sh_flags(endian).0 & elf::SHF_ALLOC.0 != 0
                && section.sh_type(endian) != elf::SHT_NOBITS
                && start <= address
                && end <= start.saturating_add(section.sh_size(endian))
        })?;
        let offset = section
            .sh_offset(endian)
            .checked_add(address - section.sh_addr(endian))?;
        read_exact_at(self.file, offset, len)
    }

    /// The address ranges of the symbols `names`, each the first defined
    /// one of its name in the dynamic symbols, then in the full table. One
    /// pass over each table for all of them, the full table only for what
    /// the dynamic symbols lack (an interpreter exports all three but 3.10's
    /// and 3.11's evaluation loop).
    fn find_symbols<const N: usize>(&self, names: [&str; N]) -> [Option<Range<u64>>; N] {
        let mut found: [Option<Range<u64>>; N] = std::array::from_fn(|_| None);
        for kind in [elf::SHT_DYNSYM, elf::SHT_SYMTAB] {
            if found.iter().all(Option::is_some) {
                break;
            }
            let Some((symbols, strings)) = self.symbol_table(kind) else {
                continue;
            };
            for entry in symbols.chunks_exact(SYMBOL_SIZE) {
                let Some(symbol) = Symbol::parse(entry, self.endian) else {
                    continue;
                };
                if symbol.value == 0 {
                    continue;
                }
                let Some(name) = strings
                    .get(symbol.name as usize..)
                    .and_then(|tail| tail.split(|&byte| byte == 0).next())
                else {
                    continue;
                };
                if let Some(at) =
                    (0..N).find(|&i| found[i].is_none() && names[i].as_bytes() == name)
                {
                    found[at] = Some(symbol.value..symbol.value.saturating_add(symbol.size));
                    if found.iter().all(Option::is_some) {
                        break;
                    }
                }
            }
        }
        found
    }

    /// The first section of `kind` (`SHT_DYNSYM`, `SHT_SYMTAB`) and the
    /// string table it links to, each read whole with one read (and
    /// bounded).
    fn symbol_table(&self, kind: elf::SectionType) -> Option<(Vec<u8>, Vec<u8>)> {
        let endian = self.endian;
        let table = self
            .sections
            .iter()
            .find(|header| header.sh_type(endian) == kind)?;
        let strings = self
            .sections
            .section(SectionIndex(table.sh_link(endian) as usize))
            .ok()?;
        let read = |header: &elf::SectionHeader64<Endianness>| {
            let size = header.sh_size(endian);
            (size <= MAX_TABLE_BYTES)
                .then(|| read_exact_at(self.file, header.sh_offset(endian), size as usize))
                .flatten()
        };
        Some((read(table)?, read(strings)?))
    }
}

fn read_exact_at(file: &File, offset: u64, len: usize) -> Option<Vec<u8>> {
    use std::os::unix::fs::FileExt as _;
    let mut bytes = vec![0; len];
    file.read_exact_at(&mut bytes, offset).ok()?;
    Some(bytes)
}

/// The fields of an `Elf64_Sym` a lookup by name needs.
struct Symbol {
    name: u32,
    value: u64,
    size: u64,
}

impl Symbol {
    fn parse(entry: &[u8], endian: Endianness) -> Option<Self> {
        let word = |at: usize| -> Option<u32> {
            let bytes = entry.get(at..at + 4)?.try_into().ok()?;
            Some(match endian {
                Endianness::Little => u32::from_le_bytes(bytes),
                Endianness::Big => u32::from_be_bytes(bytes),
            })
        };
        let quad = |at: usize| -> Option<u64> {
            let bytes = entry.get(at..at + 8)?.try_into().ok()?;
            Some(match endian {
                Endianness::Little => u64::from_le_bytes(bytes),
                Endianness::Big => u64::from_be_bytes(bytes),
            })
        };
        Some(Self {
            name: word(0)?,
            value: quad(8)?,
            size: quad(16)?,
        })
    }
}

/// The version in an interpreter's file name: `python3.10`,
/// `libpython3.10.so.1.0`, `libpython3.10d.so`.
fn version_in_name(path: &Path) -> Option<(u8, u8)> {
    let name = path.file_name()?.to_str()?;
    let rest = name
        .strip_prefix("libpython")
        .or_else(|| name.strip_prefix("python"))?;
    let (major, rest) = rest.split_once('.')?;
    let minor: String = rest.chars().take_while(char::is_ascii_digit).collect();
    Some((major.parse().ok()?, minor.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;

    #[test]
    fn a_program_without_a_runtime_is_no_interpreter() {
        let own = File::open("/proc/self/exe").expect("this test's binary");
        assert_eq!(
            Interpreter::read(&own, Path::new("/usr/bin/python3.10")).expect("an ELF file"),
            None
        );
    }

    #[test]
    fn a_file_that_is_not_elf_is_an_error_not_a_panic() {
        for bytes in [&b"#!/bin/sh\necho hi\n"[..], b"\x7fELF\x02\x01\x01", b""] {
            let mut file = tempfile::tempfile().expect("a temporary file");
            file.write_all(bytes).expect("writing");
            assert!(matches!(
                Interpreter::read(&file, Path::new("python3")),
                Err(InterpreterError::Malformed(_))
            ));
        }
    }

    #[test]
    fn a_version_is_read_from_names_as_builds_make_them() {
        for (name, version) in [
            ("/usr/bin/python3.10", Some((3, 10))),
            ("/opt/lib/libpython3.10.so.1.0", Some((3, 10))),
            ("libpython3.9d.so", Some((3, 9))),
            ("/usr/bin/python3", None),
            ("python", None),
            ("libpython3.x.so", None),
            ("pythonista", None),
        ] {
            assert_eq!(version_in_name(Path::new(name)), version, "{name}");
        }
    }

    #[test]
    fn the_version_is_major_and_minor_of_the_hex() {
        let interpreter = Interpreter {
            version_hex: 0x030D00F0,
            runtime: 0,
            eval: Vec::new(),
            debug_offsets: None,
        };
        assert_eq!(interpreter.version(), (3, 13));
    }

    /// The range of the symbol `name` in the full symbol table of `path`.
    fn symbol_range(path: &Path, name: &str) -> Range<u64> {
        use object::{Object as _, ObjectSymbol as _};
        let data = std::fs::read(path).expect("reading the fixture");
        let file = object::File::parse(&*data).expect("an ELF file");
        let symbol = file
            .symbols()
            .find(|symbol| symbol.name() == Ok(name))
            .unwrap_or_else(|| panic!("no symbol {name} in {}", path.display()));
        symbol.address()..symbol.address() + symbol.size()
    }

    /// GCC splits the loop's cold paths into `_PyEval_EvalFrameDefault.cold`,
    /// which a stripped build names nowhere: the part is found from the
    /// loop's jumps and `.eh_frame`, and the function the loop tail-calls is
    /// not taken for a part.
    #[test]
    fn the_parts_gcc_split_off_the_loop_are_found_in_a_stripped_build() {
        let fixture = stackscope_test_fixtures::Fixture::compile_with(
            "python_split_eval",
            "gcc",
            &["python_split_eval.c"],
            &["-O2", "-rdynamic", "-fno-toplevel-reorder"],
        );
        let symbol = symbol_range(&fixture.path, "_PyEval_EvalFrameDefault");
        let cold = symbol_range(&fixture.path, "_PyEval_EvalFrameDefault.cold");
        let tail_called = symbol_range(&fixture.path, "empty_frame");
        let stripped = fixture.path.with_file_name("python3.14");
        let status = std::process::Command::new("strip")
            .arg("-o")
            .arg(&stripped)
            .arg(&fixture.path)
            .status()
            .expect("running strip");
        assert!(status.success(), "strip failed: {status}");

        let file = File::open(&stripped).expect("the stripped fixture");
        let interpreter = Interpreter::read(&file, &stripped)
            .expect("an ELF file")
            .expect("an interpreter");
        assert_eq!(interpreter.version(), (3, 14));
        assert_eq!(interpreter.eval, vec![symbol, cold.clone()]);
        assert!(
            !interpreter
                .eval
                .iter()
                .any(|code| code.contains(&tail_called.start)),
            "{tail_called:x?} taken for a part"
        );
    }

    /// A table of `version_hex` with `value` in word `index`.
    fn debug_table(version_hex: u32, index: usize, value: u64) -> Vec<u8> {
        let mut bytes = vec![0u8; DEBUG_BYTES];
        bytes[..8].copy_from_slice(DEBUG_COOKIE);
        bytes[8..16].copy_from_slice(&u64::from(version_hex).to_le_bytes());
        bytes[index * 8..][..8].copy_from_slice(&value.to_le_bytes());
        bytes
    }

    #[test]
    fn debug_offsets_need_their_cookie_and_the_files_version() {
        let mut bytes = debug_table(0x030D00F0, 37, 128);
        let parsed = DebugOffsets::parse(&bytes, 0x030D00F0).expect("a table");
        assert_eq!(parsed.code_qualname, 128);
        assert!(!parsed.free_threaded);
        // A 3.13t says so as 3.14t does: refused by name, not only by an
        // offset that differs.
        let free_threaded =
            DebugOffsets::parse(&debug_table(0x030D00F0, 2, 1), 0x030D00F0).expect("a table");
        assert!(free_threaded.free_threaded);
        assert_eq!(
            DebugOffsets::parse(&bytes, 0x030E00F0),
            None,
            "another version"
        );
        assert_eq!(DebugOffsets::parse(&bytes[..64], 0x030D00F0), None, "short");
        bytes[0] = b'X';
        assert_eq!(DebugOffsets::parse(&bytes, 0x030D00F0), None, "no cookie");
        // A version whose table is not known is not guessed at.
        assert_eq!(
            DebugOffsets::parse(&debug_table(0x030F00A1, 37, 128), 0x030F00A1),
            None
        );
    }

    #[test]
    fn a_3_14_table_is_read_from_its_own_words_and_says_when_it_is_free_threaded() {
        let bytes = debug_table(0x030E0AF0, 42, 128);
        let parsed = DebugOffsets::parse(&bytes, 0x030E0AF0).expect("a table");
        assert_eq!(parsed.code_qualname, 128);
        assert!(!parsed.free_threaded);
        let free_threaded =
            DebugOffsets::parse(&debug_table(0x030E0AF0, 2, 1), 0x030E0AF0).expect("a table");
        assert!(free_threaded.free_threaded);
    }
}
