"""``Fabric(strategy="patrickstar")`` at 2 gloo ranks against plain Fabric's ``ddp``, in the same two processes.

The test's launcher starts both ranks with a torchrun-style environment (Fabric's launcher joins them; any rank's
failure is re-raised here). Each rank trains on its own share of the data (rank r: batches r, r + 2, ...) with
accumulation through ``fabric.no_backward_sync``, clipping by norm, two param groups, an LR scheduler and a no-grad
evaluation forward between steps. Small chunks spread the chunk families over both ranks, so each rank steps the
families it owns and gathers the others. Every loss on every rank within 1e-5 (relative) of ddp's, and the final
weights close to ddp's. Then a sharded checkpoint written by both ranks at step 2, and a consolidated one
gathered to rank 0, resume bit for bit, and
``fabric.all_reduce`` / ``fabric.barrier`` and the memory reports of both ranks work. The same loop started by
``"patrickstar_spawn"`` (Fabric's multiprocessing launcher) gives ddp's losses too.

The same launch also trains the loop of ``fabric_two_nodes_main.py`` once (one node, two processes): the reference
of the two-node test, which reads it from the module's fixture instead of starting the script once more for it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from fabric_two_nodes_main import COMMON as NODE_COMMON
from launch import free_port, run_commands, run_isolated, run_ranks

from lightning_pstar import PatrickStarFabricStrategy
from tests.helpers.asserts import LOSS_RTOL, assert_states_close, assert_states_equal, max_rel_diff
from tests.helpers.fabric_loop import LoopSpec, train

WORLD = 2
CHUNK = 2048
COMMON: dict[str, Any] = {
    "devices": WORLD,
    "steps": 3,
    "accumulate": 2,
    "clip_norm": 0.5,
    "two_groups": True,
    "scheduler": True,
    "eval_between": True,
}


def _pstar(checkpoint: str = "consolidated") -> PatrickStarFabricStrategy:
    return PatrickStarFabricStrategy(chunk_size=CHUNK, checkpoint=checkpoint)


def _rank(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    ref = train(LoopSpec(strategy="ddp", **COMMON))
    got = train(LoopSpec(strategy=_pstar(), **COMMON))
    fabric = got.fabric
    assert fabric is not None and fabric.world_size == WORLD and fabric.global_rank == rank
    total = fabric.all_reduce(torch.tensor(float(rank + 1)), reduce_op="sum")
    fabric.barrier()
    strategy = fabric.strategy
    assert isinstance(strategy, PatrickStarFabricStrategy)
    reports = strategy.memory_report_all()
    # the two-node test's reference: its script's loop, here at one node with two processes
    one_node = train(LoopSpec(strategy=PatrickStarFabricStrategy(chunk_size=CHUNK), devices=WORLD, **NODE_COMMON))
    assert one_node.fabric is not None
    resumes = {}
    for layout in ("sharded", "consolidated"):
        path = Path(out_dir) / layout
        whole = train(LoopSpec(strategy=_pstar(layout), save_at=2, checkpoint=path, **COMMON))
        resumed = train(LoopSpec(strategy=_pstar(layout), resume_from=path, **COMMON))
        resumes[layout] = (whole.losses, resumed.losses, whole.state, resumed.state)
    return {
        "ref": ref.losses,
        "got": got.losses,
        "ref_norms": ref.grad_norms,
        "got_norms": got.grad_norms,
        "ref_eval": ref.eval_losses,
        "got_eval": got.eval_losses,
        "ref_state": ref.state,
        "got_state": got.state,
        "all_reduce": float(total),
        "report_ranks": [r.rank for r in reports],
        "resumes": resumes,
        "one_node": {
            "rank": one_node.fabric.global_rank,
            "world_size": one_node.fabric.world_size,
            "node_rank": one_node.fabric.node_rank,
            "losses": one_node.losses,
            "norms": one_node.grad_norms,
        },
    }


@pytest.fixture(scope="module")
def ranks_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What :func:`_rank` returned on each rank (one launch for both tests of the module)."""
    return run_ranks(_rank, WORLD, str(tmp_path_factory.mktemp("fabric")))


