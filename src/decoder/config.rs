//! Decoder attention configuration, and its construction from a Hugging Face `config.json`.
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::rope::{RopeConfig, RopeScaling, RopeStyle};
use candle::Result;

/// How the Q/K/V/O projections are stored in the checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum QkvLayout {
    /// Four `nn.Linear`s, `<name>.weight` `(out, in)` (Llama, Mistral, Qwen, Gemma, gpt-oss, Whisper).
    Separate {
        /// Query projection name.
        q: String,
        /// Key projection name.
        k: String,
        /// Value projection name.
        v: String,
        /// Output projection name.
        o: String,
        /// The query projection has a bias.
        q_bias: bool,
        /// The key projection has a bias.
        k_bias: bool,
        /// The value projection has a bias.
        v_bias: bool,
        /// The output projection has a bias.
        o_bias: bool,
    },
    /// GPT-2's `Conv1D`s: `<qkv>.weight` `(hidden, 3·hidden)` (transposed), always with biases.
    Conv1dPacked {
        /// The packed projection (`c_attn`).
        qkv: String,
        /// The output projection (`c_proj`).
        o: String,
    },
    /// One linear whose output is `(H, 3, head_dim)` per token: GPT-NeoX and BLOOM's `query_key_value`.
    HeadInterleaved {
        /// The packed projection (`query_key_value`).
        qkv: String,
        /// The output projection (`dense`).
        o: String,
        /// Both projections have biases.
        bias: bool,
    },
    /// One linear whose output is `[q | k | v]` (Phi-3's `qkv_proj`).
    Packed {
        /// The packed projection (`qkv_proj`).
        qkv: String,
        /// The output projection (`o_proj`).
        o: String,
        /// The packed projection has a bias.
        qkv_bias: bool,
        /// The output projection has a bias.
        o_bias: bool,
    },
}

impl QkvLayout {
    /// `q_proj`, `k_proj`, `v_proj`, `o_proj`, with the given biases.
    pub fn separate(q_bias: bool, k_bias: bool, v_bias: bool, o_bias: bool) -> Self {
        Self::Separate {
            q: "q_proj".into(),
            k: "k_proj".into(),
            v: "v_proj".into(),
            o: "o_proj".into(),
            q_bias,
            k_bias,
            v_bias,
            o_bias,
        }
    }
}

/// Per-head RMSNorm on queries and keys (Qwen3, Gemma 3): weights `q_norm.weight`,
/// `k_norm.weight` `(head_dim)`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct QkNorm {
    /// Added to the mean square (`rms_norm_eps`).
    pub eps: f64,
    /// Gemma's RMSNorm multiplies by `1 + weight` instead of `weight`.
    pub unit_offset: bool,
}

/// Everything the [`super::DecoderAttention`] layer needs, independent of the model family.
#[derive(Clone, Debug, PartialEq)]
pub struct DecoderAttentionConfig {
    /// Model width.
    pub hidden_size: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (GQA/MQA); must divide `num_heads`.
    pub num_kv_heads: usize,
    /// Size of one head (need not be `hidden_size / num_heads`).
    pub head_dim: usize,
    /// How the projections are stored.
    pub layout: QkvLayout,
    /// Per-head RMSNorm of queries and keys.
    pub qk_norm: Option<QkNorm>,
    /// Rotary embedding, if any.
    pub rope: Option<RopeConfig>,
    /// ALiBi bias (BLOOM's slopes).
    pub alibi: bool,
    /// Logit soft-cap (Gemma 2).
    pub softcap: Option<f64>,
    /// Learned per-head sinks, weight `sinks` `(num_heads)` (gpt-oss).
    pub sinks: bool,
    /// Causal sliding window of exactly this many keys; with `bidirectional`, the keys
    /// less than this many positions away on either side.
    pub sliding_window: Option<usize>,
    /// Each token attends to the tokens after it as well as before (Gemma 3's
    /// `use_bidirectional_attention`, as in EmbeddingGemma): no causal mask, only the
    /// padding mask and the two-sided `sliding_window`. Such a layer encodes a whole
    /// sequence per call and runs without a KV cache.
    pub bidirectional: bool,
    /// Multiplier of `q · k`.
    pub scale: f64,
    /// Keys and values come from the encoder; no causal mask.
    pub cross_attention: bool,
    /// Largest position id accepted (exclusive), when the model declares one.
    pub max_position_embeddings: Option<usize>,
}

