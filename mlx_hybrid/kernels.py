"""GPU kernel plumbing: which kernel backend the default device has, and the `mx.fast` kernel
objects, built once from the sources in metal_kernels/ (each kernel has a Metal and a CUDA twin
there, and a pure-MLX reference beside the Python function that launches it)."""

import functools
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
    suffix, make = {"metal": (".metal", mx.fast.metal_kernel), "cuda": (".cu", mx.fast.cuda_kernel)}[backend]
    source = resources.files("mlx_hybrid.metal_kernels").joinpath(name + suffix).read_text()
    return make(name=name, input_names=list(inputs), output_names=list(outputs), source=source, ensure_row_contiguous=contiguous)
