//! The 16×16 f32 transpose of the AVX-512 K pack.

use super::*;

/// Transposes a 16×16 f32 block: row `i` of `dst` (stride `ldd`) receives column `i`
/// of `src` (16 rows of stride `lds`). Unpacks of 32- and 64-bit elements, then two
/// 128-bit lane shuffles.
///
/// # Safety
/// AVX-512F must be available; `src` must hold 16 rows of 16 floats at stride `lds`,
/// `dst` 16 rows at stride `ldd`.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn transpose16(src: *const f32, lds: usize, dst: *mut f32, ldd: usize) {
    let r: [__m512; 16] = std::array::from_fn(|i| _mm512_loadu_ps(src.add(i * lds)));
    // t[2i], t[2i+1]: 32-bit interleaves of rows 2i and 2i+1.
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    // u[4i + c], 128-bit lane `L`: column `4L + c` of rows `4i..4i + 4`.
    let mut u = [_mm512_setzero_ps(); 16];
    for i in 0..4 {
        let pd = |v: __m512| _mm512_castps_pd(v);
        let (a, b, c, d) = (pd(t[4 * i]), pd(t[4 * i + 1]), pd(t[4 * i + 2]), pd(t[4 * i + 3]));
        u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    // Column `4L + c` gathers lane `L` of u[c], u[4 + c], u[8 + c], u[12 + c].
    for c in 0..4 {
        let x0 = _mm512_shuffle_f32x4::<0x44>(u[c], u[4 + c]);
        let x1 = _mm512_shuffle_f32x4::<0xEE>(u[c], u[4 + c]);
        let y0 = _mm512_shuffle_f32x4::<0x44>(u[8 + c], u[12 + c]);
        let y1 = _mm512_shuffle_f32x4::<0xEE>(u[8 + c], u[12 + c]);
        _mm512_storeu_ps(dst.add(c * ldd), _mm512_shuffle_f32x4::<0x88>(x0, y0));
        _mm512_storeu_ps(dst.add((4 + c) * ldd), _mm512_shuffle_f32x4::<0xDD>(x0, y0));
        _mm512_storeu_ps(dst.add((8 + c) * ldd), _mm512_shuffle_f32x4::<0x88>(x1, y1));
        _mm512_storeu_ps(dst.add((12 + c) * ldd), _mm512_shuffle_f32x4::<0xDD>(x1, y1));
    }
}
