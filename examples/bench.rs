//! Times this crate's SDPA against candle's own paths, side by side in one process.
//!
//! ```text
//! cargo run --release --example bench -- [--json] [--case NAME | --shape B,Hq,Hkv,L,S,D[,causal|causal_br]] [--dtype f32|bf16|f16] [--impl NAME] [--rounds N] [--min-secs S] [--no-peak | --peak-only] [--inputs FILE]
//! ```
//!
//! `--help` lists the cases and implementations. `--shape` times SDPA on random inputs
//! of any shape instead of the named cases (see [`parse_shape`]);
//! `scripts/bench_vs_torch.py --shape` takes the same argument.
//!
//! Implementations (`impl`): `ours` (this crate, default dispatch), `candle_unfused`
//! (matmul → `candle_nn::ops::softmax_last_dim` → matmul, as candle-transformers models
//! write it, with `repeat_kv` for GQA and the mask built outside the timed region) and
//! `candle_flash` (`candle_nn::attention::flash_attn`, where it accepts the case).
//!
//! Agreement: the warm-up's first call of each implementation also gives its output, and
//! in f32 every other implementation's must be within [`AGREE_F32`] of ours (relative to
//! our largest value) or the bench stops with an error, so that all of them time the same
//! attention; in f16 and bf16 the difference is printed to stderr. `decode_layer_sliding`
//! checks its two layers itself.
//!
//! `--inputs FILE` (one case, one dtype) takes the case's inputs from a safetensors file
//! instead of drawing them: `scripts/bench_vs_torch.py` writes the tensors PyTorch times
//! and `expected`, PyTorch's output for them computed in float64. Our first output must
//! then be within the fixtures' tolerance of the dtype
//! ([`fixture::tolerance`]) of `expected`, in the fixtures' normalised error
//! ([`fixture::normalised_error`]), or the bench stops with an error; with `--json`, our row
//! carries that error as `err_vs_f64`. So PyTorch and this bench are shown to time the
//! same attention, masks and weights included, on the same data.
//!
//! Timing rule: after a warm-up, each implementation is timed `rounds` times (default 5),
//! alternating between implementations, each timing running whole calls for at least
//! `min-secs` (default 1 s); the figure is the median time per call. `gflops` counts
//! `4·B·Hq·D` per visible (query, key) pair (causal cases count only visible pairs, and
//! `bert_pad` only the keys its padding mask leaves visible), plus
//! the projections for `mha_layer`; `gbps` counts bytes of q, k, v read and the output
//! written. `peak_rss_mb` is the growth of the process's peak RSS during a call: the
//! larger of the first call (which includes buffers the kernel keeps for later calls,
//! such as its K/V pack) and the second. A buffer kept from an earlier case of the same
//! process is not counted again; run one `--case` per process for a standalone figure.
//!
//! `decode_gqa_cache` and `decode_b4_cache` are `decode_gqa` and `decode_b4` with K/V
//! read from a full [`KvCache`](candle_attention::KvCache), as a model's decode loop reads
//! them: on Linux its buffers are advised for transparent huge pages, which candle's own
//! tensors are not. Every implementation takes the same K/V (candle-nn's `flash_attn`
//! takes a `(B, S, H, D)` copy, as in every case).
//!
//! `decode_layer_sliding` is one decode step of a whole Mistral-7B attention layer
//! (projections, RoPE, a rotating cache holding a full window of 4096 keys), f32 and
//! bf16, B = 1:
//! `ours` is `DecoderAttention::forward_cached`, `candle_unfused` the same layer written
//! with candle-nn as candle-transformers writes it (see [`decode_layer`]); `scripts/
//! bench_vs_torch.py` has no PyTorch side for it.
//!
//! `gemma2_softcap` (Gemma 2 9B's attention: 16 query and 8 KV heads of 256, causal,
//! logit soft-cap 50) and `gptoss_sinks` (gpt-oss-20b's: 64 query and 8 KV heads of 64,
//! causal, one sink logit per head), f32 and bf16, at L = S = 1024: `candle_unfused`
//! writes the cap or the sink column in candle ops (see [`unfused_extra`]); candle-nn's
//! `flash_attn` takes the soft-cap (`gemma2_softcap`) but has no sinks.
//!
//! Before the first case and after the last, the bench also measures the machine's f32
//! FMA peak on all of the kernel's threads at once (a register-only loop of independent
//! fused multiply-adds in the kernel's instruction set) and prints it to stderr, so a
//! run's GFLOP/s can be read as a fraction of that run's peak; and its DRAM read
//! bandwidth on the same threads (each sums its own share of a 256 MiB buffer), so a
//! decode case's GB/s can be read as a fraction of that run's bandwidth (`--no-peak`
//! skips both; `--peak-only` measures both and exits).
use std::time::Instant;

use anyhow::{bail, Result};
use candle_attention::{
    fixture, sdpa, AttnMask, KvCache, MhaArgs, MultiheadAttention, MultiheadAttentionConfig, SdpaOptions,
};
use candle_core::{DType, Device, Module, Tensor};

#[derive(Clone, Copy)]
struct Case {
    name: &'static str,
    b: usize,
    hq: usize,
    hkv: usize,
    l: usize,
    s: usize,
    d: usize,
    causal: bool,
    /// With `causal`: the causal rule aligned bottom-right (query `i` sees keys up to
    /// `i + S − L`, as in a chunked prefill or a speculative decode step), not PyTorch's
    /// top-left `is_causal`. Only `--shape` sets it.
    bottom_right: bool,
    pad: bool,
    dtypes: &'static [DType],
    /// Also time candle's paths (off where they would need gigabytes or minutes).
    candle: bool,
    /// K/V are the views of a full `KvCache` (as in a model's decode loop) instead of
    /// tensors of their own.
    cache: bool,
    /// What the case adds to the softmax.
    extra: Extra,
}

/// A softmax addition of a model family: Gemma 2's logit soft-cap or gpt-oss's sinks.
#[derive(Clone, Copy, PartialEq)]
enum Extra {
    None,
    /// `cap · tanh(score / cap)` before the mask.
    Softcap(f64),
    /// One random sink logit per query head.
    Sinks,
}

const ALL: &[DType] = &[DType::F32, DType::BF16, DType::F16];
const F32: &[DType] = &[DType::F32];
const F32_BF16: &[DType] = &[DType::F32, DType::BF16];

