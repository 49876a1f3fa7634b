# The GPU parity tests (-k), on this tree's package; python3 -P keeps the repo root off sys.path.
source benchmarks/gpu/env.sh now
set -o pipefail
timeout ${2:-300} python3 -P -m pytest -v -p no:cacheprovider tests -k "${1:-cuda or with_kernel}" --tb=short 2>&1 \
  | tee $OUT/tests_gpu.log | grep -v "^tests.*PASSED" | tail -60
