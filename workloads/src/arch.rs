//! Model shapes in every family the workloads cover: grouped-query attention (Llama, Qwen3, and
//! Mixtral, which differs from Qwen3-MoE only in tensor names) and multi-head latent attention with
//! leading dense layers, shared experts and a router bias (DeepSeek-V2/V3, Kimi-K2). [`Model`] is
//! the grouped-query subset, kept for callers that build it field by field; it converts into an
//! [`Arch`].
//!
//! The configurations below are the Hugging Face `config.json` of each model (deepseek-ai/DeepSeek-V3,
//! moonshotai/Kimi-K2-Instruct, deepseek-ai/DeepSeek-V2-Lite). Their multi-token-prediction layers
//! (DeepSeek-V3's layer 61) are left out: vLLM loads them into a separate draft model, not the one a
//! refit updates.

use crate::model::Model;
use refit::{Error, Result};

/// How a layer attends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attention {
    /// `q_proj`, `k_proj`, `v_proj`, `o_proj`, with `q_norm` / `k_norm` of `[head_dim]` when
    /// `qk_norm` (Qwen3).
    Gqa { heads: u64, kv_heads: u64, head_dim: u64, qk_norm: bool },
    /// Multi-head latent attention.
    Mla(Mla),
}

/// Multi-head latent attention's sizes (DeepSeek-V2 paper, section 2.1; the Hugging Face tensors
/// `q_a_proj [q_lora_rank, hidden]`, `q_a_layernorm [q_lora_rank]`,
/// `q_b_proj [heads * (qk_nope_head_dim + qk_rope_head_dim), q_lora_rank]`,
/// `kv_a_proj_with_mqa [kv_lora_rank + qk_rope_head_dim, hidden]`, `kv_a_layernorm [kv_lora_rank]`,
/// `kv_b_proj [heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]`,
/// `o_proj [hidden, heads * v_head_dim]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mla {
    pub heads: u64,
    /// `None`: queries come straight from the hidden state through `q_proj
    /// [heads * (qk_nope_head_dim + qk_rope_head_dim), hidden]` (DeepSeek-V2-Lite).
    pub q_lora_rank: Option<u64>,
    pub kv_lora_rank: u64,
    pub qk_nope_head_dim: u64,
    pub qk_rope_head_dim: u64,
    pub v_head_dim: u64,
}

impl Mla {
    /// Rows per head of `q_b_proj` (or `q_proj`).
    pub fn q_head_rows(&self) -> u64 {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Rows per head of `kv_b_proj`: the head's no-position key rows, then its value rows.
    pub fn kv_head_rows(&self) -> u64 {
        self.qk_nope_head_dim + self.v_head_dim
    }

    /// Rows of `kv_a_proj_with_mqa`: the compressed key/value, then the one shared rotary key.
    pub fn kv_a_rows(&self) -> u64 {
        self.kv_lora_rank + self.qk_rope_head_dim
    }
}

/// The mixture-of-experts layers of a model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Experts {
    /// Routed experts, each a SwiGLU MLP of intermediate `ffn`.
    pub experts: u64,
    pub ffn: u64,
    /// Shared experts every token goes through (`n_shared_experts`), stored in the checkpoint as one
    /// MLP `mlp.shared_experts` of intermediate `shared * ffn`. 0: none.
    pub shared: u64,
    /// Layers before the first MoE layer, dense MLPs of the model's `ffn` (`first_k_dense_replace`).
    pub dense_layers: u64,
    /// The router has `e_score_correction_bias [experts]` in FP32 (`topk_method: noaux_tc`).
    pub router_bias: bool,
}

/// A decoder-only transformer's weight shapes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Arch {
    pub name: String,
    pub layers: u64,
    pub hidden: u64,
    pub attention: Attention,
    /// Intermediate size of the dense MLPs: every layer of a dense model, the leading
    /// `dense_layers` of a MoE one.
    pub ffn: u64,
    pub moe: Option<Experts>,
    pub vocab: u64,
    /// `lm_head` is `embed_tokens` (`tie_word_embeddings`): the checkpoint has no `lm_head.weight`,
    /// and neither has vLLM.
    pub tied_embeddings: bool,
    pub elem_size: u32,
    pub dtype: u32,
}

impl Arch {
    /// dtype codes the workloads give their tensors, as python/refit/tensor.py numbers them (the
    /// planner only compares codes for consistency).
    pub const DTYPE_F32: u32 = 1;
    pub const DTYPE_BF16: u32 = 2;

    /// DeepSeek-V3 (and R1) in BF16: 61 layers of hidden 7168, latent attention of 128 heads
    /// (q_lora_rank 1536, kv_lora_rank 512, 128 + 64 query/key dimensions, 128 value dimensions), the
    /// first 3 layers dense of intermediate 18,432, then 256 routed experts and 1 shared expert of
    /// intermediate 2048 with a router bias; vocabulary 129,280, untied. 671,026,419,200 parameters
    /// without the multi-token-prediction layer.
    pub fn deepseek_v3() -> Arch {
        Arch {
            name: "DeepSeek-V3".into(),
            layers: 61,
            hidden: 7168,
            attention: Attention::Mla(Mla {
                heads: 128,
                q_lora_rank: Some(1536),
                kv_lora_rank: 512,
                qk_nope_head_dim: 128,
                qk_rope_head_dim: 64,
                v_head_dim: 128,
            }),
            ffn: 18_432,
            moe: Some(Experts { experts: 256, ffn: 2048, shared: 1, dense_layers: 3, router_bias: true }),
            vocab: 129_280,
            tied_embeddings: false,
            elem_size: 2,
            dtype: Arch::DTYPE_BF16,
        }
    }

