//! Property tests of the planner against an independent per-element reference, on small random
//! tables: random shards (uneven splits), replicas on several endpoints, overlapping offers, padded
//! and permuted layouts, transposed and fused destinations, tables and entries in any order.
//!
//! The reference does not plan: it writes every needed element straight from the tensor's logical
//! contents into simulated receiver memory. The plan under test is executed byte by byte from
//! simulated publisher memory (holes filled with garbage, so reading an unneeded byte shows), and
//! both memories must match exactly, with every needed byte written once.

#[path = "common/xorshift.rs"]
mod xorshift;

use refit::plan::{
    build, build_share, Endpoint, Need, Offer, OwnerPolicy, Plan, PlanOptions, PlanStats, Region, Route,
    Table, TensorSpec,
};
use std::collections::BTreeMap;
use xorshift::Rng;

/// The byte every replica holds for byte `b` of element `index` of tensor `name`.
fn logical(name: &str, index: u64, b: u64) -> u8 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for x in name.bytes().map(u64::from).chain([index, b]) {
        h = (h ^ x).wrapping_mul(0x100_0000_01b3);
    }
    (h >> 29) as u8
}

const BASE: u64 = 0x1000;
const POISON: u8 = 0xEE;
const HOLE: u8 = 0xAB;

/// Simulated memory: one arena per endpoint, addresses from BASE.
#[derive(Default, Clone, PartialEq, Debug)]
struct Memory(BTreeMap<Endpoint, Vec<u8>>);

impl Memory {
    fn alloc(&mut self, at: Endpoint, bytes: u64, fill: u8) -> u64 {
        let arena = self.0.entry(at).or_default();
        let addr = BASE + arena.len() as u64;
        arena.resize(arena.len() + bytes as usize + 1 + (addr % 3) as usize, fill);
        addr
    }
    fn byte(&mut self, at: Endpoint, addr: u64) -> &mut u8 {
        &mut self.0.get_mut(&at).expect("arena")[(addr - BASE) as usize]
    }
}

struct Spec {
    name: String,
    elem: u64,
    shape: Vec<u64>,
}

/// Every element index of a box, in row-major order.
fn elements(lo: &[u64], ext: &[u64]) -> Vec<Vec<u64>> {
    let mut out = vec![];
    if ext.contains(&0) {
        return out;
    }
    let mut x = lo.to_vec();
    loop {
        out.push(x.clone());
        let mut d = lo.len();
        loop {
            if d == 0 {
                return out;
            }
            d -= 1;
            x[d] += 1;
            if x[d] < lo[d] + ext[d] {
                break;
            }
            x[d] = lo[d];
        }
    }
}

fn linear(shape: &[u64], x: &[u64]) -> u64 {
    x.iter().zip(shape).fold(0, |acc, (&i, &n)| acc * n + i)
}

/// Splits `0..n` into 1..=parts uneven, nonempty chunks.
fn chunks(rng: &mut Rng, n: u64, parts: u64) -> Vec<(u64, u64)> {
    let mut cuts: Vec<u64> =
        (0..rng.below(parts)).map(|_| 1 + rng.below(n.max(2) - 1)).filter(|&c| c < n).collect();
    cuts.extend([0, n]);
    cuts.sort_unstable();
    cuts.dedup();
    cuts.windows(2).map(|w| (w[0], w[1] - w[0])).collect()
}

fn grid(rng: &mut Rng, shape: &[u64], parts: u64) -> Vec<(Vec<u64>, Vec<u64>)> {
    let mut boxes = vec![(vec![], vec![])];
    for &n in shape {
        let cs = chunks(rng, n, parts);
        boxes = boxes
            .into_iter()
            .flat_map(|(lo, ext): (Vec<u64>, Vec<u64>)| {
                cs.iter().map(move |&(o, e)| {
                    let (mut l, mut x) = (lo.clone(), ext.clone());
                    l.push(o);
                    x.push(e);
                    (l, x)
                })
            })
            .collect();
    }
    boxes
}

