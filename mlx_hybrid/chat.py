"""A multi-turn conversation whose history stays in the KV cache between turns.

Each turn renders the whole conversation with the tokenizer's chat template, keeps the cached
prefix it shares with the new rendering and prefills only the rest, so a long chat does not
re-read its history every turn.

A model with DSLA weights (or any model given a memory budget) runs each turn with as many
layers as DSLA as the conversation so far plus max_tokens need to fit the budget
(`mlx_hybrid.adaptive`); when a turn needs more than the history ran with, the history is
re-read once with the new conversion, since a layer's DSLA state cannot come from its KV cache.

A recurrent state (Mamba, Mamba2, DSLA) cannot be trimmed token by token, so the session keeps a
snapshot of every layer's cache (`Cache.snapshot`) at the last point it knows to be consistent
before the reply: the end of each prefill chunk, up to the prompt but its last token (where a
re-rendered reply may start to differ). A turn that must go back before the cache's end (the
re-rendered reply differs from the tokens generated, or an interrupt left the layers at different
offsets) trims where every layer can, else restores that snapshot and reads again only the
tokens after it: the prompt's last token and the last reply. The history is read again only when
neither reaches: a DSLA conversion change, a sliding window that dropped the keys, an edit of
earlier messages (`messages` may be replaced between turns); such a turn reports it through
`on_reread`.
"""

from itertools import chain
from typing import Callable, Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlx_hybrid import template
from mlx_hybrid.adaptive import ConversionPolicy, Plan, cache_nbytes, is_adaptive
from mlx_hybrid.cache import rewind
from mlx_hybrid.decode import common_prefix
from mlx_hybrid.errors import HybridError
from mlx_hybrid.generate import GenerationResponse, context_limit, stream_generate
from mlx_hybrid.limits import clip_max_tokens
from mlx_hybrid.sampling import SamplingParams


def render_chat(tokenizer, messages: list[dict], context: int | None = None, add_generation_prompt: bool = True) -> list[int]:
    """The prompt tokens of a conversation, ending where the assistant speaks (unless
    add_generation_prompt is False): the tokenizer's chat template, rendered with time and size
    limits (`mlx_hybrid.template`; context: the model's, in tokens), mlx-lm's own renderer for the
    families it has one for, or "role: content" lines for a tokenizer without a template."""
    if tokenizer.chat_template is None:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant: " if add_generation_prompt else "")
        return tokenizer.encode(text)
    if getattr(tokenizer, "_chat_template", None) is not None:  # mlx-lm's Python renderer: library code
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) else out)
    return tokenizer.encode(template.render(tokenizer, messages, context, add_generation_prompt), add_special_tokens=False)


