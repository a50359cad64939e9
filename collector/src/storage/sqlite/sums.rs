//! The blob a bucket's or a rollup span's samples are kept in, one per
//! label set (one per span in `rollups`): the summed weight of each stack,
//! as a varint count of pairs, then per pair, ascending by stack id, the
//! id's distance from the previous one (the first's from 0) and the weight,
//! both varints.
//!
//! Why a blob and not a row per (bucket, label set, stack): a query reads
//! whole (bucket or span, label set) sums, never a single stack's, and
//! SQLite spends most of a row's read in its virtual machine and the row's
//! decoding (a query over a quarter of a fleet's hour reads 800k of them);
//! one blob per label set is one row to step over, decoded here in a tight
//! loop. The table is also several times smaller on disk. Ingest merges a
//! batch's sums into the blob of each of its label sets.
//!
//! Blobs are read back as untrusted input: a malformed one is an error
//! that says what is wrong with it, never a panic.

use rusqlite::Row;

use super::{StorageError, add_capped, saturate};
use crate::storage::codec::{BlobReader, put_varint};

/// Appends the blob of `pairs` (stack id, weight), ascending by id with no
/// id twice, to `buf`. Weights saturate at `i64::MAX`, as every sum does.
pub(super) fn encode(buf: &mut Vec<u8>, pairs: &[(i64, u64)]) {
    debug_assert!(pairs.windows(2).all(|two| two[0].0 < two[1].0));
    put_varint(buf, pairs.len() as u64);
    let mut previous = 0i64;
    for &(stack, weight) in pairs {
        put_varint(buf, stack.wrapping_sub(previous) as u64);
        put_varint(buf, saturate(weight) as u64);
        previous = stack;
    }
}

/// The blob in column `index` of `row`.
pub(super) fn column<'row>(row: &'row Row<'_>, index: usize) -> Result<&'row [u8], StorageError> {
    row.get_ref(index)?
        .as_blob()
        .map_err(|_| StorageError::Corrupt("stack sums that are not a blob".into()))
}

/// The number of pairs `blob` holds (its first varint), unchecked beyond
/// it but for the bytes they would take (two at least each).
pub(super) fn count(blob: &[u8]) -> Result<u64, StorageError> {
    let count = BlobReader { bytes: blob }.varint().map_err(corrupt)?;
    Ok(count.min(blob.len() as u64 / 2))
}

/// Calls `each(stack id, weight)` for every pair of `blob`, ascending by id.
pub(super) fn for_each(
    blob: &[u8],
    mut each: impl FnMut(i64, u64) -> Result<(), StorageError>,
) -> Result<(), StorageError> {
    let mut reader = BlobReader { bytes: blob };
    let pairs = reader.varint().map_err(corrupt)?;
    let mut stack = 0i64;
    for index in 0..pairs {
        let step = reader.varint().map_err(corrupt)?;
        let weight = reader.varint().map_err(corrupt)?;
        stack = i64::try_from(step)
            .ok()
            .and_then(|step| stack.checked_add(step))
            .filter(|&next| index == 0 || next > stack)
            .ok_or_else(|| corrupt("stack ids that do not ascend"))?;
        if weight == 0 || weight > i64::MAX as u64 {
            return Err(corrupt("a weight outside 1..=i64::MAX"));
        }
        each(stack, weight)?;
    }
    if !reader.is_empty() {
        return Err(corrupt("bytes past its last pair"));
    }
    Ok(())
}

/// Writes into `out` the blob of `stored` (a blob, or None for no pairs)
/// plus `added` (pairs ascending by id, no id twice): weights of the same
/// stack add up, capped at `i64::MAX`. `scratch` holds the stored pairs,
/// then the merged ones.
pub(super) fn merge(
    stored: Option<&[u8]>,
    added: &[(i64, u64)],
    scratch: &mut [Vec<(i64, u64)>; 2],
    out: &mut Vec<u8>,
) -> Result<(), StorageError> {
    out.clear();
    let Some(stored) = stored else {
        encode(out, added);
        return Ok(());
    };
    let [stored_pairs, merged] = scratch;
    stored_pairs.clear();
    for_each(stored, |stack, weight| {
        stored_pairs.push((stack, weight));
        Ok(())
    })?;
    merged.clear();
    let (mut old, mut new) = (stored_pairs.iter().peekable(), added.iter().peekable());
    loop {
        let next = match (old.peek(), new.peek()) {
            (Some(&&(a, wa)), Some(&&(b, wb))) if a == b => {
                old.next();
                new.next();
                (a, add_capped(wa, wb))
            }
            (Some(&&a), Some(&&b)) if a.0 < b.0 => {
                old.next();
                a
            }
            (_, Some(&&b)) => {
                new.next();
                b
            }
            (Some(&&a), None) => {
                old.next();
                a
            }
            (None, None) => break,
        };
        merged.push(next);
    }
    encode(out, merged);
    Ok(())
}

fn corrupt(what: &str) -> StorageError {
    StorageError::Corrupt(format!("a blob of stack sums holds {what}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(blob: &[u8]) -> Result<Vec<(i64, u64)>, StorageError> {
        let mut pairs = Vec::new();
        for_each(blob, |stack, weight| {
            pairs.push((stack, weight));
            Ok(())
        })?;
        Ok(pairs)
    }

    #[test]
    fn pairs_read_back_as_written() {
        let pairs = [(1, 5), (2, 1), (300, i64::MAX as u64), (1 << 40, 7)];
        let mut blob = Vec::new();
        encode(&mut blob, &pairs);
        assert_eq!(decode(&blob).expect("decodes"), pairs);
        assert_eq!(count(&blob).expect("count"), 4);
        let mut empty = Vec::new();
        encode(&mut empty, &[]);
        assert_eq!(decode(&empty).expect("decodes"), []);
    }

    #[test]
    fn merging_adds_weights_of_the_same_stack_and_keeps_order() {
        let mut stored = Vec::new();
        encode(&mut stored, &[(2, 1), (5, 2), (9, i64::MAX as u64 - 1)]);
        let (mut scratch, mut out) = (Default::default(), Vec::new());
        merge(
            Some(&stored),
            &[(1, 3), (5, 4), (9, 10), (12, 1)],
            &mut scratch,
            &mut out,
        )
        .expect("merges");
        assert_eq!(
            decode(&out).expect("decodes"),
            [(1, 3), (2, 1), (5, 6), (9, i64::MAX as u64), (12, 1)]
        );
        merge(None, &[(4, 1)], &mut scratch, &mut out).expect("merges");
        assert_eq!(decode(&out).expect("decodes"), [(4, 1)]);
    }

    #[test]
    fn malformed_blobs_are_errors() {
        let blob = |pairs: &[u64]| {
            let mut blob = Vec::new();
            for &value in pairs {
                put_varint(&mut blob, value);
            }
            blob
        };
        for (bytes, what) in [
            (Vec::new(), "truncated varint"),
            (blob(&[2, 1, 1]), "truncated varint"),
            (blob(&[2, 5, 1, 0, 1]), "stack ids that do not ascend"),
            (blob(&[1, 5, 0]), "a weight outside 1..=i64::MAX"),
            (blob(&[1, 5, 1 << 63]), "a weight outside 1..=i64::MAX"),
            (blob(&[1, u64::MAX, 1]), "stack ids that do not ascend"),
            (blob(&[1, 5, 1, 9]), "bytes past its last pair"),
        ] {
            let err = decode(&bytes).expect_err(what);
            assert_eq!(
                err.to_string(),
                StorageError::Corrupt(format!("a blob of stack sums holds {what}")).to_string()
            );
        }
    }
}
