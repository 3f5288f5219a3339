//! Known contents for a refit run on host memory: every tensor element gets a value computed from
//! (tensor, element index), publishers' boxes are filled with it, and after the refit every receiver
//! box is compared with it. Works for any element size: the value's low bytes are written.

use crate::{Placed, Role, Workload};
use std::ops::Range;

/// The bytes of element `global` (row-major index in the whole tensor) of tensor `tensor`, as a
/// little-endian u64 of which the low `elem_size` bytes are used. splitmix64, so neighbouring
/// elements and tensors differ.
pub fn element_value(tensor: u32, global: u64) -> u64 {
    let mut z = ((u64::from(tensor) << 40) ^ global).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Elements per unit of work when filling or checking on several threads.
const ELEMENTS_PER_PIECE: u64 = 1 << 20;

/// Rows `rows` of box `placed`, starting `start` bytes into its buffer: a unit of work.
struct Piece<'a> {
    placed: &'a Placed,
    rows: Range<u64>,
    start: u64,
}

impl<S: Sync> Workload<S> {
    /// Calls `f(byte offset in the box's buffer, global element index in the tensor)` for every element
    /// of a placed box, in memory order.
    pub fn for_each_element(&self, p: &Placed, f: impl FnMut(u64, u64)) {
        self.for_each_element_of_rows(p, 0..self.rows_of(p), f)
    }

    /// Rows of a placed box: the product of its extent but the last (0 for an empty box).
    fn rows_of(&self, p: &Placed) -> u64 {
        let extent = &p.region.extent;
        match extent.split_last() {
            Some((&inner, outer)) if inner > 0 => outer.iter().product(),
            _ => 0,
        }
    }

    /// As [`Workload::for_each_element`], for the rows `rows` only (a box is dense in its buffer,
    /// row after row).
    fn for_each_element_of_rows(&self, p: &Placed, rows: Range<u64>, mut f: impl FnMut(u64, u64)) {
        let spec = &self.catalog.tensors[p.tensor as usize];
        let es = u64::from(spec.elem_size);
        let extent = &p.region.extent;
        let n = extent.len();
        if n == 0 || extent.contains(&0) || rows.is_empty() {
            return;
        }
        let inner = extent[n - 1];
        // The coordinates of the first row, most significant dimension first.
        let mut coord = vec![0u64; n - 1];
        let mut rest = rows.start;
        for d in (0..n - 1).rev() {
            coord[d] = rest % extent[d];
            rest /= extent[d];
        }
        let mut at = p.offset + rows.start * inner * es;
        for _ in rows {
            // Global index of the row's first element.
            let row_start = (0..n - 1).fold(0, |acc, d| acc * spec.shape[d] + p.region.offset[d] + coord[d]);
            let first = row_start * spec.shape[n - 1] + p.region.offset[n - 1];
            for k in 0..inner {
                f(at, first + k);
                at += es;
            }
            for d in (0..n - 1).rev() {
                coord[d] += 1;
                if coord[d] < extent[d] {
                    break;
                }
                coord[d] = 0;
            }
        }
    }

