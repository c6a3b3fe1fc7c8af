//! Random calls of the public API, most of them invalid: wrong ranks, sizes, dtypes and
//! mask shapes, empty dimensions, strided inputs, scales and soft-caps of every sign,
//! sinks of the wrong shape, missing and misshapen weights, corrupt `config.json` files.
//! Each call must return (a result or an error); none may panic. SDPA calls, and
//! `MultiheadAttention` and `DecoderAttention` layers, that ran on the fused kernel must
//! also agree with the reference path. Shapes, dtypes and
//! options come from fixed seeds (the tensors' values do not), so a failure names a call
//! that can be replayed.
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};

use candle_attention::decoder::{DecoderAttention, DecoderAttentionConfig, QkNorm, QkvLayout};
use candle_attention::{
    scaled_dot_product_attention, sdpa, AttnMask, Backend, CausalAlign, KvCache, MhaArgs, MultiheadAttention,
    MultiheadAttentionConfig, RopeConfig, RopeScaling, RopeStyle, SdpaOptions,
};
use candle_core::{DType, Device, Result, Tensor};
use candle_nn::VarBuilder;

/// Xorshift draws.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(0x9E37_79B9_7F4A_7C15 ^ seed.wrapping_mul(0x2545_F491_4F6C_DD1D))
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn pick<T: Clone>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len() as u64) as usize].clone()
    }
}

/// A random tensor of `shape` and `dtype` (integers as 0/1).
fn tensor(shape: &[usize], dtype: DType) -> Tensor {
    let x = Tensor::randn(0f32, 1.0, shape, &Device::Cpu).expect("randn of any shape");
    let x = match dtype {
        DType::U8 | DType::U32 | DType::I64 => x.ge(0.0).and_then(|m| m.to_dtype(dtype)),
        _ => x.to_dtype(dtype),
    };
    x.expect("casts between candle's dtypes")
}

/// `tensor`, one time in four as a strided view: the transpose of a contiguous tensor
/// whose last two dims are swapped.
fn maybe_strided(r: &mut Rng, shape: &[usize], dtype: DType) -> Tensor {
    let n = shape.len();
    if n >= 2 && r.below(4) == 0 {
        let mut t_shape = shape.to_vec();
        t_shape.swap(n - 2, n - 1);
        return tensor(&t_shape, dtype)
            .transpose(n - 2, n - 1)
            .expect("transpose of the last two dims");
    }
    tensor(shape, dtype)
}

/// `dims`, each perturbed to a size that may break the shape rules one time in twelve.
fn perturb(r: &mut Rng, dims: &[usize]) -> Vec<usize> {
    dims.iter()
        .map(|&d| {
            if r.below(12) == 0 {
                r.pick(&[0, 1, 2, 3, 5, 17, 65])
            } else {
                d
            }
        })
        .collect()
}

/// Inserts a random weight `name` of `shape`, except that one time in forty it is left
/// out and one time in forty it is one larger in every dim.
fn put_weight(r: &mut Rng, weights: &mut HashMap<String, Tensor>, name: &str, shape: &[usize], dtype: DType) {
    if r.below(40) != 0 {
        let grow = usize::from(r.below(40) == 0);
        let shape: Vec<usize> = shape.iter().map(|d| d + grow).collect();
        weights.insert(name.to_string(), tensor(&shape, dtype));
    }
}

/// Runs `f`, returning `Some(description)` if it panicked, and counts whether it
/// returned a value or an error.
fn run(desc: String, counts: &mut (usize, usize), f: impl FnOnce() -> Result<()>) -> Option<String> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => {
            counts.0 += 1;
            None
        }
        Ok(Err(_)) => {
            counts.1 += 1;
            None
        }
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Some(format!("{desc}: {msg}"))
        }
    }
}

/// Asserts that `got` (a fused-kernel result) is within the fixtures' tolerance of the
/// dtype of `want` (the reference path's), relative to max(1, max|want|), NaN for NaN.
fn assert_agrees(got: &Tensor, want: &Tensor) -> Result<()> {
    let g = got.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
    let w = want.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
    let top = w
        .iter()
        .filter(|x| x.is_finite())
        .fold(1f64, |a, &b| a.max(b.abs()));
    let tol = candle_attention::fixture::tolerance(want.dtype()) * top;
    for (i, (g, w)) in g.iter().zip(&w).enumerate() {
        let agree = if w.is_nan() {
            g.is_nan()
        } else {
            (g - w).abs() <= tol
        };
        assert!(
            agree,
            "fused and reference differ at {i}: {g} against {w} (tolerance {tol:e})"
        );
    }
    Ok(())
}

