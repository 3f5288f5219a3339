//! Realistic refit workloads: the shard tables of a weight refit from training publishers (laid out as
//! Megatron-LM holds them) to inference receivers (laid out as vLLM holds them), for real model shapes.
//!
//! A [`Workload`] is generated once from a [`Spec`] with every address expressed as a byte offset into
//! one of its [`Buffer`]s. The caller allocates the buffers wherever it likes (fake addresses for the
//! CPU benchmark, host memory for the host backend, device memory for GPU runs) and gets the planner's
//! input with [`Workload::tables`], one [`Table`] per process rank.
//!
//! Tensors are the Hugging Face checkpoint tensors (`model.layers.{i}.self_attn.q_proj.weight`, one
//! tensor per expert weight), which is what vLLM's `load_weights` consumes: both sides describe their
//! parameters as boxes of those tensors.
//!
//! [`Spec`] describes grouped-query models ([`Model`]: Llama, Qwen3, Qwen3-MoE) on single-stage
//! Megatron publishers and vLLM tensor-parallel receivers. [`ArchSpec`] describes any [`Arch`]
//! (also DeepSeek-V3 / Kimi-K2 latent attention with shared experts, tied embeddings) on
//! [`MegatronRanks`] (pipeline stages too) and [`VllmRanks`] (data and expert parallelism too);
//! a [`Spec`] converts into one. Both frameworks pad the vocabulary their own way before splitting
//! it, so vocabularies that do not divide by TP are laid out as each framework lays them out.
//!
//! This is a development crate (`publish = false`): refit's demo, benches and integration tests use it;
//! the library does not ship it.

mod arch;
mod megatron;
mod model;
mod param;
mod pattern;
mod vllm;

pub use arch::{Arch, Attention, Experts, Mla};
pub use megatron::{Megatron, MegatronRanks};
pub use model::{CheckpointTensors, LayerTensors, MlaTensors, MlpTensors, Model, Moe};
pub use param::{Param, Piece};
pub use pattern::element_value;
pub use vllm::{ExpertPlacement, Vllm, VllmRanks};

use refit::plan::{Endpoint, Need, Offer, Region, Table};
use refit::{Error, Result};
use std::collections::BTreeMap;

/// How one side's parameters sit in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Packing {
    /// Every parameter is its own allocation (its own [`Buffer`]).
    Separate,
    /// Each endpoint's parameters are packed back to back in one buffer, aligned to 256
    /// bytes. Publishers pack in reverse parameter order, as Megatron's distributed-optimizer
    /// parameter buffer does (backward order); receivers in parameter order.
    Packed,
}

impl Packing {
    /// Alignment of each parameter inside a packed buffer.
    pub(crate) const PACK_ALIGN: u64 = 256;
}

/// Which side of the refit a buffer belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    Publisher,
    Receiver,
}

/// One allocation the caller must provide: `bytes` on `endpoint`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Buffer {
    pub endpoint: Endpoint,
    pub role: Role,
    pub bytes: u64,
    /// The framework parameter it holds, or a name for a packed buffer.
    pub name: String,
}

/// A box of a tensor at `offset` bytes into buffer `buffer`, stored row-major over `region.extent`.
/// As an offer `endpoint` is the publisher; as a need, the receiver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placed {
    pub tensor: u32,
    pub endpoint: Endpoint,
    pub buffer: u32,
    pub offset: u64,
    pub region: Region,
}

/// What to generate, for a grouped-query [`Model`] (see [`ArchSpec`] for every family).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Spec {
    pub model: Model,
    pub publishers: Megatron,
    pub publisher_layout: Packing,
    pub receivers: Vllm,
    pub receiver_layout: Packing,
    /// Give every offer a digest of its box (equal for replicas), so the planner's replica check runs.
    pub digests: bool,
}

/// Endpoints `(process, 0)` for `ranks` processes from `rank0`: one GPU per process.
pub fn endpoints(rank0: u32, ranks: u32) -> Vec<Endpoint> {
    (0..ranks).map(|r| Endpoint { process: rank0 + r, device: 0 }).collect()
}

/// Endpoints `(process, device)` for devices `first..first + count` of one process.
pub fn devices(process: u32, first: u32, count: u32) -> Vec<Endpoint> {
    (first..first + count).map(|device| Endpoint { process, device }).collect()
}

impl Spec {
    /// Qwen3-30B-A3B: Megatron EP8 publishers on ranks 0..8 (one GPU each) holding 16 experts each and
    /// a full replica of the non-expert weights, to vLLM TP2 receivers on ranks 8 and 9. Receivers'
    /// parameters are separate allocations.
    pub fn qwen3_ep8_to_tp2(publisher_layout: Packing) -> Spec {
        Spec {
            model: Model::qwen3_30b_a3b(),
            publishers: Megatron { endpoints: endpoints(0, 8), tp: 1, ep: 8, grouped_experts: true },
            publisher_layout,
            receivers: Vllm { endpoints: endpoints(8, 2) },
            receiver_layout: Packing::Separate,
            digests: false,
        }
    }

