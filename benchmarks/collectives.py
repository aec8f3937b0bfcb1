"""The collectives a gradient reduction can use, on two CPU ranks over gloo (why ``ChunkComm.start_reduce_scatter``
exchanges the parts of host tensors instead of reduce-scattering or all-reducing them: [Note: gloo's
reduce-scatter] in ``lightning_pstar/runtime/comm.py``).

    python benchmarks/collectives.py                                  # 112,384 / 1,000,000 / 10,000,000 elements
    python benchmarks/collectives.py --numel 112384 --repeats 50 --json /tmp/collectives.json

For each size (fp32 elements summed over ranks; each rank owns half) every rank times, after 5 warm-up calls,
``--repeats`` calls of each collective started asynchronously and waited for at once (wall time, rank 0's
median): ``reduce_scatter`` with a list of inputs (what the reducer issued first), ``reduce_scatter_single``
of one flat buffer, ``all_reduce`` of the whole flat buffer (what it issued next: twice the bytes, the same
sum), ``exchange (ChunkComm)``: ``ChunkComm.start_reduce_scatter`` itself, as the reducer calls it on host
tensors now (each peer's part sent to it by ``all_to_all_single``, the received part added on ``wait()``), and,
for comparison, the bf16 ``all_gather`` of one rank's half.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import make_repo_importable, run_ranks  # noqa: E402

RUN_TIMEOUT_S = 600.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", default="112384,1000000,10000000", help="comma-separated fp32 element counts")
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per collective (default: 30)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results as JSON")
    return parser.parse_args(argv)


def time_rank(rank: int, world: int, sizes: list[int], repeats: int) -> dict[str, dict[str, float]]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        return {str(numel): _time_size(numel, world, repeats) for numel in sizes}
    finally:
        dist.destroy_process_group()


def _time_size(numel: int, world: int, repeats: int) -> dict[str, float]:
    """Rank-local median milliseconds of each collective on ``numel`` fp32 elements (every rank calls it)."""
    import torch
    import torch.distributed as dist

    from lightning_pstar.runtime.comm import ChunkComm

    comm = ChunkComm(rank=dist.get_rank(), world_size=world, group=dist.group.WORLD)
    reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    part = numel // world
    flat = torch.randn(part * world)
    out = torch.empty(part)
    half = torch.randn(part).bfloat16()
    gathered = [torch.empty_like(half) for _ in range(world)]
    calls = {
        "reduce_scatter(list)": lambda: dist.reduce_scatter(out, list(flat.split(part)), async_op=True),
        "reduce_scatter_single": lambda: reduce_scatter_single(out, flat, async_op=True),
        "all_reduce": lambda: dist.all_reduce(flat, async_op=True),
        "exchange (ChunkComm)": lambda: comm.start_reduce_scatter(flat)[0],
        "all_gather(bf16 half)": lambda: dist.all_gather(gathered, half, async_op=True),
    }
    row: dict[str, float] = {}
    for name, call in calls.items():
        for _ in range(5):
            call().wait()
        dist.barrier()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            call().wait()
            times.append(time.perf_counter() - start)
        row[name] = statistics.median(times) * 1e3
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    make_repo_importable()
    sizes = [int(s) for s in args.numel.split(",") if s]
    ranks = run_ranks(2, time_rank, (2, sizes, args.repeats), threads=1, label="collectives", timeout_s=RUN_TIMEOUT_S)
    table: dict[str, Any] = ranks[0]
    names = list(next(iter(table.values())))
    print(f"{'fp32 elements':>14} " + " ".join(f"{n:>22}" for n in names) + "   (ms, rank 0's median)")
    for numel, row in table.items():
        print(f"{int(numel):>14,} " + " ".join(f"{row[n]:>22.3f}" for n in names))
    if args.json is not None:
        args.json.write_text(json.dumps({"numel": sizes, "repeats": args.repeats, "ms": table}, indent=2))
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
