//! bf16 decode products on `VDPBF16PS` (AVX512-BF16): each instruction multiplies 32
//! bf16 elements by 32 others, exactly, and adds the products to 16 f32 sums in pairs.
//! The scores take 32 elements of a K row against the same elements of a Q row, where
//! widening them to f32 costs two FMAs and two widening operations
//! ([`super::qk_dot_raw`]); `P·V` takes two keys' probabilities against their two V rows
//! interleaved.
//!
//! A GQA group's decode multiplies each K/V row by every query row of the group, so it
//! does several FMAs per element read and can run slower than memory. On the Zen 4 VM
//! (in-process probe, whole calls, rate new/old; kernel notes), with both threads:
//! groups of 4 rows 1.03–1.08 with K/V from DRAM (1.08 at E = 64, 1.10 at 256) and
//! 1.17–1.20 from L3; 8 rows 1.27; 16 rows (4 queries) 1.44. Groups of 3 rows or fewer
//! ran 0.93–1.01 from DRAM (1.09–1.16 from L3), so they kept the widening kernels, and
//! interleaving the V rows cost more than the products saved below 8 rows. Since the
//! decode blocks hold 128 KiB of K rows (`decode::decode_block_keys`), groups of 3 rows
//! take the scores here and groups of 4 the `P·V` too ([`PAIRS_MIN_ROWS`],
//! [`PAIRS_PV_MIN_ROWS`]; kernel notes).

use super::super::decode::{DECODE_BK_MAX, DECODE_MAX_ROWS};
use super::*;

/// Fewest live rows in a decode group whose bf16 scores go through [`qk_dot_pairs`].
/// With the long decode blocks, 3 rows against the widening kernels (Zen 4 VM, both
/// threads, in-process probe, geometric mean of the two orders): 1.04 with K/V from DRAM
/// (`1,24,8,1,16384,128`) and 1.23 from L3 (`1,24,8,1,4096,128`); 2 rows 1.02.
pub(in crate::kernels::cpu) const PAIRS_MIN_ROWS: usize = 3;

/// Fewest live rows in a decode group whose bf16 `P·V` goes through [`pv_rows_pairs`].
/// With 64-key blocks, against the scores alone: 1.04–1.17 with 8 or 16 rows and
/// 0.70–0.96 with 2–4. With the long decode blocks (as above): 4 rows 1.00–1.02 from
/// DRAM and 1.17 from L3 (`decode_gqa`'s shape, two runs), 6 rows 1.12.
pub(in crate::kernels::cpu) const PAIRS_PV_MIN_ROWS: usize = 4;

/// Whether [`qk_dot_pairs`] takes rows of `e` elements: the head sizes with register
/// strips.
pub(in crate::kernels::cpu) fn pairs_head_size(e: usize) -> bool {
    matches!(e, 64 | 128 | 256)
}

/// Packs each row of `e` exact bf16 values held as f32 (`q`, rows of `e`) into bf16
/// pairs, in place: row `r`'s elements `2i` and `2i + 1` become the low and high halves
/// of the 32-bit slot `r·e + i`, the layout that [`qk_dot_pairs`] reads. The other half
/// of each row is left as it was. `e` must be a multiple of 32.
///
/// # Safety
/// AVX-512F and AVX512-BF16 must be available.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(in crate::kernels::cpu) unsafe fn pack_bf16_rows(q: &mut [f32], e: usize) {
    assert!(e.is_multiple_of(32) && q.len().is_multiple_of(e.max(1)));
    for row in q.chunks_exact_mut(e) {
        let p = row.as_mut_ptr();
        for i in 0..e / 32 {
            // Chunk `i` is read before its packed form overwrites slots `16i..16i + 16`,
            // which chunks `0..=i` have already been read from.
            let (lo, hi) = (
                _mm512_loadu_ps(p.add(32 * i)),
                _mm512_loadu_ps(p.add(32 * i + 16)),
            );
            let packed = _mm512_cvtne2ps_pbh(hi, lo);
            _mm512_storeu_ps(p.add(16 * i), std::mem::transmute::<__m512bh, __m512>(packed));
        }
    }
}