@pytest.mark.slow
def test_fabric_parity_with_ddp_at_two_ranks(ranks_results: list[dict[str, Any]]) -> None:
    results = ranks_results
    for rank, r in enumerate(results):
        diff = max_rel_diff(r["got"], r["ref"])
        print(f"fabric rank {rank}: max relative loss difference against ddp {diff:.3e}")
        assert len(r["got"]) == COMMON["steps"] * COMMON["accumulate"]
        assert diff <= LOSS_RTOL, f"rank {rank}: {r['got']} vs ddp {r['ref']}"
        # what fabric.clip_gradients returned at every step (global over the ranks), against DDP's
        assert len(r["got_norms"]) == len(r["ref_norms"]) == COMMON["steps"]
        assert r["got_norms"] == pytest.approx(r["ref_norms"], rel=1e-5)
        assert any(n > COMMON["clip_norm"] for n in r["ref_norms"])
        assert r["got_eval"] == pytest.approx(r["ref_eval"], rel=LOSS_RTOL)
        assert_states_close(r["got_state"], r["ref_state"], what=f"fabric rank {rank}")
        assert r["all_reduce"] == 3.0
        assert r["report_ranks"] == [0, 1]
        for layout, (whole, resumed, whole_state, resumed_state) in r["resumes"].items():
            assert resumed == whole[2 * COMMON["accumulate"] :], f"{layout} resume, rank {rank}"
            assert_states_equal(resumed_state, whole_state, what=f"fabric {layout} resume, rank {rank}")
    assert results[0]["got"] != results[1]["got"]  # the ranks saw different data
    # Fabric's other launcher: "patrickstar_spawn" starts the ranks itself (torch.multiprocessing)
    spawned = run_isolated(_spawned)
    diff = max_rel_diff(spawned, results[0]["ref"])
    print(f"fabric patrickstar_spawn rank 0: max relative loss difference against ddp {diff:.3e}")
    assert diff <= LOSS_RTOL, f"patrickstar_spawn {spawned} vs ddp {results[0]['ref']}"


def _spawned() -> list[float]:
    """For ``run_isolated``: the same loop on 2 ranks started by ``patrickstar_spawn`` (rank 0's losses)."""
    torch.set_num_threads(1)
    return train(LoopSpec(strategy="patrickstar_spawn", local_result=False, **COMMON)).losses


@pytest.mark.slow
def test_fabric_two_nodes_match_one_node_with_two_processes(
    ranks_results: list[dict[str, Any]], tmp_path: Path
) -> None:
    """Two "nodes" started as separate programs with a scheduler's environment (``NODE_RANK``, ``LOCAL_RANK=0``,
    ``WORLD_SIZE=2``), ``Fabric(num_nodes=2, devices=1)``: every rank's losses and returned gradient norms equal
    those of a one-node, two-process run of the same loop (the same rank layout, so the same arithmetic): the
    module's launch of two ranks trains that loop too (the script's ``COMMON``, the same strategy)."""
    script = str(Path(__file__).resolve().parent / "fabric_two_nodes_main.py")
    nodes = tmp_path / "nodes"
    nodes.mkdir()
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    command = [sys.executable, script, str(nodes), "2", "1"]
    outcomes = run_commands([command, command], [{**base, "NODE_RANK": "0"}, {**base, "NODE_RANK": "1"}])
    assert [o.exitcode for o in outcomes] == [0, 0]
    for rank in range(WORLD):
        got = json.loads((nodes / f"rank{rank}.json").read_text())
        want = ranks_results[rank]["one_node"]
        assert (want["rank"], want["world_size"]) == (rank, WORLD)
        assert (got["rank"], got["world_size"], got["node_rank"]) == (rank, WORLD, rank)
        assert want["node_rank"] == 0
        assert len(got["losses"]) == 3 * 2
        assert got["losses"] == want["losses"], f"rank {rank}: two nodes {got['losses']} vs one node"
        assert got["norms"] == want["norms"]
    first = json.loads((nodes / "rank0.json").read_text())["losses"]
    assert first != json.loads((nodes / "rank1.json").read_text())["losses"]  # the ranks saw different data
