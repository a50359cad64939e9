//! Compact unwind tables: one sorted array of 8-byte rows per binary.
//!
//! This module owns the table's in-memory layout, address lookup, the rule
//! vocabulary the unwinder understands ([`UnwindRule`]), and the on-disk cache
//! format (`cache`). Evaluating DWARF CFI into rows lives in `compile`, and
//! rows for Go functions from the Go runtime's function table in `go`.
//! It does not own load biases, mappings or walking stacks (see
//! [`crate::unwinder`]).
//!
//! Layout: each `Row` is `(address offset: u32, rule index: u32)`. The
//! address is relative to the table's base address (the lowest FDE start);
//! the rule index points into a small deduplicated `Vec<UnwindRule>` (a binary
//! has a few hundred distinct rules against hundreds of thousands of rows), or
//! is `NO_INFO` for the gaps between FDEs. A row covers
//! `[its address, next row's address)`; the last row is always a `NO_INFO`
//! terminator, so an address past the last FDE finds no rule.

mod cache;
mod compile;
#[cfg(test)]
mod compile_tests;
mod direct;
mod go;
mod v8;

use std::mem::size_of;

pub use cache::CacheError;
pub use direct::{DirectCfi, DirectCfiError};

/// Rule index of a row that covers addresses no FDE describes.
pub(crate) const NO_INFO: u32 = u32::MAX;

/// Largest uncompressed size accepted for a compressed CFI section. The
/// largest `.eh_frame` known (LLVM's) is under 8 MiB; a header claiming
/// more than this is corrupt or hostile, and is refused rather than
/// allocated.
pub const MAX_DECOMPRESSED_BYTES: u64 = 256 << 20;

/// Offset of `uc_mcontext` (a `struct sigcontext`) in the kernel's
/// `struct ucontext` on x86_64: `uc_flags` (8), `uc_link` (8), `uc_stack` (24).
const UCONTEXT_MCONTEXT: u64 = 40;
/// `struct sigcontext` starts with r8..r15, rdi, rsi, rbp, rbx, rdx, rax, rcx,
/// rsp, rip: 8 bytes each, so rbp is the 11th word, rsp the 16th, rip the 17th.
pub(crate) const SIGFRAME_RBP: u64 = UCONTEXT_MCONTEXT + 10 * 8;
pub(crate) const SIGFRAME_RSP: u64 = UCONTEXT_MCONTEXT + 15 * 8;
pub(crate) const SIGFRAME_RIP: u64 = UCONTEXT_MCONTEXT + 16 * 8;

/// How to recover the caller's `rip`, `rsp` and `rbp` at one address.
///
/// `cfa` is the canonical frame address: the value `rsp` had in the caller
/// just before the `call` instruction, so the caller's `rsp` is `cfa` and the
/// return address sits at `cfa - 8`. Registers other than rip, rsp and rbp are
/// not tracked: no rule below reads them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnwindRule {
    /// cfa = rsp + cfa_off; ra = *(cfa - 8); rbp unchanged
    Rsp { cfa_off: i32 },
    /// cfa = rsp + cfa_off; ra = *(cfa - 8); rbp = *(cfa + rbp_off)
    RspRbpSaved { cfa_off: i32, rbp_off: i32 },
    /// cfa = rbp + cfa_off; ra = *(cfa - 8); rbp unchanged
    Rbp { cfa_off: i32 },
    /// cfa = rbp + cfa_off; ra = *(cfa - 8); rbp = *(cfa + rbp_off)
    RbpRbpSaved { cfa_off: i32, rbp_off: i32 },
    /// cfa = rsp + 8 + ((rip & 15) >= threshold ? 8 : 0); ra = *(cfa - 8); rbp unchanged
    ///
    /// The expression binutils writes for `.plt`: inside a 16-byte lazy PLT
    /// entry, the instructions from byte `threshold` on run after the entry
    /// pushed the relocation index (11 for the classic PLT, 10 for the IBT one).
    Plt { threshold: u8 },
    /// ra undefined: this is the outermost frame (`_start`, a new thread's
    /// `clone` child), the walk ends here.
    Outermost,
    /// A signal trampoline (`__restore_rt`), whose rsp points at the kernel's
    /// `struct ucontext`: rip = *(rsp + 168); rsp = *(rsp + 160); rbp = *(rsp + 120).
    /// The recovered rip is the interrupted instruction, not a return address.
    SignalFrame,
    /// CFI this unwinder cannot evaluate; the walk stops rather than guess.
    Unsupported(UnsupportedCfi),
    /// Code without CFI that has its frame pointer set up wherever it
    /// calls out: V8's embedded builtins (`Builtins_*`), whose frames V8's
    /// own stack walker (garbage collection, exceptions) finds by rbp. At a
    /// return address into it: cfa = rbp + 16; ra = *(cfa - 8); rbp =
    /// *(cfa - 16). At the interrupted instruction the frame may not be set
    /// up yet (or torn down already), so a walk that starts there stops.
    FramePointerAtCalls,
}

