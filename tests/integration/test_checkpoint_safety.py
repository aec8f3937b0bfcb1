"""Nothing lost, nothing silent (issue 14): kill points of every save, checksums, leftovers, a full disk.

The kill-point tests run one save in a forked child that stops with ``os._exit`` just before or just after its
N-th filesystem step (every ``os.replace``/``rename``/``symlink``/``unlink``/``mkdir``/``fsync``,
``shutil.rmtree`` and the atomic exchange, torch's and DCP's own included), for every N the save takes; after
each stop the name holds a complete checkpoint (the previous one until the new one is published), and the next
save removes what the killed one left without touching a user's file.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_pstar.checkpoint.io as ckpt_io
from lightning_pstar.checkpoint import (
    CheckpointError,
    consolidate,
    load_checkpoint_file,
    main,
    read_sharded_meta,
    read_sharded_tensors,
    save_checkpoint_file,
    sharded_meta,
    stored_keys,
    write_sharded,
)

REPO = Path(__file__).resolve().parents[2]
STEPS = ("replace", "rename", "symlink", "unlink", "mkdir", "fsync", "rmtree", "exchange")
KILLED = 17


def tensors_of(version: int, rank: int = 0, world: int = 1) -> dict[str, torch.Tensor]:
    """The tensors rank ``rank`` owns in save ``version`` (keys split over the ranks)."""
    gen = torch.Generator().manual_seed(version)
    full = {f"model/w{i}": torch.randn(64, 32, generator=gen) for i in range(4)}
    return {k: v for i, (k, v) in enumerate(full.items()) if i % world == rank}


def meta_of(version: int) -> dict[str, Any]:
    return sharded_meta({"global_step": version, "state_dict": {}}, {})


def consolidated_of(version: int) -> dict[str, Any]:
    return {"global_step": version, "state_dict": tensors_of(version)}


def instrument(stop_at: int, when: str, counter: list[int]) -> None:
    """Make every filesystem step count; stop the process before/after step ``stop_at`` (0: never)."""

    def wrap(owner: Any, name: str) -> None:
        real = getattr(owner, name)

        def step(*args: Any, **kwargs: Any) -> Any:
            counter[0] += 1
            mine = counter[0]  # steps nest (rmtree unlinks): each stops on its own number
            if mine == stop_at and when == "before":
                os._exit(KILLED)
            try:
                return real(*args, **kwargs)
            finally:  # also after a step that raised (mkdir of an existing directory)
                if mine == stop_at and when == "after":
                    os._exit(KILLED)

        setattr(owner, name, step)

    for name in ("replace", "rename", "symlink", "unlink", "mkdir", "fsync"):
        wrap(os, name)
    wrap(shutil, "rmtree")
    wrap(ckpt_io, "_exchange")


def in_child(body: Callable[[], int | None], *, stop_at: int, when: str, count_file: Path | None = None) -> int:
    """Run ``body`` in a forked child (instrumented); its exit status (KILLED where it was stopped)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            counter = [0]
            instrument(stop_at, when, counter)
            body()
            if count_file is not None:
                count_file.write_text(str(counter[0]))
            code = 0
        except BaseException as err:  # noqa: BLE001 - reported through the exit status
            print(f"child failed: {type(err).__name__}: {err}", file=sys.stderr)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def save_consolidated(path: Path, version: int) -> None:
    save_checkpoint_file(consolidated_of(version), path)


def save_sharded(path: Path, version: int) -> None:
    write_sharded(path, meta=meta_of(version), tensors=tensors_of(version), rank=0, barrier=lambda: None)


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


SAVES = {"consolidated": save_consolidated, "sharded": save_sharded}
TARGETS = ["link", "real-directory"]  # the previous sharded checkpoint: our link, or a `cp -rL` copy


