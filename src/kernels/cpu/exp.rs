//! Base-2 exponentials for the softmax.
//!
//! Scores are kept in the log2 domain (`log2(e)` is folded into the query scale and
//! applied to the additive mask), so the softmax needs `2^x` only. The AVX2 version
//! splits `x = n + f` (`n = round(x)`, `|f| <= 1/2`), evaluates the degree-6 Taylor
//! polynomial of `2^f = e^(f ln 2)` (truncation error < 1.2e-7 relative) and builds
//! `2^n` in the exponent bits. Inputs below -126 (including -inf) give exactly 0,
//! NaN gives 0. The softmax's `2^x` for `x ≤ 0` (`avx2::exp2_256_nonpos`) uses a
//! degree-5 near-minimax polynomial instead, as accurate in f32 and one step shorter.
//! The portable and NEON kernels' softmax runs the same steps in plain arithmetic
//! ([`exp2_nonpos`]), which the compiler vectorises.

/// Scalar `2^x`, used for per-row rescale factors and split-K merges.
#[inline]
pub(crate) fn exp2_scalar(x: f32) -> f32 {
    x.exp2()
}

/// Coefficients `c1..c5` of `2^f ≈ 1 + c1·f + … + c5·f^5` on `|f| ≤ 1/2`: the
/// near-minimax fit of the relative error (the constant term held at exactly 1),
/// printed by `scripts/fit_exp2.py`. Relative error of the fit 9.1e-8; evaluated in
/// f32 by Horner's rule with fused multiply-adds, 1.6e-7 (the degree-6 Taylor polynomial
/// of `avx2::exp2_256` reaches 2.2e-7 in f32). `c1` is the fitted value, 1.8e-7 below
/// `ln 2`.
#[allow(clippy::approx_constant)]
pub(crate) const MINIMAX5: [f32; 5] = [
    0.693_147,
    0.240_222_42,
    5.550_733_6e-2,
    9.671_513e-3,
    1.326_472_7e-3,
];

