"""Speculative decoding: Medusa heads, a ReDrafter drafter or a draft model propose tokens, and the
target verifies them in one forward pass (candidate trees: `tree`). Formats: docs/formats/speculative-heads.md.

    from mlx_hybrid import load
    from mlx_hybrid.speculative import load_proposer, speculative_generate

    model, tokenizer = load("path/to/model")
    proposer = load_proposer("medusa", model, "path/to/model")  # reads path/to/model/medusa/
    for r in speculative_generate(model, tokenizer, "Hello", proposer, max_tokens=64):
        print(r.text, end="")
    print(r.tokens_per_step, r.acceptance_rate)
"""

from mlx_hybrid.speculative.generate import SpeculativeResponse, load_proposer, speculative_generate

__all__ = ["SpeculativeResponse", "load_proposer", "speculative_generate"]
