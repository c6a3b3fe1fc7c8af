//! Sizes and numbers at the limits of `usize`, of the allocator and of f32: each gives
//! an error or the right answer, never a panic, an abort or a wrapped-around result.
//! (The test suite runs in debug mode, where integer overflow panics.) Most need a
//! zero-sized dimension beside a huge one, which empty tensors allow.
mod common;

use candle_attention::alibi::alibi_slopes;
use candle_attention::decoder::{DecoderAttention, DecoderAttentionConfig, HfConfig};
use candle_attention::kernels::cpu as kcpu;
use candle_attention::{
    scaled_dot_product_attention, AttnMask, Backend, KvCache, MhaArgs, MultiheadAttention,
    MultiheadAttentionConfig, RopeConfig, RopeScaling, RopeStyle, RotaryEmbedding, SdpaOptions,
};
use candle_core::{DType, Device, Result, Tensor};
use candle_nn::VarBuilder;
use common::{err_msg, max_diff, plain_decoder, plain_decoder_weights, randn};

fn zeros(shape: &[usize]) -> Result<Tensor> {
    Tensor::zeros(shape, DType::F32, &Device::Cpu)
}

/// The last layers of `usize`: the alternating and every-n-th layer patterns and GPT-2's
/// `1 / (layer_idx + 1)` are computed without `layer_idx + 1` (it overflowed).
#[test]
fn layer_indices_at_usize_max_follow_the_layer_patterns() -> Result<()> {
    let hf = HfConfig::from_json(
        r#"{"hidden_size": 64, "num_attention_heads": 4, "query_pre_attn_scalar": 16,
            "sliding_window": 8, "n_embd": 64, "n_head": 4, "scale_attn_by_inverse_layer_idx": true}"#,
    )?;
    for i in [usize::MAX - 1, usize::MAX] {
        // Layer i is full when (i + 1) is a multiple of the pattern (2, or Gemma 3's 6).
        let full = |pattern: u128| (i as u128 + 1).is_multiple_of(pattern);
        for (arch, pattern) in [("gemma2", 2), ("gpt_oss", 2), ("gemma3_text", 6)] {
            let cfg = DecoderAttentionConfig::from_hf(arch, &hf, i, false)?;
            assert_eq!(cfg.sliding_window.is_none(), full(pattern), "{arch} layer {i}");
        }
        let gpt2 = DecoderAttentionConfig::from_hf("gpt2", &hf, i, false)?;
        let want = 1.0 / 16f64.sqrt() / (i as f64 + 1.0);
        assert!(
            gpt2.scale > 0.0 && (gpt2.scale - want).abs() <= 1e-12 * want,
            "{}",
            gpt2.scale
        );
    }
    Ok(())
}

/// A window far beyond any position, with a caller's rotating cache that keeps only the
/// last keys (so the layer masks by position): every held key is in the window. The
/// window test `kp + w > qp` overflowed (a panic in debug, and in release every key hidden,
/// so the step returned zeros from its third token on).
#[test]
fn a_huge_window_over_a_rotating_cache_sees_every_held_key() -> Result<()> {
    let cfg = |w: usize| DecoderAttentionConfig {
        sliding_window: Some(w),
        scale: 1.0,
        ..plain_decoder(8)
    };
    let weights = plain_decoder_weights(8)?;
    let huge = DecoderAttention::new(&cfg(usize::MAX), weights.clone())?;
    let wide = DecoderAttention::new(&cfg(1000), weights)?;
    let (mut c_huge, mut c_wide) = (KvCache::rotating(2)?, KvCache::rotating(2)?);
    for p in 0..5i64 {
        let x = randn(&[1, 1, 8])?;
        let pos = Tensor::new(&[[p]], &Device::Cpu)?;
        let a = huge.forward_cached(&x, &pos, None, Some(&mut c_huge))?;
        let b = wide.forward_cached(&x, &pos, None, Some(&mut c_wide))?;
        assert!(max_diff(&a, &b)? < 1e-6, "step {p}: {}", max_diff(&a, &b)?);
        let norm = a.sqr()?.sum_all()?.to_scalar::<f32>()?;
        assert!(norm > 0.0, "step {p}: zeros");
    }
    Ok(())
}

