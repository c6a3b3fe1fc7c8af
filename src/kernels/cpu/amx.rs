//! Intel AMX (`TDPBF16PS`) block products for bf16 and f16 inputs.
//!
//! Both block products run on the tile unit with f32 accumulation; the softmax stays in
//! f32 on AVX-512. Inputs are split into bf16 *components* whose sum is the input:
//! * bf16 q, k, v are one component each (exact);
//! * f16 q, k, v are `hi + lo` (`hi = bf16(x)`, `lo = bf16(x − hi)`), which is exact,
//!   since f16 has 11 significant bits and bf16 8;
//! * the f32 probabilities P are one bf16 for bf16 inputs (8 significant bits, as
//!   PyTorch's CPU kernel rounds them; the output is bf16 anyway) and `hi + lo` for f16
//!   inputs (16 significant bits, so f16 outputs lose nothing to it).
//!
//! A product of two components is exact in f32. `Q·Kᵀ` is exact for bf16 (1 product);
//! for f16 it sums `hi·hi + hi·lo + lo·hi` and drops only `lo·lo`, at most 2⁻¹⁸ of
//! `|q|·|k|` per term. `P·V` is 1 product for bf16 (error at most 2⁻⁹ · max|v|) and
//! `hi·hi + hi·lo + lo·hi` for f16. `tests/kernel_cpu.rs` checks that f16 results are
//! within one output ulp of f32 math, and bf16 results within that plus 2⁻⁹ · max|v|.
//!
//! Layouts (`u16` bf16 bits; a tile is 16 rows × 64 bytes = 512 elements):
//! * A operands (Q, P): row-major, per component, rows padded to 16 and the contraction
//!   to 32 with zeros; a tile is 16 rows × 32 elements at the row stride.
//! * B operands (K, V), packed per block of [`BK`] keys and per component, as `VNNI`
//!   tiles: row `r` of a tile holds, for each of its 16 output columns, the contraction
//!   pair `(2r, 2r + 1)`. K: `[panel of 16 keys][E/32 tiles]`; V: `[panel of 16 value
//!   columns][BK/32 tiles]`.
//!
//! Everything here needs AMX-BF16 and AVX-512 (F, BF16) and, on Linux, the kernel's
//! permission to use the tile data ([`available`] asks for it once per process).

use super::avx512::{store_components, tail_mask_full};
use super::pack::{Data, View, BK, NR};
use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

/// Rows of a tile.
pub(crate) const TM: usize = 16;
/// bf16 elements of a tile row (64 bytes).
pub(crate) const TK: usize = 32;
/// Elements of one tile.
pub(crate) const TILE: usize = TM * TK;

/// Component pairs `(a, b)` summed by a block product.
pub(crate) type Terms = &'static [(usize, usize)];

/// What runs the bf16 pair products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Unit {
    /// The AMX tile unit (`TDPBF16PS`).
    Tiles,
    /// AVX-512 register tiles (`VDPBF16PS`, `super::dpbf16`), on the same operands.
    Avx512Bf16,
}

/// How an input dtype is split into bf16 components, and what multiplies them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    /// The unit that runs the block products.
    pub unit: Unit,
    /// Components of q, k and v (1 for bf16, 2 for f16).
    pub comps: usize,
    /// Components of the probabilities P (1 for bf16, 2 for f16).
    pub p_comps: usize,
    /// `(q, k)` component pairs of `Q·Kᵀ`.
    pub qk: Terms,
    /// `(p, v)` component pairs of `P·V`.
    pub pv: Terms,
}

/// bf16 inputs: exact single components.
pub(crate) const PLAN_BF16: Plan = Plan {
    unit: Unit::Tiles,
    comps: 1,
    p_comps: 1,
    qk: &[(0, 0)],
    pv: &[(0, 0)],
};
/// f16 inputs: `hi + lo` components.
pub(crate) const PLAN_F16: Plan = Plan {
    unit: Unit::Tiles,
    comps: 2,
    p_comps: 2,
    qk: &[(0, 0), (0, 1), (1, 0)],
    pv: &[(0, 0), (0, 1), (1, 0)],
};
/// bf16 inputs on AVX512-BF16 register tiles (no AMX).
pub(crate) const PLAN_BF16_AVX512: Plan = Plan {
    unit: Unit::Avx512Bf16,
    ..PLAN_BF16
};

impl Plan {
    /// Prepares this thread for the block products (loads the tile configuration).
    ///
    /// # Safety
    /// The plan's unit must be available: [`available`] for `Tiles`,
    /// `dpbf16::available` for `Avx512Bf16`.
    pub(crate) unsafe fn begin(&self) {
        if self.unit == Unit::Tiles {
            configure();
        }
    }

