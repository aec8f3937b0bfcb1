"""Two "nodes" started as separate programs, as a cluster scheduler starts them, train like one 2-rank job.

Each node is a ``subprocess.Popen`` of ``two_nodes_main.py`` with the environment a scheduler provides
(``NODE_RANK``, ``LOCAL_RANK=0``, ``WORLD_SIZE=2``, ``MASTER_ADDR``, ``MASTER_PORT``) and
``Trainer(num_nodes=2, devices=1, strategy="patrickstar")``. Both must exit 0, and every rank's losses must equal
those of a 2-process run of the same model on one node: the job's layout (which process is which rank) is
the same, so the arithmetic is too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from launch import free_port, run_commands, run_ranks
from workloads import RunSpec, fit_in_rank, read_records, spec_as_json

pytestmark = pytest.mark.slow  # every test here trains on spawned ranks: tens of seconds each

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
STEPS = 8


def test_two_nodes_match_one_node_with_two_processes(tmp_path: Path) -> None:
    common = {"out_dir": str(tmp_path), "steps": STEPS, "accumulate": 2, "clip": 0.5, "chunk_size": 4096}
    nodes = RunSpec(tag="nodes", strategy="patrickstar", devices=1, num_nodes=2, **common)
    local = RunSpec(tag="local", strategy="patrickstar", devices=2, num_nodes=1, **common)

    port = str(free_port())
    base = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, str(HERE / "two_nodes_main.py"), spec_as_json(nodes)]
    outcomes = run_commands([command, command], [{**base, "NODE_RANK": "0"}, {**base, "NODE_RANK": "1"}])
    assert [o.exitcode for o in outcomes] == [0, 0]

    run_ranks(fit_in_rank, 2, [local])

    got, want = read_records(nodes), read_records(local)
    for rank, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g["rank"] == rank and g["world_size"] == 2 and g["global_step"] == STEPS
        assert g["memory_report"]["world_size"] == 2 and g["memory_report"]["rank"] == rank
        assert len(g["losses"]) == STEPS * 2
        assert g["losses"] == w["losses"], f"rank {rank}: two nodes {g['losses']} vs one node {w['losses']}"
    assert got[0]["losses"] != got[1]["losses"]
