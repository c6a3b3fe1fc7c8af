//! Software prefetch: the request itself (`prefetch_bytes`, also behind
//! `View::prefetch_row`), and for the decode kernels, which stream K/V rows that are each
//! read once, and the decode-step projections, which stream a weight (read in place or
//! packed), how far ahead they ask ([`PF_KEYS`], [`avx512_decode_ahead`],
//! [`avx512_linear_ahead`], [`avx512_gemm_ahead`]) and whether the AVX-512 kernels ask at
//! all on this CPU ([`decode_prefetch_by_default`]); the same switch decides whether the
//! projection product's whole strips ask for their weight panels ahead
//! ([`avx512_gemm_strips`]).

/// How many keys ahead the decode kernels ask for K/V rows: all rows on AVX2, and on
/// AVX-512 f16/bf16 rows where [`avx512_decode_ahead`] asks at all (f32 rows half as
/// many).
#[cfg(target_arch = "x86_64")]
pub(crate) const PF_KEYS: usize = 16;

/// Asks for the cache lines of `bytes` bytes from `p` into the L1 (`prefetcht0`). A
/// prefetch is a hint that reads nothing and never faults, so `p` may point anywhere,
/// past the data included.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn prefetch_bytes(p: *const u8, bytes: usize) {
    prefetch_lines::<{ std::arch::x86_64::_MM_HINT_T0 }>(p, bytes)
}

/// Asks for the cache lines of `bytes` bytes from `p` into the L2 (`prefetcht1`), as
/// [`prefetch_bytes`] does into the L1.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn prefetch_bytes_l2(p: *const u8, bytes: usize) {
    prefetch_lines::<{ std::arch::x86_64::_MM_HINT_T1 }>(p, bytes)
}

/// Rows of a decode block for a kernel to ask for into the L2 while it runs: row 0, the
/// row stride and the row length, in bytes, and the row count. A score strip asks for
/// the block's V rows (`avx2::qk_dot`, `avx512::qk_dot_raw`), and where it did so,
/// `P·V` asks for the next block's K rows (`avx512::pv_rows`, `avx2::pv_rows`, through
/// [`Lines`]).
///
/// The decode score strips read 2–8 keys' K rows at a time, a few bytes of each in turn,
/// and `P·V` reads four V rows at a time, which the hardware prefetchers follow poorly
/// from DRAM; the kernels' own requests ask only [`PF_KEYS`] ahead, into the L1.
/// Asked for while the scores run, the V rows arrive while the strip works on K, and
/// `P·V` finds them in the L2. AVX2 forced on the Zen 4 VM, both threads, f32, in-process
/// probe (time asking over time not asking, 16 pairs): `decode_b4`'s shape 0.867,
/// `decode_gqa`'s 0.648, 4 rows over 16384 keys 0.650, 2 rows 0.816, 6 rows 0.723, 8
/// rows 0.845, 12 rows 0.875 (kernel notes). AVX-512 asks for them where its strips
/// read K rows interleaved or V rows are long (`avx512::decode::V_ASK_MIN_EV_LANES`).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(crate) struct AskRows {
    base: *const u8,
    stride: usize,
    len: usize,
    rows: usize,
}

#[cfg(target_arch = "x86_64")]
impl AskRows {
    /// The `nk` rows of `ev` elements, `ldv` elements apart, at the start of `v`.
    ///
    /// # Panics
    /// If `v` is too short for them (a prefetch cannot fault, but the kernels read the
    /// rows anyway).
    pub(crate) fn new(v: super::view::Data, ldv: usize, ev: usize, nk: usize) -> Self {
        let (size, (base, len)) = (v.elem_bytes(), v.raw_parts());
        assert!(nk == 0 || len >= (nk - 1) * ldv + ev, "rows past the slice");
        AskRows {
            base,
            stride: ldv * size,
            len: ev * size,
            rows: nk,
        }
    }

