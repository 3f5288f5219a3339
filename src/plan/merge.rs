//! Merging every process's table into one canonical form: tensors by name (ordered by a hash of the
//! name, then the name), offers and needs checked and resolved to tensor dimensions, and sorted by
//! canonical keys, so that the order in which tables or their entries arrive never changes the plan.
//!
//! Stages: [`index_tensors`] (distinct names, descriptions compared), [`canonical_tensors`] (their
//! order), [`resolve_entries`] (offers and needs checked and packed), [`sort_offers`] and
//! [`sort_needs`] (canonical order).

use super::boxes::{Boxed, Dims};
use super::digest::{fnv1a, Words};
use super::memory;
use super::table::{Endpoint, Table, TensorSpec, MAX_DIMS};
use crate::bail;
use crate::error::{Error, Result, Status};
use std::collections::BTreeMap;
use std::hash::BuildHasher;

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

/// An offer as the merged tables store it: the fixed fields, and where its box and strides start in
/// [`Merged::offer_dims`] (offset, extent and strides, `n` values each for a tensor of `n`
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

/// A need as the merged tables store it; its box and strides are in [`Merged::need_dims`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct PackedNeed {
    pub receiver: Endpoint,
    pub tensor: u32,
    pub addr: u64,
    dims: usize,
}

/// Every table merged: tensors sorted by (hash of the name, name), offers sorted by (tensor, box,
/// owner, ...), needs sorted by (receiver, tensor, box, ...).
pub(crate) struct Merged<'a> {
    pub tensors: Vec<&'a TensorSpec>,
    /// (dimensions, element size) of each tensor: a dense copy of what hot loops read, so they do
    /// not chase pointers into the callers' tables.
    pub geometry: Vec<(usize, u64)>,
    pub offers: Vec<PackedOffer>,
    /// `offers[offer_start[t]..offer_start[t + 1]]` are tensor `t`'s offers.
    pub offer_start: Vec<usize>,
    pub needs: Vec<PackedNeed>,
    offer_dims: Vec<u64>,
    need_dims: Vec<u64>,
    /// Digest of the tensor descriptions in canonical order (part of [`Merged::fingerprint`]).
    tensor_digest: u64,
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

impl Merged<'_> {
    /// Indices of tensor `tensor`'s offers.
    pub fn offer_range(&self, tensor: usize) -> std::ops::Range<usize> {
        self.offer_start[tensor]..self.offer_start[tensor + 1]
    }

    /// Offset, extent and strides of offer `i`, one value per dimension of its tensor.
    pub fn offer_parts(&self, i: usize) -> (&[u64], &[u64], &[u64]) {
        let p = &self.offers[i];
        let n = self.geometry[p.tensor as usize].0;
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
        let (lo, ext, strides) = expand(&self.need_dims, p.dims, self.geometry[tensor].0);
        CanonNeed { receiver: p.receiver, tensor, lo, ext, addr: p.addr, strides }
    }
}

impl Merged<'_> {
    /// A 64-bit digest (see [`Words`]) of everything planning reads, in
    /// canonical order: equal for the same tables in any order, with their entries in any order,
    /// in any process; different when any description, offer or need differs.
    pub fn fingerprint(&self) -> u64 {
        let mut h = Words::new();
        h.u64(self.tensor_digest);
        // Entry by entry in canonical order, each with its box and strides (the pools themselves
        // are in the order entries arrived: sorting moved only the entries).
        h.u64(self.offers.len() as u64);
        for o in &self.offers {
            for v in [o.tensor.into(), o.owner.process.into(), o.owner.device.into(), o.addr] {
                h.u64(v);
            }
            h.u64(o.digest.map_or(0, |_| 1));
            h.u64(o.digest.unwrap_or(0));
            let n = self.geometry[o.tensor as usize].0;
            self.offer_dims[o.dims..o.dims + 3 * n].iter().for_each(|&v| h.u64(v));
        }
        h.u64(self.needs.len() as u64);
        for n in &self.needs {
            for v in [n.tensor.into(), n.receiver.process.into(), n.receiver.device.into(), n.addr] {
                h.u64(v);
            }
            let dims = self.geometry[n.tensor as usize].0;
            self.need_dims[n.dims..n.dims + 3 * dims].iter().for_each(|&v| h.u64(v));
        }
        h.finish()
    }
}

