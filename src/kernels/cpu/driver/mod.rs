//! The tiled online-softmax driver: the problem, its work decomposition into row blocks
//! and key ranges, and their scheduling on the threads ([`run`]). One block runs in
//! [`block`] (f32 kernels) or `amx_block` (bf16 pair products), the prefill path's
//! pipelined K/V packs in [`prefill`](mod@prefill), and [`scratch`] keeps the per-thread
//! buffers.

use super::aligned::{AVec, AlignedBuf};
use super::causal::Causal;
use super::decode::{decode_max_rows, rows_f32, K_ALIGN, V_ALIGN};
use super::exp::exp2_scalar;
use super::isa::Isa;
use super::pack::{k_block_len, pack_k, pack_v, v_block_len};
#[cfg(target_arch = "x86_64")]
use super::prefetch::prefetch_bytes;
use super::store::OutElem;
use super::tiles::{BK, MR, NR};
use super::view::{MaskView, View};
#[cfg(target_arch = "x86_64")]
use super::{amx, avx2, avx512, vnni};
use super::{par, softcap};
use std::cell::RefCell;
use std::f32::consts::LOG2_E;
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

#[cfg(target_arch = "x86_64")]
mod amx_block;
mod block;
mod prefill;
mod scratch;

#[cfg(target_arch = "x86_64")]
use amx_block::process_amx;
use block::{finish, merge, process, Partial};
use prefill::prefill;
use scratch::{with_scratch, Cached, PackCache, Scratch};

/// Maximum query rows per block (a multiple of [`ROW_ALIGN`]).
pub(crate) const BQ: usize = 144;
/// Row padding of a block (the micro-kernels' register tile height).
pub(crate) const ROW_ALIGN: usize = MR;
/// Upper bound on the K/V pack kept alive at once (at least one (batch, kv head)).
pub(crate) const PACK_BUDGET_BYTES: usize = 32 << 20;
/// Smallest key range handed to one split-K work item.
const MIN_SPLIT_KEYS: usize = 512;

/// A validated attention problem (see [`super::sdpa`]).
pub(crate) struct Problem<'a> {
    pub q: View<'a>,
    pub k: View<'a>,
    pub v: View<'a>,
    pub mask: Option<MaskView<'a>>,
    pub causal: Option<Causal>,
    /// Visible keys `[a, z)` of each `(batch, query head)`, indexed `b · hq + h`: a
    /// key-padding mask applied by loop bounds (see [`MaskView::key_runs`]), with `mask`
    /// then `None`. Intersected with the causal range.
    pub keys: Option<Vec<(usize, usize)>>,
    pub scale: f32,
    pub isa: Isa,
    pub b: usize,
    pub hq: usize,
    pub hkv: usize,
    pub l: usize,
    pub s: usize,
    pub e: usize,
    pub ev: usize,
    /// Bytes of K/V pack kept alive at once ([`PACK_BUDGET_BYTES`]; tests shrink it).
    pub pack_budget: usize,
    /// Write the output as `(B, L, Hq, Ev)` row-major instead of `(B, Hq, L, Ev)`.
    pub heads_inner: bool,
    /// Attention-sink logits, one per query head, in the log2 domain of the scores
    /// (`sink · log2 e`): each adds `2^(sink − m)` to its rows' softmax sums.
    pub sinks: Option<Vec<f32>>,
    /// Soft-cap of the scores in the log2 domain (`cap · log2 e`; see `softcap`).
    pub softcap: Option<f32>,
    /// Run the block products on AMX tiles with this component plan (bf16/f16 inputs on
    /// a machine with AMX); `None` runs them on `isa`.
    #[cfg(target_arch = "x86_64")]
    pub amx: Option<amx::Plan>,
}

