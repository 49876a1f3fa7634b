# bash benchmarks/gpu/ab.sh MODEL ROUNDS [ARGS...]: BASE's package and this tree's, interleaved, each
# running benchmarks/speculative.py on MODEL; prints their rows (compare within a round). Each run
# gets AB_TIMEOUT seconds (150): more on a machine that has compiled no kernels yet.
model=$1 rounds=$2; shift 2
for r in $(seq 1 $rounds); do for p in base now; do
  echo "== $p round $r"
  (source benchmarks/gpu/env.sh $p && timeout ${AB_TIMEOUT:-150} python3 benchmarks/speculative.py --model $model --label "ab $p $r" \
    --beam 4x5 "$@" 2>&1 | grep "^| mlx-hybrid\|Error")
done; done