/// Decode scores `S = c · Q·Kᵀ` of bf16 rows: Q row `r` packed by [`pack_bf16_rows`] at
/// `q[r·e..]`, K row `j` at element `j·ldk` of `k` (bf16, read in place), `s` with row
/// stride `lds`. Each K row is read once per strip of up to 8 rows, in key order to its
/// end, as in [`super::qk_dot_raw`]; 16 keys' sums are reduced together and scaled by
/// `c` as they are stored. Padding rows (`live..rows`) get zero scores.
///
/// The products are exact and summed in f32 (`VDPBF16PS` rounds each sum to nearest
/// even, and flushes subnormal inputs and sums to zero).
///
/// # Safety
/// AVX-512F and AVX512-BF16 must be available.
#[allow(clippy::too_many_arguments)]
pub(in crate::kernels::cpu) unsafe fn qk_dot_pairs(
    q: &[f32],
    rows: usize,
    live: usize,
    e: usize,
    k: Data,
    (ldk, nk, c): (usize, usize, f32),
    s: &mut [f32],
    lds: usize,
) {
    let Data::BF16(kd) = k else {
        panic!("qk_dot_pairs takes bf16 keys")
    };
    assert!(pairs_head_size(e) && rows.is_multiple_of(MR) && live <= rows && q.len() >= rows * e);
    assert!(lds >= nk && (nk == 0 || kd.len() >= (nk - 1) * ldk + e));
    assert!(rows == 0 || s.len() >= (rows - 1) * lds + nk);
    let (qp, kp, sp) = (q.as_ptr(), kd.as_ptr() as *const u16, s.as_mut_ptr());
    let mut r0 = 0;
    while r0 < live {
        let r = (live - r0).min(8);
        let args = (qp.add(r0 * e), e, kp, ldk, nk, c, sp.add(r0 * lds), lds);
        // SAFETY: bounds asserted above; features guaranteed by the caller.
        unsafe {
            match (e, r) {
                (64, 1) => pairs_strip::<1, 1, 2>(args),
                (64, 2) => pairs_strip::<2, 2, 2>(args),
                (64, 3) => pairs_strip::<3, 3, 2>(args),
                (64, 4) => pairs_strip::<4, 4, 2>(args),
                (64, 5) => pairs_strip::<5, 5, 2>(args),
                (64, 6) => pairs_strip::<6, 6, 2>(args),
                (64, 7) => pairs_strip::<7, 7, 2>(args),
                (64, _) => pairs_strip::<8, 8, 2>(args),
                (128, 1) => pairs_strip::<1, 1, 4>(args),
                (128, 2) => pairs_strip::<2, 2, 4>(args),
                (128, 3) => pairs_strip::<3, 3, 4>(args),
                (128, 4) => pairs_strip::<4, 4, 4>(args),
                (128, 5) => pairs_strip::<5, 4, 4>(args),
                (128, 6) => pairs_strip::<6, 4, 4>(args),
                (128, 7) => pairs_strip::<7, 4, 4>(args),
                (128, _) => pairs_strip::<8, 4, 4>(args),
                (_, 1) => pairs_strip::<1, 1, 8>(args),
                (_, 2) => pairs_strip::<2, 2, 8>(args),
                (_, 3) => pairs_strip::<3, 2, 8>(args),
                (_, 4) => pairs_strip::<4, 2, 8>(args),
                (_, 5) => pairs_strip::<5, 2, 8>(args),
                (_, 6) => pairs_strip::<6, 2, 8>(args),
                (_, 7) => pairs_strip::<7, 2, 8>(args),
                (_, _) => pairs_strip::<8, 2, 8>(args),
            }
        }
        r0 += r;
    }
    for r in live..rows {
        s[r * lds..r * lds + nk].fill(0.0);
    }
}

/// `(Q strip rows, Q row stride, K base, K row stride, key count, scale, score rows, score
/// row stride)`.
type PairArgs = (*const f32, usize, *const u16, usize, usize, f32, *mut f32, usize);

