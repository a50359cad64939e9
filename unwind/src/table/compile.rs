//! Evaluating DWARF call frame information into table rows.
//!
//! This module owns finding the CFI section in an ELF file, running every
//! FDE's program through gimli's `UnwindTable` evaluator (which handles
//! `remember_state`/`restore_state`, every `advance_loc` form, `set_loc`,
//! `GNU_args_size` and the CIE's initial instructions), translating each
//! evaluated row into an [`UnwindRule`], and laying FDEs out into sorted,
//! merged rows with explicit gaps. It does not own the row layout or lookup
//! (`super`) or the cache format (`super::cache`).

use std::{borrow::Cow, collections::HashMap};

use gimli::{
    BaseAddresses, CfaRule, CieOrFde, CommonInformationEntry, DebugFrame, EhFrame, EndianSlice,
    LittleEndian, Register, RegisterRule, UnwindContext, UnwindOffset, UnwindSection,
};
use object::{
    Architecture, CompressionFormat, Object as _, ObjectSection as _, ObjectSymbol as _,
    read::elf::ElfFile64,
};

use super::{
    CfiSection, MAX_DECOMPRESSED_BYTES, NO_INFO, Row, TableError, UnsupportedCfi, UnwindRule,
    UnwindTable,
};

type Reader<'a> = EndianSlice<'a, LittleEndian>;

/// DWARF register numbers of the x86_64 psABI (figure 3.36).
const RBP: Register = gimli::X86_64::RBP;
const RSP: Register = gimli::X86_64::RSP;
const RA: Register = gimli::X86_64::RA;

pub(super) fn from_elf(data: &[u8]) -> Result<UnwindTable, TableError> {
    let file = ElfFile64::<object::Endianness>::parse(data).map_err(TableError::Elf)?;
    if file.architecture() != Architecture::X86_64 || !file.is_little_endian() {
        let machine = file.elf_header().e_machine.get(file.endian()).0;
        return Err(TableError::UnsupportedArchitecture { machine });
    }

    // Bases for DW_EH_PE_textrel/datarel pointers; GCC and LLVM use pcrel on
    // x86_64, but the bases cost nothing to provide.
    let mut bases = BaseAddresses::default();
    if let Some(text) = file.section_by_name(".text") {
        bases = bases.set_text(text.address());
    }
    if let Some(got) = file.section_by_name(".got") {
        bases = bases.set_got(got.address());
    }
    if let Some(hdr) = file.section_by_name(".eh_frame_hdr") {
        bases = bases.set_eh_frame_hdr(hdr.address());
    }

    // The entry point: where the kernel (or, for a program, the dynamic
    // loader) starts the process, so nothing called it.
    let entry = Some(file.entry()).filter(|&entry| entry != 0);
    let mut builder = Builder::default();
    let mut found = false;
    // A separate debug file keeps `.eh_frame` as SHT_NOBITS: its data is
    // empty and `.debug_frame` (if any) is what it has.
    let eh_frame = match file.section_by_name(".eh_frame") {
        Some(section) => Some((section.address(), section.data().map_err(TableError::Elf)?)),
        None => None,
    };
    if let Some((address, bytes)) = eh_frame.filter(|(_, bytes)| !bytes.is_empty()) {
        let bases = bases.set_eh_frame(address);
        let mut section = EhFrame::new(bytes, LittleEndian);
        section.set_address_size(8);
        builder.add_fdes(&section, &bases, CfiSection::EhFrame)?;
        found = true;
    } else if let Some(bytes) = debug_frame(&file)?.filter(|bytes| !bytes.is_empty()) {
        let mut section = DebugFrame::new(&bytes[..], LittleEndian);
        section.set_address_size(8);
        builder.add_fdes(&section, &BaseAddresses::default(), CfiSection::DebugFrame)?;
        found = true;
    }
    // Go's own function table, where the binary has one, describes every
    // Go function (assembly included) and replaces CFI over them.
    found |= super::go::add_functions(&file, &mut builder, entry)?;
    if !found {
        return Err(TableError::NoCfi);
    }
    // Only beside CFI: V8 is C++, and a program whose C++ has no CFI is
    // not walked through these rows either.
    super::v8::add_builtins(&file, &mut builder)?;
    let mut table = builder.finish(entry)?;
    table.frame_pointer_gaps = gaps_keep_frame_pointers(&file, &table);
    Ok(table)
}

