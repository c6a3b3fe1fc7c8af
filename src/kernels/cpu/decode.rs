//! Decode-path helpers: row-major K/V blocks read straight from the source tensor
//! (f32 with unit inner stride) or converted once into a small f32 buffer, so every
//! K/V row is streamed from memory exactly once per GQA group without a transposing
//! pack. Used when a (batch, kv head) group has few query rows (`G·L` small).

use super::tiles::NR;
use super::view::{Data, View};

/// Most rows (all query heads × queries) of a group on the decode path in general
/// ([`decode_max_rows`]).
pub(crate) const DECODE_MAX_ROWS: usize = 24;

/// Most rows of a group on the decode path of AVX-512 with f32 K rows, whose score strips
/// put up to 16 rows in the lanes (`avx512::decode::qk_lanes`): the most of any case.
#[cfg(target_arch = "x86_64")]
pub(crate) const DECODE_MAX_ROWS_LANES: usize = 48;

/// Most rows of a group on the decode path of AVX2 with f32 K rows, whose score strips
/// put up to 8 rows in the lanes (`avx2::decode::qk_lanes`), and 16 from 14 rows
/// (`avx2::decode::qk_lanes16`).
#[cfg(target_arch = "x86_64")]
pub(crate) const DECODE_MAX_ROWS_LANES_AVX2: usize = 32;

/// Most rows of a group on the decode path of AVX-512 and AVX2 with f16 K rows (heads of
/// up to 256, a multiple of 16 on AVX-512 and of 8 on AVX2). Their score strips put the
/// head dimension in the lanes, but packing each block converts every K and V element
/// to f32 first, which took longer up to 32 rows. On the Zen 4 VM (both threads, f16
/// `1,32,8,L,S,128`, in-process probe, time on the decode path over time on the pack):
/// AVX-512 28 rows 0.925, 32 rows 0.862–0.874 (S from 2048 to 16384), 40 rows 0.963,
/// 48 rows 1.046; AVX2 (forced) 28 rows 0.918, 32 rows 0.878 (kernel notes, "f16 decode
/// groups of 25 to 32 rows"). bf16 keeps [`DECODE_MAX_ROWS`]: on AVX512-BF16 its packed
/// blocks run on `VDPBF16PS`.
#[cfg(target_arch = "x86_64")]
pub(crate) const DECODE_MAX_ROWS_F16: usize = 32;

/// Most rows of a group that takes the decode path (K/V rows read in place, no pack),
/// for K rows of `e` elements in `k` on `isa`. Groups with more rows pack each 64-key
/// block (`KvSrc::Stream`). Where f32 K rows go through score strips with the rows in
/// the lanes (heads of up to 256), the decode path stays faster for more rows:
/// [`DECODE_MAX_ROWS_LANES`] on AVX-512 and [`DECODE_MAX_ROWS_LANES_AVX2`] on AVX2; f16
/// K rows of such heads stay up to [`DECODE_MAX_ROWS_F16`]; else [`DECODE_MAX_ROWS`].
/// On the Zen 4 VM (both threads, f32
/// over 4096 keys, in-process probe, time on the decode path over time on the pack, each
/// with its fastest kernels): AVX-512 28 rows 0.839, 32 rows of 128 0.791–0.804, of 64
/// 0.820, 48 rows of 64 0.956 and of 128 0.921; AVX2 (forced) 32 rows 0.818 and 0.832
/// (64), 36 rows 0.928 and 1.003 (64), 40 rows 0.951, 48 rows of 64 1.087 (kernel notes,
/// "Decode groups of 12 to 48 rows").
pub(crate) fn decode_max_rows(isa: super::isa::Isa, k: &View, e: usize) -> usize {
    #[cfg(target_arch = "x86_64")]
    if matches!(k.data, Data::F32(_)) {
        use super::isa::Isa;
        if isa == Isa::Avx512 && super::avx512::lanes_head_size(e) {
            return DECODE_MAX_ROWS_LANES;
        }
        if isa == Isa::Avx2Fma && super::avx2::lanes_head_size(e) {
            return DECODE_MAX_ROWS_LANES_AVX2;
        }
    }
    #[cfg(target_arch = "x86_64")]
    if matches!(k.data, Data::F16(_)) {
        use super::isa::Isa;
        if (isa == Isa::Avx512 && super::avx512::lanes_head_size(e))
            || (isa == Isa::Avx2Fma && super::avx2::lanes_head_size(e))
        {
            return DECODE_MAX_ROWS_F16;
        }
    }
    let _ = (isa, k, e);
    DECODE_MAX_ROWS
}

/// Bytes of K (or V) rows per block of the decode kernels that read K/V rows in place
/// (AVX-512 and AVX2; `driver::block::process`; see [`decode_block_keys`]).
#[cfg(target_arch = "x86_64")]
const DECODE_BLOCK_BYTES: usize = 128 << 10;

