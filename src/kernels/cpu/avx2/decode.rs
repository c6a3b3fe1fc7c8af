//! The AVX2 decode kernels: scores and `P·V` against K/V rows read in place (f32, or
//! f16/bf16 widened in registers), for the few query rows of a decode step.

use super::*;

/// See [`super::super::portable::qk_dot`]: scores against row-major keys (decode path), for
/// the first `live` of `rows` rows (the others are not written). `rows` must be a
/// multiple of [`MR`] and `e` a multiple of 8. `k` holds f32, bf16 or f16 rows (half
/// precision is read in place and widened in registers).
///
/// # Safety
/// AVX2, FMA and F16C must be available.
#[allow(clippy::too_many_arguments)]
pub(in crate::kernels::cpu) unsafe fn qk_dot(
    q: &[f32],
    rows: usize,
    live: usize,
    e: usize,
    k: Data,
    ldk: usize,
    nk: usize,
    s: &mut [f32],
    lds: usize,
) {
    let (kp, len, kind) = rows_of(k);
    assert!(
        rows.is_multiple_of(MR) && live <= rows && e.is_multiple_of(8) && lds >= nk && q.len() >= rows * e
    );
    assert!(nk == 0 || len >= (nk - 1) * ldk + e);
    assert!(rows == 0 || s.len() >= (rows - 1) * lds + nk);
    let (q, s) = (q.as_ptr(), s.as_mut_ptr());
    // SAFETY: bounds asserted above; features guaranteed by the caller.
    unsafe {
        match kind {
            F32 => qk_dot_impl::<F32>(q, live, e, kp, ldk, nk, s, lds),
            BF16 => qk_dot_impl::<BF16>(q, live, e, kp, ldk, nk, s, lds),
            _ => qk_dot_impl::<F16>(q, live, e, kp, ldk, nk, s, lds),
        }
    }
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn qk_dot_impl<const T: u8>(
    q: *const f32,
    live: usize,
    e: usize,
    k: *const u8,
    ldk: usize,
    nk: usize,
    s: *mut f32,
    lds: usize,
) {
    // Strips of up to `MR` live rows; padding rows are skipped (decode has few live
    // rows: one per query head of the group). The first strip asks for the K rows
    // `PF_KEYS` ahead, which are read once.
    let mut r0 = 0;
    while r0 < live {
        let r = (live - r0).min(MR);
        let (qs, sp, pf) = (q.add(r0 * e), s.add(r0 * lds), r0 == 0);
        match r {
            1 => qk_dot_strip::<T, 1, 4>(qs, e, k, ldk, nk, sp, lds, pf),
            2 => qk_dot_strip::<T, 2, 4>(qs, e, k, ldk, nk, sp, lds, pf),
            3 => qk_dot_strip::<T, 3, 4>(qs, e, k, ldk, nk, sp, lds, pf),
            4 => qk_dot_strip::<T, 4, 2>(qs, e, k, ldk, nk, sp, lds, pf),
            5 => qk_dot_strip::<T, 5, 2>(qs, e, k, ldk, nk, sp, lds, pf),
            _ => qk_dot_strip::<T, 6, 2>(qs, e, k, ldk, nk, sp, lds, pf),
        }
        r0 += r;
    }
}

/// Scores of `R` row-major Q rows against `NK` keys of kind `T` per pass (`R·NK ≤ 12`
/// accumulators).
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn qk_dot_strip<const T: u8, const R: usize, const NK: usize>(
    qs: *const f32,
    e: usize,
    k: *const u8,
    ldk: usize,
    nk: usize,
    s: *mut f32,
    lds: usize,
    pf: bool,
) {
    let size = if T == F32 { 4 } else { 2 };
    let mut j = 0;
    while j < nk {
        let t = (nk - j).min(NK);
        // (At a tail, the missing keys repeat the last one and are not stored.)
        let mut kp = [0usize; NK];
        for (c, p) in kp.iter_mut().enumerate() {
            *p = (j + c.min(t - 1)) * ldk;
            if pf && c < t {
                prefetch_bytes(k.wrapping_add((*p + PF_KEYS * ldk) * size), e * size);
            }
        }
        let mut acc = [[_mm256_setzero_ps(); NK]; R];
        let mut x = 0;
        while x < e {
            let mut kv = [_mm256_setzero_ps(); NK];
            for c in 0..NK {
                kv[c] = load8::<T>(k, kp[c] + x);
            }
            for (r, ar) in acc.iter_mut().enumerate() {
                let a = _mm256_loadu_ps(qs.add(r * e + x));
                for c in 0..NK {
                    ar[c] = _mm256_fmadd_ps(a, kv[c], ar[c]);
                }
            }
            x += 8;
        }
        for (r, ar) in acc.iter().enumerate() {
            for (c, &v) in ar.iter().enumerate().take(t) {
                *s.add(r * lds + j + c) = hsum(v);
            }
        }
        j += t;
    }
}

/// Decode `O = alpha·O + P·V` for the first `live` rows, walking the V rows in key
/// order, four keys at a time, each over all `ncols` columns (a multiple of 8). `p`: row
/// stride `ldp ≥ nk`; V row `j` at element `j * ldv` of `v` (f32, or half precision read in
/// place and widened in registers); `o`: row stride `ldo`. Reading each streamed V row
/// to its end before the next keeps DRAM reads sequential, where the panel kernel
/// [`pv`] reads 16 columns of every row per pass. With four keys, the rows go in pairs,
/// so each V vector is loaded and widened once per two rows (a GQA group's rows share
/// the V rows).
///
/// # Safety
/// AVX2, FMA and F16C must be available.
#[allow(clippy::too_many_arguments)]
pub(in crate::kernels::cpu) unsafe fn pv_rows(
    (p, ldp): (&[f32], usize),
    live: usize,
    nk: usize,
    v: Data,
    ldv: usize,
    ncols: usize,
    o: &mut [f32],
    ldo: usize,
    alpha: &[f32],
) {
    let (vp, len, kind) = rows_of(v);
    assert!(ldp >= nk && ncols.is_multiple_of(8) && ldo >= ncols && alpha.len() >= live);
    assert!(live == 0 || p.len() >= (live - 1) * ldp + nk);
    assert!(nk == 0 || ncols == 0 || len >= (nk - 1) * ldv + ncols);
    assert!(live == 0 || o.len() >= (live - 1) * ldo + ncols);
    let (p, o) = (p.as_ptr(), o.as_mut_ptr());
    // SAFETY: bounds asserted above; features guaranteed by the caller.
    unsafe {
        match kind {
            F32 => pv_rows_impl::<F32>((p, ldp), live, nk, vp, ldv, ncols, o, ldo, alpha),
            BF16 => pv_rows_impl::<BF16>((p, ldp), live, nk, vp, ldv, ncols, o, ldo, alpha),
            _ => pv_rows_impl::<F16>((p, ldp), live, nk, vp, ldv, ncols, o, ldo, alpha),
        }
    }
}

/// Four keys' V vectors: 8 elements at element `at` of `v`, then of the next three rows
/// (row stride `ldv`), widened to f32.
///
/// # Safety
/// AVX2 and F16C must be available; the four rows must hold 8 elements at `at`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn v4<const T: u8>(v: *const u8, at: usize, ldv: usize) -> [__m256; 4] {
    // (No `map` closure: closures do not inherit `target_feature`.)
    [
        load8::<T>(v, at),
        load8::<T>(v, at + ldv),
        load8::<T>(v, at + 2 * ldv),
        load8::<T>(v, at + 3 * ldv),
    ]
}