/// [`qk_dot_pairs`] for `R` rows of `32·EP` elements, the first `QR` rows' Q held in
/// registers (`QR·EP ≤ 16` vectors), the others read from L1 by their instructions.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn pairs_strip<const R: usize, const QR: usize, const EP: usize>(
    (qs, ldq, k, ldk, nk, c, s, lds): PairArgs,
) {
    debug_assert!(QR <= R && QR * EP <= 16);
    let mut qv = [[_mm512_setzero_ps(); EP]; QR];
    for (r, row) in qv.iter_mut().enumerate() {
        for (i, x) in row.iter_mut().enumerate() {
            *x = _mm512_loadu_ps(qs.add(r * ldq + 16 * i));
        }
    }
    let cv = _mm512_set1_ps(c);
    // Sums of 16 keys per row (at a tail, the lanes past `cnt` reduce stale sums from
    // the previous 16 keys, which the masked store drops).
    let mut part = [[_mm512_setzero_ps(); 16]; R];
    let mut j = 0;
    while j < nk {
        let cnt = (nk - j).min(16);
        for c in 0..cnt {
            let kr = k.add((j + c) * ldk);
            let mut acc = [_mm512_setzero_ps(); R];
            // (`i` is the K row's 32-element panel and the Q rows' register column.)
            #[allow(clippy::needless_range_loop)]
            for i in 0..EP {
                let kv = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                    kr.add(32 * i) as *const __m512i
                ));
                for (r, a) in acc.iter_mut().enumerate() {
                    let x = if r < QR {
                        qv[r][i]
                    } else {
                        _mm512_loadu_ps(qs.add(r * ldq + 16 * i))
                    };
                    *a = _mm512_dpbf16_ps(*a, std::mem::transmute::<__m512, __m512bh>(x), kv);
                }
            }
            for (p, a) in part.iter_mut().zip(acc) {
                p[c] = a;
            }
        }
        for (r, p) in part.iter().enumerate() {
            _mm512_mask_storeu_ps(
                s.add(r * lds + j),
                tail_mask_full(cnt),
                _mm512_mul_ps(super::decode::reduce16(*p), cv),
            );
        }
        j += 16;
    }
}

