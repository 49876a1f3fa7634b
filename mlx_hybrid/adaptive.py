"""Adaptive DSLA conversion (DSLA-Serve, section 4.3): each request runs just enough of the
model's convertible attention layers as DSLA for its weights and cache to fit a memory budget.

A model directory lists its convertible layers least sensitive first (`dsla_conversion` in
config.json, docs/formats/hybrid-checkpoint.md); both weight sets stay loaded, and which one a
layer uses is decided by the cache it is handed (`hybrid.Model.make_cache(dsla_layers)`).

The conversion is decided per request at prefill time, from the tokens the request will hold
(prompt, history included, plus max_tokens) -- DSLA-Serve's serving policy sets the conversion rate
from the prompt length (its Table 4) -- because a layer's DSLA state cannot be built from its KV
cache: it needs the layer's inputs, which are not kept (keeping them would cost hidden_size values
per token and layer, more than the KV rows they would replace under grouped-query attention). So
a request never converts mid-generation, and a chat turn that needs more DSLA layers than its
history ran with re-reads the history once with the new conversion (`ChatSession`).

The cache estimate repeats `KVCache`'s arithmetic (buffers grow in `cache.STEP`-row chunks, a
sliding window drops rows) and measures the fixed-size recurrent states with a one-token probe,
so it equals the caches' `nbytes` at the end of the request. Transient memory (activations of a
prefill chunk, the old buffer while a KV cache grows) is not counted: leave headroom for it.
The estimate assumes one token per decode step; speculative decoding appends a candidate tree's
rows before accepting some, which can grow a KV buffer one STEP earlier.
"""

import os
import re
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_hybrid.cache import STEP, KVCache, StateCache
from mlx_hybrid.errors import HybridError

UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
CPU_FRACTION = 0.75  # of physical memory, the default budget where the device reports no working set
GPU_FRACTION = 0.9  # of a CUDA GPU's memory


def parse_budget(value: str | int | float) -> int:
    """Bytes from a budget such as 8GB, 1.5GiB, 512MB or a plain byte count (GB = 10^9, GiB = 2^30)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kKmMgGtT]?i?)[bB]?\s*", str(value))
        if not m:
            raise HybridError(f"memory budget '{value}' is not a size (use e.g. 8GB, 512MiB or a byte count)")
        number, unit = float(m.group(1)), m.group(2).lower()
    size = int(number * UNITS[unit])
    if size <= 0:
        raise HybridError(f"memory budget must be positive, got '{value}'")
    return size


def default_budget() -> tuple[int, str]:
    """The budget when none is given, and where it came from: a Mac GPU's recommended working set,
    90% of a CUDA GPU's memory, else 75% of physical memory (the CPU backend)."""
    info = mx.device_info() if mx.default_device() == mx.gpu else {}
    if "max_recommended_working_set_size" in info:
        return int(info["max_recommended_working_set_size"]), "the GPU's recommended working set"
    for key in ("total_memory", "memory_size"):
        if key in info:
            return int(info[key] * GPU_FRACTION), f"{GPU_FRACTION:.0%} of the GPU's memory"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total * CPU_FRACTION), f"{CPU_FRACTION:.0%} of system memory"


def format_bytes(n: int) -> str:
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def kv_rows(chunks: list[int], window: int | None = None) -> int:
    """Rows of the buffer a `KVCache` holds after appending these chunks, by its own arithmetic
    (capacity grows to the next multiple of STEP; a sliding window first drops >= STEP rows)."""
    offset = start = capacity = 0
    for n in chunks:
        if window is not None and offset - window + 1 - start >= STEP:
            drop = offset - window + 1 - start  # `_drop_unreachable`: rows no future query can see
            capacity, start = capacity - drop, start + drop
        size = offset - start
        if size + n > capacity:
            capacity = (size + n + STEP - 1) // STEP * STEP
        offset += n
    return capacity


def request_chunks(prompt_tokens: int, max_tokens: int, prefill_step: int = 512) -> list[int]:
    """The token chunks `generate_step` feeds for a request: the prompt but its last token in
    prefill steps, then one token at a time (the last generated token is never fed)."""
    prefill = [min(prefill_step, prompt_tokens - 1 - i) for i in range(0, prompt_tokens - 1, prefill_step)]
    return prefill + [1] * max_tokens


