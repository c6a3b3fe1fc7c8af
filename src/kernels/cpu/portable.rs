//! Portable micro-kernels (safe Rust written so LLVM auto-vectorises the 16-lane loops).

use super::exp::exp2_scalar;
use super::tiles::{BK, MR, NR};

/// `s[r, p*NR + c] = sum_x q[r, x] * kp[p][x][c]` for all `rows` rows and `npanels` panels.
/// Q is strip-packed: `q[r, x] = q[(r / MR) * MR * e + x * MR + r % MR]`; `rows % MR == 0`.
pub(super) fn qk(q: &[f32], rows: usize, e: usize, kp: &[f32], npanels: usize, s: &mut [f32], lds: usize) {
    for p in 0..npanels {
        let panel = &kp[p * e * NR..(p + 1) * e * NR];
        for r in 0..rows {
            let qs = &q[(r / MR) * MR * e..(r / MR + 1) * MR * e];
            let mut acc = [0f32; NR];
            for (qx, kv) in qs.chunks_exact(MR).zip(panel.chunks_exact(NR)) {
                let qv = qx[r % MR];
                for c in 0..NR {
                    acc[c] += qv * kv[c];
                }
            }
            s[r * lds + p * NR..r * lds + (p + 1) * NR].copy_from_slice(&acc);
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
    for n in 0..nvp {
        let panel = &vp[n * vps..];
        for r in 0..rows {
            let orow = &mut o[r * ldo + n * NR..r * ldo + (n + 1) * NR];
            let a = alpha[r];
            let mut acc = [0f32; NR];
            for c in 0..NR {
                acc[c] = orow[c] * a;
            }
            for j in 0..nk {
                let pj = p[r * BK + j];
                let vrow = &panel[j * ldv..j * ldv + NR];
                for c in 0..NR {
                    acc[c] += pj * vrow[c];
                }
            }
            orow.copy_from_slice(&acc);
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

/// `x[j] = 2^(x[j] - m)`; returns the sum.
pub(super) fn exp2_sub_sum(x: &mut [f32], m: f32) -> f32 {
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = exp2_scalar(*v - m);
        sum += *v;
    }
    sum
}

/// `s[r, j] = sum_x q[r*e + x] * k[j*ldk + x]` (scores against row-major keys, decode path).
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