/// Bottom-right offsets of lengths beyond `isize::MAX` (empty tensors) are clamped, not
/// wrapped (`S − L` overflowed).
#[test]
fn bottom_right_offsets_of_huge_lengths_do_not_overflow() -> Result<()> {
    let offset = |l: usize, s: usize| {
        AttnMask::causal_bottom_right()
            .causal_rule(l, s)
            .map(|r| r.offset)
    };
    assert_eq!(offset(usize::MAX, isize::MAX as usize), Some(isize::MIN));
    assert_eq!(offset(usize::MAX, 1), Some(isize::MIN));
    assert_eq!(offset(0, usize::MAX), Some(isize::MAX));
    assert_eq!(offset(3, 10), Some(7));
    Ok(())
}

/// With E = 0, the scores `(L, S)` and the output `(L, Ev)` may have more elements than
/// `usize` counts although every input is empty: an error on every path, where the
/// products of the shape overflowed.
#[test]
fn shapes_beyond_usize_are_errors() -> Result<()> {
    let big = 1usize << 33;
    let q = zeros(&[big, 0])?;
    for backend in [Backend::Auto, Backend::Reference] {
        let opts = SdpaOptions::new().with_causal(true).with_backend(backend);
        let msg = err_msg(scaled_dot_product_attention(&q, &q, &q, &opts));
        assert!(
            msg.contains("sdpa: the scores shape [8589934592, 8589934592] has more elements"),
            "{msg}"
        );
    }
    let (q, k, v) = (
        zeros(&[1, 1, big, 0])?,
        zeros(&[1, 1, 0, 0])?,
        zeros(&[1, 1, 0, big])?,
    );
    let msg = err_msg(scaled_dot_product_attention(&q, &k, &v, &SdpaOptions::new()));
    assert!(
        msg.contains("sdpa: the output shape [1, 1, 8589934592, 8589934592] has more elements"),
        "{msg}"
    );
    let msg = err_msg(kcpu::sdpa(&q, &k, &v, None, None, 1.0));
    assert!(
        msg.contains("the output (B, Hq, L, Ev) = (1, 1, 8589934592, 8589934592) has more elements"),
        "{msg}"
    );
    let msg = err_msg(AttnMask::causal().causal_additive(&[big, big], DType::F32, &Device::Cpu));
    assert!(
        msg.contains("causal mask of 8589934592 x 8589934592 has more elements"),
        "{msg}"
    );
    // MultiheadAttention's (N·H, L, S) mask check multiplied N by H.
    let cfg = MultiheadAttentionConfig {
        batch_first: true,
        ..MultiheadAttentionConfig::new(8, 4)
    };
    let mha = MultiheadAttention::new(&cfg, VarBuilder::zeros(DType::F32, &Device::Cpu))?;
    let x = zeros(&[1 << 62, 0, 8])?;
    let am = Tensor::zeros((4, 0, 0), DType::U8, &Device::Cpu)?;
    let args = MhaArgs {
        attn_mask: Some(&am),
        ..MhaArgs::default()
    };
    let msg = err_msg(mha.forward_with(&x, &x, &x, &args));
    assert!(
        msg.contains("attn_mask must have shape (0, 0) or (4611686018427387904·4, 0, 0)"),
        "{msg}"
    );
    Ok(())
}

