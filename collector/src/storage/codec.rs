//! The encodings both engines store and read back: a mapping's kind as the
//! wire format's number, lines and code segments as blobs of LEB128 varints
//! and length-prefixed UTF-8 (read back as untrusted input: an error says
//! what is wrong with a blob, never a panic), and how a stored location
//! becomes frames. Shared so an item reads the same whichever engine stored
//! it. Owns no SQL, no engine's row layout, and no content hashes (`hash`).

use std::sync::Arc;

use stackscope_profile::model::{CodeAddress, Frame, PYTHON_BINARY, SENT_BINARY};

use crate::ingest::{CodeSegment, LineRecord, MappingKind, MappingRecord};

pub(super) fn kind_code(kind: MappingKind) -> i64 {
    // The wire format's numbers, so the column reads the same as the proto.
    match kind {
        MappingKind::User => 1,
        MappingKind::Kernel => 2,
        MappingKind::Vdso => 3,
        MappingKind::Anonymous => 4,
        MappingKind::Python => 5,
        MappingKind::Named => 6,
    }
}

pub(super) fn kind_from_code(code: i64) -> Option<MappingKind> {
    match code {
        1 => Some(MappingKind::User),
        2 => Some(MappingKind::Kernel),
        3 => Some(MappingKind::Vdso),
        4 => Some(MappingKind::Anonymous),
        5 => Some(MappingKind::Python),
        6 => Some(MappingKind::Named),
        _ => None,
    }
}

// Blobs: LEB128 varints and length-prefixed UTF-8.

pub(super) fn put_varint(buf: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        buf.push((value as u8) | 0x80);
        value >>= 7;
    }
    buf.push(value as u8);
}

pub(super) fn encode_lines(buf: &mut Vec<u8>, lines: &[LineRecord]) {
    for line in lines {
        put_varint(buf, line.function.len() as u64);
        buf.extend_from_slice(line.function.as_bytes());
        put_varint(buf, line.file.len() as u64);
        buf.extend_from_slice(line.file.as_bytes());
        put_varint(buf, u64::from(line.line));
    }
}

pub(super) fn encode_code_segments(buf: &mut Vec<u8>, segments: &[CodeSegment]) {
    for segment in segments {
        for value in [segment.file_offset, segment.vaddr, segment.file_size] {
            put_varint(buf, value);
        }
    }
}

pub(super) fn decode_code_segments(blob: &[u8]) -> Result<Vec<CodeSegment>, &'static str> {
    let mut reader = BlobReader { bytes: blob };
    let mut segments = Vec::new();
    while !reader.is_empty() {
        segments.push(CodeSegment {
            file_offset: reader.varint()?,
            vaddr: reader.varint()?,
            file_size: reader.varint()?,
        });
    }
    Ok(segments)
}

/// Reads a blob written by `put_varint` and friends; errors say what is
/// wrong with it, never panic.
pub(super) struct BlobReader<'a> {
    pub(super) bytes: &'a [u8],
}

impl<'a> BlobReader<'a> {
    pub(super) fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    pub(super) fn varint(&mut self) -> Result<u64, &'static str> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let (&byte, rest) = self.bytes.split_first().ok_or("truncated varint")?;
            self.bytes = rest;
            let part = u64::from(byte & 0x7f);
            if shift == 63 && part > 1 {
                return Err("varint overflows 64 bits");
            }
            value |= part << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err("varint longer than 10 bytes")
    }

    pub(super) fn str(&mut self) -> Result<&'a str, &'static str> {
        let len = usize::try_from(self.varint()?).map_err(|_| "string length overflows")?;
        let (s, rest) = self
            .bytes
            .split_at_checked(len)
            .ok_or("string runs past the end")?;
        self.bytes = rest;
        std::str::from_utf8(s).map_err(|_| "string is not UTF-8")
    }
}

pub(super) fn decode_lines(blob: &[u8]) -> Result<Vec<LineRecord>, &'static str> {
    let mut reader = BlobReader { bytes: blob };
    let mut lines = Vec::new();
    while !reader.is_empty() {
        let function = reader.str()?.to_owned();
        let file = reader.str()?.to_owned();
        let line = u32::try_from(reader.varint()?).map_err(|_| "line number overflows u32")?;
        lines.push(LineRecord {
            function,
            file,
            line,
        });
    }
    Ok(lines)
}

