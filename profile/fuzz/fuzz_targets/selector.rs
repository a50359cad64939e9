//! Selections as people type them, on arbitrary text: the first line is a
//! label selector, the next three `since`, `start` and `end` (an empty
//! line is an option not given). Parsing gives a selection or an error,
//! never a panic; a parsed selector prints back to text that parses to the
//! same matchers, survives the trip through its protobuf message, and a
//! regex matcher accepts exactly the patterns the regex crate accepts.
#![no_main]

use std::time::{Duration, UNIX_EPOCH};

use libfuzzer_sys::fuzz_target;
use stackscope_profile::{
    model::{LabelMatcher, MatchOp, Selection, TimeRange},
    selector::{format_matchers, parse_matchers, selection_from_proto, selection_to_proto},
    timespec::{DEFAULT_SINCE, resolve},
};

fn parts(matchers: &[LabelMatcher]) -> Vec<(&str, MatchOp, &str)> {
    matchers
        .iter()
        .map(|m| (m.name.as_str(), m.op, m.value.as_str()))
        .collect()
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut lines = text.split('\n');
    let selector = lines.next().unwrap_or_default();
    let mut option = || lines.next().filter(|line| !line.is_empty());
    let (since, start, end) = (option(), option(), option());

    let now = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
    if let Ok(range) = resolve(since, start, end, now, DEFAULT_SINCE) {
        assert!(range.start_unix_nanos < range.end_unix_nanos);
    }

    let Ok(matchers) = parse_matchers(selector) else {
        return;
    };
    for matcher in &matchers {
        if matches!(matcher.op, MatchOp::Regex | MatchOp::NotRegex) {
            assert!(
                regex::Regex::new(&matcher.value).is_ok(),
                "{:?} was accepted as a regular expression",
                matcher.value
            );
        }
        let _ = matcher.matches(Some(&matcher.value));
        let _ = matcher.matches(None);
    }
    let printed = format_matchers(&matchers);
    let again = parse_matchers(&printed).expect("printed matchers parse");
    assert_eq!(parts(&again), parts(&matchers), "{printed}");

    let selection = Selection {
        range: TimeRange {
            start_unix_nanos: 0,
            end_unix_nanos: 1,
        },
        matchers,
        profile_type: Default::default(),
    };
    let back = selection_from_proto(&selection_to_proto(&selection)).expect("own message");
    assert_eq!(parts(&back.matchers), parts(&selection.matchers));
});