/// The bytes of `.debug_frame` (or `.zdebug_frame`), decompressed when
/// compressed (`SHF_COMPRESSED` with zlib or zstd, or the GNU `ZLIB`
/// header of `.zdebug_*`: Go's linker and `-gz` write them), after the
/// size its header claims was checked against [`MAX_DECOMPRESSED_BYTES`].
fn debug_frame<'data>(
    file: &ElfFile64<'data, object::Endianness>,
) -> Result<Option<Cow<'data, [u8]>>, TableError> {
    let Some(section) = file.section_by_name(".debug_frame") else {
        return Ok(None);
    };
    let compressed = section.compressed_data().map_err(TableError::Elf)?;
    decompress(compressed, CfiSection::DebugFrame).map(Some)
}

/// `data` decompressed, refusing sizes beyond [`MAX_DECOMPRESSED_BYTES`]
/// before allocating (object reserves the claimed size up front).
pub(super) fn decompress<'data>(
    data: object::CompressedData<'data>,
    section: CfiSection,
) -> Result<Cow<'data, [u8]>, TableError> {
    if data.format != CompressionFormat::None && data.uncompressed_size > MAX_DECOMPRESSED_BYTES {
        return Err(TableError::DecompressedTooLarge {
            section,
            size: data.uncompressed_size,
            max: MAX_DECOMPRESSED_BYTES,
        });
    }
    data.decompress()
        .map_err(|source| TableError::Decompress { section, source })
}

/// The frame-pointer prologue: `push %rbp` first (after an `endbr64` with
/// CET), then `mov %rsp,%rbp` within the next few instructions (GCC
/// schedules other moves in between).
const PUSH_RBP: u8 = 0x55;
const MOV_RSP_RBP: [u8; 3] = [0x48, 0x89, 0xe5];
const ENDBR64: [u8; 4] = [0xf3, 0x0f, 0x1e, 0xfa];
/// Bytes of a function's start searched for `mov %rsp,%rbp`.
const PROLOGUE_BYTES: usize = 24;

/// Functions every C program links from the C runtime (crtstuff.c, crti),
/// built however the distribution built them: they say nothing of how the
/// program itself was compiled.
const C_RUNTIME: [&str; 7] = [
    "_start",
    "_init",
    "_fini",
    "deregister_tm_clones",
    "register_tm_clones",
    "__do_global_dtors_aux",
    "frame_dummy",
];

/// Symbol-less code: at least one `mov %rsp,%rbp` per this many bytes of
/// code without rows reads as frame-pointer code (functions compiled with
/// -O2 average well under a few hundred bytes; without frame pointers the
/// instruction is rare).
const BYTES_PER_PROLOGUE: u64 = 512;
/// ...and at least this many.
const MIN_PROLOGUES: u64 = 16;

/// See [`UnwindTable::frame_pointer_gaps`]: the rows cover less than half
/// of the executable sections, and most functions they do not cover begin
/// with the frame-pointer prologue (by the symbol tables), or, in a file
/// stripped of them, the prologue is common in the code.
fn gaps_keep_frame_pointers(file: &ElfFile64<'_, object::Endianness>, table: &UnwindTable) -> bool {
    let code: Vec<(u64, &[u8])> = file
        .sections()
        .filter(|section| section.kind() == object::SectionKind::Text)
        .filter_map(|section| Some((section.address(), section.data().ok()?)))
        .collect();
    let code_bytes: u64 = code.iter().map(|(_, data)| data.len() as u64).sum();
    let covered = table.covered_bytes();
    if covered.saturating_mul(2) >= code_bytes {
        return false;
    }
    let bytes_at = |address: u64| {
        code.iter().find_map(|&(start, data)| {
            let offset = usize::try_from(address.checked_sub(start)?).ok()?;
            let end = offset.checked_add(PROLOGUE_BYTES)?.min(data.len());
            data.get(offset..end)
        })
    };
    let opens_a_frame = |bytes: &[u8]| {
        let bytes = bytes.strip_prefix(&ENDBR64).unwrap_or(bytes);
        bytes.first() == Some(&PUSH_RBP) && bytes.windows(3).any(|w| w == MOV_RSP_RBP)
    };
    let (mut named, mut functions, mut with_frames) = (0u64, 0u64, 0u64);
    for symbol in file.symbols().chain(file.dynamic_symbols()) {
        if symbol.kind() != object::SymbolKind::Text
            || symbol.size() == 0
            || symbol.name().is_ok_and(|name| C_RUNTIME.contains(&name))
        {
            continue;
        }
        named += 1;
        if table.lookup(symbol.address()).is_some() {
            continue;
        }
        if let Some(bytes) = bytes_at(symbol.address()) {
            functions += 1;
            with_frames += u64::from(opens_a_frame(bytes));
        }
    }
    if named > 0 {
        // The program's own functions say it: those without rows open
        // frames, three in four at least (leaf functions may not).
        return functions > 0 && with_frames * 4 >= functions * 3;
    }
    let prologues = code
        .iter()
        .map(|(_, data)| data.windows(3).filter(|w| *w == MOV_RSP_RBP).count() as u64)
        .sum::<u64>();
    // A few could be the C runtime's own (crtstuff keeps a frame pointer):
    // too little code to tell is not frame-pointer code.
    prologues >= MIN_PROLOGUES
        && prologues.saturating_mul(BYTES_PER_PROLOGUE) >= code_bytes - covered
}

