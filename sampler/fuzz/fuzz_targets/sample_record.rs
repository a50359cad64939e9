//! The ring-buffer record decoder on arbitrary bytes: a record or an
//! error, never a panic; and what it decodes keeps the promises the walker
//! relies on (stacks inside the record, tail spans inside the tail).
#![no_main]

use libfuzzer_sys::fuzz_target;
use stackscope_sampler::record::Record;

fuzz_target!(|data: &[u8]| {
    let Ok(Record::Sample(sample)) = Record::decode(data) else {
        return;
    };
    assert!(sample.record_len() <= data.len());
    let frames = sample.kernel_frames();
    assert_eq!(
        frames.len() * 8 + sample.user_stack.len(),
        sample.record_len() - agent_common::SAMPLE_HEADER_SIZE - sample.tail_data().len()
    );
    let mut spans = Vec::new();
    sample.tail_spans(&mut spans);
    for span in &spans {
        let end = span.offset as usize + span.len as usize;
        assert!(end <= sample.tail_data().len());
    }
    let owned = sample.to_owned_sample();
    assert_eq!(owned.spans, spans);
    let _ = sample.comm();
});
