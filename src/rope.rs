//! Rotary position embeddings (RoPE), both styles, partial rotary dims and the
//! frequency scalings used by Hugging Face models (linear, Llama-3, YaRN).
//!
//! The inverse frequencies follow `transformers.modeling_rope_utils` formula for
//! formula, in f64. `cos`/`sin` are computed in f64 on CPU (f32 on other devices) and
//! cast to the activations' dtype. (Hugging Face computes them in f32 even for f64
//! models; the fixtures' oracle computes them in f64.)
use candle::{DType, Device, Result, Tensor, D};

/// How the rotated dims are paired.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Dim `i` pairs with `i + rotary_dim/2` (`rotate_half`: Llama, GPT-NeoX, Qwen, Gemma, …).
    HalfSplit,
    /// Dim `2i` pairs with `2i + 1` (GPT-J, the original RoFormer).
    Interleaved,
}

/// Frequency scaling (`rope_scaling` / `rope_parameters` in a Hugging Face config).
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    Default,
    /// Position interpolation: every frequency divided by `factor`.
    Linear {
        /// Divisor of every frequency.
        factor: f64,
    },
    /// Llama 3.1: low frequencies divided by `factor`, high ones kept, a smooth ramp between.
    Llama3 {
        /// Divisor of the low frequencies.
        factor: f64,
        /// Wavelengths above `original / low_freq_factor` are divided by `factor`.
        low_freq_factor: f64,
        /// Wavelengths below `original / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// The pre-training context length.
        original_max_position_embeddings: f64,
    },
    /// YaRN (gpt-oss, DeepSeek, Qwen long-context).
    Yarn {
        /// Context extension factor.
        factor: f64,
        /// The pre-training context length.
        original_max_position_embeddings: f64,
        /// Rotations above which dims extrapolate (default 32).
        beta_fast: f64,
        /// Rotations below which dims interpolate (default 1).
        beta_slow: f64,
        /// Explicit cos/sin scaling; `None` derives it from `factor`, `mscale`, `mscale_all_dim`.
        attention_factor: Option<f64>,
        /// DeepSeek's `mscale`.
        mscale: Option<f64>,
        /// DeepSeek's `mscale_all_dim`.
        mscale_all_dim: Option<f64>,
        /// Round the correction range to whole dims (Hugging Face's default: true).
        truncate: bool,
    },
}

/// Configuration of a [`RotaryEmbedding`].
#[derive(Clone, Debug, PartialEq)]
pub struct RopeConfig {
    /// Size of one head.
    pub head_dim: usize,
    /// Leading dims of each head that rotate (`head_dim × partial_rotary_factor`); the rest pass through.
    pub rotary_dim: usize,
    /// `rope_theta`, the base wavelength.
    pub theta: f64,
    /// How rotated dims are paired.
    pub style: RopeStyle,
    /// Frequency scaling.
    pub scaling: RopeScaling,
}

/// Rotary embedding with precomputed inverse frequencies.
#[derive(Clone, Debug)]
pub struct RotaryEmbedding {
    inv_freq: Vec<f64>,
    attention_scaling: f64,
    rotary_dim: usize,
    head_dim: usize,
    style: RopeStyle,
}

