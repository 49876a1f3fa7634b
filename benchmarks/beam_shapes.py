#!/usr/bin/env python
"""Tokens per target pass of greedy ReDrafter for several beam shapes (width x length): how much a
wider or longer beam buys. Greedy acceptance depends on the weights, not on the device, so any
machine measures it; what a shape costs a pass is the device's (`hybrid tune` weighs both).

    python -m benchmarks.beam_shapes --model path/to/model --prompts 3 4x5 8x5 4x6 8x6 16x5
"""

import argparse
from pathlib import Path

from rich.console import Console

BENCH_DIR = Path(__file__).resolve().parent
from benchmarks.run import parse_beam  # noqa: E402
from benchmarks.speculative import CHAT_PROMPTS  # noqa: E402

from mlx_hybrid.chat import render_chat  # noqa: E402
from mlx_hybrid.sampling import SamplingParams  # noqa: E402
from mlx_hybrid.loader import load_model, load_tokenizer  # noqa: E402
from mlx_hybrid.profiles import Settings  # noqa: E402
from mlx_hybrid.speculative.proposer import load_proposer  # noqa: E402
from mlx_hybrid.speculative.steps import speculative_steps  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="target directory with redrafter/ beside it")
    p.add_argument("--prompts", type=int, default=3, help="held-out chat questions (chat_prompts.txt)")
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("beams", nargs="+", help="beam shapes, WIDTHxLENGTH")
    args = p.parse_args(argv)
    try:
        shapes = [parse_beam(beam) for beam in args.beams]
    except ValueError:
        p.error(f"beam shapes are WIDTHxLENGTH, e.g. 4x5 (got {' '.join(args.beams)})")
    if any(s[0] < 1 or s[1] < 2 for s in shapes):
        p.error("a beam is at least 1 wide and 2 long, as WIDTHxLENGTH")
    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    prompts = [render_chat(tokenizer, [{"role": "user", "content": q}])
               for q in CHAT_PROMPTS.read_text().splitlines()[: args.prompts]]
    console = Console()
    console.print(f"| beam | tokens / pass |\n| --- | ---: |")
    for width, length in shapes:
        proposer = load_proposer("redrafter", model, args.model, settings=Settings(width, length))
        tokens = passes = 0
        for prompt in prompts:
            got = 0
            steps = speculative_steps(model, proposer, prompt, model.make_cache(), SamplingParams())
            next(steps)  # the first pass reads the prompt
            for new, _ in steps:
                tokens, passes, got = tokens + len(new), passes + 1, got + len(new)
                if got >= args.gen_tokens:
                    break
            steps.close()
        console.print(f"| {width}x{length} | {tokens / passes:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
