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

use crate::mask::{self, AttnMask, CausalRule};
use crate::proj::Proj;
use crate::sdpa::{attention, compute_dtype, Backend, SdpaOptions};
use crate::{cast, empty};

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
    /// The rule covers the `S` given keys: keys appended by `add_bias_kv` and
    /// `add_zero_attn` stay visible, as PyTorch's padded `attn_mask` leaves them.
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
/// In f16 and bf16, each projection is computed in f32 and rounded to the query's dtype,
/// as PyTorch's `nn.Linear` returns it: q, k, v and the attention output are f16/bf16
/// tensors, as in PyTorch's layer. (A layer loaded in f32 keeps them in f32.)
///
/// The README's example (a `state_dict` saved with `safetensors.torch.save_file`):
///
/// ```no_run
/// use candle_core::{DType, Device, Tensor};
/// use candle_attention::{MhaArgs, MultiheadAttention, MultiheadAttentionConfig};
/// let dev = Device::Cpu;
/// let (q, k, v) = (Tensor::zeros((2, 10, 512), DType::F32, &dev)?, Tensor::zeros((2, 7, 512), DType::F32, &dev)?, Tensor::zeros((2, 7, 512), DType::F32, &dev)?);
/// let vb = unsafe { candle_nn::VarBuilder::from_mmaped_safetensors(&["mha.safetensors"], DType::F32, &dev)? };
/// let cfg = MultiheadAttentionConfig { batch_first: true, ..MultiheadAttentionConfig::new(512, 8) };
/// let mha = MultiheadAttention::new(&cfg, vb)?; // in_proj_weight, out_proj.weight, … as saved
/// let (out, weights) = mha.forward_with(&q, &k, &v, &MhaArgs::default())?; // == mha(q, k, v)
/// assert_eq!((out.dims(), weights.map(|w| w.dims().to_vec())), (&[2, 10, 512][..], Some(vec![2, 10, 7])));
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
        // `in_proj_weight` is `(3E, E)`; the separate weights are `(E, kdim)` and `(E, vdim)`.
        if e.checked_mul(3)
            .and_then(|r| r.checked_mul(e.max(kdim).max(vdim)))
            .is_none()
        {
            candle::bail!(
                "MultiheadAttention: embed_dim {e}, kdim {kdim} and vdim {vdim} overflow the weight sizes"
            )
        }
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
            // (N·H, L, S), or (H, L, S) unbatched; N·H in full, as empty inputs allow any N.
            let (batch, heads_dim) = if unbatched {
                (1, h.to_string())
            } else {
                (n, format!("{n}·{h}"))
            };
            let am4 = match am.dims() {
                &[ml, ms] if ml == l && ms == s => am.reshape((1, 1, l, s))?,
                &[nh, ml, ms] if batch.checked_mul(h) == Some(nh) && ml == l && ms == s => {
                    am.reshape((batch, h, l, s))?
                }
                d => candle::bail!(
                    "MultiheadAttention: attn_mask must have shape ({l}, {s}) or ({heads_dim}, {l}, {s}), got {d:?}"
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

        let dt = query.dtype();
        if n == 0 || l == 0 {
            // No query: the output and the weights are empty. Nothing below runs, since
            // candle's CPU copy panics on the views at an offset into an empty projection
            // that the heads and `add_zero_attn` would make.
            let o = self.to_query_layout(Tensor::zeros((n, l, e), dt, query.device())?, unbatched)?;
            let w = match args.need_weights {
                false => None,
                true => {
                    let keys = s + extra_keys;
                    let shape = match (args.average_attn_weights, unbatched) {
                        (true, true) => vec![l, keys],
                        (true, false) => vec![n, l, keys],
                        (false, true) => vec![h, l, keys],
                        (false, false) => vec![n, h, l, keys],
                    };
                    Some(Tensor::zeros(shape, dt, query.device())?)
                }
            };
            return Ok((o, w));
        }

        // Projections, computed in the accumulation dtype and rounded to the query's dtype,
        // as PyTorch's `nn.Linear` layers return them: q, k, v and the attention output
        // of an f16/bf16 layer are f16/bf16.
        let cd = compute_dtype(dt);
        let proj = |p: &Proj, x: &Tensor| p.forward_to(x, dt);
        let heads = |t: &Tensor| -> Result<Tensor> {
            let (n, len, _) = t.dims3()?;
            t.reshape((n, len, h, hd))?.transpose(1, 2)
        };
        let fused = match &self.qkv {
            Some(p) if self.bias_k.is_none() && query.id() == key.id() && key.id() == value.id() => Some(p),
            _ => None,
        };
        if let Some(qkv) = fused {
            if self.per_batch_applies(qkv, &qn, args) {
                let o = cast::to_dtype(&self.per_batch(qkv, &qn, &mask, args)?, dt)?;
                return Ok((self.to_query_layout(o, unbatched)?, None));
            }
        }
        let (q, mut k, mut v) = if let Some(qkv) = fused {
            // Self-attention: one product with the whole `in_proj_weight`. Its output
            // (N, L, 3E) is viewed as (N, L, 3, H, hd), and q, k and v are strided views
            // (N, H, L, hd) of it, read in place by the kernel.
            let y = proj(qkv, &qn)?.reshape((n, l, 3, h, hd))?;
            let part = |i: usize| y.i((.., .., i))?.transpose(1, 2);
            (part(0)?, part(1)?, part(2)?)
        } else {
            let q = proj(&self.q, &qn)?;
            let mut k = proj(&self.k, &kn)?;
            let mut v = proj(&self.v, &vn)?;
            if let (Some(bk), Some(bv)) = (&self.bias_k, &self.bias_v) {
                k = Tensor::cat(&[&k, &bk.to_dtype(dt)?.broadcast_as((n, 1, e))?], 1)?;
                v = Tensor::cat(&[&v, &bv.to_dtype(dt)?.broadcast_as((n, 1, e))?], 1)?;
            }
            (heads(&q)?, heads(&k)?, heads(&v)?)
        };
        if cfg.add_zero_attn {
            k = k.pad_with_zeros(2, 0, 1)?;
            v = v.pad_with_zeros(2, 0, 1)?;
        }

        // `is_causal` stands for PyTorch's causal `attn_mask` over the S given keys, which
        // PyTorch pads with visible columns for the appended keys (`bias_k`, the zero
        // key). A causal rule over all S + extra keys would hide those from every query
        // row but the last ones, so with appended keys the rule is a mask of its own.
        if args.is_causal && extra_keys > 0 {
            let rule = CausalRule {
                offset: 0,
                window: None,
            };
            let causal = mask::causal_additive(rule, l, s, cd, query.device())?
                .pad_with_zeros(D::Minus1, 0, extra_keys)?
                .reshape((1, 1, l, s + extra_keys))?;
            mask = mask.and(&AttnMask::additive(&causal)?);
        }
        let opts = SdpaOptions {
            mask: if mask.is_empty() { None } else { Some(mask) },
            is_causal: args.is_causal && extra_keys == 0,
            need_weights: args.need_weights,
            backend: args.backend,
            ..SdpaOptions::default()
        };
        // The fused kernel writes its output as (N, L, H, hd) memory, so the transpose and
        // reshape below copy nothing.
        let att = attention(&q, &k, &v, &opts, true)?;
        // (N, H, L, hd) → (N, L, E) → out_proj.
        let o = att.output.transpose(1, 2)?.reshape((n, l, e))?;
        let o = proj(&self.out, &o)?;
        let o = self.to_query_layout(o, unbatched)?;
        let w = match att.weights {
            None => None,
            Some(w) => {
                let w = if args.average_attn_weights {
                    empty::mean(&w, 1)?
                } else {
                    w
                };
                let w = cast::to_dtype(&w, dt)?;
                Some(if unbatched { w.squeeze(0)? } else { w })
            }
        };
        Ok((o, w))
    }
}

