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
//! workload's bf16 receiver buffers (which then receive only the needs that stay bf16: the 1-D
//! norms).

use super::{parallel, with_progress, Memory};
use refit::plan::{QuantNeed, Table};
use refit::quant::reference::{quantize, SourceMatrix};
use refit::quant::{Fp8, Granularity, Quantization, SourceType};
use refit_workloads::{element_value, Placed, Workload};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};

/// Rows and columns of a quantization block (DeepSeek-V3's weight blocks).
const BLOCK: u64 = 128;

/// Every arena region starts on this many bytes: the quantizing kernel writes codes 8 at a time and
/// staging rows must start on 16 bytes; 16 keeps every row of every need aligned.
const ALIGN: u64 = 16;

/// Scales are fp32.
const SCALE_BYTES: u64 = 4;

/// Host images of codes read from a GPU at one time, at most (one larger need is read alone).
const BATCH_BYTES: u64 = 1 << 30;

/// Source elements the reference quantizes per unit of work: whole block rows, about this many.
const UNIT_ELEMENTS: u64 = 1 << 20;

/// The quantization every quantized need of the demo asks for.
pub fn quantization() -> Quantization {
    Quantization {
        target: Fp8::E4m3fn,
        granularity: Granularity::Block { rows: BLOCK as u32, cols: BLOCK as u32 },
    }
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

    /// Moves the quantized needs of `tables` (as `w.tables` made them, one table per process rank
    /// in ascending order) into each table's `quant_needs`, pointed at the arenas.
    pub fn quantize_tables<S>(&self, w: &Workload<S>, tables: &mut [Table]) -> Result<(), String> {
        // w.tables puts each rank's needs in the workload's order: map them back by rank.
        let ranks: BTreeSet<u32> = w.offers.iter().chain(&w.needs).map(|p| p.endpoint.process).collect();
        if ranks.len() != tables.len() {
            return Err(format!("{} tables for {} process ranks", tables.len(), ranks.len()));
        }
        let by_need: BTreeMap<usize, &Placement> = self.placements.iter().map(|p| (p.need, p)).collect();
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
                let Some(p) = by_need.get(&i) else {
                    plain.push(need);
                    continue;
                };
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
    /// over the need's box of finite values; returns the codes and scales checked.
    pub fn check<S: Sync>(&self, w: &Workload<S>, memory: &Memory) -> Result<(u64, u64), String> {
        let total = self.elements();
        let (codes, scales) = (AtomicU64::new(0), AtomicU64::new(0));
        with_progress("checking every FP8 code and scale against the reference", total, |done| {
            let mut devices: BTreeMap<u32, Vec<&Placement>> = BTreeMap::new();
            for p in &self.placements {
                devices.entry(p.device).or_default().push(p);
            }
            for (device, placements) in devices {
                let (code_base, scale_base) =
                    (self.base(device, Kind::Codes)?, self.base(device, Kind::Scales)?);
                // On a GPU, needs are read into host images a batch at a time; on the host backend one
                // batch reads the arenas in place.
                let mut batch: Vec<&Placement> = Vec::new();
                let mut bytes = 0;
                for (k, p) in placements.iter().enumerate() {
                    batch.push(p);
                    bytes += p.code_bytes();
                    let last = k + 1 == placements.len();
                    if last || (memory.on_gpu && bytes + placements[k + 1].code_bytes() > BATCH_BYTES) {
                        self.check_batch(
                            w,
                            memory,
                            device,
                            (code_base, scale_base),
                            &batch,
                            done,
                            (&codes, &scales),
                        )?;
                        batch.clear();
                        bytes = 0;
                    }
                }
            }
            Ok((codes.load(Ordering::Relaxed), scales.load(Ordering::Relaxed)))
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn check_batch<S: Sync>(
        &self,
        w: &Workload<S>,
        memory: &Memory,
        device: u32,
        (code_base, scale_base): (u64, u64),
        batch: &[&Placement],
        done: &AtomicU64,
        (codes, scales): (&AtomicU64, &AtomicU64),
    ) -> Result<(), String> {
        let mut images: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        if memory.on_gpu {
            for p in batch {
                let mut image = (vec![0u8; p.code_bytes() as usize], vec![0u8; p.scale_bytes() as usize]);
                // SAFETY: both ranges lie inside the arenas allocated on this device with these sizes.
                unsafe {
                    memory
                        .backend
                        .read(device as i32, code_base + p.codes, &mut image.0)
                        .map_err(|e| e.to_string())?;
                    memory
                        .backend
                        .read(device as i32, scale_base + p.scales, &mut image.1)
                        .map_err(|e| e.to_string())?;
                }
                images.push(image);
            }
        }
        let on_gpu = memory.on_gpu;
        let view = |k: usize| -> (&[u8], &[u8]) {
            let p = batch[k];
            if on_gpu {
                return (&images[k].0, &images[k].1);
            }
            let (c, s) =
                ((code_base + p.codes) as usize as *const u8, (scale_base + p.scales) as usize as *const u8);
            // SAFETY: on the host backend the arenas are host memory, allocated with these sizes; the
            // executors that write them are done (their calls return complete), so nothing writes
            // while they are read.
            unsafe {
                (
                    std::slice::from_raw_parts(c, p.code_bytes() as usize),
                    std::slice::from_raw_parts(s, p.scale_bytes() as usize),
                )
            }
        };
        // Units of whole block rows of one matrix: blocks never straddle two units, so the reference
        // over a unit gives the codes and scales it gives over the whole matrix.
        let mut work = Vec::new();
        for (k, p) in batch.iter().enumerate() {
            let per = (UNIT_ELEMENTS / (BLOCK * p.cols)).max(1);
            for m in 0..p.matrices {
                let mut i = 0;
                while i < p.grid.0 {
                    work.push((k, m * p.grid.0 + i, per.min(p.grid.0 - i)));
                    i += per;
                }
            }
        }
        parallel(&work, |k, first, count| {
            let p = batch[k];
            let (got_codes, got_scales) = view(k);
            let (m, i) = (first / p.grid.0, first % p.grid.0);
            let need = &w.needs[p.need];
            let name = &w.catalog.tensors[need.tensor as usize].name;
            let row0 = i * BLOCK;
            let rows = (count * BLOCK).min(p.rows - row0);
            let mut source = vec![0u8; (rows * p.cols * 2) as usize];
            for r in 0..rows {
                let global = global_index(w, need, m, row0 + r);
                for c in 0..p.cols {
                    let at = ((r * p.cols + c) * 2) as usize;
                    source[at..at + 2].copy_from_slice(&finite_bf16(need.tensor, global + c).to_le_bytes());
                }
            }
            let matrix =
                SourceMatrix { bytes: &source, source: SourceType::Bf16, rows, cols: p.cols, stride: p.cols };
            let mut want_codes = vec![0u8; (rows * p.cols) as usize];
            let mut want_scales = vec![0u8; (count * p.grid.1 * SCALE_BYTES) as usize];
            quantize(quantization(), &matrix, &mut want_codes, p.cols, &mut want_scales, p.grid.1);
            for r in 0..rows {
                let at = ((m * p.rows + row0 + r) * p.pitch) as usize;
                let got = &got_codes[at..at + p.cols as usize];
                let want = &want_codes[(r * p.cols) as usize..((r + 1) * p.cols) as usize];
                if let Some(c) = (0..got.len()).find(|&c| got[c] != want[c]) {
                    let global = global_index(w, need, m, row0 + r) + c as u64;
                    return Err(format!(
                        "device {}: the FP8 code of element {global} of {name} is {:#04x}; the reference gives {:#04x}",
                        p.device, got[c], want[c]
                    ));
                }
            }
            let at = ((m * p.grid.0 + i) * p.grid.1 * SCALE_BYTES) as usize;
            let got = &got_scales[at..at + want_scales.len()];
            if let Some(b) = (0..got.len()).find(|&b| got[b] != want_scales[b]) {
                let s = b as u64 / SCALE_BYTES;
                let scale = |bytes: &[u8]| {
                    f32::from_le_bytes(bytes[(s * 4) as usize..][..4].try_into().unwrap_or([0; 4]))
                };
                return Err(format!(
                    "device {}: the scale of block ({}, {}) of matrix {m} of {name}'s received box is {:e}; the reference gives {:e}",
                    p.device,
                    i + s / p.grid.1,
                    s % p.grid.1,
                    scale(got),
                    scale(&want_scales)
                ));
            }
            codes.fetch_add(rows * p.cols, Ordering::Relaxed);
            scales.fetch_add(count * p.grid.1, Ordering::Relaxed);
            done.fetch_add(rows * p.cols, Ordering::Relaxed);
            Ok(())
        })
    }
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
