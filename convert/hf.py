"""Hugging Face-layout checkpoints (Llama, Mistral, MambaInLlama, DSLA-Serve, llama_hybrid) -> MLX model directory.

The output is what `mlx_hybrid.load` reads, in mlx-lm's layout: config.json (a MambaInLlama
release or a DSLA-Serve checkpoint becomes this project's `llama_hybrid` config), safetensors
shards with an index, the tokenizer files. Tensors keep their Hugging Face names (the runtime
fuses projections at load; only DSLA-Serve's DSLA layers move from `self_attn.` to `dsla.`), so
a converted Llama or Mistral also loads in mlx-lm.

Quantization is MLX's affine `mx.quantize`, tensor by tensor as the tensors stream through (what
`nn.quantize` does to a whole model at once, which would need all of it in memory). Only Linear
and Embedding weights whose input width is a multiple of the group size are quantized, so the
projections the runtime fuses (q/k/v, gate/up, Mamba's inputs), which share an input width,
always share one quantization. The "mixed" recipe also keeps the embeddings, the LM head and the
SSM's dt / DSLA gate projections in float: errors there are multiplied through every token's
logits or compounded by the recurrence. Where float embeddings cost too much (a small model's
vocabulary is a large share of it), `embed_bits` gives the embeddings and the LM head more bits
than the rest instead (mlx-lm's per-module config entries, which mlx-lm also reads). The SSM's
A_log, D, dt_bias, gamma and alpha_list are stored in float32 by every recipe (the runtime holds them in float32 anyway), conv and norm weights in
the model dtype.
"""

import json
import shutil
from pathlib import Path
from typing import Callable

import mlx.core as mx

from mlx_hybrid.convert.checkpoint import (
    TOKENIZER_EXTRAS,
    TOKENIZER_FILES,
    Checkpoint,
    check_shapes,
    file_tensors,
    open_checkpoint,
    tensors,
)
from mlx_hybrid.convert.heads import check, medusa_plan, output_name, redrafter_plan
from mlx_hybrid.convert.publish import save_safetensors, staged
from mlx_hybrid.errors import HybridError
from mlx_hybrid.loader import DTYPES
from mlx_hybrid.models.llama import legacy_rope
from mlx_hybrid.models.hybrid import FP32_PARAMS
from mlx_hybrid.validate import first_nonfinite, refuse_remote_code

BITS = (4, 8)
EMBED_BITS = (4, 5, 6, 8)
EMBEDDINGS = ("model.embed_tokens", "lm_head")
GROUP_SIZES = (32, 64, 128)
RECIPES = ("uniform", "mixed")
SHARD_BYTES = 1 << 30  # small shards keep the converter's memory bounded (a shard is held until written)


def keeps_float(module: str) -> bool:
    """Modules the mixed recipe leaves unquantized: embeddings, LM head, Mamba's dt_proj, DSLA's gates."""
    return module in EMBEDDINGS or module.endswith(".mamba.dt_proj") or ".dsla.gate" in module or ".dsla.gk_proj" in module


def quantizes(name: str, shape: tuple[int, ...], group_size: int, recipe: str) -> bool:
    """Whether a tensor is quantized: a Linear/Embedding weight (the only 2-D weights) of a divisible width."""
    if not name.endswith(".weight") or len(shape) != 2 or shape[1] % group_size:
        return False
    return not (recipe == "mixed" and keeps_float(name.removesuffix(".weight")))


class ShardWriter:
    """Writes tensors into safetensors shards of at most `limit` bytes as they come, then the index."""

    def __init__(self, out: Path, limit: int):
        self.out, self.limit = out, limit
        self.shard, self.size, self.files, self.weight_map, self.total = {}, 0, [], {}, 0

    def add(self, name: str, a: mx.array):
        if self.shard and self.size + a.nbytes > self.limit:
            self._flush()
        self.shard[name] = a
        self.size += a.nbytes
        self.total += a.nbytes

    def _flush(self):
        file = self.out / f"shard-{len(self.files)}.safetensors"  # renamed by finish()
        save_safetensors(file, self.shard, metadata={"format": "mlx"})
        self.files.append((file, list(self.shard)))
        self.shard, self.size = {}, 0

    def finish(self):
        """Name the shards model-0000i-of-0000n.safetensors (n is known only now) and write the index."""
        if self.shard or not self.files:
            self._flush()
        n = len(self.files)
        for i, (file, names) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            file.rename(self.out / final)
            self.weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(self.weight_map.items()))}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def convert_tensor(name: str, a: mx.array, dtype: str | None, quant: dict | None, recipe: str) -> dict[str, mx.array]:
    """One source tensor -> the tensors stored for it (weight, scales, biases when quantized)."""
    if not mx.issubdtype(a.dtype, mx.floating):
        raise HybridError(f"tensor '{name}' is {a.dtype}, not a float tensor")
    if first_nonfinite([(name, a)]):
        raise HybridError(f"tensor '{name}' holds NaN or Inf values")
    if name.rpartition(".")[2] in FP32_PARAMS:
        return {name: a.astype(mx.float32)}
    if dtype:
        a = a.astype(DTYPES[dtype])
    if quant and quantizes(name, a.shape, quant["group_size"], recipe):
        module = name.removesuffix(".weight")
        w, scales, biases = mx.quantize(a, quant["group_size"], quant.get(module, quant)["bits"])
        return {name: w, f"{module}.scales": scales, f"{module}.biases": biases}
    return {name: a}


