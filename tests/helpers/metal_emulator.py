"""Run the Metal kernels of metal_kernels/ on the CPU: `metal_kernel` stands in for
`mx.fast.metal_kernel`, so the model code runs its Metal path on machines without a Mac.

A launch compiles, with g++ as C++20, the very source MLX would hand to Metal (`mlx_source`
writes it as mlx/backend/common/metal_kernel.cpp does: the signature with its buffer indices and
address spaces, `<name>_shape`/`_strides`/`_ndim` and the attribute variables only where the
body names them, the template and its instantiation; tests/test_metal.py checks it against MLX's
own), behind tests/helpers/emulator/metal_shim.h, which gives MSL's types and functions. It runs it as
Metal's `dispatchThreads` would: `grid` counts threads, threadgroups of `threadgroup` threads (each
side no longer than the grid's, as MLX clamps it) cover it, and those at the grid's far edge are
partial. Inputs keep their dtypes (half as _Float16, bfloat rounded to nearest even) and, with
ensure_row_contiguous=False, their strides; the runtime (tests/helpers/emulator/runtime.h) says how threads
are scheduled and what it checks.

Before a body is compiled, `check_body` rejects what g++ accepts and Metal does not (see
MSL_NAMES); at launch, more than 1024 threads a threadgroup, a simdgroup function in threadgroups
that are not whole 32-lane simdgroups, and more than 32 KiB of threadgroup memory are errors.
"""

import functools
import re
from math import prod

import mlx.core as mx
import numpy as np

from tests.helpers import gpu_emulator
from tests.helpers.gpu_emulator import AVAILABLE  # noqa: F401  (tests skip-check it like cuda_emulator's)

from mlx_hybrid import kernels

# mlx/backend/common/metal_kernel.cpp: the attribute variables a body may name, in the order the
# signature lists them, with their types.
ATTRIBUTES = [
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
]
# Each attribute's value in the emulator's launcher (ATTRIBUTE_VALUES): G the grid, D the
# threadgroup as dispatched, A this threadgroup's size (smaller at the grid's far edge), g its
# position, l the thread's position in it, t its index in it, n = A's product.
ATTRIBUTE_VALUES = {
    "dispatch_quadgroups_per_threadgroup": "uint((D[0] * D[1] * D[2] + 3) / 4)",
    "dispatch_simdgroups_per_threadgroup": "uint((D[0] * D[1] * D[2] + 31) / 32)",
    "dispatch_threads_per_threadgroup": "uint3{uint(D[0]), uint(D[1]), uint(D[2])}",
    "grid_origin": "uint3{0, 0, 0}",
    "grid_size": "uint3{uint(G[0]), uint(G[1]), uint(G[2])}",
    "quadgroup_index_in_threadgroup": "uint(t / 4)",
    "quadgroups_per_threadgroup": "uint((n + 3) / 4)",
    "simdgroup_index_in_threadgroup": "uint(t / 32)",
    "simdgroups_per_threadgroup": "uint((n + 31) / 32)",
    "thread_execution_width": "32u",
    "thread_index_in_quadgroup": "uint(t % 4)",
    "thread_index_in_simdgroup": "uint(t % 32)",
    "thread_index_in_threadgroup": "uint(t)",
    "thread_position_in_grid": "uint3{uint(g[0] * D[0] + l[0]), uint(g[1] * D[1] + l[1]), uint(g[2] * D[2] + l[2])}",
    "thread_position_in_threadgroup": "uint3{uint(l[0]), uint(l[1]), uint(l[2])}",
    "threadgroup_position_in_grid": "uint3{uint(g[0]), uint(g[1]), uint(g[2])}",
    "threadgroups_per_grid": "uint3{uint(N[0]), uint(N[1]), uint(N[2])}",
    "threads_per_grid": "uint3{uint(G[0]), uint(G[1]), uint(G[2])}",
    "threads_per_simdgroup": "32u",
    "threads_per_threadgroup": "uint3{uint(A[0]), uint(A[1]), uint(A[2])}",
}
# Inputs of fewer elements go to the constant address space (MLX's max_constant_array_size).
MAX_CONSTANT_ARRAY_SIZE = 8
MAX_THREADS = 1024  # threads a threadgroup on Apple GPUs
SIMD_WIDTH = 32  # threads a simdgroup on every Apple GPU MLX runs on