/// The fields of a Hugging Face `config.json` that attention layers read. Every field is
/// optional here; [`DecoderAttentionConfig::from_hf`] says which one is missing.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HfConfig {
    /// `model_type` in `config.json`.
    pub model_type: Option<String>,
    /// `hidden_size` in `config.json`.
    pub hidden_size: Option<usize>,
    /// GPT-2's name for `hidden_size`.
    pub n_embd: Option<usize>,
    /// Whisper's name for `hidden_size`.
    pub d_model: Option<usize>,
    /// `num_attention_heads` in `config.json`.
    pub num_attention_heads: Option<usize>,
    /// GPT-2 / BLOOM's name for `num_attention_heads`.
    pub n_head: Option<usize>,
    /// `decoder_attention_heads` in `config.json`.
    pub decoder_attention_heads: Option<usize>,
    /// `num_key_value_heads` in `config.json`.
    pub num_key_value_heads: Option<usize>,
    /// `head_dim` in `config.json`.
    pub head_dim: Option<usize>,
    /// `sliding_window` in `config.json`: every layer's window for Mistral and Phi-3, the
    /// `"sliding_attention"` layers' window for Gemma 2/3, gpt-oss and Qwen2/3.
    ///
    /// `None` when config.json has no such key: the config class's default then applies, as
    /// in transformers (4096 for Mistral, Qwen2/3 and Gemma 2/3, 128 for gpt-oss, no window
    /// for Phi-3). `Some(None)` is `"sliding_window": null`, no window.
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    pub sliding_window: Option<Option<usize>>,
    /// `use_sliding_window` in `config.json` (Qwen2/3): without it, `sliding_window` is ignored.
    pub use_sliding_window: Option<bool>,
    /// `max_window_layers` in `config.json` (Qwen2/3, default 28): without `layer_types`, the
    /// layers from this index on are sliding.
    pub max_window_layers: Option<usize>,
    /// `layer_types` in `config.json` (Gemma 2/3, gpt-oss, Qwen2/3). When it is absent,
    /// [`DecoderAttentionConfig::from_hf`] derives it as transformers' config class does.
    pub layer_types: Option<Vec<String>>,
    /// `sliding_window_pattern` in `config.json` (Gemma 3, default 6): without `layer_types`,
    /// every `sliding_window_pattern`-th layer is full, the others sliding.
    pub sliding_window_pattern: Option<usize>,
    /// `attention_bias` in `config.json`.
    pub attention_bias: Option<bool>,
    /// `partial_rotary_factor` in `config.json` (Phi-3; GPT-NeoX's config class ignores it
    /// at the top level).
    pub partial_rotary_factor: Option<f64>,
    /// GPT-NeoX's name for `partial_rotary_factor`, the only one its config class reads at
    /// the top level.
    pub rotary_pct: Option<f64>,
    /// `rope_theta` in `config.json` (ignored at the top level for GPT-NeoX).
    pub rope_theta: Option<f64>,
    /// GPT-NeoX's name for `rope_theta`, the only one its config class reads at the top
    /// level.
    pub rotary_emb_base: Option<f64>,
    /// transformers < 5: `{"rope_type"|"type", "factor", …}`.
    pub rope_scaling: Option<Value>,
    /// transformers 5: `{"rope_type", "rope_theta", "factor", …}`, possibly one per layer type.
    pub rope_parameters: Option<Value>,
    /// `rope_local_base_freq` in `config.json` (Gemma 3, default 10000): the theta of the
    /// sliding layers' plain rope, when `rope_parameters` has no `"sliding_attention"` entry.
    pub rope_local_base_freq: Option<f64>,
    /// `max_position_embeddings` in `config.json`.
    pub max_position_embeddings: Option<usize>,
    /// `n_positions` in `config.json`.
    pub n_positions: Option<usize>,
    /// `original_max_position_embeddings` in `config.json`: for llama3, yarn and longrope
    /// ropes shared by every layer it replaces the one in the rope parameters, as
    /// transformers' `standardize_rope_params` does (Phi3Config's default is 4096).
    pub original_max_position_embeddings: Option<usize>,
    /// `rms_norm_eps` in `config.json`.
    pub rms_norm_eps: Option<f64>,
    /// `attn_logit_softcapping` in `config.json`.
    pub attn_logit_softcapping: Option<f64>,
    /// `query_pre_attn_scalar` in `config.json`.
    pub query_pre_attn_scalar: Option<f64>,
    /// `scale_attn_weights` in `config.json`.
    pub scale_attn_weights: Option<bool>,
    /// `scale_attn_by_inverse_layer_idx` in `config.json`.
    pub scale_attn_by_inverse_layer_idx: Option<bool>,
    /// `rotary_emb_interleaved` in `config.json`.
    pub rotary_emb_interleaved: Option<bool>,
    /// `qkv_bias` in `config.json` (Qwen2-MoE, default true): biases on the q, k and v
    /// projections.
    pub qkv_bias: Option<bool>,
    /// `use_bias` in `config.json` (StarCoder2, default true): biases on all four
    /// projections.
    pub use_bias: Option<bool>,
    /// `attention_multiplier` in `config.json` (Granite, default 1): the multiplier of
    /// `q · k`, instead of `head_dim^-1/2`.
    pub attention_multiplier: Option<f64>,
    /// `use_bidirectional_attention` in `config.json` (Gemma 3, as in EmbeddingGemma): every
    /// layer attends both ways, and the sliding layers to the tokens less than
    /// `sliding_window / 2 + 1` positions away, as `Gemma3TextConfig` halves the window.
    pub use_bidirectional_attention: Option<bool>,
}