/// Buffers the allocator cannot give (beyond the 2^47-byte address space of x86-64 and
/// aarch64 user space, so no overcommit setting grants them) are errors, not aborts.
#[test]
fn allocations_too_large_for_memory_are_errors() -> Result<()> {
    // A fixed-size cache of 2^46 tokens of 16 bytes: 1 PiB.
    let mut cache = KvCache::with_max_len(1 << 46);
    let kv = zeros(&[1, 1, 1, 4])?;
    let msg = err_msg(cache.append(&kv, &kv));
    assert!(
        msg.contains("cannot allocate 281474976710656 zeroed elements of 4 bytes"),
        "{msg}"
    );
    // A rotating window of almost 2^32 tokens of 256 KiB.
    let mut cache = KvCache::rotating(u32::MAX as usize - 2)?;
    let kv = zeros(&[1, 1, 1, 1 << 16])?;
    let msg = err_msg(cache.append(&kv, &kv));
    assert!(msg.contains("cannot allocate"), "{msg}");
    // An empty batch carries any length: its positions cannot be allocated, and the
    // cache is left as it was.
    let mut cache = KvCache::new();
    let kv = zeros(&[0, 1, 1 << 61, 1])?;
    let msg = err_msg(cache.append(&kv, &kv));
    assert!(
        msg.contains("KV cache: cannot allocate the positions of 2305843009213693952 tokens"),
        "{msg}"
    );
    assert_eq!(cache.len(), 0);
    // A rope of 2^62 frequencies.
    let d = 1usize << 63;
    let rope = RotaryEmbedding::new(&RopeConfig {
        head_dim: d,
        rotary_dim: d,
        theta: 10000.0,
        style: RopeStyle::HalfSplit,
        scaling: RopeScaling::Default,
    });
    let msg = err_msg(rope);
    assert!(
        msg.contains("rope: cannot allocate the 4611686018427387904 frequencies"),
        "{msg}"
    );
    // ALiBi slopes for 2^61 heads (16 EiB).
    let msg = err_msg(alibi_slopes(1 << 61));
    assert!(
        msg.contains("alibi: cannot allocate the slopes of 2305843009213693952 heads"),
        "{msg}"
    );
    Ok(())
}

/// A soft-cap beyond f32's range cannot cap f32 scores: an error on both paths, where
/// the fused path refused it and the reference path capped with an infinite cap.
#[test]
fn a_softcap_beyond_f32_is_an_error_in_f32_only() -> Result<()> {
    let q = randn(&[1, 1, 2, 4])?;
    let opts = SdpaOptions::new().with_softcap(1e39);
    for backend in [Backend::Auto, Backend::Reference] {
        let msg = err_msg(scaled_dot_product_attention(
            &q,
            &q,
            &q,
            &opts.clone().with_backend(backend),
        ));
        assert!(
            msg.contains("sdpa: softcap 1e39 is not a positive finite f32"),
            "{backend:?}: {msg}"
        );
    }
    // In f64 such a cap is a number like any other, and leaves the scores as they are.
    let q = q.to_dtype(DType::F64)?;
    let capped = scaled_dot_product_attention(&q, &q, &q, &opts)?.output;
    let plain = scaled_dot_product_attention(&q, &q, &q, &SdpaOptions::new())?.output;
    assert!(max_diff(&capped, &plain)? < 1e-12);
    Ok(())
}

