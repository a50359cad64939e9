//! Ingest validation: turns a `stackscope.v1.Batch` straight off the network
//! (and, in `pprof`, the profiles applications send) into a [`ValidBatch`]
//! whose every index is in range, whose strings are resolved, whose labels
//! are well formed and whose size is bounded, so storage engines can trust
//! it. Owns the rules a batch must follow and the
//! limits that keep one batch from exhausting the collector; does not own
//! storing (see `storage`) or transport (see `server`).
//!
//! Indexes arrive as `u32`s chosen by whoever sent the batch: every one is
//! looked up with a bounds check and turned into an error that names the
//! offending item, never a panic.

pub mod otlp;
pub mod pprof;

use std::collections::HashMap;

use stackscope_profile::{
    model::{PROFILE_TYPE_LABEL, ProfileType, TimeRange},
    selector::is_valid_label_name,
};
use stackscope_proto::v1;

/// A batch that passed [`validate`]: every index refers to an item of the
/// same batch, every string is resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidBatch {
    /// The agent's id for the batch; retries reuse it.
    pub batch_id: [u8; 16],
    /// The node the batch came from (never empty).
    pub node: String,
    /// The aggregation window, non-empty, starting at or after the epoch.
    pub range: TimeRange,
    /// CPU time one sample stands for, in `1..=i64::MAX`.
    pub sample_period_nanos: u64,
    pub mappings: Vec<MappingRecord>,
    pub locations: Vec<LocationRecord>,
    /// Indexes into `locations`, leaf first; never empty.
    pub stacks: Vec<Vec<u32>>,
    /// Each set sorted by name with unique names, and always holding the
    /// label `node` = [`ValidBatch::node`]. Labels with an empty value are
    /// left out: an empty value means "absent" (as in PromQL). The sets
    /// samples of a type other than CPU use carry the label
    /// [`PROFILE_TYPE_LABEL`] with the type's name (see
    /// [`ProfileType::label_value`]): a set the batch sent is one set per
    /// type its samples have.
    pub label_sets: Vec<Vec<(String, String)>>,
    /// Per label set: nanoseconds one unit of its samples' weight stands
    /// for: the batch's sample period for CPU samples, in `1..=i64::MAX`;
    /// 1 for the other types, whose weights are stored in nanoseconds.
    pub label_set_periods: Vec<u64>,
    /// The CPU samples, then those of the other types.
    pub samples: Vec<SampleRecord>,
}

/// What a mapping's addresses are relative to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MappingKind {
    /// A file mapped into a process: addresses are file offsets.
    User,
    /// The kernel image or a module: addresses are kernel virtual addresses.
    Kernel,
    /// The vDSO: addresses are offsets into its image.
    Vdso,
    /// Memory no file backs: addresses are absolute.
    Anonymous,
    /// Interpreted code named on the node (Python functions): the lines
    /// say everything, the address is the line.
    Python,
    /// Code an application named itself (a frame of an SDK's pprof): the
    /// lines say everything; the path is the pprof mapping's file, often
    /// empty.
    Named,
}

/// A mapped binary.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MappingRecord {
    pub kind: MappingKind,
    /// Lower-case hex with an even number of digits, or empty.
    pub build_id: String,
    pub path: String,
    /// The file's executable segments (user mappings only; at most
    /// [`MAX_CODE_SEGMENTS`], none empty, none wrapping around the address
    /// space): how its file offsets become the ELF virtual addresses debug
    /// files are read by. Empty when the node did not know them.
    pub code_segments: Vec<CodeSegment>,
}

/// Most executable segments a mapping may list.
pub const MAX_CODE_SEGMENTS: usize = 16;

/// An executable `PT_LOAD` segment of a mapped file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CodeSegment {
    pub file_offset: u64,
    pub vaddr: u64,
    pub file_size: u64,
}

impl CodeSegment {
    /// The ELF virtual address of `file_offset` among `segments`, if one
    /// holds it.
    pub fn vaddr_of(segments: &[CodeSegment], file_offset: u64) -> Option<u64> {
        segments.iter().find_map(|segment| {
            let delta = file_offset.checked_sub(segment.file_offset)?;
            (delta < segment.file_size).then(|| segment.vaddr.wrapping_add(delta))
        })
    }
}

/// An address in a mapping and what the node knew about it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LocationRecord {
    /// Index into [`ValidBatch::mappings`].
    pub mapping: u32,
    pub address: u64,
    /// Innermost (inlined) first; empty when the node had no symbols.
    pub lines: Vec<LineRecord>,
}

/// One source line of a location.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LineRecord {
    /// Empty when unknown.
    pub function: String,
    /// Empty when unknown.
    pub file: String,
    /// 0 when unknown.
    pub line: u32,
}

/// Ticks of one stack with one label set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SampleRecord {
    /// Index into [`ValidBatch::stacks`].
    pub stack: u32,
    /// Index into [`ValidBatch::label_sets`].
    pub label_set: u32,
    /// Ticks recorded (at least 1) scaled by the sampling divisor; at most
    /// `i64::MAX`, so engines with signed 64-bit integers store it as is.
    pub weight: u64,
}

/// How large a batch may be. Exceeding one is reported as
/// [`BatchError::is_too_large`] so the agent can split the batch rather than
/// drop it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IngestLimits {
    pub max_samples: usize,
    pub max_stacks: usize,
    pub max_locations: usize,
    pub max_mappings: usize,
    /// Locations in one stack.
    pub max_stack_depth: usize,
    /// Lines (inlined frames) of one location.
    pub max_lines_per_location: usize,
    /// Entries of the string table.
    pub max_strings: usize,
    /// Bytes of one string.
    pub max_string_bytes: usize,
    /// Bytes of text the validated batch holds once string indexes are
    /// resolved: a small message that references one long string a million
    /// times would otherwise expand to gigabytes.
    pub max_text_bytes: usize,
    pub max_label_sets: usize,
    /// Labels of one set as sent (before the collector adds `node`).
    pub max_labels_per_set: usize,
}

impl Default for IngestLimits {
    /// Roomy for one agent's 10 s interval on a busy node (thousands of
    /// stacks tens of frames deep), far below what would hurt the collector.
    fn default() -> Self {
        Self {
            max_samples: 1_000_000,
            max_stacks: 1_000_000,
            max_locations: 1_000_000,
            max_mappings: 100_000,
            max_stack_depth: 1024,
            max_lines_per_location: 256,
            max_strings: 1_000_000,
            max_string_bytes: 4096,
            max_text_bytes: 128 << 20,
            max_label_sets: 100_000,
            max_labels_per_set: 64,
        }
    }
}

