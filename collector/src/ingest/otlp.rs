//! OTLP profiles (`opentelemetry.proto.collector.profiles.v1development`,
//! the spec's 1.10.0, alpha): each profile of an export turned into the
//! pprof profile and labels an SDK would have sent (`pprof`), so it is
//! stored by the same rules.
//!
//! Owns the mapping from OTLP's shared dictionary to one self-contained
//! pprof per profile: only what a profile's samples reference is copied
//! (so a large dictionary shared by many profiles is not copied whole for
//! each), every index is bounds-checked, and the labels are the resource's
//! and the profile's attributes (`service.name` becomes `service_name`)
//! with the samples' own attributes as pprof sample labels.

use std::collections::HashMap;

use opentelemetry_proto::tonic::{
    collector::profiles::v1development::ExportProfilesServiceRequest,
    common::v1::{AnyValue, KeyValue, any_value::Value},
    profiles::v1development::{Profile, ProfilesDictionary},
};
use prost::Message as _;
use stackscope_profile::model::TimeRange;
use stackscope_proto::pprof;

use super::{
    IngestLimits,
    pprof::{MAX_PROFILES_PER_REQUEST, SentProfile},
};

/// The spec version whose messages are read.
pub const OTLP_PROFILES_VERSION: &str = "1.10.0 (v1development)";

/// Why an export was refused; nothing of it was stored.
#[derive(Debug, thiserror::Error)]
#[error("resource_profiles[{resource}].scope_profiles[{scope}].profiles[{profile}]: {reason}")]
pub struct OtlpError {
    pub resource: usize,
    pub scope: usize,
    pub profile: usize,
    pub reason: String,
}

/// A dictionary table's entry `index` (`what` names the table).
fn entry<'a, T>(table: &'a [T], index: i32, what: &str) -> Result<&'a T, String> {
    usize::try_from(index)
        .ok()
        .and_then(|i| table.get(i))
        .ok_or_else(|| {
            format!(
                "{what} index {index} out of range (table has {})",
                table.len()
            )
        })
}

/// An attribute value as a label value: strings as they are, numbers and
/// booleans written out; lists, maps and bytes are not labels.
fn label_value(value: &AnyValue, strings: &[String]) -> Result<Option<String>, String> {
    Ok(match &value.value {
        Some(Value::StringValue(s)) => Some(s.clone()),
        Some(Value::StringValueStrindex(i)) => Some(entry(strings, *i, "string")?.clone()),
        Some(Value::BoolValue(b)) => Some(b.to_string()),
        Some(Value::IntValue(n)) => Some(n.to_string()),
        Some(Value::DoubleValue(x)) => Some(x.to_string()),
        _ => None,
    })
}

/// A resource attribute's key: its string, or its dictionary string.
fn key_of<'a>(attribute: &'a KeyValue, strings: &'a [String]) -> Result<&'a str, String> {
    if attribute.key.is_empty() && attribute.key_strindex != 0 {
        return entry(strings, attribute.key_strindex, "string").map(String::as_str);
    }
    Ok(&attribute.key)
}

/// OTel's `service.name` is Pyroscope's `service_name`; other dotted
/// names are made query-safe by `pprof`.
fn label_name(key: &str) -> &str {
    match key {
        "service.name" => "service_name",
        other => other,
    }
}

