//! Decoder attention: cache equivalence, left padding, rope/alibi/softcap/sinks, errors.
mod common;
use std::collections::HashMap;

use candle_attention::alibi::alibi_slopes;
use candle_attention::decoder::{DecoderAttention, DecoderAttentionConfig, HfConfig, QkNorm, QkvLayout};
use candle_attention::{
    scaled_dot_product_attention, KvCache, RopeConfig, RopeScaling, RopeStyle, RotaryEmbedding, SdpaOptions,
};
use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::VarBuilder;
use common::{err_msg, max_diff, randn};

fn llama_like(window: Option<usize>) -> DecoderAttentionConfig {
    DecoderAttentionConfig {
        hidden_size: 24,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 8,
        layout: QkvLayout::separate(true, true, true, true),
        qk_norm: Some(QkNorm {
            eps: 1e-6,
            unit_offset: false,
        }),
        rope: Some(RopeConfig {
            head_dim: 8,
            rotary_dim: 8,
            theta: 100.0,
            style: RopeStyle::HalfSplit,
            scaling: RopeScaling::Llama3 {
                factor: 4.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 16.0,
            },
        }),
        alibi: false,
        softcap: Some(20.0),
        sinks: true,
        sliding_window: window,
        bidirectional: false,
        scale: 8f64.powf(-0.5),
        cross_attention: false,
        max_position_embeddings: Some(64),
    }
}

fn weights(cfg: &DecoderAttentionConfig) -> Result<VarBuilder<'static>> {
    Ok(VarBuilder::from_tensors(
        weight_map(cfg)?,
        DType::F32,
        &Device::Cpu,
    ))
}

fn weight_map(cfg: &DecoderAttentionConfig) -> Result<HashMap<String, Tensor>> {
    let (e, qd, kvd) = (
        cfg.hidden_size,
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
    );
    let mut m = HashMap::new();
    for (name, o, i) in [
        ("q_proj", qd, e),
        ("k_proj", kvd, e),
        ("v_proj", kvd, e),
        ("o_proj", e, qd),
    ] {
        m.insert(format!("{name}.weight"), (randn(&[o, i])? * 0.3)?);
        m.insert(format!("{name}.bias"), (randn(&[o])? * 0.3)?);
    }
    m.insert("q_norm.weight".into(), ((randn(&[cfg.head_dim])? * 0.1)? + 1.0)?);
    m.insert("k_norm.weight".into(), ((randn(&[cfg.head_dim])? * 0.1)? + 1.0)?);
    m.insert("sinks".into(), randn(&[cfg.num_heads])?);
    Ok(m)
}

fn positions(b: usize, from: usize, l: usize) -> Result<Tensor> {
    Tensor::arange(from as i64, (from + l) as i64, &Device::Cpu)?
        .unsqueeze(0)?
        .broadcast_as((b, l))?
        .contiguous()
}

/// Prefill `p` tokens, then decode the rest one by one; compare with one full forward.
fn prefill_then_decode(
    layer: &DecoderAttention,
    cache: &mut KvCache,
    x: &Tensor,
    p: usize,
) -> Result<Tensor> {
    let (b, n, _) = x.dims3()?;
    let mut outs =
        vec![layer.forward_cached(&x.narrow(1, 0, p)?, &positions(b, 0, p)?, None, Some(cache))?];
    for t in p..n {
        outs.push(layer.forward_cached(&x.narrow(1, t, 1)?, &positions(b, t, 1)?, None, Some(cache))?);
    }
    Tensor::cat(&outs, 1)
}

#[test]
fn prefill_plus_cached_steps_equals_one_full_forward() -> Result<()> {
    let cfg = llama_like(None);
    let layer = DecoderAttention::new(&cfg, weights(&cfg)?)?;
    let x = randn(&[2, 11, 24])?;
    let full = layer.forward(&x)?;
    for cache in [KvCache::new(), KvCache::with_max_len(11)] {
        let mut cache = cache;
        let inc = prefill_then_decode(&layer, &mut cache, &x, 4)?;
        assert!(max_diff(&full, &inc)? < 1e-5);
        assert_eq!((cache.len(), cache.seen()), (11, 11));
    }
    Ok(())
}

/// A bf16/f16 layer rounds q, k and v to its dtype as PyTorch's `nn.Linear` does, so its
/// cache holds K/V in that dtype (half the bytes of f32), with softcap and sinks and
/// without, and decoding still equals one full forward within the dtype's tolerance.
#[test]
fn half_precision_layers_cache_keys_and_values_in_their_dtype() -> Result<()> {
    for dt in [DType::BF16, DType::F16] {
        for extras in [false, true] {
            let mut cfg = llama_like(Some(5));
            if !extras {
                (cfg.softcap, cfg.sinks) = (None, false);
            }
            let mut m = weight_map(&cfg)?;
            for t in m.values_mut() {
                *t = t.to_dtype(dt)?;
            }
            let layer = DecoderAttention::new(&cfg, VarBuilder::from_tensors(m.clone(), dt, &Device::Cpu))?;
            let layer32 = DecoderAttention::new(&cfg, VarBuilder::from_tensors(m, DType::F32, &Device::Cpu))?;
            let x = randn(&[2, 9, 24])?.to_dtype(dt)?;
            let full = layer.forward(&x)?;
            assert_eq!(full.dtype(), dt);
            let mut cache = layer.new_cache()?;
            let inc = prefill_then_decode(&layer, &mut cache, &x, 4)?;
            let view = cache.current()?.expect("9 tokens are cached");
            assert_eq!(
                (view.k.dtype(), view.v.dtype()),
                (dt, dt),
                "{dt:?} extras {extras}"
            );
            let tol = if dt == DType::BF16 { 2e-2 } else { 5e-3 };
            // The f32 layer on weights and inputs rounded to `dt` is the accuracy bar.
            let want = layer32.forward(&x.to_dtype(DType::F32)?)?;
            let size = want.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?.max(1.0) as f64;
            for got in [&full, &inc] {
                let d = max_diff(got, &want)?;
                assert!(d < tol * size, "{dt:?} extras {extras}: {d} against {size}");
            }
        }
    }
    Ok(())
}