/// Bytes after an entry point without CFI taken as its function (the
/// glibc loader's `_start` calls `_dl_start` within its first 8 bytes):
/// up to the next FDE, at most this.
const ENTRY_SPAN: u64 = 64;

pub(super) fn from_eh_frame(data: &[u8], bases: &BaseAddresses) -> Result<UnwindTable, TableError> {
    let mut section = EhFrame::new(data, LittleEndian);
    section.set_address_size(8);
    let mut builder = Builder::default();
    builder.add_fdes(&section, bases, CfiSection::EhFrame)?;
    builder.finish(None)
}

pub(super) fn from_debug_frame(data: &[u8]) -> Result<UnwindTable, TableError> {
    let mut section = DebugFrame::new(data, LittleEndian);
    section.set_address_size(8);
    let mut builder = Builder::default();
    builder.add_fdes(&section, &BaseAddresses::default(), CfiSection::DebugFrame)?;
    builder.finish(None)
}

/// One row before the spans are sorted and laid out: 8 bytes, as a laid
/// out row (a compiler's libLLVM has 1.4 million; with a 64-bit address
/// they took 16 bytes each, the compile's largest allocation).
#[derive(Debug, Clone, Copy)]
struct RawRow {
    /// From the start of its span.
    offset: u32,
    rule: u32,
}

/// The rows of one FDE (or one Go function), before they are sorted and
/// laid out.
struct Span {
    start: u64,
    end: u64,
    /// `raw[first..last]` holds this FDE's rows.
    first: usize,
    last: usize,
}

/// Deduplicates rules so a row names one by a `u32` index.
#[derive(Default)]
struct Interner {
    index: HashMap<UnwindRule, u32>,
    rules: Vec<UnwindRule>,
}

impl Interner {
    fn intern(&mut self, rule: UnwindRule) -> Result<u32, TableError> {
        if let Some(&index) = self.index.get(&rule) {
            return Ok(index);
        }
        let index = u32::try_from(self.rules.len())
            .ok()
            .filter(|&index| index != NO_INFO)
            .ok_or(TableError::TooManyRules)?;
        self.rules.push(rule);
        self.index.insert(rule, index);
        Ok(index)
    }
}

/// Collects spans of rows from every source (CFI, Go's function table),
/// then lays them out into a table.
#[derive(Default)]
pub(super) struct Builder {
    interner: Interner,
    raw: Vec<RawRow>,
    spans: Vec<Span>,
}