/// The architectures [`DecoderAttentionConfig::from_hf`] knows (Hugging Face `model_type`s).
pub const ARCHITECTURES: &[&str] = &[
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "phi3",
    "gpt2",
    "gpt_neox",
    "bloom",
    "gpt_oss",
    "whisper",
    "mixtral",
    "gemma",
    "qwen2_moe",
    "qwen3_moe",
    "starcoder2",
    "granite",
];

/// Deserializes a key that is present (possibly `null`) as `Some(value)`; with
/// `#[serde(default)]` an absent key stays `None`.
fn present<'de, D, T>(d: D) -> std::result::Result<Option<Option<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(d).map(Some)
}

fn missing(arch: &str, field: &str) -> candle::Error {
    candle::Error::Msg(format!("{arch} config: missing field '{field}'"))
}

fn num(v: &Value, key: &str) -> Option<f64> {
    v.get(key).and_then(Value::as_f64)
}

const SLIDING: &str = "sliding_attention";
const FULL: &str = "full_attention";

impl HfConfig {
    /// Parses the JSON text of a `config.json`.
    pub fn from_json(text: &str) -> Result<Self> {
        serde_json::from_str(text).map_err(|e| candle::Error::Msg(format!("bad Hugging Face config: {e}")))
    }

    /// `rope_parameters`, unless a non-empty `rope_scaling` replaces it (transformers 5.25's
    /// `convert_rope_params_to_dict`).
    fn rope_parameters_in_force(&self) -> Option<&serde_json::Map<String, Value>> {
        match (&self.rope_scaling, &self.rope_parameters) {
            (Some(Value::Object(rs)), _) if !rs.is_empty() => None,
            (_, Some(Value::Object(rp))) => Some(rp),
            _ => None,
        }
    }

    /// The rope parameters for `layer_type`, as `convert_rope_params_to_dict` picks them
    /// (transformers 5.25): a non-empty `rope_scaling` (the older spelling) replaces
    /// `rope_parameters` whole; else transformers 5's `rope_parameters`, flat or per layer
    /// type. A theta missing there is the top-level `rope_theta`, or for GPT-NeoX, whose
    /// config class reads only its own names, `rotary_emb_base`.
    fn rope_params(&self, arch: &str, layer_type: Option<&str>) -> Value {
        let mut out = serde_json::Map::new();
        match (&self.rope_scaling, self.rope_parameters_in_force()) {
            (Some(Value::Object(rs)), _) if !rs.is_empty() => out.extend(rs.clone()),
            (_, Some(rp)) => {
                let nested = layer_type.and_then(|t| rp.get(t)).and_then(Value::as_object);
                match nested {
                    Some(inner) => out.extend(inner.clone()),
                    None => out.extend(rp.clone()),
                }
            }
            _ => {}
        }
        let theta = if arch == "gpt_neox" {
            self.rotary_emb_base
        } else {
            self.rope_theta
        };
        if let Some(t) = theta {
            out.entry("rope_theta").or_insert(Value::from(t));
        }
        Value::Object(out)
    }

