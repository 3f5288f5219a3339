//! Needs that receive FP8: a box of a tensor delivered as FP8 codes and scales, quantized on the way
//! (`crate::quant` holds the arithmetic). Planned in front of the byte planner, one of three paths per
//! need:
//!
//! - **direct**: offers in the receiver's own process tile the box so that every quantization block
//!   lies inside one of them. The quantizing copy reads those sources in place and writes codes and
//!   scales straight into the need's memory, on the source's device: one byte per element crosses
//!   to the receiver instead of two.
//! - **sender**: offers tile the box that way but some lie in other processes. Each of those
//!   processes (a sender) quantizes its pieces in place into a buffer of its own, and the codes and
//!   scales cross to the receiver as the routes between processes do (CUDA IPC or staging): again
//!   one byte per element crosses, not two. Pieces in the receiver's process stay direct.
//! - **staged**: a block spans offers, or offers overlap without being replicas. The box's elements
//!   are routed like any need into the need's staging buffer on the receiver (a bf16 copy of the
//!   box, row-major), through every transport the byte planner has, and quantized there.
//!
//! The staged path adds one plain need per quantized need (the `shadow` table), so coverage, replicas,
//! owners, transports and staged commit stay the byte planner's. What comes out is a list of
//! [`QuantRoute`]s: the quantization jobs each device runs after the bytes have landed.

use super::boxes::{byte_span, Boxed, Dims};
use super::builder::TableBuilder;
use super::digest::Fnv1a;
use super::options::Limits;
use super::stats::PlanStats;
use super::table::{Endpoint, Need, Region, Table, TensorSpec, MAX_DIMS};
use crate::error::{Error, Result, Status};
use crate::quant::job::check_job;
use crate::quant::{Granularity, QuantJob, Quantization, SourceType};
use std::collections::{BTreeMap, HashMap};

/// A need for FP8: `region` of tensor `tensor` quantized to `quantization` into FP8 codes at `addr`
/// and scales at `scales`, on `receiver`.
///
/// The box is a stack of matrices: its last two dimensions are rows and columns (a 1-dimensional box
/// is one row), the dimensions before them index matrices, each quantized on its own with its blocks
/// counted from its first element. Code (.., r, c) of the box lands at
/// `addr + sum_d (i_d - offset_d) * strides[d]` bytes (`strides` in bytes = FP8 elements; the last
/// must be 1). Matrix `m` (row-major over the leading dimensions of the box) has its scale grid
/// ([`Quantization::scale_grid`]) at `scales + m * scale_matrix_stride` scales, grid rows
/// `scale_row_stride` scales apart.
///
/// `staging` (0: none) is a buffer on the receiver of the box's source elements, row-major
/// (16-byte aligned, rows a multiple of 16 bytes): where the elements land to be quantized when no
/// direct path exists.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct QuantNeed {
    pub tensor: u32,
    pub receiver: Endpoint,
    pub addr: u64,
    pub region: Region,
    pub strides: Vec<u64>,
    pub quantization: Quantization,
    pub source: SourceType,
    pub scales: u64,
    pub scale_row_stride: u64,
    pub scale_matrix_stride: u64,
    pub staging: u64,
}

/// A per-tensor scale of process `process` at `scale` (a quantized need's `scales + m *
/// scale_matrix_stride` scales) that takes one amax with every scale any table names under `key`:
/// the amax of all the needs writing any of them, across receivers and processes. vLLM's per-tensor
/// weights of a tensor-parallel layer are so: each rank holds a shard and its own copy of the one
/// scale, computed from the whole weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SharedAmax {
    pub process: u32,
    pub scale: u64,
    pub key: u64,
}

/// Which path a quantized need takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum QuantPath {
    /// The jobs read the sources in place, in the receiver's process.
    Direct,
    /// The jobs read the need's staging, filled by the plan's routes.
    Staged,
    /// The jobs read the sources in place in another process (the runner's), which quantizes into a
    /// buffer of its own and sends the codes and scales to the receiver. The jobs name the
    /// receiver's codes and scales, as the other paths' do; the executors of both processes lay
    /// that buffer out alike from them.
    Sender,
}

/// The quantization jobs one device runs for one quantized need.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantRoute {
    /// The need's number among the plan's quantized needs (sorted by receiver, tensor, box).
    pub need: usize,
    /// The tensor's name, NUL-terminated for C callers (cut at a NUL the name holds, which only a
    /// decoded table's can); [`QuantRoute::name`] for messages.
    pub tensor: std::ffi::CString,
    pub receiver: Endpoint,
    /// The device whose stream runs the jobs: the sources' (direct, sender) or the receiver's
    /// (staged).
    pub runner: Endpoint,
    pub path: QuantPath,
    pub jobs: Vec<QuantJob>,
    /// The jobs share an amax with jobs of other devices, exchanged at every run ([`AmaxExchange`]).
    pub amax_exchanged: bool,
}

impl QuantRoute {
    /// The tensor's name, for messages.
    pub fn name(&self) -> std::borrow::Cow<'_, str> {
        self.tensor.to_string_lossy()
    }

    /// Source bytes the jobs read.
    pub fn source_bytes(&self) -> u64 {
        self.jobs.iter().map(|j| j.elements().saturating_mul(j.source.size())).fold(0, u64::saturating_add)
    }

    pub fn elements(&self) -> u64 {
        self.jobs.iter().map(QuantJob::elements).fold(0, u64::saturating_add)
    }
}

/// Where a quantized need's box sits: its dimensions, and which of them are rows and columns.
#[derive(Clone, Copy, Debug)]
struct Geometry {
    n: usize,
    lo: Dims,
    ext: Dims,
    /// Code strides in bytes, by dimension.
    strides: Dims,
    elem: u64,
}

impl Geometry {
    /// The row and column dimensions (None: a dimension the box does not have, of extent 1).
    fn matrix_dims(&self) -> (Option<usize>, Option<usize>) {
        match self.n {
            0 => (None, None),
            1 => (None, Some(0)),
            n => (Some(n - 2), Some(n - 1)),
        }
    }

    /// Dimensions indexing matrices.
    fn leading(&self) -> usize {
        self.n.saturating_sub(2)
    }

    fn extent_of(&self, bx: &Boxed, d: Option<usize>) -> u64 {
        d.map_or(1, |d| bx.ext[d])
    }

