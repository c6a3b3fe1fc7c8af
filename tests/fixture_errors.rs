//! The fixture runner rejects malformed files with errors that say what is wrong.
mod common;
use std::collections::HashMap;

use candle_attention::fixture::{
    fixture_paths, normalised_error, parse_torch_dtype, Fixture, RunOptions, FORMAT,
};
use candle_core::{DType, Device, Result, Tensor};
use common::{err_msg, randn};

fn fixture_bytes(kind: &str, format: &str, tensors: Vec<(&str, Tensor)>) -> Vec<u8> {
    fixture_bytes_with(kind, &[("format", format)], tensors)
}

/// The bytes of [`fixture_bytes`]' sdpa-like fixture with the metadata entries in `meta`
/// set (replaced or added).
fn fixture_bytes_with(kind: &str, meta: &[(&str, &str)], tensors: Vec<(&str, Tensor)>) -> Vec<u8> {
    let mut all: HashMap<String, String> = [
        ("format", FORMAT),
        ("kind", kind),
        (
            "config",
            r#"{"is_causal": false, "scale": null, "enable_gqa": false, "dropout_p": 0.0}"#,
        ),
        ("call", "{}"),
        ("dtype", "float32"),
        ("torch_version", "test"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    all.extend(meta.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    safetensors::serialize(tensors.iter().map(|(k, v)| (k.to_string(), v)), Some(all)).unwrap()
}

/// [`fixture_bytes_with`], parsed.
fn fixture_with(kind: &str, meta: &[(&str, &str)], tensors: Vec<(&str, Tensor)>) -> Result<Fixture> {
    Fixture::from_bytes("x", &fixture_bytes_with(kind, meta, tensors), &Device::Cpu)
}

/// A committed fixture of `weights/`, by name.
fn committed(name: &str) -> Result<Fixture> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("weights/{name}.safetensors"));
    Fixture::load(&path, &Device::Cpu)
}

/// A committed fixture with `extra` tensors added, written out and parsed again.
fn committed_with(name: &str, extra: Vec<(&str, Tensor)>) -> Result<Fixture> {
    let fx = committed(name)?;
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    for key in fx.tensor_names() {
        tensors.push((key.to_string(), fx.tensor(key)?.clone()));
    }
    tensors.extend(extra.into_iter().map(|(k, t)| (k.to_string(), t)));
    let bytes = safetensors::serialize(
        tensors.iter().map(|(k, t)| (k.as_str(), t)),
        Some(fx.metadata.clone()),
    )
    .unwrap();
    Fixture::from_bytes(name, &bytes, &Device::Cpu)
}

fn sdpa_tensors() -> Result<Vec<(&'static str, Tensor)>> {
    let q = randn(&[1, 2, 3, 4])?;
    Ok(vec![
        ("input.query", q.clone()),
        ("input.key", q.clone()),
        ("input.value", q.clone()),
        ("output.out", q),
    ])
}

#[test]
fn unknown_kind_is_an_error() -> Result<()> {
    let fx = Fixture::from_bytes(
        "x",
        &fixture_bytes("banana", FORMAT, sdpa_tensors()?),
        &Device::Cpu,
    )?;
    let msg = err_msg(fx.run(&RunOptions::default()));
    assert!(
        msg.contains("unknown kind 'banana'") && msg.contains("sdpa"),
        "{msg}"
    );
    Ok(())
}

#[test]
fn missing_tensor_is_an_error() -> Result<()> {
    let mut t = sdpa_tensors()?;
    t.retain(|(k, _)| *k != "input.key");
    let fx = Fixture::from_bytes("x", &fixture_bytes("sdpa", FORMAT, t), &Device::Cpu)?;
    let msg = err_msg(fx.run(&RunOptions::default()));
    assert!(msg.contains("missing tensor 'input.key'"), "{msg}");
    let mut t = sdpa_tensors()?;
    t.retain(|(k, _)| *k != "output.out");
    let fx = Fixture::from_bytes("x", &fixture_bytes("sdpa", FORMAT, t), &Device::Cpu)?;
    let msg = err_msg(fx.run(&RunOptions::default()));
    assert!(msg.contains("missing tensor 'output.out'"), "{msg}");
    Ok(())
}

#[test]
fn wrong_format_or_not_safetensors_is_an_error() -> Result<()> {
    let msg = err_msg(Fixture::from_bytes(
        "x",
        &fixture_bytes("sdpa", "other/2", sdpa_tensors()?),
        &Device::Cpu,
    ));
    assert!(msg.contains("other/2"), "{msg}");
    let msg = err_msg(Fixture::from_bytes("x", b"not a safetensors file", &Device::Cpu));
    assert!(msg.contains("not a safetensors"), "{msg}");
    let msg = err_msg(fixture_paths(&["/nonexistent/fixtures".into()]));
    assert!(msg.contains("/nonexistent/fixtures"), "{msg}");
    Ok(())
}

#[test]
fn a_wrong_output_shape_is_an_error() -> Result<()> {
    let mut t = sdpa_tensors()?;
    t.retain(|(k, _)| *k != "output.out");
    t.push(("output.out", randn(&[1, 2, 3, 5])?));
    let fx = Fixture::from_bytes("x", &fixture_bytes("sdpa", FORMAT, t), &Device::Cpu)?;
    let msg = err_msg(fx.run(&RunOptions::default()));
    assert!(
        msg.contains("[1, 2, 3, 5]") && msg.contains("[1, 2, 3, 4]"),
        "{msg}"
    );
    Ok(())
}

#[test]
fn normalised_error_refuses_shapes_that_differ() -> Result<()> {
    let (a, b) = (randn(&[2, 3])?, randn(&[3, 2])?);
    let msg = err_msg(normalised_error(&a, &b));
    assert!(msg.contains("[2, 3]") && msg.contains("[3, 2]"), "{msg}");
    Ok(())
}

#[test]
fn normalised_error_scales_by_the_largest_expected_value_and_counts_nan_as_infinite() -> Result<()> {
    let dev = Device::Cpu;
    let t = |v: &[f32]| Tensor::new(v, &dev);
    // Scale max(1, 4): 0.4 / 4.
    let e = normalised_error(&t(&[4.0, -2.0, 1.4])?, &t(&[4.0, -2.0, 1.0])?)?;
    assert!((e - 0.1).abs() < 1e-6, "{e}");
    // Expected values below 1 do not shrink the scale: 0.25 / 1.
    let e = normalised_error(&t(&[0.5, 0.25])?, &t(&[0.5, 0.0])?)?;
    assert!((e - 0.25).abs() < 1e-12, "{e}");
    for bad in [f32::NAN, f32::INFINITY] {
        let e = normalised_error(&t(&[1.0, bad])?, &t(&[1.0, 2.0])?)?;
        assert_eq!(e, f64::INFINITY);
    }
    Ok(())
}

/// A `dtype` that is not one of the four float dtypes is refused when the file is parsed.
#[test]
fn a_non_float_fixture_dtype_is_an_error() -> Result<()> {
    let msg = err_msg(parse_torch_dtype("torch.int64"));
    assert!(msg.contains("unsupported fixture dtype 'int64'"), "{msg}");
    let msg = err_msg(fixture_with("sdpa", &[("dtype", "uint8")], sdpa_tensors()?));
    assert!(msg.contains("unsupported fixture dtype 'uint8'"), "{msg}");
    Ok(())
}

/// A run dtype that is not a float dtype is refused.
#[test]
fn running_in_a_non_float_dtype_is_an_error() -> Result<()> {
    let fx = fixture_with("sdpa", &[], sdpa_tensors()?)?;
    let opts = RunOptions {
        dtype: Some(DType::U8),
        ..RunOptions::default()
    };
    let msg = err_msg(fx.run(&opts));
    assert!(msg.contains("cannot run in U8"), "{msg}");
    Ok(())
}

/// A config that does not deserialize into the layer's config is refused, naming the kind.
#[test]
fn a_config_without_a_required_key_is_an_error() -> Result<()> {
    let fx = fixture_with(
        "multihead_attention",
        &[("config", r#"{"num_heads": 2}"#)],
        sdpa_tensors()?,
    )?;
    let msg = err_msg(fx.run(&RunOptions::default()));
    assert!(
        msg.contains("bad config for kind multihead_attention") && msg.contains("embed_dim"),
        "{msg}"
    );
    Ok(())
}

/// A flag of the config (or call) that is not a JSON bool is refused.
#[test]
fn a_flag_that_is_not_a_bool_is_an_error() -> Result<()> {
    let fx = fixture_with(
        "sdpa",
        &[("config", r#"{"is_causal": "yes", "dropout_p": 0.0}"#)],
        sdpa_tensors()?,
    )?;
    let msg = err_msg(fx.run(&RunOptions::default()));
    assert!(msg.contains("'is_causal' must be a bool"), "{msg}");
    Ok(())
}

/// An sdpa fixture with a non-zero or non-numeric `dropout_p` is refused (inference only).
#[test]
fn a_non_zero_dropout_is_an_error() -> Result<()> {
    let fx = fixture_with("sdpa", &[("config", r#"{"dropout_p": 0.1}"#)], sdpa_tensors()?)?;
    let msg = err_msg(fx.run(&RunOptions::default()));
    assert!(
        msg.contains("dropout_p = 0.1 is not supported (inference only)"),
        "{msg}"
    );
    // A dropout that is not a number is refused too, not read as 0.
    let fx = fixture_with("sdpa", &[("config", r#"{"dropout_p": "0.1"}"#)], sdpa_tensors()?)?;
    let msg = err_msg(fx.run(&RunOptions::default()));
    assert!(msg.contains(r#"dropout_p must be a number, got "0.1""#), "{msg}");
    Ok(())
}

/// An sdpa `scale` that is neither a number nor null is refused.
#[test]
fn a_scale_that_is_not_a_number_is_an_error() -> Result<()> {
    let fx = fixture_with("sdpa", &[("config", r#"{"scale": "0.5"}"#)], sdpa_tensors()?)?;
    let msg = err_msg(fx.run(&RunOptions::default()));
    assert!(msg.contains(r#"scale must be a number, got "0.5""#), "{msg}");
    Ok(())
}

/// A `multihead_attention` fixture that stores attention weights its call does not ask for
/// is refused.
#[test]
fn stored_weights_without_need_weights_are_an_error() -> Result<()> {
    let mut fx = committed("multihead_attention__self_default__f32")?;
    assert!(fx.run(&RunOptions::default())?.pass);
    fx.call = serde_json::json!({ "need_weights": false });
    let msg = err_msg(fx.run(&RunOptions::default()));
    assert!(
        msg.contains("stores output.attn_weights but its call has need_weights = false"),
        "{msg}"
    );
    Ok(())
}

/// A `notes_sdpa` config without an integer `d_k` is refused.
#[test]
fn notes_sdpa_without_an_integer_d_k_is_an_error() -> Result<()> {
    for config in [r#"{}"#, r#"{"d_k": "4"}"#, r#"{"d_k": 2.5}"#] {
        let fx = fixture_with("notes_sdpa", &[("config", config)], sdpa_tensors()?)?;
        let msg = err_msg(fx.run(&RunOptions::default()));
        assert!(msg.contains("config needs an integer d_k"), "{config}: {msg}");
    }
    Ok(())
}

/// An `hf_attention` fixture without an `architecture` metadata entry is refused.
#[test]
fn hf_attention_without_an_architecture_is_an_error() -> Result<()> {
    let fx = fixture_with("hf_attention", &[], sdpa_tensors()?)?;
    let msg = err_msg(fx.run(&RunOptions::default()));
    assert!(msg.contains("metadata has no 'architecture'"), "{msg}");
    Ok(())
}

/// An `hf_attention` padding mask whose rows do not match the output's `(B, L)` rows is
/// refused (the cross-attention case, whose layer does not read the mask itself).
#[test]
fn an_attention_mask_that_does_not_fit_the_output_rows_is_an_error() -> Result<()> {
    let name = "hf_attention__whisper_cross_attention__f32";
    assert!(committed(name)?.run(&RunOptions::default())?.pass);
    // The output is (2, 5, 32): a mask for 3 batch rows does not divide it, a mask of
    // no batch rows has no rows to spread it over, and 4 columns cannot hold the 5
    // query rows (before the check, that wrapped below zero).
    let cases = [
        (
            (3, 5),
            "row mask [3, 5] does not fit 'output.attn_output' [2, 5, 32]",
        ),
        (
            (0, 5),
            "row mask [0, 5] does not fit 'output.attn_output' [2, 5, 32]",
        ),
        (
            (2, 4),
            "'input.attention_mask' [2, 4] has fewer than the step's 5 query rows",
        ),
    ];
    for (shape, want) in cases {
        let mask = Tensor::ones(shape, DType::U8, &Device::Cpu)?;
        let fx = committed_with(name, vec![("input.attention_mask", mask)])?;
        let msg = err_msg(fx.run(&RunOptions::default()));
        assert!(msg.contains(want), "{shape:?}: {msg}");
    }
    Ok(())
}
