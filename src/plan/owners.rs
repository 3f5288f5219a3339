//! Replica sets and their owners. Offers of one tensor with the same box are replicas; one of them
//! serves each (replica set, receiver) pair, chosen by policy. Distinct boxes that overlap are cut
//! into disjoint pieces, so that every byte is read from one replica set only.

use super::boxes::Boxed;
use super::merge::Fnv;
use super::merge::{same_values, Catalog, PackedOffer};
use super::table::Endpoint;
use super::OwnerPolicy;
use crate::bail;
use crate::error::{Result, Status};
use std::collections::HashMap;
use std::hash::BuildHasherDefault;

type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<Fnv>>;

/// Offers `first..first + len` of the catalog, all with the same tensor and box.
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
}

impl Replicas {
    pub fn pieces_of(&self, tensor: usize) -> &[Piece] {
        &self.pieces[self.piece_start[tensor]..self.piece_start[tensor + 1]]
    }
}

/// Groups replicas, checks their digests, and cuts overlapping boxes into disjoint pieces.
/// `max_pieces` bounds the work hostile overlaps can cause.
pub(crate) fn replicas(catalog: &Catalog, max_pieces: usize) -> Result<Replicas> {
    let mut sets = Vec::new();
    // Every replica set is at least one piece: sized for one per offer, it rarely regrows.
    let mut pieces = Vec::with_capacity(catalog.offers.len().min(max_pieces));
    let mut piece_start = vec![0; catalog.tensors.len() + 1];
    // Reused between sets: the parts of the box being cut, and the parts after the next cut.
    let (mut parts, mut next): (Vec<Boxed>, Vec<Boxed>) = (Vec::new(), Vec::new());
    for (t, spec) in catalog.tensors.iter().enumerate() {
        let n = spec.shape.len();
        let offers = catalog.offer_range(t);
        let first_set = sets.len();
        let mut i = offers.start;
        while i < offers.end {
            let (lo, ext, _) = catalog.offer_parts(i);
            let same = (i..offers.end)
                .take_while(|&k| {
                    let (other_lo, other_ext, _) = catalog.offer_parts(k);
                    same_values(other_lo, lo) && same_values(other_ext, ext)
                })
                .count();
            check_digests(&catalog.offers[i..i + same], lo, ext, &spec.name)?;
            if !ext.contains(&0) {
                sets.push(ReplicaSet { first: i, len: same });
            }
            i += same;
        }
        // Each box minus every earlier box of the same tensor (canonical order decides who keeps
        // an overlapped part; the choice only changes which replica set serves those bytes).
        let tensor_sets = first_set..sets.len();
        for s in tensor_sets.clone() {
            parts.clear();
            parts.push(catalog.offer_box(sets[s].first));
            for earlier in &sets[tensor_sets.start..s] {
                let (lo, ext, _) = catalog.offer_parts(earlier.first);
                if !parts.iter().any(|p| p.intersect_parts(lo, ext).is_some()) {
                    continue;
                }
                let cut = catalog.offer_box(earlier.first);
                next.clear();
                for p in &parts {
                    p.subtract(&cut, n, &mut next);
                }
                std::mem::swap(&mut parts, &mut next);
                if pieces.len() + parts.len() > max_pieces {
                    bail!(
                        Status::Unsupported,
                        "offers of tensor '{}' overlap in too many ways to split",
                        spec.name
                    );
                }
            }
            pieces.extend(parts.iter().map(|&bx| Piece { set: s, bx }));
        }
        piece_start[t + 1] = pieces.len();
    }
    if pieces.len() > u32::MAX as usize {
        bail!(Status::Unsupported, "offers overlap in more than 2^32 pieces");
    }
    Ok(Replicas { sets, pieces, piece_start })
}

fn check_digests(replicas: &[PackedOffer], lo: &[u64], ext: &[u64], name: &str) -> Result<()> {
    let mut digests = replicas.iter().filter_map(|o| o.digest.map(|d| (d, o.owner)));
    let Some((first, first_owner)) = digests.next() else {
        return Ok(());
    };
    if let Some((other, owner)) = digests.find(|&(d, _)| d != first) {
        bail!(
            Status::ReplicaMismatch,
            "replicas of tensor '{name}' box offset {lo:?} extent {ext:?} differ: digest {first:#018x} at rank {} device {} \
             but {other:#018x} at rank {} device {}",
            first_owner.rank,
            first_owner.device,
            owner.rank,
            owner.device
        );
    }
    Ok(())
}

/// How close a source is to a receiver: 0 same device, 1 same process, 2 another process.
pub(crate) fn distance(src: Endpoint, dst: Endpoint) -> u8 {
    if src.rank != dst.rank {
        2
    } else if src.device != dst.device {
        1
    } else {
        0
    }
}

/// Owner choices for every (replica set, receiver) pair that carries bytes.
pub(crate) struct Owners {
    chosen: FastMap<(usize, Endpoint), usize>,
    policy: OwnerPolicy,
}

impl Owners {
    /// `demand`: bytes each (replica set, receiver) pair must move, sorted by (set, receiver).
    pub fn choose(
        catalog: &Catalog,
        sets: &[ReplicaSet],
        policy: OwnerPolicy,
        demand: &[(usize, Endpoint, u64)],
    ) -> Owners {
        let mut chosen = FastMap::default();
        if policy == OwnerPolicy::Balanced {
            // Largest demands first, each to the replica whose source has served the fewest bytes
            // so far; ties go to the closer, then lower, endpoint.
            let mut order: Vec<&(usize, Endpoint, u64)> = demand.iter().collect();
            order.sort_by_key(|&&(set, receiver, bytes)| (std::cmp::Reverse(bytes), set, receiver));
            let mut load: FastMap<Endpoint, u64> = FastMap::default();
            for &(set, receiver, bytes) in order {
                let replicas = &catalog.offers[sets[set].first..sets[set].first + sets[set].len];
                let best = (0..replicas.len())
                    .min_by_key(|&i| {
                        let owner = replicas[i].owner;
                        (load.get(&owner).copied().unwrap_or(0), distance(owner, receiver), owner, i)
                    })
                    .expect("a replica set is never empty");
                let served = load.entry(replicas[best].owner).or_insert(0);
                *served = served.saturating_add(bytes);
                chosen.insert((set, receiver), sets[set].first + best);
            }
        }
        Owners { chosen, policy }
    }

    /// The offer (catalog index) that serves `set` to `receiver`.
    pub fn owner(&self, catalog: &Catalog, sets: &[ReplicaSet], set: usize, receiver: Endpoint) -> usize {
        let s = sets[set];
        match self.policy {
            // Offers within a set are sorted by owner: the first is the lowest rank.
            OwnerPolicy::First => s.first,
            OwnerPolicy::Local => (s.first..s.first + s.len)
                .min_by_key(|&i| (distance(catalog.offers[i].owner, receiver), i))
                .expect("a replica set is never empty"),
            OwnerPolicy::Balanced => self.chosen[&(set, receiver)],
        }
    }
}