/// Why a batch was rejected. Each message names the item at fault so the
/// agent's log says what to fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BatchError {
    /// `batch_id` does not have 16 bytes.
    #[error("batch_id must be 16 bytes, got {0}")]
    BatchIdLength(usize),
    /// `node` is not set.
    #[error("node is missing")]
    MissingNode,
    /// `node.name` is the empty string.
    #[error("node name is empty")]
    EmptyNodeName,
    /// The window starts before the epoch: the agent's clock is wrong.
    #[error("start_unix_nanos is negative ({0}): the agent's clock is before 1970")]
    NegativeStart(i64),
    /// The window is empty or reversed.
    #[error("end_unix_nanos must be after start (start {start}, end {end})")]
    EmptyRange { start: i64, end: i64 },
    /// `sample_period_nanos` is 0 or does not fit in an `i64`.
    #[error("sample_period_nanos must be in 1..=9223372036854775807, got {0}")]
    SamplePeriod(u64),
    /// A list is longer than its limit.
    #[error("too many {what}: {count} > limit {limit}")]
    TooMany {
        what: &'static str,
        count: usize,
        limit: usize,
    },
    /// The string table has no entry 0.
    #[error("strings is empty: strings[0] must be the empty string")]
    NoStrings,
    /// `strings[0]` is not the empty string.
    #[error("strings[0] must be empty")]
    FirstStringNotEmpty,
    /// One string is longer than its limit.
    #[error("strings[{index}] is {len} bytes > limit {limit}")]
    StringTooLong {
        index: usize,
        len: usize,
        limit: usize,
    },
    /// A string index is past the end of the string table.
    #[error("{at}: string index {index} out of range (batch has {len} strings)")]
    StringIndex { at: String, index: u32, len: usize },
    /// The resolved strings exceed [`IngestLimits::max_text_bytes`].
    #[error("the batch's strings resolve to more than {limit} bytes of text")]
    TextTooLarge { limit: usize },
    /// A mapping's kind is `MAPPING_KIND_UNSPECIFIED`.
    #[error("mapping {index}: kind is unspecified")]
    UnspecifiedMappingKind { index: usize },
    /// A mapping's kind is not one this collector knows.
    #[error("mapping {index}: unknown kind {kind}")]
    UnknownMappingKind { index: usize, kind: i32 },
    /// A build-id that is not lower-case hex bytes.
    #[error(
        "mapping {index}: build-id {build_id:?} is not lower-case hex (an even number of [0-9a-f])"
    )]
    BadBuildId { index: usize, build_id: String },
    /// A mapping lists more code segments than [`MAX_CODE_SEGMENTS`], an
    /// empty one, one that wraps around the address space, or any on a
    /// mapping that is not a file.
    #[error("mapping {index}: {reason}")]
    BadCodeSegments { index: usize, reason: &'static str },
    /// A location's mapping index is out of range.
    #[error("location {index}: mapping index {mapping} out of range (batch has {len} mappings)")]
    MappingIndex {
        index: usize,
        mapping: u32,
        len: usize,
    },
    /// A location has more lines than [`IngestLimits::max_lines_per_location`].
    #[error("location {index}: too many lines: {count} > limit {limit}")]
    TooManyLines {
        index: usize,
        count: usize,
        limit: usize,
    },
    /// A stack without locations.
    #[error("stack {index} is empty")]
    EmptyStack { index: usize },
    /// A stack deeper than [`IngestLimits::max_stack_depth`].
    #[error("stack {index}: depth {depth} > limit {limit}")]
    StackTooDeep {
        index: usize,
        depth: usize,
        limit: usize,
    },
    /// A stack's location index is out of range.
    #[error(
        "stack {index}, frame {frame}: location index {location} out of range (batch has {len} locations)"
    )]
    LocationIndex {
        index: usize,
        frame: usize,
        location: u32,
        len: usize,
    },
    /// A label name outside `[a-zA-Z_][a-zA-Z0-9_]*`.
    #[error("label set {set}: label name {name:?} is not a valid name ([a-zA-Z_][a-zA-Z0-9_]*)")]
    BadLabelName { set: usize, name: String },
    /// A label name given twice in one set.
    #[error("label set {set}: duplicate label {name:?}")]
    DuplicateLabel { set: usize, name: String },
    /// A set with more labels than [`IngestLimits::max_labels_per_set`].
    #[error("label set {set}: too many labels: {count} > limit {limit}")]
    TooManyLabels {
        set: usize,
        count: usize,
        limit: usize,
    },
    /// A sample's stack index is out of range.
    #[error("sample {index}: stack index {stack} out of range (batch has {len} stacks)")]
    StackIndex {
        index: usize,
        stack: u32,
        len: usize,
    },
    /// A sample's label set index is out of range.
    #[error(
        "sample {index}: label set index {label_set} out of range (batch has {len} label sets)"
    )]
    LabelSetIndex {
        index: usize,
        label_set: u32,
        len: usize,
    },
    /// A label name starting with `__`: those are the collector's (such as
    /// the profile type's label).
    #[error(
        "label set {set}: label name {name:?} is reserved (names starting with __ are the collector's)"
    )]
    ReservedLabelName { set: usize, name: String },
    /// A group of typed samples that is not acceptable as a group.
    #[error("typed_samples[{group}]: {reason}")]
    BadTypedSamples { group: usize, reason: String },
    /// A sample of a typed group is not acceptable.
    #[error("typed_samples[{group}]: {source}")]
    InTypedSamples {
        group: usize,
        source: Box<BatchError>,
    },
    /// A sample with no ticks: agents leave those out.
    #[error("sample {index}: count is 0")]
    ZeroCount { index: usize },
    /// `count * sampling_divisor` does not fit in an `i64`.
    #[error("sample {index}: count {count} × sampling_divisor {divisor} does not fit in 63 bits")]
    WeightOverflow {
        index: usize,
        count: u64,
        divisor: u32,
    },
}

impl BatchError {
    /// Whether the batch broke a size limit rather than a rule: the server
    /// answers RESOURCE_EXHAUSTED (split and retry) instead of
    /// INVALID_ARGUMENT (do not retry).
    pub(crate) fn is_too_large(&self) -> bool {
        if let BatchError::InTypedSamples { source, .. } = self {
            return source.is_too_large();
        }
        matches!(
            self,
            BatchError::TooMany { .. }
                | BatchError::StringTooLong { .. }
                | BatchError::TextTooLarge { .. }
                | BatchError::TooManyLines { .. }
                | BatchError::StackTooDeep { .. }
                | BatchError::TooManyLabels { .. }
        )
    }
}

/// The label the collector sets on every label set to the batch's node.
pub(crate) const NODE_LABEL: &str = "node";

