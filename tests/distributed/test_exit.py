"""Ranks on gloo exit cleanly ([Note: process groups at exit] in ``lightning_pstar/runtime/comm.py``).

A gloo worker thread drops the tensors of its last collective after the work is marked done, and that drop takes
the GIL; when it comes while the interpreter finalises, the thread is killed mid-unwind and the process aborts
(SIGABRT, "terminate called without an active exception"), which a launcher reports as a failed rank. The exit
handler every multi-rank ChunkComm registers drops the engine's group references and destroys the process
groups while the interpreter is whole. The first test checks that handler directly. The second is the hazard
itself, so it is a race: with the handler switched off, the spawned pattern below (four collectives in flight
at a time, ``sys.setswitchinterval`` keeping the main thread on the GIL as a busy training loop does) aborted a
rank in anything from 1 of 6 to 7 of 8 runs from batch to batch, so its two rounds catch a regression often,
not always. With the handler it cannot abort: the groups' destructor releases the GIL and joins the worker
threads before the interpreter finalises.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import lightning_pstar.runtime.comm as comm_module
from lightning_pstar.runtime.comm import ChunkComm
from tests.distributed.launch import free_port, run_ranks

_KEEP: list[ChunkComm] = []  # what an engine does: the comm outlives the training loop


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


def test_exit_handler_drops_the_group_references_and_destroys_the_groups() -> None:
    for rank, r in enumerate(run_ranks(_handler, 2)):
        assert not r["registered_before"] and r["registered"], f"rank {rank}"
        assert r["live"] and not r["single_live"]
        assert r["sum"] == [2.0, 2.0, 2.0]
        assert r["groups"] == (None, None)
        assert not r["initialized"]


def _spawned(rank: int, port: int) -> None:
    sys.setswitchinterval(100.0)  # the main thread keeps the GIL until it blocks
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    comm = ChunkComm(rank=rank, world_size=2, group=dist.group.WORLD)
    _KEEP.append(comm)
    for _ in range(20):
        works = [comm.start_all_reduce_min(torch.ones(1000)) for _ in range(4)]
        for work in works:
            work.wait()
    # returns: torch.multiprocessing's child exits through sys.exit, exit handlers, then finalisation


def test_spawned_gloo_ranks_exit_without_an_abort() -> None:
    for _ in range(2):
        # raises ProcessExitedException ("terminated with signal SIGABRT") when a rank aborts at exit
        mp.start_processes(_spawned, args=(free_port(),), nprocs=2, start_method="spawn")


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
