#!/usr/bin/env python3
"""Export the PyTorch reference fixtures used by the candle-attention tests.

Setup (CPU-only is enough):

    python3 -m venv /tmp/venv && /tmp/venv/bin/pip install torch safetensors numpy transformers

Run from the repository root:

    /tmp/venv/bin/python scripts/export_fixtures.py

It writes one safetensors file per (kind, case, dtype) to
``weights/<kind>__<case>__<dtypeshort>.safetensors`` in the format
``candle-attention-fixture/1`` documented in ``weights/README.md``, and
``weights/hf_config_defaults.json``: the per-layer attention type, sliding
window and rope that transformers derives from config.json files without
``layer_types``.  To write only that file (no torch fixture is touched):

    /tmp/venv/bin/python scripts/export_fixtures.py --hf-config-defaults-only

To (re)write only some ``hf_attention`` cases (every other file, that JSON file
included, is left alone; e.g. to add a case without regenerating the others
under a newer transformers):

    /tmp/venv/bin/python scripts/export_fixtures.py --hf-case NAME [--hf-case NAME ...]

``--case KIND__NAME`` (repeatable) does the same for a case of the PyTorch
kinds (``sdpa``, ``multihead_attention``, ``notes_*``), e.g. ``--case sdpa__basic``.

Oracle rule: every parameter and input is drawn at random (biases included),
rounded to the fixture dtype and stored; the expected outputs are computed by
PyTorch in float64 from those rounded values, then cast to the fixture dtype
and stored.  No expected number is written by hand.  The ``hf_attention``
fixtures take their oracle from Hugging Face ``transformers`` models built
from tiny configs in code (no hub download), see ``weights/README.md``.

The script is deterministic (one fixed seed per case, derived from its name)
and idempotent: it first deletes the fixture files it owns, and the files it
writes are byte-for-byte identical from one run to the next (it writes the
safetensors container itself, with a sorted header, because
``safetensors.torch.save_file`` emits the metadata in random order).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import inspect
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
import transformers
from safetensors import safe_open
from torch.overrides import TorchFunctionMode

FORMAT = "candle-attention-fixture/1"
OUT_DIR = Path(__file__).resolve().parent.parent / "weights"
KINDS = ("sdpa", "multihead_attention", "notes_sdpa", "notes_multihead", "notes_causal",
         "hf_attention")
DTYPES = {
    "f32": torch.float32,
    "f64": torch.float64,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
}
F64 = torch.float64
MAX_TOTAL_BYTES = 3 * 1024 * 1024     # the PyTorch kinds
MAX_HF_BYTES = 4 * 1024 * 1024        # hf_attention: one or two cases for each of 16 architectures


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
    """How a tensor is stored: bool as uint8 (1 = True), int64 as is (position ids),
    floats in the fixture dtype."""
    if t.dtype == torch.int64:
        return t
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
    metadata: dict[str, str] = field(default_factory=dict)           # extra metadata keys


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
    # is_causal with appended keys: PyTorch pads the causal attn_mask with visible
    # columns for bias_k and the zero key (with need_weights, or with a padding mask).
    MhaCase("causal_bias_kv_zero_attn",
            {"embed_dim": 12, "num_heads": 3, "add_bias_kv": True, "add_zero_attn": True,
             "batch_first": True},
            {"is_causal": True}, L=6, attn_mask="causal"),
    MhaCase("causal_zero_attn_padding", {"embed_dim": 12, "num_heads": 2, "add_zero_attn": True},
            {"need_weights": False, "is_causal": True}, L=5, attn_mask="causal",
            key_padding_mask="bool"),
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
# hf_attention: the attention modules of Hugging Face transformers models
# --------------------------------------------------------------------------


class PromoteF32(TorchFunctionMode):
    """Turn every float32 request into float64 while the HF oracle runs.

    HF's modeling code computes some things in float32 on purpose, even in a
    float64 model: the rotary inv_freq / angles / cos / sin, RMSNorm, and the
    eager softmax (`softmax(..., dtype=torch.float32)`).  Under this mode
    `torch.float32` arguments become `torch.float64` and `Tensor.float()`
    becomes `Tensor.double()`, so the oracle is float64 all the way through.
    `hf_stock_deviation` measures what this changes (f32 rounding only)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        args = tuple(F64 if a is torch.float32 else a for a in args)
        kwargs = {k: (F64 if v is torch.float32 else v) for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


@contextlib.contextmanager
def hf_float64(promote: bool = True):
    old = torch.get_default_dtype()
    torch.set_default_dtype(F64)
    try:
        with PromoteF32() if promote else contextlib.nullcontext():
            yield
    finally:
        torch.set_default_dtype(old)


@dataclass(frozen=True)
class HfArch:
    config_cls: str
    model_cls: str          # the model whose own forward runs (a base model, or Whisper's decoder)
    attn_path: str          # attribute path to the attention module, "{i}" = layer_idx
    cross_attention: bool = False
    takes_position_ids: bool = True


HF_ARCHS = {
    "llama": HfArch("LlamaConfig", "LlamaModel", "layers.{i}.self_attn"),
    "mistral": HfArch("MistralConfig", "MistralModel", "layers.{i}.self_attn"),
    "qwen2": HfArch("Qwen2Config", "Qwen2Model", "layers.{i}.self_attn"),
    "qwen3": HfArch("Qwen3Config", "Qwen3Model", "layers.{i}.self_attn"),
    "gemma2": HfArch("Gemma2Config", "Gemma2Model", "layers.{i}.self_attn"),
    "gemma3_text": HfArch("Gemma3TextConfig", "Gemma3TextModel", "layers.{i}.self_attn"),
    "phi3": HfArch("Phi3Config", "Phi3Model", "layers.{i}.self_attn"),
    "gpt2": HfArch("GPT2Config", "GPT2Model", "h.{i}.attn"),
    "gpt_neox": HfArch("GPTNeoXConfig", "GPTNeoXModel", "layers.{i}.attention"),
    "bloom": HfArch("BloomConfig", "BloomModel", "h.{i}.self_attention", takes_position_ids=False),
    "gpt_oss": HfArch("GptOssConfig", "GptOssModel", "layers.{i}.self_attn"),
    "whisper": HfArch("WhisperConfig", "models.whisper.modeling_whisper.WhisperDecoder",
                      "layers.{i}.encoder_attn", cross_attention=True),
    "mixtral": HfArch("MixtralConfig", "MixtralModel", "layers.{i}.self_attn"),
    "gemma": HfArch("GemmaConfig", "GemmaModel", "layers.{i}.self_attn"),
    "qwen2_moe": HfArch("Qwen2MoeConfig", "Qwen2MoeModel", "layers.{i}.self_attn"),
    "qwen3_moe": HfArch("Qwen3MoeConfig", "Qwen3MoeModel", "layers.{i}.self_attn"),
    "starcoder2": HfArch("Starcoder2Config", "Starcoder2Model", "layers.{i}.self_attn"),
    "granite": HfArch("GraniteConfig", "GraniteModel", "layers.{i}.self_attn"),
}


@dataclass(frozen=True)
class HfCase:
    arch: str
    name: str                    # the fixture's case name (starts with the architecture)
    config: dict                 # kwargs of the config class (tiny sizes, eager attention)
    layer_idx: int = 0
    B: int = 1
    L: int = 6
    steps: int = 4
    left_pad: tuple[int, ...] | None = None  # pad tokens per batch row; None: no attention_mask
    S: int | None = None         # encoder length (cross-attention)
    all_dtypes: bool = False     # also bf16 and f16
    param_std: float = 0.2


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 100.0, "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "beta_fast": 32.0,
             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}
# LongRoPE (Phi-3-mini-128k, Phi-3.5, Phi-4-mini) with a tiny original context of 8 positions:
# a prefill of 6 and 5 decode steps reach max positions 5, 6, 7 (short factors: 6, 7, 8 <= 8),
# then 8, 9, 10 (long factors).  Partial rotary 0.75 as in Phi-4-mini; the factor derives from
# max_position_embeddings / original_max_position_embeddings = 32 / 8.
PHI3_LONGROPE = {"rope_type": "longrope", "rope_theta": 100.0, "partial_rotary_factor": 0.75,
                 "short_factor": [1.0, 1.05, 1.1, 1.25, 1.4, 1.6],
                 "long_factor": [1.0, 1.8, 3.0, 5.0, 8.0, 12.0]}
PHI3_LONGROPE_FACTOR = {"rope_type": "longrope", "rope_theta": 100.0, "factor": 2.0,
                        "short_factor": [1.0, 1.1, 1.3, 1.5],
                        "long_factor": [1.5, 2.5, 6.0, 10.0]}
# Gemma 3: one rope per layer type (the sliding layers' theta differs from the full layers')
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
               "full_attention": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}

