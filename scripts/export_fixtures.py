#!/usr/bin/env python3
"""Export the PyTorch reference fixtures used by the candle-attention tests.

Setup (CPU-only is enough):

    python3 -m venv /tmp/venv && /tmp/venv/bin/pip install torch safetensors numpy

Run from the repository root:

    /tmp/venv/bin/python scripts/export_fixtures.py

It writes one safetensors file per (kind, case, dtype) to
``weights/<kind>__<case>__<dtypeshort>.safetensors`` in the format
``candle-attention-fixture/1`` documented in ``weights/README.md``.

Oracle rule: every parameter and input is drawn at random (biases included),
rounded to the fixture dtype and stored; the expected outputs are computed by
PyTorch in float64 from those rounded values, then cast to the fixture dtype
and stored.  No expected number is written by hand.

The script is deterministic (one fixed seed per case, derived from its name)
and idempotent: it first deletes the fixture files it owns, and the files it
writes are byte-for-byte identical from one run to the next (it writes the
safetensors container itself, with a sorted header, because
``safetensors.torch.save_file`` emits the metadata in random order).
"""

from __future__ import annotations

import json
import math
import struct
import sys
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open

FORMAT = "candle-attention-fixture/1"
OUT_DIR = Path(__file__).resolve().parent.parent / "weights"
KINDS = ("sdpa", "multihead_attention", "notes_sdpa", "notes_multihead", "notes_causal")
DTYPES = {
    "f32": torch.float32,
    "f64": torch.float64,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
}
F64 = torch.float64
MAX_TOTAL_BYTES = 3 * 1024 * 1024


# --------------------------------------------------------------------------
# Random drawing (float64 values; rounding to the fixture dtype comes later)
# --------------------------------------------------------------------------


