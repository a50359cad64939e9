//! Reads the Go runtime's function table, `.gopclntab`, which every Go
//! binary keeps for its own tracebacks even when it is stripped of symbols
//! and DWARF (`go build -ldflags="-s -w"`).
//!
//! Owns parsing the table's header, its function index (one entry per
//! function, sorted by address), each function's record (name, flags, and
//! the offsets of its pc-value tables), and decoding the pc-value tables
//! this crate's users need: the stack-pointer delta (`pcsp`), the file and
//! line (`pcfile`, `pcln`) and whether code is inlined (`pcdata[2]`). It
//! does not own finding the section in a file (callers hand over its
//! bytes and the address of `.text`), nor what the values are used for
//! (unwind rules, names).
//!
//! Formats covered, by the magic number the Go linker writes first:
//! `0xfffffffa` (Go 1.16 and 1.17), `0xfffffff0` (Go 1.18 and 1.19) and
//! `0xfffffff1` (Go 1.20 and later, to 1.25 at least); little-endian, 8-byte
//! pointers (amd64) and 4-byte ones. Tables from before Go 1.16 (magic
//! `0xfffffffb`) are refused. What the format is, as this crate reads it:
//! Go's `runtime/symtab.go` (`pcHeader`, `_func`, `step`, `pcvalue`) and
//! `debug/gosym/pclntab.go`.
//!
//! The bytes are untrusted: every offset is bounds-checked, every varint is
//! bounded, nothing panics and nothing allocates in proportion to what a
//! header claims. A table whose function index is not sorted is refused
//! when parsed, so a lookup by address never names the wrong function.

use std::ops::Range;

/// The names Go's linker gives the section holding the table: its own
/// in an executable, inside `.data.rel.ro` in a position-independent one
/// (`-buildmode=pie`), where the loader relocates its start-of-text word.
pub const SECTION_NAMES: [&str; 2] = [".gopclntab", ".data.rel.ro.gopclntab"];

/// Go 1.16 and 1.17.
pub const MAGIC_GO1_16: u32 = 0xffff_fffa;
/// Go 1.18 and 1.19.
pub const MAGIC_GO1_18: u32 = 0xffff_fff0;
/// Go 1.20 and later.
pub const MAGIC_GO1_20: u32 = 0xffff_fff1;

/// `funcFlag_TOPFRAME`: the function is at the top of its stack; Go's
/// own traceback stops there (`runtime.goexit`, `runtime.mstart`,
/// `runtime.rt0_go`, `runtime.sigtramp`). Go 1.17 and later.
pub const FLAG_TOPFRAME: u8 = 1 << 0;
/// `funcFlag_SPWRITE`: the function writes SP other than by adding or
/// subtracting a constant (it switches stacks), so its `pcsp` table does
/// not say where its caller's frame is. Go 1.17 and later.
pub const FLAG_SPWRITE: u8 = 1 << 1;
/// `funcFlag_ASM`: written in assembly. Go 1.19 and later.
pub const FLAG_ASM: u8 = 1 << 2;

/// `_PCDATA_InlTreeIndex`: the pcdata table saying which inlined call (if
/// any) an instruction belongs to.
const PCDATA_INL_TREE_INDEX: u32 = 2;

/// Longest name read (generic instantiations make long names, not this
/// long): a name without its terminating NUL within it is an error.
const MAX_NAME_BYTES: usize = 1 << 16;

/// Which layout a table has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Version {
    /// Magic `0xfffffffa`: Go 1.16 and 1.17 (function entries are
    /// absolute addresses; 1.16 leaves the flags byte zero).
    Go1_16,
    /// Magic `0xfffffff0`: Go 1.18 and 1.19 (entries are 32-bit offsets
    /// from the start of the text).
    Go1_18,
    /// Magic `0xfffffff1`: Go 1.20 and later (a function record gained
    /// its start line).
    Go1_20,
}