/// One random `scaled_dot_product_attention` call, checked against the reference path
/// where the fused kernel ran.
fn sdpa_call(r: &mut Rng, counts: &mut (usize, usize)) -> Option<String> {
    let dts = [
        DType::F32,
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::F64,
        DType::U8,
        DType::I64,
    ];
    let (b, hkv) = (r.pick(&[1usize, 2, 3]), r.pick(&[1usize, 2, 4]));
    let hq = hkv * r.pick(&[1usize, 1, 2, 4]);
    let (l, s) = (
        r.pick(&[0usize, 1, 2, 7, 16, 33, 70]),
        r.pick(&[0usize, 1, 3, 7, 64, 65, 130]),
    );
    let e = r.pick(&[1usize, 8, 16, 32, 48, 64]);
    let ev = if r.below(4) == 0 {
        r.pick(&[1usize, 16, 24, 64])
    } else {
        e
    };
    let rank = r.pick(&[2usize, 3, 4, 4, 4, 5]);
    let cut = |x: [usize; 4]| -> Vec<usize> {
        if rank <= 4 {
            x[4 - rank..].to_vec()
        } else {
            [&[2][..], &x[..]].concat()
        }
    };
    let (qd, kd, vd) = (
        perturb(r, &cut([b, hq, l, e])),
        perturb(r, &cut([b, hkv, s, e])),
        perturb(r, &cut([b, hkv, s, ev])),
    );
    let dt = r.pick(&dts);
    let dtkv = if r.below(20) == 0 { r.pick(&dts) } else { dt };
    let mut opts = SdpaOptions::new();
    let mut mask_desc = String::new();
    if r.below(3) == 0 {
        let shape = match r.below(5) {
            0 => vec![l, s],
            1 => vec![b, 1, 1, s],
            2 => vec![b, hq, l, s],
            3 => vec![s],
            _ => perturb(r, &[b, hq, l, s]),
        };
        let mdt = r.pick(&[
            DType::U8,
            DType::F32,
            DType::F16,
            DType::BF16,
            DType::I64,
            DType::F64,
        ]);
        let kind = r.below(6);
        mask_desc = format!(" mask {kind} {shape:?} {mdt:?}");
        let m = tensor(&shape, mdt);
        let mask = match kind {
            0 => AttnMask::keep(&m),
            1 => AttnMask::ignore(&m),
            2 => AttnMask::additive(&m),
            3 => AttnMask::key_padding(&m),
            4 => AttnMask::sliding_window(r.pick(&[0usize, 1, 3, 100]), CausalAlign::BottomRight),
            _ => Ok(AttnMask::causal_with_offset(r.pick(&[-5isize, -1, 0, 3, 1000]))),
        };
        // A mask the constructor refuses is an error path of its own; the call runs
        // without it.
        if let Ok(mask) = mask {
            opts = opts.with_mask(mask);
        }
    }
    opts.is_causal = r.below(3) == 0;
    if r.below(4) == 0 {
        opts.scale = Some(r.pick(&[0.0, -1.0, f64::NAN, f64::INFINITY, 1e30, 0.125]));
    }
    opts.enable_gqa = r.below(4) != 0;
    opts.need_weights = r.below(6) == 0;
    opts.backend = r.pick(&[Backend::Auto, Backend::Auto, Backend::Fused, Backend::Reference]);
    if r.below(6) == 0 {
        opts.softcap = Some(r.pick(&[0.0, -3.0, f64::NAN, 50.0, 1e-30, 1e300]));
    }
    if r.below(6) == 0 {
        let shapes = [vec![hq], vec![hkv], vec![1, hq], vec![]];
        let shape = shapes[r.below(4) as usize].clone();
        opts.sinks = Some(tensor(&shape, r.pick(&[DType::F32, dt])));
    }
    let desc = format!(
        "q {qd:?} k {kd:?} v {vd:?} {dt:?}/{dtkv:?}{mask_desc} causal {} scale {:?} gqa {} weights {} {:?} softcap {:?} sinks {:?}",
        opts.is_causal,
        opts.scale,
        opts.enable_gqa,
        opts.need_weights,
        opts.backend,
        opts.softcap,
        opts.sinks.as_ref().map(|t| t.dims().to_vec())
    );
    let (q, k, v) = (
        maybe_strided(r, &qd, dt),
        maybe_strided(r, &kd, dtkv),
        maybe_strided(r, &vd, dtkv),
    );
    // Where the fused kernel ran on an ordinary scale, the reference path must agree
    // within the fixtures' tolerance of the dtype (relative to max(1, max|reference|)),
    // NaN for NaN. (Non-finite scales give 0 on one path and NaN on the other, see the
    // README's choices; huge ones have their own test in `tests/extremes.rs`.)
    let compare = opts.backend != Backend::Reference && opts.scale.is_none_or(|s| s.abs() <= 1.0);
    run(desc, counts, || {
        let out = scaled_dot_product_attention(&q, &k, &v, &opts)?;
        out.output.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        if let Some(w) = out.weights {
            w.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        }
        if compare {
            let reference = SdpaOptions {
                backend: Backend::Reference,
                need_weights: false,
                ..opts.clone()
            };
            let want = scaled_dot_product_attention(&q, &k, &v, &reference)?.output;
            assert_agrees(&out.output, &want)?;
        }
        Ok(())
    })
}

