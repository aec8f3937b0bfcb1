"""One "node" of the two-node Fabric test: ``python fabric_two_nodes_main.py OUT_DIR NUM_NODES DEVICES``.

The test starts this script once per node with ``NODE_RANK``, ``LOCAL_RANK=0``, ``WORLD_SIZE=2`` and a shared
``MASTER_ADDR``/``MASTER_PORT``, as a cluster scheduler would; ``Fabric(num_nodes=2, devices=1,
strategy=PatrickStarFabricStrategy(...))`` then starts nothing and joins. Each rank writes its losses and the
gradient norms ``fabric.clip_gradients`` returned to ``OUT_DIR/rank<R>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from lightning_pstar import PatrickStarFabricStrategy  # noqa: E402
from tests.helpers.fabric_loop import LoopSpec, train  # noqa: E402

COMMON = {"steps": 3, "accumulate": 2, "clip_norm": 0.5, "two_groups": True, "scheduler": True}


def main(out_dir: str, num_nodes: int, devices: int) -> None:
    torch.set_num_threads(1)
    spec = LoopSpec(strategy=PatrickStarFabricStrategy(chunk_size=2048), devices=devices, num_nodes=num_nodes, **COMMON)
    result = train(spec)
    fabric = result.fabric
    assert fabric is not None
    record = {
        "rank": fabric.global_rank,
        "world_size": fabric.world_size,
        "node_rank": fabric.node_rank,
        "losses": result.losses,
        "norms": result.grad_norms,
    }
    Path(out_dir, f"rank{fabric.global_rank}.json").write_text(json.dumps(record))
    # both ranks done, then the process group goes before the interpreter exits: a gloo group torn down by the
    # exit itself can abort one rank ("terminate called without an active exception") after its work is done
    fabric.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
