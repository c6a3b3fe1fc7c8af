//! Functional SDPA: shapes, invariances and errors.
mod common;
use candle_attention::{scaled_dot_product_attention, sdpa, AttnMask, Backend, SdpaOptions};
use candle_core::{DType, Device, Result, Tensor, D};
use common::{all_zero, err_msg, max_diff, randn};

/// softmax(q kᵀ · scale) v written out for one (L, E) head, as an independent check.
fn naive_head(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let s = (q.matmul(&k.t()?)? * scale)?;
    let p = candle_nn::ops::softmax_last_dim(&s)?;
    p.matmul(v)
}

#[test]
fn matches_a_naive_softmax_per_head() -> Result<()> {
    let (q, k, v) = (
        randn(&[2, 3, 5, 8])?,
        randn(&[2, 3, 7, 8])?,
        randn(&[2, 3, 7, 4])?,
    );
    let out = sdpa(&q, &k, &v, &SdpaOptions::new())?;
    for b in 0..2 {
        for h in 0..3 {
            let pick = |t: &Tensor| t.get(b).and_then(|t| t.get(h));
            let want = naive_head(&pick(&q)?, &pick(&k)?, &pick(&v)?, 1.0 / 8f64.sqrt())?;
            assert!(max_diff(&pick(&out)?, &want)? < 1e-6);
        }
    }
    // scale override
    let out = sdpa(&q, &k, &v, &SdpaOptions::new().with_scale(0.3))?;
    let want = naive_head(&q.get(1)?.get(2)?, &k.get(1)?.get(2)?, &v.get(1)?.get(2)?, 0.3)?;
    assert!(max_diff(&out.get(1)?.get(2)?, &want)? < 1e-6);
    Ok(())
}

#[test]
fn any_number_of_leading_dims() -> Result<()> {
    let (q, k, v) = (
        randn(&[2, 2, 3, 5, 8])?,
        randn(&[2, 2, 3, 6, 8])?,
        randn(&[2, 2, 3, 6, 4])?,
    );
    let out = sdpa(&q, &k, &v, &SdpaOptions::new().with_causal(true))?;
    assert_eq!(out.dims(), &[2, 2, 3, 5, 4]);
    let flat = |t: &Tensor| {
        let d = t.dims();
        t.reshape((4, d[2], d[3], d[4]))
    };
    let want = sdpa(
        &flat(&q)?,
        &flat(&k)?,
        &flat(&v)?,
        &SdpaOptions::new().with_causal(true),
    )?;
    assert_eq!(max_diff(&flat(&out)?, &want)?, 0.0);
    // (H, L, E) and (L, E)
    let out3 = sdpa(
        &q.get(0)?.get(0)?,
        &k.get(0)?.get(0)?,
        &v.get(0)?.get(0)?,
        &SdpaOptions::new(),
    )?;
    assert_eq!(out3.dims(), &[3, 5, 4]);
    let q2 = q.get(0)?.get(0)?.get(1)?;
    let out2 = sdpa(
        &q2,
        &k.get(0)?.get(0)?.get(1)?,
        &v.get(0)?.get(0)?.get(1)?,
        &SdpaOptions::new(),
    )?;
    assert_eq!(out2.dims(), &[5, 4]);
    assert!(max_diff(&out2, &out3.get(1)?)? < 1e-7);
    Ok(())
}

#[test]
fn gqa_equals_repeated_kv_heads() -> Result<()> {
    for (hq, hkv) in [(4, 4), (4, 2), (8, 2), (8, 1)] {
        let (q, k, v) = (
            randn(&[2, hq, 5, 8])?,
            randn(&[2, hkv, 6, 8])?,
            randn(&[2, hkv, 6, 3])?,
        );
        let g = hq / hkv;
        let rep = |t: &Tensor| -> Result<Tensor> {
            let (b, h, s, d) = t.dims4()?;
            t.unsqueeze(2)?
                .broadcast_as((b, h, g, s, d))?
                .reshape((b, h * g, s, d))
        };
        let opts = SdpaOptions::new().with_gqa(true).with_causal(true);
        let a = sdpa(&q, &k, &v, &opts)?;
        let b = sdpa(&q, &rep(&k)?, &rep(&v)?, &SdpaOptions::new().with_causal(true))?;
        assert!(max_diff(&a, &b)? < 1e-6, "hq {hq} hkv {hkv}");
    }
    Ok(())
}

