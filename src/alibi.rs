//! ALiBi: a per-head linear bias on key positions (Press et al.; BLOOM, MPT).
use candle::{DType, Device, Result, Tensor};

/// The per-head slopes `(num_heads)`, by BLOOM's rule: the geometric series for the
/// largest power of two `≤ num_heads`, then every other term of the series for twice
/// that many heads. An error when `num_heads` slopes do not fit in memory.
pub fn alibi_slopes(num_heads: usize) -> Result<Vec<f64>> {
    let mut slopes = Vec::new();
    slopes.try_reserve_exact(num_heads).map_err(|e| {
        candle::Error::Msg(format!(
            "alibi: cannot allocate the slopes of {num_heads} heads: {e}"
        ))
    })?;
    if num_heads == 0 {
        return Ok(slopes);
    }
    // `base^p`; `powi` takes an i32, which a count of heads may pass.
    let pow = |base: f64, p: usize| match i32::try_from(p) {
        Ok(p) => base.powi(p),
        Err(_) => base.powf(p as f64),
    };
    let closest = 1usize << (usize::BITS - 1 - num_heads.leading_zeros());
    let base = 2f64.powf(-(2f64.powf(-((closest as f64).log2() - 3.0))));
    slopes.extend((1..=closest).map(|p| pow(base, p)));
    if closest != num_heads {
        let extra_base = 2f64.powf(-(2f64.powf(-((2.0 * closest as f64).log2() - 3.0))));
        let remaining = closest.min(num_heads - closest);
        slopes.extend((0..remaining).map(|i| pow(extra_base, 2 * i + 1)));
    }
    Ok(slopes)
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
