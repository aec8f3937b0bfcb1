"""The rank launcher of the distributed tests fails a test for every way a rank can fail.

A harness that ignores a crashed or stuck rank proves nothing, so the harness itself is tested first: a rank
that raises, a rank that exits with a non-zero code without a Python exception, and a rank that never finishes
must each make the call raise, with the worker's own traceback text. Nothing here depends on how fast the
machine is: a rank's timeout counts from when it is ready (launch.py's note), and the hanging rank says when it
starts to hang.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from launch import WorkerFailure, WorkerTimeout, run_commands, run_isolated, run_ranks


def _rank_and_env(rank: int, world_size: int) -> tuple[int, int, str, str, str]:
    return rank, world_size, os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["OMP_NUM_THREADS"]


def _raise_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError(f"deliberate failure on rank {rank} of {world_size}")
    return rank


def _exit_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)  # no exception, no traceback: only the exit code tells
    return rank


HANG_TIMEOUT_S = 8.0


def _hang_on_rank_zero(rank: int, world_size: int, hung_at: str) -> int:
    if rank == 0:
        Path(hung_at).write_text(repr(time.monotonic()))  # the readiness signal the test reads
        time.sleep(3600)
    return rank


def _fail_in_isolation(message: str) -> None:
    raise RuntimeError(message)


def test_returns_every_rank_value() -> None:
    results = run_ranks(_rank_and_env, 2, timeout=60)
    assert results == [(0, 2, "0", "2", "1"), (1, 2, "1", "2", "1")]


def test_exception_in_one_rank_fails_the_test() -> None:
    with pytest.raises(WorkerFailure, match="deliberate failure on rank 1 of 2") as info:
        run_ranks(_raise_on_rank_one, 2, timeout=60)
    failure = info.value
    assert not isinstance(failure, WorkerTimeout)
    assert failure.outcome(0).ok
    rank1 = failure.outcome(1)
    assert rank1.exitcode == 1 and not rank1.killed
    # the worker's own traceback, not just a message: the function and the line that raised
    assert "Traceback (most recent call last)" in rank1.error
    assert "_raise_on_rank_one" in rank1.error and "ValueError" in rank1.error


def test_exit_code_of_one_rank_fails_the_test() -> None:
    with pytest.raises(WorkerFailure, match=r"rank 1: exit code 3") as info:
        run_ranks(_exit_on_rank_one, 2, timeout=60)
    assert info.value.outcome(1).exitcode == 3
    assert info.value.outcome(0).ok


def _after_a_slow_start(value: str) -> str:
    time.sleep(HANG_TIMEOUT_S + 2)
    return value


class _SlowToUnpickle:
    """An argument that takes longer than the timeout to unpickle in the worker, before fn runs: what slow
    imports on a loaded machine look like to the launcher. It arrives as the plain string."""

    def __init__(self, value: str) -> None:
        self.value = value

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return _after_a_slow_start, (self.value,)


@pytest.mark.slow
def test_hanging_rank_is_killed_at_the_timeout_counted_from_readiness(tmp_path: Path) -> None:
    """A rank that hangs is killed at the timeout, with its stack, while the other rank's success is kept; and the
    timeout counts from when the rank was ready, not from the launch: here each rank's start-up alone (an argument
    slow to unpickle) outlasts the timeout. [Note: one launch for both claims; they had a test each, the first
    with a plain argument, until the full suite's time was trimmed: this launch is that one plus a slow start.]"""
    hung_at = tmp_path / "hung_at"
    with pytest.raises(WorkerTimeout, match="still running after the timeout") as info:
        run_ranks(_hang_on_rank_zero, 2, _SlowToUnpickle(str(hung_at)), timeout=HANG_TIMEOUT_S)
    rank0 = info.value.outcome(0)
    assert rank0.killed and rank0.exitcode is None
    assert info.value.outcome(1).ok
    # rank 0 got as far as the hang although its start-up alone outlasted the timeout, and had its whole timeout
    assert hung_at.exists(), rank0.describe()
    assert "_hang_on_rank_zero" in rank0.stack, rank0.stack  # where it was stuck
    assert rank0.elapsed_s > HANG_TIMEOUT_S + 2
    # killed at the timeout counted from when the rank was ready, not at once and not at the default timeout; the
    # upper bound leaves room for the launcher's wait for the stack dump
    hung_for = rank0.ended_at - float(hung_at.read_text())
    assert HANG_TIMEOUT_S / 2 < hung_for < HANG_TIMEOUT_S + 90, hung_for


def test_isolated_and_command_failures_fail_the_test() -> None:
    with pytest.raises(WorkerFailure, match="raised in the isolated process"):
        run_isolated(_fail_in_isolation, "raised in the isolated process", timeout=60)
    code = "import sys; print('about to fail'); sys.exit(5)"
    with pytest.raises(WorkerFailure, match=r"(?s)rank 1: exit code 5.*about to fail"):
        run_commands([[sys.executable, "-c", "pass"], [sys.executable, "-c", code]], [{}, {}], timeout=60)
