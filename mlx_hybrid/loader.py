"""Load a model directory (Hugging Face layout, float or MLX-quantized) into a model and tokenizer.

Every way a directory can be wrong ends in a `HybridError` whose message names the file or
tensor at fault, so the CLI can print one line instead of a traceback.
"""

import glob
import logging
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tokenizer_utils import load as load_tokenizer_wrapper

from mlx_hybrid.errors import HybridError
from mlx_hybrid.generation_config import read_sampling_defaults
from mlx_hybrid.models import hybrid, llama
from mlx_hybrid.validate import (
    check_model_config,
    check_tokenizer_fits,
    first_nonfinite,
    read_json_object,
    refuse_remote_code,
)

# config.json "model_type" -> module holding ModelArgs and Model.
ARCHITECTURES = {"llama": llama, "mistral": llama, "llama_hybrid": hybrid}
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


class _SameTextNotice(logging.Filter):
    """transformers skips its WordPiece space clean-up on BPE tokenizers whose config asks for it
    (SmolLM2's, the default model's, does) and says so on stderr in every process: the decoded text
    is the same either way, so the notice is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Ignoring clean_up_tokenization_spaces=True for BPE")


logging.getLogger("transformers.tokenization_utils_tokenizers").addFilter(_SameTextNotice())


def read_config_json(path: Path, what: str = "directory") -> dict:
    """The parsed config.json of directory `path` (a model, heads or drafter); a HybridError
    says what is missing or malformed."""
    if not path.is_dir():
        raise HybridError(f"{what} not found: {path}")
    file = path / "config.json"
    if not file.is_file():
        raise HybridError(f"no config.json in {path}")
    return read_json_object(file)


def load_config(path: Path) -> dict:
    config = read_config_json(path, "model directory")
    file = path / "config.json"
    kind = config.get("model_type")
    if kind not in ARCHITECTURES:
        raise HybridError(
            f"unsupported architecture '{kind}' in {file} (supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    return config


def load_weights(path: Path) -> dict[str, mx.array]:
    files = sorted(glob.glob(str(path / "*.safetensors")))
    if not files:
        raise HybridError(f"no *.safetensors weight files in {path}")
    weights = {}
    for file in files:
        try:
            weights.update(mx.load(file))
        except Exception as e:  # mlx raises RuntimeError/ValueError with a multi-line reason
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise HybridError(f"cannot read {file}: truncated or corrupt safetensors ({reason})") from None
    return weights


def _quantize(model: nn.Module, qconfig: dict, weights: dict):
    """Swap in quantized layers wherever the checkpoint holds quantized tensors (mlx-lm's layout)."""

    def predicate(path: str, module: nn.Module):
        hf_path = path.replace("qkv_proj", "q_proj").replace("gate_up_proj", "gate_proj")
        if hf_path in qconfig:
            return qconfig[hf_path]
        return f"{path}.scales" in weights

    nn.quantize(model, qconfig["group_size"], qconfig["bits"], class_predicate=predicate)


def compute_dtype() -> str | None:
    """The float dtype to run in when none is asked for: float32 on the CPU, else as stored.

    MLX's CPU kernels for half types are many times slower than for float32 (a 4-bit matmul with
    float16 scales runs ~35x slower than with float32 scales on x86), so on the CPU we upcast.
    """
    return "float32" if mx.default_device() == mx.cpu else None


def load_model(path: str | Path, dtype: str | None = None) -> nn.Module:
    """The model in `path`, float tensors (quantization scales included) cast to `dtype`, with
    its generation_config.json's sampling defaults as `model.sampling_defaults`.

    dtype None picks `compute_dtype()`; integer (packed quantized) weights are never touched.
    """
    path = Path(path)
    dtype = dtype or compute_dtype()
    config = load_config(path)
    weights = load_weights(path)
    config.setdefault("tie_word_embeddings", "lm_head.weight" not in weights)
    check_model_config(config, path / "config.json", weights)
    sampling_defaults = read_sampling_defaults(path, config["vocab_size"])
    try:
        if (path / hybrid.MAMBA_IN_LLAMA_CONFIG).is_file():
            mamba_config = read_json_object(path / hybrid.MAMBA_IN_LLAMA_CONFIG)
            config = hybrid.config_from_mamba_in_llama(config, mamba_config, weights)
        arch = ARCHITECTURES[config["model_type"]]
        args = arch.ModelArgs.from_dict(config)
        model = arch.Model(args)
        weights = model.sanitize(weights)
    except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError) as e:
        raise HybridError(f"{path}: {e}") from None
    if config.get("quantization"):
        _quantize(model, config["quantization"], weights)
    keep = getattr(arch, "FP32_PARAMS", ())  # recurrent-state parameters stay float32 whatever dtype
    model = set_weights(model, path, weights, dtype, keep)
    model.sampling_defaults = sampling_defaults
    return model


