//! Linear projections computed in the accumulation dtype.
use candle::{DType, Result, Tensor};
use candle_nn::VarBuilder;

use crate::sdpa::compute_dtype;

/// `y = x · Wᵀ + b`, like `torch.nn.Linear`, computed in f32 for f16/bf16
/// inputs (f64 for f64) and returned in that accumulation dtype.
///
/// - `weight`: `(out, in)`, `bias`: `(out)`.
/// - `x`: `(…, in)` → `(…, out)`.
///
/// On an x86-64 CPU with AVX-512 or AVX2+FMA, f32 products run on this crate's kernel, and from its second
/// call on a `Proj` keeps its weight packed for it (`4 · out · in` bytes, shared by
/// clones) while all kept packs fit `CANDLE_ATTENTION_PACK_CACHE_MB` (256 MiB by default;
/// 0 keeps none). On a CPU with AMX, a bf16 weight's products run on the tile unit
/// instead, against a pack of `2 · out · in` bytes: x is split into bf16 parts that sum
/// to it exactly, so every product is exact and only the f32 sums round, as in the f32
/// product (in another order; `CANDLE_ATTENTION_AMX=0` turns this off). Products of fewer rows than the kernel's register tile (14 rows with
/// AVX-512, 6 with AVX2), such as decode steps, make the pack on their first call and
/// run against it, with the threads splitting the output columns, or, with no room in
/// the pack cache, by dot products against the weight read in place; a single row
/// against an f16/bf16 weight always reads it in place. So a projection returns the same
/// bits for the same input on every call. Inputs or weights that record gradients take
/// candle's `matmul`.
#[derive(Clone, Debug)]
pub struct Proj {
    weight: Tensor,
    bias: Option<Tensor>,
    /// The weight packed for the CPU kernel, made on the second call that takes it (the
    /// first, for fewer rows than a register tile) and shared by clones (`None` inside:
    /// the pack cache's budget was full then).
    #[cfg(target_arch = "x86_64")]
    packed: std::sync::Arc<PackCache>,
}

/// [`Proj`]'s packed weight and whether a product has already run without it.
#[cfg(target_arch = "x86_64")]
#[derive(Debug, Default)]
struct PackCache {
    used: std::sync::atomic::AtomicBool,
    packed: std::sync::OnceLock<Option<crate::kernels::cpu::linear::PackedWeight>>,
}

