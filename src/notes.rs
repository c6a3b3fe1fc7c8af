//! The three modules of the reference notes (`attention-notes.zh.txt`), done right.
//!
//! The notes' PyTorch code has three defects that these modules do not copy:
//! - their multi-head classes reshape to `(B, L, H, d_k)` and never move the heads
//!   in front of the positions, so `q @ kᵀ` mixes heads instead of positions;
//!   here heads are transposed to `(B, H, L, d_k)` before the product;
//! - their `CausalAttention` applies no causal mask; here it is the top-left
//!   causal rule of PyTorch's `is_causal`;
//! - they have no output projection; here `wo` is applied unless
//!   [`AttentionConfig::out_proj`] is false.
//!
//! The notes also claim that the `1/√d_k` scale keeps scores in `[0, 1]`. It does
//! not: it keeps the variance of `q · k` near 1 for unit-variance inputs.
use candle::{Module, Result, Tensor};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use crate::mask::AttnMask;
use crate::proj::Proj;
use crate::sdpa::{attention, scaled_dot_product_attention, Backend, SdpaOptions};

fn yes() -> bool {
    true
}

/// Weight-name prefixes of the four projections (each holds `.weight` and `.bias`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProjNames {
    /// Query projection.
    pub q: String,
    /// Key projection.
    pub k: String,
    /// Value projection.
    pub v: String,
    /// Output projection.
    pub o: String,
}

impl Default for ProjNames {
    /// The notes' names: `wq`, `wk`, `wv`, `wo`.
    fn default() -> Self {
        Self::new("wq", "wk", "wv", "wo")
    }
}

impl ProjNames {
    /// Any four names.
    pub fn new(q: &str, k: &str, v: &str, o: &str) -> Self {
        Self {
            q: q.to_string(),
            k: k.to_string(),
            v: v.to_string(),
            o: o.to_string(),
        }
    }
    /// Llama/Mistral/Qwen/BART style: `q_proj`, `k_proj`, `v_proj`, `o_proj`.
    pub fn hf() -> Self {
        Self::new("q_proj", "k_proj", "v_proj", "o_proj")
    }
}

/// Configuration of [`MultiHeadAttention`] and [`CausalAttention`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AttentionConfig {
    /// Model width; the Q/K/V/O projections are `d_model × d_model`.
    pub d_model: usize,
    /// Number of heads; `d_k = d_model / n_heads`.
    pub n_heads: usize,
    /// Apply the output projection `wo` (default true).
    #[serde(default = "yes")]
    pub out_proj: bool,
    /// Weight names (default `wq`, `wk`, `wv`, `wo`).
    #[serde(default)]
    pub names: ProjNames,
}

impl AttentionConfig {
    /// `d_model`, `n_heads`, with an output projection and the notes' names.
    pub fn new(d_model: usize, n_heads: usize) -> Self {
        Self {
            d_model,
            n_heads,
            out_proj: true,
            names: ProjNames::default(),
        }
    }
}

/// `softmax(q · kᵀ / √d_k) · v`, the notes' `ScaledDotProductAttention`.
///
/// Shapes: `q (…, L, d_k)`, `k (…, S, d_k)`, `v (…, S, d_v)` → `(…, L, d_v)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScaledDotProductAttention {
    d_k: usize,
    backend: Backend,
}

impl ScaledDotProductAttention {
    /// A parameter-free layer for key dimension `d_k`.
    pub fn new(d_k: usize) -> Self {
        Self {
            d_k,
            backend: Backend::Auto,
        }
    }

    /// Picks the SDPA implementation (default [`Backend::Auto`]).
    pub fn with_backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }

    /// Attention of `q` over `k`/`v`.
    pub fn forward_qkv(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        self.forward_masked(q, k, v, None)
    }

    /// Attention with an optional mask broadcastable to `(…, L, S)`.
    pub fn forward_masked(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&AttnMask>,
    ) -> Result<Tensor> {
        if q.dims().last() != Some(&self.d_k) {
            candle::bail!(
                "ScaledDotProductAttention(d_k = {}): query must be (…, L, {}), got {:?}",
                self.d_k,
                self.d_k,
                q.dims()
            )
        }
        let opts = SdpaOptions {
            mask: mask.cloned(),
            backend: self.backend,
            ..SdpaOptions::default()
        };
        Ok(scaled_dot_product_attention(q, k, v, &opts)?.output)
    }
}

impl Module for ScaledDotProductAttention {
    /// Self-attention: `q = k = v = xs`, `(…, L, d_k)`.
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.forward_qkv(xs, xs, xs)
    }
}

/// The notes' `MultiHeadAttention`, corrected: Q/K/V linears with bias, heads
/// attend over positions, and an optional output projection.
///
/// Weights: `<names.q>.weight` `(d_model, d_model)` and `<names.q>.bias` `(d_model)`, the
/// same for `k`, `v`, and `o` when `out_proj`.
///
/// In f16 and bf16, each projection is computed in f32 and rounded to the query's dtype,
/// as PyTorch's `nn.Linear` returns it.
#[derive(Clone, Debug)]
pub struct MultiHeadAttention {
    wq: Proj,
    wk: Proj,
    wv: Proj,
    wo: Option<Proj>,
    d_model: usize,
    n_heads: usize,
    causal: bool,
    backend: Backend,
}

