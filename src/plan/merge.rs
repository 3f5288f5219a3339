//! Merging every rank's table into one canonical catalog: tensors by name, offers and needs resolved
//! to tensor dimensions, validated, and sorted by canonical keys so that the order in which tables or
//! their entries arrive never changes the plan.

use super::table::{Endpoint, Need, Offer, Region, Table, TensorSpec, MAX_DIMS};
use crate::bail;
use crate::error::{Error, Result, Status};
use std::collections::BTreeMap;

/// Per-dimension values of one box or layout; entries past the tensor's rank are zero.
pub(crate) type Dims = [u64; MAX_DIMS];

/// An offer resolved against the merged tensor list: strides explicit, in elements.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
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
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct CanonNeed {
    pub receiver: Endpoint,
    pub tensor: usize,
    pub lo: Dims,
    pub ext: Dims,
    pub addr: u64,
    pub strides: Dims,
}

/// Every table merged: tensors sorted by name, offers sorted by (tensor, box, owner, ...), needs
/// sorted by (receiver, tensor, box, ...).
pub(crate) struct Catalog {
    pub tensors: Vec<TensorSpec>,
    pub offers: Vec<CanonOffer>,
    /// `offers[offer_start[t]..offer_start[t + 1]]` are tensor `t`'s offers.
    pub offer_start: Vec<usize>,
    pub needs: Vec<CanonNeed>,
}

impl Catalog {
    pub fn offers_of(&self, tensor: usize) -> &[CanonOffer] {
        &self.offers[self.offer_start[tensor]..self.offer_start[tensor + 1]]
    }
}

pub(crate) fn merge(tables: &[&Table]) -> Result<Catalog> {
    // Tensors by name; the first description seen (in name order it does not matter which: all must agree).
    let mut by_name: BTreeMap<&str, &TensorSpec> = BTreeMap::new();
    for (t, table) in tables.iter().enumerate() {
        for spec in &table.tensors {
            validate_spec(spec).map_err(|e| e.context(format!("table {t}")))?;
            match by_name.get(spec.name.as_str()) {
                None => {
                    by_name.insert(&spec.name, spec);
                }
                Some(seen) => check_same(seen, spec)?,
            }
        }
    }
    let tensors: Vec<TensorSpec> = by_name.values().map(|s| (*s).clone()).collect();
    let index: BTreeMap<&str, usize> =
        tensors.iter().enumerate().map(|(i, s)| (s.name.as_str(), i)).collect();

    let mut offers = Vec::new();
    let mut needs = Vec::new();
    for (t, table) in tables.iter().enumerate() {
        let global = |local: u32, what: &str, i: usize| -> Result<usize> {
            let spec = table.tensors.get(local as usize).ok_or_else(|| {
                Error::invalid_argument(format!(
                    "table {t} {what} {i} names tensor index {local} but the table has {} tensors",
                    table.tensors.len()
                ))
            })?;
            Ok(index[spec.name.as_str()])
        };
        for (i, offer) in table.offers.iter().enumerate() {
            let tensor = global(offer.tensor, "offer", i)?;
            offers.push(
                canon_offer(&tensors[tensor], tensor, offer)
                    .map_err(|e| e.context(format!("table {t} offer {i}")))?,
            );
        }
        for (i, need) in table.needs.iter().enumerate() {
            let tensor = global(need.tensor, "need", i)?;
            needs.push(
                canon_need(&tensors[tensor], tensor, need)
                    .map_err(|e| e.context(format!("table {t} need {i}")))?,
            );
        }
    }
    offers.sort_unstable();
    needs.sort_unstable();
    let mut offer_start = vec![0; tensors.len() + 1];
    for offer in &offers {
        offer_start[offer.tensor + 1] += 1;
    }
    for t in 0..tensors.len() {
        offer_start[t + 1] += offer_start[t];
    }
    Ok(Catalog { tensors, offers, offer_start, needs })
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
