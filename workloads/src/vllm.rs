//! Receivers as vLLM holds the weights for tensor-parallel inference. Paths below are under
//! vllm-project/vllm `vllm/`; python/refit/integrations/vllm.py follows the same files.
//!
//! - `qkv_proj` (QKVParallelLinear): this rank's q rows, then its k rows, then its v rows. When there
//!   are fewer key/value heads than ranks, each kv head is replicated on `tp / kv_heads` ranks.
//! - `o_proj`, `down_proj` (RowParallelLinear): every row, this rank's block of columns.
//! - `gate_up_proj` (MergedColumnParallelLinear): this rank's gate rows, then its up rows.
//! - Latent attention (`model_executor/models/deepseek_v2.py` DeepseekV2MLAAttention): with query
//!   compression, `fused_qkv_a_proj` (a MergedColumnParallelLinear with `disable_tp`) holds all of
//!   `q_a_proj` then all of `kv_a_proj_with_mqa` on every rank, and `q_b_proj` is column-parallel;
//!   without it, `kv_a_proj_with_mqa` is a ReplicatedLinear and `q_proj` column-parallel.
//!   `kv_b_proj` is column-parallel (whole heads: its rows are per head), `q_a_layernorm` and
//!   `kv_a_layernorm` are replicated, `o_proj` is row-parallel.
//! - Experts (FusedMoE, `model_executor/layers/fused_moe/layer.py`; vLLM 0.33 names them
//!   `mlp.experts.routed_experts.w13_weight` / `.w2_weight`): without expert parallelism every
//!   rank holds every expert split over TP, `w13_weight = [experts][2 * ffn / tp][hidden]` with the
//!   gate half then the up half of each expert, `w2_weight = [experts][hidden][ffn / tp]`. With it
//!   (`enable_expert_parallel`: the expert-parallel group is every rank, EP rank
//!   `dp_rank * tp + tp_rank`) each rank holds whole experts, by determine_expert_map's placement.
//! - DeepSeek MoE layers (DeepseekV2MoE): the router `mlp.gate` with its FP32
//!   `e_score_correction_bias`, replicated; `mlp.shared_experts` a TP-sharded MLP (gate_up_proj,
//!   down_proj) of intermediate `n_shared_experts * moe_intermediate_size`. The first
//!   `first_k_dense_replace` layers are dense MLPs.
//! - `embed_tokens`, `lm_head` (VocabParallelEmbedding, ParallelLMHead in
//!   `model_executor/layers/vocab_parallel_embedding.py`): the vocabulary padded to a multiple of 64
//!   (DEFAULT_VOCAB_PADDING_SIZE), then split evenly, so a rank's rows past the vocabulary are
//!   padding. With tied embeddings `lm_head` is `embed_tokens` (tie_weights) and is no parameter of
//!   its own.
//! - Norms, q/k norms and the router (`mlp.gate`, ReplicatedLinear) are replicated.
//!
//! Several pieces of one parameter are disjoint parts of one destination buffer.

use crate::arch::{Arch, Attention, Experts, Mla};
use crate::model::{CheckpointTensors, LayerTensors, MlpTensors, Model};
use crate::param::{Param, RankParams};
use refit::plan::Endpoint;
use refit::{Error, Result};

/// Tensor-parallel receivers for a [`Model`]: receiver `i` (position in `endpoints`) has TP rank
/// `i`. See [`VllmRanks`] for data and expert parallelism.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Vllm {
    pub endpoints: Vec<Endpoint>,
}

impl Vllm {
    /// Every parameter of every receiver, in `model.named_parameters()` order.
    pub fn params(&self, model: &Model, catalog: &CheckpointTensors) -> Result<Vec<Param>> {
        model.validate()?;
        VllmRanks::from(self).params(&Arch::from(model), catalog)
    }
}

/// Where expert parallelism puts the experts (vLLM's `expert_placement_strategy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertPlacement {
    /// EP rank `r` holds a contiguous block; the first `experts % ep` ranks one expert more.
    Linear,
    /// EP rank `r` holds experts `r, r + ep, r + 2 ep, ...`.
    RoundRobin,
}

/// vLLM receivers: `endpoints.len() / tp` data-parallel replicas of `tp` ranks each; receiver `i`
/// (position in `endpoints`) has TP rank `i % tp` and DP rank `i / tp`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VllmRanks {
    pub endpoints: Vec<Endpoint>,
    pub tp: u64,
    /// `enable_expert_parallel` with this placement: receiver `i` has EP rank `i` of
    /// `endpoints.len()` and holds its experts whole. `None`: every rank holds every expert, split
    /// over TP.
    pub expert_parallel: Option<ExpertPlacement>,
    /// The vocabulary is padded to a multiple of this before it is split (64 in vLLM).
    pub vocab_padding: u64,
}

