//! The AVX2 decode kernels: scores and `P·V` against K/V rows read in place (f32, or
//! f16/bf16 widened in registers), for the few query rows of a decode step.

use super::*;

/// See [`super::super::portable::qk_dot`]: scores against row-major keys (decode path), for
/// the first `live` of `rows` rows (the others are not written). `rows` must be a
/// multiple of [`MR`] and `e` a multiple of 8. `k` holds f32, bf16 or f16 rows (half
/// precision is read in place and widened in registers).
///
/// `v`: the block's V rows (`(rows, row stride, row length)`, one per key), for the
/// first strip to ask for into the L2 while it scores f32 K rows ([`AskRows`]). Returns
/// whether it did, that is whether [`pv_rows`] will find them there (its `v_in_l2`).
/// With f16/bf16 K rows nothing is asked for: there it made decode no faster (f16) or
/// slower (bf16; kernel notes).
///
/// # Safety
/// AVX2, FMA and F16C must be available.
#[allow(clippy::too_many_arguments)]
pub(in crate::kernels::cpu) unsafe fn qk_dot(
    q: &[f32],
    rows: usize,
    live: usize,
    e: usize,
    k: Data,
    ldk: usize,
    nk: usize,
    s: &mut [f32],
    lds: usize,
    v: Option<(Data, usize, usize)>,
) -> bool {
    let (kp, len, kind) = rows_of(k);
    assert!(
        rows.is_multiple_of(MR) && live <= rows && e.is_multiple_of(8) && lds >= nk && q.len() >= rows * e
    );
    assert!(nk == 0 || len >= (nk - 1) * ldk + e);
    assert!(rows == 0 || s.len() >= (rows - 1) * lds + nk);
    // (Only asked for, never read: a prefetch cannot fault, but the rows must be there
    // for `pv_rows` anyway.)
    let v = v.map(|(vs, ldv, ev)| AskRows::new(vs, ldv, ev, nk));
    let (q, s) = (q.as_ptr(), s.as_mut_ptr());
    // SAFETY: bounds asserted above; features guaranteed by the caller.
    unsafe {
        match kind {
            F32 => qk_dot_impl::<F32>(q, live, e, kp, ldk, nk, s, lds, v),
            BF16 => qk_dot_impl::<BF16>(q, live, e, kp, ldk, nk, s, lds, None),
            _ => qk_dot_impl::<F16>(q, live, e, kp, ldk, nk, s, lds, None),
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
    v: Option<AskRows>,
) -> bool {
    // Strips of up to `MR` live rows; padding rows are skipped (decode has few live
    // rows: one per query head of the group). The first strip asks for the V rows `v`,
    // and for the K rows `PF_KEYS` ahead, which are read once (the strips that walk each
    // f32 K row only where `prefetch::avx2_walk_ahead`).
    let mut r0 = 0;
    while r0 < live {
        // (Each strip reads every K row of the block, so the first asks for every V row.)
        let va = if r0 == 0 { v } else { None };
        // Six rows or more of f32 keys: up to 8 rows in the lanes (`qk_lanes`), and from
        // fourteen up to 16 (`qk_lanes16`).
        if T == F32 && live - r0 >= LANES_MIN_ROWS && lanes_head_size(e) {
            let wide = live - r0 >= LANES16_MIN_ROWS;
            let r = (live - r0).min(if wide { 16 } else { 8 });
            let (qs, kr, sp) = (q.add(r0 * e), (k as *const f32, ldk, nk), s.add(r0 * lds));
            if wide {
                qk_lanes16(qs, r, e, kr, sp, lds, va);
            } else {
                qk_lanes(qs, r, e, kr, sp, lds, va);
            }
            r0 += r;
            continue;
        }
        let r = (live - r0).min(MR);
        let (qs, sp, pf) = (q.add(r0 * e), s.add(r0 * lds), r0 == 0);
        // One to five rows of f32 keys whose Q fits `WALK_MAX_Q_BYTES`: each K row walked
        // to its end (`qk_rows_walk`); f16/bf16 keys, longer Q rows (projections that
        // read their weights in place, `linear`) and six f32 rows of more than 256, in
        // strips of 2–4 keys.
        if T == F32 && r <= WALK_MAX_ROWS && r * e * 4 <= WALK_MAX_Q_BYTES {
            let pf = pf && super::super::prefetch::avx2_walk_ahead();
            match r {
                1 => qk_rows_walk::<T, 1, 4>(qs, e, k, ldk, nk, sp, lds, pf, va),
                2 => qk_rows_walk::<T, 2, 2>(qs, e, k, ldk, nk, sp, lds, pf, va),
                3 => qk_rows_walk::<T, 3, 2>(qs, e, k, ldk, nk, sp, lds, pf, va),
                4 => qk_rows_walk::<T, 4, 2>(qs, e, k, ldk, nk, sp, lds, pf, va),
                _ => qk_rows_walk::<T, 5, 2>(qs, e, k, ldk, nk, sp, lds, pf, va),
            }
            r0 += r;
            continue;
        }
        match r {
            1 => qk_dot_strip::<T, 1, 4>(qs, e, k, ldk, nk, sp, lds, pf, va),
            2 => qk_dot_strip::<T, 2, 4>(qs, e, k, ldk, nk, sp, lds, pf, va),
            3 => qk_dot_strip::<T, 3, 4>(qs, e, k, ldk, nk, sp, lds, pf, va),
            4 => qk_dot_strip::<T, 4, 2>(qs, e, k, ldk, nk, sp, lds, pf, va),
            5 => qk_dot_strip::<T, 5, 2>(qs, e, k, ldk, nk, sp, lds, pf, va),
            _ => qk_dot_strip::<T, 6, 2>(qs, e, k, ldk, nk, sp, lds, pf, va),
        }
        r0 += r;
    }
    v.is_some() && live > 0
}

/// Fewest live rows that [`qk_dot_impl`] puts in the lanes of one strip ([`qk_lanes`]):
/// a strip of 6 leaves a quarter of each vector idle. Measured with
/// `CANDLE_ATTENTION_ISA=avx2` on the Zen 4 VM, as the Zen 3 VM where AVX2 is the kernel
/// that runs could not be reached (both threads, f32 decode over 4096 keys of 128 from
/// DRAM and L3, in-process probe against the strips of up to 6 rows, time new/old): 4
/// rows 0.829, 5 rows 0.902, 6 rows 0.805, 7 rows 0.767, 8 rows 0.729–0.798, 16 rows
/// 0.773–0.837, 24 rows 0.845–0.855, 16 rows of 64 0.871–0.897 (kernel notes). Groups of
/// 4 and 5 rows stay on the strips: they are bound by memory, and the strips' prefetch
/// was tuned on the Zen 3 VM.
pub(in crate::kernels::cpu) const LANES_MIN_ROWS: usize = 6;

/// Fewest live rows that [`qk_dot_impl`] puts in the lanes of a 16-row strip
/// ([`qk_lanes16`]). Measured with `CANDLE_ATTENTION_ISA=avx2` on the Zen 4 VM (both
/// threads, f32 decode over K rows of 128, in-process probe against the 8-row strips,
/// time new/old): 12 rows 1.010–1.041, 13 rows 1.021, 14 rows 0.952, 15 rows 0.940, 16
/// rows 0.916–0.956 (kernel notes).
pub(in crate::kernels::cpu) const LANES16_MIN_ROWS: usize = 14;

/// Whether [`qk_lanes`] and [`qk_lanes16`] take rows of `e` elements: a multiple of 8
/// (their Q transposes) up to 256 (their Q buffers).
pub(in crate::kernels::cpu) fn lanes_head_size(e: usize) -> bool {
    e > 0 && e.is_multiple_of(8) && e <= 256
}

/// Decode scores of `nr ≤ 8` rows with the rows in the lanes, as
/// `avx512::decode::qk_lanes` does with 16: `Qᵀ` (`e × 8`, rows `nr..8` zero) is built
/// once, then each tile of 8 keys accumulates `acc[c] += Qᵀ[x] · K[j + c][x]` over
/// `x < e`, broadcasting each K element from its row in place (f32, row stride `ldk`),
/// and an 8×8 transpose stores the tile as 8 keys of each score row (`s`, row stride
/// `lds`). The strips of [`qk_dot_strip`] put the head dimension in the lanes and sum
/// each score across them. The tiles ask for the next tile's rows as they go (two lines
/// per pass when the rows follow each other, `ldk = e`; otherwise all of them before the
/// tile). One thread, 16 rows of 128 against 256 keys in L2, AVX2 forced on the Zen 4
/// VM: 87 GFLOP/s against 75 for the strips (the tiles in intrinsics, with the next
/// rows asked for before each tile and the scores stored one by one: 72). AVX-512 takes
/// these strips too for 7 to 11 rows on Zen 4 (`avx512::decode::lanes8`).
///
/// # Safety
/// AVX2 and FMA must be available; `qs` holds `nr` rows of `e` elements
/// ([`lanes_head_size`]); K rows `0..nk` at `k + j·ldk` hold `e` elements; `s` holds
/// `nr` rows of stride `lds ≥ nk`.
///
/// With `v`, each tile also asks for its 8 keys' V rows into the L2 ([`AskRows`]): two
/// lines per loop where they follow each other and are as long as the K rows, else all
/// of them before the tile.
// (Out of line: its 17 KB of stack would otherwise be probed page by page at every
// call of `qk_dot_impl`, whatever strips the call takes.)
#[inline(never)]
#[target_feature(enable = "avx2,fma")]
pub(in crate::kernels::cpu) unsafe fn qk_lanes(
    qs: *const f32,
    nr: usize,
    e: usize,
    (k, ldk, nk): (*const f32, usize, usize),
    s: *mut f32,
    lds: usize,
    v: Option<AskRows>,
) {
    debug_assert!(nr <= 8 && lanes_head_size(e));
    // Q rows padded to 8 with zeros, then transposed: `qt[x·8 + r]`, written whole for
    // `x < e` by the transposes.
    let mut qpad = std::mem::MaybeUninit::<[f32; 8 * 256]>::uninit();
    let qpad = qpad.as_mut_ptr() as *mut f32;
    std::ptr::copy_nonoverlapping(qs, qpad, nr * e);
    std::ptr::write_bytes(qpad.add(nr * e), 0, (8 - nr) * e);
    let mut qt = std::mem::MaybeUninit::<[f32; 8 * 256]>::uninit();
    let qt = qt.as_mut_ptr() as *mut f32;
    for x0 in (0..e).step_by(8) {
        super::transpose8(qpad.add(x0), e, qt.add(x0 * 8), 8);
    }
    let (mut tile, mut rows) = ([0f32; 64], [0f32; 64]);
    let follow = ldk == e;
    let mut j = 0;
    while j < nk {
        let cnt = (nk - j).min(8);
        // The next tile's rows (past the block's last key too: a prefetch never faults).
        let next = k.wrapping_add((j + 8) * ldk);
        if !follow {
            for c in 0..8 {
                prefetch_bytes(next.wrapping_add(c * ldk) as *const u8, e * 4);
            }
        }
        // This tile's V rows: two lines per loop where they follow each other and are
        // as long as the K rows (the loop runs `e/4` times over 8 rows of `4e` bytes),
        // else all of them now.
        let vpf = v.and_then(|v| {
            let at = v.contiguous(4 * e, j).filter(|_| cnt == 8);
            if at.is_none() {
                v.ask(j, cnt);
            }
            at
        });
        let acc = if cnt == 8 {
            // SAFETY: 8 rows of `e` elements from `k + j·ldk`, and `e` steps of `qt`.
            unsafe { lanes_loop_8(k.add(j * ldk), ldk * 4, qt, e / 4, (follow.then_some(next), vpf)) }
        } else {
            // A tail of fewer than 8 keys: the lanes of keys past `nk` repeat the last
            // key, and their scores are not stored.
            let kr: [*const f32; 8] = std::array::from_fn(|c| k.add((j + c.min(cnt - 1)) * ldk));
            let mut acc = [_mm256_setzero_ps(); 8];
            for x in 0..e {
                let qv = _mm256_loadu_ps(qt.add(x * 8));
                for (a, r) in acc.iter_mut().zip(&kr) {
                    *a = _mm256_fmadd_ps(qv, _mm256_broadcast_ss(&*r.add(x)), *a);
                }
            }
            acc
        };
        for (c, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(tile.as_mut_ptr().add(8 * c), *a);
        }
        super::transpose8(tile.as_ptr(), 8, rows.as_mut_ptr(), 8);
        for r in 0..nr {
            if cnt == 8 {
                _mm256_storeu_ps(s.add(r * lds + j), _mm256_loadu_ps(rows.as_ptr().add(8 * r)));
            } else {
                std::ptr::copy_nonoverlapping(rows.as_ptr().add(8 * r), s.add(r * lds + j), cnt);
            }
        }
        j += 8;
    }
}

macro_rules! lanes_step8 {
    ($q:literal, $d:literal) => {
        concat!(
            "vmovups ymm8, ymmword ptr [{qt} + ",
            $q,
            "]\n",
            "vbroadcastss ymm9, dword ptr [{g0} + ",
            $d,
            "]\n",
            "vbroadcastss ymm10, dword ptr [{g0} + {l} + ",
            $d,
            "]\n",
            "vfmadd231ps ymm0, ymm8, ymm9\n",
            "vfmadd231ps ymm1, ymm8, ymm10\n",
            "vbroadcastss ymm11, dword ptr [{g0} + {l}*2 + ",
            $d,
            "]\n",
            "vbroadcastss ymm12, dword ptr [{g0} + {l3} + ",
            $d,
            "]\n",
            "vfmadd231ps ymm2, ymm8, ymm11\n",
            "vfmadd231ps ymm3, ymm8, ymm12\n",
            "vbroadcastss ymm9, dword ptr [{g1} + ",
            $d,
            "]\n",
            "vbroadcastss ymm10, dword ptr [{g1} + {l} + ",
            $d,
            "]\n",
            "vfmadd231ps ymm4, ymm8, ymm9\n",
            "vfmadd231ps ymm5, ymm8, ymm10\n",
            "vbroadcastss ymm11, dword ptr [{g1} + {l}*2 + ",
            $d,
            "]\n",
            "vbroadcastss ymm12, dword ptr [{g1} + {l3} + ",
            $d,
            "]\n",
            "vfmadd231ps ymm6, ymm8, ymm11\n",
            "vfmadd231ps ymm7, ymm8, ymm12\n",
        )
    };
}

/// [`qk_lanes`] for `nr ≤ 16` rows in the lanes of two vectors: `Qᵀ` (`e × 16`, rows
/// `nr..16` zero) is built once, then each tile of 8 keys runs two passes of 4 keys
/// ([`lanes_loop_16x4`]), each accumulating `acc[g][c] += Qᵀ[x][8g..8g + 8] · K[j + c][x]`
/// over `x < e`, and two 8×8 transposes store the tile as 8 keys of each score row. Each
/// K element broadcast serves 16 rows, where [`qk_lanes`] serves 8: per step 2 loads of
/// Q and 4 broadcasts for 8 FMAs, against 1 and 8 for 8, so a group of 16 rows reads each
/// K row once instead of twice. Each score is still one chain of `e` FMAs, so the
/// scores are those of [`qk_lanes`], bit for bit. The passes ask for the next tile's rows
/// as they go (one line per pass step when the rows follow each other, `ldk = e`;
/// otherwise all of them before the tile). AVX2 forced on the Zen 4 VM, both threads,
/// f32, in-process probe against two 8-row strips (time new/old, 16 pairs): 16 rows over
/// 2048 keys in the L3 0.914, over 256 keys in the L2 0.918, from DRAM 0.938, 32 rows
/// 0.919 (kernel notes).
///
/// With `v` (the V rows of the same keys: pointer, row stride, row length), each pass
/// also asks for its 4 keys' V rows into the L2 (`prefetcht1`), one line per loop where
/// the rows follow each other and are as long as the K rows, else all of them before
/// the pass. The scores are compute-bound at these row counts, so the V rows arrive
/// while the FMA units are busy, and `P·V` finds them in the L2 ([`pv_rows`]' tiles).
///
/// # Safety
/// AVX2 and FMA must be available; `qs` holds `nr` rows of `e` elements
/// ([`lanes_head_size`]); K rows `0..nk` at `k + j·ldk` hold `e` elements; `s` holds
/// `nr` rows of stride `lds ≥ nk`.
// (Out of line, as `qk_lanes`: its 24 KB of stack.)
#[inline(never)]
#[target_feature(enable = "avx2,fma")]
pub(in crate::kernels::cpu) unsafe fn qk_lanes16(
    qs: *const f32,
    nr: usize,
    e: usize,
    (k, ldk, nk): (*const f32, usize, usize),
    s: *mut f32,
    lds: usize,
    v: Option<AskRows>,
) {
    debug_assert!(nr <= 16 && lanes_head_size(e));
    // `qt[x·16 + r]`, written whole for `x < e` by the transposes: a group of 8 whole
    // rows is transposed in place, a partial one from a zero-padded copy.
    let mut qt = std::mem::MaybeUninit::<[f32; 16 * 256]>::uninit();
    let qt = qt.as_mut_ptr() as *mut f32;
    let mut qpad = std::mem::MaybeUninit::<[f32; 8 * 256]>::uninit();
    let qpad = qpad.as_mut_ptr() as *mut f32;
    for g in 0..2 {
        let have = nr.saturating_sub(8 * g).min(8);
        let src = if have == 8 {
            qs.add(8 * g * e)
        } else {
            std::ptr::copy_nonoverlapping(qs.add(8 * g * e), qpad, have * e);
            std::ptr::write_bytes(qpad.add(have * e), 0, (8 - have) * e);
            qpad
        };
        for x0 in (0..e).step_by(8) {
            super::transpose8(src.add(x0), e, qt.add(x0 * 16 + 8 * g), 16);
        }
    }
    // `tile[c·16 + r]`: key `c`'s scores of the 16 rows.
    let (mut tile, mut rows) = ([0f32; 128], [0f32; 64]);
    let follow = ldk == e;
    let mut j = 0;
    while j < nk {
        let cnt = (nk - j).min(8);
        // The next tile's rows (past the block's last key too: a prefetch never faults).
        let next = k.wrapping_add((j + 8) * ldk);
        if !follow {
            for c in 0..8 {
                prefetch_bytes(next.wrapping_add(c * ldk) as *const u8, e * 4);
            }
        }
        // (A tail of at most 4 keys takes one pass; the lanes of keys past `nk` repeat
        // the last key, and their scores are not stored.)
        for half in 0..cnt.div_ceil(4) {
            let kr: [*const f32; 4] = std::array::from_fn(|c| k.add((j + (4 * half + c).min(cnt - 1)) * ldk));
            let pf = follow.then(|| next.wrapping_add(4 * half * ldk));
            // This pass's V rows (4 keys from `j + 4·half`), one line per loop if they
            // follow each other and are `e` long (the loop runs `e/4` times over `e/4`
            // lines), else all of them now.
            let vpf = v.and_then(|v| {
                let at = v.contiguous(4 * e, j + 4 * half);
                if at.is_none() {
                    v.ask(j + 4 * half, 4);
                }
                at
            });
            // SAFETY: the 4 rows hold `e` floats each and `qt` `16·e`.
            let acc = unsafe { lanes_loop_16x4(kr, qt, e / 4, (pf, vpf)) };
            for (c, pair) in acc.chunks_exact(2).enumerate() {
                let t = tile.as_mut_ptr().add((4 * half + c) * 16);
                _mm256_storeu_ps(t, pair[0]);
                _mm256_storeu_ps(t.add(8), pair[1]);
            }
        }
        for g in 0..nr.div_ceil(8) {
            super::transpose8(tile.as_ptr().add(8 * g), 16, rows.as_mut_ptr(), 8);
            for r in 0..(nr - 8 * g).min(8) {
                let sr = s.add((8 * g + r) * lds + j);
                if cnt == 8 {
                    _mm256_storeu_ps(sr, _mm256_loadu_ps(rows.as_ptr().add(8 * r)));
                } else {
                    std::ptr::copy_nonoverlapping(rows.as_ptr().add(8 * r), sr, cnt);
                }
            }
        }
        j += 8;
    }
}

macro_rules! lanes_step16x4 {
    ($q:literal, $d:literal) => {
        concat!(
            "vmovups ymm8, ymmword ptr [{qt} + ",
            $q,
            "]\n",
            "vmovups ymm9, ymmword ptr [{qt} + ",
            $q,
            " + 32]\n",
            "vbroadcastss ymm10, dword ptr [{k0} + ",
            $d,
            "]\n",
            "vfmadd231ps ymm0, ymm8, ymm10\n",
            "vfmadd231ps ymm1, ymm9, ymm10\n",
            "vbroadcastss ymm11, dword ptr [{k1} + ",
            $d,
            "]\n",
            "vfmadd231ps ymm2, ymm8, ymm11\n",
            "vfmadd231ps ymm3, ymm9, ymm11\n",
            "vbroadcastss ymm12, dword ptr [{k2} + ",
            $d,
            "]\n",
            "vfmadd231ps ymm4, ymm8, ymm12\n",
            "vfmadd231ps ymm5, ymm9, ymm12\n",
            "vbroadcastss ymm13, dword ptr [{k3} + ",
            $d,
            "]\n",
            "vfmadd231ps ymm6, ymm8, ymm13\n",
            "vfmadd231ps ymm7, ymm9, ymm13\n",
        )
    };
}

/// [`qk_lanes16`]' pass in assembly: `acc[2c + g] = Σ_x qt[x][8g..8g + 8] · k_c[x]` for
/// the 4 rows `k[c]`, over `4·n` steps (per step two loads of `qt[x]`, 16 floats, and 4
/// broadcasts and 8 FMAs), four steps per loop. With `next`, each loop also asks for
/// one line from `next` on into the L1 (the next rows, when they follow each other), and
/// with `v` one line from `v` on into the L2.
///
/// # Safety
/// AVX2 and FMA must be available; the 4 rows hold `4·n` floats each, `qt` `64·n`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn lanes_loop_16x4(
    k: [*const f32; 4],
    qt: *const f32,
    n: usize,
    (next, v): (Option<*const f32>, Option<*const u8>),
) -> [__m256; 8] {
    let z = _mm256_setzero_ps();
    let (mut c0, mut c1, mut c2, mut c3, mut c4, mut c5, mut c6, mut c7) = (z, z, z, z, z, z, z, z);
    if n == 0 {
        return [z; 8];
    }
    // Without `next` (`v`), the prefetches ask for the first row's line again, in place.
    let (pf, pfs) = match next {
        Some(p) => (p as *const u8, 64usize),
        None => (k[0] as *const u8, 0),
    };
    let (vp, vps) = match v {
        Some(p) => (p, 64usize),
        None => (k[0] as *const u8, 0),
    };
    // SAFETY: the caller guarantees the rows and `qt`; prefetches never fault.
    std::arch::asm!(
        "2:",
        "prefetcht0 [{pf}]",
        "prefetcht1 [{vp}]",
        lanes_step16x4!("0", "0"),
        lanes_step16x4!("64", "4"),
        lanes_step16x4!("128", "8"),
        lanes_step16x4!("192", "12"),
        "add {k0}, 16",
        "add {k1}, 16",
        "add {k2}, 16",
        "add {k3}, 16",
        "add {qt}, 256",
        "add {pf}, {pfs}",
        "add {vp}, {vps}",
        "dec {n}",
        "jnz 2b",
        k0 = inout(reg) k[0] => _,
        k1 = inout(reg) k[1] => _,
        k2 = inout(reg) k[2] => _,
        k3 = inout(reg) k[3] => _,
        qt = inout(reg) qt => _,
        pf = inout(reg) pf => _,
        pfs = in(reg) pfs,
        vp = inout(reg) vp => _,
        vps = in(reg) vps,
        n = inout(reg) n => _,
        out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _, out("ymm12") _, out("ymm13") _,
        inout("ymm0") c0, inout("ymm1") c1, inout("ymm2") c2, inout("ymm3") c3,
        inout("ymm4") c4, inout("ymm5") c5, inout("ymm6") c6, inout("ymm7") c7,
        options(nostack, readonly),
    );
    [c0, c1, c2, c3, c4, c5, c6, c7]
}

/// [`qk_lanes`]' tile loop in assembly: `acc[c] = Σ_x qt[x] · k_c[x]` for 8 rows `k_c` at
/// byte `c·l` from `k`, over `4·n` steps (per step one load of `qt[x]`, 8 floats, and 8
/// broadcasts and FMAs). The rows are addressed from two group pointers and `l`, `2·l`,
/// `3·l`, four steps per pass. With `next`, each pass also asks for two lines from `next`
/// on (the next 8 rows when they follow each other).
///
/// # Safety
/// AVX2 and FMA must be available; the 8 rows hold `4·n` floats each, `qt` `32·n`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn lanes_loop_8(
    k: *const f32,
    l: usize,
    qt: *const f32,
    n: usize,
    (next, v): (Option<*const f32>, Option<*const u8>),
) -> [__m256; 8] {
    let z = _mm256_setzero_ps();
    let (mut c0, mut c1, mut c2, mut c3, mut c4, mut c5, mut c6, mut c7) = (z, z, z, z, z, z, z, z);
    if n == 0 {
        return [z; 8];
    }
    let g0 = k as *const u8;
    // Without `next` (`v`), the prefetches ask for the first rows' lines again, in place.
    let (pf, pfs) = match next {
        Some(p) => (p as *const u8, 128usize),
        None => (g0, 0),
    };
    let (vp, vps) = match v {
        Some(p) => (p, 128usize),
        None => (g0, 0),
    };
    // SAFETY: the caller guarantees the rows and `qt`; prefetches never fault.
    std::arch::asm!(
        "2:",
        "prefetcht0 [{pf}]",
        "prefetcht0 [{pf} + 64]",
        "prefetcht1 [{vp}]",
        "prefetcht1 [{vp} + 64]",
        lanes_step8!("0", "0"),
        lanes_step8!("32", "4"),
        lanes_step8!("64", "8"),
        lanes_step8!("96", "12"),
        "add {g0}, 16",
        "add {g1}, 16",
        "add {qt}, 128",
        "add {pf}, {pfs}",
        "add {vp}, {vps}",
        "dec {n}",
        "jnz 2b",
        g0 = inout(reg) g0 => _,
        g1 = inout(reg) g0.add(4 * l) => _,
        l = in(reg) l,
        l3 = in(reg) 3 * l,
        qt = inout(reg) qt => _,
        pf = inout(reg) pf => _,
        pfs = in(reg) pfs,
        vp = inout(reg) vp => _,
        vps = in(reg) vps,
        n = inout(reg) n => _,
        out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _, out("ymm12") _,
        inout("ymm0") c0, inout("ymm1") c1, inout("ymm2") c2, inout("ymm3") c3,
        inout("ymm4") c4, inout("ymm5") c5, inout("ymm6") c6, inout("ymm7") c7,
        options(nostack, readonly),
    );
    [c0, c1, c2, c3, c4, c5, c6, c7]
}

