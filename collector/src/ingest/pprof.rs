//! Profiles applications send: pprof profiles from Pyroscope's SDKs (in a
//! `push.v1` push or the body of `/ingest`), each with its series' labels,
//! turned into one [`ValidBatch`] that storage takes whole or not at all.
//!
//! Owns how an SDK's profile becomes stored samples: every pprof sample
//! type is a profile type named by its Pyroscope id (`memory:alloc_space:
//! bytes:space:bytes`), except CPU time in nanoseconds
//! (`process_cpu:cpu:nanoseconds:cpu:nanoseconds`, or CPU samples counted,
//! `process_cpu:samples:count:cpu:nanoseconds`, in a profile without it),
//! which is stored as the agents' CPU samples are, ticks of the profile's
//! period, so Grafana and our own queries see an application's CPU beside
//! a node's. Frames are
//! the pprof's functions and lines; an address no line names is kept as
//! the agents' unnamed frames are (file offset and build-id, for
//! debuginfo to name later). Labels are Pyroscope's: the series' labels,
//! `__name__` naming the profile, and the pprof samples' string labels.
//!
//! Everything here is untrusted input: indexes are bounds-checked, sizes
//! are bounded (decompressed bytes first), and a bad profile refuses the
//! whole request with an error that names it.

use std::{collections::HashMap, io::Read as _, sync::Arc};

use prost::Message as _;
use stackscope_profile::{
    model::{PROFILE_TYPE_LABEL, ProfileType, PyroscopeTypeId, TimeRange},
    selector::is_valid_label_name,
};
use stackscope_proto::pprof;
use xxhash_rust::xxh3::Xxh3;

use super::{
    BatchError, IngestLimits, LineRecord, LocationRecord, MappingKind, MappingRecord, NODE_LABEL,
    SampleRecord, ValidBatch,
};

/// One profile as an application sent it.
#[derive(Debug, Clone)]
pub struct SentProfile {
    /// The series' labels as sent: `__name__` names the profile
    /// (`process_cpu`, `memory`), `service_name` the application. Shared by
    /// the profiles of one series.
    pub labels: Arc<[(String, String)]>,
    /// The pprof profile, gzipped or not.
    pub pprof: Vec<u8>,
    /// The time the profile covers when the request says (`/ingest`'s
    /// `from` and `until`); otherwise the profile's own time and duration.
    pub window: Option<TimeRange>,
}

/// Most profiles one request may hold: each costs a decode and a hash
/// whatever its size.
pub const MAX_PROFILES_PER_REQUEST: usize = 10_000;

