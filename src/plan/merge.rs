//! Merging every rank's table into one canonical catalog: tensors by name (hash, then name), offers and needs resolved
//! to tensor dimensions, validated, and sorted by canonical keys so that the order in which tables or
//! their entries arrive never changes the plan.

use super::boxes::Boxed;
use super::table::{Endpoint, Need, Offer, Region, Table, TensorSpec, MAX_DIMS};
use crate::bail;
use crate::error::{Error, Result, Status};
use std::collections::BTreeMap;
use std::hash::Hasher;

/// Per-dimension values of one box or layout; entries past the tensor's rank are zero.
pub(crate) type Dims = [u64; MAX_DIMS];

/// An offer resolved against the merged tensor list: strides explicit, in elements. The catalog
/// keeps offers packed (see [`PackedOffer`]) and reads their values in place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CanonNeed {
    pub receiver: Endpoint,
    pub tensor: usize,
    pub lo: Dims,
    pub ext: Dims,
    pub addr: u64,
    pub strides: Dims,
}

/// An offer as the catalog stores it: the fixed fields, and where its box and strides start in
/// [`Catalog::offer_dims`] (offset, extent and strides, `n` values each for a tensor of `n`
/// dimensions). A few dozen bytes instead of three full `Dims`: sorting and copying tens of
/// thousands of entries moves (and faults in) a fifth of the memory.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PackedOffer {
    pub tensor: u32,
    pub owner: Endpoint,
    pub addr: u64,
    pub digest: Option<u64>,
    dims: usize,
}

/// A need as the catalog stores it; its box and strides are in [`Catalog::need_dims`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct PackedNeed {
    pub receiver: Endpoint,
    pub tensor: u32,
    pub addr: u64,
    dims: usize,
}

/// Every table merged: tensors sorted by (hash of the name, name), offers sorted by (tensor, box, owner, ...), needs
/// sorted by (receiver, tensor, box, ...).
pub(crate) struct Catalog<'a> {
    pub tensors: Vec<&'a TensorSpec>,
    /// (dimensions, element size) of each tensor: a dense copy of what hot loops read, so they do
    /// not chase pointers into the callers' tables.
    pub layout: Vec<(usize, u64)>,
    pub offers: Vec<PackedOffer>,
    /// `offers[offer_start[t]..offer_start[t + 1]]` are tensor `t`'s offers.
    pub offer_start: Vec<usize>,
    pub needs: Vec<PackedNeed>,
    offer_dims: Vec<u64>,
    need_dims: Vec<u64>,
}

/// Offset, extent and strides of `n` dimensions stored from `at`, as full `Dims`.
fn expand(pool: &[u64], at: usize, n: usize) -> (Dims, Dims, Dims) {
    let values = &pool[at..at + 3 * n];
    let (mut lo, mut ext, mut strides) = ([0; MAX_DIMS], [0; MAX_DIMS], [0; MAX_DIMS]);
    // Element by element rather than `copy_from_slice`: a call to memcpy per short copy costs more
    // than the copy.
    for d in 0..n.min(MAX_DIMS) {
        lo[d] = values[d];
        ext[d] = values[n + d];
        strides[d] = values[2 * n + d];
    }
    (lo, ext, strides)
}

/// Whether two short value lists are equal, compared in place (slice equality calls memcmp).
pub(crate) fn same_values(a: &[u64], b: &[u64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x == y)
}

