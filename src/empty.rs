//! Tensors with a zero-sized dimension, on every backend.
//!
//! PyTorch and candle's CPU backend take empty tensors in every op. candle 0.11's CUDA
//! backend does not: its cast, `where_cond`, fill and `index_select` kernels fail to launch
//! with no element (`CUDA_ERROR_INVALID_VALUE`), and its reductions divide by zero (a
//! panic). This was seen on an NVIDIA H200 on 2026-12-04. Zeros, views, copies, `cat` and
//! matmuls of empty tensors do work there. So the crate sends empty tensors through these
//! helpers, and its casts through [`crate::cast::to_dtype`], which build the (still empty)
//! result with [`Tensor::zeros`] instead.
use candle::{Result, Tensor};

/// `t.mean(dim)`, also when the result is empty on CUDA (when any dim but `dim` is 0).
/// The mean over an empty `dim` of a non-empty result is NaN, as in PyTorch.
pub(crate) fn mean(t: &Tensor, dim: usize) -> Result<Tensor> {
    let mut dims = t.dims().to_vec();
    if dim >= dims.len() {
        candle::bail!("mean over dim {dim} of a tensor of shape {dims:?}")
    }
    dims.remove(dim);
    if dims.iter().product::<usize>() == 0 {
        Tensor::zeros(dims, t.dtype(), t.device())
    } else {
        t.mean(dim)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle::{DType, Device};

    #[test]
    fn empty_results_match_candles_cpu_ops() -> Result<()> {
        let dev = Device::Cpu;
        let e = Tensor::zeros((2, 0, 3), DType::BF16, &dev)?;
        for dim in 0..3 {
            let (a, b) = (mean(&e, dim)?, e.mean(dim)?);
            assert_eq!((a.dims(), a.dtype()), (b.dims(), b.dtype()), "dim {dim}");
        }
        // Non-empty tensors take candle's own ops.
        let t = Tensor::new(&[[1f32, 2.], [3., 5.]], &dev)?;
        assert_eq!(mean(&t, 1)?.to_vec1::<f32>()?, [1.5, 4.0]);
        assert!(mean(&t, 2).is_err());
        Ok(())
    }
}
