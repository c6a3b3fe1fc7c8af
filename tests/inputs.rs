//! Inputs the layers must refuse with an error that names the problem: tables, dtypes,
//! parameters and cache sizes that once panicked or gave wrong numbers.
mod common;
use std::collections::HashMap;

use candle_attention::alibi::alibi_bias;
use candle_attention::decoder::{DecoderAttention, DecoderAttentionConfig, QkvLayout};
use candle_attention::{KvCache, Proj, RopeConfig, RopeScaling, RopeStyle, RotaryEmbedding};
use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::VarBuilder;
use common::{err_msg, randn};

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
    let cfg = DecoderAttentionConfig {
        hidden_size: 4,
        num_heads: 1,
        num_kv_heads: 1,
        head_dim: 4,
        layout: QkvLayout::separate(false, false, false, false),
        qk_norm: None,
        rope: None,
        alibi: false,
        softcap: None,
        sinks: false,
        sliding_window: None,
        bidirectional: false,
        scale: 0.5,
        cross_attention: true,
        max_position_embeddings: None,
    };
    let m: HashMap<String, Tensor> = ["q_proj", "k_proj", "v_proj", "o_proj"]
        .iter()
        .map(|n| Ok((format!("{n}.weight"), randn(&[4, 4])?)))
        .collect::<Result<_>>()?;
    let layer = DecoderAttention::new(&cfg, VarBuilder::from_tensors(m, DType::F32, &dev))?;
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