/// The profiles of an export, as sent profiles, bounded as the request
/// they came in: at most [`MAX_PROFILES_PER_REQUEST`], labels and stacks
/// within `limits`, their pprof profiles `max_bytes` together. `now`
/// stands for a profile without a time.
pub fn otlp_profiles(
    request: &ExportProfilesServiceRequest,
    limits: &IngestLimits,
    max_bytes: usize,
    now_unix_nanos: i64,
) -> Result<Vec<SentProfile>, OtlpError> {
    let empty = ProfilesDictionary::default();
    let dictionary = request.dictionary.as_ref().unwrap_or(&empty);
    let count: usize = request
        .resource_profiles
        .iter()
        .flat_map(|r| &r.scope_profiles)
        .map(|s| s.profiles.len())
        .sum();
    if count > MAX_PROFILES_PER_REQUEST {
        return Err(OtlpError {
            resource: 0,
            scope: 0,
            profile: count,
            reason: format!(
                "more than the {MAX_PROFILES_PER_REQUEST} profiles taken in one export"
            ),
        });
    }
    let mut budget = max_bytes;
    let mut sent = Vec::new();
    for (resource_index, resource) in request.resource_profiles.iter().enumerate() {
        for (scope_index, scope) in resource.scope_profiles.iter().enumerate() {
            for (profile_index, profile) in scope.profiles.iter().enumerate() {
                let at = |reason: String| OtlpError {
                    resource: resource_index,
                    scope: scope_index,
                    profile: profile_index,
                    reason,
                };
                let mut labels = Vec::new();
                let resource_attributes = resource
                    .resource
                    .as_ref()
                    .map_or(&[][..], |r| &r.attributes[..]);
                for attribute in resource_attributes {
                    let key = key_of(attribute, &dictionary.string_table).map_err(at)?;
                    if let Some(value) = attribute.value.as_ref()
                        && let Some(value) =
                            label_value(value, &dictionary.string_table).map_err(at)?
                    {
                        labels.push((label_name(key).to_owned(), value));
                    }
                }
                for &index in &profile.attribute_indices {
                    if let Some((key, value)) = attribute(dictionary, index).map_err(at)? {
                        labels.push((label_name(&key).to_owned(), value));
                    }
                }
                if labels.len() > limits.max_labels_per_set
                    || labels
                        .iter()
                        .any(|(n, v)| n.len() + v.len() > limits.max_string_bytes)
                {
                    return Err(at(format!(
                        "{} attributes, more than the {} taken or longer than {} bytes",
                        labels.len(),
                        limits.max_labels_per_set,
                        limits.max_string_bytes
                    )));
                }
                let pprof = profile_as_pprof(dictionary, profile, limits)
                    .map_err(at)?
                    .encode_to_vec();
                budget = budget.checked_sub(pprof.len()).ok_or_else(|| {
                    at(format!(
                        "the export's profiles are larger than {max_bytes} bytes as pprof"
                    ))
                })?;
                let duration = i64::try_from(profile.duration_nano)
                    .unwrap_or(i64::MAX)
                    .max(1);
                let start = match i64::try_from(profile.time_unix_nano) {
                    Ok(start) if start > 0 => start,
                    _ => now_unix_nanos.saturating_sub(duration),
                };
                sent.push(SentProfile {
                    labels: labels.into(),
                    pprof,
                    window: Some(TimeRange {
                        start_unix_nanos: start,
                        end_unix_nanos: start.saturating_add(duration),
                    }),
                });
            }
        }
    }
    Ok(sent)
}

/// A dictionary attribute as a label, if its value is one.
fn attribute(
    dictionary: &ProfilesDictionary,
    index: i32,
) -> Result<Option<(String, String)>, String> {
    let attribute = entry(&dictionary.attribute_table, index, "attribute")?;
    let key = entry(&dictionary.string_table, attribute.key_strindex, "string")?;
    let Some(value) = attribute.value.as_ref() else {
        return Ok(None);
    };
    Ok(label_value(value, &dictionary.string_table)?.map(|value| (key.clone(), value)))
}

/// Copies what one profile references into a pprof profile of its own.
struct PprofBuilder<'a> {
    dictionary: &'a ProfilesDictionary,
    profile: pprof::Profile,
    /// Each string once in the profile's table.
    strings: HashMap<String, i64>,
    functions: HashMap<i32, u64>,
    mappings: HashMap<i32, u64>,
    locations: HashMap<i32, u64>,
}

impl<'a> PprofBuilder<'a> {
    /// The dictionary's string `index`, in the profile's table.
    fn string(&mut self, index: i32) -> Result<i64, String> {
        let dictionary = self.dictionary;
        Ok(self.text(entry(&dictionary.string_table, index, "string")?))
    }

    /// `text` in the profile's table.
    fn text(&mut self, text: &str) -> i64 {
        if let Some(&id) = self.strings.get(text) {
            return id;
        }
        self.profile.string_table.push(text.to_owned());
        let id = self.profile.string_table.len() as i64 - 1;
        self.strings.insert(text.to_owned(), id);
        id
    }

    fn function(&mut self, index: i32) -> Result<u64, String> {
        if let Some(&id) = self.functions.get(&index) {
            return Ok(id);
        }
        let function = entry(&self.dictionary.function_table, index, "function")?;
        let id = self.profile.function.len() as u64 + 1;
        let copied = pprof::Function {
            id,
            name: self.string(function.name_strindex)?,
            system_name: self.string(function.system_name_strindex)?,
            filename: self.string(function.filename_strindex)?,
            start_line: function.start_line,
        };
        self.profile.function.push(copied);
        self.functions.insert(index, id);
        Ok(id)
    }

