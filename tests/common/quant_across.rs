//! One refit of quantized needs between two processes that takes every path at once, shared by the
//! host backend's test (tests/quant_across_host.rs) and the GPU's (tests/gpu_quant.rs): a bf16
//! matrix of `rows` x `cols`, process 0 offering rows 0..split and process 1 rows split..rows.
//!
//! - Process 0 receives rows 0..half as MXFP8 e5m2, quantized in place from its own offer (direct),
//!   and rows half..rows per row as e4m3 under vLLM's per-channel arithmetic: its own half..split
//!   in place, split..rows quantized by process 1 (sender).
//! - Process 1 receives rows 0..half in `sender` blocks under DeepGEMM's arithmetic, quantized by
//!   process 0 (sender), and the
//!   whole matrix in `staged` blocks through its staging buffer: a block spans `split`, so no
//!   offer holds it whole (staged).
//!
//! Every figure a test checks (paths, bytes between the processes, elements quantized) is worked
//! out here from the shapes, not read back from the plan. Its includer also includes
//! tests/common/quant_cases.rs as `quant_cases`.

#![allow(dead_code)]

use refit::plan::{Endpoint, Offer, QuantNeed, QuantPath, Region, TensorSpec};
use refit::quant::{Arithmetic, Fp8, Granularity, Quantization, SourceType};

pub struct Across {
    pub rows: u64,
    pub cols: u64,
    pub split: u64,
    pub half: u64,
    /// Blocks of process 1's sender-path need, and of its staged need.
    pub sender: (u32, u32),
    pub staged: (u32, u32),
}

/// One quantized need of a process: rows `lo..lo + rows`, all columns.
#[derive(Clone, Copy, Debug)]
pub struct Wanted {
    pub lo: u64,
    pub rows: u64,
    pub q: Quantization,
    pub staging: bool,
}

fn block(rows: u32, cols: u32) -> Quantization {
    Quantization::new(Fp8::E4m3fn, Granularity::Block { rows, cols })
}

impl Across {
    /// Checks the shapes make the paths the module docs say.
    pub fn new(
        rows: u64,
        cols: u64,
        split: u64,
        half: u64,
        sender: (u32, u32),
        staged: (u32, u32),
    ) -> Across {
        assert!(half < split && split < rows && cols % 32 == 0);
        assert!(half % u64::from(sender.0) == 0 && split % u64::from(staged.0) != 0);
        Across { rows, cols, split, half, sender, staged }
    }

    pub fn spec(&self) -> TensorSpec {
        TensorSpec { name: "w".into(), dtype: 1, elem_size: 2, shape: vec![self.rows, self.cols] }
    }

    /// Element (r, c): a finite bf16 over a few binades, the same in every process. Some lie far
    /// below the arithmetics' floors (2^-27 .. 2^-16, under 1e-4 and 2^-9), so that the floors
    /// decide scales: every row r with r % 64 >= 56 (whole rows of the per-row need), and one block of
    /// the sender need in each test's shape (rows 0..32, columns 64..96 on the host; rows 0..128,
    /// columns 640.. on the GPU).
    pub fn element(r: u64, c: u64) -> [u8; 2] {
        let h = (r * 7919 + c * 104729).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
        let tiny = r % 64 >= 56 || (r < 32 && (64..96).contains(&c)) || (r < 128 && c >= 640);
        let lowest = if tiny { 100 } else { 120 };
        let bits = ((h & 0x8000) | ((lowest + (h >> 16) % 12) << 7) | (h & 0x7f)) as u16;
        bits.to_le_bytes()
    }

    /// Rows `lo..lo + rows` of the matrix, row-major bf16 bytes.
    pub fn rows_of(&self, lo: u64, rows: u64) -> Vec<u8> {
        (lo..lo + rows).flat_map(|r| (0..self.cols).flat_map(move |c| Across::element(r, c))).collect()
    }

    /// The rows process `rank` offers: (first, count).
    pub fn offered(&self, rank: usize) -> (u64, u64) {
        if rank == 0 {
            (0, self.split)
        } else {
            (self.split, self.rows - self.split)
        }
    }

    pub fn offer(&self, here: Endpoint, addr: u64) -> Offer {
        let (lo, rows) = self.offered(here.process as usize);
        Offer {
            tensor: 0,
            owner: here,
            addr,
            region: Region { offset: vec![lo, 0], extent: vec![rows, self.cols] },
            strides: None,
            digest: None,
        }
    }

