//! Typed attention masks, so that nobody has to remember polarity.
//!
//! PyTorch uses two opposite conventions for bool masks:
//! `F.scaled_dot_product_attention` reads `True` as "may attend", while
//! `nn.MultiheadAttention` reads `True` as "blocked". An [`AttnMask`] is built
//! from a constructor that names the convention, and every consumer in this
//! crate reads it the same way.
//!
//! | constructor | dtype | meaning of a value |
//! |---|---|---|
//! | [`AttnMask::keep`] | bool (`u8`, any integer) | non-zero = may attend (SDPA's bool) |
//! | [`AttnMask::ignore`] | bool (`u8`, any integer) | non-zero = blocked (MHA's bool) |
//! | [`AttnMask::additive`] | float | added to the scaled scores (`-inf` = blocked) |
//! | [`AttnMask::causal`] | none | key `j` visible from query `i` iff `j <= i` (top-left, `is_causal`) |
//! | [`AttnMask::causal_bottom_right`] | none | `j <= i + S - L` (what a KV cache needs) |
//! | [`AttnMask::causal_with_offset`] | none | `j <= i + offset` |
//! | [`AttnMask::key_padding`] | bool or float, `(B, S)` | MHA's `key_padding_mask`: non-zero = padding |
//!
//! Masks combine with [`AttnMask::and`]: a key is visible only where every part
//! lets it through, and additive parts add up.
use candle::{DType, Device, Result, Tensor};

/// How a causal rule lines up queries with keys when `L != S`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CausalAlign {
    /// `tril(ones(L, S))`: key `j` is visible from query `i` iff `j <= i`.
    /// This is PyTorch's `is_causal=True`.
    TopLeft,
    /// Key `j` is visible from query `i` iff `j <= i + (S - L)`: the last query
    /// sees every key. This is what decoding with a KV cache needs.
    BottomRight,
    /// Key `j` is visible from query `i` iff `j <= i + offset`.
    Offset(isize),
}

impl CausalAlign {
    /// The offset `o` of the rule `j <= i + o` for `l` queries and `s` keys.
    pub fn offset(self, l: usize, s: usize) -> isize {
        match self {
            CausalAlign::TopLeft => 0,
            // In i128, clamped: lengths beyond `isize::MAX` only occur with empty tensors.
            CausalAlign::BottomRight => {
                (s as i128 - l as i128).clamp(isize::MIN as i128, isize::MAX as i128) as isize
            }
            CausalAlign::Offset(o) => o,
        }
    }
}

/// A causal rule resolved for concrete `(L, S)`: key `j` is visible from query
/// `i` iff `j <= i + offset` and, with a window `W`, `j > i + offset - W`. A window of
/// 0 hides every key (the intersection of two rules that share no key gives one).
/// Both bounds are evaluated exactly, whatever the magnitudes (no overflow).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CausalRule {
    /// Key `j` is visible from query `i` only if `j <= i + offset`.
    pub offset: isize,
    /// With a window `W`, also only if `j > i + offset - W` (`Some(0)`: no key).
    pub window: Option<usize>,
}

impl CausalRule {
    /// Both rules at once: the smaller offset, and the window from it down to the
    /// larger of the two lower bounds (0 when that bound is not below the offset, so
    /// that no key is visible). Computed in `i128`, so huge offsets and windows do not
    /// overflow; a window that would exceed `usize::MAX` is clamped to it, which hides
    /// nothing more for any `i + offset` below `usize::MAX`.
    fn intersect(self, other: CausalRule) -> CausalRule {
        let offset = self.offset.min(other.offset);
        // Lower bound of each rule: j > offset_k - W_k (+ i). Keep the larger.
        let lower = |r: CausalRule| r.window.map(|w| r.offset as i128 - w as i128);
        let low = match (lower(self), lower(other)) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        CausalRule {
            offset,
            window: low.map(|lo| (offset as i128 - lo).clamp(0, usize::MAX as i128) as usize),
        }
    }
}

