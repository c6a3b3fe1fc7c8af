//! `y = x · Wᵀ + b` in f32 on a register-tiled product: AVX-512 14-row × 32-output tiles
//! ([`avx512::gemm`]) or AVX2+FMA 6-row × 16-output tiles ([`avx2::gemm`]), whose rows of
//! `x` are broadcast from their row-major place (no copy of `x`), against `W` packed once
//! per call into 16-output panels (`[out / 16][in][16]`; by 16×16 transposes on AVX-512;
//! f16/bf16 weights are converted there, so no f32 copy of `W` is made). Row blocks of
//! about [`ROWS`] rows run in parallel; each writes its own contiguous output rows, so the
//! weight streams through the cache once per row block. The bias is the accumulators'
//! starting value.

use super::aligned::AVec;
use super::amx_linear::{self, Xs};
use super::isa::Isa;
use super::pack::pack_k;
use super::par;
use super::tiles::{MR, NR};
use super::view::{Data, View};
use super::{avx2, avx512};
use candle::{CpuStorage, DType, Result, Storage, Tensor};
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Rows per parallel work item (about; whole register tiles).
const ROWS: usize = 144;
/// Contraction chunk. A panel pair of 768 steps (96 KiB) streams from L2 as fast as a
/// 256-step one from L1, and whole contractions up to 768 never reload the output tiles:
/// a 1024×768×2304 product ran 5% faster than with 256 (medians of 6, alternating),
/// 1024×768×768 the same. With AVX2 (6×16 tiles, a 48 KiB panel of 768 steps, on the
/// Zen 3 VM): 1024×768×2304 at 144 GFLOP/s against 132 with 256 or 384 (one timing each).
const KC: usize = 768;
/// Largest pack buffer (floats) a thread keeps between calls (16 MiB).
const KEEP_FLOATS: usize = 4 << 20;

/// Whether [`linear`] takes a `(rows, in) · (out, in)ᵀ` product: f32 on the CPU, the
/// AVX-512 or AVX2 kernel selected, and at least a register tile of rows (see
/// [`applies_packed`] for fewer).
pub(crate) fn applies(x: &Tensor, w: &Tensor) -> bool {
    x.rank() == 2 && applies_rows(x, w)
}

/// [`applies`] to `x (…, in)` viewed as `(rows, in)`.
pub(crate) fn applies_rows(x: &Tensor, w: &Tensor) -> bool {
    takes(x, w).is_some_and(|(rows, tile)| rows >= tile)
}

/// Whether [`linear_packed`] takes `x (rows, in)` against a packed `w`, for any number
/// of rows from 1 on. Below one register tile of rows (a decode step) the product is
/// worth running only against a weight packed once: packing it for every call would
/// read the weight twice.
pub(crate) fn applies_packed(x: &Tensor, w: &Tensor) -> bool {
    x.rank() == 2 && takes(x, w).is_some_and(|(rows, _)| rows >= 1)
}

/// Whether [`linear_in_place`] takes `x (rows, in)` against `w`: what
/// [`applies_packed`] takes, with fewer rows than a register tile, and contraction
/// lengths the dot-product kernels read (AVX-512: any for f32 weights, multiples of 16
/// for f16/bf16; AVX2: multiples of 8).
pub(crate) fn applies_in_place(x: &Tensor, w: &Tensor) -> bool {
    let Some((rows, tile)) = takes(x, w).filter(|_| x.rank() == 2) else {
        return false;
    };
    let inp = w.dims2().map_or(0, |d| d.1);
    (1..tile).contains(&rows) && reads_in_place(Isa::selected(), w.dtype(), inp)
}

/// Whether `isa` has the dot-product kernels of [`linear_in_place`] and they read rows
/// of `inp` elements of `dtype`.
fn reads_in_place(isa: Isa, dtype: DType, inp: usize) -> bool {
    match isa {
        Isa::Avx512 => dtype == DType::F32 || inp.is_multiple_of(16),
        Isa::Avx2Fma => inp.is_multiple_of(8),
        _ => false,
    }
}

/// Outputs per call of the dot-product kernel in [`linear_in_place`]: their weight rows
/// (16 KiB each at 4096 f32 inputs) stay in L2 while every strip of x rows reads them.
const IN_PLACE_OUTPUTS: usize = 16;

/// `x · Wᵀ (+ b)` for a few rows of `x` (fewer than a register tile, as in a decode
/// step), reading `W (out, in)` in place, f16/bf16 widened in registers: each output is
/// a dot product of an x row with a W row, on the decode kernels' dot products
/// (`qk_dot`). The threads split the outputs. No pack is made, so a weight that the
/// pack cache has no room for still streams once per call, in its own dtype. Callers
/// check [`applies_in_place`] first; shapes are validated again here.
pub(crate) fn linear_in_place(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    linear_in_place_on(Isa::selected(), x, w, b)
}

/// [`linear_in_place`] on `selected`'s kernels if they read the weight's rows, else on
/// the first of the machine's that do. `applies_in_place` saw a selected instruction set
/// that reads them, but another thread may have changed `CANDLE_ATTENTION_ISA` since.
fn linear_in_place_on(selected: Isa, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let (out, inp) = w.dims2()?;
    let isa = [selected, Isa::Avx512, Isa::Avx2Fma]
        .into_iter()
        .find(|&isa| isa.is_supported() && reads_in_place(isa, w.dtype(), inp))
        .expect("`applies_in_place` found an instruction set that reads these rows");
    let wc = w.contiguous()?;
    let (wg, wl) = wc.storage_and_layout();
    let wd = weight_data(&wg, wl, w)?;
    new_output(x, out, |dst| {
        let n = dst.len();
        with_f32_operands(x, (out, inp), w, b, (dst, n), false, |rows, xv, bv, dst| {
            // The kernels take whole strips of `MR` rows; padding rows are not computed.
            let padded = rows.div_ceil(MR) * MR;
            let mut q = vec![0f32; padded * inp];
            q[..rows * inp].copy_from_slice(xv);
            if isa == Isa::Avx512 && matches!(wd, Data::BF16(_)) {
                q.chunks_exact_mut(inp).for_each(avx512::split_pairs);
            }
            let nt = par::threads();
            let per = out.div_ceil(nt).div_ceil(IN_PLACE_OUTPUTS).max(1) * IN_PLACE_OUTPUTS;
            let mut parts: Vec<(usize, usize, Vec<f32>)> = (0..out)
                .step_by(per)
                .map(|o0| (o0, per.min(out - o0), vec![0f32; padded * per.min(out - o0)]))
                .collect();
            // The weight is one stream of rows: ask for its lines some way ahead, on
            // the CPUs where that pays (`prefetch::avx512_linear_ahead`).
            let ahead = match super::prefetch::avx512_linear_ahead() {
                0 => avx512::Ahead::Off,
                n => avx512::Ahead::Bytes(n),
            };
            par::vec_for_each(parts.iter_mut().collect(), |(o0, n, s)| {
                let (o0, n) = (*o0, *n);
                let mut j = 0;
                while j < n {
                    let nk = IN_PLACE_OUTPUTS.min(n - j);
                    let k = slice_rows(wd, (o0 + j) * inp, (o0 + j + nk) * inp);
                    let sj = &mut s[j..];
                    // SAFETY: `isa` is supported by this machine and reads rows of
                    // `inp` elements (`reads_in_place`); the kernels assert the slice
                    // bounds.
                    unsafe {
                        match isa {
                            Isa::Avx512 => {
                                avx512::qk_dot_raw(&q, padded, rows, inp, k, (inp, nk, ahead), sj, n, None);
                            }
                            // `reads_in_place` admits only these two.
                            _ => {
                                avx2::qk_dot(&q, padded, rows, inp, k, inp, nk, sj, n, None);
                            }
                        }
                    }
                    j += nk;
                }
            });
            write_parts(&parts, rows, out, dst, bv);
        })
    })
}

