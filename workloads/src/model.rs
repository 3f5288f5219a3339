//! Model configurations and the Hugging Face tensors they define: the names and global shapes that
//! vLLM's `load_weights` sees, which are the tensors both sides of a refit agree on.

use crate::arch::{Arch, Attention};
use refit::plan::TensorSpec;
use refit::{Error, Result};

/// A mixture-of-experts block: `experts` SwiGLU experts of intermediate size `ffn` and a router of
/// `[experts, hidden]`. No shared experts (as in Qwen3 MoE).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Moe {
    pub experts: u64,
    pub ffn: u64,
}

/// A decoder-only transformer in the Llama / Qwen3 family, as far as weight shapes go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Model {
    pub name: String,
    pub layers: u64,
    pub hidden: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    /// Per-head RMSNorm of q and k (`q_norm`, `k_norm` of `[head_dim]`), as in Qwen3.
    pub qk_norm: bool,
    /// Dense SwiGLU intermediate size; ignored when `moe` is set.
    pub ffn: u64,
    pub moe: Option<Moe>,
    pub vocab: u64,
    pub elem_size: u32,
    pub dtype: u32,
}

impl Model {
    /// dtype code the workloads give BF16 tensors (the planner only compares codes for consistency).
    pub(crate) const DTYPE_BF16: u32 = Arch::DTYPE_BF16;

    /// Qwen3-30B-A3B in BF16: 48 layers, hidden 2048, 32 q / 4 kv heads of 128 with q/k norms, 128
    /// experts of intermediate 768, vocabulary 151,936, untied embeddings. 30,532,122,624 parameters.
    pub fn qwen3_30b_a3b() -> Model {
        Model {
            name: "Qwen3-30B-A3B".into(),
            layers: 48,
            hidden: 2048,
            heads: 32,
            kv_heads: 4,
            head_dim: 128,
            qk_norm: true,
            ffn: 0,
            moe: Some(Moe { experts: 128, ffn: 768 }),
            vocab: 151_936,
            elem_size: 2,
            dtype: Model::DTYPE_BF16,
        }
    }

    /// Llama-3-70B in BF16: 80 layers, hidden 8192, 64 q / 8 kv heads of 128, intermediate 28,672,
    /// vocabulary 128,256, untied embeddings. 70,553,706,496 parameters.
    pub fn llama3_70b() -> Model {
        Model {
            name: "Llama-3-70B".into(),
            layers: 80,
            hidden: 8192,
            heads: 64,
            kv_heads: 8,
            head_dim: 128,
            qk_norm: false,
            ffn: 28_672,
            moe: None,
            vocab: 128_256,
            elem_size: 2,
            dtype: Model::DTYPE_BF16,
        }
    }

    /// The same model with `layers` decoder layers (tests, demos, size sweeps).
    pub fn with_layers(mut self, layers: u64) -> Model {
        self.layers = layers;
        self
    }

    /// The same MoE model with `experts` experts (size sweeps). No effect on a dense model.
    pub fn with_experts(mut self, experts: u64) -> Model {
        if let Some(moe) = &mut self.moe {
            moe.experts = experts;
        }
        self
    }

    /// Rejects shapes no framework could hold: zero sizes, heads not grouping evenly.
    pub(crate) fn validate(&self) -> Result<()> {
        let sizes = [
            ("layers", self.layers),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("vocab", self.vocab),
            ("elem_size", self.elem_size as u64),
        ];
        for (what, value) in sizes {
            if value == 0 {
                return Err(Error::invalid_argument(format!("model {}: {what} is 0", self.name)));
            }
        }
        if self.heads % self.kv_heads != 0 {
            return Err(Error::invalid_argument(format!(
                "model {}: {} query heads do not group evenly over {} key/value heads",
                self.name, self.heads, self.kv_heads
            )));
        }
        match self.moe {
            Some(moe) if moe.experts == 0 || moe.ffn == 0 => Err(Error::invalid_argument(format!(
                "model {}: MoE with {} experts of intermediate {}",
                self.name, moe.experts, moe.ffn
            ))),
            None if self.ffn == 0 => {
                Err(Error::invalid_argument(format!("model {}: dense intermediate size is 0", self.name)))
            }
            _ => Ok(()),
        }
    }
}

