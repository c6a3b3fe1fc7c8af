//! The two block products of the AVX2 prefill, `Q·Kᵀ` and `P·V`, on 6×16 register
//! tiles whose contraction loop is written in assembly ([`rows_loop_6x16`]).

use super::*;

/// See [`super::super::portable::qk`], except that Q is row-major (row stride `e`), not
/// strip-packed (the 6-row tiles broadcast from the rows, [`rows_loop_6x16`]); `rows`
/// must be a multiple of [`MR`].
///
/// # Safety
/// AVX2 and FMA must be available.
pub(in crate::kernels::cpu) unsafe fn qk(
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
pub(in crate::kernels::cpu) unsafe fn qk_max(
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
    assert_qk_operands(q, (rows, e), kp, npanels, s, lds);
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
                    let prev = if p == 0 {
                        _mm256_set1_ps(f32::NEG_INFINITY)
                    } else {
                        _mm256_loadu_ps(mp.add(r * 8))
                    };
                    // `max(x, m)` skips NaN scores (see `online_rows_block`).
                    let v = _mm256_max_ps(acc[2 * r + 1], _mm256_max_ps(acc[2 * r], prev));
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
pub(super) unsafe fn rows_loop_6x16(
    acc: &mut [__m256; 2 * MR],
    a: *const f32,
    la: usize,
    b: *const f32,
    n: usize,
) {
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

/// See [`super::super::portable::pv`] (P row-major with row stride [`BK`]); `rows` must be a
/// multiple of [`MR`]. With packed V (`ldv == NR`) the key loop is [`rows_loop_6x16`];
/// other V row strides take the same steps in intrinsics.
///
/// # Safety
/// AVX2 and FMA must be available.
#[allow(clippy::too_many_arguments)]
pub(in crate::kernels::cpu) unsafe fn pv(
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
    assert_pv_operands(p, (rows, BK), &[(vp, nk)], (vps, ldv, nvp), o, ldo, alpha);
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
    // Strip-outer: a strip's six P rows (1.5 KB) stay in L1 while the V panels stream
    // in order, and its output tiles lie side by side in each row. The products are
    // those of the panel-outer order used before; under `CANDLE_ATTENTION_ISA=avx2` on
    // the Zen 4 VM, one process alternating the two orders measured new/old 0.983–0.990
    // at Ev = 128, 0.991–0.994 at Ev = 64 on rows of 512–1500 keys, and 1.000–1.014 on
    // rows of 128 keys (kernel notes).
    for strip in 0..rows / MR {
        let ps = p.add(strip * MR * BK);
        for n in 0..nvp {
            let vpp = vp.add(n * vps);
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

#[cfg(test)]
mod tests {
    use super::super::super::tiles::reference;
    use super::*;

    /// The assembly tile loop ([`rows_loop_6x16`]) in both block products gives exactly
    /// the scalar fused multiply-adds in the same order: `qk` on row-major Q for
    /// contraction lengths with every remainder of the four-step unroll, and `pv` with
    /// packed V (the assembly loop) and with a wider V row stride (the intrinsics loop),
    /// with the rescale factor applied to the output first.
    #[test]
    fn tile_loops_match_scalar_fmas() {
        if !super::super::super::Isa::Avx2Fma.is_supported() {
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
                reference::assert_qk(&q, (rows, e), &kp, npanels, &s, BK);
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
                    reference::assert_pv(&p, (rows, nk), &vp, (vps, ldv, nvp), &alpha, &o0, &o, ldo);
                }
            }
        }
    }

    /// `qk_max`'s partial maxima give each row's maximum score, for every row of every
    /// strip, with 1 to 4 panels, and its scores equal `qk`'s.
    #[test]
    fn qk_max_keeps_each_rows_maximum() {
        if !super::super::super::Isa::Avx2Fma.is_supported() {
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
