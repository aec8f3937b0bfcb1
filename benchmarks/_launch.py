"""What every benchmark script needs to start its runs: the repository importable in child processes, a free
port, torchrun's environment for each rank, and fresh ``spawn`` processes per run whose results (or first
failure) come back through one queue.

Also the Trainer options every benchmark run shares (:data:`QUIET_TRAINER`: training only, no logging or
checkpoints), and ``--host-malloc`` (:func:`add_host_malloc_option`). Used by every script in ``benchmarks/``;
not a public module.

[Note: --host-malloc cached]
On a CPU the simulated DEVICE tier, the activations and every transient buffer are host memory from glibc's
malloc, which hands freed blocks back to the kernel (trimming the heap's top, unmapping large blocks); their pages
fault in again, zeroed, at the next step. On a GPU CUDA's caching allocator keeps freed blocks for the process, and
on a CPU run PatrickStar tells glibc the same by default (``memory.host_malloc="cached"``, [Note: host malloc] in
``lightning_pstar/host_malloc.py``). ``--host-malloc`` picks what every rank of a run does:

- ``default``: every strategy as it ships (PatrickStar keeps freed memory, ``auto``, ``ddp`` and FSDP2 leave glibc
  as it is), which is what a user of each gets;
- ``cached``: every rank of every strategy keeps freed memory, so CPU step times compare the strategies' work
  rather than page faults;
- ``system``: none does (PatrickStar runs with ``host_malloc="system"``), PatrickStar's figures before it kept
  freed memory.

Peak RSS is a high-water mark either way.
"""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_module
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "QUIET_TRAINER",
    "add_host_malloc_option",
    "apply_host_malloc",
    "free_port",
    "importable_env",
    "make_repo_importable",
    "pstar_host_malloc",
    "rank_env",
    "repo_root",
    "run_ranks",
]


QUIET_TRAINER: dict[str, Any] = {
    "limit_val_batches": 0,
    "num_sanity_val_steps": 0,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}
"""Trainer options of every benchmark run: training steps only, nothing logged, saved or printed."""


_HOST_MALLOC_ENV = "PSTAR_BENCH_HOST_MALLOC"


def add_host_malloc_option(parser: Any) -> None:
    """``--host-malloc {default,cached,system}`` ([Note: --host-malloc cached]); call :func:`apply_host_malloc`
    with the parsed value before starting ranks."""
    parser.add_argument(
        "--host-malloc",
        choices=["default", "cached", "system"],
        default="default",
        help="default: each strategy as it ships (PatrickStar keeps freed host memory on a CPU); cached: every"
        " rank keeps it, as CUDA's caching allocator keeps device memory; system: no rank does",
    )


def apply_host_malloc(mode: str | None = None) -> None:
    """In the parent (``mode`` given): record the choice for the ranks it starts (they inherit the environment).
    In a rank (no ``mode``): with "cached", tell glibc to keep freed memory; raises if it cannot."""
    if mode is not None:
        os.environ[_HOST_MALLOC_ENV] = mode
        return
    if os.environ.get(_HOST_MALLOC_ENV, "default") != "cached":
        return
    from lightning_pstar.host_malloc import keep_freed_host_memory

    if not keep_freed_host_memory():
        raise SystemExit("--host-malloc cached needs glibc's mallopt, which this C library does not provide")


def pstar_host_malloc() -> dict[str, str]:
    """``PatrickStarStrategy`` keywords for the run's ``--host-malloc``: ``host_malloc="system"`` under "system",
    nothing otherwise (its default keeps freed memory on a CPU, and "cached" already set it)."""
    return {"host_malloc": "system"} if os.environ.get(_HOST_MALLOC_ENV) == "system" else {}


def repo_root() -> str:
    """The repository's root (the folder above ``benchmarks/``)."""
    return str(Path(__file__).resolve().parent.parent)


def importable_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the repository first on ``PYTHONPATH``: a child imports this checkout's package, installed
    or not."""
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_root(), env.get("PYTHONPATH")]))
    return env


def make_repo_importable() -> None:
    """This process and every child it starts import the repository's package (a plain checkout works)."""
    root = repo_root()
    if root not in sys.path:
        sys.path.insert(0, root)
    os.environ["PYTHONPATH"] = importable_env(dict(os.environ))["PYTHONPATH"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_env(rank: int, world: int, port: int | str, threads: int) -> dict[str, str]:
    """torchrun's variables for one rank of ``world`` on this machine (none at one rank), and the thread count
    (Lightning's DDP-based strategies reset torch's thread count at setup unless ``OMP_NUM_THREADS`` is set)."""
    env = {"OMP_NUM_THREADS": str(threads)}
    if world > 1:
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE=str(world),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            NODE_RANK="0",
        )
    return env


def _rank_main(
    rank: int, env: dict[str, str], target: Callable[..., Any], target_args: tuple[Any, ...], q: Any
) -> None:
    os.environ.update(env)
    try:
        apply_host_malloc()
        q.put(("ok", rank, target(rank, *target_args)))
    except BaseException:
        q.put(("error", rank, traceback.format_exc()))
        raise


def run_ranks(
    world: int,
    target: Callable[..., Any],
    target_args: tuple[Any, ...],
    *,
    threads: int,
    label: str,
    timeout_s: float,
) -> list[Any]:
    """``target(rank, *target_args)`` on ``world`` fresh spawn processes (a process group of their own);
    every rank's result, in rank order. Raises SystemExit naming ``label`` when a rank fails (with its
    traceback), dies, or the run passes ``timeout_s``."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = []
    for rank in range(world):
        env = rank_env(rank, world, port, threads)
        proc = ctx.Process(target=_rank_main, args=(rank, env, target, target_args, q), daemon=False)
        proc.start()
        procs.append(proc)
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world:
            if time.monotonic() > deadline:
                raise SystemExit(f"the {label} run did not finish within {timeout_s:.0f} s")
            try:
                status, rank, payload = q.get(timeout=1.0)
            except queue_module.Empty:  # check that every rank still lives
                dead = {i: p.exitcode for i, p in enumerate(procs) if p.exitcode not in (None, 0)}
                if dead:
                    raise SystemExit(f"the {label} run failed: exit codes by rank {dead}") from None
                continue
            if status != "ok":
                raise SystemExit(f"the {label} run failed:\n--- rank {rank}:\n{payload}")
            results[rank] = payload
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [results[r] for r in range(world)]
