//! One block of query rows against a key range on the f32 kernels: its rows' visible
//! keys, the online-softmax update, and the normalised or merged (split-K) output.

#[cfg(target_arch = "x86_64")]
use super::super::decode::DECODE_MAX_ROWS_LANES;
use super::*;

/// Unnormalised partial result of one split-K item.
pub(super) struct Partial {
    pub(super) m: Vec<f32>,
    pub(super) l: Vec<f32>,
    pub(super) o: Vec<f32>,
}

impl Partial {
    pub(super) fn from_scratch(p: &Problem, n: usize, sc: &Scratch) -> Self {
        let ev = p.ev;
        let evp = ev.div_ceil(NR) * NR;
        let o_all = sc.o.as_slice();
        let mut o = Vec::with_capacity(n * ev);
        for r in 0..n {
            o.extend_from_slice(&o_all[r * evp..r * evp + ev]);
        }
        Self {
            m: sc.m[..n].to_vec(),
            l: sc.l[..n].to_vec(),
            o,
        }
    }
}

/// Log-sum-exp merge of split-K partials into the output rows.
pub(super) fn merge<T: OutElem>(p: &Problem, blk: &Block, parts: &[Partial], dst: &mut BlockOut<T>) {
    let ev = p.ev;
    let mut row = vec![0f32; ev];
    debug_assert_eq!(blk.n, dst.at.3);
    dst.for_rows(|r, out| {
        let mx = parts.iter().map(|pt| pt.m[r]).fold(f32::NEG_INFINITY, f32::max);
        row.fill(0.0);
        let mut lsum = 0f32;
        if mx > f32::NEG_INFINITY {
            for pt in parts {
                if pt.m[r] == f32::NEG_INFINITY {
                    continue;
                }
                let w = exp2_scalar(pt.m[r] - mx);
                lsum += w * pt.l[r];
                for (o, &x) in row.iter_mut().zip(&pt.o[r * ev..(r + 1) * ev]) {
                    *o += w * x;
                }
            }
        }
        lsum += p.sink_term(blk, r, mx);
        let inv = if lsum > 0.0 { 1.0 / lsum } else { 0.0 };
        for o in row.iter_mut() {
            *o *= inv;
        }
        T::store(out, &row);
    });
}

/// Normalises the block accumulators in `sc` and stores them to `dst` (`n` rows of Ev).
pub(super) fn finish<T: OutElem>(p: &Problem, blk: &Block, sc: &mut Scratch, dst: &mut BlockOut<T>) {
    let ev = p.ev;
    let evp = ev.div_ceil(NR) * NR;
    let o = sc.o.as_slice();
    debug_assert_eq!(blk.n, dst.at.3);
    dst.for_rows(|r, out| {
        let l = sc.l[r] + p.sink_term(blk, r, sc.m[r]);
        let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
        T::store_scaled(out, &o[r * evp..r * evp + ev], inv, &mut sc.row);
    });
}

/// Visible-key bounds of a block's rows: the union `[lo_min, hi_max)` of the rows'
/// ranges, and `max_lo` / `min_hi` (a key block inside `[max_lo, min_hi)` is visible to
/// every row).
pub(super) struct Visible {
    pub(super) lo_min: usize,
    pub(super) hi_max: usize,
    pub(super) max_lo: usize,
    pub(super) min_hi: usize,
}

/// How many rows ahead [`block_rows`] prefetches Q (4 and 8 measured alike on
/// `mha_layer` when its Q rows were 3 KB apart; since its input projections became one
/// product they are 9 KB apart).
pub(super) const Q_AHEAD: usize = 8;

/// Fills `(hh, ii, lo, hi)` (query head, position and visible key range of each of the
/// block's rows), calls `read(r, offset of the row in q)` for each row, and returns the
/// block's [`Visible`] bounds.
pub(super) fn block_rows(
    p: &Problem,
    blk: &Block,
    (hh, ii, lo, hi): (&mut [usize], &mut [usize], &mut [usize], &mut [usize]),
    mut read: impl FnMut(usize, usize),
) -> Visible {
    let (bb, kvh) = (blk.g / p.hkv, blk.g % p.hkv);
    let mut v = Visible {
        lo_min: usize::MAX,
        hi_max: 0,
        max_lo: 0,
        min_hi: usize::MAX,
    };
    for r in 0..blk.n {
        let (hl, i) = ((blk.r0 + r) / p.l, (blk.r0 + r) % p.l);
        let h = kvh * p.group() + hl;
        hh[r] = h;
        ii[r] = i;
        // Rows in other heads or far apart sit on other pages, out of reach of the
        // hardware prefetchers: ask for the row `Q_AHEAD` ahead.
        if r + Q_AHEAD < blk.n {
            let (hl, i) = ((blk.r0 + r + Q_AHEAD) / p.l, (blk.r0 + r + Q_AHEAD) % p.l);
            p.q.prefetch_row(p.q.row_offset(bb, kvh * p.group() + hl, i), p.e);
        }
        read(r, p.q.row_offset(bb, h, i));
        let (a, z) = p.row_range(bb, h, i);
        lo[r] = a;
        hi[r] = z;
        if a < z {
            v.lo_min = v.lo_min.min(a);
            v.hi_max = v.hi_max.max(z);
        }
        v.max_lo = v.max_lo.max(a);
        v.min_hi = v.min_hi.min(z);
    }
    v
}

