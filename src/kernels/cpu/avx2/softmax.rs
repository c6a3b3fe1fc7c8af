//! The AVX2 softmax: one row at a time (`online_row`) and all rows of a block
//! (`online_rows_block`), each row in registers.

use super::*;

/// Row maximum (-inf for empty / all -inf rows), NaN scores skipped: each step takes
/// `max(x, m)`, which returns `m` where `x` is NaN.
#[target_feature(enable = "avx2,fma")]
unsafe fn row_max_impl(x: &[f32]) -> f32 {
    let n = x.len();
    let ptr = x.as_ptr();
    let mut m0 = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut m1 = m0;
    let mut j = 0;
    while j + 16 <= n {
        m0 = _mm256_max_ps(_mm256_loadu_ps(ptr.add(j)), m0);
        m1 = _mm256_max_ps(_mm256_loadu_ps(ptr.add(j + 8)), m1);
        j += 16;
    }
    if j + 8 <= n {
        m0 = _mm256_max_ps(_mm256_loadu_ps(ptr.add(j)), m0);
        j += 8;
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_max_ps(m0, m1));
    let mut r = f32::NEG_INFINITY;
    for &v in lanes.iter().chain(&x[j..]) {
        if v > r {
            r = v;
        }
    }
    r
}

/// `x[j] = 2^(x[j] - m)`; returns the sum.
#[target_feature(enable = "avx2,fma")]
unsafe fn exp2_sub_sum_impl(x: &mut [f32], m: f32) -> f32 {
    let n = x.len();
    let ptr = x.as_mut_ptr();
    let mv = _mm256_set1_ps(m);
    let mut s0 = _mm256_setzero_ps();
    let mut s1 = _mm256_setzero_ps();
    let mut j = 0;
    while j + 16 <= n {
        let a = exp2_256_nonpos(_mm256_sub_ps(_mm256_loadu_ps(ptr.add(j)), mv));
        let b = exp2_256_nonpos(_mm256_sub_ps(_mm256_loadu_ps(ptr.add(j + 8)), mv));
        _mm256_storeu_ps(ptr.add(j), a);
        _mm256_storeu_ps(ptr.add(j + 8), b);
        s0 = _mm256_add_ps(s0, a);
        s1 = _mm256_add_ps(s1, b);
        j += 16;
    }
    while j < n {
        let mut tail = [f32::NEG_INFINITY; 8];
        let t = (n - j).min(8);
        tail[..t].copy_from_slice(&x[j..j + t]);
        let a = exp2_256(_mm256_sub_ps(_mm256_loadu_ps(tail.as_ptr()), mv));
        _mm256_storeu_ps(tail.as_mut_ptr(), a);
        x[j..j + t].copy_from_slice(&tail[..t]);
        s0 = _mm256_add_ps(s0, a);
        j += t;
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(s0, s1));
    lanes.iter().sum()
}

/// One online-softmax row update: `m_new = max(m_old, max x)`, `x[j] = 2^(x[j] - m_new)`;
/// returns `(m_new, alpha = 2^(m_old - m_new), Σ x)`. When `m_new` is -inf, `x` is
/// left untouched and `(−inf, 1, 0)` is returned.
///
/// # Safety
/// AVX2 and FMA must be available.
pub(in crate::kernels::cpu) unsafe fn online_row(x: &mut [f32], m_old: f32) -> (f32, f32, f32) {
    // SAFETY: features guaranteed by the caller; all accesses are in bounds of `x`.
    unsafe { online_row_impl(x, m_old) }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn online_row_impl(x: &mut [f32], m_old: f32) -> (f32, f32, f32) {
    let bm = row_max_impl(x);
    let m_new = if bm > m_old { bm } else { m_old };
    if m_new == f32::NEG_INFINITY {
        return (m_new, 1.0, 0.0);
    }
    let alpha = if m_old == m_new {
        1.0
    } else {
        _mm_cvtss_f32(_mm256_castps256_ps128(exp2_256(_mm256_set1_ps(m_old - m_new))))
    };
    (m_new, alpha, exp2_sub_sum_impl(x, m_new))
}

/// Horizontal maximum of `x`, in every lane.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn hmax_all(x: __m256) -> __m256 {
    let a = _mm256_max_ps(x, _mm256_permute2f128_ps::<1>(x, x));
    let b = _mm256_max_ps(a, _mm256_shuffle_ps::<0b0100_1110>(a, a));
    _mm256_max_ps(b, _mm256_shuffle_ps::<0b1011_0001>(b, b))
}

