//! Inputs the layers must refuse with an error that names the problem: tables, dtypes,
//! parameters and cache sizes that once panicked or gave wrong numbers.
mod common;
use std::collections::HashMap;

use candle_attention::alibi::alibi_bias;
use candle_attention::decoder::{DecoderAttention, DecoderAttentionConfig, HfConfig, QkvLayout};
use candle_attention::{KvCache, Proj, RopeConfig, RopeScaling, RopeStyle, RotaryEmbedding};
use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::VarBuilder;
use common::{err_msg, plain_decoder, plain_decoder_weights, randn};

fn rope(scaling: RopeScaling, theta: f64) -> Result<RotaryEmbedding> {
    RotaryEmbedding::new(&RopeConfig {
        head_dim: 8,
        rotary_dim: 8,
        theta,
        style: RopeStyle::HalfSplit,
        scaling,
    })
}

/// A valid yarn scaling, but for the given `beta_fast`, `attention_factor` and `mscale`.
fn yarn(beta_fast: f64, attention_factor: Option<f64>, mscale: Option<f64>) -> RopeScaling {
    RopeScaling::Yarn {
        factor: 4.0,
        original_max_position_embeddings: 64.0,
        beta_fast,
        beta_slow: 1.0,
        attention_factor,
        mscale,
        mscale_all_dim: None,
        truncate: true,
    }
}

/// candle-nn's rope reads a longer (B, L', D/2) table with the rows of the wrong batch
/// entry (errors of up to 2.9 were seen), so `apply` takes exactly `(B, L, rotary_dim/2)`.
#[test]
fn rope_takes_only_its_own_table_shape_and_float_tables() -> Result<()> {
    let r = rope(RopeScaling::Default, 1e4)?;
    let x = randn(&[2, 1, 2, 8])?;
    let pos = Tensor::new(&[[0i64, 1, 2], [0, 1, 2]], &Device::Cpu)?;
    let (cos, sin) = r.cos_sin(&pos, DType::F32)?;
    let msg = err_msg(r.apply(&x, &cos, &sin));
    assert!(msg.contains("[2, 2, 4]") && msg.contains("[2, 3, 4]"), "{msg}");
    let (cos, sin) = r.cos_sin(&pos.narrow(1, 0, 2)?, DType::F32)?;
    let msg = err_msg(r.apply(&x, &cos, &sin.narrow(2, 0, 3)?));
    assert!(msg.contains("sin [2, 2, 3]"), "{msg}");
    assert_eq!(r.apply(&x, &cos, &sin)?.dims(), [2, 1, 2, 8]);
    let msg = err_msg(r.cos_sin(&pos, DType::U32));
    assert!(msg.contains("float") && msg.contains("U32"), "{msg}");
    Ok(())
}

#[test]
fn rope_parameters_must_be_finite_and_positive() -> Result<()> {
    let cases: Vec<(RopeScaling, f64, &str)> = vec![
        (RopeScaling::Default, f64::INFINITY, "rope_theta"),
        (
            RopeScaling::Linear {
                factor: f64::INFINITY,
            },
            1e4,
            "factor",
        ),
        (yarn(0.0, None, None), 1e4, "beta_fast"),
        (yarn(32.0, Some(f64::NAN), None), 1e4, "attention_factor"),
        (yarn(32.0, None, Some(f64::INFINITY)), 1e4, "mscale"),
        (
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: f64::NAN,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 64.0,
            },
            1e4,
            "low_freq_factor",
        ),
        (
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: f64::INFINITY,
            },
            1e4,
            "original_max_position_embeddings",
        ),
    ];
    for (scaling, theta, key) in cases {
        let msg = err_msg(rope(scaling.clone(), theta));
        assert!(msg.contains(key), "{scaling:?}: {msg}");
    }
    rope(yarn(32.0, None, None), 1e4)?;
    Ok(())
}

#[test]
fn kv_cache_errors_name_shapes_dtypes_and_sizes() -> Result<()> {
    let k = randn(&[1, 1, 2, 4])?;
    // The value dtype is part of what the cache holds.
    let mut c = KvCache::new();
    c.append(&k, &k.to_dtype(DType::BF16)?)?;
    let msg = err_msg(c.append(&k, &k));
    assert!(msg.contains("BF16") && msg.contains("values"), "{msg}");
    // The shapes of the tokens held (not of the buffer, which has spare room), and the
    // dtypes as they are.
    assert!(
        msg.contains("holds keys [1, 1, 2, 4] F32 and values [1, 1, 2, 4] BF16 but got"),
        "{msg}"
    );
    // Sizes that overflow are errors, not panics or wrapped allocations.
    for cap in [usize::MAX, 1 << 62] {
        let msg = err_msg(KvCache::with_max_len(cap).append(&k, &k));
        assert!(msg.contains(&cap.to_string()), "{msg}");
    }
    let msg = err_msg(KvCache::rotating(u32::MAX as usize + 1));
    assert!(msg.contains("4294967296"), "{msg}");
    Ok(())
}

