#!/usr/bin/env bash
# Runs tests/kernel_miri.rs under Miri: small calls of the fused CPU kernel (the portable
# kernel, since Miri reports no AVX), checked against a float64 loop, while Miri looks for
# undefined behaviour in the kernel's unsafe code and for data races between rayon's
# threads. Not part of CI: it needs a nightly toolchain with Miri,
#   rustup toolchain install nightly --component miri,rust-src
# and takes about 25 minutes the first time (Miri builds its own standard library and
# the dependencies), the test itself about 13.
#
# Tree Borrows, because under Stacked Borrows crossbeam-epoch (rayon's work-stealing
# deques) reports a retag error of its own first. Leaks are ignored because rayon's
# global pool threads are still running when the test's main thread returns.
set -euo pipefail
cd "$(dirname "$0")/.."
export MIRIFLAGS="${MIRIFLAGS:--Zmiri-tree-borrows -Zmiri-ignore-leaks}"
cargo +nightly miri test --test kernel_miri
