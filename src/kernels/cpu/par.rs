//! Where the kernels' parallel loops run: on rayon's threads, on the calling thread with
//! rayon's threads joining in as they wake ([`share`], for calls of up to a few hundred
//! µs; see [`sized`]), or on the calling thread alone inside [`inline`], which [`sized`]
//! uses for calls too small to share and a caller uses when it runs several kernel calls
//! in a parallel loop of its own (so that nothing parallel runs inside anything parallel).
use rayon::prelude::*;
use std::any::Any;
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// How this thread's kernel calls run their parallel loops.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    /// On rayon's threads, the calling thread waiting (outside any [`sized`] call).
    Pool,
    /// On the calling thread, with rayon's threads joining in as they wake ([`share`]).
    Join,
    /// On the calling thread alone ([`inline`]).
    Inline,
}

thread_local! {
    static MODE: Cell<Mode> = const { Cell::new(Mode::Pool) };
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

/// Runs `f` in `mode`, then restores the previous mode, also when `f` unwinds.
fn with_mode<R>(mode: Mode, f: impl FnOnce() -> R) -> R {
    struct Restore(Mode);
    impl Drop for Restore {
        fn drop(&mut self) {
            MODE.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(MODE.with(|c| c.replace(mode)));
    f()
}

fn mode() -> Mode {
    MODE.with(|c| c.get())
}

/// Runs `f` with every kernel call it makes on this thread sequential.
pub(crate) fn inline<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(test)]
    ENTERED.with(|c| c.set(c.get() + 1));
    with_mode(Mode::Inline, f)
}

/// Whether this thread is inside [`inline`].
fn is_inline() -> bool {
    mode() == Mode::Inline
}

/// Threads the kernels may split work over: rayon's, or 1 inside [`inline`].
pub(crate) fn threads() -> usize {
    if is_inline() {
        1
    } else {
        rayon::current_num_threads().max(1)
    }
}

/// The least time, in ns, that the other threads must be able to save before a call is
/// shared. On the 2-core Zen 3 VM (2026-12-05), handing a call's work to rayon's threads
/// and waiting for them cost 10–15 µs: an attention call with 8 heads of one query and one
/// key took 12–15 µs on both threads and 3–4 µs on the calling thread alone, and a one-row
/// projection from 64 to 64 features 10–13 µs on both threads and about 1 µs alone.
/// [`share`] no longer waits for the other threads to wake, but a lower limit did not pay
/// in whole layers: with 2 µs, a `MultiheadAttention` step of one token at E = 128 shared
/// its input projection and took 18–22 µs against 11–16 µs with 8 µs (medians of 21
/// timings), though some attention calls of an estimated 6–13 µs gained 1–2 µs. The kernel
/// notes list both measurements.
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

/// Estimated single-thread time (ns) below which a shared call runs on the calling thread
/// with rayon's threads joining in as they wake ([`share`]); from it on, its loops run on
/// rayon's threads while the calling thread waits, as rayon's own loops do. On the 2-core
/// Zen 3 VM (2026-12-05), joining saved the 10–15 µs of handing the work over on calls of
/// up to a few hundred µs, and cost 3–15% on calls of milliseconds (`enc512`, `bert_pad`,
/// and a 2.5 ms call; see the kernel notes), so it stops at about 250 µs on two threads.
const JOIN_LIMIT_NS: f64 = 500_000.0;

/// Runs `f`, with its kernel calls sequential (inside [`inline`]) when its work,
/// estimated at `t_ns` on one thread, is not worth sharing among this thread's
/// [`threads`] (see [`shares`]); shared by [`share`] below [`JOIN_LIMIT_NS`]; else on
/// rayon's threads.
pub(crate) fn sized<R>(t_ns: f64, f: impl FnOnce() -> R) -> R {
    if !shares(t_ns, threads()) {
        inline(f)
    } else if t_ns < JOIN_LIMIT_NS {
        with_mode(Mode::Join, f)
    } else {
        f()
    }
}

/// `f(i)` for every `i < n`, as this thread's mode says ([`sized`]): on rayon's threads
/// (`par_iter`); each index taken once, in increasing order, by the calling thread or by
/// one of the rayon threads that join it ([`share`]); or in order on the calling thread
/// alone inside [`inline`].
pub(crate) fn for_each_index(n: usize, f: impl Fn(usize) + Sync + Send) {
    let helpers = match mode() {
        Mode::Inline => 0,
        Mode::Pool => return (0..n).into_par_iter().for_each(f),
        Mode::Join => threads().min(n).saturating_sub(1),
    };
    if helpers == 0 {
        return (0..n).for_each(f);
    }
    let next = AtomicUsize::new(0);
    share(helpers, &|| loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        if i >= n {
            break;
        }
        f(i);
    });
}