/// Integer tensors where floats are expected: PyTorch raises a dtype error for these.
#[test]
fn layers_refuse_integer_inputs() -> Result<()> {
    let dev = Device::Cpu;
    let p = Proj::new(randn(&[3, 2])?, None);
    let msg = err_msg(p.forward(&Tensor::zeros((1, 2), DType::U32, &dev)?));
    assert!(msg.contains("float") && msg.contains("U32"), "{msg}");
    let msg = err_msg(alibi_bias(&[0.5], &[1, 3], DType::U8, &dev));
    assert!(msg.contains("float") && msg.contains("U8"), "{msg}");
    let cfg = tiny(QkvLayout::separate(false, false, false, false), true);
    let layer = DecoderAttention::new(&cfg, plain_decoder_weights(4)?)?;
    let msg = err_msg(layer.forward(&Tensor::zeros((1, 2, 4), DType::U32, &dev)?));
    assert!(msg.contains("float") && msg.contains("U32"), "{msg}");
    // Cross-attention keeps every encoder key: a rotating cache would drop some.
    let x = randn(&[1, 2, 4])?;
    let msg = err_msg(layer.forward_cross(&x, Some(&x), Some(&mut KvCache::rotating(1)?)));
    assert!(msg.contains("rotating") && msg.contains("window 1"), "{msg}");
    // Head counts and sizes whose projection widths overflow usize (a corrupt config.json).
    let huge = DecoderAttentionConfig {
        num_heads: 1 << 40,
        num_kv_heads: 1 << 40,
        head_dim: 1 << 30,
        ..cfg.clone()
    };
    let empty = VarBuilder::from_tensors(HashMap::new(), DType::F32, &dev);
    let msg = err_msg(DecoderAttention::new(&huge, empty));
    assert!(msg.contains("overflow") && msg.contains("1099511627776"), "{msg}");
    Ok(())
}

/// `Linear(0, out)`: the product is the empty sum 0, so the output is the bias.
#[test]
fn a_projection_of_no_input_features_gives_the_bias() -> Result<()> {
    let dev = Device::Cpu;
    let bias = Tensor::new(&[1f32, 2., 3.], &dev)?;
    let p = Proj::new(Tensor::zeros((3, 0), DType::F32, &dev)?, Some(bias));
    let y = p.forward(&Tensor::zeros((2, 0), DType::F32, &dev)?)?;
    assert_eq!(y.to_vec2::<f32>()?, [[1., 2., 3.], [1., 2., 3.]]);
    Ok(())
}

/// A self- or cross-attention layer of width 4 with one head of size 4, no rope.
fn tiny(layout: QkvLayout, cross_attention: bool) -> DecoderAttentionConfig {
    DecoderAttentionConfig {
        layout,
        cross_attention,
        ..plain_decoder(4)
    }
}

/// `cfg`'s layer with every weight 0.
fn zero_layer(cfg: &DecoderAttentionConfig) -> Result<DecoderAttention> {
    DecoderAttention::new(cfg, VarBuilder::zeros(DType::F32, &Device::Cpu))
}

/// [`plain_decoder`]'s layer of hidden size 4 with every weight 0, cross-attention or not.
fn plain_layer(cross_attention: bool) -> Result<DecoderAttention> {
    zero_layer(&DecoderAttentionConfig {
        cross_attention,
        ..plain_decoder(4)
    })
}

/// Layer `layer_idx` of `arch` from the config.json text `json`.
fn from_hf(arch: &str, json: &str, layer_idx: usize) -> Result<DecoderAttentionConfig> {
    DecoderAttentionConfig::from_hf(arch, &HfConfig::from_json(json)?, layer_idx, false)
}

/// A rotating cache with a window of 0 tokens.
#[test]
fn rotating_cache_of_no_tokens_is_refused() {
    let msg = err_msg(KvCache::rotating(0));
    assert!(msg.contains("window of at least 1 token"), "{msg}");
}

