//! `y = x · Wᵀ + b` on bf16 pair products for bf16 and f16 weights and f32 or bf16 `x`
//! ([`Xs`]), with the sums in f32: on the AMX tile unit (`TDPBF16PS`), or without AMX on
//! AVX512-BF16 register tiles (`VDPBF16PS`, `dpbf16::gemm`; [`unit()`]). For a bf16 weight every product is exact, as in the f32
//! products of `linear` (which sum in another order); for an f16 weight too, but for an
//! x of half-precision values ([`runs`]), whose products skip `lo · lo` as the attention
//! kernel's f16 products do (see [`product`]).
//!
//! - The weight `W (out, in)` is packed once per call (or once per layer, `linear`'s
//!   `PackedWeight`) into the VNNI blocks of the attention kernel's K blocks
//!   (`vnni::pack_k`, outputs as keys): bf16 as one bf16 component, f16 as the exact
//!   `hi + lo` (`hi` rounded to nearest, so `|lo| ≤ 2⁻⁸·|w|`).
//! - Each row block of `x` is split into three bf16 components `hi + mid + lo`, which sum
//!   to the f32 value exactly (24 significant bits in three of 8, rounded to nearest; the
//!   parts of values below about 2⁻¹⁰³ that fall under bf16's normal range are dropped,
//!   as the tile unit reads subnormal inputs as zero). Components that are zero in every
//!   row of the block are not multiplied: a bf16 layer's input is one component (given
//!   as bf16, it is copied as it is). A zero component would only add zeros, so
//!   skipping it leaves the result unchanged (but for the sign of a zero).
//! - The block products are `amx::gemm_tiles`: 2 × 2 tiles of 16 rows by 16 outputs,
//!   over the pairs of components (each W tile loaded once per contraction tile and
//!   multiplied by x's components), the bias as the accumulators' starting value. Whole
//!   tiles are stored in place, after their lines are asked for with `prefetchw`; the
//!   last row tile and a partial last panel go through a scratch tile. On the register
//!   tiles, `dpbf16::gemm` takes strips of 6 rows by a block of 64 outputs instead
//!   ([`pair_blocks`]).
//! - Rows of `x` with a value that bf16 cannot hold (±inf, NaN, or beyond bf16's largest
//!   finite value) would split into `inf + NaN`; they are recomputed by f32 dot products
//!   against the packed weight, so they give what the f32 product gives (±inf or NaN).
//!   A weight with a non-finite value is not packed here (`pack` says so), and `linear`
//!   runs its f32 product instead.

use super::aligned::AVec;
use super::amx::{self, Unit};
use super::dpbf16;
use super::par;
use super::tiles::{BK, NR};
use super::view::{Data, View};
use super::vnni::{e_pad, k_len, TILE, TK, TM};
use candle::DType;
use std::arch::x86_64::*;
use std::mem::MaybeUninit;

/// Rows per parallel work item (about; whole 16-row tiles), as in `linear`.
const ROWS: usize = 144;
/// Row stride (floats) of the scratch that receives the tile stores: one block of
/// outputs and one cache line more, so that a tile's 16 rows do not share a few L1 sets
/// (see the AMX score rows, `driver::amx_block::SLD`).
const SLD: usize = BK + 16;

/// bf16 components of a weight of `dtype` in a pack (1 for bf16, 2 for f16), or `None`
/// for dtypes the pack does not take.
pub(crate) fn weight_comps(dtype: DType) -> Option<usize> {
    match dtype {
        DType::BF16 => Some(1),
        DType::F16 => Some(2),
        _ => None,
    }
}

/// Whether this process runs the products of `rows` rows of an x of half-precision
/// values (`half_x`) or not against weights of `dtype` here: bf16 weights, and f16
/// weights against a half-precision x of [`F16_ROWS`] rows or more, where the AMX tile
/// unit is enabled for the attention kernel (`kernels::cpu::amx_enabled`: AMX
/// available, the AVX-512 instruction set selected, `CANDLE_ATTENTION_AMX` not `0`;
/// read per call).
///
/// An f16 weight is two components. Against an f16 x (two components too) its products
/// skip `lo · lo` ([`product`]): three tile products per step. Whole f16
/// `MultiheadAttention` layers, whose projections round to f16 since 2026-12-06, then
/// took 11–49% less time than on the f32 product (Intel VM, 2026-12-06, one process,
/// alternating, four shapes; kernel notes), where with all four products they took
/// −41% to +7%. An f32 x would need six tile products per step, exact, and
/// 1024×768×2304 took 2–26% more time that way than on the f32 product, so an f32 x
/// keeps the f32 product.
///
/// Without AMX, on AVX512-BF16 register tiles (`VDPBF16PS`, AMD Zen 4 and later), a bf16
/// weight runs here against a half-precision x of any number of rows: a bf16 x is one
/// component, so each `VDPBF16PS` does the work of two f32 FMAs, and the pack is half
/// the bytes of the f32 product's. On the Zen 4 VM (2026-12-06) that ran 1024×768×2304
/// at 360–370 GFLOP/s against 186–194 on the f32 product, and 1–16 rows against a kept
/// pack 1.3–4.2 times faster (kernel notes). An f32 x would be three components (1.5
/// times the f32 product's work), and an f16 weight two, so they keep the f32 product.
pub(crate) fn runs(dtype: DType, rows: usize, half_x: bool) -> bool {
    match unit() {
        Some(Unit::Tiles) => match dtype {
            DType::BF16 => true,
            DType::F16 => half_x && rows >= F16_ROWS,
            _ => false,
        },
        Some(Unit::Avx512Bf16) => dtype == DType::BF16 && half_x,
        None => false,
    }
}

/// Fewest rows whose products against an f16 weight run here ([`runs`]). Fewer rows
/// keep the f32 product: the tile unit computes whole 16-row tiles, and against an f16
/// weight, which is as many bytes as the f32 product's panels, 2–13 rows ran up to 71%
/// slower here than there (six of seven readings slower), where 16 rows ran 13–41%
/// faster (kernel notes).
pub(crate) const F16_ROWS: usize = TM;

/// What runs the products here (read per call): the unit that runs the attention
/// kernel's bf16 block products (`kernels::cpu::amx_plan`), the AMX tile unit where it
/// is enabled, else AVX512-BF16 register tiles where they are (`CANDLE_ATTENTION_AMX`
/// and `CANDLE_ATTENTION_AVX512BF16` set to `0` turn them off); `None` without either.
pub(crate) fn unit() -> Option<Unit> {
    super::amx_plan(DType::BF16, super::isa::Isa::selected()).map(|p| p.unit)
}

/// `u16` elements of the pack of an `(out, in)` weight of `comps` components.
pub(crate) fn pack_len((out, inp): (usize, usize), comps: usize) -> usize {
    out.div_ceil(BK) * k_len(inp, comps)
}

