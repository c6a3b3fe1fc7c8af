//! The fixture runner: loads a `candle-attention-fixture/1` safetensors file
//! written by PyTorch, builds the layer it describes, runs it, and compares the
//! result with the outputs PyTorch stored.
//!
//! The format is documented in `weights/README.md`. In short, one file per case:
//! `__metadata__` holds `format`, `kind`, `config` (JSON), `call` (JSON), `dtype`
//! (PyTorch's name) and `torch_version`; tensors are named `param.<state_dict key>`,
//! `input.<argument>` and `output.<name>`. A mask stored as `u8` is a PyTorch bool
//! mask; one stored as a float is added.
//!
//! # Tolerances
//! The error of a fixture is `max|got − expected| / max(1, max|expected|)`, over every
//! stored output. It passes when that is at most [`tolerance`] of the dtype it runs in
//! (the looser of the run dtype and the file's dtype):
//!
//! | dtype | tolerance |
//! |---|---|
//! | f64 | 1e-10 |
//! | f32 | 1e-5 |
//! | f16 | 5e-3 |
//! | bf16 | 2e-2 |
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle::{DType, Device, Result, Tensor};
use candle_nn::VarBuilder;
use serde::Serialize;
use serde_json::Value;

use crate::decoder::{DecoderAttention, DecoderAttentionConfig, HfConfig};
use crate::mask::AttnMask;
use crate::mha::{MhaArgs, MultiheadAttention, MultiheadAttentionConfig};
use crate::notes::{AttentionConfig, CausalAttention, MultiHeadAttention, ScaledDotProductAttention};
use crate::sdpa::{scaled_dot_product_attention, Backend, SdpaOptions};

/// The `format` every fixture's metadata carries.
pub const FORMAT: &str = "candle-attention-fixture/1";

/// The fixture kinds this runner knows.
pub const KINDS: &[&str] = &[
    "sdpa",
    "multihead_attention",
    "notes_sdpa",
    "notes_multihead",
    "notes_causal",
    "hf_attention",
];

/// Pass threshold of the normalised error for `dtype` (see the module docs).
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-10,
        DType::F32 => 1e-5,
        DType::F16 => 5e-3,
        DType::BF16 => 2e-2,
        _ => 0.0,
    }
}

/// A dtype from PyTorch's name (`float32`, `torch.bfloat16`, `half`, …).
pub fn parse_torch_dtype(name: &str) -> Result<DType> {
    Ok(match name.trim_start_matches("torch.") {
        "float32" | "float" => DType::F32,
        "float64" | "double" => DType::F64,
        "float16" | "half" => DType::F16,
        "bfloat16" => DType::BF16,
        other => candle::bail!(
            "unsupported fixture dtype '{other}' (expected float32, float64, float16 or bfloat16)"
        ),
    })
}

/// Short name of a float dtype: `f32`, `f64`, `f16`, `bf16`.
pub fn dtype_name(dtype: DType) -> &'static str {
    dtype.as_str()
}

/// One loaded fixture file.
#[derive(Debug, Clone)]
pub struct Fixture {
    /// The file stem.
    pub name: String,
    /// `kind` from the metadata (`sdpa`, `multihead_attention`, …).
    pub kind: String,
    /// The dtype the fixture was exported in.
    pub dtype: DType,
    /// `config` from the metadata, parsed.
    pub config: Value,
    /// `call` from the metadata, parsed (`{}` when absent).
    pub call: Value,
    /// The exporter's `torch.__version__`.
    pub torch_version: Option<String>,
    /// Every `__metadata__` entry, as stored.
    pub metadata: HashMap<String, String>,
    tensors: HashMap<String, Tensor>,
}

/// How to run a fixture.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// Where the layer runs.
    pub device: Device,
    /// Run in this dtype instead of the file's (float tensors are cast).
    pub dtype: Option<DType>,
    /// Which SDPA implementation the layer uses.
    pub backend: Backend,
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            device: Device::Cpu,
            dtype: None,
            backend: Backend::Auto,
        }
    }
}

