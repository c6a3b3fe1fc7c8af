//! bf16 *components* and the VNNI operand layout of the bf16 pair products, shared by the
//! AMX tile unit (`amx`) and the AVX512-BF16 register tiles (`dpbf16`).
//!
//! Inputs are split into bf16 components whose sum is the input:
//! * bf16 q, k, v are one component each (exact);
//! * f16 q, k, v are `hi + lo` (`hi = bf16(x)`, `lo = bf16(x − hi)`), which is exact,
//!   since f16 has 11 significant bits and bf16 8;
//! * the f32 probabilities P are one bf16 for bf16 inputs (8 significant bits, as
//!   PyTorch's CPU kernel rounds them; the output is bf16 anyway) and `hi + lo` for f16
//!   inputs (16 significant bits, so f16 outputs lose nothing to it).
//!
//! Layouts (`u16` bf16 bits; a tile is 16 rows × 64 bytes = 512 elements):
//! * A operands (Q, P): row-major, per component, rows padded to 16 and the contraction
//!   to 32 with zeros; a tile is 16 rows × 32 elements at the row stride.
//! * B operands (K, V), packed per block of [`BK`] keys and per component, as `VNNI`
//!   tiles: row `r` of a tile holds, for each of its 16 output columns, the contraction
//!   pair `(2r, 2r + 1)`. K: `[panel of 16 keys][E/32 tiles]`; V: `[panel of 16 value
//!   columns][BK/32 tiles]`.
//!
//! The splitting and packing functions need AVX-512 (F, BF16), and no tile state; the
//! sizes (`e_pad`, `k_len`, `v_len`) are plain arithmetic.

use super::avx512::{store_components, tail_mask_full};
use super::tiles::{BK, NR};
use super::view::{Data, View};
use std::arch::x86_64::*;

/// Rows of a tile.
pub(crate) const TM: usize = 16;
/// bf16 elements of a tile row (64 bytes).
pub(crate) const TK: usize = 32;
/// Elements of one tile.
pub(crate) const TILE: usize = TM * TK;

/// Component pairs `(a, b)` summed by a block product.
pub(crate) type Terms = &'static [(usize, usize)];

/// Padded contraction length of Q·Kᵀ.
#[inline]
pub(crate) fn e_pad(e: usize) -> usize {
    e.div_ceil(TK) * TK
}

/// `u16` elements of one packed K block (all components).
pub(crate) fn k_len(e: usize, comps: usize) -> usize {
    comps * (BK / NR) * e_pad(e) / TK * TILE
}

/// `u16` elements of one packed V block (all components).
pub(crate) fn v_len(ev: usize, comps: usize) -> usize {
    comps * ev.div_ceil(NR) * (BK / TK) * TILE
}

/// Splits 16-lane groups of `src` into bf16 components: `hi[x] = bf16(src[x])` and,
/// unless `lo` is null, `lo[x] = bf16(src[x] − hi[x])`. Writes `dst_len` (≥ `src.len()`,
/// a multiple of 16) elements, zero past `src.len()`.
///
/// # Safety
/// AVX-512F and AVX512-BF16 must be available; `hi` (and `lo`) hold `dst_len` elements.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(crate) unsafe fn split(src: &[f32], dst_len: usize, hi: *mut u16, lo: *mut u16) {
    let n = src.len();
    let mut x = 0;
    while x < dst_len {
        let v = if x < n {
            _mm512_maskz_loadu_ps(tail_mask_full(n - x), src.as_ptr().add(x))
        } else {
            _mm512_setzero_ps()
        };
        store_components(v, hi.add(x), if lo.is_null() { lo } else { lo.add(x) });
        x += 16;
    }
}

/// Row `off` (`n` elements) of `src` as bf16 components into `hi` (and `lo`, which may
/// be null when `comps == 1`), `dst_len` elements each, zero past `n`. With unit stride,
/// bf16 sources are copied bit for bit and f16 sources split from their bits; others go
/// through f32 (`tmp` holds `n` floats) and [`split`].
///
/// # Safety
/// As for [`split`].
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn row_components(
    src: &View,
    off: usize,
    n: usize,
    comps: usize,
    dst_len: usize,
    hi: *mut u16,
    lo: *mut u16,
    tmp: &mut [f32],
) {
    if let (Data::BF16(d), 1) = (src.data, comps) {
        if src.strides[3] == 1 || n <= 1 {
            let row = &d[off..off + n];
            std::ptr::copy_nonoverlapping(row.as_ptr() as *const u16, hi, n);
            std::ptr::write_bytes(hi.add(n), 0, dst_len - n);
            return;
        }
    }
    if let (Data::F16(d), 2) = (src.data, comps) {
        if src.strides[3] == 1 || n <= 1 {
            return split_f16(&d[off..off + n], dst_len, hi, lo);
        }
    }
    let row = src.row_f32(off, n, tmp);
    split(
        row,
        dst_len,
        hi,
        if comps > 1 { lo } else { std::ptr::null_mut() },
    );
}

