//! One configurable attention layer for decoder models: GQA/MQA, RoPE (both styles,
//! scaled), ALiBi, q/k norm, logit soft-cap, attention sinks, sliding windows, packed
//! QKV layouts, cross-attention, and a KV cache.
//!
//! Load it from a Hugging Face checkpoint's attention weights under their own names:
//!
//! ```no_run
//! use candle_attention::decoder::{DecoderAttention, DecoderAttentionConfig, HfConfig};
//! # fn f(vb: candle_nn::VarBuilder) -> candle_core::Result<()> {
//! let hf = HfConfig::from_json(&std::fs::read_to_string("config.json")?)?;
//! let cfg = DecoderAttentionConfig::from_hf("llama", &hf, 0, false)?;
//! let attn = DecoderAttention::new(&cfg, vb.pp("model.layers.0.self_attn"))?;
//! # Ok(()) }
//! ```
mod config;

pub use config::{DecoderAttentionConfig, HfConfig, QkNorm, QkvLayout, ARCHITECTURES};

use candle::{DType, Module, Result, Tensor, D};
use candle_nn::VarBuilder;

use crate::alibi::{alibi_bias, alibi_slopes};
use crate::cache::KvCache;
use crate::cast;
use crate::mask::{AttnMask, CausalAlign};
use crate::proj::Proj;
use crate::rope::RotaryEmbedding;
use crate::sdpa::{attention, compute_dtype, Backend, SdpaOptions};

#[derive(Clone, Debug)]
enum Qkv {
    Separate {
        q: Proj,
        k: Proj,
        v: Proj,
    },
    /// `[q | k | v]` along the output dim.
    Packed(Proj),
    /// `(H, 3, head_dim)` along the output dim.
    HeadInterleaved(Proj),
}

/// The decoder attention layer. See the [module docs](self).
#[derive(Clone, Debug)]
pub struct DecoderAttention {
    cfg: DecoderAttentionConfig,
    qkv: Qkv,
    o: Proj,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    rope: Option<RotaryEmbedding>,
    alibi: Option<Vec<f64>>,
    sinks: Option<Tensor>,
    backend: Backend,
}

impl DecoderAttention {
    /// Loads the projections (and norms, sinks) named by `cfg.layout` from `vb`, which
    /// points at the attention module (e.g. `model.layers.0.self_attn`).
    pub fn new(cfg: &DecoderAttentionConfig, vb: VarBuilder) -> Result<Self> {
        let (hidden, h, hkv, hd) = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        if h == 0 || hkv == 0 || hd == 0 || !h.is_multiple_of(hkv) {
            candle::bail!("attention: num_heads ({h}) must be a positive multiple of num_kv_heads ({hkv}), head_dim {hd}")
        }
        // No projection is wider than 3·h·hd (hkv divides h), nor holds more than
        // hidden × 3·h·hd weights.
        let largest = h
            .checked_mul(3)
            .and_then(|w| w.checked_mul(hd))
            .and_then(|w| w.checked_mul(hidden.max(1)));
        if largest.is_none() {
            candle::bail!(
                "attention: num_heads {h}, num_kv_heads {hkv}, head_dim {hd} and hidden_size {hidden} overflow the projection sizes"
            )
        }
        let (qd, kvd) = (h * hd, hkv * hd);
        let lin = |name: &str, i: usize, o: usize, bias: bool| Proj::load_linear(i, o, bias, vb.pp(name));
        let (qkv, o) = match &cfg.layout {
            QkvLayout::Separate {
                q,
                k,
                v,
                o,
                q_bias,
                k_bias,
                v_bias,
                o_bias,
            } => (
                Qkv::Separate {
                    q: lin(q, hidden, qd, *q_bias)?,
                    k: lin(k, hidden, kvd, *k_bias)?,
                    v: lin(v, hidden, kvd, *v_bias)?,
                },
                lin(o, qd, hidden, *o_bias)?,
            ),
            QkvLayout::Conv1dPacked { qkv, o } => {
                if hkv != h {
                    candle::bail!(
                        "attention: a Conv1D-packed QKV needs num_kv_heads == num_heads, got {hkv} and {h}"
                    )
                }
                let conv = |name: &str, i: usize, out: usize| -> Result<Proj> {
                    let w = vb.pp(name).get((i, out), "weight")?;
                    let b = vb.pp(name).get(out, "bias")?;
                    Ok(Proj::new(w.t()?, Some(b)))
                };
                (Qkv::Packed(conv(qkv, hidden, 3 * qd)?), conv(o, qd, hidden)?)
            }
            QkvLayout::HeadInterleaved { qkv, o, bias } => {
                if hkv != h {
                    candle::bail!("attention: a head-interleaved QKV needs num_kv_heads == num_heads, got {hkv} and {h}")
                }
                (
                    Qkv::HeadInterleaved(lin(qkv, hidden, 3 * qd, *bias)?),
                    lin(o, qd, hidden, *bias)?,
                )
            }
            QkvLayout::Packed {
                qkv,
                o,
                qkv_bias,
                o_bias,
            } => (
                Qkv::Packed(lin(qkv, hidden, qd + 2 * kvd, *qkv_bias)?),
                lin(o, qd, hidden, *o_bias)?,
            ),
        };
        // Norm weights are kept as applied: in the accumulation dtype, `1 + w` for Gemma.
        let norm_weight = |name: &str, unit_offset: bool| -> Result<Tensor> {
            let w = vb.get(hd, name)?;
            let w = w.to_dtype(compute_dtype(w.dtype()))?;
            if unit_offset {
                w + 1.0
            } else {
                Ok(w)
            }
        };
        let (q_norm, k_norm) = match cfg.qk_norm {
            Some(n) => (
                Some(norm_weight("q_norm.weight", n.unit_offset)?),
                Some(norm_weight("k_norm.weight", n.unit_offset)?),
            ),
            None => (None, None),
        };
        let rope = cfg.rope.as_ref().map(RotaryEmbedding::new).transpose()?;
        let sinks = if cfg.sinks {
            Some(vb.get(h, "sinks")?)
        } else {
            None
        };
        Ok(Self {
            cfg: cfg.clone(),
            qkv,
            o,
            q_norm,
            k_norm,
            rope,
            alibi: cfg.alibi.then(|| alibi_slopes(h)).transpose()?,
            sinks,
            backend: Backend::Auto,
        })
    }

