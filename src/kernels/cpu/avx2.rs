//! AVX2 + FMA micro-kernels: 6×16 register tiles (12 accumulators, 2 panel loads and
//! 1 or 2 broadcasts: 15 or 16 of the 16 ymm registers). The contraction loop of both
//! block products is written in assembly ([`rows_loop_6x16`]).
//!
//! Every function here is `unsafe` and requires a CPU with AVX2, FMA and F16C; the
//! dispatcher only selects `Isa::Avx2Fma` after runtime detection.

use super::exp::avx2::{exp2_256, exp2_256_nonpos, exp2_256_nonpos_n};
use super::prefetch::{prefetch_bytes, PF_KEYS};
use super::tiles::{BK, NR};
use super::view::Data;
use std::arch::x86_64::*;

/// Rows per register tile.
pub(super) const MR: usize = super::tiles::MR;

/// See [`super::portable::qk`], except that Q is row-major (row stride `e`), not
/// strip-packed (the 6-row tiles broadcast from the rows, [`rows_loop_6x16`]); `rows`
/// must be a multiple of [`MR`].
///
/// # Safety
/// AVX2 and FMA must be available.
pub(super) unsafe fn qk(
    q: &[f32],
    rows: usize,
    e: usize,
    kp: &[f32],
    npanels: usize,
    s: &mut [f32],
    lds: usize,
) {
    // SAFETY: features guaranteed by the caller.
    unsafe { qk_checked::<false>(q, rows, e, kp, npanels, s, lds, &mut []) }
}

/// [`qk`], and also each row's lane-wise maximum over all its scores: on return,
/// `mx[r·8..r·8 + 8]` holds 8 partial maxima of row `r` (their maximum is the row's),
/// for [`online_rows_block_premax`]. `npanels` must be at least 1.
///
/// # Safety
/// AVX2 and FMA must be available.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn qk_max(
    q: &[f32],
    rows: usize,
    e: usize,
    kp: &[f32],
    npanels: usize,
    s: &mut [f32],
    lds: usize,
    mx: &mut [f32],
) {
    // SAFETY: features guaranteed by the caller.
    unsafe { qk_checked::<true>(q, rows, e, kp, npanels, s, lds, mx) }
}

/// The bounds checks of [`qk`] (and, with `MAX`, of [`qk_max`]), then the kernel.
#[allow(clippy::too_many_arguments)]
unsafe fn qk_checked<const MAX: bool>(
    q: &[f32],
    rows: usize,
    e: usize,
    kp: &[f32],
    npanels: usize,
    s: &mut [f32],
    lds: usize,
    mx: &mut [f32],
) {
    assert!(rows.is_multiple_of(MR) && lds >= npanels * NR);
    assert!(q.len() >= rows * e && kp.len() >= npanels * e * NR);
    assert!(rows == 0 || s.len() >= (rows - 1) * lds + npanels * NR);
    assert!(!MAX || (npanels >= 1 && mx.len() >= rows * 8));
    // SAFETY: bounds asserted above (`mx` is only written with `MAX`); features
    // guaranteed by the caller.
    unsafe {
        qk_impl::<MAX>(
            q.as_ptr(),
            rows,
            e,
            kp.as_ptr(),
            npanels,
            s.as_mut_ptr(),
            lds,
            mx.as_mut_ptr(),
        )
    }
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
unsafe fn qk_impl<const MAX: bool>(
    q: *const f32,
    rows: usize,
    e: usize,
    kp: *const f32,
    npanels: usize,
    s: *mut f32,
    lds: usize,
    mx: *mut f32,
) {
    // Panel-outer: the K panel (16 keys × E) stays in L1 while Q strips stream.
    for p in 0..npanels {
        let kpp = kp.add(p * e * NR);
        for strip in 0..rows / MR {
            let mut acc = [_mm256_setzero_ps(); 2 * MR];
            // SAFETY: the strip's six Q rows (`e` floats each) and the K panel (`e`
            // steps of 16 floats) are inside `q` and `kp` (asserted by the callers).
            unsafe { rows_loop_6x16(&mut acc, q.add(strip * MR * e), e * 4, kpp, e) };
            let sp = s.add(strip * MR * lds + p * NR);
            for r in 0..MR {
                _mm256_storeu_ps(sp.add(r * lds), acc[2 * r]);
                _mm256_storeu_ps(sp.add(r * lds + 8), acc[2 * r + 1]);
            }
            if MAX {
                let mp = mx.add(strip * MR * 8);
                for r in 0..MR {
                    let v = _mm256_max_ps(acc[2 * r], acc[2 * r + 1]);
                    let v = if p == 0 {
                        v
                    } else {
                        _mm256_max_ps(v, _mm256_loadu_ps(mp.add(r * 8)))
                    };
                    _mm256_storeu_ps(mp.add(r * 8), v);
                }
            }
        }
    }
}

/// One step of [`rows_loop_6x16`] as assembly text: the 16-lane panel row at byte
/// offset `$db` from `{b}`, the six row elements at byte offset `$da` from their row
/// (rows `{g0}`, `+ {la}`, `+ 2·{la}`, then the same from `{g1}`), 12 FMAs into
/// `ymm0..ymm11` (two per row).
macro_rules! tile_step_6x16 {
    ($da:literal, $db:literal) => {
        concat!(
            "vmovups ymm12, ymmword ptr [{b} + ",
            $db,
            "]\n",
            "vmovups ymm13, ymmword ptr [{b} + ",
            $db,
            " + 32]\n",
            "vbroadcastss ymm14, dword ptr [{g0} + ",
            $da,
            "]\n",
            "vfmadd231ps ymm0, ymm14, ymm12\n",
            "vfmadd231ps ymm1, ymm14, ymm13\n",
            "vbroadcastss ymm15, dword ptr [{g0} + {la} + ",
            $da,
            "]\n",
            "vfmadd231ps ymm2, ymm15, ymm12\n",
            "vfmadd231ps ymm3, ymm15, ymm13\n",
            "vbroadcastss ymm14, dword ptr [{g0} + {la}*2 + ",
            $da,
            "]\n",
            "vfmadd231ps ymm4, ymm14, ymm12\n",
            "vfmadd231ps ymm5, ymm14, ymm13\n",
            "vbroadcastss ymm15, dword ptr [{g1} + ",
            $da,
            "]\n",
            "vfmadd231ps ymm6, ymm15, ymm12\n",
            "vfmadd231ps ymm7, ymm15, ymm13\n",
            "vbroadcastss ymm14, dword ptr [{g1} + {la} + ",
            $da,
            "]\n",
            "vfmadd231ps ymm8, ymm14, ymm12\n",
            "vfmadd231ps ymm9, ymm14, ymm13\n",
            "vbroadcastss ymm15, dword ptr [{g1} + {la}*2 + ",
            $da,
            "]\n",
            "vfmadd231ps ymm10, ymm15, ymm12\n",
            "vfmadd231ps ymm11, ymm15, ymm13\n",
        )
    };
}

/// A 6×16 register-tile loop in assembly, as `avx512::rows_loop_6x4` is for AVX-512:
/// `n` steps of `acc[2·r + i] += a_r · b_i`, where step `x` broadcasts `a_r` from byte
/// `(r % 3)·la + 4x` of group pointer `r / 3` (`g1 = a + 3·la`: six row-major rows of
/// stride `la` bytes) and loads `b_0`, `b_1` (8 lanes each) from byte `64x` of `b` (a
/// `[n][16]` panel). Per step 2 loads, 6 broadcasts and 12 FMAs; four steps share one
/// set of pointer updates. It is the key loop of [`qk`] (so Q stays row-major on AVX2
/// and the driver does not copy it into strips), of [`pv`] on packed V and of whole
/// 6-row strips of [`gemm`].
///
/// # Safety
/// AVX2 and FMA must be available; the six rows must hold `n` floats each and `b`
/// `16·n`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_loop_6x16(acc: &mut [__m256; 2 * MR], a: *const f32, la: usize, b: *const f32, n: usize) {
    if n == 0 {
        return;
    }
    // SAFETY: the caller guarantees the `a` rows and the `b` panel of `n` steps.
    unsafe {
        std::arch::asm!(
            "test {q}, {q}",
            "jz 3f",
            "2:",
            tile_step_6x16!("0", "0"),
            tile_step_6x16!("4", "64"),
            tile_step_6x16!("8", "128"),
            tile_step_6x16!("12", "192"),
            "add {g0}, 16",
            "add {g1}, 16",
            "add {b}, 256",
            "dec {q}",
            "jnz 2b",
            "3:",
            "test {r}, {r}",
            "jz 5f",
            "4:",
            tile_step_6x16!("0", "0"),
            "add {g0}, 4",
            "add {g1}, 4",
            "add {b}, 64",
            "dec {r}",
            "jnz 4b",
            "5:",
            inout("ymm0") acc[0],
            inout("ymm1") acc[1],
            inout("ymm2") acc[2],
            inout("ymm3") acc[3],
            inout("ymm4") acc[4],
            inout("ymm5") acc[5],
            inout("ymm6") acc[6],
            inout("ymm7") acc[7],
            inout("ymm8") acc[8],
            inout("ymm9") acc[9],
            inout("ymm10") acc[10],
            inout("ymm11") acc[11],
            out("ymm12") _,
            out("ymm13") _,
            out("ymm14") _,
            out("ymm15") _,
            g0 = inout(reg) a => _,
            g1 = inout(reg) a.wrapping_byte_add(3 * la) => _,
            b = inout(reg) b => _,
            q = inout(reg) n / 4 => _,
            r = inout(reg) n % 4 => _,
            la = in(reg) la,
            options(nostack, readonly),
        );
    }
}

