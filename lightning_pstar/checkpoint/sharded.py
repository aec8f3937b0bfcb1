"""Sharded checkpoints: a directory that every rank writes in parallel, and its conversion to one file.

A sharded checkpoint is a directory: ``meta.pt`` (everything Lightning saves except the model and optimizer
tensors, written by rank 0) and a ``torch.distributed.checkpoint`` store in which every rank writes only the
parameters and optimizer states it owns. Keys name whole parameters (``model/<name>``,
``optim/<k>/<index>/<field>``), so the store loads at any world size. The name a user gives is a symbolic
link to the data directory, swapped atomically on every save (see :func:`write_sharded`).
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
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from lightning_pstar.checkpoint.io import CheckpointError, atomic_torch_save, load_file

__all__ = [
    "INFO_KEY",
    "META_FILENAME",
    "SHARDED_KEY",
    "consolidate",
    "is_sharded_checkpoint",
    "read_sharded_meta",
    "read_sharded_tensors",
    "sharded_meta",
    "stored_keys",
    "write_sharded",
]

META_FILENAME = "meta.pt"
SHARDED_KEY = "pstar_sharded_checkpoint"  # marks a checkpoint dict whose tensors live in a sharded store
INFO_KEY = SHARDED_KEY + "_info"  # what rebuilds an ordinary state_dict: names, aliases, dtypes, param_groups


def is_sharded_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a sharded checkpoint directory (or a link to one)."""
    target = Path(path)
    return target.is_dir() and (target / META_FILENAME).is_file()


def sharded_meta(checkpoint: Mapping[str, Any], info: dict[str, Any]) -> dict[str, Any]:
    """The ``meta.pt`` dict of a sharded save: Lightning's checkpoint dict without its optimizer tensors.

    ``info`` comes from ``model_state.sharded_info``; the optimizers' ``param_groups`` are added to it here.
    """
    meta = dict(checkpoint)
    info["param_groups"] = [state["param_groups"] for state in checkpoint.get("optimizer_states", [])]
    meta[INFO_KEY] = info
    meta[SHARDED_KEY] = True
    meta["optimizer_states"] = []
    return meta


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
        atomic_torch_save(meta, data / META_FILENAME)
        _publish(path, data)
    barrier()


def _publish(path: Path, data: Path) -> None:
    """Point the link ``path`` at ``data`` with one atomic rename, then delete what no link points at."""
    previous = path.resolve() if path.is_symlink() else None
    link = path.with_name(f".{path.name}.link-{os.getpid()}")
    if link.is_symlink() or link.exists():
        link.unlink()
    os.symlink(data.name, link)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)  # a directory from an older layout: replaced by the link
    os.replace(link, path)  # atomic: readers see the old checkpoint or the new one
    _remove_stale(path, keep=data, extra=previous)


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
    meta = load_file(path / META_FILENAME)
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


def consolidate(directory: str | os.PathLike[str], output: str | os.PathLike[str]) -> None:
    """Turn a sharded checkpoint directory into one ordinary (consolidated) Lightning checkpoint file."""
    path = Path(directory)
    meta = read_sharded_meta(path)
    tensors = read_sharded_tensors(path, stored_keys(path))
    info = meta.pop(INFO_KEY)
    meta.pop(SHARDED_KEY, None)
    state_dict: dict[str, torch.Tensor] = {}
    for key in info["state_dict_keys"]:
        if key in meta["state_dict"]:
            state_dict[key] = meta["state_dict"][key]  # buffers
        else:
            dtype = getattr(torch, info["dtypes"].get(key, "float32"))
            state_dict[key] = tensors[f"model/{info['canonical'].get(key, key)}"].to(dtype)
    meta["state_dict"] = state_dict
    meta["optimizer_states"] = [
        _optimizer_state(tensors, f"optim/{k}/", groups) for k, groups in enumerate(info["param_groups"])
    ]
    atomic_torch_save(meta, Path(output))


def _optimizer_state(tensors: Mapping[str, torch.Tensor], prefix: str, groups: Any) -> dict[str, Any]:
    """torch's optimizer layout (``state`` by parameter index, ``param_groups``) from the store's keys."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith(prefix):
            index, field = key[len(prefix) :].split("/")
            state.setdefault(int(index), {})[field] = value if field != "step" else value.reshape(())
    return {"state": dict(sorted(state.items())), "param_groups": groups}