#[test]
fn truncate_then_decode_equals_the_full_forward_of_the_new_sequence() -> Result<()> {
    let cfg = llama_like(None);
    let layer = DecoderAttention::new(&cfg, weights(&cfg)?)?;
    let x = randn(&[1, 9, 24])?;
    let mut cache = KvCache::new();
    prefill_then_decode(&layer, &mut cache, &x, 5)?; // 9 tokens cached
    cache.truncate(6)?; // keep 6, then 3 different tokens
    let alt = randn(&[1, 3, 24])?;
    let mut outs = Vec::new();
    for t in 0..3 {
        outs.push(layer.forward_cached(
            &alt.narrow(1, t, 1)?,
            &positions(1, 6 + t, 1)?,
            None,
            Some(&mut cache),
        )?);
    }
    let seq = Tensor::cat(&[&x.narrow(1, 0, 6)?, &alt], 1)?;
    let full = layer.forward(&seq)?.narrow(1, 6, 3)?;
    assert!(max_diff(&full, &Tensor::cat(&outs, 1)?)? < 1e-5);
    assert!(err_msg(cache.truncate(10)).contains("10"));
    Ok(())
}

#[test]
fn rotating_cache_equals_the_full_sliding_window_forward() -> Result<()> {
    let cfg = llama_like(Some(3));
    let w = weights(&cfg)?;
    let layer = DecoderAttention::new(&cfg, w.clone())?;
    let x = randn(&[2, 12, 24])?;
    let full = layer.forward(&x)?;
    for p in [1, 2, 5] {
        let mut cache = layer.new_cache()?;
        assert_eq!(cache.window(), Some(3));
        let inc = prefill_then_decode(&layer, &mut cache, &x, p)?;
        assert!(max_diff(&full, &inc)? < 1e-5, "prefill {p}");
        assert_eq!(cache.len(), 3);
    }
    // The window matters: without it the output differs.
    let wide = DecoderAttention::new(&llama_like(None), w)?;
    assert!(max_diff(&full, &wide.forward(&x)?)? > 1e-3);
    Ok(())
}

#[test]
fn rotating_cache_truncates_only_as_far_as_it_remembers() -> Result<()> {
    let cfg = llama_like(Some(4));
    let layer = DecoderAttention::new(&cfg, weights(&cfg)?)?;
    let x = randn(&[1, 10, 24])?;
    let mut cache = layer.new_cache()?;
    prefill_then_decode(&layer, &mut cache, &x, 3)?; // holds positions 6..10
    cache.truncate(9)?; // needs 6..9: still held
    let y = layer.forward_cached(&x.narrow(1, 9, 1)?, &positions(1, 9, 1)?, None, Some(&mut cache))?;
    let full = layer.forward(&x)?.narrow(1, 9, 1)?;
    assert!(max_diff(&full, &y)? < 1e-5);
    let msg = err_msg(cache.truncate(5));
    assert!(msg.contains("evicted"), "{msg}");
    Ok(())
}

#[test]
fn left_padded_batch_equals_each_sequence_alone() -> Result<()> {
    let cfg = llama_like(Some(4));
    let w = weights(&cfg)?;
    for window in [None, Some(4)] {
        let layer = DecoderAttention::new(&llama_like(window), w.clone())?;
        // Row 0: 7 real tokens; row 1: 2 pads then 5 real tokens; then 3 decode steps.
        let (n, steps) = (7, 3);
        let x = randn(&[2, n + steps, 24])?;
        let mask_row = |pad: usize, len: usize| -> Vec<u8> { (0..len).map(|i| (i >= pad) as u8).collect() };
        let mask = |len: usize| {
            Tensor::from_vec(
                [mask_row(0, len), mask_row(2, len)].concat(),
                (2, len),
                &Device::Cpu,
            )
        };
        let pos = |from: usize, len: usize| -> Result<Tensor> {
            let r0: Vec<i64> = (from..from + len).map(|p| p as i64).collect();
            let r1: Vec<i64> = (from..from + len).map(|p| (p as i64 - 2).max(0)).collect();
            Tensor::from_vec([r0, r1].concat(), (2, len), &Device::Cpu)
        };
        let mut cache = layer.new_cache()?;
        let mut outs = vec![layer.forward_cached(
            &x.narrow(1, 0, n)?,
            &pos(0, n)?,
            Some(&mask(n)?),
            Some(&mut cache),
        )?];
        for t in n..n + steps {
            outs.push(layer.forward_cached(
                &x.narrow(1, t, 1)?,
                &pos(t, 1)?,
                Some(&mask(t + 1)?),
                Some(&mut cache),
            )?);
        }
        let batch = Tensor::cat(&outs, 1)?;
        let alone0 = layer.forward(&x.narrow(0, 0, 1)?)?;
        let alone1 = layer.forward(&x.narrow(0, 1, 1)?.narrow(1, 2, n + steps - 2)?)?;
        assert!(max_diff(&batch.narrow(0, 0, 1)?, &alone0)? < 1e-5, "{window:?}");
        assert!(
            max_diff(&batch.narrow(0, 1, 1)?.narrow(1, 2, n + steps - 2)?, &alone1)? < 1e-5,
            "{window:?}"
        );
    }
    Ok(())
}

#[test]
fn rope_rotates_pairs_by_position_times_frequency() -> Result<()> {
    let cfg = RopeConfig {
        head_dim: 6,
        rotary_dim: 4,
        theta: 10.0,
        style: RopeStyle::HalfSplit,
        scaling: RopeScaling::Default,
    };
    let rope = RotaryEmbedding::new(&cfg)?;
    let x = randn(&[1, 1, 3, 6])?;
    let pos = positions(1, 5, 3)?;
    let (cos, sin) = rope.cos_sin(&pos, DType::F32)?;
    let y = rope.apply(&x, &cos, &sin)?;
    let half = RotaryEmbedding::new(&RopeConfig {
        style: RopeStyle::Interleaved,
        ..cfg.clone()
    })?;
    let yi = half.apply(&x, &cos, &sin)?;
    let xv = x.flatten_all()?.to_vec1::<f32>()?;
    let (yv, yiv) = (
        y.flatten_all()?.to_vec1::<f32>()?,
        yi.flatten_all()?.to_vec1::<f32>()?,
    );
    for t in 0..3 {
        let p = (5 + t) as f64;
        let r = &xv[t * 6..t * 6 + 6];
        for i in 0..2 {
            let a = p * 10f64.powf(-(2.0 * i as f64) / 4.0);
            let (c, s) = (a.cos() as f32, a.sin() as f32);
            // half-split: pairs (i, i + 2)
            assert!((yv[t * 6 + i] - (r[i] * c - r[i + 2] * s)).abs() < 1e-5);
            assert!((yv[t * 6 + i + 2] - (r[i + 2] * c + r[i] * s)).abs() < 1e-5);
            // interleaved: pairs (2i, 2i + 1)
            assert!((yiv[t * 6 + 2 * i] - (r[2 * i] * c - r[2 * i + 1] * s)).abs() < 1e-5);
            assert!((yiv[t * 6 + 2 * i + 1] - (r[2 * i + 1] * c + r[2 * i] * s)).abs() < 1e-5);
        }
        // the last two dims pass through
        assert_eq!(&yv[t * 6 + 4..t * 6 + 6], &r[4..6]);
    }
    Ok(())
}

