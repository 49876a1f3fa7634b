"""Stages that train speculative-decoding heads for a base model (teacher or hybrid):

medusa     Medusa-1: K heads on a frozen base, head k's cross-entropy (or, with `distill`, its KL to the
           base's distribution) weighted 0.8^k
medusa2    Medusa-2: heads and backbone together, heads first (warm-up), differential learning
           rates, KL to a frozen copy of the original model instead of the LM loss (self-distillation)
redrafter  ReDrafter: a recurrent drafter distilled from the base's distributions along its own
           greedy continuations (T drafted steps per position)
draft      a draft model for draft-model speculation: a few of the base's layers (a Llama still, so
           mlx-lm's speculative decoding loads it too), distilled from the base along the same data

Data: `pseudo-labels` of the base itself (Medusa's self-distillation; greedy for ReDrafter, so every
position's T-token greedy continuation is the sequence itself). With `eval_data` (held-out greedy
pseudo-labels) each stage writes the top-1 accuracy of every head / drafted step to out/report.json.
Exports in docs/formats/speculative-heads.md's layout: out/medusa/, out/redrafter/, and for Medusa-2
the changed backbone with its heads, out/model/ + out/model/medusa/ (a Llama/Mistral base stays one:
Hugging Face's format, `model.save_model`); the draft model in Hugging Face's format, out/draft/.
"""

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from hybrid_train import data
from hybrid_train.errors import TrainError
from hybrid_train.heads import (Drafter, MedusaHeads, MedusaLM, ahead_mask, examples_from, hidden_states, load_base,
                                save_heads, top1_accuracy)
from hybrid_train.losses import IGNORE, distill_loss, kd_loss, medusa_loss
from hybrid_train.model import save_model
from hybrid_train.shrink import keep_layers
from hybrid_train.teacher import load_teacher, load_tokenizer
from hybrid_train.train import Dist, TrainConfig, train


@dataclass
class MedusaConfig(TrainConfig):
    base: str = ""  # HF directory, .gguf or hybrid directory
    data: str = ""  # pseudo-labels of the base (.jsonl)
    eval_data: str | None = None  # held-out greedy pseudo-labels: accuracy per head in out/report.json
    num_heads: int = 4
    num_layers: int = 1  # ResBlocks per head
    decay: float = 0.8  # lambda_k = decay^k
    distill: bool = False  # KL to the base's distribution ahead (soft labels) instead of CE on its token
    lr: float = 1e-3
    tied_lm_head: bool = False  # Medusa-1: the heads end with the frozen base's LM head, none of their own (heads.MedusaHeads)


@dataclass
class Medusa2Config(MedusaConfig):
    init_heads: str | None = None  # a medusa/ directory (Medusa-1's) to start the heads from
    heads_warmup: int = 0  # steps that train the heads alone before the backbone joins
    backbone_lr: float = 2.5e-4  # the paper's heads lr is 4x the backbone's
    lambda0: float = 0.2  # loss = KL(original || backbone) + lambda0 * Medusa-1 loss
    freeze: list | None = None  # backbone parameter-name components kept frozen


@dataclass
class ReDrafterConfig(TrainConfig):
    base: str = ""
    data: str = ""  # greedy pseudo-labels of the base (.jsonl)
    eval_data: str | None = None
    draft_steps: int = 4  # T, tokens drafted after the base's own (beam_length T + 1)
    exit_dim: int | None = None  # default 2 * hidden (no input_proj)
    num_draft_layers: int = 2
    rnn: bool = True
    tied_lm_head: bool = False  # the base's LM head, not one of its own (heads.Drafter)
    beam_width: int = 4  # the runtime's default beam, written to config.json
    lr: float = 1e-3


@dataclass
class DraftConfig(TrainConfig):
    base: str = ""  # a Llama/Mistral (HF directory or .gguf)
    data: str = ""  # greedy pseudo-labels of the base (.jsonl)
    eval_data: str | None = None
    layers: list = field(default_factory=lambda: [0, 6, 12, 18, 24, 29])  # the base's layers the draft keeps
    alpha: float = 0.0  # weight of the NLL of the base's greedy tokens
    beta: float = 1.0  # weight of KL(base || draft), the acceptance-relevant distance under sampling
    num_draft: int = 4  # K, drafted tokens a step: the report's accepted-run cap
    lr: float = 3e-4


def _check(cfg):
    for name in ("base", "data"):
        if not getattr(cfg, name):
            raise TrainError(f"config: '{name}' is required")
    if getattr(cfg, "num_heads", 1) < 1 or getattr(cfg, "draft_steps", 1) < 1:
        raise TrainError("config: num_heads and draft_steps must be at least 1")


def _dtype(env: Dist):
    return torch.bfloat16 if env.device.type == "cuda" else torch.float32


