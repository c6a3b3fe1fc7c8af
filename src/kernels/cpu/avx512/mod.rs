//! AVX-512F micro-kernels: 6×64 register tiles (24 zmm accumulators, 4 panel loads and 6
//! broadcasts per step) wherever a block has 64 keys or outputs, 12×32 tiles (2 panel
//! loads, 12 broadcasts) for the rest, with 6-row and 16-key tails. The packed layouts
//! are the AVX2 ones (`pack`): a zmm register holds exactly one 16-lane panel row, and a
//! 12-row tile reads two 6-row Q strips.
//!
//! Every function here is `unsafe` and requires a CPU with AVX-512F (the softmax also
//! AVX512DQ, for `vreduceps`); the dispatcher only selects `Isa::Avx512` after runtime
//! detection of both.
//!
//! - [`products`]: the prefill's two block products, `Q·Kᵀ` (with the softmax of full
//!   blocks in registers) and `P·V`, on packed operands or V rows read in place;
//! - [`softmax`]: the 16-lane `2^x` and the online-softmax updates;
//! - [`decode`]: scores and `P·V` of a decode step against K/V rows read in place;
//! - [`linear`]: the projection product `y = x · Wᵀ (+ b)`;
//! - [`transpose`]: the 16×16 transpose of the K pack;
//! - [`store`]: f32 rows stored as f16 or bf16.
//!
//! This module holds what they share: element kinds, widening loads and lane masks.

use super::prefetch::{prefetch_bytes, AskRows, Lines};
use super::tiles::{assert_pv_operands, assert_qk_operands, BK, LAZY_RESCALE_LOG2, MR, NR};
use super::view::Data;
use std::arch::x86_64::*;

mod decode;
mod decode_pairs;
mod linear;
mod products;
mod softmax;
mod store;
mod transpose;

pub(crate) use decode::Ahead;
pub(super) use decode::{lanes_head_size, merge_pairs, pv_rows, qk_dot, qk_dot_raw, split_pairs};
pub(super) use decode_pairs::{
    merge_unpacked, pack_bf16_rows, pairs_head_size, pv_rows_pairs, qk_dot_pairs, PAIRS_MIN_ROWS,
    PAIRS_PV_MIN_ROWS,
};
pub(crate) use linear::{gemm, GEMM_ROWS};
pub(super) use products::{pv, pv_pair, qk, qk_softmax};
pub(super) use softmax::online_rows_lazy;
pub(crate) use softmax::{softmax_row_bf16, store_components};
pub(crate) use store::{store_bf16, store_f16};
pub(crate) use transpose::transpose16;

/// Element kinds of the decode kernels' K/V rows, read straight from the source tensor
/// and widened to f32 in registers.
const F32: u8 = 0;
const BF16: u8 = 1;
const F16: u8 = 2;

/// Bytes per element of kind `T`.
#[inline]
const fn elem_bytes<const T: u8>() -> usize {
    if T == F32 {
        4
    } else {
        2
    }
}

/// 16 elements of kind `T` at element index `idx` of `p`, as f32.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load16<const T: u8>(p: *const u8, idx: usize) -> __m512 {
    match T {
        F32 => _mm512_loadu_ps((p as *const f32).add(idx)),
        BF16 => {
            let h = _mm256_loadu_si256((p as *const u16).add(idx) as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
        _ => _mm512_cvtph_ps(_mm256_loadu_si256((p as *const u16).add(idx) as *const __m256i)),
    }
}

/// The 32 bf16 elements at `p` as two f32 vectors, the even elements (0, 2, …, 30) and
/// the odd ones: one shift and one mask, where widening 16 at a time takes a widening
/// move and a shift for each half. (Little-endian: element `2i` is the low half of
/// 32-bit lane `i`.)
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load32_bf16_split(p: *const u16) -> (__m512, __m512) {
    let v = _mm512_loadu_si512(p as *const __m512i);
    let odd = _mm512_and_si512(v, _mm512_set1_epi32(0xffff_0000u32 as i32));
    (
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v)),
        _mm512_castsi512_ps(odd),
    )
}

/// Base pointer and element count of a source slice.
fn data_ptr(d: Data) -> (*const u8, usize) {
    d.raw_parts()
}

/// Lane mask of the first `n` (< 16) lanes.
#[inline]
fn tail_mask(n: usize) -> __mmask16 {
    ((1u32 << n) - 1) as __mmask16
}

/// Lane mask of the first `n` (1..=16) lanes.
#[inline]
pub(crate) fn tail_mask_full(n: usize) -> __mmask16 {
    if n >= 16 {
        0xffff
    } else {
        tail_mask(n)
    }
}