# mlx/backend/common/compiled.cpp get_type_string, and the numpy dtype of each buffer.
TYPE_NAMES = {
    mx.float32: "float", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t", mx.bool_: "bool",
    mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t",
    mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t",
}
HOST = {mx.bfloat16: np.uint16}  # numpy has no bfloat16: its bits travel as uint16


def _host_dtype(dtype: mx.Dtype):
    return HOST.get(dtype) or np.dtype({mx.float32: np.float32, mx.float16: np.float16, mx.bool_: np.bool_, mx.int8: np.int8,
                                         mx.int16: np.int16, mx.int32: np.int32, mx.int64: np.int64, mx.uint8: np.uint8,
                                         mx.uint16: np.uint16, mx.uint32: np.uint32, mx.uint64: np.uint64}[dtype])


def template_value(value) -> str:
    """A template argument as MLX writes it (a bool through an ostream: 1 or 0)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    return TYPE_NAMES[value]


def template_type(value) -> str:
    return "bool" if isinstance(value, bool) else "int" if isinstance(value, int) else "typename"


def mlx_source(name: str, input_names, output_names, source: str, inputs: list[mx.array], output_dtypes, template,
               header: str = "") -> tuple[str, str]:
    """The kernel's name and the whole source MLX compiles for a launch of
    `mx.fast.metal_kernel(name, input_names, output_names, source, header)` on `inputs` (less the
    metal::utils() preamble MLX puts before it, which metal_shim.h stands for)."""
    shapes = [(n + "_shape" in source, n + "_strides" in source, n + "_ndim" in source) for n in input_names]
    attributes = [f"  {kind} {attr} [[{attr}]]" for attr, kind in ATTRIBUTES if attr in source]
    kernel_name = "custom_kernel_" + name
    template_def = ""
    if template:
        template_def = "<" + ", ".join(template_value(v) for _, v in template) + ">"
        kernel_name += "_" + template_def.replace("<", "_").replace(">", "_").replace(", ", "_")[:-1]
    for a in inputs:
        kernel_name += "_" + TYPE_NAMES[a.dtype] + ("s" if a.ndim == 0 else "c" if a.size < MAX_CONSTANT_ARRAY_SIZE else "")
    for dtype in output_dtypes:
        kernel_name += "_" + TYPE_NAMES[dtype]

    text = header
    if template:
        text += "template <" + ", ".join(f"{template_type(v)} {k}" for k, v in template) + ">\n"
    text += f"[[kernel]] void {kernel_name}(\n"
    index = 0
    for n, a, (shape, strides, ndim) in zip(input_names, inputs, shapes):
        location = "constant" if a.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        text += f"  const {location} {TYPE_NAMES[a.dtype]}{'&' if a.ndim == 0 else '*'} {n} [[buffer({index})]],\n"
        index += 1
        if a.ndim > 0:
            for wanted, kind, suffix in ((shape, "int*", "_shape"), (strides, "int64_t*", "_strides"), (ndim, "int&", "_ndim")):
                if wanted:
                    text += f"  const constant {kind} {n}{suffix} [[buffer({index})]],\n"
                    index += 1
    for n, dtype in zip(output_names, output_dtypes):
        text += f"  device {TYPE_NAMES[dtype]}* {n} [[buffer({index})]]"
        # MLX's test compares the running buffer index with the count of inputs and outputs.
        text += ",\n" if index < len(inputs) + len(output_names) - 1 or attributes else ") {\n"
        index += 1
    if attributes:
        text += ",\n".join(attributes) + ") {\n"
    text += source + "\n}\n"
    if template:
        instance = kernel_name + template_def
        text += f'\ntemplate [[host_name("{kernel_name}")]] [[kernel]] decltype({instance}) {instance};\n'
    return kernel_name + template_def, text


# ----------------------------------------------------------------------------- strictness

# The names a body may use besides its own, its arguments, the C++ keywords and types MSL keeps:
# MSL's, as far as tests/helpers/emulator/metal_shim.h implements them (a test checks that it defines each).
# C++'s own types, and <cstdint>'s, which MSL has too.
CXX_TYPES = {"bool", "char", "short", "int", "long", "float", "size_t", "int8_t", "uint8_t", "int16_t", "uint16_t", "int32_t",
             "uint32_t", "int64_t", "uint64_t"}
MSL_TYPES = {"uchar", "ushort", "uint", "ulong", "half", "bfloat", "float16_t", "bfloat16_t",
             *(f"{t}{n}" for t in ("float", "half", "int", "uint", "short", "ushort") for n in (2, 3, 4))}
MSL_FUNCTIONS = {
    "exp", "exp2", "log", "log2", "log10", "sqrt", "rsqrt", "sin", "cos", "tan", "tanh", "floor", "ceil", "round", "trunc",
    "fabs", "abs", "max", "min", "fmax", "fmin", "clamp", "pow", "fma", "isnan", "isinf", "select", "as_type",
    "threadgroup_barrier", "simdgroup_barrier", "simd_shuffle", "simd_broadcast", "simd_shuffle_xor", "simd_shuffle_up",
    "simd_shuffle_down", "simd_sum", "simd_product", "simd_max", "simd_min", "simd_prefix_inclusive_sum",
    "simd_prefix_exclusive_sum", "simd_prefix_inclusive_product", "simd_prefix_exclusive_product", "simd_all", "simd_any",
}
MSL_NAMES = MSL_TYPES | MSL_FUNCTIONS | {"metal", "mem_flags", "mem_none", "mem_device", "mem_threadgroup", "mem_texture",
                                         "numeric_limits", "lowest", "infinity"}
KEYWORDS = {
    "const", "constexpr", "if", "else", "for", "while", "do", "break", "continue", "return", "switch", "case", "default",
    "true", "false", "sizeof", "static_cast", "unsigned", "signed", "void", "auto", "threadgroup", "device", "constant",
    "thread",
}
# What C++ (and g++) accepts and MSL does not, as the reason a body is rejected.
FORBIDDEN = {
    "std": "the C++ standard library", "new": "heap allocation", "delete": "heap allocation", "malloc": "heap allocation",
    "calloc": "heap allocation", "realloc": "heap allocation", "free": "heap allocation", "printf": "printf",
    "fprintf": "printf", "puts": "printf", "throw": "exceptions", "try": "exceptions", "catch": "exceptions",
    "double": "double (Apple GPUs have no float64)", "goto": "goto", "virtual": "virtual functions",
    "thread_local": "thread_local", "register": "register", "typeid": "type identification",
    "dynamic_cast": "dynamic_cast", "static": "static variables", "asm": "inline assembly",
}
_TOKEN = re.compile(r"\s*(?:(?P<float>(?:\d+\.\d*|\.\d+|\d+(?=[eE]))(?:[eE][+-]?\d+)?(?P<suffix>[fFhH]?))|(?P<int>0[xX][0-9a-fA-F]+[uUlL]*|\d+[uUlL]*)|(?P<name>[A-Za-z_]\w*)|(?P<op>::|->|\+\+|--|<<=|>>=|<=|>=|==|!=|&&|\|\||[-+*/%&|^!~<>=]=?|[()\[\]{};,.?:#]))")


def _tokens(source: str) -> list[tuple[str, str, int]]:
    """(kind, text, line) of each token, comments and `#pragma unroll` lines left out."""
    source = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group().count("\n"), source, flags=re.S)
    out = []
    for number, line in enumerate(source.splitlines(), 1):
        line = re.sub(r"//.*", "", line)
        if line.strip() == "#pragma unroll":
            continue
        at = 0
        while at < len(line.rstrip()):
            m = _TOKEN.match(line, at)
            if not m:
                out.append(("bad", line[at:].strip()[:1], number))
                break
            kind = next(k for k in ("float", "int", "name", "op") if m.group(k) is not None)
            out.append((kind, m.group(kind) + (m.group("suffix") or "" if kind == "float" else ""), number))
            at = m.end()
    return out


def check_body(source: str, names=(), type_names=()) -> list[str]:
    """What in the kernel body `source` Metal would not compile, or this project does not allow
    in a body, one line each ('line N: ...'); empty when none. names: the body's arguments (inputs
    and outputs, their _shape/_strides/_ndim, template names), type_names: the template's type
    parameters; attribute variables are allowed."""
    tokens = _tokens(source)
    known = KEYWORDS | CXX_TYPES | MSL_NAMES | set(names) | {a for a, _ in ATTRIBUTES}
    types = CXX_TYPES | MSL_TYPES | {"auto"} | set(type_names)
    problems, declared = [], set()

    def report(line, what):
        problems.append(f"line {line}: {what}")

    for i, (kind, text, line) in enumerate(tokens):
        before = tokens[i - 1][1] if i else ""
        after = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if kind == "bad":
            report(line, f"'{text}' (string and character literals are not used in kernels)")
        elif kind == "float" and not text.endswith(("f", "F", "h", "H")):
            report(line, f"the literal {text} is a double in C++: write {text}f")
        elif kind == "op" and text == "#":
            report(line, "preprocessor directives other than #pragma unroll")
        elif kind == "op" and text == "[" and tokens[i - 1][0] == "op" and before in ("(", ",", "=", "{", ";"):
            report(line, "lambda expressions")
        elif kind == "op" and text == "(" and after == "*" and i + 3 < len(tokens) and tokens[i + 3][1] == ")":
            report(line, "function pointers")
        elif kind != "name":
            continue
        elif text in FORBIDDEN:
            report(line, f"'{text}': {FORBIDDEN[text]} (not in MSL)")
        elif text.startswith("__"):
            report(line, f"'{text}': a reserved (compiler or CUDA) name, not MSL")
        elif text in ("device", "constant"):
            j = i + 1 + (tokens[i + 1][1] == "const")
            if not (j + 1 < len(tokens) and tokens[j + 1][1] in ("*", "&")):
                report(line, f"a {text} variable that is not a pointer or reference (MSL keeps {text} memory to kernel arguments)")
        elif text == "threadgroup":
            j = i + 1 + (tokens[i + 1][1] == "const")
            if before not in (";", "{", "}", "") or not (j + 2 < len(tokens) and tokens[j + 1][0] == "name" and tokens[j + 2][1] == "["):
                report(line, "threadgroup memory other than an array declared at the start of a statement")
            else:
                end = next(k for k in range(j, len(tokens)) if tokens[k][1] == ";")
                if any(t[1] == "=" for t in tokens[j:end]):
                    report(line, "an initializer on threadgroup memory (MSL leaves it unset)")
        elif before == ".":
            if text not in ("x", "y", "z", "w"):
                report(line, f"'.{text}': only vector components .x .y .z .w")
        elif before == "::":
            if text not in MSL_NAMES:
                report(line, f"'::{text}' is not an MSL name this project uses")
        elif text in known or text in declared:
            continue
        elif before in types or before in ("*", "&") and i > 1 and tokens[i - 2][1] in types:
            declared.add(text)  # a local variable, named after its type
        else:
            report(line, f"'{text}' is not an MSL name, an argument or a variable declared before it")
    return problems


class StrictnessError(ValueError):
    """A body uses what Metal would not compile."""


# ----------------------------------------------------------------------------- the emulated kernel


def _launcher(call: str, arguments: list[str], attributes: list[str]) -> str:
    """The C++ that runs the kernel: reads the buffers, computes each thread's attribute values."""
    values = "".join(f"  const auto {a} = {ATTRIBUTE_VALUES[a]};\n" for a in attributes)
    return (
        "\n#undef device\n#undef constant\n#undef thread\n#undef threadgroup\n"
        "static int G[3], D[3], N[3];\n"
        "static void extent(const int* g, int* A) {\n"
        "  for (int i = 0; i < 3; ++i) A[i] = D[i] < G[i] - g[i] * D[i] ? D[i] : G[i] - g[i] * D[i];\n}\n"
        "static int threads(const int* g) {\n  int A[3];\n  extent(g, A);\n  return A[0] * A[1] * A[2];\n}\n"
        "static void body(int t) {\n"
        "  const int* g = emu::team.group;\n  int A[3];\n  extent(g, A);\n"
        "  const int n = A[0] * A[1] * A[2];\n  const int l[3] = {t % A[0], t / A[0] % A[1], t / (A[0] * A[1])};\n"
        + values
        + f"  {call}({', '.join(arguments + attributes)});\n}}\n"
        "int main(int argc, char** argv) {\n"
        "  for (int i = 0; i < 3; ++i) {\n"
        "    G[i] = atoi(argv[1 + i]);\n    D[i] = atoi(argv[4 + i]);\n    N[i] = D[i] ? (G[i] + D[i] - 1) / D[i] : 0;\n  }\n"
        "  emu::read_buffers();\n  emu::run_grid(N, threads, body);\n}\n"
    )


