//! Quantized needs across OS processes on the host backend: process 0 offers a bf16 matrix; process 1
//! receives it as FP8 through its staging buffer (the sources are in another process), through IPC
//! writes or the staged exchange, under direct and staged commit; process 0 also receives its own top
//! rows quantized in place. Every code and scale is compared with the reference quantizer run over
//! the whole box by each process on its own.

#[path = "common/processes.rs"]
mod processes;
#[path = "common/quant_cases.rs"]
mod quant_cases;

use processes::{in_processes, End};
use quant_cases::Aligned;
use refit::across::build_plan;
use refit::exec::{CommitMode, ExecOptions, Executor};
use refit::group::{BackendChoice, Group, GroupOptions};
use refit::plan::{Endpoint, Offer, PlanOptions, QuantNeed, QuantPath, Region, Table, TensorSpec};
use refit::quant::{Fp8, Granularity, QuantJob, Quantization, SourceType};
use refit::transport::comm::{CommId, CommOptions, Communicator};
use refit::transport::host::HostBackend;
use refit::transport::{Backend, BackendKind, Stream};
use std::sync::Arc;
use std::time::Duration;

const ROWS: u64 = 64;
const COLS: u64 = 96;
const SENTINEL: u8 = 0x5a;

/// Element (r, c) of the tensor: a finite bf16 over a few binades, the same in every process.
fn element(r: u64, c: u64) -> [u8; 2] {
    let h = (r * 7919 + c * 104729).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
    let bits = ((h & 0x8000) | ((120 + (h >> 16) % 12) << 7) | (h & 0x7f)) as u16;
    bits.to_le_bytes()
}

fn rows_of(lo: u64, rows: u64) -> Aligned {
    let mut a = Aligned::new((rows * COLS * 2) as usize, 0);
    for r in 0..rows {
        for c in 0..COLS {
            let at = ((r * COLS + c) * 2) as usize;
            a.bytes_mut()[at..at + 2].copy_from_slice(&element(lo + r, c));
        }
    }
    a
}

/// What one quantized need of rows `lo..lo + rows` receives.
struct Received {
    lo: u64,
    rows: u64,
    q: Quantization,
    codes: Aligned,
    scales: Aligned,
    staging: Option<Aligned>,
}

impl Received {
    fn new(lo: u64, rows: u64, q: Quantization, staging: bool) -> Received {
        let (grid_rows, grid_cols) = q.scale_grid(rows, COLS);
        Received {
            lo,
            rows,
            q,
            codes: Aligned::new((rows * COLS) as usize, SENTINEL),
            scales: Aligned::new((grid_rows * grid_cols * q.scale_kind().size()) as usize, SENTINEL),
            staging: staging.then(|| Aligned::new((rows * COLS * 2) as usize, 0)),
        }
    }

    fn need(&self, receiver: Endpoint) -> QuantNeed {
        let (grid_rows, grid_cols) = self.q.scale_grid(self.rows, COLS);
        QuantNeed {
            tensor: 0,
            receiver,
            addr: self.codes.addr(),
            region: Region { offset: vec![self.lo, 0], extent: vec![self.rows, COLS] },
            strides: vec![COLS, 1],
            quantization: self.q,
            source: SourceType::Bf16,
            scales: self.scales.addr(),
            scale_row_stride: grid_cols,
            scale_matrix_stride: grid_rows * grid_cols,
            staging: self.staging.as_ref().map_or(0, Aligned::addr),
        }
    }

    fn poison(&mut self) {
        self.codes.bytes_mut().fill(SENTINEL);
        self.scales.bytes_mut().fill(SENTINEL);
    }

    fn untouched(&self) -> bool {
        self.codes.bytes().iter().chain(self.scales.bytes()).all(|&b| b == SENTINEL)
    }

