//! Logit soft-capping (Gemma 2, Grok): `s ← cap · tanh(s / cap)`, applied to a block's
//! scores before the mask and the softmax.
//!
//! Scores are kept in the log2 domain (`log2 e` folded into the query scale), and
//! `log2e · cap · tanh(s / cap) = C · tanh(s' / C)` with `s' = s · log2 e` and
//! `C = cap · log2 e`, so the kernel caps its scores with `C` and the same formula.
//!
//! On x86-64 with AVX2+FMA, eight scores at a time: with `y = s' / C`,
//! `tanh |y| = (1 − t) / (1 + t)` for `t = 2^(−2·log2(e)·|y|)` (`exp::avx2::exp2_256`,
//! relative error 1.2e-7), and below `|y| = 0.3`, where `1 − t` would cancel, the odd
//! Taylor polynomial to `y^11` (truncation error below 6e-8 relative). The sign is
//! restored afterwards; NaN stays NaN. With AVX-512, the same formula sixteen scores at
//! a time, with `t` from the near-minimax polynomial of `exp::MINIMAX5` and `vscalefps`,
//! and the quotient from `vrcp14ps`, one Newton step and one correction of the quotient
//! instead of a division (which was most of the AVX2 loop's time on Zen 4). Elsewhere
//! `f32::tanh`.
use super::isa::Isa;