/// Scores of 1e10 and more in the log2 domain (scales of 1e10 and 1e30 on small
/// integer q and k, whose dot products every path computes exactly): the fused kernel
/// gives the reference path's one-hot softmax in bf16, f16 and f32, with nothing NaN.
/// The dot products take both signs, so a row's first key blocks can hold a negative
/// maximum that a later block overtakes by more than the maximum itself. On AVX512-BF16
/// and AMX, bf16 rows use the pairs products, whose softmax took the rounded score's own
/// rounding error as a distance (up to `2^4096`) and redid a row against a rounded
/// reference; both gave NaN or wrong outputs here (`avx512::softmax`). The decode groups
/// of 8 and 16 rows take the pairs decode products there (a sign or operand-order fault
/// in either fails here).
#[test]
fn huge_scores_give_the_reference_one_hot_softmax() -> Result<()> {
    let dev = Device::Cpu;
    // Small integers from a fixed formula: exact in bf16 and f16, exact dot products.
    let ints = |n: usize, salt: usize| -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7 + salt * 13 + i / 5) % 7) as f32 - 3.0)
            .collect()
    };
    // (query heads per KV head, L, S, E): prefill, then decode groups of 8 and 16 rows,
    // which take the pairs decode products where bf16 prefill runs on AVX512-BF16
    // without AMX (`avx512::qk_dot_pairs`, `avx512::pv_rows_pairs`).
    for (h, l, s, d) in [
        (2usize, 33usize, 7usize, 48usize),
        (2, 144, 100, 64),
        (2, 200, 300, 128),
        (8, 1, 100, 64),
        (8, 2, 300, 128),
        (4, 2, 70, 256),
    ] {
        let q = Tensor::from_vec(ints(h * l * d, 1), (1, h, l, d), &dev)?;
        let k = Tensor::from_vec(ints(s * d, 2), (1, 1, s, d), &dev)?;
        let v = Tensor::from_vec(ints(s * d, 3), (1, 1, s, d), &dev)?;
        for dt in [DType::BF16, DType::F16, DType::F32] {
            let (q, k, v) = (q.to_dtype(dt)?, k.to_dtype(dt)?, v.to_dtype(dt)?);
            for scale in [1e10, 1e30] {
                let run = |backend| {
                    let opts = SdpaOptions::new()
                        .with_scale(scale)
                        .with_gqa(true)
                        .with_backend(backend);
                    scaled_dot_product_attention(&q, &k, &v, &opts)?
                        .output
                        .to_dtype(DType::F32)
                };
                let (fused, reference) = (run(Backend::Fused)?, run(Backend::Reference)?);
                let what = format!("{dt:?} h {h} l {l} s {s} d {d} scale {scale:e}");
                let nan = fused
                    .flatten_all()?
                    .to_vec1::<f32>()?
                    .iter()
                    .filter(|x| !x.is_finite())
                    .count();
                assert_eq!(nan, 0, "{what}: {nan} outputs not finite");
                // The fixtures' tolerance of the dtype, relative to max(1, max|reference|).
                let top = reference
                    .abs()?
                    .flatten_all()?
                    .max(0)?
                    .to_scalar::<f32>()?
                    .max(1.0);
                let diff = max_diff(&fused, &reference)?;
                assert!(
                    diff <= candle_attention::fixture::tolerance(dt) * top as f64,
                    "{what}: fused and reference differ by {diff}"
                );
            }
        }
    }
    Ok(())
}