impl Problem<'_> {
    fn group(&self) -> usize {
        self.hq / self.hkv
    }

    /// The sink's share `2^(sink − m)` of the softmax sum of row `r` of `blk`, whose
    /// scores are relative to `m` (0 without sinks, and for a row with no visible key).
    fn sink_term(&self, blk: &Block, r: usize, m: f32) -> f32 {
        match &self.sinks {
            Some(sk) if m > f32::NEG_INFINITY => {
                // Rows are the group's (query head, position) pairs, head-major.
                let h = (blk.g % self.hkv) * self.group() + (blk.r0 + r) / self.l;
                exp2_scalar(sk[h] - m)
            }
            _ => 0.0,
        }
    }

    /// Whether rows may see less than all keys by loop bounds (causal, window or
    /// key-padding runs), so blocks not wholly visible to all their rows need per-row
    /// bounds.
    fn bounded(&self) -> bool {
        self.causal.is_some() || self.keys.is_some()
    }

    /// Visible key range `[lo, hi)` of query position `i` of batch `b`, query head `h`.
    fn row_range(&self, b: usize, h: usize, i: usize) -> (usize, usize) {
        let run = self.keys.as_ref().map(|k| k[b * self.hq + h]);
        clip(self.causal_range(i), run)
    }

    /// Calls `f(lo, hi)` with the [`Problem::row_range`] of each row of `blk`, in order
    /// (one division per head the block spans, not per row).
    fn block_ranges(&self, blk: &Block, mut f: impl FnMut(usize, usize)) {
        let (bb, kvh) = (blk.g / self.hkv, blk.g % self.hkv);
        let (mut r, end) = (blk.r0, blk.r0 + blk.n);
        while r < end {
            let (hl, i0) = (r / self.l, r % self.l);
            let run = (self.l - i0).min(end - r);
            let keys = self
                .keys
                .as_ref()
                .map(|k| k[bb * self.hq + kvh * self.group() + hl]);
            for i in i0..i0 + run {
                let (lo, hi) = clip(self.causal_range(i), keys);
                f(lo, hi)
            }
            r += run;
        }
    }

    /// Visible key range of query position `i` under the causal bounds alone.
    fn causal_range(&self, i: usize) -> (usize, usize) {
        let s = self.s;
        match self.causal {
            None => (0, s),
            Some(c) => {
                // In i128, so that no offset or window overflows.
                let clamp = |x: i128| x.clamp(0, s as i128) as usize;
                let top = i as i128 + c.offset as i128 + 1;
                let hi = clamp(top);
                let lo = match c.window {
                    None => 0,
                    Some(w) => clamp(top - w as i128),
                };
                (lo.min(hi), hi)
            }
        }
    }
}

/// `[lo, hi)` intersected with the key run `[a, z)` when there is one (an empty range
/// stays empty: `lo ≤ hi`).
fn clip((lo, hi): (usize, usize), run: Option<(usize, usize)>) -> (usize, usize) {
    match run {
        None => (lo, hi),
        Some((a, z)) => {
            let hi = hi.min(z);
            (lo.max(a).min(hi), hi)
        }
    }
}

/// One block of query rows of a (batch, kv head) group; rows are the group's
/// `(h_local, i)` pairs flattened head-major, so a block is a contiguous output range.
#[derive(Clone, Copy)]
struct Block {
    g: usize,
    r0: usize,
    n: usize,
}

/// A schedulable unit: a block against the key range `[ks0, ks1)`.
#[derive(Clone, Copy)]
struct Item {
    blk: usize,
    ks0: usize,
    ks1: usize,
    cost: usize,
}

