//! The values every stage after storage works on: which samples a query
//! selects (time range and label matchers) and the weighted stacks it gets
//! back. Owns no I/O.

use std::{
    sync::Arc,
    time::{SystemTime, UNIX_EPOCH},
};

use regex::Regex;

/// Nanoseconds since the Unix epoch, as the wire and storage hold times:
/// negative before 1970, saturated beyond what an `i64` holds.
pub fn unix_nanos(time: SystemTime) -> i64 {
    match time.duration_since(UNIX_EPOCH) {
        Ok(after) => i64::try_from(after.as_nanos()).unwrap_or(i64::MAX),
        Err(before) => i64::try_from(before.duration().as_nanos()).map_or(i64::MIN, |n| -n),
    }
}

/// A half-open time range `[start, end)` in nanoseconds since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimeRange {
    pub start_unix_nanos: i64,
    pub end_unix_nanos: i64,
}

/// How a matcher compares a label's value, as in PromQL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatchOp {
    /// `=`
    Equal,
    /// `!=`
    NotEqual,
    /// `=~`: the whole value matches the regular expression.
    Regex,
    /// `!~`
    NotRegex,
}

impl MatchOp {
    pub fn as_str(self) -> &'static str {
        match self {
            MatchOp::Equal => "=",
            MatchOp::NotEqual => "!=",
            MatchOp::Regex => "=~",
            MatchOp::NotRegex => "!~",
        }
    }
}

/// A matcher's regular expression did not compile.
#[derive(Debug, thiserror::Error)]
#[error("label matcher {name}{op}{value:?}: invalid regular expression")]
pub struct InvalidMatcher {
    pub name: String,
    pub op: &'static str,
    pub value: String,
    #[source]
    pub source: regex::Error,
}

/// `value` matched against a whole label value: `^(?:value)$`, once
/// `value` is known to be a regular expression by itself. Otherwise the
/// group could close early (`x)|(.*` makes `^(?:x)|(.*)$`, valid and
/// matching everything) and a malformed pattern would select the wrong
/// samples instead of being refused. Checked by parsing only (the syntax
/// crate `regex` uses, with the same defaults), so the pattern is compiled
/// once.
fn anchored(value: &str) -> Result<Regex, regex::Error> {
    regex_syntax::Parser::new()
        .parse(value)
        .map_err(|err| regex::Error::Syntax(err.to_string()))?;
    Regex::new(&format!("^(?:{value})$"))
}

/// One condition on a label. A sample without the label is treated as
/// having it with the empty value (so `pod=""` selects samples outside pods,
/// as in PromQL).
#[derive(Debug, Clone)]
pub struct LabelMatcher {
    pub name: String,
    pub op: MatchOp,
    pub value: String,
    /// Compiled, anchored pattern for the regex ops.
    regex: Option<Regex>,
}

impl LabelMatcher {
    pub fn new(
        name: impl Into<String>,
        op: MatchOp,
        value: impl Into<String>,
    ) -> Result<Self, InvalidMatcher> {
        let (name, value) = (name.into(), value.into());
        let regex = match op {
            MatchOp::Equal | MatchOp::NotEqual => None,
            MatchOp::Regex | MatchOp::NotRegex => match anchored(&value) {
                Ok(regex) => Some(regex),
                Err(source) => {
                    return Err(InvalidMatcher {
                        name,
                        op: op.as_str(),
                        value,
                        source,
                    });
                }
            },
        };
        Ok(Self {
            name,
            op,
            value,
            regex,
        })
    }

    /// Whether a label value (`None`: the label is absent) satisfies this.
    pub fn matches(&self, value: Option<&str>) -> bool {
        let value = value.unwrap_or("");
        match (self.op, &self.regex) {
            (MatchOp::Equal, _) => value == self.value,
            (MatchOp::NotEqual, _) => value != self.value,
            (MatchOp::Regex, Some(regex)) => regex.is_match(value),
            (MatchOp::NotRegex, Some(regex)) => !regex.is_match(value),
            (MatchOp::Regex | MatchOp::NotRegex, None) => {
                unreachable!("LabelMatcher::new compiles the regex for regex ops")
            }
        }
    }

    /// Whether a label set (sorted or not) satisfies this matcher.
    pub fn matches_set<'a>(&self, labels: impl IntoIterator<Item = (&'a str, &'a str)>) -> bool {
        let value = labels
            .into_iter()
            .find(|(name, _)| *name == self.name)
            .map(|(_, value)| value);
        self.matches(value)
    }
}

