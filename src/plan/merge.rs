//! Merging every rank's table into one canonical catalog: tensors by name (hash, then name), offers and needs resolved
//! to tensor dimensions, validated, and sorted by canonical keys so that the order in which tables or
//! their entries arrive never changes the plan.

use super::table::{Endpoint, Need, Offer, Region, Table, TensorSpec, MAX_DIMS};
use crate::bail;
use crate::error::{Error, Result, Status};
use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

/// Per-dimension values of one box or layout; entries past the tensor's rank are zero.
pub(crate) type Dims = [u64; MAX_DIMS];

/// An offer resolved against the merged tensor list: strides explicit, in elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct CanonOffer {
    pub tensor: usize,
    pub lo: Dims,
    pub ext: Dims,
    pub owner: Endpoint,
    pub addr: u64,
    pub strides: Dims,
    pub digest: Option<u64>,
}

/// A need resolved against the merged tensor list: destination strides indexed by tensor dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct CanonNeed {
    pub receiver: Endpoint,
    pub tensor: usize,
    pub lo: Dims,
    pub ext: Dims,
    pub addr: u64,
    pub strides: Dims,
}

/// Every table merged: tensors sorted by (hash of the name, name), offers sorted by (tensor, box, owner, ...), needs
/// sorted by (receiver, tensor, box, ...).
pub(crate) struct Catalog<'a> {
    pub tensors: Vec<&'a TensorSpec>,
    /// (dimensions, element size) of each tensor: a dense copy of what hot loops read, so they do
    /// not chase pointers into the callers' tables.
    pub layout: Vec<(usize, u64)>,
    pub offers: Vec<CanonOffer>,
    /// `offers[offer_start[t]..offer_start[t + 1]]` are tensor `t`'s offers.
    pub offer_start: Vec<usize>,
    pub needs: Vec<CanonNeed>,
}

impl Catalog<'_> {
    pub fn offers_of(&self, tensor: usize) -> &[CanonOffer] {
        &self.offers[self.offer_start[tensor]..self.offer_start[tensor + 1]]
    }
}

