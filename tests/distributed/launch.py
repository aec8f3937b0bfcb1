"""Start ranks for the distributed tests, never hang, and re-raise every rank's failure in the test.

A multi-process test is only worth something if a crashed or stuck rank fails it. Every
distributed test starts its processes through this module:

- :func:`run_ranks` runs ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes (see the note on the
  fork server) with the environment of one node of a torch.distributed job (``MASTER_ADDR``, ``MASTER_PORT``,
  ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``NODE_RANK``), so a Trainer with ``devices=world_size`` joins them
  as torchrun's processes, and returns the ranks' return values in rank order.
- :func:`run_isolated` runs ``fn(*args)`` in one fresh process without that environment, for code that
  launches its own ranks (``Trainer(strategy="patrickstar_spawn")``).
- :func:`run_commands` runs command lines (one per rank or node) with ``subprocess.Popen``.

In all three, a rank that raises, exits with a non-zero code or dies from a signal makes the call raise
:class:`WorkerFailure` whose message holds every rank's outcome and traceback (or output tail). After the first
failure the other ranks get ``grace`` seconds to end by themselves (so a test can tell a rank that noticed the
failure from one that hung), then they are killed. A run that outlasts ``timeout`` is killed and raises
:class:`WorkerTimeout` with each rank's Python stack at the moment (from ``faulthandler``).

[Note: the timeout starts when the rank is ready] A worker first starts an interpreter (or is forked from the fork
server, see its note) and imports the test module and its arguments' modules (torch, Lightning where they are not
preloaded): seconds on an idle machine, far more on a loaded one.
So in :func:`run_ranks` and :func:`run_isolated` a rank's ``timeout`` counts from the moment it starts running
``fn`` (it writes that moment to a file, the readiness signal), not from the launch; a rank that is not ready
``STARTUP_TIMEOUT_S`` after the launch counts as hung in its imports. At the timeout the launcher waits for the
rank's stack dump to be written (faulthandler writes it shortly before the timeout) before it kills the rank, so
the stack always shows where the rank was. Commands (:func:`run_commands`) time out from their launch. Each
process starts
its own session, so killing it also kills the processes it started (Lightning's spawned ranks). Workers use one
intra-op thread (``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)``): two ranks share two cores.

[Note: a fork server that has imported torch and Lightning] A worker is a ``spawn``-style child: it unpickles
``fn`` and its arguments, gets the test process's ``sys.path`` and imports the test module, and shares no state
with the test process. Importing torch and Lightning alone takes about 5 s of CPU per process, which was most of
a launch on 2 cores and, over the 20-odd launches of the full suite, more than a minute. So where CUDA is not
available the workers come from a ``forkserver`` that imported torch and Lightning once per test session
(``set_forkserver_preload``; importing them starts no thread and touches no device): each worker is forked from
it with those modules loaded and nothing run, then prepared as a spawn child. The package under test is not
preloaded: the fork server's own ``sys.path`` is not the test process's (Python 3.11 ignores the one it is
given), so it could import another installed copy; the workers import it after their preparation. Where CUDA is
available the workers are spawned, as before: a process forked after a parent touched CUDA cannot use it, and
nothing checks that the imports never do. ``PSTAR_TEST_START_METHOD=spawn`` (or ``forkserver``) forces one.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "RankOutcome",
    "WorkerFailure",
    "WorkerTimeout",
    "free_port",
    "run_commands",
    "run_isolated",
    "run_ranks",
]

DEFAULT_TIMEOUT_S = 300.0  # only reached when something hangs; generous for a busy machine
DEFAULT_GRACE_S = 15.0
STARTUP_TIMEOUT_S = 300.0  # from the launch until a spawned rank runs fn (see the note above): imports only
_STACK_WAIT_S = 60.0  # at most this long past the timeout for a ready rank's stack dump before the kill
_DUMP_LEAD_S = 2.0  # faulthandler dumps the stacks this long before the timeout
_POLL_S = 0.05
_PRELOAD = ("torch", "torch.distributed", "lightning", "lightning.pytorch", "lightning.fabric")
"""What the fork server imports once (see the note on the fork server); never the package under test."""
_TAIL_CHARS = 6000


@dataclass(kw_only=True)
class RankOutcome:
    """How one process ended."""

    rank: int
    exitcode: int | None  # None: still running when it was killed; negative: killed by that signal
    elapsed_s: float  # from the start of the run to its exit (or to the kill)
    ended_at: float  # time.monotonic() of its exit (or kill): comparable with other processes' on this machine
    killed: bool = False  # killed by the launcher (after the timeout or the grace period)
    error: str = ""  # the worker's traceback, or the tail of its output (commands)
    stack: str = ""  # Python stacks dumped by faulthandler before a timeout kill
    output: str = ""  # stdout + stderr (commands only)
    result: Any = None  # fn's return value (run_ranks / run_isolated, exit code 0 only)

    @property
    def ok(self) -> bool:
        return self.exitcode == 0 and not self.killed

    def describe(self) -> str:
        if self.killed:
            how = f"killed by the launcher after {self.elapsed_s:.1f} s (it had not exited)"
        elif self.exitcode is not None and self.exitcode < 0:
            how = f"died from signal {signal.Signals(-self.exitcode).name} after {self.elapsed_s:.1f} s"
        else:
            how = f"exit code {self.exitcode} after {self.elapsed_s:.1f} s"
        text = f"--- rank {self.rank}: {how}"
        if self.error:
            text += f"\n{self.error.rstrip()}"
        if self.stack:
            text += f"\n[stack when killed]\n{self.stack.rstrip()}"
        return text


class WorkerFailure(RuntimeError):
    """At least one rank failed; ``outcomes`` says how every rank ended."""

    def __init__(self, summary: str, outcomes: Sequence[RankOutcome]) -> None:
        self.outcomes = list(outcomes)
        details = "\n".join(o.describe() for o in self.outcomes)
        super().__init__(f"{summary}\n{details}")

    def outcome(self, rank: int) -> RankOutcome:
        return next(o for o in self.outcomes if o.rank == rank)


class WorkerTimeout(WorkerFailure):
    """The run outlasted its timeout; every rank still running was killed."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---- the code that runs inside a worker process ----------------------------------------------------------


