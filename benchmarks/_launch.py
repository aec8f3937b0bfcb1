"""What every benchmark script needs to start its runs: the repository importable in child processes, a free
port, torchrun's environment for each rank, and fresh ``spawn`` processes per run whose results (or first
failure) come back through one queue.

Also the Trainer options every benchmark run shares (:data:`QUIET_TRAINER`: training only, no logging or
checkpoints), and ``--host-malloc`` (:func:`add_host_malloc_option`). Used by every script in ``benchmarks/``;
not a public module.

[Note: --host-malloc cached]
On a CPU the simulated DEVICE tier is host memory from glibc's malloc. A block PatrickStar frees at the end of a
pass (a released remote chunk, a reduction's buffer) is often handed back to the kernel (the heap's top is
trimmed, large blocks are mmap'ed) and its pages fault in again, zeroed, at the next step's allocation; DDP keeps
its gradient buckets for the whole run and barely pays it. On a GPU none of this happens: CUDA's caching
allocator keeps freed blocks for the process. ``--host-malloc cached`` makes glibc keep freed memory too
(``mallopt``: no trimming, no mmap below 32 MiB) in every rank of every strategy of the run, so CPU step times
compare the strategies' work rather than the kernel's page faults; ``default`` (the default) leaves malloc as
it is. Peak RSS is a high-water mark either way.
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
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def add_host_malloc_option(parser: Any) -> None:
    """``--host-malloc {default,cached}`` ([Note: --host-malloc cached]); call :func:`apply_host_malloc` with the
    parsed value before starting ranks."""
    parser.add_argument(
        "--host-malloc",
        choices=["default", "cached"],
        default="default",
        help="cached: glibc keeps freed host memory in every rank, as CUDA's caching allocator keeps device memory"
        " (default: glibc's own behaviour)",
    )


def apply_host_malloc(mode: str | None = None) -> None:
    """In the parent (``mode`` given): record the choice for the ranks it starts (they inherit the environment).
    In a rank (no ``mode``): with "cached", tell glibc to keep freed memory; raises if it cannot."""
    if mode is not None:
        os.environ[_HOST_MALLOC_ENV] = mode
        return
    if os.environ.get(_HOST_MALLOC_ENV, "default") != "cached":
        return
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None or not (mallopt(_M_TRIM_THRESHOLD, 2**30) and mallopt(_M_MMAP_THRESHOLD, 32 * 2**20)):
        raise SystemExit("--host-malloc cached needs glibc's mallopt, which this C library does not provide")


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
