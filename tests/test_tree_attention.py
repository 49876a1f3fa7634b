"""Tree attention: the MLX reference and the CUDA kernel body (run on the CPU by
tests/helpers/cuda_emulator.py) against float64 numpy attention over each node's visible rows, the GPU
kernels against the reference, and a Llama verification pass with and without the kernel.

The kernel parity tests call `tree_attention` with an explicit backend, so that a machine without
the kernel skips them instead of comparing the reference to itself.
"""

from importlib import resources

from tests.helpers import cuda_emulator
import mlx.core as mx
import numpy as np
import pytest
from tests.helpers.factories import GPU_BACKENDS, make_hf_model_dir

from mlx_hybrid.kernels import float_bits, kernel_backend
from mlx_hybrid.loader import load_model
from mlx_hybrid.rope import apply_rope_at, rope_frequencies
from mlx_hybrid.tree_mask import TreeMask, ancestor_mask, tree_depths
from mlx_hybrid.tree_attention import launch, tree_attention, tree_attention_ref

# Parent-before-child order: a Medusa-like tree, a chain, and a packed beam whose last two nodes
# are padding roots (parent -1, reached by no beam).
TREES = {
    "tree": [-1, 0, 0, 0, 1, 1, 2, 4, 4, 7, 3, 10, 5],
    "chain": [-1, 0, 1, 2, 3, 4],
    "beam": [-1, 0, 1, 2, 0, 4, 5, 1, 7, -1, -1],
}
# (query heads, KV heads, head size, rows before the tree): grouped queries, no cache at all, a
# head size that does not fill the 32 lanes, and a cache longer than a threadgroup's rows.
SHAPES = [(9, 3, 64, 37), (4, 4, 128, 0), (2, 1, 16, 300), (4, 2, 96, 5)]
# RoPE as the model gives it: SmolLM2's theta, and Llama 3.1's scaled frequencies for head size 128.
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def rope_case(parents, D, prefix, seed):
    """Each node's position (past a cache that starts far back, so angles are large) and freqs."""
    depths = [0] * len(parents)
    for t, p in enumerate(parents):
        depths[t] = 0 if p < 0 else depths[p] + 1
    offset = 1000 + 37 * seed + prefix
    freqs = np.array(rope_frequencies(D, 100000.0, LLAMA3 if D == 128 else None))
    return np.array(depths, np.int32) + offset, freqs.astype(np.float32)


def numpy_rope(x, positions, freqs):
    """x (1, heads, T, D) with node t turned at positions[t] (non-traditional RoPE), float64 but
    for the angle, a float32 product as RoPE's (at angles near 1000 a float32 ulp is 6e-5)."""
    half = x.shape[-1] // 2
    angle = (positions[:, None].astype(np.float32) * (np.float32(1) / freqs[None])).astype(np.float64)  # (T, half)
    cos, sin = np.cos(angle), np.sin(angle)
    a, b = x[..., :half].astype(np.float64), x[..., half:].astype(np.float64)
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def make_case(parents, H, KV, D, prefix, seed, extra=3):
    """Queries and the tree's keys and values as RoPE leaves them, a (T, heads, D) buffer seen as
    (1, heads, T, D) (`tk_buffer`, `tv_buffer`); the cache's keys and values in a buffer with
    spare rows past the prefix (stale rows, which no node may see), as `KVCache` holds them."""
    rng = np.random.default_rng(seed)
    T = len(parents)
    q_buffer = rng.standard_normal((T, H, D)).astype(np.float32)
    k = rng.standard_normal((1, KV, prefix + T + extra, D)).astype(np.float32)
    v = rng.standard_normal((1, KV, prefix + T + extra, D)).astype(np.float32)
    tk_buffer = rng.standard_normal((T, KV, D)).astype(np.float32)
    tv_buffer = rng.standard_normal((T, KV, D)).astype(np.float32)
    return q_buffer, k, v, tk_buffer, tv_buffer


def seen(buffer):
    """A (T, heads, D) buffer as the (1, heads, T, D) array the kernel reads."""
    return buffer.transpose(1, 0, 2)[None]


