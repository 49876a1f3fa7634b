"""The Metal kernels, compiled and run on the CPU by tests/helpers/metal_emulator.py: the source MLX would
hand to Metal (checked against MLX's own), each kernel against its pure-MLX reference at the
shapes and dtypes of the GPU parity tests, all of them under greedy speculative decoding, the
strictness check and the deliberately broken kernels it and the emulator must catch, and the
fallback to the references when a kernel fails on the user's device.
"""

import re
import sys

from tests.helpers import metal_emulator
import mlx.core as mx
import numpy as np
import pytest
from tests.helpers.factories import make_hybrid_dir, took_compiled_pass
from tests.test_linear import SHAPES as ROW_SHAPES
from tests.test_qlinear import SHAPES as QROW_SHAPES
from tests.test_qlinear import quantized
from tests.test_scan import STEP_SHAPES, check_tree_step_parity
from tests.test_scan import check_parity as check_scan
from tests.test_speculative import (drafter_like_target, medusa_like_target, noisy_copy, run_steps, target,  # noqa: F401
                              tie_free_references)
from tests.test_speculative_tree import BEAM_STEPS, beam_cases, beam_step_case, check_beam_step, greedy_cases, packed_arrays
from tests.test_tree_attention import check_parity as check_attention

from mlx_hybrid import doctor, dsla_step, kernels, scan, tree_attention
from mlx_hybrid.loader import load_model
from mlx_hybrid.models import hybrid, linear, qlinear
from mlx_hybrid.speculative import accept, redrafter, topk, tree, verify
from mlx_hybrid.speculative.draft import DraftProposer
from mlx_hybrid.speculative.medusa import MedusaProposer
from mlx_hybrid.speculative.redrafter import ReDrafterProposer
from mlx_hybrid.speculative.tree import MedusaTree, cartesian_paths

pytestmark = pytest.mark.skipif(not metal_emulator.AVAILABLE, reason="the emulator needs g++ on Linux")

LAUNCHERS = (scan, dsla_step, tree_attention, linear, qlinear, topk, tree, accept)  # the modules that launch kernels
ROUTERS = (scan, tree_attention, hybrid, linear, qlinear, accept, tree, topk, verify)  # the modules that ask kernel_backend
DTYPES = [mx.float32, mx.float16, mx.bfloat16]


@pytest.fixture
def metal(monkeypatch):
    """The launchers' kernels are their Metal bodies on the emulator, as `kernels.load_kernel`
    gives them on a Mac (fallback wrapper included)."""
    for module in LAUNCHERS:
        monkeypatch.setattr(module, "load_kernel", metal_emulator.load_kernel)


def emulated_metal(monkeypatch):
    """Send the model code down its GPU path with Metal kernels, drafts uncompiled (the emulator
    needs real arrays) and packed beams kept at their padded size, as on a GPU."""
    for module in LAUNCHERS:
        monkeypatch.setattr(module, "load_kernel", metal_emulator.load_kernel)
    for module in ROUTERS:
        monkeypatch.setattr(module, "kernel_backend", lambda: "metal")
    monkeypatch.setattr(redrafter, "trims_padding", lambda: False)
    monkeypatch.setattr(metal_emulator.gpu_emulator, "ORDERS", 1)
    mx.disable_compile()


def recorded_launches() -> dict:
    """Each kernel's first launch in `hybrid doctor`'s cases: name -> (inputs, outputs, contiguous, launch)."""
    seen = {}

    def record(backend, name, inputs, outputs, contiguous=True, reference=None):
        def call(**launch):
            seen.setdefault(name, (inputs, outputs, contiguous, launch))
            return reference(**launch)

        return call

    with pytest.MonkeyPatch.context() as mp:
        for module in LAUNCHERS:
            mp.setattr(module, "load_kernel", record)
        for case in doctor.cases():
            case.run("metal")
    return seen


LAUNCHES = recorded_launches()


# ----------------------------------------------------------------------------- the source