def prepare(tmp_path: Path, fmt: str, target: str) -> Path:
    """A directory with the previous checkpoint (version 1) at ``last.ckpt`` and a user's files beside it."""
    root = tmp_path / "ckpts"
    root.mkdir()
    path = root / "last.ckpt"
    SAVES[fmt](path, 1)
    if target == "real-directory":
        copy = root / "copy"
        shutil.copytree(path, copy, symlinks=False)  # what `cp -rL` makes
        os.unlink(path)
        ckpt_io.remove_leftovers(root)  # the data directory no link points at any more
        os.rename(copy, path)
        assert path.is_dir() and not path.is_symlink()
    (root / ".last.ckpt.mine").write_text("a user's file")
    (root / ".last.ckpt.123456789012345").mkdir()  # a user's directory of our data-directory name pattern
    (root / ".last.ckpt.123456789012345" / "notes.txt").write_text("mine")
    return path


def assert_user_files_kept(root: Path) -> None:
    assert (root / ".last.ckpt.mine").read_text() == "a user's file"
    assert (root / ".last.ckpt.123456789012345" / "notes.txt").read_text() == "mine"


def assert_no_leftovers(path: Path) -> None:
    root = path.parent
    linked = {os.readlink(p) for p in root.iterdir() if p.is_symlink()}
    ours = {".last.ckpt.mine", ".last.ckpt.123456789012345"}
    extra = sorted(p.name for p in root.iterdir() if p.name.startswith(".") and p.name not in ours | linked)
    assert not extra, f"leftovers after a successful save: {extra}"


def count_steps(tmp_path: Path, fmt: str, target: str) -> int:
    scratch = tmp_path / "count"
    scratch.mkdir()
    path = prepare(scratch, fmt, target)
    count_file = scratch / "count.txt"
    assert in_child(lambda: SAVES[fmt](path, 2), stop_at=0, when="never", count_file=count_file) == 0
    assert version_at(path, fmt) == 2
    return int(count_file.read_text())


KILL_CASES = [("consolidated", "link"), ("sharded", "link"), ("sharded", "real-directory")]


@pytest.mark.parametrize(("fmt", "target"), KILL_CASES)
def test_kill_at_every_filesystem_step_keeps_a_checkpoint(fmt: str, target: str, tmp_path: Path) -> None:
    steps = count_steps(tmp_path, fmt, target)
    assert steps >= 3, steps
    seen = {1: 0, 2: 0}
    for n in range(1, steps + 1):
        for when in ("before", "after"):
            case = tmp_path / f"{n}-{when}"
            case.mkdir()
            path = prepare(case, fmt, target)
            code = in_child(lambda path=path: SAVES[fmt](path, 2), stop_at=n, when=when)
            assert code == KILLED, (n, when, code)
            version = version_at(path, fmt)  # a complete checkpoint: the previous one or the new one
            seen[version] += 1
            assert_user_files_kept(path.parent)
            SAVES[fmt](path, 3)  # the next save works and removes what the killed one left
            assert version_at(path, fmt) == 3
            assert_no_leftovers(path)
            assert_user_files_kept(path.parent)
    print(f"{fmt}/{target}: {steps} filesystem steps, {2 * steps} kill points; found previous {seen[1]}, new {seen[2]}")
    assert seen[1] > 0


