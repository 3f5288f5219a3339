//! Which part of a plan one build produces, and so what each stage must look at: the whole plan,
//! or the share of one process (every route from or to one of its endpoints), which is exactly
//! the whole plan's routes restricted to that process, built at a cost that grows with that
//! process's own needs and offers rather than with every process's.

use super::boxes::Boxed;
use super::memory;
use super::merge::{Merged, PackedOffer};
use super::options::OwnerPolicy;
use super::table::Endpoint;
use crate::error::Result;
use std::ops::Range;

/// What a build covers.
pub(crate) struct Scope {
    /// `None`: the whole plan; `Some(p)`: the share of process `p`.
    process: Option<u32>,
    /// Per tensor: whether its replica sets are cut into pieces and indexed.
    pub tensors: Vec<bool>,
    /// The needs to intersect with pieces (indices into the merged needs, ascending).
    pub needs: Vec<u32>,
    /// The merged needs this build checks for coverage and counts: the share's own receivers'.
    own: Range<usize>,
    /// Whether intersections of other processes' needs are kept only where this process holds a
    /// replica (false when every intersection counts: the whole plan, and BALANCED's demand).
    only_held: bool,
    /// BALANCED shares: per merged need, whether its segments may belong to the share (its own,
    /// or one meeting this process's offers); the other needs count only as demand. None: all.
    laid_out: Option<Vec<bool>>,
}

impl Scope {
    /// The whole plan: every tensor, every need.
    pub fn whole(merged: &Merged) -> Result<Scope> {
        Ok(Scope {
            process: None,
            tensors: memory::filled(true, merged.tensors.len(), "tensors")?,
            needs: memory::collect(merged.needs.len(), 0..merged.needs.len() as u32, "needs")?,
            own: 0..merged.needs.len(),
            only_held: false,
            laid_out: None,
        })
    }

    /// The share of process `process`: its own needs (the merged needs are sorted by receiver, so
    /// they are one range), and the needs of other processes that meet one of its offers, which
    /// it may serve. BALANCED weighs every receiver's demand against every source's load, so its
    /// shares intersect every need (but lay out only their own routes).
    pub fn process(merged: &Merged, process: u32, policy: OwnerPolicy) -> Result<Scope> {
        let start = merged.needs.partition_point(|n| n.receiver.process < process);
        let end = merged.needs.partition_point(|n| n.receiver.process <= process);
        // This process's offers, as (tensor, box), in tensor order (as the merged offers are).
        let mut held: Vec<(u32, Boxed)> = Vec::new();
        for (i, offer) in merged.offers.iter().enumerate().filter(|(_, o)| o.owner.process == process) {
            memory::push(&mut held, (offer.tensor, merged.offer_box(i)), "offers")?;
        }
        let meets_held = |i: usize| {
            let tensor = merged.needs[i].tensor;
            let first = held.partition_point(|&(t, _)| t < tensor);
            let mut mine = held[first..].iter().take_while(|&&(t, _)| t == tensor).peekable();
            if mine.peek().is_none() {
                return false;
            }
            let need = merged.need(i);
            let wanted = Boxed::new(need.lo, need.ext);
            mine.any(|(_, b)| b.intersect(&wanted, merged.geometry[need.tensor].0).is_some())
        };
        if policy == OwnerPolicy::Balanced {
            let laid_out = memory::collect(
                merged.needs.len(),
                (0..merged.needs.len()).map(|i| (start..end).contains(&i) || meets_held(i)),
                "needs",
            )?;
            let whole = Scope::whole(merged)?;
            return Ok(Scope { process: Some(process), own: start..end, laid_out: Some(laid_out), ..whole });
        }
        let mut tensors = memory::filled(false, merged.tensors.len(), "tensors")?;
        for &(t, _) in &held {
            tensors[t as usize] = true;
        }
        for need in &merged.needs[start..end] {
            tensors[need.tensor as usize] = true;
        }
        let mut needs = Vec::new();
        for i in 0..merged.needs.len() {
            if (start..end).contains(&i) || meets_held(i) {
                memory::push(&mut needs, i as u32, "needs")?;
            }
        }
        Ok(Scope { process: Some(process), tensors, needs, own: start..end, only_held: true, laid_out: None })
    }

    /// Whether need `i`'s segments may belong to this build (every need intersected counts as
    /// demand; a BALANCED share lays out only its own needs' and those meeting its offers).
    pub fn lays_out(&self, need: usize) -> bool {
        self.laid_out.as_ref().is_none_or(|l| l[need])
    }

    /// The merged needs this build checks for coverage and overlaps, and counts.
    pub fn own(&self) -> Range<usize> {
        self.own.clone()
    }

    /// Whether need `i` (an index into the merged needs) is one this build checks and counts.
    pub fn is_own(&self, need: usize) -> bool {
        self.own.contains(&need)
    }

    /// Whether an intersection of another process's need with a piece of the replica set of
    /// `replicas` (offers sorted by owner) can matter to this build.
    pub fn may_serve(&self, replicas: &[PackedOffer]) -> bool {
        match self.process {
            Some(p) if self.only_held => {
                let at = replicas.partition_point(|o| o.owner.process < p);
                replicas.get(at).is_some_and(|o| o.owner.process == p)
            }
            _ => true,
        }
    }

    /// Whether the route from `src` to `dst` belongs to this build.
    pub fn keeps(&self, src: Endpoint, dst: Endpoint) -> bool {
        self.process.is_none_or(|p| src.process == p || dst.process == p)
    }

    /// Whether `receiver`'s counts belong to this build.
    pub fn counts(&self, receiver: Endpoint) -> bool {
        self.process.is_none_or(|p| receiver.process == p)
    }
}