/// One random `MultiheadAttention` layer and call.
fn mha_call(r: &mut Rng, counts: &mut (usize, usize)) -> Option<String> {
    let (e, h) = (r.pick(&[0usize, 4, 8, 12, 16, 32]), r.pick(&[0usize, 1, 2, 3, 4]));
    let mut cfg = MultiheadAttentionConfig::new(e, h);
    cfg.bias = r.below(2) == 0;
    cfg.add_bias_kv = r.below(4) == 0;
    cfg.add_zero_attn = r.below(4) == 0;
    cfg.batch_first = r.below(2) == 0;
    if r.below(4) == 0 {
        cfg.kdim = Some(r.pick(&[0usize, 5, 8]));
        cfg.vdim = Some(r.pick(&[0usize, 6, 8]));
    }
    let dt = r.pick(&[DType::F32, DType::F32, DType::F16, DType::BF16, DType::F64]);
    let (kd, vd) = (cfg.kdim.unwrap_or(e), cfg.vdim.unwrap_or(e));
    // The state dict, with a weight sometimes missing or one larger in every dim.
    let mut weights: HashMap<String, Tensor> = HashMap::new();
    let mut put = |r: &mut Rng, name: &str, shape: Vec<usize>| put_weight(r, &mut weights, name, &shape, dt);
    if kd == e && vd == e {
        put(r, "in_proj_weight", vec![3 * e, e]);
    } else {
        put(r, "q_proj_weight", vec![e, e]);
        put(r, "k_proj_weight", vec![e, kd]);
        put(r, "v_proj_weight", vec![e, vd]);
    }
    if cfg.bias {
        put(r, "in_proj_bias", vec![3 * e]);
        put(r, "out_proj.bias", vec![e]);
    }
    put(r, "out_proj.weight", vec![e, e]);
    if cfg.add_bias_kv {
        put(r, "bias_k", vec![1, 1, e]);
        put(r, "bias_v", vec![1, 1, e]);
    }
    let vb = VarBuilder::from_tensors(weights, dt, &Device::Cpu);
    let (n, l, s) = (
        r.pick(&[0usize, 1, 2, 3]),
        r.pick(&[0usize, 1, 5, 16]),
        r.pick(&[0usize, 1, 5, 16]),
    );
    let unbatched = r.below(5) == 0;
    let shape = |len: usize, d: usize| -> Vec<usize> {
        match (unbatched, cfg.batch_first) {
            (true, _) => vec![len, d],
            (false, true) => vec![n, len, d],
            (false, false) => vec![len, n, d],
        }
    };
    let mut q_shape = shape(l, e);
    if r.below(15) == 0 {
        q_shape[0] += 1;
    }
    let in_dt = if r.below(15) == 0 {
        r.pick(&[DType::F32, DType::F16, DType::U8])
    } else {
        dt
    };
    let self_attn = r.below(2) == 0 && kd == e && vd == e;
    let q = tensor(&q_shape, in_dt);
    let (k, v) = if self_attn {
        (q.clone(), q.clone())
    } else {
        (tensor(&shape(s, kd), in_dt), tensor(&shape(s, vd), in_dt))
    };
    let sl = if self_attn { l } else { s };
    let kpm = (r.below(3) == 0).then(|| {
        let shape = r.pick(&[vec![n, sl], vec![sl], vec![n, sl + 1], vec![1, sl]]);
        tensor(&shape, r.pick(&[DType::U8, DType::F32, dt, DType::I64]))
    });
    let am = (r.below(3) == 0).then(|| {
        let shape = r.pick(&[
            vec![l, sl],
            vec![n * h.max(1), l, sl],
            vec![l, sl + 1],
            vec![1, l, sl],
        ]);
        tensor(&shape, r.pick(&[DType::U8, DType::F32, dt]))
    });
    let args = MhaArgs {
        key_padding_mask: kpm.as_ref(),
        attn_mask: am.as_ref(),
        need_weights: r.below(3) == 0,
        average_attn_weights: r.below(2) == 0,
        is_causal: r.below(4) == 0,
        backend: r.pick(&[Backend::Auto, Backend::Fused, Backend::Reference]),
    };
    let desc = format!(
        "{cfg:?} {dt:?} input {in_dt:?} q {q_shape:?} n {n} l {l} s {s} unbatched {unbatched} self {self_attn} key_padding_mask {:?} attn_mask {:?} {args:?}",
        kpm.as_ref().map(|t| (t.dims().to_vec(), t.dtype())),
        am.as_ref().map(|t| (t.dims().to_vec(), t.dtype()))
    );
    run(desc, counts, || {
        let mha = MultiheadAttention::new(&cfg, vb)?;
        let (out, w) = mha.forward_with(&q, &k, &v, &args)?;
        out.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        if let Some(w) = w {
            w.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        }
        // The layer on the reference path must agree with the layer as it ran.
        if args.backend != Backend::Reference {
            let reference = MhaArgs {
                backend: Backend::Reference,
                ..args
            };
            assert_agrees(&out, &mha.forward_with(&q, &k, &v, &reference)?.0)?;
        }
        Ok(())
    })
}