    /// Codes and scales equal the reference's over the whole box.
    fn matches_the_reference(&self) -> bool {
        let source = rows_of(self.lo, self.rows);
        let codes = Aligned::new(self.codes.bytes().len(), SENTINEL);
        let scales = Aligned::new(self.scales.bytes().len(), SENTINEL);
        let (_, grid_cols) = self.q.scale_grid(self.rows, COLS);
        let job = QuantJob {
            quantization: self.q,
            source: SourceType::Bf16,
            src: source.addr(),
            rows: self.rows,
            cols: COLS,
            src_stride: COLS,
            dst: codes.addr(),
            dst_stride: COLS,
            scales: scales.addr(),
            scale_stride: grid_cols,
        };
        let host = HostBackend::new(1).unwrap();
        // SAFETY: the buffers above outlive the call, which completes on return.
        unsafe { host.quantize_batch(0, Stream::NULL, &[job]) }.unwrap();
        codes.bytes() == self.codes.bytes() && scales.bytes() == self.scales.bytes()
    }
}

fn spec() -> TensorSpec {
    TensorSpec { name: "w".into(), dtype: 1, elem_size: 2, shape: vec![ROWS, COLS] }
}

fn refit_across(rank: usize, size: usize, id: &CommId, ipc: bool) {
    let group = Group::new(&[0], GroupOptions { backend: BackendChoice::Host, host_devices: 0 }).unwrap();
    let options = CommOptions { timeout: Duration::from_secs(30), ipc, ..CommOptions::default() };
    let comm = Arc::new(Communicator::create(id, size, rank, 0, options).unwrap());
    let here = Endpoint { process: rank as u32, device: 0 };
    let block = Quantization { target: Fp8::E4m3fn, granularity: Granularity::Block { rows: 32, cols: 32 } };
    let source = rows_of(0, ROWS);
    let mut received = if rank == 0 {
        // The top half, quantized in place from this process's own offer.
        Received::new(0, 32, Quantization { target: Fp8::E5m2, granularity: Granularity::Mx }, false)
    } else {
        Received::new(0, ROWS, block, true)
    };
    let table = Table {
        tensors: vec![spec()],
        offers: if rank == 0 {
            vec![Offer {
                tensor: 0,
                owner: here,
                addr: source.addr(),
                region: Region { offset: vec![0, 0], extent: vec![ROWS, COLS] },
                strides: None,
                digest: None,
            }]
        } else {
            vec![]
        },
        needs: vec![],
        quant_needs: vec![received.need(here)],
    };
    let share = build_plan(&comm, &table, &PlanOptions::default()).unwrap();
    let path = if rank == 0 { QuantPath::Direct } else { QuantPath::Staged };
    assert!(share.quant_routes().iter().all(|r| r.path == path && r.receiver == here));
    assert_eq!(share.quant_routes().len(), 1);
    for commit in [CommitMode::Direct, CommitMode::Staged] {
        let options = ExecOptions { commit, ..ExecOptions::default() };
        let mut executor = Executor::new_across(&group, &share, Arc::clone(&comm), options).unwrap();
        for step in 0..2 {
            received.poison();
            // SAFETY: every buffer of the plan lives until the calls (outside a scope) return.
            let ran = unsafe { executor.run(&group) }.unwrap();
            if commit == CommitMode::Staged {
                assert!(
                    received.untouched(),
                    "rank {rank} ipc {ipc} step {step}: a staged run wrote live codes"
                );
                // SAFETY: as above.
                let committed = unsafe { executor.commit(&group) }.unwrap();
                assert_eq!(ran.quantized_elements + committed.quantized_elements, received.rows * COLS);
            } else {
                assert_eq!(ran.quantized_elements, received.rows * COLS);
            }
            assert!(received.matches_the_reference(), "rank {rank} ipc {ipc} {commit:?} step {step}");
        }
        comm.allgather_bytes(b"next").unwrap();
    }
}

#[test]
fn quantized_needs_across_processes_through_ipc_match_the_reference() {
    in_processes(
        "quantized_needs_across_processes_through_ipc_match_the_reference",
        BackendKind::Host,
        &[End::Done; 2],
        |rank, size, id| refit_across(rank, size, id, true),
    );
}

#[test]
fn quantized_needs_across_processes_through_staging_match_the_reference() {
    in_processes(
        "quantized_needs_across_processes_through_staging_match_the_reference",
        BackendKind::Host,
        &[End::Done; 2],
        |rank, size, id| refit_across(rank, size, id, false),
    );
}
