//! Builds one `stackscope.v1.Batch` from a finished [`Interval`].
//!
//! Owns the batch's dictionaries: the string table (`""` first), mappings
//! (kernel frames split into the kernel image and its modules here, where
//! kallsyms is at hand), locations with their names, stacks, label sets and
//! samples, each deduplicated, every index into them in range. Names come
//! from the [`Symbolizer`], once per distinct location of the interval and
//! grouped by file, so a hot frame costs a cache hit per batch, not per
//! sample.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use foldhash::{HashMap, HashMapExt as _};

use stackscope_profile::model::unix_nanos;
use stackscope_proto::v1;

use super::{Interval, MappingKey, index_of, labels};
use stackscope_process_table::ObjectId;
use stackscope_symbolize::node::{FrameLine, Lines, Symbolizer, perf_map, truncate_str};

/// The longest string sent: the collector's default limit.
const MAX_STRING_BYTES: usize = 4096;

/// Mapping paths of the kernel image and of pseudo-frames, as perf names
/// the first.
const KERNEL_PATH: &str = "[kernel.kallsyms]";
const ANONYMOUS_PATH: &str = "[anonymous]";
/// The mapping JIT frames are shipped in (their names come with them).
const JIT_PATH: &str = stackscope_unwind::walker::JIT_BINARY;
/// The mapping Python frames are shipped in (their names come with them).
const PYTHON_PATH: &str = "[python]";
const VDSO_PATH: &str = "[vdso]";
/// The function (and mapping path) of the pseudo-frame that stands for the
/// stacks beyond the interval's bound.
pub const TRUNCATED: &str = "[truncated]";

/// What a batch says beyond its interval.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchOptions {
    /// Nanoseconds of CPU time one sample stands for (1e9 / frequency).
    pub sample_period_nanos: u64,
    /// Time allowed for naming the locations not in the cache; past it, the
    /// rest of the batch goes unnamed (and is named for a later batch).
    pub naming_budget: Duration,
}

impl BatchOptions {
    /// Options for sampling at `frequency_hz` (at least 1).
    pub fn for_frequency(frequency_hz: u64) -> Self {
        Self {
            sample_period_nanos: 1_000_000_000 / frequency_hz.max(1),
            naming_budget: Duration::from_secs(5),
        }
    }
}

