//! Quantized needs across OS processes on the host backend, every path at once
//! (tests/common/quant_across.rs: in place, quantized by the sending process, staged), through IPC
//! writes or the staged exchange, under direct and staged commit, with and without verify. Every
//! code and scale is compared with the reference quantizer run over the whole box by each process
//! on its own, and the bytes received from the other process are counted: codes and scales where
//! the sender quantizes, bf16 only for the staged need.

#[path = "common/amax_exchange.rs"]
mod amax_exchange;
#[path = "common/processes.rs"]
mod processes;
#[path = "common/quant_across.rs"]
mod quant_across;
#[path = "common/quant_cases.rs"]
mod quant_cases;

use processes::{in_processes, End};
use quant_across::{Across, Wanted};
use quant_cases::Aligned;
use refit::across::build_plan;
use refit::exec::{CommitMode, ExecOptions, Executor};
use refit::group::{BackendChoice, Group, GroupOptions};
use refit::plan::{Endpoint, PlanOptions, Table};
use refit::transport::comm::{CommId, CommOptions, Communicator};
use refit::transport::BackendKind;
use std::sync::Arc;
use std::time::Duration;

const SENTINEL: u8 = 0x5a;

/// One quantized need's memory in this process.
struct Received {
    wanted: Wanted,
    codes: Aligned,
    scales: Aligned,
    staging: Aligned,
}

impl Received {
    fn new(across: &Across, wanted: Wanted) -> Received {
        let (codes, scales, staging) = across.sizes(&wanted);
        Received {
            wanted,
            codes: Aligned::new(codes, SENTINEL),
            scales: Aligned::new(scales, SENTINEL),
            staging: Aligned::new(staging.max(1), 0),
        }
    }

    fn poison(&mut self) {
        self.codes.bytes_mut().fill(SENTINEL);
        self.scales.bytes_mut().fill(SENTINEL);
    }

    fn untouched(&self) -> bool {
        self.codes.bytes().iter().chain(self.scales.bytes()).all(|&b| b == SENTINEL)
    }
}

