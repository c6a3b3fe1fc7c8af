//! Fused, tiled flash-attention kernel for the CPU.
//!
//! * Online-softmax tiling: blocks of up to `driver::BQ` (144) query rows against
//!   blocks of `tiles::BK` (64) keys; nothing of size L×S is ever materialised.
//! * Work items are (batch, kv head, row block), where the rows of a block are the
//!   flattened `(query head in the GQA group, query position)` pairs, so one block can
//!   cover several query heads of a group (decode) and every block is a contiguous
//!   range of the `(B, Hq, L, Ev)` output. Items are handed out from an atomic counter
//!   on the rayon pool, sorted by visible-key count, largest first (in prefill, group
//!   by group and largest first within each group).
//! * Prefill (several row blocks per group): K/V are converted to f32 and packed once per
//!   (batch, kv head) into micro-kernel panels (`pack`), shared by every query head of
//!   the group; groups are packed in chunks of at most 32 MiB, so extra memory stays
//!   O(threads × block + 32 MiB) whatever L and S are. The calling thread keeps that
//!   buffer for its next call (a fresh one costs a page fault per 4 KiB). Packing is
//!   pipelined with the blocks: the packs of group g + 1 are work units handed out just
//!   before the blocks of group g, and a block waits until its own group's packs are
//!   written (`driver::prefill::Pipeline`), so no barrier separates packing from computing.
//! * One row block per group: K/V are packed block by block inside the item; with few
//!   query rows per group (decode, `G·L` ≤ 24) K/V rows are read straight from the
//!   source (f32, and f16/bf16 with unit inner stride on AVX2 and AVX-512) or converted
//!   block by block (f16/bf16 otherwise) and fed to a dot-product score kernel, so each
//!   K/V row is streamed once per GQA group. Where rows are read in place, those blocks
//!   are longer: 128 KiB of K rows (`decode::decode_block_keys`: 256 keys of f32 rows of
//!   128, 512 of bf16), so that the kernels switch between the K and V streams less
//!   often. When there are fewer groups than 2 × threads, the key range is split across
//!   items and merged with log-sum-exp.
//! * Register-blocked micro-kernels for `S = Q·Kᵀ` and `O = α·O + P·V`: AVX-512F/DQ
//!   6×64 tiles (their f32 contraction loops in assembly, `avx512::tile_loop_6x4`) with
//!   12×32 and smaller ones for the remainders (`avx512`), AVX2+FMA
//!   6×16 tiles (`avx2`), NEON (`neon`) and a portable auto-vectorised fallback
//!   (`portable`), chosen at runtime; a polynomial `2^x` (`exp`, `avx512::exp2_512`) —
//!   scores are kept in the log2 domain (`log2 e` folded into the query scale and the
//!   mask). On AVX-512, f32 prefill with Ev ≥ 128 takes two wholly visible key blocks
//!   per step (`avx512::pv_pair`), and the softmax updates a block's rows in one call,
//!   each row in registers, with lazy rescaling (`avx512::online_rows_lazy`); a full,
//!   wholly visible 64-key block with no explicit mask takes its softmax straight from
//!   the score tiles' registers (`avx512::qk_softmax`), also as either block of a full
//!   pair.
//! * bf16/f16 on a CPU with AMX: both block products on the tile unit (`amx`, f32
//!   accumulation) over 256-key super-blocks, with inputs split into exact bf16
//!   components (see `amx` for the error bounds); the softmax stays in f32 on AVX-512,
//!   with lazy rescaling and lane-wise row sums (`avx512::softmax_row_bf16`).
//! * bf16 without AMX, on a CPU with AVX512-BF16 (AMD Zen 4): the same path, operands
//!   and packs, with the two block products on `VDPBF16PS` register tiles (`dpbf16`).
//! * Projections (`linear`) with bf16 weights on a CPU with AMX: their products on the
//!   tile unit too (`amx_linear`, `amx::gemm_tiles`), the weight packed as the K blocks
//!   are and x split into exact bf16 parts, so every product is exact and the sums are
//!   f32 ones. Other weights (f32, f16) run the f32 register-tiled product.
//! * Attention sinks (one logit per query head, [`Extras::sinks`]) enter each row's
//!   softmax sum once, `2^(sink − m)` against the row's reference max `m`, when the row
//!   is normalised (`driver::block::finish`) or after the split-K merge (`driver::block::merge`).
//! * Logit soft-capping ([`Extras::softcap`]) caps each block's scores in
//!   `driver::block::online_rows`, before the mask (`softcap`); the f32 paths that take
//!   their softmax elsewhere (AVX-512's softmax in registers, AVX2's row maxima kept by
//!   the score kernel) stand aside for it. The AMX and AVX512-BF16 path caps its score
//!   rows itself, before their mask and softmax (`driver::amx_block`).
//! * Nothing here has a backward pass: the dispatcher (`crate::sdpa`) and `crate::Proj`
//!   send tensors that record gradients to candle's ops instead.
//! * Decode on AVX-512 reads K/V rows in place, f16/bf16 widened in registers, and
//!   walks each K and V row to its end before the next, keys in order
//!   (`avx512::qk_dot_impl`, `avx512::pv_rows`), which the hardware prefetchers follow
//!   from DRAM. On Intel CPUs they also ask for the rows 4 KiB ahead with heads of 128
//!   (16 keys of f16/bf16, 8 of f32; software prefetch,
//!   `prefetch::avx512_decode_ahead`); other vendors' CPUs take none. On AVX2 the decode
//!   kernels do the same (f16 with F16C): scores only for the live rows
//!   (`avx2::qk_dot`), and a `P·V` that walks each V row to its end, four keys at a
//!   time (`avx2::pv_rows`), where the panel kernel reads 16 columns of every row per
//!   pass. With f32 rows, the first score strip of a block also asks for the block's V
//!   rows into the L2 as it goes (`prefetch::AskRows`), which on the Zen 4 VM with AVX2
//!   forced made decode of 1–12 rows 13–35% faster; groups of 14 rows or more score in
//!   strips of 16 rows and run `P·V` in register tiles over the rows in the L2
//!   (`avx2::pv_rows_tiles`). Wherever the scores asked for V (AVX2, and AVX-512 where
//!   `avx512::qk_dot_raw` does), `P·V` asks for the next block's K rows
//!   into the L2 as it runs (`prefetch::Lines`), so the memory streams during both
//!   products (3–23% less time from DRAM on the Zen 4 VM). The portable and NEON kernels also score the live rows only
//!   (`portable::qk_dot`) and walk each V row to its end (`portable::pv_rows`).
//! * The portable and NEON kernels' softmax computes `2^x` in plain arithmetic that the
//!   compiler vectorises (`exp::exp2_nonpos`, the steps of `exp2_256_nonpos`) at the
//!   full register width.
//! * On AVX2 the softmax updates a block's rows in one call, each row read into eight
//!   registers, in two passes over all rows (`avx2::online_rows_block`), with a `2^x`
//!   for `x ≤ 0` with one clamp and a degree-5 polynomial (`exp::avx2::exp2_256_nonpos`).
//! * Causal / sliding-window visibility through loop bounds: hidden key blocks are
//!   skipped, only edge blocks are masked, and on edge blocks each 6-row strip only
//!   computes the key panels it can see. Optional additive mask with broadcasting; a
//!   key-padding mask (one run of visible keys per batch and head, the same for every
//!   query) becomes loop bounds as well (`view::MaskView::key_runs`).
//! * Outputs of 32 MiB or more (the attention output and `linear`'s) are marked for
//!   transparent huge pages on Linux before they are written (`pages`): glibc maps such
//!   allocations afresh on every call, and faulting them in 4 KiB at a time took about 5%
//!   of the thread time of `gpt2k_causal_d128` (its calls ran 2.6% faster with the advice).
//!
//! `NOTES.md`, beside this file, records the measurements behind these choices, what was
//! tried and not kept, and the benchmark tables of earlier runs and machines.

