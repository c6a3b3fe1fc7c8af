//! Dtype casts: [`Tensor::to_dtype`], with the casts between f32 and f16/bf16 of
//! contiguous CPU tensors on the CPU kernels' threads (the same bits; see
//! [`crate::kernels::cpu::cast`]), and empty tensors cast on every backend (see
//! [`crate::empty`]).
use candle::{DType, Result, Tensor};

/// `t.to_dtype(dtype)`, also for an empty `t` on CUDA.
pub(crate) fn to_dtype(t: &Tensor, dtype: DType) -> Result<Tensor> {
    if t.dtype() == dtype {
        // What candle's `to_dtype` returns too; the layers' f32 projections come here.
        Ok(t.clone())
    } else if t.elem_count() == 0 {
        Tensor::zeros(t.shape(), dtype, t.device())
    } else if let Some(cast) = crate::kernels::cpu::cast::to_dtype(t, dtype) {
        cast
    } else {
        t.to_dtype(dtype)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle::Device;

    #[test]
    fn casts_match_candles() -> Result<()> {
        let dev = Device::Cpu;
        let e = Tensor::zeros((2, 0, 3), DType::BF16, &dev)?;
        for dt in [DType::F32, DType::F16, DType::BF16] {
            let (a, b) = (to_dtype(&e, dt)?, e.to_dtype(dt)?);
            assert_eq!((a.dims(), a.dtype()), (b.dims(), b.dtype()));
        }
        let t = Tensor::new(&[[1f32, 2.], [3., 5.]], &dev)?;
        assert_eq!(to_dtype(&t, DType::F64)?.to_vec2::<f64>()?, [[1., 2.], [3., 5.]]);
        let half = to_dtype(&t.t()?, DType::F16)?;
        assert_eq!(half.to_dtype(DType::F32)?.to_vec2::<f32>()?, [[1., 3.], [2., 5.]]);
        Ok(())
    }
}
