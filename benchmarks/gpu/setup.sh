# After .device/mlx-a's stash: unpack MLX's CUDA build, install mlx-lm, lay this tree's package out
# at /tmp/now and BASE's at /tmp/base (the repo root's mlx_hybrid/ is not importable as it stands).
source .device/mlx-b/activate.sh || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
rm -rf /tmp/now /tmp/base; mkdir -p /tmp/now
cp -r mlx_hybrid /tmp/now/; cp -r cli convert metal_kernels /tmp/now/mlx_hybrid/
if [ -d .gpu/base ]; then cp -r .gpu/base /tmp/base; ln -s /tmp/now/mlx_hybrid/data/default /tmp/base/mlx_hybrid/data/default; fi
source benchmarks/gpu/env.sh now
(cd /tmp && python3 -c "import mlx.core as mx, mlx_hybrid; print(mx.default_device(), mlx_hybrid.__file__)")
