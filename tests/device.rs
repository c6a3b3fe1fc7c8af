//! Zero-sized dimensions on the test device: CUDA when the tests are built with
//! `--features cuda` on a machine with a GPU, else the CPU. candle's CUDA backend cannot
//! cast or reduce empty tensors, and its CPU copies of empty views at an offset index out
//! of bounds, so the crate routes empty tensors around those ops. The attention tests
//! compare every such call with the reference path in f64 on the CPU.
mod common;
use std::collections::HashMap;

use candle_attention::decoder::{DecoderAttention, DecoderAttentionConfig, QkNorm, QkvLayout};
use candle_attention::fixture::normalised_error;
use candle_attention::{
    scaled_dot_product_attention, AttnMask, Backend, KvCache, MhaArgs, MultiheadAttention,
    MultiheadAttentionConfig, RopeConfig, RopeScaling, RopeStyle, RotaryEmbedding, SdpaOptions,
};
use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::VarBuilder;
use common::max_diff;

const DTYPES: [(DType, f64); 3] = [(DType::F32, 1e-5), (DType::F16, 5e-3), (DType::BF16, 2e-2)];

/// Deterministic values in [-1, 1) of `shape`, f32 on the CPU.
fn values(shape: &[usize], seed: usize) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| ((i * 7919 + seed * 104729) % 61) as f32 / 30.5 - 1.0)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
}

/// `got` (on the device, in `dt`) against `want` (f64 on the CPU), by the fixtures' error
/// (the largest difference over `max(1, max|want|)`), to which `tol` applies.
fn check(got: &Tensor, want: &Tensor, dt: DType, dev: &Device, tol: f64, what: &str) -> Result<()> {
    assert!(
        got.device().same_device(dev),
        "{what}: output on {:?}",
        got.device()
    );
    assert_eq!(got.dtype(), dt, "{what}");
    assert_eq!(got.dims(), want.dims(), "{what}");
    let got = got.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    if got.elem_count() > 0 {
        let err = normalised_error(&got, want)?;
        assert!(err <= tol, "{what}: error {err:.3e} > {tol:.0e}");
    }
    Ok(())
}

#[test]
fn sdpa_with_zero_sized_dims_on_the_test_device() -> Result<()> {
    let dev = Device::cuda_if_available(0)?;
    // (N, H, L, S, E, Ev), each with one dim 0.
    let shapes = [
        (0, 2, 3, 4, 8, 8),
        (2, 0, 3, 4, 8, 8),
        (2, 2, 0, 4, 8, 8),
        (2, 2, 3, 0, 8, 8),
        (2, 2, 3, 4, 0, 8),
        (2, 2, 3, 4, 8, 0),
    ];
    for (n, h, l, s, e, ev) in shapes {
        let (q, k, v) = (
            values(&[n, h, l, e], 1)?,
            values(&[n, h, s, e], 2)?,
            values(&[n, h, s, ev], 3)?,
        );
        // A bool mask that keeps a key where (i + j) % 3 != 0, and an additive one.
        let keep: Vec<u8> = (0..l * s)
            .map(|x| ((x / s.max(1) + x % s.max(1)) % 3 != 0) as u8)
            .collect();
        let keep = Tensor::from_vec(keep, (l, s), &Device::Cpu)?;
        let add = (values(&[l, s], 4)? * 2.0)?;
        for (dt, tol) in DTYPES {
            let on = |t: &Tensor| t.to_dtype(dt)?.to_device(&dev);
            let (qd, kd, vd) = (on(&q)?, on(&k)?, on(&v)?);
            let f64s = |t: &Tensor| t.to_dtype(dt)?.to_dtype(DType::F64);
            let (q64, k64, v64) = (f64s(&q)?, f64s(&k)?, f64s(&v)?);
            for variant in 0..4 {
                let opts = |keep: &Tensor, add: &Tensor| -> Result<SdpaOptions> {
                    Ok(match variant {
                        0 => SdpaOptions::new(),
                        1 => SdpaOptions::new().with_causal(true).with_weights(true),
                        2 => SdpaOptions::new()
                            .with_mask(AttnMask::keep(keep)?)
                            .with_weights(true),
                        _ => SdpaOptions::new()
                            .with_mask(AttnMask::additive(add)?)
                            .with_causal(true),
                    })
                };
                let got =
                    scaled_dot_product_attention(&qd, &kd, &vd, &opts(&keep.to_device(&dev)?, &on(&add)?)?)?;
                let want = scaled_dot_product_attention(
                    &q64,
                    &k64,
                    &v64,
                    &opts(&keep, &f64s(&add)?)?.with_backend(Backend::Reference),
                )?;
                let what = format!("N={n} H={h} L={l} S={s} E={e} Ev={ev} {dt:?} variant {variant}");
                check(&got.output, &want.output, dt, &dev, tol, &what)?;
                assert_eq!(got.weights.is_some(), want.weights.is_some(), "{what}");
                if let (Some(gw), Some(ww)) = (&got.weights, &want.weights) {
                    check(gw, ww, dt, &dev, tol, &format!("{what} weights"))?;
                }
            }
        }
    }
    Ok(())
}