/// Builds the batch of `interval`, naming its frames with `symbolizer`.
pub fn build_batch(
    interval: &Interval,
    symbolizer: &mut Symbolizer,
    options: &BatchOptions,
) -> v1::Batch {
    symbolizer.begin_batch(Some(Instant::now() + options.naming_budget));
    let names = name_locations(interval, symbolizer);
    let mut batch = BatchBuilder::default();

    // Locations, with their mappings as they are used.
    let mut location_remap = Vec::with_capacity(interval.locations.len());
    let mut mapping_remap: HashMap<(u32, Option<Arc<str>>), u32> = HashMap::new();
    for (location, (lines, module)) in interval.locations.iter().zip(names) {
        let mapping = match mapping_remap.get(&(location.mapping, module.clone())) {
            Some(&index) => index,
            None => {
                let index = batch.mapping(interval, location.mapping, module.as_ref(), symbolizer);
                mapping_remap.insert((location.mapping, module), index);
                index
            }
        };
        // The byte named, not the return address: the collector names
        // unnamed frames by it (see the wire format).
        location_remap.push(batch.location(mapping, location.lookup(), &lines));
    }
    symbolizer.end_batch();

    // The interval's stacks are distinct, and stay so in the batch unless
    // two of their locations became one there (named alike): only then do
    // they need looking up (a hash and a copy of each stack).
    let merged = batch.locations.len() < interval.locations.len();
    // Sized once, as the samples below: grown by doubling, the vector of a
    // busy interval's stacks was copied into fresh pages several times.
    batch.stacks.reserve_exact(interval.stacks.len());
    let stack_remap: Vec<u32> = interval
        .stacks
        .iter()
        .map(|stack| {
            let locations = stack
                .iter()
                .map(|&location| location_remap.get(location as usize).copied().unwrap_or(0))
                .collect();
            if merged {
                batch.stack(locations)
            } else {
                batch.new_stack(locations)
            }
        })
        .collect();

    let node = batch.strings.intern(&interval.node);
    let label_remap: Vec<u32> = interval
        .label_sets
        .iter()
        .map(|values| {
            let mut labels = vec![(labels::NODE, node)];
            let pid = values.pid.map(|pid| pid.to_string());
            let container = values.container.as_deref();
            let choice = &interval.labels;
            let candidates = [
                (labels::COMM, choice.comm, Some(values.comm.as_str())),
                (labels::EXE, choice.exe, Some(&*values.exe)),
                (labels::PID, choice.pid, pid.as_deref()),
                (
                    labels::CONTAINER_ID,
                    choice.container_id,
                    container.map(|c| &*c.id),
                ),
                (
                    labels::CONTAINER_NAME,
                    choice.container_name,
                    container.map(|c| &*c.name),
                ),
                (labels::POD, choice.pod, container.map(|c| &*c.pod)),
                (
                    labels::NAMESPACE,
                    choice.namespace,
                    container.map(|c| &*c.namespace),
                ),
                (
                    labels::SERVICE_NAME,
                    choice.service_name,
                    Some(labels::service_name(container, &values.exe)),
                ),
            ];
            for (name, chosen, value) in candidates {
                // An empty value is no label: a host process has no pod.
                if let Some(value) = value.filter(|v| chosen && !v.is_empty()) {
                    labels.push((name, batch.strings.intern(value)));
                }
            }
            batch.label_set(&labels)
        })
        .collect();

    batch.samples.reserve_exact(interval.samples.len());
    batch.sample_index.reserve(interval.samples.len());
    for sample in &interval.samples {
        let (Some(&stack), Some(&label_set)) = (
            stack_remap.get(sample.stack as usize),
            label_remap.get(sample.label_set as usize),
        ) else {
            continue;
        };
        batch.sample(
            stack,
            label_set,
            sample.divisor,
            sample.count,
            sample.profile_type,
        );
    }
    // Counts of off-CPU samples are nanoseconds already.
    let typed_samples = match batch.off_cpu_samples.is_empty() {
        true => Vec::new(),
        false => vec![v1::TypedSamples {
            r#type: v1::ProfileType::OffCpu.into(),
            period_nanos: 1,
            samples: batch.off_cpu_samples,
        }],
    };

    let start = unix_nanos(interval.start);
    let agent_version = batch.strings.intern(env!("CARGO_PKG_VERSION"));
    v1::Batch {
        batch_id: rand::random::<[u8; 16]>().to_vec(),
        node: Some(v1::Node {
            name: node,
            agent_version,
        }),
        start_unix_nanos: start,
        // The collector wants a non-empty window.
        end_unix_nanos: unix_nanos(interval.end).max(start + 1),
        sample_period_nanos: options.sample_period_nanos.max(1),
        strings: batch.strings.strings,
        mappings: batch.mappings,
        locations: batch.locations,
        stacks: batch.stacks,
        label_sets: batch.label_sets,
        samples: batch.samples,
        typed_samples,
    }
}

/// The names of every location of `interval` (and the kernel module of
/// kernel ones), index for index.
fn name_locations(
    interval: &Interval,
    symbolizer: &mut Symbolizer,
) -> Vec<(Lines, Option<Arc<str>>)> {
    let unnamed: Lines = Arc::new([]);
    let mut names = vec![(unnamed, None); interval.locations.len()];
    // Locations of each file (and of the vDSO) together: one lookup each.
    let mut by_mapping: HashMap<u32, Vec<usize>> = HashMap::new();
    for (index, location) in interval.locations.iter().enumerate() {
        let Some(mapping) = interval.mappings.get(location.mapping as usize) else {
            continue;
        };
        match &mapping.key {
            MappingKey::User { .. } | MappingKey::Vdso => {
                by_mapping.entry(location.mapping).or_default().push(index);
            }
            MappingKey::Kernel => {
                let frame = symbolizer.kernel(location.lookup());
                names[index] = (frame.lines, frame.module);
            }
            MappingKey::Truncated => {
                names[index].0 = Arc::new([FrameLine {
                    function: TRUNCATED.into(),
                    file: "".into(),
                    line: 0,
                }]);
            }
            MappingKey::Python { function, file } => {
                names[index].0 = Arc::new([FrameLine {
                    function: function.as_ref().into(),
                    file: file.as_ref().into(),
                    line: u32::try_from(location.address).unwrap_or(0),
                }]);
            }
            MappingKey::Jit { name } => {
                names[index].0 = Arc::new([FrameLine {
                    function: name.as_ref().into(),
                    file: "".into(),
                    line: 0,
                }]);
            }
            // Renamed when the interval ended; an interval made otherwise
            // (by hand, in tests) still ships a name.
            MappingKey::JitNotYetNamed { comm, .. } => {
                names[index].0 = Arc::new([FrameLine {
                    function: perf_map::unnamed(comm).as_ref().into(),
                    file: "".into(),
                    line: 0,
                }]);
            }
            MappingKey::Unreadable { .. } | MappingKey::Anonymous => {}
        }
    }
    let mut groups: Vec<(u32, Vec<usize>)> = by_mapping.into_iter().collect();
    // Deterministic order, so the naming budget cuts the same way each time,
    // and the mappings of one file (each process maps its own) together: a
    // file the symbolizer has no room to keep is then opened once a batch.
    let file_of = |mapping: u32| match &interval.mappings[mapping as usize].key {
        MappingKey::User { id, .. } => Some(*id),
        _ => None,
    };
    let mut first_of_file: HashMap<ObjectId, u32> = HashMap::new();
    for &(mapping, _) in &groups {
        if let Some(id) = file_of(mapping) {
            let first = first_of_file.entry(id).or_insert(mapping);
            *first = (*first).min(mapping);
        }
    }
    groups.sort_unstable_by_key(|&(mapping, _)| {
        let first = file_of(mapping).map_or(mapping, |id| first_of_file[&id]);
        (first, mapping)
    });
    for (mapping, indexes) in groups {
        let offsets: Vec<u64> = indexes
            .iter()
            .map(|&index| interval.locations[index].lookup())
            .collect();
        let found = match &interval.mappings[mapping as usize] {
            mapping if mapping.key == MappingKey::Vdso => symbolizer.vdso(&offsets),
            super::IntervalMapping {
                file: Some(file), ..
            } => symbolizer.user(file, &offsets),
            _ => continue,
        };
        for (index, lines) in indexes.into_iter().zip(found) {
            names[index].0 = lines;
        }
    }
    names
}

