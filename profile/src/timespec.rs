//! Selections as people type them: label matchers (`comm="x"`) and a time
//! range, as `--since 5m` or `--start`/`--end` given as RFC 3339 timestamps,
//! Unix seconds, or a duration meaning "that long ago". Shared by the HTTP
//! API and the `stackscope` CLI.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::{
    model::{ProfileType, Selection, TimeRange, unix_nanos},
    selector::{self, SelectorError},
};

/// The range a query covers when it names none.
pub const DEFAULT_SINCE: Duration = Duration::from_secs(3600);

/// The matchers or the time range of a selection are malformed.
#[derive(Debug, thiserror::Error)]
pub enum SelectionError {
    #[error(transparent)]
    Time(#[from] TimeSpecError),
    /// Not a `#[source]`: the message already carries the parser's words.
    #[error("match: {0}")]
    Matchers(SelectorError),
    #[error(
        "type {0:?}: expected cpu, off_cpu or a profile type id such as memory:alloc_space:bytes:space:bytes"
    )]
    ProfileType(String),
}

/// A selection's matchers as people read them, for titles and messages.
pub fn describe(selection: &Selection) -> String {
    let samples = if selection.matchers.is_empty() {
        "all samples".to_string()
    } else {
        selector::format_matchers(&selection.matchers)
    };
    match &selection.profile_type {
        ProfileType::Cpu => samples,
        other => format!("{samples} ({other})"),
    }
}

/// The title of a selection's flamegraph.
pub fn title(selection: &Selection) -> String {
    format!("stackscope: {}", describe(selection))
}

/// The title of a differential flamegraph of `selection` against `base`.
pub fn diff_title(selection: &Selection, base: &Selection) -> String {
    format!(
        "stackscope diff: {} against {}",
        describe(selection),
        describe(base)
    )
}

/// A selection as typed (CLI options or HTTP parameters), before parsing.
#[derive(Debug, Clone, Copy, Default)]
pub struct SelectionText<'a> {
    /// Label matchers; `None` selects every sample.
    pub matchers: Option<&'a str>,
    /// The profile type's name; `None` is CPU.
    pub profile_type: Option<&'a str>,
    /// The time options as [`resolve`] takes them.
    pub since: Option<&'a str>,
    pub start: Option<&'a str>,
    pub end: Option<&'a str>,
}

impl<'a> SelectionText<'a> {
    /// Parses it, with the last [`DEFAULT_SINCE`] when no range is given.
    pub fn parse(&self) -> Result<Selection, SelectionError> {
        let range = resolve(
            self.since,
            self.start,
            self.end,
            SystemTime::now(),
            DEFAULT_SINCE,
        )?;
        let matchers = match self.matchers {
            Some(text) => selector::parse_matchers(text).map_err(SelectionError::Matchers)?,
            None => Vec::new(),
        };
        let profile_type = match self.profile_type {
            Some(name) => ProfileType::from_name(name)
                .ok_or_else(|| SelectionError::ProfileType(name.to_owned()))?,
            None => ProfileType::Cpu,
        };
        Ok(Selection {
            range,
            matchers,
            profile_type,
        })
    }