HF_CASES = [
    HfCase("llama", "llama_gqa_llama3_leftpad",
           dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                rope_parameters=LLAMA3_ROPE),
           B=2, L=6, steps=5, left_pad=(2, 0), all_dtypes=True),
    HfCase("llama", "llama_linear_rope_bias",
           dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=1,
                attention_bias=True,
                rope_parameters={"rope_type": "linear", "rope_theta": 100.0, "factor": 2.0}),
           B=1, L=5, steps=4),
    # dynamic NTK is the plain rope up to max_position_embeddings, and the crate refuses
    # positions beyond it: the case pins that from_hf takes "dynamic" and matches there
    HfCase("llama", "llama_dynamic_ntk_within_max_positions",
           dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                max_position_embeddings=16,
                rope_parameters={"rope_type": "dynamic", "rope_theta": 100.0, "factor": 2.0}),
           B=2, L=6, steps=4, left_pad=(1, 0)),
    HfCase("mistral", "mistral_sliding_window",
           dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                sliding_window=4, rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),
           B=1, L=6, steps=5, all_dtypes=True),
    HfCase("mistral", "mistral_sliding_window_leftpad",
           dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                sliding_window=3, rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),
           B=2, L=7, steps=5, left_pad=(3, 1)),
    HfCase("qwen2", "qwen2_qkv_bias_leftpad",
           dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),
           B=2, L=6, steps=4, left_pad=(0, 2), all_dtypes=True),
    HfCase("qwen3", "qwen3_qk_norm_head_dim",
           dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_hidden_layers=1,
                rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),
           B=2, L=6, steps=4, left_pad=(1, 0), all_dtypes=True),
    HfCase("gemma2", "gemma2_sliding_softcap",
           dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_hidden_layers=1, layer_types=["sliding_attention"], sliding_window=4,
                query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),
           B=2, L=6, steps=5, left_pad=(2, 0), all_dtypes=True, param_std=0.3),
    HfCase("gemma2", "gemma2_full_layer1",
           dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                sliding_window=4, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),
           layer_idx=1, B=2, L=5, steps=4, left_pad=(0, 1), param_std=0.3),
    # Gemma 3 sets attn_logit_softcapping in its config, but transformers' Gemma3Attention
    # never passes it to the attention function: these cases set it to pin that it is not applied.
    HfCase("gemma3_text", "gemma3_text_sliding_qk_norm_softcap_unused",
           dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_hidden_layers=1, layer_types=["sliding_attention"], sliding_window=4,
                query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                rope_parameters=GEMMA3_ROPE),
           B=2, L=6, steps=5, left_pad=(2, 0), all_dtypes=True, param_std=0.3),
    HfCase("gemma3_text", "gemma3_text_full_linear_rope_layer1",
           dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                sliding_window=4, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                rope_parameters=GEMMA3_ROPE),
           layer_idx=1, B=2, L=5, steps=4, left_pad=(0, 1), param_std=0.3),
    # Gemma 3 with use_bidirectional_attention (EmbeddingGemma): no causal mask, and the
    # sliding layers see |i - j| < sliding_window // 2 + 1 (Gemma3TextConfig halves the window).
    # An encoder: one call over the whole sequence, no decode steps.
    HfCase("gemma3_text", "gemma3_text_bidirectional_sliding_leftpad",
           dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_hidden_layers=1, layer_types=["sliding_attention"], sliding_window=6,
                query_pre_attn_scalar=24, use_bidirectional_attention=True,
                rope_parameters=GEMMA3_ROPE),
           B=2, L=11, steps=0, left_pad=(0, 3), all_dtypes=True, param_std=0.3),
    HfCase("gemma3_text", "gemma3_text_bidirectional_full_layer1",
           dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                sliding_window=4, query_pre_attn_scalar=24, use_bidirectional_attention=True,
                rope_parameters=GEMMA3_ROPE),
           layer_idx=1, B=2, L=7, steps=0, left_pad=(2, 0), param_std=0.3),
    # Mixtral's attention is Mistral's: a window on every layer, no biases whatever
    # attention_bias says (this case sets it to pin that).
    HfCase("mixtral", "mixtral_sliding_window_leftpad_bias_ignored",
           dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                sliding_window=3, attention_bias=True,
                rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),
           B=2, L=6, steps=4, left_pad=(0, 2), all_dtypes=True),
    # Gemma (1): head_dim 16 != hidden_size / heads, MQA, attention_bias, scale head_dim^-1/2.
    HfCase("gemma", "gemma_mqa_head_dim_bias_leftpad",
           dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                num_hidden_layers=1, attention_bias=True,
                rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),
           B=2, L=5, steps=4, left_pad=(1, 0)),
    # Qwen3-MoE: Qwen3's attention (q/k RMSNorm) with the window on every layer.
    HfCase("qwen3_moe", "qwen3_moe_sliding_qk_norm_leftpad",
           dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_hidden_layers=1, use_sliding_window=True, sliding_window=3,
                rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),
           B=2, L=6, steps=4, left_pad=(0, 2), all_dtypes=True),
    # Qwen2-MoE: q/k/v biases (qkv_bias), none on o; layer 0 slides (even, below max_window_layers).
    HfCase("qwen2_moe", "qwen2_moe_qkv_bias_sliding_layer0",
           dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=2, use_sliding_window=True, sliding_window=3,
                max_window_layers=2,
                rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),
           B=2, L=6, steps=4, left_pad=(1, 0)),
    # StarCoder2: Mistral's masks, biases on all four projections (use_bias, default true).
    HfCase("starcoder2", "starcoder2_use_bias_sliding_leftpad",
           dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                sliding_window=3,
                rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),
           B=2, L=6, steps=4, left_pad=(0, 2), all_dtypes=True),
    # Granite: Llama's attention scaled by attention_multiplier instead of head_dim^-1/2.
    HfCase("granite", "granite_attention_multiplier_bias_leftpad",
           dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                attention_multiplier=0.9, attention_bias=True,
                rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),
           B=2, L=5, steps=4, left_pad=(1, 0)),
    HfCase("phi3", "phi3_packed_qkv_partial_sliding_leftpad",
           dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                sliding_window=3,
                rope_parameters={"rope_type": "default", "rope_theta": 1000.0,
                                 "partial_rotary_factor": 0.75}),
           B=2, L=6, steps=5, left_pad=(0, 2), all_dtypes=True),
    HfCase("phi3", "phi3_no_window_layer1",
           dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
                sliding_window=None,
                rope_parameters={"rope_type": "default", "rope_theta": 1000.0,
                                 "partial_rotary_factor": 0.5}),
           layer_idx=1, B=1, L=5, steps=4),
    HfCase("phi3", "phi3_longrope_switch_in_decode",
           dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
                sliding_window=None, max_position_embeddings=32,
                original_max_position_embeddings=8, rope_parameters=PHI3_LONGROPE),
           B=1, L=6, steps=5, all_dtypes=True),
    # the longest row decides for the whole batch: the left-padded row (positions 3 behind)
    # takes the long factors from step 3 on too; an explicit factor sets the attention factor
    HfCase("phi3", "phi3_longrope_batch_max_leftpad_factor",
           dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                sliding_window=4, max_position_embeddings=32,
                original_max_position_embeddings=8, rope_parameters=PHI3_LONGROPE_FACTOR),
           B=2, L=6, steps=5, left_pad=(3, 0)),
    HfCase("gpt2", "gpt2_conv1d_leftpad",
           dict(n_embd=32, n_head=4, n_layer=1, n_positions=64),
           B=2, L=6, steps=4, left_pad=(2, 0), all_dtypes=True),
    HfCase("gpt2", "gpt2_inverse_layer_idx",
           dict(n_embd=32, n_head=4, n_layer=2, n_positions=64,
                scale_attn_by_inverse_layer_idx=True),
           layer_idx=1, B=1, L=5, steps=4),
    HfCase("gpt_neox", "gpt_neox_partial_rotary_leftpad",
           dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=1,
                rope_parameters={"rope_type": "default", "rope_theta": 1000.0,
                                 "partial_rotary_factor": 0.5}),
           B=2, L=6, steps=4, left_pad=(0, 3), all_dtypes=True),
    HfCase("gpt_neox", "gpt_neox_partial_rotary_quarter",
           dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=1,
                rope_parameters={"rope_type": "default", "rope_theta": 1000.0,
                                 "partial_rotary_factor": 0.25}),
           B=1, L=5, steps=4),
    HfCase("bloom", "bloom_alibi_6heads_leftpad",
           dict(hidden_size=48, n_head=6, n_layer=1),
           B=2, L=6, steps=4, left_pad=(2, 0), all_dtypes=True),
    HfCase("bloom", "bloom_alibi_6heads_nomask",
           dict(hidden_size=48, n_head=6, n_layer=1),
           B=1, L=5, steps=4),
    HfCase("gpt_oss", "gpt_oss_sinks_yarn_sliding_leftpad",
           dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                num_hidden_layers=1, layer_types=["sliding_attention"], sliding_window=3,
                num_local_experts=2, num_experts_per_tok=1, rope_parameters=YARN_ROPE),
           B=2, L=6, steps=5, left_pad=(0, 2), all_dtypes=True),
    HfCase("gpt_oss", "gpt_oss_sinks_full_layer1",
           dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                sliding_window=3, num_local_experts=2, num_experts_per_tok=1,
                rope_parameters=YARN_ROPE),
           layer_idx=1, B=1, L=5, steps=4),
    HfCase("whisper", "whisper_cross_attention",
           dict(d_model=32, decoder_attention_heads=4, encoder_attention_heads=4, decoder_layers=1,
                encoder_layers=1, decoder_ffn_dim=16, encoder_ffn_dim=16, max_target_positions=32,
                max_source_positions=16),
           B=2, L=5, steps=4, S=9, all_dtypes=True),
]

