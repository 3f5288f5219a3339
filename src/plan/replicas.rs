//! Replica sets and the disjoint pieces they serve. Offers of one tensor with the same box are
//! replicas (one replica set); distinct boxes that overlap are cut into disjoint pieces, so that
//! every byte is read from one replica set only. Sets and pieces are indexed by box
//! ([`BoxForest`], one tree per tensor), so that finding what meets a box never scans a tensor.

use super::box_index::BoxForest;
use super::boxes::Boxed;
use super::memory;
use super::merge::{same_values, Merged, PackedOffer};
use super::options::{Budget, Limits};
use crate::bail;
use crate::error::{Result, Status};
use std::ops::Range;

/// Offers `first..first + len` of the merged tables, all with the same tensor and box.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ReplicaSet {
    pub first: usize,
    pub len: usize,
}

/// A disjoint part of one replica set's box.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Piece {
    pub set: usize,
    pub bx: Boxed,
}

/// Replica sets of every tensor and the disjoint pieces they serve.
pub(crate) struct Replicas {
    pub sets: Vec<ReplicaSet>,
    pub pieces: Vec<Piece>,
    /// `pieces[piece_start[t]..piece_start[t + 1]]` belong to tensor `t`.
    pub piece_start: Vec<usize>,
    /// Tree `t` holds tensor `t`'s replica sets (ids: set indices).
    pub set_index: BoxForest,
    /// Tree `t` holds tensor `t`'s pieces (ids: piece indices).
    pub piece_index: BoxForest,
}

/// Groups replicas, checks their digests, and cuts overlapping boxes into disjoint pieces, tensor
/// by tensor. The pieces (`max_pieces`) and the box tests (`work`) are bounded, so that hostile
/// overlaps end with UNSUPPORTED naming the tensor and the limit.
///
/// Every tensor's sets are grouped (and their digests checked); only tensors marked in `cut` are
/// cut into pieces and indexed (the others get empty trees, so that tree `t` is still tensor `t`).
pub(crate) fn replicas(
    merged: &Merged,
    cut: &[bool],
    limits: &Limits,
    work: &mut Budget,
) -> Result<Replicas> {
    let mut out = Replicas {
        sets: Vec::new(),
        // Every replica set is at least one piece: sized for one per offer, it rarely regrows.
        pieces: memory::with_capacity(merged.offers.len().min(limits.max_pieces as usize), "pieces")?,
        piece_start: memory::filled(0, merged.tensors.len() + 1, "tensors")?,
        set_index: BoxForest::new(),
        piece_index: BoxForest::new(),
    };
    let mut scratch = Scratch::default();
    for (t, spec) in merged.tensors.iter().enumerate() {
        let first_set = out.sets.len();
        group_sets(merged, t, &mut out.sets)?;
        let sets = if cut[t] { first_set..out.sets.len() } else { first_set..first_set };
        index_sets(merged, t, sets.clone(), &mut out)?;
        cut_pieces(merged, t, sets, limits, &mut out, &mut scratch, work)
            .map_err(|e| e.context(format!("offers of tensor '{}'", spec.name)))?;
        out.piece_start[t + 1] = out.pieces.len();
    }
    if out.pieces.len() > u32::MAX as usize {
        bail!(Status::Unsupported, "offers overlap in more than 2^32 pieces");
    }
    Ok(out)
}

/// Buffers reused from tensor to tensor: the parts of a box being cut, the parts after the next
/// cut, and the earlier sets meeting a box.
#[derive(Default)]
struct Scratch {
    parts: Vec<Boxed>,
    next: Vec<Boxed>,
    earlier: Vec<u32>,
}

/// Adds tensor `t`'s tree of replica sets (`sets`) to the set index.
fn index_sets(merged: &Merged, t: usize, sets: Range<usize>, out: &mut Replicas) -> Result<()> {
    let boxes = sets.map(|s| (s as u32, merged.offer_box(out.sets[s].first)));
    let tree = out.set_index.add_tree(merged.geometry[t].0, boxes)?;
    debug_assert_eq!(tree, t, "one tree per tensor, in order");
    Ok(())
}