    /// Ends the block products of [`Plan::begin`] (releases the tile state).
    ///
    /// # Safety
    /// As for [`Plan::begin`].
    pub(crate) unsafe fn end(&self) {
        if self.unit == Unit::Tiles {
            release();
        }
    }

    /// [`qk`] on the plan's unit, with its operands.
    ///
    /// # Safety
    /// As for [`qk`], after [`Plan::begin`] on this thread.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn qk(
        &self,
        qa: *const u16,
        qcs: usize,
        tiles: (usize, usize),
        e: usize,
        kb: *const u16,
        kcs: usize,
        s: *mut f32,
        lds: usize,
    ) {
        match self.unit {
            Unit::Tiles => qk(qa, qcs, tiles, e, kb, kcs, self.qk, s, lds),
            Unit::Avx512Bf16 => super::dpbf16::qk(qa, qcs, tiles, e, kb, kcs, self.qk, s, lds),
        }
    }

    /// [`pv`] on the plan's unit, with its operands.
    ///
    /// # Safety
    /// As for [`pv`], after [`Plan::begin`] on this thread.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn pv(
        &self,
        pa: *const u16,
        pcs: usize,
        ldp: usize,
        rtiles: usize,
        vbs: &[*const u16],
        vcs: usize,
        nvp: usize,
        o: *mut f32,
        ldo: usize,
    ) {
        match self.unit {
            Unit::Tiles => pv(pa, pcs, ldp, rtiles, vbs, vcs, nvp, self.pv, o, ldo),
            Unit::Avx512Bf16 => super::dpbf16::pv(pa, pcs, ldp, rtiles, vbs, vcs, nvp, self.pv, o, ldo),
        }
    }
}

/// Whether this process can run the AMX kernel: the CPU reports AMX-TILE, AMX-BF16,
/// AVX-512F and AVX512-BF16, and (Linux) the kernel granted the tile-data permission.
pub(crate) fn available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        if !(is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512dq")
            && is_x86_feature_detected!("avx512bf16"))
        {
            return false;
        }
        // CPUID.(EAX=7, ECX=0):EDX bit 22 = AMX-BF16, bit 24 = AMX-TILE.
        // CPUID leaf 7 exists on every CPU with AVX-512.
        let edx = __cpuid_count(7, 0).edx;
        if edx & (1 << 22) == 0 || edx & (1 << 24) == 0 {
            return false;
        }
        request_permission()
    })
}

/// `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`: Linux only lets a process use
/// the tile data registers after asking. Returns whether it was granted.
#[cfg(target_os = "linux")]
fn request_permission() -> bool {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: a plain system call with two integer arguments; it touches no memory of ours.
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret == 0
}

#[cfg(not(target_os = "linux"))]
fn request_permission() -> bool {
    false
}

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

/// Loads the tile configuration: palette 1, all eight tiles 16 rows × 64 bytes.
///
/// # Safety
/// [`available`] must have returned true.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn configure() {
    #[repr(C, align(64))]
    struct TileCfg([u8; 64]);
    let mut cfg = TileCfg([0; 64]);
    cfg.0[0] = 1;
    for t in 0..8 {
        cfg.0[16 + 2 * t] = 64;
        cfg.0[48 + t] = TM as u8;
    }
    asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
}

