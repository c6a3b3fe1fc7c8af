//! Every PyTorch fixture in `weights/` passes, on the default path and on the reference path.
mod common;
use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;

use candle_attention::fixture::{fixture_paths, Fixture, RunOptions, KINDS};
use candle_attention::Backend;
use candle_core::{DType, Device, Result, Tensor};

fn weights() -> Vec<PathBuf> {
    fixture_paths(&[PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("weights")]).expect("weights/ is listable")
}

fn run_all(backend: Backend) -> Result<()> {
    let files = weights();
    assert!(
        files.len() >= 100,
        "expected the bundled fixtures, found {}",
        files.len()
    );
    let opts = RunOptions {
        backend,
        ..RunOptions::default()
    };
    let mut failures = Vec::new();
    for f in &files {
        let r = Fixture::load(f, &Device::Cpu)?.run(&opts)?;
        if !r.pass {
            failures.push(format!(
                "{} rel err {:.3e} > tol {:.0e}",
                r.name, r.max_rel_err, r.tol
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} fixtures failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    Ok(())
}

#[test]
fn every_fixture_passes_on_the_default_path() -> Result<()> {
    run_all(Backend::Auto)
}

#[test]
fn every_fixture_passes_on_the_reference_path() -> Result<()> {
    run_all(Backend::Reference)
}

#[test]
fn every_kind_is_covered_in_every_dtype() -> Result<()> {
    let mut seen = BTreeSet::new();
    for f in weights() {
        let fx = Fixture::load(&f, &Device::Cpu)?;
        seen.insert((fx.kind.clone(), fx.dtype.as_str()));
    }
    for kind in KINDS {
        for dt in ["f32", "f64", "f16", "bf16"] {
            assert!(
                seen.contains(&(kind.to_string(), dt)),
                "no {kind} fixture in {dt}"
            );
        }
    }
    Ok(())
}

/// The runner must fail a fixture whose stored output is off: proof that the comparison bites.
#[test]
fn a_perturbed_expected_output_fails() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("cattn-parity-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for file in weights().iter().filter(|p| {
        let s = p.to_string_lossy();
        s.contains("__basic__f32") || s.contains("multihead_attention__self_default__f32")
    }) {
        let bytes = std::fs::read(file).unwrap();
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let meta = header.metadata().clone();
        let mut tensors: HashMap<String, Tensor> =
            candle_core::safetensors::load_buffer(&bytes, &Device::Cpu)?;
        let key = tensors
            .keys()
            .find(|k| k.starts_with("output."))
            .cloned()
            .unwrap();
        let t = &tensors[&key];
        // Nudge one element by 1e-3 relative: far above the f32 tolerance.
        let mut v = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        v[0] += 1e-3 * v.iter().fold(1f32, |m, x| m.max(x.abs()));
        tensors.insert(
            key.clone(),
            Tensor::from_vec(v, t.shape(), &Device::Cpu)?.to_dtype(t.dtype())?,
        );
        let out = dir.join(file.file_name().unwrap());
        let data = safetensors::serialize(tensors.iter().map(|(k, v)| (k.clone(), v)), meta).unwrap();
        std::fs::write(&out, data).unwrap();
        let original = Fixture::load(file, &Device::Cpu)?.run(&RunOptions::default())?;
        let perturbed = Fixture::load(&out, &Device::Cpu)?.run(&RunOptions::default())?;
        assert!(original.pass, "{}", original.name);
        assert!(
            !perturbed.pass,
            "perturbed {} still passes ({:e})",
            perturbed.name, perturbed.max_rel_err
        );
    }
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}
