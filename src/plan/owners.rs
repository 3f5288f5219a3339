//! Which replica serves each (replica set, receiver) pair, by policy. FIRST and LOCAL decide each
//! pair on its own; BALANCED weighs every pair's bytes against every source's load.

use super::digest::Words;
use super::memory;
use super::merge::Merged;
use super::options::{Budget, OwnerPolicy};
use super::replicas::ReplicaSet;
use super::table::Endpoint;
use crate::error::Result;

/// Bytes one replica set sends one receiver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Demand {
    pub set: u32,
    pub receiver: Endpoint,
    pub bytes: u64,
}

/// Owner choices for every (replica set, receiver) pair that carries bytes.
pub(crate) struct Owners {
    policy: OwnerPolicy,
    /// BALANCED: (set, receiver, chosen offer), sorted by (set, receiver).
    balanced: Vec<(u32, Endpoint, u32)>,
}

impl Owners {
    /// `demand`: bytes each (replica set, receiver) pair moves, sorted by (set, receiver), each
    /// pair once. Only BALANCED reads it; `work` meters its search.
    pub fn choose(
        merged: &Merged,
        sets: &[ReplicaSet],
        policy: OwnerPolicy,
        demand: &[Demand],
        work: &mut Budget,
    ) -> Result<Owners> {
        let balanced = match policy {
            OwnerPolicy::Balanced => {
                let offers = balance(merged, sets, demand, work)?;
                memory::collect(
                    demand.len(),
                    demand.iter().zip(offers).map(|(d, o)| (d.set, d.receiver, o)),
                    "owner choices",
                )?
            }
            _ => Vec::new(),
        };
        Ok(Owners { policy, balanced })
    }

    /// The offer (index into the merged offers) that serves `set` to `receiver`.
    pub fn owner(&self, merged: &Merged, sets: &[ReplicaSet], set: usize, receiver: Endpoint) -> usize {
        let s = sets[set];
        match self.policy {
            // Offers within a set are sorted by owner: the first is the lowest endpoint.
            OwnerPolicy::First => s.first,
            // The nearest replica, the lowest among equals: sorted by owner, the replicas of the
            // receiver's process are one run, starting with its lowest device.
            OwnerPolicy::Local => {
                let offers = &merged.offers[s.first..s.first + s.len];
                let process = offers.partition_point(|o| o.owner.process < receiver.process);
                let device = offers.partition_point(|o| o.owner < receiver);
                if offers.get(device).is_some_and(|o| o.owner == receiver) {
                    s.first + device
                } else if offers.get(process).is_some_and(|o| o.owner.process == receiver.process) {
                    s.first + process
                } else {
                    s.first
                }
            }
            OwnerPolicy::Balanced => {
                let at = self
                    .balanced
                    .binary_search_by_key(&(set as u32, receiver), |&(s, r, _)| (s, r))
                    .expect("every (set, receiver) pair that carries bytes has a demand");
                self.balanced[at].2 as usize
            }
        }
    }
}

/// How many times the work of assigning replicated demand BALANCED may spend on moving it (each
/// move searches the busiest sources' demands; the bound keeps that from growing quadratically on
/// large or hostile tables, and ends the same way in every process).
const IMPROVEMENT_WORK: u64 = 4;

