"""Writing a converted model directory beside its destination, then putting it in place at once.

A conversion writes into a staging directory next to the destination (same filesystem, so a
rename moves it without copying). When everything is written, the staging directory becomes the
destination in one rename; with --force an existing destination is swapped with it in one
atomic exchange (Linux renameat2 RENAME_EXCHANGE, macOS renamex_np RENAME_SWAP), so at every
moment the destination is either the old model or the new one, never absent, and the old one
is deleted only once the new one is in place. Where the filesystem cannot exchange, the old one
is renamed aside, the new one renamed in, and the old one put back if that fails.

A killed conversion leaves its staging directory behind; its name carries the process id, so
the next conversion to the same destination removes those whose process is gone.
"""

import ctypes
import errno
import glob
import os
import secrets
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

from mlx_hybrid.errors import HybridError

AT_FDCWD = -100
RENAME_EXCHANGE = 2  # Linux <linux/fs.h>
RENAME_SWAP = 2  # macOS <stdio.h>


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _side_name(dst: Path, kind: str) -> Path:
    """A hidden name beside dst for kind ("staging", "old"), owned by this process."""
    return dst.parent / f".{dst.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def staging_dir(dst: Path) -> Path:
    """An empty directory beside dst to write a conversion into, with the permissions a plain
    mkdir gives (a private temp directory would make every converted model private)."""
    tmp = _side_name(dst, "staging")
    tmp.mkdir()
    return tmp


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def clean_stale(dst: Path):
    """Remove the staging and set-aside directories that killed conversions to dst left."""
    for p in dst.parent.glob(f".{glob.escape(dst.name)}.*-*-*"):
        kind, _, rest = p.name.removeprefix(f".{dst.name}.").partition("-")
        pid = rest.partition("-")[0]
        if kind in ("staging", "old") and pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


def exchange(a: Path, b: Path) -> bool:
    """Swap the directory entries a and b in one atomic step; False where the OS or filesystem
    cannot (the caller then renames in two steps)."""
    libc = _libc()
    if sys.platform == "linux" and libc is not None and hasattr(libc, "renameat2"):
        result = libc.renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE)
    elif sys.platform == "darwin" and libc is not None and hasattr(libc, "renamex_np"):
        result = libc.renamex_np(os.fsencode(a), os.fsencode(b), RENAME_SWAP)
    else:
        return False
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)):
        return False  # not on this filesystem
    raise OSError(code, os.strerror(code), str(b))


def publish(tmp: Path, dst: Path):
    """Put the finished tmp at dst: a rename, or an exchange with the existing dst, whose old
    contents (then at tmp) are deleted after."""
    if not (dst.exists() or dst.is_symlink()):
        tmp.rename(dst)
        return
    if exchange(tmp, dst):
        shutil.rmtree(tmp, ignore_errors=True)
        return
    old = _side_name(dst, "old")
    dst.rename(old)
    try:
        tmp.rename(dst)
    except BaseException:
        old.rename(dst)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def staged(dst: Path):
    """A staging directory beside dst to write the conversion into (stale ones of killed runs
    are removed first); on success it is published at dst, on any failure removed, dst left as
    it was. Errors of the filesystem (read-only, full, gone) become one-line HybridErrors."""
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        clean_stale(dst)
        tmp = staging_dir(dst)
    except OSError as e:
        raise HybridError(f"cannot write beside {dst}: {e.strerror or e}") from None
    try:
        yield tmp
        publish(tmp, dst)
    except OSError as e:
        where = f" ({e.filename})" if e.filename else ""
        raise HybridError(f"writing {dst} failed: {e.strerror or e}{where}; {dst} is unchanged") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_safetensors(file: Path, arrays: dict, metadata: dict):
    """mx.save_safetensors, its write errors (a full disk) as OSError: MLX reports them as RuntimeError."""
    import mlx.core as mx

    try:
        mx.save_safetensors(str(file), arrays, metadata=metadata)
    except RuntimeError as e:
        raise OSError(errno.EIO, str(e).splitlines()[0], str(file)) from None
