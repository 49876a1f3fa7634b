"""Run the body of a CUDA kernel from metal_kernels/ on the CPU, so that its indexing and its
algorithm are tested on machines without a GPU (CI has none; the GPU parity tests skip there).

The body is compiled by g++ as the function MLX's `mx.fast.cuda_kernel` would wrap it in, in
float32, and run by the emulators' runtime (tests/helpers/emulator/runtime.h: a fiber a CUDA thread, a
block at a time, in a schedule that exposes a missing barrier): `__shared__` memory is a static
array, `__syncthreads` the runtime's barrier and `__shfl_xor_sync` an exchange between the 32
lanes of a warp. CUDA rounds the grid up to whole blocks, so a block always has blockDim threads.
A program depends only on the body, the template and the argument names, not on sizes (read at
run time), so it is built once per process for all the calls that share them.

`load_kernel` stands in for `mlx_hybrid.kernels.load_kernel`: the model code then runs its GPU
path with every kernel emulated (end-to-end tests of that path on the CPU).
"""

import mlx.core as mx
import numpy as np

from tests.helpers import gpu_emulator
from tests.helpers.gpu_emulator import AVAILABLE  # noqa: F401  (tests skip on it)

from mlx_hybrid import kernels
from mlx_hybrid.kernels import kernel_source

def run(body: str, inputs: list, outputs: list, template: list, blocks: int | tuple[int, int], threads: int) -> list[np.ndarray]:
    """inputs: (name, C-contiguous float32 or int32 array, strides in elements or None); with
    strides the body sees `<name>_strides` and the array is its buffer, without them its
    `<name>_shape`. outputs: (name, shape), float32. template: (name, int or C type name).
    blocks: the grid in blocks, x or (x, y); threads: the block size along x. Returns the outputs."""
    bx, by = (blocks, 1) if isinstance(blocks, int) else blocks
    sig, args, buffers = [], [], []
    for name, a, strides in inputs:
        ctype = {np.dtype(np.float32): "float", np.dtype(np.int32): "int"}[a.dtype]
        ints, values = ("strides", strides) if strides is not None else ("shape", a.shape)
        sig += [f"const {ctype}* {name}", f"Ints {name}_{ints}"]
        args += [f"(const {ctype}*)emu::buffers[{len(buffers) + 1}].data", f"*(const Ints*)emu::buffers[{len(buffers)}].data"]
        buffers += [np.array(list(values) + [0] * (8 - len(values)), np.int64).tobytes(), gpu_emulator.as_bytes(a)]
    for j, (name, _) in enumerate(outputs):
        sig.append(f"float* {name}")
        args.append(f"(float*)emu::buffers[{len(buffers) + j}].data")
    consts = "".join(f"  using {k} = {v};\n" if isinstance(v, str) else f"  constexpr int {k} = {int(v)};\n" for k, v in template)
    source = (
        '#include "cuda_shim.h"\n' + "void kernel(" + ", ".join(sig) + ") {\n" + consts + body + "\n}\n"
        "static int block_threads(const int*) { return g_threads; }\n"
        f"static void thread(int) {{ kernel({', '.join(args)}); }}\n"
        "int main(int argc, char** argv) {\n"
        "  g_threads = atoi(argv[1]);\n  const int grid[3] = {atoi(argv[2]), atoi(argv[3]), 1};\n"
        "  emu::read_buffers();\n  emu::run_grid(grid, block_threads, thread);\n}\n"
    )
    binary = gpu_emulator.build(source)
    sizes = [(int(np.prod(shape)) * 4, gpu_emulator.poison(4)) for _, shape in outputs]
    raw = gpu_emulator.execute(binary, buffers, sizes, [threads, bx, by], [name for name, _ in outputs])
    return [np.frombuffer(r, np.float32).reshape(shape) for r, (_, shape) in zip(raw, outputs)]


def load_kernel(backend: str, name: str, inputs: tuple[str, ...], outputs: tuple[str, ...], contiguous: bool = True, reference=None):
    """`mlx_hybrid.kernels.load_kernel` on the emulator: the kernel, behind the same fallback
    wrapper as on a GPU (`kernels.Kernel`), takes MLX's kernel arguments, runs the CUDA body on
    the CPU (in float32) and returns MLX arrays of the requested dtypes. Inputs that the kernel
    takes with their strides (contiguous=False) are handed over as row-major copies with those
    strides."""
    body = kernel_source("cuda", name)  # as MLX gets it

    def launch(*, inputs: list, template: list, grid: tuple, threadgroup: tuple, output_shapes: list, output_dtypes: list, **_):
        arrays = []
        for arg, a in zip(input_names, inputs):
            host = np.array(a.astype(mx.float32 if mx.issubdtype(a.dtype, mx.floating) else mx.int32))
            strides = None if contiguous else [int(np.prod(host.shape[i + 1 :])) for i in range(host.ndim)]
            arrays.append((arg, host, strides))
        threads = threadgroup[0]
        outs = run(
            body,
            inputs=arrays,
            outputs=list(zip(outputs, [tuple(s) for s in output_shapes])),
            template=[(k, "float" if isinstance(v, mx.Dtype) else v) for k, v in template],
            blocks=(-(-grid[0] // threads), grid[1]),
            threads=threads,
        )
        return [mx.array(o).astype(dtype) for o, dtype in zip(outs, output_dtypes)]

    input_names = inputs
    return kernels.Kernel(backend, name, lambda: launch, reference)
