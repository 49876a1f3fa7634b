# After target.sh: variant.sh's Medusa heads (/tmp/hv) in a copy of /tmp/mt (/tmp/mv, no other
# heads), calibrated as target.sh calibrates /tmp/mt's, then the benchmark's Medusa rows.
# Usage: variant_target.sh [SECONDS to wait for the variant] [more speculative.py arguments]
source benchmarks/gpu/env.sh now
wait=${1:-300}; shift $(( $# > 0 ? 1 : 0 ))
for i in $(seq 1 $wait); do [ -f /tmp/hv/report.json ] && break; sleep 1; done
cp /tmp/hv/report.json $OUT/variant_report.json || { tail -5 /tmp/hv.log; exit 1; }
rm -rf /tmp/mv; cp -r /tmp/mt /tmp/mv; rm -rf /tmp/mv/medusa /tmp/mv/redrafter /tmp/mv/draft
cp -r /tmp/hv/medusa1/medusa /tmp/mv/
python3 benchmarks/gpu/calibrate.py 24 /tmp/mv || exit 1
python3 benchmarks/speculative.py --model /tmp/mv --label 'NVIDIA H100, MLX CUDA backend' "$@"
cp benchmarks/results/speculative-mv-* $OUT/
