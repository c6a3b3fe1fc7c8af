//! Loads an `hf_attention` fixture, prefills, then decodes step by step with the KV cache,
//! printing each step's max error against PyTorch and the decode speed.
//!
//! ```text
//! cargo run --release --example decode -- [FIXTURE.safetensors] [--steps N]
//! ```
//! Without a path it uses `weights/hf_attention__mistral_sliding_window__f32.safetensors`.
//! `--steps N` times N extra decode steps (random inputs) after the checked ones.
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_attention::decoder::{DecoderAttention, DecoderAttentionConfig, HfConfig};
use candle_attention::fixture::Fixture;
use candle_core::{DType, Device, Tensor};

/// `max|got − want|` over the rows that `rows` `(B, L)` keeps (padding query rows are
/// unspecified), with a NaN counted as an infinite error (candle's `max` would skip it).
fn max_err(got: &Tensor, want: &Tensor, rows: Option<&Tensor>) -> Result<f64> {
    if got.dims() != want.dims() {
        bail!("output shape {:?}, expected {:?}", got.dims(), want.dims());
    }
    let g = got.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let w = want.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let keep = match rows {
        Some(r) => r.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?,
        None => vec![1.0],
    };
    let per = g.len().div_ceil(keep.len()).max(1);
    Ok(g.iter()
        .zip(&w)
        .enumerate()
        .filter(|(i, _)| keep[i / per] != 0.0)
        .map(|(_, (a, b))| (a - b).abs())
        .map(|d| if d.is_nan() { f64::INFINITY } else { d })
        .fold(0.0, f64::max))
}

fn main() -> Result<()> {
    let mut path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("weights/hf_attention__mistral_sliding_window__f32.safetensors");
    let mut extra = 256usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--steps" => {
                let v = args.next().context("--steps takes a number")?;
                extra = v
                    .parse()
                    .with_context(|| format!("--steps takes a whole number, got {v:?}"))?;
            }
            "-h" | "--help" => {
                println!("usage: decode [FIXTURE.safetensors] [--steps N]");
                return Ok(());
            }
            s if s.starts_with("--") => bail!("unknown option {s}"),
            _ => path = PathBuf::from(a),
        }
    }
    let dev = Device::Cpu;
    let fx = Fixture::load(&path, &dev)?;
    if fx.kind != "hf_attention" {
        bail!("{} is a '{}' fixture, not hf_attention", path.display(), fx.kind);
    }
    let arch = fx
        .metadata
        .get("architecture")
        .context("no architecture in metadata")?;
    let hf: HfConfig = serde_json::from_value(fx.config.clone())?;
    let layer_idx = fx.call.get("layer_idx").and_then(|v| v.as_u64()).unwrap_or(0) as usize;
    let cross = fx
        .call
        .get("cross_attention")
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    let cfg = DecoderAttentionConfig::from_hf(arch, &hf, layer_idx, cross)?;
    let layer = DecoderAttention::new(&cfg, fx.params(fx.dtype, &dev))?;
    let mut cache = layer.new_cache()?;
    println!(
        "{} ({arch}, {:?}, layer {layer_idx}, cross-attention {cross})",
        fx.name, fx.dtype
    );

    let run = |p: &str, cache: &mut candle_attention::KvCache| -> Result<(Tensor, Option<Tensor>)> {
        let x = fx.tensor(&format!("input.{p}hidden_states"))?;
        let mask = fx.opt_tensor(&format!("input.{p}attention_mask"));
        let y = if cross {
            let enc = if p.is_empty() {
                Some(fx.tensor("input.encoder_hidden_states")?)
            } else {
                None
            };
            layer.forward_cross(x, enc, Some(cache))?
        } else {
            layer.forward_cached(
                x,
                fx.tensor(&format!("input.{p}position_ids"))?,
                mask,
                Some(cache),
            )?
        };
        let l = x.dim(1)?;
        let rows = mask.map(|m| m.narrow(1, m.dim(1)? - l, l)).transpose()?;
        Ok((y, rows))
    };
    let (y, rows) = run("", &mut cache)?;
    println!(
        "prefill   L={:<3} max abs err {:.3e}",
        y.dim(1)?,
        max_err(&y, fx.tensor("output.attn_output")?, rows.as_ref())?
    );
    let mut step = 1;
    while fx
        .opt_tensor(&format!("input.step{step}.hidden_states"))
        .is_some()
    {
        let p = format!("step{step}.");
        let (y, rows) = run(&p, &mut cache)?;
        let err = max_err(&y, fx.tensor(&format!("output.{p}attn_output"))?, rows.as_ref())?;
        println!("step {step:<4} cache {:<3} max abs err {err:.3e}", cache.len());
        step += 1;
    }

    // Speed: more single-token steps with random inputs (no padding), after the checked ones.
    if !cross && extra > 0 {
        let (b, _, hidden) = fx.tensor("input.hidden_states")?.dims3()?;
        let start = cache.seen();
        let limit = cfg.max_position_embeddings.unwrap_or(usize::MAX);
        let n = extra.min(limit.saturating_sub(start));
        let xs = Tensor::randn(0f32, 1f32, (n, b, 1, hidden), &dev)?.to_dtype(fx.dtype)?;
        let t0 = Instant::now();
        for i in 0..n {
            let pos = Tensor::full((start + i) as i64, (b, 1), &dev)?;
            layer.forward_cached(&xs.get(i)?, &pos, None, Some(&mut cache))?;
        }
        let dt = t0.elapsed().as_secs_f64();
        println!(
            "{n} more decode steps: {:.0} steps/s (batch {b}, cache {} tokens at the end)",
            n as f64 / dt,
            cache.len()
        );
    }
    Ok(())
}