    fn rows_cols(&self) -> (u64, u64) {
        let (r, c) = self.matrix_dims();
        (r.map_or(1, |d| self.ext[d]), c.map_or(1, |d| self.ext[d]))
    }

    fn matrices(&self) -> u64 {
        self.ext[..self.leading()].iter().product()
    }

    fn whole(&self) -> Boxed {
        Boxed::new(self.lo, self.ext)
    }
}

impl QuantNeed {
    /// Checks the need against its tensor (see [`TableBuilder::add_quant_need`]).
    pub(crate) fn check(&self, spec: &TensorSpec) -> Result<()> {
        spec.validate()?;
        self.geometry(spec).map(|_| ())
    }

    /// Checks the need against its tensor: box, strides, element size, quantization, the ranges of
    /// codes, scales and staging.
    fn geometry(&self, spec: &TensorSpec) -> Result<Geometry> {
        let name = &spec.name;
        let invalid = |message: String| {
            Error::invalid_argument(format!("quantized need of tensor '{name}': {message}"))
        };
        let need = Need {
            tensor: self.tensor,
            receiver: self.receiver,
            addr: self.addr,
            region: self.region.clone(),
            perm: None,
            strides: self.strides.clone(),
        };
        // Box and stride count as a plain need of one-byte elements (the codes).
        let codes = TensorSpec { elem_size: 1, ..spec.clone() };
        let resolved = need.resolve(&codes)?;
        let n = spec.shape.len();
        let elem = u64::from(spec.elem_size);
        if elem != self.source.size() {
            let name = match self.source {
                SourceType::Bf16 => "REFIT_SOURCE_BF16",
                SourceType::F16 => "REFIT_SOURCE_F16",
                SourceType::F32 => "REFIT_SOURCE_F32",
            };
            return Err(invalid(format!(
                "the tensor's elements are {elem} bytes; {name} elements are {} bytes",
                self.source.size()
            )));
        }
        let g = Geometry { n, lo: resolved.lo, ext: resolved.ext, strides: resolved.strides, elem };
        if n >= 1 && g.ext[n - 1] > 1 && g.strides[n - 1] != 1 {
            return Err(invalid(format!(
                "the last destination stride is {}; codes of a row must be contiguous (1)",
                g.strides[n - 1]
            )));
        }
        let (rows, cols) = g.rows_cols();
        let probe = QuantJob {
            quantization: self.quantization,
            source: self.source,
            src: 16,
            rows: 0,
            cols: 0,
            src_stride: 0,
            dst: 8,
            dst_stride: 0,
            scales: 4,
            scale_stride: 0,
            amax_key: 0,
        };
        check_job(0, &probe).map_err(|e| invalid(e.message.trim_start_matches("jobs[0]: ").to_string()))?;
        if g.whole().is_empty(n) {
            return Ok(g);
        }
        let (grid_rows, grid_cols) = self.quantization.scale_grid(rows, cols);
        let scale_size = self.quantization.scale_kind().size();
        if grid_rows > 1 && self.scale_row_stride < grid_cols {
            return Err(invalid(format!(
                "scale_row_stride {} is below the {grid_cols} scales of a grid row ({grid_rows} x {grid_cols} scales per matrix)",
                self.scale_row_stride
            )));
        }
        let grid_span =
            (grid_rows - 1).checked_mul(self.scale_row_stride).and_then(|s| s.checked_add(grid_cols));
        let matrices = g.matrices();
        if matrices > 1 && grid_span.is_none_or(|span| self.scale_matrix_stride < span) {
            return Err(invalid(format!(
                "scale_matrix_stride {} is below the {} scales one matrix's grid spans ({matrices} matrices)",
                self.scale_matrix_stride,
                grid_span.map_or("2^64".into(), |s| s.to_string())
            )));
        }
        let scales_end = (matrices - 1)
            .checked_mul(self.scale_matrix_stride)
            .and_then(|s| s.checked_add(grid_span?))
            .and_then(|s| s.checked_mul(scale_size))
            .and_then(|s| self.scales.checked_add(s));
        if self.scales == 0 || scales_end.is_none() {
            return Err(invalid(format!(
                "scales at {:#x} are 0 or run past the end of the address space",
                self.scales
            )));
        }
        if self.staging != 0 {
            let row_bytes = cols * elem;
            if self.staging % 16 != 0 || (rows > 1 && row_bytes % 16 != 0) {
                return Err(invalid(format!(
                    "staging at {:#x} with rows of {row_bytes} bytes: staging and its rows must start on 16 bytes \
                     (columns a multiple of {})",
                    self.staging,
                    16 / elem
                )));
            }
            let span = byte_span(n, &g.ext, &row_major(n, &g.ext), elem);
            if span.and_then(|s| self.staging.checked_add(s)).is_none() {
                return Err(invalid(format!(
                    "staging at {:#x} runs past the end of the address space",
                    self.staging
                )));
            }
        }
        Ok(g)
    }
}

/// Element strides of a row-major box of extent `ext`.
fn row_major(n: usize, ext: &Dims) -> Dims {
    let mut strides = [0; MAX_DIMS];
    let mut step = 1u64;
    for d in (0..n).rev() {
        strides[d] = step;
        step = step.saturating_mul(ext[d]);
    }
    strides
}

/// An offer as the quantized planner sees it.
#[derive(Clone, Copy, Debug)]
struct Source {
    owner: Endpoint,
    /// The address of the offer's corner element, `corner`.
    addr: u64,
    corner: Dims,
    /// The offer's box (a piece: cut to the need).
    bx: Boxed,
    /// Element strides by dimension.
    strides: Dims,
}

/// The quantized needs of every table, planned.
#[derive(Debug, Default)]
pub(crate) struct Planned {
    /// A plain need into the staging of each staged quantized need (empty: no table).
    pub shadow: Table,
    /// Sorted by receiver, tensor name, runner.
    pub routes: Vec<QuantRoute>,
    /// A digest of every quantized need (0 when there is none), for the inputs' fingerprint.
    pub fingerprint: u64,
    /// The amaxes exchanged at every run (sets of needs sharing an amax whose jobs run on several
    /// devices): the same in every process's plan.
    pub exchange: AmaxExchange,
}

