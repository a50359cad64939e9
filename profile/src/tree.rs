//! The merged call tree of a set of weighted stacks.
//!
//! Owns [`CallTree`]: building it from storage's leaf-first stacks, pruning
//! it for display, and carrying it over the wire as a
//! `stackscope.v1.FlamegraphResponse` (and validating one that arrives, since
//! it comes from the network). Does not own any rendering (see
//! `render`).
//!
//! Shape and invariants, which every constructor upholds and every renderer
//! relies on:
//! - node 0 is the root, a synthetic frame named [`ROOT_FUNCTION`];
//! - nodes are in depth-first order, parents before children, and each
//!   node's children are in [`Frame`] order (function name, then binary,
//!   then the remaining fields), so equal trees are equal values and every
//!   rendering is deterministic;
//! - siblings have distinct frames: children are keyed by the whole frame,
//!   so the same function in two binaries (or at two lines) stays apart;
//! - `self = total − Σ children totals` at every node;
//! - no node is deeper than [`MAX_DEPTH`].

use std::collections::HashMap;
use std::sync::Arc;

use stackscope_proto::v1::{FlamegraphResponse, Frame as ProtoFrame, TreeNode};

use crate::model::{Frame, StackSamples};

/// The function name of the synthetic root frame.
pub const ROOT_FUNCTION: &str = "all";

/// The function name of the synthetic frame that stands for the frames cut
/// off a stack deeper than [`MAX_DEPTH`].
pub const TRUNCATED_FUNCTION: &str = "[truncated]";

/// The deepest node a tree holds (the root is at depth 0).
///
/// Real stacks stay far below it (the agent copies at most 32 KiB of user
/// stack plus 127 kernel frames); the limit exists so that a tree received
/// from the network cannot make the renderers, whose nested outputs (JSON)
/// are dropped and serialized recursively, exhaust the thread's stack.
pub const MAX_DEPTH: usize = 4096;

/// The frame of the root node.
pub(crate) fn root_frame() -> Frame {
    Frame::synthetic(ROOT_FUNCTION, "")
}

/// One node of a [`CallTree`]: a frame reached by one particular path from
/// the root.
///
/// Indexes are kept as `u32`: a fleet-wide tree has hundreds of thousands
/// of nodes, and a smaller node is less memory to fill and free; a tree
/// of 2^32 nodes could not be held in memory anyway.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    frame: Arc<Frame>,
    total: u64,
    self_weight: u64,
    /// Index of the parent; [`NO_PARENT`] for the root.
    parent: u32,
    depth: u32,
    /// Where the node's children lie in [`CallTree::children`]'s list.
    children_start: u32,
    children_end: u32,
}

/// [`Node::parent`] of the root.
const NO_PARENT: u32 = u32::MAX;

impl Node {
    /// A node without children yet (see [`CallTree::linked`]).
    fn new(frame: Arc<Frame>, parent: u32, depth: u32, total: u64, self_weight: u64) -> Self {
        Node {
            frame,
            total,
            self_weight,
            parent,
            depth,
            children_start: 0,
            children_end: 0,
        }
    }

    pub fn frame(&self) -> &Frame {
        &self.frame
    }

    /// Index of the parent; `None` for the root.
    pub fn parent(&self) -> Option<usize> {
        (self.parent != NO_PARENT).then_some(self.parent as usize)
    }

    /// Distance from the root (the root is 0, its children 1).
    pub fn depth(&self) -> usize {
        self.depth as usize
    }

    /// Weight of the stacks that pass through this node.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Weight of the stacks that end here: `total − Σ children totals`.
    /// After [`CallTree::prune`] this includes the pruned children.
    pub fn self_weight(&self) -> u64 {
        self.self_weight
    }
}

/// A `FlamegraphResponse` does not describe a valid call tree. Indexes are
/// positions in `FlamegraphResponse.nodes`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TreeError {
    #[error("the tree has no nodes (node 0 must be the root)")]
    NoRoot,
    #[error("node 0 is the root and must be its own parent, but its parent is {parent}")]
    RootParent { parent: u32 },
    #[error("node {index}: its parent {parent} does not come before it")]
    ParentNotBefore { index: usize, parent: u32 },
    #[error(
        "node {index}: no frame inline, and its frame index {frame_index} is not in the table \
         of {frames} frames"
    )]
    MissingFrame {
        index: usize,
        frame_index: u32,
        frames: usize,
    },
    #[error("node {index}: deeper than the limit of {max} frames")]
    TooDeep { index: usize, max: usize },
    #[error("node {index}: node {parent} already has a child with the same frame")]
    DuplicateChild { index: usize, parent: usize },
    #[error("node {index}: its children total {children}, more than its own total {total}")]
    ChildrenExceedTotal {
        index: usize,
        total: u64,
        children: u128,
    },
    #[error(
        "node {index}: self is {self_weight}, but total minus the children's totals is {expected}"
    )]
    InconsistentSelf {
        index: usize,
        self_weight: u64,
        expected: u64,
    },
    #[error("the response's total is {total}, but the root's total is {root}")]
    TotalMismatch { total: u64, root: u64 },
}

/// A merged call tree: see the module documentation for its invariants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallTree {
    nodes: Vec<Node>,
    /// Every node's children, one run per parent (see [`Node`]): one list
    /// rather than a vector per node, whose allocations and frees took a
    /// good part of a fleet-wide query.
    children: Vec<u32>,
}