#[test]
fn rope_scalings_follow_their_rules() -> Result<()> {
    let base = RopeConfig {
        head_dim: 64,
        rotary_dim: 64,
        theta: 10000.0,
        style: RopeStyle::HalfSplit,
        scaling: RopeScaling::Default,
    };
    let plain = RotaryEmbedding::new(&base)?;
    let lin = RotaryEmbedding::new(&RopeConfig {
        scaling: RopeScaling::Linear { factor: 4.0 },
        ..base.clone()
    })?;
    for (a, b) in plain.inv_freq().iter().zip(lin.inv_freq()) {
        assert!((a / 4.0 - b).abs() < 1e-15);
    }
    let l3 = RotaryEmbedding::new(&RopeConfig {
        scaling: RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        },
        ..base.clone()
    })?;
    let two_pi = 2.0 * std::f64::consts::PI;
    for (a, b) in plain.inv_freq().iter().zip(l3.inv_freq()) {
        let wl = two_pi / a;
        if wl < 8192.0 / 4.0 {
            assert_eq!(a, b); // high frequency: kept
        } else if wl > 8192.0 {
            assert!((a / 8.0 - b).abs() < 1e-15); // low frequency: divided by factor
        } else {
            assert!(*b < *a && *b > a / 8.0); // in between
        }
    }
    let yarn = RotaryEmbedding::new(&RopeConfig {
        scaling: RopeScaling::Yarn {
            factor: 32.0,
            original_max_position_embeddings: 4096.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: None,
            mscale: None,
            mscale_all_dim: None,
            truncate: false,
        },
        ..base.clone()
    })?;
    assert!((yarn.attention_scaling() - (0.1 * 32f64.ln() + 1.0)).abs() < 1e-12);
    let (f0, fl) = (yarn.inv_freq()[0], *yarn.inv_freq().last().unwrap());
    assert_eq!(f0, plain.inv_freq()[0]); // fastest dims extrapolate
    assert!((fl - plain.inv_freq().last().unwrap() / 32.0).abs() < 1e-18); // slowest interpolate
    assert!(err_msg(RotaryEmbedding::new(&RopeConfig {
        rotary_dim: 7,
        ..base.clone()
    }))
    .contains('7'));
    assert!(err_msg(RotaryEmbedding::new(&RopeConfig { theta: 0.5, ..base })).contains("rope_theta"));
    Ok(())
}

#[test]
fn alibi_slopes_follow_the_bloom_rule() -> Result<()> {
    // Powers of two: the geometric series 2^(-8k/n).
    for n in [1usize, 2, 4, 8, 16] {
        let s = alibi_slopes(n)?;
        for (k, v) in s.iter().enumerate() {
            assert!(
                (v - 2f64.powf(-8.0 * (k + 1) as f64 / n as f64)).abs() < 1e-15,
                "n {n}"
            );
        }
    }
    // Otherwise: the series for the power of two below, then odd terms of the series for twice that.
    let s6 = alibi_slopes(6)?;
    let (s4, s8) = (alibi_slopes(4)?, alibi_slopes(8)?);
    assert_eq!(&s6[..4], &s4[..]);
    assert_eq!(s6[4], s8[0]);
    assert_eq!(s6[5], s8[2]);
    Ok(())
}

#[test]
fn sinks_and_softcap_change_the_softmax_as_specified() -> Result<()> {
    let (q, k, v) = (
        randn(&[1, 2, 3, 4])?,
        randn(&[1, 2, 5, 4])?,
        randn(&[1, 2, 5, 4])?,
    );
    let scale = 0.5;
    let plain = scaled_dot_product_attention(
        &q,
        &k,
        &v,
        &SdpaOptions::new().with_scale(scale).with_weights(true),
    )?;
    let sinks = Tensor::new(&[0.3f32, -1.2], &Device::Cpu)?;
    let with = scaled_dot_product_attention(
        &q,
        &k,
        &v,
        &SdpaOptions::new()
            .with_scale(scale)
            .with_weights(true)
            .with_sinks(sinks.clone()),
    )?;
    // Each row keeps the plain distribution, scaled by Z / (Z + e^sink).
    let scores = (q.matmul(&k.t()?)? * scale)?;
    let z = scores.exp()?.sum_keepdim(D::Minus1)?; // (1, 2, 3, 1)
    let es = sinks.exp()?.reshape((1, 2, 1, 1))?;
    let factor = z.broadcast_div(&z.broadcast_add(&es)?)?;
    let want = plain.weights.unwrap().broadcast_mul(&factor)?;
    assert!(max_diff(&with.weights.unwrap(), &want)? < 1e-6);
    // Softcap: weights = softmax(cap · tanh(scores / cap)).
    let cap = 1.5;
    let capped = scaled_dot_product_attention(
        &q,
        &k,
        &v,
        &SdpaOptions::new()
            .with_scale(scale)
            .with_weights(true)
            .with_softcap(cap),
    )?;
    let want = candle_nn::ops::softmax_last_dim(&((scores / cap)?.tanh()? * cap)?)?;
    assert!(max_diff(&capped.weights.unwrap(), &want)? < 1e-6);
    assert!(err_msg(scaled_dot_product_attention(
        &q,
        &k,
        &v,
        &SdpaOptions::new().with_softcap(0.0)
    ))
    .contains("softcap"));
    let bad = Tensor::new(&[1f32, 2., 3.], &Device::Cpu)?;
    assert!(err_msg(scaled_dot_product_attention(
        &q,
        &k,
        &v,
        &SdpaOptions::new().with_sinks(bad)
    ))
    .contains("[3]"));
    Ok(())
}

#[test]
fn fixed_cache_overflow_is_an_error() -> Result<()> {
    let cfg = llama_like(None);
    let layer = DecoderAttention::new(&cfg, weights(&cfg)?)?;
    let mut cache = KvCache::with_max_len(5);
    let x = randn(&[1, 4, 24])?;
    layer.forward_cached(&x, &positions(1, 0, 4)?, None, Some(&mut cache))?;
    let msg =
        err_msg(layer.forward_cached(&x.narrow(1, 0, 2)?, &positions(1, 4, 2)?, None, Some(&mut cache)));
    assert!(msg.contains("overflow") && msg.contains('5'), "{msg}");
    Ok(())
}