/// Checks every rule and limit of `batch` and resolves its strings.
pub fn validate(batch: v1::Batch, limits: &IngestLimits) -> Result<ValidBatch, BatchError> {
    let v1::Batch {
        batch_id,
        node,
        start_unix_nanos,
        end_unix_nanos,
        sample_period_nanos,
        strings,
        mappings,
        locations,
        stacks,
        label_sets,
        samples,
        typed_samples,
    } = batch;

    let batch_id: [u8; 16] = batch_id
        .as_slice()
        .try_into()
        .map_err(|_| BatchError::BatchIdLength(batch_id.len()))?;

    // Counts first: they are cheap and bound all the work below.
    for (what, count, limit) in [
        ("strings", strings.len(), limits.max_strings),
        ("mappings", mappings.len(), limits.max_mappings),
        ("locations", locations.len(), limits.max_locations),
        ("stacks", stacks.len(), limits.max_stacks),
        ("label sets", label_sets.len(), limits.max_label_sets),
        (
            "samples",
            typed_samples.iter().fold(samples.len(), |sum, group| {
                sum.saturating_add(group.samples.len())
            }),
            limits.max_samples,
        ),
    ] {
        if count > limit {
            return Err(BatchError::TooMany { what, count, limit });
        }
    }

    // Every reference `resolve` or `get` will follow, so the last one can
    // take its string.
    let references = node
        .iter()
        .map(|node| node.name)
        .chain(mappings.iter().flat_map(|m| [m.build_id, m.path]))
        .chain(
            locations
                .iter()
                .flat_map(|l| l.lines.iter().flat_map(|line| [line.function, line.file])),
        )
        .chain(label_sets.iter().flat_map(|set| {
            set.labels
                .iter()
                .flat_map(|label| [label.name, label.value])
        }));
    let mut text = StringTable::new(strings, references, limits)?;

    let node = node.ok_or(BatchError::MissingNode)?;
    let node_name = text.resolve(node.name, || "node.name".into())?;
    if node_name.is_empty() {
        return Err(BatchError::EmptyNodeName);
    }
    text.check(node.agent_version, || "node.agent_version".into())?;

    if start_unix_nanos < 0 {
        return Err(BatchError::NegativeStart(start_unix_nanos));
    }
    if end_unix_nanos <= start_unix_nanos {
        return Err(BatchError::EmptyRange {
            start: start_unix_nanos,
            end: end_unix_nanos,
        });
    }
    if sample_period_nanos == 0 || i64::try_from(sample_period_nanos).is_err() {
        return Err(BatchError::SamplePeriod(sample_period_nanos));
    }

    let mappings = mappings
        .into_iter()
        .enumerate()
        .map(|(index, mapping)| validate_mapping(index, &mapping, &mut text))
        .collect::<Result<Vec<_>, _>>()?;

    let locations = locations
        .into_iter()
        .enumerate()
        .map(|(index, location)| {
            validate_location(index, location, mappings.len(), limits, &mut text)
        })
        .collect::<Result<Vec<_>, _>>()?;

    let stacks = stacks
        .into_iter()
        .enumerate()
        .map(|(index, stack)| validate_stack(index, stack, locations.len(), limits))
        .collect::<Result<Vec<_>, _>>()?;

    let label_sets = label_sets
        .into_iter()
        .enumerate()
        .map(|(set, labels)| validate_label_set(set, labels, &node_name, limits, &mut text))
        .collect::<Result<Vec<_>, _>>()?;

    let mut samples = samples
        .into_iter()
        .enumerate()
        .map(|(index, sample)| validate_sample(index, sample, stacks.len(), label_sets.len()))
        .collect::<Result<Vec<_>, _>>()?;
    let mut label_sets = TypedLabelSets::new(label_sets, sample_period_nanos);
    let mut types_seen = Vec::new();
    for (group, typed) in typed_samples.into_iter().enumerate() {
        let bad = |reason: String| BatchError::BadTypedSamples { group, reason };
        let profile_type = match v1::ProfileType::try_from(typed.r#type) {
            Ok(v1::ProfileType::OffCpu) => ProfileType::OffCpu,
            Ok(v1::ProfileType::Cpu) => {
                return Err(bad("CPU samples go in samples, not typed_samples".into()));
            }
            Ok(v1::ProfileType::Unspecified) => return Err(bad("the type is unspecified".into())),
            Err(_) => return Err(bad(format!("unknown type {}", typed.r#type))),
        };
        if types_seen.contains(&profile_type) {
            return Err(bad(format!("a second group of type {profile_type}")));
        }
        types_seen.push(profile_type.clone());
        if typed.period_nanos == 0 || i64::try_from(typed.period_nanos).is_err() {
            return Err(bad(format!(
                "period_nanos must be in 1..=9223372036854775807, got {}",
                typed.period_nanos
            )));
        }
        for (index, sample) in typed.samples.into_iter().enumerate() {
            let record = validate_sample(index, sample, stacks.len(), label_sets.sent()).map_err(
                |source| BatchError::InTypedSamples {
                    group,
                    source: Box::new(source),
                },
            )?;
            // Stored in nanoseconds (period 1), whatever unit the node
            // counted in: weights from nodes with other periods then add
            // up, and every reader takes them as they are.
            let weight = record
                .weight
                .checked_mul(typed.period_nanos)
                .filter(|w| i64::try_from(*w).is_ok())
                .ok_or_else(|| {
                    bad(format!(
                        "sample {index}: {} × period_nanos {} does not fit in 63 bits",
                        record.weight, typed.period_nanos
                    ))
                })?;
            let label_set = label_sets.of_type(record.label_set, &profile_type);
            samples.push(SampleRecord {
                label_set,
                weight,
                ..record
            });
        }
    }
    label_sets.check(limits)?;
    let TypedLabelSets {
        sets: label_sets,
        periods: label_set_periods,
        ..
    } = label_sets;

    Ok(ValidBatch {
        batch_id,
        node: node_name,
        range: TimeRange {
            start_unix_nanos,
            end_unix_nanos,
        },
        sample_period_nanos,
        mappings,
        locations,
        stacks,
        label_sets,
        label_set_periods,
        samples,
    })
}

/// The batch's label sets, with a set of its own for each (set, type)
/// pair typed samples use.
struct TypedLabelSets {
    sets: Vec<Vec<(String, String)>>,
    periods: Vec<u64>,
    sent: usize,
    typed: HashMap<(u32, ProfileType), u32>,
}

impl TypedLabelSets {
    fn new(sets: Vec<Vec<(String, String)>>, cpu_period: u64) -> Self {
        Self {
            periods: vec![cpu_period; sets.len()],
            sent: sets.len(),
            sets,
            typed: HashMap::new(),
        }
    }

    /// How many sets the batch sent (typed samples index those).
    fn sent(&self) -> usize {
        self.sent
    }

    /// The index of sent set `set` with `profile_type`'s label.
    fn of_type(&mut self, set: u32, profile_type: &ProfileType) -> u32 {
        *self
            .typed
            .entry((set, profile_type.clone()))
            .or_insert_with(|| {
                let mut labels = self.sets[set as usize].clone();
                let at = labels.partition_point(|(name, _)| name.as_str() < PROFILE_TYPE_LABEL);
                labels.insert(
                    at,
                    (
                        PROFILE_TYPE_LABEL.to_owned(),
                        profile_type.label_value().to_owned(),
                    ),
                );
                self.sets.push(labels);
                // Typed weights are stored in nanoseconds.
                self.periods.push(1);
                (self.sets.len() - 1) as u32
            })
    }

    fn check(&self, limits: &IngestLimits) -> Result<(), BatchError> {
        if self.sets.len() > limits.max_label_sets {
            return Err(BatchError::TooMany {
                what: "label sets with their types",
                count: self.sets.len(),
                limit: limits.max_label_sets,
            });
        }
        Ok(())
    }
}

/// The batch's string table, resolving indexes while counting the bytes
/// handed out against [`IngestLimits::max_text_bytes`].
///
/// Most strings (function names above all) are referenced once: the last
/// reference takes the string instead of copying it, which saves an
/// allocation and a free per string on the ingest path.
struct StringTable {
    strings: Vec<String>,
    /// References to each string not resolved yet. Label references are
    /// counted but never resolved (labels are copied), so a string a label
    /// uses is never taken.
    uses: Vec<u32>,
    resolved_bytes: usize,
    max_text_bytes: usize,
}

impl StringTable {
    fn new(
        strings: Vec<String>,
        references: impl Iterator<Item = u32>,
        limits: &IngestLimits,
    ) -> Result<Self, BatchError> {
        match strings.first() {
            None => return Err(BatchError::NoStrings),
            Some(first) if !first.is_empty() => return Err(BatchError::FirstStringNotEmpty),
            Some(_) => {}
        }
        if let Some((index, s)) = strings
            .iter()
            .enumerate()
            .find(|(_, s)| s.len() > limits.max_string_bytes)
        {
            return Err(BatchError::StringTooLong {
                index,
                len: s.len(),
                limit: limits.max_string_bytes,
            });
        }
        let mut uses = vec![0u32; strings.len()];
        for index in references {
            // Out-of-range indexes are reported when they are resolved.
            if let Some(count) = usize::try_from(index).ok().and_then(|i| uses.get_mut(i)) {
                *count = count.saturating_add(1);
            }
        }
        Ok(Self {
            strings,
            uses,
            resolved_bytes: 0,
            max_text_bytes: limits.max_text_bytes,
        })
    }

    /// Where `index` is in the table; `at` names the field for the error
    /// message and is only built when the index is bad.
    fn position(&self, index: u32, at: impl FnOnce() -> String) -> Result<usize, BatchError> {
        usize::try_from(index)
            .ok()
            .filter(|&i| i < self.strings.len())
            .ok_or_else(|| BatchError::StringIndex {
                at: at(),
                index,
                len: self.strings.len(),
            })
    }

    /// The string at `index`, for references counted as never resolved.
    fn get(&self, index: u32, at: impl FnOnce() -> String) -> Result<&str, BatchError> {
        let i = self.position(index, at)?;
        Ok(self.strings.get(i).map_or("", String::as_str))
    }

    fn check(&self, index: u32, at: impl FnOnce() -> String) -> Result<(), BatchError> {
        self.position(index, at).map(|_| ())
    }

    /// The string at `index` (taken on its last counted reference, else
    /// copied), counted against the text budget.
    fn resolve(&mut self, index: u32, at: impl FnOnce() -> String) -> Result<String, BatchError> {
        let i = self.position(index, at)?;
        let (Some(s), Some(uses)) = (self.strings.get_mut(i), self.uses.get_mut(i)) else {
            return Ok(String::new());
        };
        *uses = uses.saturating_sub(1);
        let s = if *uses == 0 {
            std::mem::take(s)
        } else {
            s.clone()
        };
        self.charge(s.len())?;
        Ok(s)
    }

    /// Counts `bytes` of copied text against the budget.
    fn charge(&mut self, bytes: usize) -> Result<(), BatchError> {
        self.resolved_bytes = self.resolved_bytes.saturating_add(bytes);
        if self.resolved_bytes > self.max_text_bytes {
            return Err(BatchError::TextTooLarge {
                limit: self.max_text_bytes,
            });
        }
        Ok(())
    }
}

fn validate_mapping(
    index: usize,
    mapping: &v1::Mapping,
    text: &mut StringTable,
) -> Result<MappingRecord, BatchError> {
    let kind = match v1::MappingKind::try_from(mapping.kind) {
        Ok(v1::MappingKind::Unspecified) => {
            return Err(BatchError::UnspecifiedMappingKind { index });
        }
        Ok(v1::MappingKind::User) => MappingKind::User,
        Ok(v1::MappingKind::Kernel) => MappingKind::Kernel,
        Ok(v1::MappingKind::Vdso) => MappingKind::Vdso,
        Ok(v1::MappingKind::Anonymous) => MappingKind::Anonymous,
        Ok(v1::MappingKind::Python) => MappingKind::Python,
        Ok(v1::MappingKind::Named) => MappingKind::Named,
        Err(_) => {
            return Err(BatchError::UnknownMappingKind {
                index,
                kind: mapping.kind,
            });
        }
    };
    let build_id = text.resolve(mapping.build_id, || format!("mapping {index}: build_id"))?;
    // Build-ids are bytes; storage and debuginfod key on their canonical
    // lower-case hex spelling, so any other spelling would split one binary
    // into two.
    let is_hex = build_id
        .bytes()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    if !is_hex || build_id.len() % 2 != 0 {
        return Err(BatchError::BadBuildId { index, build_id });
    }
    let path = text.resolve(mapping.path, || format!("mapping {index}: path"))?;
    let bad = |reason| BatchError::BadCodeSegments { index, reason };
    if mapping.load_segments.len() > MAX_CODE_SEGMENTS {
        return Err(bad("more than 16 code segments"));
    }
    if kind != MappingKind::User && !mapping.load_segments.is_empty() {
        return Err(bad("code segments on a mapping that is not a file"));
    }
    let mut code_segments = Vec::with_capacity(mapping.load_segments.len());
    for segment in &mapping.load_segments {
        if segment.file_size == 0 {
            return Err(bad("an empty code segment"));
        }
        if segment.file_offset.checked_add(segment.file_size).is_none()
            || segment.vaddr.checked_add(segment.file_size).is_none()
        {
            return Err(bad("a code segment past the end of the address space"));
        }
        code_segments.push(CodeSegment {
            file_offset: segment.file_offset,
            vaddr: segment.vaddr,
            file_size: segment.file_size,
        });
    }
    Ok(MappingRecord {
        kind,
        build_id,
        path,
        code_segments,
    })
}

fn validate_location(
    index: usize,
    location: v1::Location,
    mappings: usize,
    limits: &IngestLimits,
    text: &mut StringTable,
) -> Result<LocationRecord, BatchError> {
    if usize::try_from(location.mapping).map_or(true, |m| m >= mappings) {
        return Err(BatchError::MappingIndex {
            index,
            mapping: location.mapping,
            len: mappings,
        });
    }
    if location.lines.len() > limits.max_lines_per_location {
        return Err(BatchError::TooManyLines {
            index,
            count: location.lines.len(),
            limit: limits.max_lines_per_location,
        });
    }
    let lines = location
        .lines
        .iter()
        .enumerate()
        .map(|(line_index, line)| {
            Ok(LineRecord {
                function: text.resolve(line.function, || {
                    format!("location {index}, line {line_index}: function")
                })?,
                file: text.resolve(line.file, || {
                    format!("location {index}, line {line_index}: file")
                })?,
                line: line.line,
            })
        })
        .collect::<Result<Vec<_>, BatchError>>()?;
    Ok(LocationRecord {
        mapping: location.mapping,
        address: location.address,
        lines,
    })
}

fn validate_stack(
    index: usize,
    stack: v1::Stack,
    locations: usize,
    limits: &IngestLimits,
) -> Result<Vec<u32>, BatchError> {
    if stack.locations.is_empty() {
        return Err(BatchError::EmptyStack { index });
    }
    if stack.locations.len() > limits.max_stack_depth {
        return Err(BatchError::StackTooDeep {
            index,
            depth: stack.locations.len(),
            limit: limits.max_stack_depth,
        });
    }
    if let Some((frame, &location)) = stack
        .locations
        .iter()
        .enumerate()
        .find(|(_, l)| usize::try_from(**l).map_or(true, |l| l >= locations))
    {
        return Err(BatchError::LocationIndex {
            index,
            frame,
            location,
            len: locations,
        });
    }
    Ok(stack.locations)
}

fn validate_label_set(
    set: usize,
    labels: v1::LabelSet,
    node: &str,
    limits: &IngestLimits,
    text: &mut StringTable,
) -> Result<Vec<(String, String)>, BatchError> {
    if labels.labels.len() > limits.max_labels_per_set {
        return Err(BatchError::TooManyLabels {
            set,
            count: labels.labels.len(),
            limit: limits.max_labels_per_set,
        });
    }
    let mut resolved = Vec::with_capacity(labels.labels.len() + 1);
    for (label_index, label) in labels.labels.iter().enumerate() {
        let name = text.get(label.name, || {
            format!("label set {set}, label {label_index}: name")
        })?;
        if !is_valid_label_name(name) {
            return Err(BatchError::BadLabelName {
                set,
                name: name.to_owned(),
            });
        }
        if name.starts_with("__") {
            return Err(BatchError::ReservedLabelName {
                set,
                name: name.to_owned(),
            });
        }
        let value = text.get(label.value, || {
            format!("label set {set}, label {label_index}: value")
        })?;
        resolved.push((name, value));
    }
    resolved.sort_unstable_by(|a, b| a.0.cmp(b.0));
    if let Some(pair) = resolved.windows(2).find(|pair| pair[0].0 == pair[1].0) {
        return Err(BatchError::DuplicateLabel {
            set,
            name: pair[0].0.to_owned(),
        });
    }
    // The node label is the collector's word, not the agent's: a sent one is
    // replaced so a misconfigured agent cannot pose as another node.
    resolved.retain(|(name, value)| *name != NODE_LABEL && !value.is_empty());
    let at = resolved.partition_point(|(name, _)| *name < NODE_LABEL);
    resolved.insert(at, (NODE_LABEL, node));
    let labels: Vec<(String, String)> = resolved
        .into_iter()
        .map(|(name, value)| (name.to_owned(), value.to_owned()))
        .collect();
    text.charge(labels.iter().map(|(n, v)| n.len() + v.len()).sum())?;
    Ok(labels)
}

fn validate_sample(
    index: usize,
    sample: v1::Sample,
    stacks: usize,
    label_sets: usize,
) -> Result<SampleRecord, BatchError> {
    if usize::try_from(sample.stack).map_or(true, |s| s >= stacks) {
        return Err(BatchError::StackIndex {
            index,
            stack: sample.stack,
            len: stacks,
        });
    }
    if usize::try_from(sample.label_set).map_or(true, |s| s >= label_sets) {
        return Err(BatchError::LabelSetIndex {
            index,
            label_set: sample.label_set,
            len: label_sets,
        });
    }
    if sample.count == 0 {
        return Err(BatchError::ZeroCount { index });
    }
    // 0 and 1 both mean "every tick was recorded".
    let weight = sample
        .count
        .checked_mul(u64::from(sample.sampling_divisor.max(1)))
        .filter(|w| i64::try_from(*w).is_ok())
        .ok_or(BatchError::WeightOverflow {
            index,
            count: sample.count,
            divisor: sample.sampling_divisor,
        })?;
    Ok(SampleRecord {
        stack: sample.stack,
        label_set: sample.label_set,
        weight,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small valid batch: strings
    /// `["", "node-a", "abcd01", "/usr/lib/libfoo.so", "main", "main.c", "comm", "app", "v1"]`,
    /// one user mapping, two locations, two stacks, two label sets, two
    /// samples.
    fn batch() -> v1::Batch {
        v1::Batch {
            batch_id: (0..16).collect(),
            node: Some(v1::Node {
                name: 1,
                agent_version: 8,
            }),
            start_unix_nanos: 1_000,
            end_unix_nanos: 2_000,
            sample_period_nanos: 10_000_000,
            strings: [
                "",
                "node-a",
                "abcd01",
                "/usr/lib/libfoo.so",
                "main",
                "main.c",
                "comm",
                "app",
                "v1",
            ]
            .map(String::from)
            .to_vec(),
            mappings: vec![v1::Mapping {
                kind: v1::MappingKind::User as i32,
                build_id: 2,
                path: 3,
                load_segments: vec![v1::LoadSegment {
                    file_offset: 0x1000,
                    vaddr: 0x401000,
                    file_size: 0x2000,
                }],
            }],
            locations: vec![
                v1::Location {
                    mapping: 0,
                    address: 0x1a2b,
                    lines: vec![],
                },
                v1::Location {
                    mapping: 0,
                    address: 0x10,
                    lines: vec![v1::Line {
                        function: 4,
                        file: 5,
                        line: 7,
                    }],
                },
            ],
            stacks: vec![
                v1::Stack {
                    locations: vec![0, 1],
                },
                v1::Stack { locations: vec![1] },
            ],
            label_sets: vec![
                v1::LabelSet {
                    labels: vec![v1::Label { name: 6, value: 7 }],
                },
                v1::LabelSet { labels: vec![] },
            ],
            samples: vec![
                v1::Sample {
                    stack: 0,
                    label_set: 0,
                    count: 3,
                    sampling_divisor: 0,
                },
                v1::Sample {
                    stack: 1,
                    label_set: 1,
                    count: 2,
                    sampling_divisor: 4,
                },
            ],
            typed_samples: Vec::new(),
        }
    }

    /// The message of the error `validate` returns for `batch` changed by `f`.
    fn error(f: impl FnOnce(&mut v1::Batch)) -> String {
        error_with(&IngestLimits::default(), f)
    }

    fn error_with(limits: &IngestLimits, f: impl FnOnce(&mut v1::Batch)) -> String {
        let mut b = batch();
        f(&mut b);
        match validate(b, limits) {
            Ok(_) => panic!("the batch was accepted"),
            Err(err) => err.to_string(),
        }
    }

    fn push_string(b: &mut v1::Batch, s: &str) -> u32 {
        b.strings.push(s.to_owned());
        u32::try_from(b.strings.len() - 1).expect("small test table")
    }

    #[test]
    fn valid_batch() {
        let valid = validate(batch(), &IngestLimits::default()).expect("valid");
        let expected = ValidBatch {
            batch_id: std::array::from_fn(|i| i as u8),
            node: "node-a".into(),
            range: TimeRange {
                start_unix_nanos: 1_000,
                end_unix_nanos: 2_000,
            },
            sample_period_nanos: 10_000_000,
            mappings: vec![MappingRecord {
                kind: MappingKind::User,
                build_id: "abcd01".into(),
                path: "/usr/lib/libfoo.so".into(),
                code_segments: vec![CodeSegment {
                    file_offset: 0x1000,
                    vaddr: 0x401000,
                    file_size: 0x2000,
                }],
            }],
            locations: vec![
                LocationRecord {
                    mapping: 0,
                    address: 0x1a2b,
                    lines: vec![],
                },
                LocationRecord {
                    mapping: 0,
                    address: 0x10,
                    lines: vec![LineRecord {
                        function: "main".into(),
                        file: "main.c".into(),
                        line: 7,
                    }],
                },
            ],
            stacks: vec![vec![0, 1], vec![1]],
            label_sets: vec![
                vec![
                    ("comm".into(), "app".into()),
                    ("node".into(), "node-a".into()),
                ],
                vec![("node".into(), "node-a".into())],
            ],
            label_set_periods: vec![10_000_000; 2],
            samples: vec![
                SampleRecord {
                    stack: 0,
                    label_set: 0,
                    weight: 3,
                },
                SampleRecord {
                    stack: 1,
                    label_set: 1,
                    weight: 8,
                },
            ],
        };
        assert_eq!(valid, expected);
    }

    fn off_cpu(samples: Vec<v1::Sample>) -> v1::TypedSamples {
        v1::TypedSamples {
            r#type: v1::ProfileType::OffCpu as i32,
            period_nanos: 1,
            samples,
        }
    }

    fn sample(stack: u32, label_set: u32, count: u64) -> v1::Sample {
        v1::Sample {
            stack,
            label_set,
            count,
            sampling_divisor: 0,
        }
    }

    #[test]
    fn typed_samples_get_label_sets_of_their_own() {
        let mut b = batch();
        // Set 0 holds CPU ticks too; set 1 is used twice.
        b.typed_samples = vec![off_cpu(vec![
            sample(1, 0, 5_000),
            sample(0, 1, 7_000),
            sample(1, 1, 2_000),
        ])];
        let valid = validate(b, &IngestLimits::default()).expect("valid");
        assert_eq!(
            valid.label_sets[2..],
            [
                vec![
                    ("__type__".to_owned(), "off_cpu".to_owned()),
                    ("comm".into(), "app".into()),
                    ("node".into(), "node-a".into()),
                ],
                vec![
                    ("__type__".to_owned(), "off_cpu".to_owned()),
                    ("node".into(), "node-a".into()),
                ],
            ]
        );
        assert_eq!(valid.label_set_periods, [10_000_000, 10_000_000, 1, 1]);
        let typed: Vec<_> = valid.samples[2..]
            .iter()
            .map(|s| (s.stack, s.label_set, s.weight))
            .collect();
        assert_eq!(typed, [(1, 2, 5_000), (0, 3, 7_000), (1, 3, 2_000)]);

        // Counted in microseconds by the node: stored in nanoseconds.
        let mut b = batch();
        let mut group = off_cpu(vec![sample(1, 0, 5)]);
        group.period_nanos = 1_000;
        b.typed_samples = vec![group];
        let valid = validate(b, &IngestLimits::default()).expect("valid");
        assert_eq!(valid.samples[2].weight, 5_000);
        assert_eq!(valid.label_set_periods[2], 1);
    }

    #[test]
    fn bad_typed_samples_are_refused_with_their_group() {
        type Change = fn(&mut v1::Batch);
        let cases: [(Change, &str); 7] = [
            (
                |b| {
                    b.typed_samples = vec![off_cpu(vec![sample(0, 0, 1)])];
                    b.typed_samples[0].r#type = v1::ProfileType::Cpu as i32;
                },
                "typed_samples[0]: CPU samples go in samples, not typed_samples",
            ),
            (
                |b| {
                    b.typed_samples = vec![off_cpu(vec![sample(0, 0, 1)])];
                    b.typed_samples[0].r#type = 99;
                },
                "typed_samples[0]: unknown type 99",
            ),
            (
                |b| b.typed_samples = vec![off_cpu(vec![]), off_cpu(vec![])],
                "typed_samples[1]: a second group of type off_cpu",
            ),
            (
                |b| {
                    b.typed_samples = vec![off_cpu(vec![sample(0, 0, 1)])];
                    b.typed_samples[0].period_nanos = 0;
                },
                "typed_samples[0]: period_nanos must be in 1..=9223372036854775807, got 0",
            ),
            (
                |b| b.typed_samples = vec![off_cpu(vec![sample(0, 9, 1)])],
                "typed_samples[0]: sample 0: label set index 9 out of range (batch has 2 label sets)",
            ),
            (
                |b| b.typed_samples = vec![off_cpu(vec![sample(0, 0, 0)])],
                "typed_samples[0]: sample 0: count is 0",
            ),
            (
                |b| {
                    b.typed_samples = vec![off_cpu(vec![sample(0, 0, 1 << 40)])];
                    b.typed_samples[0].period_nanos = 1 << 30;
                },
                "typed_samples[0]: sample 0: 1099511627776 × period_nanos 1073741824 does not fit \
                 in 63 bits",
            ),
        ];
        for (change, message) in cases {
            assert_eq!(error(change), message);
        }
        // Every sample counts against the limit, whatever its type.
        let limits = IngestLimits {
            max_samples: 3,
            ..IngestLimits::default()
        };
        assert_eq!(
            error_with(&limits, |b| {
                b.typed_samples = vec![off_cpu(vec![sample(0, 0, 1), sample(1, 1, 1)])];
            }),
            "too many samples: 4 > limit 3"
        );
    }

    #[test]
    fn label_names_starting_with_two_underscores_are_the_collectors() {
        let message = error(|b| {
            let name = push_string(b, "__type__");
            let value = push_string(b, "cpu");
            b.label_sets[1].labels = vec![v1::Label { name, value }];
        });
        assert_eq!(
            message,
            "label set 1: label name \"__type__\" is reserved (names starting with __ are the \
             collector's)"
        );
    }

    #[test]
    fn sent_node_label_is_replaced_and_empty_values_dropped() {
        let mut b = batch();
        let node = push_string(&mut b, "node");
        let liar = push_string(&mut b, "node-b");
        let zone = push_string(&mut b, "zone");
        let pod = push_string(&mut b, "pod");
        b.label_sets[0].labels = vec![
            v1::Label {
                name: zone,
                value: 7,
            },
            v1::Label {
                name: node,
                value: liar,
            },
            v1::Label {
                name: pod,
                value: 0,
            },
            v1::Label { name: 6, value: 7 },
        ];
        let valid = validate(b, &IngestLimits::default()).expect("valid");
        let labels: Vec<(&str, &str)> = valid.label_sets[0]
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        assert_eq!(
            labels,
            [("comm", "app"), ("node", "node-a"), ("zone", "app")]
        );
    }

    /// Strings are moved out of the table on their last reference only:
    /// every other reference still reads them.
    #[test]
    fn shared_strings_resolve_everywhere() {
        let mut b = batch();
        // "app" (7) is also a label value; "main" (4) now names two lines
        // and a mapping path.
        b.locations[0].lines = vec![
            v1::Line {
                function: 7,
                file: 4,
                line: 1,
            },
            v1::Line {
                function: 4,
                file: 5,
                line: 2,
            },
        ];
        b.mappings.push(v1::Mapping {
            kind: v1::MappingKind::Anonymous as i32,
            build_id: 0,
            path: 4,
            load_segments: Vec::new(),
        });
        let valid = validate(b, &IngestLimits::default()).expect("valid");
        let lines: Vec<(&str, &str)> = valid.locations[0]
            .lines
            .iter()
            .chain(&valid.locations[1].lines)
            .map(|l| (l.function.as_str(), l.file.as_str()))
            .collect();
        assert_eq!(
            lines,
            [("app", "main"), ("main", "main.c"), ("main", "main.c")]
        );
        assert_eq!(valid.mappings[1].path, "main");
        assert_eq!(valid.label_sets[0][0], ("comm".into(), "app".into()));
    }

    #[test]
    fn batch_id_length() {
        assert_eq!(
            error(|b| b.batch_id = vec![1, 2, 3]),
            "batch_id must be 16 bytes, got 3"
        );
    }

    #[test]
    fn missing_node() {
        assert_eq!(error(|b| b.node = None), "node is missing");
    }

    #[test]
    fn empty_node_name() {
        assert_eq!(
            error(|b| b.node = Some(v1::Node::default())),
            "node name is empty"
        );
    }

    #[test]
    fn negative_start() {
        assert_eq!(
            error(|b| b.start_unix_nanos = -5),
            "start_unix_nanos is negative (-5): the agent's clock is before 1970"
        );
    }

    #[test]
    fn empty_range() {
        assert_eq!(
            error(|b| b.end_unix_nanos = 1_000),
            "end_unix_nanos must be after start (start 1000, end 1000)"
        );
    }

    #[test]
    fn sample_period() {
        assert_eq!(
            error(|b| b.sample_period_nanos = 0),
            "sample_period_nanos must be in 1..=9223372036854775807, got 0"
        );
        assert_eq!(
            error(|b| b.sample_period_nanos = u64::MAX),
            "sample_period_nanos must be in 1..=9223372036854775807, got 18446744073709551615"
        );
    }

    #[test]
    fn too_many() {
        let limits = IngestLimits {
            max_samples: 1,
            ..IngestLimits::default()
        };
        let mut b = batch();
        let samples = b.samples.clone();
        b.samples.extend(samples);
        let err = validate(b, &limits).expect_err("too many");
        assert_eq!(err.to_string(), "too many samples: 4 > limit 1");
        assert!(err.is_too_large());

        let limits = IngestLimits {
            max_strings: 3,
            ..IngestLimits::default()
        };
        assert_eq!(error_with(&limits, |_| {}), "too many strings: 9 > limit 3");
    }

    #[test]
    fn string_table() {
        assert_eq!(
            error(|b| b.strings.clear()),
            "strings is empty: strings[0] must be the empty string"
        );
        assert_eq!(
            error(|b| b.strings[0] = "x".into()),
            "strings[0] must be empty"
        );
        let limits = IngestLimits {
            max_string_bytes: 5,
            ..IngestLimits::default()
        };
        assert_eq!(
            error_with(&limits, |_| {}),
            "strings[1] is 6 bytes > limit 5"
        );
    }

    #[test]
    fn string_index() {
        assert_eq!(
            error(|b| b.mappings[0].path = 900),
            "mapping 0: path: string index 900 out of range (batch has 9 strings)"
        );
        assert_eq!(
            error(|b| b.locations[1].lines[0].file = u32::MAX),
            "location 1, line 0: file: string index 4294967295 out of range (batch has 9 strings)"
        );
        assert_eq!(
            error(|b| b.label_sets[0].labels[0].value = 9),
            "label set 0, label 0: value: string index 9 out of range (batch has 9 strings)"
        );
        assert_eq!(
            error(|b| b.node = Some(v1::Node {
                name: 1,
                agent_version: 10
            })),
            "node.agent_version: string index 10 out of range (batch has 9 strings)"
        );
    }

    #[test]
    fn text_budget() {
        let limits = IngestLimits {
            max_text_bytes: 40,
            ..IngestLimits::default()
        };
        let err = {
            let mut b = batch();
            // One 18-byte path referenced by three mappings: 6 + 3 × (6 + 18) bytes.
            b.mappings = vec![b.mappings[0].clone(); 3];
            validate(b, &limits).expect_err("too much text")
        };
        assert_eq!(
            err.to_string(),
            "the batch's strings resolve to more than 40 bytes of text"
        );
        assert!(err.is_too_large());
    }

    #[test]
    fn code_segments() {
        let valid = validate(batch(), &IngestLimits::default()).expect("valid");
        let segments = &valid.mappings[0].code_segments;
        assert_eq!(CodeSegment::vaddr_of(segments, 0x1000), Some(0x401000));
        assert_eq!(CodeSegment::vaddr_of(segments, 0x2fff), Some(0x402fff));
        assert_eq!(CodeSegment::vaddr_of(segments, 0x3000), None);
        assert_eq!(CodeSegment::vaddr_of(segments, 0xfff), None);
        let segment = |file_offset, vaddr, file_size| v1::LoadSegment {
            file_offset,
            vaddr,
            file_size,
        };
        assert_eq!(
            error(|b| b.mappings[0].load_segments = vec![segment(0, 0, 1); 17]),
            "mapping 0: more than 16 code segments"
        );
        assert_eq!(
            error(|b| b.mappings[0].load_segments = vec![segment(0x1000, 0x1000, 0)]),
            "mapping 0: an empty code segment"
        );
        assert_eq!(
            error(|b| b.mappings[0].load_segments = vec![segment(u64::MAX, 0, 2)]),
            "mapping 0: a code segment past the end of the address space"
        );
        assert_eq!(
            error(|b| b.mappings[0].kind = v1::MappingKind::Kernel as i32),
            "mapping 0: code segments on a mapping that is not a file"
        );
    }

    #[test]
    fn mapping_kind() {
        assert_eq!(
            error(|b| b.mappings[0].kind = v1::MappingKind::Unspecified as i32),
            "mapping 0: kind is unspecified"
        );
        assert_eq!(
            error(|b| b.mappings[0].kind = 77),
            "mapping 0: unknown kind 77"
        );
    }

    #[test]
    fn build_id() {
        for bad in ["ABCD", "abc", "xyz0"] {
            assert_eq!(
                error(|b| b.mappings[0].build_id = push_string(b, bad)),
                format!(
                    "mapping 0: build-id {bad:?} is not lower-case hex (an even number of [0-9a-f])"
                )
            );
        }
        let mut b = batch();
        b.mappings[0].build_id = 0;
        let valid = validate(b, &IngestLimits::default()).expect("no build-id is fine");
        assert_eq!(valid.mappings[0].build_id, "");
    }

    #[test]
    fn mapping_index() {
        assert_eq!(
            error(|b| b.locations[1].mapping = 1),
            "location 1: mapping index 1 out of range (batch has 1 mappings)"
        );
    }

    #[test]
    fn too_many_lines() {
        let limits = IngestLimits {
            max_lines_per_location: 1,
            ..IngestLimits::default()
        };
        let err = {
            let mut b = batch();
            let line = b.locations[1].lines[0];
            b.locations[1].lines.push(line);
            validate(b, &limits).expect_err("too many lines")
        };
        assert_eq!(err.to_string(), "location 1: too many lines: 2 > limit 1");
        assert!(err.is_too_large());
    }

    #[test]
    fn empty_stack() {
        assert_eq!(error(|b| b.stacks[1].locations.clear()), "stack 1 is empty");
    }

    #[test]
    fn stack_too_deep() {
        let err = {
            let mut b = batch();
            b.stacks[0].locations = vec![0; 1025];
            validate(b, &IngestLimits::default()).expect_err("too deep")
        };
        assert_eq!(err.to_string(), "stack 0: depth 1025 > limit 1024");
        assert!(err.is_too_large());
    }

    #[test]
    fn location_index() {
        assert_eq!(
            error(|b| b.stacks[0].locations[1] = 2),
            "stack 0, frame 1: location index 2 out of range (batch has 2 locations)"
        );
    }

    #[test]
    fn label_name() {
        for bad in ["1bad", "", "a-b", "é"] {
            let message = error(|b| b.label_sets[0].labels[0].name = push_string(b, bad));
            assert_eq!(
                message,
                format!(
                    "label set 0: label name {bad:?} is not a valid name ([a-zA-Z_][a-zA-Z0-9_]*)"
                )
            );
        }
    }

    #[test]
    fn duplicate_label() {
        assert_eq!(
            error(|b| {
                b.label_sets[1].labels = vec![
                    v1::Label { name: 6, value: 7 },
                    v1::Label { name: 6, value: 1 },
                ];
            }),
            "label set 1: duplicate label \"comm\""
        );
    }

    #[test]
    fn too_many_labels() {
        let err = {
            let mut b = batch();
            b.label_sets[1].labels = (0..65)
                .map(|i| {
                    let name = push_string(&mut b, &format!("l{i}"));
                    v1::Label { name, value: 7 }
                })
                .collect();
            validate(b, &IngestLimits::default()).expect_err("too many labels")
        };
        assert_eq!(
            err.to_string(),
            "label set 1: too many labels: 65 > limit 64"
        );
        assert!(err.is_too_large());
    }

    #[test]
    fn stack_index() {
        let message = error(|b| b.samples[1].stack = 900);
        assert_eq!(
            message,
            "sample 1: stack index 900 out of range (batch has 2 stacks)"
        );
    }

    #[test]
    fn label_set_index() {
        assert_eq!(
            error(|b| b.samples[0].label_set = u32::MAX),
            "sample 0: label set index 4294967295 out of range (batch has 2 label sets)"
        );
    }

    #[test]
    fn zero_count() {
        assert_eq!(error(|b| b.samples[1].count = 0), "sample 1: count is 0");
    }

    #[test]
    fn weight_overflow() {
        assert_eq!(
            error(|b| b.samples[1].count = u64::MAX / 2),
            "sample 1: count 9223372036854775807 × sampling_divisor 4 does not fit in 63 bits"
        );
        assert_eq!(
            error(|b| b.samples[0].count = 1 << 63),
            "sample 0: count 9223372036854775808 × sampling_divisor 0 does not fit in 63 bits"
        );
    }

    #[test]
    fn rule_errors_are_not_too_large() {
        let err = validate(
            v1::Batch {
                batch_id: vec![0; 2],
                ..batch()
            },
            &IngestLimits::default(),
        )
        .expect_err("bad id");
        assert!(!err.is_too_large());
    }

    /// Arbitrary indexes and counts never panic: a small deterministic
    /// generator flips fields of the valid batch to random values.
    #[test]
    fn random_indexes_do_not_panic() {
        use rand::{Rng as _, SeedableRng as _, rngs::StdRng};
        let mut rng = StdRng::seed_from_u64(0x9e37_79b9_7f4a_7c15);
        let mut next = move || rng.random::<u64>();
        for _ in 0..20_000 {
            let mut b = batch();
            let small = |x: u64| (x % 12) as u32;
            match next() % 10 {
                0 => b.mappings[0].kind = (next() % 7) as i32 - 1,
                1 => b.locations[(next() % 2) as usize].mapping = small(next()),
                2 => b.stacks[0].locations[(next() % 2) as usize] = small(next()),
                3 => b.samples[0].stack = small(next()),
                4 => b.samples[1].label_set = small(next()),
                5 => b.label_sets[0].labels[0].name = small(next()),
                6 => b.locations[1].lines[0].function = small(next()),
                7 => b.samples[1].count = next(),
                8 => b.samples[1].sampling_divisor = next() as u32,
                _ => {
                    b.start_unix_nanos = next() as i64;
                    b.end_unix_nanos = next() as i64;
                }
            }
            let _ = validate(b, &IngestLimits::default());
        }
    }
}
