"""Checkpoints: crash-safe files, consolidated and sharded state, and their conversion.

- :class:`SafeCheckpointIO` writes every file to a temporary name in the same directory, fsyncs it and
  renames it into place, so a process killed in the middle of a save leaves the previous checkpoint intact;
  loading a truncated or corrupt file raises an error that names the file.
- Consolidated checkpoints are ordinary Lightning checkpoints (the model's own parameter names, fp32
  weights, torch's optimizer layout), gathered family by family to rank 0 (see ``ChunkManager``).
- Sharded checkpoints are a directory: ``meta.pt`` (everything Lightning saves except the model and
  optimizer tensors, written by rank 0) and a ``torch.distributed.checkpoint`` store in which every rank
  writes only the parameters and optimizer states it owns. Keys name whole parameters (``model/<name>``,
  ``optim/<k>/<index>/<field>``), so the store loads at any world size.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from typing_extensions import override

__all__ = [
    "META_FILENAME",
    "CheckpointError",
    "SafeCheckpointIO",
    "consolidate",
    "is_sharded_checkpoint",
    "read_sharded_meta",
    "read_sharded_tensors",
    "write_sharded",
]

META_FILENAME = "meta.pt"
SHARDED_KEY = "pstar_sharded_checkpoint"  # marks a checkpoint dict whose tensors live in a sharded store


class CheckpointError(ValueError):
    """A checkpoint file or directory cannot be used (truncated, corrupt, incomplete, another model)."""


def _atomic_torch_save(obj: Any, path: Path) -> None:
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


def _load_file(path: Path, *, map_location: Any = "cpu", weights_only: bool | None = False) -> Any:
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


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's torch checkpoint IO with atomic writes and clear errors on unreadable files."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options, got {storage_options!r}")
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        _atomic_torch_save(checkpoint, target)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        target = Path(path)
        if is_sharded_checkpoint(target):
            return read_sharded_meta(target)
        loaded = _load_file(target, map_location=map_location, weights_only=weights_only)
        if not isinstance(loaded, dict):
            raise CheckpointError(
                f"checkpoint '{target}' holds a {type(loaded).__name__}, not a checkpoint dict."
                " HINT: pass a file written by trainer.save_checkpoint or ModelCheckpoint."
            )
        return loaded

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
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


# ---- sharded ------------------------------------------------------------------------------------------------
def is_sharded_checkpoint(path: _PATH) -> bool:
    target = Path(path)
    return target.is_dir() and (target / META_FILENAME).is_file()


def write_sharded(
    path: Path,
    *,
    meta: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    rank: int,
    barrier: Callable[[], None],
) -> None:
    """Write a sharded checkpoint directory. Every rank passes only the tensors it owns.

    The data goes to a fresh hidden directory next to ``path``; when every rank has finished, rank 0 points
    ``path`` (a symbolic link) at it with one atomic rename and then deletes the previous data. A process
    killed at any moment leaves ``path`` pointing at a complete checkpoint, old or new.
    """
    token = f".{path.name}.{time.time_ns()}" if rank == 0 else ""
    holder = [token]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(holder, src=0)
    data = path.with_name(holder[0])
    dcp.save(tensors, storage_writer=FileSystemWriter(data))
    barrier()
    if rank == 0:
        _atomic_torch_save(meta, data / META_FILENAME)
        previous = path.resolve() if path.is_symlink() else None
        link = path.with_name(f".{path.name}.link-{os.getpid()}")
        if link.is_symlink() or link.exists():
            link.unlink()
        os.symlink(data.name, link)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)  # a directory from an older layout: replaced by the link
        os.replace(link, path)  # atomic: readers see the old checkpoint or the new one
        _remove_stale(path, keep=data, extra=previous)
    barrier()


def _remove_stale(path: Path, *, keep: Path, extra: Path | None) -> None:
    """Delete data directories of ``path`` that no link points at any more (also after a crash)."""
    for candidate in path.parent.glob(f".{path.name}.*"):
        if candidate.resolve() == keep.resolve() or candidate.is_symlink():
            continue
        if candidate.is_dir():
            shutil.rmtree(candidate, ignore_errors=True)
    if extra is not None and extra.exists() and extra.resolve() != keep.resolve():
        shutil.rmtree(extra, ignore_errors=True)


def read_sharded_meta(path: Path) -> dict[str, Any]:
    """The checkpoint dict of a sharded checkpoint (tensors stay in the store), after checking the store."""
    meta = _load_file(path / META_FILENAME)
    if not isinstance(meta, dict) or SHARDED_KEY not in meta:
        raise CheckpointError(f"'{path / META_FILENAME}' is not the metadata of a PatrickStar sharded checkpoint.")
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as err:  # noqa: BLE001 - any failure to read the index means an unusable store
        raise CheckpointError(
            f"sharded checkpoint '{path}' has no readable store index ({type(err).__name__}: {err})."
            " HINT: the save was interrupted or the directory was copied incompletely."
        ) from err
    files = sorted({info.relative_path for info in (metadata.storage_data or {}).values()})
    missing = [f for f in files if not (path / f).is_file()]
    if missing:
        raise CheckpointError(
            f"sharded checkpoint '{path}' is incomplete: missing {missing} (written by other ranks)."
            " HINT: copy every file of the checkpoint directory, from every node."
        )
    meta[SHARDED_KEY] = str(path)
    return meta


def stored_keys(path: Path) -> dict[str, torch.Size]:
    """Keys and shapes of the tensors in a sharded store."""
    metadata = FileSystemReader(path).read_metadata()
    out: dict[str, torch.Size] = {}
    for key, md in metadata.state_dict_metadata.items():
        size = getattr(md, "size", None)
        if size is not None:
            out[key] = torch.Size(size)
    return out


def read_sharded_tensors(path: Path, wanted: Mapping[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Read the tensors named by ``wanted`` (each rank asks only for what it owns)."""
    out = {key: torch.empty(shape, dtype=torch.float32) for key, shape in wanted.items()}
    if out:
        dcp.load(out, storage_reader=FileSystemReader(path), no_dist=True)
    return out


