//! Receivers as vLLM holds the weights for tensor-parallel inference.
//!
//! - `qkv_proj` (QKVParallelLinear): this rank's q rows, then its k rows, then its v rows. When there
//!   are fewer key/value heads than ranks, each kv head is replicated on `tp / kv_heads` ranks.
//! - `o_proj`, `down_proj` (RowParallelLinear): every row, this rank's block of columns.
//! - `gate_up_proj` (MergedColumnParallelLinear): this rank's gate rows, then its up rows.
//! - Experts (FusedMoE, no expert parallelism): `w13_weight = [experts][2 * ffn / tp][hidden]` with
//!   the gate half then the up half of each expert, `w2_weight = [experts][hidden][ffn / tp]`.
//! - `embed_tokens`, `lm_head` (vocab-parallel): rows in chunks of `ceil(vocab / tp)`.
//! - Norms, q/k norms and the router (`mlp.gate`, ReplicatedLinear) are replicated.
//!
//! Several pieces of one parameter are disjoint parts of one destination buffer.

use crate::model::{CheckpointTensors, MlpTensors, Model};
use crate::param::{Param, RankParams};
use refit::plan::Endpoint;
use refit::{Error, Result};

/// Tensor-parallel receivers: receiver `i` (position in `endpoints`) has TP rank `i`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Vllm {
    pub endpoints: Vec<Endpoint>,
}

impl Vllm {
    fn tp(&self) -> u64 {
        self.endpoints.len() as u64
    }

    fn validate(&self, model: &Model) -> Result<()> {
        let tp = self.tp();
        let bad = |why: String| Err(Error::invalid_argument(format!("vLLM receivers: {why}")));
        if tp == 0 {
            return bad("no receivers".into());
        }
        if model.heads % tp != 0 {
            return bad(format!("{} query heads do not split over tp {tp}", model.heads));
        }
        if model.kv_heads % tp != 0 && tp % model.kv_heads != 0 {
            return bad(format!(
                "{} key/value heads neither split nor replicate over tp {tp}",
                model.kv_heads
            ));
        }
        let ffn = model.moe.map_or(model.ffn, |moe| moe.ffn);
        if ffn % tp != 0 {
            return bad(format!("intermediate {ffn} does not split over tp {tp}"));
        }
        Ok(())
    }

    /// Every parameter of every receiver, in `model.named_parameters()` order.
    pub fn params(&self, model: &Model, catalog: &CheckpointTensors) -> Result<Vec<Param>> {
        model.validate()?;
        self.validate(model)?;
        let mut params = Vec::new();
        for (i, &endpoint) in self.endpoints.iter().enumerate() {
            let shard = RankParams::new(endpoint, (i as u64, self.tp()), model);
            Rank { shard }.params(model, catalog, &mut params);
        }
        Ok(params)
    }
}

struct Rank {
    shard: RankParams,
}

impl Rank {
    /// This rank's key/value heads: `(first head, heads)`.
    fn kv_heads(&self, m: &Model) -> (u64, u64) {
        let (tp, tp_size) = (self.shard.tp, self.shard.tp_size);
        if m.kv_heads >= tp_size {
            let n = m.kv_heads / tp_size;
            (tp * n, n)
        } else {
            (tp / (tp_size / m.kv_heads), 1)
        }
    }

    fn params(&self, m: &Model, c: &CheckpointTensors, out: &mut Vec<Param>) {
        let s = &self.shard;
        let (es, h) = (s.es, s.hidden);
        out.push(s.vocab_shard("model.embed_tokens.weight", c.embed));
        let hd = m.head_dim;
        let q_local = m.q_dim() / s.tp_size;
        let (kv_first, kv_n) = self.kv_heads(m);
        let kv_local = kv_n * hd;
        for (l, t) in c.layers.iter().enumerate() {
            let p = format!("model.layers.{l}");
            out.push(s.vector(format!("{p}.input_layernorm.weight"), t.input_norm, h));
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
            out.push(s.vector(format!("{p}.post_attention_layernorm.weight"), t.post_norm, h));

            match &t.mlp {
                MlpTensors::Moe { router, experts } => {
                    let moe = m.moe.expect("MoE tensors come from a MoE model");
                    let f = moe.ffn / s.tp_size;
                    let mut r = s.param(format!("{p}.mlp.gate.weight"), moe.experts * h);
                    r.rows_cols(*router, 0, (0, moe.experts), (0, h));
                    out.push(r);
                    let mut w13 = s.param(format!("{p}.mlp.experts.w13_weight"), moe.experts * 2 * f * h);
                    let mut w2 = s.param(format!("{p}.mlp.experts.w2_weight"), moe.experts * h * f);
                    for (e, &[gate, up, down]) in experts.iter().enumerate() {
                        let e = e as u64;
                        w13.gate_up_rows([gate, up], e * 2 * f * h * es, s.tp_rows(f), (h, es));
                        w2.rows_cols(down, e * h * f * es, (0, h), s.tp_rows(f));
                    }
                    out.push(w13);
                    out.push(w2);
                }
                MlpTensors::Dense { gate, up, down } => {
                    let f = m.ffn / s.tp_size;
                    let mut gate_up = s.param(format!("{p}.mlp.gate_up_proj.weight"), 2 * f * h);
                    gate_up.gate_up_rows([*gate, *up], 0, s.tp_rows(f), (h, es));
                    out.push(gate_up);
                    let mut down_proj = s.param(format!("{p}.mlp.down_proj.weight"), h * f);
                    down_proj.rows_cols(*down, 0, (0, h), s.tp_rows(f));
                    out.push(down_proj);
                }
            }
        }
        out.push(s.vector("model.norm.weight".into(), c.final_norm, h));
        out.push(s.vocab_shard("lm_head.weight", c.lm_head));
    }
}
