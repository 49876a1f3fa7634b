# Wait for hybrid.sh's run, convert its hybrid to /tmp/ht (bfloat16) with its drafter, then run the
# speculative benchmark on it (README section, JSON and plot to $OUT, with the run's report).
# Usage: hybrid_target.sh [SECONDS to wait for the run] [more benchmarks/speculative.py arguments]
source benchmarks/gpu/env.sh now
wait=${1:-300}; shift $(( $# > 0 ? 1 : 0 ))
for i in $(seq 1 $wait); do [ -f /tmp/hyb/report.json ] && break; sleep 1; done
cp /tmp/hyb/report.json $OUT/hybrid_report.json || { tail -c 2000 /tmp/hyb.log; exit 1; }
if [ ! -d /tmp/ht/redrafter ]; then
  (cd /tmp && python3 -m mlx_hybrid.cli.main convert /tmp/hyb/student/model /tmp/ht --dtype bfloat16 \
    --redrafter /tmp/hyb/redrafter/redrafter) || exit 1
fi
python3 benchmarks/speculative.py --model /tmp/ht --label 'NVIDIA H100, MLX CUDA backend' "$@"
cp benchmarks/results/speculative-ht-*.* benchmarks/README.md $OUT/