pub(crate) fn merge<'a>(tables: &[&'a Table]) -> Result<Catalog<'a>> {
    // Distinct tensors in the order first seen, then ranked by name: the global index is the rank.
    let entries: usize = tables.iter().map(|t| t.tensors.len()).sum();
    let mut seen: HashMap<&str, usize, BuildHasherDefault<Fnv>> =
        HashMap::with_capacity_and_hasher(entries, BuildHasherDefault::default());
    let mut distinct: Vec<&'a TensorSpec> = Vec::new();
    // What later descriptions are compared with, kept dense (reading the first description again
    // would be a cache miss into another table per entry).
    let mut described: Vec<(u32, u32, usize, Dims)> = Vec::new();
    let describe = |spec: &TensorSpec| {
        let mut shape = [0; MAX_DIMS];
        shape[..spec.shape.len()].copy_from_slice(&spec.shape);
        (spec.dtype, spec.elem_size, spec.shape.len(), shape)
    };
    let mut local_to_distinct: Vec<Vec<usize>> = Vec::with_capacity(tables.len());
    for (t, table) in tables.iter().enumerate() {
        let mut map = Vec::with_capacity(table.tensors.len());
        // Tables tend to list tensors in the same order: try the successor of the previous match
        // before hashing the name.
        let mut guess = usize::MAX;
        for spec in &table.tensors {
            validate_spec(spec).map_err(|e| e.context(format!("table {t}")))?;
            let known = distinct.get(guess).filter(|d| d.name == spec.name).map(|_| guess);
            let at = match known {
                Some(at) => at,
                None => match seen.entry(&spec.name) {
                    std::collections::hash_map::Entry::Occupied(e) => *e.get(),
                    std::collections::hash_map::Entry::Vacant(e) => {
                        distinct.push(spec);
                        described.push(describe(spec));
                        *e.insert(distinct.len() - 1)
                    }
                },
            };
            if described[at] != describe(spec) {
                check_same(distinct[at], spec)?;
            }
            map.push(at);
            guess = at + 1;
        }
        local_to_distinct.push(map);
    }
    // Ordered by a hash of the name, then the name: a content-only order (the same in every
    // process) that rarely needs to compare the long shared prefixes of parameter names.
    let keyed: Vec<u64> = distinct.iter().map(|s| name_hash(&s.name)).collect();
    let mut by_name: Vec<usize> = (0..distinct.len()).collect();
    by_name.sort_unstable_by(|&a, &b| {
        keyed[a].cmp(&keyed[b]).then_with(|| distinct[a].name.cmp(&distinct[b].name))
    });
    let mut global = vec![0; distinct.len()];
    for (g, &d) in by_name.iter().enumerate() {
        global[d] = g;
    }
    let tensors: Vec<&'a TensorSpec> = by_name.iter().map(|&d| distinct[d]).collect();

    // Resolve every entry in input order (the order its memory was written in, so reading the
    // entries' vectors stays cache-friendly), then put the dense results in canonical order.
    let mut offers = Vec::with_capacity(tables.iter().map(|t| t.offers.len()).sum());
    let mut needs = Vec::with_capacity(tables.iter().map(|t| t.needs.len()).sum());
    for (t, table) in tables.iter().enumerate() {
        let global = |local: u32, what: &str, i: usize| -> Result<usize> {
            let d = local_to_distinct[t].get(local as usize).ok_or_else(|| {
                Error::invalid_argument(format!(
                    "table {t} {what} {i} names tensor index {local} but the table has {} tensors",
                    table.tensors.len()
                ))
            })?;
            Ok(global[*d])
        };
        for (i, offer) in table.offers.iter().enumerate() {
            let tensor = global(offer.tensor, "offer", i)?;
            offers.push(
                canon_offer(tensors[tensor], tensor, offer)
                    .map_err(|e| e.context(format!("table {t} offer {i}")))?,
            );
        }
        for (i, need) in table.needs.iter().enumerate() {
            let tensor = global(need.tensor, "need", i)?;
            needs.push(
                canon_need(tensors[tensor], tensor, need)
                    .map_err(|e| e.context(format!("table {t} need {i}")))?,
            );
        }
    }
    if offers.len() > u32::MAX as usize || needs.len() > u32::MAX as usize {
        bail!(Status::Unsupported, "more than 2^32 offers or needs");
    }
    // Canonical order without comparing whole entries across tables: bucket by tensor (and
    // receiver), then sort each small bucket fully.
    let order =
        bucket_order((0..offers.len() as u32).collect(), tensors.len(), |i| offers[i as usize].tensor);
    let offers = sort_runs(order.iter().map(|&i| offers[i as usize]).collect(), |a, b| a.tensor == b.tensor);
    let receivers: BTreeMap<Endpoint, usize> =
        needs.iter().map(|n| (n.receiver, 0)).collect::<BTreeMap<_, _>>().into_keys().zip(0..).collect();
    let receiver_of: Vec<usize> = needs.iter().map(|n| receivers[&n.receiver]).collect();
    let order = bucket_order((0..needs.len() as u32).collect(), tensors.len(), |i| needs[i as usize].tensor);
    let order = bucket_order(order, receivers.len(), |i| receiver_of[i as usize]);
    let needs = sort_runs(order.iter().map(|&i| needs[i as usize]).collect(), |a, b| {
        (a.receiver, a.tensor) == (b.receiver, b.tensor)
    });
    let mut offer_start = vec![0; tensors.len() + 1];
    for offer in &offers {
        offer_start[offer.tensor + 1] += 1;
    }
    for t in 0..tensors.len() {
        offer_start[t + 1] += offer_start[t];
    }
    let layout = tensors.iter().map(|s| (s.shape.len(), u64::from(s.elem_size))).collect();
    Ok(Catalog { tensors, layout, offers, offer_start, needs })
}

