"""Nothing lost at two ranks (issue 14): kill points of 2-rank saves, and a disk that fills under one.

Each case forks two gloo ranks (``tests.helpers.killpoints.in_ranks``: a fraction of a second) that save version
2 over a previous 2-rank checkpoint (version 1) and stops one rank, or both, just before or just after its N-th
step: every filesystem call (torch's and DCP's own included) and every collective, counted per rank. The saves
are the strategy's: sharded, ``write_sharded`` with ``barrier=torch.distributed.barrier``; consolidated, what
``DDPStrategy.save_checkpoint`` and ``Trainer.save_checkpoint`` do after the state is gathered to rank 0 (rank 0
writes the file, then every rank waits in a barrier). After every stop:

- the rank that was not stopped ends by itself (finished, or failed because its peer died), never hangs;
- ``last.ckpt`` holds a complete checkpoint, the previous one or the new one, tensor for tensor equal to what
  was saved, and the user's files beside it are untouched;
- what the killed save left is removed, alternately by the start-up cleanup (``remove_leftovers``, which
  ``PatrickStarStrategy.load_checkpoint`` runs) and by a later 2-rank save.

The default run stops at the first occurrence of every distinct step of each rank and at rank 0's publishing
steps, before and after (both ranks: before only), and for a real directory at the name (``cp -rL``) only
where its steps differ (from the link on); the ``slow`` variant stops at every step of every case (run it with
``PSTAR_EXHAUSTIVE_KILLS=1``: it takes about two minutes).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import lightning_pstar.checkpoint.sharded as sharded
from lightning_pstar.checkpoint import CheckpointError, remove_leftovers, save_checkpoint_file, write_sharded
from tests.helpers.killpoints import (
    HANG,
    KILLED,
    Stop,
    add_user_files,
    assert_no_leftovers,
    assert_user_files_kept,
    in_ranks,
    make_real_directory,
    meta_of,
    tensors_of,
    version_at,
)

WORLD = 2
CASES = [("consolidated", "link"), ("sharded", "link"), ("sharded", "real-directory")]
# the quick subset keeps the cheapest 2-rank case; the sharded ones (10-15 s each) run in the full suite
QUICK_CASES = [CASES[0], *(pytest.param(*case, marks=pytest.mark.slow) for case in CASES[1:])]
WHO = ("rank0", "rank1", "both")


def save_body(fmt: str, path: Path, version: int) -> Callable[[int], None]:
    """What rank ``r`` runs to save ``version`` at two ranks."""

    def sharded(rank: int) -> None:
        tensors = tensors_of(version, rank, WORLD)
        write_sharded(path, meta=meta_of(version), tensors=tensors, rank=rank, barrier=dist.barrier)

    def consolidated(rank: int) -> None:
        gathered: list[Any] = [None] * WORLD  # the state gathered to rank 0 (here: to every rank)
        dist.all_gather_object(gathered, tensors_of(version, rank, WORLD))
        if rank == 0:
            state = {k: v for part in gathered for k, v in part.items()}
            save_checkpoint_file({"global_step": version, "state_dict": dict(sorted(state.items()))}, path)
        dist.barrier()  # Trainer.save_checkpoint's barrier

    return sharded if fmt == "sharded" else consolidated


def two_rank_save(fmt: str, path: Path, version: int) -> None:
    codes = in_ranks(save_body(fmt, path, version), stops={})
    assert codes == {0: 0, 1: 0}, codes


def make_template(root: Path, fmt: str, target: str) -> Path:
    """``root/ckpts/last.ckpt``: version 1 saved at two ranks, the user's files beside it."""
    folder = root / "ckpts"
    folder.mkdir(parents=True)
    path = folder / "last.ckpt"
    two_rank_save(fmt, path, 1)
    if target == "real-directory":
        make_real_directory(path)
    add_user_files(folder)
    return path


def copy_of(template: Path, case: Path) -> Path:
    shutil.copytree(template.parent, case / "ckpts", symlinks=True)
    return case / "ckpts" / template.name


def steps_of(template: Path, fmt: str, scratch: Path) -> dict[int, list[str]]:
    """The names of the steps each rank's save takes over a copy of ``template``."""
    path = copy_of(template, scratch)
    assert in_ranks(save_body(fmt, path, 2), stops={}, count_dir=scratch) == {0: 0, 1: 0}
    assert version_at(path, fmt) == 2
    return {rank: (scratch / f"rank{rank}.txt").read_text().split() for rank in range(WORLD)}


def chosen(names: list[str], every: bool, publish: bool) -> list[int]:
    """Step numbers (1-based) to stop at: all, or the first occurrence of every distinct step (and, with
    ``publish``, the last ``replace``/``exchange``/``rmtree``: the publishing of the new checkpoint)."""
    if every:
        return list(range(1, len(names) + 1))
    picks = {names.index(n) + 1 for n in set(names)}
    if publish:
        picks |= {len(names) - names[::-1].index(n) for n in ("replace", "_exchange", "rmtree") if n in names}
    return sorted(picks)


