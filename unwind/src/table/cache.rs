//! The on-disk form of an [`UnwindTable`], so a binary's CFI is evaluated once
//! per build-id rather than once per agent start.
//!
//! This module owns the byte format and its validation. It does not own where
//! files live, how they are keyed or when they are evicted.
//!
//! Format (all integers little-endian):
//!
//! ```text
//! offset  size          field
//! 0       8             magic  b"STKUNWT\0"
//! 8       4             version (FORMAT_VERSION)
//! 12      4             rule count R
//! 16      4             row count N
//! 20      4             flags: bit 0, code without rows keeps frame pointers
//! 24      8             base address
//! 32      12 * R        rules: kind u8, aux u8, 2 zero bytes, a i32, b i32
//! 32+12R  8 * N         rows: address offset u32, rule index u32
//! end-8   8             FNV-1a 64 of every byte before it
//! ```
//!
//! Decoding trusts nothing: besides the checksum (which catches torn writes
//! and bit rot, not malice) it re-checks every invariant `lookup` relies on,
//! so a file that decodes is a table that could have been compiled.

use super::{NO_INFO, Row, UnsupportedCfi, UnwindRule, UnwindTable};

const MAGIC: [u8; 8] = *b"STKUNWT\0";
/// Bump on any change to the layout or to the meaning of a rule, or to
/// what a table holds: old files then fail with [`CacheError::Version`] and
/// get recompiled. 2: entry points without CFI are outermost. 3: flags.
/// 4: compressed `.debug_frame` read, Go functions from `.gopclntab`.
/// 5: V8's builtins ([`UnwindRule::FramePointerAtCalls`]).
pub(crate) const FORMAT_VERSION: u32 = 5;
/// Header flag: [`UnwindTable::frame_pointer_gaps`].
const FLAG_FRAME_POINTER_GAPS: u32 = 1;
const HEADER_LEN: usize = 32;
const RULE_LEN: usize = 12;
const ROW_LEN: usize = 8;
const CHECKSUM_LEN: usize = 8;

/// Why cached table bytes were rejected. Every variant means "recompile".
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CacheError {
    /// Too short to hold the header and checksum.
    #[error("cached table truncated: {len} bytes")]
    Truncated {
        /// Length of the input.
        len: usize,
    },
    /// Not a stackscope unwind table.
    #[error("not a cached unwind table (bad magic)")]
    BadMagic,
    /// Written by a different format version.
    #[error("cached table format version {found}, expected {FORMAT_VERSION}")]
    Version {
        /// The version in the file.
        found: u32,
    },
    /// The length does not match the rule and row counts in the header.
    #[error("cached table is {found} bytes, its header says {expected}")]
    Length {
        /// Length implied by the header.
        expected: u64,
        /// Actual length.
        found: usize,
    },
    /// The checksum does not match the contents.
    #[error("cached table checksum mismatch")]
    Checksum,
    /// The contents break a table invariant.
    #[error("cached table is invalid: {what}")]
    Invalid {
        /// Which invariant.
        what: &'static str,
    },
}

