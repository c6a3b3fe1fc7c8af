//! Where the kernels' parallel loops run: on rayon's threads, or on the calling thread
//! alone inside [`inline`], which a caller uses when it runs several kernel calls in a
//! parallel loop of its own (so that nothing parallel runs inside anything parallel).
use rayon::prelude::*;
use std::cell::Cell;

thread_local! {
    static INLINE: Cell<bool> = const { Cell::new(false) };
}

#[cfg(test)]
thread_local! {
    /// How many times this thread entered [`inline`] (the tests' view of [`sized`]).
    static ENTERED: Cell<usize> = const { Cell::new(0) };
}

/// How many times this thread entered [`inline`].
#[cfg(test)]
pub(crate) fn inline_entries() -> usize {
    ENTERED.with(|c| c.get())
}

/// Runs `f` with every kernel call it makes on this thread sequential.
pub(crate) fn inline<R>(f: impl FnOnce() -> R) -> R {
    /// Restores the previous mode, also when `f` unwinds.
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            INLINE.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(INLINE.with(|c| c.replace(true)));
    #[cfg(test)]
    ENTERED.with(|c| c.set(c.get() + 1));
    f()
}

/// Whether this thread is inside [`inline`].
fn is_inline() -> bool {
    INLINE.with(|c| c.get())
}

/// Threads the kernels may split work over: rayon's, or 1 inside [`inline`].
pub(crate) fn threads() -> usize {
    if is_inline() {
        1
    } else {
        rayon::current_num_threads().max(1)
    }
}

/// The least time, in ns, that the other threads must be able to save before a call
/// wakes them. Handing a call's work to rayon's threads and waiting for them cost about
/// 10–15 µs on the 2-core Zen 3 VM (2026-12-05): an attention call with 8 heads of one
/// query and one key took 12–15 µs on both threads and 3–4 µs on the calling thread
/// alone, and a one-row projection from 64 to 64 features 10–13 µs on both threads and
/// about 1 µs alone. Smaller than that cost, so that a machine whose threads wake faster
/// loses little.
const WAKE_NS: f64 = 8_000.0;

/// Estimated time in ns, on one thread, of work of `flops` floating-point operations
/// over `elems` elements read or written, for [`sized`]: 50 GFLOP/s, and 0.2 ns per
/// element (4 bytes at 20 GB/s). On the Zen 3 VM (2026-12-05) this was within a factor
/// of two of the times of cache-resident attention calls that took 6–281 µs on one
/// thread; it leaves out fixed costs, which dominate smaller calls.
pub(crate) fn work_ns(flops: f64, elems: f64) -> f64 {
    flops / 50.0 + elems * 0.2
}

/// Whether work estimated at `t_ns` on one thread is worth sharing among `threads`: the
/// most the others could save, `t_ns · (1 − 1/threads)`, is at least [`WAKE_NS`]. Under
/// Miri, which checks the threads' accesses for data races, everything is shared.
pub(crate) fn shares(t_ns: f64, threads: usize) -> bool {
    if cfg!(miri) {
        return threads > 1;
    }
    t_ns * (1.0 - 1.0 / threads.max(1) as f64) >= WAKE_NS
}

/// Runs `f`, with its kernel calls sequential (inside [`inline`]) when its work,
/// estimated at `t_ns` on one thread, is not worth sharing among this thread's
/// [`threads`] (see [`shares`]).
pub(crate) fn sized<R>(t_ns: f64, f: impl FnOnce() -> R) -> R {
    if shares(t_ns, threads()) {
        f()
    } else {
        inline(f)
    }
}

/// `f(i)` for every `i < n`, on rayon's threads (or in order inside [`inline`]).
pub(crate) fn for_each_index(n: usize, f: impl Fn(usize) + Sync + Send) {
    if is_inline() {
        (0..n).for_each(f)
    } else {
        (0..n).into_par_iter().for_each(f)
    }
}

/// `f(item)` for every item of `items`, on rayon's threads (or in order inside
/// [`inline`]).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // used by `linear` (x86-64)
pub(crate) fn vec_for_each<T: Send>(items: Vec<T>, f: impl Fn(T) + Sync + Send) {
    if is_inline() {
        items.into_iter().for_each(f)
    } else {
        items.into_par_iter().for_each(f)
    }
}

/// `f(state, (i, chunk))` for the `i`-th chunk of `n` elements of `buf`, with states
/// made by `init` (one per rayon job, or a single one inside [`inline`]).
// Only `linear` (x86-64) calls it outside the tests.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn chunks_for_each<T: Send, S>(
    buf: &mut [T],
    n: usize,
    init: impl Fn() -> S + Sync + Send,
    f: impl Fn(&mut S, (usize, &mut [T])) + Sync + Send,
) {
    if is_inline() {
        let mut state = init();
        buf.chunks_mut(n).enumerate().for_each(|x| f(&mut state, x))
    } else {
        buf.par_chunks_mut(n).enumerate().for_each_init(init, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_runs_on_the_calling_thread_and_restores_the_mode() {
        let me = std::thread::current().id();
        assert!(!is_inline());
        inline(|| {
            assert_eq!(threads(), 1);
            for_each_index(64, |_| assert_eq!(std::thread::current().id(), me));
            vec_for_each((0..64).collect(), |_: i32| {
                assert_eq!(std::thread::current().id(), me)
            });
            let mut buf = vec![0u8; 64];
            chunks_for_each(
                &mut buf,
                8,
                || (),
                |_, (i, c)| {
                    assert_eq!(std::thread::current().id(), me);
                    c.fill(i as u8);
                },
            );
            assert_eq!(buf[63], 7);
        });
        assert!(!is_inline());
        // Too little work to share runs inline; enough for two threads does not. (Under
        // Miri everything is shared.)
        if !cfg!(miri) {
            sized(0.0, || assert!(is_inline()));
            let big = 4.0 * WAKE_NS;
            assert!(shares(big, 2) && !shares(big, 1) && !shares(WAKE_NS, 2));
            if threads() > 1 {
                sized(big, || assert!(!is_inline()));
            }
        }
        assert!(!is_inline());
        let caught = std::panic::catch_unwind(|| inline(|| panic!("unwinds")));
        assert!(caught.is_err());
        assert!(!is_inline());
    }
}