/// Elements `a..b` of `d`.
fn slice_rows(d: Data<'_>, a: usize, b: usize) -> Data<'_> {
    match d {
        Data::F32(v) => Data::F32(&v[a..b]),
        Data::BF16(v) => Data::BF16(&v[a..b]),
        Data::F16(v) => Data::F16(&v[a..b]),
    }
}

/// `(rows, register tile rows)` when the product takes `x (…, in)` and `w` but for the
/// number of rows: f32 `x` (or bf16 `x` against a bf16 weight, where the pairs products
/// run them: [`on_tiles`]) on the CPU, a non-empty f32/f16/bf16 weight, the AVX-512 or
/// AVX2 kernel selected, and no gradients. Small products are taken too: they run on the
/// calling thread ([`par::sized`]), and a 1×32 → 32 product took 0.7 µs there against
/// 1.0 µs on candle's `matmul` with `RAYON_NUM_THREADS` set and 39 µs without (Zen 3 VM,
/// 2026-12-05), where weights under 4096 elements went to candle's `matmul` before.
fn takes(x: &Tensor, w: &Tensor) -> Option<(usize, usize)> {
    let (Some(&inp), Ok((out, win))) = (x.dims().last(), w.dims2()) else {
        return None;
    };
    let rows = x.elem_count() / inp.max(1);
    // bf16 rows go to the pairs products as they are (`amx_linear::Xs`), where those
    // run them.
    let x_ok = match x.dtype() {
        DType::F32 => true,
        DType::BF16 => w.dtype() == DType::BF16 && on_tiles(DType::BF16, rows, true),
        _ => false,
    };
    // Tensors that record gradients take candle's ops: this product has no backward.
    let ok = !x.track_op()
        && !w.track_op()
        && x.device().is_cpu()
        && w.device().is_cpu()
        && x_ok
        && matches!(w.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && inp == win
        && inp > 0
        && out > 0
        && cfg!(target_arch = "x86_64");
    ok.then(|| tile_rows(Isa::selected()).map(|t| (rows, t)))
        .flatten()
}

/// Rows of the register tile of `isa`'s product, for the instruction sets that have one.
fn tile_rows(isa: Isa) -> Option<usize> {
    match isa {
        Isa::Avx512 => Some(avx512::GEMM_ROWS),
        Isa::Avx2Fma => Some(avx2::GEMM_ROWS),
        _ => None,
    }
}

/// `x · Wᵀ (+ b)`: x `(rows, in)` and b `(out)` f32, w `(out, in)` f32, bf16 or f16, all
/// on the CPU; returns `(rows, out)` in f32. `W` is packed for this call only, into a
/// buffer the calling thread keeps. Callers check [`applies`] first; shapes are
/// validated again here.
///
/// `half_x` says that x holds f16/bf16 values whose results the caller rounds to a half
/// dtype: an f16 weight then runs on the AMX tile unit, where it is enabled, for 16 rows
/// or more, without its `lo · lo` products (`amx_linear::product`, within
/// `2⁻¹⁶·Σ|x·w|`).
///
/// The result is returned in `dtype` (f32, or bf16/f16 rounded as `cast::to_dtype`
/// rounds f32): products on the tile unit write bf16 rows themselves
/// ([`rounds_on_tiles`]).
pub(crate) fn linear(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    half_x: bool,
    dtype: DType,
) -> Result<Tensor> {
    let out = w.dims2()?.0;
    if rounds_on_tiles(dtype) && on_tiles(w.dtype(), x.dim(0)?, half_x) {
        let direct = new_half_output(x, out, dtype, |dst| tiles_into(x, w, b, half_x, dst))?;
        if let Some(y) = direct {
            return Ok(y);
        }
    }
    let y = new_output(x, out, |dst| linear_into(x, w, b, half_x, dst))?;
    crate::cast::to_dtype(&y, dtype)
}

/// Whether products on the tile unit round their rows to `dtype` themselves (bf16),
/// rather than write f32 rows that are then cast. On the Intel VM (2026-12-06, whole
/// layers in one process, alternating, outputs bit-identical), bf16 layers took 2–25%
/// less time that way in all twelve readings; f16 layers took −9% to +23%, and f16
/// `mha_layer` more in three of four (kernel notes), so f16 rows are cast afterwards.
fn rounds_on_tiles(dtype: DType) -> bool {
    dtype == DType::BF16
}

/// A new `(rows, out)` tensor of `dtype` (bf16 or f16) for `x (rows, in)`, written whole
/// by `write` when it returns true; `None` when it returns false.
fn new_half_output(
    x: &Tensor,
    out: usize,
    dtype: DType,
    write: impl FnOnce(amx_linear::Rows) -> Result<bool>,
) -> Result<Option<Tensor>> {
    fn fill<T: candle::WithDType>(
        n: usize,
        dtype: DType,
        write: impl FnOnce(amx_linear::Rows) -> Result<bool>,
    ) -> Result<Option<Vec<T>>> {
        assert_eq!(std::mem::size_of::<T>(), 2, "a half-precision element");
        let mut y: Vec<T> = Vec::with_capacity(n);
        let spare = &mut y.spare_capacity_mut()[..n];
        super::pages::advise_fresh_output(spare);
        // SAFETY: `T` is bf16 or f16, a `u16` in memory (`#[repr(transparent)]`;
        // size asserted).
        let dst = unsafe { &mut *(spare as *mut [MaybeUninit<T>] as *mut [MaybeUninit<u16>]) };
        if !write(amx_linear::Rows::Half(dst, dtype))? {
            return Ok(None);
        }
        // SAFETY: `write` returned true, so it wrote all `n` elements.
        unsafe { y.set_len(n) };
        Ok(Some(y))
    }
    let (rows, _) = x.dims2()?;
    let (n, dev) = (rows * out, x.device());
    match dtype {
        DType::BF16 => fill::<half::bf16>(n, dtype, write)?.map(|y| Tensor::from_vec(y, (rows, out), dev)),
        DType::F16 => fill::<half::f16>(n, dtype, write)?.map(|y| Tensor::from_vec(y, (rows, out), dev)),
        _ => candle::bail!("linear: rows rounded to {dtype:?}, which is not bf16 or f16"),
    }
    .transpose()
}

/// A new `(rows, out)` f32 tensor for `x (rows, in)`, written whole by `write`.
fn new_output(
    x: &Tensor,
    out: usize,
    write: impl FnOnce(&mut [MaybeUninit<f32>]) -> Result<()>,
) -> Result<Tensor> {
    let (rows, _) = x.dims2()?;
    let mut y: Vec<f32> = Vec::with_capacity(rows * out);
    let spare = &mut y.spare_capacity_mut()[..rows * out];
    super::pages::advise_fresh_output(spare);
    write(spare)?;
    // SAFETY: `write` returned Ok, so it wrote all `rows · out` elements.
    unsafe { y.set_len(rows * out) };
    Tensor::from_vec(y, (rows, out), x.device())
}

/// [`linear`] into `dst` (`rows · out` elements, row-major), which it writes whole when
/// it returns Ok.
pub(crate) fn linear_into(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    half_x: bool,
    dst: &mut [MaybeUninit<f32>],
) -> Result<()> {
    if on_tiles(w.dtype(), x.dim(0)?, half_x) && tiles_into(x, w, b, half_x, amx_linear::Rows::F32(dst))? {
        return Ok(());
    }
    let (out, inp) = w.dims2()?;
    let wc = w.contiguous()?;
    let (wg, wl) = wc.storage_and_layout();
    let wd = weight_data(&wg, wl, w)?;
    let np = out.div_ceil(NR);
    let n = dst.len();
    // bf16 rows that the pairs products did not take (a weight with ±inf or NaN) are
    // multiplied as f32.
    let xf = crate::cast::to_dtype(x, DType::F32)?;
    with_f32_operands(&xf, (out, inp), w, b, (dst, n), true, |rows, xv, bv, dst| {
        with_kept(&PACK, KEEP_FLOATS, |wp| {
            wp.grow(np * inp * NR);
            pack_into(wd, (out, inp), &mut wp[..np * inp * NR]);
            product(xv, &wp[..np * inp * NR], bv, (rows, inp, out), dst);
        })
    })
}

/// [`linear_into`] on the AMX tile unit, into `dst` (f32 or rounded): for a weight and
/// rows that [`on_tiles`] sends there. Returns false, with `dst` not written, for a
/// weight with ±inf or NaN, which the tile pack does not take.
fn tiles_into(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    half_x: bool,
    dst: amx_linear::Rows,
) -> Result<bool> {
    let (out, inp) = w.dims2()?;
    let Some(cw) = tiles_comps(w.dtype(), x.dim(0)?, half_x) else {
        candle::bail!(
            "linear: the tile unit does not take this product of weight {:?}",
            w.dims()
        )
    };
    let wc = w.contiguous()?;
    let (wg, wl) = wc.storage_and_layout();
    let wd = weight_data(&wg, wl, w)?;
    let n = dst.len();
    with_operands(x, (out, inp), w, b, (dst, n), true, |rows, xv, bv, dst| {
        // 16 MiB of bf16 kept, as for the f32 pack of `linear_into`.
        with_kept(&PACK_TILES, 2 * KEEP_FLOATS, |wp| {
            let len = amx_linear::pack_len((out, inp), cw);
            wp.grow(len);
            // SAFETY: `tiles_comps` saw the tile unit enabled.
            let finite = unsafe { amx_linear::pack(wd, (out, inp), cw, &mut wp[..len]) };
            if finite {
                // SAFETY: the same, and the pack holds finite weights.
                unsafe { amx_linear::product(xv, (&wp[..len], cw), bv, (rows, inp, out), half_x, dst) };
            }
            finite
        })
    })
}

/// `f(buf)` on this thread's buffer `key`, kept between calls: a fresh multi-MB
/// allocation would page-fault on every call. A buffer of more than `keep` elements is
/// dropped afterwards, so a large layer's pack is not held; a call nested inside `f`
/// (which the products do not make) gets a fresh buffer.
fn with_kept<T: Copy + Default, R>(
    key: &'static std::thread::LocalKey<std::cell::RefCell<AVec<T>>>,
    keep: usize,
    f: impl FnOnce(&mut AVec<T>) -> R,
) -> R {
    key.with(|cell| {
        let mut guard = cell.try_borrow_mut();
        let mut fresh = AVec::default();
        let buf = match guard.as_deref_mut() {
            Ok(buf) => buf,
            Err(_) => &mut fresh,
        };
        let r = f(buf);
        if buf.len() > keep {
            *buf = AVec::default();
        }
        r
    })
}

/// [`linear`] against a weight packed once by [`PackedWeight::cached`], with `half_x` as
/// there.
pub(crate) fn linear_packed(
    x: &Tensor,
    w: &PackedWeight,
    b: Option<&Tensor>,
    half_x: bool,
    dtype: DType,
) -> Result<Tensor> {
    if let (true, Panels::Tiles(..)) = (rounds_on_tiles(dtype), &w.panels) {
        let direct = new_half_output(x, w.out, dtype, |dst| {
            packed_product(x, w, b, half_x, dst)?;
            Ok(true)
        })?;
        if let Some(y) = direct {
            return Ok(y);
        }
    }
    let y = new_output(x, w.out, |dst| linear_packed_into(x, w, b, half_x, dst))?;
    crate::cast::to_dtype(&y, dtype)
}

/// [`linear_packed`] into `dst`, as [`linear_into`].
pub(crate) fn linear_packed_into(
    x: &Tensor,
    w: &PackedWeight,
    b: Option<&Tensor>,
    half_x: bool,
    dst: &mut [MaybeUninit<f32>],
) -> Result<()> {
    packed_product(x, w, b, half_x, amx_linear::Rows::F32(dst))
}

/// [`linear_packed_into`] into `dst`, f32 or rounded; rounded rows only from a tile pack
/// (an error otherwise).
fn packed_product(
    x: &Tensor,
    w: &PackedWeight,
    b: Option<&Tensor>,
    half_x: bool,
    dst: amx_linear::Rows,
) -> Result<()> {
    let n = dst.len();
    with_operands(
        x,
        (w.out, w.inp),
        &w.source,
        b,
        (dst, n),
        false,
        |rows, xv, bv, dst| {
            match (&w.panels, dst) {
                (Panels::F32(wp), amx_linear::Rows::F32(dst)) => {
                    // bf16 rows against f32 panels (a weight with ±inf or NaN, which
                    // the pairs products do not take) are multiplied as f32.
                    product(&xv.to_f32(), wp, bv, (rows, w.inp, w.out), dst);
                    Ok(())
                }
                // SAFETY: a tile pack is made only where the tile unit is enabled, and only
                // of finite weights (`PackedWeight::cached`).
                (Panels::Tiles(wp, cw), dst) => {
                    unsafe { amx_linear::product(xv, (wp, *cw), bv, (rows, w.inp, w.out), half_x, dst) };
                    Ok(())
                }
                (Panels::F32(_), _) => {
                    candle::bail!(
                        "linear: rounded rows from f32 panels of weight {:?}",
                        w.source.dims()
                    )
                }
            }
        },
    )?
}

/// Estimated time in ns of a `(rows, in) · (in, out)` product on one thread, for
/// [`par::sized`]: its multiply-adds, and every element of x, the weight (twice where it
/// is packed first) and the output ([`par::work_ns`]).
fn product_ns(rows: usize, inp: usize, out: usize, packs: bool) -> f64 {
    let (r, i, o) = (rows as f64, inp as f64, out as f64);
    let weight = if packs { 2.0 } else { 1.0 } * i * o;
    par::work_ns(2.0 * r * i * o, weight + r * (i + o))
}

/// [`with_operands`] for products that take f32 rows of x only (an error for others).
fn with_f32_operands<D, R>(
    x: &Tensor,
    (out, inp): (usize, usize),
    w: &Tensor,
    b: Option<&Tensor>,
    dst: (D, usize),
    packs: bool,
    f: impl FnOnce(usize, &[f32], Option<&[f32]>, D) -> R,
) -> Result<R> {
    with_operands(x, (out, inp), w, b, dst, packs, |rows, xv, bv, dst| match xv {
        Xs::F32(xv) => Ok(f(rows, xv, bv, dst)),
        Xs::Bf16(_) => candle::bail!(
            "linear: this product takes f32 rows, not x {:?} {:?} (weight {:?})",
            x.dims(),
            x.dtype(),
            w.dims()
        ),
    })?
}

/// Checks `x (rows, in)`, `b (out)` and `dst` (`rows · out`) against a weight
/// `(out, in)` (named `w` in errors), then runs `f(rows, x, b, dst)` on their contiguous
/// data (x f32 or bf16, b f32): on this thread alone when the product (with a pack of
/// the weight where `packs`) is too small to share among the threads ([`par::sized`]).
fn with_operands<D, R>(
    x: &Tensor,
    (out, inp): (usize, usize),
    w: &Tensor,
    b: Option<&Tensor>,
    (dst, dst_len): (D, usize),
    packs: bool,
    f: impl FnOnce(usize, Xs, Option<&[f32]>, D) -> R,
) -> Result<R> {
    let (rows, xin) = x.dims2()?;
    if dst_len != rows * out {
        candle::bail!(
            "linear: output of {} elements for x {:?} and weight {:?} (expected {})",
            dst_len,
            x.dims(),
            w.dims(),
            rows * out
        );
    }
    if xin != inp {
        candle::bail!(
            "linear: x {:?} and weight {:?} disagree on in-features",
            x.dims(),
            w.dims()
        );
    }
    if let Some(b) = b {
        if b.dims() != [out] {
            candle::bail!("linear: bias {:?} does not match weight {:?}", b.dims(), w.dims());
        }
    }
    let (xc, bc) = (x.contiguous()?, b.map(|b| b.contiguous()).transpose()?);
    let (xg, xl) = xc.storage_and_layout();
    let xv = match (&*xg, xl.contiguous_offsets()) {
        (Storage::Cpu(CpuStorage::BF16(v)), Some((a, z))) => {
            // SAFETY: bf16 is a 16-bit plain-old-data type (`#[repr(transparent)]` u16);
            // the slice is reinterpreted in place.
            Xs::Bf16(unsafe { std::slice::from_raw_parts(v[a..z].as_ptr() as *const u16, z - a) })
        }
        _ => Xs::F32(f32_slice(&xg, xl, x)?),
    };
    let bg = bc.as_ref().map(|b| b.storage_and_layout());
    let bv = match (&bg, &bc) {
        (Some((g, l)), Some(b)) => Some(f32_slice(g, l, b)?),
        _ => None,
    };
    Ok(par::sized(product_ns(rows, inp, out, packs), || {
        f(rows, xv, bv, dst)
    }))
}

/// Bytes of packed weights that [`PackedWeight::cached`] may keep alive at once, all
/// layers together: `CANDLE_ATTENTION_PACK_CACHE_MB` (MiB; 0 turns caching off), 256 MiB
/// when unset or not a number.
fn cache_budget() -> usize {
    static BUDGET: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BUDGET.get_or_init(|| {
        let mb = std::env::var("CANDLE_ATTENTION_PACK_CACHE_MB")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(256);
        mb.saturating_mul(1 << 20)
    })
}

/// Bytes held by live [`PackedWeight`]s made by [`PackedWeight::cached`].
static CACHED_BYTES: AtomicUsize = AtomicUsize::new(0);

/// A weight `(out, in)` packed once, for layers that apply the same weight many times
/// ([`crate::Proj`]): into f32 16-output panels `[out / 16][in][16]`, or, where the
/// AMX tile unit runs the products it is packed for ([`tiles_comps`]), into the tile
/// unit's VNNI blocks (`amx_linear::pack`). It counts against a process-wide budget
/// ([`cache_budget`]) until dropped.
pub(crate) struct PackedWeight {
    panels: Panels,
    out: usize,
    inp: usize,
    /// The weight it was packed from (a cheap handle), for error messages.
    source: Tensor,
}

impl PackedWeight {
    /// Packs `w` for products of `rows` rows of an x of half-precision values (`half_x`)
    /// or not (for f16 weights the kind of pack depends on them: [`packs_by_call`]), if
    /// the budget has room for it; `None` otherwise.
    pub(crate) fn cached(w: &Tensor, rows: usize, half_x: bool) -> Result<Option<Self>> {
        let (out, inp) = w.dims2()?;
        let wc = w.contiguous()?;
        let (wg, wl) = wc.storage_and_layout();
        let wd = weight_data(&wg, wl, w)?;
        if let Some(cw) = tiles_comps(w.dtype(), rows, half_x) {
            let len = amx_linear::pack_len((out, inp), cw);
            let Some(mut packed) = Self::reserved(Panels::Tiles(AVec::new(len), cw), w)? else {
                return Ok(None);
            };
            if let Panels::Tiles(wp, _) = &mut packed.panels {
                // SAFETY: `tiles_comps` saw the tile unit enabled.
                if unsafe { amx_linear::pack(wd, (out, inp), cw, wp) } {
                    return Ok(Some(packed));
                }
            }
            // A weight with ±inf or NaN: the f32 panels below (after `packed` gave its
            // reservation back).
        }
        let Some(mut packed) = Self::reserved(Panels::F32(AVec::new(out.div_ceil(NR) * NR * inp)), w)? else {
            return Ok(None);
        };
        if let Panels::F32(wp) = &mut packed.panels {
            pack_into(wd, (out, inp), wp);
        }
        Ok(Some(packed))
    }

    /// A pack of `w` into `panels` (not yet written), if the budget has room for it.
    fn reserved(panels: Panels, w: &Tensor) -> Result<Option<Self>> {
        let (out, inp) = w.dims2()?;
        if !reserve(&CACHED_BYTES, panels.bytes(), cache_budget()) {
            return Ok(None);
        }
        // From here the drop gives the reservation back.
        Ok(Some(Self {
            panels,
            out,
            inp,
            source: w.clone(),
        }))
    }
}

/// The packed weight of a [`PackedWeight`].
enum Panels {
    /// f32 16-output panels `[out / 16][in][16]`.
    F32(AVec<f32>),
    /// The tile unit's VNNI blocks, and the weight's bf16 components (`amx_linear`).
    Tiles(AVec<u16>, usize),
}

impl Panels {
    fn bytes(&self) -> usize {
        match self {
            Panels::F32(v) => std::mem::size_of_val(&v[..]),
            Panels::Tiles(v, _) => std::mem::size_of_val(&v[..]),
        }
    }
}

/// The bf16 components of a weight of `dtype` when its products of `rows` rows of x
/// (half-precision values or not: `half_x`) run on the AMX tile unit
/// (`amx_linear::runs`: bf16 weights, and f16 weights against half-precision x of 16
/// rows or more, where the tile unit is enabled; read per call); `None` otherwise.
fn tiles_comps(dtype: DType, rows: usize, half_x: bool) -> Option<usize> {
    amx_linear::weight_comps(dtype).filter(|_| amx_linear::runs(dtype, rows, half_x))
}

/// Whether products against a weight of `dtype` take the tile unit's pack for some
/// calls and f32 panels for others ([`on_tiles`]; f16 weights where the tile unit is
/// enabled): a layer that runs both keeps both ([`crate::Proj`]).
pub(crate) fn packs_by_call(dtype: DType) -> bool {
    on_tiles(dtype, TILE_CALL.0, TILE_CALL.1) && !on_tiles(dtype, 1, false)
}

/// Whether products of `rows` rows (of half-precision values or not: `half_x`) against
/// a weight of `dtype` run on the tile unit's pack.
pub(crate) fn on_tiles(dtype: DType, rows: usize, half_x: bool) -> bool {
    tiles_comps(dtype, rows, half_x).is_some()
}

/// Whether one row of x (of half-precision values or not: `half_x`) against a weight of
/// `dtype` runs on a kept pack rather than reading the weight in place
/// ([`linear_in_place`]): where AVX512-BF16 register tiles run it ([`on_tiles`]). Their
/// pack is bf16, as many bytes as the weight, and on the Zen 4 VM (2026-12-06, one bf16
/// row, kept pack against in place, ms) it took 0.89–0.93 against 1.95 at 4096×4096,
/// 3.5 against 4.8 at 14336 outputs and 3.4 against 5.7 at 14336 inputs.
pub(crate) fn one_row_on_pack(dtype: DType, half_x: bool) -> bool {
    amx_linear::unit() == Some(super::amx::Unit::Avx512Bf16) && on_tiles(dtype, 1, half_x)
}

/// A call that every weight the tile unit takes runs there with: a half-precision x of
/// `amx_linear::F16_ROWS` rows.
const TILE_CALL: (usize, bool) = (amx_linear::F16_ROWS, true);

/// Adds `bytes` to `held` if the sum stays within `budget`; whether it did.
fn reserve(held: &AtomicUsize, bytes: usize, budget: usize) -> bool {
    // A compare-exchange loop, as `fetch_update` (deprecated on nightly for `try_update`,
    // which stable 1.95 lacks) would run it.
    let mut h = held.load(Ordering::Relaxed);
    loop {
        let Some(t) = h.checked_add(bytes).filter(|&t| t <= budget) else {
            return false;
        };
        match held.compare_exchange_weak(h, t, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return true,
            Err(now) => h = now,
        }
    }
}

impl Drop for PackedWeight {
    fn drop(&mut self) {
        CACHED_BYTES.fetch_sub(self.panels.bytes(), Ordering::Relaxed);
    }
}

impl std::fmt::Debug for PackedWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PackedWeight({}, {})", self.out, self.inp)
    }
}