/// Appends tensor `t`'s pieces: each replica set's box minus every earlier box of the tensor that
/// meets it (canonical order decides who keeps an overlapped part; the choice only changes which
/// replica set serves those bytes), and adds their tree to the piece index.
fn cut_pieces(
    merged: &Merged,
    t: usize,
    sets: Range<usize>,
    limits: &Limits,
    out: &mut Replicas,
    scratch: &mut Scratch,
    work: &mut Budget,
) -> Result<()> {
    let n = merged.geometry[t].0;
    let pieces = Budget::pieces(limits);
    let first_piece = out.pieces.len();
    let Scratch { parts, next, earlier } = scratch;
    for s in sets.clone() {
        let own = merged.offer_box(out.sets[s].first);
        earlier.clear();
        // The first set has no earlier set to be cut by (and most tensors have one set).
        if s > sets.start {
            out.set_index.for_each_meeting(t, &own, work, |e| {
                if (e as usize) < s {
                    memory::push(earlier, e, "replica sets")?;
                }
                Ok(())
            })?;
        }
        earlier.sort_unstable();
        parts.clear();
        parts.push(own);
        for &e in earlier.iter() {
            let cut = merged.offer_box(out.sets[e as usize].first);
            work.spend(parts.len() as u64)?;
            if !parts.iter().any(|p| p.intersect(&cut, n).is_some()) {
                continue;
            }
            next.clear();
            for p in parts.iter() {
                memory::reserve(next, 2 * n + 1, "pieces")?;
                p.subtract(&cut, n, next);
            }
            std::mem::swap(parts, next);
            pieces.check_total((out.pieces.len() + parts.len()) as u64)?;
        }
        memory::reserve(&mut out.pieces, parts.len(), "pieces")?;
        out.pieces.extend(parts.iter().map(|&bx| Piece { set: s, bx }));
    }
    let pieces =
        out.pieces[first_piece..].iter().enumerate().map(|(p, piece)| ((first_piece + p) as u32, piece.bx));
    out.piece_index.add_tree(n, pieces)?;
    Ok(())
}

/// Appends tensor `t`'s replica sets (runs of offers with the same box, nonempty boxes only),
/// checking that the replicas' digests agree.
fn group_sets(merged: &Merged, t: usize, sets: &mut Vec<ReplicaSet>) -> Result<()> {
    let offers = merged.offer_range(t);
    let mut i = offers.start;
    while i < offers.end {
        let (lo, ext, _) = merged.offer_parts(i);
        let same = (i..offers.end)
            .take_while(|&k| {
                let (other_lo, other_ext, _) = merged.offer_parts(k);
                same_values(other_lo, lo) && same_values(other_ext, ext)
            })
            .count();
        check_digests(&merged.offers[i..i + same], lo, ext, &merged.tensors[t].name)?;
        if !ext.contains(&0) {
            memory::push(sets, ReplicaSet { first: i, len: same }, "replica sets")?;
        }
        i += same;
    }
    Ok(())
}

fn check_digests(replicas: &[PackedOffer], lo: &[u64], ext: &[u64], name: &str) -> Result<()> {
    let mut digests = replicas.iter().filter_map(|o| o.digest.map(|d| (d, o.owner)));
    let Some((first, first_owner)) = digests.next() else {
        return Ok(());
    };
    if let Some((other, owner)) = digests.find(|&(d, _)| d != first) {
        bail!(
            Status::ReplicaMismatch,
            "replicas of tensor '{name}' box offset {lo:?} extent {ext:?} differ: digest {first:#018x} at process {} \
             device {} but {other:#018x} at process {} device {}",
            first_owner.process,
            first_owner.device,
            owner.process,
            owner.device
        );
    }
    Ok(())
}