/// FNV-1a, 64-bit: a few lines, no dependency, and plenty to detect
/// corruption of a file we wrote ourselves.
fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &byte in bytes {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

fn reason_code(reason: UnsupportedCfi) -> u8 {
    match reason {
        UnsupportedCfi::CfaRegister => 1,
        UnsupportedCfi::CfaExpression => 2,
        UnsupportedCfi::ReturnAddress => 3,
        UnsupportedCfi::Rbp => 4,
        UnsupportedCfi::Rsp => 5,
        UnsupportedCfi::OffsetRange => 6,
        UnsupportedCfi::Program => 7,
        UnsupportedCfi::StackSwitch => 8,
    }
}

fn reason_from_code(code: u8) -> Option<UnsupportedCfi> {
    Some(match code {
        1 => UnsupportedCfi::CfaRegister,
        2 => UnsupportedCfi::CfaExpression,
        3 => UnsupportedCfi::ReturnAddress,
        4 => UnsupportedCfi::Rbp,
        5 => UnsupportedCfi::Rsp,
        6 => UnsupportedCfi::OffsetRange,
        7 => UnsupportedCfi::Program,
        8 => UnsupportedCfi::StackSwitch,
        _ => return None,
    })
}

/// `(kind, aux, a, b)`; fields a kind does not use are zero.
fn encode_rule(rule: UnwindRule) -> (u8, u8, i32, i32) {
    match rule {
        UnwindRule::Rsp { cfa_off } => (1, 0, cfa_off, 0),
        UnwindRule::RspRbpSaved { cfa_off, rbp_off } => (2, 0, cfa_off, rbp_off),
        UnwindRule::Rbp { cfa_off } => (3, 0, cfa_off, 0),
        UnwindRule::RbpRbpSaved { cfa_off, rbp_off } => (4, 0, cfa_off, rbp_off),
        UnwindRule::Plt { threshold } => (5, threshold, 0, 0),
        UnwindRule::Outermost => (6, 0, 0, 0),
        UnwindRule::SignalFrame => (7, 0, 0, 0),
        UnwindRule::Unsupported(reason) => (8, reason_code(reason), 0, 0),
        UnwindRule::FramePointerAtCalls => (9, 0, 0, 0),
    }
}

fn decode_rule(kind: u8, aux: u8, a: i32, b: i32) -> Option<UnwindRule> {
    let rule = match kind {
        1 => UnwindRule::Rsp { cfa_off: a },
        2 => UnwindRule::RspRbpSaved {
            cfa_off: a,
            rbp_off: b,
        },
        3 => UnwindRule::Rbp { cfa_off: a },
        4 => UnwindRule::RbpRbpSaved {
            cfa_off: a,
            rbp_off: b,
        },
        5 if aux <= 15 => UnwindRule::Plt { threshold: aux },
        6 => UnwindRule::Outermost,
        7 => UnwindRule::SignalFrame,
        8 => UnwindRule::Unsupported(reason_from_code(aux)?),
        9 => UnwindRule::FramePointerAtCalls,
        _ => return None,
    };
    // Only the canonical encoding is accepted: a stray bit in an unused field
    // is corruption the checksum happened to miss.
    (encode_rule(rule) == (kind, aux, a, b)).then_some(rule)
}

pub(super) fn encode(table: &UnwindTable) -> Vec<u8> {
    let len = HEADER_LEN + table.rules.len() * RULE_LEN + table.rows.len() * ROW_LEN + CHECKSUM_LEN;
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    // Rules are indexed by u32 and rows have distinct u32 addresses, so
    // neither count can exceed u32::MAX + 1 rows; should that one case ever
    // happen, the saturated count makes the file fail its length check.
    let count = |len: usize| u32::try_from(len).unwrap_or(u32::MAX);
    out.extend_from_slice(&count(table.rules.len()).to_le_bytes());
    out.extend_from_slice(&count(table.rows.len()).to_le_bytes());
    let flags = if table.frame_pointer_gaps {
        FLAG_FRAME_POINTER_GAPS
    } else {
        0
    };
    out.extend_from_slice(&flags.to_le_bytes());
    out.extend_from_slice(&table.base.to_le_bytes());
    for &rule in &table.rules {
        let (kind, aux, a, b) = encode_rule(rule);
        out.extend_from_slice(&[kind, aux, 0, 0]);
        out.extend_from_slice(&a.to_le_bytes());
        out.extend_from_slice(&b.to_le_bytes());
    }
    for row in &table.rows {
        out.extend_from_slice(&row.address.to_le_bytes());
        out.extend_from_slice(&row.rule.to_le_bytes());
    }
    let checksum = fnv1a64(&out);
    out.extend_from_slice(&checksum.to_le_bytes());
    out
}

/// Little-endian reads from a slice whose length the caller already checked.
struct Cursor<'a> {
    bytes: &'a [u8],
}

impl Cursor<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], CacheError> {
        let (head, tail) = self
            .bytes
            .split_first_chunk::<N>()
            .ok_or(CacheError::Invalid {
                what: "length accounting",
            })?;
        self.bytes = tail;
        Ok(*head)
    }
    fn u32(&mut self) -> Result<u32, CacheError> {
        self.take().map(u32::from_le_bytes)
    }
    fn i32(&mut self) -> Result<i32, CacheError> {
        self.take().map(i32::from_le_bytes)
    }
    fn u64(&mut self) -> Result<u64, CacheError> {
        self.take().map(u64::from_le_bytes)
    }
}

