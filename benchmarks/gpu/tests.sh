#!/usr/bin/env bash
# The GPU parity tests: every kernel against its pure-MLX reference on this machine's GPU, and
# greedy speculation through the kernels against plain greedy decoding. The CUDA bodies emulated
# on the CPU are left out (CI runs them). Run them with the GPU to itself: beside a training run
# they crawl.   bash benchmarks/gpu/tests.sh [PYTEST -k EXPRESSION]
set -euo pipefail
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
python -m pytest -v -p no:cacheprovider tests -k "${1:-(cuda or with_kernel) and not on_the_cpu and not emulated}" --tb=short
