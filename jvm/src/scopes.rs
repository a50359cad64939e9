//! Methods a compiled method inlined, at one of its addresses: the
//! nmethod's `PcDesc`s map code offsets to scope records in its scopes
//! data, each naming a method (an index into the nmethod's metadata) and
//! the record of the method it was inlined into, out to the nmethod's own
//! method. Read as HotSpot's `ScopeDesc::decode_body` does, for JDK 9-19
//! (JDK 20 encodes the records' numbers otherwise, as UNSIGNED5, and JDK 23
//! moves them out of the nmethod: neither is read, their frames show the
//! compiled method alone).

use crate::{JvmError, code_cache::CodeBlob, memory::Memory};

/// Bytes of `PcDesc`s, scopes data or metadata read at most per nmethod
/// (read on the sampling thread: a larger nmethod shows its compiled
/// method alone).
const MAX_SECTION_BYTES: u64 = 256 << 10;

/// Scopes followed at most from an address out to its nmethod's method.
const MAX_INLINE_DEPTH: usize = 64;

/// Where JDK 9-19 keep an nmethod's debug information.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScopesLayout {
    /// `nmethod::_scopes_pcs_offset`, `_dependencies_offset` (its end) and
    /// `_metadata_offset`, from the blob's start.
    pub pcs_offset: u64,
    pub pcs_end_offset: u64,
    pub metadata_offset: u64,
    /// `CompiledMethod::_scopes_data_begin` (an address; the data ends
    /// where the `PcDesc`s begin, the metadata where the data begins).
    pub data_begin: u64,
    /// `sizeof(PcDesc)` and its fields' offsets.
    pub pc_desc_size: u64,
    pub pc_desc_pc_offset: u64,
    pub pc_desc_scope_offset: u64,
}

/// One nmethod's debug information, read once.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scopes {
    /// (code offset, scope record offset), in code order.
    pcs: Vec<(i32, i32)>,
    data: Vec<u8>,
    metadata: Vec<u64>,
}

impl Scopes {
    /// The bytes it holds.
    pub fn bytes(&self) -> usize {
        self.pcs.len() * 8 + self.data.len() + self.metadata.len() * 8
    }

    /// Reads the debug information of `blob`, an nmethod; `None` when the
    /// layout does not say where it is.
    pub fn read(
        memory: &impl Memory,
        scopes: &ScopesLayout,
        blob: &CodeBlob,
    ) -> Result<Option<Self>, JvmError> {
        let Some(sections) = &blob.debug else {
            return Ok(None);
        };
        let read = |range: &std::ops::Range<u64>| -> Result<Vec<u8>, JvmError> {
            if range.end - range.start > MAX_SECTION_BYTES {
                return Err(JvmError::Malformed(
                    "an nmethod's debug section over 256 KiB",
                ));
            }
            let mut bytes = vec![0; (range.end - range.start) as usize];
            memory.read(range.start, &mut bytes)?;
            Ok(bytes)
        };
        let size = scopes.pc_desc_size as usize;
        let (pc_at, scope_at) = (
            scopes.pc_desc_pc_offset as usize,
            scopes.pc_desc_scope_offset as usize,
        );
        let int = |desc: &[u8], at: usize| {
            i32::from_le_bytes(desc[at..at + 4].try_into().expect("checked by Layout"))
        };
        let pcs = read(&sections.pcs)?
            .chunks_exact(size)
            .map(|desc| (int(desc, pc_at), int(desc, scope_at)))
            .collect();
        let metadata = read(&sections.metadata)?
            .chunks_exact(8)
            .map(|word| u64::from_le_bytes(word.try_into().expect("8 bytes")))
            .collect();
        Ok(Some(Self {
            pcs,
            data: read(&sections.data)?,
            metadata,
        }))
    }

    /// The methods at code offset `offset`, innermost first, out to the
    /// nmethod's own (`own`): a return address's are those its `PcDesc`
    /// records; an interrupted instruction's, those of the next `PcDesc`
    /// (HotSpot's own choice, `pc_desc_near`, as JFR and AsyncGetCallTrace
    /// report them: between two records, C2 may have scheduled code of
    /// either's inlined methods, so an inlined frame at an interrupted
    /// instruction is the JVM's best account, not an exact one). Empty
    /// where the debug information says nothing (the caller names the frame
    /// by `own`).
    pub fn methods_at(
        &self,
        offset: u64,
        interrupted: bool,
        own: u64,
    ) -> Result<Vec<u64>, JvmError> {
        let Ok(offset) = i32::try_from(offset) else {
            return Ok(Vec::new());
        };
        let at = self.pcs.partition_point(|&(pc, _)| pc < offset);
        match self.pcs.get(at) {
            Some(&(pc, scope)) if interrupted || pc == offset => self.chain(scope, own),
            _ => Ok(Vec::new()),
        }
    }