/// Strings by value, `""` at index 0.
struct StringTable {
    strings: Vec<String>,
    index: HashMap<String, u32>,
}

impl Default for StringTable {
    fn default() -> Self {
        Self {
            strings: vec![String::new()],
            index: [(String::new(), 0)].into_iter().collect(),
        }
    }
}

impl StringTable {
    fn intern(&mut self, text: &str) -> u32 {
        let text = truncate_str(text, MAX_STRING_BYTES);
        if let Some(&index) = self.index.get(text) {
            return index;
        }
        let index = index_of(self.strings.len());
        self.strings.push(text.to_owned());
        self.index.insert(text.to_owned(), index);
        index
    }
}

/// A location as deduplicated: mapping, address, and (function, file,
/// line) string indexes per line.
type LocationKey = (u32, u64, Vec<(u32, u32, u32)>);

/// Each dictionary with the index of every entry by value.
#[derive(Default)]
struct BatchBuilder {
    strings: StringTable,
    mappings: Vec<v1::Mapping>,
    mapping_index: HashMap<(i32, u32, u32), u32>,
    locations: Vec<v1::Location>,
    location_index: HashMap<LocationKey, u32>,
    stacks: Vec<v1::Stack>,
    stack_index: HashMap<Vec<u32>, u32>,
    label_sets: Vec<v1::LabelSet>,
    label_set_index: HashMap<Vec<(u32, u32)>, u32>,
    samples: Vec<v1::Sample>,
    /// Off-CPU samples: nanoseconds blocked.
    off_cpu_samples: Vec<v1::Sample>,
    sample_index: HashMap<(u32, u32, u32, v1::ProfileType), usize>,
}

