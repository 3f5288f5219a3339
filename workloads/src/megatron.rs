//! Publishers as Megatron-LM (Transformer Engine layers) holds the weights during training.
//!
//! - Dense weights are split over tensor-parallel ranks (column-parallel: rows; row-parallel:
//!   columns); ranks with the same TP rank in different data-parallel replicas hold identical copies.
//! - `linear_qkv` is one fused column-parallel weight interleaved by query group:
//!   `[local groups][q_per_group + 2 heads][head_dim][hidden]`, so the q, k and v rows of each group are
//!   separate boxes at strided addresses.
//! - Experts are expert-parallel with expert-TP 1: each rank holds `experts / ep` whole experts in two
//!   grouped weights, `linear_fc1 = [local experts][gate | up][ffn][hidden]` and
//!   `linear_fc2 = [local experts][hidden][ffn]`, so consecutive experts sit at constant strides
//!   (GroupedMLP). With `grouped_experts` off, each local expert has its own `linear_fc1.weight{j}`
//!   (`[gate | up][ffn][hidden]`) and `linear_fc2.weight{j}` (TEGroupedMLP), so experts sit wherever
//!   their allocations do. The non-expert weights are replicated on every rank of the expert-parallel
//!   group.
//! - Vocabulary rows are split over TP in chunks of `ceil(vocab / tp)` (the last rank holds padding).

use crate::model::{CheckpointTensors, MlpTensors, Model};
use crate::param::{Param, RankParams};
use refit::plan::Endpoint;
use refit::{Error, Result};

/// How the publishers are parallelized. Publisher `i` (position in `endpoints`) has tensor-parallel
/// rank `i % tp` and expert-parallel rank `i % ep`; `endpoints.len() / tp` is the number of
/// data-parallel replicas of the dense weights.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Megatron {
    pub endpoints: Vec<Endpoint>,
    pub tp: u64,
    pub ep: u64,
    /// Local experts in two grouped weights per layer (true), or two weights per expert (false).
    pub grouped_experts: bool,
}

impl Megatron {
    fn validate(&self, model: &Model) -> Result<()> {
        let n = self.endpoints.len() as u64;
        let bad = |why: String| Err(Error::invalid_argument(format!("Megatron publishers: {why}")));
        if n == 0 || self.tp == 0 || self.ep == 0 {
            return bad(format!("{n} ranks, tp {}, ep {}", self.tp, self.ep));
        }
        if n % self.tp != 0 || n % self.ep != 0 {
            return bad(format!("{n} ranks do not divide into tp {} and ep {}", self.tp, self.ep));
        }
        if model.kv_heads % self.tp != 0 {
            return bad(format!("{} query groups do not split over tp {}", model.kv_heads, self.tp));
        }
        if model.moe.is_none() && model.ffn % self.tp != 0 {
            return bad(format!("intermediate {} does not split over tp {}", model.ffn, self.tp));
        }
        match model.moe {
            Some(moe) if moe.experts % self.ep != 0 => {
                bad(format!("{} experts do not split over ep {}", moe.experts, self.ep))
            }
            None if self.ep != 1 => bad(format!("ep {} on a dense model", self.ep)),
            _ => Ok(()),
        }
    }

    /// Every parameter of every publisher, in each rank's `model.parameters()` order.
    pub fn params(&self, model: &Model, catalog: &CheckpointTensors) -> Result<Vec<Param>> {
        model.validate()?;
        self.validate(model)?;
        let mut params = Vec::new();
        for (i, &endpoint) in self.endpoints.iter().enumerate() {
            let i = i as u64;
            let rank = Rank {
                shard: RankParams::new(endpoint, (i % self.tp, self.tp), model),
                ep: i % self.ep,
                ep_size: self.ep,
                grouped_experts: self.grouped_experts,
            };
            rank.params(model, catalog, &mut params);
        }
        Ok(params)
    }
}

struct Rank {
    shard: RankParams,
    ep: u64,
    ep_size: u64,
    grouped_experts: bool,
}