/// Why sent profiles were refused; nothing of the request was stored.
#[derive(Debug, thiserror::Error)]
pub enum SentProfileError {
    #[error("the request holds no profile")]
    NoProfile,
    #[error("the request holds {0} profiles, more than the {MAX_PROFILES_PER_REQUEST} taken")]
    TooManyProfiles(usize),
    /// A profile is not a pprof profile, or breaks one of pprof's rules.
    #[error("profile {index}: {reason}")]
    Malformed { index: usize, reason: String },
    /// The profiles, once decompressed, are larger than the collector
    /// takes in one request (`index` is the one that went past).
    #[error("profile {index}: the request's profiles are larger than {limit} bytes decompressed")]
    TooLarge { index: usize, limit: usize },
    /// The profiles together exceed one of the ingest limits.
    #[error(transparent)]
    Limits(#[from] BatchError),
}

impl SentProfileError {
    /// Whether the request was refused for its size (the sender should
    /// send less at once), not for what it holds.
    pub fn is_too_large(&self) -> bool {
        match self {
            Self::TooLarge { .. } | Self::TooManyProfiles(_) => true,
            Self::Limits(err) => err.is_too_large(),
            Self::NoProfile | Self::Malformed { .. } => false,
        }
    }
}

/// The name of a profile whose series has no `__name__` (`/ingest`
/// requests), from what its samples measure: Pyroscope's names where it
/// has them.
fn default_profile_name(profile: &pprof::Profile, strings: &Strings<'_>) -> String {
    let period = profile
        .period_type
        .as_ref()
        .and_then(|t| strings.get(t.r#type).ok())
        .unwrap_or("");
    let first_sample = profile
        .sample_type
        .first()
        .and_then(|t| strings.get(t.r#type).ok())
        .unwrap_or("");
    match (period, first_sample) {
        ("cpu", _) | (_, "cpu") => "process_cpu".to_owned(),
        (_, kind) if kind.starts_with("alloc_") || kind.starts_with("inuse_") => {
            "memory".to_owned()
        }
        ("", kind) => kind.to_owned(),
        (period, _) => period.to_owned(),
    }
}

/// Label names as the query language takes them: a character it does not
/// (`.` in `otel.scope.name`) becomes `_`, as Prometheus does.
fn sanitized_label_name(name: &str) -> String {
    let mut out: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    if out.starts_with(|c: char| c.is_ascii_digit()) {
        out.insert(0, '_');
    }
    out
}

/// The labels a stored set gets from sent ones: names sanitized, the
/// collector's names (`__…`, and `node`, which is the agents' word for
/// where a sample was taken) left out, empty values left out (absent).
fn stored_labels<'a>(
    sent: impl IntoIterator<Item = (&'a str, &'a str)>,
    into: &mut Vec<(String, String)>,
    limits: &IngestLimits,
) -> Result<(), String> {
    for (name, value) in sent {
        if value.is_empty() {
            continue;
        }
        // Sanitized first: `.._type__` would become the collector's own.
        let name = sanitized_label_name(name);
        if name.starts_with("__") || name == NODE_LABEL || !is_valid_label_name(&name) {
            continue;
        }
        if name.len() + value.len() > limits.max_string_bytes {
            return Err(format!(
                "label {name} has {} bytes, more than the {} taken",
                name.len() + value.len(),
                limits.max_string_bytes
            ));
        }
        // A later value of the same name (a sample's label over its
        // series') wins.
        match into.iter_mut().find(|(n, _)| *n == name) {
            Some((_, v)) => *v = value.to_owned(),
            None => into.push((name, value.to_owned())),
        }
    }
    if into.len() > limits.max_labels_per_set {
        return Err(format!(
            "{} labels, more than the {} taken",
            into.len(),
            limits.max_labels_per_set
        ));
    }
    Ok(())
}

/// A pprof string table, every index checked.
struct Strings<'a>(&'a [String]);

impl<'a> Strings<'a> {
    fn get(&self, index: i64) -> Result<&'a str, String> {
        usize::try_from(index)
            .ok()
            .and_then(|i| self.0.get(i))
            .map(String::as_str)
            .ok_or_else(|| {
                format!(
                    "string index {index} out of range (string table has {})",
                    self.0.len()
                )
            })
    }
}

/// Decompresses (when gzipped: pprof's own files are) and decodes a pprof
/// profile of at most `limit` bytes; returns it with its size.
fn decode_pprof(bytes: &[u8], limit: usize) -> Result<(pprof::Profile, usize), DecodeError> {
    let decompressed;
    let plain = if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(bytes)
            .take(limit as u64 + 1)
            .read_to_end(&mut out)
            .map_err(|err| DecodeError::Malformed(format!("gzip: {err}")))?;
        decompressed = out;
        &decompressed[..]
    } else {
        bytes
    };
    if plain.len() > limit {
        return Err(DecodeError::TooLarge);
    }
    pprof::Profile::decode(plain)
        .map(|profile| (profile, plain.len()))
        .map_err(|err| DecodeError::Malformed(format!("pprof: {err}")))
}

enum DecodeError {
    Malformed(String),
    TooLarge,
}

/// How one pprof sample type is stored.
struct StoredType {
    profile_type: ProfileType,
    /// CPU: nanoseconds per tick (the profile's period); 0 otherwise.
    tick_nanos: u64,
    /// How many of the sample type's units make one stored unit (CPU
    /// nanoseconds: the period; counts: 1).
    units_per_tick: u64,
}

/// How far apart in time the profiles of one request may be.
const MAX_REQUEST_SPAN_NANOS: i64 = 15 * 60 * 1_000_000_000;

/// CPU samples counted, each worth the period.
const CPU_SAMPLES_ID: &str = "process_cpu:samples:count:cpu:nanoseconds";

/// Where the batch's items are numbered: each distinct item once.
#[derive(Default)]
struct BatchBuilder {
    mappings: Vec<MappingRecord>,
    mapping_ids: HashMap<MappingRecord, u32>,
    locations: Vec<LocationRecord>,
    location_ids: HashMap<LocationRecord, u32>,
    stacks: Vec<Vec<u32>>,
    stack_ids: HashMap<Vec<u32>, u32>,
    label_sets: Vec<Vec<(String, String)>>,
    label_set_periods: Vec<u64>,
    label_set_ids: HashMap<(Vec<(String, String)>, u64), u32>,
    weights: HashMap<(u32, u32), u64>,
    range: Option<TimeRange>,
    text_bytes: usize,
}

fn intern<T: Clone + Eq + std::hash::Hash>(
    items: &mut Vec<T>,
    ids: &mut HashMap<T, u32>,
    item: T,
) -> u32 {
    *ids.entry(item).or_insert_with_key(|item| {
        items.push(item.clone());
        (items.len() - 1) as u32
    })
}

impl BatchBuilder {
    fn mapping(&mut self, mapping: MappingRecord) -> u32 {
        intern(&mut self.mappings, &mut self.mapping_ids, mapping)
    }