fn refit_across(rank: usize, size: usize, id: &CommId, ipc: bool) {
    let across = Across::new(64, 96, 48, 32, (32, 32), (32, 32));
    let group = Group::new(&[0], GroupOptions { backend: BackendChoice::Host, host_devices: 0 }).unwrap();
    let options = CommOptions { timeout: Duration::from_secs(30), ipc, ..CommOptions::default() };
    let comm = Arc::new(Communicator::create(id, size, rank, 0, options).unwrap());
    let here = Endpoint { process: rank as u32, device: 0 };
    let (lo, rows) = across.offered(rank);
    let mut source = Aligned::new((rows * across.cols * 2) as usize, 0);
    source.bytes_mut().copy_from_slice(&across.rows_of(lo, rows));
    let mut received: Vec<Received> =
        across.wanted(rank).into_iter().map(|w| Received::new(&across, w)).collect();
    let need = |r: &Received| {
        let staging = if r.wanted.staging { r.staging.addr() } else { 0 };
        across.need(&r.wanted, here, r.codes.addr(), r.scales.addr(), staging)
    };
    let table = Table {
        tensors: vec![across.spec()],
        offers: vec![across.offer(here, source.addr())],
        needs: vec![],
        quant_needs: received.iter().map(need).collect(),
        shared_amax: vec![],
    };
    let share = build_plan(&comm, &table, &PlanOptions::default()).unwrap();
    let mut planned: Vec<_> =
        share.quant_routes().iter().map(|r| (r.receiver.process, r.runner.process, r.path)).collect();
    planned.sort();
    assert_eq!(planned, across.paths(rank), "rank {rank}");
    assert_eq!(share.stats().quantized_sent_bytes, across.sent_bf16(rank), "rank {rank}");
    let references: Vec<_> = received.iter().map(|r| across.reference(&r.wanted)).collect();
    let cases = [(CommitMode::Direct, false), (CommitMode::Staged, false), (CommitMode::Direct, true)];
    let mut plain_held: Option<u64> = None;
    for (commit, verify) in cases {
        let options = ExecOptions { commit, verify, ..ExecOptions::default() };
        let mut executor = Executor::new_across(&group, &share, Arc::clone(&comm), options).unwrap();
        // The host backend's IPC writes with process_vm_writev: the sender quantizes into its buffer.
        assert_eq!(executor.remote_totals().unwrap().quantized_straight_bytes, 0, "rank {rank}");
        // Memory beside staging_limit: that buffer (the codes and scales sent, rows and scales
        // padded to 16 bytes), with verify the scratch of a second quantization too, and under
        // staged commit the landing of what the other process sends.
        let held = executor.quantization_bytes();
        assert!(held >= across.quantized_crossing(1 - rank), "rank {rank} {commit:?}: {held} bytes");
        match verify {
            false => plain_held = Some(held.max(plain_held.unwrap_or(0))),
            true => assert!(held > plain_held.unwrap_or(u64::MAX), "rank {rank}: {held} bytes with verify"),
        }
        let landing = if commit == CommitMode::Staged { across.crossing(rank) } else { 0 };
        let landed = executor.landing_bytes();
        assert!(
            (landing..=landing + 1024).contains(&landed),
            "rank {rank} {commit:?}: {landed} landing bytes"
        );
        for step in 0..2 {
            let at = format!("rank {rank} ipc {ipc} {commit:?} verify {verify} step {step}");
            received.iter_mut().for_each(Received::poison);
            // SAFETY: every buffer of the plan lives until the calls (outside a scope) return.
            let ran = unsafe { executor.run(&group) }.unwrap();
            let mut elements = ran.quantized_elements;
            if commit == CommitMode::Staged {
                assert!(received.iter().all(Received::untouched), "{at}: a staged run wrote live codes");
                // SAFETY: as above.
                elements += unsafe { executor.commit(&group) }.unwrap().quantized_elements;
            }
            assert_eq!(elements, across.quantized(rank), "{at}");
            assert_eq!(ran.remote_received_bytes, across.crossing(rank), "{at}");
            assert_eq!(ran.verified, verify, "{at}");
            for (k, (r, (codes, scales))) in received.iter().zip(&references).enumerate() {
                assert!(
                    r.codes.bytes() == codes.as_slice(),
                    "{at}: need {k}'s codes differ from the reference"
                );
                assert!(
                    r.scales.bytes() == scales.as_slice(),
                    "{at}: need {k}'s scales differ from the reference"
                );
            }
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

/// A fused weight with one per-tensor scale received by two engine processes from a trainer process
/// that offers q, k and v as separate tensors, quantized by the trainer on the sender path (one
/// device holds every piece) with the amax of the whole fused matrix.
///
/// - `sharded` false (vLLM's per-tensor FP8 `qkv_proj` at TP 1, replicated): each receiver gets the
///   whole of q, k and v; its three needs share its scale.
/// - `sharded` true (the same layer at TP 2): each receiver gets half the rows of each of q, k and v
///   (the first engine the first halves) and keeps its own copy of the scale, which both give one
///   amax key: every code and both scales come from the amax of the whole fused matrix, which lies
///   in the second engine's half only.
///
/// `trainers` processes offer the fused matrix (ranks below it; the engines are the two after): one
/// the whole of it, or each the same share of every part's rows (a tensor-parallel trainer). With
/// two, each engine's share comes from one trainer; with four, from two. No trainer then holds the
/// whole weight, so the trainers exchange their amaxes at every run.
///
/// Both receivers keep their codes and scale at one same virtual address, so that the sender's
/// buffer must keep the two receivers' scales apart. Every code and the scale equal the reference's
/// over the fused matrix (the receiver's rows of it), through IPC writes and the staged exchange,
/// under both commits and with verify.
fn fused_per_tensor_across(rank: usize, size: usize, id: &CommId, ipc: bool, sharded: bool, trainers: usize) {
    use refit::plan::{Offer, QuantNeed, QuantPath, Region, SharedAmax, TensorSpec};
    use refit::quant::{Arithmetic, Fp8, Granularity, Quantization, SourceType};

    const COLS: u64 = 64;
    const PARTS: [(&str, u64); 3] = [("q", 32), ("k", 16), ("v", 16)];
    const ROWS: u64 = 64;
    // Where both receivers map their codes (and the scale after them): one address in each process.
    const FIXED: usize = 0x5a5a_0000_0000;
    const KEY: u64 = 0x9e37_79b9;
    let q = Quantization::new(Fp8::E4m3fn, Granularity::Tensor).with(Arithmetic::VllmTensor);
    // Element (r, c) of the fused matrix: the magnitude grows every 8 rows, so v's rows are the
    // largest (no part alone has the fused amax) and the last 8 of them (the second engine's half of
    // v when sharded) larger still.
    let element = |r: u64, c: u64| -> [u8; 2] {
        let h = (r * 7919 + c * 104729).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
        let exponent = 118 + r / 8;
        (((h & 0x8000) | (exponent << 7) | (h & 0x7f)) as u16).to_le_bytes()
    };
    let fused: Vec<u8> = (0..ROWS).flat_map(|r| (0..COLS).flat_map(move |c| element(r, c))).collect();

    let group = Group::new(&[0], GroupOptions { backend: BackendChoice::Host, host_devices: 0 }).unwrap();
    let options = CommOptions { timeout: Duration::from_secs(30), ipc, ..CommOptions::default() };
    let comm = Arc::new(Communicator::create(id, size, rank, 0, options).unwrap());
    let here = Endpoint { process: rank as u32, device: 0 };
    let tensors: Vec<TensorSpec> = PARTS
        .iter()
        .map(|&(name, rows)| TensorSpec {
            name: name.into(),
            dtype: 1,
            elem_size: 2,
            shape: vec![rows, COLS],
        })
        .collect();
    let mut source = Aligned::new(fused.len(), 0);
    source.bytes_mut().copy_from_slice(&fused);
    let first_rows: Vec<u64> =
        PARTS.iter().scan(0, |at, &(_, rows)| Some(std::mem::replace(at, *at + rows))).collect();
    // The rows of each part this receiver gets: (first row within the part, rows).
    let share = |rows: u64| match (sharded, rank.saturating_sub(trainers)) {
        (false, _) => (0, rows),
        (true, 0) => (0, rows / 2),
        (true, _) => (rows / 2, rows / 2),
    };
    // The fused matrix's rows this receiver holds, in its order.
    let held: Vec<u64> = PARTS
        .iter()
        .zip(&first_rows)
        .flat_map(|(&(_, rows), &first)| {
            let (lo, count) = share(rows);
            first + lo..first + lo + count
        })
        .collect();
    let (mut offers, mut quant_needs, mut shared_amax) = (Vec::new(), Vec::new(), Vec::new());
    let received = if rank < trainers {
        for (tensor, (&(_, rows), &first)) in PARTS.iter().zip(&first_rows).enumerate() {
            let mine = rows / trainers as u64;
            let lo = mine * rank as u64;
            offers.push(Offer {
                tensor: tensor as u32,
                owner: here,
                addr: source.addr() + (first + lo) * COLS * 2,
                region: Region { offset: vec![lo, 0], extent: vec![mine, COLS] },
                strides: None,
                digest: None,
            });
        }
        None
    } else {
        // SAFETY: a fresh anonymous mapping at an address nothing else here uses (refused, not
        // replaced, if something does).
        let at = unsafe {
            libc::mmap(
                FIXED as *mut libc::c_void,
                4096 * 2,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
                -1,
                0,
            )
        };
        assert_eq!(at as usize, FIXED, "rank {rank}: mapping the fixed address");
        let (codes, scale) = (FIXED as u64, (FIXED + 4096) as u64);
        let mut at = codes;
        for (tensor, &(_, rows)) in PARTS.iter().enumerate() {
            let (lo, count) = share(rows);
            quant_needs.push(QuantNeed {
                tensor: tensor as u32,
                receiver: here,
                addr: at,
                region: Region { offset: vec![lo, 0], extent: vec![count, COLS] },
                strides: vec![COLS, 1],
                quantization: q,
                source: SourceType::Bf16,
                scales: scale,
                scale_row_stride: 1,
                scale_matrix_stride: 1,
                staging: 0,
            });
            at += count * COLS;
        }
        if sharded {
            shared_amax.push(SharedAmax { process: rank as u32, scale, key: KEY });
        }
        // SAFETY: the mapping above, alive to the end of the process.
        Some(unsafe {
            (
                std::slice::from_raw_parts_mut(codes as *mut u8, held.len() * COLS as usize),
                &mut *(scale as *mut [u8; 4]),
            )
        })
    };
    let table = Table { tensors, offers, needs: vec![], quant_needs, shared_amax };
    let share = build_plan(&comm, &table, &PlanOptions::default()).unwrap();
    assert!(
        share
            .quant_routes()
            .iter()
            .all(|r| r.path == QuantPath::Sender && (r.runner.process as usize) < trainers),
        "rank {rank}"
    );
    let routes = match (rank < trainers, trainers) {
        (true, 1) => 6,
        (true, _) => 3,
        (false, t) => 3 * (t / 2).max(1),
    };
    assert_eq!(share.quant_routes().len(), routes, "rank {rank}");
    // The trainers exchange amaxes only when none holds the whole weight.
    assert_eq!(share.amax_exchange().is_empty(), trainers == 1, "rank {rank}");

    // The reference: the fused matrix quantized whole; this receiver's rows of its codes.
    let (fused_codes, want_scale) = quant_cases::reference_bf16(q, &fused, ROWS, COLS);
    let want_codes: Vec<u8> = held
        .iter()
        .flat_map(|&r| &fused_codes[(r * COLS) as usize..((r + 1) * COLS) as usize])
        .copied()
        .collect();
    if sharded && rank == trainers {
        // The check can fail: this receiver's rows alone have another scale.
        let mine: Vec<u8> = held
            .iter()
            .flat_map(|&r| &fused[(r * COLS * 2) as usize..((r + 1) * COLS * 2) as usize])
            .copied()
            .collect();
        let (_, alone) = quant_cases::reference_bf16(q, &mine, held.len() as u64, COLS);
        assert_ne!(alone, want_scale, "the first engine's rows alone have the fused amax");
    }

    let mut received = received;
    let cases = [(CommitMode::Direct, false), (CommitMode::Staged, false), (CommitMode::Direct, true)];
    for (commit, verify) in cases {
        let options = ExecOptions { commit, verify, ..ExecOptions::default() };
        let mut executor = Executor::new_across(&group, &share, Arc::clone(&comm), options).unwrap();
        let at =
            format!("rank {rank} ipc {ipc} sharded {sharded} trainers {trainers} {commit:?} verify {verify}");
        if let Some((codes, scale)) = received.as_mut() {
            codes.fill(SENTINEL);
            scale.fill(SENTINEL);
        }
        // SAFETY: every buffer of the plan lives until the calls return.
        unsafe { executor.run(&group) }.unwrap();
        if commit == CommitMode::Staged {
            // SAFETY: as above.
            unsafe { executor.commit(&group) }.unwrap();
        }
        if let Some((codes, scale)) = received.as_ref() {
            assert_eq!(&scale[..], want_scale.as_slice(), "{at}: the shared scale");
            assert!(*codes == want_codes.as_slice(), "{at}: codes differ from the reference");
        }
        comm.allgather_bytes(b"next").unwrap();
    }
}

#[test]
fn a_fused_per_tensor_weight_is_quantized_by_its_sender_with_one_scale_through_ipc() {
    in_processes(
        "a_fused_per_tensor_weight_is_quantized_by_its_sender_with_one_scale_through_ipc",
        BackendKind::Host,
        &[End::Done; 3],
        |rank, size, id| fused_per_tensor_across(rank, size, id, true, false, 1),
    );
}

#[test]
fn a_fused_per_tensor_weight_is_quantized_by_its_sender_with_one_scale_through_staging() {
    in_processes(
        "a_fused_per_tensor_weight_is_quantized_by_its_sender_with_one_scale_through_staging",
        BackendKind::Host,
        &[End::Done; 3],
        |rank, size, id| fused_per_tensor_across(rank, size, id, false, false, 1),
    );
}

#[test]
fn a_per_tensor_weight_sharded_over_two_engines_takes_one_amax_through_ipc() {
    in_processes(
        "a_per_tensor_weight_sharded_over_two_engines_takes_one_amax_through_ipc",
        BackendKind::Host,
        &[End::Done; 3],
        |rank, size, id| fused_per_tensor_across(rank, size, id, true, true, 1),
    );
}

#[test]
fn a_per_tensor_weight_sharded_over_two_engines_takes_one_amax_through_staging() {
    in_processes(
        "a_per_tensor_weight_sharded_over_two_engines_takes_one_amax_through_staging",
        BackendKind::Host,
        &[End::Done; 3],
        |rank, size, id| fused_per_tensor_across(rank, size, id, false, true, 1),
    );
}

#[test]
fn a_per_tensor_weight_sharded_over_two_trainers_and_two_engines_takes_one_amax_through_ipc() {
    in_processes(
        "a_per_tensor_weight_sharded_over_two_trainers_and_two_engines_takes_one_amax_through_ipc",
        BackendKind::Host,
        &[End::Done; 4],
        |rank, size, id| fused_per_tensor_across(rank, size, id, true, true, 2),
    );
}

#[test]
fn a_per_tensor_weight_sharded_over_four_trainers_and_two_engines_takes_one_amax_through_staging() {
    in_processes(
        "a_per_tensor_weight_sharded_over_four_trainers_and_two_engines_takes_one_amax_through_staging",
        BackendKind::Host,
        &[End::Done; 6],
        |rank, size, id| fused_per_tensor_across(rank, size, id, false, true, 4),
    );
}

impl amax_exchange::Memory for Aligned {
    fn new(len: usize) -> Aligned {
        Aligned::new(len, 0)
    }

    fn addr(&self) -> u64 {
        Aligned::addr(self)
    }

    fn write(&mut self, bytes: &[u8]) {
        self.bytes_mut().copy_from_slice(bytes);
    }

    fn read(&self) -> Vec<u8> {
        self.bytes().to_vec()
    }
}

#[test]
fn trainers_holding_column_halves_exchange_amaxes_through_ipc() {
    in_processes(
        "trainers_holding_column_halves_exchange_amaxes_through_ipc",
        BackendKind::Host,
        &[End::Done; amax_exchange::PROCESSES],
        |rank, size, id| {
            amax_exchange::trainers_exchange_amaxes::<Aligned>(rank, size, id, BackendChoice::Host, true)
        },
    );
}

#[test]
fn trainers_holding_column_halves_exchange_amaxes_through_staging() {
    in_processes(
        "trainers_holding_column_halves_exchange_amaxes_through_staging",
        BackendKind::Host,
        &[End::Done; amax_exchange::PROCESSES],
        |rank, size, id| {
            amax_exchange::trainers_exchange_amaxes::<Aligned>(rank, size, id, BackendChoice::Host, false)
        },
    );
}