    /// Kimi-K2 in BF16: DeepSeek-V3's architecture with 64 heads, 384 routed experts, one leading
    /// dense layer and a vocabulary of 163,840. 1,026,408,232,448 parameters.
    pub fn kimi_k2() -> Arch {
        let mut arch = Arch::deepseek_v3();
        arch.name = "Kimi-K2".into();
        if let Attention::Mla(mla) = &mut arch.attention {
            mla.heads = 64;
        }
        arch.moe = Some(Experts { experts: 384, ffn: 2048, shared: 1, dense_layers: 1, router_bias: true });
        arch.vocab = 163_840;
        arch
    }

    /// DeepSeek-V2-Lite in BF16: latent attention without query compression (16 heads, `q_proj`
    /// from the hidden state), 27 layers of hidden 2048, 1 dense layer of intermediate 10,944, then
    /// 64 routed and 2 shared experts of intermediate 1408, no router bias; vocabulary 102,400.
    /// 15,706,484,224 parameters.
    pub fn deepseek_v2_lite() -> Arch {
        Arch {
            name: "DeepSeek-V2-Lite".into(),
            layers: 27,
            hidden: 2048,
            attention: Attention::Mla(Mla {
                heads: 16,
                q_lora_rank: None,
                kv_lora_rank: 512,
                qk_nope_head_dim: 128,
                qk_rope_head_dim: 64,
                v_head_dim: 128,
            }),
            ffn: 10_944,
            moe: Some(Experts { experts: 64, ffn: 1408, shared: 2, dense_layers: 1, router_bias: false }),
            vocab: 102_400,
            tied_embeddings: false,
            elem_size: 2,
            dtype: Arch::DTYPE_BF16,
        }
    }

    /// The same model with `layers` decoder layers. Leading dense layers are kept up to `layers`.
    pub fn with_layers(mut self, layers: u64) -> Arch {
        self.layers = layers;
        if let Some(moe) = &mut self.moe {
            moe.dense_layers = moe.dense_layers.min(layers);
        }
        self
    }

    /// The same MoE model with `experts` routed experts. No effect on a dense model.
    pub fn with_experts(mut self, experts: u64) -> Arch {
        if let Some(moe) = &mut self.moe {
            moe.experts = experts;
        }
        self
    }

    /// The same model with a vocabulary of `vocab` rows.
    pub fn with_vocab(mut self, vocab: u64) -> Arch {
        self.vocab = vocab;
        self
    }

    /// The same model with `lm_head` tied to `embed_tokens`.
    pub fn with_tied_embeddings(mut self) -> Arch {
        self.tied_embeddings = true;
        self
    }

    /// Whether layer `layer` (global index) is a MoE layer.
    pub fn is_moe_layer(&self, layer: u64) -> bool {
        self.moe.is_some_and(|moe| layer >= moe.dense_layers)
    }

    /// Whether any layer is a dense MLP.
    pub(crate) fn has_dense_layers(&self) -> bool {
        self.moe.is_none_or(|moe| moe.dense_layers > 0)
    }

    /// Rejects shapes no framework could hold: zero sizes, heads not grouping evenly, more leading
    /// dense layers than layers.
    pub(crate) fn validate(&self) -> Result<()> {
        let bad = |why: String| Err(Error::invalid_argument(format!("model {}: {why}", self.name)));
        let mut sizes = vec![
            ("layers", self.layers),
            ("hidden", self.hidden),
            ("vocab", self.vocab),
            ("elem_size", self.elem_size as u64),
        ];
        match self.attention {
            Attention::Gqa { heads, kv_heads, head_dim, .. } => {
                sizes.extend([("heads", heads), ("kv_heads", kv_heads), ("head_dim", head_dim)]);
            }
            Attention::Mla(mla) => {
                sizes.extend([
                    ("heads", mla.heads),
                    ("kv_lora_rank", mla.kv_lora_rank),
                    ("qk_rope_head_dim", mla.qk_rope_head_dim),
                    ("v_head_dim", mla.v_head_dim),
                ]);
                if let Some(q_lora_rank) = mla.q_lora_rank {
                    sizes.push(("q_lora_rank", q_lora_rank));
                }
            }
        }
        for (what, value) in sizes {
            if value == 0 {
                return bad(format!("{what} is 0"));
            }
        }
        if let Some(moe) = self.moe.filter(|moe| moe.experts == 0 || moe.ffn == 0) {
            return bad(format!("MoE with {} experts of intermediate {}", moe.experts, moe.ffn));
        }
        if let Attention::Gqa { heads, kv_heads, .. } = self.attention {
            if heads % kv_heads != 0 {
                return bad(format!(
                    "{heads} query heads do not group evenly over {kv_heads} key/value heads"
                ));
            }
        }
        if let Some(moe) = self.moe {
            if moe.dense_layers > self.layers {
                return bad(format!("{} leading dense layers of {} layers", moe.dense_layers, self.layers));
            }
        }
        if self.has_dense_layers() && self.ffn == 0 {
            return bad("dense intermediate size is 0".into());
        }
        Ok(())
    }
}

impl From<&Model> for Arch {
    fn from(m: &Model) -> Arch {
        Arch {
            name: m.name.clone(),
            layers: m.layers,
            hidden: m.hidden,
            attention: Attention::Gqa {
                heads: m.heads,
                kv_heads: m.kv_heads,
                head_dim: m.head_dim,
                qk_norm: m.qk_norm,
            },
            ffn: m.ffn,
            moe: m.moe.map(|moe| Experts {
                experts: moe.experts,
                ffn: moe.ffn,
                shared: 0,
                dense_layers: 0,
                router_bias: false,
            }),
            vocab: m.vocab,
            tied_embeddings: false,
            elem_size: m.elem_size,
            dtype: m.dtype,
        }
    }
}