impl Default for CallTree {
    /// The tree of no samples: just the root, with weight 0.
    fn default() -> Self {
        Builder::new(Arc::new(root_frame())).finish()
    }
}

impl CallTree {
    /// Merges stacks (leaf first, as storage returns them) into a tree
    /// (root first). Stacks of weight 0 are left out; an empty stack adds
    /// to the root's self weight. A stack deeper than [`MAX_DEPTH`] keeps
    /// its outermost frames and ends in a [`TRUNCATED_FUNCTION`] frame, so
    /// its weight stays visible without being charged to a wrong leaf.
    /// Weights that sum beyond `u64::MAX` saturate.
    ///
    /// Each stack becomes its frames' ranks in frame order, root first; the
    /// stacks sorted by them come in the tree's own order (depth first,
    /// siblings in frame order), so each adds nodes at the end of the list
    /// from where it parts from the one before: no map of children, no
    /// second pass to lay the tree out.
    pub fn from_stacks(samples: &StackSamples) -> CallTree {
        let truncated = Arc::new(Frame::synthetic(TRUNCATED_FUNCTION, ""));
        let mut numbers = FrameNumbers::default();
        // Every kept stack's frame numbers, root first, one after another;
        // each stack's run in it and its weight.
        let mut paths: Vec<u32> = Vec::new();
        let mut stacks: Vec<(usize, usize, u64)> = Vec::with_capacity(samples.stacks.len());
        for stack in &samples.stacks {
            if stack.weight == 0 {
                continue;
            }
            let frames = &stack.frames;
            let (kept, cut) = if frames.len() > MAX_DEPTH {
                (&frames[frames.len() - (MAX_DEPTH - 1)..], true)
            } else {
                (&frames[..], false)
            };
            let start = paths.len();
            for frame in kept.iter().rev().chain(cut.then_some(&truncated)) {
                paths.push(numbers.number(frame));
            }
            stacks.push((start, paths.len(), stack.weight));
        }
        let (frames, rank) = numbers.in_frame_order();
        for number in &mut paths {
            *number = rank[*number as usize];
        }
        stacks.sort_unstable_by(|a, b| paths[a.0..a.1].cmp(&paths[b.0..b.1]));

        let mut nodes = vec![Node::new(Arc::new(root_frame()), NO_PARENT, 0, 0, 0)];
        // The nodes of the last stack's path, below the root.
        let mut path: Vec<u32> = Vec::new();
        let mut previous: &[u32] = &[];
        for &(start, end, weight) in &stacks {
            let ranks = &paths[start..end];
            let shared = ranks
                .iter()
                .zip(previous)
                .take_while(|(a, b)| a == b)
                .count();
            path.truncate(shared);
            add(&mut nodes[0].total, weight);
            for &node in &path {
                add(&mut nodes[node as usize].total, weight);
            }
            for (depth, &rank) in ranks.iter().enumerate().skip(shared) {
                let parent = path.last().copied().unwrap_or(0);
                path.push(compact_index(nodes.len()));
                nodes.push(Node::new(
                    Arc::clone(&frames[rank as usize]),
                    parent,
                    compact_index(depth + 1),
                    weight,
                    0,
                ));
            }
            let leaf = path.last().copied().unwrap_or(0) as usize;
            add(&mut nodes[leaf].self_weight, weight);
            previous = ranks;
        }
        CallTree::linked(nodes)
    }

    /// The tree of `nodes`, given depth first with each one's parent and
    /// siblings in frame order: each node's children listed.
    fn linked(mut nodes: Vec<Node>) -> CallTree {
        let mut counts = vec![0u32; nodes.len()];
        for node in &nodes[1..] {
            counts[node.parent as usize] += 1;
        }
        let mut start = 0;
        for (node, count) in nodes.iter_mut().zip(counts) {
            node.children_start = start;
            node.children_end = start;
            start += count;
        }
        // In node order, so each parent's children come in frame order.
        let mut children = vec![0u32; nodes.len() - 1];
        for index in 1..nodes.len() {
            let parent = nodes[index].parent as usize;
            let parent = &mut nodes[parent];
            children[parent.children_end as usize] = compact_index(index);
            parent.children_end += 1;
        }
        CallTree { nodes, children }
    }

    /// Total weight of the tree (the root's total).
    pub fn total(&self) -> u64 {
        self.nodes[0].total
    }

    /// Whether the tree holds no weight at all.
    pub fn is_empty(&self) -> bool {
        self.total() == 0
    }

