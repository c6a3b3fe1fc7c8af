//! The fused CPU kernel called directly, on every instruction set this machine supports,
//! against a naive candle reference (including its error paths).

mod common;
use candle_attention::kernels::cpu::{sdpa, sdpa_with, sdpa_with_isa, Causal, Extras, Isa};
use candle_core::{DType, Device, Result, Tensor, D};
use common::err_msg;

/// Deterministic xorshift generator.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as usize
    }
    fn vec(&mut self, n: usize, amp: f32) -> Vec<f32> {
        (0..n).map(|_| (self.uniform() * 2.0 - 1.0) * amp).collect()
    }
}

/// Every instruction set this machine supports, portable first.
fn isas() -> Vec<Isa> {
    [Isa::Portable, Isa::Neon, Isa::Avx2Fma, Isa::Avx512]
        .into_iter()
        .filter(|i| i.is_supported())
        .collect()
}

/// Naive reference: f64 math in candle ops, mask and causal rule as dense (L, S) masks,
/// softmax with fully masked rows -> 0, cast back to the input dtype.
fn reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    causal: Option<Causal>,
    scale: f32,
) -> Result<Tensor> {
    let dtype = q.dtype();
    let (b, hq, l, _e) = q.dims4()?;
    let (_, hkv, s, e) = k.dims4()?;
    let ev = v.dim(3)?;
    let g = hq / hkv;
    let q = q.to_dtype(DType::F64)?.contiguous()?;
    let k = k
        .to_dtype(DType::F64)?
        .unsqueeze(2)?
        .broadcast_as((b, hkv, g, s, e))?
        .reshape((b, hq, s, e))?;
    let v = v
        .to_dtype(DType::F64)?
        .unsqueeze(2)?
        .broadcast_as((b, hkv, g, s, ev))?
        .reshape((b, hq, s, ev))?;
    let mut scores = (q.matmul(&k.t()?.contiguous()?)? * scale as f64)?;
    if let Some(m) = mask {
        scores = scores.broadcast_add(&m.to_dtype(DType::F64)?)?;
    }
    if let Some(c) = causal {
        let mut cm = vec![0f32; l * s];
        for i in 0..l {
            for j in 0..s {
                let top = i as isize + c.offset;
                let mut vis = (j as isize) <= top;
                if let Some(w) = c.window {
                    vis &= (j as isize) > top - w as isize;
                }
                if !vis {
                    cm[i * s + j] = f32::NEG_INFINITY;
                }
            }
        }
        let cm = Tensor::from_vec(cm, (1, 1, l, s), &Device::Cpu)?.to_dtype(DType::F64)?;
        scores = scores.broadcast_add(&cm)?;
    }
    let m = scores.max_keepdim(D::Minus1)?;
    let finite = m.ge(f32::MIN as f64)?;
    let m = finite.where_cond(&m, &m.zeros_like()?)?;
    let ex = scores.broadcast_sub(&m)?.exp()?;
    let sum = ex.sum_keepdim(D::Minus1)?.maximum(1e-30f64)?;
    let p = ex.broadcast_div(&sum)?;
    p.matmul(&v.contiguous()?)?.to_dtype(dtype)
}

fn tol(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 5e-3,
        _ => 2e-2,
    }
}

fn max_rel_err(ours: &Tensor, reference: &Tensor) -> Result<f32> {
    assert_eq!(ours.dims(), reference.dims());
    assert_eq!(ours.dtype(), reference.dtype());
    assert!(ours.is_contiguous());
    let a = ours.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let r = reference.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let denom = r.iter().fold(1f32, |m, x| m.max(x.abs()));
    let mut worst = 0f32;
    for (x, y) in a.iter().zip(&r) {
        assert!(x.is_finite(), "non-finite output {x}");
        worst = worst.max((x - y).abs() / denom);
    }
    Ok(worst)
}

#[derive(Clone, Debug)]
struct Case {
    b: usize,
    hq: usize,
    hkv: usize,
    l: usize,
    s: usize,
    e: usize,
    ev: usize,
    dtype: DType,
    /// Which mask dims are full (vs 1); None = no mask.
    mask: Option<[bool; 4]>,
    /// Fraction of -inf mask entries; also fully masks some rows when > 0.
    neg_inf: f32,
    causal: Option<Causal>,
    /// Build q/k/v as transposed (B, L, H, E) views with a start offset.
    noncontig: bool,
    amp: f32,
}

fn make_input(rng: &mut Rng, c: &Case, h: usize, n: usize, d: usize) -> Result<Tensor> {
    let t = if c.noncontig {
        // (B, n, h, d + 3) narrowed and transposed -> (B, h, n, d), non-contiguous, offset.
        let full = Tensor::from_vec(
            rng.vec(c.b * n * h * (d + 3), c.amp),
            (c.b, n, h, d + 3),
            &Device::Cpu,
        )?;
        full.narrow(3, 2, d)?.transpose(1, 2)?
    } else {
        Tensor::from_vec(rng.vec(c.b * h * n * d, c.amp), (c.b, h, n, d), &Device::Cpu)?
    };
    t.to_dtype(c.dtype)
}

