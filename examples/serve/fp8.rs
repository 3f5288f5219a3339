//! The demo's `--serve fp8`: the receivers take their 2-D weights as FP8, quantized from the bf16
//! publishers on the way (quantized needs: e4m3fn codes with one fp32 scale per 128 x 128 block, as
//! DeepSeek-V3 and Qwen3's FP8 checkpoints hold them), and the demo checks every code and scale
//! against the Rust reference quantizer.
//!
//! Publishers hold finite bf16 values here ([`finite_bf16`]): element_value's raw bit patterns put a
//! NaN in nearly every 128 x 128 block, and a NaN makes its whole block's codes 0x7f, so a check over
//! them would compare little more than NaN propagation.
//!
//! Codes and scales land in arenas the demo allocates on each receiving device, apart from the
//! workload's bf16 receiver buffers, which then receive only the needs that stay bf16 (the 1-D
//! norms): those whose needs are all quantized are not allocated. Phase 2's staged executor holds
//! codes and scales twice more (staging, and the verify's scratch), so its step runs in parts
//! ([`Layout::parts`]).

use super::{parallel_with, with_progress, Memory};
use refit::plan::{QuantNeed, Table};
use refit::quant::reference::{quantize, SourceMatrix};
use refit::quant::{Fp8, Granularity, Quantization, SourceType};
use refit_workloads::{element_value, Placed, Workload};
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

/// Rows and columns of a quantization block (DeepSeek-V3's weight blocks).
const BLOCK: u64 = 128;

/// Every arena region starts on this many bytes: the quantizing kernel writes codes 8 at a time and
/// staging rows must start on 16 bytes; 16 keeps every row of every need aligned.
const ALIGN: u64 = 16;

/// Scales are fp32.
const SCALE_BYTES: u64 = 4;

/// Source elements the reference quantizes per unit of work: whole block rows, about this many (on a
/// GPU each unit is one read of its codes; a worker holds about 4 bytes per element).
const UNIT_ELEMENTS: u64 = 1 << 22;

/// The quantization every quantized need of the demo asks for.
pub fn quantization() -> Quantization {
    Quantization::new(Fp8::E4m3fn, Granularity::Block { rows: BLOCK as u32, cols: BLOCK as u32 })
}

/// Element `global` of `tensor` as a finite bf16: element_value's sign and mantissa bits with an
/// exponent field of 118..=133, so magnitudes from 2^-9 to just under 2^7. Within one block that spans
/// 16 binades: the scale comes from the largest, and the smallest quotients fall into e4m3fn's
/// subnormals and round, so the codes exercise the whole range of the format.
pub fn finite_bf16(tensor: u32, global: u64) -> u16 {
    let raw = element_value(tensor, global) as u16;
    let exponent = 118 + ((raw >> 7) & 0xff) % 16;
    (raw & 0x807f) | (exponent << 7)
}

/// Where one quantized need's codes, scales and (when planning asks for it) staging lie.
#[derive(Clone, Debug)]
pub struct Placement {
    /// The need's index in the workload's needs.
    pub need: usize,
    pub device: u32,
    /// The box as matrices: the leading dimensions number them, the last two are rows and columns.
    pub matrices: u64,
    pub rows: u64,
    pub cols: u64,
    /// Bytes from one code row to the next (the columns rounded up to ALIGN).
    pub pitch: u64,
    /// Byte offset of the codes in the device's code arena, of the scale grids in its scale arena.
    pub codes: u64,
    pub scales: u64,
    /// Scale grid of one matrix: block rows x block columns.
    pub grid: (u64, u64),
    /// Byte offset of the bf16 staging in the device's staging arena.
    pub staging: Option<u64>,
}

impl Placement {
    fn code_bytes(&self) -> u64 {
        self.matrices * self.rows * self.pitch
    }

    fn scale_bytes(&self) -> u64 {
        self.matrices * self.grid.0 * self.grid.1 * SCALE_BYTES
    }

    fn staging_bytes(&self) -> u64 {
        self.matrices * self.rows * self.cols * 2
    }

    /// Bytes of the quantization staging a staged executor packs this need's codes and scales into
    /// (src/exec/quantize.rs, `packed`: one job per matrix, code rows and each scale grid on 16
    /// bytes); a verified one packs as much again to quantize a second time and compare.
    pub fn packed_bytes(&self) -> u64 {
        self.matrices
            * (self.rows * self.pitch + (self.grid.0 * self.grid.1 * SCALE_BYTES).next_multiple_of(ALIGN))
    }
}

