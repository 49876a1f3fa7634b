"""Run the body of a CUDA kernel from metal_kernels/ on the CPU, so that its indexing and its
algorithm are tested on machines without a GPU (CI has none; the GPU parity tests skip there).

The body is compiled by g++ as the function MLX's `mx.fast.cuda_kernel` would wrap it in, in
float32, with one std::thread per CUDA thread and the blocks run one after another: `__shared__`
memory is a static array (one block lives at a time), `__syncthreads` a std::barrier over the
block, and `__shfl_xor_sync` an exchange through memory between two barriers of the warp. A
program depends only on the body, the template and the argument names, not on sizes (read at run
time), so it is built once per process for all the calls that share them.

`load_kernel` stands in for `mlx_hybrid.kernels.load_kernel`: the model code then runs its GPU
path with every kernel emulated (end-to-end tests of that path on the CPU).
"""

import hashlib
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_hybrid.kernels import kernel_source

AVAILABLE = shutil.which("g++") is not None

PRELUDE = r"""
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
static float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
struct Dim { int x, y, z; };
thread_local int tl_thread, tl_block;
static int g_threads, g_blocks_x;
#define threadIdx (Dim{tl_thread, 0, 0})
#define blockIdx (Dim{tl_block % g_blocks_x, tl_block / g_blocks_x, 0})
#define blockDim (Dim{g_threads, 1, 1})
#define __shared__ static
static std::barrier<>* g_block;
static std::vector<std::barrier<>*> g_warps;
static float g_lanes[64][32];
#define __syncthreads() g_block->arrive_and_wait()
static float __shfl_xor_sync(unsigned, float v, int lane_mask) {
  const int w = tl_thread / 32, l = tl_thread % 32;
  g_lanes[w][l] = v;
  g_warps[w]->arrive_and_wait();
  const float r = g_lanes[w][l ^ lane_mask];
  g_warps[w]->arrive_and_wait();
  return r;
}
struct Ints { long long v[8]; long long operator[](int i) const { return v[i]; } };
static Ints read_ints(FILE* f) { Ints r; fread(r.v, 8, 8, f); return r; }
"""


def run(body: str, inputs: list, outputs: list, template: list, blocks: int | tuple[int, int], threads: int) -> list[np.ndarray]:
    """inputs: (name, C-contiguous float32 or int32 array, strides in elements or None); with
    strides the body sees `<name>_strides` and the array is its buffer, without them its
    `<name>_shape`. outputs: (name, shape), float32. template: (name, int or C type name).
    blocks: the grid in blocks, x or (x, y); threads: the block size along x. Returns the outputs."""
    bx, by = (blocks, 1) if isinstance(blocks, int) else blocks
    sig, reads, args, header = [], [], [], []
    for i, (name, a, strides) in enumerate(inputs):
        ctype = {np.dtype(np.float32): "float", np.dtype(np.int32): "int"}[a.dtype]
        ints, values = ("strides", strides) if strides is not None else ("shape", a.shape)
        sig += [f"const {ctype}* {name}", f"Ints {name}_{ints}"]
        reads.append(f"Ints d{i} = read_ints(f); long long n{i} = read_ints(f)[0]; std::vector<char> in{i}(n{i} + 4); fread(in{i}.data(), 1, n{i}, f);")
        args += [f"(const {ctype}*)in{i}.data()", f"d{i}"]
        header.append((list(values), a))
    for j, (name, shape) in enumerate(outputs):
        sig.append(f"float* {name}")
        reads.append(f"long long m{j} = read_ints(f)[0]; std::vector<float> out{j}(m{j} + 1);")
        args.append(f"out{j}.data()")
    consts = "".join(f"  using {k} = {v};\n" if isinstance(v, str) else f"  constexpr int {k} = {int(v)};\n" for k, v in template)
    source = (
        PRELUDE + "void kernel(" + ", ".join(sig) + ") {\n" + consts + body + "\n}\n"
        "int main(int argc, char** argv) {\n  FILE* f = fopen(argv[1], \"rb\");\n  " + "\n  ".join(reads) + "\n  fclose(f);\n"
        "  const int threads = atoi(argv[3]), blocks = atoi(argv[4]);\n"
        "  for (int w = 0; w < threads / 32; ++w) g_warps.push_back(new std::barrier<>(32));\n"
        "  g_block = new std::barrier<>(threads);\n"
        "  g_threads = threads; g_blocks_x = atoi(argv[5]);\n"
        "  for (int b = 0; b < blocks; ++b) {\n"
        "    std::vector<std::thread> team;\n"
        "    for (int t = 0; t < threads; ++t)\n"
        f"      team.emplace_back([&, b, t]() {{ tl_thread = t; tl_block = b; kernel({', '.join(args)}); }});\n"
        "    for (auto& t : team) t.join();\n  }\n"
        "  FILE* g = fopen(argv[2], \"wb\");\n"
        + "".join(f"  fwrite(out{j}.data(), 4, m{j}, g);\n" for j in range(len(outputs)))
        + "  fclose(g);\n}\n"
    )
    binary = _build(source)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        ints = lambda values: struct.pack("8q", *(list(values) + [0] * (8 - len(values))))  # noqa: E731
        blob = b"".join(ints(v) + ints([a.nbytes]) + np.ascontiguousarray(a).tobytes() for v, a in header)
        blob += b"".join(ints([int(np.prod(shape))]) for _, shape in outputs)
        (d / "in.bin").write_bytes(blob)
        subprocess.run([binary, d / "in.bin", d / "out.bin", str(threads), str(bx * by), str(bx)], check=True)
        raw = np.fromfile(d / "out.bin", np.float32)
    results, at = [], 0
    for _, shape in outputs:
        n = int(np.prod(shape))
        results.append(raw[at : at + n].reshape(shape))
        at += n
    return results


_BUILDS = tempfile.TemporaryDirectory()  # removed when the process exits
_BUILT: dict[str, Path] = {}


def _build(source: str) -> Path:
    """The compiled program for source, built once per process."""
    key = hashlib.sha1(source.encode()).hexdigest()
    if key not in _BUILT:
        d = Path(_BUILDS.name)
        (d / f"{key}.cpp").write_text(source)
        build = subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", "-o", d / key, d / f"{key}.cpp"], capture_output=True, text=True)
        if build.returncode:
            raise RuntimeError("the kernel body does not compile:\n" + build.stderr[:4000])
        _BUILT[key] = d / key
    return _BUILT[key]


def load_kernel(backend: str, name: str, inputs: tuple[str, ...], outputs: tuple[str, ...], contiguous: bool = True):
    """`mlx_hybrid.kernels.load_kernel` on the emulator: the returned callable takes MLX's kernel
    arguments, runs the CUDA body on the CPU (in float32) and returns MLX arrays of the requested
    dtypes. Inputs that the kernel takes with their strides (contiguous=False) are handed over as
    row-major copies with those strides."""
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
    return launch
