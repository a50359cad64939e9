//! Test batches and helpers shared by the storage tests of every engine
//! (`storage.rs` for SQLite, `clickhouse.rs`): batches built the way an
//! agent builds them, validated by `ingest::validate`, and the expected
//! weights and frames they give. Each test binary uses a part of it.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};

use stackscope_collector::ingest::{self, IngestLimits, ValidBatch};
use stackscope_profile::model::{
    Frame, LabelMatcher, MatchOp, ProfileType, Selection, StackSamples, TimeRange, WeightedStack,
};
use stackscope_proto::v1;

pub const SECOND: i64 = 1_000_000_000;
pub const MINUTE: i64 = 60 * SECOND;
pub const DAY: i64 = 24 * 60 * MINUTE;
/// A multiple of 120 s, so 60 s buckets and 120 s series steps align on it.
pub const T0: i64 = 1_700_000_040 * SECOND;
pub const PERIOD_100HZ: u64 = 10_000_000;
pub const PERIOD_99HZ: u64 = 10_101_010;

/// Builds a wire batch the way an agent does: a string table and
/// dictionaries indexed from 0.
pub struct Builder {
    pub batch: v1::Batch,
    strings: HashMap<String, u32>,
}

impl Builder {
    pub fn new(id: u8, node: &str, start: i64, period: u64) -> Self {
        let mut builder = Self {
            batch: v1::Batch {
                batch_id: vec![id; 16],
                start_unix_nanos: start,
                end_unix_nanos: start + 10 * SECOND,
                sample_period_nanos: period,
                strings: vec![String::new()],
                ..v1::Batch::default()
            },
            strings: HashMap::from([(String::new(), 0)]),
        };
        let name = builder.s(node);
        let agent_version = builder.s("0.1.0");
        builder.batch.node = Some(v1::Node {
            name,
            agent_version,
        });
        builder
    }

    pub fn s(&mut self, s: &str) -> u32 {
        if let Some(&index) = self.strings.get(s) {
            return index;
        }
        let index = u32::try_from(self.batch.strings.len()).expect("small table");
        self.batch.strings.push(s.to_owned());
        self.strings.insert(s.to_owned(), index);
        index
    }

    pub fn index(len: usize) -> u32 {
        u32::try_from(len).expect("small batch")
    }

    pub fn mapping(&mut self, kind: v1::MappingKind, build_id: &str, path: &str) -> u32 {
        let (build_id, path) = (self.s(build_id), self.s(path));
        self.batch.mappings.push(v1::Mapping {
            kind: kind as i32,
            build_id,
            path,
            load_segments: Vec::new(),
        });
        Self::index(self.batch.mappings.len() - 1)
    }

    pub fn location(&mut self, mapping: u32, address: u64, lines: &[(&str, &str, u32)]) -> u32 {
        let lines = lines
            .iter()
            .map(|&(function, file, line)| v1::Line {
                function: self.s(function),
                file: self.s(file),
                line,
            })
            .collect();
        self.batch.locations.push(v1::Location {
            mapping,
            address,
            lines,
        });
        Self::index(self.batch.locations.len() - 1)
    }

    pub fn stack(&mut self, locations: &[u32]) -> u32 {
        self.batch.stacks.push(v1::Stack {
            locations: locations.to_vec(),
        });
        Self::index(self.batch.stacks.len() - 1)
    }

    pub fn label_set(&mut self, labels: &[(&str, &str)]) -> u32 {
        let labels = labels
            .iter()
            .map(|&(name, value)| v1::Label {
                name: self.s(name),
                value: self.s(value),
            })
            .collect();
        self.batch.label_sets.push(v1::LabelSet { labels });
        Self::index(self.batch.label_sets.len() - 1)
    }

    pub fn sample(&mut self, stack: u32, label_set: u32, count: u64, sampling_divisor: u32) {
        self.batch.samples.push(v1::Sample {
            stack,
            label_set,
            count,
            sampling_divisor,
        });
    }

