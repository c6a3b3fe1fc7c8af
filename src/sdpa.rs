//! Functional scaled dot-product attention with the semantics of PyTorch's
//! `torch.nn.functional.scaled_dot_product_attention` (torch >= 2.5).
//!
//! ```text
//! out = softmax(q · kᵀ · scale + mask) · v
//! ```
//!
//! Shapes: `q (…, Hq, L, E)`, `k (…, Hkv, S, E)`, `v (…, Hkv, S, Ev)` → `(…, Hq, L, Ev)`,
//! with any number of leading batch dims (none included). Inputs of rank 2,
//! `(L, E)`, are a single head.
//!
//! Differences from a hand-written `softmax(q kᵀ) v`:
//! - rows whose keys are all masked give 0 (PyTorch's "safe softmax"), never NaN;
//! - f16/bf16 inputs compute scores, softmax and the weighted sum in f32, and
//!   return the input dtype;
//! - `is_causal` is aligned top-left, like PyTorch; [`AttnMask::causal_bottom_right`]
//!   gives the alignment a KV cache needs.
use candle::{DType, Result, Tensor, D};

use crate::cast;
use crate::dims::{check_dims, Dims};
use crate::mask::{add_masks, AttnMask};

/// Which implementation computes the attention.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Backend {
    /// The fastest path that supports the call; the reference path otherwise, which
    /// includes every call whose inputs or mask record gradients (built from a `Var`):
    /// the fused kernel has no backward pass.
    #[default]
    Auto,
    /// The unfused matmul → softmax → matmul path in candle ops: the oracle,
    /// available on every device.
    Reference,
    /// The fused CPU kernel ([`crate::kernels::cpu`]); an error if the call is
    /// not one it supports (attention weights, or a dtype or device without a kernel) or
    /// records gradients.
    Fused,
}

/// Options of [`scaled_dot_product_attention`], named after PyTorch's arguments.
#[derive(Clone, Debug, Default)]
pub struct SdpaOptions {
    /// `attn_mask`, typed so that its polarity is explicit. Broadcasts to `(…, Hq, L, S)`.
    pub mask: Option<AttnMask>,
    /// `is_causal`: top-left aligned causal mask, `tril(ones(L, S))`. Combines with `mask`
    /// (PyTorch rejects both at once; here both apply).
    pub is_causal: bool,
    /// `scale`: multiplier of `q · kᵀ`; default `1 / sqrt(E)`.
    pub scale: Option<f64>,
    /// `enable_gqa`: query head `h` uses key/value head `h / (Hq / Hkv)`.
    pub enable_gqa: bool,
    /// Also return the attention weights `(…, Hq, L, S)` (forces the reference path).
    pub need_weights: bool,
    /// Which implementation to use.
    pub backend: Backend,
    /// Logit soft-capping (Gemma 2): `scores = cap · tanh(scores / cap)`, before the mask;
    /// `cap` must be positive and finite. The fused CPU kernel caps each block of scores.
    pub softcap: Option<f64>,
    /// Learned attention sinks (gpt-oss), one logit per query head `(Hq)`: an extra key
    /// with that logit and a zero value joins every softmax row. The fused CPU kernel
    /// adds it to each row's softmax sum after the last key block (and after the merge
    /// of a split key range).
    pub sinks: Option<Tensor>,
}

impl SdpaOptions {
    /// Options with every PyTorch default.
    pub fn new() -> Self {
        Self::default()
    }
    /// Sets `attn_mask`.
    pub fn with_mask(mut self, mask: AttnMask) -> Self {
        self.mask = Some(mask);
        self
    }
    /// Sets `is_causal`.
    pub fn with_causal(mut self, is_causal: bool) -> Self {
        self.is_causal = is_causal;
        self
    }
    /// Sets `scale`.
    pub fn with_scale(mut self, scale: f64) -> Self {
        self.scale = Some(scale);
        self
    }
    /// Sets `enable_gqa`.
    pub fn with_gqa(mut self, enable_gqa: bool) -> Self {
        self.enable_gqa = enable_gqa;
        self
    }
    /// Asks for the attention weights too.
    pub fn with_weights(mut self, need_weights: bool) -> Self {
        self.need_weights = need_weights;
        self
    }
    /// Picks the implementation.
    pub fn with_backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }
    /// Sets the logit soft-cap.
    pub fn with_softcap(mut self, cap: f64) -> Self {
        self.softcap = Some(cap);
        self
    }
    /// Sets per-head attention sinks `(Hq)`.
    pub fn with_sinks(mut self, sinks: Tensor) -> Self {
        self.sinks = Some(sinks);
        self
    }
}

/// Result of [`scaled_dot_product_attention`].
#[derive(Clone, Debug)]
pub struct SdpaOutput {
    /// `(…, Hq, L, Ev)`, in the input dtype.
    pub output: Tensor,
    /// `(…, Hq, L, S)`, in the input dtype, when asked for.
    pub weights: Option<Tensor>,
}