/// Cross-attention (separate projections, `kdim`, `add_bias_kv`) and self-attention (one
/// `in_proj_weight`, `add_zero_attn`) with an empty batch, no query or no key. The weights
/// have PyTorch's shapes: `(N, L, S')` averaged, `(N, H, L, S')` per head, where `S'` counts
/// the appended keys (PyTorch 2.15 gives these shapes; checked).
#[test]
fn multihead_attention_with_zero_sized_dims_on_the_test_device() -> Result<()> {
    let dev = Device::cuda_if_available(0)?;
    let (e, kdim) = (8, 5);
    // One head too: its views into an empty projection once made candle's CPU copy panic.
    for (self_attn, h) in [(false, 1), (false, 2), (true, 1), (true, 2)] {
        // (N, L, S): an empty batch, no query and no key (S = L in self-attention).
        for (n, l, s) in [(0, 3, 4), (2, 0, 4), (2, 3, 0)] {
            let s = if self_attn { l } else { s };
            let extra = if self_attn { 1 } else { [0, 1][n % 2] };
            let mut params = vec![
                ("in_proj_bias", values(&[3 * e], 8)?),
                ("out_proj.weight", values(&[e, e], 9)?),
                ("out_proj.bias", values(&[e], 10)?),
            ];
            if self_attn {
                params.push(("in_proj_weight", values(&[3 * e, e], 5)?));
            } else {
                params.push(("q_proj_weight", values(&[e, e], 5)?));
                params.push(("k_proj_weight", values(&[e, kdim], 6)?));
                params.push(("v_proj_weight", values(&[e, kdim], 7)?));
            }
            let bias_kv = !self_attn && extra == 1;
            if bias_kv {
                params.push(("bias_k", values(&[1, 1, e], 11)?));
                params.push(("bias_v", values(&[1, 1, e], 12)?));
            }
            let cfg = MultiheadAttentionConfig {
                batch_first: true,
                add_bias_kv: bias_kv,
                add_zero_attn: self_attn,
                kdim: (!self_attn).then_some(kdim),
                vdim: (!self_attn).then_some(kdim),
                ..MultiheadAttentionConfig::new(e, h)
            };
            let query = values(&[n, l, e], 13)?;
            let key = if self_attn {
                query.clone()
            } else {
                values(&[n, s, kdim], 14)?
            };
            let pad: Vec<u8> = (0..n * s).map(|x| (x % 3 == 2) as u8).collect();
            let pad = Tensor::from_vec(pad, (n, s), &Device::Cpu)?;
            for (dt, tol) in DTYPES {
                let load = |dtype: DType, device: &Device| -> Result<MultiheadAttention> {
                    let map: HashMap<String, Tensor> = params
                        .iter()
                        .map(|(k, v)| {
                            Ok((k.to_string(), v.to_dtype(dt)?.to_dtype(dtype)?.to_device(device)?))
                        })
                        .collect::<Result<_>>()?;
                    MultiheadAttention::new(&cfg, VarBuilder::from_tensors(map, dtype, device))
                };
                let (mha, mha64) = (load(dt, &dev)?, load(DType::F64, &Device::Cpu)?);
                for (masked, average) in [(false, true), (true, true), (true, false)] {
                    let run = |m: &MultiheadAttention, q: &Tensor, k: &Tensor, pad: &Tensor, be| {
                        // Self-attention passes one tensor three times (the fused projection).
                        let k = if self_attn { q } else { k };
                        m.forward_with(
                            q,
                            k,
                            k,
                            &MhaArgs {
                                key_padding_mask: masked.then_some(pad),
                                average_attn_weights: average,
                                backend: be,
                                ..MhaArgs::default()
                            },
                        )
                    };
                    let on = |t: &Tensor| t.to_dtype(dt)?.to_device(&dev);
                    let (o, w) = run(
                        &mha,
                        &on(&query)?,
                        &on(&key)?,
                        &pad.to_device(&dev)?,
                        Backend::Auto,
                    )?;
                    let f64s = |t: &Tensor| t.to_dtype(dt)?.to_dtype(DType::F64);
                    let (o64, w64) = run(&mha64, &f64s(&query)?, &f64s(&key)?, &pad, Backend::Reference)?;
                    let what = format!(
                        "self_attn={self_attn} N={n} L={l} S={s} extra keys {extra} {dt:?} masked={masked} average={average}"
                    );
                    let (w, w64) = (w.expect("weights"), w64.expect("weights"));
                    let want_w = match average {
                        true => vec![n, l, s + extra],
                        false => vec![n, h, l, s + extra],
                    };
                    assert_eq!(w.dims(), want_w.as_slice(), "{what}");
                    assert_eq!(o.dims(), [n, l, e], "{what}");
                    check(&o, &o64, dt, &dev, tol, &what)?;
                    check(&w, &w64, dt, &dev, tol, &format!("{what} weights"))?;
                }
            }
        }
    }
    Ok(())
}

