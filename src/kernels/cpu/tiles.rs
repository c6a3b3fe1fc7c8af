//! The geometry that the packed layouts and the register-tiled kernels share: panel
//! width, keys per block, rows per tile, and the operand checks of the block products'
//! and the projection's register tiles.

/// Lane count of a packed panel (two AVX2 registers, four NEON registers).
pub(crate) const NR: usize = 16;

/// Asserts the operand bounds of one contraction chunk `k0..k1` of a register-tiled
/// `y = x · Wᵀ (+ b)` (`avx512::gemm`, `avx2::gemm`): `rows` rows of `x` with stride
/// `ldx ≥ e`, `W` packed as `[out / NR][e][NR]`, `y` rows of stride `ldy ≥ out`, and
/// `b` (when given) of at least `out`. Returns the number of W panels.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub(crate) fn assert_gemm_operands(
    x: &[f32],
    ldx: usize,
    rows: usize,
    (k0, k1, e): (usize, usize, usize),
    wp: &[f32],
    out: usize,
    ldy: usize,
    b: Option<&[f32]>,
) -> usize {
    let npanels = out.div_ceil(NR);
    assert!(k0 <= k1 && k1 <= e && ldx >= e && ldy >= out);
    assert!(rows == 0 || x.len() >= (rows - 1) * ldx + e);
    assert!(wp.len() >= npanels * e * NR && b.is_none_or(|b| b.len() >= out));
    npanels
}

/// Keys per block; also the fixed row stride of the score / probability block.
pub(crate) const BK: usize = 64;
/// Rows of a register tile. The portable and NEON score kernels take Q strip-packed
/// as `[rows / MR][k][MR]`; the AVX-512 and AVX2 ones take it row-major.
pub(crate) const MR: usize = 6;

/// How far (log2) a row's running maximum may fall behind a new block's scores before
/// the softmax rescales (AMX, and f32 on AVX-512 and AVX2): the lazy rescaling of
/// FlashAttention-4. Probabilities then stay below 2^8 = 256, far inside the f32 and
/// bf16 range, and the normalisation by the row sum at the end is unchanged.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // AMX, AVX-512 and AVX2 only
pub(crate) const LAZY_RESCALE_LOG2: f32 = 8.0;

/// Asserts the operand bounds of a register-tiled score product `s = Q·Kᵀ` (`qk` of
/// the AVX-512, AVX2 and NEON kernels): `rows` Q rows (a multiple of [`MR`]) of `e`
/// elements, `npanels` K panels of `e × NR`, and `rows` score rows of stride
/// `lds ≥ npanels·NR`. The kernels' pointer arithmetic relies on exactly these bounds.
#[inline]
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub(crate) fn assert_qk_operands(
    q: &[f32],
    (rows, e): (usize, usize),
    kp: &[f32],
    npanels: usize,
    s: &[f32],
    lds: usize,
) {
    assert!(rows.is_multiple_of(MR) && lds >= npanels * NR);
    assert!(q.len() >= rows * e && kp.len() >= npanels * e * NR);
    assert!(rows == 0 || s.len() >= (rows - 1) * lds + npanels * NR);
}

/// Asserts the operand bounds of a register-tiled `O = α·O + P·V` (`pv` of the AVX-512,
/// AVX2 and NEON kernels, and AVX-512's `pv_pair`): `rows` P rows (a multiple of [`MR`])
/// of stride `ldp`, each run of V (its operand and key count, at most [`BK`] keys) read
/// as `nvp` panels of panel stride `vps` and row stride `ldv`, `rows` output rows of
/// stride `ldo ≥ nvp·NR`, and `rows` rescale factors. The kernels' pointer arithmetic
/// relies on exactly these bounds.
#[inline]
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub(crate) fn assert_pv_operands(
    p: &[f32],
    (rows, ldp): (usize, usize),
    runs: &[(&[f32], usize)],
    (vps, ldv, nvp): (usize, usize, usize),
    o: &[f32],
    ldo: usize,
    alpha: &[f32],
) {
    assert!(rows.is_multiple_of(MR) && ldo >= nvp * NR && alpha.len() >= rows);
    assert!(p.len() >= rows * ldp);
    for &(v, nk) in runs {
        assert!(nk <= BK);
        assert!(nvp == 0 || nk == 0 || v.len() >= (nvp - 1) * vps + (nk - 1) * ldv + NR);
    }
    assert!(rows == 0 || o.len() >= (rows - 1) * ldo + nvp * NR);
}

/// Scalar references for the register tiles' tests: the same fused multiply-adds in the
/// same order, so that a tile must match them bit for bit.
#[cfg(all(test, target_arch = "x86_64"))]
pub(crate) mod reference {
    use super::{BK, NR};