    pub fn wanted(&self, rank: usize) -> Vec<Wanted> {
        let w = |lo, rows, q, staging| Wanted { lo, rows, q, staging };
        if rank == 0 {
            vec![
                w(0, self.half, Quantization::new(Fp8::E5m2, Granularity::Mx), false),
                w(
                    self.half,
                    self.rows - self.half,
                    Quantization::new(Fp8::E4m3fn, Granularity::Row).with(Arithmetic::VllmChannel),
                    false,
                ),
            ]
        } else {
            vec![
                w(0, self.half, block(self.sender.0, self.sender.1).with(Arithmetic::DeepGemm), false),
                w(0, self.rows, block(self.staged.0, self.staged.1), true),
            ]
        }
    }

    /// The quantized routes process `rank`'s share holds, as (receiver, runner, path), sorted.
    pub fn paths(&self, rank: usize) -> Vec<(u32, u32, QuantPath)> {
        let mut paths = if rank == 0 {
            vec![
                (0, 0, QuantPath::Direct),
                (0, 0, QuantPath::Direct),
                (0, 1, QuantPath::Sender),
                (1, 0, QuantPath::Sender),
            ]
        } else {
            vec![(0, 1, QuantPath::Sender), (1, 0, QuantPath::Sender), (1, 1, QuantPath::Staged)]
        };
        paths.sort();
        paths
    }

    /// Source bytes the other process quantizes for `rank`'s needs (its plan stats'
    /// quantized_sent_bytes).
    pub fn sent_bf16(&self, rank: usize) -> u64 {
        2 * self.cols * if rank == 0 { self.rows - self.split } else { self.half }
    }

    /// Bytes of codes and f32 scales `rank` receives per step from the other process, which
    /// quantizes them (the sender path).
    pub fn quantized_crossing(&self, rank: usize) -> u64 {
        if rank == 0 {
            let rows = self.rows - self.split;
            rows * self.cols + rows * 4
        } else {
            let (grid_rows, grid_cols) = block(self.sender.0, self.sender.1).scale_grid(self.half, self.cols);
            self.half * self.cols + grid_rows * grid_cols * 4
        }
    }

    /// Bytes `rank` receives from the other process per step: the codes and scales of the sender
    /// path, and bf16 of rows 0..split into process 1's staging.
    pub fn crossing(&self, rank: usize) -> u64 {
        self.quantized_crossing(rank) + if rank == 0 { 0 } else { self.split * self.cols * 2 }
    }

    /// Elements `rank` quantizes per step: in place, for the other process, and from its staging.
    pub fn quantized(&self, rank: usize) -> u64 {
        self.cols
            * if rank == 0 {
                self.half + (self.split - self.half) + self.half
            } else {
                (self.rows - self.split) + self.rows
            }
    }

    /// Bytes of a need's codes, scales and staging.
    pub fn sizes(&self, w: &Wanted) -> (usize, usize, usize) {
        let (grid_rows, grid_cols) = w.q.scale_grid(w.rows, self.cols);
        let scales = grid_rows * grid_cols * w.q.scale_kind().size();
        (
            (w.rows * self.cols) as usize,
            scales as usize,
            if w.staging { (w.rows * self.cols * 2) as usize } else { 0 },
        )
    }

    pub fn need(&self, w: &Wanted, receiver: Endpoint, codes: u64, scales: u64, staging: u64) -> QuantNeed {
        let (grid_rows, grid_cols) = w.q.scale_grid(w.rows, self.cols);
        QuantNeed {
            tensor: 0,
            receiver,
            addr: codes,
            region: Region { offset: vec![w.lo, 0], extent: vec![w.rows, self.cols] },
            strides: vec![self.cols, 1],
            quantization: w.q,
            source: SourceType::Bf16,
            scales,
            scale_row_stride: grid_cols,
            scale_matrix_stride: grid_rows * grid_cols,
            staging,
        }
    }

    /// A need's codes and scales as the reference quantizer makes them over its whole box.
    pub fn reference(&self, w: &Wanted) -> (Vec<u8>, Vec<u8>) {
        super::quant_cases::reference_bf16(w.q, &self.rows_of(w.lo, w.rows), w.rows, self.cols)
    }
}