/// One random `DecoderAttention` layer (separate projections) and one to three calls:
/// a prefill and decode steps through a cache (the layer's own or one of the caller's),
/// or cross-attention.
fn decoder_call(r: &mut Rng, counts: &mut (usize, usize)) -> Option<String> {
    let hkv = r.pick(&[0usize, 1, 2]);
    let h = hkv * r.pick(&[1usize, 2, 3]) + usize::from(r.below(10) == 0);
    let hd = r.pick(&[0usize, 2, 4, 8, 16]);
    let hidden = r.pick(&[0usize, 4, 8, 16]);
    let rope = (r.below(2) == 0).then(|| RopeConfig {
        head_dim: if r.below(10) == 0 { hd + 2 } else { hd },
        rotary_dim: r.pick(&[0usize, 2, hd, hd / 2, hd + 2]),
        theta: r.pick(&[10000.0, 0.0, -1.0, f64::NAN, 1e300]),
        style: r.pick(&[RopeStyle::HalfSplit, RopeStyle::Interleaved]),
        scaling: RopeScaling::Default,
    });
    let cfg = DecoderAttentionConfig {
        hidden_size: hidden,
        num_heads: h,
        num_kv_heads: hkv,
        head_dim: hd,
        layout: QkvLayout::separate(r.below(2) == 0, r.below(2) == 0, r.below(2) == 0, r.below(2) == 0),
        qk_norm: (r.below(4) == 0).then(|| QkNorm {
            eps: r.pick(&[1e-6, 0.0, -1.0]),
            unit_offset: r.below(2) == 0,
        }),
        rope,
        alibi: r.below(6) == 0,
        softcap: (r.below(6) == 0).then(|| r.pick(&[30.0, 0.0, -1.0, f64::NAN])),
        sinks: r.below(6) == 0,
        sliding_window: (r.below(4) == 0).then(|| r.pick(&[0usize, 1, 2, 5])),
        bidirectional: r.below(8) == 0,
        scale: r.pick(&[0.25, 0.0, f64::NAN]),
        cross_attention: r.below(8) == 0,
        max_position_embeddings: (r.below(4) == 0).then(|| r.pick(&[0usize, 4, 64])),
    };
    let dt = r.pick(&[DType::F32, DType::F32, DType::F16, DType::BF16, DType::F64]);
    let mut weights: HashMap<String, Tensor> = HashMap::new();
    let mut put = |r: &mut Rng, name: &str, shape: Vec<usize>| put_weight(r, &mut weights, name, &shape, dt);
    for (name, out, inp) in [
        ("q_proj", h * hd, hidden),
        ("k_proj", hkv * hd, hidden),
        ("v_proj", hkv * hd, hidden),
        ("o_proj", hidden, h * hd),
    ] {
        put(r, &format!("{name}.weight"), vec![out, inp]);
        put(r, &format!("{name}.bias"), vec![out]);
    }
    put(r, "q_norm.weight", vec![hd]);
    put(r, "k_norm.weight", vec![hd]);
    put(r, "sinks", vec![h]);
    let vb = VarBuilder::from_tensors(weights, dt, &Device::Cpu);
    let b = r.pick(&[0usize, 1, 2]);
    let steps: Vec<usize> = (0..r.pick(&[1usize, 2, 3]))
        .map(|_| r.pick(&[0usize, 1, 3, 9]))
        .collect();
    let width = if r.below(15) == 0 { hidden + 1 } else { hidden };
    let in_dt = if r.below(15) == 0 {
        r.pick(&[DType::F32, DType::U8])
    } else {
        dt
    };
    // 0: no cache; 1: the layer's own; 2, 3: a growable or rotating cache of the caller's.
    let cache_kind = r.below(4);
    let cache_window = r.pick(&[0usize, 1, 4]);
    let cached = cache_kind != 0;
    let masked = r.below(3) == 0;
    let far = r.below(10) == 0;
    let enc_len = r.pick(&[0usize, 1, 7]);
    let desc = format!(
        "{cfg:?} {dt:?} input {in_dt:?} width {width} batch {b} steps {steps:?} cache {cache_kind} (window {cache_window}) masked {masked} far positions {far} encoder length {enc_len}"
    );
    let mut r2 = Rng::new(r.next());
    // The same layer on the reference path, with a cache of its own, must agree at every
    // step: except where NaN scores are expected (a NaN scale, or a q/k norm with a
    // negative epsilon), which the two paths treat differently (see the README).
    let compare = !cfg.scale.is_nan() && cfg.qk_norm.is_none_or(|n| n.eps >= 0.0);
    run(desc, counts, move || {
        let layer = DecoderAttention::new(&cfg, vb.clone())?;
        let reference = DecoderAttention::new(&cfg, vb)?.with_backend(Backend::Reference);
        let new_cache = |layer: &DecoderAttention| -> Result<Option<KvCache>> {
            Ok(match cache_kind {
                0 => None,
                1 => Some(layer.new_cache()?),
                2 => Some(KvCache::new()),
                _ => Some(KvCache::rotating(cache_window)?),
            })
        };
        let mut cache = new_cache(&layer)?;
        let mut ref_cache = new_cache(&reference)?;
        let mut seen = 0usize;
        for &l in &steps {
            let x = tensor(&[b, l, width], in_dt);
            let out = if cfg.cross_attention {
                // Without the encoder's states one time in four: a cache that holds them
                // serves, an empty one is an error.
                let enc = (r2.below(4) != 0).then(|| tensor(&[b, enc_len, width], in_dt));
                let out = layer.forward_cross(&x, enc.as_ref(), cache.as_mut())?;
                if compare {
                    let want = reference.forward_cross(&x, enc.as_ref(), ref_cache.as_mut())?;
                    assert_agrees(&out, &want)?;
                }
                out
            } else {
                let base = if far { u32::MAX as usize - 2 } else { seen };
                let pos: Vec<u32> = (0..b * l).map(|i| (base + i % l.max(1)) as u32).collect();
                let pos = Tensor::from_vec(pos, (b, l), &Device::Cpu)?;
                let t = if cached { seen + l } else { l };
                let mask = masked.then(|| tensor(&[b, t], DType::U8));
                let out = layer.forward_cached(&x, &pos, mask.as_ref(), cache.as_mut())?;
                if compare {
                    let want = reference.forward_cached(&x, &pos, mask.as_ref(), ref_cache.as_mut())?;
                    assert_agrees(&out, &want)?;
                }
                out
            };
            out.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            seen += l;
        }
        Ok(())
    })
}

/// One operation's draws: key and value shapes and dtypes, and a truncation length.
type Draw = (Vec<usize>, Vec<usize>, DType, DType, usize);

