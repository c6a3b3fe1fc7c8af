//! AVX-512F micro-kernels: 6×64 register tiles (24 zmm accumulators, 4 panel loads and 6
//! broadcasts per step) wherever a block has 64 keys or outputs, 12×32 tiles (2 panel
//! loads, 12 broadcasts) for the rest, with 6-row and 16-key tails. The packed layouts
//! are the AVX2 ones (`pack`): a zmm register holds exactly one 16-lane panel row, and a
//! 12-row tile reads two 6-row Q strips.
//!
//! Every function here is `unsafe` and requires a CPU with AVX-512F (the softmax also
//! AVX512DQ, for `vreduceps`); the dispatcher only selects `Isa::Avx512` after runtime
//! detection of both.

use super::prefetch::prefetch_bytes;
use super::tiles::{BK, MR, NR};
use super::view::Data;
use std::arch::x86_64::*;

/// 16-lane `2^x`: `x = n + f` (`n = floor(x)`, `0 ≤ f < 1`, `f` in one `vreduceps`), a
/// degree-5 polynomial for `2^f` (fitted for relative error with `2^0 = 1` exact;
/// < 8.3e-8 in exact arithmetic, < 1.6e-7 evaluated in f32) and `vscalefps` for the `2^n`
/// factor. Inputs below -126 (including -inf) give exactly 0, NaN gives 0: the one
/// compare that finds them zeroes those lanes, so no clamp is needed (the polynomial's
/// value there, NaN for -inf, is never used).
///
/// # Safety
/// The CPU must support AVX-512F and AVX512DQ.
#[inline]
#[target_feature(enable = "avx512f,avx512dq")]
pub(crate) unsafe fn exp2_512(x: __m512) -> __m512 {
    let valid = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, _mm512_set1_ps(-126.0));
    let f = _mm512_reduce_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(x);
    let mut y = _mm512_set1_ps(1.867_126_3e-3);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.017_038e-3));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.579_991e-2));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.240_164_46));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.693_151_3));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0));
    _mm512_maskz_scalef_ps(valid, y, x)
}

/// [`exp2_512`] on the lanes of `keep` (0 elsewhere) with a shorter polynomial, for the
/// AMX path, where the probabilities are rounded to bf16 components anyway: degree 3
/// (relative error < 1.1e-4, against 2⁻⁹ for one bf16) when `HI_ONLY`, else degree 4
/// (< 3e-6, against 2⁻¹⁶ for `hi + lo`). Lanes below -126 (-inf included) give 0, as in
/// [`exp2_512`]; the one masked compare that finds them also applies `keep`, and the
/// polynomial's value in lanes it drops (NaN for -inf) is never used, so no clamp is
/// needed.
///
/// # Safety
/// The CPU must support AVX-512F and AVX512DQ.
#[inline]
#[target_feature(enable = "avx512f,avx512dq")]
unsafe fn exp2_512_short<const HI_ONLY: bool>(x: __m512, keep: __mmask16) -> __m512 {
    let valid = _mm512_mask_cmp_ps_mask::<_CMP_GE_OQ>(keep, x, _mm512_set1_ps(-126.0));
    // `x − floor(x)` in one instruction (AVX512DQ `vreduceps`); `vscalefps` multiplies by
    // 2^floor(x). The polynomials approximate 2^f on [0, 1): they are the minimax ones on
    // [-0.5, 0.5] shifted by one half and scaled by √2, with the same relative error.
    let f = _mm512_reduce_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(x);
    let y = if HI_ONLY {
        let mut y = _mm512_set1_ps(7.779_365e-2);
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.225_846_17));
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.696_258_67));
        _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.999_898_5))
    } else {
        let mut y = _mm512_set1_ps(1.355_212_7e-2);
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.195_923e-2));
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.241_485_03));
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.692_995_13));
        _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.000_002_8))
    };
    _mm512_maskz_scalef_ps(valid, y, x)
}

/// How far (log2) a row's running maximum may fall behind a new block's maximum before
/// the AMX softmax rescales: the lazy rescaling of FlashAttention-4. Probabilities then
/// stay below 2^8 = 256, far inside the f32 and bf16 range, and the normalisation by the
/// row sum at the end is unchanged.
const LAZY_RESCALE_LOG2: f32 = 8.0;

/// Element kinds of the decode kernels' K/V rows, read straight from the source tensor
/// and widened to f32 in registers.
const F32: u8 = 0;
const BF16: u8 = 1;
const F16: u8 = 2;

/// Bytes per element of kind `T`.
#[inline]
const fn elem_bytes<const T: u8>() -> usize {
    if T == F32 {
        4
    } else {
        2
    }
}

/// What the row-reading score kernels ([`qk_dot_raw`]) ask for ahead of reading it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Ahead {
    /// Nothing.
    Off,
    /// Each K row `n` rows ahead, whole, as a row is read (decode: the rows of one head,
    /// at any row stride, mostly of 64–256 elements).
    Keys(usize),
    /// Each 64-byte line `n` bytes past the one being read (`linear`: weight rows of
    /// thousands of elements stored one after the other, read as one stream).
    Bytes(usize),
}

impl Ahead {
    /// How far past the start of the row being read (rows `ldk` elements of `size` bytes
    /// apart) [`Ahead::Keys`] and [`Ahead::Bytes`] ask, in bytes (0 for [`Ahead::Off`]).
    #[inline]
    fn row_offset(self, ldk: usize, size: usize) -> usize {
        match self {
            Ahead::Off => 0,
            Ahead::Keys(n) => n * ldk * size,
            Ahead::Bytes(n) => n,
        }
    }
}

/// 16 elements of kind `T` at element index `idx` of `p`, as f32.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load16<const T: u8>(p: *const u8, idx: usize) -> __m512 {
    match T {
        F32 => _mm512_loadu_ps((p as *const f32).add(idx)),
        BF16 => {
            let h = _mm256_loadu_si256((p as *const u16).add(idx) as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
        _ => _mm512_cvtph_ps(_mm256_loadu_si256((p as *const u16).add(idx) as *const __m256i)),
    }
}

/// The 32 bf16 elements at `p` as two f32 vectors, the even elements (0, 2, …, 30) and
/// the odd ones: one shift and one mask, where widening 16 at a time takes a widening
/// move and a shift for each half. (Little-endian: element `2i` is the low half of
/// 32-bit lane `i`.)
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load32_bf16_split(p: *const u16) -> (__m512, __m512) {
    let v = _mm512_loadu_si512(p as *const __m512i);
    let odd = _mm512_and_si512(v, _mm512_set1_epi32(0xffff_0000u32 as i32));
    (
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v)),
        _mm512_castsi512_ps(odd),
    )
}

/// Puts each whole 32-element group of `row` in the split layout of
/// [`load32_bf16_split`]: its 16 even elements, then its 16 odd ones. A tail of fewer
/// than 32 stays as it is.
pub(super) fn split_pairs(row: &mut [f32]) {
    for g in row.chunks_exact_mut(32) {
        let t: [f32; 32] = std::array::from_fn(|i| g[(i % 16) * 2 + i / 16]);
        g.copy_from_slice(&t);
    }
}

/// The inverse of [`split_pairs`] on the first `groups` 32-element groups of `row`.
pub(super) fn merge_pairs(row: &mut [f32], groups: usize) {
    for g in row.chunks_exact_mut(32).take(groups) {
        let t: [f32; 32] = std::array::from_fn(|i| g[(i % 2) * 16 + i / 2]);
        g.copy_from_slice(&t);
    }
}

/// See [`super::portable::qk`], except that Q is row-major (row stride `e`), not
/// strip-packed: the 6-row tiles broadcast from six row pointers, so the driver skips
/// the strip pack on this ISA. `rows` must be a multiple of [`MR`].
///
/// # Safety
/// AVX-512F must be available.
pub(super) unsafe fn qk(
    q: &[f32],
    rows: usize,
    e: usize,
    kp: &[f32],
    npanels: usize,
    s: &mut [f32],
    lds: usize,
) {
    assert!(rows.is_multiple_of(MR) && lds >= npanels * NR);
    assert!(q.len() >= rows * e && kp.len() >= npanels * e * NR);
    assert!(rows == 0 || s.len() >= (rows - 1) * lds + npanels * NR);
    // SAFETY: bounds asserted above; features guaranteed by the caller.
    unsafe { qk_impl(q.as_ptr(), rows, e, kp.as_ptr(), npanels, s.as_mut_ptr(), lds) }
}

/// Scores and softmax of one full, wholly visible 64-key block in one pass (no explicit
/// mask): each 6-row strip's 6×64 score tile ([`rows_loop_6x4`], Q row-major with row
/// stride `e`) goes through [`softmax_regs`] while still in registers, and only the
/// probabilities are stored (`s`, row stride `lds`). Rows `live..rows` are padding:
/// their scores (0) are stored as they are. `m`, `l` and `alpha` are updated for the
/// first `live` rows, as by [`online_rows_lazy`].
///
/// # Safety
/// AVX-512F and AVX512DQ must be available.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512dq")]
pub(super) unsafe fn qk_softmax(
    q: &[f32],
    (rows, live): (usize, usize),
    e: usize,
    kp: &[f32],
    s: &mut [f32],
    lds: usize,
    (m, l, alpha): (&mut [f32], &mut [f32], &mut [f32]),
) {
    assert!(rows.is_multiple_of(MR) && live <= rows && lds >= BK && BK == 4 * NR);
    assert!(q.len() >= rows * e && kp.len() >= BK * e);
    assert!(rows == 0 || s.len() >= (rows - 1) * lds + BK);
    assert!(m.len() >= live && l.len() >= live && alpha.len() >= live);
    let (qp, kpp, sp) = (q.as_ptr(), kp.as_ptr(), s.as_mut_ptr());
    for st in 0..rows / MR {
        let mut acc = [[_mm512_setzero_ps(); 4]; 6];
        // SAFETY: the strip's Q rows and the block's four K panels are inside `q` and
        // `kp` (asserted above).
        unsafe { rows_loop_6x4(&mut acc, qp.add(st * MR * e), e * 4, kpp, e * NR * 4, e) };
        for (i, row) in acc.iter().enumerate() {
            let r = st * MR + i;
            let p = if r < live {
                softmax_regs(*row, (&mut m[r], &mut l[r], &mut alpha[r]))
            } else {
                *row
            };
            for (c, &pc) in p.iter().enumerate() {
                // SAFETY: row `r < rows` of `s` holds `BK` floats (asserted above).
                unsafe { _mm512_storeu_ps(sp.add(r * lds + c * NR), pc) };
            }
        }
    }
}

