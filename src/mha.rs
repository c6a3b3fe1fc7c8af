//! `torch.nn.MultiheadAttention`, loaded from its `state_dict` key names unchanged.
//!
//! | PyTorch | here |
//! |---|---|
//! | `nn.MultiheadAttention(embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first)` | [`MultiheadAttentionConfig`] + [`MultiheadAttention::new`] |
//! | `mha(query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal)` | [`MultiheadAttention::forward_with`] with [`MhaArgs`] |
//! | `mha(x, x, x, need_weights=False)[0]` | [`candle_nn::Module::forward`] |
//!
//! The layer is inference-only (`.eval()`): `dropout` is read from the config
//! and never applied.
use candle::{IndexOp, Module, Result, Tensor, D};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use crate::mask::AttnMask;
use crate::proj::Proj;
use crate::sdpa::{attention, compute_dtype, Backend, SdpaOptions};

fn yes() -> bool {
    true
}

/// The constructor arguments of `torch.nn.MultiheadAttention` (serde, with PyTorch's
/// defaults for absent keys; unknown keys such as `device` are ignored).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MultiheadAttentionConfig {
    /// Model width `E`.
    pub embed_dim: usize,
    /// Number of heads; `E` must be a multiple of it.
    pub num_heads: usize,
    /// Attention dropout; inference ignores it.
    #[serde(default)]
    pub dropout: f64,
    /// Biases on the input and output projections.
    #[serde(default = "yes")]
    pub bias: bool,
    /// Learned `bias_k` / `bias_v` rows appended to the keys and values.
    #[serde(default)]
    pub add_bias_kv: bool,
    /// A zero key and value appended to every sequence.
    #[serde(default)]
    pub add_zero_attn: bool,
    /// Feature size of `key`; `None` means `embed_dim`.
    #[serde(default)]
    pub kdim: Option<usize>,
    /// Feature size of `value`; `None` means `embed_dim`.
    #[serde(default)]
    pub vdim: Option<usize>,
    /// Inputs are `(N, L, E)` instead of `(L, N, E)`.
    #[serde(default)]
    pub batch_first: bool,
}

impl MultiheadAttentionConfig {
    /// PyTorch's defaults for the given sizes.
    pub fn new(embed_dim: usize, num_heads: usize) -> Self {
        Self {
            embed_dim,
            num_heads,
            dropout: 0.0,
            bias: true,
            add_bias_kv: false,
            add_zero_attn: false,
            kdim: None,
            vdim: None,
            batch_first: false,
        }
    }
    fn kdim(&self) -> usize {
        self.kdim.unwrap_or(self.embed_dim)
    }
    fn vdim(&self) -> usize {
        self.vdim.unwrap_or(self.embed_dim)
    }
}

/// Forward arguments of `nn.MultiheadAttention` beyond query, key and value.
///
/// `Default` gives PyTorch's defaults: `need_weights = true`,
/// `average_attn_weights = true`, no masks, `is_causal = false`.
#[derive(Clone, Copy, Debug)]
pub struct MhaArgs<'a> {
    /// `(N, S)`, or `(S)` for unbatched input. Bool (`u8`): non-zero = ignore that key;
    /// float: added to the scores.
    pub key_padding_mask: Option<&'a Tensor>,
    /// `(L, S)` or `(N·num_heads, L, S)` (`(num_heads, L, S)` unbatched). Bool (`u8`):
    /// non-zero = NOT allowed to attend (the opposite of SDPA); float: added.
    pub attn_mask: Option<&'a Tensor>,
    /// Return the attention weights.
    pub need_weights: bool,
    /// Average the weights over heads: `(N, L, S)` instead of `(N, num_heads, L, S)`.
    pub average_attn_weights: bool,
    /// Causal hint. PyTorch requires `attn_mask` to hold the causal mask then; here the
    /// top-left causal rule is applied in any case, together with `attn_mask` if given.
    pub is_causal: bool,
    /// Which SDPA implementation runs the attention (not a PyTorch argument).
    pub backend: Backend,
}