impl Builder {
    /// Adds every FDE of `section`.
    fn add_fdes<'a, S>(
        &mut self,
        section: &S,
        bases: &BaseAddresses,
        which: CfiSection,
    ) -> Result<(), TableError>
    where
        S: UnwindSection<Reader<'a>>,
    {
        let cfi_error = |source| TableError::Cfi {
            section: which,
            source,
        };
        let mut ctx = UnwindContext::new();
        // Most sections have one or two CIEs shared by every FDE: parse each once.
        let mut cies: HashMap<usize, CommonInformationEntry<Reader<'a>>> = HashMap::new();

        let mut entries = section.entries(bases);
        while let Some(entry) = entries.next().map_err(cfi_error)? {
            let partial = match entry {
                CieOrFde::Cie(_) => continue,
                CieOrFde::Fde(partial) => partial,
            };
            let fde = partial
                .parse(|section, bases, offset| {
                    let key = UnwindOffset::into(offset);
                    if let Some(cie) = cies.get(&key) {
                        return Ok(cie.clone());
                    }
                    let cie = section.cie_from_offset(bases, offset)?;
                    cies.insert(key, cie.clone());
                    Ok(cie)
                })
                .map_err(cfi_error)?;

            let start = fde.initial_address();
            let length = fde.len();
            let end = start
                .checked_add(length)
                .ok_or_else(|| TableError::FdeRange {
                    section: which,
                    offset: fde.offset() as u64,
                    start,
                    length,
                })?;
            if length == 0 {
                continue;
            }

            let first = self.raw.len();
            let evaluated = evaluate_fde(
                section,
                bases,
                &mut ctx,
                &fde,
                start..end,
                &mut self.interner,
                &mut self.raw,
            );
            match evaluated {
                Ok(()) => {}
                Err(Failure::Table(error)) => return Err(error),
                // One FDE whose program gimli rejects should not cost the whole
                // binary its table: its range is marked unsupported instead, so
                // a walk through it stops rather than guesses.
                Err(Failure::Program) => {
                    self.raw.truncate(first);
                    self.push_whole(start, end, UnwindRule::Unsupported(UnsupportedCfi::Program))?;
                    continue;
                }
            }
            self.spans.push(Span {
                start,
                end,
                first,
                last: self.raw.len(),
            });
        }
        Ok(())
    }

    /// Drops the spans added so far that overlap any of `ranges` (sorted by
    /// start, not overlapping each other), so a source added next owns
    /// those addresses alone.
    pub(super) fn drop_spans_overlapping(&mut self, ranges: &[std::ops::Range<u64>]) {
        self.spans.retain(|span| {
            // The first range ending after the span starts overlaps it if
            // it also starts before the span ends.
            let i = ranges.partition_point(|range| range.end <= span.start);
            ranges.get(i).is_none_or(|range| range.start >= span.end)
        });
    }

    /// The addresses the spans added so far cover, as sorted ranges that
    /// do not overlap (overlapping spans merged).
    pub(super) fn covered_ranges(&self) -> Vec<std::ops::Range<u64>> {
        let mut spans: Vec<_> = self.spans.iter().map(|span| span.start..span.end).collect();
        spans.sort_unstable_by_key(|range| range.start);
        let mut merged: Vec<std::ops::Range<u64>> = Vec::with_capacity(spans.len());
        for span in spans {
            match merged.last_mut() {
                Some(last) if span.start <= last.end => last.end = last.end.max(span.end),
                _ => merged.push(span),
            }
        }
        merged
    }

    /// Adds a span `start..end` following `rule` throughout.
    pub(super) fn push_whole(
        &mut self,
        start: u64,
        end: u64,
        rule: UnwindRule,
    ) -> Result<(), TableError> {
        let first = self.raw.len();
        let rule = self.interner.intern(rule)?;
        self.raw.push(RawRow { offset: 0, rule });
        self.spans.push(Span {
            start,
            end,
            first,
            last: self.raw.len(),
        });
        Ok(())
    }

    /// Adds a span of consecutive rows: each rule from its address to the
    /// next one's, the last to `end`.
    pub(super) fn push_rows(
        &mut self,
        rows: impl IntoIterator<Item = (u64, UnwindRule)>,
        end: u64,
    ) -> Result<(), TableError> {
        let first = self.raw.len();
        let mut start = None;
        for (address, rule) in rows {
            let index = self.interner.intern(rule)?;
            if self.raw[first..]
                .last()
                .is_some_and(|row| row.rule == index)
            {
                continue;
            }
            let start = *start.get_or_insert(address);
            // A row before the first, or 4 GiB past it, is out of order in
            // a table of ascending rows: left out.
            let Some(offset) = address
                .checked_sub(start)
                .and_then(|offset| u32::try_from(offset).ok())
            else {
                continue;
            };
            self.raw.push(RawRow {
                offset,
                rule: index,
            });
        }
        let Some(start) = start else {
            return Ok(());
        };
        if start >= end {
            self.raw.truncate(first);
            return Ok(());
        }
        self.spans.push(Span {
            start,
            end,
            first,
            last: self.raw.len(),
        });
        Ok(())
    }

    /// Lays the spans out into a table. `entry`: the ELF entry point. When
    /// no span covers it (the glibc loader's `_start` has no FDE), its first
    /// bytes are marked outermost, so a walk that reaches it ends there as
    /// a complete stack.
    fn finish(mut self, entry: Option<u64>) -> Result<UnwindTable, TableError> {
        if let Some(entry) = entry
            && !self
                .spans
                .iter()
                .any(|span| (span.start..span.end).contains(&entry))
        {
            let end = self
                .spans
                .iter()
                .map(|span| span.start)
                .filter(|&start| start > entry)
                .fold(entry.saturating_add(ENTRY_SPAN), u64::min);
            self.push_whole(entry, end, UnwindRule::Outermost)?;
        }

        let (base, rows) = lay_out(&self.spans, &self.raw)?;
        let mut rules = self.interner.rules;
        rules.shrink_to_fit();
        Ok(UnwindTable {
            base,
            rows,
            rules,
            frame_pointer_gaps: false,
        })
    }
}

