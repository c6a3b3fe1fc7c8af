//! `MultiheadAttention` and the notes' modules: loading, invariances and errors.
mod common;
use std::collections::HashMap;

use candle_attention::{
    scaled_dot_product_attention, AttentionConfig, AttnMask, Backend, CausalAttention, MhaArgs,
    MultiHeadAttention, MultiheadAttention, MultiheadAttentionConfig, Proj, ProjNames,
    ScaledDotProductAttention, SdpaOptions,
};
use candle_core::{DType, Device, IndexOp, Module, Result, Tensor};
use candle_nn::VarBuilder;
use common::{all_zero, err_msg, max_diff, randn};

fn vb(tensors: Vec<(&str, Tensor)>) -> VarBuilder<'static> {
    let map: HashMap<String, Tensor> = tensors.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    VarBuilder::from_tensors(map, DType::F32, &Device::Cpu)
}

fn mha_params(e: usize) -> Result<Vec<(&'static str, Tensor)>> {
    Ok(vec![
        ("in_proj_weight", (randn(&[3 * e, e])? * 0.3)?),
        ("in_proj_bias", randn(&[3 * e])?),
        ("out_proj.weight", (randn(&[e, e])? * 0.3)?),
        ("out_proj.bias", randn(&[e])?),
    ])
}

fn args<'a>() -> MhaArgs<'a> {
    MhaArgs {
        need_weights: false,
        ..MhaArgs::default()
    }
}

#[test]
fn module_forward_is_unmasked_self_attention() -> Result<()> {
    let cfg = MultiheadAttentionConfig {
        batch_first: true,
        ..MultiheadAttentionConfig::new(12, 3)
    };
    let mha = MultiheadAttention::new(&cfg, vb(mha_params(12)?))?;
    let x = randn(&[2, 5, 12])?;
    let a = mha.forward(&x)?;
    let (b, _) = mha.forward_with(&x, &x, &x, &args())?;
    assert_eq!(max_diff(&a, &b)?, 0.0);
    // With weights the reference path runs instead of the fused kernel: equal within f32 tolerance.
    let (c, w) = mha.forward_with(&x, &x, &x, &MhaArgs::default())?;
    assert!(max_diff(&a, &c)? < 1e-5);
    assert_eq!(w.unwrap().dims(), &[2, 5, 5]);
    Ok(())
}

/// Self-attention (query, key and value the same tensor) takes one product with the
/// whole `in_proj_weight`; it must equal three separate projections, which distinct
/// tensors of the same values take. Sizes on both sides of the CPU kernel's threshold,
/// with and without the kernel's SDPA.
#[test]
fn self_attention_projection_equals_separate_projections() -> Result<()> {
    for (e, h, n, l) in [(12, 3, 2, 5), (64, 4, 2, 40)] {
        let cfg = MultiheadAttentionConfig {
            batch_first: true,
            ..MultiheadAttentionConfig::new(e, h)
        };
        let mha = MultiheadAttention::new(&cfg, vb(mha_params(e)?))?;
        let x = randn(&[n, l, e])?;
        let (k, v) = (x.copy()?, x.copy()?);
        for a in [args(), MhaArgs::default()] {
            let (fused, _) = mha.forward_with(&x, &x, &x, &a)?;
            let (split, _) = mha.forward_with(&x, &k, &v, &a)?;
            let d = max_diff(&fused, &split)?;
            assert!(d < 1e-5, "E {e} L {l} need_weights {}: diff {d}", a.need_weights);
        }
    }
    Ok(())
}