    /// Gemma 3's rope for `layer_type`, as `Gemma3TextConfig.convert_rope_params_to_dict`
    /// builds it (transformers 5.25): `rope_parameters[layer_type]` when config.json nests
    /// one, else the default rope; `rope_scaling` updates the full layers' only; a missing
    /// theta is `rope_theta` on full layers and `rope_local_base_freq` (default 10000) on
    /// sliding ones.
    fn gemma3_rope_params(&self, arch: &str, layer_type: &str) -> Result<Value> {
        let mut out = serde_json::Map::new();
        match &self.rope_parameters {
            None | Some(Value::Null) => {}
            Some(Value::Object(rp)) if rp.contains_key(SLIDING) || rp.contains_key(FULL) => {
                if let Some(Value::Object(inner)) = rp.get(layer_type) {
                    out.extend(inner.clone());
                }
            }
            Some(Value::Object(rp)) if rp.is_empty() => {}
            Some(_) => candle::bail!(
                "{arch} config: rope_parameters must be nested by layer type ('{SLIDING}', '{FULL}'); \
                 transformers ignores a flat one"
            ),
        }
        out.entry("rope_type").or_insert(Value::from("default"));
        if layer_type == FULL {
            if let Some(Value::Object(rs)) = &self.rope_scaling {
                out.extend(rs.clone());
            }
        }
        let theta = if layer_type == SLIDING {
            Some(self.rope_local_base_freq.unwrap_or(10_000.0))
        } else {
            self.rope_theta
        };
        if let Some(t) = theta {
            out.entry("rope_theta").or_insert(Value::from(t));
        }
        Ok(Value::Object(out))
    }

    /// `sliding_window`, or when config.json has no such key, the default of `arch`'s config
    /// class (transformers 5.25): 128 for gpt-oss, none for Phi-3, Mixtral and StarCoder2,
    /// 4096 for the others that have a window.
    fn window(&self, arch: &str) -> Option<usize> {
        match self.sliding_window {
            Some(w) => w,
            None => match arch {
                "gpt_oss" => Some(128),
                "mistral" | "qwen2" | "qwen3" | "qwen2_moe" | "qwen3_moe" | "gemma2" | "gemma3_text" => {
                    Some(4096)
                }
                _ => None,
            },
        }
    }

    /// Qwen2/3's (and their MoE variants') `sliding_window`: their config classes drop it
    /// unless `use_sliding_window`.
    fn qwen_window(&self, arch: &str) -> Option<usize> {
        self.window(arch)
            .filter(|_| self.use_sliding_window == Some(true))
    }
}

