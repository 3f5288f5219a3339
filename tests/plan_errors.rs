//! Every way planning fails, with the status and the message naming what is wrong; and the small
//! cases that must not fail (overlapping offers, interleaved destinations, empty boxes).

use refit::plan::{
    build, build_share, build_with_limits, Endpoint, Limits, Need, Offer, OwnerPolicy, Plan, PlanOptions,
    Region, Table, TableBuilder, TensorSpec,
};
use refit::{Error, Status};

fn spec(name: &str, elem_size: u32, shape: &[u64]) -> TensorSpec {
    TensorSpec { name: name.into(), dtype: 1, elem_size, shape: shape.to_vec() }
}

fn at(rank: u32) -> Endpoint {
    Endpoint { process: rank, device: 0 }
}

fn region(offset: &[u64], extent: &[u64]) -> Region {
    Region { offset: offset.to_vec(), extent: extent.to_vec() }
}

fn offer(tensor: u32, rank: u32, addr: u64, offset: &[u64], extent: &[u64]) -> Offer {
    Offer { tensor, owner: at(rank), addr, region: region(offset, extent), strides: None, digest: None }
}

fn need(tensor: u32, rank: u32, addr: u64, offset: &[u64], extent: &[u64], strides: &[u64]) -> Need {
    Need {
        tensor,
        receiver: at(rank),
        addr,
        region: region(offset, extent),
        perm: None,
        strides: strides.to_vec(),
    }
}

/// A 4x8 tensor of 4-byte elements offered whole by rank 0 and needed whole by rank 1.
fn simple() -> Table {
    Table {
        tensors: vec![spec("w", 4, &[4, 8])],
        offers: vec![offer(0, 0, 0x1000, &[0, 0], &[4, 8])],
        needs: vec![need(0, 1, 0x8000, &[0, 0], &[4, 8], &[8, 1])],
        quant_needs: Vec::new(),
        shared_amax: Vec::new(),
    }
}

fn plan(tables: &[Table]) -> Result<Plan, Error> {
    build(tables, &PlanOptions::default())
}

fn fails(tables: &[Table], status: Status, words: &[&str]) {
    let err = plan(tables).expect_err("planning should fail");
    assert_eq!(err.status, status, "{err}");
    for w in words {
        assert!(err.message.contains(w), "message {:?} lacks {w:?}", err.message);
    }
}

#[test]
fn a_tensor_described_two_ways_is_a_tensor_mismatch_naming_both_values() {
    let mut other = simple();
    other.offers.clear();
    other.needs.clear();
    other.tensors[0].shape = vec![4, 9];
    fails(&[simple(), other.clone()], Status::TensorMismatch, &["'w'", "[4, 8]", "[4, 9]"]);
    other.tensors[0] = spec("w", 2, &[4, 8]);
    fails(&[simple(), other.clone()], Status::TensorMismatch, &["'w'", "element size 4", "2"]);
    other.tensors[0] = TensorSpec { dtype: 9, ..spec("w", 4, &[4, 8]) };
    fails(&[simple(), other], Status::TensorMismatch, &["'w'", "dtype 1", "9"]);
}

#[test]
fn boxes_outside_the_tensor_or_of_the_wrong_rank_are_tensor_mismatches() {
    let mut t = simple();
    t.offers[0].region = region(&[1, 0], &[4, 8]);
    fails(&[t], Status::TensorMismatch, &["outside tensor 'w'"]);
    let mut t = simple();
    t.needs[0].region = region(&[0], &[4]);
    fails(&[t], Status::TensorMismatch, &["2 dimensions"]);
    let mut t = simple();
    t.needs[0].region = region(&[u64::MAX, 0], &[2, 8]);
    fails(&[t], Status::TensorMismatch, &["outside"]);
}