/// The outcome of one fixture.
#[derive(Clone, Debug, Serialize)]
pub struct FixtureReport {
    /// The fixture name (file stem).
    pub name: String,
    /// `kind` from the metadata (`sdpa`, `multihead_attention`, …).
    pub kind: String,
    /// The dtype it ran in (`f32`, …).
    pub dtype: String,
    /// `max|got − expected|` over every output.
    pub max_abs_err: f64,
    /// `max|got − expected| / max(1, max|expected|)`, the value held against `tol`.
    pub max_rel_err: f64,
    /// The tolerance `max_rel_err` is held against.
    pub tol: f64,
    /// `max_rel_err <= tol`.
    pub pass: bool,
}

fn meta_str<'a>(meta: &'a HashMap<String, String>, key: &str, name: &str) -> Result<&'a str> {
    meta.get(key)
        .map(String::as_str)
        .ok_or_else(|| candle::Error::Msg(format!("fixture '{name}': metadata has no '{key}'")))
}

fn meta_json(meta: &HashMap<String, String>, key: &str, name: &str) -> Result<Value> {
    match meta.get(key) {
        None => Ok(Value::Object(Default::default())),
        Some(s) => serde_json::from_str(s)
            .map_err(|e| candle::Error::Msg(format!("fixture '{name}': metadata '{key}' is not JSON: {e}"))),
    }
}

impl Fixture {
    /// Loads a fixture file onto `device`.
    pub fn load(path: &Path, device: &Device) -> Result<Self> {
        let bytes = std::fs::read(path)
            .map_err(|e| candle::Error::Msg(format!("cannot read fixture {}: {e}", path.display())))?;
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        Self::from_bytes(&name, &bytes, device)
    }

    /// Parses a fixture from the bytes of a safetensors file.
    pub fn from_bytes(name: &str, bytes: &[u8], device: &Device) -> Result<Self> {
        let (_, header) = safetensors::SafeTensors::read_metadata(bytes)
            .map_err(|e| candle::Error::Msg(format!("fixture '{name}': not a safetensors file: {e}")))?;
        let meta = header.metadata().clone().unwrap_or_default();
        let format = meta_str(&meta, "format", name)?;
        if format != FORMAT {
            candle::bail!("fixture '{name}': format is '{format}', expected '{FORMAT}'")
        }
        let kind = meta_str(&meta, "kind", name)?.to_string();
        let dtype = parse_torch_dtype(meta_str(&meta, "dtype", name)?)
            .map_err(|e| candle::Error::Msg(format!("fixture '{name}': {e}")))?;
        let tensors = candle::safetensors::load_buffer(bytes, device)?;
        Ok(Self {
            name: name.to_string(),
            kind,
            dtype,
            config: meta_json(&meta, "config", name)?,
            call: meta_json(&meta, "call", name)?,
            torch_version: meta.get("torch_version").cloned(),
            metadata: meta.clone(),
            tensors,
        })
    }

    /// A stored tensor by its full name (`input.query`, …); an error names what is missing.
    pub fn tensor(&self, key: &str) -> Result<&Tensor> {
        self.tensors.get(key).ok_or_else(|| {
            candle::Error::Msg(format!(
                "fixture '{}' (kind {}) is missing tensor '{key}'",
                self.name, self.kind
            ))
        })
    }

    /// A stored tensor, if present.
    pub fn opt_tensor(&self, key: &str) -> Option<&Tensor> {
        self.tensors.get(key)
    }