/// The online-softmax update of `n` score rows of one block of at most [`BK`] keys
/// (row `r` at `s[r * lds..]`, `lds ≥ BK`), where row `r` sees keys `range(r) = (a, z)`,
/// `a ≤ z ≤ BK`. Per row, as [`online_row`] on `row[a..z]`: `m_new = max(m, max)`,
/// `row = 2^(row − m_new)`, `alpha = 2^(m − m_new)`, `l = l·alpha + Σ row`, `m = m_new`,
/// and the row's other keys below `nk` rounded up to 8 become 0 (keys from there up to
/// [`BK`] are left as they are). A row with no finite score becomes 0 with `alpha = 1`
/// and `m`, `l` unchanged. Each row is read in `nk.div_ceil(8)` vectors (one for a
/// block's tail of up to 8 keys, eight for a full block), with lanes outside its range
/// replaced by −inf, in two passes over all rows (maxima and `alpha`,
/// then probabilities and sums): one row's chain from its loads to its sum is longer than
/// the out-of-order window, so a single pass per row leaves the rows serialised. For the
/// same reason a row's exponentials (up to eight vectors) run interleaved, step by step
/// ([`exp2_256_nonpos_n`]), not one after the other.
///
/// # Safety
/// AVX2 and FMA must be available, and every `range(r)` must satisfy `a ≤ z ≤ nk ≤ BK`.
pub(in crate::kernels::cpu) unsafe fn online_rows_block(
    s: &mut [f32],
    (lds, n, nk): (usize, usize, usize),
    range: impl Fn(usize) -> (usize, usize),
    (m, l, alpha): (&mut [f32], &mut [f32], &mut [f32]),
) {
    assert!(nk <= BK && lds >= BK && m.len() >= n && l.len() >= n && alpha.len() >= n);
    assert!(n == 0 || s.len() >= (n - 1) * lds + BK);
    let sp = s.as_mut_ptr();
    let none = std::ptr::null();
    macro_rules! rows {
        ($v:literal) => {
            online_rows_block_inner::<false, $v>(sp, lds, n, range, none, (m, l, alpha))
        };
    }
    // SAFETY: bounds asserted above; features guaranteed by the caller.
    unsafe {
        match nk.div_ceil(8) {
            0 | 1 => rows!(1),
            2 => rows!(2),
            3 => rows!(3),
            4 => rows!(4),
            5 => rows!(5),
            6 => rows!(6),
            7 => rows!(7),
            _ => rows!(8),
        }
    }
}

/// The first `V` vectors of a row, −inf outside `[a, z)`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn load_row_ranged<const V: usize>(row: *const f32, (a, z): (usize, usize)) -> [__m256; V] {
    let mut x = [_mm256_setzero_ps(); V];
    for (i, xi) in x.iter_mut().enumerate() {
        *xi = _mm256_loadu_ps(row.add(8 * i));
    }
    if a > 0 || z < 8 * V {
        let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let (av, zv) = (_mm256_set1_epi32(a as i32 - 1), _mm256_set1_epi32(z as i32));
        let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
        for (i, xi) in x.iter_mut().enumerate() {
            let j = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * i as i32));
            // a ≤ j < z  ⇔  j > a − 1  and  z > j
            let vis = _mm256_and_si256(_mm256_cmpgt_epi32(j, av), _mm256_cmpgt_epi32(zv, j));
            *xi = _mm256_blendv_ps(ninf, *xi, _mm256_castsi256_ps(vis));
        }
    }
    x
}

