//! Bytes in and out of ClickHouse: RowBinary rows (what inserts send and
//! queries answer, read as untrusted input: every error is a message, never
//! a panic) and the self-contained encoding of a stack's frames stored in
//! `stacks.frames`. Owns no SQL.

use crate::ingest::{MappingRecord, ValidBatch};
use crate::storage::codec::{
    BlobReader, decode_code_segments, decode_lines, encode_code_segments, encode_lines, kind_code,
    kind_from_code, put_varint,
};

/// Appends rows in ClickHouse's RowBinary format: little-endian integers,
/// strings as a LEB128 length and their bytes, arrays as a LEB128 count and
/// their items.
#[derive(Default)]
pub struct RowWriter {
    pub bytes: Vec<u8>,
}

impl RowWriter {
    pub fn i64(&mut self, value: i64) {
        self.bytes.extend_from_slice(&value.to_le_bytes());
    }

    pub fn u64(&mut self, value: u64) {
        self.bytes.extend_from_slice(&value.to_le_bytes());
    }

    /// A `FixedString(16)`: a content hash's little-endian bytes.
    pub fn hash(&mut self, value: u128) {
        self.bytes.extend_from_slice(&value.to_le_bytes());
    }

    pub fn string(&mut self, value: &[u8]) {
        put_varint(&mut self.bytes, value.len() as u64);
        self.bytes.extend_from_slice(value);
    }

    pub fn strings<'a>(&mut self, values: impl ExactSizeIterator<Item = &'a str>) {
        put_varint(&mut self.bytes, values.len() as u64);
        for value in values {
            self.string(value.as_bytes());
        }
    }
}

/// Reads RowBinary rows of known column types.
pub struct RowReader<'a> {
    bytes: &'a [u8],
}

impl<'a> RowReader<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        Self { bytes }
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    fn take<const N: usize>(&mut self, what: &str) -> Result<[u8; N], String> {
        let (head, rest) = self
            .bytes
            .split_first_chunk::<N>()
            .ok_or_else(|| format!("truncated {what}"))?;
        self.bytes = rest;
        Ok(*head)
    }

    pub fn i64(&mut self) -> Result<i64, String> {
        self.take::<8>("Int64").map(i64::from_le_bytes)
    }

    pub fn u64(&mut self) -> Result<u64, String> {
        self.take::<8>("UInt64").map(u64::from_le_bytes)
    }

    pub fn hash(&mut self) -> Result<u128, String> {
        self.take::<16>("FixedString(16)").map(u128::from_le_bytes)
    }

    fn len(&mut self, what: &str) -> Result<usize, String> {
        let mut reader = BlobReader { bytes: self.bytes };
        let len = reader
            .varint()
            .map_err(|err| format!("{what} length: {err}"))?;
        self.bytes = reader.bytes;
        // Each item takes at least a byte: a longer count is corrupt (and
        // must not size an allocation).
        usize::try_from(len)
            .ok()
            .filter(|&len| len <= self.bytes.len())
            .ok_or_else(|| format!("{what} of {len} items runs past the answer's end"))
    }

    pub fn bytes(&mut self) -> Result<&'a [u8], String> {
        let len = self.len("String")?;
        let (value, rest) = self.bytes.split_at(len);
        self.bytes = rest;
        Ok(value)
    }

    pub fn string(&mut self) -> Result<String, String> {
        let bytes = self.bytes()?;
        String::from_utf8(bytes.to_vec()).map_err(|_| "a String is not UTF-8".to_owned())
    }

    pub fn strings(&mut self) -> Result<Vec<String>, String> {
        let count = self.len("Array(String)")?;
        (0..count).map(|_| self.string()).collect()
    }
}

// Stack blobs: a version byte, then per location, leaf first: the
// mapping's kind code, build-id and path (varint-length strings), its code
// segments and the location's lines (each a varint byte length and the
// encoding SQLite's `code_segments` and `lines` columns use) and the
// address (varint). Self-contained, so one row names a whole stack: a
// query fetches frames with one lookup per stack, and no other table has
// to outlive it.

const STACK_BLOB_VERSION: u8 = 1;

/// The frames blob of `stack` (indexes into the batch's locations, already
/// checked by the caller).
pub fn encode_stack(
    batch: &ValidBatch,
    stack: &[u32],
    out: &mut Vec<u8>,
    scratch: &mut Vec<u8>,
) -> Result<(), String> {
    out.clear();
    out.push(STACK_BLOB_VERSION);
    for &index in stack {
        let location = usize::try_from(index)
            .ok()
            .and_then(|i| batch.locations.get(i))
            .ok_or_else(|| format!("location {index} out of range"))?;
        let mapping = usize::try_from(location.mapping)
            .ok()
            .and_then(|i| batch.mappings.get(i))
            .ok_or_else(|| {
                format!(
                    "location {index}: mapping {} out of range",
                    location.mapping
                )
            })?;
        out.push(kind_code(mapping.kind) as u8);
        for s in [&mapping.build_id, &mapping.path] {
            put_varint(out, s.len() as u64);
            out.extend_from_slice(s.as_bytes());
        }
        scratch.clear();
        encode_code_segments(scratch, &mapping.code_segments);
        put_varint(out, scratch.len() as u64);
        out.extend_from_slice(scratch);
        scratch.clear();
        encode_lines(scratch, &location.lines);
        put_varint(out, scratch.len() as u64);
        out.extend_from_slice(scratch);
        put_varint(out, location.address);
    }
    Ok(())
}