/// What a profile's weights measure. A query selects one type: weights
/// of different types are never summed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ProfileType {
    /// Time on the CPU, sampled by a timer: a weight is ticks, each worth
    /// the batch's sample period.
    #[default]
    Cpu,
    /// Time blocked off the CPU: a weight is nanoseconds.
    OffCpu,
    /// A type an application sent (an SDK's pprof sample type: allocated
    /// bytes, heap in use, lock waits, ...), named by its Pyroscope id
    /// (see [`PyroscopeTypeId`]); a weight is the id's sample unit.
    Sent(PyroscopeTypeId),
}

/// The label storage keeps a sample's profile type in, when it is not
/// [`ProfileType::Cpu`] (samples stored before types existed, and CPU
/// samples since, carry none, so their label sets are unchanged). Names
/// starting with `__` are the collector's: ingest refuses them from nodes.
pub const PROFILE_TYPE_LABEL: &str = "__type__";

/// A profile type as Pyroscope names it, `name:sample_type:sample_unit:
/// period_type:period_unit` (`memory:alloc_space:bytes:space:bytes`): five
/// parts of letters, digits, `_`, `-` and `.`, the period's two possibly
/// empty (`memory:alloc_in_new_tlab_bytes:bytes::`). Grafana and the
/// application SDKs speak these ids, so sent types keep them as they are.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PyroscopeTypeId(Arc<str>);

/// A string is not a Pyroscope profile type id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{0:?} is not a profile type id (name:sample_type:sample_unit:period_type:period_unit, \
     each part letters, digits, '_', '-' or '.', only the period's may be empty)"
)]
pub struct InvalidTypeId(pub String);

impl PyroscopeTypeId {
    /// Most bytes an id may have: ids are label values and names in menus.
    pub const MAX_LEN: usize = 200;

    pub fn new(id: &str) -> Result<Self, InvalidTypeId> {
        let part_ok = |(index, part): (usize, &str)| {
            (index >= 3 || !part.is_empty())
                && part
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
        };
        if id.len() <= Self::MAX_LEN
            && id.split(':').count() == 5
            && id.split(':').enumerate().all(part_ok)
        {
            Ok(Self(id.into()))
        } else {
            Err(InvalidTypeId(id.to_owned()))
        }
    }

    /// The id built from its parts (each checked as [`PyroscopeTypeId::new`] does).
    pub fn from_parts(
        name: &str,
        sample: (&str, &str),
        period: (&str, &str),
    ) -> Result<Self, InvalidTypeId> {
        Self::new(&format!(
            "{name}:{}:{}:{}:{}",
            sample.0, sample.1, period.0, period.1
        ))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    fn part(&self, index: usize) -> &str {
        self.0.split(':').nth(index).unwrap_or("")
    }

    /// The profile's name (`memory`, `process_cpu`, ...).
    pub fn name(&self) -> &str {
        self.part(0)
    }

    /// What a sample's value is and its unit (`alloc_space`, `bytes`).
    pub fn sample_type(&self) -> (&str, &str) {
        (self.part(1), self.part(2))
    }

    /// What the profile's period counts and its unit.
    pub fn period_type(&self) -> (&str, &str) {
        (self.part(3), self.part(4))
    }
}

impl ProfileType {
    /// Pyroscope's id for CPU time, which is what the agents' CPU samples
    /// (converted to nanoseconds) and SDKs' CPU profiles are in Grafana.
    pub const CPU_ID: &str = "process_cpu:cpu:nanoseconds:cpu:nanoseconds";
    /// The id off-CPU time is given in Pyroscope's API.
    pub const OFF_CPU_ID: &str = "off_cpu:off_cpu:nanoseconds:off_cpu:nanoseconds";

    /// Its name in queries (`type=`, `--type`) and in storage.
    pub fn name(&self) -> &str {
        match self {
            ProfileType::Cpu => "cpu",
            ProfileType::OffCpu => "off_cpu",
            ProfileType::Sent(id) => id.as_str(),
        }
    }