/// Rotary embeddings and every kind of KV cache with an empty batch, no heads or no new
/// token. Narrowed empty tensors sit at an offset into no memory, which candle's copies
/// once indexed out of bounds.
#[test]
fn rope_and_kv_cache_with_zero_sized_dims_on_the_test_device() -> Result<()> {
    let dev = Device::cuda_if_available(0)?;
    for style in [RopeStyle::HalfSplit, RopeStyle::Interleaved] {
        let rope = RotaryEmbedding::new(&RopeConfig {
            head_dim: 8,
            rotary_dim: 6,
            theta: 1e4,
            style,
            scaling: RopeScaling::Default,
        })?;
        for (b, h, l) in [(1, 2, 0), (0, 2, 3), (2, 0, 3)] {
            let pos = Tensor::zeros((b, l), DType::I64, &dev)?;
            let (cos, sin) = rope.cos_sin(&pos, DType::F32)?;
            // A view at an offset: the second half of a (B, H, 2L, 8) tensor.
            let x = Tensor::zeros((b, h, 2 * l, 8), DType::F32, &dev)?.narrow(2, l, l)?;
            let y = rope.apply(&x, &cos, &sin)?;
            assert_eq!(y.dims(), [b, h, l, 8], "{style:?} B={b} H={h} L={l}");
        }
    }
    let filled = values(&[1, 2, 3, 4], 20)?.to_device(&dev)?;
    for kind in 0..3 {
        let new = || -> Result<KvCache> {
            Ok(match kind {
                0 => KvCache::new(),
                1 => KvCache::with_max_len(8),
                _ => KvCache::rotating(2)?,
            })
        };
        // No new token, on a fresh cache and after three tokens.
        let none = Tensor::zeros((1, 2, 0, 4), DType::F32, &dev)?;
        let view = new()?.append(&none, &none)?;
        assert_eq!(
            (view.k.dims(), view.positions.len()),
            ([1, 2, 0, 4].as_slice(), 0),
            "kind {kind}"
        );
        let mut cache = new()?;
        cache.append(&filled, &filled)?;
        let before = cache.current()?.expect("three tokens");
        let view = cache.append(&none, &none)?;
        assert_eq!(view.positions, before.positions, "kind {kind}");
        assert_eq!(
            max_diff(
                &view.k.to_device(&Device::Cpu)?,
                &before.k.to_device(&Device::Cpu)?
            )?,
            0.0
        );
        assert_eq!(cache.seen(), 3);
        // No heads and an empty batch, narrowed so that they sit at an offset.
        for shape in [[1, 0, 5, 4], [0, 2, 5, 4]] {
            let mut cache = new()?;
            let k = Tensor::zeros(&shape, DType::F32, &dev)?.narrow(2, 2, 3)?;
            cache.append(&k, &k)?;
            let view = cache.append(&k.narrow(2, 0, 1)?, &k.narrow(2, 0, 1)?)?;
            let held = if kind == 2 { 3 } else { 4 };
            assert_eq!(
                view.k.dims(),
                [shape[0], shape[1], held, 4],
                "kind {kind} {shape:?}"
            );
            assert_eq!(cache.seen(), 4);
        }
    }
    Ok(())
}

