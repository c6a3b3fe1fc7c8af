//! The validated dimensions of one scaled dot-product attention call, shared by the
//! dispatcher (`sdpa`) and the fused kernels (`kernels`).

use candle::{Result, Tensor};

/// Validated dimensions of one call.
#[derive(Clone, Debug)]
pub(crate) struct Dims {
    /// Leading batch dims of the inputs.
    pub lead: Vec<usize>,
    /// Product of `lead`.
    pub n: usize,
    pub hq: usize,
    pub hkv: usize,
    pub l: usize,
    pub s: usize,
    pub e: usize,
    pub ev: usize,
    /// Inputs were `(L, E)`: no head dim.
    pub headless: bool,
}

impl Dims {
    /// Shape of the scores in the caller's layout: `(…, Hq, L, S)`.
    pub fn score_shape(&self) -> Vec<usize> {
        let mut s = self.lead.clone();
        if !self.headless {
            s.push(self.hq);
        }
        s.extend([self.l, self.s]);
        s
    }
    pub(crate) fn out_shape(&self, last: usize) -> Vec<usize> {
        let mut s = self.lead.clone();
        if !self.headless {
            s.push(self.hq);
        }
        s.extend([self.l, last]);
        s
    }
}

pub(crate) fn check_dims(q: &Tensor, k: &Tensor, v: &Tensor, enable_gqa: bool) -> Result<Dims> {
    let (qs, ks, vs) = (q.dims(), k.dims(), v.dims());
    let r = qs.len();
    if r < 2 {
        candle::bail!("sdpa: query must have shape (…, Hq, L, E) or (L, E), got {qs:?}")
    }
    if ks.len() != r || vs.len() != r {
        candle::bail!(
            "sdpa: query, key and value must have the same rank, got query {qs:?}, key {ks:?}, value {vs:?}"
        )
    }
    let dt = q.dtype();
    if !dt.is_float() {
        candle::bail!("sdpa: query must be a float tensor, got {dt:?}")
    }
    if k.dtype() != dt || v.dtype() != dt {
        candle::bail!(
            "sdpa: query, key and value must share a dtype, got query {dt:?}, key {:?}, value {:?}",
            k.dtype(),
            v.dtype()
        )
    }
    if !q.device().same_device(k.device()) || !q.device().same_device(v.device()) {
        candle::bail!("sdpa: query, key and value must be on the same device")
    }
    let headless = r == 2;
    let nlead = r.saturating_sub(3);
    if qs[..nlead] != ks[..nlead] || qs[..nlead] != vs[..nlead] {
        candle::bail!(
            "sdpa: batch dims differ: query {qs:?}, key {ks:?}, value {vs:?} (batch dims are all but the last 3)"
        )
    }
    let (l, e) = (qs[r - 2], qs[r - 1]);
    let (s, ek) = (ks[r - 2], ks[r - 1]);
    let (sv, ev) = (vs[r - 2], vs[r - 1]);
    let (hq, hkv, hv) = if headless {
        (1, 1, 1)
    } else {
        (qs[r - 3], ks[r - 3], vs[r - 3])
    };
    if ek != e {
        candle::bail!(
            "sdpa: query and key must share the embedding dim E (last dim), got query {qs:?}, key {ks:?}"
        )
    }
    if sv != s {
        candle::bail!("sdpa: key and value must share the sequence dim S, got key {ks:?}, value {vs:?}")
    }
    if hv != hkv {
        candle::bail!("sdpa: key and value must have the same number of heads, got key {ks:?}, value {vs:?}")
    }
    if enable_gqa {
        if hkv == 0 || !hq.is_multiple_of(hkv) {
            candle::bail!(
                "sdpa: with enable_gqa the query heads ({hq}) must be a multiple of the key/value heads ({hkv}); \
                 query {qs:?}, key {ks:?}"
            )
        }
    } else if hq != hkv {
        candle::bail!(
            "sdpa: query has {hq} heads but key/value have {hkv}; set enable_gqa for grouped-query attention \
             (query {qs:?}, key {ks:?})"
        )
    }
    let lead = qs[..nlead].to_vec();
    let n = lead.iter().product();
    let dims = Dims {
        lead,
        n,
        hq,
        hkv,
        l,
        s,
        e,
        ev,
        headless,
    };
    // With a zero-sized E, L·S and L·Ev can exceed what the inputs hold. (Counted
    // without building the shapes: this runs on every call.)
    let count = |last: usize| {
        let rows = [dims.hq, l, last];
        dims.lead
            .iter()
            .chain(&rows)
            .try_fold(1usize, |a, &d| a.checked_mul(d))
    };
    for (what, last) in [("scores", s), ("output", ev)] {
        if count(last).is_none() {
            candle::bail!(
                "sdpa: the {what} shape {:?} has more elements than usize can count \
                 (query {qs:?}, key {ks:?}, value {vs:?})",
                dims.out_shape(last)
            )
        }
    }
    Ok(dims)
}