/// `order` (indices) stably sorted by `key` (below `buckets`): a counting sort.
fn bucket_order(order: Vec<u32>, buckets: usize, key: impl Fn(u32) -> usize) -> Vec<u32> {
    let mut start = vec![0usize; buckets + 1];
    for &i in &order {
        start[key(i) + 1] += 1;
    }
    for b in 0..buckets {
        start[b + 1] += start[b];
    }
    let mut out = vec![0u32; order.len()];
    for &i in &order {
        let k = key(i);
        out[start[k]] = i;
        start[k] += 1;
    }
    out
}

/// Sorts each maximal run of neighbours that `same` groups together.
fn sort_runs<T: Ord>(mut items: Vec<T>, same: impl Fn(&T, &T) -> bool) -> Vec<T> {
    let mut start = 0;
    while start < items.len() {
        let mut end = start + 1;
        while end < items.len() && same(&items[start], &items[end]) {
            end += 1;
        }
        if end - start > 1 {
            items[start..end].sort_unstable();
        }
        start = end;
    }
    items
}

fn name_hash(name: &str) -> u64 {
    let mut h = Fnv::default();
    h.write(name.as_bytes());
    h.finish()
}

/// FNV-1a for the name index: fast on short keys, and deterministic (nothing depends on its order).
#[derive(Default)]
pub(crate) struct Fnv(u64);

impl Hasher for Fnv {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        let mut h = if self.0 == 0 { 0xcbf2_9ce4_8422_2325 } else { self.0 };
        for &b in bytes {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
        self.0 = h;
    }
}

/// Checks a tensor description on its own: a name, a positive element size, at most MAX_DIMS
/// dimensions, and a byte size that fits in 64 bits.
pub(crate) fn validate_spec(spec: &TensorSpec) -> Result<()> {
    if spec.name.is_empty() {
        return Err(Error::invalid_argument("a tensor has an empty name"));
    }
    if spec.elem_size == 0 {
        return Err(Error::invalid_argument(format!("tensor '{}' has element size 0", spec.name)));
    }
    if spec.shape.len() > MAX_DIMS {
        return Err(Error::invalid_argument(format!(
            "tensor '{}' has {} dimensions; at most {MAX_DIMS} are supported",
            spec.name,
            spec.shape.len()
        )));
    }
    let elems = spec.shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
    if elems.and_then(|e| e.checked_mul(spec.elem_size.into())).is_none() {
        return Err(Error::invalid_argument(format!("tensor '{}' has more than 2^64 bytes", spec.name)));
    }
    Ok(())
}

pub(crate) fn check_same(a: &TensorSpec, b: &TensorSpec) -> Result<()> {
    let name = &a.name;
    if a.elem_size != b.elem_size {
        bail!(
            Status::TensorMismatch,
            "tensor '{name}' has element size {} in one table and {} in another",
            a.elem_size,
            b.elem_size
        );
    }
    if a.shape != b.shape {
        bail!(
            Status::TensorMismatch,
            "tensor '{name}' has shape {:?} in one table and {:?} in another",
            a.shape,
            b.shape
        );
    }
    if a.dtype != b.dtype {
        bail!(
            Status::TensorMismatch,
            "tensor '{name}' has dtype {} in one table and {} in another",
            a.dtype,
            b.dtype
        );
    }
    Ok(())
}

/// Checks a box against the tensor's shape and returns its (offset, extent).
fn resolve_region(spec: &TensorSpec, region: &Region) -> Result<(Dims, Dims)> {
    let n = spec.shape.len();
    if region.offset.len() != n || region.extent.len() != n {
        bail!(
            Status::TensorMismatch,
            "box of tensor '{}' has {} offsets and {} extents; the tensor has {n} dimensions",
            spec.name,
            region.offset.len(),
            region.extent.len()
        );
    }
    let (mut lo, mut ext) = ([0; MAX_DIMS], [0; MAX_DIMS]);
    for d in 0..n {
        let end = region.offset[d].checked_add(region.extent[d]);
        if end.is_none_or(|end| end > spec.shape[d]) {
            bail!(
                Status::TensorMismatch,
                "box offset {:?} extent {:?} is outside tensor '{}' of shape {:?}",
                region.offset,
                region.extent,
                spec.name,
                spec.shape
            );
        }
        lo[d] = region.offset[d];
        ext[d] = region.extent[d];
    }
    Ok((lo, ext))
}

