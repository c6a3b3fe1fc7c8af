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
    assert_qk_operands(q, (rows, e), kp, npanels, s, lds);
    // SAFETY: bounds asserted above; features guaranteed by the caller.
    unsafe { qk_impl(q.as_ptr(), rows, e, kp.as_ptr(), npanels, s.as_mut_ptr(), lds) }
}

/// `Q·Kᵀ` of one full block of [`BK`] keys that every row sees whole, and the
/// online-softmax update of its `live` rows, with each 6×16 score tile turned into
/// probabilities while it is still in registers: on return, rows `0..live` of `s`
/// (stride `lds ≥ BK`) hold the block's probabilities against the updated `m`, with
/// `l ← alpha·l + Σ p` and `alpha` the factor by which the row's output must be
/// rescaled, as [`super::online_rows_block`] leaves them; the padding rows
/// `live..rows` hold raw scores.
///
/// The lazy rescaling of the AVX-512 softmax (`avx512::qk_softmax`), on 16-key tiles:
/// a strip of six rows whose live rows all have a finite running maximum `m` starts
/// each tile's accumulators at `−m`, so its scores come out as `s − m`, and unless one
/// of them exceeds [`LAZY_RESCALE_LOG2`], `p = 2^(s − m)` with `m` unchanged. When one
/// does (rarely after a row's first block), the row moves its `m` to that tile's
/// maximum, and the probabilities and sum of its earlier tiles in the block, and its
/// `alpha`, take the factor. A strip with a row that has seen no finite score yet
/// (its first visible block) stores its raw scores, keeps their maxima lane-wise while
/// the tiles are in registers, and runs the two-pass update of
/// [`super::online_rows_block`] on its rows with those maxima, so that it skips the
/// pass that finds them. A NaN score is a hidden key (`p = 0`): the lazy check and the
/// maxima skip it, as in [`super::online_rows_block`].
///
/// # Safety
/// AVX2 and FMA must be available.
#[allow(clippy::too_many_arguments)]
pub(in crate::kernels::cpu) unsafe fn qk_softmax(
    q: &[f32],
    (rows, live): (usize, usize),
    e: usize,
    kp: &[f32],
    s: &mut [f32],
    lds: usize,
    (m, l, alpha): (&mut [f32], &mut [f32], &mut [f32]),
) {
    assert!(live <= rows && lds >= BK);
    assert_qk_operands(q, (rows, e), kp, BK / NR, s, lds);
    assert!(m.len() >= live && l.len() >= live && alpha.len() >= live);
    // SAFETY: bounds asserted above; features guaranteed by the caller.
    unsafe {
        qk_softmax_impl(
            q.as_ptr(),
            (rows, live),
            e,
            kp.as_ptr(),
            s.as_mut_ptr(),
            lds,
            (m, l, alpha),
        )
    }
}

