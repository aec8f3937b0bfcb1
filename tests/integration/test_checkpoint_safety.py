"""Nothing lost, nothing silent (issue 14): kill points of every save, checksums, leftovers, a full disk.

The kill-point tests run one save in a forked child that stops with ``os._exit`` just before or just after its
N-th filesystem step (every ``os.replace``/``rename``/``symlink``/``unlink``/``mkdir``/``fsync``,
``shutil.rmtree`` and the atomic exchange, torch's and DCP's own included), for every N the save takes; after
each stop the name holds a complete checkpoint (the previous one until the new one is published), and the next
save removes what the killed one left without touching a user's file.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
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
    save_checkpoint_file,
    write_sharded,
)
from tests.helpers.killpoints import (
    KILLED,
    SAVES,
    Stop,
    assert_no_leftovers,
    assert_user_files_kept,
    in_child,
    meta_of,
    prepare,
    save_consolidated,
    save_sharded,
    version_at,
)

REPO = Path(__file__).resolve().parents[2]


def count_steps(tmp_path: Path, fmt: str, target: str) -> int:
    scratch = tmp_path / "count"
    scratch.mkdir()
    path = prepare(scratch, fmt, target)
    count_file = scratch / "count.txt"
    assert in_child(lambda: SAVES[fmt](path, 2), stop=Stop(), count_file=count_file) == 0
    assert version_at(path, fmt) == 2
    return len(count_file.read_text().split())


# the fallback for filesystems without an atomic exchange (real-directory) takes the most steps: the full suite
# kills it at every step; tests/integration/test_checkpoint_set_aside.py covers its set-aside path quickly
KILL_CASES = [
    ("consolidated", "link"),
    ("sharded", "link"),
    pytest.param("sharded", "real-directory", marks=pytest.mark.slow),
]


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
            code = in_child(lambda path=path: SAVES[fmt](path, 2), stop=Stop(n, when))
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