/// See [`super::portable::pv`] (P row-major with row stride [`BK`]); `rows` must be a
/// multiple of [`MR`]. With packed V (`ldv == NR`) the key loop is [`rows_loop_6x16`];
/// other V row strides take the same steps in intrinsics.
///
/// # Safety
/// AVX2 and FMA must be available.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn pv(
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
    assert!(rows.is_multiple_of(MR) && BK >= nk && ldo >= nvp * NR && alpha.len() >= rows);
    assert!(p.len() >= rows * BK);
    assert!(nvp == 0 || nk == 0 || vp.len() >= (nvp - 1) * vps + (nk - 1) * ldv + NR);
    assert!(rows == 0 || o.len() >= (rows - 1) * ldo + nvp * NR);
    // SAFETY: bounds asserted above; features guaranteed by the caller.
    unsafe {
        pv_impl(
            p.as_ptr(),
            rows,
            nk,
            vp.as_ptr(),
            vps,
            ldv,
            nvp,
            o.as_mut_ptr(),
            ldo,
            alpha.as_ptr(),
        )
    }
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
unsafe fn pv_impl(
    p: *const f32,
    rows: usize,
    nk: usize,
    vp: *const f32,
    vps: usize,
    ldv: usize,
    nvp: usize,
    o: *mut f32,
    ldo: usize,
    alpha: *const f32,
) {
    // Panel-outer: the V panel (BK keys × 16) stays in L1 while P strips stream.
    for n in 0..nvp {
        let vpp = vp.add(n * vps);
        for strip in 0..rows / MR {
            let ps = p.add(strip * MR * BK);
            let op = o.add(strip * MR * ldo + n * NR);
            let mut acc = [_mm256_setzero_ps(); 2 * MR];
            for r in 0..MR {
                let a = _mm256_broadcast_ss(&*alpha.add(strip * MR + r));
                acc[2 * r] = _mm256_mul_ps(a, _mm256_loadu_ps(op.add(r * ldo)));
                acc[2 * r + 1] = _mm256_mul_ps(a, _mm256_loadu_ps(op.add(r * ldo + 8)));
            }
            // A macro (not a closure: closures do not inherit `target_feature`).
            macro_rules! step {
                ($acc:expr, $j:expr) => {{
                    let j = $j;
                    let v0 = _mm256_loadu_ps(vpp.add(j * ldv));
                    let v1 = _mm256_loadu_ps(vpp.add(j * ldv + 8));
                    for r in 0..MR {
                        let a = _mm256_broadcast_ss(&*ps.add(r * BK + j));
                        $acc[2 * r] = _mm256_fmadd_ps(a, v0, $acc[2 * r]);
                        $acc[2 * r + 1] = _mm256_fmadd_ps(a, v1, $acc[2 * r + 1]);
                    }
                }};
            }
            if ldv == NR {
                // SAFETY: the strip's six P rows (`nk ≤ BK` floats each) and the V panel
                // (`nk` rows of 16 floats) are inside `p` and `vp` (asserted by `pv`).
                unsafe { rows_loop_6x16(&mut acc, ps, BK * 4, vpp, nk) };
            } else {
                let mut j = 0;
                while j + 2 <= nk {
                    step!(acc, j);
                    step!(acc, j + 1);
                    j += 2;
                }
                if j < nk {
                    step!(acc, j);
                }
            }
            for r in 0..MR {
                _mm256_storeu_ps(op.add(r * ldo), acc[2 * r]);
                _mm256_storeu_ps(op.add(r * ldo + 8), acc[2 * r + 1]);
            }
        }
    }
}

