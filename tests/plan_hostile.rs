//! Tables a hostile or careless caller might pass: sizes that made planning quadratic (tens of
//! thousands of one-element offers and needs, tens of thousands of tensors), overlaps that cut
//! offers into too many pieces, and extreme addresses and strides. Planning must either succeed
//! with exactly the right bytes or fail with a specific status; never panic (debug builds check
//! every arithmetic operation) and never run for long. Timings are in benches/plan_bench.rs.

#[path = "common/xorshift.rs"]
mod xorshift;

use refit::plan::{
    build, build_with_limits, Endpoint, Limits, Need, Offer, Plan, PlanOptions, Region, Table, TableBuilder,
    TensorSpec,
};
use refit::Status;
use std::collections::BTreeMap;
use xorshift::Rng;

const COUNT: u64 = 40_000;

fn at(process: u32) -> Endpoint {
    Endpoint { process, device: 0 }
}

fn spec(name: &str, elem_size: u32, shape: &[u64]) -> TensorSpec {
    TensorSpec { name: name.into(), dtype: 0, elem_size, shape: shape.to_vec() }
}

fn region(offset: &[u64], extent: &[u64]) -> Region {
    Region { offset: offset.to_vec(), extent: extent.to_vec() }
}

/// The source byte of every destination byte the plan writes, per receiver; fails on a byte
/// written twice.
fn sources_of(plan: &Plan) -> BTreeMap<(Endpoint, u64), (Endpoint, u64)> {
    let mut map = BTreeMap::new();
    for r in plan.routes() {
        for s in &r.segments {
            s.for_each_run(|src, dst, len| {
                for b in 0..len {
                    assert!(
                        map.insert((r.dst, dst + b), (r.src, src + b)).is_none(),
                        "byte {:#x} twice",
                        dst + b
                    );
                }
            });
        }
    }
    map
}

/// A 1-D tensor of `COUNT` 2-byte elements, each element offered on its own by process 0 at a
/// scattered address (element `i` at `0x100_0000 + 8 * ((i * 7919) % COUNT)`).
fn one_element_offers() -> Table {
    let mut t = Table { tensors: vec![spec("x", 2, &[COUNT])], ..Table::default() };
    for i in 0..COUNT {
        t.offers.push(Offer {
            tensor: 0,
            owner: at(0),
            addr: offer_addr(i),
            region: region(&[i], &[1]),
            strides: None,
            digest: None,
        });
    }
    t
}

fn offer_addr(i: u64) -> u64 {
    0x100_0000 + 8 * ((i * 7919) % COUNT)
}

#[test]
fn forty_thousand_one_element_offers_serve_one_need() {
    let mut t = one_element_offers();
    t.needs.push(Need {
        tensor: 0,
        receiver: at(1),
        addr: 0x900_0000,
        region: region(&[0], &[COUNT]),
        perm: None,
        strides: vec![1],
    });
    let plan = build(&[t], &PlanOptions::default()).unwrap();
    let map = sources_of(&plan);
    assert_eq!(map.len() as u64, 2 * COUNT);
    for i in [0, 1, 2, COUNT / 2, COUNT - 1] {
        for b in 0..2 {
            assert_eq!(map[&(at(1), 0x900_0000 + 2 * i + b)], (at(0), offer_addr(i) + b));
        }
    }
    assert_eq!(plan.stats().replica_sets, COUNT);
}

#[test]
fn forty_thousand_one_element_offers_serve_forty_thousand_needs() {
    let mut t = one_element_offers();
    // Need i takes element (i * 104729) % COUNT into its own 2 bytes, in a shuffled order.
    for i in 0..COUNT {
        let element = (i * 104_729) % COUNT;
        t.needs.push(Need {
            tensor: 0,
            receiver: at(1 + (i % 3) as u32),
            addr: 0x900_0000 + 2 * i,
            region: region(&[element], &[1]),
            perm: None,
            strides: vec![1],
        });
    }
    let plan = build(&[t], &PlanOptions::default()).unwrap();
    let map = sources_of(&plan);
    assert_eq!(map.len() as u64, 2 * COUNT);
    for i in (0..COUNT).step_by(997) {
        let element = (i * 104_729) % COUNT;
        let receiver = at(1 + (i % 3) as u32);
        assert_eq!(map[&(receiver, 0x900_0000 + 2 * i + 1)], (at(0), offer_addr(element) + 1));
    }
    assert_eq!(plan.stats().needs, COUNT);
}