def consolidate(directory: _PATH, output: _PATH) -> None:
    """Turn a sharded checkpoint directory into one ordinary (consolidated) Lightning checkpoint file."""
    path = Path(directory)
    meta = read_sharded_meta(path)
    tensors = read_sharded_tensors(path, stored_keys(path))
    info = meta.pop(SHARDED_KEY + "_info")
    meta.pop(SHARDED_KEY, None)
    state_dict: dict[str, torch.Tensor] = {}
    for key in info["state_dict_keys"]:
        if key in meta["state_dict"]:
            state_dict[key] = meta["state_dict"][key]  # buffers
        else:
            dtype = getattr(torch, info["dtypes"].get(key, "float32"))
            state_dict[key] = tensors[f"model/{info['canonical'].get(key, key)}"].to(dtype)
    meta["state_dict"] = state_dict
    optimizer_states = []
    for k, groups in enumerate(info["param_groups"]):
        state: dict[int, dict[str, torch.Tensor]] = {}
        prefix = f"optim/{k}/"
        for key, value in tensors.items():
            if key.startswith(prefix):
                index, field = key[len(prefix) :].split("/")
                state.setdefault(int(index), {})[field] = value if field != "step" else value.reshape(())
        optimizer_states.append({"state": dict(sorted(state.items())), "param_groups": groups})
    meta["optimizer_states"] = optimizer_states
    _atomic_torch_save(meta, Path(output))


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m lightning_pstar.consolidate",
        description="Turn a PatrickStar sharded checkpoint directory into one consolidated checkpoint file.",
    )
    parser.add_argument("directory", help="the sharded checkpoint directory")
    parser.add_argument("output", help="the .ckpt file to write")
    args = parser.parse_args(argv)
    try:
        consolidate(args.directory, args.output)
    except CheckpointError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    print(f"wrote {args.output}")
    return 0
