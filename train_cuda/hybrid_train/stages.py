"""The stages, one function and one config dataclass each (fields = the keys of its config file).

pseudo-labels  the teacher answers prompts; its answers are the distillation data (SeqKD)
distill        attention-initialized hybrid, eq. 2 loss (NLL of pseudo-labels + beta word-level KL)
sft            supervised fine-tuning on prompt/response pairs
dpo            distilled DPO: preference pairs, the teacher as the reference model
dsla           DSLA-Serve's chained conversion: one layer at a time in ascending attention entropy,
               all else frozen, KL to the teacher + lambda * gate similarity
perplexity     perplexity of models on held-out text, and the ratio to the first (the teacher)
"""

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from hybrid_train import data, layers, shrink
from hybrid_train.errors import TrainError
from hybrid_train.head_stages import HEAD_STAGES
from hybrid_train.heads import is_recurrent, load_base
from hybrid_train.losses import distill_loss, dpo_loss, nll_loss, sequence_logprob
from hybrid_train.model import HybridArgs, convert_layers, load_hybrid, mixer_types, save_hybrid
from hybrid_train.teacher import load_teacher, load_tokenizer
from hybrid_train.train import Dist, TrainConfig, train


@dataclass
class PseudoLabelConfig:
    teacher: str  # HF directory, .gguf, or a hybrid directory (for training heads on a hybrid)
    prompts: str
    out: str  # .jsonl
    max_new_tokens: int = 256
    batch_size: int = 16
    chat: bool = True  # wrap each prompt as a user turn in the teacher's chat template
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0


@dataclass
class DistillConfig(TrainConfig):
    teacher: str = ""
    data: str = ""  # pseudo-labels .jsonl
    text: list = field(default_factory=list)  # plain-text files: blocks of seq_len added to the data, loss on every token
    init: str | None = None  # a hybrid directory to convert further (stepwise: 50% -> 25%); default the teacher
    mixer: str = "mamba2"  # mamba, mamba2 or dsla
    attention: dict = field(default_factory=lambda: {"every": 2})  # which layers keep attention (layers.py)
    calibration: str | None = None  # prompts for the attention-entropy ranking
    hybrid: dict = field(default_factory=dict)  # HybridArgs: d_state, d_conv, ...
    alpha: float = 1.0
    beta: float = 0.1
    freeze: list = field(default_factory=lambda: ["mlp"])  # parameter-name components to freeze
    calibrate: int = 8  # examples whose attention activations initialize new Mamba2 mixers (Mamba2.calibrate); 0: none
    layers: list | None = None  # a smaller student: the teacher layers it keeps (shrink.keep_layers); default all
    vocab_size: int | None = None  # a smaller student: its vocabulary trimmed to this many tokens (shrink.trim_vocab)


@dataclass
class SFTConfig(TrainConfig):
    model: str = ""
    data: str = ""  # .jsonl with prompt, response
    chat: bool = True
    freeze: list = field(default_factory=list)


@dataclass
class DPOConfig(TrainConfig):
    model: str = ""
    teacher: str = ""  # the reference model
    data: str = ""  # .jsonl with prompt, chosen, rejected
    beta: float = 0.1
    chat: bool = True
    freeze: list = field(default_factory=list)


@dataclass
class DSLAConfig(TrainConfig):
    """steps is per converted layer."""

    teacher: str = ""
    data: list = field(default_factory=list)  # plain-text files
    attention: dict = field(default_factory=lambda: {"entropy": True, "keep": 0.5})
    calibration: str | None = None
    hybrid: dict = field(default_factory=dict)
    lam: float = 0.1  # weight of the contrastive gate term (eq. 10)


@dataclass
class PerplexityConfig:
    models: list  # directories (hybrid or Hugging Face) or .gguf files; the first is the reference
    text: list  # plain-text files
    out: str  # .json report
    seq_len: int = 512
    batch_size: int = 8
    max_blocks: int | None = None