thread_local! {
    /// This thread's W pack, reused across calls.
    static PACK: std::cell::RefCell<AVec<f32>> = std::cell::RefCell::new(AVec::default());
    /// This thread's VNNI pack for the tile unit, reused across calls.
    static PACK_TILES: std::cell::RefCell<AVec<u16>> = std::cell::RefCell::new(AVec::default());
    /// This thread's copy of the x rows of a block, for [`with_x_rows`].
    static X_ROWS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `f(x, ldx)` on the `n` rows of `xs` (row stride `inp`), or on a copy of them with a
/// row stride one cache line longer when `inp` floats are a multiple of 4 KiB.
///
/// The products broadcast x from up to 14 rows at once, `ldx` apart. At a multiple of
/// 4 KiB (every hidden size that is a multiple of 1024) those rows fall in the same
/// L1 set, more than its 8 ways hold, and the products lose a fifth of their speed: on
/// the Zen 4 VM (2026-12-04, medians of seven 0.5 s timings) 1024×2048×2048 ran at 164
/// GFLOP/s and 1024×2000×2048 at 213. Copying the block's rows costs one pass over them.
fn with_x_rows<R>(xs: &[f32], n: usize, inp: usize, f: impl FnOnce(&[f32], usize) -> R) -> R {
    if n < 2 || !inp.is_multiple_of(1024) {
        return f(xs, inp);
    }
    let ld = inp + 16;
    // Only the first `inp` elements of each row are written (and read by the products);
    // the buffer is zeroed only where it grows, not on every call.
    let fill = |buf: &mut Vec<f32>| {
        if buf.len() < n * ld {
            buf.resize(n * ld, 0.0);
        }
        for (dst, src) in buf.chunks_exact_mut(ld).zip(xs.chunks_exact(inp)) {
            dst[..inp].copy_from_slice(src);
        }
    };
    X_ROWS.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => {
            fill(&mut buf);
            f(&buf[..n * ld], ld)
        }
        Err(_) => {
            let mut buf = Vec::new();
            fill(&mut buf);
            f(&buf[..n * ld], ld)
        }
    })
}