impl Proj {
    /// A projection from its tensors.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self {
            weight,
            bias,
            #[cfg(target_arch = "x86_64")]
            packed: Default::default(),
        }
    }

    /// Loads `<prefix>.weight` `(out, in)` and, with `bias`, `<prefix>.bias` `(out)`:
    /// the key names of a `torch.nn.Linear`.
    pub fn load_linear(in_dim: usize, out_dim: usize, bias: bool, vb: VarBuilder) -> Result<Self> {
        if out_dim.checked_mul(in_dim).is_none() {
            candle::bail!(
                "linear {}: a ({out_dim}, {in_dim}) weight has more elements than usize holds",
                vb.prefix()
            )
        }
        let weight = vb.get((out_dim, in_dim), "weight")?;
        let bias = if bias {
            Some(vb.get(out_dim, "bias")?)
        } else {
            None
        };
        Ok(Self::new(weight, bias))
    }

    /// The weight, `(out, in)`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias, `(out)`.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// `x · Wᵀ + b` for `x (rows, in)` and `b (out)` in the accumulation dtype `cd`: for
    /// f32 `x` on a CPU with AVX-512 or AVX2+FMA, the fused kernel's register-tiled product
    /// (`kernels::cpu`) against the weight packed into f32 panels (an f16/bf16 weight is
    /// converted there), or, for a bf16 weight on a CPU with AMX, the tile unit's product
    /// against the weight packed as bf16 tiles (`kernels::cpu::amx_linear`); everywhere
    /// else candle's `matmul` on the weight converted to `cd`. `tests/proj.rs` checks that
    /// they agree.
    ///
    /// The kernel packs the weight for each product into a per-thread buffer. From the
    /// second product on, the projection keeps its pack (`4 · out · in` bytes; `2 · out ·
    /// in` as the tile unit's bf16 pack), so later
    /// calls skip that step (8% of a 1024×768×768 product), as long as all packs kept in
    /// the process fit the budget `CANDLE_ATTENTION_PACK_CACHE_MB` (256 MiB by default;
    /// 0 keeps none). A weight used once with a register tile of rows or more is never
    /// kept. Fewer rows than a register tile run against the kept pack, made on the
    /// first such call, or read the weight in place (with no room for a pack, and for
    /// one row against an f16/bf16 weight). Until 2026-12-05 their first call read the
    /// weight in place and later ones used the pack: the two products sum in different
    /// orders, so a layer's results moved by 1–2 f32 ulps from its first call to its
    /// second.
    fn matmul_bias(&self, x: &Tensor, b: Option<&Tensor>, cd: DType) -> Result<Tensor> {
        let w = &self.weight;
        #[cfg(target_arch = "x86_64")]
        {
            use crate::kernels::cpu::linear::{
                applies, applies_in_place, applies_packed, linear, linear_in_place, linear_packed,
            };
            if applies(x, w) {
                return match self.kept_pack(false)? {
                    Some(p) => linear_packed(x, p, b),
                    None => linear(x, w, b),
                };
            }
            // Fewer rows than a register tile (a decode step): against the kept pack, or
            // without one (no room left in the pack cache) with the weight read in
            // place, since packing on every call would read it twice. A
            // single row against an f16/bf16 weight reads it in place even with a pack:
            // half the bytes of the f32 pack (on the Zen 4 VM, 1×4096×4096 with a bf16
            // weight: 0.86 ms in place, 1.47–1.51 ms on the pack; with 4 rows the pack
            // was faster, 1.46–1.54 against 2.23–2.31 ms).
            if applies_packed(x, w) {
                let in_place = applies_in_place(x, w);
                let half_row = in_place && x.dim(0)? == 1 && w.dtype() != DType::F32;
                if !half_row {
                    // The pack is made on the first such call, so that every call of
                    // these rows runs the same product and gives the same result.
                    if let Some(p) = self.kept_pack(true)? {
                        return linear_packed(x, p, b);
                    }
                }
                if in_place {
                    return linear_in_place(x, w, b);
                }
            }
        }
        Self::matmul_bias_reference(x, &w.to_dtype(cd)?, b)
    }

    /// The weight's kept pack: made on the second call that asks, or on the first with
    /// `now` (see [`Proj::matmul_bias`]); `None` before, or when the pack cache's budget
    /// was full when it was to be made.
    #[cfg(target_arch = "x86_64")]
    fn kept_pack(&self, now: bool) -> Result<Option<&crate::kernels::cpu::linear::PackedWeight>> {
        use std::sync::atomic::Ordering;
        let cache = &self.packed;
        if cache.packed.get().is_none() && (cache.used.swap(true, Ordering::Relaxed) || now) {
            let made = crate::kernels::cpu::linear::PackedWeight::cached(&self.weight)?;
            // A racing thread's pack may win; the loser's is dropped.
            let _ = cache.packed.set(made);
        }
        Ok(match cache.packed.get() {
            Some(Some(p)) => Some(p),
            _ => None,
        })
    }

    /// [`Proj::forward`] of `x (…, in)` into `dst` (`rows · out` f32, row-major), on this
    /// crate's CPU kernel: only where [`Proj::on_kernel`] holds for `x` (an error
    /// otherwise).
    pub(crate) fn forward_into(&self, x: &Tensor, dst: &mut [std::mem::MaybeUninit<f32>]) -> Result<()> {
        let (rows, in_dim) = self.check_input(x)?;
        if !self.on_kernel(x) {
            candle::bail!(
                "projection into a buffer needs the CPU kernel, which does not take x {:?} {:?} for weight {:?}",
                x.dims(),
                x.dtype(),
                self.weight.dims()
            )
        }
        #[cfg(target_arch = "x86_64")]
        {
            use crate::kernels::cpu::linear::{linear_into, linear_packed_into};
            let x2 = x.reshape((rows, in_dim))?;
            let bias = self.bias.as_ref().map(|b| b.to_dtype(DType::F32)).transpose()?;
            match self.kept_pack(false)? {
                Some(p) => linear_packed_into(&x2, p, bias.as_ref(), dst),
                None => linear_into(&x2, &self.weight, bias.as_ref(), dst),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (rows, in_dim, dst);
            unreachable!("on_kernel is false off x86-64")
        }
    }

    /// Checks `x (…, in)` and the bias against the weight; returns `(rows, in)`.
    fn check_input(&self, x: &Tensor) -> Result<(usize, usize)> {
        let (out_dim, in_dim) = self.weight.dims2()?;
        let dims = x.dims();
        if dims.last() != Some(&in_dim) {
            candle::bail!(
                "projection expects input (…, {in_dim}) for weight {:?}, got {dims:?}",
                self.weight.dims()
            )
        }
        if let Some(b) = &self.bias {
            if b.dims() != [out_dim] {
                candle::bail!(
                    "projection bias {:?} does not match weight {:?} (expected ({out_dim},))",
                    b.dims(),
                    self.weight.dims()
                )
            }
        }
        if !x.dtype().is_float() {
            candle::bail!(
                "projection input must be a float tensor, got {dims:?} {:?}",
                x.dtype()
            )
        }
        // The product of the leading dims (not elem_count / in, which is 0 when in = 0).
        Ok((dims[..dims.len() - 1].iter().product(), in_dim))
    }

    /// Whether [`Proj::forward`] of `x (…, in)` runs on this crate's CPU kernel (f32 `x`
    /// on a CPU with AVX-512 or AVX2+FMA, at least a register tile of rows, no gradients),
    /// which runs sequentially inside `kernels::cpu::par::inline`.
    pub(crate) fn on_kernel(&self, x: &Tensor) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            crate::kernels::cpu::linear::applies_rows(x, &self.weight)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = x;
            false
        }
    }

    /// [`Proj::forward`]'s product on candle's `matmul` only (the reference path):
    /// `x (rows, in) · w (out, in)ᵀ + b (out)`.
    pub fn matmul_bias_reference(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
        let y = x.matmul(&w.t()?)?;
        match b {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }

    /// `(…, in)` → `(…, out)` in the accumulation dtype of `x`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (rows, in_dim) = self.check_input(x)?;
        let out_dim = self.weight.dims2()?.0;
        let dims = x.dims();
        let cd = compute_dtype(x.dtype());
        let x2 = crate::cast::to_dtype(x, cd)?.reshape((rows, in_dim))?;
        let bias = self.bias.as_ref().map(|b| b.to_dtype(cd)).transpose()?;
        let y = self.matmul_bias(&x2, bias.as_ref(), cd)?;
        let mut shape = dims.to_vec();
        if let Some(last) = shape.last_mut() {
            *last = out_dim;
        }
        y.reshape(shape)
    }
}
