//! The AVX-512 softmax: the 16-lane `2^x`, the online-softmax update of f32 score rows
//! held in registers (lazily rescaled), and the AMX path's rows of bf16 components.

use super::*;

/// 16-lane `2^x`: `x = n + f` (`n = floor(x)`, `0 ≤ f < 1`, `f` in one `vreduceps`), a
/// degree-5 polynomial for `2^f` (fitted for relative error with `2^0 = 1` exact;
/// < 8.3e-8 in exact arithmetic, < 1.6e-7 evaluated in f32) and `vscalefps` for the `2^n`
/// factor. Inputs below -126 (including -inf) give exactly 0, NaN gives 0: the one
/// compare that finds them zeroes those lanes, so no clamp is needed (the polynomial's
/// value there, NaN for -inf, is never used).
///
/// # Safety
/// The CPU must support AVX-512F and AVX512DQ.
#[inline]
#[target_feature(enable = "avx512f,avx512dq")]
pub(crate) unsafe fn exp2_512(x: __m512) -> __m512 {
    let valid = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, _mm512_set1_ps(-126.0));
    let f = _mm512_reduce_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(x);
    let mut y = _mm512_set1_ps(1.867_126_3e-3);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.017_038e-3));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.579_991e-2));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.240_164_46));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.693_151_3));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0));
    _mm512_maskz_scalef_ps(valid, y, x)
}

/// [`exp2_512`] on the lanes of `keep` (0 elsewhere) with a shorter polynomial, for the
/// AMX path, where the probabilities are rounded to bf16 components anyway: degree 3
/// (relative error < 1.1e-4, against 2⁻⁹ for one bf16) when `HI_ONLY`, else degree 4
/// (< 3e-6, against 2⁻¹⁶ for `hi + lo`). Lanes below -126 (-inf included) give 0, as in
/// [`exp2_512`]; the one masked compare that finds them also applies `keep`, and the
/// polynomial's value in lanes it drops (NaN for -inf) is never used, so no clamp is
/// needed.
///
/// # Safety
/// The CPU must support AVX-512F and AVX512DQ.
#[inline]
#[target_feature(enable = "avx512f,avx512dq")]
unsafe fn exp2_512_short<const HI_ONLY: bool>(x: __m512, keep: __mmask16) -> __m512 {
    let valid = _mm512_mask_cmp_ps_mask::<_CMP_GE_OQ>(keep, x, _mm512_set1_ps(-126.0));
    // `x − floor(x)` in one instruction (AVX512DQ `vreduceps`); `vscalefps` multiplies by
    // 2^floor(x). The polynomials approximate 2^f on [0, 1): they are the minimax ones on
    // [-0.5, 0.5] shifted by one half and scaled by √2, with the same relative error.
    let f = _mm512_reduce_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(x);
    let y = if HI_ONLY {
        let mut y = _mm512_set1_ps(7.779_365e-2);
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.225_846_17));
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.696_258_67));
        _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.999_898_5))
    } else {
        let mut y = _mm512_set1_ps(1.355_212_7e-2);
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.195_923e-2));
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.241_485_03));
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.692_995_13));
        _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.000_002_8))
    };
    _mm512_maskz_scalef_ps(valid, y, x)
}

/// Stores 16 floats as bf16 components: `hi = bf16(v)` and, unless `lo` is null,
/// `lo = bf16(v − hi)` (16 elements each).
///
/// # Safety
/// AVX-512F and AVX512-BF16 must be available; `hi` (and `lo`) hold 16 elements.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
pub(crate) unsafe fn store_components(v: __m512, hi: *mut u16, lo: *mut u16) {
    let h = _mm512_cvtneps_pbh(v);
    _mm256_storeu_si256(hi as *mut __m256i, std::mem::transmute::<__m256bh, __m256i>(h));
    if !lo.is_null() {
        let l = _mm512_cvtneps_pbh(_mm512_sub_ps(v, _mm512_cvtpbh_ps(h)));
        _mm256_storeu_si256(lo as *mut __m256i, std::mem::transmute::<__m256bh, __m256i>(l));
    }
}

