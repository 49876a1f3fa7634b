# source benchmarks/gpu/env.sh [now|base]: MLX's CUDA build, mlx-lm and the package (this tree's, or BASE's)
export PYTHONPATH=/tmp/${1:-now}:/tmp/site:/tmp/mlx-site PYTHONUNBUFFERED=1