    /// Llama-3-70B: Megatron TP8 publishers on ranks `0..8 * dp` (`dp` data-parallel replicas) to vLLM
    /// TP2 receivers on the next two ranks.
    pub fn llama3_70b_tp8_to_tp2(publisher_layout: Packing, dp: u32) -> Spec {
        Spec {
            model: Model::llama3_70b(),
            publishers: Megatron { endpoints: endpoints(0, 8 * dp), tp: 8, ep: 1, grouped_experts: true },
            publisher_layout,
            receivers: Vllm { endpoints: endpoints(8 * dp, 2) },
            receiver_layout: Packing::Separate,
            digests: false,
        }
    }

    /// Qwen3-30B-A3B colocated on one process with two GPUs: EP2 publishers (64 experts each, replicated
    /// non-expert weights) and TP2 receivers on the same devices 0 and 1 of rank 0.
    pub fn qwen3_colocated_ep2_tp2(publisher_layout: Packing) -> Spec {
        let devices: Vec<Endpoint> = (0..2).map(|device| Endpoint { process: 0, device }).collect();
        Spec {
            model: Model::qwen3_30b_a3b(),
            publishers: Megatron { endpoints: devices.clone(), tp: 1, ep: 2, grouped_experts: true },
            publisher_layout,
            receivers: Vllm { endpoints: devices },
            receiver_layout: Packing::Separate,
            digests: false,
        }
    }

    /// The same spec with each Megatron expert in its own pair of weights (TEGroupedMLP) instead of
    /// grouped weights.
    pub fn with_expert_weights(mut self) -> Spec {
        self.publishers.grouped_experts = false;
        self
    }

    /// The same spec with `model` replaced (e.g. `spec.model.clone().with_layers(2)`).
    pub fn with_model(mut self, model: Model) -> Spec {
        self.model = model;
        self
    }
}

/// What to generate, for any [`Arch`] and every parallelism [`MegatronRanks`] and [`VllmRanks`]
/// cover. [`Spec`] is the grouped-query, single-stage subset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArchSpec {
    pub model: Arch,
    pub publishers: MegatronRanks,
    pub publisher_layout: Packing,
    pub receivers: VllmRanks,
    pub receiver_layout: Packing,
    /// Give every offer a digest of its box (equal for replicas), so the planner's replica check runs.
    pub digests: bool,
}

impl ArchSpec {
    /// `model` from `publishers` to `receivers`, every parameter its own allocation, no digests.
    pub fn new(model: Arch, publishers: MegatronRanks, receivers: VllmRanks) -> ArchSpec {
        ArchSpec {
            model,
            publishers,
            publisher_layout: Packing::Separate,
            receivers,
            receiver_layout: Packing::Separate,
            digests: false,
        }
    }

    /// DeepSeek-V3 from Megatron TP2 x EP8 publishers (8 ranks, 32 experts each; ranks 0..8) to a
    /// vLLM TP8 group (ranks 8..16) without expert parallelism, every parameter packed into the
    /// publishers' buffers as `publisher_layout` says.
    pub fn deepseek_v3_tp2_ep8_to_tp8(publisher_layout: Packing) -> ArchSpec {
        ArchSpec {
            publisher_layout,
            ..ArchSpec::new(
                Arch::deepseek_v3(),
                MegatronRanks::new(endpoints(0, 8), 2, 8),
                VllmRanks::tp(endpoints(8, 8)),
            )
        }
    }

    /// Kimi-K2 from Megatron TP8 x EP16 x PP4 publishers (64 ranks, 16 per stage; stages of 16,
    /// 15, 15 and 15 layers) to a vLLM TP8 group with expert parallelism (48 whole experts each).
    pub fn kimi_k2_pp4_to_tp8_ep(publisher_layout: Packing) -> ArchSpec {
        let publishers = MegatronRanks {
            first_stage_layers: Some(16),
            ..MegatronRanks::new(endpoints(0, 64), 8, 16).with_pp(4)
        };
        ArchSpec {
            publisher_layout,
            ..ArchSpec::new(
                Arch::kimi_k2(),
                publishers,
                VllmRanks::tp(endpoints(64, 8)).with_expert_parallel(),
            )
        }
    }

    /// The same spec with `model` replaced.
    pub fn with_model(mut self, model: Arch) -> ArchSpec {
        self.model = model;
        self
    }
}