/// Strides for `ext`: row-major over a dimension order, sometimes with padding (in elements).
fn strides(rng: &mut Rng, ext: &[u64], shuffle: bool) -> Vec<u64> {
    let mut order: Vec<usize> = (0..ext.len()).collect();
    if shuffle {
        rng.shuffle(&mut order);
    }
    let mut s = vec![0; ext.len()];
    let mut step = 1;
    for &d in order.iter().rev() {
        s[d] = step;
        step = step * ext[d] + if rng.chance(25) { rng.below(3) } else { 0 };
    }
    s
}

fn row_major(ext: &[u64]) -> Vec<u64> {
    let mut s = vec![1; ext.len()];
    for d in (0..ext.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * ext[d + 1];
    }
    s
}

fn span(ext: &[u64], strides: &[u64]) -> u64 {
    if ext.contains(&0) {
        return 0;
    }
    ext.iter().zip(strides).map(|(e, s)| (e - 1) * s).sum::<u64>() + 1
}

/// A random problem: tables, the publishers' memory, the receivers' memory (poisoned) and what
/// the receivers' memory must hold afterwards.
struct Case {
    tables: Vec<Table>,
    sources: Memory,
    poisoned: Memory,
    expected: Memory,
    needed_bytes: u64,
}

/// A need not yet placed: offset, extent, permutation, destination strides, bytes spanned.
type Pending = (Vec<u64>, Vec<u64>, Vec<u32>, Vec<u64>, u64);

fn endpoint(rng: &mut Rng) -> Endpoint {
    Endpoint { process: rng.below(3) as u32, device: rng.below(2) as u32 }
}

