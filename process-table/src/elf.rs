//! The two facts this crate needs from an ELF file: its GNU build-id and its
//! `PT_LOAD` segments.
//!
//! Owns: reading those lazily from an open file, touching only the ELF
//! header, the program headers and the note segments (a few KiB even for a
//! 200 MB library), and falling back to the `.note.gnu.build-id` section
//! when no note segment holds the build-id.
//!
//! Does not own: unwind tables, symbols or anything else in the file (the
//! table compiler and the symbolizer open the file themselves), nor the
//! fallback identity for files without a build-id ([`object_id`](crate::object_id)).

use std::{fs::File, os::unix::fs::FileExt as _};

use object::{
    Endianness,
    elf::{self, FileHeader32, FileHeader64},
    read::{
        ReadCache,
        elf::{FileHeader, NoteIterator, ProgramHeader as _, SectionHeader as _},
    },
};
use thiserror::Error;

use crate::object_id::BuildId;

/// Note segments and sections larger than this are skipped: real ones hold a
/// handful of notes (well under 1 KiB), and a corrupt header must not make
/// us allocate the size it claims.
pub const MAX_NOTES_BYTES: u64 = 1 << 20;

/// Size of the identification bytes at the start of every ELF file, and the
/// index of the class byte in them (`object` models them as a struct).
const EI_NIDENT: usize = 16;
const EI_CLASS: usize = 4;

/// The name of the section the build-id lives in.
const BUILD_ID_SECTION: &[u8] = b".note.gnu.build-id";

/// A `PT_LOAD` program header: what the loader maps, from where.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LoadSegment {
    /// `p_offset`: where the segment starts in the file.
    pub offset: u64,
    /// `p_vaddr`: where it starts in the ELF's virtual address space.
    pub vaddr: u64,
    /// `p_filesz`: bytes backed by the file.
    pub file_size: u64,
    /// `p_memsz`: bytes in memory (the rest is zero-filled, e.g. `.bss`).
    pub mem_size: u64,
    /// `p_flags` (`PF_R`, `PF_W`, `PF_X`).
    pub flags: u32,
}

impl LoadSegment {
    /// Whether the segment holds code.
    pub fn is_executable(&self) -> bool {
        self.flags & elf::PF_X.0 != 0
    }
}

/// What [`read_summary`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElfSummary {
    /// The `NT_GNU_BUILD_ID` note's descriptor, if the file has one of a
    /// usable length (1 to [`BuildId::MAX_LEN`] bytes).
    pub build_id: Option<BuildId>,
    /// The `PT_LOAD` segments, in program header order.
    pub load_segments: Vec<LoadSegment>,
}

