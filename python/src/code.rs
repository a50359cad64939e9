//! Code objects read from a CPython process: what names a frame the sampler
//! found (qualified name, file, line).
//!
//! The sampler reads a frame's code object address and a fingerprint at
//! the tick: the object's first line, or the size of the frame (which the
//! object fixes: `agent_common::PythonFrame::FRAME_SIZE`); the object is
//! read here later. Code objects live as long as their function or
//! module, but one freed in between can have its address reused: the
//! fingerprint read here must match the tick's, or the frame is refused
//! (`CodeError::Stale`). Everything read is bounded (names, files
//! and location tables) and checked, so a process with garbage where a
//! code object should be costs a few small reads and an error.

use std::{collections::HashMap, io, sync::Arc};

use agent_common::PythonFrame;

use crate::{
    Layout,
    layout::{CodeFrameSize, FRAME_SPECIALS_WORDS_3_11, LineTable},
};

/// Longest name or file name read, in characters.
const MAX_STRING_CHARS: u64 = 4096;
/// Longest location table read.
const MAX_LINETABLE_BYTES: u64 = 64 << 10;

/// One code object, as much of it as names its frames.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CodeObject {
    /// `co_qualname`: `Class.method`, `outer.<locals>.inner`, `<module>`.
    pub qualname: Arc<str>,
    pub filename: Arc<str>,
    pub first_line: u32,
    linetable: Vec<u8>,
    format: LineTable,
}

/// Why a code object could not be read.
#[derive(Debug, thiserror::Error)]
pub enum CodeError {
    #[error("reading {len} bytes at {addr:#x}: {source}")]
    Read {
        addr: u64,
        len: usize,
        #[source]
        source: io::Error,
    },
    #[error("the code object's {what} is {found}, the sample's {expected}: its address was reused")]
    Stale {
        what: &'static str,
        expected: u32,
        found: i64,
    },
    #[error("a first line of {0}: not a code object")]
    BadFirstLine(i64),
    #[error("not a string CPython makes: {0}")]
    BadString(&'static str),
    #[error("location table of {0} bytes is longer than {MAX_LINETABLE_BYTES}")]
    LongLinetable(u64),
}

/// Another process's memory, read with `process_vm_readv`.
#[derive(Debug, Clone, Copy)]
pub struct ProcessMemory {
    pub pid: u32,
}

impl ProcessMemory {
    /// Fills `buf` from `addr`; a short read is an error.
    pub fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), CodeError> {
        let len = buf.len();
        let error = |source| CodeError::Read { addr, len, source };
        let local = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        let remote = libc::iovec {
            iov_base: addr as *mut libc::c_void,
            iov_len: buf.len(),
        };
        // SAFETY: one local iovec over `buf`, which we own; the remote
        // range is only read by the kernel, which checks it.
        let read = unsafe { libc::process_vm_readv(self.pid as i32, &local, 1, &remote, 1, 0) };
        match read {
            -1 => Err(error(io::Error::last_os_error())),
            n if n as usize == len => Ok(()),
            _ => Err(error(io::ErrorKind::UnexpectedEof.into())),
        }
    }

    fn u64_at(&self, addr: u64) -> Result<u64, CodeError> {
        let mut word = [0; 8];
        self.read(addr, &mut word)?;
        Ok(u64::from_ne_bytes(word))
    }
}