/// Why a row is [`UnwindRule::Unsupported`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnsupportedCfi {
    /// The CFA is based on a register other than rsp or rbp (for example r10
    /// in functions that realign the stack).
    CfaRegister,
    /// The CFA is a DWARF expression other than the PLT one.
    CfaExpression,
    /// The return address is not saved at `cfa - 8`, or the return address
    /// column is not 16.
    ReturnAddress,
    /// rbp is recovered in some other way than unchanged or `*(cfa + off)`.
    Rbp,
    /// rsp has an explicit rule, while the unwinder assumes caller rsp = cfa.
    Rsp,
    /// An offset does not fit the row's 32-bit fields.
    OffsetRange,
    /// The FDE's instructions failed to evaluate (unknown opcode,
    /// `restore_state` without `remember_state`, ...): its whole range gets
    /// this rule. Also a Go function whose record or stack-pointer table
    /// in `.gopclntab` is malformed.
    Program,
    /// A Go function that switches stacks (flagged `SPWRITE` by Go's
    /// assembler: `runtime.systemstack`, `runtime.mcall`,
    /// `runtime.morestack`, `runtime.asmcgocall`, ...) or that is entered
    /// other than by a call (`runtime.sigtramp` by the kernel,
    /// `runtime.asyncPreempt` by a preemption signal): its caller's frame
    /// is on another stack or made no call, so stepping out of it by its
    /// stack-pointer table would not find a caller. Go's own traceback
    /// stops at (or specially handles) these too.
    StackSwitch,
}

/// One table row: addresses `[base + address, base + next.address)` follow
/// `rules[rule]` (or nothing, for [`NO_INFO`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub(crate) struct Row {
    pub(crate) address: u32,
    pub(crate) rule: u32,
}

/// The unwind rules of one binary, by file virtual address (before load bias).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct UnwindTable {
    base: u64,
    /// Sorted by strictly increasing `address`; the last one is `NO_INFO`.
    rows: Vec<Row>,
    /// Every distinct rule, indexed by `Row::rule`.
    rules: Vec<UnwindRule>,
    /// The code no row covers keeps frame pointers (see
    /// [`UnwindTable::frame_pointer_gaps`]).
    frame_pointer_gaps: bool,
}

/// Which section a table was compiled from; named in errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CfiSection {
    /// `.eh_frame`
    EhFrame,
    /// `.debug_frame`
    DebugFrame,
}

impl std::fmt::Display for CfiSection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::EhFrame => ".eh_frame",
            Self::DebugFrame => ".debug_frame",
        })
    }
}