/// Clears the online-softmax accumulators of `rows` rows: `o = 0`, `m = -inf`, `l = 0`,
/// `alpha = 1`.
pub(super) fn reset_accumulators(
    rows: usize,
    evp: usize,
    (o, m, l, alpha): (&mut AlignedBuf, &mut [f32], &mut [f32], &mut [f32]),
) {
    o.as_mut_slice()[..rows * evp].fill(0.0);
    m[..rows].fill(f32::NEG_INFINITY);
    l[..rows].fill(0.0);
    alpha[..rows].fill(1.0);
}

/// Runs one block against keys `[ks0, ks1)` (multiples of [`BK`], or `ks1 == S`),
/// leaving unnormalised `o`, running max `m` (log2 domain) and sum `l` in the scratch.
pub(super) fn process(p: &Problem, blk: &Block, ks0: usize, ks1: usize, src: KvSrc, sc: &mut Scratch) {
    let (s, e, ev) = (p.s, p.e, p.ev);
    let (bb, kvh) = (blk.g / p.hkv, blk.g % p.hkv);
    let n = blk.n;
    let rows = n.div_ceil(ROW_ALIGN) * ROW_ALIGN;
    let evp = ev.div_ceil(NR) * NR;
    let nvp = evp / NR;
    let kbl = k_block_len(BK, e);
    let vbl = v_pack_len(p);
    // V rows read in place: the operand of keys `j0..` (as `&[f32]`) and the row stride.
    let v_rows = v_rows_in_place(p);
    let v_from = |j0: usize| v_rows.map(|(v, ld)| (&v[p.v.row_offset(bb, kvh, j0)..], ld));
    // Asks for V rows `j0..j0 + nk` read in place, before the block's scores: they come
    // from where the caller left them, not from a pack just written.
    // (Only x86-64 reads V in place; `v_from` is `None` elsewhere.)
    let ask_v = |j0: usize, nk: usize| {
        #[cfg(target_arch = "x86_64")]
        if let Some((vs, ldv)) = v_from(j0) {
            for j in 0..nk {
                prefetch_bytes(vs.as_ptr().wrapping_add(j * ldv) as *const u8, ev * 4);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (j0, nk);
    };
    let isa = p.isa;

    let Scratch {
        q,
        qp,
        s: sbuf,
        o,
        kp,
        vp,
        m,
        l: lsum,
        l16,
        alpha,
        lo,
        hi,
        hh,
        ii,
        tmp,
        ..
    } = sc;

    // The register-tiled score kernels take Q strip-packed, except on AVX-512 and AVX2,
    // whose 6-row tiles broadcast from the row-major rows (`avx512::qk`, `avx2::qk`); the
    // decode kernels take it row-major.
    let strip_q = !matches!(src, KvSrc::Rows) && !matches!(isa, Isa::Avx512 | Isa::Avx2Fma);
    // Decode on AVX-512 reads K/V rows of unit inner stride in place (`raw`), f16/bf16
    // widened in registers; bf16 rows are widened 32 at a time, split into even and odd
    // elements (`avx512::qk_dot_raw`, `avx512::pv_rows`), so Q takes that layout here and
    // the output leaves it at the end (`e > 0`: the split walks Q in rows of `e`).
    #[cfg(target_arch = "x86_64")]
    let raw = matches!(src, KvSrc::Rows)
        && isa == Isa::Avx512
        && e > 0
        && e.is_multiple_of(16)
        && ev.is_multiple_of(16)
        && unit_rows(p);
    // On AVX2, half-precision decode rows are read in place too (`avx2::qk_dot`,
    // `avx2::pv_rows`).
    #[cfg(target_arch = "x86_64")]
    let raw2 = matches!(src, KvSrc::Rows)
        && isa == Isa::Avx2Fma
        && e.is_multiple_of(K_ALIGN)
        && ev.is_multiple_of(V_ALIGN)
        && raw_rows_ok(p);
    // The raw AVX-512 kernels ask for the K/V rows they stream some keys ahead, on the
    // CPUs where that pays (`prefetch::avx512_decode_ahead`).
    #[cfg(target_arch = "x86_64")]
    let ahead = if raw {
        super::super::prefetch::avx512_decode_ahead(p.k.data.elem_bytes())
    } else {
        0
    };
    // (q, k and v share one dtype: `sdpa_impl` checks it.)
    #[cfg(target_arch = "x86_64")]
    let split = raw && matches!(p.k.data, super::super::view::Data::BF16(_));
    // Where bf16 prefill runs its products on AVX512-BF16 register tiles, the scores of
    // bf16 decode groups of `PAIRS_MIN_ROWS` rows or more run on `VDPBF16PS` too
    // (`avx512::qk_dot_pairs`): Q is read unscaled and packed into bf16 pairs, and the
    // scale multiplies the scores instead. Groups of `PAIRS_PV_MIN_ROWS` rows or more
    // also run `P·V` there (`avx512::pv_rows_pairs`), with the probabilities rounded to
    // bf16; its output leaves its interleaved layout at the end.
    #[cfg(target_arch = "x86_64")]
    let pairs = split
        && n >= avx512::PAIRS_MIN_ROWS
        && avx512::pairs_head_size(e)
        && avx512::pairs_head_size(ev)
        && p.amx
            .is_some_and(|pl| pl.unit == super::super::amx::Unit::Avx512Bf16)
        && std::arch::is_x86_feature_detected!("avx512bw");
    #[cfg(not(target_arch = "x86_64"))]
    let pairs = false;
    let q_mul = if pairs { 1.0 } else { p.scale * LOG2_E };
    #[cfg(target_arch = "x86_64")]
    let pairs_pv = pairs && n >= avx512::PAIRS_PV_MIN_ROWS;
    let qb = &mut q.as_mut_slice()[..rows * e];
    let qpm = &mut qp.as_mut_slice()[..rows * e];
    let vis = block_rows(p, blk, (hh, ii, lo, hi), |r, off| {
        let qrow = &mut qb[r * e..(r + 1) * e];
        p.q.read_row(off, qrow, q_mul);
        if strip_q {
            // Strip-packed copy `[r / MR][x][r % MR]` for the register-tiled kernel.
            let strip = &mut qpm[(r / MR) * MR * e..(r / MR + 1) * MR * e];
            for (d, &x) in strip.chunks_exact_mut(MR).zip(qrow.iter()) {
                d[r % MR] = x;
            }
        }
    });
    let Visible {
        lo_min,
        hi_max,
        max_lo,
        min_hi,
    } = vis;
    // The decode kernels (`KvSrc::Rows`) read Q and write the output for the live rows
    // only, so only the other kernels need the padding rows cleared.
    let cleared = if matches!(src, KvSrc::Rows) { n } else { rows };
    qb[n * e..cleared * e].fill(0.0);
    if strip_q {
        for r in n..rows {
            let strip = &mut qpm[(r / MR) * MR * e..(r / MR + 1) * MR * e];
            for d in strip.chunks_exact_mut(MR) {
                d[r % MR] = 0.0;
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    if pairs {
        // SAFETY: `pairs` needs the AVX512-BF16 plan, set only where the CPU has it.
        unsafe { avx512::pack_bf16_rows(&mut qb[..n * e], e) };
    } else if split {
        for row in qb.chunks_exact_mut(e) {
            avx512::split_pairs(row);
        }
    }
    reset_accumulators(cleared, evp, (o, m, lsum, alpha));
    // The AVX-512 softmax keeps each row's sum in 16 lanes (`l16`), which are added
    // into `lsum` after the last key block.
    let lanes = isa == Isa::Avx512;
    if lanes {
        l16[..n * 16].fill(0.0);
    }

    let klo = lo_min.max(ks0);
    let khi = hi_max.min(ks1).min(s);
    if klo >= khi {
        return;
    }
    let qb = &q.as_slice()[..rows * e];
    // Q for the register-tiled score kernels (strip-packed or row-major, as above).
    let qpk = if strip_q { &qp.as_slice()[..rows * e] } else { qb };
    let kend = khi.div_ceil(BK);
    let mut kb = klo / BK;
    // Keys per block, and the row stride of its scores: decode on K/V rows read in place
    // (`raw`: AVX-512; `raw2`: half precision on AVX2; f32 rows of unit inner stride on
    // AVX2, which `rows_f32` borrows) takes blocks of up to 128 KiB of K rows
    // (`decode_block_keys`), so that it switches between the K and V streams less often;
    // everything else takes `BK` (`rows_f32` converts other rows into a buffer of `BK`).
    #[cfg(target_arch = "x86_64")]
    let borrowed2 = matches!(src, KvSrc::Rows)
        && isa == Isa::Avx2Fma
        && super::super::decode::borrows_rows(&p.k, e, K_ALIGN)
        && super::super::decode::borrows_rows(&p.v, ev, V_ALIGN);
    // (At most as many keys as the score buffer holds for these rows: a group of more
    // than `DECODE_MAX_ROWS` rows of 64 f32 elements would want 512.)
    #[cfg(target_arch = "x86_64")]
    let step = if raw || raw2 || borrowed2 {
        super::super::decode::decode_block_keys(e.max(ev) * p.k.data.elem_bytes())
            .min(sbuf.as_slice().len() / rows / BK * BK)
    } else {
        BK
    };
    #[cfg(not(target_arch = "x86_64"))]
    let step = BK;
    while kb < kend {
        let j0 = kb * BK;
        // (`kend·BK − j0 ≥ BK`, so blocks of `BK` keys end where they did.)
        let nk = step.min(s - j0).min(kend * BK - j0);
        let npanels = nk.div_ceil(NR);
        let sb = sbuf.as_mut_slice();
        let need_causal = p.bounded() && !(max_lo <= j0 && min_hi >= j0 + nk);
        // Two blocks at once on AVX-512 when both are wholly visible and the output rows
        // are long (Ev ≥ 128): one softmax update and one pass over the output per 2·BK
        // keys (`avx512::pv_pair`). Measured, alternating binaries: 2–3% faster on
        // `enc1k_d128` and `gpt2k_causal_d128`. With Ev = 64 it was mixed (1.5% faster on
        // `gpt1k_causal`, none on `enc512`, 4% slower on `bert_pad`), so it stays off.
        #[cfg(target_arch = "x86_64")]
        if let KvSrc::Packed(grp) = src {
            let nk2 = (2 * BK).min(s - j0);
            let pair = isa == Isa::Avx512
                && evp >= 128
                && kb + 1 < kend
                && !(p.bounded() && !(max_lo <= j0 && min_hi >= j0 + nk2));
            if pair {
                ask_v(j0, nk2);
                let lds = 2 * BK;
                let (b0, b1) = (kb * (kbl + vbl), (kb + 1) * (kbl + vbl));
                let (k0, k1) = (&grp[b0..b0 + kbl], &grp[b1..b1 + kbl]);
                if p.mask.is_none() && p.softcap.is_none() && nk2 == 2 * BK {
                    // Both blocks full and no explicit mask: each goes through the
                    // softmax in registers, then block 0's probabilities are brought to
                    // block 1's reference (rows whose reference moved, rare with the lazy
                    // rescale) and the two rescale factors multiply.
                    let mut a0 = [0f32; BQ];
                    // SAFETY: `Isa::Avx512` only reaches here after `is_supported()`.
                    unsafe {
                        avx512::qk_softmax(qpk, (rows, n), e, k0, sb, lds, (&mut *m, &mut *l16, &mut *alpha))
                    };
                    a0[..n].copy_from_slice(&alpha[..n]);
                    // SAFETY: as above.
                    unsafe {
                        avx512::qk_softmax(
                            qpk,
                            (rows, n),
                            e,
                            k1,
                            &mut sb[BK..],
                            lds,
                            (&mut *m, &mut *l16, &mut *alpha),
                        )
                    };
                    for r in 0..n {
                        if alpha[r] != 1.0 {
                            sb[r * lds..r * lds + BK].iter_mut().for_each(|x| *x *= alpha[r]);
                        }
                        alpha[r] *= a0[r];
                    }
                } else {
                    isa.qk(qpk, rows, e, k0, BK / NR, sb, lds);
                    isa.qk(qpk, rows, e, k1, (nk2 - BK).div_ceil(NR), &mut sb[BK..], lds);
                    let rows_of = RowsOf { bb, hh, ii, lo, hi };
                    online_rows(p, &rows_of, (sb, lds, n), (j0, nk2, false), (m, lsum, l16, alpha));
                }
                let (v0, v1, vps, ldv) = match (v_from(j0), v_from(j0 + BK)) {
                    (Some((v0, ldv)), Some((v1, _))) => (v0, v1, NR, ldv),
                    _ => (
                        &grp[b0 + kbl..b0 + kbl + vbl],
                        &grp[b1 + kbl..b1 + kbl + vbl],
                        BK * NR,
                        NR,
                    ),
                };
                // SAFETY: `Isa::Avx512` only reaches here after `is_supported()`.
                unsafe {
                    avx512::pv_pair(
                        sb,
                        rows,
                        (v0, BK),
                        (v1, nk2 - BK),
                        (vps, ldv),
                        nvp,
                        o.as_mut_slice(),
                        evp,
                        alpha,
                    )
                };
                kb += 2;
                continue;
            }
        }
        // On causal edge blocks, each 6-row strip only needs keys below its largest
        // `hi`: trim the QK panels and the PV key count per strip.
        let nstrips = rows / MR;
        let mut snk = [nk; BQ.div_ceil(MR)];
        let mut trimmed = false;
        if need_causal && !matches!(src, KvSrc::Rows) {
            for (st, v) in snk.iter_mut().enumerate().take(nstrips) {
                let h = (st * MR..((st + 1) * MR).min(n))
                    .map(|r| hi[r])
                    .max()
                    .unwrap_or(0);
                *v = h.saturating_sub(j0).min(nk);
                trimmed |= *v < nk;
            }
        }
        // A full, wholly visible block with no explicit mask: its scores go through the
        // softmax in registers (`avx512::qk_softmax`, `avx2::qk_softmax`), so
        // `online_rows` is skipped below.
        let whole = cfg!(target_arch = "x86_64")
            && p.mask.is_none()
            && p.softcap.is_none()
            && !need_causal
            && nk == BK
            && matches!(src, KvSrc::Packed(_) | KvSrc::Stream);
        let fused = whole && isa == Isa::Avx512;
        let fused2 = whole && isa == Isa::Avx2Fma;
        // `FnMut` only on x86-64, where the fused branches update `m`, the sums and
        // `alpha`.
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
        let mut qk = |kps: &[f32], sb: &mut [f32]| {
            #[cfg(target_arch = "x86_64")]
            if fused {
                // SAFETY: `Isa::Avx512` only reaches here after `is_supported()`.
                return unsafe {
                    avx512::qk_softmax(qpk, (rows, n), e, kps, sb, BK, (&mut *m, &mut *l16, &mut *alpha))
                };
            }
            #[cfg(target_arch = "x86_64")]
            if fused2 {
                // SAFETY: `Isa::Avx2Fma` only reaches here after `is_supported()`.
                return unsafe {
                    avx2::qk_softmax(qpk, (rows, n), e, kps, sb, BK, (&mut *m, &mut *lsum, &mut *alpha))
                };
            }
            if trimmed {
                for (st, &k) in snk.iter().enumerate().take(nstrips) {
                    if k > 0 {
                        let qs = &qpk[st * MR * e..(st + 1) * MR * e];
                        isa.qk(qs, MR, e, kps, k.div_ceil(NR), &mut sb[st * MR * BK..], BK);
                    }
                }
            } else {
                isa.qk(qpk, rows, e, kps, npanels, sb, BK);
            }
        };
        // Half-precision decode on AVX-512 reads K/V rows straight from the source and
        // widens them in registers; `raw_v` is then the V operand.
        #[allow(unused_mut)] // only assigned on x86-64
        let mut raw_v: Option<super::super::view::Data> = None;
        // Whether the score kernel asked for this block's V rows into the L2 (decode of
        // f32 rows on AVX2 and AVX-512), so that `P·V` finds them there (on AVX2 it may
        // then take register tiles) and asks for the next block's K rows (`next_k`).
        let mut v_asked = false;
        // (V operand, V panel stride, V row stride)
        let (vsl, vps, ldv): (&[f32], usize, usize) = match src {
            #[cfg(target_arch = "x86_64")]
            KvSrc::Rows if raw || raw2 => {
                let (kd, ldk) = rows_raw(&p.k, bb, kvh, j0, nk, e);
                let (vd, ldv) = rows_raw(&p.v, bb, kvh, j0, nk, ev);
                if pairs {
                    let c = p.scale * LOG2_E;
                    // SAFETY: as at `pack_bf16_rows` above.
                    unsafe { avx512::qk_dot_pairs(qb, rows, n, e, kd, (ldk, nk, c), sb, step) };
                } else if raw {
                    let keys = match ahead {
                        0 => avx512::Ahead::Off,
                        d => avx512::Ahead::Keys(d),
                    };
                    // (Its first strip may ask for the V rows into the L2 as it scores;
                    // `avx512::pv_rows` reads them the same way either way.)
                    let v = Some((vd, ldv, ev));
                    // SAFETY: `Isa::Avx512` only reaches here after `is_supported()`.
                    v_asked = unsafe { avx512::qk_dot_raw(qb, rows, n, e, kd, (ldk, nk, keys), sb, step, v) };
                } else {
                    // SAFETY: `Isa::Avx2Fma` only reaches here after `is_supported()`.
                    unsafe { avx2::qk_dot(qb, rows, n, e, kd, ldk, nk, sb, step, None) };
                }
                raw_v = Some(vd);
                (&[][..], NR, ldv)
            }
            KvSrc::Packed(grp) => {
                let base = kb * (kbl + vbl);
                ask_v(j0, nk);
                qk(&grp[base..base + kbl], sb);
                match v_from(j0) {
                    Some((vs, ldv)) => (vs, NR, ldv),
                    None => (&grp[base + kbl..base + kbl + vbl], BK * NR, NR),
                }
            }
            // (`PackedAmx` only reaches here through a bug in `run_block`; packing the
            // f32 block on the fly is still correct.)
            #[cfg(target_arch = "x86_64")]
            KvSrc::PackedAmx(_) => {
                pack_k(isa, &p.k, bb, kvh, j0, nk, e, kp.as_mut_slice(), tmp);
                pack_v(&p.v, bb, kvh, j0, nk, BK, ev, vp.as_mut_slice(), tmp);
                qk(kp.as_slice(), sb);
                (vp.as_slice(), BK * NR, NR)
            }
            KvSrc::Stream => {
                pack_k(isa, &p.k, bb, kvh, j0, nk, e, kp.as_mut_slice(), tmp);
                // Asks for the next block's K rows, so that its pack finds them in cache
                // rather than waiting on memory with the FMA units idle (kernel notes,
                // "Decode groups of 12 to 48 rows").
                let j1 = j0 + nk;
                for j in j1..(j1 + BK).min(khi) {
                    p.k.prefetch_row(p.k.row_offset(bb, kvh, j), e);
                }
                // V rows are read in place where they can be, as on `Packed`.
                let v_in_place = v_from(j0);
                if v_in_place.is_some() {
                    ask_v(j0, nk);
                } else {
                    pack_v(&p.v, bb, kvh, j0, nk, BK, ev, vp.as_mut_slice(), tmp);
                }
                qk(kp.as_slice(), sb);
                match v_in_place {
                    Some((vs, ldv)) => (vs, NR, ldv),
                    None => (vp.as_slice(), BK * NR, NR),
                }
            }
            KvSrc::Rows => {
                let (ks, ldk) = rows_f32(&p.k, bb, kvh, j0, nk, e, K_ALIGN, kp.as_mut_slice());
                let (vs, ldv) = rows_f32(&p.v, bb, kvh, j0, nk, ev, V_ALIGN, vp.as_mut_slice());
                // (On AVX2 the score strips ask for the V rows into the L2 while they
                // score: `avx2::qk_dot`, `avx2::pv_rows`.)
                v_asked = isa.qk_dot(qb, rows, n, e, ks, ldk, nk, sb, step, Some((vs, ldv, ev)));
                (vs, NR, ldv)
            }
        };
        if !fused && !fused2 {
            let rows_of = RowsOf { bb, hh, ii, lo, hi };
            online_rows(
                p,
                &rows_of,
                (sb, step, n),
                (j0, nk, need_causal),
                (m, lsum, l16, alpha),
            );
        }
        let o = o.as_mut_slice();
        // Where the scores asked for this block's V rows (f32 K rows read in place),
        // `P·V` asks for the next block's K rows (`avx512::pv_rows`, `avx2::pv_rows`).
        #[cfg(target_arch = "x86_64")]
        let next_k = {
            let j1 = j0 + nk;
            (v_asked && (raw || borrowed2) && j1 < khi).then(|| {
                let nk1 = step.min(khi - j1);
                let (kd1, ldk1) = rows_raw(&p.k, bb, kvh, j1, nk1, e);
                super::super::prefetch::AskRows::new(kd1, ldk1, e, nk1)
            })
        };
        if trimmed {
            for (st, &k) in snk.iter().enumerate().take(nstrips) {
                if k > 0 {
                    let (r0, sbs) = (st * MR, &sb[st * MR * BK..]);
                    isa.pv(
                        sbs,
                        MR,
                        MR,
                        k,
                        vsl,
                        vps,
                        ldv,
                        nvp,
                        &mut o[r0 * evp..],
                        evp,
                        &alpha[r0..],
                    );
                }
            }
        } else if let Some(vd) = raw_v {
            #[cfg(target_arch = "x86_64")]
            if pairs_pv {
                // SAFETY: as at `pack_bf16_rows` above (and AVX512BW, checked there).
                unsafe { avx512::pv_rows_pairs((sb, step), n, nk, vd, (ldv, ev), o, evp, alpha) };
            } else if raw {
                // SAFETY: `raw` is only set on the `Isa::Avx512` path.
                unsafe { avx512::pv_rows((sb, step), n, nk, vd, (ldv, nvp, ahead), o, evp, alpha, next_k) };
            } else {
                // SAFETY: `raw2` is only set on the `Isa::Avx2Fma` path.
                unsafe { avx2::pv_rows((sb, step), n, nk, vd, ldv, evp, o, evp, alpha, (false, None)) };
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = vd;
        } else if cfg!(target_arch = "x86_64") && isa == Isa::Avx2Fma && matches!(src, KvSrc::Rows) {
            // Decode on AVX2 walks each streamed V row to its end (`avx2::pv_rows`), or
            // runs register tiles over the rows the scores asked for (`v_asked`); either
            // asks for `next_k`.
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Isa::Avx2Fma` only reaches here after `is_supported()`.
            unsafe {
                avx2::pv_rows(
                    (sb, step),
                    n,
                    nk,
                    super::super::view::Data::F32(vsl),
                    ldv,
                    evp,
                    o,
                    evp,
                    alpha,
                    (v_asked, next_k),
                )
            };
        } else if cfg!(target_arch = "x86_64") && isa == Isa::Avx512 && matches!(src, KvSrc::Rows) {
            // Decode on AVX-512 walks each streamed V row to its end (`avx512::pv_rows`).
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Isa::Avx512` only reaches here after `is_supported()`.
            unsafe {
                avx512::pv_rows(
                    (sb, step),
                    n,
                    nk,
                    super::super::view::Data::F32(vsl),
                    (ldv, nvp, 0),
                    o,
                    evp,
                    alpha,
                    None,
                )
            };
        } else if matches!(src, KvSrc::Rows) {
            // Decode on the portable and NEON kernels: the live rows only, each V row
            // walked to its end (`portable::pv_rows`).
            super::super::portable::pv_rows(sb, n, nk, vsl, ldv, evp, o, evp, alpha);
        } else {
            isa.pv(sb, rows, n, nk, vsl, vps, ldv, nvp, o, evp, alpha);
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = v_asked; // (no kernel here asks for V rows)
        kb += nk.div_ceil(BK);
    }
    if lanes {
        for (l, lanes) in lsum[..n].iter_mut().zip(l16.chunks_exact(16)) {
            *l = lanes.iter().sum();
        }
    }
    #[cfg(target_arch = "x86_64")]
    if pairs_pv {
        for row in o.as_mut_slice().chunks_exact_mut(evp).take(n) {
            avx512::merge_unpacked(row, ev / 32);
        }
    } else if split {
        for row in o.as_mut_slice().chunks_exact_mut(evp).take(n) {
            avx512::merge_pairs(row, nvp / 2);
        }
    }
}

/// Batch, and per row head, position and visible key range `[lo, hi)`, of a block's rows.
pub(super) struct RowsOf<'a> {
    pub(super) bb: usize,
    pub(super) hh: &'a [usize],
    pub(super) ii: &'a [usize],
    pub(super) lo: &'a [usize],
    pub(super) hi: &'a [usize],
}

/// The online-softmax update of the first `n` score rows of `sb` (row stride `lds`)
/// for the `nk` keys from `j0`: adds the explicit mask, turns each row's visible part
/// into probabilities (0 elsewhere; with `causal`, the visible part is the row's
/// `[lo, hi)`, else all `nk` keys) and updates `m`, the row sums and `alpha`: on AVX-512
/// the sums are `l16`'s 16 lane-wise partial sums per row (see `process`), elsewhere
/// `lsum`. A row with no visible key is all 0, with `m` and its sums unchanged.
pub(super) fn online_rows(
    p: &Problem,
    rows: &RowsOf,
    (sb, lds, n): (&mut [f32], usize, usize),
    (j0, nk, causal): (usize, usize, bool),
    (m, lsum, l16, alpha): (&mut [f32], &mut [f32], &mut [f32], &mut [f32]),
) {
    let range = |r: usize| {
        if causal {
            let z = rows.hi[r].saturating_sub(j0).min(nk);
            (rows.lo[r].saturating_sub(j0).min(z), z)
        } else {
            (0, nk)
        }
    };
    if let Some(c) = p.softcap {
        // Before the mask, as in Gemma 2.
        for r in 0..n {
            let (a, z) = range(r);
            softcap::cap_scores(p.isa, &mut sb[r * lds + a..r * lds + z], c);
        }
    }
    if let Some(mk) = &p.mask {
        for r in 0..n {
            let (a, z) = range(r);
            let vis = &mut sb[r * lds + a..r * lds + z];
            mk.add_row(rows.bb, rows.hh[r], rows.ii[r], j0 + a, vis, LOG2_E);
        }
    }
    // Only the AVX-512 softmax keeps lane-wise sums.
    #[cfg(not(target_arch = "x86_64"))]
    let _ = &l16;

    // AVX-512: all rows in one call, each kept in registers, rescaled lazily
    // (`avx512::online_rows_lazy`), up to two key blocks per call. AVX2: all rows of one
    // block in one call, each read into registers (`avx2::online_rows_block`). Measured,
    // alternating binaries: see `NOTES.md`.
    #[cfg(target_arch = "x86_64")]
    if matches!(p.isa, Isa::Avx512 | Isa::Avx2Fma) {
        let wide = p.isa == Isa::Avx512;
        // Keys per call; callers pass one key block, a pair of them (AVX-512), or a
        // decode block of up to `DECODE_BK_MAX` keys.
        let per = if wide { 2 * BK } else { BK };
        let most = super::super::decode::DECODE_BK_MAX;
        assert!(nk <= most, "{nk} keys: at most {most} per softmax update");
        assert!(
            n <= m.len()
                && n <= lsum.len()
                && (!wide || 16 * n <= l16.len())
                && n <= alpha.len()
                && (n == 0 || sb.len() >= (n - 1) * lds + nk)
        );
        let len = sb.len();
        let sp = sb.as_mut_ptr();
        // The update of keys `c0..c0 + c` (`c ≤ per`), the rows' ranges taken relative to
        // `c0`. On AVX-512 only the 16-key chunks that hold keys are computed: a block's
        // tail (5 keys of ViT's 197) takes one chunk, not four.
        // SAFETY (of each call): the instruction set is only selected after detecting it
        // (AVX-512F and DQ; AVX2 and FMA); the bounds of `sb`, `m`, the sums and `alpha`
        // are asserted above (and `online_rows_block` asserts its own), and each call's
        // keys lie in `0..nk`, as do its rows' ranges.
        let update =
            |c0: usize, c: usize, (m, lsum, l16, alpha): (&mut [f32], &mut [f32], &mut [f32], &mut [f32])| {
                let sub = |r: usize| {
                    let (a, z) = range(r);
                    (a.clamp(c0, c0 + c) - c0, z.clamp(c0, c0 + c) - c0)
                };
                if !wide {
                    // `sb` from `c0` on, written only through this slice during the call.
                    let s = unsafe { std::slice::from_raw_parts_mut(sp.add(c0), len - c0) };
                    return unsafe { avx2::online_rows_block(s, (lds, n, c), sub, (m, lsum, alpha)) };
                }
                let sp = sp.wrapping_add(c0);
                macro_rules! lazy {
                    ($nc:literal) => {
                        unsafe { avx512::online_rows_lazy::<$nc>(sp, (lds, n, c), sub, (m, l16, alpha)) }
                    };
                }
                match c.div_ceil(16) {
                    0 | 1 => lazy!(1),
                    2 => lazy!(2),
                    3 => lazy!(3),
                    4 => lazy!(4),
                    5 => lazy!(5),
                    6 => lazy!(6),
                    7 => lazy!(7),
                    _ => lazy!(8),
                }
            };
        if nk <= per {
            update(0, nk, (m, lsum, l16, alpha));
            return;
        }
        // A decode block of more keys: updates of `per` keys, one after the other. Where
        // a later one moves a row's reference (`alpha ≠ 1`, rare once the row has seen
        // keys), the probabilities the earlier ones wrote are brought to it, and the
        // row's `alpha` is the product of the updates' (its sums were rescaled by each).
        assert!(
            n <= DECODE_MAX_ROWS_LANES,
            "{n} rows: a decode block has at most {DECODE_MAX_ROWS_LANES}"
        );
        let mut total = [1f32; DECODE_MAX_ROWS_LANES];
        let mut c0 = 0;
        while c0 < nk {
            let c = per.min(nk - c0);
            update(c0, c, (&mut *m, &mut *lsum, &mut *l16, &mut *alpha));
            for (r, (t, &a)) in total.iter_mut().zip(alpha.iter()).enumerate().take(n) {
                if a != 1.0 && c0 > 0 {
                    for j in 0..c0 {
                        // SAFETY: `r < n` and `j < c0 < nk`, inside `sb` (asserted above);
                        // written through `sp`, as the updates write.
                        unsafe { *sp.add(r * lds + j) *= a };
                    }
                }
                *t *= a;
            }
            c0 += c;
        }
        alpha[..n].copy_from_slice(&total[..n]);
        return;
    }
    for r in 0..n {
        let row = &mut sb[r * lds..r * lds + nk];
        let (a, z) = range(r);
        let (m_new, al, sum) = p.isa.online_row(&mut row[a..z], m[r]);
        alpha[r] = al;
        if m_new == f32::NEG_INFINITY {
            row.fill(0.0);
            continue;
        }
        row[..a].fill(0.0);
        row[z..].fill(0.0);
        lsum[r] = lsum[r] * al + sum;
        m[r] = m_new;
    }
}

/// The f32 V rows that the AVX-512 prefill (`KvSrc::Packed` and `KvSrc::Stream`)
/// reads in place instead of packing them:
/// `Some((storage, row stride))` when V is f32 with unit inner stride and `Ev` is a
/// non-zero multiple of 16, so that each key's row holds whole 16-lane panels. The
/// `P·V` tiles then load adjacent panels of one row per key (the 6×64 tiles in
/// `avx512::rows_loop_6x4_in_rows`) instead of one row of each packed panel; the
/// products and their order are the same, so the output is too.
pub(super) fn v_rows_in_place<'a>(p: &Problem<'a>) -> Option<(&'a [f32], usize)> {
    match p.v.data {
        super::super::view::Data::F32(v)
            if cfg!(target_arch = "x86_64")
                && p.isa == Isa::Avx512
                && p.v.strides[3] == 1
                && p.ev > 0
                && p.ev.is_multiple_of(NR) =>
        {
            Some((v, p.v.strides[2]))
        }
        _ => None,
    }
}

/// Floats of one packed V block of the f32 prefill: none when V is read in place
/// ([`v_rows_in_place`]).
pub(super) fn v_pack_len(p: &Problem) -> usize {
    if v_rows_in_place(p).is_some() {
        0
    } else {
        v_block_len(BK, p.ev)
    }
}

/// Whether the K and V rows have unit inner strides, so that the decode kernels can read
/// them in place.
#[cfg(target_arch = "x86_64")]
pub(super) fn unit_rows(p: &Problem) -> bool {
    p.k.strides[3] == 1 && p.v.strides[3] == 1
}

/// Whether the AVX2 decode kernels read K and V rows in place: half precision (f32 rows
/// are borrowed in place by `rows_f32` and take the same kernels) with unit inner strides.
#[cfg(target_arch = "x86_64")]
pub(super) fn raw_rows_ok(p: &Problem) -> bool {
    !matches!(p.k.data, super::super::view::Data::F32(_)) && unit_rows(p)
}

/// Rows `j0 .. j0 + nk` of `(b, kvh)` in place, as `(elements from the first row, row
/// stride)`; `width` elements per row, unit inner stride.
#[cfg(target_arch = "x86_64")]
pub(super) fn rows_raw<'a>(
    src: &View<'a>,
    b: usize,
    kvh: usize,
    j0: usize,
    nk: usize,
    width: usize,
) -> (super::super::view::Data<'a>, usize) {
    use super::super::view::Data;
    let start = src.row_offset(b, kvh, j0);
    let ld = src.strides[2];
    let end = start + nk.saturating_sub(1) * ld + width;
    let d = match src.data {
        Data::F32(v) => Data::F32(&v[start..end]),
        Data::F16(v) => Data::F16(&v[start..end]),
        Data::BF16(v) => Data::BF16(&v[start..end]),
    };
    (d, ld)
}