/// Packs `W (out, in)` (bf16 or f16, `comps` from [`weight_comps`]) into `dst`
/// ([`pack_len`] elements) in blocks of [`BK`] outputs, in parallel. Returns whether
/// every weight is finite; when it returns false the pack must not be used.
///
/// # Safety
/// [`unit()`] returned a unit (AVX-512F and AVX512-BF16 are available: both units need
/// them, and the packs and the split of x use them too).
pub(crate) unsafe fn pack(wd: Data, (out, inp): (usize, usize), comps: usize, dst: &mut [u16]) -> bool {
    assert_eq!(dst.len(), pack_len((out, inp), comps));
    let view = View {
        data: wd,
        start: 0,
        strides: [0, 0, inp, 1],
    };
    let ep = e_pad(inp);
    let klen = k_len(inp, comps);
    let finite = std::sync::atomic::AtomicBool::new(true);
    par::chunks_for_each(
        dst,
        klen,
        || (vec![0u16; comps * BK * ep], vec![0f32; inp]),
        |(rows, tmp), (j, blk)| {
            let o0 = j * BK;
            // SAFETY: the caller's guarantee; `blk` holds `k_len` elements, `rows` and
            // `tmp` the scratch `pack_k` asks for.
            unsafe { super::vnni::pack_k(&view, 0, 0, o0, BK.min(out - o0), inp, comps, blk, rows, tmp) };
            // Component 0 (`hi`) is ±inf or NaN exactly where the weight is.
            let hi = &blk[..klen / comps];
            if hi.iter().any(|&h| h & 0x7f80 == 0x7f80) {
                finite.store(false, std::sync::atomic::Ordering::Relaxed);
            }
        },
    );
    finite.into_inner()
}

/// `n` rows of x split into bf16 components for the tile products.
struct SplitX {
    /// Component `c`, row `r`, element `k` at `c·cs + r·ld + k`; rows padded to whole
    /// tiles and elements to `ld` with zeros.
    data: AVec<u16>,
    /// Row stride (`e_pad(in)`).
    ld: usize,
    /// Component stride (`ld` × rows padded to a multiple of 16).
    cs: usize,
    /// Components with a non-zero element (1–3).
    comps: usize,
    /// Rows with a value that bf16 cannot hold (see the module doc).
    bad: Vec<usize>,
}

thread_local! {
    /// This thread's buffer for [`SplitX`], reused across calls: a fresh one of a few MB
    /// would page-fault on every call.
    static SPLIT: std::cell::RefCell<AVec<u16>> = std::cell::RefCell::new(AVec::default());
}

/// Largest [`SPLIT`] buffer (elements) a thread keeps between calls (8 MiB).
const KEEP_SPLIT: usize = 4 << 20;

impl Drop for SplitX {
    fn drop(&mut self) {
        let data = std::mem::take(&mut self.data);
        if data.len() <= KEEP_SPLIT {
            SPLIT.with(|cell| {
                if let Ok(mut b) = cell.try_borrow_mut() {
                    *b = data;
                }
            });
        }
    }
}

/// One row of x (`row`) as bf16 components: `hi` at `dst`, and, when `cs > 0`, `mid`
/// at `dst + cs` and `lo` at `dst + 2·cs`, `ld` elements each (zero past the row; `mid`
/// and `lo` also zero where `hi` is not finite). Returns whether the row has a value that
/// bf16 cannot hold (±inf, NaN, beyond its range), and whether its finite values need
/// `mid` and `lo`: with `cs == 0` both say whether any finite value differs from its
/// `hi` (then `mid` or `lo` is non-zero but for values below bf16's normal range).
///
/// # Safety
/// AVX-512F, AVX512DQ and AVX512-BF16 are available; `dst` (and the other components)
/// hold `ld ≥ row.len()` elements, a multiple of 16.
#[target_feature(enable = "avx512f,avx512dq,avx512bf16")]
unsafe fn split_row(row: &[f32], ld: usize, dst: *mut u16, cs: usize) -> (bool, bool, bool) {
    let n = row.len();
    let (mut any_mid, mut any_lo) = (_mm256_setzero_si256(), _mm256_setzero_si256());
    let (mut nonfinite, mut rest): (__mmask16, __mmask16) = (0, 0);
    let bits = |v: __m256bh| std::mem::transmute::<__m256bh, __m256i>(v);
    let mut k = 0;
    while k < ld {
        let v = if k + 16 <= n {
            _mm512_loadu_ps(row.as_ptr().add(k))
        } else {
            _mm512_maskz_loadu_ps(
                super::avx512::tail_mask_full(n.saturating_sub(k)),
                row.as_ptr().add(k),
            )
        };
        let h = _mm512_cvtneps_pbh(v);
        let hf = _mm512_cvtpbh_ps(h);
        // ±inf (0x08, 0x10) or NaN (0x01, 0x80).
        let nf = _mm512_fpclass_ps_mask::<0x99>(hf);
        nonfinite |= nf;
        _mm256_storeu_si256(dst.add(k) as *mut __m256i, bits(h));
        if cs == 0 {
            rest |= _mm512_mask_cmp_ps_mask::<_CMP_NEQ_UQ>(!nf, v, hf);
        } else {
            let r1 = _mm512_maskz_sub_ps(!nf, v, hf);
            let mi = _mm512_cvtneps_pbh(r1);
            let lo = _mm512_cvtneps_pbh(_mm512_sub_ps(r1, _mm512_cvtpbh_ps(mi)));
            let (mi, lo) = (bits(mi), bits(lo));
            any_mid = _mm256_or_si256(any_mid, mi);
            any_lo = _mm256_or_si256(any_lo, lo);
            _mm256_storeu_si256(dst.add(cs + k) as *mut __m256i, mi);
            _mm256_storeu_si256(dst.add(2 * cs + k) as *mut __m256i, lo);
        }
        k += 16;
    }
    if cs == 0 {
        return (nonfinite != 0, rest != 0, rest != 0);
    }
    // Bits other than the sign: a component of −0 is zero too.
    let magnitude = _mm256_set1_epi16(0x7fff);
    let nonzero = |v: __m256i| _mm256_testz_si256(v, magnitude) == 0;
    (nonfinite != 0, nonzero(any_mid), nonzero(any_lo))
}

/// Rows of x, row-major: f32 values, or the bits of bf16 values (a bf16 layer's input,
/// which is its own one bf16 part: no f32 copy of it is made).
#[derive(Clone, Copy)]
pub(crate) enum Xs<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

impl<'a> Xs<'a> {
    /// Elements.
    fn len(self) -> usize {
        match self {
            Xs::F32(x) => x.len(),
            Xs::Bf16(x) => x.len(),
        }
    }

    /// Elements `range`.
    fn slice(self, range: std::ops::Range<usize>) -> Xs<'a> {
        match self {
            Xs::F32(x) => Xs::F32(&x[range]),
            Xs::Bf16(x) => Xs::Bf16(&x[range]),
        }
    }

    /// All elements as f32 values.
    pub(crate) fn to_f32(self) -> std::borrow::Cow<'a, [f32]> {
        self.f32s(0..self.len())
    }

    /// Elements `range` as f32 values.
    fn f32s(self, range: std::ops::Range<usize>) -> std::borrow::Cow<'a, [f32]> {
        let bf = |bits: u16| f32::from_bits((bits as u32) << 16);
        match self {
            Xs::F32(x) => std::borrow::Cow::Borrowed(&x[range]),
            Xs::Bf16(x) => std::borrow::Cow::Owned(x[range].iter().map(|&b| bf(b)).collect()),
        }
    }
}

/// This thread's [`SPLIT`] buffer (or a fresh one), grown to `len` elements.
fn split_buffer(len: usize) -> AVec<u16> {
    let mut data = SPLIT.with(|cell| {
        cell.try_borrow_mut()
            .map(|mut b| std::mem::take(&mut *b))
            .unwrap_or_default()
    });
    data.grow(len);
    data
}