impl MultiheadAttention {
    /// `(N, L, E)` → the query's layout: `(L, E)` unbatched, `(N, L, E)` batch-first,
    /// else `(L, N, E)`.
    fn to_query_layout(&self, o: Tensor, unbatched: bool) -> Result<Tensor> {
        if unbatched {
            o.squeeze(0)
        } else if self.cfg.batch_first {
            Ok(o)
        } else {
            o.transpose(0, 1)?.contiguous()
        }
    }

    /// Whether [`MultiheadAttention::per_batch`] takes this self-attention call: no
    /// weights, no appended keys, both projections on this crate's CPU kernel, and enough
    /// batch rows of a size that suits it (several per thread, evenly split or at least
    /// four per thread; `L ≥ 64`, so that each weight pass serves enough rows; q, k, v of
    /// one batch row within 4 MiB, so that they fit a core's L2).
    fn per_batch_applies(&self, qkv: &Proj, qn: &Tensor, args: &MhaArgs) -> bool {
        let Ok((n, l, e)) = qn.dims3() else {
            return false;
        };
        let nt = crate::kernels::cpu::par::threads();
        !args.need_weights
            && !self.cfg.add_zero_attn
            && args.backend != Backend::Reference
            && nt > 1
            && n >= 2 * nt
            && (n % nt == 0 || n >= 4 * nt)
            && l >= 64
            && l * 3 * e <= 1 << 20
            && qkv.on_kernel(qn)
            && self.out.on_kernel(qn)
    }

