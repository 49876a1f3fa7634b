"""The training loop every stage shares: DDP or FSDP2 under torchrun, bf16 autocast, gradient
checkpointing, checkpoints every N steps that `--resume` continues from exactly, a JSONL metrics
log, rich progress and a loss plot.

Exact resumption: a checkpoint holds the model, optimizer, scheduler, the step and every rank's
RNG state; the batches are a function of (seed, step) alone (`batch_indices`), so a resumed run
reads the same batches and ends with the same weights as one that was never stopped. A run may
resume on another number of processes when `micro_batch` is set: each step's examples are cut
into the same micro-batches whatever the count (consecutive runs of the step's list, a process
taking a consecutive share), so the step's gradient is the same mean, summed in another order.

`parallel: fsdp` shards the parameters, gradients and optimizer state of every block (each
member of the model's `nn.ModuleList`s, e.g. the decoder layers) and of the rest over the
processes with `torch.distributed.fsdp.fully_shard`, bf16 compute with float32 master weights
and gradients reduced in float32. Its checkpoints are `torch.distributed.checkpoint` directories,
which load into any number of processes. Training returns the whole model on every process,
unsharded, so a stage exports and measures it as it does after DDP.
"""

import copy
import json
import math
import os
import random
import shutil
import time
import warnings
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