fn random_case(seed: u64) -> Case {
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let specs: Vec<Spec> = (0..1 + rng.below(4))
        .map(|t| Spec {
            name: format!("layer.{t}.weight"),
            elem: [1, 2, 4][rng.below(3) as usize],
            shape: (0..1 + rng.below(3)).map(|_| 1 + rng.below(6)).collect(),
        })
        .collect();
    let mut sources = Memory::default();
    let mut poisoned = Memory::default();
    let mut expected = Memory::default();
    let mut offers: Vec<(usize, Offer)> = vec![];
    let mut needs: Vec<(usize, Need)> = vec![];
    let mut needed_bytes = 0;
    for (t, spec) in specs.iter().enumerate() {
        let n = spec.shape.len();
        let mut boxes = grid(&mut rng, &spec.shape, 3);
        if rng.chance(30) {
            // An offer overlapping others without being identical to any.
            let lo: Vec<u64> = spec.shape.iter().map(|&d| rng.below(d)).collect();
            let ext: Vec<u64> = spec.shape.iter().zip(&lo).map(|(&d, &l)| 1 + rng.below(d - l)).collect();
            boxes.push((lo, ext));
        }
        for (lo, ext) in boxes {
            let digest = rng.chance(50).then(|| linear(&spec.shape, &lo) ^ 0x5eed);
            for _ in 0..1 + rng.below(3) {
                let owner = endpoint(&mut rng);
                let shuffle = rng.chance(30);
                let st = strides(&mut rng, &ext, shuffle);
                let addr = sources.alloc(owner, span(&ext, &st) * spec.elem, HOLE);
                for x in elements(&lo, &ext) {
                    let off: u64 = (0..n).map(|d| (x[d] - lo[d]) * st[d]).sum();
                    for b in 0..spec.elem {
                        *sources.byte(owner, addr + off * spec.elem + b) =
                            logical(&spec.name, linear(&spec.shape, &x), b);
                    }
                }
                let row_major = st == row_major(&ext) && !rng.chance(20);
                let region = Region { offset: lo.clone(), extent: ext.clone() };
                offers.push((
                    t,
                    Offer { tensor: 0, owner, addr, region, strides: (!row_major).then_some(st), digest },
                ));
            }
        }
    }
    // Needs: per receiver, some tensors, cut into boxes; each box lands in one fused buffer per
    // (receiver, tensor) or its own buffer, permuted and padded at random.
    for _ in 0..1 + rng.below(3) {
        let receiver = endpoint(&mut rng);
        for (t, spec) in specs.iter().enumerate() {
            if rng.chance(30) {
                continue;
            }
            let n = spec.shape.len();
            // Three ways to lay destinations out: each box in its own allocation, boxes back to back
            // in one fused buffer, or every box at its place in one buffer holding the whole tensor
            // (so the boxes' bytes interleave).
            let mode = rng.below(3);
            let mut pending: Vec<Pending> = vec![];
            let mut whole_perm: Vec<u32> = (0..n as u32).collect();
            if rng.chance(30) {
                rng.shuffle(&mut whole_perm);
            }
            let whole_shape: Vec<u64> = whole_perm.iter().map(|&p| spec.shape[p as usize]).collect();
            let whole_strides = strides(&mut rng, &whole_shape, false);
            for (lo, ext) in grid(&mut rng, &spec.shape, 2) {
                if rng.chance(20) {
                    continue;
                }
                if mode == 2 {
                    pending.push((lo, ext, whole_perm.clone(), whole_strides.clone(), 0));
                    continue;
                }
                let mut perm: Vec<u32> = (0..n as u32).collect();
                if rng.chance(30) {
                    rng.shuffle(&mut perm);
                }
                let dest_ext: Vec<u64> = perm.iter().map(|&p| ext[p as usize]).collect();
                let st = strides(&mut rng, &dest_ext, false);
                let bytes = span(&dest_ext, &st) * spec.elem;
                pending.push((lo, ext, perm, st, bytes));
            }
            let total: u64 = pending.iter().map(|p| p.4).sum();
            let mut next = match mode {
                1 => Some(poisoned.alloc(receiver, total, POISON)),
                _ => None,
            };
            let whole_base = (mode == 2)
                .then(|| poisoned.alloc(receiver, span(&whole_shape, &whole_strides) * spec.elem, POISON));
            for (lo, ext, perm, st, bytes) in pending {
                let addr = match (next.as_mut(), whole_base) {
                    (Some(a), _) => {
                        let at = *a;
                        *a += bytes;
                        at
                    }
                    (None, Some(base)) => {
                        base + spec.elem
                            * perm.iter().enumerate().map(|(d, &p)| lo[p as usize] * st[d]).sum::<u64>()
                    }
                    (None, None) => poisoned.alloc(receiver, bytes, POISON),
                };
                expected.0.entry(receiver).or_default().resize(poisoned.0[&receiver].len(), POISON);
                for x in elements(&lo, &ext) {
                    // Destination dimension d is tensor dimension perm[d].
                    let off: u64 =
                        perm.iter().enumerate().map(|(d, &p)| (x[p as usize] - lo[p as usize]) * st[d]).sum();
                    for b in 0..spec.elem {
                        *expected.byte(receiver, addr + off * spec.elem + b) =
                            logical(&spec.name, linear(&spec.shape, &x), b);
                        needed_bytes += 1;
                    }
                }
                let identity = perm.iter().enumerate().all(|(d, &p)| p as usize == d);
                let region = Region { offset: lo, extent: ext };
                needs.push((
                    t,
                    Need {
                        tensor: 0,
                        receiver,
                        addr,
                        region,
                        perm: (!identity).then_some(perm),
                        strides: st,
                    },
                ));
            }
        }
    }
    for (e, arena) in &poisoned.0 {
        expected.0.entry(*e).or_default().resize(arena.len(), POISON);
    }
    // Spread entries over tables (one per rank, plus a needs-only table), each naming its tensors in
    // its own order.
    let ntables = 1 + rng.below(4) as usize;
    let mut tables: Vec<(Table, Vec<Option<u32>>)> =
        (0..ntables).map(|_| (Table::default(), vec![None; specs.len()])).collect();
    let local = |table: &mut (Table, Vec<Option<u32>>), t: usize| -> u32 {
        *table.1[t].get_or_insert_with(|| {
            table.0.tensors.push(TensorSpec {
                name: specs[t].name.clone(),
                dtype: 7,
                elem_size: specs[t].elem as u32,
                shape: specs[t].shape.clone(),
            });
            table.0.tensors.len() as u32 - 1
        })
    };
    for (t, mut offer) in offers {
        let k = rng.below(ntables as u64) as usize;
        offer.tensor = local(&mut tables[k], t);
        tables[k].0.offers.push(offer);
    }
    for (t, mut need) in needs {
        let k = rng.below(ntables as u64) as usize;
        need.tensor = local(&mut tables[k], t);
        tables[k].0.needs.push(need);
    }
    let tables = tables.into_iter().map(|(t, _)| t).collect();
    Case { tables, sources, poisoned, expected, needed_bytes }
}

