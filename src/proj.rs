//! Linear projections computed in the accumulation dtype.
use candle::{DType, Result, Tensor};
use candle_nn::VarBuilder;

use crate::sdpa::compute_dtype;

/// `y = x · Wᵀ + b`, like `torch.nn.Linear`, computed in f32 for f16/bf16
/// inputs (f64 for f64) and returned in that accumulation dtype.
///
/// - `weight`: `(out, in)`, `bias`: `(out)`.
/// - `x`: `(…, in)` → `(…, out)`.
#[derive(Clone, Debug)]
pub struct Proj {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Proj {
    /// A projection from its tensors.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self { weight, bias }
    }

    /// Loads `<prefix>.weight` `(out, in)` and, with `bias`, `<prefix>.bias` `(out)`:
    /// the key names of a `torch.nn.Linear`.
    pub fn load_linear(in_dim: usize, out_dim: usize, bias: bool, vb: VarBuilder) -> Result<Self> {
        let weight = vb.get((out_dim, in_dim), "weight")?;
        let bias = if bias {
            Some(vb.get(out_dim, "bias")?)
        } else {
            None
        };
        Ok(Self { weight, bias })
    }

    /// The weight, `(out, in)`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias, `(out)`.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// `x · Wᵀ + b` for `x (rows, in)` and `b (out)` in the accumulation dtype `cd`, and
    /// `w (out, in)` as stored: for f32 `x` on a CPU with AVX-512, the fused kernel's
    /// register-tiled product (`kernels::cpu`), which converts an f16/bf16 `w` while
    /// packing it; everywhere else candle's `matmul` on `w` converted to `cd`.
    /// `tests/proj.rs` checks that the two agree.
    fn matmul_bias(x: &Tensor, w: &Tensor, b: Option<&Tensor>, cd: DType) -> Result<Tensor> {
        #[cfg(target_arch = "x86_64")]
        if crate::kernels::cpu::linear::applies(x, w) {
            return crate::kernels::cpu::linear::linear(x, w, b);
        }
        Self::matmul_bias_reference(x, &w.to_dtype(cd)?, b)
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
        let (out_dim, in_dim) = self.weight.dims2()?;
        let dims = x.dims();
        if dims.last() != Some(&in_dim) {
            candle::bail!(
                "projection expects input (…, {in_dim}) for weight {:?}, got {dims:?}",
                self.weight.dims()
            )
        }
        let cd = compute_dtype(x.dtype());
        let rows = x.elem_count() / in_dim.max(1);
        let x2 = x.to_dtype(cd)?.reshape((rows, in_dim))?;
        let bias = self.bias.as_ref().map(|b| b.to_dtype(cd)).transpose()?;
        let y = Self::matmul_bias(&x2, &self.weight, bias.as_ref(), cd)?;
        let mut shape = dims.to_vec();
        if let Some(last) = shape.last_mut() {
            *last = out_dim;
        }
        y.reshape(shape)
    }
}
