//! Pyroscope's flame graph encoding (`querier.v1.FlameGraph`), what
//! Grafana's flame graph panel draws: a table of names and, per depth, the
//! nodes as `[x offset, total, self, name index]` quadruples.
//!
//! The layout is Pyroscope's: nodes with the same function name under one
//! parent are one node, children are ordered by name and start after their
//! parent's self weight, and a node's x offset is counted from the end of
//! the node before it on the same level (whatever its parent). `names[0]`
//! is `total`, the root.

use std::collections::{BTreeMap, HashMap};

use crate::tree::CallTree;

/// A call tree in Pyroscope's flame graph encoding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlameGraphLevels {
    pub names: Vec<String>,
    /// Per depth, the root's first: `[x offset, total, self, name index]`
    /// per node, by x.
    pub levels: Vec<Vec<i64>>,
    pub total: i64,
    /// The largest self weight of a node drawn.
    pub max_self: i64,
}

/// The name of the node that stands for the children a `max_nodes` bound
/// left out, as Pyroscope names it.
pub const OTHER: &str = "other";

/// A node of the tree merged by name.
#[derive(Default)]
struct Named {
    total: u64,
    self_weight: u64,
    children: BTreeMap<String, usize>,
}

/// `tree` in Pyroscope's encoding, each weight times `scale` (the sample
/// period, for CPU samples in nanoseconds). With more than `max_nodes`
/// nodes (0: no bound), only those at least as heavy as the `max_nodes`-th
/// heaviest are drawn; the rest of a parent's children become one
/// [`OTHER`] node.
pub fn flame_graph_levels(tree: &CallTree, max_nodes: usize, scale: u64) -> FlameGraphLevels {
    // Merge by function name, as Pyroscope's trees are.
    let mut named: Vec<Named> = vec![Named::default()];
    let mut renumbered = vec![0usize; tree.nodes().len()];
    for (index, node) in tree.nodes().iter().enumerate() {
        let at = match node.parent() {
            None => 0,
            Some(parent) => {
                let parent = renumbered[parent];
                let next = named.len();
                let at = *named[parent]
                    .children
                    .entry(node.frame().function.clone())
                    .or_insert(next);
                if at == next {
                    named.push(Named::default());
                }
                at
            }
        };
        renumbered[index] = at;
        named[at].total = named[at].total.saturating_add(node.total());
        named[at].self_weight = named[at].self_weight.saturating_add(node.self_weight());
    }

    let min_total = if max_nodes > 0 && named.len() - 1 > max_nodes {
        let mut totals: Vec<u64> = named[1..].iter().map(|n| n.total).collect();
        totals.sort_unstable_by(|a, b| b.cmp(a));
        totals[max_nodes - 1]
    } else {
        0
    };

    let weight = |w: u64| i64::try_from(w.saturating_mul(scale)).unwrap_or(i64::MAX);
    let mut names = vec!["total".to_owned()];
    let mut name_ids: HashMap<&str, i64> = HashMap::from([("total", 0)]);
    // Absolute x first; offsets are taken once every level is complete.
    let mut levels: Vec<Vec<i64>> = Vec::new();
    let mut max_self = 0i64;
    // Depth first, children left to right (pushed right to left), so each
    // level is filled in x order.
    let mut stack: Vec<(Item<'_>, usize, u64)> = vec![(
        Item::Node {
            index: 0,
            name: "total",
        },
        0,
        0,
    )];
    while let Some((item, depth, x)) = stack.pop() {
        let (total, self_weight, name) = match item {
            Item::Node { index, name } => (named[index].total, named[index].self_weight, name),
            Item::Other { total } => (total, total, OTHER),
        };
        let name_id = *name_ids.entry(name).or_insert_with(|| {
            names.push(name.to_owned());
            names.len() as i64 - 1
        });
        if levels.len() <= depth {
            levels.push(Vec::new());
        }
        max_self = max_self.max(weight(self_weight));
        levels[depth].extend([weight(x), weight(total), weight(self_weight), name_id]);
        let Item::Node { index, .. } = item else {
            continue;
        };
        let mut child_x = x.saturating_add(self_weight);
        let mut children = Vec::new();
        let mut other = 0u64;
        for (child_name, &child) in &named[index].children {
            if named[child].total < min_total {
                other = other.saturating_add(named[child].total);
                continue;
            }
            children.push((
                Item::Node {
                    index: child,
                    name: child_name,
                },
                depth + 1,
                child_x,
            ));
            child_x = child_x.saturating_add(named[child].total);
        }
        if other > 0 {
            children.push((Item::Other { total: other }, depth + 1, child_x));
        }
        stack.extend(children.into_iter().rev());
    }
    for level in &mut levels {
        let mut end = 0i64;
        for node in level.chunks_exact_mut(4) {
            let x = node[0];
            node[0] = x.saturating_sub(end);
            end = x.saturating_add(node[1]);
        }
    }
    FlameGraphLevels {
        names,
        levels,
        total: weight(named[0].total),
        max_self,
    }
}

