//! Label matchers as people type them, and selections as they travel.
//!
//! Owns the PromQL-style matcher syntax the CLI (`--match`) and the HTTP API
//! (`match=`) accept — `{comm="redis-server", exe=~".*/redis.*"}` — and the
//! conversions between [`model::Selection`](crate::model::Selection) and the
//! `stackscope.v1.Selection` message. Does not own matching itself (that is
//! [`LabelMatcher::matches`](crate::model::LabelMatcher::matches)) nor time
//! specifications (the CLI parses `--since` and friends).
//!
//! Grammar (whitespace allowed between any two tokens):
//!
//! ```text
//! selector := "{" list? "}" | list?
//! list     := matcher ("," matcher)* ","?
//! matcher  := name op value
//! name     := [a-zA-Z_][a-zA-Z0-9_]*
//! op       := "=" | "!=" | "=~" | "!~"
//! value    := '"' (any character but '"' and '\', or \" or \\)* '"'
//! ```
//!
//! Only `\"` and `\\` are escapes. Other backslash sequences are rejected
//! rather than passed through, so that `"\d"` cannot silently mean something
//! different from what PromQL would make of it; a regex backslash is written
//! `\\` (as in PromQL).

use stackscope_proto::v1::{
    LabelMatcher as ProtoMatcher, Selection as ProtoSelection, label_matcher::Op,
};

use crate::model::{InvalidMatcher, LabelMatcher, MatchOp, ProfileType, Selection, TimeRange};

/// A matcher list or a selection message is not acceptable. Text positions
/// are 0-based byte offsets into the text given to [`parse_matchers`];
/// matcher indexes are 0-based positions in `Selection.matchers`.
#[derive(Debug, thiserror::Error)]
pub enum SelectorError {
    /// The text does not follow the grammar.
    #[error("at {position}: expected {expected}, found {found}")]
    Syntax {
        position: usize,
        /// What the grammar allows here, e.g. `one of =, !=, =~, !~`.
        expected: &'static str,
        /// The offending character (`'x'`) or `end of input`.
        found: String,
    },
    /// A backslash in a quoted value is followed by something other than
    /// `"` or `\`.
    #[error("at {position}: unknown escape \\{escape} (quoted values know only \\\" and \\\\)")]
    UnknownEscape { position: usize, escape: char },
    /// A `=~` or `!~` value in the text is not a regular expression.
    #[error("at {position}: invalid regular expression in {name}{op}{value:?}")]
    InvalidRegex {
        /// Where the quoted value starts.
        position: usize,
        name: String,
        op: &'static str,
        value: String,
        #[source]
        source: regex::Error,
    },
    /// A matcher in a selection message has the operator left unset.
    #[error("matcher {index} ({name:?}): the operator is unspecified")]
    UnspecifiedOp { index: usize, name: String },
    /// A matcher in a selection message has an operator this build does not
    /// know (a newer peer).
    #[error("matcher {index} ({name:?}): unknown operator {op}")]
    UnknownOp { index: usize, name: String, op: i32 },
    /// A matcher in a selection message names a label the text syntax could
    /// not express.
    #[error("matcher {index}: invalid label name {name:?} (expected [a-zA-Z_][a-zA-Z0-9_]*)")]
    InvalidLabelName { index: usize, name: String },
    /// A regex matcher in a selection message is not a regular expression.
    #[error("matcher {index}: invalid regular expression in {name}{op}{value:?}")]
    InvalidProtoRegex {
        index: usize,
        name: String,
        op: &'static str,
        value: String,
        #[source]
        source: regex::Error,
    },
    /// A selection message names a profile type this build does not know.
    #[error(
        "profile type {0:?}: expected cpu, off_cpu or a profile type id such as memory:alloc_space:bytes:space:bytes"
    )]
    UnknownProfileType(String),
}