/// Merges `tables` (see the module documentation for the stages).
pub(crate) fn merge<'a>(tables: &[&'a Table]) -> Result<Merged<'a>> {
    let index = index_tensors(tables)?;
    let Canonical { tensors, global, geometry, digest: tensor_digest } = canonical_tensors(&index)?;
    let local: Vec<Vec<usize>> =
        index.local_to_distinct.iter().map(|map| map.iter().map(|&d| global[d]).collect()).collect();
    let entries = resolve_entries(tables, &local, &tensors, &geometry)?;
    let (offers, offer_dims) = sort_offers(entries.offers, &entries.offer_dims, &geometry)?;
    let (needs, need_dims) = sort_needs(entries.needs, &entries.need_dims, &geometry)?;
    let mut offer_start = memory::filled(0, tensors.len() + 1, "tensors")?;
    for offer in &offers {
        offer_start[offer.tensor as usize + 1] += 1;
    }
    for t in 0..tensors.len() {
        offer_start[t + 1] += offer_start[t];
    }
    Ok(Merged { tensors, geometry, offers, offer_start, needs, offer_dims, need_dims, tensor_digest })
}

/// The distinct tensors of all tables, in the order first seen.
struct TensorIndex<'a> {
    distinct: Vec<&'a TensorSpec>,
    /// Hash of each distinct tensor's name.
    keyed: Vec<u64>,
    /// (dtype, element size, dimensions, shape) of each distinct tensor, kept dense: what later
    /// descriptions are compared with (reading the first description again would be a cache miss
    /// into another table per entry).
    described: Vec<(u32, u32, usize, Dims)>,
    /// The names of distinct tensors in one dense buffer, and where each one is.
    names: Vec<u8>,
    name_at: Vec<std::ops::Range<usize>>,
    /// For each table, the distinct index of each of its tensors.
    local_to_distinct: Vec<Vec<usize>>,
}

impl TensorIndex<'_> {
    fn name(&self, d: usize) -> &[u8] {
        &self.names[self.name_at[d].clone()]
    }
}

/// Finds the distinct tensors of all tables by name, checking every description of a name against
/// the first (TENSOR_MISMATCH) and each on its own (INVALID_ARGUMENT).
fn index_tensors<'a>(tables: &[&'a Table]) -> Result<TensorIndex<'a>> {
    let entries: usize = tables.iter().map(|t| t.tensors.len()).sum();
    // The name index below holds distinct indices as u32; there are no more of them than entries.
    if entries > u32::MAX as usize {
        bail!(Status::Unsupported, "more than 2^32 tensor descriptions in all tables");
    }
    let mut index = TensorIndex {
        distinct: Vec::new(),
        described: Vec::new(),
        keyed: Vec::new(),
        names: Vec::new(),
        name_at: Vec::new(),
        local_to_distinct: Vec::with_capacity(tables.len()),
    };
    let describe = |spec: &TensorSpec| {
        let mut shape = [0; MAX_DIMS];
        shape[..spec.shape.len()].copy_from_slice(&spec.shape);
        (spec.dtype, spec.elem_size, spec.shape.len(), shape)
    };
    // Open addressing with linear probing over distinct indices (`EMPTY` when free), at most half
    // full. Keys are compared through `keyed` and `names`. Slots are chosen by a hash keyed per
    // build: names chosen to collide in the ordering hash (FNV, which every process must share)
    // would otherwise make probing quadratic.
    const EMPTY: u32 = u32::MAX;
    let slot_hash = std::collections::hash_map::RandomState::new();
    let mut slots: Vec<u32> = memory::filled(EMPTY, (2 * entries).next_power_of_two(), "tensor names")?;
    let mask = slots.len() - 1;
    // Tables tend to list tensors in the same order: the guess for an entry is the distinct tensor
    // that followed the previous entry's tensor in the last table that listed it, tried before
    // hashing the name.
    let mut follows: Vec<usize> = Vec::new();
    let mut first_of_last_table = usize::MAX;
    for (t, table) in tables.iter().enumerate() {
        let mut map = memory::with_capacity(table.tensors.len(), "tensors")?;
        let mut previous = usize::MAX;
        for (j, spec) in table.tensors.iter().enumerate() {
            if let Some(ahead) = table.tensors.get(j + PREFETCH_AHEAD) {
                prefetch(ahead.name.as_ptr());
                prefetch(ahead.shape.as_ptr());
            }
            spec.validate().map_err(|e| e.context(format!("table {t}")))?;
            let name = spec.name.as_bytes();
            let guess = if previous == usize::MAX { first_of_last_table } else { follows[previous] };
            let known = (guess < index.distinct.len() && index.name(guess) == name).then_some(guess);
            let at = match known {
                Some(at) => at,
                None => {
                    let hash = fnv1a(name);
                    let mut slot = slot_hash.hash_one(name) as usize & mask;
                    loop {
                        let d = slots[slot];
                        if d == EMPTY {
                            let at = index.distinct.len();
                            slots[slot] = at as u32;
                            index.distinct.push(spec);
                            index.described.push(describe(spec));
                            index.names.extend_from_slice(name);
                            index.name_at.push(index.names.len() - name.len()..index.names.len());
                            index.keyed.push(hash);
                            follows.push(usize::MAX);
                            break at;
                        }
                        let d = d as usize;
                        if index.keyed[d] == hash && index.name(d) == name {
                            break d;
                        }
                        slot = (slot + 1) & mask;
                    }
                }
            };
            if index.described[at] != describe(spec) {
                index.distinct[at].check_same(spec)?;
            }
            map.push(at);
            if previous == usize::MAX {
                first_of_last_table = at;
            } else {
                follows[previous] = at;
            }
            previous = at;
        }
        index.local_to_distinct.push(map);
    }
    Ok(index)
}

