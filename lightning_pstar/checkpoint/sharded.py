"""Sharded checkpoints: a directory that every rank writes in parallel, and its conversion to one file.

A sharded checkpoint is a directory: ``meta.pt`` (everything Lightning saves except the model and optimizer
tensors, written by rank 0) and a ``torch.distributed.checkpoint`` store in which every rank writes only the
parameters and optimizer states it owns. Keys name whole parameters (``model/<name>``,
``optim/<k>/<index>/<field>``), so the store loads at any world size. The name a user gives is a symbolic
link to the data directory, swapped atomically on every save (see :func:`write_sharded`). ``meta.pt`` keeps the
CRC32 of every file of the store, checked on load.

Plain Lightning (``strategy="auto"``, ``LightningModule.load_from_checkpoint``) reads files only: given a
sharded directory it fails with ``IsADirectoryError``. Turn the directory into one file first with
``python -m lightning_pstar.consolidate DIR OUT.ckpt``.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
import warnings
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from lightning_pstar.checkpoint.integrity import ChecksumMismatch, file_checksums, verify_checksums
from lightning_pstar.checkpoint.io import (
    CheckpointError,
    atomic_torch_save,
    load_file,
    no_space_error,
    publish,
    remove_leftovers,
    restore_set_aside,
    write_data_marker,
)

__all__ = [
    "INFO_KEY",
    "META_FILENAME",
    "SHARDED_KEY",
    "CHECKSUMS_KEY",
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
CHECKSUMS_KEY = SHARDED_KEY + "_checksums"  # file name -> {"crc32", "bytes"} of every file of the store


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
    if "optimizer_states" in checkpoint:  # a weights-only save has none, which is how Lightning recognises one
        meta["optimizer_states"] = []
        info["weights_only"] = False
    else:
        info["weights_only"] = True
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

    The data goes to a fresh hidden directory next to ``path`` (marked as this package's, see
    :func:`~lightning_pstar.checkpoint.io.remove_leftovers`); every rank adds the checksums of the files it
    wrote to ``meta.pt``; when every rank has finished, rank 0 publishes ``path`` (a symbolic link to the data)
    in one atomic step and then deletes the previous data ([Note: publishing] in ``io.py``). A process killed at
    any moment leaves ``path`` holding a complete checkpoint, old or new. A full disk raises a
    :class:`CheckpointError` naming the path and "no space" on every rank, after removing the partial data.
    """
    data: Path | None = None
    try:
        needed = _total_bytes(tensors)
        data = path.with_name(
            _from_rank0(rank, lambda: _new_data_directory(path, needed), "start the sharded checkpoint")
        )
        with _single_process_is_intended():
            dcp.save(tensors, storage_writer=FileSystemWriter(data))
        mine = file_checksums(data, sorted(p.name for p in data.glob(f"__{rank}_*.distcp")))
        if rank == 0:
            mine.update(file_checksums(data, [".metadata"]))
        checksums = _gather_checksums(mine)
        barrier()
        written = data
        _from_rank0(rank, lambda: _finish(path, written, meta, checksums), "publish the checkpoint")
    except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
        full = _agreed_no_space(err, no_space_error(err) or _short_of_space(path.parent, tensors))
        if rank == 0 and data is not None and not _points_at(path, data):
            shutil.rmtree(data, ignore_errors=True)  # the partial output: no leftover fills the disk
        if full:
            raise CheckpointError(
                f"cannot write sharded checkpoint '{path}': no space left on device ({_first_line(err)})."
                " The partial data was removed and the previous checkpoint kept."
                " HINT: free disk space or save elsewhere (ModelCheckpoint(dirpath=...), save_top_k)."
            ) from err
        raise