enum Failure {
    /// Stops the whole compilation.
    Table(TableError),
    /// Marks the FDE's range unsupported.
    Program,
}

impl From<gimli::Error> for Failure {
    fn from(_: gimli::Error) -> Self {
        Self::Program
    }
}

impl From<TableError> for Failure {
    fn from(error: TableError) -> Self {
        Self::Table(error)
    }
}

/// Appends one FDE's evaluated rows to `raw`, merging consecutive rows with
/// the same rule and clipping rows to the FDE's range.
fn evaluate_fde<'a, S>(
    section: &S,
    bases: &BaseAddresses,
    ctx: &mut UnwindContext<usize>,
    fde: &gimli::FrameDescriptionEntry<Reader<'a>>,
    range: std::ops::Range<u64>,
    interner: &mut Interner,
    raw: &mut Vec<RawRow>,
) -> Result<(), Failure>
where
    S: UnwindSection<Reader<'a>>,
{
    let first = raw.len();
    let signal = fde.is_signal_trampoline();
    let ra_register = fde.cie().return_address_register();
    let mut rows = fde.rows(section, bases, ctx)?;
    while let Some(row) = rows.next_row()? {
        let row_start = row.start_address();
        // advance_loc past the FDE's end makes rows outside it; they describe
        // no code this FDE covers.
        if row_start >= row.end_address().min(range.end) {
            continue;
        }
        let rule = if signal {
            // The kernel's frame layout, not the CFI, says where registers
            // are; glibc's CFI for __restore_rt uses expressions for them.
            UnwindRule::SignalFrame
        } else {
            rule_for_row(section, row, ra_register)
        };
        let index = interner.intern(rule)?;
        if raw[first..].last().is_some_and(|row| row.rule == index) {
            continue;
        }
        // Rows advance from the FDE's start; one 4 GiB past it could not
        // be laid out either.
        let offset = row_start
            .checked_sub(range.start)
            .and_then(|offset| u32::try_from(offset).ok())
            .ok_or(TableError::AddressSpan {
                base: range.start,
                end: row_start,
            })?;
        raw.push(RawRow {
            offset,
            rule: index,
        });
    }
    Ok(())
}

/// Translates one evaluated CFI row into the unwinder's vocabulary.
pub(super) fn rule_for_row<'a, S>(
    section: &S,
    row: &gimli::UnwindTableRow<usize>,
    ra_register: Register,
) -> UnwindRule
where
    S: UnwindSection<Reader<'a>>,
{
    use UnsupportedCfi as U;
    let unsupported = UnwindRule::Unsupported;

    if ra_register != RA {
        return unsupported(U::ReturnAddress);
    }
    match row.register(RA) {
        Some(RegisterRule::Offset(-8)) => {}
        // DW_CFA_undefined rip: there is no caller. Decided before the CFA,
        // which in such frames is often meaningless.
        Some(RegisterRule::Undefined) => return UnwindRule::Outermost,
        _ => return unsupported(U::ReturnAddress),
    }
    match row.register(RSP) {
        None | Some(RegisterRule::ValOffset(0)) => {}
        Some(_) => return unsupported(U::Rsp),
    }
    let rbp_off = match row.register(RBP) {
        None | Some(RegisterRule::SameValue) => None,
        Some(RegisterRule::Offset(off)) => match i32::try_from(off) {
            Ok(off) => Some(off),
            Err(_) => return unsupported(U::OffsetRange),
        },
        Some(_) => return unsupported(U::Rbp),
    };

    match row.cfa() {
        CfaRule::RegisterAndOffset { register, offset } => {
            let Ok(cfa_off) = i32::try_from(*offset) else {
                return unsupported(U::OffsetRange);
            };
            match (*register, rbp_off) {
                (RSP, None) => UnwindRule::Rsp { cfa_off },
                (RSP, Some(rbp_off)) => UnwindRule::RspRbpSaved { cfa_off, rbp_off },
                (RBP, None) => UnwindRule::Rbp { cfa_off },
                (RBP, Some(rbp_off)) => UnwindRule::RbpRbpSaved { cfa_off, rbp_off },
                _ => unsupported(U::CfaRegister),
            }
        }
        CfaRule::Expression(expression) => {
            let threshold = expression
                .get(section)
                .ok()
                .and_then(|expression| plt_threshold(expression.0.slice()));
            match (threshold, rbp_off) {
                (Some(threshold), None) => UnwindRule::Plt { threshold },
                _ => unsupported(U::CfaExpression),
            }
        }
    }
}