/// Splits `n` rows of `inp` elements (row stride `ldx`) into [`SplitX`]. bf16 rows are
/// one part, copied as they are: the same part that the split of their f32 values
/// makes (bf16 subnormals included, which both units read as zero; ±inf and NaN mark
/// the row for [`dot_row`], as there).
///
/// # Safety
/// AVX-512F, AVX512DQ and AVX512-BF16 are available.
unsafe fn split_rows(xs: Xs, ldx: usize, n: usize, inp: usize) -> SplitX {
    assert!(n == 0 || xs.len() >= (n - 1) * ldx + inp);
    match xs {
        Xs::F32(xs) => split_f32_rows(xs, ldx, n, inp),
        Xs::Bf16(xs) => {
            let ld = e_pad(inp);
            let n16 = n.div_ceil(TM) * TM;
            let mut data = split_buffer(n16 * ld);
            let mut bad = Vec::new();
            for (r, dst) in data[..n16 * ld].chunks_exact_mut(ld).enumerate() {
                let row = if r < n { &xs[r * ldx..r * ldx + inp] } else { &[] };
                dst[..row.len()].copy_from_slice(row);
                dst[row.len()..].fill(0);
                // The largest exponent field (a max, which vectorises).
                if row.iter().fold(0, |m, &b| m.max(b & 0x7f80)) == 0x7f80 {
                    bad.push(r);
                }
            }
            SplitX {
                data,
                ld,
                cs: n16 * ld,
                comps: 1,
                bad,
            }
        }
    }
}

/// [`split_rows`] of f32 rows.
///
/// # Safety
/// As for [`split_rows`].
#[target_feature(enable = "avx512f,avx512dq,avx512bf16")]
unsafe fn split_f32_rows(xs: &[f32], ldx: usize, n: usize, inp: usize) -> SplitX {
    let ld = e_pad(inp);
    let n16 = n.div_ceil(TM) * TM;
    let cs = n16 * ld;
    let mut data = split_buffer(3 * cs);
    let d = data.as_mut_ptr();
    let (mut any_mid, mut any_lo) = (false, false);
    let mut bad = Vec::new();
    // Until a row needs `mid` or `lo`, only `hi` is stored (a bf16 layer's input never
    // needs them); the first row that does zeroes them for the rows before it.
    let mut full = false;
    for r in 0..n {
        let row = &xs[r * ldx..r * ldx + inp];
        let at = d.add(r * ld);
        let parts = if full { cs } else { 0 };
        let (mut nonfinite, mut mid, mut lo) = split_row(row, ld, at, parts);
        if !full && (mid || lo) {
            full = true;
            for c in 1..3 {
                std::ptr::write_bytes(d.add(c * cs), 0, r * ld);
            }
            (nonfinite, mid, lo) = split_row(row, ld, at, cs);
        }
        if nonfinite {
            bad.push(r);
        }
        any_mid |= mid;
        any_lo |= lo;
    }
    // Padding rows are zero (the buffer may hold an earlier split) in the components
    // read.
    for c in 0..if full { 3 } else { 1 } {
        std::ptr::write_bytes(d.add(c * cs + n * ld), 0, (n16 - n) * ld);
    }
    let comps = if any_lo {
        3
    } else if any_mid {
        2
    } else {
        1
    };
    SplitX {
        data,
        ld,
        cs,
        comps,
        bad,
    }
}

/// `y = x · Wᵀ (+ b)` for `x (rows, in)` (row-major, f32) against the pack `wp` of `cw`
/// components ([`pack`]), into `y` (`rows · out`, all written). Row blocks of about
/// [`ROWS`] rows run in parallel; with fewer 16-row tiles than threads (a decode step) the
/// threads split the output blocks instead.
///
/// With `half_x` (x holds f16/bf16 values, whose products the caller rounds to a half
/// dtype), the components of W after the first (an f16 weight's `lo`) are multiplied
/// only by x's first (`hi`): for an f16 x that skips `lo · lo`, a term of at most
/// `2⁻¹⁶·|x·w|` (each `lo` is at most `2⁻⁸` of its value), so each output is within
/// `2⁻¹⁶·Σ|x·w|` of the exact sum (plus the f32 sums' rounding), far below f16's own
/// rounding of `2⁻¹¹`. It changes nothing for a bf16 weight (one component) or a bf16 x
/// (one component). Without `half_x`, every pair of components is multiplied and every
/// product is exact.
///
/// The results are written to `y` as f32, or rounded to bf16/f16 ([`Rows::Half`]) with
/// the bits of `cast::to_dtype`, so that a half-precision layer need not write f32 rows
/// and read them back to round them.
///
/// The products run on [`unit()`] (on AVX512-BF16 register tiles if another thread has
/// turned both units off since the caller's check): both give the same products, summed
/// in different orders.
///
/// # Safety
/// [`unit()`] returned a unit, and [`pack`] returned true for `wp`.
pub(crate) unsafe fn product(
    xv: Xs,
    (wp, cw): (&[u16], usize),
    bv: Option<&[f32]>,
    dims: (usize, usize, usize),
    half_x: bool,
    y: Rows,
) {
    let unit = unit().unwrap_or(Unit::Avx512Bf16);
    product_on(unit, xv, (wp, cw), bv, dims, half_x, y)
}

/// [`product`] on `unit`.
///
/// # Safety
/// As for [`product`], and `unit` is available ([`amx::available`] for the tile unit).
#[allow(clippy::too_many_arguments)]
unsafe fn product_on(
    unit: Unit,
    xv: Xs,
    (wp, cw): (&[u16], usize),
    bv: Option<&[f32]>,
    (rows, inp, out): (usize, usize, usize),
    half_x: bool,
    y: Rows,
) {
    assert!(y.len() == rows * out && xv.len() == rows * inp);
    assert!(wp.len() == pack_len((out, inp), cw) && bv.is_none_or(|b| b.len() == out));
    if rows == 0 || out == 0 {
        return;
    }
    if rows.div_ceil(TM) < par::threads() {
        return product_by_columns(unit, xv, (wp, cw), bv, (rows, inp, out), half_x, y);
    }
    let bp = padded_bias(bv, out);
    let block = |(r0, ys): (usize, Dst)| {
        let n = ys.len / out;
        // SAFETY: the caller's guarantees; `ys` holds rows `r0..r0 + n` of `y`.
        unsafe {
            let xs = xv.slice(r0 * inp..(r0 + n) * inp);
            let sx = split_rows(xs, inp, n, inp);
            blocks_into(
                (xs, &sx),
                (wp, cw),
                (bv, bp.as_deref()),
                (n, inp, out),
                (0, out.div_ceil(BK)),
                (unit, half_x),
                ys,
                out,
            );
        }
    };
    let blocks: Vec<(usize, Dst)> = match y {
        Rows::F32(y) => par::row_blocks(y, (rows, out), TM, ROWS)
            .into_iter()
            .map(|(r0, ys)| (r0, Dst::f32(ys)))
            .collect(),
        Rows::Half(y, dt) => par::row_blocks(y, (rows, out), TM, ROWS)
            .into_iter()
            .map(|(r0, ys)| (r0, Dst::half(ys, dt)))
            .collect(),
    };
    par::vec_for_each(blocks, block);
}

/// Where [`product`] writes its `rows · out` results (row-major), all of them.
pub(crate) enum Rows<'a> {
    /// As computed.
    F32(&'a mut [MaybeUninit<f32>]),
    /// Rounded to `dtype` (bf16 or f16), bit for bit as `cast::to_dtype` rounds f32.
    Half(&'a mut [MaybeUninit<u16>], DType),
}

impl Rows<'_> {
    /// Elements of the output.
    pub(crate) fn len(&self) -> usize {
        match self {
            Rows::F32(y) => y.len(),
            Rows::Half(y, _) => y.len(),
        }
    }
}

/// A run of `len` output elements that [`blocks_into`] writes, f32 or rounded
/// ([`Rows`]); a raw pointer, so that the threads' disjoint row blocks can be passed
/// around as values.
#[derive(Clone, Copy)]
struct Dst {
    ptr: *mut u8,
    len: usize,
    /// `None` for f32; the dtype rounded to otherwise.
    half: Option<DType>,
}

