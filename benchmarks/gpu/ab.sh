#!/usr/bin/env bash
# An A/B round of two versions of the package on one model: the package at git revision BASE and
# this checkout's, each running this checkout's benchmarks.speculative on MODEL (so BASE must
# have the API it calls), ROUNDS times in turn. The host's speed drifts between runs minutes
# apart, so compare within a round. Result files go to a temporary directory, not results/.
#   bash benchmarks/gpu/ab.sh BASE MODEL ROUNDS [more benchmarks.speculative arguments]
set -euo pipefail
[ $# -ge 3 ] || { sed -n '2,6p' "$0"; exit 2; }
base=$1 model=$2 rounds=$3; shift 3
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/src"
git -C "$root" archive "$base" | tar -x -C "$work/src"
python -m pip install -q --no-deps --no-build-isolation --target "$work/site" "$work/src"
model=$(realpath "$model")
cd "$work"  # not the checkout: its mlx_hybrid/ would come first on the path
for r in $(seq 1 "$rounds"); do
  for side in base now; do
    echo "== $side, round $r"
    if [ $side = base ]; then path="$work/site:$root"; else path="$root"; fi
    PYTHONPATH="$path" python -m benchmarks.speculative --model "$model" --results "$work/results" \
      --label "ab $side $r" "$@" | grep "^| \|rror"
  done
done