/// Why a table could not be compiled.
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    /// The bytes are not a 64-bit ELF file, or its headers are damaged.
    #[error("not a readable 64-bit ELF file")]
    Elf(#[source] object::Error),
    /// The ELF file is for another machine or byte order than little-endian x86_64.
    #[error("ELF machine {machine} is not little-endian x86_64")]
    UnsupportedArchitecture {
        /// `e_machine` from the ELF header.
        machine: u16,
    },
    /// The file has neither a non-empty `.eh_frame` nor a `.debug_frame`.
    #[error("no .eh_frame or .debug_frame section")]
    NoCfi,
    /// A compressed CFI section (`SHF_COMPRESSED` or `.zdebug_*`) says it
    /// is larger than [`MAX_DECOMPRESSED_BYTES`] uncompressed: refused
    /// before anything is allocated for it.
    #[error("{section} claims {size} bytes uncompressed, more than the limit of {max}")]
    DecompressedTooLarge {
        /// The section.
        section: CfiSection,
        /// The size its compression header gives.
        size: u64,
        /// [`MAX_DECOMPRESSED_BYTES`].
        max: u64,
    },
    /// A compressed CFI section could not be decompressed: an unknown
    /// format, a corrupt stream, or fewer bytes than its header says.
    #[error("cannot decompress {section}")]
    Decompress {
        /// The section.
        section: CfiSection,
        #[source]
        source: object::Error,
    },
    /// The Go function table (`.gopclntab`) of a Go binary could not be
    /// read (its header or function index is malformed).
    #[error("malformed .gopclntab")]
    GoFunctionTable(#[source] stackscope_gopclntab::Error),
    /// The CFI section is truncated or malformed (a CIE or FDE header,
    /// augmentation or pointer encoding could not be parsed).
    #[error("malformed {section}")]
    Cfi {
        /// The section being parsed.
        section: CfiSection,
        #[source]
        source: gimli::Error,
    },
    /// An FDE's address range wraps around the end of the address space.
    #[error("FDE at {section} offset {offset:#x} covers {start:#x} + {length:#x}, past 2^64")]
    FdeRange {
        /// The section holding the FDE.
        section: CfiSection,
        /// The FDE's offset in its section.
        offset: u64,
        /// The FDE's initial location.
        start: u64,
        /// The FDE's address range length.
        length: u64,
    },
    /// The FDEs span more than 4 GiB of addresses, more than a row's `u32`
    /// address offset can express.
    #[error("FDEs span {base:#x}..{end:#x}, more than 4 GiB")]
    AddressSpan {
        /// Lowest FDE start.
        base: u64,
        /// The first address that did not fit.
        end: u64,
    },
    /// More distinct rules than a row's `u32` rule index can name.
    #[error("more than 2^32 - 1 distinct unwind rules")]
    TooManyRules,
}

impl UnwindTable {
    /// Compiles the CFI of an x86_64 ELF file (executable, shared library or
    /// separate debug file): `.eh_frame` when it has one with contents,
    /// otherwise `.debug_frame`.
    pub fn from_elf(data: &[u8]) -> Result<Self, TableError> {
        compile::from_elf(data)
    }

    /// Compiles a raw `.eh_frame` section loaded at file virtual address
    /// `section_address` (needed for its pc-relative pointers). Pointers
    /// relative to `.text` or the GOT are reported as errors:
    /// [`UnwindTable::from_elf`] knows those bases, this does not.
    pub fn from_eh_frame(data: &[u8], section_address: u64) -> Result<Self, TableError> {
        let bases = gimli::BaseAddresses::default().set_eh_frame(section_address);
        compile::from_eh_frame(data, &bases)
    }

    /// Compiles a raw `.debug_frame` section (absolute addresses).
    pub fn from_debug_frame(data: &[u8]) -> Result<Self, TableError> {
        compile::from_debug_frame(data)
    }

    /// The rule covering file virtual address `address`, or `None` when no
    /// FDE covers it (before the first FDE, between FDEs, after the last one).
    #[inline]
    pub fn lookup(&self, address: u64) -> Option<UnwindRule> {
        let offset = u32::try_from(address.checked_sub(self.base)?).ok()?;
        // Index of the first row starting after `offset`; the row before it covers it.
        let next = self.rows.partition_point(|row| row.address <= offset);
        let row = self.rows.get(next.checked_sub(1)?)?;
        // NO_INFO is out of range of `rules`, so `get` also handles the gaps.
        self.rules.get(row.rule as usize).copied()
    }

    /// Number of rows, gap rows and the terminator included.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// True when the CFI described no address at all.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Whether the binary's code that no row covers keeps frame pointers,
    /// so a walk may step out of it by rbp: that code is most of the
    /// binary (its CFI describes a sliver, as in a program built with
    /// frame pointers and without unwind tables), and it reads as such
    /// (its functions begin `push %rbp; mov %rsp,%rbp`). Known only for
    /// tables compiled from an ELF file.
    pub fn frame_pointer_gaps(&self) -> bool {
        self.frame_pointer_gaps
    }

    /// Bytes of code the rows cover (gaps and the terminator excluded).
    /// One pass over the rows: callers that need it often keep it.
    pub(crate) fn covered_bytes(&self) -> u64 {
        self.rows
            .windows(2)
            .filter(|pair| self.rules.get(pair[0].rule as usize).is_some())
            .map(|pair| u64::from(pair[1].address - pair[0].address))
            .sum()
    }

    /// Number of distinct rules the rows index.
    pub fn rule_count(&self) -> usize {
        self.rules.len()
    }

    /// Heap memory held by the table.
    pub fn heap_bytes(&self) -> usize {
        self.rows.capacity() * size_of::<Row>() + self.rules.capacity() * size_of::<UnwindRule>()
    }

    /// Every row in address order: its first address and its rule (`None`
    /// for a gap, and for the terminator that follows the last FDE).
    pub fn rows(&self) -> impl ExactSizeIterator<Item = (u64, Option<UnwindRule>)> + '_ {
        self.rows.iter().map(|row| {
            (
                self.base.wrapping_add(u64::from(row.address)),
                self.rules.get(row.rule as usize).copied(),
            )
        })
    }

    /// Builds a table from `(start address, rule)` rows, `None` for gaps;
    /// for tests of code that consumes tables.
    #[cfg(test)]
    pub(crate) fn from_rows(rows: &[(u64, Option<UnwindRule>)]) -> Self {
        let base = rows.first().map_or(0, |&(address, _)| address);
        let mut rules: Vec<UnwindRule> = Vec::new();
        let rows = rows
            .iter()
            .map(|&(address, rule)| Row {
                address: u32::try_from(address - base).expect("test rows span < 4 GiB"),
                rule: rule.map_or(NO_INFO, |rule| {
                    let index = rules.iter().position(|&r| r == rule).unwrap_or_else(|| {
                        rules.push(rule);
                        rules.len() - 1
                    });
                    index as u32
                }),
            })
            .collect();
        Self {
            base,
            rows,
            rules,
            frame_pointer_gaps: false,
        }
    }

    /// Serialises the table for the on-disk cache (see [`Self::from_bytes`]).
    pub fn to_bytes(&self) -> Vec<u8> {
        cache::encode(self)
    }

    /// Reads a table written by [`Self::to_bytes`]. A file from another
    /// format version, a truncated or corrupt file, or one whose rows break
    /// the table's invariants is an error, so the caller recompiles.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, CacheError> {
        cache::decode(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Habit 3: the hot types' sizes are part of the design (rows are the
    // bulk of an agent's memory); a change must be deliberate.
    #[test]
    fn hot_type_sizes() {
        assert_eq!(size_of::<Row>(), 8);
        assert_eq!(size_of::<UnwindRule>(), 12);
        assert_eq!(size_of::<Option<UnwindRule>>(), 12);
    }

    #[test]
    fn counts_the_bytes_rows_cover() {
        let rule = Some(UnwindRule::Rsp { cfa_off: 8 });
        let table = UnwindTable::from_rows(&[
            (0x1000, rule),
            (0x1100, rule),
            (0x1200, None),
            (0x1300, rule),
            (0x1400, None),
        ]);
        assert_eq!(table.covered_bytes(), 0x300);
        assert_eq!(UnwindTable::default().covered_bytes(), 0);
    }

    #[test]
    fn signal_frame_offsets_match_the_kernel_layout() {
        // glibc's __restore_rt CFI says the same: rbp at rsp+120, rsp at
        // rsp+160, rip at rsp+168.
        assert_eq!(SIGFRAME_RBP, 120);
        assert_eq!(SIGFRAME_RSP, 160);
        assert_eq!(SIGFRAME_RIP, 168);
    }

    fn table(base: u64, rows: &[(u32, u32)], rules: &[UnwindRule]) -> UnwindTable {
        UnwindTable {
            base,
            rows: rows
                .iter()
                .map(|&(address, rule)| Row { address, rule })
                .collect(),
            rules: rules.to_vec(),
            frame_pointer_gaps: false,
        }
    }

    #[test]
    fn lookup_covers_half_open_ranges_and_gaps() {
        let a = UnwindRule::Rsp { cfa_off: 8 };
        let b = UnwindRule::Rsp { cfa_off: 16 };
        let t = table(
            0x1000,
            &[(0, 0), (4, 1), (0x10, NO_INFO), (0x20, 0), (0x30, NO_INFO)],
            &[a, b],
        );
        assert_eq!(t.lookup(0xfff), None);
        assert_eq!(t.lookup(0x1000), Some(a));
        assert_eq!(t.lookup(0x1003), Some(a));
        assert_eq!(t.lookup(0x1004), Some(b));
        assert_eq!(t.lookup(0x100f), Some(b));
        assert_eq!(t.lookup(0x1010), None);
        assert_eq!(t.lookup(0x101f), None);
        assert_eq!(t.lookup(0x1020), Some(a));
        assert_eq!(t.lookup(0x102f), Some(a));
        assert_eq!(t.lookup(0x1030), None);
        assert_eq!(t.lookup(u64::MAX), None);
        assert_eq!(t.lookup(0), None);
        assert_eq!(t.len(), 5);
        assert_eq!(UnwindTable::default().lookup(0x1000), None);
    }
}
