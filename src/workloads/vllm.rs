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

use super::model::{Catalog, MlpTensors, Model};
use super::param::{replicated_vector, vocab_rows, Param};
use crate::error::{Error, Result};
use crate::plan::Endpoint;

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
    pub fn params(&self, model: &Model, catalog: &Catalog) -> Result<Vec<Param>> {
        model.validate()?;
        self.validate(model)?;
        let mut params = Vec::new();
        for (i, &endpoint) in self.endpoints.iter().enumerate() {
            Rank { endpoint, tp: i as u64, tp_size: self.tp() }.params(model, catalog, &mut params);
        }
        Ok(params)
    }
}

struct Rank {
    endpoint: Endpoint,
    tp: u64,
    tp_size: u64,
}

impl Rank {
    /// This rank's key/value heads: `(first head, heads)`.
    fn kv_heads(&self, m: &Model) -> (u64, u64) {
        if m.kv_heads >= self.tp_size {
            let n = m.kv_heads / self.tp_size;
            (self.tp * n, n)
        } else {
            (self.tp / (self.tp_size / m.kv_heads), 1)
        }
    }

    fn params(&self, m: &Model, c: &Catalog, out: &mut Vec<Param>) {
        let es = m.elem_size as u64;
        let h = m.hidden;
        let new = |name: String, elems: u64| Param::new(self.endpoint, name, elems * es);
        let vector =
            |name: String, tensor: u32, len: u64| replicated_vector(self.endpoint, name, tensor, len, es);
        let vocab_shard = |name: &str, tensor: u32| {
            vocab_rows(self.endpoint, name.to_string(), tensor, (m.vocab, h), (self.tp, self.tp_size), es)
        };

        out.push(vocab_shard("model.embed_tokens.weight", c.embed));
        let hd = m.head_dim;
        let q_local = m.q_dim() / self.tp_size;
        let (kv_first, kv_n) = self.kv_heads(m);
        let kv_local = kv_n * hd;
        for (l, t) in c.layers.iter().enumerate() {
            let p = format!("model.layers.{l}");
            out.push(vector(format!("{p}.input_layernorm.weight"), t.input_norm, h));
            let mut qkv = new(format!("{p}.self_attn.qkv_proj.weight"), (q_local + 2 * kv_local) * h);
            qkv.rows_cols(t.q, 0, (self.tp * q_local, q_local), (0, h));
            qkv.rows_cols(t.k, q_local * h * es, (kv_first * hd, kv_local), (0, h));
            qkv.rows_cols(t.v, (q_local + kv_local) * h * es, (kv_first * hd, kv_local), (0, h));
            out.push(qkv);
            if let Some((qn, kn)) = t.qk_norm {
                out.push(vector(format!("{p}.self_attn.q_norm.weight"), qn, hd));
                out.push(vector(format!("{p}.self_attn.k_norm.weight"), kn, hd));
            }
            let mut o = new(format!("{p}.self_attn.o_proj.weight"), h * q_local);
            o.rows_cols(t.o, 0, (0, h), (self.tp * q_local, q_local));
            out.push(o);
            out.push(vector(format!("{p}.post_attention_layernorm.weight"), t.post_norm, h));

            match &t.mlp {
                MlpTensors::Moe { router, experts } => {
                    let moe = m.moe.expect("MoE tensors come from a MoE model");
                    let f = moe.ffn / self.tp_size;
                    let mut r = new(format!("{p}.mlp.gate.weight"), moe.experts * h);
                    r.rows_cols(*router, 0, (0, moe.experts), (0, h));
                    out.push(r);
                    let mut w13 = new(format!("{p}.mlp.experts.w13_weight"), moe.experts * 2 * f * h);
                    let mut w2 = new(format!("{p}.mlp.experts.w2_weight"), moe.experts * h * f);
                    for (e, &[gate, up, down]) in experts.iter().enumerate() {
                        let e = e as u64;
                        w13.rows_cols(gate, e * 2 * f * h * es, (self.tp * f, f), (0, h));
                        w13.rows_cols(up, (e * 2 + 1) * f * h * es, (self.tp * f, f), (0, h));
                        w2.rows_cols(down, e * h * f * es, (0, h), (self.tp * f, f));
                    }
                    out.push(w13);
                    out.push(w2);
                }
                MlpTensors::Dense { gate, up, down } => {
                    let f = m.ffn / self.tp_size;
                    let mut gate_up = new(format!("{p}.mlp.gate_up_proj.weight"), 2 * f * h);
                    gate_up.rows_cols(*gate, 0, (self.tp * f, f), (0, h));
                    gate_up.rows_cols(*up, f * h * es, (self.tp * f, f), (0, h));
                    out.push(gate_up);
                    let mut down_proj = new(format!("{p}.mlp.down_proj.weight"), h * f);
                    down_proj.rows_cols(*down, 0, (0, h), (self.tp * f, f));
                    out.push(down_proj);
                }
            }
        }
        out.push(vector("model.norm.weight".into(), c.final_norm, h));
        out.push(vocab_shard("lm_head.weight", c.lm_head));
    }
}