#[rustfmt::skip]
const CASES: &[Case] = &[
    Case { name: "enc512", b: 1, hq: 16, hkv: 16, l: 512, s: 512, d: 64, causal: false, bottom_right: false, pad: false, dtypes: ALL, candle: true, cache: false, extra: Extra::None },
    Case { name: "enc1k_d128", b: 1, hq: 16, hkv: 16, l: 1024, s: 1024, d: 128, causal: false, bottom_right: false, pad: false, dtypes: ALL, candle: true, cache: false, extra: Extra::None },
    Case { name: "gpt1k_causal", b: 1, hq: 32, hkv: 32, l: 1024, s: 1024, d: 64, causal: true, bottom_right: false, pad: false, dtypes: ALL, candle: true, cache: false, extra: Extra::None },
    Case { name: "gpt2k_causal_d128", b: 1, hq: 32, hkv: 32, l: 2048, s: 2048, d: 128, causal: true, bottom_right: false, pad: false, dtypes: ALL, candle: true, cache: false, extra: Extra::None },
    Case { name: "bert_pad", b: 8, hq: 12, hkv: 12, l: 128, s: 128, d: 64, causal: false, bottom_right: false, pad: true, dtypes: ALL, candle: true, cache: false, extra: Extra::None },
    Case { name: "long8k_causal", b: 1, hq: 8, hkv: 8, l: 8192, s: 8192, d: 64, causal: true, bottom_right: false, pad: false, dtypes: F32, candle: true, cache: false, extra: Extra::None },
    Case { name: "long32k_causal", b: 1, hq: 8, hkv: 8, l: 32768, s: 32768, d: 64, causal: true, bottom_right: false, pad: false, dtypes: F32, candle: false, cache: false, extra: Extra::None },
    Case { name: "decode_gqa", b: 1, hq: 32, hkv: 8, l: 1, s: 4096, d: 128, causal: false, bottom_right: false, pad: false, dtypes: ALL, candle: true, cache: false, extra: Extra::None },
    Case { name: "decode_b4", b: 4, hq: 32, hkv: 32, l: 1, s: 2048, d: 128, causal: false, bottom_right: false, pad: false, dtypes: ALL, candle: true, cache: false, extra: Extra::None },
    Case { name: "decode_gqa_cache", b: 1, hq: 32, hkv: 8, l: 1, s: 4096, d: 128, causal: false, bottom_right: false, pad: false, dtypes: ALL, candle: true, cache: true, extra: Extra::None },
    Case { name: "decode_b4_cache", b: 4, hq: 32, hkv: 32, l: 1, s: 2048, d: 128, causal: false, bottom_right: false, pad: false, dtypes: ALL, candle: true, cache: true, extra: Extra::None },
    Case { name: "mha_layer", b: 8, hq: 12, hkv: 12, l: 128, s: 128, d: 64, causal: false, bottom_right: false, pad: false, dtypes: ALL, candle: true, cache: false, extra: Extra::None },
    Case { name: "decode_layer_sliding", b: 1, hq: 32, hkv: 8, l: 1, s: 4096, d: 128, causal: true, bottom_right: false, pad: false, dtypes: F32_BF16, candle: true, cache: true, extra: Extra::None },
    Case { name: "gemma2_softcap", b: 1, hq: 16, hkv: 8, l: 1024, s: 1024, d: 256, causal: true, bottom_right: false, pad: false, dtypes: F32_BF16, candle: true, cache: false, extra: Extra::Softcap(50.0) },
    Case { name: "gptoss_sinks", b: 1, hq: 64, hkv: 8, l: 1024, s: 1024, d: 64, causal: true, bottom_right: false, pad: false, dtypes: F32_BF16, candle: true, cache: false, extra: Extra::Sinks },
];

/// The case of `--shape B,Hq,Hkv,L,S,D[,causal|causal_br]`, named `shape_B_Hq_Hkv_L_S_D`
/// with `_causal` or `_causal_br` appended: SDPA on random inputs of that shape, in every
/// dtype, GQA where `Hq ≠ Hkv`. `causal` is PyTorch's top-left `is_causal`; `causal_br`
/// aligns the rule bottom-right (query `i` sees keys up to `i + S − L`), as a chunked
/// prefill or a speculative decode step over a cache needs.
fn parse_shape(spec: &str) -> Result<Case> {
    let parts: Vec<&str> = spec.split(',').collect();
    let (dims, rule) = match parts.len() {
        6 => (&parts[..], None),
        7 => (&parts[..6], Some(parts[6])),
        _ => bail!("--shape takes B,Hq,Hkv,L,S,D[,causal|causal_br], got {spec:?}"),
    };
    let mut n = [0usize; 6];
    for (x, p) in n.iter_mut().zip(dims) {
        *x = p
            .trim()
            .parse()
            .map_err(|_| anyhow::anyhow!("--shape {spec:?}: {p:?} is not a size"))?;
    }
    let [b, hq, hkv, l, s, d] = n;
    if n.contains(&0) || !hq.is_multiple_of(hkv) {
        bail!("--shape {spec:?}: every size must be positive and Hkv must divide Hq");
    }
    let (causal, bottom_right) = match rule {
        None => (false, false),
        Some("causal") => (true, false),
        Some("causal_br") if l <= s => (true, true),
        Some("causal_br") => bail!("--shape {spec:?}: causal_br needs L <= S"),
        Some(r) => bail!("--shape {spec:?}: the rule is causal or causal_br, got {r:?}"),
    };
    let suffix = rule.map(|r| format!("_{r}")).unwrap_or_default();
    let name = format!("shape_{b}_{hq}_{hkv}_{l}_{s}_{d}{suffix}");
    Ok(Case {
        // One case per process: leaking its name keeps `Case` a plain `Copy` constant.
        name: Box::leak(name.into_boxed_str()),
        b,
        hq,
        hkv,
        l,
        s,
        d,
        causal,
        bottom_right,
        pad: false,
        dtypes: ALL,
        candle: true,
        cache: false,
        extra: Extra::None,
    })
}

fn dtype_name(dt: DType) -> &'static str {
    dt.as_str()
}

/// Visible (query, key) pairs per (batch, head), averaged over the batch.
fn pairs(c: &Case) -> f64 {
    if c.pad {
        // The odd batch rows hide the last quarter of the keys (see `keep` below).
        let hidden = (c.b / 2 * c.l * (c.s / 4)) as f64 / c.b as f64;
        return (c.l * c.s) as f64 - hidden;
    }
    if !c.causal {
        return (c.l * c.s) as f64;
    }
    (0..c.l).map(|i| (i + 1 + kv_offset(c)).min(c.s)).sum::<usize>() as f64
}

/// How many more keys than its position a causal query sees: `S − L` bottom-right, 0
/// top-left.
fn kv_offset(c: &Case) -> usize {
    if c.bottom_right {
        c.s.saturating_sub(c.l)
    } else {
        0
    }
}

/// Largest relative difference between two implementations' f32 outputs, `max |out −
/// ours| / max |ours|`, that the bench accepts as the same attention. Every f32 path
/// lands within about 1e-5 of ours, so 1e-3 leaves room and still catches a wrong mask or
/// scale, which moves some outputs by a sizeable fraction of their range. In f16 and
/// bf16 the difference is printed and not checked: candle's unfused path computes in the
/// dtype, and its softmax even sums each row in it, so it lands up to 1.7 away on these
/// random inputs (bf16 `decode_gqa`, 4096 keys), as far as a wrong mask would. The f32
/// run of the same case checks the inputs and masks, which are built the same way in
/// every dtype.
const AGREE_F32: f64 = 1e-3;

/// `max |got − reference| / max |reference|` over all elements, in f64 (a NaN or a
/// shape mismatch counts as infinitely far).
fn rel_diff(got: &Tensor, reference: &Tensor) -> Result<f64> {
    if got.dims() != reference.dims() {
        return Ok(f64::INFINITY);
    }
    let flat = |t: &Tensor| -> Result<Vec<f64>> { Ok(t.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?) };
    let (a, b) = (flat(got)?, flat(reference)?);
    let (mut diff, mut top) = (0f64, f64::MIN_POSITIVE);
    for (x, y) in a.iter().zip(&b) {
        let d = (x - y).abs();
        if d.is_nan() {
            return Ok(f64::INFINITY);
        }
        diff = diff.max(d);
        top = top.max(y.abs());
    }
    Ok(diff / top)
}