const EXPECTED_OP: &str = "one of =, !=, =~, !~";
const EXPECTED_NAME: &str = "a label name";
const EXPECTED_VALUE: &str = "a double-quoted value";
const EXPECTED_CLOSING_QUOTE: &str = "a closing \"";

/// Parses a matcher list such as `comm="redis-server",exe=~".*/redis.*"`,
/// optionally inside `{}`. Empty text (or `{}`) is the empty list, which
/// selects everything.
pub fn parse_matchers(text: &str) -> Result<Vec<LabelMatcher>, SelectorError> {
    Parser { text, pos: 0 }.selector()
}

/// Whether `name` is a label name the text syntax can express.
pub fn is_valid_label_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// A hand-written recursive-descent parser: the grammar is tiny, and doing it
/// by hand is what lets every error name the byte and the expected token.
struct Parser<'a> {
    text: &'a str,
    /// Byte offset of the next unread character (always a char boundary).
    pos: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<char> {
        self.text[self.pos..].chars().next()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.pos += c.len_utf8();
        Some(c)
    }

    fn skip_whitespace(&mut self) {
        while self.peek().is_some_and(char::is_whitespace) {
            self.bump();
        }
    }

    fn error(&self, expected: &'static str) -> SelectorError {
        SelectorError::Syntax {
            position: self.pos,
            expected,
            found: match self.peek() {
                Some(c) => format!("{c:?}"),
                None => "end of input".to_string(),
            },
        }
    }

    fn selector(mut self) -> Result<Vec<LabelMatcher>, SelectorError> {
        self.skip_whitespace();
        let braced = self.peek() == Some('{');
        if braced {
            self.bump();
        }
        let (closing, after_value): (Option<char>, &'static str) = if braced {
            (Some('}'), "',' or '}'")
        } else {
            (None, "',' or end of input")
        };
        let first_expected = if braced {
            "a label name or '}'"
        } else {
            "a label name or end of input"
        };

        let mut matchers = Vec::new();
        loop {
            self.skip_whitespace();
            // The list may be empty and may end in a comma, so a closing
            // token is acceptable wherever a matcher could start.
            if self.peek() == closing {
                self.bump();
                break;
            }
            if !self
                .peek()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            {
                return Err(self.error(first_expected));
            }
            matchers.push(self.matcher()?);
            self.skip_whitespace();
            match self.peek() {
                Some(',') => {
                    self.bump();
                }
                c if c == closing => {
                    self.bump();
                    break;
                }
                _ => return Err(self.error(after_value)),
            }
        }
        self.skip_whitespace();
        if self.pos != self.text.len() {
            return Err(self.error("end of input"));
        }
        Ok(matchers)
    }

    fn matcher(&mut self) -> Result<LabelMatcher, SelectorError> {
        let name = self.name()?;
        self.skip_whitespace();
        let op = self.op()?;
        self.skip_whitespace();
        let position = self.pos;
        let value = self.quoted()?;
        LabelMatcher::new(name, op, value).map_err(
            |InvalidMatcher {
                 name,
                 op,
                 value,
                 source,
             }| SelectorError::InvalidRegex {
                position,
                name,
                op,
                value,
                source,
            },
        )
    }

    fn name(&mut self) -> Result<String, SelectorError> {
        let start = self.pos;
        if !self
            .peek()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        {
            return Err(self.error(EXPECTED_NAME));
        }
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            self.bump();
        }
        Ok(self.text[start..self.pos].to_string())
    }

    fn op(&mut self) -> Result<MatchOp, SelectorError> {
        let rest = &self.text[self.pos..];
        // Longest match first: `=~` before `=`.
        let (op, len) = if rest.starts_with("=~") {
            (MatchOp::Regex, 2)
        } else if rest.starts_with("!=") {
            (MatchOp::NotEqual, 2)
        } else if rest.starts_with("!~") {
            (MatchOp::NotRegex, 2)
        } else if rest.starts_with('=') {
            (MatchOp::Equal, 1)
        } else {
            return Err(self.error(EXPECTED_OP));
        };
        self.pos += len;
        Ok(op)
    }

    fn quoted(&mut self) -> Result<String, SelectorError> {
        if self.peek() != Some('"') {
            return Err(self.error(EXPECTED_VALUE));
        }
        self.bump();
        let mut value = String::new();
        loop {
            let position = self.pos;
            match self.bump() {
                None => return Err(self.error(EXPECTED_CLOSING_QUOTE)),
                Some('"') => return Ok(value),
                Some('\\') => match self.bump() {
                    Some(c @ ('"' | '\\')) => value.push(c),
                    Some(escape) => return Err(SelectorError::UnknownEscape { position, escape }),
                    None => return Err(self.error(EXPECTED_CLOSING_QUOTE)),
                },
                Some(c) => value.push(c),
            }
        }
    }
}