    /// Adds an off-CPU sample of `nanos` blocked (in the batch's one
    /// off-CPU group, made on first use).
    pub fn off_cpu_sample(&mut self, stack: u32, label_set: u32, nanos: u64) {
        let group = match self
            .batch
            .typed_samples
            .iter()
            .position(|group| group.r#type == v1::ProfileType::OffCpu as i32)
        {
            Some(group) => group,
            None => {
                self.batch.typed_samples.push(v1::TypedSamples {
                    r#type: v1::ProfileType::OffCpu as i32,
                    period_nanos: 1,
                    samples: Vec::new(),
                });
                self.batch.typed_samples.len() - 1
            }
        };
        self.batch.typed_samples[group].samples.push(v1::Sample {
            stack,
            label_set,
            count: nanos,
            sampling_divisor: 1,
        });
    }

    /// Adds the three test stacks (in reverse when `reverse`, so batches
    /// disagree on indexes but not on content) and returns their indexes
    /// as `[S0, S1, S2]`:
    ///
    /// * S0 = `[unknown] libfoo.so+0x1a2b` <- `inlined_helper` (inlined) <- `work` <- `main`
    /// * S1 = `inlined_helper` (inlined) <- `work` <- `main`
    /// * S2 = `do_syscall_64` ([kernel]) <- `main`
    pub fn standard_stacks(&mut self, reverse: bool) -> [u32; 3] {
        if reverse {
            let s2 = self.standard_stack(2);
            let s1 = self.standard_stack(1);
            let s0 = self.standard_stack(0);
            [s0, s1, s2]
        } else {
            [0, 1, 2].map(|which| self.standard_stack(which))
        }
    }

    /// Adds S0, S1 or S2 with its own copies of the mappings and locations
    /// it shares with the others: storage must merge identical items
    /// within a batch too.
    pub fn standard_stack(&mut self, which: usize) -> u32 {
        let app = self.mapping(v1::MappingKind::User, "", "/usr/bin/app");
        let main = self.location(app, 0x200, &[("main", "app.c", 20)]);
        let work_lines = [("inlined_helper", "util.h", 3), ("work", "app.c", 10)];
        match which {
            0 => {
                let libfoo = self.mapping(v1::MappingKind::User, "abcd01", "/usr/lib/libfoo.so");
                let unknown = self.location(libfoo, 0x1a2b, &[]);
                let work = self.location(app, 0x100, &work_lines);
                self.stack(&[unknown, work, main])
            }
            1 => {
                let work = self.location(app, 0x100, &work_lines);
                self.stack(&[work, main])
            }
            _ => {
                let kernel = self.mapping(v1::MappingKind::Kernel, "", "vmlinux");
                let syscall =
                    self.location(kernel, 0xffff_ffff_8100_0000, &[("do_syscall_64", "", 0)]);
                self.stack(&[syscall, main])
            }
        }
    }

    pub fn validate(self) -> ValidBatch {
        ingest::validate(self.batch, &IngestLimits::default()).expect("a valid batch")
    }
}

pub const S0: &str = "[unknown] libfoo.so+0x1a2b;inlined_helper;work;main";
pub const S1: &str = "inlined_helper;work;main";
pub const S2: &str = "do_syscall_64;main";

/// B1: node-a, bucket T0: (comm=app) S0 ×5, S1 ×3; (comm=worker) S2 ×7.
pub fn batch1() -> ValidBatch {
    let mut b = Builder::new(1, "node-a", T0, PERIOD_100HZ);
    let [s0, s1, s2] = b.standard_stacks(false);
    let app = b.label_set(&[("comm", "app"), ("exe", "/usr/bin/app")]);
    let worker = b.label_set(&[("exe", "/usr/bin/app"), ("comm", "worker")]);
    b.sample(s0, app, 5, 0);
    b.sample(s1, app, 3, 1);
    b.sample(s2, worker, 7, 0);
    b.validate()
}

/// B2: node-a, bucket T0 + 60 s: (comm=app) S0 ×2.
pub fn batch2() -> ValidBatch {
    let mut b = Builder::new(2, "node-a", T0 + MINUTE, PERIOD_100HZ);
    let [s0, _, _] = b.standard_stacks(true);
    let app = b.label_set(&[("comm", "app"), ("exe", "/usr/bin/app")]);
    b.sample(s0, app, 2, 0);
    b.validate()
}

/// B3: node-b at 99 Hz, bucket T0: (comm=app, exe=/usr/bin/other) S1 ×11,
/// S2 ×13. Sends its own `node` label, which the collector replaces.
pub fn batch3() -> ValidBatch {
    let mut b = Builder::new(3, "node-b", T0 + 15 * SECOND, PERIOD_99HZ);
    let [_, s1, s2] = b.standard_stacks(true);
    let app = b.label_set(&[
        ("comm", "app"),
        ("exe", "/usr/bin/other"),
        ("node", "spoofed"),
    ]);
    b.sample(s1, app, 11, 0);
    b.sample(s2, app, 13, 0);
    b.validate()
}

/// A label matcher as (name, op, value).
pub type Matcher<'a> = (&'a str, MatchOp, &'a str);

pub fn select(start: i64, end: i64, matchers: &[Matcher<'_>]) -> Selection {
    Selection {
        range: TimeRange {
            start_unix_nanos: start,
            end_unix_nanos: end,
        },
        matchers: matchers
            .iter()
            .map(|&(name, op, value)| LabelMatcher::new(name, op, value).expect("matcher"))
            .collect(),
        profile_type: ProfileType::Cpu,
    }
}

/// Everything ingested in these tests.
pub fn all(matchers: &[Matcher<'_>]) -> Selection {
    select(T0 - 3600 * SECOND, T0 + 3600 * SECOND, matchers)
}

/// A stack as its frames' functions, leaf first.
pub fn name(stack: &WeightedStack) -> String {
    stack
        .frames
        .iter()
        .map(|f| f.function.as_str())
        .collect::<Vec<_>>()
        .join(";")
}

/// Weights per stack by [`name`].
pub fn folded(samples: &StackSamples) -> BTreeMap<String, u64> {
    let mut folded = BTreeMap::new();
    for stack in &samples.stacks {
        let name = name(stack);
        assert!(
            folded.insert(name.clone(), stack.weight).is_none(),
            "stack {name} returned twice"
        );
    }
    folded
}

pub fn expect(pairs: &[(&str, u64)]) -> BTreeMap<String, u64> {
    pairs.iter().map(|&(k, v)| (k.to_owned(), v)).collect()
}

pub fn frame(
    function: &str,
    binary: &str,
    build_id: &str,
    file: &str,
    line: u32,
    inlined: bool,
) -> Frame {
    Frame {
        function: function.into(),
        binary: binary.into(),
        build_id: build_id.into(),
        file: file.into(),
        line,
        inlined,
        unnamed_code: None,
    }
}

/// A batch of `node` at `start` with the three standard stacks weighted by
/// `seed`, under one of two label sets.
pub fn fleet_batch(id: u8, node: &str, start: i64, period: u64, seed: u64) -> ValidBatch {
    let mut b = Builder::new(id, node, start, period);
    let stacks = b.standard_stacks(seed.is_multiple_of(2));
    let comm = if seed.is_multiple_of(3) {
        "app"
    } else {
        "worker"
    };
    let labels = b.label_set(&[("comm", comm)]);
    for (i, stack) in stacks.into_iter().enumerate() {
        let weight = 1 + (seed >> (4 * i)) % 13;
        if weight != 7 {
            b.sample(stack, labels, weight, 0);
        }
        // Off-CPU time on some stacks: fleet-wide CPU answers (rollups
        // among them) leave it out.
        if weight % 4 == 1 {
            b.off_cpu_sample(stack, labels, weight * 1_000_000);
        }
    }
    b.validate()
}

/// A seeded generator (xorshift64), so a test's random choices repeat.
pub fn seeded(mut state: u64) -> impl FnMut() -> u64 {
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    }
}
