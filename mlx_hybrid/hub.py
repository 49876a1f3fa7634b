"""Model ids: a local path, or a Hugging Face Hub repo id ("org/name") resolved through
huggingface-hub's cache, downloading what is missing.

huggingface-hub does the work: its cache layout and location (HF_HOME, HF_HUB_CACHE), offline
mode (HF_HUB_OFFLINE=1: the cached snapshot or an error, never a download), tokens for gated
repos. Only the files a model directory needs are fetched, and anything that keeps a repo from
resolving ends in a one-line `HybridError` naming the id.
"""

import re
from pathlib import Path

from mlx_hybrid.errors import HybridError

# What `mlx_hybrid.loader` reads from a model directory, heads and drafter subdirectories included.
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.tiktoken", "*.txt"]
# `hybrid convert` also reads PyTorch weights (and Medusa's medusa_lm_head.pt).
CHECKPOINT_FILES = MODEL_FILES + ["*.bin", "*.pt"]

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_repo_id(name: str) -> bool:
    return REPO_ID.fullmatch(name) is not None and ".." not in name


def resolve(model: str | Path, patterns: list[str] = MODEL_FILES) -> Path:
    """The local path of model: itself when it exists or is no repo id (then the loader says what
    is missing), else the Hub repo's snapshot in the cache, fetched first unless offline."""
    path = Path(model).expanduser()
    if path.exists() or not is_repo_id(str(model)):
        return path
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(str(model), allow_patterns=patterns))
    except Exception as e:  # not found, gated, offline, network down, incomplete snapshot...
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        offline = " (HF_HUB_OFFLINE is set: no download was tried)" if constants.HF_HUB_OFFLINE else ""
        raise HybridError(
            f"model '{model}' is not a local directory, not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
            f"and could not be downloaded{offline}: {type(e).__name__}: {reason}"
        ) from None