/// Amaxes that the devices quantizing a set of needs sharing them must agree on before they
/// quantize: each device reduces its own jobs' elements (phase 1), the executors exchange those
/// partial amaxes (through the communicator between processes), and every device quantizes with
/// their maximum. Planned where no one device holds every piece of such a set: a sharded trainer's
/// shards of a weight that an engine scales per tensor (or per row, row-parallel) across its ranks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AmaxExchange {
    /// The jobs' amax keys ([`QuantJob::amax_key`]) of the exchanged sets, sorted.
    pub keys: Vec<u64>,
    /// The processes whose devices run jobs of those sets, sorted.
    pub processes: Vec<u32>,
}

impl AmaxExchange {
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Whether jobs with `key` take the exchanged amax.
    pub fn covers(&self, key: u64) -> bool {
        key != 0 && self.keys.binary_search(&key).is_ok()
    }
}

/// Plans the quantized needs of `tables` (every process's: the staged path adds needs that every
/// process must plan alike); `process` Some keeps the routes that process takes part in: those of
/// its receivers, and those it quantizes for another process's (the sender path).
pub(crate) fn plan(tables: &[&Table], process: Option<u32>, limits: &Limits) -> Result<Planned> {
    let mut planned = Planned::default();
    if tables.iter().all(|t| t.quant_needs.is_empty()) {
        return Ok(planned);
    }
    // Tables decoded from bytes are unchecked until merged, which comes after: every description is
    // checked before its shape sizes anything here.
    for table in tables {
        table.tensors.iter().try_for_each(TensorSpec::validate)?;
    }
    let sources = sources_by_name(tables)?;
    let mut shadow = TableBuilder::new();
    let mut digest = Fnv1a::new();
    let mut budget = limits.max_segments;
    let mut needs: Vec<(&TensorSpec, &QuantNeed)> = Vec::new();
    for table in tables {
        for q in &table.quant_needs {
            let spec = table.tensors.get(q.tensor as usize).ok_or_else(|| {
                Error::invalid_argument(format!(
                    "quantized need of tensor index {} but its table has {} tensors",
                    q.tensor,
                    table.tensors.len()
                ))
            })?;
            needs.push((spec, q));
        }
    }
    // Tables in any order plan alike.
    needs.sort_by(|a, b| {
        (a.1.receiver, &a.0.name, &a.1.region, a.1.addr).cmp(&(
            b.1.receiver,
            &b.0.name,
            &b.1.region,
            b.1.addr,
        ))
    });
    let keys = amax_keys(tables, &mut digest)?;
    let ties = ScaleTies::of(&needs, &sources, &keys, limits.max_segments)?;
    for (number, (spec, q)) in needs.into_iter().enumerate() {
        let g = q.geometry(spec)?;
        hash_need(&mut digest, spec, q);
        if g.whole().is_empty(g.n) {
            continue;
        }
        let offers = sources.get(spec.name.as_str()).map(Vec::as_slice).unwrap_or(&[]);
        let amax_key = |m: u64, r0: u64| ties.key(number, m, r0);
        let own_pieces = |q: &QuantNeed, g: &Geometry| {
            direct_pieces(q, g, offers, Pieces::ReceiversProcess)
                .or_else(|_| direct_pieces(q, g, offers, Pieces::AnyProcess { turn: number }))
        };
        let in_place = match ties.tied(number) {
            Some(Err(Refusal { why, stageable: false })) => {
                return Err(Error::new(
                    Status::Unsupported,
                    format!(
                        "quantized need of tensor '{}' on process {} device {}: {why}; needs sharing an amax across \
                         receiving devices are quantized in place (from one device, or each need where it is \
                         offered with the amax exchanged) or not at all (staging on each receiver would give each \
                         its own amax)",
                        spec.name, q.receiver.process, q.receiver.device
                    ),
                ))
            }
            Some(Err(Refusal { why, .. })) => Err(why),
            Some(Ok(Tie::From(from))) => direct_pieces(q, &g, offers, from),
            Some(Ok(Tie::Exchanged)) | None => own_pieces(q, &g),
        };
        let routes = match in_place {
            Ok(pieces) => direct_routes(spec, q, &g, &pieces, &amax_key, &mut budget)?,
            Err(why) if q.staging == 0 => {
                return Err(Error::new(
                    Status::Unsupported,
                    format!(
                        "quantized need of tensor '{}' on process {} device {}: it cannot be quantized where it is \
                         offered ({why}); give the need a staging buffer for its {} source elements",
                        spec.name,
                        q.receiver.process,
                        q.receiver.device,
                        g.whole().volume(g.n)
                    ),
                ))
            }
            Err(why) => {
                log::debug!("quantized need of tensor '{}' is staged: {why}", spec.name);
                shadow.add_tensor(spec.clone()).and_then(|tensor| {
                    shadow.add_need(Need {
                        tensor,
                        receiver: q.receiver,
                        addr: q.staging,
                        region: q.region.clone(),
                        perm: None,
                        strides: row_major(g.n, &g.ext)[..g.n].to_vec(),
                    })
                })?;
                vec![staged_route(spec, q, &g, &amax_key, &mut budget)?]
            }
        };
        if ties.exchanged(number) {
            planned.exchange.keys.extend(routes.iter().flat_map(|r| &r.jobs).map(|j| j.amax_key));
            planned.exchange.processes.extend(routes.iter().map(|r| r.runner.process));
        }
        let kept = routes
            .into_iter()
            .filter(|r| process.is_none_or(|p| p == r.receiver.process || p == r.runner.process));
        let amax_exchanged = ties.exchanged(number);
        planned.routes.extend(kept.map(|r| QuantRoute { need: number, amax_exchanged, ..r }));
    }
    planned.shadow = shadow.into_table();
    planned.fingerprint = digest.finish();
    let exchange = &mut planned.exchange;
    exchange.keys.sort_unstable();
    exchange.keys.dedup();
    exchange.processes.sort_unstable();
    exchange.processes.dedup();
    Ok(planned)
}

