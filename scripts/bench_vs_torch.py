#!/usr/bin/env python3
"""Times PyTorch's CPU attention on the cases of `examples/bench.rs`, alternating with
the Rust benchmark, and prints torch_ms / ours_ms per case (> 1 means we are faster).

Setup (a venv outside the repo):
    python3 -m venv /tmp/venv && /tmp/venv/bin/pip install torch safetensors numpy
    cargo build --release --example bench
    /tmp/venv/bin/python scripts/bench_vs_torch.py [--case NAME | --shape B,Hq,Hkv,L,S,D[,causal|causal_br]] [--dtype f32|bf16|f16] [--rounds 5] [--min-secs 1]

`--shape` runs one SDPA case of any shape instead of the named ones, as `bench --shape`
does: `causal` is PyTorch's `is_causal` (top-left), `causal_br` the bottom-right rule
(query i sees keys up to i + S - L), which PyTorch runs as a boolean `attn_mask`
(`torch.ones(L, S).tril(S - L)`), as Hugging Face models pass it.

Timing rule (the same as the Rust side): after a warm-up, `rounds` timings, each running
whole calls for at least `min-secs`; the figure is the median time per call. PyTorch runs
`F.scaled_dot_product_attention` (`nn.MultiheadAttention` for `mha_layer`) with as many
threads as the machine has cores, under `torch.inference_mode()`. Torch and the Rust binary
alternate: torch, rust, torch; torch's figure is the median over both of its turns. The Rust
side runs `--impl ours` (the candle comparisons come from `examples/bench.rs` itself). The
machine's f32 FMA peak and DRAM read bandwidth (`bench --peak-only`) are printed before the
first case and after the last, and `ours_GB/s` (bytes of q, k, v and the output per second,
as the Rust bench counts them) can be read against that bandwidth for the decode cases.

Agreement: both sides time the same inputs. Before timing a case, the script draws its
inputs from a seeded generator (`inputs`), computes PyTorch's output on them in the
case's dtype and again in float64, and writes the inputs and the float64 output to a
temporary safetensors file, which the Rust binary reads (`bench --inputs`). The Rust side
stops with an error when our output is further from PyTorch's float64 output than the
fixtures' tolerance of the dtype (f32 1e-5, f16 5e-3, bf16 2e-2, in the fixtures'
normalised error `max |got - expected| / max(1, max |expected|)`); this script stops when
PyTorch's own output in the dtype is further than that from its float64 output. A wrong
mask, scale or weight on either side therefore stops the run instead of timing different
work. `torch_err` and `ours_err` print the two errors.

`gemma2_softcap` and `gptoss_sinks` need a logit soft-cap or attention sinks, which
`F.scaled_dot_product_attention` does not take; PyTorch runs Hugging Face's eager attention
for those families there (see `eager`), as transformers does on CPU.

`decode_gqa_cache` and `decode_b4_cache` read K/V from this crate's `KvCache`, whose CPU
buffers are advised for transparent huge pages. For those two, PyTorch runs in a child
process with `THP_MEM_ALLOC_ENABLE=1`, so that its tensors get huge pages too.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release", "examples", "bench")

ALL = ["f32", "bf16", "f16"]
CASES = {
    # name: (B, Hq, Hkv, L, S, D, causal, pad, dtypes)
    "enc512": (1, 16, 16, 512, 512, 64, False, False, ALL),
    "enc1k_d128": (1, 16, 16, 1024, 1024, 128, False, False, ALL),
    "gpt1k_causal": (1, 32, 32, 1024, 1024, 64, True, False, ALL),
    "gpt2k_causal_d128": (1, 32, 32, 2048, 2048, 128, True, False, ALL),
    "bert_pad": (8, 12, 12, 128, 128, 64, False, True, ALL),
    "long8k_causal": (1, 8, 8, 8192, 8192, 64, True, False, ["f32"]),
    "long32k_causal": (1, 8, 8, 32768, 32768, 64, True, False, ["f32"]),
    "decode_gqa": (1, 32, 8, 1, 4096, 128, False, False, ALL),
    "decode_b4": (4, 32, 32, 1, 2048, 128, False, False, ALL),
    "decode_gqa_cache": (1, 32, 8, 1, 4096, 128, False, False, ALL),
    "decode_b4_cache": (4, 32, 32, 1, 2048, 128, False, False, ALL),
    "mha_layer": (8, 12, 12, 128, 128, 64, False, False, ["f32", "bf16", "f16"]),
    "gemma2_softcap": (1, 16, 8, 1024, 1024, 256, True, False, ["f32", "bf16"]),
    "gptoss_sinks": (1, 64, 8, 1024, 1024, 64, True, False, ["f32", "bf16"]),
}
# Cases that PyTorch's SDPA cannot express: they run the eager attention of Hugging Face's
# modeling code for the family (`eager_attention_forward` of Gemma 2 and gpt-oss).
EAGER = {"gemma2_softcap": ("softcap", 50.0), "gptoss_sinks": ("sinks", None)}
# Cases whose PyTorch side allocates with huge pages (PyTorch reads the variable once).
THP_CASES = {"decode_gqa_cache", "decode_b4_cache"}
DT = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
# The fixtures' tolerances (`src/fixture.rs`): the Rust side holds our output to them
# against PyTorch's float64 output, and this script PyTorch's own output.
TOL = {"f32": 1e-5, "bf16": 2e-2, "f16": 5e-3}


def parse_shape(spec):
    """`B,Hq,Hkv,L,S,D[,causal|causal_br]` as a `CASES` entry and its name, which is
    the name `bench --shape` gives the case."""
    parts = spec.split(",")
    if len(parts) not in (6, 7):
        sys.exit(f"--shape takes B,Hq,Hkv,L,S,D[,causal|causal_br], got {spec!r}")
    try:
        b, hq, hkv, l, s, d = (int(x) for x in parts[:6])
    except ValueError:
        sys.exit(f"--shape {spec!r}: the first six fields are sizes")
    rule = parts[6] if len(parts) == 7 else None
    if rule not in (None, "causal", "causal_br"):
        sys.exit(f"--shape {spec!r}: the rule is causal or causal_br, got {rule!r}")
    # The same checks as `bench --shape`, before PyTorch runs.
    if min(b, hq, hkv, l, s, d) <= 0 or hq % hkv:
        sys.exit(f"--shape {spec!r}: every size must be positive and Hkv must divide Hq")
    if rule == "causal_br" and l > s:
        sys.exit(f"--shape {spec!r}: causal_br needs L <= S")
    name = f"shape_{b}_{hq}_{hkv}_{l}_{s}_{d}" + (f"_{rule}" if rule else "")
    causal = {None: False, "causal": True, "causal_br": "causal_br"}[rule]
    return name, (b, hq, hkv, l, s, d, causal, False, ALL)


def time_median(fn, rounds, min_secs):
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-9)
    iters = max(1, math.ceil(min_secs / once))
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


# Seed of every case's inputs, so that the THP child process draws the same ones.
SEED = 1234
MHA_WEIGHTS = ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")


def inputs(name, dtype):
    """The tensors PyTorch's side of `name` runs on, in `dtype`, drawn as the Rust side
    draws its own (standard normal in f32, then converted), from a generator seeded with
    `SEED`. For `mha_layer`: `x` and the layer's weights under their `state_dict` names,
    PyTorch's initialisation with random biases (PyTorch initialises them to 0, which
    would leave them unchecked)."""
    b, hq, hkv, l, s, d, _, _, _ = CASES[name]
    dt = DT[dtype]
    gen = torch.Generator().manual_seed(SEED)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dt)

    if name == "mha_layer":
        e = hq * d
        torch.manual_seed(SEED)
        mha = torch.nn.MultiheadAttention(e, hq, batch_first=True)
        t = {k: w.detach().to(dt) for k, w in mha.state_dict().items()}
        t["in_proj_bias"] = rnd(3 * e) * e ** -0.5
        t["out_proj.bias"] = rnd(e) * e ** -0.5
        t["x"] = rnd(b, l, e)
        return t
    t = {"q": rnd(b, hq, l, d), "k": rnd(b, hkv, s, d), "v": rnd(b, hkv, s, d)}
    if name in EAGER and EAGER[name][0] == "sinks":
        t["sinks"] = rnd(hq)
    return t


def prepare(name, t):
    """A function of no arguments that runs PyTorch's attention for `name` on the tensors
    `t` (of `inputs`), in their dtype."""
    b, hq, hkv, l, s, d, causal, pad, _ = CASES[name]
    if name == "mha_layer":
        x = t["x"]
        mha = torch.nn.MultiheadAttention(hq * d, hq, batch_first=True, dtype=x.dtype)
        mha.load_state_dict({k: t[k] for k in MHA_WEIGHTS})
        mha.eval()
        return lambda: mha(x, x, x, need_weights=False)[0]
    q, k, v = t["q"], t["k"], t["v"]
    if name in EAGER:
        _, cap = EAGER[name]
        causal_mask = torch.full((l, s), float("-inf"), dtype=q.dtype).triu(1)
        sinks = t.get("sinks")
        return lambda: eager(q, k, v, causal_mask, cap, sinks)
    mask = None
    if causal == "causal_br":
        mask = torch.ones(l, s, dtype=torch.bool).tril(s - l)
        causal = False
    if pad:
        mask = torch.ones(b, 1, 1, s, dtype=torch.bool)
        mask[1::2, ..., s - s // 4:] = False
    gqa = hq != hkv
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)


def torch_case(name, dtype, rounds, min_secs):
    with torch.inference_mode():
        return time_median(prepare(name, inputs(name, dtype)), rounds, min_secs)


def normalised_err(got, expected):
    """`max |got - expected| / max(1, max |expected|)` in float64: the fixtures' error
    (`src/fixture.rs`), held against the same per-dtype tolerances."""
    got, expected = got.double(), expected.double()
    if got.shape != expected.shape or not torch.isfinite(got).all():
        return math.inf
    return ((got - expected).abs().max() / expected.abs().max().clamp(min=1.0)).item()


def write_check(name, dtype, path):
    """Writes `path` for `bench --inputs`: the case's inputs and `expected`, PyTorch's
    output for them computed in float64 (stored as f32). Returns the error of PyTorch's
    own output in `dtype` against it."""
    t = inputs(name, dtype)
    with torch.inference_mode():
        got = prepare(name, t)()
        expected = prepare(name, {k: x.double() for k, x in t.items()})()
    save_file({**{k: x.contiguous() for k, x in t.items()}, "expected": expected.float().contiguous()}, path)
    return normalised_err(got, expected)


def eager(q, k, v, causal_mask, softcap, sinks):
    """Hugging Face's eager attention for Gemma 2 (soft-cap before the mask, softmax in
    float32) and gpt-oss (a sink column joined to the logits, max subtracted, softmax in
    the input dtype, column dropped), with `repeat_kv` for GQA."""
    b, hkv, s, d = k.shape
    g = q.shape[1] // hkv

    def repeat_kv(x):
        return x[:, :, None].expand(b, hkv, g, s, d).reshape(b, hkv * g, s, d)

    w = torch.matmul(q, repeat_kv(k).transpose(2, 3)) * d ** -0.5
    if softcap is not None:
        w = torch.tanh(w / softcap) * softcap
    w = w + causal_mask
    if sinks is not None:
        combined = torch.cat([w, sinks.reshape(1, -1, 1, 1).expand(b, -1, w.shape[2], -1)], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        w = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    else:
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(w, repeat_kv(v))


def torch_case_thp(name, dtype, rounds, min_secs):
    """`torch_case` in a child process whose PyTorch allocates with huge pages."""
    env = dict(os.environ, THP_MEM_ALLOC_ENABLE="1")
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--torch-only", "--case", name, "--dtype", dtype,
         "--rounds", str(rounds), "--min-secs", str(min_secs)],
        check=True, capture_output=True, text=True, env=env,
    ).stdout
    return float(out.split()[-1])


def rust_case(name, dtype, rounds, min_secs, shape=None, given=None):
    which = ["--shape", shape] if shape else ["--case", name]
    extra = ["--inputs", given] if given else []
    run = subprocess.run(
        [BIN, "--json", *which, "--dtype", dtype, "--impl", "ours", "--rounds", str(rounds),
         "--min-secs", str(min_secs), "--no-peak", *extra],
        capture_output=True, text=True,
    )
    if run.returncode:
        sys.exit(f"bench failed on {name} {dtype}:\n{run.stderr.split('Stack backtrace:')[0].strip()}")
    return {r["impl"]: r for r in map(json.loads, run.stdout.splitlines())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case")
    ap.add_argument("--shape")
    ap.add_argument("--dtype")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min-secs", type=float, default=1.0)
    # Internal: time one case of PyTorch alone and print its seconds per call.
    ap.add_argument("--torch-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds takes a whole number of at least 1, got {args.rounds}")
    if not (math.isfinite(args.min_secs) and args.min_secs >= 0):
        ap.error(f"--min-secs takes a finite number of seconds, at least 0, got {args.min_secs}")
    if args.shape:
        if args.case:
            sys.exit("--shape and --case exclude each other")
        args.case, CASES[args.case] = parse_shape(args.shape)
    if args.torch_only:
        torch.set_num_threads(os.cpu_count())
        print(torch_case(args.case, args.dtype, args.rounds, args.min_secs))
        return
    if not os.path.exists(BIN):
        sys.exit(f"build the Rust benchmark first: cargo build --release --example bench ({BIN} is missing)")
    torch.set_num_threads(os.cpu_count())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print_peak()
    w = max(18, len(args.case or ""))
    print(f"{'case':<{w}} {'dtype':<5} {'torch_ms':>10} {'ours_ms':>10} {'torch/ours':>10} {'ours_GB/s':>9}"
          f" {'torch_err':>9} {'ours_err':>9}")
    tmp = tempfile.TemporaryDirectory(prefix="bench_vs_torch")
    for name, spec in CASES.items():
        if args.case and args.case != name:
            continue
        for dtype in spec[8]:
            if args.dtype and args.dtype != dtype:
                continue
            given = os.path.join(tmp.name, f"{name}_{dtype}.safetensors")
            torch_err = write_check(name, dtype, given)
            if torch_err > TOL[dtype]:
                sys.exit(f"{name} {dtype}: PyTorch's output is {torch_err:.2e} from its own float64 output, "
                         f"more than the {dtype} tolerance {TOL[dtype]:.0e}")
            timer = torch_case_thp if name in THP_CASES else torch_case
            torch_t = [timer(name, dtype, args.rounds, args.min_secs) * 1e3]
            r = rust_case(name, dtype, args.rounds, args.min_secs, args.shape, given)["ours"]
            os.remove(given)
            ours = r["ms"]
            torch_t.append(timer(name, dtype, args.rounds, args.min_secs) * 1e3)
            t = statistics.median(torch_t)
            print(f"{name:<{w}} {dtype:<5} {t:>10.3f} {ours:>10.3f} {t / ours:>10.2f} {r['gbps']:>9.2f}"
                  f" {torch_err:>9.1e} {r['err_vs_f64']:>9.1e}", flush=True)
    print_peak()


def print_peak():
    """The machine's f32 FMA peak and read bandwidth now, as measured by the Rust benchmark."""
    out = subprocess.run([BIN, "--peak-only"], check=True, capture_output=True, text=True)
    print(out.stderr.strip(), flush=True)


if __name__ == "__main__":
    main()
