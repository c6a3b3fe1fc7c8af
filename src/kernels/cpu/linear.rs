//! `y = x · Wᵀ + b` in f32 on an AVX-512 register-tiled product ([`avx512::gemm`]):
//! 14-row × 32-output tiles whose rows of `x` are broadcast from their row-major place
//! (no copy of `x`), against `W` packed once per call into 16-output panels
//! (`[out / 16][in][16]`, by 16×16 transposes; f16/bf16 weights are converted there, so
//! no f32 copy of `W` is made). Row blocks of about [`ROWS`] rows run in
//! parallel; each writes its own contiguous output rows, so the weight streams through
//! the cache once per row block. The bias is the accumulators' starting value.

use super::avx512::{self, GEMM_ROWS};
use super::pack::{pack_k, AVec, Data, View, NR};
use candle::{CpuStorage, DType, Result, Storage, Tensor};
use rayon::prelude::*;

/// Rows per parallel work item (about; whole register tiles).
const ROWS: usize = 144;
/// Contraction chunk.
const KC: usize = 256;
/// Largest pack buffer (floats) a thread keeps between calls (16 MiB).
const KEEP_FLOATS: usize = 4 << 20;

/// Whether [`linear`] takes a `(rows, in) · (out, in)ᵀ` product: f32 on the CPU, the
/// AVX-512 kernel selected, and a product large enough to amortise the packing.
pub(crate) fn applies(x: &Tensor, w: &Tensor) -> bool {
    let (Ok((rows, inp)), Ok((out, win))) = (x.dims2(), w.dims2()) else {
        return false;
    };
    x.device().is_cpu()
        && w.device().is_cpu()
        && x.dtype() == DType::F32
        && matches!(w.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && inp == win
        && rows >= GEMM_ROWS
        && inp * out >= 4096
        && cfg!(target_arch = "x86_64")
        && super::Isa::selected() == super::Isa::Avx512
}

/// `x · Wᵀ (+ b)`: x `(rows, in)` and b `(out)` f32, w `(out, in)` f32, bf16 or f16, all
/// on the CPU; returns `(rows, out)` in f32. Callers check [`applies`] first; shapes are validated again here.
pub(crate) fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let (rows, inp) = x.dims2()?;
    let (out, win) = w.dims2()?;
    if win != inp {
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
    let (xc, wc) = (x.contiguous()?, w.contiguous()?);
    let bc = b.map(|b| b.contiguous()).transpose()?;
    let (xg, xl) = xc.storage_and_layout();
    let (wg, wl) = wc.storage_and_layout();
    let bg = bc.as_ref().map(|b| b.storage_and_layout());
    let xv = f32_slice(&xg, xl, x)?;
    let wd = weight_data(&wg, wl, w)?;
    let bv = match (&bg, b) {
        (Some((g, l)), Some(b)) => Some(f32_slice(g, l, b)?),
        _ => None,
    };
    let np = out.div_ceil(NR);
    // The W pack lives in a buffer kept by the calling thread between calls: a fresh
    // multi-MB allocation would page-fault on every call.
    let y = PACK.with(|cell| {
        let mut guard = cell.try_borrow_mut();
        let mut fresh = AVec::default();
        let wp = match guard.as_deref_mut() {
            Ok(buf) => buf,
            Err(_) => &mut fresh,
        };
        wp.grow(np * inp * NR);
        let y = product(xv, wd, bv, (rows, inp, out), &mut wp[..np * inp * NR]);
        // Keep at most `KEEP_FLOATS`, so a large layer's pack is not held.
        if wp.len() > KEEP_FLOATS {
            *wp = AVec::default();
        }
        y
    });
    Tensor::from_vec(y, (rows, out), x.device())
}

thread_local! {
    /// This thread's W pack, reused across calls.
    static PACK: std::cell::RefCell<AVec<f32>> = std::cell::RefCell::new(AVec::default());
}

/// Packs `W` into `wp` and returns the `(rows, out)` product, `x` read in place.
fn product(
    xv: &[f32],
    wd: Data,
    bv: Option<&[f32]>,
    (rows, inp, out): (usize, usize, usize),
    wp: &mut [f32],
) -> Vec<f32> {
    // W panels: [panel][k][NR], zero outputs past `out` (every element is written: the
    // buffer holds stale values from earlier calls). This is the K-panel layout of the
    // attention kernel, with outputs as keys, so its packer serves; f16/bf16 weights are
    // converted there, so no f32 copy of W is made.
    let wview = View {
        data: wd,
        start: 0,
        strides: [0, 0, inp, 1],
    };
    // Conversion scratch, needed only for f16/bf16 weights.
    let tmp_len = if matches!(wd, Data::F32(_)) { 0 } else { NR * inp };
    wp.par_chunks_mut(inp * NR).enumerate().for_each_init(
        || vec![0f32; tmp_len],
        |tmp, (p, panel)| {
            let o0 = p * NR;
            pack_k(
                super::Isa::Avx512,
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
    let wp = &*wp;

    let mut y: Vec<f32> = Vec::with_capacity(rows * out);
    // Row blocks of about `ROWS` rows, as many as a multiple of the thread count, with
    // whole register tiles split evenly (block sizes differ by at most one tile), so the
    // threads get equal work.
    let nt = rayon::current_num_threads().max(1);
    let tiles = rows.div_ceil(GEMM_ROWS);
    let nblk = rows.div_ceil(ROWS).div_ceil(nt) * nt;
    let mut blocks = Vec::with_capacity(nblk);
    let mut rest = &mut y.spare_capacity_mut()[..rows * out];
    for i in 0..nblk {
        let r0 = (i * tiles / nblk * GEMM_ROWS).min(rows);
        let r1 = ((i + 1) * tiles / nblk * GEMM_ROWS).min(rows);
        let (head, tail) = std::mem::take(&mut rest).split_at_mut((r1 - r0) * out);
        blocks.push((r0, head));
        rest = tail;
    }
    blocks
        .into_par_iter()
        .filter(|(_, ys)| !ys.is_empty())
        .for_each(|(r0, ys)| {
            let n = ys.len() / out;
            let full = n / GEMM_ROWS * GEMM_ROWS;
            let yp = ys.as_mut_ptr() as *mut f32;
            // Rows past the last full tile go through a zero-padded copy.
            let tail = n - full;
            let mut xt = vec![0f32; if tail > 0 { GEMM_ROWS * inp } else { 0 }];
            let mut yt = vec![0f32; if tail > 0 { GEMM_ROWS * out } else { 0 }];
            if tail > 0 {
                xt[..tail * inp].copy_from_slice(&xv[(r0 + full) * inp..(r0 + n) * inp]);
            }
            // Contraction chunks of `KC`: a panel pair (2 × KC × 16 floats) stays in L1.
            let mut k0 = 0;
            while k0 < inp {
                let k1 = (k0 + KC).min(inp);
                let bias = if k0 == 0 { bv } else { None };
                // SAFETY: `applies` selected the AVX-512 kernel, so the machine has it;
                // rows `0..full` of this block are inside `ys`. The first chunk writes
                // every element before later chunks read them.
                unsafe {
                    avx512::gemm(
                        &xv[r0 * inp..(r0 + full) * inp],
                        inp,
                        full / GEMM_ROWS,
                        (k0, k1, inp),
                        wp,
                        out,
                        yp,
                        out,
                        bias,
                        k0 > 0,
                    )
                };
                if tail > 0 {
                    // SAFETY: as above, into the padded `yt` of `GEMM_ROWS` rows.
                    unsafe {
                        avx512::gemm(
                            &xt,
                            inp,
                            1,
                            (k0, k1, inp),
                            wp,
                            out,
                            yt.as_mut_ptr(),
                            out,
                            bias,
                            k0 > 0,
                        )
                    };
                }
                k0 = k1;
            }
            if tail > 0 {
                // SAFETY: rows `full..n` of this block are inside `ys`.
                unsafe { std::ptr::copy_nonoverlapping(yt.as_ptr(), yp.add(full * out), tail * out) };
            }
        });
    // SAFETY: the row blocks above wrote all `rows · out` elements.
    unsafe { y.set_len(rows * out) };
    y
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