/// The distinct tensors in canonical order.
struct Canonical<'a> {
    tensors: Vec<&'a TensorSpec>,
    /// For each distinct index (order first seen), its place in canonical order.
    global: Vec<usize>,
    /// (dimensions, element size) of each tensor, in canonical order.
    geometry: Vec<(usize, u64)>,
    /// Digest of the descriptions in canonical order.
    digest: u64,
}

/// The distinct tensors ordered by a hash of the name, then the name: a content-only order (the
/// same in every process) that rarely needs to compare the long shared prefixes of parameter
/// names. What it reads of each tensor comes from the index's dense copies, not the callers'
/// tables.
fn canonical_tensors<'a>(index: &TensorIndex<'a>) -> Result<Canonical<'a>> {
    let count = index.distinct.len();
    let mut by_name: Vec<usize> = memory::collect(count, 0..count, "tensors")?;
    by_name.sort_unstable_by(|&a, &b| {
        index.keyed[a].cmp(&index.keyed[b]).then_with(|| index.name(a).cmp(index.name(b)))
    });
    let mut global = memory::filled(0, count, "tensors")?;
    for (g, &d) in by_name.iter().enumerate() {
        global[d] = g;
    }
    let tensors = memory::collect(count, by_name.iter().map(|&d| index.distinct[d]), "tensors")?;
    let geometry = memory::collect(
        count,
        by_name.iter().map(|&d| (index.described[d].2, u64::from(index.described[d].1))),
        "tensors",
    )?;
    let mut digest = Words::new();
    digest.u64(count as u64);
    for &d in &by_name {
        let (dtype, elem_size, dims, shape) = &index.described[d];
        digest.bytes(index.name(d));
        for v in [u64::from(*dtype), u64::from(*elem_size), *dims as u64] {
            digest.u64(v);
        }
        shape[..*dims].iter().for_each(|&x| digest.u64(x));
    }
    Ok(Canonical { tensors, global, geometry, digest: digest.finish() })
}

/// Offers and needs of all tables, checked and packed in input order, with their values pooled.
struct Entries {
    offers: Vec<PackedOffer>,
    needs: Vec<PackedNeed>,
    offer_dims: Vec<u64>,
    need_dims: Vec<u64>,
}

