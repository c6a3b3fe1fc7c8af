//! The two block products of the bf16 prefill path on AVX512-BF16 (`VDPBF16PS`), for
//! CPUs that have it without AMX (AMD Zen 4 and later, Intel Cooper Lake).
//!
//! [`qk`] and [`pv`] take exactly the operands of `amx::qk` and `amx::pv`: row-major
//! bf16 Q and P (rows padded to whole 16-row tiles), and K/V blocks packed by
//! `vnni::pack_k` / `vnni::pack_v` into VNNI rows, where each 64-byte row holds, for 16
//! output columns, one pair of consecutive contraction elements. That row is exactly
//! the right operand of one `VDPBF16PS`: with a broadcast pair of Q (or P) elements as
//! the left operand, lane `c` accumulates `a₀·b₀[c] + a₁·b₁[c]` in f32. So the driver's
//! AMX path runs unchanged, with these register tiles in place of the tile unit.
//!
//! Each product of two bf16 values is exact in f32, as on AMX (both flush bf16
//! denormals), so the error bounds of `amx` hold here too. On a Zen 4 core one
//! `VDPBF16PS` (32 products) issues per cycle, like one f32 FMA (16 products): the
//! products run at twice the f32 rate. f16 inputs stay on the f32 kernels: their
//! `hi + lo` split needs three products per pair, 1.5 times the f32 work.
//!
//! Register tiles: up to 6 rows × 4 column panels (24 accumulators), so each loaded
//! K/V row serves 6 rows and each broadcast pair 64 columns.

use super::tiles::{BK, NR};
use super::vnni::{e_pad, Terms, TILE, TK, TM};
use std::arch::x86_64::*;

/// Rows of a register tile.
const MR: usize = 6;

/// Whether the CPU has what these kernels use: AVX-512F/DQ and AVX512-BF16.
pub(crate) fn available() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512dq")
        && is_x86_feature_detected!("avx512bf16")
}

/// The bf16 pair at element `i` of `p` (an even index), as 16 copies.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn pair(p: *const u16, i: usize) -> __m512bh {
    let x = std::ptr::read_unaligned(p.add(i) as *const i32);
    std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(x))
}

/// One 64-byte VNNI row.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn row(p: *const u16) -> __m512bh {
    std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p as *const __m512i))
}

/// `S = Q·Kᵀ` for one block, with the operands of `amx::qk`: `rtiles` 16-row tiles of Q
/// (`qa`, per-component stride `qcs`, row stride `ldq ≥ e_pad(e)` elements, zeros past
/// `e`) against the [`BK`] keys of a K block packed by `vnni::pack_k` (`kb`,
/// per-component stride `kcs`); scores go to `s` (f32, row stride `lds` floats).
///
/// # Safety
/// [`available`] must have returned true; the buffers must hold what the layouts above
/// describe.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bf16")]
pub(crate) unsafe fn qk(
    qa: *const u16,
    qcs: usize,
    (rtiles, ldq): (usize, usize),
    e: usize,
    kb: *const u16,
    kcs: usize,
    terms: Terms,
    s: *mut f32,
    lds: usize,
) {
    let rows = rtiles * TM;
    let mut r0 = 0;
    while r0 < rows {
        let nr = (rows - r0).min(MR);
        let args = QkArgs {
            qa: qa.add(r0 * ldq),
            qcs,
            ldq,
            pairs: e_pad(e) / 2,
            kb,
            kcs,
            terms,
            s: s.add(r0 * lds),
            lds,
        };
        match nr {
            6 => qk_tile::<6>(args),
            5 => qk_tile::<5>(args),
            4 => qk_tile::<4>(args),
            3 => qk_tile::<3>(args),
            2 => qk_tile::<2>(args),
            _ => qk_tile::<1>(args),
        }
        r0 += nr;
    }
}

#[derive(Clone, Copy)]
struct QkArgs {
    qa: *const u16,
    qcs: usize,
    ldq: usize,
    pairs: usize,
    kb: *const u16,
    kcs: usize,
    terms: Terms,
    s: *mut f32,
    lds: usize,
}

