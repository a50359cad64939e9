//! One record per process in the run loop's process table
//! ([`ProcessRecord`]): beside the mappings the table keeps, what the
//! walker knows of the process (its modules, identity and copy size), what
//! its labels are made of (exe, container), its CPython interpreter
//! (with the code objects read and the Python stacks waiting for walks)
//! and the samples it had (for the run's report). A
//! sample finds it with the one lookup its walk makes and hands it to the
//! aggregator with the walk ([`WalkSink::add_walked`]); it goes when the table lets go
//! of the process (exit, exec, pid reuse, the table's bound), all of it at
//! once.

use stackscope_metadata::process::ProcessLabels;
use stackscope_process_table::ProcessTable;
use stackscope_unwind::walker::{ProcessState, Walked, WalkerRecord};

use super::{jvm::JvmRecord, off_cpu::OffCpuWeights};
use crate::aggregate::{Aggregator, LabelRecords, PythonSample, SampleWeight};
use stackscope_python::{PythonRecord, PythonState};
use stackscope_telemetry::tally::{Counted, ProcessTally};

/// See the module documentation.
#[derive(Debug, Default)]
pub(super) struct ProcessRecord {
    walker: ProcessState,
    pub labels: ProcessLabels,
    pub python: PythonRecord,
    pub jvm: JvmRecord,
    pub samples: Counted,
}

impl ProcessRecord {
    /// The process's start time, as its samples said (0: unknown).
    pub fn started(&self) -> u64 {
        self.walker.started()
    }
}

impl WalkerRecord for ProcessRecord {
    fn walker_state(&self) -> &ProcessState {
        &self.walker
    }

    fn walker_state_mut(&mut self) -> &mut ProcessState {
        &mut self.walker
    }
}

impl LabelRecords for ProcessTable<ProcessRecord> {
    fn labels_of(&mut self, tgid: u32) -> Option<&mut ProcessLabels> {
        self.state_of_mut(tgid).map(|record| &mut record.labels)
    }
}

/// What the walks add to: the interval's aggregate, and the tally of
/// processes whose record went first.
#[derive(Debug)]
pub(super) struct WalkSink {
    pub aggregator: Aggregator,
    pub tally: ProcessTally,
    /// The weights of off-CPU samples, put there at their switch-in.
    pub off_cpu: OffCpuWeights,
}

impl WalkSink {
    /// Counts each walk the walker delivers, under its process's labels,
    /// its Python frames merged in when its sample came with them, and in
    /// its process's record (in the tally when the record went first).
    pub fn add_walked(&mut self) -> impl FnMut(Walked<'_, ProcessRecord>) + '_ {
        let Self {
            aggregator,
            tally,
            off_cpu,
        } = self;
        move |walked| {
            let weight = if walked.header.flags & agent_common::sample_flags::OFF_CPU == 0 {
                SampleWeight::Tick
            } else {
                // An off-CPU sample whose weight is gone: no time to count.
                let Some(nanos) = off_cpu.take(walked.header) else {
                    return;
                };
                SampleWeight::OffCpu { nanos }
            };
            let Some(ProcessRecord {
                labels,
                python,
                samples,
                ..
            }) = walked.record
            else {
                tally.add_other();
                aggregator.add_with_python(
                    walked.header,
                    walked.kernel_frames,
                    Some(&walked.walk),
                    None,
                    None,
                    weight,
                );
                return;
            };
            // The report's samples per process are ticks.
            if weight == SampleWeight::Tick {
                samples.add(|| agent_common::comm_str(&walked.header.comm));
            }
            let PythonRecord::Found(state) = python else {
                aggregator.add_with_python(
                    walked.header,
                    walked.kernel_frames,
                    Some(&walked.walk),
                    Some(labels),
                    None,
                    weight,
                );
                return;
            };
            let stack = state.take_stack(walked.header);
            let PythonState { eval, codes, .. } = &mut **state;
            let python = stack.as_ref().map(|stack| PythonSample {
                frames: &stack.frames,
                cut: stack.cut,
                eval,
                codes,
            });
            aggregator.add_with_python(
                walked.header,
                walked.kernel_frames,
                Some(&walked.walk),
                Some(labels),
                python,
                weight,
            );
        }
    }
}
