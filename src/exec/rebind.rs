//! Buffers that moved: which prepared addresses a rebind changes, found without planning and
//! without visiting segments the move does not touch.
//!
//! At creation every address the executor's batches read or write in caller memory is registered
//! with the byte extent its segment covers on its device. Extents that overlap form one *span* (a
//! buffer as this plan sees it: bytes that must move together). A rebind of `[old, old + len)` to
//! `new` must cover whole spans (one cut through would leave a segment half in the old place: a new
//! plan is needed) and moves each by the same offset. A coalesced plan may join buffers that sit at
//! regular distances into one strided segment; those then move only together (a plan built without
//! coalescing keeps every buffer in segments of its own).
//!
//! A rebind names a buffer by where it is now for the executor: where the last run had it, or where a
//! rebind since then put it. Moved spans are kept apart from unmoved ones until the next run settles
//! them, so a range that holds both (a buffer moved onto one not moved yet) is ambiguous and refused
//! rather than guessed; buffers trade places through a third address (A to X, B to A's, A to B's).

use crate::error::{Error, Result, Status};
use crate::segment::Side;
use std::collections::{BTreeMap, HashMap};

/// Which prepared list holds a registered address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Target {
    Copy(u32),
    Verify(u32),
}

/// One registered address: segment `index` of `target`, its `side`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Ref {
    pub target: Target,
    pub index: u32,
    pub side: Side,
}

#[derive(Clone, Debug)]
struct Span {
    lo: u64,
    hi: u64,
    refs: Vec<Ref>,
}

/// The spans of one device: `settled` (as of the last run, not moved since) and `moved` (rebound
/// since), each keyed by current start and disjoint within itself.
#[derive(Debug, Default)]
struct Device {
    spans: Vec<Span>,
    settled: BTreeMap<u64, usize>,
    moved: BTreeMap<u64, usize>,
}

/// Spans of `map` that intersect `[lo, hi)`.
fn intersecting(map: &BTreeMap<u64, usize>, spans: &[Span], lo: u64, hi: u64) -> Vec<usize> {
    let before = map.range(..lo).next_back().map(|(_, &id)| id).filter(|&id| spans[id].hi > lo);
    before.into_iter().chain(map.range(lo..hi).map(|(_, &id)| id)).collect()
}

#[derive(Debug, Default)]
pub(crate) struct AddressBook {
    devices: HashMap<i32, Device>,
}

/// Registers extents before the book is built.
#[derive(Default)]
pub(crate) struct Registrar {
    extents: HashMap<i32, Vec<(u64, u64, Ref)>>,
}

impl Registrar {
    /// Registers `side` of segment `index` of `target`, whose extent on `device` is `[lo, hi)`.
    pub fn add(&mut self, device: i32, lo: u64, hi: u64, target: Target, index: usize, side: Side) {
        let reference = Ref { target, index: index as u32, side };
        self.extents.entry(device).or_default().push((lo, hi, reference));
    }

    /// Joins overlapping extents into spans.
    pub fn build(self) -> AddressBook {
        let mut devices = HashMap::new();
        for (device, mut extents) in self.extents {
            extents.sort_unstable_by_key(|&(lo, hi, _)| (lo, hi));
            let mut spans: Vec<Span> = Vec::new();
            for (lo, hi, reference) in extents {
                match spans.last_mut() {
                    Some(span) if lo < span.hi => {
                        span.hi = span.hi.max(hi);
                        span.refs.push(reference);
                    }
                    _ => spans.push(Span { lo, hi, refs: vec![reference] }),
                }
            }
            let settled = spans.iter().enumerate().map(|(id, s)| (s.lo, id)).collect();
            devices.insert(device, Device { spans, settled, moved: BTreeMap::new() });
        }
        AddressBook { devices }
    }
}

