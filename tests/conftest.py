import importlib
import os

# MLX's CUDA backend multiplies float32 in TF32 unless told not to (MLX_ENABLE_TF32): the
# float32 GPU parity tests compare kernels against float32 arithmetic, not TF32's 10-bit mantissa.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx.core as mx
import pytest

# The package exports a function `generate` that hides the module of that name.
LOOPS = [importlib.import_module(m) for m in ("mlx_hybrid.decode",)]


@pytest.fixture
def exact_float32(monkeypatch):
    """Run the test on the CPU, generation loops included: it checks float32 results to a
    tolerance (or greedy tokens through near-ties) that MLX's CUDA backend, which multiplies
    float32 in TF32, does not meet (the GPU paths have parity tests of their own)."""
    cpu = mx.new_stream(mx.cpu)
    for module in LOOPS:
        monkeypatch.setattr(module, "generation_stream", cpu)
    with mx.stream(cpu):
        yield