impl Default for MhaArgs<'_> {
    fn default() -> Self {
        Self {
            key_padding_mask: None,
            attn_mask: None,
            need_weights: true,
            average_attn_weights: true,
            is_causal: false,
            backend: Backend::Auto,
        }
    }
}

/// `torch.nn.MultiheadAttention` in inference mode.
///
/// Weight keys, exactly those of the PyTorch `state_dict`:
/// - `in_proj_weight` `(3E, E)` when `kdim == vdim == embed_dim`, otherwise
///   `q_proj_weight` `(E, E)`, `k_proj_weight` `(E, kdim)`, `v_proj_weight` `(E, vdim)`;
/// - `in_proj_bias` `(3E)` and `out_proj.bias` `(E)` when `bias`;
/// - `out_proj.weight` `(E, E)`;
/// - `bias_k`, `bias_v` `(1, 1, E)` when `add_bias_kv`.
///
/// With `in_proj_weight` and no `add_bias_kv`, self-attention (query, key and value the
/// same tensor, as in [`Module::forward`]) runs the three input projections as one
/// `(N·L, E) · (3E, E)ᵀ` product, as PyTorch does; other calls run three.
///
/// ```no_run
/// use candle_core::{DType, Device};
/// use candle_attention::{MultiheadAttention, MultiheadAttentionConfig};
/// let vb = unsafe { candle_nn::VarBuilder::from_mmaped_safetensors(&["mha.safetensors"], DType::F32, &Device::Cpu)? };
/// let mha = MultiheadAttention::new(&MultiheadAttentionConfig::new(512, 8), vb)?;
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct MultiheadAttention {
    cfg: MultiheadAttentionConfig,
    q: Proj,
    k: Proj,
    v: Proj,
    /// `in_proj_weight` whole, `(3E, E)`, for self-attention (query, key and value the
    /// same tensor): one product instead of three.
    qkv: Option<Proj>,
    out: Proj,
    bias_k: Option<Tensor>,
    bias_v: Option<Tensor>,
    head_dim: usize,
}