# Config kwargs added to every case: tiny vocabulary and MLP, eager attention.
HF_COMMON_CONFIG = {"vocab_size": 16, "attn_implementation": "eager"}
HF_ARCH_CONFIG = {
    "gpt2": {"n_inner": 16, "bos_token_id": 0, "eos_token_id": 0},
    # Phi-3's default special token ids (32000, ...) lie outside the tiny vocabulary
    "phi3": {"intermediate_size": 16, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0},
    "bloom": {},
    # the MoE's default grouped_mm kernel has no float64;
    # YaRN wants max_position_embeddings = factor * original_max_position_embeddings
    "gpt_oss": {"intermediate_size": 16, "experts_implementation": "eager",
                "max_position_embeddings": 256},
    "whisper": {"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0,
                "decoder_start_token_id": 0, "begin_suppress_tokens": None},
    "mixtral": {"intermediate_size": 16, "num_local_experts": 2, "num_experts_per_tok": 1,
                "experts_implementation": "eager"},
    "qwen2_moe": {"intermediate_size": 16, "moe_intermediate_size": 8,
                  "shared_expert_intermediate_size": 8, "num_experts": 2,
                  "num_experts_per_tok": 1, "experts_implementation": "eager"},
    "qwen3_moe": {"intermediate_size": 16, "moe_intermediate_size": 8, "num_experts": 2,
                  "num_experts_per_tok": 1, "experts_implementation": "eager"},
}
HF_DEFAULT_ARCH_CONFIG = {"intermediate_size": 16}


