//! `Proj::forward` (the fused CPU product where it applies) agrees with candle's
//! `matmul` reference: on the shapes of `shared/proj_cases.rs` (every row-tile tail,
//! partial panels, contraction tails, first and kept-pack calls), batched and strided
//! inputs, f16/bf16 weights, gradients, and its shape errors; and that a second and
//! third call return the first call's bits.
#[path = "shared/proj_cases.rs"]
mod proj_cases;

use candle_attention::Proj;
use candle_core::{DType, Device, Result, Tensor};
use proj_cases::rel_err;

/// Every case of `shared/proj_cases.rs`: the shapes against candle's `matmul`, repeated
/// calls bit for bit, calls of other sizes in between, and f16/bf16 weights with f16,
/// bf16 or f32 inputs against their f32 product.
#[test]
fn the_shared_cases_pass() -> Result<()> {
    proj_cases::all_cases_pass()
}

#[test]
fn batched_and_strided_inputs_match_candle_matmul() -> Result<()> {
    let dev = Device::Cpu;
    // Batched input (…, in) and a strided (transposed) input.
    let x = Tensor::randn(0f32, 1.0, (2, 40, 64), &dev)?;
    let w = Tensor::randn(0f32, 0.1, (48, 64), &dev)?;
    let p = Proj::new(w.clone(), None);
    let got = p.forward(&x)?;
    let want = Proj::matmul_bias_reference(&x.reshape((80, 64))?, &w, None)?.reshape((2, 40, 48))?;
    assert!(rel_err(&got, &want)? < 1e-5);
    let xt = Tensor::randn(0f32, 1.0, (64, 80), &dev)?.t()?;
    let got = p.forward(&xt)?;
    let want = Proj::matmul_bias_reference(&xt.contiguous()?, &w, None)?;
    assert!(rel_err(&got, &want)? < 1e-5);
    // Half precision goes through f32 and returns f32.
    let got = p.forward(&xt.to_dtype(DType::BF16)?)?;
    assert_eq!(got.dtype(), DType::F32);
    // Batched and strided bf16 inputs against a bf16 weight, which the AMX and
    // AVX512-BF16 products take as bf16 rows where they run.
    let wb = w.to_dtype(DType::BF16)?;
    let pb = Proj::new(wb.clone(), None);
    let wf = wb.to_dtype(DType::F32)?;
    for xb in [
        x.to_dtype(DType::BF16)?,
        Tensor::randn(0f32, 1.0, (64, 80), &dev)?
            .to_dtype(DType::BF16)?
            .t()?,
    ] {
        let got = pb.forward(&xb)?;
        let rows = xb.elem_count() / 64;
        let xf = xb.to_dtype(DType::F32)?.contiguous()?.reshape((rows, 64))?;
        let want = Proj::matmul_bias_reference(&xf, &wf, None)?.reshape(got.shape())?;
        assert_eq!(got.dtype(), DType::F32);
        assert!(rel_err(&got, &want)? < 1e-5, "bf16 input {:?}", xb.dims());
    }
    Ok(())
}

/// An output of 32 MiB (8192 × 1024 f32), the size from which the kernel asks Linux
/// for huge pages before writing it, matches the reference like small ones.
#[test]
fn a_32_mib_output_matches_candle_matmul() -> Result<()> {
    let dev = Device::Cpu;
    let x = Tensor::randn(0f32, 1.0, (8192, 8), &dev)?;
    let w = Tensor::randn(0f32, 0.3, (1024, 8), &dev)?;
    let b = Tensor::randn(0f32, 1.0, 1024, &dev)?;
    let got = Proj::new(w.clone(), Some(b.clone())).forward(&x)?;
    let want = Proj::matmul_bias_reference(&x, &w, Some(&b))?;
    let err = rel_err(&got, &want)?;
    assert!(err < 1e-5, "err {err}");
    Ok(())
}

/// A weight and input that record gradients (candle `Var`s, as in training) take
/// candle's differentiable ops: the fused product has no backward pass. The gradients
/// equal those of the reference product.
#[test]
fn trainable_weights_get_gradients() -> Result<()> {
    let dev = Device::Cpu;
    let (rows, inp, out) = (64, 96, 80);
    let w = candle_core::Var::from_tensor(&Tensor::randn(0f32, 0.1, (out, inp), &dev)?)?;
    let b = candle_core::Var::from_tensor(&Tensor::randn(0f32, 1.0, out, &dev)?)?;
    let x = candle_core::Var::from_tensor(&Tensor::randn(0f32, 1.0, (rows, inp), &dev)?)?;
    let p = Proj::new(w.as_tensor().clone(), Some(b.as_tensor().clone()));
    let dy = Tensor::randn(0f32, 1.0, (rows, out), &dev)?;
    for call in ["first", "second"] {
        let grads = (p.forward(x.as_tensor())? * &dy)?.sum_all()?.backward()?;
        let want = (Proj::matmul_bias_reference(x.as_tensor(), w.as_tensor(), Some(b.as_tensor()))? * &dy)?
            .sum_all()?
            .backward()?;
        for (name, var) in [("weight", &w), ("bias", &b), ("input", &x)] {
            let got = grads
                .get(var)
                .unwrap_or_else(|| panic!("no gradient for the {name} ({call} call)"));
            let err = rel_err(got, want.get(var).expect("the reference has every gradient"))?;
            assert!(err < 1e-5, "{name} gradient ({call} call): err {err}");
        }
    }
    Ok(())
}