/// Writes matchers back in the syntax [`parse_matchers`] reads, so that
/// `parse_matchers(&format_matchers(m))` gives `m` again.
pub fn format_matchers(matchers: &[LabelMatcher]) -> String {
    let mut text = String::from("{");
    for (i, matcher) in matchers.iter().enumerate() {
        if i > 0 {
            text.push_str(", ");
        }
        text.push_str(&matcher.name);
        text.push_str(matcher.op.as_str());
        text.push('"');
        for c in matcher.value.chars() {
            if matches!(c, '"' | '\\') {
                text.push('\\');
            }
            text.push(c);
        }
        text.push('"');
    }
    text.push('}');
    text
}

fn op_to_proto(op: MatchOp) -> Op {
    match op {
        MatchOp::Equal => Op::Equal,
        MatchOp::NotEqual => Op::NotEqual,
        MatchOp::Regex => Op::Regex,
        MatchOp::NotRegex => Op::NotRegex,
    }
}

/// The `stackscope.v1.Selection` for a selection.
pub fn selection_to_proto(selection: &Selection) -> ProtoSelection {
    ProtoSelection {
        start_unix_nanos: selection.range.start_unix_nanos,
        end_unix_nanos: selection.range.end_unix_nanos,
        matchers: selection
            .matchers
            .iter()
            .map(|m| ProtoMatcher {
                name: m.name.clone(),
                op: op_to_proto(m.op) as i32,
                value: m.value.clone(),
            })
            .collect(),
        profile_type: selection.profile_type.label_value().to_owned(),
    }
}