/// The dtype in which scores and softmax are computed: f32 for f16/bf16.
pub(crate) fn compute_dtype(dt: DType) -> DType {
    match dt {
        DType::F64 => DType::F64,
        _ => DType::F32,
    }
}

/// Scaled dot-product attention, argument for argument PyTorch's
/// `F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p=0, is_causal, scale, enable_gqa)`.
///
/// - `q`: `(…, Hq, L, E)`; `k`: `(…, Hkv, S, E)`; `v`: `(…, Hkv, S, Ev)`.
/// - Returns `(…, Hq, L, Ev)` in the input dtype, and the weights `(…, Hq, L, S)` when
///   [`SdpaOptions::need_weights`] is set.
///
/// ```
/// use candle_core::{Device, Tensor, DType};
/// use candle_attention::{scaled_dot_product_attention, SdpaOptions};
/// let dev = Device::Cpu;
/// let q = Tensor::randn(0f32, 1., (2, 4, 5, 8), &dev)?;
/// let k = Tensor::randn(0f32, 1., (2, 4, 7, 8), &dev)?;
/// let v = Tensor::randn(0f32, 1., (2, 4, 7, 3), &dev)?;
/// let out = scaled_dot_product_attention(&q, &k, &v, &SdpaOptions::new().with_causal(true))?;
/// assert_eq!(out.output.dims(), &[2, 4, 5, 3]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn scaled_dot_product_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &SdpaOptions,
) -> Result<SdpaOutput> {
    attention(q, k, v, opts, false)
}

/// [`scaled_dot_product_attention`]; with `heads_inner`, the fused path returns a rank-4
/// output `(N, Hq, L, Ev)` as a view of `(N, L, Hq, Ev)` memory, so that a caller's
/// `transpose(1, 2)` and merge of the heads copies nothing (other paths return it
/// contiguous, as always).
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &SdpaOptions,
    heads_inner: bool,
) -> Result<SdpaOutput> {
    let dims = check_dims(q, k, v, opts.enable_gqa)?;
    let mut mask = opts.mask.clone().unwrap_or_default();
    if opts.is_causal {
        mask = mask.and(&AttnMask::causal());
    }
    let scale = opts.scale.unwrap_or(1.0 / (dims.e as f64).sqrt());
    // Validate the mask against the score shape on every path.
    let score_shape = dims.score_shape();
    let explicit = mask.explicit_additive(&score_shape, compute_dtype(q.dtype()))?;
    if dims.s == 0 || dims.l == 0 || dims.n == 0 || dims.hq == 0 {
        // No keys: every row is fully masked and gives 0 (PyTorch: an empty matmul).
        let output = Tensor::zeros(dims.out_shape(dims.ev), q.dtype(), q.device())?;
        let weights = match opts.need_weights {
            true => Some(Tensor::zeros(score_shape, q.dtype(), q.device())?),
            false => None,
        };
        return Ok(SdpaOutput { output, weights });
    }
    if let Some(cap) = opts.softcap {
        if !(cap > 0.0 && cap.is_finite()) {
            candle::bail!("sdpa: softcap must be positive and finite, got {cap}")
        }
        // f16/bf16/f32 scores are capped in f32, where the cap must stay positive and finite.
        let in_f32 = cap as f32;
        if compute_dtype(q.dtype()) == DType::F32 && !(in_f32 > 0.0 && in_f32.is_finite()) {
            candle::bail!(
                "sdpa: softcap {cap:e} is not a positive finite f32, the dtype that caps {:?} scores",
                q.dtype()
            )
        }
    }
    if let Some(sinks) = &opts.sinks {
        if sinks.dims() != [dims.hq] {
            candle::bail!(
                "sdpa: sinks must have shape ({},) (one per query head), got {:?}",
                dims.hq,
                sinks.dims()
            )
        }
    }
    let tracked = [q, k, v].iter().any(|t| t.track_op()) || explicit.as_ref().is_some_and(|m| m.track_op());
    match select_backend(q, &dims, opts, tracked)? {
        Path::Reference => {
            let causal = mask.causal_additive(&score_shape, compute_dtype(q.dtype()), q.device())?;
            let full = add_masks(explicit, causal)?;
            reference(q, k, v, full.as_ref(), &dims, scale, opts)
        }
        Path::Fused => Ok(SdpaOutput {
            output: crate::kernels::dispatch_fused(
                q,
                k,
                v,
                explicit.as_ref(),
                &mask,
                &dims,
                scale,
                heads_inner,
                (opts.sinks.as_ref(), opts.softcap),
            )?,
            weights: None,
        }),
    }
}

