"""Gradients of accumulating micro-batches summed on a host lane while the backward goes on.

[Note: sums beside the backward]
A micro-batch whose gradients are summed with the next ones (gradient accumulation) adds each of them to the fp32
GRAD chunk. Where that chunk is on the host (the optimizer states are), the add was host work on the calling thread,
one parameter at a time as autograd handed the gradients over; on CUDA each one a blocking copy to pageable memory
first (the first GPU run: 3.7 GB/s, most of an offloaded step's backward). After the warm-up, at one rank, and where
the coming step runs pipelined (not under ``optimizer_overlap="off"``, nor while ``"auto"`` times or keeps the
serial step: its trials time each schedule whole), such gradients wait for the rest of their family instead (as
final ones do), and the family's adds run on a host lane of the step pipeline (``StepPipeline.run_aside``: one
worker, so a family's sums run in the order they were handed over), while the backward goes on. On CUDA the
gradients are first copied into one pinned block per family on a side stream, ordered after the compute stream's
kernels that wrote them (each gradient ``record_stream``-ed, so its memory is not reused before its copy ends); the
lane waits for that copy's event. The arithmetic is the serial path's: each sum is ``sum.add_(gradient)`` (the first
micro-batch's a copy), elementwise the same, in the same order per element. At most ``SUMS_IN_FLIGHT`` families wait
for their sum at once (the backward waits for the oldest), so the gradients kept alive and the pinned copies
(torch's caching host allocator, counted in its reserved bytes like every pinned block) stay a few families' worth.
Nothing outlives the backward: :meth:`GradStore.settle` outside a backward (``finish_backward``, the step,
``zero_grad``, a reader of gradients) hands over what still waits and waits for every sum, and raises the first
error of one. The warm-up keeps the serial way, so that its trace measures what it always did.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import torch

__all__ = ["SUMS_IN_FLIGHT", "HostSums"]

SUMS_IN_FLIGHT = 4
"""Families whose gradients may wait for their sum on a host lane at once ([Note: sums beside the backward])."""

SumWork = list[tuple[list[torch.Tensor], list[torch.Tensor], bool]]
"""Per part of a family: the GRAD chunk's views, the gradients, and whether they are added (else copied)."""


class HostSums:
    """The family sums handed to a host lane ([Note: sums beside the backward]); ``GradStore`` does the bookkeeping
    (which gradients, which views) on the calling thread and hands the arithmetic here."""

    def __init__(self) -> None:
        # runs a task on a host lane of the step pipeline; None: sums are added on the calling thread instead
        self.lane: Callable[[Callable[[], None]], Future[None]] | None = None
        self._futures: list[Future[None]] = []

    @property
    def pending(self) -> bool:
        return bool(self._futures)

    def submit(self, work: SumWork) -> None:
        """Add (or copy) each part's gradients into its views on the lane; on CUDA from pinned copies queued on a
        side stream first. At most ``SUMS_IN_FLIGHT`` sums are in flight: the oldest is waited for."""
        staged = _stage_on_host(work)  # CUDA: copies to pinned memory queued on a side stream, waited for aside

        def run() -> None:
            if staged is not None:
                staged.synchronize()
            for targets, grads, add in work:
                if add:
                    torch._foreach_add_(targets, grads)
                else:
                    torch._foreach_copy_(targets, grads)

        assert self.lane is not None
        pending = [f for f in self._futures if not f.done()]
        if len(pending) >= SUMS_IN_FLIGHT:  # what waits (gradients, pinned copies) stays bounded: the oldest ends
            pending[0].exception()  # waits; its error is raised by wait
        self._futures.append(self.lane(run))

    def wait(self) -> None:
        """Wait for every sum handed to the lane; raise the first error."""
        futures, self._futures = self._futures, []
        failed: BaseException | None = None
        for future in futures:
            try:
                future.result()
            except BaseException as error:  # noqa: BLE001 - raised once every sum has ended
                failed = failed or error
        if failed is not None:
            raise failed


def _stage_on_host(work: SumWork) -> torch.cuda.Event | None:
    """CUDA gradients for host targets: queue their copies into pinned host memory on a side stream, ordered after
    the compute stream's kernels that wrote them, and replace them in ``work`` by those host copies; returns the
    event the host lane waits on before it reads them ([Note: sums beside the backward]). None off CUDA."""
    grads = [g for _, part, _ in work for g in part]
    if not grads or not grads[0].is_cuda:
        return None
    device = grads[0].device
    compute = torch.cuda.current_stream(device)
    stream = _side_stream(device)
    stream.wait_stream(compute)
    with torch.cuda.stream(stream):
        for i, (targets, part, add) in enumerate(work):
            # one pinned block per part (the caching host allocator keeps it until the copies that use it end)
            block = torch.empty(sum(g.numel() for g in part), dtype=part[0].dtype, pin_memory=True)
            host = [view.view(g.shape) for view, g in zip(block.split([g.numel() for g in part]), part, strict=True)]
            for copy, grad in zip(host, part, strict=True):
                copy.copy_(grad, non_blocking=True)
                grad.record_stream(stream)  # its block is not reused before this copy ends
            work[i] = (targets, host, add)
        done = torch.cuda.Event()
        done.record(stream)
    return done


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream
