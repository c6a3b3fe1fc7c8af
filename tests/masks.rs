//! Mask semantics: every way of writing the same mask gives the same output.
mod common;
use candle_attention::{sdpa, AttnMask, CausalAlign, SdpaOptions};
use candle_core::{DType, Device, Result, Tensor};
use common::{all_zero, err_msg, max_diff, randn};

fn qkv(b: usize, h: usize, l: usize, s: usize) -> Result<(Tensor, Tensor, Tensor)> {
    Ok((
        randn(&[b, h, l, 8])?,
        randn(&[b, h, s, 8])?,
        randn(&[b, h, s, 6])?,
    ))
}

fn run(q: &Tensor, k: &Tensor, v: &Tensor, mask: AttnMask) -> Result<Tensor> {
    sdpa(q, k, v, &SdpaOptions::new().with_mask(mask))
}

/// A random keep mask (u8, 1 = attend) with at least one visible key per row.
fn random_keep(shape: &[usize]) -> Result<Tensor> {
    let u = Tensor::rand(0f32, 1f32, shape, &Device::Cpu)?;
    let keep = u.ge(0.4f32)?;
    // Force the first key visible so no row is fully masked.
    let s = *shape.last().unwrap();
    let first = Tensor::cat(
        &[
            Tensor::ones(&shape[..shape.len() - 1], DType::U8, &Device::Cpu)?.unsqueeze(shape.len() - 1)?,
            Tensor::zeros(
                [&shape[..shape.len() - 1], &[s - 1]].concat(),
                DType::U8,
                &Device::Cpu,
            )?,
        ],
        shape.len() - 1,
    )?;
    keep.maximum(&first)
}

#[test]
fn keep_ignore_and_additive_agree() -> Result<()> {
    let (q, k, v) = qkv(2, 3, 5, 7)?;
    let keep = random_keep(&[2, 3, 5, 7])?;
    let ignore = keep.eq(0u8)?;
    let additive = keep.where_cond(
        &Tensor::zeros(keep.shape(), DType::F32, &Device::Cpu)?,
        &Tensor::full(f32::NEG_INFINITY, keep.shape(), &Device::Cpu)?,
    )?;
    let a = run(&q, &k, &v, AttnMask::keep(&keep)?)?;
    let b = run(&q, &k, &v, AttnMask::ignore(&ignore)?)?;
    let c = run(&q, &k, &v, AttnMask::additive(&additive)?)?;
    assert_eq!(max_diff(&a, &b)?, 0.0);
    assert!(max_diff(&a, &c)? < 1e-6);
    // The mask matters: without it the output differs.
    let none = sdpa(&q, &k, &v, &SdpaOptions::new())?;
    assert!(max_diff(&a, &none)? > 1e-3);
    Ok(())
}

#[test]
fn key_padding_is_an_ignore_mask_over_keys() -> Result<()> {
    let (q, k, v) = qkv(2, 3, 4, 6)?;
    let pad = Tensor::new(&[[0u8, 0, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1]], &Device::Cpu)?;
    let a = run(&q, &k, &v, AttnMask::key_padding(&pad)?)?;
    let b = run(&q, &k, &v, AttnMask::ignore(&pad.reshape((2, 1, 1, 6))?)?)?;
    assert_eq!(max_diff(&a, &b)?, 0.0);
    // Row 1 equals attention over its first 4 keys only.
    let alone = sdpa(
        &q.narrow(0, 1, 1)?,
        &k.narrow(0, 1, 1)?.narrow(2, 0, 4)?,
        &v.narrow(0, 1, 1)?.narrow(2, 0, 4)?,
        &SdpaOptions::new(),
    )?;
    assert!(max_diff(&a.narrow(0, 1, 1)?, &alone)? < 1e-6);
    Ok(())
}

/// An explicit `(L, S)` keep mask of `j <= i + off` (and `j > i + off - w`).
fn band(l: usize, s: usize, off: isize, w: Option<usize>) -> Result<Tensor> {
    let mut m = vec![0u8; l * s];
    for i in 0..l {
        for j in 0..s {
            let (i, j) = (i as isize, j as isize);
            let lo_ok = w.is_none_or(|w| j > i + off - w as isize);
            m[(i * s as isize + j) as usize] = (j <= i + off && lo_ok) as u8;
        }
    }
    Tensor::from_vec(m, (l, s), &Device::Cpu)
}