#[derive(Clone, Debug)]
enum Part {
    /// Integer tensor, non-zero = may attend.
    Keep(Tensor),
    /// Float tensor added to the scores.
    Additive(Tensor),
    Causal {
        align: CausalAlign,
        window: Option<usize>,
    },
}

/// An attention mask whose polarity is fixed by its constructor.
///
/// Explicit masks broadcast (numpy rules, right-aligned) to the score shape
/// `(…, Hq, L, S)`. A shape that cannot broadcast is an error that names both
/// shapes.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_attention::AttnMask;
/// let dev = Device::Cpu;
/// // MHA-style key padding: batch row 1 ignores its last key.
/// let pad = Tensor::new(&[[0u8, 0, 0], [0, 0, 1]], &dev)?;
/// let mask = AttnMask::key_padding(&pad)?.and(&AttnMask::causal());
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Clone, Debug, Default)]
pub struct AttnMask {
    parts: Vec<Part>,
}

fn check_bool(t: &Tensor, what: &str) -> Result<()> {
    match t.dtype() {
        DType::U8 | DType::U32 | DType::I16 | DType::I32 | DType::I64 => Ok(()),
        dt => candle::bail!(
            "{what} mask must be bool (u8 or another integer dtype), got {dt:?} with shape {:?}; \
             use AttnMask::additive for float masks",
            t.dims()
        ),
    }
}

fn check_float(t: &Tensor, what: &str) -> Result<()> {
    if t.dtype().is_float() {
        Ok(())
    } else {
        candle::bail!(
            "{what} mask must be a float dtype, got {:?} with shape {:?}; \
             use AttnMask::keep or AttnMask::ignore for bool masks",
            t.dtype(),
            t.dims()
        )
    }
}

impl AttnMask {
    /// A mask that lets everything through.
    pub fn none() -> Self {
        Self::default()
    }

    /// Bool mask with SDPA's polarity: non-zero = may attend.
    /// Shape: broadcastable to `(…, Hq, L, S)`.
    pub fn keep(mask: &Tensor) -> Result<Self> {
        check_bool(mask, "keep")?;
        Ok(Self {
            parts: vec![Part::Keep(mask.clone())],
        })
    }

    /// Bool mask with `nn.MultiheadAttention`'s polarity: non-zero = blocked.
    /// Shape: broadcastable to `(…, Hq, L, S)`.
    pub fn ignore(mask: &Tensor) -> Result<Self> {
        check_bool(mask, "ignore")?;
        // An empty mask is built without a kernel (see `crate::empty` for candle's CUDA backend).
        let keep = match mask.elem_count() {
            0 => Tensor::zeros(mask.shape(), DType::U8, mask.device())?,
            _ => mask.eq(0u8)?,
        };
        Ok(Self {
            parts: vec![Part::Keep(keep)],
        })
    }

    /// Float mask added to the scaled scores (`-inf` blocks a key).
    /// Shape: broadcastable to `(…, Hq, L, S)`.
    pub fn additive(mask: &Tensor) -> Result<Self> {
        check_float(mask, "additive")?;
        Ok(Self {
            parts: vec![Part::Additive(mask.clone())],
        })
    }

    /// Top-left causal mask, PyTorch's `is_causal=True`: `tril(ones(L, S))`.
    pub fn causal() -> Self {
        Self::causal_aligned(CausalAlign::TopLeft)
    }

    /// Bottom-right causal mask: the last query sees every key (KV cache decoding).
    pub fn causal_bottom_right() -> Self {
        Self::causal_aligned(CausalAlign::BottomRight)
    }

    /// Causal mask with an explicit offset: key `j` visible from query `i` iff `j <= i + offset`.
    pub fn causal_with_offset(offset: isize) -> Self {
        Self::causal_aligned(CausalAlign::Offset(offset))
    }

