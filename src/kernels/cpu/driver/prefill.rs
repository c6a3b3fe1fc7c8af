//! The prefill path: K/V packed once per chunk of groups, pipelined with the blocks that
//! read the packs.

use super::*;

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
pub(super) fn prefill<T: OutElem, E: Cached + Send + Sync, S>(
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

/// A work unit of [`prefill()`]: one K/V block pack `(group in chunk, key block)`, or one
/// row block's attention.
#[derive(Clone, Copy)]
pub(super) enum Unit {
    Pack(usize, usize),
    Run(Item),
}

/// The K/V packs of one chunk of groups (`[group][key block][K block | V block]`) while
/// [`prefill()`]'s threads fill and read them: each block is written once, by
/// [`Pipeline::fill`], and a group is only read, through [`Pipeline::ready`], once all
/// of its blocks are written.
pub(super) struct Pipeline<'a, E> {
    pub(super) base: *mut E,
    /// `(groups, key blocks per group, elements per block)`.
    pub(super) dims: (usize, usize, usize),
    /// Whether each block has been handed to a writer, `[group][key block]`.
    pub(super) claimed: Vec<AtomicBool>,
    /// Blocks written, per group.
    pub(super) done: Vec<AtomicUsize>,
    /// Set when a writer unwinds, so that readers waiting for its group give up.
    pub(super) failed: AtomicBool,
    pub(super) _buf: PhantomData<&'a mut [E]>,
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

    /// Group `g`'s blocks, once they are all written. Waits for them: [`prefill()`] hands
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
