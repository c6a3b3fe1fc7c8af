//! `y = x · Wᵀ + b` in f32 on the AVX-512 score micro-kernel: the projection is the same
//! product as `S = Q·Kᵀ`, with the rows of `x` as queries and the rows of `W` as keys.
//!
//! `x` is strip-packed once (`[rows / MR][in][MR]`), `W` is packed once into 16-output
//! panels (`[out / 16][in][16]`), and row blocks of [`ROWS`] rows run in parallel; each
//! writes its own contiguous output rows, so the weight streams through the cache once
//! per row block.

use super::pack::{AVec, MR, NR};
use candle::{CpuStorage, DType, Result, Storage, Tensor};
use rayon::prelude::*;

/// Rows per parallel work item (a multiple of 2·[`MR`], the 12-row register tile).
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
        && w.dtype() == DType::F32
        && inp == win
        && rows >= 2 * MR
        && inp * out >= 4096
        && cfg!(target_arch = "x86_64")
        && super::Isa::selected() == super::Isa::Avx512
}

/// `x · Wᵀ (+ b)`: x `(rows, in)`, w `(out, in)`, b `(out)`, all f32 on the CPU; returns
/// `(rows, out)`. Callers check [`applies`] first; shapes are validated again here.
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
    let wv = f32_slice(&wg, wl, w)?;
    let bv = match (&bg, b) {
        (Some((g, l)), Some(b)) => Some(f32_slice(g, l, b)?),
        _ => None,
    };
    let rows_pad = rows.div_ceil(MR) * MR;
    let np = out.div_ceil(NR);
    let out_pad = np * NR;

    // The packs live in buffers kept by the calling thread between calls: fresh multi-MB
    // allocations would page-fault on every call.
    let y = PACKS.with(|cell| {
        let mut guard = cell.try_borrow_mut();
        let mut fresh = (AVec::default(), AVec::default());
        let (xs, wp) = match guard.as_deref_mut() {
            Ok(bufs) => (&mut bufs.0, &mut bufs.1),
            Err(_) => (&mut fresh.0, &mut fresh.1),
        };
        xs.grow(rows_pad * inp);
        wp.grow(np * inp * NR);
        let y = product(
            xv,
            wv,
            bv,
            (rows, inp, out),
            &mut xs[..rows_pad * inp],
            &mut wp[..np * inp * NR],
        );
        // Keep at most `KEEP_FLOATS` per buffer, so a large layer's packs are not held.
        for v in [xs, wp] {
            if v.len() > KEEP_FLOATS {
                *v = AVec::default();
            }
        }
        y
    });
    let y = Tensor::from_vec(y, (rows_pad, out_pad), x.device())?;
    if rows_pad == rows && out_pad == out {
        Ok(y)
    } else {
        y.narrow(0, 0, rows)?.narrow(1, 0, out)?.contiguous()
    }
}

thread_local! {
    /// This thread's x and W packs, reused across calls.
    static PACKS: std::cell::RefCell<(AVec<f32>, AVec<f32>)> = std::cell::RefCell::new((AVec::default(), AVec::default()));
}

/// Packs `x` and `W` into `xs` and `wp` and returns the `(rows_pad, out_pad)` product.
fn product(
    xv: &[f32],
    wv: &[f32],
    bv: Option<&[f32]>,
    (rows, inp, out): (usize, usize, usize),
    xs: &mut [f32],
    wp: &mut [f32],
) -> Vec<f32> {
    let rows_pad = rows.div_ceil(MR) * MR;
    let np = out.div_ceil(NR);
    let out_pad = np * NR;
    // x strips: [strip][k][MR], zero rows past `rows` (every element is written: the
    // buffers hold stale values from earlier calls).
    xs.par_chunks_mut(MR * inp).enumerate().for_each(|(st, strip)| {
        for rr in 0..MR {
            let r = st * MR + rr;
            if r < rows {
                for (k, &v) in xv[r * inp..(r + 1) * inp].iter().enumerate() {
                    strip[k * MR + rr] = v;
                }
            } else {
                for k in 0..inp {
                    strip[k * MR + rr] = 0.0;
                }
            }
        }
    });
    // W panels: [panel][k][NR], zero outputs past `out`.
    wp.par_chunks_mut(inp * NR).enumerate().for_each(|(p, panel)| {
        for c in 0..NR {
            let o = p * NR + c;
            if o < out {
                for (k, &v) in wv[o * inp..(o + 1) * inp].iter().enumerate() {
                    panel[k * NR + c] = v;
                }
            } else {
                for k in 0..inp {
                    panel[k * NR + c] = 0.0;
                }
            }
        }
    });

    let (xs, wp) = (&*xs, &*wp);
    let mut y = vec![0f32; rows_pad * out_pad];
    // Row blocks of at most `ROWS` rows, as many as a multiple of the thread count, so the
    // threads get equal work.
    let nt = rayon::current_num_threads().max(1);
    let nblk = rows_pad.div_ceil(ROWS).div_ceil(nt) * nt;
    let blk_rows = rows_pad.div_ceil(nblk).div_ceil(2 * MR) * 2 * MR;
    y.par_chunks_mut(blk_rows * out_pad)
        .enumerate()
        .for_each(|(blk, ys)| {
            let r0 = blk * blk_rows;
            let n = ys.len() / out_pad;
            let xb = &xs[r0 * inp..(r0 + n) * inp];
            // Contraction chunks of `KC`: a panel pair (2 × KC × 16 floats) stays in L1.
            let mut k0 = 0;
            while k0 < inp {
                let k1 = (k0 + KC).min(inp);
                // The first chunk overwrites `ys` (writing fresh pages first avoids a
                // copy-on-write fault of the kernel's shared zero page, with its TLB
                // shootdown); later chunks accumulate.
                // SAFETY: `applies` selected the AVX-512 kernel, so the machine has it.
                unsafe { super::avx512::qk_acc(xb, n, inp, (k0, k1), wp, np, ys, out_pad, k0 > 0) };
                k0 = k1;
            }
            if let Some(bv) = bv {
                for row in ys.chunks_exact_mut(out_pad) {
                    for (d, &bb) in row.iter_mut().zip(bv.iter()) {
                        *d += bb;
                    }
                }
            }
        });
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
