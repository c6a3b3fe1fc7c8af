//! Key/value cache for incremental decoding.
//!
//! Keys and values are `(B, Hkv, S, D)` tensors; the cache grows along `S`.
//!
//! - [`KvCache::new`] grows by doubling its buffer, so `n` appends copy `O(n)` rows in all.
//! - [`KvCache::with_max_len`] allocates once and refuses to overflow.
//! - [`KvCache::rotating`] keeps only the last `window` tokens in a ring buffer, for
//!   sliding-window attention. Its keys come back in ring order, with their absolute
//!   positions, which is all attention needs to build its mask.
//!
//! Every sequence of a batch shares one index space: with left padding, the padded
//! slots are cached like any other and masked by the attention mask.
use candle::{Result, Tensor};

#[derive(Clone, Debug, PartialEq, Eq)]
enum Mode {
    Growable,
    Fixed(usize),
    Rotating(usize),
}

/// What attention sees after an append.
#[derive(Clone, Debug)]
pub struct KvView {
    /// `(B, Hkv, S, D)`.
    pub k: Tensor,
    /// `(B, Hkv, S, Dv)`.
    pub v: Tensor,
    /// Absolute position (index since the first append) of each of the `S` keys.
    pub positions: Vec<usize>,
}

/// A key/value cache for one attention layer.
///
/// The tensors returned by [`KvCache::append`] may share storage with the cache:
/// after [`KvCache::truncate`], a later append overwrites what an older view showed.
/// `clone` copies the buffers, so a clone evolves independently (beam search).
#[derive(Debug)]
pub struct KvCache {
    mode: Mode,
    k: Option<Tensor>,
    v: Option<Tensor>,
    /// Tokens held by a linear cache (slots `0..len`).
    len: usize,
    /// Absolute position held by each slot of a rotating cache (`window` slots).
    ring: Vec<Option<usize>>,
    /// Tokens appended since the last reset (after truncation: the new length).
    seen: usize,
}

impl Clone for KvCache {
    fn clone(&self) -> Self {
        // Deep copy: appends write into the buffers in place.
        let copy = |t: &Option<Tensor>| t.as_ref().and_then(|t| t.copy().ok());
        Self {
            mode: self.mode.clone(),
            k: copy(&self.k),
            v: copy(&self.v),
            len: self.len,
            ring: self.ring.clone(),
            seen: self.seen,
        }
    }
}

impl Default for KvCache {
    fn default() -> Self {
        Self::new()
    }
}

const SEQ: usize = 2;

impl KvCache {
    /// A cache that grows as needed (doubling its buffer).
    pub fn new() -> Self {
        Self::with_mode(Mode::Growable)
    }

    /// A cache of at most `max_len` tokens, allocated once; appending past it is an error.
    pub fn with_max_len(max_len: usize) -> Self {
        Self::with_mode(Mode::Fixed(max_len))
    }

    /// A ring buffer keeping the last `window` tokens (sliding-window attention).
    pub fn rotating(window: usize) -> Result<Self> {
        if window == 0 {
            candle::bail!("rotating KV cache needs a window of at least 1 token")
        }
        // The ring of slot positions, and the slot indices (u32), must fit.
        if window > u32::MAX as usize {
            candle::bail!(
                "rotating KV cache: a window of {window} tokens is more than {} slots",
                u32::MAX
            )
        }
        Ok(Self::with_mode(Mode::Rotating(window)))
    }

    fn with_mode(mode: Mode) -> Self {
        Self {
            mode,
            k: None,
            v: None,
            len: 0,
            ring: Vec::new(),
            seen: 0,
        }
    }

    /// Tokens appended so far: the absolute position of the next token.
    pub fn seen(&self) -> usize {
        self.seen
    }

    /// Tokens currently held (at most the window for a rotating cache).
    pub fn len(&self) -> usize {
        match self.mode {
            Mode::Rotating(_) => self.ring.iter().flatten().count(),
            _ => self.len,
        }
    }

