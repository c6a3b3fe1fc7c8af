//! AVX2 + FMA micro-kernels: 6×16 register tiles (12 accumulators, 2 panel loads and
//! 1 or 2 broadcasts: 15 or 16 of the 16 ymm registers). The contraction loop of both
//! block products is written in assembly ([`products::rows_loop_6x16`]).
//!
//! Every function here is `unsafe` and requires a CPU with AVX2, FMA and F16C; the
//! dispatcher only selects `Isa::Avx2Fma` after runtime detection.
//!
//! - [`products`]: the prefill's two block products, `Q·Kᵀ` (with the lazy online
//!   softmax on the score tiles in registers, for full blocks) and `P·V`;
//! - [`softmax`]: the online-softmax updates of a row and of a block's rows;
//! - [`decode`]: scores and `P·V` of a decode step against K/V rows read in place;
//! - [`linear`]: the projection product `y = x · Wᵀ (+ b)`;
//! - [`transpose`]: the 8×8 transpose of the K pack;
//! - [`store`]: f32 rows stored as f16 or bf16.
//!
//! This module holds what they share: element kinds, widening loads and a horizontal sum.

use super::exp::avx2::{exp2_256, exp2_256_nonpos, exp2_256_nonpos_n};
use super::prefetch::{prefetch_bytes, AskRows, Lines, PF_KEYS};
use super::tiles::{assert_pv_operands, assert_qk_operands, BK, LAZY_RESCALE_LOG2, NR};
use super::view::Data;
use std::arch::x86_64::*;

mod decode;
mod linear;
mod products;
mod softmax;
mod store;
mod transpose;

pub(super) use decode::{lanes_head_size, pv_rows, qk_dot, qk_lanes};
pub(crate) use linear::{gemm, GEMM_ROWS};
pub(super) use products::{pv, qk, qk_softmax};
pub(super) use softmax::{online_row, online_rows_block};
pub(crate) use store::{store_bf16, store_f16};
pub(crate) use transpose::transpose8;

/// Rows per register tile.
pub(super) const MR: usize = super::tiles::MR;

/// Element kinds of the K/V rows that the decode kernels read in place.
const F32: u8 = 0;
const BF16: u8 = 1;
const F16: u8 = 2;

/// Eight elements of kind `T` at element index `idx` of `p`, as f32 (bf16 → f32 is a
/// 16-bit shift, f16 → f32 one F16C conversion).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load8<const T: u8>(p: *const u8, idx: usize) -> __m256 {
    if T == F32 {
        _mm256_loadu_ps((p as *const f32).add(idx))
    } else {
        let h = _mm_loadu_si128((p as *const u16).add(idx) as *const __m128i);
        if T == BF16 {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        } else {
            _mm256_cvtph_ps(h)
        }
    }
}

/// The rows of `d` as `(pointer, element count, kind)`.
fn rows_of(d: Data) -> (*const u8, usize, u8) {
    let (p, n) = d.raw_parts();
    let kind = match d {
        Data::F32(_) => F32,
        Data::BF16(_) => BF16,
        Data::F16(_) => F16,
    };
    (p, n, kind)
}

/// Horizontal sum of `x`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum(x: __m256) -> f32 {
    let a = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps::<1>(x));
    let b = _mm_add_ps(a, _mm_movehl_ps(a, a));
    _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)))
}

/// Xorshift values spread over `[-half, half]`, from the nonzero seed `x` (the tests' inputs,
/// the AVX-512 tiles' too).
#[cfg(test)]
pub(super) fn uniform(mut x: u32, half: f32) -> impl FnMut() -> f32 {
    move || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        x as f32 / u32::MAX as f32 * (2.0 * half) - half
    }
}