    /// The baseline of a diff against this selection: `base`'s parts, each
    /// defaulting to this selection's own. A base range given by its start
    /// or duration does not inherit this selection's end. The profile type
    /// is always this selection's: weights of two types do not compare.
    pub fn baseline(&self, base: SelectionText<'a>) -> SelectionText<'a> {
        let own_range = base.since.is_none() && base.start.is_none();
        SelectionText {
            matchers: base.matchers.or(self.matchers),
            profile_type: self.profile_type,
            since: if own_range { self.since } else { base.since },
            start: if own_range { self.start } else { base.start },
            end: base.end.or(if own_range { self.end } else { None }),
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TimeSpecError {
    #[error("{what} {value:?}: expected a duration like 5m or 2h30m")]
    Duration { what: &'static str, value: String },
    #[error(
        "{what} {value:?}: expected an RFC 3339 time (2026-11-21T17:00:00Z), Unix seconds, \
         or a duration ago (15m)"
    )]
    Time { what: &'static str, value: String },
    #[error("give either since or start/end, not both")]
    SinceAndStart,
    #[error("the time range is empty: start ({start}) is not before end ({end})")]
    Empty { start: String, end: String },
}

fn parse_duration(what: &'static str, value: &str) -> Result<Duration, TimeSpecError> {
    humantime::parse_duration(value.trim()).map_err(|_| TimeSpecError::Duration {
        what,
        value: value.to_string(),
    })
}

fn parse_time(what: &'static str, value: &str, now: SystemTime) -> Result<i64, TimeSpecError> {
    let trimmed = value.trim();
    if trimmed == "now" {
        return Ok(unix_nanos(now));
    }
    if let Ok(seconds) = trimmed.parse::<f64>()
        && seconds.is_finite()
        && seconds.abs() < 1e11
    {
        return Ok((seconds * 1e9) as i64);
    }
    if let Ok(time) = humantime::parse_rfc3339_weak(trimmed) {
        return Ok(unix_nanos(time));
    }
    if let Ok(ago) = humantime::parse_duration(trimmed) {
        return Ok(
            unix_nanos(now).saturating_sub(i64::try_from(ago.as_nanos()).unwrap_or(i64::MAX))
        );
    }
    Err(TimeSpecError::Time {
        what,
        value: value.to_string(),
    })
}

fn show(unix_nanos: i64) -> String {
    match u64::try_from(unix_nanos) {
        Ok(nanos) => {
            humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_nanos(nanos)).to_string()
        }
        Err(_) => format!("{unix_nanos} ns"),
    }
}

/// Resolves the user's time options against `now`. With none given the range
/// is the last `default_since`; `end` defaults to now.
pub fn resolve(
    since: Option<&str>,
    start: Option<&str>,
    end: Option<&str>,
    now: SystemTime,
    default_since: Duration,
) -> Result<TimeRange, TimeSpecError> {
    let end_nanos = match end {
        Some(end) => parse_time("end", end, now)?,
        None => unix_nanos(now),
    };
    let start_nanos = match (since, start) {
        (Some(_), Some(_)) => return Err(TimeSpecError::SinceAndStart),
        (Some(since), None) => {
            let since = parse_duration("since", since)?;
            end_nanos.saturating_sub(i64::try_from(since.as_nanos()).unwrap_or(i64::MAX))
        }
        (None, Some(start)) => parse_time("start", start, now)?,
        (None, None) => {
            end_nanos.saturating_sub(i64::try_from(default_since.as_nanos()).unwrap_or(i64::MAX))
        }
    };
    if start_nanos >= end_nanos {
        return Err(TimeSpecError::Empty {
            start: show(start_nanos),
            end: show(end_nanos),
        });
    }
    Ok(TimeRange {
        start_unix_nanos: start_nanos,
        end_unix_nanos: end_nanos,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: Duration = Duration::from_secs(3600);

    fn now() -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(1_800_000_000)
    }

    #[test]
    fn since_counts_back_from_end() {
        let range = resolve(Some("5m"), None, None, now(), HOUR).unwrap();
        assert_eq!(range.end_unix_nanos, 1_800_000_000 * 1_000_000_000);
        assert_eq!(
            range.start_unix_nanos,
            (1_800_000_000 - 300) * 1_000_000_000
        );
    }

    #[test]
    fn default_is_the_last_default_since() {
        let range = resolve(None, None, None, now(), HOUR).unwrap();
        assert_eq!(
            range.start_unix_nanos,
            (1_800_000_000 - 3600) * 1_000_000_000
        );
    }

    #[test]
    fn absolute_and_relative_times() {
        // 1_800_000_000 is 2027-01-15T08:00:00Z.
        let range = resolve(
            None,
            Some("2027-01-15T07:00:00Z"),
            Some("1800000000"),
            now(),
            HOUR,
        )
        .unwrap();
        assert_eq!(range.start_unix_nanos, 1_799_996_400 * 1_000_000_000);
        assert_eq!(range.end_unix_nanos, 1_800_000_000 * 1_000_000_000);
        let range = resolve(None, Some("2h"), Some("1h"), now(), HOUR).unwrap();
        assert_eq!(
            range.start_unix_nanos,
            (1_800_000_000 - 7200) * 1_000_000_000
        );
        assert_eq!(range.end_unix_nanos, (1_800_000_000 - 3600) * 1_000_000_000);
    }

    #[test]
    fn a_baseline_defaults_to_the_selection_but_not_half_of_its_range() {
        let own = SelectionText {
            matchers: Some("comm=\"a\""),
            profile_type: Some("off_cpu"),
            since: Some("5m"),
            start: None,
            end: Some("1h"),
        };
        let inherited = own.baseline(SelectionText::default());
        assert_eq!(
            (inherited.matchers, inherited.since, inherited.end),
            (Some("comm=\"a\""), Some("5m"), Some("1h"))
        );
        let base = own.baseline(SelectionText {
            matchers: Some("comm=\"b\""),
            start: Some("2h"),
            ..SelectionText::default()
        });
        assert_eq!(
            (base.matchers, base.since, base.start, base.end),
            (Some("comm=\"b\""), None, Some("2h"), None)
        );
        // Weights of two types do not compare: the baseline has this type.
        assert_eq!(base.profile_type, Some("off_cpu"));
    }

    #[test]
    fn a_selection_reads_one_profile_type_cpu_unless_named() {
        let parse = |profile_type| {
            SelectionText {
                profile_type,
                ..SelectionText::default()
            }
            .parse()
        };
        assert_eq!(parse(None).unwrap().profile_type, ProfileType::Cpu);
        assert_eq!(
            parse(Some("off-cpu")).unwrap().profile_type,
            ProfileType::OffCpu
        );
        assert_eq!(
            parse(Some("off_cpu")).unwrap().profile_type,
            ProfileType::OffCpu
        );
        assert_eq!(
            parse(Some("wall")).unwrap_err().to_string(),
            "type \"wall\": expected cpu, off_cpu or a profile type id such as memory:alloc_space:bytes:space:bytes"
        );
    }

    #[test]
    fn errors_say_what_is_wrong() {
        assert_eq!(
            resolve(Some("5 parsecs"), None, None, now(), HOUR),
            Err(TimeSpecError::Duration {
                what: "since",
                value: "5 parsecs".into()
            })
        );
        assert_eq!(
            resolve(Some("5m"), Some("1h"), None, now(), HOUR),
            Err(TimeSpecError::SinceAndStart)
        );
        assert!(matches!(
            resolve(None, Some("1h"), Some("2h"), now(), HOUR),
            Err(TimeSpecError::Empty { .. })
        ));
        assert_eq!(
            resolve(None, Some("yesterday-ish"), None, now(), HOUR),
            Err(TimeSpecError::Time {
                what: "start",
                value: "yesterday-ish".into()
            })
        );
    }
}
