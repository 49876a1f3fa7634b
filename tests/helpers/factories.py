"""Small real-architecture models with random weights, written in the Hugging Face layout.

Nothing is downloaded: transformers builds the model from a config, and the tokenizer is a
byte-level BPE trained here on a few sentences.
"""

import json
from pathlib import Path

import mlx.core as mx
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hybrid models replace some attention layers with state space layers.",
    "Speculative decoding verifies many drafted tokens in one forward pass.",
    "Once upon a time there was a little robot who loved to read books.",
] * 20

BASE_CONFIG = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def make_tokenizer(path: Path, vocab_size: int = 320):
    """Train a tiny byte-level BPE and save it as a transformers fast tokenizer with a chat template."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", unk_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def make_hf_model_dir(
    path: Path,
    arch: str = "llama",
    seed: int = 0,
    tokenizer: bool = True,
    save_dtype: str | None = None,
    legacy_rope: bool = False,
    random_vectors: bool = False,
    **overrides,
) -> Path:
    """A Hugging Face model directory (config.json, model.safetensors, tokenizer) with random weights.

    save_dtype ("bfloat16", "float16") stores the weights in that dtype, as published checkpoints do.
    legacy_rope writes rope_theta / rope_scaling at the top level of config.json, the layout of
    transformers 4.x and most Hub checkpoints (transformers 5 writes only "rope_parameters").
    random_vectors also perturbs biases and norm weights (zeros and ones at init), so a loader
    that dropped or misplaced them would change the logits.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(path) if tokenizer else None
    cfg = dict(BASE_CONFIG, vocab_size=len(tok) if tok else 320, **overrides)
    if tok:
        cfg.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**cfg))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**cfg))
    else:
        raise ValueError(arch)
    # Random init has tiny weights; widen them so logits differ clearly between tokens.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            elif random_vectors:
                p.add_(torch.randn_like(p), alpha=0.08)
    if save_dtype:
        model.to(getattr(torch, save_dtype))
    model.save_pretrained(path, safe_serialization=True)
    if legacy_rope:
        _write_legacy_rope(path / "config.json")
    return path


def _write_legacy_rope(file: Path):
    config = json.loads(file.read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = rope
    file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# Hybrid-layer fields of config.json besides d_inner, d_xb and dt_rank, which follow from the base config.
HYBRID_DEFAULTS = dict(d_state=16, d_conv=4, conv_bias=True, gate_rank=16, gate_norm=16.0)


def make_hybrid_dir(
    path: Path, layer_types: list[str], layout: str = "ours", arch: str = "llama", seed: int = 0, **overrides
):
    """A hybrid model directory built by the PyTorch reference (tests/helpers/torch_hybrid.py); returns (path, torch model).

    layout "mamba_in_llama" writes a MambaInLlama release: the base model's config.json plus their
    mamba_config.json (their MambaConfig as train_distill.py fills it); it holds one SSM kind.
    layout "ours" writes config.json with model_type "llama_hybrid" and mixer_types, any mix of kinds.
    Both store the same tensors (MambaInLlama's names). overrides go to the base config, except
    the keys of HYBRID_DEFAULTS. Every weight, biases and norms included, is random.
    """
    import math

    import torch
    from safetensors.torch import save_file
    from tests.helpers.torch_hybrid import build_hybrid
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    ssm_kinds = set(layer_types) - {"attention"}
    if layout not in ("ours", "mamba_in_llama"):
        raise ValueError(layout)
    if layout == "mamba_in_llama" and (len(ssm_kinds) > 1 or "dsla" in ssm_kinds):
        raise ValueError(f"a MambaInLlama release holds one kind of mamba layer, not {sorted(ssm_kinds)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ssm = {k: overrides.pop(k, v) for k, v in HYBRID_DEFAULTS.items()}
    tok = make_tokenizer(path)
    cfg = dict(BASE_CONFIG, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    cfg.update(num_hidden_layers=len(layer_types), **overrides)
    torch.manual_seed(seed)
    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM)}
    config_cls, model_cls = classes[arch]
    model = model_cls(config_cls(**cfg))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            else:
                p.add_(torch.randn_like(p), alpha=0.08)
    config = model.config
    d_xb = config.num_key_value_heads * config.head_dim
    ssm.update(d_inner=config.hidden_size, d_xb=d_xb, dt_rank=math.ceil(config.hidden_size / 16))
    build_hybrid(model, layer_types, ssm)
    weights = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(path / "model.safetensors"), {"format": "pt"})
    config.save_pretrained(path)
    if layout == "mamba_in_llama":
        mamba2 = "mamba2" in ssm_kinds
        if mamba2:  # train_mamba2/train_distill.py
            ssm_cfg = {"expand": 1, "ngroups": config.num_attention_heads, "d_state": ssm["d_state"]}
        else:  # train_mamba/train_distill.py; Mamba's own default d_state is 16
            ssm_cfg = {"expand": 1} | ({} if ssm["d_state"] == 16 else {"d_state": ssm["d_state"]})
        mamba_config = dict(
            d_model=config.hidden_size,
            ssm_cfg=ssm_cfg,
            rms_norm_eps=config.rms_norm_eps,
            vocab_size=None,
            d_inner=config.hidden_size if mamba2 else None,
            d_xb=d_xb,
            intermediate_size=config.intermediate_size,
            hidden_act=config.hidden_act,
            n_layer=len(layer_types),
            attn_layers=[i for i, kind in enumerate(layer_types) if kind == "attention"],
        )
        (path / "mamba_config.json").write_text(json.dumps(mamba_config, indent=4))
    else:
        file = path / "config.json"
        hybrid = json.loads(file.read_text())
        hybrid.update(model_type="llama_hybrid", base_model_type=arch, mixer_types=list(layer_types))
        hybrid.update(ssm)  # d_state, d_conv, conv_bias, gate_rank, gate_norm, d_inner, d_xb, dt_rank
        file.write_text(json.dumps(hybrid, indent=2, sort_keys=True) + "\n")
    return path, model


