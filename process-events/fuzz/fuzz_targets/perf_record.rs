//! The perf ring walk and the side-band record decoder on arbitrary bytes,
//! as the reader runs them: the first two bytes say where the data area
//! wraps, the rest is the published part of the ring. The walk must hand
//! out whole records (each exactly its `header.size`) and account for every
//! byte, whatever the split; every record decodes to an event or an error
//! (with and without a trailing `sample_id`), never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stackscope_process_events::{EventKind, FileRef, fuzzing::walk_records, parse_record};

fuzz_target!(|data: &[u8]| {
    let Some((split, ring)) = data.split_first_chunk::<2>() else {
        return;
    };
    let split = usize::from(u16::from_le_bytes(*split)) % (ring.len() + 1);
    let (first, second) = ring.split_at(split);

    let mut records = Vec::new();
    let mut scratch = Vec::new();
    let (count, bytes, discarded) = walk_records(first, second, &mut scratch, |record| {
        records.push(record.to_vec())
    });
    assert_eq!(count, records.len() as u64);
    assert_eq!(bytes + discarded.unwrap_or(0), ring.len() as u64);
    assert!(scratch.len() <= ring.len());

    // The same bytes in one piece are the same records.
    let mut whole = Vec::new();
    walk_records(ring, &[], &mut scratch, |record| {
        whole.push(record.to_vec())
    });
    assert_eq!(whole, records);

    for record in &records {
        let size = u16::from_ne_bytes([record[6], record[7]]);
        assert_eq!(usize::from(size), record.len());
        for has_sample_id in [true, false] {
            let Ok(event) = parse_record(record, has_sample_id) else {
                continue;
            };
            let _ = event.pid();
            if let EventKind::Mmap(mmap) = &event.kind {
                assert!(!mmap.path.contains(&0));
                assert!(mmap.path.len() < record.len());
                let _ = mmap.end();
                if let FileRef::BuildId(id) = &mmap.file {
                    assert!(!id.as_bytes().is_empty() && id.as_bytes().len() <= 20);
                    let _ = id.to_string();
                }
            }
            let _ = format!("{event:?}");
        }
    }
});
