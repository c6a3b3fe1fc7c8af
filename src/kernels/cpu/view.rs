//! Strided views of the kernel's inputs, read as f32: q, k and v of any float dtype
//! (converted while read, with AVX-512, AVX2 or F16C where the CPU has them), and the
//! additive f32 mask.

use half::{bf16, f16, slice::HalfFloatSliceExt};

/// Borrowed storage of one input tensor.
#[derive(Clone, Copy)]
pub(crate) enum Data<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
}

impl Data<'_> {
    /// Bytes per element.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // the AVX-512 decode only
    pub fn elem_bytes(&self) -> usize {
        match self {
            Data::F32(_) => 4,
            Data::F16(_) | Data::BF16(_) => 2,
        }
    }

    /// The first element's address and the element count.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // the x86-64 kernels only
    pub fn raw_parts(&self) -> (*const u8, usize) {
        match self {
            Data::F32(v) => (v.as_ptr() as *const u8, v.len()),
            Data::F16(v) => (v.as_ptr() as *const u8, v.len()),
            Data::BF16(v) => (v.as_ptr() as *const u8, v.len()),
        }
    }
}

/// A rank-4 strided view (strides in elements; broadcast dims may have stride 0).
#[derive(Clone, Copy)]
pub(crate) struct View<'a> {
    pub data: Data<'a>,
    pub start: usize,
    pub strides: [usize; 4],
}

impl View<'_> {
    /// Element offset of `(i0, i1, i2, 0)`.
    #[inline]
    pub fn row_offset(&self, i0: usize, i1: usize, i2: usize) -> usize {
        self.start + i0 * self.strides[0] + i1 * self.strides[1] + i2 * self.strides[2]
    }

    /// `n` elements at `off` as f32: borrowed from the storage when it is f32 with unit
    /// inner stride, otherwise converted into `buf` (which must hold `n` floats).
    #[inline]
    pub fn row_f32<'s>(&'s self, off: usize, n: usize, buf: &'s mut [f32]) -> &'s [f32] {
        if let Data::F32(s) = self.data {
            if self.strides[3] == 1 || n <= 1 {
                return &s[off..off + n];
            }
        }
        let buf = &mut buf[..n];
        self.read_row(off, buf, 1.0);
        buf
    }

    /// Asks for the cache lines of the `n` unit-stride elements at `off` (a hint: nothing
    /// is read, and nothing happens for other strides or off-range offsets). Only x86-64
    /// has a stable prefetch instruction in Rust.
    #[inline]
    pub fn prefetch_row(&self, off: usize, n: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            let (ptr, len, size) = match self.data {
                Data::F32(s) => (s.as_ptr() as *const u8, s.len(), 4),
                Data::F16(s) => (s.as_ptr() as *const u8, s.len(), 2),
                Data::BF16(s) => (s.as_ptr() as *const u8, s.len(), 2),
            };
            if self.strides[3] != 1 || off.saturating_add(n) > len {
                return;
            }
            super::prefetch::prefetch_bytes(ptr.wrapping_add(off * size), n * size);
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (off, n);
    }

    /// Reads `dst.len()` elements starting at `off` with stride `strides[3]`,
    /// converting to f32 and multiplying by `mul`.
    #[inline]
    pub fn read_row(&self, off: usize, dst: &mut [f32], mul: f32) {
        let n = dst.len();
        let st = self.strides[3];
        if n == 0 {
            return;
        }
        if st == 1 {
            // (Each arm applies `mul` in the same pass.)
            match self.data {
                Data::F32(s) => {
                    let src = &s[off..off + n];
                    if mul == 1.0 {
                        dst.copy_from_slice(src);
                    } else {
                        for (d, &x) in dst.iter_mut().zip(src) {
                            *d = x * mul;
                        }
                    }
                }
                Data::F16(s) => f16_to_f32(&s[off..off + n], dst, mul),
                Data::BF16(s) => bf16_to_f32(&s[off..off + n], dst, mul),
            }
            return;
        }
        match self.data {
            Data::F32(s) => {
                for (x, d) in dst.iter_mut().enumerate() {
                    *d = s[off + x * st];
                }
            }
            Data::F16(s) => {
                for (x, d) in dst.iter_mut().enumerate() {
                    *d = s[off + x * st].to_f32();
                }
            }
            Data::BF16(s) => {
                for (x, d) in dst.iter_mut().enumerate() {
                    *d = s[off + x * st].to_f32();
                }
            }
        }
        scale_in_place(dst, mul);
    }
}

