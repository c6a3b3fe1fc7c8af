//! Helpers shared by the integration tests (included with `mod common;`).
#![allow(dead_code)]
use candle_core::{DType, Device, Result, Tensor};

pub fn randn(shape: &[usize]) -> Result<Tensor> {
    Tensor::randn(0f32, 1f32, shape, &Device::Cpu)
}

/// `max |a − b|`, in f64; shapes must match.
pub fn max_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    (a.to_dtype(DType::F64)? - b.to_dtype(DType::F64)?)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f64>()
}

/// The error message of a result that must be an error.
pub fn err_msg<T: std::fmt::Debug>(r: Result<T>) -> String {
    match r {
        Ok(v) => panic!("expected an error, got Ok({v:?})"),
        Err(e) => e.to_string(),
    }
}