    /// All nodes, root first, in depth-first order (parents before
    /// children). Never empty.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    pub fn root(&self) -> &Node {
        &self.nodes[0]
    }

    pub fn node(&self, index: usize) -> Option<&Node> {
        self.nodes.get(index)
    }

    /// Indexes of node `index`'s children, in frame order (none for an
    /// unknown index).
    pub fn children(&self, index: usize) -> impl ExactSizeIterator<Item = usize> + '_ {
        let run = self.nodes.get(index).map_or(0..0, |node| {
            node.children_start as usize..node.children_end as usize
        });
        self.children[run].iter().map(|&child| child as usize)
    }

    /// The frames from the root's child down to `index` (root-first; the
    /// root itself is left out). Empty for the root or an unknown index.
    pub fn path(&self, index: usize) -> Vec<&Frame> {
        let mut path = Vec::new();
        let mut current = self.nodes.get(index);
        while let Some(node) = current {
            let Some(parent) = node.parent() else { break };
            path.push(node.frame());
            current = self.nodes.get(parent);
        }
        path.reverse();
        path
    }

    /// The first node (in node order) reached from the root through
    /// children with these function names.
    pub fn find(&self, functions: &[&str]) -> Option<usize> {
        let mut index = 0;
        for function in functions {
            index = self
                .children(index)
                .find(|&child| self.nodes[child].frame.function == *function)?;
        }
        Some(index)
    }

    /// The tree without the subtrees whose total is below `min_share` of
    /// the root's total (so 0.05 keeps nodes with at least 5% inclusive
    /// cost). Totals stay as they were, so the weight of a dropped subtree
    /// shows as its parent's self weight (the remainder a flamegraph draws
    /// beside the children). For display: self weights after pruning are not
    /// what `render::top_functions` should
    /// be computed from. `min_share` of 0, below 0, or NaN keeps everything.
    pub fn prune(&self, min_share: f64) -> CallTree {
        if min_share.is_nan() || min_share <= 0.0 {
            return self.clone();
        }
        let threshold = min_share * self.total() as f64;
        let mut renumbered: Vec<Option<u32>> = vec![None; self.nodes.len()];
        let mut nodes: Vec<Node> = Vec::with_capacity(self.nodes.len());
        // Filtering a depth-first order keeps it depth-first, and children
        // keep their relative order.
        for (index, node) in self.nodes.iter().enumerate() {
            let parent = match node.parent() {
                None => NO_PARENT,
                Some(parent) => match renumbered[parent] {
                    Some(parent) if node.total as f64 >= threshold => parent,
                    _ => continue,
                },
            };
            renumbered[index] = Some(compact_index(nodes.len()));
            nodes.push(Node::new(
                Arc::clone(&node.frame),
                parent,
                node.depth,
                node.total,
                0,
            ));
        }
        let mut tree = CallTree::linked(nodes);
        for index in 0..tree.nodes.len() {
            let children = tree.children(index).fold(0u64, |sum, child| {
                sum.saturating_add(tree.nodes[child].total)
            });
            tree.nodes[index].self_weight = tree.nodes[index].total.saturating_sub(children);
        }
        tree
    }

    /// The tree as a `FlamegraphResponse`: nodes in this tree's order, the
    /// root its own parent, each distinct frame once in the frame table.
    pub fn to_proto(&self, sample_period_nanos: u64) -> FlamegraphResponse {
        // A tree's nodes share their frames' allocations (one per distinct
        // frame), so the table is keyed by address; an equal frame in
        // another allocation only costs a second entry.
        let mut numbers: HashMap<usize, u32, foldhash::fast::FixedState> = HashMap::default();
        let mut frames = Vec::new();
        let nodes = self
            .nodes
            .iter()
            .map(|node| {
                let frame_index = *numbers
                    .entry(Arc::as_ptr(&node.frame) as usize)
                    .or_insert_with(|| {
                        frames.push(frame_to_proto(&node.frame));
                        compact_index(frames.len() - 1)
                    });
                TreeNode {
                    // A tree with more than 2^32 nodes cannot be built in
                    // memory in practice; if it were, u32::MAX makes
                    // `from_proto` reject the message instead of
                    // misreading it.
                    parent: node.parent().map_or(0, compact_index),
                    frame: None,
                    frame_index,
                    total: node.total,
                    self_: node.self_weight,
                }
            })
            .collect();
        FlamegraphResponse {
            nodes,
            total: self.total(),
            sample_period_nanos,
            frames,
            profile_type: String::new(),
        }
    }

    /// Reads a `FlamegraphResponse`, checking everything a peer could get
    /// wrong: a root at index 0 that is its own parent, every other parent
    /// before its child, a frame on every non-root node, no two siblings
    /// with the same frame, depth within [`MAX_DEPTH`], children totals
    /// within their parent's, `self = total − Σ children totals`, and the
    /// response total equal to the root's. Sibling order need not be
    /// canonical: the result is put in canonical order. The root's frame is
    /// taken as sent ([`root_frame`] when missing).
    pub fn from_proto(response: &FlamegraphResponse) -> Result<CallTree, TreeError> {
        let nodes = &response.nodes;
        let root = nodes.first().ok_or(TreeError::NoRoot)?;
        if root.parent != 0 {
            return Err(TreeError::RootParent {
                parent: root.parent,
            });
        }
        // Each table frame is read once and shared by its nodes.
        let table: Vec<Arc<Frame>> = response
            .frames
            .iter()
            .map(|frame| Arc::new(frame_from_proto(frame)))
            .collect();
        let frame_of = |node: &TreeNode| -> Option<Arc<Frame>> {
            match &node.frame {
                Some(frame) => Some(Arc::new(frame_from_proto(frame))),
                None => table.get(node.frame_index as usize).cloned(),
            }
        };
        let root_frame = frame_of(root).unwrap_or_else(|| Arc::new(root_frame()));
        let mut builder = Builder::new(root_frame);
        builder.set_weights(0, root.total, root.self_);

        // Per message index: the builder's index, the depth, and the sum of
        // the children's totals (u128: cannot overflow for any message).
        let mut draft = Vec::with_capacity(nodes.len());
        let mut depth = Vec::with_capacity(nodes.len());
        let mut children = vec![0u128; nodes.len()];
        draft.push(0usize);
        depth.push(0usize);
        for (index, node) in nodes.iter().enumerate().skip(1) {
            let parent = node.parent as usize;
            if parent >= index {
                return Err(TreeError::ParentNotBefore {
                    index,
                    parent: node.parent,
                });
            }
            let node_depth = depth[parent] + 1;
            if node_depth > MAX_DEPTH {
                return Err(TreeError::TooDeep {
                    index,
                    max: MAX_DEPTH,
                });
            }
            let frame = frame_of(node).ok_or(TreeError::MissingFrame {
                index,
                frame_index: node.frame_index,
                frames: table.len(),
            })?;
            let new = builder
                .new_child(draft[parent], frame)
                .ok_or(TreeError::DuplicateChild { index, parent })?;
            builder.set_weights(new, node.total, node.self_);
            draft.push(new);
            depth.push(node_depth);
            children[parent] += u128::from(node.total);
        }
        for (index, node) in nodes.iter().enumerate() {
            let expected = u128::from(node.total).checked_sub(children[index]).ok_or(
                TreeError::ChildrenExceedTotal {
                    index,
                    total: node.total,
                    children: children[index],
                },
            )?;
            // expected <= node.total, so it fits.
            let expected = expected as u64;
            if node.self_ != expected {
                return Err(TreeError::InconsistentSelf {
                    index,
                    self_weight: node.self_,
                    expected,
                });
            }
        }
        if response.total != root.total {
            return Err(TreeError::TotalMismatch {
                total: response.total,
                root: root.total,
            });
        }
        Ok(builder.finish())
    }
}