@pytest.mark.parametrize("name", sorted(LAUNCHES))
def test_generated_source_is_mlxs_own(name, capfd, tmp_path):
    """mlx_source writes what MLX's mx.fast.metal_kernel assembles, byte for byte: MLX prints it
    (verbose=True) while exporting a function, which works without Metal."""
    inputs, outputs, contiguous, launch = LAUNCHES[name]
    source = kernels.kernel_source("metal", name)
    kernel = mx.fast.metal_kernel(name=name, input_names=list(inputs), output_names=list(outputs), source=source,
                                  ensure_row_contiguous=contiguous)
    mx.export_function(str(tmp_path / "k.mlxfn"), lambda *a: kernel(**{**launch, "inputs": list(a)}, verbose=True), *launch["inputs"])
    printed = capfd.readouterr().out
    mlx_text = printed[printed.index("```\n") + 4 : printed.rindex("\n```")]
    _, ours = metal_emulator.mlx_source(name, inputs, outputs, source, launch["inputs"], launch["output_dtypes"], launch["template"])
    assert ours == mlx_text


@pytest.mark.parametrize("name", sorted(LAUNCHES))
def test_every_metal_body_passes_the_strictness_check(name):
    inputs, outputs, _, launch = LAUNCHES[name]
    names = [*inputs, *outputs, *(f"{n}_{s}" for n in inputs for s in ("shape", "strides", "ndim")), *(k for k, _ in launch["template"])]
    types = [k for k, v in launch["template"] if isinstance(v, mx.Dtype)]
    assert metal_emulator.check_body(kernels.kernel_source("metal", name), names, types) == []


def test_strictness_names_are_the_shims():
    """Every MSL name the strictness check allows is one the shim defines."""
    shim = (metal_emulator.gpu_emulator.HEADERS / "metal_shim.h").read_text()
    undefined = sorted(n for n in metal_emulator.MSL_NAMES if not re.search(rf"\b{n}\b", shim))
    assert not undefined