/// Where a work item gets its K/V blocks from.
#[derive(Clone, Copy)]
enum KvSrc<'a> {
    /// The group's pre-packed K/V (`[kb][K block | V block]`).
    Packed(&'a [f32]),
    /// Packed on the fly, block by block (V read in place instead where
    /// [`block::v_rows_in_place`] allows, as with `Packed`).
    Stream,
    /// Row-major rows straight from the source (decode path).
    Rows,
    /// The group's pre-packed AMX operands (`[kb][K block | V block]`, bf16 bits).
    #[cfg(target_arch = "x86_64")]
    PackedAmx(&'a [u16]),
}

/// Runs one block on the AMX path where the problem asks for it, else on `p.isa`.
fn run_block(p: &Problem, blk: &Block, ks0: usize, ks1: usize, src: KvSrc, sc: &mut Scratch) {
    #[cfg(target_arch = "x86_64")]
    if let Some(plan) = p.amx {
        match src {
            KvSrc::PackedAmx(grp) => return process_amx(p, plan, blk, ks0, ks1, Some(grp), sc),
            KvSrc::Stream => return process_amx(p, plan, blk, ks0, ks1, None, sc),
            _ => {}
        }
    }
    process(p, blk, ks0, ks1, src, sc)
}

/// Splits `len` rows starting at `start` into balanced chunks of at most [`BQ`] rows.
fn split_rows(start: usize, len: usize, out: &mut Vec<(usize, usize)>) {
    if len == 0 {
        return;
    }
    let nb = len.div_ceil(BQ);
    let size = len.div_ceil(nb).div_ceil(ROW_ALIGN) * ROW_ALIGN;
    let mut r = 0;
    while r < len {
        let n = size.min(len - r);
        out.push((start + r, n));
        r += n;
    }
}

/// Runs `f(item_index, scratch)` for every item on the threads that [`par::for_each_index`]
/// gives the call, handing out items in order from a shared counter (items are
/// pre-sorted largest first).
fn run_dynamic<F>(n_items: usize, e: usize, ev: usize, f: F)
where
    F: Fn(usize, &mut Scratch) + Sync,
{
    run_dynamic_with(n_items, e, ev, &|| (), |i, sc, _| f(i, sc))
}

/// [`run_dynamic`] with a second per-thread state made by `init`.
fn run_dynamic_with<S, F>(n_items: usize, e: usize, ev: usize, init: &(impl Fn() -> S + Sync), f: F)
where
    F: Fn(usize, &mut Scratch, &mut S) + Sync,
{
    if n_items == 0 {
        return;
    }
    let nt = par::threads().min(n_items);
    if nt == 1 {
        let mut state = init();
        with_scratch(e, ev, |sc| {
            for i in 0..n_items {
                f(i, sc, &mut state);
            }
        });
        return;
    }
    let next = AtomicUsize::new(0);
    par::for_each_index(nt, |_| {
        let mut state = init();
        with_scratch(e, ev, |sc| loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= n_items {
                break;
            }
            f(i, sc, &mut state);
        })
    });
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The output rows of one block: row `r` of block `blk` is query position `i` of query
/// head `h` (see [`block::block_rows`]), stored at row `(b · Hq + h) · L + i` of the output, or
/// `(b · L + i) · Hq + h` with [`Problem::heads_inner`].
struct BlockOut<T> {
    base: *mut MaybeUninit<T>,
    /// Elements behind `base`.
    len: usize,
    ev: usize,
    /// (batch, first query head of the group, first row, rows)
    at: (usize, usize, usize, usize),
    /// (Hq, L, heads_inner)
    shape: (usize, usize, bool),
}

// SAFETY: a `BlockOut` is a unique handle on its block's output rows: the rows of
// different blocks are disjoint (`(b, h, i)` ↦ row is one-to-one in both layouts and each
// `(b, h, i)` belongs to one block), and each handle sits in its own slot, taken once.
unsafe impl<T: Send> Send for BlockOut<T> {}

impl<T> BlockOut<T> {
    /// Calls `f(r, row r)` for each of the block's `n` rows (`ev` elements each), in
    /// order. In the default layout the rows are consecutive: one slice, cut in rows.
    #[inline]
    fn for_rows(&mut self, mut f: impl FnMut(usize, &mut [MaybeUninit<T>])) {
        let (bb, h0, r0, n) = self.at;
        let (hq, l, heads_inner) = self.shape;
        let ev = self.ev;
        if !heads_inner {
            // Row `(b · Hq + h) · L + i` with `h = h0 + (r0 + r) / L`, `i = (r0 + r) % L`.
            let first = (bb * hq + h0) * l + r0;
            assert!(
                (first + n) * ev <= self.len,
                "output rows {first}.. out of bounds"
            );
            // SAFETY: in bounds (asserted), and these rows belong to this block only (see
            // the `Send` impl); `&mut self` keeps one borrow of them at a time.
            let rows = unsafe { std::slice::from_raw_parts_mut(self.base.add(first * ev), n * ev) };
            for (r, row) in rows.chunks_exact_mut(ev.max(1)).enumerate() {
                f(r, row);
            }
            return;
        }
        for r in 0..n {
            let (h, i) = (h0 + (r0 + r) / l, (r0 + r) % l);
            let row = (bb * l + i) * hq + h;
            assert!((row + 1) * ev <= self.len, "output row {row} out of bounds");
            // SAFETY: as above, for one row.
            f(r, unsafe {
                std::slice::from_raw_parts_mut(self.base.add(row * ev), ev)
            });
        }
    }

    /// Writes zeros to all of the block's rows.
    fn zero(&mut self)
    where
        T: OutElem,
    {
        self.for_rows(|_, row| row.fill(MaybeUninit::new(T::default())));
    }
}

/// Estimated time in ns of a call of shape `(B, Hq, Hkv, L, S, E, Ev)` on one thread,
/// for [`par::sized`]: every query–key pair's products, and every element of Q, K, V and
/// the output ([`par::work_ns`]).
pub(crate) fn single_thread_ns(
    (b, hq, hkv, l, s, e, ev): (usize, usize, usize, usize, usize, usize, usize),
) -> f64 {
    let width = (e + ev) as f64;
    let flops = 2.0 * (b * hq * l) as f64 * s as f64 * width;
    let elems = ((b * hkv * s) as f64 + (b * hq * l) as f64) * width;
    par::work_ns(flops, elems)
}

/// Computes the attention output, `(B, Hq, L, Ev)` row-major, or `(B, L, Hq, Ev)` with
/// [`Problem::heads_inner`].
pub(crate) fn run<T: OutElem>(p: &Problem) -> Vec<T> {
    let (b, hkv, l, s, ev) = (p.b, p.hkv, p.l, p.s, p.ev);
    let g_sz = p.group();
    let total_rows = b * p.hq * l;
    if total_rows == 0 || ev == 0 || s == 0 {
        return vec![T::default(); total_rows * ev];
    }
    let ngroups = b * hkv;
    let rows_per_group = g_sz * l;

    // Row blocks of one group (identical for every group).
    let mut gblocks = Vec::new();
    if l >= BQ / 2 {
        for hl in 0..g_sz {
            split_rows(hl * l, l, &mut gblocks);
        }
    } else {
        split_rows(0, rows_per_group, &mut gblocks);
    }
    let blocks: Vec<Block> = (0..ngroups)
        .flat_map(|g| gblocks.iter().map(move |&(r0, n)| Block { g, r0, n }))
        .collect();

    // One output slot per block, uninitialised: each is written once, by `finish` or
    // `merge` when its block's work is done, or with zeros at the end if no work item
    // had a visible key for it.
    let mut out: Vec<T> = Vec::with_capacity(total_rows * ev);
    let spare = &mut out.spare_capacity_mut()[..total_rows * ev];
    super::pages::fault_in_fresh_output(spare);
    let (base, len) = (spare.as_mut_ptr(), spare.len());
    // A group's row blocks tile its rows `0..g·L` in order, and groups hold distinct
    // (batch, head) rows, so no row belongs to two blocks and every row to one.
    let mut next = 0;
    for &(r0, n) in &gblocks {
        assert_eq!(r0, next, "row blocks must tile a group's rows in order");
        next += n;
    }
    assert_eq!(next, rows_per_group, "row blocks must cover a group's rows");
    let slots: Vec<Mutex<Option<BlockOut<T>>>> = blocks
        .iter()
        .map(|blk| {
            let (bb, kvh) = (blk.g / hkv, blk.g % hkv);
            Mutex::new(Some(BlockOut {
                base,
                len,
                ev,
                at: (bb, kvh * g_sz, blk.r0, blk.n),
                shape: (p.hq, l, p.heads_inner),
            }))
        })
        .collect();

    // A small call runs on this thread alone: waking the others would cost more.
    par::sized(single_thread_ns((b, p.hq, hkv, l, s, p.e, ev)), || {
        work(p, &blocks, gblocks.len(), &slots)
    });
    for slot in &slots {
        if let Some(mut dst) = lock(slot).take() {
            dst.zero();
        }
    }
    drop(slots);
    // SAFETY: the blocks' rows are distinct and cover all `total_rows` rows (the tiling
    // is asserted above), and every slot was taken exactly once and all its rows written: by
    // `finish` or `merge`, or with zeros just above.
    unsafe { out.set_len(total_rows * ev) };
    out
}

/// The work of [`run`]: the attention of every row block (`nbg` per group), each written
/// to its output slot once its work is done.
fn work<T: OutElem>(p: &Problem, blocks: &[Block], nbg: usize, slots: &[Mutex<Option<BlockOut<T>>>]) {
    let (b, hkv, l, s, e, ev) = (p.b, p.hkv, p.l, p.s, p.e, p.ev);
    let ngroups = b * hkv;
    let rows_per_group = p.group() * l;
    // Visible-key union of a block's rows.
    let union = |blk: &Block| -> (usize, usize) {
        let (mut lo, mut hi) = (usize::MAX, 0);
        p.block_ranges(blk, |a, z| {
            if a < z {
                lo = lo.min(a);
                hi = hi.max(z);
            }
        });
        (lo, hi)
    };
    let cost = |blk: &Block, ks0: usize, ks1: usize| -> usize {
        let mut c = 0;
        p.block_ranges(blk, |a, z| {
            let (a, z) = (a.max(ks0), z.min(ks1));
            c += z.saturating_sub(a) + 16;
        });
        c
    };

    let nt = par::threads();
    if nbg == 1 {
        // Streaming (decode-style) path: every group is one block, so K/V are packed
        // block by block inside the work item (each K/V row is read once per group);
        // with few groups the key range is split across threads and merged by LSE.
        let nsplit = if ngroups < 2 * nt {
            (2 * nt).div_ceil(ngroups).min((s / MIN_SPLIT_KEYS).max(1)).max(1)
        } else {
            1
        };
        let mut items = Vec::new();
        for (bi, blk) in blocks.iter().enumerate() {
            let (lo, hi) = union(blk);
            if lo >= hi {
                continue;
            }
            let lo_a = lo / BK * BK;
            let chunk = (hi - lo_a).div_ceil(nsplit).div_ceil(BK) * BK;
            let mut k0 = lo_a;
            while k0 < hi {
                let k1 = (k0 + chunk).min(hi);
                items.push(Item {
                    blk: bi,
                    ks0: k0,
                    ks1: k1,
                    cost: cost(blk, k0, k1),
                });
                k0 = k1;
            }
        }
        items.sort_by_key(|it| std::cmp::Reverse(it.cost));
        // bf16 groups of more than `AMX_DECODE_MAX_ROWS` rows run faster on the AMX tiles
        // (`KvSrc::Stream` goes to `process_amx`).
        #[cfg(target_arch = "x86_64")]
        let tiles = rows_per_group > super::decode::AMX_DECODE_MAX_ROWS
            && p.amx
                .is_some_and(|pl| pl.unit == amx::Unit::Tiles && pl.comps == 1);
        #[cfg(not(target_arch = "x86_64"))]
        let tiles = false;
        let src = if rows_per_group <= decode_max_rows(p.isa, &p.k, e) && e.is_multiple_of(K_ALIGN) && !tiles
        {
            KvSrc::Rows
        } else {
            KvSrc::Stream
        };
        if nsplit == 1 {
            run_dynamic(items.len(), e, ev, |i, sc| {
                let it = items[i];
                let blk = blocks[it.blk];
                run_block(p, &blk, it.ks0, it.ks1, src, sc);
                if let Some(mut dst) = lock(&slots[it.blk]).take() {
                    finish(p, &blk, sc, &mut dst);
                }
            });
        } else {
            let partials: Vec<Mutex<Option<Partial>>> = items.iter().map(|_| Mutex::new(None)).collect();
            run_dynamic(items.len(), e, ev, |i, sc| {
                let it = items[i];
                let blk = blocks[it.blk];
                run_block(p, &blk, it.ks0, it.ks1, src, sc);
                *lock(&partials[i]) = Some(Partial::from_scratch(p, blk.n, sc));
            });
            let mut per_block: Vec<Vec<Partial>> = blocks.iter().map(|_| Vec::new()).collect();
            for (it, part) in items.iter().zip(partials) {
                if let Some(pt) = part.into_inner().unwrap_or_else(|e| e.into_inner()) {
                    per_block[it.blk].push(pt);
                }
            }
            par::for_each_index(blocks.len(), |i| {
                if let Some(mut dst) = lock(&slots[i]).take() {
                    merge::<T>(p, &blocks[i], &per_block[i], &mut dst);
                }
            });
        }
        return;
    }

    #[cfg(target_arch = "x86_64")]
    if let Some(plan) = p.amx {
        // The prefill path on AMX: bf16 VNNI packs (see `amx`).
        let (kbl, vbl) = (vnni::k_len(e, plan.comps), vnni::v_len(ev, plan.comps));
        let stage = plan.comps * BK * vnni::e_pad(e).max(ev.div_ceil(NR) * NR);
        prefill::<T, u16, _>(
            p,
            (blocks, slots, nbg, &cost),
            (kbl, vbl),
            || (vec![0f32; e.max(ev)], vec![0u16; stage]),
            |(tmp, rows), (kc, vc), (bb, kvh, j0, nk)| {
                // SAFETY: `p.amx` is only set after `amx::available()` or
                // `dpbf16::available()`.
                unsafe {
                    vnni::pack_k(&p.k, bb, kvh, j0, nk, e, plan.comps, kc, rows, tmp);
                    vnni::pack_v(&p.v, bb, kvh, j0, nk, ev, plan.comps, vc, rows, tmp);
                }
            },
            |g| KvSrc::PackedAmx(g),
        );
        return;
    }
    // f32 V rows that the AVX-512 tiles read in place are not packed (`v_pack_len` 0).
    let v_packed = block::v_rows_in_place(p).is_none();
    prefill::<T, f32, _>(
        p,
        (blocks, slots, nbg, &cost),
        (k_block_len(BK, e), block::v_pack_len(p)),
        || vec![0f32; NR * e.max(ev.div_ceil(NR) * NR)],
        |tmp, (kc, vc), (bb, kvh, j0, nk)| {
            pack_k(p.isa, &p.k, bb, kvh, j0, nk, e, kc, tmp);
            if v_packed {
                pack_v(&p.v, bb, kvh, j0, nk, BK, ev, vc, tmp);
            }
        },
        |g| KvSrc::Packed(g),
    );
}

/// `(blocks, output slots, row blocks per group, cost of a block's key range)`.
type Blocks<'s, 'o, T> = (
    &'s [Block],
    &'s [Mutex<Option<BlockOut<T>>>],
    usize,
    &'s (dyn Fn(&Block, usize, usize) -> usize + Sync),
);

#[cfg(test)]
mod tests {
    use super::super::par::shares;
    use super::single_thread_ns;

    #[test]
    fn only_calls_too_small_to_share_run_on_the_calling_thread() {
        // (B, Hq, Hkv, L, S, E, Ev)
        let one_key = single_thread_ns((1, 8, 8, 1, 1, 64, 64));
        let eight = single_thread_ns((1, 8, 8, 8, 8, 64, 64));
        for threads in [1, 2, 64] {
            assert!(!shares(one_key, threads) && !shares(eight, threads));
        }
        // About 12.8 µs of work: two threads could save half of it, 16 threads almost all.
        let sixteen = single_thread_ns((1, 6, 6, 16, 16, 64, 64));
        assert!(!shares(sixteen, 2) && shares(sixteen, 16));
        // The benchmark's cases, and calls of a few tens of µs, are shared.
        let cases = [
            (1, 16, 16, 512, 512, 64, 64),
            (8, 12, 12, 128, 128, 64, 64),
            (1, 32, 8, 1, 4096, 128, 128),
            (4, 32, 32, 1, 2048, 128, 128),
            (1, 32, 8, 1, 128, 128, 128),
            (1, 12, 12, 32, 32, 64, 64),
        ];
        for c in cases {
            assert!(shares(single_thread_ns(c), 2), "{c:?}");
        }
    }
}
