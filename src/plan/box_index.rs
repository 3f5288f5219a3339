//! Finding the boxes that meet a query box without testing every box. Per tensor, the boxes sit in
//! a tree built by median splits (a bounding-volume hierarchy): each node holds the bounds of the
//! boxes below it, so a query descends only into nodes whose bounds meet it. Shards and pieces,
//! which are (nearly) disjoint, are found in about `log n + k` tests for `k` hits.
//!
//! Every node and box tested is counted against a budget (the planner's `max_box_tests`): hostile
//! layouts, such as many thin boxes whose bounds all meet every query, end with a status instead of
//! quadratic work.

use super::boxes::{Boxed, MAX_DIMS};
use super::memory;
use super::options::Budget;
use crate::error::Result;

/// Most boxes in a leaf: tested one by one, which is faster than descending further.
const LEAF: usize = 8;

/// A node of a tree: entries `start..end`, and `next`, the node after its subtree in preorder.
/// A node is a leaf when its first child would be `next`.
#[derive(Clone, Copy, Debug)]
struct Node {
    start: u32,
    end: u32,
    next: u32,
}

/// Where one tree's nodes and entries are in the shared pools.
#[derive(Clone, Copy, Debug)]
struct Tree {
    dims: usize,
    nodes: (usize, usize),
    /// First entry; entry `e` has corners at `2 * dims * (e - first_entry)` from `corner_base`.
    first_entry: usize,
    corner_base: usize,
    node_corner_base: usize,
}

/// Trees over the boxes of many tensors, one tree each, in shared pools (a plan has tens of
/// thousands of tensors: one allocation per tensor would cost more than the trees).
#[derive(Default)]
pub(crate) struct BoxForest {
    trees: Vec<Tree>,
    nodes: Vec<Node>,
    /// Each node's bounds: `lo` then `hi` (exclusive), `dims` values each.
    node_corners: Vec<u64>,
    /// Caller ids of the entries, in tree order.
    ids: Vec<u32>,
    /// Each entry's `lo` then `hi`, in tree order.
    corners: Vec<u64>,
}

/// Whether `[lo, hi)` meets the query `[qlo, qhi)` in every dimension (empty boxes meet nothing).
#[inline]
fn meets(corners: &[u64], dims: usize, qlo: &[u64], qhi: &[u64]) -> bool {
    let (lo, hi) = corners.split_at(dims);
    (0..dims).all(|d| lo[d] < qhi[d] && qlo[d] < hi[d])
}

impl BoxForest {
    pub fn new() -> BoxForest {
        BoxForest::default()
    }

    /// Adds a tree over `boxes` (caller id, box) of `dims` dimensions; returns its index, which
    /// counts up from 0 in the order trees are added.
    pub fn add_tree(&mut self, dims: usize, boxes: &[(u32, Boxed)]) -> Result<usize> {
        let what = "box index entries";
        let mut order: Vec<u32> = memory::collect(boxes.len(), 0..boxes.len() as u32, what)?;
        let node_start = self.nodes.len();
        let node_corner_base = self.node_corners.len();
        self.split(dims, boxes, &mut order, 0)?;
        let first_entry = self.ids.len();
        let corner_base = self.corners.len();
        memory::reserve(&mut self.ids, boxes.len(), what)?;
        memory::reserve(&mut self.corners, 2 * dims * boxes.len(), what)?;
        for &i in &order {
            let (id, bx) = &boxes[i as usize];
            self.ids.push(*id);
            self.corners.extend_from_slice(&bx.lo[..dims]);
            // Inside the tensor's shape: the end never overflows.
            self.corners.extend((0..dims).map(|d| bx.lo[d] + bx.ext[d]));
        }
        memory::push(
            &mut self.trees,
            Tree { dims, nodes: (node_start, self.nodes.len()), first_entry, corner_base, node_corner_base },
            what,
        )?;
        Ok(self.trees.len() - 1)
    }

    /// Builds the subtree over `order` (entries from `offset` in the tree), splitting at the median
    /// of the box centres along the dimension where they spread most.
    fn split(&mut self, dims: usize, boxes: &[(u32, Boxed)], order: &mut [u32], offset: usize) -> Result<()> {
        let what = "box index nodes";
        let at = self.nodes.len();
        let (start, end) = (offset as u32, (offset + order.len()) as u32);
        memory::push(&mut self.nodes, Node { start, end, next: 0 }, what)?;
        memory::reserve(&mut self.node_corners, 2 * dims, what)?;
        let bounds = |d: usize| {
            order
                .iter()
                .map(|&i| &boxes[i as usize].1)
                .fold((u64::MAX, 0), |(lo, hi), b| (lo.min(b.lo[d]), hi.max(b.lo[d] + b.ext[d])))
        };
        let spans: [(u64, u64); MAX_DIMS] =
            std::array::from_fn(|d| if d < dims { bounds(d) } else { (0, 0) });
        self.node_corners.extend(spans[..dims].iter().map(|s| s.0));
        self.node_corners.extend(spans[..dims].iter().map(|s| s.1));
        if order.len() > LEAF {
            let centre = |i: u32, d: usize| {
                let b = &boxes[i as usize].1;
                b.lo[d] + b.ext[d] / 2
            };
            let spread = |d: usize| {
                let (lo, hi) = order
                    .iter()
                    .fold((u64::MAX, 0), |(lo, hi), &i| (lo.min(centre(i, d)), hi.max(centre(i, d))));
                hi.saturating_sub(lo)
            };
            let d = (0..dims).max_by_key(|&d| (spread(d), std::cmp::Reverse(d))).unwrap_or(0);
            let mid = order.len() / 2;
            order.select_nth_unstable_by_key(mid, |&i| centre(i, d));
            let (left, right) = order.split_at_mut(mid);
            self.split(dims, boxes, left, offset)?;
            self.split(dims, boxes, right, offset + mid)?;
        }
        self.nodes[at].next = self.nodes.len() as u32;
        Ok(())
    }

