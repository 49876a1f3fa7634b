"""Speculative decoding: Medusa heads, a ReDrafter drafter or a draft model propose tokens, and the
target verifies them in one forward pass (candidate trees: `tree`). Formats: FORMAT.md."""