/// Checks every offer and need against its tensor (`local[t][i]` is the canonical index of table
/// `t`'s tensor `i`) and packs it. Entries are read in input order (the order their memory was
/// written in, so reading the entries' vectors stays cache-friendly).
fn resolve_entries(
    tables: &[&Table],
    local: &[Vec<usize>],
    tensors: &[&TensorSpec],
    geometry: &[(usize, u64)],
) -> Result<Entries> {
    let total_offers: usize = tables.iter().map(|t| t.offers.len()).sum();
    let total_needs: usize = tables.iter().map(|t| t.needs.len()).sum();
    if total_offers > u32::MAX as usize || total_needs > u32::MAX as usize {
        bail!(Status::Unsupported, "more than 2^32 offers or needs");
    }
    // Sized from the boxes' lengths (what valid entries store), so that the pools never regrow.
    let values = |offsets: usize| 3 * offsets.min(MAX_DIMS);
    let offer_values = tables.iter().flat_map(|t| &t.offers).map(|o| values(o.region.offset.len())).sum();
    let need_values = tables.iter().flat_map(|t| &t.needs).map(|n| values(n.region.offset.len())).sum();
    let mut out = Entries {
        offers: memory::with_capacity(total_offers, "offers")?,
        needs: memory::with_capacity(total_needs, "needs")?,
        offer_dims: memory::with_capacity(offer_values, "offer dimensions")?,
        need_dims: memory::with_capacity(need_values, "need dimensions")?,
    };
    for (t, table) in tables.iter().enumerate() {
        let canonical = |i: u32, what: &str, entry: usize| -> Result<usize> {
            local[t].get(i as usize).copied().ok_or_else(|| {
                Error::invalid_argument(format!(
                    "table {t} {what} {entry} names tensor index {i} but the table has {} tensors",
                    table.tensors.len()
                ))
            })
        };
        for (i, offer) in table.offers.iter().enumerate() {
            // The entry's tensor description lives in whichever table described it first: ask
            // for it, then for its shape, as for the entry's own vectors.
            if let Some(ahead) = table.offers.get(i + 2 * PREFETCH_AHEAD) {
                if let Some(&g) = local[t].get(ahead.tensor as usize) {
                    prefetch(tensors[g]);
                }
            }
            if let Some(ahead) = table.offers.get(i + PREFETCH_AHEAD) {
                if let Some(&g) = local[t].get(ahead.tensor as usize) {
                    prefetch(tensors[g].shape.as_ptr());
                }
                prefetch(ahead.region.offset.as_ptr());
                prefetch(ahead.region.extent.as_ptr());
                if let Some(strides) = &ahead.strides {
                    prefetch(strides.as_ptr());
                }
            }
            let tensor = canonical(offer.tensor, "offer", i)?;
            let r = offer.resolve(tensors[tensor]).map_err(|e| e.context(format!("table {t} offer {i}")))?;
            let n = geometry[tensor].0;
            out.offers.push(PackedOffer {
                tensor: tensor as u32,
                owner: offer.owner,
                addr: offer.addr,
                digest: offer.digest,
                dims: out.offer_dims.len(),
            });
            push_values(&mut out.offer_dims, &r.lo[..n], "offer dimensions")?;
            push_values(&mut out.offer_dims, &r.ext[..n], "offer dimensions")?;
            push_values(&mut out.offer_dims, &r.strides[..n], "offer dimensions")?;
        }
        for (i, need) in table.needs.iter().enumerate() {
            if let Some(ahead) = table.needs.get(i + 2 * PREFETCH_AHEAD) {
                if let Some(&g) = local[t].get(ahead.tensor as usize) {
                    prefetch(tensors[g]);
                }
            }
            if let Some(ahead) = table.needs.get(i + PREFETCH_AHEAD) {
                if let Some(&g) = local[t].get(ahead.tensor as usize) {
                    prefetch(tensors[g].shape.as_ptr());
                }
                prefetch(ahead.region.offset.as_ptr());
                prefetch(ahead.region.extent.as_ptr());
                prefetch(ahead.strides.as_ptr());
                if let Some(perm) = &ahead.perm {
                    prefetch(perm.as_ptr());
                }
            }
            let tensor = canonical(need.tensor, "need", i)?;
            let r = need.resolve(tensors[tensor]).map_err(|e| e.context(format!("table {t} need {i}")))?;
            let n = geometry[tensor].0;
            out.needs.push(PackedNeed {
                receiver: need.receiver,
                tensor: tensor as u32,
                addr: need.addr,
                dims: out.need_dims.len(),
            });
            push_values(&mut out.need_dims, &r.lo[..n], "need dimensions")?;
            push_values(&mut out.need_dims, &r.ext[..n], "need dimensions")?;
            push_values(&mut out.need_dims, &r.strides[..n], "need dimensions")?;
        }
    }
    Ok(out)
}