# ---- checksums ---------------------------------------------------------------------------------------------


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def storage_offset(path: Path, record: str = "/data/") -> int:
    """An offset inside the bytes of a record (a tensor storage by default) of a torch zip file."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if record in i.filename and i.file_size > 16)
        return info.header_offset + 30 + len(info.filename.encode()) + len(info.extra) + info.file_size // 2


def test_flipped_byte_in_a_consolidated_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "c.ckpt"
    save_consolidated(path, 1)
    torch.load(path, weights_only=False)  # plain torch reads it (no format of our own)
    flip(path, storage_offset(path))
    torch.load(path, weights_only=False)  # torch alone does not notice
    with pytest.raises(CheckpointError, match="checksum") as info:
        load_checkpoint_file(path)
    assert str(path) in str(info.value)


def test_truncated_consolidated_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "c.ckpt"
    save_consolidated(path, 1)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="truncated or corrupt") as info:
        load_checkpoint_file(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("damage", ["flip-shard", "truncate-shard", "flip-index", "flip-meta"])
def test_damaged_sharded_checkpoint_is_named(damage: str, tmp_path: Path) -> None:
    path = tmp_path / "s.ckpt"
    save_sharded(path, 1)
    data = path.resolve()
    shard = next(data.glob("*.distcp"))
    if damage == "flip-shard":
        flip(shard, shard.stat().st_size // 2)
        named = shard.name
    elif damage == "truncate-shard":
        shard.write_bytes(shard.read_bytes()[:-10])
        named = shard.name
    elif damage == "flip-index":
        flip(data / ".metadata", 40)
        named = ".metadata"
    else:
        flip(data / "meta.pt", storage_offset(data / "meta.pt", "data.pkl"))
        named = "meta.pt"
    with pytest.raises(CheckpointError) as info:
        read_sharded_meta(path)
    message = str(info.value)
    print(f"{damage}: {message}")
    assert named in message


def test_consolidate_command_on_a_damaged_shard_prints_one_line(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "s.ckpt"
    save_sharded(path, 1)
    shard = next(path.resolve().glob("*.distcp"))
    flip(shard, 100)
    with pytest.raises(SystemExit) as info:
        main([str(path), str(tmp_path / "out.ckpt")])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and shard.name in err, err
    assert not (tmp_path / "out.ckpt").exists()
    with pytest.raises(CheckpointError, match=shard.name):
        consolidate(path, tmp_path / "out.ckpt")


# ---- a full disk -------------------------------------------------------------------------------------------


@pytest.fixture
def small_filesystem(tmp_path: Path) -> Any:
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def big_tensors() -> dict[str, torch.Tensor]:
    return {f"model/big{i}": torch.ones(64 * 1024) for i in range(2)}  # 512 KiB: more than the filesystem


@pytest.mark.parametrize("fmt", ["consolidated", "sharded"])
def test_disk_full_names_the_path_and_keeps_the_previous_checkpoint(
    fmt: str, small_filesystem: Path, tmp_path: Path
) -> None:
    path = small_filesystem / "last.ckpt"
    SAVES[fmt](path, 1)
    before = sorted(p.name for p in small_filesystem.iterdir())
    with pytest.raises(CheckpointError, match="no space") as info:
        if fmt == "consolidated":
            save_checkpoint_file({"state_dict": big_tensors()}, path)
        else:
            write_sharded(path, meta=meta_of(2), tensors=big_tensors(), rank=0, barrier=lambda: None)
    assert str(path) in str(info.value)
    assert version_at(path, fmt) == 1
    assert sorted(p.name for p in small_filesystem.iterdir()) == before, "the partial output was left"


# ---- leftovers at start-up ---------------------------------------------------------------------------------


def test_leftovers_of_dead_writers_are_removed_and_users_files_kept(tmp_path: Path) -> None:
    path = prepare(tmp_path, "sharded", "link")
    root = path.parent
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (root / f".last.ckpt.pstar-tmp-{dead.pid}").write_bytes(b"PK\x03\x04partial")
    os.symlink("nowhere", root / f".last.ckpt.pstar-link-{dead.pid}")
    stale = root / ".last.ckpt.999999999999999"
    stale.mkdir()
    (stale / ckpt_io.DATA_MARKER).write_text(f"{socket.gethostname()} {dead.pid}\n")
    alive = root / ".last.ckpt.888888888888888"  # another live process's save in progress: kept
    alive.mkdir()
    (alive / ckpt_io.DATA_MARKER).write_text(f"{socket.gethostname()} {os.getppid()}\n")
    removed = ckpt_io.remove_leftovers(root)
    assert sorted(p.name for p in removed) == sorted(
        [f".last.ckpt.pstar-tmp-{dead.pid}", f".last.ckpt.pstar-link-{dead.pid}", stale.name]
    )
    assert alive.is_dir() and version_at(path, "sharded") == 1
    assert_user_files_kept(root)