    /// The methods of the scope record at `scope` and those it was inlined
    /// into, innermost first; they must end in `own`.
    fn chain(&self, mut scope: i32, own: u64) -> Result<Vec<u64>, JvmError> {
        let mut methods = Vec::new();
        // 0 is DebugInformationRecorder::serialized_null: no record.
        while scope != 0 {
            if methods.len() >= MAX_INLINE_DEPTH {
                return Err(JvmError::Malformed("inlined scopes without an end"));
            }
            let mut stream = Stream {
                bytes: &self.data,
                at: usize::try_from(scope).map_err(|_| JvmError::Malformed("a scope offset"))?,
            };
            let sender = stream.int()?;
            let method = match stream.int()? as usize {
                0 => return Err(JvmError::Malformed("a scope without a method")),
                index => *self
                    .metadata
                    .get(index - 1)
                    .ok_or(JvmError::Malformed("a metadata index"))?,
            };
            methods.push(method);
            scope =
                i32::try_from(sender).map_err(|_| JvmError::Malformed("a sender scope offset"))?;
        }
        if methods.last().is_some_and(|&last| last != own) {
            return Err(JvmError::Malformed(
                "inlined scopes that end in another method",
            ));
        }
        Ok(methods)
    }
}

/// HotSpot's compressed stream of unsigned ints (`CompressedReadStream`,
/// JDK 9-19): a byte below 192 ends a number; each of up to five bytes
/// adds its value times 64 to the power of its position.
struct Stream<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Stream<'_> {
    fn int(&mut self) -> Result<u32, JvmError> {
        const L: u32 = 192;
        let mut sum = 0u32;
        let mut shift = 0;
        for i in 0..5 {
            let byte = u32::from(
                *self
                    .bytes
                    .get(self.at)
                    .ok_or(JvmError::Malformed("scopes data cut short"))?,
            );
            self.at += 1;
            sum = sum.wrapping_add(byte << shift);
            if byte < L || i == 4 {
                return Ok(sum);
            }
            shift += 6;
        }
        unreachable!("the fifth byte ends the number")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compressed_ints_read_as_hotspot_writes_them() {
        // 5: one byte; 200 = 192 + 8 + 0*64 ... written as [200, 0]: 200 + 0 << 6.
        let bytes = [5, 200, 0, 255, 255, 1, 192, 192, 192, 192, 192];
        let mut stream = Stream {
            bytes: &bytes,
            at: 0,
        };
        assert_eq!(stream.int().unwrap(), 5);
        assert_eq!(stream.int().unwrap(), 200);
        assert_eq!(stream.int().unwrap(), 255 + (255 << 6) + (1 << 12));
        // Five bytes at most, the last whatever its value.
        assert_eq!(
            stream.int().unwrap(),
            192 + (192 << 6) + (192 << 12) + (192 << 18) + (192 << 24)
        );
        assert!(stream.int().is_err(), "nothing left");
    }

    #[test]
    fn an_address_is_named_by_its_scopes_out_to_the_nmethods_method() {
        // Records: at 1, leaf (metadata 3) inlined into the record at 5;
        // at 5, middle (metadata 2) inlined into the one at 9; at 9, outer
        // (metadata 1), the nmethod's own.
        let data = vec![0, 5, 3, 0, 0, 9, 2, 0, 0, 0, 1, 0];
        let scopes = Scopes {
            pcs: vec![(-1, 0), (0x20, 9), (0x40, 1), (0x60, 5), (i32::MAX, 0)],
            data,
            metadata: vec![0x100, 0x200, 0x300],
        };
        // A return address: its own record.
        assert_eq!(
            scopes.methods_at(0x40, false, 0x100).unwrap(),
            [0x300, 0x200, 0x100]
        );
        assert_eq!(scopes.methods_at(0x20, false, 0x100).unwrap(), [0x100]);
        assert!(
            scopes.methods_at(0x30, false, 0x100).unwrap().is_empty(),
            "no record there"
        );
        // Interrupted: the next record's.
        assert_eq!(
            scopes.methods_at(0x50, true, 0x100).unwrap(),
            [0x200, 0x100]
        );
        assert_eq!(
            scopes.methods_at(0x30, true, 0x100).unwrap(),
            [0x300, 0x200, 0x100]
        );
        assert_eq!(scopes.methods_at(0x10, true, 0x100).unwrap(), [0x100]);
        assert!(
            scopes.methods_at(0x70, true, 0x100).unwrap().is_empty(),
            "before the end sentinel"
        );
        assert!(
            scopes.methods_at(0x40, false, 0x999).is_err(),
            "not this nmethod's scopes"
        );
        let cut = Scopes {
            data: vec![0, 5],
            ..scopes.clone()
        };
        assert!(cut.methods_at(0x40, false, 0x100).is_err());
        let bad_index = Scopes {
            metadata: vec![0x100],
            ..scopes
        };
        assert!(bad_index.methods_at(0x40, false, 0x100).is_err());
    }
}