/// Packs `W (out, in)` into 16-output panels `[out / 16][in][16]` in `wp`, in parallel.
fn pack_into(wd: Data, (out, inp): (usize, usize), wp: &mut [f32]) {
    // W panels: [panel][k][NR], zero outputs past `out` (every element is written: the
    // buffer may hold stale values from earlier calls). This is the K-panel layout of the
    // attention kernel, with outputs as keys, so its packer serves; f16/bf16 weights are
    // converted there, so no f32 copy of W is made.
    let wview = View {
        data: wd,
        start: 0,
        strides: [0, 0, inp, 1],
    };
    // Conversion scratch, needed only for f16/bf16 weights.
    let tmp_len = if matches!(wd, Data::F32(_)) { 0 } else { NR * inp };
    par::chunks_for_each(
        wp,
        inp * NR,
        || vec![0f32; tmp_len],
        |tmp, (p, panel)| {
            let o0 = p * NR;
            pack_k(
                Isa::selected(),
                &wview,
                0,
                0,
                o0,
                NR.min(out - o0),
                inp,
                panel,
                tmp,
            );
        },
    );
}

/// The `(rows, out)` product of `x` (read in place) and the packed `wp`, plus `b`, into
/// `y` (`rows · out` elements, all written).
fn product(
    xv: &[f32],
    wp: &[f32],
    bv: Option<&[f32]>,
    dims: (usize, usize, usize),
    y: &mut [MaybeUninit<f32>],
) {
    product_on(Isa::selected(), xv, wp, bv, dims, y)
}