def numpy_attention(q, k, v, tk, tv, parents, prefix, scale, positions, freqs):
    """float64: q and tk turned by RoPE, node t attends to cache rows 0..prefix-1 and to the tree
    rows of t and its ancestors. Returns the output and the turned tree keys."""
    q, tk = numpy_rope(q, positions, freqs), numpy_rope(tk, positions, freqs)
    _, H, T, D = q.shape
    R = H // k.shape[1]
    out = np.zeros((1, T, H, D))
    for t in range(T):
        nodes, n = [], t
        while n >= 0:
            nodes.append(n)
            n = parents[n]
        for h in range(H):
            keys = np.concatenate([k[0, h // R, :prefix], tk[0, h // R, nodes]]).astype(np.float64)
            values = np.concatenate([v[0, h // R, :prefix], tv[0, h // R, nodes]])
            s = keys @ q[0, h, t] * scale
            p = np.exp(s - s.max())
            out[0, t, h] = (p / p.sum()) @ values
    return out, tk


def test_reference_matches_numpy():
    for name, parents in TREES.items():
        for i, (H, KV, D, prefix) in enumerate(SHAPES):
            q_buffer, k, v, tk_buffer, tv_buffer = make_case(parents, H, KV, D, prefix, seed=i)
            q, tk, tv = seen(q_buffer), seen(tk_buffer), seen(tv_buffer)
            positions, freqs = rope_case(parents, D, prefix, seed=i)
            with mx.stream(mx.cpu):  # exact float32: MLX's CUDA backend multiplies float32 in TF32
                visible = mx.array(ancestor_mask(parents))
                got = tree_attention_ref(*map(mx.array, (q, k, v, tk, tv)), visible, prefix, D**-0.5, mx.array(positions), mx.array(freqs))
            want = numpy_attention(q, k, v, tk, tv, parents, prefix, D**-0.5, positions, freqs)
            for g, w in zip(got, want):  # the output, the turned keys
                np.testing.assert_allclose(np.array(g), w, atol=1e-5, err_msg=f"{name} {H}/{KV} heads, D={D}, prefix {prefix}")


@pytest.mark.skipif(not cuda_emulator.AVAILABLE, reason="g++ not found: the CUDA body cannot be run on the CPU")
def test_cuda_body_on_the_cpu_matches_numpy():
    """What the GPU parity test checks on CUDA, on every machine: indexing (strided queries, grouped
    heads, cache rows past the tree), the parent walk, the per-warp online softmax and the merge."""
    body = resources.files("mlx_hybrid.metal_kernels").joinpath("tree_attention.cu").read_text()
    cases = [("tree", SHAPES[0]), ("beam", SHAPES[1]), ("chain", SHAPES[2]), ("tree", SHAPES[3])]
    for i, (name, (H, KV, D, prefix)) in enumerate(cases):
        parents = TREES[name]
        T = len(parents)
        q_buffer, k, v, tk_buffer, tv_buffer = make_case(parents, H, KV, D, prefix, seed=10 + i)
        S = k.shape[2]
        positions, freqs = rope_case(parents, D, prefix, seed=10 + i)
        template, groups, threads = launch(H, KV, T, D, mx.float32)
        got = cuda_emulator.run(
            body,
            inputs=[
                ("q", q_buffer, (T * H * D, D, H * D, 1)),  # (1, H, T, D) over a (T, H, D) buffer
                ("k", k, (KV * S * D, S * D, D, 1)),
                ("v", v, (KV * S * D, S * D, D, 1)),
                ("tk", tk_buffer, (T * KV * D, D, KV * D, 1)),  # (1, KV, T, D) over a (T, KV, D) buffer
                ("tv", tv_buffer, (T * KV * D, D, KV * D, 1)),
                ("parents", np.array(parents, np.int32), None),
                ("node_rows", prefix + tree_depths(parents), None),
                ("positions", positions, None),
                ("freqs", freqs, None),
            ],
            outputs=[("out", (1, T, H, D)), ("rk", (1, KV, T, D))],
            template=[(k, "float" if k == "T" else v) for k, v in template] + [("SCALE", float_bits(D**-0.5))],
            blocks=groups,
            threads=threads,
        )
        want = numpy_attention(seen(q_buffer), k, v, seen(tk_buffer), seen(tv_buffer), parents, prefix, D**-0.5, positions, freqs)
        for g, w in zip(got, want):  # the output, the turned keys
            np.testing.assert_allclose(g, w, atol=1e-5, err_msg=f"{name} {H}/{KV} heads, D={D}, prefix {prefix}")


# Half types: the kernel accumulates in float32 and rounds the output to the half type once, as
# the float32 reference is rounded (fp16 2**-11, bf16 2**-8 relative); outputs are O(1).
PARITY_TOL = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}


def check_parity(backend, dtype, cases=None, device=mx.gpu):
    """The kernel against the reference for each (tree name, index into SHAPES) of cases (default:
    every tree at every shape), on device (the CPU runs the Metal emulator)."""
    worst = 0.0
    for name, parents in TREES.items():
        for i, (H, KV, D, prefix) in enumerate(SHAPES):
            if cases is not None and (name, i) not in cases:
                continue
            q_buffer, k, v, tk_buffer, tv_buffer = make_case(parents, H, KV, D, prefix, seed=i)
            positions, freqs = (mx.array(a) for a in rope_case(parents, D, prefix, seed=i))
            with mx.stream(device):
                # strided, as out of the projection; the cache's whole buffer, stale rows included
                q, tk, tv = (mx.array(b).astype(dtype).swapaxes(0, 1)[None] for b in (q_buffer, tk_buffer, tv_buffer))
                keys, values = mx.array(k).astype(dtype), mx.array(v).astype(dtype)
                got = tree_attention(q, keys, values, tk, tv, mx.array(parents, mx.int32), mx.array(prefix + tree_depths(parents)),
                                     positions, freqs, scale=D**-0.5, backend=backend)
            # The queries and keys turned by MLX's RoPE in the dtype (rounded to it, as the kernel
            # rounds them), then attention on the same rounded inputs in exact float32 (the CPU
            # stream: MLX's CUDA backend multiplies float32 in TF32, and the CPU's half-type
            # attention rounds every step; position 0 turns nothing), rounded once.
            with mx.stream(mx.cpu):
                q, tk = (apply_rope_at(a.transpose(2, 1, 0, 3), freqs, positions).transpose(2, 1, 0, 3) for a in (q, tk))
                arrays = (mx.array(np.array(a.astype(mx.float32))) for a in (q, keys, values, tk, tv))
                out, _ = tree_attention_ref(*arrays, mx.array(ancestor_mask(parents)), prefix, D**-0.5, mx.zeros_like(positions), freqs)
            # turned keys: the kernel's float32 cos and sin may round a key the other way (1 ulp, up to 4 PARITY_TOL at |key| < 8)
            for g, w, what, tol in zip(got, (out.astype(dtype), tk), ("output", "turned keys"), (PARITY_TOL[dtype], 4 * PARITY_TOL[dtype])):
                g, w = np.array(g.astype(mx.float32)), np.array(w.astype(mx.float32))
                np.testing.assert_allclose(g, w, atol=tol, err_msg=f"{dtype} {what} {name} {H}/{KV} heads, D={D}, prefix {prefix}")
                worst = max(worst, float(np.abs(g - w).max()))
    print(f"\n{backend} {dtype}: max |kernel - reference| {worst:.3g}")


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_kernel_matches_reference(backend, dtype):
    check_parity(backend, dtype)


@pytest.mark.skipif(kernel_backend() is None, reason="no GPU kernel backend (Metal or MLX CUDA) on this device")
def test_verification_pass_with_kernel_matches_reference(tmp_path, monkeypatch):
    """A Llama target's logits over a candidate tree after a prompt, through the kernel in every
    layer and through MLX's masked attention. Same model and inputs, so only the attention's
    summation order differs; the matmuls around it (TF32 on MLX's CUDA backend, see
    test_hybrid_runtime) may amplify that: |diff| <= 1e-2 * max|logit| and equal argmax."""
    from mlx_hybrid.models import llama

    model = load_model(make_hf_model_dir(tmp_path / "m", tokenizer=False, hidden_size=128, num_attention_heads=4))
    parents = TREES["tree"]
    tokens = mx.array([[5, 17, 42, 9, 33, 21, 7, 60, 11, 3, 8, 2, 19]])

    def verify():
        cache = model.make_cache()
        model(mx.array([[1, 4, 9, 16, 25, 36, 49, 64, 81, 100] * 3]), cache)
        return np.array(model(tokens, cache, mask=TreeMask.from_parents(parents)))

    with_kernel = verify()
    monkeypatch.setattr(llama, "tree_kernel", lambda *args: None)
    reference = verify()
    diff = np.abs(with_kernel - reference).max()
    print(f"max |kernel - reference| logit difference: {diff:.3g} (max |logit| {np.abs(reference).max():.3g})")
    assert diff <= 1e-2 * np.abs(reference).max()
    assert (with_kernel.argmax(-1) == reference.argmax(-1)).all()