/// One random `KvCache` (growable, bounded or rotating) and a random run of appends (of
/// keys and values that sometimes disagree in rank, shape or dtype), truncations, resets
/// and reads, each read attended to by a one-token query.
fn cache_calls(r: &mut Rng, counts: &mut (usize, usize)) -> Option<String> {
    let kind = r.below(3);
    let size = r.pick(&[0usize, 1, 3, 8]);
    let ops: Vec<u64> = (0..r.pick(&[1usize, 3, 6])).map(|_| r.below(10)).collect();
    let draws: Vec<Draw> = ops
        .iter()
        .map(|_| {
            let (b, h, l, d) = (
                r.pick(&[1usize, 2]),
                r.pick(&[1usize, 2]),
                r.pick(&[0usize, 1, 4, 9]),
                r.pick(&[4usize, 8]),
            );
            let dv = if r.below(6) == 0 { d + 4 } else { d };
            let kd = perturb(r, &[b, h, l, d]);
            let vd = if r.below(8) == 0 {
                perturb(r, &[b, h, l])
            } else {
                perturb(r, &[b, h, l, dv])
            };
            let dt = r.pick(&[DType::F32, DType::F32, DType::F16, DType::BF16]);
            let dtv = if r.below(12) == 0 { DType::F32 } else { dt };
            (kd, vd, dt, dtv, r.pick(&[0usize, 1, 2, 5, 100]))
        })
        .collect();
    let desc = format!("cache kind {kind} size {size} ops {ops:?} draws {draws:?}");
    run(desc, counts, || {
        let mut cache = match kind {
            0 => KvCache::new(),
            1 => KvCache::with_max_len(size),
            _ => KvCache::rotating(size)?,
        };
        let attend = |view: &candle_attention::KvView| -> Result<()> {
            let (b, h, _, d) = view.k.dims4()?;
            let q = tensor(&[b, h, 1, d], view.k.dtype());
            let opts = SdpaOptions::new().with_mask(AttnMask::causal_bottom_right());
            sdpa(&q, &view.k, &view.v, &opts)?
                .flatten_all()?
                .to_dtype(DType::F32)?
                .to_vec1::<f32>()?;
            Ok(())
        };
        for (op, (kd, vd, dt, dtv, n)) in ops.iter().zip(&draws) {
            match op {
                0 => cache.reset(),
                1 => cache.truncate(*n)?,
                2 => {
                    if let Some(view) = cache.current()? {
                        attend(&view)?;
                    }
                }
                _ => {
                    let view = cache.append(&tensor(kd, *dt), &tensor(vd, *dtv))?;
                    attend(&view)?;
                }
            }
        }
        Ok(())
    })
}

/// One random call of a building block: a `Proj` on weights and inputs of random ranks
/// and sizes, a `RotaryEmbedding` (its tables for random positions, then applied to a
/// random tensor), or one of the notes' three modules on random weights and inputs.
fn block_call(r: &mut Rng, counts: &mut (usize, usize)) -> Option<String> {
    let dt = r.pick(&[DType::F32, DType::F32, DType::F16, DType::BF16, DType::F64]);
    let other = if r.below(10) == 0 {
        r.pick(&[DType::F32, DType::U8, DType::I64])
    } else {
        dt
    };
    match r.below(3) {
        0 => {
            let (o, i) = (r.pick(&[0usize, 1, 3, 16]), r.pick(&[0usize, 1, 5, 16]));
            let w = perturb(r, &[o, i]);
            let w = if r.below(10) == 0 { vec![o] } else { w };
            let b = (r.below(2) == 0).then(|| perturb(r, &[o]));
            let (n, l) = (r.pick(&[0usize, 1, 2]), r.pick(&[0usize, 1, 15]));
            let x = perturb(r, &[n, l, i]);
            let x = if r.below(8) == 0 { x[1..].to_vec() } else { x };
            let desc = format!("proj w {w:?} b {b:?} x {x:?} {dt:?}/{other:?}");
            let (w, b, x) = (
                tensor(&w, dt),
                b.map(|b| tensor(&b, dt)),
                maybe_strided(r, &x, other),
            );
            run(desc, counts, || {
                candle_attention::Proj::new(w, b)
                    .forward(&x)?
                    .flatten_all()?
                    .to_dtype(DType::F32)?
                    .to_vec1::<f32>()?;
                Ok(())
            })
        }
        1 => {
            let hd = r.pick(&[0usize, 2, 8, 16]);
            let cfg = RopeConfig {
                head_dim: hd,
                rotary_dim: r.pick(&[0usize, 2, hd, hd / 2, hd + 2]),
                theta: r.pick(&[10000.0, 1.0, 0.5, f64::INFINITY, 1e300]),
                style: r.pick(&[RopeStyle::HalfSplit, RopeStyle::Interleaved]),
                scaling: match r.below(3) {
                    0 => RopeScaling::Default,
                    1 => RopeScaling::Linear {
                        factor: r.pick(&[2.0, 0.0, -1.0, f64::NAN]),
                    },
                    _ => RopeScaling::DynamicNtk {
                        factor: r.pick(&[2.0, 0.5, 0.0, f64::INFINITY]),
                        max_position_embeddings: r.pick(&[0.0, 4.0, 1e30]),
                    },
                },
            };
            let (b, l) = (r.pick(&[0usize, 1, 2]), r.pick(&[0usize, 1, 7]));
            let pos_shape = perturb(r, &[b, l]);
            let pos_dt = r.pick(&[DType::U32, DType::I64, DType::F32]);
            let far = r.below(6) == 0;
            let heads = r.pick(&[1usize, 2]);
            let x = perturb(r, &[b, heads, l, hd]);
            let desc = format!("rope {cfg:?} positions {pos_shape:?} {pos_dt:?} far {far} x {x:?} {dt:?}");
            let n: usize = pos_shape.iter().product();
            let pos: Vec<i64> = (0..n)
                .map(|i| if far { i64::MAX - i as i64 } else { i as i64 })
                .collect();
            let x = tensor(&x, dt);
            run(desc, counts, || {
                let rope = candle_attention::RotaryEmbedding::new(&cfg)?;
                let pos = Tensor::from_vec(pos, pos_shape.as_slice(), &Device::Cpu)?.to_dtype(pos_dt)?;
                let (cos, sin) = rope.cos_sin(&pos, dt)?;
                rope.apply(&x, &cos, &sin)?
                    .flatten_all()?
                    .to_dtype(DType::F32)?
                    .to_vec1::<f32>()?;
                Ok(())
            })
        }
        _ => {
            let (d, h) = (r.pick(&[0usize, 4, 8, 12]), r.pick(&[0usize, 1, 2, 3]));
            let mut cfg = candle_attention::AttentionConfig::new(d, h);
            cfg.out_proj = r.below(2) == 0;
            let kind = r.below(3);
            let mut weights: HashMap<String, Tensor> = HashMap::new();
            for name in ["wq", "wk", "wv", "wo"] {
                put_weight(r, &mut weights, &format!("{name}.weight"), &[d, d], dt);
                put_weight(r, &mut weights, &format!("{name}.bias"), &[d], dt);
            }
            let vb = VarBuilder::from_tensors(weights, dt, &Device::Cpu);
            let (b, l, s) = (
                r.pick(&[0usize, 1, 2]),
                r.pick(&[0usize, 1, 6]),
                r.pick(&[0usize, 1, 6]),
            );
            let (qd, kd) = (perturb(r, &[b, l, d]), perturb(r, &[b, s, d]));
            let mask = (r.below(3) == 0).then(|| perturb(r, &[b, 1, l, s]));
            let desc =
                format!("notes module {kind} {cfg:?} q {qd:?} k/v {kd:?} mask {mask:?} {dt:?}/{other:?}");
            let (q, k) = (tensor(&qd, other), tensor(&kd, other));
            let mask = mask.map(|m| tensor(&m, DType::U8));
            run(desc, counts, || {
                let mask = mask.as_ref().map(AttnMask::keep).transpose()?;
                let out = match kind {
                    0 => candle_attention::ScaledDotProductAttention::new(d).forward_masked(
                        &q,
                        &k,
                        &k,
                        mask.as_ref(),
                    )?,
                    1 => candle_attention::MultiHeadAttention::new(&cfg, vb)?.forward_masked(
                        &q,
                        &k,
                        &k,
                        mask.as_ref(),
                    )?,
                    _ => candle_attention::CausalAttention::new(&cfg, vb)?.forward_masked(
                        &q,
                        &k,
                        &k,
                        mask.as_ref(),
                    )?,
                };
                out.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
                Ok(())
            })
        }
    }
}