/// A node to draw: one of the merged tree's, or the children a bound left
/// out.
enum Item<'a> {
    Node { index: usize, name: &'a str },
    Other { total: u64 },
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::model::{Frame, StackSamples, WeightedStack};

    fn tree(stacks: &[(&[&str], u64)]) -> CallTree {
        CallTree::from_stacks(&StackSamples {
            stacks: stacks
                .iter()
                .map(|(frames, weight)| WeightedStack {
                    // Leaf first, as storage hands stacks back.
                    frames: frames
                        .iter()
                        .rev()
                        .map(|f| Arc::new(Frame::synthetic(*f, "bin")))
                        .collect(),
                    weight: *weight,
                })
                .collect(),
            sample_period_nanos: 0,
        })
    }

    #[test]
    fn levels_are_pyroscopes_encoding() {
        // Pyroscope's own example: a;c = 5, a = 1, b = 4.
        let levels = flame_graph_levels(&tree(&[(&["a", "c"], 5), (&["a"], 1), (&["b"], 4)]), 0, 1);
        assert_eq!(levels.names, ["total", "a", "c", "b"]);
        assert_eq!(
            levels.levels,
            [
                vec![0, 10, 0, 0],
                vec![0, 6, 1, 1, 0, 4, 4, 3],
                vec![1, 5, 5, 2]
            ]
        );
        assert_eq!((levels.total, levels.max_self), (10, 5));
    }

    #[test]
    fn offsets_count_from_the_previous_node_of_the_level_and_weights_scale() {
        // x of c under a is 0 + a's self 2 = 2; d under b starts at 6 + 1.
        let levels = flame_graph_levels(
            &tree(&[(&["a"], 2), (&["a", "c"], 4), (&["b"], 1), (&["b", "d"], 3)]),
            0,
            10,
        );
        assert_eq!(levels.names, ["total", "a", "c", "b", "d"]);
        assert_eq!(
            levels.levels,
            [
                vec![0, 100, 0, 0],
                vec![0, 60, 20, 1, 0, 40, 10, 3],
                // c at 20; d at 70, 70 - (20 + 40) = 10 after c's end.
                vec![20, 40, 40, 2, 10, 30, 30, 4],
            ]
        );
        assert_eq!(levels.max_self, 40);
    }

    #[test]
    fn frames_with_one_name_are_one_node() {
        // Two frames named `f` (of two binaries) under one parent.
        let main = Arc::new(Frame::synthetic("main", "bin"));
        let stack = |binary: &str, weight| WeightedStack {
            frames: vec![Arc::new(Frame::synthetic("f", binary)), Arc::clone(&main)],
            weight,
        };
        let samples = CallTree::from_stacks(&StackSamples {
            stacks: vec![stack("bin", 3), stack("libother.so", 2)],
            sample_period_nanos: 0,
        });
        assert_eq!(
            samples.nodes().len(),
            4,
            "two nodes named f in the call tree"
        );
        let levels = flame_graph_levels(&samples, 0, 1);
        assert_eq!(levels.names, ["total", "main", "f"]);
        assert_eq!(levels.levels[2], [0, 5, 5, 2]);
    }

    #[test]
    fn a_node_bound_folds_the_light_children_into_other() {
        let tree = tree(&[(&["a"], 50), (&["b"], 30), (&["c"], 2), (&["d"], 1)]);
        let levels = flame_graph_levels(&tree, 2, 1);
        assert_eq!(levels.names, ["total", "a", "b", OTHER]);
        assert_eq!(levels.levels[1], [0, 50, 50, 1, 0, 30, 30, 2, 0, 3, 3, 3]);
        assert_eq!(levels.total, 83, "the total keeps every sample");
    }

    #[test]
    fn an_empty_tree_is_the_root_alone() {
        let levels = flame_graph_levels(&CallTree::default(), 100, 1);
        assert_eq!(levels.names, ["total"]);
        assert_eq!(levels.levels, [vec![0, 0, 0, 0]]);
        assert_eq!(levels.total, 0);
    }
}