/// `a·b + c`: fused where the target has fused multiply-adds in its baseline (AArch64),
/// else a multiply and an add (a fused `mul_add` without hardware support is a libm
/// call, which also stops the loop from being vectorised).
#[inline(always)]
fn madd(a: f32, b: f32, c: f32) -> f32 {
    if cfg!(target_arch = "aarch64") {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// `2^x` for `x ≤ 0` (and −inf), the steps of `avx2::exp2_256_nonpos` in plain
/// arithmetic, with no branch and no call, so that a loop over it is vectorised (SSE2 on
/// x86-64's baseline, NEON on AArch64). One clamp at −127 is the only one: −inf and NaN
/// (which fails the comparison) become −127, whose `2^n` has a zero exponent field, so
/// every input below −126.5 gives exactly 0. `n = round(x)` (to nearest even, by adding
/// and subtracting `1.5·2^23`), `f = x − n`, the degree-5 polynomial [`MINIMAX5`] for
/// `2^f`, and `2^n` from `n + 127` shifted into the exponent bits (`n` is the low bits of
/// `x + 1.5·2^23`). Inputs above 0 are wrong (callers never pass them).
#[inline(always)]
pub(crate) fn exp2_nonpos(x: f32) -> f32 {
    // 1.5 · 2^23
    const SHIFT: f32 = 12_582_912.0;
    // The clamp; NaN fails the comparison and takes −127 too (one `maxps` on x86-64).
    let x = if x > -127.0 { x } else { -127.0 };
    let t = x + SHIFT;
    let f = x - (t - SHIFT);
    let c = MINIMAX5;
    let y = madd(
        madd(madd(madd(madd(c[4], f, c[3]), f, c[2]), f, c[1]), f, c[0]),
        f,
        1.0,
    );
    // `t` lies in [2^23, 2^24), where consecutive integers are consecutive bit patterns.
    let pow2n = f32::from_bits(t.to_bits().wrapping_sub(SHIFT.to_bits()).wrapping_add(127) << 23);
    y * pow2n
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Worst relative error against f64 of a `2^x` for `x ≤ 0` given eight lanes at a
    /// time: eight points in each step of 0.0137 from −125 to 0.
    pub(super) fn nonpos_worst_rel_err(mut f: impl FnMut([f32; 8]) -> [f32; 8]) -> f64 {
        let mut worst = 0f64;
        let mut x = -125.0f32;
        while x <= 0.0 {
            let xs = [0.0, 0.001, 0.37, 0.5, 0.61, 0.77, 0.9, 0.999].map(|d| (x + d).min(0.0));
            for (a, o) in xs.iter().zip(f(xs)) {
                let r = (*a as f64).exp2();
                worst = worst.max(((o as f64) - r).abs() / r);
            }
            x += 0.0137;
        }
        worst
    }

    /// Special inputs of a `2^x` for `x ≤ 0`, and what it must give for them.
    pub(super) const NONPOS_SPECIAL: ([f32; 8], [f32; 8]) = (
        [
            f32::NEG_INFINITY,
            -1e30,
            -127.0,
            -200.0,
            0.0,
            f32::NAN,
            -0.0,
            -1.0,
        ],
        [0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.5],
    );

    /// The portable exponential against f64 on `[−125, 0]`, and its special inputs.
    #[test]
    fn exp2_nonpos_accuracy() {
        let worst = nonpos_worst_rel_err(|x| x.map(exp2_nonpos));
        assert!(worst < 2e-7, "worst rel err {worst}");
        assert_eq!(NONPOS_SPECIAL.0.map(exp2_nonpos), NONPOS_SPECIAL.1);
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::MINIMAX5;
    use std::arch::x86_64::*;

    /// 8-lane `2^x`.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn exp2_256(x: __m256) -> __m256 {
        let lo = _mm256_set1_ps(-126.0);
        let valid = _mm256_cmp_ps::<_CMP_GE_OQ>(x, lo);
        let xc = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(127.0)), lo);
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(xc);
        let f = _mm256_sub_ps(xc, n);
        let mut y = _mm256_set1_ps(1.540_353_e-4);
        y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.333_355_8e-3));
        y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(9.618_129e-3));
        y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(5.550_411e-2));
        y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(0.240_226_5));
        y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(std::f32::consts::LN_2));
        y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.0));
        let pow2n = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        )));
        _mm256_and_ps(_mm256_mul_ps(y, pow2n), valid)
    }

    /// 8-lane `2^x` for `x ≤ 0` (and −inf), as the softmax needs after subtracting the
    /// maximum: 12 instructions where [`exp2_256`] takes 16, and a shorter dependency
    /// chain, which is what limits it (the softmax keeps too few exponentials in flight
    /// to fill the pipes). One `max` with −127 is the only clamp: it maps −inf and NaN to
    /// −127, whose `2^n` has a zero exponent field, so every input below −126.5 gives
    /// exactly 0. `n = round(x)`, `f = x − n`, a degree-5 polynomial for `2^f`
    /// ([`MINIMAX5`]), and `2^n` from the integer `n + 127` shifted into the exponent.
    /// Lanes with `x > 0` are wrong (callers never pass them).
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn exp2_256_nonpos(x: __m256) -> __m256 {
        // `max` returns its second operand when the first is NaN.
        let x = _mm256_max_ps(x, _mm256_set1_ps(-127.0));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
        let f = _mm256_sub_ps(x, n);
        let c = MINIMAX5;
        let mut y = _mm256_set1_ps(c[4]);
        y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(c[3]));
        y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(c[2]));
        y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(c[1]));
        y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(c[0]));
        y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.0));
        let pow2n = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        )));
        _mm256_mul_ps(y, pow2n)
    }

    /// [`exp2_256_nonpos`] of `N` vectors, each step applied to all `N` before the next,
    /// so the independent chains are interleaved in program order.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn exp2_256_nonpos_n<const N: usize>(mut x: [__m256; N]) -> [__m256; N] {
        // Loops, not `map` closures: closures do not inherit `target_feature`.
        for v in x.iter_mut() {
            *v = _mm256_max_ps(*v, _mm256_set1_ps(-127.0));
        }
        let mut n = x;
        for v in n.iter_mut() {
            *v = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(*v);
        }
        let mut f = x;
        for i in 0..N {
            f[i] = _mm256_sub_ps(x[i], n[i]);
        }
        let c = MINIMAX5;
        let mut y = [_mm256_set1_ps(c[4]); N];
        for k in [c[3], c[2], c[1], c[0], 1.0] {
            for i in 0..N {
                y[i] = _mm256_fmadd_ps(y[i], f[i], _mm256_set1_ps(k));
            }
        }
        for i in 0..N {
            let pow2n = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
                _mm256_cvtps_epi32(n[i]),
                _mm256_set1_epi32(127),
            )));
            y[i] = _mm256_mul_ps(y[i], pow2n);
        }
        y
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn exp2_256_nonpos_accuracy() {
            if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
                return;
            }
            let lanes = |xs: [f32; 8]| {
                let mut out = [0f32; 8];
                // SAFETY: AVX2+FMA detected above; the arrays hold 8 lanes.
                unsafe { _mm256_storeu_ps(out.as_mut_ptr(), exp2_256_nonpos(_mm256_loadu_ps(xs.as_ptr()))) };
                out
            };
            let worst = super::super::tests::nonpos_worst_rel_err(lanes);
            assert!(worst < 2e-7, "worst rel err {worst}");
            let (special, expected) = super::super::tests::NONPOS_SPECIAL;
            assert_eq!(lanes(special), expected);
        }

        /// The interleaved form computes what [`exp2_256_nonpos`] does, bit for bit, in
        /// every vector of the group, on the accuracy sweep and the special inputs.
        #[test]
        fn exp2_256_nonpos_n_matches_one_at_a_time() {
            if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
                return;
            }
            // Groups of eight vectors: the special inputs, then seven vectors of the
            // accuracy sweep (which hands each of its vectors to this closure).
            let mut groups: Vec<[[f32; 8]; 8]> = Vec::new();
            let mut pending = Vec::new();
            super::super::tests::nonpos_worst_rel_err(|xs| {
                pending.push(xs);
                if pending.len() == 7 {
                    let mut g = [super::super::tests::NONPOS_SPECIAL.0; 8];
                    g[1..].copy_from_slice(&pending);
                    groups.push(g);
                    pending.clear();
                }
                xs
            });
            assert!(groups.len() > 1000);
            for g in groups {
                // SAFETY: AVX2+FMA detected above; each array holds 8 lanes.
                unsafe {
                    let x = g.map(|v| _mm256_loadu_ps(v.as_ptr()));
                    let y = exp2_256_nonpos_n(x);
                    for (xi, yi) in x.iter().zip(y) {
                        let (mut a, mut b) = ([0f32; 8], [0f32; 8]);
                        _mm256_storeu_ps(a.as_mut_ptr(), exp2_256_nonpos(*xi));
                        _mm256_storeu_ps(b.as_mut_ptr(), yi);
                        assert_eq!(a.map(f32::to_bits), b.map(f32::to_bits), "{:?}", g);
                    }
                }
            }
        }

        #[test]
        fn exp2_256_accuracy() {
            if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
                return;
            }
            let mut worst = 0f64;
            let mut x = -125.0f32;
            while x < 125.0 {
                let xs = [
                    x,
                    x + 0.001,
                    x + 0.37,
                    x + 0.5,
                    x + 0.61,
                    x + 0.77,
                    x + 0.9,
                    x + 0.999,
                ];
                let mut out = [0f32; 8];
                // SAFETY: AVX2+FMA detected above; arrays hold 8 lanes.
                unsafe {
                    let v = exp2_256(_mm256_loadu_ps(xs.as_ptr()));
                    _mm256_storeu_ps(out.as_mut_ptr(), v);
                }
                for (a, o) in xs.iter().zip(out) {
                    let r = (*a as f64).exp2();
                    let rel = ((o as f64) - r).abs() / r;
                    worst = worst.max(rel);
                }
                x += 0.25;
            }
            assert!(worst < 3e-7, "worst rel err {worst}");
            let special = [f32::NEG_INFINITY, -1e30, -127.0, -200.0, 0.0, f32::NAN, -0.0, 1.0];
            let mut out = [0f32; 8];
            // SAFETY: as above.
            unsafe {
                _mm256_storeu_ps(out.as_mut_ptr(), exp2_256(_mm256_loadu_ps(special.as_ptr())));
            }
            assert_eq!(&out[..4], &[0.0, 0.0, 0.0, 0.0]);
            assert_eq!(out[4], 1.0);
            assert_eq!(out[5], 0.0);
            assert_eq!(out[6], 1.0);
            assert_eq!(out[7], 2.0);
        }
    }
}