/// Online-softmax update of `n` f32 score rows of at most 128 keys, in place, lazily
/// rescaled as in [`softmax_row_bf16`]: row `r` (at `s + r·lds`, `nk` keys) becomes
/// `p = 2^(x − m_new)` on its visible keys `[a, z)` and 0 on the rest of `0..nk`, where
/// `(a, z) = range(r)`. `m`, the row sum and `alpha` are updated as by
/// `avx2::online_row` (`l ← alpha·l + Σ p`), except that the reference `m_new` stays
/// `m_old` (`alpha = 1`) unless the row's maximum exceeds it by more than
/// [`LAZY_RESCALE_LOG2`], so `p ≤ 2^8`, and that the row sum is kept as 16 lane-wise
/// partial sums, `l16[16·r..16·r + 16]`, whose total is the row sum: each block adds
/// its sum vector with one multiply-add, where a horizontal sum per row and block took
/// about 1.5% of the time at D = 64. A row's first visible block (`m_old = −inf`) sets
/// `m_new` to its maximum (and `alpha = 0`, so whatever `l16` held is dropped); a row
/// with no visible key so far is all 0, with `m` and `l16` unchanged and `alpha = 1`.
///
/// The row stays in registers between its maximum and its exponentials (`NC` chunks of
/// 16 keys, `16·NC ≥ nk`), so no pass over memory finds the maximum and a row whose
/// maximum stays within the bound needs no horizontal maximum at all. The caller picks
/// the fewest chunks that hold `nk` keys: a block's tail of up to 16 keys takes one.
/// The maximum skips NaN scores (see [`softmax_regs`]), so the chunks of −inf that a
/// tail leaves out would not change it.
///
/// # Safety
/// AVX-512F and AVX512DQ must be available; `s` holds `n` rows of stride `lds ≥ nk`;
/// `m` and `alpha` hold `n` elements and `l16` `16·n`; `a ≤ z ≤ nk ≤ 16·NC` for every
/// range.
#[target_feature(enable = "avx512f,avx512dq")]
pub(in crate::kernels::cpu) unsafe fn online_rows_lazy<const NC: usize>(
    s: *mut f32,
    (lds, n, nk): (usize, usize, usize),
    range: impl Fn(usize) -> (usize, usize),
    (m, l16, alpha): (&mut [f32], &mut [f32], &mut [f32]),
) {
    debug_assert!(nk <= 16 * NC && lds >= nk && m.len() >= n && l16.len() >= 16 * n && alpha.len() >= n);
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    let stores: [__mmask16; NC] = std::array::from_fn(|c| chunk_mask(16 * c, (0, nk)));
    for r in 0..n {
        let row = s.add(r * lds);
        let ar = range(r);
        debug_assert!(ar.0 <= ar.1 && ar.1 <= nk);
        let mut v = [ninf; NC];
        for (c, vc) in v.iter_mut().enumerate() {
            *vc = _mm512_mask_loadu_ps(ninf, chunk_mask(16 * c, ar), row.add(16 * c));
        }
        let p = softmax_regs(v, (&mut m[r], l16.as_mut_ptr().add(16 * r), &mut alpha[r]));
        for (c, (&pc, &sm)) in p.iter().zip(&stores).enumerate() {
            _mm512_mask_storeu_ps(row.add(16 * c), sm, pc);
        }
    }
}

/// The lazily rescaled online-softmax update of one score row held in registers (`NC`
/// chunks of 16 scores, -inf where hidden), as described at [`online_rows_lazy`]:
/// returns the probabilities (0 where hidden, all 0 for a row with nothing visible so
/// far) and updates the row's `m`, its 16 partial sums at `l16` and `alpha`.
///
/// The row's maximum skips NaN scores (`max(v, mx)` returns `mx` where `v` is NaN), so
/// a NaN key hides only itself. Taken the other way round, a NaN in a later chunk
/// replaced the lane's maximum, so a key in the same lane of an earlier chunk went
/// through the exponential unseen, and one more than 128 (log2) ahead of the row's
/// reference overflowed and made the row NaN
/// (`tests/extremes.rs::a_nan_key_hides_only_itself`).
///
/// # Safety
/// AVX-512F and AVX512DQ must be available; `l16` points to 16 floats, read and
/// written.
#[inline]
#[target_feature(enable = "avx512f,avx512dq")]
pub(super) unsafe fn softmax_regs<const NC: usize>(
    v: [__m512; NC],
    (m, l16, alpha): (&mut f32, *mut f32, &mut f32),
) -> [__m512; NC] {
    let mut mx = _mm512_set1_ps(f32::NEG_INFINITY);
    for &vc in &v {
        mx = _mm512_max_ps(vc, mx);
    }
    let m_old = *m;
    let (m_new, al) = if m_old == f32::NEG_INFINITY {
        let bm = _mm512_reduce_max_ps(mx);
        if bm == f32::NEG_INFINITY {
            *alpha = 1.0;
            return [_mm512_setzero_ps(); NC];
        }
        (bm, 0.0)
    } else if _mm512_cmp_ps_mask::<_CMP_GT_OQ>(
        _mm512_sub_ps(mx, _mm512_set1_ps(m_old)),
        _mm512_set1_ps(LAZY_RESCALE_LOG2),
    ) == 0
    {
        (m_old, 1.0)
    } else {
        // The row's maximum ran ahead of the reference: rescale to it.
        let bm = _mm512_reduce_max_ps(mx);
        (bm, _mm512_cvtss_f32(exp2_512(_mm512_set1_ps(m_old - bm))))
    };
    let p = exp_and_sum(v, m_new, al, l16);
    *m = m_new;
    *alpha = al;
    p
}

/// `p = 2^(v − r)` for each chunk of a row, and the row's 16 lane-wise partial sums
/// `l16 ← al·l16 + Σ p`: the rows of [`softmax_regs`], and the rescaled ones of
/// [`softmax_regs_shifted`].
///
/// # Safety
/// AVX-512F and AVX512DQ must be available; `l16` points to 16 floats, read and
/// written.
#[inline]
#[target_feature(enable = "avx512f,avx512dq")]
unsafe fn exp_and_sum<const NC: usize>(v: [__m512; NC], r: f32, al: f32, l16: *mut f32) -> [__m512; NC] {
    let rv = _mm512_set1_ps(r);
    let mut sum = _mm512_setzero_ps();
    let p = v.map(|vc| {
        let pc = exp2_512(_mm512_sub_ps(vc, rv));
        sum = _mm512_add_ps(sum, pc);
        pc
    });
    _mm512_storeu_ps(
        l16,
        _mm512_fmadd_ps(_mm512_loadu_ps(l16), _mm512_set1_ps(al), sum),
    );
    p
}