impl CodeObject {
    /// Reads the code object at `code`, refusing it unless it has the
    /// `fingerprint` the sampler read (`PythonFrame::first_line` without
    /// its entry mark): its first line, or with `PythonFrame::FRAME_SIZE`
    /// the size of its frames in words.
    pub fn read(
        memory: &ProcessMemory,
        layout: &Layout,
        code: u64,
        fingerprint: u32,
    ) -> Result<Self, CodeError> {
        // Up to the bytecode (3.11+) or the last field read (3.10).
        let mut object = vec![0; layout.code_bytecode as usize];
        memory.read(code, &mut object)?;
        let int = |offset: u32| -> i64 {
            let at = offset as usize;
            i32::from_ne_bytes(object[at..at + 4].try_into().expect("4 bytes")).into()
        };
        let first_line = int(layout.code_first_line);
        let (what, found) = if fingerprint & PythonFrame::FRAME_SIZE != 0 {
            let words = match layout.code_frame_size {
                CodeFrameSize::None => -1,
                CodeFrameSize::Slots {
                    nlocalsplus,
                    stacksize,
                } => int(nlocalsplus) + int(stacksize) + i64::from(FRAME_SPECIALS_WORDS_3_11),
                CodeFrameSize::Field(offset) => int(offset),
            };
            ("frame size", words)
        } else {
            ("first line", first_line)
        };
        let expected = fingerprint & !PythonFrame::FRAME_SIZE;
        if found != i64::from(expected) {
            return Err(CodeError::Stale {
                what,
                expected,
                found,
            });
        }
        let first_line =
            u32::try_from(first_line).map_err(|_| CodeError::BadFirstLine(first_line))?;
        let field = |offset: u32, size: usize| -> &[u8] {
            &object[offset as usize..offset as usize + size]
        };
        let pointer = |offset| u64::from_ne_bytes(field(offset, 8).try_into().expect("8"));
        Ok(Self {
            qualname: read_string(memory, layout, pointer(layout.code_qualname))?.into(),
            filename: read_string(memory, layout, pointer(layout.code_filename))?.into(),
            first_line,
            linetable: read_bytes(memory, pointer(layout.code_linetable))?,
            format: layout.line_table,
        })
    }

    /// The line of the instruction at byte `instr_offset` of the bytecode
    /// (as the sampler computed it); None when the table gives it none.
    pub fn line_of(&self, instr_offset: i32) -> Option<u32> {
        match self.format {
            LineTable::Pep626 => self.pep626_line_of(instr_offset),
            LineTable::Locations => self.location_line_of(instr_offset),
        }
    }

    /// From 3.10's line table: (bytes, line delta) pairs, a delta of -128
    /// for bytes with no line. A pair of no bytes still moves the line (a
    /// jump of more than 127 lines takes several).
    fn pep626_line_of(&self, instr_offset: i32) -> Option<u32> {
        let target = u64::try_from(instr_offset.max(0)).ok()?;
        let mut line = i64::from(self.first_line);
        let mut end = 0u64;
        for pair in self.linetable.chunks_exact(2) {
            end += u64::from(pair[0]);
            let delta = pair[1] as i8;
            if delta != -128 {
                line += i64::from(delta);
            }
            // Earlier pairs ended at or before `target`.
            if target < end {
                return (delta != -128).then(|| u32::try_from(line).ok()).flatten();
            }
        }
        None
    }

    /// From the location table of CPython 3.11+ (`Objects/locations.md`).
    fn location_line_of(&self, instr_offset: i32) -> Option<u32> {
        let target = u64::try_from(instr_offset.max(0) / 2).ok()?;
        let table = &self.linetable;
        let mut at = 0;
        let mut line = i64::from(self.first_line);
        let mut unit = 0u64;
        while at < table.len() {
            let first = table[at];
            at += 1;
            let code = (first >> 3) & 15;
            let length = u64::from(first & 7) + 1;
            let has_line = match code {
                15 => false,
                14 => {
                    line += signed_varint(table, &mut at)?;
                    for _ in 0..3 {
                        varint(table, &mut at)?;
                    }
                    true
                }
                13 => {
                    line += signed_varint(table, &mut at)?;
                    true
                }
                10..=12 => {
                    line += i64::from(code - 10);
                    at += 2;
                    true
                }
                _ => {
                    at += 1;
                    true
                }
            };
            if target < unit + length {
                return has_line.then(|| u32::try_from(line).ok()).flatten();
            }
            unit += length;
        }
        None
    }
}

/// An unsigned varint of the location table: 6-bit chunks, least first,
/// 0x40 set on all but the last.
fn varint(table: &[u8], at: &mut usize) -> Option<u64> {
    let mut value = 0u64;
    let mut shift = 0;
    loop {
        let byte = *table.get(*at)?;
        *at += 1;
        value |= u64::from(byte & 63).checked_shl(shift)?;
        shift += 6;
        if byte & 64 == 0 || shift > 60 {
            return Some(value);
        }
    }
}

