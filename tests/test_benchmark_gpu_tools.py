"""The GPU measurement tools (benchmarks/gpu/) where there is no GPU: CI's machine."""

import pytest


def test_attention_cost_needs_a_cuda_gpu(capsys):
    """benchmarks/gpu/attention_cost.py times CUDA kernels: without MLX's CUDA backend it stops
    with one line and status 1 (the numbers come from an H100)."""
    from benchmarks.gpu import attention_cost

    if attention_cost.kernel_backend() == "cuda":
        pytest.skip("a CUDA GPU is here: the benchmark would run")
    assert attention_cost.main(["--shape", "smollm2-135m"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: attention_cost times CUDA kernels") and "\n" not in err
