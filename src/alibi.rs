//! ALiBi: a per-head linear bias on key positions (Press et al.; BLOOM, MPT).
use candle::{DType, Device, Result, Tensor};

/// The per-head slopes, by BLOOM's rule: the geometric series for the largest power of
/// two `≤ num_heads`, then every other term of the series for twice that many heads.
pub fn alibi_slopes(num_heads: usize) -> Vec<f64> {
    if num_heads == 0 {
        return Vec::new();
    }
    let closest = 1usize << (usize::BITS - 1 - num_heads.leading_zeros());
    let base = 2f64.powf(-(2f64.powf(-((closest as f64).log2() - 3.0))));
    let mut slopes: Vec<f64> = (1..=closest).map(|p| base.powi(p as i32)).collect();
    if closest != num_heads {
        let extra_base = 2f64.powf(-(2f64.powf(-((2.0 * closest as f64).log2() - 3.0))));
        let remaining = closest.min(num_heads - closest);
        slopes.extend((0..remaining).map(|i| extra_base.powi((2 * i + 1) as i32)));
    }
    slopes
}

/// The additive bias `slope_h · position_j`, shape `(1, H, 1, S)`, in `dtype`.
pub fn alibi_bias(slopes: &[f64], key_positions: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
    if !dtype.is_float() {
        candle::bail!("alibi: the bias must be a float dtype, got {dtype:?}")
    }
    let (h, s) = (slopes.len(), key_positions.len());
    let mut data = Vec::with_capacity(h * s);
    for &m in slopes {
        data.extend(key_positions.iter().map(|&p| m * p as f64));
    }
    Tensor::from_vec(data, (1, h, 1, s), device)?.to_dtype(dtype)
}