/// Transposes a 16×16 f32 block: row `i` of `dst` (stride `ldd`) receives column `i`
/// of `src` (16 rows of stride `lds`). Unpacks of 32- and 64-bit elements, then two
/// 128-bit lane shuffles.
///
/// # Safety
/// AVX-512F must be available; `src` must hold 16 rows of 16 floats at stride `lds`,
/// `dst` 16 rows at stride `ldd`.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn transpose16(src: *const f32, lds: usize, dst: *mut f32, ldd: usize) {
    let r: [__m512; 16] = std::array::from_fn(|i| _mm512_loadu_ps(src.add(i * lds)));
    // t[2i], t[2i+1]: 32-bit interleaves of rows 2i and 2i+1.
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    // u[4i + c], 128-bit lane `L`: column `4L + c` of rows `4i..4i + 4`.
    let mut u = [_mm512_setzero_ps(); 16];
    for i in 0..4 {
        let pd = |v: __m512| _mm512_castps_pd(v);
        let (a, b, c, d) = (pd(t[4 * i]), pd(t[4 * i + 1]), pd(t[4 * i + 2]), pd(t[4 * i + 3]));
        u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    // Column `4L + c` gathers lane `L` of u[c], u[4 + c], u[8 + c], u[12 + c].
    for c in 0..4 {
        let x0 = _mm512_shuffle_f32x4::<0x44>(u[c], u[4 + c]);
        let x1 = _mm512_shuffle_f32x4::<0xEE>(u[c], u[4 + c]);
        let y0 = _mm512_shuffle_f32x4::<0x44>(u[8 + c], u[12 + c]);
        let y1 = _mm512_shuffle_f32x4::<0xEE>(u[8 + c], u[12 + c]);
        _mm512_storeu_ps(dst.add(c * ldd), _mm512_shuffle_f32x4::<0x88>(x0, y0));
        _mm512_storeu_ps(dst.add((4 + c) * ldd), _mm512_shuffle_f32x4::<0xDD>(x0, y0));
        _mm512_storeu_ps(dst.add((8 + c) * ldd), _mm512_shuffle_f32x4::<0x88>(x1, y1));
        _mm512_storeu_ps(dst.add((12 + c) * ldd), _mm512_shuffle_f32x4::<0xDD>(x1, y1));
    }
}

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
    let npanels = super::tiles::assert_gemm_operands(x, ldx, rows, (k0, k1, e), wp, out, ldy, b);
    let (strips, tail) = (rows / GEMM_ROWS, rows % GEMM_ROWS);
    // A decode step's 2 or more rows (no whole strip) read each panel once, from memory:
    // ask for the panels' lines ahead (`prefetch::avx512_gemm_ahead`). One row ran as
    // fast without.
    let ahead = if strips == 0 && rows >= 2 {
        super::prefetch::avx512_gemm_ahead()
    } else {
        0
    };
    // Whole strips ask for the panels' lines `GEMM_LOOP_AHEAD` steps ahead on the CPUs
    // where that pays (`prefetch::avx512_gemm_strips`).
    let strip_ahead = if super::prefetch::avx512_gemm_strips() {
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

#[target_feature(enable = "avx512f")]
unsafe fn qk_impl(
    q: *const f32,
    rows: usize,
    e: usize,
    kp: *const f32,
    npanels: usize,
    s: *mut f32,
    lds: usize,
) {
    let nstrips = rows / MR;
    // Panel-pair outer: two K panels (32 keys × E) stay in L1 while Q strips stream.
    let mut p = 0;
    while p < npanels {
        if p + 4 <= npanels {
            // Four K panels (64 keys) per 6-row Q strip: each strip is read once per 64
            // keys, and a step takes 4 K loads and 6 broadcasts for 24 FMAs.
            for st in 0..nstrips {
                let sp = s.add(st * MR * lds + p * NR);
                let qs = q.add(st * MR * e);
                let kpp = kp.add(p * e * NR);
                qk_tile::<1, 4>(qs, e, (MR * e, e * NR), kpp, sp, lds);
            }
            p += 4;
            continue;
        }
        let two = p + 1 < npanels;
        let mut st = 0;
        while st < nstrips {
            let both = st + 1 < nstrips;
            let sp = s.add(st * MR * lds + p * NR);
            let qs = q.add(st * MR * e);
            let kpp = kp.add(p * e * NR);
            let strides = (MR * e, e * NR);
            match (both, two) {
                (true, true) => qk_tile::<2, 2>(qs, e, strides, kpp, sp, lds),
                (true, false) => qk_tile::<2, 1>(qs, e, strides, kpp, sp, lds),
                (false, true) => qk_tile::<1, 2>(qs, e, strides, kpp, sp, lds),
                (false, false) => qk_tile::<1, 1>(qs, e, strides, kpp, sp, lds),
            }
            st += if both { 2 } else { 1 };
        }
        p += if two { 2 } else { 1 };
    }
}

/// One `(S·MR) × (P·NR)` score tile: `S` consecutive Q strips (row-major rows of `kc`
/// elements) against `P` consecutive K panels over `kc` contraction steps (strip and
/// panel strides `strides`).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn qk_tile<const S: usize, const P: usize>(
    qs: *const f32,
    kc: usize,
    (strip_len, panel_len): (usize, usize),
    kpp: *const f32,
    sp: *mut f32,
    lds: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); P]; 12];
    if S == 1 && P == 4 {
        // SAFETY: with `P == 4`, the first six rows of `acc` are a `[[__m512; 4]; 6]`.
        let a6 = unsafe { &mut *(acc.as_mut_ptr() as *mut [[__m512; 4]; 6]) };
        rows_loop_6x4(a6, qs, kc * 4, kpp, panel_len * 4, kc);
    } else {
        qk_contract::<S, P>(&mut acc, qs, kc, (strip_len, panel_len), kpp);
    }
    for (r, row) in acc.iter().enumerate().take(S * MR) {
        for (pi, &v) in row.iter().enumerate() {
            _mm512_storeu_ps(sp.add(r * lds + pi * NR), v);
        }
    }
}

/// [`qk_tile`]'s contraction in intrinsics, for the tile shapes without an assembly loop.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn qk_contract<const S: usize, const P: usize>(
    acc: &mut [[__m512; P]; 12],
    qs: *const f32,
    kc: usize,
    (strip_len, panel_len): (usize, usize),
    kpp: *const f32,
) {
    for x in 0..kc {
        let mut kv = [_mm512_setzero_ps(); P];
        for (pi, k) in kv.iter_mut().enumerate() {
            *k = _mm512_loadu_ps(kpp.add(pi * panel_len + x * NR));
        }
        for si in 0..S {
            let qx = qs.add(si * strip_len + x);
            for r in 0..MR {
                let a = _mm512_set1_ps(*qx.add(r * kc));
                for pi in 0..P {
                    acc[si * MR + r][pi] = _mm512_fmadd_ps(a, kv[pi], acc[si * MR + r][pi]);
                }
            }
        }
    }
}

/// One step of a 6×64 tile loop (`tile_loop_6x4!`) as assembly text: the four 16-lane
/// `b` operands at `{b} + $b0 … $b3` (address text), the six row elements at byte offset
/// `$da` from their row (rows `{g0}`, `+ {la}`, `+ 2·{la}`, then the same from `{g1}`),
/// 24 FMAs into `zmm0..zmm23` (row-major, four per row).
macro_rules! tile_step_6x4 {
    ($da:literal, [$b0:literal, $b1:literal, $b2:literal, $b3:literal]) => {
        concat!(
            "vmovups zmm24, zmmword ptr [{b} + ",
            $b0,
            "]\n",
            "vmovups zmm25, zmmword ptr [{b} + ",
            $b1,
            "]\n",
            "vmovups zmm26, zmmword ptr [{b} + ",
            $b2,
            "]\n",
            "vmovups zmm27, zmmword ptr [{b} + ",
            $b3,
            "]\n",
            "vbroadcastss zmm28, dword ptr [{g0} + ",
            $da,
            "]\n",
            "vfmadd231ps zmm0, zmm28, zmm24\n",
            "vfmadd231ps zmm1, zmm28, zmm25\n",
            "vfmadd231ps zmm2, zmm28, zmm26\n",
            "vfmadd231ps zmm3, zmm28, zmm27\n",
            "vbroadcastss zmm29, dword ptr [{g0} + {la} + ",
            $da,
            "]\n",
            "vfmadd231ps zmm4, zmm29, zmm24\n",
            "vfmadd231ps zmm5, zmm29, zmm25\n",
            "vfmadd231ps zmm6, zmm29, zmm26\n",
            "vfmadd231ps zmm7, zmm29, zmm27\n",
            "vbroadcastss zmm28, dword ptr [{g0} + {la}*2 + ",
            $da,
            "]\n",
            "vfmadd231ps zmm8, zmm28, zmm24\n",
            "vfmadd231ps zmm9, zmm28, zmm25\n",
            "vfmadd231ps zmm10, zmm28, zmm26\n",
            "vfmadd231ps zmm11, zmm28, zmm27\n",
            "vbroadcastss zmm29, dword ptr [{g1} + ",
            $da,
            "]\n",
            "vfmadd231ps zmm12, zmm29, zmm24\n",
            "vfmadd231ps zmm13, zmm29, zmm25\n",
            "vfmadd231ps zmm14, zmm29, zmm26\n",
            "vfmadd231ps zmm15, zmm29, zmm27\n",
            "vbroadcastss zmm28, dword ptr [{g1} + {la} + ",
            $da,
            "]\n",
            "vfmadd231ps zmm16, zmm28, zmm24\n",
            "vfmadd231ps zmm17, zmm28, zmm25\n",
            "vfmadd231ps zmm18, zmm28, zmm26\n",
            "vfmadd231ps zmm19, zmm28, zmm27\n",
            "vbroadcastss zmm29, dword ptr [{g1} + {la}*2 + ",
            $da,
            "]\n",
            "vfmadd231ps zmm20, zmm29, zmm24\n",
            "vfmadd231ps zmm21, zmm29, zmm25\n",
            "vfmadd231ps zmm22, zmm29, zmm26\n",
            "vfmadd231ps zmm23, zmm29, zmm27\n",
        )
    };
}