/// Every table's shared amax entries by (process, scale), their keys hashed into `digest`;
/// INVALID_ARGUMENT when tables give one scale two keys, or give key 0.
fn amax_keys(tables: &[&Table], digest: &mut Fnv1a) -> Result<HashMap<(u32, u64), u64>> {
    let mut keys: HashMap<(u32, u64), u64> = HashMap::new();
    let mut entries: Vec<&SharedAmax> = tables.iter().flat_map(|t| &t.shared_amax).collect();
    entries.sort_by_key(|s| (s.process, s.scale, s.key));
    for s in entries {
        if s.key == 0 {
            return Err(Error::invalid_argument(format!(
                "scale at {:#x} of process {} shares its amax under key 0, which means none",
                s.scale, s.process
            )));
        }
        match keys.insert((s.process, s.scale), s.key) {
            Some(other) if other != s.key => {
                return Err(Error::invalid_argument(format!(
                    "scale at {:#x} of process {} shares its amax under two keys, {other} and {}",
                    s.scale, s.process, s.key
                )))
            }
            Some(_) => {}
            None => [u64::from(s.process), s.scale, s.key].into_iter().for_each(|v| digest.u64(v)),
        }
    }
    Ok(keys)
}

/// Per-tensor needs whose matrices share one amax: those of one process naming the same scale (a
/// fused `qkv` received from separate q, k and v: one scale), and those whose scales share a key
/// ([`SharedAmax`]: the shards of one weight on several receivers, each with its own copy of the
/// scale). Jobs in one batch of one device share an amax by themselves
/// (`crate::quant::job::amax_owners`), so such needs are quantized in place from one device when
/// every one of them can be: of the receivers' process (direct), else of one other process (the
/// sender path, which quantizes them in one batch), never some direct and some sent. Else, where
/// they are received on one device and each has staging, all of them are staged there. Else, where
/// each can be quantized in place on its own (per row: its pieces in bands of rows that every need
/// of the set cuts alike), each is, and the devices running them exchange their amaxes at every run
/// ([`AmaxExchange`]). Otherwise planning fails (UNSUPPORTED). Jobs take one amax key per set of
/// matrices sharing a scale or a key (per tensor) or per band of rows of the set (per row).
struct ScaleTies {
    /// By need: its set's number (that of its first need), for needs that share an amax.
    set: Vec<Option<usize>>,
    /// By set: where its needs take their pieces from; else why not in place.
    decided: HashMap<usize, std::result::Result<Tie, Refusal>>,
    /// The amax key of each matrix (need, matrix) of a per-tensor need in a set: one per set of
    /// matrices sharing a scale or a key, so that a need's other matrices keep their own amaxes.
    matrix_keys: HashMap<(usize, u64), u64>,
    /// The amax key of each band of rows (set, first row of the band in the box) of the per-row
    /// needs in a set: one per band of pieces, which hold the same rows in every need of the set.
    row_keys: HashMap<(usize, u64), u64>,
}

/// Where the needs of a set sharing an amax take their pieces from.
#[derive(Clone, Copy, Debug)]
enum Tie {
    /// All from the offers of one device, which quantizes them in one batch.
    From(Pieces),
    /// Each its own (as a need sharing nothing), the amax exchanged between the devices.
    Exchanged,
}

/// Why the needs sharing an amax are not quantized in place, and whether they may be staged instead
/// (they are received on one device).
#[derive(Clone, Debug)]
struct Refusal {
    why: String,
    stageable: bool,
}