#[test]
fn eighty_thousand_tensors_are_found_by_name() {
    let mut builder = TableBuilder::new();
    let names: Vec<String> =
        (0..80_000).map(|i| format!("model.layers.{}.mlp.experts.{}.w", i / 384, i % 384)).collect();
    for (i, name) in names.iter().enumerate() {
        assert_eq!(builder.add_tensor(spec(name, 2, &[4, 4])).unwrap(), i as u32);
    }
    // Again, in reverse: the same indices; a differing description names the mismatch.
    for (i, name) in names.iter().enumerate().rev() {
        assert_eq!(builder.add_tensor(spec(name, 2, &[4, 4])).unwrap(), i as u32);
    }
    let err = builder.add_tensor(spec(&names[41_234], 2, &[4, 5])).unwrap_err();
    assert_eq!(err.status, Status::TensorMismatch);
    assert!(err.message.contains(&names[41_234]), "{err}");
    // A table continued after decoding knows its names too.
    let mut decoded = TableBuilder::from(builder.into_table());
    assert_eq!(decoded.add_tensor(spec(&names[79_999], 2, &[4, 4])).unwrap(), 79_999);
    assert_eq!(decoded.add_tensor(spec("new", 2, &[4])).unwrap(), 80_000);
}

/// Process 0 offers the even columns of a square tensor whole; process 1 offers every row. Row 0
/// comes first in canonical order (the lowest corner, then the shortest extent) and keeps its
/// bytes; every later row is cut by every even column into `side / 2` pieces: about `side^2 / 2`
/// pieces in all, each cut costing work that grows with the pieces already cut from its row.
fn combs(side: u64) -> Table {
    let mut t = Table { tensors: vec![spec("w", 1, &[side, side])], ..Table::default() };
    for j in (0..side).step_by(2) {
        let strides = Some(vec![1, side]);
        t.offers.push(Offer {
            tensor: 0,
            owner: at(0),
            addr: 0x10_0000 + j * side,
            region: region(&[0, j], &[side, 1]),
            strides,
            digest: None,
        });
    }
    for i in 0..side {
        t.offers.push(Offer {
            tensor: 0,
            owner: at(1),
            addr: 0x80_0000 + i * side,
            region: region(&[i, 0], &[1, side]),
            strides: None,
            digest: None,
        });
    }
    t
}

#[test]
fn overlaps_beyond_the_limits_are_unsupported_and_name_the_limit() {
    let options = PlanOptions::default();
    // Within the default limits: planned, and the pieces hold every offered byte once.
    let mut small = combs(64);
    small.needs.push(Need {
        tensor: 0,
        receiver: at(2),
        addr: 0x900_0000,
        region: region(&[0, 0], &[64, 64]),
        perm: None,
        strides: vec![64, 1],
    });
    let plan = build(std::slice::from_ref(&small), &options).unwrap();
    let map = sources_of(&plan);
    assert_eq!(map.len(), 64 * 64);
    // Even columns from process 0 below row 0; row 0 and the odd columns from process 1.
    assert_eq!(map[&(at(2), 0x900_0000 + 64 * 5 + 4)], (at(0), 0x10_0000 + 4 * 64 + 5));
    assert_eq!(map[&(at(2), 0x900_0000 + 64 * 5 + 3)], (at(1), 0x80_0000 + 5 * 64 + 3));
    assert_eq!(map[&(at(2), 0x900_0000 + 4)], (at(1), 0x80_0000 + 4));
    assert_eq!(plan.stats().replica_sets, 32 + 64);
    let big = combs(2048);
    for (limits, name) in [
        (Limits { max_box_tests: 1 << 20, ..Limits::default() }, "max_box_tests"),
        (Limits { max_pieces: 10_000, ..Limits::default() }, "max_pieces"),
    ] {
        let err = build_with_limits(std::slice::from_ref(&big), &options, &limits).unwrap_err();
        assert_eq!(err.status, Status::Unsupported, "{err}");
        assert!(err.message.contains(name) && err.message.contains("'w'"), "{err}");
    }
}

/// Every element index of a box, in row-major order.
fn elements(lo: &[u64], ext: &[u64]) -> Vec<Vec<u64>> {
    let mut out = vec![lo.to_vec()];
    for d in (0..lo.len()).rev() {
        out = out
            .into_iter()
            .flat_map(|x| {
                (0..ext[d]).map(move |i| {
                    let mut y = x.clone();
                    y[d] += i;
                    y
                })
            })
            .collect();
    }
    out
}