/// [`split`] of f16 values into `hi + lo` straight from their bits (widened in registers).
///
/// # Safety
/// As for [`split`]; `lo` holds `dst_len` elements too.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn split_f16(src: &[half::f16], dst_len: usize, hi: *mut u16, lo: *mut u16) {
    let n = src.len();
    let p = src.as_ptr() as *const u16;
    let mut x = 0;
    while x < dst_len {
        let v = if x + 16 <= n {
            _mm512_cvtph_ps(_mm256_loadu_si256(p.add(x) as *const __m256i))
        } else {
            let mut t = [0u16; 16];
            if x < n {
                std::ptr::copy_nonoverlapping(p.add(x), t.as_mut_ptr(), n - x);
            }
            _mm512_cvtph_ps(_mm256_loadu_si256(t.as_ptr() as *const __m256i))
        };
        store_components(v, hi.add(x), lo.add(x));
        x += 16;
    }
}

/// Stages rows `j0 .. j0 + nk` of `(b, kvh)` as bf16 components in `rows`: component
/// `c`, row `j` at `(c·BK + j)·wpad`, `width` elements zero-padded to `wpad`; rows
/// `nk..BK` are zero (a padding key must not poison the products: 0 · NaN = NaN).
///
/// # Safety
/// As for [`split`]; `rows` holds `comps × BK × wpad` elements, `tmp` `width` floats.
unsafe fn stage_rows(
    src: &View,
    (b, kvh, j0, nk): (usize, usize, usize, usize),
    (width, wpad): (usize, usize),
    comps: usize,
    rows: &mut [u16],
    tmp: &mut [f32],
) {
    let rlen = BK * wpad;
    for c in 0..comps {
        rows[c * rlen + nk * wpad..(c + 1) * rlen].fill(0);
    }
    let base = rows.as_mut_ptr();
    for j in 0..nk {
        let off = src.row_offset(b, kvh, j0 + j);
        let lo = if comps > 1 {
            base.add(rlen + j * wpad)
        } else {
            std::ptr::null_mut()
        };
        row_components(src, off, width, comps, wpad, base.add(j * wpad), lo, tmp);
    }
}

/// The rows `j0 .. j0 + BK` of `(b, kvh)` read in place, when staging them would only
/// copy: a bf16 source (one component) with unit inner stride, a full block of [`BK`]
/// rows, `width == wpad`, and an even row stride (the K transposes read 32-bit pairs).
/// Returns the elements from row `j0` to the end of row `j0 + BK − 1` and the row stride.
fn direct_rows<'a>(
    src: &View<'a>,
    (b, kvh, j0, nk): (usize, usize, usize, usize),
    (width, wpad): (usize, usize),
    comps: usize,
) -> Option<(&'a [u16], usize)> {
    let Data::BF16(d) = src.data else {
        return None;
    };
    let rs = src.strides[2];
    if comps != 1 || src.strides[3] != 1 || nk != BK || width != wpad || !rs.is_multiple_of(2) || rs < width {
        return None;
    }
    let off = src.row_offset(b, kvh, j0);
    let rows = d.get(off..off + (BK - 1) * rs + width)?;
    // SAFETY: bf16 is a 16-bit plain-old-data type; the slice is reinterpreted in place.
    Some((
        unsafe { std::slice::from_raw_parts(rows.as_ptr() as *const u16, rows.len()) },
        rs,
    ))
}

