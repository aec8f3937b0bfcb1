"""One "node" of the two-node test: ``python two_nodes_main.py '<RunSpec as JSON>'``.

The test starts this script twice with ``NODE_RANK=0/1``, ``LOCAL_RANK=0``, ``WORLD_SIZE=2`` and a shared
``MASTER_ADDR``/``MASTER_PORT``, as a cluster scheduler or torchrun on each node would; the spec asks for
``Trainer(num_nodes=2, devices=1, strategy="patrickstar")``, whose popen launcher then starts nothing and joins.
"""

from __future__ import annotations

import sys

from workloads import fit, spec_from_json

if __name__ == "__main__":
    fit(spec_from_json(sys.argv[1]))
