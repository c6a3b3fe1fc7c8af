//! Key/value cache for incremental decoding.
//!
//! Keys and values are `(B, Hkv, S, D)` tensors; the cache grows along `S`.
//!
//! - [`KvCache::new`] grows by doubling its buffer, so `n` appends copy `O(n)` rows in all.
//! - [`KvCache::with_max_len`] allocates once and refuses to overflow.
//! - [`KvCache::rotating`] keeps only the last `window` tokens in a ring buffer of
//!   `window + 1` slots, for sliding-window attention. Its keys come back in ring order,
//!   with their absolute positions, which is all attention needs to build its mask. A
//!   step of one token onto a full window (every decode step once the window is full)
//!   returns the ring itself, with no copy; so does any append while the held and new
//!   tokens lie side by side in the ring. Other appends copy.
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
/// The tensors returned by [`KvCache::append`] may share storage with the cache, as
/// candle-nn's caches do: a later append overwrites what an older view showed, after
/// [`KvCache::truncate`] for a linear cache and at any time for a rotating one. Use each
/// view before the next append (or `copy` it).
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
        // Deep copy: appends write into the buffers in place. The copies are allocated
        // like the originals (huge pages on the CPU).
        let copy = |t: &Option<Tensor>| {
            t.as_ref()
                .and_then(|t| t.dim(SEQ).and_then(|n| grow(Some(t), t, n, n)).ok())
        };
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
        // The ring has one slot more than the window, and its slot indices (u32) must fit.
        if window >= u32::MAX as usize {
            candle::bail!(
                "rotating KV cache: a window of {window} tokens needs one slot more, and at most {} slots fit",
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
                positions: positions(0..self.len)?,
            })),
        }
    }

    /// Appends `k` `(B, Hkv, L, D)` and `v` `(B, Hkv, L, Dv)` and returns what attention
    /// should see: every cached token plus the new ones.
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<KvView> {
        let rank4 = |t: &Tensor, what: &str| {
            t.dims4()
                .map_err(|_| candle::Error::Msg(format!("KV cache: {what}, got {:?}", t.dims())))
        };
        let (b, h, l, _) = rank4(k, "keys must be (B, Hkv, L, D)")?;
        let (bv, hv, lv, _) = rank4(v, "values must be (B, Hkv, L, Dv)")?;
        if (b, h, l) != (bv, hv, lv) {
            candle::bail!("KV cache: keys {:?} and values {:?} disagree", k.dims(), v.dims())
        }
        if let Some(ck) = &self.k {
            let cd = ck.dims();
            let cv = self.v.as_ref().map(|t| t.dims().to_vec()).unwrap_or_default();
            let cvt = self.v.as_ref().map(|t| t.dtype());
            // (`k` and `v` are set together; "none" would only show a bug.)
            let cvt_name = cvt.map_or_else(|| "none".to_string(), |d| format!("{d:?}"));
            let same = cd[0] == b
                && cd[1] == h
                && cd[3] == k.dim(3)?
                && cv.get(3) == Some(&v.dim(3)?)
                && ck.dtype() == k.dtype()
                && cvt == Some(v.dtype());
            if !same && !self.is_empty() {
                // The shapes of the tokens held, not of the buffer (which has spare room).
                let held = |d: &[usize]| -> Vec<usize> {
                    d.iter()
                        .enumerate()
                        .map(|(i, &x)| if i == SEQ { self.len() } else { x })
                        .collect()
                };
                candle::bail!(
                    "KV cache holds keys {:?} {:?} and values {:?} {} but got keys {:?} {:?} and values {:?} {:?}; reset it before changing shapes or dtypes",
                    held(cd),
                    ck.dtype(),
                    held(&cv),
                    cvt_name,
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
        // An empty batch (B, H or D = 0) can carry any sequence length.
        if self.seen.checked_add(l).is_none() {
            candle::bail!(
                "KV cache: {} tokens seen, {l} more would overflow the positions",
                self.seen
            )
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
        // Before the cache changes, so that an error leaves it as it was.
        let positions = positions(0..need)?;
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
            positions,
        })
    }

    fn append_rotating(&mut self, k: &Tensor, v: &Tensor, w: usize) -> Result<KvView> {
        let l = k.dim(SEQ)?;
        // One slot more than the window: a step that adds one token to `w` held ones finds
        // a free slot, so attention reads the whole ring in place instead of a copy.
        let slots = w + 1;
        if self.k.is_none() {
            self.k = Some(grow(None, k, 0, slots)?);
            self.v = Some(grow(None, v, 0, slots)?);
        }
        if self.ring.len() != slots {
            let mut ring = Vec::new();
            ring.try_reserve_exact(slots).map_err(|_| {
                candle::Error::Msg(format!("KV cache: cannot allocate a ring of {slots} slots"))
            })?;
            ring.resize(slots, None);
            self.ring = ring;
        }
        let (ck, cv) = self.buffers()?;
        // The held tokens are the positions `first..seen`, at slots `position % slots`.
        let held = self.len();
        let first = self.seen - held;
        let n = held + l;
        let view = if n <= slots {
            // Held and new tokens fit side by side: store the new ones, then attention
            // reads them all from the ring.
            store_ring(&ck, k, self.seen, slots)?;
            store_ring(&cv, v, self.seen, slots)?;
            for p in self.seen..self.seen + l {
                self.ring[p % slots] = Some(p);
            }
            if n == slots {
                // Every slot: the whole buffers, in slot order, with no copy.
                KvView {
                    k: ck.clone(),
                    v: cv.clone(),
                    positions: self.ring.iter().flatten().copied().collect(),
                }
            } else {
                KvView {
                    k: ring_arc(&ck, first % slots, n)?,
                    v: ring_arc(&cv, first % slots, n)?,
                    positions: positions(first..first + n)?,
                }
            }
        } else {
            // More tokens than slots: copy the held ones out before the new ones evict
            // them, then store the last `w` new tokens.
            let (kk, vv) = if held == 0 {
                (k.clone(), v.clone())
            } else {
                (
                    cat_seq(&ring_arc(&ck, first % slots, held)?, k)?,
                    cat_seq(&ring_arc(&cv, first % slots, held)?, v)?,
                )
            };
            let view = KvView {
                k: kk,
                v: vv,
                positions: positions(first..first + n)?,
            };
            let keep = l.min(w);
            let from = self.seen + l - keep;
            store_ring(&ck, &k.narrow(SEQ, l - keep, keep)?, from, slots)?;
            store_ring(&cv, &v.narrow(SEQ, l - keep, keep)?, from, slots)?;
            for p in from..from + keep {
                self.ring[p % slots] = Some(p);
            }
            view
        };
        self.seen += l;
        // Keep the last `w` tokens.
        let oldest = self.seen.saturating_sub(w);
        for s in self.ring.iter_mut() {
            if s.is_some_and(|p| p < oldest) {
                *s = None;
            }
        }
        Ok(view)
    }

    fn buffers(&self) -> Result<(Tensor, Tensor)> {
        match (&self.k, &self.v) {
            (Some(k), Some(v)) => Ok((k.clone(), v.clone())),
            _ => candle::bail!("KV cache buffers are not allocated"),
        }
    }
}

/// The positions `range`, as [`KvView::positions`] holds them: an error, not an abort,
/// when they cannot be allocated (an empty batch can carry any sequence length).
fn positions(range: std::ops::Range<usize>) -> Result<Vec<usize>> {
    let mut v = Vec::new();
    v.try_reserve_exact(range.len()).map_err(|_| {
        candle::Error::Msg(format!(
            "KV cache: cannot allocate the positions of {} tokens",
            range.len()
        ))
    })?;
    v.extend(range);
    Ok(v)
}

/// A zeroed `(B, H, cap, D)` buffer like `like`, holding the first `len` tokens of `old`.
///
/// On the CPU, large buffers are advised for transparent huge pages before they are
/// written (`kernels::cpu::pages::zeroed`): decode reads the whole cache at every step,
/// and it streams 5–14% faster from huge pages.
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
    let buf = crate::kernels::cpu::pages::zeroed(&(b, h, cap, d).into(), like.dtype(), like.device())?;
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

/// Stores `src` `(B, H, L, D)`, the tokens at positions `from..from + L` (`L <= slots`),
/// at their slots `position % slots` of the ring `dst`.
fn store_ring(dst: &Tensor, src: &Tensor, from: usize, slots: usize) -> Result<()> {
    let l = src.dim(SEQ)?;
    let at = from % slots;
    let head = l.min(slots - at);
    set_seq(dst, &src.narrow(SEQ, 0, head)?, at)?;
    if head < l {
        set_seq(dst, &src.narrow(SEQ, head, l - head)?, 0)?;
    }
    Ok(())
}

/// The `n` slots of the ring `t` from slot `at` on, wrapping past the end: a view when
/// they do not wrap, else a copy.
fn ring_arc(t: &Tensor, at: usize, n: usize) -> Result<Tensor> {
    let slots = t.dim(SEQ)?;
    if at + n <= slots {
        return t.narrow(SEQ, at, n);
    }
    let head = slots - at;
    cat_seq(&t.narrow(SEQ, at, head)?, &t.narrow(SEQ, 0, n - head)?)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::max_diff;
    use candle::{DType, Device};

    /// A clone holds what the original holds and then evolves apart from it, for
    /// linear, fixed and rotating caches.
    #[test]
    fn clones_hold_the_same_tokens_in_every_mode() -> Result<()> {
        let dev = Device::Cpu;
        for mut cache in [KvCache::new(), KvCache::with_max_len(40), KvCache::rotating(7)?] {
            cache.append(
                &Tensor::randn(0f32, 1., (2, 3, 9, 4), &dev)?,
                &Tensor::randn(0f32, 1., (2, 3, 9, 5), &dev)?,
            )?;
            let mut other = cache.clone();
            let (k, v) = (
                Tensor::randn(0f32, 1., (2, 3, 2, 4), &dev)?,
                Tensor::randn(0f32, 1., (2, 3, 2, 5), &dev)?,
            );
            let a = cache.append(&k, &v)?;
            let b = other.append(&k, &v)?;
            assert_eq!(a.positions, b.positions, "{:?}", cache.mode);
            assert_eq!(max_diff(&a.k, &b.k)?, 0.0, "{:?}", cache.mode);
            assert_eq!(max_diff(&a.v, &b.v)?, 0.0, "{:?}", cache.mode);
            // Writing into the clone leaves the original alone.
            let before = cache.current()?.expect("the cache holds tokens");
            other.append(&(&k + 1.0)?, &v)?;
            let after = cache.current()?.expect("the cache holds tokens");
            assert_eq!(before.positions, after.positions, "{:?}", cache.mode);
            assert_eq!(max_diff(&before.k, &after.k)?, 0.0, "{:?}", cache.mode);
        }
        Ok(())
    }

    /// Tokens `from..from + l` as `(1, 2, l, 3)` keys and `(1, 2, l, 1)` values whose
    /// every element is the token's position plus one.
    fn tokens(from: usize, l: usize) -> Result<(Tensor, Tensor)> {
        let pos: Vec<f32> = (from..from + l).map(|p| p as f32 + 1.0).collect();
        let t = Tensor::from_vec(pos, (1, 1, l, 1), &Device::Cpu)?;
        Ok((
            t.broadcast_as((1, 2, l, 3))?.contiguous()?,
            t.broadcast_as((1, 2, l, 1))?.contiguous()?,
        ))
    }

    /// The position of each key of a view (its stored value minus one), checking that
    /// every element of a key and of its value agree.
    fn stored_positions(view: &KvView) -> Result<Vec<usize>> {
        let s = view.k.dim(SEQ)?;
        let k = view.k.transpose(2, 3)?.flatten_to(2)?.to_vec2::<f32>()?;
        let v = view.v.transpose(2, 3)?.flatten_to(2)?.to_vec2::<f32>()?;
        let mut out = Vec::new();
        for j in 0..s {
            let x = k[0][j];
            let all_k = (0..k.len()).all(|r| k[r][j] == x);
            let all_v = (0..v.len()).all(|r| v[r][j] == x);
            assert!(all_k && all_v, "key {j} mixes tokens");
            out.push(x as usize - 1);
        }
        Ok(out)
    }

    /// A rotating cache against a plain model of it, over appends of 0 to w + 2 tokens
    /// and truncations: each view holds exactly the kept tokens plus the new ones, each
    /// under its own position, and a step of one token onto a full window reads the
    /// cache's own buffers (no copy).
    #[test]
    fn rotating_views_hold_the_kept_and_new_tokens() -> Result<()> {
        for w in [1usize, 2, 3, 5] {
            let mut cache = KvCache::rotating(w)?;
            // The model: the positions held after each call.
            let mut held: Vec<usize> = Vec::new();
            let mut seen = 0usize;
            let mut rng = 0x2545_f491u32;
            let mut next = |n: u32| {
                rng ^= rng << 13;
                rng ^= rng >> 17;
                rng ^= rng << 5;
                rng % n
            };
            let mut in_place = 0;
            for step in 0..200 {
                if step % 17 == 16 && seen > 0 {
                    // Truncate to 0, or to a length whose next token sees only held keys.
                    let oldest = held.first().copied().unwrap_or(seen);
                    let lo = (oldest + w - 1).min(seen);
                    let n = match next(4) {
                        0 => 0,
                        _ => lo + next((seen - lo) as u32 + 1) as usize,
                    };
                    cache.truncate(n)?;
                    held.retain(|&p| p < n);
                    seen = n;
                    continue;
                }
                let l = match next(6) {
                    0 => 0,
                    1 => 2,
                    2 => w + 2,
                    _ => 1,
                };
                let (k, v) = tokens(seen, l)?;
                let view = cache.append(&k, &v)?;
                let mut want: Vec<usize> = held.iter().copied().chain(seen..seen + l).collect();
                assert_eq!(stored_positions(&view)?, view.positions, "w {w} step {step}");
                let mut got = view.positions.clone();
                got.sort_unstable();
                want.sort_unstable();
                assert_eq!(got, want, "w {w} step {step}");
                let full_step = l == 1 && held.len() == w;
                seen += l;
                held = want.iter().copied().filter(|&p| p + w >= seen).collect();
                assert_eq!(cache.len(), held.len());
                assert_eq!(cache.seen(), seen);
                if full_step {
                    let (ck, _) = cache.buffers()?;
                    let ptr = |t: &Tensor| &*t.storage_and_layout().0 as *const candle::Storage;
                    assert_eq!(ptr(&view.k), ptr(&ck), "w {w} step {step}: the view is a copy");
                    in_place += 1;
                }
            }
            assert!(in_place > 20, "w {w}: only {in_place} steps onto a full window");
        }
        Ok(())
    }

    /// On Linux, a CPU cache buffer of 8 MiB, and its clone, are marked for huge pages.
    #[cfg(target_os = "linux")]
    #[test]
    fn large_cpu_buffers_are_marked_for_huge_pages() -> Result<()> {
        use crate::kernels::cpu::pages::{marked_for_huge_pages, storage_span, thp_available};
        if !thp_available() {
            eprintln!("transparent huge pages off, absent or not reported: nothing to check");
            return Ok(());
        }
        let mut cache = KvCache::with_max_len(4096);
        let kv = Tensor::ones((1, 8, 1, 128), DType::BF16, &Device::Cpu)?;
        cache.append(&kv, &kv)?;
        let other = cache.clone();
        for c in [&cache, &other] {
            let (k, v) = c.buffers()?;
            for t in [k, v] {
                let (addr, len) = storage_span(&t);
                assert_eq!(len, 8 << 20);
                assert_eq!(marked_for_huge_pages(addr, len), Some(true));
            }
        }
        Ok(())
    }
}
