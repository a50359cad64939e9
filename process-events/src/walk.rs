//! Finding record boundaries in the published part of a perf ring buffer.
//!
//! Owns: splitting the bytes between `data_tail` and `data_head` into
//! records by their `header.size`, copying a record that wraps around the
//! end of the data area into a scratch buffer, and giving up on the rest of
//! the ring (a resync) when a header is impossible.
//!
//! Does not own: the mapping or the head/tail protocol
//! ([`sys`](crate::sys)), or decoding a record ([`record`](crate::record)).
//!
//! The published bytes arrive as two slices because the data area is a
//! circle: `first` runs from the tail to the end of the area (or to the head)
//! and `second` from the start of the area to the head. Working on plain
//! slices keeps this logic safe code, testable without a kernel.

use crate::record::HEADER_LEN;

/// What one walk over the published bytes did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Walk {
    /// Records handed to the callback.
    pub(crate) records: u64,
    /// Bytes of those records.
    pub(crate) bytes: u64,
    /// Bytes thrown away after an impossible header: the ring's framing is
    /// lost, and every byte up to the head is discarded so that the next
    /// drain starts on a record boundary again. `None` when no resync.
    pub(crate) discarded: Option<u64>,
}

/// Hands every record in `first ++ second` to `on_record`, in order, each as
/// exactly `header.size` bytes. Consumes all the bytes, whatever happens:
/// the caller then releases everything up to the head.
///
/// A header whose size is below the header's own 8 bytes (0 included) or
/// beyond the bytes left is impossible (the kernel publishes whole records
/// only), and ends the walk with a resync rather than a guess. The scratch
/// buffer only ever holds one record, so it is bounded by the published
/// length, which the caller bounds by the ring size.
pub(crate) fn walk_records(
    first: &[u8],
    second: &[u8],
    scratch: &mut Vec<u8>,
    mut on_record: impl FnMut(&[u8]),
) -> Walk {
    let total = first.len() + second.len();
    let mut walk = Walk::default();
    let mut pos = 0;
    while pos < total {
        let remaining = total - pos;
        let mut header = [0u8; HEADER_LEN];
        if remaining < HEADER_LEN {
            walk.discarded = Some(remaining as u64);
            break;
        }
        copy_out(first, second, pos, &mut header);
        let size = usize::from(u16::from_ne_bytes([header[6], header[7]]));
        if size < HEADER_LEN || size > remaining {
            walk.discarded = Some(remaining as u64);
            break;
        }
        let record = if pos + size <= first.len() {
            &first[pos..pos + size]
        } else if pos >= first.len() {
            let at = pos - first.len();
            &second[at..at + size]
        } else {
            // Wraps around the end of the data area.
            scratch.clear();
            scratch.resize(size, 0);
            copy_out(first, second, pos, scratch);
            &scratch[..]
        };
        on_record(record);
        walk.records += 1;
        walk.bytes += size as u64;
        pos += size;
    }
    walk
}

/// Copies `out.len()` bytes starting at `pos` of `first ++ second` into
/// `out`. The caller has checked that they exist.
fn copy_out(first: &[u8], second: &[u8], pos: usize, out: &mut [u8]) {
    let from_first = first.get(pos..).unwrap_or_default();
    let n = from_first.len().min(out.len());
    out[..n].copy_from_slice(&from_first[..n]);
    let rest = out.len() - n;
    let second_start = pos.saturating_sub(first.len());
    out[n..].copy_from_slice(&second[second_start..second_start + rest]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::tests::{record, with_header};

    fn records_of(first: &[u8], second: &[u8]) -> (Vec<Vec<u8>>, Walk) {
        let mut seen = Vec::new();
        let mut scratch = Vec::new();
        let walk = walk_records(first, second, &mut scratch, |r| seen.push(r.to_vec()));
        (seen, walk)
    }

    fn three_records() -> Vec<Vec<u8>> {
        vec![
            record(7, 0, &[1; 24]),
            record(3, 0, b"\x01\0\0\0\x02\0\0\0sh\0\0\0\0\0\0"),
            record(4, 0, &[2; 24]),
        ]
    }

    #[test]
    fn empty() {
        assert_eq!(records_of(&[], &[]), (vec![], Walk::default()));
    }

    #[test]
    fn contiguous() {
        let recs = three_records();
        let all = recs.concat();
        let (seen, walk) = records_of(&all, &[]);
        assert_eq!(seen, recs);
        assert_eq!(walk.records, 3);
        assert_eq!(walk.bytes, all.len() as u64);
        assert_eq!(walk.discarded, None);
    }

    #[test]
    fn every_split_point() {
        // Splitting the same bytes anywhere (on a record boundary, inside a
        // header, inside a body) must give the same records.
        let recs = three_records();
        let all = recs.concat();
        for split in 0..=all.len() {
            let (seen, walk) = records_of(&all[..split], &all[split..]);
            assert_eq!(seen, recs, "split at {split}");
            assert_eq!(walk.discarded, None);
        }
    }

    #[test]
    fn zero_size_resyncs() {
        let recs = three_records();
        let mut all = recs.concat();
        let second = recs[0].len();
        all[second + 6..second + 8].copy_from_slice(&0u16.to_ne_bytes());
        let (seen, walk) = records_of(&all, &[]);
        assert_eq!(seen, recs[..1]);
        assert_eq!(walk.discarded, Some((all.len() - second) as u64));
    }

    #[test]
    fn size_beyond_published_bytes_resyncs() {
        let mut rec = with_header(3, 0, &[0; 16]);
        rec[6..8].copy_from_slice(&4096u16.to_ne_bytes());
        let (seen, walk) = records_of(&rec, &[]);
        assert!(seen.is_empty());
        assert_eq!(walk.discarded, Some(24));
    }

    #[test]
    fn size_below_header_resyncs() {
        let mut rec = with_header(3, 0, &[0; 16]);
        rec[6..8].copy_from_slice(&4u16.to_ne_bytes());
        let (_, walk) = records_of(&rec, &[]);
        assert_eq!(walk.discarded, Some(24));
    }

    #[test]
    fn partial_header_at_the_end_resyncs() {
        let mut all = three_records().concat();
        all.extend_from_slice(&[0; 5]);
        let (seen, walk) = records_of(&all, &[]);
        assert_eq!(seen.len(), 3);
        assert_eq!(walk.discarded, Some(5));
    }

    #[test]
    fn scratch_is_bounded_by_one_record() {
        let recs = three_records();
        let all = recs.concat();
        let mut scratch = Vec::new();
        walk_records(&all[..10], &all[10..], &mut scratch, |_| {});
        assert_eq!(scratch.len(), recs[0].len());
    }
}
