//! Reading jitdump files (`jit-<pid>.dump`), the binary cousin of perf
//! maps that V8 (`--perf-prof`), the JVM's and .NET's perf agents write.
//!
//! Owns: decoding the stream as it grows, a chunk at a time, into code
//! loads (address range and name) and moves, treating the bytes as
//! untrusted (every size checked, a record that cannot be right stops the
//! stream for good: [`DumpReader::is_broken`]), and never holding a
//! record's code bytes: they are skipped as they arrive. Does not own
//! finding the file or what the names are used for (the agent's perf maps).
//!
//! Format (Linux `tools/perf/Documentation/jitdump-specification.txt`): a
//! header (magic `JiTD`, version, its own size, ...) then records, each
//! `{id: u32, total_size: u32, timestamp: u64}` and a body. Code loads
//! (id 0) carry `pid, tid: u32; vma, code_addr, code_size, code_index: u64`,
//! a NUL-terminated name, then the code; moves (id 1) carry `pid, tid: u32;
//! vma, old_code_addr, new_code_addr, code_size, code_index: u64`. Other
//! kinds (debug and unwinding info, close) are skipped.

/// `JiTD` as a little-endian `u32`: the file was written on this byte order.
const MAGIC: u32 = 0x4A69_5444;
const FILE_HEADER_MIN: u32 = 40;
const RECORD_HEADER: usize = 16;
const CODE_LOAD: u32 = 0;
const CODE_MOVE: u32 = 1;
/// `pid, tid, vma, code_addr, code_size, code_index` of a code load.
const LOAD_FIELDS: usize = 40;
/// `pid, tid, vma, old_code_addr, new_code_addr, code_size, code_index`.
const MOVE_FIELDS: usize = 48;
/// Longest name read (a longer one stops the stream as corrupt): far above
/// what JITs write, and it bounds what a partial record can hold.
const MAX_NAME: usize = 4096;
/// Largest record believed (code included).
const MAX_RECORD: u32 = 256 << 20;

/// What a record said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DumpEvent {
    /// Code now at `start..end` is `name`.
    Load { start: u64, end: u64, name: String },
    /// The code at `from` (of `size` bytes) moved to `to`.
    Move { from: u64, to: u64, size: u64 },
}

/// A jitdump stream decoded as it grows.
#[derive(Debug, Default)]
pub struct DumpReader {
    header_done: bool,
    /// Bytes of the stream still to drop (code bytes, skipped records).
    skip: u64,
    /// The start of a record (or the header) not complete yet: at most a
    /// record header, a load's fields and its name.
    pending: Vec<u8>,
    broken: bool,
}

impl DumpReader {
    /// Whether the stream was found corrupt (or of another byte order);
    /// nothing more is read from it.
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    /// Decodes the stream's next bytes, handing each load and move to
    /// `on_event`.
    pub fn feed(&mut self, mut bytes: &[u8], mut on_event: impl FnMut(DumpEvent)) {
        while !self.broken {
            if self.skip > 0 {
                if bytes.is_empty() {
                    return;
                }
                let n = usize::try_from(self.skip)
                    .unwrap_or(usize::MAX)
                    .min(bytes.len());
                bytes = &bytes[n..];
                self.skip -= n as u64;
                continue;
            }
            // Enough of the next unit in `pending` to decode it; what is
            // needed grows as the unit's header says what follows.
            let need = self.needed();
            if self.pending.len() < need {
                if bytes.is_empty() {
                    return;
                }
                let take = (need - self.pending.len()).min(bytes.len());
                self.pending.extend_from_slice(&bytes[..take]);
                bytes = &bytes[take..];
                continue;
            }
            if let Some(Some(event)) = self.decode() {
                on_event(event);
            }
        }
    }

    /// How many bytes `pending` must hold to decode what comes next.
    fn needed(&self) -> usize {
        if !self.header_done {
            return 12;
        }
        let Some(header) = self.pending.get(..RECORD_HEADER) else {
            return RECORD_HEADER;
        };
        let size = u32_at(header, 4) as usize;
        match u32_at(header, 0) {
            // A size no record can have is decoded (as broken) at once.
            _ if size < RECORD_HEADER => RECORD_HEADER,
            CODE_LOAD => {
                let fixed = RECORD_HEADER + LOAD_FIELDS;
                // The name: up to its NUL, one more byte at a time, and no
                // further than the record or the longest name.
                match self.pending.get(fixed..) {
                    Some(name)
                        if name.contains(&0)
                            || name.len() > MAX_NAME
                            || self.pending.len() >= size =>
                    {
                        self.pending.len()
                    }
                    Some(_) => self.pending.len() + 1,
                    None => fixed,
                }
            }
            CODE_MOVE => RECORD_HEADER + MOVE_FIELDS,
            _ => RECORD_HEADER,
        }
    }

