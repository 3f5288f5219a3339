//! The planner under an address-space limit: a plan whose segments do not fit returns
//! OUT_OF_MEMORY instead of aborting the process, and the planner keeps working afterwards.
//!
//! Each test re-executes this test binary as a child process with `PLAN_MEMORY_CHILD` set; the
//! child lowers RLIMIT_AS (which would make the parent's other tests fail) before planning.

use refit::plan::{
    build, build_with_limits, Endpoint, Limits, Need, Offer, PlanOptions, Region, Table, TensorSpec,
};
use refit::Status;
use std::process::Command;

const CHILD: &str = "PLAN_MEMORY_CHILD";
/// The address space the child keeps: enough for the test harness and a small plan, far from
/// what the large plan's segments take (several hundred MiB).
const ADDRESS_SPACE: u64 = 256 << 20;

/// A tensor of 6^8 one-byte elements, offered row-major by process 0 and needed `needs` times
/// by process 1 with its dimensions reversed: every element is its own run, every 36 elements one
/// two-level segment (46,656 segments per need).
fn reversed_8d(needs: u64) -> Table {
    let shape = vec![6u64; 8];
    let whole = Region { offset: vec![0; 8], extent: shape.clone() };
    let elements: u64 = shape.iter().product();
    // Destination dimension d is tensor dimension 7 - d; row-major over the reversed shape.
    let strides: Vec<u64> = (0..8u32).map(|d| 6u64.pow(7 - d)).collect();
    Table {
        tensors: vec![TensorSpec { name: "w".into(), dtype: 0, elem_size: 1, shape }],
        offers: vec![Offer {
            tensor: 0,
            owner: Endpoint { process: 0, device: 0 },
            addr: 1 << 40,
            region: whole.clone(),
            strides: None,
            digest: None,
        }],
        needs: (0..needs)
            .map(|i| Need {
                tensor: 0,
                receiver: Endpoint { process: 1, device: 0 },
                addr: (2 << 40) + i * elements,
                region: whole.clone(),
                perm: Some((0..8u32).rev().collect()),
                strides: strides.clone(),
            })
            .collect(),
        quant_needs: Vec::new(),
        shared_amax: Vec::new(),
    }
}

/// Runs test `name` of this binary again in a child with `PLAN_MEMORY_CHILD` set and checks that
/// it passed (an abort or a crash in the child fails the parent).
fn in_child(name: &str) {
    let output = Command::new(std::env::current_exe().expect("test binary path"))
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .expect("child runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && stdout.contains("child done"),
        "child {name} failed ({}):\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
}

fn limit_address_space(bytes: u64) {
    let limit = libc::rlimit { rlim_cur: bytes, rlim_max: bytes };
    // SAFETY: setrlimit reads the struct it is given; lowering a soft and hard limit is always allowed.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) }, 0, "setrlimit");
}

#[test]
fn segments_beyond_the_address_space_are_out_of_memory_not_an_abort() {
    if std::env::var_os(CHILD).is_none() {
        return in_child("segments_beyond_the_address_space_are_out_of_memory_not_an_abort");
    }
    limit_address_space(ADDRESS_SPACE);
    let options = PlanOptions::default();
    // Within the limit: a plan of a few needs works.
    let small = build(&[reversed_8d(2)], &options).expect("a small plan fits");
    assert_eq!(small.stats().needed_bytes, 2 * 6u64.pow(8));
    // 70 needs: 3.3 million segments, more than the address space holds.
    let err = build(&[reversed_8d(70)], &options).expect_err("the large plan does not fit");
    assert_eq!(err.status, Status::OutOfMemory, "{err}");
    assert!(err.message.contains("segments"), "{err}");
    // Nothing is left behind: the small plan still fits.
    assert!(build(&[reversed_8d(2)], &options).is_ok());
    println!("child done");
}

#[test]
fn the_segment_limit_is_named_when_reached() {
    let limits = Limits { max_segments: 100_000, ..Limits::default() };
    let err = build_with_limits(&[reversed_8d(3)], &PlanOptions::default(), &limits).unwrap_err();
    assert_eq!(err.status, Status::OutOfMemory, "{err}");
    assert!(err.message.contains("100000 segments"), "{err}");
    assert!(build_with_limits(&[reversed_8d(2)], &PlanOptions::default(), &limits).is_ok());
}