/// The wire form of a frame.
pub(crate) fn frame_to_proto(frame: &Frame) -> ProtoFrame {
    ProtoFrame {
        function: frame.function.clone(),
        binary: frame.binary.clone(),
        build_id: frame.build_id.clone(),
        file: frame.file.clone(),
        line: frame.line,
        inlined: frame.inlined,
    }
}

/// A frame from its wire form.
pub(crate) fn frame_from_proto(frame: &ProtoFrame) -> Frame {
    Frame {
        function: frame.function.clone(),
        binary: frame.binary.clone(),
        build_id: frame.build_id.clone(),
        file: frame.file.clone(),
        line: frame.line,
        inlined: frame.inlined,
        unnamed_code: None,
    }
}

/// Numbers frames by value (equal frames from different allocations are
/// one number) and remembers them by pointer, so a frame shared by many
/// stacks (storage hands out one `Arc` per location) is hashed by content
/// only once: a fleet-wide tree is built from millions of frame visits.
#[derive(Default)]
struct FrameNumbers {
    /// Distinct frames by number.
    frames: Vec<Arc<Frame>>,
    by_value: FastMap<Arc<Frame>, u32>,
    /// Frame numbers by the address of an `Arc` seen before.
    by_pointer: FastMap<usize, u32>,
    /// Every `Arc` whose address `by_pointer` holds, kept alive so that no
    /// address can be reused for another frame meanwhile.
    seen: Vec<Arc<Frame>>,
}

impl FrameNumbers {
    /// The number of `frame`'s value.
    fn number(&mut self, frame: &Arc<Frame>) -> u32 {
        let address = Arc::as_ptr(frame) as usize;
        if let Some(&number) = self.by_pointer.get(&address) {
            return number;
        }
        let number = match self.by_value.get(frame) {
            Some(&number) => number,
            None => {
                let number = compact_index(self.frames.len());
                self.frames.push(Arc::clone(frame));
                self.by_value.insert(Arc::clone(frame), number);
                number
            }
        };
        self.by_pointer.insert(address, number);
        self.seen.push(Arc::clone(frame));
        number
    }

    /// The distinct frames in frame order, and each number's rank in it.
    fn in_frame_order(self) -> (Vec<Arc<Frame>>, Vec<u32>) {
        let frames = self.frames;
        let mut order: Vec<u32> = (0..compact_index(frames.len())).collect();
        order.sort_unstable_by(|&a, &b| frames[a as usize].cmp(&frames[b as usize]));
        let mut rank = vec![0u32; frames.len()];
        for (position, &number) in order.iter().enumerate() {
            rank[number as usize] = compact_index(position);
        }
        let in_order = order
            .iter()
            .map(|&number| Arc::clone(&frames[number as usize]))
            .collect();
        (in_order, rank)
    }
}

/// Weights that sum beyond `u64::MAX` saturate.
fn add(sum: &mut u64, weight: u64) {
    *sum = sum.saturating_add(weight);
}

/// A node while the tree is being built, in insertion order.
struct Draft {
    /// Index into `Builder::numbers`' frames.
    frame: u32,
    total: u64,
    self_weight: u64,
}

type FastMap<K, V> = HashMap<K, V, foldhash::fast::FixedState>;