#[test]
fn causal_alignments_equal_explicit_masks() -> Result<()> {
    for (l, s) in [(5, 5), (3, 7), (7, 3)] {
        let (q, k, v) = qkv(1, 2, l, s)?;
        let tl = run(&q, &k, &v, AttnMask::causal())?;
        assert!(max_diff(&tl, &run(&q, &k, &v, AttnMask::keep(&band(l, s, 0, None)?)?)?)? < 1e-6);
        let flag = sdpa(&q, &k, &v, &SdpaOptions::new().with_causal(true))?;
        assert_eq!(max_diff(&tl, &flag)?, 0.0);
        let off = s as isize - l as isize;
        let br = run(&q, &k, &v, AttnMask::causal_bottom_right())?;
        assert!(max_diff(&br, &run(&q, &k, &v, AttnMask::keep(&band(l, s, off, None)?)?)?)? < 1e-6);
        let o2 = run(&q, &k, &v, AttnMask::causal_with_offset(2))?;
        assert!(max_diff(&o2, &run(&q, &k, &v, AttnMask::keep(&band(l, s, 2, None)?)?)?)? < 1e-6);
        let sw = run(&q, &k, &v, AttnMask::sliding_window(2, CausalAlign::BottomRight)?)?;
        assert!(
            max_diff(
                &sw,
                &run(&q, &k, &v, AttnMask::keep(&band(l, s, off, Some(2))?)?)?
            )? < 1e-6
        );
    }
    Ok(())
}

/// An explicit `(L, S)` keep mask of `visible(i, j)`.
fn keep_where(l: usize, s: usize, visible: impl Fn(i128, i128) -> bool) -> Result<AttnMask> {
    let m: Vec<u8> = (0..l * s)
        .map(|x| visible((x / s) as i128, (x % s) as i128) as u8)
        .collect();
    AttnMask::keep(&Tensor::from_vec(m, (l, s), &Device::Cpu)?)
}

/// Causal rules combined with `and`, including pairs that share no key (every row 0)
/// and offsets and windows at the ends of `isize` and `usize`, give on both backends
/// the output of the same visibility written as an explicit mask (checked in `i128`).
#[test]
fn causal_rules_combine_and_extremes_agree_on_both_backends() -> Result<()> {
    use candle_attention::Backend;
    let (l, s) = (3, 7);
    let (q, k, v) = qkv(1, 2, l, s)?;
    // (mask, visibility of key j from query i)
    type Vis = Box<dyn Fn(i128, i128) -> bool>;
    let sw = |w: usize, a: CausalAlign| AttnMask::sliding_window(w, a);
    let cases: Vec<(&str, AttnMask, Vis)> = vec![
        (
            "top-left causal and a 2-key bottom-right window: no key in common",
            AttnMask::causal().and(&sw(2, CausalAlign::BottomRight)?),
            Box::new(|_, _| false),
        ),
        (
            "j <= i + 1 and i - 1 < j <= i + 2",
            AttnMask::causal_with_offset(1).and(&sw(3, CausalAlign::Offset(2))?),
            Box::new(|i, j| j <= i + 1 && j > i - 1),
        ),
        (
            "a window and an offset that leave the last row no key",
            sw(2, CausalAlign::Offset(6))?.and(&AttnMask::causal_with_offset(5)),
            Box::new(|i, j| j <= i + 5 && j > i + 4),
        ),
        (
            "offset isize::MAX: every key",
            AttnMask::causal_with_offset(isize::MAX),
            Box::new(|_, _| true),
        ),
        (
            "offset isize::MIN: no key",
            AttnMask::causal_with_offset(isize::MIN),
            Box::new(|_, _| false),
        ),
        (
            "window usize::MAX, bottom-right",
            sw(usize::MAX, CausalAlign::BottomRight)?,
            Box::new(move |i, j| j <= i + (s - l) as i128),
        ),
        (
            "window isize::MAX at offset isize::MAX: j > i",
            sw(isize::MAX as usize, CausalAlign::Offset(isize::MAX))?,
            Box::new(|i, j| j > i),
        ),
        (
            "window usize::MAX at offset isize::MAX, and top-left causal",
            sw(usize::MAX, CausalAlign::Offset(isize::MAX))?.and(&AttnMask::causal()),
            Box::new(|i, j| j <= i),
        ),
    ];
    for (name, mask, vis) in cases {
        let want = run(&q, &k, &v, keep_where(l, s, &*vis)?)?;
        for be in [Backend::Reference, Backend::Fused] {
            let opts = SdpaOptions::new().with_mask(mask.clone()).with_backend(be);
            let got = sdpa(&q, &k, &v, &opts)?;
            let d = max_diff(&got, &want)?;
            assert!(d < 1e-5, "{name}, {be:?}: max diff {d}");
        }
    }
    Ok(())
}