/// Row maximum (-inf for empty / all -inf rows).
#[target_feature(enable = "avx2,fma")]
unsafe fn row_max_impl(x: &[f32]) -> f32 {
    let n = x.len();
    let ptr = x.as_ptr();
    let mut m0 = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut m1 = m0;
    let mut j = 0;
    while j + 16 <= n {
        m0 = _mm256_max_ps(m0, _mm256_loadu_ps(ptr.add(j)));
        m1 = _mm256_max_ps(m1, _mm256_loadu_ps(ptr.add(j + 8)));
        j += 16;
    }
    if j + 8 <= n {
        m0 = _mm256_max_ps(m0, _mm256_loadu_ps(ptr.add(j)));
        j += 8;
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_max_ps(m0, m1));
    let mut r = f32::NEG_INFINITY;
    for &v in lanes.iter().chain(&x[j..]) {
        if v > r {
            r = v;
        }
    }
    r
}

/// `x[j] = 2^(x[j] - m)`; returns the sum.
#[target_feature(enable = "avx2,fma")]
unsafe fn exp2_sub_sum_impl(x: &mut [f32], m: f32) -> f32 {
    let n = x.len();
    let ptr = x.as_mut_ptr();
    let mv = _mm256_set1_ps(m);
    let mut s0 = _mm256_setzero_ps();
    let mut s1 = _mm256_setzero_ps();
    let mut j = 0;
    while j + 16 <= n {
        let a = exp2_256_nonpos(_mm256_sub_ps(_mm256_loadu_ps(ptr.add(j)), mv));
        let b = exp2_256_nonpos(_mm256_sub_ps(_mm256_loadu_ps(ptr.add(j + 8)), mv));
        _mm256_storeu_ps(ptr.add(j), a);
        _mm256_storeu_ps(ptr.add(j + 8), b);
        s0 = _mm256_add_ps(s0, a);
        s1 = _mm256_add_ps(s1, b);
        j += 16;
    }
    while j < n {
        let mut tail = [f32::NEG_INFINITY; 8];
        let t = (n - j).min(8);
        tail[..t].copy_from_slice(&x[j..j + t]);
        let a = exp2_256(_mm256_sub_ps(_mm256_loadu_ps(tail.as_ptr()), mv));
        _mm256_storeu_ps(tail.as_mut_ptr(), a);
        x[j..j + t].copy_from_slice(&tail[..t]);
        s0 = _mm256_add_ps(s0, a);
        j += t;
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(s0, s1));
    lanes.iter().sum()
}

/// Element kinds of the K/V rows that the decode kernels read in place.
const F32: u8 = 0;
const BF16: u8 = 1;
const F16: u8 = 2;

/// Eight elements of kind `T` at element index `idx` of `p`, as f32 (bf16 → f32 is a
/// 16-bit shift, f16 → f32 one F16C conversion).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load8<const T: u8>(p: *const u8, idx: usize) -> __m256 {
    if T == F32 {
        _mm256_loadu_ps((p as *const f32).add(idx))
    } else {
        let h = _mm_loadu_si128((p as *const u16).add(idx) as *const __m128i);
        if T == BF16 {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        } else {
            _mm256_cvtph_ps(h)
        }
    }
}

/// The rows of `d` as `(pointer, element count, kind)`.
fn rows_of(d: Data) -> (*const u8, usize, u8) {
    match d {
        Data::F32(v) => (v.as_ptr() as *const u8, v.len(), F32),
        Data::BF16(v) => (v.as_ptr() as *const u8, v.len(), BF16),
        Data::F16(v) => (v.as_ptr() as *const u8, v.len(), F16),
    }
}