    /// Asserts that `s` (row stride `lds`) holds `Q·Kᵀ` for `rows` row-major Q rows of `e`
    /// elements and `npanels` K panels packed as `[panel][e][NR]`, each score a chain of
    /// fused multiply-adds over `e` from 0.
    pub(crate) fn assert_qk(
        q: &[f32],
        (rows, e): (usize, usize),
        kp: &[f32],
        npanels: usize,
        s: &[f32],
        lds: usize,
    ) {
        for r in 0..rows {
            for j in 0..npanels * NR {
                let (pn, c) = (j / NR, j % NR);
                let want = (0..e).fold(0f32, |a, x| q[r * e + x].mul_add(kp[(pn * e + x) * NR + c], a));
                assert_eq!(
                    s[r * lds + j],
                    want,
                    "qk rows {rows} e {e} panels {npanels} row {r} key {j}"
                );
            }
        }
    }

    /// Asserts that `o` (row stride `ldo`) holds `alpha·o0 + P·V` on its first `nvp·NR`
    /// columns and `o0` after them, for `rows` rows of P (row stride [`BK`]) over `nk`
    /// keys, V panel `n`'s key `j` at `vp[n·vps + j·ldv..]`: each output the rescaled
    /// `o0` followed by a chain of fused multiply-adds over the keys.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn assert_pv(
        p: &[f32],
        (rows, nk): (usize, usize),
        vp: &[f32],
        (vps, ldv, nvp): (usize, usize, usize),
        alpha: &[f32],
        o0: &[f32],
        o: &[f32],
        ldo: usize,
    ) {
        for r in 0..rows {
            for c in 0..nvp * NR {
                let (n, cc) = (c / NR, c % NR);
                let a0 = alpha[r] * o0[r * ldo + c];
                let want = (0..nk).fold(a0, |a, j| p[r * BK + j].mul_add(vp[n * vps + j * ldv + cc], a));
                assert_eq!(
                    o[r * ldo + c],
                    want,
                    "pv rows {rows} nk {nk} vps {vps} ldv {ldv} row {r} col {c}"
                );
            }
            assert_eq!(
                o[r * ldo + nvp * NR..(r + 1) * ldo],
                o0[r * ldo + nvp * NR..(r + 1) * ldo]
            );
        }
    }
}

#[cfg(all(test, any(target_arch = "x86_64", target_arch = "aarch64")))]
mod tests {
    use super::*;

    /// Operands that fit exactly pass, and each one element too short (or a count out of
    /// range) is refused: the unsafe kernels behind these checks index by pointer.
    #[test]
    fn block_product_checks_refuse_every_short_operand() {
        let refused = |f: &dyn Fn()| std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err();

        let (rows, e, np, lds) = (2 * MR, 5, 3, 3 * NR + 2);
        let (q, kp) = (vec![0f32; rows * e], vec![0f32; np * e * NR]);
        let s = vec![0f32; (rows - 1) * lds + np * NR];
        let qk =
            |q: &[f32], rows, kp: &[f32], s: &[f32], lds| assert_qk_operands(q, (rows, e), kp, np, s, lds);
        qk(&q, rows, &kp, &s, lds);
        assert!(refused(&|| qk(&q[1..], rows, &kp, &s, lds)));
        assert!(refused(&|| qk(&q, rows, &kp[1..], &s, lds)));
        assert!(refused(&|| qk(&q, rows, &kp, &s[1..], lds)));
        assert!(refused(&|| qk(&q, rows, &kp, &s, np * NR - 1)));
        assert!(refused(&|| qk(&q, rows - 1, &kp, &s, lds)));

        let (nk, vps, ldv, nvp, ldo, ldp) = (BK - 3, BK * NR, NR, 2, 2 * NR + 1, BK);
        let p = vec![0f32; rows * ldp];
        let v = vec![0f32; (nvp - 1) * vps + (nk - 1) * ldv + NR];
        // Room for BK + 1 keys, so that only the key count is out of range below.
        let vbig = vec![0f32; (nvp - 1) * vps + BK * ldv + NR];
        let o = vec![0f32; (rows - 1) * ldo + nvp * NR];
        let alpha = vec![1f32; rows];
        let pv = |p: &[f32], rows, runs: &[(&[f32], usize)], o: &[f32], ldo, alpha: &[f32]| {
            assert_pv_operands(p, (rows, ldp), runs, (vps, ldv, nvp), o, ldo, alpha)
        };
        pv(&p, rows, &[(&v, nk), (&v, 0)], &o, ldo, &alpha);
        assert!(refused(&|| pv(&p[1..], rows, &[(&v, nk)], &o, ldo, &alpha)));
        assert!(refused(&|| pv(&p, rows, &[(&v[1..], nk)], &o, ldo, &alpha)));
        assert!(refused(&|| pv(
            &p,
            rows,
            &[(&v, nk), (&v[1..], nk)],
            &o,
            ldo,
            &alpha
        )));
        assert!(refused(&|| pv(&p, rows, &[(&vbig, BK + 1)], &o, ldo, &alpha)));
        assert!(refused(&|| pv(&p, rows, &[(&v, nk)], &o[1..], ldo, &alpha)));
        assert!(refused(&|| pv(&p, rows, &[(&v, nk)], &o, nvp * NR - 1, &alpha)));
        assert!(refused(&|| pv(&p, rows, &[(&v, nk)], &o, ldo, &alpha[1..])));
        assert!(refused(&|| pv(&p, rows - 1, &[(&v, nk)], &o, ldo, &alpha)));
    }
}