#[test]
fn bad_positions_and_masks_are_errors() -> Result<()> {
    let cfg = llama_like(None);
    let layer = DecoderAttention::new(&cfg, weights(&cfg)?)?;
    let x = randn(&[1, 3, 24])?;
    let neg = Tensor::new(&[[0i64, -1, 2]], &Device::Cpu)?;
    assert!(err_msg(layer.forward_cached(&x, &neg, None, None)).contains("out of range"));
    let big = Tensor::new(&[[0i64, 1, 64]], &Device::Cpu)?;
    let msg = err_msg(layer.forward_cached(&x, &big, None, None));
    assert!(msg.contains("out of range") && msg.contains("64"), "{msg}");
    let msg = err_msg(layer.forward_cached(&x, &positions(1, 0, 2)?, None, None));
    assert!(msg.contains("[1, 2]"), "{msg}");
    let am = Tensor::ones((1, 4), DType::U8, &Device::Cpu)?;
    let msg = err_msg(layer.forward_cached(&x, &positions(1, 0, 3)?, Some(&am), None));
    assert!(msg.contains("[1, 4]"), "{msg}");
    let msg = err_msg(layer.forward(&randn(&[1, 3, 25])?));
    assert!(msg.contains("[1, 3, 25]"), "{msg}");
    Ok(())
}

fn hf(json: &str) -> HfConfig {
    HfConfig::from_json(json).unwrap()
}

/// Layer 0 of `arch` with E=32, H=4, Hkv=2 and the config.json keys in `extra` (empty or
/// starting with a comma).
fn small(arch: &str, extra: &str) -> Result<DecoderAttentionConfig> {
    let base = r#""hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2"#;
    layer_of(arch, base, extra, 0)
}

/// Layer `layer_idx` of `arch` from the config.json object `{base extra}` (`extra` empty or
/// starting with a comma).
fn layer_of(arch: &str, base: &str, extra: &str, layer_idx: usize) -> Result<DecoderAttentionConfig> {
    DecoderAttentionConfig::from_hf(arch, &hf(&format!("{{{base}{extra}}}")), layer_idx, false)
}

