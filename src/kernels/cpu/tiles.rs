//! The geometry that the packed layouts and the register-tiled kernels share: panel
//! width, keys per block, rows per tile, and the operand check of the projection tiles.

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
