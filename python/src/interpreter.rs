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
    /// read here); None when the file has no such symbol.
    pub eval: Option<Range<u64>>,
    /// What `_Py_DebugOffsets` says (3.13+; None before, or when the file
    /// holds no such table).
    pub debug_offsets: Option<DebugOffsets>,
}

/// The offsets of `_Py_DebugOffsets` (CPython 3.13) that the profiler's
/// layout also states: thread state, frame and code object fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DebugOffsets {
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

/// `_Py_DebugOffsets` as 3.13 lays it out: the cookie, then 8-byte words.
const DEBUG_COOKIE: &[u8; 8] = b"xdebugpy";
/// Word indexes of the fields read, and how many words are read.
const DEBUG_WORDS: usize = 44;
const DEBUG_VERSION: usize = 1;
const DEBUG_TSTATE_CURRENT_FRAME: usize = 23;
const DEBUG_FRAME_PREVIOUS: usize = 29;
const DEBUG_FRAME_EXECUTABLE: usize = 30;
const DEBUG_FRAME_INSTR_PTR: usize = 31;
const DEBUG_FRAME_OWNER: usize = 33;
const DEBUG_CODE_FILENAME: usize = 35;
const DEBUG_CODE_QUALNAME: usize = 37;
const DEBUG_CODE_LINETABLE: usize = 38;
const DEBUG_CODE_FIRSTLINENO: usize = 39;
const DEBUG_CODE_BYTECODE: usize = 43;

impl DebugOffsets {
    /// Parses the start of a 3.13 `_PyRuntime`; None without the cookie
    /// or when its version is not `version_hex`.
    pub fn parse(bytes: &[u8], version_hex: u32) -> Option<Self> {
        if bytes.len() < DEBUG_WORDS * 8 || &bytes[..8] != DEBUG_COOKIE {
            return None;
        }
        let word =
            |index: usize| u64::from_le_bytes(bytes[index * 8..][..8].try_into().expect("8 bytes"));
        if word(DEBUG_VERSION) != u64::from(version_hex) {
            return None;
        }
        Some(Self {
            tstate_current_frame: word(DEBUG_TSTATE_CURRENT_FRAME),
            frame_previous: word(DEBUG_FRAME_PREVIOUS),
            frame_executable: word(DEBUG_FRAME_EXECUTABLE),
            frame_instr_ptr: word(DEBUG_FRAME_INSTR_PTR),
            frame_owner: word(DEBUG_FRAME_OWNER),
            code_filename: word(DEBUG_CODE_FILENAME),
            code_qualname: word(DEBUG_CODE_QUALNAME),
            code_linetable: word(DEBUG_CODE_LINETABLE),
            code_firstlineno: word(DEBUG_CODE_FIRSTLINENO),
            code_bytecode: word(DEBUG_CODE_BYTECODE),
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
        let eval = eval.filter(|range| !range.is_empty());
        let debug_offsets = elf
            .read_at_address(runtime, DEBUG_WORDS * 8)
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
            eval: None,
            debug_offsets: None,
        };
        assert_eq!(interpreter.version(), (3, 13));
    }

    #[test]
    fn debug_offsets_need_their_cookie_and_the_files_version() {
        let mut bytes = vec![0u8; DEBUG_WORDS * 8];
        bytes[..8].copy_from_slice(DEBUG_COOKIE);
        bytes[8..16].copy_from_slice(&0x030D00F0u64.to_le_bytes());
        bytes[DEBUG_CODE_QUALNAME * 8..][..8].copy_from_slice(&128u64.to_le_bytes());
        let parsed = DebugOffsets::parse(&bytes, 0x030D00F0).expect("a table");
        assert_eq!(parsed.code_qualname, 128);
        assert_eq!(
            DebugOffsets::parse(&bytes, 0x030E00F0),
            None,
            "another version"
        );
        assert_eq!(DebugOffsets::parse(&bytes[..64], 0x030D00F0), None, "short");
        bytes[0] = b'X';
        assert_eq!(DebugOffsets::parse(&bytes, 0x030D00F0), None, "no cookie");
    }
}