#[test]
fn hf_config_errors_name_the_problem() -> Result<()> {
    let ok =
        r#"{"hidden_size": 24, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0}"#;
    DecoderAttentionConfig::from_hf("llama", &hf(ok), 0, false)?;
    let msg = err_msg(DecoderAttentionConfig::from_hf("mamba", &hf(ok), 0, false));
    assert!(
        msg.contains("unknown architecture 'mamba'") && msg.contains("llama"),
        "{msg}"
    );
    let msg = err_msg(DecoderAttentionConfig::from_hf(
        "llama",
        &hf(r#"{"num_attention_heads": 4}"#),
        0,
        false,
    ));
    assert!(msg.contains("missing field 'hidden_size'"), "{msg}");
    // A missing rope_theta takes the config class's default (see hf_config_defaults.json);
    // a scaled rope without its factor is an error.
    let msg = err_msg(DecoderAttentionConfig::from_hf(
        "llama",
        &hf(r#"{"hidden_size": 24, "num_attention_heads": 4, "rope_scaling": {"rope_type": "linear"}}"#),
        0,
        false,
    ));
    assert!(msg.contains("rope_parameters.factor"), "{msg}");
    let bad_heads =
        r#"{"hidden_size": 24, "num_attention_heads": 4, "num_key_value_heads": 3, "rope_theta": 1e4}"#;
    let msg = err_msg(DecoderAttentionConfig::from_hf("llama", &hf(bad_heads), 0, false));
    assert!(msg.contains("num_key_value_heads 3"), "{msg}");
    let msg = err_msg(DecoderAttentionConfig::from_hf("gemma2", &hf(ok), 0, false));
    assert!(msg.contains("query_pre_attn_scalar"), "{msg}");
    let msg = err_msg(DecoderAttentionConfig::from_hf("llama", &hf(ok), 0, true));
    assert!(msg.contains("cross-attention"), "{msg}");
    let mut cfg = llama_like(None);
    cfg.num_kv_heads = 3;
    let msg = err_msg(DecoderAttention::new(&cfg, weights(&llama_like(None))?));
    assert!(msg.contains("num_kv_heads (3)"), "{msg}");
    Ok(())
}

#[test]
fn both_rope_spellings_give_the_same_layer() -> Result<()> {
    let old = r#"{"hidden_size": 32, "num_attention_heads": 4, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}}"#;
    let new = r#"{"hidden_size": 32, "num_attention_heads": 4,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}"#;
    let a = DecoderAttentionConfig::from_hf("llama", &hf(old), 0, false)?;
    let b = DecoderAttentionConfig::from_hf("llama", &hf(new), 0, false)?;
    assert_eq!(a, b);
    assert!(matches!(a.rope.unwrap().scaling, RopeScaling::Llama3 { .. }));
    Ok(())
}

/// `partial_rotary_factor` as Hugging Face's modeling code reads it: GPT-NeoX (from its rope
/// parameters, else `rotary_pct`) and Phi-3 rotate that share of the head; Llama, Mistral
/// and Qwen2 ignore it and rotate the whole head.
#[test]
fn partial_rotary_follows_each_architectures_modeling() -> Result<()> {
    let rot = |arch: &str, json: &str| -> Result<usize> {
        let cfg = DecoderAttentionConfig::from_hf(arch, &hf(json), 0, false)?;
        Ok(cfg.rope.expect("a rope layer").rotary_dim)
    };
    let top =
        r#"{"hidden_size": 32, "num_attention_heads": 4, "rope_theta": 1e4, "partial_rotary_factor": 0.5}"#;
    let nested = r#"{"hidden_size": 32, "num_attention_heads": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}"#;
    for json in [top, nested] {
        for arch in ["llama", "mistral", "qwen2"] {
            assert_eq!(rot(arch, json)?, 8, "{arch}");
        }
        assert_eq!(rot("phi3", json)?, 4);
    }
    // GPTNeoXConfig reads the factor from the rope parameters or `rotary_pct` (default
    // 0.25), never from a top-level `partial_rotary_factor` (hf_config_defaults.json).
    assert_eq!(rot("gpt_neox", nested)?, 4);
    assert_eq!(rot("gpt_neox", top)?, 2);
    let pct = r#"{"hidden_size": 32, "num_attention_heads": 4, "rope_theta": 1e4, "rotary_pct": 0.25}"#;
    assert_eq!(rot("gpt_neox", pct)?, 2);
    Ok(())
}

#[test]
fn growable_cache_doubles_its_buffer() -> Result<()> {
    let mut cache = KvCache::new();
    let kv = randn(&[1, 2, 1, 4])?;
    let mut caps = Vec::new();
    for _ in 0..100 {
        cache.append(&kv, &kv)?;
        if caps.last() != Some(&cache.capacity()) {
            caps.push(cache.capacity());
        }
    }
    // Four reallocations for 100 tokens: each copies the tokens held so far once.
    assert_eq!(caps, vec![16, 32, 64, 128]);
    let all = cache.current()?.unwrap();
    assert_eq!(all.k.dims(), &[1, 2, 100, 4]);
    assert_eq!(max_diff(&all.k.narrow(2, 57, 1)?, &kv)?, 0.0);
    // A clone is independent of the original.
    let mut other = cache.clone();
    other.truncate(10)?;
    other.append(&(&kv + 1.0)?, &kv)?;
    assert_eq!(
        max_diff(&cache.current()?.unwrap().k.narrow(2, 10, 1)?, &kv)?,
        0.0
    );
    Ok(())
}

#[test]
fn packed_and_head_interleaved_layouts_equal_separate_projections() -> Result<()> {
    let mut cfg = llama_like(None);
    cfg.num_kv_heads = 4;
    cfg.qk_norm = None;
    cfg.sinks = false;
    let sep = weights(&cfg)?;
    let get = |k: &str| sep.get_unchecked_dtype(k, DType::F32);
    let (wq, wk, wv) = (
        get("q_proj.weight")?,
        get("k_proj.weight")?,
        get("v_proj.weight")?,
    );
    let (bq, bk, bv) = (get("q_proj.bias")?, get("k_proj.bias")?, get("v_proj.bias")?);
    let (wo, bo) = (get("o_proj.weight")?, get("o_proj.bias")?);
    let x = randn(&[2, 5, 24])?;
    let want = DecoderAttention::new(&cfg, sep.clone())?.forward(&x)?;
    // Phi-3: [q | k | v].
    let mut m = HashMap::new();
    m.insert("qkv_proj.weight".to_string(), Tensor::cat(&[&wq, &wk, &wv], 0)?);
    m.insert("qkv_proj.bias".to_string(), Tensor::cat(&[&bq, &bk, &bv], 0)?);
    m.insert("o_proj.weight".to_string(), wo.clone());
    m.insert("o_proj.bias".to_string(), bo.clone());
    let packed = DecoderAttentionConfig {
        layout: QkvLayout::Packed {
            qkv: "qkv_proj".into(),
            o: "o_proj".into(),
            qkv_bias: true,
            o_bias: true,
        },
        ..cfg.clone()
    };
    let got =
        DecoderAttention::new(&packed, VarBuilder::from_tensors(m, DType::F32, &Device::Cpu))?.forward(&x)?;
    assert!(max_diff(&got, &want)? < 1e-5);
    // GPT-NeoX / BLOOM: per head [q | k | v].
    let per_head = |q: &Tensor, k: &Tensor, v: &Tensor| -> Result<Tensor> {
        let (h, d) = (4, 8);
        let split = |t: &Tensor| -> Result<Tensor> {
            let rest: Vec<usize> = t.dims()[1..].to_vec();
            t.reshape([vec![h, 1, d], rest].concat())
        };
        let cat = Tensor::cat(&[split(q)?, split(k)?, split(v)?], 1)?;
        let rest: Vec<usize> = q.dims()[1..].to_vec();
        cat.reshape([vec![3 * h * d], rest].concat())
    };
    let mut m = HashMap::new();
    m.insert("query_key_value.weight".to_string(), per_head(&wq, &wk, &wv)?);
    m.insert("query_key_value.bias".to_string(), per_head(&bq, &bk, &bv)?);
    m.insert("dense.weight".to_string(), wo);
    m.insert("dense.bias".to_string(), bo);
    let inter = DecoderAttentionConfig {
        layout: QkvLayout::HeadInterleaved {
            qkv: "query_key_value".into(),
            o: "dense".into(),
            bias: true,
        },
        ..cfg
    };
    let got =
        DecoderAttention::new(&inter, VarBuilder::from_tensors(m, DType::F32, &Device::Cpu))?.forward(&x)?;
    assert!(max_diff(&got, &want)? < 1e-5);
    Ok(())
}

/// How `rope` differs from what transformers' rope init function reads from `want` (one
/// layer's effective `rope_parameters`): theta, the rope type, and that type's parameters.
fn rope_differences(want: &serde_json::Value, rope: Option<&RopeConfig>) -> Vec<String> {
    let Some(rope) = rope else {
        return vec!["no rope".into()];
    };
    let f = |key: &str| want.get(key).and_then(serde_json::Value::as_f64);
    let mut out = Vec::new();
    let mut same = |key: &str, got: Option<f64>, want: Option<f64>| {
        if want.is_some() && got != want {
            out.push(format!("{key}: got {got:?}, transformers {want:?}"));
        }
    };
    same("rope_theta", Some(rope.theta), f("rope_theta"));
    if let Some(p) = f("partial_rotary_factor") {
        let want_dim = (rope.head_dim as f64 * p) as usize;
        same("rotary_dim", Some(rope.rotary_dim as f64), Some(want_dim as f64));
    }
    let kind = want["rope_type"].as_str().unwrap_or("<missing>");
    match (kind, &rope.scaling) {
        ("default", RopeScaling::Default) => {}
        ("linear", RopeScaling::Linear { factor }) => same("factor", Some(*factor), f("factor")),
        // Its `max_position_embeddings` is the config's; the recorded calls of transformers'
        // rotary module past it check that (tests/rope_by_length.rs).
        ("dynamic", RopeScaling::DynamicNtk { factor, .. }) => same("factor", Some(*factor), f("factor")),
        (
            "llama3",
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            },
        ) => {
            same("factor", Some(*factor), f("factor"));
            same("low_freq_factor", Some(*low_freq_factor), f("low_freq_factor"));
            same("high_freq_factor", Some(*high_freq_factor), f("high_freq_factor"));
            same(
                "original_max_position_embeddings",
                Some(*original_max_position_embeddings),
                f("original_max_position_embeddings"),
            );
        }
        (
            "yarn",
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                attention_factor,
                mscale,
                mscale_all_dim,
                truncate,
            },
        ) => {
            same("factor", Some(*factor), f("factor"));
            same(
                "original_max_position_embeddings",
                Some(*original_max_position_embeddings),
                f("original_max_position_embeddings"),
            );
            same("beta_fast", Some(*beta_fast), f("beta_fast"));
            same("beta_slow", Some(*beta_slow), f("beta_slow"));
            same("attention_factor", *attention_factor, f("attention_factor"));
            same("mscale", *mscale, f("mscale"));
            same("mscale_all_dim", *mscale_all_dim, f("mscale_all_dim"));
            let want_truncate = want
                .get("truncate")
                .and_then(serde_json::Value::as_bool)
                .unwrap_or(true);
            if *truncate != want_truncate {
                out.push(format!("truncate: got {truncate}, transformers {want_truncate}"));
            }
        }
        (
            "longrope",
            RopeScaling::LongRope {
                short_factor,
                long_factor,
                original_max_position_embeddings,
                factor,
                attention_factor,
            },
        ) => {
            same(
                "original_max_position_embeddings",
                Some(*original_max_position_embeddings),
                f("original_max_position_embeddings"),
            );
            // Without `factor`, transformers derives it from max_position_embeddings, which
            // the rope parameters do not hold: `tests/rope_by_length.rs` checks the resulting
            // attention scaling against transformers' rotary module.
            same("factor", Some(*factor), f("factor"));
            same("attention_factor", *attention_factor, f("attention_factor"));
            for (key, got) in [("short_factor", short_factor), ("long_factor", long_factor)] {
                let want: Option<Vec<f64>> = want[key]
                    .as_array()
                    .map(|a| a.iter().filter_map(serde_json::Value::as_f64).collect());
                if want.as_ref() != Some(got) {
                    out.push(format!("{key}: got {got:?}, transformers {want:?}"));
                }
            }
        }
        (kind, got) => out.push(format!("rope_type: got {got:?}, transformers '{kind}'")),
    }
    out
}