/// Part of phase 2's step: a staged executor holds quantization staging (and a verify's scratch)
/// for all of its quantized needs at once, beside `--staging-limit`, so the step runs in parts small
/// enough to fit.
#[derive(Clone, Debug)]
pub struct Part {
    /// Indices into the layout's placements.
    pub placements: Range<usize>,
    /// Whether the part also takes the plain (bf16) needs.
    pub plain: bool,
}

/// What each arena of a device holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Codes,
    Scales,
    Staging,
}

/// The quantized needs of a workload and the arenas they lie in.
pub struct Layout {
    pub placements: Vec<Placement>,
    /// By need index: whether the need is quantized.
    pub quantized: Vec<bool>,
    /// Bytes of each device's arenas.
    pub sizes: BTreeMap<(u32, Kind), u64>,
    /// Addresses of the allocated arenas.
    pub bases: BTreeMap<(u32, Kind), u64>,
}

impl Layout {
    /// Makes a quantized need of every bf16 need whose tensor has at least 2 dimensions and whose box
    /// rows are a multiple of 8 elements (the staging path needs rows of whole 16 bytes, and the
    /// quantizing kernel works 8 columns at a time), and places its codes and scales.
    pub fn new<S>(w: &Workload<S>) -> Result<Layout, String> {
        let mut layout = Layout {
            placements: Vec::new(),
            quantized: vec![false; w.needs.len()],
            sizes: BTreeMap::new(),
            bases: BTreeMap::new(),
        };
        for (i, n) in w.needs.iter().enumerate() {
            let tensor = &w.catalog.tensors[n.tensor as usize];
            let ext = &n.region.extent;
            let d = ext.len();
            if tensor.shape.len() < 2 || d < 2 || tensor.elem_size != 2 || ext[d - 1] % 8 != 0 {
                continue;
            }
            if ext.contains(&0) {
                continue;
            }
            if n.endpoint.process != 0 {
                return Err(format!("{}: --serve fp8 runs in one process", tensor.name));
            }
            let (rows, cols) = (ext[d - 2], ext[d - 1]);
            let device = n.endpoint.device;
            let mut p = Placement {
                need: i,
                device,
                matrices: ext[..d - 2].iter().product(),
                rows,
                cols,
                pitch: cols.next_multiple_of(ALIGN),
                codes: 0,
                scales: 0,
                grid: quantization().scale_grid(rows, cols),
                staging: None,
            };
            p.codes = layout.take(device, Kind::Codes, p.code_bytes());
            p.scales = layout.take(device, Kind::Scales, p.scale_bytes());
            layout.quantized[i] = true;
            layout.placements.push(p);
        }
        Ok(layout)
    }

    /// Reserves `bytes` at the end of a device's arena; returns their offset.
    fn take(&mut self, device: u32, kind: Kind, bytes: u64) -> u64 {
        let size = self.sizes.entry((device, kind)).or_insert(0);
        let at = *size;
        *size = (at + bytes).next_multiple_of(ALIGN);
        at
    }

    /// Gives every quantized need a bf16 staging buffer, row-major, on its device. The planner keeps
    /// the direct path wherever one exists, so only the needs without one use theirs.
    pub fn add_staging(&mut self) {
        for i in 0..self.placements.len() {
            let (device, bytes) = (self.placements[i].device, self.placements[i].staging_bytes());
            self.placements[i].staging = Some(self.take(device, Kind::Staging, bytes));
        }
    }

    /// Arenas of `kinds` by device: `(device, kind, bytes)`.
    pub fn arenas(&self, kinds: &[Kind]) -> Vec<(u32, Kind, u64)> {
        self.sizes
            .iter()
            .filter(|((_, kind), bytes)| kinds.contains(kind) && **bytes > 0)
            .map(|(&(device, kind), &bytes)| (device, kind, bytes))
            .collect()
    }

    fn base(&self, device: u32, kind: Kind) -> Result<u64, String> {
        self.bases
            .get(&(device, kind))
            .copied()
            .ok_or(format!("no {kind:?} arena allocated on device {device}"))
    }

    /// Source elements of the quantized needs.
    pub fn elements(&self) -> u64 {
        self.placements.iter().map(|p| p.matrices * p.rows * p.cols).sum()
    }

