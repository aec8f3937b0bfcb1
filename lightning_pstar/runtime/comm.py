"""Ownership math and the collectives of ZeRO data parallelism with chunks.

Chunk *i* belongs to communication group ``i // world_size`` and is owned by rank ``i % world_size``.
Every collective goes through :class:`ChunkComm` with an explicit process group (NCCL on GPUs, gloo on
CPUs); nothing here talks to the default group implicitly. With one rank every operation is the identity
and no process group is needed.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from lightning_pstar.planning.layout import group_of, owner_of

__all__ = ["ChunkComm", "group_of", "owner_of", "profiled", "staging_device"]

_profiling = torch._C._autograd._profiler_enabled
log = logging.getLogger(__name__)


def profiled(name: str) -> AbstractContextManager[Any]:
    """A ``pstar::`` profiler range while a profiler records, else nothing: a range costs two dispatcher calls
    even without one, and these run for every chunk group of every step."""
    return torch.profiler.record_function(name) if _profiling() else nullcontext()


def staging_device(device: torch.device | None, backend: str) -> torch.device | None:
    """Where a collective's tensors must be for the run's group: the run's CUDA ``device`` over NCCL (which takes
    only CUDA tensors), else None (gloo takes host tensors, and CUDA ones for the collectives used here).

    [Note: one group per run]
    Every tensor collective of a run goes through the run's one process group (``ChunkComm.group``: NCCL on
    GPUs, gloo on CPUs), chosen from the run's configuration, never from the tensor's device: the same chunk can
    sit on the host on one rank and on the device on another (a hybrid optimizer plan, an eviction), and ranks
    that picked different groups for the same collective would wait for each other forever. A tensor that is not
    where the group needs it (a host tensor over NCCL) is copied there and back for a blocking collective; an
    asynchronous one (gathers, reduce-scatters) refuses it. The gloo group beside NCCL (``cpu_group``) carries
    pickled objects only."""
    if device is not None and device.type == "cuda" and backend == "nccl":
        return device
    return None


# newer torch (2.13 here) calls reduce_scatter_tensor reduce_scatter_single and deprecates the old name
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _backend(group: Any | None) -> str:
    """The backend of ``group`` (None: the default group), by name: "gloo", "nccl", ..."""
    return str(dist.get_backend(group)).lower()


class _SumOnWait:
    """The handle of a reduce-scatter done as an exchange of parts (gloo): ``wait()`` waits for the exchange, then
    adds the parts received from the peers into this rank's own part, once, in rank order.

    [Note: gloo's reduce-scatter]
    gloo's own reduce-scatter is slower than its all-reduce of twice the bytes, and the all-reduce (what the
    reduction used before) sends every rank twice the bytes of the buffer's other parts. The exchange sends each
    part once, to its owner, and the owner sums: on two CPU ranks about twice as fast as the all-reduce (1M and
    10M fp32 elements: 1.4-1.7 against 3.4-3.9 ms, 14-16 against 25-28 ms; ``python benchmarks/collectives.py``),
    for one part of extra room (every part at more ranks). With two ranks the sum is own + peer's, bitwise the
    all-reduce's (fp32 addition commutes); with more it is own + the others in rank order, a fixed order where
    gloo's ring fixes none."""

    def __init__(self, work: Any, mine: torch.Tensor, received: list[torch.Tensor]) -> None:
        self.work = work
        self.mine = mine
        self.received: list[torch.Tensor] | None = received

    def is_completed(self) -> bool:
        return self.received is None or bool(self.work.is_completed())

    def wait(self) -> bool:
        if self.received is not None:
            self.work.wait()
            for part in self.received:
                self.mine.add_(part)
            self.received = None  # the buffers go; a second wait adds nothing
        return True