#[test]
fn seq_first_equals_batch_first_and_unbatched() -> Result<()> {
    let p = mha_params(12)?;
    let bf = MultiheadAttention::new(
        &MultiheadAttentionConfig {
            batch_first: true,
            ..MultiheadAttentionConfig::new(12, 3)
        },
        vb(p.clone()),
    )?;
    let sf = MultiheadAttention::new(&MultiheadAttentionConfig::new(12, 3), vb(p))?;
    let q = randn(&[2, 5, 12])?;
    let kv = randn(&[2, 7, 12])?;
    let (a, wa) = bf.forward_with(&q, &kv, &kv, &MhaArgs::default())?;
    let (b, wb) = sf.forward_with(
        &q.transpose(0, 1)?,
        &kv.transpose(0, 1)?,
        &kv.transpose(0, 1)?,
        &MhaArgs::default(),
    )?;
    assert!(max_diff(&a, &b.transpose(0, 1)?)? < 1e-6);
    assert!(max_diff(&wa.unwrap(), &wb.unwrap())? < 1e-6);
    let (u, _) = sf.forward_with(&q.get(1)?, &kv.get(1)?, &kv.get(1)?, &args())?;
    // One sequence alone sends fewer rows through the projections than the batch, which
    // can take another product (its sums in another order): allow f32 rounding at the
    // outputs' size (an absolute 1e-6 failed 3 times in 300 runs).
    let scale = a.abs()?.max_all()?.to_scalar::<f32>()?.max(1.0) as f64;
    let d = max_diff(&u, &a.get(1)?)?;
    assert!(d < 1e-6 * scale, "unbatched: diff {d}, outputs up to {scale}");
    Ok(())
}

#[test]
fn padded_batch_equals_each_sequence_alone() -> Result<()> {
    let cfg = MultiheadAttentionConfig {
        batch_first: true,
        ..MultiheadAttentionConfig::new(12, 3)
    };
    let mha = MultiheadAttention::new(&cfg, vb(mha_params(12)?))?;
    let q = randn(&[2, 4, 12])?;
    let kv = randn(&[2, 6, 12])?;
    let kpm = Tensor::new(&[[0u8, 0, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1]], &Device::Cpu)?;
    let a = MhaArgs {
        key_padding_mask: Some(&kpm),
        need_weights: true,
        ..MhaArgs::default()
    };
    let (batch, w) = mha.forward_with(&q, &kv, &kv, &a)?;
    for (b, len) in [(0usize, 6usize), (1, 3)] {
        let kvb = kv.narrow(0, b, 1)?.narrow(1, 0, len)?;
        let (alone, _) = mha.forward_with(&q.narrow(0, b, 1)?, &kvb, &kvb, &args())?;
        assert!(max_diff(&batch.narrow(0, b, 1)?, &alone)? < 1e-5, "row {b}");
    }
    // Padded keys get zero weight.
    let w = w.unwrap();
    assert!(all_zero(&w.get(1)?.narrow(1, 3, 3)?)?);
    Ok(())
}

#[test]
fn bool_and_float_masks_agree() -> Result<()> {
    let cfg = MultiheadAttentionConfig {
        batch_first: true,
        ..MultiheadAttentionConfig::new(12, 3)
    };
    let mha = MultiheadAttention::new(&cfg, vb(mha_params(12)?))?;
    let x = randn(&[2, 5, 12])?;
    let blocked = Tensor::new(
        &[
            [0u8, 1, 0, 0, 1],
            [0, 0, 0, 1, 0],
            [1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 1, 0, 0, 0],
        ],
        &Device::Cpu,
    )?;
    let float = blocked.where_cond(
        &Tensor::full(f32::NEG_INFINITY, (5, 5), &Device::Cpu)?,
        &Tensor::zeros((5, 5), DType::F32, &Device::Cpu)?,
    )?;
    let (a, _) = mha.forward_with(
        &x,
        &x,
        &x,
        &MhaArgs {
            attn_mask: Some(&blocked),
            ..args()
        },
    )?;
    let (b, _) = mha.forward_with(
        &x,
        &x,
        &x,
        &MhaArgs {
            attn_mask: Some(&float),
            ..args()
        },
    )?;
    let (c, _) = mha.forward_with(&x, &x, &x, &args())?;
    assert!(max_diff(&a, &b)? < 1e-6);
    assert!(max_diff(&a, &c)? > 1e-3);
    Ok(())
}

