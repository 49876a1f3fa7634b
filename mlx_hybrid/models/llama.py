"""Llama 2/3/3.x and Mistral (sliding-window) decoder, in the Hugging Face weight layout.

Q/K/V and gate/up projections are fused into one matmul each at load time (`sanitize`): a
decode step is a chain of small matrix-vector products, so fewer, larger ones run faster. For the
same reason queries and keys turn in one RoPE call (a launch per layer saved).
"""

from dataclasses import dataclass, field, fields

import mlx.core as mx
import mlx.nn as nn

from mlx_hybrid.cache import KVCache, tree_mask_over
from mlx_hybrid.models.linear import Linear, fused_project, row_product, swiglu
from mlx_hybrid.rope import apply_rope, apply_rope_at, rope_frequencies
from mlx_hybrid.kernels import kernel_backend
from mlx_hybrid.tree_attention import tree_attention, tree_kernel


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
        self._scale = mx.array([self.scale], mx.float32)  # the tree-attention kernel's input
        qkv = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        self.qkv_proj = Linear(args.hidden_size, qkv, bias=args.attention_bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, args.hidden_size, bias=args.attention_bias)
        self._freqs = rope_frequencies(self.head_dim, args.rope_theta, args.rope_scaling)

    def __call__(self, x: mx.array, cache: KVCache, tree=None) -> mx.array:
        """With `tree` (a `mlx_hybrid.speculative.tree.Tree`), x holds candidate-tree nodes: each
        sees the cache and its ancestors, at position (cache offset or `tree.pos`) + depth, and
        its keys/values wait beside the cache for `accept` (see `KVCache.hold`)."""
        B, L, _ = x.shape
        if tree is None:
            qkv = self.qkv_proj(x).reshape(B, L, -1, self.head_dim).transpose(0, 2, 1, 3)
            qk, v = mx.split(qkv, [self.n_heads + self.n_kv_heads], axis=1)
            q, k = mx.split(apply_rope(qk, self._freqs, cache.offset), [self.n_heads], axis=1)
            k, v = cache.update_and_fetch(k, v)
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=cache.make_mask(L))
            return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
        pos, bound = tree.position(cache.offset)
        depths = tree.node_depths()
        positions = tree.once(("positions", tree.host_offset(cache.offset)), lambda: pos + depths)
        qk, v = self.tree_qkv(x)
        keys, values, row = cache.tree_buffers(L, pos, bound, v)
        if tree_kernel(qk, keys, cache.window):
            out, k = self.tree_attend(qk, v, keys, values, row, positions, tree.once("parents", tree.parent_array), None)
        else:
            out, k = self.tree_attend(qk, v, keys, values, row, positions, None, cache.tree_mask(tree, row, depths))
        cache.hold(row, k, v)
        return out[None]

    def tree_qkv(self, x: mx.array, norm: nn.RMSNorm | None = None) -> tuple[mx.array, mx.array]:
        """Queries and keys (1, heads + kv_heads, nodes, head_dim) before RoPE, and values (1,
        kv_heads, nodes, head_dim), of tree nodes x ([1,] nodes, hidden), normalized first by
        `norm` if given (in the projection's launch: `linear.fused_project`): views of the projection."""
        qkv = fused_project(self.qkv_proj, x, norm)
        qk, v = mx.split(qkv.reshape(x.shape[-2], -1, 1, self.head_dim), [self.n_heads + self.n_kv_heads], axis=1)
        return qk.transpose(2, 1, 0, 3), v.transpose(2, 1, 0, 3)

    def tree_attend(self, qk, v, keys, values, row, positions, parents, mask, residual=None) -> tuple[mx.array, mx.array]:
        """The nodes' attention output, projected (nodes, hidden) and added to `residual` if
        given, and their keys after RoPE (at positions): over the cache buffers' rows before
        `row` and each node's own ancestors, by the tree kernel (mask None), which turns the
        queries and keys itself, or by MLX's RoPE and attention with `mask` over the buffer
        followed by the nodes."""
        q, k = mx.split(qk, [self.n_heads], axis=1)
        if mask is None:
            out, k = tree_attention(q, keys, values, k, v, parents, row, self._scale, positions, self._freqs, backend=kernel_backend())
        else:
            # a node per batch entry in RoPE, so that each gets its own position
            q, k = mx.split(apply_rope_at(qk.transpose(2, 1, 0, 3), self._freqs, positions).transpose(2, 1, 0, 3), [self.n_heads], axis=1)
            keys, values = mx.concatenate([keys, k], axis=2), mx.concatenate([values, v], axis=2)
            out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask).transpose(0, 2, 1, 3)
        return fused_project(self.o_proj, out.reshape(q.shape[2], -1), residual=residual), k


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_up_proj = Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(swiglu(gate, up))

    def nodes(self, h: mx.array, norm: nn.RMSNorm) -> mx.array:
        """h + self(norm(h)) for a verification pass's nodes h (nodes, hidden): on the row kernel
        two launches, the norm in the first and SwiGLU and the residual in the second."""
        return fused_project(self.down_proj, fused_project(self.gate_up_proj, h, norm), gated=True, residual=h)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cache: KVCache, tree=None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache, tree)
        return h + self.mlp(self.post_attention_layernorm(h))

    def compiles_tree(self, cache) -> bool:
        """Whether `placed_tree` can run this layer's share of a compiled pass over cache."""
        return type(cache) is KVCache and cache.window is None and cache.keys is not None

    def placed_tree(self, h: mx.array, keys: mx.array, values: mx.array, at: "PlacedTree"):
        """This layer over tree nodes h inside the compiled pass (`Model._placed_tree_arrays`),
        with the cache's buffers; returns h and the nodes' keys and values (for `KVCache.hold`)."""
        attn = self.self_attn
        qk, v = attn.tree_qkv(h, self.input_layernorm)
        h, k = attn.tree_attend(qk, v, keys, values, at.pos, at.positions, at.parents, at.mask(qk, keys), residual=h)
        return self.mlp.nodes(h, self.post_attention_layernorm), (k, v)