def _device_bytes(a: mx.array, contiguous: bool) -> tuple[bytes, list[int]]:
    """The bytes MLX's Metal backend hands over for input a, and the element strides it passes:
    row-major (ensure_row_contiguous, or an array that is already so), else a's own layout, the
    gaps between its elements filled with 0xff bytes."""
    host = _host_dtype(a.dtype)
    view = np.asarray(memoryview(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)).view(host)
    row_major = [int(prod(a.shape[i + 1 :])) for i in range(a.ndim)]
    strides = [s // view.itemsize for s in view.strides]
    if contiguous or strides == row_major or any(s < 0 for s in strides) or a.size == 0:
        return gpu_emulator.as_bytes(view), row_major
    span = 1 + sum((n - 1) * s for n, s in zip(a.shape, strides))
    buffer = np.frombuffer(b"\xff" * (span * view.itemsize), host).copy()
    np.lib.stride_tricks.as_strided(buffer, a.shape, view.strides)[...] = view
    return buffer.tobytes(), strides


class MetalKernel:
    """`mx.fast.metal_kernel`'s kernel object, run by the emulator (see the module docstring)."""

    def __init__(self, name, input_names, output_names, source, header="", ensure_row_contiguous=True, atomic_outputs=False):
        if atomic_outputs or header:
            raise NotImplementedError("the Metal emulator takes no atomic outputs and no header")
        self.name, self.input_names, self.output_names = name, list(input_names), list(output_names)
        self.source, self.header, self.contiguous = source, header, ensure_row_contiguous

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None, init_value=None, verbose=False,
                 stream=None):
        template = list(template or [])
        inputs = [a if isinstance(a, mx.array) else mx.array(a) for a in inputs]
        if prod(threadgroup) > MAX_THREADS:  # MLX's own message (mlx/backend/metal/custom_kernel.cpp)
            raise ValueError(f"Thread group size ({prod(threadgroup)}) is greater than  the maximum allowed threads per threadgroup ({MAX_THREADS}).")
        dispatched = [min(t, g) for t, g in zip(threadgroup, grid)]
        if "simd_" in self.source and prod(dispatched) % SIMD_WIDTH:
            raise ValueError(f"{self.name}: threadgroups of {prod(dispatched)} threads are not whole {SIMD_WIDTH}-lane simdgroups, "
                             "which its simdgroup functions assume")
        binary = self._build(inputs, output_dtypes, template, verbose)
        buffers = []
        for n, a in zip(self.input_names, inputs):
            data, strides = _device_bytes(a, self.contiguous)
            buffers.append(data)
            if a.ndim > 0:
                for suffix, values, dtype in (("_shape", a.shape, np.int32), ("_strides", strides, np.int64), ("_ndim", [a.ndim], np.int32)):
                    if n + suffix in self.source:
                        buffers.append(np.array(values, dtype).tobytes())
        outputs = []
        for shape, dtype in zip(output_shapes, output_dtypes):
            itemsize = np.dtype(_host_dtype(dtype)).itemsize
            fill = gpu_emulator.poison(itemsize) if init_value is None else _element(init_value, dtype)
            outputs.append((int(prod(shape)) * itemsize, fill))
        raw = gpu_emulator.execute(binary, buffers, outputs, [*grid, *dispatched], self.output_names)
        results = []
        for data, shape, dtype in zip(raw, output_shapes, output_dtypes):
            host = np.frombuffer(data, _host_dtype(dtype)).reshape(shape)
            results.append(mx.array(host).view(mx.bfloat16) if dtype == mx.bfloat16 else mx.array(host))
        return results

    def _build(self, inputs: list[mx.array], output_dtypes, template: list, verbose: bool = False):
        """The program of a launch on inputs: the strictness check, then MLX's source compiled."""
        names = [*self.input_names, *self.output_names, *(f"{n}_{s}" for n in self.input_names for s in ("shape", "strides", "ndim")),
                 *(k for k, _ in template)]
        types = tuple(k for k, v in template if isinstance(v, mx.Dtype))
        problems = _check(self.source, tuple(names), types)
        if problems:
            raise StrictnessError(f"{self.name}.metal: Metal would not compile this body: " + "\n".join(problems))
        call, text = mlx_source(self.name, self.input_names, self.output_names, self.source, inputs, output_dtypes, template, self.header)
        if verbose:
            print(f"Generated source code for `{self.name}`:\n```\n{text}\n```")
        # g++'s messages name the .metal file's lines (kernel_source keeps them)
        program = text.replace(") {\n" + self.source, f') {{\n#line 1 "{self.name}.metal"\n' + self.source, 1)
        return gpu_emulator.build('#include "metal_shim.h"\n' + program + self._launcher(call, inputs, output_dtypes))

    def threadgroup_bytes(self, *, inputs, output_dtypes, template=None, **_) -> int:
        """The threadgroup memory the kernel declares for this launch (its program is built, not run)."""
        inputs = [a if isinstance(a, mx.array) else mx.array(a) for a in inputs]
        return gpu_emulator.threadgroup_bytes(self._build(inputs, output_dtypes, list(template or [])))

    def _launcher(self, call: str, inputs: list[mx.array], output_dtypes) -> str:
        """The launcher's C++: each buffer cast to its argument's type, in the signature's order."""
        arguments, index = [], 0
        for n, a in zip(self.input_names, inputs):
            ctype = TYPE_NAMES[a.dtype]
            arguments.append(f"*(const {ctype}*)emu::buffers[{index}].data" if a.ndim == 0 else f"(const {ctype}*)emu::buffers[{index}].data")
            index += 1
            if a.ndim > 0:
                for suffix, cast in (("_shape", "(const int*)"), ("_strides", "(const int64_t*)"), ("_ndim", "*(const int*)")):
                    if n + suffix in self.source:
                        arguments.append(f"{cast}emu::buffers[{index}].data")
                        index += 1
        for dtype in output_dtypes:
            arguments.append(f"({TYPE_NAMES[dtype]}*)emu::buffers[{index}].data")
            index += 1
        return _launcher(call, arguments, [a for a, _ in ATTRIBUTES if a in self.source])

    def __repr__(self):
        return f"MetalKernel({self.name})"


@functools.cache
def _check(source: str, names: tuple[str, ...], types: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(check_body(source, names, types))


def _element(value: float, dtype: mx.Dtype) -> bytes:
    a = mx.array([value], mx.float32).astype(dtype)
    return np.array(a.view(mx.uint16) if dtype == mx.bfloat16 else a).tobytes()


def metal_kernel(name, input_names, output_names, source, header="", ensure_row_contiguous=True, atomic_outputs=False, compile_options=None):
    """`mx.fast.metal_kernel` on the emulator."""
    return MetalKernel(name, input_names, output_names, source, header, ensure_row_contiguous, atomic_outputs)


def load_kernel(backend: str, name: str, inputs: tuple[str, ...], outputs: tuple[str, ...], contiguous: bool = True, reference=None):
    """`mlx_hybrid.kernels.load_kernel` with the Metal body run by the emulator, behind the same
    fallback wrapper as on a Mac (`kernels.Kernel`)."""
    source = kernels.kernel_source("metal", name)
    return kernels.Kernel("metal", name, lambda: metal_kernel(name, inputs, outputs, source, ensure_row_contiguous=contiguous), reference)
