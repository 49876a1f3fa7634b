#!/usr/bin/env bash
# `hybrid serve`'s benchmark (benchmarks/serve.py; benchmarks/README.md, "Serving") on the lent H100.
#   here, once:   bash benchmarks/gpu/serve.sh wheels   (the server's wheels for the device's Python 3.12,
#                 into .whl/, which setup.sh installs into /tmp/site with the others)
#   device call:  bash benchmarks/gpu/setup.sh && bash benchmarks/gpu/serve.sh   (carry .device/mlx-b, .whl)
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" = wheels ]; then
  ${PYTHON:-.venv/bin/python} -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "starlette>=0.40" "uvicorn>=0.30" "pydantic>=2.6"
  exit
fi
source benchmarks/gpu/env.sh now
python3 benchmarks/serve.py --out "${OUT:-benchmarks/results}" --label "NVIDIA H100, MLX CUDA backend" "$@"