    /// Causal mask with the given alignment.
    pub fn causal_aligned(align: CausalAlign) -> Self {
        Self {
            parts: vec![Part::Causal { align, window: None }],
        }
    }

    /// Causal sliding window of exactly `window` keys (Hugging Face's rule
    /// `j > i + offset - window`), aligned as given. `window` must be at least 1.
    pub fn sliding_window(window: usize, align: CausalAlign) -> Result<Self> {
        if window == 0 {
            candle::bail!("sliding window must be at least 1 key, got 0")
        }
        Ok(Self {
            parts: vec![Part::Causal {
                align,
                window: Some(window),
            }],
        })
    }

    /// `nn.MultiheadAttention`'s `key_padding_mask`, shape `(B, S)` (or `(S)`).
    ///
    /// A bool (integer) mask is non-zero where the key is padding and must be
    /// ignored; a float mask is added. It applies to scores of shape `(B, H, L, S)`.
    pub fn key_padding(mask: &Tensor) -> Result<Self> {
        let rank = mask.rank();
        let t = match rank {
            1 => mask.clone(),
            2 => {
                let (b, s) = mask.dims2()?;
                mask.reshape((b, 1, 1, s))?
            }
            _ => candle::bail!(
                "key padding mask must have shape (B, S) or (S), got {:?}",
                mask.dims()
            ),
        };
        if mask.dtype().is_float() {
            Self::additive(&t)
        } else {
            check_bool(mask, "key padding")?;
            Self::ignore(&t)
        }
    }

    /// Both masks at once: a key is visible only where both let it through.
    pub fn and(&self, other: &AttnMask) -> AttnMask {
        let mut parts = self.parts.clone();
        parts.extend(other.parts.iter().cloned());
        AttnMask { parts }
    }

    /// The mask of batch row `b` of `n`, for scores `(n, H, L, S)` seen one batch row at
    /// a time as `(1, H, L, S)`: each rank-4 tensor part with `n > 1` rows keeps row `b`;
    /// every other part broadcasts over the batch and stays as it is.
    pub(crate) fn batch_row(&self, b: usize, n: usize) -> Result<AttnMask> {
        let row = |t: &Tensor| -> Result<Tensor> {
            if n > 1 && t.rank() == 4 && t.dim(0)? == n {
                t.narrow(0, b, 1)
            } else {
                Ok(t.clone())
            }
        };
        let parts = self
            .parts
            .iter()
            .map(|p| {
                Ok(match p {
                    Part::Keep(t) => Part::Keep(row(t)?),
                    Part::Additive(t) => Part::Additive(row(t)?),
                    c @ Part::Causal { .. } => c.clone(),
                })
            })
            .collect::<Result<_>>()?;
        Ok(AttnMask { parts })
    }

    /// True when the mask has no parts (lets everything through).
    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// The combined causal rule for `l` queries and `s` keys, if any part is causal.
    pub fn causal_rule(&self, l: usize, s: usize) -> Option<CausalRule> {
        self.parts
            .iter()
            .filter_map(|p| match p {
                Part::Causal { align, window } => Some(CausalRule {
                    offset: align.offset(l, s),
                    window: *window,
                }),
                _ => None,
            })
            .reduce(CausalRule::intersect)
    }

    /// The explicit (tensor) parts combined into one additive mask of `dtype`
    /// (`0` = visible, `-inf` = blocked, other values added), with a shape that
    /// broadcasts to `scores` (right-aligned, padded on the left to its rank).
    /// `None` when the mask has no explicit part.
    pub fn explicit_additive(&self, scores: &[usize], dtype: DType) -> Result<Option<Tensor>> {
        let mut acc: Option<Tensor> = None;
        for part in &self.parts {
            let t = match part {
                Part::Causal { .. } => continue,
                Part::Keep(t) if t.elem_count() == 0 => {
                    let t = align_rank(t, scores)?;
                    Tensor::zeros(t.shape(), dtype, t.device())?
                }
                Part::Keep(t) => {
                    let t = align_rank(t, scores)?;
                    let zero = Tensor::zeros((), dtype, t.device())?.broadcast_as(t.shape())?;
                    let ninf = Tensor::full(f32::NEG_INFINITY, (), t.device())?
                        .to_dtype(dtype)?
                        .broadcast_as(t.shape())?;
                    t.where_cond(&zero, &ninf)?
                }
                Part::Additive(t) => crate::cast::to_dtype(&align_rank(t, scores)?, dtype)?,
            };
            acc = Some(match acc {
                None => t,
                Some(a) => a.broadcast_add(&t)?,
            });
        }
        Ok(acc)
    }

    /// The causal parts alone as an additive `(1, …, 1, L, S)` mask of `dtype`, for
    /// `scores = (…, L, S)`. `None` when no part is causal.
    pub fn causal_additive(&self, scores: &[usize], dtype: DType, device: &Device) -> Result<Option<Tensor>> {
        let n = scores.len();
        if n < 2 {
            candle::bail!("attention scores need rank >= 2, got shape {scores:?}")
        }
        let (l, s) = (scores[n - 2], scores[n - 1]);
        match self.causal_rule(l, s) {
            None => Ok(None),
            Some(rule) => {
                let mut shape = vec![1usize; n - 2];
                shape.extend([l, s]);
                Ok(Some(causal_additive(rule, l, s, dtype, device)?.reshape(shape)?))
            }
        }
    }

    /// The whole mask, causal parts included, as one additive mask of `dtype`
    /// broadcastable to `scores = (…, L, S)`. `None` when the mask is empty.
    pub fn to_additive(&self, scores: &[usize], dtype: DType, device: &Device) -> Result<Option<Tensor>> {
        let explicit = self.explicit_additive(scores, dtype)?;
        let causal = self.causal_additive(scores, dtype, device)?;
        add_masks(explicit, causal)
    }
}

/// The sum of two optional additive masks.
pub(crate) fn add_masks(a: Option<Tensor>, b: Option<Tensor>) -> Result<Option<Tensor>> {
    Ok(match (a, b) {
        (None, c) => c,
        (e, None) => e,
        (Some(e), Some(c)) => Some(e.broadcast_add(&c)?),
    })
}

/// Reshape `t` to `scores.len()` dims by adding leading 1s, after checking that
/// it broadcasts to `scores`. The error names both shapes.
pub(crate) fn align_rank(t: &Tensor, scores: &[usize]) -> Result<Tensor> {
    let dims = t.dims();
    let fits = dims.len() <= scores.len()
        && dims
            .iter()
            .rev()
            .zip(scores.iter().rev())
            .all(|(&m, &s)| m == s || m == 1);
    if !fits {
        candle::bail!("attention mask of shape {dims:?} cannot broadcast to the score shape {scores:?}")
    }
    let mut shape = vec![1usize; scores.len() - dims.len()];
    shape.extend_from_slice(dims);
    t.reshape(shape)
}

/// `(L, S)` additive mask of a causal rule: 0 where visible, `-inf` elsewhere.
pub(crate) fn causal_additive(
    rule: CausalRule,
    l: usize,
    s: usize,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let Some(n) = l.checked_mul(s) else {
        candle::bail!("causal mask of {l} x {s} has more elements than usize can count")
    };
    let mut data = vec![f32::NEG_INFINITY; n];
    for i in 0..l {
        // In i128, so that no offset or window overflows.
        let hi = i as i128 + rule.offset as i128; // inclusive
        let lo = match rule.window {
            Some(w) => hi - w as i128 + 1,
            None => 0,
        };
        for j in lo.max(0)..=hi.min(s as i128 - 1) {
            data[i * s + j as usize] = 0.0;
        }
    }
    crate::cast::to_dtype(&Tensor::from_vec(data, (l, s), device)?, dtype)
}