class Draw:
    """Seeded random source; one per (kind, case), so all dtypes share draws."""

    def __init__(self, kind: str, case: str):
        self.g = torch.Generator().manual_seed(zlib.crc32(f"{kind}__{case}".encode()))

    def randn(self, *shape: int, std: float = 0.5) -> torch.Tensor:
        return torch.randn(shape, generator=self.g, dtype=F64) * std

    def randint(self, low: int, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(low, high + 1, shape, generator=self.g).to(F64)

    def _one_per_row(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A bool tensor of `shape` with exactly one True per last-dim row."""
        idx = torch.randint(shape[-1], (*shape[:-1], 1), generator=self.g)
        return torch.zeros(shape, dtype=torch.bool).scatter_(-1, idx, True)

    def bool_mask(self, shape: tuple[int, ...], p_true: float) -> torch.Tensor:
        """Random bool mask; every last-dim row has at least one True."""
        m = torch.rand(shape, generator=self.g) < p_true
        return m | self._one_per_row(shape)

    def float_mask(self, shape: tuple[int, ...], p_neg_inf: float = 0.25) -> torch.Tensor:
        """Random additive mask with some -inf; every last-dim row keeps a finite entry."""
        m = self.randn(*shape)
        neg_inf = (torch.rand(shape, generator=self.g) < p_neg_inf) & ~self._one_per_row(shape)
        return m.masked_fill(neg_inf, -math.inf)


def rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round a float64 tensor to `dtype` and come back to float64 (bool passes through)."""
    return t if t.dtype == torch.bool else t.to(dtype).to(F64)


def stored(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """How a tensor is stored: bool as uint8 (1 = True), floats in the fixture dtype."""
    return t.to(torch.uint8) if t.dtype == torch.bool else t.to(dtype)


@dataclass
class Fixture:
    kind: str
    case: str
    config: dict
    call: dict
    params: dict[str, torch.Tensor] = field(default_factory=dict)   # float64, already rounded
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)   # float64 (rounded) or bool
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)  # float64 oracle


# --------------------------------------------------------------------------
# sdpa: torch.nn.functional.scaled_dot_product_attention
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class SdpaCase:
    name: str
    batch: tuple[int, ...] = (2,)
    hq: int = 3
    hkv: int = 3
    L: int = 5
    S: int = 7
    E: int = 11
    Ev: int = 9
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False
    mask: str | None = None                 # "bool" (True = may attend) or "float" (added)
    mask_shape: tuple[int, ...] | None = None
    masked_rows: tuple[int, ...] = ()       # query rows whose mask row is entirely masked
    large_logits: bool = False


SDPA_CASES = [
    SdpaCase("basic"),
    SdpaCase("causal_l_lt_s", L=5, S=7, is_causal=True),
    SdpaCase("causal_l_gt_s", L=7, S=5, is_causal=True),
    SdpaCase("causal_square", L=6, S=6, is_causal=True),
    SdpaCase("scale", scale=0.3),
    SdpaCase("gqa_6_2", hq=6, hkv=2, enable_gqa=True),
    SdpaCase("gqa_8_1_causal", batch=(1,), hq=8, hkv=1, L=6, S=6, E=5, Ev=3,
             enable_gqa=True, is_causal=True),
    SdpaCase("mask_bool_ls", mask="bool", mask_shape=(5, 7)),
    SdpaCase("mask_bool_b1ls", mask="bool", mask_shape=(2, 1, 5, 7)),
    SdpaCase("mask_bool_1h1s", mask="bool", mask_shape=(1, 3, 1, 7)),
    SdpaCase("mask_bool_bhls", mask="bool", mask_shape=(2, 3, 5, 7)),
    SdpaCase("mask_float", mask="float", mask_shape=(2, 3, 5, 7)),
    SdpaCase("fully_masked_rows_bool", mask="bool", mask_shape=(2, 3, 5, 7), masked_rows=(1, 3)),
    SdpaCase("fully_masked_rows_float", mask="float", mask_shape=(5, 7), masked_rows=(0, 4)),
    SdpaCase("large_logits", large_logits=True),
    SdpaCase("unbatched_3d", batch=(), hq=3, hkv=3, L=4, S=6, E=7, Ev=5),
    SdpaCase("batch_5d", batch=(2, 3), hq=2, hkv=2, L=4, S=6, E=5, Ev=7,
             mask="bool", mask_shape=(3, 1, 4, 6)),
]


def draw_large_logit_qk(d: Draw, c: SdpaCase) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k with entries 8 * {-2..2}: raw q.k products are exact in every dtype,
    logits reach a few hundred, and every query row has a unique top logit
    (redrawn until so), so the near one-hot result is not sensitive to rounding."""
    k = 8 * d.randint(-2, 2, *c.batch, c.hkv, c.S, c.E)
    q = 8 * d.randint(-2, 2, *c.batch, c.hq, c.L, c.E)
    while True:
        top2 = (q @ k.mT).topk(2, dim=-1).values
        tied = top2[..., 0] == top2[..., 1]
        if not tied.any():
            return q, k
        q[tied] = 8 * d.randint(-2, 2, int(tied.sum()), c.E)


def reference_sdpa(q, k, v, attn_mask, is_causal, scale, enable_gqa):
    """Plain float64 softmax(q k^T * scale + mask) v; fully masked rows give 0."""
    if enable_gqa:
        k = k.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), dim=-3)
    logits = q @ k.mT * (scale if scale is not None else 1 / math.sqrt(q.size(-1)))
    if is_causal:
        visible = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril()
        logits = logits.masked_fill(~visible, -math.inf)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        logits = logits.masked_fill(~attn_mask, -math.inf)
    elif attn_mask is not None:
        logits = logits + attn_mask
    row_max = logits.amax(dim=-1, keepdim=True)
    dead = row_max == -math.inf
    w = torch.exp(logits - row_max.masked_fill(dead, 0.0))
    w = torch.where(dead, 0.0, w / w.sum(dim=-1, keepdim=True))
    return w @ v


def build_sdpa(c: SdpaCase, dtype: torch.dtype) -> Fixture:
    d = Draw("sdpa", c.name)
    if c.large_logits:
        q, k = draw_large_logit_qk(d, c)
    else:
        q = d.randn(*c.batch, c.hq, c.L, c.E)
        k = d.randn(*c.batch, c.hkv, c.S, c.E)
    v = d.randn(*c.batch, c.hkv, c.S, c.Ev)
    inputs = {"query": q, "key": k, "value": v}
    if c.mask == "bool":
        mask = d.bool_mask(c.mask_shape, p_true=0.6)
        mask[..., list(c.masked_rows), :] = False
        inputs["attn_mask"] = mask
    elif c.mask == "float":
        mask = d.float_mask(c.mask_shape)
        mask[..., list(c.masked_rows), :] = -math.inf
        inputs["attn_mask"] = mask
    inputs = {n: rounded(t, dtype) for n, t in inputs.items()}

    kwargs = dict(is_causal=c.is_causal, scale=c.scale, enable_gqa=c.enable_gqa)
    out = F.scaled_dot_product_attention(
        inputs["query"], inputs["key"], inputs["value"],
        attn_mask=inputs.get("attn_mask"), dropout_p=0.0, **kwargs)

    # Prove the oracle: finite, equal to the plain formula, 0 on fully masked rows.
    assert torch.isfinite(out).all(), f"sdpa/{c.name}: torch returned non-finite values"
    ref = reference_sdpa(inputs["query"], inputs["key"], inputs["value"],
                         inputs.get("attn_mask"), **kwargs)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    if c.masked_rows:
        assert (out[..., list(c.masked_rows), :] == 0).all(), \
            f"sdpa/{c.name}: torch did not return 0 on fully masked rows"
    if c.large_logits:
        assert (inputs["query"] @ inputs["key"].mT).abs().max() / math.sqrt(c.E) > 200

    config = {"is_causal": c.is_causal, "scale": c.scale,
              "enable_gqa": c.enable_gqa, "dropout_p": 0.0}
    return Fixture("sdpa", c.name, config, {}, inputs=inputs, outputs={"out": out})


# --------------------------------------------------------------------------
# multihead_attention: torch.nn.MultiheadAttention
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class MhaCase:
    name: str
    config: dict                           # constructor kwargs, exactly as passed
    call: dict = field(default_factory=dict)
    N: int | None = 2                      # None: unbatched inputs
    L: int = 5
    S: int | None = None                   # None: self-attention (query = key = value)
    key_padding_mask: str | None = None    # "bool" (True = ignore) or "float" (added)
    attn_mask: str | None = None           # "bool" (L,S) True = not allowed, "float3d"
                                           # (N*H,L,S) added, "causal" (L,S) bool
    masked_rows: tuple[int, ...] = ()      # query rows fully masked by a "bool" attn_mask


MHA_CASES = [
    MhaCase("self_default", {"embed_dim": 12, "num_heads": 2}),
    MhaCase("batch_first", {"embed_dim": 12, "num_heads": 3, "batch_first": True}, S=7),
    MhaCase("no_bias", {"embed_dim": 12, "num_heads": 2, "bias": False}, S=6),
    MhaCase("kdim_vdim", {"embed_dim": 12, "num_heads": 3, "kdim": 10, "vdim": 7}, L=4, S=6),
    MhaCase("add_bias_kv", {"embed_dim": 10, "num_heads": 2, "add_bias_kv": True}, S=6),
    MhaCase("add_zero_attn", {"embed_dim": 10, "num_heads": 2, "add_zero_attn": True},
            L=6, S=4),
    MhaCase("bias_kv_zero_attn_masks",
            {"embed_dim": 12, "num_heads": 3, "add_bias_kv": True, "add_zero_attn": True,
             "batch_first": True},
            L=4, S=6, key_padding_mask="bool", attn_mask="bool"),
    MhaCase("key_padding_mask_bool", {"embed_dim": 12, "num_heads": 2}, S=7,
            key_padding_mask="bool"),
    MhaCase("key_padding_mask_float", {"embed_dim": 12, "num_heads": 3, "batch_first": True},
            S=7, key_padding_mask="float"),
    MhaCase("attn_mask_2d_bool", {"embed_dim": 12, "num_heads": 2}, S=6, attn_mask="bool"),
    MhaCase("attn_mask_3d_float", {"embed_dim": 12, "num_heads": 3}, S=6, attn_mask="float3d"),
    MhaCase("per_head_weights", {"embed_dim": 12, "num_heads": 3},
            {"need_weights": True, "average_attn_weights": False}, S=7),
    MhaCase("no_weights", {"embed_dim": 12, "num_heads": 2}, {"need_weights": False}, S=6),
    MhaCase("causal", {"embed_dim": 12, "num_heads": 2, "batch_first": True},
            {"need_weights": False, "is_causal": True}, L=6, attn_mask="causal"),
    MhaCase("unbatched", {"embed_dim": 12, "num_heads": 3}, N=None, L=4, S=6,
            key_padding_mask="bool"),
    MhaCase("e18_h3", {"embed_dim": 18, "num_heads": 3, "dropout": 0.0}, N=3, L=4, S=9),
    MhaCase("fully_masked_rows", {"embed_dim": 12, "num_heads": 2}, {"need_weights": False},
            S=6, attn_mask="bool", masked_rows=(0, 3)),
]


def build_multihead_attention(c: MhaCase, dtype: torch.dtype) -> Fixture:
    d = Draw("multihead_attention", c.name)
    E, H = c.config["embed_dim"], c.config["num_heads"]
    kdim, vdim = c.config.get("kdim", E), c.config.get("vdim", E)
    batch_first = c.config.get("batch_first", False)
    S = c.L if c.S is None else c.S

    mha = nn.MultiheadAttention(**c.config, dtype=F64)
    params = {n: rounded(d.randn(*p.shape), dtype) for n, p in mha.state_dict().items()}
    mha.load_state_dict(params)
    mha.eval()

    def seq(T: int, D: int) -> torch.Tensor:
        if c.N is None:
            return d.randn(T, D)
        return d.randn(c.N, T, D) if batch_first else d.randn(T, c.N, D)

    inputs = {"query": seq(c.L, E)}
    if c.S is None:
        inputs["key"] = inputs["value"] = inputs["query"]
    else:
        inputs["key"], inputs["value"] = seq(S, kdim), seq(S, vdim)

    kpm_shape = (S,) if c.N is None else (c.N, S)
    if c.key_padding_mask == "bool":
        inputs["key_padding_mask"] = ~d.bool_mask(kpm_shape, p_true=0.7)
    elif c.key_padding_mask == "float":
        inputs["key_padding_mask"] = d.float_mask(kpm_shape)
    if c.attn_mask == "bool":
        mask = ~d.bool_mask((c.L, S), p_true=0.7)
        mask[list(c.masked_rows), :] = True
        inputs["attn_mask"] = mask
    elif c.attn_mask == "float3d":
        inputs["attn_mask"] = d.float_mask(((c.N or 1) * H, c.L, S))
    elif c.attn_mask == "causal":
        inputs["attn_mask"] = torch.ones(c.L, S, dtype=torch.bool).triu(diagonal=1)
    inputs = {n: rounded(t, dtype) for n, t in inputs.items()}

    with torch.no_grad():
        attn_output, attn_weights = mha(
            inputs["query"], inputs["key"], inputs["value"],
            key_padding_mask=inputs.get("key_padding_mask"),
            attn_mask=inputs.get("attn_mask"), **c.call)
    outputs = {"attn_output": attn_output}
    if attn_weights is not None:
        outputs["attn_weights"] = attn_weights
    assert (attn_weights is not None) == c.call.get("need_weights", True)

    for name, t in outputs.items():
        assert torch.isfinite(t).all(), f"mha/{c.name}: torch returned non-finite {name}"
    if c.masked_rows:
        # A fully masked row attends to nothing: its attention value is 0, so the
        # module output there is out_proj(0) = out_proj.bias.
        rows = list(c.masked_rows)
        rows = attn_output[:, rows] if batch_first and c.N is not None else attn_output[rows]
        assert torch.equal(rows, params["out_proj.bias"].expand_as(rows)), \
            f"mha/{c.name}: torch did not give 0 attention on fully masked rows"

    return Fixture("multihead_attention", c.name, c.config, c.call,
                   params=params, inputs=inputs, outputs=outputs)


# --------------------------------------------------------------------------
# The notes' modules (corrected versions of the blog's code)
# --------------------------------------------------------------------------

DEFAULT_NAMES = {"q": "wq", "k": "wk", "v": "wv", "o": "wo"}


class NotesSdpa(nn.Module):
    """softmax(q k^T / sqrt(d_k)) v, optionally causal with top-left alignment."""

    def __init__(self, d_k: int):
        super().__init__()
        self.d_k = d_k

    def forward(self, query, key, value, causal: bool = False):
        scores = query @ key.transpose(-2, -1) / math.sqrt(self.d_k)
        if causal:  # key j is visible from query i iff j <= i
            visible = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
            scores = scores.masked_fill(~visible, -math.inf)
        return torch.softmax(scores, dim=-1) @ value


class NotesMultihead(nn.Module):
    """Multi-head attention of the notes, with the missing transposes restored."""

    def __init__(self, d_model: int, n_heads: int, out_proj: bool = True,
                 names: dict | None = None, causal: bool = False):
        super().__init__()
        assert d_model % n_heads == 0
        self.d_model, self.n_heads, self.d_k = d_model, n_heads, d_model // n_heads
        self.names = {**DEFAULT_NAMES, **(names or {})}
        self.has_out_proj, self.causal = out_proj, causal
        roles = ("q", "k", "v", "o") if out_proj else ("q", "k", "v")
        for role in roles:
            setattr(self, self.names[role], nn.Linear(d_model, d_model, dtype=F64))
        self.attention = NotesSdpa(self.d_k)

    def heads(self, role: str, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        x = getattr(self, self.names[role])(x)
        return x.view(B, T, self.n_heads, self.d_k).transpose(1, 2)  # (B, H, T, d_k)

    def forward(self, query, key, value):
        B, L, _ = query.shape
        q, k, v = self.heads("q", query), self.heads("k", key), self.heads("v", value)
        out = self.attention(q, k, v, causal=self.causal)              # (B, H, L, d_k)
        out = out.transpose(1, 2).reshape(B, L, self.d_model)
        if self.has_out_proj:
            out = getattr(self, self.names["o"])(out)
        return out


@dataclass(frozen=True)
class NotesCase:
    kind: str
    name: str
    config: dict
    B: int = 2
    L: int = 5
    S: int | None = None  # None: self-attention (query = key = value)
    dv: int | None = None  # notes_sdpa only: value width


NOTES_CASES = [
    NotesCase("notes_sdpa", "basic", {"d_k": 11}, L=5, S=7, dv=9),
    NotesCase("notes_multihead", "out_proj", {"d_model": 12, "n_heads": 3, "out_proj": True},
              S=7),
    NotesCase("notes_multihead", "no_out_proj",
              {"d_model": 12, "n_heads": 2, "out_proj": False}, S=6),
    NotesCase("notes_multihead", "named_projections",
              {"d_model": 18, "n_heads": 3, "out_proj": True,
               "names": {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}},
              L=4, S=6),
    NotesCase("notes_causal", "self", {"d_model": 12, "n_heads": 3, "out_proj": True}, L=6),
    NotesCase("notes_causal", "l_ne_s", {"d_model": 12, "n_heads": 2, "out_proj": True},
              L=5, S=7),
]


def check_notes_multihead_against_torch(m: NotesMultihead, q, k, v, out):
    """The same weights loaded into nn.MultiheadAttention must give the same output."""
    mha = nn.MultiheadAttention(m.d_model, m.n_heads, batch_first=True, dtype=F64).eval()
    proj = [getattr(m, m.names[r]) for r in ("q", "k", "v")]
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([p.weight for p in proj]))
        mha.in_proj_bias.copy_(torch.cat([p.bias for p in proj]))
        if m.has_out_proj:
            o = getattr(m, m.names["o"])
            mha.out_proj.weight.copy_(o.weight)
            mha.out_proj.bias.copy_(o.bias)
        else:
            mha.out_proj.weight.copy_(torch.eye(m.d_model, dtype=F64))
            mha.out_proj.bias.zero_()
        causal = {}
        if m.causal:
            mask = torch.ones(q.size(1), k.size(1), dtype=torch.bool).triu(diagonal=1)
            causal = {"attn_mask": mask, "is_causal": True}
        expected, _ = mha(q, k, v, need_weights=False, **causal)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def build_notes(c: NotesCase, dtype: torch.dtype) -> Fixture:
    d = Draw(c.kind, c.name)
    S = c.L if c.S is None else c.S
    if c.kind == "notes_sdpa":
        d_k = c.config["d_k"]
        inputs = {"query": d.randn(c.B, c.L, d_k), "key": d.randn(c.B, S, d_k),
                  "value": d.randn(c.B, S, c.dv)}
        inputs = {n: rounded(t, dtype) for n, t in inputs.items()}
        out = NotesSdpa(d_k)(inputs["query"], inputs["key"], inputs["value"])
        expected = F.scaled_dot_product_attention(inputs["query"], inputs["key"], inputs["value"])
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
        return Fixture(c.kind, c.name, c.config, {}, inputs=inputs, outputs={"out": out})

    m = NotesMultihead(**c.config, causal=(c.kind == "notes_causal"))
    params = {n: rounded(d.randn(*p.shape), dtype) for n, p in m.state_dict().items()}
    m.load_state_dict(params)
    D = c.config["d_model"]
    inputs = {"query": d.randn(c.B, c.L, D)}
    if c.S is None:
        inputs["key"] = inputs["value"] = inputs["query"]
    else:
        inputs["key"], inputs["value"] = d.randn(c.B, S, D), d.randn(c.B, S, D)
    inputs = {n: rounded(t, dtype) for n, t in inputs.items()}
    with torch.no_grad():
        out = m(inputs["query"], inputs["key"], inputs["value"])
    check_notes_multihead_against_torch(m, inputs["query"], inputs["key"], inputs["value"], out)
    return Fixture(c.kind, c.name, c.config, {}, params=params, inputs=inputs,
                   outputs={"out": out})


# --------------------------------------------------------------------------
# Writing and checking the files
# --------------------------------------------------------------------------

ST_DTYPE = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
            torch.bfloat16: "BF16", torch.uint8: "U8"}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]):
    """Byte-deterministic safetensors writer (sorted header, 8-byte padded)."""
    header: dict = {"__metadata__": dict(sorted(metadata.items()))}
    blobs, offset = [], 0
    # Largest elements first, as safetensors does, so every tensor stays aligned.
    for name, t in sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0])):
        data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": ST_DTYPE[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def save_fixture(fx: Fixture, short: str, dtype: torch.dtype) -> Path:
    tensors = {}
    for prefix, group in (("param", fx.params), ("input", fx.inputs), ("output", fx.outputs)):
        for name, t in group.items():
            tensors[f"{prefix}.{name}"] = stored(t, dtype)
    metadata = {
        "format": FORMAT,
        "kind": fx.kind,
        "config": json.dumps(fx.config, sort_keys=True),
        "call": json.dumps(fx.call, sort_keys=True),
        "dtype": str(dtype).removeprefix("torch."),
        "torch_version": torch.__version__,
    }
    path = OUT_DIR / f"{fx.kind}__{fx.case}__{short}.safetensors"
    write_safetensors(path, tensors, metadata)
    verify(path, tensors, metadata)
    return path


def verify(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]):
    """Re-open with the safetensors library and compare everything bit for bit."""
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == metadata, path
        assert sorted(f.keys()) == sorted(tensors), path
        for name in f.keys():
            got, want = f.get_tensor(name), tensors[name]
            assert got.dtype == want.dtype and got.shape == want.shape, (path, name)
            assert torch.equal(got.reshape(-1).view(torch.uint8),
                               want.contiguous().reshape(-1).view(torch.uint8)), (path, name)


def main():
    assert sys.byteorder == "little"
    torch.set_num_threads(1)
    torch.backends.mha.set_fastpath_enabled(False)
    OUT_DIR.mkdir(exist_ok=True)
    for kind in KINDS:
        for stale in OUT_DIR.glob(f"{kind}__*.safetensors"):
            stale.unlink()

    builders = ([(build_sdpa, c) for c in SDPA_CASES]
                + [(build_multihead_attention, c) for c in MHA_CASES]
                + [(build_notes, c) for c in NOTES_CASES])
    written = []
    for build, case in builders:
        for short, dtype in DTYPES.items():
            written.append(save_fixture(build(case, dtype), short, dtype))

    counts = Counter((p.stem.split("__")[0], p.stem.split("__")[2]) for p in written)
    total = sum(p.stat().st_size for p in written)
    print(f"torch {torch.__version__}: wrote {len(written)} fixtures to {OUT_DIR}")
    for kind in KINDS:
        row = "  ".join(f"{s}={counts[(kind, s)]}" for s in DTYPES)
        print(f"  {kind:<20} {row}")
    print(f"total {total} bytes ({total / 1024:.1f} KiB)")
    assert total <= MAX_TOTAL_BYTES, "fixtures exceed the size budget"


if __name__ == "__main__":
    main()