    /// `boxes` cut into pieces of about [`ELEMENTS_PER_PIECE`] elements, in order.
    fn pieces<'a>(&self, boxes: &'a [Placed]) -> Vec<Piece<'a>> {
        let mut pieces = Vec::new();
        for placed in boxes {
            let rows = self.rows_of(placed);
            let inner = placed.region.extent.last().copied().unwrap_or(0).max(1);
            let es = u64::from(self.catalog.tensors[placed.tensor as usize].elem_size);
            let step = (ELEMENTS_PER_PIECE / inner).max(1);
            for first in (0..rows).step_by(step as usize) {
                let rows = first..(first + step).min(rows);
                pieces.push(Piece { placed, start: placed.offset + first * inner * es, rows });
            }
        }
        pieces
    }

    /// Writes every offered box into the publishers' host memory (`memory[i]` is buffer `i`; receiver
    /// buffers are not touched and may be empty), on every core. Panics if a slice is shorter than
    /// its buffer, or if two offers of one buffer overlap.
    pub fn fill_offers(&self, memory: &mut [&mut [u8]]) {
        let mut pieces = self.pieces(&self.offers);
        pieces.sort_by_key(|p| (p.placed.buffer, p.start));
        // Each piece gets the bytes it writes, carved from its buffer, so that threads share nothing.
        let mut work: Vec<(&Piece, &mut [u8])> = Vec::with_capacity(pieces.len());
        let mut buffers: Vec<Option<&mut [u8]>> = memory.iter_mut().map(|m| Some(&mut **m)).collect();
        let mut carved_to = vec![0u64; buffers.len()];
        for piece in &pieces {
            let b = piece.placed.buffer as usize;
            let es = u64::from(self.catalog.tensors[piece.placed.tensor as usize].elem_size);
            let inner = piece.placed.region.extent.last().copied().unwrap_or(0);
            let len = (piece.rows.end - piece.rows.start) * inner * es;
            let rest = buffers[b].take().expect("a buffer");
            let (_, rest) = rest.split_at_mut((piece.start - carved_to[b]) as usize);
            let (mine, rest) = rest.split_at_mut(len as usize);
            buffers[b] = Some(rest);
            carved_to[b] = piece.start + len;
            work.push((piece, mine));
        }
        in_parallel(work, |(piece, bytes)| {
            let es = self.catalog.tensors[piece.placed.tensor as usize].elem_size as usize;
            self.for_each_element_of_rows(piece.placed, piece.rows.clone(), |at, g| {
                let at = (at - piece.start) as usize;
                bytes[at..at + es]
                    .copy_from_slice(&element_value(piece.placed.tensor, g).to_le_bytes()[..es]);
            });
        });
    }

    /// Checks every needed box in the receivers' host memory (`memory[i]` is buffer `i`; publisher
    /// buffers may be empty), on every core. Returns the elements checked, or the first wrong element
    /// (in the order of the needs) named by buffer, tensor and index.
    pub fn check_needs(&self, memory: &[&[u8]]) -> Result<u64, String> {
        let pieces = self.pieces(&self.needs);
        let found: Vec<Option<(usize, u64, u64)>> = in_parallel_map(&pieces, |index, piece| {
            let n = piece.placed;
            let es = self.catalog.tensors[n.tensor as usize].elem_size as usize;
            let buffer = &memory[n.buffer as usize];
            let mut wrong = None;
            self.for_each_element_of_rows(n, piece.rows.clone(), |at, g| {
                let at = at as usize;
                if wrong.is_none() && buffer[at..at + es] != element_value(n.tensor, g).to_le_bytes()[..es] {
                    wrong = Some((index, at as u64, g));
                }
            });
            wrong
        });
        if let Some((index, at, g)) = found.into_iter().flatten().min() {
            let n = pieces[index].placed;
            let spec = &self.catalog.tensors[n.tensor as usize];
            let b = &self.buffers[n.buffer as usize];
            debug_assert_eq!(b.role, Role::Receiver);
            let at = at as usize;
            let bytes = &memory[n.buffer as usize][at..at + spec.elem_size as usize];
            return Err(format!(
                "{} byte {at}: element {g} of {} is wrong ({bytes:02x?})",
                b.name, spec.name
            ));
        }
        Ok(self.needs.iter().map(|n| n.region.extent.iter().product::<u64>()).sum())
    }
}

/// Threads for the fill and the check: every core.
fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Runs `f` on every item, the items dealt out to every core in turn.
fn in_parallel<T: Send>(items: Vec<T>, f: impl Fn(T) + Sync) {
    let n = threads();
    let mut shares: Vec<Vec<T>> = (0..n).map(|_| Vec::new()).collect();
    for (i, item) in items.into_iter().enumerate() {
        shares[i % n].push(item);
    }
    std::thread::scope(|scope| {
        for share in shares {
            let f = &f;
            scope.spawn(move || share.into_iter().for_each(f));
        }
    });
}

/// `f(index, item)` of every item, computed on every core, in the items' order.
fn in_parallel_map<T: Sync, R: Send>(items: &[T], f: impl Fn(usize, &T) -> R + Sync) -> Vec<R> {
    let n = threads();
    let mut results: Vec<Option<R>> = (0..items.len()).map(|_| None).collect();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .map(|t| {
                let f = &f;
                scope.spawn(move || {
                    (t..items.len()).step_by(n).map(|i| (i, f(i, &items[i]))).collect::<Vec<_>>()
                })
            })
            .collect();
        for handle in handles {
            for (i, r) in handle.join().expect("a check thread") {
                results[i] = Some(r);
            }
        }
    });
    results.into_iter().map(|r| r.expect("every item computed")).collect()
}