/// Offers in canonical order: by tensor (a counting sort), then each tensor's offers fully by
/// (offset, extent, owner, address, strides, digest).
fn sort_offers(
    offers: Vec<PackedOffer>,
    pool: &[u64],
    geometry: &[(usize, u64)],
) -> Result<(Vec<PackedOffer>, Vec<u64>)> {
    let order = memory::collect(offers.len(), 0..offers.len() as u32, "offers")?;
    let order = bucket_order(order, geometry.len(), |i| offers[i as usize].tensor as usize)?;
    // Gathered in bucket order with their values copied into a pool in the same order: later
    // stages walk entries in canonical order and read memory front to back (sorting inside a
    // bucket only permutes neighbours).
    let (offers, pool) = gather(&offers, pool, &order, |o| geometry[o.tensor as usize].0)?;
    let offers = sort_runs(
        offers,
        |a, b| a.tensor == b.tensor,
        |a, b| {
            let n = geometry[a.tensor as usize].0;
            let (x, y) = (&pool[a.dims..a.dims + 3 * n], &pool[b.dims..b.dims + 3 * n]);
            x[..2 * n]
                .cmp(&y[..2 * n])
                .then(a.owner.cmp(&b.owner))
                .then(a.addr.cmp(&b.addr))
                .then_with(|| x[2 * n..].cmp(&y[2 * n..]))
                .then(a.digest.cmp(&b.digest))
        },
    );
    Ok((offers, pool))
}

/// Needs in canonical order: by receiver, then tensor (counting sorts), then fully by (offset,
/// extent, address, strides).
fn sort_needs(
    needs: Vec<PackedNeed>,
    pool: &[u64],
    geometry: &[(usize, u64)],
) -> Result<(Vec<PackedNeed>, Vec<u64>)> {
    let receivers: BTreeMap<Endpoint, usize> =
        needs.iter().map(|n| (n.receiver, 0)).collect::<BTreeMap<_, _>>().into_keys().zip(0..).collect();
    let receiver_of = memory::collect(needs.len(), needs.iter().map(|n| receivers[&n.receiver]), "needs")?;
    let order = memory::collect(needs.len(), 0..needs.len() as u32, "needs")?;
    let order = bucket_order(order, geometry.len(), |i| needs[i as usize].tensor as usize)?;
    let order = bucket_order(order, receivers.len(), |i| receiver_of[i as usize])?;
    let (needs, pool) = gather(&needs, pool, &order, |o| geometry[o.tensor as usize].0)?;
    let needs = sort_runs(
        needs,
        |a, b| (a.receiver, a.tensor) == (b.receiver, b.tensor),
        |a, b| {
            let n = geometry[a.tensor as usize].0;
            let (x, y) = (&pool[a.dims..a.dims + 3 * n], &pool[b.dims..b.dims + 3 * n]);
            x[..2 * n].cmp(&y[..2 * n]).then(a.addr.cmp(&b.addr)).then_with(|| x[2 * n..].cmp(&y[2 * n..]))
        },
    );
    Ok((needs, pool))
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
/// copying a handful of values. The pools are sized up front; this only grows them for entries
/// longer than their tensor, which fail validation before they are pushed.
#[inline]
fn push_values(pool: &mut Vec<u64>, values: &[u64], what: &str) -> Result<()> {
    if pool.capacity() - pool.len() < values.len() {
        memory::reserve(pool, values.len(), what)?;
    }
    for &v in values {
        pool.push(v);
    }
    Ok(())
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

/// `entries` taken in `order`, with their values (`3 n` each, `n` from `dims_of`) copied from
/// `pool` into a new pool in the same order.
fn gather<T: Pooled>(
    entries: &[T],
    pool: &[u64],
    order: &[u32],
    dims_of: impl Fn(&T) -> usize,
) -> Result<(Vec<T>, Vec<u64>)> {
    let mut out = memory::with_capacity(order.len(), "entries")?;
    let mut values = memory::with_capacity(pool.len(), "entry dimensions")?;
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
            prefetch(pool.as_ptr().wrapping_add(at + (3 * dims_of(&entry)).saturating_sub(1)));
        }
        let mut entry = entries[i as usize];
        let at = *entry.dims();
        let n = 3 * dims_of(&entry);
        for &v in &pool[at..at + n] {
            values.push(v);
        }
        *entry.dims() = values.len() - n;
        out.push(entry);
    }
    Ok((out, values))
}

/// `order` (indices) stably sorted by `key` (below `buckets`): a counting sort.
fn bucket_order(order: Vec<u32>, buckets: usize, key: impl Fn(u32) -> usize) -> Result<Vec<u32>> {
    let mut start = memory::filled(0usize, buckets + 1, "buckets")?;
    for &i in &order {
        start[key(i) + 1] += 1;
    }
    for b in 0..buckets {
        start[b + 1] += start[b];
    }
    let mut out = memory::filled(0u32, order.len(), "entries")?;
    for &i in &order {
        let k = key(i);
        out[start[k]] = i;
        start[k] += 1;
    }
    Ok(out)
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
