//! Function-level views of a call tree: the top functions by self weight,
//! and one function's callers and callees.
//!
//! Totals count a stack once however often a function recurses in it: on
//! the tree, a node's total is added only when no ancestor on its path is
//! the same function (every stack through the inner node also runs through
//! the outer one).

use std::collections::HashMap;

use serde::Serialize;

use crate::tree::CallTree;

/// The cost of one function of one binary.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FunctionStat {
    pub function: String,
    pub binary: String,
    /// Weight of the stacks whose leaf is this function.
    pub self_weight: u64,
    /// Weight of the stacks that contain it anywhere (once per stack).
    pub total_weight: u64,
}

/// The `limit` costliest functions, keyed by (function, binary): sorted by
/// self weight, then total weight (both descending), then function and
/// binary names. The root is not a function and is left out. Meant for
/// unpruned trees (after [`CallTree::prune`] self weights include the
/// pruned callees).
pub fn top_functions(tree: &CallTree, limit: usize) -> Vec<FunctionStat> {
    let mut stats: HashMap<(&str, &str), (u64, u64)> = HashMap::new();
    let mut on_path: HashMap<(&str, &str), usize> = HashMap::new();
    // Keys of the current node's ancestors, indexed by depth - 1.
    let mut path: Vec<(&str, &str)> = Vec::new();
    for node in tree.nodes().iter().skip(1) {
        while path.len() >= node.depth() {
            if let Some(key) = path.pop()
                && let Some(count) = on_path.get_mut(&key)
            {
                *count -= 1;
            }
        }
        let key = (node.frame().function.as_str(), node.frame().binary.as_str());
        let stat = stats.entry(key).or_default();
        stat.0 = stat.0.saturating_add(node.self_weight());
        let count = on_path.entry(key).or_default();
        if *count == 0 {
            stat.1 = stat.1.saturating_add(node.total());
        }
        *count += 1;
        path.push(key);
    }
    let mut top: Vec<FunctionStat> = stats
        .into_iter()
        .map(
            |((function, binary), (self_weight, total_weight))| FunctionStat {
                function: function.to_string(),
                binary: binary.to_string(),
                self_weight,
                total_weight,
            },
        )
        .collect();
    top.sort_by(|a, b| {
        b.self_weight
            .cmp(&a.self_weight)
            .then(b.total_weight.cmp(&a.total_weight))
            .then_with(|| a.function.cmp(&b.function))
            .then_with(|| a.binary.cmp(&b.binary))
    });
    top.truncate(limit);
    top
}

/// Who calls a function and whom it calls, by function name (all binaries).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CallersCallees {
    pub function: String,
    /// Weight of the stacks whose leaf is the function.
    pub self_weight: u64,
    /// Weight of the stacks that contain it (once per stack).
    pub total: u64,
    /// Calling functions and the weight of the stacks in which each calls
    /// this one (once per stack and caller), heaviest first. Where the
    /// function is the outermost frame it has no caller, so these can sum
    /// to less than `total`; under recursion they can sum to more.
    pub callers: Vec<(String, u64)>,
    /// Called functions and the weight of the stacks in which this one
    /// calls each (once per stack and callee), heaviest first.
    pub callees: Vec<(String, u64)>,
}

/// Callers and callees of `function` (matched by exact name, across
/// binaries). A function the tree does not contain gives zeros and empty
/// lists.
pub fn callers_callees(tree: &CallTree, function: &str) -> CallersCallees {
    let nodes = tree.nodes();
    let (mut self_weight, mut total) = (0u64, 0u64);
    let mut callers: HashMap<&str, u64> = HashMap::new();
    let mut callees: HashMap<&str, u64> = HashMap::new();

    // What each node on the current path marked, indexed by depth - 1, and
    // how often each mark is on the path: a stack (a path) is counted once
    // for the function, once per caller and once per callee.
    struct Marks<'a> {
        function: bool,
        caller: Option<&'a str>,
        callee: Option<&'a str>,
    }
    let mut path: Vec<Marks<'_>> = Vec::new();
    let mut function_on_path = 0usize;
    let mut callers_on_path: HashMap<&str, usize> = HashMap::new();
    let mut callees_on_path: HashMap<&str, usize> = HashMap::new();

    for node in nodes.iter().skip(1) {
        while path.len() >= node.depth() {
            let Some(marks) = path.pop() else { break };
            if marks.function {
                function_on_path -= 1;
            }
            if let Some(count) = marks.caller.and_then(|name| callers_on_path.get_mut(name)) {
                *count -= 1;
            }
            if let Some(count) = marks.callee.and_then(|name| callees_on_path.get_mut(name)) {
                *count -= 1;
            }
        }
        let name = node.frame().function.as_str();
        // The root is not a caller: a function right under it is where the
        // stacks begin.
        let parent = node
            .parent()
            .filter(|&parent| parent != 0)
            .map(|parent| nodes[parent].frame().function.as_str());
        let mut marks = Marks {
            function: false,
            caller: None,
            callee: None,
        };
        if name == function {
            self_weight = self_weight.saturating_add(node.self_weight());
            if function_on_path == 0 {
                total = total.saturating_add(node.total());
            }
            function_on_path += 1;
            marks.function = true;
            if let Some(caller) = parent {
                let count = callers_on_path.entry(caller).or_default();
                if *count == 0 {
                    let weight = callers.entry(caller).or_default();
                    *weight = weight.saturating_add(node.total());
                }
                *count += 1;
                marks.caller = Some(caller);
            }
        }
        if parent == Some(function) {
            let count = callees_on_path.entry(name).or_default();
            if *count == 0 {
                let weight = callees.entry(name).or_default();
                *weight = weight.saturating_add(node.total());
            }
            *count += 1;
            marks.callee = Some(name);
        }
        path.push(marks);
    }

    CallersCallees {
        function: function.to_string(),
        self_weight,
        total,
        callers: sorted(callers),
        callees: sorted(callees),
    }
}