fn signed_varint(table: &[u8], at: &mut usize) -> Option<i64> {
    let value = varint(table, at)?;
    let magnitude = (value >> 1) as i64;
    Some(if value & 1 != 0 {
        -magnitude
    } else {
        magnitude
    })
}

/// A `str` object's text. CPython makes names and file names compact
/// strings: the characters follow the object, 1, 2 or 4 bytes each.
fn read_string(memory: &ProcessMemory, layout: &Layout, addr: u64) -> Result<String, CodeError> {
    let length = memory.u64_at(addr + 16)?;
    let mut state = [0; 4];
    memory.read(addr + 32, &mut state)?;
    let state = u32::from_ne_bytes(state);
    let (kind, compact, ascii) = (
        (state >> 2) & 7,
        (state >> 5) & 1 != 0,
        (state >> 6) & 1 != 0,
    );
    if !compact {
        return Err(CodeError::BadString("not compact"));
    }
    if length > MAX_STRING_CHARS {
        return Err(CodeError::BadString("too long"));
    }
    let data = addr
        + u64::from(if ascii {
            layout.ascii_data
        } else {
            layout.compact_data
        });
    let width = match kind {
        1 | 2 | 4 => kind as usize,
        _ => return Err(CodeError::BadString("unknown kind")),
    };
    let mut bytes = vec![0; length as usize * width];
    memory.read(data, &mut bytes)?;
    let chars: Option<String> = match width {
        1 => Some(bytes.iter().map(|&b| char::from(b)).collect()),
        2 => bytes
            .chunks_exact(2)
            .map(|c| char::from_u32(u32::from(u16::from_ne_bytes([c[0], c[1]]))))
            .collect(),
        _ => bytes
            .chunks_exact(4)
            .map(|c| char::from_u32(u32::from_ne_bytes([c[0], c[1], c[2], c[3]])))
            .collect(),
    };
    chars.ok_or(CodeError::BadString("not a character"))
}