    /// Picks the SDPA implementation (default [`Backend::Auto`]).
    pub fn with_backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }

    /// The configuration.
    pub fn config(&self) -> &DecoderAttentionConfig {
        &self.cfg
    }

    /// A fresh cache suited to this layer: rotating for a sliding window, growable otherwise.
    pub fn new_cache(&self) -> Result<KvCache> {
        if self.cfg.bidirectional {
            candle::bail!(
                "attention: a bidirectional layer attends to later tokens, so it runs without a KV cache"
            )
        }
        match self.cfg.sliding_window {
            Some(w) => KvCache::rotating(w),
            None => Ok(KvCache::new()),
        }
    }

    fn check_hidden(&self, x: &Tensor, what: &str) -> Result<(usize, usize)> {
        let (b, l, e) = x.dims3().map_err(|_| {
            candle::Error::Msg(format!(
                "attention: {what} must be (B, L, hidden), got {:?}",
                x.dims()
            ))
        })?;
        if e != self.cfg.hidden_size {
            candle::bail!(
                "attention: {what} must be (B, L, {}), got {:?}",
                self.cfg.hidden_size,
                x.dims()
            )
        }
        if !x.dtype().is_float() {
            candle::bail!(
                "attention: {what} must be a float tensor, got {:?} {:?}",
                x.dims(),
                x.dtype()
            )
        }
        Ok((b, l))
    }

    /// `(B, L, hidden)` → q `(B, H, L, hd)`, and k, v `(B, Hkv, L, hd)` from `kv_src` (the
    /// same tensor for self-attention), in the accumulation dtype.
    fn project(&self, x: &Tensor, kv_src: Option<&Tensor>) -> Result<(Tensor, Option<(Tensor, Tensor)>)> {
        let (h, hkv, hd) = (self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim);
        let heads = |t: Tensor, n: usize| -> Result<Tensor> {
            let (b, l, _) = t.dims3()?;
            t.reshape((b, l, n, hd))
        };
        let (q, kv) = match &self.qkv {
            Qkv::Separate { q, k, v } => {
                let qh = heads(q.forward(x)?, h)?;
                let kv = match kv_src {
                    Some(src) => Some((heads(k.forward(src)?, hkv)?, heads(v.forward(src)?, hkv)?)),
                    None => None,
                };
                (qh, kv)
            }
            Qkv::Packed(p) => {
                let y = p.forward(x)?;
                let q = heads(y.narrow(D::Minus1, 0, h * hd)?, h)?;
                let k = heads(y.narrow(D::Minus1, h * hd, hkv * hd)?, hkv)?;
                let v = heads(y.narrow(D::Minus1, (h + hkv) * hd, hkv * hd)?, hkv)?;
                (q, Some((k, v)))
            }
            Qkv::HeadInterleaved(p) => {
                let y = p.forward(x)?;
                let (b, l, _) = y.dims3()?;
                let y = y.reshape((b, l, h, 3, hd))?;
                let part = |i: usize| y.narrow(3, i, 1)?.squeeze(3);
                (part(0)?, Some((part(1)?, part(2)?)))
            }
        };
        let norm = |t: Tensor, w: &Option<Tensor>| -> Result<Tensor> {
            match (w, self.cfg.qk_norm) {
                (Some(w), Some(n)) => rms_norm(&t, w, n.eps),
                _ => Ok(t),
            }
        };
        let q = norm(q, &self.q_norm)?.transpose(1, 2)?;
        let kv = match kv {
            Some((k, v)) => Some((norm(k, &self.k_norm)?.transpose(1, 2)?, v.transpose(1, 2)?)),
            None => None,
        };
        Ok((q, kv))
    }

    /// Checks `position_ids` `(B, L)` and returns the largest (`None` when empty).
    fn check_positions(&self, position_ids: &Tensor, b: usize, l: usize) -> Result<Option<i64>> {
        if position_ids.dims() != [b, l] {
            candle::bail!(
                "attention: position_ids must be (B, L) = ({b}, {l}), got {:?}",
                position_ids.dims()
            )
        }
        if position_ids.dtype().is_float() {
            candle::bail!(
                "attention: position_ids must be integers, got {:?}",
                position_ids.dtype()
            )
        }
        if b * l == 0 {
            return Ok(None);
        }
        let flat = position_ids.to_dtype(DType::I64)?.flatten_all()?;
        let (min, max) = (flat.min(0)?.to_scalar::<i64>()?, flat.max(0)?.to_scalar::<i64>()?);
        if min < 0 {
            candle::bail!("attention: positions out of range: position_ids contains {min}")
        }
        if let Some(limit) = self.cfg.max_position_embeddings {
            if max as usize >= limit {
                candle::bail!(
                    "attention: positions out of range: position_ids contains {max}, max_position_embeddings is {limit}"
                )
            }
        }
        Ok(Some(max))
    }

    /// Self-attention over `x` `(B, L, hidden)` at `position_ids` `(B, L)`, returning `(B, L, hidden)`.
    ///
    /// - `attention_mask` `(B, T)`, non-zero = real token (Hugging Face's padding mask, left
    ///   padding allowed), covers every position so far: `T` is the number of tokens seen by
    ///   the cache after this call (`L` without a cache).
    /// - `cache`: keys and values are appended to it and attention runs over all of them,
    ///   with the causal rule aligned bottom-right (query `i` is token `cache.seen() + i`).
    ///   A [bidirectional](DecoderAttentionConfig::bidirectional) layer refuses a cache: each
    ///   token attends to the tokens before and after it within the call.
    /// - Queries, keys and values are rounded to `x`'s dtype after their projection (and
    ///   RoPE), as PyTorch's bf16/f16 layers round them, so the cache holds K/V in that
    ///   dtype; scores, softmax and sums still accumulate in f32.
    pub fn forward_cached(
        &self,
        x: &Tensor,
        position_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        if self.cfg.cross_attention {
            candle::bail!("attention: this is a cross-attention layer; use forward_cross")
        }
        if self.cfg.bidirectional && cache.is_some() {
            candle::bail!(
                "attention: a bidirectional layer attends to later tokens, so it runs without a KV cache"
            )
        }
        let (b, l) = self.check_hidden(x, "hidden_states")?;
        let max_position = self.check_positions(position_ids, b, l)?;
        let (q, kv) = self.project(x, Some(x))?;
        let (mut q, (mut k, v)) = (
            q,
            kv.ok_or_else(|| candle::Error::Msg("attention: no keys".into()))?,
        );
        if let Some(rope) = &self.rope {
            // check_positions already validated them and found the largest.
            let (cos, sin) = rope.cos_sin_at(position_ids, q.dtype(), max_position)?;
            q = rope.apply(&q.contiguous()?, &cos, &sin)?;
            k = rope.apply(&k.contiguous()?, &cos, &sin)?;
        }
        let (q, k, v) = (
            in_model_dtype(&q, x)?,
            in_model_dtype(&k, x)?,
            in_model_dtype(&v, x)?,
        );
        let (past, k, v, positions) = match cache {
            Some(c) => {
                let past = c.seen();
                let view = c.append(&k, &v)?;
                (past, view.k, view.v, view.positions)
            }
            None => (0, k, v, (0..l).collect()),
        };
        let total = past + l;
        let contiguous = positions.iter().enumerate().all(|(i, &p)| i == p);
        let mut mask = if self.cfg.bidirectional {
            // No cache (refused above), so keys and queries are the same tokens 0..L.
            match self.cfg.sliding_window {
                // |i - j| < w: the causal band of 2w - 1 keys shifted w - 1 ahead.
                // (A window of 0 gives a band of 0, which `sliding_window` refuses.)
                Some(w) => {
                    let band = w.saturating_mul(2).saturating_sub(1);
                    let ahead = isize::try_from(w.saturating_sub(1)).unwrap_or(isize::MAX);
                    AttnMask::sliding_window(band, CausalAlign::Offset(ahead))?
                }
                None => AttnMask::none(),
            }
        } else if contiguous {
            match self.cfg.sliding_window {
                Some(w) => AttnMask::sliding_window(w, CausalAlign::Offset(past as isize))?,
                None => AttnMask::causal_with_offset(past as isize),
            }
        } else {
            AttnMask::additive(&self.positional_mask(past, l, &positions, q.device())?)?
        };
        if let Some(am) = attention_mask {
            if am.dims() != [b, total] {
                candle::bail!(
                    "attention: attention_mask must be (B, tokens so far) = ({b}, {total}), got {:?}",
                    am.dims()
                )
            }
            let am = if contiguous {
                am.clone()
            } else {
                let idx: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
                am.index_select(&Tensor::new(idx.as_slice(), am.device())?, 1)?
            };
            let s = positions.len();
            mask = mask.and(&AttnMask::keep(&am.reshape((b, 1, 1, s))?)?);
        }
        if let Some(slopes) = &self.alibi {
            mask = mask.and(&AttnMask::additive(&alibi_bias(
                slopes,
                &positions,
                compute_dtype(q.dtype()),
                q.device(),
            )?)?);
        }
        self.attend(x, &q, &k, &v, mask)
    }

    /// `(L, S)` additive mask for keys at arbitrary absolute `positions` (a rotating cache).
    fn positional_mask(
        &self,
        past: usize,
        l: usize,
        positions: &[usize],
        dev: &candle::Device,
    ) -> Result<Tensor> {
        let s = positions.len();
        let mut m = vec![f32::NEG_INFINITY; l * s];
        for i in 0..l {
            let qp = past + i;
            for (j, &kp) in positions.iter().enumerate() {
                // `kp + w > qp`, without overflow for a huge window.
                if kp <= qp && self.cfg.sliding_window.is_none_or(|w| qp - kp < w) {
                    m[i * s + j] = 0.0;
                }
            }
        }
        Tensor::from_vec(m, (l, s), dev)
    }

    /// Cross-attention of `x` `(B, L, hidden)` over encoder states `(B, S, hidden)`.
    ///
    /// With a cache, the encoder keys and values are computed on the first call and
    /// reused afterwards (`encoder_hidden_states` may then be `None`).
    pub fn forward_cross(
        &self,
        x: &Tensor,
        encoder_hidden_states: Option<&Tensor>,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        let (b, _) = self.check_hidden(x, "hidden_states")?;
        if let Some(w) = cache.as_ref().and_then(|c| c.window()) {
            candle::bail!(
                "attention: cross-attention keeps every encoder key, so it needs a linear KV cache, got a rotating one (window {w})"
            )
        }
        let cached = match &cache {
            Some(c) => c.current()?,
            None => None,
        };
        let (q, _) = self.project(x, None)?;
        let q = in_model_dtype(&q, x)?;
        let (k, v) = match cached {
            Some(view) => (view.k, view.v),
            None => {
                let enc = encoder_hidden_states.ok_or_else(|| {
                    candle::Error::Msg(
                        "attention: cross-attention needs encoder_hidden_states on its first call".into(),
                    )
                })?;
                let (be, _) = self.check_hidden(enc, "encoder_hidden_states")?;
                if be != b {
                    candle::bail!(
                        "attention: encoder_hidden_states {:?} and hidden_states {:?} disagree on the batch",
                        enc.dims(),
                        x.dims()
                    )
                }
                let (k, v) = self.cross_kv(enc)?;
                let (k, v) = (in_model_dtype(&k, x)?, in_model_dtype(&v, x)?);
                match cache {
                    Some(c) => {
                        let view = c.append(&k, &v)?;
                        (view.k, view.v)
                    }
                    None => (k, v),
                }
            }
        };
        self.attend(x, &q, &k, &v, AttnMask::none())
    }

    /// Encoder keys and values `(B, Hkv, S, hd)` for cross-attention.
    fn cross_kv(&self, enc: &Tensor) -> Result<(Tensor, Tensor)> {
        let (hkv, hd) = (self.cfg.num_kv_heads, self.cfg.head_dim);
        match &self.qkv {
            Qkv::Separate { k, v, .. } => {
                let (b, s, _) = enc.dims3()?;
                let k = k.forward(enc)?.reshape((b, s, hkv, hd))?;
                let k = match (&self.k_norm, self.cfg.qk_norm) {
                    (Some(w), Some(n)) => rms_norm(&k, w, n.eps)?,
                    _ => k,
                };
                let v = v.forward(enc)?.reshape((b, s, hkv, hd))?;
                Ok((k.transpose(1, 2)?, v.transpose(1, 2)?))
            }
            _ => candle::bail!("attention: cross-attention needs separate q/k/v projections"),
        }
    }

    fn attend(&self, x: &Tensor, q: &Tensor, k: &Tensor, v: &Tensor, mask: AttnMask) -> Result<Tensor> {
        let (b, l, _) = x.dims3()?;
        let opts = SdpaOptions {
            mask: (!mask.is_empty()).then_some(mask),
            scale: Some(self.cfg.scale),
            enable_gqa: true,
            backend: self.backend,
            softcap: self.cfg.softcap,
            sinks: self.sinks.clone(),
            ..SdpaOptions::default()
        };
        // Fused: (B, L, H, D) memory, so the transpose and reshape below copy nothing.
        let o = attention(q, k, v, &opts, true)?.output;
        let o = o
            .transpose(1, 2)?
            .reshape((b, l, self.cfg.num_heads * self.cfg.head_dim))?;
        self.o.forward_to(&o, x.dtype())
    }
}

