#!/usr/bin/env bash
# Builds for aarch64 and runs the test suite and the fixture parity check there under
# qemu-user, so the NEON kernel (selected on every aarch64 CPU) is exercised on an x86-64
# machine. Not part of CI: it needs the Rust target and two Debian packages,
#   rustup target add aarch64-unknown-linux-gnu
#   apt-get install gcc-aarch64-linux-gnu qemu-user
# and takes about 5 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
cargo test --release --no-fail-fast --target aarch64-unknown-linux-gnu
cargo run --release --target aarch64-unknown-linux-gnu --example parity
