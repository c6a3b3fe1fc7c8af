//! The two block products of the AVX-512 prefill, `Q·Kᵀ` and `P·V`, on 6×64 register
//! tiles (contraction loops in assembly) and 12×32 and narrower tiles for the rest.

use super::softmax::{softmax_regs, softmax_regs_shifted};
use super::*;

/// See [`super::super::portable::qk`], except that Q is row-major (row stride `e`), not
/// strip-packed: the 6-row tiles broadcast from six row pointers, so the driver skips
/// the strip pack on this ISA. `rows` must be a multiple of [`MR`].
///
/// # Safety
/// AVX-512F must be available.
pub(in crate::kernels::cpu) unsafe fn qk(
    q: &[f32],
    rows: usize,
    e: usize,
    kp: &[f32],
    npanels: usize,
    s: &mut [f32],
    lds: usize,
) {
    assert_qk_operands(q, (rows, e), kp, npanels, s, lds);
    // SAFETY: bounds asserted above; features guaranteed by the caller.
    unsafe { qk_impl(q.as_ptr(), rows, e, kp.as_ptr(), npanels, s.as_mut_ptr(), lds) }
}

/// Scores and softmax of one full, wholly visible 64-key block in one pass (no explicit
/// mask): each 6-row strip's 6×64 score tile ([`rows_loop_6x4`], Q row-major with row
/// stride `e`) goes through [`softmax_regs`] while still in registers, and only the
/// probabilities are stored (`s`, row stride `lds`). Rows `live..rows` are padding:
/// their scores (0) are stored as they are. `m`, the lane-wise row sums `l16` (16 per
/// row) and `alpha` are updated for the first `live` rows, as by [`online_rows_lazy`].
///
/// A live row whose running maximum `m` is already finite starts its four accumulators
/// at `−m` instead of 0, so that its scores come out as `s − m`, which the softmax
/// needs ([`softmax_regs_shifted`]): one subtraction fewer per 16 scores (in-process
/// probe, new/old: `long8k_causal`'s shape 0.992, `enc512`'s 0.995, `gpt1k_causal`'s
/// 0.993, `enc1k_d128`'s 0.995, `gpt2k_causal_d128`'s 0.999; see the kernel notes).
/// Each score then rounds in another order, as a chain of FMAs from `−m`.
///
/// # Safety
/// AVX-512F and AVX512DQ must be available.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512dq")]
pub(in crate::kernels::cpu) unsafe fn qk_softmax(
    q: &[f32],
    (rows, live): (usize, usize),
    e: usize,
    kp: &[f32],
    s: &mut [f32],
    lds: usize,
    (m, l16, alpha): (&mut [f32], &mut [f32], &mut [f32]),
) {
    assert!(live <= rows && BK == 4 * NR);
    assert_qk_operands(q, (rows, e), kp, BK / NR, s, lds);
    assert!(m.len() >= live && l16.len() >= 16 * live && alpha.len() >= live);
    let (qp, kpp, sp) = (q.as_ptr(), kp.as_ptr(), s.as_mut_ptr());
    for st in 0..rows / MR {
        // Each live row with a finite running maximum starts at `−m` (see above).
        let mut init = [[_mm512_setzero_ps(); 4]; 6];
        let mut shifted = [false; 6];
        for (i, (acc, sh)) in init.iter_mut().zip(&mut shifted).enumerate() {
            let r = st * MR + i;
            if r < live && m[r] != f32::NEG_INFINITY {
                *acc = [_mm512_set1_ps(-m[r]); 4];
                *sh = true;
            }
        }
        // SAFETY: the strip's Q rows and the block's four K panels are inside `q` and
        // `kp` (asserted above). (By value: see `rows_loop_6x4`.)
        let acc = unsafe { rows_loop_6x4(init, qp.add(st * MR * e), e * 4, kpp, e * NR * 4, e) };
        for (i, row) in acc.iter().enumerate() {
            let r = st * MR + i;
            let p = if shifted[i] {
                // SAFETY: `l16` holds 16 floats per live row (asserted above).
                unsafe {
                    softmax_regs_shifted(*row, (&mut m[r], l16.as_mut_ptr().add(16 * r), &mut alpha[r]))
                }
            } else if r < live {
                // SAFETY: as above.
                unsafe { softmax_regs(*row, (&mut m[r], l16.as_mut_ptr().add(16 * r), &mut alpha[r])) }
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
    if S == 1 && P == 4 {
        let acc = rows_loop_6x4([[_mm512_setzero_ps(); 4]; 6], qs, kc * 4, kpp, panel_len * 4, kc);
        for (r, row) in acc.iter().enumerate() {
            for (pi, &v) in row.iter().enumerate() {
                _mm512_storeu_ps(sp.add(r * lds + pi * NR), v);
            }
        }
        return;
    }
    let mut acc = [[_mm512_setzero_ps(); P]; 12];
    qk_contract::<S, P>(&mut acc, qs, kc, (strip_len, panel_len), kpp);
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

/// The requests of one pass of a `tile_loop_6x4!` loop with `ask`, as assembly text:
/// eight lines from `{pf}` on into the L2 (`prefetcht1`), then `{pf}` past them. (The
/// argument only names the operand, so that the macro can repeat this where it is given.)
macro_rules! ask_pass {
    ($ask:ident) => {
        concat!(
            "prefetcht1 [{pf}]\n",
            "prefetcht1 [{pf} + 64]\n",
            "prefetcht1 [{pf} + 128]\n",
            "prefetcht1 [{pf} + 192]\n",
            "prefetcht1 [{pf} + 256]\n",
            "prefetcht1 [{pf} + 320]\n",
            "prefetcht1 [{pf} + 384]\n",
            "prefetcht1 [{pf} + 448]\n",
            "add {pf}, 512\n",
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
///
/// With a last `$(#[doc])* name asks ask`, it also defines the loop `name`, which takes
/// one more argument, `ask: *const u8`: each pass of four steps also asks for the eight
/// lines from that address on into the L2 (`ask_pass!`), and the address moves past
/// them; the single steps of the tail ask for nothing.
///
/// The accumulators go in and come back by value. Passed as `&mut` to an array, they
/// made the caller keep that array in memory, and since the assembly may read memory,
/// a score tile's zeros were written there by a call of `memset` before every strip
/// (1% of a `long8k_causal` profile; 1–2.5% of the time, see the kernel notes).
macro_rules! tile_loop_6x4 {
    (
        $(#[$doc:meta])* $name:ident, $sa:literal, $sa4:literal, [$d1:literal, $d2:literal, $d3:literal],
        $bs:ident => $bstep:expr, $steps:tt $(, $(#[$adoc:meta])* $askname:ident asks $ask:ident)?
    ) => {
        tile_loop_6x4!(@fn $(#[$doc])* $name, $sa, $sa4, [$d1, $d2, $d3], $bs => $bstep, $steps);
        $(
            tile_loop_6x4!(
                @fn $(#[$adoc])* $askname, $sa, $sa4, [$d1, $d2, $d3], $bs => $bstep, $steps, ask $ask
            );
        )?
    };
    (
        @fn $(#[$doc:meta])* $name:ident, $sa:literal, $sa4:literal, [$d1:literal, $d2:literal, $d3:literal],
        $bs:ident => $bstep:expr, [$s0:tt, $s1:tt, $s2:tt, $s3:tt] $(, ask $ask:ident)?
    ) => {
        $(#[$doc])*
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn $name(
            acc: [[__m512; 4]; 6],
            a: *const f32,
            la: usize,
            b: *const f32,
            sb: usize,
            n: usize,
            $($ask: *const u8,)?
        ) -> [[__m512; 4]; 6] {
            if n == 0 {
                return acc;
            }
            let [
                [mut c0, mut c1, mut c2, mut c3],
                [mut c4, mut c5, mut c6, mut c7],
                [mut c8, mut c9, mut c10, mut c11],
                [mut c12, mut c13, mut c14, mut c15],
                [mut c16, mut c17, mut c18, mut c19],
                [mut c20, mut c21, mut c22, mut c23],
            ] = acc;
            let $bs = sb;
            let bstep: usize = $bstep;
            // SAFETY: the caller guarantees the `a` rows and `b` operands of `n` steps.
            unsafe {
                std::arch::asm!(
                    "test {q}, {q}",
                    "jz 3f",
                    "2:",
                    $(ask_pass!($ask),)?
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
                    inout("zmm0") c0,
                    inout("zmm1") c1,
                    inout("zmm2") c2,
                    inout("zmm3") c3,
                    inout("zmm4") c4,
                    inout("zmm5") c5,
                    inout("zmm6") c6,
                    inout("zmm7") c7,
                    inout("zmm8") c8,
                    inout("zmm9") c9,
                    inout("zmm10") c10,
                    inout("zmm11") c11,
                    inout("zmm12") c12,
                    inout("zmm13") c13,
                    inout("zmm14") c14,
                    inout("zmm15") c15,
                    inout("zmm16") c16,
                    inout("zmm17") c17,
                    inout("zmm18") c18,
                    inout("zmm19") c19,
                    inout("zmm20") c20,
                    inout("zmm21") c21,
                    inout("zmm22") c22,
                    inout("zmm23") c23,
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
                    $(pf = inout(reg) $ask => _,)?
                    options(nostack, readonly),
                );
            }
            [
                [c0, c1, c2, c3],
                [c4, c5, c6, c7],
                [c8, c9, c10, c11],
                [c12, c13, c14, c15],
                [c16, c17, c18, c19],
                [c20, c21, c22, c23],
            ]
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
    ],
    /// [`rows_loop_6x4_in_rows`] that also asks for eight lines from `ask` on into the L2
    /// per pass of four keys, in order (`ask` past the last of them at the end): the
    /// requests of [`PvSrc::ask`].
    rows_loop_6x4_in_rows_ask asks ask
);

/// See [`super::super::portable::pv`] (P row-major with row stride [`BK`]); `rows` must be a
/// multiple of [`MR`]. When `rows == MR` and only the first `live` rows are real (decode),
/// only those are computed; the padding rows of `o` are left as they are.
///
/// # Safety
/// AVX-512F must be available.
#[allow(clippy::too_many_arguments)]
pub(in crate::kernels::cpu) unsafe fn pv(
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
    assert_pv_operands(p, (rows, BK), &[(vp, nk)], (vps, ldv, nvp), o, ldo, alpha);
    // SAFETY: bounds asserted above; features guaranteed by the caller.
    unsafe {
        let src = PvSrc {
            p: p.as_ptr(),
            ldp: BK,
            segs: [(vp.as_ptr() as *const u8, nk), (std::ptr::null(), 0)],
            vps,
            ldv,
            ahead: 0,
            ask: Lines::NONE,
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
pub(in crate::kernels::cpu) unsafe fn pv_pair(
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
    assert!(nk1 == 0 || nk0 == BK);
    assert_pv_operands(
        p,
        (rows, ldp),
        &[(v0, nk0), (v1, nk1)],
        (vps, ldv, nvp),
        o,
        ldo,
        alpha,
    );
    // SAFETY: bounds asserted above; features guaranteed by the caller.
    unsafe {
        let src = PvSrc {
            p: p.as_ptr(),
            ldp,
            segs: [(v0.as_ptr() as *const u8, nk0), (v1.as_ptr() as *const u8, nk1)],
            vps,
            ldv,
            ahead: 0,
            ask: Lines::NONE,
        };
        pv_impl::<2>(src, rows, rows, nvp, o.as_mut_ptr(), ldo, alpha.as_ptr())
    }
}

/// The operands of a `P·V` product: P (`p`, row stride `ldp`) against up to two runs of
/// keys (`segs`: V base and key count; run 1's probabilities follow run 0's in P), V
/// panel stride `vps` and row stride `ldv` (elements of kind `T`).
#[derive(Clone, Copy)]
pub(super) struct PvSrc {
    pub(super) p: *const f32,
    pub(super) ldp: usize,
    pub(super) segs: [(*const u8, usize); 2],
    pub(super) vps: usize,
    pub(super) ldv: usize,
    /// How many keys ahead the tiles ask for V rows (0: not at all; only decode asks,
    /// see [`pv_rows`]).
    pub(super) ahead: usize,
    /// Lines to ask for into the L2 while the tile runs: two per key of the first run, in
    /// order (`P·V` of decode asks for the next block's K rows, see
    /// `decode::pv_rows_impl`). A hint: the results do not depend on it.
    pub(super) ask: Lines,
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
pub(super) unsafe fn pv_tile<const R: usize, const N: usize, const T: u8, const G: usize>(
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
        let mut lines = src.ask.left;
        for &(vb, nk) in &src.segs[..G] {
            let v = (vb as *const f32).wrapping_add(v0);
            if ldv == NR {
                // Packed V: a panel row per key.
                *a6 = rows_loop_6x4(*a6, ps, ldp * 4, v, vps * 4, nk);
            } else {
                // V rows in place: four adjacent panels per key; the passes of the first
                // keys ask for the lines of `src.ask`, eight per four keys (the last pass
                // up to seven past them: hints, which cannot fault).
                let asked = (lines.div_ceil(8) * 4).min(nk);
                if asked > 0 {
                    *a6 = rows_loop_6x4_in_rows_ask(*a6, ps, ldp * 4, v, ldv * 4, asked, src.ask.at);
                    lines = 0;
                }
                let (ps, v) = (ps.add(asked), v.add(asked * ldv));
                *a6 = rows_loop_6x4_in_rows(*a6, ps, ldp * 4, v, ldv * 4, nk - asked);
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
    let mut ask = src.ask;
    for &(vb, nk) in &src.segs[..G] {
        for j in 0..nk {
            if ahead > 0 {
                prefetch_bytes(vb.wrapping_add((v0 + (j + ahead) * ldv) * size), N * NR * size);
            }
            // (Only decode asks; the other callers pass no lines.)
            if ask.left > 0 {
                ask.take(2).ask();
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
        ask = Lines::NONE;
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::avx2::uniform;
    use super::super::super::tiles::reference;
    use super::*;

    /// Whether AVX-512F and DQ are here; when not, says that `what` is not exercised.
    fn have_avx512(what: &str) -> bool {
        let here = is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512dq");
        if !here {
            eprintln!("note: no AVX-512F/DQ on this machine; {what} not exercised");
        }
        here
    }

    /// `P·V` on f32 V rows read in place (`vps = NR`, any row stride: the rows' own width,
    /// wider, or 0 for a broadcast row) gives the bits of the same product on the packed
    /// V block (`pack::pack_v`'s layout), and both are within f32 rounding of an f64
    /// product: [`pv`] for strips of 6–144 rows, the decode path's live rows below 6, and
    /// key counts that leave every remainder of the 4-step unroll; [`pv_pair`] for one
    /// and two blocks. Outputs of 16 to 128 columns (every tile width of [`pv_impl`]), as
    /// the driver reads in place.
    #[test]
    fn pv_reads_v_rows_in_place_as_packed() {
        if !have_avx512("in-place V") {
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

    /// The register tiles give the bits of scalar fused multiply-adds in the same order:
    /// [`qk`] for 1–5 panels (the 6×64 assembly loop at 4 and after it a one-panel tile
    /// at 5, the intrinsics tiles below 4) and contraction lengths with every remainder
    /// of the four-step unroll; [`pv`] on packed V (the assembly loop over panels), on
    /// V rows in place (the assembly loop over rows, `vps = NR`) and on a wider panel
    /// row stride (the intrinsics loop), with the rescale factor applied to the output
    /// first, and with no key at all (the loops hand their accumulators back as they
    /// got them).
    #[test]
    fn tile_loops_match_scalar_fmas() {
        if !have_avx512("the AVX-512 tiles") {
            return;
        }
        let mut rnd = uniform(4242, 1.0);
        for rows in [6, 18] {
            for e in [1, 2, 3, 4, 5, 7, 8, 9, 33, 64, 128] {
                for npanels in 1..=5 {
                    let lds = 5 * NR;
                    let q: Vec<f32> = (0..rows * e).map(|_| rnd()).collect();
                    let kp: Vec<f32> = (0..npanels * e * NR).map(|_| rnd()).collect();
                    let mut s = vec![f32::NAN; rows * lds];
                    // SAFETY: AVX-512F detected above; shapes as the kernel requires.
                    unsafe { qk(&q, rows, e, &kp, npanels, &mut s, lds) };
                    reference::assert_qk(&q, (rows, e), &kp, npanels, &s, lds);
                }
            }
            for nk in [0, 1, 2, 3, 4, 5, 6, 31, 64] {
                // (panel stride, row stride): packed panels, rows in place, wider panels.
                for (vps, ldv) in [(BK * NR, NR), (NR, 4 * NR), (BK * 24, 24)] {
                    let nvp = 4;
                    let p: Vec<f32> = (0..rows * BK).map(|_| rnd()).collect();
                    let vp: Vec<f32> = (0..(nvp - 1) * vps + BK * ldv + NR).map(|_| rnd()).collect();
                    let alpha: Vec<f32> = (0..rows).map(|_| rnd()).collect();
                    let ldo = nvp * NR + 8;
                    let o0: Vec<f32> = (0..rows * ldo).map(|_| rnd()).collect();
                    let mut o = o0.clone();
                    // SAFETY: AVX-512F detected above; shapes as the kernel requires.
                    unsafe { pv(&p, rows, rows, nk, &vp, vps, ldv, nvp, &mut o, ldo, &alpha) };
                    reference::assert_pv(&p, (rows, nk), &vp, (vps, ldv, nvp), &alpha, &o0, &o, ldo);
                }
            }
        }
    }

    /// [`qk_softmax`] keeps each live row's sum in 16 lanes: after a first block, their
    /// total is the sum of the row's stored probabilities (`alpha = 0`, `m` the row's
    /// largest score); after a second block, `alpha` times that plus the second block's
    /// sum, both for rows whose reference stays (`alpha = 1`: scores of Q rows scaled
    /// down) and for rows that rescale (scores three times the first block's). The
    /// padding rows' lanes are not touched.
    #[test]
    fn qk_softmax_keeps_each_rows_sum_in_lanes() {
        if !have_avx512("the fused softmax") {
            return;
        }
        let mut rnd = uniform(99, 1.7);
        let (rows, live, e) = (12, 10, 64);
        let q: Vec<f32> = (0..rows * e)
            .map(|i| rnd() * if (i / e) % 2 == 0 { 0.01 } else { 1.0 })
            .collect();
        let ka: Vec<f32> = (0..BK * e).map(|_| rnd()).collect();
        let kb: Vec<f32> = ka.iter().map(|x| 3.0 * x).collect();
        let (mut m, mut alpha) = (vec![f32::NEG_INFINITY; live], vec![1f32; live]);
        let mut l16 = vec![0f32; 16 * live];
        l16.extend(std::iter::repeat_n(f32::NAN, 16 * (rows - live)));
        let row_sum = |l16: &[f32], r: usize| l16[16 * r..16 * r + 16].iter().map(|&x| x as f64).sum::<f64>();
        let (mut sa, mut sb) = (vec![0f32; rows * BK], vec![0f32; rows * BK]);
        // SAFETY: AVX-512F and DQ detected above; shapes as the kernel requires.
        unsafe {
            qk_softmax(
                &q,
                (rows, live),
                e,
                &ka,
                &mut sa,
                BK,
                (&mut m, &mut l16, &mut alpha),
            )
        };
        let mut sum_a = vec![0f64; live];
        for r in 0..live {
            let scores: Vec<f32> = (0..BK)
                .map(|j| {
                    (0..e).fold(0f32, |a, x| {
                        q[r * e + x].mul_add(ka[((j / NR) * e + x) * NR + j % NR], a)
                    })
                })
                .collect();
            assert_eq!(
                m[r],
                scores.iter().copied().fold(f32::NEG_INFINITY, f32::max),
                "row {r}"
            );
            assert_eq!(alpha[r], 0.0, "row {r}");
            sum_a[r] = sa[r * BK..(r + 1) * BK].iter().map(|&x| x as f64).sum();
            let got = row_sum(&l16, r);
            assert!(
                (got - sum_a[r]).abs() <= 1e-6 * sum_a[r],
                "row {r}: lanes {got}, probabilities {}",
                sum_a[r]
            );
        }
        let m_a = m.clone();
        // SAFETY: as above.
        unsafe {
            qk_softmax(
                &q,
                (rows, live),
                e,
                &kb,
                &mut sb,
                BK,
                (&mut m, &mut l16, &mut alpha),
            )
        };
        let (mut kept, mut moved) = (0, 0);
        for r in 0..live {
            let sum_b: f64 = sb[r * BK..(r + 1) * BK].iter().map(|&x| x as f64).sum();
            let want = alpha[r] as f64 * sum_a[r] + sum_b;
            let got = row_sum(&l16, r);
            assert!(
                (got - want).abs() <= 1e-6 * want,
                "row {r}: lanes {got}, want {want} (alpha {})",
                alpha[r]
            );
            if alpha[r] == 1.0 {
                assert_eq!(m[r], m_a[r], "row {r}");
                kept += 1;
            } else {
                assert!(alpha[r] < 1.0 && m[r] > m_a[r], "row {r}");
                moved += 1;
            }
        }
        assert!(kept > 0 && moved > 0, "kept {kept}, rescaled {moved}");
        assert!(
            l16[16 * live..].iter().all(|x| x.is_nan()),
            "a padding row's lanes were written"
        );
    }
}