/// Additive masks with finite values too large to scale by `log2 e` in f32 (Hugging
/// Face hides keys with `f32::MIN`): the fused kernel, which keeps scores in log2 units,
/// must treat them as the reference path does in natural units, as finite values. A
/// row whose keys all carry `f32::MIN` is a softmax over equal scores (the mean of V),
/// not a fully masked row, and a key at `f32::MAX` takes all the weight of its row.
#[test]
fn huge_finite_additive_values_stay_finite_on_both_backends() -> Result<()> {
    use candle_attention::Backend;
    let (l, s) = (4, 70);
    let (q, k, v) = qkv(1, 2, l, s)?;
    let mut m = vec![0f32; l * s];
    m[..s].fill(f32::MIN); // row 0: every key at f32::MIN
    for j in (0..s).step_by(3) {
        m[s + j] = f32::MIN; // row 1: a third of the keys
    }
    m[2 * s + 66] = f32::MAX; // row 2: one key at f32::MAX
    m[3 * s + 5] = f32::NEG_INFINITY; // row 3: one key hidden
    let m = Tensor::from_vec(m, (l, s), &Device::Cpu)?;
    let mean_v = v.mean_keepdim(2)?; // (1, 2, 1, 6)
    let v66 = v.narrow(2, 66, 1)?;
    // Contiguous, and a transposed copy seen as `(L, S)`, whose key stride is not 1
    // (the kernel's scalar loop; the contiguous rows take AVX-512 where there is one).
    for m in [m.clone(), m.t()?.contiguous()?.t()?] {
        let mask = AttnMask::additive(&m)?;
        for be in [Backend::Reference, Backend::Fused] {
            let opts = SdpaOptions::new().with_mask(mask.clone()).with_backend(be);
            let o = sdpa(&q, &k, &v, &opts)?;
            assert!(max_diff(&o.narrow(2, 0, 1)?, &mean_v)? < 1e-5, "{be:?}: row 0");
            assert!(max_diff(&o.narrow(2, 2, 1)?, &v66)? < 1e-5, "{be:?}: row 2");
        }
        let fused = SdpaOptions::new()
            .with_mask(mask.clone())
            .with_backend(Backend::Fused);
        let reference = SdpaOptions::new()
            .with_mask(mask)
            .with_backend(Backend::Reference);
        let d = max_diff(&sdpa(&q, &k, &v, &fused)?, &sdpa(&q, &k, &v, &reference)?)?;
        assert!(d < 1e-5, "fused against reference: {d}");
    }
    Ok(())
}

#[test]
fn sliding_window_lets_exactly_w_keys_through() -> Result<()> {
    let m = AttnMask::sliding_window(3, CausalAlign::TopLeft)?;
    let add = m.to_additive(&[6, 6], DType::F32, &Device::Cpu)?.unwrap();
    let visible = add.eq(0f32)?.to_dtype(DType::U32)?.sum(1)?.to_vec1::<u32>()?;
    assert_eq!(visible, vec![1, 2, 3, 3, 3, 3]);
    Ok(())
}

#[test]
fn masks_combine() -> Result<()> {
    let (q, k, v) = qkv(2, 2, 5, 5)?;
    let keep = random_keep(&[2, 1, 5, 5])?;
    let both = AttnMask::keep(&keep)?.and(&AttnMask::causal());
    let explicit = keep.minimum(
        &band(5, 5, 0, None)?
            .reshape((1, 1, 5, 5))?
            .broadcast_as((2, 1, 5, 5))?,
    )?;
    let a = run(&q, &k, &v, both)?;
    let b = run(&q, &k, &v, AttnMask::keep(&explicit)?)?;
    assert!(max_diff(&a, &b)? < 1e-6);
    // Two additive masks add up.
    let m1 = randn(&[5, 5])?;
    let m2 = randn(&[2, 1, 1, 5])?;
    let a = run(
        &q,
        &k,
        &v,
        AttnMask::additive(&m1)?.and(&AttnMask::additive(&m2)?),
    )?;
    let b = run(&q, &k, &v, AttnMask::additive(&m1.broadcast_add(&m2)?)?)?;
    assert!(max_diff(&a, &b)? < 1e-6);
    Ok(())
}