/// [`softmax_regs`] for a full block's row of scores that come already shifted by the
/// row's running maximum, `v = s − m` (`m` finite: the score tile started its
/// accumulators at `−m`, see [`super::qk_softmax`]), which saves the subtraction per 16
/// scores and the one of the lazy check. Returns the probabilities and updates `m`, the
/// 16 partial sums at `l16` and `alpha` as [`softmax_regs`] does: `p = 2^v` with
/// `alpha = 1` unless a score exceeds `m` by more than [`LAZY_RESCALE_LOG2`], and then
/// `m` moves to the row's maximum and the block is taken against it. The maximum skips
/// NaN scores, as in [`softmax_regs`].
///
/// # Safety
/// AVX-512F and AVX512DQ must be available; `l16` points to 16 floats, read and
/// written.
#[inline]
#[target_feature(enable = "avx512f,avx512dq")]
pub(super) unsafe fn softmax_regs_shifted(
    v: [__m512; 4],
    (m, l16, alpha): (&mut f32, *mut f32, &mut f32),
) -> [__m512; 4] {
    let mut mx = _mm512_set1_ps(f32::NEG_INFINITY);
    for &vc in &v {
        mx = _mm512_max_ps(vc, mx);
    }
    if _mm512_cmp_ps_mask::<_CMP_GT_OQ>(mx, _mm512_set1_ps(LAZY_RESCALE_LOG2)) == 0 {
        let mut sum = _mm512_setzero_ps();
        let p = v.map(|vc| {
            let pc = exp2_512(vc);
            sum = _mm512_add_ps(sum, pc);
            pc
        });
        _mm512_storeu_ps(l16, _mm512_add_ps(_mm512_loadu_ps(l16), sum));
        *alpha = 1.0;
        return p;
    }
    // The row's maximum ran ahead of the reference: rescale to it (`m + bm`).
    let bm = _mm512_reduce_max_ps(mx);
    let al = _mm512_cvtss_f32(exp2_512(_mm512_set1_ps(-bm)));
    let p = exp_and_sum(v, bm, al, l16);
    *m += bm;
    *alpha = al;
    p
}

/// Lane mask of the lanes of the 16-key chunk starting at `x0` that are visible in `[a, z)`.
#[inline]
fn chunk_mask(x0: usize, (a, z): (usize, usize)) -> __mmask16 {
    let lo = a.saturating_sub(x0).min(16);
    let hi = z.saturating_sub(x0).min(16);
    let upto = |n: usize| if n >= 16 { 0xffffu32 } else { (1u32 << n) - 1 };
    (upto(hi) & !upto(lo)) as __mmask16
}

/// Online-softmax update of one score row of the AMX path (`x.len()` a multiple of 16):
/// `y = c·x` on the visible keys `[a, z)`, `p = 2^(y − m_new)` (0 outside `[a, z)`),
/// stored as bf16 components `hi = bf16(p)` and, unless `lo` is null, `lo = bf16(p − hi)`
/// (`x.len()` each). Returns `(m_new, alpha = 2^(m_old − m_new))` and updates the row's
/// sum `l ← alpha·l + Σ p`, kept as 16 lane-wise partial sums in `l16` (their total is the
/// row sum), so that no horizontal sum runs per block. When `m_new` is -inf, `hi` and `lo`
/// are zero, `l16` is unchanged and `(−inf, 1)` is returned.
///
/// The reference `m_new` is the row's running maximum, rescaled lazily: a row's first
/// visible block sets it to that block's maximum, and later blocks keep `m_new = m_old`
/// (`alpha = 1`, one pass over the row, no rescale of the output) unless their maximum
/// exceeds it by more than [`LAZY_RESCALE_LOG2`], when `m_new` becomes their maximum
/// (a second pass). A row's first visible block takes the maximum of its visible keys in
/// the 16-key chunk that holds key `a` as `m_old` in the same way, which saves the pass
/// for its maximum (when those keys have no finite score, the maximum pass runs).
/// `p ≤ 2^8` either way, and a first block's `m_new` lies within [`LAZY_RESCALE_LOG2`]
/// below its maximum.
///
/// # Safety
/// AVX-512F, AVX512DQ and AVX512-BF16 must be available; `hi` (and `lo`, unless null)
/// hold `x.len()` elements; `a ≤ z ≤ x.len()`.
#[target_feature(enable = "avx512f,avx512dq,avx512bf16")]
pub(crate) unsafe fn softmax_row_bf16(
    x: &[f32],
    (a, z): (usize, usize),
    c: f32,
    m_old: f32,
    (hi, lo): (*mut u16, *mut u16),
    l16: &mut [f32; 16],
) -> (f32, f32) {
    // Only the 16-key chunks that hold visible keys are computed; the others get zero
    // probabilities here. Chunks wholly inside `[a, z)` then run unmasked (a key-padding
    // run or a causal edge ending on a chunk boundary takes no masks at all).
    let w = x.len();
    let (a16, z16) = (a / 16 * 16, z.div_ceil(16) * 16);
    let (a16, z16) = (a16.min(z16), z16.min(w));
    let zero = _mm256_setzero_si256();
    for (from, to) in [(0, a16), (z16, w)] {
        // Whole chunks (`w`, `a16` and `z16` are multiples of 16).
        for i in (from..to).step_by(16) {
            _mm256_storeu_si256(hi.add(i) as *mut __m256i, zero);
            if !lo.is_null() {
                _mm256_storeu_si256(lo.add(i) as *mut __m256i, zero);
            }
        }
    }
    let (xs, ab) = (&x[a16..z16], (a - a16, z - a16));
    let (hs, ls) = (hi.add(a16), if lo.is_null() { lo } else { lo.add(a16) });
    let (m_new, alpha, sum) = if lo.is_null() {
        softmax_row_impl::<true>(xs, ab, c, m_old, hs, ls)
    } else {
        softmax_row_impl::<false>(xs, ab, c, m_old, hs, ls)
    };
    if m_new != f32::NEG_INFINITY {
        let l = _mm512_loadu_ps(l16.as_ptr());
        let l = if alpha == 1.0 {
            _mm512_add_ps(l, sum)
        } else {
            _mm512_fmadd_ps(l, _mm512_set1_ps(alpha), sum)
        };
        _mm512_storeu_ps(l16.as_mut_ptr(), l);
    }
    (m_new, alpha)
}