/// A decoder layer whose q, k and v are views into one packed projection (Phi-3), with
/// rope and q/k norms, on an empty batch or sequence, and a zero-length decoding step.
#[test]
fn decoder_layer_with_zero_sized_dims_on_the_test_device() -> Result<()> {
    let dev = Device::cuda_if_available(0)?;
    let (hidden, heads, kv_heads, hd) = (8, 2, 1, 4);
    let cfg = DecoderAttentionConfig {
        hidden_size: hidden,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim: hd,
        layout: QkvLayout::Packed {
            qkv: "qkv_proj".into(),
            o: "o_proj".into(),
            qkv_bias: true,
            o_bias: false,
        },
        qk_norm: Some(QkNorm {
            eps: 1e-6,
            unit_offset: false,
        }),
        rope: Some(RopeConfig {
            head_dim: hd,
            rotary_dim: hd,
            theta: 1e4,
            style: RopeStyle::HalfSplit,
            scaling: RopeScaling::Default,
        }),
        alibi: false,
        softcap: None,
        sinks: false,
        sliding_window: Some(2),
        bidirectional: false,
        scale: 0.5,
        cross_attention: false,
        max_position_embeddings: None,
    };
    let qkv = (heads + 2 * kv_heads) * hd;
    let mut m = HashMap::new();
    m.insert(
        "qkv_proj.weight".to_string(),
        values(&[qkv, hidden], 21)?.to_device(&dev)?,
    );
    m.insert("qkv_proj.bias".to_string(), values(&[qkv], 22)?.to_device(&dev)?);
    m.insert(
        "o_proj.weight".to_string(),
        values(&[hidden, heads * hd], 23)?.to_device(&dev)?,
    );
    m.insert("q_norm.weight".to_string(), values(&[hd], 24)?.to_device(&dev)?);
    m.insert("k_norm.weight".to_string(), values(&[hd], 25)?.to_device(&dev)?);
    let layer = DecoderAttention::new(&cfg, VarBuilder::from_tensors(m, DType::F32, &dev))?;
    for (b, l) in [(0, 2), (2, 0), (0, 0)] {
        let y = layer.forward(&Tensor::zeros((b, l, hidden), DType::F32, &dev)?)?;
        assert_eq!(y.dims(), [b, l, hidden]);
    }
    // Prefill three tokens, then a step of none: linear and rotating caches.
    let x = values(&[1, 3, hidden], 26)?.to_device(&dev)?;
    let pos = |from: i64, l: usize| Tensor::arange(from, from + l as i64, &dev)?.reshape((1, l));
    for mut cache in [KvCache::new(), layer.new_cache()?] {
        layer.forward_cached(&x, &pos(0, 3)?, None, Some(&mut cache))?;
        let y = layer.forward_cached(&x.narrow(1, 3, 0)?, &pos(3, 0)?, None, Some(&mut cache))?;
        assert_eq!(y.dims(), [1, 0, hidden]);
        assert_eq!(cache.seen(), 3);
    }
    Ok(())
}
