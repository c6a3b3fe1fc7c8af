//! Small calls of the fused CPU kernel through [`sdpa`] (`Backend::Fused`), each checked
//! against a float64 loop written here rather than against the reference path.
//!
//! The calls are small enough to run under Miri, which checks the kernel's unsafe code
//! (the output row handles, the pack pipeline, the uninitialised output) and, with
//! rayon's threads, looks for data races: `scripts/test_miri.sh`. Miri sees no AVX, so
//! there the portable kernel runs. In `cargo test` each call runs on the detected
//! instruction set and on the portable one. Between them the calls cover:
//! - decode (the streaming path);
//! - prefill (the pack pipeline);
//! - the split key range and its log-sum-exp merge;
//! - GQA;
//! - causal rules with rows that see no key, and a sliding window;
//! - key padding run as loop bounds;
//! - a general mask with a fully masked row;
//! - softcap and sinks;
//! - f16 and bf16;
//! - a strided K.
#[allow(dead_code)] // the module's comparisons with the reference path serve the other tests
#[path = "shared/kernel_cases.rs"]
mod kernel_cases;

use candle_attention::{sdpa, AttnMask, Backend, CausalAlign, SdpaOptions};
use candle_core::{DType, Result, Tensor};
use kernel_cases::{rel_err, tol, Lcg};

/// `(B, Hq, Hkv, L, S, E, Ev)`.
type Dims = (usize, usize, usize, usize, usize, usize, usize);

/// What a call hides and adds, as the oracle reads it.
#[derive(Clone, Copy)]
enum Rule {
    None,
    /// Key `j` visible from query `i` iff `j ≤ i + offset`.
    Causal(isize),
    /// Causal at `offset`, and only the last `w` keys.
    Window(isize, usize),
}

struct Case {
    dims: Dims,
    dtype: DType,
    rule: Rule,
    /// A `(B, 1, 1, S)` keep mask whose second batch row hides its keys from this one.
    pad_from: Option<usize>,
    /// An additive `(1, 1, L, S)` mask: `−inf` on every third key and on all of row 1.
    additive: bool,
    softcap: Option<f64>,
    sinks: bool,
    strided_k: bool,
}

impl Case {
    fn new(dims: Dims, dtype: DType) -> Self {
        Self {
            dims,
            dtype,
            rule: Rule::None,
            pad_from: None,
            additive: false,
            softcap: None,
            sinks: false,
            strided_k: false,
        }
    }
}

/// Row-major `(d0, d1, d2, d3)` values of a tensor as f64.
fn values(t: &Tensor) -> Result<Vec<f64>> {
    t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()
}

/// `softmax(cap(q·kᵀ·scale) + mask) · v` in float64, with a sink logit per head joining
/// each row's sum and rows that see no key giving 0.
#[allow(clippy::too_many_arguments)]
fn oracle(c: &Case, q: &[f64], k: &[f64], v: &[f64], add: &[f64], sinks: &[f64], scale: f64) -> Vec<f64> {
    let (b, hq, hkv, l, s, e, ev) = c.dims;
    let g = hq / hkv;
    let mut out = vec![0f64; b * hq * l * ev];
    for bb in 0..b {
        for h in 0..hq {
            let kh = h / g;
            for i in 0..l {
                let mut logit = vec![f64::NEG_INFINITY; s];
                for (j, lg) in logit.iter_mut().enumerate() {
                    let seen = match c.rule {
                        Rule::None => true,
                        Rule::Causal(o) => j as isize <= i as isize + o,
                        Rule::Window(o, w) => {
                            j as isize <= i as isize + o && j as isize > i as isize + o - w as isize
                        }
                    };
                    let padded = c.pad_from.is_some_and(|z| bb == 1 && j >= z);
                    if !seen || padded {
                        continue;
                    }
                    let qi = &q[((bb * hq + h) * l + i) * e..][..e];
                    let kj = &k[((bb * hkv + kh) * s + j) * e..][..e];
                    let mut x = qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>() * scale;
                    if let Some(cap) = c.softcap {
                        x = cap * (x / cap).tanh();
                    }
                    *lg = x + if c.additive { add[i * s + j] } else { 0.0 };
                }
                let mx = logit.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                if mx == f64::NEG_INFINITY {
                    continue;
                }
                let sink = if c.sinks { sinks[h] } else { f64::NEG_INFINITY };
                let top = mx.max(sink);
                let w: Vec<f64> = logit.iter().map(|&x| (x - top).exp()).collect();
                let sum = w.iter().sum::<f64>() + (sink - top).exp();
                for y in 0..ev {
                    let acc: f64 = (0..s).map(|j| w[j] * v[((bb * hkv + kh) * s + j) * ev + y]).sum();
                    out[((bb * hq + h) * l + i) * ev + y] = acc / sum;
                }
            }
        }
    }
    out
}