/// Builds a tree from nodes given in any sibling order (a tree received
/// from the network), refusing a second child with the same frame, and
/// then lays it out canonically, so that [`CallTree`] values built from
/// the same content are equal. Children are found in one hash map by
/// (parent, frame number): a visit hashes two integers instead of
/// comparing frames' strings.
struct Builder {
    drafts: Vec<Draft>,
    numbers: FrameNumbers,
    /// (parent draft, frame number) -> child draft.
    children: FastMap<(u32, u32), u32>,
}

impl Builder {
    fn new(root: Arc<Frame>) -> Self {
        let mut builder = Builder {
            drafts: Vec::new(),
            numbers: FrameNumbers::default(),
            children: FastMap::default(),
        };
        let frame = builder.numbers.number(&root);
        builder.drafts.push(Draft {
            frame,
            total: 0,
            self_weight: 0,
        });
        builder
    }

    /// A new child of `parent`; `None` if it already has one with this frame.
    fn new_child(&mut self, parent: usize, frame: Arc<Frame>) -> Option<usize> {
        let frame = self.numbers.number(&frame);
        let next = self.drafts.len();
        let child = *self
            .children
            .entry((compact_index(parent), frame))
            .or_insert(compact_index(next));
        if child as usize != next {
            return None;
        }
        self.drafts.push(Draft {
            frame,
            total: 0,
            self_weight: 0,
        });
        Some(next)
    }

    fn set_weights(&mut self, node: usize, total: u64, self_weight: u64) {
        self.drafts[node].total = total;
        self.drafts[node].self_weight = self_weight;
    }

    /// The tree in depth-first order with each node's children in frame
    /// order.
    fn finish(self) -> CallTree {
        let (frames, rank) = self.numbers.in_frame_order();
        // Every (parent, child) edge, grouped by parent and in frame order
        // within it: the children of draft p are edges[start[p]..start[p + 1]].
        let mut edges: Vec<(u32, u32, u32)> = self
            .children
            .iter()
            .map(|(&(parent, frame), &child)| (parent, rank[frame as usize], child))
            .collect();
        edges.sort_unstable();
        let mut start = vec![0usize; self.drafts.len() + 1];
        for &(parent, _, _) in &edges {
            start[parent as usize + 1] += 1;
        }
        for i in 1..start.len() {
            start[i] += start[i - 1];
        }

        let mut nodes: Vec<Node> = Vec::with_capacity(self.drafts.len());
        let mut pending = vec![(0usize, NO_PARENT, 0u32)];
        while let Some((draft_at, parent, depth)) = pending.pop() {
            let index = compact_index(nodes.len());
            let draft = &self.drafts[draft_at];
            nodes.push(Node::new(
                Arc::clone(&frames[rank[draft.frame as usize] as usize]),
                parent,
                depth,
                draft.total,
                draft.self_weight,
            ));
            // Reversed, so the first child is taken (and numbered) first.
            for &(_, _, child) in edges[start[draft_at]..start[draft_at + 1]].iter().rev() {
                pending.push((child as usize, index, depth + 1));
            }
        }
        CallTree::linked(nodes)
    }
}