/// Decode `O = α·O + P·V` for the first `live` rows with bf16 V rows on `VDPBF16PS`:
/// the probabilities (`p`, row stride `ldp`, `nk ≤ DECODE_BK_MAX` keys) are rounded to bf16, as
/// PyTorch rounds them before its bf16 `P·V` product and as this crate's bf16 prefill
/// does, and multiply pairs of V rows exactly, summed in f32. V row `j` at element
/// `j·ldv` of `v` (bf16, read in place), `ev` columns (see [`pairs_head_size`]); `o` with
/// row stride `ldo`, whose rows `alpha` scales first.
///
/// Each 32 columns of a pair of V rows are interleaved element by element
/// (`vpunpcklwd`/`vpunpckhwd`) within each 128-bit lane, so the output columns come out
/// permuted within each group of 32: the caller applies [`merge_unpacked`] once all keys
/// are in. Tiles span whole V rows (up to 4 rows at `ev` = 64, 2 at 128, 1 at 256), so a
/// block's V rows are read from memory by the first tile and from cache by the others,
/// in key order.
///
/// # Safety
/// AVX-512F, AVX512BW and AVX512-BF16 must be available.
#[allow(clippy::too_many_arguments)]
pub(in crate::kernels::cpu) unsafe fn pv_rows_pairs(
    (p, ldp): (&[f32], usize),
    live: usize,
    nk: usize,
    v: Data,
    (ldv, ev): (usize, usize),
    o: &mut [f32],
    ldo: usize,
    alpha: &[f32],
) {
    let Data::BF16(vd) = v else {
        panic!("pv_rows_pairs takes bf16 values")
    };
    assert!(pairs_head_size(ev) && DECODE_BK_MAX >= nk && ldp >= nk && live <= DECODE_MAX_ROWS);
    assert!(alpha.len() >= live && (live == 0 || p.len() >= (live - 1) * ldp + nk));
    assert!(nk == 0 || vd.len() >= (nk - 1) * ldv + ev);
    assert!(live == 0 || (ldo >= ev && o.len() >= (live - 1) * ldo + ev));
    // Each live row's probabilities as bf16 pairs (keys `2t` and `2t + 1` in the low and
    // high halves of `pp[r·ldpp + t]`, rows of 16 pairs per 32 keys); a missing last key of
    // an odd count is 0. Left uninitialised: the loop below writes every pair the tiles
    // read (`t < ⌈nk / 2⌉ ≤ ldpp`), and a decode block of 512 keys would otherwise clear
    // 24 KB per call.
    let ldpp = nk.div_ceil(32) * 16;
    let mut pp = std::mem::MaybeUninit::<[u32; DECODE_MAX_ROWS * DECODE_BK_MAX / 2]>::uninit();
    let pw = pp.as_mut_ptr() as *mut u32;
    for r in 0..live {
        for c in 0..nk.div_ceil(32) {
            let at = p.as_ptr().add(r * ldp + 32 * c);
            let (m0, m1) = (
                tail_mask_full(nk.saturating_sub(32 * c)),
                tail_mask_full(nk.saturating_sub(32 * c + 16)),
            );
            let (lo, hi) = (
                _mm512_maskz_loadu_ps(m0, at),
                _mm512_maskz_loadu_ps(m1, at.add(16)),
            );
            let packed = _mm512_cvtne2ps_pbh(hi, lo);
            _mm512_storeu_si512(
                pw.add(r * ldpp + 16 * c) as *mut __m512i,
                std::mem::transmute::<__m512bh, __m512i>(packed),
            );
        }
    }
    let (vp, op, al, ppp) = (
        vd.as_ptr() as *const u16,
        o.as_mut_ptr(),
        alpha.as_ptr(),
        pw as *const u32,
    );
    let args = |r0: usize| {
        (
            (ppp.add(r0 * ldpp), ldpp),
            vp,
            ldv,
            nk,
            op.add(r0 * ldo),
            ldo,
            al.add(r0),
        )
    };
    // Tiles of 4 rows × 64 columns, 2 × 128 or 1 × 256 (at most 16 accumulators).
    let mut r0 = 0;
    while r0 < live {
        let rem = live - r0;
        // SAFETY: bounds asserted above; features guaranteed by the caller.
        r0 += unsafe {
            match (ev, rem) {
                (64, 1) => pairs_pv_tile::<1, 2>(args(r0)),
                (64, 2) => pairs_pv_tile::<2, 2>(args(r0)),
                (64, 3) => pairs_pv_tile::<3, 2>(args(r0)),
                (64, _) => pairs_pv_tile::<4, 2>(args(r0)),
                (128, 1) => pairs_pv_tile::<1, 4>(args(r0)),
                (128, _) => pairs_pv_tile::<2, 4>(args(r0)),
                _ => pairs_pv_tile::<1, 8>(args(r0)),
            }
        };
    }
}

/// `((P pairs of the tile's first row, their row stride), V, V row stride, key count, the
/// tile's first output row, output row stride, alpha of the tile's first row)`.
type PvPairArgs = (
    (*const u32, usize),
    *const u16,
    usize,
    usize,
    *mut f32,
    usize,
    *const f32,
);