@dataclass
class PlacedTree:
    """A placed tree's arrays as a compiled pass sees them (node 0 at pos; positions = pos +
    depths), and the attention mask, built once for the layers when the tree kernel is not used."""

    pos: mx.array
    positions: mx.array
    parents: mx.array
    visible: mx.array
    _mask: mx.array | None = None

    def mask(self, qk: mx.array, keys: mx.array) -> mx.array | None:
        if tree_kernel(qk, keys, None):
            return None
        if self._mask is None:
            self._mask = tree_mask_over(keys.shape[2], self.pos, self.visible)
        return self._mask


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, tokens: mx.array, cache: list, tree=None) -> mx.array:
        h = self.embed_tokens(tokens)
        for layer, c in zip(self.layers, cache):
            h = layer(h, c) if tree is None else layer(h, c, tree)
        return self.norm(h)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = LlamaModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        self._placed_tree_fn = None  # `_placed_tree_arrays` compiled, made at the first such pass

    def __call__(self, tokens: mx.array, cache: list | None = None, return_hidden: bool = False, tree=None):
        """Logits (batch, length, vocab) for tokens (batch, length); also the final hidden states if asked.

        Without a cache the tokens are a whole sequence from position 0 (a throwaway cache gives the
        same masks, sliding window included, as generation uses). With a `tree`
        (`mlx_hybrid.speculative.tree.Tree`, batch 1) the tokens are speculative candidates that
        continue the cache; the caches keep them pending until `accept(path)` (mlx_hybrid/cache.py).
        """
        if tree is not None and tree.pos is not None and self._compiles_placed_trees(cache):
            logits, h = self._placed_tree(tokens, cache, tree)
        else:
            h = self.model(tokens, cache if cache is not None else self.make_cache(), tree)
            logits = self._logits(h)
        return (logits, h) if return_hidden else logits

    def _logits(self, h: mx.array) -> mx.array:
        if not self.args.tie_word_embeddings:
            return self.lm_head(h)
        embed = self.model.embed_tokens  # a pass's nodes on the row kernel, as the projections (linear.py)
        y = row_product(h, embed.weight) if type(embed) is nn.Embedding else None
        return embed.as_linear(h) if y is None else y

    def _compiles_placed_trees(self, cache: list) -> bool:
        return all(layer.compiles_tree(c) for layer, c in zip(self.layers, cache))

    def _placed_tree(self, tokens: mx.array, cache: list, tree) -> tuple[mx.array, mx.array]:
        """A greedy pass's tree, placed on the device (`Tree.at`), through one compiled function
        of arrays. Such passes repeat their shapes (the buffers grow every `STEP` tokens), so it is
        traced once a shape and replayed: a pass of a small model is bound by the host's time per
        op, which replaying cuts to MLX's own, without Python building a few hundred ops again.
        Each layer hands in two arrays (a KV cache's buffers, a recurrent layer's window and
        state) and gets two back (the nodes' keys and values, or the window and state after each
        node). The trace keeps the weights the model has at the first such pass."""
        n, bound = tokens.shape[1], tree.bound
        for c in cache:
            if isinstance(c, KVCache):
                c.make_room(n, bound)
        if self._placed_tree_fn is None:
            self._placed_tree_fn = mx.compile(self._placed_tree_arrays)
        arrays = [a for c in cache for a in c.state]
        logits, h, *held = self._placed_tree_fn(tokens, tree.pos, tree.node_depths(), tree.parent_array(), tree.visible(), *arrays)
        for c, a, b in zip(cache, held[::2], held[1::2]):
            if isinstance(c, KVCache):
                c.hold(c.buffer_row(tree.pos), a, b)  # room made above
            else:
                c.hold_nodes([a, b])
        return logits, h

    def _placed_tree_arrays(self, tokens, pos, depths, parents, visible, *arrays):
        """Logits, hidden states and each layer's two held arrays (see `_placed_tree`) of tree
        nodes tokens (1, n) with node 0 at pos, over caches whose arrays (two a layer, in turn)
        hold the context before pos."""
        # The nodes as rows of a matrix (nodes, hidden): no projection then reshapes them (each
        # reshape is a node of the graph, which costs the host about a microsecond a pass).
        h, at, held = self.model.embed_tokens(tokens.reshape(-1)), PlacedTree(pos, pos + depths, parents, visible), []
        for layer, a, b in zip(self.layers, arrays[::2], arrays[1::2]):
            h, kept = layer.placed_tree(h, a, b, at)
            held += kept
        h = self.model.norm(h)
        return self._logits(h)[None], h[None], *held

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
