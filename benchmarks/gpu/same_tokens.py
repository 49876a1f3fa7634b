"""Where ReDrafter's greedy tokens (beams 4x5 and 2x5) leave plain greedy decoding's on the first
three benchmark chat questions, and plain decoding's top-2 logit margin there: an exact or
one-step bfloat16 tie, or a real difference. In float32 they must not leave it.

    python -m benchmarks.gpu.same_tokens OUTDIR/hybrid-target [float32]
"""

import argparse
from pathlib import Path

import mlx.core as mx

from benchmarks.speculative import CHAT_PROMPTS  # noqa: E402

from mlx_hybrid.chat import render_chat  # noqa: E402
from mlx_hybrid.decode import generate_step  # noqa: E402
from mlx_hybrid.sampling import SamplingParams  # noqa: E402
from mlx_hybrid.loader import load_model, load_tokenizer  # noqa: E402
from mlx_hybrid.profiles import Settings  # noqa: E402
from mlx_hybrid.speculative.proposer import load_proposer  # noqa: E402
from mlx_hybrid.speculative.steps import speculative_steps  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("model", type=Path, help="a target with redrafter/")
p.add_argument("dtype", nargs="?", default=None, help="load the model in this dtype (default: as stored)")
args = p.parse_args()
model_dir, dtype = args.model, args.dtype
model = load_model(model_dir, dtype) if dtype else load_model(model_dir)
tok = load_tokenizer(model_dir)
N = 64
for w, l in ((4, 5), (2, 5)):
    proposer = load_proposer("redrafter", model, model_dir, settings=Settings(w, l))
    for q in CHAT_PROMPTS.read_text().splitlines()[:3]:
        prompt = render_chat(tok, [{"role": "user", "content": q}])
        ref = [t for t, _ in generate_step(mx.array(prompt), model, model.make_cache(), lambda x: mx.argmax(x, -1), max_tokens=N)]
        got = []
        for new, _ in speculative_steps(model, proposer, prompt, model.make_cache(), SamplingParams()):
            got += new
            if len(got) >= N:
                break
        got = got[:N]
        i = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
        if i is None:
            print(f"{w}x{l} same")
            continue
        logits = model(mx.array([prompt + ref[:i]]))[0, -1].astype(mx.float32)
        top = mx.sort(logits)[-2:].tolist()
        print(f"{w}x{l} differs at token {i}: plain {ref[i]}, speculative {got[i]}; plain decoding's logits for them "
              f"{logits[ref[i]].item():.4f} / {logits[got[i]].item():.4f}, its top-2 margin {top[1] - top[0]:.4f}")