def _limit_threads() -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch = sys.modules.get("torch")  # unpickling the arguments may already have imported it
    if torch is not None:
        torch.set_num_threads(1)


def _bootstrap(
    fn: Callable[..., Any],
    call_args: tuple[Any, ...],
    env: Mapping[str, str],
    files: Mapping[str, str],
    dump_after_s: float,
) -> None:
    os.setsid()  # its own process group: the launcher kills it together with whatever it starts
    os.environ.update(env)
    _limit_threads()
    with open(files["stack"], "w") as stack_file:
        # if the launcher is about to kill this process for the timeout, the test shows where it was stuck
        faulthandler.dump_traceback_later(dump_after_s, exit=False, file=stack_file)
        ready = Path(files["ready"])
        ready.with_suffix(".tmp").write_text(repr(time.monotonic()))
        ready.with_suffix(".tmp").replace(ready)  # the readiness signal: the timeout counts from here
        try:
            result = fn(*call_args)
        except BaseException:
            Path(files["error"]).write_text(traceback.format_exc())
            sys.stderr.flush()
            os._exit(1)  # no atexit handlers: a process-group teardown must not wait for a dead peer
        Path(files["result"]).write_bytes(pickle.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---- supervision -----------------------------------------------------------------------------------------


class _Proc(Protocol):
    """What the supervisor needs of a process (multiprocessing.Process or subprocess.Popen)."""

    rank: int
    pid: int

    def exitcode(self) -> int | None: ...

    def sentinel(self) -> Any: ...

    def ready_at(self) -> float | None:
        """``time.monotonic()`` from which the timeout counts; None while the process is not ready."""
        ...

    def stack_written(self) -> bool:
        """Whether the stack dump to show for a timeout is there (or none is expected)."""
        ...


@dataclass
class _SpawnProc:
    rank: int
    process: multiprocessing.Process
    files: dict[str, str] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def exitcode(self) -> int | None:
        return self.process.exitcode

    def sentinel(self) -> Any:
        return self.process.sentinel

    def ready_at(self) -> float | None:
        try:
            return float(Path(self.files["ready"]).read_text())
        except (OSError, ValueError):
            return None

    def stack_written(self) -> bool:
        path = Path(self.files["stack"])
        return self.ready_at() is None or (path.exists() and path.stat().st_size > 0)


@dataclass
class _PopenProc:
    rank: int
    process: subprocess.Popen[bytes]
    log: str
    launched_at: float

    @property
    def pid(self) -> int:
        return self.process.pid

    def exitcode(self) -> int | None:
        return self.process.poll()

    def sentinel(self) -> Any:
        return None

    def ready_at(self) -> float | None:
        return self.launched_at  # a command's timeout counts from its launch

    def stack_written(self) -> bool:
        return True  # PYTHONFAULTHANDLER dumps on fatal signals only: no stack is waited for


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _timeout_at(running: Sequence[_Proc], *, start: float, timeout: float) -> float:
    """When the run times out: ``timeout`` after the last running process became ready, or
    ``STARTUP_TIMEOUT_S`` after the launch while one is not ready yet (see the note on readiness)."""
    ready = [p.ready_at() for p in running]
    if not ready:
        return start + timeout
    if any(r is None for r in ready):
        return start + STARTUP_TIMEOUT_S
    return max(r for r in ready if r is not None) + timeout


def _supervise(procs: Sequence[_Proc], *, timeout: float, grace: float, start: float) -> tuple[list[RankOutcome], bool]:
    """Wait for every process; kill the rest ``grace`` s after the first failure or at ``timeout``.

    Returns the outcomes in rank order and whether the timeout (not the grace period) ended the wait.
    """
    ended: dict[int, tuple[int | None, float]] = {}  # rank -> (exit code or None if killed, time.monotonic())
    first_failure: float | None = None
    timed_out = False
    clean_exit = False
    try:
        while len(ended) < len(procs):
            now = time.monotonic()
            for proc in procs:
                code = proc.exitcode()
                if proc.rank not in ended and code is not None:
                    ended[proc.rank] = (code, now)
                    if code != 0 and first_failure is None:
                        first_failure = now
            if len(ended) == len(procs):
                break
            running = [p for p in procs if p.rank not in ended]
            deadline = _timeout_at(running, start=start, timeout=timeout)
            stop_at = deadline if first_failure is None else min(deadline, first_failure + grace)
            # at the timeout, the stack dumps are the signal to wait for (bounded: a dump may never come)
            dumps_due = now >= deadline and now < deadline + _STACK_WAIT_S
            if now >= stop_at and not (dumps_due and not all(p.stack_written() for p in running)):
                timed_out = now >= deadline
                for proc in running:
                    _kill_group(proc.pid)
                    ended[proc.rank] = (None, now)
                break
            sentinels = [s for p in running if (s := p.sentinel()) is not None]
            if len(sentinels) == len(running):
                wait(sentinels, timeout=min(0.5, max(_POLL_S, stop_at - now)))
            else:
                time.sleep(_POLL_S)
        clean_exit = all(code == 0 for code, _ in ended.values())
    finally:
        if not clean_exit:
            # processes that outlived a failed rank (e.g. the ranks Lightning spawned from it) are ended too
            for proc in procs:
                _kill_group(proc.pid)
    outcomes = [
        RankOutcome(
            rank=p.rank,
            exitcode=ended[p.rank][0],
            elapsed_s=ended[p.rank][1] - start,
            ended_at=ended[p.rank][1],
            killed=ended[p.rank][0] is None,
        )
        for p in procs
    ]
    return outcomes, timed_out


def _raise_if_failed(outcomes: list[RankOutcome], *, timed_out: bool, timeout: float, what: str) -> None:
    failed = [o.rank for o in outcomes if not o.ok]
    if not failed:
        return
    if timed_out:
        raise WorkerTimeout(f"{what}: ranks {failed} still running after the timeout of {timeout:.0f} s", outcomes)
    raise WorkerFailure(f"{what}: ranks {failed} of {len(outcomes)} failed", outcomes)


def _context() -> Any:
    """The multiprocessing context the workers start from: [Note: a fork server that has imported torch and
    Lightning]."""
    method = os.environ.get("PSTAR_TEST_START_METHOD")
    if method is None:
        import torch  # the test process has imported it already (tests/conftest.py)

        method = "spawn" if torch.cuda.is_available() else "forkserver"
    if method not in ("spawn", "forkserver"):
        raise ValueError(f"PSTAR_TEST_START_METHOD={method!r}: expected 'spawn' or 'forkserver'")
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(_PRELOAD))  # takes effect when the server starts: the first launch
    return ctx