/// `R` rows of [`qk`] against the block's four 16-key panels.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn qk_tile<const R: usize>(a: QkArgs) {
    const N: usize = BK / NR;
    // A K panel (16 keys) holds `pairs` VNNI rows of 32 elements.
    let panel = a.pairs * TK;
    let mut acc = [[_mm512_setzero_ps(); N]; R];
    for &(ca, cb) in a.terms {
        let (q, k) = (a.qa.add(ca * a.qcs), a.kb.add(cb * a.kcs));
        for pp in 0..a.pairs {
            let b: [__m512bh; N] = std::array::from_fn(|n| row(k.add(n * panel + pp * TK)));
            for (r, accr) in acc.iter_mut().enumerate() {
                let x = pair(q, r * a.ldq + 2 * pp);
                for n in 0..N {
                    accr[n] = _mm512_dpbf16_ps(accr[n], x, b[n]);
                }
            }
        }
    }
    for (r, accr) in acc.iter().enumerate() {
        for (n, &v) in accr.iter().enumerate() {
            _mm512_storeu_ps(a.s.add(r * a.lds + n * NR), v);
        }
    }
}

/// `O += P·V` for a super-block of `vbs.len()` key blocks, with the operands of
/// `amx::pv`: `rtiles` 16-row tiles of P (`pa`, per-component stride `pcs`, row stride
/// `ldp`, key block `i` at column `i·BK`) against V blocks packed by `vnni::pack_v`
/// (`vbs`, per-component stride `vcs`, `nvp` column panels each); `o` is f32 with row
/// stride `ldo` floats (already rescaled).
///
/// # Safety
/// As for [`qk`].
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bf16")]
pub(crate) unsafe fn pv(
    pa: *const u16,
    pcs: usize,
    ldp: usize,
    rtiles: usize,
    vbs: &[*const u16],
    vcs: usize,
    nvp: usize,
    terms: Terms,
    o: *mut f32,
    ldo: usize,
) {
    let rows = rtiles * TM;
    let mut r0 = 0;
    while r0 < rows {
        let nr = (rows - r0).min(MR);
        let mut cp = 0;
        while cp < nvp {
            let nc = (nvp - cp).min(4);
            let args = PvArgs {
                pa: pa.add(r0 * ldp),
                pcs,
                ldp,
                vbs,
                vcs,
                cp,
                terms,
                o: o.add(r0 * ldo + cp * NR),
                ldo,
            };
            match nr {
                6 => pv_cols::<6>(args, nc),
                5 => pv_cols::<5>(args, nc),
                4 => pv_cols::<4>(args, nc),
                3 => pv_cols::<3>(args, nc),
                2 => pv_cols::<2>(args, nc),
                _ => pv_cols::<1>(args, nc),
            }
            cp += nc;
        }
        r0 += nr;
    }
}

#[derive(Clone, Copy)]
struct PvArgs<'a> {
    pa: *const u16,
    pcs: usize,
    ldp: usize,
    vbs: &'a [*const u16],
    vcs: usize,
    /// First column panel of the tile.
    cp: usize,
    terms: Terms,
    o: *mut f32,
    ldo: usize,
}

/// `R` rows × `nc` (1–4) column panels of [`pv`].
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn pv_cols<const R: usize>(a: PvArgs, nc: usize) {
    match nc {
        4 => pv_tile::<R, 4>(a),
        3 => pv_tile::<R, 3>(a),
        2 => pv_tile::<R, 2>(a),
        _ => pv_tile::<R, 1>(a),
    }
}

