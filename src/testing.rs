//! Helpers of the unit tests.
use candle::{DType, Result, Tensor};

/// `max|a − b|` in f32. Equal elements (two equal infinities, or two NaNs) differ by 0,
/// and a NaN on one side only counts as an infinite difference: candle's `max` skips
/// NaN, so a reduction in candle ops would miss it.
pub(crate) fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    let a = a.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let b = b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    assert_eq!(a.len(), b.len(), "sizes differ");
    Ok(a.iter().zip(&b).fold(0f32, |m, (&x, &y)| {
        let d = if x == y || (x.is_nan() && y.is_nan()) {
            0.0
        } else {
            (x - y).abs()
        };
        if d.is_nan() {
            f32::INFINITY
        } else {
            m.max(d)
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle::Device;

    #[test]
    fn a_nan_on_one_side_is_an_infinite_difference() -> Result<()> {
        let t = |v: &[f32]| Tensor::new(v, &Device::Cpu);
        let inf = f32::INFINITY;
        assert_eq!(max_diff(&t(&[1.0, f32::NAN, 3.0])?, &t(&[1.0, 2.0, 3.0])?)?, inf);
        assert_eq!(max_diff(&t(&[1.0, -inf, 2.5])?, &t(&[1.0, -inf, 3.0])?)?, 0.5);
        assert_eq!(max_diff(&t(&[f32::NAN])?, &t(&[f32::NAN])?)?, 0.0);
        Ok(())
    }
}