fn run_case(rng: &mut Rng, c: &Case) -> Result<()> {
    let q = make_input(rng, c, c.hq, c.l, c.e)?;
    let k = make_input(rng, c, c.hkv, c.s, c.e)?;
    let v = make_input(rng, c, c.hkv, c.s, c.ev)?;
    let mask = match c.mask {
        None => None,
        Some(full) => {
            let want = [c.b, c.hq, c.l, c.s];
            let dims: Vec<usize> = (0..4).map(|i| if full[i] { want[i] } else { 1 }).collect();
            let n: usize = dims.iter().product();
            let mut vals = rng.vec(n, 2.0);
            for x in vals.iter_mut() {
                if rng.uniform() < c.neg_inf {
                    *x = f32::NEG_INFINITY;
                }
            }
            // Fully mask one row (of the last dim) when requested.
            if c.neg_inf > 0.0 && dims[3] > 0 && n > 0 {
                let rows = n / dims[3];
                let r = rng.range(0, rows - 1);
                vals[r * dims[3]..(r + 1) * dims[3]].fill(f32::NEG_INFINITY);
            }
            let m = Tensor::from_vec(vals, dims.as_slice(), &Device::Cpu)?;
            // Present broadcast dims as stride-0 views half of the time.
            if rng.uniform() < 0.5 {
                Some(m.broadcast_as((
                    if full[0] { c.b } else { 1 },
                    if full[1] { c.hq } else { 1 },
                    if full[2] { c.l } else { 1 },
                    if full[3] { c.s } else { 1 },
                ))?)
            } else {
                Some(m)
            }
        }
    };
    let scale = 1.0 / (c.e.max(1) as f32).sqrt();
    let r = reference(&q, &k, &v, mask.as_ref(), c.causal, scale)?;
    for isa in isas() {
        let o = sdpa_with_isa(&q, &k, &v, mask.as_ref(), c.causal, scale, isa)?;
        let err = max_rel_err(&o, &r)?;
        assert!(
            err <= tol(c.dtype),
            "{isa:?} err {err} > {} for {c:?}",
            tol(c.dtype)
        );
    }
    Ok(())
}

fn base(b: usize, hq: usize, hkv: usize, l: usize, s: usize, e: usize) -> Case {
    Case {
        b,
        hq,
        hkv,
        l,
        s,
        e,
        ev: e,
        dtype: DType::F32,
        mask: None,
        neg_inf: 0.0,
        causal: None,
        noncontig: false,
        amp: 1.0,
    }
}

#[test]
fn basic_shapes() -> Result<()> {
    let mut rng = Rng(0x1234_5678_9abc_def1);
    for &(b, hq, hkv, l, s, e) in &[
        (1, 1, 1, 1, 1, 8),
        (1, 2, 1, 1, 5, 16),
        (2, 4, 2, 7, 9, 32),
        (1, 8, 1, 33, 17, 64),
        (1, 4, 4, 100, 130, 64),
        (2, 8, 2, 61, 200, 24),
        (1, 2, 2, 97, 63, 128),
        (1, 8, 8, 5, 700, 32),
        (1, 3, 3, 50, 1, 7),
    ] {
        run_case(&mut rng, &base(b, hq, hkv, l, s, e))?;
    }
    Ok(())
}

#[test]
fn randomized() -> Result<()> {
    let mut rng = Rng(0xdead_beef_cafe_f00d);
    let dtypes = [DType::F32, DType::F16, DType::BF16];
    for iter in 0..120 {
        let g = [1, 2, 4, 8][rng.range(0, 3)];
        let hkv = rng.range(1, 2);
        let l = match rng.range(0, 3) {
            0 => 1,
            1 => rng.range(2, 16),
            _ => rng.range(17, 150),
        };
        let s = match rng.range(0, 2) {
            0 => rng.range(1, 15),
            _ => rng.range(16, 260),
        };
        let e = [8, 16, 33, 64, 80][rng.range(0, 4)];
        let mut c = base(rng.range(1, 2), g * hkv, hkv, l, s, e);
        c.ev = if rng.uniform() < 0.3 { rng.range(1, 70) } else { e };
        c.dtype = dtypes[iter % 3];
        c.noncontig = rng.uniform() < 0.3;
        c.amp = if rng.uniform() < 0.2 { 4.0 } else { 1.0 };
        if rng.uniform() < 0.5 {
            let bits = rng.range(0, 15);
            c.mask = Some([bits & 1 != 0, bits & 2 != 0, bits & 4 != 0, bits & 8 != 0]);
            c.neg_inf = if rng.uniform() < 0.5 { 0.3 } else { 0.0 };
        }
        if rng.uniform() < 0.5 {
            let offset = match rng.range(0, 3) {
                0 => 0,
                1 => s as isize - l as isize,
                2 => -(rng.range(0, 5) as isize),
                _ => rng.range(0, 40) as isize,
            };
            let window = if rng.uniform() < 0.4 {
                Some(rng.range(1, 70))
            } else {
                None
            };
            c.causal = Some(Causal { offset, window });
        }
        run_case(&mut rng, &c)?;
    }
    Ok(())
}

#[test]
fn every_mask_broadcast_shape_and_dtype() -> Result<()> {
    let mut rng = Rng(42);
    for bits in 0..16usize {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let mut c = base(2, 4, 2, 13, 75, 32);
            c.dtype = dtype;
            c.mask = Some([bits & 1 != 0, bits & 2 != 0, bits & 4 != 0, bits & 8 != 0]);
            c.neg_inf = 0.25;
            run_case(&mut rng, &c)?;
        }
    }
    Ok(())
}

