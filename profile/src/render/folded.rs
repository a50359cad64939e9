//! Folded stacks (`main;a;b 42`), the line format of Brendan Gregg's
//! `flamegraph.pl` and inferno, and what the SVG renderers feed inferno.

use std::borrow::Cow;
use std::collections::BTreeMap;

use crate::tree::CallTree;

/// One line per distinct root-to-node path (root left out) whose node has
/// self weight, `frame;frame;… weight\n`, sorted bytewise. Frames are named
/// by [`folded_name`]; inlined frames appear like any other. Paths that
/// differ only in fields the names leave out (binary, line) are merged into
/// one line. The root's own self weight (empty stacks) has no path and is
/// left out.
pub fn folded(tree: &CallTree) -> String {
    let mut out = String::new();
    for (stack, weight) in folded_counts(tree) {
        out.push_str(&stack);
        out.push(' ');
        out.push_str(&weight.to_string());
        out.push('\n');
    }
    out
}

/// Folded stacks and their weights, merged and sorted.
pub(crate) fn folded_counts(tree: &CallTree) -> BTreeMap<String, u64> {
    let mut counts = BTreeMap::new();
    // The names on the path to the current node, indexed by depth - 1.
    let mut path: Vec<Cow<'_, str>> = Vec::new();
    for node in tree.nodes().iter().skip(1) {
        path.truncate(node.depth() - 1);
        path.push(folded_name(&node.frame().function));
        if node.self_weight() > 0 {
            let weight: &mut u64 = counts.entry(path.join(";")).or_default();
            *weight = weight.saturating_add(node.self_weight());
        }
    }
    counts
}

/// A function name made safe for the folded format, where `;` separates
/// frames, a line ends at a newline, and the count is whatever follows the
/// last space:
/// - `;` becomes `,` (so Rust's `[u8; 8]` reads `[u8, 8]`);
/// - control characters (newlines, tabs) become spaces, and the name is
///   trimmed (readers trim lines, so edge spaces would not survive);
/// - a name whose last space-separated word looks like a count (`f 12`)
///   gets `_` for that space, or readers would take the word for a second
///   (differential) count column;
/// - an empty name becomes `[unknown]`.
pub fn folded_name(function: &str) -> Cow<'_, str> {
    let clean = |c: char| c != ';' && !c.is_control();
    let needs_work = function.is_empty()
        || !function.chars().all(clean)
        || function.trim() != function
        || ends_with_count(function);
    if !needs_work {
        return Cow::Borrowed(function);
    }
    let replaced: String = function
        .chars()
        .map(|c| match c {
            ';' => ',',
            c if c.is_control() => ' ',
            c => c,
        })
        .collect();
    let mut name = replaced.trim().to_string();
    if name.is_empty() {
        return Cow::Borrowed("[unknown]");
    }
    if ends_with_count(&name)
        && let Some(space) = name.rfind(' ')
    {
        name.replace_range(space..=space, "_");
    }
    Cow::Owned(name)
}

/// Whether the text after the last space is something inferno and
/// `flamegraph.pl` would parse as a sample count (digits, at most one dot).
fn ends_with_count(name: &str) -> bool {
    match name.rfind(' ') {
        None => false,
        Some(space) => {
            let word = &name[space + 1..];
            !word.is_empty()
                && word.chars().all(|c| c.is_ascii_digit() || c == '.')
                && word.chars().filter(|&c| c == '.').count() <= 1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::tests::tree;

    #[test]
    fn folded_lines_are_sorted_with_self_weights() {
        let tree = tree(&[
            ("main;a;b;c", 42),
            ("main;a", 2),
            ("main;a;b;c", 1),
            ("init", 4),
            ("", 9),
        ]);
        assert_eq!(folded(&tree), "init 4\nmain;a 2\nmain;a;b;c 43\n");
    }

    #[test]
    fn empty_tree_folds_to_nothing() {
        assert_eq!(folded(&CallTree::default()), "");
        assert_eq!(folded(&tree(&[("", 3)])), "");
    }

    #[test]
    fn names_are_sanitized() {
        assert_eq!(folded_name("main"), "main");
        assert_eq!(folded_name("[unknown] app+0x1f"), "[unknown] app+0x1f");
        assert_eq!(folded_name("<[u8; 8]>::fmt"), "<[u8, 8]>::fmt");
        assert_eq!(folded_name("two\nlines\r\tx"), "two lines  x");
        assert_eq!(folded_name(" padded\n"), "padded");
        assert_eq!(folded_name("operator new 2"), "operator new_2");
        assert_eq!(folded_name("v 1.5"), "v_1.5");
        assert_eq!(folded_name("v 1.2.3"), "v 1.2.3");
        assert_eq!(folded_name(""), "[unknown]");
        assert_eq!(folded_name("\n"), "[unknown]");
    }

    #[test]
    fn frames_with_the_same_name_share_a_line() {
        let samples = crate::tree::tests::samples(&[
            (&[("memcpy", "libc.so.6"), ("main", "app")], 2),
            (&[("memcpy", "app"), ("main", "app")], 3),
            (&[("x;y", "app"), ("main", "app")], 1),
        ]);
        assert_eq!(
            folded(&CallTree::from_stacks(&samples)),
            "main;memcpy 5\nmain;x,y 1\n"
        );
    }
}