impl ScaleTies {
    /// The ties among `needs` (`keys`: the shared amax entries of every table); UNSUPPORTED when their
    /// per-tensor matrices (one job each) are more than `max_jobs`, which the jobs themselves would be
    /// refused for anyway; INVALID_ARGUMENT when needs sharing an amax quantize differently, when needs
    /// naming one scale are received on different devices, or when a key names a scale no per-tensor
    /// need writes.
    fn of(
        needs: &[(&TensorSpec, &QuantNeed)],
        sources: &HashMap<&str, Vec<Source>>,
        keys: &HashMap<(u32, u64), u64>,
        max_jobs: u64,
    ) -> Result<ScaleTies> {
        // Union-find over the needs, joined through each scale address and each key.
        let mut parent: Vec<usize> = (0..needs.len()).collect();
        fn root(parent: &mut [usize], mut i: usize) -> usize {
            while parent[i] != i {
                parent[i] = parent[parent[i]];
                i = parent[i];
            }
            i
        }
        let mut first_at: HashMap<(u32, u64), usize> = HashMap::new();
        let mut first_with: HashMap<u64, usize> = HashMap::new();
        let mut budget = max_jobs;
        let mut keyed_rows: HashMap<(u32, u64), usize> = HashMap::new();
        // Matrices of per-tensor needs, joined the same way: (need, matrix) per node.
        let mut matrices: Vec<(usize, u64)> = Vec::new();
        let mut matrix_parent: Vec<usize> = Vec::new();
        let (mut matrix_at, mut matrix_with): (HashMap<(u32, u64), usize>, HashMap<u64, usize>) =
            (HashMap::new(), HashMap::new());
        for (i, (spec, q)) in needs.iter().enumerate() {
            let g = match q.quantization.granularity {
                Granularity::Tensor | Granularity::Row => q.geometry(spec)?,
                _ => continue,
            };
            if g.whole().is_empty(g.n) {
                continue;
            }
            if q.quantization.granularity == Granularity::Row {
                // Per-row scales are the need's own, unless a key shares each row's amax.
                let place = (q.receiver.process, q.scales);
                let Some(&key) = keys.get(&place) else { continue };
                if g.matrices() != 1 {
                    return Err(Error::invalid_argument(format!(
                        "quantized need of tensor '{}': its per-row scales share amaxes under key {key}, but its box \
                         holds {} matrices; needs sharing per-row amaxes are one matrix each",
                        spec.name,
                        g.matrices()
                    )));
                }
                keyed_rows.insert(place, i);
                let j = *first_with.entry(key).or_insert(i);
                let (a, b) = (root(&mut parent, i), root(&mut parent, j));
                parent[a.max(b)] = a.min(b);
                continue;
            }
            spend(&mut budget, g.matrices())?;
            for m in 0..g.matrices() {
                let scale =
                    m.wrapping_mul(q.scale_matrix_stride).wrapping_mul(q.quantization.scale_kind().size());
                let addr = q.scales.wrapping_add(scale);
                let place = (q.receiver.process, addr);
                let j = *first_at.entry(place).or_insert(i);
                if needs[j].1.receiver != q.receiver {
                    return Err(Error::invalid_argument(format!(
                        "quantized needs of tensors '{}' and '{}' name one per-tensor scale at {addr:#x} of process {} \
                         but differ in receiving device ({} and {}): needs naming one scale are received on one device \
                         (give each device its own scale, and one amax key to all of them)",
                        needs[j].0.name, spec.name, q.receiver.process, needs[j].1.receiver.device, q.receiver.device
                    )));
                }
                let mut joined = vec![j];
                let node = matrices.len();
                matrices.push((i, m));
                matrix_parent.push(node);
                let mut joined_matrices = vec![*matrix_at.entry(place).or_insert(node)];
                if let Some(&key) = keys.get(&place) {
                    joined.push(*first_with.entry(key).or_insert(i));
                    joined_matrices.push(*matrix_with.entry(key).or_insert(node));
                }
                for j in joined {
                    let (a, b) = (root(&mut parent, i), root(&mut parent, j));
                    parent[a.max(b)] = a.min(b);
                }
                for other in joined_matrices {
                    let (a, b) = (root(&mut matrix_parent, node), root(&mut matrix_parent, other));
                    matrix_parent[a.max(b)] = a.min(b);
                }
            }
        }
        let unknown = |place: &&(u32, u64)| !first_at.contains_key(place) && !keyed_rows.contains_key(place);
        if let Some(((process, scale), key)) = keys.iter().find(|(place, _)| unknown(place)) {
            return Err(Error::invalid_argument(format!(
                "scale at {scale:#x} of process {process} shares its amax under key {key}, but no quantized need with \
                 elements writes a per-tensor scale there, nor starts its per-row scales there"
            )));
        }
        let mut members: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for i in 0..needs.len() {
            let r = root(&mut parent, i);
            members.entry(r).or_default().push(i);
        }
        // A per-tensor need alone is a set when a matrix of it lies on several devices.
        let apart = |i: usize| {
            let (spec, q) = needs[i];
            if q.quantization.granularity != Granularity::Tensor {
                return false;
            }
            let Ok(g) = q.geometry(spec) else { return false };
            let offers = sources.get(spec.name.as_str()).map(Vec::as_slice).unwrap_or(&[]);
            direct_pieces(q, &g, offers, Pieces::ReceiversProcess)
                .or_else(|_| direct_pieces(q, &g, offers, Pieces::AnyProcess { turn: i }))
                .is_ok_and(|pieces| splits_a_matrix(&g, &pieces))
        };
        let mut ties = ScaleTies {
            set: vec![None; needs.len()],
            decided: HashMap::new(),
            matrix_keys: HashMap::new(),
            row_keys: HashMap::new(),
        };
        // Keys count up from 1 in an order every process's plan shares: matrices first, then bands.
        let mut next_key = 1u64;
        let mut key_of_root: HashMap<usize, u64> = HashMap::new();
        for (node, &matrix) in matrices.iter().enumerate() {
            let key = *key_of_root.entry(root(&mut matrix_parent, node)).or_insert_with(|| {
                next_key += 1;
                next_key - 1
            });
            ties.matrix_keys.insert(matrix, key);
        }
        for (first, set) in members.into_iter().filter(|(_, set)| set.len() > 1 || apart(set[0])) {
            let mut names: Vec<String> = set.iter().map(|&i| format!("'{}'", needs[i].0.name)).collect();
            names.sort_unstable();
            names.dedup();
            let names = names.join(", ");
            let (_, lead) = needs[first];
            for &i in &set {
                let (spec, q) = needs[i];
                if q.quantization != lead.quantization {
                    return Err(Error::invalid_argument(format!(
                        "quantized needs of tensors {names} share a per-tensor amax but differ in quantization: needs \
                         sharing an amax take one target, granularity and arithmetic (tensor '{}')",
                        spec.name
                    )));
                }
                // The box's rows in the tensor (a box of fewer than 2 dimensions is one row).
                let rows = |q: &QuantNeed| match q.region.offset.len() {
                    n if n >= 2 => (q.region.offset.get(n - 2).copied(), q.region.extent.get(n - 2).copied()),
                    _ => (None, None),
                };
                if q.quantization.granularity == Granularity::Row && rows(q) != rows(lead) {
                    return Err(Error::invalid_argument(format!(
                        "quantized needs of tensors {names} share per-row amaxes but not their rows (tensor '{}': rows \
                         {:?} against {:?}): needs sharing per-row amaxes hold the same rows of their tensors",
                        spec.name,
                        rows(q),
                        rows(lead)
                    )));
                }
                ties.set[i] = Some(first);
            }
            let one_receiver = set.iter().all(|&i| needs[i].1.receiver == lead.receiver);
            // Quantized in place when one device holds every need's pieces: preferably in the
            // receivers' process, else in one other (one turn for all, so that replicas are chosen
            // alike); never direct for some and sent for others, which run as two batches.
            let runner = |from: Pieces| {
                let runners: Vec<Option<Endpoint>> = set
                    .iter()
                    .map(|&i| {
                        let (spec, q) = needs[i];
                        let g = q.geometry(spec).ok()?;
                        let offers = sources.get(spec.name.as_str()).map(Vec::as_slice).unwrap_or(&[]);
                        let pieces = direct_pieces(q, &g, offers, from).ok()?;
                        let owner = pieces.first()?.owner;
                        // A per-row set's jobs index its rows' amaxes from their first row: one
                        // job (one piece) per need.
                        let one_job = q.quantization.granularity != Granularity::Row || pieces.len() == 1;
                        (one_job && pieces.iter().all(|p| p.owner == owner)).then_some(owner)
                    })
                    .collect();
                let runner = runners[0].filter(|_| runners.iter().all(|r| *r == runners[0]))?;
                let direct = set.iter().filter(|&&i| needs[i].1.receiver.process == runner.process).count();
                (direct == 0 || direct == set.len()).then_some(runner)
            };
            let from = [Pieces::ReceiversProcess, Pieces::AnyProcess { turn: first }]
                .into_iter()
                .find(|&p| runner(p).is_some());
            let why = || {
                format!(
                    "the {} needs sharing its amax (of tensors {names}) cannot all be quantized in place from one \
                     device (of a process that receives all of them or none; per row, each need from one offer), \
                     nor each where it is offered (per row, in bands of rows alike in every need)",
                    set.len()
                )
            };
            // Each need on its own, as plan() takes it: its receiver's offers, else any process's.
            // Per row, the pieces' bands of rows (first row in the box, rows) alike in every need
            // or apart, so that a band's jobs share their rows' amaxes under one key.
            let exchangeable = || {
                let mut bands: Vec<(u64, u64)> = Vec::new();
                let all = set.iter().all(|&i| {
                    let (spec, q) = needs[i];
                    let Ok(g) = q.geometry(spec) else { return false };
                    let offers = sources.get(spec.name.as_str()).map(Vec::as_slice).unwrap_or(&[]);
                    let pieces = direct_pieces(q, &g, offers, Pieces::ReceiversProcess)
                        .or_else(|_| direct_pieces(q, &g, offers, Pieces::AnyProcess { turn: i }));
                    let Ok(pieces) = pieces else { return false };
                    if q.quantization.granularity == Granularity::Row {
                        bands.extend(pieces.iter().map(|p| band_of(&g, &p.bx)));
                    }
                    true
                });
                bands.sort_unstable();
                bands.dedup();
                all && bands.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0)
            };
            let stageable = one_receiver && set.iter().all(|&i| needs[i].1.staging != 0);
            let decided = match from {
                Some(from) => Ok(Tie::From(from)),
                None if stageable => Err(Refusal { why: why(), stageable }),
                None if exchangeable() => Ok(Tie::Exchanged),
                None => Err(Refusal { why: why(), stageable: one_receiver }),
            };
            if lead.quantization.granularity == Granularity::Row {
                // The bands of rows the set's jobs take, as plan() will cut them: one piece per
                // need from one device, the whole box staged, or each need's own pieces.
                let mut bands: Vec<u64> = Vec::new();
                for &i in &set {
                    let (spec, q) = needs[i];
                    let g = q.geometry(spec)?;
                    let offers = sources.get(spec.name.as_str()).map(Vec::as_slice).unwrap_or(&[]);
                    let pieces = match decided {
                        Ok(Tie::From(from)) => direct_pieces(q, &g, offers, from),
                        Ok(Tie::Exchanged) => direct_pieces(q, &g, offers, Pieces::ReceiversProcess)
                            .or_else(|_| direct_pieces(q, &g, offers, Pieces::AnyProcess { turn: i })),
                        Err(_) => Ok(Vec::new()),
                    };
                    bands.extend(pieces.unwrap_or_default().iter().map(|p| band_of(&g, &p.bx).0));
                }
                bands.push(0);
                bands.sort_unstable();
                bands.dedup();
                for band in bands {
                    ties.row_keys.insert((first, band), next_key);
                    next_key += 1;
                }
            }
            ties.decided.insert(first, decided);
        }
        Ok(ties)
    }

    /// For need `number`, if it shares an amax: where it takes its pieces from, or why not in place.
    fn tied(&self, number: usize) -> Option<std::result::Result<Tie, Refusal>> {
        self.set[number].and_then(|set| self.decided.get(&set).cloned())
    }

    /// Whether need `number`'s set exchanges its amax between devices.
    fn exchanged(&self, number: usize) -> bool {
        matches!(self.tied(number), Some(Ok(Tie::Exchanged)))
    }

    /// The amax key of need `number`'s job of matrix `m` whose rows start at row `r0` of the box:
    /// per tensor, its matrix's; per row, its band's; the same in every process's plan (0: the need
    /// shares none).
    fn key(&self, number: usize, m: u64, r0: u64) -> Result<u64> {
        let Some(set) = self.set[number] else { return Ok(0) };
        let key = self.matrix_keys.get(&(number, m)).or_else(|| self.row_keys.get(&(set, r0)));
        key.copied().ok_or_else(|| {
            Error::new(
                Status::InternalError,
                format!("quantized need {number}: no amax key for matrix {m} row {r0}"),
            )
        })
    }
}