/// [`pv_rows_pairs`] for a tile of `R` rows × `CH` groups of 32 columns; returns `R`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pairs_pv_tile<const R: usize, const CH: usize>(
    ((pp, ldpp), v, ldv, nk, o, ldo, al): PvPairArgs,
) -> usize {
    let mut acc = [[_mm512_setzero_ps(); 16]; R];
    for (r, ar) in acc.iter_mut().enumerate() {
        let a = _mm512_set1_ps(*al.add(r));
        for (x, ax) in ar.iter_mut().enumerate().take(2 * CH) {
            *ax = _mm512_mul_ps(a, _mm512_loadu_ps(o.add(r * ldo + 16 * x)));
        }
    }
    let mut t = 0;
    while 2 * t < nk {
        let (r0, r1) = (v.add(2 * t * ldv), v.add((2 * t + 1) * ldv));
        let two = 2 * t + 1 < nk;
        let pr: [__m512bh; R] = std::array::from_fn(|r| {
            std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(*pp.add(r * ldpp + t) as i32))
        });
        for ch in 0..CH {
            let a = _mm512_loadu_si512(r0.add(32 * ch) as *const __m512i);
            let b = if two {
                _mm512_loadu_si512(r1.add(32 * ch) as *const __m512i)
            } else {
                _mm512_setzero_si512()
            };
            let lo = std::mem::transmute::<__m512i, __m512bh>(_mm512_unpacklo_epi16(a, b));
            let hi = std::mem::transmute::<__m512i, __m512bh>(_mm512_unpackhi_epi16(a, b));
            for (ar, &p) in acc.iter_mut().zip(&pr) {
                ar[2 * ch] = _mm512_dpbf16_ps(ar[2 * ch], p, lo);
                ar[2 * ch + 1] = _mm512_dpbf16_ps(ar[2 * ch + 1], p, hi);
            }
        }
        t += 1;
    }
    for (r, ar) in acc.iter().enumerate() {
        for (x, &ax) in ar.iter().enumerate().take(2 * CH) {
            _mm512_storeu_ps(o.add(r * ldo + 16 * x), ax);
        }
    }
    R
}