/// The byte span `[addr, addr + span)` touched by a strided box, or None when it does not fit in 64 bits.
pub(crate) fn byte_span(n: usize, ext: &Dims, strides: &Dims, elem: u64) -> Option<u64> {
    if ext[..n].contains(&0) {
        return Some(0);
    }
    let mut last = 0u64;
    for d in 0..n {
        last = last.checked_add((ext[d] - 1).checked_mul(strides[d])?)?;
    }
    last.checked_add(1)?.checked_mul(elem)
}

fn check_addresses(spec: &TensorSpec, addr: u64, ext: &Dims, strides: &Dims, what: &str) -> Result<()> {
    let n = spec.shape.len();
    let span = byte_span(n, ext, strides, spec.elem_size.into());
    if span.and_then(|s| addr.checked_add(s)).is_none() {
        return Err(Error::invalid_argument(format!(
            "{what} of tensor '{}' at {addr:#x} with strides {:?} runs past the end of the address space",
            spec.name,
            &strides[..n]
        )));
    }
    Ok(())
}

fn canon_offer(spec: &TensorSpec, tensor: usize, offer: &Offer) -> Result<CanonOffer> {
    let n = spec.shape.len();
    let (lo, ext) = resolve_region(spec, &offer.region)?;
    let mut strides = [0; MAX_DIMS];
    match &offer.strides {
        Some(given) => {
            if given.len() != n {
                return Err(Error::invalid_argument(format!(
                    "offer of tensor '{}' has {} strides; the tensor has {n} dimensions",
                    spec.name,
                    given.len()
                )));
            }
            strides[..n].copy_from_slice(given);
        }
        None => {
            let mut step = 1u64;
            for d in (0..n).rev() {
                strides[d] = step;
                step = step.saturating_mul(ext[d]);
            }
        }
    }
    check_addresses(spec, offer.addr, &ext, &strides, "offer")?;
    Ok(CanonOffer { tensor, lo, ext, owner: offer.owner, addr: offer.addr, strides, digest: offer.digest })
}

fn canon_need(spec: &TensorSpec, tensor: usize, need: &Need) -> Result<CanonNeed> {
    let n = spec.shape.len();
    let (lo, ext) = resolve_region(spec, &need.region)?;
    if need.strides.len() != n {
        return Err(Error::invalid_argument(format!(
            "need of tensor '{}' has {} destination strides; the tensor has {n} dimensions",
            spec.name,
            need.strides.len()
        )));
    }
    let mut strides = [0; MAX_DIMS];
    match &need.perm {
        None => strides[..n].copy_from_slice(&need.strides),
        Some(perm) => {
            let mut seen = [false; MAX_DIMS];
            let valid = perm.len() == n
                && perm.iter().all(|&p| (p as usize) < n && !std::mem::replace(&mut seen[p as usize], true));
            if !valid {
                return Err(Error::invalid_argument(format!(
                    "need of tensor '{}' has permutation {perm:?}, which is not a permutation of 0..{n}",
                    spec.name
                )));
            }
            for (d, &p) in perm.iter().enumerate() {
                strides[p as usize] = need.strides[d];
            }
        }
    }
    check_addresses(spec, need.addr, &ext, &strides, "need")?;
    Ok(CanonNeed { receiver: need.receiver, tensor, lo, ext, addr: need.addr, strides })
}

/// Checks one offer against its tensor, as planning will (for callers that add entries one by one).
pub(crate) fn check_offer(spec: &TensorSpec, offer: &Offer) -> Result<()> {
    canon_offer(spec, 0, offer).map(|_| ())
}

/// Checks one need against its tensor, as planning will.
pub(crate) fn check_need(spec: &TensorSpec, need: &Need) -> Result<()> {
    canon_need(spec, 0, need).map(|_| ())
}