    /// Cuts the quantized needs into parts whose staged, verified executor allocates at most `limit`
    /// bytes of staging on each device (0: one part), counting `plain` (bytes of the plain needs'
    /// staging by device) in the first part, which takes the plain needs. A need larger than the limit
    /// is a part of its own.
    pub fn parts(&self, limit: u64, plain: &BTreeMap<u32, u64>) -> Vec<Part> {
        let mut parts = vec![Part { placements: 0..0, plain: true }];
        let mut used = plain.clone();
        for (k, p) in self.placements.iter().enumerate() {
            let bytes = 2 * p.packed_bytes();
            let on_device = used.get(&p.device).copied().unwrap_or(0);
            let last = parts.last_mut().expect("one part at least");
            if limit != 0 && !last.placements.is_empty() && on_device + bytes > limit {
                parts.push(Part { placements: k..k, plain: false });
                used.clear();
            }
            *used.entry(p.device).or_default() += bytes;
            parts.last_mut().expect("one part at least").placements.end = k + 1;
        }
        parts
    }

    /// Staging a part's staged, verified executor allocates on each device for its quantized needs.
    pub fn part_staging(&self, part: &Part) -> BTreeMap<u32, u64> {
        let mut out = BTreeMap::new();
        for p in &self.placements[part.placements.clone()] {
            *out.entry(p.device).or_default() += 2 * p.packed_bytes();
        }
        out
    }

    /// Bytes of a part's codes and scales.
    pub fn part_bytes(&self, part: &Part) -> u64 {
        self.placements[part.placements.clone()].iter().map(|p| p.code_bytes() + p.scale_bytes()).sum()
    }

    /// The live codes and scales of a part, `(device, address, bytes)`: on each device the part's
    /// placements lie one after another in each arena (placed in order).
    pub fn part_regions(&self, part: &Part) -> Result<Vec<(u32, u64, u64)>, String> {
        let mut spans: BTreeMap<(u32, Kind), (u64, u64)> = BTreeMap::new();
        for p in &self.placements[part.placements.clone()] {
            for (kind, at, bytes) in
                [(Kind::Codes, p.codes, p.code_bytes()), (Kind::Scales, p.scales, p.scale_bytes())]
            {
                let span = spans.entry((p.device, kind)).or_insert((at, at + bytes));
                *span = (span.0.min(at), span.1.max(at + bytes));
            }
        }
        spans
            .into_iter()
            .map(|((device, kind), (start, end))| Ok((device, self.base(device, kind)? + start, end - start)))
            .collect()
    }

    /// Moves the quantized needs of `tables` (as `w.tables` made them, one table per process rank
    /// in ascending order) into each table's `quant_needs`, pointed at the arenas. With `part`, only
    /// its quantized needs stay (and the plain ones only when it takes them).
    pub fn quantize_tables<S>(
        &self,
        w: &Workload<S>,
        tables: &mut [Table],
        part: Option<&Part>,
    ) -> Result<(), String> {
        // w.tables puts each rank's needs in the workload's order: map them back by rank.
        let ranks: BTreeSet<u32> = w.offers.iter().chain(&w.needs).map(|p| p.endpoint.process).collect();
        if ranks.len() != tables.len() {
            return Err(format!("{} tables for {} process ranks", tables.len(), ranks.len()));
        }
        let by_need: BTreeMap<usize, (usize, &Placement)> =
            self.placements.iter().enumerate().map(|(k, p)| (p.need, (k, p))).collect();
        let keep_plain = part.is_none_or(|part| part.plain);
        let keep = |k: usize| part.is_none_or(|part| part.placements.contains(&k));
        for (rank, table) in ranks.into_iter().zip(tables.iter_mut()) {
            let needs: Vec<usize> =
                (0..w.needs.len()).filter(|&i| w.needs[i].endpoint.process == rank).collect();
            if needs.len() != table.needs.len() {
                return Err(format!(
                    "rank {rank}: {} needs in its table, {} in the workload",
                    table.needs.len(),
                    needs.len()
                ));
            }
            let mut plain = Vec::with_capacity(table.needs.len());
            for (need, i) in std::mem::take(&mut table.needs).into_iter().zip(needs) {
                let Some(&(k, p)) = by_need.get(&i) else {
                    if keep_plain {
                        plain.push(need);
                    }
                    continue;
                };
                if !keep(k) {
                    continue;
                }
                if need.region != w.needs[i].region {
                    return Err(format!("rank {rank}: the table's needs are not in the workload's order"));
                }
                let n = need.region.extent.len();
                // Code strides in bytes: rows `pitch` apart, matrices one after another.
                let mut strides = vec![1; n];
                strides[n - 2] = p.pitch;
                if n > 2 {
                    strides[n - 3] = p.rows * p.pitch;
                }
                for d in (0..n.saturating_sub(3)).rev() {
                    strides[d] = strides[d + 1] * need.region.extent[d + 1];
                }
                let staging = match p.staging {
                    Some(at) => self.base(p.device, Kind::Staging)? + at,
                    None => 0,
                };
                table.quant_needs.push(QuantNeed {
                    tensor: need.tensor,
                    receiver: need.receiver,
                    addr: self.base(p.device, Kind::Codes)? + p.codes,
                    region: need.region,
                    strides,
                    quantization: quantization(),
                    source: SourceType::Bf16,
                    scales: self.base(p.device, Kind::Scales)? + p.scales,
                    scale_row_stride: p.grid.1,
                    scale_matrix_stride: p.grid.0 * p.grid.1,
                    staging,
                });
            }
            table.needs = plain;
        }
        Ok(())
    }