/// The name people know a mapping by in a frame.
fn binary_name(kind: MappingKind, path: &str) -> String {
    match kind {
        MappingKind::Kernel => "[kernel]".into(),
        MappingKind::Vdso => "[vdso]".into(),
        MappingKind::Python => PYTHON_BINARY.into(),
        MappingKind::Named if path.is_empty() => SENT_BINARY.into(),
        MappingKind::User | MappingKind::Anonymous | MappingKind::Named => {
            match path.rsplit('/').find(|part| !part.is_empty()) {
                Some(name) => name.into(),
                None if kind == MappingKind::Anonymous => "[anonymous]".into(),
                None => "[unknown]".into(),
            }
        }
    }
}

/// One frame per line, innermost first (all but the outermost inlined), or
/// one unnamed frame when the location has no lines (with where its code
/// is, for a file with a build-id, so debuginfo can name it later).
pub(super) fn resolve_frames(
    mapping: &MappingRecord,
    address: u64,
    lines: Vec<LineRecord>,
) -> Vec<Arc<Frame>> {
    let (kind, build_id) = (mapping.kind, mapping.build_id.as_str());
    let binary = binary_name(kind, &mapping.path);
    if lines.is_empty() {
        let unnamed_code =
            (kind == MappingKind::User && !build_id.is_empty()).then(|| CodeAddress {
                file_offset: address,
                vaddr: CodeSegment::vaddr_of(&mapping.code_segments, address),
            });
        return vec![Arc::new(Frame {
            build_id: build_id.to_owned(),
            unnamed_code,
            ..Frame::synthetic(Frame::unknown_function(&binary, address), binary)
        })];
    }
    let count = lines.len();
    lines
        .into_iter()
        .enumerate()
        .map(|(i, line)| {
            Arc::new(Frame {
                function: if line.function.is_empty() {
                    Frame::unknown_function(&binary, address)
                } else {
                    line.function
                },
                binary: binary.clone(),
                build_id: build_id.to_owned(),
                file: line.file,
                line: line.line,
                inlined: i + 1 < count,
                unnamed_code: None,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_round_trip() {
        let mut buf = Vec::new();
        let values = [0, 1, 127, 128, 300, u64::from(u32::MAX), u64::MAX];
        for v in values {
            put_varint(&mut buf, v);
        }
        let mut reader = BlobReader { bytes: &buf };
        for v in values {
            assert_eq!(reader.varint(), Ok(v));
        }
        assert!(reader.is_empty());
    }

    #[test]
    fn corrupt_blobs_are_errors() {
        assert_eq!(
            BlobReader { bytes: &[0x80] }.varint(),
            Err("truncated varint")
        );
        assert_eq!(
            BlobReader { bytes: &[0xff; 10] }.varint(),
            Err("varint overflows 64 bits")
        );
        assert_eq!(
            BlobReader { bytes: &[0x80; 11] }.varint(),
            Err("varint longer than 10 bytes")
        );
        assert_eq!(decode_lines(&[5, b'a']), Err("string runs past the end"));
        assert_eq!(decode_lines(&[1, 0xff, 0, 0]), Err("string is not UTF-8"));
    }

    #[test]
    fn lines_round_trip() {
        let lines = vec![
            LineRecord {
                function: "inlined".into(),
                file: "a.h".into(),
                line: 3,
            },
            LineRecord {
                function: String::new(),
                file: String::new(),
                line: u32::MAX,
            },
        ];
        let mut buf = Vec::new();
        encode_lines(&mut buf, &lines);
        assert_eq!(decode_lines(&buf), Ok(lines));
    }

    #[test]
    fn binary_names() {
        assert_eq!(
            binary_name(MappingKind::User, "/usr/lib/libfoo.so"),
            "libfoo.so"
        );
        assert_eq!(binary_name(MappingKind::User, "/opt/app/"), "app");
        assert_eq!(binary_name(MappingKind::User, ""), "[unknown]");
        assert_eq!(binary_name(MappingKind::Anonymous, ""), "[anonymous]");
        assert_eq!(binary_name(MappingKind::Kernel, "vmlinux"), "[kernel]");
        assert_eq!(binary_name(MappingKind::Vdso, "[vdso]"), "[vdso]");
    }
}