/// Inputs and biases whose shapes do not fit the weight, and weights that are not
/// `(out, in)`, are errors that name the shapes, on the CPU kernel's path (20 rows) and on
/// candle's (3 rows) alike.
#[test]
fn bad_shapes_are_errors_that_name_them() -> Result<()> {
    let dev = Device::Cpu;
    let w = Tensor::randn(0f32, 1.0, (48, 64), &dev)?;
    let err = |r: Result<Tensor>| match r {
        Ok(t) => panic!("expected an error, got {:?}", t.dims()),
        Err(e) => e.to_string(),
    };
    for rows in [20, 3] {
        let p = Proj::new(w.clone(), None);
        let msg = err(p.forward(&Tensor::zeros((rows, 63), DType::F32, &dev)?));
        assert!(msg.contains("63") && msg.contains("[48, 64]"), "{msg}");
        let p = Proj::new(w.clone(), Some(Tensor::zeros(47, DType::F32, &dev)?));
        let msg = err(p.forward(&Tensor::zeros((rows, 64), DType::F32, &dev)?));
        assert!(msg.contains("[47]") && msg.contains("[48, 64]"), "{msg}");
        // A weight that is not (out, in).
        for shape in [&[48][..], &[2, 48, 64][..]] {
            let p = Proj::new(Tensor::zeros(shape, DType::F32, &dev)?, None);
            let msg = err(p.forward(&Tensor::zeros((rows, 64), DType::F32, &dev)?));
            let want = format!("projection weight must be (out, in), got {shape:?}");
            assert!(msg.contains(&want), "{msg}");
        }
    }
    Ok(())
}

/// Inputs with ±inf and NaN, and weights with them (f32, bf16 and f16), give the
/// reference's infinities and NaNs, and its finite values elsewhere, on the first call
/// and on the kept pack, for a few rows and for many, with f32 inputs and inputs in the
/// weight's dtype. (Where the AMX tile unit runs bf16 products, and f16 products of
/// half-precision inputs, such input rows are recomputed by f32 dot products and such
/// weights take the f32 product.)
#[test]
fn non_finite_inputs_and_weights_give_the_references_values() -> Result<()> {
    let dev = Device::Cpu;
    let (inp, out) = (64, 48);
    for wdt in [DType::F32, DType::BF16, DType::F16] {
        for bad_weight in [false, true] {
            let mut wv = (Tensor::randn(0f32, 1.0, (out, inp), &dev)? / 8.0)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            if bad_weight {
                wv[3 * inp + 1] = f32::INFINITY;
                wv[40 * inp + 9] = f32::NAN;
            }
            let w = Tensor::from_vec(wv, (out, inp), &dev)?.to_dtype(wdt)?;
            for rows in [5, 40] {
                let mut xv = Tensor::randn(0f32, 1.0, (rows, inp), &dev)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                xv[inp + 2] = f32::INFINITY;
                xv[3 * inp + 60] = f32::NEG_INFINITY;
                xv[4 * inp] = f32::NAN;
                let x32 = Tensor::from_vec(xv, (rows, inp), &dev)?;
                let w32 = w.to_dtype(DType::F32)?;
                for xdt in if wdt == DType::F32 {
                    vec![wdt]
                } else {
                    vec![DType::F32, wdt]
                } {
                    let x = x32.to_dtype(xdt)?;
                    let x32 = x.to_dtype(DType::F32)?;
                    let p = Proj::new(w.clone(), None);
                    let want = Proj::matmul_bias_reference(&x32, &w32, None)?.to_vec2::<f32>()?;
                    // An f16 weight against a half-precision input may skip `lo·lo`
                    // products: within `2⁻¹⁶·Σ|x·w|` more (`Proj`).
                    let size = x32.abs()?.matmul(&w32.abs()?.t()?)?.to_vec2::<f32>()?;
                    let skip = if xdt == DType::F16 { 2f32.powi(-16) } else { 0.0 };
                    for call in ["first", "second"] {
                        let got = p.forward(&x)?.to_vec2::<f32>()?;
                        for (r, (g, w)) in got.iter().zip(&want).enumerate() {
                            for (o, (&g, &w)) in g.iter().zip(w).enumerate() {
                                let same = if w.is_finite() {
                                    (g - w).abs() <= 1e-5 * w.abs().max(1.0) + skip * size[r][o]
                                } else {
                                    g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan())
                                };
                                assert!(
                                    same,
                                    "weight {wdt:?} (non-finite: {bad_weight}), x {xdt:?}, rows {rows}, {call} call, ({r}, {o}): {g} vs {w}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(())
}