/// `weights/hf_config_defaults.json` is written by `scripts/export_fixtures.py` from
/// transformers' config classes and attention modules: for config.json files as hub
/// checkpoints have them (most without `layer_types`), each layer's sliding window and rope
/// as transformers uses them. `from_hf` must give the same for every layer.
#[test]
fn hf_configs_without_layer_types_give_each_layer_what_transformers_derives() -> Result<()> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("weights/hf_config_defaults.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let doc: serde_json::Value = serde_json::from_str(&text).expect("hf_config_defaults.json is JSON");
    assert_eq!(doc["format"], "candle-attention-hf-config-defaults/1");
    let cases = doc["cases"].as_array().expect("a list of cases");
    assert!(cases.len() >= 10, "{} cases", cases.len());
    let mut failures = Vec::new();
    let mut layers_checked = 0;
    for case in cases {
        let (arch, name) = (
            case["architecture"].as_str().unwrap(),
            case["name"].as_str().unwrap(),
        );
        let cfg = HfConfig::from_json(&case["config"].to_string())?;
        for (i, want) in case["layers"].as_array().unwrap().iter().enumerate() {
            layers_checked += 1;
            let got = match DecoderAttentionConfig::from_hf(arch, &cfg, i, false) {
                Ok(got) => got,
                Err(e) => {
                    failures.push(format!("{name} layer {i}: error {e}"));
                    continue;
                }
            };
            let want_window = want["sliding_window"].as_u64().map(|w| w as usize);
            if got.sliding_window != want_window {
                failures.push(format!(
                    "{name} layer {i} ({}): sliding_window {:?}, transformers {want_window:?}",
                    want["layer_type"], got.sliding_window
                ));
            }
            let want_bidirectional = want["bidirectional"].as_bool().unwrap_or(false);
            if got.bidirectional != want_bidirectional {
                failures.push(format!(
                    "{name} layer {i} ({}): bidirectional {}, transformers {want_bidirectional}",
                    want["layer_type"], got.bidirectional
                ));
            }
            for d in rope_differences(&want["rope"], got.rope.as_ref()) {
                failures.push(format!("{name} layer {i} ({}): {d}", want["layer_type"]));
            }
        }
    }
    assert!(layers_checked >= 40, "{layers_checked} layers");
    assert!(
        failures.is_empty(),
        "{} of {layers_checked} layers differ from transformers {}:\n{}",
        failures.len(),
        doc["transformers_version"],
        failures.join("\n")
    );
    Ok(())
}

/// Values for which transformers divides by zero or scales by infinity are errors that name
/// the architecture, the key and the value.
#[test]
fn gemma_sliding_window_pattern_and_query_pre_attn_scalar_are_checked() -> Result<()> {
    let gemma = |extra: &str| {
        hf(&format!(
            r#"{{"hidden_size": 32, "num_attention_heads": 4, "head_dim": 8, "rope_theta": 1e6,
                "sliding_window": 512, "query_pre_attn_scalar": 8{extra}}}"#
        ))
    };
    let msg = err_msg(DecoderAttentionConfig::from_hf(
        "gemma3_text",
        &gemma(r#", "sliding_window_pattern": 0"#),
        0,
        false,
    ));
    assert!(
        msg.contains("gemma3_text") && msg.contains("sliding_window_pattern"),
        "{msg}"
    );
    let one = DecoderAttentionConfig::from_hf(
        "gemma3_text",
        &gemma(r#", "sliding_window_pattern": 1"#),
        0,
        false,
    )?;
    assert_eq!(one.sliding_window, None, "a pattern of 1 makes every layer full");
    // transformers would silently ignore a flat rope_parameters for Gemma 3; we refuse it.
    let flat = r#", "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}"#;
    let msg = err_msg(DecoderAttentionConfig::from_hf(
        "gemma3_text",
        &gemma(flat),
        0,
        false,
    ));
    assert!(
        msg.contains("gemma3_text") && msg.contains("rope_parameters"),
        "{msg}"
    );
    for arch in ["gemma2", "gemma3_text"] {
        for bad in ["0", "-4.0", "0.0"] {
            let mut cfg = gemma("");
            cfg.query_pre_attn_scalar = Some(bad.parse().unwrap());
            let msg = err_msg(DecoderAttentionConfig::from_hf(arch, &cfg, 0, false));
            assert!(
                msg.contains(arch)
                    && msg.contains("query_pre_attn_scalar")
                    && msg.contains(bad.trim_end_matches(".0")),
                "{arch} {bad}: {msg}"
            );
        }
        for bad in [f64::NAN, f64::INFINITY] {
            let mut cfg = gemma("");
            cfg.query_pre_attn_scalar = Some(bad);
            let msg = err_msg(DecoderAttentionConfig::from_hf(arch, &cfg, 0, false));
            assert!(
                msg.contains("query_pre_attn_scalar") && msg.contains(&format!("{bad}")),
                "{arch} {bad}: {msg}"
            );
        }
        let cfg = DecoderAttentionConfig::from_hf(arch, &gemma(""), 0, false)?;
        assert_eq!(cfg.scale, 1.0 / 8f64.sqrt());
    }
    Ok(())
}

/// transformers 5.25's `Gemma3Attention` keeps `attn_logit_softcapping` but never passes it
/// to its attention function, where `Gemma2Attention` does; a randomised comparison with
/// transformers found the crate capping Gemma 3's logits. So only Gemma 2 applies it.
#[test]
fn attn_logit_softcapping_applies_to_gemma2_only() -> Result<()> {
    let cfg = hf(
        r#"{"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "rope_theta": 10000.0, "query_pre_attn_scalar": 8,
        "attn_logit_softcapping": 50.0, "sliding_window": 4}"#,
    );
    assert_eq!(
        DecoderAttentionConfig::from_hf("gemma2", &cfg, 0, false)?.softcap,
        Some(50.0)
    );
    assert_eq!(
        DecoderAttentionConfig::from_hf("gemma3_text", &cfg, 0, false)?.softcap,
        None
    );
    Ok(())
}