use candle::{CpuStorage, DType, Layout, Result, Storage, Tensor};

mod aligned;
#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod amx_linear;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
pub(crate) mod cast;
mod causal;
mod decode;
#[cfg(target_arch = "x86_64")]
mod dpbf16;
mod driver;
mod exp;
mod isa;
#[cfg(target_arch = "x86_64")]
pub(crate) mod linear;
#[cfg(target_arch = "aarch64")]
mod neon;
mod pack;
pub(crate) mod pages;
pub(crate) mod par;
mod portable;
mod prefetch;
mod softcap;
mod store;
mod tiles;
mod view;
#[cfg(target_arch = "x86_64")]
mod vnni;

pub use causal::Causal;
pub use isa::Isa;
pub use prefetch::decode_prefetch_by_default;
use view::{Data, MaskView, View};

/// The instruction set the kernel dispatches to on this machine: "avx512", "avx2+fma",
/// "neon" or "portable" (`CANDLE_ATTENTION_ISA=portable|avx2|avx512` forces one, where the
/// machine supports it; read per call).
pub fn isa() -> &'static str {
    Isa::selected().name()
}

/// Scaled dot-product attention, fused and tiled (see the module docs).
///
/// q: (B, Hq, L, E), k: (B, Hkv, S, E), v: (B, Hkv, S, Ev); all the same dtype, one of
/// F32, F16, BF16; CPU device; any strides and start offsets. `Hq % Hkv == 0`; query head
/// h uses kv head `h / (Hq / Hkv)`. mask: optional additive F32 mask of rank 4, each dim
/// 1 or equal to (B, Hq, L, S). causal: optional loop-bound causal/window rule (combined
/// with the mask). scale multiplies q·k. Returns (B, Hq, L, Ev), contiguous, input dtype;
/// rows without any visible key are exactly 0.
pub fn sdpa(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    causal: Option<Causal>,
    scale: f32,
) -> Result<Tensor> {
    sdpa_with_isa(q, k, v, mask, causal, scale, Isa::selected())
}

