# bash benchmarks/gpu/ab.sh MODEL ROUNDS [ARGS...]: BASE's package and this tree's, interleaved, each
# running benchmarks/speculative.py on MODEL; prints their rows (compare within a round).
model=$1 rounds=$2; shift 2
for r in $(seq 1 $rounds); do for p in base now; do
  echo "== $p round $r"
  (source benchmarks/gpu/env.sh $p && timeout 150 python3 benchmarks/speculative.py --model $model --label "ab $p $r" \
    --beam 4x5 "$@" 2>&1 | grep "^| mlx-hybrid\|Error")
done; done