CHECKPOINT = "checkpoint.pt"  # parallel: ddp, one file
SHARDED = "checkpoint"  # parallel: fsdp, a torch.distributed.checkpoint directory
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
    parallel: str = "ddp"  # ddp: every process holds the whole model; fsdp: parameters, gradients, optimizer sharded
    teacher_sharding: str = "replicate"  # fsdp: the frozen teacher (or DPO reference) "replicate"d or "shard"ed too


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

    def reduce(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        """values summed (or op) over the processes, in one all-reduce."""
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

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
    keys = [k for k in rows[0] if k not in ("step", "lr", "elapsed_s", "tokens", "peak_gib")]
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


def _blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules FSDP shards one at a time: each member of an `nn.ModuleList` (a decoder layer,
    a Medusa head) not inside another. Only one block's whole weights are on a GPU at a time."""
    found = []
    for child in module.children():
        if isinstance(child, torch.nn.ModuleList):
            found += [m for m in child if next(m.parameters(), None) is not None]
        else:
            found += _blocks(child)
    return found


def _shard(model: torch.nn.Module, bf16: bool):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # bf16 products on float32 master weights; gradients reduced in float32.
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for block in _blocks(model):
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def _skeleton(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` whose parameters are on the meta device (they take no memory): sharding
    turns the model's own parameters into shards, and the trained whole is loaded into this.
    Buffers are copied as they are; shared (tied) parameters stay shared."""
    memo = {id(p): torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in model.parameters()}
    return copy.deepcopy(model, memo)


def _unshard(sharded: torch.nn.Module, skeleton: torch.nn.Module) -> torch.nn.Module:
    """The skeleton holding the sharded model's whole trained weights, on every process (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True))
    ties: dict[int, list[str]] = {}
    for name, p in skeleton.named_parameters(remove_duplicate=False):
        ties.setdefault(id(p), []).append(name)
    skeleton.load_state_dict(full, assign=True)
    for names in ties.values():  # assign gave each name its own tensor: share them again
        first = skeleton.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(skeleton.get_submodule(owner), attr, first)
    return skeleton


def _save_sharded(out: Path, model, opt, meta: dict, env: Dist):
    """A torch.distributed.checkpoint directory (each process writes its shards; out must be on a
    filesystem every node sees) plus meta.pt, written beside the last one and swapped in."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    tmp, final, old = out / (SHARDED + ".tmp"), out / SHARDED, out / (SHARDED + ".old")
    if env.main and tmp.exists():
        shutil.rmtree(tmp)
    env.barrier()
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():  # one process, no group: the same checkpoint, which dcp warns of
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp)
    if env.main:
        torch.save(meta, tmp / "meta.pt")
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    env.barrier()


def _load_sharded(path: Path, model, opt):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)  # resharded to this run's processes
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def set_checkpointing(model: torch.nn.Module, on: bool) -> None:
    """Activation checkpointing on (non-reentrant) or off. transformers 5 calls it activation
    checkpointing, its gradient_* names warn and go in v6; 4.x has only those."""
    kind = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"
    if on:
        getattr(model, f"{kind}_checkpointing_enable")(**{f"{kind}_checkpointing_kwargs": {"use_reentrant": False}})
    else:
        getattr(model, f"{kind}_checkpointing_disable")()


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
    frozen: tuple[torch.nn.Module, ...] = (),
) -> torch.nn.Module:
    """Train the parameters of `model` that require grad; returns the model (unwrapped, whole).

    loss_fn(model, batch) -> (loss, {name: value}) runs under autocast; batch comes from
    collate_fn on this rank's share of the step's examples, moved to the device. `groups`
    (optimizer parameter groups {"params", "lr", "delay"}) replaces the one group of every
    trainable parameter at cfg.lr: each has its own lr, and its schedule starts `delay` steps late.
    `frozen`: the models loss_fn runs without gradients (a teacher), sharded too under
    `parallel: fsdp` with `teacher_sharding: shard` (then only usable by every process together).
    """
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.parallel not in ("ddp", "fsdp"):
        raise TrainError(f"parallel must be ddp or fsdp, got '{cfg.parallel}'")
    if cfg.teacher_sharding not in ("replicate", "shard"):
        raise TrainError(f"teacher_sharding must be replicate or shard, got '{cfg.teacher_sharding}'")
    if cfg.batch_size % env.world:
        raise TrainError(f"batch_size {cfg.batch_size} is not a multiple of the {env.world} processes")
    share = cfg.batch_size // env.world
    micro = cfg.micro_batch or share
    if share % micro:
        raise TrainError(f"micro_batch {micro} does not divide the per-process batch {share}")
    fsdp = cfg.parallel == "fsdp"
    checkpoint, other = (out / SHARDED, out / CHECKPOINT) if fsdp else (out / CHECKPOINT, out / SHARDED)
    if env.main and fsdp and not checkpoint.exists() and (out / (SHARDED + ".old")).exists():
        os.replace(out / (SHARDED + ".old"), checkpoint)  # killed between the two renames of a save
    env.barrier()
    if (checkpoint.exists() or other.exists()) and not resume:
        raise TrainError(f"{checkpoint if checkpoint.exists() else other} exists: pass --resume to continue that run, or choose another out")
    if resume and other.exists() and not checkpoint.exists():
        raise TrainError(f"{other} was written with parallel: {'ddp' if fsdp else 'fsdp'}; resume with that")

    meta = None  # the checkpoint's step, scheduler, RNG states, process count (and DDP's model and optimizer)
    if resume and checkpoint.exists():
        meta = torch.load(checkpoint / "meta.pt" if fsdp else checkpoint, map_location=env.device, weights_only=False)
        if meta["world"] != env.world and cfg.micro_batch is None:
            raise TrainError(f"{checkpoint} was written by {meta['world']} processes, not {env.world}: set micro_batch "
                             "(it must divide each process's share at both counts) to resume on another count")

    bf16 = cfg.bf16 if cfg.bf16 is not None else env.device.type == "cuda"
    sharded = fsdp and env.world > 1
    if not sharded:
        model.to(env.device)
    if cfg.grad_checkpointing:
        set_checkpointing(model, True)
    model.train()
    # Groups by parameter name: sharding replaces the parameters.
    named = {id(p): n for n, p in model.named_parameters()}
    groups = groups or [{"params": [p for p in model.parameters() if p.requires_grad], "lr": cfg.lr}]
    group_names = [[named[id(p)] for p in g["params"]] for g in groups]
    skeleton = None
    if sharded:
        skeleton = _skeleton(model)
        _shard(model, bf16)
        if cfg.teacher_sharding == "shard":
            from torch.distributed.fsdp import FSDPModule

            for m in frozen:
                if not isinstance(m, FSDPModule):  # a teacher shared by several trainings (dsla's phases)
                    _shard(m, False)
    params_now = dict(model.named_parameters())
    groups = [{**g, "params": [params_now[n] for n in names]} for g, names in zip(groups, group_names)]
    params = [p for g in groups for p in g["params"]]
    if not params:
        raise TrainError("nothing to train: every parameter is frozen")
    opt = torch.optim.AdamW([{"params": g["params"], "lr": g["lr"]} for g in groups], lr=cfg.lr,
                            betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [schedule(cfg, g.get("delay", 0)) for g in groups])
    start = 0
    if meta is not None:
        if fsdp:
            _load_sharded(checkpoint, model, opt)
        else:
            model.load_state_dict(meta["model"])
            opt.load_state_dict(meta["optimizer"])
        sched.load_state_dict(meta["scheduler"])
        # On another count each process takes an old one's RNG; no stage draws random numbers while training.
        _set_rng_state(meta["rng"][env.rank % meta["world"]])
        start = meta["step"]
    if env.main:
        _trim_metrics(out / METRICS, start)
    env.barrier()
    wrapped = DistributedDataParallel(model) if env.world > 1 and not fsdp else model
    metrics = (out / METRICS).open("a") if env.main else None
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]:.4f}"), TimeRemainingColumn())
    if env.device.type == "cuda":  # peak_gib: the steps' memory, not the loading's before sharding
        torch.cuda.reset_peak_memory_stats(env.device)
    began = time.time()
    with Progress(*columns, disable=not env.main) as progress:
        task = progress.add_task(label, total=cfg.steps, completed=start, loss=float("nan"))
        for step in range(start, cfg.steps):
            mine = batch_indices(cfg.seed, len(examples), step, cfg.batch_size)[env.rank * share : (env.rank + 1) * share]
            totals: dict[str, float] = {}
            tokens = 0
            for k in range(0, share, micro):
                batch = {n: t.to(env.device) for n, t in collate_fn([examples[i] for i in mine[k : k + micro]]).items()}
                tokens += batch["input_ids"].numel()
                last = k + micro >= share
                sync = nullcontext() if last or env.world == 1 or fsdp else wrapped.no_sync()
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
            *sums, tokens = env.reduce([*totals.values(), tokens])
            values = {name: v / env.world for name, v in zip(totals, sums)}
            row = {"step": step + 1, **values, "lr": sched.get_last_lr()[0], "elapsed_s": time.time() - began,
                   "tokens": int(tokens)}
            if env.device.type == "cuda":  # the most any process held
                row["peak_gib"] = env.reduce([torch.cuda.max_memory_allocated(env.device) / 2**30], dist.ReduceOp.MAX)[0]
            if env.main:
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
            progress.update(task, advance=1, loss=values["loss"])
            if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
                meta = {"scheduler": sched.state_dict(), "step": step + 1, "rng": env.gather(_rng_state()), "world": env.world}
                if fsdp:
                    _save_sharded(out, model, opt, meta, env)
                    continue
                if env.main:
                    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), **meta}
                    torch.save(state, out / (CHECKPOINT + ".tmp"))
                    os.replace(out / (CHECKPOINT + ".tmp"), checkpoint)
                env.barrier()
    if env.main:
        metrics.close()
        plot_metrics(out)
    if sharded:
        del opt, params, groups
        model = _unshard(model, skeleton)
    if cfg.grad_checkpointing:
        set_checkpointing(model, False)
    return model.eval()