/// Runs the plan byte by byte; returns receiver memory and fails on a byte written twice.
fn execute(plan: &Plan, case: &Case) -> Memory {
    let mut dst = case.poisoned.clone();
    let mut written = std::collections::HashSet::new();
    let mut sources = case.sources.clone();
    for route in plan.routes() {
        for s in &route.segments {
            s.for_each_run(|src, d, len| {
                for b in 0..len {
                    let value = *sources.byte(route.src, src + b);
                    assert!(
                        written.insert((route.dst, d + b)),
                        "byte {:#x} of {:?} written twice",
                        d + b,
                        route.dst
                    );
                    *dst.byte(route.dst, d + b) = value;
                }
            });
        }
    }
    dst
}

/// The same tables with tables and entries reordered (tensor indices remapped).
fn shuffled(tables: &[Table], rng: &mut Rng) -> Vec<Table> {
    let mut out: Vec<Table> = tables
        .iter()
        .map(|t| {
            let mut order: Vec<usize> = (0..t.tensors.len()).collect();
            rng.shuffle(&mut order);
            let mut new_index = vec![0; order.len()];
            for (new, &old) in order.iter().enumerate() {
                new_index[old] = new as u32;
            }
            let mut table = Table {
                tensors: order.iter().map(|&i| t.tensors[i].clone()).collect(),
                offers: t.offers.clone(),
                needs: t.needs.clone(),
                quant_needs: Vec::new(),
                shared_amax: Vec::new(),
            };
            table.offers.iter_mut().for_each(|o| o.tensor = new_index[o.tensor as usize]);
            table.needs.iter_mut().for_each(|n| n.tensor = new_index[n.tensor as usize]);
            rng.shuffle(&mut table.offers);
            rng.shuffle(&mut table.needs);
            table
        })
        .collect();
    rng.shuffle(&mut out);
    out
}

#[test]
fn random_tables_match_the_per_element_reference() {
    let policies = [OwnerPolicy::First, OwnerPolicy::Local, OwnerPolicy::Balanced];
    let mut planned = 0;
    for seed in 0..1000u64 {
        let case = random_case(seed);
        let mut rng = Rng(seed + 77);
        let mut by_policy = vec![];
        for policy in policies {
            for coalesce in [true, false] {
                let options = PlanOptions { policy, coalesce };
                let plan = build(&case.tables, &options).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
                let got = execute(&plan, &case);
                assert!(
                    got == case.expected,
                    "seed {seed} {options:?}: receiver memory differs from the reference"
                );
                let stats = plan.stats();
                assert_eq!(stats.needed_bytes, case.needed_bytes, "seed {seed}");
                let moved: u64 =
                    plan.routes().iter().flat_map(|r| &r.segments).map(|s| s.bytes().unwrap()).sum();
                assert_eq!(moved, case.needed_bytes, "seed {seed}");
                assert_eq!(stats.bytes_local + stats.bytes_peer + stats.bytes_remote, moved);
                assert!(stats.ranges_coalesced <= stats.segments_deduped || !coalesce);
                assert!(stats.flat_runs_coalesced <= stats.ranges_deduped);
                assert!(stats.bytes_all_replicas >= stats.needed_bytes);
                assert_eq!(stats.size_histogram.iter().sum::<u64>(), stats.ranges_coalesced);
                let per_receiver: u64 = plan.receivers().map(|r| plan.receiver_stats(r).needed_bytes).sum();
                assert_eq!(per_receiver, stats.needed_bytes);
                // Same inputs in another order: the same plan.
                let again = build(&shuffled(&case.tables, &mut rng), &options).unwrap();
                assert_eq!(again.routes(), plan.routes(), "seed {seed} {options:?}: order changed the plan");
                assert_eq!(again.fingerprint(), plan.fingerprint());
                by_policy.push((policy, *stats));
                planned += 1;
            }
        }
        // LOCAL picks, for every piece, a replica at least as near as FIRST's.
        let (first, local) = (&by_policy[0].1, &by_policy[2].1);
        assert!(
            local.bytes_local >= first.bytes_local && local.bytes_remote <= first.bytes_remote,
            "seed {seed}"
        );
    }
    assert_eq!(planned, 1000 * 6);
}