#[test]
fn padded_batch_equals_each_sequence_alone() -> Result<()> {
    // Two sequences of 7 and 4 keys, padded to 7; queries of length 3.
    let (q, k, v) = (
        randn(&[2, 2, 3, 8])?,
        randn(&[2, 2, 7, 8])?,
        randn(&[2, 2, 7, 5])?,
    );
    let pad = Tensor::new(&[[0u8, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1, 1]], &Device::Cpu)?;
    let opts = SdpaOptions::new().with_mask(AttnMask::key_padding(&pad)?);
    let batch = sdpa(&q, &k, &v, &opts)?;
    for (b, len) in [(0usize, 7usize), (1, 4)] {
        let alone = sdpa(
            &q.narrow(0, b, 1)?,
            &k.narrow(0, b, 1)?.narrow(2, 0, len)?,
            &v.narrow(0, b, 1)?.narrow(2, 0, len)?,
            &SdpaOptions::new(),
        )?;
        assert!(max_diff(&batch.narrow(0, b, 1)?, &alone)? < 1e-6, "batch row {b}");
    }
    Ok(())
}

#[test]
fn non_contiguous_inputs_equal_contiguous() -> Result<()> {
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        // (B, L, H, E) transposed to (B, H, L, E): a strided view.
        let q = randn(&[2, 5, 3, 8])?.to_dtype(dtype)?.transpose(1, 2)?;
        let k = randn(&[2, 7, 3, 8])?.to_dtype(dtype)?.transpose(1, 2)?;
        let v = randn(&[2, 7, 3, 4])?.to_dtype(dtype)?.transpose(1, 2)?;
        assert!(!q.is_contiguous());
        let mask = AttnMask::keep(&randn(&[2, 1, 5, 7])?.ge(-1.0f32)?)?;
        for backend in [Backend::Auto, Backend::Reference] {
            let opts = SdpaOptions::new()
                .with_mask(mask.clone())
                .with_causal(true)
                .with_backend(backend);
            let a = sdpa(&q, &k, &v, &opts)?;
            let b = sdpa(&q.contiguous()?, &k.contiguous()?, &v.contiguous()?, &opts)?;
            assert_eq!(a.dtype(), dtype);
            assert_eq!(max_diff(&a, &b)?, 0.0, "{dtype:?}");
        }
    }
    Ok(())
}

/// The fused path reads strided views of rank 2, 3, 4 and 5 in place (rank 5 by a copy of
/// its collapsed batch dims); each must equal its contiguous copy exactly.
#[test]
fn strided_views_of_every_rank_equal_contiguous() -> Result<()> {
    // (…, E, L) transposed to (…, L, E).
    let strided = |lead: &[usize], l: usize, e: usize, dtype: DType| -> Result<Tensor> {
        let mut d = lead.to_vec();
        d.extend([e, l]);
        let r = d.len();
        randn(&d)?.to_dtype(dtype)?.transpose(r - 2, r - 1)
    };
    for lead in [&[][..], &[3][..], &[2, 3][..], &[2, 2, 3][..]] {
        for dtype in [DType::F32, DType::BF16] {
            let q = strided(lead, 5, 16, dtype)?;
            let k = strided(lead, 9, 16, dtype)?;
            let v = strided(lead, 9, 8, dtype)?;
            assert!(!q.is_contiguous() && !k.is_contiguous() && !v.is_contiguous());
            let opts = SdpaOptions::new().with_causal(true);
            let a = sdpa(&q, &k, &v, &opts)?;
            let b = sdpa(&q.contiguous()?, &k.contiguous()?, &v.contiguous()?, &opts)?;
            assert_eq!(a.dims(), b.dims());
            assert_eq!(max_diff(&a, &b)?, 0.0, "{lead:?} {dtype:?}");
        }
    }
    Ok(())
}

#[test]
fn weights_are_returned_in_torch_shape() -> Result<()> {
    let (q, k, v) = (
        randn(&[2, 3, 5, 8])?,
        randn(&[2, 3, 7, 8])?,
        randn(&[2, 3, 7, 4])?,
    );
    let out = scaled_dot_product_attention(&q, &k, &v, &SdpaOptions::new().with_weights(true))?;
    let w = out.weights.expect("weights");
    assert_eq!(w.dims(), &[2, 3, 5, 7]);
    let sums = w.sum(D::Minus1)?.flatten_all()?.to_vec1::<f32>()?;
    assert!(sums.iter().all(|s| (s - 1.0).abs() < 1e-5));
    assert!(max_diff(&w.matmul(&v)?, &out.output)? < 1e-6);
    Ok(())
}