fn rss_kb(field: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// `g()` and the growth (MB) of the process's peak RSS while it ran, using Linux's
/// resettable high-water mark (NaN where that is not available).
fn with_peak_rss<R>(g: impl FnOnce() -> R) -> (R, f64) {
    let reset = std::fs::write("/proc/self/clear_refs", "5").is_ok();
    let before = rss_kb("VmRSS:").unwrap_or(0);
    let r = g();
    let peak = rss_kb("VmHWM:").unwrap_or(0);
    let mb = if reset {
        peak.saturating_sub(before) as f64 / 1024.0
    } else {
        f64::NAN
    };
    (r, mb)
}

type Impl = (&'static str, Box<dyn Fn() -> Result<Tensor>>);

fn repeat_kv(x: &Tensor, n: usize) -> candle_core::Result<Tensor> {
    if n == 1 {
        return Ok(x.clone());
    }
    let (b, h, s, d) = x.dims4()?;
    Tensor::cat(&vec![x; n], 2)?.reshape((b, h * n, s, d))
}

fn unfused(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: f64,
    g: usize,
) -> candle_core::Result<Tensor> {
    unfused_extra(q, k, v, mask, scale, g, (None, None))
}

/// [`unfused`] with Gemma 2's soft-cap (before the mask) or gpt-oss's sinks (a column of
/// per-head logits joined to the scores for the softmax, then dropped), as their
/// candle-transformers and Hugging Face eager attention write them.
fn unfused_extra(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: f64,
    g: usize,
    (softcap, sinks): (Option<f64>, Option<&Tensor>),
) -> candle_core::Result<Tensor> {
    let k = repeat_kv(k, g)?;
    let v = repeat_kv(v, g)?;
    let mut s = (q.matmul(&k.t()?)? * scale)?;
    if let Some(cap) = softcap {
        s = ((s / cap)?.tanh()? * cap)?;
    }
    if let Some(m) = mask {
        s = s.broadcast_add(m)?;
    }
    let Some(sinks) = sinks else {
        return candle_nn::ops::softmax_last_dim(&s)?.matmul(&v);
    };
    let (b, h, l, n) = s.dims4()?;
    let col = sinks
        .reshape((1, h, 1, 1))?
        .broadcast_as((b, h, l, 1))?
        .contiguous()?;
    let p = candle_nn::ops::softmax_last_dim(&Tensor::cat(&[&s, &col.to_dtype(s.dtype())?], 3)?)?;
    p.narrow(3, 0, n)?.matmul(&v)
}

fn flash(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f32,
    mask: candle_nn::attention::AttnMask,
    softcap: Option<f32>,
) -> candle_core::Result<Tensor> {
    use candle_nn::attention::flash_attn;
    // Takes `(B, S, H, D)` and returns `(B, H, L, D)`, as `sdpa` does.
    match q.dtype() {
        DType::F32 => flash_attn::<f32>(q, k, v, scale, mask, None, softcap),
        DType::F16 => flash_attn::<half::f16>(q, k, v, scale, mask, None, softcap),
        DType::BF16 => flash_attn::<half::bf16>(q, k, v, scale, mask, None, softcap),
        dt => candle_core::bail!("flash_attn: no {dt:?}"),
    }
}

/// RoPE angles of one position for a half-split rotary of `d` dims and base `theta`:
/// `(cos, sin)`, each `(1, d / 2)`.
fn rope_at(pos: usize, d: usize, theta: f64, dev: &Device) -> candle_core::Result<(Tensor, Tensor)> {
    let ang: Vec<f32> = (0..d / 2)
        .map(|i| (pos as f64 * theta.powf(-2.0 * i as f64 / d as f64)) as f32)
        .collect();
    let cos: Vec<f32> = ang.iter().map(|a| a.cos()).collect();
    let sin: Vec<f32> = ang.iter().map(|a| a.sin()).collect();
    Ok((
        Tensor::from_vec(cos, (1, d / 2), dev)?,
        Tensor::from_vec(sin, (1, d / 2), dev)?,
    ))
}

/// One decode step of candle's attention layer as candle-transformers' Mistral writes
/// it, with the weights `[q, k, v, o]` in `dt`: `Linear`, `rotary_emb::rope`, the
/// rotating cache's append, `repeat_kv`, matmul → softmax → matmul (no mask for one
/// token). `dims`: `(B, Hq, Hkv, D, θ)`. The step takes the cache, `x (B, 1, hidden)`
/// and the token's position.
#[allow(clippy::type_complexity)]
fn candle_layer(
    ws: [&Tensor; 4],
    (b, hq, hkv, d, theta): (usize, usize, usize, usize, f64),
    dt: DType,
) -> Result<
    Box<dyn Fn(&mut candle_nn::kv_cache::RotatingKvCache, &Tensor, usize) -> candle_core::Result<Tensor>>,
> {
    let lin = |t: &Tensor| -> Result<candle_nn::Linear> { Ok(candle_nn::Linear::new(t.to_dtype(dt)?, None)) };
    let (lq, lk, lv, lo) = (lin(ws[0])?, lin(ws[1])?, lin(ws[2])?, lin(ws[3])?);
    Ok(Box::new(move |cache, x, pos| {
        let heads = |t: Tensor, h: usize| t.reshape((b, 1, h, d))?.transpose(1, 2)?.contiguous();
        let q = heads(lq.forward(x)?, hq)?;
        let k = heads(lk.forward(x)?, hkv)?;
        let v = heads(lv.forward(x)?, hkv)?;
        let (cos, sin) = rope_at(pos, d, theta, &Device::Cpu)?;
        let (cos, sin) = (cos.to_dtype(q.dtype())?, sin.to_dtype(q.dtype())?);
        let q = candle_nn::rotary_emb::rope(&q, &cos, &sin)?;
        let k = candle_nn::rotary_emb::rope(&k, &cos, &sin)?;
        let (k, v) = cache.append(&k, &v)?;
        let o = unfused(&q, &k, &v, None, (d as f64).powf(-0.5), hq / hkv)?;
        lo.forward(&o.transpose(1, 2)?.reshape((b, 1, hq * d))?)
    }))
}

/// `decode_layer_sliding`: one decode step of a Mistral-7B attention layer (hidden
/// 4096, 32 query and 8 KV heads of 128, RoPE θ 1e6, a sliding window of 4096 keys,
/// no biases), B = 1, with the window's 4096 keys already cached. `ours` is
/// [`DecoderAttention::forward_cached`] with its rotating `KvCache`; `candle_unfused` is
/// the same layer written with candle-nn as candle-transformers' Mistral writes it
/// (`Linear`, `rotary_emb::rope`, `kv_cache::RotatingKvCache`, `repeat_kv`, matmul →
/// softmax → matmul; no mask for one token; [`candle_layer`]). Both caches start from
/// the same K/V, in `dt`.
/// Before timing, our first step is checked against candle's layer run in f32 on the
/// same values (1e-4 of the largest output in f32, 2e-2 in bf16); candle's own bf16
/// step is only reported, since it rounds its products and softmax to bf16. Every timed
/// call is one more step, at the next position. Returns `(flops, bytes)` per call: the
/// projections plus the window's attention, and the weights plus the K/V read, counted
/// in `dt`.
fn decode_layer(
    c: &Case,
    dt: DType,
    rnd: &dyn Fn(&[usize]) -> Result<Tensor>,
    impls: &mut Vec<Impl>,
) -> Result<(f64, f64)> {
    use candle_attention::decoder::{DecoderAttention, DecoderAttentionConfig, QkvLayout};
    use candle_attention::{RopeConfig, RopeScaling, RopeStyle};
    use std::cell::{Cell, RefCell};
    let dev = Device::Cpu;
    let (hq, hkv, d, w) = (c.hq, c.hkv, c.d, c.s);
    let e = hq * d;
    let theta = 1e6;
    let cfg = DecoderAttentionConfig {
        hidden_size: e,
        num_heads: hq,
        num_kv_heads: hkv,
        head_dim: d,
        layout: QkvLayout::separate(false, false, false, false),
        qk_norm: None,
        rope: Some(RopeConfig {
            head_dim: d,
            rotary_dim: d,
            theta,
            style: RopeStyle::HalfSplit,
            scaling: RopeScaling::Default,
        }),
        alibi: false,
        softcap: None,
        sinks: false,
        sliding_window: Some(w),
        bidirectional: false,
        scale: (d as f64).powf(-0.5),
        cross_attention: false,
        max_position_embeddings: None,
    };
    let scale = 0.5 / (e as f64).sqrt();
    let wq = (rnd(&[e, e])? * scale)?;
    let wk = (rnd(&[hkv * d, e])? * scale)?;
    let wv = (rnd(&[hkv * d, e])? * scale)?;
    let wo = (rnd(&[e, e])? * scale)?;
    let map = [("q_proj", &wq), ("k_proj", &wk), ("v_proj", &wv), ("o_proj", &wo)]
        .into_iter()
        .map(|(k, v)| (format!("{k}.weight"), v.clone()))
        .collect();
    let layer = DecoderAttention::new(&cfg, candle_nn::VarBuilder::from_tensors(map, dt, &dev))?;
    // The window's keys and values (rotated keys, as a cache holds them).
    let k0 = rnd(&[c.b, hkv, w, d])?;
    let v0 = rnd(&[c.b, hkv, w, d])?;
    // Both caches hold K/V in the layer's dtype.
    let mut ours_cache = layer.new_cache()?;
    ours_cache.append(&k0, &v0)?;
    let mut theirs_cache = candle_nn::kv_cache::RotatingKvCache::new(2, w);
    theirs_cache.append(&k0.contiguous()?, &v0.contiguous()?)?;
    let x = (rnd(&[c.b, 1, e])? * 0.5)?;
    let dims = (c.b, hq, hkv, d, theta);
    let ws = [&wq, &wk, &wv, &wo];
    let theirs = candle_layer(ws, dims, dt)?;
    let b = c.b;
    let position = move |p: usize| Tensor::from_vec(vec![p as i64; b], (b, 1), &Device::Cpu);
    // The first step from the same state must agree with candle's layer run in f32 on
    // the same values (in bf16, candle's own layer rounds its products and softmax to
    // bf16, and is only reported).
    let f32_of = |t: &Tensor| t.to_dtype(DType::F32);
    let mut cache32 = candle_nn::kv_cache::RotatingKvCache::new(2, w);
    cache32.append(&f32_of(&k0)?, &f32_of(&v0)?)?;
    let want = candle_layer(ws, dims, DType::F32)?(&mut cache32, &f32_of(&x)?, w)?;
    let got = layer.forward_cached(&x, &position(w)?, None, Some(&mut ours_cache))?;
    let theirs_first = theirs(&mut theirs_cache, &x, w)?;
    let max_abs =
        |t: &Tensor| -> Result<f32> { Ok(f32_of(t)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?) };
    let size = max_abs(&want)?;
    let diff = max_abs(&(f32_of(&got)? - &want)?)?;
    let theirs_diff = max_abs(&(f32_of(&theirs_first)? - &want)?)?;
    eprintln!(
        "# decode_layer_sliding {}: against candle's layer in f32, ours differs by {diff:.1e} and candle's by {theirs_diff:.1e} (largest output {size:.2})",
        dtype_name(dt)
    );
    let tol = if dt == DType::F32 { 1e-4 } else { 2e-2 };
    if diff.is_nan() || diff > tol * size {
        bail!("decode_layer_sliding: ours and candle's f32 layer differ by {diff} (largest output {size})");
    }
    let (ours_cache, ours_pos) = (RefCell::new(ours_cache), Cell::new(w + 1));
    let xo = x.clone();
    impls.push((
        "ours",
        Box::new(move || {
            let p = ours_pos.replace(ours_pos.get() + 1);
            let mut cache = ours_cache.borrow_mut();
            Ok(layer.forward_cached(&xo, &position(p)?, None, Some(&mut cache))?)
        }),
    ));
    let (theirs_cache, theirs_pos) = (RefCell::new(theirs_cache), Cell::new(w + 1));
    impls.push((
        "candle_unfused",
        Box::new(move || {
            let p = theirs_pos.replace(theirs_pos.get() + 1);
            Ok(theirs(&mut theirs_cache.borrow_mut(), &x, p)?)
        }),
    ));
    let params = (2 * e * e + 2 * e * hkv * d) as f64;
    let flops = 2.0 * c.b as f64 * params + 4.0 * (c.b * hq * d * w) as f64;
    let bytes = (params + (2 * c.b * hkv * w * d) as f64) * dt.size_in_bytes() as f64;
    Ok((flops, bytes))
}

struct Row {
    case: &'static str,
    imp: &'static str,
    dtype: DType,
    ms: f64,
    gflops: f64,
    gbps: f64,
    peak_rss_mb: f64,
    /// With `--inputs`: our output's error against PyTorch's float64 output
    /// ([`fixture::normalised_error`]).
    err_vs_f64: Option<f64>,
}

/// Inputs of one case and dtype given by `--inputs FILE`: a safetensors file that
/// `scripts/bench_vs_torch.py` writes, with the tensors PyTorch times (`q`, `k`, `v`,
/// `sinks`; `x` and the four `nn.MultiheadAttention` weights for `mha_layer`, under their
/// `state_dict` names) and `expected`, PyTorch's output computed in float64 from them.
type Given = std::collections::HashMap<String, Tensor>;

fn bench_case(
    c: &Case,
    dt: DType,
    only_impl: Option<&str>,
    (rounds, min_secs): (usize, f64),
    given: Option<&Given>,
) -> Result<Vec<Row>> {
    let dev = Device::Cpu;
    let rnd =
        |shape: &[usize]| -> Result<Tensor> { Ok(Tensor::randn(0f32, 1f32, shape, &dev)?.to_dtype(dt)?) };
    // An input: `key` of `--inputs` where given, else a random normal draw times `scale`.
    let take = |key: &str, shape: &[usize], scale: f64| -> Result<Tensor> {
        let Some(given) = given else {
            return Ok((rnd(shape)? * scale)?);
        };
        let Some(t) = given.get(key) else {
            bail!("--inputs has no tensor {key:?}, which case {} needs", c.name);
        };
        if t.dims() != shape || t.dtype() != dt {
            bail!(
                "--inputs: {key:?} is {:?} {}, case {} needs {shape:?} {}",
                t.dims(),
                dtype_name(t.dtype()),
                c.name,
                dtype_name(dt)
            );
        }
        Ok(t.clone())
    };
    if given.is_some() && c.name == "decode_layer_sliding" {
        bail!("--inputs: decode_layer_sliding has no PyTorch side");
    }
    let expected = match given {
        Some(g) => match g.get("expected") {
            Some(t) => Some(t.clone()),
            None => bail!("--inputs has no tensor \"expected\" (PyTorch's float64 output)"),
        },
        None => None,
    };
    let scale = 1.0 / (c.d as f64).sqrt();
    let g = c.hq / c.hkv;
    let mut impls: Vec<Impl> = Vec::new();
    let flops;
    let bytes;
    if c.name == "decode_layer_sliding" {
        (flops, bytes) = decode_layer(c, dt, &rnd, &mut impls)?;
    } else if c.name == "mha_layer" {
        let e = c.hq * c.d;
        let x = take("x", &[c.b, c.l, e], 1.0)?;
        let cfg = MultiheadAttentionConfig {
            batch_first: true,
            ..MultiheadAttentionConfig::new(e, c.hq)
        };
        // One set of weights for both layers, scaled as PyTorch initialises them (so that
        // the scores stay of order 1 and the agreement check below is meaningful).
        let ws = (e as f64).powf(-0.5);
        let (w_in, b_in) = (
            take("in_proj_weight", &[3 * e, e], ws)?,
            take("in_proj_bias", &[3 * e], ws)?,
        );
        let (w_out, b_out) = (
            take("out_proj.weight", &[e, e], ws)?,
            take("out_proj.bias", &[e], ws)?,
        );
        let map = [
            ("in_proj_weight", w_in.clone()),
            ("in_proj_bias", b_in.clone()),
            ("out_proj.weight", w_out.clone()),
            ("out_proj.bias", b_out.clone()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let mha = MultiheadAttention::new(&cfg, candle_nn::VarBuilder::from_tensors(map, dt, &dev))?;
        let xr = x.clone();
        impls.push((
            "ours",
            Box::new(move || {
                let args = MhaArgs {
                    need_weights: false,
                    ..MhaArgs::default()
                };
                Ok(mha.forward_with(&xr, &xr, &xr, &args)?.0)
            }),
        ));
        let (b, l, h, d) = (c.b, c.l, c.hq, c.d);
        impls.push((
            "candle_unfused",
            Box::new(move || {
                let lin_in = candle_nn::Linear::new(w_in.clone(), Some(b_in.clone()));
                let qkv = lin_in.forward(&x)?.reshape((b, l, 3, h, d))?;
                let part = |i: usize| qkv.narrow(2, i, 1)?.squeeze(2)?.transpose(1, 2)?.contiguous();
                let o = unfused(&part(0)?, &part(1)?, &part(2)?, None, scale, 1)?;
                let o = o.transpose(1, 2)?.reshape((b, l, h * d))?;
                Ok(candle_nn::Linear::new(w_out.clone(), Some(b_out.clone())).forward(&o)?)
            }),
        ));
        flops = 4.0 * (c.b * c.hq * c.d) as f64 * pairs(c) + 2.0 * (c.b * c.l * e * e) as f64 * 4.0;
        bytes = (2 * c.b * c.l * e) as f64 * dt.size_in_bytes() as f64;
    } else {
        let q = take("q", &[c.b, c.hq, c.l, c.d], 1.0)?;
        let mut k = take("k", &[c.b, c.hkv, c.s, c.d], 1.0)?;
        let mut v = take("v", &[c.b, c.hkv, c.s, c.d], 1.0)?;
        if c.cache {
            // The buffers a model's decode loop reads: on Linux they are advised for huge
            // pages, which tensors of candle's own allocation are not.
            let view = KvCache::with_max_len(c.s).append(&k, &v)?;
            (k, v) = (view.k, view.v);
        }
        // Key padding: in half the batch rows, the last quarter of the keys is masked.
        let keep = if c.pad {
            let rows: Vec<u8> = (0..c.b)
                .flat_map(|b| (0..c.s).map(move |j| !(b % 2 == 1 && j >= c.s - c.s / 4) as u8))
                .collect();
            Some(Tensor::from_vec(rows, (c.b, 1, 1, c.s), &dev)?)
        } else {
            None
        };
        let mut opts = SdpaOptions::new().with_gqa(g > 1);
        opts = match (c.causal, c.bottom_right) {
            (true, true) => opts.with_mask(AttnMask::causal_bottom_right()),
            (causal, _) => opts.with_causal(causal),
        };
        if let Some(m) = &keep {
            opts = opts.with_mask(AttnMask::keep(m)?);
        }
        let softcap = match c.extra {
            Extra::Softcap(cap) => Some(cap),
            _ => None,
        };
        let sinks = match c.extra {
            Extra::Sinks => Some(take("sinks", &[c.hq], 1.0)?),
            _ => None,
        };
        opts.softcap = softcap;
        opts.sinks = sinks.clone();
        let add_mask = match (&keep, c.causal) {
            (Some(m), _) => Some(m.where_cond(
                &Tensor::zeros(m.shape(), dt, &dev)?,
                &Tensor::full(f32::NEG_INFINITY, m.shape(), &dev)?.to_dtype(dt)?,
            )?),
            (None, true) if c.candle => {
                let mut data = vec![0f32; c.l * c.s];
                for i in 0..c.l {
                    for j in (i + 1 + kv_offset(c)).min(c.s)..c.s {
                        data[i * c.s + j] = f32::NEG_INFINITY;
                    }
                }
                Some(Tensor::from_vec(data, (c.l, c.s), &dev)?.to_dtype(dt)?)
            }
            _ => None,
        };
        let (qr, kr, vr) = (q.clone(), k.clone(), v.clone());
        impls.push(("ours", Box::new(move || Ok(sdpa(&qr, &kr, &vr, &opts)?))));
        // The unfused path holds several f32 score tensors of `B·Hq·L·S`: skipped when one
        // of them would pass 1 GiB (`long8k_causal`'s is 2 GiB; `long32k_causal` runs
        // none of candle's paths).
        if c.candle && c.b * c.hq * c.l * c.s * 4 <= 1 << 30 {
            let (qr, kr, vr, am) = (q.clone(), k.clone(), v.clone(), add_mask.clone());
            let sk = sinks.clone();
            impls.push((
                "candle_unfused",
                Box::new(move || {
                    Ok(unfused_extra(
                        &qr,
                        &kr,
                        &vr,
                        am.as_ref(),
                        scale,
                        g,
                        (softcap, sk.as_ref()),
                    )?)
                }),
            ));
        }
        // candle's flash_attn takes (B, S, H, D).
        let qf = q.transpose(1, 2)?.contiguous()?;
        let kf = k.transpose(1, 2)?.contiguous()?;
        let vf = v.transpose(1, 2)?.contiguous()?;
        let cmask = if c.causal {
            candle_nn::attention::AttnMask::causal_with_offset(kv_offset(c))
        } else if c.pad {
            // Only B=1 takes an explicit mask; B=8 is refused (recorded as not accepted).
            candle_nn::attention::AttnMask::Mask(add_mask.clone().unwrap_or(q.zeros_like()?))
        } else {
            candle_nn::attention::AttnMask::None
        };
        // candle-nn's `flash_attn` takes a soft-cap (`cap · tanh(score / cap)`, as ours),
        // but no sinks.
        if c.candle && c.extra != Extra::Sinks {
            let cap = softcap.map(|x| x as f32);
            impls.push((
                "candle_flash",
                Box::new(move || Ok(flash(&qf, &kf, &vf, scale as f32, cmask.clone(), cap)?)),
            ));
        }
        flops = 4.0 * (c.b * c.hq * c.d) as f64 * pairs(c);
        let el = (c.b * c.hq * c.l * c.d * 2 + c.b * c.hkv * c.s * c.d * 2) as f64;
        bytes = el * dt.size_in_bytes() as f64;
    }

    // Warm-up, acceptance, agreement, calibration and memory.
    let mut runnable = Vec::new();
    // Our first output, which every other implementation's first output must match.
    let mut ours_out: Option<Tensor> = None;
    let mut err_vs_f64 = None;
    for (name, f) in impls {
        if only_impl.is_some_and(|i| i != name) {
            continue;
        }
        // The first call (its memory includes the buffers kept for later calls), then a
        // second one (steady state); the larger growth is reported.
        let t0 = Instant::now();
        let (first, rss_first) = with_peak_rss(&f);
        let out = match first {
            Ok(out) => out,
            Err(e) => {
                let first = e.to_string().lines().next().unwrap_or_default().to_string();
                eprintln!("# {} {} {}: not accepted: {first}", c.name, name, dtype_name(dt));
                continue;
            }
        };
        // `decode_layer_sliding` checks its layers itself (candle's bf16 layer is far
        // off; see `decode_layer`).
        if c.name != "decode_layer_sliding" {
            if name == "ours" {
                if let Some(expected) = &expected {
                    let err = fixture::normalised_error(&out, expected)?;
                    let tol = fixture::tolerance(dt);
                    eprintln!(
                        "# {} ours {}: max |ours - PyTorch f64| / max(1, max |PyTorch f64|) = {err:.1e} (tolerance {tol:.0e})",
                        c.name,
                        dtype_name(dt)
                    );
                    if err > tol {
                        bail!(
                            "{} ours {}: output differs from PyTorch's float64 output by {err:.2e} \
                             (more than the fixtures' {tol:.0e})",
                            c.name,
                            dtype_name(dt)
                        );
                    }
                    err_vs_f64 = Some(err);
                }
                ours_out = Some(out);
            } else if let Some(reference) = &ours_out {
                let err = rel_diff(&out, reference)?;
                eprintln!(
                    "# {} {} {}: max |out - ours| / max |ours| = {err:.1e}",
                    c.name,
                    name,
                    dtype_name(dt)
                );
                if dt == DType::F32 && err > AGREE_F32 {
                    bail!(
                        "{} {} {}: output differs from ours by {err:.2e} of its largest value \
                         (more than {}): the two do not compute the same attention",
                        c.name,
                        name,
                        dtype_name(dt),
                        AGREE_F32
                    );
                }
            }
        }
        let once = t0.elapsed().as_secs_f64();
        let iters = ((min_secs / once.max(1e-9)).ceil() as usize).max(1);
        let (second, rss_second) = with_peak_rss(|| f().map(drop));
        second?;
        let rss = rss_first.max(rss_second);
        runnable.push((name, f, iters, rss, Vec::new()));
    }
    for _ in 0..rounds {
        for (_, f, iters, _, times) in runnable.iter_mut() {
            let t0 = Instant::now();
            for _ in 0..*iters {
                drop(f()?);
            }
            times.push(t0.elapsed().as_secs_f64() / *iters as f64);
        }
    }
    Ok(runnable
        .into_iter()
        .map(|(name, _, _, rss, mut times)| {
            times.sort_by(f64::total_cmp);
            let t = times[times.len() / 2];
            Row {
                case: c.name,
                imp: name,
                dtype: dt,
                ms: t * 1e3,
                gflops: flops / t / 1e9,
                gbps: bytes / t / 1e9,
                peak_rss_mb: rss,
                err_vs_f64: if name == "ours" { err_vs_f64 } else { None },
            }
        })
        .collect())
}

/// One thread's f32 FMA loop: `n` iterations of 24 independent `vfmadd231ps` on zmm
/// registers (AVX-512F), 12 on ymm (AVX2+FMA) or 22 `fmla` on NEON q registers.
/// Returns the FLOPs it did, or `None` where the kernel has no such instruction set.
///
/// Each loop first zeroes its accumulators (stale register contents could be
/// denormal), and the x86 loops end with `vzeroupper`: with dirty upper register state,
/// the code after them (candle's, built for baseline x86-64) ran its SSE instructions
/// up to 50× slower.
#[allow(unused_variables)]
fn fma_loop(isa: &str, n: usize) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        if isa == "avx512" {
            // SAFETY: the kernel reports AVX-512 only on a CPU that has AVX-512F; the loop
            // touches no memory and clobbers only the registers it names.
            unsafe {
                std::arch::asm!(
                    "vxorps xmm0, xmm0, xmm0", "vxorps xmm1, xmm1, xmm1", "vxorps xmm2, xmm2, xmm2",
                    "vxorps xmm3, xmm3, xmm3", "vxorps xmm4, xmm4, xmm4", "vxorps xmm5, xmm5, xmm5",
                    "vxorps xmm6, xmm6, xmm6", "vxorps xmm7, xmm7, xmm7", "vxorps xmm8, xmm8, xmm8",
                    "vxorps xmm9, xmm9, xmm9", "vxorps xmm10, xmm10, xmm10", "vxorps xmm11, xmm11, xmm11",
                    "vxorps xmm12, xmm12, xmm12", "vxorps xmm13, xmm13, xmm13", "vxorps xmm14, xmm14, xmm14",
                    "vxorps xmm15, xmm15, xmm15", "vpxord xmm16, xmm16, xmm16", "vpxord xmm17, xmm17, xmm17",
                    "vpxord xmm18, xmm18, xmm18", "vpxord xmm19, xmm19, xmm19", "vpxord xmm20, xmm20, xmm20",
                    "vpxord xmm21, xmm21, xmm21", "vpxord xmm22, xmm22, xmm22", "vpxord xmm23, xmm23, xmm23",
                    "vpxord xmm30, xmm30, xmm30",
                    "vpxord xmm31, xmm31, xmm31",
                    "2:",
                    "vfmadd231ps zmm0, zmm30, zmm31", "vfmadd231ps zmm1, zmm30, zmm31",
                    "vfmadd231ps zmm2, zmm30, zmm31", "vfmadd231ps zmm3, zmm30, zmm31",
                    "vfmadd231ps zmm4, zmm30, zmm31", "vfmadd231ps zmm5, zmm30, zmm31",
                    "vfmadd231ps zmm6, zmm30, zmm31", "vfmadd231ps zmm7, zmm30, zmm31",
                    "vfmadd231ps zmm8, zmm30, zmm31", "vfmadd231ps zmm9, zmm30, zmm31",
                    "vfmadd231ps zmm10, zmm30, zmm31", "vfmadd231ps zmm11, zmm30, zmm31",
                    "vfmadd231ps zmm12, zmm30, zmm31", "vfmadd231ps zmm13, zmm30, zmm31",
                    "vfmadd231ps zmm14, zmm30, zmm31", "vfmadd231ps zmm15, zmm30, zmm31",
                    "vfmadd231ps zmm16, zmm30, zmm31", "vfmadd231ps zmm17, zmm30, zmm31",
                    "vfmadd231ps zmm18, zmm30, zmm31", "vfmadd231ps zmm19, zmm30, zmm31",
                    "vfmadd231ps zmm20, zmm30, zmm31", "vfmadd231ps zmm21, zmm30, zmm31",
                    "vfmadd231ps zmm22, zmm30, zmm31", "vfmadd231ps zmm23, zmm30, zmm31",
                    "dec {n}",
                    "jnz 2b",
                    "vzeroupper",
                    n = inout(reg) n.max(1) => _,
                    out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _,
                    out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _,
                    out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
                    out("zmm12") _, out("zmm13") _, out("zmm14") _, out("zmm15") _,
                    out("zmm16") _, out("zmm17") _, out("zmm18") _, out("zmm19") _,
                    out("zmm20") _, out("zmm21") _, out("zmm22") _, out("zmm23") _,
                    out("zmm30") _, out("zmm31") _,
                    options(nostack, nomem),
                );
            }
            return Some((n.max(1) * 24 * 32) as f64);
        }
        if isa == "avx2+fma" {
            // SAFETY: as above, for AVX2+FMA.
            unsafe {
                std::arch::asm!(
                    "vxorps xmm0, xmm0, xmm0", "vxorps xmm1, xmm1, xmm1", "vxorps xmm2, xmm2, xmm2",
                    "vxorps xmm3, xmm3, xmm3", "vxorps xmm4, xmm4, xmm4", "vxorps xmm5, xmm5, xmm5",
                    "vxorps xmm6, xmm6, xmm6", "vxorps xmm7, xmm7, xmm7", "vxorps xmm8, xmm8, xmm8",
                    "vxorps xmm9, xmm9, xmm9", "vxorps xmm10, xmm10, xmm10", "vxorps xmm11, xmm11, xmm11",
                    "vxorps xmm14, xmm14, xmm14",
                    "vxorps xmm15, xmm15, xmm15",
                    "2:",
                    "vfmadd231ps ymm0, ymm14, ymm15", "vfmadd231ps ymm1, ymm14, ymm15",
                    "vfmadd231ps ymm2, ymm14, ymm15", "vfmadd231ps ymm3, ymm14, ymm15",
                    "vfmadd231ps ymm4, ymm14, ymm15", "vfmadd231ps ymm5, ymm14, ymm15",
                    "vfmadd231ps ymm6, ymm14, ymm15", "vfmadd231ps ymm7, ymm14, ymm15",
                    "vfmadd231ps ymm8, ymm14, ymm15", "vfmadd231ps ymm9, ymm14, ymm15",
                    "vfmadd231ps ymm10, ymm14, ymm15", "vfmadd231ps ymm11, ymm14, ymm15",
                    "dec {n}",
                    "jnz 2b",
                    "vzeroupper",
                    n = inout(reg) n.max(1) => _,
                    out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
                    out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
                    out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
                    out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
                    options(nostack, nomem),
                );
            }
            return Some((n.max(1) * 12 * 16) as f64);
        }
    }
    #[cfg(target_arch = "aarch64")]
    if isa == "neon" {
        // SAFETY: NEON is part of AArch64; the loop touches no memory and clobbers only
        // the registers it names.
        unsafe {
            std::arch::asm!(
                "movi v0.4s, #0", "movi v1.4s, #0", "movi v2.4s, #0", "movi v3.4s, #0",
                "movi v4.4s, #0", "movi v5.4s, #0", "movi v6.4s, #0", "movi v7.4s, #0",
                "movi v16.4s, #0", "movi v17.4s, #0", "movi v18.4s, #0", "movi v19.4s, #0",
                "movi v20.4s, #0", "movi v21.4s, #0", "movi v22.4s, #0", "movi v23.4s, #0",
                "movi v24.4s, #0", "movi v25.4s, #0", "movi v26.4s, #0", "movi v27.4s, #0",
                "movi v28.4s, #0", "movi v29.4s, #0",
                "movi v30.4s, #0",
                "movi v31.4s, #0",
                "2:",
                "fmla v0.4s, v30.4s, v31.4s", "fmla v1.4s, v30.4s, v31.4s",
                "fmla v2.4s, v30.4s, v31.4s", "fmla v3.4s, v30.4s, v31.4s",
                "fmla v4.4s, v30.4s, v31.4s", "fmla v5.4s, v30.4s, v31.4s",
                "fmla v6.4s, v30.4s, v31.4s", "fmla v7.4s, v30.4s, v31.4s",
                "fmla v16.4s, v30.4s, v31.4s", "fmla v17.4s, v30.4s, v31.4s",
                "fmla v18.4s, v30.4s, v31.4s", "fmla v19.4s, v30.4s, v31.4s",
                "fmla v20.4s, v30.4s, v31.4s", "fmla v21.4s, v30.4s, v31.4s",
                "fmla v22.4s, v30.4s, v31.4s", "fmla v23.4s, v30.4s, v31.4s",
                "fmla v24.4s, v30.4s, v31.4s", "fmla v25.4s, v30.4s, v31.4s",
                "fmla v26.4s, v30.4s, v31.4s", "fmla v27.4s, v30.4s, v31.4s",
                "fmla v28.4s, v30.4s, v31.4s", "fmla v29.4s, v30.4s, v31.4s",
                "subs {n}, {n}, #1",
                "b.ne 2b",
                n = inout(reg) n.max(1) => _,
                out("v0") _, out("v1") _, out("v2") _, out("v3") _, out("v4") _, out("v5") _,
                out("v6") _, out("v7") _, out("v16") _, out("v17") _, out("v18") _,
                out("v19") _, out("v20") _, out("v21") _, out("v22") _, out("v23") _,
                out("v24") _, out("v25") _, out("v26") _, out("v27") _, out("v28") _,
                out("v29") _, out("v30") _, out("v31") _,
                options(nostack, nomem),
            );
        }
        return Some((n.max(1) * 22 * 8) as f64);
    }
    None
}

/// The f32 FMA peak in GFLOP/s with every rayon thread (the kernel's pool) running
/// [`fma_loop`] at once, the median of three runs of about `secs` each, and the
/// instruction set it used; `None` on the portable kernel.
fn fma_peak(secs: f64) -> Option<(f64, usize, &'static str)> {
    let isa = candle_attention::cpu_kernel_isa();
    // Calibrate the iteration count on one thread.
    let mut n = 1 << 16;
    loop {
        let t = Instant::now();
        fma_loop(isa, n)?;
        let dt = t.elapsed().as_secs_f64();
        if dt > 0.02 {
            n = ((n as f64) * secs / dt).max(1.0) as usize;
            break;
        }
        n *= 4;
    }
    let threads = rayon::current_num_threads();
    let mut runs: Vec<f64> = (0..3)
        .map(|_| {
            let t = Instant::now();
            let flops: f64 = rayon::broadcast(|_| fma_loop(isa, n).unwrap_or(0.0)).iter().sum();
            flops / t.elapsed().as_secs_f64() / 1e9
        })
        .collect();
    runs.sort_by(f64::total_cmp);
    Some((runs[1], threads, isa))
}

/// Bytes of the buffer that [`read_bw`] reads: 8× this machine's 32 MiB L3, so every
/// pass streams from DRAM.
const BW_BYTES: usize = 256 << 20;

/// Sum of `x` with 32 independent partial sums, so the loop is limited by memory and
/// not by the latency of one chain of additions.
fn sum_f32(x: &[f32]) -> f32 {
    let mut acc = [0f32; 32];
    for c in x.chunks_exact(32) {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v;
        }
    }
    acc.iter().sum::<f32>() + x.chunks_exact(32).remainder().iter().sum::<f32>()
}

/// A [`BW_BYTES`] buffer of ones, on huge pages where `huge` and Linux grants them (the
/// advice `KvCache` gives its buffers), else on the allocator's pages (4 KiB).
fn bw_buffer(huge: bool) -> Vec<f32> {
    let n = BW_BYTES / 4;
    let mut buf: Vec<f32> = Vec::with_capacity(n);
    #[cfg(target_os = "linux")]
    if huge {
        const HP: usize = 2 << 20;
        let addr = buf.as_mut_ptr() as usize;
        let (start, end) = ((addr + HP - 1) & !(HP - 1), (addr + BW_BYTES) & !(HP - 1));
        // SAFETY: `[start, end)` lies inside the capacity of `buf`, which nothing has
        // written yet; the advice only changes how its pages are faulted in.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = huge;
    // Filled before timing, so the pages are resident.
    buf.resize(n, 1.0);
    buf
}

/// The machine's DRAM read bandwidth in GB/s with every rayon thread (the kernel's pool)
/// summing its own contiguous share of a [`BW_BYTES`] buffer at once (of huge pages
/// where `huge`), the median of three runs of about `secs` each (the decode cases' `gbps`
/// can be read as a fraction of it), and the thread count.
fn read_bw(secs: f64, huge: bool) -> (f64, usize) {
    let threads = rayon::current_num_threads().max(1);
    let n = BW_BYTES / 4;
    let buf = bw_buffer(huge);
    let per = n / threads;
    let pass = |reps: usize| -> f64 {
        let t = Instant::now();
        let sums = rayon::broadcast(|ctx| {
            let part = &buf[ctx.index() * per..(ctx.index() + 1) * per];
            (0..reps)
                .map(|_| sum_f32(std::hint::black_box(part)))
                .sum::<f32>()
        });
        std::hint::black_box(sums);
        (reps * per * threads * 4) as f64 / t.elapsed().as_secs_f64() / 1e9
    };
    let first = pass(1);
    let reps = ((secs * first * 1e9 / BW_BYTES as f64).ceil() as usize).max(1);
    let mut runs: Vec<f64> = (0..3).map(|_| pass(reps)).collect();
    runs.sort_by(f64::total_cmp);
    (runs[1], threads)
}

fn report_peak(when: &str) {
    match fma_peak(0.5) {
        Some((g, t, isa)) => eprintln!("fma_peak {when}: {g:.1} GFLOP/s f32 ({t} threads, {isa})"),
        None => eprintln!("fma_peak {when}: not measured (portable kernel)"),
    }
    let (bw, t) = read_bw(0.5, false);
    let (bw_huge, _) = read_bw(0.5, true);
    eprintln!(
        "read_bw {when}: {bw:.1} GB/s with 4 KiB pages, {bw_huge:.1} GB/s with huge pages ({t} threads, {} MiB)",
        BW_BYTES >> 20
    );
}

/// Usage line, printed by `--help`.
const USAGE: &str = "usage: bench [--json] [--case NAME | --shape B,Hq,Hkv,L,S,D[,causal|causal_br]] \
[--dtype f32|bf16|f16] [--impl NAME] [--rounds N] [--min-secs S] [--no-peak | --peak-only] [--inputs FILE]";

/// The implementations `--impl` can pick.
const IMPLS: &[&str] = &["ours", "candle_unfused", "candle_flash"];

fn main() -> Result<()> {
    let mut json = false;
    let mut only_case: Option<String> = None;
    let mut only_dtype: Option<DType> = None;
    let mut only_impl: Option<String> = None;
    let mut rounds = 5usize;
    let mut min_secs = 1.0f64;
    let mut peak = true;
    let mut shape: Option<Case> = None;
    let mut inputs: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        // The value after the flag `a`, or an error that names it.
        let mut value = |flag: &str| args.next().ok_or_else(|| anyhow::anyhow!("{flag} needs a value"));
        match a.as_str() {
            "-h" | "--help" => {
                println!("{USAGE}");
                println!(
                    "cases: {}",
                    CASES.iter().map(|c| c.name).collect::<Vec<_>>().join(", ")
                );
                println!("impls: {}", IMPLS.join(", "));
                return Ok(());
            }
            "--json" => json = true,
            "--no-peak" => peak = false,
            "--peak-only" => {
                report_peak("now");
                return Ok(());
            }
            "--case" => only_case = Some(value("--case")?),
            "--shape" => shape = Some(parse_shape(&value("--shape")?)?),
            "--impl" => {
                let name = value("--impl")?;
                if !IMPLS.contains(&name.as_str()) {
                    bail!("--impl takes one of {}, got {name:?}", IMPLS.join(", "));
                }
                only_impl = Some(name);
            }
            "--inputs" => inputs = Some(value("--inputs")?),
            "--dtype" => {
                only_dtype = Some(match value("--dtype")?.as_str() {
                    "f32" => DType::F32,
                    "bf16" => DType::BF16,
                    "f16" => DType::F16,
                    other => bail!("--dtype takes f32, bf16 or f16, got {other:?}"),
                })
            }
            "--rounds" => {
                let v = value("--rounds")?;
                rounds = match v.parse() {
                    Ok(n) if n >= 1 => n,
                    _ => bail!("--rounds takes a whole number of at least 1, got {v:?}"),
                };
            }
            "--min-secs" => {
                let v = value("--min-secs")?;
                min_secs = match v.parse::<f64>() {
                    Ok(x) if x.is_finite() && x >= 0.0 => x,
                    _ => bail!("--min-secs takes a finite number of seconds, at least 0, got {v:?}"),
                };
            }
            _ => bail!("unknown argument {a} (--help lists them)"),
        }
    }
    if shape.is_some() && only_case.is_some() {
        bail!("--shape and --case exclude each other");
    }
    if let Some(name) = &only_case {
        if !CASES.iter().any(|c| c.name == name) {
            bail!(
                "unknown case {name}; cases: {}",
                CASES.iter().map(|c| c.name).collect::<Vec<_>>().join(", ")
            );
        }
    }
    // `--inputs` holds one case in one dtype.
    let given = match &inputs {
        None => None,
        Some(_) if only_dtype.is_none() || (only_case.is_none() && shape.is_none()) => {
            bail!("--inputs needs one case (--case or --shape) and one --dtype")
        }
        Some(path) => Some(
            candle_core::safetensors::load(path, &Device::Cpu)
                .map_err(|e| anyhow::anyhow!("--inputs {path}: {e}"))?,
        ),
    };
    if peak {
        report_peak("before");
    }
    if !json {
        println!(
            "{:<18} {:<15} {:<5} {:>10} {:>8} {:>8} {:>11}",
            "case", "impl", "dtype", "ms", "GFLOP/s", "GB/s", "peak_rss_mb"
        );
    }
    let cases: Vec<Case> = match shape {
        Some(c) => vec![c],
        None => CASES
            .iter()
            .filter(|c| only_case.as_deref().is_none_or(|n| n == c.name))
            .copied()
            .collect(),
    };
    for c in &cases {
        for &dt in c.dtypes.iter().filter(|d| only_dtype.is_none_or(|o| o == **d)) {
            for r in bench_case(c, dt, only_impl.as_deref(), (rounds, min_secs), given.as_ref())? {
                if json {
                    let mut row = serde_json::json!({"case": r.case, "impl": r.imp, "dtype": dtype_name(r.dtype), "ms": r.ms,
                            "gflops": r.gflops, "gbps": r.gbps, "peak_rss_mb": r.peak_rss_mb});
                    if let Some(err) = r.err_vs_f64 {
                        row["err_vs_f64"] = err.into();
                    }
                    println!("{row}");
                } else {
                    println!(
                        "{:<18} {:<15} {:<5} {:>10.3} {:>8.1} {:>8.2} {:>11.1}",
                        r.case,
                        r.imp,
                        dtype_name(r.dtype),
                        r.ms,
                        r.gflops,
                        r.gbps,
                        r.peak_rss_mb
                    );
                }
            }
        }
    }
    if peak {
        report_peak("after");
    }
    Ok(())
}