/// See [`super::portable::qk_dot`]: scores against row-major keys (decode path), for
/// the first `live` of `rows` rows (the others are not written). `rows` must be a
/// multiple of [`MR`] and `e` a multiple of 8. `k` holds f32, bf16 or f16 rows (half
/// precision is read in place and widened in registers).
///
/// # Safety
/// AVX2, FMA and F16C must be available.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn qk_dot(
    q: &[f32],
    rows: usize,
    live: usize,
    e: usize,
    k: Data,
    ldk: usize,
    nk: usize,
    s: &mut [f32],
    lds: usize,
) {
    let (kp, len, kind) = rows_of(k);
    assert!(
        rows.is_multiple_of(MR) && live <= rows && e.is_multiple_of(8) && lds >= nk && q.len() >= rows * e
    );
    assert!(nk == 0 || len >= (nk - 1) * ldk + e);
    assert!(rows == 0 || s.len() >= (rows - 1) * lds + nk);
    let (q, s) = (q.as_ptr(), s.as_mut_ptr());
    // SAFETY: bounds asserted above; features guaranteed by the caller.
    unsafe {
        match kind {
            F32 => qk_dot_impl::<F32>(q, live, e, kp, ldk, nk, s, lds),
            BF16 => qk_dot_impl::<BF16>(q, live, e, kp, ldk, nk, s, lds),
            _ => qk_dot_impl::<F16>(q, live, e, kp, ldk, nk, s, lds),
        }
    }
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn qk_dot_impl<const T: u8>(
    q: *const f32,
    live: usize,
    e: usize,
    k: *const u8,
    ldk: usize,
    nk: usize,
    s: *mut f32,
    lds: usize,
) {
    // Strips of up to `MR` live rows; padding rows are skipped (decode has few live
    // rows: one per query head of the group). The first strip asks for the K rows
    // `PF_KEYS` ahead, which are read once.
    let mut r0 = 0;
    while r0 < live {
        let r = (live - r0).min(MR);
        let (qs, sp, pf) = (q.add(r0 * e), s.add(r0 * lds), r0 == 0);
        match r {
            1 => qk_dot_strip::<T, 1, 4>(qs, e, k, ldk, nk, sp, lds, pf),
            2 => qk_dot_strip::<T, 2, 4>(qs, e, k, ldk, nk, sp, lds, pf),
            3 => qk_dot_strip::<T, 3, 4>(qs, e, k, ldk, nk, sp, lds, pf),
            4 => qk_dot_strip::<T, 4, 2>(qs, e, k, ldk, nk, sp, lds, pf),
            5 => qk_dot_strip::<T, 5, 2>(qs, e, k, ldk, nk, sp, lds, pf),
            _ => qk_dot_strip::<T, 6, 2>(qs, e, k, ldk, nk, sp, lds, pf),
        }
        r0 += r;
    }
}

/// Scores of `R` row-major Q rows against `NK` keys of kind `T` per pass (`R·NK ≤ 12`
/// accumulators).
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn qk_dot_strip<const T: u8, const R: usize, const NK: usize>(
    qs: *const f32,
    e: usize,
    k: *const u8,
    ldk: usize,
    nk: usize,
    s: *mut f32,
    lds: usize,
    pf: bool,
) {
    let size = if T == F32 { 4 } else { 2 };
    let mut j = 0;
    while j < nk {
        let t = (nk - j).min(NK);
        // (At a tail, the missing keys repeat the last one and are not stored.)
        let mut kp = [0usize; NK];
        for (c, p) in kp.iter_mut().enumerate() {
            *p = (j + c.min(t - 1)) * ldk;
            if pf && c < t {
                prefetch_bytes(k.wrapping_add((*p + PF_KEYS * ldk) * size), e * size);
            }
        }
        let mut acc = [[_mm256_setzero_ps(); NK]; R];
        let mut x = 0;
        while x < e {
            let mut kv = [_mm256_setzero_ps(); NK];
            for c in 0..NK {
                kv[c] = load8::<T>(k, kp[c] + x);
            }
            for (r, ar) in acc.iter_mut().enumerate() {
                let a = _mm256_loadu_ps(qs.add(r * e + x));
                for c in 0..NK {
                    ar[c] = _mm256_fmadd_ps(a, kv[c], ar[c]);
                }
            }
            x += 8;
        }
        for (r, ar) in acc.iter().enumerate() {
            for (c, &v) in ar.iter().enumerate().take(t) {
                *s.add(r * lds + j + c) = hsum(v);
            }
        }
        j += t;
    }
}

/// One online-softmax row update: `m_new = max(m_old, max x)`, `x[j] = 2^(x[j] - m_new)`;
/// returns `(m_new, alpha = 2^(m_old - m_new), Σ x)`. When `m_new` is -inf, `x` is
/// left untouched and `(−inf, 1, 0)` is returned.
///
/// # Safety
/// AVX2 and FMA must be available.
pub(super) unsafe fn online_row(x: &mut [f32], m_old: f32) -> (f32, f32, f32) {
    // SAFETY: features guaranteed by the caller; all accesses are in bounds of `x`.
    unsafe { online_row_impl(x, m_old) }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn online_row_impl(x: &mut [f32], m_old: f32) -> (f32, f32, f32) {
    let bm = row_max_impl(x);
    let m_new = if bm > m_old { bm } else { m_old };
    if m_new == f32::NEG_INFINITY {
        return (m_new, 1.0, 0.0);
    }
    let alpha = if m_old == m_new {
        1.0
    } else {
        _mm_cvtss_f32(_mm256_castps256_ps128(exp2_256(_mm256_set1_ps(m_old - m_new))))
    };
    (m_new, alpha, exp2_sub_sum_impl(x, m_new))
}

/// Decode `O = alpha·O + P·V` for the first `live` rows, walking the V rows in key
/// order, four keys at a time, each over all `ncols` columns (a multiple of 8). `p`: row
/// stride [`BK`]; V row `j` at element `j * ldv` of `v` (f32, or half precision read in
/// place and widened in registers); `o`: row stride `ldo`. Reading each streamed V row
/// to its end before the next keeps DRAM reads sequential, where the panel kernel
/// [`pv`] reads 16 columns of every row per pass. With four keys, the rows go in pairs,
/// so each V vector is loaded and widened once per two rows (a GQA group's rows share
/// the V rows).
///
/// # Safety
/// AVX2, FMA and F16C must be available.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn pv_rows(
    p: &[f32],
    live: usize,
    nk: usize,
    v: Data,
    ldv: usize,
    ncols: usize,
    o: &mut [f32],
    ldo: usize,
    alpha: &[f32],
) {
    let (vp, len, kind) = rows_of(v);
    assert!(BK >= nk && ncols.is_multiple_of(8) && ldo >= ncols && alpha.len() >= live);
    assert!(live == 0 || p.len() >= (live - 1) * BK + nk);
    assert!(nk == 0 || ncols == 0 || len >= (nk - 1) * ldv + ncols);
    assert!(live == 0 || o.len() >= (live - 1) * ldo + ncols);
    let (p, o) = (p.as_ptr(), o.as_mut_ptr());
    // SAFETY: bounds asserted above; features guaranteed by the caller.
    unsafe {
        match kind {
            F32 => pv_rows_impl::<F32>(p, live, nk, vp, ldv, ncols, o, ldo, alpha),
            BF16 => pv_rows_impl::<BF16>(p, live, nk, vp, ldv, ncols, o, ldo, alpha),
            _ => pv_rows_impl::<F16>(p, live, nk, vp, ldv, ncols, o, ldo, alpha),
        }
    }
}

/// Four keys' V vectors: 8 elements at element `at` of `v`, then of the next three rows
/// (row stride `ldv`), widened to f32.
///
/// # Safety
/// AVX2 and F16C must be available; the four rows must hold 8 elements at `at`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn v4<const T: u8>(v: *const u8, at: usize, ldv: usize) -> [__m256; 4] {
    // (No `map` closure: closures do not inherit `target_feature`.)
    [
        load8::<T>(v, at),
        load8::<T>(v, at + ldv),
        load8::<T>(v, at + 2 * ldv),
        load8::<T>(v, at + 3 * ldv),
    ]
}