impl MultiHeadAttention {
    /// Loads the projections named in `cfg.names` from `vb`.
    pub fn new(cfg: &AttentionConfig, vb: VarBuilder) -> Result<Self> {
        Self::load(cfg, vb, false)
    }

    fn load(cfg: &AttentionConfig, vb: VarBuilder, causal: bool) -> Result<Self> {
        let (d, h) = (cfg.d_model, cfg.n_heads);
        if d == 0 || h == 0 || !d.is_multiple_of(h) {
            candle::bail!("attention: d_model ({d}) must be a positive multiple of n_heads ({h})")
        }
        let lin = |name: &str| Proj::load_linear(d, d, true, vb.pp(name));
        Ok(Self {
            wq: lin(&cfg.names.q)?,
            wk: lin(&cfg.names.k)?,
            wv: lin(&cfg.names.v)?,
            wo: if cfg.out_proj {
                Some(lin(&cfg.names.o)?)
            } else {
                None
            },
            d_model: d,
            n_heads: h,
            causal,
            backend: Backend::Auto,
        })
    }

    /// Picks the SDPA implementation (default [`Backend::Auto`]).
    pub fn with_backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }

    /// `query (B, L, d_model)`, `key`/`value (B, S, d_model)` → `(B, L, d_model)`.
    pub fn forward_qkv(&self, query: &Tensor, key: &Tensor, value: &Tensor) -> Result<Tensor> {
        self.forward_masked(query, key, value, None)
    }

    /// As [`Self::forward_qkv`], with a mask broadcastable to `(B, H, L, S)`
    /// (combined with the causal rule for [`CausalAttention`]).
    pub fn forward_masked(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        mask: Option<&AttnMask>,
    ) -> Result<Tensor> {
        let (d, h) = (self.d_model, self.n_heads);
        let (b, l, qd) = query.dims3().map_err(|_| self.shape_err(query, key, value))?;
        let (bk, s, kd) = key.dims3().map_err(|_| self.shape_err(query, key, value))?;
        let (bv, sv, vd) = value.dims3().map_err(|_| self.shape_err(query, key, value))?;
        if qd != d || kd != d || vd != d || bk != b || bv != b || sv != s {
            return Err(self.shape_err(query, key, value));
        }
        let heads =
            |t: Tensor, len: usize| -> Result<Tensor> { t.reshape((b, len, h, d / h))?.transpose(1, 2) };
        // Each projection computed in the accumulation dtype and rounded to the query's
        // dtype, as PyTorch's `nn.Linear` returns it.
        let dt = query.dtype();
        let proj = |p: &Proj, x: &Tensor| p.forward_to(x, dt);
        let q = heads(proj(&self.wq, query)?, l)?;
        let k = heads(proj(&self.wk, key)?, s)?;
        let v = heads(proj(&self.wv, value)?, s)?;
        let opts = SdpaOptions {
            mask: mask.cloned(),
            is_causal: self.causal,
            backend: self.backend,
            ..SdpaOptions::default()
        };
        // Fused: (B, L, H, d_k) memory, so the transpose and reshape copy nothing.
        let o = attention(&q, &k, &v, &opts, true)?.output;
        let o = o.transpose(1, 2)?.reshape((b, l, d))?;
        match &self.wo {
            Some(wo) => proj(wo, &o),
            None => Ok(o),
        }
    }

    fn shape_err(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> candle::Error {
        candle::Error::Msg(format!(
            "attention(d_model = {}): expected query (B, L, {0}) and key/value (B, S, {0}), got query {:?}, key {:?}, value {:?}",
            self.d_model,
            q.dims(),
            k.dims(),
            v.dims()
        ))
    }
}

impl Module for MultiHeadAttention {
    /// Self-attention: `(B, L, d_model)` → `(B, L, d_model)`.
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.forward_qkv(xs, xs, xs)
    }
}

/// The notes' `CausalAttention`, corrected: [`MultiHeadAttention`] with the top-left
/// causal rule (key `j` visible from query `i` iff `j <= i`, PyTorch's `is_causal`).
#[derive(Clone, Debug)]
pub struct CausalAttention {
    inner: MultiHeadAttention,
}

impl CausalAttention {
    /// Loads the projections named in `cfg.names` from `vb`.
    pub fn new(cfg: &AttentionConfig, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            inner: MultiHeadAttention::load(cfg, vb, true)?,
        })
    }

    /// `query (B, L, d_model)`, `key`/`value (B, S, d_model)` → `(B, L, d_model)`.
    pub fn forward_qkv(&self, query: &Tensor, key: &Tensor, value: &Tensor) -> Result<Tensor> {
        self.inner.forward_qkv(query, key, value)
    }

    /// Picks the SDPA implementation (default [`Backend::Auto`]).
    pub fn with_backend(self, backend: Backend) -> Self {
        Self {
            inner: self.inner.with_backend(backend),
        }
    }

    /// As [`Self::forward_qkv`], with an extra mask combined with the causal rule.
    pub fn forward_masked(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        mask: Option<&AttnMask>,
    ) -> Result<Tensor> {
        self.inner.forward_masked(query, key, value, mask)
    }
}

impl Module for CausalAttention {
    /// Causal self-attention: `(B, L, d_model)` → `(B, L, d_model)`.
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.inner.forward(xs)
    }
}