    /// The type named `name`: `cpu`, `off_cpu` (or `off-cpu`), or a
    /// Pyroscope id (those of CPU and off-CPU time name those types).
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "cpu" | Self::CPU_ID => Some(ProfileType::Cpu),
            "off_cpu" | "off-cpu" | Self::OFF_CPU_ID => Some(ProfileType::OffCpu),
            _ => PyroscopeTypeId::new(name).ok().map(ProfileType::Sent),
        }
    }

    /// The type whose samples carry `value` in [`PROFILE_TYPE_LABEL`]
    /// (`""`: CPU); `None` for a value no type of this collector stores.
    pub fn from_label_value(value: &str) -> Option<Self> {
        match value {
            "" => Some(ProfileType::Cpu),
            "cpu" | Self::CPU_ID => None,
            _ => Self::from_name(value),
        }
    }

    /// The value of [`PROFILE_TYPE_LABEL`] in its samples' label sets:
    /// empty (absent) for CPU samples.
    pub fn label_value(&self) -> &str {
        match self {
            ProfileType::Cpu => "",
            _ => self.name(),
        }
    }

    /// Its Pyroscope id: what Grafana lists and selects.
    pub fn pyroscope_id(&self) -> &str {
        match self {
            ProfileType::Cpu => Self::CPU_ID,
            ProfileType::OffCpu => Self::OFF_CPU_ID,
            ProfileType::Sent(id) => id.as_str(),
        }
    }

    /// The unit its weights are in once multiplied by the sample period
    /// (CPU: nanoseconds; the others: as stored).
    pub fn unit(&self) -> &str {
        match self {
            ProfileType::Cpu | ProfileType::OffCpu => "nanoseconds",
            ProfileType::Sent(id) => id.sample_type().1,
        }
    }
}

impl std::fmt::Display for ProfileType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Which samples a query covers: samples of its profile type, on which
/// every matcher holds.
#[derive(Debug, Clone)]
pub struct Selection {
    pub range: TimeRange,
    pub matchers: Vec<LabelMatcher>,
    pub profile_type: ProfileType,
}

impl Selection {
    /// Whether a sample with these labels is selected (time aside): its
    /// type is the selection's and every matcher holds.
    pub fn matches_labels<'a, I>(&self, labels: I) -> bool
    where
        I: IntoIterator<Item = (&'a str, &'a str)> + Clone,
    {
        let type_value = labels
            .clone()
            .into_iter()
            .find(|(name, _)| *name == PROFILE_TYPE_LABEL)
            .map_or("", |(_, value)| value);
        type_value == self.profile_type.label_value() && self.matches_labels_of_any_type(labels)
    }

    /// Whether every matcher holds on these labels, whatever their type.
    pub fn matches_labels_of_any_type<'a, I>(&self, labels: I) -> bool
    where
        I: IntoIterator<Item = (&'a str, &'a str)> + Clone,
    {
        self.matchers.iter().all(|m| m.matches_set(labels.clone()))
    }

    /// Whether it selects every CPU sample (no matchers): what storage
    /// answers from label-free sums, which hold CPU samples only.
    pub fn selects_every_cpu_sample(&self) -> bool {
        self.matchers.is_empty() && self.profile_type == ProfileType::Cpu
    }
}

/// The binary of Python functions' frames (named on the node from the
/// interpreter's code objects: their line is the line run).
pub const PYTHON_BINARY: &str = "[python]";

/// The binary of frames an application named itself (an SDK's pprof) when
/// its profile names no file for them.
pub const SENT_BINARY: &str = "[sdk]";

/// A frame as people read it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Frame {
    /// The function, or `[unknown] <binary>+0x<offset>` when unnamed.
    pub function: String,
    /// File name of the mapping (`[kernel]`, `[vdso]` for those).
    pub binary: String,
    /// Lower-case hex; empty when the file has none.
    pub build_id: String,
    /// Source file and line, empty / 0 when unknown.
    pub file: String,
    pub line: u32,
    /// Inlined into the frame after it (no call of its own).
    pub inlined: bool,
    /// For a frame of a file with a build-id that carries no name yet:
    /// where its code is, so it can be named later from debuginfo.
    pub unnamed_code: Option<CodeAddress>,
}

/// Where an unnamed frame's code is in its file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CodeAddress {
    /// The byte named (inside the call instruction for a caller), as a file
    /// offset: what `[unknown] <binary>+0x<offset>` shows.
    pub file_offset: u64,
    /// The same byte as an ELF virtual address, when the node sent the
    /// file's code segments: separate debug files are read by it.
    pub vaddr: Option<u64>,
}