/// bf16 → f32, times `mul` (skipped when it is 1): a 16-bit shift (AVX-512 or AVX2
/// where available, else auto-vectorised).
#[inline]
fn bf16_to_f32(src: &[bf16], dst: &mut [f32], mul: f32) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F was detected just above.
            unsafe { bf16_to_f32_avx512(src, dst) };
            scale_in_place(dst, mul);
            return;
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 was detected just above.
            unsafe {
                if mul == 1.0 {
                    bf16_to_f32_avx2::<false>(src, dst, mul)
                } else {
                    bf16_to_f32_avx2::<true>(src, dst, mul)
                }
            };
            return;
        }
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f32::from_bits((s.to_bits() as u32) << 16);
    }
    scale_in_place(dst, mul);
}

/// `x *= mul` for every element, unless `mul` is 1.
#[inline]
fn scale_in_place(x: &mut [f32], mul: f32) {
    if mul != 1.0 {
        x.iter_mut().for_each(|d| *d *= mul);
    }
}

/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn bf16_to_f32_avx512(src: &[bf16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = src.len().min(dst.len());
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: `i + 16 <= n` elements are in bounds of both slices.
        let h = _mm256_loadu_si256(src.as_ptr().add(i) as *const __m256i);
        let w = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h));
        _mm512_storeu_ps(dst.as_mut_ptr().add(i), _mm512_castsi512_ps(w));
        i += 16;
    }
    for (d, s) in dst[i..n].iter_mut().zip(&src[i..n]) {
        *d = f32::from_bits((s.to_bits() as u32) << 16);
    }
}

/// How many half-precision elements ahead the AVX2 and F16C conversions ask for their
/// source (1 KiB).
#[cfg(target_arch = "x86_64")]
const PF_HALF: usize = 512;

/// With `SCALE`, each element is also multiplied by `mul` (same result as a separate
/// pass).
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn bf16_to_f32_avx2<const SCALE: bool>(src: &[bf16], dst: &mut [f32], mul: f32) {
    use std::arch::x86_64::*;
    let n = src.len().min(dst.len());
    let mv = _mm256_set1_ps(mul);
    let mut i = 0;
    while i + 8 <= n {
        if i.is_multiple_of(32) {
            // Long conversions stream from DRAM (half-precision decode converts whole
            // K/V blocks): ask for the line 1 KiB ahead (a hint that never faults).
            _mm_prefetch::<_MM_HINT_T0>(src.as_ptr().wrapping_add(i + PF_HALF) as *const i8);
        }
        // SAFETY: `i + 8 <= n` elements are in bounds of both slices.
        let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
        let w = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)));
        let w = if SCALE { _mm256_mul_ps(w, mv) } else { w };
        _mm256_storeu_ps(dst.as_mut_ptr().add(i), w);
        i += 8;
    }
    for (d, s) in dst[i..n].iter_mut().zip(&src[i..n]) {
        let x = f32::from_bits((s.to_bits() as u32) << 16);
        *d = if SCALE { x * mul } else { x };
    }
}

/// f16 → f32, times `mul` (skipped when it is 1), with F16C when available.
#[inline]
fn f16_to_f32(src: &[f16], dst: &mut [f32], mul: f32) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx") {
            // SAFETY: F16C and AVX were detected just above.
            unsafe {
                if mul == 1.0 {
                    f16_to_f32_f16c::<false>(src, dst, mul)
                } else {
                    f16_to_f32_f16c::<true>(src, dst, mul)
                }
            };
            return;
        }
    }
    src.convert_to_f32_slice(dst);
    scale_in_place(dst, mul);
}