    /// Checks every code and every scale of every quantized need against the reference quantizer
    /// over the need's box of finite values, on every core; returns the codes and scales checked.
    pub fn check<S: Sync>(&self, w: &Workload<S>, memory: &Memory) -> Result<(u64, u64), String> {
        // Units of whole block rows of one matrix: blocks never straddle two units, so the reference
        // over a unit gives the codes and scales it gives over the whole matrix. Each unit reads its
        // own codes and scales (from the device on a GPU), so reads and checks run side by side.
        let mut units = Vec::new();
        for (k, p) in self.placements.iter().enumerate() {
            let per = (UNIT_ELEMENTS / (BLOCK * p.cols)).max(1);
            for m in 0..p.matrices {
                let mut i = 0;
                while i < p.grid.0 {
                    units.push(Unit {
                        placement: k,
                        matrix: m,
                        block_row: i,
                        block_rows: per.min(p.grid.0 - i),
                    });
                    i += per;
                }
            }
        }
        let mut bases = BTreeMap::new();
        for p in &self.placements {
            if let std::collections::btree_map::Entry::Vacant(e) = bases.entry(p.device) {
                e.insert((self.base(p.device, Kind::Codes)?, self.base(p.device, Kind::Scales)?));
            }
        }
        let (codes, scales) = (AtomicU64::new(0), AtomicU64::new(0));
        with_progress("checking every FP8 code and scale against the reference", self.elements(), |done| {
            parallel_with(units.len(), Scratch::default, |scratch, u| {
                let unit = units[u];
                let p = &self.placements[unit.placement];
                let arenas = *bases.get(&p.device).ok_or(format!("no arenas on device {}", p.device))?;
                let (n_codes, n_scales) = self.check_unit(w, memory, arenas, unit, scratch)?;
                codes.fetch_add(n_codes, Ordering::Relaxed);
                scales.fetch_add(n_scales, Ordering::Relaxed);
                done.fetch_add(n_codes, Ordering::Relaxed);
                Ok(())
            })?;
            Ok((codes.load(Ordering::Relaxed), scales.load(Ordering::Relaxed)))
        })
    }