/// Random small tables whose addresses, strides and shapes are extreme: each plan either fails
/// with a status or writes every needed byte exactly once from the right place.
#[test]
fn extreme_addresses_and_strides_never_wrap() {
    let mut planned = 0;
    for seed in 0..3000u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let n = 1 + rng.below(3) as usize;
        let shape: Vec<u64> = (0..n).map(|_| 1 + rng.below(4)).collect();
        let elem = [1u32, 2, 8][rng.below(3) as usize];
        let whole = region(&vec![0; n], &shape);
        let mut t = Table { tensors: vec![spec("w", elem, &shape)], ..Table::default() };
        let strides = |rng: &mut Rng| (0..n).map(|_| rng.extreme()).collect::<Vec<u64>>();
        t.offers.push(Offer {
            tensor: 0,
            owner: at(0),
            addr: rng.extreme(),
            region: whole.clone(),
            strides: (rng.below(2) == 0).then(|| strides(&mut rng)),
            digest: None,
        });
        for _ in 0..1 + rng.below(3) {
            let lo: Vec<u64> = shape.iter().map(|&d| rng.below(d)).collect();
            let ext: Vec<u64> = shape.iter().zip(&lo).map(|(&d, &l)| 1 + rng.below(d - l)).collect();
            t.needs.push(Need {
                tensor: 0,
                receiver: at(1),
                addr: rng.extreme(),
                region: region(&lo, &ext),
                perm: None,
                strides: strides(&mut rng),
            });
        }
        let Ok(plan) = build(std::slice::from_ref(&t), &PlanOptions::default()) else {
            continue;
        };
        planned += 1;
        // Every needed element lands at its destination address from its source address,
        // computed here in 128 bits.
        let map = sources_of(&plan);
        let offer = &t.offers[0];
        let offer_strides = offer
            .strides
            .clone()
            .unwrap_or_else(|| (0..n).map(|d| shape[d + 1..].iter().product::<u64>()).collect::<Vec<u64>>());
        let mut needed = 0u64;
        for need in &t.needs {
            for index in elements(&need.region.offset, &need.region.extent) {
                let place = |base: u64, corner: &[u64], strides: &[u64]| -> u128 {
                    let elements: u128 =
                        (0..n).map(|d| u128::from(index[d] - corner[d]) * u128::from(strides[d])).sum();
                    u128::from(base) + elements * u128::from(elem)
                };
                let dst = place(need.addr, &need.region.offset, &need.strides);
                let src = place(offer.addr, &offer.region.offset, &offer_strides);
                for b in 0..u128::from(elem) {
                    let d = u64::try_from(dst + b).expect("a planned destination fits in 64 bits");
                    let s = u64::try_from(src + b).expect("a planned source fits in 64 bits");
                    assert_eq!(map.get(&(at(1), d)), Some(&(at(0), s)), "seed {seed}");
                }
                needed += u64::from(elem);
            }
        }
        assert_eq!(map.len() as u64, needed, "seed {seed}: bytes written that no need asked for");
    }
    assert!(planned > 300, "only {planned} plans succeeded: the test explores too little");
}

#[test]
fn many_needs_of_a_scalar_at_one_address_overlap() {
    // Found by the plan fuzz target: a 0-dimensional tensor has one box, so more needs of it at one
    // address than a leaf of the box index holds left the index nothing to split on.
    let mut t = Table { tensors: vec![spec("s", 4, &[])], ..Table::default() };
    t.offers.push(Offer {
        tensor: 0,
        owner: at(0),
        addr: 0x100,
        region: region(&[], &[]),
        strides: None,
        digest: None,
    });
    let need = |addr| Need {
        tensor: 0,
        receiver: at(1),
        addr,
        region: region(&[], &[]),
        perm: None,
        strides: vec![],
    };
    for addr in [|_: u64| 0x1000u64, |i: u64| 0x1000 + 2 * i] {
        t.needs = (0..20).map(|i| need(addr(i))).collect();
        let err = build(std::slice::from_ref(&t), &PlanOptions::default()).unwrap_err();
        assert_eq!(err.status, Status::Overlap, "{err}");
    }
    // Apart, they plan: each gets the scalar's 4 bytes.
    t.needs = (0..20).map(|i| need(0x1000 + 4 * i)).collect();
    let plan = build(std::slice::from_ref(&t), &PlanOptions::default()).unwrap();
    let map = sources_of(&plan);
    assert_eq!(map.len(), 80);
    assert_eq!(map[&(at(1), 0x1000 + 4 * 19 + 3)], (at(0), 0x103));
}

#[test]
fn a_share_of_tables_that_repeat_another_processs_need_ends() {
    // The same table passed twice: process 1's need appears twice. Process 1's own share refuses
    // the overlap; the sending process's share plans the route without checking process 1's needs,
    // and coalescing its duplicate segments once looped forever.
    let mut t = Table::default();
    t.tensors.push(spec("w", 1, &[]));
    let (offer, need) = (
        |p, addr| Offer {
            tensor: 0,
            owner: at(p),
            addr,
            region: region(&[], &[]),
            strides: None,
            digest: None,
        },
        0x2e00,
    );
    t.needs.push(Need {
        tensor: 0,
        receiver: at(1),
        addr: need,
        region: region(&[], &[]),
        perm: None,
        strides: vec![],
    });
    t.offers.extend([offer(0, 0x1000), offer(1, 0x3800)]);
    let options = PlanOptions { policy: refit::plan::OwnerPolicy::First, coalesce: true };
    let sender = refit::plan::build_share(&[&t, &t], 0, &options, &Limits::default()).unwrap();
    let segments: Vec<_> = sender.routes().iter().flat_map(|r| r.segments.iter()).collect();
    assert!(!segments.is_empty() && segments.iter().all(|s| s.dst == need && s.len == 1), "{segments:?}");
    let receiver = refit::plan::build_share(&[&t, &t], 1, &options, &Limits::default()).unwrap_err();
    assert_eq!(receiver.status, Status::Overlap, "{}", receiver.message);
}