impl From<&Spec> for ArchSpec {
    fn from(s: &Spec) -> ArchSpec {
        ArchSpec {
            model: Arch::from(&s.model),
            publishers: MegatronRanks::from(&s.publishers),
            publisher_layout: s.publisher_layout,
            receivers: VllmRanks::from(&s.receivers),
            receiver_layout: s.receiver_layout,
            digests: s.digests,
        }
    }
}

/// A description a [`Workload`] is generated from: [`Spec`] or [`ArchSpec`].
pub trait Layouts: Clone {
    /// The tensors, and every publisher's and receiver's parameters and buffers.
    fn layouts(&self) -> Result<Generated>;
    /// Whether offers carry digests.
    fn digests(&self) -> bool;
}

/// What a [`Layouts`] generates.
pub struct Generated {
    pub catalog: CheckpointTensors,
    /// Publishers' parameters, packed as the publisher layout says.
    pub publishers: Vec<Param>,
    /// Publishers' persistent buffers: always allocations of their own.
    pub publisher_buffers: Vec<Param>,
    pub receivers: Vec<Param>,
    pub publisher_layout: Packing,
    pub receiver_layout: Packing,
}

impl Layouts for ArchSpec {
    fn layouts(&self) -> Result<Generated> {
        let catalog = CheckpointTensors::of(&self.model);
        let (publishers, publisher_buffers) = self.publishers.held(&self.model, &catalog)?;
        let receivers = self.receivers.params(&self.model, &catalog)?;
        Ok(Generated {
            catalog,
            publishers,
            publisher_buffers,
            receivers,
            publisher_layout: self.publisher_layout,
            receiver_layout: self.receiver_layout,
        })
    }

    fn digests(&self) -> bool {
        self.digests
    }
}

impl Layouts for Spec {
    fn layouts(&self) -> Result<Generated> {
        self.model.validate()?;
        ArchSpec::from(self).layouts()
    }

    fn digests(&self) -> bool {
        self.digests
    }
}

/// A generated refit: tensors, the buffers to allocate, and every offer and need placed in them.
#[derive(Clone, Debug)]
pub struct Workload<S = Spec> {
    pub spec: S,
    pub catalog: CheckpointTensors,
    pub buffers: Vec<Buffer>,
    pub offers: Vec<Placed>,
    pub needs: Vec<Placed>,
}

impl<S: Layouts> Workload<S> {
    /// Generates the workload of `spec`. Fails with `INVALID_ARGUMENT` when the model or a
    /// parallelism does not divide evenly the way the framework requires.
    pub fn generate(spec: &S) -> Result<Workload<S>> {
        let g = spec.layouts()?;
        let mut buffers = Vec::new();
        let mut offers = place(g.publishers, g.publisher_layout, Role::Publisher, &mut buffers);
        offers.extend(place(g.publisher_buffers, Packing::Separate, Role::Publisher, &mut buffers));
        let needs = place(g.receivers, g.receiver_layout, Role::Receiver, &mut buffers);
        Ok(Workload { spec: spec.clone(), catalog: g.catalog, buffers, offers, needs })
    }
}

impl<S> Workload<S> {
    /// Bytes of one placed box.
    pub fn bytes(&self, p: &Placed) -> u64 {
        p.region.extent.iter().product::<u64>() * self.catalog.tensors[p.tensor as usize].elem_size as u64
    }

    /// Bytes each receiver needs, by receiver endpoint.
    pub fn need_bytes(&self) -> BTreeMap<Endpoint, u64> {
        let mut out = BTreeMap::new();
        for n in &self.needs {
            *out.entry(n.endpoint).or_insert(0) += self.bytes(n);
        }
        out
    }

    /// Addresses for every buffer as if each were its own allocation in one address space: aligned to
    /// 4 KiB, separated by gaps of irregular size so that no two buffers are adjacent and no stride
    /// between buffers repeats by accident. For planning without memory (the CPU benchmark).
    pub fn fake_bases(&self) -> Vec<u64> {
        const PAGE: u64 = 4096;
        let mut cursor = 1u64 << 40;
        self.buffers
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let gap = PAGE * (1 + mix(i as u64) % 61);
                let base = (cursor + gap).next_multiple_of(PAGE);
                cursor = base + b.bytes;
                base
            })
            .collect()
    }
}