/// Packs keys `j0 .. j0 + nk` (≤ [`BK`]) of `(b, kvh)` into `dst` ([`k_len`] elements).
/// `rows` is scratch of `comps × BK × e_pad(e)` elements, `tmp` of `e` floats.
///
/// # Safety
/// AVX-512F and AVX512-BF16 must be available (`amx::available` or `dpbf16::available`
/// returned true); no tile state is used.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn pack_k(
    k: &View,
    b: usize,
    kvh: usize,
    j0: usize,
    nk: usize,
    e: usize,
    comps: usize,
    dst: &mut [u16],
    rows: &mut [u16],
    tmp: &mut [f32],
) {
    let ep = e_pad(e);
    let rlen = BK * ep;
    assert!(nk <= BK && dst.len() >= k_len(e, comps) && rows.len() >= comps * rlen && tmp.len() >= e);
    let (staged, rs) = match direct_rows(k, (b, kvh, j0, nk), (e, ep), comps) {
        Some(direct) => direct,
        None => {
            stage_rows(k, (b, kvh, j0, nk), (e, ep), comps, rows, tmp);
            (&rows[..comps * rlen], ep)
        }
    };
    // VNNI: tile (panel, t) row r, key c = the u32 pair (2r, 2r + 1) of key
    // `panel·16 + c` in contraction tile t.
    let kt = ep / TK;
    let clen = (BK / NR) * kt * TILE;
    // That is a 16×16 transpose of 32-bit pairs: the 16 keys' pairs of tile t (rows of
    // stride `rs / 2` pairs) become the tile's 16 rows of 16 pairs.
    for c in 0..comps {
        let src = &staged[c * rlen..];
        for panel in 0..BK / NR {
            for t in 0..kt {
                let tile = &mut dst[c * clen + (panel * kt + t) * TILE..][..TILE];
                let first = &src[panel * NR * rs + t * TK..(panel * NR + NR - 1) * rs + (t + 1) * TK];
                // SAFETY: `first` holds the 16 key rows of 32 elements at stride `rs`
                // (bounds checked by the slice), `tile` 16 rows of 32; the transpose
                // only moves bits, and AVX-512F comes with the caller's check.
                unsafe {
                    super::avx512::transpose16(
                        first.as_ptr() as *const f32,
                        rs / 2,
                        tile.as_mut_ptr() as *mut f32,
                        TK / 2,
                    )
                };
            }
        }
    }
}

/// Packs values `j0 .. j0 + nk` (≤ [`BK`]) of `(b, kvh)` into `dst` ([`v_len`]
/// elements). `rows` is scratch of `comps × BK × ceil(ev/16)·16` elements, `tmp` of `ev` floats.
///
/// # Safety
/// AVX-512F and AVX512-BF16 must be available (`amx::available` or `dpbf16::available`
/// returned true); no tile state is used.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn pack_v(
    v: &View,
    b: usize,
    kvh: usize,
    j0: usize,
    nk: usize,
    ev: usize,
    comps: usize,
    dst: &mut [u16],
    rows: &mut [u16],
    tmp: &mut [f32],
) {
    let evp = ev.div_ceil(NR) * NR;
    let rlen = BK * evp;
    assert!(nk <= BK && dst.len() >= v_len(ev, comps) && rows.len() >= comps * rlen && tmp.len() >= ev);
    let (staged, rs) = match direct_rows(v, (b, kvh, j0, nk), (ev, evp), comps) {
        Some(direct) => direct,
        None => {
            stage_rows(v, (b, kvh, j0, nk), (ev, evp), comps, rows, tmp);
            (&rows[..comps * rlen], evp)
        }
    };
    // VNNI: tile (panel, t) row r, column c = values (key t·32 + 2r, column panel·16 + c)
    // and (key t·32 + 2r + 1, same column).
    let nvp = evp / NR;
    let clen = nvp * (BK / TK) * TILE;
    for c in 0..comps {
        let src = &staged[c * rlen..];
        for panel in 0..nvp {
            for t in 0..BK / TK {
                let tile = &mut dst[c * clen + (panel * (BK / TK) + t) * TILE..][..TILE];
                for r in 0..TM {
                    let k0 = &src[(t * TK + 2 * r) * rs + panel * NR..][..NR];
                    let k1 = &src[(t * TK + 2 * r + 1) * rs + panel * NR..][..NR];
                    // The two keys' 16 values interleaved: each 32-bit lane is the pair
                    // (k0[col], k1[col]), k0 in the low half.
                    // SAFETY: `k0`, `k1` hold 16 elements and `tile` row `r` 32 (bounds
                    // checked by the slices); AVX-512F comes with the caller's check.
                    unsafe {
                        let lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(k0.as_ptr() as *const __m256i));
                        let hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(k1.as_ptr() as *const __m256i));
                        let pairs = _mm512_or_si512(lo, _mm512_slli_epi32::<16>(hi));
                        _mm512_storeu_si512(tile[r * TK..(r + 1) * TK].as_mut_ptr() as *mut _, pairs);
                    }
                }
            }
        }
    }
}