def parse(cls, raw: dict):
    """A config dataclass from a dict, with one-line errors for unknown or missing keys."""
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise TrainError(f"unknown config key '{unknown[0]}' (known: {', '.join(sorted(names))})")
    try:
        cfg = cls(**raw)
    except TypeError as e:
        raise TrainError(f"config: {e}") from None
    for name in ("teacher", "data", "model"):
        if name in names and not getattr(cfg, name):
            raise TrainError(f"config: '{name}' is required")
    return cfg


def _hybrid_args(raw: dict) -> HybridArgs:
    names = {f.name for f in fields(HybridArgs)}
    if set(raw) - names:
        raise TrainError(f"unknown hybrid key '{sorted(set(raw) - names)[0]}' (known: {', '.join(sorted(names))})")
    return HybridArgs(**raw)


def _teacher_dtype(env: Dist):
    return torch.bfloat16 if env.device.type == "cuda" else torch.float32


def _freeze(model, parts: list[str]):
    for name, p in model.named_parameters():
        p.requires_grad_(not any(part in name.split(".") for part in parts))


def _logits(model, batch):
    return model(input_ids=batch["input_ids"], use_cache=False).logits


def _entropy_ranking(cfg, teacher, tokenizer, env: Dist) -> list[float] | None:
    if "entropy" not in cfg.attention:
        return None
    if not cfg.calibration:
        raise TrainError("attention.entropy needs calibration: a prompt file")
    prompts = [data.encode_prompt(tokenizer, p, chat=False) for p in data.read_prompts(cfg.calibration)]
    entropy = layers.attention_entropy(teacher, prompts)
    if env.main:
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        (Path(cfg.out) / "entropy.json").write_text(json.dumps({"entropy": entropy}, indent=1) + "\n")
    return entropy


def pseudo_labels(cfg: PseudoLabelConfig, resume: bool = False):
    """Teacher answers to every prompt, written as .jsonl (prompt order kept across ranks).

    A hybrid teacher has no KV cache in transformers and its recurrent layers would take left
    padding into their state: it generates without a cache, in batches of equal-length prompts."""
    env = Dist()
    tokenizer = load_tokenizer(cfg.teacher)
    teacher = load_base(cfg.teacher, _teacher_dtype(env), env.device)
    recurrent = is_recurrent(teacher)
    prompts = data.read_prompts(cfg.prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    torch.manual_seed(cfg.seed + env.rank)
    mine = list(range(env.rank, len(prompts), env.world))
    encoded = {i: data.encode_prompt(tokenizer, prompts[i], cfg.chat) for i in mine}
    groups = [mine]
    if recurrent:
        groups = [[i for i in mine if len(encoded[i]) == n] for n in sorted({len(encoded[i]) for i in mine})]
    batches = [g[k : k + cfg.batch_size] for g in groups for k in range(0, len(g), cfg.batch_size)]
    rows = []
    with Progress(disable=not env.main) as progress:
        task = progress.add_task("pseudo-labels", total=len(mine))
        for batch in batches:
            ids = [encoded[i] for i in batch]
            width = max(map(len, ids))
            x = torch.tensor([[pad] * (width - len(s)) + s for s in ids], device=env.device)  # left padding
            mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in ids], device=env.device)
            sample = {"do_sample": True, "temperature": cfg.temperature, "top_p": cfg.top_p} if cfg.temperature else {"do_sample": False}
            with torch.no_grad():
                gen = teacher.generate(input_ids=x, attention_mask=mask, max_new_tokens=cfg.max_new_tokens,
                                       pad_token_id=pad, eos_token_id=eos, use_cache=not recurrent, **sample)
            for i, s, g in zip(batch, ids, gen[:, width:].tolist()):
                response = g[: g.index(eos) + 1] if eos in g else g
                rows.append({"index": i, "prompt": prompts[i], "prompt_ids": s, "response_ids": response,
                             "response": tokenizer.decode(response, skip_special_tokens=True)})
            progress.update(task, advance=len(ids))
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    shard = out.with_suffix(f".rank{env.rank}.tmp")
    shard.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env.barrier()
    if env.main:
        merged = []
        for r in range(env.world):
            part = out.with_suffix(f".rank{r}.tmp")
            merged += [json.loads(line) for line in part.read_text().splitlines()]
            part.unlink()
        merged.sort(key=lambda r: r.pop("index"))
        tmp = out.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in merged))
        os.replace(tmp, out)
    env.barrier()