/// Keys and values of different lengths (or batches, or heads) in one append, and keys
/// or values that are not of rank 4.
#[test]
fn kv_cache_refuses_keys_and_values_that_disagree() -> Result<()> {
    let k = randn(&[1, 1, 2, 4])?;
    for v in [
        randn(&[1, 1, 3, 4])?,
        randn(&[2, 1, 2, 4])?,
        randn(&[1, 2, 2, 4])?,
    ] {
        let msg = err_msg(KvCache::new().append(&k, &v));
        let want = format!("keys [1, 1, 2, 4] and values {:?} disagree", v.dims());
        assert!(msg.contains(&want), "{msg}");
    }
    // Keys or values of another rank.
    let (k3, v5) = (randn(&[1, 2, 4])?, randn(&[1, 1, 1, 2, 4])?);
    let msg = err_msg(KvCache::new().append(&k3, &k));
    assert!(
        msg.contains("KV cache: keys must be (B, Hkv, L, D), got [1, 2, 4]"),
        "{msg}"
    );
    let msg = err_msg(KvCache::new().append(&k, &v5));
    assert!(
        msg.contains("KV cache: values must be (B, Hkv, L, Dv), got [1, 1, 1, 2, 4]"),
        "{msg}"
    );
    Ok(())
}

/// config.json head counts that cannot split the hidden size: zero heads, and (without
/// `head_dim`) a hidden_size that is not a multiple of the heads.
#[test]
fn hf_config_heads_that_cannot_split_the_hidden_size_are_refused() {
    for (json, want) in [
        (
            r#"{"hidden_size": 8, "num_attention_heads": 0}"#,
            "llama config: num_attention_heads must be positive",
        ),
        (
            r#"{"hidden_size": 10, "num_attention_heads": 4}"#,
            "llama config: hidden_size 10 is not divisible by num_attention_heads 4",
        ),
    ] {
        let msg = err_msg(from_hf("llama", json, 0));
        assert!(msg.contains(want), "{json}: {msg}");
    }
}

/// A layer index past the end of config.json's `layer_types`.
#[test]
fn hf_config_layer_past_layer_types_is_refused() -> Result<()> {
    let json = r#"{"hidden_size": 8, "num_attention_heads": 2,
        "layer_types": ["full_attention", "sliding_attention"]}"#;
    from_hf("qwen2", json, 1)?;
    let msg = err_msg(from_hf("qwen2", json, 2));
    assert!(
        msg.contains("qwen2 config: layer_types has no entry for layer 2"),
        "{msg}"
    );
    Ok(())
}

/// Packed QKV layouts that split heads without GQA (GPT-2's Conv1D, BLOOM's head-interleaved)
/// with fewer key/value heads than query heads.
#[test]
fn packed_qkv_without_gqa_refuses_fewer_kv_heads() -> Result<()> {
    for (arch, json, want) in [
        (
            "gpt2",
            r#"{"n_embd": 8, "n_head": 2, "num_key_value_heads": 1}"#,
            "Conv1D-packed QKV needs num_kv_heads == num_heads, got 1 and 2",
        ),
        (
            "bloom",
            r#"{"hidden_size": 8, "n_head": 2, "num_key_value_heads": 1}"#,
            "head-interleaved QKV needs num_kv_heads == num_heads, got 1 and 2",
        ),
    ] {
        let msg = err_msg(zero_layer(&from_hf(arch, json, 0)?));
        assert!(msg.contains(want), "{arch}: {msg}");
    }
    Ok(())
}

/// Hidden or encoder states that are not `(B, L, hidden)` tensors of rank 3.
#[test]
fn hidden_states_of_another_rank_are_refused() -> Result<()> {
    let layer = plain_layer(false)?;
    let msg = err_msg(layer.forward(&randn(&[2, 4])?));
    assert!(
        msg.contains("hidden_states must be (B, L, hidden), got [2, 4]"),
        "{msg}"
    );
    let cross = plain_layer(true)?;
    let x = randn(&[1, 2, 4])?;
    let msg = err_msg(cross.forward_cross(&x, Some(&randn(&[1, 1, 3, 4])?), None));
    assert!(
        msg.contains("encoder_hidden_states must be (B, L, hidden), got [1, 1, 3, 4]"),
        "{msg}"
    );
    Ok(())
}

/// Float position ids: positions are indices, as in PyTorch.
#[test]
fn layer_refuses_float_position_ids() -> Result<()> {
    let layer = plain_layer(false)?;
    let pos = Tensor::new(&[[0f32, 1.0]], &Device::Cpu)?;
    let msg = err_msg(layer.forward_cached(&randn(&[1, 2, 4])?, &pos, None, None));
    assert!(msg.contains("position_ids must be integers, got F32"), "{msg}");
    Ok(())
}