// SAFETY: a `Dst` is made from a `&mut` slice that the thread holding it writes alone
// (`row_blocks` and the column parts hand out disjoint runs).
unsafe impl Send for Dst {}

impl Dst {
    fn f32(y: &mut [MaybeUninit<f32>]) -> Self {
        Dst {
            ptr: y.as_mut_ptr().cast(),
            len: y.len(),
            half: None,
        }
    }

    fn half(y: &mut [MaybeUninit<u16>], dt: DType) -> Self {
        assert!(matches!(dt, DType::BF16 | DType::F16), "rounding to {dt:?}");
        Dst {
            ptr: y.as_mut_ptr().cast(),
            len: y.len(),
            half: Some(dt),
        }
    }

    /// The f32 element `at`, where the output is f32.
    fn f32_at(self, at: usize) -> Option<*mut f32> {
        assert!(at < self.len);
        // SAFETY: inside the run (asserted).
        self.half
            .is_none()
            .then(|| unsafe { (self.ptr as *mut f32).add(at) })
    }

    /// Writes `src` at elements `at..at + src.len()`: copied, or rounded.
    ///
    /// # Safety
    /// AVX-512F is available (for the rounding).
    unsafe fn put(self, at: usize, src: &[f32]) {
        assert!(at + src.len() <= self.len);
        match self.half {
            None => std::ptr::copy_nonoverlapping(src.as_ptr(), (self.ptr as *mut f32).add(at), src.len()),
            Some(dt) => super::cast::round_avx512(dt, (self.ptr as *mut u16).add(at), src),
        }
    }
}

/// The bias with zeros up to whole blocks of [`BK`] outputs, as [`amx::gemm_tiles`]
/// reads it.
fn padded_bias(bv: Option<&[f32]>, out: usize) -> Option<AVec<f32>> {
    bv.map(|b| {
        let mut p = AVec::new(out.div_ceil(BK) * BK);
        p[..out].copy_from_slice(&b[..out]);
        p
    })
}

/// [`product`] for fewer 16-row tiles than threads: x is split once, and the threads
/// take runs of output blocks, each into a buffer of its own that is then copied to `y`.
///
/// # Safety
/// As for [`product`].
unsafe fn product_by_columns(
    unit: Unit,
    xv: Xs,
    (wp, cw): (&[u16], usize),
    bv: Option<&[f32]>,
    (rows, inp, out): (usize, usize, usize),
    half_x: bool,
    y: Rows,
) {
    let sx = split_rows(xv, inp, rows, inp);
    let bp = padded_bias(bv, out);
    let nb = out.div_ceil(BK);
    let parts_n = par::threads().min(nb).max(1);
    let mut parts: Vec<(usize, usize, Vec<MaybeUninit<f32>>)> = (0..parts_n)
        .map(|i| {
            let (j0, j1) = (i * nb / parts_n, (i + 1) * nb / parts_n);
            let cols = (j1 * BK).min(out) - j0 * BK;
            (j0, j1, vec![MaybeUninit::uninit(); rows * cols])
        })
        .filter(|(j0, j1, _)| j1 > j0)
        .collect();
    par::vec_for_each(parts.iter_mut().collect(), |(j0, j1, buf)| {
        let cols = buf.len() / rows;
        // SAFETY: the caller's guarantees; `buf` holds `rows` rows of the `cols`
        // outputs of blocks `j0..j1`.
        unsafe {
            blocks_into(
                (xv, &sx),
                (wp, cw),
                (bv, bp.as_deref()),
                (rows, inp, out),
                (*j0, *j1),
                (unit, half_x),
                Dst::f32(buf),
                cols,
            )
        };
    });
    let y = match y {
        Rows::F32(y) => Dst::f32(y),
        Rows::Half(y, dt) => Dst::half(y, dt),
    };
    for (j0, _, buf) in &parts {
        let (o0, cols) = (j0 * BK, buf.len() / rows);
        for r in 0..rows {
            // SAFETY: `blocks_into` wrote every element of `buf`; AVX-512F is there
            // (the caller's guarantee).
            let row =
                unsafe { std::mem::transmute::<&[MaybeUninit<f32>], &[f32]>(&buf[r * cols..(r + 1) * cols]) };
            unsafe { y.put(r * out + o0, row) };
        }
    }
}

/// Output blocks `j0..j1` ([`BK`] outputs each) of the `rows` rows of `xs` (row-major,
/// split into `sx`), plus the bias (`bp`: padded with zeros to whole blocks), into `y`
/// (row stride `ldy`; block `j0` at column 0), all written, with `half_x` as in
/// [`product`], on `unit` ([`tile_blocks`] or [`pair_blocks`]). Rows in `sx.bad` are
/// recomputed by [`dot_row`].
///
/// # Safety
/// As for [`product_on`]; `y` holds `rows` rows of stride `ldy ≥ (j1 − j0)·BK` clipped
/// to `out`.
#[allow(clippy::too_many_arguments)]
unsafe fn blocks_into(
    (xs, sx): (Xs, &SplitX),
    (wp, cw): (&[u16], usize),
    (bv, bp): (Option<&[f32]>, Option<&[f32]>),
    (rows, inp, out): (usize, usize, usize),
    (j0, j1): (usize, usize),
    (unit, half_x): (Unit, bool),
    y: Dst,
    ldy: usize,
) {
    assert!(y.len >= (rows - 1) * ldy + ((j1 * BK).min(out) - j0 * BK));
    assert!(bp.is_none_or(|b| b.len() >= j1 * BK));
    let blocks = (sx, (wp, cw), bp, (rows, inp, out), (j0, j1), half_x);
    match unit {
        Unit::Tiles => tile_blocks(blocks, y, ldy),
        Unit::Avx512Bf16 => pair_blocks(blocks, y, ldy),
    }
    if sx.bad.is_empty() {
        return;
    }
    let cols = (j1 * BK).min(out) - j0 * BK;
    let mut row = vec![MaybeUninit::<f32>::uninit(); cols];
    for &r in &sx.bad {
        let x = xs.f32s(r * inp..(r + 1) * inp);
        dot_row(&x, (wp, cw), bv, out, (j0, j1), &mut row);
        // SAFETY: `dot_row` wrote all `cols` elements.
        y.put(
            r * ldy,
            std::mem::transmute::<&[MaybeUninit<f32>], &[f32]>(&row[..]),
        );
    }
}

/// The operands of [`tile_blocks`] and [`pair_blocks`]: x split, the pack and its
/// components, the padded bias, `(rows, in, out)`, the output blocks `j0..j1`, and
/// `half_x`.
type Blocks<'a> = (
    &'a SplitX,
    (&'a [u16], usize),
    Option<&'a [f32]>,
    (usize, usize, usize),
    (usize, usize),
    bool,
);

