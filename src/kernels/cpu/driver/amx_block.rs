//! One block with both block products on bf16 pair products: AMX tiles or AVX512-BF16
//! registers (`amx::Plan`).

use super::block::{block_rows, reset_accumulators, Visible};
use super::*;

/// Key blocks per AMX super-block: scores, softmax and the `P·V` accumulation run over
/// up to `AMX_GROUP × BK` = 256 keys at once, so the output tiles are loaded and stored
/// once per 256 keys.
#[cfg(target_arch = "x86_64")]
pub(super) const AMX_GROUP: usize = 4;
/// Keys per AMX super-block (the row stride of its probability buffer).
#[cfg(target_arch = "x86_64")]
pub(super) const SBK: usize = AMX_GROUP * BK;
/// Row stride of the AMX super-block's score buffer, in floats: [`SBK`] and one more
/// cache line. With rows 1 KiB apart, the 16 rows of a tile store fall in 4 of the 64
/// L1 sets of a 48 KiB 12-way cache; 1088 bytes apart, in 16. On the Intel Xeon VM
/// (one thread, the two strides alternating call by call) bf16 `gpt1k_causal` took 5–6%
/// less time, `enc512` 0.4–4% less and `enc1k_d128` the same within 2% (kernel notes).
#[cfg(target_arch = "x86_64")]
const SLD: usize = SBK + 16;