def hf_class(path: str):
    obj = transformers
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def hf_submodule(model: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        model = model[int(part)] if part.isdigit() else getattr(model, part)
    return model


def hf_build_config(c: HfCase):
    arch = HF_ARCHS[c.arch]
    kwargs = {**HF_COMMON_CONFIG, **HF_ARCH_CONFIG.get(c.arch, HF_DEFAULT_ARCH_CONFIG), **c.config}
    return hf_class(arch.config_cls)(**kwargs)


def hf_positions(mask: torch.Tensor | None, B: int, T: int) -> torch.Tensor:
    """generate()'s position_ids: (cumsum(mask) - 1).clamp(min=0), or arange."""
    if mask is None:
        return torch.arange(T).expand(B, T).clone()
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


class HfRun:
    """One HF model plus hooks on its attention module.

    The forward_pre_hook replaces the module's `hidden_states` with the next
    tensor from `feed` (our random, dtype-rounded input), and Bloom's
    `residual` with zeros (so the module's output is the attention output
    alone).  The forward_hook records the module's output (first element)."""

    def __init__(self, c: HfCase, promote: bool = True):
        self.c, self.arch = c, HF_ARCHS[c.arch]
        torch.manual_seed(zlib.crc32(f"hf_attention__{c.name}".encode()))
        with hf_float64(promote):
            self.config = hf_build_config(c)
            self.model = hf_class(self.arch.model_cls)(self.config).double().eval()
        self.promote = promote
        self.attn = hf_submodule(self.model, self.arch.attn_path.format(i=c.layer_idx))
        self.feed: list[torch.Tensor] = []
        self.outputs: list[torch.Tensor] = []
        self.encoder: torch.Tensor | None = None
        self.attn.register_forward_pre_hook(self._pre, with_kwargs=True)
        self.attn.register_forward_hook(self._post, with_kwargs=True)

    def _pre(self, module, args, kwargs):
        x = self.feed.pop(0)
        args = list(args)
        if args:
            assert args[0].shape == x.shape, (args[0].shape, x.shape)
            args[0] = x
        else:
            assert kwargs["hidden_states"].shape == x.shape
            kwargs["hidden_states"] = x
        if self.c.arch == "bloom":
            residual = args[1] if len(args) > 1 else kwargs["residual"]
            zero = torch.zeros_like(residual)
            if len(args) > 1:
                args[1] = zero
            else:
                kwargs["residual"] = zero
        if self.arch.cross_attention:   # the key/value states are exactly the stored ones
            assert torch.equal(kwargs["key_value_states"], self.encoder)
        return tuple(args), kwargs

    def _post(self, module, args, kwargs, output):
        self.outputs.append(output[0].detach().clone())

    def forward(self, hidden, embeds, mask, pos, cache, encoder=None, use_cache=True):
        """One forward of the whole model; returns (attention output, cache)."""
        self.feed.append(hidden)
        kw = dict(inputs_embeds=embeds, use_cache=use_cache)
        if use_cache and cache is not None:
            kw["cache"] = cache
        if mask is not None:
            kw["attention_mask"] = mask.long()
        if self.arch.takes_position_ids:
            kw["position_ids"] = pos
        if encoder is not None:
            kw["encoder_hidden_states"] = self.encoder = encoder
        with torch.no_grad(), hf_float64(self.promote):
            out = self.model(**kw)
        assert not self.feed and len(self.outputs) == 1, "the module ran more than once"
        return self.outputs.pop(), getattr(out, "cache", None)

    def run(self, prefill: dict, steps: list[dict]):
        """Prefill, then each step with the cache the model returned:
        (prefill output, step outputs, final cache)."""
        out, cache = self.forward(**prefill, cache=None)
        step_outs = []
        for s in steps:
            o, cache = self.forward(**s, cache=cache)
            step_outs.append(o)
        return out, step_outs, cache


def hf_draw_inputs(c: HfCase, d: Draw, hidden: int, dtype: torch.dtype):
    """Prefill and decode-step inputs: float64 values rounded to `dtype`."""
    T = c.L + c.steps
    mask = None
    if c.left_pad is not None:
        assert len(c.left_pad) == c.B
        mask = torch.ones(c.B, T, dtype=torch.bool)
        for b, p in enumerate(c.left_pad):
            mask[b, :p] = False
    pos = hf_positions(mask, c.B, T)
    x = rounded(d.randn(c.B, T, hidden, std=1.0), dtype)          # attention-module inputs
    emb = d.randn(c.B, T, hidden, std=1.0)                        # model inputs_embeds (irrelevant)
    enc = rounded(d.randn(c.B, c.S, hidden, std=1.0), dtype) if c.S else None

    def part(lo, hi):
        return dict(hidden=x[:, lo:hi].contiguous(), embeds=emb[:, lo:hi].contiguous(),
                    mask=None if mask is None else mask[:, :hi].contiguous(),
                    pos=pos[:, lo:hi].contiguous(), encoder=enc)

    prefill = part(0, c.L)
    steps = [part(c.L + i, c.L + i + 1) for i in range(c.steps)]
    return x, mask, pos, enc, prefill, steps


def hf_randomize(attn: nn.Module, d: Draw, dtype: torch.dtype, std: float) -> dict:
    """Random values for every entry of the attention module's state_dict, rounded to dtype."""
    params = {}
    buffers = {n for n, _ in attn.named_buffers()}
    for name, p in attn.state_dict().items():
        assert name not in buffers, f"unexpected buffer {name} in the attention state_dict"
        if name == "sinks":
            v = d.randn(*p.shape, std=1.0)
        elif "norm" in name:
            v = 1.0 + d.randn(*p.shape, std=0.1)
        else:
            v = d.randn(*p.shape, std=std)
        params[name] = rounded(v, dtype)
    attn.load_state_dict(params)
    return params


def build_hf_attention(c: HfCase, dtype: torch.dtype) -> Fixture:
    d = Draw("hf_attention", c.name)
    run = HfRun(c)
    params = hf_randomize(run.attn, d, dtype, c.param_std)
    hidden = run.config.d_model if c.arch == "whisper" else run.config.hidden_size
    x, mask, pos, enc, prefill, steps = hf_draw_inputs(c, d, hidden, dtype)
    out, step_outs, cache = run.run(prefill, steps)

    inputs = {"hidden_states": prefill["hidden"], "position_ids": prefill["pos"]}
    if mask is not None:
        inputs["attention_mask"] = prefill["mask"]
    if enc is not None:
        inputs["encoder_hidden_states"] = enc
    outputs = {"attn_output": out}
    for i, (s, o) in enumerate(zip(steps, step_outs), start=1):
        inputs[f"step{i}.hidden_states"] = s["hidden"]
        inputs[f"step{i}.position_ids"] = s["pos"]
        if mask is not None:
            inputs[f"step{i}.attention_mask"] = s["mask"]
        outputs[f"step{i}.attn_output"] = o

    config = json.loads(json.dumps(run.config.to_dict(), sort_keys=True, default=str))
    call = {"layer_idx": c.layer_idx, "cross_attention": HF_ARCHS[c.arch].cross_attention}
    fx = Fixture("hf_attention", c.name, config, call, params=params, inputs=inputs,
                 outputs=outputs,
                 metadata={"architecture": c.arch,
                           "transformers_version": transformers.__version__})

    # Prove the oracle.
    valid = torch.ones(c.B, c.L + c.steps, dtype=torch.bool) if mask is None else mask
    full = torch.cat([out] + step_outs, dim=1)
    assert torch.isfinite(full[valid]).all(), f"hf/{c.name}: non-finite output at a real token"
    # 1. The cached decode equals one forward over the whole sequence without cache
    #    (unless longrope switches factors between calls: see hf_check_longrope_switch).
    again = HfRun(c)
    again.attn.load_state_dict(params)
    whole, _ = again.forward(x, torch.cat([prefill["embeds"]] + [s["embeds"] for s in steps], 1),
                             mask, pos, None, encoder=enc, use_cache=False)
    if not hf_longrope_switches(c, config, [prefill] + steps):
        torch.testing.assert_close(full[valid], whole[valid], rtol=1e-12, atol=1e-12)
    # 2. An independent float64 implementation of the contract, from the fixture's contents only.
    ref = reference_hf_attention(fx)
    torch.testing.assert_close(full[valid], ref[valid], rtol=1e-10, atol=1e-12)
    if hf_longrope_switches(c, config, [prefill] + steps):
        hf_check_longrope_switch(c, fx, valid, full, whole, ref)
    #    A Gemma 3 case that sets attn_logit_softcapping pins that it is not applied:
    #    applying it must move the output well beyond the loosest (bf16) tolerance.
    if c.arch == "gemma3_text" and config.get("attn_logit_softcapping") is not None:
        capped = reference_hf_attention(fx, gemma3_softcap=True)
        moved = ((capped - ref)[valid].abs().max() / ref[valid].abs().max()).item()
        assert moved > 0.05, f"hf/{c.name}: the softcap would change the output by {moved:.1e} only"
    #    A bidirectional case pins both halves of the rule: the causal mask, or the window
    #    as config.json writes it (not halved), must move the output well beyond the loosest
    #    (bf16) tolerance.
    if config.get("use_bidirectional_attention"):
        variants = ["causal"] + (["unhalved_window"] if hf_window(c.arch, config, c.layer_idx) else [])
        for variant in variants:
            other = reference_hf_attention(fx, bidirectional=variant)
            moved = ((other - ref)[valid].abs().max() / ref[valid].abs().max()).item()
            assert moved > 0.05, f"hf/{c.name}: '{variant}' would change the output by {moved:.1e} only"
            if dtype == F64:
                print(f"  hf/{c.name}: the '{variant}' variant moves the output by {moved:.0%}")
        return fx                      # an encoder: the crate runs it without a cache
    # 3. The cache is the kind the README describes.
    hf_check_cache(c, run, cache)
    return fx


def hf_longrope_switches(c: HfCase, config: dict, calls: list[dict]) -> bool:
    """Whether some calls take longrope's short factors and others its long ones."""
    rp = config.get("rope_parameters") or {}
    if rp.get("rope_type") != "longrope":
        return False
    longs = {int(call["pos"].max()) + 1 > rp["original_max_position_embeddings"] for call in calls}
    return len(longs) == 2


def hf_check_longrope_switch(c: HfCase, fx: Fixture, valid, full, whole, ref):
    """A longrope case whose calls switch from the short to the long factors: transformers
    picks the factors per call (the cached run differs from one forward of the whole
    sequence, which the reference reproduces when it rotates the sequence as one call), and
    the fixture tells a per-call switch from one that never happens, covers every call or
    (with a batch) is made per row."""
    torch.testing.assert_close(whole[valid], reference_hf_attention(fx, rope_calls="whole")[valid],
                               rtol=1e-10, atol=1e-12)
    others = [("one forward of the whole sequence", whole),
              ("the short factors throughout", reference_hf_attention(fx, rope_calls="short"))]
    if c.B > 1:
        others.append(("a switch per batch row", reference_hf_attention(fx, rope_calls="per_row")))
    for name, other in others:
        moved = ((other - ref)[valid].abs().max() / ref[valid].abs().max()).item()
        assert moved > 0.05, f"hf/{c.name}: {name} changes the output by {moved:.1e} only"


def hf_check_cache(c: HfCase, run: HfRun, cache):
    if c.arch == "whisper":
        assert type(cache).__name__ == "EncoderDecoderCache", type(cache)
        layer = cache.cross_attention_cache.layers[c.layer_idx]
        assert layer.keys.shape[-2] == c.S, "the cross-attention cache holds the encoder K/V"
        return
    assert type(cache).__name__ == "DynamicCache", type(cache)
    layer = cache.layers[c.layer_idx]
    config = json.loads(json.dumps(run.config.to_dict(), default=str))
    window = hf_window(c.arch, config, c.layer_idx)
    total = c.L + c.steps
    if window is None:
        assert type(layer).__name__ == "DynamicLayer" and layer.keys.shape[-2] == total
    else:
        assert type(layer).__name__ == "DynamicSlidingWindowLayer", type(layer)
        assert layer.keys.shape[-2] == min(total, window - 1) and total > window


def hf_stock_deviation(c: HfCase, fx: Fixture) -> float:
    """Max |stock HF - float64 oracle| / max |oracle| over real tokens, where stock HF
    keeps its float32 rotary / RMSNorm / softmax (f64 fixture only)."""
    run = HfRun(c, promote=False)
    run.attn.load_state_dict(fx.params)
    prefill = {"hidden": fx.inputs["hidden_states"], "embeds": fx.inputs["hidden_states"],
               "mask": fx.inputs.get("attention_mask"), "pos": fx.inputs["position_ids"],
               "encoder": fx.inputs.get("encoder_hidden_states")}
    steps = []
    for i in range(1, c.steps + 1):
        steps.append({"hidden": fx.inputs[f"step{i}.hidden_states"],
                      "embeds": fx.inputs[f"step{i}.hidden_states"],
                      "mask": fx.inputs.get(f"step{i}.attention_mask"),
                      "pos": fx.inputs[f"step{i}.position_ids"],
                      "encoder": fx.inputs.get("encoder_hidden_states")})
    out, step_outs, _ = run.run(prefill, steps)
    got = torch.cat([out] + step_outs, 1)
    want = torch.cat([fx.outputs["attn_output"]]
                     + [fx.outputs[f"step{i}.attn_output"] for i in range(1, c.steps + 1)], 1)
    last = f"step{c.steps}.attention_mask" if c.steps else "attention_mask"
    mask = (fx.inputs.get(last)
            if "attention_mask" in fx.inputs else torch.ones(got.shape[:2], dtype=torch.bool))
    return ((got - want)[mask].abs().max() / want[mask].abs().max()).item()


# ---- an independent float64 implementation of the hf_attention contract ----


def hf_window(arch: str, cfg: dict, layer_idx: int) -> int | None:
    """The window of layer `layer_idx`, from a `config.to_dict()` (where the config class
    has filled in `layer_types` and, for Qwen, cleared `sliding_window` unless
    `use_sliding_window`).  Mistral, Mixtral, Phi-3 and Qwen3-MoE use `sliding_window` on
    every layer.  A
    bidirectional Gemma 3 layer's is the bound on |i - j| that Gemma3TextConfig derives."""
    if arch in ("mistral", "mixtral", "phi3", "qwen3_moe", "starcoder2"):
        return cfg.get("sliding_window")
    if arch in ("qwen2", "qwen3", "qwen2_moe", "gemma2", "gemma3_text", "gpt_oss"):
        sliding = cfg["layer_types"][layer_idx] == "sliding_attention"
        if not sliding or cfg["sliding_window"] is None:
            return None
        if arch == "gemma3_text" and cfg.get("use_bidirectional_attention"):
            # Gemma3TextConfig halves it (the bound on |i - j|); to_dict writes the original.
            return cfg["sliding_window"] // 2 + 1
        return cfg["sliding_window"]
    return None


def ref_inv_freq(cfg: dict, head_dim: int,
                 seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_factor) from config["rope_parameters"], in float64, for a call
    whose largest position id is seq_len - 1 (only longrope and dynamic read it; None: the
    short set, the plain rope)."""
    rp = cfg["rope_parameters"]
    base, kind = rp["rope_theta"], rp.get("rope_type", "default")
    dim = int(head_dim * rp.get("partial_rotary_factor", 1.0))
    exps = torch.arange(0, dim, 2, dtype=F64) / dim
    inv = 1.0 / base ** exps
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / rp["factor"], 1.0
    if kind == "dynamic":                              # plain within max_position_embeddings
        mpe, factor = cfg["max_position_embeddings"], rp["factor"]
        if seq_len is None or seq_len <= mpe:
            return inv, 1.0
        grown = base * (factor * seq_len / mpe - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / grown ** exps, 1.0
    if kind == "llama3":
        factor, lo, hi = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
        old = rp["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        out = torch.where(wavelen > old / lo, inv / factor, inv)          # low band: / factor
        mid = (wavelen >= old / hi) & (wavelen <= old / lo)              # medium band: blend
        out = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, out)
        return out, 1.0
    if kind == "yarn":
        factor, old = rp["factor"], rp["original_max_position_embeddings"]
        att = rp.get("attention_factor")
        if att is None:
            att = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        beta_fast, beta_slow = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1

        def corr(rot):
            return dim * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(base))

        low, high = corr(beta_fast), corr(beta_slow)
        if rp.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=F64) - low) / (high - low)).clamp(0, 1)
        extrap = 1 - ramp                                  # weight of the unscaled frequency
        return inv / factor * (1 - extrap) + inv * extrap, att
    if kind == "longrope":
        old = rp["original_max_position_embeddings"]
        factor = rp.get("factor")
        if factor is None:                                 # Phi-3: the context extension ratio
            factor = cfg["max_position_embeddings"] / old
        att = rp.get("attention_factor")
        if att is None:
            att = math.sqrt(1 + math.log(factor) / math.log(old)) if factor > 1 else 1.0
        long = seq_len is not None and seq_len > old       # the switch, once per call
        ext = torch.tensor(rp["long_factor" if long else "short_factor"], dtype=F64)
        assert ext.numel() == dim // 2
        return inv / ext, att
    raise ValueError(kind)


def ref_rope(x: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor, att: float) -> torch.Tensor:
    """x (B, H, T, D); rotate-half RoPE on the first 2*len(inv) dims of D."""
    rot = 2 * inv.numel()
    ang = pos[:, None, :, None].to(F64) * inv                 # (B, 1, T, rot/2)
    cos, sin = (torch.cat([ang.cos()] * 2, -1) * att, torch.cat([ang.sin()] * 2, -1) * att)
    xr, xp = x[..., :rot], x[..., rot:]
    x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
    return torch.cat([xr * cos + torch.cat([-x2, x1], -1) * sin, xp], -1)


def ref_alibi_slopes(n: int) -> torch.Tensor:
    p = 2 ** math.floor(math.log2(n))
    slopes = [2 ** (-8 * (i + 1) / p) for i in range(p)]
    slopes += [2 ** (-8 * (2 * i + 1) / (2 * p)) for i in range(min(p, n - p))]
    return torch.tensor(slopes, dtype=F64)


def reference_hf_attention(fx: Fixture, gemma3_softcap: bool = False,
                           rope_calls: str = "per_call",
                           bidirectional: str = "as_config") -> torch.Tensor:
    """The attention output for the whole sequence (prefill, then every step),
    computed in float64 without a cache from the fixture's config, call,
    params and inputs only, exactly as the README describes.

    The queries and keys of each call (the prefill, each step) are rotated with
    the frequencies of that call, as the cached run does: longrope picks its
    short or long factors from the call's largest position id, and keys keep
    the frequencies they were rotated with.  Counterfactuals: `rope_calls="whole"`
    rotates the whole sequence as one call (what a forward without cache does),
    `"short"` always takes longrope's short factors and `"per_row"` decides per
    batch row instead of once for the call.

    `gemma3_softcap=True` applies a Gemma 3 config's `attn_logit_softcapping`,
    which transformers does not: the counterfactual that shows a case pins that.

    With Gemma 3's `use_bidirectional_attention`, a query sees every real key, and on a
    sliding layer those less than `sliding_window // 2 + 1` positions away on either side
    (config.json holds the window before Gemma3TextConfig halves it).  Counterfactuals:
    `bidirectional="causal"` ignores the flag, `"unhalved_window"` takes the distance bound
    from config.json's window as it stands."""
    cfg = json.loads(json.dumps(fx.config))
    arch, li = fx.metadata["architecture"], fx.call["layer_idx"]
    P = fx.params
    steps = sum(1 for k in fx.inputs if k.endswith(".hidden_states"))
    cat = lambda n: torch.cat([fx.inputs[n]] + [fx.inputs[f"step{i}.{n}"]  # noqa: E731
                                                 for i in range(1, steps + 1)], 1)
    x, pos = cat("hidden_states"), cat("position_ids")
    calls = [fx.inputs["position_ids"]] + [fx.inputs[f"step{i}.position_ids"]
                                           for i in range(1, steps + 1)]
    if rope_calls == "whole":
        calls = [pos]
    assert rope_calls in ("per_call", "whole", "short", "per_row"), rope_calls

    def rope_qk(q, k, rope_cfg, D):                            # rotate each call's slice
        qs, ks, t0 = [], [], 0
        for p in calls:
            n = p.shape[1]
            rows = [slice(b, b + 1) for b in range(B)] if rope_calls == "per_row" else [slice(None)]
            for r in rows:
                seq_len = None if rope_calls == "short" else int(p[r].max()) + 1
                inv, att = ref_inv_freq(rope_cfg, D, seq_len)
                qs.append(ref_rope(q[r, :, t0:t0 + n], p[r], inv, att))
                ks.append(ref_rope(k[r, :, t0:t0 + n], p[r], inv, att))
            if len(rows) > 1:                                  # per_row: stack the rows again
                qs[-B:] = [torch.cat(qs[-B:], 0)]
                ks[-B:] = [torch.cat(ks[-B:], 0)]
            t0 += n
        assert t0 == q.shape[2]
        return torch.cat(qs, 2), torch.cat(ks, 2)
    B, T, E = x.shape
    mask = fx.inputs.get(f"step{steps}.attention_mask" if steps else "attention_mask")
    pad = torch.ones(B, T, dtype=torch.bool) if mask is None else mask
    lin = lambda t, w, b=None: F.linear(t, P[w], P.get(b) if b else None)  # noqa: E731

    def heads(t, n):                                           # (B, T', n*D) -> (B, n, T', D)
        return t.view(B, t.shape[1], n, -1).transpose(1, 2)

    scale, softcap, sinks, bias, window, causal = None, None, None, 0.0, None, True
    if arch in ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "gemma",
                "gemma2", "gemma3_text", "gpt_oss", "phi3", "starcoder2", "granite"):
        H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        D = cfg.get("head_dim") or E // H
        if arch == "phi3":                                     # packed [q | k | v], no bias
            q, k, v = lin(x, "qkv_proj.weight").split([H * D, Hkv * D, Hkv * D], -1)
            q, k, v = heads(q, H), heads(k, Hkv), heads(v, Hkv)
        else:
            q = heads(lin(x, "q_proj.weight", "q_proj.bias"), H)
            k = heads(lin(x, "k_proj.weight", "k_proj.bias"), Hkv)
            v = heads(lin(x, "v_proj.weight", "v_proj.bias"), Hkv)
        if arch in ("qwen3", "qwen3_moe", "gemma3_text"):
            eps = cfg["rms_norm_eps"]
            unit = 1.0 if arch == "gemma3_text" else 0.0       # Gemma's RMSNorm scales by 1 + w
            rms = lambda t, w: (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)  # noqa
                                * (unit + P[w]))
            q, k = rms(q, "q_norm.weight"), rms(k, "k_norm.weight")
        rope = cfg
        if arch == "gemma3_text":                              # one rope per layer type
            rope = {"rope_parameters": cfg["rope_parameters"][cfg["layer_types"][li]]}
        q, k = rope_qk(q, k, rope, D)
        k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
        gemma = arch in ("gemma2", "gemma3_text")
        scale = (cfg["query_pre_attn_scalar"] if gemma else D) ** -0.5
        if arch == "granite":                                  # GraniteAttention.scaling
            scale = cfg["attention_multiplier"]
        # Gemma 3's attention never passes attn_logit_softcapping on (transformers 5.x)
        if arch == "gemma2" or (arch == "gemma3_text" and gemma3_softcap):
            softcap = cfg.get("attn_logit_softcapping")
        sinks = P["sinks"] if arch == "gpt_oss" else None
        window = hf_window(arch, cfg, li)
        assert bidirectional in ("as_config", "causal", "unhalved_window"), bidirectional
        if arch == "gemma3_text" and cfg.get("use_bidirectional_attention") and bidirectional != "causal":
            causal = False
            if window is not None:
                reach = cfg["sliding_window"] if bidirectional == "unhalved_window" else window
                t = torch.arange(T)
                near = ((t[None, :] - t[:, None]).abs() < reach)[None, None]
        out_w, out_b = "o_proj.weight", "o_proj.bias"
    elif arch == "gpt2":
        H = cfg["n_head"]
        q, k, v = (x @ P["c_attn.weight"] + P["c_attn.bias"]).split(E, -1)   # Conv1D: x W + b
        q, k, v = heads(q, H), heads(k, H), heads(v, H)
        D = E // H
        scale = D ** -0.5 if cfg["scale_attn_weights"] else 1.0
        if cfg["scale_attn_by_inverse_layer_idx"]:
            scale /= li + 1
        out_w = None
    elif arch == "gpt_neox":
        H = cfg["num_attention_heads"]
        D = E // H
        qkv = lin(x, "query_key_value.weight", "query_key_value.bias").view(B, T, H, 3 * D)
        q, k, v = qkv.transpose(1, 2).chunk(3, -1)            # per head: [q | k | v]
        q, k = rope_qk(q, k, cfg, D)
        scale = D ** -0.5
        out_w, out_b = "dense.weight", "dense.bias"
    elif arch == "bloom":
        H = cfg["n_head"]
        D = E // H
        qkv = lin(x, "query_key_value.weight", "query_key_value.bias").view(B, T, H, 3, D)
        q, k, v = (qkv[..., i, :].transpose(1, 2) for i in range(3))
        key_pos = (torch.arange(T).expand(B, T) if mask is None
                   else (pad.long().cumsum(-1) - 1) * pad.long())
        bias = ref_alibi_slopes(H)[None, :, None, None] * key_pos[:, None, None, :].to(F64)
        scale = D ** -0.5
        out_w, out_b = "dense.weight", "dense.bias"
    elif arch == "whisper":
        H = cfg["decoder_attention_heads"]
        D = E // H
        enc = fx.inputs["encoder_hidden_states"]
        q = heads(lin(x, "q_proj.weight", "q_proj.bias"), H)
        k = heads(lin(enc, "k_proj.weight"), H)               # no k bias
        v = heads(lin(enc, "v_proj.weight", "v_proj.bias"), H)
        scale, causal = D ** -0.5, False
        out_w, out_b = "out_proj.weight", "out_proj.bias"
    else:
        raise ValueError(arch)

    logits = q @ k.mT * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits + bias
    if causal:
        t = torch.arange(T)
        vis = (t[None, :] <= t[:, None])[None, None] & pad[:, None, None, :]
        if window is not None:
            vis = vis & (t[None, :] > t[:, None] - window)[None, None]
        logits = logits.masked_fill(~vis, -math.inf)
    elif arch == "gemma3_text":                                # bidirectional: padding, distance
        vis = pad[:, None, None, :] & (near if window is not None else True)
        logits = logits.masked_fill(~vis, -math.inf)
    if sinks is not None:
        sink = sinks[None, :, None, None].expand(B, H, T, 1)
        w = torch.softmax(torch.cat([logits, sink], -1), -1)[..., :-1]
    else:
        w = torch.softmax(logits, -1)
    o = (w @ v).transpose(1, 2).reshape(B, T, -1)
    if out_w is None:
        return o @ P["c_proj.weight"] + P["c_proj.bias"]
    return lin(o, out_w, out_b)