/// Most live rows of a strip of f32 K rows that [`qk_rows_walk`] scores (from 6 rows,
/// strips put the rows in the lanes: [`LANES_MIN_ROWS`]). AVX2 forced on the Zen 4 VM
/// (both threads, f32, in-process probe against the strips of 2–4 interleaved keys,
/// time new/old, 12 pairs): 1 row (`decode_b4`'s shape) 0.860 and 0.822, and 0.764 with
/// K/V in the L3; 2 rows of 256 0.673 (of 128, in an earlier build, 0.746 and 0.803); 3
/// rows 0.769; 4 rows (`decode_gqa`'s shape) 0.882, and 0.864 from DRAM; 5 rows 0.911;
/// 4 rows of 64 0.996 (kernel notes, "AVX2 decode walks each f32 K row to its end").
pub(in crate::kernels::cpu) const WALK_MAX_ROWS: usize = 5;

/// Most bytes of Q rows that [`qk_rows_walk`] takes: it reads every Q element once per
/// key, so they must stay in the L1, where the strips read each once per 2–4 keys. This
/// matters for the projections of a decode step that read their weights in place
/// (`linear`, whose "keys" are weight rows and whose Q rows are as long as the
/// layer's input). AVX2 forced on the Zen 4 VM (`Proj::forward` against 8 weights in
/// turn with `CANDLE_ATTENTION_PACK_CACHE_MB=0`, walk over strips, 12 pairs): 16 KiB of
/// Q and less, 1 row of 4096 inputs 0.950, 2 rows of 2048 0.969, 4 rows of 1024 0.877, 2
/// rows of 1024 0.700, 1 row of 768 0.603; more, 2 rows of 4096 1.276, 4 rows 1.228, 5
/// rows 1.377, 1 row of 14336 1.101.
pub(in crate::kernels::cpu) const WALK_MAX_Q_BYTES: usize = 16 * 1024;

