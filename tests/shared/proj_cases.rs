//! Shapes on which `Proj::forward` (the CPU kernel's product where it applies) is
//! checked against candle's `matmul` reference: short row tiles of every height of the
//! AVX-512 (14-row) and AVX2 (6-row) tiles, partial 16-output panels (masked stores) and
//! an odd panel count, contraction lengths that are not multiples of 16 (the W pack's
//! 16×16 transposes) or of 4 (the products' unrolled steps, also after a full
//! contraction chunk of 768), several parallel row blocks, fewer rows than a tile (the
//! kept pack's column-split product), with and without bias. Every
//! projection is applied twice: the first product packs the weight for that call only,
//! the second keeps the pack and uses it (below a register tile of rows, the first call
//! already makes the kept pack). Used by `tests/proj.rs` and, with the AVX2 kernel
//! forced, by `tests/kernel_avx2.rs`, as is [`repeated_calls_agree_bit_for_bit`].
use candle_attention::Proj;
use candle_core::{DType, Device, Result, Tensor};

/// `max|a − b| / max(1, max|b|)` in f64, infinite where a difference is NaN (a NaN or
/// an infinity on either side): the fixtures' normalised error.
pub use candle_attention::fixture::normalised_error as rel_err;

/// Every case of this file, with the counts that each must compare.
pub fn all_cases_pass() -> Result<()> {
    let n = projections_match_matmul()?;
    assert!(n >= 80, "only {n} products compared");
    assert_eq!(repeated_calls_agree_bit_for_bit()?, 90);
    assert_eq!(calls_of_other_sizes_leave_a_call_unchanged()?, 9);
    assert_eq!(half_precision_weights_match()?, 24);
    Ok(())
}

/// Runs every case (each asserts); returns the number of products compared.
pub fn projections_match_matmul() -> Result<usize> {
    let mut compared = 0;
    let dev = Device::Cpu;
    // (rows, in, out): tiny (on the calling thread; candle's path before 2026-12-05),
    // row and output padding, contraction tails, > one row block.
    let shapes = [
        (3, 8, 8),
        (1, 8, 8),
        (16, 16, 16),
        (6, 32, 20),
        (2, 20, 12),
        (7, 3, 5),
        (14, 64, 64),
        (37, 100, 50),
        (300, 96, 129),
        (29, 103, 64),
        (300, 259, 129),
        (60, 771, 40),
        (1024, 768, 768),
        // Rows 4 KiB apart (copied to a longer stride), in whole tiles and a tail.
        (45, 1024, 40),
    ];
    // Rows 15..27: full tiles, then a short tile of every height 1..13 of the 14-row
    // AVX-512 tile and 1..5 of the 6-row AVX2 tile (with a pair of output panels and a
    // single last one).
    let short = (15..28).map(|rows| (rows, 40, 48));
    // Fewer rows than a tile (decode steps): the kept pack's column-split product from
    // the second call on, with an odd number of panel pairs, a partial last panel and a
    // contraction past one chunk.
    let few = (1..15).map(|rows| (rows, 800, 80 + rows)).chain([(9, 2048, 33)]);
    for (rows, inp, out) in shapes.into_iter().chain(short).chain(few) {
        let x = Tensor::randn(0f32, 1.0, (rows, inp), &dev)?;
        let w = (Tensor::randn(0f32, 1.0, (out, inp), &dev)? / (inp as f64).sqrt())?;
        let b = Tensor::randn(0f32, 1.0, out, &dev)?;
        for bias in [None, Some(b)] {
            let p = Proj::new(w.clone(), bias.clone());
            let want = Proj::matmul_bias_reference(&x, &w, bias.as_ref())?;
            for call in ["first", "second"] {
                let got = p.forward(&x)?;
                assert_eq!(got.dims(), &[rows, out]);
                let err = rel_err(&got, &want)?;
                compared += 1;
                assert!(
                    err < 1e-5,
                    "rows {rows} in {inp} out {out} bias {} ({call} call): err {err}",
                    bias.is_some()
                );
            }
        }
    }
    Ok(compared)
}

/// A projection called again on the same input returns the same bits, whatever its
/// earlier calls: for every row count from 1 to 15 (below, at and past the AVX2 and
/// AVX-512 register tiles), f32, bf16 and f16 weights, and contraction lengths that the
/// in-place dot products read (64) and do not read (24). (Until 2026-12-05 the first
/// call of fewer rows than a tile read the weight in place, by dot products, and later
/// calls ran on the kept pack: results 1–2 f32 ulps apart.) Returns the number of
/// projections checked.
pub fn repeated_calls_agree_bit_for_bit() -> Result<usize> {
    let dev = Device::Cpu;
    let mut checked = 0;
    for inp in [64, 24] {
        for rows in 1..16 {
            for wdt in [DType::F32, DType::BF16, DType::F16] {
                let w = Tensor::randn(0f32, 1.0, (40, inp), &dev)?.to_dtype(wdt)?;
                let b = Tensor::randn(0f32, 1.0, 40, &dev)?.to_dtype(wdt)?;
                let x = Tensor::randn(0f32, 1.0, (rows, inp), &dev)?;
                let p = Proj::new(w, Some(b));
                let first = p.forward(&x)?.to_vec2::<f32>()?;
                for call in 2..=3 {
                    let again = p.forward(&x)?.to_vec2::<f32>()?;
                    let same = first
                        .iter()
                        .flatten()
                        .zip(again.iter().flatten())
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "rows {rows} in {inp} weight {wdt:?}: call {call} differs from the first"
                    );
                }
                checked += 1;
            }
        }
    }
    Ok(checked)
}