impl Rank {
    fn params(&self, m: &Model, c: &CheckpointTensors, out: &mut Vec<Param>) {
        let s = &self.shard;
        let (es, h) = (s.es, s.hidden);
        out.push(s.vocab_shard("embedding.word_embeddings.weight", c.embed));
        let groups = m.kv_heads / s.tp_size;
        let q_per_group = m.heads / m.kv_heads;
        let hd = m.head_dim;
        let q_local = m.q_dim() / s.tp_size;
        for (l, t) in c.layers.iter().enumerate() {
            let p = format!("decoder.layers.{l}");
            out.push(s.vector(format!("{p}.self_attention.linear_qkv.layer_norm_weight"), t.input_norm, h));

            let group_rows = (q_per_group + 2) * hd;
            let mut qkv = s.param(format!("{p}.self_attention.linear_qkv.weight"), groups * group_rows * h);
            for local in 0..groups {
                let g = s.tp * groups + local;
                let base = local * group_rows * h * es;
                qkv.rows_cols(t.q, base, (g * q_per_group * hd, q_per_group * hd), (0, h));
                qkv.rows_cols(t.k, base + q_per_group * hd * h * es, (g * hd, hd), (0, h));
                qkv.rows_cols(t.v, base + (q_per_group + 1) * hd * h * es, (g * hd, hd), (0, h));
            }
            out.push(qkv);
            if let Some((qn, kn)) = t.qk_norm {
                out.push(s.vector(format!("{p}.self_attention.q_layernorm.weight"), qn, hd));
                out.push(s.vector(format!("{p}.self_attention.k_layernorm.weight"), kn, hd));
            }
            let mut proj = s.param(format!("{p}.self_attention.linear_proj.weight"), h * q_local);
            proj.rows_cols(t.o, 0, (0, h), s.tp_rows(q_local));
            out.push(proj);

            match &t.mlp {
                MlpTensors::Moe { router, experts } => {
                    let moe = m.moe.expect("MoE tensors come from a MoE model");
                    let f = moe.ffn;
                    out.push(s.vector(format!("{p}.pre_mlp_layernorm.weight"), t.post_norm, h));
                    let mut r = s.param(format!("{p}.mlp.router.weight"), moe.experts * h);
                    r.rows_cols(*router, 0, (0, moe.experts), (0, h));
                    out.push(r);
                    // Expert-TP 1: every local expert whole.
                    let local = moe.experts / self.ep_size;
                    let expert = |j: u64| experts[(self.ep * local + j) as usize];
                    if self.grouped_experts {
                        let mut fc1 =
                            s.param(format!("{p}.mlp.experts.linear_fc1.weight"), local * 2 * f * h);
                        let mut fc2 = s.param(format!("{p}.mlp.experts.linear_fc2.weight"), local * h * f);
                        for j in 0..local {
                            let [gate, up, down] = expert(j);
                            fc1.gate_up_rows([gate, up], j * 2 * f * h * es, (0, f), (h, es));
                            fc2.rows_cols(down, j * h * f * es, (0, h), (0, f));
                        }
                        out.push(fc1);
                        out.push(fc2);
                    } else {
                        for j in 0..local {
                            let [gate, up, _] = expert(j);
                            let mut fc1 = s.param(format!("{p}.mlp.experts.linear_fc1.weight{j}"), 2 * f * h);
                            fc1.gate_up_rows([gate, up], 0, (0, f), (h, es));
                            out.push(fc1);
                        }
                        for j in 0..local {
                            let mut fc2 = s.param(format!("{p}.mlp.experts.linear_fc2.weight{j}"), h * f);
                            fc2.rows_cols(expert(j)[2], 0, (0, h), (0, f));
                            out.push(fc2);
                        }
                    }
                }
                MlpTensors::Dense { gate, up, down } => {
                    out.push(s.vector(format!("{p}.mlp.linear_fc1.layer_norm_weight"), t.post_norm, h));
                    let f = m.ffn / s.tp_size;
                    let mut fc1 = s.param(format!("{p}.mlp.linear_fc1.weight"), 2 * f * h);
                    fc1.gate_up_rows([*gate, *up], 0, s.tp_rows(f), (h, es));
                    out.push(fc1);
                    let mut fc2 = s.param(format!("{p}.mlp.linear_fc2.weight"), h * f);
                    fc2.rows_cols(*down, 0, (0, h), s.tp_rows(f));
                    out.push(fc2);
                }
            }
        }
        out.push(s.vector("decoder.final_layernorm.weight".into(), c.final_norm, h));
        out.push(s.vocab_shard("output_layer.weight", c.lm_head));
    }
}