def output_config(checkpoint: Checkpoint, dtype: str | None, quant: dict | None) -> dict:
    config = {k: v for k, v in checkpoint.config.items() if v is not None}
    for key in ("torch_dtype", "dtype"):  # transformers 4 / 5 spell it differently
        if dtype and key in config:
            config[key] = dtype
    if quant:
        config["quantization"] = config["quantization_config"] = quant  # mlx-lm writes both
    # mlx-lm would run a transformers 5 config at its default theta (10000; SmolLM2's is 100000).
    return legacy_rope(config) | config


def _check_options(dtype, quantize, bits, group_size, recipe, embed_bits):
    if dtype is not None and dtype not in DTYPES:
        raise HybridError(f"unknown dtype '{dtype}' (choose from {', '.join(DTYPES)})")
    if bits not in BITS:
        raise HybridError(f"--bits must be one of {', '.join(map(str, BITS))}, got {bits}")
    if group_size not in GROUP_SIZES:
        raise HybridError(f"--group-size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}")
    if recipe not in RECIPES:
        raise HybridError(f"unknown quantization recipe '{recipe}' (choose from {', '.join(RECIPES)})")
    if recipe != "uniform" and not quantize:
        raise HybridError(f"--quant-recipe {recipe} needs -q/--quantize")
    if embed_bits is not None:
        if embed_bits not in EMBED_BITS:
            raise HybridError(f"--embed-bits must be one of {', '.join(map(str, EMBED_BITS))}, got {embed_bits}")
        if not quantize or recipe != "uniform":
            raise HybridError("--embed-bits needs -q/--quantize and the uniform recipe (mixed keeps embeddings in float)")


def convert(
    src: str | Path,
    dst: str | Path,
    dtype: str | None = None,
    quantize: bool = False,
    bits: int = 4,
    group_size: int = 64,
    recipe: str = "uniform",
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
    shard_bytes: int = SHARD_BYTES,
    medusa: str | Path | None = None,
    redrafter: str | Path | None = None,
    embed_bits: int | None = None,
) -> Path:
    """Write the MLX model directory for checkpoint `src` at `dst`; returns dst.

    medusa / redrafter: directories of heads in the FasterDecoding/Medusa or apple/ml-recurrent-drafter
    layout, converted alongside into dst/medusa/ and dst/redrafter/ (`docs/formats/speculative-heads.md`).
    embed_bits: bits for the embeddings and LM head (default: bits).
    dtype None keeps each tensor's stored float dtype. Everything is checked first, then written
    into a staging directory beside dst and put in place at the end (`publish.staged`), so a
    failed or interrupted run leaves dst as it was; an existing dst is replaced only with force,
    in one atomic swap.
    """
    _check_options(dtype, quantize, bits, group_size, recipe, embed_bits)
    src, dst = Path(src), Path(dst)
    if dst.exists() or dst.is_symlink():
        if not force:
            raise HybridError(f"{dst} already exists (pass --force to replace it)")
        if src.resolve() == dst.resolve() or dst.resolve() in src.resolve().parents:
            raise HybridError(f"{dst} holds the source {src}; choose another destination")
    refuse_remote_code(src)
    checkpoint = open_checkpoint(src)
    if not any((src / f).is_file() for f in TOKENIZER_FILES):
        raise HybridError(f"no tokenizer in {src} (expected {' or '.join(TOKENIZER_FILES)})")
    expected = check_shapes(checkpoint)
    quant = {"group_size": group_size, "bits": bits, "mode": "affine"} if quantize else None
    if quant and not any(quantizes(name, shape, group_size, recipe) for name, shape in expected.items()):
        raise HybridError(f"nothing to quantize: no layer's input width is a multiple of --group-size {group_size}")
    heads = []
    base_quant = quant
    if embed_bits is not None:  # per-module entries, for the base model only: the heads keep quant
        embeddings = [m for m in EMBEDDINGS if f"{m}.weight" in expected and quantizes(f"{m}.weight", expected[f"{m}.weight"], group_size, recipe)]
        base_quant = dict(quant, **{m: {"group_size": group_size, "bits": embed_bits} for m in embeddings})
    for kind, path, plan in (("medusa", medusa, medusa_plan), ("redrafter", redrafter, redrafter_plan)):
        if path is not None:
            file, head_config, shapes = plan(path, checkpoint.config)
            check(kind, file, shapes)
            heads.append((kind, file, dict(head_config, **({"quantization": quant} if quant else {}))))
    with staged(dst) as tmp:
        writer = ShardWriter(tmp, shard_bytes)
        done = 0
        for name, a in tensors(checkpoint):
            name = checkpoint.converted_name(name)
            if name in expected:
                for out_name, out in convert_tensor(name, a, dtype, base_quant, recipe).items():
                    mx.eval(out)
                    writer.add(out_name, out)
            done += 1
            if progress:
                progress(done, len(checkpoint.shapes))
        writer.finish()
        for kind, file, head_config in heads:
            (tmp / kind).mkdir()
            head_writer = ShardWriter(tmp / kind, shard_bytes)
            for name, a in file_tensors(file):
                for out_name, out in convert_tensor(output_name(kind, name), a, dtype, quant, "uniform").items():
                    mx.eval(out)
                    head_writer.add(out_name, out)
            head_writer.finish()
            (tmp / kind / "config.json").write_text(json.dumps(head_config, indent=2) + "\n")
        for file in TOKENIZER_FILES + TOKENIZER_EXTRAS:
            if (src / file).is_file():
                shutil.copyfile(src / file, tmp / file)
        config = output_config(checkpoint, dtype, base_quant)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst
