"""File I/O of a checkpoint: atomic writes, shard files, the ``latest`` pointer, leftovers.

Every file is written to a temporary name, fsynced and renamed, so a reader sees the old file or
the whole new one, never a part; the directory is fsynced after the rename.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import save_file

from ds_canzona.zero.checkpoint.format import LATEST_FILE, SHARD_PATTERN, TMP_MARK, CheckpointError, check_tag


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    """The process's umask, read without changing it where the OS allows (Linux), else swapped back."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode an ordinary ``open(path, "w")`` gives a new file: 0o666 less the umask."""
    return 0o666 & ~_umask()


def atomic_write(path: str, write: Callable[[str], Any]) -> None:
    """``write(tmp)``, fsync, then rename to ``path``: readers see the old file or the whole new one.

    The file gets the ordinary umask-respecting mode, whatever ``write`` created it with:
    safetensors' ``save_file`` (0.8) creates its file 0600, which made shards and exports private
    while the manifest, written with ``open``, was 0644.
    """
    tmp = f"{path}{TMP_MARK}{os.getpid()}"
    try:
        write(tmp)
        os.chmod(tmp, file_mode())
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(os.path.dirname(path) or ".")


def write_bytes(data: bytes) -> Callable[[str], None]:
    def write(path: str) -> None:
        with open(path, "wb") as f:
            f.write(data)
    return write


def write_shard(path: str, tensors: dict[str, torch.Tensor], header: dict[str, str]) -> int:
    """One rank's shard file, written atomically; returns its size in bytes."""
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=header))
    return os.path.getsize(path)


def remove_stale(directory: str, keep: set[str]) -> None:
    """Shard files of older saves of this tag, and temporary files of crashed writes."""
    for entry in os.listdir(directory):
        stale_shard = SHARD_PATTERN.match(entry) is not None and entry not in keep
        stale_tmp = TMP_MARK in entry and entry.startswith(("canzona_", LATEST_FILE + TMP_MARK))
        if stale_shard or stale_tmp:
            try:
                os.remove(os.path.join(directory, entry))
            except OSError:
                pass


def resolve_tag(load_dir: str, tag: Any = None) -> str | None:
    """``tag``, or the tag named by ``<load_dir>/latest``; None when there is neither."""
    if tag is not None:
        return check_tag(tag)
    latest = os.path.join(load_dir, LATEST_FILE)
    if not os.path.isfile(latest):
        return None
    with open(latest, encoding="utf-8") as f:
        text = f.read().strip()
    try:
        return check_tag(text)
    except CheckpointError as error:
        raise CheckpointError(f"{latest}: {error}") from None