# --------------------------------------------------------------------------
# hf_config_defaults: what transformers derives from an old config.json
# --------------------------------------------------------------------------

# Many hub checkpoints predate `layer_types`: their config.json leaves the
# per-layer attention type (and Gemma 3's per-type rope) for the config class
# to derive.  Each case is such a config.json (sizes shrunk so the attention
# modules are cheap to build); the file records, for every layer, what
# transformers' config class and modeling code make of it.
HF_DEFAULTS_FILE = OUT_DIR / "hf_config_defaults.json"
HF_DEFAULTS_FORMAT = "candle-attention-hf-config-defaults/1"

# architecture -> (config class, modeling module, attention class, rotary class)
HF_DEFAULTS_ARCHS = {
    "llama": ("LlamaConfig", "llama", "LlamaAttention", "LlamaRotaryEmbedding"),
    "mistral": ("MistralConfig", "mistral", "MistralAttention", "MistralRotaryEmbedding"),
    "qwen2": ("Qwen2Config", "qwen2", "Qwen2Attention", "Qwen2RotaryEmbedding"),
    "qwen3": ("Qwen3Config", "qwen3", "Qwen3Attention", "Qwen3RotaryEmbedding"),
    "gemma2": ("Gemma2Config", "gemma2", "Gemma2Attention", "Gemma2RotaryEmbedding"),
    "gemma3_text": ("Gemma3TextConfig", "gemma3", "Gemma3Attention", "Gemma3RotaryEmbedding"),
    "mixtral": ("MixtralConfig", "mixtral", "MixtralAttention", "MixtralRotaryEmbedding"),
    "gemma": ("GemmaConfig", "gemma", "GemmaAttention", "GemmaRotaryEmbedding"),
    "qwen2_moe": ("Qwen2MoeConfig", "qwen2_moe", "Qwen2MoeAttention", "Qwen2MoeRotaryEmbedding"),
    "qwen3_moe": ("Qwen3MoeConfig", "qwen3_moe", "Qwen3MoeAttention", "Qwen3MoeRotaryEmbedding"),
    "starcoder2": ("Starcoder2Config", "starcoder2", "Starcoder2Attention", "Starcoder2RotaryEmbedding"),
    "granite": ("GraniteConfig", "granite", "GraniteAttention", "GraniteRotaryEmbedding"),
    "phi3": ("Phi3Config", "phi3", "Phi3Attention", "Phi3RotaryEmbedding"),
    "gpt_oss": ("GptOssConfig", "gpt_oss", "GptOssAttention", "GptOssRotaryEmbedding"),
    "gpt_neox": ("GPTNeoXConfig", "gpt_neox", "GPTNeoXAttention", "GPTNeoXRotaryEmbedding"),
}