/// The kernel of [`qk_softmax`].
///
/// # Safety
/// AVX2 and FMA must be available; `q` holds `rows` rows of `e` floats, `kp` the
/// block's four K panels and `s` `rows` rows of stride `lds ≥ BK` (as [`qk_softmax`]
/// asserts), and `m`, `l` and `alpha` hold at least `live` elements.
#[target_feature(enable = "avx2,fma")]
unsafe fn qk_softmax_impl(
    q: *const f32,
    (rows, live): (usize, usize),
    e: usize,
    kp: *const f32,
    s: *mut f32,
    lds: usize,
    (m, l, alpha): (&mut [f32], &mut [f32], &mut [f32]),
) {
    let lazy = _mm256_set1_ps(LAZY_RESCALE_LOG2);
    for st in 0..rows / MR {
        let r0 = st * MR;
        let nl = live.saturating_sub(r0).min(MR);
        let qs = q.add(r0 * e);
        let sp = s.add(r0 * lds);
        if (r0..r0 + nl).any(|r| m[r] == f32::NEG_INFINITY) {
            // A row's first visible block: raw scores and their lane-wise maxima, then
            // the update of `online_rows_block`, whose first pass reads these maxima.
            let mut mx = [_mm256_set1_ps(f32::NEG_INFINITY); MR];
            for p in 0..BK / NR {
                let acc = rows_loop_6x16([_mm256_setzero_ps(); 2 * MR], qs, e * 4, kp.add(p * e * NR), e);
                for r in 0..MR {
                    _mm256_storeu_ps(sp.add(r * lds + p * NR), acc[2 * r]);
                    _mm256_storeu_ps(sp.add(r * lds + p * NR + 8), acc[2 * r + 1]);
                    // `max(x, m)` skips NaN scores (see `online_rows_block`).
                    mx[r] = _mm256_max_ps(acc[2 * r + 1], _mm256_max_ps(acc[2 * r], mx[r]));
                }
            }
            let mut pre = [0f32; 8 * MR];
            for (r, v) in mx.iter().enumerate() {
                _mm256_storeu_ps(pre.as_mut_ptr().add(8 * r), *v);
            }
            super::softmax::online_rows_block_inner::<true, { BK / 8 }>(
                sp,
                lds,
                nl,
                |_| (0, BK),
                pre.as_ptr(),
                (&mut m[r0..], &mut l[r0..], &mut alpha[r0..]),
            );
            continue;
        }
        alpha[r0..r0 + nl].fill(1.0);
        let mut sums = [_mm256_setzero_ps(); MR];
        for p in 0..BK / NR {
            let mut acc = [_mm256_setzero_ps(); 2 * MR];
            for r in 0..nl {
                let v = _mm256_set1_ps(-m[r0 + r]);
                acc[2 * r] = v;
                acc[2 * r + 1] = v;
            }
            let mut acc = rows_loop_6x16(acc, qs, e * 4, kp.add(p * e * NR), e);
            let tp = sp.add(p * NR);
            // Each vector compared on its own: `max` would hide a lane behind a NaN.
            let mut over = 0;
            for r in 0..nl {
                let c = _mm256_or_ps(
                    _mm256_cmp_ps::<_CMP_GT_OQ>(acc[2 * r], lazy),
                    _mm256_cmp_ps::<_CMP_GT_OQ>(acc[2 * r + 1], lazy),
                );
                over |= ((_mm256_movemask_ps(c) != 0) as u32) << r;
            }
            if over != 0 {
                rescale_tile_rows(
                    over,
                    &mut acc,
                    (sp, lds, p * NR),
                    (&mut m[r0..], &mut alpha[r0..], &mut sums),
                );
            }
            for r in 0..nl {
                let [p0, p1] = exp2_256_nonpos_n([acc[2 * r], acc[2 * r + 1]]);
                sums[r] = _mm256_add_ps(sums[r], _mm256_add_ps(p0, p1));
                _mm256_storeu_ps(tp.add(r * lds), p0);
                _mm256_storeu_ps(tp.add(r * lds + 8), p1);
            }
            for r in nl..MR {
                _mm256_storeu_ps(tp.add(r * lds), acc[2 * r]);
                _mm256_storeu_ps(tp.add(r * lds + 8), acc[2 * r + 1]);
            }
        }
        for r in 0..nl {
            l[r0 + r] = l[r0 + r] * alpha[r0 + r] + hsum(sums[r]);
        }
    }
}