    /// A `VarBuilder` over the `param.*` tensors (keys without the prefix), loading in `dtype`.
    pub fn params(&self, dtype: DType, device: &Device) -> VarBuilder<'static> {
        let map: HashMap<String, Tensor> = self
            .tensors
            .iter()
            .filter_map(|(k, v)| k.strip_prefix("param.").map(|k| (k.to_string(), v.clone())))
            .collect();
        VarBuilder::from_tensors(map, dtype, device)
    }

    /// Names of all stored tensors, sorted.
    pub fn tensor_names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.tensors.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }

    /// Runs the fixture and compares every stored output.
    pub fn run(&self, opts: &RunOptions) -> Result<FixtureReport> {
        let dt = opts.dtype.unwrap_or(self.dtype);
        if !matches!(dt, DType::F32 | DType::F64 | DType::F16 | DType::BF16) {
            candle::bail!("fixture '{}': cannot run in {dt:?}", self.name)
        }
        let ctx = Ctx { fx: self, dt, opts };
        let pairs = match self.kind.as_str() {
            "sdpa" => ctx.run_sdpa()?,
            "multihead_attention" => ctx.run_mha()?,
            "notes_sdpa" => ctx.run_notes_sdpa()?,
            "notes_multihead" | "notes_causal" => ctx.run_notes_multihead()?,
            "hf_attention" => ctx.run_hf()?,
            other => candle::bail!(
                "fixture '{}': unknown kind '{other}' (known kinds: {})",
                self.name,
                KINDS.join(", ")
            ),
        };
        let mut max_abs = 0f64;
        let mut max_rel = 0f64;
        for Compared { key, got, rows } in pairs {
            let expected = self.tensor(&key)?;
            let (a, r) = compare(&self.name, &key, &got, expected, rows.as_ref())?;
            max_abs = max_abs.max(a);
            max_rel = max_rel.max(r);
        }
        let tol = tolerance(dt).max(tolerance(self.dtype));
        Ok(FixtureReport {
            name: self.name.clone(),
            kind: self.kind.clone(),
            dtype: dtype_name(dt).to_string(),
            max_abs_err: max_abs,
            max_rel_err: max_rel,
            tol,
            pass: max_rel <= tol,
        })
    }
}

/// The normalised error that [`tolerance`] is held against:
/// `max|got − expected| / max(1, max|expected|)` over every element, in f64. A NaN
/// difference (a NaN on either side, or equal infinities) counts as infinite, and
/// non-finite expected values do not raise the scale. `got` and `expected` must have the
/// same shape (any shape; the dtypes may differ).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_attention::fixture::normalised_error;
///
/// let expected = Tensor::new(&[[4.0f32, -2.0], [0.5, 1.0]], &Device::Cpu)?;
/// let got = Tensor::new(&[[4.0f32, -2.0], [0.5, 1.2]], &Device::Cpu)?;
/// // max |difference| 0.2, scaled by the largest |expected| value, 4.
/// assert!((normalised_error(&got, &expected)? - 0.05).abs() < 1e-6);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn normalised_error(got: &Tensor, expected: &Tensor) -> Result<f64> {
    if got.dims() != expected.dims() {
        candle::bail!(
            "normalised_error: got has shape {:?} but expected has shape {:?}",
            got.dims(),
            expected.dims()
        )
    }
    Ok(errors(&flat_f64(got)?, &flat_f64(expected)?, None).1)
}

fn flat_f64(t: &Tensor) -> Result<Vec<f64>> {
    t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()
}

/// `(max abs error, max abs error / max(1, max|expected|))` over the elements where
/// `keep` is true (every element without it), as [`normalised_error`] defines them.
fn errors(got: &[f64], expected: &[f64], keep: Option<&[bool]>) -> (f64, f64) {
    let mut max_abs = 0f64;
    let mut scale = 1f64;
    for (i, (&g, &e)) in got.iter().zip(expected).enumerate() {
        if keep.is_some_and(|k| !k[i]) {
            continue;
        }
        let d = (g - e).abs();
        max_abs = if d.is_nan() { f64::INFINITY } else { max_abs.max(d) };
        if e.is_finite() {
            scale = scale.max(e.abs());
        }
    }
    (max_abs, max_abs / scale)
}