/// Releases the tile state (so context switches stop saving it).
///
/// # Safety
/// [`available`] must have returned true.
pub(crate) unsafe fn release() {
    asm!("tilerelease", options(nostack, nomem));
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
/// AVX-512F and AVX512-BF16 must be available ([`available`] or `dpbf16::available`
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
/// AVX-512F and AVX512-BF16 must be available ([`available`] or `dpbf16::available`
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

macro_rules! tzero {
    ($t:literal) => {
        asm!(concat!("tilezero tmm", $t), options(nostack, nomem))
    };
}
macro_rules! tload {
    ($t:literal, $p:expr, $stride:expr) => {
        asm!(concat!("tileloadd tmm", $t, ", [{p} + {s}*1]"), p = in(reg) $p, s = in(reg) $stride, options(nostack, readonly))
    };
}
macro_rules! tstore {
    ($t:literal, $p:expr, $stride:expr) => {
        asm!(concat!("tilestored [{p} + {s}*1], tmm", $t), p = in(reg) $p, s = in(reg) $stride, options(nostack))
    };
}
macro_rules! tdp {
    ($c:literal, $a:literal, $b:literal) => {
        asm!(
            concat!("tdpbf16ps tmm", $c, ", tmm", $a, ", tmm", $b),
            options(nostack, nomem)
        )
    };
}

/// `S = Q·Kᵀ` for one block: `rtiles` 16-row tiles of Q (`qa`, per-component stride
/// `qcs`, row stride `ldq ≥ e_pad(e)` elements) against the [`BK`] keys of a packed K
/// block (`kb`, per-component stride `kcs`); scores go to `s` (f32, row stride `lds`
/// floats).
///
/// # Safety
/// [`configure`] must have run on this thread; the buffers must hold what the layouts
/// above describe.
#[allow(clippy::too_many_arguments)]
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
    let ep = e_pad(e);
    let kt = ep / TK;
    let (sa, sb, ss) = (ldq * 2, TK * 2, lds * 4);
    let mut rt = 0;
    while rt < rtiles {
        let two = rt + 1 < rtiles;
        for panel in (0..BK / NR).step_by(2) {
            tzero!(0);
            tzero!(1);
            tzero!(2);
            tzero!(3);
            for &(ca, cb) in terms {
                for t in 0..kt {
                    let a0 = qa.add(ca * qcs + rt * TM * ldq + t * TK);
                    let b0 = kb.add(cb * kcs + (panel * kt + t) * TILE);
                    let b1 = kb.add(cb * kcs + ((panel + 1) * kt + t) * TILE);
                    tload!(4, a0, sa);
                    tload!(6, b0, sb);
                    tload!(7, b1, sb);
                    tdp!(0, 4, 6);
                    tdp!(1, 4, 7);
                    if two {
                        tload!(5, a0.add(TM * ldq), sa);
                        tdp!(2, 5, 6);
                        tdp!(3, 5, 7);
                    }
                }
            }
            let s0 = s.add(rt * TM * lds + panel * NR);
            tstore!(0, s0, ss);
            tstore!(1, s0.add(NR), ss);
            if two {
                tstore!(2, s0.add(TM * lds), ss);
                tstore!(3, s0.add(TM * lds + NR), ss);
            }
        }
        rt += if two { 2 } else { 1 };
    }
}

/// `O += P·V` for a super-block of `vbs.len()` key blocks: `rtiles` 16-row tiles of P
/// (`pa`, per-component stride `pcs`, row stride `ldp`, key block `i` at column
/// `i·BK`) against the packed V blocks `vbs` (per-component stride `vcs`, `nvp` column
/// panels each); `o` is f32 with row stride `ldo` floats (already rescaled).
///
/// # Safety
/// As for [`qk`].
#[allow(clippy::too_many_arguments)]
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
    let (sa, sb, so) = (ldp * 2, TK * 2, ldo * 4);
    let nt = BK / TK;
    let mut rt = 0;
    while rt < rtiles {
        let two_r = rt + 1 < rtiles;
        let mut cp = 0;
        while cp < nvp {
            let two_c = cp + 1 < nvp;
            let o0 = o.add(rt * TM * ldo + cp * NR);
            tload!(0, o0, so);
            if two_c {
                tload!(1, o0.add(NR), so);
            }
            if two_r {
                tload!(2, o0.add(TM * ldo), so);
            }
            if two_r && two_c {
                tload!(3, o0.add(TM * ldo + NR), so);
            }
            for &(ca, cb) in terms {
                for (bi, &vb) in vbs.iter().enumerate() {
                    for t in 0..nt {
                        let a0 = pa.add(ca * pcs + rt * TM * ldp + bi * BK + t * TK);
                        let b0 = vb.add(cb * vcs + (cp * nt + t) * TILE);
                        tload!(4, a0, sa);
                        tload!(6, b0, sb);
                        tdp!(0, 4, 6);
                        if two_c {
                            tload!(7, b0.add(nt * TILE), sb);
                            tdp!(1, 4, 7);
                        }
                        if two_r {
                            tload!(5, a0.add(TM * ldp), sa);
                            tdp!(2, 5, 6);
                            if two_c {
                                tdp!(3, 5, 7);
                            }
                        }
                    }
                }
            }
            tstore!(0, o0, so);
            if two_c {
                tstore!(1, o0.add(NR), so);
            }
            if two_r {
                tstore!(2, o0.add(TM * ldo), so);
            }
            if two_r && two_c {
                tstore!(3, o0.add(TM * ldo + NR), so);
            }
            cp += if two_c { 2 } else { 1 };
        }
        rt += if two_r { 2 } else { 1 };
    }
}