/// Four probabilities from `p`, each broadcast to 8 lanes.
///
/// # Safety
/// AVX must be available; `p` must hold 4 floats.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn p4(p: *const f32) -> [__m256; 4] {
    [
        _mm256_broadcast_ss(&*p),
        _mm256_broadcast_ss(&*p.add(1)),
        _mm256_broadcast_ss(&*p.add(2)),
        _mm256_broadcast_ss(&*p.add(3)),
    ]
}

/// `*o += p[0]·v[0] + p[1]·v[1] + p[2]·v[2] + p[3]·v[3]` on 8 lanes, as four fused
/// multiply-adds in that order.
///
/// # Safety
/// AVX2 and FMA must be available; `o` must hold 8 floats.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn madd4(o: *mut f32, p: &[__m256; 4], v: &[__m256; 4]) {
    let mut acc = _mm256_loadu_ps(o);
    for (&pi, &vi) in p.iter().zip(v) {
        acc = _mm256_fmadd_ps(pi, vi, acc);
    }
    _mm256_storeu_ps(o, acc);
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pv_rows_impl<const T: u8>(
    (p, ldp): (*const f32, usize),
    live: usize,
    nk: usize,
    v: *const u8,
    ldv: usize,
    ncols: usize,
    o: *mut f32,
    ldo: usize,
    alpha: &[f32],
) {
    for (r, &a) in alpha.iter().enumerate().take(live) {
        if a != 1.0 {
            let av = _mm256_set1_ps(a);
            let orow = o.add(r * ldo);
            for c in (0..ncols).step_by(8) {
                _mm256_storeu_ps(orow.add(c), _mm256_mul_ps(av, _mm256_loadu_ps(orow.add(c))));
            }
        }
    }
    let size = if T == F32 { 4 } else { 2 };
    let mut j = 0;
    while j < nk {
        let t = (nk - j).min(4);
        for jj in 0..t {
            prefetch_bytes(v.wrapping_add((j + jj + PF_KEYS) * ldv * size), ncols * size);
        }
        let vr = j * ldv;
        let mut r = 0;
        if t == 4 {
            // Two rows at a time: each V vector is loaded (and widened) once for both.
            while r + 2 <= live {
                let (a, b) = (p4(p.add(r * ldp + j)), p4(p.add((r + 1) * ldp + j)));
                let (oa, ob) = (o.add(r * ldo), o.add((r + 1) * ldo));
                for c in (0..ncols).step_by(8) {
                    let vs = v4::<T>(v, vr + c, ldv);
                    madd4(oa.add(c), &a, &vs);
                    madd4(ob.add(c), &b, &vs);
                }
                r += 2;
            }
        }
        for r in r..live {
            let orow = o.add(r * ldo);
            if t == 4 {
                let pr = p4(p.add(r * ldp + j));
                for c in (0..ncols).step_by(8) {
                    madd4(orow.add(c), &pr, &v4::<T>(v, vr + c, ldv));
                }
            } else {
                for jj in 0..t {
                    let pj = _mm256_broadcast_ss(&*p.add(r * ldp + j + jj));
                    for c in (0..ncols).step_by(8) {
                        let vj = load8::<T>(v, vr + jj * ldv + c);
                        _mm256_storeu_ps(orow.add(c), _mm256_fmadd_ps(pj, vj, _mm256_loadu_ps(orow.add(c))));
                    }
                }
            }
        }
        j += t;
    }
}
