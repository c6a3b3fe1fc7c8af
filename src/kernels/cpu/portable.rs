//! Portable micro-kernels (safe Rust written so LLVM auto-vectorises the 16-lane loops).

use super::exp::{exp2_nonpos, exp2_scalar};
use super::tiles::{BK, MR, NR};

/// `s[r, p*NR + c] = sum_x q[r, x] * kp[p][x][c]` for all `rows` rows and `npanels` panels.
/// Q is strip-packed: `q[r, x] = q[(r / MR) * MR * e + x * MR + r % MR]`; `rows % MR == 0`.
/// Two rows per pass over a panel (`MR` is even): 32 accumulator lanes, so that the
/// additions into each lane are not one serial chain per panel row.
pub(super) fn qk(q: &[f32], rows: usize, e: usize, kp: &[f32], npanels: usize, s: &mut [f32], lds: usize) {
    const { assert!(MR.is_multiple_of(2)) };
    assert!(rows.is_multiple_of(MR));
    for p in 0..npanels {
        let panel = &kp[p * e * NR..(p + 1) * e * NR];
        for r in (0..rows).step_by(2) {
            let qs = &q[(r / MR) * MR * e..(r / MR + 1) * MR * e];
            let (mut a0, mut a1) = ([0f32; NR], [0f32; NR]);
            for (qx, kv) in qs.chunks_exact(MR).zip(panel.chunks_exact(NR)) {
                let (q0, q1) = (qx[r % MR], qx[r % MR + 1]);
                for c in 0..NR {
                    a0[c] += q0 * kv[c];
                    a1[c] += q1 * kv[c];
                }
            }
            s[r * lds + p * NR..r * lds + (p + 1) * NR].copy_from_slice(&a0);
            s[(r + 1) * lds + p * NR..(r + 1) * lds + (p + 1) * NR].copy_from_slice(&a1);
        }
    }
}

/// `o[r, n*NR + c] = alpha[r] * o[r, n*NR + c] + sum_{j < nk} p[r*BK + j] * vp[n*vps + j*ldv + c]`.
/// P is row-major with the fixed row stride [`BK`]; `rows % MR == 0`.
#[allow(clippy::too_many_arguments)]
pub(super) fn pv(
    p: &[f32],
    rows: usize,
    nk: usize,
    vp: &[f32],
    vps: usize,
    ldv: usize,
    nvp: usize,
    o: &mut [f32],
    ldo: usize,
    alpha: &[f32],
) {
    // Two rows per pass over a panel, as in `qk` (`rows` is a multiple of `MR`, even).
    assert!(rows.is_multiple_of(MR));
    for n in 0..nvp {
        let panel = &vp[n * vps..];
        for r in (0..rows).step_by(2) {
            let (a, b) = (alpha[r], alpha[r + 1]);
            let (mut a0, mut a1) = ([0f32; NR], [0f32; NR]);
            let o0 = &o[r * ldo + n * NR..r * ldo + (n + 1) * NR];
            let o1 = &o[(r + 1) * ldo + n * NR..(r + 1) * ldo + (n + 1) * NR];
            for c in 0..NR {
                a0[c] = o0[c] * a;
                a1[c] = o1[c] * b;
            }
            for j in 0..nk {
                let (p0, p1) = (p[r * BK + j], p[(r + 1) * BK + j]);
                let vrow = &panel[j * ldv..j * ldv + NR];
                for c in 0..NR {
                    a0[c] += p0 * vrow[c];
                    a1[c] += p1 * vrow[c];
                }
            }
            o[r * ldo + n * NR..r * ldo + (n + 1) * NR].copy_from_slice(&a0);
            o[(r + 1) * ldo + n * NR..(r + 1) * ldo + (n + 1) * NR].copy_from_slice(&a1);
        }
    }
}

/// Maximum of a row (-inf for an empty or all -inf row; NaNs are ignored).
pub(super) fn row_max(x: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; 8];
    let mut it = x.chunks_exact(8);
    for ch in &mut it {
        for c in 0..8 {
            if ch[c] > m[c] {
                m[c] = ch[c];
            }
        }
    }
    let mut r = f32::NEG_INFINITY;
    for &v in it.remainder().iter().chain(m.iter()) {
        if v > r {
            r = v;
        }
    }
    r
}

/// `x[j] = 2^(x[j] - m)` for a row whose maximum is at most `m` (so every exponent is
/// at most 0; −inf gives 0); returns the sum. On [`exp2_nonpos`], which the compiler
/// vectorises: `libm`'s `exp2f` per score took 27% of the portable kernel's time on
/// `enc512`.
pub(super) fn exp2_sub_sum(x: &mut [f32], m: f32) -> f32 {
    // Two loops that the compiler vectorises at the full register width: the
    // exponentials, then the sum in eight lanes (in one loop it used two-lane vectors).
    for v in x.iter_mut() {
        *v = exp2_nonpos(*v - m);
    }
    let mut acc = [0f32; 8];
    let mut it = x.chunks_exact(8);
    for ch in &mut it {
        for (a, v) in acc.iter_mut().zip(ch) {
            *a += *v;
        }
    }
    let sum: f32 = it.remainder().iter().sum();
    let pairs = [acc[0] + acc[4], acc[1] + acc[5], acc[2] + acc[6], acc[3] + acc[7]];
    (pairs[0] + pairs[2]) + (pairs[1] + pairs[3]) + sum
}