impl BatchBuilder {
    /// The batch mapping of interval mapping `index` (of `module`, for the
    /// kernel).
    fn mapping(
        &mut self,
        interval: &Interval,
        index: u32,
        module: Option<&Arc<str>>,
        symbolizer: &mut Symbolizer,
    ) -> u32 {
        let interval_mapping = interval.mappings.get(index as usize);
        let key = interval_mapping.map(|m| &m.key);
        let (kind, build_id, path) = match key {
            Some(MappingKey::User { id, path }) => {
                let build_id = id.build_id().map(|id| id.to_string()).unwrap_or_default();
                (v1::MappingKind::User, build_id, path.clone())
            }
            Some(MappingKey::Vdso) => (
                v1::MappingKind::Vdso,
                symbolizer.vdso_build_id().unwrap_or_default().to_owned(),
                VDSO_PATH.to_owned(),
            ),
            Some(MappingKey::Kernel) => (
                v1::MappingKind::Kernel,
                symbolizer
                    .kernel_build_id(module)
                    .unwrap_or_default()
                    .to_owned(),
                module.map_or_else(|| KERNEL_PATH.to_owned(), |module| format!("[{module}]")),
            ),
            Some(MappingKey::Truncated) => (
                v1::MappingKind::Anonymous,
                String::new(),
                TRUNCATED.to_owned(),
            ),
            Some(MappingKey::Unreadable { path }) => {
                (v1::MappingKind::User, String::new(), path.to_string())
            }
            Some(MappingKey::Python { .. }) => (
                v1::MappingKind::Python,
                String::new(),
                PYTHON_PATH.to_owned(),
            ),
            Some(MappingKey::Jit { .. } | MappingKey::JitNotYetNamed { .. }) => (
                v1::MappingKind::Anonymous,
                String::new(),
                JIT_PATH.to_owned(),
            ),
            Some(MappingKey::Anonymous) | None => (
                v1::MappingKind::Anonymous,
                String::new(),
                ANONYMOUS_PATH.to_owned(),
            ),
        };
        let load_segments = match interval_mapping {
            Some(super::IntervalMapping {
                key: MappingKey::User { .. },
                file: Some(file),
            }) => symbolizer
                .code_segments(file)
                .iter()
                .map(|segment| v1::LoadSegment {
                    file_offset: segment.offset,
                    vaddr: segment.vaddr,
                    file_size: segment.file_size,
                })
                .collect(),
            _ => Vec::new(),
        };
        let mapping = v1::Mapping {
            kind: kind as i32,
            build_id: self.strings.intern(&build_id),
            path: self.strings.intern(&path),
            load_segments,
        };
        let key = (mapping.kind, mapping.build_id, mapping.path);
        if let Some(&index) = self.mapping_index.get(&key) {
            return index;
        }
        let index = index_of(self.mappings.len());
        self.mappings.push(mapping);
        self.mapping_index.insert(key, index);
        index
    }

    fn location(&mut self, mapping: u32, address: u64, lines: &[FrameLine]) -> u32 {
        let lines: Vec<(u32, u32, u32)> = lines
            .iter()
            .map(|line| {
                (
                    self.strings.intern(&line.function),
                    self.strings.intern(&line.file),
                    line.line,
                )
            })
            .collect();
        let key = (mapping, address, lines);
        if let Some(&index) = self.location_index.get(&key) {
            return index;
        }
        let index = index_of(self.locations.len());
        self.locations.push(v1::Location {
            mapping,
            address,
            lines: key
                .2
                .iter()
                .map(|&(function, file, line)| v1::Line {
                    function,
                    file,
                    line,
                })
                .collect(),
        });
        self.location_index.insert(key, index);
        index
    }

    fn stack(&mut self, locations: Vec<u32>) -> u32 {
        if let Some(&index) = self.stack_index.get(&locations) {
            return index;
        }
        let index = index_of(self.stacks.len());
        self.stacks.push(v1::Stack {
            locations: locations.clone(),
        });
        self.stack_index.insert(locations, index);
        index
    }

    /// Adds a stack known to differ from every stack added (not indexed:
    /// only [`Self::stack`] looks stacks up, and only when stacks can merge).
    fn new_stack(&mut self, locations: Vec<u32>) -> u32 {
        let index = index_of(self.stacks.len());
        self.stacks.push(v1::Stack { locations });
        index
    }

    /// `labels` as (name, value index); names are interned here.
    fn label_set(&mut self, labels: &[(&str, u32)]) -> u32 {
        let mut labels: Vec<(u32, u32)> = labels
            .iter()
            .map(|&(name, value)| (self.strings.intern(name), value))
            .collect();
        labels.sort_unstable();
        if let Some(&index) = self.label_set_index.get(&labels) {
            return index;
        }
        let index = index_of(self.label_sets.len());
        self.label_sets.push(v1::LabelSet {
            labels: labels
                .iter()
                .map(|&(name, value)| v1::Label { name, value })
                .collect(),
        });
        self.label_set_index.insert(labels, index);
        index
    }

    /// Counts merge when two interval entries became one (locations that
    /// differed only in how they were named).
    fn sample(
        &mut self,
        stack: u32,
        label_set: u32,
        divisor: u32,
        count: u64,
        profile_type: v1::ProfileType,
    ) {
        if count == 0 {
            return;
        }
        let key = (stack, label_set, divisor, profile_type);
        let samples = match profile_type {
            v1::ProfileType::Cpu | v1::ProfileType::Unspecified => &mut self.samples,
            v1::ProfileType::OffCpu => &mut self.off_cpu_samples,
        };
        match self
            .sample_index
            .get(&key)
            .and_then(|&at| samples.get_mut(at))
        {
            Some(sample) => sample.count += count,
            None => {
                self.sample_index.insert(key, samples.len());
                samples.push(v1::Sample {
                    stack,
                    label_set,
                    count,
                    sampling_divisor: divisor,
                });
            }
        }
    }
}