/// Most keys per decode block: eight of the prefill's 64-key blocks.
#[cfg(target_arch = "x86_64")]
pub(crate) const DECODE_BK_MAX: usize = 8 * super::tiles::BK;

/// Keys per block of the decode kernels that read K/V rows in place (AVX-512 and AVX2)
/// for K/V rows of `row_bytes` bytes (the longer of a K and a V row): as many whole
/// 64-key blocks as fit [`DECODE_BLOCK_BYTES`], from one to [`DECODE_BK_MAX`] keys' worth
/// (f32 rows of 128: 256 keys; bf16 rows of 128: 512). Each block streams its K rows,
/// then its V rows, so longer blocks switch between the two streams less often, and the
/// softmax update, the output rescale and the calls between them run once per block,
/// not per 64 keys. 128 KiB per stream keeps a block's K and V rows within a 512 KiB L2 for the
/// score strips and `P·V` tiles that read them again. On the Zen 4 VM (2026-12-07, both
/// threads, in-process probe against 64-key blocks, rate new/old, the geometric mean of
/// the two orders, the memory in a fast phase): `decode_b4`'s shape f32 1.11, bf16
/// 1.21, f16 1.16; 4 query rows per KV head over K/V from DRAM 1.20, 1.49 and 1.45, and
/// from L3 (`decode_gqa`'s shape) 1.11, 1.20 and 1.14. With AVX2 forced there, half
/// precision read 1.05–1.29 and f32 1.00–1.25 (one order; kernel notes).
#[cfg(target_arch = "x86_64")]
pub(crate) fn decode_block_keys(row_bytes: usize) -> usize {
    use super::tiles::BK;
    (DECODE_BLOCK_BYTES / row_bytes.max(1) / BK * BK).clamp(BK, DECODE_BK_MAX)
}

/// Most query rows per group that bf16 decode keeps on the decode kernels where the AMX
/// tile unit runs the bf16 products; groups with more rows take the AMX path, which
/// packs each K/V block once per group and runs both products on 16-row tiles. On the
/// Intel Xeon VM of 2026-12-06 (both threads, the two paths alternating call by call)
/// the tiles took 9–45% less time from 9 rows up (Llama 3's 4 query heads per KV head
/// with 3–6 queries: 30–43% less), about the same at 8 rows of 128 and 11% less at 8
/// of 64, and 36–56% more at 4 rows (kernel notes).
#[cfg(target_arch = "x86_64")]
pub(crate) const AMX_DECODE_MAX_ROWS: usize = 8;

/// Rows `j0 .. j0 + nk` of `(b, kvh)` as a row-major f32 matrix `(slice, row stride)`.
/// Borrowed from the source when it is f32 with unit inner stride (and `width` is a
/// multiple of `align`); otherwise converted into `buf` with row stride
/// `width` rounded up to `align` (padding zeroed).
#[allow(clippy::too_many_arguments)]
pub(crate) fn rows_f32<'r, 'd: 'r>(
    src: &View<'d>,
    b: usize,
    kvh: usize,
    j0: usize,
    nk: usize,
    width: usize,
    align: usize,
    buf: &'r mut [f32],
) -> (&'r [f32], usize) {
    if width == 0 {
        return (&buf[..0], 0);
    }
    let start = src.row_offset(b, kvh, j0);
    let ld = src.strides[2];
    if let Data::F32(data) = src.data {
        if borrows_rows(src, width, align) && nk > 0 {
            let end = start + (nk - 1) * ld + width;
            return (&data[start..end], ld);
        }
    }
    let ldb = width.div_ceil(align) * align;
    if ldb == width && ld == width && src.strides[3] == 1 {
        // Contiguous rows: one conversion for the whole block.
        src.read_row(start, &mut buf[..nk * width], 1.0);
        return (&buf[..nk * ldb], ldb);
    }
    for jl in 0..nk {
        let row = &mut buf[jl * ldb..(jl + 1) * ldb];
        src.read_row(start + jl * ld, &mut row[..width], 1.0);
        row[width..].fill(0.0);
    }
    (&buf[..nk * ldb], ldb)
}

/// Whether [`rows_f32`] borrows rows of `width` elements from `src` (f32 with unit inner
/// stride, `width` a multiple of `align`) instead of converting them into its buffer.
pub(crate) fn borrows_rows(src: &View, width: usize, align: usize) -> bool {
    matches!(src.data, Data::F32(_)) && (src.strides[3] == 1 || width <= 1) && width.is_multiple_of(align)
}

/// Alignment of V rows for the `O += P·V` kernel (whole panels).
pub(crate) const V_ALIGN: usize = NR;
/// Alignment of K rows for the dot-product score kernel.
pub(crate) const K_ALIGN: usize = 8;