/// [`process`] with both block products on AMX tiles (see `amx`): leaves the same
/// unnormalised `o`, `m` (log2 domain) and `l` in the scratch.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub(super) fn process_amx(
    p: &Problem,
    plan: amx::Plan,
    blk: &Block,
    ks0: usize,
    ks1: usize,
    packed: Option<&[u16]>,
    sc: &mut Scratch,
) {
    use vnni::TM;
    let (s, e, ev) = (p.s, p.e, p.ev);
    let (bb, kvh) = (blk.g / p.hkv, blk.g % p.hkv);
    let n = blk.n;
    let rtiles = n.div_ceil(TM);
    let rows = rtiles * TM;
    let ep = vnni::e_pad(e);
    let evp = ev.div_ceil(NR) * NR;
    let nvp = evp / NR;
    let comps = plan.comps;
    let (kbl, vbl) = (vnni::k_len(e, comps), vnni::v_len(ev, comps));
    let (kcs, vcs) = (kbl / comps, vbl / comps);
    let c = p.scale * LOG2_E;

    let Scratch {
        o,
        m,
        l: lsum,
        alpha,
        lo,
        hi,
        hh,
        ii,
        tmp,
        amx_bufs: ab,
        ..
    } = sc;
    let qcs = rows * ep;
    let pcs = rows * SBK;
    ab.qa.grow(comps * BQ * ep);
    ab.pa.grow(plan.p_comps * BQ * SBK);
    ab.s.grow(BQ * SLD);
    ab.l16.grow(BQ * 16);
    ab.l16[..rows * 16].fill(0.0);
    if packed.is_none() {
        ab.ka.grow(AMX_GROUP * kbl);
        ab.va.grow(AMX_GROUP * vbl);
        ab.rows.grow(comps * BK * ep.max(evp));
    }

    // bf16 Q whose rows are the AMX operand as they are (one component, unit inner
    // stride, E a multiple of the tile depth, the block inside one head): its whole
    // 16-row tiles are loaded from the source, and only a last partial tile is copied.
    use super::super::view::Data;
    let q_src: Option<(*const u16, usize)> = match p.q.data {
        Data::BF16(d)
            if comps == 1
                && p.q.strides[3] == 1
                && e == ep
                && n >= TM
                && blk.r0 / p.l == (blk.r0 + n - 1) / p.l =>
        {
            let (hl, i0) = (blk.r0 / p.l, blk.r0 % p.l);
            let off = p.q.row_offset(bb, kvh * p.group() + hl, i0);
            let ld = p.q.strides[2];
            // The first and last element of the in-place tiles lie in `d`.
            let last = off + ((n / TM) * TM - 1) * ld + e;
            (last <= d.len()).then(|| (d[off..].as_ptr() as *const u16, ld))
        }
        _ => None,
    };
    let full_tiles = if q_src.is_some() { n / TM } else { 0 };
    let qa = ab.qa.as_mut_ptr();
    let vis = block_rows(p, blk, (hh, ii, lo, hi), |r, off| {
        if r < full_tiles * TM {
            return;
        }
        // SAFETY: `p.amx` is only set after `amx::available()` or
        // `dpbf16::available()`; row `r` of each component holds `ep` elements of `ab.qa`.
        unsafe {
            let lo = if comps > 1 {
                qa.add(qcs + r * ep)
            } else {
                std::ptr::null_mut()
            };
            vnni::row_components(&p.q, off, e, comps, ep, qa.add(r * ep), lo, tmp);
        }
    });
    let Visible {
        lo_min,
        hi_max,
        max_lo,
        min_hi,
    } = vis;
    reset_accumulators(rows, evp, (o, m, lsum, alpha));

    let klo = lo_min.max(ks0);
    let khi = hi_max.min(ks1).min(s);
    if klo >= khi {
        return;
    }
    // SAFETY: as above.
    unsafe { plan.begin() };
    let kb_end = khi.div_ceil(BK);
    let mut kb0 = klo / BK;
    while kb0 < kb_end {
        let nb = (kb_end - kb0).min(AMX_GROUP);
        let j0 = kb0 * BK;
        let nks = (nb * BK).min(s - j0);
        let mut kbs = [std::ptr::null::<u16>(); AMX_GROUP];
        let mut vbs = [std::ptr::null::<u16>(); AMX_GROUP];
        for bi in 0..nb {
            let kb = kb0 + bi;
            match packed {
                Some(grp) => {
                    let base = kb * (kbl + vbl);
                    kbs[bi] = grp[base..base + kbl].as_ptr();
                    vbs[bi] = grp[base + kbl..base + kbl + vbl].as_ptr();
                }
                None => {
                    let nk = BK.min(s - kb * BK);
                    let (kd, vd) = (
                        &mut ab.ka[bi * kbl..(bi + 1) * kbl],
                        &mut ab.va[bi * vbl..(bi + 1) * vbl],
                    );
                    // SAFETY: as above; the buffers were sized for `AMX_GROUP` blocks.
                    unsafe {
                        vnni::pack_k(&p.k, bb, kvh, kb * BK, nk, e, comps, kd, &mut ab.rows, tmp);
                        vnni::pack_v(&p.v, bb, kvh, kb * BK, nk, ev, comps, vd, &mut ab.rows, tmp);
                    }
                    kbs[bi] = ab.ka[bi * kbl..].as_ptr();
                    vbs[bi] = ab.va[bi * vbl..].as_ptr();
                }
            }
        }
        let sb = ab.s.as_mut_ptr();
        let need_causal = p.bounded() && !(max_lo <= j0 && min_hi >= j0 + nks);
        // Keys each 16-row tile needs from this super-block: all `nks`, or on causal
        // edges and key-padding bounds up to its rows' last visible key. A tile's scores
        // stop at the 16-key panel and its `P·V` at the 32-key depth tile that holds
        // that key. The scores it skips are outside every row's visible range, so the
        // softmax never reads them and writes zero probabilities there, which `P·V`
        // may then skip as well.
        let mut need = [nks; BQ.div_ceil(TM)];
        if need_causal {
            for (t, v) in need.iter_mut().enumerate().take(rtiles) {
                let h = (t * TM..((t + 1) * TM).min(n)).map(|r| hi[r]).max().unwrap_or(0);
                *v = h.saturating_sub(j0).min(nks);
            }
        }
        // Key blocks that tile `t` needs, and 16-key panels of block `bi` that it needs.
        let tile_nb = need.map(|v| v.div_ceil(BK));
        let tile_panels = |t: usize, bi: usize| need[t].saturating_sub(bi * BK).min(BK).div_ceil(NR);
        // Score panels computed for tile `t`: the larger count of its pair of row tiles,
        // so that `amx::qk` keeps two row tiles per K tile on causal diagonals.
        let panels =
            |t: usize, bi: usize| tile_panels(t & !1, bi).max(tile_panels((t | 1).min(rtiles - 1), bi));
        for (bi, &kbp) in kbs.iter().enumerate().take(nb) {
            // Runs of consecutive row tiles that need the same panels of block `bi`.
            let mut t0 = 0;
            while t0 < rtiles {
                let np = panels(t0, bi);
                if np == 0 {
                    t0 += 1;
                    continue;
                }
                let mut t1 = t0 + 1;
                while t1 < rtiles && panels(t1, bi) == np {
                    t1 += 1;
                }
                // Tiles `t0..mid` from the source, `mid..t1` from the copy.
                let mid = t1.min(full_tiles).max(t0);
                // SAFETY: `configure` ran on this thread. Tiles below `full_tiles` are
                // whole source rows of stride `ld` (bounds checked with `q_src`); the
                // copy holds `rtiles` tiles of every component (tiles `t0..t1` from row
                // `t0·TM`); each K block holds `kbl` elements, the score buffer
                // `rows × SLD` floats.
                unsafe {
                    if let (Some((qs, ld)), true) = (q_src, mid > t0) {
                        let q0 = qs.add(t0 * TM * ld);
                        let s0 = sb.add(t0 * TM * SLD + bi * BK);
                        plan.qk(q0, 0, (mid - t0, ld), e, (kbp, np), kcs, s0, SLD);
                    }
                    if t1 > mid {
                        let q0 = ab.qa.as_ptr().add(mid * TM * ep);
                        let s0 = sb.add(mid * TM * SLD + bi * BK);
                        plan.qk(q0, qcs, (t1 - mid, ep), e, (kbp, np), kcs, s0, SLD);
                    }
                };
                t0 = t1;
            }
        }
        let ov = o.as_mut_slice();
        let pa = ab.pa.as_mut_ptr();
        for r in 0..n {
            let row = &mut ab.s[r * SLD..r * SLD + nb * BK];
            let (a, z) = if need_causal {
                let z = hi[r].saturating_sub(j0).min(nks);
                (lo[r].saturating_sub(j0).min(z), z)
            } else {
                (0, nks)
            };
            let mut cr = c;
            if let Some(cap) = p.softcap {
                // Before the mask, as in Gemma 2 (`block::online_rows`), on the scores in
                // the log2 domain.
                let vis = &mut row[a..z];
                vis.iter_mut().for_each(|x| *x *= c);
                softcap::cap_scores(p.isa, vis, cap);
                cr = 1.0;
            }
            if let Some(mk) = &p.mask {
                mk.scale_add_row(bb, hh[r], ii[r], j0 + a, &mut row[a..z], cr, LOG2_E);
                cr = 1.0;
            }
            // SAFETY: `p.amx` is only set after `amx::available()` or `dpbf16::available()`
            // (both include AVX-512F and AVX512-BF16); the row holds `nb·BK` floats and row `r` of both
            // P components `SBK` elements of `ab.pa` (`lo` is null with one component).
            let (m_new, al) = unsafe {
                let lo_p = if plan.p_comps > 1 {
                    pa.add(pcs + r * SBK)
                } else {
                    std::ptr::null_mut()
                };
                let l16: &mut [f32; 16] = (&mut ab.l16[r * 16..(r + 1) * 16]).try_into().expect("16 floats");
                avx512::softmax_row_bf16(row, (a, z), cr, m[r], (pa.add(r * SBK), lo_p), l16)
            };
            if m_new != f32::NEG_INFINITY {
                m[r] = m_new;
                if al != 1.0 {
                    for x in &mut ov[r * evp..(r + 1) * evp] {
                        *x *= al;
                    }
                }
            }
        }
        // Runs of consecutive row tiles that need the same leading blocks, and the same
        // depth tiles of the last of them.
        let last_nt = |t: usize| (need[t] - (tile_nb[t] - 1) * BK).div_ceil(vnni::TK);
        let mut t0 = 0;
        while t0 < rtiles {
            let k = tile_nb[t0];
            let mut t1 = t0 + 1;
            while t1 < rtiles && tile_nb[t1] == k && (k == 0 || last_nt(t1) == last_nt(t0)) {
                t1 += 1;
            }
            if k > 0 {
                // SAFETY: as for `qk`; P holds `rtiles` tiles of both components with row
                // stride `SBK` (tiles `t0..t1` from row `t0·TM`), each V block `vbl`
                // elements, O `rows × evp` floats.
                unsafe {
                    plan.pv(
                        ab.pa.as_ptr().add(t0 * TM * SBK),
                        pcs,
                        SBK,
                        t1 - t0,
                        (&vbs[..k], last_nt(t0)),
                        vcs,
                        nvp,
                        ov.as_mut_ptr().add(t0 * TM * evp),
                        evp,
                    )
                };
            }
            t0 = t1;
        }
        kb0 += nb;
    }
    // SAFETY: as above.
    unsafe { plan.end() };
    for (r, l) in lsum.iter_mut().enumerate().take(n) {
        *l = ab.l16[r * 16..(r + 1) * 16].iter().sum();
    }
}
