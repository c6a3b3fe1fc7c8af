//! Backend-specific fused kernels behind the SDPA dispatcher.
use candle::{DType, Device, Result, Tensor};

use crate::mask::AttnMask;
use crate::sdpa::Dims;

/// Whether a fused kernel handles this device and dtype.
pub(crate) fn fused_supports(_device: &Device, _dtype: DType, _dims: &Dims) -> bool {
    false
}

/// Runs the fused kernel; only called when [`fused_supports`] said yes.
pub(crate) fn dispatch_fused(
    _q: &Tensor,
    _k: &Tensor,
    _v: &Tensor,
    _explicit: Option<&Tensor>,
    _mask: &AttnMask,
    _dims: &Dims,
    _scale: f64,
) -> Result<crate::sdpa::SdpaOutput> {
    candle::bail!("no fused kernel is compiled in")
}
