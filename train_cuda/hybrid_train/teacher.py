"""Teachers: Hugging Face Llama/Mistral directories, or a GGUF file that transformers dequantizes."""

import json
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from hybrid_train.errors import TrainError

SUPPORTED = ("llama", "mistral")


def _source(path: str | Path) -> tuple[Path, dict]:
    """The directory to load from and the extra from_pretrained arguments (gguf_file for a .gguf)."""
    path = Path(path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise TrainError(f"teacher GGUF file not found: {path}")
        return path.parent, {"gguf_file": path.name}
    if not (path / "config.json").is_file():
        raise TrainError(f"teacher directory not found or without config.json: {path}")
    return path, {}


def load_tokenizer(path: str | Path):
    directory, extra = _source(path)
    try:
        # A student's config.json names model_type llama_hybrid, which transformers does not know
        # (it warns at every load): the tokenizer is looked up by its base model's config instead.
        config = {} if extra else json.loads((directory / "config.json").read_text())
        if config.get("model_type") == "llama_hybrid":
            extra = {"config": AutoConfig.for_model(config.get("base_model_type", "llama"))}
        return AutoTokenizer.from_pretrained(directory, trust_remote_code=False, **extra)
    except Exception as e:  # transformers raises many types, with multi-line messages
        raise TrainError(f"cannot load the tokenizer of {path}: {str(e).splitlines()[0]}") from None


def load_teacher(path: str | Path, dtype=torch.float32, device="cpu"):
    """A frozen Llama/Mistral teacher in eval mode."""
    directory, extra = _source(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, trust_remote_code=False, **extra)
    except Exception as e:
        raise TrainError(f"cannot load the teacher {path}: {str(e).splitlines()[0]}") from None
    if model.config.model_type not in SUPPORTED:
        raise TrainError(f"teacher {path} is a {model.config.model_type} model (supported: {', '.join(SUPPORTED)})")
    model.requires_grad_(False)
    return model.to(device).eval()


def gguf_to_hf(gguf: str | Path, out: str | Path) -> Path:
    """Write a GGUF teacher as a plain Hugging Face directory (float32 safetensors + tokenizer).

    transformers keeps a GGUF-loaded model marked as quantized and refuses to save it, so the
    dequantized weights are copied into a fresh model of the same config.
    """
    src = load_teacher(gguf)
    model = AutoModelForCausalLM.from_config(src.config, dtype=torch.float32)
    model.load_state_dict(src.state_dict())
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    # The copied config still names the GGUF quantization; these weights are float, and converters
    # (`hybrid convert`) refuse a directory that says it is quantized.
    config = json.loads((tmp / "config.json").read_text())
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    load_tokenizer(gguf).save_pretrained(tmp)
    tmp.rename(out)
    return out