/// A 6×64 register-tile loop in assembly: `n` steps of `acc[r][i] += a_r · b_i`, where
/// step `x` broadcasts `a_r` from byte `r%3·la + x·$sa` of group pointer `r/3`
/// (`g1 = a + 3·la`) and loads `b_i` (16 lanes) from `b` at the addresses of
/// `[$s0, $s1, $s2, $s3]` (the four steps of one pass, each a list of four address texts
/// over `{sb}` and `{sb3} = 3·sb`), after which `b` moves on by `4·$bstep` bytes
/// (`$bstep` an expression in which `$bs` names `sb`; the tail's single steps use `$s0`
/// and move on by `$bstep`). Per step 4 loads, 6 broadcasts
/// and 24 FMAs; four steps share one set of pointer updates. The compiled intrinsics
/// spent integer work per step on row addresses, and ran `enc1k_d128` 4% and `enc512`
/// 2–3% slower (medians, alternating binaries).
macro_rules! tile_loop_6x4 {
    (
        $(#[$doc:meta])* $name:ident, $sa:literal, $sa4:literal, [$d1:literal, $d2:literal, $d3:literal],
        $bs:ident => $bstep:expr, [$s0:tt, $s1:tt, $s2:tt, $s3:tt]
    ) => {
        $(#[$doc])*
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn $name(acc: &mut [[__m512; 4]; 6], a: *const f32, la: usize, b: *const f32, sb: usize, n: usize) {
            if n == 0 {
                return;
            }
            let $bs = sb;
            let bstep: usize = $bstep;
            // SAFETY: the caller guarantees the `a` rows and `b` operands of `n` steps.
            unsafe {
                std::arch::asm!(
                    "test {q}, {q}",
                    "jz 3f",
                    "2:",
                    tile_step_6x4!("0", $s0),
                    tile_step_6x4!($d1, $s1),
                    tile_step_6x4!($d2, $s2),
                    tile_step_6x4!($d3, $s3),
                    concat!("add {g0}, ", $sa4),
                    concat!("add {g1}, ", $sa4),
                    "add {b}, {bstep4}",
                    "dec {q}",
                    "jnz 2b",
                    "3:",
                    "test {r}, {r}",
                    "jz 5f",
                    "4:",
                    tile_step_6x4!("0", $s0),
                    concat!("add {g0}, ", $sa),
                    concat!("add {g1}, ", $sa),
                    "add {b}, {bstep}",
                    "dec {r}",
                    "jnz 4b",
                    "5:",
                    inout("zmm0") acc[0][0],
                    inout("zmm1") acc[0][1],
                    inout("zmm2") acc[0][2],
                    inout("zmm3") acc[0][3],
                    inout("zmm4") acc[1][0],
                    inout("zmm5") acc[1][1],
                    inout("zmm6") acc[1][2],
                    inout("zmm7") acc[1][3],
                    inout("zmm8") acc[2][0],
                    inout("zmm9") acc[2][1],
                    inout("zmm10") acc[2][2],
                    inout("zmm11") acc[2][3],
                    inout("zmm12") acc[3][0],
                    inout("zmm13") acc[3][1],
                    inout("zmm14") acc[3][2],
                    inout("zmm15") acc[3][3],
                    inout("zmm16") acc[4][0],
                    inout("zmm17") acc[4][1],
                    inout("zmm18") acc[4][2],
                    inout("zmm19") acc[4][3],
                    inout("zmm20") acc[5][0],
                    inout("zmm21") acc[5][1],
                    inout("zmm22") acc[5][2],
                    inout("zmm23") acc[5][3],
                    out("zmm24") _,
                    out("zmm25") _,
                    out("zmm26") _,
                    out("zmm27") _,
                    out("zmm28") _,
                    out("zmm29") _,
                    g0 = inout(reg) a => _,
                    g1 = inout(reg) a.wrapping_byte_add(3 * la) => _,
                    b = inout(reg) b => _,
                    q = inout(reg) n / 4 => _,
                    r = inout(reg) n % 4 => _,
                    la = in(reg) la,
                    sb = in(reg) sb,
                    sb3 = in(reg) 3 * sb,
                    bstep = in(reg) bstep,
                    bstep4 = in(reg) 4 * bstep,
                    options(nostack, readonly),
                );
            }
        }
    };
}

tile_loop_6x4!(
    /// The 6×64 contraction over six row-major rows (`a` the first, `la` the row stride
    /// in bytes, 4 bytes per step) and four 16-lane panels (`b` the first, `sb` the panel
    /// stride in bytes, 64 bytes per step): [`pv_tile`]'s key loop on packed f32 V (P
    /// rows against V panels) and [`qk_tile`]'s and [`qk_softmax`]'s (Q rows against K
    /// panels).
    rows_loop_6x4,
    "4",
    "16",
    ["4", "8", "12"],
    _sb => 64,
    [
        ["0", "{sb} + 0", "{sb}*2 + 0", "{sb3} + 0"],
        ["64", "{sb} + 64", "{sb}*2 + 64", "{sb3} + 64"],
        ["128", "{sb} + 128", "{sb}*2 + 128", "{sb3} + 128"],
        ["192", "{sb} + 192", "{sb}*2 + 192", "{sb3} + 192"]
    ]
);

tile_loop_6x4!(
    /// [`rows_loop_6x4`] against 64 consecutive floats of each of `n` rows (`b` the
    /// first, `sb` the row stride in bytes, one row per step): [`pv_tile`]'s key loop on
    /// f32 V rows read in place (P rows against 64 columns of V).
    rows_loop_6x4_in_rows,
    "4",
    "16",
    ["4", "8", "12"],
    sb => sb,
    [
        ["0", "64", "128", "192"],
        ["{sb} + 0", "{sb} + 64", "{sb} + 128", "{sb} + 192"],
        ["{sb}*2 + 0", "{sb}*2 + 64", "{sb}*2 + 128", "{sb}*2 + 192"],
        ["{sb3} + 0", "{sb3} + 64", "{sb3} + 128", "{sb3} + 192"]
    ]
);

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
    /// their order are those of [`gemm_loop_2p`]). See [`super::prefetch::avx512_gemm_strips`].
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

/// See [`super::portable::pv`] (P row-major with row stride [`BK`]); `rows` must be a
/// multiple of [`MR`]. When `rows == MR` and only the first `live` rows are real (decode),
/// only those are computed; the padding rows of `o` are left as they are.
///
/// # Safety
/// AVX-512F must be available.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn pv(
    p: &[f32],
    rows: usize,
    live: usize,
    nk: usize,
    vp: &[f32],
    vps: usize,
    ldv: usize,
    nvp: usize,
    o: &mut [f32],
    ldo: usize,
    alpha: &[f32],
) {
    assert!(rows.is_multiple_of(MR) && BK >= nk && ldo >= nvp * NR && alpha.len() >= rows);
    assert!(p.len() >= rows * BK);
    assert!(nvp == 0 || nk == 0 || vp.len() >= (nvp - 1) * vps + (nk - 1) * ldv + NR);
    assert!(rows == 0 || o.len() >= (rows - 1) * ldo + nvp * NR);
    // SAFETY: bounds asserted above; features guaranteed by the caller.
    unsafe {
        let src = PvSrc {
            p: p.as_ptr(),
            ldp: BK,
            segs: [(vp.as_ptr() as *const u8, nk), (std::ptr::null(), 0)],
            vps,
            ldv,
            ahead: 0,
        };
        pv_impl::<1>(src, rows, live, nvp, o.as_mut_ptr(), ldo, alpha.as_ptr())
    }
}

/// [`pv`] over two consecutive f32 V blocks at once (a super-block of `nk0 + nk1` keys;
/// `nk1 == 0` for one), both packed or both rows in place (V panel stride `vps`, row
/// stride `ldv`, as in [`pv`]): P has row stride `2·BK`, block 0's probabilities in
/// columns `0..nk0` (`nk0 == BK` when `nk1 > 0`) and block 1's from column `nk0`. Each
/// output tile is then loaded, rescaled and stored once per two blocks.
///
/// # Safety
/// AVX-512F must be available.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn pv_pair(
    p: &[f32],
    rows: usize,
    (v0, nk0): (&[f32], usize),
    (v1, nk1): (&[f32], usize),
    (vps, ldv): (usize, usize),
    nvp: usize,
    o: &mut [f32],
    ldo: usize,
    alpha: &[f32],
) {
    let ldp = 2 * BK;
    assert!(rows.is_multiple_of(MR) && BK >= nk0 && BK >= nk1 && (nk1 == 0 || nk0 == BK));
    assert!(ldo >= nvp * NR && alpha.len() >= rows && p.len() >= rows * ldp);
    for (v, nk) in [(v0, nk0), (v1, nk1)] {
        assert!(nvp == 0 || nk == 0 || v.len() >= (nvp - 1) * vps + (nk - 1) * ldv + NR);
    }
    assert!(rows == 0 || o.len() >= (rows - 1) * ldo + nvp * NR);
    // SAFETY: bounds asserted above; features guaranteed by the caller.
    unsafe {
        let src = PvSrc {
            p: p.as_ptr(),
            ldp,
            segs: [(v0.as_ptr() as *const u8, nk0), (v1.as_ptr() as *const u8, nk1)],
            vps,
            ldv,
            ahead: 0,
        };
        pv_impl::<2>(src, rows, rows, nvp, o.as_mut_ptr(), ldo, alpha.as_ptr())
    }
}

/// Base pointer and element count of a source slice.
fn data_ptr(d: Data) -> (*const u8, usize) {
    match d {
        Data::F32(v) => (v.as_ptr() as *const u8, v.len()),
        Data::BF16(v) => (v.as_ptr() as *const u8, v.len()),
        Data::F16(v) => (v.as_ptr() as *const u8, v.len()),
    }
}

/// The operands of a `P·V` product: P (`p`, row stride `ldp`) against up to two runs of
/// keys (`segs`: V base and key count; run 1's probabilities follow run 0's in P), V
/// panel stride `vps` and row stride `ldv` (elements of kind `T`).
#[derive(Clone, Copy)]
struct PvSrc {
    p: *const f32,
    ldp: usize,
    segs: [(*const u8, usize); 2],
    vps: usize,
    ldv: usize,
    /// How many keys ahead the tiles ask for V rows (0: not at all; only decode asks,
    /// see [`pv_rows`]).
    ahead: usize,
}

impl PvSrc {
    /// The same runs for P rows from `r0` on.
    fn rows_from(mut self, r0: usize) -> Self {
        // SAFETY: callers stay inside the P block (`r0 < rows`).
        self.p = unsafe { self.p.add(r0 * self.ldp) };
        self
    }
}

#[target_feature(enable = "avx512f")]
unsafe fn pv_impl<const G: usize>(
    src: PvSrc,
    rows: usize,
    live: usize,
    nvp: usize,
    o: *mut f32,
    ldo: usize,
    alpha: *const f32,
) {
    let nstrips = rows / MR;
    if nstrips == 1 && live < MR {
        let mut n = 0;
        while n < nvp {
            let two = n + 1 < nvp;
            let op = o.add(n * NR);
            let v0 = n * src.vps;
            if n + 4 <= nvp {
                // Four panels (64 outputs) per pass: `4·live` accumulators hide the FMA
                // latency, and each P element is broadcast once per 64 outputs.
                match live {
                    0 => {}
                    1 => pv_tile::<1, 4, F32, G>(src, v0, op, ldo, alpha),
                    2 => pv_tile::<2, 4, F32, G>(src, v0, op, ldo, alpha),
                    3 => pv_tile::<3, 4, F32, G>(src, v0, op, ldo, alpha),
                    4 => pv_tile::<4, 4, F32, G>(src, v0, op, ldo, alpha),
                    _ => pv_tile::<5, 4, F32, G>(src, v0, op, ldo, alpha),
                }
                n += 4;
                continue;
            }
            match (live, two) {
                (0, _) => {}
                (1, true) => pv_tile::<1, 2, F32, G>(src, v0, op, ldo, alpha),
                (1, false) => pv_tile::<1, 1, F32, G>(src, v0, op, ldo, alpha),
                (2, true) => pv_tile::<2, 2, F32, G>(src, v0, op, ldo, alpha),
                (2, false) => pv_tile::<2, 1, F32, G>(src, v0, op, ldo, alpha),
                (3, true) => pv_tile::<3, 2, F32, G>(src, v0, op, ldo, alpha),
                (3, false) => pv_tile::<3, 1, F32, G>(src, v0, op, ldo, alpha),
                (4, true) => pv_tile::<4, 2, F32, G>(src, v0, op, ldo, alpha),
                (4, false) => pv_tile::<4, 1, F32, G>(src, v0, op, ldo, alpha),
                (_, true) => pv_tile::<5, 2, F32, G>(src, v0, op, ldo, alpha),
                (_, false) => pv_tile::<5, 1, F32, G>(src, v0, op, ldo, alpha),
            }
            n += if two { 2 } else { 1 };
        }
        return;
    }
    let mut n = 0;
    while n < nvp {
        if n + 4 <= nvp {
            // Four panels (64 outputs) per 6-row strip: each P row is read once per
            // 64 outputs, and a key step takes 4 V loads and 6 broadcasts for 24 FMAs.
            for st in 0..nstrips {
                let r0 = st * MR;
                let (sr, v0) = (src.rows_from(r0), n * src.vps);
                let (op, al) = (o.add(r0 * ldo + n * NR), alpha.add(r0));
                pv_tile::<6, 4, F32, G>(sr, v0, op, ldo, al);
            }
            n += 4;
            continue;
        }
        let two = n + 1 < nvp;
        let mut st = 0;
        while st < nstrips {
            let both = st + 1 < nstrips;
            let r0 = st * MR;
            let (sr, v0) = (src.rows_from(r0), n * src.vps);
            let (op, al) = (o.add(r0 * ldo + n * NR), alpha.add(r0));
            match (both, two) {
                (true, true) => pv_tile::<12, 2, F32, G>(sr, v0, op, ldo, al),
                (true, false) => pv_tile::<12, 1, F32, G>(sr, v0, op, ldo, al),
                (false, true) => pv_tile::<6, 2, F32, G>(sr, v0, op, ldo, al),
                (false, false) => pv_tile::<6, 1, F32, G>(sr, v0, op, ldo, al),
            }
            st += if both { 2 } else { 1 };
        }
        n += if two { 2 } else { 1 };
    }
}

/// One `R × (N·NR)` tile of `O = α·O + P·V`, V panels from element offset `v0` of each run.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn pv_tile<const R: usize, const N: usize, const T: u8, const G: usize>(
    src: PvSrc,
    v0: usize,
    op: *mut f32,
    ldo: usize,
    alpha: *const f32,
) {
    let (vps, ldv, ldp) = (src.vps, src.ldv, src.ldp);
    let mut acc = [[_mm512_setzero_ps(); N]; R];
    for (r, row) in acc.iter_mut().enumerate() {
        let a = _mm512_set1_ps(*alpha.add(r));
        for (ni, v) in row.iter_mut().enumerate() {
            *v = _mm512_mul_ps(a, _mm512_loadu_ps(op.add(r * ldo + ni * NR)));
        }
    }
    let mut ps = src.p;
    if R == MR && N == 4 && T == F32 && (ldv == NR || vps == NR) {
        // SAFETY: with `R == 6` and `N == 4`, `acc` is a `[[__m512; 4]; 6]`; the P rows
        // and V panels are those the loop below would read.
        let a6 = unsafe { &mut *(acc.as_mut_ptr() as *mut [[__m512; 4]; 6]) };
        for &(vb, nk) in &src.segs[..G] {
            let v = (vb as *const f32).wrapping_add(v0);
            if ldv == NR {
                // Packed V: a panel row per key.
                rows_loop_6x4(a6, ps, ldp * 4, v, vps * 4, nk);
            } else {
                // V rows in place: four adjacent panels per key.
                rows_loop_6x4_in_rows(a6, ps, ldp * 4, v, ldv * 4, nk);
            }
            ps = ps.add(nk);
        }
    } else {
        pv_contract::<R, N, T, G>(&mut acc, src, v0);
    }
    for (r, row) in acc.iter().enumerate() {
        for (ni, &v) in row.iter().enumerate() {
            _mm512_storeu_ps(op.add(r * ldo + ni * NR), v);
        }
    }
}