/// Why a table or one of its parts cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The bytes end before something the table says is there.
    #[error("{what} at offset {offset:#x} lies past the end of the table")]
    Truncated {
        /// What was being read.
        what: &'static str,
        /// Where, from the start of the part it is in.
        offset: u64,
    },
    /// The first four bytes are not a Go 1.16+ table's magic.
    #[error("magic {0:#010x} is not a Go 1.16 or later function table")]
    UnknownMagic(u32),
    /// The pad bytes are not zero, or the instruction size or the
    /// pointer size is not one Go uses.
    #[error("malformed header (pc quantum {quantum}, pointer size {ptr_size})")]
    BadHeader {
        /// Instruction size unit (1 on x86).
        quantum: u8,
        /// 4 or 8.
        ptr_size: u8,
    },
    /// The function index is not sorted by address.
    #[error("function {index} does not start after the one before it")]
    Unsorted {
        /// Index of the function out of order.
        index: usize,
    },
    /// A function's record does not start at the address its index entry
    /// gives: the record offset is wrong.
    #[error("function {index}'s record does not match its index entry")]
    RecordMismatch {
        /// Index of the function.
        index: usize,
    },
    /// A name is not NUL-terminated within bounds or not UTF-8.
    #[error("malformed string at offset {offset:#x}")]
    BadString {
        /// Offset in its string table.
        offset: u64,
    },
    /// A pc-value table has a varint longer than 32 bits or steps past
    /// the end of the address space.
    #[error("malformed pc-value table at offset {offset:#x}")]
    BadPcValue {
        /// The table's offset in `pctab`.
        offset: u64,
    },
}

/// A parsed `.gopclntab`. Borrowing the section's bytes; cheap to copy.
#[derive(Clone, Copy, Debug)]
pub struct Table<'a> {
    version: Version,
    quantum: u8,
    ptr_size: u8,
    nfunc: usize,
    text_start: u64,
    funcnametab: &'a [u8],
    cutab: &'a [u8],
    filetab: &'a [u8],
    pctab: &'a [u8],
    /// The function index (`nfunc + 1` entries of two fields), then the
    /// function records it points into.
    functab: &'a [u8],
    /// Bytes per index field: 4 from Go 1.18, a pointer before.
    field: usize,
}

/// One function's record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Func<'a> {
    /// Its index in the table.
    pub index: usize,
    /// Its addresses, `entry..end` (the next function's entry).
    pub entry: u64,
    pub end: u64,
    /// The name, as Go's traceback prints it (`main.main`,
    /// `crypto/sha256.block`, `main.(*T).m`).
    pub name: &'a str,
    /// `funcID`: which special runtime function this is, if any (the
    /// numbering changes between Go releases: compare names instead).
    pub func_id: u8,
    /// `FLAG_*` bits; always 0 in Go 1.16 tables.
    pub flags: u8,
    pcsp: u32,
    pcfile: u32,
    pcln: u32,
    cu_offset: u32,
    /// `pcdata[..]` offsets, in `functab`.
    pcdata: &'a [u8],
}

impl Func<'_> {
    /// Whether `pc` is in this function.
    pub fn contains(&self, pc: u64) -> bool {
        (self.entry..self.end).contains(&pc)
    }
}

/// Reads little-endian integers at offsets of a slice, as errors rather
/// than panics.
fn u32_at(data: &[u8], offset: usize, what: &'static str) -> Result<u32, Error> {
    offset
        .checked_add(4)
        .and_then(|end| data.get(offset..end))
        .map(|bytes| u32::from_le_bytes(bytes.try_into().unwrap_or([0; 4])))
        .ok_or(Error::Truncated {
            what,
            offset: offset as u64,
        })
}

fn uint_at(data: &[u8], offset: usize, size: usize, what: &'static str) -> Result<u64, Error> {
    if size == 4 {
        return u32_at(data, offset, what).map(u64::from);
    }
    offset
        .checked_add(8)
        .and_then(|end| data.get(offset..end))
        .map(|bytes| u64::from_le_bytes(bytes.try_into().unwrap_or([0; 8])))
        .ok_or(Error::Truncated {
            what,
            offset: offset as u64,
        })
}

/// `data[offset..]`, or an error naming `what`.
fn tail<'a>(data: &'a [u8], offset: u64, what: &'static str) -> Result<&'a [u8], Error> {
    usize::try_from(offset)
        .ok()
        .and_then(|at| data.get(at..))
        .ok_or(Error::Truncated { what, offset })
}

/// The NUL-terminated string at `offset` of `data`.
fn string_at(data: &[u8], offset: u64) -> Result<&str, Error> {
    let bad = Error::BadString { offset };
    let bytes = usize::try_from(offset)
        .ok()
        .and_then(|at| data.get(at..))
        .ok_or(bad.clone())?;
    let window = &bytes[..bytes.len().min(MAX_NAME_BYTES)];
    let len = window.iter().position(|&b| b == 0).ok_or(bad.clone())?;
    std::str::from_utf8(&window[..len]).map_err(|_| bad)
}