# [Note: process groups at exit]
# A gloo process group that is still alive when the interpreter finalises can abort the process ("terminate called
# without an active exception", SIGABRT). A core of such an abort shows why: a gloo worker thread destroys the work of a
# finished collective, the work's tensors hand back their Python objects, which takes the GIL, and the interpreter is
# finalising by then, so ``take_gil`` ends the thread and its forced unwind calls ``std::terminate``. ``python
# benchmarks/exit_abort.py --runs 12`` counts it: with plain torch (2 spawned ranks, 50 gloo all-reduces, then return) 6
# exits in 12 lost a rank, none once ``destroy_process_group()`` ran first (the groups' destructor releases the GIL and
# joins the worker threads), and 7 in 12 still did when a Python reference to the group outlived that call (the object
# outlives it too). Lightning destroys the process group at exit only for NCCL, and Fabric's launchers tear nothing
# down, so a run on gloo ranks exits with its groups alive, and our engine's references would keep them alive past
# anyone's destroy. So the first multi-rank ChunkComm of a process registers one exit handler that drops the group
# references of every ChunkComm still alive and then destroys the process groups (what Lightning does for NCCL), while
# the interpreter is whole. It runs before any exit handler registered earlier (Lightning's NCCL one finds nothing left
# to do). Processes that end by ``os._exit`` skip exit handlers and do not finalise either. What the handler cannot
# release: ``torch.distributed.checkpoint`` imported after ``init_process_group`` holds references to the group that
# ``destroy_process_group`` leaves (seen on torch 2.13), so the group outlives the handler; a Lightning run imports
# it (with this package) before its launcher starts the process group.
_live_comms: weakref.WeakSet[ChunkComm] = weakref.WeakSet()
_exit_handler_registered = False


def _release_groups_at_exit() -> None:
    """The exit handler of [Note: process groups at exit]."""
    for comm in list(_live_comms):
        comm.group = comm.cpu_group = None
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception as err:  # noqa: BLE001 - the process is ending: say so, do not mask its exit status
        log.warning("PatrickStar: destroying the process groups at exit failed: %s: %s", type(err).__name__, err)


def destroy_process_groups_at_exit() -> None:
    """Register, once per process, the exit handler of [Note: process groups at exit]: any code whose gloo groups
    would otherwise reach finalisation alive (the engine's comms do it themselves; a plain run's rank may too)."""
    global _exit_handler_registered
    if not _exit_handler_registered:
        atexit.register(_release_groups_at_exit)
        _exit_handler_registered = True


def _release_at_exit(comm: ChunkComm) -> None:
    _live_comms.add(comm)
    destroy_process_groups_at_exit()


