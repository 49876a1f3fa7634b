"""DSLA-Serve checkpoints (utnslab/DSLA-Serve) as `hybrid convert` reads them.

DSLA-Serve distills a Hugging Face Llama into one whose layers in `dsla_list` run its
`DualStateLinearAttention` (src/layer.py) as `self_attn`, and saves it with transformers'
`save_pretrained` (src/run_distill.py): a Llama config.json with the extra fields `dsla_list` and
`kernel_hidden_size` (the gates' width per head; `layer_to_train` too), and the DSLA layers'
tensors under the attention's prefix `model.layers.{i}.self_attn.`: `q_proj`, `k_proj`, `v_proj`,
`o_proj` (no bias, and as many K/V heads as query heads whatever the base model groups),
`gk_proj`, `gk_proj2` (full rank, with bias) and `alpha_list` (2). The layer's head size is
hidden_size / num_attention_heads, and its gate normalizer (16), log-gate clamp (-50), softmax
mix, and lack of RoPE and of an output norm are fixed in its code.

Converted, the model is this project's `llama_hybrid` with those layers `dsla` in DSLA-Serve's
form (`mlx_hybrid.models.hybrid.DSLA`) and their tensors under `model.layers.{i}.dsla.`.
"""

# The config of their layer's form in ours (docs/formats/hybrid-checkpoint.md); dsla_kv_heads = heads.
FORM = dict(gate_rank=0, gate_norm=16.0, gate_clamp=-50.0, dsla_mix="softmax", dsla_o_norm=False)
FIELDS = ("dsla_list", "kernel_hidden_size", "layer_to_train")  # theirs, beside the Llama config's


def is_dsla_serve(config: dict) -> bool:
    return config.get("model_type") == "llama" and bool(config.get("dsla_list"))


def hybrid_config(config: dict) -> dict:
    """Our `llama_hybrid` config for a DSLA-Serve config.json; ValueError for what their layer cannot be."""
    layers, heads, hidden = config["num_hidden_layers"], config["num_attention_heads"], config["hidden_size"]
    dsla = config["dsla_list"]
    if not isinstance(dsla, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in dsla):
        raise ValueError(f"dsla_list must list layer indices in [0, {layers}), got {dsla!r}")
    head_dim = hidden // heads
    if head_dim * heads != hidden or config.get("head_dim", head_dim) != head_dim:
        raise ValueError(f"DSLA-Serve's layer has heads of hidden_size / num_attention_heads; this config's head_dim is {config.get('head_dim')}")
    if config.get("kernel_hidden_size", head_dim) != head_dim:
        raise ValueError(f"kernel_hidden_size {config['kernel_hidden_size']} is not the head size {head_dim} (the gates gate the keys)")
    if config.get("attention_bias"):
        raise ValueError("DSLA-Serve's layer has no q/k/v/o biases; a model with attention_bias is not one of its checkpoints")
    base = {k: v for k, v in config.items() if k not in FIELDS}
    kinds = ["dsla" if i in dsla else "attention" for i in range(layers)]
    return dict(base, model_type="llama_hybrid", base_model_type="llama", mixer_types=kinds, dsla_kv_heads=heads, **FORM)


def renames(config: dict) -> list[tuple[str, str]]:
    """(source prefix, converted prefix) of the DSLA layers' tensors: their `self_attn.`, our `dsla.`."""
    return [(f"model.layers.{i}.self_attn.", f"model.layers.{i}.dsla.") for i in config["dsla_list"]]