/// Runs one case on the fused kernel and compares it with [`oracle`]; returns the error.
fn check(c: &Case, seed: u64) -> Result<f64> {
    let (b, hq, hkv, l, s, e, ev) = c.dims;
    let mut r = Lcg::new(seed);
    let q = r.normal(&[b, hq, l, e])?.to_dtype(c.dtype)?;
    let mut k = r.normal(&[b, hkv, s, e])?.to_dtype(c.dtype)?;
    let v = r.normal(&[b, hkv, s, ev])?.to_dtype(c.dtype)?;
    if c.strided_k {
        // The same values, read through the strides of a transposed copy.
        k = k.transpose(2, 3)?.contiguous()?.transpose(2, 3)?;
    }
    let scale = 0.5 / (e as f64).sqrt();
    let mut opts = SdpaOptions::new()
        .with_backend(Backend::Fused)
        .with_scale(scale)
        .with_gqa(hq != hkv);
    let mut mask = AttnMask::none();
    match c.rule {
        Rule::None => {}
        Rule::Causal(o) => mask = mask.and(&AttnMask::causal_with_offset(o)),
        Rule::Window(o, w) => mask = mask.and(&AttnMask::sliding_window(w, CausalAlign::Offset(o))?),
    }
    if let Some(z) = c.pad_from {
        let keep: Vec<u8> = (0..b * s).map(|x| (x / s != 1 || x % s < z) as u8).collect();
        mask = mask.and(&AttnMask::keep(&Tensor::from_vec(
            keep,
            (b, 1, 1, s),
            q.device(),
        )?)?);
    }
    let add: Vec<f32> = (0..l * s)
        .map(|x| {
            if x % 3 == 0 || x / s == 1 {
                f32::NEG_INFINITY
            } else {
                r.next_f32() - 0.5
            }
        })
        .collect();
    if c.additive {
        let m = Tensor::from_vec(add.clone(), (1, 1, l, s), q.device())?;
        mask = mask.and(&AttnMask::additive(&m)?);
    }
    if !mask.is_empty() {
        opts = opts.with_mask(mask);
    }
    if let Some(cap) = c.softcap {
        opts = opts.with_softcap(cap);
    }
    // Sink logits near the log of the key count, so that they weigh as much as all keys.
    let sinks = (r.sinks(hq)? + (s as f64).ln())?;
    if c.sinks {
        opts = opts.with_sinks(sinks.clone());
    }
    let got = sdpa(&q, &k, &v, &opts)?;
    assert_eq!(got.dims(), &[b, hq, l, ev]);
    assert_eq!(got.dtype(), c.dtype);
    let add: Vec<f64> = add.iter().map(|&x| x as f64).collect();
    let want = oracle(
        c,
        &values(&q)?,
        &values(&k)?,
        &values(&v)?,
        &add,
        &values(&sinks)?,
        scale,
    );
    if c.additive {
        // Row 1 sees no key: exactly 0, as in PyTorch.
        let vals = values(&got)?;
        for bb in 0..b {
            for h in 0..hq {
                let at = ((bb * hq + h) * l + 1) * ev;
                assert!(vals[at..at + ev].iter().all(|&x| x == 0.0));
            }
        }
    }
    // Infinite when `got` holds a NaN or an infinity.
    rel_err(&got, &Tensor::from_vec(want, got.dims(), got.device())?)
}

fn cases() -> Vec<Case> {
    use DType::{BF16, F16, F32};
    let mut v = vec![
        // Decode, GQA 2 (one row block per group: the streaming path).
        Case::new((1, 2, 1, 3, 70, 8, 16), F32),
        // Prefill: two row blocks per group, so the pack pipeline runs.
        Case {
            rule: Rule::Causal(0),
            ..Case::new((1, 2, 1, 80, 75, 4, 8), F32)
        },
        // Causal from 10 keys before the diagonal: the first rows see nothing.
        Case {
            rule: Rule::Causal(-10),
            ..Case::new((1, 2, 1, 80, 40, 4, 4), F32)
        },
        // A sliding window at an offset, GQA 1, two KV heads, bf16.
        Case {
            rule: Rule::Window(61, 9),
            ..Case::new((1, 2, 2, 5, 66, 8, 8), BF16)
        },
        // Split key range (one group, 1100 keys) and its merge, with sinks.
        Case {
            sinks: true,
            ..Case::new((1, 2, 1, 1, 1100, 8, 8), F32)
        },
        // Key padding as loop bounds, batch 2, GQA 2, causal.
        Case {
            rule: Rule::Causal(0),
            pad_from: Some(50),
            ..Case::new((2, 4, 2, 75, 70, 8, 8), F32)
        },
        // A general additive mask with a fully masked row, prefill, softcap, strided K.
        Case {
            additive: true,
            softcap: Some(1.5),
            strided_k: true,
            ..Case::new((1, 2, 1, 73, 130, 8, 4), F32)
        },
    ];
    // Decode with the general mask and a strided K, f16.
    v.push(Case {
        additive: true,
        strided_k: true,
        ..Case::new((2, 4, 2, 2, 9, 8, 8), F16)
    });
    v
}

#[test]
fn small_fused_calls_match_a_float64_loop() -> Result<()> {
    // Under Miri only the default (portable there); natively also the portable kernel.
    let isas: &[Option<&str>] = if cfg!(miri) {
        &[None]
    } else {
        &[None, Some("portable")]
    };
    for isa in isas {
        match isa {
            Some(name) => std::env::set_var("CANDLE_ATTENTION_ISA", name),
            None => std::env::remove_var("CANDLE_ATTENTION_ISA"),
        }
        for (n, c) in cases().iter().enumerate() {
            let err = check(c, 100 + n as u64)?;
            assert!(
                err <= tol(c.dtype),
                "case {n} {:?} {:?} on {}: error {err:.3e} over {:.0e}",
                c.dims,
                c.dtype,
                candle_attention::cpu_kernel_isa(),
                tol(c.dtype)
            );
        }
    }
    Ok(())
}
