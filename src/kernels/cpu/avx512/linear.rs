//! The AVX-512 projection product `y = x · Wᵀ (+ b)` ([`gemm`]) on 14-row register tiles.

use super::*;

/// Rows per [`gemm`] register tile.
pub(crate) const GEMM_ROWS: usize = 14;

/// One contraction chunk `k0..k1` of `y = x · Wᵀ (+ b)` for `rows` rows of `x` (whole
/// `GEMM_ROWS`-row strips, then one shorter strip for the rest), read in place
/// (row-major, row stride `ldx`), against `W` packed into
/// 16-output panels `[npanels][e][NR]` (`e`: the full contraction length). `y` is
/// row-major with row stride `ldy`; its first `out` columns are written (the last panel
/// with a masked store). The first chunk (`!accumulate`) overwrites `y` with the product
/// plus `b` (when given, `b.len() >= out`); later chunks add to it. Panel pairs are the
/// outer loop, so a pair stays in L1 while the row strips stream past it.
///
/// # Safety
/// AVX-512F must be available, and `y` must hold `rows` rows of stride `ldy`.
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
    let (strips, tail) = (rows / GEMM_ROWS, rows % GEMM_ROWS);
    // A decode step's 2 or more rows (no whole strip) read each panel once, from memory:
    // ask for the panels' lines ahead (`prefetch::avx512_gemm_ahead`). One row ran as
    // fast without.
    let ahead = if strips == 0 && rows >= 2 {
        super::super::prefetch::avx512_gemm_ahead()
    } else {
        0
    };
    // Whole strips ask for the panels' lines `GEMM_LOOP_AHEAD` steps ahead on the CPUs
    // where that pays (`prefetch::avx512_gemm_strips`).
    let strip_ahead = if super::super::prefetch::avx512_gemm_strips() {
        GEMM_LOOP_AHEAD
    } else {
        0
    };
    let bias = b.map_or(std::ptr::null(), |b| b.as_ptr());
    let kc = k1 - k0;
    let mask = |p: usize| -> __mmask16 {
        let live = out - p * NR;
        if live >= NR {
            0xffff
        } else {
            (1u16 << live) - 1
        }
    };
    // SAFETY: `x` and `wp` bounds asserted above; the caller guarantees `y` and the
    // features.
    unsafe {
        let mut p = 0;
        while p < npanels {
            let wpp = wp.as_ptr().add(p * e * NR + k0 * NR);
            let bp = if bias.is_null() { bias } else { bias.add(p * NR) };
            let two = p + 1 < npanels;
            let (m2, m1) = ([mask(p), if two { mask(p + 1) } else { 0 }], [mask(p)]);
            for st in 0..strips {
                let xk = x.as_ptr().add(st * GEMM_ROWS * ldx + k0);
                let yp = y.add(st * GEMM_ROWS * ldy + p * NR);
                let t = (xk, ldx, kc, wpp, e * NR, yp, ldy, bp, accumulate, strip_ahead);
                match two {
                    true => gemm_tile::<GEMM_ROWS, 2>(t, m2),
                    false => gemm_tile::<GEMM_ROWS, 1>(t, m1),
                }
            }
            if tail > 0 {
                // The last `tail` rows: a shorter tile, in the same pass over the panels.
                let xk = x.as_ptr().add(strips * GEMM_ROWS * ldx + k0);
                let yp = y.add(strips * GEMM_ROWS * ldy + p * NR);
                let t = (xk, ldx, kc, wpp, e * NR, yp, ldy, bp, accumulate, ahead);
                macro_rules! short {
                    ($($r:literal)*) => {
                        match (tail, two) {
                            $(
                                ($r, true) => gemm_tile::<$r, 2>(t, m2),
                                ($r, false) => gemm_tile::<$r, 1>(t, m1),
                            )*
                            _ => unreachable!("a tail is shorter than GEMM_ROWS"),
                        }
                    };
                }
                short!(1 2 3 4 5 6 7 8 9 10 11 12 13);
            }
            p += if two { 2 } else { 1 };
        }
    }
}