/// What [`sdpa_with`] adds to [`sdpa`]'s softmax. The default adds nothing.
#[derive(Clone, Copy, Debug, Default)]
pub struct Extras<'a> {
    /// Attention sinks (gpt-oss): one logit per query head (`Hq` values), an extra key of
    /// that score and a zero value in every row's softmax, so each row's weights sum to
    /// less than one. Rows without a visible key are 0, as without sinks.
    pub sinks: Option<&'a [f32]>,
    /// Logit soft-capping (Gemma 2): `cap · tanh(score / cap)` of each scaled score,
    /// before the mask; `cap` positive and finite.
    pub softcap: Option<f32>,
}

/// [`sdpa`] with [`Extras`] (sinks, softcap). With `heads_inner`, the result `(B, Hq, L,
/// Ev)` is a view of `(B, L, Hq, Ev)` row-major memory (the layout of PyTorch's CPU flash
/// attention output), so that the usual `transpose(1, 2)` to `(B, L, Hq, Ev)` afterwards
/// is contiguous and a following `reshape` to `(B, L, Hq · Ev)` copies nothing.
#[allow(clippy::too_many_arguments)]
pub fn sdpa_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    causal: Option<Causal>,
    scale: f32,
    extras: Extras,
    heads_inner: bool,
) -> Result<Tensor> {
    let plan = CallPlan {
        extras,
        ..CallPlan::new(heads_inner)
    };
    sdpa_impl(q, k, v, mask, causal, scale, Isa::selected(), plan)
}

/// The output layout, the K/V pack budget and the [`Extras`] of one [`sdpa_impl`] call.
#[derive(Clone, Copy)]
struct CallPlan<'a> {
    /// `(B, L, Hq, Ev)` memory behind the `(B, Hq, L, Ev)` result.
    heads_inner: bool,
    /// [`driver::PACK_BUDGET_BYTES`] outside tests.
    pack_budget: usize,
    extras: Extras<'a>,
}

impl CallPlan<'_> {
    fn new(heads_inner: bool) -> Self {
        Self {
            heads_inner,
            pack_budget: driver::PACK_BUDGET_BYTES,
            extras: Extras::default(),
        }
    }
}