/// [`product`] on `selected`'s kernel, or on the machine's best when `selected` has no
/// product. `applies` saw a selected instruction set with a product, but another thread
/// may have changed `CANDLE_ATTENTION_ISA` since (to `portable`, say); the machine's best
/// then has a product too.
fn product_on(
    selected: Isa,
    xv: &[f32],
    wp: &[f32],
    bv: Option<&[f32]>,
    (rows, inp, out): (usize, usize, usize),
    y: &mut [MaybeUninit<f32>],
) {
    assert_eq!(y.len(), rows * out);
    let (isa, tile) = [selected, Isa::detect()]
        .into_iter()
        .find_map(|isa| tile_rows(isa).map(|tile| (isa, tile)))
        .expect("`applies` found an instruction set with a product on this machine");
    if rows.div_ceil(tile) < par::threads() {
        return product_by_columns(xv, wp, bv, (rows, inp, out), y, isa);
    }
    par::vec_for_each(par::row_blocks(y, (rows, out), tile, ROWS), |(r0, ys)| {
        let n = ys.len() / out;
        let yp = ys.as_mut_ptr() as *mut f32;
        with_x_rows(&xv[r0 * inp..(r0 + n) * inp], n, inp, |xs, ldx| {
            // SAFETY: `applies` selected this instruction set, so the machine has it;
            // rows `0..n` of this block are inside `ys`.
            unsafe { gemm_chunks(isa, (xs, ldx, n, inp), (wp, out), (yp, out), bv) }
        })
    });
}