/// The rare branch of [`qk_softmax`]: each row `r` of the strip whose bit is set in
/// `over` has a score in this tile (`acc`, scores less the row's `m`) more than
/// [`LAZY_RESCALE_LOG2`] above `m`. Moves its `m` up by the tile's largest score `bm`
/// (NaN lanes ignored), subtracts `bm` from its tile, and multiplies its probabilities
/// of the block so far (row `r` of `sp`, stride `lds`, the first `done` keys), its sum
/// lanes and its `alpha` by `2^−bm`.
///
/// # Safety
/// AVX2 and FMA must be available; row `r` of `sp` holds `done` floats for every bit
/// `r` of `over`, and `m` and `alpha` hold an element for each.
#[cold]
#[inline(never)]
#[target_feature(enable = "avx2,fma")]
unsafe fn rescale_tile_rows(
    over: u32,
    acc: &mut [__m256; 2 * MR],
    (sp, lds, done): (*mut f32, usize, usize),
    (m, alpha, sums): (&mut [f32], &mut [f32], &mut [__m256; MR]),
) {
    for r in (0..MR).filter(|r| over >> r & 1 != 0) {
        let mut lanes = [0f32; 16];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc[2 * r]);
        _mm256_storeu_ps(lanes.as_mut_ptr().add(8), acc[2 * r + 1]);
        let bm = lanes.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
        let f = _mm_cvtss_f32(_mm256_castps256_ps128(exp2_256(_mm256_set1_ps(-bm))));
        let (bv, fv) = (_mm256_set1_ps(bm), _mm256_set1_ps(f));
        acc[2 * r] = _mm256_sub_ps(acc[2 * r], bv);
        acc[2 * r + 1] = _mm256_sub_ps(acc[2 * r + 1], bv);
        for x in std::slice::from_raw_parts_mut(sp.add(r * lds), done) {
            *x *= f;
        }
        sums[r] = _mm256_mul_ps(sums[r], fv);
        alpha[r] *= f;
        m[r] += bm;
    }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn qk_impl(
    q: *const f32,
    rows: usize,
    e: usize,
    kp: *const f32,
    npanels: usize,
    s: *mut f32,
    lds: usize,
) {
    // Panel-outer: the K panel (16 keys × E) stays in L1 while Q strips stream.
    for p in 0..npanels {
        let kpp = kp.add(p * e * NR);
        for strip in 0..rows / MR {
            // SAFETY: the strip's six Q rows (`e` floats each) and the K panel (`e`
            // steps of 16 floats) are inside `q` and `kp` (asserted by the callers).
            let acc = unsafe {
                rows_loop_6x16(
                    [_mm256_setzero_ps(); 2 * MR],
                    q.add(strip * MR * e),
                    e * 4,
                    kpp,
                    e,
                )
            };
            let sp = s.add(strip * MR * lds + p * NR);
            for r in 0..MR {
                _mm256_storeu_ps(sp.add(r * lds), acc[2 * r]);
                _mm256_storeu_ps(sp.add(r * lds + 8), acc[2 * r + 1]);
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
    acc: [__m256; 2 * MR],
    a: *const f32,
    la: usize,
    b: *const f32,
    n: usize,
) -> [__m256; 2 * MR] {
    if n == 0 {
        return acc;
    }
    let [mut c0, mut c1, mut c2, mut c3, mut c4, mut c5, mut c6, mut c7, mut c8, mut c9, mut c10, mut c11] =
        acc;
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
            inout("ymm0") c0,
            inout("ymm1") c1,
            inout("ymm2") c2,
            inout("ymm3") c3,
            inout("ymm4") c4,
            inout("ymm5") c5,
            inout("ymm6") c6,
            inout("ymm7") c7,
            inout("ymm8") c8,
            inout("ymm9") c9,
            inout("ymm10") c10,
            inout("ymm11") c11,
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
    [c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11]
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
                acc = unsafe { rows_loop_6x16(acc, ps, BK * 4, vpp, nk) };
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

    /// `qk_softmax` leaves each live row's probabilities, `m`, `l` and `alpha` as the
    /// online softmax defines them, over a run of blocks whose scores jump: against
    /// scores computed in f64, `p = 2^(s − m)` for every key, `alpha = 2^(m_old − m)`
    /// (0 after a row's first block), `l = alpha·l_old + Σ p`, no `p` above 2^8, and, in
    /// strips whose rows all have a running maximum, `m` unchanged with `alpha = 1` where
    /// no score ran more than 8 (less a margin) ahead.
    /// The strips start in every state: all rows on their first block, all rows with a
    /// running maximum, and a mix. The blocks rescale some rows in their first panel and
    /// some only in their last, after earlier panels' probabilities were written. The
    /// padding rows hold `qk`'s raw scores.
    #[test]
    fn qk_softmax_follows_the_online_softmax() {
        if !super::super::super::Isa::Avx2Fma.is_supported() {
            return;
        }
        let mut rnd = uniform(4242, 1.0);
        for e in [64, 33] {
            let (rows, live) = (18, 16);
            let q: Vec<f32> = (0..rows * e)
                .map(|i| rnd() * if (i / e) % 3 == 0 { 0.05 } else { 0.6 })
                .collect();
            let ka: Vec<f32> = (0..BK * e).map(|_| rnd()).collect();
            // Block b: all keys ×3 (every row jumps, in its first panel); block c: the
            // last panel's keys ×9 (rows jump only after three panels).
            let kb: Vec<f32> = ka.iter().map(|x| 3.0 * x).collect();
            let kc: Vec<f32> = ka
                .iter()
                .enumerate()
                .map(|(i, x)| if i / (e * NR) == 3 { 9.0 * x } else { *x })
                .collect();
            // Strip 0 on its first block, strip 1 with running maxima, strip 2 mixed.
            let mut m: Vec<f32> = (0..live)
                .map(|r| {
                    if r < 6 || r == 12 {
                        f32::NEG_INFINITY
                    } else {
                        0.5 * rnd()
                    }
                })
                .collect();
            let mut l: Vec<f32> = m.iter().map(|&x| if x.is_finite() { 3.0 } else { 0.0 }).collect();
            let mut alpha = vec![f32::NAN; live];
            for (bi, kp) in [&ka, &kb, &kc, &ka].into_iter().enumerate() {
                let (m_old, l_old) = (m.clone(), l.clone());
                let mut s = vec![f32::NAN; rows * BK];
                // SAFETY: AVX2 and FMA detected above; shapes as the kernel requires.
                unsafe { qk_softmax(&q, (rows, live), e, kp, &mut s, BK, (&mut m, &mut l, &mut alpha)) };
                let mut raw = vec![0f32; rows * BK];
                // SAFETY: as above.
                unsafe { qk(&q, rows, e, kp, BK / NR, &mut raw, BK) };
                assert_eq!(s[live * BK..], raw[live * BK..], "padding rows, e {e} block {bi}");
                for r in 0..live {
                    let what = format!("e {e} block {bi} row {r}");
                    let sc: Vec<f64> = (0..BK)
                        .map(|j| {
                            (0..e)
                                .map(|x| q[r * e + x] as f64 * kp[((j / NR) * e + x) * NR + j % NR] as f64)
                                .sum()
                        })
                        .collect();
                    let smax = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let (mo, mn) = (m_old[r] as f64, m[r] as f64);
                    assert!(mn >= smax - 8.0 - 1e-4, "{what}: m {mn} for a maximum of {smax}");
                    // (A strip with a row on its first block takes the two-pass update,
                    // which moves every row's `m` to its maximum.)
                    let st = r / MR * MR;
                    let lazy = m_old[st..(st + MR).min(live)].iter().all(|x| x.is_finite());
                    if lazy && smax - mo < 8.0 - 1e-3 {
                        assert_eq!((m[r], alpha[r]), (m_old[r], 1.0), "{what}");
                    }
                    let want_alpha = if mo.is_finite() { (mo - mn).exp2() } else { 0.0 };
                    assert!(
                        (alpha[r] as f64 - want_alpha).abs() <= 1e-5 * want_alpha,
                        "{what}: alpha {} against {want_alpha}",
                        alpha[r]
                    );
                    let mut sum = 0f64;
                    for (j, &x) in sc.iter().enumerate() {
                        let (got, want) = (s[r * BK + j] as f64, (x - mn).exp2());
                        assert!(
                            got <= 256.0 && (got - want).abs() <= 3e-5 * want,
                            "{what} key {j}: p {got} against {want}"
                        );
                        sum += got;
                    }
                    let want_l = alpha[r] as f64 * l_old[r] as f64 + sum;
                    assert!(
                        (l[r] as f64 - want_l).abs() <= 1e-5 * want_l,
                        "{what}: l {} against {want_l}",
                        l[r]
                    );
                }
            }
        }
    }
}