/// Four probabilities from `p`, each broadcast to 8 lanes.
///
/// # Safety
/// AVX must be available; `p` must hold 4 floats.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn p4(p: *const f32) -> [__m256; 4] {
    [
        _mm256_broadcast_ss(&*p),
        _mm256_broadcast_ss(&*p.add(1)),
        _mm256_broadcast_ss(&*p.add(2)),
        _mm256_broadcast_ss(&*p.add(3)),
    ]
}

/// `*o += p[0]·v[0] + p[1]·v[1] + p[2]·v[2] + p[3]·v[3]` on 8 lanes, as four fused
/// multiply-adds in that order.
///
/// # Safety
/// AVX2 and FMA must be available; `o` must hold 8 floats.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn madd4(o: *mut f32, p: &[__m256; 4], v: &[__m256; 4]) {
    let mut acc = _mm256_loadu_ps(o);
    for (&pi, &vi) in p.iter().zip(v) {
        acc = _mm256_fmadd_ps(pi, vi, acc);
    }
    _mm256_storeu_ps(o, acc);
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pv_rows_impl<const T: u8>(
    p: *const f32,
    live: usize,
    nk: usize,
    v: *const u8,
    ldv: usize,
    ncols: usize,
    o: *mut f32,
    ldo: usize,
    alpha: &[f32],
) {
    for (r, &a) in alpha.iter().enumerate().take(live) {
        if a != 1.0 {
            let av = _mm256_set1_ps(a);
            let orow = o.add(r * ldo);
            for c in (0..ncols).step_by(8) {
                _mm256_storeu_ps(orow.add(c), _mm256_mul_ps(av, _mm256_loadu_ps(orow.add(c))));
            }
        }
    }
    let size = if T == F32 { 4 } else { 2 };
    let mut j = 0;
    while j < nk {
        let t = (nk - j).min(4);
        for jj in 0..t {
            prefetch_bytes(v.wrapping_add((j + jj + PF_KEYS) * ldv * size), ncols * size);
        }
        let vr = j * ldv;
        let mut r = 0;
        if t == 4 {
            // Two rows at a time: each V vector is loaded (and widened) once for both.
            while r + 2 <= live {
                let (a, b) = (p4(p.add(r * BK + j)), p4(p.add((r + 1) * BK + j)));
                let (oa, ob) = (o.add(r * ldo), o.add((r + 1) * ldo));
                for c in (0..ncols).step_by(8) {
                    let vs = v4::<T>(v, vr + c, ldv);
                    madd4(oa.add(c), &a, &vs);
                    madd4(ob.add(c), &b, &vs);
                }
                r += 2;
            }
        }
        for r in r..live {
            let orow = o.add(r * ldo);
            if t == 4 {
                let pr = p4(p.add(r * BK + j));
                for c in (0..ncols).step_by(8) {
                    madd4(orow.add(c), &pr, &v4::<T>(v, vr + c, ldv));
                }
            } else {
                for jj in 0..t {
                    let pj = _mm256_broadcast_ss(&*p.add(r * BK + j + jj));
                    for c in (0..ncols).step_by(8) {
                        let vj = load8::<T>(v, vr + jj * ldv + c);
                        _mm256_storeu_ps(orow.add(c), _mm256_fmadd_ps(pj, vj, _mm256_loadu_ps(orow.add(c))));
                    }
                }
            }
        }
        j += t;
    }
}

/// Transposes an 8×8 f32 block: row `i` of `dst` (stride `ldd`) receives column `i`
/// of `src` (8 rows of stride `lds`). Unpacks of 32- and 64-bit elements, then 128-bit
/// lane permutes.
///
/// # Safety
/// AVX2 must be available; `src` must hold 8 rows of 8 floats at stride `lds`, `dst`
/// 8 rows of 8 at stride `ldd`.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn transpose8(src: *const f32, lds: usize, dst: *mut f32, ldd: usize) {
    let r: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(src.add(i * lds)));
    // t[2i], t[2i+1]: 32-bit interleaves of rows 2i and 2i+1.
    let mut t = [_mm256_setzero_ps(); 8];
    for i in 0..4 {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    // u[4i + c], 128-bit lane `L`: column `4L + c` of rows `4i..4i + 4`.
    let mut u = [_mm256_setzero_ps(); 8];
    for i in 0..2 {
        let pd = |v: __m256| _mm256_castps_pd(v);
        let (a, b, c, d) = (pd(t[4 * i]), pd(t[4 * i + 1]), pd(t[4 * i + 2]), pd(t[4 * i + 3]));
        u[4 * i] = _mm256_castpd_ps(_mm256_unpacklo_pd(a, c));
        u[4 * i + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(a, c));
        u[4 * i + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(b, d));
        u[4 * i + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(b, d));
    }
    // Column `4L + c` is lane `L` of u[c] (rows 0..4) then lane `L` of u[4 + c] (rows 4..8).
    for c in 0..4 {
        _mm256_storeu_ps(dst.add(c * ldd), _mm256_permute2f128_ps::<0x20>(u[c], u[4 + c]));
        _mm256_storeu_ps(
            dst.add((4 + c) * ldd),
            _mm256_permute2f128_ps::<0x31>(u[c], u[4 + c]),
        );
    }
}

