//! Aligned plain-text tables for terminals: top functions, callers and
//! callees.

use std::borrow::Cow;

use super::top::{CallersCallees, FunctionStat};

/// `SELF  SELF%  TOTAL  TOTAL%  FUNCTION  BINARY`, one row per function,
/// numbers right-aligned, percentages of `total` (the tree's total weight).
pub fn text_top(functions: &[FunctionStat], total: u64) -> String {
    let rows = functions
        .iter()
        .map(|stat| {
            vec![
                stat.self_weight.to_string(),
                percent(stat.self_weight, total),
                stat.total_weight.to_string(),
                percent(stat.total_weight, total),
                one_line(&stat.function).into_owned(),
                one_line(&stat.binary).into_owned(),
            ]
        })
        .collect();
    table(
        &[
            ("SELF", Align::Right),
            ("SELF%", Align::Right),
            ("TOTAL", Align::Right),
            ("TOTAL%", Align::Right),
            ("FUNCTION", Align::Left),
            ("BINARY", Align::Left),
        ],
        rows,
    )
}

/// A function's self and total weight, then its callers and its callees as
/// `WEIGHT  WEIGHT%  FUNCTION` tables, percentages of `total` (the tree's
/// total weight).
pub fn text_callers_callees(report: &CallersCallees, total: u64) -> String {
    let mut out = format!(
        "{}: self {} ({}), total {} ({})\n",
        one_line(&report.function),
        report.self_weight,
        percent(report.self_weight, total),
        report.total,
        percent(report.total, total),
    );
    if report.total == 0 {
        out.push_str("(no stacks contain it)\n");
        return out;
    }
    for (title, list, none) in [
        (
            "CALLERS",
            &report.callers,
            "(none: its stacks start with it)",
        ),
        ("CALLEES", &report.callees, "(none: it calls nothing)"),
    ] {
        out.push('\n');
        out.push_str(title);
        out.push('\n');
        if list.is_empty() {
            out.push_str(none);
            out.push('\n');
            continue;
        }
        let rows = list
            .iter()
            .map(|(name, weight)| {
                vec![
                    weight.to_string(),
                    percent(*weight, total),
                    one_line(name).into_owned(),
                ]
            })
            .collect();
        out.push_str(&table(
            &[
                ("WEIGHT", Align::Right),
                ("WEIGHT%", Align::Right),
                ("FUNCTION", Align::Left),
            ],
            rows,
        ));
    }
    out
}

/// `part` as a percentage of `total` with two decimals; `-` when the total
/// is 0 (no share to speak of).
fn percent(part: u64, total: u64) -> String {
    if total == 0 {
        return "-".to_string();
    }
    format!("{:.2}%", part as f64 * 100.0 / total as f64)
}

/// Control characters (a newline in a symbol name) would break the table.
fn one_line(text: &str) -> Cow<'_, str> {
    if text.chars().any(char::is_control) {
        Cow::Owned(
            text.chars()
                .map(|c| if c.is_control() { ' ' } else { c })
                .collect(),
        )
    } else {
        Cow::Borrowed(text)
    }
}

#[derive(Clone, Copy)]
enum Align {
    Left,
    Right,
}

/// Columns two spaces apart, each as wide as its widest cell (in
/// characters); no trailing spaces.
fn table(headers: &[(&str, Align)], rows: Vec<Vec<String>>) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|(h, _)| h.chars().count()).collect();
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let header: Vec<String> = headers.iter().map(|(h, _)| h.to_string()).collect();
    let mut out = String::new();
    for row in std::iter::once(&header).chain(&rows) {
        let mut line = String::new();
        for (column, cell) in row.iter().enumerate() {
            if column > 0 {
                line.push_str("  ");
            }
            let pad = widths[column].saturating_sub(cell.chars().count());
            match headers[column].1 {
                Align::Right => {
                    line.extend(std::iter::repeat_n(' ', pad));
                    line.push_str(cell);
                }
                Align::Left => {
                    line.push_str(cell);
                    line.extend(std::iter::repeat_n(' ', pad));
                }
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::render::{callers_callees, top_functions};
    use crate::tree::tests::tree;

    #[test]
    fn top_table_is_aligned() {
        let tree = tree(&[
            ("main;compute_checksum", 1234),
            ("main;a", 5),
            ("main;compute_checksum;memcpy", 61),
        ]);
        let top = top_functions(&tree, 10);
        assert_eq!(
            text_top(&top, tree.total()),
            "\
SELF   SELF%  TOTAL   TOTAL%  FUNCTION          BINARY
1234  94.92%   1295   99.62%  compute_checksum  app
  61   4.69%     61    4.69%  memcpy            app
   5   0.38%      5    0.38%  a                 app
   0   0.00%   1300  100.00%  main              app
"
        );
    }

    #[test]
    fn empty_top_is_the_header() {
        assert_eq!(
            text_top(&[], 0),
            "SELF  SELF%  TOTAL  TOTAL%  FUNCTION  BINARY\n"
        );
    }

    #[test]
    fn control_characters_do_not_break_rows() {
        let stat = FunctionStat {
            function: "two\nlines".into(),
            binary: "app".into(),
            self_weight: 1,
            total_weight: 1,
        };
        assert_eq!(
            text_top(&[stat], 0),
            "SELF  SELF%  TOTAL  TOTAL%  FUNCTION   BINARY\n   1      -      1       -  two lines  app\n"
        );
    }

    #[test]
    fn callers_callees_report() {
        let tree = tree(&[
            ("main;parse;lex", 30),
            ("main;parse", 10),
            ("worker;parse;alloc", 60),
        ]);
        let report = callers_callees(&tree, "parse");
        assert_eq!(
            text_callers_callees(&report, tree.total()),
            "\
parse: self 10 (10.00%), total 100 (100.00%)

CALLERS
WEIGHT  WEIGHT%  FUNCTION
    60   60.00%  worker
    40   40.00%  main

CALLEES
WEIGHT  WEIGHT%  FUNCTION
    60   60.00%  alloc
    30   30.00%  lex
"
        );
        let report = callers_callees(&tree, "worker");
        assert_eq!(
            text_callers_callees(&report, tree.total()),
            "\
worker: self 0 (0.00%), total 60 (60.00%)

CALLERS
(none: its stacks start with it)

CALLEES
WEIGHT  WEIGHT%  FUNCTION
    60   60.00%  parse
"
        );
        let report = callers_callees(&tree, "missing");
        assert_eq!(
            text_callers_callees(&report, tree.total()),
            "missing: self 0 (0.00%), total 0 (0.00%)\n(no stacks contain it)\n"
        );
    }
}