impl MultiheadAttention {
    /// Loads the layer from a `VarBuilder` holding the PyTorch `state_dict` keys.
    pub fn new(cfg: &MultiheadAttentionConfig, vb: VarBuilder) -> Result<Self> {
        let cfg = cfg.clone();
        let e = cfg.embed_dim;
        let h = cfg.num_heads;
        if e == 0 || h == 0 || !e.is_multiple_of(h) {
            candle::bail!(
                "MultiheadAttention: embed_dim ({e}) must be a positive multiple of num_heads ({h})"
            )
        }
        let (kdim, vdim) = (cfg.kdim(), cfg.vdim());
        let in_bias = if cfg.bias {
            Some(vb.get(3 * e, "in_proj_bias")?)
        } else {
            None
        };
        let bias_part = |i: usize| -> Result<Option<Tensor>> {
            in_bias.as_ref().map(|b| b.narrow(0, i * e, e)).transpose()
        };
        let mut qkv = None;
        let (wq, wk, wv) = if kdim == e && vdim == e {
            let w = vb.get((3 * e, e), "in_proj_weight")?;
            qkv = Some(Proj::new(w.clone(), in_bias.clone()));
            (w.narrow(0, 0, e)?, w.narrow(0, e, e)?, w.narrow(0, 2 * e, e)?)
        } else {
            (
                vb.get((e, e), "q_proj_weight")?,
                vb.get((e, kdim), "k_proj_weight")?,
                vb.get((e, vdim), "v_proj_weight")?,
            )
        };
        let q = Proj::new(wq, bias_part(0)?);
        let k = Proj::new(wk, bias_part(1)?);
        let v = Proj::new(wv, bias_part(2)?);
        let out = Proj::load_linear(e, e, cfg.bias, vb.pp("out_proj"))?;
        let (bias_k, bias_v) = if cfg.add_bias_kv {
            (
                Some(vb.get((1, 1, e), "bias_k")?),
                Some(vb.get((1, 1, e), "bias_v")?),
            )
        } else {
            (None, None)
        };
        Ok(Self {
            head_dim: e / h,
            cfg,
            q,
            k,
            v,
            qkv,
            out,
            bias_k,
            bias_v,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &MultiheadAttentionConfig {
        &self.cfg
    }

    /// PyTorch's `forward(query, key, value, key_padding_mask, need_weights, attn_mask,
    /// average_attn_weights, is_causal)`.
    ///
    /// - `query`: `(L, N, E)`, or `(N, L, E)` with `batch_first`, or `(L, E)` unbatched;
    /// - `key`: `(S, N, kdim)` / `(N, S, kdim)` / `(S, kdim)`; `value` likewise with `vdim`.
    ///
    /// Returns the output in the query's layout, `(L, N, E)` / `(N, L, E)` / `(L, E)`, and
    /// with `need_weights` the weights `(N, L, S')` averaged or `(N, num_heads, L, S')`
    /// (`N` dropped when unbatched), where `S'` counts the keys added by `add_bias_kv`
    /// and `add_zero_attn`. Rows whose keys are all masked give 0 in the output and the
    /// weights (PyTorch gives NaN there when `need_weights` is set).
    pub fn forward_with(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        args: &MhaArgs,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let cfg = &self.cfg;
        let (e, h, hd) = (cfg.embed_dim, cfg.num_heads, self.head_dim);
        let unbatched = match (query.rank(), key.rank(), value.rank()) {
            (2, 2, 2) => true,
            (3, 3, 3) => false,
            _ => candle::bail!(
                "MultiheadAttention: query, key and value must all be 3-D (batched) or 2-D (unbatched), \
                 got query {:?}, key {:?}, value {:?}",
                query.dims(),
                key.dims(),
                value.dims()
            ),
        };
        // To batch-first (N, L, E).
        let to_nle = |t: &Tensor| -> Result<Tensor> {
            if unbatched {
                t.unsqueeze(0)
            } else if cfg.batch_first {
                Ok(t.clone())
            } else {
                t.transpose(0, 1)
            }
        };
        let (qn, kn, vn) = (to_nle(query)?, to_nle(key)?, to_nle(value)?);
        let (n, l, qe) = qn.dims3()?;
        let (nk, s, ke) = kn.dims3()?;
        let (nv, sv, ve) = vn.dims3()?;
        if qe != e || ke != cfg.kdim() || ve != cfg.vdim() {
            candle::bail!(
                "MultiheadAttention: expected feature dims query {e}, key {}, value {}, got query {:?}, key {:?}, value {:?}",
                cfg.kdim(),
                cfg.vdim(),
                query.dims(),
                key.dims(),
                value.dims()
            )
        }
        if nk != n || nv != n || sv != s {
            candle::bail!(
                "MultiheadAttention: query, key and value disagree on batch or key length: query {:?}, key {:?}, value {:?} (batch_first = {})",
                query.dims(),
                key.dims(),
                value.dims(),
                cfg.batch_first
            )
        }

        // Masks, checked against PyTorch's shapes before any key is appended.
        let mut mask = AttnMask::none();
        let mut extra_keys = 0usize;
        if self.bias_k.is_some() {
            extra_keys += 1;
        }
        if cfg.add_zero_attn {
            extra_keys += 1;
        }
        if let Some(am) = args.attn_mask {
            let am4 = match (am.dims(), unbatched) {
                (&[ml, ms], _) if ml == l && ms == s => am.reshape((1, 1, l, s))?,
                (&[nh, ml, ms], false) if nh == n * h && ml == l && ms == s => am.reshape((n, h, l, s))?,
                (&[nh, ml, ms], true) if nh == h && ml == l && ms == s => am.reshape((1, h, l, s))?,
                (d, _) => candle::bail!(
                    "MultiheadAttention: attn_mask must have shape ({l}, {s}) or ({}, {l}, {s}), got {d:?}",
                    if unbatched { h } else { n * h }
                ),
            };
            // Appended keys are never masked by attn_mask (PyTorch pads it with zeros).
            let am4 = am4.pad_with_zeros(D::Minus1, 0, extra_keys)?;
            mask = mask.and(&if am.dtype().is_float() {
                AttnMask::additive(&am4)?
            } else {
                AttnMask::ignore(&am4)?
            });
        }
        if let Some(kpm) = args.key_padding_mask {
            let ok = if unbatched {
                kpm.dims() == [s]
            } else {
                kpm.dims() == [n, s]
            };
            if !ok {
                candle::bail!(
                    "MultiheadAttention: key_padding_mask must have shape {:?}, got {:?}",
                    if unbatched { vec![s] } else { vec![n, s] },
                    kpm.dims()
                )
            }
            let kpm = kpm.reshape((n, s))?.pad_with_zeros(D::Minus1, 0, extra_keys)?;
            mask = mask.and(&AttnMask::key_padding(&kpm)?);
        }

        // Projections, in the accumulation dtype.
        let dt = query.dtype();
        let cd = compute_dtype(dt);
        let heads = |t: &Tensor| -> Result<Tensor> {
            let (n, len, _) = t.dims3()?;
            t.reshape((n, len, h, hd))?.transpose(1, 2)
        };
        let fused = match &self.qkv {
            Some(p) if self.bias_k.is_none() && query.id() == key.id() && key.id() == value.id() => Some(p),
            _ => None,
        };
        let (q, mut k, mut v) = if let Some(qkv) = fused {
            // Self-attention: one product with the whole `in_proj_weight`. Its output
            // (N, L, 3E) is viewed as (N, L, 3, H, hd), and q, k and v are strided views
            // (N, H, L, hd) of it, read in place by the kernel.
            let y = qkv.forward(&qn)?.reshape((n, l, 3, h, hd))?;
            let part = |i: usize| y.i((.., .., i))?.transpose(1, 2);
            (part(0)?, part(1)?, part(2)?)
        } else {
            let q = self.q.forward(&qn)?;
            let mut k = self.k.forward(&kn)?;
            let mut v = self.v.forward(&vn)?;
            if let (Some(bk), Some(bv)) = (&self.bias_k, &self.bias_v) {
                k = Tensor::cat(&[&k, &bk.to_dtype(cd)?.broadcast_as((n, 1, e))?], 1)?;
                v = Tensor::cat(&[&v, &bv.to_dtype(cd)?.broadcast_as((n, 1, e))?], 1)?;
            }
            (heads(&q)?, heads(&k)?, heads(&v)?)
        };
        if cfg.add_zero_attn {
            k = k.pad_with_zeros(2, 0, 1)?;
            v = v.pad_with_zeros(2, 0, 1)?;
        }

        let opts = SdpaOptions {
            mask: if mask.is_empty() { None } else { Some(mask) },
            is_causal: args.is_causal,
            need_weights: args.need_weights,
            backend: args.backend,
            ..SdpaOptions::default()
        };
        // The fused kernel writes its output as (N, L, H, hd) memory, so the transpose and
        // reshape below copy nothing.
        let att = attention(&q, &k, &v, &opts, true)?;
        // (N, H, L, hd) → (N, L, E) → out_proj.
        let o = att.output.transpose(1, 2)?.reshape((n, l, e))?;
        let o = self.out.forward(&o)?.to_dtype(dt)?;
        let o = if unbatched {
            o.squeeze(0)?
        } else if cfg.batch_first {
            o
        } else {
            o.transpose(0, 1)?.contiguous()?
        };
        let w = match att.weights {
            None => None,
            Some(w) => {
                let w = if args.average_attn_weights {
                    w.mean(1)?.to_dtype(dt)?
                } else {
                    w.to_dtype(dt)?
                };
                Some(if unbatched { w.squeeze(0)? } else { w })
            }
        };
        Ok((o, w))
    }
}

impl Module for MultiheadAttention {
    /// Self-attention without masks: `mha(x, x, x, need_weights=False)[0]`.
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let args = MhaArgs {
            need_weights: false,
            ..MhaArgs::default()
        };
        Ok(self.forward_with(xs, xs, xs, &args)?.0)
    }
}