    fn location(&mut self, location: LocationRecord) -> u32 {
        intern(&mut self.locations, &mut self.location_ids, location)
    }

    fn stack(&mut self, stack: Vec<u32>) -> u32 {
        intern(&mut self.stacks, &mut self.stack_ids, stack)
    }

    /// The set of `labels` (sorted, unique names) for samples of `stored`;
    /// a new set counts against the limits on sets and on text.
    fn label_set(
        &mut self,
        labels: &[(String, String)],
        stored: &StoredType,
        limits: &IngestLimits,
    ) -> Result<u32, String> {
        let mut set = labels.to_vec();
        if stored.profile_type != ProfileType::Cpu {
            set.push((
                PROFILE_TYPE_LABEL.to_owned(),
                stored.profile_type.label_value().to_owned(),
            ));
        }
        set.sort_unstable();
        // CPU weights are ticks of the profile's period; the others are
        // stored in their unit.
        let period = stored.tick_nanos.max(1);
        let key = (set, period);
        if let Some(&id) = self.label_set_ids.get(&key) {
            return Ok(id);
        }
        if self.label_sets.len() >= limits.max_label_sets {
            return Err(BatchError::TooMany {
                what: "label sets",
                count: self.label_sets.len() + 1,
                limit: limits.max_label_sets,
            }
            .to_string());
        }
        let bytes: usize = key.0.iter().map(|(n, v)| n.len() + v.len()).sum();
        self.charge_text(bytes, limits)?;
        self.label_sets.push(key.0.clone());
        self.label_set_periods.push(period);
        let id = (self.label_sets.len() - 1) as u32;
        self.label_set_ids.insert(key, id);
        Ok(id)
    }

    /// Counts `bytes` of text against [`IngestLimits::max_text_bytes`].
    fn charge_text(&mut self, bytes: usize, limits: &IngestLimits) -> Result<(), String> {
        self.text_bytes = self.text_bytes.saturating_add(bytes);
        if self.text_bytes > limits.max_text_bytes {
            return Err(BatchError::TextTooLarge {
                limit: limits.max_text_bytes,
            }
            .to_string());
        }
        Ok(())
    }

