//! Randomised comparison of the fused CPU kernel with the reference path, shared by
//! `tests/kernel.rs` (the detected instruction set) and `tests/kernel_portable.rs`
//! (the portable fallback, forced by `CANDLE_ATTENTION_ISA=portable`).
use candle_attention::{sdpa, AttnMask, Backend, CausalAlign, SdpaOptions};
use candle_core::{DType, Device, Result, Tensor};

/// A small deterministic generator, so failures reproduce.
pub struct Lcg(u64);

impl Lcg {
    pub fn new(seed: u64) -> Self {
        Self(
            seed.wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407),
        )
    }
    pub fn next_f32(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32) / ((1u64 << 24) as f32)
    }
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next_f32() * n as f32) as usize).min(n - 1)
    }
    pub fn normal(&mut self, shape: &[usize]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| {
                // Box-Muller
                let (a, b) = (self.next_f32().max(1e-7), self.next_f32());
                (-2.0 * a.ln()).sqrt() * (2.0 * std::f32::consts::PI * b).cos()
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu)
    }
    pub fn keep(&mut self, shape: &[usize], p: f32) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let v: Vec<u8> = (0..n).map(|_| (self.next_f32() < p) as u8).collect();
        Tensor::from_vec(v, shape, &Device::Cpu)
    }

    /// Attention-sink logits for `hq` query heads, large enough to weigh against every
    /// key of a row.
    pub fn sinks(&mut self, hq: usize) -> Result<Tensor> {
        (self.normal(&[hq])? * 3.0)? + 2.0
    }

    /// A logit soft-cap between 0.5 and 3.5.
    pub fn cap(&mut self) -> f64 {
        0.5 + 3.0 * self.next_f32() as f64
    }

    /// A bool keep mask whose rows (over the last dim) each keep one run of keys, as
    /// right or left padding gives: all keys, none, a prefix, a suffix or a middle run.
    pub fn runs(&mut self, shape: &[usize]) -> Result<Tensor> {
        let s = shape[shape.len() - 1];
        let rows: usize = shape[..shape.len() - 1].iter().product();
        let mut v = vec![0u8; rows * s];
        for row in v.chunks_exact_mut(s) {
            let (a, z) = match self.below(5) {
                0 => (0, s),
                1 => (0, 0),
                2 => (0, 1 + self.below(s)),
                3 => (self.below(s), s),
                _ => {
                    let a = self.below(s);
                    (a, a + 1 + self.below(s - a))
                }
            };
            row[a..z].fill(1);
        }
        Tensor::from_vec(v, shape, &Device::Cpu)
    }
}

pub fn tol(dt: DType) -> f64 {
    match dt {
        DType::F16 => 5e-3,
        DType::BF16 => 2e-2,
        _ => 1e-5,
    }
}

/// `max|a − b| / max(1, max|b|)` in f64, infinite where a difference is NaN (a NaN or
/// an infinity on either side): the fixtures' normalised error.
pub use candle_attention::fixture::normalised_error as rel_err;

#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub b: usize,
    pub hq: usize,
    pub hkv: usize,
    pub l: usize,
    pub s: usize,
    pub e: usize,
    pub ev: usize,
}