fn dims4(t: &Tensor, name: &str) -> Result<[usize; 4]> {
    match t.dims() {
        &[a, b, c, d] => Ok([a, b, c, d]),
        d => candle::bail!("sdpa: {name} must have rank 4, got shape {d:?}"),
    }
}

fn data_of<'a>(s: &'a Storage, name: &str) -> Result<Data<'a>> {
    match s {
        Storage::Cpu(CpuStorage::F32(v)) => Ok(Data::F32(v)),
        Storage::Cpu(CpuStorage::F16(v)) => Ok(Data::F16(v)),
        Storage::Cpu(CpuStorage::BF16(v)) => Ok(Data::BF16(v)),
        Storage::Cpu(_) => candle::bail!("sdpa: unsupported storage dtype for {name}"),
        _ => candle::bail!("sdpa: {name} must be on the CPU device"),
    }
}

fn view<'a>(st: &'a Storage, lay: &Layout, dims: [usize; 4], name: &str) -> Result<View<'a>> {
    Ok(View {
        data: data_of(st, name)?,
        start: lay.start_offset(),
        strides: strides4(lay, &dims),
    })
}

fn strides4(layout: &Layout, dims: &[usize; 4]) -> [usize; 4] {
    let st = layout.stride();
    let mut out = [0; 4];
    for i in 0..4 {
        out[i] = if dims[i] == 1 { 0 } else { st[i] };
    }
    out
}

/// [`sdpa`] with an explicit instruction set (tests use this to cover every kernel).
/// Errors if `isa` is not supported on this machine.
#[allow(clippy::too_many_arguments)]
pub fn sdpa_with_isa(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    causal: Option<Causal>,
    scale: f32,
    isa: Isa,
) -> Result<Tensor> {
    sdpa_impl(q, k, v, mask, causal, scale, isa, CallPlan::new(false))
}