#[test]
fn causal_offsets_and_windows() -> Result<()> {
    let mut rng = Rng(7);
    for &(l, s) in &[
        (1usize, 1usize),
        (1, 300),
        (64, 64),
        (97, 97),
        (50, 300),
        (300, 50),
        (129, 257),
    ] {
        for offset in [0isize, s as isize - l as isize, -3, 5] {
            for window in [None, Some(1), Some(16), Some(65)] {
                let mut c = base(1, 2, 1, l, s, 32);
                c.causal = Some(Causal { offset, window });
                run_case(&mut rng, &c)?;
            }
        }
    }
    Ok(())
}

#[test]
fn causal_with_mask_and_gqa() -> Result<()> {
    let mut rng = Rng(99);
    for g in [1usize, 2, 4, 8] {
        let mut c = base(2, 2 * g, 2, 70, 90, 64);
        c.causal = Some(Causal {
            offset: 20,
            window: Some(40),
        });
        c.mask = Some([true, false, false, true]);
        c.neg_inf = 0.2;
        c.noncontig = true;
        run_case(&mut rng, &c)?;
    }
    Ok(())
}

#[test]
fn larger_prefill_blocks() -> Result<()> {
    // Several row blocks per head, several key blocks, edge-block trimming, GQA.
    let mut rng = Rng(31337);
    for dtype in [DType::F32, DType::F16] {
        let mut c = base(1, 8, 2, 333, 517, 64);
        c.dtype = dtype;
        c.causal = Some(Causal {
            offset: 517 - 333,
            window: None,
        });
        run_case(&mut rng, &c)?;
        c.causal = Some(Causal {
            offset: 517 - 333,
            window: Some(200),
        });
        c.mask = Some([false, false, true, true]);
        c.neg_inf = 0.1;
        run_case(&mut rng, &c)?;
        c.causal = None;
        c.ev = 40;
        c.noncontig = true;
        run_case(&mut rng, &c)?;
    }
    Ok(())
}

#[test]
fn a_32_mib_output_matches_the_reference() -> Result<()> {
    // B1 H4 L16384 Ev128 f32: 32 MiB, the size from which the kernel asks Linux for
    // huge pages before writing its output (few keys and a short E keep it cheap).
    let mut rng = Rng(0x32_3232);
    let mut c = base(1, 4, 4, 16384, 40, 8);
    c.ev = 128;
    c.causal = Some(Causal {
        offset: 0,
        window: None,
    });
    run_case(&mut rng, &c)
}

#[test]
fn decode_split_k() -> Result<()> {
    // Few groups and a long key range exercise the split-K / LSE merge path.
    let mut rng = Rng(2024);
    for &(hq, hkv, l) in &[(1usize, 1usize, 1usize), (4, 1, 1), (8, 2, 3), (32, 8, 1)] {
        for dtype in [DType::F32, DType::BF16] {
            let mut c = base(1, hq, hkv, l, 2100, 64);
            c.dtype = dtype;
            run_case(&mut rng, &c)?;
            c.causal = Some(Causal {
                offset: 2100 - l as isize,
                window: Some(900),
            });
            run_case(&mut rng, &c)?;
            c.causal = None;
            c.mask = Some([false, true, true, true]);
            c.neg_inf = 0.5;
            run_case(&mut rng, &c)?;
        }
    }
    Ok(())
}

/// f32 decode groups of 7 to 54 rows (query heads per KV head × queries). AVX-512 reads
/// f32 K rows in place for up to 48 rows, with strips of up to 16 rows in the lanes from
/// 12 rows on (and on Zen 4 of up to 8 rows from 7 on), and takes fewer keys per decode
/// block where 512 would not fit the score buffer (48 rows of 64). AVX2 reads them in
/// place for up to 32 rows, with strips of up to 8 rows in the lanes from 6 rows on and
/// of up to 16 from 14 (whose `P·V` then runs register tiles over V rows asked for while
/// the scores ran). The
/// portable kernel (and half precision, which `decode_split_k` and
/// `decode_blocks_follow_growing_scores` cover) packs each block from 25 rows on. Two
/// groups, so the key range is split across threads too; 1100 keys, so a decode block
/// of 256 or 384 keys ends inside the range and the last tile of 16 or 8 keys is
/// partial. Each with the bottom-right causal rule (a speculative step), a padding mask
/// with fully masked rows, and K/V as strided views.
#[test]
fn decode_groups_of_7_to_54_rows() -> Result<()> {
    let mut rng = Rng(0x1a4e_5eed);
    let s = 1100;
    for &(hq, l, e) in &[
        (7usize, 1usize, 64usize),
        (8, 1, 128),
        (5, 2, 128),
        (4, 3, 128),
        (8, 2, 64),
        (4, 4, 128),
        (16, 1, 256),
        (4, 6, 64),
        (7, 4, 128),
        (8, 4, 64),
        (4, 11, 128),
        (8, 6, 64),
        (6, 9, 32),
    ] {
        decode_group_variants(&mut rng, base(1, 2 * hq, 2, l, s, e))?;
    }
    Ok(())
}

/// f16 groups of 25–32 rows, which stay on the decode path on AVX-512 and AVX2
/// (`decode::DECODE_MAX_ROWS_F16`), against the reference, with the same three variants
/// as above.
#[test]
fn f16_decode_groups_of_25_to_32_rows() -> Result<()> {
    let mut rng = Rng(0xf16d_ec0d);
    let s = 1100;
    for &(hq, l, e) in &[
        (5usize, 5usize, 128usize),
        (7, 4, 128),
        (8, 4, 64),
        (4, 8, 256),
        (4, 7, 32),
    ] {
        let mut c = base(1, 2 * hq, 2, l, s, e);
        c.dtype = DType::F16;
        decode_group_variants(&mut rng, c)?;
    }
    Ok(())
}