#[test]
fn balanced_policy_spreads_replicated_bytes() {
    // One tensor of 8 rows, each row its own replica set held by both of two ranks.
    let spec = TensorSpec { name: "w".into(), dtype: 0, elem_size: 4, shape: vec![8, 16] };
    let mut table = Table { tensors: vec![spec], ..Table::default() };
    for row in 0..8u64 {
        for rank in 0..2u32 {
            table.offers.push(Offer {
                tensor: 0,
                owner: Endpoint { process: rank, device: 0 },
                addr: 0x10000 * (u64::from(rank) + 1) + row * 64,
                region: Region { offset: vec![row, 0], extent: vec![1, 16] },
                strides: None,
                digest: Some(row),
            });
        }
    }
    let receiver = Endpoint { process: 5, device: 0 };
    table.needs.push(Need {
        tensor: 0,
        receiver,
        addr: 0x90000,
        region: Region { offset: vec![0, 0], extent: vec![8, 16] },
        perm: None,
        strides: vec![16, 1],
    });
    let bytes_from = |plan: &Plan, rank: u32| -> u64 {
        plan.routes()
            .iter()
            .filter(|r| r.src.process == rank)
            .flat_map(|r| &r.segments)
            .map(|s| s.bytes().unwrap())
            .sum()
    };
    let first =
        build(std::slice::from_ref(&table), &PlanOptions { policy: OwnerPolicy::First, coalesce: true })
            .unwrap();
    assert_eq!((bytes_from(&first, 0), bytes_from(&first, 1)), (512, 0));
    let balanced = build(&[table], &PlanOptions { policy: OwnerPolicy::Balanced, coalesce: true }).unwrap();
    assert_eq!((bytes_from(&balanced, 0), bytes_from(&balanced, 1)), (256, 256));
    assert_ne!(first.fingerprint(), balanced.fingerprint());
    assert_eq!(balanced.stats().offers_kept, 8);
    assert_eq!(balanced.stats().offers_in, 16);
    assert_eq!(balanced.stats().duplicate_bytes_dropped, 512);
}

#[test]
fn balanced_serves_single_replica_demand_first() {
    // Issue 14 item 9: `a` offered by (0,0) and (1,0), `b` only by (1,0); receiver (1,0) needs both.
    // The busiest source must serve 8 bytes, whatever the tensors are called.
    for (a, b) in [("a", "b"), ("b", "a"), ("zz", "aa")] {
        let spec = |name: &str| TensorSpec { name: name.into(), dtype: 0, elem_size: 1, shape: vec![8] };
        let whole = Region { offset: vec![0], extent: vec![8] };
        let at = |rank| Endpoint { process: rank, device: 0 };
        let offer = |tensor, rank, addr| Offer {
            tensor,
            owner: at(rank),
            addr,
            region: whole.clone(),
            strides: None,
            digest: None,
        };
        let need = |tensor, addr| Need {
            tensor,
            receiver: at(1),
            addr,
            region: whole.clone(),
            perm: None,
            strides: vec![1],
        };
        let table = Table {
            tensors: vec![spec(a), spec(b)],
            offers: vec![offer(0, 0, 0x100), offer(0, 1, 0x200), offer(1, 1, 0x300)],
            needs: vec![need(0, 0x1000), need(1, 0x2000)],
            quant_needs: Vec::new(),
            shared_amax: Vec::new(),
        };
        let plan = build(&[table], &PlanOptions { policy: OwnerPolicy::Balanced, coalesce: true }).unwrap();
        let mut served = BTreeMap::new();
        for r in plan.routes() {
            *served.entry(r.src).or_insert(0) += r.segments.iter().map(|s| s.bytes().unwrap()).sum::<u64>();
        }
        assert_eq!(served.into_iter().collect::<Vec<_>>(), vec![(at(0), 8), (at(1), 8)], "names {a}, {b}");
    }
}

