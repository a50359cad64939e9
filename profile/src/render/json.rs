//! The call tree as nested JSON, for the web UI and scripts.

use serde_json::{Map, Value, json};

use crate::tree::CallTree;

/// The tree from the root down:
/// `{"name", "binary", "build_id", "file", "line", "inlined", "self",
/// "total", "children": [...]}`, children in the tree's order. Built
/// bottom-up without recursion; depth is bounded by
/// [`MAX_DEPTH`](crate::tree::MAX_DEPTH).
pub fn json(tree: &CallTree) -> Value {
    let nodes = tree.nodes();
    let mut built: Vec<Option<Value>> = vec![None; nodes.len()];
    // Children come after their parent, so walking backwards finds every
    // child already built.
    for (index, node) in nodes.iter().enumerate().rev() {
        let children: Vec<Value> = tree
            .children(index)
            .map(|child| built[child].take().unwrap_or(Value::Null))
            .collect();
        let frame = node.frame();
        let mut object = Map::new();
        object.insert("name".into(), json!(frame.function));
        object.insert("binary".into(), json!(frame.binary));
        object.insert("build_id".into(), json!(frame.build_id));
        object.insert("file".into(), json!(frame.file));
        object.insert("line".into(), json!(frame.line));
        object.insert("inlined".into(), json!(frame.inlined));
        object.insert("self".into(), json!(node.self_weight()));
        object.insert("total".into(), json!(node.total()));
        object.insert("children".into(), Value::Array(children));
        built[index] = Some(Value::Object(object));
    }
    built[0].take().unwrap_or(Value::Null)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::model::{Frame, StackSamples, WeightedStack};
    use crate::tree::tests::frame;

    #[test]
    fn nested_from_the_root() {
        let inlined = Arc::new(Frame {
            function: "helper".into(),
            binary: "app".into(),
            build_id: "abcd".into(),
            file: "src/lib.rs".into(),
            line: 7,
            inlined: true,
            unnamed_code: None,
        });
        let tree = CallTree::from_stacks(&StackSamples {
            stacks: vec![
                WeightedStack {
                    frames: vec![inlined, frame("main", "app")],
                    weight: 2,
                },
                WeightedStack {
                    frames: vec![frame("main", "app")],
                    weight: 1,
                },
            ],
            sample_period_nanos: 0,
        });
        assert_eq!(
            json(&tree),
            json!({
                "name": "all", "binary": "", "build_id": "", "file": "", "line": 0,
                "inlined": false, "self": 0, "total": 3,
                "children": [{
                    "name": "main", "binary": "app", "build_id": "", "file": "", "line": 0,
                    "inlined": false, "self": 1, "total": 3,
                    "children": [{
                        "name": "helper", "binary": "app", "build_id": "abcd",
                        "file": "src/lib.rs", "line": 7, "inlined": true,
                        "self": 2, "total": 2, "children": []
                    }]
                }]
            })
        );
    }

    #[test]
    fn empty_tree_is_the_root_alone() {
        assert_eq!(
            json(&CallTree::default()),
            json!({
                "name": "all", "binary": "", "build_id": "", "file": "", "line": 0,
                "inlined": false, "self": 0, "total": 0, "children": []
            })
        );
    }
}