/// `PRE`: the row maxima come from `pre`, 8 lane-wise maxima per row (from the score
/// tiles of [`super::qk_softmax`] on a row's first block). `V`: the
/// vectors of 8 keys read per row (`1..=BK / 8`).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn online_rows_block_inner<const PRE: bool, const V: usize>(
    s: *mut f32,
    lds: usize,
    n: usize,
    range: impl Fn(usize) -> (usize, usize),
    pre: *const f32,
    (m, l, alpha): (&mut [f32], &mut [f32], &mut [f32]),
) {
    const { assert!(V >= 1 && V <= BK / 8) };
    for r in 0..n {
        let mx = if PRE {
            _mm256_loadu_ps(pre.add(r * 8))
        } else {
            // Two running maxima over the row's vectors, each `max(x, m)`: `max` returns
            // its second operand where the first is NaN, so NaN scores are skipped and
            // a NaN key hides only itself. (A tree of `max(x[2i], x[2i + 1])` let a
            // NaN in one vector replace the lane's score in the other.)
            let x = load_row_ranged::<V>(s.add(r * lds), range(r));
            let mut t = [_mm256_set1_ps(f32::NEG_INFINITY); 2];
            for (i, &xi) in x.iter().enumerate() {
                t[i % 2] = _mm256_max_ps(xi, t[i % 2]);
            }
            _mm256_max_ps(t[0], t[1])
        };
        let m_old = m[r];
        let m_new = _mm_cvtss_f32(_mm256_castps256_ps128(_mm256_max_ps(
            hmax_all(mx),
            _mm256_set1_ps(m_old),
        )));
        alpha[r] = if m_old == m_new || m_new == f32::NEG_INFINITY {
            1.0
        } else {
            _mm_cvtss_f32(_mm256_castps256_ps128(exp2_256(_mm256_set1_ps(m_old - m_new))))
        };
        m[r] = m_new;
    }
    for r in 0..n {
        let row = s.add(r * lds);
        let m_new = m[r];
        if m_new == f32::NEG_INFINITY {
            for i in 0..V {
                _mm256_storeu_ps(row.add(8 * i), _mm256_setzero_ps());
            }
            continue;
        }
        let x = load_row_ranged::<V>(row, range(r));
        let mv = _mm256_set1_ps(m_new);
        let mut sum = [_mm256_setzero_ps(); 2];
        let mut d = x;
        for v in d.iter_mut() {
            *v = _mm256_sub_ps(*v, mv);
        }
        let p = exp2_256_nonpos_n(d);
        for (i, &pi) in p.iter().enumerate() {
            _mm256_storeu_ps(row.add(8 * i), pi);
            sum[i % 2] = _mm256_add_ps(sum[i % 2], pi);
        }
        l[r] = l[r] * alpha[r] + hsum(_mm256_add_ps(sum[0], sum[1]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `online_row` takes its maximum over the non-NaN scores, wherever the NaN sits
    /// (same lane of the other accumulator, a later vector of the same one, the tail):
    /// a key 577 ahead gets `p = 1` and the row sum is 1. With `max(m, x)` a NaN 16
    /// keys after the large key replaced it in the lane's maximum.
    #[test]
    fn online_row_skips_nan_scores_in_its_maximum() {
        if !super::super::super::Isa::Avx2Fma.is_supported() {
            return;
        }
        for n in [40, 64] {
            for (big, nan) in [(3, 19), (19, 3), (3, 11), (3, 35), (20, 36), (1, n - 1)] {
                let mut x = vec![0.01f32; n];
                x[big] = 577.0;
                x[nan] = f32::NAN;
                // SAFETY: AVX2 and FMA detected above.
                let (m, alpha, sum) = unsafe { online_row(&mut x, f32::NEG_INFINITY) };
                let what = format!("n {n}, large key {big}, NaN key {nan}");
                assert_eq!((m, alpha), (577.0, 0.0), "{what}");
                assert_eq!(x[big], 1.0, "{what}");
                assert!((sum - 1.0).abs() < 1e-6, "{what}: sum {sum}");
            }
        }
    }
}
