//! Helpers shared by the integration tests (included with `mod common;`).
#![allow(dead_code)]
use candle_core::{DType, Device, Result, Tensor};

pub fn randn(shape: &[usize]) -> Result<Tensor> {
    Tensor::randn(0f32, 1f32, shape, &Device::Cpu)
}

/// `max |a − b|`, in f64; shapes must match. Equal elements (infinities included) differ
/// by 0, and a NaN on one side only counts as an infinite difference: candle's `max`
/// skips NaN, so a reduction in candle ops would miss it.
pub fn max_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let a = a.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let b = b.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    Ok(a.iter().zip(&b).map(|(&x, &y)| diff(x, y)).fold(0.0, f64::max))
}

/// `|x − y|`: 0 when equal (also two equal infinities, or two NaNs), infinite when the
/// difference is NaN.
pub fn diff(x: f64, y: f64) -> f64 {
    if x == y || (x.is_nan() && y.is_nan()) {
        0.0
    } else {
        let d = (x - y).abs();
        if d.is_nan() {
            f64::INFINITY
        } else {
            d
        }
    }
}

/// Whether every element is exactly 0 (a NaN is not).
pub fn all_zero(t: &Tensor) -> Result<bool> {
    let v = t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    Ok(v.iter().all(|&x| x == 0.0))
}

/// The error message of a result that must be an error.
pub fn err_msg<T: std::fmt::Debug>(r: Result<T>) -> String {
    match r {
        Ok(v) => panic!("expected an error, got Ok({v:?})"),
        Err(e) => e.to_string(),
    }
}

/// The plainest decoder layer: one head of `hidden` features, separate q/k/v/o
/// projections without biases, no rope, norm, window, ALiBi, softcap or sinks. Tests
/// change the fields they need with `..plain_decoder(h)`.
pub fn plain_decoder(hidden: usize) -> candle_attention::decoder::DecoderAttentionConfig {
    use candle_attention::decoder::{DecoderAttentionConfig, QkvLayout};
    DecoderAttentionConfig {
        hidden_size: hidden,
        num_heads: 1,
        num_kv_heads: 1,
        head_dim: hidden,
        layout: QkvLayout::separate(false, false, false, false),
        qk_norm: None,
        rope: None,
        alibi: false,
        softcap: None,
        sinks: false,
        sliding_window: None,
        bidirectional: false,
        scale: 1.0 / (hidden as f64).sqrt(),
        cross_attention: false,
        max_position_embeddings: None,
    }
}

/// Random `(hidden, hidden)` weights for [`plain_decoder`]'s four projections.
pub fn plain_decoder_weights(hidden: usize) -> Result<candle_nn::VarBuilder<'static>> {
    let map = ["q_proj", "k_proj", "v_proj", "o_proj"]
        .iter()
        .map(|n| Ok((format!("{n}.weight"), randn(&[hidden, hidden])?)))
        .collect::<Result<_>>()?;
    Ok(candle_nn::VarBuilder::from_tensors(map, DType::F32, &Device::Cpu))
}
