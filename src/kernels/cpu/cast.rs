//! Casts between f32 and f16/bf16 of contiguous CPU tensors, bit for bit those of
//! candle's `to_dtype` (`half`'s conversions: to nearest even, subnormals kept, a NaN
//! keeps its sign and top payload bits with the quiet bit set), on the kernels' threads.
//!
//! candle 0.11 casts element by element on one thread. On the Intel Xeon VM of
//! 2026-12-06 it took 1.2–1.4 ms to cast the 786 432 f32 elements of `mha_layer`'s input
//! or output to or from f16 (0.3–0.7 ms for bf16), where `half`'s slice conversions took
//! 0.2–0.4 ms on one thread; a layer in f16 or bf16 casts its input to f32 and its
//! output back. Here, on both threads: 0.10–0.13 ms with AVX-512 (0.10–0.16 with AVX2).
//!
//! The casts of [`Isa::selected`]: AVX-512 rounds f32 → bf16 with integer lanes (not
//! `VCVTNEPS2BF16`, which flushes subnormals) and widens with shifts and `VCVTPH2PS`;
//! AVX2 rounds through `avx2::store_bf16` and widens 8 lanes at a time; f32 → f16 takes
//! the F16C/AVX-512 stores; other instruction sets take `half`'s slice conversions.

use super::isa::Isa;
use super::store::converted_through_buffer;
use super::{pages, par};
use candle::{CpuStorage, DType, Result, Storage, Tensor};
use half::{bf16, f16, slice::HalfFloatSliceExt};
use std::mem::MaybeUninit;

/// Elements per task handed to a thread.
const CHUNK: usize = 1 << 14;

/// `t.to_dtype(dtype)` for a contiguous CPU `t` that is cast between f32 and f16/bf16
/// (any shape, the same bits); `None` for every other cast, and for tensors that record
/// gradients (candle's cast records its backward op).
pub(crate) fn to_dtype(t: &Tensor, dtype: DType) -> Option<Result<Tensor>> {
    to_dtype_on(Isa::selected(), t, dtype)
}

/// [`to_dtype`] with the casts of `isa` (the tests run each instruction set).
fn to_dtype_on(isa: Isa, t: &Tensor, dtype: DType) -> Option<Result<Tensor>> {
    // The casts below run `isa`'s instructions.
    assert!(isa.is_supported(), "cast on {}, which this CPU lacks", isa.name());
    if !t.device().is_cpu() || t.track_op() {
        return None;
    }
    let (st, lay) = t.storage_and_layout();
    let (a, z) = lay.contiguous_offsets()?;
    let (shape, dev) = (t.shape(), t.device());
    Some(match (&*st, dtype) {
        (Storage::Cpu(CpuStorage::F32(v)), DType::BF16) => {
            Tensor::from_vec(cast(&v[a..z], isa, to_bf16), shape, dev)
        }
        (Storage::Cpu(CpuStorage::F32(v)), DType::F16) => {
            Tensor::from_vec(cast(&v[a..z], isa, to_f16), shape, dev)
        }
        (Storage::Cpu(CpuStorage::BF16(v)), DType::F32) => {
            Tensor::from_vec(cast(&v[a..z], isa, from_bf16), shape, dev)
        }
        (Storage::Cpu(CpuStorage::F16(v)), DType::F32) => {
            Tensor::from_vec(cast(&v[a..z], isa, from_f16), shape, dev)
        }
        _ => return None,
    })
}

/// `src` cast element by element by `convert` on `isa`, in chunks of [`CHUNK`] shared
/// among the threads when that pays ([`par::sized`]).
fn cast<S: Sync, D: Send>(src: &[S], isa: Isa, convert: Conversion<S, D>) -> Vec<D> {
    let n = src.len();
    let mut out: Vec<D> = Vec::with_capacity(n);
    let dst = &mut out.spare_capacity_mut()[..n];
    pages::advise_fresh_output(dst);
    par::sized(par::work_ns(0.0, 2.0 * n as f64), || {
        par::chunks_for_each(
            dst,
            CHUNK,
            || (),
            |_, (i, d)| convert(isa, d, &src[i * CHUNK..][..d.len()]),
        )
    });
    // SAFETY: `chunks_for_each` returned, so `convert` ran on every chunk of `dst`, and
    // each call wrote all of its chunk.
    unsafe { out.set_len(n) };
    out
}