def set_weights(module: nn.Module, path: Path, weights: dict, dtype: str | None, keep=()) -> nn.Module:
    """Load weights into module (strictly: every name and shape), float tensors cast to dtype
    except the parameters named in keep (float32); the module is evaluated and in eval mode."""
    if dtype is not None and dtype not in DTYPES:
        raise HybridError(f"unknown dtype '{dtype}' (choose from {', '.join(DTYPES)})")

    def cast(name: str, v: mx.array) -> mx.array:
        if not mx.issubdtype(v.dtype, mx.floating):
            return v
        if name.rpartition(".")[2] in keep:
            return v.astype(mx.float32)
        return v.astype(DTYPES[dtype]) if dtype else v

    try:
        module.load_weights([(k, cast(k, v)) for k, v in weights.items()], strict=True)
    except ValueError as e:
        raise HybridError(f"{path}: weights do not match config.json: {str(e).splitlines()[0]}") from None
    # Every array the module holds, its private ones too (RoPE frequencies...): one left lazy here
    # would be tied to this thread's stream, and a generation on another thread could not run it.
    mx.eval(module.filter_and_map(lambda _, __, v: isinstance(v, (dict, list, mx.array))))
    bad = first_nonfinite(tree_flatten(module.parameters()))
    if bad:
        raise HybridError(f"{path}: weight '{bad}' holds NaN or Inf values")
    module.eval()
    return module


def load_tokenizer(path: str | Path, eos_token_ids=None) -> TokenizerWrapper:
    """The tokenizer in path. A hybrid's config.json names a model_type transformers does not know,
    which draws a warning on every load, so transformers gets its base architecture's config."""
    path = Path(path)
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise HybridError(f"no tokenizer in {path} (expected {' or '.join(TOKENIZER_FILES)})")
    refuse_remote_code(path)
    config = read_config_json(path, "model directory") if (path / "config.json").is_file() else {}
    try:
        extra = {"trust_remote_code": False}
        if config.get("model_type") == "llama_hybrid":
            from transformers import AutoConfig

            extra["config"] = AutoConfig.for_model(config.get("base_model_type", "llama"))
        return load_tokenizer_wrapper(path, tokenizer_config_extra=extra, eos_token_ids=eos_token_ids)
    except Exception as e:
        raise HybridError(f"cannot load the tokenizer in {path}: {str(e).splitlines()[0]}") from None


def load(path: str | Path | None = None, dtype: str | None = None) -> tuple[nn.Module, TokenizerWrapper]:
    """Model and tokenizer from a model directory (config.json + *.safetensors + tokenizer files),
    or, path None, the embedded default model's (what `hybrid chat` runs without --model).
    The folder is data: one asking to run code (auto_map) is refused before anything is read."""
    if path is None:
        from mlx_hybrid.default_model import default_model_path

        path = default_model_path()
    path = Path(path)
    refuse_remote_code(path)
    model = load_model(path, dtype)
    config = load_config(path)
    eos = config.get("eos_token_id")
    tokenizer = load_tokenizer(path, [eos] if isinstance(eos, int) else eos)
    check_tokenizer_fits(tokenizer, model.args.vocab_size, path)
    return model, tokenizer


def load_default(dtype: str | None = None) -> tuple[nn.Module, TokenizerWrapper]:
    """The embedded default model and its tokenizer: `load()`."""
    return load(None, dtype)
