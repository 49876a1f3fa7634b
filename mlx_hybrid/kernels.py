"""GPU kernel plumbing: which kernel backend the default device has, and the `mx.fast` kernel
objects, built once from the sources in metal_kernels/ (each kernel has a Metal and a CUDA twin
there, and a pure-MLX reference beside the Python function that launches it).

A kernel that fails to build or launch on the user's device (a Metal compiler or driver that
rejects what the tests could not try, a GPU without the resources it asks for) must not end the
program: `Kernel` says so once, in one line on stderr, and runs the kernel's reference instead for
the rest of the process, so the output stays correct, only slower.
"""

import contextlib
import contextvars
import functools
import re
import struct
import sys
from importlib import resources

import mlx.core as mx

# The decode step's parents (one token continuing the cache) for the kernels that also take a
# tree's: four elements where one is read, since MLX's CUDA allocator keeps arrays of 8 bytes or
# less in managed memory on the host, where each of a kernel's reads crosses the bus. For the same
# reason a model's scalar constants reach the kernels as template arguments (`float_bits`).
DECODE_PARENTS = mx.full((4,), -1, mx.int32)

# Kernels that failed in this process: name -> the error's first line.
_failed: dict[str, str] = {}
# Set within `references_only`.
_references_only = contextvars.ContextVar("references_only", default=False)


def kernel_backend() -> str | None:
    """'metal' or 'cuda' when the default device is a GPU with that MLX backend, else None."""
    if mx.default_device().type != mx.DeviceType.gpu:
        return None
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return None


class Kernel:
    """An `mx.fast` kernel, called as MLX calls one (inputs=, template=, grid=, threadgroup=,
    output_shapes=, output_dtypes=), that falls back to `reference`, which takes the same
    arguments and returns the same outputs in MLX ops. `build()` makes the kernel, at the first
    launch.

    MLX builds a kernel's program when its outputs are evaluated, not when it is called, so an
    error would surface at some later `mx.eval`, far from here. The first launch of each program
    therefore also runs on zeros of the inputs' shapes, evaluated at once: zeros, because inside
    `mx.compile` the inputs are placeholders that cannot be. A program is told apart by its
    template and threadgroup (the launchers name every input dtype that varies in the template):
    a pass launches ~150 kernels, and reading every input's dtype and size at each launch would
    cost more host time than the launch itself."""

    def __init__(self, backend: str, name: str, build, reference):
        self.backend, self.name, self.build, self.reference = backend, name, build, reference
        self._kernel = None
        self._built = set()

    def __call__(self, *, inputs, grid, threadgroup, output_shapes, output_dtypes, template=()):
        launch = dict(inputs=inputs, grid=grid, threadgroup=threadgroup, output_shapes=output_shapes, output_dtypes=output_dtypes,
                      template=template)
        if _references_only.get() or self.name in _failed:
            return self.reference(**launch)
        try:
            if self._kernel is None:
                self._kernel = self.build()
            outputs = self._kernel(**launch)
            program = (tuple(template), tuple(threadgroup))
            if program not in self._built:
                mx.eval(self._kernel(**{**launch, "inputs": [mx.zeros(a.shape, a.dtype) for a in inputs]}))
                self._built.add(program)
            return outputs
        except Exception as e:  # whatever the device's compiler or driver raises
            fail(self.backend, self.name, e)
            return self.reference(**launch)


def fail(backend: str, name: str, error: Exception):
    """Record that kernel `name` failed, and say so once a process, in one line."""
    if name not in _failed:
        lines = [s.strip() for s in str(error).splitlines() if s.strip()] or [type(error).__name__]
        detail = next((s for s in lines if "error" in s.lower()), lines[0])  # a compiler's first error
        _failed[name] = (lines[0] if detail == lines[0] else f"{lines[0]} {detail}")[:300]
        print(f"mlx-hybrid: the {backend} kernel {name} failed ({_failed[name]}); using its pure-MLX reference instead", file=sys.stderr)


def failures() -> dict[str, str]:
    """The kernels that failed in this process, each with its error's first line."""
    return dict(_failed)


@contextlib.contextmanager
def references_only():
    """Every kernel runs its reference within: the same launch, computed in MLX ops (`hybrid
    doctor` and the tests compare a kernel with its reference on one launch this way)."""
    token = _references_only.set(True)
    try:
        yield
    finally:
        _references_only.reset(token)


@functools.cache
def load_kernel(backend: str, name: str, inputs: tuple[str, ...], outputs: tuple[str, ...], contiguous: bool = True, *,
                reference) -> Kernel:
    """The kernel `name` for 'metal' or 'cuda', falling back to `reference` (see `Kernel`).
    contiguous=False hands inputs over with their strides (the source indexes
    `<input>_strides`) instead of copying them to row-major order."""
    make = {"metal": mx.fast.metal_kernel, "cuda": mx.fast.cuda_kernel}[backend]
    return Kernel(backend, name, lambda: make(name=name, input_names=list(inputs), output_names=list(outputs),
                                              source=kernel_source(backend, name), ensure_row_contiguous=contiguous), reference)


def kernel_source(backend: str, name: str) -> str:
    """The body of kernel `name` for 'metal' or 'cuda', less its // comments and indentation, its
    lines kept (a compiler's messages keep their line numbers): MLX's CUDA backend hashes a
    kernel's whole source at every launch, about 0.3 us a KB (benchmarks/gpu/dispatch_cost.py),
    and a verification pass launches 150 kernels."""
    source = resources.files("mlx_hybrid.metal_kernels").joinpath(name + {"metal": ".metal", "cuda": ".cu"}[backend]).read_text()
    return "\n".join(re.sub(r"//.*", "", line).strip() for line in source.splitlines())


def float_bits(x: float) -> int:
    """The float32 bits of x as an int, a kernel's template argument (MLX's take ints, not floats);
    the body reads it back with `__int_as_float` (CUDA) or `as_type<float>` (Metal)."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


def bits_float(bits: int) -> float:
    """`float_bits` undone, for a kernel's reference."""
    return struct.unpack("<f", struct.pack("<i", bits))[0]