/// `s[r, j] = sum_x q[r*e + x] * k[j*ldk + x]` for rows `r < rows` (scores against
/// row-major keys, decode path; the dispatcher passes the live rows only).
#[allow(clippy::too_many_arguments)]
pub(super) fn qk_dot(
    q: &[f32],
    rows: usize,
    e: usize,
    k: &[f32],
    ldk: usize,
    nk: usize,
    s: &mut [f32],
    lds: usize,
) {
    for j in 0..nk {
        let kr = &k[j * ldk..j * ldk + e];
        for r in 0..rows {
            s[r * lds + j] = dot(&q[r * e..(r + 1) * e], kr);
        }
    }
}

/// Decode `o[r, ..ncols] = alpha[r]·o[r, ..ncols] + Σ_{j < nk} p[r·BK + j]·v[j·ldv..][..ncols]`
/// for the first `live` rows, walking each V row to its end, four keys per pass over the
/// output rows, where [`pv`] would run all padded rows and read 16 columns of every V
/// row per pass. The rows go in pairs, so that each V element read serves two rows (a
/// GQA group's rows share the V rows); each row's sums are taken in the same order
/// either way.
#[allow(clippy::too_many_arguments)]
pub(super) fn pv_rows(
    p: &[f32],
    live: usize,
    nk: usize,
    v: &[f32],
    ldv: usize,
    ncols: usize,
    o: &mut [f32],
    ldo: usize,
    alpha: &[f32],
) {
    for (r, &a) in alpha.iter().enumerate().take(live) {
        if a != 1.0 {
            o[r * ldo..r * ldo + ncols].iter_mut().for_each(|x| *x *= a);
        }
    }
    let vrow = |j: usize| &v[j * ldv..j * ldv + ncols];
    let mut r = 0;
    while r + 2 <= live {
        let (head, tail) = o.split_at_mut((r + 1) * ldo);
        let (o0, o1) = (&mut head[r * ldo..r * ldo + ncols], &mut tail[..ncols]);
        let (pa, pb) = (&p[r * BK..r * BK + nk], &p[(r + 1) * BK..(r + 1) * BK + nk]);
        let mut j = 0;
        while j + 4 <= nk {
            let (v0, v1, v2, v3) = (vrow(j), vrow(j + 1), vrow(j + 2), vrow(j + 3));
            let (a0, a1, a2, a3) = (pa[j], pa[j + 1], pa[j + 2], pa[j + 3]);
            let (b0, b1, b2, b3) = (pb[j], pb[j + 1], pb[j + 2], pb[j + 3]);
            for c in 0..ncols {
                let (x0, x1, x2, x3) = (v0[c], v1[c], v2[c], v3[c]);
                o0[c] += a0 * x0 + a1 * x1 + a2 * x2 + a3 * x3;
                o1[c] += b0 * x0 + b1 * x1 + b2 * x2 + b3 * x3;
            }
            j += 4;
        }
        for jj in j..nk {
            let (x, a, b) = (vrow(jj), pa[jj], pb[jj]);
            for c in 0..ncols {
                o0[c] += a * x[c];
                o1[c] += b * x[c];
            }
        }
        r += 2;
    }
    if r < live {
        let orow = &mut o[r * ldo..r * ldo + ncols];
        let pr = &p[r * BK..r * BK + nk];
        let mut j = 0;
        while j + 4 <= nk {
            let (v0, v1, v2, v3) = (vrow(j), vrow(j + 1), vrow(j + 2), vrow(j + 3));
            let (p0, p1, p2, p3) = (pr[j], pr[j + 1], pr[j + 2], pr[j + 3]);
            for c in 0..ncols {
                orow[c] += p0 * v0[c] + p1 * v1[c] + p2 * v2[c] + p3 * v3[c];
            }
            j += 4;
        }
        for (jj, &pj) in pr.iter().enumerate().skip(j) {
            for (x, &y) in orow.iter_mut().zip(vrow(jj)) {
                *x += pj * y;
            }
        }
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let mut ia = a.chunks_exact(8);
    let mut ib = b.chunks_exact(8);
    for (x, y) in (&mut ia).zip(&mut ib) {
        for c in 0..8 {
            acc[c] += x[c] * y[c];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for (x, y) in ia.remainder().iter().zip(ib.remainder()) {
        sum += x * y;
    }
    sum
}

/// One online-softmax row update (see the AVX2 version): returns `(m_new, alpha, sum)`.
pub(super) fn online_row(x: &mut [f32], m_old: f32) -> (f32, f32, f32) {
    let bm = row_max(x);
    let m_new = if bm > m_old { bm } else { m_old };
    if m_new == f32::NEG_INFINITY {
        return (m_new, 1.0, 0.0);
    }
    let alpha = if m_old == m_new {
        1.0
    } else {
        exp2_scalar(m_old - m_new)
    };
    (m_new, alpha, exp2_sub_sum(x, m_new))
}