HF_DEFAULTS_SIZES = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "head_dim": 8}
GPT_OSS_YARN_SCALING = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                        "truncate": False, "original_max_position_embeddings": 4096}

# (architecture, name, config.json, num_hidden_layers); most without layer_types
HF_DEFAULTS_CASES = [
    ("gemma2", "gemma2_alternating",
     dict(sliding_window=4096, rope_theta=10000.0, query_pre_attn_scalar=8,
          attn_logit_softcapping=50.0), 4),
    ("gemma3_text", "gemma3_pattern3_local_freq_linear",
     dict(sliding_window=512, sliding_window_pattern=3, rope_theta=1000000.0,
          rope_local_base_freq=20000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
          query_pre_attn_scalar=8), 6),
    ("gemma3_text", "gemma3_default_pattern_and_local_freq",
     dict(sliding_window=512, rope_theta=1000000.0, rope_scaling=None, query_pre_attn_scalar=8), 8),
    # the old spelling "type" is not read: the full layers keep rope_type "default"
    ("gemma3_text", "gemma3_scaling_type_key",
     dict(sliding_window=512, sliding_window_pattern=2, rope_theta=1000000.0,
          rope_local_base_freq=10000.0, rope_scaling={"type": "linear", "factor": 8.0},
          query_pre_attn_scalar=8), 2),
    ("gpt_oss", "gpt_oss_yarn_alternating",
     dict(sliding_window=128, rope_theta=150000.0, rope_scaling=GPT_OSS_YARN_SCALING,
          max_position_embeddings=131072, num_local_experts=2, num_experts_per_tok=1), 4),
    ("qwen2", "qwen2_sliding_from_layer4",
     dict(use_sliding_window=True, sliding_window=4096, max_window_layers=4,
          rope_theta=1000000.0), 6),
    ("qwen2", "qwen2_sliding_default_max_window_layers",
     dict(use_sliding_window=True, sliding_window=4096, rope_theta=1000000.0), 4),
    ("qwen2", "qwen2_sliding_off",
     dict(use_sliding_window=False, sliding_window=4096, max_window_layers=2,
          rope_theta=1000000.0), 3),
    ("qwen3", "qwen3_sliding_from_layer3",
     dict(use_sliding_window=True, sliding_window=4096, max_window_layers=3,
          rope_theta=1000000.0), 5),
    ("qwen3", "qwen3_sliding_off_null_window",
     dict(use_sliding_window=False, sliding_window=None, max_window_layers=28,
          rope_theta=1000000.0), 3),
    ("phi3", "phi3_sliding_every_layer",
     dict(sliding_window=2047, rope_theta=10000.0, rope_scaling=None), 2),
    ("mistral", "mistral_sliding_every_layer",
     dict(sliding_window=4096, rope_theta=10000.0), 2),
    ("mistral", "mistral_null_window",
     dict(sliding_window=None, rope_theta=1000000.0), 2),
    # configs written by transformers 4.5x: layer_types, but the older rope keys
    ("gemma3_text", "gemma3_with_layer_types_old_rope_keys",
     dict(sliding_window=512, rope_theta=1000000.0, rope_local_base_freq=10000.0,
          rope_scaling=None, query_pre_attn_scalar=8,
          layer_types=["sliding_attention", "sliding_attention", "full_attention"]), 3),
    # layer_types that the modeling code overrides or ignores
    ("qwen2", "qwen2_with_layer_types_sliding_off",
     dict(use_sliding_window=False, sliding_window=4096, max_window_layers=0,
          layer_types=["sliding_attention", "sliding_attention"], rope_theta=1000000.0), 2),
    ("mistral", "mistral_with_layer_types",
     dict(sliding_window=4096, layer_types=["full_attention", "sliding_attention"],
          rope_theta=1000000.0), 2),
    ("gpt_oss", "gpt_oss_no_rope_scaling",
     dict(sliding_window=128, rope_theta=150000.0), 2),
    # no sliding_window key: the config classes' default window (null means none)
    ("mistral", "mistral_no_window_key", dict(rope_theta=10000.0), 2),
    ("gemma2", "gemma2_no_window_key", dict(rope_theta=10000.0, query_pre_attn_scalar=8), 2),
    ("gemma3_text", "gemma3_no_window_key",
     dict(sliding_window_pattern=2, query_pre_attn_scalar=8), 2),
    ("gpt_oss", "gpt_oss_no_window_key", dict(rope_theta=150000.0), 2),
    # use_bidirectional_attention (EmbeddingGemma): Gemma3TextConfig halves the window
    ("gemma3_text", "gemma3_bidirectional_window_halved",
     dict(sliding_window=512, use_bidirectional_attention=True, sliding_window_pattern=2,
          query_pre_attn_scalar=8), 2),
    # a window of 1 halves to 1, and to_dict writes (1 - 1) * 2 = 0, which reloads as 1
    ("gemma3_text", "gemma3_bidirectional_window_1_saved_as_0",
     dict(sliding_window=0, use_bidirectional_attention=True, sliding_window_pattern=2,
          query_pre_attn_scalar=8), 2),
    ("gemma3_text", "gemma3_bidirectional_no_window_key",
     dict(use_bidirectional_attention=True, sliding_window_pattern=2, query_pre_attn_scalar=8), 2),
    ("qwen2", "qwen2_sliding_no_window_key",
     dict(use_sliding_window=True, max_window_layers=1, rope_theta=1000000.0), 2),
    ("qwen3", "qwen3_sliding_no_window_key",
     dict(use_sliding_window=True, max_window_layers=1, rope_theta=1000000.0), 2),
    # both spellings of the rope: a non-empty rope_scaling replaces rope_parameters whole
    ("llama", "llama_rope_scaling_replaces_rope_parameters",
     dict(rope_theta=500.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
          rope_parameters={"rope_type": "default", "rope_theta": 1000.0}), 1),
    ("gemma2", "gemma2_rope_scaling_replaces_nested_rope_parameters",
     dict(query_pre_attn_scalar=8, rope_scaling={"rope_type": "linear", "factor": 2.0},
          rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
                           "full_attention": {"rope_type": "default", "rope_theta": 3000.0}}), 2),
    ("qwen2", "qwen2_rope_scaling_replaces_nested_top_level_original_wins",
     dict(original_max_position_embeddings=128, max_position_embeddings=512,
          rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
          rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000.0}}), 1),
    ("qwen2", "qwen2_empty_rope_scaling_keeps_rope_parameters",
     dict(rope_scaling={}, rope_parameters={"rope_type": "linear", "factor": 3.0,
                                            "rope_theta": 1000.0}), 1),
    # each config class reads its own top-level names only (found by a randomised campaign)
    ("gpt_neox", "gpt_neox_ignores_rope_theta_and_partial_rotary_factor",
     dict(rope_theta=500.0, partial_rotary_factor=0.5), 1),
    ("gpt_neox", "gpt_neox_rotary_emb_base_and_rotary_pct_win",
     dict(rope_theta=500.0, rotary_emb_base=2000.0, partial_rotary_factor=0.25, rotary_pct=0.5), 1),
    ("llama", "llama_ignores_rotary_emb_base", dict(rotary_emb_base=2000.0), 1),
    ("phi3", "phi3_ignores_rotary_pct", dict(rope_theta=10000.0, rotary_pct=0.5), 1),
    ("gpt_oss", "gpt_oss_empty_rope_scaling_is_no_rope",
     dict(sliding_window=128, rope_theta=150000.0, rope_scaling={}), 2),
    # no rope_theta (nor rotary_pct): the config classes' defaults
    ("llama", "llama_no_rope_theta", dict(), 1),
    ("phi3", "phi3_no_rope_theta", dict(), 1),
    ("gemma3_text", "gemma3_no_rope_theta",
     dict(sliding_window=512, query_pre_attn_scalar=8), 6),
    ("gpt_oss", "gpt_oss_no_rope_theta", dict(sliding_window=128), 2),
    ("gpt_neox", "gpt_neox_no_rope_theta_nor_rotary_pct", dict(), 1),
    ("mixtral", "mixtral_no_rope_theta_no_window_key", dict(), 2),
    ("mixtral", "mixtral_sliding_every_layer", dict(sliding_window=4096, rope_theta=1000.0), 2),
    ("gemma", "gemma_no_rope_theta", dict(), 1),
    # Qwen3-MoE: the window on every layer, only with use_sliding_window
    ("qwen3_moe", "qwen3_moe_sliding_every_layer_no_window_key",
     dict(use_sliding_window=True, rope_theta=1000000.0), 2),
    ("qwen3_moe", "qwen3_moe_sliding_off", dict(sliding_window=512, rope_theta=1000000.0), 2),
    # Qwen2-MoE: the even layers below max_window_layers slide, with use_sliding_window
    ("qwen2_moe", "qwen2_moe_sliding_even_layers_below_max_window_layers",
     dict(use_sliding_window=True, sliding_window=64, max_window_layers=3, rope_theta=1000000.0), 5),
    ("qwen2_moe", "qwen2_moe_sliding_off", dict(sliding_window=64, rope_theta=1000000.0), 2),
    ("starcoder2", "starcoder2_no_window_key_no_rope_theta", dict(), 2),
    ("starcoder2", "starcoder2_sliding_every_layer", dict(sliding_window=4096, rope_theta=100000.0), 2),
    ("granite", "granite_no_rope_theta", dict(attention_multiplier=0.0078125), 1),
    ("llama", "llama3_rope_scaling",
     dict(rope_theta=500000.0, max_position_embeddings=131072,
          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}), 2),
]