def kill_points(
    steps: dict[int, list[str]], every: bool, *, publish_only: bool = False
) -> Iterator[tuple[str, dict[int, Stop]]]:
    """The cases: who is stopped (rank 0, rank 1, both) and where. ``publish_only`` (the default run's
    real-directory case, whose steps differ from the link case's only from the link on): rank 0 and both
    ranks, at rank 0's publishing steps."""
    start = steps[0].index("symlink") + 1 if publish_only else 1
    for who in ("rank0", "both") if publish_only else WHO:
        ranks = [0, 1] if who == "both" else [int(who[-1])]
        longest = max((steps[r] for r in ranks), key=len)
        whens = ("before",) if who == "both" and not every else ("before", "after")
        for n in chosen(longest, every, publish=who != "both"):
            if n < start:
                continue
            for when in whens:
                yield f"{who}@{n}-{when}", {r: Stop(min(n, len(steps[r])), when) for r in ranks}


def check_kill_points(tmp_path: Path, fmt: str, target: str, every: bool) -> None:
    template = make_template(tmp_path / "template", fmt, target)
    scratch = tmp_path / "count"
    scratch.mkdir()
    steps = steps_of(template, fmt, scratch)
    found = {1: 0, 2: 0}
    total = both_killed = 0
    publish_only = target == "real-directory" and not every
    for i, (name, stops) in enumerate(kill_points(steps, every, publish_only=publish_only)):
        case = tmp_path / name
        case.mkdir()
        path = copy_of(template, case)
        codes = in_ranks(save_body(fmt, path, 2), stops=stops)
        for rank in range(WORLD):
            # a survivor finishes or fails, it never hangs; with both stopped, one whose peer died first may fail
            # before it reaches its own kill point
            want = {0, 1} if rank not in stops else {KILLED, 1} if len(stops) > 1 else {KILLED}
            assert codes[rank] in want and codes[rank] != HANG, (name, steps[rank], codes)
        assert KILLED in codes.values(), (name, codes)
        both_killed += list(codes.values()) == [KILLED] * WORLD
        found[version_at(path, fmt)] += 1  # complete, tensor for tensor: the previous checkpoint or the new one
        assert_user_files_kept(path.parent)
        if i % 2 == 0:
            remove_leftovers(path.parent)  # start-up (PatrickStarStrategy.load_checkpoint)
            assert version_at(path, fmt) in (1, 2)
        else:
            two_rank_save(fmt, path, 3)  # a later save
            assert version_at(path, fmt) == 3
        assert_no_leftovers(path)
        assert_user_files_kept(path.parent)
        total += 1
    print(
        f"2 ranks {fmt}/{target}: steps rank0 {len(steps[0])} rank1 {len(steps[1])}; {total} kill points;"
        f" found previous {found[1]}, new {found[2]}; both ranks killed in {both_killed}"
    )
    assert found[1] > 0 and found[2] > 0 and both_killed > 0


@pytest.mark.parametrize(("fmt", "target"), QUICK_CASES)
def test_two_rank_kill_points_keep_a_checkpoint(fmt: str, target: str, tmp_path: Path) -> None:
    check_kill_points(tmp_path, fmt, target, every=False)


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("PSTAR_EXHAUSTIVE_KILLS"),
    reason="the exhaustive 2-rank kill sweep (every step of every case, about 2 minutes) runs with"
    " PSTAR_EXHAUSTIVE_KILLS=1; the default run stops at every distinct step",
)
@pytest.mark.parametrize(("fmt", "target"), CASES)
def test_two_rank_kill_at_every_step_keeps_a_checkpoint(fmt: str, target: str, tmp_path: Path) -> None:
    check_kill_points(tmp_path, fmt, target, every=True)


# ---- a full disk at two ranks ------------------------------------------------------------------------------


@pytest.mark.parametrize("when", ["before-writing", "while-writing"])
def test_two_rank_disk_full_names_the_path_and_keeps_the_previous_checkpoint(
    when: str, small_filesystem: Path, tmp_path: Path
) -> None:
    """``before-writing``: the save's own free-space check refuses it; ``while-writing``: the check is blinded
    (as if another program filled the disk after it), so a rank's DCP write fails on the full disk."""
    path = small_filesystem / "last.ckpt"
    two_rank_save("sharded", path, 1)
    before = sorted(p.name for p in small_filesystem.iterdir())
    errors = tmp_path / "errors"
    errors.mkdir()

    def big_save(rank: int) -> None:
        if when == "while-writing":
            sharded._total_bytes = lambda tensors: 0  # this forked rank only
        tensors = {f"model/big{rank}": torch.ones(40 * 1024)}  # 160 KiB per rank: more than the filesystem
        try:
            write_sharded(path, meta=meta_of(2), tensors=tensors, rank=rank, barrier=dist.barrier)
        except CheckpointError as err:
            (errors / f"rank{rank}.txt").write_text(str(err))

    assert in_ranks(big_save, stops={}) == {0: 0, 1: 0}
    for rank in range(WORLD):
        message = (errors / f"rank{rank}.txt").read_text()  # every rank raised a CheckpointError
        print(f"rank {rank}: {message}")
        assert "no space" in message and str(path) in message, (rank, message)
    assert version_at(path, "sharded") == 1
    assert sorted(p.name for p in small_filesystem.iterdir()) == before, "the partial output was left"