/// `dst[i] = src[i]` rounded to `dtype` (bf16 or f16) with AVX-512, bit for bit as
/// [`to_dtype`] rounds it: for products that write half-precision rows themselves
/// (`amx_linear`).
///
/// # Safety
/// AVX-512F is available, and `dst` is valid for `src.len()` writes.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn round_avx512(dtype: DType, dst: *mut u16, src: &[f32]) {
    match dtype {
        DType::BF16 => x86::to_bf16(dst.cast(), src),
        DType::F16 => super::avx512::store_f16(dst.cast(), src, 1.0),
        _ => unreachable!("round_avx512 rounds to bf16 or f16, not {dtype:?}"),
    }
}

/// A cast of a chunk on an instruction set: `dst` (of `src.len()` elements) all written.
type Conversion<S, D> = fn(Isa, &mut [MaybeUninit<D>], &[S]);

fn to_bf16(isa: Isa, dst: &mut [MaybeUninit<bf16>], src: &[f32]) {
    match isa {
        // SAFETY (both): `isa` is supported (`Isa::selected`, or the tests' check), so
        // AVX-512F or AVX2 is there; `dst` holds `src.len()` elements.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::to_bf16(dst.as_mut_ptr().cast(), src) },
        // Rounded as `half::bf16::from_f32`; `x · 1` is `x` (a signalling NaN quieted,
        // as `half` quiets it).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => unsafe { super::avx2::store_bf16(dst.as_mut_ptr().cast(), src, 1.0) },
        _ => converted_through_buffer(dst, src, |b: &mut [bf16], s| b.convert_from_f32_slice(s)),
    }
}

fn to_f16(isa: Isa, dst: &mut [MaybeUninit<f16>], src: &[f32]) {
    match isa {
        // SAFETY (both): as in `to_bf16`; AVX2+FMA as `Isa` selects it includes F16C.
        // Both round to nearest even, as `half::f16::from_f32`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { super::avx512::store_f16(dst.as_mut_ptr().cast(), src, 1.0) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => unsafe { super::avx2::store_f16(dst.as_mut_ptr().cast(), src, 1.0) },
        _ => converted_through_buffer(dst, src, |b: &mut [f16], s| b.convert_from_f32_slice(s)),
    }
}

fn from_bf16(isa: Isa, dst: &mut [MaybeUninit<f32>], src: &[bf16]) {
    match isa {
        // SAFETY (both): as in `to_bf16`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::from_bf16(dst.as_mut_ptr().cast(), src) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => unsafe { x86::from_bf16_avx2(dst.as_mut_ptr().cast(), src) },
        _ => converted_through_buffer(dst, src, |b, s: &[bf16]| s.convert_to_f32_slice(b)),
    }
}

fn from_f16(isa: Isa, dst: &mut [MaybeUninit<f32>], src: &[f16]) {
    match isa {
        // SAFETY (both): as in `to_f16`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::from_f16(dst.as_mut_ptr().cast(), src) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => unsafe { x86::from_f16_avx2(dst.as_mut_ptr().cast(), src) },
        _ => converted_through_buffer(dst, src, |b, s: &[f16]| s.convert_to_f32_slice(b)),
    }
}