/// [`errors`] of a fixture output. With `rows` `(B, L)`, only the `(b, l, …)` entries
/// whose row value is non-zero count.
fn compare(
    name: &str,
    key: &str,
    got: &Tensor,
    expected: &Tensor,
    rows: Option<&Tensor>,
) -> Result<(f64, f64)> {
    if got.dims() != expected.dims() {
        candle::bail!(
            "fixture '{name}': '{key}' has shape {:?} but the layer returned {:?}",
            expected.dims(),
            got.dims()
        )
    }
    let g = flat_f64(got)?;
    let e = flat_f64(expected)?;
    let keep: Option<Vec<bool>> = match rows {
        None => None,
        Some(mask) => {
            let r = mask.to_dtype(DType::U8)?.flatten_all()?.to_vec1::<u8>()?;
            if r.is_empty() || g.len() % r.len() != 0 {
                candle::bail!(
                    "fixture '{name}': row mask {:?} does not fit '{key}' {:?}",
                    mask.dims(),
                    got.dims()
                )
            }
            let per = g.len() / r.len();
            Some((0..g.len()).map(|i| r[i / per] != 0).collect())
        }
    };
    Ok(errors(&g, &e, keep.as_deref()))
}

struct Ctx<'a> {
    fx: &'a Fixture,
    dt: DType,
    opts: &'a RunOptions,
}

/// A layer output to compare with the stored tensor `key`, optionally only on the
/// query rows where `rows` `(B, L)` is non-zero.
struct Compared {
    key: String,
    got: Tensor,
    rows: Option<Tensor>,
}

/// Whether `a` and `b` have the same shape, dtype and elements.
fn identical(a: &Tensor, b: &Tensor) -> Result<bool> {
    if a.dims() != b.dims() || a.dtype() != b.dtype() {
        return Ok(false);
    }
    let (a, b) = (a.to_dtype(DType::F64)?, b.to_dtype(DType::F64)?);
    Ok(a.ne(&b)?.to_dtype(DType::U32)?.sum_all()?.to_scalar::<u32>()? == 0)
}

fn out(key: &str, got: Tensor) -> Compared {
    Compared {
        key: key.to_string(),
        got,
        rows: None,
    }
}

type Outputs = Vec<Compared>;