pub const SHAPES: &[Shape] = &[
    // The same with E and Ev multiples of 16 (f16/bf16 rows are then read in place, and
    // on AVX-512 f32 rows take the same in-place kernels).
    Shape {
        b: 2,
        hq: 3,
        hkv: 3,
        l: 1,
        s: 200,
        e: 48,
        ev: 32,
    },
    // Decode with one query row per kv head (MHA-style), S over several key blocks, E not
    // a multiple of 16.
    Shape {
        b: 3,
        hq: 4,
        hkv: 4,
        l: 1,
        s: 300,
        e: 72,
        ev: 40,
    },
    Shape {
        b: 1,
        hq: 1,
        hkv: 1,
        l: 1,
        s: 1,
        e: 8,
        ev: 8,
    },
    // Decode with 1, 2, 3 and 5 query rows per kv head and Ev ≥ 64 (the AVX-512 decode
    // tiles take 64 outputs per pass, then a tail of 16 or 32).
    Shape {
        b: 2,
        hq: 2,
        hkv: 2,
        l: 1,
        s: 90,
        e: 32,
        ev: 80,
    },
    Shape {
        b: 2,
        hq: 4,
        hkv: 2,
        l: 1,
        s: 33,
        e: 32,
        ev: 64,
    },
    Shape {
        b: 1,
        hq: 6,
        hkv: 2,
        l: 1,
        s: 65,
        e: 48,
        ev: 96,
    },
    Shape {
        b: 1,
        hq: 10,
        hkv: 2,
        l: 1,
        s: 70,
        e: 16,
        ev: 64,
    },
    // The AVX-512 decode kernels that walk K and V rows in order: 7 rows per kv head
    // against 13 output panels (panel chunks of 4, 4, 4 and 1, row tiles of 6 and 1 in
    // each) with E = 256 (score strips of 4 and 3 rows, the first row's Q in registers);
    // E = 64 in one strip of 7 rows against Ev = 256 (panel chunks of 4); E = 128 in
    // one strip of 3 rows (the third row's Q read from memory) against one chunk of 8
    // panels in f32 (row tiles of 2 and 1) and two chunks of 4 in half precision.
    Shape {
        b: 1,
        hq: 7,
        hkv: 1,
        l: 1,
        s: 150,
        e: 256,
        ev: 208,
    },
    Shape {
        b: 2,
        hq: 7,
        hkv: 1,
        l: 1,
        s: 100,
        e: 64,
        ev: 256,
    },
    Shape {
        b: 1,
        hq: 3,
        hkv: 1,
        l: 1,
        s: 70,
        e: 128,
        ev: 128,
    },
    // Score strips of 8 rows and a tail of 1 at E = 64 (rows 4–7 read Q from memory),
    // of 4 rows at E = 128 (a GQA group of 4, as in Llama 3 8B), and of 2 at E = 256
    // against 16 output panels (two chunks of 8, one 2-row tile each).
    Shape {
        b: 1,
        hq: 9,
        hkv: 1,
        l: 1,
        s: 77,
        e: 64,
        ev: 64,
    },
    Shape {
        b: 1,
        hq: 8,
        hkv: 2,
        l: 1,
        s: 140,
        e: 128,
        ev: 128,
    },
    Shape {
        b: 1,
        hq: 4,
        hkv: 2,
        l: 1,
        s: 70,
        e: 256,
        ev: 256,
    },
    Shape {
        b: 2,
        hq: 4,
        hkv: 4,
        l: 37,
        s: 53,
        e: 24,
        ev: 24,
    },
    Shape {
        b: 1,
        hq: 8,
        hkv: 4,
        l: 5,
        s: 3,
        e: 16,
        ev: 8,
    },
    Shape {
        b: 2,
        hq: 8,
        hkv: 2,
        l: 1,
        s: 131,
        e: 64,
        ev: 64,
    },
    Shape {
        b: 1,
        hq: 8,
        hkv: 1,
        l: 67,
        s: 67,
        e: 40,
        ev: 20,
    },
    Shape {
        b: 3,
        hq: 2,
        hkv: 2,
        l: 130,
        s: 70,
        e: 17,
        ev: 33,
    },
    Shape {
        b: 1,
        hq: 16,
        hkv: 2,
        l: 3,
        s: 300,
        e: 128,
        ev: 128,
    },
    Shape {
        b: 1,
        hq: 2,
        hkv: 2,
        l: 200,
        s: 200,
        e: 64,
        ev: 64,
    },
    // Prefill (200 query rows per group, more than one row block: shared K/V packs) with
    // Ev ≥ 128, where f32 on AVX-512 pairs wholly visible key blocks (here 64 + 64 and
    // 64 + 8 keys); Ev not a multiple of 16 and an odd V panel count; GQA.
    Shape {
        b: 1,
        hq: 2,
        hkv: 1,
        l: 100,
        s: 200,
        e: 40,
        ev: 130,
    },
    // 64-key blocks and a 7-key tail against E = 66 and Ev = 70 (E and the tail not
    // multiples of 4): the AVX-512 6×64 tiles' assembly loops run their leftover steps.
    Shape {
        b: 1,
        hq: 2,
        hkv: 1,
        l: 75,
        s: 135,
        e: 66,
        ev: 70,
    },
];