/// A `bytes` object's contents (`ob_size` at 16, the bytes from 32, in
/// every version read here).
fn read_bytes(memory: &ProcessMemory, addr: u64) -> Result<Vec<u8>, CodeError> {
    let length = memory.u64_at(addr + 16)?;
    if length > MAX_LINETABLE_BYTES {
        return Err(CodeError::LongLinetable(length));
    }
    let mut bytes = vec![0; length as usize];
    memory.read(addr + 32, &mut bytes)?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(first_line: u32, linetable: Vec<u8>) -> CodeObject {
        CodeObject {
            qualname: "f".into(),
            filename: "f.py".into(),
            first_line,
            linetable,
            format: LineTable::Locations,
        }
    }

    #[test]
    fn the_3_10_line_table_gives_each_instruction_its_line() {
        // 4 bytes at line 10 (+0), 2 at 11, 2 with no line, a jump of 130
        // lines in two pairs (the first of no bytes), 4 bytes at 141, 2 at
        // 139.
        let table = vec![4, 0, 2, 1, 2, 0x80, 0, 127, 4, 3, 2, 0xfe];
        let code = CodeObject {
            format: LineTable::Pep626,
            ..code(10, table)
        };
        let lines: Vec<Option<u32>> = (0..9).map(|unit| code.line_of(unit * 2)).collect();
        assert_eq!(
            lines,
            [
                Some(10),
                Some(10),
                Some(11),
                None,
                Some(141),
                Some(141),
                Some(139),
                None,
                None
            ]
        );
        // Before the first instruction (`f_lasti` -1): the first line.
        assert_eq!(code.line_of(-2), Some(10));
        // An odd byte count cut short: no panic.
        let code = CodeObject {
            linetable: vec![4, 0, 9],
            ..code
        };
        assert_eq!(code.line_of(6), None);
    }

    #[test]
    fn the_location_table_gives_each_instruction_its_line() {
        // Entries: 1 unit, short form (line 10); 2 units, one-line form
        // +1 (line 11); 1 unit no location; 3 units, no-columns form -1
        // (svarint 3: line 10); 1 unit, long form +12 (svarint 24: 22).
        let table = vec![
            0x80,
            0x00, // short form 0, 1 unit, one column byte
            0x80 | (11 << 3) | 1,
            4,
            8,                // one-line +1, 2 units
            0x80 | (15 << 3), // no location, 1 unit
            0x80 | (13 << 3) | 2,
            3, // no columns, svarint -1, 3 units
            0x80 | (14 << 3),
            24,
            0,
            1,
            1, // long form, +12, 1 unit
        ];
        let code = code(10, table);
        let lines: Vec<Option<u32>> = (0..9).map(|unit| code.line_of(unit * 2)).collect();
        assert_eq!(
            lines,
            [
                Some(10),
                Some(11),
                Some(11),
                None,
                Some(10),
                Some(10),
                Some(10),
                Some(22),
                None
            ]
        );
        // 3.11 and 3.12 start a frame's instruction pointer one unit
        // before its first instruction.
        assert_eq!(code.line_of(-2), Some(10));
    }

    #[test]
    fn a_table_cut_short_gives_no_line_and_no_panic() {
        let code = code(1, vec![0x80 | (14 << 3), 0x40]);
        assert_eq!(code.line_of(0), None);
        let code = code_with_varint_overflow();
        assert_eq!(code.line_of(0), None);
    }

    /// Objects laid out as CPython 3.12 lays them, in this process's
    /// memory, read back through `process_vm_readv` as from any process.
    struct FakeObjects {
        layout: Layout,
        memory: ProcessMemory,
        /// Kept alive while read.
        buffers: Vec<Vec<u64>>,
    }

    impl FakeObjects {
        fn new() -> Self {
            Self {
                layout: Layout::of((3, 12)).expect("3.12"),
                memory: ProcessMemory {
                    pid: std::process::id(),
                },
                buffers: Vec::new(),
            }
        }

        /// A buffer of `bytes` (8-aligned), and its address.
        fn put(&mut self, bytes: &[u8]) -> u64 {
            let mut words = vec![0u64; bytes.len().div_ceil(8)];
            // SAFETY: the words hold at least `bytes.len()` bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    bytes.as_ptr(),
                    words.as_mut_ptr().cast(),
                    bytes.len(),
                )
            };
            let address = words.as_ptr() as u64;
            self.buffers.push(words);
            address
        }

        /// A compact `str` of `length` characters of `width` bytes each
        /// (`data` already encoded), ASCII when said.
        fn string(&mut self, length: u64, width: u32, ascii: bool, data: &[u8]) -> u64 {
            let start = if ascii {
                self.layout.ascii_data
            } else {
                self.layout.compact_data
            } as usize;
            let mut bytes = vec![0u8; start];
            bytes[16..24].copy_from_slice(&length.to_ne_bytes());
            let state = (width << 2) | (1 << 5) | (u32::from(ascii) << 6);
            bytes[32..36].copy_from_slice(&state.to_ne_bytes());
            bytes.extend_from_slice(data);
            self.put(&bytes)
        }

        fn bytes_object(&mut self, length: u64, data: &[u8]) -> u64 {
            let mut bytes = vec![0u8; 32];
            bytes[16..24].copy_from_slice(&length.to_ne_bytes());
            bytes.extend_from_slice(data);
            self.put(&bytes)
        }

        fn code(&mut self, first_line: i32, qualname: u64, filename: u64, linetable: u64) -> u64 {
            self.code_of_frame_size(first_line, 0, qualname, filename, linetable)
        }

        /// A code object whose frames take `frame_words` (3.12+'s
        /// `co_framesize`).
        fn code_of_frame_size(
            &mut self,
            first_line: i32,
            frame_words: i32,
            qualname: u64,
            filename: u64,
            linetable: u64,
        ) -> u64 {
            let layout = self.layout;
            let mut bytes = vec![0u8; layout.code_bytecode as usize];
            let at = |offset: u32| offset as usize;
            bytes[at(layout.code_first_line)..][..4].copy_from_slice(&first_line.to_ne_bytes());
            if let CodeFrameSize::Field(offset) = layout.code_frame_size {
                bytes[at(offset)..][..4].copy_from_slice(&frame_words.to_ne_bytes());
            }
            for (offset, pointer) in [
                (layout.code_qualname, qualname),
                (layout.code_filename, filename),
                (layout.code_linetable, linetable),
            ] {
                bytes[at(offset)..][..8].copy_from_slice(&pointer.to_ne_bytes());
            }
            self.put(&bytes)
        }
    }

    #[test]
    fn a_code_object_is_read_with_its_names_and_refused_when_its_first_line_differs() {
        let mut fake = FakeObjects::new();
        let qualname = fake.string(14, 1, true, b"Handler.handle");
        // Not ASCII: two bytes a character ("é" and "→").
        let file: Vec<u8> = "/app/é→.py"
            .encode_utf16()
            .flat_map(u16::to_ne_bytes)
            .collect();
        let filename = fake.string(10, 2, false, &file);
        // One entry: 3 code units, one line below the first.
        let linetable = fake.bytes_object(3, &[0x80 | (11 << 3) | 2, 0, 4]);
        let code = fake.code(7, qualname, filename, linetable);
        let read = CodeObject::read(&fake.memory, &fake.layout, code, 7).expect("a code object");
        assert_eq!(&*read.qualname, "Handler.handle");
        assert_eq!(&*read.filename, "/app/é→.py");
        assert_eq!(read.line_of(4), Some(8));
        assert!(matches!(
            CodeObject::read(&fake.memory, &fake.layout, code, 8),
            Err(CodeError::Stale {
                what: "first line",
                expected: 8,
                found: 7
            })
        ));
    }

    /// A frame fingerprinted by its size (the distance to the frame it
    /// called) names the object whose frames take that many words, and
    /// refuses one whose frames take another size, whatever its first line.
    #[test]
    fn a_frame_fingerprinted_by_its_size_is_checked_against_the_codes_frame_size() {
        let mut fake = FakeObjects::new();
        let qualname = fake.string(4, 1, true, b"work");
        let filename = fake.string(6, 1, true, b"/a.py");
        let linetable = fake.bytes_object(0, &[]);
        let code = fake.code_of_frame_size(40, 13, qualname, filename, linetable);
        let by_size = |words: u32| {
            CodeObject::read(
                &fake.memory,
                &fake.layout,
                code,
                words | PythonFrame::FRAME_SIZE,
            )
        };
        let read = by_size(13).expect("a code object");
        assert_eq!((&*read.qualname, read.first_line), ("work", 40));
        assert!(matches!(
            by_size(14),
            Err(CodeError::Stale {
                what: "frame size",
                expected: 14,
                found: 13
            })
        ));
        // A first line that happens to equal the size is no size.
        assert!(CodeObject::read(&fake.memory, &fake.layout, code, 13).is_err());
    }

    #[test]
    fn garbage_where_a_code_object_should_be_is_an_error_not_a_panic() {
        let mut fake = FakeObjects::new();
        let good = fake.string(1, 1, true, b"f");
        let table = fake.bytes_object(0, &[]);
        let read = |fake: &FakeObjects, code| CodeObject::read(&fake.memory, &fake.layout, code, 1);
        // A name pointer into nowhere.
        let code = fake.code(1, 0x10, good, table);
        assert!(matches!(read(&fake, code), Err(CodeError::Read { .. })));
        // A string whose length would take a terabyte.
        let huge = fake.string(1 << 40, 1, true, b"x");
        let code = fake.code(1, huge, good, table);
        assert!(matches!(read(&fake, code), Err(CodeError::BadString(_))));
        // A string of a kind CPython has no such width for.
        let odd = fake.string(1, 3, false, b"xyz");
        let code = fake.code(1, odd, good, table);
        assert!(matches!(read(&fake, code), Err(CodeError::BadString(_))));
        // A location table longer than the bound.
        let long = fake.bytes_object(MAX_LINETABLE_BYTES + 1, &[]);
        let code = fake.code(1, good, good, long);
        assert!(matches!(
            read(&fake, code),
            Err(CodeError::LongLinetable(_))
        ));
        // The code object itself unmapped.
        assert!(matches!(read(&fake, 0x1000), Err(CodeError::Read { .. })));
    }

    #[test]
    fn the_cache_reads_each_object_once_and_counts_what_it_refused() {
        let mut fake = FakeObjects::new();
        let name = fake.string(1, 1, true, b"f");
        let table = fake.bytes_object(0, &[]);
        let code = fake.code(3, name, name, table);
        let mut cache = CodeCache::new(std::process::id(), fake.layout);
        assert_eq!(cache.get(code, 3).map(|code| code.first_line), Ok(3));
        assert!(cache.get(code, 3).is_ok());
        // The same address with another first line: another object (the
        // one the sample saw was freed), refused, on a hit too.
        assert_eq!(cache.get(code, 4).err(), Some(Unnamed::Stale));
        assert_eq!(cache.get(code, 4).err(), Some(Unnamed::Stale));
        assert_eq!(cache.get(0x1000, 1).err(), Some(Unnamed::Unreadable));
        assert_eq!(cache.get(0x1000, 1).err(), Some(Unnamed::Unreadable));
        assert_eq!(
            cache.stats,
            CodeCacheStats {
                hits: 3,
                reads: 3,
                stale: 1,
                failed: 1,
                resets: 0
            }
        );
        assert!(cache.bytes() > 0);
    }

    fn code_with_varint_overflow() -> CodeObject {
        let mut table = vec![0x80 | (13 << 3)];
        table.extend([0x7f; 20]);
        code(1, table)
    }
}