/// The band of rows `bx` holds in the box of `g`: its first row in the box and its rows.
fn band_of(g: &Geometry, bx: &Boxed) -> (u64, u64) {
    let (row_dim, _) = g.matrix_dims();
    row_dim.map_or((0, 1), |d| (bx.lo[d] - g.lo[d], bx.ext[d]))
}

/// Whether two of `pieces` on different devices hold parts of one matrix of the box (their ranges
/// meet in every dimension before the rows and columns).
fn splits_a_matrix(g: &Geometry, pieces: &[Source]) -> bool {
    if pieces.iter().all(|p| p.owner == pieces[0].owner) {
        return false;
    }
    let (row_dim, col_dim) = g.matrix_dims();
    let leading: Vec<usize> = (0..g.n).filter(|&d| Some(d) != row_dim && Some(d) != col_dim).collect();
    let meet = |a: &Source, b: &Source| {
        leading
            .iter()
            .all(|&d| a.bx.lo[d] < b.bx.lo[d] + b.bx.ext[d] && b.bx.lo[d] < a.bx.lo[d] + a.bx.ext[d])
    };
    pieces.iter().enumerate().any(|(i, a)| pieces[i + 1..].iter().any(|b| a.owner != b.owner && meet(a, b)))
}

fn hash_need(h: &mut Fnv1a, spec: &TensorSpec, q: &QuantNeed) {
    h.bytes(spec.name.as_bytes());
    for v in [q.receiver.process, q.receiver.device, q.source.code()] {
        h.u64(v.into());
    }
    for v in q.quantization.codes() {
        h.u64(v.into());
    }
    for v in [q.addr, q.scales, q.scale_row_stride, q.scale_matrix_stride, q.staging] {
        h.u64(v);
    }
    for list in [&q.region.offset, &q.region.extent, &q.strides] {
        h.u64(list.len() as u64);
        list.iter().for_each(|v| h.u64(*v));
    }
}

/// Every table's offers by tensor name, resolved.
fn sources_by_name<'t>(tables: &[&'t Table]) -> Result<HashMap<&'t str, Vec<Source>>> {
    let mut out: HashMap<&str, Vec<Source>> = HashMap::new();
    for table in tables {
        for offer in &table.offers {
            let Some(spec) = table.tensors.get(offer.tensor as usize) else { continue };
            let resolved = offer.resolve(spec)?;
            out.entry(spec.name.as_str()).or_default().push(Source {
                owner: offer.owner,
                addr: offer.addr,
                corner: resolved.lo,
                bx: Boxed::new(resolved.lo, resolved.ext),
                strides: resolved.strides,
            });
        }
    }
    Ok(out)
}