    /// Asks for rows `j0..j0 + n`, whole, into the L2 (past the block's last key too: a
    /// prefetch never faults).
    #[inline]
    pub(crate) fn ask(&self, j0: usize, n: usize) {
        for j in j0..j0 + n {
            prefetch_bytes_l2(self.base.wrapping_add(j * self.stride), self.len);
        }
    }

    /// The rows' first byte and their bytes in all, where they follow each other (`None`
    /// where they do not), for a loop to ask for them line by line.
    #[inline]
    pub(crate) fn span(&self) -> Option<(*const u8, usize)> {
        (self.stride == self.len).then_some((self.base, self.rows * self.len))
    }

    /// The length of a row, in bytes.
    #[inline]
    pub(crate) fn row_bytes(&self) -> usize {
        self.len
    }

    /// Row `j`'s start where the rows follow each other and are `len` bytes long, so that
    /// a loop can ask for them line by line.
    #[inline]
    pub(crate) fn contiguous(&self, len: usize, j: usize) -> Option<*const u8> {
        (self.stride == self.len && self.len == len).then(|| self.base.wrapping_add(j * self.stride))
    }
}

/// Lines that follow each other, for a kernel to ask for into the L2 a few at a time as
/// it runs (`P·V` of decode asks for the next block's K rows this way): the next line
/// and how many are left.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(crate) struct Lines {
    pub(crate) at: *const u8,
    pub(crate) left: usize,
}

#[cfg(target_arch = "x86_64")]
impl Lines {
    /// No lines.
    pub(crate) const NONE: Lines = Lines {
        at: std::ptr::null(),
        left: 0,
    };

    /// The lines of `rows` where they follow each other ([`AskRows::span`]), else none:
    /// from the line that holds their first byte to the one that holds their last.
    pub(crate) fn of(rows: Option<AskRows>) -> Lines {
        match rows.and_then(|r| r.span()) {
            Some((at, bytes)) if bytes > 0 => Lines {
                at,
                left: (at as usize % 64 + bytes).div_ceil(64),
            },
            _ => Lines::NONE,
        }
    }

    /// The next `n` lines (all that are left, if fewer), which this moves past.
    #[inline]
    pub(crate) fn take(&mut self, n: usize) -> Lines {
        let n = n.min(self.left);
        let head = Lines { at: self.at, left: n };
        self.at = self.at.wrapping_add(64 * n);
        self.left -= n;
        head
    }

    /// Asks for them all into the L2, now.
    #[inline]
    pub(crate) fn ask(self) {
        prefetch_bytes_l2(self.at, 64 * self.left);
    }
}

/// [`prefetch_bytes`] with the hint `H`.
#[cfg(target_arch = "x86_64")]
#[inline]
fn prefetch_lines<const H: i32>(p: *const u8, bytes: usize) {
    let mut b = 0;
    while b < bytes {
        // SAFETY: a prefetch touches no memory the program can observe and cannot fault,
        // whatever the address (SSE, which every x86-64 CPU has).
        #[allow(unused_unsafe)]
        unsafe {
            std::arch::x86_64::_mm_prefetch::<H>((p as *const i8).wrapping_add(b))
        };
        b += 64;
    }
}

/// Whether the AVX-512 decode kernels ask for K/V rows ahead (and the projection
/// product for weight lines) when `CANDLE_ATTENTION_DECODE_PREFETCH` does not say
/// (`1` on, `0` off; read once per process, at the first use): on Intel CPUs, where it
/// made decode of long caches and the projections faster, and not on others (see the
/// kernel notes). Does not read the variable.
pub fn decode_prefetch_by_default() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::isa::cpu_vendor() == *b"GenuineIntel"
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the AVX-512 decode kernels ask for K/V rows ahead, and the projection product
/// for weight lines: `CANDLE_ATTENTION_DECODE_PREFETCH` if it is `1` or `0`
/// (read once per process), else [`decode_prefetch_by_default`]. On an Intel Xeon VM
/// (AVX-512, AMX) it made bf16 and f16 `decode_b4` about 1.6–2× faster, and f32 decode
/// with GQA or MQA over K/V out of cache 10–21% faster; on an AMD Zen 4 VM it made no
/// consistent difference to half-precision decode and slowed bf16 `decode_b4` (kernel
/// notes).
#[cfg(target_arch = "x86_64")]
fn decode_rows() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(
        || match std::env::var("CANDLE_ATTENTION_DECODE_PREFETCH").as_deref() {
            Ok("1") => true,
            Ok("0") => false,
            _ => decode_prefetch_by_default(),
        },
    )
}