/// The AVX-512 casts (16 elements per step) and the AVX2 widening casts (8), each
/// element as `half` converts it. `view`'s widening loops (the kernel's reads of q, k,
/// v) are not reused: they write initialised rows, scale, and keep a signalling NaN's
/// bits, where a cast writes fresh memory and quiets it as `half` does.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    /// `dst[i] = bf16(src[i])`, rounded as `half::bf16::from_f32`: to nearest even (add
    /// `0x7fff` plus the lowest kept bit, then shift; subnormals kept, unlike
    /// `VCVTNEPS2BF16`), and a NaN keeps its top bits with the quiet bit set.
    ///
    /// # Safety
    /// AVX-512F must be available, and `dst` valid for `src.len()` writes.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn to_bf16(dst: *mut bf16, src: &[f32]) {
        let n = src.len();
        let mut i = 0;
        while i + 16 <= n {
            let v = _mm512_loadu_ps(src.as_ptr().add(i));
            let b = _mm512_castps_si512(v);
            let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
            let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(
                b,
                _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)),
            ));
            let nan = _mm512_or_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(0x40));
            let bits = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v), nan);
            _mm256_storeu_si256(dst.add(i) as *mut __m256i, _mm512_cvtepi32_epi16(bits));
            i += 16;
        }
        for (j, &v) in src.iter().enumerate().skip(i) {
            dst.add(j).write(bf16::from_f32(v));
        }
    }

    /// `dst[i] = f32(src[i])`, as `half::bf16::to_f32`: the bits shifted up, and a NaN
    /// quieted.
    ///
    /// # Safety
    /// AVX-512F must be available, and `dst` valid for `src.len()` writes.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn from_bf16(dst: *mut f32, src: &[bf16]) {
        let n = src.len();
        let mut i = 0;
        while i + 16 <= n {
            let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(src.as_ptr().add(i) as *const __m256i));
            let is_nan = _mm512_cmpgt_epi32_mask(
                _mm512_and_si512(h, _mm512_set1_epi32(0x7fff)),
                _mm512_set1_epi32(0x7f80),
            );
            let h = _mm512_mask_or_epi32(h, is_nan, h, _mm512_set1_epi32(0x40));
            _mm512_storeu_si512(dst.add(i) as *mut __m512i, _mm512_slli_epi32::<16>(h));
            i += 16;
        }
        for (j, x) in src.iter().enumerate().skip(i) {
            dst.add(j).write(x.to_f32());
        }
    }

    /// `dst[i] = f32(src[i])` (`VCVTPH2PS`, exact, as `half::f16::to_f32`).
    ///
    /// # Safety
    /// AVX-512F must be available, and `dst` valid for `src.len()` writes.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn from_f16(dst: *mut f32, src: &[f16]) {
        let n = src.len();
        let mut i = 0;
        while i + 16 <= n {
            let v = _mm512_cvtph_ps(_mm256_loadu_si256(src.as_ptr().add(i) as *const __m256i));
            _mm512_storeu_ps(dst.add(i), v);
            i += 16;
        }
        for (j, x) in src.iter().enumerate().skip(i) {
            dst.add(j).write(x.to_f32());
        }
    }

    /// [`from_bf16`] with AVX2, 8 elements per step.
    ///
    /// # Safety
    /// AVX2 must be available, and `dst` valid for `src.len()` writes.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn from_bf16_avx2(dst: *mut f32, src: &[bf16]) {
        let n = src.len();
        let mut i = 0;
        while i + 8 <= n {
            let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(src.as_ptr().add(i) as *const __m128i));
            let is_nan = _mm256_cmpgt_epi32(
                _mm256_and_si256(h, _mm256_set1_epi32(0x7fff)),
                _mm256_set1_epi32(0x7f80),
            );
            let h = _mm256_or_si256(h, _mm256_and_si256(is_nan, _mm256_set1_epi32(0x40)));
            _mm256_storeu_si256(dst.add(i) as *mut __m256i, _mm256_slli_epi32::<16>(h));
            i += 8;
        }
        for (j, x) in src.iter().enumerate().skip(i) {
            dst.add(j).write(x.to_f32());
        }
    }

    /// [`from_f16`] with F16C, 8 elements per step.
    ///
    /// # Safety
    /// AVX and F16C must be available, and `dst` valid for `src.len()` writes.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn from_f16_avx2(dst: *mut f32, src: &[f16]) {
        let n = src.len();
        let mut i = 0;
        while i + 8 <= n {
            let v = _mm256_cvtph_ps(_mm_loadu_si128(src.as_ptr().add(i) as *const __m128i));
            _mm256_storeu_ps(dst.add(i), v);
            i += 8;
        }
        for (j, x) in src.iter().enumerate().skip(i) {
            dst.add(j).write(x.to_f32());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle::Device;

    /// f32 bit patterns that every rounding rule must get right: zeros, subnormals,
    /// the edges of bf16's and f16's ranges, halfway cases, infinities, quiet and
    /// signalling NaNs with payloads, and xorshift values over all exponents.
    fn f32_bits() -> Vec<u32> {
        let mut v: Vec<u32> = vec![
            0,
            0x8000_0000,
            1,
            0x8000_0001,
            0x007f_ffff,
            0x0080_0000,
            0x0080_8000,
            0x0001_8000,
            0x7f7f_ffff,
            0x7f7f_8000,
            0x7f7f_7fff,
            0xff7f_ffff,
            0x3f80_8000,
            0x3f81_8000,
            0x3f80_7fff,
            0x4780_0000,
            0x477f_f000,
            0x477f_efff,
            0x3380_0000,
            0x3300_0000,
            0x3300_0001,
            0x3880_0000,
            0x387f_ffff,
            0x7f80_0000,
            0xff80_0000,
            0x7fc0_0000,
            0xffc0_0001,
            0x7f80_0001,
            0xff80_0001,
            0x7fa0_1234,
            0x7f80_2000,
            0x7fbf_ffff,
        ];
        let mut x = 0x9e37_79b9u32;
        for _ in 0..70_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            v.push(x);
        }
        v
    }

    fn bits_of(t: &Tensor) -> Result<Vec<u32>> {
        Ok(match t.dtype() {
            DType::F32 => t.to_vec1::<f32>()?.iter().map(|x| x.to_bits()).collect(),
            DType::BF16 => t
                .to_vec1::<bf16>()?
                .iter()
                .map(|x| u32::from(x.to_bits()))
                .collect(),
            DType::F16 => t
                .to_vec1::<f16>()?
                .iter()
                .map(|x| u32::from(x.to_bits()))
                .collect(),
            dt => candle::bail!("no bits for {dt:?}"),
        })
    }

    const ISAS: [Isa; 4] = [Isa::Avx512, Isa::Avx2Fma, Isa::Neon, Isa::Portable];

    /// Every cast gives candle's bits, on every instruction set this machine has, on
    /// both threads and on one, for lengths around the chunk and SIMD widths, from an
    /// offset into the storage.
    #[test]
    fn casts_give_candles_bits() -> Result<()> {
        let dev = Device::Cpu;
        let bits = f32_bits();
        let all = Tensor::from_vec(
            bits.iter().map(|&b| f32::from_bits(b)).collect::<Vec<_>>(),
            bits.len(),
            &dev,
        )?;
        let half_bits: Vec<u16> = bits.iter().map(|&b| (b >> 16) as u16).collect();
        let bf = Tensor::from_vec(
            half_bits.iter().map(|&b| bf16::from_bits(b)).collect::<Vec<_>>(),
            bits.len(),
            &dev,
        )?;
        let hf = Tensor::from_vec(
            half_bits.iter().map(|&b| f16::from_bits(b)).collect::<Vec<_>>(),
            bits.len(),
            &dev,
        )?;
        let cases = [
            (&all, DType::BF16),
            (&all, DType::F16),
            (&bf, DType::F32),
            (&hf, DType::F32),
        ];
        for len in [
            0,
            1,
            7,
            8,
            15,
            16,
            17,
            33,
            64,
            65,
            CHUNK - 1,
            CHUNK + 3,
            bits.len() - 5,
        ] {
            for (src, dt) in cases {
                let src = src.narrow(0, 5, len)?;
                let want = bits_of(&src.to_dtype(dt)?)?;
                for isa in ISAS.into_iter().filter(|i| i.is_supported()) {
                    let got = to_dtype_on(isa, &src, dt).expect("a contiguous CPU cast is taken")?;
                    assert_eq!((got.dims(), got.dtype()), (src.dims(), dt));
                    let one = par::inline(|| to_dtype_on(isa, &src, dt).expect("taken"))?;
                    for (got, threads) in [(got, "both threads"), (one, "one thread")] {
                        let got = bits_of(&got)?;
                        let bad = got.iter().zip(&want).position(|(a, b)| a != b);
                        assert!(
                            bad.is_none(),
                            "{:?} → {dt:?} on {}, {len} elements, {threads}: element {bad:?} is {:#x}, candle's {:#x}",
                            src.dtype(),
                            isa.name(),
                            got[bad.unwrap_or(0)],
                            want[bad.unwrap_or(0)]
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// Casts it does not take: other dtype pairs, strided views, and tensors that record
    /// gradients.
    #[test]
    fn other_casts_are_left_to_candle() -> Result<()> {
        let dev = Device::Cpu;
        let t = Tensor::arange(0f32, 12., &dev)?.reshape((3, 4))?;
        assert!(to_dtype(&t, DType::F64).is_none());
        assert!(to_dtype(&t, DType::F32).is_none());
        assert!(to_dtype(&t.to_dtype(DType::BF16)?, DType::F16).is_none());
        assert!(to_dtype(&t.t()?, DType::BF16).is_none());
        let var = candle::Var::from_tensor(&t)?;
        assert!(to_dtype(var.as_tensor(), DType::BF16).is_none());
        // A contiguous view at an offset is taken, with its own shape.
        let got = to_dtype(&t.narrow(0, 1, 2)?, DType::BF16).expect("taken")?;
        assert_eq!(
            got.to_dtype(DType::F32)?.to_vec2::<f32>()?,
            [[4., 5., 6., 7.], [8., 9., 10., 11.]]
        );
        Ok(())
    }
}
