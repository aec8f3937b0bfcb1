"""Warm-up trace: non-model memory and chunk accesses at every moment of one iteration.

A *moment* is one point of the iteration: before a module's forward, before a module's backward, or the
optimizer step. During the warm-up iteration the tracer records, per moment, which chunk families are
accessed and the peak of non-model memory until the next moment. Later iterations plan from that trace
(:class:`~lightning_pstar.runtime.placement.AutoPlacement`): the room for chunks at moment ``t`` is
``budget - non_model[t]``.

Non-model memory is measured with the CUDA allocator on a GPU (peak between moments, minus chunk bytes)
and, on the simulated device, as the bytes of tensors autograd saves for backward, excluding views of
chunks, which are model data. The saved-tensor hooks themselves are installed by
:meth:`lightning_pstar.runtime.hooks.ModelHooks.saved_tensors` (one pair for the whole engine), which hands every
saved tensor that is not a chunk-backed weight to :meth:`MemoryTracer.count` while :attr:`counting`.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import torch

from lightning_pstar.planning.requirements import MemoryBudgetError
from lightning_pstar.report import format_bytes

__all__ = [
    "CudaAllocatorStats",
    "Moment",
    "MomentKind",
    "MemoryTracer",
    "Trace",
    "out_of_memory_as_error",
    "take_free_blocks",
]

log = logging.getLogger(__name__)


class MomentKind(str, Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    STEP = "step"


_STEP = MomentKind.STEP  # module-level: an Enum member read through its class costs a lookup per moment


@dataclass(frozen=True)
class Moment:
    """One recorded moment: what ran, which chunk families it accessed, the non-model peak until the next."""

    kind: MomentKind
    key: int  # module index for FORWARD/BACKWARD, 0 for STEP
    families: tuple[int, ...]
    non_model_bytes: int = 0


@dataclass
class Trace:
    """The warm-up iteration, as a cyclic sequence of moments."""

    moments: list[Moment] = field(default_factory=list)
    _uses: dict[int, list[int]] = field(default_factory=dict)  # family -> sorted moment indices
    keys: list[tuple[MomentKind, int]] = field(default_factory=list)  # (kind, key) per moment, once finished

    def finish(self) -> None:
        self._uses = {}
        self.keys = [(m.kind, m.key) for m in self.moments]
        for index, moment in enumerate(self.moments):
            for fid in moment.families:
                self._uses.setdefault(fid, []).append(index)

    def next_use(self, family_id: int, after: int) -> int:
        """Moments from ``after`` until ``family_id`` is used again (the trace repeats); huge if never."""
        uses = self._uses.get(family_id)
        n = len(self.moments)
        if not uses or n == 0:
            return 1 << 30
        i = bisect.bisect_right(uses, after)
        nxt = uses[i] if i < len(uses) else uses[0] + n
        return nxt - after

    @property
    def peak_non_model(self) -> int:
        return max((m.non_model_bytes for m in self.moments), default=0)

    def device_need(self, chunk_bytes: Callable[[Sequence[int]], int]) -> list[int]:
        """Per moment, the device bytes it needs: its chunks (``chunk_bytes(families)``; none at the step, which
        moves chunks family by family) plus the non-model memory measured then."""
        return [
            (chunk_bytes(m.families) if m.kind is not MomentKind.STEP else 0) + m.non_model_bytes for m in self.moments
        ]


class _SavedToken:
    """Held by autograd next to a saved tensor; its death means the saved bytes are free again."""

    __slots__ = ("_nbytes", "_release")

    def __init__(self, nbytes: int, release: Callable[[int], None]) -> None:
        self._nbytes = nbytes
        self._release = release

    def __del__(self) -> None:
        self._release(self._nbytes)


class CudaAllocatorStats:
    """The CUDA caching allocator's counters the tracer reads (a seam: the CPU tests pass a fake).

    [Note: peak counter]
    The tracer measures the non-model peak of each moment with ``max_memory_allocated`` and resets the peak
    counter at every moment of the warm-up. Resetting would corrupt a user's own peak measurement (a
    ``torch.cuda.max_memory_allocated()`` around ``trainer.fit``), so the tracer keeps the highest value the
    counter ever reached (before the first reset and at every moment) and, once the warm-up ends, raises the
    counter back to it (:meth:`restore_peak`) by allocating the missing bytes for an instant. It takes them only
    from blocks the caching allocator already holds free (read once from ``torch.cuda.memory_snapshot()``, the
    largest first, each request sized for one free large block, which the allocator's best fit then serves):
    one tensor of the whole difference would ask the driver for a new segment that size (a ``cudaMalloc`` of
    up to the peak, reserved memory raised by as much for the rest of the run, or an out-of-memory retry that
    frees the cache and synchronises), all to restore a counter. Where the free blocks hold less than the
    difference the counter stays lower by the rest, and a debug message says so.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def restore_peak(self, target: int) -> None:
        """Raise the peak counter towards ``target`` if it is lower (see [Note: peak counter])."""
        missing = target - self.allocated()
        if self.peak() >= target or missing <= 0:
            return
        sizes = take_free_blocks(self.free_blocks(), missing)
        if sum(sizes) < missing:
            log.debug(
                "PatrickStar: the CUDA peak counter is restored to %d of %d bytes (the rest is not held free)",
                target - missing + sum(sizes),
                target,
            )
        try:
            self._hold_and_free(sizes)
        except torch.OutOfMemoryError:
            log.debug("PatrickStar: the CUDA peak counter could not be restored to %d bytes", target)

    def free_blocks(self) -> list[int]:
        """Sizes of the blocks the caching allocator holds free on this device."""
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return [
            int(block["size"])
            for segment in torch.cuda.memory_snapshot()
            if segment.get("device", index) == index and segment.get("segment_type") == "large"
            for block in segment.get("blocks", ())
            if block.get("state") == "inactive" and int(block["size"]) > SMALL_REQUEST_BYTES
        ]

    def _hold_and_free(self, sizes: list[int]) -> None:
        held = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]
        del held