def distill(cfg: DistillConfig, resume: bool = False):
    """Stepwise hybrid distillation (one step of it: from the teacher, or from `init`), optionally
    into a smaller student (`layers`, `vocab_size`): the teacher then reads the student's tokens
    mapped back to its own ids, and its logits are cut to the student's vocabulary."""
    env = Dist()
    if cfg.mixer not in ("mamba", "mamba2", "dsla"):
        raise TrainError(f"mixer must be mamba, mamba2 or dsla, got '{cfg.mixer}'")
    if cfg.init and (cfg.layers or cfg.vocab_size):
        raise TrainError("layers and vocab_size shrink the teacher; they do not apply to init")
    if cfg.layers and "entropy" in cfg.attention:
        raise TrainError("attention.entropy ranks the teacher's layers: with layers, name the student's (every or layers)")
    tokenizer = load_tokenizer(cfg.teacher)
    teacher = load_teacher(cfg.teacher, _teacher_dtype(env), env.device)
    rows = [(r["prompt_ids"], r["response_ids"]) for r in data.read_jsonl(cfg.data, ("prompt_ids", "response_ids"))]
    torch.manual_seed(cfg.seed)
    student = (load_hybrid(cfg.init) if cfg.init else load_teacher(cfg.teacher)).to(env.device)
    if cfg.layers:
        shrink.keep_layers(student, cfg.layers)
    student_tokenizer, keep = tokenizer, None
    if cfg.vocab_size:
        text = data.text_blocks(tokenizer, cfg.text, cfg.seq_len) if cfg.text else []
        counts = shrink.token_counts([p + r for p, r in rows] + [ids for ids, _ in text])
        student_tokenizer, keep = shrink.trim_vocab(tokenizer, counts, cfg.vocab_size)
        shrink.keep_rows(student, keep)
        rows = [(shrink.reencode(p, tokenizer, student_tokenizer), shrink.reencode(r, tokenizer, student_tokenizer))
                for p, r in rows]
        keep = torch.tensor(keep, device=env.device)
    examples = [data.example(p, r, cfg.seq_len) for p, r in rows]
    if cfg.text:
        examples += data.text_blocks(student_tokenizer, cfg.text, cfg.seq_len)
    n = student.config.num_hidden_layers
    keep_attention = layers.attention_layers(cfg.attention, n, _entropy_ranking(cfg, teacher, tokenizer, env))
    kinds = ["attention" if i in keep_attention else cfg.mixer for i in range(n)]
    args = getattr(student, "hybrid_args", None) if cfg.init and not cfg.hybrid else _hybrid_args(cfg.hybrid)
    calibration = [examples[i][0] for i in torch.randperm(len(examples))[: cfg.calibrate].tolist()]
    convert_layers(student, kinds, args or HybridArgs(), calibration)
    _freeze(student, cfg.freeze)

    def loss_fn(model, batch):
        with torch.no_grad():
            if keep is None:
                target = _logits(teacher, batch)
            else:
                target = teacher(input_ids=keep[batch["input_ids"]], use_cache=False).logits[..., keep]
        return distill_loss(_logits(model, batch), target, batch["labels"], cfg.alpha, cfg.beta)

    label = f"distill {kinds.count('attention')}/{n} attention" + (f", vocabulary {len(student_tokenizer)}" if cfg.vocab_size else "")
    student = train(cfg, student, examples, loss_fn, resume, env, label=label, frozen=(teacher,))
    if env.main:
        save_hybrid(student, Path(cfg.out) / "model", student_tokenizer)
    env.barrier()