/// `(x, ldx, kc, W panels, panel stride, y, ldy, bias, accumulate, contraction steps
/// ahead to ask for the panels' lines, 0 for none)` of a [`gemm_tile`].
type GemmArgs = (
    *const f32,
    usize,
    usize,
    *const f32,
    usize,
    *mut f32,
    usize,
    *const f32,
    bool,
    usize,
);

/// An `R × (P·NR)` tile of [`gemm`]: rows of `x` broadcast from their row-major place,
/// `P` consecutive W panels (stride `panel_len`), stores masked by `masks`; the output
/// starts from `y` (`acc`), else from the bias (when not null) or zero.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn gemm_tile<const R: usize, const P: usize>(
    (x, ldx, kc, wpp, panel_len, y, ldy, bias, acc_y, ahead): GemmArgs,
    masks: [__mmask16; P],
) {
    let mut acc = [[_mm512_setzero_ps(); P]; R];
    for (r, row) in acc.iter_mut().enumerate() {
        for (pi, v) in row.iter_mut().enumerate() {
            if acc_y {
                *v = _mm512_maskz_loadu_ps(masks[pi], y.add(r * ldy + pi * NR));
            } else if !bias.is_null() {
                *v = _mm512_maskz_loadu_ps(masks[pi], bias.add(pi * NR));
            }
        }
    }
    if P == 2 && R == GEMM_ROWS {
        let mut a2 = [[_mm512_setzero_ps(); 2]; GEMM_ROWS];
        for (d, s) in a2.iter_mut().zip(acc.iter()) {
            d.copy_from_slice(&s[..2]);
        }
        if ahead > 0 {
            debug_assert_eq!(ahead, GEMM_LOOP_AHEAD, "the assembly's distance is fixed");
            gemm_loop_2p_ahead(&mut a2, x, ldx, kc, wpp, panel_len);
        } else {
            gemm_loop_2p(&mut a2, x, ldx, kc, wpp, panel_len);
        }
        for (d, s) in acc.iter_mut().zip(a2.iter()) {
            d.copy_from_slice(&s[..P]);
        }
    } else {
        for k in 0..kc {
            let mut wv = [_mm512_setzero_ps(); P];
            for (pi, v) in wv.iter_mut().enumerate() {
                if ahead > 0 {
                    // One 64-byte panel row per step: the line `ahead` steps on.
                    let next = wpp.wrapping_add(pi * panel_len + (k + ahead) * NR);
                    prefetch_bytes(next as *const u8, 64);
                }
                *v = _mm512_loadu_ps(wpp.add(pi * panel_len + k * NR));
            }
            for (r, row) in acc.iter_mut().enumerate() {
                let a = _mm512_set1_ps(*x.add(r * ldx + k));
                for pi in 0..P {
                    row[pi] = _mm512_fmadd_ps(a, wv[pi], row[pi]);
                }
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        for (pi, &v) in row.iter().enumerate() {
            _mm512_mask_storeu_ps(y.add(r * ldy + pi * NR), masks[pi], v);
        }
    }
}

/// One contraction step of [`gemm_loop_2p`] as assembly text: the W pair at byte
/// offset `$dw` from `{w}`, the row elements at byte offset `$dx` from their row. With
/// `ahead`, the step first asks for the W pair's lines [`GEMM_LOOP_AHEAD`] steps on
/// (1 KiB further into each panel; the displacement below must stay `64 ×` it).
macro_rules! gemm_step {
    ($dx:literal, $dw:literal, ahead) => {
        concat!(
            "prefetcht0 [{w} + ",
            $dw,
            " + 1024]\n",
            "prefetcht0 [{w} + {pl} + ",
            $dw,
            " + 1024]\n",
            gemm_step!($dx, $dw)
        )
    };
    ($dx:literal, $dw:literal) => {
        concat!(
            "vmovups zmm28, zmmword ptr [{w} + ",
            $dw,
            "]\n",
            "vmovups zmm29, zmmword ptr [{w} + {pl} + ",
            $dw,
            "]\n",
            "vbroadcastss zmm30, dword ptr [{g0} + ",
            $dx,
            "]\n",
            "vfmadd231ps zmm0, zmm30, zmm28\n",
            "vfmadd231ps zmm1, zmm30, zmm29\n",
            "vbroadcastss zmm30, dword ptr [{g0} + {l} + ",
            $dx,
            "]\n",
            "vfmadd231ps zmm2, zmm30, zmm28\n",
            "vfmadd231ps zmm3, zmm30, zmm29\n",
            "vbroadcastss zmm30, dword ptr [{g0} + {l}*2 + ",
            $dx,
            "]\n",
            "vfmadd231ps zmm4, zmm30, zmm28\n",
            "vfmadd231ps zmm5, zmm30, zmm29\n",
            "vbroadcastss zmm30, dword ptr [{g0} + {l3} + ",
            $dx,
            "]\n",
            "vfmadd231ps zmm6, zmm30, zmm28\n",
            "vfmadd231ps zmm7, zmm30, zmm29\n",
            "vbroadcastss zmm30, dword ptr [{g1} + ",
            $dx,
            "]\n",
            "vfmadd231ps zmm8, zmm30, zmm28\n",
            "vfmadd231ps zmm9, zmm30, zmm29\n",
            "vbroadcastss zmm30, dword ptr [{g1} + {l} + ",
            $dx,
            "]\n",
            "vfmadd231ps zmm10, zmm30, zmm28\n",
            "vfmadd231ps zmm11, zmm30, zmm29\n",
            "vbroadcastss zmm30, dword ptr [{g1} + {l}*2 + ",
            $dx,
            "]\n",
            "vfmadd231ps zmm12, zmm30, zmm28\n",
            "vfmadd231ps zmm13, zmm30, zmm29\n",
            "vbroadcastss zmm30, dword ptr [{g1} + {l3} + ",
            $dx,
            "]\n",
            "vfmadd231ps zmm14, zmm30, zmm28\n",
            "vfmadd231ps zmm15, zmm30, zmm29\n",
            "vbroadcastss zmm30, dword ptr [{g2} + ",
            $dx,
            "]\n",
            "vfmadd231ps zmm16, zmm30, zmm28\n",
            "vfmadd231ps zmm17, zmm30, zmm29\n",
            "vbroadcastss zmm30, dword ptr [{g2} + {l} + ",
            $dx,
            "]\n",
            "vfmadd231ps zmm18, zmm30, zmm28\n",
            "vfmadd231ps zmm19, zmm30, zmm29\n",
            "vbroadcastss zmm30, dword ptr [{g2} + {l}*2 + ",
            $dx,
            "]\n",
            "vfmadd231ps zmm20, zmm30, zmm28\n",
            "vfmadd231ps zmm21, zmm30, zmm29\n",
            "vbroadcastss zmm30, dword ptr [{g2} + {l3} + ",
            $dx,
            "]\n",
            "vfmadd231ps zmm22, zmm30, zmm28\n",
            "vfmadd231ps zmm23, zmm30, zmm29\n",
            "vbroadcastss zmm30, dword ptr [{g3} + ",
            $dx,
            "]\n",
            "vfmadd231ps zmm24, zmm30, zmm28\n",
            "vfmadd231ps zmm25, zmm30, zmm29\n",
            "vbroadcastss zmm30, dword ptr [{g3} + {l} + ",
            $dx,
            "]\n",
            "vfmadd231ps zmm26, zmm30, zmm28\n",
            "vfmadd231ps zmm27, zmm30, zmm29\n",
        )
    };
}

macro_rules! gemm_loop {
    ($(#[$doc:meta])* $name:ident $(, $ahead:ident)?) => {
        $(#[$doc])*
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn $name(
            acc: &mut [[__m512; 2]; GEMM_ROWS],
            x: *const f32,
            ldx: usize,
            kc: usize,
            w: *const f32,
            panel_len: usize,
        ) {
            if kc == 0 {
                return;
            }
            // SAFETY: the caller guarantees `GEMM_ROWS` rows of `kc` elements at stride `ldx`
            // from `x`, and two panels of `kc` steps of 16 floats at `w` and `w + panel_len`.
            unsafe {
                std::arch::asm!(
                    // Four steps per iteration (the pointer updates are shared), then the rest.
                    "test {q}, {q}",
                    "jz 3f",
                    "2:",
                    gemm_step!("0", "0" $(, $ahead)?),
                    gemm_step!("4", "64" $(, $ahead)?),
                    gemm_step!("8", "128" $(, $ahead)?),
                    gemm_step!("12", "192" $(, $ahead)?),
                    "add {g0}, 16",
                    "add {g1}, 16",
                    "add {g2}, 16",
                    "add {g3}, 16",
                    "add {w}, 256",
                    "dec {q}",
                    "jnz 2b",
                    "3:",
                    "test {r}, {r}",
                    "jz 5f",
                    "4:",
                    gemm_step!("0", "0" $(, $ahead)?),
                    "add {g0}, 4",
                    "add {g1}, 4",
                    "add {g2}, 4",
                    "add {g3}, 4",
                    "add {w}, 64",
                    "dec {r}",
                    "jnz 4b",
                    "5:",
                    inout("zmm0") acc[0][0],
                    inout("zmm1") acc[0][1],
                    inout("zmm2") acc[1][0],
                    inout("zmm3") acc[1][1],
                    inout("zmm4") acc[2][0],
                    inout("zmm5") acc[2][1],
                    inout("zmm6") acc[3][0],
                    inout("zmm7") acc[3][1],
                    inout("zmm8") acc[4][0],
                    inout("zmm9") acc[4][1],
                    inout("zmm10") acc[5][0],
                    inout("zmm11") acc[5][1],
                    inout("zmm12") acc[6][0],
                    inout("zmm13") acc[6][1],
                    inout("zmm14") acc[7][0],
                    inout("zmm15") acc[7][1],
                    inout("zmm16") acc[8][0],
                    inout("zmm17") acc[8][1],
                    inout("zmm18") acc[9][0],
                    inout("zmm19") acc[9][1],
                    inout("zmm20") acc[10][0],
                    inout("zmm21") acc[10][1],
                    inout("zmm22") acc[11][0],
                    inout("zmm23") acc[11][1],
                    inout("zmm24") acc[12][0],
                    inout("zmm25") acc[12][1],
                    inout("zmm26") acc[13][0],
                    inout("zmm27") acc[13][1],
                    out("zmm28") _,
                    out("zmm29") _,
                    out("zmm30") _,
                    g0 = inout(reg) x => _,
                    g1 = inout(reg) x.add(4 * ldx) => _,
                    g2 = inout(reg) x.add(8 * ldx) => _,
                    g3 = inout(reg) x.add(12 * ldx) => _,
                    w = inout(reg) w => _,
                    q = inout(reg) kc / 4 => _,
                    r = inout(reg) kc % 4 => _,
                    l = in(reg) ldx * 4,
                    l3 = in(reg) ldx * 12,
                    pl = in(reg) panel_len * 4,
                    options(nostack, readonly),
                );
            }
        }
    };
}

gemm_loop!(
    /// The contraction loop of a `GEMM_ROWS`×32 [`gemm_tile`] in assembly: per step two W
    /// loads, `GEMM_ROWS` broadcasts and `2·GEMM_ROWS` FMAs. Rows are addressed as
    /// `group + j·ldx` (one group pointer per four rows, `j < 4`), so the loop carries no
    /// per-row integer work competing with the FMAs for execution ports (the compiled
    /// intrinsics recomputed row addresses each step); unrolled by four steps, which shares
    /// the pointer updates (3% faster on a 1024×768×768 product).
    gemm_loop_2p
);

gemm_loop!(
    /// [`gemm_loop_2p`] that also asks for the W panels' lines [`GEMM_LOOP_AHEAD`] steps
    /// ahead of the step that reads them (`prefetcht0`, two per step; the products and
    /// their order are those of [`gemm_loop_2p`]). See [`super::super::prefetch::avx512_gemm_strips`].
    gemm_loop_2p_ahead,
    ahead
);

/// How many contraction steps ahead [`gemm_loop_2p_ahead`] asks for the W panels' lines
/// (its assembly writes the byte distance, `64 ×` this). On the Intel VM every distance
/// from 4 to 64 steps took less time than none, by amounts within one another's noise
/// (kernel notes).
pub(crate) const GEMM_LOOP_AHEAD: usize = 16;
const _: () = assert!(
    GEMM_LOOP_AHEAD * 64 == 1024,
    "`gemm_step!` writes the distance as 1024 bytes"
);

#[cfg(test)]
mod tests {
    use super::*;

    /// A whole strip of the projection product (`gemm_tile::<GEMM_ROWS, 2>`, the assembly
    /// loop) gives the same bits with the W panels asked for ahead as without, and
    /// matches an f64 product: contractions around the unrolling by four (0–9), odd
    /// lengths and a full 768-step chunk, from the bias, from zero and accumulating
    /// into `y`, with the second panel's last outputs masked off.
    #[test]
    fn gemm_strip_matches_f64_with_and_without_asking_ahead() {
        if !is_x86_feature_detected!("avx512f") {
            eprintln!("note: no AVX-512F on this machine; gemm strips not exercised");
            return;
        }
        let val = |i: usize, m: usize| ((i * 37 + m) % 101) as f32 / 50.0 - 1.0;
        for kc in [0usize, 1, 2, 3, 4, 5, 7, 8, 9, 33, 768] {
            let ldx = kc + 3;
            let x: Vec<f32> = (0..GEMM_ROWS * ldx).map(|i| val(i, 1)).collect();
            let panel_len = kc * NR;
            // Two panels `[kc][16]` (the loop asks for lines past their end too: a
            // prefetch reads nothing and cannot fault).
            let w: Vec<f32> = (0..2 * panel_len).map(|i| val(i, 5)).collect();
            let bias: Vec<f32> = (0..2 * NR).map(|i| val(i, 7)).collect();
            let ldy = 2 * NR + 5;
            let y0: Vec<f32> = (0..GEMM_ROWS * ldy).map(|i| val(i, 9)).collect();
            let masks = [0xffff, 0x7fff];
            for (start, acc_y) in [(0, false), (1, false), (2, true)] {
                let bp = if start == 1 {
                    bias.as_ptr()
                } else {
                    std::ptr::null()
                };
                let run = |ahead: usize| {
                    let mut y = y0.clone();
                    let t = (
                        x.as_ptr(),
                        ldx,
                        kc,
                        w.as_ptr(),
                        panel_len,
                        y.as_mut_ptr(),
                        ldy,
                        bp,
                        acc_y,
                        ahead,
                    );
                    // SAFETY: AVX-512F detected above; `x` holds GEMM_ROWS rows of `kc`
                    // at stride `ldx`, `w` two panels of `kc` steps, `y` GEMM_ROWS rows
                    // of stride `ldy ≥ 32`.
                    unsafe { gemm_tile::<GEMM_ROWS, 2>(t, masks) };
                    y
                };
                let (plain, ahead) = (run(0), run(GEMM_LOOP_AHEAD));
                assert!(
                    plain.iter().zip(&ahead).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "kc {kc}, start {start}: asking ahead changed the result"
                );
                for r in 0..GEMM_ROWS {
                    for c in 0..ldy {
                        let (p, j) = (c / NR, c % NR);
                        let stored = c < 2 * NR && (masks[p.min(1)] >> j) & 1 == 1;
                        let terms: Vec<f64> = if stored {
                            (0..kc)
                                .map(|k| x[r * ldx + k] as f64 * w[p * panel_len + k * NR + j] as f64)
                                .collect()
                        } else {
                            Vec::new()
                        };
                        let want = match (stored, start) {
                            (false, _) => y0[r * ldy + c] as f64,
                            (true, 1) => bias[c] as f64 + terms.iter().sum::<f64>(),
                            (true, 2) => y0[r * ldy + c] as f64 + terms.iter().sum::<f64>(),
                            _ => terms.iter().sum::<f64>(),
                        };
                        let scale = 1.0 + terms.iter().map(|t| t.abs()).sum::<f64>();
                        let got = plain[r * ldy + c] as f64;
                        assert!(
                            (got - want).abs() <= 1e-6 * scale,
                            "kc {kc}, start {start}, row {r}, column {c}: {got} against {want}"
                        );
                    }
                }
            }
        }
    }
}
