//! The 8×8 f32 transpose of the AVX2 K pack.

use super::*;

/// Transposes an 8×8 f32 block: row `i` of `dst` (stride `ldd`) receives column `i`
/// of `src` (8 rows of stride `lds`). Unpacks of 32- and 64-bit elements, then 128-bit
/// lane permutes.
///
/// # Safety
/// AVX2 must be available; `src` must hold 8 rows of 8 floats at stride `lds`, `dst`
/// 8 rows of 8 at stride `ldd`.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn transpose8(src: *const f32, lds: usize, dst: *mut f32, ldd: usize) {
    let r: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(src.add(i * lds)));
    // t[2i], t[2i+1]: 32-bit interleaves of rows 2i and 2i+1.
    let mut t = [_mm256_setzero_ps(); 8];
    for i in 0..4 {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    // u[4i + c], 128-bit lane `L`: column `4L + c` of rows `4i..4i + 4`.
    let mut u = [_mm256_setzero_ps(); 8];
    for i in 0..2 {
        let pd = |v: __m256| _mm256_castps_pd(v);
        let (a, b, c, d) = (pd(t[4 * i]), pd(t[4 * i + 1]), pd(t[4 * i + 2]), pd(t[4 * i + 3]));
        u[4 * i] = _mm256_castpd_ps(_mm256_unpacklo_pd(a, c));
        u[4 * i + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(a, c));
        u[4 * i + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(b, d));
        u[4 * i + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(b, d));
    }
    // Column `4L + c` is lane `L` of u[c] (rows 0..4) then lane `L` of u[4 + c] (rows 4..8).
    for c in 0..4 {
        _mm256_storeu_ps(dst.add(c * ldd), _mm256_permute2f128_ps::<0x20>(u[c], u[4 + c]));
        _mm256_storeu_ps(
            dst.add((4 + c) * ldd),
            _mm256_permute2f128_ps::<0x31>(u[c], u[4 + c]),
        );
    }
}
