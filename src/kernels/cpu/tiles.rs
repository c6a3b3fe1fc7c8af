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
