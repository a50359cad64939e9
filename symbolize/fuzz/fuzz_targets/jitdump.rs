//! The jitdump reader on an arbitrary stream: events or a broken stream,
//! never a panic. The first byte says how the stream is cut into the
//! chunks the reader is fed (as a file grows between reads); any cut must
//! give the same events as the whole stream at once.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stackscope_symbolize::jitdump::{DumpEvent, DumpReader};

fn read<'a>(chunks: impl Iterator<Item = &'a [u8]>) -> (Vec<DumpEvent>, bool) {
    let mut reader = DumpReader::default();
    let mut events = Vec::new();
    for chunk in chunks {
        reader.feed(chunk, |event| events.push(event));
    }
    (events, reader.is_broken())
}

fuzz_target!(|data: &[u8]| {
    let Some((&cut, stream)) = data.split_first() else {
        return;
    };
    let whole = read(std::iter::once(stream));
    let mut rest = stream;
    let mut i = 0usize;
    let pieces = std::iter::from_fn(|| {
        if rest.is_empty() {
            return None;
        }
        i += 1;
        let len = ((usize::from(cut) * i) % 97 + 1).min(rest.len());
        let (piece, after) = rest.split_at(len);
        rest = after;
        Some(piece)
    });
    assert_eq!(whole, read(pieces));
    for event in &whole.0 {
        if let DumpEvent::Load { start, end, name } = event {
            assert!(start < end);
            assert!(!name.is_empty());
        }
    }
});