impl RotaryEmbedding {
    /// Computes the inverse frequencies for `cfg`.
    pub fn new(cfg: &RopeConfig) -> Result<Self> {
        let (dim, hd) = (cfg.rotary_dim, cfg.head_dim);
        if dim == 0 || dim % 2 != 0 || dim > hd {
            candle::bail!("rope: rotary_dim must be even, positive and at most head_dim ({hd}), got {dim}")
        }
        if !cfg.theta.is_finite() || cfg.theta <= 1.0 {
            candle::bail!("rope: rope_theta must be greater than 1, got {}", cfg.theta)
        }
        let base: Vec<f64> = (0..dim / 2)
            .map(|i| 1.0 / cfg.theta.powf((2 * i) as f64 / dim as f64))
            .collect();
        let positive = |name: &str, x: f64| -> Result<()> {
            if !x.is_finite() || x <= 0.0 {
                candle::bail!("rope: {name} must be positive and finite, got {x}")
            }
            Ok(())
        };
        let (inv_freq, attention_scaling) = match &cfg.scaling {
            RopeScaling::Default => (base, 1.0),
            RopeScaling::Linear { factor } => {
                positive("factor", *factor)?;
                (base.iter().map(|f| f / factor).collect(), 1.0)
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                positive("factor", *factor)?;
                positive("original_max_position_embeddings", *old)?;
                positive("low_freq_factor", *low_freq_factor)?;
                positive("high_freq_factor", *high_freq_factor)?;
                if high_freq_factor <= low_freq_factor {
                    candle::bail!(
                        "rope: llama3 needs high_freq_factor > low_freq_factor, got {high_freq_factor} and {low_freq_factor}"
                    )
                }
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                let f = base
                    .iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        let scaled = if wavelen > low_wavelen { f / factor } else { f };
                        let medium = (high_wavelen..=low_wavelen).contains(&wavelen);
                        if medium {
                            let smooth =
                                (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * scaled / factor + smooth * scaled
                        } else {
                            scaled
                        }
                    })
                    .collect();
                (f, 1.0)
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: old,
                beta_fast,
                beta_slow,
                attention_factor,
                mscale,
                mscale_all_dim,
                truncate,
            } => {
                positive("factor", *factor)?;
                positive("original_max_position_embeddings", *old)?;
                positive("beta_fast", *beta_fast)?;
                positive("beta_slow", *beta_slow)?;
                if let Some(a) = attention_factor {
                    positive("attention_factor", *a)?;
                }
                for (name, m) in [("mscale", mscale), ("mscale_all_dim", mscale_all_dim)] {
                    if let Some(m) = m.filter(|m| !m.is_finite()) {
                        candle::bail!("rope: {name} must be finite, got {m}")
                    }
                }
                let get_mscale = |scale: f64, m: f64| {
                    if scale <= 1.0 {
                        1.0
                    } else {
                        0.1 * m * scale.ln() + 1.0
                    }
                };
                let att = match (attention_factor, mscale, mscale_all_dim) {
                    (Some(a), _, _) => *a,
                    (None, Some(m), Some(ma)) if *m != 0.0 && *ma != 0.0 => {
                        get_mscale(*factor, *m) / get_mscale(*factor, *ma)
                    }
                    _ => get_mscale(*factor, 1.0),
                };
                let d = dim as f64;
                let correction_dim =
                    |rot: f64| (d * (old / (rot * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * cfg.theta.ln());
                let (mut low, mut high) = (correction_dim(*beta_fast), correction_dim(*beta_slow));
                if *truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0);
                let mut high = high.min(d - 1.0);
                if low == high {
                    high += 0.001;
                }
                let f = base
                    .iter()
                    .enumerate()
                    .map(|(i, &extrap)| {
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrap_factor = 1.0 - ramp;
                        let interp = extrap / factor;
                        interp * (1.0 - extrap_factor) + extrap * extrap_factor
                    })
                    .collect();
                (f, att)
            }
        };
        if inv_freq.iter().any(|f: &f64| !f.is_finite()) || !attention_scaling.is_finite() {
            candle::bail!(
                "rope: {:?} gives non-finite frequencies or scaling (inv_freq {inv_freq:?}, scaling {attention_scaling})",
                cfg.scaling
            )
        }
        Ok(Self {
            inv_freq,
            attention_scaling,
            rotary_dim: dim,
            head_dim: hd,
            style: cfg.style,
        })
    }

    /// The inverse frequencies, `rotary_dim / 2` of them.
    pub fn inv_freq(&self) -> &[f64] {
        &self.inv_freq
    }

    /// The factor applied to `cos` and `sin` (YaRN's attention factor; 1 otherwise).
    pub fn attention_scaling(&self) -> f64 {
        self.attention_scaling
    }

