//! Content hashes of the dictionary items both engines store (mappings,
//! locations, stacks, label sets): 128-bit xxh3 of a tag byte per kind of
//! item, then every field, strings length-prefixed so no two different items
//! serialize alike. Shared so both engines name an item by the same hash;
//! the hashes are stored, so they must never change for an item already
//! sent. Owns no storage and no encoding of stored rows (`codec`).

use super::codec::kind_code;
use crate::ingest::{LineRecord, MappingRecord};

fn put_str(bytes: &mut Vec<u8>, s: &str) {
    bytes.extend_from_slice(&(s.len() as u64).to_le_bytes());
    bytes.extend_from_slice(s.as_bytes());
}

pub(super) fn mapping_hash(bytes: &mut Vec<u8>, mapping: &MappingRecord) -> u128 {
    bytes.clear();
    bytes.push(b'm');
    bytes.push(kind_code(mapping.kind) as u8);
    put_str(bytes, &mapping.build_id);
    put_str(bytes, &mapping.path);
    // Nothing for no segments: mappings stored before segments were sent
    // keep their hashes.
    for segment in &mapping.code_segments {
        for value in [segment.file_offset, segment.vaddr, segment.file_size] {
            bytes.extend_from_slice(&value.to_le_bytes());
        }
    }
    xxhash_rust::xxh3::xxh3_128(bytes)
}

pub(super) fn location_hash(
    bytes: &mut Vec<u8>,
    mapping: u128,
    address: u64,
    lines: &[LineRecord],
) -> u128 {
    bytes.clear();
    bytes.push(b'l');
    bytes.extend_from_slice(&mapping.to_le_bytes());
    bytes.extend_from_slice(&address.to_le_bytes());
    for line in lines {
        put_str(bytes, &line.function);
        put_str(bytes, &line.file);
        bytes.extend_from_slice(&line.line.to_le_bytes());
    }
    xxhash_rust::xxh3::xxh3_128(bytes)
}

pub(super) fn label_set_hash(bytes: &mut Vec<u8>, labels: &[(String, String)]) -> u128 {
    bytes.clear();
    bytes.push(b'L');
    for (name, value) in labels {
        put_str(bytes, name);
        put_str(bytes, value);
    }
    xxhash_rust::xxh3::xxh3_128(bytes)
}

/// A stack's hash, from its locations' hashes, leaf first (or the first
/// error the caller's lookup of one gave).
pub(super) fn stack_hash<E>(
    bytes: &mut Vec<u8>,
    locations: impl IntoIterator<Item = Result<u128, E>>,
) -> Result<u128, E> {
    bytes.clear();
    bytes.push(b's');
    for hash in locations {
        bytes.extend_from_slice(&hash?.to_le_bytes());
    }
    Ok(xxhash_rust::xxh3::xxh3_128(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_separate_fields() {
        let mut bytes = Vec::new();
        let a = label_set_hash(&mut bytes, &[("ab".into(), "c".into())]);
        let b = label_set_hash(&mut bytes, &[("a".into(), "bc".into())]);
        assert_ne!(a, b);
    }

    #[test]
    fn a_stack_hash_is_made_of_its_locations_hashes_in_order() {
        let mut bytes = Vec::new();
        let mut hash = |locations: &[u128]| {
            stack_hash::<()>(&mut bytes, locations.iter().copied().map(Ok)).expect("hash")
        };
        assert_eq!(hash(&[1, 2]), hash(&[1, 2]));
        assert_ne!(hash(&[1, 2]), hash(&[2, 1]));
        assert_eq!(
            stack_hash(&mut bytes, [Ok(1), Err("missing")]),
            Err("missing")
        );
    }
}