impl Catalog<'_> {
    /// Catalog indices of tensor `tensor`'s offers.
    pub fn offer_range(&self, tensor: usize) -> std::ops::Range<usize> {
        self.offer_start[tensor]..self.offer_start[tensor + 1]
    }

    /// Offset, extent and strides of offer `i`, one value per dimension of its tensor.
    pub fn offer_parts(&self, i: usize) -> (&[u64], &[u64], &[u64]) {
        let p = &self.offers[i];
        let n = self.layout[p.tensor as usize].0;
        let values = &self.offer_dims[p.dims..p.dims + 3 * n];
        (&values[..n], &values[n..2 * n], &values[2 * n..])
    }

    /// The box of offer `i`.
    pub fn offer_box(&self, i: usize) -> Boxed {
        let (lo, ext, _) = self.offer_parts(i);
        Boxed::from_parts(lo, ext)
    }

    /// Need `i`, expanded.
    pub fn need(&self, i: usize) -> CanonNeed {
        let p = &self.needs[i];
        let tensor = p.tensor as usize;
        let (lo, ext, strides) = expand(&self.need_dims, p.dims, self.layout[tensor].0);
        CanonNeed { receiver: p.receiver, tensor, lo, ext, addr: p.addr, strides }
    }
}

pub(crate) fn merge<'a>(tables: &[&'a Table]) -> Result<Catalog<'a>> {
    // Distinct tensors in the order first seen, then ranked by name: the global index is the rank.
    let entries: usize = tables.iter().map(|t| t.tensors.len()).sum();
    // The name index below holds distinct indices as u32; there are no more of them than entries.
    if entries > u32::MAX as usize {
        bail!(Status::Unsupported, "more than 2^32 tensor descriptions in all tables");
    }
    let mut distinct: Vec<&'a TensorSpec> = Vec::new();
    // What later descriptions are compared with, kept dense (reading the first description again
    // would be a cache miss into another table per entry).
    let mut described: Vec<(u32, u32, usize, Dims)> = Vec::new();
    let describe = |spec: &TensorSpec| {
        let mut shape = [0; MAX_DIMS];
        shape[..spec.shape.len()].copy_from_slice(&spec.shape);
        (spec.dtype, spec.elem_size, spec.shape.len(), shape)
    };
    // The names of distinct tensors, copied into one dense buffer as they are first seen, with
    // their hashes: comparing a later table's name with a candidate then reads this buffer instead
    // of chasing a pointer into another table (a cache miss per entry).
    let mut names: Vec<u8> = Vec::new();
    let mut name_at: Vec<std::ops::Range<usize>> = Vec::new();
    let mut keyed: Vec<u64> = Vec::new();
    // The name index: open addressing with linear probing over distinct indices (`EMPTY` when
    // free), at most half full. Keys are compared through `keyed` and `names`.
    const EMPTY: u32 = u32::MAX;
    let mut slots: Vec<u32> = vec![EMPTY; (2 * entries).next_power_of_two()];
    let mask = slots.len() - 1;
    // Tables tend to list tensors in the same order: the guess for an entry is the distinct tensor
    // that followed the previous entry's tensor in the last table that listed it, tried before
    // hashing the name.
    let mut follows: Vec<usize> = Vec::new();
    let mut first_of_last_table = usize::MAX;
    let mut local_to_distinct: Vec<Vec<usize>> = Vec::with_capacity(tables.len());
    for (t, table) in tables.iter().enumerate() {
        let mut map = Vec::with_capacity(table.tensors.len());
        let mut previous = usize::MAX;
        for (j, spec) in table.tensors.iter().enumerate() {
            if let Some(ahead) = table.tensors.get(j + PREFETCH_AHEAD) {
                prefetch(ahead.name.as_ptr());
                prefetch(ahead.shape.as_ptr());
            }
            validate_spec(spec).map_err(|e| e.context(format!("table {t}")))?;
            let name = spec.name.as_bytes();
            let guess = if previous == usize::MAX { first_of_last_table } else { follows[previous] };
            let known = name_at.get(guess).filter(|r| names[(*r).clone()] == *name).map(|_| guess);
            let at = match known {
                Some(at) => at,
                None => {
                    let hash = name_hash(&spec.name);
                    let mut slot = hash as usize & mask;
                    loop {
                        let d = slots[slot];
                        if d == EMPTY {
                            let at = distinct.len();
                            slots[slot] = at as u32;
                            distinct.push(spec);
                            described.push(describe(spec));
                            names.extend_from_slice(name);
                            name_at.push(names.len() - name.len()..names.len());
                            keyed.push(hash);
                            follows.push(usize::MAX);
                            break at;
                        }
                        let d = d as usize;
                        if keyed[d] == hash && names[name_at[d].clone()] == *name {
                            break d;
                        }
                        slot = (slot + 1) & mask;
                    }
                }
            };
            if described[at] != describe(spec) {
                check_same(distinct[at], spec)?;
            }
            map.push(at);
            if previous == usize::MAX {
                first_of_last_table = at;
            } else {
                follows[previous] = at;
            }
            previous = at;
        }
        local_to_distinct.push(map);
    }
    // Ordered by a hash of the name, then the name: a content-only order (the same in every
    // process) that rarely needs to compare the long shared prefixes of parameter names.
    let mut by_name: Vec<usize> = (0..distinct.len()).collect();
    by_name.sort_unstable_by(|&a, &b| {
        keyed[a].cmp(&keyed[b]).then_with(|| names[name_at[a].clone()].cmp(&names[name_at[b].clone()]))
    });
    let mut global = vec![0; distinct.len()];
    for (g, &d) in by_name.iter().enumerate() {
        global[d] = g;
    }
    let tensors: Vec<&'a TensorSpec> = by_name.iter().map(|&d| distinct[d]).collect();

    let layout: Vec<(usize, u64)> = tensors.iter().map(|s| (s.shape.len(), u64::from(s.elem_size))).collect();

    // Resolve every entry in input order (the order its memory was written in, so reading the
    // entries' vectors stays cache-friendly), then put the packed results in canonical order.
    let mut offers = Vec::with_capacity(tables.iter().map(|t| t.offers.len()).sum());
    let mut needs = Vec::with_capacity(tables.iter().map(|t| t.needs.len()).sum());
    // Sized from the boxes' lengths (what valid entries store), so that the pools never regrow.
    let values = |offsets: usize| 3 * offsets.min(MAX_DIMS);
    let mut offer_dims = Vec::with_capacity(
        tables.iter().flat_map(|t| &t.offers).map(|o| values(o.region.offset.len())).sum(),
    );
    let mut need_dims =
        Vec::with_capacity(tables.iter().flat_map(|t| &t.needs).map(|n| values(n.region.offset.len())).sum());
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
            // The entry's tensor description lives in whichever table described it first: ask
            // for it, then for its shape, as for the entry's own vectors.
            if let Some(ahead) = table.offers.get(i + 2 * PREFETCH_AHEAD) {
                if let Some(&d) = local_to_distinct[t].get(ahead.tensor as usize) {
                    prefetch(distinct[d]);
                }
            }
            if let Some(ahead) = table.offers.get(i + PREFETCH_AHEAD) {
                if let Some(&d) = local_to_distinct[t].get(ahead.tensor as usize) {
                    prefetch(distinct[d].shape.as_ptr());
                }
                prefetch(ahead.region.offset.as_ptr());
                prefetch(ahead.region.extent.as_ptr());
                if let Some(strides) = &ahead.strides {
                    prefetch(strides.as_ptr());
                }
            }
            let tensor = global(offer.tensor, "offer", i)?;
            let c = canon_offer(tensors[tensor], tensor, offer)
                .map_err(|e| e.context(format!("table {t} offer {i}")))?;
            let n = layout[tensor].0;
            offers.push(PackedOffer {
                tensor: tensor as u32,
                owner: c.owner,
                addr: c.addr,
                digest: c.digest,
                dims: offer_dims.len(),
            });
            push_values(&mut offer_dims, &c.lo[..n]);
            push_values(&mut offer_dims, &c.ext[..n]);
            push_values(&mut offer_dims, &c.strides[..n]);
        }
        for (i, need) in table.needs.iter().enumerate() {
            // The entry's tensor description lives in whichever table described it first: ask
            // for it, then for its shape, as for the entry's own vectors.
            if let Some(ahead) = table.needs.get(i + 2 * PREFETCH_AHEAD) {
                if let Some(&d) = local_to_distinct[t].get(ahead.tensor as usize) {
                    prefetch(distinct[d]);
                }
            }
            if let Some(ahead) = table.needs.get(i + PREFETCH_AHEAD) {
                if let Some(&d) = local_to_distinct[t].get(ahead.tensor as usize) {
                    prefetch(distinct[d].shape.as_ptr());
                }
                prefetch(ahead.region.offset.as_ptr());
                prefetch(ahead.region.extent.as_ptr());
                prefetch(ahead.strides.as_ptr());
                if let Some(perm) = &ahead.perm {
                    prefetch(perm.as_ptr());
                }
            }
            let tensor = global(need.tensor, "need", i)?;
            let c = canon_need(tensors[tensor], tensor, need)
                .map_err(|e| e.context(format!("table {t} need {i}")))?;
            let n = layout[tensor].0;
            needs.push(PackedNeed {
                receiver: c.receiver,
                tensor: tensor as u32,
                addr: c.addr,
                dims: need_dims.len(),
            });
            push_values(&mut need_dims, &c.lo[..n]);
            push_values(&mut need_dims, &c.ext[..n]);
            push_values(&mut need_dims, &c.strides[..n]);
        }
    }
    if offers.len() > u32::MAX as usize || needs.len() > u32::MAX as usize {
        bail!(Status::Unsupported, "more than 2^32 offers or needs");
    }
    // Canonical order without comparing whole entries across tables: bucket by tensor (and
    // receiver), then sort each small bucket fully: offers by (tensor, offset, extent, owner,
    // address, strides, digest), needs by (receiver, tensor, offset, extent, address, strides).
    let order = bucket_order((0..offers.len() as u32).collect(), tensors.len(), |i| {
        offers[i as usize].tensor as usize
    });
    // Gathered in bucket order with their values copied into a pool in the same order: later
    // stages walk entries in canonical order and read memory front to back (sorting inside a
    // bucket only permutes neighbours).
    let (offers, offer_dims) = gather(&offers, &offer_dims, &order, |o| layout[o.tensor as usize].0);
    let offers = sort_runs(
        offers,
        |a, b| a.tensor == b.tensor,
        |a, b| {
            let n = layout[a.tensor as usize].0;
            let (x, y) = (&offer_dims[a.dims..a.dims + 3 * n], &offer_dims[b.dims..b.dims + 3 * n]);
            x[..2 * n]
                .cmp(&y[..2 * n])
                .then(a.owner.cmp(&b.owner))
                .then(a.addr.cmp(&b.addr))
                .then_with(|| x[2 * n..].cmp(&y[2 * n..]))
                .then(a.digest.cmp(&b.digest))
        },
    );
    let receivers: BTreeMap<Endpoint, usize> =
        needs.iter().map(|n| (n.receiver, 0)).collect::<BTreeMap<_, _>>().into_keys().zip(0..).collect();
    let receiver_of: Vec<usize> = needs.iter().map(|n| receivers[&n.receiver]).collect();
    let order =
        bucket_order((0..needs.len() as u32).collect(), tensors.len(), |i| needs[i as usize].tensor as usize);
    let order = bucket_order(order, receivers.len(), |i| receiver_of[i as usize]);
    let (needs, need_dims) = gather(&needs, &need_dims, &order, |o| layout[o.tensor as usize].0);
    let needs = sort_runs(
        needs,
        |a, b| (a.receiver, a.tensor) == (b.receiver, b.tensor),
        |a, b| {
            let n = layout[a.tensor as usize].0;
            let (x, y) = (&need_dims[a.dims..a.dims + 3 * n], &need_dims[b.dims..b.dims + 3 * n]);
            x[..2 * n].cmp(&y[..2 * n]).then(a.addr.cmp(&b.addr)).then_with(|| x[2 * n..].cmp(&y[2 * n..]))
        },
    );
    let mut offer_start = vec![0; tensors.len() + 1];
    for offer in &offers {
        offer_start[offer.tensor as usize + 1] += 1;
    }
    for t in 0..tensors.len() {
        offer_start[t + 1] += offer_start[t];
    }
    Ok(Catalog { tensors, layout, offers, offer_start, needs, offer_dims, need_dims })
}

