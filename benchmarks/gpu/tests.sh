# The GPU parity tests (-k), on this tree's package; python3 -P keeps the repo root off sys.path.
# By default not the CUDA bodies emulated on the CPU (CI runs them). Beside a training run on the
# same GPU, tests that read results often crawl past any limit (README.md): run them without one.
source benchmarks/gpu/env.sh now
set -o pipefail
timeout ${2:-300} python3 -P -m pytest -v -p no:cacheprovider tests -k "${1:-(cuda or with_kernel) and not on_the_cpu and not emulated}" --tb=short 2>&1 \
  | tee $OUT/tests_gpu.log | grep -v "^tests.*PASSED" | tail -60