impl AddressBook {
    /// Moves every span inside `[old, old + len)` on `device` by `new - old` and returns the
    /// references to patch with that offset. Nothing changes on error: InvalidArgument (empty or
    /// overflowing range, a range that is both a moved and an unmoved buffer, a destination
    /// overlapping another moved buffer), NotFound (no registered byte there: nothing to rebind),
    /// PlanStale (the range cuts through a span), and `check`'s error: it is shown the references
    /// that would move and the offset before anything changes.
    pub fn rebind_checked(
        &mut self,
        device: i32,
        (old, new, len): (u64, u64, u64),
        check: impl FnOnce(&[Ref], u64) -> Result<()>,
    ) -> Result<(Vec<Ref>, u64)> {
        let (Some(old_end), Some(new_end)) = (old.checked_add(len), new.checked_add(len)) else {
            crate::bail!(Status::InvalidArgument, "the range of {len} bytes runs past 2^64");
        };
        if len == 0 || new == 0 {
            crate::bail!(Status::InvalidArgument, "length and new base must not be 0");
        }
        if new == old {
            // A move by 0 would register the range as moved onto itself, where it overlaps itself:
            // every later run would be refused as stale.
            crate::bail!(
                Status::InvalidArgument,
                "new_base {new:#x} equals old_base: the range has not moved (nothing to rebind)"
            );
        }
        let Some(spans) = self.devices.get_mut(&device) else {
            crate::bail!(Status::NotFound, "this executor reads and writes nothing on device {device}");
        };
        let settled = intersecting(&spans.settled, &spans.spans, old, old_end);
        let moved = intersecting(&spans.moved, &spans.spans, old, old_end);
        let ids = match (settled.is_empty(), moved.is_empty()) {
            (true, true) => crate::bail!(
                Status::NotFound,
                "no buffer of this executor's plan lies in [{old:#x}, {old_end:#x}) on device {device} \
                 (nothing to rebind)"
            ),
            (false, false) => crate::bail!(
                Status::InvalidArgument,
                "[{old:#x}, {old_end:#x}) on device {device} holds both buffers rebound since the last run \
                 and buffers not: run once between these rebinds"
            ),
            (false, true) => settled,
            (true, false) => moved.clone(),
        };
        for &id in &ids {
            let span = &spans.spans[id];
            if span.lo < old || span.hi > old_end {
                return Err(Error::new(
                    Status::PlanStale,
                    format!(
                        "[{old:#x}, {old_end:#x}) on device {device} cuts through [{:#x}, {:#x}), bytes the plan \
                         reads or writes together (a segment crosses the range's edge): build a new plan (one \
                         built without coalescing keeps every buffer in segments of its own)",
                        span.lo, span.hi
                    ),
                ));
            }
        }
        let delta = new.wrapping_sub(old);
        let clash =
            intersecting(&spans.moved, &spans.spans, new, new_end).into_iter().find(|id| !moved.contains(id));
        if let Some(other) = clash {
            let span = &spans.spans[other];
            crate::bail!(
                Status::InvalidArgument,
                "[{new:#x}, {new_end:#x}) on device {device} overlaps [{:#x}, {:#x}), where another buffer \
                 was rebound since the last run",
                span.lo,
                span.hi
            );
        }
        let refs: Vec<Ref> = ids.iter().flat_map(|&id| spans.spans[id].refs.iter().copied()).collect();
        check(&refs, delta)?;
        for id in ids {
            let span = &mut spans.spans[id];
            spans.settled.remove(&span.lo);
            spans.moved.remove(&span.lo);
            span.lo = span.lo.wrapping_add(delta);
            span.hi = span.hi.wrapping_add(delta);
            spans.moved.insert(span.lo, id);
        }
        Ok((refs, delta))
    }

    /// [`AddressBook::rebind_checked`] with nothing more checked.
    #[cfg(test)]
    pub fn rebind(&mut self, device: i32, old: u64, new: u64, len: u64) -> Result<(Vec<Ref>, u64)> {
        self.rebind_checked(device, (old, new, len), |_, _| Ok(()))
    }

    /// Whether spans were moved since the last [`AddressBook::settle`].
    pub fn has_moved(&self) -> bool {
        self.devices.values().any(|d| !d.moved.is_empty())
    }