impl From<&Vllm> for VllmRanks {
    fn from(v: &Vllm) -> VllmRanks {
        VllmRanks::tp(v.endpoints.clone())
    }
}

impl VllmRanks {
    /// One tensor-parallel group over `endpoints`, no expert parallelism.
    pub fn tp(endpoints: Vec<Endpoint>) -> VllmRanks {
        let tp = endpoints.len() as u64;
        VllmRanks { endpoints, tp, expert_parallel: None, vocab_padding: 64 }
    }

    /// The same ranks with expert parallelism, linear placement.
    pub fn with_expert_parallel(mut self) -> VllmRanks {
        self.expert_parallel = Some(ExpertPlacement::Linear);
        self
    }

    /// Rows of each rank's vocabulary shard.
    fn vocab_rows(&self, arch: &Arch) -> u64 {
        arch.vocab.next_multiple_of(self.vocab_padding) / self.tp
    }

    fn validate(&self, arch: &Arch) -> Result<()> {
        let (n, tp) = (self.endpoints.len() as u64, self.tp);
        let bad = |why: String| Err(Error::invalid_argument(format!("vLLM receivers: {why}")));
        if n == 0 {
            return bad("no receivers".into());
        }
        if tp == 0 || n % tp != 0 || self.vocab_padding == 0 {
            return bad(format!("{n} ranks in groups of tp {tp}, vocabulary padding {}", self.vocab_padding));
        }
        match arch.attention {
            Attention::Gqa { heads, kv_heads, .. } => {
                if heads % tp != 0 {
                    return bad(format!("{heads} query heads do not split over tp {tp}"));
                }
                if kv_heads % tp != 0 && tp % kv_heads != 0 {
                    return bad(format!(
                        "{kv_heads} key/value heads neither split nor replicate over tp {tp}"
                    ));
                }
            }
            Attention::Mla(mla) if mla.heads % tp != 0 => {
                return bad(format!("{} heads do not split over tp {tp}", mla.heads));
            }
            Attention::Mla(_) => {}
        }
        if arch.has_dense_layers() && arch.ffn % tp != 0 {
            return bad(format!("intermediate {} does not split over tp {tp}", arch.ffn));
        }
        if let Some(moe) = arch.moe {
            if self.expert_parallel.is_none() && moe.ffn % tp != 0 {
                return bad(format!("intermediate {} does not split over tp {tp}", moe.ffn));
            }
            if self.expert_parallel.is_some() && moe.experts < n {
                return bad(format!("{} experts for {n} expert-parallel ranks", moe.experts));
            }
            if (moe.shared * moe.ffn) % tp != 0 {
                return bad(format!(
                    "shared expert intermediate {} does not split over tp {tp}",
                    moe.shared * moe.ffn
                ));
            }
        }
        let padded = arch.vocab.next_multiple_of(self.vocab_padding);
        if padded % tp != 0 {
            return bad(format!("padded vocabulary {padded} does not split over tp {tp}"));
        }
        Ok(())
    }

    /// Every parameter of every receiver, in `model.named_parameters()` order.
    pub fn params(&self, arch: &Arch, catalog: &CheckpointTensors) -> Result<Vec<Param>> {
        arch.validate()?;
        self.validate(arch)?;
        let n = self.endpoints.len() as u64;
        let mut params = Vec::new();
        for (i, &endpoint) in self.endpoints.iter().enumerate() {
            let i = i as u64;
            let rank = Rank {
                shard: RankParams::new(endpoint, (i % self.tp, self.tp), arch, self.vocab_rows(arch)),
                experts: self.expert_parallel.map(|placement| (placement, i, n)),
            };
            rank.params(arch, catalog, &mut params);
        }
        Ok(params)
    }
}

struct Rank {
    shard: RankParams,
    /// (placement, EP rank, EP size) with expert parallelism.
    experts: Option<(ExpertPlacement, u64, u64)>,
}

impl Rank {
    /// This rank's key/value heads: `(first head, heads)`.
    fn kv_heads(&self, kv_heads: u64) -> (u64, u64) {
        let (tp, tp_size) = (self.shard.tp, self.shard.tp_size);
        if kv_heads >= tp_size {
            let n = kv_heads / tp_size;
            (tp * n, n)
        } else {
            (tp / (tp_size / kv_heads), 1)
        }
    }