/// Horizontal maximum of `x`, in every lane.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn hmax_all(x: __m256) -> __m256 {
    let a = _mm256_max_ps(x, _mm256_permute2f128_ps::<1>(x, x));
    let b = _mm256_max_ps(a, _mm256_shuffle_ps::<0b0100_1110>(a, a));
    _mm256_max_ps(b, _mm256_shuffle_ps::<0b1011_0001>(b, b))
}

/// Horizontal sum of `x`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum(x: __m256) -> f32 {
    let a = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps::<1>(x));
    let b = _mm_add_ps(a, _mm_movehl_ps(a, a));
    _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)))
}

/// The online-softmax update of `n` score rows of one block of at most [`BK`] keys
/// (row `r` at `s[r * lds..]`, `lds ≥ BK`), where row `r` sees keys `range(r) = (a, z)`,
/// `a ≤ z ≤ BK`. Per row, as [`online_row`] on `row[a..z]`: `m_new = max(m, max)`,
/// `row = 2^(row − m_new)`, `alpha = 2^(m − m_new)`, `l = l·alpha + Σ row`, `m = m_new`,
/// and the row's other keys up to [`BK`] become 0. A row with no finite score becomes 0
/// with `alpha = 1` and `m`, `l` unchanged. Each row is read in eight vectors, with lanes
/// outside its range replaced by −inf, in two passes over all rows (maxima and `alpha`,
/// then probabilities and sums): one row's chain from its loads to its sum is longer than
/// the out-of-order window, so a single pass per row leaves the rows serialised. For the
/// same reason a row's eight exponentials run interleaved, step by step
/// ([`exp2_256_nonpos_n`]), not one after the other.
///
/// # Safety
/// AVX2 and FMA must be available, and every `range(r)` must satisfy `a ≤ z ≤ BK`.
pub(super) unsafe fn online_rows_block(
    s: &mut [f32],
    lds: usize,
    n: usize,
    range: impl Fn(usize) -> (usize, usize),
    (m, l, alpha): (&mut [f32], &mut [f32], &mut [f32]),
) {
    assert!(lds >= BK && m.len() >= n && l.len() >= n && alpha.len() >= n);
    assert!(n == 0 || s.len() >= (n - 1) * lds + BK);
    // SAFETY: bounds asserted above; features guaranteed by the caller.
    unsafe {
        online_rows_block_inner::<false>(s.as_mut_ptr(), lds, n, range, std::ptr::null(), (m, l, alpha))
    }
}

/// Row `r`'s eight vectors, −inf outside `(a, z)`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn load_row_ranged(row: *const f32, (a, z): (usize, usize)) -> [__m256; BK / 8] {
    let mut x = [_mm256_setzero_ps(); BK / 8];
    for (i, xi) in x.iter_mut().enumerate() {
        *xi = _mm256_loadu_ps(row.add(8 * i));
    }
    if a > 0 || z < BK {
        let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let (av, zv) = (_mm256_set1_epi32(a as i32 - 1), _mm256_set1_epi32(z as i32));
        let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
        for (i, xi) in x.iter_mut().enumerate() {
            let j = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * i as i32));
            // a ≤ j < z  ⇔  j > a − 1  and  z > j
            let vis = _mm256_and_si256(_mm256_cmpgt_epi32(j, av), _mm256_cmpgt_epi32(zv, j));
            *xi = _mm256_blendv_ps(ninf, *xi, _mm256_castsi256_ps(vis));
        }
    }
    x
}

/// `PRE`: the row maxima come from `pre` (see [`online_rows_block_premax`]).
#[target_feature(enable = "avx2,fma")]
unsafe fn online_rows_block_inner<const PRE: bool>(
    s: *mut f32,
    lds: usize,
    n: usize,
    range: impl Fn(usize) -> (usize, usize),
    pre: *const f32,
    (m, l, alpha): (&mut [f32], &mut [f32], &mut [f32]),
) {
    const V: usize = BK / 8;
    for r in 0..n {
        let mx = if PRE {
            _mm256_loadu_ps(pre.add(r * 8))
        } else {
            let x = load_row_ranged(s.add(r * lds), range(r));
            let mut t = [_mm256_setzero_ps(); V / 2];
            for (i, ti) in t.iter_mut().enumerate() {
                *ti = _mm256_max_ps(x[2 * i], x[2 * i + 1]);
            }
            _mm256_max_ps(_mm256_max_ps(t[0], t[1]), _mm256_max_ps(t[2], t[3]))
        };
        let m_old = m[r];
        let m_new = _mm_cvtss_f32(_mm256_castps256_ps128(_mm256_max_ps(
            hmax_all(mx),
            _mm256_set1_ps(m_old),
        )));
        alpha[r] = if m_old == m_new || m_new == f32::NEG_INFINITY {
            1.0
        } else {
            _mm_cvtss_f32(_mm256_castps256_ps128(exp2_256(_mm256_set1_ps(m_old - m_new))))
        };
        m[r] = m_new;
    }
    for r in 0..n {
        let row = s.add(r * lds);
        let m_new = m[r];
        if m_new == f32::NEG_INFINITY {
            for i in 0..V {
                _mm256_storeu_ps(row.add(8 * i), _mm256_setzero_ps());
            }
            continue;
        }
        let x = load_row_ranged(row, range(r));
        let mv = _mm256_set1_ps(m_new);
        let mut sum = [_mm256_setzero_ps(); 2];
        let mut d = x;
        for v in d.iter_mut() {
            *v = _mm256_sub_ps(*v, mv);
        }
        let p = exp2_256_nonpos_n(d);
        for (i, &pi) in p.iter().enumerate() {
            _mm256_storeu_ps(row.add(8 * i), pi);
            sum[i % 2] = _mm256_add_ps(sum[i % 2], pi);
        }
        l[r] = l[r] * alpha[r] + hsum(_mm256_add_ps(sum[0], sum[1]));
    }
}