/// With `SCALE`, each element is also multiplied by `mul` (same result as a separate
/// pass).
///
/// # Safety
/// The CPU must support AVX and F16C; `dst.len() == src.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn f16_to_f32_f16c<const SCALE: bool>(src: &[f16], dst: &mut [f32], mul: f32) {
    use std::arch::x86_64::*;
    let n = src.len().min(dst.len());
    let mv = _mm256_set1_ps(mul);
    let mut i = 0;
    while i + 8 <= n {
        if i.is_multiple_of(32) {
            // As in `bf16_to_f32_avx2`.
            _mm_prefetch::<_MM_HINT_T0>(src.as_ptr().wrapping_add(i + PF_HALF) as *const i8);
        }
        // SAFETY: `i + 8 <= n` elements are in bounds of both slices.
        let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
        let w = _mm256_cvtph_ps(h);
        let w = if SCALE { _mm256_mul_ps(w, mv) } else { w };
        _mm256_storeu_ps(dst.as_mut_ptr().add(i), w);
        i += 8;
    }
    for (d, s) in dst[i..n].iter_mut().zip(&src[i..n]) {
        *d = if SCALE { s.to_f32() * mul } else { s.to_f32() };
    }
}

/// Additive f32 mask view, rank 4, stride 0 on broadcast dims.
#[derive(Clone, Copy)]
pub(crate) struct MaskView<'a> {
    pub data: &'a [f32],
    pub start: usize,
    pub strides: [usize; 4],
}

impl MaskView<'_> {
    /// The mask as key runs, when it only hides keys: it broadcasts over query positions
    /// and each `(batch, query head)` row is `0` on one run of keys `[a, z)` and `-inf`
    /// elsewhere (a key-padding mask, as bool masks become). Then the runs, indexed
    /// `b · hq + h`, `(0, 0)` for a row that hides every key; else `None`. Adding `0`
    /// leaves a score as it is and `-inf` gives it probability 0, so loop bounds on the
    /// runs give the same result with no mask reads and no work on hidden keys.
    pub fn key_runs(&self, b: usize, hq: usize, s: usize) -> Option<Vec<(usize, usize)>> {
        if self.strides[2] != 0 {
            return None;
        }
        let mut runs: Vec<(usize, usize)> = Vec::with_capacity(b * hq);
        for bb in 0..b {
            if bb > 0 && self.strides[0] == 0 {
                // Broadcast over the batch: the same rows as batch 0.
                runs.extend_from_within(..hq);
                continue;
            }
            for h in 0..hq {
                if h > 0 && self.strides[1] == 0 {
                    // Broadcast over heads: the same row as head 0.
                    runs.push(runs[runs.len() - 1]);
                    continue;
                }
                let off = self.start + bb * self.strides[0] + h * self.strides[1];
                let mut run: Option<(usize, usize)> = None;
                for j in 0..s {
                    let x = self.data[off + j * self.strides[3]];
                    if x == 0.0 {
                        run = match run {
                            None => Some((j, j + 1)),
                            Some((a, z)) if z == j => Some((a, j + 1)),
                            // A second run of visible keys.
                            Some(_) => return None,
                        };
                    } else if x != f32::NEG_INFINITY {
                        return None;
                    }
                }
                runs.push(run.unwrap_or((0, 0)));
            }
        }
        Some(runs)
    }

    /// Adds `mul * mask[b, h, i, j0 .. j0 + row.len()]` to `row`.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub fn add_row(&self, b: usize, h: usize, i: usize, j0: usize, row: &mut [f32], mul: f32) {
        self.scale_add_row(b, h, i, j0, row, 1.0, mul)
    }

    /// `row = scale * row + mul * mask[b, h, i, j0 .. j0 + row.len()]`, where a finite
    /// mask value whose sum overflows gives ±`f32::MAX` instead of ±∞ ([`keep_finite`]).
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub fn scale_add_row(
        &self,
        b: usize,
        h: usize,
        i: usize,
        j0: usize,
        row: &mut [f32],
        scale: f32,
        mul: f32,
    ) {
        let n = row.len();
        if n == 0 {
            return;
        }
        let st = self.strides[3];
        let off = self.start + b * self.strides[0] + h * self.strides[1] + i * self.strides[2] + j0 * st;
        if st == 1 {
            let m = &self.data[off..off + n];
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: AVX-512F was detected just above; `m` and `row` have `n` elements.
                return unsafe { scale_add_avx512(row, scale, m, mul) };
            }
            for (d, &mv) in row.iter_mut().zip(m) {
                *d = keep_finite(mv, *d * scale + mv * mul);
            }
        } else {
            for (x, d) in row.iter_mut().enumerate() {
                let mv = self.data[off + x * st];
                *d = keep_finite(mv, *d * scale + mv * mul);
            }
        }
    }
}

