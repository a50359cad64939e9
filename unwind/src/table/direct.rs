//! Rules read straight from a binary's `.eh_frame`, one address at a time,
//! while its table compiles.
//!
//! A compiler's driver (librustc_driver, libLLVM: 100 MB and more of code)
//! takes seconds to compile into a table, and a compile that lives four
//! seconds is sampled mostly meanwhile. Its samples could only be held
//! (hundreds of KB each when deep, beyond any sane bound) or dropped. This
//! module answers the addresses those samples need through the binary's
//! `.eh_frame_hdr` search table: a binary search to the FDE, its program
//! run to the address by gimli, the row translated exactly as the compiled
//! table translates it (`compile::rule_for_row`). An address no FDE covers
//! (an entry point, Go or V8 code the compiled table adds, a gap walked by
//! frame pointers) has no answer here: its sample waits for the table as
//! before, so a walk never takes a step the table would not.
//!
//! It owns the mapped file and nothing else; the walker's step cache keeps
//! the answers.

use std::{ops::Range, sync::Mutex};

use gimli::{
    BaseAddresses, EhFrame, EhFrameHdr, EndianSlice, LittleEndian, UnwindContext,
    UnwindSection as _,
};
use object::{Object as _, ObjectSection as _, read::elf::ElfFile64};

use super::{UnwindRule, compile::rule_for_row};

/// A binary's `.eh_frame` and its search table, mapped.
pub struct DirectCfi {
    /// The whole file (a mapping, in the agent).
    bytes: Box<dyn AsRef<[u8]> + Send + Sync>,
    eh_frame: Range<usize>,
    eh_frame_hdr: Range<usize>,
    bases: BaseAddresses,
    /// Reused across lookups (its row storage is on the heap).
    context: Mutex<UnwindContext<usize>>,
}

/// Why a binary's rules cannot be read directly (its samples wait for the
/// compiled table instead).
#[derive(Debug, thiserror::Error)]
pub enum DirectCfiError {
    #[error("not a 64-bit ELF file: {0}")]
    Elf(object::Error),
    #[error("no {0} section with contents in the file")]
    Missing(&'static str),
    #[error("a Go binary (its functions' rules come from .gopclntab)")]
    Go,
    #[error(".eh_frame_hdr: {0}")]
    Header(gimli::Error),
    #[error(".eh_frame_hdr has no search table")]
    NoSearchTable,
}

impl DirectCfi {
    /// Reads the section headers of a mapped ELF file; nothing of the CFI
    /// itself is read until [`DirectCfi::rule_at`].
    pub fn new(bytes: impl AsRef<[u8]> + Send + Sync + 'static) -> Result<Self, DirectCfiError> {
        let bytes: Box<dyn AsRef<[u8]> + Send + Sync> = Box::new(bytes);
        let data = (*bytes).as_ref();
        let file = ElfFile64::<object::Endianness>::parse(data).map_err(DirectCfiError::Elf)?;
        if file.section_by_name(".gopclntab").is_some() {
            return Err(DirectCfiError::Go);
        }
        // A section's bytes in the file; a SHT_NOBITS one (a separate debug
        // file's copy) has none.
        let in_file = |name: &'static str| {
            let section = file
                .section_by_name(name)
                .ok_or(DirectCfiError::Missing(name))?;
            let (offset, size) = section
                .file_range()
                .filter(|&(_, size)| size > 0)
                .ok_or(DirectCfiError::Missing(name))?;
            let start = usize::try_from(offset).map_err(|_| DirectCfiError::Missing(name))?;
            let end = usize::try_from(size)
                .ok()
                .and_then(|size| start.checked_add(size))
                .filter(|&end| end <= data.len())
                .ok_or(DirectCfiError::Missing(name))?;
            Ok((section.address(), start..end))
        };
        let (eh_frame_address, eh_frame) = in_file(".eh_frame")?;
        let (hdr_address, eh_frame_hdr) = in_file(".eh_frame_hdr")?;
        // The same bases as the compiled table's (see `compile::from_elf`).
        let mut bases = BaseAddresses::default()
            .set_eh_frame(eh_frame_address)
            .set_eh_frame_hdr(hdr_address);
        if let Some(text) = file.section_by_name(".text") {
            bases = bases.set_text(text.address());
        }
        if let Some(got) = file.section_by_name(".got") {
            bases = bases.set_got(got.address());
        }
        let direct = Self {
            bytes,
            eh_frame,
            eh_frame_hdr,
            bases,
            context: Mutex::new(UnwindContext::new()),
        };
        let header = direct.header().map_err(DirectCfiError::Header)?;
        if header.table().is_none() {
            return Err(DirectCfiError::NoSearchTable);
        }
        Ok(direct)
    }

    fn header(&self) -> gimli::Result<gimli::ParsedEhFrameHdr<EndianSlice<'_, LittleEndian>>> {
        let data = (*self.bytes).as_ref();
        EhFrameHdr::new(&data[self.eh_frame_hdr.clone()], LittleEndian).parse(&self.bases, 8)
    }

    /// The rule at file virtual address `address`, as the compiled table
    /// will have it; `None` when no FDE covers it or its FDE does not
    /// evaluate (the table decides those).
    pub fn rule_at(&self, address: u64) -> Option<UnwindRule> {
        // gimli reports malformed input as errors; a panic in it on a
        // hostile file must not end the walker either.
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.evaluate(address)))
            .ok()
            .flatten()
    }

    fn evaluate(&self, address: u64) -> Option<UnwindRule> {
        let header = self.header().ok()?;
        let table = header.table()?;
        let data = (*self.bytes).as_ref();
        let mut section = EhFrame::new(&data[self.eh_frame.clone()], LittleEndian);
        section.set_address_size(8);
        let fde = table
            .fde_for_address(&section, &self.bases, address, EhFrame::cie_from_offset)
            .ok()?;
        if fde.is_signal_trampoline() {
            return Some(UnwindRule::SignalFrame);
        }
        let mut context = self
            .context
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let row = fde
            .unwind_info_for_address(&section, &self.bases, &mut context, address)
            .ok()?;
        Some(rule_for_row(
            &section,
            row,
            fde.cie().return_address_register(),
        ))
    }
}

impl std::fmt::Debug for DirectCfi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectCfi")
            .field("bytes", &(*self.bytes).as_ref().len())
            .field("eh_frame", &self.eh_frame)
            .field("eh_frame_hdr", &self.eh_frame_hdr)
            .finish_non_exhaustive()
    }
}
