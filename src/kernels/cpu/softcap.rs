//! Logit soft-capping (Gemma 2, Grok): `s ← cap · tanh(s / cap)`, applied to a block's
//! scores before the mask and the softmax.
//!
//! Scores are kept in the log2 domain (`log2 e` folded into the query scale), and
//! `log2e · cap · tanh(s / cap) = C · tanh(s' / C)` with `s' = s · log2 e` and
//! `C = cap · log2 e`, so the kernel caps its scores with `C` and the same formula.
//!
//! On x86-64 with AVX2+FMA (also the AVX-512 path), eight scores at a time: with
//! `y = s' / C`, `tanh |y| = (1 − t) / (1 + t)` for `t = 2^(−2·log2(e)·|y|)`
//! (`exp::avx2::exp2_256`, relative error 1.2e-7), and below `|y| = 0.3`, where
//! `1 − t` would cancel, the odd Taylor polynomial to `y^11` (truncation error below
//! 6e-8 relative). The sign is restored afterwards; NaN stays NaN. Elsewhere `f32::tanh`.
use super::isa::Isa;

/// Caps every score of `xs` (log2 domain) at `±c`: `x ← c · tanh(x / c)`, `c > 0`.
pub(crate) fn cap_scores(isa: Isa, xs: &mut [f32], c: f32) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2Fma
        || isa == Isa::Avx512
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
    {
        // SAFETY: `Isa::Avx2Fma` is only selected after detecting AVX2 and FMA, and for
        // `Isa::Avx512` they are detected here (every AVX-512 CPU has them).
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
    const T: [f32; 5] = [
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
        // Restore the sign, scale by c, and keep NaN as NaN.
        let r = _mm256_mul_ps(_mm256_or_ps(th, _mm256_and_ps(y, sign)), _mm256_set1_ps(c));
        let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x);
        _mm256_blendv_ps(r, x, nan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every instruction set this machine runs against `c · tanh(x / c)` in f64, over
    /// scores from 1e-6 to far past the cap, both signs, ±inf and NaN, and lengths that
    /// leave tails.
    #[test]
    fn capped_scores_match_f64_tanh() {
        let c = 50.0 * std::f32::consts::LOG2_E;
        let mut xs: Vec<f32> = Vec::new();
        let mut v = 1e-6f32;
        while v < 1e4 {
            xs.extend([v, -v]);
            v *= 1.07;
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
        for isa in [Isa::Portable, Isa::detect()] {
            for len in [xs.len(), xs.len() - 3] {
                let mut got = xs[..len].to_vec();
                got.push(f32::NAN);
                cap_scores(isa, &mut got, c);
                assert!(got.pop().is_some_and(f32::is_nan), "{isa:?}: NaN must stay NaN");
                for (&x, &g) in xs.iter().zip(&got) {
                    let want = c as f64 * (x as f64 / c as f64).tanh();
                    let err = (g as f64 - want).abs();
                    assert!(
                        err <= 3e-7 * want.abs() + 1e-12,
                        "{isa:?}: x = {x}: {g} against {want} (error {err:e})"
                    );
                }
            }
        }
    }
}