def _total_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """The bytes of the tensors every rank saves (a collective where a process group runs)."""
    mine = sum(t.numel() * t.element_size() for t in tensors.values())
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return mine
    gathered: list[int | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    return sum(n or 0 for n in gathered)


def _new_data_directory(path: Path, needed: int) -> str:
    """Rank 0: remove what killed saves left, refuse a save that cannot fit, create this save's marked data
    directory; its name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(path.parent)
    free = shutil.disk_usage(path.parent).free
    if free < needed:  # the tensors alone: the store's files are a little larger still
        raise OSError(
            errno.ENOSPC,
            f"No space left on device: the save needs at least {needed} bytes, the filesystem has {free} free;"
            " nothing was written",
            str(path.parent),
        )
    token = f".{path.name}.{time.time_ns()}"
    (path.parent / token).mkdir()
    write_data_marker(path.parent / token)
    return token


def _finish(path: Path, data: Path, meta: dict[str, Any], checksums: dict[str, dict[str, int]]) -> str:
    """Rank 0, once every rank has written its files: ``meta.pt`` with the checksums, then publish."""
    meta[CHECKSUMS_KEY] = checksums
    atomic_torch_save(meta, data / META_FILENAME)
    _publish(path, data)
    return ""


def _points_at(path: Path, data: Path) -> bool:
    """Whether ``path`` already names ``data`` (published: never delete it then, whatever failed after)."""
    return path.is_symlink() and os.readlink(path) == data.name


def _from_rank0(rank: int, work: Callable[[], str], what: str) -> str:
    """Run ``work`` on rank 0 and give every rank its result; where it raised on rank 0, every rank raises.

    A failure of rank 0 alone would leave the other ranks waiting in the next collective until the process
    group's timeout: they raise at once instead, with rank 0's reason (a full disk reads as one everywhere).
    """
    outcome = ["", ""]  # (result, error)
    failure: BaseException | None = None
    if rank == 0:
        try:
            outcome[0] = work()
        except Exception as err:  # noqa: BLE001 - re-raised below, after the other ranks are told
            failure = err
            outcome[1] = f"{type(err).__name__}: {_first_line(err)}"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(outcome, src=0)
    if failure is not None:
        raise failure
    if outcome[1]:
        raise CheckpointError(f"rank 0 could not {what}: {outcome[1]}")
    return outcome[0]


def _agreed_no_space(err: BaseException, mine: bool) -> bool:
    """Whether any rank found the disk full, asked before rank 0 removes the partial data (which frees it).

    DCP raises its ``CheckpointException`` on every rank together, so every rank can answer; after any other
    error a peer may be gone and this rank's own answer stands.
    """
    if not isinstance(err, CheckpointException):
        return mine
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return mine
    answers: list[bool | None] = [None] * torch.distributed.get_world_size()
    try:
        torch.distributed.all_gather_object(answers, mine)
    except Exception:  # noqa: BLE001 - a peer that died meanwhile: keep this rank's own answer
        return mine
    return any(bool(a) for a in answers)


def _short_of_space(directory: Path, tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether the filesystem has less room left than this rank's tensors take: DCP's writer can lose the
    ENOSPC of a full disk inside torch's zip writer ("unexpected pos"), so the free space tells instead."""
    needed = sum(t.numel() * t.element_size() for t in tensors.values())
    return shutil.disk_usage(directory).free < needed


def _first_line(err: BaseException) -> str:
    """One line saying what went wrong (for DCP's ``CheckpointException``: what each failed rank raised)."""
    failures = getattr(err, "failures", None)
    if isinstance(err, CheckpointException) and isinstance(failures, dict) and failures:
        parts = []
        for rank, failure in sorted(failures.items()):
            raised = failure[0] if isinstance(failure, tuple) and failure else failure
            parts.append(f"rank {rank}: {type(raised).__name__}: {_first_line(raised)}")
        return "; ".join(parts)
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def _gather_checksums(mine: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Every rank's file checksums, merged (what rank 0 writes to ``meta.pt``)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return dict(mine)
    gathered: list[dict[str, dict[str, int]] | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    merged: dict[str, dict[str, int]] = {}
    for table in gathered:
        merged.update(table or {})
    return merged


def _publish(path: Path, data: Path) -> None:
    """Point ``path`` at ``data`` with one atomic step, then delete what no link points at any more."""
    link = path.with_name(f".{path.name}.pstar-link-{os.getpid()}")
    if link.is_symlink() or link.exists():
        link.unlink()
    os.symlink(data.name, link)
    try:
        publish(link, path)
    finally:
        if link.is_symlink():
            link.unlink()
    remove_leftovers(path.parent)


def read_sharded_meta(path: Path) -> dict[str, Any]:
    """The checkpoint dict of a sharded checkpoint (tensors stay in the store), after checking the store."""
    meta = load_file(path / META_FILENAME)
    if not isinstance(meta, dict) or SHARDED_KEY not in meta:
        raise CheckpointError(f"'{path / META_FILENAME}' is not the metadata of a PatrickStar sharded checkpoint.")
    try:
        verify_checksums(path, meta.pop(CHECKSUMS_KEY, None) or {})  # older checkpoints have none
    except ChecksumMismatch as err:
        raise CheckpointError(
            f"sharded checkpoint '{path}' is damaged: {err}. HINT: resume from an earlier checkpoint or copy"
            " the directory again; PatrickStar publishes a checkpoint only when every file is complete."
        ) from err
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
        with _single_process_is_intended():
            dcp.load(out, storage_reader=FileSystemReader(path), no_dist=True)
    return out


@contextmanager
def _single_process_is_intended() -> Generator[None, None, None]:
    """Silence torch's "torch.distributed is disabled ... assuming the intent is to save/load in a single process"
    around this module's own ``dcp`` calls: a one-process save and every rank's own read (``no_dist=True``) are
    single-process by design, and the warning gives the user nothing to act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def consolidate(directory: str | os.PathLike[str], output: str | os.PathLike[str]) -> None:
    """Turn a sharded checkpoint directory into one ordinary (consolidated) Lightning checkpoint file."""
    path = Path(directory)
    restore_set_aside(path)  # a save killed mid-publish: [Note: publishing] in io.py
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
    if not info.get("weights_only", False):  # plain Lightning's weights-only file has no optimizer_states
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