/// [`scaled_dot_product_attention`] without the weights: `(…, Hq, L, Ev)`.
pub fn sdpa(q: &Tensor, k: &Tensor, v: &Tensor, opts: &SdpaOptions) -> Result<Tensor> {
    let opts = SdpaOptions {
        need_weights: false,
        ..opts.clone()
    };
    Ok(scaled_dot_product_attention(q, k, v, &opts)?.output)
}

enum Path {
    Reference,
    Fused,
}

/// `tracked`: whether an input or the explicit mask records gradients (built from a
/// `Var`); the fused kernel has no backward pass, so `Auto` takes the reference path then.
fn select_backend(q: &Tensor, dims: &Dims, opts: &SdpaOptions, tracked: bool) -> Result<Path> {
    match opts.backend {
        Backend::Reference => Ok(Path::Reference),
        Backend::Auto => Ok(
            if !opts.need_weights && !tracked && crate::kernels::fused_supports(q.device(), q.dtype(), dims) {
                Path::Fused
            } else {
                Path::Reference
            },
        ),
        Backend::Fused => {
            if opts.need_weights {
                candle::bail!(
                    "sdpa: the fused backend does not return attention weights; use Backend::Reference"
                )
            }
            if tracked {
                candle::bail!(
                    "sdpa: the fused backend has no backward pass, but q, k, v or the mask record \
                     gradients (they come from a Var); use Backend::Auto or Backend::Reference"
                )
            }
            if !crate::kernels::fused_supports(q.device(), q.dtype(), dims) {
                candle::bail!(
                    "sdpa: no fused kernel for dtype {:?} on {:?} (the fused CPU kernel takes f32, f16 and bf16 on CPU)",
                    q.dtype(),
                    q.device().location()
                )
            }
            Ok(Path::Fused)
        }
    }
}

/// Softmax over the last dim where a row of `-inf` gives zeros instead of NaN.
pub(crate) fn safe_softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let m = x.max_keepdim(D::Minus1)?;
    let dead = m.eq(f64::NEG_INFINITY)?;
    let m = dead.where_cond(&m.zeros_like()?, &m)?;
    let e = x.broadcast_sub(&m)?.exp()?;
    let sum = e.sum_keepdim(D::Minus1)?;
    let sum = sum.eq(0f64)?.where_cond(&sum.ones_like()?, &sum)?;
    e.broadcast_div(&sum)
}

/// The unfused oracle: matmul → masked safe softmax → matmul, in candle ops.
fn reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    dims: &Dims,
    scale: f64,
    opts: &SdpaOptions,
) -> Result<SdpaOutput> {
    let (n, hq, hkv, l, s, e, ev) = (dims.n, dims.hq, dims.hkv, dims.l, dims.s, dims.e, dims.ev);
    let dt = q.dtype();
    let cd = compute_dtype(dt);
    let g = hq / hkv.max(1);
    // Query heads of one GQA group are adjacent: (N, Hkv, g·L, E) shares each K/V head.
    let q = cast::to_dtype(q, cd)?.reshape((n, hkv, g * l, e))?;
    let k = cast::to_dtype(k, cd)?.reshape((n, hkv, s, e))?;
    let v = cast::to_dtype(v, cd)?.reshape((n, hkv, s, ev))?;
    // With E = 0 every score is the empty sum 0, whatever the scale (the default
    // 1/√0 is infinite): PyTorch, which scales q and k by √scale before their product,
    // then returns the mean of V, and so does the fused kernel.
    let scale = if e == 0 { 1.0 } else { scale };
    let mut scores = q.matmul(&k.t()?)?.affine(scale, 0.0)?.reshape((n, hq, l, s))?;
    if let Some(cap) = opts.softcap {
        scores = ((scores / cap)?.tanh()? * cap)?;
    }
    let score_shape = dims.score_shape();
    let scores = match mask {
        None => scores,
        Some(m) => {
            let m = m.broadcast_as(score_shape.as_slice())?.reshape((n, hq, l, s))?;
            (scores + m)?
        }
    };
    let p = match &opts.sinks {
        None => safe_softmax_last_dim(&scores)?,
        Some(sinks) => {
            let sink = sinks
                .to_dtype(cd)?
                .reshape((1, hq, 1, 1))?
                .broadcast_as((n, hq, l, 1))?;
            let p = safe_softmax_last_dim(&Tensor::cat(&[&scores, &sink], 3)?)?;
            p.narrow(3, 0, s)?
        }
    };
    let out = p.contiguous()?.reshape((n, hkv, g * l, s))?.matmul(&v)?;
    let output = cast::to_dtype(&out.reshape(dims.out_shape(ev))?, dt)?;
    let weights = if opts.need_weights {
        Some(cast::to_dtype(&p.reshape(score_shape)?, dt)?)
    } else {
        None
    };
    Ok(SdpaOutput { output, weights })
}
