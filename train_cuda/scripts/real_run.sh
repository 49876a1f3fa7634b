#!/usr/bin/env bash
# The real run on a GPU machine (see README.md, "Real run"): distill SmolLM2-135M-Instruct into 50% and
# 25% attention Mamba2 hybrids and report held-out perplexity against the teacher.
#   bash train_cuda/scripts/real_run.sh TEACHER(.gguf or HF dir) CORPUS_DIR OUT_DIR [--resume]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
exec "${PYTHON:-python}" "$here/real_run.py" --teacher "$1" --corpus "$2" --out "$3" "${@:4}"
