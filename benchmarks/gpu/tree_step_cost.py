"""What a verification pass over n tree nodes costs on a hybrid target against a Llama of the same
shape, and the Mamba2 tree step alone: random weights in SmolLM2-135M's shape (bfloat16), 256
context tokens, trees of 1 + w chains of 5 below the root (ReDrafter's wx5 beams, none shared),
each timing the median of 30 synchronous runs in ms. Prints JSON.

    python -m benchmarks.gpu.tree_step_cost > tree-step-cost.json
"""

import argparse
import json
import mlx.core as mx

from benchmarks.run import SYNTHETIC, median_eval_ms

from mlx_hybrid.kernels import kernel_backend
from mlx_hybrid.models import hybrid
from mlx_hybrid.speculative.verify import verify
from mlx_hybrid.tree_mask import TreeMask


def ms(fn, reps=30):
    return round(median_eval_ms(fn, reps), 3)


def beams(width: int, length: int = 5) -> list[int]:
    parents = [-1]
    for _ in range(width):
        parents += [0] + [len(parents) + i for i in range(length - 1)]
    return parents


argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
shape = SYNTHETIC["smollm2-135m"]
n = shape["num_hidden_layers"]
out = {"backend": kernel_backend(), "passes": {}, "mamba2_step": {}}
for name, kinds in (("llama", ["attention"] * n), ("hybrid", ["attention" if i % 2 == 0 else "mamba2" for i in range(n)])):
    model = hybrid.Model(hybrid.ModelArgs(model_type="llama_hybrid", mixer_types=kinds, d_state=64, **shape))
    model.set_dtype(mx.bfloat16)
    cache = model.make_cache()
    mx.eval(model(mx.random.randint(0, 1000, (1, 256)), cache))
    rows = {"decode step": ms(lambda: model(mx.array([[7]]), cache))}
    for width in (2, 4):
        parents = beams(width)
        tokens = mx.random.randint(0, 1000, (1, len(parents)))
        tree = TreeMask.from_parents(parents)
        offset = cache[0].offset
        placed = tree.at(mx.array([offset], mx.int32), offset)
        rows[f"{width}x5 ({len(parents)} nodes) compiled"] = ms(lambda: verify(model, tokens, cache, placed))
        rows[f"{width}x5 ({len(parents)} nodes) eager"] = ms(lambda: model(tokens, cache, mask=tree))
    out["passes"][name] = rows
    if name == "hybrid" and kernel_backend():
        layer = model.layers[1]
        window, state = cache[1].arrays
        for nodes in (1, 11, 21):
            u = mx.random.normal((1, nodes, shape["hidden_size"])).astype(mx.bfloat16)
            parents = mx.array(beams(2 if nodes == 11 else 4)[:nodes] if nodes > 1 else [-1], mx.int32)
            out["mamba2_step"][f"{nodes} nodes"] = ms(lambda: layer.mixer.kernel_step(u, window, state, parents, kernel_backend()))
print(json.dumps(out, indent=1))