/// A NaN key hides only itself, on every instruction set and in every dtype: with one
/// key of NaNs and one key whose scores run 130 or 577 ahead of the others (in the log2
/// domain the kernels work in), each row that sees the large key is that key's
/// value row, as the reference path gives it with the NaN key masked out. The two keys
/// share a lane of one block (8, 16 or 32 keys apart, in both orders), sit in the
/// first block or a later one, or in one 16-key chunk; the shapes take the whole-block
/// softmax in registers, a block's tail, the causal edge blocks and decode, with the
/// first 16 keys as they are, hidden by a mask, or NaN as well. The lane-wise maxima of
/// the AVX-512 and AVX2 f32 softmax, and of the bf16 softmax when a row's first 16 keys
/// hold no finite score, let a NaN in one vector of a row replace the lane's score in
/// another, so the large key went through the exponential unseen: on AVX-512 it
/// overflowed and made the row NaN, on AVX2 its exponent wrapped and the row came out
/// as some other mix of values (`avx512::softmax_regs`, `avx512::softmax_row_impl`,
/// `avx2::online_rows_block`, `avx2::qk_max`).
#[test]
fn a_nan_key_hides_only_itself() -> Result<()> {
    let dev = Device::Cpu;
    let d = 16;
    let isas: Vec<kcpu::Isa> = [
        kcpu::Isa::Portable,
        kcpu::Isa::Neon,
        kcpu::Isa::Avx2Fma,
        kcpu::Isa::Avx512,
    ]
    .into_iter()
    .filter(|i| i.is_supported())
    .collect();
    // (L, S, top-left causal)
    let shapes = [
        (64, 256, false),
        (100, 200, false),
        (256, 256, true),
        (1, 256, false),
        (4, 256, false),
    ];
    let pairs = [
        (104, 120),
        (120, 104),
        (104, 88),
        (40, 56),
        (56, 40),
        (8, 40),
        (40, 8),
        (1, 17),
        (3, 9),
        (200, 232),
        (232, 248),
        (20, 0),
        (20, 5),
        (40, 15),
        (5, 0),
        (0, 5),
        (70, 64),
        (64, 79),
        (82, 90),
        (90, 82),
        (2, 10),
        (10, 2),
    ];
    // The large key's scores run about 130 or 577 ahead (log2), so that an exponential
    // that overflows or wraps gives it a weight of inf, NaN or about 0.
    let cases = shapes
        .into_iter()
        .flat_map(|sh| [22.6f32, 100.0].map(|big_k| (sh, big_k)));
    for ((l, s, causal), big_k) in cases {
        for (big, nan) in pairs.into_iter().filter(|&(b, n)| b < s && n < s) {
            let v = Tensor::arange(0u32, s as u32, &dev)?
                .to_dtype(DType::F32)?
                .reshape((1, 1, s, 1))?
                .broadcast_as((1, 1, s, d))?
                .contiguous()?;
            let q = Tensor::ones((1, 1, l, d), DType::F32, &dev)?;
            // The first 16 keys as they are, hidden by an additive mask, or NaN too, so
            // that a row's first chunk holds no finite score (the NaN ones are not
            // turned into a key range, as a mask of a padding shape may be).
            for head in ["as is", "masked", "NaN"] {
                let hide = if head == "as is" { 0 } else { 16 };
                if big < hide {
                    continue;
                }
                let mut kv = vec![0.01f32; s * d];
                if head == "NaN" {
                    kv[..hide * d].fill(f32::NAN);
                }
                kv[big * d..(big + 1) * d].fill(big_k);
                kv[nan * d..(nan + 1) * d].fill(f32::NAN);
                let k = Tensor::from_vec(kv.clone(), (1, 1, s, d), &dev)?;
                for x in kv.iter_mut().filter(|x| x.is_nan()) {
                    *x = 0.0;
                }
                let k_clean = Tensor::from_vec(kv, (1, 1, s, d), &dev)?;
                let keep: Vec<u8> = (0..s).map(|j| (j != nan && j >= hide) as u8).collect();
                let keep = Tensor::from_vec(keep, (1, 1, 1, s), &dev)?;
                let mut opts = SdpaOptions::new()
                    .with_mask(AttnMask::keep(&keep)?)
                    .with_backend(Backend::Reference);
                if causal {
                    opts = opts.with_causal(true);
                }
                let want = scaled_dot_product_attention(&q, &k_clean, &v, &opts)?.output;
                let mask: Vec<f32> = (0..s)
                    .map(|j| if j < hide { f32::NEG_INFINITY } else { 0.0 })
                    .collect();
                let mask = (head == "masked")
                    .then(|| Tensor::from_vec(mask, (1, 1, 1, s), &dev))
                    .transpose()?;
                let causal = causal.then_some(kcpu::Causal {
                    offset: 0,
                    window: None,
                });
                for dt in [DType::F32, DType::BF16, DType::F16] {
                    let (q, k, v) = (q.to_dtype(dt)?, k.to_dtype(dt)?, v.to_dtype(dt)?);
                    for &isa in &isas {
                        let scale = 1.0 / (d as f32).sqrt();
                        let got = kcpu::sdpa_with_isa(&q, &k, &v, mask.as_ref(), causal, scale, isa)?
                            .to_dtype(DType::F32)?;
                        let diff = max_diff(&got, &want)?;
                        // Each row is one value row, an integer below 256 (or 0 where no
                        // key is visible); bf16 rounds those above 128 to even numbers.
                        assert!(
                            diff <= 1.0,
                            "{isa:?} {dt:?} L {l} S {s} causal {causal:?} first 16 keys {head}, \
                             large key {big} ({big_k}), NaN key {nan}: off by {diff}"
                        );
                    }
                }
            }
        }
    }
    Ok(())
}
