//! A small `stackscope.v1.Batch` for tests of the collector and the CLI:
//! named frames, an unnamed one and a `comm` label, stamped now.

use std::time::SystemTime;

use stackscope_profile::model::unix_nanos;
use stackscope_proto::v1::{
    Batch, Label, LabelSet, Line, Location, Mapping, MappingKind, Node, Sample, Stack,
};

/// A batch from `node`: `comm` ran main -> work (named, with an inlined
/// helper) `count` times, and an unnamed frame of libfoo.so `unnamed` times.
pub fn batch(id: u8, node: &str, comm: &str, count: u64, unnamed: u64) -> Batch {
    let strings: Vec<String> = [
        "",
        node,
        "0.1.0",
        "/usr/bin/app",
        "abcdef01",
        "main",
        "app.c",
        "work",
        "helper",
        "/usr/lib/libfoo.so",
        "comm",
        comm,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let line = |function, line| Line {
        function,
        file: 6,
        line,
    };
    let now = unix_nanos(SystemTime::now());
    Batch {
        batch_id: vec![id; 16],
        node: Some(Node {
            name: 1,
            agent_version: 2,
        }),
        start_unix_nanos: now - 10_000_000_000,
        end_unix_nanos: now,
        sample_period_nanos: 10_101_010,
        strings,
        mappings: vec![
            Mapping {
                kind: MappingKind::User as i32,
                build_id: 4,
                path: 3,
                load_segments: Vec::new(),
            },
            Mapping {
                kind: MappingKind::User as i32,
                build_id: 0,
                path: 9,
                load_segments: Vec::new(),
            },
        ],
        locations: vec![
            Location {
                mapping: 0,
                address: 0x1100,
                lines: vec![line(5, 10)],
            },
            Location {
                mapping: 0,
                address: 0x1200,
                lines: vec![line(8, 30), line(7, 20)],
            },
            Location {
                mapping: 1,
                address: 0x1a2b,
                lines: vec![],
            },
        ],
        stacks: vec![
            Stack {
                locations: vec![1, 0],
            },
            Stack {
                locations: vec![2, 0],
            },
        ],
        label_sets: vec![LabelSet {
            labels: vec![Label {
                name: 10,
                value: 11,
            }],
        }],
        samples: [(0, count), (1, unnamed)]
            .into_iter()
            .filter(|&(_, n)| n > 0)
            .map(|(stack, count)| Sample {
                stack,
                label_set: 0,
                count,
                sampling_divisor: 0,
            })
            .collect(),
        typed_samples: Vec::new(),
    }
}