/// How many bytes ahead `linear_in_place` asks for weight lines on AVX-512, one 64-byte
/// line per line read: 0 (it does not ask) unless [`decode_rows`], else 4 KiB. On the
/// Intel VM, a decode step's product of 1–3 rows with an f32 weight took 6–19% less
/// time with it than with nothing asked, and with a bf16 or f16 weight 12–41% less than
/// with whole rows asked for 16 rows ahead; 2 KiB ran about as fast and 8 KiB slower
/// (kernel notes).
#[cfg(target_arch = "x86_64")]
pub(crate) fn avx512_linear_ahead() -> usize {
    if decode_rows() {
        4096
    } else {
        0
    }
}

/// How many contraction steps (64-byte panel rows) ahead the AVX-512 product of a
/// decode step's 2–13 rows against a packed weight asks for each panel's lines: 0 (it
/// does not ask) unless [`decode_rows`], else 32 (2 KiB per panel, 4 KiB for the two
/// panels a tile reads). On the Intel VM, 2–13 rows against a packed 14336 × 4096 weight
/// took 7–21% less time; weights that stay in the L3, and a single row, ran about as
/// fast (kernel notes).
#[cfg(target_arch = "x86_64")]
pub(crate) fn avx512_gemm_ahead() -> usize {
    if decode_rows() {
        32
    } else {
        0
    }
}

/// Whether the AVX-512 projection product's whole 14-row strips ask for the weight
/// panels' lines `avx512::linear::GEMM_LOOP_AHEAD` steps ahead of reading them: where
/// [`decode_rows`] (the same switch). The panels of a 768-step contraction chunk
/// (96 KiB) come from L2; on the Intel VM, products with 4096 inputs took 10–15% less
/// time with it and whole `MultiheadAttention` layers 3–10% less, while products with
/// 768 inputs moved by −7% to +8% (kernel notes).
#[cfg(target_arch = "x86_64")]
pub(crate) fn avx512_gemm_strips() -> bool {
    decode_rows()
}

/// Whether the AVX2 decode strips that walk each f32 K row to its end
/// (`avx2::decode::qk_rows_walk`) ask for the K rows [`PF_KEYS`] ahead: where
/// [`decode_rows`], as the AVX-512 kernels do. On the Zen 4 VM (AVX2 forced, time with
/// over time without, in-process probe against the earlier strips) it made no
/// consistent difference to one row (0.799 and 0.851 with, 0.835–0.859 without) and
/// slowed 2–4 rows (0.830–0.917 with, 0.713–0.886 without); Intel CPUs were not
/// measured (kernel notes).
#[cfg(target_arch = "x86_64")]
pub(crate) fn avx2_walk_ahead() -> bool {
    decode_rows()
}

/// How many keys ahead the AVX-512 decode kernels ask for K/V rows of `elem_bytes`-byte
/// elements read in place: 0 (they do not ask) unless [`decode_rows`], else [`PF_KEYS`]
/// for f16/bf16 rows and half as many for f32 rows, so that both ask the same number of
/// bytes ahead (4 KiB with heads of 128). On the Intel VM, f32 rows asked 4, 8 or 16 keys
/// ahead ran alike and 32 or 64 keys ahead slower (kernel notes). Projections that read
/// weights in place (`linear`) ask differently ([`avx512_linear_ahead`]): whole weight
/// rows asked for this many rows ahead made them slower.
#[cfg(target_arch = "x86_64")]
pub(crate) fn avx512_decode_ahead(elem_bytes: usize) -> usize {
    if decode_rows() {
        PF_KEYS * 2 / elem_bytes.clamp(2, 4)
    } else {
        0
    }
}