#[test]
fn half_precision_accumulates_in_f32() -> Result<()> {
    // Logits around ±60 overflow exp in f16 if summed there; the f32 path is fine.
    let q = (randn(&[1, 2, 9, 16])? * 4.0)?;
    let k = (randn(&[1, 2, 11, 16])? * 4.0)?;
    let v = randn(&[1, 2, 11, 16])?;
    let want = sdpa(&q, &k, &v, &SdpaOptions::new())?;
    for (dt, tol) in [(DType::F16, 5e-3), (DType::BF16, 2e-2)] {
        let (qh, kh, vh) = (q.to_dtype(dt)?, k.to_dtype(dt)?, v.to_dtype(dt)?);
        let want = sdpa(
            &qh.to_dtype(DType::F32)?,
            &kh.to_dtype(DType::F32)?,
            &vh.to_dtype(DType::F32)?,
            &SdpaOptions::new(),
        )?;
        let got = sdpa(&qh, &kh, &vh, &SdpaOptions::new())?;
        assert_eq!(got.dtype(), dt);
        assert!(max_diff(&got, &want)? < tol, "{dt:?}");
    }
    assert_eq!(want.dtype(), DType::F32);
    Ok(())
}

/// candle-nn 0.11's `softmax_last_dim` sums a row's exponentials in the row's dtype on
/// CPU: 4096 equal bf16 scores give probabilities that sum to 16 (f16: 2). Both of our
/// paths sum in f32, so equal scores over 4096 keys give the mean of V.
#[test]
fn long_half_precision_rows_sum_in_f32() -> Result<()> {
    let s = 4096;
    let q = Tensor::zeros((1, 2, 3, 16), DType::F32, &Device::Cpu)?;
    let k = randn(&[1, 2, s, 16])?;
    // Centred on 1, so that the mean is far from 0 against the tolerance.
    let v = (randn(&[1, 2, s, 8])? + 1.0)?;
    for (dt, tol) in [(DType::F16, 5e-3), (DType::BF16, 2e-2)] {
        let (qh, kh, vh) = (q.to_dtype(dt)?, k.to_dtype(dt)?, v.to_dtype(dt)?);
        let want = vh
            .to_dtype(DType::F32)?
            .mean_keepdim(2)?
            .broadcast_as((1, 2, 3, 8))?;
        for backend in [Backend::Reference, Backend::Fused] {
            let got = sdpa(&qh, &kh, &vh, &SdpaOptions::new().with_backend(backend))?;
            let err = max_diff(&got.to_dtype(DType::F32)?, &want)?;
            assert!(err < tol, "{dt:?} {backend:?}: {err}");
        }
    }
    Ok(())
}

#[test]
fn bad_shapes_are_errors_that_name_them() -> Result<()> {
    let o = SdpaOptions::new();
    let q = randn(&[2, 4, 5, 8])?;
    let k = randn(&[2, 4, 6, 8])?;
    let v = randn(&[2, 4, 6, 3])?;
    // wrong rank
    let msg = err_msg(sdpa(&randn(&[8])?, &randn(&[8])?, &randn(&[8])?, &o));
    assert!(msg.contains("[8]"), "{msg}");
    let msg = err_msg(sdpa(&q, &k.get(0)?, &v, &o));
    assert!(msg.contains("rank") && msg.contains("[4, 6, 8]"), "{msg}");
    // mismatched E
    let msg = err_msg(sdpa(&q, &randn(&[2, 4, 6, 7])?, &v, &o));
    assert!(
        msg.contains("[2, 4, 6, 7]") && msg.contains("[2, 4, 5, 8]"),
        "{msg}"
    );
    // mismatched S between k and v
    let msg = err_msg(sdpa(&q, &k, &randn(&[2, 4, 5, 3])?, &o));
    assert!(msg.contains("[2, 4, 5, 3]"), "{msg}");
    // mismatched batch
    let msg = err_msg(sdpa(&randn(&[3, 4, 5, 8])?, &k, &v, &o));
    assert!(msg.contains("batch"), "{msg}");
    // heads differ without enable_gqa
    let msg = err_msg(sdpa(&q, &randn(&[2, 2, 6, 8])?, &randn(&[2, 2, 6, 3])?, &o));
    assert!(msg.contains("enable_gqa"), "{msg}");
    // Hq not divisible by Hkv
    let msg = err_msg(sdpa(
        &q,
        &randn(&[2, 3, 6, 8])?,
        &randn(&[2, 3, 6, 3])?,
        &o.clone().with_gqa(true),
    ));
    assert!(
        msg.contains("multiple") && msg.contains('4') && msg.contains('3'),
        "{msg}"
    );
    // k and v heads differ
    let msg = err_msg(sdpa(&q, &k, &randn(&[2, 2, 6, 3])?, &o.clone().with_gqa(true)));
    assert!(msg.contains("same number of heads"), "{msg}");
    // dtypes
    let msg = err_msg(sdpa(&q, &k.to_dtype(DType::F64)?, &v, &o));
    assert!(msg.contains("F64"), "{msg}");
    let msg = err_msg(sdpa(
        &q.to_dtype(DType::U32)?,
        &k.to_dtype(DType::U32)?,
        &v.to_dtype(DType::U32)?,
        &o,
    ));
    assert!(msg.contains("U32"), "{msg}");
    Ok(())
}

