//! Backend-specific fused kernels behind the SDPA dispatcher.
//!
//! Only the CPU has one so far ([`cpu`]). Every other device, f64 and attention weights
//! go through the reference path in candle ops.
use candle::{DType, Device, Result, Tensor};

use crate::dims::Dims;
use crate::mask::AttnMask;

pub mod cpu;

/// Whether the fused kernel handles this device and dtype.
pub(crate) fn fused_supports(device: &Device, dtype: DType, _dims: &Dims) -> bool {
    device.is_cpu() && matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
}

/// Runs the fused CPU kernel on `(…, Hq, L, E)` inputs; `explicit` is the explicit part of
/// the mask as an additive f32 tensor aligned to the score rank, `mask` supplies the causal
/// rule, applied by loop bounds. With `heads_inner` and rank-4 inputs, the output is a view
/// of `(N, L, Hq, Ev)` memory (see [`cpu::sdpa_with`]). `sinks`: one logit per query
/// head `(Hq)`; `softcap`: the cap of the scaled scores. Returns the output `(…, Hq, L, Ev)`
/// (the kernel computes no attention weights).
#[allow(clippy::too_many_arguments)]
pub(crate) fn dispatch_fused(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    explicit: Option<&Tensor>,
    mask: &AttnMask,
    dims: &Dims,
    scale: f64,
    heads_inner: bool,
    (sinks, softcap): (Option<&Tensor>, Option<f64>),
) -> Result<Tensor> {
    let (n, hq, hkv, l, s, e, ev) = (dims.n, dims.hq, dims.hkv, dims.l, dims.s, dims.e, dims.ev);
    // Views with the batch dims collapsed; the kernel reads any strides.
    let q4 = as_4d(q, (n, hq, l, e))?;
    let k4 = as_4d(k, (n, hkv, s, e))?;
    let v4 = as_4d(v, (n, hkv, s, ev))?;
    let m4 = match explicit {
        None => None,
        Some(m) => Some(mask_4d(&m.to_dtype(DType::F32)?, dims)?),
    };
    let causal = mask.causal_rule(l, s).map(|r| cpu::Causal {
        offset: r.offset,
        window: r.window,
    });
    let sinks = match sinks {
        Some(t) => Some(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?),
        None => None,
    };
    let shape = dims.out_shape(ev);
    // Already the output shape: a `reshape` would copy the `heads_inner` view.
    let heads_inner = heads_inner && shape == [n, hq, l, ev];
    let extras = cpu::Extras {
        sinks: sinks.as_deref(),
        softcap: softcap.map(|c| c as f32),
    };
    let output = cpu::sdpa_with(
        &q4,
        &k4,
        &v4,
        m4.as_ref(),
        causal,
        scale as f32,
        extras,
        heads_inner,
    )?;
    if heads_inner {
        Ok(output)
    } else {
        output.reshape(shape)
    }
}

/// `t` as the rank-4 `dims`, without copying where that can be a view: rank 4 as is, ranks
/// 2 and 3 by adding unit dims. Only more than one leading batch dim is collapsed by
/// `reshape`, which copies a non-contiguous tensor (candle's `reshape` copies any
/// non-contiguous input, even to its own shape, so the common `(B, H, L, D)` view made by
/// `transpose(1, 2)` must not go through it).
fn as_4d(t: &Tensor, dims: (usize, usize, usize, usize)) -> Result<Tensor> {
    let (a, b, c, d) = dims;
    let t = match t.rank() {
        4 => t.clone(),
        3 => t.unsqueeze(0)?,
        2 => t.unsqueeze(0)?.unsqueeze(0)?,
        _ => return t.reshape(dims),
    };
    if t.dims() != [a, b, c, d] {
        candle::bail!("fused SDPA: expected {:?}, got {:?}", [a, b, c, d], t.dims())
    }
    Ok(t)
}

/// An explicit mask aligned to `(…, Hq, L, S)` as `(N, Hq, L, S)` with size-1 dims kept
/// (broadcast), collapsing the leading batch dims without copying when they are all 1 or
/// all full.
fn mask_4d(m: &Tensor, dims: &Dims) -> Result<Tensor> {
    let md = m.dims();
    let r = md.len();
    let (ml, ms) = (md[r - 2], md[r - 1]);
    let mh = if dims.headless { 1 } else { md[r - 3] };
    let lead = &md[..dims.lead.len()];
    if lead.iter().all(|&d| d == 1) {
        m.reshape((1, mh, ml, ms))
    } else if lead == dims.lead.as_slice() {
        m.reshape((dims.n, mh, ml, ms))
    } else {
        // Mixed leading dims: materialise the batch broadcast, keep the rest.
        let mut full = dims.lead.clone();
        full.extend_from_slice(&md[dims.lead.len()..]);
        m.broadcast_as(full)?.contiguous()?.reshape((dims.n, mh, ml, ms))
    }
}
