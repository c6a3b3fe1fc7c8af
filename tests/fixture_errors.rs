//! The fixture runner rejects malformed files with errors that say what is wrong.
mod common;
use std::collections::HashMap;

use candle_attention::fixture::{fixture_paths, normalised_error, Fixture, RunOptions, FORMAT};
use candle_core::{Device, Result, Tensor};
use common::{err_msg, randn};

fn fixture_bytes(kind: &str, format: &str, tensors: Vec<(&str, Tensor)>) -> Vec<u8> {
    let meta: HashMap<String, String> = [
        ("format", format),
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
    safetensors::serialize(tensors.iter().map(|(k, v)| (k.to_string(), v)), Some(meta)).unwrap()
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