class ChunkComm:
    """Collectives over one process group, for chunks."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        group: Any | None = None,
        cpu_group: Any | None = None,
        device: torch.device | None = None,
    ) -> None:
        if world_size > 1 and not dist.is_initialized():
            raise RuntimeError(
                f"world size {world_size} needs an initialised torch.distributed process group."
                " HINT: launch through the Trainer (devices/num_nodes) or torchrun."
            )
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.cpu_group = cpu_group  # gloo beside NCCL: pickled objects ([Note: one group per run])
        self.device = device  # the run's device (None: a CPU run, or a test's fake)
        self._staging: list[torch.device | None] = []  # staging_device, found on the first collective
        self.gathered_bytes = 0  # bytes received by all-gathers
        self.reduced_bytes = 0  # bytes sent to reduce-scatters
        if world_size > 1:
            _release_at_exit(self)  # [Note: process groups at exit]

    def group_for(self, tensor: torch.Tensor) -> Any | None:
        """The group for a collective on ``tensor``: the run's one group whatever the tensor's device ([Note: one
        group per run])."""
        return self.group

    def staging(self) -> torch.device | None:
        """Where the tensors of this run's collectives must be (:func:`staging_device`)."""
        if not self._staging:
            backend = _backend(self.group) if self.distributed and self.device is not None else "gloo"
            self._staging.append(staging_device(self.device, backend))
        return self._staging[0]

    def _in_place(self, tensor: torch.Tensor, collective: Callable[[torch.Tensor], Any]) -> torch.Tensor:
        """Run a blocking in-place ``collective`` on ``tensor``, through a copy where the group needs one."""
        where = self.staging()
        if where is None or tensor.device == where:
            collective(tensor)
            return tensor
        staged = tensor.to(where)
        collective(staged)
        tensor.copy_(staged)
        return tensor

    def _check_placed(self, tensor: torch.Tensor, what: str) -> None:
        """An asynchronous collective's tensor must be where the group needs it: a wrong one is an engine bug."""
        where = self.staging()
        if where is not None and tensor.device != where:
            raise RuntimeError(
                f"PatrickStar: rank {self.rank} started {what} on a tensor on {tensor.device}, but this run's"
                f" collectives run on {where} ([Note: one group per run]). HINT: this is a bug in lightning_pstar;"
                " please report it with the model and the options."
            )

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def all_gather_chunks(self, buffers: Sequence[torch.Tensor], rank_in_group: int) -> Any:
        """Start filling ``buffers`` (one chunk buffer per rank, same size) from their owners.

        Returns the collective's work handle (``wait()`` before reading the buffers; on NCCL it makes the
        current stream wait), or None with one rank. ``buffers[rank_in_group]`` is the send buffer: it must
        stay in place until the work is done.
        """
        if not self.distributed:
            return None
        self._check_placed(buffers[rank_in_group], "an all-gather")
        work = dist.all_gather(list(buffers), buffers[rank_in_group], group=self.group, async_op=True)
        self.gathered_bytes += sum(b.numel() * b.element_size() for i, b in enumerate(buffers) if i != rank_in_group)
        return work

    def start_reduce_scatter(self, flat: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """Start summing ``flat`` over ranks, where part ``r`` of its ``world_size`` equal parts goes to rank
        ``r``; returns the work handle (None with one rank) and this rank's part of the sum (read it once the
        work's ``wait()`` returned). ``flat`` must stay alive until then.

        Over NCCL a reduce-scatter. On host tensors (gloo) every rank sends each peer that peer's part
        (``all_to_all_single``) and adds what it receives into its own part of ``flat`` when the work is waited
        for ([Note: gloo's reduce-scatter]). CUDA tensors over a gloo group (``process_group_backend="gloo"`` on
        GPUs) are all-reduced in place, as before the exchange: the exchange has been measured on CPUs only."""
        if not self.distributed:
            return None, flat
        self.reduced_bytes += flat.numel() * flat.element_size()
        width, rank = self.world_size, self.rank
        parts = flat.view(width, -1)
        self._check_placed(flat, "a reduce-scatter")
        group = self.group
        if flat.device.type == "cpu":  # a gloo group (over NCCL, _check_placed refused a host tensor)
            mine = parts[rank]
            if width == 2:  # only the peer's part travels each way; one part of room for what arrives
                peer = 1 - rank
                received = torch.empty_like(mine)
                splits = [0, 0]
                splits[peer] = mine.numel()
                work = dist.all_to_all_single(received, parts[peer], splits, splits, group=group, async_op=True)
                return _SumOnWait(work, mine, [received]), mine
            out = torch.empty_like(flat)  # every part, in rank order (this rank's own copied locally)
            work = dist.all_to_all_single(out, flat, group=group, async_op=True)
            others = [p for r, p in enumerate(out.view(width, -1)) if r != rank]
            return _SumOnWait(work, mine, others), mine
        if _backend(group) == "gloo":
            return dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True), parts[rank]
        output = torch.empty_like(parts[rank])
        return _reduce_scatter_single(output, flat, op=dist.ReduceOp.SUM, group=group, async_op=True), output

    def start_all_reduce_min(self, tensor: torch.Tensor) -> Any:
        """Start an element-wise minimum over ranks in place; returns the work handle (None with one rank)."""
        if not self.distributed:
            return None
        self._check_placed(tensor, "an all-reduce")
        return dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group, async_op=True)

    def all_reduce_max_(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            self._in_place(tensor, lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group))
        return tensor

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            self._in_place(tensor, lambda t: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group))
        return tensor

    def broadcast_(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        if self.distributed:
            self._in_place(tensor, lambda t: dist.broadcast(t, src=src, group=self.group))
        return tensor

    def to_rank0_(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Bring ``tensor`` from rank ``src`` to rank 0; other ranks receive it too but are expected to drop it
        at once (so each holds one chunk at a time). A broadcast rather than send/recv: point-to-point gloo
        sends were seen to abort worker processes at exit (before [Note: process groups at exit] was understood)."""
        if not self.distributed or src == 0:  # rank 0 already holds it; nobody else keeps it
            return tensor
        self._in_place(tensor, lambda t: dist.broadcast(t, src=src, group=self.group))
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.cpu_group if self.cpu_group is not None else self.group)
        return out