/// E = 0: every score is the empty sum 0, so each row is the mean of V, also with the
/// default scale 1/√0 = ∞ (PyTorch 2.15 returns the mean there too, where `0 · ∞` would
/// be NaN), on both backends and in every dtype.
#[test]
fn zero_head_dim_gives_the_mean_of_v_whatever_the_scale() -> Result<()> {
    let dev = Device::Cpu;
    let v = Tensor::arange(0f32, 40.0, &dev)?.reshape((1, 2, 5, 4))?;
    let want = v.mean_keepdim(2)?.broadcast_as((1, 2, 3, 4))?.contiguous()?;
    for dt in [DType::F32, DType::F16, DType::BF16] {
        let q = Tensor::zeros((1, 2, 3, 0), dt, &dev)?;
        let k = Tensor::zeros((1, 2, 5, 0), dt, &dev)?;
        let v = v.to_dtype(dt)?;
        for be in [Backend::Reference, Backend::Fused] {
            for opts in [SdpaOptions::new(), SdpaOptions::new().with_scale(f64::INFINITY)] {
                let o = sdpa(&q, &k, &v, &opts.with_backend(be))?.to_dtype(DType::F32)?;
                let d = max_diff(&o, &want)?;
                assert!(d < 1e-5, "{dt:?} {be:?}: {d}");
            }
        }
    }
    Ok(())
}

#[test]
fn fused_backend_errors_when_it_cannot_run() -> Result<()> {
    let q = randn(&[1, 2, 3, 4])?.to_dtype(DType::F64)?;
    let msg = err_msg(sdpa(&q, &q, &q, &SdpaOptions::new().with_backend(Backend::Fused)));
    assert!(msg.contains("F64"), "{msg}");
    let q = randn(&[1, 2, 3, 4])?;
    let opts = SdpaOptions::new().with_backend(Backend::Fused).with_weights(true);
    let msg = err_msg(scaled_dot_product_attention(&q, &q, &q, &opts));
    assert!(msg.contains("weights"), "{msg}");
    // Sinks and softcap run on the fused kernel; a cap that is not positive and finite
    // is refused on either path.
    let fused = SdpaOptions::new().with_backend(Backend::Fused);
    let sinks = Tensor::zeros(2, DType::F32, &Device::Cpu)?;
    sdpa(&q, &q, &q, &fused.clone().with_softcap(30.0).with_sinks(sinks))?;
    for cap in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        for opts in [fused.clone(), SdpaOptions::new().with_backend(Backend::Reference)] {
            let msg = err_msg(sdpa(&q, &q, &q, &opts.with_softcap(cap)));
            assert!(
                msg.contains("softcap must be positive and finite"),
                "{cap}: {msg}"
            );
        }
    }
    Ok(())
}