    /// Decodes `pending`, which holds what [`Self::needed`] asked for:
    /// `Some(event)` for a complete unit, `None` when the stream is broken.
    fn decode(&mut self) -> Option<Option<DumpEvent>> {
        if !self.header_done {
            let (magic, size) = (u32_at(&self.pending, 0), u32_at(&self.pending, 8));
            if magic != MAGIC || size < FILE_HEADER_MIN {
                self.broken = true;
                return None;
            }
            self.header_done = true;
            self.skip = u64::from(size) - 12;
            self.pending.clear();
            return Some(None);
        }
        let (id, size) = (u32_at(&self.pending, 0), u32_at(&self.pending, 4));
        if (size as usize) < RECORD_HEADER || size > MAX_RECORD {
            self.broken = true;
            return None;
        }
        let event = match id {
            CODE_LOAD => {
                let fixed = RECORD_HEADER + LOAD_FIELDS;
                let name = &self.pending[fixed..];
                let Some(nul) = name.iter().position(|&b| b == 0) else {
                    // No NUL within the record or the longest name.
                    self.broken = true;
                    return None;
                };
                let used = fixed + nul + 1;
                if used > size as usize {
                    self.broken = true;
                    return None;
                }
                let start = u64_at(&self.pending, RECORD_HEADER + 16);
                let len = u64_at(&self.pending, RECORD_HEADER + 24);
                let name = String::from_utf8_lossy(&name[..nul]).into_owned();
                self.skip = u64::from(size) - used as u64;
                start
                    .checked_add(len)
                    .filter(|_| len > 0 && !name.is_empty())
                    .map(|end| DumpEvent::Load { start, end, name })
            }
            CODE_MOVE => {
                if (size as usize) < RECORD_HEADER + MOVE_FIELDS {
                    self.broken = true;
                    return None;
                }
                let at = |field: usize| u64_at(&self.pending, RECORD_HEADER + 8 + 8 * field);
                let event = DumpEvent::Move {
                    from: at(1),
                    to: at(2),
                    size: at(3),
                };
                self.skip = u64::from(size) - (RECORD_HEADER + MOVE_FIELDS) as u64;
                Some(event)
            }
            _ => {
                self.skip = u64::from(size) - RECORD_HEADER as u64;
                None
            }
        };
        self.pending.clear();
        Some(event)
    }
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    bytes
        .get(at..at + 4)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u32::from_le_bytes)
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    bytes
        .get(at..at + 8)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u64::from_le_bytes)
}

/// Jitdump streams made by hand, for the tests of this reader and of the
/// agent's perf maps, which read jitdump files behind it.
#[cfg(any(test, feature = "test-support"))]
pub mod test_streams {
    use super::*;

    /// A jitdump file header.
    pub fn header() -> Vec<u8> {
        let mut out = Vec::new();
        for word in [MAGIC, 1, FILE_HEADER_MIN, 62, 0, 4242] {
            out.extend_from_slice(&word.to_le_bytes());
        }
        out.extend_from_slice(&[0; 16]); // timestamp, flags
        out
    }

