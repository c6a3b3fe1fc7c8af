//! The tiled online-softmax driver: work decomposition, scheduling, K/V packing
//! phases, per-block softmax bookkeeping and the split-K (decode) merge.

use super::aligned::{AVec, AlignedBuf};
use super::decode::{rows_f32, DECODE_MAX_ROWS, K_ALIGN, V_ALIGN};
use super::exp::exp2_scalar;
use super::pack::{k_block_len, pack_k, pack_v, v_block_len};
use super::store::OutElem;
use super::tiles::{BK, MR, NR};
use super::view::{MaskView, View};
#[cfg(target_arch = "x86_64")]
use super::{amx, avx2, avx512, vnni};
use super::{par, softcap, Causal, Isa};
use std::cell::RefCell;
use std::f32::consts::LOG2_E;
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

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
    /// Packed on the fly, block by block.
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

/// Per-thread scratch buffers, reused across work items.
struct Scratch {
    dims: (usize, usize),
    q: AlignedBuf,
    qp: AlignedBuf,
    s: AlignedBuf,
    o: AlignedBuf,
    kp: AlignedBuf,
    vp: AlignedBuf,
    m: Vec<f32>,
    l: Vec<f32>,
    alpha: Vec<f32>,
    lo: Vec<usize>,
    hi: Vec<usize>,
    hh: Vec<usize>,
    ii: Vec<usize>,
    tmp: Vec<f32>,
    row: Vec<f32>,
    /// Lane-wise row maxima of one score block (`avx2::qk_max`), 8 per row.
    mx: Vec<f32>,
    /// AMX operands (bf16 bits), sized on first use: Q components, P components, one
    /// K and one V block, and the row staging of the packers.
    #[cfg(target_arch = "x86_64")]
    amx_bufs: AmxBufs,
}

/// Scratch of the AMX path (empty until used).
#[cfg(target_arch = "x86_64")]
#[derive(Default)]
struct AmxBufs {
    s: AVec<f32>,
    /// Each row's softmax sum as 16 lane-wise partial sums (`avx512::softmax_row_bf16`).
    l16: AVec<f32>,
    qa: AVec<u16>,
    pa: AVec<u16>,
    ka: AVec<u16>,
    va: AVec<u16>,
    rows: AVec<u16>,
}

thread_local! {
    /// Per-thread scratch kept between calls (a few hundred KiB), avoiding fresh
    /// page faults on every call.
    static SCRATCH: RefCell<Option<Scratch>> = const { RefCell::new(None) };
}

/// Runs `f` with this thread's cached scratch for `(e, ev)` (a private one if the
/// cache is busy or sized for other dims).
fn with_scratch<R>(e: usize, ev: usize, f: impl FnOnce(&mut Scratch) -> R) -> R {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut slot) => {
            let fits = slot.as_ref().is_some_and(|s| s.dims == (e, ev));
            if !fits {
                *slot = Some(Scratch::new(e, ev));
            }
            match slot.as_mut() {
                Some(sc) => f(sc),
                None => f(&mut Scratch::new(e, ev)),
            }
        }
        Err(_) => f(&mut Scratch::new(e, ev)),
    })
}

impl Scratch {
    fn new(e: usize, ev: usize) -> Self {
        let rp = BQ.div_ceil(ROW_ALIGN) * ROW_ALIGN;
        let evp = ev.div_ceil(NR) * NR;
        Self {
            dims: (e, ev),
            q: AlignedBuf::new(rp * e),
            qp: AlignedBuf::new(rp * e),
            // Two blocks' scores: the AVX-512 path pairs full blocks (`process`).
            s: AlignedBuf::new(rp * 2 * BK),
            o: AlignedBuf::new(rp * evp),
            kp: AlignedBuf::new(k_block_len(BK, e)),
            vp: AlignedBuf::new(v_block_len(BK, ev)),
            m: vec![0.0; rp],
            l: vec![0.0; rp],
            alpha: vec![1.0; rp],
            lo: vec![0; rp],
            hi: vec![0; rp],
            hh: vec![0; rp],
            ii: vec![0; rp],
            tmp: vec![0.0; NR * e.max(evp)],
            row: vec![0.0; evp],
            mx: vec![0.0; rp * 8],
            #[cfg(target_arch = "x86_64")]
            amx_bufs: AmxBufs::default(),
        }
    }
}

/// Largest K/V pack (bytes) a thread keeps for its next call: the whole budget, so a
/// model's successive attention calls reuse one buffer. A fresh 32 MiB buffer costs
/// about 8000 page faults per call: with a 16 MiB limit, `gpt2k_causal_d128` (whose
/// packs fill the budget) took 36.3 ms in bf16 and 132.7 ms in f32, against 28.9 and
/// 124.6 ms with the buffer kept (medians of three, alternating binaries).
const KEEP_PACK_BYTES: usize = PACK_BUDGET_BYTES;