def _report(cfg, env: Dist, method: str, examples: int, began: float, measure):
    """out/report.json: settings, seconds, and `measure(held-out examples, device)` (the held-out top-1
    accuracy per head / drafted step)."""
    if not env.main:
        return
    report = {"method": method, "base": cfg.base, "train_examples": examples, "train_seconds": round(time.time() - began, 1),
              "config": asdict(cfg)}
    if cfg.eval_data:
        began = time.time()
        held = examples_from(cfg.eval_data, cfg.seq_len)
        with torch.autocast(env.device.type, dtype=torch.bfloat16, enabled=env.device.type == "cuda"):
            report["heldout"] = measure(held, env.device)
        report["eval_seconds"] = round(time.time() - began, 1)
    tmp = Path(cfg.out) / "report.json.tmp"
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(tmp, Path(cfg.out) / "report.json")


def _ahead_masks(labels, n: int):
    """Each Medusa head's / drafted step's positions (`ahead_mask`), k = 1..n."""
    return [ahead_mask(labels, k) for k in range(1, n + 1)]


def _ahead(x, masks):
    """x[:, k:] at the positions masks[k-1] selects, k = 1..: each head's / step's targets (the
    tokens ahead, or the base's distributions there)."""
    return [x[:, k:][m] for k, m in enumerate(masks, 1)]


def _heads_loss(cfg, head_logits, masks, labels, base_logits):
    """Medusa-1's loss (eq. 1): CE on the tokens ahead, or with `distill` the KL to the base's
    distributions there (Medusa's self-distillation with soft labels, as ReDrafter's drafter learns;
    on greedy pseudo-labels their argmax is the token). base_logits: (batch, L, vocab), or None
    without `distill`."""
    if cfg.distill:
        return kd_loss(head_logits, _ahead(base_logits, masks), cfg.decay)
    return medusa_loss(head_logits, _ahead(labels, masks), cfg.decay)


def medusa(cfg: MedusaConfig, resume: bool = False):
    """Medusa-1: heads on a frozen base."""
    _check(cfg)
    env = Dist()
    base = load_base(cfg.base, _dtype(env), env.device)
    examples = examples_from(cfg.data, cfg.seq_len)
    torch.manual_seed(cfg.seed)
    heads = MedusaHeads.for_base(base, cfg.num_heads, cfg.num_layers, cfg.tied_lm_head)

    def loss_fn(model, batch):
        masks = _ahead_masks(batch["labels"], cfg.num_heads)
        with torch.no_grad():
            h = hidden_states(base, batch["input_ids"])
            base_logits = base.lm_head(h) if cfg.distill else None
        return _heads_loss(cfg, model(h, masks), masks, batch["labels"], base_logits)

    began = time.time()
    heads = train(cfg, heads, examples, loss_fn, resume, env, label=f"medusa-1 ({cfg.num_heads} heads)")
    if env.main:
        save_heads(heads, heads.config(), Path(cfg.out) / "medusa")
    _report(cfg, env, "medusa-1", len(examples), began, lambda held, device: top1_accuracy(base, held, device, medusa=heads))
    env.barrier()


def medusa2(cfg: Medusa2Config, resume: bool = False):
    """Medusa-2: heads and backbone together, against a frozen copy of the original."""
    _check(cfg)
    if cfg.tied_lm_head:
        raise TrainError("tied_lm_head is for Medusa-1 (stage medusa): Medusa-2 trains the LM head the heads would end with")
    env = Dist()
    original = load_base(cfg.base, _dtype(env), env.device)
    examples = examples_from(cfg.data, cfg.seq_len)
    torch.manual_seed(cfg.seed)
    backbone = load_base(cfg.base)  # float32 weights to train
    for name, p in backbone.named_parameters():
        p.requires_grad_(not any(part in name.split(".") for part in cfg.freeze or []))
    heads = MedusaHeads.for_base(backbone, cfg.num_heads, cfg.num_layers)
    if cfg.init_heads:
        config = json.loads((Path(cfg.init_heads) / "config.json").read_text())
        if (config["medusa_num_heads"], config["medusa_num_layers"]) != (cfg.num_heads, cfg.num_layers):
            raise TrainError(f"{cfg.init_heads} holds {config['medusa_num_heads']} heads of {config['medusa_num_layers']} "
                             f"layers, the config asks for {cfg.num_heads} of {cfg.num_layers}")
        heads.load_state_dict(load_file(str(Path(cfg.init_heads) / "model.safetensors")))
    model = MedusaLM(backbone, heads)
    groups = [{"params": list(heads.parameters()), "lr": cfg.lr},
              {"params": [p for p in backbone.parameters() if p.requires_grad], "lr": cfg.backbone_lr, "delay": cfg.heads_warmup}]

    def loss_fn(model, batch):
        masks = _ahead_masks(batch["labels"], cfg.num_heads)
        with torch.no_grad():
            reference = original(input_ids=batch["input_ids"], use_cache=False).logits
        logits, head_logits = model(batch["input_ids"], masks)
        kl, _ = distill_loss(logits, reference, batch["labels"], alpha=0.0, beta=1.0)  # KL(original || backbone)
        heads_loss, parts = _heads_loss(cfg, head_logits, masks, batch["labels"], reference)
        return kl + cfg.lambda0 * heads_loss, {"kl": kl.detach(), **parts}

    began = time.time()
    model = train(cfg, model, examples, loss_fn, resume, env, label=f"medusa-2 ({cfg.num_heads} heads)", groups=groups,
                  frozen=(original,))
    if env.main:
        save_model(model.base, Path(cfg.out) / "model", load_tokenizer(cfg.base))
        save_heads(model.heads, model.heads.config(), Path(cfg.out) / "model" / "medusa")
    _report(cfg, env, "medusa-2", len(examples), began,
            lambda held, device: top1_accuracy(model.base, held, device, medusa=model.heads))
    env.barrier()