/// `f(item)` for every item of `items`, as [`for_each_index`] hands out their indices.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // used by `linear` (x86-64)
pub(crate) fn vec_for_each<T: Send>(items: Vec<T>, f: impl Fn(T) + Sync + Send) {
    match mode() {
        Mode::Inline => return items.into_iter().for_each(f),
        Mode::Pool => return items.into_par_iter().for_each(f),
        Mode::Join => {}
    }
    let slots: Vec<Mutex<Option<T>>> = items.into_iter().map(|t| Mutex::new(Some(t))).collect();
    for_each_index(slots.len(), |i| {
        if let Some(t) = take(&slots[i]) {
            f(t)
        }
    });
}

/// `f(state, (i, chunk))` for the `i`-th chunk of `n` elements of `buf`, as
/// [`for_each_index`] hands out their indices, with one state made by `init` for each
/// thread that takes a chunk.
// Only `linear` (x86-64) calls it outside the tests.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn chunks_for_each<T: Send, S>(
    buf: &mut [T],
    n: usize,
    init: impl Fn() -> S + Sync + Send,
    f: impl Fn(&mut S, (usize, &mut [T])) + Sync + Send,
) {
    match mode() {
        Mode::Inline => {
            let mut state = init();
            return buf.chunks_mut(n).enumerate().for_each(|x| f(&mut state, x));
        }
        Mode::Pool => return buf.par_chunks_mut(n).enumerate().for_each_init(init, f),
        Mode::Join => {}
    }
    let chunks = buf.chunks_mut(n);
    let slots: Vec<Mutex<Option<&mut [T]>>> = chunks.map(|c| Mutex::new(Some(c))).collect();
    let next = AtomicUsize::new(0);
    share(threads().min(slots.len()).saturating_sub(1), &|| {
        let mut state = None;
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= slots.len() {
                break;
            }
            if let Some(c) = take(&slots[i]) {
                f(state.get_or_insert_with(&init), (i, c));
            }
        }
    });
}

/// The `rows · out` elements of `y` (row-major) cut into row blocks of about `block`
/// rows, for the threads to write: as many blocks as a multiple of the thread count,
/// with whole tiles of `tile` rows split evenly (block sizes differ by at most one tile),
/// so the threads get equal work. Returns each non-empty block with its first row.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // used by the x86-64 products
pub(crate) fn row_blocks<T>(
    y: &mut [T],
    (rows, out): (usize, usize),
    tile: usize,
    block: usize,
) -> Vec<(usize, &mut [T])> {
    assert_eq!(y.len(), rows * out);
    let nt = threads();
    let tiles = rows.div_ceil(tile);
    let nblk = rows.div_ceil(block).div_ceil(nt) * nt;
    let mut blocks = Vec::with_capacity(nblk);
    let mut rest = y;
    for i in 0..nblk {
        let r0 = (i * tiles / nblk * tile).min(rows);
        let r1 = ((i + 1) * tiles / nblk * tile).min(rows);
        let (head, tail) = std::mem::take(&mut rest).split_at_mut((r1 - r0) * out);
        blocks.push((r0, head));
        rest = tail;
    }
    blocks.retain(|(_, ys)| !ys.is_empty());
    blocks
}

/// Takes the value out of a slot (also after a panic on another thread poisoned it).
fn take<T>(slot: &Mutex<Option<T>>) -> Option<T> {
    slot.lock().unwrap_or_else(|e| e.into_inner()).take()
}