/// Scores of `R` row-major Q rows against K rows of kind `T`, each K row walked to its
/// end before the next, keys in order: per 8·`A` elements, `A` K loads shared by the `R`
/// rows and `A` accumulators per row (`A` chains of FMAs, summed at the end of the row).
/// The hardware prefetchers follow such reads from DRAM, as on AVX-512
/// (`avx512::decode::qk_rows_strip_reg`); [`qk_dot_strip`] reads 2–4 keys' rows
/// interleaved. With `pf`, each key asks for the K row `PF_KEYS` ahead into the L1, and
/// with `v` each key's V row is asked for into the L2 ([`AskRows`]): without `v` the walk
/// took 0.975 of the asking strips' time at one row, but 1.060–1.313 at 2–5 rows.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn qk_rows_walk<const T: u8, const R: usize, const A: usize>(
    qs: *const f32,
    e: usize,
    k: *const u8,
    ldk: usize,
    nk: usize,
    s: *mut f32,
    lds: usize,
    pf: bool,
    v: Option<AskRows>,
) {
    debug_assert!(R * A + A <= 16);
    let size = if T == F32 { 4 } else { 2 };
    for j in 0..nk {
        let kr = j * ldk;
        if pf {
            prefetch_bytes(k.wrapping_add((kr + PF_KEYS * ldk) * size), e * size);
        }
        if let Some(v) = v {
            v.ask(j, 1);
        }
        let mut acc = [[_mm256_setzero_ps(); A]; R];
        let mut x = 0;
        while x + 8 * A <= e {
            let kv: [__m256; A] = std::array::from_fn(|i| load8::<T>(k, kr + x + 8 * i));
            for (r, ar) in acc.iter_mut().enumerate() {
                for (i, a) in ar.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(_mm256_loadu_ps(qs.add(r * e + x + 8 * i)), kv[i], *a);
                }
            }
            x += 8 * A;
        }
        while x < e {
            let kv = load8::<T>(k, kr + x);
            for (r, ar) in acc.iter_mut().enumerate() {
                ar[0] = _mm256_fmadd_ps(_mm256_loadu_ps(qs.add(r * e + x)), kv, ar[0]);
            }
            x += 8;
        }
        for (r, ar) in acc.iter().enumerate() {
            let sum = ar.iter().skip(1).fold(ar[0], |t, &a| _mm256_add_ps(t, a));
            *s.add(r * lds + j) = hsum(sum);
        }
    }
}

