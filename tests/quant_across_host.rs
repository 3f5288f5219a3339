//! Quantized needs across OS processes on the host backend, every path at once
//! (tests/common/quant_across.rs: in place, quantized by the sending process, staged), through IPC
//! writes or the staged exchange, under direct and staged commit, with and without verify. Every
//! code and scale is compared with the reference quantizer run over the whole box by each process
//! on its own, and the bytes received from the other process are counted: codes and scales where
//! the sender quantizes, bf16 only for the staged need.

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
    };
    let share = build_plan(&comm, &table, &PlanOptions::default()).unwrap();
    let mut planned: Vec<_> =
        share.quant_routes().iter().map(|r| (r.receiver.process, r.runner.process, r.path)).collect();
    planned.sort();
    assert_eq!(planned, across.paths(rank), "rank {rank}");
    assert_eq!(share.stats().quantized_sent_bytes, across.sent_bf16(rank), "rank {rank}");
    let references: Vec<_> = received.iter().map(|r| across.reference(&r.wanted)).collect();
    let cases = [(CommitMode::Direct, false), (CommitMode::Staged, false), (CommitMode::Direct, true)];
    for (commit, verify) in cases {
        let options = ExecOptions { commit, verify, ..ExecOptions::default() };
        let mut executor = Executor::new_across(&group, &share, Arc::clone(&comm), options).unwrap();
        // The host backend's IPC writes with process_vm_writev: the sender quantizes into its buffer.
        assert_eq!(executor.remote_totals().unwrap().quantized_straight_bytes, 0, "rank {rank}");
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