    /// `cos`, `sin` for integer `position_ids` `(B, L)`: each `(B, L, rotary_dim/2)` in `dtype`.
    /// Negative positions are an error.
    pub fn cos_sin(&self, position_ids: &Tensor, dtype: DType) -> Result<(Tensor, Tensor)> {
        let (b, l) = position_ids.dims2().map_err(|_| {
            candle::Error::Msg(format!(
                "rope: position_ids must be (B, L), got {:?}",
                position_ids.dims()
            ))
        })?;
        if position_ids.dtype().is_float() {
            candle::bail!(
                "rope: position_ids must be integers, got {:?}",
                position_ids.dtype()
            )
        }
        if !dtype.is_float() {
            candle::bail!("rope: cos and sin must be a float dtype, got {dtype:?}")
        }
        let dev = position_ids.device();
        let half = self.inv_freq.len();
        if b * l == 0 {
            let z = Tensor::zeros((b, l, half), dtype, dev)?;
            return Ok((z.clone(), z));
        }
        let min = position_ids
            .to_dtype(DType::I64)?
            .flatten_all()?
            .min(0)?
            .to_scalar::<i64>()?;
        if min < 0 {
            candle::bail!("rope: positions out of range: position_ids contains {min}")
        }
        self.cos_sin_unchecked(position_ids, dtype)
    }

    /// [`Self::cos_sin`] without the range check, for callers that validated the positions.
    pub(crate) fn cos_sin_unchecked(&self, position_ids: &Tensor, dtype: DType) -> Result<(Tensor, Tensor)> {
        let (b, l) = position_ids.dims2()?;
        let dev = position_ids.device();
        let half = self.inv_freq.len();
        // f64 on CPU; f32 elsewhere (Metal has no f64).
        let cd = if dev.is_cpu() || dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let pos = position_ids.to_dtype(cd)?.reshape((b, l, 1))?;
        let inv = Tensor::from_slice(&self.inv_freq, (1, 1, half), &Device::Cpu)?
            .to_dtype(cd)?
            .to_device(dev)?;
        let freqs = pos.broadcast_mul(&inv)?;
        let s = self.attention_scaling;
        let cos = (freqs.cos()? * s)?.to_dtype(dtype)?.contiguous()?;
        let sin = (freqs.sin()? * s)?.to_dtype(dtype)?.contiguous()?;
        Ok((cos, sin))
    }

    /// Rotates `x` `(B, H, L, head_dim)` with `cos`/`sin` `(B, L, rotary_dim/2)` from [`Self::cos_sin`].
    pub fn apply(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let (b, _, l, d) = x.dims4()?;
        if d != self.head_dim {
            candle::bail!(
                "rope: expected heads of size {}, got x {:?}",
                self.head_dim,
                x.dims()
            )
        }
        let want = [b, l, self.rotary_dim / 2];
        if cos.dims() != want || sin.dims() != want {
            candle::bail!(
                "rope: cos and sin must be {want:?} (B, L, rotary_dim/2) for x {:?}, got cos {:?}, sin {:?}",
                x.dims(),
                cos.dims(),
                sin.dims()
            )
        }
        if x.elem_count() == 0 {
            // Nothing to rotate (candle's rope kernels index out of bounds on empty inputs).
            return Tensor::zeros(x.shape(), x.dtype(), x.device());
        }
        let rot = x.narrow(D::Minus1, 0, self.rotary_dim)?.contiguous()?;
        let rotated = match self.style {
            RopeStyle::HalfSplit => candle_nn::rotary_emb::rope(&rot, cos, sin)?,
            RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(&rot, cos, sin)?,
        };
        if self.rotary_dim == d {
            Ok(rotated)
        } else {
            let pass = x.narrow(D::Minus1, self.rotary_dim, d - self.rotary_dim)?;
            Tensor::cat(&[&rotated, &pass], D::Minus1)
        }
    }
}