/// `r`, the score plus the mask value `m` scaled to log2 units, except that an
/// infinite `r` from a finite `m` becomes ±`f32::MAX`. The scaling by `log2 e` overflows
/// for `|m|` above about 2.36e38: Hugging Face masks hidden keys with `f32::MIN`, and
/// the reference path adds that in natural units, where it stays finite. A row whose
/// keys all carry it is then a softmax over equal scores (the mean of V), as in
/// PyTorch, not a fully masked row (zeros). -∞ and NaN mask values are kept.
#[inline]
fn keep_finite(m: f32, r: f32) -> f32 {
    if r.is_infinite() && m.is_finite() {
        f32::MAX.copysign(r)
    } else {
        r
    }
}

/// `row = scale * row + mul * m` (`m.len() >= row.len()`), with [`keep_finite`] on
/// each lane.
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn scale_add_avx512(row: &mut [f32], scale: f32, m: &[f32], mul: f32) {
    use std::arch::x86_64::*;
    let n = row.len().min(m.len());
    let (sv, mv) = (_mm512_set1_ps(scale), _mm512_set1_ps(mul));
    let (ninf, pinf) = (_mm512_set1_ps(f32::NEG_INFINITY), _mm512_set1_ps(f32::INFINITY));
    let (min, max) = (_mm512_set1_ps(f32::MIN), _mm512_set1_ps(f32::MAX));
    let mut i = 0;
    while i < n {
        let k = if n - i >= 16 {
            0xffff
        } else {
            ((1u32 << (n - i)) - 1) as __mmask16
        };
        // SAFETY: lanes past `n` are masked off, so only in-bounds elements are touched.
        let x = _mm512_maskz_loadu_ps(k, row.as_ptr().add(i));
        let y = _mm512_maskz_loadu_ps(k, m.as_ptr().add(i));
        let r = _mm512_fmadd_ps(y, mv, _mm512_mul_ps(x, sv));
        // `keep_finite`: lanes that reached ∓∞ from a mask value other than ∓∞.
        let lo = _mm512_mask_cmp_ps_mask::<_CMP_EQ_OQ>(_mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(y, ninf), r, ninf);
        let hi = _mm512_mask_cmp_ps_mask::<_CMP_EQ_OQ>(_mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(y, pinf), r, pinf);
        let r = _mm512_mask_mov_ps(_mm512_mask_mov_ps(r, lo, min), hi, max);
        _mm512_mask_storeu_ps(row.as_mut_ptr().add(i), k, r);
        i += 16;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NEG: f32 = f32::NEG_INFINITY;

    /// A `(b, h, 1, s)` mask view of `data` with the given head and batch strides (0:
    /// broadcast).
    fn view(data: &[f32], h_stride: usize, b_stride: usize) -> MaskView<'_> {
        MaskView {
            data,
            start: 0,
            strides: [b_stride, h_stride, 0, 1],
        }
    }

    /// `scale_add_row` with mask values whose product with `log2 e` overflows f32: finite
    /// ones give ±`f32::MAX`, -∞ stays -∞ and NaN stays NaN, in the unit-stride loop
    /// (AVX-512 where the CPU has it; 20 lanes, so a masked tail too) and in the strided
    /// scalar one, which must agree bit for bit with a plain evaluation elsewhere.
    #[test]
    fn mask_values_that_overflow_when_scaled_stay_finite() {
        let l2e = std::f32::consts::LOG2_E;
        let vals = [f32::MIN, f32::MAX, -3e38, NEG, f32::NAN, -1e30, 0.0, 2.5];
        let m: Vec<f32> = (0..20).map(|j| vals[j % vals.len()]).collect();
        let scores: Vec<f32> = (0..20).map(|j| j as f32 * 0.25 - 2.0).collect();
        // Strided: the same 20 values at every other element.
        let spread: Vec<f32> = m.iter().flat_map(|&x| [x, 7.0]).collect();
        for (data, st) in [(&m[..], 1usize), (&spread[..], 2)] {
            let view = MaskView {
                data,
                start: 0,
                strides: [0, 0, 0, st],
            };
            let mut row = scores.clone();
            view.scale_add_row(0, 0, 0, 0, &mut row, 0.5, l2e);
            for (j, (&got, &x)) in row.iter().zip(&scores).enumerate() {
                let mv = m[j];
                let want = if mv.is_nan() {
                    f32::NAN
                } else if mv == NEG {
                    NEG
                } else if mv <= -3e38 {
                    f32::MIN
                } else if mv == f32::MAX {
                    f32::MAX
                } else {
                    x * 0.5 + mv * l2e
                };
                if want.is_nan() {
                    assert!(got.is_nan(), "stride {st}, key {j}: {got}");
                } else if st == 2 || want.abs() == f32::MAX || want == NEG {
                    assert_eq!(got, want, "stride {st}, key {j}");
                } else {
                    // The vector loop fuses the multiply-add: one rounding fewer.
                    assert!(
                        (got - want).abs() <= 1e-6 * want.abs().max(1.0),
                        "stride {st}, key {j}: {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn key_runs_reads_one_run_per_row() {
        // Two batches × two heads of 5 keys: a prefix, a middle run, none, all.
        let d = [
            0.0, 0.0, NEG, NEG, NEG, //
            NEG, -0.0, 0.0, NEG, NEG, //
            NEG, NEG, NEG, NEG, NEG, //
            0.0, 0.0, 0.0, 0.0, 0.0,
        ];
        let runs = view(&d, 5, 10).key_runs(2, 2, 5);
        assert_eq!(runs, Some(vec![(0, 2), (1, 3), (0, 0), (0, 5)]));
        // Broadcast over heads: each batch's row serves every head.
        let runs = view(&d, 0, 5).key_runs(2, 3, 5);
        assert_eq!(
            runs,
            Some(vec![(0, 2); 3].into_iter().chain(vec![(1, 3); 3]).collect())
        );
        // Broadcast over the batch (and heads): batch 0's runs serve every batch.
        let runs = view(&d[5..], 5, 0).key_runs(3, 2, 5);
        assert_eq!(runs, Some([(1, 3), (0, 0)].repeat(3)));
    }

    #[test]
    fn key_runs_refuses_other_masks() {
        // Two runs in one row.
        let d = [0.0, NEG, 0.0, NEG];
        assert_eq!(view(&d, 0, 0).key_runs(1, 1, 4), None);
        // A finite additive value.
        let d = [0.0, -1.0, NEG, NEG];
        assert_eq!(view(&d, 0, 0).key_runs(1, 1, 4), None);
        // A NaN.
        let d = [0.0, f32::NAN, NEG, NEG];
        assert_eq!(view(&d, 0, 0).key_runs(1, 1, 4), None);
        // A mask that differs between query positions.
        let d = [0.0, NEG, NEG, NEG];
        let per_query = MaskView {
            data: &d,
            start: 0,
            strides: [0, 0, 4, 1],
        };
        assert_eq!(per_query.key_runs(1, 1, 4), None);
    }
}