/// [`pv_tile`]'s key loop in intrinsics, for the shapes and types without an assembly
/// loop.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn pv_contract<const R: usize, const N: usize, const T: u8, const G: usize>(
    acc: &mut [[__m512; N]; R],
    src: PvSrc,
    v0: usize,
) {
    let (vps, ldv, ldp) = (src.vps, src.ldv, src.ldp);
    let mut ps = src.p;
    let (ahead, size) = (src.ahead, elem_bytes::<T>());
    for &(vb, nk) in &src.segs[..G] {
        for j in 0..nk {
            if ahead > 0 {
                prefetch_bytes(vb.wrapping_add((v0 + (j + ahead) * ldv) * size), N * NR * size);
            }
            let mut vv = [_mm512_setzero_ps(); N];
            let mut ni = 0;
            while ni < N {
                let at = v0 + ni * vps + j * ldv;
                if T == BF16 && ni + 1 < N {
                    // A panel pair of bf16 rows read in place (adjacent panels, `vps ==
                    // NR`) in one load, split even / odd: the output columns of the pair
                    // come out in the split layout (see `pv_rows`).
                    (vv[ni], vv[ni + 1]) = load32_bf16_split((vb as *const u16).add(at));
                    ni += 2;
                } else {
                    vv[ni] = load16::<T>(vb, at);
                    ni += 1;
                }
            }
            for (r, row) in acc.iter_mut().enumerate() {
                let a = _mm512_set1_ps(*ps.add(r * ldp + j));
                for ni in 0..N {
                    row[ni] = _mm512_fmadd_ps(a, vv[ni], row[ni]);
                }
            }
        }
        ps = ps.add(nk);
    }
}

/// Lane mask of the first `n` (< 16) lanes.
#[inline]
fn tail_mask(n: usize) -> __mmask16 {
    ((1u32 << n) - 1) as __mmask16
}

/// See [`super::portable::qk_dot`]: scores against row-major keys (decode path).
/// `rows` must be a multiple of [`MR`]; any `e`. Only the first `live` rows are computed
/// (the rest are padding and get 0).
///
/// # Safety
/// AVX-512F must be available.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn qk_dot(
    q: &[f32],
    rows: usize,
    live: usize,
    e: usize,
    k: &[f32],
    ldk: usize,
    nk: usize,
    s: &mut [f32],
    lds: usize,
) {
    assert!(rows.is_multiple_of(MR) && lds >= nk && q.len() >= rows * e);
    assert!(nk == 0 || k.len() >= (nk - 1) * ldk + e);
    assert!(rows == 0 || s.len() >= (rows - 1) * lds + nk);
    // SAFETY: bounds asserted above; features guaranteed by the caller.
    unsafe {
        qk_dot_impl::<F32>(
            q.as_ptr(),
            rows,
            live.min(rows),
            e,
            (k.as_ptr() as *const u8, ldk, nk, Ahead::Off),
            s.as_mut_ptr(),
            lds,
        )
    }
}

/// [`qk_dot`] with K rows read straight from the source (f32, bf16 or f16), widened in
/// registers (decode path). Half-precision keys need `e % 16 == 0`. With bf16 keys, the
/// Q rows must be in the split layout of [`split_pairs`]. `ahead` says what to ask for
/// ahead of reading it (a hint: results do not depend on it).
///
/// # Safety
/// AVX-512F must be available.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn qk_dot_raw(
    q: &[f32],
    rows: usize,
    live: usize,
    e: usize,
    k: Data,
    (ldk, nk, ahead): (usize, usize, Ahead),
    s: &mut [f32],
    lds: usize,
) {
    let (ptr, len) = data_ptr(k);
    assert!(rows.is_multiple_of(MR) && lds >= nk && q.len() >= rows * e);
    assert!(matches!(k, Data::F32(_)) || e.is_multiple_of(16));
    assert!(nk == 0 || len >= (nk - 1) * ldk + e);
    assert!(rows == 0 || s.len() >= (rows - 1) * lds + nk);
    let (qp, live, sp) = (q.as_ptr(), live.min(rows), s.as_mut_ptr());
    // SAFETY: bounds asserted above; features guaranteed by the caller.
    unsafe {
        match k {
            Data::F32(_) => qk_dot_impl::<F32>(qp, rows, live, e, (ptr, ldk, nk, ahead), sp, lds),
            Data::BF16(_) => qk_dot_impl::<BF16>(qp, rows, live, e, (ptr, ldk, nk, ahead), sp, lds),
            Data::F16(_) => qk_dot_impl::<F16>(qp, rows, live, e, (ptr, ldk, nk, ahead), sp, lds),
        }
    }
}

/// Horizontal sums of 16 registers at once: lane `i` of the result is `Σ regs[i]`, by a
/// transpose-and-add tree (15 shuffle pairs instead of 16 full reductions).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn reduce16(regs: [__m512; 16]) -> __m512 {
    // 16 → 8: within each 128-bit lane, (a0 + a2, b0 + b2, a1 + a3, b1 + b3).
    let b: [__m512; 8] = std::array::from_fn(|i| {
        let (x0, x1) = (regs[2 * i], regs[2 * i + 1]);
        _mm512_add_ps(_mm512_unpacklo_ps(x0, x1), _mm512_unpackhi_ps(x0, x1))
    });
    // 8 → 4: each 128-bit lane holds partial sums of four consecutive registers.
    let c: [__m512; 4] = std::array::from_fn(|i| {
        let (x0, x1) = (b[2 * i], b[2 * i + 1]);
        _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(x0, x1),
            _mm512_shuffle_ps::<0xEE>(x0, x1),
        )
    });
    // 4 → 2 → 1: sum the four 128-bit lanes of each group.
    let d: [__m512; 2] = std::array::from_fn(|i| {
        let (x0, x1) = (c[2 * i], c[2 * i + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x44>(x0, x1),
            _mm512_shuffle_f32x4::<0xEE>(x0, x1),
        )
    });
    _mm512_add_ps(
        _mm512_shuffle_f32x4::<0x88>(d[0], d[1]),
        _mm512_shuffle_f32x4::<0xDD>(d[0], d[1]),
    )
}

/// Decode scores `S = Q·Kᵀ` (`q`: `rows × e` row-major; K row `j` at element `j·ldk`;
/// `s`: row stride `lds`) that walk each K row to its end before the next, keys in
/// order. The hardware prefetchers follow such reads from DRAM; they did not follow the
/// earlier kernel's, which read 16 (one live row) or 4 keys' rows interleaved, 64 bytes
/// of each in turn (on the Zen 4 VM a plain read of 64-key K/V blocks in row order ran
/// at 25–32 GB/s on both threads, with rows interleaved 4 or 16 at a time at 12–20).
/// Live rows go in strips of up to 8 (E = 64 and 128), 4 (E = 256) or [`MR`] (other
/// head sizes); each strip reads the K block once (the first from memory, the others
/// from cache). Padding rows (`live..rows`) get zero scores.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
unsafe fn qk_dot_impl<const T: u8>(
    q: *const f32,
    rows: usize,
    live: usize,
    e: usize,
    (k, ldk, nk, ahead): (*const u8, usize, usize, Ahead),
    s: *mut f32,
    lds: usize,
) {
    let mut r0 = 0;
    while r0 < live {
        let (qs, sp) = (q.add(r0 * e), s.add(r0 * lds));
        let rem = live - r0;
        // Common head sizes: strips of up to 8 rows (4 with 256 elements), up to 16
        // vectors of Q in registers.
        let r = match e {
            64 | 128 => rem.min(8),
            256 => rem.min(4),
            _ => rem.min(MR),
        };
        let args = (qs, k, ldk, nk, sp, lds, ahead);
        let kr = (k, ldk, nk, ahead);
        match (e, r) {
            (64, 1) => qk_rows_strip_reg::<T, 1, 1, 4>(args),
            (64, 2) => qk_rows_strip_reg::<T, 2, 2, 4>(args),
            (64, 3) => qk_rows_strip_reg::<T, 3, 3, 4>(args),
            (64, 4) => qk_rows_strip_reg::<T, 4, 4, 4>(args),
            (64, 5) => qk_rows_strip_reg::<T, 5, 4, 4>(args),
            (64, 6) => qk_rows_strip_reg::<T, 6, 4, 4>(args),
            (64, 7) => qk_rows_strip_reg::<T, 7, 4, 4>(args),
            (64, _) => qk_rows_strip_reg::<T, 8, 4, 4>(args),
            (128, 1) => qk_rows_strip_reg::<T, 1, 1, 8>(args),
            (128, 2) => qk_rows_strip_reg::<T, 2, 2, 8>(args),
            (128, 3) => qk_rows_strip_reg::<T, 3, 2, 8>(args),
            (128, 4) => qk_rows_strip_reg::<T, 4, 2, 8>(args),
            (128, 5) => qk_rows_strip_reg::<T, 5, 2, 8>(args),
            (128, 6) => qk_rows_strip_reg::<T, 6, 2, 8>(args),
            (128, 7) => qk_rows_strip_reg::<T, 7, 2, 8>(args),
            (128, _) => qk_rows_strip_reg::<T, 8, 2, 8>(args),
            (256, 1) => qk_rows_strip_reg::<T, 1, 1, 16>(args),
            (256, 2) => qk_rows_strip_reg::<T, 2, 1, 16>(args),
            (256, 3) => qk_rows_strip_reg::<T, 3, 1, 16>(args),
            (256, _) => qk_rows_strip_reg::<T, 4, 1, 16>(args),
            (_, 1) => qk_rows_strip::<T, 1>(qs, e, kr, sp, lds),
            (_, 2) => qk_rows_strip::<T, 2>(qs, e, kr, sp, lds),
            (_, 3) => qk_rows_strip::<T, 3>(qs, e, kr, sp, lds),
            (_, 4) => qk_rows_strip::<T, 4>(qs, e, kr, sp, lds),
            (_, 5) => qk_rows_strip::<T, 5>(qs, e, kr, sp, lds),
            _ => qk_rows_strip::<T, MR>(qs, e, kr, sp, lds),
        }
        r0 += r;
    }
    // Padding rows get zero scores.
    for r in live..rows {
        std::ptr::write_bytes(s.add(r * lds), 0, nk);
    }
}

/// `(Q strip rows, K base, K row stride, key count, score rows, score row stride, what
/// to ask for ahead)`.
type DotArgs = (*const f32, *const u8, usize, usize, *mut f32, usize, Ahead);