/// One decode group's case as it is, with the bottom-right causal rule (a speculative
/// step), and with a padding mask that fully masks rows and K/V as strided views.
fn decode_group_variants(rng: &mut Rng, mut c: Case) -> Result<()> {
    run_case(rng, &c)?;
    c.causal = Some(Causal {
        offset: (c.s - c.l) as isize,
        window: None,
    });
    run_case(rng, &c)?;
    c.causal = None;
    c.mask = Some([false, true, false, true]);
    c.neg_inf = 0.3;
    c.noncontig = true;
    run_case(rng, &c)
}

#[test]
fn fully_masked_rows_are_zero() -> Result<()> {
    let q = Tensor::ones((1, 2, 4, 8), DType::F32, &Device::Cpu)?;
    let k = Tensor::ones((1, 1, 6, 8), DType::F32, &Device::Cpu)?;
    let v = Tensor::ones((1, 1, 6, 8), DType::F32, &Device::Cpu)?;
    let mask = Tensor::full(f32::NEG_INFINITY, (1, 1, 1, 6), &Device::Cpu)?;
    for isa in isas() {
        let o = sdpa_with_isa(&q, &k, &v, Some(&mask), None, 1.0, isa)?;
        assert!(o.flatten_all()?.to_vec1::<f32>()?.iter().all(|&x| x == 0.0));
        // Causal offset -10: no key visible from any row.
        let o = sdpa_with_isa(
            &q,
            &k,
            &v,
            None,
            Some(Causal {
                offset: -10,
                window: None,
            }),
            1.0,
            isa,
        )?;
        assert!(o.flatten_all()?.to_vec1::<f32>()?.iter().all(|&x| x == 0.0));
    }
    // S == 0.
    let k0 = Tensor::zeros((1, 1, 0, 8), DType::F32, &Device::Cpu)?;
    let o = sdpa(&q, &k0, &k0, None, None, 1.0)?;
    assert_eq!(o.dims(), &[1, 2, 4, 8]);
    assert!(o.flatten_all()?.to_vec1::<f32>()?.iter().all(|&x| x == 0.0));
    // L == 0.
    let q0 = Tensor::zeros((1, 2, 0, 8), DType::F32, &Device::Cpu)?;
    assert_eq!(sdpa(&q0, &k, &v, None, None, 1.0)?.dims(), &[1, 2, 0, 8]);
    Ok(())
}

#[test]
fn zero_head_dim_averages_values() -> Result<()> {
    // E == 0: every score is 0, so each output row is the mean of the visible values.
    // Ev = 16 puts half-precision decode on the AVX-512 path that reads K/V rows in
    // place, whose bf16 Q split walked Q in rows of E and panicked for E == 0. The means
    // (8..=11 and 32..=47) are exact in every dtype.
    let dev = Device::Cpu;
    for dt in [DType::F32, DType::F16, DType::BF16] {
        let q = Tensor::zeros((1, 2, 3, 0), dt, &dev)?;
        let k = Tensor::zeros((1, 1, 5, 0), dt, &dev)?;
        for ev in [4, 16] {
            let v = Tensor::arange(0f32, (5 * ev) as f32, &dev)?.reshape((1, 1, 5, ev))?;
            let want = v.mean_keepdim(2)?.broadcast_as((1, 2, 3, ev))?;
            let v = v.to_dtype(dt)?;
            for isa in isas() {
                let o = sdpa_with_isa(&q, &k, &v, None, None, 1.0, isa)?;
                assert_eq!(o.dtype(), dt);
                let o = o.to_dtype(DType::F32)?;
                assert!(
                    max_rel_err(&o, &want.contiguous()?)? < 1e-6,
                    "{dt:?} Ev={ev} {isa:?}"
                );
            }
        }
    }
    Ok(())
}

#[test]
fn extreme_causal_parameters() -> Result<()> {
    let dev = Device::Cpu;
    let q = Tensor::randn(0f32, 1.0, (1, 2, 9, 16), &dev)?;
    let k = Tensor::randn(0f32, 1.0, (1, 2, 11, 16), &dev)?;
    let v = Tensor::randn(0f32, 1.0, (1, 2, 11, 16), &dev)?;
    let full = sdpa(&q, &k, &v, None, None, 0.25)?;
    let all = Causal {
        offset: isize::MAX,
        window: Some(usize::MAX),
    };
    let o = sdpa(&q, &k, &v, None, Some(all), 0.25)?;
    assert!(max_rel_err(&o, &full)? < 1e-6);
    let none = Causal {
        offset: isize::MIN,
        window: None,
    };
    let o = sdpa(&q, &k, &v, None, Some(none), 0.25)?;
    assert!(o.flatten_all()?.to_vec1::<f32>()?.iter().all(|&x| x == 0.0));
    // A window of 0 keys (what two causal rules with no key in common combine to)
    // hides every key: every row is 0, as on the reference path.
    let empty = Causal {
        offset: 3,
        window: Some(0),
    };
    let o = sdpa(&q, &k, &v, None, Some(empty), 0.25)?;
    assert!(o.flatten_all()?.to_vec1::<f32>()?.iter().all(|&x| x == 0.0));
    // Key j visible iff j > i, with the bounds far past isize's range in between:
    // `i + offset + 1` saturated at isize::MAX made every key visible.
    let above = Causal {
        offset: isize::MAX,
        window: Some(isize::MAX as usize),
    };
    let o = sdpa(&q, &k, &v, None, Some(above), 0.25)?;
    let keep: Vec<f32> = (0..9 * 11)
        .map(|x| if x % 11 > x / 11 { 0.0 } else { f32::NEG_INFINITY })
        .collect();
    let m = Tensor::from_vec(keep, (1, 1, 9, 11), &dev)?;
    let want = sdpa(&q, &k, &v, Some(&m), None, 0.25)?;
    assert!(max_rel_err(&o, &want)? < 1e-6);
    Ok(())
}