/// burn's `quiet_softmax` (`exp(s_i) / (1 + Σ_j exp(s_j))`, "attention is off by one") is
/// a sink of logit 0 in every head, as the README's peer table says. Checked on both
/// backends against that formula written out in f64, over 70 keys (two of the fused
/// kernel's key blocks), with a bool mask whose first row hides every key: quiet
/// softmax gives 0 there too.
#[test]
fn quiet_softmax_is_a_zero_sink() -> Result<()> {
    let (b, h, l, s, e, ev) = (2, 3, 5, 70, 8, 6);
    let (q, k, v) = (
        randn(&[b, h, l, e])?,
        randn(&[b, h, s, e])?,
        randn(&[b, h, s, ev])?,
    );
    // keep[i][j] = 0 for the whole of row 0 and for every third key of the other rows.
    let keep: Vec<u8> = (0..l * s)
        .map(|ij| u8::from(ij / s != 0 && (ij % s) % 3 != 0))
        .collect();
    let keep = Tensor::from_vec(keep, (l, s), &Device::Cpu)?;
    let scale = 0.5 / (e as f64).sqrt();
    let f = |t: &Tensor| t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>();
    let (qv, kv, vv, mv) = (f(&q)?, f(&k)?, f(&v)?, f(&keep)?);
    let mut want = vec![0f64; b * h * l * ev];
    for bh in 0..b * h {
        for i in 0..l {
            let (mut num, mut den) = (vec![0f64; ev], 1f64);
            for j in (0..s).filter(|&j| mv[i * s + j] != 0.0) {
                let dot: f64 = (0..e)
                    .map(|c| qv[(bh * l + i) * e + c] * kv[(bh * s + j) * e + c])
                    .sum();
                let p = (scale * dot).exp();
                den += p;
                for (c, n) in num.iter_mut().enumerate() {
                    *n += p * vv[(bh * s + j) * ev + c];
                }
            }
            for c in 0..ev {
                want[(bh * l + i) * ev + c] = num[c] / den;
            }
        }
    }
    let want = Tensor::from_vec(want, (b, h, l, ev), &Device::Cpu)?;
    let zero_sinks = Tensor::zeros(h, DType::F32, &Device::Cpu)?;
    for backend in [Backend::Reference, Backend::Fused] {
        let opts = SdpaOptions::new()
            .with_mask(AttnMask::keep(&keep)?)
            .with_scale(scale)
            .with_backend(backend);
        let out = sdpa(&q, &k, &v, &opts.clone().with_sinks(zero_sinks.clone()))?;
        let err = max_diff(&out, &want)?;
        assert!(err < 1e-5, "{backend:?}: {err}");
        assert!(all_zero(&out.narrow(2, 0, 1)?)?, "{backend:?}");
        // Without the sink the softmax is PyTorch's, which this formula is not.
        let plain = max_diff(&sdpa(&q, &k, &v, &opts)?, &want)?;
        assert!(plain > 1e-3, "{backend:?}: {plain}");
    }
    Ok(())
}

/// Inputs or a mask that record gradients (candle `Var`s, as in training) take the
/// reference path under `Backend::Auto`, so the backward pass reaches every one of them
/// (a learned additive bias, as T5's relative positions, included); the fused kernel,
/// which has no backward pass, refuses them.
#[test]
fn trainable_inputs_get_gradients() -> Result<()> {
    use candle_core::Var;
    let var = |shape: &[usize]| Var::from_tensor(&randn(shape)?);
    let (q, k, v) = (var(&[2, 4, 33, 16])?, var(&[2, 2, 40, 16])?, var(&[2, 2, 40, 8])?);
    let bias = var(&[1, 4, 33, 40])?;
    let dy = randn(&[2, 4, 33, 8])?;
    let run = |backend: Backend| -> Result<candle_core::backprop::GradStore> {
        let opts = SdpaOptions::new()
            .with_gqa(true)
            .with_causal(true)
            .with_mask(AttnMask::additive(bias.as_tensor())?)
            .with_backend(backend);
        let o = sdpa(q.as_tensor(), k.as_tensor(), v.as_tensor(), &opts)?;
        (o * &dy)?.sum_all()?.backward()
    };
    let (got, want) = (run(Backend::Auto)?, run(Backend::Reference)?);
    for (name, t) in [("q", &q), ("k", &k), ("v", &v), ("mask", &bias)] {
        let g = got.get(t).unwrap_or_else(|| panic!("no gradient for {name}"));
        let d = max_diff(g, want.get(t).expect("the reference has every gradient"))?;
        assert!(d < 1e-5, "{name} gradient: max diff {d}");
    }
    // Any one tracked input is enough for the fused backend to refuse.
    let plain = randn(&[1, 2, 5, 4])?;
    let tracked = Var::from_tensor(&plain)?;
    let opts = SdpaOptions::new().with_backend(Backend::Fused);
    let msg = err_msg(sdpa(&plain, tracked.as_tensor(), &plain, &opts));
    assert!(msg.contains("backward"), "{msg}");
    let opts = opts.with_mask(AttnMask::additive(
        &Var::from_tensor(&randn(&[5, 5])?)?.as_tensor().clone(),
    )?);
    let msg = err_msg(sdpa(&plain, &plain, &plain, &opts));
    assert!(msg.contains("backward"), "{msg}");
    Ok(())
}
