"""Crash-safe checkpoint files: atomic writes, checked loads whose errors name the file, leftovers removed.

Every file is written to a temporary name in the same directory, fsynced and renamed into place, so a
process killed in the middle of a save leaves the previous checkpoint intact (see [Note: publishing]);
loading a truncated or corrupt file raises a :class:`CheckpointError` that names the file and what is wrong
(:mod:`~lightning_pstar.checkpoint.integrity` checks the checksums written with it). The Lightning
``CheckpointIO`` built on these functions lives in ``lightning_pstar/checkpointing.py`` (only the glue files
import Lightning).

[Note: publishing]
A new checkpoint becomes visible under its final name in one atomic step: ``rename(2)`` of a file or a symbolic
link onto the name. A name held by a real directory (a sharded checkpoint copied with ``cp -rL``) cannot be
replaced by ``rename``; there the new entry and the directory swap places atomically (Linux
``renameat2(RENAME_EXCHANGE)``) and the old directory is deleted afterwards. Where the exchange is missing, the
directory is first renamed aside to ``.<name>.pstar-aside-<pid>``; a kill before the new entry is published
leaves it there and the next save or load puts it back (:func:`restore_set_aside`: every PatrickStar load
and ``python -m lightning_pstar.consolidate``; plain readers cannot know the name). Everything a save writes
beside the final name has a name of its own pattern (``.<name>.pstar-tmp-<pid>``, ``.<name>.pstar-link-<pid>``,
``.<name>.<ns>`` data directories holding a ``.pstar-data`` marker) and :func:`remove_leftovers` deletes only
such entries whose writer has gone: never a user's file.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Any

import torch

from lightning_pstar.checkpoint.integrity import ChecksumMismatch, describe_damage, verify_torch_file

__all__ = [
    "DATA_MARKER",
    "CheckpointError",
    "atomic_torch_save",
    "load_checkpoint_file",
    "load_file",
    "no_space_error",
    "publish",
    "remove_checkpoint_path",
    "remove_leftovers",
    "restore_set_aside",
    "save_checkpoint_file",
    "write_data_marker",
]

log = logging.getLogger(__name__)

DATA_MARKER = ".pstar-data"  # in every data directory of a sharded save: "<host> <pid>" of the writer
_TMP = re.compile(r"^\.(?P<name>.+)\.pstar-(?P<kind>tmp|link|aside)-(?P<pid>\d+)$")
_DATA = re.compile(r"^\.(?P<name>.+)\.(?P<ns>\d{12,})$")
_LEGACY_DATA_FILES = re.compile(r"^(meta\.pt|\.metadata|__\d+_\d+\.distcp|\..*\.pstar-tmp-\d+|\.meta\.pt\.tmp-\d+)$")


class CheckpointError(ValueError):
    """A checkpoint file or directory cannot be used (truncated, corrupt, incomplete, another model)."""


def no_space_error(err: BaseException) -> bool:
    """Whether ``err`` (or an error it was raised from) means the filesystem is full."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "no space left on device" in str(seen).lower():
            return True
        failures = getattr(seen, "failures", None)  # DCP's CheckpointException: rank -> (error, traceback)
        if isinstance(failures, dict):
            raised = [f[0] if isinstance(f, tuple) and f else f for f in failures.values()]
            if any(isinstance(f, BaseException) and no_space_error(f) for f in raised):
                return True
        seen = seen.__cause__ or seen.__context__
    return False


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` ``obj`` to ``path`` so that readers see the old file or the new one, never half of one.

    A full filesystem raises a :class:`CheckpointError` naming ``path`` and "no space"; the partial file is
    removed and whatever ``path`` held before is kept.
    """
    tmp = path.with_name(f".{path.name}.pstar-tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, path)
    except Exception as err:
        if no_space_error(err):
            raise CheckpointError(
                f"cannot write checkpoint '{path}': no space left on device ({err})."
                " The partial file was removed and the previous checkpoint kept."
                " HINT: free disk space or save elsewhere (ModelCheckpoint(dirpath=...), save_top_k)."
            ) from err
        raise
    finally:
        if tmp.exists() or tmp.is_symlink():
            tmp.unlink()


def _exchange(a: Path, b: Path) -> bool:
    """Swap the entries ``a`` and ``b`` atomically (Linux ``renameat2``); False where that is not available."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False  # this filesystem or kernel cannot exchange
    raise OSError(code, os.strerror(code), str(b))


def publish(new: Path, path: Path) -> None:
    """Make ``new`` (a file or a link beside ``path``) the entry at ``path`` in one atomic step; see
    [Note: publishing]. Whatever ``path`` held before is removed only once ``new`` is in place."""
    if path.is_dir() and not path.is_symlink():
        if _exchange(new, path):
            _fsync_dir(path.parent)
            shutil.rmtree(new)  # `new` now names the old directory
            return
        aside = path.with_name(f".{path.name}.pstar-aside-{os.getpid()}")
        os.replace(path, aside)
        os.replace(new, path)
        _fsync_dir(path.parent)
        shutil.rmtree(aside)
        return
    os.replace(new, path)  # atomic on POSIX: readers see the old entry or the new one, never half of one
    _fsync_dir(path.parent)


def write_data_marker(directory: Path) -> None:
    """Mark ``directory`` as a data directory written by this process (see :func:`remove_leftovers`)."""
    (directory / DATA_MARKER).write_text(f"{socket.gethostname()} {os.getpid()}\n")


def _writer_gone(host: str, pid: int) -> bool:
    """Whether the process that wrote an entry can no longer be writing it (this process counts as gone:
    its saves run one at a time and clean up after themselves)."""
    if host != socket.gethostname():
        return False  # another machine's process: not ours to judge
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _is_our_data_dir(entry: Path) -> tuple[bool, bool]:
    """(written by this package, its writer has gone) for a ``.<name>.<ns>`` directory."""
    marker = entry / DATA_MARKER
    if marker.is_file():
        host, _, pid = marker.read_text().strip().partition(" ")
        return True, pid.isdigit() and _writer_gone(host, int(pid))
    # a data directory of an older version: no marker, only the files a sharded save writes
    # (or one killed before its marker was written: empty, so removing it loses nothing)
    names = [p.name for p in entry.iterdir()]
    return all(_LEGACY_DATA_FILES.match(n) for n in names), True


def remove_leftovers(directory: Path) -> list[Path]:
    """Delete what killed or failed saves left in ``directory``; return what was deleted.

    Only entries of this package's name patterns whose writer has gone (see [Note: publishing]): temporary
    files, link symlinks, data directories no link points at; a directory set aside is put back where its
    name is empty. Nothing else is touched.
    """
    if not directory.is_dir():
        return []
    removed: list[Path] = []
    for entry in [p for p in directory.iterdir() if p.name.startswith(".")]:
        match = _TMP.match(entry.name)
        if match is not None and _writer_gone(socket.gethostname(), int(match["pid"])):
            _remove_tmp(entry, match["kind"], directory / match["name"], removed)
    # only now the links: a link symlink of a save killed before publishing it no longer keeps its data
    linked = {os.readlink(p) for p in directory.iterdir() if p.is_symlink()}
    for entry in [p for p in directory.iterdir() if p.name.startswith(".")]:
        data = _DATA.match(entry.name)
        if data is None or entry.is_symlink() or not entry.is_dir() or entry.name in linked:
            continue
        ours, gone = _is_our_data_dir(entry)
        if ours and gone:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _remove_tmp(entry: Path, kind: str, final: Path, removed: list[Path]) -> None:
    if kind == "aside":
        if entry.is_dir() and not (final.exists() or final.is_symlink()):
            os.replace(entry, final)  # killed between setting it aside and publishing: put it back
            return
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
        return
    if entry.is_dir() and not entry.is_symlink():
        # a temporary name that an exchange gave the replaced directory (see `publish`), killed before rmtree
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    elif kind == "link" and entry.is_symlink():
        entry.unlink()
        removed.append(entry)
    elif kind == "tmp" and entry.is_file() and not entry.is_symlink():
        entry.unlink()
        removed.append(entry)


def restore_set_aside(path: str | os.PathLike[str]) -> Path | None:
    """Put back the checkpoint directory a save set aside at ``path`` and was killed before publishing its
    replacement ([Note: publishing]); return the name it had (None: nothing to put back).

    Only when ``path`` is empty and the writer named in the entry has gone: a save in flight is left alone.
    Several ranks may race here: the first one's rename wins, the others find the entry gone.
    """
    target = Path(path)
    if target.exists() or target.is_symlink() or not target.parent.is_dir():
        return None
    prefix = f".{target.name}.pstar-aside-"
    here = socket.gethostname()
    found = [
        entry
        for entry in target.parent.iterdir()
        if entry.name.startswith(prefix)
        and entry.name[len(prefix) :].isdigit()
        and entry.is_dir()
        and not entry.is_symlink()
        and _writer_gone(here, int(entry.name[len(prefix) :]))
    ]
    for entry in sorted(found, key=lambda e: e.stat().st_mtime, reverse=True):  # the latest set aside
        try:
            os.replace(entry, target)
        except OSError:
            if target.exists():
                return None  # another rank put one back first
            continue
        _fsync_dir(target.parent)
        log.warning(
            "PatrickStar: checkpoint '%s' was set aside as '%s' by a save killed before it published its"
            " replacement; it is back in place.",
            target,
            entry.name,
        )
        return entry
    return None


def load_file(path: Path, *, map_location: Any = "cpu", weights_only: bool | None = False) -> Any:
    """``torch.load`` ``path`` after checking its checksums; a missing, truncated or corrupt file raises a
    :class:`CheckpointError` naming it and what is wrong."""
    restore_set_aside(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint '{path}' does not exist. HINT: check the path (ckpt_path=...).")
    if path.is_dir():
        if (path / "meta.pt").is_file():  # sharded.META_FILENAME (that module imports this one)
            raise CheckpointError(
                f"checkpoint '{path}' is a PatrickStar sharded checkpoint directory, not one file."
                f" HINT: resume it with Trainer(strategy='patrickstar', ...).fit(ckpt_path=...) at any world size,"
                f" or make one file that plain Lightning and torch.load read:"
                f" python -m lightning_pstar.consolidate {path} OUT.ckpt"
            )
        raise CheckpointError(
            f"checkpoint '{path}' is a directory but not a PatrickStar sharded checkpoint (no meta.pt)."
            " HINT: pass a checkpoint file, or a directory written with checkpoint='sharded'."
        )
    hint = (
        " HINT: resume from an earlier checkpoint; files written by PatrickStar are renamed into place only"
        " when complete, so a damaged one was cut short or changed afterwards (copy, disk, network)."
    )
    try:
        verify_torch_file(path)
    except ChecksumMismatch as err:
        raise CheckpointError(f"checkpoint {err}; it is truncated or corrupt.{hint}") from err
    try:
        return torch.load(path, map_location=map_location, weights_only=bool(weights_only))
    except Exception as err:  # noqa: BLE001 - a damaged file makes torch.load raise almost anything
        raise CheckpointError(
            f"checkpoint '{path}' is truncated or corrupt and cannot be read: {describe_damage(err)}.{hint}"
        ) from err


def save_checkpoint_file(checkpoint: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write one checkpoint file atomically, creating its directory if needed, and delete what earlier killed
    saves left beside it."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(target.parent)
    atomic_torch_save(checkpoint, target)
    remove_leftovers(target.parent)  # a sharded checkpoint this file replaced leaves its data directory


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