/// [`softmax_row_bf16`]'s row pass: `(m_new, alpha, lane-wise Σ p)`.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,avx512bf16")]
unsafe fn softmax_row_impl<const HI_ONLY: bool>(
    x: &[f32],
    (a, z): (usize, usize),
    c: f32,
    m_old: f32,
    hi: *mut u16,
    lo: *mut u16,
) -> (f32, f32, __m512) {
    let w = x.len();
    debug_assert!(w.is_multiple_of(16) && a <= z && z <= w);
    if m_old > f32::NEG_INFINITY {
        // One pass against the running maximum.
        let (m_new, sum, redone) = lazy_pass::<HI_ONLY>(x, (a, z), c, m_old, hi, lo);
        let alpha = if redone {
            _mm512_cvtss_f32(exp2_512(_mm512_set1_ps(m_old - m_new)))
        } else {
            1.0
        };
        return (m_new, alpha, sum);
    }
    let xp = x.as_ptr();
    let cv = _mm512_set1_ps(c);
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    // The row's first visible block: the maximum of the visible keys among its first 16
    // keys (the chunk of key `a`) is a provisional reference, redone as above when the
    // block's maximum runs more than `LAZY_RESCALE_LOG2` ahead of it. That saves a pass
    // over the row for its maximum.
    let first = if a == 0 && z >= 16 {
        0xffff
    } else {
        chunk_mask(0, (a, z))
    };
    let m0 = _mm512_reduce_max_ps(_mm512_mask_mul_ps(ninf, first, _mm512_loadu_ps(xp), cv));
    if m0.is_finite() {
        let (m_new, sum, _) = lazy_pass::<HI_ONLY>(x, (a, z), c, m0, hi, lo);
        return (m_new, 1.0, sum);
    }
    // No finite visible score among those 16: the block's maximum first, then the
    // exponentials.
    let full = a == 0 && z == w;
    let mask = |i: usize| if full { 0xffff } else { chunk_mask(i, (a, z)) };
    let (mut m0, mut m1) = (ninf, ninf);
    let mut i = 0;
    // `max(y, m)` skips NaN scores, as in `visible_max`.
    while i + 32 <= w {
        m0 = _mm512_max_ps(
            _mm512_mask_mul_ps(ninf, mask(i), _mm512_loadu_ps(xp.add(i)), cv),
            m0,
        );
        m1 = _mm512_max_ps(
            _mm512_mask_mul_ps(ninf, mask(i + 16), _mm512_loadu_ps(xp.add(i + 16)), cv),
            m1,
        );
        i += 32;
    }
    if i < w {
        m0 = _mm512_max_ps(
            _mm512_mask_mul_ps(ninf, mask(i), _mm512_loadu_ps(xp.add(i)), cv),
            m0,
        );
    }
    let m_new = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
    if m_new == f32::NEG_INFINITY {
        std::ptr::write_bytes(hi, 0, w);
        if !HI_ONLY {
            std::ptr::write_bytes(lo, 0, w);
        }
        return (m_new, 1.0, _mm512_setzero_ps());
    }
    let sum = exp_pass::<HI_ONLY>(x, (a, z), c, m_new, hi, lo);
    (m_new, 1.0, sum)
}

/// The largest lane-wise `Σ p` of a pass that [`lazy_pass`] takes as proof that no
/// visible key ran more than [`LAZY_RESCALE_LOG2`] ahead of the reference. An f32 sum of
/// non-negative terms is at least each of them, and a key with `c·x − m > 8` gets
/// `p ≥ 2^8 · (1 − 1.1·10⁻⁴) > 255.9` from `exp2_512_short` (either polynomial, or +inf
/// or NaN), so lane sums of at most 254 leave no such key, whatever the rounding.
const LAZY_SUM_BOUND: f32 = 254.0;

