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
/// product (in another order; `CANDLE_ATTENTION_AMX=0` turns this off). So do an f16
/// weight's products with f16/bf16 inputs of 16 rows or more (a pack of `4 · out · in`
/// bytes, the weight as two bf16 parts that sum to it), without the products of the two
/// low parts, so each output is within `2⁻¹⁶·Σ|x·w|` of the exact sum (plus the f32
/// sums' rounding), where f16's own rounding is `2⁻¹¹`. Without AMX, on a CPU with
/// AVX512-BF16 (AMD Zen 4 and later), a bf16 weight's products with f16/bf16 inputs run
/// on `VDPBF16PS` register tiles against the same bf16 pack, for any number of rows
/// (`CANDLE_ATTENTION_AVX512BF16=0` turns this off). Products of fewer rows than the
/// kernel's register tile (14 rows with AVX-512, 6 with AVX2), such as decode steps,
/// make the pack on their first call and run against it, with the threads splitting the
/// output columns, or, with no room in the pack cache, by dot products against the
/// weight read in place; a single row against an f16/bf16 weight reads it in place even
/// with a pack, but for the `VDPBF16PS` products' pack. So a projection returns the same
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
    /// For weights whose calls take two kinds of pack (`linear::packs_by_call`: f16 on
    /// the AMX tile unit), the f32 panels for the calls that the tile unit does not take.
    panels: std::sync::OnceLock<Option<crate::kernels::cpu::linear::PackedWeight>>,
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
    /// (without AMX, with AVX512-BF16 and an `x` of f16/bf16 values: `VDPBF16PS` register
    /// tiles) against the weight packed as bf16 tiles (`kernels::cpu::amx_linear`); everywhere
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
    ///
    /// `half_x`: x holds f16/bf16 values (the input before its cast to `cd`); an f16
    /// weight's products on the tile unit then skip `lo · lo` (see [`Proj`]). The
    /// result is returned in `out`, rounded from `cd` as `cast::to_dtype` rounds (the
    /// tile unit's products write bf16 rows themselves, with the same bits).
    fn matmul_bias(
        &self,
        x: &Tensor,
        b: Option<&Tensor>,
        (cd, out): (DType, DType),
        half_x: bool,
    ) -> Result<Tensor> {
        let w = &self.weight;
        #[cfg(target_arch = "x86_64")]
        {
            use crate::kernels::cpu::linear::{
                applies, applies_in_place, applies_packed, linear, linear_in_place, linear_packed,
                one_row_on_pack,
            };
            if applies(x, w) {
                return match self.kept_pack(false, x.dim(0)?, half_x)? {
                    Some(p) => linear_packed(x, p, b, half_x, out),
                    None => linear(x, w, b, half_x, out),
                };
            }
            // Fewer rows than a register tile (a decode step): against the kept pack, or
            // without one (no room left in the pack cache) with the weight read in
            // place, since packing on every call would read it twice. A
            // single row against an f16/bf16 weight reads it in place even with a pack:
            // half the bytes of the f32 pack (on the Zen 4 VM, 1×4096×4096 with a bf16
            // weight: 0.86 ms in place, 1.47–1.51 ms on the pack; with 4 rows the pack
            // was faster, 1.46–1.54 against 2.23–2.31 ms), unless the pack is the bf16
            // one of AVX512-BF16 register tiles (`one_row_on_pack`).
            if applies_packed(x, w) {
                let in_place = applies_in_place(x, w);
                let half_row = in_place
                    && x.dim(0)? == 1
                    && w.dtype() != DType::F32
                    && !one_row_on_pack(w.dtype(), half_x);
                if !half_row {
                    // The pack is made on the first such call, so that every call of
                    // these rows runs the same product and gives the same result.
                    if let Some(p) = self.kept_pack(true, x.dim(0)?, half_x)? {
                        return linear_packed(x, p, b, half_x, out);
                    }
                }
                if in_place {
                    // bf16 rows (see `Proj::forward_to`) are read as f32 here.
                    let x = crate::cast::to_dtype(x, cd)?;
                    return crate::cast::to_dtype(&linear_in_place(&x, w, b)?, out);
                }
            }
        }
        // Candle's `matmul` multiplies every product in `cd`.
        #[cfg(not(target_arch = "x86_64"))]
        let _ = half_x;
        let x = crate::cast::to_dtype(x, cd)?;
        crate::cast::to_dtype(&Self::matmul_bias_reference(&x, &w.to_dtype(cd)?, b)?, out)
    }

    /// The weight's kept pack for products of `rows` rows of half-precision values
    /// (`half_x`) or not: made on the second call that asks, or on the first with `now`
    /// (see [`Proj::matmul_bias`]); `None` before, or when the pack cache's budget was
    /// full when it was to be made.
    ///
    /// An f16 weight on a CPU with AMX has two (`linear::packs_by_call`): the tile
    /// unit's for half-precision inputs of 16 rows and more, f32 panels for the rest.
    /// Each is made when a call first needs it, so a layer that only ever runs one kind
    /// of call keeps one pack, and every call runs the product that its rows and dtype
    /// select, whatever calls came before.
    #[cfg(target_arch = "x86_64")]
    fn kept_pack(
        &self,
        now: bool,
        rows: usize,
        half_x: bool,
    ) -> Result<Option<&crate::kernels::cpu::linear::PackedWeight>> {
        use crate::kernels::cpu::linear::{on_tiles, packs_by_call, PackedWeight};
        use std::sync::atomic::Ordering;
        let (cache, dt) = (&self.packed, self.weight.dtype());
        let slot = if packs_by_call(dt) && !on_tiles(dt, rows, half_x) {
            &cache.panels
        } else {
            &cache.packed
        };
        if slot.get().is_none() && (cache.used.swap(true, Ordering::Relaxed) || now) {
            let made = PackedWeight::cached(&self.weight, rows, half_x)?;
            // A racing thread's pack may win; the loser's is dropped.
            let _ = slot.set(made);
        }
        Ok(match slot.get() {
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
            // `on_kernel` holds: x is f32.
            match self.kept_pack(false, rows, false)? {
                Some(p) => linear_packed_into(&x2, p, bias.as_ref(), false, dst),
                None => linear_into(&x2, &self.weight, bias.as_ref(), false, dst),
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
        let (out_dim, in_dim) = self.weight.dims2().map_err(|_| {
            candle::Error::Msg(format!(
                "projection weight must be (out, in), got {:?}",
                self.weight.dims()
            ))
        })?;
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
            // The kernel also takes bf16 rows for the pairs products, which `forward_into`
            // does not run.
            x.dtype() == DType::F32 && crate::kernels::cpu::linear::applies_rows(x, &self.weight)
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
        self.forward_to(x, compute_dtype(x.dtype()))
    }

    /// [`Proj::forward`] rounded to `dtype`: the bits of `cast::to_dtype(&forward(x)?,
    /// dtype)`, as a half-precision layer rounds its projections. On the AMX tile unit a
    /// product rounded to bf16 writes the bf16 rows itself, without an f32 result to
    /// read back.
    pub(crate) fn forward_to(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        let (rows, in_dim) = self.check_input(x)?;
        let out_dim = self.weight.dims2()?.0;
        let dims = x.dims();
        let cd = compute_dtype(x.dtype());
        let half_x = matches!(x.dtype(), DType::F16 | DType::BF16);
        let x2 = x.reshape((rows, in_dim))?;
        // bf16 rows go to the pairs products as they are, where those take them: no f32
        // copy of x is made (`kernels::cpu::amx_linear::Xs`).
        #[cfg(target_arch = "x86_64")]
        let direct =
            x2.dtype() == DType::BF16 && crate::kernels::cpu::linear::applies_packed(&x2, &self.weight);
        #[cfg(not(target_arch = "x86_64"))]
        let direct = false;
        let x2 = if direct {
            x2
        } else {
            crate::cast::to_dtype(&x2, cd)?
        };
        let bias = self.bias.as_ref().map(|b| b.to_dtype(cd)).transpose()?;
        let y = self.matmul_bias(&x2, bias.as_ref(), (cd, dtype), half_x)?;
        let mut shape = dims.to_vec();
        if let Some(last) = shape.last_mut() {
            *last = out_dim;
        }
        y.reshape(shape)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `forward_to` gives the bits of `forward` cast by candle, on the first call (the
    /// weight packed for the call) and on later ones (the kept pack), for bf16 and f16
    /// weights and outputs, inputs in f32 and in the weight's dtype, and rows below and
    /// above a tile (on AMX, bf16 rows written by the tile unit itself).
    #[test]
    fn rounded_projections_are_the_cast_of_the_f32_projection() -> Result<()> {
        let dev = candle::Device::Cpu;
        for wdt in [DType::BF16, DType::F16] {
            let w = Tensor::randn(0f32, 1.0, (100, 96), &dev)?.to_dtype(wdt)?;
            let b = Tensor::randn(0f32, 1.0, 100, &dev)?.to_dtype(wdt)?;
            for xdt in [DType::F32, wdt] {
                for rows in [4, 40] {
                    let x = Tensor::randn(0f32, 2.0, (2, rows, 96), &dev)?.to_dtype(xdt)?;
                    for out in [DType::BF16, DType::F16] {
                        let (p, q) = (
                            Proj::new(w.clone(), Some(b.clone())),
                            Proj::new(w.clone(), Some(b.clone())),
                        );
                        for call in 1..=3 {
                            let got = p.forward_to(&x, out)?;
                            let want = q.forward(&x)?.to_dtype(out)?;
                            assert_eq!((got.dtype(), got.dims()), (out, want.dims()));
                            let bits = |t: &Tensor| -> Result<Vec<u32>> {
                                let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                                Ok(v.iter().map(|v| v.to_bits()).collect())
                            };
                            assert!(
                                bits(&got)? == bits(&want)?,
                                "weight {wdt:?}, x {xdt:?}, {rows} rows, rounded to {out:?}: call {call}"
                            );
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// An f16 weight against f16 inputs of 16 rows or more skips the products of the two
    /// low bf16 parts where the AMX tile unit runs it, and nowhere else: not against an
    /// f32 input holding the same values, and not for fewer rows. The values make the
    /// skipped terms add up to `2⁻¹⁰` while the sum stays near 0.5 (so that the f32
    /// sums' rounding, below `1e-5`, cannot hide them): `x = 1 + 3e` and, in turn, `w =
    /// 1 + 3e` and `w = −(1 + e)`, with `e = 2⁻⁹`; `1 + 3e` is `(1 + 4e) − e` in bf16
    /// parts and `1 + e` is `1 + e`, so every `lo·lo` is `+e²`.
    #[test]
    fn only_half_inputs_on_the_tile_unit_skip_the_low_products() -> Result<()> {
        let dev = candle::Device::Cpu;
        let e = 2f64.powi(-9);
        let inp = 256;
        let w: Vec<f32> = (0..16 * inp)
            .map(|i| if i % 2 == 0 { 1.0 + 3.0 * e } else { -(1.0 + e) } as f32)
            .collect();
        let w = Tensor::from_vec(w, (16, inp), &dev)?.to_dtype(DType::F16)?;
        let exact = (inp / 2) as f64 * ((1.0 + 3.0 * e) * (1.0 + 3.0 * e) - (1.0 + 3.0 * e) * (1.0 + e));
        let skipped = exact - inp as f64 * e * e;
        for rows in [4, 16, 40] {
            let x = Tensor::full((1.0 + 3.0 * e) as f32, (rows, inp), &dev)?;
            for xdt in [DType::F32, DType::F16] {
                let p = Proj::new(w.clone(), None);
                #[cfg(target_arch = "x86_64")]
                let tiles =
                    xdt == DType::F16 && crate::kernels::cpu::linear::on_tiles(DType::F16, rows, true);
                #[cfg(not(target_arch = "x86_64"))]
                let tiles = false;
                let want = if tiles { skipped } else { exact };
                for call in ["first", "second"] {
                    let got = p.forward(&x.to_dtype(xdt)?)?.flatten_all()?.to_vec1::<f32>()?;
                    for g in got {
                        assert!(
                            (g as f64 - want).abs() < 1e-5,
                            "{rows} rows, x {xdt:?}, tiles {tiles} ({call} call): {g} vs {want} (exact {exact})"
                        );
                    }
                }
            }
        }
        Ok(())
    }
}