/// [`online_rows_block`] for `n` rows that each see all [`BK`] keys, with their maxima
/// already known as 8 lane-wise partial maxima per row (`mx[r·8..r·8 + 8]`, from
/// [`qk_max`]): the first pass reads those instead of the rows.
///
/// # Safety
/// AVX2 and FMA must be available.
pub(super) unsafe fn online_rows_block_premax(
    s: &mut [f32],
    lds: usize,
    n: usize,
    mx: &[f32],
    (m, l, alpha): (&mut [f32], &mut [f32], &mut [f32]),
) {
    assert!(lds >= BK && m.len() >= n && l.len() >= n && alpha.len() >= n && mx.len() >= n * 8);
    assert!(n == 0 || s.len() >= (n - 1) * lds + BK);
    // SAFETY: bounds asserted above; features guaranteed by the caller.
    unsafe {
        online_rows_block_inner::<true>(s.as_mut_ptr(), lds, n, |_| (0, BK), mx.as_ptr(), (m, l, alpha))
    }
}

/// Rows per [`gemm`] register tile.
pub(crate) const GEMM_ROWS: usize = MR;

/// One contraction chunk `k0..k1` of `y = x · Wᵀ (+ b)`, as [`super::avx512::gemm`]
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
    let npanels = super::tiles::assert_gemm_operands(x, ldx, rows, (k0, k1, e), wp, out, ldy, b);
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
        let mut a: [__m256; 2 * MR] = std::array::from_fn(|i| acc[i / 2][i % 2]);
        // SAFETY: the caller guarantees `R` rows of `x` (stride `ldx`) with `kc`
        // elements each and a `[kc][NR]` W panel.
        unsafe { rows_loop_6x16(&mut a, x, ldx * 4, w, kc) };
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

/// `dst[x] = f16(src[x] · scale)` (the product in f32), rounding to nearest even, as
/// `half::f16::from_f32` and `avx512::store_f16` do (F16C, 8 elements per step).
///
/// # Safety
/// AVX2 and F16C must be available, and `dst` valid for `src.len()` writes.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn store_f16(dst: *mut half::f16, src: &[f32], scale: f32) {
    let n = src.len();
    let sv = _mm256_set1_ps(scale);
    let mut x = 0;
    while x + 8 <= n {
        let v = _mm256_mul_ps(_mm256_loadu_ps(src.as_ptr().add(x)), sv);
        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
        _mm_storeu_si128(dst.add(x) as *mut __m128i, h);
        x += 8;
    }
    for (i, &v) in src.iter().enumerate().skip(x) {
        dst.add(i).write(half::f16::from_f32(v * scale));
    }
}

/// The eight f32 lanes of `v` as bf16 bit patterns in the low 16 bits of each 32-bit
/// lane, rounded as `half::bf16::from_f32`: to nearest even (add `0x7fff` plus the
/// lowest kept bit, then shift), and a NaN keeps its top bits with the quiet bit set.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn bf16_bits(v: __m256) -> __m256i {
    let b = _mm256_castps_si256(v);
    let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(1));
    let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(
        b,
        _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)),
    ));
    let nan = _mm256_or_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(0x40));
    let is_nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
    _mm256_blendv_epi8(rounded, nan, is_nan)
}