def is_adaptive(model: nn.Module) -> bool:
    """Whether the model has layers it may run as DSLA."""
    return bool(getattr(model.args, "dsla_order", None)) and model.args.dsla_max_layers > 0


@dataclass
class Plan:
    """The conversion chosen for one request."""

    dsla_layers: list[int]  # layers run as DSLA, least sensitive first
    num_layers: int
    tokens: int  # tokens the cache holds at the end of the request
    cache_bytes: int  # the caches' nbytes then
    weights_bytes: int
    budget: int

    @property
    def rate(self) -> float:
        return len(self.dsla_layers) / self.num_layers


class ConversionPolicy:
    """Picks, per request, the fewest convertible layers (least sensitive first, at most the
    configured maximum) to run as DSLA so that weights + cache fit the budget."""

    def __init__(self, model: nn.Module, budget: str | int | float | None = None):
        self.model = model
        if budget is None:
            self.budget, self.budget_source = default_budget()
        else:
            self.budget, self.budget_source = parse_budget(budget), "--memory-budget"
        args = model.args
        self.order = list(getattr(args, "dsla_order", []))[: getattr(args, "dsla_max_layers", 0)]
        self.window = args.sliding_window
        self.weights_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        embed = model.model.embed_tokens
        dtype = embed.scales.dtype if "scales" in embed else embed.weight.dtype
        self.kv_row_bytes = 2 * args.num_key_value_heads * args.head_dim * dtype.size
        probe = model.make_cache(self.order) if self.order else model.make_cache()
        model(mx.array([[0]]), probe)
        self.state_bytes = {i: c.nbytes for i, c in enumerate(probe) if isinstance(c, StateCache)}
        self.kv_layers = [i for i, c in enumerate(probe) if isinstance(c, KVCache)] + self.order

    def cache_bytes(self, chunks: list[int], dsla_layers: list[int]) -> int:
        """The caches' total nbytes after a request fed these chunks with these layers as DSLA."""
        kv = [i for i in self.kv_layers if i not in dsla_layers]
        states = sum(b for i, b in self.state_bytes.items() if i not in self.order or i in dsla_layers)
        return len(kv) * kv_rows(chunks, self.window) * self.kv_row_bytes + states

    def plan(self, prompt_tokens: int, max_tokens: int, prefill_step: int = 512) -> Plan:
        """The conversion for a request of prompt_tokens (history included) and up to max_tokens more."""
        chunks = request_chunks(prompt_tokens, max_tokens, prefill_step)
        for k in range(len(self.order) + 1):
            cache = self.cache_bytes(chunks, self.order[:k])
            if self.weights_bytes + cache <= self.budget:
                break
        else:
            n = len(self.order)
            converted = f"even with {n} layers as DSLA" if n else "and the model has no DSLA layers to convert"
            raise HybridError(
                f"{prompt_tokens} prompt + {max_tokens} new tokens need {format_bytes(self.weights_bytes + cache)} "
                f"(weights {format_bytes(self.weights_bytes)} + cache {format_bytes(cache)}) {converted}, over the "
                f"memory budget of {format_bytes(self.budget)} ({self.budget_source})"
            )
        n_layers = len(self.model.layers)
        return Plan(self.order[:k], n_layers, sum(chunks), cache, self.weights_bytes, self.budget)


def request_cache(
    model: nn.Module, prompt_tokens: int, max_tokens: int, budget=None, prefill_step: int = 512
) -> tuple[list, Plan | None]:
    """A fresh cache for one request and the plan it follows: converted as the policy decides
    when the model has DSLA layers or a budget is given, else the model's own (plan None)."""
    if budget is None and not is_adaptive(model):
        return model.make_cache(), None
    plan = ConversionPolicy(model, budget).plan(prompt_tokens, max_tokens, prefill_step)
    return model.make_cache(plan.dsla_layers), plan


def cache_nbytes(cache: list) -> int:
    return sum(c.nbytes for c in cache)