    /// The global indices of this rank's experts, in local order.
    fn local_experts(&self, experts: u64) -> Vec<u64> {
        match self.experts {
            None => (0..experts).collect(),
            Some((ExpertPlacement::Linear, r, ep)) => {
                let (base, extra) = (experts / ep, experts % ep);
                let start = r * base + r.min(extra);
                (start..start + base + u64::from(r < extra)).collect()
            }
            Some((ExpertPlacement::RoundRobin, r, ep)) => (r..experts).step_by(ep as usize).collect(),
        }
    }

    fn params(&self, m: &Arch, c: &CheckpointTensors, out: &mut Vec<Param>) {
        let s = &self.shard;
        let h = s.hidden;
        out.push(s.vocab_shard("model.embed_tokens.weight", c.embed));
        for (l, t) in c.layers.iter().enumerate() {
            let p = format!("model.layers.{l}");
            match m.attention {
                Attention::Gqa { heads, kv_heads, head_dim, .. } => {
                    // Llama and Qwen register the norms around the attention.
                    out.push(s.vector(format!("{p}.input_layernorm.weight"), t.input_norm, h));
                    self.gqa(t, &p, (heads, kv_heads, head_dim), out);
                    out.push(s.vector(format!("{p}.post_attention_layernorm.weight"), t.post_norm, h));
                    self.mlp(m, t, &p, out);
                }
                Attention::Mla(mla) => {
                    // DeepseekV2DecoderLayer registers its norms after the attention and the MLP.
                    self.mla(t, &p, mla, out);
                    self.mlp(m, t, &p, out);
                    out.push(s.vector(format!("{p}.input_layernorm.weight"), t.input_norm, h));
                    out.push(s.vector(format!("{p}.post_attention_layernorm.weight"), t.post_norm, h));
                }
            }
        }
        out.push(s.vector("model.norm.weight".into(), c.final_norm, h));
        if !m.tied_embeddings {
            out.push(s.vocab_shard("lm_head.weight", c.lm_head));
        }
    }

    fn gqa(&self, t: &LayerTensors, p: &str, (heads, kv_heads, hd): (u64, u64, u64), out: &mut Vec<Param>) {
        let s = &self.shard;
        let (es, h) = (s.es, s.hidden);
        let q_local = heads * hd / s.tp_size;
        let (kv_first, kv_n) = self.kv_heads(kv_heads);
        let kv_local = kv_n * hd;
        let mut qkv = s.param(format!("{p}.self_attn.qkv_proj.weight"), (q_local + 2 * kv_local) * h);
        qkv.rows_cols(t.q, 0, s.tp_rows(q_local), (0, h));
        qkv.rows_cols(t.k, q_local * h * es, (kv_first * hd, kv_local), (0, h));
        qkv.rows_cols(t.v, (q_local + kv_local) * h * es, (kv_first * hd, kv_local), (0, h));
        out.push(qkv);
        if let Some((qn, kn)) = t.qk_norm {
            out.push(s.vector(format!("{p}.self_attn.q_norm.weight"), qn, hd));
            out.push(s.vector(format!("{p}.self_attn.k_norm.weight"), kn, hd));
        }
        let mut o = s.param(format!("{p}.self_attn.o_proj.weight"), h * q_local);
        o.rows_cols(t.o, 0, (0, h), s.tp_rows(q_local));
        out.push(o);
    }