impl Ctx<'_> {
    /// An input, cast to the run dtype if it is a float tensor.
    fn input(&self, name: &str) -> Result<Tensor> {
        self.cast(self.fx.tensor(&format!("input.{name}"))?)
    }

    fn opt_input(&self, name: &str) -> Result<Option<Tensor>> {
        self.fx
            .opt_tensor(&format!("input.{name}"))
            .map(|t| self.cast(t))
            .transpose()
    }

    fn cast(&self, t: &Tensor) -> Result<Tensor> {
        let t = t.to_device(&self.opts.device)?;
        if t.dtype().is_float() {
            t.to_dtype(self.dt)
        } else {
            Ok(t)
        }
    }

    fn params(&self) -> VarBuilder<'static> {
        self.fx.params(self.dt, &self.opts.device)
    }

    fn config<T: serde::de::DeserializeOwned>(&self) -> Result<T> {
        serde_json::from_value(self.fx.config.clone()).map_err(|e| {
            candle::Error::Msg(format!(
                "fixture '{}': bad config for kind {}: {e}",
                self.fx.name, self.fx.kind
            ))
        })
    }

    fn flag(&self, v: &Value, key: &str, default: bool) -> Result<bool> {
        match v.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(other) => candle::bail!("fixture '{}': '{key}' must be a bool, got {other}", self.fx.name),
        }
    }

    /// `v[key]` as a number; absent or null gives `None`.
    fn number(&self, v: &Value, key: &str) -> Result<Option<f64>> {
        match v.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => match x.as_f64() {
                Some(n) => Ok(Some(n)),
                None => candle::bail!("fixture '{}': {key} must be a number, got {x}", self.fx.name),
            },
        }
    }

    fn run_sdpa(&self) -> Result<Outputs> {
        let cfg = &self.fx.config;
        let dropout = self.number(cfg, "dropout_p")?.unwrap_or(0.0);
        if dropout != 0.0 {
            candle::bail!(
                "fixture '{}': dropout_p = {dropout} is not supported (inference only)",
                self.fx.name
            )
        }
        let scale = self.number(cfg, "scale")?;
        let mask = match self.opt_input("attn_mask")? {
            None => None,
            Some(m) if m.dtype().is_float() => Some(AttnMask::additive(&m)?),
            Some(m) => Some(AttnMask::keep(&m)?),
        };
        let opts = SdpaOptions {
            mask,
            is_causal: self.flag(cfg, "is_causal", false)?,
            scale,
            enable_gqa: self.flag(cfg, "enable_gqa", false)?,
            need_weights: false,
            backend: self.opts.backend,
            ..SdpaOptions::default()
        };
        let res = scaled_dot_product_attention(
            &self.input("query")?,
            &self.input("key")?,
            &self.input("value")?,
            &opts,
        )?;
        Ok(vec![out("output.out", res.output)])
    }

    fn run_mha(&self) -> Result<Outputs> {
        let cfg: MultiheadAttentionConfig = self.config()?;
        let mha = MultiheadAttention::new(&cfg, self.params())?;
        let call = &self.fx.call;
        let kpm = self.opt_input("key_padding_mask")?;
        let am = self.opt_input("attn_mask")?;
        let args = MhaArgs {
            key_padding_mask: kpm.as_ref(),
            attn_mask: am.as_ref(),
            need_weights: self.flag(call, "need_weights", true)?,
            average_attn_weights: self.flag(call, "average_attn_weights", true)?,
            is_causal: self.flag(call, "is_causal", false)?,
            backend: self.opts.backend,
        };
        // The exporter calls `mha(x, x, x)` for self-attention, and the layer, like
        // PyTorch's, takes its self-attention path (one input projection) only when
        // query, key and value are the same tensor: pass it so when they are equal.
        let q = self.input("query")?;
        let same_as_q = |t: Tensor| -> Result<Tensor> { Ok(if identical(&q, &t)? { q.clone() } else { t }) };
        let (k, v) = (same_as_q(self.input("key")?)?, same_as_q(self.input("value")?)?);
        let (o, w) = mha.forward_with(&q, &k, &v, &args)?;
        let mut outs = vec![out("output.attn_output", o)];
        match (w, self.fx.opt_tensor("output.attn_weights")) {
            (Some(w), _) => outs.push(out("output.attn_weights", w)),
            (None, Some(_)) => candle::bail!(
                "fixture '{}': stores output.attn_weights but its call has need_weights = false",
                self.fx.name
            ),
            (None, None) => {}
        }
        Ok(outs)
    }

    fn run_notes_sdpa(&self) -> Result<Outputs> {
        let d_k = self.fx.config.get("d_k").and_then(Value::as_u64).ok_or_else(|| {
            candle::Error::Msg(format!("fixture '{}': config needs an integer d_k", self.fx.name))
        })?;
        let layer = ScaledDotProductAttention::new(d_k as usize).with_backend(self.opts.backend);
        let o = layer.forward_qkv(&self.input("query")?, &self.input("key")?, &self.input("value")?)?;
        Ok(vec![out("output.out", o)])
    }

    fn run_notes_multihead(&self) -> Result<Outputs> {
        let cfg: AttentionConfig = self.config()?;
        let (q, k, v) = (self.input("query")?, self.input("key")?, self.input("value")?);
        let o = if self.fx.kind == "notes_causal" {
            CausalAttention::new(&cfg, self.params())?
                .with_backend(self.opts.backend)
                .forward_qkv(&q, &k, &v)?
        } else {
            MultiHeadAttention::new(&cfg, self.params())?
                .with_backend(self.opts.backend)
                .forward_qkv(&q, &k, &v)?
        };
        Ok(vec![out("output.out", o)])
    }
}