#[allow(clippy::too_many_arguments)]
fn sdpa_impl(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    causal: Option<Causal>,
    scale: f32,
    isa: Isa,
    layout: CallPlan,
) -> Result<Tensor> {
    if !isa.is_supported() {
        candle::bail!(
            "sdpa: instruction set {} is not supported on this machine",
            isa.name()
        );
    }
    let [b, hq, l, e] = dims4(q, "q")?;
    let [bk, hkv, s, ek] = dims4(k, "k")?;
    let [bv, hkv_v, sv, ev] = dims4(v, "v")?;
    let dtype = q.dtype();
    if k.dtype() != dtype || v.dtype() != dtype {
        candle::bail!(
            "sdpa: q, k, v must share a dtype, got q {dtype:?}, k {:?}, v {:?}",
            k.dtype(),
            v.dtype()
        );
    }
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        candle::bail!("sdpa: unsupported dtype {dtype:?} (expected F32, F16 or BF16)");
    }
    for (t, name) in [(q, "q"), (k, "k"), (v, "v")] {
        if !t.device().is_cpu() {
            candle::bail!("sdpa: {name} must be on the CPU device, got {:?}", t.device());
        }
    }
    if bk != b || bv != b || hkv_v != hkv || sv != s || ek != e {
        candle::bail!(
            "sdpa: shape mismatch: q {:?} (B, Hq, L, E), k {:?} (B, Hkv, S, E), v {:?} (B, Hkv, S, Ev)",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    if hkv == 0 && hq != 0 || hkv != 0 && hq % hkv != 0 {
        candle::bail!(
            "sdpa: query heads ({hq}) must be a multiple of kv heads ({hkv}); q {:?}, k {:?}",
            q.dims(),
            k.dims()
        );
    }
    if let Some(sk) = layout.extras.sinks {
        if sk.len() != hq {
            candle::bail!(
                "sdpa: sinks must hold one logit per query head ({hq}), got {} for q {:?}",
                sk.len(),
                q.dims()
            );
        }
    }
    if let Some(cap) = layout.extras.softcap {
        if !(cap > 0.0 && cap.is_finite()) {
            candle::bail!("sdpa: softcap must be positive and finite, got {cap}");
        }
    }
    if let Some(m) = mask {
        let md = dims4(m, "mask")?;
        if m.dtype() != DType::F32 {
            candle::bail!("sdpa: mask must be F32 (additive), got {:?}", m.dtype());
        }
        if !m.device().is_cpu() {
            candle::bail!("sdpa: mask must be on the CPU device, got {:?}", m.device());
        }
        let want = [b, hq, l, s];
        if md.iter().zip(want).any(|(&d, w)| d != 1 && d != w) {
            candle::bail!("sdpa: mask shape {md:?} does not broadcast to (B, Hq, L, S) = {want:?}");
        }
    }
    let out_shape = (b, hq, l, ev);
    match [b, hq, l, ev].iter().try_fold(1usize, |a, &d| a.checked_mul(d)) {
        None => candle::bail!(
            "sdpa: the output (B, Hq, L, Ev) = {out_shape:?} has more elements than usize can count"
        ),
        Some(0) => return Tensor::zeros(out_shape, dtype, q.device()),
        Some(_) => {}
    }

    let (qs, ql) = q.storage_and_layout();
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let qv = view(&qs, ql, [b, hq, l, e], "q")?;
    let kv = view(&ks, kl, [b, hkv, s, e], "k")?;
    let vv = view(&vs, vl, [b, hkv, s, ev], "v")?;
    let mguard = mask.map(|m| m.storage_and_layout());
    let mview = match &mguard {
        None => None,
        Some((ms, mlay)) => match &**ms {
            Storage::Cpu(CpuStorage::F32(data)) => {
                let md = dims4(mask.map_or(q, |m| m), "mask")?;
                Some(MaskView {
                    data,
                    start: mlay.start_offset(),
                    strides: strides4(mlay, &md),
                })
            }
            _ => candle::bail!("sdpa: mask must be an F32 CPU tensor"),
        },
    };
    // A key-padding mask runs as loop bounds (`MaskView::key_runs`).
    let keys = mview.as_ref().and_then(|m| m.key_runs(b, hq, s));
    let mview = if keys.is_some() { None } else { mview };
    let p = driver::Problem {
        q: qv,
        k: kv,
        v: vv,
        mask: mview,
        causal,
        keys,
        scale,
        isa,
        b,
        hq,
        hkv,
        l,
        s,
        e,
        ev,
        pack_budget: layout.pack_budget,
        heads_inner: layout.heads_inner,
        sinks: layout
            .extras
            .sinks
            .map(|sk| sk.iter().map(|&x| x * std::f32::consts::LOG2_E).collect()),
        softcap: layout.extras.softcap.map(|cap| cap * std::f32::consts::LOG2_E),
        #[cfg(target_arch = "x86_64")]
        amx: amx_plan(dtype, isa),
    };
    let dev = q.device();
    let mem_shape = if layout.heads_inner {
        (b, l, hq, ev)
    } else {
        out_shape
    };
    let out = match dtype {
        DType::F32 => Tensor::from_vec(driver::run::<f32>(&p), mem_shape, dev)?,
        DType::F16 => Tensor::from_vec(driver::run::<half::f16>(&p), mem_shape, dev)?,
        _ => Tensor::from_vec(driver::run::<half::bf16>(&p), mem_shape, dev)?,
    };
    if layout.heads_inner {
        out.transpose(1, 2)
    } else {
        Ok(out)
    }
}

/// Whether the AMX tile unit can run bf16/f16 inputs here (and the products of
/// projections with bf16 weights): AMX is available, the instruction set is AVX-512 (the
/// softmax and conversions use it) and `CANDLE_ATTENTION_AMX=0` is not set (read per
/// call).
pub fn amx_enabled() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        amx_plan(DType::F16, Isa::selected()).is_some()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether bf16 prefill runs its block products as bf16 pair products, on the AMX tile
/// unit ([`amx_enabled`]) or, without it, on AVX512-BF16 register tiles (`VDPBF16PS`,
/// unless `CANDLE_ATTENTION_AVX512BF16=0` is set; read per call). Otherwise bf16 is
/// converted to f32 while packing and runs the f32 kernels.
pub fn bf16_pairs_enabled() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        amx_plan(DType::BF16, Isa::selected()).is_some()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(target_arch = "x86_64")]
fn amx_plan(dtype: DType, isa: Isa) -> Option<amx::Plan> {
    let off = |var: &str| std::env::var(var).is_ok_and(|v| v == "0");
    if isa != Isa::Avx512 {
        return None;
    }
    let tiles = !off("CANDLE_ATTENTION_AMX") && amx::available();
    match dtype {
        DType::BF16 if tiles => Some(amx::PLAN_BF16),
        DType::F16 if tiles => Some(amx::PLAN_F16),
        DType::BF16 if !off("CANDLE_ATTENTION_AVX512BF16") && dpbf16::available() => {
            Some(amx::PLAN_BF16_AVX512)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle::Device;

    /// Several pack chunks (budget smaller than one group) must give identical results.
    #[test]
    fn pack_chunking_is_transparent() -> Result<()> {
        let dev = Device::Cpu;
        let q = Tensor::randn(0f32, 1.0, (2, 6, 100, 32), &dev)?;
        let k = Tensor::randn(0f32, 1.0, (2, 3, 150, 32), &dev)?;
        let v = Tensor::randn(0f32, 1.0, (2, 3, 150, 24), &dev)?;
        let c = Some(Causal {
            offset: 50,
            window: Some(70),
        });
        let budget = |pack_budget| CallPlan {
            heads_inner: false,
            pack_budget,
            extras: Extras::default(),
        };
        for isa in [Isa::Portable, Isa::detect()] {
            let a = sdpa_impl(&q, &k, &v, None, c, 0.2, isa, budget(driver::PACK_BUDGET_BYTES))?;
            let b = sdpa_impl(&q, &k, &v, None, c, 0.2, isa, budget(1))?;
            let d = (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            assert_eq!(d, 0.0);
        }
        Ok(())
    }

    /// The prefill path's packing runs pipelined with the blocks on however many threads
    /// there are (blocks waiting for their group's packs): one thread, two, or more than
    /// the machine has, over one pack chunk or several, must give identical results.
    #[test]
    fn thread_count_is_transparent() -> Result<()> {
        let dev = Device::Cpu;
        let q = Tensor::randn(0f32, 1.0, (2, 8, 300, 32), &dev)?;
        let k = Tensor::randn(0f32, 1.0, (2, 4, 333, 32), &dev)?;
        let v = Tensor::randn(0f32, 1.0, (2, 4, 333, 40), &dev)?;
        let one_group = 333usize.div_ceil(tiles::BK)
            * (pack::k_block_len(tiles::BK, 32) + pack::v_block_len(tiles::BK, 40))
            * 4;
        for c in [
            None,
            Some(Causal {
                offset: 33,
                window: None,
            }),
        ] {
            for pack_budget in [driver::PACK_BUDGET_BYTES, 3 * one_group, 1] {
                let plan = CallPlan {
                    heads_inner: false,
                    pack_budget,
                    extras: Extras::default(),
                };
                let run = |threads: usize| -> Result<Tensor> {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .map_err(candle::Error::wrap)?;
                    pool.install(|| sdpa_impl(&q, &k, &v, None, c, 0.2, Isa::detect(), plan))
                };
                let a = run(1)?;
                for threads in [2, 3, 8] {
                    let b = run(threads)?;
                    let d = (&a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
                    assert_eq!(
                        d,
                        0.0,
                        "{threads} threads, budget {pack_budget}, causal {}",
                        c.is_some()
                    );
                }
            }
        }
        Ok(())
    }

    /// A call too small to share among the threads runs on the calling thread alone; a
    /// larger one is shared. Both give the output of a call on one thread.
    #[test]
    fn small_calls_run_on_the_calling_thread() -> Result<()> {
        let dev = Device::Cpu;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .map_err(candle::Error::wrap)?;
        // (B, Hq, Hkv, L, S, E), and whether the call is small
        for ((b, hq, hkv, l, s, e), small) in [
            ((1, 8, 8, 1, 1, 64), true),
            ((2, 4, 2, 8, 8, 32), true),
            ((1, 8, 2, 1, 2048, 64), false),
            ((2, 8, 8, 64, 64, 64), false),
        ] {
            let q = Tensor::randn(0f32, 1.0, (b, hq, l, e), &dev)?;
            let k = Tensor::randn(0f32, 1.0, (b, hkv, s, e), &dev)?;
            let v = Tensor::randn(0f32, 1.0, (b, hkv, s, e), &dev)?;
            let call = || sdpa_impl(&q, &k, &v, None, None, 0.125, Isa::detect(), CallPlan::new(false));
            let (entered, got) = pool.install(|| {
                let before = par::inline_entries();
                let got = call();
                (par::inline_entries() - before, got)
            });
            assert_eq!(entered > 0, small, "{:?}", (b, hq, hkv, l, s, e));
            // On one thread every call runs inline. The result is the same up to rounding:
            // the long decode call splits its keys among the threads, and merges the parts.
            let one = par::inline(call)?;
            let d = (got? - one)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            assert!(d <= 1e-5, "{d}");
        }
        Ok(())
    }

    /// The `(B, L, Hq, Ev)` output layout holds the same values as the default one, on
    /// the prefill, decode and split-K paths, with GQA, a mask, fully masked rows
    /// (written as zeros), every dtype and every instruction set.
    #[test]
    fn heads_inner_layout_holds_the_same_values() -> Result<()> {
        let dev = Device::Cpu;
        // (b, hq, hkv, l, s, e, ev)
        let shapes = [
            (2, 6, 3, 100, 150, 32, 24),
            (1, 8, 2, 1, 2048, 64, 64),
            (3, 4, 4, 5, 77, 16, 40),
            (2, 12, 12, 128, 128, 64, 64),
        ];
        let isas: Vec<Isa> = [Isa::Portable, Isa::Avx2Fma, Isa::Avx512, Isa::Neon]
            .into_iter()
            .filter(|i| i.is_supported())
            .collect();
        for (b, hq, hkv, l, s, e, ev) in shapes {
            let q = Tensor::randn(0f32, 1.0, (b, hq, l, e), &dev)?;
            let k = Tensor::randn(0f32, 1.0, (b, hkv, s, e), &dev)?;
            let v = Tensor::randn(0f32, 1.0, (b, hkv, s, ev), &dev)?;
            // Batch 0 sees no key at all (rows of zeros); the others see a prefix.
            let keep: Vec<f32> = (0..b * s)
                .map(|x| {
                    if x / s == 0 || x % s >= s / 3 {
                        f32::NEG_INFINITY
                    } else {
                        0.0
                    }
                })
                .collect();
            let mask = Tensor::from_vec(keep, (b, 1, 1, s), &dev)?;
            for dt in [DType::F32, DType::F16, DType::BF16] {
                let (q, k, v) = (q.to_dtype(dt)?, k.to_dtype(dt)?, v.to_dtype(dt)?);
                for &isa in &isas {
                    for m in [None, Some(&mask)] {
                        let a = sdpa_impl(&q, &k, &v, m, None, 0.3, isa, CallPlan::new(false))?;
                        let t = sdpa_impl(&q, &k, &v, m, None, 0.3, isa, CallPlan::new(true))?;
                        assert_eq!(t.dims(), a.dims());
                        // The transposed view is contiguous: its memory is (B, L, Hq, Ev).
                        assert!(t.transpose(1, 2)?.is_contiguous());
                        let d = (a.to_dtype(DType::F32)? - t.to_dtype(DType::F32)?)?
                            .abs()?
                            .flatten_all()?
                            .max(0)?
                            .to_scalar::<f32>()?;
                        assert_eq!(
                            d,
                            0.0,
                            "{:?} {dt:?} {isa:?} mask {}",
                            (b, hq, hkv, l, s),
                            m.is_some()
                        );
                    }
                }
            }
        }
        Ok(())
    }
}
