//! The AVX2 projection product `y = x · Wᵀ (+ b)` ([`gemm`]) on 6×16 register tiles.

use super::products::rows_loop_6x16;
use super::*;

/// Rows per [`gemm`] register tile.
pub(crate) const GEMM_ROWS: usize = MR;

/// One contraction chunk `k0..k1` of `y = x · Wᵀ (+ b)`, as [`super::super::avx512::gemm`]
/// (same operands and layouts) on 6-row × 16-output tiles: whole `GEMM_ROWS`-row strips,
/// then one or two shorter tiles for the rest ([`gemm_row_tiles`]); a partial last
/// panel is loaded and stored with lane masks. Panels are the outer loop, so a panel
/// stays in L1/L2 while the row strips stream past it.
///
/// # Safety
/// AVX2 and FMA must be available, and `y` must hold `rows` rows of stride `ldy`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm(
    x: &[f32],
    ldx: usize,
    rows: usize,
    (k0, k1, e): (usize, usize, usize),
    wp: &[f32],
    out: usize,
    y: *mut f32,
    ldy: usize,
    b: Option<&[f32]>,
    accumulate: bool,
) {
    let npanels = super::super::tiles::assert_gemm_operands(x, ldx, rows, (k0, k1, e), wp, out, ldy, b);
    let (strips, tails) = gemm_row_tiles(rows);
    let bias = b.map_or(std::ptr::null(), |b| b.as_ptr());
    let kc = k1 - k0;
    // SAFETY: `x` and `wp` bounds asserted above; the caller guarantees `y` and the
    // features.
    unsafe {
        for p in 0..npanels {
            let wpp = wp.as_ptr().add(p * e * NR + k0 * NR);
            let bp = if bias.is_null() { bias } else { bias.add(p * NR) };
            let live = (out - p * NR).min(NR);
            for st in 0..strips {
                let xk = x.as_ptr().add(st * GEMM_ROWS * ldx + k0);
                let yp = y.add(st * GEMM_ROWS * ldy + p * NR);
                gemm_tile::<GEMM_ROWS>((xk, ldx, kc, wpp, yp, ldy, bp, accumulate), live);
            }
            let mut r0 = strips * GEMM_ROWS;
            for tail in tails.into_iter().filter(|&t| t > 0) {
                let xk = x.as_ptr().add(r0 * ldx + k0);
                let yp = y.add(r0 * ldy + p * NR);
                let t = (xk, ldx, kc, wpp, yp, ldy, bp, accumulate);
                match tail {
                    1 => gemm_tile::<1>(t, live),
                    2 => gemm_tile::<2>(t, live),
                    3 => gemm_tile::<3>(t, live),
                    4 => gemm_tile::<4>(t, live),
                    5 => gemm_tile::<5>(t, live),
                    _ => unreachable!("a tail is shorter than GEMM_ROWS"),
                }
                r0 += tail;
            }
        }
    }
}

/// How [`gemm`] covers `rows` rows: whole `GEMM_ROWS`-row strips, then up to two shorter
/// tiles. A last tile of 1–3 rows keeps 2–6 accumulators, fewer than the 8 that the FMA
/// latency needs to keep both pipes busy, so such a remainder takes the last whole strip
/// with it and runs as two tiles of 3–5 rows (7 → 4 + 3, 8 → 4 + 4, 9 → 5 + 4).
fn gemm_row_tiles(rows: usize) -> (usize, [usize; 2]) {
    let (strips, tail) = (rows / GEMM_ROWS, rows % GEMM_ROWS);
    if strips > 0 && (1..=3).contains(&tail) {
        let r = tail + GEMM_ROWS;
        (strips - 1, [r - r / 2, r / 2])
    } else {
        (strips, [tail, 0])
    }
}

/// `(x, ldx, kc, W panel, y, ldy, bias, accumulate)` of a [`gemm_tile`].
type GemmArgs = (
    *const f32,
    usize,
    usize,
    *const f32,
    *mut f32,
    usize,
    *const f32,
    bool,
);

/// Lane masks for the first `live` of 16 outputs, as two 8-lane halves.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn live_masks(live: usize) -> [__m256i; 2] {
    let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let n = live as i32;
    [
        _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes),
        _mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8), lanes),
    ]
}