SMALL_REQUEST_BYTES = 1 << 20
"""Requests up to this size come from the caching allocator's small pool (``kSmallSize``), whose segments are 2 MiB:
the restore counts only free blocks above it (a last request below it costs at most one such segment)."""


def take_free_blocks(free: list[int], missing: int) -> list[int]:
    """Requests, one per free large block (``free``: their sizes), largest first, that raise the allocated bytes
    by ``missing``, or as close below as the blocks allow; the last is cut to what is still missing. See [Note:
    peak counter]."""
    taken: list[int] = []
    for size in sorted(free, reverse=True):
        if missing <= 0:
            break
        taken.append(min(size, missing))
        missing -= taken[-1]
    return taken


class MemoryTracer:
    """Records the warm-up trace; afterwards, follows the iteration along it."""

    def __init__(
        self,
        device: torch.device,
        chunk_bytes_on_device: Callable[[], int],
        chunk_storage_ptrs: Callable[[], set[int]] = set,
        allocator: CudaAllocatorStats | None = None,
    ) -> None:
        self.device = device
        self.cuda = device.type == "cuda" or allocator is not None
        self.allocator = allocator if allocator is not None or not self.cuda else CudaAllocatorStats(device)
        self._open_chunk_bytes = 0  # chunk bytes on the device when the peak counter was last reset
        self._true_peak = 0  # the highest the allocator's peak counter reached (see [Note: peak counter])
        self._chunk_bytes = chunk_bytes_on_device
        self._chunk_storage_ptrs = chunk_storage_ptrs
        self.trace = Trace()
        self.recording = False
        self.warmed_up = False
        self.cursor = -1  # index of the current moment in the trace (after warm-up)
        self.matches = True  # False once the execution stopped following the trace
        self.untraced = False  # a stationary micro-batch: its modules are not followed ([Note: stationary chunks])
        self._live = 0  # simulated device: bytes of saved tensors alive now
        self._peak = 0  # simulated device: peak of ``_live`` since the last moment
        self._pending: tuple[MomentKind, int, tuple[int, ...]] | None = None

    # ---- saved-tensor accounting (simulated device) ------------------------------------------------------
    def _release(self, nbytes: int) -> None:
        self._live -= nbytes

    @property
    def counting(self) -> bool:
        """Whether saved tensors are counted now (a recorded training step on the simulated device)."""
        return self.recording and not self.cuda

    def count(self, tensor: torch.Tensor) -> _SavedToken | None:
        """Count a tensor autograd saves for backward until the returned token dies (keep it beside the tensor);
        None when it is not counted."""
        storage = tensor.untyped_storage()
        # a view of a chunk (on either tier; chunks move and re-allocate during the step): model data
        if storage.data_ptr() in self._chunk_storage_ptrs():
            return None
        if tensor.device.type != self.device.type:
            return None
        nbytes = storage.nbytes()
        self._live += nbytes
        self._peak = max(self._peak, self._live)
        return _SavedToken(nbytes, self._release)

    def _non_model_now_and_reset(self, kind: MomentKind) -> int:
        if self.allocator is not None:
            return self._cuda_non_model_and_reset(kind)
        peak = self._peak
        self._peak = self._live
        return peak

    def _cuda_non_model_and_reset(self, kind: MomentKind) -> int:
        """The allocator's peak since the last reset minus the chunks on the device then.

        Chunks come to the device during a forward or backward moment (the peak comes with them: the chunks
        now are the ones to subtract), and leave it during the optimizer step (the peak comes before they
        leave: the chunks resident at the reset are the ones to subtract, or the step would count them as
        activations). The step's own device temporaries are budgeted apart (``step_temporary_bytes``).
        """
        allocator = self.allocator
        assert allocator is not None
        peak = allocator.peak()
        self._true_peak = max(self._true_peak, peak)
        chunks = self._chunk_bytes()
        if kind is MomentKind.STEP:
            chunks = max(chunks, self._open_chunk_bytes)
        allocator.reset_peak()
        self._open_chunk_bytes = self._chunk_bytes()
        return max(0, peak - chunks)

    # ---- moments ------------------------------------------------------------------------------------------
    def start_recording(self) -> None:
        self.trace = Trace()
        self.recording = True
        self._pending = None
        if self.allocator is not None:
            self._true_peak = max(self._true_peak, self.allocator.peak())  # the user's peak so far
            self.allocator.reset_peak()
            self._open_chunk_bytes = self._chunk_bytes()
        self._peak = self._live

    def moment(self, kind: MomentKind, key: int, families: Sequence[int]) -> int:
        """Called before every moment. Records during warm-up; afterwards advances along the trace. Returns the
        trace moment the iteration is at now when it follows the trace after the warm-up, else -1."""
        if self.recording:
            self._close_pending()
            self._pending = (kind, key, tuple(families))
            return -1
        if not self.warmed_up or not self.matches:
            return -1
        nxt = self.cursor + 1
        keys = self.trace.keys
        if nxt < len(keys) and keys[nxt] == (kind, key):  # the iteration follows the trace (a step: the next one)
            self.cursor = nxt
            return nxt
        if kind is _STEP:
            # the trace's next step: with several optimizers an iteration has several steps (a GAN's generator
            # and discriminator cycles); accumulated micro-batches each restart at the trace's first moment,
            # so their step is the trace's last
            moments = self.trace.moments
            after = self.cursor + 1
            steps = (i for i in range(max(after, 0), len(moments)) if moments[i].kind is MomentKind.STEP)
            self.cursor = next(steps, len(moments) - 1)
            return self.cursor
        self.matches = False
        log.warning(
            "PatrickStar: the iteration no longer follows the warm-up trace (moment %d: %s of module %d);"
            " placement falls back to least-recently-used eviction for the rest of the run.",
            nxt,
            kind.value,
            key,
        )
        return -1

    def _close_pending(self) -> None:
        if self._pending is None:
            return
        kind, key, families = self._pending
        self.trace.moments.append(Moment(kind, key, families, self._non_model_now_and_reset(kind)))
        self._pending = None

    def stop_recording(self) -> None:
        """End of warm-up (after the first optimizer step)."""
        self._close_pending()
        self.recording = False
        self.warmed_up = True
        self.trace.finish()
        self.cursor = len(self.trace.moments) - 1  # the step: the next moment starts the next iteration
        if self.allocator is not None:
            self.allocator.restore_peak(self._true_peak)  # a user's own peak reading stays true

    # ---- out of memory --------------------------------------------------------------------------------------
    def moment_label(self) -> str:
        """The moment the iteration is at now, in words (for errors)."""
        if self.recording and self._pending is not None:
            kind, key, _ = self._pending
            where = "warm-up"
        elif self.untraced:
            return "a training micro-batch after the warm-up (no chunk moves in it, so its modules are not traced)"
        elif self.warmed_up and self.matches and 0 <= self.cursor < len(self.trace.moments):
            moment = self.trace.moments[self.cursor]
            kind, key, where = moment.kind, moment.key, f"moment {self.cursor} of the trace"
        else:
            return "outside the traced iteration"
        what = "the optimizer step" if kind is MomentKind.STEP else f"{kind.value} of module #{key}"
        return f"{what} ({where})"

    @contextmanager
    def out_of_memory_as_error(self, *, device_budget: int | None) -> Iterator[None]:
        """Turn a CUDA out-of-memory error raised inside into a :class:`MemoryBudgetError` naming the moment, the
        budget, what chunks and non-model memory held, and what to change (the allocator's message is kept as
        the cause)."""
        try:
            yield
        except torch.OutOfMemoryError as err:
            raise self.out_of_memory_error(err, device_budget=device_budget) from err

    def out_of_memory_error(self, err: BaseException, *, device_budget: int | None) -> MemoryBudgetError:
        chunks = self._chunk_bytes()
        measured = ""
        if self.warmed_up and self.matches and 0 <= self.cursor < len(self.trace.moments):
            measured = (
                f"; the warm-up measured {format_bytes(self.trace.moments[self.cursor].non_model_bytes, exact=True)}"
                " of non-model memory (activations) at this moment"
            )
        budget = (
            "no device_memory_limit"
            if device_budget is None
            else f"device_memory_limit {format_bytes(device_budget, exact=True)}"
        )
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        return MemoryBudgetError(
            f"CUDA ran out of memory during {self.moment_label()} under {budget}: chunks held"
            f" {format_bytes(chunks, exact=True)} of the device{measured}. The allocator said: {first}"
            " HINT: set device_memory_limit below the free device memory (other processes and the CUDA context"
            " take their share), lower the batch size or chunk_size, or use activation checkpointing."
        )

    def start_iteration(self) -> None:
        """A new micro-batch begins: the next forward moment is the trace's first."""
        if self.warmed_up and self.matches:
            self.cursor = -1


class _Engine(Protocol):
    """What :func:`out_of_memory_as_error` reads of a chunk manager (which imports this module)."""

    tracer: MemoryTracer
    residency: Any  # its ``device_budget``


def out_of_memory_as_error(manager: _Engine | None) -> AbstractContextManager[None]:
    """The strategy's guard around a training step and an optimizer step: a CUDA out-of-memory inside becomes a
    :class:`MemoryBudgetError` naming the moment and the budget (no guard before setup)."""
    if manager is None:
        return nullcontext()
    return manager.tracer.out_of_memory_as_error(device_budget=manager.residency.device_budget)
