//! Ropes whose frequencies depend on the length of the call: LongRoPE (Phi-3-mini-128k,
//! Phi-3.5, Phi-4-mini) and dynamic NTK scaling. The frequencies, the attention factor and the
//! per-call switch against what transformers computes, and the errors for bad inputs.
//!
//! Expected values come from files that `scripts/export_fixtures.py` writes with transformers:
//! `weights/hf_config_defaults.json` records, for each longrope or dynamic layer, transformers'
//! rotary module (attention scaling, and frequencies and cos/sin of calls below, at and past
//! the switch, then below it again); the `hf_attention__phi3_longrope_*` fixtures hold a Phi-3
//! model's attention output over a prefill within `original_max_position_embeddings` and
//! decode steps beyond it.
mod common;
use std::path::{Path, PathBuf};

use candle_attention::decoder::{DecoderAttentionConfig, HfConfig};
use candle_attention::fixture::{Fixture, RunOptions};
use candle_attention::{RopeConfig, RopeScaling, RopeStyle, RotaryEmbedding};
use candle_core::{DType, Device, Result, Tensor};
use common::err_msg;
use serde_json::{json, Value};

fn weights() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("weights")
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .expect("a list of numbers")
        .iter()
        .map(|x| x.as_f64().expect("a number"))
        .collect()
}

/// `max_i |a_i - b_i| / max_i |b_i|`; the lengths must match.
fn rel_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
    let scale = b.iter().fold(0f64, |m, x| m.max(x.abs()));
    a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// Every layer of `weights/hf_config_defaults.json` whose rope type is `kind` and that