impl<'a> Table<'a> {
    /// Parses the header and checks the function index. `text_start` is
    /// the address of the binary's `.text` section, used where the
    /// header's own start of text is 0 (a position-independent binary,
    /// whose header is relocated only when loaded) and for Go 1.16 tables
    /// never (their entries are absolute).
    pub fn parse(data: &'a [u8], text_start: u64) -> Result<Self, Error> {
        let magic = u32_at(data, 0, "header")?;
        let version = match magic {
            MAGIC_GO1_16 => Version::Go1_16,
            MAGIC_GO1_18 => Version::Go1_18,
            MAGIC_GO1_20 => Version::Go1_20,
            other => return Err(Error::UnknownMagic(other)),
        };
        let &[_, _, _, _, pad1, pad2, quantum, ptr_size, ..] = data else {
            return Err(Error::Truncated {
                what: "header",
                offset: 4,
            });
        };
        if pad1 != 0 || pad2 != 0 || !matches!(quantum, 1 | 2 | 4) || !matches!(ptr_size, 4 | 8) {
            return Err(Error::BadHeader { quantum, ptr_size });
        }
        let size = usize::from(ptr_size);
        let word = |i: usize| uint_at(data, 8 + i * size, size, "header");
        let nfunc = word(0)?;
        // Word 1 is the number of files, which nothing here needs.
        let (header_text, first_offset) = match version {
            Version::Go1_16 => (0, 2),
            Version::Go1_18 | Version::Go1_20 => (word(2)?, 3),
        };
        let part = |i: usize, what| -> Result<&'a [u8], Error> {
            tail(data, word(first_offset + i)?, what)
        };
        let funcnametab = part(0, "function name table")?;
        let cutab = part(1, "compilation unit table")?;
        let filetab = part(2, "file table")?;
        let pctab = part(3, "pc-value tables")?;
        let functab = part(4, "function table")?;
        let field = match version {
            Version::Go1_16 => size,
            Version::Go1_18 | Version::Go1_20 => 4,
        };
        let table = Table {
            version,
            quantum,
            ptr_size,
            nfunc: usize::try_from(nfunc).unwrap_or(usize::MAX),
            text_start: if header_text != 0 {
                header_text
            } else {
                text_start
            },
            funcnametab,
            cutab,
            filetab,
            pctab,
            functab,
            field,
        };
        // The index holds nfunc + 1 entries (the last one is the end of
        // the last function): checked against the bytes before anything
        // is sized by nfunc.
        table
            .nfunc
            .checked_add(1)
            .and_then(|n| n.checked_mul(2 * field))
            .filter(|&bytes| bytes <= functab.len())
            .ok_or(Error::Truncated {
                what: "function index",
                offset: 0,
            })?;
        let mut previous = 0;
        for index in 0..=table.nfunc {
            let entry = table.entry(index)?;
            if index > 0 && entry < previous {
                return Err(Error::Unsorted { index });
            }
            previous = entry;
        }
        Ok(table)
    }

    /// The layout the table has.
    pub fn version(&self) -> Version {
        self.version
    }

    /// Pointer size of the target, in bytes.
    pub fn ptr_size(&self) -> u8 {
        self.ptr_size
    }

    /// Number of functions.
    pub fn len(&self) -> usize {
        self.nfunc
    }

    /// True when the table lists no function.
    pub fn is_empty(&self) -> bool {
        self.nfunc == 0
    }

    /// The addresses the table's functions cover.
    pub fn range(&self) -> Range<u64> {
        match (self.entry(0), self.entry(self.nfunc)) {
            (Ok(start), Ok(end)) => start..end,
            _ => 0..0,
        }
    }

    /// Entry address of function `index` (`index == len()`: the end of
    /// the last function).
    fn entry(&self, index: usize) -> Result<u64, Error> {
        let at = index.checked_mul(2 * self.field).ok_or(Error::Truncated {
            what: "function index",
            offset: u64::MAX,
        })?;
        let value = uint_at(self.functab, at, self.field, "function index")?;
        Ok(match self.version {
            Version::Go1_16 => value,
            Version::Go1_18 | Version::Go1_20 => self.text_start.wrapping_add(value),
        })
    }

    /// Function `index`'s addresses, from the index alone (checked when
    /// the table was parsed): known even when its record is damaged.
    pub fn func_range(&self, index: usize) -> Result<Range<u64>, Error> {
        let index = self.checked_index(index)?;
        Ok(self.entry(index)?..self.entry(index + 1)?)
    }

    /// `index` if it names a function (so `index + 1` names its end).
    fn checked_index(&self, index: usize) -> Result<usize, Error> {
        if index < self.nfunc {
            Ok(index)
        } else {
            Err(Error::Truncated {
                what: "function index",
                offset: u64::try_from(index).unwrap_or(u64::MAX),
            })
        }
    }

    /// Function `index`'s record.
    pub fn func(&self, index: usize) -> Result<Func<'a>, Error> {
        // In bounds of the index checked at parse time, so the arithmetic
        // below cannot overflow.
        let index = self.checked_index(index)?;
        let entry = self.entry(index)?;
        let end = self.entry(index + 1)?;
        let at = index * 2 * self.field + self.field;
        let record_offset = uint_at(self.functab, at, self.field, "function index")?;
        let record = tail(self.functab, record_offset, "function record")?;
        // Fields after the entry, by layout; the entry itself is checked
        // against the index (a wrong record offset reads as a mismatch).
        let (base, func_id_at, flags_at, size) = match self.version {
            Version::Go1_16 => {
                let base = self.field;
                (base, base + 32, base + 33, base + 36)
            }
            Version::Go1_18 => (4, 36, 37, 40),
            Version::Go1_20 => (4, 40, 41, 44),
        };
        let fixed = record.get(..size).ok_or(Error::Truncated {
            what: "function record",
            offset: record_offset,
        })?;
        let record_entry = uint_at(fixed, 0, base, "function record")?;
        let expected = match self.version {
            Version::Go1_16 => entry,
            Version::Go1_18 | Version::Go1_20 => entry.wrapping_sub(self.text_start),
        };
        if record_entry != expected {
            return Err(Error::RecordMismatch { index });
        }
        let field = |i: usize| u32_at(fixed, base + 4 * i, "function record");
        let name_offset = field(0)?;
        let npcdata = field(6)?;
        let pcdata_bytes = usize::try_from(npcdata)
            .ok()
            .and_then(|n| n.checked_mul(4))
            .and_then(|bytes| record.get(size..size.checked_add(bytes)?))
            .ok_or(Error::Truncated {
                what: "pcdata offsets",
                offset: record_offset,
            })?;
        Ok(Func {
            index,
            entry,
            end,
            name: string_at(self.funcnametab, u64::from(name_offset))?,
            func_id: fixed[func_id_at],
            flags: if self.version == Version::Go1_16 {
                // Go 1.16's byte here is padding; 1.17 put the flags in it
                // under the same magic, so it is read as flags only when
                // it holds nothing but known ones.
                let byte = fixed[flags_at];
                if byte & !(FLAG_TOPFRAME | FLAG_SPWRITE | FLAG_ASM) == 0 {
                    byte
                } else {
                    0
                }
            } else {
                fixed[flags_at]
            },
            pcsp: field(3)?,
            pcfile: field(4)?,
            pcln: field(5)?,
            cu_offset: field(7)?,
            pcdata: pcdata_bytes,
        })
    }

    /// Every function, in address order.
    pub fn funcs(&self) -> impl Iterator<Item = Result<Func<'a>, Error>> + '_ {
        (0..self.nfunc).map(|index| self.func(index))
    }

    /// The function containing `pc`, if any.
    pub fn func_at(&self, pc: u64) -> Result<Option<Func<'a>>, Error> {
        let range = self.range();
        if !range.contains(&pc) {
            return Ok(None);
        }
        // The index was checked sorted when parsed: the function starting
        // last at or before `pc`.
        let (mut low, mut high) = (0, self.nfunc);
        while low < high {
            let mid = low + (high - low) / 2;
            if self.entry(mid)? <= pc {
                low = mid + 1;
            } else {
                high = mid;
            }
        }
        let Some(index) = low.checked_sub(1) else {
            return Ok(None);
        };
        let func = self.func(index)?;
        Ok(func.contains(pc).then_some(func))
    }

    /// `func`'s stack-pointer deltas: for each address range, how many
    /// bytes the function has pushed or reserved below the stack pointer
    /// it was entered with (the return address excluded).
    pub fn sp_deltas(&self, func: &Func<'a>) -> PcValues<'a> {
        self.pc_values(func, func.pcsp)
    }

    /// The file and line of `pc` in `func`, unless `pc` is in code inlined
    /// from another function: then the line is the inlined function's,
    /// which under `func`'s name would mislead, and `None` is returned.
    pub fn file_line(&self, func: &Func<'a>, pc: u64) -> Result<Option<(&'a str, u32)>, Error> {
        if !func.contains(pc) {
            return Ok(None);
        }
        if let Some(offset) = func
            .pcdata
            .chunks_exact(4)
            .nth(PCDATA_INL_TREE_INDEX as usize)
            .map(|bytes| u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
            && offset != 0
            && self
                .pc_values(func, offset)
                .value_at(pc)?
                .is_some_and(|v| v >= 0)
        {
            return Ok(None);
        }
        let Some(file) = self.pc_values(func, func.pcfile).value_at(pc)? else {
            return Ok(None);
        };
        let Some(line) = self.pc_values(func, func.pcln).value_at(pc)? else {
            return Ok(None);
        };
        let (Ok(file), Ok(line)) = (u32::try_from(file), u32::try_from(line)) else {
            return Ok(None);
        };
        let slot = u64::from(func.cu_offset) + u64::from(file);
        let file_offset = usize::try_from(slot)
            .ok()
            .and_then(|slot| slot.checked_mul(4))
            .map_or(
                Err(Error::Truncated {
                    what: "compilation unit table",
                    offset: slot,
                }),
                |at| u32_at(self.cutab, at, "compilation unit table"),
            )?;
        if file_offset == u32::MAX {
            return Ok(None);
        }
        let name = string_at(self.filetab, u64::from(file_offset))?;
        Ok(Some((name, line)))
    }

    fn pc_values(&self, func: &Func<'a>, offset: u32) -> PcValues<'a> {
        // Offset 0 means the function has no such table.
        let data = if offset == 0 {
            &[][..]
        } else {
            self.pctab.get(offset as usize..).unwrap_or(&[])
        };
        PcValues {
            data,
            offset,
            entry: func.entry,
            pc: func.entry,
            end: func.end,
            value: -1,
            quantum: u64::from(self.quantum),
            state: if offset == 0 || data.is_empty() {
                if offset != 0 {
                    PcState::Failed
                } else {
                    PcState::Done
                }
            } else {
                PcState::Going
            },
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PcState {
    Going,
    Done,
    /// The table's offset lies outside `pctab`: reported once.
    Failed,
}

/// One pc-value table of one function, decoded as Go's `runtime.step`
/// does: pairs of a zig-zag value delta and an instruction-count delta,
/// starting from value -1 at the function's entry, ending at a zero value
/// delta (after the first pair) or the function's end.
#[derive(Clone, Debug)]
pub struct PcValues<'a> {
    data: &'a [u8],
    offset: u32,
    entry: u64,
    pc: u64,
    end: u64,
    value: i32,
    quantum: u64,
    state: PcState,
}

impl PcValues<'_> {
    /// The value at `pc`, if the table covers it.
    pub fn value_at(mut self, pc: u64) -> Result<Option<i32>, Error> {
        for item in &mut self {
            let (range, value) = item?;
            if range.contains(&pc) {
                return Ok(Some(value));
            }
            if range.start > pc {
                break;
            }
        }
        Ok(None)
    }

    fn error(&mut self) -> Error {
        self.state = PcState::Done;
        Error::BadPcValue {
            offset: u64::from(self.offset),
        }
    }

    /// A varint of at most 32 bits (5 bytes), advancing `data`.
    fn varint(&mut self) -> Option<u32> {
        let mut value: u32 = 0;
        for (i, &byte) in self.data.iter().take(5).enumerate() {
            let bits = u32::from(byte & 0x7f);
            if i == 4 && bits > 0x0f {
                return None;
            }
            value |= bits << (7 * i);
            if byte & 0x80 == 0 {
                self.data = &self.data[i + 1..];
                return Some(value);
            }
        }
        None
    }
}

impl Iterator for PcValues<'_> {
    /// Addresses `start..end` and their value.
    type Item = Result<(Range<u64>, i32), Error>;

    fn next(&mut self) -> Option<Self::Item> {
        match self.state {
            PcState::Done => return None,
            PcState::Failed => return Some(Err(self.error())),
            PcState::Going => {}
        }
        if self.pc >= self.end {
            self.state = PcState::Done;
            return None;
        }
        let first = self.pc == self.entry;
        match self.data.first() {
            None => return Some(Err(self.error())),
            Some(0) if !first => {
                self.state = PcState::Done;
                return None;
            }
            Some(_) => {}
        }
        let Some(value_delta) = self.varint() else {
            return Some(Err(self.error()));
        };
        // Zig-zag: the low bit is the sign.
        let delta = ((value_delta >> 1) as i32) ^ -((value_delta & 1) as i32);
        self.value = self.value.wrapping_add(delta);
        let Some(pc_delta) = self.varint() else {
            return Some(Err(self.error()));
        };
        let Some(next) = u64::from(pc_delta)
            .checked_mul(self.quantum)
            .and_then(|delta| self.pc.checked_add(delta))
        else {
            return Some(Err(self.error()));
        };
        let start = self.pc;
        self.pc = next;
        // Tables end at the function's end; one that runs past it is cut
        // there rather than describe the next function.
        Some(Ok((start..next.min(self.end), self.value)))
    }
}

#[cfg(test)]
mod tests;

#[cfg(feature = "elf")]
pub mod elf;