thread_local! {
    /// This thread's last K/V pack buffers (f32 and bf16 bits), reused by its next call:
    /// a fresh multi-MB buffer costs a page fault per page or a full zeroing every call.
    static PACKS_F32: RefCell<AVec<f32>> = RefCell::new(AVec::default());
    static PACKS_U16: RefCell<AVec<u16>> = RefCell::new(AVec::default());
}

/// Element types with a per-thread pack cache.
trait Cached: Copy + Default + 'static {
    fn cell() -> &'static std::thread::LocalKey<RefCell<AVec<Self>>>;
}
impl Cached for f32 {
    fn cell() -> &'static std::thread::LocalKey<RefCell<AVec<f32>>> {
        &PACKS_F32
    }
}
impl Cached for u16 {
    fn cell() -> &'static std::thread::LocalKey<RefCell<AVec<u16>>> {
        &PACKS_U16
    }
}

/// A pack buffer taken from the thread's cache (or fresh), returned to it on drop when it
/// is at most [`KEEP_PACK_BYTES`]. Its contents are stale: the packers overwrite every
/// element of the blocks they fill.
struct PackCache<T: Cached> {
    buf: AVec<T>,
}

impl<T: Cached> PackCache<T> {
    fn take(len: usize) -> Self {
        let mut buf = T::cell().with(|c| {
            c.try_borrow_mut()
                .map(|mut b| std::mem::take(&mut *b))
                .unwrap_or_default()
        });
        buf.grow(len);
        PackCache { buf }
    }
}

impl<T: Cached> Drop for PackCache<T> {
    fn drop(&mut self) {
        if self.buf.len() * std::mem::size_of::<T>() <= KEEP_PACK_BYTES {
            let buf = std::mem::take(&mut self.buf);
            T::cell().with(|c| {
                if let Ok(mut b) = c.try_borrow_mut() {
                    *b = buf;
                }
            });
        }
    }
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

/// Runs `f(item_index, scratch)` for every item on all rayon threads, handing out
/// items in order from a shared counter (items are pre-sorted largest first).
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
/// head `h` (see [`block_rows`]), stored at row `(b · Hq + h) · L + i` of the output, or
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
    super::pages::advise_fresh_output(spare);
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

