//! AVX-512 stores of f32 rows as f16 or bf16 (the kernel's half-precision outputs).

use super::*;

/// `dst[x] = f16(src[x] · scale)` (the product in f32), rounding to nearest even (as
/// `half::f16::from_f32`).
///
/// # Safety
/// AVX-512F must be available, and `dst` valid for `src.len()` writes.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn store_f16(dst: *mut half::f16, src: &[f32], scale: f32) {
    let n = src.len();
    let sv = _mm512_set1_ps(scale);
    let mut x = 0;
    while x + 16 <= n {
        let v = _mm512_mul_ps(_mm512_loadu_ps(src.as_ptr().add(x)), sv);
        let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
        _mm256_storeu_si256(dst.add(x) as *mut __m256i, h);
        x += 16;
    }
    for (i, &v) in src.iter().enumerate().skip(x) {
        dst.add(i).write(half::f16::from_f32(v * scale));
    }
}

/// `dst[x] = bf16(src[x] · scale)` (the product in f32), rounding to nearest even (as
/// `half::bf16::from_f32`, but for subnormals: `VCVTNEPS2BF16` reads subnormal inputs as
/// zero and flushes subnormal results to zero; `kernels::cpu::cast` rounds them as
/// `half` does).
///
/// # Safety
/// AVX-512F and AVX512-BF16 must be available, and `dst` valid for `src.len()` writes.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(crate) unsafe fn store_bf16(dst: *mut half::bf16, src: &[f32], scale: f32) {
    let n = src.len();
    let sv = _mm512_set1_ps(scale);
    let mut x = 0;
    while x + 16 <= n {
        let h = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(src.as_ptr().add(x)), sv));
        _mm256_storeu_si256(
            dst.add(x) as *mut __m256i,
            std::mem::transmute::<__m256bh, __m256i>(h),
        );
        x += 16;
    }
    for (i, &v) in src.iter().enumerate().skip(x) {
        dst.add(i).write(half::bf16::from_f32(v * scale));
    }
}