def test_dispatch_covers_the_grid_with_partial_threadgroups():
    """`grid` counts threads (Metal's dispatchThreads, not CUDA's whole blocks): threadgroups of
    `threadgroup` threads cover it, each side clamped to the grid's, and the last along each side
    is partial; its threads_per_threadgroup says so, dispatch_threads_per_threadgroup does not."""
    kernel = metal_emulator.metal_kernel("where", [], ["out"], """
const uint i = thread_position_in_grid.x + thread_position_in_grid.y * threads_per_grid.x;
out[i * 4] = threadgroup_position_in_grid.x * 100 + threadgroup_position_in_grid.y;
out[i * 4 + 1] = thread_index_in_threadgroup;
out[i * 4 + 2] = threads_per_threadgroup.x * 100 + threads_per_threadgroup.y;
out[i * 4 + 3] = dispatch_threads_per_threadgroup.x * 100 + dispatch_threads_per_threadgroup.y;""")
    (out,) = kernel(inputs=[], output_shapes=[(3, 70, 4)], output_dtypes=[mx.uint32], grid=(70, 3, 1), threadgroup=(32, 2, 1))
    out = np.array(out)
    x, y = np.meshgrid(np.arange(70), np.arange(3))
    assert (out[..., 0] == x // 32 * 100 + y // 2).all()
    width, height = np.where(x < 64, 32, 6), np.where(y < 2, 2, 1)
    assert (out[..., 1] == x % 32 + y % 2 * width).all()
    assert (out[..., 2] == width * 100 + height).all() and (out[..., 3] == 3202).all()
    (out,) = kernel(inputs=[], output_shapes=[(1, 5, 4)], output_dtypes=[mx.uint32], grid=(5, 1, 1), threadgroup=(32, 2, 1))
    assert np.array(out)[0, :, 3].tolist() == [501] * 5  # the threadgroup no larger than the grid


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_types_round_as_mlx_does(dtype):
    """float to half and bfloat rounds to nearest even, as MLX's own conversion."""
    kernel = metal_emulator.metal_kernel("round", ["x"], ["out"], """
const uint i = thread_position_in_grid.x;
out[i] = static_cast<T>(x[i] * 3.0f);""")
    x = mx.array(np.random.default_rng(0).standard_normal(4096).astype(np.float32) * np.float32(1e3))
    (out,) = kernel(inputs=[x], template=[("T", dtype)], output_shapes=[x.shape], output_dtypes=[dtype], grid=(4096, 1, 1), threadgroup=(256, 1, 1))
    assert mx.array_equal(out, (x * 3).astype(dtype)).item()


def test_launch_limits():
    """More than 1024 threads a threadgroup, simdgroup functions in threadgroups that are not
    whole simdgroups, and more than 32 KiB of threadgroup memory fail, as on a Mac."""
    simd = metal_emulator.metal_kernel("simd", [], ["out"], "out[thread_position_in_grid.x] = simd_sum(1.0f);")
    big = metal_emulator.metal_kernel("big", [], ["out"], """
threadgroup float scratch[N];
scratch[thread_position_in_threadgroup.x] = 1.0f;
threadgroup_barrier(mem_flags::mem_threadgroup);
out[thread_position_in_grid.x] = scratch[0];""")
    launch = dict(inputs=[], output_shapes=[(64,)], output_dtypes=[mx.float32], grid=(64, 1, 1))
    with pytest.raises(ValueError, match="maximum allowed threads per threadgroup"):
        simd(**launch, threadgroup=(1025, 1, 1))
    with pytest.raises(ValueError, match="whole 32-lane simdgroups"):
        simd(**launch, threadgroup=(48, 1, 1))
    assert np.array(big(**launch, threadgroup=(64, 1, 1), template=[("N", 8192)])[0]).tolist() == [1.0] * 64
    with pytest.raises(RuntimeError, match="32 KiB"):
        big(**launch, threadgroup=(64, 1, 1), template=[("N", 8193)])


def largest_tree(H, KV, D, dtype) -> int:
    """The most nodes tree_attention's launcher takes the kernel for at these heads."""
    T = 1
    while tree_attention.launch(H, KV, T + 1, D, dtype):
        T += 1
    return T


@pytest.mark.parametrize("H,KV,D,dtype", [(9, 3, 64, mx.bfloat16), (32, 8, 128, mx.float32)])  # SmolLM2-135M, Llama 3 8B
def test_tree_attention_threadgroup_memory_is_its_launchers_count(H, KV, D, dtype):
    """At the largest tree its launcher gives the kernel, tree attention declares the threadgroup
    memory `launch` counts, within Apple's 32 KiB: the launcher's budget is the kernel's."""
    T = largest_tree(H, KV, D, dtype)
    template, _, threads = tree_attention.launch(H, KV, T, D, dtype)
    t = dict(template)
    count = 4 * (2 * T + 2 + t["R"] * D + t["NW"] * t["R"] * (D + 2)) + dtype.size * T * D
    kernel = metal_emulator.metal_kernel("tree_attention", ["q", "k", "v", "tk", "tv", "parents", "node_rows", "positions", "freqs"],
                                         ["out", "rk"], kernels.kernel_source("metal", "tree_attention"), ensure_row_contiguous=False)
    arrays = [mx.zeros((1, 1, 8, D), dtype)] * 5 + [mx.zeros((T,), mx.int32)] * 3 + [mx.zeros((D // 2,), mx.float32)]
    measured = kernel.threadgroup_bytes(inputs=arrays, output_dtypes=[dtype, dtype], template=template + [("SCALE", 0)])
    assert measured == count <= tree_attention.SHARED_BYTES == 32 << 10
    assert not tree_attention.launch(H, KV, T + 1, D, dtype)


def test_threadgroup_memory_within_32_kib_at_the_launchers_limits():
    """The beam step at k = 16 (the most its launcher takes) and packing 1024 beam positions (the
    most a threadgroup has threads for) declare at most 32 KiB of threadgroup memory."""
    def kernel(name, inputs, outputs):
        return metal_emulator.metal_kernel(name, inputs, outputs, kernels.kernel_source("metal", name))

    chunks = kernel("beam_topk_chunks", ["logits"], ["part_m", "part_s", "part_v", "part_i"])
    merge = kernel("beam_topk_merge", ["part_m", "part_s", "part_v", "part_i", "scores"], ["origin", "token", "score"])
    pack = kernel("pack_beams", ["beams"], ["tokens", "parents", "depths", "mask", "node_of", "count"])
    parts = [mx.zeros((1, 16, 8)), mx.zeros((1, 16, 8)), mx.zeros((1, 16, 8, 16)), mx.zeros((1, 16, 8, 16), mx.int32), mx.zeros((1, 16))]
    sizes = [
        chunks.threadgroup_bytes(inputs=[mx.zeros((1, 16, 16384))], output_dtypes=[mx.float32] * 3 + [mx.int32],
                                 template=[("T", mx.float32), ("K", 16), ("TG", topk.TG), ("E", topk.PER_THREAD)]),
        merge.threadgroup_bytes(inputs=parts, output_dtypes=[mx.int32, mx.int32, mx.float32], template=[("K", 16), ("TG", topk.TG), ("V", 16384)]),
        pack.threadgroup_bytes(inputs=[mx.zeros((1, 1024), mx.int32)], output_dtypes=[mx.int32] * 3 + [mx.bool_, mx.int32, mx.int32],
                               template=[("BW", 1), ("BL", 1024), ("TN", 1024)]),
    ]
    assert all(0 < size <= 32 << 10 for size in sizes), sizes


# ----------------------------------------------------------------------------- each kernel


def test_every_kernel_matches_its_reference_in_the_doctors_cases(metal):
    """`hybrid doctor`'s checks with the Metal kernels (its GPU path), each within its tolerance."""
    for case in doctor.cases():
        result = doctor.check(case, "metal", repeats=1)
        assert result.ok and result.kernel_error is not None, result


@pytest.mark.parametrize("dtype", DTYPES)
def test_selective_scan(metal, dtype):
    """The CUDA parity test's tolerances, at a partial threadgroup (300 channels), one and several
    tokens and batches, shared and per-row decays, grouped B and C, and a tree."""
    shapes = [(16, 1, "1", 1, 1), (16, 4, "n", 7, 3), (64, 4, "1", 7, 1)]
    check_scan("metal", dtype, shapes, trees=[(16, 3)], device=mx.cpu)


@pytest.mark.parametrize("dtype,cases", [(mx.float32, [("tree", 0), ("beam", 1), ("chain", 2), ("tree", 3)]),
                                         (mx.float16, [("tree", 0), ("chain", 2)]), (mx.bfloat16, [("beam", 1), ("tree", 3)])])
def test_tree_attention(metal, dtype, cases):
    """Strided queries and keys, grouped heads, no cache, cache rows past a threadgroup's, every
    tree shape, as the CUDA parity test (each case a build, so the half types take two each)."""
    check_attention("metal", dtype, cases, device=mx.cpu)


@pytest.mark.parametrize("dtype,shapes", [(mx.float32, STEP_SHAPES[-2:] + [("mamba", 16, 4, 2, 512), ("mamba2", 64, 1, 1, 512)]),
                                          (mx.float16, STEP_SHAPES[-1:]), (mx.bfloat16, STEP_SHAPES[-2:-1])])
def test_ssm_step(monkeypatch, dtype, shapes):
    """The fused Mamba and Mamba2 step over a tree and then decode steps, against the layers'
    unfused path (72 x 8 threads: a partial last threadgroup, whose lanes all take part)."""

    def emulated():
        monkeypatch.setattr(hybrid, "kernel_backend", lambda: "metal")
        monkeypatch.setattr(scan, "load_kernel", metal_emulator.load_kernel)

    check_tree_step_parity(dtype, emulated, monkeypatch, shapes)


def test_ssm_step_reference_is_the_unfused_path(monkeypatch):
    """`ssm_step_ref`, the fused kernel's fallback, equals the mixers' unfused path."""

    def emulated():  # the kernel path, each launch computed by its reference
        monkeypatch.setattr(hybrid, "kernel_backend", lambda: "metal")
        monkeypatch.setattr(scan, "load_kernel", lambda *a, reference, **k: lambda **launch: reference(**launch))

    check_tree_step_parity(mx.float32, emulated, monkeypatch, STEP_SHAPES[::5])


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_matmul(metal, dtype):
    """Products of a few rows, with the RMSNorm, SwiGLU and residual a launch can take, against
    MLX's ops in float32 (half types: float32 sums rounded once, outputs O(10))."""
    rng = np.random.default_rng(1)
    tol = {mx.float32: 1e-4, mx.float16: 2e-2, mx.bfloat16: 1.6e-1}[dtype]
    shapes = ROW_SHAPES if dtype == mx.float32 else ROW_SHAPES[1:3]
    for M, K, N in shapes:
        x, w = (mx.array(rng.standard_normal(s).astype(np.float32)).astype(dtype) for s in ((M, K), (N, K)))
        got = linear.row_matmul(x, w, backend="metal")
        np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(x.astype(mx.float32) @ w.astype(mx.float32).T),
                                   atol=tol, rtol=1e-2, err_msg=f"{dtype} {M}x{K} @ {N}x{K}")
    M, K, N = ROW_SHAPES[1]
    layer, norm = linear.Linear(K, N, bias=False), linear.nn.RMSNorm(K)
    layer.weight = mx.array(rng.standard_normal((N, K)).astype(np.float32) / 8).astype(dtype)
    norm.weight = mx.array(rng.uniform(0.5, 1.5, K).astype(np.float32)).astype(dtype)
    x, residual = mx.array(rng.standard_normal((M, 2 * K)).astype(np.float32)).astype(dtype), mx.ones((M, N), dtype)
    for gated, use_norm in ((False, True), (True, False)):
        rows = x[:, :K] if not gated else x
        got = linear.row_matmul(rows, layer.weight, backend="metal", norm=norm if use_norm else None, gated=gated, residual=residual)
        with kernels.references_only():
            want = linear.row_matmul(rows, layer.weight, backend="metal", norm=norm if use_norm else None, gated=gated, residual=residual)
        np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=tol, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qrow_matmul(metal, dtype):
    """Products of a few rows with quantized weights against the reference under qlinear's policy:
    float32 sums rounded once, so within float32 rounding, and for the half types one step of the
    dtype at the output's size."""
    rng = np.random.default_rng(3)
    shapes = QROW_SHAPES if dtype == mx.float32 else QROW_SHAPES[:2]
    step = {mx.float32: 1e-5, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}[dtype]
    for M, K, N, gs, bits in shapes:
        wq, scales, biases = quantized(N, K, gs, bits, dtype, seed=M)
        x = mx.array(rng.standard_normal((M, K)).astype(np.float32)).astype(dtype)
        got = qlinear.qrow_matmul(x, wq, scales, biases, group_size=gs, bits=bits, backend="metal")
        want = qlinear.qrow_matmul_ref(x, wq, scales, biases, gs, bits)
        np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=1e-4, rtol=step,
                                   err_msg=f"{dtype} {M}x{K} @ {N}x{K}, {bits} bits, groups of {gs}")


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_beam_topk(metal, monkeypatch, dtype):
    """A beam-search step's two kernels against `beam_step_ref`, at the CUDA parity test's steps."""
    monkeypatch.setattr(topk, "kernel_backend", lambda: "metal")
    steps = BEAM_STEPS if dtype == mx.float32 else BEAM_STEPS[1:3]
    for i, (batch, beams, vocab, k) in enumerate(steps):
        logits, scores = beam_step_case(batch, beams, vocab, seed=10 + i)
        logits = logits.astype(dtype)
        check_beam_step(topk.beam_step(logits, scores, k), topk.beam_step_ref(logits, scores, k),
                        f"{dtype}, batch {batch}, {beams} beams, vocabulary {vocab}, k {k}")


def test_pack_beams_and_greedy_accept(metal, monkeypatch):
    """Beams below, at and above a simdgroup's 32 threads, and greedy acceptance over Medusa trees
    and packed beams, against their references."""
    monkeypatch.setattr(tree, "kernel_backend", lambda: "metal")
    for beams in list(beam_cases(9))[::3]:
        got, want = packed_arrays(tree.pack_beams(beams)), packed_arrays(tree.pack_beams_ref(beams))
        assert [g.tolist() for g in got] == [w.tolist() for w in want], f"beams {beams.tolist()}"
    for draft, logits, _, _ in greedy_cases(6, seed=7):
        want_info, want_last = accept.greedy_rows_ref(draft.tokens, draft.rows, logits)
        info, last = accept.greedy_rows_kernel(draft.tokens, draft.rows, mx.argmax(logits, axis=-1), backend="metal")
        assert info.tolist() == want_info.tolist() and last.item() == want_last.item()


# ----------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("kind", ["llama", "hybrid"])
@pytest.mark.parametrize("method", ["medusa", "redrafter", "draft"])
def test_greedy_speculative_decoding_on_metal_kernels(target, tmp_path, monkeypatch, kind, method):  # noqa: F811
    """The Metal path end to end: tree attention, `ssm_step` and `dsla_step` (hybrid),
    `beam_topk_*`, `pack_beams` and `greedy_accept` all run as Metal kernels (emulated); the tokens
    must be plain greedy decoding's."""
    path, model = target[0], target[1]
    if kind == "hybrid":
        path, _ = make_hybrid_dir(tmp_path / "h", ["attention", "mamba", "mamba2", "dsla"], seed=3)
        model = load_model(path, "float32")
    [(prompt, ref)] = tie_free_references(model, 1, n=10, seed=1)
    if method == "medusa":
        proposer = MedusaProposer(medusa_like_target(model), MedusaTree(cartesian_paths([2, 2, 1])))
    elif method == "redrafter":
        proposer = ReDrafterProposer(drafter_like_target(model), model, beam_width=3, beam_length=4)
    else:
        proposer = DraftProposer(noisy_copy(model, path, 0.01, seed=1), model, k=3)
    emulated_metal(monkeypatch)
    try:
        got, _, _ = run_steps(model, proposer, prompt, 10)
    finally:
        mx.enable_compile()
    assert got == ref, f"{kind} {method}, prompt {prompt}"


# ----------------------------------------------------------------------------- broken kernels


def broken(name: str, old: str, new: str, monkeypatch):
    """Kernel `name`'s Metal body with `old` (which it must contain) replaced by `new`."""
    source = kernels.kernel_source

    def patched(backend, kernel):
        body = source(backend, kernel)
        if kernel == name and backend == "metal":
            assert old in body
            body = body.replace(old, new, 1)
        return body

    monkeypatch.setattr(kernels, "kernel_source", patched)


def doctor_case(name: str) -> doctor.Case:
    return next(c for c in doctor.cases() if c.kernel == name)


BROKEN = {
    "flipped comparison": ("beam_topk_chunks", "if (v < V && xs[e] > tv[K - 1]) {", "if (v < V && xs[e] < tv[K - 1]) {", "kernel off"),
    "missing barrier": ("beam_topk_chunks", "red_s[i] = s;\nthreadgroup_barrier(mem_flags::mem_threadgroup);", "red_s[i] = s;\n",
                        "differs between two orders"),
    "device pointer to threadgroup memory": ("beam_topk_merge", "const float x = scores[b * WC + w] + (part_v[b * WC * CH * K + n] - lse[w]);",
                                             "const device float* norms = lse; const float x = scores[b * WC + w] + (part_v[b * WC * CH * K + n] - norms[w]);",
                                             "volatile"),
    "threadgroup array declared device": ("beam_topk_merge", "threadgroup float lse[K];", "device float lse[K];", "not a pointer"),
    "a CUDA spelling left": ("pack_beams", "threadgroup_barrier(mem_flags::mem_threadgroup);", "__syncthreads();", "reserved"),
}


@pytest.mark.kernel_failure
@pytest.mark.parametrize("what", sorted(BROKEN))
def test_broken_kernels_fail(metal, monkeypatch, what):
    """A deliberately broken copy of a kernel fails the doctor's check, the one the suite runs
    above, and for the reason it should: wrong results, a race between the two schedules, a
    compile error from the shim's address spaces, or the strictness check."""
    name, old, new, reason = BROKEN[what]
    broken(name, old, new, monkeypatch)
    result = doctor.check(doctor_case(name), "metal", repeats=1)
    assert not result.ok
    assert reason in result.problem


# ----------------------------------------------------------------------------- the fallback


@pytest.mark.kernel_failure
def test_a_kernel_that_does_not_build_falls_back_once(metal, monkeypatch, capsys):
    """A kernel whose source does not compile: one line on stderr naming it and the error, its
    reference's results, and no second attempt or message in the process."""
    broken("selective_scan", "const int c = thread_position_in_grid.x;", "const int c = thread_position_in_grid.x +;", monkeypatch)
    case = doctor_case("selective_scan")
    with kernels.references_only():
        want = case.run("metal")
    for _ in range(2):
        got = case.run("metal")
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.array(g), np.array(w))
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "selective_scan" in lines[0] and "does not compile" in lines[0]
    assert "selective_scan" in kernels.failures()


@pytest.mark.kernel_failure
@pytest.mark.parametrize("kind", ["llama", "hybrid"])
def test_every_kernel_failing_keeps_decoding_exact(target, tmp_path, monkeypatch, capsys, kind):  # noqa: F811
    """On a 'GPU' (kernel_backend says cuda) whose kernel builder raises, `kernels.load_kernel`'s
    kernels all fall back, inside compiled passes too: speculative greedy decoding (ReDrafter:
    beam steps, packing, tree attention, the fused step, acceptance) still gives plain greedy
    decoding's tokens, and each failed kernel is named once."""
    model = target[1]
    if kind == "hybrid":
        model = load_model(make_hybrid_dir(tmp_path / "h", ["attention", "mamba", "mamba2", "dsla"], seed=3)[0], "float32")
    [(prompt, ref)] = tie_free_references(model, 1, n=10, seed=2)
    proposer = ReDrafterProposer(drafter_like_target(model), model, beam_width=3, beam_length=4)

    def builder(**_):
        raise RuntimeError("nvrtc: error: this GPU compiles nothing")

    kernels.load_kernel.cache_clear()
    monkeypatch.setattr(mx.fast, "cuda_kernel", builder)
    for module in ROUTERS:
        monkeypatch.setattr(module, "kernel_backend", lambda: "cuda")
    monkeypatch.setattr(redrafter, "trims_padding", lambda: False)
    try:
        got, _, _ = run_steps(model, proposer, prompt, 10)
    finally:
        kernels.load_kernel.cache_clear()
    assert got == ref
    assert took_compiled_pass(model)  # the passes took the compiled route, the references inside it
    lines = capsys.readouterr().err.splitlines()
    named = [re.search(r"kernel (\w+) failed", line).group(1) for line in lines]
    assert len(named) == len(set(named)) and all("this GPU compiles nothing" in line for line in lines)
    assert set(named) >= {"tree_attention", "row_matmul", "beam_topk_chunks", "beam_topk_merge", "pack_beams", "greedy_accept"}
    assert ("ssm_step" in named) == ("dsla_step" in named) == (kind == "hybrid")


def test_the_cli_doctor_on_emulated_metal(metal, monkeypatch, capsys):
    """`hybrid doctor` on a 'Mac' (the emulator): the device lines, a row per kernel, exit 0."""
    from mlx_hybrid.cli import main as cli

    monkeypatch.setattr(kernels, "kernel_backend", lambda: "metal")
    monkeypatch.setattr(mx.fast, "metal_kernel", metal_emulator.metal_kernel)
    monkeypatch.setattr(doctor, "check", lambda case, backend, repeats=1, check=doctor.check: check(case, backend, repeats))
    monkeypatch.setattr(sys, "argv", ["hybrid", "doctor"])
    with pytest.raises(SystemExit) as done:
        cli.main()
    out = capsys.readouterr().out
    assert done.value.code == 0, out
    assert "simdgroup width  32" in out and "backend          metal" in out
    for name in LAUNCHES:
        assert re.search(rf"{name}\s+\d", out), out