/// Chooses an offer for each demand so that the busiest source serves as little as possible.
///
/// 1. Demand that only one source can serve (every replica on one endpoint) is assigned first:
///    it loads that source whatever else is decided.
/// 2. Replicated demand follows, largest first, each to the replica whose source has the least
///    load so far (ties: nearer to the receiver, then the lower endpoint). The order depends on
///    bytes, receivers and the replicas' endpoints, never on tensor names.
/// 3. Then, while a demand on a busiest source can move to another of its replicas whose source
///    stays below that load, the move that evens the two sources best is made, until no single
///    move relieves a busiest source, or until the search has cost [`IMPROVEMENT_WORK`] times the
///    assignment (then the assignment stands as it is: still complete, only less even).
fn balance(merged: &Merged, sets: &[ReplicaSet], demand: &[Demand], work: &mut Budget) -> Result<Vec<u32>> {
    let mut sources: Vec<Endpoint> =
        memory::collect(merged.offers.len(), merged.offers.iter().map(|o| o.owner), "sources")?;
    sources.sort_unstable();
    sources.dedup();
    // The source of every offer, looked up once: the searches below read it many times.
    let source_index = memory::collect(
        merged.offers.len(),
        merged
            .offers
            .iter()
            .map(|o| sources.binary_search(&o.owner).expect("every owner is a source") as u32),
        "sources",
    )?;
    let source_of = |offer: usize| source_index[offer] as usize;
    let replicas = |d: &Demand| {
        let s = sets[d.set as usize];
        s.first..s.first + s.len
    };
    let mut load = memory::filled(0u64, sources.len(), "sources")?;
    let mut chosen = memory::filled(0u32, demand.len(), "owner choices")?;
    let mut replicated: Vec<u32> = Vec::new();
    for (i, d) in demand.iter().enumerate() {
        let offers = replicas(d);
        let first = merged.offers[offers.start].owner;
        if merged.offers[offers.clone()].iter().all(|o| o.owner == first) {
            chosen[i] = offers.start as u32;
            let s = source_of(offers.start);
            load[s] = load[s].saturating_add(d.bytes);
        } else {
            memory::push(&mut replicated, i as u32, "owner choices")?;
        }
    }
    // Largest first; among equals by receiver, then by the replicas' endpoints (a digest of the
    // list: set indices follow tensor names, endpoints do not), then by set, which only orders
    // demands with the same bytes, receiver and replicas: interchangeable for the loads.
    let owners_digest = |d: &Demand| {
        let mut h = Words::new();
        for &o in &source_index[replicas(d)] {
            h.u64(o.into());
        }
        h.finish()
    };
    let mut keyed: Vec<(std::cmp::Reverse<u64>, Endpoint, u64, u32)> = memory::collect(
        replicated.len(),
        replicated.iter().map(|&i| {
            let d = &demand[i as usize];
            (std::cmp::Reverse(d.bytes), d.receiver, owners_digest(d), i)
        }),
        "owner choices",
    )?;
    keyed.sort_unstable();
    for (slot, key) in replicated.iter_mut().zip(&keyed) {
        *slot = key.3;
    }
    drop(keyed);
    let mut assigned: Vec<Vec<u32>> = memory::filled(Vec::new(), sources.len(), "sources")?;
    let mut assignment_work = 0u64;
    for &i in &replicated {
        let d = &demand[i as usize];
        work.spend(replicas(d).len() as u64)?;
        assignment_work += replicas(d).len() as u64;
        let best = replicas(d)
            .min_by_key(|&o| {
                let owner = merged.offers[o].owner;
                (load[source_of(o)], owner.distance(d.receiver), owner, o)
            })
            .expect("a replica set is never empty");
        chosen[i as usize] = best as u32;
        let s = source_of(best);
        load[s] = load[s].saturating_add(d.bytes);
        memory::push(&mut assigned[s], i, "owner choices")?;
    }
    let mut search_left = IMPROVEMENT_WORK.saturating_mul(assignment_work);
    'moves: loop {
        // Among the moves off any of the busiest sources (several may share the highest load),
        // the one whose higher new load of the two sources is lowest: it evens the pair best.
        let ceiling = load.iter().copied().max().unwrap_or(0);
        let mut best: Option<(u64, u64, u8, Endpoint, usize, u32, usize)> = None;
        for from in (0..sources.len()).filter(|&s| load[s] == ceiling) {
            for &i in &assigned[from] {
                let d = &demand[i as usize];
                let Some(left) = search_left.checked_sub(replicas(d).len() as u64) else {
                    break 'moves;
                };
                search_left = left;
                for o in replicas(d) {
                    let to = source_of(o);
                    let after = load[to].saturating_add(d.bytes);
                    if to == from || after >= ceiling {
                        continue;
                    }
                    let owner = merged.offers[o].owner;
                    let key =
                        (after.max(ceiling - d.bytes), after, owner.distance(d.receiver), owner, o, i, from);
                    if best.is_none_or(|b| key < b) {
                        best = Some(key);
                    }
                }
            }
        }
        let Some((_, _, _, _, o, i, from)) = best else { break 'moves };
        let at = assigned[from].iter().position(|&x| x == i).expect("the demand is on its source");
        assigned[from].swap_remove(at);
        let bytes = demand[i as usize].bytes;
        let to = source_of(o);
        load[from] -= bytes;
        load[to] = load[to].saturating_add(bytes);
        chosen[i as usize] = o as u32;
        memory::push(&mut assigned[to], i, "owner choices")?;
    }
    Ok(chosen)
}