#[test]
fn invalid_inputs_error() -> Result<()> {
    let dev = Device::Cpu;
    let q = Tensor::zeros((1, 4, 3, 8), DType::F32, &dev)?;
    let k = Tensor::zeros((1, 2, 5, 8), DType::F32, &dev)?;
    let v = Tensor::zeros((1, 2, 5, 6), DType::F32, &dev)?;
    assert!(sdpa(&q, &k, &v, None, None, 1.0).is_ok());
    let q3 = Tensor::zeros((4, 3, 8), DType::F32, &dev)?;
    assert!(sdpa(&q3, &k, &v, None, None, 1.0).is_err());
    let kh = k.to_dtype(DType::F16)?;
    assert!(sdpa(&q, &kh, &v, None, None, 1.0).is_err());
    let qi = Tensor::zeros((1, 4, 3, 8), DType::U32, &dev)?;
    let ki = Tensor::zeros((1, 2, 5, 8), DType::U32, &dev)?;
    let vi = Tensor::zeros((1, 2, 5, 6), DType::U32, &dev)?;
    assert!(sdpa(&qi, &ki, &vi, None, None, 1.0).is_err());
    let k3 = Tensor::zeros((1, 3, 5, 8), DType::F32, &dev)?;
    let v3 = Tensor::zeros((1, 3, 5, 6), DType::F32, &dev)?;
    assert!(sdpa(&q, &k3, &v3, None, None, 1.0).is_err());
    let ke = Tensor::zeros((1, 2, 5, 7), DType::F32, &dev)?;
    assert!(sdpa(&q, &ke, &v, None, None, 1.0).is_err());
    let vs = Tensor::zeros((1, 2, 4, 6), DType::F32, &dev)?;
    assert!(sdpa(&q, &k, &vs, None, None, 1.0).is_err());
    let bad_mask = Tensor::zeros((1, 1, 2, 5), DType::F32, &dev)?;
    let err = sdpa(&q, &k, &v, Some(&bad_mask), None, 1.0).unwrap_err();
    assert!(err.to_string().contains("mask"), "{err}");
    let mask_f16 = Tensor::zeros((1, 1, 1, 5), DType::F16, &dev)?;
    assert!(sdpa(&q, &k, &v, Some(&mask_f16), None, 1.0).is_err());
    let mask3 = Tensor::zeros((1, 3, 5), DType::F32, &dev)?;
    assert!(sdpa(&q, &k, &v, Some(&mask3), None, 1.0).is_err());
    // One sink per query head (4 here); a positive, finite soft-cap.
    let sinks = |sk: &'static [f32]| Extras {
        sinks: Some(sk),
        softcap: None,
    };
    let cap = |c: f32| Extras {
        sinks: None,
        softcap: Some(c),
    };
    for heads_inner in [false, true] {
        let ok = sdpa_with(&q, &k, &v, None, None, 1.0, sinks(&[0.5; 4]), heads_inner)?;
        assert_eq!(ok.dims(), &[1, 4, 3, 6]);
        let err = sdpa_with(&q, &k, &v, None, None, 1.0, sinks(&[0.5; 2]), heads_inner).unwrap_err();
        assert!(
            err.to_string().contains("one logit per query head (4), got 2"),
            "{err}"
        );
        sdpa_with(&q, &k, &v, None, None, 1.0, cap(30.0), heads_inner)?;
        for c in [0.0, -2.0, f32::NAN, f32::INFINITY] {
            let err = sdpa_with(&q, &k, &v, None, None, 1.0, cap(c), heads_inner).unwrap_err();
            assert!(
                err.to_string().contains("softcap must be positive and finite"),
                "{err}"
            );
        }
    }
    Ok(())
}