/// A random owner-balancing problem: tensors of 1..64 bytes, each offered whole by a random set of
/// processes 0..4, needed whole by some of processes 10..12. Returns the table (tensor `t` named
/// `names[t]`, need of tensor `t` by process `10 + r` at `0x10000 * (t + 1) + 0x100 * r`), each
/// tensor's bytes and owners.
fn balancing_case(rng: &mut Rng, names: &[String]) -> (Table, Vec<u64>, Vec<Vec<Endpoint>>) {
    let mut table = Table::default();
    let (mut sizes, mut owners) = (vec![], vec![]);
    for (t, name) in names.iter().enumerate() {
        let bytes = 1 + rng.below(64);
        table.tensors.push(TensorSpec { name: name.clone(), dtype: 0, elem_size: 1, shape: vec![bytes] });
        let whole = Region { offset: vec![0], extent: vec![bytes] };
        let mut held: Vec<Endpoint> =
            (0..4).filter(|_| rng.chance(50)).map(|p| Endpoint { process: p, device: 0 }).collect();
        if held.is_empty() {
            held.push(Endpoint { process: rng.below(4) as u32, device: 0 });
        }
        for owner in &held {
            let addr = 0x100_0000 * (u64::from(owner.process) + 1) + 0x1000 * t as u64;
            table.offers.push(Offer {
                tensor: t as u32,
                owner: *owner,
                addr,
                region: whole.clone(),
                strides: None,
                digest: None,
            });
        }
        for r in 0..3u64 {
            if rng.chance(60) {
                table.needs.push(Need {
                    tensor: t as u32,
                    receiver: Endpoint { process: 10 + r as u32, device: 0 },
                    addr: 0x10000 * (t as u64 + 1) + 0x100 * r,
                    region: whole.clone(),
                    perm: None,
                    strides: vec![1],
                });
            }
        }
        sizes.push(bytes);
        owners.push(held);
    }
    (table, sizes, owners)
}

/// Bytes each source serves, and the source serving each (tensor, receiver process) need.
fn served(plan: &Plan) -> (BTreeMap<Endpoint, u64>, BTreeMap<(u64, u32), Endpoint>) {
    let (mut load, mut by_need) = (BTreeMap::new(), BTreeMap::new());
    for r in plan.routes() {
        for s in &r.segments {
            *load.entry(r.src).or_insert(0) += s.bytes().unwrap();
            s.for_each_run(|_, dst, _| {
                by_need.insert((dst / 0x10000 - 1, r.dst.process), r.src);
            });
        }
    }
    (load, by_need)
}