/// Puts the first `groups` 32-column groups of an output row of [`pv_rows_pairs`] in
/// column order: within each group, value `i < 16` of the first half holds column
/// `8·(i / 4) + i % 4` and value `i` of the second half column `8·(i / 4) + 4 + i % 4`
/// (the element order of `vpunpcklwd` and `vpunpckhwd`, lane by 128-bit lane).
pub(in crate::kernels::cpu) fn merge_unpacked(row: &mut [f32], groups: usize) {
    for g in row.chunks_exact_mut(32).take(groups) {
        let mut t = [0f32; 32];
        for (i, &x) in g.iter().enumerate() {
            let j = i % 16;
            t[(j / 4) * 8 + (i / 16) * 4 + j % 4] = x;
        }
        g.copy_from_slice(&t);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `qk_dot_pairs` against `c ·` f64 dot products of the same bf16 values, for every
    /// live row count of a decode group (1..=24: every strip and dispatch arm, Q rows in
    /// registers and read from L1) at each head size it takes, over 70 keys (a tail of 6
    /// after 64), with K rows further apart than their length; padding rows must get
    /// zero scores. `pack_bf16_rows` packs the Q rows in place first.
    #[test]
    fn pair_scores_match_f64_for_every_strip() {
        if !super::super::super::dpbf16::available() {
            eprintln!("note: no AVX512-BF16 on this machine; bf16 pair scores not exercised");
            return;
        }
        let (nk, lds, c) = (70usize, 80usize, 0.7f32);
        let val = |i: usize, m: usize| half::bf16::from_f32(((i * 37 + m) % 101) as f32 / 50.0 - 1.0);
        for e in [64usize, 128, 256] {
            let ldk = e + 32;
            let kb: Vec<half::bf16> = (0..nk * ldk).map(|i| val(i, 3)).collect();
            for live in 1..=24usize {
                let rows = live.div_ceil(MR) * MR;
                let qb: Vec<half::bf16> = (0..rows * e).map(|i| val(i, 11)).collect();
                let mut q: Vec<f32> = qb.iter().map(|x| x.to_f32()).collect();
                // SAFETY: AVX512-BF16 (and AVX-512F) detected above.
                unsafe { pack_bf16_rows(&mut q, e) };
                let mut s = vec![f32::NAN; rows * lds];
                // SAFETY: as above.
                unsafe { qk_dot_pairs(&q, rows, live, e, Data::BF16(&kb), (ldk, nk, c), &mut s, lds) };
                for r in 0..rows {
                    for j in 0..nk {
                        let got = s[r * lds + j] as f64;
                        if r >= live {
                            assert_eq!(got, 0.0, "padding row {r} key {j} (e {e}, live {live})");
                            continue;
                        }
                        let (qr, kr) = (&qb[r * e..(r + 1) * e], &kb[j * ldk..j * ldk + e]);
                        let dot: f64 = qr.iter().zip(kr).map(|(a, b)| a.to_f64() * b.to_f64()).sum();
                        let mag: f64 = qr
                            .iter()
                            .zip(kr)
                            .map(|(a, b)| (a.to_f64() * b.to_f64()).abs())
                            .sum();
                        let want = c as f64 * dot;
                        assert!(
                            (got - want).abs() <= 1e-6 * c as f64 * mag,
                            "row {r} key {j} (e {e}, live {live}): {got} against {want}"
                        );
                    }
                }
            }
        }
    }

    /// `pv_rows_pairs` then `merge_unpacked` against `α·O + P·V` in f64 (the starting `O`
    /// in the kernel's layout) with each probability rounded to bf16 first, for every
    /// live row count (1..=24: every tile shape), each head size it takes, odd and even
    /// key counts up to a whole decode block (`DECODE_BK_MAX`; the missing last key of an
    /// odd count adds nothing, even where that V row is infinite), rows of P and of V
    /// further apart than their length and output rows longer than `ev`; the columns past
    /// `ev` must stay as they were.
    #[test]
    fn pair_values_match_f64_for_every_tile() {
        if !super::super::super::dpbf16::available() || !is_x86_feature_detected!("avx512bw") {
            eprintln!("note: no AVX512-BF16 or AVX512BW on this machine; bf16 pair values not exercised");
            return;
        }
        let val = |i: usize, m: usize| ((i * 37 + m) % 101) as f32 / 50.0 - 1.0;
        for ev in [64usize, 128, 256] {
            let (ldv, ldo) = (ev + 32, ev + 16);
            // Scores of a long decode block: up to `DECODE_BK_MAX` keys, rows `ldp` apart.
            let ldp = DECODE_BK_MAX + 3;
            for nk in [1usize, 37, 64, 201, DECODE_BK_MAX] {
                // One V row past the keys, all infinite: a pair read past `nk` would show.
                let mut vf: Vec<f32> = (0..(nk + 1) * ldv).map(|i| val(i, 5)).collect();
                vf[nk * ldv..].fill(f32::INFINITY);
                let vb: Vec<half::bf16> = vf.iter().map(|&x| half::bf16::from_f32(x)).collect();
                for live in 1..=24usize {
                    let p: Vec<f32> = (0..live * ldp).map(|i| val(i, 7).abs() * 1.37).collect();
                    let alpha: Vec<f32> = (0..live).map(|r| 0.5 + r as f32 / 16.0).collect();
                    let o0: Vec<f32> = (0..live * ldo).map(|i| val(i, 13)).collect();
                    let mut o = o0.clone();
                    // SAFETY: AVX512-BF16, AVX512BW (and AVX-512F) detected above.
                    unsafe {
                        pv_rows_pairs(
                            (&p, ldp),
                            live,
                            nk,
                            Data::BF16(&vb[..nk * ldv]),
                            (ldv, ev),
                            &mut o,
                            ldo,
                            &alpha,
                        )
                    };
                    for row in o.chunks_exact_mut(ldo) {
                        merge_unpacked(row, ev / 32);
                    }
                    // The output the kernel started from is in its layout too.
                    let mut om = o0.clone();
                    for row in om.chunks_exact_mut(ldo) {
                        merge_unpacked(row, ev / 32);
                    }
                    for r in 0..live {
                        for c in 0..ldo {
                            let got = o[r * ldo + c] as f64;
                            if c >= ev {
                                assert_eq!(got, o0[r * ldo + c] as f64, "row {r} column {c} past ev {ev}");
                                continue;
                            }
                            let terms = (0..nk).map(|j| {
                                half::bf16::from_f32(p[r * ldp + j]).to_f64() * vb[j * ldv + c].to_f64()
                            });
                            let o_in = om[r * ldo + c] as f64;
                            let mag: f64 = terms.clone().map(f64::abs).sum::<f64>() + o_in.abs();
                            let want = alpha[r] as f64 * o_in + terms.sum::<f64>();
                            assert!(
                                (got - want).abs() <= 1e-6 * mag,
                                "row {r} column {c} (ev {ev}, nk {nk}, live {live}): {got} against {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}