impl DecoderAttentionConfig {
    /// The attention of layer `layer_idx` of a Hugging Face model of type `architecture`
    /// (one of [`ARCHITECTURES`]). `cross_attention` selects Whisper's `encoder_attn`.
    pub fn from_hf(
        architecture: &str,
        cfg: &HfConfig,
        layer_idx: usize,
        cross_attention: bool,
    ) -> Result<Self> {
        let arch = architecture;
        if !ARCHITECTURES.contains(&arch) {
            candle::bail!(
                "unknown architecture '{arch}' (known: {})",
                ARCHITECTURES.join(", ")
            )
        }
        if cross_attention && arch != "whisper" {
            candle::bail!("{arch} has no cross-attention (only whisper does)")
        }
        let hidden = cfg
            .hidden_size
            .or(cfg.n_embd)
            .or(cfg.d_model)
            .ok_or_else(|| missing(arch, "hidden_size"))?;
        let heads = match arch {
            "whisper" => cfg
                .decoder_attention_heads
                .ok_or_else(|| missing(arch, "decoder_attention_heads"))?,
            _ => cfg
                .num_attention_heads
                .or(cfg.n_head)
                .ok_or_else(|| missing(arch, "num_attention_heads"))?,
        };
        if heads == 0 {
            candle::bail!("{arch} config: num_attention_heads must be positive")
        }
        let kv_heads = cfg.num_key_value_heads.unwrap_or(heads);
        let head_dim = match cfg.head_dim {
            Some(d) => d,
            // `GemmaConfig.head_dim` defaults to 256, whatever hidden_size / heads is.
            None if arch == "gemma" => 256,
            None => {
                if !hidden.is_multiple_of(heads) {
                    candle::bail!(
                        "{arch} config: hidden_size {hidden} is not divisible by num_attention_heads {heads}"
                    )
                }
                hidden / heads
            }
        };
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            candle::bail!("{arch} config: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        }
        let layer_type = Self::layer_type(arch, cfg, layer_idx)?;
        let sliding = match (arch, layer_type) {
            // Their modeling code passes `config.sliding_window` to every layer.
            ("mistral" | "mixtral" | "phi3" | "starcoder2", _) => cfg.window(arch),
            // Qwen3-MoE passes `config.sliding_window` (kept only with `use_sliding_window`)
            // to every layer.
            ("qwen3_moe", _) => cfg.qwen_window(arch),
            ("qwen2" | "qwen3", Some(SLIDING)) => cfg.qwen_window(arch),
            // `Qwen2MoeConfig` sets the window to 0 without `use_sliding_window`, which a
            // sliding layer (from an explicit `layer_types`) cannot use, and transformers
            // cannot run a null one.
            ("qwen2_moe", Some(SLIDING)) => match cfg.qwen_window(arch) {
                Some(w) => Some(w),
                None if cfg.use_sliding_window != Some(true) => candle::bail!(
                    "{arch} config: layer {layer_idx} is a sliding_attention layer, but use_sliding_window \
                     is not set (Qwen2MoeConfig then gives it a window of 0)"
                ),
                None => candle::bail!(
                    "{arch} config: layer {layer_idx} is a sliding_attention layer, but sliding_window is null"
                ),
            },
            (_, Some(SLIDING)) => cfg.window(arch),
            _ => None,
        };
        let bidirectional = cfg.use_bidirectional_attention == Some(true);
        // `Gemma3TextConfig.__post_init__` halves the window of a bidirectional model
        // (`sliding_window // 2 + 1`, the exclusive bound on the distance |i - j|), and its
        // `to_dict` writes `(w - 1) * 2` back, which halves to the same bound again (a
        // window of 1 is saved as 0, which means 1 here). Gemma's and Gemma 2's modeling
        // code only turns off `is_causal`, which changes the result with some attention
        // implementations and not others.
        let sliding = match arch {
            "gemma3_text" if bidirectional => sliding.map(|w| w / 2 + 1),
            "gemma" | "gemma2" if bidirectional => candle::bail!(
                "{arch} config: use_bidirectional_attention is not supported for {arch} \
                 (transformers' model keeps its causal masks and only turns off is_causal)"
            ),
            _ => sliding,
        };
        if sliding == Some(0) {
            candle::bail!("{arch} config: sliding_window must be at least 1")
        }
        let default_scale = 1.0 / (head_dim as f64).sqrt();
        let bias = cfg.attention_bias;
        let max_pos = cfg.max_position_embeddings.or(cfg.n_positions);
        let mut out = Self {
            hidden_size: hidden,
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            layout: QkvLayout::separate(false, false, false, false),
            qk_norm: None,
            rope: None,
            alibi: false,
            softcap: None,
            sinks: false,
            sliding_window: sliding,
            bidirectional: bidirectional && arch == "gemma3_text",
            scale: default_scale,
            cross_attention,
            max_position_embeddings: max_pos,
        };
        // Gemma scales by query_pre_attn_scalar^-1/2 instead of head_dim^-1/2.
        let gemma_scale = || -> Result<f64> {
            let s = cfg
                .query_pre_attn_scalar
                .ok_or_else(|| missing(arch, "query_pre_attn_scalar"))?;
            if !(s.is_finite() && s > 0.0) {
                candle::bail!("{arch} config: query_pre_attn_scalar must be finite and positive, got {s}")
            }
            Ok(1.0 / s.sqrt())
        };
        let rope = |style: RopeStyle| Self::rope_from_hf(arch, cfg, head_dim, layer_type, style).map(Some);
        match arch {
            "llama" | "mistral" | "mixtral" | "gpt_oss" | "phi3" | "gemma" | "starcoder2" | "granite" => {
                // Mistral's, Mixtral's and Phi-3's modeling code builds its projections
                // without biases whatever `attention_bias` says; gpt-oss defaults to them;
                // StarCoder2 reads `use_bias` (default true) instead.
                let b = match arch {
                    "mistral" | "mixtral" | "phi3" => false,
                    "starcoder2" => cfg.use_bias.unwrap_or(true),
                    _ => bias.unwrap_or(arch == "gpt_oss"),
                };
                if arch == "granite" {
                    // `GraniteAttention.scaling = config.attention_multiplier` (default 1).
                    let m = cfg.attention_multiplier.unwrap_or(1.0);
                    if !m.is_finite() {
                        candle::bail!("{arch} config: attention_multiplier must be finite, got {m}")
                    }
                    out.scale = m;
                }
                out.layout = if arch == "phi3" {
                    QkvLayout::Packed {
                        qkv: "qkv_proj".into(),
                        o: "o_proj".into(),
                        qkv_bias: b,
                        o_bias: b,
                    }
                } else {
                    QkvLayout::separate(b, b, b, b)
                };
                out.sinks = arch == "gpt_oss";
                out.rope = rope(RopeStyle::HalfSplit)?;
            }
            "qwen2" | "qwen2_moe" => {
                let b = arch == "qwen2" || cfg.qkv_bias.unwrap_or(true);
                out.layout = QkvLayout::separate(b, b, b, false);
                out.rope = rope(RopeStyle::HalfSplit)?;
            }
            "qwen3" | "qwen3_moe" | "gemma3_text" => {
                let b = bias.unwrap_or(false);
                out.layout = QkvLayout::separate(b, b, b, b);
                out.qk_norm = Some(QkNorm {
                    eps: cfg.rms_norm_eps.unwrap_or(1e-6),
                    unit_offset: arch == "gemma3_text",
                });
                out.rope = rope(RopeStyle::HalfSplit)?;
                if arch == "gemma3_text" {
                    out.scale = gemma_scale()?;
                    // `Gemma3Attention` keeps `attn_logit_softcapping` but never passes it to
                    // the attention function (transformers 5.25), so it is not applied.
                }
            }
            "gemma2" => {
                let b = bias.unwrap_or(false);
                out.layout = QkvLayout::separate(b, b, b, b);
                out.rope = rope(RopeStyle::HalfSplit)?;
                out.scale = gemma_scale()?;
                out.softcap = cfg.attn_logit_softcapping;
            }
            "gpt2" => {
                out.layout = QkvLayout::Conv1dPacked {
                    qkv: "c_attn".into(),
                    o: "c_proj".into(),
                };
                out.scale = if cfg.scale_attn_weights.unwrap_or(true) {
                    default_scale
                } else {
                    1.0
                };
                if cfg.scale_attn_by_inverse_layer_idx.unwrap_or(false) {
                    out.scale /= layer_idx as f64 + 1.0;
                }
            }
            "gpt_neox" => {
                out.layout = QkvLayout::HeadInterleaved {
                    qkv: "query_key_value".into(),
                    o: "dense".into(),
                    bias: bias.unwrap_or(true),
                };
                let style = if cfg.rotary_emb_interleaved == Some(true) {
                    RopeStyle::Interleaved
                } else {
                    RopeStyle::HalfSplit
                };
                out.rope = rope(style)?;
            }
            "bloom" => {
                out.layout = QkvLayout::HeadInterleaved {
                    qkv: "query_key_value".into(),
                    o: "dense".into(),
                    bias: true,
                };
                out.alibi = true;
            }
            "whisper" => {
                out.layout = QkvLayout::Separate {
                    q: "q_proj".into(),
                    k: "k_proj".into(),
                    v: "v_proj".into(),
                    o: "out_proj".into(),
                    q_bias: true,
                    k_bias: false,
                    v_bias: true,
                    o_bias: true,
                };
            }
            _ => unreachable!("architecture list checked above"),
        }
        Ok(out)
    }

    /// The type of layer `layer_idx` for the architectures whose modeling code has layer
    /// types (Gemma 2/3, gpt-oss, Qwen2/3, Qwen2-MoE; `None` for the others, which ignore
    /// `layer_types`): `layer_types[layer_idx]`, or when config.json has no `layer_types`,
    /// what the config class's `__init__` derives (transformers 5.25).
    fn layer_type<'a>(arch: &str, cfg: &'a HfConfig, layer_idx: usize) -> Result<Option<&'a str>> {
        if !matches!(
            arch,
            "gemma2" | "gemma3_text" | "gpt_oss" | "qwen2" | "qwen3" | "qwen2_moe"
        ) {
            return Ok(None);
        }
        if let Some(types) = &cfg.layer_types {
            return match types.get(layer_idx) {
                Some(t) => Ok(Some(t.as_str())),
                None => candle::bail!("{arch} config: layer_types has no entry for layer {layer_idx}"),
            };
        }
        let sliding = match arch {
            // Gemma2Config, GptOssConfig: sliding, full, sliding, full, …
            "gemma2" | "gpt_oss" => layer_idx.is_multiple_of(2),
            // Gemma3TextConfig: every `sliding_window_pattern`-th layer is full.
            "gemma3_text" => {
                let pattern = cfg.sliding_window_pattern.unwrap_or(6);
                if pattern == 0 {
                    candle::bail!("{arch} config: sliding_window_pattern must be at least 1, got 0")
                }
                // `(layer_idx + 1) % pattern != 0`, without overflow at `usize::MAX`.
                layer_idx % pattern != pattern - 1
            }
            // Qwen2MoeConfig: the even layers below `max_window_layers`, with `use_sliding_window`.
            "qwen2_moe" => {
                layer_idx.is_multiple_of(2)
                    && layer_idx < cfg.max_window_layers.unwrap_or(28)
                    && cfg.use_sliding_window == Some(true)
            }
            // Qwen2Config, Qwen3Config: sliding from `max_window_layers` on, if a window is used.
            _ => cfg.qwen_window(arch).is_some() && layer_idx >= cfg.max_window_layers.unwrap_or(28),
        };
        Ok(Some(if sliding { SLIDING } else { FULL }))
    }

    fn rope_from_hf(
        arch: &str,
        cfg: &HfConfig,
        head_dim: usize,
        layer_type: Option<&str>,
        style: RopeStyle,
    ) -> Result<RopeConfig> {
        let p = match (arch, layer_type) {
            ("gemma3_text", Some(t)) => cfg.gemma3_rope_params(arch, t)?,
            _ => cfg.rope_params(arch, layer_type),
        };
        // `rope_scaling: {}` names no rope: transformers' `rope_scaling or rope_parameters`
        // skips an empty dict.
        let named = |v: &Option<Value>| {
            v.as_ref()
                .is_some_and(|v| !v.is_null() && v.as_object().is_none_or(|o| !o.is_empty()))
        };
        let p = if arch == "gpt_oss" && !named(&cfg.rope_scaling) && !named(&cfg.rope_parameters) {
            // `GptOssConfig.__post_init__` (transformers 5.25): yarn ×32 when config.json
            // names no rope.
            let mut m = p.as_object().cloned().unwrap_or_default();
            for (k, v) in [
                ("rope_type", Value::from("yarn")),
                ("factor", Value::from(32.0)),
                ("beta_fast", Value::from(32.0)),
                ("beta_slow", Value::from(1.0)),
                ("truncate", Value::from(false)),
                ("original_max_position_embeddings", Value::from(4096)),
            ] {
                m.entry(k).or_insert(v);
            }
            Value::Object(m)
        } else {
            p
        };
        // A config.json without `rope_theta` gets its config class's default (transformers
        // 5.25): 1e6 for Gemma 3's full layers (its sliding ones default above), 150000 for
        // gpt-oss, 1e6 for Mixtral, 10000 for the others.
        let theta = num(&p, "rope_theta").unwrap_or(match arch {
            "gemma3_text" | "mixtral" => 1e6,
            "gpt_oss" => 150_000.0,
            _ => 10_000.0,
        });
        // Only GPT-NeoX's and Phi-3's modeling code rotates part of the head. The others'
        // (Llama, Mistral, Mixtral, Qwen2/3 and their MoE variants, Gemma 1/2/3, gpt-oss)
        // compute the default rope over the whole head and ignore `partial_rotary_factor` (transformers 5.25; with a scaled
        // rope type they apply it to the frequencies and then fail on the shapes).
        // A factor missing from the rope parameters is the top-level one: `rotary_pct`
        // (default 0.25) for GPT-NeoX, whose config class ignores `partial_rotary_factor`
        // there, and `partial_rotary_factor` (default 1) for Phi-3.
        let partial = match arch {
            "gpt_neox" => num(&p, "partial_rotary_factor")
                .or(cfg.rotary_pct)
                .unwrap_or(0.25),
            "phi3" => num(&p, "partial_rotary_factor")
                .or(cfg.partial_rotary_factor)
                .unwrap_or(1.0),
            _ => 1.0,
        };
        let rotary_dim = (head_dim as f64 * partial) as usize;
        let kind = p
            .get("rope_type")
            .or_else(|| p.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        // `Phi3Config.convert_rope_params_to_dict` renames the older "su" and "yarn" to
        // "longrope", and its `validate_rope` accepts only "default" and "longrope"
        // (transformers 5.25).
        let kind = match kind {
            "su" | "yarn" if arch == "phi3" => "longrope",
            "default" | "longrope" => kind,
            other if arch == "phi3" => candle::bail!(
                "{arch} config: unsupported rope_type '{other}' (Phi3Config accepts default and longrope; \
                 su and yarn mean longrope)"
            ),
            other => other,
        };
        let need = |key: &str| num(&p, key).ok_or_else(|| missing(arch, &format!("rope_parameters.{key}")));
        // Phi3Config declares `max_position_embeddings` and `original_max_position_embeddings`,
        // both 4096 by default.
        let max_pos = cfg
            .max_position_embeddings
            .or((arch == "phi3").then_some(4096))
            .map(|v| v as f64);
        // `standardize_rope_params` (transformers 5.25): for one rope shared by every layer, a
        // top-level `original_max_position_embeddings` replaces the one in the rope parameters
        // (Phi3Config always has one); a rope nested by layer type keeps its own. Without
        // either, `max_position_embeddings`.
        let nested = match (arch, layer_type) {
            ("gemma3_text", Some(_)) => true,
            (_, Some(t)) => cfg
                .rope_parameters_in_force()
                .is_some_and(|rp| rp.get(t).is_some_and(Value::is_object)),
            _ => false,
        };
        let top_original = match arch {
            _ if nested => None,
            "phi3" => Some(cfg.original_max_position_embeddings.unwrap_or(4096)),
            _ => cfg.original_max_position_embeddings,
        };
        let original = || -> Result<f64> {
            top_original
                .map(|v| v as f64)
                .or(num(&p, "original_max_position_embeddings"))
                .or(max_pos)
                .ok_or_else(|| missing(arch, "rope_parameters.original_max_position_embeddings"))
        };
        let scaling = match kind {
            "default" => RopeScaling::Default,
            "linear" => RopeScaling::Linear {
                factor: need("factor")?,
            },
            // `_compute_dynamic_ntk_parameters` scales from `config.max_position_embeddings`
            // (which the layer's position check also bounds: within it, the rope is plain).
            "dynamic" => RopeScaling::DynamicNtk {
                factor: need("factor")?,
                max_position_embeddings: max_pos.ok_or_else(|| missing(arch, "max_position_embeddings"))?,
            },
            "llama3" => RopeScaling::Llama3 {
                factor: need("factor")?,
                low_freq_factor: need("low_freq_factor")?,
                high_freq_factor: need("high_freq_factor")?,
                original_max_position_embeddings: original()?,
            },
            "yarn" => {
                let original = original()?;
                let factor = match num(&p, "factor") {
                    Some(f) => f,
                    None => {
                        cfg.max_position_embeddings
                            .ok_or_else(|| missing(arch, "rope_parameters.factor"))?
                            as f64
                            / original
                    }
                };
                RopeScaling::Yarn {
                    factor,
                    original_max_position_embeddings: original,
                    beta_fast: num(&p, "beta_fast").filter(|b| *b != 0.0).unwrap_or(32.0),
                    beta_slow: num(&p, "beta_slow").filter(|b| *b != 0.0).unwrap_or(1.0),
                    attention_factor: num(&p, "attention_factor"),
                    mscale: num(&p, "mscale"),
                    mscale_all_dim: num(&p, "mscale_all_dim"),
                    truncate: p.get("truncate").and_then(Value::as_bool).unwrap_or(true),
                }
            }
            "longrope" => {
                let original = original()?;
                // `_compute_longrope_parameters`: `factor`, else max_position_embeddings / original.
                let factor = match num(&p, "factor") {
                    Some(f) => f,
                    None => max_pos.ok_or_else(|| missing(arch, "rope_parameters.factor"))? / original,
                };
                let half = rotary_dim / 2;
                let list = |key: &str| -> Result<Vec<f64>> {
                    let values = match p.get(key) {
                        None | Some(Value::Null) => {
                            return Err(missing(arch, &format!("rope_parameters.{key}")))
                        }
                        Some(Value::Array(a)) => a,
                        Some(other) => {
                            candle::bail!(
                                "{arch} config: rope_parameters.{key} must be a list of numbers, got {other}"
                            )
                        }
                    };
                    let values = values
                        .iter()
                        .enumerate()
                        .map(|(i, v)| {
                            v.as_f64().ok_or_else(|| {
                                candle::Error::Msg(format!(
                                    "{arch} config: rope_parameters.{key}[{i}] must be a number, got {v}"
                                ))
                            })
                        })
                        .collect::<Result<Vec<f64>>>()?;
                    if values.len() != half {
                        candle::bail!(
                            "{arch} config: rope_parameters.{key} has {} entries, but the rope rotates \
                             {rotary_dim} dims of each head (head_dim {head_dim} × partial_rotary_factor {partial}), \
                             so it needs rotary_dim/2 = {half}",
                            values.len()
                        )
                    }
                    Ok(values)
                };
                RopeScaling::LongRope {
                    short_factor: list("short_factor")?,
                    long_factor: list("long_factor")?,
                    original_max_position_embeddings: original,
                    factor,
                    attention_factor: num(&p, "attention_factor"),
                }
            }
            other => candle::bail!(
                "{arch} config: unsupported rope_type '{other}' (default, linear, dynamic, llama3, yarn, longrope)"
            ),
        };
        Ok(RopeConfig {
            head_dim,
            rotary_dim,
            theta,
            style,
            scaling,
        })
    }
}