    /// A code load record with `code` bytes of code.
    pub fn load(start: u64, len: u64, name: &str, code: usize) -> Vec<u8> {
        let size = RECORD_HEADER + LOAD_FIELDS + name.len() + 1 + code;
        let mut out = Vec::new();
        out.extend_from_slice(&CODE_LOAD.to_le_bytes());
        out.extend_from_slice(&(size as u32).to_le_bytes());
        out.extend_from_slice(&7u64.to_le_bytes()); // timestamp
        out.extend_from_slice(&[0; 8]); // pid, tid
        for word in [start, start, len, 1] {
            out.extend_from_slice(&word.to_le_bytes());
        }
        out.extend_from_slice(name.as_bytes());
        out.push(0);
        out.extend(std::iter::repeat_n(0xcc, code));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::{test_streams::*, *};

    fn code_move(from: u64, to: u64, size: u64) -> Vec<u8> {
        let total = RECORD_HEADER + MOVE_FIELDS;
        let mut out = Vec::new();
        out.extend_from_slice(&CODE_MOVE.to_le_bytes());
        out.extend_from_slice(&(total as u32).to_le_bytes());
        out.extend_from_slice(&[0; 16]); // timestamp, pid, tid
        for word in [from, from, to, size, 2] {
            out.extend_from_slice(&word.to_le_bytes());
        }
        out
    }

    fn other(id: u32, body: usize) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&id.to_le_bytes());
        out.extend_from_slice(&((RECORD_HEADER + body) as u32).to_le_bytes());
        out.extend_from_slice(&[0; 8]);
        out.extend(std::iter::repeat_n(0xab, body));
        out
    }

    fn stream() -> Vec<u8> {
        [
            header(),
            other(4, 40),
            load(0x1000, 0x100, "JS:*leaf /app/x.js:2", 0x100),
            load(0x2000, 0x80, "JS:*middle /app/x.js:7", 300),
            code_move(0x2000, 0x3000, 0x80),
            other(3, 0),
        ]
        .concat()
    }

    fn expected() -> Vec<DumpEvent> {
        vec![
            DumpEvent::Load {
                start: 0x1000,
                end: 0x1100,
                name: "JS:*leaf /app/x.js:2".into(),
            },
            DumpEvent::Load {
                start: 0x2000,
                end: 0x2080,
                name: "JS:*middle /app/x.js:7".into(),
            },
            DumpEvent::Move {
                from: 0x2000,
                to: 0x3000,
                size: 0x80,
            },
        ]
    }

    #[test]
    fn decodes_loads_and_moves_and_skips_the_rest() {
        let mut reader = DumpReader::default();
        let mut events = Vec::new();
        reader.feed(&stream(), |event| events.push(event));
        assert_eq!(events, expected());
        assert!(!reader.is_broken());
        assert!(reader.pending.is_empty() && reader.skip == 0);
    }

    #[test]
    fn any_split_of_the_stream_gives_the_same_events() {
        let bytes = stream();
        for chunk in [1, 3, 7, 16, 57, 100] {
            let mut reader = DumpReader::default();
            let mut events = Vec::new();
            for piece in bytes.chunks(chunk) {
                reader.feed(piece, |event| events.push(event));
            }
            assert_eq!(events, expected(), "chunks of {chunk}");
        }
    }

    #[test]
    fn corrupt_streams_stop_without_panicking() {
        let mut bad_magic = stream();
        bad_magic[0] ^= 0xff;
        let mut tiny_record = [header(), other(4, 0)].concat();
        tiny_record[FILE_HEADER_MIN as usize + 4] = 3; // total_size 3 < 16
        let mut huge_record = [header(), other(4, 0)].concat();
        huge_record[FILE_HEADER_MIN as usize + 4..FILE_HEADER_MIN as usize + 8]
            .copy_from_slice(&u32::MAX.to_le_bytes());
        // A name running past its record's end.
        let mut overlong_name = [header(), load(0x1000, 0x10, "name", 0)].concat();
        overlong_name[FILE_HEADER_MIN as usize + 4] = (RECORD_HEADER + LOAD_FIELDS + 2) as u8;
        for (what, bytes) in [
            ("magic", bad_magic),
            ("tiny record", tiny_record),
            ("huge record", huge_record),
            ("name past the record", overlong_name),
        ] {
            let mut reader = DumpReader::default();
            let mut events = Vec::new();
            reader.feed(&bytes, |event| events.push(event));
            reader.feed(&stream(), |event| events.push(event));
            assert!(reader.is_broken(), "{what}");
            assert!(events.is_empty(), "{what}: {events:?}");
        }
        // A name with no NUL in sight stops at the bound, not later.
        let mut reader = DumpReader::default();
        let mut endless = [header(), load(0x1000, 0x10, "", 0)].concat();
        endless.truncate(endless.len() - 1);
        endless[FILE_HEADER_MIN as usize + 4..FILE_HEADER_MIN as usize + 8]
            .copy_from_slice(&(MAX_RECORD - 1).to_le_bytes());
        reader.feed(&endless, |_| {});
        reader.feed(&vec![b'a'; MAX_NAME + 8], |_| {});
        assert!(reader.is_broken());
        assert!(reader.pending.len() <= RECORD_HEADER + LOAD_FIELDS + MAX_NAME + 1);
    }

    #[test]
    fn every_truncation_waits_for_more() {
        let bytes = stream();
        for cut in 0..bytes.len() {
            let mut reader = DumpReader::default();
            let mut events = Vec::new();
            reader.feed(&bytes[..cut], |event| events.push(event));
            assert!(!reader.is_broken(), "cut at {cut}");
            reader.feed(&bytes[cut..], |event| events.push(event));
            assert_eq!(events, expected(), "cut at {cut}");
        }
    }
}
