//! Rotary position embeddings (RoPE), both styles, partial rotary dims and the
//! frequency scalings used by Hugging Face models (linear, Llama-3, YaRN, LongRoPE,
//! dynamic NTK).
//!
//! The inverse frequencies follow `transformers.modeling_rope_utils` formula for
//! formula, in f64. `cos`/`sin` are computed in f64 on CPU (f32 on other devices) and
//! cast to the activations' dtype. (Hugging Face computes them in f32 even for f64
//! models; the fixtures' oracle computes them in f64.)
use candle::{DType, Device, Result, Tensor, D};
use std::borrow::Cow;

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
    /// LongRoPE (Phi-3-mini-128k, Phi-3.5, Phi-4-mini): every frequency divided by a factor of
    /// its own, from one of two lists chosen per call, and `cos`/`sin` scaled by an attention
    /// factor in both regimes (transformers 5.25, `_compute_longrope_parameters` and
    /// `dynamic_rope_update`'s `longrope_frequency_update`):
    ///
    /// - `inv_freq[i] = 1 / (ext[i] · theta^(2i / rotary_dim))` for `i < rotary_dim / 2`, with
    ///   `ext = long_factor` for a call whose largest position id `p` (over the whole
    ///   `(B, L)` `position_ids`) has `p + 1 > original_max_position_embeddings`, else
    ///   `ext = short_factor`;
    /// - attention factor: `attention_factor` if given, else 1 when `factor <= 1`, else
    ///   `sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`.
    ///
    /// [`RotaryEmbedding::cos_sin`] makes the choice on every call, as transformers does
    /// (statelessly: a later call with small positions goes back to the short factors).
    LongRope {
        /// Divisors of the frequencies while the call's positions stay within
        /// `original_max_position_embeddings`; `rotary_dim / 2` of them, positive and finite.
        short_factor: Vec<f64>,
        /// Divisors of the frequencies once a call reaches past
        /// `original_max_position_embeddings`; `rotary_dim / 2` of them, positive and finite.
        long_factor: Vec<f64>,
        /// The pre-training context length: the switch point, and the base of the logarithm
        /// in the default attention factor.
        original_max_position_embeddings: f64,
        /// Context extension factor; only the default attention factor reads it.
        /// transformers takes `rope_parameters.factor`, else `max_position_embeddings /
        /// original_max_position_embeddings` (what
        /// [`DecoderAttentionConfig::from_hf`](crate::decoder::DecoderAttentionConfig::from_hf)
        /// fills in).
        factor: f64,
        /// Explicit `cos`/`sin` scaling; `None` derives it from `factor`.
        attention_factor: Option<f64>,
    },
    /// Dynamic NTK scaling (Hugging Face's `"dynamic"`): plain RoPE for a call whose largest
    /// position id `p` has `p + 1 <= max_position_embeddings`; beyond, the plain rope with
    /// `theta · (factor · (p + 1) / max_position_embeddings − (factor − 1))^(d / (d − 2))`
    /// for `d = rotary_dim` (transformers 5.25, `_compute_dynamic_ntk_parameters`).
    ///
    /// [`RotaryEmbedding::cos_sin`] decides on every call from that call's positions alone.
    /// transformers' rotary module keeps state instead: past `max_position_embeddings` it
    /// keeps the frequencies of the longest call so far, until a call shorter than
    /// `max_position_embeddings` resets them. The two agree while calls grow (a prefill
    /// and its decode steps) and after such a reset; they differ for a call that is shorter
    /// than an earlier one but still longer than `max_position_embeddings`.
    /// [`crate::decoder::DecoderAttention`] refuses positions at or beyond
    /// `max_position_embeddings`, so there dynamic NTK is plain RoPE, exactly as in
    /// transformers.
    DynamicNtk {
        /// Context extension factor (transformers warns below 1).
        factor: f64,
        /// The length up to which the rope is plain, `config.max_position_embeddings`.
        max_position_embeddings: f64,
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

/// Frequencies that depend on the length of the call.
#[derive(Clone, Debug)]
enum ByLength {
    /// LongRoPE's long set, for calls past `original`.
    Long { inv_freq: Vec<f64>, original: f64 },
    /// Dynamic NTK: past `max_position_embeddings`, theta grows with the call's length.
    Ntk {
        factor: f64,
        max_position_embeddings: f64,
        theta: f64,
    },
}

/// Rotary embedding with precomputed inverse frequencies.
#[derive(Clone, Debug)]
pub struct RotaryEmbedding {
    /// The frequencies of every call; LongRoPE's short set.
    inv_freq: Vec<f64>,
    /// LongRoPE's long set, or dynamic NTK's rule.
    by_length: Option<ByLength>,
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
        let mut base: Vec<f64> = Vec::new();
        base.try_reserve_exact(dim / 2).map_err(|_| {
            candle::Error::Msg(format!(
                "rope: cannot allocate the {} frequencies of rotary_dim {dim}",
                dim / 2
            ))
        })?;
        base.extend((0..dim / 2).map(|i| 1.0 / cfg.theta.powf((2 * i) as f64 / dim as f64)));
        let positive = |name: &str, x: f64| -> Result<()> {
            if !x.is_finite() || x <= 0.0 {
                candle::bail!("rope: {name} must be positive and finite, got {x}")
            }
            Ok(())
        };
        let mut by_length = None;
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
            RopeScaling::LongRope {
                short_factor,
                long_factor,
                original_max_position_embeddings: old,
                factor,
                attention_factor,
            } => {
                positive("original_max_position_embeddings", *old)?;
                positive("factor", *factor)?;
                if let Some(a) = attention_factor {
                    positive("attention_factor", *a)?;
                }
                for (name, ext) in [("short_factor", short_factor), ("long_factor", long_factor)] {
                    if ext.len() != dim / 2 {
                        candle::bail!(
                            "rope: longrope {name} must have rotary_dim/2 = {} entries (one per frequency), got {}",
                            dim / 2,
                            ext.len()
                        )
                    }
                    if let Some((i, x)) = ext.iter().enumerate().find(|(_, x)| !x.is_finite() || **x <= 0.0) {
                        candle::bail!("rope: longrope {name}[{i}] must be positive and finite, got {x}")
                    }
                }
                let att = match attention_factor {
                    Some(a) => *a,
                    None if *factor <= 1.0 => 1.0,
                    None => {
                        if *old <= 1.0 {
                            candle::bail!(
                                "rope: longrope derives attention_factor from ln(original_max_position_embeddings), \
                                 which needs original_max_position_embeddings > 1, got {old}"
                            )
                        }
                        (1.0 + factor.ln() / old.ln()).sqrt()
                    }
                };
                // transformers' formula, 1 / (ext · theta^(2i/dim)).
                let scaled = |ext: &[f64]| -> Vec<f64> {
                    ext.iter()
                        .enumerate()
                        .map(|(i, e)| 1.0 / (e * cfg.theta.powf((2 * i) as f64 / dim as f64)))
                        .collect()
                };
                by_length = Some(ByLength::Long {
                    inv_freq: scaled(long_factor),
                    original: *old,
                });
                (scaled(short_factor), att)
            }
            RopeScaling::DynamicNtk {
                factor,
                max_position_embeddings,
            } => {
                positive("factor", *factor)?;
                positive("max_position_embeddings", *max_position_embeddings)?;
                if dim <= 2 {
                    candle::bail!(
                        "rope: dynamic NTK scaling raises theta to the power d/(d-2), so it needs rotary_dim > 2, got {dim}"
                    )
                }
                by_length = Some(ByLength::Ntk {
                    factor: *factor,
                    max_position_embeddings: *max_position_embeddings,
                    theta: cfg.theta,
                });
                (base, 1.0)
            }
        };
        let long_freq = match &by_length {
            Some(ByLength::Long { inv_freq, .. }) => inv_freq.as_slice(),
            _ => &[],
        };
        if inv_freq.iter().chain(long_freq).any(|f: &f64| !f.is_finite()) || !attention_scaling.is_finite() {
            candle::bail!(
                "rope: {:?} gives non-finite frequencies or scaling (inv_freq {inv_freq:?}, scaling {attention_scaling})",
                cfg.scaling
            )
        }
        Ok(Self {
            inv_freq,
            by_length,
            attention_scaling,
            rotary_dim: dim,
            head_dim: hd,
            style: cfg.style,
        })
    }

    /// The inverse frequencies, `rotary_dim / 2` of them. For LongRoPE these are the short
    /// set, the one of calls within `original_max_position_embeddings` (transformers'
    /// `original_inv_freq`); [`Self::long_inv_freq`] is the other one. For dynamic NTK, those
    /// of calls within `max_position_embeddings` (see [`Self::inv_freq_for_max_position`]).
    pub fn inv_freq(&self) -> &[f64] {
        &self.inv_freq
    }

    /// LongRoPE's long set of inverse frequencies (`rotary_dim / 2` of them); `None` for the
    /// other scalings, which have one set.
    pub fn long_inv_freq(&self) -> Option<&[f64]> {
        match &self.by_length {
            Some(ByLength::Long { inv_freq, .. }) => Some(inv_freq),
            _ => None,
        }
    }

    /// The inverse frequencies of a call whose largest position id is `max_position`
    /// (`rotary_dim / 2` of them): for LongRoPE the long set when `max_position + 1 >
    /// original_max_position_embeddings`, else the short set; for dynamic NTK, those of
    /// theta grown for a length of `max_position + 1` when that exceeds
    /// `max_position_embeddings`; [`Self::inv_freq`] otherwise.
    pub fn inv_freq_for_max_position(&self, max_position: u64) -> Cow<'_, [f64]> {
        let len = max_position as f64 + 1.0;
        match &self.by_length {
            Some(ByLength::Long { inv_freq, original }) if len > *original => Cow::Borrowed(inv_freq),
            Some(ByLength::Ntk {
                factor,
                max_position_embeddings: mpe,
                theta,
            }) if len > *mpe => {
                let d = self.rotary_dim as f64;
                let base = theta * (factor * len / mpe - (factor - 1.0)).powf(d / (d - 2.0));
                Cow::Owned(
                    (0..self.rotary_dim / 2)
                        .map(|i| 1.0 / base.powf((2 * i) as f64 / d))
                        .collect(),
                )
            }
            _ => Cow::Borrowed(&self.inv_freq),
        }
    }

    /// The factor applied to `cos` and `sin` (YaRN's and LongRoPE's attention factor; 1
    /// otherwise). LongRoPE applies it with both frequency sets.
    pub fn attention_scaling(&self) -> f64 {
        self.attention_scaling
    }

    /// `cos`, `sin` for integer `position_ids` `(B, L)`: each `(B, L, rotary_dim/2)` in `dtype`.
    /// Negative positions are an error.
    ///
    /// LongRoPE picks its frequency set here, once per call, from the largest position in the
    /// whole `position_ids` (every row of the batch gets the same set), as transformers'
    /// rotary module does on every forward (see [`Self::inv_freq_for_max_position`]). Keys
    /// rotated by earlier calls and kept in a [`crate::KvCache`] keep the frequencies they were
    /// rotated with, as in transformers' cache: a prefill within
    /// `original_max_position_embeddings` followed by decode steps beyond it mixes short-set
    /// keys with long-set queries. (`Phi3ForCausalLM.prepare_inputs_for_generation` avoids that
    /// in `generate` by dropping the cache once, at the step that crosses, and running the whole
    /// sequence again; a caller can do the same with a fresh cache.) Dynamic NTK scaling
    /// decides here too, from the same largest position (see [`RopeScaling::DynamicNtk`]).
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
        let flat = position_ids.to_dtype(DType::I64)?.flatten_all()?;
        let min = flat.min(0)?.to_scalar::<i64>()?;
        if min < 0 {
            candle::bail!("rope: positions out of range: position_ids contains {min}")
        }
        let max = match self.by_length {
            Some(_) => Some(flat.max(0)?.to_scalar::<i64>()?),
            None => None,
        };
        self.cos_sin_at(position_ids, dtype, max)
    }

    /// [`Self::cos_sin`] for positions the caller validated (none negative), with the
    /// frequencies of a call whose largest position is `max` (only LongRoPE and dynamic NTK
    /// read it; `None`: [`Self::inv_freq`]).
    pub(crate) fn cos_sin_at(
        &self,
        position_ids: &Tensor,
        dtype: DType,
        max: Option<i64>,
    ) -> Result<(Tensor, Tensor)> {
        let (b, l) = position_ids.dims2()?;
        let dev = position_ids.device();
        let inv_freq = match max {
            Some(m) if m >= 0 => self.inv_freq_for_max_position(m as u64),
            _ => Cow::Borrowed(self.inv_freq.as_slice()),
        };
        let half = inv_freq.len();
        // f64 on CPU; f32 elsewhere (Metal has no f64).
        let cd = if dev.is_cpu() || dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let pos = position_ids.to_dtype(cd)?.reshape((b, l, 1))?;
        let inv = Tensor::from_slice(&inv_freq, (1, 1, half), &Device::Cpu)?
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
