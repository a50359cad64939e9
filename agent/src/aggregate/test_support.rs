//! What the aggregator's tests share (the `test-support` feature, for its
//! integration tests): real module files of the test process, sample
//! headers, and adding a sample as the agent does.

use std::{collections::HashMap, sync::Arc};

use agent_common::{COMM_LEN, RecordKind, SampleHeader, sample_flags};
use stackscope_metadata::{describe::Wanted, process::ProcessLabels};
use stackscope_process_table::{Location, ModuleFile, ProcessTable};
use stackscope_unwind::{
    UnwindEnd,
    walker::{FrameObject, Walk, WalkOutcome},
};

use super::{Aggregator, AggregatorConfig, Interval, LabelRecords as _, LabelValues, MappingKey};

/// Two real module files of this test process: its own executable and
/// the C library.
pub fn module_files() -> (Arc<ModuleFile>, Arc<ModuleFile>) {
    let mut table = ProcessTable::default();
    let pid = std::process::id();
    let mut module = |address: u64| match table.lookup(pid, address) {
        Ok(Some(Location::Object(object))) => Arc::new(ModuleFile {
            id: object.id,
            region: object.region,
        }),
        other => panic!("{address:#x} is not in a file: {other:?}"),
    };
    let own = module(module_files as fn() -> _ as usize as u64);
    let libc = module(libc::getpid as unsafe extern "C" fn() -> libc::pid_t as usize as u64);
    assert_ne!(own.id, libc.id, "two different objects");
    (own, libc)
}

pub fn header(tgid: u32, comm: &str, user: bool) -> SampleHeader {
    let mut name = [0u8; COMM_LEN];
    name[..comm.len()].copy_from_slice(comm.as_bytes());
    SampleHeader {
        kind: RecordKind::Sample as u32,
        flags: if user { sample_flags::USER_REGS } else { 0 },
        tgid,
        tid: tgid,
        cpu: 0,
        kernel_stack_len: 0,
        user_stack_len: 0,
        sampling_divisor: 1,
        ktime_ns: 0,
        cgroup_id: 0,
        user_rip: 0,
        user_rsp: 0,
        user_rbp: 0,
        comm: name,
        tail_len: 0,
        tail_spans: 0,
        process_start_ns: 0,
    }
}

pub fn file(module: &Arc<ModuleFile>, file_offset: u64) -> FrameObject {
    FrameObject::File {
        file: Arc::clone(module),
        file_offset,
    }
}

/// Adds one sample with user frames `objects` (innermost first).
pub fn add(
    aggregator: &mut Aggregator,
    header: &SampleHeader,
    kernel: &[u64],
    objects: &[FrameObject],
) {
    let frames = vec![0; objects.len()];
    let walk = Walk {
        frames: &frames,
        objects,
        outcome: WalkOutcome::Ended(UnwindEnd::Outermost),
        stitched: false,
        space: None,
    };
    aggregator.add_with_metadata(header, kernel, Some(&walk));
}

/// Adding a sample as the agent does with a metadata worker that answers
/// at once: the process described first, the files the sample met opened
/// after (the label sets made before an answer have their own test).
pub trait AddWithMetadata {
    fn add_with_metadata(&mut self, header: &SampleHeader, kernel: &[u64], user: Option<&Walk<'_>>);
}

impl AddWithMetadata for Aggregator {
    fn add_with_metadata(
        &mut self,
        header: &SampleHeader,
        kernel: &[u64],
        user: Option<&Walk<'_>>,
    ) {
        // The process's record, described before the sample is added.
        let mut records = described(self, header);
        self.add(header, kernel, user, records.labels_of(header.tgid));
        for file in self.take_to_open() {
            let _ = file.open_now();
        }
    }
}

/// The labels records of the process of `header`, described as the
/// metadata worker would.
pub fn described(
    aggregator: &mut Aggregator,
    header: &SampleHeader,
) -> HashMap<u32, ProcessLabels> {
    let description = aggregator.config().describer().describe(Wanted {
        tgid: header.tgid,
        started: header.process_start_ns,
        cgroup_id: header.cgroup_id,
    });
    let mut records = HashMap::new();
    aggregator.describe(vec![description], &mut records);
    records
}

/// The node the tests' samples come from.
pub fn config() -> AggregatorConfig {
    AggregatorConfig {
        node_name: "node-a".into(),
        ..AggregatorConfig::default()
    }
}

/// Every sample of `interval` as (stack as (mapping key, address), labels, count).
pub type Flat = Vec<(Vec<(MappingKey, u64, bool)>, LabelValues, u64)>;

pub fn flatten(interval: &Interval) -> Flat {
    interval
        .samples
        .iter()
        .map(|sample| {
            let frames = interval
                .stacks
                .get(sample.stack as usize)
                .unwrap()
                .iter()
                .map(|&location| {
                    let location = interval.locations[location as usize];
                    let key = interval.mappings[location.mapping as usize].key.clone();
                    (key, location.address, location.return_address)
                })
                .collect();
            (
                frames,
                interval.label_sets[sample.label_set as usize].clone(),
                sample.count,
            )
        })
        .collect()
}