/// An absent `sliding_window` key, `null` and a number are three different configs: the
/// absent key takes the config class's default (checked per architecture against
/// transformers in `hf_config_defaults.json`), `null` means no window. Serializing keeps
/// the difference.
#[test]
fn absent_null_and_numeric_sliding_window_stay_distinct() -> Result<()> {
    let base = r#""hidden_size": 32, "num_attention_heads": 4, "rope_theta": 10000.0"#;
    let absent = hf(&format!("{{{base}}}"));
    let null = hf(&format!(r#"{{{base}, "sliding_window": null}}"#));
    let eight = hf(&format!(r#"{{{base}, "sliding_window": 8}}"#));
    assert_eq!(absent.sliding_window, None);
    assert_eq!(null.sliding_window, Some(None));
    assert_eq!(eight.sliding_window, Some(Some(8)));
    let window =
        |cfg: &HfConfig| DecoderAttentionConfig::from_hf("mistral", cfg, 0, false).map(|c| c.sliding_window);
    assert_eq!(window(&absent)?, Some(4096));
    assert_eq!(window(&null)?, None);
    assert_eq!(window(&eight)?, Some(8));
    for cfg in [&absent, &null, &eight] {
        let text = serde_json::to_string(cfg).expect("HfConfig serializes");
        assert_eq!(&HfConfig::from_json(&text)?, cfg, "{text}");
    }
    Ok(())
}

/// Gemma 3's `use_bidirectional_attention` (EmbeddingGemma): every layer attends both
/// ways, a sliding layer to the tokens less than `sliding_window / 2 + 1` positions away
/// (`Gemma3TextConfig` halves the window; the `hf_attention` bidirectional fixtures check
/// the outputs against transformers). A cache, a window of 0 and the flag on Gemma 2 are
/// errors; other architectures have no such key and ignore it.
#[test]
fn bidirectional_layers_attend_both_ways_within_the_window() -> Result<()> {
    let base = r#""hidden_size": 24, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "query_pre_attn_scalar": 8, "rope_theta": 100.0,
        "use_bidirectional_attention": true,
        "layer_types": ["sliding_attention", "full_attention"]"#;
    let layer = |extra: &str, arch: &str, idx: usize| layer_of(arch, base, extra, idx);
    let got = |c: DecoderAttentionConfig| (c.bidirectional, c.sliding_window);
    assert_eq!(
        got(layer(r#", "sliding_window": 512"#, "gemma3_text", 0)?),
        (true, Some(257))
    );
    assert_eq!(
        got(layer(r#", "sliding_window": 7"#, "gemma3_text", 0)?),
        (true, Some(4))
    );
    assert_eq!(got(layer("", "gemma3_text", 0)?), (true, Some(2049)));
    // transformers saves a window of 1 as (1 - 1) * 2 = 0, which halves to 1 again; without
    // the flag, a window of 0 is an error.
    assert_eq!(
        got(layer(r#", "sliding_window": 0"#, "gemma3_text", 0)?),
        (true, Some(1))
    );
    let causal = base.replace(
        r#""use_bidirectional_attention": true"#,
        r#""use_bidirectional_attention": false"#,
    );
    let e = err_msg(DecoderAttentionConfig::from_hf(
        "gemma3_text",
        &hf(&format!(r#"{{{causal}, "sliding_window": 0}}"#)),
        0,
        false,
    ));
    assert!(e.contains("sliding_window must be at least 1"), "{e}");
    assert_eq!(
        got(layer(r#", "sliding_window": null"#, "gemma3_text", 0)?),
        (true, None)
    );
    assert_eq!(
        got(layer(r#", "sliding_window": 512"#, "gemma3_text", 1)?),
        (true, None)
    );
    assert_eq!(
        got(layer(r#", "sliding_window": 512"#, "llama", 0)?),
        (false, None)
    );
    assert_eq!(
        got(layer(r#", "sliding_window": 512"#, "mistral", 0)?),
        (false, Some(512))
    );
    let e = err_msg(layer(r#", "sliding_window": 512"#, "gemma2", 0));
    assert!(
        e.contains("use_bidirectional_attention is not supported for gemma2"),
        "{e}"
    );

    // Which outputs a change of token 5 reaches: |i - 5| < 3 with a window of 3, all of
    // them without one.
    let x = randn(&[1, 10, 24])?;
    let bump = x.narrow(1, 5, 1)?.affine(1.0, 0.5)?;
    let x2 = Tensor::cat(&[x.narrow(1, 0, 5)?, bump, x.narrow(1, 6, 4)?], 1)?;
    for (window, reached) in [(Some(3), vec![3, 4, 5, 6, 7]), (None, (0..10).collect())] {
        let cfg = DecoderAttentionConfig {
            bidirectional: true,
            ..llama_like(window)
        };
        let attn = DecoderAttention::new(&cfg, weights(&cfg)?)?;
        let diff = (attn.forward(&x2)? - attn.forward(&x)?)?
            .abs()?
            .max(D::Minus1)?
            .squeeze(0)?;
        let moved: Vec<usize> = diff
            .to_vec1::<f32>()?
            .iter()
            .enumerate()
            .filter(|(_, &d)| d > 1e-6)
            .map(|(i, _)| i)
            .collect();
        assert_eq!(moved, reached, "window {window:?}");
        let e = err_msg(attn.new_cache());
        assert!(e.contains("bidirectional layer attends to later tokens"), "{e}");
        let mut cache = KvCache::new();
        let e = err_msg(attn.forward_cached(&x, &positions(1, 0, 10)?, None, Some(&mut cache)));
        assert!(e.contains("runs without a KV cache"), "{e}");
    }
    let cfg = DecoderAttentionConfig {
        bidirectional: true,
        ..llama_like(Some(0))
    };
    let attn = DecoderAttention::new(&cfg, weights(&cfg)?)?;
    let e = err_msg(attn.forward(&x));
    assert!(e.contains("sliding window must be at least 1 key"), "{e}");
    Ok(())
}

/// Mixtral and Gemma (1) load like Mistral and Llama, with their config classes' defaults
/// (transformers 5.25): Gemma's `head_dim` is 256 when config.json has none, whatever
/// `hidden_size / num_attention_heads` is; Mistral, Mixtral and Phi-3 build their
/// projections without biases whatever `attention_bias` says. (The `hf_attention` fixtures
/// `mixtral_*` and `gemma_*`, and `hf_config_defaults.json`, check the rest.)
#[test]
fn mixtral_and_gemma_follow_their_config_classes() -> Result<()> {
    let base = r#""hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 1"#;
    let cfg = |arch: &str, extra: &str| layer_of(arch, base, extra, 0);
    assert_eq!(cfg("gemma", "")?.head_dim, 256);
    assert_eq!(cfg("gemma", r#", "head_dim": 16"#)?.head_dim, 16);
    assert_eq!(cfg("gemma", "")?.scale, 1.0 / 16.0);
    assert_eq!(cfg("mixtral", "")?.head_dim, 8);
    let no_bias = QkvLayout::separate(false, false, false, false);
    for arch in ["mistral", "mixtral"] {
        assert_eq!(
            cfg(arch, r#", "attention_bias": true"#)?.layout,
            no_bias,
            "{arch}"
        );
    }
    for arch in ["llama", "gemma"] {
        let biased = QkvLayout::separate(true, true, true, true);
        assert_eq!(cfg(arch, r#", "attention_bias": true"#)?.layout, biased, "{arch}");
    }
    let phi3 = cfg("phi3", r#", "attention_bias": true"#)?;
    assert!(
        matches!(
            phi3.layout,
            QkvLayout::Packed {
                qkv_bias: false,
                o_bias: false,
                ..
            }
        ),
        "{:?}",
        phi3.layout
    );
    let e = err_msg(cfg("gemma", r#", "use_bidirectional_attention": true"#));
    assert!(
        e.contains("use_bidirectional_attention is not supported for gemma"),
        "{e}"
    );
    Ok(())
}

/// Qwen2-MoE reads `qkv_bias` (default true; never a bias on o) and Qwen3-MoE
/// `attention_bias`; an explicit sliding `layer_types` entry without `use_sliding_window`
/// is an error for Qwen2-MoE, whose config class sets that window to 0. (The
/// `hf_attention` fixtures `qwen2_moe_*` and `qwen3_moe_*`, and `hf_config_defaults.json`,
/// check the windows, norms and ropes against transformers.)
#[test]
fn qwen_moe_biases_and_windows_follow_their_config_classes() -> Result<()> {
    let cfg = small;
    let qkv = |b: bool| QkvLayout::separate(b, b, b, false);
    assert_eq!(cfg("qwen2_moe", "")?.layout, qkv(true));
    assert_eq!(cfg("qwen2_moe", r#", "qkv_bias": false"#)?.layout, qkv(false));
    assert_eq!(cfg("qwen2", r#", "qkv_bias": false"#)?.layout, qkv(true));
    let all = |b: bool| QkvLayout::separate(b, b, b, b);
    assert_eq!(cfg("qwen3_moe", "")?.layout, all(false));
    assert_eq!(cfg("qwen3_moe", r#", "attention_bias": true"#)?.layout, all(true));
    assert!(cfg("qwen3_moe", "")?.qk_norm.is_some());
    let e = err_msg(cfg("qwen2_moe", r#", "layer_types": ["sliding_attention"]"#));
    assert!(
        e.contains("layer 0 is a sliding_attention layer, but use_sliding_window is not set"),
        "{e}"
    );
    let e = err_msg(cfg(
        "qwen2_moe",
        r#", "layer_types": ["sliding_attention"], "use_sliding_window": true, "sliding_window": null"#,
    ));
    assert!(e.contains("but sliding_window is null"), "{e}");
    let sliding = cfg(
        "qwen2_moe",
        r#", "layer_types": ["sliding_attention"], "use_sliding_window": true, "sliding_window": 8"#,
    )?;
    assert_eq!(sliding.sliding_window, Some(8));
    Ok(())
}

/// StarCoder2 reads `use_bias` (default true, all four projections) and Granite scales by
/// `attention_multiplier` (default 1) instead of `head_dim^-1/2`, as their config classes
/// and modeling code do (transformers 5.25; the `hf_attention` fixtures `starcoder2_*` and
/// `granite_*` check the outputs).
#[test]
fn starcoder2_biases_and_granite_scale_follow_their_config_classes() -> Result<()> {
    let cfg = small;
    let all = |b: bool| QkvLayout::separate(b, b, b, b);
    assert_eq!(cfg("starcoder2", "")?.layout, all(true));
    assert_eq!(cfg("starcoder2", r#", "use_bias": false"#)?.layout, all(false));
    assert_eq!(
        cfg("starcoder2", r#", "sliding_window": 16"#)?.sliding_window,
        Some(16)
    );
    assert_eq!(cfg("starcoder2", "")?.sliding_window, None);
    assert_eq!(cfg("granite", "")?.scale, 1.0);
    assert_eq!(
        cfg("granite", r#", "attention_multiplier": 0.015625"#)?.scale,
        0.015625
    );
    assert_eq!(
        cfg("llama", r#", "attention_multiplier": 0.015625"#)?.scale,
        1.0 / 8f64.sqrt()
    );
    let inf = HfConfig {
        attention_multiplier: Some(f64::INFINITY),
        ..hf(r#"{"hidden_size": 32, "num_attention_heads": 4}"#)
    };
    let e = err_msg(DecoderAttentionConfig::from_hf("granite", &inf, 0, false));
    assert!(e.contains("attention_multiplier must be finite, got inf"), "{e}");
    Ok(())
}
