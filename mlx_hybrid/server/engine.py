"""The model worker: one thread owns the model, every cache and the prompt cache, and serves all
requests. MLX streams, and the arrays built on them, belong to the thread that made them, so the
model is loaded on this thread too; the HTTP layer only queues `Job`s and reads their events.

A job is read alone: the prompt cache gives the longest prefix it holds (`PromptCache.fetch`),
the rest of the prompt is prefilled and the first token is sampled and sent. Then the job joins
the batch (`mlx_hybrid.batch`): each step runs the next token of every running job through the
model in one pass, so new jobs join and finished ones leave between any two steps (continuous
batching). One queued job is admitted between two steps, so running jobs wait for at most one
prompt's prefill. The steps are pipelined as in `generate_step`: step n+1 is queued before the
host reads the tokens of step n, so each row has one token that is sampled but not yet fed
(`pending`).

With a speculator (`mlx_hybrid.speculative`) a job that runs alone decodes speculatively: one
sequence gains from verifying several drafted tokens a pass, while a batch is already wide. When
another job arrives the speculating one stops at the end of a verification pass, the point where
its caches hold exactly its tokens but the last (a recurrent state cannot be rewound), and
rejoins the batch; when the batch shrinks to one job that job speculates again.

A finished job's caches go to the prompt cache. For a hybrid model, whose recurrent states can
only be continued, never cut back, the prefill also leaves snapshots there: after the system
prompt (other conversations share it) and after all of the prompt but its last token (the next
turn of a chat continues the prompt even where the reply re-tokenizes differently).
"""

import queue
import threading
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from mlx_hybrid.batch import Batch
from mlx_hybrid.cache import StateCache
from mlx_hybrid.chat import render_chat
from mlx_hybrid.decode import common_prefix, generation_stream, prefill
from mlx_hybrid.generate import TextStream, context_limit, stream_generate
from mlx_hybrid.sampling import SamplingParams
from mlx_hybrid.prompt_cache import PromptCache, copy_cache


@dataclass
class Job:
    """One request. Exactly one of messages (chat) and prompt (text or token ids) is set; the
    worker answers through send: `Started`, then text pieces (str), then `Finished`, or a `Failed`
    at any point. Setting `cancelled` stops the job at its next step and frees its caches."""

    send: Callable[[object], None]
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
    max_tokens: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    stop: list[str] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class Started:
    prompt_tokens: int
    cached_tokens: int  # of the prompt, read from the prompt cache


@dataclass
class Finished:
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class Failed:
    status: int  # HTTP status
    message: str
    param: str | None = None
    code: str | None = None