/// Most bytes of code objects one [`CodeCache`] keeps (names, files and
/// location tables); past it the cache starts again, empty.
pub const MAX_CACHE_BYTES: usize = 2 << 20;

/// The code objects of one process read so far, by address and the
/// fingerprint the sampler read (a reused address with another fingerprint
/// is another object; one object met with both kinds of fingerprint, its
/// first line and its frames' size, is held twice), those that could not
/// be read included, so garbage is not read again on every sample. Bounded
/// by [`MAX_CACHE_BYTES`].
#[derive(Debug)]
pub struct CodeCache {
    memory: ProcessMemory,
    layout: Layout,
    entries: HashMap<(u64, u32), Result<Arc<CodeObject>, Unnamed>>,
    bytes: usize,
    pub stats: CodeCacheStats,
}

/// Why a frame's code object names nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unnamed {
    /// The object at the address has another fingerprint than the sampler
    /// read: the one it saw was freed and its address reused.
    Stale,
    /// Not readable as a code object (unmapped, or garbage).
    Unreadable,
}

/// What a [`CodeCache`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CodeCacheStats {
    pub hits: u64,
    pub reads: u64,
    /// Reads refused because the fingerprint differed (a reused address).
    pub stale: u64,
    /// Reads that failed otherwise (a freed object, garbage).
    pub failed: u64,
    /// Times the cache was emptied for its bound.
    pub resets: u64,
}