class ChatSession:
    def __init__(
        self, model: nn.Module, tokenizer: TokenizerWrapper, system: str | None = None, memory_budget=None,
        speculator=None, on_reread: Callable[[int, int], None] | None = None,
    ):
        """speculator: replies use speculative decoding with it (`mlx_hybrid.speculative.load_proposer`).

        on_reread(done, total): a turn reads again history its cache lost (module docstring);
        total is the tokens the turn reads before replying, done those read so far: (0, total)
        first, then after each chunk of 512. An exception it raises (or a Ctrl-C) stops the turn
        with the history unchanged; the cache keeps the chunks read, and the next turn reads the rest."""
        self.model, self.tokenizer, self.system = model, tokenizer, system
        self.speculator, self.on_reread = speculator, on_reread
        adaptive = memory_budget is not None or is_adaptive(model)
        self.policy = ConversionPolicy(model, memory_budget) if adaptive else None
        self.plan: Plan | None = None  # the last turn's plan
        self._reply = None  # the reply being streamed, until it is closed
        self.reset()

    def reset(self):
        """Forget the conversation (the system prompt stays)."""
        self._close_reply()
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.dsla_layers: list[int] = []  # layers the cache runs as DSLA
        self.cache = self._new_cache()
        self.tokens: list[int] = []  # exactly the tokens whose keys/values the cache holds
        self._snapshot: tuple[int, list] | None = None  # (n, every layer's snapshot) after self.tokens[:n]
        self._reply_start = 0  # tokens before the last reply: a cache that keeps fewer means a re-read

    @property
    def context_used(self) -> int:
        return len(self.tokens)

    @property
    def context_limit(self) -> int | None:
        return context_limit(self.model)

    @property
    def cache_bytes(self) -> int:
        """Memory the conversation's caches (KV and recurrent states) hold now."""
        return cache_nbytes(self.cache)

    def _new_cache(self) -> list:
        return self.model.make_cache(self.dsla_layers) if self.dsla_layers else self.model.make_cache()

    def render(self, messages: list[dict]) -> list[int]:
        return render_chat(self.tokenizer, messages, self.context_limit)

    def send(
        self, text: str, max_tokens: int = 512, sampling: SamplingParams | None = None
    ) -> Iterator[GenerationResponse]:
        """Stream the assistant's reply to text. Closing the iterator early keeps the partial reply.

        One reply at a time: a reply still open when the next `send` or `reset` comes (its
        consumer stopped reading or raised) is closed first, so the history always alternates
        user, assistant. The history changes only when a reply ends, in one step. Turns may
        come from different threads; read and close each reply on one thread (MLX binds the
        reply's stream to the thread that started it)."""
        self._close_reply()
        self._reply = self._turn(text, max_tokens, sampling)
        return self._reply

    def _close_reply(self):
        reply, self._reply = self._reply, None
        if reply is not None:
            try:
                reply.close()
            except ValueError:  # "generator already executing": another thread is reading it
                self._reply = reply
                raise HybridError("this ChatSession is replying in another thread; it takes one reply at a time") from None

    def _turn(self, text: str, max_tokens: int, sampling: SamplingParams | None) -> Iterator[GenerationResponse]:
        if any(c.offset != len(self.tokens) for c in self.cache):  # an interrupt landed in the last turn's cleanup
            self._sync(self.tokens)
        prompt = self.render(self.messages + [{"role": "user", "content": text}])
        keep = min(common_prefix(self.tokens, prompt), len(prompt) - 1)
        if self.policy:
            self.plan = self.policy.plan(len(prompt), clip_max_tokens(max_tokens, self.model, len(prompt)))
            if len(self.plan.dsla_layers) > len(self.dsla_layers):  # convert more: re-read the history
                self.dsla_layers = self.plan.dsla_layers
                self.cache, self._snapshot, keep = self._new_cache(), None, 0
        keep = self._rewind(keep)
        self.tokens = prompt[:keep]
        self._snapshot = (keep, [c.snapshot() for c in self.cache])
        replies = stream_generate(
            self.model, self.tokenizer, prompt[keep:], max_tokens=max_tokens, sampling=sampling, cache=self.cache,
            history=self.tokens, speculator=self.speculator,
            progress=self._reading(prompt, keep, reread=keep < min(self._reply_start, len(prompt) - 1)),
        )
        try:
            first = next(replies)
        except BaseException:  # prompt rejected, or Ctrl-C during prefill: history unchanged
            self._sync(prompt)
            raise
        reply, generated = "", []
        try:
            for r in chain([first], replies):
                reply += r.text
                generated.append(r.token)
                yield r
        finally:
            # One assignment: an interrupt cannot land between the user's message and the reply.
            self.messages = self.messages + [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
            self._reply_start = len(prompt) - 1
            replies.close()
            self._sync(prompt + generated)

    def _reading(self, prompt: list[int], keep: int, reread: bool) -> Callable[[int, int], None]:
        """stream_generate's progress for a prompt read from prompt[keep]: after each chunk every
        layer holds prompt[:keep + done], the newest point an interrupt can return to."""

        def progress(done: int, total: int):
            if done:
                self.tokens = prompt[: keep + done]
                self._snapshot = (keep + done, [c.snapshot() for c in self.cache])
            if reread and self.on_reread:
                self.on_reread(done, total)

        return progress

    def _rewind(self, n: int) -> int:
        """`cache.rewind` to the snapshot, else to an empty cache; the tokens it holds then."""
        held = rewind(self.cache, n, self._snapshot)
        if held is None:
            self.cache, self._snapshot, held = self._new_cache(), None, 0
        return held

    def _sync(self, fed: list[int]):
        """Make the cache hold a prefix of `fed` in every layer (an interrupt can land between layers)."""
        n = self._rewind(min([len(fed)] + [c.offset for c in self.cache]))
        self.tokens = fed[:n]
        mx.eval([c.state for c in self.cache])  # nothing left lazy: the next turn may run on another thread