#[test]
fn balanced_leaves_no_move_that_relieves_the_busiest_source_and_ignores_names() {
    for seed in 0..400u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let count = 1 + rng.below(8) as usize;
        let names: Vec<String> = (0..count).map(|t| format!("t{t}")).collect();
        let (table, sizes, owners) = balancing_case(&mut Rng(rng.next() | 1), &names);
        let balanced = PlanOptions { policy: OwnerPolicy::Balanced, coalesce: false };
        let plan = build(std::slice::from_ref(&table), &balanced).unwrap();
        let (load, by_need) = served(&plan);
        let busiest = load.values().copied().max().unwrap_or(0);
        for (&(t, _), &source) in &by_need {
            let t = t as usize;
            // Demand only one source holds is served by it.
            if owners[t].len() == 1 {
                assert_eq!(source, owners[t][0], "seed {seed}");
            }
            if load[&source] < busiest {
                continue;
            }
            // No single need on a busiest source can move to another replica and stay below it.
            for other in owners[t].iter().filter(|&&o| o != source) {
                let after = load.get(other).copied().unwrap_or(0) + sizes[t];
                assert!(
                    after >= busiest,
                    "seed {seed}: moving tensor {t} from {source:?} to {other:?} relieves it"
                );
            }
        }
        // Renamed tensors (another canonical order) and another table order: the same loads.
        let renamed: Vec<String> = (0..count).map(|t| format!("z{}.{}", rng.next(), t)).collect();
        let mut table2 = table.clone();
        for (t, spec) in table2.tensors.iter_mut().enumerate() {
            spec.name = renamed[t].clone();
        }
        let shuffled_tables = shuffled(&[table2], &mut rng);
        let other = build(&shuffled_tables, &balanced).unwrap();
        let mut a: Vec<u64> = load.values().copied().collect();
        let mut b: Vec<u64> = served(&other).0.values().copied().collect();
        a.sort_unstable();
        b.sort_unstable();
        assert_eq!(a, b, "seed {seed}: names or order changed the loads");
    }
}

#[test]
fn each_process_share_is_the_whole_plan_restricted_to_that_process() {
    let policies = [OwnerPolicy::First, OwnerPolicy::Local, OwnerPolicy::Balanced];
    let limits = refit::plan::Limits::default();
    for seed in 0..300u64 {
        let case = random_case(seed);
        let tables: Vec<&Table> = case.tables.iter().collect();
        for policy in policies {
            let options = PlanOptions { policy, coalesce: seed % 2 == 0 };
            let whole = build(&case.tables, &options).unwrap();
            for process in 0..4u32 {
                let share = build_share(&tables, process, &options, &limits).unwrap();
                let expected: Vec<&Route> = whole
                    .routes()
                    .iter()
                    .filter(|r| r.src.process == process || r.dst.process == process)
                    .collect();
                let got: Vec<&Route> = share.routes().iter().collect();
                assert_eq!(got, expected, "seed {seed} {options:?} process {process}");
                assert_eq!(share.inputs_fingerprint(), whole.inputs_fingerprint());
                let receivers: Vec<Endpoint> = whole.receivers().filter(|e| e.process == process).collect();
                assert_eq!(share.receivers().collect::<Vec<_>>(), receivers);
                for e in receivers {
                    let (a, b) = (share.receiver_stats(e), whole.receiver_stats(e));
                    assert_eq!(PlanStats { build_ns: 0, ..a }, PlanStats { build_ns: 0, ..b }, "seed {seed}");
                }
            }
        }
    }
}

#[test]
fn the_inputs_fingerprint_follows_content_not_order() {
    let options = PlanOptions::default();
    for seed in 0..100u64 {
        let case = random_case(seed);
        let expected = build(&case.tables, &options).unwrap().inputs_fingerprint();
        let mut rng = Rng(seed + 99);
        for _ in 0..3 {
            let again = build(&shuffled(&case.tables, &mut rng), &options).unwrap();
            assert_eq!(again.inputs_fingerprint(), expected, "seed {seed}");
        }
    }
    let case = random_case(7);
    let plan = build(&case.tables, &options).unwrap();
    let coalesce_off = PlanOptions { coalesce: false, ..options.clone() };
    assert_ne!(build(&case.tables, &coalesce_off).unwrap().inputs_fingerprint(), plan.inputs_fingerprint());
    // Any entry changed: another fingerprint (an offer's address, a need's receiver device).
    let mut moved = case.tables.clone();
    let t = moved.iter().position(|t| !t.offers.is_empty()).unwrap();
    moved[t].offers[0].addr += 1;
    assert_ne!(build(&moved, &options).unwrap().inputs_fingerprint(), plan.inputs_fingerprint());
}
