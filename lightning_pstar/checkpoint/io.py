"""Crash-safe checkpoint files: atomic writes, and loads whose errors name the file.

Every file is written to a temporary name in the same directory, fsynced and renamed into place, so a
process killed in the middle of a save leaves the previous checkpoint intact; loading a truncated or
corrupt file raises a :class:`CheckpointError` that names the file. The Lightning ``CheckpointIO`` built on
these functions lives in ``strategy.py`` (only the glue files import Lightning).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CheckpointError",
    "atomic_torch_save",
    "load_checkpoint_file",
    "load_file",
    "remove_checkpoint_path",
    "save_checkpoint_file",
]


class CheckpointError(ValueError):
    """A checkpoint file or directory cannot be used (truncated, corrupt, incomplete, another model)."""


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` ``obj`` to ``path`` so that readers see the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one, never half of one
    finally:
        if tmp.exists():
            tmp.unlink()


def load_file(path: Path, *, map_location: Any = "cpu", weights_only: bool | None = False) -> Any:
    """``torch.load`` ``path``; a missing, truncated or corrupt file raises a :class:`CheckpointError`."""
    if not path.exists():
        raise CheckpointError(f"checkpoint '{path}' does not exist. HINT: check the path (ckpt_path=...).")
    try:
        return torch.load(path, map_location=map_location, weights_only=bool(weights_only))
    except Exception as err:  # noqa: BLE001 - a damaged file makes torch.load raise almost anything
        raise CheckpointError(
            f"checkpoint '{path}' is truncated or corrupt and cannot be read ({type(err).__name__}: {err})."
            " HINT: resume from an earlier checkpoint; files written by PatrickStar are renamed into place only"
            " when complete, so a file cut short was written by something else or damaged afterwards."
        ) from err


def save_checkpoint_file(checkpoint: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write one checkpoint file atomically, creating its directory if needed."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_torch_save(checkpoint, target)


def load_checkpoint_file(
    path: str | os.PathLike[str], *, map_location: Any = "cpu", weights_only: bool | None = None
) -> dict[str, Any]:
    """Read one checkpoint file; anything but a checkpoint dict raises a :class:`CheckpointError`."""
    target = Path(path)
    loaded = load_file(target, map_location=map_location, weights_only=weights_only)
    if not isinstance(loaded, dict):
        raise CheckpointError(
            f"checkpoint '{target}' holds a {type(loaded).__name__}, not a checkpoint dict."
            " HINT: pass a file written by trainer.save_checkpoint or ModelCheckpoint."
        )
    return loaded


def remove_checkpoint_path(path: str | os.PathLike[str]) -> None:
    """Delete a checkpoint: a file, a directory, or a link and the data directory it points at."""
    target = Path(path)
    if target.is_symlink():
        data = target.resolve()
        target.unlink()
        if data.is_dir():
            shutil.rmtree(data)
    elif target.is_dir():
        shutil.rmtree(target)
    elif target.exists():
        target.unlink()