/// An index or count as a tree keeps it (see [`Node`]). A tree of more
/// than 2^32 nodes cannot be held in memory (each node is tens of bytes).
fn compact_index(index: usize) -> u32 {
    u32::try_from(index).unwrap_or(u32::MAX)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::model::WeightedStack;

    pub(crate) fn frame(function: &str, binary: &str) -> Arc<Frame> {
        Arc::new(Frame {
            function: function.to_string(),
            binary: binary.to_string(),
            build_id: String::new(),
            file: String::new(),
            line: 0,
            inlined: false,
            unnamed_code: None,
        })
    }

    /// A stack written root first (`"main;a;b"`, as people read them), all
    /// frames in binary `app`.
    /// Stacks given as (function, binary) frames, leaf first, and weights.
    pub(crate) fn samples(stacks: &[(&[(&str, &str)], u64)]) -> StackSamples {
        StackSamples {
            stacks: stacks
                .iter()
                .map(|&(frames, weight)| WeightedStack {
                    frames: frames.iter().map(|&(f, b)| frame(f, b)).collect(),
                    weight,
                })
                .collect(),
            sample_period_nanos: 0,
        }
    }

    pub(crate) fn stack(path: &str, weight: u64) -> WeightedStack {
        WeightedStack {
            frames: path
                .split(';')
                .filter(|f| !f.is_empty())
                .rev()
                .map(|f| frame(f, "app"))
                .collect(),
            weight,
        }
    }

    pub(crate) fn tree(stacks: &[(&str, u64)]) -> CallTree {
        CallTree::from_stacks(&StackSamples {
            stacks: stacks.iter().map(|(p, w)| stack(p, *w)).collect(),
            sample_period_nanos: 10_000_000,
        })
    }

    /// Every node as (root-first path, total, self), in node order.
    pub(crate) fn summary(tree: &CallTree) -> Vec<(String, u64, u64)> {
        tree.nodes()
            .iter()
            .enumerate()
            .map(|(index, node)| {
                let path: Vec<&str> = tree
                    .path(index)
                    .iter()
                    .map(|f| f.function.as_str())
                    .collect();
                (path.join(";"), node.total(), node.self_weight())
            })
            .collect()
    }

    fn expect(rows: &[(&str, u64, u64)]) -> Vec<(String, u64, u64)> {
        rows.iter()
            .map(|(p, t, s)| (p.to_string(), *t, *s))
            .collect()
    }

    #[test]
    fn from_stacks_merges_root_first() {
        let tree = tree(&[
            ("main;a;b", 3),
            ("main;a", 2),
            ("main;c", 5),
            ("main;a;b", 1),
            ("main;zero", 0),
            ("", 1),
            ("init", 4),
        ]);
        assert_eq!(
            summary(&tree),
            expect(&[
                ("", 16, 1),
                ("init", 4, 4),
                ("main", 11, 0),
                ("main;a", 6, 2),
                ("main;a;b", 4, 4),
                ("main;c", 5, 5),
            ])
        );
        assert_eq!(tree.total(), 16);
        assert_eq!(tree.root().frame(), &root_frame());
        assert_eq!(tree.root().parent(), None);
        let b = tree.find(&["main", "a", "b"]).unwrap();
        assert_eq!(b, 4);
        assert_eq!(tree.nodes()[b].depth(), 3);
        assert_eq!(tree.nodes()[b].parent(), Some(3));
        assert_eq!(tree.children(2).collect::<Vec<_>>(), [3, 5]);
        assert_eq!(tree.children(4).len(), 0);
        assert_eq!(tree.children(99).len(), 0, "an unknown node");
        assert_eq!(tree.find(&["main", "zero"]), None);
    }

    #[test]
    fn same_function_in_two_binaries_stays_apart_in_order() {
        let samples = samples(&[
            (&[("memcpy", "libc.so.6"), ("main", "app")], 2),
            (&[("memcpy", "app"), ("main", "app")], 3),
            (&[("alloc", "zlib.so"), ("main", "app")], 1),
        ]);
        let tree = CallTree::from_stacks(&samples);
        let children: Vec<(&str, &str, u64)> = tree
            .children(1)
            .map(|c| {
                let node = &tree.nodes()[c];
                (
                    node.frame().function.as_str(),
                    node.frame().binary.as_str(),
                    node.total(),
                )
            })
            .collect();
        assert_eq!(
            children,
            [
                ("alloc", "zlib.so", 1),
                ("memcpy", "app", 3),
                ("memcpy", "libc.so.6", 2)
            ]
        );
    }

    #[test]
    fn empty_tree_is_just_the_root() {
        let tree = CallTree::from_stacks(&StackSamples::default());
        assert_eq!(tree, CallTree::default());
        assert_eq!(summary(&tree), expect(&[("", 0, 0)]));
        assert!(tree.is_empty());
        assert_eq!(CallTree::from_proto(&tree.to_proto(0)).unwrap(), tree);
    }

    fn wide_tree() -> CallTree {
        tree(&[
            ("main;a;b", 3),
            ("main;a;c", 57),
            ("main;d", 4),
            ("main;e", 36),
        ])
    }

    #[test]
    fn prune_keeps_parent_totals() {
        let pruned = wide_tree().prune(0.05);
        assert_eq!(
            summary(&pruned),
            expect(&[
                ("", 100, 0),
                ("main", 100, 4),
                ("main;a", 60, 3),
                ("main;a;c", 57, 57),
                ("main;e", 36, 36),
            ])
        );
        assert_eq!(pruned.children(1).collect::<Vec<_>>(), [2, 4]);
        assert_eq!(pruned.nodes()[4].parent(), Some(1));
        // Still a valid tree on the wire.
        assert_eq!(CallTree::from_proto(&pruned.to_proto(1)).unwrap(), pruned);
    }

    #[test]
    fn prune_boundaries() {
        let tree = wide_tree();
        assert_eq!(tree.prune(0.0), tree);
        assert_eq!(tree.prune(-1.0), tree);
        assert_eq!(tree.prune(f64::NAN), tree);
        // Exactly at the threshold stays.
        assert!(tree.prune(0.04).find(&["main", "d"]).is_some());
        assert_eq!(summary(&tree.prune(2.0)), expect(&[("", 100, 100)]));
    }

    #[test]
    fn to_proto_is_depth_first_with_the_root_its_own_parent() {
        let tree = tree(&[("main;a", 2), ("main", 1), ("b;main", 4)]);
        let proto = tree.to_proto(10_000_000);
        let node = |parent, frame_index, total, self_| TreeNode {
            parent,
            frame: None,
            frame_index,
            total,
            self_,
        };
        let frame = |function: &str, binary: &str| ProtoFrame {
            function: function.into(),
            binary: binary.into(),
            ..ProtoFrame::default()
        };
        assert_eq!(
            proto,
            FlamegraphResponse {
                nodes: vec![
                    node(0, 0, 7, 0),
                    node(0, 1, 4, 0),
                    node(1, 2, 4, 4),
                    node(0, 2, 3, 1),
                    node(3, 3, 2, 2),
                ],
                total: 7,
                sample_period_nanos: 10_000_000,
                // `main` once, though two nodes hold it.
                frames: vec![
                    frame("all", ""),
                    frame("b", "app"),
                    frame("main", "app"),
                    frame("a", "app"),
                ],
                profile_type: String::new(),
            }
        );
    }

    #[test]
    fn from_proto_reads_inline_frames_and_the_frame_table_alike() {
        let tree = tree(&[("main;a", 2), ("main;b", 3)]);
        let mut inline = tree.to_proto(0);
        for node in &mut inline.nodes {
            node.frame = Some(inline.frames[node.frame_index as usize].clone());
            node.frame_index = 0;
        }
        inline.frames.clear();
        assert_eq!(CallTree::from_proto(&inline).unwrap(), tree);
    }

    #[test]
    fn proto_round_trip_keeps_every_field() {
        let full = Arc::new(Frame {
            function: "inner".into(),
            binary: "/usr/bin/app".into(),
            build_id: "00ff".into(),
            file: "src/inner.rs".into(),
            line: 42,
            inlined: true,
            unnamed_code: None,
        });
        let samples = StackSamples {
            stacks: vec![
                WeightedStack {
                    frames: vec![full, frame("main", "app")],
                    weight: 7,
                },
                stack("main;b;c", 5),
                stack("x", 1),
            ],
            sample_period_nanos: 1,
        };
        let tree = CallTree::from_stacks(&samples);
        let proto = tree.to_proto(1);
        assert_eq!(CallTree::from_proto(&proto).unwrap(), tree);
        let inner = &proto.frames[proto.nodes[4].frame_index as usize];
        assert_eq!(inner.line, 42);
        assert!(inner.inlined);
    }

    #[test]
    fn from_proto_puts_siblings_in_canonical_order() {
        let tree = tree(&[("main;a", 2), ("main;b", 3)]);
        let mut proto = tree.to_proto(0);
        // Same tree, siblings swapped: all, main, b, a.
        proto.nodes.swap(2, 3);
        assert_eq!(CallTree::from_proto(&proto).unwrap(), tree);
    }

    fn error(edit: impl FnOnce(&mut FlamegraphResponse)) -> String {
        let mut proto = tree(&[("main;a", 2), ("main;b", 3)]).to_proto(0);
        edit(&mut proto);
        CallTree::from_proto(&proto).unwrap_err().to_string()
    }

    #[test]
    fn from_proto_rejects_bad_parents() {
        assert_eq!(
            error(|p| p.nodes.clear()),
            "the tree has no nodes (node 0 must be the root)"
        );
        assert_eq!(
            error(|p| p.nodes[0].parent = 1),
            "node 0 is the root and must be its own parent, but its parent is 1"
        );
        assert_eq!(
            error(|p| p.nodes[2].parent = 2),
            "node 2: its parent 2 does not come before it"
        );
        assert_eq!(
            error(|p| p.nodes[1].parent = 3),
            "node 1: its parent 3 does not come before it"
        );
        assert_eq!(
            error(|p| p.nodes[2].parent = u32::MAX),
            "node 2: its parent 4294967295 does not come before it"
        );
        assert_eq!(
            error(|p| p.nodes[3].frame_index = 4),
            "node 3: no frame inline, and its frame index 4 is not in the table of 4 frames"
        );
        assert_eq!(
            error(|p| p.nodes[3].frame_index = p.nodes[2].frame_index),
            "node 3: node 1 already has a child with the same frame"
        );
    }

    #[test]
    fn from_proto_rejects_inconsistent_weights() {
        assert_eq!(
            error(|p| p.nodes[2].self_ = 1),
            "node 2: self is 1, but total minus the children's totals is 2"
        );
        assert_eq!(
            error(|p| p.nodes[1].self_ = 1),
            "node 1: self is 1, but total minus the children's totals is 0"
        );
        assert_eq!(
            error(|p| {
                p.total = 4;
                p.nodes[0].total = 4;
                p.nodes[1].total = 4;
            }),
            "node 1: its children total 5, more than its own total 4"
        );
        assert_eq!(
            error(|p| {
                p.nodes[2].total = u64::MAX;
                p.nodes[2].self_ = u64::MAX;
                p.nodes[3].total = u64::MAX;
                p.nodes[3].self_ = u64::MAX;
            }),
            "node 1: its children total 36893488147419103230, more than its own total 5"
        );
        assert_eq!(
            error(|p| p.total = 6),
            "the response's total is 6, but the root's total is 5"
        );
    }

    fn chain(depth: usize) -> FlamegraphResponse {
        let mut nodes = vec![TreeNode {
            parent: 0,
            frame: None,
            frame_index: 0,
            total: 1,
            self_: 0,
        }];
        for index in 1..=depth {
            nodes.push(TreeNode {
                parent: (index - 1) as u32,
                frame: Some(ProtoFrame {
                    function: "f".into(),
                    ..ProtoFrame::default()
                }),
                frame_index: 0,
                total: 1,
                self_: u64::from(index == depth),
            });
        }
        FlamegraphResponse {
            nodes,
            total: 1,
            sample_period_nanos: 0,
            frames: Vec::new(),
            profile_type: String::new(),
        }
    }

    #[test]
    fn from_proto_limits_depth() {
        let deepest = CallTree::from_proto(&chain(MAX_DEPTH)).unwrap();
        assert_eq!(deepest.nodes().last().unwrap().depth(), MAX_DEPTH);
        // A missing root frame becomes the standard one.
        assert_eq!(deepest.root().frame(), &root_frame());
        assert_eq!(
            CallTree::from_proto(&chain(MAX_DEPTH + 1))
                .unwrap_err()
                .to_string(),
            "node 4097: deeper than the limit of 4096 frames"
        );
    }

    /// Random stacks over a few functions, some repeated, some prefixes of
    /// others, some empty or of weight 0, equal frames in separate
    /// allocations: the tree holds every path once, in depth-first order
    /// with siblings by name, with the weights a plain sum over the paths
    /// gives; it survives the wire; its children lists agree with the
    /// parents.
    #[test]
    fn from_stacks_agrees_with_a_sum_over_paths() {
        use rand::{Rng, SeedableRng, rngs::StdRng};
        use std::collections::BTreeMap;
        let mut rng = StdRng::seed_from_u64(11);
        for round in 0..50 {
            let stacks: Vec<(String, u64)> = (0..rng.random_range(0..60))
                .map(|_| {
                    let depth = rng.random_range(0..7);
                    let path: Vec<&str> = (0..depth)
                        .map(|_| ["a", "b", "c", "d"][rng.random_range(0..4)])
                        .collect();
                    (path.join(";"), rng.random_range(0..4))
                })
                .collect();
            let stacks: Vec<(&str, u64)> = stacks.iter().map(|(p, w)| (p.as_str(), *w)).collect();
            let tree = tree(&stacks);

            let mut expected: BTreeMap<Vec<&str>, (u64, u64)> = BTreeMap::new();
            expected.insert(Vec::new(), (0, 0));
            for &(path, weight) in stacks.iter().filter(|(_, w)| *w > 0) {
                let frames: Vec<&str> = path.split(';').filter(|f| !f.is_empty()).collect();
                for depth in 0..=frames.len() {
                    expected.entry(frames[..depth].to_vec()).or_default().0 += weight;
                }
                expected.get_mut(&frames).expect("added above").1 += weight;
            }
            let expected: Vec<(String, u64, u64)> = expected
                .into_iter()
                .map(|(path, (total, self_weight))| (path.join(";"), total, self_weight))
                .collect();
            assert_eq!(summary(&tree), expected, "round {round}: {stacks:?}");
            assert_eq!(
                CallTree::from_proto(&tree.to_proto(0)).unwrap(),
                tree,
                "round {round}"
            );
            for (index, node) in tree.nodes().iter().enumerate() {
                for child in tree.children(index) {
                    assert_eq!(tree.nodes()[child].parent(), Some(index));
                    assert_eq!(tree.nodes()[child].depth(), node.depth() + 1);
                }
            }
            let children: usize = (0..tree.nodes().len())
                .map(|i| tree.children(i).len())
                .sum();
            assert_eq!(children, tree.nodes().len() - 1, "round {round}");
        }
    }

    #[test]
    fn deep_stacks_are_truncated_at_the_limit() {
        let frames: Vec<String> = (0..MAX_DEPTH + 10).map(|i| format!("f{i}")).collect();
        let tree = tree(&[(&frames.join(";"), 3)]);
        let leaf = tree.nodes().len() - 1;
        assert_eq!(tree.nodes().len(), MAX_DEPTH + 1);
        assert_eq!(tree.nodes()[leaf].depth(), MAX_DEPTH);
        assert_eq!(tree.nodes()[leaf].frame().function, TRUNCATED_FUNCTION);
        assert_eq!(tree.nodes()[leaf].self_weight(), 3);
        // The outermost frames are the ones kept.
        assert_eq!(tree.nodes()[1].frame().function, "f0");
        assert_eq!(
            tree.nodes()[leaf - 1].frame().function,
            format!("f{}", MAX_DEPTH - 2)
        );
        assert_eq!(CallTree::from_proto(&tree.to_proto(0)).unwrap(), tree);
    }

    /// Arbitrary parents, totals and frames never panic (a poor man's fuzz
    /// run, deterministic so failures reproduce).
    #[test]
    fn from_proto_never_panics() {
        use rand::{Rng as _, SeedableRng as _, rngs::StdRng};
        let mut rng = StdRng::seed_from_u64(0x2545_f491_4f6c_dd1d);
        let mut next = move || rng.random::<u64>();
        let mut accepted = 0;
        for _ in 0..2_000 {
            let len = (next() % 6) as usize;
            let nodes = (0..len)
                .map(|_| TreeNode {
                    parent: (next() % 5) as u32,
                    frame: (next() % 4 == 0).then(|| ProtoFrame {
                        function: ["a", "b"][(next() % 2) as usize].into(),
                        ..ProtoFrame::default()
                    }),
                    frame_index: (next() % 4) as u32,
                    total: next() % 4,
                    self_: next() % 3,
                })
                .collect();
            let response = FlamegraphResponse {
                nodes,
                total: next() % 4,
                sample_period_nanos: 0,
                frames: (0..next() % 4)
                    .map(|i| ProtoFrame {
                        function: ["a", "b", "c"][(i % 3) as usize].into(),
                        ..ProtoFrame::default()
                    })
                    .collect(),
                profile_type: String::new(),
            };
            if let Ok(tree) = CallTree::from_proto(&response) {
                accepted += 1;
                assert_eq!(tree.total(), response.total);
                assert_eq!(CallTree::from_proto(&tree.to_proto(0)).unwrap(), tree);
            }
        }
        assert!(
            accepted > 0,
            "the generator should produce some valid trees"
        );
    }
}
