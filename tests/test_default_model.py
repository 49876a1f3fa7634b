"""The embedded default model (package data): its size budget, architecture and quantization, and
exact greedy speculative decoding with its own ReDrafter drafter against plain greedy decoding."""

import json

from mlx_hybrid.chat import ChatSession
from mlx_hybrid.default_model import PATH, default_model_path
from mlx_hybrid.generate import stream_generate
from mlx_hybrid.loader import load
from mlx_hybrid.speculative import load_proposer

BUDGET = 25_000_000  # bytes of package data for the default model and its drafter


def test_default_model_fits_the_package_budget():
    size = sum(f.stat().st_size for f in PATH.rglob("*") if f.is_file())
    assert size <= BUDGET, size


def test_default_model_is_the_distilled_4bit_hybrid_with_its_drafter():
    config = json.loads((PATH / "config.json").read_text())
    assert config["model_type"] == "llama_hybrid"
    assert config["mixer_types"] == ["attention", "mamba2"] * 4  # 50% hybrid, 8 layers
    assert config["vocab_size"] == 8192
    quant = config["quantization"]
    assert (quant["bits"], quant["group_size"], quant["model.embed_tokens"]["bits"]) == (4, 64, 5)
    drafter = json.loads((PATH / "redrafter" / "config.json").read_text())
    assert drafter["vocab_size"] == config["vocab_size"] and drafter["quantization"]["bits"] == 4


def test_default_model_speculative_greedy_equals_plain_greedy():
    """Its drafter only speeds decoding up: greedy output with it is plain greedy output, token for token."""
    model, tokenizer = load(default_model_path())
    prompt = ChatSession(model, tokenizer).render([{"role": "user", "content": "Give me three tips for staying healthy."}])
    plain = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=24)]
    proposer = load_proposer("redrafter", model, PATH)
    drafted = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=24, speculator=proposer)]
    assert len(plain) == 24 and drafted == plain


def test_loading_and_decoding_the_default_model_says_nothing_on_stderr():
    """A chat's first screen is the model's own: no library notice at load or at the first decode
    (in a fresh process, where transformers' once-per-process notices would show)."""
    import subprocess
    import sys

    code = ("from mlx_hybrid.default_model import default_model_path\nfrom mlx_hybrid.loader import load\n"
            "model, tokenizer = load(default_model_path())\nprint(tokenizer.decode(tokenizer.encode('Hello , world !')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]
    assert done.stdout.strip() == "Hello , world !"  # the spaces before punctuation kept (no WordPiece clean-up)