/// Scores of `R` row-major Q rows against `NK` keys of kind `T` per pass (`R·NK ≤ 12`
/// accumulators). With `pf`, each pass asks for its keys' K rows `PF_KEYS` ahead into
/// the L1, and with `v` for their V rows into the L2 ([`AskRows`]).
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
    v: Option<AskRows>,
) {
    let size = if T == F32 { 4 } else { 2 };
    let mut j = 0;
    while j < nk {
        let t = (nk - j).min(NK);
        if let Some(v) = v {
            v.ask(j, t);
        }
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

/// Decode `O = alpha·O + P·V` for the first `live` rows, walking the V rows in key
/// order, four keys at a time, each over all `ncols` columns (a multiple of 8). `p`: row
/// stride `ldp ≥ nk`; V row `j` at element `j * ldv` of `v` (f32, or half precision read in
/// place and widened in registers); `o`: row stride `ldo`. Reading each streamed V row
/// to its end before the next keeps DRAM reads sequential, where the panel kernel
/// [`pv`] reads 16 columns of every row per pass. With four keys, the rows go in pairs,
/// so each V vector is loaded and widened once per two rows (a GQA group's rows share
/// the V rows).
///
/// With `v_in_l2` (the score kernel asked for these V rows into the L2, [`qk_dot`]),
/// f32 groups of [`PV_TILES_MIN_ROWS`] rows or more take register tiles instead
/// ([`pv_rows_tiles`]).
///
/// `next_k`: the next block's K rows, for f32 `P·V` to ask for into the L2 as it runs,
/// where the rows follow each other (a hint: results do not depend on it), as
/// `avx512::pv_rows` does: the walk at most eight lines per four keys, the tiles at most
/// two per key, the lines shared out evenly. The decode driver passes them where the
/// scores asked for the block's V rows (`v_in_l2`). AVX2 forced on the Zen 4 VM (both
/// threads, f32, in-process probe, time asking over time not, 12–16 pairs, the same
/// bits): `decode_gqa`'s shape 0.921–0.953 (once 1.016), 4 rows per group from DRAM
/// (`4,32,8,1,4096,128`) 0.938–0.952, 6 rows 0.951, 16 rows 0.888–0.936, 8 rows of 64
/// 0.945, Gemma's 2 rows of 256 0.951 (1.079–1.089 without the caps), `decode_b4`'s
/// shape 0.964–1.002, 2 rows 0.976, 12 rows 0.997; 16 rows with K/V in the L3 1.033
/// (kernel notes, "`P·V` asks for the next block's K rows").
///
/// # Safety
/// AVX2, FMA and F16C must be available.
#[allow(clippy::too_many_arguments)]
pub(in crate::kernels::cpu) unsafe fn pv_rows(
    (p, ldp): (&[f32], usize),
    live: usize,
    nk: usize,
    v: Data,
    ldv: usize,
    ncols: usize,
    o: &mut [f32],
    ldo: usize,
    alpha: &[f32],
    (v_in_l2, next_k): (bool, Option<AskRows>),
) {
    let (vp, len, kind) = rows_of(v);
    assert!(ldp >= nk && ncols.is_multiple_of(8) && ldo >= ncols && alpha.len() >= live);
    assert!(live == 0 || p.len() >= (live - 1) * ldp + nk);
    assert!(nk == 0 || ncols == 0 || len >= (nk - 1) * ldv + ncols);
    assert!(live == 0 || o.len() >= (live - 1) * ldo + ncols);
    let (p, o) = (p.as_ptr(), o.as_mut_ptr());
    let ask = Lines::of(next_k);
    // SAFETY: bounds asserted above; features guaranteed by the caller.
    let _unasked = unsafe {
        match kind {
            F32 if v_in_l2 && live >= PV_TILES_MIN_ROWS => pv_rows_tiles(
                (p, ldp),
                live,
                nk,
                vp as *const f32,
                ldv,
                ncols,
                o,
                ldo,
                alpha,
                ask,
            ),
            F32 => pv_rows_impl::<F32>((p, ldp), live, nk, vp, ldv, ncols, o, ldo, alpha, ask),
            BF16 => pv_rows_impl::<BF16>((p, ldp), live, nk, vp, ldv, ncols, o, ldo, alpha, Lines::NONE),
            _ => pv_rows_impl::<F16>((p, ldp), live, nk, vp, ldv, ncols, o, ldo, alpha, Lines::NONE),
        }
    };
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
    (p, ldp): (*const f32, usize),
    live: usize,
    nk: usize,
    v: *const u8,
    ldv: usize,
    ncols: usize,
    o: *mut f32,
    ldo: usize,
    alpha: &[f32],
    mut ask: Lines,
) -> Lines {
    rescale_rows(live, o, ldo, ncols, alpha);
    let size = if T == F32 { 4 } else { 2 };
    // `ask`'s lines, shared out over the passes of four keys, at most eight per pass.
    let per = ask.left.div_ceil(nk.div_ceil(4).max(1)).min(8);
    let mut j = 0;
    while j < nk {
        let t = (nk - j).min(4);
        if ask.left > 0 {
            ask.take(per).ask();
        }
        for jj in 0..t {
            prefetch_bytes(v.wrapping_add((j + jj + PF_KEYS) * ldv * size), ncols * size);
        }
        let vr = j * ldv;
        let mut r = 0;
        if t == 4 {
            // Two rows at a time: each V vector is loaded (and widened) once for both.
            while r + 2 <= live {
                let (a, b) = (p4(p.add(r * ldp + j)), p4(p.add((r + 1) * ldp + j)));
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
                let pr = p4(p.add(r * ldp + j));
                for c in (0..ncols).step_by(8) {
                    madd4(orow.add(c), &pr, &v4::<T>(v, vr + c, ldv));
                }
            } else {
                for jj in 0..t {
                    let pj = _mm256_broadcast_ss(&*p.add(r * ldp + j + jj));
                    for c in (0..ncols).step_by(8) {
                        let vj = load8::<T>(v, vr + jj * ldv + c);
                        _mm256_storeu_ps(orow.add(c), _mm256_fmadd_ps(pj, vj, _mm256_loadu_ps(orow.add(c))));
                    }
                }
            }
        }
        j += t;
    }
    ask
}

/// `O[r] *= alpha[r]` for the first `live` output rows (`ncols` columns, a multiple of
/// 8, row stride `ldo`), skipping rows whose factor is 1: the start of [`pv_rows_impl`]
/// and [`pv_rows_tiles`].
///
/// # Safety
/// AVX must be available; `o` holds `live` rows of `ncols` floats.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn rescale_rows(live: usize, o: *mut f32, ldo: usize, ncols: usize, alpha: &[f32]) {
    for (r, &a) in alpha.iter().enumerate().take(live) {
        if a != 1.0 {
            let av = _mm256_set1_ps(a);
            let orow = o.add(r * ldo);
            for c in (0..ncols).step_by(8) {
                _mm256_storeu_ps(orow.add(c), _mm256_mul_ps(av, _mm256_loadu_ps(orow.add(c))));
            }
        }
    }
}

/// Fewest live rows whose `P·V` takes register tiles ([`pv_rows_tiles`]) over V rows
/// in the L2. AVX2 forced on the Zen 4 VM, f32, in-process probe, the V rows asked for
/// in both, time with tiles over time without (the ratio of two readings against the
/// same baseline): 1 row 1.15, 2 rows 1.07, 4 rows 1.44, 6 rows 1.06, 8 rows 1.14, 12
/// rows 0.97 (kernel notes); from 14 rows, see [`qk_lanes16`].
pub(in crate::kernels::cpu) const PV_TILES_MIN_ROWS: usize = LANES16_MIN_ROWS;

/// Keys per chunk of [`pv_rows_tiles`]: 16 KB of V rows of 128, which stay in the L1
/// while every strip of the group passes over them. (Chunks of 16, 64 and all 256 keys
/// of a block measured within the noise of 32; kernel notes.)
const PV_TILE_KEYS: usize = 32;

/// [`pv_rows`] for f32 V rows that the score kernel asked for into the L2: `O =
/// alpha·O + P·V` in register tiles of up to 6 rows × 16 columns (12 accumulators; per
/// key 2 V loads and 6 broadcasts for 12 FMAs, where the pairs of [`pv_rows_impl`] load
/// and store their two output rows at every 4 keys), over chunks of [`PV_TILE_KEYS`]
/// keys, each chunk's strips and 16-column panels in turn. Each output takes the same
/// fused multiply-adds in the same order as in [`pv_rows_impl`], so the results are the
/// same, bit for bit. From DRAM or the L3 the tiles were slower than walking each V row
/// to its end (their 64-byte reads, one row after another, are not what the hardware
/// prefetchers follow), so they are only for rows already asked for (kernel notes).
/// The tiles also ask for `ask`'s lines (see [`pv_rows`]), at most two per key, and it
/// returns those left unasked, as [`pv_rows_impl`] does (at most eight per four keys).
///
/// # Safety
/// AVX2 and FMA must be available; as [`pv_rows_impl`], with f32 rows.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
unsafe fn pv_rows_tiles(
    (p, ldp): (*const f32, usize),
    live: usize,
    nk: usize,
    v: *const f32,
    ldv: usize,
    ncols: usize,
    o: *mut f32,
    ldo: usize,
    alpha: &[f32],
    mut ask: Lines,
) -> Lines {
    rescale_rows(live, o, ldo, ncols, alpha);
    // `ask`'s lines, shared out over the tiles, at most two per key of each.
    let tiles = nk.div_ceil(PV_TILE_KEYS) * live.div_ceil(MR) * ncols.div_ceil(16);
    let share = ask.left.div_ceil(tiles.max(1));
    let mut j = 0;
    while j < nk {
        let kn = (nk - j).min(PV_TILE_KEYS);
        let mut r0 = 0;
        while r0 < live {
            let r = (live - r0).min(MR);
            let t = (p.add(r0 * ldp + j), ldp, kn);
            let mut c0 = 0;
            while c0 < ncols {
                let (vc, oc) = ((v.add(j * ldv + c0), ldv), (o.add(r0 * ldo + c0), ldo));
                // (A macro: closures do not inherit `target_feature`.)
                macro_rules! tile {
                    ($c:literal) => {
                        match r {
                            6 => pv_tile::<6, $c>(t, vc, oc),
                            5 => pv_tile::<5, $c>(t, vc, oc),
                            4 => pv_tile::<4, $c>(t, vc, oc),
                            3 => pv_tile::<3, $c>(t, vc, oc),
                            2 => pv_tile::<2, $c>(t, vc, oc),
                            _ => pv_tile::<1, $c>(t, vc, oc),
                        }
                    };
                }
                ask.take(share.min(2 * kn)).ask();
                if ncols - c0 >= 16 {
                    tile!(2);
                    c0 += 16;
                } else {
                    tile!(1);
                    c0 += 8;
                }
            }
            r0 += r;
        }
        j += kn;
    }
    ask
}

/// One tile of [`pv_rows_tiles`]: `o[r][c] += Σ_j p[r][j]·v[j][c]` for `R` rows × `8·C`
/// columns, `kn` keys in order.
///
/// # Safety
/// AVX2 and FMA must be available; `p` holds `R` rows of `kn` floats (stride `ldp`), `v`
/// `kn` rows of `8·C` (stride `ldv`), `o` `R` rows of `8·C` (stride `ldo`).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn pv_tile<const R: usize, const C: usize>(
    (p, ldp, kn): (*const f32, usize, usize),
    (v, ldv): (*const f32, usize),
    (o, ldo): (*mut f32, usize),
) {
    let mut acc = [[_mm256_setzero_ps(); C]; R];
    for (r, ar) in acc.iter_mut().enumerate() {
        for (c, a) in ar.iter_mut().enumerate() {
            *a = _mm256_loadu_ps(o.add(r * ldo + 8 * c));
        }
    }
    for j in 0..kn {
        let mut vv = [_mm256_setzero_ps(); C];
        for (c, x) in vv.iter_mut().enumerate() {
            *x = _mm256_loadu_ps(v.add(j * ldv + 8 * c));
        }
        for (r, ar) in acc.iter_mut().enumerate() {
            let b = _mm256_broadcast_ss(&*p.add(r * ldp + j));
            for (a, &x) in ar.iter_mut().zip(&vv) {
                *a = _mm256_fmadd_ps(b, x, *a);
            }
        }
    }
    for (r, ar) in acc.iter().enumerate() {
        for (c, &a) in ar.iter().enumerate() {
            _mm256_storeu_ps(o.add(r * ldo + 8 * c), a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `qk_dot` asks for the V rows with f32 K rows (every kind of strip: 1–5 rows walking
    /// each K row, 6–13 and 14–32 with the rows in the lanes, heads of 64 to 256) and
    /// says so, asks for nothing with f16 K rows, and asking changes no score: V rows that
    /// follow each other and are as long as the K rows (asked for line by line in the
    /// loops), longer ones, rows with a gap, and half-precision V rows.
    #[test]
    fn decode_scores_ask_for_v_rows_without_changing_them() {
        if !(is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c"))
        {
            eprintln!("note: no AVX2+FMA+F16C on this machine; decode scores not exercised");
            return;
        }
        let val = |i: usize, m: usize| ((i * 37 + m) % 101) as f32 / 50.0 - 1.0;
        let nk = 69;
        for (e, ev, ldv) in [
            (128usize, 128usize, 128usize),
            (64, 128, 128),
            (64, 64, 72),
            (80, 64, 64),
            (256, 256, 256),
            (256, 256, 264),
        ] {
            let k: Vec<f32> = (0..nk * e).map(|i| val(i, 3)).collect();
            let kh: Vec<half::f16> = k.iter().map(|&x| half::f16::from_f32(x)).collect();
            let v: Vec<f32> = (0..nk * ldv).map(|i| val(i, 5)).collect();
            let vh: Vec<half::f16> = v.iter().map(|&x| half::f16::from_f32(x)).collect();
            for live in [1usize, 2, 5, 6, 8, 13, 14, 16, 24, 30, 32] {
                let rows = live.div_ceil(MR) * MR;
                let q: Vec<f32> = (0..rows * e).map(|i| val(i, 11)).collect();
                for (kd, vd) in [
                    (Data::F32(&k), Data::F32(&v)),
                    (Data::F32(&k), Data::F16(&vh)),
                    (Data::F16(&kh), Data::F32(&v)),
                ] {
                    let (mut s0, mut s1) = (vec![f32::NAN; rows * nk], vec![f32::NAN; rows * nk]);
                    // SAFETY: AVX2, FMA and F16C detected above.
                    let asked0 = unsafe { qk_dot(&q, rows, live, e, kd, e, nk, &mut s0, nk, None) };
                    // SAFETY: as above.
                    let asked1 =
                        unsafe { qk_dot(&q, rows, live, e, kd, e, nk, &mut s1, nk, Some((vd, ldv, ev))) };
                    assert!(!asked0);
                    let f32_k = matches!(kd, Data::F32(_));
                    assert_eq!(asked1, f32_k, "e {e}, live {live}, f32 K {f32_k}");
                    let same = s0.iter().zip(&s1).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "e {e}, ev {ev}, ldv {ldv}, live {live}: scores changed");
                }
            }
        }
    }

    /// The walk and the tiles of f32 `P·V` ask for every line of a next block's K rows
    /// where their caps allow it (eight per four keys, two per key of each tile), else
    /// as many as the caps allow, and return the rest, the address moved past the lines
    /// asked for: 1–32 rows, 70 and 5 keys, rows of 128 and 40 columns, next blocks of
    /// 1 to 300 rows of 128.
    #[test]
    fn decode_values_ask_for_the_next_k_rows_within_their_caps() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            eprintln!("note: no AVX2+FMA on this machine; decode values not exercised");
            return;
        }
        let k = vec![0.5f32; 300 * 128];
        for (nk, ncols) in [(70usize, 128usize), (5, 40)] {
            let (ldp, ldo) = (nk, ncols);
            let v = vec![0.25f32; nk * ncols];
            for live in [1usize, 2, 5, 13, 14, 20, 32] {
                let p = vec![0.5f32; live * ldp];
                let alpha = vec![1f32; live];
                let mut o = vec![0f32; live * ldo];
                for nk1 in [1usize, 9, 70, 300] {
                    let lines = Lines::of(Some(AskRows::new(Data::F32(&k), 128, 128, nk1)));
                    let n = lines.left;
                    // (Rows of 512 bytes from wherever `k` starts in its line.)
                    assert_eq!(n, (k.as_ptr() as usize % 64 + nk1 * 512).div_ceil(64));
                    // SAFETY: AVX2 and FMA detected above; shapes as `pv_rows` requires.
                    let (walk, tiles) = unsafe {
                        let vp = v.as_ptr() as *const u8;
                        let pp = (p.as_ptr(), ldp);
                        let om = o.as_mut_ptr();
                        (
                            pv_rows_impl::<F32>(pp, live, nk, vp, ncols, ncols, om, ldo, &alpha, lines),
                            pv_rows_tiles(pp, live, nk, v.as_ptr(), ncols, ncols, om, ldo, &alpha, lines),
                        )
                    };
                    // The walk: `⌈n / passes⌉` lines per pass of four keys, at most 8.
                    let walk_room = 8 * nk.div_ceil(4);
                    assert_eq!(n - walk.left, n.min(walk_room), "walk");
                    // The tiles: an even share each, at most two lines per key.
                    let tiles_n = nk.div_ceil(PV_TILE_KEYS) * live.div_ceil(MR) * ncols.div_ceil(16);
                    let shortest = nk - (nk - 1) / PV_TILE_KEYS * PV_TILE_KEYS;
                    let tile_room = 2 * nk * live.div_ceil(MR) * ncols.div_ceil(16);
                    let asked = n - tiles.left;
                    assert!(
                        asked <= n.min(tile_room),
                        "tiles: {asked} of {n}, room {tile_room}"
                    );
                    if n.div_ceil(tiles_n) <= 2 * shortest {
                        assert_eq!(asked, n, "tiles");
                    } else {
                        assert!(asked >= n.min(tiles_n * 2 * shortest), "tiles: {asked} of {n}");
                    }
                    for (left, what) in [(walk, "walk"), (tiles, "tiles")] {
                        assert_eq!(left.at, lines.at.wrapping_add(64 * (n - left.left)), "{what}");
                    }
                }
            }
        }
    }

    /// `pv_rows` with its V rows in the L2 (f32 groups from `PV_TILES_MIN_ROWS` rows in
    /// register tiles, [`pv_rows_tiles`]) gives exactly what walking the V rows gives, and
    /// both match f64 within a bound: every live row count up to 32 (tiles of 1–6 rows),
    /// rows of 128, 40 and 24 columns (16-column tiles and an 8-column one), 70 and 5 keys
    /// (a chunk and a tail), rescale factors other than 1, and P, V and O rows with room
    /// after each. Both also give the same bits while they ask for a next block's K rows.
    #[test]
    fn decode_values_in_tiles_equal_the_row_walk() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            eprintln!("note: no AVX2+FMA on this machine; decode values not exercised");
            return;
        }
        let val = |i: usize, m: usize| ((i * 37 + m) % 101) as f32 / 50.0 - 1.0;
        let k = vec![0.5f32; 300 * 128];
        for (nk, ncols) in [(70usize, 128usize), (70, 40), (5, 24), (70, 24)] {
            let (ldp, ldv, ldo) = (nk + 3, ncols + 8, ncols + 16);
            let v: Vec<f32> = (0..nk * ldv).map(|i| val(i, 5)).collect();
            for live in 1..=32usize {
                let p: Vec<f32> = (0..live * ldp).map(|i| val(i, 7).abs()).collect();
                let alpha: Vec<f32> = (0..live).map(|r| if r % 3 == 1 { 0.75 } else { 1.0 }).collect();
                let o0: Vec<f32> = (0..live * ldo).map(|i| val(i, 13)).collect();
                // `pv_rows` from `o0`, with V in the L2 or not and a next block to ask for.
                let run = |in_l2: bool, next: Option<AskRows>| {
                    let mut o = o0.clone();
                    let d = Data::F32(&v);
                    // SAFETY: AVX2 and FMA detected above; shapes as `pv_rows` requires.
                    unsafe {
                        pv_rows(
                            (&p, ldp),
                            live,
                            nk,
                            d,
                            ldv,
                            ncols,
                            &mut o,
                            ldo,
                            &alpha,
                            (in_l2, next),
                        )
                    };
                    o
                };
                let (a, b) = (run(false, None), run(true, None));
                // Both again, asking for a next block's K rows (a few lines, and more
                // than they ask for): the same bits.
                let mut asking = vec![];
                for nk1 in [3usize, 300] {
                    let next = AskRows::new(Data::F32(&k), 128, 128, nk1);
                    asking.push(run(false, Some(next)));
                    asking.push(run(true, Some(next)));
                }
                for (i, c) in asking.iter().enumerate() {
                    let same = a.iter().zip(c).all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(
                        same,
                        "nk {nk}, ncols {ncols}, live {live}: asking ({i}) changed the output"
                    );
                }
                for r in 0..live {
                    for c in 0..ldo {
                        let (x, y) = (a[r * ldo + c], b[r * ldo + c]);
                        assert_eq!(
                            x.to_bits(),
                            y.to_bits(),
                            "nk {nk}, ncols {ncols}, live {live}, row {r}, col {c}"
                        );
                        if c >= ncols {
                            assert_eq!(
                                y.to_bits(),
                                o0[r * ldo + c].to_bits(),
                                "column {c} past the row written"
                            );
                            continue;
                        }
                        let (want, mag) = (0..nk).fold(
                            (
                                alpha[r] as f64 * o0[r * ldo + c] as f64,
                                (alpha[r] * o0[r * ldo + c]).abs() as f64,
                            ),
                            |(w, m), j| {
                                let t = p[r * ldp + j] as f64 * v[j * ldv + c] as f64;
                                (w + t, m + t.abs())
                            },
                        );
                        let bound = (nk + 1) as f64 * f64::from(f32::EPSILON) * mag;
                        assert!(
                            (y as f64 - want).abs() <= bound,
                            "row {r} col {c}: {y} against {want}"
                        );
                    }
                }
            }
        }
    }

    /// `qk_dot` on f32 K rows against f64 dot products for every live row count of a
    /// decode group up to 32 (strips of up to 6 rows below `LANES_MIN_ROWS`, strips of up
    /// to 8 rows in the lanes from there and of up to 16 from `LANES16_MIN_ROWS`, alone
    /// and after others), at head sizes that are multiples of 8 (64, 128, 256, 40), over
    /// 70 and 67 keys (tails of 6 and 3 after 64), with K rows that follow each other and
    /// rows 8 elements apart (NaN between them), and score rows with room after each and
    /// without. A strip in the lanes sums each score in one chain of `e` FMAs (the bound
    /// of recursive summation, `e·u` of the magnitudes); the other strips sum 8 lanes and
    /// then the lanes. Nothing outside the live rows' first `nk` scores is written.
    #[test]
    fn decode_scores_match_f64_for_every_strip() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            eprintln!("note: no AVX2+FMA on this machine; decode scores not exercised");
            return;
        }
        let val = |i: usize, m: usize| ((i * 37 + m) % 101) as f32 / 50.0 - 1.0;
        for (nk, e) in [70usize, 67]
            .into_iter()
            .flat_map(|nk| [64usize, 128, 256, 40].map(|e| (nk, e)))
        {
            let kf: Vec<f32> = (0..nk * e).map(|i| val(i, 3)).collect();
            let ldw = e + 8;
            let mut kwide = vec![f32::NAN; nk * ldw];
            for (w, r) in kwide.chunks_exact_mut(ldw).zip(kf.chunks_exact(e)) {
                w[..e].copy_from_slice(r);
            }
            for live in 1..=32usize {
                let rows = live.div_ceil(MR) * MR;
                let lds = if live % 2 == 0 { 80 } else { nk };
                let q: Vec<f32> = (0..rows * e).map(|i| val(i, 11)).collect();
                // Whether row `r` is in a strip in the lanes (see `qk_dot_impl`).
                let in_lanes = |r: usize| {
                    let mut r0 = 0;
                    while live - r0 >= LANES_MIN_ROWS {
                        let n = (live - r0).min(if live - r0 >= LANES16_MIN_ROWS { 16 } else { 8 });
                        if r < r0 + n {
                            return true;
                        }
                        r0 += n;
                    }
                    false
                };
                for (k, ldk) in [(&kf, e), (&kwide, ldw)] {
                    let mut s = vec![f32::NAN; rows * lds];
                    // SAFETY: AVX2 and FMA detected above (F16C only for half rows).
                    unsafe { qk_dot(&q, rows, live, e, Data::F32(k), ldk, nk, &mut s, lds, None) };
                    for (i, x) in s.iter().enumerate() {
                        let (r, j) = (i / lds, i % lds);
                        assert!(
                            r < live && j < nk || x.is_nan(),
                            "row {r} key {j} written (e {e}, live {live}, nk {nk}, ldk {ldk})"
                        );
                    }
                    for r in 0..live {
                        let bound = if in_lanes(r) {
                            e as f64 * f64::from(f32::EPSILON) / 2.0
                        } else {
                            1e-6
                        };
                        for j in 0..nk {
                            let got = s[r * lds + j] as f64;
                            let (qr, kr) = (&q[r * e..(r + 1) * e], &kf[j * e..(j + 1) * e]);
                            let want: f64 = qr.iter().zip(kr).map(|(&a, &b)| a as f64 * b as f64).sum();
                            let mag: f64 = qr
                                .iter()
                                .zip(kr)
                                .map(|(&a, &b)| (a as f64 * b as f64).abs())
                                .sum();
                            assert!(
                                (got - want).abs() <= bound * mag,
                                "row {r} key {j} (e {e}, live {live}, nk {nk}, ldk {ldk}): {got} against {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}
