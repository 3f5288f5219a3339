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
    /// No nodes: a flat list of `len` entries (a handful of boxes, or boxes of no dimension).
    nodes: (usize, usize),
    /// First entry; entry `e` has corners at `2 * dims * (e - first_entry)` from `corner_base`.
    first_entry: usize,
    len: usize,
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
    pub fn add_tree(
        &mut self,
        dims: usize,
        boxes: impl ExactSizeIterator<Item = (u32, Boxed)>,
    ) -> Result<usize> {
        let what = "box index entries";
        let count = boxes.len();
        let (first_entry, corner_base) = (self.ids.len(), self.corners.len());
        memory::reserve(&mut self.ids, count, what)?;
        memory::reserve(&mut self.corners, 2 * dims * count, what)?;
        for (id, bx) in boxes {
            self.ids.push(id);
            // Value by value: a call to memcpy per short copy costs more than the copy.
            for d in 0..dims {
                self.corners.push(bx.lo[d]);
            }
            // Inside the tensor's shape: the end never overflows.
            for d in 0..dims {
                self.corners.push(bx.lo[d] + bx.ext[d]);
            }
        }
        let (node_start, node_corner_base) = (self.nodes.len(), self.node_corners.len());
        let entries = &mut self.corners[corner_base..];
        // Most tensors have a handful of boxes: a flat list, tested one by one, costs less to build
        // and to query than any node. Boxes of no dimension are all the same box: nothing to
        // split on either.
        if count > LEAF && dims > 0 {
            let mut order: Vec<u32> = memory::collect(count, 0..count as u32, what)?;
            split(entries, dims, &mut order, 0, &mut self.nodes, &mut self.node_corners)?;
            // Entries in tree order, so that each leaf's boxes are contiguous.
            let old_corners = memory::collect(entries.len(), entries.iter().copied(), what)?;
            let old_ids = memory::collect(count, self.ids[first_entry..].iter().copied(), what)?;
            let w = 2 * dims;
            for (k, &i) in order.iter().enumerate() {
                let i = i as usize;
                entries[k * w..(k + 1) * w].copy_from_slice(&old_corners[i * w..(i + 1) * w]);
                self.ids[first_entry + k] = old_ids[i];
            }
        }
        memory::push(
            &mut self.trees,
            Tree {
                dims,
                nodes: (node_start, self.nodes.len()),
                first_entry,
                len: count,
                corner_base,
                node_corner_base,
            },
            what,
        )?;
        Ok(self.trees.len() - 1)
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
        let t = &self.trees[tree];
        let dims = t.dims;
        let qlo = &query.lo[..dims];
        let mut qhi = [0u64; MAX_DIMS];
        for (hi, (lo, ext)) in qhi.iter_mut().zip(qlo.iter().zip(&query.ext)) {
            *hi = lo + ext;
        }
        let entries = &self.corners[t.corner_base..];
        let mut scan = |entries_of: std::ops::Range<usize>, work: &mut Budget| -> Result<()> {
            work.spend(entries_of.len() as u64)?;
            for e in entries_of {
                if meets(&entries[2 * dims * e..2 * dims * (e + 1)], dims, qlo, &qhi) {
                    hit(self.ids[t.first_entry + e])?;
                }
            }
            Ok(())
        };
        if t.nodes.0 == t.nodes.1 {
            return scan(0..t.len, work);
        }
        let mut i = t.nodes.0;
        while i < t.nodes.1 {
            work.spend(1)?;
            let node = &self.nodes[i];
            let bounds = &self.node_corners[t.node_corner_base + 2 * dims * (i - t.nodes.0)..][..2 * dims];
            if !meets(bounds, dims, qlo, &qhi) {
                i = node.next as usize;
                continue;
            }
            if node.next as usize == i + 1 {
                scan(node.start as usize..node.end as usize, work)?;
            }
            i += 1;
        }
        Ok(())
    }
}

/// Builds the subtree over the entries in `order` (positions `offset..` of the tree; their corners
/// in `corners`, `2 * dims` values each), splitting at the median of the box centres along the
/// dimension where they spread most; `order` ends in tree order.
fn split(
    corners: &[u64],
    dims: usize,
    order: &mut [u32],
    offset: usize,
    nodes: &mut Vec<Node>,
    node_corners: &mut Vec<u64>,
) -> Result<()> {
    let what = "box index nodes";
    let (at, len) = (nodes.len(), order.len());
    memory::push(nodes, Node { start: offset as u32, end: (offset + len) as u32, next: 0 }, what)?;
    memory::reserve(node_corners, 2 * dims, what)?;
    let corners_of = |i: usize| &corners[2 * dims * i..2 * dims * (i + 1)];
    let mut bounds = [(u64::MAX, 0u64); MAX_DIMS];
    for &i in order.iter() {
        let c = corners_of(i as usize);
        for d in 0..dims {
            bounds[d] = (bounds[d].0.min(c[d]), bounds[d].1.max(c[dims + d]));
        }
    }
    node_corners.extend(bounds[..dims].iter().map(|b| b.0));
    node_corners.extend(bounds[..dims].iter().map(|b| b.1));
    if len > LEAF {
        let centre = |i: usize, d: usize| {
            let c = corners_of(i);
            c[d] + (c[dims + d] - c[d]) / 2
        };
        let spread = |d: usize| {
            let (lo, hi) = order.iter().fold((u64::MAX, 0), |(lo, hi), &i| {
                let x = centre(i as usize, d);
                (lo.min(x), hi.max(x))
            });
            hi.saturating_sub(lo)
        };
        let d = (0..dims).max_by_key(|&d| (spread(d), std::cmp::Reverse(d))).unwrap_or(0);
        let mid = len / 2;
        order.select_nth_unstable_by_key(mid, |&i| centre(i as usize, d));
        let (left, right) = order.split_at_mut(mid);
        split(corners, dims, left, offset, nodes, node_corners)?;
        split(corners, dims, right, offset + mid, nodes, node_corners)?;
    }
    nodes[at].next = nodes.len() as u32;
    Ok(())
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
        assert_eq!(forest.add_tree(1, [(9, Boxed::from_parts(&[2], &[3]))].into_iter()).unwrap(), 0);
        let tree = forest.add_tree(2, boxes.iter().copied()).unwrap();
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
        // Scalars: every box is the one box, however many there are.
        let scalars = forest.add_tree(0, (0..20).map(|id| (id, Boxed::from_parts(&[], &[])))).unwrap();
        let mut all = Vec::new();
        forest
            .for_each_meeting(scalars, &Boxed::from_parts(&[], &[]), &mut work, |id| {
                all.push(id);
                Ok(())
            })
            .unwrap();
        all.sort_unstable();
        assert_eq!(all, (0..20).collect::<Vec<u32>>());
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