/// A projection's result for one input does not depend on the calls it ran before:
/// calls of 4 and of 40 rows, of f32 and of the weight's dtype, in two orders and
/// repeated, give the bits that a fresh projection gives for each, with f32, bf16 and
/// f16 weights. (Products against an f16 weight take the AMX tile unit's pack for
/// half-precision inputs of 16 rows or more and f32 panels for the rest, where the tile
/// unit is enabled; a projection that runs both keeps both packs.) Returns the number
/// of sequences checked.
pub fn calls_of_other_sizes_leave_a_call_unchanged() -> Result<usize> {
    let dev = Device::Cpu;
    let bits = |t: Tensor| -> Result<Vec<u32>> {
        let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        Ok(v.iter().map(|x| x.to_bits()).collect())
    };
    let mut checked = 0;
    for wdt in [DType::F32, DType::BF16, DType::F16] {
        let w = Tensor::randn(0f32, 1.0, (100, 96), &dev)?.to_dtype(wdt)?;
        let b = Tensor::randn(0f32, 1.0, 100, &dev)?.to_dtype(wdt)?;
        let mut xs = Vec::new();
        for xdt in [DType::F32, wdt] {
            for rows in [4, 40] {
                xs.push(Tensor::randn(0f32, 1.0, (rows, 96), &dev)?.to_dtype(xdt)?);
            }
        }
        let fresh = |x: &Tensor| bits(Proj::new(w.clone(), Some(b.clone())).forward(x)?);
        let want = xs.iter().map(fresh).collect::<Result<Vec<_>>>()?;
        for order in [
            [0, 1, 2, 3, 0, 1, 2, 3],
            [3, 2, 1, 0, 3, 2, 1, 0],
            [1, 3, 0, 2, 1, 3, 0, 2],
        ] {
            let p = Proj::new(w.clone(), Some(b.clone()));
            for (call, &i) in order.iter().enumerate() {
                let x = &xs[i];
                assert!(
                    bits(p.forward(x)?)? == want[i],
                    "weight {wdt:?}, order {order:?}: call {call} ({} rows, {:?}) differs from a fresh projection's",
                    x.dim(0)?,
                    x.dtype()
                );
            }
            checked += 1;
        }
    }
    Ok(checked)
}

/// f16/bf16 weights (as loaded from a half-precision checkpoint) with f16, bf16 or f32
/// inputs: the product is the f32 product of the converted values (the CPU kernel
/// converts the weight while packing it, or widens it in registers for a few rows), on
/// shapes with full 16×16 weight blocks, a partial last panel and a contraction tail.
/// An f16 weight against an f16 input of 16 rows or more may skip the products of the
/// two low bf16 parts (on the AMX tile unit): within `2⁻¹⁶·Σ|x·w|` more. Runs every case
/// (each asserts); returns the number of projections compared, each on two calls.
pub fn half_precision_weights_match() -> Result<usize> {
    let dev = Device::Cpu;
    let mut compared = 0;
    // Then a few rows (decode steps): one row reads the weight in place on every call
    // (where AVX512-BF16 runs bf16 weights without AMX, a half-precision row takes the
    // pack instead),
    // with one 32-element bf16 group and a 16-element tail (96); several rows run on the
    // kept pack; whole groups (2048).
    for (rows, inp, out) in [
        (37, 100, 50),
        (300, 96, 129),
        (64, 768, 768),
        (1, 96, 40),
        (5, 96, 129),
        (13, 2048, 33),
    ] {
        for wdt in [DType::BF16, DType::F16] {
            let w = (Tensor::randn(0f32, 1.0, (out, inp), &dev)? / (inp as f64).sqrt())?.to_dtype(wdt)?;
            let b = Tensor::randn(0f32, 1.0, out, &dev)?.to_dtype(wdt)?;
            for xdt in [wdt, DType::F32] {
                let x = Tensor::randn(0f32, 1.0, (rows, inp), &dev)?.to_dtype(xdt)?;
                let p = Proj::new(w.clone(), Some(b.clone()));
                let f = |t: &Tensor| t.to_dtype(DType::F32);
                let want = Proj::matmul_bias_reference(&f(&x)?, &f(&w)?, Some(&f(&b)?))?;
                let mut tol = 1e-5;
                if (wdt, xdt) == (DType::F16, DType::F16) {
                    // `2⁻¹⁶·max Σ|x·w|`, relative to the fixtures' `max(1, max|want|)`.
                    let size = f(&x)?.abs()?.matmul(&f(&w)?.abs()?.t()?)?;
                    let size = size.max_all()?.to_scalar::<f32>()? as f64;
                    let scale = want.abs()?.max_all()?.to_scalar::<f32>()?.max(1.0) as f64;
                    tol += 2f64.powi(-16) * size / scale;
                }
                compared += 1;
                for call in ["first", "second"] {
                    let got = p.forward(&x)?;
                    assert_eq!(got.dtype(), DType::F32);
                    let err = rel_err(&got, &want)?;
                    assert!(
                        err < tol,
                        "rows {rows} in {inp} out {out} weight {wdt:?} input {xdt:?} ({call} call): err {err}"
                    );
                }
            }
        }
    }
    Ok(compared)
}