def _pairs(tokenizer, prompt: str, responses: list[str], chat: bool, seq_len: int):
    prompt_ids = data.encode_prompt(tokenizer, prompt, chat)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return [data.example(prompt_ids, tokenizer(r, add_special_tokens=False).input_ids + eos, seq_len) for r in responses]


def sft(cfg: SFTConfig, resume: bool = False):
    env = Dist()
    tokenizer = load_tokenizer(cfg.model)
    rows = data.read_jsonl(cfg.data, ("prompt", "response"))
    examples = [_pairs(tokenizer, r["prompt"], [r["response"]], cfg.chat, cfg.seq_len)[0] for r in rows]
    torch.manual_seed(cfg.seed)
    student = load_hybrid(cfg.model)
    _freeze(student, cfg.freeze)
    student = train(cfg, student, examples, lambda m, b: (nll_loss(_logits(m, b), b["labels"]), {}), resume, env, label="sft")
    if env.main:
        save_hybrid(student, Path(cfg.out) / "model", tokenizer)
    env.barrier()


def dpo(cfg: DPOConfig, resume: bool = False):
    env = Dist()
    tokenizer = load_tokenizer(cfg.model)
    reference = load_teacher(cfg.teacher, _teacher_dtype(env), env.device)
    rows = data.read_jsonl(cfg.data, ("prompt", "chosen", "rejected"))
    examples = [tuple(_pairs(tokenizer, r["prompt"], [r["chosen"], r["rejected"]], cfg.chat, cfg.seq_len)) for r in rows]
    torch.manual_seed(cfg.seed)
    student = load_hybrid(cfg.model)
    _freeze(student, cfg.freeze)

    def collate_pairs(pairs):  # rows: all chosen, then all rejected
        return data.collate([c for c, _ in pairs] + [r for _, r in pairs])

    def loss_fn(model, batch):
        with torch.no_grad():
            ref = sequence_logprob(_logits(reference, batch), batch["labels"])
        logp = sequence_logprob(_logits(model, batch), batch["labels"])
        half = len(logp) // 2
        return dpo_loss(logp[:half], logp[half:], ref[:half], ref[half:], cfg.beta)

    student = train(cfg, student, examples, loss_fn, resume, env, collate_fn=collate_pairs, label="dpo",
                    frozen=(reference,))
    if env.main:
        save_hybrid(student, Path(cfg.out) / "model", tokenizer)
    env.barrier()


def dsla(cfg: DSLAConfig, resume: bool = False):
    """Chained fine-tuning (DSLA-Serve section 4.4): convert layers one by one in ascending attention
    entropy; each phase trains only the new DSLA layer against the teacher, then commits it.
    Phase k lives in out/phaseKK-layerI/ (its own checkpoints); the last phase's model is out/model."""
    env = Dist()
    tokenizer = load_tokenizer(cfg.teacher)
    teacher = load_teacher(cfg.teacher, _teacher_dtype(env), env.device)
    examples = data.text_blocks(tokenizer, cfg.data, cfg.seq_len)
    n = teacher.config.num_hidden_layers
    entropy = _entropy_ranking(cfg, teacher, tokenizer, env)
    keep = layers.attention_layers(cfg.attention, n, entropy)
    order = [i for i in (layers.conversion_order(entropy) if entropy else range(n)) if i not in keep]
    args = _hybrid_args(cfg.hybrid)
    torch.manual_seed(cfg.seed)
    student = load_teacher(cfg.teacher)
    for phase, layer in enumerate(order):
        phase_cfg = TrainConfig(**{f.name: getattr(cfg, f.name) for f in fields(TrainConfig)})
        phase_cfg.out = str(Path(cfg.out) / f"phase{phase:02d}-layer{layer}")
        done = Path(phase_cfg.out) / "model"
        if (done / "config.json").is_file():
            if not resume:
                raise TrainError(f"{done} exists: pass --resume to continue that run, or choose another out")
            student = load_hybrid(done)
            continue
        kinds = mixer_types(student)
        kinds[layer] = "dsla"
        convert_layers(student, kinds, args)
        mixer = student.model.layers[layer].dsla
        student.requires_grad_(False)
        mixer.requires_grad_(True)

        def loss_fn(model, batch, mixer=mixer):
            with torch.no_grad():
                target = _logits(teacher, batch)
            loss, parts = distill_loss(_logits(model, batch), target, batch["labels"], alpha=0.0, beta=1.0)
            return loss + cfg.lam * mixer.similarity, {**parts, "gate_similarity": mixer.similarity.detach()}

        student = train(phase_cfg, student, examples, loss_fn, resume, env,
                        label=f"dsla layer {layer} ({phase + 1}/{len(order)})", frozen=(teacher,))
        if env.main:
            save_hybrid(student, done, tokenizer)
        env.barrier()
    if env.main:
        save_hybrid(student, Path(cfg.out) / "model", tokenizer)
    env.barrier()


