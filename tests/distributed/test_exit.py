"""Ranks on gloo exit cleanly ([Note: process groups at exit] in ``lightning_pstar/runtime/comm.py``).

A gloo worker thread drops the tensors of its last collective after the work is marked done, and that drop takes
the GIL; when it comes while the interpreter finalises, the thread is killed mid-unwind and the process aborts
(SIGABRT, "terminate called without an active exception"), which a launcher reports as a failed rank. The exit
handler every multi-rank ChunkComm registers drops the engine's group references and destroys the process
groups while the interpreter is whole. The first test checks that handler directly. The second is the hazard
itself, so it is a race: with the handler switched off, its pattern (``benchmarks/exit_abort.py``'s ``engine``)
aborts a rank in some runs, not all (``python benchmarks/exit_abort.py --patterns engine-off,engine`` counts
them), so its two rounds catch a regression often, not always. With the handler it cannot abort: the groups'
destructor releases the GIL and joins the worker threads before the interpreter finalises.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import lightning_pstar.runtime.comm as comm_module
from lightning_pstar.runtime.comm import ChunkComm
from tests.distributed.launch import run_ranks

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _handler(rank: int, world: int) -> dict[str, Any]:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    registered_before = comm_module._exit_handler_registered
    comm = ChunkComm(rank=rank, world_size=world, group=dist.group.WORLD, cpu_group=dist.new_group(backend="gloo"))
    single = ChunkComm(rank=0, world_size=1)  # one rank: no collectives, nothing to release
    total = comm.all_reduce_sum_(torch.ones(3))
    comm_module._release_groups_at_exit()  # what atexit runs
    return {
        "registered_before": registered_before,
        "registered": comm_module._exit_handler_registered,
        "live": comm in comm_module._live_comms,
        "single_live": single in comm_module._live_comms,
        "sum": total.tolist(),
        "groups": (comm.group, comm.cpu_group),
        "initialized": dist.is_initialized(),
    }


@pytest.mark.slow  # spawned gloo ranks
def test_exit_handler_drops_the_group_references_and_destroys_the_groups() -> None:
    for rank, r in enumerate(run_ranks(_handler, 2)):
        assert not r["registered_before"] and r["registered"], f"rank {rank}"
        assert r["live"] and not r["single_live"]
        assert r["sum"] == [2.0, 2.0, 2.0]
        assert r["groups"] == (None, None)
        assert not r["initialized"]


@contextmanager
def _exit_abort() -> Iterator[Any]:
    """``benchmarks/exit_abort.py`` as a module; its directory stays importable while the spawned ranks start."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import exit_abort

        yield exit_abort
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.slow  # two runs of spawned gloo ranks
def test_spawned_gloo_ranks_exit_without_an_abort() -> None:
    # the benchmark's "engine" pattern: a kept ChunkComm, four collectives in flight at a time, the switch
    # interval at 100 s; a run returns what ended a rank ("terminated with signal SIGABRT"), None if nothing did
    with _exit_abort() as exit_abort:
        assert [exit_abort.one_run("engine") for _ in range(2)] == [None, None]


def test_exit_abort_benchmark_refuses_an_unknown_pattern(capsys: pytest.CaptureFixture[str]) -> None:
    with _exit_abort() as exit_abort, pytest.raises(SystemExit):
        exit_abort.parse_args(["--patterns", "engine,nope"])
    assert "unknown ['nope']" in capsys.readouterr().err


def test_a_failing_destroy_at_exit_is_logged_not_raised(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> None:
        raise RuntimeError("store gone")

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", broken)
    with caplog.at_level("WARNING", logger="lightning_pstar.runtime.comm"):
        comm_module._release_groups_at_exit()
    assert "destroying the process groups at exit failed: RuntimeError: store gone" in caplog.text
