"""The fused DSLA kernel (`mlx_hybrid.dsla_step`, metal_kernels/dsla_step.*) against its reference,
the DSLA mixer's unfused path, in both forms of the layer (this project's and DSLA-Serve's): a
decode step from an empty cache, a verification tree after a prefix (outputs, and both states
after every node), accepting a path, then decode steps from the accepted states.

On a GPU the kernel runs as MLX compiles it; on every machine its CUDA body also runs on the CPU
(tests/helpers/cuda_emulator.py). Tolerances are ssm_step's (tests/test_scan.py): the paths sum in
different orders, and the unfused one rounds q * scale and the mixed output to the model dtype.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten


from mlx_hybrid import dsla_step
from mlx_hybrid.cache import StateCache
from mlx_hybrid.convert.dsla_serve import FORM
from mlx_hybrid.models import hybrid
from mlx_hybrid.speculative.tree import path_to
from mlx_hybrid.tree_mask import TreeMask
from tests.helpers import cuda_emulator, metal_emulator
from tests.helpers.factories import GPU_BACKENDS

PARITY_TOL = {mx.float32: (1e-4, 1e-4), mx.bfloat16: (2e-2, 2e-2)}
# DSLA-Serve's form has as many K/V heads as query heads; this project's shares them (GQA).
FORMS = {
    "ours": {},
    "dsla-serve": FORM,
}
# Two roots, and a chain 0 -> 1 -> 3 -> 7 -> 8 that is accepted.
TREE = [-1, 0, 0, 1, 1, 2, -1, 3, 7, 6]
HIDDEN = 64
# (form, head_dim, heads, kv_heads, batch); head_dim 72 leaves threads of the last SIMD group idle.
GPU_SHAPES = [(form, d, h, kv if form == "ours" else h, b) for form in FORMS for d, h, kv in ((16, 4, 2), (64, 8, 2), (128, 4, 1), (72, 2, 2))
              for b in (1, 3)]
EMULATED_SHAPES = [("ours", 16, 4, 2, 2), ("dsla-serve", 72, 2, 2, 1)]


def dsla_layer(form: str, head_dim: int, heads: int, kv_heads: int, dtype, seed: int) -> hybrid.DSLA:
    """A DSLA mixer with random weights: gates from fast to slow forgetting, a few so negative
    that the clamp (DSLA-Serve's form) bounds them."""
    args = hybrid.ModelArgs(
        model_type="llama_hybrid", hidden_size=HIDDEN, num_hidden_layers=1, intermediate_size=64, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=8, mixer_types=["dsla"], d_xb=HIDDEN, dsla_kv_heads=kv_heads, **FORMS[form],
    )
    layer = hybrid.DSLA(args)
    rng = np.random.default_rng(seed)
    params = []
    for name, p in tree_flatten(layer.parameters()):
        if name in ("gamma", "alpha_list"):
            value = rng.uniform(0.1, 0.9, p.shape) if name == "gamma" else rng.normal(0, 1, p.shape)
        elif name == "o_norm.weight":
            value = 1 + 0.3 * rng.standard_normal(p.shape)
        elif name.endswith("bias"):  # gate biases: logsigmoid(bias) / 16 from -0.3 to ~0, a few far below -50
            value = rng.uniform(-5, 6, p.shape)
            value[rng.random(p.shape) < 0.05] = -2000.0
        else:
            value = rng.normal(0, p.shape[1] ** -0.5, p.shape)
        params.append((name, mx.array(value.astype(np.float32)).astype(mx.float32 if name in ("gamma", "alpha_list") else dtype)))
    layer.update(tree_unflatten(params))
    return layer


def check_against_unfused(dtype, backend: str, install, monkeypatch, shapes) -> float:
    """Each layer with the kernel (`install()` routes it there) against its unfused path; returns
    the largest difference seen."""
    atol, rtol = PARITY_TOL[dtype]
    worst = 0.0
    path = path_to(TREE, 8)
    for form, head_dim, heads, kv_heads, batch in shapes:
        layer = dsla_layer(form, head_dim, heads, kv_heads, dtype, head_dim + heads + batch)
        u = mx.array(np.random.default_rng(batch).standard_normal((batch, 5 + len(TREE) + 2, HIDDEN)).astype(np.float32)).astype(dtype)
        case = f"{dtype} {form} head_dim={head_dim} heads={heads}/{kv_heads} batch={batch}"

        def compare(got, want, what):
            nonlocal worst
            got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
            np.testing.assert_allclose(got, want, atol=atol, rtol=rtol, err_msg=f"{case}: {what}")
            worst = max(worst, float(np.abs(got - want).max()))

        def both(tokens, fused, ref, tree=None):
            install()
            y = layer(tokens, tree, fused)
            monkeypatch.setattr(hybrid, "kernel_backend", lambda: None)
            return y, layer(tokens, tree, ref)

        fused, ref = StateCache(), StateCache()
        with mx.stream(mx.gpu if backend == "gpu" else mx.cpu):
            compare(*both(u[:, :1], fused, ref), "decode step from an empty cache")
            layer(u[:, 1:5], cache=ref)
            fused.arrays, fused.offset = list(ref.arrays), ref.offset
            compare(*both(u[:, 5 : 5 + len(TREE)], fused, ref, TreeMask.from_parents(TREE)), "tree outputs")
            for node in range(len(TREE)):
                for got, want, what in zip(fused._after(node), ref._after(node), ("state 1", "state 2")):
                    compare(got, want, f"{what} after node {node}")
            for c in (fused, ref):
                c.commit(path)
            for t in range(5 + len(TREE), u.shape[1]):
                compare(*both(u[:, t : t + 1], fused, ref), f"decode step after the accepted path, token {t}")
                for got, want, what in zip(fused.arrays, ref.arrays, ("state 1", "state 2")):
                    compare(got, want, f"{what} after token {t}")
    return worst


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_kernel_matches_unfused_path(backend, dtype, monkeypatch):
    worst = check_against_unfused(dtype, "gpu", lambda: monkeypatch.setattr(hybrid, "kernel_backend", lambda: backend),
                                  monkeypatch, GPU_SHAPES)
    print(f"\n{backend} dsla_step {dtype}: {len(GPU_SHAPES)} shapes, max |fused - unfused| {worst:.3g}")


# Kernel bodies run on the CPU by an emulator with `mlx_hybrid.kernels.load_kernel`'s signature.
EMULATORS = {"cuda": cuda_emulator, "metal": metal_emulator}


@pytest.mark.parametrize(
    "body,dtype", [pytest.param(name, dtype, marks=pytest.mark.skipif(not m.AVAILABLE, reason=f"the {name} body cannot be run on this CPU"))
                   for name, m in EMULATORS.items()
                   for dtype in ([mx.float32] if name == "cuda" else [mx.float32, mx.bfloat16])]  # the CUDA emulator reads float32
)
def test_kernel_body_on_the_cpu_matches_unfused_path(body, dtype, monkeypatch):
    """The GPU test above on every machine: the DSLA mixer calls `dsla_step`, whose body runs on
    the CPU (the Metal body also in bfloat16, as the GPU test runs it)."""

    def emulated():
        monkeypatch.setattr(hybrid, "kernel_backend", lambda: body)
        monkeypatch.setattr(dsla_step, "load_kernel", EMULATORS[body].load_kernel)

    check_against_unfused(dtype, "cpu", emulated, monkeypatch, EMULATED_SHAPES)
