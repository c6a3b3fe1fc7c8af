//! Output element types: the f32 accumulators converted into output memory that may
//! still be uninitialised (f16 through F16C or AVX-512, bf16 rounded to nearest even).

use half::{bf16, f16, slice::HalfFloatSliceExt};
use std::mem::MaybeUninit;

/// Output element types: conversion from the f32 accumulators into output memory that
/// may still be uninitialised.
pub(crate) trait OutElem: Copy + Send + Sync + Default + 'static {
    /// Writes `src` converted to `dst` (of the same length).
    fn store(dst: &mut [MaybeUninit<Self>], src: &[f32]);

    /// [`OutElem::store`] of `src · scale`; `tmp` (at least `src.len()`) is scratch for
    /// the types that convert.
    fn store_scaled(dst: &mut [MaybeUninit<Self>], src: &[f32], scale: f32, tmp: &mut [f32]) {
        scaled_then_stored(dst, src, scale, tmp)
    }
}

impl OutElem for f32 {
    #[inline]
    fn store(dst: &mut [MaybeUninit<f32>], src: &[f32]) {
        assert_eq!(dst.len(), src.len());
        for (d, &x) in dst.iter_mut().zip(src) {
            d.write(x);
        }
    }

    #[inline]
    fn store_scaled(dst: &mut [MaybeUninit<f32>], src: &[f32], scale: f32, _tmp: &mut [f32]) {
        assert_eq!(dst.len(), src.len());
        for (d, &x) in dst.iter_mut().zip(src) {
            d.write(x * scale);
        }
    }
}

/// `dst[i] = convert(src[i])` through a stack buffer: `convert` fills initialised
/// chunks of up to 64 elements (`half`'s slice conversions, SIMD where the CPU has it,
/// unlike a per-element `from_f32`), which are then copied into the possibly
/// uninitialised `dst` (of `src.len()` elements). The non-AVX-512 [`OutElem::store`] of
/// the half types, and the portable casts of [`super::cast`].
pub(crate) fn converted_through_buffer<S, D: Copy + Default>(
    dst: &mut [MaybeUninit<D>],
    src: &[S],
    convert: impl Fn(&mut [D], &[S]),
) {
    assert_eq!(dst.len(), src.len());
    const CHUNK: usize = 64;
    let mut buf = [D::default(); CHUNK];
    for (d, s) in dst.chunks_mut(CHUNK).zip(src.chunks(CHUNK)) {
        let b = &mut buf[..s.len()];
        convert(b, s);
        for (x, &y) in d.iter_mut().zip(b.iter()) {
            x.write(y);
        }
    }
}

impl OutElem for f16 {
    #[inline]
    fn store(dst: &mut [MaybeUninit<f16>], src: &[f32]) {
        assert_eq!(dst.len(), src.len());
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F was detected just above; `dst` holds `src.len()` elements.
            return unsafe { super::avx512::store_f16(dst.as_mut_ptr().cast(), src, 1.0) };
        }
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c") {
            // SAFETY: AVX2 and F16C were detected just above; `dst` holds `src.len()`
            // elements.
            return unsafe { super::avx2::store_f16(dst.as_mut_ptr().cast(), src, 1.0) };
        }
        converted_through_buffer(dst, src, |b, s| b.convert_from_f32_slice(s));
    }

    /// On AVX-512 the scale and the conversion are one pass; the same rounding as
    /// scaling into `tmp` first.
    #[inline]
    fn store_scaled(dst: &mut [MaybeUninit<f16>], src: &[f32], scale: f32, tmp: &mut [f32]) {
        assert_eq!(dst.len(), src.len());
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F was detected just above; `dst` holds `src.len()` elements.
            return unsafe { super::avx512::store_f16(dst.as_mut_ptr().cast(), src, scale) };
        }
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c") {
            // SAFETY: AVX2 and F16C were detected just above; `dst` holds `src.len()`
            // elements.
            return unsafe { super::avx2::store_f16(dst.as_mut_ptr().cast(), src, scale) };
        }
        scaled_then_stored(dst, src, scale, tmp);
    }
}

impl OutElem for bf16 {
    #[inline]
    fn store(dst: &mut [MaybeUninit<bf16>], src: &[f32]) {
        assert_eq!(dst.len(), src.len());
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bf16")
        {
            // SAFETY: both features were detected just above; `dst` holds `src.len()`
            // elements.
            return unsafe { super::avx512::store_bf16(dst.as_mut_ptr().cast(), src, 1.0) };
        }
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 was detected just above; `dst` holds `src.len()` elements.
            return unsafe { super::avx2::store_bf16(dst.as_mut_ptr().cast(), src, 1.0) };
        }
        converted_through_buffer(dst, src, |b, s| b.convert_from_f32_slice(s));
    }

    /// As for f16: one pass on AVX-512 (with AVX512-BF16).
    #[inline]
    fn store_scaled(dst: &mut [MaybeUninit<bf16>], src: &[f32], scale: f32, tmp: &mut [f32]) {
        assert_eq!(dst.len(), src.len());
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bf16")
        {
            // SAFETY: both features were detected just above; `dst` holds `src.len()`
            // elements.
            return unsafe { super::avx512::store_bf16(dst.as_mut_ptr().cast(), src, scale) };
        }
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 was detected just above; `dst` holds `src.len()` elements.
            return unsafe { super::avx2::store_bf16(dst.as_mut_ptr().cast(), src, scale) };
        }
        scaled_then_stored(dst, src, scale, tmp);
    }
}

/// The default [`OutElem::store_scaled`]: `src · scale` into `tmp`, then stored.
fn scaled_then_stored<T: OutElem>(dst: &mut [MaybeUninit<T>], src: &[f32], scale: f32, tmp: &mut [f32]) {
    let tmp = &mut tmp[..src.len()];
    for (t, &x) in tmp.iter_mut().zip(src) {
        *t = x * scale;
    }
    T::store(dst, tmp);
}
