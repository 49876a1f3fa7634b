#!/usr/bin/env bash
# Split ../shared/device/stage-mlx-cuda's part 1 (.device/mlx-a, 40 MB) in two, for when it and
# the repo's tracked files together pass a call's 64 MiB: call 1 becomes two calls,
# `bash .device/mlx-a1/stash.sh` (carry .device/mlx-a1), then `bash .device/mlx-a2/stash.sh`
# (carry .device/mlx-a2), which leave part 1 where .device/mlx-b/activate.sh looks for it.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
rm -rf .device/mlx-a1 .device/mlx-a2 && mkdir -p .device/mlx-a1 .device/mlx-a2
split -b 20M .device/mlx-a/part_aa .device/mlx-a1/part_aa_
mv .device/mlx-a1/part_aa_ab .device/mlx-a2/
echo 'mkdir -p /tmp/mlx-stash && cp "$(dirname "${BASH_SOURCE[0]}")/part_aa_aa" /tmp/mlx-stash/ && echo "part 1a stashed"' > .device/mlx-a1/stash.sh
echo 'cat /tmp/mlx-stash/part_aa_aa "$(dirname "${BASH_SOURCE[0]}")/part_aa_ab" > /tmp/mlx-stash/part_aa && rm /tmp/mlx-stash/part_aa_aa && echo "part 1 stashed"' > .device/mlx-a2/stash.sh
cat .device/mlx-a1/part_aa_aa .device/mlx-a2/part_aa_ab | cmp - .device/mlx-a/part_aa && du -sh .device/mlx-a1 .device/mlx-a2