/// [`qk_dot_impl`] for `R` rows of `e = 16·EQ` elements, the first `QR` of them held in
/// registers (`QR·EQ ≤ 16` vectors) and the others read from L1 by their FMAs: per key,
/// `EQ` K loads (bf16: `EQ / 2` split loads) and `R·EQ` FMAs. One strip of up to 8 rows
/// reads each K row once, where strips of only the rows whose Q fits in registers read
/// it once per strip. Measured on the Intel Xeon VM (one thread, f32, 64 keys of 128
/// elements in L1, best of five): 2.99 ns per key and row with 8 rows against 4.70
/// with 2 (kernel notes, "Score strips of up to 8 rows").
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn qk_rows_strip_reg<const T: u8, const R: usize, const QR: usize, const EQ: usize>(
    (qs, k, ldk, nk, s, lds, ahead): DotArgs,
) {
    debug_assert!(QR <= R && QR * EQ <= 16);
    let mut qv = [[_mm512_setzero_ps(); EQ]; QR];
    for (r, row) in qv.iter_mut().enumerate() {
        for (i, x) in row.iter_mut().enumerate() {
            *x = _mm512_loadu_ps(qs.add(r * EQ * 16 + i * 16));
        }
    }
    // Row `r`'s Q vector `i`: a register for the first `QR` rows, else read from L1.
    let qat = |qv: &[[__m512; EQ]; QR], r: usize, i: usize| {
        if r < QR {
            qv[r][i]
        } else {
            _mm512_loadu_ps(qs.add(r * EQ * 16 + i * 16))
        }
    };
    // Partial sums of 16 keys per row (at a tail, the lanes past `cnt` reduce stale
    // sums from the previous 16 keys, which the masked store drops).
    let mut part = [[_mm512_setzero_ps(); 16]; R];
    let size = elem_bytes::<T>();
    // Rows of at most 256 elements: the row ahead is asked for whole in either mode.
    let skip = ahead.row_offset(ldk, size);
    let mut j = 0;
    while j < nk {
        let cnt = (nk - j).min(16);
        for c in 0..cnt {
            let kr = (j + c) * ldk;
            if skip > 0 {
                prefetch_bytes(k.wrapping_add(kr * size + skip), EQ * 16 * size);
            }
            let mut acc = [_mm512_setzero_ps(); R];
            let mut i = 0;
            while i < EQ {
                if T == BF16 && i + 1 < EQ {
                    let (k0, k1) = load32_bf16_split((k as *const u16).add(kr + i * 16));
                    for (r, a) in acc.iter_mut().enumerate() {
                        *a = _mm512_fmadd_ps(qat(&qv, r, i + 1), k1, _mm512_fmadd_ps(qat(&qv, r, i), k0, *a));
                    }
                    i += 2;
                } else {
                    let kv = load16::<T>(k, kr + i * 16);
                    for (r, a) in acc.iter_mut().enumerate() {
                        *a = _mm512_fmadd_ps(qat(&qv, r, i), kv, *a);
                    }
                    i += 1;
                }
            }
            for (p, a) in part.iter_mut().zip(acc) {
                p[c] = a;
            }
        }
        for (r, p) in part.iter().enumerate() {
            _mm512_mask_storeu_ps(s.add(r * lds + j), tail_mask_full(cnt), reduce16(*p));
        }
        j += 16;
    }
}

/// [`qk_dot_impl`] for `R` rows: per key, one pass over its row (e/16 loads, shared by
/// the `R` rows); the partial sums of 16 keys are reduced together ([`reduce16`]).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn qk_rows_strip<const T: u8, const R: usize>(
    qs: *const f32,
    e: usize,
    (k, ldk, nk, ahead): (*const u8, usize, usize, Ahead),
    s: *mut f32,
    lds: usize,
) {
    let full = e / 16 * 16;
    let tm = tail_mask(e - full);
    // Partial sums of 16 keys per row (at a tail, the lanes past `cnt` reduce stale
    // sums from the previous 16 keys, which the masked store drops).
    let mut part = [[_mm512_setzero_ps(); 16]; R];
    let size = elem_bytes::<T>();
    // `Keys`: the whole row ahead, once per row; `Bytes`: one line per 64 bytes read,
    // spread over the row (a whole long row at once took more time than none; kernel
    // notes).
    let (row, line) = match ahead {
        Ahead::Keys(_) => (ahead.row_offset(ldk, size), 0),
        Ahead::Bytes(n) => (0, n),
        Ahead::Off => (0, 0),
    };
    let mut j = 0;
    while j < nk {
        let cnt = (nk - j).min(16);
        for c in 0..cnt {
            let kr = (j + c) * ldk;
            if row > 0 {
                prefetch_bytes(k.wrapping_add(kr * size + row), e * size);
            }
            let mut acc = [_mm512_setzero_ps(); R];
            let mut x = 0;
            if T == BF16 {
                while x + 32 <= e {
                    if line > 0 {
                        prefetch_bytes(k.wrapping_add((kr + x) * size + line), 64);
                    }
                    let (k0, k1) = load32_bf16_split((k as *const u16).add(kr + x));
                    for (r, a) in acc.iter_mut().enumerate() {
                        let qr = qs.add(r * e + x);
                        *a = _mm512_fmadd_ps(
                            _mm512_loadu_ps(qr.add(16)),
                            k1,
                            _mm512_fmadd_ps(_mm512_loadu_ps(qr), k0, *a),
                        );
                    }
                    x += 32;
                }
            }
            while x < full {
                if line > 0 && (x * size).is_multiple_of(64) {
                    prefetch_bytes(k.wrapping_add((kr + x) * size + line), 64);
                }
                let kv = load16::<T>(k, kr + x);
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(_mm512_loadu_ps(qs.add(r * e + x)), kv, *a);
                }
                x += 16;
            }
            if full < e && T == F32 {
                let kv = _mm512_maskz_loadu_ps(tm, (k as *const f32).add(kr + full));
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tm, qs.add(r * e + full)), kv, *a);
                }
            }
            for (p, a) in part.iter_mut().zip(acc) {
                p[c] = a;
            }
        }
        for (r, p) in part.iter().enumerate() {
            _mm512_mask_storeu_ps(s.add(r * lds + j), tail_mask_full(cnt), reduce16(*p));
        }
        j += 16;
    }
}

