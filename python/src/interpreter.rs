//! Whether an ELF file is a CPython interpreter, and which.
//!
//! Distributions link libpython into `python3.X` (Debian's binary is
//! stripped but exports `_PyRuntime`); pyenv and others build a small
//! launcher and a `libpython3.X.so`. Either way the file that holds the
//! interpreter exports `_PyRuntime` (the runtime state every walk starts
//! from) and, since 3.11, `Py_Version` (`PY_VERSION_HEX`); every build
//! also keeps `_PyRuntime` alone in a section named `.PyRuntime`, the
//! fallback when its symbol is gone.

use std::{fs::File, ops::Range};

use object::{
    Endianness, Object as _, ObjectSection as _, ObjectSymbol as _, ReadCache, read::elf::ElfFile64,
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
}

/// Why a file could not be read as an interpreter.
#[derive(Debug, thiserror::Error)]
pub enum InterpreterError {
    #[error("not a 64-bit ELF file: {0}")]
    Malformed(#[source] object::Error),
    #[error("`_PyRuntime` is there but no `Py_Version` (CPython before 3.11 is not read)")]
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

    /// Reads `file`; None when it holds no interpreter (no `_PyRuntime`).
    /// Only the headers, symbol tables and the 4 bytes of `Py_Version` are
    /// read, not the whole (often 20 MB) file.
    pub fn read(file: &File) -> Result<Option<Self>, InterpreterError> {
        let cache = ReadCache::new(file);
        let elf = ElfFile64::<Endianness, _>::parse(&cache).map_err(InterpreterError::Malformed)?;
        let symbol = |name: &str| {
            elf.dynamic_symbols()
                .chain(elf.symbols())
                .find(|symbol| symbol.name_bytes() == Ok(name.as_bytes()) && symbol.address() != 0)
                .map(|symbol| symbol.address()..symbol.address() + symbol.size())
        };
        let runtime = symbol("_PyRuntime").map(|range| range.start).or_else(|| {
            elf.section_by_name(".PyRuntime")
                .map(|section| section.address())
        });
        let Some(runtime) = runtime else {
            return Ok(None);
        };
        let version_hex = symbol("Py_Version")
            .and_then(|range| {
                let address = range.start;
                elf.sections().find_map(|section| {
                    let bytes = section.data_range(address, 4).ok()??;
                    Some(u32::from_le_bytes(bytes.try_into().ok()?))
                })
            })
            .ok_or(InterpreterError::NoVersion)?;
        let eval = symbol("_PyEval_EvalFrameDefault").filter(|range| !range.is_empty());
        Ok(Some(Self {
            version_hex,
            runtime,
            eval,
        }))
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;

    #[test]
    fn a_program_without_a_runtime_is_no_interpreter() {
        let own = File::open("/proc/self/exe").expect("this test's binary");
        assert_eq!(Interpreter::read(&own).expect("an ELF file"), None);
    }

    #[test]
    fn a_file_that_is_not_elf_is_an_error_not_a_panic() {
        for bytes in [&b"#!/bin/sh\necho hi\n"[..], b"\x7fELF\x02\x01\x01", b""] {
            let mut file = tempfile::tempfile().expect("a temporary file");
            file.write_all(bytes).expect("writing");
            assert!(matches!(
                Interpreter::read(&file),
                Err(InterpreterError::Malformed(_))
            ));
        }
    }

    #[test]
    fn the_version_is_major_and_minor_of_the_hex() {
        let interpreter = Interpreter {
            version_hex: 0x030D00F0,
            runtime: 0,
            eval: None,
        };
        assert_eq!(interpreter.version(), (3, 13));
    }
}
