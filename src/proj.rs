//! Linear projections computed in the accumulation dtype.
use candle::{Result, Tensor};
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
        let w = self.weight.to_dtype(cd)?;
        let mut y = x2.matmul(&w.t()?)?;
        if let Some(b) = &self.bias {
            y = y.broadcast_add(&b.to_dtype(cd)?)?;
        }
        let mut shape = dims.to_vec();
        if let Some(last) = shape.last_mut() {
            *last = out_dim;
        }
        y.reshape(shape)
    }
}