def _spawn(
    fn: Callable[..., Any],
    per_rank: Sequence[tuple[tuple[Any, ...], dict[str, str]]],
    *,
    timeout: float,
    grace: float,
    what: str,
) -> list[RankOutcome]:
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="pstar-ranks-") as tmp:
        procs: list[_SpawnProc] = []
        start = time.monotonic()
        try:
            for rank, (call_args, env) in enumerate(per_rank):
                kinds = ("error", "result", "stack", "ready")
                files = {kind: os.path.join(tmp, f"rank{rank}.{kind}") for kind in kinds}
                dump_after = max(1.0, timeout - _DUMP_LEAD_S)
                process = ctx.Process(
                    target=_bootstrap,
                    args=(fn, call_args, env, files, dump_after),
                    name=f"rank{rank}",
                    daemon=False,  # a daemon process may not start processes of its own (Lightning's ranks)
                )
                process.start()
                procs.append(_SpawnProc(rank=rank, process=process, files=files))
            outcomes, timed_out = _supervise(procs, timeout=timeout, grace=grace, start=start)
        finally:
            for proc in procs:
                if proc.process.is_alive():  # only if supervising was interrupted (e.g. KeyboardInterrupt)
                    _kill_group(proc.pid)
                proc.process.join(timeout=10)
        for proc, outcome in zip(procs, outcomes, strict=True):
            error, result, stack = (Path(proc.files[k]) for k in ("error", "result", "stack"))
            if error.exists():
                outcome.error = error.read_text()
            if outcome.killed and stack.exists():
                outcome.stack = stack.read_text()[-_TAIL_CHARS:]
            if outcome.killed and proc.ready_at() is None:
                outcome.stack = "(killed before it started running fn: still starting up or importing)"
            if outcome.exitcode == 0 and result.exists():
                outcome.result = pickle.loads(result.read_bytes())
    _raise_if_failed(outcomes, timed_out=timed_out, timeout=timeout, what=what)
    return outcomes


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    grace: float = DEFAULT_GRACE_S,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local ranks; their return values in rank order.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function of an importable module). Raises
    :class:`WorkerFailure` if any rank fails and :class:`WorkerTimeout` after ``timeout`` seconds.
    """
    port = str(free_port())
    per_rank = []
    for rank in range(world_size):
        rank_env = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "WORLD_SIZE": str(world_size),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "NODE_RANK": "0",
            **(env or {}),
        }
        per_rank.append(((rank, world_size, *args), rank_env))
    outcomes = _spawn(fn, per_rank, timeout=timeout, grace=grace, what=f"run_ranks({fn.__qualname__})")
    return [o.result for o in outcomes]


def run_isolated(
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
) -> Any:
    """Run ``fn(*args)`` in one fresh process (no distributed environment) and return its value.

    For code that starts its own ranks (a spawn-based Trainer): those are killed with it on a timeout, and a
    failure of any of them reaches the test through the exception Lightning raises in ``fn``'s process.
    """
    what = f"run_isolated({fn.__qualname__})"
    outcomes = _spawn(fn, [(args, dict(env or {}))], timeout=timeout, grace=0.0, what=what)
    return outcomes[0].result


def run_commands(
    commands: Sequence[Sequence[str]],
    envs: Sequence[Mapping[str, str]],
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    grace: float = DEFAULT_GRACE_S,
    cwd: str | os.PathLike[str] | None = None,
) -> list[RankOutcome]:
    """Run one command line per rank (``envs[i]`` added to this process's environment); their outcomes.

    Raises :class:`WorkerFailure` (with each rank's output tail) when any command exits with a non-zero code.
    """
    if len(commands) != len(envs):
        raise ValueError(f"{len(commands)} commands but {len(envs)} environments")
    with tempfile.TemporaryDirectory(prefix="pstar-commands-") as tmp:
        procs: list[_PopenProc] = []
        logs = []
        start = time.monotonic()
        try:
            for rank, (cmd, extra) in enumerate(zip(commands, envs, strict=True)):
                log_path = os.path.join(tmp, f"rank{rank}.log")
                log = open(log_path, "wb")  # closed in the finally below
                logs.append(log)
                full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **extra}
                process = subprocess.Popen(
                    list(cmd), env=full_env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
                procs.append(_PopenProc(rank=rank, process=process, log=log_path, launched_at=start))
            outcomes, timed_out = _supervise(procs, timeout=timeout, grace=grace, start=start)
        finally:
            for proc in procs:
                if proc.process.poll() is None:  # only if supervising was interrupted (e.g. KeyboardInterrupt)
                    _kill_group(proc.pid)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.process.wait(timeout=10)
            for log in logs:
                log.close()
        for proc, outcome in zip(procs, outcomes, strict=True):
            outcome.output = Path(proc.log).read_text(errors="replace")
            if not outcome.ok:
                outcome.error = outcome.output[-_TAIL_CHARS:]
    _raise_if_failed(outcomes, timed_out=timed_out, timeout=timeout, what=f"run_commands({len(commands)} commands)")
    return outcomes