/// How many entries ahead the merge asks for the small heap blocks (names, shapes, boxes, strides)
/// of the caller's tables: far enough that the block arrives before it is read.
const PREFETCH_AHEAD: usize = 24;

/// Asks the processor to start loading the cache line at `p` (a hint: never faults, whatever `p` is).
#[inline(always)]
fn prefetch<T>(p: *const T) {
    // SAFETY: a prefetch reads nothing and cannot fault, whatever the address; SSE, which it
    // needs, is part of every x86_64 target.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast::<i8>())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Appends a few values one by one: `extend_from_slice` calls memcpy, which costs more than
/// copying a handful of values.
fn push_values(pool: &mut Vec<u64>, values: &[u64]) {
    for &v in values {
        pool.push(v);
    }
}

/// An entry whose `3 n` values live in a pool from `dims`.
trait Pooled: Copy {
    fn dims(&mut self) -> &mut usize;
}

impl Pooled for PackedOffer {
    fn dims(&mut self) -> &mut usize {
        &mut self.dims
    }
}

impl Pooled for PackedNeed {
    fn dims(&mut self) -> &mut usize {
        &mut self.dims
    }
}

/// `entries` taken in `order`, with their values (`3 n` each, `n` from `rank`) copied from `pool`
/// into a new pool in the same order.
fn gather<T: Pooled>(
    entries: &[T],
    pool: &[u64],
    order: &[u32],
    rank: impl Fn(&T) -> usize,
) -> (Vec<T>, Vec<u64>) {
    let mut out = Vec::with_capacity(order.len());
    let mut values = Vec::with_capacity(pool.len());
    for (k, &i) in order.iter().enumerate() {
        // `order` jumps between tables, so each entry and its values would be a cache miss waited
        // for in turn: on large plans the pool has left the cache by now (the callers' tables
        // streamed through it while it was written). Entries are asked for twice as far ahead as
        // their values, whose place is read from the entry.
        if let Some(&ahead) = order.get(k + 2 * PREFETCH_AHEAD) {
            prefetch(entries.as_ptr().wrapping_add(ahead as usize));
        }
        if let Some(&ahead) = order.get(k + PREFETCH_AHEAD) {
            let mut entry = entries[ahead as usize];
            let at = *entry.dims();
            // The values may straddle two cache lines: ask for the first and the last.
            prefetch(pool.as_ptr().wrapping_add(at));
            prefetch(pool.as_ptr().wrapping_add(at + (3 * rank(&entry)).saturating_sub(1)));
        }
        let mut entry = entries[i as usize];
        let at = *entry.dims();
        push_values(&mut values, &pool[at..at + 3 * rank(&entry)]);
        *entry.dims() = values.len() - 3 * rank(&entry);
        out.push(entry);
    }
    (out, values)
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

/// Sorts by `order` each maximal run of neighbours that `same` groups together.
fn sort_runs<T>(
    mut items: Vec<T>,
    same: impl Fn(&T, &T) -> bool,
    order: impl Fn(&T, &T) -> std::cmp::Ordering,
) -> Vec<T> {
    let mut start = 0;
    while start < items.len() {
        let mut end = start + 1;
        while end < items.len() && same(&items[start], &items[end]) {
            end += 1;
        }
        if end - start > 1 {
            items[start..end].sort_unstable_by(&order);
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