/// An instruction set the running machine lacks, chosen without the crate's own detection:
/// one of another architecture first (its kernel is not even compiled in), else a missing
/// x86-64 extension; `None` only on a machine that has them all.
fn missing_isa() -> Option<Isa> {
    #[cfg(target_arch = "x86_64")]
    let lacks = |isa: Isa| match isa {
        Isa::Avx512 => {
            !(std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512dq"))
        }
        Isa::Avx2Fma => {
            !(std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
                && std::is_x86_feature_detected!("f16c"))
        }
        Isa::Neon => true,
        Isa::Portable => false,
    };
    #[cfg(target_arch = "aarch64")]
    let lacks = |isa: Isa| match isa {
        Isa::Neon => !std::arch::is_aarch64_feature_detected!("neon"),
        Isa::Portable => false,
        Isa::Avx512 | Isa::Avx2Fma => true,
    };
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let lacks = |isa: Isa| isa != Isa::Portable;
    [Isa::Neon, Isa::Avx512, Isa::Avx2Fma, Isa::Portable]
        .into_iter()
        .find(|&isa| lacks(isa))
}

/// `sdpa_with_isa` refuses an instruction set this machine does not support.
#[test]
fn an_unsupported_instruction_set_is_an_error() -> Result<()> {
    let Some(isa) = missing_isa() else {
        eprintln!("skipped: this machine supports every instruction set of `Isa`");
        return Ok(());
    };
    let dev = Device::Cpu;
    let q = Tensor::zeros((1, 2, 3, 8), DType::F32, &dev)?;
    let v = Tensor::zeros((1, 2, 5, 8), DType::F32, &dev)?;
    let msg = err_msg(sdpa_with_isa(&q, &v, &v, None, None, 1.0, isa));
    assert!(
        msg.contains(&format!(
            "instruction set {} is not supported on this machine",
            isa.name()
        )),
        "{msg}"
    );
    Ok(())
}

#[test]
fn isa_name() {
    let name = candle_attention::kernels::cpu::isa();
    assert!(["avx512", "avx2+fma", "neon", "portable"].contains(&name));
    // Every aarch64 CPU has NEON, so unless a variable forces another kernel it is the
    // one this binary's kernel tests ran on.
    #[cfg(target_arch = "aarch64")]
    if std::env::var("CANDLE_ATTENTION_ISA").is_err() {
        assert_eq!(name, "neon");
    }
}

/// The bf16 pair-product path (bf16/f16 inputs on a machine with AMX; bf16 inputs on
/// AVX512-BF16 without AMX, or with `CANDLE_ATTENTION_AMX=0`) against f32 math on the same
/// inputs, rounded to the input dtype. f16 keeps every significant bit (components
/// `hi + lo`), so it must be within one output ulp, up to f32 rounding noise; bf16 rounds
/// the probabilities to one bf16 (as PyTorch does), which may add up to 2⁻⁹ · max|v|.
/// Both bounds are much tighter than the dtype tolerance, so they catch a dropped
/// component term (e.g. the low half of an f16 value). Covers the packed prefill path
/// (long L), the streamed path (one row block per group), causal edges, a mask, GQA and
/// head dims that are not multiples of 32.
#[test]
fn amx_precision_matches_f32_math() -> Result<()> {
    if !candle_attention::kernels::cpu::amx_enabled() {
        eprintln!("note: AMX not available here; f16 runs the f32 kernels");
    }
    if !candle_attention::kernels::cpu::bf16_pairs_enabled() {
        eprintln!("note: no bf16 pair products here; bf16 runs the f32 kernels");
    }
    let mut rng = Rng(0x05ee_da11);
    let dev = Device::Cpu;
    // (b, hq, hkv, l, s, e, ev, causal, masked)
    let shapes = [
        (1, 2, 2, 300, 300, 64, 64, false, false),
        (1, 4, 2, 200, 333, 40, 72, true, false),
        (2, 3, 1, 90, 130, 128, 128, false, true),
        (1, 2, 2, 1000, 1000, 16, 48, true, true),
    ];
    for (b, hq, hkv, l, s, e, ev, causal, masked) in shapes {
        let mk = |n: &[usize], amp: f32, rng: &mut Rng| -> Result<Tensor> {
            let len = n.iter().product();
            Tensor::from_vec(rng.vec(len, amp), n, &dev)
        };
        let q = mk(&[b, hq, l, e], 2.0, &mut rng)?;
        let k = mk(&[b, hkv, s, e], 2.0, &mut rng)?;
        let v = mk(&[b, hkv, s, ev], 1.5, &mut rng)?;
        let mask = if masked {
            let m: Vec<f32> = (0..b * l * s)
                .map(|_| {
                    if rng.uniform() < 0.3 {
                        f32::NEG_INFINITY
                    } else {
                        rng.uniform() - 0.5
                    }
                })
                .collect();
            Some(Tensor::from_vec(m, (b, 1, l, s), &dev)?)
        } else {
            None
        };
        let c = causal.then_some(Causal {
            offset: s as isize - l as isize,
            window: None,
        });
        let label = format!("b{b} hq{hq} hkv{hkv} l{l} s{s} e{e} ev{ev} causal={causal} masked={masked}");
        check_amx_precision(&q, &k, &v, mask.as_ref(), c, &label, &[DType::F16, DType::BF16])?;
    }
    Ok(())
}

/// The bound of [`amx_precision_matches_f32_math`]: our f16 and bf16 results against f32
/// math on the same rounded inputs, rounded to the dtype.
fn check_amx_precision(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    c: Option<Causal>,
    label: &str,
    dtypes: &[DType],
) -> Result<()> {
    let vmax = v.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()? as f64;
    for (dt, ulp, p_err) in [
        (DType::F16, 2f32.powi(-10), 0.0),
        (DType::BF16, 2f32.powi(-7), 2f64.powi(-9)),
    ] {
        if !dtypes.contains(&dt) {
            continue;
        }
        let (q, k, v) = (q.to_dtype(dt)?, k.to_dtype(dt)?, v.to_dtype(dt)?);
        let ours = sdpa(&q, &k, &v, mask, c, 0.125)?.to_dtype(DType::F32)?;
        let f32_math = sdpa(
            &q.to_dtype(DType::F32)?,
            &k.to_dtype(DType::F32)?,
            &v.to_dtype(DType::F32)?,
            mask,
            c,
            0.125,
        )?;
        let rounded = f32_math.to_dtype(dt)?.to_dtype(DType::F32)?;
        // |ours − rounded| ≤ one ulp of the f32 result, plus 2e-5 ≈ 2⁻¹⁶ · max|v| for
        // the f32 rounding of either path (dropping an f16 component costs ~2⁻⁹ · |v|),
        // plus the bf16 probability rounding.
        let bound = ((f32_math.abs()? * ulp as f64)? + (2e-5 + p_err * vmax))?;
        // (Checked first: candle's `max` below would skip a NaN.)
        let finite = ours.flatten_all()?.to_vec1::<f32>()?;
        assert!(
            finite.iter().all(|x| x.is_finite()),
            "{dt:?} {label}: non-finite output"
        );
        let excess = ((ours - &rounded)?.abs()? - bound)?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        assert!(excess <= 0.0, "{dt:?} {label}: off by more than 1 ulp ({excess})");
    }
    Ok(())
}

/// Inputs of the lazy-rescaling tests: queries of about 1 `(1, 1, l, e)`, keys whose
/// elements come from `key(rng, j)` for key `j` `(1, 1, s, e)`, values of amplitude 1.5
/// `(1, 1, s, ev)`, and, with `causal`, the bottom-right aligned causal rule. A row's
/// score for key `j` is then about `e · scale · key(j)`.
fn rescale_case(
    rng: &mut Rng,
    (l, s, e, ev): (usize, usize, usize, usize),
    mut key: impl FnMut(&mut Rng, usize) -> f32,
    causal: bool,
) -> Result<(Tensor, Tensor, Tensor, Option<Causal>)> {
    let dev = Device::Cpu;
    let qv: Vec<f32> = (0..l * e).map(|_| 1.0 + 0.01 * rng.uniform()).collect();
    let kv: Vec<f32> = (0..s * e).map(|i| key(rng, i / e)).collect();
    let q = Tensor::from_vec(qv, (1, 1, l, e), &dev)?;
    let k = Tensor::from_vec(kv, (1, 1, s, e), &dev)?;
    let v = Tensor::from_vec(rng.vec(s * ev, 1.5), (1, 1, s, ev), &dev)?;
    let c = causal.then_some(Causal {
        offset: s as isize - l as isize,
        window: None,
    });
    Ok((q, k, v, c))
}

/// Scores that grow along the keys, slowly (the AMX softmax keeps its stale running
/// maximum: probabilities up to 2^8) and fast (every 256-key super-block exceeds it by
/// more than 2^8 and is redone against its own maximum); also on causal rows, whose
/// first visible block differs per row. Score `j` of a row is about
/// `0.125 · 64 · g(j)` for keys `k_j ≈ g(j)·1` and queries of ones.
#[test]
fn amx_lazy_rescale_follows_growing_scores() -> Result<()> {
    let mut rng = Rng(0x1a2e_5ca1);
    let (l, s, e, ev) = (160, 1024, 64, 64);
    // Per 256 keys the scores grow by 8·256·slope nats: 1 (≈ 1.4 in log2, lazy), 8
    // (≈ 11.5, redone), 16 (≈ 23) and 64 (≈ 92: without the redo, probabilities would
    // overflow f32 by the last block). Scores that large (~256) put the f16 path's
    // dropped lo·lo product term above this test's one-ulp bound, though still far
    // inside the f16 tolerance, so those slopes run in bf16 only. At 1/8, a causal row's
    // hidden keys in its diagonal block score up to ~370 (log2) above its visible ones:
    // counted in the block maximum, they would flush every visible probability to 0.
    let both = [DType::F16, DType::BF16];
    for (slope, causal, dtypes) in [
        (1.0 / 2048.0, false, &both[..]),
        (1.0 / 256.0, false, &both[..]),
        (1.0 / 128.0, false, &both[..]),
        (1.0 / 128.0, true, &both[..]),
        (1.0 / 32.0, true, &[DType::BF16][..]),
        (1.0 / 8.0, true, &[DType::BF16][..]),
    ] {
        let key = |rng: &mut Rng, j: usize| j as f32 * slope + 0.05 * (rng.uniform() - 0.5);
        let (q, k, v, c) = rescale_case(&mut rng, (l, s, e, ev), key, causal)?;
        check_amx_precision(
            &q,
            &k,
            &v,
            None,
            c,
            &format!("slope {slope} causal={causal}"),
            dtypes,
        )?;
    }
    // Flat scores but for one key of the third 256-key block (lane 5 of its 16-key chunk)
    // that scores 100 nats (≈ 144 in log2) above the rest: only that lane's maximum
    // calls for the redo, and without it the key's probability would overflow f32.
    let spike = 2 * 256 + 16 * 7 + 5;
    let key = |rng: &mut Rng, j: usize| {
        if j == spike {
            12.5
        } else {
            0.05 * (rng.uniform() - 0.5)
        }
    };
    let (q, k, v, _) = rescale_case(&mut rng, (l, s, e, ev), key, false)?;
    check_amx_precision(&q, &k, &v, None, None, "spike in lane 5", &[DType::BF16])?;
    Ok(())
}

/// The f32 softmax's lazy rescaling (AVX-512 keeps a row's stale running maximum while
/// the scores stay within 2^8 of it, and redoes a row against its own maximum beyond
/// that), on every instruction set: scores that step up from one 64-key block to the
/// next, slowly and fast, on full and causal rows, with `Ev = 64` (64-key blocks) and
/// `Ev = 130` (two blocks at once on AVX-512), and one key far above the rest in lane 5
/// of its 16-key chunk. A row's score for key `j` is about `0.125 · 64 · k_j = 8·k_j`
/// nats (queries of ones); scores are centred on 0 so that their own f32 rounding stays
/// well below the tolerance.
#[test]
fn f32_lazy_rescale_follows_growing_scores() -> Result<()> {
    let mut rng = Rng(0x5ca1_ab1e);
    let (l, s, e) = (40, 256, 64);
    let spike = 2 * 64 + 16 * 2 + 5;
    for ev in [64, 130] {
        // Per block the scores step up by 8·step nats: ≈ 1.4 in log2 (kept), ≈ 11.5
        // (redone) and ≈ 65 (two steps overflow f32 without the redo). Step 0: flat
        // scores but for the spike, 100 nats (≈ 144 in log2) above them.
        for (step, causal) in [
            (0.12, false),
            (1.0, false),
            (1.0, true),
            (5.6, false),
            (5.6, true),
            (0.0, false),
        ] {
            let key = |rng: &mut Rng, j: usize| {
                let base = if step == 0.0 {
                    if j == spike {
                        12.5
                    } else {
                        0.0
                    }
                } else {
                    ((j / 64) as f32 - 1.5) * step
                };
                base + 0.05 * (rng.uniform() - 0.5)
            };
            let (q, k, v, c) = rescale_case(&mut rng, (l, s, e, ev), key, causal)?;
            // Four query heads on the one K/V head: 160 rows per group, more than one
            // row block, so K/V go through the shared pack (which the two-block path
            // needs) instead of the single-block streaming path.
            let q = q.repeat((1, 4, 1, 1))?;
            let want = reference(&q, &k, &v, None, c, 0.125)?;
            for isa in isas() {
                let got = sdpa_with_isa(&q, &k, &v, None, c, 0.125, isa)?;
                let err = max_rel_err(&got, &want)?;
                assert!(
                    err <= tol(DType::F32),
                    "{isa:?} ev {ev} step {step} causal={causal}: rel err {err}"
                );
            }
        }
    }
    Ok(())
}

/// Decode groups on blocks of up to 512 keys (AVX-512 and AVX2 read K/V rows in place in
/// blocks of 128 KiB of rows, whose softmax is updated 128 keys at a time on AVX-512 and
/// 64 on AVX2): scores that step up
/// every 128 keys, slowly (the stale reference is kept) and fast (each 128 keys redo the
/// row against their own maximum, so the probabilities that the block's earlier updates
/// wrote are brought to the new reference, and `alpha` multiplies), one key far above
/// the rest in the second 128 keys of a block, and rows whose first visible key lies
/// inside a block (a sliding window, or an additive mask hiding the first keys). Groups
/// of 1, 4 and 8 query rows (bf16 groups of 4 and 8 take the pairs products where there
/// is AVX512-BF16), 16 (f32 scores with the rows in the lanes on AVX-512 and AVX2) and
/// 40 (f32 on AVX-512: in place, in blocks of 384 keys at heads of 64; packed
/// elsewhere), f32, bf16 and f16, heads of 64 and 128; 1400 keys end in a partial block.
/// A row's score for key `j` is about `0.125 · e · k_j` nats (queries of ones).
#[test]
fn decode_blocks_follow_growing_scores() -> Result<()> {
    let mut rng = Rng(0xdec0_b10c);
    let s = 1400;
    let spike = 512 + 128 + 16 * 3 + 5;
    for e in [64usize, 128] {
        // Per 128 keys the scores step up by `0.125·e·step` nats: with e = 128, 0.8
        // (≈ 1.2 in log2, kept) and 8 (≈ 11.5, redone); step 0: flat scores but for the
        // spike, 100 nats above them.
        let unit = 0.125 * e as f32;
        for step in [0.8 / unit, 8.0 / unit, 0.0] {
            let key = |rng: &mut Rng, j: usize| {
                let base = if step == 0.0 {
                    if j == spike {
                        100.0 / unit
                    } else {
                        0.0
                    }
                } else {
                    ((j / 128) as f32 - 5.0) * step
                };
                base + 0.05 * (rng.uniform() - 0.5)
            };
            let (q1, k, v, _) = rescale_case(&mut rng, (1, s, e, e), key, false)?;
            for g in [1usize, 4, 8, 16, 40] {
                let q = q1.repeat((1, g, 1, 1))?;
                // No mask; a window whose first key is 300 (inside the first block); an
                // additive mask hiding the first 700 keys (inside the second block of
                // 512, the sixth of 256).
                let window = Causal {
                    offset: s as isize - 1,
                    window: Some(s - 300),
                };
                let mut hide = vec![0f32; s];
                hide[..700].fill(f32::NEG_INFINITY);
                let hide = Tensor::from_vec(hide, (1, 1, 1, s), &Device::Cpu)?;
                for (what, mask, c) in [
                    ("whole", None, None),
                    ("window", None, Some(window)),
                    ("masked", Some(&hide), None),
                ] {
                    // (Groups of 16 and 40 rows in f32 only: half precision takes the
                    // same paths there as at 8 rows and at 25.)
                    let dtypes: &[DType] = if g < 16 {
                        &[DType::F32, DType::BF16, DType::F16]
                    } else {
                        &[DType::F32]
                    };
                    for &dtype in dtypes {
                        let (q, k, v) = (q.to_dtype(dtype)?, k.to_dtype(dtype)?, v.to_dtype(dtype)?);
                        let want = reference(&q, &k, &v, mask, c, 0.125)?;
                        for isa in isas() {
                            let got = sdpa_with_isa(&q, &k, &v, mask, c, 0.125, isa)?;
                            let err = max_rel_err(&got, &want)?;
                            assert!(
                                err <= tol(dtype),
                                "{isa:?} {dtype:?} e {e} step {step} {g} rows {what}: rel err {err}"
                            );
                        }
                    }
                }
            }
        }
    }
    Ok(())
}
