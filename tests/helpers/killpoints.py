"""Kill points: stop a checkpoint save before or after its N-th step, in forked processes, at 1 or 2 ranks.

A *step* is one filesystem call that can leave something behind (every ``os.replace``/``rename``/``symlink``/
``unlink``/``mkdir``/``fsync``, ``shutil.rmtree`` and the atomic exchange, torch's and DCP's own included) and, at
two ranks, one collective (``torch.distributed.barrier``, the object collectives DCP and the save use): a rank
killed there leaves its peer blocked or failing in the collective, which is what a dead node does. The steps of
one save are counted from the save's first call on, per rank (the process group is set up before counting).

- :func:`in_child` runs a body in one forked child (one rank, no process group);
- :func:`in_ranks` runs it in two forked children joined by a gloo process group, each stopped at its own step
  (or not at all), and returns each rank's exit status; a surviving rank that hangs past the timeout is killed
  and reported, since a dead peer must make a save fail, not hang.

Forking (not spawning) keeps one kill point at well under a second: the children inherit the imported torch.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import lightning_pstar.checkpoint.io as ckpt_io
from lightning_pstar.checkpoint import (
    load_checkpoint_file,
    read_sharded_meta,
    read_sharded_tensors,
    save_checkpoint_file,
    sharded_meta,
    stored_keys,
    write_sharded,
)

__all__ = [
    "COLLECTIVES",
    "FS_STEPS",
    "HANG",
    "KILLED",
    "SAVES",
    "Stop",
    "add_user_files",
    "assert_no_leftovers",
    "assert_user_files_kept",
    "consolidated_of",
    "in_child",
    "in_ranks",
    "instrument",
    "make_real_directory",
    "meta_of",
    "prepare",
    "save_consolidated",
    "save_sharded",
    "tensors_of",
    "version_at",
]

FS_STEPS = ("replace", "rename", "symlink", "unlink", "mkdir", "fsync")
COLLECTIVES = ("barrier", "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list")
KILLED = 17  # the exit status of a process stopped at its kill point
HANG = -1  # in_ranks' status of a rank it had to kill after the timeout


@dataclass(frozen=True)
class Stop:
    """Where one rank stops: before or after its step number ``at`` (0: never)."""

    at: int = 0
    when: str = "never"


def tensors_of(version: int, rank: int = 0, world: int = 1) -> dict[str, torch.Tensor]:
    """The tensors rank ``rank`` owns in save ``version`` (keys split over the ranks)."""
    gen = torch.Generator().manual_seed(version)
    full = {f"model/w{i}": torch.randn(64, 32, generator=gen) for i in range(4)}
    return {k: v for i, (k, v) in enumerate(full.items()) if i % world == rank}


def meta_of(version: int) -> dict[str, Any]:
    return sharded_meta({"global_step": version, "state_dict": {}}, {})


def consolidated_of(version: int) -> dict[str, Any]:
    return {"global_step": version, "state_dict": tensors_of(version)}


def instrument(stop: Stop, counter: list[int], names: list[str] | None = None, *, collectives: bool = False) -> None:
    """Make every step count (its name appended to ``names``); stop the process at ``stop``."""

    def wrap(owner: Any, name: str) -> None:
        real = getattr(owner, name)

        def step(*args: Any, **kwargs: Any) -> Any:
            counter[0] += 1
            mine = counter[0]  # steps nest (rmtree unlinks): each stops on its own number
            if names is not None:
                names.append(name)
            if mine == stop.at and stop.when == "before":
                os._exit(KILLED)
            try:
                return real(*args, **kwargs)
            finally:  # also after a step that raised (mkdir of an existing directory)
                if mine == stop.at and stop.when == "after":
                    os._exit(KILLED)

        setattr(owner, name, step)

    for name in FS_STEPS:
        wrap(os, name)
    wrap(shutil, "rmtree")
    wrap(ckpt_io, "_exchange")
    if collectives:
        for name in COLLECTIVES:
            wrap(dist, name)


def _child(body: Callable[[], Any], stop: Stop, count_file: Path | None, collectives: bool) -> int:
    counter = [0]
    names: list[str] = []
    instrument(stop, counter, names, collectives=collectives)
    body()
    if count_file is not None:
        count_file.write_text(" ".join(names))
    return 0


def in_child(body: Callable[[], Any], *, stop: Stop, count_file: Path | None = None) -> int:
    """Run ``body`` in a forked child (instrumented); its exit status (KILLED where it was stopped).

    With ``count_file``, the names of the steps the body took are written there, space-separated.
    """
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            code = _child(body, stop, count_file, collectives=False)
        except BaseException as err:  # noqa: BLE001 - reported through the exit status
            print(f"child failed: {type(err).__name__}: {err}", file=sys.stderr)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def in_ranks(
    body: Callable[[int], Any],
    *,
    stops: Mapping[int, Stop],
    count_dir: Path | None = None,
    timeout_s: float = 60.0,
    world_size: int = 2,
) -> dict[int, int]:
    """Run ``body(rank)`` in ``world_size`` forked gloo ranks, rank ``r`` stopped at ``stops[r]``.

    Returns each rank's exit status: 0 (finished), KILLED (stopped at its kill point), 1 (raised: a peer died
    under it) or HANG (still running ``timeout_s`` after the start: killed here). With ``count_dir``, rank ``r``
    writes the names of its steps to ``count_dir/rank<r>.txt``.
    """
    port = _free_port()
    pids: dict[int, int] = {}
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                dist.init_process_group(
                    "gloo",
                    init_method=f"tcp://127.0.0.1:{port}",
                    rank=rank,
                    world_size=world_size,
                    timeout=timedelta(seconds=timeout_s / 2),
                )
                count_file = None if count_dir is None else count_dir / f"rank{rank}.txt"
                code = _child(lambda rank=rank: body(rank), stops.get(rank, Stop()), count_file, collectives=True)
            except BaseException as err:  # noqa: BLE001 - reported through the exit status
                print(f"rank {rank} failed: {type(err).__name__}: {str(err).splitlines()[:1]}", file=sys.stderr)
            finally:
                os._exit(code)
        pids[rank] = pid
    return _wait_all(pids, timeout_s)


def _wait_all(pids: Mapping[int, int], timeout_s: float) -> dict[int, int]:
    codes: dict[int, int] = {}
    deadline = time.monotonic() + timeout_s
    while len(codes) < len(pids):
        for rank, pid in pids.items():
            if rank in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[rank] = os.waitstatus_to_exitcode(status)
        if len(codes) < len(pids) and time.monotonic() > deadline:
            for rank, pid in pids.items():
                if rank not in codes:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    codes[rank] = HANG
        time.sleep(0.01)
    return codes


def save_consolidated(path: Path, version: int) -> None:
    save_checkpoint_file(consolidated_of(version), path)


def save_sharded(path: Path, version: int) -> None:
    write_sharded(path, meta=meta_of(version), tensors=tensors_of(version), rank=0, barrier=lambda: None)


SAVES: dict[str, Callable[[Path, int], None]] = {"consolidated": save_consolidated, "sharded": save_sharded}


def version_at(path: Path, fmt: str) -> int:
    """The version of the complete checkpoint at ``path`` (its tensors checked against that version)."""
    if fmt == "consolidated":
        loaded = load_checkpoint_file(path)
        version = int(loaded["global_step"])
        got = loaded["state_dict"]
    else:
        meta = read_sharded_meta(path)
        version = int(meta["global_step"])
        got = read_sharded_tensors(path, stored_keys(path))
    want = tensors_of(version)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    return version


def make_real_directory(path: Path) -> None:
    """Replace the link of a sharded checkpoint by a real copy of its directory (what ``cp -rL`` makes)."""
    copy = path.with_name("copy")
    shutil.copytree(path, copy, symlinks=False)
    os.unlink(path)
    ckpt_io.remove_leftovers(path.parent)  # the data directory no link points at any more
    os.rename(copy, path)
    assert path.is_dir() and not path.is_symlink()


def add_user_files(root: Path) -> None:
    """Files of the user's beside the checkpoint, one of them named like our data directories."""
    (root / ".last.ckpt.mine").write_text("a user's file")
    (root / ".last.ckpt.123456789012345").mkdir()
    (root / ".last.ckpt.123456789012345" / "notes.txt").write_text("mine")


def prepare(tmp_path: Path, fmt: str, target: str) -> Path:
    """A directory with the previous checkpoint (version 1) at ``last.ckpt`` and a user's files beside it."""
    root = tmp_path / "ckpts"
    root.mkdir()
    path = root / "last.ckpt"
    SAVES[fmt](path, 1)
    if target == "real-directory":
        make_real_directory(path)
    add_user_files(root)
    return path


def assert_user_files_kept(root: Path) -> None:
    assert (root / ".last.ckpt.mine").read_text() == "a user's file"
    assert (root / ".last.ckpt.123456789012345" / "notes.txt").read_text() == "mine"


def assert_no_leftovers(path: Path) -> None:
    root = path.parent
    linked = {os.readlink(p) for p in root.iterdir() if p.is_symlink()}
    ours = {".last.ckpt.mine", ".last.ckpt.123456789012345"}
    extra = sorted(p.name for p in root.iterdir() if p.name.startswith(".") and p.name not in ours | linked)
    assert not extra, f"leftovers: {extra}"