/// Every mask kind the dispatcher hands to the kernel, for one shape.
pub fn masks(r: &mut Lcg, sh: &Shape) -> Result<Vec<(String, SdpaOptions)>> {
    let mut out = vec![
        ("none".to_string(), SdpaOptions::new()),
        ("causal".to_string(), SdpaOptions::new().with_causal(true)),
        (
            "bottom_right".to_string(),
            SdpaOptions::new().with_mask(AttnMask::causal_bottom_right()),
        ),
        (
            "window".to_string(),
            SdpaOptions::new().with_mask(AttnMask::sliding_window(
                1 + r.below(9),
                CausalAlign::BottomRight,
            )?),
        ),
        (
            "scale".to_string(),
            SdpaOptions::new().with_scale(0.05 + r.next_f32() as f64),
        ),
    ];
    // Keep masks of every broadcast shape (each of B, H, L, S either 1 or full), some with
    // fully masked rows (p = 0.3 leaves many rows without keys when S is small).
    for bits in 0..16u32 {
        let full = [sh.b, sh.hq, sh.l, sh.s];
        let shape: Vec<usize> = (0..4)
            .map(|i| if bits >> i & 1 == 1 { full[i] } else { 1 })
            .collect();
        let p = if bits % 3 == 0 { 0.3 } else { 0.8 };
        let m = r.keep(&shape, p)?;
        out.push((
            format!("keep{shape:?}"),
            SdpaOptions::new().with_mask(AttnMask::keep(&m)?),
        ));
    }
    // Key-padding masks (one run of visible keys per batch and head), which the kernel
    // applies by loop bounds: per batch, per batch and head, shared by all, and per
    // batch under the causal bound.
    for shape in [[sh.b, 1, 1, sh.s], [sh.b, sh.hq, 1, sh.s], [1, 1, 1, sh.s]] {
        let m = r.runs(&shape)?;
        out.push((
            format!("pad{shape:?}"),
            SdpaOptions::new().with_mask(AttnMask::keep(&m)?),
        ));
    }
    let m = r.runs(&[sh.b, 1, 1, sh.s])?;
    out.push((
        "pad+causal".to_string(),
        SdpaOptions::new()
            .with_mask(AttnMask::keep(&m)?)
            .with_causal(true),
    ));
    let add = (r.normal(&[sh.b, 1, sh.l, sh.s])? * 2.0)?;
    out.push((
        "additive+causal".to_string(),
        SdpaOptions::new()
            .with_mask(AttnMask::additive(&add)?)
            .with_causal(true),
    ));
    // Attention sinks (one logit per query head, large enough to weigh against every key):
    // alone, under a window, with fully masked rows, and with padding run as loop bounds.
    out.push((
        "sinks".to_string(),
        SdpaOptions::new().with_sinks(r.sinks(sh.hq)?),
    ));
    out.push((
        "sinks+window".to_string(),
        SdpaOptions::new()
            .with_mask(AttnMask::sliding_window(
                1 + r.below(9),
                CausalAlign::BottomRight,
            )?)
            .with_sinks(r.sinks(sh.hq)?),
    ));
    let m = r.keep(&[sh.b, sh.hq, sh.l, sh.s], 0.3)?;
    out.push((
        "sinks+keep".to_string(),
        SdpaOptions::new()
            .with_mask(AttnMask::keep(&m)?)
            .with_sinks(r.sinks(sh.hq)?),
    ));
    // Soft-capping (caps of 0.5–3.5, below the scaled scores' spread, so it matters):
    // alone, with causal and explicit masks, fully masked rows, and sinks.
    out.push(("softcap".to_string(), SdpaOptions::new().with_softcap(r.cap())));
    let add = (r.normal(&[1, sh.hq, sh.l, sh.s])? * 2.0)?;
    out.push((
        "softcap+additive+causal".to_string(),
        SdpaOptions::new()
            .with_mask(AttnMask::additive(&add)?)
            .with_causal(true)
            .with_softcap(r.cap()),
    ));
    let m = r.keep(&[sh.b, 1, sh.l, sh.s], 0.3)?;
    out.push((
        "softcap+keep+sinks".to_string(),
        SdpaOptions::new()
            .with_mask(AttnMask::keep(&m)?)
            .with_softcap(r.cap())
            .with_sinks(r.sinks(sh.hq)?),
    ));
    let m = r.runs(&[sh.b, 1, 1, sh.s])?;
    out.push((
        "sinks+pad+causal".to_string(),
        SdpaOptions::new()
            .with_mask(AttnMask::keep(&m)?)
            .with_causal(true)
            .with_sinks(r.sinks(sh.hq)?),
    ));
    Ok(out)
}