    /// Calls `hit` with the id of every box of tree `tree` that meets `query`, in no particular
    /// order, counting the tests against `work`.
    pub fn for_each_meeting(
        &self,
        tree: usize,
        query: &Boxed,
        work: &mut Budget,
        mut hit: impl FnMut(u32) -> Result<()>,
    ) -> Result<()> {
        let t = self.trees[tree];
        let dims = t.dims;
        let (qlo, qhi): (&[u64], [u64; MAX_DIMS]) = (
            &query.lo[..dims],
            std::array::from_fn(|d| if d < dims { query.lo[d] + query.ext[d] } else { 0 }),
        );
        let mut i = t.nodes.0;
        while i < t.nodes.1 {
            work.spend(1)?;
            let node = self.nodes[i];
            let bounds = &self.node_corners[t.node_corner_base + 2 * dims * (i - t.nodes.0)..][..2 * dims];
            if !meets(bounds, dims, qlo, &qhi) {
                i = node.next as usize;
                continue;
            }
            if node.next as usize != i + 1 {
                i += 1;
                continue;
            }
            work.spend(u64::from(node.end - node.start))?;
            for e in node.start as usize..node.end as usize {
                let corners = &self.corners[t.corner_base + 2 * dims * e..][..2 * dims];
                if meets(corners, dims, qlo, &qhi) {
                    hit(self.ids[t.first_entry + e])?;
                }
            }
            i += 1;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b2(lo: [u64; 2], ext: [u64; 2]) -> Boxed {
        Boxed::from_parts(&lo, &ext)
    }

    /// Every box of a 40 x 30 grid of 3 x 5 tiles, plus a row of thin boxes, queried with boxes
    /// of every size: the hits are exactly the boxes a pairwise test finds.
    #[test]
    fn queries_find_exactly_the_meeting_boxes() {
        let mut boxes = Vec::new();
        for i in 0..40u64 {
            for j in 0..30u64 {
                boxes.push(((i * 30 + j) as u32, b2([3 * i, 5 * j], [3, 5])));
            }
        }
        boxes.push((5000, b2([7, 0], [1, 150])));
        boxes.push((5001, b2([0, 0], [0, 4])));
        let mut forest = BoxForest::new();
        assert_eq!(forest.add_tree(1, &[(9, Boxed::from_parts(&[2], &[3]))]).unwrap(), 0);
        let tree = forest.add_tree(2, &boxes).unwrap();
        let mut work = Budget::unlimited("box tests");
        for (qlo, qext) in [([0, 0], [120, 150]), ([4, 6], [1, 1]), ([5, 9], [7, 13]), ([119, 149], [5, 5])] {
            let query = b2(qlo, qext);
            let mut hits = Vec::new();
            forest
                .for_each_meeting(tree, &query, &mut work, |id| {
                    hits.push(id);
                    Ok(())
                })
                .unwrap();
            hits.sort_unstable();
            let mut expected: Vec<u32> =
                boxes.iter().filter(|(_, b)| b.intersect(&query, 2).is_some()).map(|(id, _)| *id).collect();
            expected.sort_unstable();
            assert_eq!(hits, expected, "query {qlo:?} {qext:?}");
        }
        let mut one = Vec::new();
        forest
            .for_each_meeting(0, &Boxed::from_parts(&[4], &[9]), &mut work, |id| {
                one.push(id);
                Ok(())
            })
            .unwrap();
        assert_eq!(one, vec![9]);
        // A point query tests a few dozen nodes and boxes, not all 1,200.
        let limits = crate::plan::Limits { max_box_tests: 100, ..Default::default() };
        let mut small = Budget::box_tests(&limits);
        forest.for_each_meeting(tree, &b2([60, 70], [1, 1]), &mut small, |_| Ok(())).unwrap();
        let err = forest.for_each_meeting(tree, &b2([0, 0], [120, 150]), &mut small, |_| Ok(())).unwrap_err();
        assert_eq!(err.status, crate::Status::Unsupported);
        assert!(err.message.contains("max_box_tests"), "{err}");
    }
}
