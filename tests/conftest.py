import atexit
import importlib
import os
import shutil
import tempfile

# MLX's CUDA backend multiplies float32 in TF32 unless told not to (MLX_ENABLE_TF32): the
# float32 GPU parity tests compare kernels against float32 arithmetic, not TF32's 10-bit mantissa.
os.environ.setdefault("MLX_ENABLE_TF32", "0")
# The default model is built at first use into the user's cache: the tests build it once, into
# their own (subprocesses inherit it), and leave the user's alone.
if "MLX_HYBRID_CACHE" not in os.environ:
    os.environ["MLX_HYBRID_CACHE"] = tempfile.mkdtemp(prefix="mlx-hybrid-test-cache-")
    atexit.register(shutil.rmtree, os.environ["MLX_HYBRID_CACHE"], ignore_errors=True)

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


@pytest.fixture(autouse=True)
def no_kernel_fallback(request):
    """A kernel that fails falls back to its reference (`mlx_hybrid.kernels.Kernel`), whose
    results are right: a test of a kernel would then pass on the reference. Every test fails if a
    kernel failed during it, unless it is marked `kernel_failure` (it expects one)."""
    from mlx_hybrid import kernels

    kernels._failed.clear()
    yield
    failed = kernels.failures()
    kernels._failed.clear()
    if failed and not request.node.get_closest_marker("kernel_failure"):
        pytest.fail(f"kernels fell back to their references: {failed}")


def pytest_configure(config):
    config.addinivalue_line("markers", "kernel_failure: the test makes a kernel fail on purpose")