    /// Makes every moved span settled (at a run). PlanStale when two buffers now overlap; then
    /// nothing changes, so that every later run is refused too rather than writing both buffers'
    /// bytes into one place.
    pub fn settle(&mut self) -> Result<()> {
        for (device, spans) in &self.devices {
            for &id in spans.moved.values() {
                let (lo, hi) = (spans.spans[id].lo, spans.spans[id].hi);
                if let Some(&other) = intersecting(&spans.settled, &spans.spans, lo, hi).first() {
                    let span = &spans.spans[other];
                    crate::bail!(
                        Status::PlanStale,
                        "after the rebinds, [{lo:#x}, {hi:#x}) and [{:#x}, {:#x}) overlap on device {device}: \
                         build a new plan",
                        span.lo,
                        span.hi
                    );
                }
            }
        }
        for spans in self.devices.values_mut() {
            for (lo, id) in std::mem::take(&mut spans.moved) {
                spans.settled.insert(lo, id);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn book(extents: &[(i32, u64, u64)]) -> AddressBook {
        let mut registrar = Registrar::default();
        for (i, &(device, lo, hi)) in extents.iter().enumerate() {
            registrar.add(device, lo, hi, Target::Copy(0), i, Side::Destination);
        }
        registrar.build()
    }

    fn indices(refs: &[Ref]) -> Vec<u32> {
        let mut v: Vec<u32> = refs.iter().map(|r| r.index).collect();
        v.sort_unstable();
        v
    }

    #[test]
    fn whole_buffers_move_and_cuts_are_plan_stale() {
        // Buffer A [0x1000, 0x2000) read by segments 0 and 1 (overlapping extents: one span);
        // buffer B [0x2000, 0x2800) by segment 2; device 1 has its own.
        let mut b =
            book(&[(0, 0x1000, 0x1800), (0, 0x1400, 0x2000), (0, 0x2000, 0x2800), (1, 0x1000, 0x1100)]);
        assert_eq!(b.rebind(0, 0x1000, 0x9000, 0x800).unwrap_err().status, Status::PlanStale);
        assert_eq!(b.rebind(0, 0x1400, 0x9000, 0x1000).unwrap_err().status, Status::PlanStale);
        assert_eq!(b.rebind(0, 0x3000, 0x9000, 0x100).unwrap_err().status, Status::NotFound);
        assert_eq!(b.rebind(2, 0x1000, 0x9000, 0x100).unwrap_err().status, Status::NotFound);
        assert_eq!(b.rebind(0, 0x1000, 0x9000, 0).unwrap_err().status, Status::InvalidArgument);
        assert_eq!(b.rebind(0, u64::MAX - 4, 0x9000, 0x10).unwrap_err().status, Status::InvalidArgument);
        let (refs, delta) = b.rebind(0, 0x1000, 0x9000, 0x1000).unwrap();
        assert_eq!((indices(&refs), delta), (vec![0, 1], 0x8000));
        // A range covering both buffers moves both.
        let mut both = book(&[(0, 0x1000, 0x1800), (0, 0x2000, 0x2800)]);
        assert_eq!(indices(&both.rebind(0, 0x1000, 0x5000, 0x1800).unwrap().0), vec![0, 1]);
    }

    #[test]
    fn buffers_trade_places_between_runs() {
        let mut b = book(&[(0, 0x1000, 0x2000), (0, 0x2000, 0x3000)]);
        // A moved onto B's place: 0x2000 now names both, which is refused, not guessed.
        let mut direct = book(&[(0, 0x1000, 0x2000), (0, 0x2000, 0x3000)]);
        assert_eq!(indices(&direct.rebind(0, 0x1000, 0x2000, 0x1000).unwrap().0), vec![0]);
        assert_eq!(direct.rebind(0, 0x2000, 0x1000, 0x1000).unwrap_err().status, Status::InvalidArgument);
        // Through a third address: A to 0x7000, B to A's place, A (named where the last rebind put
        // it) to B's.
        let (refs, delta) = b.rebind(0, 0x1000, 0x7000, 0x1000).unwrap();
        assert_eq!((indices(&refs), delta), (vec![0], 0x6000));
        assert_eq!(indices(&b.rebind(0, 0x2000, 0x1000, 0x1000).unwrap().0), vec![1]);
        let (refs, delta) = b.rebind(0, 0x7000, 0x2000, 0x1000).unwrap();
        assert_eq!((indices(&refs), delta), (vec![0], 0x2000u64.wrapping_sub(0x7000)));
        // Two buffers moved onto each other are refused.
        assert_eq!(b.rebind(0, 0x2000, 0x1800, 0x1000).unwrap_err().status, Status::InvalidArgument);
        assert!(b.has_moved());
        b.settle().unwrap();
        assert!(!b.has_moved());
        assert_eq!(indices(&b.rebind(0, 0x2000, 0x3000, 0x1000).unwrap().0), vec![0]);
    }

    #[test]
    fn settling_overlapping_buffers_is_plan_stale() {
        let mut b = book(&[(0, 0x1000, 0x2000), (0, 0x4000, 0x5000)]);
        b.rebind(0, 0x1000, 0x4800, 0x1000).unwrap();
        assert_eq!(b.settle().unwrap_err().status, Status::PlanStale);
        // Still refused at the next settle: the refused one changed nothing.
        assert!(b.has_moved());
        assert_eq!(b.settle().unwrap_err().status, Status::PlanStale);
    }
}