/// `dst[x] = bf16(src[x] · scale)` (the product in f32), rounded as
/// `half::bf16::from_f32` (see [`bf16_bits`]), 16 elements per step.
///
/// # Safety
/// AVX2 must be available, and `dst` valid for `src.len()` writes.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn store_bf16(dst: *mut half::bf16, src: &[f32], scale: f32) {
    let n = src.len();
    let sv = _mm256_set1_ps(scale);
    let mut x = 0;
    while x + 16 <= n {
        let a = bf16_bits(_mm256_mul_ps(_mm256_loadu_ps(src.as_ptr().add(x)), sv));
        let b = bf16_bits(_mm256_mul_ps(_mm256_loadu_ps(src.as_ptr().add(x + 8)), sv));
        // Each lane fits in 16 bits, so the saturating pack is exact; it interleaves the
        // 128-bit halves (a0 b0 a1 b1), which the permute puts back in order.
        let h = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(a, b));
        _mm256_storeu_si256(dst.add(x) as *mut __m256i, h);
        x += 16;
    }
    for (i, &v) in src.iter().enumerate().skip(x) {
        dst.add(i).write(half::bf16::from_f32(v * scale));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Xorshift values spread over `[-half, half]`, from the nonzero seed `x`.
    fn uniform(mut x: u32, half: f32) -> impl FnMut() -> f32 {
        move || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as f32 / u32::MAX as f32 * (2.0 * half) - half
        }
    }

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

    /// The AVX2 half-precision stores give exactly `half`'s conversions of the f32
    /// products, for every length remainder of their 8- and 16-element steps: ties that
    /// round to even both ways, values that round up into the next binade or to
    /// infinity, subnormal results, ±0, ±inf and NaNs (a signalling one, and payloads whose rounding
    /// would carry out of the exponent).
    #[test]
    fn half_stores_round_as_half() {
        if !super::super::Isa::Avx2Fma.is_supported() {
            return;
        }
        let mut rnd = uniform(4242, 3.0);
        let mut src: Vec<f32> = vec![
            f32::from_bits(0x3f80_8000), // bf16 tie, even below: rounds down
            f32::from_bits(0x3f81_8000), // bf16 tie, odd below: rounds up
            f32::from_bits(0x3f80_8001), // just above a bf16 tie
            f32::from_bits(0x3fff_ffff), // rounds up into the next binade
            f32::from_bits(0x7f7f_ffff), // f32::MAX: bf16 rounds to inf
            1.0 + 2f32.powi(-11),        // f16 tie, even below
            1.0 + 3.0 * 2f32.powi(-11),  // f16 tie, odd below
            65520.0,                     // f16 rounds to inf
            1e5,                         // beyond f16
            3e-6,                        // f16 subnormal
            1e-9,                        // below f16's smallest subnormal
            f32::from_bits(1),           // f32 subnormal
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::from_bits(0x7f80_0001), // signalling NaN
            f32::from_bits(0xffc1_2345), // negative quiet NaN with payload
            f32::from_bits(0x7fff_ffff), // NaN whose rounding would carry into the sign
        ];
        src.extend((0..45).map(|_| rnd()));
        for scale in [1.0f32, 0.37, 3.0e-3] {
            for n in 0..src.len() {
                let s = &src[..n];
                let mut h = vec![half::f16::ZERO; n];
                let mut b = vec![half::bf16::ZERO; n];
                // SAFETY: features checked above; both buffers hold `n` elements.
                unsafe {
                    store_f16(h.as_mut_ptr(), s, scale);
                    store_bf16(b.as_mut_ptr(), s, scale);
                }
                for (i, &x) in s.iter().enumerate() {
                    let want_h = half::f16::from_f32(x * scale);
                    let want_b = half::bf16::from_f32(x * scale);
                    assert_eq!(
                        h[i].to_bits(),
                        want_h.to_bits(),
                        "f16 of {x:e}·{scale} (n = {n}, i = {i})"
                    );
                    assert_eq!(
                        b[i].to_bits(),
                        want_b.to_bits(),
                        "bf16 of {x:e}·{scale} (n = {n}, i = {i})"
                    );
                }
            }
        }
    }

    /// The assembly tile loop ([`rows_loop_6x16`]) in both block products gives exactly
    /// the scalar fused multiply-adds in the same order: `qk` on row-major Q for
    /// contraction lengths with every remainder of the four-step unroll, and `pv` with
    /// packed V (the assembly loop) and with a wider V row stride (the intrinsics loop),
    /// with the rescale factor applied to the output first.
    #[test]
    fn tile_loops_match_scalar_fmas() {
        if !super::super::Isa::Avx2Fma.is_supported() {
            return;
        }
        let mut rnd = uniform(777, 1.0);
        for rows in [6, 18] {
            for e in [1, 2, 3, 4, 5, 7, 8, 9, 33, 64, 128] {
                let npanels = 1 + e % 4;
                let q: Vec<f32> = (0..rows * e).map(|_| rnd()).collect();
                let kp: Vec<f32> = (0..npanels * e * NR).map(|_| rnd()).collect();
                let mut s = vec![f32::NAN; rows * BK];
                // SAFETY: AVX2 and FMA detected above; shapes as the kernel requires.
                unsafe { qk(&q, rows, e, &kp, npanels, &mut s, BK) };
                for r in 0..rows {
                    for j in 0..npanels * NR {
                        let (pn, c) = (j / NR, j % NR);
                        let want =
                            (0..e).fold(0f32, |a, x| q[r * e + x].mul_add(kp[(pn * e + x) * NR + c], a));
                        assert_eq!(s[r * BK + j], want, "qk rows {rows} e {e} row {r} key {j}");
                    }
                }
            }
            for nk in [1, 2, 3, 4, 5, 6, 31, 64] {
                for ldv in [NR, 24] {
                    let nvp = 2;
                    let vps = BK * ldv;
                    let p: Vec<f32> = (0..rows * BK).map(|_| rnd()).collect();
                    let vp: Vec<f32> = (0..nvp * vps).map(|_| rnd()).collect();
                    let alpha: Vec<f32> = (0..rows).map(|_| rnd()).collect();
                    let ldo = nvp * NR + 8;
                    let o0: Vec<f32> = (0..rows * ldo).map(|_| rnd()).collect();
                    let mut o = o0.clone();
                    // SAFETY: AVX2 and FMA detected above; shapes as the kernel requires.
                    unsafe { pv(&p, rows, nk, &vp, vps, ldv, nvp, &mut o, ldo, &alpha) };
                    for r in 0..rows {
                        for c in 0..nvp * NR {
                            let (n, cc) = (c / NR, c % NR);
                            let a0 = alpha[r] * o0[r * ldo + c];
                            let want =
                                (0..nk).fold(a0, |a, j| p[r * BK + j].mul_add(vp[n * vps + j * ldv + cc], a));
                            assert_eq!(
                                o[r * ldo + c],
                                want,
                                "pv rows {rows} nk {nk} ldv {ldv} row {r} col {c}"
                            );
                        }
                        assert_eq!(
                            o[r * ldo + nvp * NR..(r + 1) * ldo],
                            o0[r * ldo + nvp * NR..(r + 1) * ldo]
                        );
                    }
                }
            }
        }
    }

    /// `qk_max`'s partial maxima give each row's maximum score, for every row of every
    /// strip, with 1 to 4 panels, and its scores equal `qk`'s.
    #[test]
    fn qk_max_keeps_each_rows_maximum() {
        if !super::super::Isa::Avx2Fma.is_supported() {
            return;
        }
        let mut rnd = uniform(12345, 4.0);
        for (rows, e, npanels) in [(6, 1, 1), (12, 7, 2), (18, 64, 4), (144, 128, 4), (30, 33, 3)] {
            let q: Vec<f32> = (0..rows * e).map(|_| rnd()).collect();
            let kp: Vec<f32> = (0..npanels * e * NR).map(|_| rnd()).collect();
            let lds = BK;
            let (mut s0, mut s1) = (vec![0f32; rows * lds], vec![0f32; rows * lds]);
            let mut mx = vec![f32::NAN; rows * 8];
            // SAFETY: AVX2 and FMA detected above; shapes as the kernels require.
            unsafe {
                qk(&q, rows, e, &kp, npanels, &mut s0, lds);
                qk_max(&q, rows, e, &kp, npanels, &mut s1, lds, &mut mx);
            }
            assert_eq!(s0, s1, "rows {rows} e {e} panels {npanels}");
            for r in 0..rows {
                let want = s0[r * lds..r * lds + npanels * NR]
                    .iter()
                    .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let got = mx[r * 8..r * 8 + 8]
                    .iter()
                    .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                assert_eq!(got, want, "row {r} of rows {rows} e {e} panels {npanels}");
            }
        }
    }
}
