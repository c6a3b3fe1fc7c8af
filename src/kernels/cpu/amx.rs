//! Intel AMX (`TDPBF16PS`) block products for bf16 and f16 inputs.
//!
//! Both block products run on the tile unit with f32 accumulation; the softmax stays in
//! f32 on AVX-512. The operands are bf16 components in the VNNI layout of `vnni`, which
//! also says how f16 and the probabilities are split. A product of two components is
//! exact in f32. `Q·Kᵀ` is exact for bf16 (1 product);
//! for f16 it sums `hi·hi + hi·lo + lo·hi` and drops only `lo·lo`, at most 2⁻¹⁸ of
//! `|q|·|k|` per term. `P·V` is 1 product for bf16 (error at most 2⁻⁹ · max|v|) and
//! `hi·hi + hi·lo + lo·hi` for f16. `tests/kernel_cpu.rs` checks that f16 results are
//! within one output ulp of f32 math, and bf16 results within that plus 2⁻⁹ · max|v|.
//!
//! Everything here needs AMX-BF16 and AVX-512 (F, BF16) and, on Linux, the kernel's
//! permission to use the tile data ([`available`] asks for it once per process).

use super::tiles::{BK, NR};
use super::vnni::{e_pad, Terms, TILE, TK, TM};
use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

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

    /// [`qk`] on the plan's unit, with its operands. The tiles compute the scores of the
    /// block's first `panels` 16-key panels (1 to `BK / NR`); the AVX512-BF16 products
    /// compute all of them.
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
        (kb, panels): (*const u16, usize),
        kcs: usize,
        s: *mut f32,
        lds: usize,
    ) {
        match self.unit {
            Unit::Tiles => qk(qa, qcs, tiles, e, (kb, panels), kcs, self.qk, s, lds),
            Unit::Avx512Bf16 => super::dpbf16::qk(qa, qcs, tiles, e, kb, kcs, self.qk, s, lds),
        }
    }

    /// [`pv`] on the plan's unit, with its operands. The tiles take the first `last_nt`
    /// 32-key depth tiles of the last block (1 to `BK / TK`); the AVX512-BF16 products
    /// take all of its keys.
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
        (vbs, last_nt): (&[*const u16], usize),
        vcs: usize,
        nvp: usize,
        o: *mut f32,
        ldo: usize,
    ) {
        match self.unit {
            Unit::Tiles => pv(pa, pcs, ldp, rtiles, (vbs, last_nt), vcs, nvp, self.pv, o, ldo),
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
/// `qcs`, row stride `ldq ≥ e_pad(e)` elements) against the first `panels` 16-key panels
/// (1 to `BK / NR`) of a packed K block (`kb`, per-component stride `kcs`); scores go to
/// `s` (f32, row stride `lds` floats), `16·panels` per row.
///
/// # Safety
/// [`configure`] must have run on this thread; the buffers must hold what the layouts
/// of `vnni` describe.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn qk(
    qa: *const u16,
    qcs: usize,
    (rtiles, ldq): (usize, usize),
    e: usize,
    (kb, panels): (*const u16, usize),
    kcs: usize,
    terms: Terms,
    s: *mut f32,
    lds: usize,
) {
    debug_assert!((1..=BK / NR).contains(&panels));
    let ep = e_pad(e);
    let kt = ep / TK;
    let (sa, sb, ss) = (ldq * 2, TK * 2, lds * 4);
    let mut rt = 0;
    while rt < rtiles {
        let two = rt + 1 < rtiles;
        for panel in (0..panels).step_by(2) {
            let two_p = panel + 1 < panels;
            tzero!(0);
            tzero!(1);
            tzero!(2);
            tzero!(3);
            for &(ca, cb) in terms {
                for t in 0..kt {
                    let a0 = qa.add(ca * qcs + rt * TM * ldq + t * TK);
                    let b0 = kb.add(cb * kcs + (panel * kt + t) * TILE);
                    tload!(4, a0, sa);
                    tload!(6, b0, sb);
                    if two_p {
                        tload!(7, b0.add(kt * TILE), sb);
                        tdp!(0, 4, 6);
                        tdp!(1, 4, 7);
                        if two {
                            tload!(5, a0.add(TM * ldq), sa);
                            tdp!(2, 5, 6);
                            tdp!(3, 5, 7);
                        }
                    } else {
                        tdp!(0, 4, 6);
                        if two {
                            tload!(5, a0.add(TM * ldq), sa);
                            tdp!(2, 5, 6);
                        }
                    }
                }
            }
            let s0 = s.add(rt * TM * lds + panel * NR);
            tstore!(0, s0, ss);
            if two_p {
                tstore!(1, s0.add(NR), ss);
            }
            if two {
                tstore!(2, s0.add(TM * lds), ss);
                if two_p {
                    tstore!(3, s0.add(TM * lds + NR), ss);
                }
            }
        }
        rt += if two { 2 } else { 1 };
    }
}

/// `O += P·V` for a super-block of `vbs.len()` key blocks: `rtiles` 16-row tiles of P
/// (`pa`, per-component stride `pcs`, row stride `ldp`, key block `i` at column
/// `i·BK`) against the packed V blocks `vbs` (per-component stride `vcs`, `nvp` column
/// panels each), of which the last contributes its first `last_nt` 32-key depth tiles
/// (1 to `BK / TK`); `o` is f32 with row stride `ldo` floats (already rescaled).
///
/// # Safety
/// As for [`qk`].
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn pv(
    pa: *const u16,
    pcs: usize,
    ldp: usize,
    rtiles: usize,
    (vbs, last_nt): (&[*const u16], usize),
    vcs: usize,
    nvp: usize,
    terms: Terms,
    o: *mut f32,
    ldo: usize,
) {
    let (sa, sb, so) = (ldp * 2, TK * 2, ldo * 4);
    let nt = BK / TK;
    debug_assert!((1..=nt).contains(&last_nt));
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
                    let nt_b = if bi + 1 == vbs.len() { last_nt } else { nt };
                    for t in 0..nt_b {
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

/// One output block of a projection: `C = init + Σ X_c · W_c'ᵀ` over the component
/// pairs `(c, c')` (`cx` components of x, `cw` of W) with `c' = 0` or `c < cx_lo`, for
/// `rtiles` (1–2) 16-row tiles of x by `panels` (1–2) 16-output panels of a packed W
/// block. With `cx_lo = cx` every pair is multiplied; with `cx_lo = 1` the later
/// components of W (an f16 weight's `lo`) meet only x's first (`hi`).
///
/// - x (`xa`): row-major bf16 components at stride `xcs`, rows `ldx` apart (≥ `32·kt`).
/// - W (`wb`): the VNNI tiles of `vnni::pack_k`, panel `p`, contraction tile `t` at
///   `(p·kt + t)·TILE`, components at stride `wcs`.
/// - `init`: 16 floats per panel, added to every row (the bias; read as tiles of
///   stride 0), or zero when null.
/// - C (f32) is stored at `y`, rows `ldy` floats apart, panel `p` at `y + 16·p`.
/// - `between` runs after the products are issued and before C is stored: the tile
///   unit works through them meanwhile, so the core can do other work there (the
///   projection rounds the previous block's rows).
///
/// Each contraction tile loads its W tiles once per W component and multiplies them by
/// the x components above.
///
/// # Safety
/// [`configure`] must have run on this thread; the buffers must hold what is described.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_tiles(
    (xa, xcs, ldx, cx, cx_lo): (*const u16, usize, usize, usize, usize),
    (wb, wcs, cw): (*const u16, usize, usize),
    kt: usize,
    (rtiles, panels): (usize, usize),
    init: *const f32,
    (y, ldy): (*mut f32, usize),
    between: &mut dyn FnMut(),
) {
    debug_assert!((1..=2).contains(&rtiles) && (1..=2).contains(&panels));
    debug_assert!((1..=cx).contains(&cx_lo));
    let (two_r, two_p) = (rtiles == 2, panels == 2);
    let (sa, sb, sy) = (ldx * 2, TK * 2, ldy * 4);
    if init.is_null() {
        tzero!(0);
        tzero!(1);
        tzero!(2);
        tzero!(3);
    } else {
        tload!(0, init, 0usize);
        tload!(2, init, 0usize);
        if two_p {
            tload!(1, init.add(NR), 0usize);
            tload!(3, init.add(NR), 0usize);
        }
    }
    for t in 0..kt {
        for cb in 0..cw {
            let b0 = wb.add(cb * wcs + t * TILE);
            tload!(6, b0, sb);
            if two_p {
                tload!(7, b0.add(kt * TILE), sb);
            }
            for ca in 0..if cb == 0 { cx } else { cx_lo } {
                let a0 = xa.add(ca * xcs + t * TK);
                tload!(4, a0, sa);
                tdp!(0, 4, 6);
                if two_p {
                    tdp!(1, 4, 7);
                }
                if two_r {
                    tload!(5, a0.add(TM * ldx), sa);
                    tdp!(2, 5, 6);
                    if two_p {
                        tdp!(3, 5, 7);
                    }
                }
            }
        }
    }
    between();
    tstore!(0, y, sy);
    if two_p {
        tstore!(1, y.add(NR), sy);
    }
    if two_r {
        tstore!(2, y.add(TM * ldy), sy);
        if two_p {
            tstore!(3, y.add(TM * ldy + NR), sy);
        }
    }
}