impl Frame {
    /// A frame that stands for no code (a tree's root, a group, an unnamed
    /// location): only a function and a binary, no build id or source line.
    pub fn synthetic(function: impl Into<String>, binary: impl Into<String>) -> Self {
        Self {
            function: function.into(),
            binary: binary.into(),
            build_id: String::new(),
            file: String::new(),
            line: 0,
            inlined: false,
            unnamed_code: None,
        }
    }

    /// The name of a frame no symbol covers; never dropped, so its weight
    /// stays visible and the collector can name it later.
    pub fn unknown_function(binary: &str, address: u64) -> String {
        format!("[unknown] {binary}+0x{address:x}")
    }
}

/// One distinct stack and its weight (samples, scaled by sampling divisors).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightedStack {
    /// Innermost (leaf) first. Frames are shared between stacks.
    pub frames: Vec<Arc<Frame>>,
    pub weight: u64,
}

/// What storage hands back for a selection.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StackSamples {
    pub stacks: Vec<WeightedStack>,
    /// Nanoseconds of CPU one unit of weight stands for, when every batch
    /// in the selection agreed on it; 0 otherwise.
    pub sample_period_nanos: u64,
}

impl StackSamples {
    pub fn total_weight(&self) -> u64 {
        self.stacks.iter().map(|s| s.weight).sum()
    }
}

/// Whether every contributor (batch, bucket, group) had the same sample
/// period: [`StackSamples::sample_period_nanos`] is that period when all
/// agreed, 0 when they did not or there were none.
#[derive(Debug, Clone, Copy, Default)]
pub struct PeriodAgreement {
    value: Option<u64>,
    disagree: bool,
}

impl PeriodAgreement {
    pub fn add(&mut self, period_nanos: u64) {
        match self.value {
            None => self.value = Some(period_nanos),
            Some(value) if value != period_nanos => self.disagree = true,
            Some(_) => {}
        }
    }

    /// The agreed period, or 0.
    pub fn result(&self) -> u64 {
        match self.value {
            Some(value) if !self.disagree => value,
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profile_types_are_named_by_their_names_and_pyroscope_ids() {
        assert_eq!(ProfileType::from_name("cpu"), Some(ProfileType::Cpu));
        assert_eq!(
            ProfileType::from_name(ProfileType::CPU_ID),
            Some(ProfileType::Cpu)
        );
        assert_eq!(ProfileType::from_name("off-cpu"), Some(ProfileType::OffCpu));
        let alloc = ProfileType::from_name("memory:alloc_space:bytes:space:bytes").unwrap();
        let ProfileType::Sent(id) = &alloc else {
            panic!("{alloc:?}")
        };
        assert_eq!(id.name(), "memory");
        assert_eq!(id.sample_type(), ("alloc_space", "bytes"));
        assert_eq!(id.period_type(), ("space", "bytes"));
        assert_eq!(alloc.unit(), "bytes");
        assert_eq!(alloc.label_value(), alloc.pyroscope_id());
        for bad in [
            "alloc_space",
            "memory:alloc_space:bytes:space",
            "memory:alloc_space:bytes:space:bytes:x",
            "memory::bytes:space:bytes",
            "memory:alloc_space::space:bytes",
            "memory:alloc space:bytes:space:bytes",
            "memory:alloc_space:bytes:space:bytes\"",
        ] {
            assert_eq!(ProfileType::from_name(bad), None, "{bad}");
        }
        assert!(PyroscopeTypeId::new("memory:alloc_in_new_tlab_bytes:bytes::").is_ok());
        assert!(PyroscopeTypeId::new(&format!("{}:a:b:c:d", "x".repeat(200))).is_err());
    }

    #[test]
    fn label_values_name_the_type_that_stores_them() {
        for profile_type in [
            ProfileType::Cpu,
            ProfileType::OffCpu,
            ProfileType::from_name("memory:inuse_objects:count:space:bytes").unwrap(),
        ] {
            assert_eq!(
                ProfileType::from_label_value(profile_type.label_value()),
                Some(profile_type)
            );
        }
        // CPU samples carry no type label: a set that says "cpu" is no type's.
        assert_eq!(ProfileType::from_label_value("cpu"), None);
        assert_eq!(ProfileType::from_label_value(ProfileType::CPU_ID), None);
    }
}