/// [`blocks_into`] on the AMX tile unit, but for the rows in `sx.bad`. Whole tiles of an
/// f32 output are stored in place; the last row tile, a partial last panel and every
/// tile of a rounded output go through a scratch tile.
///
/// # Safety
/// As for [`blocks_into`], with the tile unit available.
unsafe fn tile_blocks((sx, (wp, cw), bp, (rows, inp, out), (j0, j1), half_x): Blocks, y: Dst, ldy: usize) {
    let klen = k_len(inp, cw);
    let kt = e_pad(inp) / TK;
    let tiles = rows.div_ceil(TM);
    // Two scratch blocks: the rows of a tile stored through one are written out (copied
    // or rounded) while the tile unit runs the next tile's products into the other.
    let mut scratch = AVec::<f32>::new(2 * 2 * TM * SLD);
    let bufs = [scratch.as_mut_ptr(), scratch.as_mut_ptr().add(2 * TM * SLD)];
    let mut cur = 0;
    // The tile waiting in `bufs[i]`: `(at, nr, nc, i)`.
    let mut pending: Option<(usize, usize, usize, usize)> = None;
    let write_out = |(at, nr, nc, i): (usize, usize, usize, usize)| {
        for r in 0..nr {
            // SAFETY: `bufs[i]` holds `nr` rows of `nc ≤ 2·NR` floats stored by the tile
            // unit, `SLD` apart.
            y.put(at + r * ldy, std::slice::from_raw_parts(bufs[i].add(r * SLD), nc));
        }
    };
    amx::configure();
    for j in j0..j1 {
        let o0 = j * BK;
        let nout = BK.min(out - o0);
        let np = nout.div_ceil(NR);
        let kb = wp[j * klen..(j + 1) * klen].as_ptr();
        let mut tile = |rt: usize, p: usize| {
            let (rtiles, panels) = (2.min(tiles - rt), 2.min(np - p));
            let (r0, c0) = (rt * TM, p * NR);
            let (nr, nc) = ((rows - r0).min(rtiles * TM), (nout - c0).min(panels * NR));
            let init = bp.map_or(std::ptr::null(), |b| b[o0 + c0..].as_ptr());
            let cx_lo = if half_x { 1 } else { sx.comps };
            let x = (sx.data.as_ptr().add(r0 * sx.ld), sx.cs, sx.ld, sx.comps, cx_lo);
            let w = (kb.add(p * kt * TILE), klen / cw, cw);
            let at = r0 * ldy + o0 - j0 * BK + c0;
            let whole = nr == rtiles * TM && nc == panels * NR;
            // Whole tiles of an f32 output in place, the rest through a scratch block.
            let in_place = if whole { y.f32_at(at) } else { None };
            let dst = match in_place {
                Some(yp) => {
                    // Ask for the output's lines for writing (`prefetchw`) before the
                    // products, so that the tile stores do not wait for them. In one
                    // process, alternating, two readings of five products (kernel notes):
                    // −11.5% to +2.3%, eight of the ten faster.
                    for r in 0..rtiles * TM {
                        let line = yp.add(r * ldy) as *const i8;
                        _mm_prefetch::<_MM_HINT_ET0>(line);
                        if panels == 2 {
                            _mm_prefetch::<_MM_HINT_ET0>(line.add(64));
                        }
                    }
                    (yp, ldy)
                }
                None => (bufs[cur], SLD),
            };
            let mut before = || {
                if let Some(t) = pending.take() {
                    write_out(t);
                }
            };
            amx::gemm_tiles(x, w, kt, (rtiles, panels), init, dst, &mut before);
            if in_place.is_none() {
                pending = Some((at, nr, nc, cur));
                cur ^= 1;
            }
        };
        // Each pair of row tiles takes the block's panel pairs in turn, so that its x
        // tiles are read again from L1.
        let mut rt = 0;
        while rt < tiles {
            let mut p = 0;
            while p < np {
                tile(rt, p);
                p += 2;
            }
            rt += 2;
        }
    }
    if let Some(t) = pending.take() {
        write_out(t);
    }
    amx::release();
}

/// Rows of x per call of [`dpbf16::gemm`] in [`pair_blocks`] (one register strip).
const STRIP: usize = 6;

/// [`blocks_into`] on AVX512-BF16 register tiles ([`dpbf16::gemm`]), but for the rows in
/// `sx.bad`: for each output block, strips of [`STRIP`] rows, so that the block's
/// weights are read from L2 by every strip of the rows. Whole blocks of an f32 output are
/// stored in place; a partial last block and a rounded output go through a scratch strip.
///
/// # Safety
/// As for [`blocks_into`], with AVX512-BF16 available.
unsafe fn pair_blocks((sx, (wp, cw), bp, (rows, inp, out), (j0, j1), half_x): Blocks, y: Dst, ldy: usize) {
    let klen = k_len(inp, cw);
    let pairs = e_pad(inp) / 2;
    // As on the tile unit: the components of W after the first meet x's first only
    // with `half_x`.
    let cx_lo = if half_x { 1 } else { sx.comps };
    let terms: Vec<(usize, usize)> = (0..cw)
        .flat_map(|cb| (0..if cb == 0 { sx.comps } else { cx_lo }).map(move |ca| (ca, cb)))
        .collect();
    let mut scratch = AVec::<f32>::new(STRIP * BK);
    for j in j0..j1 {
        let o0 = j * BK;
        let nout = BK.min(out - o0);
        let w = (wp[j * klen..(j + 1) * klen].as_ptr(), klen / cw);
        let init = bp.map_or(std::ptr::null(), |b| b[o0..].as_ptr());
        let mut r0 = 0;
        while r0 < rows {
            let nr = (rows - r0).min(STRIP);
            let x = (sx.data.as_ptr().add(r0 * sx.ld), sx.cs, sx.ld);
            let at = r0 * ldy + o0 - j0 * BK;
            match y.f32_at(at).filter(|_| nout == BK) {
                Some(yp) => dpbf16::gemm(x, w, pairs, &terms, nr, init, (yp, ldy)),
                None => {
                    dpbf16::gemm(x, w, pairs, &terms, nr, init, (scratch.as_mut_ptr(), BK));
                    for r in 0..nr {
                        y.put(at + r * ldy, &scratch[r * BK..r * BK + nout]);
                    }
                }
            }
            r0 += nr;
        }
    }
}