/// Runs `job` on the calling thread, and asks `helpers` of rayon's threads to run it too
/// as soon as they are free; returns once the calling thread's run has returned and every
/// helper that started has returned. A helper that starts after that does nothing, so the
/// calling thread never waits for a thread to wake up: handing work to rayon and waiting
/// for it (`par_iter` from a thread outside the pool) cost 12–19 µs on the 2-core Zen 3
/// VM even with nothing to do. `job` hands out its own work items (a shared counter), so
/// whichever threads run it share them. A panic in a helper's run is raised again here.
pub(crate) fn share(helpers: usize, job: &(dyn Fn() + Sync)) {
    if helpers == 0 {
        return job();
    }
    // SAFETY (of the lifetime erased here): `Ticket::help` calls the job only while
    // registered in `state`, and registers only before `Close` sets the closed bit;
    // `Close` (also run when `job` unwinds on this thread) returns only once no helper is
    // registered, so no helper calls the job after this function returns.
    let job: *const (dyn Fn() + Sync + '_) = job;
    let job: *const (dyn Fn() + Sync + 'static) = unsafe { std::mem::transmute(job) };
    let ticket = Arc::new(Ticket {
        state: AtomicUsize::new(0),
        job: Job(job),
        panic: Mutex::new(None),
    });
    for _ in 0..helpers {
        let t = Arc::clone(&ticket);
        rayon::spawn(move || t.help());
    }
    /// Closes the ticket and waits for the registered helpers, also when `job` unwinds.
    struct Close<'a>(&'a Ticket);
    impl Drop for Close<'_> {
        fn drop(&mut self) {
            self.0.state.fetch_or(CLOSED, Ordering::AcqRel);
            let mut spins = 0u32;
            while self.0.state.load(Ordering::Acquire) != CLOSED {
                spins = spins.saturating_add(1);
                if spins < 1 << 10 {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
        }
    }
    {
        let _close = Close(&ticket);
        // SAFETY: the job outlives this call (see above).
        unsafe { (*job)() };
    }
    let panicked = ticket.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some(payload) = panicked {
        std::panic::resume_unwind(payload);
    }
}

/// Bit 0 of [`Ticket::state`]: the calling thread has finished; the rest counts the
/// helpers running the job, in steps of [`HELPER`].
const CLOSED: usize = 1;
const HELPER: usize = 2;

/// The job of one [`share`] call, as its helpers see it.
struct Ticket {
    state: AtomicUsize,
    job: Job,
    /// The first panic of a helper's run, raised again by the calling thread.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

/// The job's address, valid while [`Ticket::state`] counts a helper (see [`share`]).
struct Job(*const (dyn Fn() + Sync + 'static));
// SAFETY: the job is `Sync`, and it is only called through this pointer by registered
// helpers while `share` keeps it alive.
unsafe impl Send for Job {}
// SAFETY: as above.
unsafe impl Sync for Job {}

impl Ticket {
    /// Runs the job if the calling thread has not finished it yet.
    fn help(&self) {
        let mut s = self.state.load(Ordering::Acquire);
        loop {
            if s & CLOSED != 0 {
                return;
            }
            match self
                .state
                .compare_exchange_weak(s, s + HELPER, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break,
                Err(now) => s = now,
            }
        }
        // SAFETY: registered above before the ticket closed, so the job is alive until
        // the `fetch_sub` below (see `share`).
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe { (*self.job.0)() }));
        if let Err(payload) = run {
            self.panic
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert(payload);
        }
        self.state.fetch_sub(HELPER, Ordering::AcqRel);
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
                // Shared: joined below the limit, on rayon's threads from it on.
                sized(big, || assert_eq!(mode(), Mode::Join));
                sized(JOIN_LIMIT_NS, || assert_eq!(mode(), Mode::Pool));
            }
        }
        assert!(!is_inline());
        let caught = std::panic::catch_unwind(|| inline(|| panic!("unwinds")));
        assert!(caught.is_err());
        assert!(!is_inline());
        assert_eq!(mode(), Mode::Pool);
    }

    /// A pool of two threads, for the tests of [`share`] (the global pool may have one).
    fn two_threads() -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("a pool of two threads")
    }

    /// Waits until `flag` is set, for at most 20 s (a helper that never comes fails the
    /// test instead of hanging it).
    fn wait_for(flag: &std::sync::atomic::AtomicBool) -> bool {
        let t = std::time::Instant::now();
        while !flag.load(Ordering::Acquire) {
            if t.elapsed() > std::time::Duration::from_secs(20) {
                return false;
            }
            std::thread::yield_now();
        }
        true
    }

    #[test]
    fn joined_loops_take_every_index_once_on_both_threads() {
        use std::sync::atomic::AtomicBool;
        let pool = two_threads();
        pool.install(|| {
            with_mode(Mode::Join, || {
                assert_eq!(threads(), 2);
                let me = std::thread::current().id();
                // The first index holds the calling thread until another thread has
                // taken one, so the helper is seen to join.
                let other = AtomicBool::new(false);
                let counts: Vec<AtomicUsize> = (0..64).map(|_| AtomicUsize::new(0)).collect();
                for_each_index(64, |i| {
                    counts[i].fetch_add(1, Ordering::Relaxed);
                    if std::thread::current().id() != me {
                        other.store(true, Ordering::Release);
                    } else if i == 0 {
                        assert!(wait_for(&other), "no helper joined");
                    }
                });
                assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1));
                assert!(other.load(Ordering::Acquire));

                let seen = Mutex::new(Vec::new());
                vec_for_each((0..50).collect(), |x: usize| seen.lock().unwrap().push(x));
                let mut seen = seen.into_inner().unwrap();
                seen.sort_unstable();
                assert_eq!(seen, (0..50).collect::<Vec<_>>());

                let mut buf = vec![0u32; 100];
                let inits = AtomicUsize::new(0);
                chunks_for_each(
                    &mut buf,
                    7,
                    || inits.fetch_add(1, Ordering::Relaxed),
                    |_, (i, c)| c.iter_mut().for_each(|x| *x += i as u32 + 1),
                );
                assert!(buf.iter().enumerate().all(|(j, &x)| x == (j / 7) as u32 + 1));
                assert!((1..=2).contains(&inits.load(Ordering::Relaxed)));
            })
        });
    }

    #[test]
    fn the_calling_thread_does_not_wait_for_a_helper_that_has_not_started() {
        use std::sync::atomic::AtomicBool;
        use std::sync::mpsc::channel;
        let pool = two_threads();
        // Occupy one of the two threads until released, by the test or, if the loop
        // below waits for that thread, by a watchdog after 10 s.
        let (started_tx, started_rx) = channel();
        let (release_tx, release_rx) = channel::<()>();
        pool.spawn(move || {
            let _ = started_tx.send(());
            let _ = release_rx.recv();
        });
        started_rx.recv().expect("the blocking job starts");
        let late = Arc::new(AtomicBool::new(false));
        let watchdog = {
            let (late, release_tx) = (Arc::clone(&late), release_tx.clone());
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_secs(10));
                late.store(true, Ordering::Release);
                let _ = release_tx.send(());
            })
        };
        let ran_here = pool.install(|| {
            let me = std::thread::current().id();
            let here = AtomicUsize::new(0);
            with_mode(Mode::Join, || {
                for_each_index(32, |_| {
                    if std::thread::current().id() == me {
                        here.fetch_add(1, Ordering::Relaxed);
                    }
                })
            });
            here.into_inner()
        });
        // The loop returned while the other thread was still blocked, having run every
        // index on the calling thread.
        assert!(
            !late.load(Ordering::Acquire),
            "the loop waited for the blocked thread"
        );
        assert_eq!(ran_here, 32);
        let _ = release_tx.send(());
        drop(watchdog); // (detached: it only sends to a job that has ended)
    }

    #[test]
    fn a_helper_panic_is_raised_on_the_calling_thread_after_the_helpers_finish() {
        use std::sync::atomic::AtomicBool;
        let pool = two_threads();
        for caller_panics in [false, true] {
            let (entered, done) = (AtomicBool::new(false), AtomicBool::new(false));
            let caught = pool.install(|| {
                let me = std::thread::current().id();
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    share(1, &|| {
                        if std::thread::current().id() == me {
                            assert!(wait_for(&entered), "no helper joined");
                            if caller_panics {
                                panic!("caller");
                            }
                        } else {
                            entered.store(true, Ordering::Release);
                            std::thread::sleep(std::time::Duration::from_millis(50));
                            done.store(true, Ordering::Release);
                            if !caller_panics {
                                panic!("helper");
                            }
                        }
                    })
                }))
            });
            let payload = caught.expect_err("the panic reaches the calling thread");
            let msg = payload.downcast_ref::<&str>().copied();
            assert_eq!(msg, Some(if caller_panics { "caller" } else { "helper" }));
            // Either way `share` returned only after the helper's run had ended.
            assert!(done.load(Ordering::Acquire));
        }
    }
}