    fn add_weight(&mut self, stack: u32, label_set: u32, weight: u64) -> Result<(), String> {
        let sum = self.weights.entry((stack, label_set)).or_default();
        *sum = sum
            .checked_add(weight)
            .filter(|w| i64::try_from(*w).is_ok())
            .ok_or("a stack's summed value does not fit in 63 bits")?;
        Ok(())
    }

    /// Adds a profile's time to the batch's. A batch's samples are stored
    /// at its start, so profiles of one request must be of about the same
    /// time.
    fn cover(&mut self, window: TimeRange) -> Result<(), String> {
        let range = match self.range {
            None => window,
            Some(range) => TimeRange {
                start_unix_nanos: range.start_unix_nanos.min(window.start_unix_nanos),
                end_unix_nanos: range.end_unix_nanos.max(window.end_unix_nanos),
            },
        };
        if range.end_unix_nanos - range.start_unix_nanos > MAX_REQUEST_SPAN_NANOS {
            return Err(format!(
                "the request's profiles span more than {} minutes: send profiles of other \
                 times in requests of their own",
                MAX_REQUEST_SPAN_NANOS / 60_000_000_000
            ));
        }
        self.range = Some(range);
        Ok(())
    }
}

/// Turns the profiles of one request into one batch (its id a hash of
/// what was sent, so a request sent again is stored once). `max_bytes`
/// bounds the profiles decompressed, all together (a small request of many
/// small gzip bombs is refused as one large one is); `now` stands for a
/// profile that says nothing of its time.
pub fn sent_profiles_batch(
    profiles: &[SentProfile],
    limits: &IngestLimits,
    max_bytes: usize,
    now_unix_nanos: i64,
) -> Result<ValidBatch, SentProfileError> {
    if profiles.is_empty() {
        return Err(SentProfileError::NoProfile);
    }
    if profiles.len() > MAX_PROFILES_PER_REQUEST {
        return Err(SentProfileError::TooManyProfiles(profiles.len()));
    }
    let mut builder = BatchBuilder::default();
    let mut id = Xxh3::new();
    let mut budget = max_bytes;
    for (index, sent) in profiles.iter().enumerate() {
        let (profile, size) = decode_pprof(&sent.pprof, budget).map_err(|err| match err {
            DecodeError::Malformed(reason) => SentProfileError::Malformed { index, reason },
            DecodeError::TooLarge => SentProfileError::TooLarge {
                index,
                limit: max_bytes,
            },
        })?;
        budget -= size;
        let window = add_profile(&mut builder, sent, &profile, limits, now_unix_nanos)
            .map_err(|reason| SentProfileError::Malformed { index, reason })?;
        for (name, value) in sent.labels.iter() {
            id.update(&(name.len() as u64).to_le_bytes());
            id.update(name.as_bytes());
            id.update(&(value.len() as u64).to_le_bytes());
            id.update(value.as_bytes());
        }
        // The time used, not the time sent: two profiles that say none,
        // sent a minute apart, are two.
        id.update(&window.start_unix_nanos.to_le_bytes());
        id.update(&window.end_unix_nanos.to_le_bytes());
        id.update(&(sent.pprof.len() as u64).to_le_bytes());
        id.update(&sent.pprof);
    }
    let BatchBuilder {
        mappings,
        locations,
        stacks,
        label_sets,
        label_set_periods,
        weights,
        range,
        ..
    } = builder;
    for (what, count, limit) in [
        ("mappings", mappings.len(), limits.max_mappings),
        ("locations", locations.len(), limits.max_locations),
        ("stacks", stacks.len(), limits.max_stacks),
        ("label sets", label_sets.len(), limits.max_label_sets),
        ("samples", weights.len(), limits.max_samples),
    ] {
        if count > limit {
            return Err(BatchError::TooMany { what, count, limit }.into());
        }
    }
    let mut samples: Vec<SampleRecord> = weights
        .into_iter()
        .map(|((stack, label_set), weight)| SampleRecord {
            stack,
            label_set,
            weight,
        })
        .collect();
    samples.sort_unstable_by_key(|s| (s.label_set, s.stack));
    let range = range.ok_or(SentProfileError::NoProfile)?;
    Ok(ValidBatch {
        batch_id: id.digest128().to_le_bytes(),
        // Applications are not nodes: their sets carry no node label.
        node: String::new(),
        range,
        sample_period_nanos: label_set_periods.iter().copied().max().unwrap_or(1),
        mappings,
        locations,
        stacks,
        label_sets,
        label_set_periods,
        samples,
    })
}

/// Adds one decoded profile's samples to the batch; returns the time it
/// covers.
fn add_profile(
    builder: &mut BatchBuilder,
    sent: &SentProfile,
    profile: &pprof::Profile,
    limits: &IngestLimits,
    now_unix_nanos: i64,
) -> Result<TimeRange, String> {
    let strings = Strings(&profile.string_table);
    match profile.string_table.first() {
        Some(first) if first.is_empty() => {}
        _ => return Err("the string table must start with the empty string".into()),
    }
    if let Some((index, s)) = profile
        .string_table
        .iter()
        .enumerate()
        .find(|(_, s)| s.len() > limits.max_string_bytes)
    {
        return Err(format!(
            "string {index} has {} bytes, more than the {} taken",
            s.len(),
            limits.max_string_bytes
        ));
    }

    // The profile's name and the series' labels.
    let name = sent
        .labels
        .iter()
        .find(|(n, _)| n == "__name__")
        .map(|(_, v)| v.clone())
        .unwrap_or_else(|| default_profile_name(profile, &strings));
    let mut series_labels = Vec::new();
    stored_labels(
        sent.labels.iter().map(|(n, v)| (n.as_str(), v.as_str())),
        &mut series_labels,
        limits,
    )
    .map_err(|reason| format!("the series' labels: {reason}"))?;

    // What each sample type is stored as.
    let (period_type, period_unit) = match &profile.period_type {
        Some(t) => (strings.get(t.r#type)?, strings.get(t.unit)?),
        None => ("", ""),
    };
    let mut ids = Vec::with_capacity(profile.sample_type.len());
    for sample_type in &profile.sample_type {
        let sample = (
            strings.get(sample_type.r#type)?,
            strings.get(sample_type.unit)?,
        );
        ids.push(
            PyroscopeTypeId::from_parts(&name, sample, (period_type, period_unit))
                .map_err(|err| err.to_string())?,
        );
    }
    // CPU time is the agents' CPU type, in ticks of the profile's period:
    // nanoseconds divided by it, or, when the profile counts samples alone
    // (OTel's eBPF profiler), the counts as they are.
    let has_cpu_time = ids.iter().any(|id| id.as_str() == ProfileType::CPU_ID);
    let types: Vec<StoredType> = ids
        .into_iter()
        .map(|id| {
            // Units of the sample type per tick: nanoseconds per period,
            // or one sample counted.
            let per_tick = match id.as_str() {
                ProfileType::CPU_ID => Some(profile.period),
                CPU_SAMPLES_ID if !has_cpu_time => Some(1),
                _ => None,
            };
            if let Some(per_tick) = per_tick {
                return if profile.period > 0 {
                    Ok(StoredType {
                        profile_type: ProfileType::Cpu,
                        tick_nanos: profile.period as u64,
                        units_per_tick: per_tick as u64,
                    })
                } else {
                    Err(format!(
                        "{}: CPU samples need the profile's period, and it is {}",
                        id.as_str(),
                        profile.period
                    ))
                };
            }
            // Off-CPU time by its id is the agents' off-CPU type.
            Ok(StoredType {
                profile_type: ProfileType::from_name(id.as_str()).unwrap_or(ProfileType::Sent(id)),
                tick_nanos: 0,
                units_per_tick: 1,
            })
        })
        .collect::<Result<_, String>>()?;
    if types.is_empty() {
        return Err("the profile has no sample types".into());
    }

    // The time it covers.
    let window = match sent.window {
        Some(window) => window,
        None => {
            let duration = profile.duration_nanos.max(1);
            let start = if profile.time_nanos > 0 {
                profile.time_nanos
            } else {
                now_unix_nanos.saturating_sub(duration)
            };
            TimeRange {
                start_unix_nanos: start,
                end_unix_nanos: start.saturating_add(duration),
            }
        }
    };
    if window.start_unix_nanos < 0 || window.end_unix_nanos <= window.start_unix_nanos {
        return Err(format!(
            "the profile's time is not a range after 1970 ({}..{} ns)",
            window.start_unix_nanos, window.end_unix_nanos
        ));
    }
    builder.cover(window)?;

    // Mappings and functions by id, then each location once.
    let mappings: HashMap<u64, &pprof::Mapping> =
        profile.mapping.iter().map(|m| (m.id, m)).collect();
    let functions: HashMap<u64, &pprof::Function> =
        profile.function.iter().map(|f| (f.id, f)).collect();
    let mut location_ids: HashMap<u64, u32> = HashMap::with_capacity(profile.location.len());
    for location in &profile.location {
        let (mapping, record) = location_record(location, &mappings, &functions, &strings, limits)?;
        let bytes = record
            .lines
            .iter()
            .map(|line| line.function.len() + line.file.len())
            .sum();
        builder.charge_text(bytes, limits)?;
        let mapping = builder.mapping(mapping);
        let id = builder.location(LocationRecord { mapping, ..record });
        if location_ids.insert(location.id, id).is_some() {
            return Err(format!("location id {} appears twice", location.id));
        }
    }
    let no_stack = || {
        (
            MappingRecord {
                kind: MappingKind::Named,
                build_id: String::new(),
                path: String::new(),
                code_segments: Vec::new(),
            },
            LineRecord {
                function: "[no stack]".to_owned(),
                file: String::new(),
                line: 0,
            },
        )
    };

    let mut labels = Vec::new();
    let mut series_sets: Vec<Option<u32>> = vec![None; types.len()];
    for (index, sample) in profile.sample.iter().enumerate() {
        if sample.value.len() != types.len() {
            return Err(format!(
                "sample {index} has {} values for {} sample types",
                sample.value.len(),
                types.len()
            ));
        }
        if sample.location_id.len() > limits.max_stack_depth {
            return Err(format!(
                "sample {index} is {} frames deep, more than the {} taken",
                sample.location_id.len(),
                limits.max_stack_depth
            ));
        }
        let stack = if sample.location_id.is_empty() {
            let (mapping, line) = no_stack();
            let mapping = builder.mapping(mapping);
            vec![builder.location(LocationRecord {
                mapping,
                address: 0,
                lines: vec![line],
            })]
        } else {
            sample
                .location_id
                .iter()
                .map(|id| {
                    location_ids
                        .get(id)
                        .copied()
                        .ok_or_else(|| format!("sample {index}: no location has id {id}"))
                })
                .collect::<Result<Vec<_>, _>>()?
        };
        let stack = builder.stack(stack);
        let sample_labels = sample
            .label
            .iter()
            .filter(|label| label.str != 0)
            .map(|label| Ok((strings.get(label.key)?, strings.get(label.str)?)))
            .collect::<Result<Vec<_>, String>>()?;
        let own_labels = !sample_labels.is_empty();
        if own_labels {
            labels.clone_from(&series_labels);
            stored_labels(sample_labels, &mut labels, limits)
                .map_err(|reason| format!("sample {index}: {reason}"))?;
        }
        for (type_index, (stored, &value)) in types.iter().zip(&sample.value).enumerate() {
            // pprof values are counts, sizes or times: a negative or zero
            // one (a delta profile's) adds nothing.
            let Ok(value) = u64::try_from(value) else {
                continue;
            };
            // CPU nanoseconds: ticks, rounded (SDKs send multiples of the
            // period).
            let weight = value
                .saturating_add(stored.units_per_tick / 2)
                .checked_div(stored.units_per_tick)
                .unwrap_or(value);
            if weight == 0 {
                continue;
            }
            // Most samples have only their series' labels: their set is
            // found once per type.
            let label_set = match series_sets[type_index] {
                Some(set) if !own_labels => set,
                _ => {
                    let set = builder
                        .label_set(
                            if own_labels { &labels } else { &series_labels },
                            stored,
                            limits,
                        )
                        .map_err(|reason| format!("sample {index}: {reason}"))?;
                    if !own_labels {
                        series_sets[type_index] = Some(set);
                    }
                    set
                }
            };
            builder
                .add_weight(stack, label_set, weight)
                .map_err(|reason| format!("sample {index}: {reason}"))?;
        }
    }
    Ok(window)
}

/// A pprof location as stored: its lines when it has some (a `Named`
/// mapping), else its address as an offset in its mapped file (so debuginfo
/// can name it later) or, without a file, as it is.
fn location_record(
    location: &pprof::Location,
    mappings: &HashMap<u64, &pprof::Mapping>,
    functions: &HashMap<u64, &pprof::Function>,
    strings: &Strings<'_>,
    limits: &IngestLimits,
) -> Result<(MappingRecord, LocationRecord), String> {
    let at = |reason: String| format!("location {}: {reason}", location.id);
    let mapping = match location.mapping_id {
        0 => None,
        id => Some(
            *mappings
                .get(&id)
                .ok_or_else(|| at(format!("no mapping has id {id}")))?,
        ),
    };
    let path = match mapping {
        Some(m) => strings.get(m.filename).map_err(at)?,
        None => "",
    };
    if location.line.len() > limits.max_lines_per_location {
        return Err(at(format!(
            "{} lines, more than the {} taken",
            location.line.len(),
            limits.max_lines_per_location
        )));
    }
    let mut lines = Vec::with_capacity(location.line.len());
    for line in &location.line {
        let function = match line.function_id {
            0 => None,
            id => Some(
                *functions
                    .get(&id)
                    .ok_or_else(|| at(format!("no function has id {id}")))?,
            ),
        };
        let (name, file) = match function {
            Some(f) => {
                let name = strings.get(f.name).map_err(at)?;
                let name = if name.is_empty() {
                    strings.get(f.system_name).map_err(at)?
                } else {
                    name
                };
                (name, strings.get(f.filename).map_err(at)?)
            }
            None => ("", ""),
        };
        lines.push(LineRecord {
            function: name.to_owned(),
            file: file.to_owned(),
            line: u32::try_from(line.line).unwrap_or(0),
        });
    }
    let named = lines.iter().any(|line| !line.function.is_empty());
    if named {
        return Ok((
            MappingRecord {
                kind: MappingKind::Named,
                build_id: String::new(),
                path: path.to_owned(),
                code_segments: Vec::new(),
            },
            LocationRecord {
                mapping: 0,
                address: location.address,
                lines,
            },
        ));
    }
    // No name: where its code is, as the agents send unnamed frames.
    let file_offset = mapping.and_then(|m| {
        location
            .address
            .checked_sub(m.memory_start)
            .and_then(|delta| delta.checked_add(m.file_offset))
    });
    let (kind, address, build_id) = match (mapping, file_offset) {
        (Some(m), Some(offset)) if !path.is_empty() => {
            let build_id = strings.get(m.build_id).map_err(at)?.to_ascii_lowercase();
            let is_hex = build_id.len() % 2 == 0 && build_id.bytes().all(|b| b.is_ascii_hexdigit());
            // Go's build ids are not GNU ones: they name no debuginfo.
            let build_id = if is_hex { build_id } else { String::new() };
            (MappingKind::User, offset, build_id)
        }
        _ => (MappingKind::Anonymous, location.address, String::new()),
    };
    Ok((
        MappingRecord {
            kind,
            build_id,
            path: path.to_owned(),
            code_segments: Vec::new(),
        },
        LocationRecord {
            mapping: 0,
            address,
            lines: Vec::new(),
        },
    ))
}