    /// In the order DeepseekV2MLAAttention registers its modules.
    fn mla(&self, t: &LayerTensors, p: &str, m: Mla, out: &mut Vec<Param>) {
        let s = &self.shard;
        let (es, h) = (s.es, s.hidden);
        let x = t.mla.as_ref().expect("latent attention tensors come from a latent-attention model");
        let heads = m.heads / s.tp_size;
        let a = format!("{p}.self_attn");
        let q_local = heads * m.q_head_rows();
        match (x.q_a, m.q_lora_rank) {
            (Some((q_a, q_a_norm)), Some(rank)) => {
                let mut fused = s.param(format!("{a}.fused_qkv_a_proj.weight"), (rank + m.kv_a_rows()) * h);
                fused.rows_cols(q_a, 0, (0, rank), (0, h));
                fused.rows_cols(x.kv_a, rank * h * es, (0, m.kv_a_rows()), (0, h));
                out.push(fused);
                out.push(s.vector(format!("{a}.q_a_layernorm.weight"), q_a_norm, rank));
                let mut q_b = s.param(format!("{a}.q_b_proj.weight"), q_local * rank);
                q_b.rows_cols(x.q, 0, s.tp_rows(q_local), (0, rank));
                out.push(q_b);
            }
            _ => {
                out.push(s.whole(format!("{a}.kv_a_proj_with_mqa.weight"), x.kv_a, (m.kv_a_rows(), h)));
                let mut q = s.param(format!("{a}.q_proj.weight"), q_local * h);
                q.rows_cols(x.q, 0, s.tp_rows(q_local), (0, h));
                out.push(q);
            }
        }
        let rank = m.kv_lora_rank;
        out.push(s.vector(format!("{a}.kv_a_layernorm.weight"), x.kv_a_norm, rank));
        let kv_local = heads * m.kv_head_rows();
        let mut kv_b = s.param(format!("{a}.kv_b_proj.weight"), kv_local * rank);
        kv_b.rows_cols(x.kv_b, 0, s.tp_rows(kv_local), (0, rank));
        out.push(kv_b);
        let v_local = heads * m.v_head_dim;
        let mut o = s.param(format!("{a}.o_proj.weight"), h * v_local);
        o.rows_cols(t.o, 0, (0, h), s.tp_rows(v_local));
        out.push(o);
    }

    fn mlp(&self, m: &Arch, t: &LayerTensors, p: &str, out: &mut Vec<Param>) {
        let s = &self.shard;
        let h = s.hidden;
        match (&t.mlp, m.moe) {
            (MlpTensors::Moe { router, experts }, Some(moe)) => {
                out.push(s.whole(format!("{p}.mlp.gate.weight"), *router, (moe.experts, h)));
                if let Some(bias) = t.router_bias {
                    out.push(s.vector_of(
                        format!("{p}.mlp.gate.e_score_correction_bias"),
                        bias,
                        moe.experts,
                        4,
                    ));
                }
                if let Some(shared) = t.shared_experts {
                    self.gated_mlp(shared, &format!("{p}.mlp.shared_experts"), moe.shared * moe.ffn, out);
                }
                self.experts(experts, p, moe, out);
            }
            (&MlpTensors::Dense { gate, up, down }, _) => {
                self.gated_mlp([gate, up, down], &format!("{p}.mlp"), m.ffn, out)
            }
            (MlpTensors::Moe { .. }, None) => unreachable!("MoE tensors come from a MoE model"),
        }
    }

    /// A TP-sharded SwiGLU MLP `prefix` of intermediate `ffn`: `gate_up_proj`, `down_proj`.
    fn gated_mlp(&self, [gate, up, down]: [u32; 3], prefix: &str, ffn: u64, out: &mut Vec<Param>) {
        let s = &self.shard;
        let h = s.hidden;
        let f = ffn / s.tp_size;
        let mut gate_up = s.param(format!("{prefix}.gate_up_proj.weight"), 2 * f * h);
        gate_up.gate_up_rows([gate, up], 0, s.tp_rows(f), (h, s.es));
        out.push(gate_up);
        let mut down_proj = s.param(format!("{prefix}.down_proj.weight"), h * f);
        down_proj.rows_cols(down, 0, (0, h), s.tp_rows(f));
        out.push(down_proj);
    }

    /// `w13_weight`, `w2_weight`: this rank's experts, whole with expert parallelism, else every
    /// expert's TP share.
    fn experts(&self, experts: &[[u32; 3]], p: &str, moe: Experts, out: &mut Vec<Param>) {
        let s = &self.shard;
        let (es, h) = (s.es, s.hidden);
        let (f, rows) = match self.experts {
            Some(_) => (moe.ffn, (0, moe.ffn)),
            None => (moe.ffn / s.tp_size, s.tp_rows(moe.ffn / s.tp_size)),
        };
        let local = self.local_experts(moe.experts);
        let n = local.len() as u64;
        let mut w13 = s.param(format!("{p}.mlp.experts.routed_experts.w13_weight"), n * 2 * f * h);
        let mut w2 = s.param(format!("{p}.mlp.experts.routed_experts.w2_weight"), n * h * f);
        for (j, &e) in local.iter().enumerate() {
            let j = j as u64;
            let [gate, up, down] = experts[e as usize];
            w13.gate_up_rows([gate, up], j * 2 * f * h * es, rows, (h, es));
            w2.rows_cols(down, j * h * f * es, (0, h), rows);
        }
        out.push(w13);
        out.push(w2);
    }
}