    work(p, &blocks, gblocks.len(), &slots);
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
        let rows_pad = rows_per_group.div_ceil(ROW_ALIGN) * ROW_ALIGN;
        let src = if rows_pad <= DECODE_MAX_ROWS && e.is_multiple_of(K_ALIGN) {
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
    prefill::<T, f32, _>(
        p,
        (blocks, slots, nbg, &cost),
        (k_block_len(BK, e), v_block_len(BK, ev)),
        || vec![0f32; NR * e.max(ev.div_ceil(NR) * NR)],
        |tmp, (kc, vc), (bb, kvh, j0, nk)| {
            pack_k(p.isa, &p.k, bb, kvh, j0, nk, e, kc, tmp);
            pack_v(&p.v, bb, kvh, j0, nk, BK, ev, vc, tmp);
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

/// The prefill path: packs K/V of a chunk of groups once (shared by all query heads of
/// each GQA group and all their row blocks) and runs the chunk's blocks group by group,
/// each group's largest first. `pack(stage, (K block, V block), (batch, kv head, first
/// key, keys))` fills one block pair of `(kbl, vbl)` elements with the thread's `stage`
/// scratch from `init`; `src` wraps a group's packs for [`run_block`].
///
/// Packing is pipelined with the blocks instead of being a phase of its own: the work
/// units are the packs of group 0, then for each group `g` the packs of group `g + 1`
/// followed by `g`'s blocks, handed out in that order. A block waits (briefly: the
/// units before it are all taken) until its group's packs are done, so the threads
/// never stop at a barrier between packing and computing, and each group's packs are
/// written just before its blocks read them.
fn prefill<T: OutElem, E: Cached + Send + Sync, S>(
    p: &Problem,
    (blocks, slots, nbg, cost): Blocks<'_, '_, T>,
    (kbl, vbl): (usize, usize),
    init: impl Fn() -> S + Sync + Send,
    pack: impl Fn(&mut S, (&mut [E], &mut [E]), (usize, usize, usize, usize)) + Sync + Send,
    src: impl for<'g> Fn(&'g [E]) -> KvSrc<'g> + Sync,
) {
    let (hkv, s, e, ev) = (p.hkv, p.s, p.e, p.ev);
    let ngroups = p.b * hkv;
    let kbn = s.div_ceil(BK);
    let blk_len = kbl + vbl;
    let group_len = kbn * blk_len;
    let elem = std::mem::size_of::<E>();
    let cg = (p.pack_budget / (group_len * elem).max(1)).clamp(1, ngroups);
    let mut pack_guard = PackCache::<E>::take(cg * group_len);
    let buf = &mut pack_guard.buf;
    let mut g0 = 0;
    while g0 < ngroups {
        let gn = cg.min(ngroups - g0);
        let mut items: Vec<Item> = (g0 * nbg..(g0 + gn) * nbg)
            .map(|bi| Item {
                blk: bi,
                ks0: 0,
                ks1: s,
                cost: cost(&blocks[bi], 0, s),
            })
            .collect();
        items.sort_by_key(|it| (blocks[it.blk].g, std::cmp::Reverse(it.cost)));
        let packs = |gl: usize| (0..kbn).map(move |kb| Unit::Pack(gl, kb));
        let mut units: Vec<Unit> = packs(0).collect();
        for (gl, group_items) in items.chunks(nbg).enumerate() {
            // Each group has `nbg` blocks, so the sorted items come `nbg` per group.
            assert!(
                group_items.iter().all(|it| blocks[it.blk].g == g0 + gl),
                "row blocks of group {} out of order",
                g0 + gl
            );
            if gl + 1 < gn {
                units.extend(packs(gl + 1));
            }
            units.extend(group_items.iter().map(|&it| Unit::Run(it)));
        }
        let chunk = Pipeline::<E>::new(&mut buf[..gn * group_len], (gn, kbn, blk_len));
        run_dynamic_with(units.len(), e, ev, &init, |u, sc, stage| match units[u] {
            Unit::Pack(gl, kb) => {
                let gi = g0 + gl;
                let j0 = kb * BK;
                chunk.fill(gl, kb, |blk| {
                    let (kc, vc) = blk.split_at_mut(kbl);
                    pack(stage, (kc, vc), (gi / hkv, gi % hkv, j0, BK.min(s - j0)));
                });
            }
            Unit::Run(it) => {
                let blk = blocks[it.blk];
                let gl = blk.g - g0;
                let grp = chunk.ready(gl);
                run_block(p, &blk, 0, s, src(grp), sc);
                if let Some(mut dst) = lock(&slots[it.blk]).take() {
                    finish(p, &blk, sc, &mut dst);
                }
            }
        });
        g0 += gn;
    }
}

/// A work unit of [`prefill`]: one K/V block pack `(group in chunk, key block)`, or one
/// row block's attention.
#[derive(Clone, Copy)]
enum Unit {
    Pack(usize, usize),
    Run(Item),
}

/// The K/V packs of one chunk of groups (`[group][key block][K block | V block]`) while
/// [`prefill`]'s threads fill and read them: each block is written once, by
/// [`Pipeline::fill`], and a group is only read, through [`Pipeline::ready`], once all
/// of its blocks are written.
struct Pipeline<'a, E> {
    base: *mut E,
    /// `(groups, key blocks per group, elements per block)`.
    dims: (usize, usize, usize),
    /// Whether each block has been handed to a writer, `[group][key block]`.
    claimed: Vec<AtomicBool>,
    /// Blocks written, per group.
    done: Vec<AtomicUsize>,
    /// Set when a writer unwinds, so that readers waiting for its group give up.
    failed: AtomicBool,
    _buf: PhantomData<&'a mut [E]>,
}

// SAFETY: `base` is only dereferenced by `fill`, on a block no other thread can reach
// (claimed once, and its group is not yet readable), and by `ready`, on a group whose
// blocks are all written and can never be claimed again.
unsafe impl<E: Send + Sync> Sync for Pipeline<'_, E> {}

impl<'a, E> Pipeline<'a, E> {
    /// `buf` holds `groups` groups of `blocks` blocks of `len` elements each.
    fn new(buf: &'a mut [E], (groups, blocks, len): (usize, usize, usize)) -> Self {
        assert!(
            groups * blocks * len <= buf.len(),
            "pack buffer of {} elements for {groups}×{blocks}×{len}",
            buf.len()
        );
        Pipeline {
            base: buf.as_mut_ptr(),
            dims: (groups, blocks, len),
            claimed: (0..groups * blocks).map(|_| AtomicBool::new(false)).collect(),
            done: (0..groups).map(|_| AtomicUsize::new(0)).collect(),
            failed: AtomicBool::new(false),
            _buf: PhantomData,
        }
    }

    /// Writes block `kb` of group `g` with `f` (once per block), then counts it as done.
    fn fill(&self, g: usize, kb: usize, f: impl FnOnce(&mut [E])) {
        let (groups, blocks, len) = self.dims;
        assert!(g < groups && kb < blocks, "pack block ({g}, {kb}) out of range");
        let first = !self.claimed[g * blocks + kb].swap(true, Ordering::Relaxed);
        assert!(first, "pack block ({g}, {kb}) filled twice");
        /// Marks the pipeline failed if `f` unwinds.
        struct Unwind<'p>(&'p AtomicBool);
        impl Drop for Unwind<'_> {
            fn drop(&mut self) {
                if std::thread::panicking() {
                    self.0.store(true, Ordering::Release);
                }
            }
        }
        let _guard = Unwind(&self.failed);
        // SAFETY: in bounds (`new` checked the buffer holds every block); this block is
        // disjoint from all others, claimed by this call alone, and its group is not
        // readable before `done[g]` counts it below.
        f(unsafe { std::slice::from_raw_parts_mut(self.base.add((g * blocks + kb) * len), len) });
        self.done[g].fetch_add(1, Ordering::Release);
    }