/// `y = x · Wᵀ (+ b)` for `rows` rows of `x` (row stride `ldx`, `inp` long) against the
/// panels `wp` of `out` outputs, into `y` (row stride `ldy`), in contraction chunks of
/// [`KC`]: the first chunk writes every element (with the bias), later ones add to it.
///
/// # Safety
/// `isa` has a product ([`tile_rows`]) and the machine has it; `y` holds `rows` rows of
/// stride `ldy`.
unsafe fn gemm_chunks(
    isa: Isa,
    (xs, ldx, rows, inp): (&[f32], usize, usize, usize),
    (wp, out): (&[f32], usize),
    (y, ldy): (*mut f32, usize),
    bv: Option<&[f32]>,
) {
    let mut k0 = 0;
    while k0 < inp {
        let k1 = (k0 + KC).min(inp);
        let bias = if k0 == 0 { bv } else { None };
        let chunk = (k0, k1, inp);
        // SAFETY: the caller's guarantees; the products assert the slice bounds.
        unsafe {
            match isa {
                Isa::Avx512 => avx512::gemm(xs, ldx, rows, chunk, wp, out, y, ldy, bias, k0 > 0),
                // `tile_rows` admits only these two.
                _ => avx2::gemm(xs, ldx, rows, chunk, wp, out, y, ldy, bias, k0 > 0),
            }
        }
        k0 = k1;
    }
}

/// [`product`] for fewer register tiles of rows than threads (a decode step): the
/// threads split the output columns (whole pairs of 16-output panels) instead of the
/// rows, so that all of them stream the weight. Each writes its columns into a buffer
/// of its own, copied into `y` at the end (`rows · out` floats, a few KiB for a decode
/// step).
fn product_by_columns(
    xv: &[f32],
    wp: &[f32],
    bv: Option<&[f32]>,
    (rows, inp, out): (usize, usize, usize),
    y: &mut [MaybeUninit<f32>],
    isa: Isa,
) {
    let np = out.div_ceil(NR);
    let pairs = np.div_ceil(2);
    let nb = par::threads().min(pairs).max(1);
    let mut parts: Vec<(usize, usize, Vec<f32>)> = (0..nb)
        .map(|i| {
            let p0 = (2 * (i * pairs / nb)).min(np);
            let p1 = (2 * ((i + 1) * pairs / nb)).min(np);
            let cols = (p1 * NR).min(out) - p0 * NR;
            (p0, cols, vec![0f32; rows * cols])
        })
        .filter(|(_, cols, _)| *cols > 0)
        .collect();
    with_x_rows(xv, rows, inp, |xs, ldx| {
        par::vec_for_each(parts.iter_mut().collect(), |(p0, cols, buf)| {
            let (p0, cols) = (*p0, *cols);
            let panels = &wp[p0 * inp * NR..(p0 + cols.div_ceil(NR)) * inp * NR];
            let bias = bv.map(|b| &b[p0 * NR..]);
            // SAFETY: `applies_packed` selected this instruction set, so the machine has
            // it; `buf` holds `rows` rows of `cols` floats.
            unsafe {
                gemm_chunks(
                    isa,
                    (xs, ldx, rows, inp),
                    (panels, cols),
                    (buf.as_mut_ptr(), cols),
                    bias,
                )
            }
        })
    });
    let parts: Vec<_> = parts
        .into_iter()
        .map(|(p0, cols, buf)| (p0 * NR, cols, buf))
        .collect();
    write_parts(&parts, rows, out, y, None);
}

/// Writes the parts `(first output o0, outputs n, rows × n results)` of a product into
/// `y` (`rows × out`, row-major), adding `b[o0..o0 + n]` where given.
fn write_parts(
    parts: &[(usize, usize, Vec<f32>)],
    rows: usize,
    out: usize,
    y: &mut [MaybeUninit<f32>],
    b: Option<&[f32]>,
) {
    for (o0, n, part) in parts {
        let (o0, n) = (*o0, *n);
        for r in 0..rows {
            let dst = &mut y[r * out + o0..r * out + o0 + n];
            for (c, (d, &v)) in dst.iter_mut().zip(&part[r * n..(r + 1) * n]).enumerate() {
                d.write(v + b.map_or(0.0, |b| b[o0 + c]));
            }
        }
    }
}

fn f32_slice<'a>(st: &'a Storage, lay: &candle::Layout, t: &Tensor) -> Result<&'a [f32]> {
    match (st, lay.contiguous_offsets()) {
        (Storage::Cpu(CpuStorage::F32(v)), Some((a, z))) => Ok(&v[a..z]),
        _ => candle::bail!(
            "linear: expected a contiguous f32 CPU tensor, got {:?} {:?} on {:?}",
            t.dims(),
            t.dtype(),
            t.device()
        ),
    }
}

