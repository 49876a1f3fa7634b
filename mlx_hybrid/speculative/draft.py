"""Draft-model speculation: a small model (Llama or hybrid) drafts K tokens, the target checks them.

The draft keeps its own cache across steps and across chat turns. After a step it must forget the
drafts the target rejected: a KV cache is trimmed; a recurrent state cannot be, so the draft
returns to the snapshot taken once it has read the target's tokens, before its first draft, and
re-reads the accepted drafts in the next step's first forward pass, together with the new token
(the hybrid-draft scheme of "The Mamba in the Llama", section 5.5).
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_hybrid.cache import commit, rewind
from mlx_hybrid.decode import common_prefix, prefill
from mlx_hybrid.errors import HybridError
from mlx_hybrid.limits import check_draft_count
from mlx_hybrid.sampling import SamplingParams
from mlx_hybrid.speculative.accept import Candidates, target_logprobs
from mlx_hybrid.tree_mask import TreeMask


class DraftProposer:
    name = "draft"
    drafts_on_device = False

    def __init__(self, draft: nn.Module, target: nn.Module, k: int = 4):
        check_draft_count(k, target)
        if draft.args.vocab_size < target.args.vocab_size:
            raise HybridError(
                f"the draft model's vocabulary ({draft.args.vocab_size}) is smaller than the target's ({target.args.vocab_size})"
            )
        self.model, self.k = draft, k
        self.vocab = target.args.vocab_size
        self.depth = k
        self.cache = draft.make_cache()
        self.fed: list[int] = []  # exactly the tokens the draft cache holds
        self._snap = None  # (len(fed), per-layer snapshot) after the last step's first forward

    def _rewind(self, keep: int):
        """Make the cache hold fed[:keep]."""
        if keep == len(self.fed):
            return
        keep = rewind(self.cache, keep, self._snap)
        if keep is None:
            self.cache, keep = self.model.make_cache(), 0
        self.fed = self.fed[:keep]

    def _logits(self, x: mx.array) -> mx.array:
        """The draft's next-token logits after reading tokens x (n,). Several tokens (a step's
        re-read, at most k + 1) go in as a chain of tree nodes: MLX's CUDA attention builds a cuDNN
        plan for each new key length of a query of several tokens (50-160 ms on the H100,
        benchmarks/README.md), the tree kernel none."""
        if x.shape[0] == 1:
            return self.model(x[None], self.cache)[0, -1]
        logits = self.model(x[None], self.cache, mask=TreeMask.chain(x.shape[0]))[0, -1]
        commit(self.cache, list(range(x.shape[0])))
        return logits

    def propose(self, history: list[int], hidden: mx.array, sampling: SamplingParams) -> Candidates:
        self._rewind(common_prefix(self.fed, history[:-1]))
        pending = history[len(self.fed) :]
        if len(pending) > self.k + 1:  # a prompt (a re-read is at most k + 1 tokens): read as prompts are
            prefill(self.model, mx.array(pending[:-1]), self.cache)
            self.fed, pending = self.fed + pending[:-1], pending[-1:]
        x = mx.array(pending)
        tokens, logq = [], []
        for i in range(self.k):
            logits = self._logits(x)[: self.vocab].astype(mx.float32)
            if i == 0:  # the target's tokens read, no draft yet: what a rejection returns to
                self._snap = (len(self.fed) + len(pending), [c.snapshot() for c in self.cache])
            if sampling.temp == 0:
                x = mx.argmax(logits, axis=-1, keepdims=True)
            else:
                lq = target_logprobs(logits, sampling)
                x = mx.random.categorical(lq, num_samples=1)
                logq.append(lq)
            tokens.append(x)
        drafted = np.array(mx.concatenate(tokens)).tolist()
        self.fed = self.fed + pending + drafted[:-1]
        q = None
        if logq:
            q = np.exp(np.array(mx.stack(logq), np.float64))
            q = np.concatenate([q, np.zeros((1, q.shape[1]))])  # the last draft has nothing below it
        return Candidates(np.array([history[-1]] + drafted), list(range(-1, self.k)), q=q)