/// [`exp_pass`] against the reference `m`; when the block's maximum runs more than
/// [`LAZY_RESCALE_LOG2`] ahead of `m`, the row is redone against that maximum. Returns
/// `(m_new, lane-wise Σ p, whether it was redone)`.
///
/// The pass itself keeps no maximum: lane sums of at most [`LAZY_SUM_BOUND`] show that
/// no key ran ahead, which is the common case. Only a row with larger sums reads its
/// scores again for their maximum ([`visible_max`]), and the decision is then the one
/// the maximum gives, so the result is that of a pass that tracked it.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,avx512bf16")]
unsafe fn lazy_pass<const HI_ONLY: bool>(
    x: &[f32],
    (a, z): (usize, usize),
    c: f32,
    m: f32,
    hi: *mut u16,
    lo: *mut u16,
) -> (f32, __m512, bool) {
    let sum = exp_pass::<HI_ONLY>(x, (a, z), c, m, hi, lo);
    if _mm512_cmp_ps_mask::<_CMP_LE_OQ>(sum, _mm512_set1_ps(LAZY_SUM_BOUND)) == 0xffff {
        return (m, sum, false);
    }
    let y_max = visible_max(x, (a, z), c);
    let t_max = _mm512_sub_ps(y_max, _mm512_set1_ps(m));
    if _mm512_cmp_ps_mask::<_CMP_GT_OQ>(t_max, _mm512_set1_ps(LAZY_RESCALE_LOG2)) == 0 {
        return (m, sum, false);
    }
    // The block's maximum ran ahead: redo the row against it. The reference is that
    // maximum itself, not `m` plus its distance (which rounds when the two differ by
    // more than a factor of 2), so the largest key gets an exponent of exactly 0.
    let m_new = _mm512_reduce_max_ps(y_max);
    let sum = exp_pass::<HI_ONLY>(x, (a, z), c, m_new, hi, lo);
    (m_new, sum, true)
}

/// The lane-wise maximum over the visible keys `[a, z)` of the scores `c·x`, rounded as
/// [`exp_pass`] rounds them (-inf in lanes with no visible key). NaN scores count as
/// invisible, as in `exp2_512_short`.
#[inline]
#[target_feature(enable = "avx512f,avx512dq")]
unsafe fn visible_max(x: &[f32], (a, z): (usize, usize), c: f32) -> __m512 {
    let xp = x.as_ptr();
    let cv = _mm512_set1_ps(c);
    let mut ym = _mm512_set1_ps(f32::NEG_INFINITY);
    for i in (0..x.len()).step_by(16) {
        let y = _mm512_mul_ps(_mm512_loadu_ps(xp.add(i)), cv);
        // `max(y, ym)` returns `ym` where `y` is NaN.
        ym = _mm512_mask_max_ps(ym, chunk_mask(i, (a, z)), y, ym);
    }
    ym
}

/// `p = 2^(y − m)`, `y = c·x` rounded to f32 first (as the maximum that gives the
/// reference is, so that a key at the reference gets an exponent of exactly 0 however
/// large the scores), on the visible keys `[a, z)` (0 elsewhere) stored as bf16 components
/// (see [`softmax_row_bf16`]); returns the lane-wise `Σ p`. The 32-key steps wholly
/// inside `[a, z)` run without lane masks ([`exp_steps`]); the 16-key chunks before and
/// after them take lane masks. Even chunks sum into one accumulator and odd ones into
/// another, whichever way they run.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,avx512bf16")]
unsafe fn exp_pass<const HI_ONLY: bool>(
    x: &[f32],
    (a, z): (usize, usize),
    c: f32,
    m: f32,
    hi: *mut u16,
    lo: *mut u16,
) -> __m512 {
    let w = x.len();
    let (cv, mv) = (_mm512_set1_ps(c), _mm512_set1_ps(m));
    let zero = _mm512_setzero_ps();
    if a == 0 && z == w {
        // Every key visible (the common case): the steps, and a last chunk without a mask.
        let (s0, s1) = exp_steps::<HI_ONLY>(x, (0, w / 32 * 32), (cv, mv), (hi, lo), (zero, zero));
        let (s0, s1) = exp_masked::<HI_ONLY>(x, (0, w), (w / 32 * 32, w), (cv, mv), (hi, lo), (s0, s1));
        return _mm512_add_ps(s0, s1);
    }
    // The unmasked steps: keys `u0..u1`, or none.
    let (u0, u1) = (a.div_ceil(32) * 32, z / 32 * 32);
    let (u0, u1) = if u0 < u1 { (u0, u1) } else { (w, w) };
    let (s0, s1) = exp_masked::<HI_ONLY>(x, (a, z), (0, u0), (cv, mv), (hi, lo), (zero, zero));
    let (s0, s1) = exp_steps::<HI_ONLY>(x, (u0, u1), (cv, mv), (hi, lo), (s0, s1));
    let (s0, s1) = exp_masked::<HI_ONLY>(x, (a, z), (u1, w), (cv, mv), (hi, lo), (s0, s1));
    _mm512_add_ps(s0, s1)
}