fn sorted(weights: HashMap<&str, u64>) -> Vec<(String, u64)> {
    let mut list: Vec<(String, u64)> = weights
        .into_iter()
        .map(|(name, weight)| (name.to_string(), weight))
        .collect();
    list.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    list
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::tests::{samples, tree};

    fn stat(function: &str, self_weight: u64, total_weight: u64) -> FunctionStat {
        FunctionStat {
            function: function.to_string(),
            binary: "app".to_string(),
            self_weight,
            total_weight,
        }
    }

    fn recursive() -> CallTree {
        tree(&[
            ("main;fib;fib;fib", 10),
            ("main;fib;fib", 5),
            ("main;fib;add", 3),
            ("main;fib;fib;add", 2),
            ("main;print", 4),
            ("main;print;fib", 1),
        ])
    }

    #[test]
    fn top_counts_recursion_once_per_stack() {
        assert_eq!(
            top_functions(&recursive(), 10),
            [
                stat("fib", 16, 21),
                stat("add", 5, 5),
                stat("print", 4, 5),
                stat("main", 0, 25),
            ]
        );
    }

    #[test]
    fn top_limit_and_ties() {
        let tree = tree(&[("main;b", 2), ("main;a", 2), ("main;c;b", 1), ("x", 2)]);
        assert_eq!(
            top_functions(&tree, 3),
            [stat("b", 3, 3), stat("a", 2, 2), stat("x", 2, 2)]
        );
        assert!(top_functions(&tree, 0).is_empty());
        assert!(top_functions(&CallTree::default(), 5).is_empty());
    }

    #[test]
    fn top_keeps_binaries_apart() {
        let tree = CallTree::from_stacks(&samples(&[
            (&[("memcpy", "libc.so.6"), ("main", "app")], 2),
            (&[("memcpy", "app"), ("main", "app")], 2),
        ]));
        let top: Vec<(String, String, u64)> = top_functions(&tree, 10)
            .into_iter()
            .map(|s| (s.function, s.binary, s.self_weight))
            .collect();
        assert_eq!(
            top,
            [
                ("memcpy".into(), "app".into(), 2),
                ("memcpy".into(), "libc.so.6".into(), 2),
                ("main".into(), "app".into(), 0),
            ]
        );
    }

    fn named(list: &[(&str, u64)]) -> Vec<(String, u64)> {
        list.iter().map(|(n, w)| (n.to_string(), *w)).collect()
    }

    #[test]
    fn callers_and_callees_under_recursion() {
        assert_eq!(
            callers_callees(&recursive(), "fib"),
            CallersCallees {
                function: "fib".into(),
                self_weight: 16,
                total: 21,
                // fib calls itself in the 17 weight of stacks at least two
                // deep, counted once each though 10 of them recurse twice.
                callers: named(&[("main", 20), ("fib", 17), ("print", 1)]),
                callees: named(&[("fib", 17), ("add", 5)]),
            }
        );
    }

    #[test]
    fn callers_and_callees_of_a_leaf_and_a_root() {
        let tree = recursive();
        assert_eq!(
            callers_callees(&tree, "add"),
            CallersCallees {
                function: "add".into(),
                self_weight: 5,
                total: 5,
                callers: named(&[("fib", 5)]),
                callees: vec![],
            }
        );
        assert_eq!(
            callers_callees(&tree, "main"),
            CallersCallees {
                function: "main".into(),
                self_weight: 0,
                total: 25,
                callers: vec![],
                callees: named(&[("fib", 20), ("print", 5)]),
            }
        );
        assert_eq!(
            callers_callees(&tree, "missing"),
            CallersCallees {
                function: "missing".into(),
                self_weight: 0,
                total: 0,
                callers: vec![],
                callees: vec![],
            }
        );
    }
}
