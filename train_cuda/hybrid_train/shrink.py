"""A student smaller than its teacher: fewer layers and a trimmed vocabulary.

The embedded default model must fit in 25 MB at 4 bits, about 40 M parameters, and SmolLM2-135M's
embedding alone holds 28 M. So the student keeps some of the teacher's layers (their weights as
they are, before hybrid conversion and distillation) and the tokens its training text uses.

Vocabulary trimming keeps a byte-level BPE tokenizer valid: every single-character (byte) token
and every special token stays, each kept token brings the two tokens its merge joins (recursively,
so it can still be produced), and only the merges of kept tokens stay, in their order. Any text
still encodes; a word whose merge was dropped comes out in more, smaller pieces. Kept tokens keep
their order, so new id k is old id keep[k], and the student's embedding rows are the teacher's
rows keep.
"""

import json
import tempfile
from collections import Counter
from pathlib import Path

import torch
from torch import nn
from transformers import AutoTokenizer

from hybrid_train.errors import TrainError


def keep_layers(model, layers: list[int]):
    """Keep only the decoder layers `layers` (teacher indices, in order), in place."""
    n = model.config.num_hidden_layers
    if not layers or sorted(set(layers)) != list(layers) or not all(isinstance(i, int) and 0 <= i < n for i in layers):
        raise TrainError(f"layers must be increasing layer indices in [0, {n}), got {layers}")
    model.model.layers = nn.ModuleList(model.model.layers[i] for i in layers)
    for k, layer in enumerate(model.model.layers):
        layer.self_attn.layer_idx = k  # the KV-cache slot
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in layers]
    model.config.num_hidden_layers = len(layers)
    return model


def _merges(model: dict) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]


def trim_vocab(tokenizer, counts: Counter, size: int):
    """(student tokenizer, keep): `size` tokens, the most used by `counts` (old id -> uses) first, with
    the bytes, the special tokens and the merge parents they need; keep[new id] = old id."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise TrainError(f"vocabulary trimming needs a BPE tokenizer, this one is {model.get('type')}")
    vocab = model["vocab"]
    token = {i: t for t, i in vocab.items()}
    parents = {}
    for a, b in _merges(model):
        parents.setdefault(a + b, (a, b))
    outside = [a["content"] for a in spec["added_tokens"] if a["content"] not in vocab]
    if outside:
        raise TrainError(f"special token {outside[0]!r} is not in the BPE vocabulary; trimming keeps ids in one table")
    kept = {t for t in vocab if len(t) == 1} | {a["content"] for a in spec["added_tokens"]}
    if len(kept) > size:
        raise TrainError(f"vocab_size {size} is below the {len(kept)} byte and special tokens every text may need")

    def closure(t: str) -> set[str]:
        need, todo = set(), [t]
        while todo:
            t = todo.pop()
            if t not in kept and t not in need:
                need.add(t)
                todo += parents.get(t, ())
        return need

    # The text's tokens by use, then the rest in the teacher's order (earlier merges are commoner).
    for i in [i for i, _ in counts.most_common()] + sorted(token):
        need = closure(token[i])
        if len(kept) + len(need) <= size:
            kept |= need
        if len(kept) == size:
            break
    keep = sorted(vocab[t] for t in kept)
    new_id = {old: new for new, old in enumerate(keep)}
    model["vocab"] = {token[old]: new for new, old in enumerate(keep)}
    model["merges"] = [[a, b] for a, b in _merges(model) if a in kept and b in kept and a + b in kept]
    for added in spec["added_tokens"]:
        added["id"] = new_id[added["id"]]
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        (Path(tmp) / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
        config = Path(tmp) / "tokenizer_config.json"
        settings = json.loads(config.read_text())
        if "added_tokens_decoder" in settings:
            settings["added_tokens_decoder"] = {str(new_id[int(k)]): v for k, v in settings["added_tokens_decoder"].items()}
            config.write_text(json.dumps(settings))
        student = AutoTokenizer.from_pretrained(tmp, trust_remote_code=False)
    return student, keep


@torch.no_grad()
def keep_rows(model, keep: list[int]):
    """Cut the embedding and LM head to the rows `keep` (old ids, in new-id order), in place."""
    index = torch.tensor(keep, device=model.lm_head.weight.device)
    embed = nn.Embedding(len(keep), model.config.hidden_size).to(model.lm_head.weight)
    embed.weight.copy_(model.model.embed_tokens.weight[index])
    head = nn.Linear(model.config.hidden_size, len(keep), bias=False).to(model.lm_head.weight)
    if model.config.tie_word_embeddings:
        head.weight = embed.weight
    else:
        head.weight.copy_(model.lm_head.weight[index])
    model.model.embed_tokens, model.lm_head = embed, head
    model.config.vocab_size = len(keep)
    new_id = {old: new for new, old in enumerate(keep)}
    for config in (model.config, getattr(model, "generation_config", None)):
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            old = getattr(config, name, None)
            if isinstance(old, list):
                setattr(config, name, [new_id[i] for i in old if i in new_id])
            elif old is not None:
                setattr(config, name, new_id.get(old))
    return model


def token_counts(sequences) -> Counter:
    """Uses of each token id over id lists."""
    counts = Counter()
    for ids in sequences:
        counts.update(ids)
    return counts


def reencode(ids: list[int], source, target) -> list[int]:
    """Token ids of one tokenizer as another's: decoded (special tokens kept) and encoded again."""
    return target(source.decode(ids), add_special_tokens=False).input_ids