/// An `R × 16` tile of [`gemm`]: rows of `x` broadcast from their row-major place, one W
/// panel; only the first `live` outputs are read from `y`/`bias` and stored. The output
/// starts from `y` (`acc`), else from the bias (when not null) or zero.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn gemm_tile<const R: usize>((x, ldx, kc, w, y, ldy, bias, acc_y): GemmArgs, live: usize) {
    let full = live == NR;
    let m = live_masks(live);
    // A macro (not a closure: closures do not inherit `target_feature`). Only the first
    // `live` outputs at `$p` are read.
    macro_rules! load {
        ($p:expr, $h:expr) => {
            if full {
                _mm256_loadu_ps($p.add(8 * $h))
            } else {
                _mm256_maskload_ps($p.add(8 * $h), m[$h])
            }
        };
    }
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    for (r, row) in acc.iter_mut().enumerate() {
        for (h, v) in row.iter_mut().enumerate() {
            if acc_y {
                *v = load!(y.add(r * ldy), h);
            } else if !bias.is_null() {
                *v = load!(bias, h);
            }
        }
    }
    macro_rules! step {
        ($k:expr) => {{
            let k = $k;
            let w0 = _mm256_loadu_ps(w.add(k * NR));
            let w1 = _mm256_loadu_ps(w.add(k * NR + 8));
            for (r, row) in acc.iter_mut().enumerate() {
                let a = _mm256_broadcast_ss(&*x.add(r * ldx + k));
                row[0] = _mm256_fmadd_ps(a, w0, row[0]);
                row[1] = _mm256_fmadd_ps(a, w1, row[1]);
            }
        }};
    }
    if R == MR {
        // Whole strips take the assembly loop of the block products.
        let a: [__m256; 2 * MR] = std::array::from_fn(|i| acc[i / 2][i % 2]);
        // SAFETY: the caller guarantees `R` rows of `x` (stride `ldx`) with `kc`
        // elements each and a `[kc][NR]` W panel.
        let a = unsafe { rows_loop_6x16(a, x, ldx * 4, w, kc) };
        for (i, v) in a.into_iter().enumerate() {
            acc[i / 2][i % 2] = v;
        }
    } else {
        let mut k = 0;
        while k + 4 <= kc {
            step!(k);
            step!(k + 1);
            step!(k + 2);
            step!(k + 3);
            k += 4;
        }
        while k < kc {
            step!(k);
            k += 1;
        }
    }
    for (r, row) in acc.iter().enumerate() {
        let yp = y.add(r * ldy);
        if full {
            _mm256_storeu_ps(yp, row[0]);
            _mm256_storeu_ps(yp.add(8), row[1]);
        } else {
            _mm256_maskstore_ps(yp, m[0], row[0]);
            _mm256_maskstore_ps(yp.add(8), m[1], row[1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `gemm_row_tiles` covers every row once, in tiles of at most `GEMM_ROWS` rows.
    /// Where a whole strip can share the remainder, no tile has 1 or 2 rows and the
    /// remainder's first tile has at least 4.
    #[test]
    fn gemm_row_tiles_cover_the_rows_without_thin_tails() {
        for rows in 0..=40 {
            let (strips, tails) = gemm_row_tiles(rows);
            assert_eq!(strips * GEMM_ROWS + tails[0] + tails[1], rows, "rows {rows}");
            assert!(tails.iter().all(|&t| t < GEMM_ROWS), "rows {rows}: {tails:?}");
            assert!(tails[1] <= tails[0], "rows {rows}: {tails:?}");
            if rows > GEMM_ROWS {
                let thin = tails.iter().filter(|&&t| t > 0 && t < 3).count();
                assert_eq!(thin, 0, "rows {rows}: {tails:?}");
                assert!(
                    tails[0] + tails[1] == 0 || tails[0] >= 4,
                    "rows {rows}: {tails:?}"
                );
            }
        }
        assert_eq!(gemm_row_tiles(8), (0, [4, 4]));
        assert_eq!(gemm_row_tiles(128), (20, [4, 4]));
        assert_eq!(gemm_row_tiles(11), (1, [5, 0]));
    }
}