/// `is_causal` gives what PyTorch gives for the causal `attn_mask` it stands for, with
/// or without that mask, and with keys appended by `add_bias_kv` and `add_zero_attn`:
/// PyTorch pads `attn_mask` with visible columns for them, so the rule covers only the
/// given keys (a rule over all keys would hide the appended ones).
#[test]
fn is_causal_equals_a_causal_attn_mask() -> Result<()> {
    // MHA's bool mask: true = blocked, so the causal mask is the strict upper triangle.
    let blocked: Vec<u8> = (0..25).map(|i| ((i % 5) > (i / 5)) as u8).collect();
    let blocked = Tensor::from_vec(blocked, (5, 5), &Device::Cpu)?;
    let x = randn(&[2, 5, 12])?;
    for (add_bias_kv, add_zero_attn) in [(false, false), (true, false), (false, true), (true, true)] {
        let cfg = MultiheadAttentionConfig {
            batch_first: true,
            add_bias_kv,
            add_zero_attn,
            ..MultiheadAttentionConfig::new(12, 3)
        };
        let mut params = mha_params(12)?;
        if add_bias_kv {
            params.push(("bias_k", randn(&[1, 1, 12])?));
            params.push(("bias_v", randn(&[1, 1, 12])?));
        }
        let mha = MultiheadAttention::new(&cfg, vb(params))?;
        for need_weights in [false, true] {
            let what = format!("bias_kv {add_bias_kv}, zero_attn {add_zero_attn}, weights {need_weights}");
            let run = |is_causal: bool, attn_mask: Option<&Tensor>| {
                let a = MhaArgs {
                    is_causal,
                    attn_mask,
                    need_weights,
                    ..args()
                };
                mha.forward_with(&x, &x, &x, &a)
            };
            let (a, wa) = run(false, Some(&blocked))?;
            for (b, wb) in [run(true, None)?, run(true, Some(&blocked))?] {
                assert!(max_diff(&a, &b)? < 1e-6, "{what}: {}", max_diff(&a, &b)?);
                if let (Some(wa), Some(wb)) = (&wa, &wb) {
                    assert!(max_diff(wa, wb)? < 1e-6, "{what}: weights {}", max_diff(wa, wb)?);
                }
            }
            // The appended keys are seen: the first query row puts weight on them.
            if let Some(w) = &wa {
                let extra = add_bias_kv as usize + add_zero_attn as usize;
                let tail = w
                    .narrow(2, 5, extra)?
                    .narrow(1, 0, 1)?
                    .sum_all()?
                    .to_scalar::<f32>()?;
                assert!(extra == 0 || tail > 1e-3, "{what}: {tail}");
            }
        }
    }
    Ok(())
}