    fn mapping(&mut self, index: i32) -> Result<u64, String> {
        if let Some(&id) = self.mappings.get(&index) {
            return Ok(id);
        }
        let mapping = entry(&self.dictionary.mapping_table, index, "mapping")?;
        // The build id is an attribute (`process.executable.build_id.gnu`).
        let mut build_id = 0;
        for &attribute_index in &mapping.attribute_indices {
            if let Some((key, value)) = attribute(self.dictionary, attribute_index)?
                && key == "process.executable.build_id.gnu"
            {
                build_id = self.text(&value);
            }
        }
        let id = self.profile.mapping.len() as u64 + 1;
        let copied = pprof::Mapping {
            id,
            memory_start: mapping.memory_start,
            memory_limit: mapping.memory_limit,
            file_offset: mapping.file_offset,
            filename: self.string(mapping.filename_strindex)?,
            build_id,
            ..Default::default()
        };
        self.profile.mapping.push(copied);
        self.mappings.insert(index, id);
        Ok(id)
    }

    fn location(&mut self, index: i32) -> Result<u64, String> {
        if let Some(&id) = self.locations.get(&index) {
            return Ok(id);
        }
        let location = entry(&self.dictionary.location_table, index, "location")?;
        // Index 0 of every table is the "not set" entry.
        let mapping_id = match location.mapping_index {
            0 => 0,
            mapping => self.mapping(mapping)?,
        };
        let mut lines = Vec::with_capacity(location.lines.len());
        for line in &location.lines {
            lines.push(pprof::Line {
                function_id: self.function(line.function_index)?,
                line: line.line,
            });
        }
        let id = self.profile.location.len() as u64 + 1;
        self.profile.location.push(pprof::Location {
            id,
            mapping_id,
            address: location.address,
            line: lines,
            is_folded: false,
        });
        self.locations.insert(index, id);
        Ok(id)
    }

    fn value_type(
        &mut self,
        value_type: Option<&'a opentelemetry_proto::tonic::profiles::v1development::ValueType>,
    ) -> Result<Option<pprof::ValueType>, String> {
        let Some(value_type) = value_type else {
            return Ok(None);
        };
        Ok(Some(pprof::ValueType {
            r#type: self.string(value_type.type_strindex)?,
            unit: self.string(value_type.unit_strindex)?,
        }))
    }
}

/// One OTLP profile as a pprof profile with one sample type.
fn profile_as_pprof(
    dictionary: &ProfilesDictionary,
    profile: &Profile,
    limits: &IngestLimits,
) -> Result<pprof::Profile, String> {
    let mut builder = PprofBuilder {
        dictionary,
        profile: pprof::Profile {
            string_table: vec![String::new()],
            ..Default::default()
        },
        strings: HashMap::from([(String::new(), 0)]),
        functions: HashMap::new(),
        mappings: HashMap::new(),
        locations: HashMap::new(),
    };
    let sample_type = builder
        .value_type(profile.sample_type.as_ref())?
        .ok_or("the profile has no sample type")?;
    builder.profile.sample_type = vec![sample_type];
    builder.profile.period_type = builder.value_type(profile.period_type.as_ref())?;
    builder.profile.period = profile.period;
    for (index, sample) in profile.samples.iter().enumerate() {
        let at = |reason: String| format!("sample {index}: {reason}");
        if !sample.values.is_empty()
            && !sample.timestamps_unix_nano.is_empty()
            && sample.values.len() != sample.timestamps_unix_nano.len()
        {
            return Err(at(format!(
                "{} values for {} timestamps",
                sample.values.len(),
                sample.timestamps_unix_nano.len()
            )));
        }
        // Without values, each timestamp is one event.
        let value = if sample.values.is_empty() {
            sample.timestamps_unix_nano.len() as i64
        } else {
            sample
                .values
                .iter()
                .fold(0i64, |sum, v| sum.saturating_add(*v))
        };
        let stack = entry(&dictionary.stack_table, sample.stack_index, "stack").map_err(at)?;
        if stack.location_indices.len() > limits.max_stack_depth {
            return Err(at(format!(
                "{} frames deep, more than the {} taken",
                stack.location_indices.len(),
                limits.max_stack_depth
            )));
        }
        if sample.attribute_indices.len() > limits.max_labels_per_set {
            return Err(at(format!(
                "{} attributes, more than the {} taken",
                sample.attribute_indices.len(),
                limits.max_labels_per_set
            )));
        }
        let mut location_id = Vec::with_capacity(stack.location_indices.len());
        for &location in &stack.location_indices {
            location_id.push(builder.location(location).map_err(at)?);
        }
        let mut label = Vec::new();
        for &attribute_index in &sample.attribute_indices {
            if let Some((key, value)) = attribute(dictionary, attribute_index).map_err(at)? {
                label.push(pprof::Label {
                    key: builder.text(&key),
                    str: builder.text(&value),
                    ..Default::default()
                });
            }
        }
        builder.profile.sample.push(pprof::Sample {
            location_id,
            value: vec![value],
            label,
        });
    }
    Ok(builder.profile)
}