/// Decode `O = α·O + P·V` for the first `live` rows that walks each V row to its end
/// before the next, keys in order (see [`qk_dot_impl`] for why): P `live × nk` with row
/// stride [`BK`]; V row `j` at element `j·ldv` of `v` (f32, or half precision read in
/// place and widened in registers); `nvp` 16-column output panels; `o` with row stride
/// `ldo`; each tile asks for its columns of the V row `ahead` keys on (0: nothing; a
/// hint, results do not depend on it). Tiles of `R` rows × `N` panels (`R·N ≤ 24`
/// accumulators) each run over all keys; where one tile spans every panel (`nvp` of 1,
/// 2, 4, 8 or 16), the first tile reads the block's V rows in memory order and the later
/// tiles find them in cache.
/// Chunks of panels are capped so that tiles hold more rows: at 8 panels for 2 live
/// rows and at 4 for 3 or more, except for f32 rows with `nvp ≤ 8`, whose chunks stay
/// whole (from DRAM, f32 rows read in 4-panel chunks ran up to 16% slower on the Intel
/// VM; kernel notes, "`P·V` tiles of more rows").
/// For bf16 rows, the output columns of each whole panel pair (`2m`, `2m + 1 < nvp`)
/// come out in the split layout of [`split_pairs`]: the caller applies
/// [`merge_pairs`] once all keys are in.
///
/// # Safety
/// AVX-512F must be available.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn pv_rows(
    p: &[f32],
    live: usize,
    nk: usize,
    v: Data,
    (ldv, nvp, ahead): (usize, usize, usize),
    o: &mut [f32],
    ldo: usize,
    alpha: &[f32],
) {
    let (ptr, len) = data_ptr(v);
    assert!(BK >= nk && ldo >= nvp * NR && alpha.len() >= live);
    assert!(live == 0 || p.len() >= (live - 1) * BK + nk);
    assert!(nvp == 0 || nk == 0 || len >= (nk - 1) * ldv + nvp * NR);
    assert!(live == 0 || o.len() >= (live - 1) * ldo + nvp * NR);
    let (pp, op, al) = (p.as_ptr(), o.as_mut_ptr(), alpha.as_ptr());
    // SAFETY: bounds asserted above; features guaranteed by the caller.
    unsafe {
        match v {
            Data::F32(_) => pv_rows_impl::<F32>(pp, (live, nk), ptr, (ldv, nvp, ahead), op, ldo, al),
            Data::BF16(_) => pv_rows_impl::<BF16>(pp, (live, nk), ptr, (ldv, nvp, ahead), op, ldo, al),
            Data::F16(_) => pv_rows_impl::<F16>(pp, (live, nk), ptr, (ldv, nvp, ahead), op, ldo, al),
        }
    }
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
unsafe fn pv_rows_impl<const T: u8>(
    p: *const f32,
    (live, nk): (usize, usize),
    v: *const u8,
    (ldv, nvp, ahead): (usize, usize, usize),
    o: *mut f32,
    ldo: usize,
    alpha: *const f32,
) {
    // Panel chunks of 16, 8, 4, 2, 1 (even starts, so bf16 pairs stay whole), at most
    // `cap` panels (see `pv_rows`).
    let cap = match live {
        _ if T == F32 && nvp <= 8 => 16,
        0 | 1 => 16,
        2 => 8,
        _ => 4,
    };
    let mut n0 = 0;
    while n0 < nvp {
        let n = [16, 8, 4, 2, 1]
            .into_iter()
            .find(|&c| c <= (nvp - n0).min(cap))
            .unwrap_or(1);
        let mut r0 = 0;
        while r0 < live {
            let rem = live - r0;
            let r = match n {
                16 => 1,
                8 => rem.min(2),
                4 => rem.min(6),
                _ => [6, 3, 2, 1].into_iter().find(|&x| x <= rem).unwrap_or(1),
            };
            let src = PvSrc {
                p: p.add(r0 * BK),
                ldp: BK,
                segs: [(v, nk), (std::ptr::null(), 0)],
                vps: NR,
                ldv,
                ahead,
            };
            let (v0, op, al) = (n0 * NR, o.add(r0 * ldo + n0 * NR), alpha.add(r0));
            match (n, r) {
                (16, _) => pv_tile::<1, 16, T, 1>(src, v0, op, ldo, al),
                (8, 1) => pv_tile::<1, 8, T, 1>(src, v0, op, ldo, al),
                (8, _) => pv_tile::<2, 8, T, 1>(src, v0, op, ldo, al),
                (4, 1) => pv_tile::<1, 4, T, 1>(src, v0, op, ldo, al),
                (4, 2) => pv_tile::<2, 4, T, 1>(src, v0, op, ldo, al),
                (4, 3) => pv_tile::<3, 4, T, 1>(src, v0, op, ldo, al),
                (4, 4) => pv_tile::<4, 4, T, 1>(src, v0, op, ldo, al),
                (4, 5) => pv_tile::<5, 4, T, 1>(src, v0, op, ldo, al),
                (4, _) => pv_tile::<6, 4, T, 1>(src, v0, op, ldo, al),
                (2, 1) => pv_tile::<1, 2, T, 1>(src, v0, op, ldo, al),
                (2, 2) => pv_tile::<2, 2, T, 1>(src, v0, op, ldo, al),
                (2, 3) => pv_tile::<3, 2, T, 1>(src, v0, op, ldo, al),
                (2, _) => pv_tile::<6, 2, T, 1>(src, v0, op, ldo, al),
                (_, 1) => pv_tile::<1, 1, T, 1>(src, v0, op, ldo, al),
                (_, 2) => pv_tile::<2, 1, T, 1>(src, v0, op, ldo, al),
                (_, 3) => pv_tile::<3, 1, T, 1>(src, v0, op, ldo, al),
                (_, _) => pv_tile::<6, 1, T, 1>(src, v0, op, ldo, al),
            }
            r0 += r;
        }
        n0 += n;
    }
}

/// Stores 16 floats as bf16 components: `hi = bf16(v)` and, unless `lo` is null,
/// `lo = bf16(v − hi)` (16 elements each).
///
/// # Safety
/// AVX-512F and AVX512-BF16 must be available; `hi` (and `lo`) hold 16 elements.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
pub(crate) unsafe fn store_components(v: __m512, hi: *mut u16, lo: *mut u16) {
    let h = _mm512_cvtneps_pbh(v);
    _mm256_storeu_si256(hi as *mut __m256i, std::mem::transmute::<__m256bh, __m256i>(h));
    if !lo.is_null() {
        let l = _mm512_cvtneps_pbh(_mm512_sub_ps(v, _mm512_cvtpbh_ps(h)));
        _mm256_storeu_si256(lo as *mut __m256i, std::mem::transmute::<__m256bh, __m256i>(l));
    }
}

/// Lane mask of the first `n` (1..=16) lanes.
#[inline]
pub(crate) fn tail_mask_full(n: usize) -> __mmask16 {
    if n >= 16 {
        0xffff
    } else {
        tail_mask(n)
    }
}

/// Online-softmax update of `n` f32 score rows of at most 128 keys, in place, lazily
/// rescaled as in [`softmax_row_bf16`]: row `r` (at `s + r·lds`, `nk` keys) becomes
/// `p = 2^(x − m_new)` on its visible keys `[a, z)` and 0 on the rest of `0..nk`, where
/// `(a, z) = range(r)`. `m`, `l` and `alpha` are updated as by `avx2::online_row`
/// (`l ← alpha·l + Σ p`), except that the reference `m_new` stays `m_old`
/// (`alpha = 1`) unless the row's maximum exceeds it by more than
/// [`LAZY_RESCALE_LOG2`], so `p ≤ 2^8`. A row's first visible block (`m_old = −inf`)
/// sets `m_new` to its maximum; a row with no visible key so far is all 0, with `m`
/// and `l` unchanged and `alpha = 1`.
///
/// The row stays in registers between its maximum and its exponentials (`NC` chunks of
/// 16 keys, `16·NC ≥ nk`), so no pass over memory finds the maximum and a row whose
/// maximum stays within the bound needs no horizontal maximum at all.
///
/// # Safety
/// AVX-512F and AVX512DQ must be available; `s` holds `n` rows of stride `lds ≥ nk`;
/// `m`, `l`, `alpha` hold `n` elements; `a ≤ z ≤ nk ≤ 16·NC` for every range.
#[target_feature(enable = "avx512f,avx512dq")]
pub(super) unsafe fn online_rows_lazy<const NC: usize>(
    s: *mut f32,
    (lds, n, nk): (usize, usize, usize),
    range: impl Fn(usize) -> (usize, usize),
    (m, l, alpha): (&mut [f32], &mut [f32], &mut [f32]),
) {
    debug_assert!(nk <= 16 * NC && lds >= nk && m.len() >= n && l.len() >= n && alpha.len() >= n);
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    let stores: [__mmask16; NC] = std::array::from_fn(|c| chunk_mask(16 * c, (0, nk)));
    for r in 0..n {
        let row = s.add(r * lds);
        let ar = range(r);
        debug_assert!(ar.0 <= ar.1 && ar.1 <= nk);
        let mut v = [ninf; NC];
        for (c, vc) in v.iter_mut().enumerate() {
            *vc = _mm512_mask_loadu_ps(ninf, chunk_mask(16 * c, ar), row.add(16 * c));
        }
        let p = softmax_regs(v, (&mut m[r], &mut l[r], &mut alpha[r]));
        for (c, (&pc, &sm)) in p.iter().zip(&stores).enumerate() {
            _mm512_mask_storeu_ps(row.add(16 * c), sm, pc);
        }
    }
}

/// The lazily rescaled online-softmax update of one score row held in registers (`NC`
/// chunks of 16 scores, -inf where hidden), as described at [`online_rows_lazy`]:
/// returns the probabilities (0 where hidden, all 0 for a row with nothing visible so
/// far) and updates the row's `m`, `l` and `alpha`.
#[inline]
#[target_feature(enable = "avx512f,avx512dq")]
unsafe fn softmax_regs<const NC: usize>(
    v: [__m512; NC],
    (m, l, alpha): (&mut f32, &mut f32, &mut f32),
) -> [__m512; NC] {
    let mut mx = _mm512_set1_ps(f32::NEG_INFINITY);
    for &vc in &v {
        mx = _mm512_max_ps(mx, vc);
    }
    let m_old = *m;
    let (m_new, al) = if m_old == f32::NEG_INFINITY {
        let bm = _mm512_reduce_max_ps(mx);
        if bm == f32::NEG_INFINITY {
            *alpha = 1.0;
            return [_mm512_setzero_ps(); NC];
        }
        (bm, 0.0)
    } else if _mm512_cmp_ps_mask::<_CMP_GT_OQ>(
        _mm512_sub_ps(mx, _mm512_set1_ps(m_old)),
        _mm512_set1_ps(LAZY_RESCALE_LOG2),
    ) == 0
    {
        (m_old, 1.0)
    } else {
        // The row's maximum ran ahead of the reference: rescale to it.
        let bm = _mm512_reduce_max_ps(mx);
        (bm, _mm512_cvtss_f32(exp2_512(_mm512_set1_ps(m_old - bm))))
    };
    let mv = _mm512_set1_ps(m_new);
    let mut sum = _mm512_setzero_ps();
    let p = v.map(|vc| {
        let pc = exp2_512(_mm512_sub_ps(vc, mv));
        sum = _mm512_add_ps(sum, pc);
        pc
    });
    *l = *l * al + _mm512_reduce_add_ps(sum);
    *m = m_new;
    *alpha = al;
    p
}

/// Lane mask of the lanes of the 16-key chunk starting at `x0` that are visible in `[a, z)`.
#[inline]
fn chunk_mask(x0: usize, (a, z): (usize, usize)) -> __mmask16 {
    let lo = a.saturating_sub(x0).min(16);
    let hi = z.saturating_sub(x0).min(16);
    let upto = |n: usize| if n >= 16 { 0xffffu32 } else { (1u32 << n) - 1 };
    (upto(hi) & !upto(lo)) as __mmask16
}

/// Online-softmax update of one score row of the AMX path (`x.len()` a multiple of 16):
/// `y = c·x` on the visible keys `[a, z)`, `p = 2^(y − m_new)` (0 outside `[a, z)`),
/// stored as bf16 components `hi = bf16(p)` and, unless `lo` is null, `lo = bf16(p − hi)`
/// (`x.len()` each). Returns `(m_new, alpha = 2^(m_old − m_new))` and updates the row's
/// sum `l ← alpha·l + Σ p`, kept as 16 lane-wise partial sums in `l16` (their total is the
/// row sum), so that no horizontal sum runs per block. When `m_new` is -inf, `hi` and `lo`
/// are zero, `l16` is unchanged and `(−inf, 1)` is returned.
///
/// The reference `m_new` is the row's running maximum, rescaled lazily: a row's first
/// visible block sets it to that block's maximum, and later blocks keep `m_new = m_old`
/// (`alpha = 1`, one pass over the row, no rescale of the output) unless their maximum
/// exceeds it by more than [`LAZY_RESCALE_LOG2`], when `m_new` becomes their maximum
/// (a second pass). A row's first visible block takes the maximum of its visible keys in
/// the 16-key chunk that holds key `a` as `m_old` in the same way, which saves the pass
/// for its maximum (when those keys have no finite score, the maximum pass runs).
/// `p ≤ 2^8` either way, and a first block's `m_new` lies within [`LAZY_RESCALE_LOG2`]
/// below its maximum.
///
/// # Safety
/// AVX-512F, AVX512DQ and AVX512-BF16 must be available; `hi` (and `lo`, unless null)
/// hold `x.len()` elements; `a ≤ z ≤ x.len()`.
#[target_feature(enable = "avx512f,avx512dq,avx512bf16")]
pub(crate) unsafe fn softmax_row_bf16(
    x: &[f32],
    (a, z): (usize, usize),
    c: f32,
    m_old: f32,
    (hi, lo): (*mut u16, *mut u16),
    l16: &mut [f32; 16],
) -> (f32, f32) {
    // Only the 16-key chunks that hold visible keys are computed; the others get zero
    // probabilities here. Chunks wholly inside `[a, z)` then run unmasked (a key-padding
    // run or a causal edge ending on a chunk boundary takes no masks at all).
    let w = x.len();
    let (a16, z16) = (a / 16 * 16, z.div_ceil(16) * 16);
    let (a16, z16) = (a16.min(z16), z16.min(w));
    let zero = _mm256_setzero_si256();
    for (from, to) in [(0, a16), (z16, w)] {
        // Whole chunks (`w`, `a16` and `z16` are multiples of 16).
        for i in (from..to).step_by(16) {
            _mm256_storeu_si256(hi.add(i) as *mut __m256i, zero);
            if !lo.is_null() {
                _mm256_storeu_si256(lo.add(i) as *mut __m256i, zero);
            }
        }
    }
    let (xs, ab) = (&x[a16..z16], (a - a16, z - a16));
    let (hs, ls) = (hi.add(a16), if lo.is_null() { lo } else { lo.add(a16) });
    let (m_new, alpha, sum) = if lo.is_null() {
        softmax_row_impl::<true>(xs, ab, c, m_old, hs, ls)
    } else {
        softmax_row_impl::<false>(xs, ab, c, m_old, hs, ls)
    };
    if m_new != f32::NEG_INFINITY {
        let l = _mm512_loadu_ps(l16.as_ptr());
        let l = if alpha == 1.0 {
            _mm512_add_ps(l, sum)
        } else {
            _mm512_fmadd_ps(l, _mm512_set1_ps(alpha), sum)
        };
        _mm512_storeu_ps(l16.as_mut_ptr(), l);
    }
    (m_new, alpha)
}

/// [`softmax_row_bf16`]'s row pass: `(m_new, alpha, lane-wise Σ p)`.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,avx512bf16")]
unsafe fn softmax_row_impl<const HI_ONLY: bool>(
    x: &[f32],
    (a, z): (usize, usize),
    c: f32,
    m_old: f32,
    hi: *mut u16,
    lo: *mut u16,
) -> (f32, f32, __m512) {
    let w = x.len();
    debug_assert!(w.is_multiple_of(16) && a <= z && z <= w);
    if m_old > f32::NEG_INFINITY {
        // One pass against the running maximum.
        let (m_new, sum, redone) = lazy_pass::<HI_ONLY>(x, (a, z), c, m_old, hi, lo);
        let alpha = if redone {
            _mm512_cvtss_f32(exp2_512(_mm512_set1_ps(m_old - m_new)))
        } else {
            1.0
        };
        return (m_new, alpha, sum);
    }
    let xp = x.as_ptr();
    let cv = _mm512_set1_ps(c);
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    // The row's first visible block: the maximum of the visible keys among its first 16
    // keys (the chunk of key `a`) is a provisional reference, redone as above when the
    // block's maximum runs more than `LAZY_RESCALE_LOG2` ahead of it. That saves a pass
    // over the row for its maximum.
    let first = if a == 0 && z >= 16 {
        0xffff
    } else {
        chunk_mask(0, (a, z))
    };
    let m0 = _mm512_reduce_max_ps(_mm512_mask_mul_ps(ninf, first, _mm512_loadu_ps(xp), cv));
    if m0.is_finite() {
        let (m_new, sum, _) = lazy_pass::<HI_ONLY>(x, (a, z), c, m0, hi, lo);
        return (m_new, 1.0, sum);
    }
    // No finite visible score among those 16: the block's maximum first, then the
    // exponentials.
    let full = a == 0 && z == w;
    let mask = |i: usize| if full { 0xffff } else { chunk_mask(i, (a, z)) };
    let (mut m0, mut m1) = (ninf, ninf);
    let mut i = 0;
    while i + 32 <= w {
        m0 = _mm512_max_ps(
            m0,
            _mm512_mask_mul_ps(ninf, mask(i), _mm512_loadu_ps(xp.add(i)), cv),
        );
        m1 = _mm512_max_ps(
            m1,
            _mm512_mask_mul_ps(ninf, mask(i + 16), _mm512_loadu_ps(xp.add(i + 16)), cv),
        );
        i += 32;
    }
    if i < w {
        m0 = _mm512_max_ps(
            m0,
            _mm512_mask_mul_ps(ninf, mask(i), _mm512_loadu_ps(xp.add(i)), cv),
        );
    }
    let m_new = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
    if m_new == f32::NEG_INFINITY {
        std::ptr::write_bytes(hi, 0, w);
        if !HI_ONLY {
            std::ptr::write_bytes(lo, 0, w);
        }
        return (m_new, 1.0, _mm512_setzero_ps());
    }
    let sum = exp_pass::<HI_ONLY>(x, (a, z), c, m_new, hi, lo);
    (m_new, 1.0, sum)
}

/// The largest lane-wise `Σ p` of a pass that [`lazy_pass`] takes as proof that no
/// visible key ran more than [`LAZY_RESCALE_LOG2`] ahead of the reference. An f32 sum of
/// non-negative terms is at least each of them, and a key with `c·x − m > 8` gets
/// `p ≥ 2^8 · (1 − 1.1·10⁻⁴) > 255.9` from `exp2_512_short` (either polynomial, or +inf
/// or NaN), so lane sums of at most 254 leave no such key, whatever the rounding.
const LAZY_SUM_BOUND: f32 = 254.0;

/// [`exp_pass`] against the reference `m`; when the block's maximum runs more than
/// [`LAZY_RESCALE_LOG2`] ahead of `m`, the row is redone against that maximum. Returns
/// `(m_new, lane-wise Σ p, whether it was redone)`.
///
/// The pass itself keeps no maximum: lane sums of at most [`LAZY_SUM_BOUND`] show that
/// no key ran ahead, which is the common case. Only a row with larger sums reads its
/// scores again for their maximum ([`visible_max`]), and the decision is then the one
/// the maximum gives, so the result is that of a pass that tracked it.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,avx512bf16")]
unsafe fn lazy_pass<const HI_ONLY: bool>(
    x: &[f32],
    (a, z): (usize, usize),
    c: f32,
    m: f32,
    hi: *mut u16,
    lo: *mut u16,
) -> (f32, __m512, bool) {
    let sum = exp_pass::<HI_ONLY>(x, (a, z), c, m, hi, lo);
    if _mm512_cmp_ps_mask::<_CMP_LE_OQ>(sum, _mm512_set1_ps(LAZY_SUM_BOUND)) == 0xffff {
        return (m, sum, false);
    }
    let t_max = visible_max(x, (a, z), c, m);
    if _mm512_cmp_ps_mask::<_CMP_GT_OQ>(t_max, _mm512_set1_ps(LAZY_RESCALE_LOG2)) == 0 {
        return (m, sum, false);
    }
    // The block's maximum ran ahead: redo the row against it.
    let m_new = m + _mm512_reduce_max_ps(t_max);
    let sum = exp_pass::<HI_ONLY>(x, (a, z), c, m_new, hi, lo);
    (m_new, sum, true)
}

/// The lane-wise maximum over the visible keys `[a, z)` of `c·x − m` (-inf in lanes
/// with no visible key). NaN scores count as invisible, as in `exp2_512_short`.
#[inline]
#[target_feature(enable = "avx512f,avx512dq")]
unsafe fn visible_max(x: &[f32], (a, z): (usize, usize), c: f32, m: f32) -> __m512 {
    let xp = x.as_ptr();
    let (cv, mv) = (_mm512_set1_ps(c), _mm512_set1_ps(m));
    let mut tm = _mm512_set1_ps(f32::NEG_INFINITY);
    for i in (0..x.len()).step_by(16) {
        let t = _mm512_fmsub_ps(_mm512_loadu_ps(xp.add(i)), cv, mv);
        // `max(t, tm)` returns `tm` where `t` is NaN.
        tm = _mm512_mask_max_ps(tm, chunk_mask(i, (a, z)), t, tm);
    }
    tm
}

/// `p = 2^(c·x − m)` on the visible keys `[a, z)` (0 elsewhere) stored as bf16 components
/// (see [`softmax_row_bf16`]); returns the lane-wise `Σ p`. The 32-key steps wholly
/// inside `[a, z)` run without lane masks ([`exp_steps`]); the 16-key chunks before and
/// after them take lane masks. Even chunks sum into one accumulator and odd ones into
/// another, whichever way they run.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,avx512bf16")]
unsafe fn exp_pass<const HI_ONLY: bool>(
    x: &[f32],
    (a, z): (usize, usize),
    c: f32,
    m: f32,
    hi: *mut u16,
    lo: *mut u16,
) -> __m512 {
    let w = x.len();
    let (cv, mv) = (_mm512_set1_ps(c), _mm512_set1_ps(m));
    let zero = _mm512_setzero_ps();
    if a == 0 && z == w {
        // Every key visible (the common case): the steps, and a last chunk without a mask.
        let (s0, s1) = exp_steps::<HI_ONLY>(x, (0, w / 32 * 32), (cv, mv), (hi, lo), (zero, zero));
        let (s0, s1) = exp_masked::<HI_ONLY>(x, (0, w), (w / 32 * 32, w), (cv, mv), (hi, lo), (s0, s1));
        return _mm512_add_ps(s0, s1);
    }
    // The unmasked steps: keys `u0..u1`, or none.
    let (u0, u1) = (a.div_ceil(32) * 32, z / 32 * 32);
    let (u0, u1) = if u0 < u1 { (u0, u1) } else { (w, w) };
    let (s0, s1) = exp_masked::<HI_ONLY>(x, (a, z), (0, u0), (cv, mv), (hi, lo), (zero, zero));
    let (s0, s1) = exp_steps::<HI_ONLY>(x, (u0, u1), (cv, mv), (hi, lo), (s0, s1));
    let (s0, s1) = exp_masked::<HI_ONLY>(x, (a, z), (u1, w), (cv, mv), (hi, lo), (s0, s1));
    _mm512_add_ps(s0, s1)
}

/// [`exp_pass`] on the 32-key steps of keys `i0..i1` (`i0` and `i1` multiples of 32, all
/// visible), with no lane masks: with one component, each step's 32 probabilities are
/// rounded by one `VCVTNE2PS2BF16` and stored as one 64-byte vector (the row starts on
/// a 64-byte boundary in the AMX path's buffer). Adds to and returns the even and odd
/// chunks' sums.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,avx512bf16")]
unsafe fn exp_steps<const HI_ONLY: bool>(
    x: &[f32],
    (i0, i1): (usize, usize),
    (cv, mv): (__m512, __m512),
    (hi, lo): (*mut u16, *mut u16),
    (mut s0, mut s1): (__m512, __m512),
) -> (__m512, __m512) {
    let xp = x.as_ptr();
    let mut i = i0;
    while i < i1 {
        let t0 = _mm512_fmsub_ps(_mm512_loadu_ps(xp.add(i)), cv, mv);
        let t1 = _mm512_fmsub_ps(_mm512_loadu_ps(xp.add(i + 16)), cv, mv);
        let e0 = exp2_512_short::<HI_ONLY>(t0, 0xffff);
        let e1 = exp2_512_short::<HI_ONLY>(t1, 0xffff);
        s0 = _mm512_add_ps(s0, e0);
        s1 = _mm512_add_ps(s1, e1);
        if HI_ONLY {
            // Keys `i..i + 16` from `e0` in the low half, `i + 16..i + 32` from `e1`.
            let h = _mm512_cvtne2ps_pbh(e1, e0);
            _mm512_storeu_si512(hi.add(i) as *mut _, std::mem::transmute::<__m512bh, __m512i>(h));
        } else {
            store_components(e0, hi.add(i), lo.add(i));
            store_components(e1, hi.add(i + 16), lo.add(i + 16));
        }
        i += 32;
    }
    (s0, s1)
}

/// [`exp_pass`] on the 16-key chunks of keys `i0..i1` (`i0` a multiple of 32) with the
/// lane masks of the visible keys `[a, z)`. Adds to and returns the even and odd chunks'
/// sums.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,avx512bf16")]
unsafe fn exp_masked<const HI_ONLY: bool>(
    x: &[f32],
    (a, z): (usize, usize),
    (i0, i1): (usize, usize),
    (cv, mv): (__m512, __m512),
    (hi, lo): (*mut u16, *mut u16),
    (mut s0, mut s1): (__m512, __m512),
) -> (__m512, __m512) {
    let xp = x.as_ptr();
    let mut i = i0;
    while i < i1 {
        let t = _mm512_fmsub_ps(_mm512_loadu_ps(xp.add(i)), cv, mv);
        let e = exp2_512_short::<HI_ONLY>(t, chunk_mask(i, (a, z)));
        if (i / 16) % 2 == 0 {
            s0 = _mm512_add_ps(s0, e);
        } else {
            s1 = _mm512_add_ps(s1, e);
        }
        store_components(
            e,
            hi.add(i),
            if HI_ONLY { std::ptr::null_mut() } else { lo.add(i) },
        );
        i += 16;
    }
    (s0, s1)
}

/// `dst[x] = f16(src[x] · scale)` (the product in f32), rounding to nearest even (as
/// `half::f16::from_f32`).
///
/// # Safety
/// AVX-512F must be available, and `dst` valid for `src.len()` writes.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn store_f16(dst: *mut half::f16, src: &[f32], scale: f32) {
    let n = src.len();
    let sv = _mm512_set1_ps(scale);
    let mut x = 0;
    while x + 16 <= n {
        let v = _mm512_mul_ps(_mm512_loadu_ps(src.as_ptr().add(x)), sv);
        let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
        _mm256_storeu_si256(dst.add(x) as *mut __m256i, h);
        x += 16;
    }
    for (i, &v) in src.iter().enumerate().skip(x) {
        dst.add(i).write(half::f16::from_f32(v * scale));
    }
}