/// Most distinct offers a direct path is looked for among (pairwise disjointness is checked).
const MAX_DIRECT_PIECES: usize = 4096;

/// Which offers a path that quantizes in place may take its pieces from.
#[derive(Clone, Copy, Debug)]
enum Pieces {
    /// Offers in the receiver's process only (the direct path).
    ReceiversProcess,
    /// Offers in any process, the receiver's preferred. Of the replicas of one piece in other
    /// processes, the `turn`-th (modulo their count) is taken, so that the needs in turn spread
    /// the quantizing over the processes that hold copies (data-parallel trainers).
    AnyProcess { turn: usize },
}

/// The offers that quantize the need in place, one per distinct box, or why there are none.
fn direct_pieces(
    q: &QuantNeed,
    g: &Geometry,
    offers: &[Source],
    from: Pieces,
) -> std::result::Result<Vec<Source>, String> {
    let n = g.n;
    let whole = g.whole();
    let (place, turn) = match from {
        Pieces::ReceiversProcess => (" in the receiver's process", 0),
        Pieces::AnyProcess { turn } => ("", turn),
    };
    // Every offer meeting the box, by distinct box.
    let mut candidates: BTreeMap<(Vec<u64>, Vec<u64>), Vec<Source>> = BTreeMap::new();
    for s in offers {
        if matches!(from, Pieces::ReceiversProcess) && s.owner.process != q.receiver.process {
            continue;
        }
        if s.bx.intersect(&whole, n).is_none() {
            continue;
        }
        let key = (s.bx.lo[..n].to_vec(), s.bx.ext[..n].to_vec());
        candidates.entry(key).or_default().push(*s);
    }
    if candidates.is_empty() {
        return Err(format!("nothing{place} offers it"));
    }
    if candidates.len() > MAX_DIRECT_PIECES {
        return Err(format!(
            "{} distinct offers meet it (at most {MAX_DIRECT_PIECES} are tried)",
            candidates.len()
        ));
    }
    // One offer per box: the receiver's own device, else another of its devices, else the turn's
    // among the other processes' replicas.
    let chosen = candidates.into_values().map(|mut replicas| {
        replicas
            .sort_by_key(|s| (s.owner.process != q.receiver.process, s.owner != q.receiver, s.owner, s.addr));
        replicas.dedup_by_key(|s| s.owner);
        let first = replicas[0];
        if first.owner.process == q.receiver.process {
            return first;
        }
        replicas[turn % replicas.len()]
    });
    let pieces: Vec<Source> =
        chosen.map(|s| Source { bx: s.bx.intersect(&whole, n).expect("kept above"), ..s }).collect();
    for (i, a) in pieces.iter().enumerate() {
        if pieces[i + 1..].iter().any(|b| a.bx.intersect(&b.bx, n).is_some()) {
            return Err(format!("offers of it{place} overlap without being replicas"));
        }
    }
    let covered: u64 = pieces.iter().map(|p| p.bx.volume(n)).sum();
    if covered != whole.volume(n) {
        return Err(format!("offers{place} hold {covered} of its {} elements", whole.volume(n)));
    }
    let (rows, cols) = g.rows_cols();
    let (block_rows, block_cols) = q.quantization.block_shape(rows, cols);
    let (row_dim, col_dim) = g.matrix_dims();
    // A per-tensor box of one matrix may lie across offers: their jobs share its scale, hence its
    // amax (in one batch, or exchanged between devices: ScaleTies). Of several matrices, each lies
    // in one offer (the need's jobs take one amax key, which would join the matrices).
    let whole_blocks = q.quantization.granularity != Granularity::Tensor || g.matrices() != 1;
    for p in &pieces {
        for (dim, block, what) in [(row_dim, block_rows, "row"), (col_dim, block_cols, "column")] {
            let Some(d) = dim.filter(|_| whole_blocks) else { continue };
            let (start, end) = (p.bx.lo[d] - g.lo[d], p.bx.lo[d] + p.bx.ext[d] - g.lo[d]);
            if start % block != 0 || (end != g.ext[d] && end % block != 0) {
                return Err(format!(
                    "a block of {block_rows} x {block_cols} spans two offers: one holds {what}s {start}..{end} of it"
                ));
            }
        }
        if let Some(d) = col_dim {
            if p.bx.ext[d] > 1 && p.strides[d] != 1 {
                return Err(format!("an offer's rows are not contiguous (column stride {})", p.strides[d]));
            }
        }
    }
    Ok(pieces)
}

/// The jobs of the paths that quantize in place (direct and sender), one route per source device.
fn direct_routes(
    spec: &TensorSpec,
    q: &QuantNeed,
    g: &Geometry,
    pieces: &[Source],
    amax_key: &AmaxKeyOf,
    budget: &mut u64,
) -> Result<Vec<QuantRoute>> {
    let mut by_runner: BTreeMap<Endpoint, Vec<QuantJob>> = BTreeMap::new();
    for p in pieces {
        let jobs = by_runner.entry(p.owner).or_default();
        let (row_dim, _) = g.matrix_dims();
        matrix_jobs(q, g, &p.bx, amax_key, budget, jobs, |at| {
            (offer_address(p, g, at), row_dim.map_or(0, |d| p.strides[d]))
        })?;
    }
    by_runner
        .into_iter()
        .map(|(runner, jobs)| {
            check(spec, &jobs, "its sources in place")?;
            Ok(QuantRoute {
                need: 0,
                tensor: c_name(&spec.name),
                receiver: q.receiver,
                runner,
                path: if runner.process == q.receiver.process {
                    QuantPath::Direct
                } else {
                    QuantPath::Sender
                },
                jobs,
                amax_exchanged: false,
            })
        })
        .collect()
}

/// Address of element `at` (inside the offer's box) in the offer piece `p` was cut from.
fn offer_address(p: &Source, g: &Geometry, at: &Dims) -> u64 {
    let elements: u64 = (0..g.n).map(|d| (at[d] - p.corner[d]) * p.strides[d]).sum();
    p.addr + elements * g.elem
}

