//! The K/V packing routines, which also pack the projection weights (`linear`).
//!
//! Packed layouts (all f32, `NR = 16` lanes):
//! * K block of `BK` keys: `BK / NR` panels, each `[E][NR]` (key-minor), i.e. the
//!   transposed operand of the `S = Q·Kᵀ` micro-kernel. Keys past the end are zero.
//! * V block of `BK` keys: `ceil(Ev / NR)` panels, each `[BK][NR]` (column-minor),
//!   the right operand of the `O += P·V` micro-kernel. Columns past `Ev` are zero.
use super::isa::Isa;
use super::tiles::NR;
#[cfg(target_arch = "x86_64")]
use super::view::Data;
use super::view::View;

/// Number of floats in one packed K block (`bk` keys, head dim `e`).
#[inline]
pub(crate) fn k_block_len(bk: usize, e: usize) -> usize {
    bk * e
}

/// Number of floats in one packed V block (`bk` keys, value dim `ev`).
#[inline]
pub(crate) fn v_block_len(bk: usize, ev: usize) -> usize {
    bk * ev.div_ceil(NR) * NR
}

/// Packs keys `j0 .. j0 + nk` of `(b, kvh)` into `dst` (`k_block_len(bk, e)` floats,
/// `nk <= bk`). `tmp` is conversion scratch: it must hold `NR * e` floats, except for
/// f32 keys with unit inner stride, which are read in place (`tmp` may then be empty).
/// With `isa` AVX-512, full
/// panels of unit-stride rows are transposed 16×16 at a time. The same layout serves as
/// the projection weight pack (`linear`: outputs as keys, in-features as `e`).
#[allow(clippy::too_many_arguments)]
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))] // `isa`: x86-64 only
pub(crate) fn pack_k(
    isa: Isa,
    k: &View,
    b: usize,
    kvh: usize,
    j0: usize,
    nk: usize,
    e: usize,
    dst: &mut [f32],
    tmp: &mut [f32],
) {
    let npanels = nk.div_ceil(NR);
    for p in 0..npanels {
        let kk = (nk - p * NR).min(NR);
        let panel = &mut dst[p * e * NR..(p + 1) * e * NR];
        #[cfg(target_arch = "x86_64")]
        if kk == NR && matches!(isa, Isa::Avx512 | Isa::Avx2Fma) && k.strides[3] == 1 {
            // Full panel of unit-stride rows: 16×16 (AVX-512) or 8×8 (AVX2) transposes,
            // from the f32 rows in place or from f16/bf16 rows converted into `tmp`.
            let (base, ld) = (k.row_offset(b, kvh, j0 + p * NR), k.strides[2]);
            let (src, lds) = match k.data {
                Data::F32(s) => (&s[base..base + (NR - 1) * ld + e], ld),
                _ => {
                    for (c, row) in tmp[..NR * e].chunks_exact_mut(e.max(1)).enumerate() {
                        k.read_row(base + c * ld, row, 1.0);
                    }
                    (&tmp[..NR * e], e)
                }
            };
            let full = if isa == Isa::Avx512 {
                let full = e / NR * NR;
                for x0 in (0..full).step_by(NR) {
                    // SAFETY: `Isa::Avx512` is only selected after detection; the 16
                    // rows of 16 at `x0` are inside `src` (bounds above), and their 16
                    // panel rows inside `panel`.
                    unsafe {
                        super::avx512::transpose16(src[x0..].as_ptr(), lds, panel[x0 * NR..].as_mut_ptr(), NR)
                    };
                }
                full
            } else {
                let full = e / 8 * 8;
                for h in 0..NR / 8 {
                    for x0 in (0..full).step_by(8) {
                        // SAFETY: `Isa::Avx2Fma` is only selected after detection; rows
                        // `8h..8h + 8` of the panel's 16 hold columns `x0..x0 + 8 ≤ e`
                        // inside `src` (bounds above), and panel rows `x0..x0 + 8`,
                        // lanes `8h..8h + 8`, lie inside `panel`.
                        unsafe {
                            super::avx2::transpose8(
                                src[8 * h * lds + x0..].as_ptr(),
                                lds,
                                panel[x0 * NR + 8 * h..].as_mut_ptr(),
                                NR,
                            )
                        };
                    }
                }
                full
            };
            for c in 0..NR {
                for x in full..e {
                    panel[x * NR + c] = src[c * lds + x];
                }
            }
            continue;
        }
        if kk < NR {
            panel.fill(0.0);
        }
        for c in 0..kk {
            let off = k.row_offset(b, kvh, j0 + p * NR + c);
            let row = k.row_f32(off, e, tmp);
            for (out, &x) in panel.chunks_exact_mut(NR).zip(row) {
                out[c] = x;
            }
        }
    }
}

/// Packs values `j0 .. j0 + nk` of `(b, kvh)` into `dst` (`v_block_len(bk, ev)` floats,
/// panel stride `bk * NR`). `tmp` must hold at least `ceil(ev / NR) * NR` floats.
#[allow(clippy::too_many_arguments)]
pub(crate) fn pack_v(
    v: &View,
    b: usize,
    kvh: usize,
    j0: usize,
    nk: usize,
    bk: usize,
    ev: usize,
    dst: &mut [f32],
    tmp: &mut [f32],
) {
    let nvp = ev.div_ceil(NR);
    let full = ev / NR;
    let rem = ev - full * NR;
    for jl in 0..nk {
        let off = v.row_offset(b, kvh, j0 + jl);
        let row = v.row_f32(off, ev, &mut tmp[..ev]);
        for n in 0..full {
            let at = n * bk * NR + jl * NR;
            dst[at..at + NR].copy_from_slice(&row[n * NR..(n + 1) * NR]);
        }
        if rem > 0 {
            let at = (nvp - 1) * bk * NR + jl * NR;
            dst[at..at + rem].copy_from_slice(&row[full * NR..]);
            dst[at + rem..at + NR].fill(0.0);
        }
    }
}