    /// Group `g`'s blocks, once they are all written. Waits for them: [`prefill`] hands
    /// out every pack of a group before any of its blocks' work, so the packs still
    /// running are on other threads and finish without waiting for anything.
    fn ready(&self, g: usize) -> &[E] {
        let (groups, blocks, len) = self.dims;
        assert!(g < groups, "pack group {g} out of range");
        let mut spins = 0u32;
        while self.done[g].load(Ordering::Acquire) < blocks {
            assert!(!self.failed.load(Ordering::Acquire), "a K/V packer panicked");
            spins = spins.saturating_add(1);
            if spins < 1 << 10 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        // SAFETY: in bounds (`new`); every block of the group was written, each by one
        // `fill` that released `done[g]` after its write (acquired above), and a block is
        // never filled twice, so no write follows.
        unsafe { std::slice::from_raw_parts(self.base.add(g * blocks * len), blocks * len) }
    }
}

/// Key blocks per AMX super-block: scores, softmax and the `P·V` accumulation run over
/// up to `AMX_GROUP × BK` = 256 keys at once, so the output tiles are loaded and stored
/// once per 256 keys.
#[cfg(target_arch = "x86_64")]
const AMX_GROUP: usize = 4;
/// Keys per AMX super-block (the row stride of its score and probability buffers).
#[cfg(target_arch = "x86_64")]
const SBK: usize = AMX_GROUP * BK;

/// [`process`] with both block products on AMX tiles (see `amx`): leaves the same
/// unnormalised `o`, `m` (log2 domain) and `l` in the scratch.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn process_amx(
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
    ab.s.grow(BQ * SBK);
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
    use super::view::Data;
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
        // Key blocks each 16-row tile needs from this super-block: on causal edges, a
        // tile stops at the block holding its last visible key. The scores it skips are
        // outside every row's visible range, so the softmax never reads them and writes
        // zero probabilities there, which `P·V` may then skip as well.
        let mut tile_nb = [nb; BQ.div_ceil(TM)];
        if need_causal {
            for (t, v) in tile_nb.iter_mut().enumerate().take(rtiles) {
                let h = (t * TM..((t + 1) * TM).min(n)).map(|r| hi[r]).max().unwrap_or(0);
                *v = h.saturating_sub(j0).div_ceil(BK).min(nb);
            }
        }
        for (bi, &kbp) in kbs.iter().enumerate().take(nb) {
            // Runs of consecutive row tiles that see block `bi`.
            let mut t0 = 0;
            while t0 < rtiles {
                if tile_nb[t0] <= bi {
                    t0 += 1;
                    continue;
                }
                let mut t1 = t0 + 1;
                while t1 < rtiles && tile_nb[t1] > bi {
                    t1 += 1;
                }
                // Tiles `t0..mid` from the source, `mid..t1` from the copy.
                let mid = t1.min(full_tiles).max(t0);
                // SAFETY: `configure` ran on this thread. Tiles below `full_tiles` are
                // whole source rows of stride `ld` (bounds checked with `q_src`); the
                // copy holds `rtiles` tiles of every component (tiles `t0..t1` from row
                // `t0·TM`); each K block holds `kbl` elements, the score buffer
                // `rows × SBK` floats.
                unsafe {
                    if let (Some((qs, ld)), true) = (q_src, mid > t0) {
                        let q0 = qs.add(t0 * TM * ld);
                        let s0 = sb.add(t0 * TM * SBK + bi * BK);
                        plan.qk(q0, 0, (mid - t0, ld), e, kbp, kcs, s0, SBK);
                    }
                    if t1 > mid {
                        let q0 = ab.qa.as_ptr().add(mid * TM * ep);
                        let s0 = sb.add(mid * TM * SBK + bi * BK);
                        plan.qk(q0, qcs, (t1 - mid, ep), e, kbp, kcs, s0, SBK);
                    }
                };
                t0 = t1;
            }
        }
        let ov = o.as_mut_slice();
        let pa = ab.pa.as_mut_ptr();
        for r in 0..n {
            let row = &mut ab.s[r * SBK..r * SBK + nb * BK];
            let (a, z) = if need_causal {
                let z = hi[r].saturating_sub(j0).min(nks);
                (lo[r].saturating_sub(j0).min(z), z)
            } else {
                (0, nks)
            };
            let mut cr = c;
            if let Some(mk) = &p.mask {
                mk.scale_add_row(bb, hh[r], ii[r], j0 + a, &mut row[a..z], c, LOG2_E);
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
        // Runs of consecutive row tiles that need the same leading blocks.
        let mut t0 = 0;
        while t0 < rtiles {
            let k = tile_nb[t0];
            let mut t1 = t0 + 1;
            while t1 < rtiles && tile_nb[t1] == k {
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
                        &vbs[..k],
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

/// Unnormalised partial result of one split-K item.
struct Partial {
    m: Vec<f32>,
    l: Vec<f32>,
    o: Vec<f32>,
}

impl Partial {
    fn from_scratch(p: &Problem, n: usize, sc: &Scratch) -> Self {
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
fn merge<T: OutElem>(p: &Problem, blk: &Block, parts: &[Partial], dst: &mut BlockOut<T>) {
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
fn finish<T: OutElem>(p: &Problem, blk: &Block, sc: &mut Scratch, dst: &mut BlockOut<T>) {
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
struct Visible {
    lo_min: usize,
    hi_max: usize,
    max_lo: usize,
    min_hi: usize,
}

/// How many rows ahead [`block_rows`] prefetches Q (4 and 8 measured alike on
/// `mha_layer` when its Q rows were 3 KB apart; since its input projections became one
/// product they are 9 KB apart).
const Q_AHEAD: usize = 8;

/// Fills `(hh, ii, lo, hi)` (query head, position and visible key range of each of the
/// block's rows), calls `read(r, offset of the row in q)` for each row, and returns the
/// block's [`Visible`] bounds.
fn block_rows(
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
fn reset_accumulators(
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
fn process(p: &Problem, blk: &Block, ks0: usize, ks1: usize, src: KvSrc, sc: &mut Scratch) {
    let (s, e, ev) = (p.s, p.e, p.ev);
    let (bb, kvh) = (blk.g / p.hkv, blk.g % p.hkv);
    let n = blk.n;
    let rows = n.div_ceil(ROW_ALIGN) * ROW_ALIGN;
    let evp = ev.div_ceil(NR) * NR;
    let nvp = evp / NR;
    let kbl = k_block_len(BK, e);
    let vbl = v_block_len(BK, ev);
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
        alpha,
        lo,
        hi,
        hh,
        ii,
        tmp,
        mx,
        ..
    } = sc;
    #[cfg(not(target_arch = "x86_64"))]
    let _ = &mx; // only the AVX2 score kernel keeps row maxima

    // The register-tiled score kernels take Q strip-packed, except on AVX-512 and AVX2,
    // whose 6-row tiles broadcast from the row-major rows (`avx512::qk`, `avx2::qk`); the
    // decode kernels take it row-major.
    let strip_q = !matches!(src, KvSrc::Rows) && !matches!(isa, Isa::Avx512 | Isa::Avx2Fma);
    let qb = &mut q.as_mut_slice()[..rows * e];
    let qpm = &mut qp.as_mut_slice()[..rows * e];
    let vis = block_rows(p, blk, (hh, ii, lo, hi), |r, off| {
        let qrow = &mut qb[r * e..(r + 1) * e];
        p.q.read_row(off, qrow, p.scale * LOG2_E);
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
    qb[n * e..].fill(0.0);
    if strip_q {
        for r in n..rows {
            let strip = &mut qpm[(r / MR) * MR * e..(r / MR + 1) * MR * e];
            for d in strip.chunks_exact_mut(MR) {
                d[r % MR] = 0.0;
            }
        }
    }
    // Half-precision decode on AVX-512 reads K/V rows in place (`raw`); bf16 rows are
    // widened 32 at a time, split into even and odd elements (`avx512::qk_dot_raw`,
    // `avx512::pv_rows`), so Q takes that layout here and the output leaves it at the end
    // (`e > 0`: the split walks Q in rows of `e`).
    #[cfg(target_arch = "x86_64")]
    let raw = matches!(src, KvSrc::Rows)
        && isa == Isa::Avx512
        && e > 0
        && e.is_multiple_of(16)
        && ev.is_multiple_of(16)
        && raw_rows_ok(p);
    // On AVX2, half-precision decode rows are read in place too (`avx2::qk_dot`,
    // `avx2::pv_rows`).
    #[cfg(target_arch = "x86_64")]
    let raw2 = matches!(src, KvSrc::Rows)
        && isa == Isa::Avx2Fma
        && e.is_multiple_of(K_ALIGN)
        && ev.is_multiple_of(V_ALIGN)
        && raw_rows_ok(p);
    // (q, k and v share one dtype: `sdpa_impl` checks it.)
    #[cfg(target_arch = "x86_64")]
    let split = raw && matches!(p.k.data, super::view::Data::BF16(_));
    #[cfg(target_arch = "x86_64")]
    if split {
        for row in qb.chunks_exact_mut(e) {
            avx512::split_pairs(row);
        }
    }
    reset_accumulators(rows, evp, (o, m, lsum, alpha));

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
    while kb < kend {
        let j0 = kb * BK;
        let nk = BK.min(s - j0);
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
                        avx512::qk_softmax(qpk, (rows, n), e, k0, sb, lds, (&mut *m, &mut *lsum, &mut *alpha))
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
                            (&mut *m, &mut *lsum, &mut *alpha),
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
                    online_rows(p, &rows_of, (sb, lds, n), (j0, nk2, false), (m, lsum, alpha));
                }
                let v0 = &grp[b0 + kbl..b0 + kbl + vbl];
                let v1 = &grp[b1 + kbl..b1 + kbl + vbl];
                // SAFETY: `Isa::Avx512` only reaches here after `is_supported()`.
                unsafe {
                    avx512::pv_pair(
                        sb,
                        rows,
                        (v0, BK),
                        (v1, nk2 - BK),
                        BK * NR,
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
        // A full, wholly visible block with no explicit mask. On AVX-512 its scores go
        // through the softmax in registers (`avx512::qk_softmax`), so `online_rows` is
        // skipped below; on AVX2 the score kernel also keeps each row's maximum
        // (`avx2::qk_max`), so the softmax skips its pass over the rows for the maxima.
        let whole = cfg!(target_arch = "x86_64")
            && p.mask.is_none()
            && p.softcap.is_none()
            && !need_causal
            && nk == BK
            && matches!(src, KvSrc::Packed(_) | KvSrc::Stream);
        let fused = whole && isa == Isa::Avx512;
        let premax = whole && isa == Isa::Avx2Fma;
        // `FnMut` only on x86-64, where the fused branch updates `m`, `lsum` and `alpha`.
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
        let mut qk = |kps: &[f32], sb: &mut [f32]| {
            #[cfg(target_arch = "x86_64")]
            if fused {
                // SAFETY: `Isa::Avx512` only reaches here after `is_supported()`.
                return unsafe {
                    avx512::qk_softmax(qpk, (rows, n), e, kps, sb, BK, (&mut *m, &mut *lsum, &mut *alpha))
                };
            }
            #[cfg(target_arch = "x86_64")]
            if premax {
                // SAFETY: `Isa::Avx2Fma` only reaches here after `is_supported()`.
                return unsafe { avx2::qk_max(qpk, rows, e, kps, npanels, sb, BK, &mut mx[..]) };
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
        let mut raw_v: Option<super::view::Data> = None;
        // (V operand, V panel stride, V row stride)
        let (vsl, vps, ldv): (&[f32], usize, usize) = match src {
            #[cfg(target_arch = "x86_64")]
            KvSrc::Rows if raw || raw2 => {
                let (kd, ldk) = rows_raw(&p.k, bb, kvh, j0, nk, e);
                let (vd, ldv) = rows_raw(&p.v, bb, kvh, j0, nk, ev);
                if raw {
                    // SAFETY: `Isa::Avx512` only reaches here after `is_supported()`.
                    unsafe { avx512::qk_dot_raw(qb, rows, n, e, kd, ldk, nk, sb, BK) };
                } else {
                    // SAFETY: `Isa::Avx2Fma` only reaches here after `is_supported()`.
                    unsafe { avx2::qk_dot(qb, rows, n, e, kd, ldk, nk, sb, BK) };
                }
                raw_v = Some(vd);
                (&[][..], NR, ldv)
            }
            KvSrc::Packed(grp) => {
                let base = kb * (kbl + vbl);
                qk(&grp[base..base + kbl], sb);
                (&grp[base + kbl..base + kbl + vbl], BK * NR, NR)
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
                pack_v(&p.v, bb, kvh, j0, nk, BK, ev, vp.as_mut_slice(), tmp);
                qk(kp.as_slice(), sb);
                (vp.as_slice(), BK * NR, NR)
            }
            KvSrc::Rows => {
                let (ks, ldk) = rows_f32(&p.k, bb, kvh, j0, nk, e, K_ALIGN, kp.as_mut_slice());
                isa.qk_dot(qb, rows, n, e, ks, ldk, nk, sb, BK);
                let (vs, ldv) = rows_f32(&p.v, bb, kvh, j0, nk, ev, V_ALIGN, vp.as_mut_slice());
                (vs, NR, ldv)
            }
        };
        if premax {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `premax` is only set on the `Isa::Avx2Fma` path.
            unsafe {
                avx2::online_rows_block_premax(sb, BK, n, mx, (m, lsum, alpha))
            };
        } else if !fused {
            let rows_of = RowsOf { bb, hh, ii, lo, hi };
            online_rows(p, &rows_of, (sb, BK, n), (j0, nk, need_causal), (m, lsum, alpha));
        }
        let o = o.as_mut_slice();
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
            if raw {
                // SAFETY: `raw` is only set on the `Isa::Avx512` path.
                unsafe { avx512::pv_rows(sb, n, nk, vd, ldv, nvp, o, evp, alpha) };
            } else {
                // SAFETY: `raw2` is only set on the `Isa::Avx2Fma` path.
                unsafe { avx2::pv_rows(sb, n, nk, vd, ldv, evp, o, evp, alpha) };
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = vd;
        } else if cfg!(target_arch = "x86_64") && isa == Isa::Avx2Fma && matches!(src, KvSrc::Rows) {
            // Decode on AVX2 walks each streamed V row to its end (`avx2::pv_rows`).
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Isa::Avx2Fma` only reaches here after `is_supported()`.
            unsafe {
                avx2::pv_rows(sb, n, nk, super::view::Data::F32(vsl), ldv, evp, o, evp, alpha)
            };
        } else if cfg!(target_arch = "x86_64") && isa == Isa::Avx512 && matches!(src, KvSrc::Rows) {
            // Decode on AVX-512 walks each streamed V row to its end (`avx512::pv_rows`).
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Isa::Avx512` only reaches here after `is_supported()`.
            unsafe {
                avx512::pv_rows(sb, n, nk, super::view::Data::F32(vsl), ldv, nvp, o, evp, alpha)
            };
        } else {
            isa.pv(sb, rows, n, nk, vsl, vps, ldv, nvp, o, evp, alpha);
        }
        kb += 1;
    }
    #[cfg(target_arch = "x86_64")]
    if split {
        for row in o.as_mut_slice().chunks_exact_mut(evp).take(n) {
            avx512::merge_pairs(row, nvp / 2);
        }
    }
}

/// Batch, and per row head, position and visible key range `[lo, hi)`, of a block's rows.
struct RowsOf<'a> {
    bb: usize,
    hh: &'a [usize],
    ii: &'a [usize],
    lo: &'a [usize],
    hi: &'a [usize],
}

/// The online-softmax update of the first `n` score rows of `sb` (row stride `lds`)
/// for the `nk` keys from `j0`: adds the explicit mask, turns each row's visible part
/// into probabilities (0 elsewhere; with `causal`, the visible part is the row's
/// `[lo, hi)`, else all `nk` keys) and updates `m`, `l` and `alpha`. A row with no
/// visible key is all 0, with `m` and `l` unchanged.
fn online_rows(
    p: &Problem,
    rows: &RowsOf,
    (sb, lds, n): (&mut [f32], usize, usize),
    (j0, nk, causal): (usize, usize, bool),
    (m, lsum, alpha): (&mut [f32], &mut [f32], &mut [f32]),
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
    // AVX-512: all rows in one call, each kept in registers, rescaled lazily
    // (`avx512::online_rows_lazy`). Measured, alternating binaries: see `NOTES.md`.
    #[cfg(target_arch = "x86_64")]
    if p.isa == Isa::Avx512 {
        // Callers pass one key block or a pair of them.
        assert!(nk <= 2 * BK, "{nk} keys: at most two blocks per softmax update");
        assert!(
            n <= m.len() && n <= lsum.len() && n <= alpha.len() && (n == 0 || sb.len() >= (n - 1) * lds + nk)
        );
        let sp = sb.as_mut_ptr();
        // SAFETY: `Isa::Avx512` is only selected after detecting AVX-512F and DQ; the
        // bounds of `sb`, `m`, `lsum` and `alpha` are asserted above, and every range
        // lies in `0..nk` with `nk ≤ 2·BK = 16·8`.
        unsafe {
            if nk <= BK {
                avx512::online_rows_lazy::<4>(sp, (lds, n, nk), range, (m, lsum, alpha));
            } else {
                avx512::online_rows_lazy::<8>(sp, (lds, n, nk), range, (m, lsum, alpha));
            }
        }
        return;
    }
    // AVX2: all rows of one block in one call, each read into registers
    // (`avx2::online_rows_block`). Measured, alternating binaries: see `NOTES.md`.
    #[cfg(target_arch = "x86_64")]
    if p.isa == Isa::Avx2Fma && nk <= BK {
        // SAFETY: `Isa::Avx2Fma` only reaches here after `is_supported()`; every range
        // lies in `0..nk` with `nk ≤ BK`.
        unsafe { avx2::online_rows_block(sb, lds, n, range, (m, lsum, alpha)) };
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

/// Whether the decode path can read K and V rows in place: half precision (f32 rows are
/// already borrowed in place by `rows_f32`) with unit inner strides.
#[cfg(target_arch = "x86_64")]
fn raw_rows_ok(p: &Problem) -> bool {
    use super::view::Data;
    let unit = |v: &View| v.strides[3] == 1;
    !matches!(p.k.data, Data::F32(_)) && unit(&p.k) && unit(&p.v)
}

/// Rows `j0 .. j0 + nk` of `(b, kvh)` in place, as `(elements from the first row, row
/// stride)`; `width` elements per row, unit inner stride.
#[cfg(target_arch = "x86_64")]
fn rows_raw<'a>(
    src: &View<'a>,
    b: usize,
    kvh: usize,
    j0: usize,
    nk: usize,
    width: usize,
) -> (super::view::Data<'a>, usize) {
    use super::view::Data;
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::panic::{catch_unwind, AssertUnwindSafe};

    /// A reader sees each group only once all of its blocks are written, while another
    /// thread is still writing later groups.
    #[test]
    fn pipeline_hands_out_whole_groups() {
        let mut buf = vec![0u32; 3 * 4 * 5];
        let pipe = Pipeline::new(&mut buf, (3, 4, 5));
        std::thread::scope(|sc| {
            sc.spawn(|| {
                for g in 0..3 {
                    for kb in (0..4).rev() {
                        std::thread::sleep(std::time::Duration::from_millis(2));
                        pipe.fill(g, kb, |b| b.fill((10 * g + kb) as u32 + 1));
                    }
                }
            });
            for g in 0..3 {
                let grp = pipe.ready(g);
                assert_eq!(grp.len(), 20);
                for (kb, blk) in grp.chunks(5).enumerate() {
                    assert!(blk.iter().all(|&x| x == (10 * g + kb) as u32 + 1), "group {g}");
                }
            }
        });
    }

    /// Filling a block twice, or a block or group out of range, is a bug: it panics
    /// instead of writing memory a reader may hold.
    #[test]
    fn pipeline_refuses_a_second_fill_and_out_of_range_blocks() {
        let mut buf = vec![0f32; 2 * 2 * 3];
        let pipe = Pipeline::new(&mut buf, (2, 2, 3));
        pipe.fill(0, 1, |b| b.fill(1.0));
        let twice = catch_unwind(AssertUnwindSafe(|| pipe.fill(0, 1, |b| b.fill(2.0))));
        assert!(twice.is_err());
        assert!(catch_unwind(AssertUnwindSafe(|| pipe.fill(0, 2, |_| ()))).is_err());
        assert!(catch_unwind(AssertUnwindSafe(|| pipe.fill(2, 0, |_| ()))).is_err());
        assert!(catch_unwind(AssertUnwindSafe(|| pipe.ready(2))).is_err());
        pipe.fill(0, 0, |b| b.fill(3.0));
        assert_eq!(pipe.ready(0), &[3.0, 3.0, 3.0, 1.0, 1.0, 1.0]);
        let small = catch_unwind(|| Pipeline::new(&mut [0f32; 11], (2, 2, 3)).dims);
        assert!(small.is_err());
    }

    /// A writer that panics makes the readers waiting for its group panic too, instead
    /// of waiting forever.
    #[test]
    fn a_failed_pack_fails_its_readers() {
        let mut buf = vec![0f32; 8];
        let pipe = Pipeline::new(&mut buf, (1, 2, 4));
        std::thread::scope(|sc| {
            let reader = sc.spawn(|| catch_unwind(AssertUnwindSafe(|| pipe.ready(0).len())));
            std::thread::sleep(std::time::Duration::from_millis(5));
            pipe.fill(0, 0, |b| b.fill(1.0));
            let writer = catch_unwind(AssertUnwindSafe(|| pipe.fill(0, 1, |_| panic!("packer bug"))));
            assert!(writer.is_err());
            let read = reader.join().expect("the reader returns its own result");
            assert!(read.is_err(), "the reader got {read:?}");
        });
    }
}
