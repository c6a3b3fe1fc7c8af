//! Checks every PyTorch fixture against this crate.
//!
//! ```text
//! cargo run --release --example parity -- [--device cpu|cuda|metal] [--json] [--backend auto|reference|fused] [PATH ...]
//! ```
//!
//! With no path it runs every `*.safetensors` in the crate's `weights/`. It prints one
//! row per fixture and exits non-zero if any fails (a fixture that cannot be loaded or
//! run fails too).
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Result};
use candle_attention::fixture::{fixture_paths, Fixture, FixtureReport, RunOptions};
use candle_attention::Backend;
use candle_core::Device;

struct Args {
    device: Device,
    json: bool,
    backend: Backend,
    paths: Vec<PathBuf>,
}

fn parse_args() -> Result<Args> {
    let mut device = Device::Cpu;
    let mut json = false;
    let mut backend = Backend::Auto;
    let mut paths = Vec::new();
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--json" => json = true,
            "--device" => {
                device = match it.next().as_deref() {
                    Some("cpu") => Device::Cpu,
                    Some("cuda") => Device::new_cuda(0)?,
                    Some("metal") => Device::new_metal(0)?,
                    other => bail!("--device takes cpu, cuda or metal, got {other:?}"),
                }
            }
            "--backend" => {
                backend = match it.next().as_deref() {
                    Some("auto") => Backend::Auto,
                    Some("reference") => Backend::Reference,
                    Some("fused") => Backend::Fused,
                    other => bail!("--backend takes auto, reference or fused, got {other:?}"),
                }
            }
            "-h" | "--help" => {
                println!(
                    "usage: parity [--device cpu|cuda|metal] [--json] [--backend auto|reference|fused] [PATH ...]"
                );
                std::process::exit(0);
            }
            s if s.starts_with("--") => bail!("unknown option {s}"),
            _ => paths.push(PathBuf::from(a)),
        }
    }
    if paths.is_empty() {
        paths.push(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("weights"));
    }
    Ok(Args {
        device,
        json,
        backend,
        paths,
    })
}

fn main() -> Result<ExitCode> {
    let args = parse_args()?;
    let files = fixture_paths(&args.paths)?;
    if files.is_empty() {
        bail!("no fixtures found in {:?}", args.paths);
    }
    let opts = RunOptions {
        device: args.device.clone(),
        dtype: None,
        backend: args.backend,
    };
    if !args.json {
        println!(
            "{:<56} {:<20} {:<5} {:>11} {:>11} {:>8}  result",
            "name", "kind", "dtype", "max_abs_err", "max_rel_err", "tol"
        );
    }
    let (mut passed, mut failed) = (0usize, 0usize);
    for path in &files {
        let stem = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let (kind, result) = match Fixture::load(path, &args.device) {
            Ok(fx) => (fx.kind.clone(), fx.run(&opts)),
            Err(e) => ("?".to_string(), Err(e)),
        };
        match result {
            Ok(r) => {
                if r.pass {
                    passed += 1
                } else {
                    failed += 1
                }
                print_row(&r, args.json, None)?;
            }
            Err(e) => {
                failed += 1;
                let r = FixtureReport {
                    name: stem,
                    kind,
                    dtype: "?".into(),
                    max_abs_err: f64::NAN,
                    max_rel_err: f64::NAN,
                    tol: f64::NAN,
                    pass: false,
                };
                print_row(&r, args.json, Some(&e.to_string()))?;
            }
        }
    }
    if !args.json {
        println!("{passed} passed, {failed} failed");
    }
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn print_row(r: &FixtureReport, json: bool, error: Option<&str>) -> Result<()> {
    if json {
        let mut v = serde_json::to_value(r)?;
        if let Some(e) = error {
            v["error"] = serde_json::Value::String(e.to_string());
        }
        println!("{v}");
    } else {
        println!(
            "{:<56} {:<20} {:<5} {:>11.3e} {:>11.3e} {:>8.0e}  {}{}",
            r.name,
            r.kind,
            r.dtype,
            r.max_abs_err,
            r.max_rel_err,
            r.tol,
            if r.pass { "PASS" } else { "FAIL" },
            error.map(|e| format!(" ({e})")).unwrap_or_default()
        );
    }
    Ok(())
}