/// Caps every score of `xs` (log2 domain) at `±c`: `x ← c · tanh(x / c)`, `c > 0`.
pub(crate) fn cap_scores(isa: Isa, xs: &mut [f32], c: f32) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: `Isa::Avx512` is only selected after detecting AVX-512F and DQ.
        unsafe { avx512::cap_scores(xs, c) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2Fma {
        // SAFETY: `Isa::Avx2Fma` is only selected after detecting AVX2 and FMA.
        unsafe { avx2::cap_scores(xs, c) };
        return;
    }
    let _ = isa;
    let inv = 1.0 / c;
    for x in xs {
        *x = c * (*x * inv).tanh();
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::exp::avx2::exp2_256;
    use std::arch::x86_64::*;

    /// Below this `|y|`, `tanh y` comes from its Taylor polynomial.
    const SMALL: f32 = 0.3;
    /// `tanh y = y · (1 + y²·(T[0] + y²·(T[1] + …)))`: the Taylor coefficients of
    /// `y^3 … y^11` over `y`.
    pub(super) const T: [f32; 5] = [
        -1.0 / 3.0,
        2.0 / 15.0,
        -17.0 / 315.0,
        62.0 / 2835.0,
        -1382.0 / 155_925.0,
    ];

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn cap_scores(xs: &mut [f32], c: f32) {
        let n8 = xs.len() / 8 * 8;
        let p = xs.as_mut_ptr();
        let mut i = 0;
        while i < n8 {
            // SAFETY: `i + 8 ≤ n8 ≤ xs.len()`.
            let x = unsafe { _mm256_loadu_ps(p.add(i)) };
            unsafe { _mm256_storeu_ps(p.add(i), cap8(x, c)) };
            i += 8;
        }
        if n8 < xs.len() {
            let mut tail = [0f32; 8];
            let rest = xs.len() - n8;
            tail[..rest].copy_from_slice(&xs[n8..]);
            // SAFETY: `tail` holds 8 floats.
            let y = unsafe { cap8(_mm256_loadu_ps(tail.as_ptr()), c) };
            unsafe { _mm256_storeu_ps(tail.as_mut_ptr(), y) };
            xs[n8..].copy_from_slice(&tail[..rest]);
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn cap8(x: __m256, c: f32) -> __m256 {
        let sign = _mm256_set1_ps(-0.0);
        let y = _mm256_mul_ps(x, _mm256_set1_ps(1.0 / c));
        let ay = _mm256_andnot_ps(sign, y);
        // |y| ≥ SMALL: (1 − t) / (1 + t), t = e^(−2|y|) (0 for |y| past about 44).
        let t = exp2_256(_mm256_mul_ps(ay, _mm256_set1_ps(-2.0 * std::f32::consts::LOG2_E)));
        let one = _mm256_set1_ps(1.0);
        let big = _mm256_div_ps(_mm256_sub_ps(one, t), _mm256_add_ps(one, t));
        // |y| < SMALL: the odd polynomial.
        let y2 = _mm256_mul_ps(ay, ay);
        let mut q = _mm256_set1_ps(T[4]);
        for &k in T[..4].iter().rev() {
            q = _mm256_fmadd_ps(q, y2, _mm256_set1_ps(k));
        }
        let small = _mm256_fmadd_ps(_mm256_mul_ps(q, y2), ay, ay);
        let is_small = _mm256_cmp_ps::<_CMP_LT_OQ>(ay, _mm256_set1_ps(SMALL));
        let th = _mm256_blendv_ps(big, small, is_small);
        // Restore the sign, scale by c, and keep NaN as NaN. The NaN lanes take `y`, not
        // `x`: blending with the loaded `x` let the compiler store through `vmaskmovps`,
        // which is slow on AMD CPUs.
        let r = _mm256_mul_ps(_mm256_or_ps(th, _mm256_and_ps(y, sign)), _mm256_set1_ps(c));
        let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x);
        _mm256_blendv_ps(r, y, nan)
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::super::exp::MINIMAX5;
    use super::avx2::T;
    use std::arch::x86_64::*;

    /// Below this `|y|`, `tanh y` comes from the Taylor polynomial of [`T`] (truncation
    /// error below 6e-8 relative up to 0.4). Higher than AVX2's 0.3: the error of `t`
    /// (1.6e-7 here, from [`MINIMAX5`]) grows by `2t / (1 − t²)` in `(1 − t) / (1 + t)`,
    /// 1.57 at 0.3 and 1.13 at 0.4.
    const SMALL: f32 = 0.4;

    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn cap_scores(xs: &mut [f32], c: f32) {
        let p = xs.as_mut_ptr();
        let mut i = 0;
        while i < xs.len() {
            let rest = xs.len() - i;
            let k: __mmask16 = if rest >= 16 { 0xffff } else { (1u16 << rest) - 1 };
            // SAFETY: the lanes of `k` are `i..i + min(16, rest)`, all inside `xs`.
            let x = unsafe { _mm512_maskz_loadu_ps(k, p.add(i)) };
            unsafe { _mm512_mask_storeu_ps(p.add(i), k, cap16(x, c)) };
            i += 16;
        }
    }

    /// `c · tanh(x / c)` on 16 lanes.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn cap16(x: __m512, c: f32) -> __m512 {
        let y = _mm512_mul_ps(x, _mm512_set1_ps(1.0 / c));
        let ay = _mm512_abs_ps(y);
        // t = 2^z, z = −2·log2(e)·|y| ≤ 0, clamped at −127 (a t of at most 2^−127 leaves
        // tanh at 1; NaN lanes are put back at the end): z = n + f with n = round(z).
        let z = _mm512_max_ps(
            _mm512_mul_ps(ay, _mm512_set1_ps(-2.0 * std::f32::consts::LOG2_E)),
            _mm512_set1_ps(-127.0),
        );
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(z);
        let f = _mm512_sub_ps(z, n);
        let mut e = _mm512_set1_ps(MINIMAX5[4]);
        for &k in MINIMAX5[..4].iter().rev() {
            e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(k));
        }
        e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(1.0));
        let t = _mm512_scalef_ps(e, n);
        // |y| ≥ SMALL: (1 − t) / (1 + t), 1 + t in [1, 2]. r ≈ 1 / (1 + t) to 14 bits,
        // one Newton step to about 28, then the quotient's residual corrects q.
        let one = _mm512_set1_ps(1.0);
        let num = _mm512_sub_ps(one, t);
        let den = _mm512_add_ps(one, t);
        let mut r = _mm512_rcp14_ps(den);
        r = _mm512_fmadd_ps(r, _mm512_fnmadd_ps(den, r, one), r);
        let q = _mm512_mul_ps(num, r);
        let big = _mm512_fmadd_ps(_mm512_fnmadd_ps(q, den, num), r, q);
        // |y| < SMALL: the odd polynomial.
        let y2 = _mm512_mul_ps(ay, ay);
        let mut s = _mm512_set1_ps(T[4]);
        for &k in T[..4].iter().rev() {
            s = _mm512_fmadd_ps(s, y2, _mm512_set1_ps(k));
        }
        let small = _mm512_fmadd_ps(_mm512_mul_ps(s, y2), ay, ay);
        let is_small = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(ay, _mm512_set1_ps(SMALL));
        let th = _mm512_mask_blend_ps(is_small, big, small);
        // Restore the sign (that of y), scale by c, and keep NaN as NaN.
        let sign = _mm512_set1_epi32(i32::MIN);
        let signed = _mm512_castsi512_ps(_mm512_or_si512(
            _mm512_castps_si512(th),
            _mm512_and_si512(_mm512_castps_si512(y), sign),
        ));
        let r = _mm512_mul_ps(signed, _mm512_set1_ps(c));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(y, y);
        _mm512_mask_blend_ps(nan, r, y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every instruction set this machine runs against `c · tanh(x / c)` in f64, over
    /// scores from 1e-6 to far past the cap, both signs, ±inf and NaN, and lengths that
    /// leave tails of every size below 16.
    #[test]
    fn capped_scores_match_f64_tanh() {
        let c = 50.0 * std::f32::consts::LOG2_E;
        let mut xs: Vec<f32> = Vec::new();
        let mut v = 1e-6f32;
        while v < 1e4 {
            xs.extend([v, -v]);
            v *= 1.07;
        }
        // Densely around the switches to the Taylor polynomial (|y| = 0.3 on AVX2, 0.4 on
        // AVX-512), where `1 − t` loses the most bits.
        for i in 0..2000 {
            let v = c * (0.25 + i as f32 * 2.5e-4);
            xs.extend([v, -v]);
        }
        xs.extend([
            0.0,
            -0.0,
            0.3 * c,
            -0.3 * c,
            0.2999 * c,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ]);
        let isas = [Isa::Portable, Isa::Avx2Fma, Isa::Neon, Isa::Avx512];
        for isa in isas.into_iter().filter(|i| i.is_supported()) {
            let mut worst = (0f64, 0f32);
            for len in (xs.len() - 16..=xs.len()).rev() {
                let mut got = xs[..len].to_vec();
                got.push(f32::NAN);
                cap_scores(isa, &mut got, c);
                assert!(got.pop().is_some_and(f32::is_nan), "{isa:?}: NaN must stay NaN");
                for (&x, &g) in xs.iter().zip(&got) {
                    let want = c as f64 * (x as f64 / c as f64).tanh();
                    let err = (g as f64 - want).abs();
                    if err / (want.abs() + 1e-30) > worst.0 {
                        worst = (err / (want.abs() + 1e-30), x / c);
                    }
                    assert!(
                        err <= 3e-7 * want.abs() + 1e-12,
                        "{isa:?}: x = {x}: {g} against {want} (error {err:e})"
                    );
                }
            }
            eprintln!(
                "{isa:?}: worst relative error {:.3e} at x / c = {}",
                worst.0, worst.1
            );
        }
    }
}