/// `R` rows × `N` column panels of [`pv`].
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn pv_tile<const R: usize, const N: usize>(a: PvArgs) {
    // A V column panel holds `BK / 2` VNNI rows of 32 elements (one per key pair).
    let panel = BK / 2 * TK;
    debug_assert_eq!(panel, (BK / TK) * TILE);
    let mut acc = [[_mm512_setzero_ps(); N]; R];
    for (r, accr) in acc.iter_mut().enumerate() {
        for (n, v) in accr.iter_mut().enumerate() {
            *v = _mm512_loadu_ps(a.o.add(r * a.ldo + n * NR));
        }
    }
    for &(ca, cb) in a.terms {
        for (bi, &vb) in a.vbs.iter().enumerate() {
            let p = a.pa.add(ca * a.pcs + bi * BK);
            let v = vb.add(cb * a.vcs + a.cp * panel);
            for kp in 0..BK / 2 {
                let b: [__m512bh; N] = std::array::from_fn(|n| row(v.add(n * panel + kp * TK)));
                for (r, accr) in acc.iter_mut().enumerate() {
                    let x = pair(p, r * a.ldp + 2 * kp);
                    for n in 0..N {
                        accr[n] = _mm512_dpbf16_ps(accr[n], x, b[n]);
                    }
                }
            }
        }
    }
    for (r, accr) in acc.iter().enumerate() {
        for (n, &v) in accr.iter().enumerate() {
            _mm512_storeu_ps(a.o.add(r * a.ldo + n * NR), v);
        }
    }
}

/// One output block of a projection (`amx_linear`): `C = init + Σ X_a · W_bᵀ` over the
/// component pairs `(a, b)` of `terms`, for `rows` rows of x by the [`BK`] outputs of
/// one weight block packed by `vnni::pack_k` (outputs as keys), the operands of
/// `amx::gemm_tiles`.
///
/// - x (`xa`): row-major bf16 components at stride `xcs`, rows `ldx` apart, `2·pairs`
///   elements each (zeros past the contraction).
/// - W (`wb`): components at stride `wcs`; the VNNI row of panel `p` and contraction
///   pair `pp` at `(p·pairs + pp)·TK`.
/// - `init`: [`BK`] floats added to every row (the bias), or null for zeros.
/// - C: f32, all [`BK`] columns of each row, at `y` with rows `ldy` floats apart.
///
/// Strips of up to 6 rows × 64 outputs (24 accumulators): each VNNI row loaded serves
/// the strip's rows, each broadcast pair of x the block's 64 outputs.
///
/// Each `VDPBF16PS` rounds twice, so with several pairs in `terms` (the low components
/// of an f32 or f16 value) the sums would round far more often than an f32 product's.
/// The pairs after the first (whose components, after x's and W's first, are at most
/// 2⁻⁸ of their values) are summed first, on their own, and added once to the first
/// pair's sum, so that their roundings are of a sum 2⁸ times smaller.
///
/// # Safety
/// [`available`] must have returned true; the buffers must hold what is described.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bf16")]
pub(crate) unsafe fn gemm(
    (xa, xcs, ldx): (*const u16, usize, usize),
    (wb, wcs): (*const u16, usize),
    pairs: usize,
    terms: &[(usize, usize)],
    rows: usize,
    init: *const f32,
    (y, ldy): (*mut f32, usize),
) {
    let mut r0 = 0;
    while r0 < rows {
        let nr = (rows - r0).min(MR);
        let args = GemmArgs {
            xa: xa.add(r0 * ldx),
            xcs,
            ldx,
            wb,
            wcs,
            pairs,
            terms,
            init,
            y: y.add(r0 * ldy),
            ldy,
        };
        match nr {
            6 => gemm_tile::<6>(args),
            5 => gemm_tile::<5>(args),
            4 => gemm_tile::<4>(args),
            3 => gemm_tile::<3>(args),
            2 => gemm_tile::<2>(args),
            _ => gemm_tile::<1>(args),
        }
        r0 += nr;
    }
}

#[derive(Clone, Copy)]
struct GemmArgs<'a> {
    xa: *const u16,
    xcs: usize,
    ldx: usize,
    wb: *const u16,
    wcs: usize,
    pairs: usize,
    terms: &'a [(usize, usize)],
    init: *const f32,
    y: *mut f32,
    ldy: usize,
}