#[test]
fn malformed_entries_are_invalid_arguments() {
    let mut t = simple();
    t.offers[0].tensor = 3;
    fails(&[t], Status::InvalidArgument, &["tensor index 3", "1 tensors"]);
    let mut t = simple();
    t.needs[0].strides = vec![1];
    fails(&[t], Status::InvalidArgument, &["1 destination strides"]);
    let mut t = simple();
    t.offers[0].strides = Some(vec![1, 2, 3]);
    fails(&[t], Status::InvalidArgument, &["3 strides"]);
    let mut t = simple();
    t.needs[0].perm = Some(vec![1, 1]);
    fails(&[t], Status::InvalidArgument, &["not a permutation"]);
    let mut t = simple();
    t.needs[0].perm = Some(vec![0, 2]);
    fails(&[t], Status::InvalidArgument, &["not a permutation"]);
    let mut t = simple();
    t.offers[0].addr = u64::MAX - 100;
    fails(&[t], Status::InvalidArgument, &["address space"]);
    let mut t = simple();
    t.needs[0].strides = vec![u64::MAX / 2, 1];
    fails(&[t], Status::InvalidArgument, &["address space"]);
    let mut t = simple();
    t.tensors[0].elem_size = 0;
    fails(&[t], Status::InvalidArgument, &["element size 0"]);
    let mut t = simple();
    t.tensors[0].shape = vec![1; 9];
    fails(&[t], Status::InvalidArgument, &["9 dimensions"]);
    let mut t = simple();
    t.tensors[0].name.clear();
    fails(&[t], Status::InvalidArgument, &["empty name"]);
    let mut t = simple();
    t.tensors[0].shape = vec![u64::MAX, 4];
    fails(&[t], Status::InvalidArgument, &["2^64"]);
}

#[test]
fn replicas_with_different_digests_fail_and_name_the_box() {
    let mut t = simple();
    t.offers[0].digest = Some(1);
    t.offers.push(Offer { owner: at(2), addr: 0x5000, digest: Some(2), ..t.offers[0].clone() });
    fails(&[t.clone()], Status::ReplicaMismatch, &["'w'", "offset [0, 0]", "process 0", "process 2"]);
    // A replica without a digest is not a mismatch; equal digests are not either.
    t.offers[1].digest = None;
    assert!(plan(&[t.clone()]).is_ok());
    t.offers[1].digest = Some(1);
    let p = plan(&[t]).unwrap();
    assert_eq!((p.stats().offers_in, p.stats().offers_kept, p.stats().replica_sets), (2, 1, 1));
}

#[test]
fn uncovered_bytes_are_a_coverage_gap_naming_the_first_uncovered_region() {
    let mut t = simple();
    // Rows 0..2 and the left half of rows 2..4 are offered; the right half of rows 2..4 is not.
    t.offers = vec![offer(0, 0, 0x1000, &[0, 0], &[2, 8]), offer(0, 0, 0x2000, &[2, 0], &[2, 4])];
    fails(&[t.clone()], Status::CoverageGap, &["'w'", "process 1 device 0", "offset [2, 4] extent [2, 4]"]);
    t.offers.clear();
    fails(&[t], Status::CoverageGap, &["offset [0, 0] extent [4, 8]"]);
}

#[test]
fn needs_writing_the_same_bytes_overlap() {
    // Two needs of different tensors at overlapping destinations.
    let mut t = simple();
    t.tensors.push(spec("v", 4, &[8]));
    t.offers.push(offer(1, 0, 0x3000, &[0], &[8]));
    t.needs.push(need(1, 1, 0x8000 + 120, &[0], &[8], &[1]));
    fails(&[t.clone()], Status::Overlap, &["process 1 device 0", "'w'", "'v'"]);
    // The same addresses on another receiver are another memory: no overlap.
    t.needs[1].receiver = at(2);
    assert!(plan(&[t]).is_ok());
    // One need whose strides alias its own elements.
    let mut t = simple();
    t.needs[0].strides = vec![4, 1];
    fails(&[t.clone()], Status::Overlap, &["'w'"]);
    t.needs[0].strides = vec![0, 1];
    fails(&[t], Status::Overlap, &["'w'"]);
}

#[test]
fn interleaved_destinations_that_do_not_overlap_are_planned() {
    // Column halves of one tensor written into the two halves of each row of one buffer (their byte
    // spans interleave, so the planner has to look inside them), and transposed strides that nest.
    let mut t = simple();
    t.needs =
        vec![need(0, 1, 0x8000, &[0, 0], &[4, 4], &[8, 1]), need(0, 1, 0x8010, &[0, 4], &[4, 4], &[8, 1])];
    let p = plan(&[t.clone()]).unwrap();
    assert_eq!(p.stats().needed_bytes, 128);
    assert_eq!(p.stats().ranges_coalesced, 1, "{:?}", p.routes());
    // Shifting the second half left by one element makes the halves collide (another frame, so
    // the planner expands both into runs to find it).
    t.needs[1].addr -= 4;
    fails(&[t.clone()], Status::Overlap, &["'w'"]);
    // The same frame with intersecting boxes is settled by box arithmetic.
    t.needs[1] = need(0, 1, 0x8008, &[0, 2], &[4, 4], &[8, 1]);
    fails(&[t.clone()], Status::Overlap, &["offset [0, 0]", "offset [0, 2]"]);
    // A frame whose rows are too short for the boxes it holds aliases (row stride 6 < 8 columns).
    t.needs =
        vec![need(0, 1, 0x8000, &[0, 0], &[4, 4], &[6, 1]), need(0, 1, 0x8010, &[0, 4], &[4, 4], &[6, 1])];
    fails(&[t], Status::Overlap, &["'w'"]);
}

