"""The training loop every stage shares: DDP under torchrun, bf16 autocast, gradient checkpointing,
checkpoints every N steps that `--resume` continues from exactly, a JSONL metrics log, rich
progress and a loss plot.

Exact resumption: a checkpoint holds the model, optimizer, scheduler, the step and every rank's
RNG state; the batches are a function of (seed, step) alone (`data.example_index`), so a resumed
run reads the same batches and ends with the same weights as one that was never stopped.
"""

import json
import math
import os
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from torch.nn.parallel import DistributedDataParallel

from hybrid_train.data import collate
from hybrid_train.errors import TrainError

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"


@dataclass
class TrainConfig:
    """Fields every training stage's config has."""

    out: str
    steps: int
    batch_size: int = 8  # examples per optimizer step, all ranks together
    micro_batch: int | None = None  # examples per forward on one rank; default: the rank's whole share
    lr: float = 1e-4
    min_lr: float = 0.0  # the cosine decays to this
    warmup_steps: int = 0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.98)  # "The Mamba in the Llama", section 5.1
    max_grad_norm: float = 1.0
    seq_len: int = 512
    seed: int = 0
    save_every: int = 100
    bf16: bool | None = None  # None: on CUDA only
    grad_checkpointing: bool = False


class Dist:
    """This process's place in a torchrun job (a job of one without torchrun)."""

    def __init__(self):
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.rank = int(os.environ.get("RANK", 0))
        local = int(os.environ.get("LOCAL_RANK", 0))
        self.device = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
        if self.world > 1 and not dist.is_initialized():
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self):
        if self.world > 1:
            dist.barrier()

    def mean(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return (t / self.world).tolist()

    def gather(self, obj) -> list:
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out


@lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def batch_indices(seed: int, n: int, step: int, batch_size: int) -> list[int]:
    """The examples of optimizer step `step`: consecutive draws from epoch-wise seeded permutations."""
    return [_permutation(seed, i // n, n)[i % n] for i in range(step * batch_size, (step + 1) * batch_size)]


def schedule(cfg: TrainConfig, delay: int = 0) -> Callable[[int], float]:
    """Linear warm-up then cosine decay to min_lr, as a multiplier of lr; 0 for the first `delay` steps."""

    def factor(step: int) -> float:
        if step < delay:
            return 0.0
        step -= delay
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - delay - cfg.warmup_steps)
        floor = cfg.min_lr / cfg.lr
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def autocast(cfg: TrainConfig, device: torch.device):
    use = cfg.bf16 if cfg.bf16 is not None else device.type == "cuda"
    return torch.autocast(device.type, dtype=torch.bfloat16) if use else nullcontext()


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict):
    # A checkpoint loaded with map_location on a GPU brings the RNG states there; torch wants them on the CPU.
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def _trim_metrics(path: Path, upto: int):
    """Drop the lines a killed run logged after its last checkpoint (they are about to be redone)."""
    if path.is_file():
        lines = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= upto]
        path.write_text("".join(line + "\n" for line in lines))


def plot_metrics(out: Path):
    """out/loss.png: every logged loss term against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in (out / METRICS).read_text().splitlines() if line]
    keys = [k for k in rows[0] if k not in ("step", "lr", "elapsed_s")]
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.2 * len(keys)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        ax.plot([r["step"] for r in rows], [r[key] for r in rows])
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(out.name)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    plt.close(fig)


def train(
    cfg: TrainConfig,
    model: torch.nn.Module,
    examples: list,
    loss_fn: Callable,
    resume: bool,
    env: Dist,
    collate_fn: Callable = collate,
    label: str = "train",
    groups: list[dict] | None = None,
) -> torch.nn.Module:
    """Train the parameters of `model` that require grad; returns the model (unwrapped).

    loss_fn(model, batch) -> (loss, {name: value}) runs under autocast; batch comes from
    collate_fn on this rank's share of the step's examples, moved to the device. `groups`
    (optimizer parameter groups {"params", "lr", "delay"}) replaces the one group of every
    trainable parameter at cfg.lr: each has its own lr, and its schedule starts `delay` steps late.
    """
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.batch_size % env.world:
        raise TrainError(f"batch_size {cfg.batch_size} is not a multiple of the {env.world} processes")
    share = cfg.batch_size // env.world
    micro = cfg.micro_batch or share
    if share % micro:
        raise TrainError(f"micro_batch {micro} does not divide the per-process batch {share}")
    checkpoint = out / CHECKPOINT
    if checkpoint.exists() and not resume:
        raise TrainError(f"{checkpoint} exists: pass --resume to continue that run, or choose another out")

    model.to(env.device)
    if cfg.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    groups = groups or [{"params": [p for p in model.parameters() if p.requires_grad], "lr": cfg.lr}]
    params = [p for g in groups for p in g["params"]]
    if not params:
        raise TrainError("nothing to train: every parameter is frozen")
    opt = torch.optim.AdamW([{"params": g["params"], "lr": g["lr"]} for g in groups], lr=cfg.lr,
                            betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [schedule(cfg, g.get("delay", 0)) for g in groups])
    start = 0
    if resume and checkpoint.exists():
        state = torch.load(checkpoint, map_location=env.device, weights_only=False)
        if state["world"] != env.world:
            raise TrainError(f"{checkpoint} was written by {state['world']} processes, not {env.world}")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        _set_rng_state(state["rng"][env.rank])
        start = state["step"]
    if env.main:
        _trim_metrics(out / METRICS, start)
    env.barrier()
    wrapped = DistributedDataParallel(model) if env.world > 1 else model
    metrics = (out / METRICS).open("a") if env.main else None
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]:.4f}"), TimeRemainingColumn())
    began = time.time()
    with Progress(*columns, disable=not env.main) as progress:
        task = progress.add_task(label, total=cfg.steps, completed=start, loss=float("nan"))
        for step in range(start, cfg.steps):
            mine = batch_indices(cfg.seed, len(examples), step, cfg.batch_size)[env.rank :: env.world]
            totals: dict[str, float] = {}
            for k in range(0, share, micro):
                batch = {n: t.to(env.device) for n, t in collate_fn([examples[i] for i in mine[k : k + micro]]).items()}
                last = k + micro >= share
                sync = nullcontext() if last or env.world == 1 else wrapped.no_sync()
                with sync:
                    with autocast(cfg, env.device):
                        loss, parts = loss_fn(wrapped, batch)
                    (loss * micro / share).backward()
                for name, value in {"loss": loss.detach(), **parts}.items():
                    totals[name] = totals.get(name, 0.0) + float(value) * micro / share
            if cfg.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            values = dict(zip(totals, env.mean(list(totals.values()))))
            if env.main:
                row = {"step": step + 1, **values, "lr": sched.get_last_lr()[0], "elapsed_s": time.time() - began}
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
            progress.update(task, advance=1, loss=values["loss"])
            if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
                rng = env.gather(_rng_state())
                if env.main:
                    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                             "step": step + 1, "rng": rng, "world": env.world}
                    torch.save(state, out / (CHECKPOINT + ".tmp"))
                    os.replace(out / (CHECKPOINT + ".tmp"), checkpoint)
                env.barrier()
    if env.main:
        metrics.close()
        plot_metrics(out)
    if cfg.grad_checkpointing:
        model.gradient_checkpointing_disable()
    return model.eval()