    /// Tokens the buffer can hold before it must grow (the window for a rotating cache).
    pub fn capacity(&self) -> usize {
        match self.mode {
            Mode::Rotating(w) => w,
            _ => self.k.as_ref().and_then(|t| t.dim(SEQ).ok()).unwrap_or(0),
        }
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The window of a rotating cache.
    pub fn window(&self) -> Option<usize> {
        match self.mode {
            Mode::Rotating(w) => Some(w),
            _ => None,
        }
    }

    /// Forgets everything (keeps the allocation).
    pub fn reset(&mut self) {
        self.len = 0;
        self.ring.iter_mut().for_each(|s| *s = None);
        self.seen = 0;
    }

    /// Keeps the first `n` tokens and forgets the rest (speculative decoding, prefix reuse).
    ///
    /// A rotating cache can only go back as far as it still holds every key that the
    /// next token would see.
    pub fn truncate(&mut self, n: usize) -> Result<()> {
        if n > self.seen {
            candle::bail!("cannot truncate a KV cache of {} tokens to {n}", self.seen)
        }
        match self.mode {
            Mode::Rotating(w) => {
                let oldest = self.ring.iter().flatten().copied().min().unwrap_or(0);
                let need_from = n.saturating_sub(w - 1);
                if n > 0 && need_from < oldest {
                    candle::bail!(
                        "cannot truncate a rotating KV cache (window {w}) to {n} tokens: positions before {oldest} were already evicted"
                    )
                }
                // Slots holding positions past n become free.
                for s in self.ring.iter_mut() {
                    if s.is_some_and(|p| p >= n) {
                        *s = None;
                    }
                }
            }
            _ => self.len = n,
        }
        self.seen = n;
        Ok(())
    }

    /// What attention would see without appending anything; `None` when empty.
    pub fn current(&self) -> Result<Option<KvView>> {
        let (k, v) = match (&self.k, &self.v) {
            (Some(k), Some(v)) if !self.is_empty() => (k, v),
            _ => return Ok(None),
        };
        match self.mode {
            Mode::Rotating(_) => {
                let held: Vec<u32> = (0..self.ring.len() as u32)
                    .filter(|&s| self.ring[s as usize].is_some())
                    .collect();
                let idx = Tensor::new(held.as_slice(), k.device())?;
                Ok(Some(KvView {
                    k: k.index_select(&idx, SEQ)?,
                    v: v.index_select(&idx, SEQ)?,
                    positions: self.ring.iter().flatten().copied().collect(),
                }))
            }
            _ => Ok(Some(KvView {
                k: k.narrow(SEQ, 0, self.len)?,
                v: v.narrow(SEQ, 0, self.len)?,
                positions: (0..self.len).collect(),
            })),
        }
    }

    /// Appends `k` `(B, Hkv, L, D)` and `v` `(B, Hkv, L, Dv)` and returns what attention
    /// should see: every cached token plus the new ones.
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<KvView> {
        let (b, h, l, _) = k.dims4()?;
        let (bv, hv, lv, _) = v.dims4()?;
        if (b, h, l) != (bv, hv, lv) {
            candle::bail!("KV cache: keys {:?} and values {:?} disagree", k.dims(), v.dims())
        }
        if let Some(ck) = &self.k {
            let cd = ck.dims();
            let cv = self.v.as_ref().map(|t| t.dims().to_vec()).unwrap_or_default();
            let cvt = self.v.as_ref().map(|t| t.dtype());
            let same = cd[0] == b
                && cd[1] == h
                && cd[3] == k.dim(3)?
                && cv.get(3) == Some(&v.dim(3)?)
                && ck.dtype() == k.dtype()
                && cvt == Some(v.dtype());
            if !same && !self.is_empty() {
                candle::bail!(
                    "KV cache holds keys {:?} {:?} and values {:?} {:?} but got keys {:?} {:?} and values {:?} {:?}; reset it before changing shapes or dtypes",
                    cd,
                    ck.dtype(),
                    cv,
                    cvt,
                    k.dims(),
                    k.dtype(),
                    v.dims(),
                    v.dtype()
                )
            }
            if !same {
                self.k = None;
                self.v = None;
            }
        }
        match self.mode {
            Mode::Rotating(w) => self.append_rotating(k, v, w),
            _ => self.append_linear(k, v),
        }
    }

    fn append_linear(&mut self, k: &Tensor, v: &Tensor) -> Result<KvView> {
        let l = k.dim(SEQ)?;
        let len = self.len;
        let need = len + l;
        let cap = self.k.as_ref().map(|t| t.dim(SEQ)).transpose()?.unwrap_or(0);
        if let Mode::Fixed(max) = self.mode {
            if need > max {
                candle::bail!("KV cache overflow: capacity {max} tokens, holds {len}, cannot append {l} more")
            }
        }
        if need > cap || self.k.is_none() {
            let new_cap = match self.mode {
                Mode::Fixed(max) => max,
                _ => need.max(2 * cap).max(16),
            };
            self.k = Some(grow(self.k.as_ref(), k, len, new_cap)?);
            self.v = Some(grow(self.v.as_ref(), v, len, new_cap)?);
        }
        let (ck, cv) = self.buffers()?;
        set_seq(&ck, k, len)?;
        set_seq(&cv, v, len)?;
        self.len = need;
        self.seen += l;
        Ok(KvView {
            k: ck.narrow(SEQ, 0, need)?,
            v: cv.narrow(SEQ, 0, need)?,
            positions: (0..need).collect(),
        })
    }

    fn append_rotating(&mut self, k: &Tensor, v: &Tensor, w: usize) -> Result<KvView> {
        let l = k.dim(SEQ)?;
        if self.k.is_none() {
            self.k = Some(grow(None, k, 0, w)?);
            self.v = Some(grow(None, v, 0, w)?);
        }
        if self.ring.len() != w {
            self.ring = vec![None; w];
        }
        let (ck, cv) = self.buffers()?;
        // Attention sees the held tokens (ring order) followed by the new ones.
        let held: Vec<u32> = (0..w as u32)
            .filter(|&s| self.ring[s as usize].is_some())
            .collect();
        let mut positions: Vec<usize> = self.ring.iter().flatten().copied().collect();
        positions.extend(self.seen..self.seen + l);
        let (kk, vv) = if held.is_empty() {
            (k.clone(), v.clone())
        } else {
            let (old_k, old_v) = if held.len() == w {
                (ck.clone(), cv.clone())
            } else {
                let idx = Tensor::new(held.as_slice(), k.device())?;
                (select_seq(&ck, &idx)?, select_seq(&cv, &idx)?)
            };
            (cat_seq(&old_k, k)?, cat_seq(&old_v, v)?)
        };
        // Store the last min(l, w) new tokens at slot = position % w.
        for t in l - l.min(w)..l {
            let pos = self.seen + t;
            let slot = pos % w;
            set_seq(&ck, &k.narrow(SEQ, t, 1)?, slot)?;
            set_seq(&cv, &v.narrow(SEQ, t, 1)?, slot)?;
            self.ring[slot] = Some(pos);
        }
        self.seen += l;
        Ok(KvView {
            k: kk,
            v: vv,
            positions,
        })
    }

    fn buffers(&self) -> Result<(Tensor, Tensor)> {
        match (&self.k, &self.v) {
            (Some(k), Some(v)) => Ok((k.clone(), v.clone())),
            _ => candle::bail!("KV cache buffers are not allocated"),
        }
    }
}

/// A zeroed `(B, H, cap, D)` buffer like `like`, holding the first `len` tokens of `old`.
fn grow(old: Option<&Tensor>, like: &Tensor, len: usize, cap: usize) -> Result<Tensor> {
    let (b, h, _, d) = like.dims4()?;
    let bytes = [b, h, cap, d, like.dtype().size_in_bytes()]
        .iter()
        .try_fold(1usize, |acc, &x| acc.checked_mul(x))
        .filter(|&n| n <= isize::MAX as usize);
    if bytes.is_none() {
        candle::bail!(
            "KV cache: a buffer of {cap} tokens for {:?} {:?} does not fit in memory",
            like.dims(),
            like.dtype()
        )
    }
    let buf = Tensor::zeros((b, h, cap, d), like.dtype(), like.device())?;
    if let Some(old) = old {
        if len > 0 {
            set_seq(&buf, &old.narrow(SEQ, 0, len)?, 0)?;
        }
    }
    Ok(buf)
}

// Empty tensors (B, H or D = 0) are handled apart below: candle's CPU copy of an empty
// view at an offset (a narrowed empty tensor) indexes out of bounds, and its CUDA backend
// cannot `index_select` with no element.

/// `dst[.., .., at..at + L, ..] = src`.
fn set_seq(dst: &Tensor, src: &Tensor, at: usize) -> Result<()> {
    if src.elem_count() == 0 {
        return Ok(());
    }
    dst.slice_set(&src.contiguous()?, SEQ, at)
}

/// The tokens `idx` of `t` along the sequence dim.
fn select_seq(t: &Tensor, idx: &Tensor) -> Result<Tensor> {
    if t.elem_count() == 0 {
        let (b, h, _, d) = t.dims4()?;
        return Tensor::zeros((b, h, idx.elem_count(), d), t.dtype(), t.device());
    }
    t.index_select(idx, SEQ)
}

/// `a` then `b` along the sequence dim.
fn cat_seq(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.elem_count() == 0 && b.elem_count() == 0 {
        let mut shape = a.dims().to_vec();
        shape[SEQ] += b.dim(SEQ)?;
        return Tensor::zeros(shape, a.dtype(), a.device());
    }
    let part = |t: &Tensor| match t.elem_count() {
        0 => Tensor::zeros(t.shape(), t.dtype(), t.device()),
        _ => Ok(t.clone()),
    };
    Tensor::cat(&[&part(a)?, &part(b)?], SEQ)
}