class RequestError(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.failed = Failed(status, message, param, code)


@dataclass
class Loaded:
    """What the worker serves: built by `load` on the worker thread."""

    model: object
    tokenizer: object
    proposer: object = None  # a speculator (`load_proposer`), or None for plain decoding


def speculate(loaded: Loaded, token: int, cache: list, history: list[int], max_tokens: int, sampling: SamplingParams):
    """The one call into the library's generation loops: decode after `token` speculatively,
    cache holding `history`. Yields responses with `.token`, one per generated token."""
    return stream_generate(
        loaded.model, loaded.tokenizer, [token], max_tokens=max_tokens, sampling=sampling, cache=cache, history=history,
        speculator=loaded.proposer,
    )


class Sequence:
    """A job while it runs: its tokens (prompt and generated, as the host has read them), its
    text stream, and its own caches while it is not a row of the batch."""

    def __init__(self, job: Job, tokens: list[int], max_tokens: int, cached: int, tokenizer, limit: int | None):
        self.job, self.tokens, self.max_tokens, self.cached = job, tokens, max_tokens, cached
        self.prompt_tokens, self.generated = len(tokens), 0
        self.stream = TextStream(tokenizer, job.stop)
        s = job.sampling
        self.sampler = s.sampler()
        self.key = mx.random.key(s.seed) if s.seed is not None and s.temp > 0 else None
        context = limit or 1 << 30  # OpenAI's penalties count the whole text so far
        self.processors = make_logits_processors(
            job.logit_bias, s.repetition_penalty, s.repetition_context_size,
            job.presence_penalty or None, context, job.frequency_penalty or None, context,
        )
        self.greedy = s.temp == 0 and not self.processors
        self.cache: list | None = None
        self.first: mx.array | None = None  # the newest token, read, as the batch feeds it next
        self.fresh = False  # in the batch, its pending token was read already (`Engine._join`)

    def sample(self, logits: mx.array, fed: mx.array | None) -> mx.array:
        """The next token (1,) from logits (1, vocab); fed: the token just fed, not yet read."""
        if self.processors:
            history = mx.array(self.tokens) if fed is None else mx.concatenate([mx.array(self.tokens), fed])
            for processor in self.processors:
                logits = processor(history, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self.key is None:
            return self.sampler(logprobs)
        self.key, key = mx.random.split(self.key)
        return _draw(logprobs, self.job.sampling, key)

    def emit(self, token: int) -> str | None:
        """Take a generated token; send its text; return the finish reason, if it is the last."""
        self.tokens.append(token)
        self.generated += 1
        piece, finish = self.stream.add(token, last=self.generated == self.max_tokens)
        if piece:
            self.job.send(piece)
        return finish

    def finished(self, reason: str) -> Finished:
        return Finished(reason, self.prompt_tokens, self.generated, self.cached)


def _draw(logprobs: mx.array, s: SamplingParams, key: mx.array) -> mx.array:
    """mlx-lm's `make_sampler` draw with the job's own random key, so that a seed gives the same
    tokens whatever else the batch holds (mlx-lm's sampler draws from the global state)."""
    if 0 < s.top_p < 1:
        logprobs = apply_top_p(logprobs, s.top_p)
    if s.min_p:
        logprobs = apply_min_p(logprobs, s.min_p)
    if s.top_k:
        logprobs = apply_top_k(logprobs, s.top_k)
    return mx.random.categorical(logprobs * (1 / s.temp), key=key)


class Engine:
    """The worker thread and its queue. `start` loads the model (on the worker) and returns once
    it serves; `submit` queues a job; `stop` ends the thread."""

    def __init__(
        self, load: Callable[[], Loaded], max_batch: int = 16, prompt_cache_bytes: int = 2 * 10**9,
        prefill_step_size: int = 512,
    ):
        self.load, self.max_batch, self.prefill_step_size = load, max_batch, prefill_step_size
        self.prompt_cache = PromptCache(prompt_cache_bytes)
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="mlx-hybrid-model", daemon=True)
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.loaded: Loaded | None = None
        self.context_limit: int | None = None
        self.recurrent = False  # a layer keeps a recurrent state: the prefill leaves snapshots
        # The batch: its caches, its rows' sequences in row order, and their pending tokens.
        self.batch, self.seqs, self.pending = Batch(), [], None
        self.alone: Job | None = None  # the job being started or speculating, outside the batch
        # Counters for /health and the tests (read from other threads: plain ints).
        self.rows = 0
        self.peak_rows = 0  # the widest batch so far
        self.speculating = False
        self.rejoined = 0  # speculating jobs that went back to the batch when another arrived
        self.served = 0
        self.generated_tokens = 0
        self.speculated_tokens = 0  # of generated_tokens, those from speculative passes

    def start(self):
        self.thread.start()
        self.ready.wait()
        if self.error is not None:
            raise self.error

    def submit(self, job: Job):
        self.jobs.put(job)

    def stop(self):
        self.jobs.put(None)
        self.thread.join()

    def stats(self) -> dict:
        return {
            "running": self.rows + int(self.speculating),
            "peak_batch": self.peak_rows,
            "speculating": self.speculating,
            "rejoined": self.rejoined,
            "queued": self.jobs.qsize(),
            "served": self.served,
            "generated_tokens": self.generated_tokens,
            "speculated_tokens": self.speculated_tokens,
            "prompt_cache": {"entries": len(self.prompt_cache), "bytes": self.prompt_cache.nbytes, "max_bytes": self.prompt_cache.max_bytes},
            "memory": {"active": mx.get_active_memory(), "peak": mx.get_peak_memory(), "mlx_cache": mx.get_cache_memory()},
        }

    # The worker thread from here on.

    def _run(self):
        try:
            self._serve()
        finally:
            # MLX keeps this thread's streams and compile cache in C++ thread-locals whose
            # destructors take the GIL; run at thread exit while the interpreter finalizes (Ctrl-C
            # on `hybrid serve`), they abort the process. Clearing them here, with the GIL held and
            # the interpreter alive, is MLX's own rule for threads that used it.
            mx.clear_streams()

    def _serve(self):
        try:
            self.loaded = self.load()
            model = self.loaded.model
            self.context_limit = context_limit(model)
            self.recurrent = any(isinstance(c, StateCache) for c in model.make_cache())
        except BaseException as e:  # noqa: BLE001 (handed to start's caller)
            self.error = e
            self.ready.set()
            return
        self.ready.set()
        with mx.stream(generation_stream):
            while True:
                try:
                    if not self._admit():
                        break
                    if self.seqs:
                        self._step()
                except Exception as e:  # a bug or an MLX error: fail the jobs it touched, keep serving
                    failed = Failed(500, f"generation failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                    for job in [seq.job for seq in self.seqs] + ([self.alone] if self.alone else []):
                        job.send(failed)
                    self.batch, self.seqs, self.pending, self.rows, self.alone = Batch(), [], None, 0, None
                    self.speculating = False
                    mx.clear_cache()
        for job in [seq.job for seq in self.seqs] + self._drain():
            job.send(Failed(503, "the server is shutting down"))

    def _drain(self) -> list[Job]:
        jobs = []
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return jobs
            if job is not None:
                jobs.append(job)

    def _admit(self) -> bool:
        """Start one queued job if the batch has room, waiting for one when nothing runs: one
        prompt is read between two decode steps, so running jobs never wait for more than one.
        A lone job with a speculator speculates. False once `stop` was called."""
        if len(self.seqs) < self.max_batch:
            idle = not self.seqs
            if idle:
                mx.clear_cache()  # buffers freed by finished jobs go back to the system
            try:
                job = self.jobs.get() if idle else self.jobs.get_nowait()
            except queue.Empty:
                pass
            else:
                if job is None:
                    return False
                self.alone = job
                seq = self._start(job)
                if seq is not None and idle and self.jobs.empty() and self._can_speculate(seq):
                    self._speculate(seq)
                elif seq is not None:
                    self._join(seq)
                self.alone = None
        if len(self.seqs) == 1 and self.jobs.empty() and self._can_speculate(self.seqs[0]):
            self._leave_batch_and_speculate()
        return True

    def _can_speculate(self, seq: Sequence) -> bool:
        return self.loaded.proposer is not None and not seq.processors

    def _tokens(self, job: Job) -> list[int]:
        """The job's prompt tokens, checked against the vocabulary and the context."""
        tokenizer = self.loaded.tokenizer
        if job.messages is not None:
            tokens = render_chat(tokenizer, job.messages)
            param = "messages"
        elif isinstance(job.prompt, str):
            tokens, param = tokenizer.encode(job.prompt), "prompt"
        else:
            tokens, param = list(job.prompt), "prompt"
            vocab = self.loaded.model.args.vocab_size
            if any(not 0 <= t < vocab for t in tokens):
                raise RequestError(f"prompt token ids must be in [0, {vocab})", param)
        if not tokens:
            raise RequestError("the prompt is empty", param)
        limit = self.context_limit
        if limit is not None and len(tokens) >= limit:
            raise RequestError(
                f"This model's maximum context length is {limit} tokens. However, your {param} resulted in "
                f"{len(tokens)} tokens.", param, "context_length_exceeded",
            )
        if job.logit_bias and any(not 0 <= t < self.loaded.model.args.vocab_size for t in job.logit_bias):
            raise RequestError(f"logit_bias token ids must be in [0, {self.loaded.model.args.vocab_size})", "logit_bias")
        return tokens

    def _max_tokens(self, job: Job, prompt_tokens: int) -> int:
        """max_tokens, cut to the context left after the prompt (a reply then ends with "length")."""
        limit = self.context_limit
        if job.max_tokens is not None and limit is not None and job.max_tokens > limit:
            raise RequestError(f"max_tokens is too large: {job.max_tokens}. This model's context is {limit} tokens.", "max_tokens")
        if limit is None:
            return job.max_tokens if job.max_tokens is not None else 1 << 30
        return min(job.max_tokens or limit, limit - prompt_tokens)

    def _start(self, job: Job) -> Sequence | None:
        """Read a job's prompt into caches of its own and emit its first token; the caches then
        hold all of seq.tokens but that token. None if the job failed, ended or was cancelled."""
        if job.cancelled.is_set():
            return None
        try:
            tokens = self._tokens(job)
            max_tokens = self._max_tokens(job, len(tokens))
        except RequestError as e:
            job.send(e.failed)
            return None
        except Exception as e:  # a chat template that rejects the messages, a tokenizer error
            job.send(Failed(400, f"cannot render the prompt: {str(e).splitlines()[0] if str(e) else type(e).__name__}", "messages"))
            return None
        model = self.loaded.model
        cache, cached = self.prompt_cache.fetch(tokens)
        cache = cache if cache is not None else model.make_cache()
        seq = Sequence(job, tokens, max_tokens, cached, self.loaded.tokenizer, self.context_limit)
        done = cached
        for point in self._snapshot_points(job, tokens, cached):
            prefill(model, mx.array(tokens[done:point]), cache, self.prefill_step_size)
            done = point
            self.prompt_cache.insert(tokens[:point], copy_cache(cache, point))
        prefill(model, mx.array(tokens[done:-1]), cache, self.prefill_step_size)
        logits = model(mx.array(tokens[-1:])[None], cache)[:, -1, :]
        seq.first = seq.sample(logits, None)
        job.send(Started(len(tokens), cached))
        seq.cache = cache
        finish = seq.emit(seq.first.item())
        self.generated_tokens += 1
        if finish:
            self._finish(seq, finish, cache)
            return None
        return seq

    def _snapshot_points(self, job: Job, tokens: list[int], cached: int) -> list[int]:
        """Where a hybrid model's prefill leaves copies in the prompt cache (module docstring):
        after the system message and before the prompt's last token. Attention-only caches need
        none: the finished job's cache can be cut back to any prefix."""
        if not self.recurrent:
            return []
        points = {len(tokens) - 1}
        if job.messages and job.messages[0]["role"] == "system" and len(job.messages) > 1:
            system = render_chat(self.loaded.tokenizer, job.messages[:1], add_generation_prompt=False)
            points.add(common_prefix(system, tokens))
        return sorted(p for p in points if cached < p < len(tokens))

    def _join(self, seq: Sequence):
        """Make seq a row of the batch. Its newest token, read but not fed yet, becomes the row's
        pending token (`seq.first`, marked `fresh`: the next step does not emit it again)."""
        self.batch.add(seq.cache)
        seq.cache, seq.fresh = None, True
        self.seqs.append(seq)
        self.pending = seq.first if self.pending is None else mx.concatenate([self.pending, seq.first])
        self.rows = len(self.seqs)
        self.peak_rows = max(self.peak_rows, self.rows)

    def _step(self):
        """One decode step for every row: feed the pending tokens, queue the next ones, then read
        the pending ones (whose step ran before this) and retire the rows they finish."""
        logits = self.loaded.model(self.pending[:, None], self.batch.caches)[:, -1, :]
        if all(seq.greedy for seq in self.seqs):
            nxt = mx.argmax(logits, axis=-1)
        else:
            nxt = mx.concatenate([seq.sample(logits[i : i + 1], self.pending[i : i + 1]) for i, seq in enumerate(self.seqs)])
        mx.async_eval(nxt)
        keep = []
        for i, (seq, token) in enumerate(zip(self.seqs, self.pending.tolist())):
            if seq.job.cancelled.is_set():
                self._cancelled(seq)
                continue
            if seq.fresh:  # read when it joined
                seq.fresh = False
                keep.append(i)
                continue
            finish = seq.emit(token)
            self.generated_tokens += 1
            if finish:
                self._finish(seq, finish, self.batch.take(i, len(seq.tokens)))
            else:
                keep.append(i)
        if len(keep) < len(self.seqs):
            self.batch.keep(keep)
            self.seqs = [self.seqs[i] for i in keep]
            nxt = nxt[mx.array(keep, mx.int32)] if keep else None
            self.rows = len(self.seqs)
        self.pending = nxt

    def _finish(self, seq: Sequence, reason: str, cache: list):
        """Keep the job's caches (holding its tokens up to their offset) for later prompts, then
        answer its end: a client's next turn finds them."""
        self.prompt_cache.insert(seq.tokens[: cache[0].offset], cache)
        self.served += 1
        seq.job.send(seq.finished(reason))

    def _cancelled(self, seq: Sequence):
        """The client went away: its caches are dropped (freed once nothing refers to them)."""
        self.served += 1

    def _leave_batch_and_speculate(self):
        """The batch is down to one job: read its pending token, take its caches out (they hold
        all its tokens but that one) and let it speculate."""
        seq = self.seqs[0]
        finish = None if seq.fresh else seq.emit(self.pending.item())
        cache = self.batch.take(0, len(seq.tokens) - 1)
        self.batch, self.seqs, self.pending, self.rows = Batch(), [], None, 0
        if finish:
            return self._finish(seq, finish, cache)
        seq.cache, self.alone = cache, seq.job
        self._speculate(seq)
        self.alone = None

    def _speculate(self, seq: Sequence):
        """Decode seq alone with the speculator until it finishes or another job waits; then it
        rejoins the batch. Its caches hold all of seq.tokens but the newest."""
        if seq.job.cancelled.is_set():
            return self._cancelled(seq)
        self.speculating, finish = True, None
        replies = speculate(self.loaded, seq.tokens[-1], seq.cache, seq.tokens[:-1], seq.max_tokens - seq.generated, seq.job.sampling)
        try:
            for r in replies:
                self.generated_tokens += 1
                self.speculated_tokens += 1
                finish = seq.emit(r.token)
                if finish or seq.job.cancelled.is_set():
                    break
                # between passes the caches hold all tokens but the newest: rejoin the batch there
                if not self.jobs.empty() and all(c.offset == len(seq.tokens) - 1 for c in seq.cache):
                    break
        finally:
            replies.close()
            self.speculating = False
        if finish:
            return self._finish(seq, finish, seq.cache)
        if seq.job.cancelled.is_set():
            return self._cancelled(seq)
        seq.first = mx.array(seq.tokens[-1:])
        self._join(seq)
        self.rejoined += 1