/// A selection from a `stackscope.v1.Selection` received over the network:
/// every matcher needs a known operator, a label name the text syntax could
/// express, and (for `=~`, `!~`) a valid regular expression. The time range
/// is taken as is; whether it is empty is the caller's business.
pub fn selection_from_proto(selection: &ProtoSelection) -> Result<Selection, SelectorError> {
    let matchers = selection
        .matchers
        .iter()
        .enumerate()
        .map(|(index, m)| {
            let op = match Op::try_from(m.op) {
                Ok(Op::Equal) => MatchOp::Equal,
                Ok(Op::NotEqual) => MatchOp::NotEqual,
                Ok(Op::Regex) => MatchOp::Regex,
                Ok(Op::NotRegex) => MatchOp::NotRegex,
                Ok(Op::Unspecified) => {
                    return Err(SelectorError::UnspecifiedOp {
                        index,
                        name: m.name.clone(),
                    });
                }
                Err(_) => {
                    return Err(SelectorError::UnknownOp {
                        index,
                        name: m.name.clone(),
                        op: m.op,
                    });
                }
            };
            if !is_valid_label_name(&m.name) {
                return Err(SelectorError::InvalidLabelName {
                    index,
                    name: m.name.clone(),
                });
            }
            LabelMatcher::new(m.name.clone(), op, m.value.clone()).map_err(
                |InvalidMatcher {
                     name,
                     op,
                     value,
                     source,
                 }| SelectorError::InvalidProtoRegex {
                    index,
                    name,
                    op,
                    value,
                    source,
                },
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    let profile_type = match selection.profile_type.as_str() {
        "" => ProfileType::Cpu,
        name => ProfileType::from_name(name)
            .ok_or_else(|| SelectorError::UnknownProfileType(name.to_owned()))?,
    };
    Ok(Selection {
        range: TimeRange {
            start_unix_nanos: selection.start_unix_nanos,
            end_unix_nanos: selection.end_unix_nanos,
        },
        matchers,
        profile_type,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Matchers as (name, op, value) triples, for exact comparisons
    /// (`LabelMatcher` holds a compiled regex and is not `PartialEq`).
    fn triples(matchers: &[LabelMatcher]) -> Vec<(&str, &str, &str)> {
        matchers
            .iter()
            .map(|m| (m.name.as_str(), m.op.as_str(), m.value.as_str()))
            .collect()
    }

    fn parse(text: &str) -> Vec<(String, &'static str, String)> {
        parse_matchers(text)
            .unwrap_or_else(|err| panic!("{text:?} should parse: {err}"))
            .iter()
            .map(|m| (m.name.clone(), m.op.as_str(), m.value.clone()))
            .collect()
    }

    fn error(text: &str) -> String {
        match parse_matchers(text) {
            Ok(m) => panic!("{text:?} should not parse, got {:?}", triples(&m)),
            Err(err) => err.to_string(),
        }
    }

    fn owned(expected: &[(&str, &'static str, &str)]) -> Vec<(String, &'static str, String)> {
        expected
            .iter()
            .map(|(n, o, v)| (n.to_string(), *o, v.to_string()))
            .collect()
    }

    #[test]
    fn parses_all_operators() {
        assert_eq!(
            parse(r#"comm="redis-server",exe=~".*/redis.*",pod!="",container!~"side.*""#),
            owned(&[
                ("comm", "=", "redis-server"),
                ("exe", "=~", ".*/redis.*"),
                ("pod", "!=", ""),
                ("container", "!~", "side.*"),
            ])
        );
    }

    #[test]
    fn braces_whitespace_and_trailing_comma() {
        let expected = owned(&[("comm", "=", "redis"), ("_node2", "!=", "a b")]);
        assert_eq!(parse(r#"{comm="redis",_node2!="a b"}"#), expected);
        assert_eq!(
            parse(" \t{ comm = \"redis\" ,\n _node2 != \"a b\" , } \n"),
            expected
        );
        assert_eq!(parse(r#"comm="redis", _node2!="a b","#), expected);
    }

    #[test]
    fn empty_selectors() {
        assert!(parse("").is_empty());
        assert!(parse("   ").is_empty());
        assert!(parse("{}").is_empty());
        assert!(parse(" { } ").is_empty());
    }

    #[test]
    fn escapes_and_unicode() {
        assert_eq!(
            parse(r#"comm="say \"hi\" \\o/""#),
            owned(&[("comm", "=", r#"say "hi" \o/"#)])
        );
        assert_eq!(
            parse(r#"exe=~"/usr/bin/\\w+""#),
            owned(&[("exe", "=~", r"/usr/bin/\w+")])
        );
        assert_eq!(parse("pod=\"café=,}\""), owned(&[("pod", "=", "café=,}")]));
    }

    #[test]
    fn regex_matchers_are_anchored_and_compiled() {
        let matchers = parse_matchers(r#"exe=~".*/redis.*""#).unwrap();
        assert!(matchers[0].matches(Some("/usr/bin/redis-server")));
        assert!(!matchers[0].matches(Some("/usr/bin/python")));
    }

    #[test]
    fn syntax_errors_name_position_and_expectation() {
        assert_eq!(
            error("comm<\"x\""),
            "at 4: expected one of =, !=, =~, !~, found '<'"
        );
        assert_eq!(
            error("comm !x"),
            "at 5: expected one of =, !=, =~, !~, found '!'"
        );
        assert_eq!(
            error("comm"),
            "at 4: expected one of =, !=, =~, !~, found end of input"
        );
        assert_eq!(
            error("comm=redis"),
            "at 5: expected a double-quoted value, found 'r'"
        );
        assert_eq!(
            error("comm=='x'"),
            "at 5: expected a double-quoted value, found '='"
        );
        assert_eq!(
            error("comm=\"redis"),
            "at 11: expected a closing \", found end of input"
        );
        assert_eq!(
            error("comm=\"redis\\"),
            "at 12: expected a closing \", found end of input"
        );
        assert_eq!(
            error("1comm=\"x\""),
            "at 0: expected a label name or end of input, found '1'"
        );
        assert_eq!(
            error("{comm=\"x\",,}"),
            "at 10: expected a label name or '}', found ','"
        );
        assert_eq!(
            error("comm=\"x\" exe=\"y\""),
            "at 9: expected ',' or end of input, found 'e'"
        );
        assert_eq!(
            error("{comm=\"x\""),
            "at 9: expected ',' or '}', found end of input"
        );
        assert_eq!(
            error("{comm=\"x\"} x"),
            "at 11: expected end of input, found 'x'"
        );
        assert_eq!(
            error("comm=\"x\"}"),
            "at 8: expected ',' or end of input, found '}'"
        );
        assert_eq!(
            error("cömm=\"x\""),
            "at 1: expected one of =, !=, =~, !~, found 'ö'"
        );
        assert_eq!(
            error("{é}"),
            "at 1: expected a label name or '}', found 'é'"
        );
    }

    #[test]
    fn unknown_escapes_are_rejected() {
        assert_eq!(
            error(r#"exe=~"\d+""#),
            r#"at 6: unknown escape \d (quoted values know only \" and \\)"#
        );
    }

    #[test]
    fn invalid_regex_points_at_the_value() {
        let err = parse_matchers(r#"comm="a", exe=~"(""#).unwrap_err();
        assert_eq!(
            err.to_string(),
            r#"at 15: invalid regular expression in exe=~"(""#
        );
        assert!(std::error::Error::source(&err).is_some());
        // `=` and `!=` take the value literally, so the same text is fine.
        assert_eq!(parse(r#"exe="(""#), owned(&[("exe", "=", "(")]));
    }

    /// Found by the `selector` fuzz target: a value that is not a regular
    /// expression on its own was accepted because the anchoring group it is
    /// wrapped in (`^(?:value)$`) balanced its parentheses; `x)|(.*` then
    /// matched every value, unanchored.
    #[test]
    fn a_value_that_only_parses_inside_the_anchoring_group_is_rejected() {
        // The fuzzer's input (profile/fuzz, crash-980a7eb2), its first line.
        let found = "{commm=\"r1is\", ex=~\"ear)i?ide(cai\0*\"}";
        let err = parse_matchers(found).unwrap_err();
        assert!(
            matches!(err, SelectorError::InvalidRegex { ref value, .. } if value == "ear)i?ide(cai\0*"),
            "{err}"
        );
        let err = parse_matchers(r#"exe=~"x)|(.*""#).unwrap_err();
        assert_eq!(
            err.to_string(),
            r#"at 5: invalid regular expression in exe=~"x)|(.*""#
        );
        assert_eq!(
            proto_error("exe", Op::Regex as i32, "x)|(.*"),
            r#"matcher 1: invalid regular expression in exe=~"x)|(.*""#
        );
        // Parentheses that balance inside the value are a group, as before.
        let matchers = parse_matchers(r#"exe=~"(x)|(y)""#).unwrap();
        assert!(matchers[0].matches(Some("y")));
        assert!(!matchers[0].matches(Some("xy")));
    }

    #[test]
    fn format_round_trips() {
        let text = r#"{comm="say \"hi\" \\o/", exe=~".*", pod!="", c!~"x|y"}"#;
        let matchers = parse_matchers(text).unwrap();
        assert_eq!(format_matchers(&matchers), text);
        assert_eq!(format_matchers(&[]), "{}");
    }

    #[test]
    fn label_names() {
        assert!(is_valid_label_name("_"));
        assert!(is_valid_label_name("pod_2"));
        assert!(!is_valid_label_name(""));
        assert!(!is_valid_label_name("2pod"));
        assert!(!is_valid_label_name("k8s.pod"));
    }

    fn selection() -> Selection {
        Selection {
            range: TimeRange {
                start_unix_nanos: 1_000,
                end_unix_nanos: 2_000,
            },
            matchers: parse_matchers(r#"comm="redis",exe=~".*redis.*",pod!="",c!~"x""#).unwrap(),
            profile_type: ProfileType::OffCpu,
        }
    }

    #[test]
    fn selection_proto_round_trip() {
        let proto = selection_to_proto(&selection());
        assert_eq!(
            proto,
            ProtoSelection {
                start_unix_nanos: 1_000,
                end_unix_nanos: 2_000,
                matchers: vec![
                    ProtoMatcher {
                        name: "comm".into(),
                        op: Op::Equal as i32,
                        value: "redis".into()
                    },
                    ProtoMatcher {
                        name: "exe".into(),
                        op: Op::Regex as i32,
                        value: ".*redis.*".into()
                    },
                    ProtoMatcher {
                        name: "pod".into(),
                        op: Op::NotEqual as i32,
                        value: "".into()
                    },
                    ProtoMatcher {
                        name: "c".into(),
                        op: Op::NotRegex as i32,
                        value: "x".into()
                    },
                ],
                profile_type: "off_cpu".into(),
            }
        );
        let back = selection_from_proto(&proto).unwrap();
        assert_eq!(back.range, selection().range);
        assert_eq!(triples(&back.matchers), triples(&selection().matchers));
        assert_eq!(back.profile_type, ProfileType::OffCpu);
        // Empty is CPU (peers from before types); an unknown type is refused.
        let cpu = ProtoSelection {
            profile_type: String::new(),
            ..proto.clone()
        };
        assert_eq!(
            selection_from_proto(&cpu).unwrap().profile_type,
            ProfileType::Cpu
        );
        let unknown = ProtoSelection {
            profile_type: "alloc_space".into(),
            ..proto
        };
        let err = selection_from_proto(&unknown).unwrap_err().to_string();
        assert!(err.contains("\"alloc_space\""), "{err}");
    }

    fn proto_error(name: &str, op: i32, value: &str) -> String {
        let proto = ProtoSelection {
            start_unix_nanos: 0,
            end_unix_nanos: 1,
            matchers: vec![
                ProtoMatcher {
                    name: "ok".into(),
                    op: Op::Equal as i32,
                    value: "x".into(),
                },
                ProtoMatcher {
                    name: name.into(),
                    op,
                    value: value.into(),
                },
            ],
            profile_type: String::new(),
        };
        selection_from_proto(&proto).unwrap_err().to_string()
    }

    #[test]
    fn selection_from_proto_rejects_bad_matchers() {
        assert_eq!(
            proto_error("comm", Op::Unspecified as i32, "x"),
            r#"matcher 1 ("comm"): the operator is unspecified"#
        );
        assert_eq!(
            proto_error("comm", 9, "x"),
            r#"matcher 1 ("comm"): unknown operator 9"#
        );
        assert_eq!(
            proto_error("k8s.pod", Op::Equal as i32, "x"),
            r#"matcher 1: invalid label name "k8s.pod" (expected [a-zA-Z_][a-zA-Z0-9_]*)"#
        );
        assert_eq!(
            proto_error("exe", Op::NotRegex as i32, "(["),
            r#"matcher 1: invalid regular expression in exe!~"([""#
        );
    }
}