/// Indices (into [`CheckpointTensors::tensors`]) of one decoder layer's tensors.
#[derive(Clone, Debug)]
pub struct LayerTensors {
    pub input_norm: u32,
    /// `q_proj`, `k_proj`, `v_proj` of grouped-query attention; [`CheckpointTensors::ABSENT`] in a
    /// latent-attention layer (its tensors are in `mla`).
    pub q: u32,
    pub k: u32,
    pub v: u32,
    /// `o_proj`, in either kind of attention.
    pub o: u32,
    /// `q_norm`, `k_norm` when the model has them.
    pub qk_norm: Option<(u32, u32)>,
    /// Latent attention's tensors, or None for grouped-query attention.
    pub mla: Option<MlaTensors>,
    pub post_norm: u32,
    pub mlp: MlpTensors,
    /// `[gate_proj, up_proj, down_proj]` of `mlp.shared_experts` in a MoE layer that has them.
    pub shared_experts: Option<[u32; 3]>,
    /// `mlp.gate.e_score_correction_bias` (FP32) in a MoE layer that has it.
    pub router_bias: Option<u32>,
}

/// A latent-attention layer's tensors other than `o_proj`.
#[derive(Clone, Debug)]
pub struct MlaTensors {
    /// `q_a_proj` and `q_a_layernorm` when queries are compressed (`q_lora_rank` set).
    pub q_a: Option<(u32, u32)>,
    /// `q_b_proj` when queries are compressed, else `q_proj`.
    pub q: u32,
    pub kv_a: u32,
    pub kv_a_norm: u32,
    pub kv_b: u32,
}

/// A layer's feed-forward tensors.
#[derive(Clone, Debug)]
pub enum MlpTensors {
    Dense {
        gate: u32,
        up: u32,
        down: u32,
    },
    /// `router` is `mlp.gate.weight`; `experts[e]` is `[gate_proj, up_proj, down_proj]` of expert `e`.
    Moe {
        router: u32,
        experts: Vec<[u32; 3]>,
    },
}

/// Every Hugging Face tensor of a model in checkpoint order, with per-layer indices so the publisher
/// and receiver layouts can name tensors without string lookups.
#[derive(Clone, Debug)]
pub struct CheckpointTensors {
    pub tensors: Vec<TensorSpec>,
    pub embed: u32,
    pub layers: Vec<LayerTensors>,
    pub final_norm: u32,
    /// `lm_head.weight`, or `embed` itself when the embeddings are tied (the checkpoint then has no
    /// output tensor of its own).
    pub lm_head: u32,
}

impl CheckpointTensors {
    /// The index of a tensor a layer does not have.
    pub const ABSENT: u32 = u32::MAX;

    pub fn new(model: &Model) -> CheckpointTensors {
        CheckpointTensors::of(&Arch::from(model))
    }

    /// The tensors of any covered architecture.
    pub fn of(arch: &Arch) -> CheckpointTensors {
        let mut c = Catalog { tensors: Vec::new(), dtype: arch.dtype, elem_size: arch.elem_size };
        let h = arch.hidden;
        let embed = c.add("model.embed_tokens.weight".into(), vec![arch.vocab, h]);
        let layers = (0..arch.layers).map(|i| c.layer(arch, i)).collect();
        let final_norm = c.add("model.norm.weight".into(), vec![h]);
        let lm_head =
            if arch.tied_embeddings { embed } else { c.add("lm_head.weight".into(), vec![arch.vocab, h]) };
        CheckpointTensors { tensors: c.tensors, embed, layers, final_norm, lm_head }
    }

    /// Elements of tensor `t`.
    pub fn elements(&self, t: u32) -> u64 {
        self.tensors[t as usize].shape.iter().product()
    }
}

/// The tensor list under construction.
struct Catalog {
    tensors: Vec<TensorSpec>,
    dtype: u32,
    elem_size: u32,
}

impl Catalog {
    /// Adds a tensor of the model's element type.
    fn add(&mut self, name: String, shape: Vec<u64>) -> u32 {
        self.add_typed(name, shape, (self.dtype, self.elem_size))
    }

    fn add_typed(&mut self, name: String, shape: Vec<u64>, (dtype, elem_size): (u32, u32)) -> u32 {
        self.tensors.push(TensorSpec { name, dtype, elem_size, shape });
        (self.tensors.len() - 1) as u32
    }

    /// `[gate_proj, up_proj, down_proj]` of a SwiGLU MLP named `prefix`.
    fn mlp(&mut self, prefix: &str, ffn: u64, hidden: u64) -> [u32; 3] {
        [
            self.add(format!("{prefix}.gate_proj.weight"), vec![ffn, hidden]),
            self.add(format!("{prefix}.up_proj.weight"), vec![ffn, hidden]),
            self.add(format!("{prefix}.down_proj.weight"), vec![hidden, ffn]),
        ]
    }