/// `y[o − j0·BK] = b[o] + Σₖ x[k]·W[o][k]` for the outputs `o` of blocks `j0..j1`,
/// as f32 dot products in order of the contraction (bias first), with the weight read
/// back from the pack: for rows of x that the split cannot carry (see the module doc),
/// so that they give the f32 product's ±inf and NaN.
fn dot_row(
    x: &[f32],
    (wp, cw): (&[u16], usize),
    bv: Option<&[f32]>,
    out: usize,
    (j0, j1): (usize, usize),
    y: &mut [MaybeUninit<f32>],
) {
    let inp = x.len();
    let klen = k_len(inp, cw);
    let (kt, clen) = (e_pad(inp) / TK, klen / cw);
    let bf = |bits: u16| f32::from_bits((bits as u32) << 16);
    for o in j0 * BK..(j1 * BK).min(out) {
        let (j, p, col) = (o / BK, (o % BK) / NR, o % NR);
        let mut acc = bv.map_or(0.0, |b| b[o]);
        for (k, &xk) in x.iter().enumerate() {
            let (t, pair, half) = (k / TK, (k % TK) / 2, k % 2);
            let at = j * klen + (p * kt + t) * TILE + pair * TK + 2 * col + half;
            let w: f32 = (0..cw).map(|c| bf(wp[c * clen + at])).sum();
            acc += xk * w;
        }
        y[o - j0 * BK].write(acc);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle::{Device, Tensor};

    /// The units that can run the products on this machine: the AMX tile unit where it
    /// is available, and AVX512-BF16 register tiles (which every CPU with AMX has too).
    fn units() -> Vec<Unit> {
        let mut units = Vec::new();
        if amx::available() {
            units.push(Unit::Tiles);
        }
        if dpbf16::available() {
            units.push(Unit::Avx512Bf16);
        }
        units
    }

    /// [`units`], or `None` (saying so) where there are none.
    fn units_here() -> Option<Vec<Unit>> {
        let units = units();
        if units.is_empty() {
            eprintln!("no AMX or AVX512-BF16 here: nothing to check");
            return None;
        }
        Some(units)
    }

    /// `w (out, in)` (bf16 or f16) packed here: the pack, its components, and whether
    /// `pack` found every weight finite. Callers check [`units_here`] first.
    fn pack_tensor(w: &Tensor) -> (AVec<u16>, usize, bool) {
        let cw = weight_comps(w.dtype()).expect("a bf16 or f16 weight");
        let (out, inp) = w.dims2().expect("a weight (out, in)");
        let (g, l) = w.storage_and_layout();
        let wd = match &*g {
            candle::Storage::Cpu(candle::CpuStorage::BF16(v)) => Data::BF16(&v[l.start_offset()..]),
            candle::Storage::Cpu(candle::CpuStorage::F16(v)) => Data::F16(&v[l.start_offset()..]),
            _ => unreachable!("a bf16 or f16 CPU tensor"),
        };
        let mut wp = AVec::<u16>::new(pack_len((out, inp), cw));
        // SAFETY: the callers checked `units_here`.
        let finite = unsafe { pack(wd, (out, inp), cw, &mut wp) };
        (wp, cw, finite)
    }

    /// [`pack_tensor`] of a weight with finite values.
    fn packed(w: &Tensor) -> (AVec<u16>, usize) {
        let (wp, cw, finite) = pack_tensor(w);
        assert!(finite);
        (wp, cw)
    }

    /// [`product_on`] `unit` (one of [`units`]) into f32 rows.
    fn run(
        unit: Unit,
        x: &[f32],
        w: &(AVec<u16>, usize),
        b: Option<&[f32]>,
        dims: (usize, usize, usize),
        half_x: bool,
    ) -> Vec<f32> {
        let mut y = vec![MaybeUninit::<f32>::uninit(); dims.0 * dims.2];
        // SAFETY: `unit` is available, and `pack` returned true.
        unsafe { product_on(unit, Xs::F32(x), (&w.0, w.1), b, dims, half_x, Rows::F32(&mut y)) };
        // SAFETY: `product` writes every element.
        y.into_iter().map(|v| unsafe { v.assume_init() }).collect()
    }

    /// Against an f64 product of the same values, within `5e-7 · (1 + Σ|x·w|)` (about 4
    /// f32 ulps of the terms' size; dropping x's `lo` component would cost 2⁻¹⁷ of it,
    /// a tile of 32 of the contraction much more; the worst seen was 1.5e-7): bf16 and f16 weights, x with 1, 2 and 3 non-zero components, every
    /// height of a short last row tile and both schedules (row blocks and output blocks),
    /// partial output panels and blocks, contraction tails, with and without bias.
    #[test]
    fn products_match_f64() -> Result<(), candle::Error> {
        let Some(units) = units_here() else {
            return Ok(());
        };
        let dev = Device::Cpu;
        let mut checked = 0;
        for (rows, inp, out) in [
            (1, 32, 16),
            (5, 100, 50),
            (17, 64, 64),
            (33, 96, 129),
            (300, 259, 200),
            (47, 768, 80),
        ] {
            for wdt in [DType::BF16, DType::F16] {
                let w = Tensor::randn(0f32, 1.0, (out, inp), &dev)?.to_dtype(wdt)?;
                let pw = packed(&w);
                let wv = w.to_dtype(DType::F32)?.to_vec2::<f32>()?;
                let b: Vec<f32> = (0..out).map(|o| o as f32 * 0.25 - 3.0).collect();
                for xdt in [DType::BF16, DType::F16, DType::F32] {
                    let x = Tensor::randn(0f32, 1.0, (rows, inp), &dev)?
                        .to_dtype(xdt)?
                        .to_dtype(DType::F32)?;
                    let xv = x.flatten_all()?.to_vec1::<f32>()?;
                    // f16 and bf16 values also as half-precision inputs, whose products
                    // skip `lo·lo` against an f16 weight.
                    let modes: &[bool] = if xdt == DType::F32 {
                        &[false]
                    } else {
                        &[false, true]
                    };
                    for (bias, &half_x, &unit) in [None, Some(&b[..])]
                        .into_iter()
                        .flat_map(|b| modes.iter().map(move |h| (b, h)))
                        .flat_map(|(b, h)| units.iter().map(move |u| (b, h, u)))
                    {
                        let got = run(unit, &xv, &pw, bias, (rows, inp, out), half_x);
                        for r in 0..rows {
                            for o in 0..out {
                                let (x, w) = (&xv[r * inp..(r + 1) * inp], &wv[o]);
                                let want = product_f64(x, w, half_x) + bias.map_or(0.0, |b| b[o] as f64);
                                let size =
                                    (0..inp).map(|k| (x[k] as f64 * w[k] as f64).abs()).sum::<f64>() + 1.0;
                                let g = got[r * out + o] as f64;
                                assert!(
                                    (g - want).abs() <= 5e-7 * size,
                                    "{unit:?} {rows}x{inp}x{out} w {wdt:?} x {xdt:?} half_x {half_x} ({r}, {o}): {g} vs {want}"
                                );
                            }
                        }
                        checked += 1;
                    }
                }
            }
        }
        assert_eq!(checked, 120 * units.len());
        Ok(())
    }

    /// `x · w` in f64, without the products of the two low bf16 parts (each value's
    /// difference from its bf16 rounding) with `half_x`.
    fn product_f64(x: &[f32], w: &[f32], half_x: bool) -> f64 {
        let lo = |v: f32| v as f64 - half::bf16::from_f32(v).to_f64();
        let lo_lo = |k: usize| if half_x { lo(x[k]) * lo(w[k]) } else { 0.0 };
        (0..x.len()).map(|k| x[k] as f64 * w[k] as f64 - lo_lo(k)).sum()
    }

    /// On each unit, an f16 weight against half-precision inputs skips exactly the
    /// `lo·lo` products, and against other inputs runs them all. The values are chosen
    /// so that the skipped terms add up (`1 + 3·2⁻⁹` is `(1 + 2⁻⁷) − 2⁻⁹` in bf16 parts:
    /// every `lo·lo` is `+2⁻¹⁸`), and the two sums lie further apart than the f32 sums'
    /// rounding.
    #[test]
    fn half_inputs_skip_only_the_low_parts_products() -> Result<(), candle::Error> {
        let Some(units) = units_here() else {
            return Ok(());
        };
        let dev = Device::Cpu;
        for (rows, inp, out) in [(16, 256, 20), (40, 512, 70)] {
            // Signs and powers of two by input position and row, so that every
            // `x[k]·w[k]` and every `lo·lo` of one output has the same sign.
            let v = |n: usize, s: usize| -> Vec<f32> {
                (0..n)
                    .map(|i| {
                        let (k, row) = (i % inp, i / inp);
                        let sign = if (k % 5 == 3) ^ (row % s == 1) { -1.0 } else { 1.0 };
                        sign * (1.0 + 3.0 / 512.0) * [1.0, 0.5, 2.0, 0.25][(k + row) % 4]
                    })
                    .collect()
            };
            let wv = v(out * inp, 3);
            let w = Tensor::from_vec(wv.clone(), (out, inp), &dev)?.to_dtype(DType::F16)?;
            assert_eq!(w.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?, wv);
            let pw = packed(&w);
            assert_eq!(pw.1, 2);
            let xv = v(rows * inp, 7);
            for &unit in &units {
                // Without and with `half_x`.
                let got = [false, true].map(|h| run(unit, &xv, &pw, None, (rows, inp, out), h));
                for r in 0..rows {
                    for o in 0..out {
                        let (x, w) = (&xv[r * inp..(r + 1) * inp], &wv[o * inp..(o + 1) * inp]);
                        let want = [false, true].map(|h| product_f64(x, w, h));
                        let size = (0..inp).map(|k| (x[k] as f64 * w[k] as f64).abs()).sum::<f64>();
                        let g = got.each_ref().map(|g| g[r * out + o] as f64);
                        let case = format!("{unit:?} {rows}x{inp}x{out} ({r}, {o}): {g:?} vs {want:?}");
                        // The tile unit sums each tile's 32 products before it rounds. The
                        // register tiles round twice per pair, in order (an f32 product's
                        // rounding count); every term of these sums has the same sign, so
                        // their roundings pile up: bound them as `inp` roundings of the
                        // whole sum, and check the skip on the difference of the two calls,
                        // whose first-pair sums are the same (`dpbf16::gemm`).
                        let tol = match unit {
                            Unit::Tiles => 5e-7 * size,
                            Unit::Avx512Bf16 => (inp + 2) as f64 * 2f64.powi(-24) * size,
                        };
                        for h in 0..2 {
                            assert!((g[h] - want[h]).abs() <= tol, "half_x {}: {case}", h == 1);
                            // The bound that `product` states for the skipped terms.
                            assert!((g[h] - want[0]).abs() <= size * 2f64.powi(-16) + tol, "{case}");
                        }
                        let lo_lo = want[0] - want[1];
                        match unit {
                            Unit::Tiles => {
                                assert!(lo_lo.abs() > 4.0 * tol, "the case cannot tell them apart")
                            }
                            Unit::Avx512Bf16 => {
                                assert!(((g[0] - g[1]) - lo_lo).abs() <= 0.25 * lo_lo.abs(), "{case}")
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Rows rounded by the product ([`Rows::Half`]) are, bit for bit, its f32 rows cast
    /// by candle: bf16 and f16 weights and outputs, f32 and half-precision inputs, both
    /// schedules (a few rows by columns, and row blocks), partial row tiles, panels and
    /// blocks, a bias, and rows with ±inf and NaN (recomputed by dot products).
    #[test]
    fn rounded_rows_are_candles_casts_of_the_f32_rows() -> Result<(), candle::Error> {
        let Some(units) = units_here() else {
            return Ok(());
        };
        let dev = Device::Cpu;
        for (rows, inp, out) in [(5, 96, 70), (40, 100, 130), (300, 64, 64)] {
            for wdt in [DType::BF16, DType::F16] {
                let w = Tensor::randn(0f32, 1.0, (out, inp), &dev)?.to_dtype(wdt)?;
                let pw = packed(&w);
                let b: Vec<f32> = (0..out).map(|o| o as f32 * 0.125 - 4.0).collect();
                let calls = [(DType::F32, false), (wdt, true)];
                for ((xdt, half_x), unit) in
                    calls.into_iter().flat_map(|c| units.iter().map(move |&u| (c, u)))
                {
                    let mut xv = Tensor::randn(0f32, 3.0, (rows, inp), &dev)?
                        .to_dtype(xdt)?
                        .to_dtype(DType::F32)?
                        .flatten_all()?
                        .to_vec1::<f32>()?;
                    xv[inp + 3] = f32::INFINITY;
                    xv[3 * inp + 5] = f32::NAN;
                    let f32_rows = run(unit, &xv, &pw, Some(&b), (rows, inp, out), half_x);
                    for dt in [DType::BF16, DType::F16] {
                        let want = Tensor::from_vec(f32_rows.clone(), rows * out, &dev)?.to_dtype(dt)?;
                        let want: Vec<u16> = match dt {
                            DType::BF16 => want
                                .to_vec1::<half::bf16>()?
                                .iter()
                                .map(|v| v.to_bits())
                                .collect(),
                            _ => want.to_vec1::<half::f16>()?.iter().map(|v| v.to_bits()).collect(),
                        };
                        let mut y = vec![MaybeUninit::<u16>::uninit(); rows * out];
                        // SAFETY: `unit` is available, and `pack` returned true.
                        unsafe {
                            product_on(
                                unit,
                                Xs::F32(&xv),
                                (&pw.0, pw.1),
                                Some(&b),
                                (rows, inp, out),
                                half_x,
                                Rows::Half(&mut y, dt),
                            )
                        };
                        // SAFETY: `product` writes every element.
                        let got: Vec<u16> = y.into_iter().map(|v| unsafe { v.assume_init() }).collect();
                        assert_eq!(
                            got, want,
                            "{unit:?} {rows}x{inp}x{out} weight {wdt:?}, x {xdt:?}, rounded to {dt:?}"
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// bf16 rows given as they are ([`Xs::Bf16`]) give the bits of their f32 values
    /// ([`Xs::F32`]), on every unit, in both schedules (a few rows by columns, and row
    /// blocks), as f32 and rounded rows, with rows that hold ±inf, NaN and a subnormal.
    /// A subnormal weight meets the infinity: both units read it as zero (inf · 0 is
    /// NaN), so only the f32 dot products of rows marked for them give the f32
    /// product's infinity there.
    #[test]
    fn bf16_rows_give_the_bits_of_their_f32_values() -> Result<(), candle::Error> {
        let Some(units) = units_here() else {
            return Ok(());
        };
        let dev = Device::Cpu;
        for (rows, inp, out) in [(5, 96, 70), (40, 100, 130), (300, 64, 64)] {
            let mut wv = Tensor::randn(0f32, 1.0, (out, inp), &dev)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            wv[3] = f32::from_bits(1 << 16); // the smallest bf16 subnormal
            let w = Tensor::from_vec(wv, (out, inp), &dev)?.to_dtype(DType::BF16)?;
            let pw = packed(&w);
            let b: Vec<f32> = (0..out).map(|o| o as f32 * 0.125 - 4.0).collect();
            let x = Tensor::randn(0f32, 3.0, (rows, inp), &dev)?.to_dtype(DType::BF16)?;
            let mut bits: Vec<u16> = x
                .flatten_all()?
                .to_vec1::<half::bf16>()?
                .iter()
                .map(|v| v.to_bits())
                .collect();
            bits[inp + 3] = 0x7f80; // +inf
            bits[3 * inp + 5] = 0x7fc0; // NaN
            bits[2 * inp + 1] = 0x0001; // the smallest subnormal
            let xf: Vec<f32> = bits.iter().map(|&v| f32::from_bits((v as u32) << 16)).collect();
            for (&unit, dt) in units
                .iter()
                .flat_map(|u| [None, Some(DType::BF16), Some(DType::F16)].map(move |d| (u, d)))
            {
                let run = |xs: Xs| -> Vec<u32> {
                    let dims = (rows, inp, out);
                    let w = (&pw.0[..], pw.1);
                    // SAFETY: `unit` is available, and `pack` returned true; `product_on`
                    // writes every element.
                    unsafe {
                        match dt {
                            None => {
                                let mut y = vec![MaybeUninit::<f32>::uninit(); rows * out];
                                product_on(unit, xs, w, Some(&b), dims, true, Rows::F32(&mut y));
                                y.into_iter().map(|v| v.assume_init().to_bits()).collect()
                            }
                            Some(dt) => {
                                let mut y = vec![MaybeUninit::<u16>::uninit(); rows * out];
                                product_on(unit, xs, w, Some(&b), dims, true, Rows::Half(&mut y, dt));
                                y.into_iter().map(|v| v.assume_init() as u32).collect()
                            }
                        }
                    }
                };
                let got = run(Xs::Bf16(&bits));
                assert_eq!(
                    got,
                    run(Xs::F32(&xf)),
                    "{unit:?} {rows}x{inp}x{out} rounded to {dt:?}"
                );
                // Row 1 (its +inf against the subnormal weight of output 0) is +inf.
                let inf = match dt {
                    None => f32::INFINITY.to_bits(),
                    Some(DType::BF16) => 0x7f80,
                    Some(_) => 0x7c00,
                };
                assert_eq!(got[out], inf, "{unit:?} {rows}x{inp}x{out} rounded to {dt:?}");
            }
        }
        Ok(())
    }

    /// Rows of x that are exactly bf16 values split into one component, f16 values into
    /// two, other f32 values into three; and multiplying the zero components too (all
    /// three) gives the same bits as skipping them.
    #[test]
    fn zero_components_are_skipped_without_changing_a_bit() -> Result<(), candle::Error> {
        let Some(units) = units_here() else {
            return Ok(());
        };
        let dev = Device::Cpu;
        let (rows, inp, out) = (37, 200, 70);
        for wdt in [DType::BF16, DType::F16] {
            let w = Tensor::randn(0f32, 1.0, (out, inp), &dev)?.to_dtype(wdt)?;
            let (wp, cw) = packed(&w);
            let b: Vec<f32> = (0..out).map(|o| o as f32 - 30.0).collect();
            for (xdt, comps) in [(DType::BF16, 1), (DType::F16, 2), (DType::F32, 3)] {
                let x = Tensor::randn(0f32, 1.0, (rows, inp), &dev)?
                    .to_dtype(xdt)?
                    .to_dtype(DType::F32)?;
                let xv = x.flatten_all()?.to_vec1::<f32>()?;
                // SAFETY: `units_here` found a unit.
                let mut sx = unsafe { split_rows(Xs::F32(&xv), inp, rows, inp) };
                assert_eq!(sx.comps, comps, "{xdt:?}");
                let run = |sx: &SplitX, unit: Unit| {
                    let mut y = vec![MaybeUninit::<f32>::uninit(); rows * out];
                    let blocks = (0, out.div_ceil(BK));
                    // SAFETY: as above, and `pack` returned true.
                    unsafe {
                        blocks_into(
                            (Xs::F32(&xv), sx),
                            (&wp, cw),
                            (Some(&b), padded_bias(Some(&b), out).as_deref()),
                            (rows, inp, out),
                            blocks,
                            (unit, false),
                            Dst::f32(&mut y),
                            out,
                        )
                    };
                    // SAFETY: `blocks_into` writes every element.
                    y.into_iter()
                        .map(|v| unsafe { v.assume_init() }.to_bits())
                        .collect::<Vec<_>>()
                };
                let skipped: Vec<_> = units.iter().map(|&u| run(&sx, u)).collect();
                // Components the split did not need hold no values: zero them.
                let cs = sx.cs;
                sx.data[cs * comps..3 * cs].fill(0);
                sx.comps = 3;
                for (&unit, skipped) in units.iter().zip(skipped) {
                    assert_eq!(skipped, run(&sx, unit), "{unit:?} weight {wdt:?}, x {xdt:?}");
                }
            }
        }
        Ok(())
    }

    /// Rows with ±inf, NaN or a finite value beyond bf16's range give what f32 dot
    /// products give (the same infinities and NaNs, and finite values where those are
    /// finite), in both schedules; the other rows keep the tile products.
    #[test]
    fn rows_that_bf16_cannot_hold_get_f32_products() -> Result<(), candle::Error> {
        let Some(units) = units_here() else {
            return Ok(());
        };
        let dev = Device::Cpu;
        let (inp, out) = (96, 80);
        let w = (Tensor::randn(0f32, 1.0, (out, inp), &dev)? / 20.0)?.to_dtype(DType::BF16)?;
        let wv = w.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        let (wp, _) = packed(&w);
        for (rows, &unit) in [3, 40]
            .into_iter()
            .flat_map(|r| units.iter().map(move |u| (r, u)))
        {
            let mut xv = Tensor::randn(0f32, 1.0, (rows, inp), &dev)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            xv[inp + 5] = f32::INFINITY;
            xv[2 * inp + 7] = f32::NEG_INFINITY;
            xv[2 * inp + 9] = f32::INFINITY;
            if rows > 3 {
                xv[20 * inp] = f32::NAN;
                xv[33 * inp + 95] = 3.4e38;
            }
            let mut y = vec![MaybeUninit::<f32>::uninit(); rows * out];
            // SAFETY: `unit` is available, and `pack` returned true.
            unsafe {
                product_on(
                    unit,
                    Xs::F32(&xv),
                    (&wp, 1),
                    None,
                    (rows, inp, out),
                    false,
                    Rows::F32(&mut y),
                )
            };
            for r in 0..rows {
                for o in 0..out {
                    // SAFETY: `product` writes every element.
                    let got = unsafe { y[r * out + o].assume_init() };
                    let want = (0..inp).fold(0f32, |acc, k| acc + xv[r * inp + k] * wv[o][k]);
                    let same = if want.is_finite() {
                        (got - want).abs() <= 1e-5 * want.abs().max(1.0)
                    } else {
                        got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan())
                    };
                    assert!(same, "{unit:?} rows {rows} ({r}, {o}): {got} vs {want}");
                }
            }
        }
        Ok(())
    }

    /// ±inf, NaN and values beyond bf16's range in x (recomputed by f32 dot products)
    /// do not count towards the components: bf16 values with them still split into one.
    #[test]
    fn non_finite_values_leave_one_component_for_bf16_values() {
        if units_here().is_none() {
            return;
        }
        let (rows, inp) = (20, 40);
        let mut xv: Vec<f32> = (0..rows * inp)
            .map(|i| half::bf16::from_f32(i as f32 * 0.37 - 9.0).to_f32())
            .collect();
        for (at, v) in [
            (3, f32::INFINITY),
            (41, f32::NEG_INFINITY),
            (200, f32::NAN),
            (799, 3.4e38),
        ] {
            xv[at] = v;
        }
        // SAFETY: `units_here` found a unit.
        let sx = unsafe { split_rows(Xs::F32(&xv), inp, rows, inp) };
        assert_eq!((sx.comps, &sx.bad[..]), (1, &[0, 1, 5, 19][..]));
        // 1 + 2⁻²³ is `1 + 2⁻²³` (two components); 1 + 2⁻⁹ + 2⁻²³ is `1 + 2⁻⁹ + 2⁻²³` (three).
        for (bits, comps) in [(0x3f80_0001, 2), (0x3f80_4001, 3)] {
            xv[555] = f32::from_bits(bits);
            // SAFETY: as above.
            let sx = unsafe { split_rows(Xs::F32(&xv), inp, rows, inp) };
            assert_eq!((sx.comps, &sx.bad[..]), (comps, &[0, 1, 5, 19][..]));
        }
    }

    /// A weight with ±inf or NaN is refused (`pack` returns false), in bf16 and f16.
    #[test]
    fn weights_with_non_finite_values_are_refused() -> Result<(), candle::Error> {
        if units_here().is_none() {
            return Ok(());
        }
        let dev = Device::Cpu;
        let (out, inp) = (70, 40);
        for wdt in [DType::BF16, DType::F16] {
            for (bad, at) in [
                (f32::INFINITY, 0),
                (f32::NEG_INFINITY, 69 * 40 + 39),
                (f32::NAN, 65 * 40 + 3),
                (0.5, 7),
            ] {
                let mut wv = Tensor::randn(0f32, 1.0, (out, inp), &dev)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                wv[at] = bad;
                let w = Tensor::from_vec(wv, (out, inp), &dev)?.to_dtype(wdt)?;
                let (_, _, finite) = pack_tensor(&w);
                assert_eq!(finite, bad.is_finite(), "{wdt:?} {bad} at {at}");
            }
        }
        Ok(())
    }
}