impl CodeCache {
    pub fn new(pid: u32, layout: Layout) -> Self {
        Self {
            memory: ProcessMemory { pid },
            layout,
            entries: HashMap::new(),
            bytes: 0,
            stats: CodeCacheStats::default(),
        }
    }

    /// The code object at `code` with `fingerprint` (see
    /// [`CodeObject::read`]), read from the process on a miss; why not,
    /// when it cannot be read or is not the object the sampler saw.
    pub fn get(&mut self, code: u64, fingerprint: u32) -> Result<Arc<CodeObject>, Unnamed> {
        if let Some(entry) = self.entries.get(&(code, fingerprint)) {
            self.stats.hits += 1;
            return entry.clone();
        }
        self.stats.reads += 1;
        let read = match CodeObject::read(&self.memory, &self.layout, code, fingerprint) {
            Ok(object) => Ok(Arc::new(object)),
            Err(CodeError::Stale { .. }) => {
                self.stats.stale += 1;
                Err(Unnamed::Stale)
            }
            Err(_) => {
                self.stats.failed += 1;
                Err(Unnamed::Unreadable)
            }
        };
        let cost = 64
            + read.as_ref().map_or(0, |object| {
                object.qualname.len() + object.filename.len() + object.linetable.len()
            });
        if self.bytes + cost > MAX_CACHE_BYTES {
            self.entries.clear();
            self.bytes = 0;
            self.stats.resets += 1;
        }
        self.bytes += cost;
        self.entries.insert((code, fingerprint), read.clone());
        read
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Empties the cache (for a bound over every process's): its objects
    /// are read again as samples name them.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.bytes = 0;
        self.stats.resets += 1;
    }
}
