//! Model configurations and the Hugging Face tensors they define: the names and global shapes that
//! vLLM's `load_weights` sees, which are the tensors both sides of a refit agree on.

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
    pub(crate) const DTYPE_BF16: u32 = 2;

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

    pub(crate) fn q_dim(&self) -> u64 {
        self.heads * self.head_dim
    }

    pub(crate) fn kv_dim(&self) -> u64 {
        self.kv_heads * self.head_dim
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
    pub q: u32,
    pub k: u32,
    pub v: u32,
    pub o: u32,
    /// `q_norm`, `k_norm` when the model has them.
    pub qk_norm: Option<(u32, u32)>,
    pub post_norm: u32,
    pub mlp: MlpTensors,
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
    pub lm_head: u32,
}

impl CheckpointTensors {
    pub fn new(model: &Model) -> CheckpointTensors {
        let mut tensors = Vec::new();
        let mut add = |name: String, shape: Vec<u64>| -> u32 {
            tensors.push(TensorSpec { name, dtype: model.dtype, elem_size: model.elem_size, shape });
            (tensors.len() - 1) as u32
        };
        let h = model.hidden;
        let embed = add("model.embed_tokens.weight".into(), vec![model.vocab, h]);
        let mut layers = Vec::with_capacity(model.layers as usize);
        for i in 0..model.layers {
            let p = format!("model.layers.{i}");
            let input_norm = add(format!("{p}.input_layernorm.weight"), vec![h]);
            let q = add(format!("{p}.self_attn.q_proj.weight"), vec![model.q_dim(), h]);
            let k = add(format!("{p}.self_attn.k_proj.weight"), vec![model.kv_dim(), h]);
            let v = add(format!("{p}.self_attn.v_proj.weight"), vec![model.kv_dim(), h]);
            let o = add(format!("{p}.self_attn.o_proj.weight"), vec![h, model.q_dim()]);
            let qk_norm = model.qk_norm.then(|| {
                let qn = add(format!("{p}.self_attn.q_norm.weight"), vec![model.head_dim]);
                let kn = add(format!("{p}.self_attn.k_norm.weight"), vec![model.head_dim]);
                (qn, kn)
            });
            let post_norm = add(format!("{p}.post_attention_layernorm.weight"), vec![h]);
            let mlp = match model.moe {
                Some(moe) => {
                    let router = add(format!("{p}.mlp.gate.weight"), vec![moe.experts, h]);
                    let experts = (0..moe.experts)
                        .map(|e| {
                            [
                                add(format!("{p}.mlp.experts.{e}.gate_proj.weight"), vec![moe.ffn, h]),
                                add(format!("{p}.mlp.experts.{e}.up_proj.weight"), vec![moe.ffn, h]),
                                add(format!("{p}.mlp.experts.{e}.down_proj.weight"), vec![h, moe.ffn]),
                            ]
                        })
                        .collect();
                    MlpTensors::Moe { router, experts }
                }
                None => MlpTensors::Dense {
                    gate: add(format!("{p}.mlp.gate_proj.weight"), vec![model.ffn, h]),
                    up: add(format!("{p}.mlp.up_proj.weight"), vec![model.ffn, h]),
                    down: add(format!("{p}.mlp.down_proj.weight"), vec![h, model.ffn]),
                },
            };
            layers.push(LayerTensors { input_norm, q, k, v, o, qk_norm, post_norm, mlp });
        }
        let final_norm = add("model.norm.weight".into(), vec![h]);
        let lm_head = add("lm_head.weight".into(), vec![model.vocab, h]);
        CheckpointTensors { tensors, embed, layers, final_norm, lm_head }
    }

    /// Elements of tensor `t`.
    pub fn elements(&self, t: u32) -> u64 {
        self.tensors[t as usize].shape.iter().product()
    }
}