/// [`exp_pass`] on the 32-key steps of keys `i0..i1` (`i0` and `i1` multiples of 32, all
/// visible), with no lane masks: with one component, each step's 32 probabilities are
/// rounded by one `VCVTNE2PS2BF16` and stored as one 64-byte vector (the row starts on
/// a 64-byte boundary in the AMX path's buffer). Adds to and returns the even and odd
/// chunks' sums.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,avx512bf16")]
unsafe fn exp_steps<const HI_ONLY: bool>(
    x: &[f32],
    (i0, i1): (usize, usize),
    (cv, mv): (__m512, __m512),
    (hi, lo): (*mut u16, *mut u16),
    (mut s0, mut s1): (__m512, __m512),
) -> (__m512, __m512) {
    let xp = x.as_ptr();
    let mut i = i0;
    while i < i1 {
        let t0 = _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(xp.add(i)), cv), mv);
        let t1 = _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(xp.add(i + 16)), cv), mv);
        let e0 = exp2_512_short::<HI_ONLY>(t0, 0xffff);
        let e1 = exp2_512_short::<HI_ONLY>(t1, 0xffff);
        s0 = _mm512_add_ps(s0, e0);
        s1 = _mm512_add_ps(s1, e1);
        if HI_ONLY {
            // Keys `i..i + 16` from `e0` in the low half, `i + 16..i + 32` from `e1`.
            let h = _mm512_cvtne2ps_pbh(e1, e0);
            _mm512_storeu_si512(hi.add(i) as *mut _, std::mem::transmute::<__m512bh, __m512i>(h));
        } else {
            store_components(e0, hi.add(i), lo.add(i));
            store_components(e1, hi.add(i + 16), lo.add(i + 16));
        }
        i += 32;
    }
    (s0, s1)
}