def hf_modeling_window(attn: nn.Module, config) -> int | None:
    """The window the attention module passes to the attention function: its own
    `sliding_window` attribute (set from the layer type), else the config's
    `sliding_window` when forward passes that (Mistral, Phi-3), else none."""
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window
    src = inspect.getsource(type(attn).forward)
    if 'sliding_window=getattr(self.config, "sliding_window", None)' in src:
        return config.sliding_window
    assert "sliding_window" not in src, type(attn).__name__
    return None


# LongRoPE config.json files as Phi-3-mini-128k, Phi-3.5-mini and Phi-4-mini ship them (sizes
# and factor lists shrunk), the older spellings Phi3Config renames, and which
# original_max_position_embeddings wins.  For these layers the file also records what
# transformers' own rotary module computes (see hf_longrope_rotary).
LONGROPE_SHORT, LONGROPE_LONG = [1.0, 1.05, 1.2, 1.6], [1.0, 1.9, 5.5, 12.0]


def longrope_scaling(kind: str = "longrope", key: str = "type", n: int = 4, **extra) -> dict:
    return {key: kind, "short_factor": LONGROPE_SHORT[:n], "long_factor": LONGROPE_LONG[:n],
            **extra}


PHI3_128K = dict(max_position_embeddings=131072, original_max_position_embeddings=4096,
                 rope_theta=10000.0)
HF_DEFAULTS_LONGROPE_CASES = [
    ("phi3", "phi3_longrope_128k",
     dict(**PHI3_128K, sliding_window=262144, rope_scaling=longrope_scaling()), 2),
    ("phi3", "phi3_longrope_rope_type_key",
     dict(**PHI3_128K, rope_scaling=longrope_scaling(key="rope_type")), 1),
    # Phi3Config renames the older "su" and "yarn" to "longrope"
    ("phi3", "phi3_su_is_longrope", dict(**PHI3_128K, rope_scaling=longrope_scaling("su")), 1),
    ("phi3", "phi3_yarn_is_longrope", dict(**PHI3_128K, rope_scaling=longrope_scaling("yarn")), 1),
    # Phi-4-mini: partial rotary, so rotary_dim/2 = 3 factors
    ("phi3", "phi3_longrope_partial_rotary",
     dict(**PHI3_128K, partial_rotary_factor=0.75, rope_scaling=longrope_scaling(n=3)), 1),
    # the top-level original_max_position_embeddings replaces the one in rope_scaling ...
    ("phi3", "phi3_longrope_top_level_original_wins",
     dict(**PHI3_128K,
          rope_scaling=longrope_scaling(original_max_position_embeddings=8192)), 1),
    # ... and Phi3Config's default 4096 does too
    ("phi3", "phi3_longrope_original_defaults_to_4096",
     dict(max_position_embeddings=16384, rope_theta=10000.0,
          rope_scaling=longrope_scaling(original_max_position_embeddings=2048)), 1),
    # neither length: both 4096, so factor 1 and attention factor 1
    ("phi3", "phi3_longrope_no_lengths",
     dict(rope_theta=10000.0, rope_scaling=longrope_scaling()), 1),
    ("phi3", "phi3_longrope_explicit_factor",
     dict(**PHI3_128K, rope_scaling=longrope_scaling(factor=2.0)), 1),
    ("phi3", "phi3_longrope_explicit_attention_factor",
     dict(**PHI3_128K, rope_scaling=longrope_scaling(attention_factor=1.25)), 1),
    # other architectures: a top-level original_max_position_embeddings wins when there is one
    ("llama", "llama_longrope_top_level_original_wins",
     dict(max_position_embeddings=131072, original_max_position_embeddings=2048, rope_theta=10000.0,
          rope_scaling=longrope_scaling(key="rope_type",
                                        original_max_position_embeddings=4096)), 1),
    ("llama", "llama_longrope_original_in_rope_scaling",
     dict(max_position_embeddings=131072, rope_theta=10000.0,
          rope_scaling=longrope_scaling(key="rope_type",
                                        original_max_position_embeddings=4096)), 1),
    # dynamic NTK: plain rope up to max_position_embeddings, theta grown past it
    ("llama", "llama_dynamic_ntk",
     dict(max_position_embeddings=64, rope_theta=10000.0,
          rope_scaling={"rope_type": "dynamic", "factor": 2.0}), 1),
    ("qwen2", "qwen2_dynamic_ntk_old_type_key",
     dict(max_position_embeddings=128, rope_theta=1000000.0,
          rope_scaling={"type": "dynamic", "factor": 4.0}), 1),
    ("gpt_neox", "gpt_neox_dynamic_ntk_partial_rotary",
     dict(max_position_embeddings=32, rotary_pct=0.5, rotary_emb_base=10000.0,
          rope_scaling={"rope_type": "dynamic", "factor": 3.0}), 1),
    ("llama", "llama3_top_level_original_wins",
     dict(rope_theta=500000.0, max_position_embeddings=131072,
          original_max_position_embeddings=2048,
          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}), 1),
]


def hf_rotary_calls(modeling, rotary_cls: str, config, positions) -> dict:
    """Runs one transformers rotary module in float64 over calls whose largest position id
    is each of `positions`, in that order (the module may keep state between them): its
    attention scaling, and per call the frequencies it used and cos/sin at that largest
    position (the first rotary_dim/2 entries; the rest repeat them)."""
    calls = []
    with hf_float64():
        rotary = getattr(modeling, rotary_cls)(config)
        plain = rotary.inv_freq.tolist()
        for p in positions:
            cos, sin = rotary(torch.zeros(1, 1, dtype=F64), torch.tensor([[0, p]]))
            inv = rotary.inv_freq
            assert inv.dtype == F64 and cos.dtype == F64, (inv.dtype, cos.dtype)
            half = inv.numel()
            ang = p * inv.to(F64)
            torch.testing.assert_close(cos[0, 1, :half], ang.cos() * rotary.attention_scaling)
            calls.append({"max_position": p, "inv_freq": inv.tolist(),
                          "cos": cos[0, 1, :half].tolist(), "sin": sin[0, 1, :half].tolist()})
    return {"attention_scaling": rotary.attention_scaling, "calls": calls, "plain": plain}


def hf_longrope_rotary(modeling, rotary_cls: str, config, params: dict) -> dict:
    """What transformers' rotary module does with a longrope config: calls whose largest
    position id is just below the switch, at it, and below it again."""
    old = params["original_max_position_embeddings"]
    out = hf_rotary_calls(modeling, rotary_cls, config, (old - 1, old, old - 1))
    inv = [c["inv_freq"] for c in out["calls"]]
    assert inv[0] == inv[2] != inv[1], "no switch"
    return {"attention_scaling": out["attention_scaling"], "calls": out["calls"]}