/// A random JSON value for a config key of kind `kind` (0: a size or count, 1: a float,
/// 2: a flag): mostly of the key's type (0 and huge sizes, floats of every sign
/// included), one time in eight of another type or `null`.
fn json_value(r: &mut Rng, kind: u8) -> serde_json::Value {
    use serde_json::Value;
    if r.below(8) == 0 {
        return r.pick(&[
            Value::Null,
            Value::from("8"),
            Value::from(-1),
            Value::from(0.5),
            Value::from(1),
        ]);
    }
    match kind {
        0 => Value::from(r.pick(&[
            0u64,
            1,
            2,
            3,
            4,
            8,
            16,
            32,
            64,
            128,
            1 << 40,
            u32::MAX as u64,
            u64::MAX,
        ])),
        1 => Value::from(r.pick(&[0.0f64, 0.5, 1.0, 2.0, 10000.0, 1e-6, -2.0, 1e308, -1e308])),
        _ => Value::from(r.below(2) == 0),
    }
}

/// One random `config.json` (a random subset of the keys `HfConfig` reads, with
/// random values, and a random `rope_scaling`), read by `HfConfig::from_json` and turned
/// into a layer's configuration by `DecoderAttentionConfig::from_hf` for a random
/// architecture and layer; when that succeeds with small sizes, the layer is built on
/// random weights and run for two tokens.
fn hf_config_call(r: &mut Rng, counts: &mut (usize, usize)) -> Option<String> {
    use candle_attention::decoder::{HfConfig, ARCHITECTURES};
    use serde_json::{Map, Value};
    const SIZES: [&str; 14] = [
        "hidden_size",
        "n_embd",
        "d_model",
        "num_attention_heads",
        "n_head",
        "decoder_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_window_layers",
        "sliding_window_pattern",
        "max_position_embeddings",
        "n_positions",
        "original_max_position_embeddings",
        "sliding_window",
    ];
    const FLOATS: [&str; 9] = [
        "partial_rotary_factor",
        "rotary_pct",
        "rope_theta",
        "rotary_emb_base",
        "rope_local_base_freq",
        "rms_norm_eps",
        "attn_logit_softcapping",
        "query_pre_attn_scalar",
        "attention_multiplier",
    ];
    const FLAGS: [&str; 8] = [
        "use_sliding_window",
        "attention_bias",
        "scale_attn_weights",
        "scale_attn_by_inverse_layer_idx",
        "rotary_emb_interleaved",
        "qkv_bias",
        "use_bias",
        "use_bidirectional_attention",
    ];
    let mut cfg = Map::new();
    // Mostly a small, consistent model that the other keys then perturb.
    let heads = r.pick(&[1u64, 2, 4]);
    cfg.insert("hidden_size".into(), Value::from(8 * heads));
    cfg.insert("num_attention_heads".into(), Value::from(heads));
    cfg.insert("num_key_value_heads".into(), Value::from(r.pick(&[1u64, heads])));
    for key in SIZES.iter().chain(&FLOATS).chain(&FLAGS) {
        if r.below(10) == 0 {
            let kind = if FLAGS.contains(key) {
                2
            } else {
                u8::from(FLOATS.contains(key))
            };
            let v = json_value(r, kind);
            cfg.insert((*key).into(), v);
        }
    }
    if r.below(4) == 0 {
        let types = [
            "default", "linear", "dynamic", "llama3", "yarn", "longrope", "su", "ntk",
        ];
        let mut rs = Map::new();
        rs.insert(r.pick(&["rope_type", "type"]).into(), Value::from(r.pick(&types)));
        let fields = [
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "attention_factor",
            "mscale",
            "mscale_all_dim",
            "truncate",
        ];
        for f in fields {
            if r.below(2) == 0 {
                let kind = u8::from(!f.starts_with("original") && f != "truncate");
                rs.insert(f.into(), json_value(r, if f == "truncate" { 2 } else { kind }));
            }
        }
        if r.below(3) == 0 {
            let n = r.pick(&[0usize, 1, 2, 4, 8]);
            for f in ["short_factor", "long_factor"] {
                rs.insert(f.into(), Value::from(vec![r.pick(&[1.0f64, 0.0, -1.0]); n]));
            }
        }
        cfg.insert(
            r.pick(&["rope_scaling", "rope_parameters"]).into(),
            Value::Object(rs),
        );
    }
    if r.below(8) == 0 {
        let n = r.pick(&[0usize, 1, 3]);
        let kinds = ["full_attention", "sliding_attention", "linear_attention"];
        let lt: Vec<Value> = (0..n).map(|_| Value::from(r.pick(&kinds))).collect();
        cfg.insert("layer_types".into(), Value::from(lt));
    }
    let text = Value::Object(cfg).to_string();
    let arch = if r.below(20) == 0 {
        "bert"
    } else {
        r.pick(ARCHITECTURES)
    };
    let layer = r.pick(&[0usize, 1, 5, usize::MAX]);
    let cross = r.below(10) == 0;
    let build = r.below(2) == 0;
    let desc = format!("{arch} layer {layer} cross {cross} build {build}: {text}");
    let mut rr = Rng::new(r.next());
    run(desc, counts, move || {
        let hf = HfConfig::from_json(&text)?;
        let dc = DecoderAttentionConfig::from_hf(arch, &hf, layer, cross)?;
        if let Some(rope) = &dc.rope {
            candle_attention::RotaryEmbedding::new(rope)?;
        }
        let widths = [
            dc.hidden_size,
            dc.num_heads.saturating_mul(dc.head_dim),
            dc.num_kv_heads.saturating_mul(dc.head_dim),
        ];
        if !build || widths.iter().any(|&w| w > 256) {
            return Ok(());
        }
        // Random weights under the layout's names, one larger in every dim now and then,
        // from the names `DecoderAttention::new` asks for.
        let mut weights: HashMap<String, Tensor> = HashMap::new();
        for _ in 0..30 {
            let vb = VarBuilder::from_tensors(weights.clone(), DType::F32, &Device::Cpu);
            match DecoderAttention::new(&dc, vb) {
                Ok(layer) => {
                    let x = tensor(&[1, 2, dc.hidden_size], DType::F32);
                    let pos = Tensor::new(&[[0u32, 1]], &Device::Cpu)?;
                    if dc.cross_attention {
                        layer.forward_cross(&x, Some(&x), None)?;
                    } else {
                        layer.forward_cached(&x, &pos, None, None)?;
                    }
                    return Ok(());
                }
                Err(e) => {
                    // "cannot find tensor NAME" or "shape mismatch for NAME, expected: [..]".
                    // (The first line: candle appends a backtrace when one is asked for.)
                    let msg = e.to_string().lines().next().unwrap_or_default().to_string();
                    let missing = msg
                        .strip_prefix("cannot find tensor ")
                        .map(|n| (n.to_string(), None));
                    let misshapen = msg.strip_prefix("shape mismatch for ").and_then(|m| {
                        let (name, rest) = m.split_once(", expected: ")?;
                        let dims = rest.split(", got").next()?.trim_matches(|c| c == '[' || c == ']');
                        let dims: Vec<usize> = dims.split(", ").filter_map(|d| d.parse().ok()).collect();
                        Some((name.to_string(), Some(dims)))
                    });
                    match missing.or(misshapen) {
                        Some((name, dims)) if !weights.contains_key(&name) || dims.is_some() => {
                            let dims = dims.unwrap_or_else(|| vec![dc.hidden_size.max(1)]);
                            put_weight(&mut rr, &mut weights, &name, &dims, DType::F32);
                            weights.entry(name).or_insert_with(|| tensor(&dims, DType::F32));
                        }
                        _ => return Err(e),
                    }
                }
            }
        }
        Ok(())
    })
}