# The GPU kernels' backends, each skipped with its reason where this machine lacks it.
GPU_BACKENDS = [
    pytest.param("metal", marks=pytest.mark.skipif(not mx.metal.is_available(), reason="Metal not available (needs an Apple-silicon Mac)")),
    pytest.param("cuda", marks=pytest.mark.skipif(not mx.cuda.is_available(), reason="MLX CUDA backend not available")),
]


def check_placed_against_eager(model, parents: list[int], path: list[int]):
    """Three verification passes of the tree `parents` after a 250-token prefix, eager on one cache
    and placed on the device (`TreeMask.at`, as greedy passes run: `verify` then takes the
    compiled pass where it can) on another, each followed by committing path's first 2, 3, 4
    nodes: the same logits, hidden states and held keys/values or per-node states (atol 1e-5), and
    at the end the same caches. The second pass needs a bigger KV buffer."""
    import numpy as np

    from mlx_hybrid.cache import KVCache, commit
    from mlx_hybrid.speculative.verify import verify
    from mlx_hybrid.tree_mask import TreeMask

    def held(c, node):
        return c.held if isinstance(c, KVCache) else c._after(node)

    def kept(c):
        return [c.keys[..., : c.size, :], c.values[..., : c.size, :]] if isinstance(c, KVCache) else c.arrays

    rng = np.random.default_rng(5)
    vocab = model.args.vocab_size
    caches = [model.make_cache(), model.make_cache()]
    prefix = mx.array([rng.integers(0, vocab, 250).tolist()])
    for cache in caches:
        model(prefix, cache)
    for step in range(3):
        tokens = mx.array([rng.integers(0, vocab, len(parents)).tolist()])
        offset = caches[0][0].offset
        tree = TreeMask.from_parents(parents)
        want = model(tokens, caches[0], mask=tree, return_hidden=True)
        got = verify(model, tokens, caches[1], tree.at(mx.array([offset], mx.int32), offset))
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.array(g), np.array(w), atol=1e-5, err_msg=f"pass {step}")
        accepted = path[: step + 2]
        for c0, c1 in zip(*caches):
            for g, w in zip(held(c1, accepted[-1]), held(c0, accepted[-1])):
                np.testing.assert_allclose(np.array(g), np.array(w), atol=1e-5, err_msg=f"pass {step}")
        for cache in caches:
            commit(cache, accepted)
    for c0, c1 in zip(*caches):
        assert c0.offset == c1.offset
        for g, w in zip(kept(c1), kept(c0)):
            np.testing.assert_allclose(np.array(g), np.array(w), atol=1e-5)


def took_compiled_pass(model) -> bool:
    """Whether a verification pass of this model went through the compiled function (`verify`)."""
    from mlx_hybrid.speculative import verify

    return any(key[0] == id(model) for key in verify._COMPILED)