/// Why an ELF summary could not be read.
#[derive(Debug, Error)]
pub enum ElfError {
    /// The file does not start with the ELF magic (a mapped data file, JIT
    /// code in a memfd, a script...). Not an error for identity purposes.
    #[error("not an ELF file")]
    NotElf,
    /// Reading the identification bytes failed.
    #[error("reading the ELF identification")]
    Io(#[source] std::io::Error),
    /// The headers are truncated or inconsistent, or reading them failed
    /// (`object`'s lazy reader reports both the same way).
    #[error("malformed ELF headers")]
    Malformed(#[source] object::Error),
}

/// Reads the build-id and `PT_LOAD` segments of `file`.
pub fn read_summary(file: &File) -> Result<ElfSummary, ElfError> {
    let mut ident = [0u8; EI_NIDENT];
    match file.read_exact_at(&mut ident, 0) {
        Ok(()) => {}
        Err(err) if err.kind() == std::io::ErrorKind::UnexpectedEof => {
            return Err(ElfError::NotElf);
        }
        Err(err) => return Err(ElfError::Io(err)),
    }
    if ident[..elf::ELFMAG.len()] != elf::ELFMAG {
        return Err(ElfError::NotElf);
    }
    // Only the ranges `object` asks for are read, and each only once.
    let cache = ReadCache::new(file);
    let class = elf::FileClass(ident[EI_CLASS]);
    let result = match class {
        elf::ELFCLASS64 => summarize::<FileHeader64<Endianness>>(&cache),
        elf::ELFCLASS32 => summarize::<FileHeader32<Endianness>>(&cache),
        _ => return Err(ElfError::NotElf),
    };
    result.map_err(ElfError::Malformed)
}

fn summarize<Elf: FileHeader<Endian = Endianness>>(
    data: &ReadCache<&File>,
) -> Result<ElfSummary, object::Error> {
    let header = Elf::parse(data)?;
    let endian = header.endian()?;
    let mut build_id = None;
    let mut load_segments = Vec::new();
    for phdr in header.program_headers(endian, data)? {
        match phdr.p_type(endian) {
            elf::PT_LOAD => load_segments.push(LoadSegment {
                offset: phdr.p_offset(endian).into(),
                vaddr: phdr.p_vaddr(endian).into(),
                file_size: phdr.p_filesz(endian).into(),
                mem_size: phdr.p_memsz(endian).into(),
                flags: phdr.p_flags(endian).0,
            }),
            elf::PT_NOTE if build_id.is_none() => {
                if phdr.p_filesz(endian).into() > MAX_NOTES_BYTES {
                    tracing::debug!("skipping an oversized PT_NOTE segment");
                    continue;
                }
                if let Some(notes) = phdr.notes(endian, data)? {
                    build_id = find_build_id(endian, notes)?;
                }
            }
            _ => {}
        }
    }
    if build_id.is_none() {
        // Section headers are optional for loading, and may be corrupt in a
        // file that runs fine: failing here would lose the segments we have.
        build_id = build_id_from_sections(header, endian, data).unwrap_or_else(|err| {
            tracing::debug!(error = %err, "reading the build-id section");
            None
        });
    }
    Ok(ElfSummary {
        build_id,
        load_segments,
    })
}

fn build_id_from_sections<Elf: FileHeader<Endian = Endianness>>(
    header: &Elf,
    endian: Endianness,
    data: &ReadCache<&File>,
) -> Result<Option<BuildId>, object::Error> {
    let sections = header.sections(endian, data)?;
    let Some((_, section)) = sections.section_by_name(endian, BUILD_ID_SECTION) else {
        return Ok(None);
    };
    if section.sh_size(endian).into() > MAX_NOTES_BYTES {
        return Ok(None);
    }
    match section.notes(endian, data)? {
        Some(notes) => find_build_id(endian, notes),
        None => Ok(None),
    }
}

fn find_build_id<Elf: FileHeader<Endian = Endianness>>(
    endian: Endianness,
    mut notes: NoteIterator<'_, Elf>,
) -> Result<Option<BuildId>, object::Error> {
    while let Some(note) = notes.next()? {
        if note.name() == elf::ELF_NOTE_GNU && note.n_type(endian) == elf::NT_GNU_BUILD_ID {
            let build_id = BuildId::new(note.desc());
            if build_id.is_none() {
                tracing::debug!(
                    len = note.desc().len(),
                    "ignoring a build-id of unusable length"
                );
            }
            return Ok(build_id);
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;

    fn file_with(bytes: &[u8]) -> File {
        let mut file = tempfile::tempfile().expect("temporary file");
        file.write_all(bytes).expect("writing the temporary file");
        file
    }

    #[test]
    fn not_elf() {
        for bytes in [&b""[..], b"\x7fEL", b"#!/bin/sh\necho hi\n", &[0u8; 64]] {
            let err = read_summary(&file_with(bytes)).expect_err("not ELF");
            assert!(matches!(err, ElfError::NotElf), "{bytes:?}: {err:?}");
        }
    }

    #[test]
    fn unknown_class_is_not_elf() {
        let mut bytes = [0u8; 64];
        bytes[..4].copy_from_slice(&elf::ELFMAG);
        bytes[EI_CLASS] = 7;
        let err = read_summary(&file_with(&bytes)).expect_err("bad class");
        assert!(matches!(err, ElfError::NotElf), "{err:?}");
    }

    #[test]
    fn truncated_header_is_malformed() {
        // A 64-bit little-endian identification and nothing else.
        let mut bytes = vec![0u8; 20];
        bytes[..4].copy_from_slice(&elf::ELFMAG);
        // Class, data encoding and version bytes: 64-bit, little-endian, 1.
        bytes[EI_CLASS] = elf::ELFCLASS64.0;
        bytes[5] = elf::ELFDATA2LSB.0;
        bytes[6] = 1;
        let err = read_summary(&file_with(&bytes)).expect_err("truncated");
        assert!(matches!(err, ElfError::Malformed(_)), "{err:?}");
    }

    #[test]
    fn own_executable() {
        let file = File::open("/proc/self/exe").expect("opening our executable");
        let summary = read_summary(&file).expect("our executable is ELF");
        // Rust binaries are linked with a build-id on Debian's toolchain (gcc
        // passes --build-id), and always have a code segment.
        assert!(summary.build_id.is_some(), "{summary:?}");
        assert!(
            summary.load_segments.iter().any(LoadSegment::is_executable),
            "{summary:?}"
        );
    }
}
