"""Llama 2/3/3.x and Mistral (sliding-window) decoder, in the Hugging Face weight layout.

Q/K/V and gate/up projections are fused into one matmul each at load time (`sanitize`): a
decode step is a chain of small matrix-vector products, so fewer, larger ones run faster. For the
same reason queries and keys turn in one RoPE call (a launch per layer saved).
"""

from dataclasses import dataclass, field, fields

import mlx.core as mx
import mlx.nn as nn

from mlx_hybrid.attention import attention
from mlx_hybrid.cache import KVCache
from mlx_hybrid.models.linear import Linear, fused_project, row_product
from mlx_hybrid.rope import rope_frequencies
from mlx_hybrid.tree_mask import TreeMask


@dataclass
class ModelArgs:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    quantization: dict | None = field(default=None, repr=False)

    @classmethod
    def from_dict(cls, config: dict) -> "ModelArgs":
        config = legacy_rope(config) | config
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names})

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if self.model_type != "mistral":
            self.sliding_window = None  # Llama configs may carry the key unused


def legacy_rope(config: dict) -> dict:
    """rope_theta and rope_scaling as transformers 4 wrote them, from transformers 5's
    "rope_parameters" (theta and scaling together), which mlx-lm does not read."""
    rope = dict(config.get("rope_parameters") or {})
    legacy = {"rope_theta": rope.pop("rope_theta")} if "rope_theta" in rope else {}
    if rope.get("rope_type", "default") != "default":
        legacy["rope_scaling"] = rope
    return legacy


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
        )
        self.scale = self.head_dim**-0.5
        qkv = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        self.qkv_proj = Linear(args.hidden_size, qkv, bias=args.attention_bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, args.hidden_size, bias=args.attention_bias)
        self._freqs = rope_frequencies(self.head_dim, args.rope_theta, args.rope_scaling)

    def __call__(self, x: mx.array, mask=None, cache: KVCache = None, norm=None, residual=None) -> mx.array:
        """residual + o_proj(attention(norm(x))), norm and residual optional (see `DecoderLayer`)."""
        out = attention(self, fused_project(self.qkv_proj, x, norm), mask, cache)
        return fused_project(self.o_proj, out, residual=residual)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_up_proj = Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def __call__(self, x: mx.array, norm=None, residual=None) -> mx.array:
        """residual + down(swiglu(gate_up(norm(x)))), norm and residual optional."""
        return fused_project(self.down_proj, fused_project(self.gate_up_proj, x, norm), gated=True, residual=residual)


class DecoderLayer(nn.Module):
    """x + attention(norm(x)), then h + mlp(norm(h)). The norms and residual adds are handed to
    the projections (`linear.fused_project`): for a verification pass's nodes on CUDA each
    projection is then one launch with its norm or add, a decoder layer five launches, not ten."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask=None, cache: KVCache = None) -> mx.array:
        h = self.self_attn(x, mask, cache, norm=self.input_layernorm, residual=x)
        return self.mlp(h, norm=self.post_attention_layernorm, residual=h)


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, tokens: mx.array, cache: list, mask: TreeMask | None = None) -> mx.array:
        h = self.embed_tokens(tokens)
        if mask is not None:
            # A tree's nodes (batch 1) as the rows of a matrix: projections over a few rows then
            # take the row kernel (`linear.row_product`), and none reshapes them.
            h = h.reshape(-1, h.shape[-1])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
        return self.norm(h)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = LlamaModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, tokens: mx.array, cache: list | None = None, mask: TreeMask | None = None, return_hidden: bool = False):
        """Logits (batch, length, vocab) for tokens (batch, length); also the final hidden states if asked.

        Without a cache the tokens are a whole sequence from position 0 (a throwaway cache gives the
        same masks, sliding window included, as generation uses). The tokens continue what the
        cache holds, causally, or, with a `TreeMask` (batch 1), as the nodes of a candidate tree
        that the caches hold apart until `commit` (`mlx_hybrid.cache`).
        """
        h = self.model(tokens, cache if cache is not None else self.make_cache(), mask)
        logits = self._logits(h)
        if mask is not None:
            logits, h = logits[None], h[None]
        return (logits, h) if return_hidden else logits

    def _logits(self, h: mx.array) -> mx.array:
        if not self.args.tie_word_embeddings:
            return self.lm_head(h)
        embed = self.model.embed_tokens  # a pass's nodes on the row kernel, as the projections (linear.py)
        y = row_product(h, embed.weight) if type(embed) is nn.Embedding else None
        return embed.as_linear(h) if y is None else y

    def make_cache(self) -> list[KVCache]:
        return [KVCache(self.args.sliding_window) for _ in self.model.layers]

    @property
    def layers(self):
        return self.model.layers

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Map Hugging Face / mlx-lm tensor names onto this module: fuse q/k/v and gate/up, drop unused."""
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        for name in list(weights):
            module, _, param = name.rpartition(".")  # param: weight, bias, scales or biases
            parent, _, leaf = module.rpartition(".")
            for target, parts in FUSED.items():
                if leaf == parts[0]:
                    names = [f"{parent}.{p}.{param}" for p in parts]
                    missing = [n for n in names if n not in weights]
                    if missing:
                        raise ValueError(f"checkpoint lacks tensor '{missing[0]}'")
                    weights[f"{parent}.{target}.{param}"] = mx.concatenate([weights.pop(n) for n in names])
        return weights


# Fused projection -> the Hugging Face projections it concatenates (along the output axis).
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