pub(super) fn decode(bytes: &[u8]) -> Result<UnwindTable, CacheError> {
    if bytes.len() < HEADER_LEN + CHECKSUM_LEN {
        return Err(CacheError::Truncated { len: bytes.len() });
    }
    let mut header = Cursor { bytes };
    if header.take::<8>()? != MAGIC {
        return Err(CacheError::BadMagic);
    }
    let version = header.u32()?;
    if version != FORMAT_VERSION {
        return Err(CacheError::Version { found: version });
    }
    let rule_count = header.u32()?;
    let row_count = header.u32()?;
    let flags = header.u32()?;
    let base = header.u64()?;

    let expected = HEADER_LEN as u64
        + u64::from(rule_count) * RULE_LEN as u64
        + u64::from(row_count) * ROW_LEN as u64
        + CHECKSUM_LEN as u64;
    if expected != bytes.len() as u64 {
        return Err(CacheError::Length {
            expected,
            found: bytes.len(),
        });
    }
    let (body, checksum) = bytes.split_at(bytes.len() - CHECKSUM_LEN);
    if (Cursor { bytes: checksum }).u64()? != fnv1a64(body) {
        return Err(CacheError::Checksum);
    }
    if flags & !FLAG_FRAME_POINTER_GAPS != 0 {
        return Err(CacheError::Invalid {
            what: "unknown header flags",
        });
    }
    if rule_count == NO_INFO {
        return Err(CacheError::Invalid { what: "rule count" });
    }

    let mut cursor = Cursor {
        bytes: &body[HEADER_LEN..],
    };
    let mut rules = Vec::with_capacity(rule_count as usize);
    for _ in 0..rule_count {
        let [kind, aux, pad0, pad1] = cursor.take()?;
        let (a, b) = (cursor.i32()?, cursor.i32()?);
        let rule = decode_rule(kind, aux, a, b)
            .filter(|_| pad0 == 0 && pad1 == 0)
            .ok_or(CacheError::Invalid { what: "rule" })?;
        rules.push(rule);
    }

    let mut rows: Vec<Row> = Vec::with_capacity(row_count as usize);
    for _ in 0..row_count {
        let row = Row {
            address: cursor.u32()?,
            rule: cursor.u32()?,
        };
        if row.rule != NO_INFO && row.rule >= rule_count {
            return Err(CacheError::Invalid { what: "rule index" });
        }
        if rows.last().is_some_and(|last| last.address >= row.address) {
            return Err(CacheError::Invalid {
                what: "rows not sorted",
            });
        }
        rows.push(row);
    }
    if let Some(last) = rows.last() {
        if last.rule != NO_INFO {
            return Err(CacheError::Invalid {
                what: "no terminating gap row",
            });
        }
        if base.checked_add(u64::from(last.address)).is_none() {
            return Err(CacheError::Invalid {
                what: "addresses past 2^64",
            });
        }
    }
    Ok(UnwindTable {
        base,
        rows,
        rules,
        frame_pointer_gaps: flags & FLAG_FRAME_POINTER_GAPS != 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> UnwindTable {
        UnwindTable {
            base: 0x40_1000,
            rows: vec![
                Row {
                    address: 0,
                    rule: 0,
                },
                Row {
                    address: 1,
                    rule: 1,
                },
                Row {
                    address: 0x20,
                    rule: NO_INFO,
                },
                Row {
                    address: 0x30,
                    rule: 2,
                },
                Row {
                    address: 0x40,
                    rule: NO_INFO,
                },
            ],
            rules: vec![
                UnwindRule::Rsp { cfa_off: 8 },
                UnwindRule::RspRbpSaved {
                    cfa_off: 16,
                    rbp_off: -16,
                },
                UnwindRule::Unsupported(UnsupportedCfi::CfaExpression),
            ],
            frame_pointer_gaps: false,
        }
    }

    fn every_rule() -> Vec<UnwindRule> {
        vec![
            UnwindRule::Rsp { cfa_off: -4 },
            UnwindRule::RspRbpSaved {
                cfa_off: i32::MAX,
                rbp_off: i32::MIN,
            },
            UnwindRule::Rbp { cfa_off: 16 },
            UnwindRule::RbpRbpSaved {
                cfa_off: 16,
                rbp_off: -16,
            },
            UnwindRule::Plt { threshold: 11 },
            UnwindRule::Outermost,
            UnwindRule::SignalFrame,
            UnwindRule::Unsupported(UnsupportedCfi::CfaRegister),
            UnwindRule::Unsupported(UnsupportedCfi::CfaExpression),
            UnwindRule::Unsupported(UnsupportedCfi::ReturnAddress),
            UnwindRule::Unsupported(UnsupportedCfi::Rbp),
            UnwindRule::Unsupported(UnsupportedCfi::Rsp),
            UnwindRule::Unsupported(UnsupportedCfi::OffsetRange),
            UnwindRule::Unsupported(UnsupportedCfi::Program),
            UnwindRule::Unsupported(UnsupportedCfi::StackSwitch),
            UnwindRule::FramePointerAtCalls,
        ]
    }

    /// Rewrites the checksum after a deliberate edit, so the test reaches the
    /// validation behind it.
    fn reseal(bytes: &mut [u8]) {
        let split = bytes.len() - CHECKSUM_LEN;
        let checksum = fnv1a64(&bytes[..split]);
        bytes[split..].copy_from_slice(&checksum.to_le_bytes());
    }

    #[test]
    fn round_trip() {
        let table = sample();
        let bytes = table.to_bytes();
        assert_eq!(bytes.len(), 32 + 3 * 12 + 5 * 8 + 8);
        assert_eq!(UnwindTable::from_bytes(&bytes), Ok(table));

        let empty = UnwindTable::default();
        assert_eq!(UnwindTable::from_bytes(&empty.to_bytes()), Ok(empty));
    }

    #[test]
    fn every_rule_round_trips() {
        let rules = every_rule();
        let rows = (0..rules.len() as u32)
            .map(|rule| Row {
                address: rule * 4,
                rule,
            })
            .chain([Row {
                address: 0x100,
                rule: NO_INFO,
            }])
            .collect();
        let table = UnwindTable {
            base: 0,
            rows,
            rules,
            frame_pointer_gaps: true,
        };
        assert_eq!(UnwindTable::from_bytes(&table.to_bytes()), Ok(table));
    }

    #[test]
    fn fnv1a64_reference_values() {
        // Published FNV-1a 64 test vectors.
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn every_truncation_is_rejected() {
        let bytes = sample().to_bytes();
        for len in 0..bytes.len() {
            let error = UnwindTable::from_bytes(&bytes[..len]).unwrap_err();
            if len < HEADER_LEN + CHECKSUM_LEN {
                assert_eq!(error, CacheError::Truncated { len });
            } else {
                assert_eq!(
                    error,
                    CacheError::Length {
                        expected: bytes.len() as u64,
                        found: len
                    }
                );
            }
        }
    }

    #[test]
    fn every_bit_flip_is_rejected() {
        let bytes = sample().to_bytes();
        for byte in 0..bytes.len() {
            for bit in 0..8 {
                let mut corrupt = bytes.clone();
                corrupt[byte] ^= 1 << bit;
                assert!(
                    UnwindTable::from_bytes(&corrupt).is_err(),
                    "flipping bit {bit} of byte {byte} went unnoticed"
                );
            }
        }
    }

    #[test]
    fn header_errors() {
        let bytes = sample().to_bytes();

        let mut wrong_magic = bytes.clone();
        wrong_magic[0] = b'X';
        assert_eq!(
            UnwindTable::from_bytes(&wrong_magic),
            Err(CacheError::BadMagic)
        );

        let mut old = bytes.clone();
        old[8..12].copy_from_slice(&0u32.to_le_bytes());
        reseal(&mut old);
        assert_eq!(
            UnwindTable::from_bytes(&old),
            Err(CacheError::Version { found: 0 })
        );

        let mut bad_sum = bytes.clone();
        *bad_sum.last_mut().unwrap() ^= 0xff;
        assert_eq!(UnwindTable::from_bytes(&bad_sum), Err(CacheError::Checksum));

        // A header claiming 2^32 - 1 rows must not allocate for them.
        let mut huge = bytes.clone();
        huge[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
        reseal(&mut huge);
        assert!(matches!(
            UnwindTable::from_bytes(&huge),
            Err(CacheError::Length { .. })
        ));
    }

    #[test]
    fn invariant_violations_with_valid_checksums() {
        let rows_at = HEADER_LEN + 3 * RULE_LEN;
        // (invariant, byte offset, bytes written there)
        let cases: [(&str, usize, &[u8]); 6] = [
            ("rule", HEADER_LEN, &[99]),    // unknown kind
            ("rule", HEADER_LEN + 8, &[1]), // `b` of an Rsp rule
            ("rule index", rows_at + 4, &3u32.to_le_bytes()),
            ("rows not sorted", rows_at + 8, &0u32.to_le_bytes()),
            (
                "no terminating gap row",
                rows_at + 4 * ROW_LEN + 4,
                &0u32.to_le_bytes(),
            ),
            ("unknown header flags", 20, &[2]),
        ];
        for (what, at, edit) in cases {
            let mut bytes = sample().to_bytes();
            bytes[at..at + edit.len()].copy_from_slice(edit);
            reseal(&mut bytes);
            assert_eq!(
                UnwindTable::from_bytes(&bytes),
                Err(CacheError::Invalid { what }),
                "{what}"
            );
        }
    }
}
