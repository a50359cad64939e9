//! Reads what the table compiler parses of an object file (the ELF and
//! program headers, the section headers, `.shstrtab`, `.eh_frame`,
//! `.eh_frame_hdr`, `.debug_frame`) in the same pass that digests the whole
//! file, and hands it over only when the digest is the one the file was
//! identified by.
//!
//! Why: a table is shared by every file of the same identity (build-id and
//! digest). A process can map a writable copy of a library, identical and
//! so of the same identity, and rewrite it once it was identified; compiled
//! from that copy, the table would then unwind the real library everywhere
//! (and be kept on disk). Compiled from the very bytes that were digested,
//! it is the real library's table or none.
//!
//! The image is as long as the file and zero where nothing was kept:
//! allocated zeroed, those pages are never touched and take no memory.

use std::{fs::File, ops::Range};

use object::{
    Endianness, Object as _, ObjectSection as _, ReadCache, ReadRef,
    read::elf::{ElfFile64, FileHeader as _},
};
use stackscope_process_table::ContentDigest;

/// The sections whose contents `UnwindTable::from_elf` reads.
const CFI_SECTIONS: [&str; 3] = [".eh_frame", ".eh_frame_hdr", ".debug_frame"];

/// The section the names of the others are read from.
const SECTION_NAMES: &str = ".shstrtab";

/// The head of the file kept whole: the ELF header and the program headers
/// of any file a real linker makes.
const HEAD_BYTES: u64 = 64 << 10;

/// What [`read`] found.
pub(super) enum CfiImage {
    /// The file as digested, with the parts the compiler reads.
    Verified(Vec<u8>),
    /// Not a 64-bit ELF file: there is no table to compile.
    NotElf64,
    /// The file is not the one identified (it changed), or could not be
    /// read: worth trying again later.
    Unverified,
}

/// Reads `file` (`len` bytes, identified by `expected`); see the module
/// documentation.
pub(super) fn read(file: &File, len: u64, expected: ContentDigest) -> CfiImage {
    let Some(wanted) = wanted_ranges(&ReadCache::new(file), len) else {
        return CfiImage::NotElf64;
    };
    let Ok(size) = usize::try_from(len) else {
        return CfiImage::Unverified;
    };
    let mut image = vec![0u8; size];
    let digest = ContentDigest::of_file_visiting(file, len, |at, chunk| {
        keep_overlaps(&mut image, &wanted, at, chunk);
    });
    if !matches!(digest, Ok(Some(digest)) if digest == expected) {
        return CfiImage::Unverified;
    }
    // The headers kept are the identified file's; the ranges were found
    // from the file as it was a moment before, which may differ: what
    // they name must have been kept.
    match wanted_ranges(image.as_slice(), len) {
        Some(named) if named.iter().all(|range| covered(range, &wanted)) => {
            CfiImage::Verified(image)
        }
        _ => CfiImage::Unverified,
    }
}

/// The byte ranges of `data` (a file of `len` bytes) the compiler reads;
/// `None` when it is not a 64-bit ELF file.
fn wanted_ranges<'data, R: ReadRef<'data>>(data: R, len: u64) -> Option<Vec<Range<u64>>> {
    let elf = ElfFile64::<Endianness, R>::parse(data).ok()?;
    let endian = elf.endian();
    let header = elf.elf_header();
    let section_headers =
        u64::from(header.e_shentsize(endian)).saturating_mul(elf.elf_section_table().len() as u64);
    let shoff = header.e_shoff(endian);
    let mut ranges = vec![
        0..HEAD_BYTES.min(len),
        shoff..shoff.saturating_add(section_headers),
    ];
    for section in elf.sections() {
        let wanted = section
            .name()
            .is_ok_and(|name| CFI_SECTIONS.contains(&name) || name == SECTION_NAMES);
        if wanted && let Some((offset, size)) = section.file_range() {
            ranges.push(offset..offset.saturating_add(size));
        }
    }
    Some(ranges)
}

/// Copies the parts of `chunk` (read at `at`) that fall in `wanted`.
fn keep_overlaps(image: &mut [u8], wanted: &[Range<u64>], at: u64, chunk: &[u8]) {
    let chunk_end = at + chunk.len() as u64;
    for range in wanted {
        let start = range.start.max(at);
        let end = range.end.min(chunk_end).min(image.len() as u64);
        if start < end {
            // Both fit in usize: they are within the image.
            let (from, to) = ((start - at) as usize, (end - at) as usize);
            image[start as usize..end as usize].copy_from_slice(&chunk[from..to]);
        }
    }
}

fn covered(range: &Range<u64>, kept: &[Range<u64>]) -> bool {
    range.is_empty()
        || kept
            .iter()
            .any(|k| k.start <= range.start && range.end <= k.end)
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use stackscope_unwind::UnwindTable;

    use super::*;

    fn digest(file: &File) -> ContentDigest {
        let len = file.metadata().expect("fstat").len();
        ContentDigest::of_file(file, len)
            .expect("reading")
            .expect("small enough")
    }

    #[test]
    fn the_verified_image_compiles_to_the_files_own_table() {
        let path = std::env::current_exe().expect("the test binary");
        let file = File::open(&path).expect("opening");
        let len = file.metadata().expect("fstat").len();
        let CfiImage::Verified(image) = read(&file, len, digest(&file)) else {
            panic!("the test binary was not read whole");
        };
        let whole = std::fs::read(&path).expect("reading");
        assert_eq!(image.len(), whole.len());
        assert_eq!(
            UnwindTable::from_elf(&image).expect("a table"),
            UnwindTable::from_elf(&whole).expect("a table"),
        );
        // Only what the compiler reads was kept: the code is zero.
        let text = object::File::parse(whole.as_slice())
            .expect("ELF")
            .section_by_name(".text")
            .and_then(|text| text.file_range())
            .expect(".text");
        let code = text.0 as usize..(text.0 + text.1) as usize;
        assert!(image[code.clone()].iter().all(|&b| b == 0));
        assert!(whole[code].iter().any(|&b| b != 0));
    }

    #[test]
    fn a_file_changed_since_it_was_identified_is_not_compiled() {
        let path = std::env::current_exe().expect("the test binary");
        let original = std::fs::read(&path).expect("reading");
        let identified = digest(&File::open(&path).expect("opening"));
        // The same file with one byte of .eh_frame rewritten.
        let eh_frame = object::File::parse(original.as_slice())
            .expect("ELF")
            .section_by_name(".eh_frame")
            .and_then(|section| section.file_range())
            .expect(".eh_frame");
        let mut rewritten = original.clone();
        rewritten[eh_frame.0 as usize + 40] ^= 0xff;
        let mut copy = tempfile::tempfile().expect("temporary file");
        copy.write_all(&rewritten).expect("writing");
        let len = rewritten.len() as u64;
        assert!(matches!(read(&copy, len, identified), CfiImage::Unverified));
        // Not ELF at all: nothing to compile.
        let mut text = tempfile::tempfile().expect("temporary file");
        text.write_all(b"#!/bin/sh\n").expect("writing");
        assert!(matches!(read(&text, 10, identified), CfiImage::NotElf64));
    }
}