/// `R` rows of [`gemm`] against the block's four 16-output panels.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn gemm_tile<const R: usize>(a: GemmArgs) {
    const N: usize = BK / NR;
    let panel = a.pairs * TK;
    let start: [__m512; N] = std::array::from_fn(|n| {
        if a.init.is_null() {
            _mm512_setzero_ps()
        } else {
            _mm512_loadu_ps(a.init.add(n * NR))
        }
    });
    let term = |acc: &mut [[__m512; N]; R], (ca, cb): (usize, usize)| {
        let (x, w) = (a.xa.add(ca * a.xcs), a.wb.add(cb * a.wcs));
        for pp in 0..a.pairs {
            let b: [__m512bh; N] = std::array::from_fn(|n| row(w.add(n * panel + pp * TK)));
            for (r, accr) in acc.iter_mut().enumerate() {
                let xp = pair(x, r * a.ldx + 2 * pp);
                for n in 0..N {
                    accr[n] = _mm512_dpbf16_ps(accr[n], xp, b[n]);
                }
            }
        }
    };
    let Some((&first, rest)) = a.terms.split_first() else {
        return;
    };
    let mut acc = [[_mm512_setzero_ps(); N]; R];
    if !rest.is_empty() {
        // The later pairs' sum, parked in C until the first pair's is done.
        for &t in rest {
            term(&mut acc, t);
        }
        for (r, accr) in acc.iter().enumerate() {
            for (n, &v) in accr.iter().enumerate() {
                _mm512_storeu_ps(a.y.add(r * a.ldy + n * NR), v);
            }
        }
    }
    acc = [start; R];
    term(&mut acc, first);
    if !rest.is_empty() {
        for (r, accr) in acc.iter_mut().enumerate() {
            for (n, v) in accr.iter_mut().enumerate() {
                *v = _mm512_add_ps(*v, _mm512_loadu_ps(a.y.add(r * a.ldy + n * NR)));
            }
        }
    }
    for (r, accr) in acc.iter().enumerate() {
        for (n, &v) in accr.iter().enumerate() {
            _mm512_storeu_ps(a.y.add(r * a.ldy + n * NR), v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf16(x: f32) -> u16 {
        half::bf16::from_f32(x).to_bits()
    }

    fn val(b: u16) -> f64 {
        half::bf16::from_bits(b).to_f64()
    }

    /// Small pseudo-random values (a fixed LCG), exactly representable in bf16.
    fn values(n: usize, seed: u64) -> Vec<u16> {
        let mut x = seed;
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                bf16(((x >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0)
            })
            .collect()
    }

    /// Both products against f64 sums over the VNNI layout that `vnni::pack_k` and
    /// `vnni::pack_v` document, on every row-tile height (two 16-row tiles: strips of
    /// 6, 6, 6, 6, 6 and 2 rows), a column-panel count that is not a multiple of four,
    /// two key blocks, and rows of O that already hold values.
    #[test]
    fn products_follow_the_vnni_layout() {
        if !available() {
            eprintln!("note: no AVX512-BF16 here; skipped");
            return;
        }
        let (rtiles, e, nvp) = (2, 96, 5);
        let (rows, ep, ldq) = (rtiles * TM, e_pad(e), e_pad(e) + 32);
        let q = values(rows * ldq, 1);
        // K: key `c` of panel `n`, contraction element `d` at VNNI row d / 2.
        let kpanel = ep / 2 * TK;
        let kb = values(BK / NR * kpanel, 2);
        let key = |j: usize, d: usize| val(kb[(j / NR) * kpanel + (d / 2) * TK + 2 * (j % NR) + d % 2]);
        let lds = BK + 8;
        let mut s = vec![f32::NAN; rows * lds];
        unsafe {
            qk(
                q.as_ptr(),
                0,
                (rtiles, ldq),
                e,
                kb.as_ptr(),
                0,
                &[(0, 0)],
                s.as_mut_ptr(),
                lds,
            )
        };
        for r in 0..rows {
            for j in 0..BK {
                let want: f64 = (0..ep).map(|d| val(q[r * ldq + d]) * key(j, d)).sum();
                let got = s[r * lds + j] as f64;
                assert!(
                    (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "qk row {r} key {j}: {got} vs {want}"
                );
            }
        }
        // P: two key blocks side by side; V: column `c` of panel `n`, key `j` at VNNI row j / 2.
        let ldp = 2 * BK + 16;
        let p = values(rows * ldp, 3);
        let vpanel = BK / 2 * TK;
        let vblocks = [values(nvp * vpanel, 4), values(nvp * vpanel, 5)];
        let vptr: Vec<*const u16> = vblocks.iter().map(|v| v.as_ptr()).collect();
        let vel = |bi: usize, j: usize, c: usize| {
            val(vblocks[bi][(c / NR) * vpanel + (j / 2) * TK + 2 * (c % NR) + j % 2])
        };
        let ldo = nvp * NR + 16;
        let o0: Vec<f32> = (0..rows * ldo).map(|i| (i % 7) as f32 - 3.0).collect();
        let mut o = o0.clone();
        unsafe {
            pv(
                p.as_ptr(),
                0,
                ldp,
                rtiles,
                &vptr,
                0,
                nvp,
                &[(0, 0)],
                o.as_mut_ptr(),
                ldo,
            )
        };
        for r in 0..rows {
            for c in 0..nvp * NR {
                let dot: f64 = (0..2)
                    .flat_map(|bi| (0..BK).map(move |j| (bi, j)))
                    .map(|(bi, j)| val(p[r * ldp + bi * BK + j]) * vel(bi, j, c))
                    .sum();
                let want = o0[r * ldo + c] as f64 + dot;
                let got = o[r * ldo + c] as f64;
                assert!(
                    (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "pv row {r} col {c}: {got} vs {want}"
                );
            }
            // Columns past the panels are left alone.
            assert_eq!(
                o[r * ldo + nvp * NR..(r + 1) * ldo],
                o0[r * ldo + nvp * NR..(r + 1) * ldo]
            );
        }
    }

    /// The projection product against f64 sums over the VNNI layout of `vnni::pack_k`:
    /// every strip height (1–6 rows, and 13 as 6 + 6 + 1), with and without a bias,
    /// one pair of components and three (x's `hi` and `lo` against W's `hi`, and x's
    /// `hi` against W's `lo`, the later two summed apart); columns past the block and
    /// rows past `rows` are left alone.
    #[test]
    fn gemm_follows_the_vnni_layout() {
        if !available() {
            eprintln!("note: no AVX512-BF16 here; skipped");
            return;
        }
        let (e, ldy) = (80, BK + 16);
        let (ep, ldx) = (e_pad(e), e_pad(e) + 32);
        let pairs = ep / 2;
        let (xcs, wcs) = (16 * ldx, BK / NR * pairs * TK);
        let x = values(2 * xcs, 6);
        let w = values(2 * wcs, 7);
        let init: Vec<f32> = (0..BK).map(|c| c as f32 * 0.5 - 9.0).collect();
        let weight = |c: usize, j: usize, d: usize| {
            val(w[c * wcs + (j / NR) * pairs * TK + (d / 2) * TK + 2 * (j % NR) + d % 2])
        };
        let terms: [&[(usize, usize)]; 2] = [&[(0, 0)], &[(0, 0), (1, 0), (0, 1)]];
        for rows in [1, 2, 3, 4, 5, 6, 13] {
            for (terms, bias) in terms.into_iter().flat_map(|t| [false, true].map(|b| (t, b))) {
                let y0: Vec<f32> = (0..16 * ldy).map(|i| (i % 5) as f32 + 100.0).collect();
                let mut y = y0.clone();
                let init_ptr = if bias { init.as_ptr() } else { std::ptr::null() };
                // SAFETY: `available` returned true; the buffers hold the layouts above.
                unsafe {
                    gemm(
                        (x.as_ptr(), xcs, ldx),
                        (w.as_ptr(), wcs),
                        pairs,
                        terms,
                        rows,
                        init_ptr,
                        (y.as_mut_ptr(), ldy),
                    )
                };
                for r in 0..16 {
                    for j in 0..ldy {
                        let got = y[r * ldy + j] as f64;
                        if r >= rows || j >= BK {
                            assert_eq!(got, y0[r * ldy + j] as f64, "rows {rows}: ({r}, {j}) written");
                            continue;
                        }
                        let dot: f64 = terms
                            .iter()
                            .map(|&(a, b)| {
                                (0..ep)
                                    .map(|d| val(x[a * xcs + r * ldx + d]) * weight(b, j, d))
                                    .sum::<f64>()
                            })
                            .sum();
                        let want = dot + if bias { init[j] as f64 } else { 0.0 };
                        assert!(
                            (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                            "rows {rows} terms {terms:?} bias {bias} ({r}, {j}): {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
