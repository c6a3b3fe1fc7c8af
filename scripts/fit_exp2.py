#!/usr/bin/env python3
"""Fits the polynomial of the AVX2 softmax exponential (`exp::avx2::exp2_256_nonpos`).

2^f ~ 1 + c1 f + ... + c5 f^5 on |f| <= 1/2, near-minimax in relative error, with the
constant term held at exactly 1 (so 2^0 = 1 and 2^-k are exact). Lawson's iteratively
reweighted least squares on Chebyshev nodes; then the f32 coefficients are evaluated in
f32 by Horner's rule with fused multiply-adds, as the kernel does.

Usage: python3 scripts/fit_exp2.py   (needs numpy only)
"""

import numpy as np

DEG = 5
N = 4000


def main():
    f = 0.5 * np.cos(np.pi * (np.arange(N) + 0.5) / N)
    y = 2.0**f
    a = np.vstack([f**k for k in range(1, DEG + 1)]).T
    w = np.ones(N)
    for _ in range(200):
        sw = np.sqrt(w) / y
        c, *_ = np.linalg.lstsq(a * sw[:, None], (y - 1.0) * sw, rcond=None)
        err = (1.0 + a @ c - y) / y
        w = w * np.abs(err)
        w /= w.sum()
    print(f"fit relative error (f64): {np.abs(err).max():.2e}")

    c32 = [np.float32(x) for x in c]
    ff = np.linspace(-0.5, 0.5, 200001).astype(np.float32)
    acc = np.full_like(ff, c32[-1])
    for ck in list(reversed(c32[:-1])) + [np.float32(1.0)]:
        # one rounding per step, as an FMA
        acc = (acc.astype(np.float64) * ff.astype(np.float64) + np.float64(ck)).astype(np.float32)
    ref = 2.0 ** ff.astype(np.float64)
    print(f"f32 Horner relative error: {np.abs((acc - ref) / ref).max():.2e}")
    print("const MINIMAX5: [f32; 5] = [")
    for x in c32:
        print(f"    {np.format_float_positional(x, unique=True)},")
    print("];")


if __name__ == "__main__":
    main()