/// One bundled PyTorch fixture, damaged one to three times (a `config` or `call` entry
/// removed or given a random value, `kind`, `dtype` or `format` replaced, a tensor
/// dropped, reshaped or cast), written back to bytes and run by the fixture runner in a
/// random dtype and backend.
fn fixture_call(r: &mut Rng, counts: &mut (usize, usize)) -> Option<String> {
    use candle_attention::fixture::{fixture_paths, Fixture, RunOptions};
    use serde_json::Value;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("weights");
    let mut paths = fixture_paths(&[dir]).expect("the bundled fixtures are listed");
    paths.sort();
    let path = r.pick(&paths);
    let fx = Fixture::load(&path, &Device::Cpu).expect("a bundled fixture loads");
    let mut meta = fx.metadata.clone();
    let mut tensors: Vec<(String, Tensor)> = {
        let mut names = fx.tensor_names();
        names.sort();
        names
            .iter()
            .map(|n| (n.to_string(), fx.tensor(n).expect("listed").clone()))
            .collect()
    };
    let mut damage = Vec::new();
    for _ in 0..r.pick(&[1usize, 1, 2, 3]) {
        match r.below(6) {
            op @ (0 | 1) => {
                let entry = if op == 0 { "config" } else { "call" };
                let mut obj: serde_json::Map<String, Value> =
                    serde_json::from_str(meta.get(entry).map_or("{}", |s| s.as_str())).unwrap_or_default();
                let mut keys: Vec<String> = obj.keys().cloned().collect();
                keys.sort();
                if keys.is_empty() {
                    continue;
                }
                let key = r.pick(&keys);
                if r.below(3) == 0 {
                    obj.remove(&key);
                    damage.push(format!("{entry}.{key} removed"));
                } else {
                    let kind = r.below(3) as u8;
                    let v = json_value(r, kind);
                    damage.push(format!("{entry}.{key} = {v}"));
                    obj.insert(key, v);
                }
                meta.insert(entry.to_string(), Value::Object(obj).to_string());
            }
            2 => {
                let (key, values) = r.pick(&[
                    (
                        "kind",
                        &[
                            "sdpa",
                            "multihead_attention",
                            "hf_attention",
                            "notes_causal",
                            "bogus",
                        ][..],
                    ),
                    (
                        "dtype",
                        &["float32", "bfloat16", "float16", "float64", "int8", ""][..],
                    ),
                    ("format", &["candle-attention-fixture/0", ""][..]),
                ]);
                let v = r.pick(values);
                damage.push(format!("{key} = {v:?}"));
                meta.insert(key.to_string(), v.to_string());
            }
            op => {
                if tensors.is_empty() {
                    continue;
                }
                let at = r.below(tensors.len() as u64) as usize;
                let (name, t) = tensors[at].clone();
                match op {
                    3 => {
                        tensors.remove(at);
                        damage.push(format!("{name} dropped"));
                    }
                    4 => {
                        let mut dims = t.dims().to_vec();
                        if dims.is_empty() || r.below(4) == 0 {
                            dims.push(1);
                        } else {
                            let d = r.below(dims.len() as u64) as usize;
                            dims[d] = if r.below(2) == 0 {
                                dims[d] + 1
                            } else {
                                dims[d].saturating_sub(1)
                            };
                        }
                        damage.push(format!("{name} {:?} -> {dims:?}", t.dims()));
                        tensors[at].1 = tensor(&dims, t.dtype());
                    }
                    _ => {
                        let dt = r.pick(&[
                            DType::F32,
                            DType::F16,
                            DType::BF16,
                            DType::F64,
                            DType::U8,
                            DType::I64,
                        ]);
                        damage.push(format!("{name} {:?} -> {dt:?}", t.dtype()));
                        tensors[at].1 = tensor(t.dims(), dt);
                    }
                }
            }
        }
    }
    let opts = RunOptions {
        device: Device::Cpu,
        dtype: r.pick(&[
            None,
            None,
            Some(DType::F32),
            Some(DType::BF16),
            Some(DType::F16),
            Some(DType::U8),
        ]),
        backend: r.pick(&[Backend::Auto, Backend::Fused, Backend::Reference]),
    };
    let name = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let desc = format!(
        "{name} damaged: {damage:?}, run {:?} {:?}",
        opts.dtype, opts.backend
    );
    let bytes = safetensors::serialize(tensors.iter().map(|(k, v)| (k.clone(), v)), Some(meta))
        .expect("tensors of candle's dtypes serialise");
    run(desc, counts, move || {
        Fixture::from_bytes(&name, &bytes, &Device::Cpu)?.run(&opts)?;
        Ok(())
    })
}