/// The staged path's route: one job per matrix, reading the staging buffer.
fn staged_route(
    spec: &TensorSpec,
    q: &QuantNeed,
    g: &Geometry,
    amax_key: &AmaxKeyOf,
    budget: &mut u64,
) -> Result<QuantRoute> {
    let strides = row_major(g.n, &g.ext);
    let mut jobs = Vec::new();
    let (row_dim, _) = g.matrix_dims();
    matrix_jobs(q, g, &g.whole(), amax_key, budget, &mut jobs, |at| {
        let mut elements = 0u64;
        for d in 0..g.n {
            elements += (at[d] - g.lo[d]) * strides[d];
        }
        (q.staging + elements * g.elem, row_dim.map_or(0, |d| strides[d]))
    })?;
    check(spec, &jobs, "its staging")?;
    Ok(QuantRoute {
        need: 0,
        tensor: c_name(&spec.name),
        receiver: q.receiver,
        runner: q.receiver,
        path: QuantPath::Staged,
        jobs,
        amax_exchanged: false,
    })
}

/// `name` as a C string, up to its first NUL.
fn c_name(name: &str) -> std::ffi::CString {
    let bytes = name.as_bytes().split(|&b| b == 0).next().unwrap_or_default();
    std::ffi::CString::new(bytes).unwrap_or_default()
}

/// Checks the jobs of one route, naming the tensor and the path.
fn check(spec: &TensorSpec, jobs: &[QuantJob], path: &str) -> Result<()> {
    crate::quant::check_jobs(jobs).map_err(|e| {
        Error::new(
            e.status,
            format!("quantized need of tensor '{}', quantized from {path}: {}", spec.name, e.message),
        )
    })
}

/// A job's amax key ([`QuantJob::amax_key`]) from its matrix's number in the need's box and its
/// first row in the box ([`ScaleTies::key`]).
type AmaxKeyOf<'a> = dyn Fn(u64, u64) -> Result<u64> + 'a;

/// Appends one job per matrix of `bx` (a part of the need's box whose rows and columns start on
/// block boundaries), each with its `amax_key`. `source(at)`: the source address of element `at`
/// and the source row stride in elements.
fn matrix_jobs(
    q: &QuantNeed,
    g: &Geometry,
    bx: &Boxed,
    amax_key: &AmaxKeyOf,
    budget: &mut u64,
    jobs: &mut Vec<QuantJob>,
    source: impl Fn(&Dims) -> (u64, u64),
) -> Result<()> {
    let leading = g.leading();
    let (row_dim, col_dim) = g.matrix_dims();
    let (rows, cols) = g.rows_cols();
    let (block_rows, block_cols) = q.quantization.block_shape(rows, cols);
    let scale_size = q.quantization.scale_kind().size();
    let count: u64 = bx.ext[..leading].iter().product();
    spend(budget, count)?;
    jobs.try_reserve(count as usize)
        .map_err(|_| Error::new(Status::OutOfMemory, "no memory for the quantization jobs"))?;
    let mut index = vec![0u64; leading];
    for _ in 0..count {
        let mut at = bx.lo;
        for d in 0..leading {
            at[d] = bx.lo[d] + index[d];
        }
        // Matrix number within the need, row-major over its leading dimensions.
        let m = (0..leading).fold(0u64, |m, d| m * g.ext[d] + (at[d] - g.lo[d]));
        let mut codes: u64 = (0..leading).map(|d| (at[d] - g.lo[d]) * g.strides[d]).sum();
        let (r0, c0) = (row_dim.map_or(0, |d| at[d] - g.lo[d]), col_dim.map_or(0, |d| at[d] - g.lo[d]));
        codes += row_dim.map_or(0, |d| r0 * g.strides[d]) + c0;
        let scale = m * q.scale_matrix_stride + (r0 / block_rows) * q.scale_row_stride + c0 / block_cols;
        let (src, src_stride) = source(&at);
        jobs.push(QuantJob {
            quantization: q.quantization,
            source: q.source,
            src,
            rows: g.extent_of(bx, row_dim),
            cols: g.extent_of(bx, col_dim),
            src_stride,
            dst: q.addr + codes,
            dst_stride: row_dim.map_or(0, |d| g.strides[d]),
            scales: q.scales + scale * scale_size,
            scale_stride: q.scale_row_stride,
            amax_key: amax_key(m, r0)?,
        });
        // Next index, last leading dimension fastest.
        for d in (0..leading).rev() {
            index[d] += 1;
            if index[d] < bx.ext[d] {
                break;
            }
            index[d] = 0;
        }
    }
    Ok(())
}

/// Takes `jobs` from what is left of the planner's segment limit (`budget`).
fn spend(budget: &mut u64, jobs: u64) -> Result<()> {
    *budget = budget.checked_sub(jobs).ok_or_else(|| {
        Error::unsupported("quantized needs make more quantization jobs than the planner's segment limit")
    })?;
    Ok(())
}

/// Adds the quantized routes' counts to their receivers' (an entry made for a receiver that has
/// none, from `shared`: the inputs every receiver's counts carry) and to the plan's `total`. A
/// share (`process` Some) counts its own receivers' needs only, as its other counts do, not those
/// it quantizes for another process.
pub(crate) fn tally(
    routes: &[QuantRoute],
    process: Option<u32>,
    total: &mut PlanStats,
    receivers: &mut Vec<(Endpoint, PlanStats)>,
    shared: &PlanStats,
) {
    let mut last_need = None;
    for route in routes.iter().filter(|r| process.is_none_or(|p| p == r.receiver.process)) {
        let at = match receivers.binary_search_by_key(&route.receiver, |(e, _)| *e) {
            Ok(at) => at,
            Err(at) => {
                let fresh = PlanStats {
                    offers_in: shared.offers_in,
                    replica_sets: shared.replica_sets,
                    ..PlanStats::default()
                };
                receivers.insert(at, (route.receiver, fresh));
                at
            }
        };
        let new_need = last_need.replace(route.need) != Some(route.need);
        for stats in [&mut receivers[at].1, &mut *total] {
            stats.quantized_needs += u64::from(new_need);
            stats.quantized_elements = stats.quantized_elements.saturating_add(route.elements());
            let bytes = match route.path {
                QuantPath::Direct => &mut stats.quantized_direct_bytes,
                QuantPath::Staged => &mut stats.quantized_staged_bytes,
                QuantPath::Sender => &mut stats.quantized_sent_bytes,
            };
            *bytes = bytes.saturating_add(route.source_bytes());
        }
    }
}
