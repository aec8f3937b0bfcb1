"""How often a gloo rank aborts at exit, with and without a process-group teardown ([Note: process groups at exit]
in ``lightning_pstar/runtime/comm.py``; the figures of the CHANGELOG, the note and ``tests/distributed/test_exit.py``).

    python benchmarks/exit_abort.py                          # every pattern, 12 runs each
    python benchmarks/exit_abort.py --patterns engine-off,engine --runs 8 --json /tmp/exit_abort.json

Each run starts two ranks with ``torch.multiprocessing`` (spawn), which exit as a spawned rank does: through
``sys.exit``, exit handlers, then interpreter finalisation. A run counts as an abort when a rank ends by a signal.
The patterns:

- ``plain``: 50 gloo all-reduces, then return (no teardown: what a Fabric run on gloo did);
- ``destroy``: the same, then ``destroy_process_group()``;
- ``held``: ``destroy``, with a Python reference to the group kept past it (as the engine kept one);
- ``engine-off``: a multi-rank ``ChunkComm`` kept alive, 20 rounds of four collectives in flight, the switch
  interval at 100 s (the main thread keeps the GIL, as a busy loop does), its exit handler not registered;
- ``engine``: the same with PatrickStar's exit handler.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import free_port, make_repo_importable  # noqa: E402

PATTERNS = ("plain", "destroy", "held", "engine-off", "engine")
_KEEP: list[Any] = []


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--patterns", default=",".join(PATTERNS), help="comma-separated, of: " + ", ".join(PATTERNS))
    parser.add_argument("--runs", type=int, default=12, help="runs per pattern (default: 12)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the counts as JSON")
    args = parser.parse_args(argv)
    args.patterns = [p.strip() for p in args.patterns.split(",") if p.strip()]
    unknown = sorted(set(args.patterns) - set(PATTERNS))
    if unknown or not args.patterns:
        parser.error(f"--patterns: unknown {unknown or 'none given'}; choose from {', '.join(PATTERNS)}")
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    return args


def rank_main(rank: int, pattern: str, port: int) -> None:
    """One rank of one run (module level: the spawned child imports it)."""
    import torch
    import torch.distributed as dist

    engine = pattern.startswith("engine")
    if engine:
        # imported before the process group, as a Lightning run does (torch.distributed.checkpoint imported after
        # init_process_group keeps references to the group that destroy_process_group leaves behind)
        import lightning_pstar.runtime.comm as comm_module

        sys.setswitchinterval(100.0)
    init = f"tcp://127.0.0.1:{port}"  # a stuck rendezvous or collective raises in 2 minutes, not gloo's 30
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=120))
    if not engine:
        for _ in range(50):
            dist.all_reduce(torch.ones(1000))
        if pattern == "held":
            _KEEP.append(dist.group.WORLD)
        if pattern in ("destroy", "held"):
            dist.destroy_process_group()
        return
    if pattern == "engine-off":
        comm_module._exit_handler_registered = True  # as if registered: the handler stays out
    comm = comm_module.ChunkComm(rank=rank, world_size=2, group=dist.group.WORLD)
    _KEEP.append(comm)
    for _ in range(20):
        works = [comm.start_all_reduce_min(torch.ones(1000)) for _ in range(4)]
        for work in works:
            work.wait()


def one_run(pattern: str) -> str | None:
    """None when both ranks exit cleanly, else what ended a rank."""
    import torch.multiprocessing as mp

    try:
        mp.start_processes(rank_main, args=(pattern, free_port()), nprocs=2, start_method="spawn")
    except mp.ProcessExitedException as err:
        return str(err)
    return None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    make_repo_importable()
    counts: dict[str, dict[str, Any]] = {}
    for pattern in args.patterns:
        failures = [f for f in (one_run(pattern) for _ in range(args.runs)) if f is not None]
        counts[pattern] = {"runs": args.runs, "aborts": len(failures), "how": sorted(set(failures))}
        print(f"{pattern:>10}: {len(failures)} of {args.runs} runs lost a rank at exit", flush=True)
    report = {"args": {"patterns": args.patterns, "runs": args.runs}, "counts": counts}
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