/// Draws 150 calls from each of four seeds with `call`, and asserts that none panicked
/// and that more than 50 returned a value and more than 50 an error.
fn assert_no_panics(call: fn(&mut Rng, &mut (usize, usize)) -> Option<String>) {
    let mut counts = (0, 0);
    let mut panics = Vec::new();
    for seed in 1..=4 {
        let mut r = Rng::new(seed);
        for i in 0..150 {
            if let Some(p) = call(&mut r, &mut counts) {
                panics.push(format!("seed {seed} call {i}: {p}"));
            }
        }
    }
    assert!(
        panics.is_empty(),
        "{} panics:\n{}",
        panics.len(),
        panics.join("\n")
    );
    assert!(
        counts.0 > 50 && counts.1 > 50,
        "ran {} and refused {}",
        counts.0,
        counts.1
    );
}

/// Random `scaled_dot_product_attention` calls never panic, and both outcomes occur.
#[test]
fn random_sdpa_calls_return_instead_of_panicking() {
    assert_no_panics(sdpa_call);
}

/// Random `MultiheadAttention` layers and calls never panic, and both outcomes occur.
#[test]
fn random_multihead_attention_calls_return_instead_of_panicking() {
    assert_no_panics(mha_call);
}

/// Random `DecoderAttention` layers and calls never panic, and both outcomes occur.
#[test]
fn random_decoder_attention_calls_return_instead_of_panicking() {
    assert_no_panics(decoder_call);
}

/// Random `KvCache` appends, truncations, resets and reads never panic, and both
/// outcomes occur.
#[test]
fn random_kv_cache_calls_return_instead_of_panicking() {
    assert_no_panics(cache_calls);
}

/// Random calls of `Proj`, `RotaryEmbedding` and the notes' modules never panic, and both
/// outcomes occur.
#[test]
fn random_building_block_calls_return_instead_of_panicking() {
    assert_no_panics(block_call);
}

/// Random `config.json` files, read and turned into layers (built and run where small),
/// never panic, and both outcomes occur.
#[test]
fn random_hf_configs_return_instead_of_panicking() {
    assert_no_panics(hf_config_call);
}

/// Damaged PyTorch fixtures, read and run by the fixture runner, never panic, and both
/// outcomes occur.
#[test]
fn damaged_fixtures_return_instead_of_panicking() {
    assert_no_panics(fixture_call);
}