impl<S: Layouts> Workload<S> {
    /// The planner's input: one table per process rank (ascending), holding that rank's offers and
    /// needs with `bases[i]` the address of buffer `i`, and the tensors they name. Fails with
    /// `INVALID_ARGUMENT` when `bases` does not have one entry per buffer or an address overflows.
    pub fn tables(&self, bases: &[u64]) -> Result<Vec<Table>> {
        if bases.len() != self.buffers.len() {
            return Err(Error::invalid_argument(format!(
                "{} buffer bases given for {} buffers",
                bases.len(),
                self.buffers.len()
            )));
        }
        let addr = |p: &Placed| -> Result<u64> {
            let buffer = &self.buffers[p.buffer as usize];
            let base = bases[p.buffer as usize];
            base.checked_add(buffer.bytes).map(|_| base + p.offset).ok_or_else(|| {
                Error::invalid_argument(format!(
                    "buffer {} ({}) at {base:#x} overflows",
                    p.buffer, buffer.name
                ))
            })
        };
        let mut by_rank: BTreeMap<u32, RankTable> = BTreeMap::new();
        for o in &self.offers {
            let table = by_rank.entry(o.endpoint.process).or_default();
            let tensor = table.tensor(o.tensor, &self.catalog);
            let digest =
                self.spec.digests().then(|| digest(&self.catalog.tensors[o.tensor as usize].name, &o.region));
            table.table.offers.push(Offer {
                tensor,
                owner: o.endpoint,
                addr: addr(o)?,
                region: o.region.clone(),
                strides: None,
                digest,
            });
        }
        for n in &self.needs {
            let table = by_rank.entry(n.endpoint.process).or_default();
            let tensor = table.tensor(n.tensor, &self.catalog);
            table.table.needs.push(Need {
                tensor,
                receiver: n.endpoint,
                addr: addr(n)?,
                region: n.region.clone(),
                perm: None,
                strides: row_major(&n.region.extent),
            });
        }
        Ok(by_rank.into_values().map(|t| t.table).collect())
    }
}

/// splitmix64's finalizer: successive inputs give unrelated outputs, so sums of consecutive gaps do not
/// repeat (a linear congruence would make every layer's buffers sit at one constant stride).
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Element strides of a row-major array of `extent`.
pub fn row_major(extent: &[u64]) -> Vec<u64> {
    let mut strides = vec![1; extent.len()];
    for d in (0..extent.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * extent[d + 1];
    }
    strides
}

/// A stand-in digest of a tensor box's bytes: a function of what the bytes are (name and box), so
/// replicas agree. FNV-1a.
fn digest(name: &str, region: &Region) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    };
    eat(name.as_bytes());
    for v in region.offset.iter().chain(&region.extent) {
        eat(&v.to_le_bytes());
    }
    h
}

/// A table under construction, with the map from catalog tensor to this table's tensor index.
#[derive(Default)]
struct RankTable {
    table: Table,
    index: Vec<u32>,
}

impl RankTable {
    fn tensor(&mut self, t: u32, catalog: &CheckpointTensors) -> u32 {
        if self.index.is_empty() {
            self.index = vec![u32::MAX; catalog.tensors.len()];
        }
        let slot = &mut self.index[t as usize];
        if *slot == u32::MAX {
            *slot = self.table.tensors.len() as u32;
            self.table.tensors.push(catalog.tensors[t as usize].clone());
        }
        *slot
    }
}

/// Gives every parameter a buffer (its own, or a slot in its endpoint's packed buffer) and returns its
/// pieces placed there.
fn place(params: Vec<Param>, layout: Packing, role: Role, buffers: &mut Vec<Buffer>) -> Vec<Placed> {
    let mut placed = Vec::new();
    let mut put = |param: &Param, buffer: usize, base: u64| {
        for piece in &param.pieces {
            placed.push(Placed {
                tensor: piece.tensor,
                endpoint: param.endpoint,
                buffer: buffer as u32,
                offset: base + piece.offset,
                region: piece.region.clone(),
            });
        }
    };
    match layout {
        Packing::Separate => {
            for param in &params {
                buffers.push(Buffer {
                    endpoint: param.endpoint,
                    role,
                    bytes: param.bytes,
                    name: param.name.clone(),
                });
                put(param, buffers.len() - 1, 0);
            }
        }
        Packing::Packed => {
            let mut packed: BTreeMap<Endpoint, Vec<&Param>> = BTreeMap::new();
            for param in &params {
                packed.entry(param.endpoint).or_default().push(param);
            }
            for (endpoint, mut list) in packed {
                if role == Role::Publisher {
                    list.reverse();
                }
                let index = buffers.len();
                let mut cursor = 0u64;
                for param in list {
                    put(param, index, cursor);
                    cursor = (cursor + param.bytes).next_multiple_of(Packing::PACK_ALIGN);
                }
                let side = match role {
                    Role::Publisher => "param_buffer",
                    Role::Receiver => "weights",
                };
                let name = format!("rank{}.device{}.{side}", endpoint.process, endpoint.device);
                buffers.push(Buffer { endpoint, role, bytes: cursor, name });
            }
        }
    }
    placed
}