#[test]
fn config_deserializes_with_torch_defaults() -> Result<()> {
    let cfg: MultiheadAttentionConfig =
        serde_json::from_str(r#"{"embed_dim": 16, "num_heads": 4, "kdim": null, "device": "cpu"}"#).unwrap();
    assert_eq!(cfg, MultiheadAttentionConfig::new(16, 4));
    assert!(serde_json::from_str::<MultiheadAttentionConfig>(r#"{"embed_dim": 16}"#).is_err());
    Ok(())
}

#[test]
fn embed_dim_must_divide_by_heads() -> Result<()> {
    let msg = err_msg(MultiheadAttention::new(
        &MultiheadAttentionConfig::new(10, 3),
        vb(mha_params(10)?),
    ));
    assert!(msg.contains("10") && msg.contains('3'), "{msg}");
    let msg = err_msg(MultiHeadAttention::new(&AttentionConfig::new(10, 4), vb(vec![])));
    assert!(msg.contains("10") && msg.contains('4'), "{msg}");
    Ok(())
}

#[test]
fn missing_or_misshapen_weights_name_the_key_and_shapes() -> Result<()> {
    let mut p = mha_params(8)?;
    p.retain(|(k, _)| *k != "out_proj.bias");
    let msg = err_msg(MultiheadAttention::new(
        &MultiheadAttentionConfig::new(8, 2),
        vb(p),
    ));
    assert!(msg.contains("out_proj.bias"), "{msg}");

    let mut p = mha_params(8)?;
    p[0] = ("in_proj_weight", randn(&[24, 7])?);
    let msg = err_msg(MultiheadAttention::new(
        &MultiheadAttentionConfig::new(8, 2),
        vb(p),
    ));
    assert!(
        msg.contains("in_proj_weight") && msg.contains("[24, 8]") && msg.contains("[24, 7]"),
        "{msg}"
    );

    // kdim != embed_dim needs the separate projection keys.
    let cfg = MultiheadAttentionConfig {
        kdim: Some(5),
        ..MultiheadAttentionConfig::new(8, 2)
    };
    let msg = err_msg(MultiheadAttention::new(&cfg, vb(mha_params(8)?)));
    assert!(msg.contains("q_proj_weight"), "{msg}");

    let msg = err_msg(MultiHeadAttention::new(&AttentionConfig::new(8, 2), vb(vec![])));
    assert!(msg.contains("wq.weight"), "{msg}");
    let cfg = AttentionConfig {
        names: ProjNames::hf(),
        ..AttentionConfig::new(8, 2)
    };
    let ps = vec![("q_proj.weight", randn(&[8, 8])?), ("q_proj.bias", randn(&[9])?)];
    let msg = err_msg(MultiHeadAttention::new(&cfg, vb(ps)));
    assert!(
        msg.contains("q_proj.bias") && msg.contains("[8]") && msg.contains("[9]"),
        "{msg}"
    );
    Ok(())
}

#[test]
fn bad_inputs_are_errors() -> Result<()> {
    let mha = MultiheadAttention::new(&MultiheadAttentionConfig::new(8, 2), vb(mha_params(8)?))?;
    let x = randn(&[5, 2, 8])?;
    // rank
    let msg = err_msg(mha.forward_with(&x, &x.get(0)?, &x, &args()));
    assert!(msg.contains("[5, 2, 8]") && msg.contains("[2, 8]"), "{msg}");
    let msg = err_msg(mha.forward(&randn(&[1, 5, 2, 8])?));
    assert!(msg.contains("[1, 5, 2, 8]"), "{msg}");
    // feature dim
    let msg = err_msg(mha.forward(&randn(&[5, 2, 9])?));
    assert!(msg.contains("[5, 2, 9]"), "{msg}");
    // batch mismatch between query and key
    let kv = randn(&[6, 3, 8])?;
    let msg = err_msg(mha.forward_with(&x, &kv, &kv, &args()));
    assert!(msg.contains("[6, 3, 8]"), "{msg}");
    // attn_mask shape
    let am = Tensor::zeros((4, 5), DType::U8, &Device::Cpu)?;
    let msg = err_msg(mha.forward_with(
        &x,
        &x,
        &x,
        &MhaArgs {
            attn_mask: Some(&am),
            ..args()
        },
    ));
    assert!(msg.contains("[4, 5]") && msg.contains("(5, 5)"), "{msg}");
    // key_padding_mask shape
    let kpm = Tensor::zeros((5, 2), DType::U8, &Device::Cpu)?;
    let msg = err_msg(mha.forward_with(
        &x,
        &x,
        &x,
        &MhaArgs {
            key_padding_mask: Some(&kpm),
            ..args()
        },
    ));
    assert!(msg.contains("[5, 2]") && msg.contains("[2, 5]"), "{msg}");
    // notes modules
    let l = MultiHeadAttention::new(
        &AttentionConfig::new(8, 2),
        vb(notes_params(&ProjNames::default(), 8)?),
    )?;
    let msg = err_msg(l.forward(&randn(&[2, 5, 7])?));
    assert!(msg.contains("[2, 5, 7]"), "{msg}");
    let msg = err_msg(ScaledDotProductAttention::new(4).forward(&randn(&[2, 5, 7])?));
    assert!(msg.contains("[2, 5, 7]"), "{msg}");
    // sizes whose weights overflow usize (a corrupt config)
    let huge = 1usize << 33;
    let msg = err_msg(MultiheadAttention::new(
        &MultiheadAttentionConfig::new(huge, 2),
        vb(vec![]),
    ));
    assert!(
        msg.contains("overflow") && msg.contains(&huge.to_string()),
        "{msg}"
    );
    let msg = err_msg(MultiHeadAttention::new(
        &AttentionConfig::new(huge, 2),
        vb(vec![]),
    ));
    assert!(msg.contains(&format!("({huge}, {huge})")), "{msg}");
    Ok(())
}

fn notes_params(names: &ProjNames, d: usize) -> Result<Vec<(&'static str, Tensor)>> {
    let mut v = Vec::new();
    for n in [&names.q, &names.k, &names.v, &names.o] {
        let w: &'static str = Box::leak(format!("{n}.weight").into_boxed_str());
        let b: &'static str = Box::leak(format!("{n}.bias").into_boxed_str());
        v.push((w, (randn(&[d, d])? * 0.3)?));
        v.push((b, randn(&[d])?));
    }
    Ok(v)
}

#[test]
fn notes_modules_attend_over_positions_per_head() -> Result<()> {
    let names = ProjNames::hf();
    let p = notes_params(&names, 8)?;
    let cfg = AttentionConfig {
        names: names.clone(),
        ..AttentionConfig::new(8, 2)
    };
    let notes = MultiHeadAttention::new(&cfg, vb(p.clone()))?;
    // The same weights as an nn.MultiheadAttention (packed in_proj) must agree.
    let get = |k: &str| p.iter().find(|(n, _)| *n == k).map(|(_, t)| t.clone()).unwrap();
    let mha_p = vec![
        (
            "in_proj_weight",
            Tensor::cat(
                &[get("q_proj.weight"), get("k_proj.weight"), get("v_proj.weight")],
                0,
            )?,
        ),
        (
            "in_proj_bias",
            Tensor::cat(&[get("q_proj.bias"), get("k_proj.bias"), get("v_proj.bias")], 0)?,
        ),
        ("out_proj.weight", get("o_proj.weight")),
        ("out_proj.bias", get("o_proj.bias")),
    ];
    let mha = MultiheadAttention::new(
        &MultiheadAttentionConfig {
            batch_first: true,
            ..MultiheadAttentionConfig::new(8, 2)
        },
        vb(mha_p),
    )?;
    let x = randn(&[2, 5, 8])?;
    assert!(max_diff(&notes.forward(&x)?, &mha.forward(&x)?)? < 1e-5);
    let causal = CausalAttention::new(&cfg, vb(p))?;
    let (c, _) = mha.forward_with(
        &x,
        &x,
        &x,
        &MhaArgs {
            is_causal: true,
            ..args()
        },
    )?;
    assert!(max_diff(&causal.forward(&x)?, &c)? < 1e-5);
    // An extra mask combines with the causal rule.
    let pad = Tensor::new(&[[0u8, 0, 0, 0, 0], [0, 0, 0, 1, 1]], &Device::Cpu)?;
    let kpm = AttnMask::key_padding(&pad)?;
    let a = causal.forward_masked(&x, &x, &x, Some(&kpm))?;
    let (b, _) = mha.forward_with(
        &x,
        &x,
        &x,
        &MhaArgs {
            is_causal: true,
            key_padding_mask: Some(&pad),
            ..args()
        },
    )?;
    assert!(max_diff(&a, &b)? < 1e-5);
    Ok(())
}

/// An f16/bf16 `MultiheadAttention`, and the notes' multi-head modules, round q, k, v and
/// the attention output to their dtype, as PyTorch's `nn.Linear` layers return them: the
/// output equals that pipeline built from the crate's pieces bit for bit (the reference
/// SDPA on both sides), and differs from the same pipeline kept in f32 until the end.
#[test]
fn half_precision_layers_round_each_projection_to_their_dtype() -> Result<()> {
    let (e, h, n, l) = (64, 4, 2, 40);
    let x32 = randn(&[n, l, e])?;
    let reference = SdpaOptions {
        backend: Backend::Reference,
        ..SdpaOptions::default()
    };
    // Heads of `(N, L, E)`, the attention, and its output `(N, L, E)`.
    let attend = |q: &Tensor, k: &Tensor, v: &Tensor, causal: bool| -> Result<Tensor> {
        let heads = |t: &Tensor| t.reshape((n, l, h, e / h))?.transpose(1, 2);
        let opts = SdpaOptions {
            is_causal: causal,
            ..reference.clone()
        };
        let o = scaled_dot_product_attention(&heads(q)?, &heads(k)?, &heads(v)?, &opts)?.output;
        o.transpose(1, 2)?.reshape((n, l, e))
    };
    for dt in [DType::BF16, DType::F16] {
        let x = x32.to_dtype(dt)?;
        let round = |t: Tensor, yes: bool| if yes { t.to_dtype(dt) } else { Ok(t) };
        let load = |p: Vec<(&str, Tensor)>| -> Result<VarBuilder<'static>> {
            let map: HashMap<String, Tensor> = p
                .into_iter()
                .map(|(k, v)| Ok((k.to_string(), v.to_dtype(dt)?)))
                .collect::<Result<_>>()?;
            Ok(VarBuilder::from_tensors(map, dt, &Device::Cpu))
        };

        let p = mha_params(e)?;
        let get = |k: &str| {
            p.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, t)| t.to_dtype(dt))
                .unwrap()
        };
        let cfg = MultiheadAttentionConfig {
            batch_first: true,
            ..MultiheadAttentionConfig::new(e, h)
        };
        let mha = MultiheadAttention::new(&cfg, load(p.clone())?)?;
        let a = MhaArgs {
            backend: Backend::Reference,
            ..args()
        };
        let (got, _) = mha.forward_with(&x, &x, &x, &a)?;
        let (inp, out) = (
            Proj::new(get("in_proj_weight")?, Some(get("in_proj_bias")?)),
            Proj::new(get("out_proj.weight")?, Some(get("out_proj.bias")?)),
        );
        let by_hand = |rounded: bool| -> Result<Tensor> {
            let y = round(inp.forward(&x)?, rounded)?;
            let o = attend(
                &y.i((.., .., 0..e))?,
                &y.i((.., .., e..2 * e))?,
                &y.i((.., .., 2 * e..))?,
                false,
            )?;
            out.forward(&round(o, rounded)?)?.to_dtype(dt)
        };
        assert_eq!(max_diff(&got, &by_hand(true)?)?, 0.0, "{dt:?} MultiheadAttention");
        assert!(
            max_diff(&got, &by_hand(false)?)? > 0.0,
            "{dt:?}: f32 intermediates give the same bits"
        );

        let names = ProjNames::hf();
        let p = notes_params(&names, e)?;
        let get = |k: &str| {
            p.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, t)| t.to_dtype(dt))
                .unwrap()
        };
        let proj = |r: &str| -> Result<Proj> {
            Ok(Proj::new(
                get(&format!("{r}.weight"))?,
                Some(get(&format!("{r}.bias"))?),
            ))
        };
        let (wq, wk, wv, wo) = (proj("q_proj")?, proj("k_proj")?, proj("v_proj")?, proj("o_proj")?);
        let ncfg = AttentionConfig {
            names,
            ..AttentionConfig::new(e, h)
        };
        let notes = MultiHeadAttention::new(&ncfg, load(p.clone())?)?.with_backend(Backend::Reference);
        let causal = CausalAttention::new(&ncfg, load(p.clone())?)?.with_backend(Backend::Reference);
        for (module, is_causal) in [(&notes as &dyn Module, false), (&causal, true)] {
            let by_hand = |rounded: bool| -> Result<Tensor> {
                let qkv = [&wq, &wk, &wv].map(|w| round(w.forward(&x)?, rounded));
                let [q, k, v] = qkv;
                let o = attend(&q?, &k?, &v?, is_causal)?;
                wo.forward(&round(o, rounded)?)?.to_dtype(dt)
            };
            let got = module.forward(&x)?;
            assert_eq!(
                max_diff(&got, &by_hand(true)?)?,
                0.0,
                "{dt:?} notes, causal {is_causal}"
            );
            assert!(
                max_diff(&got, &by_hand(false)?)? > 0.0,
                "{dt:?} notes, causal {is_causal}"
            );
        }
    }
    Ok(())
}