    /// Layer `i`'s tensors in checkpoint order.
    fn layer(&mut self, arch: &Arch, i: u64) -> LayerTensors {
        let h = arch.hidden;
        let p = format!("model.layers.{i}");
        let absent = CheckpointTensors::ABSENT;
        let input_norm = self.add(format!("{p}.input_layernorm.weight"), vec![h]);
        let (mut q, mut k, mut v, mut qk_norm, mut mla) = (absent, absent, absent, None, None);
        let o = match arch.attention {
            Attention::Gqa { heads, kv_heads, head_dim, qk_norm: with_norms } => {
                let (q_dim, kv_dim) = (heads * head_dim, kv_heads * head_dim);
                q = self.add(format!("{p}.self_attn.q_proj.weight"), vec![q_dim, h]);
                k = self.add(format!("{p}.self_attn.k_proj.weight"), vec![kv_dim, h]);
                v = self.add(format!("{p}.self_attn.v_proj.weight"), vec![kv_dim, h]);
                let o = self.add(format!("{p}.self_attn.o_proj.weight"), vec![h, q_dim]);
                if with_norms {
                    let qn = self.add(format!("{p}.self_attn.q_norm.weight"), vec![head_dim]);
                    let kn = self.add(format!("{p}.self_attn.k_norm.weight"), vec![head_dim]);
                    qk_norm = Some((qn, kn));
                }
                o
            }
            Attention::Mla(m) => {
                let q_rows = m.heads * m.q_head_rows();
                let (q_a, q) = match m.q_lora_rank {
                    Some(rank) => {
                        let a = self.add(format!("{p}.self_attn.q_a_proj.weight"), vec![rank, h]);
                        let norm = self.add(format!("{p}.self_attn.q_a_layernorm.weight"), vec![rank]);
                        (
                            Some((a, norm)),
                            self.add(format!("{p}.self_attn.q_b_proj.weight"), vec![q_rows, rank]),
                        )
                    }
                    None => (None, self.add(format!("{p}.self_attn.q_proj.weight"), vec![q_rows, h])),
                };
                let kv_a =
                    self.add(format!("{p}.self_attn.kv_a_proj_with_mqa.weight"), vec![m.kv_a_rows(), h]);
                let kv_a_norm =
                    self.add(format!("{p}.self_attn.kv_a_layernorm.weight"), vec![m.kv_lora_rank]);
                let kv_b = self.add(
                    format!("{p}.self_attn.kv_b_proj.weight"),
                    vec![m.heads * m.kv_head_rows(), m.kv_lora_rank],
                );
                mla = Some(MlaTensors { q_a, q, kv_a, kv_a_norm, kv_b });
                self.add(format!("{p}.self_attn.o_proj.weight"), vec![h, m.heads * m.v_head_dim])
            }
        };
        let post_norm = self.add(format!("{p}.post_attention_layernorm.weight"), vec![h]);
        let (mut shared_experts, mut router_bias) = (None, None);
        let mlp = match arch.moe.filter(|_| arch.is_moe_layer(i)) {
            Some(moe) => {
                let router = self.add(format!("{p}.mlp.gate.weight"), vec![moe.experts, h]);
                if moe.router_bias {
                    // FP32 in the checkpoint and on both sides (Megatron's expert_bias buffer,
                    // vLLM's e_score_correction_bias parameter), whatever the weights' type.
                    let name = format!("{p}.mlp.gate.e_score_correction_bias");
                    router_bias = Some(self.add_typed(name, vec![moe.experts], (Arch::DTYPE_F32, 4)));
                }
                let experts =
                    (0..moe.experts).map(|e| self.mlp(&format!("{p}.mlp.experts.{e}"), moe.ffn, h)).collect();
                if moe.shared > 0 {
                    shared_experts =
                        Some(self.mlp(&format!("{p}.mlp.shared_experts"), moe.shared * moe.ffn, h));
                }
                MlpTensors::Moe { router, experts }
            }
            None => {
                let [gate, up, down] = self.mlp(&format!("{p}.mlp"), arch.ffn, h);
                MlpTensors::Dense { gate, up, down }
            }
        };
        LayerTensors { input_norm, q, k, v, o, qk_norm, mla, post_norm, mlp, shared_experts, router_bias }
    }
}