fn weight_data<'a>(st: &'a Storage, lay: &candle::Layout, t: &Tensor) -> Result<Data<'a>> {
    match (st, lay.contiguous_offsets()) {
        (Storage::Cpu(CpuStorage::F32(v)), Some((a, z))) => Ok(Data::F32(&v[a..z])),
        (Storage::Cpu(CpuStorage::BF16(v)), Some((a, z))) => Ok(Data::BF16(&v[a..z])),
        (Storage::Cpu(CpuStorage::F16(v)), Some((a, z))) => Ok(Data::F16(&v[a..z])),
        _ => candle::bail!(
            "linear: expected a contiguous f32, bf16 or f16 CPU weight, got {:?} {:?} on {:?}",
            t.dims(),
            t.dtype(),
            t.device()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::super::amx::Unit;
    use super::*;

    /// Asserts that `got(r, o)` equals `x · wᵀ (+ b)` computed in f64, for `x (rows, in)`
    /// row-major and `w (out, in)`, within `1e-5 · (1 + √in)`; `what` names the case.
    fn assert_matches_f64(
        got: impl Fn(usize, usize) -> f32,
        x: &[f32],
        w: &[Vec<f32>],
        b: Option<&[f32]>,
        (rows, inp, out): (usize, usize, usize),
        what: &str,
    ) {
        let tol = 1e-5 * (1.0 + (inp as f64).sqrt());
        for r in 0..rows {
            for o in 0..out {
                let want: f64 = (0..inp)
                    .map(|k| x[r * inp + k] as f64 * w[o][k] as f64)
                    .sum::<f64>()
                    + b.map_or(0.0, |b| b[o] as f64);
                let g = got(r, o) as f64;
                assert!(
                    (g - want).abs() < tol,
                    "{what} in {inp} out {out} rows {rows} ({r}, {o}): {g} vs {want}"
                );
            }
        }
    }

    /// `w (out, in)` packed into 16-output panels, as the products read it.
    fn packed(w: &Tensor) -> Result<Vec<f32>> {
        let (out, inp) = w.dims2()?;
        let (wg, wl) = w.storage_and_layout();
        let mut wp = vec![0f32; out.div_ceil(NR) * inp * NR];
        pack_into(weight_data(&wg, wl, w)?, (out, inp), &mut wp);
        Ok(wp)
    }

    /// `rows · inp` deterministic inputs in [−1, 1], row-major.
    fn rows_of(rows: usize, inp: usize) -> Vec<f32> {
        (0..rows * inp)
            .map(|i| ((i * 7919) % 61) as f32 / 30.0 - 1.0)
            .collect()
    }

    /// The elements of `y`, which the product under test wrote whole.
    fn written(y: Vec<MaybeUninit<f32>>) -> Vec<f32> {
        // SAFETY: the callers pass buffers that the product wrote in full.
        y.into_iter().map(|v| unsafe { v.assume_init() }).collect()
    }

    /// A product whose selected instruction set has no kernel (`CANDLE_ATTENTION_ISA`
    /// changed to `portable` by another thread after `applies` looked) runs on the
    /// machine's best and equals an f64 product, in both the column-split and the
    /// row-block schedules. It panicked before.
    #[test]
    fn a_selection_without_a_product_runs_on_the_machines_best() -> Result<()> {
        let Some(tile) = tile_rows(Isa::detect()) else {
            eprintln!("no x86-64 product on this machine: nothing to check");
            return Ok(());
        };
        let (inp, out) = (64, 37);
        let w = Tensor::randn(0f32, 1.0, (out, inp), &candle::Device::Cpu)?;
        let (wv, wp) = (w.to_vec2::<f32>()?, packed(&w)?);
        for rows in [1, 4 * tile * par::threads() + 1] {
            let x = rows_of(rows, inp);
            let mut y = vec![MaybeUninit::<f32>::uninit(); rows * out];
            product_on(Isa::Portable, &x, &wp, None, (rows, inp, out), &mut y);
            let y = written(y);
            let dims = (rows, inp, out);
            assert_matches_f64(|r, o| y[r * out + o], &x, &wv, None, dims, "portable");
        }
        Ok(())
    }

    /// Rows read in place when the selected instruction set cannot read them: `portable`
    /// (no dot-product kernels), and, on an AVX-512 machine, AVX2 against f32 rows of 20
    /// elements (its kernels read multiples of 8, and asserted before). Both run on an
    /// instruction set of the machine that reads them and equal an f64 product.
    #[test]
    fn rows_in_place_run_on_an_instruction_set_that_reads_them() -> Result<()> {
        if !Isa::Avx2Fma.is_supported() {
            eprintln!("no AVX2: nothing to check");
            return Ok(());
        }
        let dev = candle::Device::Cpu;
        let mut cases = vec![(Isa::Portable, 64)];
        if Isa::Avx512.is_supported() {
            cases.push((Isa::Avx2Fma, 20));
        }
        for (selected, inp) in cases {
            let (rows, out) = (3, 40);
            let x = Tensor::randn(0f32, 1.0, (rows, inp), &dev)?;
            let w = Tensor::randn(0f32, 1.0, (out, inp), &dev)?;
            let got = linear_in_place_on(selected, &x, &w, None)?.to_vec2::<f32>()?;
            let (xv, wv) = (x.flatten_all()?.to_vec1::<f32>()?, w.to_vec2::<f32>()?);
            let what = format!("{selected:?}");
            assert_matches_f64(|r, o| got[r][o], &xv, &wv, None, (rows, inp, out), &what);
        }
        Ok(())
    }

    /// The column-split product of a few rows (a decode step) equals an f64 product:
    /// every row count below two register tiles, output counts of one panel, an odd
    /// number of panel pairs and a partial last panel, contraction lengths past one
    /// chunk of `KC`, with and without bias.
    #[test]
    fn products_of_a_few_rows_split_by_columns_match_f64() -> Result<()> {
        let Some(tile) = tile_rows(Isa::selected()) else {
            eprintln!("no x86-64 product on this machine: nothing to check");
            return Ok(());
        };
        let dev = candle::Device::Cpu;
        for (inp, out) in [(100, 16), (64, 80), (771, 37), (1600, 129)] {
            let w = Tensor::randn(0f32, 1.0, (out, inp), &dev)?;
            let (wv, wp) = (w.to_vec2::<f32>()?, packed(&w)?);
            let b: Vec<f32> = (0..out).map(|o| o as f32 * 0.25 - 3.0).collect();
            for rows in 1..2 * tile {
                let x = rows_of(rows, inp);
                for bias in [None, Some(&b[..])] {
                    let mut y = vec![MaybeUninit::<f32>::uninit(); rows * out];
                    product_by_columns(&x, &wp, bias, (rows, inp, out), &mut y, Isa::selected());
                    let y = written(y);
                    let dims = (rows, inp, out);
                    assert_matches_f64(|r, o| y[r * out + o], &x, &wv, bias, dims, "columns");
                }
            }
        }
        Ok(())
    }

    /// Inside a pool of two threads, a product too small to share (and its pack) runs on
    /// the calling thread alone, a larger one is shared, and both equal an f64 product.
    /// Small weights are taken, down to a few hundred elements.
    #[test]
    fn small_products_run_on_the_calling_thread() -> Result<()> {
        if tile_rows(Isa::selected()).is_none() {
            eprintln!("no x86-64 product on this machine: nothing to check");
            return Ok(());
        }
        let dev = candle::Device::Cpu;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .map_err(candle::Error::wrap)?;
        for ((rows, inp, out), small) in [
            ((1, 64, 64), true),
            ((16, 64, 192), true),
            ((6, 32, 20), true),
            ((64, 512, 512), false),
        ] {
            let w = Tensor::randn(0f32, 1.0, (out, inp), &dev)?;
            let x = Tensor::randn(0f32, 1.0, (rows, inp), &dev)?;
            // Weights of any size are taken (`Proj` sends these to `linear`).
            assert!(
                applies(&x, &w) || applies_packed(&x, &w),
                "{:?}",
                (rows, inp, out)
            );
            let (entered, got) = pool.install(|| {
                let before = par::inline_entries();
                let got = linear(&x, &w, None, false, DType::F32);
                (par::inline_entries() - before, got)
            });
            assert_eq!(entered > 0, small, "{:?}", (rows, inp, out));
            let got = got?.to_vec2::<f32>()?;
            let (xv, wv) = (x.flatten_all()?.to_vec1::<f32>()?, w.to_vec2::<f32>()?);
            let dims = (rows, inp, out);
            assert_matches_f64(|r, o| got[r][o], &xv, &wv, None, dims, "sized");
        }
        Ok(())
    }

    /// A few rows against the weight read in place, in f32, bf16 and f16, equal an f64
    /// product of the same values: every row count below a register tile, one output
    /// block and several (with a partial last one), contraction lengths with a bf16
    /// tail of 16 and whole 32-element groups (and, for f32 on AVX-512, any length).
    #[test]
    fn products_read_in_place_match_f64() -> Result<()> {
        let Some(tile) = tile_rows(Isa::selected()) else {
            eprintln!("no x86-64 product on this machine: nothing to check");
            return Ok(());
        };
        let dev = candle::Device::Cpu;
        let mut checked = 0;
        for (inp, out) in [(96, 45), (2048, 37), (100, 64), (1000, 130)] {
            for wdt in [DType::F32, DType::BF16, DType::F16] {
                let w = Tensor::randn(0f32, 1.0, (out, inp), &dev)?.to_dtype(wdt)?;
                let wv = w.to_dtype(DType::F32)?.to_vec2::<f32>()?;
                let b = Tensor::randn(0f32, 1.0, out, &dev)?;
                let bv = b.to_vec1::<f32>()?;
                for rows in 1..tile {
                    let x = Tensor::randn(0f32, 1.0, (rows, inp), &dev)?;
                    if !applies_in_place(&x, &w) {
                        continue;
                    }
                    let xv = x.flatten_all()?.to_vec1::<f32>()?;
                    for bias in [None, Some(&b)] {
                        let got = linear_in_place(&x, &w, bias)?.to_vec2::<f32>()?;
                        let bv = bias.map(|_| &bv[..]);
                        let dims = (rows, inp, out);
                        let what = format!("{wdt:?}");
                        assert_matches_f64(|r, o| got[r][o], &xv, &wv, bv, dims, &what);
                        checked += 1;
                    }
                }
            }
        }
        // At least 8 (shape, dtype) pairs: on AVX-512 f32 at every length and half
        // precision at the two multiples of 16; on AVX2 every dtype at three lengths.
        assert!(checked >= 2 * 8 * (tile - 1), "only {checked} products checked");
        Ok(())
    }

    /// Rows a multiple of 4 KiB apart are handed over as a copy with a longer stride
    /// and the same values; other strides, and a single row, as they are.
    #[test]
    fn x_rows_at_4_kib_strides_are_restrided() {
        for (n, inp, copied) in [
            (3, 1024, true),
            (14, 2048, true),
            (1, 1024, false),
            (3, 1000, false),
            (3, 1536, false),
        ] {
            let xs: Vec<f32> = (0..n * inp).map(|i| i as f32).collect();
            with_x_rows(&xs, n, inp, |got, ld| {
                assert_eq!(ld != inp, copied, "{n} rows of {inp}");
                assert_eq!(ld.is_multiple_of(1024), !copied && inp.is_multiple_of(1024));
                for r in 0..n {
                    assert_eq!(&got[r * ld..r * ld + inp], &xs[r * inp..(r + 1) * inp]);
                }
            });
        }
    }

    #[test]
    fn reservations_stay_within_the_budget() {
        let held = AtomicUsize::new(0);
        assert!(reserve(&held, 60, 100));
        assert!(reserve(&held, 40, 100));
        assert!(!reserve(&held, 1, 100), "over the budget");
        assert_eq!(held.load(Ordering::Relaxed), 100);
        assert!(!reserve(&held, usize::MAX, usize::MAX), "overflow is refused");
        assert!(
            !reserve(&AtomicUsize::new(0), 1, 0),
            "a zero budget keeps nothing"
        );
    }

    /// No other test of the library's test binary packs weights, so the counter moves
    /// only here.
    #[test]
    fn a_pack_holds_its_bytes_until_dropped() -> Result<()> {
        if cache_budget() < 1 << 20 {
            // CANDLE_ATTENTION_PACK_CACHE_MB=0 in the environment: nothing is kept.
            return Ok(());
        }
        let w = Tensor::ones((20, 8), DType::F32, &candle::Device::Cpu)?;
        let before = CACHED_BYTES.load(Ordering::Relaxed);
        let p = PackedWeight::cached(&w, 16, false)?.expect("a 1 KiB pack fits the default budget");
        let bytes = 32 * 8 * 4; // two 16-output panels of 8 inputs
        assert_eq!(CACHED_BYTES.load(Ordering::Relaxed), before + bytes);
        drop(p);
        assert_eq!(CACHED_BYTES.load(Ordering::Relaxed), before);
        // Where the AMX tile unit runs the products of bf16 weights, and of f16 weights
        // against half-precision x of 16 rows or more, those weights are kept as its
        // VNNI blocks (64 outputs × 32 inputs × 2 bytes per component); so are bf16
        // weights against half-precision x of any number of rows where AVX512-BF16
        // register tiles run them. A weight with an infinity, weights packed for other
        // calls, and every weight elsewhere, as f32 panels.
        for (dt, comps, rows, half_x) in [
            (DType::BF16, 1, 1, false),
            (DType::BF16, 1, 1, true),
            (DType::BF16, 1, 16, false),
            (DType::BF16, 1, 16, true),
            (DType::F16, 2, 15, true),
            (DType::F16, 2, 16, false),
            (DType::F16, 2, 16, true),
        ] {
            let case = format!("{dt:?} for {rows} rows, half_x {half_x}");
            let w = w.to_dtype(dt)?;
            let p = PackedWeight::cached(&w, rows, half_x)?.expect("fits");
            let unit = amx_linear::unit();
            let tiles = match unit {
                Some(Unit::Tiles) => dt == DType::BF16 || (rows >= 16 && half_x),
                Some(Unit::Avx512Bf16) => dt == DType::BF16 && half_x,
                None => false,
            };
            assert_eq!(on_tiles(dt, rows, half_x), tiles, "{case}");
            let by_call = match unit {
                Some(Unit::Tiles) => dt == DType::F16,
                Some(Unit::Avx512Bf16) => dt == DType::BF16,
                None => false,
            };
            assert_eq!(packs_by_call(dt), by_call, "{case}");
            assert_eq!(matches!(p.panels, Panels::Tiles(..)), tiles, "{case}");
            let want = if tiles { 64 * 32 * 2 * comps } else { bytes };
            assert_eq!(CACHED_BYTES.load(Ordering::Relaxed), before + want, "{case}");
            drop(p);
            let inf = Tensor::cat(&[w.narrow(0, 0, 19)?, (w.narrow(0, 19, 1)? * f64::INFINITY)?], 0)?;
            let p = PackedWeight::cached(&inf, rows, half_x)?.expect("fits");
            assert!(matches!(p.panels, Panels::F32(_)), "{case} with inf");
            assert_eq!(
                CACHED_BYTES.load(Ordering::Relaxed),
                before + bytes,
                "{case} with inf"
            );
            drop(p);
            assert_eq!(CACHED_BYTES.load(Ordering::Relaxed), before);
        }
        Ok(())
    }
}
