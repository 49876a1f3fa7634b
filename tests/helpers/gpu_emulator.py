"""What the Metal and CUDA emulators share (tests/helpers/metal_emulator.py, tests/helpers/cuda_emulator.py): the
g++ build of a kernel program, once per process for every launch that shares its source, and one
run of it with its buffers. The C++ runtime is tests/helpers/emulator/runtime.h: one fiber a GPU thread, a
threadgroup at a time, by a fixed schedule that makes a missing barrier show (it says how).
"""

import hashlib
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

# The runtime needs Linux (it is what CI runs; a Mac runs the kernels on its GPU instead).
AVAILABLE = shutil.which("g++") is not None and sys.platform == "linux"
HEADERS = Path(__file__).parent / "emulator"
# -O1: the programs run for milliseconds and build for about a second; -Wvla: MSL and CUDA have
# no variable-length arrays, which g++ would otherwise accept.
FLAGS = ["-std=c++20", "-O1", "-w", "-Werror=vla", "-ftrivial-auto-var-init=pattern", f"-I{HEADERS}"]

# Schedule orders a launch runs in (tests/helpers/emulator/runtime.h): 2 reports a race; end-to-end tests,
# whose kernels the parity tests run in both, take 1 and half the time.
ORDERS = 2
_BUILDS = tempfile.TemporaryDirectory()  # removed when the process exits
_BUILT: dict[str, Path] = {}
_THREADGROUP: dict[Path, list[tuple[int, int]]] = {}  # a program's threadgroup arrays: offset from emu::team, bytes


class BuildError(RuntimeError):
    """The kernel program does not compile; the message holds g++'s errors."""


def _precompile(header: str):
    """header (metal_shim.h, cuda_shim.h) precompiled beside the programs, which include it first:
    it halves a build."""
    d = Path(_BUILDS.name)
    if not (d / f"{header}.gch").exists():
        subprocess.run(["g++", *FLAGS, "-x", "c++-header", HEADERS / header, "-o", d / f"{header}.gch"], check=True, capture_output=True)


def build(source: str) -> Path:
    """The compiled program for source, built once per process."""
    key = hashlib.sha1(source.encode()).hexdigest()
    if key not in _BUILT:
        d = Path(_BUILDS.name)
        first = re.match(r'#include "(\w+\.h)"', source)
        if first:
            _precompile(first.group(1))
        (d / f"{key}.cpp").write_text(source)
        done = subprocess.run(["g++", *FLAGS, "-o", d / key, d / f"{key}.cpp"], capture_output=True, text=True)
        if done.returncode:
            errors = [line for line in done.stderr.splitlines() if "error" in line]
            raise BuildError("the kernel does not compile: " + "\n".join(errors or [done.stderr])[:4000])
        _BUILT[key] = d / key
        _THREADGROUP[d / key] = _threadgroup_arrays(d / key)
    return _BUILT[key]


def threadgroup_bytes(binary: Path) -> int:
    """The threadgroup memory of a built program: its threadgroup arrays' bytes."""
    return sum(size for _, size in _THREADGROUP[binary])


def _threadgroup_arrays(binary: Path) -> list[tuple[int, int]]:
    """The static variables of functions outside the runtime (the kernel's threadgroup arrays:
    a body may declare no other), each as (offset from emu::team, bytes)."""
    symbols = subprocess.run(["nm", "-S", "-C", "--defined-only", binary], capture_output=True, text=True, check=True).stdout
    found, team = [], None
    for line in symbols.splitlines():
        parts = line.split(" ", 3)
        if len(parts) < 4:
            continue
        at, size, name = int(parts[0], 16), int(parts[1], 16), parts[3]
        if name == "emu::team":
            team = at
        elif re.search(r"\)::\w+$", name) and not name.startswith(("emu::", "guard variable")):
            found.append((at, size))
    return [(at - team, size) for at, size in found]


def execute(binary: Path, inputs: list[bytes], outputs: list[tuple[int, bytes]], args: list[int], names=()) -> list[bytes]:
    """Run binary on its buffers: inputs, then outputs as (bytes, initial element), in ORDERS
    schedule orders; args go to its command line; names: the outputs', for messages. Returns the
    outputs' bytes."""
    header = lambda *v: struct.pack(f"{len(v)}q", *v)  # noqa: E731
    regions = _THREADGROUP[binary]
    blob = [header(len(regions), *(v for r in regions for v in r)), header(len(inputs) + len(outputs))]
    blob += [header(len(b), 0, 0) + b for b in inputs]
    blob += [header(n, 1, len(fill)) + fill for n, fill in outputs]
    done = subprocess.run([binary, *map(str, args)], input=b"".join(blob), capture_output=True, env={"EMULATOR_ORDERS": str(ORDERS)})
    if done.returncode:
        message = done.stderr.decode(errors="replace").strip() or f"the kernel program exited with {done.returncode}"
        raise RuntimeError(re.sub(r"output (\d+)", lambda m: f"output {names[int(m.group(1))]}" if names else m.group(), message))
    results, at = [], 0
    for n, _ in outputs:
        results.append(done.stdout[at : at + n])
        at += n
    return results


def poison(itemsize: int) -> bytes:
    """An output's initial element: 0xff bytes (NaN as a float), as a GPU leaves memory unset."""
    return b"\xff" * itemsize


def as_bytes(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()
