"""Sampling defaults a model folder ships in generation_config.json (the transformers convention).

A model's authors know what settings it was tuned for (a small model that loops under greedy
decoding wants a temperature and a repetition penalty), so chat, generate, serve and the Python
API start from them; an explicit flag, request field or `SamplingParams` always wins. The file is
data from anywhere like the rest of the folder: a value out of range is a one-line error naming
the file and the field, not a failure deep inside the sampler.
"""

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from mlx_hybrid.errors import HybridError
from mlx_hybrid.sampling import SamplingParams
from mlx_hybrid.validate import read_json_object

FILE = "generation_config.json"
# generation_config.json field -> SamplingParams field
FIELDS = {"temperature": "temp", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty"}
LABELS = {"temp": "temperature", "top_p": "top-p", "top_k": "top-k", "min_p": "min-p", "repetition_penalty": "repetition penalty"}


@dataclass
class SamplingDefaults:
    """The SamplingParams fields a model's generation_config.json sets, and that file."""

    values: dict = field(default_factory=dict)
    file: Path | None = None

    def params(self, speculative: bool = False, **given) -> SamplingParams:
        """SamplingParams from these defaults under the fields given (None: not given).
        speculative: leave out the file's repetition penalty, which speculative decoding cannot
        apply (a penalty given explicitly stays, and is refused there)."""
        values = {k: v for k, v in self.values.items() if not (speculative and k == "repetition_penalty")}
        return replace(SamplingParams(**values), **{k: v for k, v in given.items() if v is not None})

    def describe(self, params: SamplingParams, given: dict) -> str:
        """The effective settings, grouped by where they came from: flags, this file or built in."""
        sampled = params.temp > 0
        shown = ["temp"] + [k for k in ("top_p", "top_k", "min_p") if sampled and getattr(params, k)]
        shown += ["repetition_penalty"] if params.repetition_penalty is not None else []
        groups: dict[str, list[str]] = {}
        for name in shown:
            value = getattr(params, name)
            source = "flags" if given.get(name) is not None else FILE if name in self.values else "built-in default"
            text = "greedy" if name == "temp" and not sampled else f"{LABELS[name]} {value:g}"
            groups.setdefault(source, []).append(text)
        return "; ".join(f"{', '.join(texts)} ({source})" for source, texts in groups.items())


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check(file: Path, name: str, value, vocab_size: int | None):
    bad = {
        "temperature": not (_number(value) and value >= 0) and "a number >= 0",
        "top_p": not (_number(value) and 0 < value <= 1) and "a number in (0, 1]",
        "top_k": not (isinstance(value, int) and not isinstance(value, bool) and value >= 0) and "an integer >= 0",
        "min_p": not (_number(value) and 0 <= value <= 1) and "a number in [0, 1]",
        "repetition_penalty": not (_number(value) and value > 0) and "a number > 0",
    }[name]
    if not bad and name == "top_k" and vocab_size is not None and value >= vocab_size:
        bad = f"below the vocabulary size ({vocab_size})"
    if bad:
        raise HybridError(f"{file}: '{name}' must be {bad}, got {value!r}")


def read_sampling_defaults(model_dir: str | Path, vocab_size: int | None = None) -> SamplingDefaults:
    """The sampling defaults of model_dir's generation_config.json (none without one). do_sample
    false means greedy, as in transformers; a repetition penalty of 1 is none (it changes nothing,
    and any penalty rules out speculative decoding)."""
    file = Path(model_dir) / FILE
    if not file.is_file():
        return SamplingDefaults()
    config = read_json_object(file)
    values = {}
    for name, target in FIELDS.items():
        if config.get(name) is not None:
            _check(file, name, config[name], vocab_size)
            values[target] = float(config[name]) if target != "top_k" else config[name]
    do_sample = config.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise HybridError(f"{file}: 'do_sample' must be true or false, got {do_sample!r}")
    if do_sample is False:
        values["temp"] = 0.0
    if values.get("repetition_penalty") == 1.0:
        del values["repetition_penalty"]
    return SamplingDefaults(values, file)


def model_sampling_defaults(model) -> SamplingDefaults:
    """The defaults `loader.load_model` read for model; none for a model built in code."""
    return getattr(model, "sampling_defaults", None) or SamplingDefaults()