def hf_dynamic_rotary(modeling, rotary_cls: str, config, params: dict) -> dict:
    """What transformers' rotary module does with a dynamic (NTK) rope: calls whose largest
    position id is just below max_position_embeddings (plain rope), at it and past it (theta
    grows with the call's length), and well below it again (its state resets to the plain
    rope).  The module keeps state between calls; in this growing-then-reset order it equals
    a rule that looks at each call alone, which the crate follows."""
    mpe = config.max_position_embeddings
    out = hf_rotary_calls(modeling, rotary_cls, config, (mpe - 1, mpe, mpe + 5, mpe - 2))
    assert out["attention_scaling"] == 1.0
    inv = [c["inv_freq"] for c in out["calls"]]
    assert inv[0] == inv[3] == out["plain"] != inv[1] != inv[2], "no growth or no reset"
    return {"attention_scaling": out["attention_scaling"], "calls": out["calls"]}


def hf_config_defaults_case(arch: str, name: str, config_json: dict, layers: int) -> dict:
    config_cls, module, attn_cls, rotary_cls = HF_DEFAULTS_ARCHS[arch]
    config_json = {"model_type": arch, **HF_DEFAULTS_SIZES, "num_hidden_layers": layers,
                   **config_json}
    # from_dict modifies the dicts it is given (it adds rope_theta to rope_scaling)
    config = hf_class(config_cls).from_dict(copy.deepcopy(config_json))
    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    rotary = getattr(modeling, rotary_cls)(config)
    as_dict = json.loads(json.dumps(config.to_dict(), default=str))
    layer_types = getattr(config, "layer_types", None)
    rope = config.rope_parameters
    out = []
    for i in range(layers):
        layer_type = layer_types[i] if layer_types is not None else None
        nested = isinstance(rotary.rope_type, dict)       # Gemma 3: one rope per layer type
        params = dict(rope[layer_type] if nested else rope)
        assert params["rope_type"] == (rotary.rope_type[layer_type] if nested else rotary.rope_type)
        attn = getattr(modeling, attn_cls)(config, i)
        window = hf_modeling_window(attn, config)
        assert window == hf_window(arch, as_dict, i), (name, i, window)
        layer = {"layer_type": layer_type, "sliding_window": window,
                 "rope": dict(sorted(params.items()))}
        if not getattr(attn, "is_causal", True):
            layer["bidirectional"] = True
        if params["rope_type"] == "longrope":
            layer["rotary"] = hf_longrope_rotary(modeling, rotary_cls, config, params)
        if params["rope_type"] == "dynamic":
            layer["rotary"] = hf_dynamic_rotary(modeling, rotary_cls, config, params)
        out.append(layer)
    return {"architecture": arch, "name": name, "config": config_json, "layers": out}


def export_hf_config_defaults() -> Path:
    cases = [hf_config_defaults_case(*c) for c in HF_DEFAULTS_CASES + HF_DEFAULTS_LONGROPE_CASES]
    doc = {"format": HF_DEFAULTS_FORMAT, "transformers_version": transformers.__version__,
           "cases": cases}
    # one line per case field and per layer: small, and a diff shows what moved
    lines = [f'{{"format": {json.dumps(doc["format"])},',
             f' "transformers_version": {json.dumps(doc["transformers_version"])},',
             ' "cases": [']
    for n, c in enumerate(cases):
        lines.append(f'  {{"architecture": {json.dumps(c["architecture"])}, '
                     f'"name": {json.dumps(c["name"])},')
        lines.append(f'   "config": {json.dumps(c["config"])},')
        lines.append('   "layers": [')
        lines += [f'    {json.dumps(layer)}' + ("," if j + 1 < len(c["layers"]) else "")
                  for j, layer in enumerate(c["layers"])]
        lines.append("   ]}" + ("," if n + 1 < len(cases) else ""))
    lines.append(" ]}")
    text = "\n".join(lines) + "\n"
    assert json.loads(text) == json.loads(json.dumps(doc)), "the hand-laid-out JSON is wrong"
    HF_DEFAULTS_FILE.write_text(text)
    return HF_DEFAULTS_FILE


# --------------------------------------------------------------------------
# Writing and checking the files
# --------------------------------------------------------------------------

ST_DTYPE = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
            torch.bfloat16: "BF16", torch.uint8: "U8", torch.int64: "I64"}


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
        "config": json.dumps(fx.config, sort_keys=True, default=str),
        "call": json.dumps(fx.call, sort_keys=True),
        "dtype": str(dtype).removeprefix("torch."),
        "torch_version": torch.__version__,
        **fx.metadata,
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


def export_hf_case(case: HfCase, written: list[Path], deviations: dict[str, float]):
    for short, dtype in DTYPES.items():
        if short in ("f16", "bf16") and not case.all_dtypes:
            continue
        fx = build_hf_attention(case, dtype)
        written.append(save_fixture(fx, short, dtype))
        if short == "f64":
            deviations[case.name] = hf_stock_deviation(case, fx)


def print_hf_deviations(deviations: dict[str, float]):
    print("hf_attention: max |stock HF (float32 rotary/RMSNorm/softmax) - float64 oracle|"
          " / max |oracle|, f64 fixtures:")
    for name, dev in deviations.items():
        print(f"  {name:<40} {dev:.1e}")
    assert max(deviations.values()) < 1e-4, "the float64 promotion changed more than rounding"


def export_hf_cases(cases: list[HfCase]):
    """--hf-case: rewrite only these cases' files; the budget counts every hf_attention file."""
    for case in cases:
        for stale in OUT_DIR.glob(f"hf_attention__{case.name}__*.safetensors"):
            stale.unlink()
    written, deviations = [], {}
    for case in cases:
        export_hf_case(case, written, deviations)
    hf_total = sum(p.stat().st_size for p in OUT_DIR.glob("hf_attention__*.safetensors"))
    print(f"torch {torch.__version__}, transformers {transformers.__version__}: "
          f"wrote {len(written)} hf_attention fixtures to {OUT_DIR}")
    for p in written:
        print(f"  {p.name:<64} {p.stat().st_size} bytes")
    print(f"all hf_attention fixtures: {hf_total} bytes ({hf_total / 1024:.1f} KiB)")
    print_hf_deviations(deviations)
    assert hf_total <= MAX_HF_BYTES, "hf_attention fixtures exceed the size budget"


def builder(kind: str):
    """The function that builds a fixture of one of the PyTorch kinds."""
    return {"sdpa": build_sdpa, "multihead_attention": build_multihead_attention}.get(
        kind, build_notes)


def torch_kind_cases() -> list[tuple[str, object]]:
    """(kind, case) for every case of the PyTorch kinds, in export order."""
    return ([("sdpa", c) for c in SDPA_CASES]
            + [("multihead_attention", c) for c in MHA_CASES]
            + [(c.kind, c) for c in NOTES_CASES])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-config-defaults-only", action="store_true",
                        help=f"write only {HF_DEFAULTS_FILE.name}; leave the fixtures alone")
    parser.add_argument("--hf-case", action="append", metavar="NAME",
                        choices=[c.name for c in HF_CASES],
                        help="write only this hf_attention case (repeatable); leave every other "
                             "file alone")
    parser.add_argument("--case", action="append", metavar="KIND__NAME",
                        choices=[f"{k}__{c.name}" for k, c in torch_kind_cases()],
                        help="write only this case of the PyTorch kinds (sdpa, "
                             "multihead_attention, notes_*), e.g. sdpa__basic (repeatable); "
                             "leave every other file alone")
    args = parser.parse_args()
    assert sys.byteorder == "little"
    torch.set_num_threads(1)
    torch.backends.mha.set_fastpath_enabled(False)
    OUT_DIR.mkdir(exist_ok=True)
    if args.hf_case:
        export_hf_cases([c for c in HF_CASES if c.name in args.hf_case])
        return
    if args.case:
        for kind, case in torch_kind_cases():
            if f"{kind}__{case.name}" in args.case:
                for short, dtype in DTYPES.items():
                    p = save_fixture(builder(kind)(case, dtype), short, dtype)
                    print(f"  {p.name:<64} {p.stat().st_size} bytes")
        return
    defaults = export_hf_config_defaults()
    print(f"transformers {transformers.__version__}: wrote {defaults} "
          f"({len(HF_DEFAULTS_CASES) + len(HF_DEFAULTS_LONGROPE_CASES)} cases, "
          f"{defaults.stat().st_size} bytes)")
    if args.hf_config_defaults_only:
        return
    for kind in KINDS:
        for stale in OUT_DIR.glob(f"{kind}__*.safetensors"):
            stale.unlink()

    written = []
    for kind, case in torch_kind_cases():
        for short, dtype in DTYPES.items():
            written.append(save_fixture(builder(kind)(case, dtype), short, dtype))

    hf_written, deviations = [], {}
    for case in HF_CASES:
        export_hf_case(case, hf_written, deviations)

    counts = Counter((p.stem.split("__")[0], p.stem.split("__")[2]) for p in written + hf_written)
    total = sum(p.stat().st_size for p in written)
    hf_total = sum(p.stat().st_size for p in hf_written)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}: "
          f"wrote {len(written) + len(hf_written)} fixtures to {OUT_DIR}")
    for kind in KINDS:
        row = "  ".join(f"{s}={counts[(kind, s)]}" for s in DTYPES)
        print(f"  {kind:<20} {row}")
    print(f"total {total + hf_total} bytes ({(total + hf_total) / 1024:.1f} KiB), "
          f"of which hf_attention {hf_total} bytes ({hf_total / 1024:.1f} KiB)")
    print_hf_deviations(deviations)
    assert total <= MAX_TOTAL_BYTES, "fixtures exceed the size budget"
    assert hf_total <= MAX_HF_BYTES, "hf_attention fixtures exceed the size budget"


if __name__ == "__main__":
    main()
