//! Per-thread scratch kept between calls: the block buffers of [`Scratch`] and the K/V
//! pack buffers of [`PackCache`].

use super::*;

/// Per-thread scratch buffers, reused across work items.
pub(super) struct Scratch {
    pub(super) dims: (usize, usize),
    pub(super) q: AlignedBuf,
    pub(super) qp: AlignedBuf,
    pub(super) s: AlignedBuf,
    pub(super) o: AlignedBuf,
    pub(super) kp: AlignedBuf,
    pub(super) vp: AlignedBuf,
    pub(super) m: Vec<f32>,
    pub(super) l: Vec<f32>,
    /// Each row's softmax sum as 16 lane-wise partial sums, on the AVX-512 f32 path
    /// (`avx512::qk_softmax`, `avx512::online_rows_lazy`): `process` adds them into `l`
    /// once, after its last key block.
    pub(super) l16: Vec<f32>,
    pub(super) alpha: Vec<f32>,
    pub(super) lo: Vec<usize>,
    pub(super) hi: Vec<usize>,
    pub(super) hh: Vec<usize>,
    pub(super) ii: Vec<usize>,
    pub(super) tmp: Vec<f32>,
    pub(super) row: Vec<f32>,
    /// AMX operands (bf16 bits), sized on first use: Q components, P components, one
    /// K and one V block, and the row staging of the packers.
    #[cfg(target_arch = "x86_64")]
    pub(super) amx_bufs: AmxBufs,
}

/// Scratch of the AMX path (empty until used).
#[cfg(target_arch = "x86_64")]
#[derive(Default)]
pub(super) struct AmxBufs {
    pub(super) s: AVec<f32>,
    /// Each row's softmax sum as 16 lane-wise partial sums (`avx512::softmax_row_bf16`).
    pub(super) l16: AVec<f32>,
    pub(super) qa: AVec<u16>,
    pub(super) pa: AVec<u16>,
    pub(super) ka: AVec<u16>,
    pub(super) va: AVec<u16>,
    pub(super) rows: AVec<u16>,
}

thread_local! {
    /// Per-thread scratch kept between calls (a few hundred KiB), avoiding fresh
    /// page faults on every call.
    static SCRATCH: RefCell<Option<Scratch>> = const { RefCell::new(None) };
}

/// Runs `f` with this thread's cached scratch for `(e, ev)` (a private one if the
/// cache is busy or sized for other dims).
pub(super) fn with_scratch<R>(e: usize, ev: usize, f: impl FnOnce(&mut Scratch) -> R) -> R {
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

/// The scores of a decode block (at most `DECODE_MAX_ROWS` rows of
/// `DECODE_BK_MAX` keys) fit the scratch's two blocks of `BQ` rows, and a decode block
/// is whole 64-key blocks (`online_rows` updates 128 keys at a time on AVX-512, 64 on
/// AVX2). Groups of up to `DECODE_MAX_ROWS_LANES` rows take fewer keys per block where
/// they would not fit (`block::process`), and at least two 64-key blocks fit them; f16
/// groups stay within that (`DECODE_MAX_ROWS_F16`).
#[cfg(target_arch = "x86_64")]
const _SCORES_FIT_DECODE: () = {
    use super::super::decode::{DECODE_BK_MAX, DECODE_MAX_ROWS, DECODE_MAX_ROWS_F16, DECODE_MAX_ROWS_LANES};
    assert!(DECODE_MAX_ROWS * DECODE_BK_MAX <= BQ.div_ceil(ROW_ALIGN) * ROW_ALIGN * 2 * BK);
    assert!(DECODE_MAX_ROWS_LANES * 2 * BK <= BQ.div_ceil(ROW_ALIGN) * ROW_ALIGN * 2 * BK);
    assert!(DECODE_MAX_ROWS_F16 <= DECODE_MAX_ROWS_LANES);
    assert!(DECODE_BK_MAX.is_multiple_of(BK));
};

impl Scratch {
    fn new(e: usize, ev: usize) -> Self {
        let rp = BQ.div_ceil(ROW_ALIGN) * ROW_ALIGN;
        let evp = ev.div_ceil(NR) * NR;
        Self {
            dims: (e, ev),
            q: AlignedBuf::new(rp * e),
            qp: AlignedBuf::new(rp * e),
            // Two blocks' scores (the AVX-512 path pairs full blocks, `process`), or the
            // scores of a decode block (`_SCORES_FIT_DECODE` below).
            s: AlignedBuf::new(rp * 2 * BK),
            o: AlignedBuf::new(rp * evp),
            kp: AlignedBuf::new(k_block_len(BK, e)),
            vp: AlignedBuf::new(v_block_len(BK, ev)),
            m: vec![0.0; rp],
            l: vec![0.0; rp],
            l16: vec![0.0; rp * 16],
            alpha: vec![1.0; rp],
            lo: vec![0; rp],
            hi: vec![0; rp],
            hh: vec![0; rp],
            ii: vec![0; rp],
            tmp: vec![0.0; NR * e.max(evp)],
            row: vec![0.0; evp],
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
pub(super) const KEEP_PACK_BYTES: usize = PACK_BUDGET_BYTES;

thread_local! {
    /// This thread's last K/V pack buffers (f32 and bf16 bits), reused by its next call:
    /// a fresh multi-MB buffer costs a page fault per page or a full zeroing every call.
    static PACKS_F32: RefCell<AVec<f32>> = RefCell::new(AVec::default());
    static PACKS_U16: RefCell<AVec<u16>> = RefCell::new(AVec::default());
}

/// Element types with a per-thread pack cache.
pub(super) trait Cached: Copy + Default + 'static {
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
pub(super) struct PackCache<T: Cached> {
    pub(super) buf: AVec<T>,
}

impl<T: Cached> PackCache<T> {
    pub(super) fn take(len: usize) -> Self {
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