/// Self-attention (`forward`, `forward_cached`) on a cross-attention layer.
#[test]
fn cross_attention_layer_refuses_self_attention() -> Result<()> {
    let layer = plain_layer(true)?;
    let x = randn(&[1, 2, 4])?;
    let msg = err_msg(layer.forward(&x));
    assert!(msg.contains("cross-attention layer; use forward_cross"), "{msg}");
    let pos = Tensor::new(&[[0i64, 1]], &Device::Cpu)?;
    let msg = err_msg(layer.forward_cached(&x, &pos, None, Some(&mut KvCache::new())));
    assert!(msg.contains("cross-attention layer; use forward_cross"), "{msg}");
    Ok(())
}

/// A first cross-attention call (no cache, or an empty one) without encoder states.
#[test]
fn first_cross_attention_call_without_encoder_states_is_refused() -> Result<()> {
    let layer = plain_layer(true)?;
    let x = randn(&[1, 2, 4])?;
    for cache in [None, Some(&mut KvCache::new())] {
        let msg = err_msg(layer.forward_cross(&x, None, cache));
        assert!(
            msg.contains("needs encoder_hidden_states on its first call"),
            "{msg}"
        );
    }
    Ok(())
}

/// Encoder states of another batch size than the decoder's hidden states.
#[test]
fn encoder_states_of_another_batch_are_refused() -> Result<()> {
    let layer = plain_layer(true)?;
    let msg = err_msg(layer.forward_cross(&randn(&[1, 2, 4])?, Some(&randn(&[2, 3, 4])?), None));
    assert!(
        msg.contains("encoder_hidden_states [2, 3, 4] and hidden_states [1, 2, 4] disagree on the batch"),
        "{msg}"
    );
    Ok(())
}

/// Cross-attention with packed QKV projections, whose keys cannot be computed apart.
#[test]
fn cross_attention_with_packed_projections_is_refused() -> Result<()> {
    let (qkv, o) = (String::from("qkv"), String::from("o"));
    let layouts = [
        QkvLayout::Packed {
            qkv: qkv.clone(),
            o: o.clone(),
            qkv_bias: false,
            o_bias: false,
        },
        QkvLayout::Conv1dPacked {
            qkv: qkv.clone(),
            o: o.clone(),
        },
        QkvLayout::HeadInterleaved { qkv, o, bias: false },
    ];
    let x = randn(&[1, 2, 4])?;
    for layout in layouts {
        let layer = zero_layer(&tiny(layout.clone(), true))?;
        let msg = err_msg(layer.forward_cross(&x, Some(&x), None));
        assert!(
            msg.contains("cross-attention needs separate q/k/v projections"),
            "{layout:?}: {msg}"
        );
    }
    Ok(())
}

/// A llama3 rope whose high_freq_factor is not above its low_freq_factor.
#[test]
fn llama3_rope_needs_high_freq_factor_above_low_freq_factor() {
    for (low, high) in [(4.0, 1.0), (2.0, 2.0)] {
        let scaling = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: low,
            high_freq_factor: high,
            original_max_position_embeddings: 64.0,
        };
        let msg = err_msg(rope(scaling, 1e4));
        assert!(
            msg.contains(&format!(
                "high_freq_factor > low_freq_factor, got {high} and {low}"
            )),
            "{msg}"
        );
    }
}

/// Position ids that are not a `(B, L)` matrix of integers, given to the rope directly.
#[test]
fn rope_refuses_position_ids_of_another_rank_or_dtype() -> Result<()> {
    let r = rope(RopeScaling::Default, 1e4)?;
    let cases = [
        (
            Tensor::new(&[0i64, 1, 2], &Device::Cpu)?,
            "rope: position_ids must be (B, L), got [3]",
        ),
        (
            Tensor::new(&[[0f32, 1.0, 2.0]], &Device::Cpu)?,
            "rope: position_ids must be integers, got F32",
        ),
    ];
    for (pos, want) in cases {
        let msg = err_msg(r.cos_sin(&pos, DType::F32));
        assert!(msg.contains(want), "{msg}");
    }
    Ok(())
}

/// Heads of another size than the rope's head_dim, even with tables of the right shape.
#[test]
fn rope_refuses_heads_of_another_size() -> Result<()> {
    let r = rope(RopeScaling::Default, 1e4)?;
    let (cos, sin) = r.cos_sin(&Tensor::new(&[[0i64, 1]], &Device::Cpu)?, DType::F32)?;
    let msg = err_msg(r.apply(&randn(&[1, 1, 2, 10])?, &cos, &sin));
    assert!(
        msg.contains("expected heads of size 8, got x [1, 1, 2, 10]"),
        "{msg}"
    );
    Ok(())
}