    /// Self-attention one batch row at a time: in parallel over the rows, each row's input
    /// projection, attention and output projection run on one thread
    /// (`par::inline`), so its q, k, v and the attention output are still in that core's
    /// L2 when the next step reads them. `qn`: `(N, L, E)`, `mask` for scores
    /// `(N, H, L, S)`; returns `(N, L, E)`.
    fn per_batch(&self, qkv: &Proj, qn: &Tensor, mask: &AttnMask, args: &MhaArgs) -> Result<Tensor> {
        use rayon::prelude::*;
        let (n, l, e) = qn.dims3()?;
        let (h, hd) = (self.cfg.num_heads, self.head_dim);
        // Each batch row's output projection writes its rows of the result in place.
        let mut out: Vec<f32> = Vec::with_capacity(n * l * e);
        out.spare_capacity_mut()[..n * l * e]
            .par_chunks_mut(l * e)
            .enumerate()
            .try_for_each(|(b, dst)| {
                crate::kernels::cpu::par::inline(|| {
                    let row_mask = mask.batch_row(b, n)?;
                    let opts = SdpaOptions {
                        mask: (!row_mask.is_empty()).then_some(row_mask),
                        is_causal: args.is_causal,
                        backend: args.backend,
                        ..SdpaOptions::default()
                    };
                    let y = qkv.forward(&qn.narrow(0, b, 1)?)?.reshape((1, l, 3, h, hd))?;
                    let part = |i: usize| y.i((.., .., i))?.transpose(1, 2);
                    let att = attention(&part(0)?, &part(1)?, &part(2)?, &opts, true)?;
                    let o = att.output.transpose(1, 2)?.reshape((l, e))?;
                    self.out.forward_into(&o, dst)
                })
            })?;
        // SAFETY: every chunk's `forward_into` returned Ok, so all `n · l · e` elements are
        // written.
        unsafe { out.set_len(n * l * e) };
        Tensor::from_vec(out, (n, l, e), qn.device())
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::max_diff;
    use candle::{DType, Device};
    use std::collections::HashMap;

    fn layer(e: usize, h: usize, batch_first: bool) -> Result<MultiheadAttention> {
        let dev = Device::Cpu;
        let map: HashMap<String, Tensor> = [
            (
                "in_proj_weight",
                (Tensor::randn(0f32, 1., (3 * e, e), &dev)? * 0.2)?,
            ),
            ("in_proj_bias", Tensor::randn(0f32, 1., 3 * e, &dev)?),
            ("out_proj.weight", (Tensor::randn(0f32, 1., (e, e), &dev)? * 0.2)?),
            ("out_proj.bias", Tensor::randn(0f32, 1., e, &dev)?),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let cfg = MultiheadAttentionConfig {
            batch_first,
            ..MultiheadAttentionConfig::new(e, h)
        };
        MultiheadAttention::new(&cfg, VarBuilder::from_tensors(map, DType::F32, &dev))
    }

    /// Self-attention one batch row per thread (`per_batch`) equals the whole-batch path
    /// (which distinct key and value tensors take) and the reference SDPA, batch-first or
    /// not, causal or not, without a mask and with each kind of mask split by batch row: a
    /// bool key-padding mask (one row fully padded), a float `(L, S)` mask and a bool
    /// `(N·H, L, S)` mask. On an AVX-512 or AVX2 machine with several threads the path is
    /// taken.
    #[test]
    fn per_batch_rows_equal_the_whole_batch() -> Result<()> {
        let (e, h, n, l) = (64, 4, 6, 70);
        let dev = Device::Cpu;
        let pad: Vec<u8> = (0..n * l)
            .map(|x| u8::from(x / l == 2 || x % l >= l - 3 * (x / l)))
            .collect();
        let kpm = Tensor::from_vec(pad, (n, l), &dev)?;
        let float_mask = Tensor::randn(0f32, 1., (l, l), &dev)?;
        let bool_mask = Tensor::rand(0f32, 1., (n * h, l, l), &dev)?
            .ge(0.8)?
            .to_dtype(DType::U8)?;
        for batch_first in [true, false] {
            let mha = layer(e, h, batch_first)?;
            let shape = if batch_first { (n, l, e) } else { (l, n, e) };
            let x = Tensor::randn(0f32, 1., shape, &dev)?;
            let (k, v) = (x.copy()?, x.copy()?);
            let masks: [(Option<&Tensor>, Option<&Tensor>); 4] = [
                (None, None),
                (Some(&kpm), None),
                (None, Some(&float_mask)),
                (Some(&kpm), Some(&bool_mask)),
            ];
            for is_causal in [false, true] {
                for (m, &(key_padding_mask, attn_mask)) in masks.iter().enumerate() {
                    let args = MhaArgs {
                        need_weights: false,
                        is_causal,
                        key_padding_mask,
                        attn_mask,
                        ..MhaArgs::default()
                    };
                    let qn = if batch_first {
                        x.clone()
                    } else {
                        x.transpose(0, 1)?
                    };
                    let qkv = mha.qkv.as_ref().expect("self-attention has one input projection");
                    let kernel = matches!(crate::kernels::cpu::isa(), "avx512" | "avx2+fma")
                        && crate::kernels::cpu::par::threads() > 1;
                    assert_eq!(mha.per_batch_applies(qkv, &qn, &args), kernel);
                    let (rows, _) = mha.forward_with(&x, &x, &x, &args)?;
                    let (whole, _) = mha.forward_with(&x, &k, &v, &args)?;
                    let reference = MhaArgs {
                        backend: Backend::Reference,
                        ..args
                    };
                    let (oracle, _) = mha.forward_with(&x, &k, &v, &reference)?;
                    assert_eq!(rows.dims(), x.dims());
                    // The same kernels on the same rows (bit-identical here), and the
                    // reference SDPA within the f32 tolerance.
                    for (other, what, tol) in [(&whole, "whole batch", 1e-6), (&oracle, "reference", 2e-5)] {
                        let d = max_diff(&rows, other)?;
                        assert!(
                            d < tol,
                            "{what}, batch_first {batch_first}, causal {is_causal}, masks {m}: {d}"
                        );
                    }
                }
            }
        }
        Ok(())
    }
}