#[test]
fn overlapping_offers_are_read_once() {
    // 1-D tensor of 10 bytes; offers [0, 6) and [4, 10) overlap on [4, 6).
    let t = Table {
        tensors: vec![spec("x", 1, &[10])],
        offers: vec![offer(0, 0, 0x100, &[0], &[6]), offer(0, 1, 0x200, &[4], &[6])],
        needs: vec![need(0, 2, 0x900, &[0], &[10], &[1])],
        quant_needs: Vec::new(),
        shared_amax: Vec::new(),
    };
    for policy in [OwnerPolicy::First, OwnerPolicy::Local, OwnerPolicy::Balanced] {
        let p = build(std::slice::from_ref(&t), &PlanOptions { policy, coalesce: true }).unwrap();
        let mut runs = vec![];
        for r in p.routes() {
            for s in &r.segments {
                s.for_each_run(|src, dst, len| runs.push((dst, src, len, r.src.process)));
            }
        }
        runs.sort_unstable();
        assert_eq!(runs, vec![(0x900, 0x100, 6, 0), (0x906, 0x202, 4, 1)], "{policy:?}");
        assert_eq!(p.stats().bytes_all_replicas, 12);
        assert_eq!(p.stats().duplicate_bytes_dropped, 2);
    }
}

#[test]
fn transposed_destination_with_a_permutation() {
    // w is 2x3 (1-byte elements) at 0x100 row-major; the receiver wants its transpose (3x2).
    let mut t = Table {
        tensors: vec![spec("w", 1, &[2, 3])],
        offers: vec![offer(0, 0, 0x100, &[0, 0], &[2, 3])],
        needs: vec![Need { perm: Some(vec![1, 0]), ..need(0, 1, 0x900, &[0, 0], &[2, 3], &[2, 1]) }],
        quant_needs: Vec::new(),
        shared_amax: Vec::new(),
    };
    let p = plan(std::slice::from_ref(&t)).unwrap();
    let mut map = vec![];
    for r in p.routes() {
        for s in &r.segments {
            s.for_each_run(|src, dst, len| map.extend((0..len).map(|b| (dst + b - 0x900, src + b - 0x100))));
        }
    }
    map.sort_unstable();
    // Destination (i, j) = source (j, i): dst i*2 + j <- src j*3 + i.
    assert_eq!(map, vec![(0, 0), (1, 3), (2, 1), (3, 4), (4, 2), (5, 5)]);
    // An empty need plans to nothing.
    t.needs[0].region = region(&[0, 0], &[0, 3]);
    let p = plan(&[t]).unwrap();
    assert!(p.routes().is_empty());
    assert_eq!(p.stats().needs, 1);
}

#[test]
fn limits_turn_pathological_tables_into_statuses() {
    // A 3-d transpose of 1-byte elements: 8192 one-byte runs, two segments of two levels each.
    let t = Table {
        tensors: vec![spec("w", 1, &[64, 64, 2])],
        offers: vec![offer(0, 0, 0x10000, &[0, 0, 0], &[64, 64, 2])],
        needs: vec![Need {
            perm: Some(vec![2, 1, 0]),
            ..need(0, 1, 0x90000, &[0, 0, 0], &[64, 64, 2], &[4096, 64, 1])
        }],
        quant_needs: Vec::new(),
        shared_amax: Vec::new(),
    };
    let options = PlanOptions::default();
    assert!(build_with_limits(std::slice::from_ref(&t), &options, &Limits::default()).is_ok());
    let tight = Limits { max_segments: 1, ..Limits::default() };
    let err = build_with_limits(std::slice::from_ref(&t), &options, &tight).unwrap_err();
    assert_eq!(err.status, Status::OutOfMemory);
    // Interleaved destinations of different frames need their runs expanded; too many is
    // UNSUPPORTED, not a hang. (w's left half and all of v, 4 columns each, in rows of 8.)
    let mut halves = simple();
    halves.tensors.push(spec("v", 4, &[4, 4]));
    halves.offers.push(offer(1, 0, 0x3000, &[0, 0], &[4, 4]));
    halves.needs =
        vec![need(0, 1, 0x8000, &[0, 0], &[4, 4], &[8, 1]), need(1, 1, 0x8010, &[0, 0], &[4, 4], &[8, 1])];
    assert!(build_with_limits(std::slice::from_ref(&halves), &options, &Limits::default()).is_ok());
    let tight = Limits { max_overlap_runs: 3, ..Limits::default() };
    assert_eq!(build_with_limits(&[halves], &options, &tight).unwrap_err().status, Status::Unsupported);
    // Overlapping offers split into too many pieces.
    let mut overlapping = simple();
    overlapping.offers.push(offer(0, 1, 0x5000, &[0, 0], &[2, 2]));
    let tight = Limits { max_pieces: 2, ..Limits::default() };
    assert_eq!(build_with_limits(&[overlapping], &options, &tight).unwrap_err().status, Status::Unsupported);
}