/// carries a record of transformers' rotary module: (case name, architecture, config, layer
/// index, the layer's record).
fn rotary_layers(kind: &str) -> Vec<(String, String, HfConfig, usize, Value)> {
    let path = weights().join("hf_config_defaults.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let doc: Value = serde_json::from_str(&text).expect("hf_config_defaults.json is JSON");
    let mut out = Vec::new();
    for case in doc["cases"].as_array().expect("a list of cases") {
        let cfg = HfConfig::from_json(&case["config"].to_string()).expect("a config.json");
        for (i, layer) in case["layers"].as_array().unwrap().iter().enumerate() {
            if layer.get("rotary").is_some() && layer["rope"]["rope_type"] == kind {
                out.push((
                    case["name"].as_str().unwrap().to_string(),
                    case["architecture"].as_str().unwrap().to_string(),
                    cfg.clone(),
                    i,
                    layer.clone(),
                ));
            }
        }
    }
    out
}

fn rope_of(arch: &str, cfg: &HfConfig, layer: usize) -> Result<RotaryEmbedding> {
    let dec = DecoderAttentionConfig::from_hf(arch, cfg, layer, false)?;
    RotaryEmbedding::new(dec.rope.as_ref().expect("a rope layer"))
}

/// The attention scaling, and for each recorded call (largest position below, at or past the
/// switch) the frequencies and cos/sin, equal transformers' rotary module.
#[test]
fn frequencies_and_scaling_of_each_call_are_transformers() -> Result<()> {
    let (long, dynamic) = (rotary_layers("longrope"), rotary_layers("dynamic"));
    assert!(long.len() >= 12, "{} longrope layers", long.len());
    assert!(dynamic.len() >= 3, "{} dynamic layers", dynamic.len());
    let mut failures = Vec::new();
    for (name, arch, cfg, i, want) in long.iter().chain(&dynamic) {
        let rope = rope_of(arch, cfg, *i)?;
        let rotary = &want["rotary"];
        let att = rotary["attention_scaling"].as_f64().unwrap();
        if (rope.attention_scaling() - att).abs() > 1e-15 * att {
            failures.push(format!(
                "{name}: attention scaling {}, transformers {att}",
                rope.attention_scaling()
            ));
        }
        for call in rotary["calls"].as_array().unwrap() {
            let p = call["max_position"].as_u64().unwrap();
            let inv = floats(&call["inv_freq"]);
            let err = rel_diff(&rope.inv_freq_for_max_position(p), &inv);
            if err > 1e-15 {
                failures.push(format!("{name}: inv_freq at max position {p}: rel err {err:.1e}"));
            }
            // cos/sin of the call `[[0, p]]` at position p, in f64.
            let pos = Tensor::new(&[[0i64, p as i64]], &Device::Cpu)?;
            let (cos, sin) = rope.cos_sin(&pos, DType::F64)?;
            for (what, got, key) in [("cos", cos, "cos"), ("sin", sin, "sin")] {
                let got = got.get(0)?.get(1)?.to_vec1::<f64>()?;
                let err = rel_diff(&got, &floats(&call[key]));
                if err > 1e-12 {
                    failures.push(format!("{name}: {what} at position {p}: rel err {err:.1e}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    Ok(())
}

/// The switch: a call whose largest position id `p` has `p + 1 > original_max_position_embeddings`
/// takes the long set, every other call the short set, statelessly, and the largest position
/// of the whole batch decides for every row.
#[test]
fn longrope_switches_per_call_at_the_original_length() -> Result<()> {
    for (name, arch, cfg, i, want) in rotary_layers("longrope") {
        let rope = rope_of(&arch, &cfg, i)?;
        let old = want["rope"]["original_max_position_embeddings"].as_u64().unwrap();
        let calls = want["rotary"]["calls"].as_array().unwrap();
        let at = |p: u64| -> Vec<f64> {
            let call = calls
                .iter()
                .find(|c| c["max_position"] == p)
                .expect("a recorded call");
            floats(&call["inv_freq"])
        };
        let (short, long) = (at(old - 1), at(old));
        assert!(rel_diff(rope.inv_freq(), &short) < 1e-15, "{name}");
        assert!(
            rel_diff(rope.long_inv_freq().expect("a long set"), &long) < 1e-15,
            "{name}"
        );
        assert_eq!(rope.inv_freq_for_max_position(old - 1), rope.inv_freq(), "{name}");
        assert_eq!(
            rope.inv_freq_for_max_position(old),
            rope.long_inv_freq().unwrap(),
            "{name}"
        );
        assert_eq!(rope.inv_freq_for_max_position(0), rope.inv_freq(), "{name}");
        assert_eq!(
            rope.inv_freq_for_max_position(u64::MAX),
            rope.long_inv_freq().unwrap(),
            "{name}"
        );
        // Row 1 sits at position 10 in both calls; row 0's position picks the set for both.
        let att = rope.attention_scaling();
        for (p, set) in [(old - 1, &short), (old, &long), (old - 1, &short)] {
            let pos = Tensor::new(&[[p as i64], [10]], &Device::Cpu)?;
            let (cos, _) = rope.cos_sin(&pos, DType::F64)?;
            let row1 = cos.get(1)?.get(0)?.to_vec1::<f64>()?;
            let want: Vec<f64> = set.iter().map(|f| (10.0 * f).cos() * att).collect();
            assert!(
                rel_diff(&row1, &want) < 1e-14,
                "{name}: row 1 in a call up to {p}"
            );
        }
    }
    Ok(())
}

fn longrope_fixtures() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(weights())
        .expect("weights/ is listable")
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("hf_attention__phi3_longrope_"))
        })
        .collect();
    files.sort();
    files
}

/// The Phi-3 longrope fixtures pass, and they pin the switch: a layer that never switches,
/// always takes the long factors, or switches one position early or late fails them.
#[test]
fn longrope_fixtures_pass_and_pin_the_switch() -> Result<()> {
    let files = longrope_fixtures();
    assert_eq!(files.len(), 6, "{files:?}");
    let opts = RunOptions::default();
    for f in &files {
        let fx = Fixture::load(f, &Device::Cpu)?;
        let r = fx.run(&opts)?;
        assert!(
            r.pass,
            "{}: rel err {:.1e} > {:.0e}",
            r.name, r.max_rel_err, r.tol
        );
        // The attention scaling the layer derives, pinned so that moving the switch point
        // below changes nothing else.
        let hf: HfConfig = serde_json::from_value(fx.config.clone()).unwrap();
        let att = rope_of("phi3", &hf, 0)?.attention_scaling();
        let rp = &fx.config["rope_parameters"];
        let old = fx.config["original_max_position_embeddings"].as_u64().unwrap();
        let variants: Vec<(&str, Value)> = vec![
            ("never switches", json!({"long_factor": rp["short_factor"]})),
            ("always long", json!({"short_factor": rp["long_factor"]})),
            (
                "switches one position early",
                json!({"original_max_position_embeddings": old - 1}),
            ),
            (
                "switches one position late",
                json!({"original_max_position_embeddings": old + 1}),
            ),
        ];
        for (what, change) in variants {
            let mut bad = Fixture::load(f, &Device::Cpu)?;
            bad.config["rope_parameters"]["attention_factor"] = json!(att);
            for (k, v) in change.as_object().unwrap() {
                bad.config["rope_parameters"][k] = v.clone();
                if k == "original_max_position_embeddings" {
                    bad.config[k] = v.clone(); // the top-level key wins
                }
            }
            let r = bad.run(&opts)?;
            assert!(
                !r.pass && r.max_rel_err > 10.0 * r.tol,
                "{}: a layer that {what} passes (rel err {:.1e}, tol {:.0e})",
                r.name,
                r.max_rel_err,
                r.tol
            );
        }
    }
    Ok(())
}

fn longrope(short: Vec<f64>, long: Vec<f64>) -> RopeScaling {
    RopeScaling::LongRope {
        short_factor: short,
        long_factor: long,
        original_max_position_embeddings: 4096.0,
        factor: 32.0,
        attention_factor: None,
    }
}

fn rope(scaling: RopeScaling) -> Result<RotaryEmbedding> {
    RotaryEmbedding::new(&RopeConfig {
        head_dim: 8,
        rotary_dim: 8,
        theta: 1e4,
        style: RopeStyle::HalfSplit,
        scaling,
    })
}

#[test]
fn bad_longrope_scalings_are_errors_that_name_the_key() -> Result<()> {
    let ok = || vec![1.0; 4];
    rope(longrope(ok(), ok()))?;
    let msg = err_msg(rope(longrope(vec![1.0; 3], ok())));
    assert!(
        msg.contains("short_factor") && msg.contains("rotary_dim/2 = 4") && msg.contains("got 3"),
        "{msg}"
    );
    let msg = err_msg(rope(longrope(ok(), vec![1.0; 5])));
    assert!(msg.contains("long_factor") && msg.contains("got 5"), "{msg}");
    for (bad, shown) in [
        (f64::NAN, "NaN"),
        (f64::INFINITY, "inf"),
        (0.0, "0"),
        (-2.0, "-2"),
    ] {
        let msg = err_msg(rope(longrope(ok(), vec![1.0, 1.0, bad, 1.0])));
        assert!(msg.contains("long_factor[2]") && msg.contains(shown), "{msg}");
        let msg = err_msg(rope(longrope(vec![bad, 1.0, 1.0, 1.0], ok())));
        assert!(msg.contains("short_factor[0]") && msg.contains(shown), "{msg}");
    }
    let with = |f: &dyn Fn(&mut RopeScaling)| {
        let mut s = longrope(ok(), ok());
        f(&mut s);
        err_msg(rope(s))
    };
    let msg = with(&|s| {
        if let RopeScaling::LongRope { factor, .. } = s {
            *factor = f64::NAN
        }
    });
    assert!(msg.contains("factor"), "{msg}");
    let msg = with(&|s| {
        if let RopeScaling::LongRope { attention_factor, .. } = s {
            *attention_factor = Some(-1.0)
        }
    });
    assert!(msg.contains("attention_factor"), "{msg}");
    let msg = with(&|s| {
        if let RopeScaling::LongRope {
            original_max_position_embeddings,
            ..
        } = s
        {
            *original_max_position_embeddings = f64::INFINITY
        }
    });
    assert!(msg.contains("original_max_position_embeddings"), "{msg}");
    // The default attention factor divides by ln(original): 1 would divide by zero.
    let msg = with(&|s| {
        if let RopeScaling::LongRope {
            original_max_position_embeddings,
            ..
        } = s
        {
            *original_max_position_embeddings = 1.0
        }
    });
    assert!(msg.contains("original_max_position_embeddings > 1"), "{msg}");
    // Factors so small that a frequency overflows.
    let msg = err_msg(rope(longrope(vec![1e-320, 1.0, 1.0, 1.0], ok())));
    assert!(msg.contains("non-finite"), "{msg}");
    Ok(())
}

/// No positions: empty tables, whatever the set.
#[test]
fn longrope_takes_empty_and_huge_positions() -> Result<()> {
    let r = rope(longrope(vec![1.0; 4], vec![2.0; 4]))?;
    let (cos, sin) = r.cos_sin(&Tensor::zeros((2, 0), DType::I64, &Device::Cpu)?, DType::F32)?;
    assert_eq!(cos.dims(), [2, 0, 4]);
    assert_eq!(sin.dims(), [2, 0, 4]);
    let (cos, _) = r.cos_sin(&Tensor::new(&[[i64::MAX]], &Device::Cpu)?, DType::F32)?;
    assert_eq!(cos.dims(), [1, 1, 4]);
    let msg = err_msg(r.cos_sin(&Tensor::new(&[[3i64, -1]], &Device::Cpu)?, DType::F32));
    assert!(msg.contains("-1"), "{msg}");
    Ok(())
}

fn hf(json: &str) -> HfConfig {
    HfConfig::from_json(json).unwrap()
}

fn from_hf(arch: &str, rope_scaling: &str) -> Result<DecoderAttentionConfig> {
    let json = format!(
        r#"{{"hidden_size": 32, "num_attention_heads": 4, "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096, "rope_scaling": {rope_scaling}}}"#
    );
    DecoderAttentionConfig::from_hf(arch, &hf(&json), 0, false)
}

#[test]
fn bad_longrope_configs_are_errors_that_name_the_key() -> Result<()> {
    let lists = r#""short_factor": [1, 1, 1, 1], "long_factor": [1, 2, 3, 4]"#;
    from_hf("phi3", &format!(r#"{{"type": "longrope", {lists}}}"#))?;
    from_hf("llama", &format!(r#"{{"rope_type": "longrope", {lists}}}"#))?;
    for (scaling, want) in [
        (
            r#"{"type": "longrope", "long_factor": [1, 2, 3, 4]}"#,
            &["missing field 'rope_parameters.short_factor'"][..],
        ),
        (
            r#"{"type": "longrope", "short_factor": [1, 1, 1, 1], "long_factor": null}"#,
            &["missing field 'rope_parameters.long_factor'"],
        ),
        (
            r#"{"type": "longrope", "short_factor": [1, 1, 1, 1], "long_factor": 2.0}"#,
            &["rope_parameters.long_factor must be a list"],
        ),
        (
            r#"{"type": "longrope", "short_factor": [1, 1, "x", 1], "long_factor": [1, 2, 3, 4]}"#,
            &["rope_parameters.short_factor[2] must be a number"],
        ),
        (
            r#"{"type": "longrope", "short_factor": [1, 1, 1], "long_factor": [1, 2, 3, 4]}"#,
            &["rope_parameters.short_factor has 3 entries", "rotary_dim/2 = 4"],
        ),
    ] {
        let msg = err_msg(from_hf("phi3", scaling));
        assert!(want.iter().all(|w| msg.contains(w)), "{scaling}: {msg}");
    }
    // Phi3Config accepts only default and longrope (su and yarn are renamed longrope).
    let msg = err_msg(from_hf("phi3", r#"{"type": "linear", "factor": 2.0}"#));
    assert!(msg.contains("'linear'") && msg.contains("Phi3Config"), "{msg}");
    // Other config classes do not know "su".
    let msg = err_msg(from_hf("llama", &format!(r#"{{"type": "su", {lists}}}"#)));
    assert!(
        msg.contains("unsupported rope_type 'su'") && msg.contains("longrope"),
        "{msg}"
    );
    // Without `factor` and `max_position_embeddings` (a llama config), no attention factor.
    let json = format!(
        r#"{{"hidden_size": 32, "num_attention_heads": 4,
            "rope_scaling": {{"rope_type": "longrope", "original_max_position_embeddings": 4096, {lists}}}}}"#
    );
    let msg = err_msg(DecoderAttentionConfig::from_hf("llama", &hf(&json), 0, false));
    assert!(msg.contains("missing field 'rope_parameters.factor'"), "{msg}");
    Ok(())
}

fn dynamic(factor: f64, max_position_embeddings: f64) -> RopeScaling {
    RopeScaling::DynamicNtk {
        factor,
        max_position_embeddings,
    }
}

/// Dynamic NTK decides from each call alone: plain RoPE up to `max_position_embeddings`,
/// grown frequencies past it, and plain again for a later short call. (transformers' stateful
/// module agrees on this order of calls; `hf_config_defaults.json` records it.)
#[test]
fn dynamic_ntk_is_plain_rope_within_max_positions_and_decided_per_call() -> Result<()> {
    let plain = rope(RopeScaling::Default)?;
    let r = rope(dynamic(2.0, 64.0))?;
    assert_eq!(r.inv_freq(), plain.inv_freq());
    assert_eq!(r.long_inv_freq(), None);
    assert_eq!(r.inv_freq_for_max_position(63), plain.inv_freq());
    let past = r.inv_freq_for_max_position(64).into_owned();
    assert_ne!(past, plain.inv_freq());
    // The lowest frequency (i = 0) is 1 whatever theta; the others shrink as theta grows.
    assert_eq!(past[0], 1.0);
    assert!(past[1..].iter().zip(&plain.inv_freq()[1..]).all(|(p, q)| p < q));
    let cos = |p: i64| -> Result<Vec<f64>> {
        let (c, _) = r.cos_sin(&Tensor::new(&[[p]], &Device::Cpu)?, DType::F64)?;
        c.get(0)?.get(0)?.to_vec1::<f64>()
    };
    let want = |inv: &[f64], p: f64| -> Vec<f64> { inv.iter().map(|f| (p * f).cos()).collect() };
    assert!(rel_diff(&cos(64)?, &want(&past, 64.0)) < 1e-15);
    assert!(rel_diff(&cos(10)?, &want(plain.inv_freq(), 10.0)) < 1e-15);
    // Empty and huge positions neither panic nor give non-finite tables.
    let (c, _) = r.cos_sin(&Tensor::zeros((1, 0), DType::I64, &Device::Cpu)?, DType::F32)?;
    assert_eq!(c.dims(), [1, 0, 4]);
    assert!(cos(i64::MAX)?.iter().all(|x| x.is_finite()));
    Ok(())
}

#[test]
fn bad_dynamic_ntk_scalings_and_configs_are_errors() -> Result<()> {
    for (f, m, key) in [
        (f64::NAN, 64.0, "factor"),
        (0.0, 64.0, "factor"),
        (2.0, 0.0, "max_position_embeddings"),
        (2.0, f64::INFINITY, "max_position_embeddings"),
    ] {
        let msg = err_msg(rope(dynamic(f, m)));
        assert!(msg.contains(key), "{msg}");
    }
    // theta grows by the power d/(d-2): a rotary size of 2 divides by zero (transformers
    // raises ZeroDivisionError).
    let msg = err_msg(RotaryEmbedding::new(&RopeConfig {
        head_dim: 8,
        rotary_dim: 2,
        theta: 1e4,
        style: RopeStyle::HalfSplit,
        scaling: dynamic(2.0, 64.0),
    }));
    assert!(msg.contains("rotary_dim > 2") && msg.contains("got 2"), "{msg}");
    // from_hf: the factor is required, and so is max_position_embeddings, which the rule
    // scales from (transformers would take the config class's default).
    from_hf("llama", r#"{"rope_type": "dynamic", "factor": 2.0}"#)?;
    let msg = err_msg(from_hf("llama", r#"{"rope_type": "dynamic"}"#));
    assert!(msg.contains("missing field 'rope_parameters.factor'"), "{msg}");
    let json = r#"{"hidden_size": 32, "num_attention_heads": 4,
        "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}"#;
    let msg = err_msg(DecoderAttentionConfig::from_hf("llama", &hf(json), 0, false));
    assert!(msg.contains("missing field 'max_position_embeddings'"), "{msg}");
    // Phi3Config refuses it.
    let msg = err_msg(from_hf("phi3", r#"{"rope_type": "dynamic", "factor": 2.0}"#));
    assert!(msg.contains("'dynamic'") && msg.contains("Phi3Config"), "{msg}");
    Ok(())
}
