# Wait for the heads, convert the Llama target to /tmp/mt (bfloat16) with its heads and draft model, calibrate
# Medusa's tree, then run the speculative benchmark (its README section, JSON and plot to $OUT).
# Usage: target.sh [SECONDS to wait for the heads] [more benchmarks/speculative.py arguments]
# MT_DTYPE=float32 converts the target in float32 instead (bfloat16 near-ties: benchmarks/README.md).
source benchmarks/gpu/env.sh now
wait=${1:-300}; shift $(( $# > 0 ? 1 : 0 ))
for i in $(seq 1 $wait); do [ -f /tmp/heads/report.json ] && break; sleep 1; done
cp /tmp/heads/report.json $OUT/heads_report.json || { tail -5 /tmp/heads.log; exit 1; }
if [ ! -d /tmp/mt ]; then
  (cd /tmp && python3 -m mlx_hybrid.cli.main convert /tmp/heads/base /tmp/mt --dtype ${MT_DTYPE:-bfloat16}) || exit 1
  for heads in medusa1/medusa redrafter/redrafter; do  # the head sets the run's stages trained
    [ -d /tmp/heads/$heads ] && cp -r /tmp/heads/$heads /tmp/mt/
  done
  if [ -d /tmp/heads/draft/draft ]; then  # the draft model, in the target's dtype, for ours and mlx-lm's
    (cd /tmp && python3 -m mlx_hybrid.cli.main convert /tmp/heads/draft/draft /tmp/mt/draft --dtype ${MT_DTYPE:-bfloat16}) || exit 1
  fi
  [ -d /tmp/mt/medusa ] && { python3 benchmarks/gpu/calibrate.py || exit 1; }
fi
python3 benchmarks/speculative.py --model /tmp/mt --label 'NVIDIA H100, MLX CUDA backend' --beam 4x5 "$@"
cp benchmarks/results/speculative-mt-chat-nvidia-h100-mlx-cuda-backend.* benchmarks/README.md $OUT/