/// One location of a stack blob.
pub struct DecodedLocation<'a> {
    /// The location's bytes in the blob: the same bytes mean the same
    /// frames, so they key the frame cache.
    pub raw: &'a [u8],
    pub mapping: MappingRecord,
    pub address: u64,
    pub lines: Vec<crate::ingest::LineRecord>,
}

/// Splits a stack blob into its locations, leaf first.
pub fn decode_stack(blob: &[u8]) -> Result<Vec<DecodedLocation<'_>>, String> {
    let (&version, rest) = blob.split_first().ok_or("empty stack blob")?;
    if version != STACK_BLOB_VERSION {
        return Err(format!(
            "stack blob version {version}, this collector reads {STACK_BLOB_VERSION}"
        ));
    }
    let mut reader = BlobReader { bytes: rest };
    let mut locations = Vec::new();
    while !reader.is_empty() {
        let start = reader.bytes;
        let (&kind, rest) = reader.bytes.split_first().ok_or("truncated location")?;
        reader.bytes = rest;
        let kind = kind_from_code(i64::from(kind))
            .ok_or_else(|| format!("unknown mapping kind {kind}"))?;
        let build_id = reader.str()?.to_owned();
        let path = reader.str()?.to_owned();
        let segments = sub_blob(&mut reader)?;
        let code_segments = decode_code_segments(segments)?;
        let lines = decode_lines(sub_blob(&mut reader)?)?;
        let address = reader.varint()?;
        let used = start.len() - reader.bytes.len();
        locations.push(DecodedLocation {
            raw: &start[..used],
            mapping: MappingRecord {
                kind,
                build_id,
                path,
                code_segments,
            },
            address,
            lines,
        });
    }
    if locations.is_empty() {
        return Err("a stack without locations".into());
    }
    Ok(locations)
}

fn sub_blob<'a>(reader: &mut BlobReader<'a>) -> Result<&'a [u8], &'static str> {
    let len = usize::try_from(reader.varint()?).map_err(|_| "length overflows")?;
    let (blob, rest) = reader
        .bytes
        .split_at_checked(len)
        .ok_or("field runs past the end")?;
    reader.bytes = rest;
    Ok(blob)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncated_rows_are_errors() {
        assert_eq!(
            RowReader::new(&[1, 2, 3]).u64(),
            Err("truncated UInt64".into())
        );
        assert_eq!(
            RowReader::new(&[5, b'a']).string(),
            Err("String of 5 items runs past the answer's end".into())
        );
        assert_eq!(
            RowReader::new(&[0xff; 11]).strings(),
            Err("Array(String) length: varint overflows 64 bits".into())
        );
        assert_eq!(
            RowReader::new(&[1, 0xff]).string(),
            Err("a String is not UTF-8".into())
        );
    }

    #[test]
    fn rows_round_trip() {
        let mut writer = RowWriter::default();
        writer.i64(-5);
        writer.u64(u64::MAX);
        writer.hash(u128::MAX - 7);
        writer.strings(["a", "", "ü"].into_iter());
        let mut reader = RowReader::new(&writer.bytes);
        assert_eq!(reader.i64(), Ok(-5));
        assert_eq!(reader.u64(), Ok(u64::MAX));
        assert_eq!(reader.hash(), Ok(u128::MAX - 7));
        assert_eq!(
            reader.strings(),
            Ok(vec!["a".into(), String::new(), "ü".into()])
        );
        assert!(reader.is_empty());
    }

    #[test]
    fn corrupt_stack_blobs_are_errors() {
        assert_eq!(decode_stack(&[]).err(), Some("empty stack blob".into()));
        assert_eq!(
            decode_stack(&[9]).err(),
            Some("stack blob version 9, this collector reads 1".into())
        );
        assert_eq!(
            decode_stack(&[1]).err(),
            Some("a stack without locations".into())
        );
        assert_eq!(
            decode_stack(&[1, 77]).err(),
            Some("unknown mapping kind 77".into())
        );
        assert_eq!(
            decode_stack(&[1, 1, 0, 0, 0, 3, 0]).err(),
            Some("field runs past the end".into())
        );
    }
}