def redrafter(cfg: ReDrafterConfig, resume: bool = False):
    """ReDrafter: a recurrent drafter distilled from the frozen base."""
    _check(cfg)
    env = Dist()
    base = load_base(cfg.base, _dtype(env), env.device)
    embed = base.get_input_embeddings()
    examples = examples_from(cfg.data, cfg.seq_len)
    torch.manual_seed(cfg.seed)
    drafter = Drafter.for_base(base, cfg.exit_dim, cfg.num_draft_layers, cfg.rnn, cfg.tied_lm_head)

    def loss_fn(model, batch):
        ids, labels = batch["input_ids"], batch["labels"]
        masks = _ahead_masks(labels, cfg.draft_steps)
        with torch.no_grad():
            h = hidden_states(base, ids)
            logits = base.lm_head(h)  # the base's distribution at t+j is step j's target at t
            targets = _ahead(logits, masks)
            e = embed(ids)
        return kd_loss(model(h, e, masks), targets)

    began = time.time()
    drafter = train(cfg, drafter, examples, loss_fn, resume, env, label=f"redrafter ({cfg.draft_steps} steps)")
    if env.main:
        save_heads(drafter, drafter.config(cfg.beam_width, cfg.draft_steps + 1), Path(cfg.out) / "redrafter")
    _report(cfg, env, "redrafter", len(examples), began,
            lambda held, device: top1_accuracy(base, held, device, drafter=drafter, steps=cfg.draft_steps))
    env.barrier()


@torch.no_grad()
def draft_accuracy(model, examples: list, device, num_draft: int, batch_size: int = 8) -> dict:
    """On the base's greedy continuations: how often the draft's top-1 is the base's next token, and
    the mean run of agreeing tokens from each position, capped at num_draft. Greedy draft-model
    speculation from that position accepts exactly that run (the draft, fed the accepted prefix,
    is teacher-forced here), so 1 + accepted estimates tokens a target pass."""
    hits = runs = count = 0
    for i in range(0, len(examples), batch_size):
        batch = {k: v.to(device) for k, v in data.collate(examples[i : i + batch_size]).items()}
        labels = batch["labels"]
        mask = labels != IGNORE
        right = (model(input_ids=batch["input_ids"], use_cache=False).logits.argmax(-1) == labels) & mask
        run = torch.zeros(labels.shape[0], labels.shape[1] + 1, dtype=torch.long, device=device)  # agreeing tokens from t on
        for t in range(labels.shape[1] - 1, -1, -1):
            run[:, t] = torch.where(right[:, t], (run[:, t + 1] + 1).clamp(max=num_draft), 0)
        run = run[:, :-1]
        hits += int(right.sum())
        runs += int(run[mask].sum())
        count += int(mask.sum())
    return {"top1": hits / max(count, 1), "accepted": runs / max(count, 1), "num_draft": num_draft, "positions": count,
            "examples": len(examples)}


def draft(cfg: DraftConfig, resume: bool = False):
    """A draft model: the base's layers `layers`, distilled from the frozen base."""
    _check(cfg)
    env = Dist()
    base = load_teacher(cfg.base, _dtype(env), env.device)
    examples = examples_from(cfg.data, cfg.seq_len)
    torch.manual_seed(cfg.seed)
    model = keep_layers(load_teacher(cfg.base).requires_grad_(True), cfg.layers).to(env.device)

    def loss_fn(model, batch):
        with torch.no_grad():
            target = base(input_ids=batch["input_ids"], use_cache=False).logits
        logits = model(input_ids=batch["input_ids"], use_cache=False).logits
        return distill_loss(logits, target, batch["labels"], cfg.alpha, cfg.beta)

    began = time.time()
    model = train(cfg, model, examples, loss_fn, resume, env, label=f"draft ({len(cfg.layers)} layers)")
    if env.main:
        save_model(model, Path(cfg.out) / "draft", load_tokenizer(cfg.base))
    _report(cfg, env, "draft", len(examples), began, lambda held, device: draft_accuracy(model, held, device, cfg.num_draft))
    env.barrier()


HEAD_STAGES = {
    "medusa": (medusa, MedusaConfig),
    "medusa2": (medusa2, Medusa2Config),
    "redrafter": (redrafter, ReDrafterConfig),
    "draft": (draft, DraftConfig),
}