#[test]
fn table_builders_check_entries_as_they_are_added() {
    let mut t = TableBuilder::new();
    let w = t.add_tensor(spec("w", 4, &[4, 8])).unwrap();
    assert_eq!(t.add_tensor(spec("w", 4, &[4, 8])).unwrap(), w);
    assert_eq!(t.add_tensor(spec("w", 2, &[4, 8])).unwrap_err().status, Status::TensorMismatch);
    assert_eq!(t.add_tensor(spec("", 2, &[4, 8])).unwrap_err().status, Status::InvalidArgument);
    assert_eq!(t.add_offer(offer(5, 0, 0, &[0, 0], &[4, 8])).unwrap_err().status, Status::InvalidArgument);
    assert_eq!(t.add_offer(offer(w, 0, 0, &[0, 0], &[5, 8])).unwrap_err().status, Status::TensorMismatch);
    t.add_offer(offer(w, 0, 0x100, &[0, 0], &[4, 8])).unwrap();
    let bad_perm = Need { perm: Some(vec![0]), ..need(w, 1, 0x900, &[0, 0], &[4, 8], &[8, 1]) };
    assert_eq!(t.add_need(bad_perm).unwrap_err().status, Status::InvalidArgument);
    t.add_need(need(w, 1, 0x900, &[0, 0], &[4, 8], &[8, 1])).unwrap();
    let t = t.into_table();
    assert_eq!((t.tensors.len(), t.offers.len(), t.needs.len()), (1, 1, 1));
    assert_eq!(plan(&[t]).unwrap().stats().needed_bytes, 128);
}

#[test]
fn needs_whose_bounding_box_overflows_the_address_space_still_overlap() {
    // Issue 14 item 1: two one-element needs at the same address, boxes {0,4} and {4,0}, strides
    // 2^62. Each need alone fits; the bounding box of the pair does not, and the proof that its
    // strides keep elements apart overflowed and said "disjoint".
    let t = Table {
        tensors: vec![spec("w", 2, &[8, 8])],
        offers: vec![offer(0, 0, 0x1000, &[0, 0], &[8, 8])],
        needs: vec![
            need(0, 1, 0x9000, &[0, 4], &[1, 1], &[1 << 62, 1 << 62]),
            need(0, 1, 0x9000, &[4, 0], &[1, 1], &[1 << 62, 1 << 62]),
        ],
        quant_needs: Vec::new(),
        shared_amax: Vec::new(),
    };
    fails(&[t], Status::Overlap, &["0x9000", "'w'"]);
}

#[test]
fn a_share_checks_its_own_needs_and_every_table_entry() {
    // Process 1 needs rows nobody offers; process 2's needs are covered.
    let mut t = simple();
    t.offers = vec![offer(0, 0, 0x1000, &[0, 0], &[2, 8])];
    t.needs =
        vec![need(0, 1, 0x8000, &[0, 0], &[4, 8], &[8, 1]), need(0, 2, 0x8000, &[0, 0], &[2, 8], &[8, 1])];
    let (options, limits) = (PlanOptions::default(), Limits::default());
    let share = |t: &Table, p: u32| build_share(&[t], p, &options, &limits);
    assert_eq!(share(&t, 1).unwrap_err().status, Status::CoverageGap);
    let p2 = share(&t, 2).unwrap();
    assert_eq!(p2.stats().needed_bytes, 64);
    // Process 0 publishes to both: its share holds both routes, though process 1's need is not
    // covered (process 1 reports that).
    let p0 = share(&t, 0).unwrap();
    assert_eq!(p0.routes().len(), 2);
    assert_eq!(p0.receivers().count(), 0);
    // Entries are checked in every share, whoever they belong to: every process fails alike.
    let mut bad = t.clone();
    bad.needs[1].perm = Some(vec![0, 0]);
    for p in 0..3 {
        assert_eq!(share(&bad, p).unwrap_err().status, Status::InvalidArgument, "process {p}");
    }
}