/// `dst[x] = bf16(src[x] · scale)` (the product in f32), rounding to nearest even (as
/// `half::bf16::from_f32`, but for subnormals: `VCVTNEPS2BF16` reads subnormal inputs as
/// zero and flushes subnormal results to zero; `kernels::cpu::cast` rounds them as
/// `half` does).
///
/// # Safety
/// AVX-512F and AVX512-BF16 must be available, and `dst` valid for `src.len()` writes.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(crate) unsafe fn store_bf16(dst: *mut half::bf16, src: &[f32], scale: f32) {
    let n = src.len();
    let sv = _mm512_set1_ps(scale);
    let mut x = 0;
    while x + 16 <= n {
        let h = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(src.as_ptr().add(x)), sv));
        _mm256_storeu_si256(
            dst.add(x) as *mut __m256i,
            std::mem::transmute::<__m256bh, __m256i>(h),
        );
        x += 16;
    }
    for (i, &v) in src.iter().enumerate().skip(x) {
        dst.add(i).write(half::bf16::from_f32(v * scale));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `P·V` on f32 V rows read in place (`vps = NR`, any row stride: the rows' own width,
    /// wider, or 0 for a broadcast row) gives the bits of the same product on the packed
    /// V block (`pack::pack_v`'s layout), and both are within f32 rounding of an f64
    /// product: [`pv`] for strips of 6–144 rows, the decode path's live rows below 6, and
    /// key counts that leave every remainder of the 4-step unroll; [`pv_pair`] for one
    /// and two blocks. Outputs of 16 to 128 columns (every tile width of [`pv_impl`]), as
    /// the driver reads in place.
    #[test]
    fn pv_reads_v_rows_in_place_as_packed() {
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512dq")) {
            eprintln!("note: no AVX-512F/DQ on this machine; in-place V not exercised");
            return;
        }
        let val = |i: usize, m: usize| ((i * 37 + m) % 101) as f32 / 50.0 - 1.0;
        // Packs `nk` rows (stride `ld`) into panels `[nvp][BK][NR]`.
        let pack = |src: &[f32], ld: usize, nk: usize, ev: usize| {
            let mut vp = vec![0f32; ev * BK];
            for j in 0..nk {
                for c in 0..ev {
                    vp[(c / NR) * BK * NR + j * NR + c % NR] = src[j * ld + c];
                }
            }
            vp
        };
        for ev in [16usize, 32, 48, 64, 80, 128] {
            let nvp = ev / NR;
            for ld in [ev, ev + 48, 0] {
                let src: Vec<f32> = (0..2 * BK * ld.max(1) + ev).map(|i| val(i, 5)).collect();
                for (rows, live) in [(6, 6), (6, 1), (6, 5), (12, 12), (18, 18), (144, 144)] {
                    let p: Vec<f32> = (0..rows * 2 * BK).map(|i| val(i, 7) + 1.0).collect();
                    let alpha: Vec<f32> = (0..rows).map(|r| 0.5 + r as f32 / 64.0).collect();
                    let o0: Vec<f32> = (0..rows * ev).map(|i| val(i, 13)).collect();
                    for nk in [0usize, 1, 2, 3, 4, 5, 7, 17, 62, 63, 64] {
                        let vp = pack(&src, ld, nk, ev);
                        let (mut packed, mut rows_in) = (o0.clone(), o0.clone());
                        // SAFETY: AVX-512F and DQ detected above.
                        unsafe {
                            pv(&p, rows, live, nk, &vp, BK * NR, NR, nvp, &mut packed, ev, &alpha);
                            pv(&p, rows, live, nk, &src, NR, ld, nvp, &mut rows_in, ev, &alpha);
                        }
                        for r in 0..live {
                            for c in 0..ev {
                                let at = r * ev + c;
                                let (a, b) = (packed[at], rows_in[at]);
                                assert_eq!(
                                    a.to_bits(),
                                    b.to_bits(),
                                    "ev {ev} ld {ld} rows {rows} nk {nk}: ({r}, {c}) {a} against {b}"
                                );
                                let mut want = alpha[r] as f64 * o0[at] as f64;
                                let mut mag = want.abs();
                                for j in 0..nk {
                                    let t = p[r * BK + j] as f64 * src[j * ld + c] as f64;
                                    want += t;
                                    mag += t.abs();
                                }
                                assert!(
                                    (b as f64 - want).abs() <= 1e-6 * mag,
                                    "ev {ev} ld {ld} nk {nk}: ({r}, {c}) {b} against {want}"
                                );
                            }
                        }
                    }
                    if live < rows {
                        continue;
                    }
                    // Two blocks at once: P rows of 2·BK, block 1 from key BK on.
                    for nk1 in [0usize, 1, 5, 64] {
                        let (vp0, vp1) = (pack(&src, ld, BK, ev), pack(&src[BK * ld..], ld, nk1, ev));
                        let (mut packed, mut rows_in) = (o0.clone(), o0.clone());
                        // SAFETY: AVX-512F and DQ detected above.
                        unsafe {
                            pv_pair(
                                &p,
                                rows,
                                (&vp0, BK),
                                (&vp1, nk1),
                                (BK * NR, NR),
                                nvp,
                                &mut packed,
                                ev,
                                &alpha,
                            );
                            pv_pair(
                                &p,
                                rows,
                                (&src, BK),
                                (&src[BK * ld..], nk1),
                                (NR, ld),
                                nvp,
                                &mut rows_in,
                                ev,
                                &alpha,
                            );
                        }
                        for (at, (a, b)) in packed.iter().zip(&rows_in).enumerate() {
                            assert_eq!(
                                a.to_bits(),
                                b.to_bits(),
                                "pair: ev {ev} ld {ld} rows {rows} nk1 {nk1}: {at}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// `softmax_row_bf16` against f64 on rows of 1, 3, 4 and 16 chunks (the 32-key steps
    /// of the all-visible pass and their 16-key tail), all visible or a part, a row's
    /// first block (`m_old = −inf`) or a later one, with one or two bf16 components, on
    /// rows that keep the reference and rows that force a redo: a score more than
    /// `LAZY_RESCALE_LOG2` above the first 16 keys' maximum (the provisional reference of
    /// an all-visible first block) or above `m_old`, and a first chunk of `−inf` (an
    /// additive mask) that leaves no provisional reference. Checks the reference
    /// (`max − 8 ≤ m_new ≤ max` for a first block), `alpha`, every probability
    /// component (0 outside `[a, z)`), and the lane-wise sums.
    #[test]
    fn softmax_row_bf16_matches_f64() {
        if !(is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512dq")
            && is_x86_feature_detected!("avx512bf16"))
        {
            eprintln!("note: no AVX-512F/DQ/BF16 on this machine; softmax_row_bf16 not exercised");
            return;
        }
        let c = 0.18f32;
        let bf = |v: u16| half::bf16::from_bits(v).to_f64();
        for w in [16usize, 48, 64, 256] {
            for kind in 0..5 {
                let mut x: Vec<f32> = (0..w).map(|i| ((i * 37 + 11) % 53) as f32 / 4.0 - 6.0).collect();
                match kind {
                    // Many keys close to 2^8 above the reference but none past it: lane
                    // sums above `LAZY_SUM_BOUND` with no redo due (c·x in 5.4..6.5 past
                    // the first 16 keys, in −1.5..−0.3 on them).
                    4 => {
                        for (i, v) in x.iter_mut().enumerate() {
                            *v = 30.0 + (i % 7) as f32 - if i < 16 { 38.0 } else { 0.0 };
                        }
                    }
                    // A score far above the rest (c·150 = 27 against at most 1.4),
                    // after the first 16 keys.
                    1 => x[w - 1] = 150.0,
                    // The spike inside the first 16 keys.
                    2 => x[5] = 150.0,
                    // The first chunk masked out additively.
                    3 => x[..16].fill(f32::NEG_INFINITY),
                    _ => {}
                }
                let ranges = [(0, w), (3, w - 2), (w / 2, w)];
                for (a, z) in ranges {
                    for m_old in [f32::NEG_INFINITY, 1.0, -30.0] {
                        for two in [false, true] {
                            let vis: Vec<f64> = (a..z).map(|i| c as f64 * x[i] as f64).collect();
                            let vmax = vis.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                            let mut hi = vec![0xffffu16; w];
                            let mut lo = vec![0xffffu16; w];
                            let l_old = 0.5f32;
                            let mut l16 = [l_old / 16.0; 16];
                            let lo_p = if two {
                                lo.as_mut_ptr()
                            } else {
                                std::ptr::null_mut()
                            };
                            // SAFETY: features checked above; `hi` and `lo` hold `w` elements.
                            let (m_new, alpha) = unsafe {
                                softmax_row_bf16(&x, (a, z), c, m_old, (hi.as_mut_ptr(), lo_p), &mut l16)
                            };
                            let what = format!("w {w} kind {kind} [{a}, {z}) m_old {m_old} two {two}");
                            if vmax == f64::NEG_INFINITY {
                                // No finite score: the reference stays, every p is 0.
                                assert_eq!((m_new, alpha), (m_old, 1.0), "{what}");
                                assert!(hi.iter().all(|&h| h == 0), "{what}");
                                let l: f32 = l16.iter().sum();
                                assert!((l - l_old).abs() <= 1e-6, "{what}: l {l}");
                                continue;
                            }
                            let m = m_new as f64;
                            // The reference the pass starts from: `m_old`, or for a first
                            // block the maximum of the visible keys in the chunk of key `a`
                            // (in f32, as the kernel takes it).
                            let m_start = if m_old > f32::NEG_INFINITY {
                                m_old
                            } else {
                                let a16 = a / 16 * 16;
                                (a..z.min(a16 + 16))
                                    .map(|i| x[i] * c)
                                    .fold(f32::NEG_INFINITY, f32::max)
                            };
                            // No visible key more than 8 above it: it stays, with no redo.
                            if m_start.is_finite() && vmax - (m_start as f64) < 8.0 - 1e-3 {
                                assert_eq!(m_new, m_start, "{what}: reference moved");
                            }
                            if m_old == f32::NEG_INFINITY {
                                assert!(
                                    m >= vmax - 8.0 - 1e-4 && m <= vmax + 1e-4,
                                    "{what}: m_new {m} max {vmax}"
                                );
                                assert_eq!(alpha, 1.0, "{what}");
                            } else {
                                assert!(
                                    m >= m_old as f64 && m >= vmax - 8.0 - 1e-4,
                                    "{what}: m_new {m} max {vmax}"
                                );
                                let want = (m_old as f64 - m).exp2();
                                assert!(
                                    (alpha as f64 - want).abs() <= 1e-6 * want.max(1e-30),
                                    "{what}: alpha {alpha} want {want}"
                                );
                            }
                            let mut sum = 0f64;
                            for i in 0..w {
                                let got = bf(hi[i]) + if two { bf(lo[i]) } else { 0.0 };
                                if i < a || i >= z {
                                    assert_eq!(got, 0.0, "{what}: key {i} outside");
                                    continue;
                                }
                                let p = (c as f64 * x[i] as f64 - m).exp2();
                                sum += p;
                                // Relative: the short polynomial (1.1e-4 or 3e-6), the rounding
                                // to bf16 components (half an ulp, at most 2⁻⁸ or 2⁻¹⁶ of the
                                // value) and `c·x − m` in f32 (|c·x| ≤ 27 here: 2e-6).
                                let tol = 2e-6
                                    + if two {
                                        3e-6 + 2f64.powi(-16)
                                    } else {
                                        1.1e-4 + 2f64.powi(-8)
                                    };
                                assert!(
                                    (got - p).abs() <= tol * p + 1e-37,
                                    "{what}: key {i} p {p} got {got}"
                                );
                            }
                            let l: f64 = l16.iter().map(|&v| v as f64).sum();
                            let want = alpha as f64 * l_old as f64 + sum;
                            assert!((l - want).abs() <= 2e-4 * want, "{what}: l {l} want {want}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn exp2_512_accuracy() {
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512dq")) {
            eprintln!("note: no AVX-512F/DQ on this machine; exp2_512 not exercised");
            return;
        }
        let mut worst = 0f64;
        let mut x = -125.0f32;
        while x < 125.0 {
            let xs: [f32; 16] = std::array::from_fn(|i| x + i as f32 / 16.0);
            let mut out = [0f32; 16];
            // SAFETY: AVX-512F and DQ detected above; arrays hold 16 lanes.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr(), exp2_512(_mm512_loadu_ps(xs.as_ptr()))) };
            for (a, o) in xs.iter().zip(out) {
                let r = (*a as f64).exp2();
                worst = worst.max(((o as f64) - r).abs() / r);
            }
            x += 1.0;
        }
        assert!(worst < 3e-7, "worst rel err {worst}");
        let mut special = [0f32; 16];
        special[..8].copy_from_slice(&[f32::NEG_INFINITY, -1e30, -127.0, -200.0, 0.0, f32::NAN, -0.0, 1.0]);
        let mut out = [0f32; 16];
        // SAFETY: as above.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), exp2_512(_mm512_loadu_ps(special.as_ptr()))) };
        assert_eq!(&out[..8], &[0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 2.0]);
    }

    /// `qk_dot_raw` against f64 dot products for every live row count of a decode group
    /// (1..=24, so every score strip and its dispatch arm), at the head sizes with
    /// register strips (64, 128, 256) and one without (80), for f32, bf16 and f16 K rows
    /// (read in place; bf16 with Q in the split layout), over 70 keys (a tail of 6 after
    /// 64). Padding rows must get zero scores.
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

    #[test]
    fn decode_scores_match_f64_for_every_strip() {
        if !is_x86_feature_detected!("avx512f") {
            eprintln!("note: no AVX-512F on this machine; decode scores not exercised");
            return;
        }
        let (nk, lds) = (70usize, 80usize);
        let val = |i: usize, m: usize| ((i * 37 + m) % 101) as f32 / 50.0 - 1.0;
        for e in [64usize, 128, 256, 80] {
            let kf: Vec<f32> = (0..nk * e).map(|i| val(i, 3)).collect();
            let kb: Vec<half::bf16> = kf.iter().map(|&x| half::bf16::from_f32(x)).collect();
            let kh: Vec<half::f16> = kf.iter().map(|&x| half::f16::from_f32(x)).collect();
            for live in 1..=24usize {
                let rows = live.div_ceil(MR) * MR;
                let q: Vec<f32> = (0..rows * e).map(|i| val(i, 11)).collect();
                // (Every head size here is a multiple of 16, as half-precision rows need.)
                for dt in 0..3 {
                    // The K rows each dtype reads, widened exactly, for the reference.
                    let kw: Vec<f64> = match dt {
                        0 => kf.iter().map(|&x| x as f64).collect(),
                        1 => kb.iter().map(|x| x.to_f64()).collect(),
                        _ => kh.iter().map(|x| x.to_f64()).collect(),
                    };
                    let mut qk = q.clone();
                    if dt == 1 {
                        for row in qk.chunks_exact_mut(e) {
                            split_pairs(row);
                        }
                    }
                    let mut s = vec![f32::NAN; rows * lds];
                    let k = match dt {
                        0 => Data::F32(&kf),
                        1 => Data::BF16(&kb),
                        _ => Data::F16(&kh),
                    };
                    // Asking for nothing ahead, for rows ahead, and for lines ahead (past
                    // the last key too).
                    let ahead = [Ahead::Off, Ahead::Keys(8), Ahead::Bytes(256)][live % 3];
                    // SAFETY: AVX-512F detected above.
                    unsafe { qk_dot_raw(&qk, rows, live, e, k, (e, nk, ahead), &mut s, lds) };
                    for r in 0..rows {
                        for j in 0..nk {
                            let got = s[r * lds + j] as f64;
                            if r >= live {
                                assert_eq!(
                                    got, 0.0,
                                    "padding row {r} key {j} (e {e}, live {live}, dtype {dt})"
                                );
                                continue;
                            }
                            let (qr, kr) = (&q[r * e..(r + 1) * e], &kw[j * e..(j + 1) * e]);
                            let want: f64 = qr.iter().zip(kr).map(|(&a, &b)| a as f64 * b).sum();
                            let mag: f64 = qr.iter().zip(kr).map(|(&a, &b)| (a as f64 * b).abs()).sum();
                            assert!(
                                (got - want).abs() <= 1e-6 * mag,
                                "row {r} key {j} (e {e}, live {live}, dtype {dt}): {got} against {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}