@torch.no_grad()
def perplexity(cfg: PerplexityConfig, resume: bool = False):
    """Perplexity of each model on the same text, and the ratio to the first model.

    Each model reads the text in its own tokens. Per-token perplexity and its ratio compare models
    of one vocabulary; word perplexity (the same total NLL over the words its blocks cover) also
    compares a student with a trimmed vocabulary to its teacher."""
    env = Dist()
    results, first = [], None
    for path in cfg.models:
        tokenizer = load_tokenizer(path)
        blocks = data.text_blocks(tokenizer, cfg.text, cfg.seq_len)[: cfg.max_blocks]
        model = (load_teacher(path) if str(path).endswith(".gguf") else load_hybrid(path)).to(env.device).eval()
        nll, count = 0.0, 0
        for k in range(0, len(blocks), cfg.batch_size):
            batch = {n: t.to(env.device) for n, t in data.collate(blocks[k : k + cfg.batch_size]).items()}
            with torch.autocast(env.device.type, dtype=torch.bfloat16, enabled=env.device.type == "cuda"):
                logits = _logits(model, batch)
            nll += float(nll_loss(logits, batch["labels"])) * batch["labels"].numel()
            count += batch["labels"].numel()
        words = sum(len(tokenizer.decode(labels).split()) for _, labels in blocks)
        kinds = mixer_types(model)
        vocabulary = tokenizer.get_vocab()
        first = first or vocabulary
        results.append({"model": str(path), "attention_layers": kinds.count("attention"), "layers": len(kinds),
                        "vocab_size": len(tokenizer), "same_vocabulary": vocabulary == first, "ppl": float(torch.tensor(nll / count).exp()), "tokens": count,
                        "word_ppl": float(torch.tensor(nll / words).exp()), "words": words})
        del model
    for r in results:
        r["ratio"] = r["ppl"] / results[0]["ppl"] if r.pop("same_vocabulary") else None
        r["word_ratio"] = r["word_ppl"] / results[0]["word_ppl"]
    if env.main:
        out = Path(cfg.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1) + "\n")
        table = Table("model", "attention", "vocabulary", "perplexity", "ratio to first", "word perplexity", "word ratio")
        for r in results:
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
            table.add_row(r["model"], f"{r['attention_layers']}/{r['layers']}", str(r["vocab_size"]), f"{r['ppl']:.3f}",
                          ratio, f"{r['word_ppl']:.2f}", f"{r['word_ratio']:.3f}")
        Console().print(table)
    return results


STAGES = {
    "pseudo-labels": (pseudo_labels, PseudoLabelConfig),
    "distill": (distill, DistillConfig),
    "sft": (sft, SFTConfig),
    "dpo": (dpo, DPOConfig),
    "dsla": (dsla, DSLAConfig),
    "perplexity": (perplexity, PerplexityConfig),
    **HEAD_STAGES,
}