/// `t` (a projection's output, in the accumulation dtype) rounded to the dtype of the
/// layer's input `x`, as PyTorch's `nn.Linear` returns it: queries, keys and values
/// enter attention, and keys and values the cache, in the model's dtype (bf16 K/V take
/// half the memory and half the bytes per decode step of f32 ones).
fn in_model_dtype(t: &Tensor, x: &Tensor) -> Result<Tensor> {
    cast::to_dtype(t, x.dtype())
}

/// RMSNorm over the last dim in the accumulation dtype: `x / rms(x) · w`, where `w` is the
/// weight as applied (already `1 + w` for Gemma, see [`DecoderAttention::new`]).
fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let cd = compute_dtype(x.dtype());
    if x.elem_count() == 0 {
        // candle's reductions index out of bounds on an empty view at an offset.
        return Tensor::zeros(x.shape(), cd, x.device());
    }
    let x = x.to_dtype(cd)?;
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    let y = x.broadcast_div(&(ms + eps)?.sqrt()?)?;
    y.broadcast_mul(&w.to_dtype(cd)?)
}

impl Module for DecoderAttention {
    /// Self-attention without cache or padding, causal unless the layer is
    /// [bidirectional](DecoderAttentionConfig::bidirectional): `(B, L, hidden)` →
    /// `(B, L, hidden)`, positions `0..L` in every row.
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let (b, l) = self.check_hidden(xs, "hidden_states")?;
        let pos = Tensor::arange(0i64, l as i64, xs.device())?
            .unsqueeze(0)?
            .broadcast_as((b, l))?
            .contiguous()?;
        self.forward_cached(xs, &pos, None, None)
    }
}