    /// Checks one unit's codes and scales against the reference; returns the codes and scales checked.
    fn check_unit<S>(
        &self,
        w: &Workload<S>,
        memory: &Memory,
        (code_base, scale_base): (u64, u64),
        unit: Unit,
        scratch: &mut Scratch,
    ) -> Result<(u64, u64), String> {
        let p = &self.placements[unit.placement];
        let (m, i, count) = (unit.matrix, unit.block_row, unit.block_rows);
        let need = &w.needs[p.need];
        let name = &w.catalog.tensors[need.tensor as usize].name;
        let row0 = i * BLOCK;
        let rows = (count * BLOCK).min(p.rows - row0);
        // The unit's codes (its rows, `pitch` apart) and its scales, both contiguous in the arenas.
        let code_at = code_base + p.codes + (m * p.rows + row0) * p.pitch;
        let code_len = (rows * p.pitch) as usize;
        let scale_at = scale_base + p.scales + (m * p.grid.0 + i) * p.grid.1 * SCALE_BYTES;
        let scale_len = (count * p.grid.1 * SCALE_BYTES) as usize;
        let (got_codes, got_scales): (&[u8], &[u8]) = if memory.on_gpu {
            scratch.got_codes.resize(code_len, 0);
            scratch.got_scales.resize(scale_len, 0);
            // SAFETY: both ranges lie inside the arenas allocated on this device with these sizes.
            unsafe {
                memory
                    .backend
                    .read(p.device as i32, code_at, &mut scratch.got_codes)
                    .map_err(|e| e.to_string())?;
                memory
                    .backend
                    .read(p.device as i32, scale_at, &mut scratch.got_scales)
                    .map_err(|e| e.to_string())?;
            }
            (&scratch.got_codes, &scratch.got_scales)
        } else {
            // SAFETY: on the host backend the arenas are host memory, allocated with these sizes; the
            // executors that write them are done (their calls return complete), so nothing writes
            // while they are read.
            unsafe {
                (
                    std::slice::from_raw_parts(code_at as usize as *const u8, code_len),
                    std::slice::from_raw_parts(scale_at as usize as *const u8, scale_len),
                )
            }
        };
        let source = &mut scratch.source;
        source.clear();
        source.reserve((rows * p.cols * 2) as usize);
        for r in 0..rows {
            let global = global_index(w, need, m, row0 + r);
            source.extend((0..p.cols).flat_map(|c| finite_bf16(need.tensor, global + c).to_le_bytes()));
        }
        let matrix =
            SourceMatrix { bytes: source, source: SourceType::Bf16, rows, cols: p.cols, stride: p.cols };
        scratch.want_codes.resize((rows * p.cols) as usize, 0);
        scratch.want_scales.resize(scale_len, 0);
        let (want_codes, want_scales) = (&mut scratch.want_codes, &mut scratch.want_scales);
        quantize(quantization(), &matrix, want_codes, p.cols, want_scales, p.grid.1);
        let cols = p.cols as usize;
        for r in 0..rows as usize {
            let got = &got_codes[r * p.pitch as usize..][..cols];
            let want = &want_codes[r * cols..][..cols];
            if got != want {
                let c = (0..cols).find(|&c| got[c] != want[c]).unwrap_or(0);
                let global = global_index(w, need, m, row0 + r as u64) + c as u64;
                return Err(format!(
                    "device {}: the FP8 code of element {global} of {name} is {:#04x}; the reference gives {:#04x}",
                    p.device, got[c], want[c]
                ));
            }
        }
        if got_scales != &want_scales[..] {
            let b = (0..scale_len).find(|&b| got_scales[b] != want_scales[b]).unwrap_or(0);
            let s = b as u64 / SCALE_BYTES;
            let scale = |bytes: &[u8]| {
                f32::from_le_bytes(bytes[(s * 4) as usize..][..4].try_into().unwrap_or([0; 4]))
            };
            return Err(format!(
                "device {}: the scale of block ({}, {}) of matrix {m} of {name}'s received box is {:e}; the reference gives {:e}",
                p.device,
                i + s / p.grid.1,
                s % p.grid.1,
                scale(got_scales),
                scale(want_scales)
            ));
        }
        Ok((rows * p.cols, count * p.grid.1))
    }
}

/// Whole block rows of one matrix of one quantized need: what one worker checks at a time.
#[derive(Clone, Copy)]
struct Unit {
    placement: usize,
    matrix: u64,
    block_row: u64,
    block_rows: u64,
}

/// A worker's buffers, reused from unit to unit.
#[derive(Default)]
struct Scratch {
    source: Vec<u8>,
    want_codes: Vec<u8>,
    want_scales: Vec<u8>,
    got_codes: Vec<u8>,
    got_scales: Vec<u8>,
}

/// The tensor's flat index of the first element of row `row` of matrix `m` of a need's box.
fn global_index<S>(w: &Workload<S>, need: &Placed, m: u64, row: u64) -> u64 {
    let shape = &w.catalog.tensors[need.tensor as usize].shape;
    let (offset, extent) = (&need.region.offset, &need.region.extent);
    let n = extent.len();
    let mut coord = vec![0u64; n];
    coord[n - 2] = row;
    let mut rest = m;
    for d in (0..n - 2).rev() {
        coord[d] = rest % extent[d];
        rest /= extent[d];
    }
    (0..n).fold(0, |acc, d| acc * shape[d] + offset[d] + coord[d])
}