/// Recognises binutils' `.plt` CFA expression
/// `DW_OP_breg7 (rsp) 8; DW_OP_breg16 (rip) 0; DW_OP_lit15; DW_OP_and;
/// DW_OP_lit<N>; DW_OP_ge; DW_OP_lit3; DW_OP_shl; DW_OP_plus`, i.e.
/// `rsp + 8 + ((rip & 15) >= N) << 3`, and returns N.
fn plt_threshold(bytes: &[u8]) -> Option<u8> {
    use gimli::constants as c;
    let lit = |n: u8| c::DW_OP_lit0.0 + n;
    match *bytes {
        [breg7, 8, breg16, 0, lit15, and, lit_n, ge, lit3, shl, plus]
            if breg7 == c::DW_OP_breg7.0
                && breg16 == c::DW_OP_breg16.0
                && lit15 == lit(15)
                && and == c::DW_OP_and.0
                && (lit(0)..=lit(15)).contains(&lit_n)
                && ge == c::DW_OP_ge.0
                && lit3 == lit(3)
                && shl == c::DW_OP_shl.0
                && plus == c::DW_OP_plus.0 =>
        {
            Some(lit_n - lit(0))
        }
        _ => None,
    }
}

/// Sorts FDEs by address and writes the final rows: each FDE's rows, then a
/// gap row at its end (dropped when the next FDE starts right there), so
/// addresses between FDEs (split hot/cold fragments, code without CFI) never
/// inherit the previous function's rule.
///
/// Overlapping FDEs (malformed, or duplicated by a linker) are resolved in
/// favour of the one starting later: the earlier one's rows from that address
/// on are dropped. A nested FDE therefore leaves the rest of its parent as a
/// gap: less coverage, never a wrong rule from the wrong FDE.
fn lay_out(spans: &[Span], raw: &[RawRow]) -> Result<(u64, Vec<Row>), TableError> {
    let mut order: Vec<usize> = (0..spans.len()).collect();
    order.sort_unstable_by_key(|&i| (spans[i].start, spans[i].end));
    let Some(base) = order.first().map(|&i| spans[i].start) else {
        return Ok((0, Vec::new()));
    };
    // Every address is at or above its FDE's start, hence above `base`.
    let offset = |address: u64| {
        address
            .checked_sub(base)
            .and_then(|offset| u32::try_from(offset).ok())
            .ok_or(TableError::AddressSpan { base, end: address })
    };

    let mut rows: Vec<Row> = Vec::with_capacity(raw.len() + spans.len());
    let push = |rows: &mut Vec<Row>, row: Row| {
        if rows.last().is_none_or(|last| last.rule != row.rule) {
            rows.push(row);
        }
    };
    for &i in &order {
        let span = &spans[i];
        let start = offset(span.start)?;
        while rows.last().is_some_and(|last| last.address >= start) {
            rows.pop();
        }
        for row in &raw[span.first..span.last] {
            let address = offset(span.start.saturating_add(u64::from(row.offset)))?;
            push(
                &mut rows,
                Row {
                    address,
                    rule: row.rule,
                },
            );
        }
        let end = offset(span.end)?;
        push(
            &mut rows,
            Row {
                address: end,
                rule: NO_INFO,
            },
        );
    }
    rows.shrink_to_fit();
    Ok((base, rows))
}
