"""GPU kernel plumbing: which kernel backend the default device has, and the `mx.fast` kernel
objects, built once from the sources in metal_kernels/ (each kernel has a Metal and a CUDA twin
there, and a pure-MLX reference beside the Python function that launches it)."""

import functools
import re
from importlib import resources

import mlx.core as mx


def kernel_backend() -> str | None:
    """'metal' or 'cuda' when the default device is a GPU with that MLX backend, else None."""
    if mx.default_device().type != mx.DeviceType.gpu:
        return None
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return None


@functools.cache
def load_kernel(backend: str, name: str, inputs: tuple[str, ...], outputs: tuple[str, ...], contiguous: bool = True):
    """The kernel `name` for 'metal' or 'cuda'. contiguous=False hands inputs over with their
    strides (the source indexes `<input>_strides`) instead of copying them to row-major order."""
    make = {"metal": mx.fast.metal_kernel, "cuda": mx.fast.cuda_kernel}[backend]
    source = kernel_source(backend, name)
    return make(name=name, input_names=list(inputs), output_names=list(outputs), source=source, ensure_row_contiguous=contiguous)


def kernel_source(backend: str, name: str) -> str:
    """The body of kernel `name` for 'metal' or 'cuda', less its // comments and indentation, its
    lines kept (a compiler's messages keep their line numbers): MLX's CUDA backend hashes a
    kernel's whole source at every launch, about 0.3 us a KB (benchmarks/gpu/dispatch_cost.py),
    and a verification pass launches 150 kernels."""
    source = resources.files("mlx_hybrid.metal_kernels").joinpath(name + {"metal": ".metal", "cuda": ".cu"}[backend]).read_text()
    return "\n".join(re.sub(r"//.*", "", line).strip() for line in source.splitlines())