/// [`exp_pass`] on the 16-key chunks of keys `i0..i1` (`i0` a multiple of 32) with the
/// lane masks of the visible keys `[a, z)`. Adds to and returns the even and odd chunks'
/// sums.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,avx512bf16")]
unsafe fn exp_masked<const HI_ONLY: bool>(
    x: &[f32],
    (a, z): (usize, usize),
    (i0, i1): (usize, usize),
    (cv, mv): (__m512, __m512),
    (hi, lo): (*mut u16, *mut u16),
    (mut s0, mut s1): (__m512, __m512),
) -> (__m512, __m512) {
    let xp = x.as_ptr();
    let mut i = i0;
    while i < i1 {
        let t = _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(xp.add(i)), cv), mv);
        let e = exp2_512_short::<HI_ONLY>(t, chunk_mask(i, (a, z)));
        if (i / 16) % 2 == 0 {
            s0 = _mm512_add_ps(s0, e);
        } else {
            s1 = _mm512_add_ps(s1, e);
        }
        store_components(
            e,
            hi.add(i),
            if HI_ONLY { std::ptr::null_mut() } else { lo.add(i) },
        );
        i += 16;
    }
    (s0, s1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `softmax_row_bf16` against f64 on rows of 1, 3, 4 and 16 chunks (the 32-key steps
    /// of the all-visible pass and their 16-key tail), all visible or a part, a row's
    /// first block (`m_old = −inf`) or a later one, with one or two bf16 components, on
    /// rows that keep the reference and rows that force a redo: a score more than
    /// `LAZY_RESCALE_LOG2` above the first 16 keys' maximum (the provisional reference of
    /// an all-visible first block) or above `m_old`, and a first chunk of `−inf` (an
    /// additive mask) that leaves no provisional reference. Checks the reference
    /// (`max − 8 ≤ m_new ≤ max` for a first block), `alpha`, every probability
    /// component (0 outside `[a, z)`), and the lane-wise sums.
    #[test]
    fn softmax_row_bf16_matches_f64() {
        if !(is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512dq")
            && is_x86_feature_detected!("avx512bf16"))
        {
            eprintln!("note: no AVX-512F/DQ/BF16 on this machine; softmax_row_bf16 not exercised");
            return;
        }
        let c = 0.18f32;
        let bf = |v: u16| half::bf16::from_bits(v).to_f64();
        for w in [16usize, 48, 64, 256] {
            for kind in 0..5 {
                let mut x: Vec<f32> = (0..w).map(|i| ((i * 37 + 11) % 53) as f32 / 4.0 - 6.0).collect();
                match kind {
                    // Many keys close to 2^8 above the reference but none past it: lane
                    // sums above `LAZY_SUM_BOUND` with no redo due (c·x in 5.4..6.5 past
                    // the first 16 keys, in −1.5..−0.3 on them).
                    4 => {
                        for (i, v) in x.iter_mut().enumerate() {
                            *v = 30.0 + (i % 7) as f32 - if i < 16 { 38.0 } else { 0.0 };
                        }
                    }
                    // A score far above the rest (c·150 = 27 against at most 1.4),
                    // after the first 16 keys.
                    1 => x[w - 1] = 150.0,
                    // The spike inside the first 16 keys.
                    2 => x[5] = 150.0,
                    // The first chunk masked out additively.
                    3 => x[..16].fill(f32::NEG_INFINITY),
                    _ => {}
                }
                let ranges = [(0, w), (3, w - 2), (w / 2, w)];
                for (a, z) in ranges {
                    for m_old in [f32::NEG_INFINITY, 1.0, -30.0] {
                        for two in [false, true] {
                            let vis: Vec<f64> = (a..z).map(|i| c as f64 * x[i] as f64).collect();
                            let vmax = vis.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                            let mut hi = vec![0xffffu16; w];
                            let mut lo = vec![0xffffu16; w];
                            let l_old = 0.5f32;
                            let mut l16 = [l_old / 16.0; 16];
                            let lo_p = if two {
                                lo.as_mut_ptr()
                            } else {
                                std::ptr::null_mut()
                            };
                            // SAFETY: features checked above; `hi` and `lo` hold `w` elements.
                            let (m_new, alpha) = unsafe {
                                softmax_row_bf16(&x, (a, z), c, m_old, (hi.as_mut_ptr(), lo_p), &mut l16)
                            };
                            let what = format!("w {w} kind {kind} [{a}, {z}) m_old {m_old} two {two}");
                            if vmax == f64::NEG_INFINITY {
                                // No finite score: the reference stays, every p is 0.
                                assert_eq!((m_new, alpha), (m_old, 1.0), "{what}");
                                assert!(hi.iter().all(|&h| h == 0), "{what}");
                                let l: f32 = l16.iter().sum();
                                assert!((l - l_old).abs() <= 1e-6, "{what}: l {l}");
                                continue;
                            }
                            let m = m_new as f64;
                            // The reference the pass starts from: `m_old`, or for a first
                            // block the maximum of the visible keys in the chunk of key `a`
                            // (in f32, as the kernel takes it).
                            let m_start = if m_old > f32::NEG_INFINITY {
                                m_old
                            } else {
                                let a16 = a / 16 * 16;
                                (a..z.min(a16 + 16))
                                    .map(|i| x[i] * c)
                                    .fold(f32::NEG_INFINITY, f32::max)
                            };
                            // No visible key more than 8 above it: it stays, with no redo.
                            if m_start.is_finite() && vmax - (m_start as f64) < 8.0 - 1e-3 {
                                assert_eq!(m_new, m_start, "{what}: reference moved");
                            }
                            if m_old == f32::NEG_INFINITY {
                                assert!(
                                    m >= vmax - 8.0 - 1e-4 && m <= vmax + 1e-4,
                                    "{what}: m_new {m} max {vmax}"
                                );
                                assert_eq!(alpha, 1.0, "{what}");
                            } else {
                                assert!(
                                    m >= m_old as f64 && m >= vmax - 8.0 - 1e-4,
                                    "{what}: m_new {m} max {vmax}"
                                );
                                // `alpha = 2^(m_old − m_new)` of the difference in f32,
                                // as the kernel takes it.
                                let want = ((m_old - m_new) as f64).exp2();
                                assert!(
                                    (alpha as f64 - want).abs() <= 1e-6 * want.max(1e-30),
                                    "{what}: alpha {alpha} want {want}"
                                );
                            }
                            let mut sum = 0f64;
                            for i in 0..w {
                                let got = bf(hi[i]) + if two { bf(lo[i]) } else { 0.0 };
                                if i < a || i >= z {
                                    assert_eq!(got, 0.0, "{what}: key {i} outside");
                                    continue;
                                }
                                let p = (c as f64 * x[i] as f64 - m).exp2();
                                sum += p;
                                // Relative: the short polynomial (1.1e-4 or 3e-6), the rounding
                                // to bf16 components (half an ulp, at most 2⁻⁸ or 2⁻¹⁶ of the
                                // value) and `c·x − m` in f32 (|c·x| ≤ 27 here: 2e-6).
                                let tol = 2e-6
                                    + if two {
                                        3e-6 + 2f64.powi(-16)
                                    } else {
                                        1.1e-4 + 2f64.powi(-8)
                                    };
                                assert!(
                                    (got - p).abs() <= tol * p + 1e-37,
                                    "{what}: key {i} p {p} got {got}"
                                );
                            }
                            let l: f64 = l16.iter().map(|&v| v as f64).sum();
                            let want = alpha as f64 * l_old as f64 + sum;
                            assert!((l - want).abs() <= 2e-4 * want, "{what}: l {l} want {want}");
                        }
                    }
                }
            }
        }
    }

    /// Scores so large that an f32 ulp of them is thousands (`c·x` up to about 1e11): the
    /// reference is the rounded maximum, its key gets `p = 1` (to the polynomial's error),
    /// every other key 0, and nothing is infinite or NaN. For a row's first block (the
    /// spike in the first 16 keys or after them) and for later blocks whose maximum runs
    /// past a smaller reference, negative ones included (where the distance to the
    /// maximum exceeds the maximum itself). Before the reference became the rounded
    /// maximum itself, `2^(c·x − m)` of the largest key could reach `2^4096` (the exact
    /// product minus its own rounding), and a redo added the distance in rounded form;
    /// both gave NaN outputs in bf16 attention with scales of 1e10 and more.
    #[test]
    fn softmax_row_bf16_keeps_huge_scores_finite() {
        if !(is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512dq")
            && is_x86_feature_detected!("avx512bf16"))
        {
            eprintln!("note: no AVX-512F/DQ/BF16 on this machine; softmax_row_bf16 not exercised");
            return;
        }
        let c = 1.442_695e10f32;
        for spike in [3usize, 40] {
            for m_old in [f32::NEG_INFINITY, 1e9, 2.5e10, -1e11, -3.3e10, -1.234e11, -7.7e9] {
                for two in [false, true] {
                    // Distinct scores about 1.4e9 apart (log2 domain), the largest at `spike`.
                    let mut x: Vec<f32> = (0..64).map(|i| ((i * 37) % 64) as f32 * 0.1 - 3.3).collect();
                    x[spike] = 6.93;
                    let (mut hi, mut lo) = (vec![0u16; 64], vec![0u16; 64]);
                    let mut l16 = [0.25f32; 16];
                    let lo_p = if two {
                        lo.as_mut_ptr()
                    } else {
                        std::ptr::null_mut()
                    };
                    // SAFETY: features checked above; `hi` and `lo` hold 64 elements.
                    let (m_new, alpha) =
                        unsafe { softmax_row_bf16(&x, (0, 64), c, m_old, (hi.as_mut_ptr(), lo_p), &mut l16) };
                    let what = format!("spike {spike} m_old {m_old} two {two}");
                    let y_max = x.iter().map(|&v| v * c).fold(f32::NEG_INFINITY, f32::max);
                    assert_eq!(m_new, y_max, "{what}: the reference is the rounded maximum");
                    let want_alpha = if m_old == f32::NEG_INFINITY { 1.0 } else { 0.0 };
                    assert_eq!(alpha, want_alpha, "{what}");
                    // The short polynomials' error at `2^0` (as in the test above), and the
                    // rounding to bf16 components.
                    let tol = if two {
                        3e-6 + 2f64.powi(-16)
                    } else {
                        1.1e-4 + 2f64.powi(-8)
                    };
                    for i in 0..64 {
                        let got = half::bf16::from_bits(hi[i]).to_f64()
                            + if two {
                                half::bf16::from_bits(lo[i]).to_f64()
                            } else {
                                0.0
                            };
                        if i == spike {
                            assert!((got - 1.0).abs() <= tol, "{what}: key {i} p {got}");
                        } else {
                            assert_eq!(got, 0.0, "{what}: key {i}");
                        }
                    }
                    let l: f64 = l16.iter().map(|&v| v as f64).sum();
                    let want_l = if m_old == f32::NEG_INFINITY {
                        4.0 + 1.0
                    } else {
                        1.0
                    };
                    assert!((l - want_l).abs() <= 1.1e-4, "{what}: row sum {l}");
                }
            }
        }
    }

    #[test]
    fn exp2_512_accuracy() {
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512dq")) {
            eprintln!("note: no AVX-512F/DQ on this machine; exp2_512 not exercised");
            return;
        }
        let mut worst = 0f64;
        let mut x = -125.0f32;
        while x < 125.0 {
            let xs: [f32; 16] = std::array::from_fn(|i| x + i as f32 / 16.0);
            let mut out = [0f32; 16];
            // SAFETY: AVX-512F and DQ detected above; arrays hold 16 lanes.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr(), exp2_512(_mm512_loadu_ps(xs.as_ptr()))) };
            for (a, o) in xs.iter().zip(out) {
                let r = (*a as f64).exp2();
                worst = worst.max(((o as f64) - r).abs() / r);
            }
            x += 1.0;
        }
        assert!(worst < 3e-7, "worst rel err {worst}");
        let mut special = [0f32; 16];
        special[..8].copy_from_slice(&[f32::NEG_INFINITY, -1e30, -127.0, -200.0, 0.0, f32::NAN, -0.0, 1.0]);
        let mut out = [0f32; 16];
        // SAFETY: as above.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), exp2_512(_mm512_loadu_ps(special.as_ptr()))) };
        assert_eq!(&out[..8], &[0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 2.0]);
    }

    /// A NaN score hides only its own key in `softmax_row_bf16`, also on the path that
    /// takes the block's maximum first (a first block whose first 16 keys show no finite
    /// score): a key 577 ahead of the others, in the same lane as the NaN one or not,
    /// gets `p = 1` and the others about 0. That path took `max(m, y)`, so a NaN in a
    /// later chunk replaced the lane's maximum; the large key then got `p = inf`.
    #[test]
    fn softmax_row_bf16_skips_nan_scores_in_its_maximum() {
        if !(is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512dq")
            && is_x86_feature_detected!("avx512bf16"))
        {
            eprintln!("note: no AVX-512F/DQ/BF16 on this machine; softmax_row_bf16 not exercised");
            return;
        }
        for hidden in [0, 16] {
            for (big, nan) in [(40, 56), (56, 40), (20, 52), (33, 49), (40, 24), (17, 18)] {
                let mut x = vec![0.01f32; 64];
                x[..hidden].fill(f32::NEG_INFINITY);
                x[big] = 577.0;
                x[nan] = f32::NAN;
                let (mut hi, mut lo) = (vec![0u16; 64], vec![0u16; 64]);
                let mut l16 = [0f32; 16];
                // SAFETY: features checked above; `hi` and `lo` hold 64 elements.
                let (m_new, _) = unsafe {
                    softmax_row_bf16(
                        &x,
                        (0, 64),
                        1.0,
                        f32::NEG_INFINITY,
                        (hi.as_mut_ptr(), lo.as_mut_ptr()),
                        &mut l16,
                    )
                };
                let what = format!("first {hidden} keys hidden, large key {big}, NaN key {nan}");
                assert_eq!(m_new, 577.0, "{what}");
                let p =
                    |i: usize| half::bf16::from_bits(hi[i]).to_f64() + half::bf16::from_bits(lo[i]).to_f64();
                assert!((p(big) - 1.0).abs() < 1e-5, "{what}: p {}", p(big));
                let sum: f64 = l16.iter().map(|&v| v as f64).sum();
                assert!((sum - 1.0).abs() < 1e-5, "{what}: sum {sum}");
            }
        }
    }
}
