#!/usr/bin/env python3
"""Summarises `cargo run --release --example parity -- --json` as the README's markdown table.

    cargo run --release --example parity -- --json | python3 scripts/parity_summary.py
"""
import json
import sys

ORDER = {"f64": 0, "f32": 1, "f16": 2, "bf16": 3}
KINDS = ["sdpa", "multihead_attention", "notes_sdpa", "notes_multihead", "notes_causal", "hf_attention"]

rows = [json.loads(line) for line in sys.stdin if line.strip()]
agg = {}
for r in rows:
    a = agg.setdefault((r["kind"], r["dtype"]), {"n": 0, "pass": 0, "worst": 0.0, "tol": None})
    # A fixture that failed with an error has no tolerance, and its dtype is "?".
    a["tol"] = a["tol"] if r["tol"] is None else r["tol"]
    a["n"] += 1
    a["pass"] += bool(r["pass"])
    a["worst"] = max(a["worst"], r["max_rel_err"] if r["max_rel_err"] is not None else float("inf"))
print("| kind | dtype | fixtures | passed | worst error | tolerance |")
print("|---|---|---|---|---|---|")
key = lambda kd: (KINDS.index(kd[0]) if kd[0] in KINDS else 99, ORDER.get(kd[1], 9))
for (kind, dtype) in sorted(agg, key=key):
    a = agg[(kind, dtype)]
    tol = "—" if a["tol"] is None else f"{a['tol']:.0e}"
    print(f"| {kind} | {dtype} | {a['n']} | {a['pass']} | {a['worst']:.1e} | {tol} |")
print(f"\n{sum(a['pass'] for a in agg.values())} of {len(rows)} fixtures pass.")
