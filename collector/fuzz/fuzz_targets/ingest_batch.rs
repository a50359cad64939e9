//! The collector's ingest on arbitrary bytes: decoded as the
//! `stackscope.v1.Batch` an agent sends and validated, under the default
//! limits and under tight ones. A valid batch or an error, never a panic;
//! and a valid batch keeps the promises storage relies on: every index in
//! range, label sets sorted and unique with the node label, weights in
//! `1..=i64::MAX`, and the resolved text within its budget.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message as _;
use stackscope_collector::ingest::{IngestLimits, ValidBatch, validate};
use stackscope_proto::v1;

fn check(batch: &ValidBatch, limits: &IngestLimits) {
    assert!(!batch.node.is_empty());
    assert!(batch.range.start_unix_nanos >= 0);
    assert!(batch.range.start_unix_nanos < batch.range.end_unix_nanos);
    assert!((1..=i64::MAX as u64).contains(&batch.sample_period_nanos));
    let mut text = batch.node.len();
    for mapping in &batch.mappings {
        assert!(mapping.build_id.len() % 2 == 0);
        text += mapping.build_id.len() + mapping.path.len();
    }
    for location in &batch.locations {
        assert!((location.mapping as usize) < batch.mappings.len());
        assert!(location.lines.len() <= limits.max_lines_per_location);
        for line in &location.lines {
            text += line.function.len() + line.file.len();
        }
    }
    for stack in &batch.stacks {
        assert!(!stack.is_empty() && stack.len() <= limits.max_stack_depth);
        assert!(stack.iter().all(|&l| (l as usize) < batch.locations.len()));
    }
    for set in &batch.label_sets {
        assert!(set.windows(2).all(|pair| pair[0].0 < pair[1].0));
        assert!(
            set.iter()
                .any(|(name, value)| name == "node" && *value == batch.node)
        );
        assert!(set.iter().all(|(_, value)| !value.is_empty()));
        text += set.iter().map(|(n, v)| n.len() + v.len()).sum::<usize>();
    }
    for sample in &batch.samples {
        assert!((sample.stack as usize) < batch.stacks.len());
        assert!((sample.label_set as usize) < batch.label_sets.len());
        assert!((1..=i64::MAX as u64).contains(&sample.weight));
    }
    assert!(text <= limits.max_text_bytes, "{text} bytes of text");
}

fuzz_target!(|data: &[u8]| {
    let Ok(batch) = v1::Batch::decode(data) else {
        return;
    };
    let tight = IngestLimits {
        max_samples: 8,
        max_stacks: 8,
        max_locations: 8,
        max_mappings: 4,
        max_stack_depth: 8,
        max_lines_per_location: 4,
        max_strings: 16,
        max_string_bytes: 64,
        max_text_bytes: 256,
        max_label_sets: 4,
        max_labels_per_set: 4,
    };
    for limits in [IngestLimits::default(), tight] {
        if let Ok(valid) = validate(batch.clone(), &limits) {
            check(&valid, &limits);
        }
    }
});
