"""Speculative decoding: Medusa heads, a ReDrafter drafter or a draft model propose tokens, and the
target verifies them in one forward pass over a candidate tree. Formats: docs/formats/speculative-heads.md.

    from mlx_hybrid import load, stream_generate
    from mlx_hybrid.speculative import load_proposer

    model, tokenizer = load("path/to/model")
    proposer = load_proposer("medusa", model, "path/to/model")  # reads path/to/model/medusa/
    for r in stream_generate(model, tokenizer, "Hello", max_tokens=64, speculator=proposer):
        print(r.text, end="")
    print(r.tokens_per_step, r.acceptance_rate)
"""

from mlx_hybrid.speculative.proposer import Proposer, load_proposer

__all__ = ["Proposer", "load_proposer"]