#[test]
fn every_broadcast_shape_matches_the_full_mask() -> Result<()> {
    let (q, k, v) = qkv(2, 3, 4, 5)?;
    for shape in [
        vec![4, 5],
        vec![1, 5],
        vec![2, 1, 4, 5],
        vec![1, 3, 1, 5],
        vec![2, 3, 4, 5],
        vec![5],
    ] {
        let keep = random_keep(&shape)?;
        let full = keep
            .reshape([vec![1; 4 - shape.len()], shape.clone()].concat())?
            .broadcast_as((2, 3, 4, 5))?;
        let a = run(&q, &k, &v, AttnMask::keep(&keep)?)?;
        let b = run(&q, &k, &v, AttnMask::keep(&full.contiguous()?)?)?;
        assert_eq!(max_diff(&a, &b)?, 0.0, "mask shape {shape:?}");
    }
    Ok(())
}

#[test]
fn fully_masked_rows_give_zero() -> Result<()> {
    let (q, k, v) = qkv(1, 2, 4, 5)?;
    let mut keep = vec![1u8; 20];
    keep[5..10].fill(0); // query row 1 sees nothing
    let keep = Tensor::from_vec(keep, (4, 5), &Device::Cpu)?;
    let opts = SdpaOptions::new()
        .with_mask(AttnMask::keep(&keep)?)
        .with_weights(true);
    let out = candle_attention::scaled_dot_product_attention(&q, &k, &v, &opts)?;
    let row = out.output.narrow(2, 1, 1)?;
    assert!(all_zero(&row)?);
    let w = out.weights.unwrap();
    assert!(all_zero(&w.narrow(2, 1, 1)?)?);
    // Other rows are normal softmax rows.
    let sums = w.narrow(2, 0, 1)?.sum(3)?.flatten_all()?.to_vec1::<f32>()?;
    assert!(sums.iter().all(|s| (s - 1.0).abs() < 1e-5));
    // Causal with L > S (top-left) leaves rows with no key, and L, S = 0 edge: all zero, no NaN.
    let (q, k, v) = qkv(1, 1, 3, 0)?;
    let out = sdpa(&q, &k, &v, &SdpaOptions::new())?;
    assert_eq!(out.dims(), &[1, 1, 3, 6]);
    Ok(())
}

#[test]
fn mask_that_cannot_broadcast_names_both_shapes() -> Result<()> {
    let (q, k, v) = qkv(2, 3, 4, 5)?;
    let bad = Tensor::ones((3, 5), DType::U8, &Device::Cpu)?;
    let msg = err_msg(run(&q, &k, &v, AttnMask::keep(&bad)?));
    assert!(msg.contains("[3, 5]") && msg.contains("[2, 3, 4, 5]"), "{msg}");
    let too_many = Tensor::ones((1, 2, 3, 4, 5), DType::U8, &Device::Cpu)?;
    let msg = err_msg(run(&q, &k, &v, AttnMask::keep(&too_many)?));
    assert!(
        msg.contains("[1, 2, 3, 4, 5]") && msg.contains("[2, 3, 4, 5]"),
        "{msg}"
    );
    Ok(())
}

#[test]
fn mask_with_the_wrong_dtype_is_an_error() -> Result<()> {
    let f = Tensor::zeros((4, 5), DType::F32, &Device::Cpu)?;
    let b = Tensor::zeros((4, 5), DType::U8, &Device::Cpu)?;
    assert!(err_msg(AttnMask::keep(&f)).contains("F32"));
    assert!(err_msg(AttnMask::ignore(&f)).contains("F32"));
    assert!(err_msg(AttnMask::additive(&b)).contains("U8"));
    assert!(err_msg(AttnMask::key_padding(&Tensor::zeros(
        (1, 2, 3),
        DType::U8,
        &Device::Cpu
    )?))
    .contains("[1, 2, 3]"));
    assert!(err_msg(AttnMask::sliding_window(0, CausalAlign::TopLeft)).contains("at least 1"));
    Ok(())
}

/// `causal_additive` and `to_additive` refuse a score shape of rank below 2.
#[test]
fn scores_of_rank_below_2_are_an_error() {
    let dev = Device::Cpu;
    for scores in [&[5usize][..], &[]] {
        for mask in [AttnMask::causal(), AttnMask::none()] {
            let msg = err_msg(mask.causal_additive(scores, DType::F32, &dev));
            assert!(msg.contains("attention scores need rank >= 2"), "{msg}");
            let msg = err_msg(mask.to_additive(scores, DType::F32, &dev));
            assert!(msg.contains("attention scores need rank >= 2"), "{msg}");
        }
    }
}