/// Runs every shape × mask × dtype, contiguous and strided, through both paths.
pub fn fused_matches_reference(seed: u64) -> Result<usize> {
    let mut r = Lcg::new(seed);
    let mut checked = 0;
    for sh in SHAPES {
        let q = r.normal(&[sh.b, sh.l, sh.hq, sh.e])?;
        let k = r.normal(&[sh.b, sh.s, sh.hkv, sh.e])?;
        let v = r.normal(&[sh.b, sh.s, sh.hkv, sh.ev])?;
        for (name, opts) in masks(&mut r, sh)? {
            for dt in [DType::F32, DType::F16, DType::BF16] {
                // (B, L, H, E) viewed as (B, H, L, E): non-contiguous inputs.
                let (qs, ks, vs) = (
                    q.to_dtype(dt)?.transpose(1, 2)?,
                    k.to_dtype(dt)?.transpose(1, 2)?,
                    v.to_dtype(dt)?.transpose(1, 2)?,
                );
                let opts = opts.clone().with_gqa(sh.hq != sh.hkv);
                let want = sdpa(&qs, &ks, &vs, &opts.clone().with_backend(Backend::Reference))?;
                for (qi, ki, vi) in [
                    (qs.clone(), ks.clone(), vs.clone()),
                    (qs.contiguous()?, ks.contiguous()?, vs.contiguous()?),
                ] {
                    let got = sdpa(&qi, &ki, &vi, &opts.clone().with_backend(Backend::Fused))?;
                    assert_eq!(got.dtype(), dt);
                    let err = rel_err(&got, &want)?;
                    assert!(
                        err <= tol(dt),
                        "{sh:?} {name} {dt:?}: error {err:e} > {}",
                        tol(dt)
                    );
                    checked += 1;
                }
            }
        }
    }
    Ok(checked)
}

/// Attention sinks (some with a soft-cap) where few (batch, kv head) groups meet a long
/// key range, so the kernel splits the keys across threads and merges the parts by
/// log-sum-exp: the sink must enter each row once, after the merge. Returns the number
/// of comparisons.
pub fn sinks_split_k_matches_reference(seed: u64) -> Result<usize> {
    let mut r = Lcg::new(seed);
    let mut checked = 0;
    for (hq, hkv, l) in [(1, 1, 1), (4, 1, 1), (8, 2, 3)] {
        let s = 2100;
        let q = r.normal(&[1, hq, l, 64])?;
        let k = r.normal(&[1, hkv, s, 64])?;
        let v = r.normal(&[1, hkv, s, 64])?;
        let window = AttnMask::sliding_window(900, CausalAlign::BottomRight)?;
        let keep = AttnMask::keep(&r.keep(&[1, hq, l, s], 0.5)?)?;
        for (mask, cap) in [
            (None, false),
            (Some(window), true),
            (Some(keep), false),
            (None, true),
        ] {
            let mut opts = SdpaOptions::new().with_gqa(hq != hkv).with_sinks(r.sinks(hq)?);
            if let Some(m) = mask {
                opts = opts.with_mask(m);
            }
            if cap {
                opts = opts.with_softcap(r.cap());
            }
            for dt in [DType::F32, DType::BF16] {
                let (q, k, v) = (q.to_dtype(dt)?, k.to_dtype(dt)?, v.to_dtype(dt)?);
                let want = sdpa(&q, &k, &v, &opts.clone().with_backend(Backend::Reference))?;
                let got = sdpa(&q, &k, &v, &opts.clone().with_backend(Backend::Fused))?;
                let err = rel_err(&got, &want)?;
                assert!(err <= tol(dt), "hq {hq} hkv {hkv} l {l} {dt:?}: error {err:e}");
                checked += 1;
            }
        }
    }
    Ok(checked)
}
