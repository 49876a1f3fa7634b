# After target.sh (the heads run with the medusa2 stage): convert Medusa-2's changed teacher with its
# heads to /tmp/mt2 (bfloat16), calibrate its tree, then run the speculative benchmark on it (its
# README section, JSON and plot to $OUT). Usage: medusa2.sh [more benchmarks/speculative.py arguments]
source benchmarks/gpu/env.sh now
if [ ! -d /tmp/mt2 ]; then
  (cd /tmp && python3 -m mlx_hybrid.cli.main convert /tmp/heads/medusa2/model /tmp/mt2 --dtype bfloat16) || exit 1
  cp -r /tmp/heads/medusa2/model/medusa /tmp/mt2/medusa
  python3 benchmarks/gpu/calibrate.py 24 /tmp/mt2 || exit 1
fi
python3 benchmarks/speculative.py --model /tmp/mt2 --label 'NVIDIA H100, MLX CUDA backend' "$@"
cp benchmarks/results/speculative-mt2-chat-nvidia-h100-mlx-cuda-backend.* benchmarks/README.md $OUT/
