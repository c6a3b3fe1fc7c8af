//! AVX2 stores of f32 rows as f16 or bf16 (the kernel's half-precision outputs).

use super::*;

/// `dst[x] = f16(src[x] · scale)` (the product in f32), rounding to nearest even, as
/// `half::f16::from_f32` and `avx512::store_f16` do (F16C, 8 elements per step).
///
/// # Safety
/// AVX2 and F16C must be available, and `dst` valid for `src.len()` writes.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn store_f16(dst: *mut half::f16, src: &[f32], scale: f32) {
    let n = src.len();
    let sv = _mm256_set1_ps(scale);
    let mut x = 0;
    while x + 8 <= n {
        let v = _mm256_mul_ps(_mm256_loadu_ps(src.as_ptr().add(x)), sv);
        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
        _mm_storeu_si128(dst.add(x) as *mut __m128i, h);
        x += 8;
    }
    for (i, &v) in src.iter().enumerate().skip(x) {
        dst.add(i).write(half::f16::from_f32(v * scale));
    }
}

/// The eight f32 lanes of `v` as bf16 bit patterns in the low 16 bits of each 32-bit
/// lane, rounded as `half::bf16::from_f32`: to nearest even (add `0x7fff` plus the
/// lowest kept bit, then shift), and a NaN keeps its top bits with the quiet bit set.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn bf16_bits(v: __m256) -> __m256i {
    let b = _mm256_castps_si256(v);
    let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(1));
    let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(
        b,
        _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)),
    ));
    let nan = _mm256_or_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(0x40));
    let is_nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
    _mm256_blendv_epi8(rounded, nan, is_nan)
}

/// `dst[x] = bf16(src[x] · scale)` (the product in f32), rounded as
/// `half::bf16::from_f32` (see [`bf16_bits`]), 16 elements per step.
///
/// # Safety
/// AVX2 must be available, and `dst` valid for `src.len()` writes.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn store_bf16(dst: *mut half::bf16, src: &[f32], scale: f32) {
    let n = src.len();
    let sv = _mm256_set1_ps(scale);
    let mut x = 0;
    while x + 16 <= n {
        let a = bf16_bits(_mm256_mul_ps(_mm256_loadu_ps(src.as_ptr().add(x)), sv));
        let b = bf16_bits(_mm256_mul_ps(_mm256_loadu_ps(src.as_ptr().add(x + 8)), sv));
        // Each lane fits in 16 bits, so the saturating pack is exact; it interleaves the
        // 128-bit halves (a0 b0 a1 b1), which the permute puts back in order.
        let h = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(a, b));
        _mm256_storeu_si256(dst.add(x) as *mut __m256i, h);
        x += 16;
    }
    for (i, &v) in src.iter().enumerate().skip(x) {
        dst.add(i).write(half::bf16::from_f32(v * scale));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX2 half-precision stores give exactly `half`'s conversions of the f32
    /// products, for every length remainder of their 8- and 16-element steps: ties that
    /// round to even both ways, values that round up into the next binade or to
    /// infinity, subnormal results, ±0, ±inf and NaNs (a signalling one, and payloads whose rounding
    /// would carry out of the exponent).
    #[test]
    fn half_stores_round_as_half() {
        if !super::super::super::Isa::Avx2Fma.is_supported() {
            return;
        }
        let mut rnd = uniform(4242, 3.0);
        let mut src: Vec<f32> = vec![
            f32::from_bits(0x3f80_8000), // bf16 tie, even below: rounds down
            f32::from_bits(0x3f81_8000), // bf16 tie, odd below: rounds up
            f32::from_bits(0x3f80_8001), // just above a bf16 tie
            f32::from_bits(0x3fff_ffff), // rounds up into the next binade
            f32::from_bits(0x7f7f_ffff), // f32::MAX: bf16 rounds to inf
            1.0 + 2f32.powi(-11),        // f16 tie, even below
            1.0 + 3.0 * 2f32.powi(-11),  // f16 tie, odd below
            65520.0,                     // f16 rounds to inf
            1e5,                         // beyond f16
            3e-6,                        // f16 subnormal
            1e-9,                        // below f16's smallest subnormal
            f32::from_bits(1),           // f32 subnormal
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::from_bits(0x7f80_0001), // signalling NaN
            f32::from_bits(0xffc1_2345), // negative quiet NaN with payload
            f32::from_bits(0x7fff_ffff), // NaN whose rounding would carry into the sign
        ];
        src.extend((0..45).map(|_| rnd()));
        for scale in [1.0f32, 0.37, 3.0e-3] {
            for n in 0..src.len() {
                let s = &src[..n];
                let mut h = vec![half::f16::ZERO; n];
                let mut b = vec![half::bf16::ZERO; n];
                // SAFETY: features checked above; both buffers hold `n` elements.
                unsafe {
                    store_f16(h.as_mut_ptr(), s, scale);
                    store_bf16(b.as_mut_ptr(), s, scale);
                }
                for (i, &x) in s.iter().enumerate() {
                    let want_h = half::f16::from_f32(x * scale);
                    let want_b = half::bf16::from_f32(x * scale);
                    assert_eq!(
                        h[i].to_bits(),
                        want_h.to_bits(),
                        "f16 of {x:e}·{scale} (n = {n}, i = {i})"
                    );
                    assert_eq!(
                        b[i].to_bits(),
                        want_b.to_bits(),
                        "bf16 of {x:e}·{scale} (n = {n}, i = {i})"
                    );
                }
            }
        }
    }
}