impl Ctx<'_> {
    /// `hf_attention`: one Hugging Face attention module, prefill then cached decode steps.
    fn run_hf(&self) -> Result<Outputs> {
        let arch = self.fx.metadata.get("architecture").ok_or_else(|| {
            candle::Error::Msg(format!(
                "fixture '{}': metadata has no 'architecture'",
                self.fx.name
            ))
        })?;
        let hf: HfConfig = self.config()?;
        let call = &self.fx.call;
        let layer_idx = call.get("layer_idx").and_then(Value::as_u64).unwrap_or(0) as usize;
        let cross = self.flag(call, "cross_attention", false)?;
        let cfg = DecoderAttentionConfig::from_hf(arch, &hf, layer_idx, cross)?;
        let layer = DecoderAttention::new(&cfg, self.params())?.with_backend(self.opts.backend);
        // A bidirectional layer encodes the whole sequence in one call, without a cache.
        let mut cache = if cfg.bidirectional {
            None
        } else {
            Some(layer.new_cache()?)
        };
        let mut outs = Vec::new();
        let mut step = 0usize;
        loop {
            let p = if step == 0 {
                "".to_string()
            } else {
                format!("step{step}.")
            };
            if step > 0 && self.fx.opt_tensor(&format!("input.{p}hidden_states")).is_none() {
                break;
            }
            let x = self.input(&format!("{p}hidden_states"))?;
            let mask = self.opt_input(&format!("{p}attention_mask"))?;
            let y = if cross {
                let enc = if step == 0 {
                    Some(self.input("encoder_hidden_states")?)
                } else {
                    None
                };
                layer.forward_cross(&x, enc.as_ref(), cache.as_mut())?
            } else {
                let pos = self.input(&format!("{p}position_ids"))?;
                layer.forward_cached(&x, &pos, mask.as_ref(), cache.as_mut())?
            };
            // Rows of padding queries are unspecified: compare real tokens only.
            let l = x.dim(1)?;
            let rows = match &mask {
                Some(m) => {
                    let cols = m.dim(1)?;
                    if cols < l {
                        candle::bail!(
                            "fixture '{}': 'input.{p}attention_mask' {:?} has fewer than the \
                             step's {l} query rows",
                            self.fx.name,
                            m.dims()
                        )
                    }
                    Some(m.narrow(1, cols - l, l)?)
                }
                None => None,
            };
            outs.push(Compared {
                key: format!("output.{p}attn_output"),
                got: y,
                rows,
            });
            step += 1;
        }
        Ok(outs)
    }
}

/// Every `*.safetensors` file in the given files and folders (folders are not
/// searched recursively), sorted by path.
pub fn fixture_paths(paths: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for p in paths {
        if p.is_dir() {
            let rd = std::fs::read_dir(p)
                .map_err(|e| candle::Error::Msg(format!("cannot list {}: {e}", p.display())))?;
            for entry in rd {
                let path = entry
                    .map_err(|e| candle::Error::Msg(format!("cannot list {}: {e}", p.display())))?
                    .path();
                if path.extension().is_some_and(|x| x == "safetensors") {
                    out.push(path);
                }
            }
        } else if p.is_file() {
            out.push(p.clone());
        } else {
            candle::bail!("no fixture file or folder at {}", p.display())
        }
    }
    out.sort();
    Ok(out)
}

/// Loads and runs one fixture file.
pub fn run_fixture_file(path: &Path, opts: &RunOptions) -> Result<FixtureReport> {
    Fixture::load(path, &opts.device)?.run(opts)
}
