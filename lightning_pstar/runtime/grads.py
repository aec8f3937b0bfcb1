"""Gradients: the one way a gradient is written into the chunks, summed over micro-batches, or discarded.

A parameter's final gradient of a backward lands in one of two places (:class:`GradLocation`):

- mixed precision, last micro-batch before a step: the parameter's own slot of the param chunk, in the
  compute dtype ("chunk reuse": the weight is not needed again this iteration, the fp32 master holds it),
  which is what makes model data 14 bytes/param;
- otherwise (32-true, or a micro-batch whose gradient is summed with the next ones): the fp32 GRAD chunk.

Both can hold a part at once (accumulated micro-batches in GRAD, the last one in the param slot): the
optimizer adds them. With several ranks the gradient first goes to the sharding layer, which reduces it
across ranks and stores the owner's share through :meth:`GradStore.store_owned`.

[Note: gradients land per family]
On one rank a final gradient (the last micro-batch before a step) is not copied into its chunk when autograd
hands it over: the gradient hook keeps it (autograd's own tensor, ``param.grad`` cleared) and the family's
gradients land together, in one ``torch._foreach_copy_`` (or ``_foreach_add_``, summing an earlier backward's
gradient in the GRAD chunk) and one loop over its records, once every trainable parameter of the family has
its gradient. Per parameter the hook then does a list append instead of a copy, a view lookup and a
``param.data`` swap, each of which costs microseconds when it runs between the backward's kernels (the
interpreter's and the dispatcher's caches are cold there). What waits is bounded: a family's gradients until
its last one, and everything as soon as more elements wait than one chunk holds (a family whose parameters do
not all receive a gradient). Nothing outlives the backward: the first gradient that waits queues a callback on
autograd's running backward (``queue_callback``, as DDP's reducer finishes its buckets), which lands the rest
when that backward returns, however it was called (``loss.backward()``, ``manual_backward``, a reentrant
checkpoint's inner backward). A backward that raises runs no callback: the strategy's and Fabric's ``backward``
land what arrived when it raised (their own error is the one raised), and every reader of gradients (the step,
the gradient norm, ``zero_grad``, the next micro-batch) lands what still waits first (:meth:`GradStore.settle`).
The state check runs when the gradient arrives, before anything is kept, so a gradient the table refuses raises
as before; a waiting parameter keeps its weight in the slot (and is read from it) until its gradient lands.
When a gradient replaces a weight in its slot (chunk reuse) the parameter's version counter is bumped (its
``replaced_at`` keeps the version before): a view of the slot autograd saved and reads again (a second backward
of a retained graph) raises autograd's in-place error, while a weight saved by reference (``hooks.py``) accepts
exactly that bump and reads its fp32 master.

Accumulating micro-batches' gradients for a GRAD chunk on the host are summed beside the backward
([Note: sums beside the backward] in :mod:`~lightning_pstar.runtime.grad_sums`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager, nullcontext, suppress

import torch
from torch.autograd import Variable

from lightning_pstar.planning.requirements import MemoryBudgetError
from lightning_pstar.report import format_bytes
from lightning_pstar.runtime.chunk import Chunk, ChunkKind, Slot
from lightning_pstar.runtime.family import ChunkFamily, ParamRecord
from lightning_pstar.runtime.grad_sums import HostSums
from lightning_pstar.runtime.late_gradients import refuse_late_gradient
from lightning_pstar.runtime.residency import Residency
from lightning_pstar.runtime.state import SOURCES_OF, MicroBatch, TensorState, Tier

__all__ = ["GradStore"]

# module-level: an Enum member read through its class costs a lookup, and these are read per parameter
_DEVICE, _PARAM, _MASTER = Tier.DEVICE, ChunkKind.PARAM, ChunkKind.MASTER
_FINAL, _HOLD_AFTER_BWD = MicroBatch.FINAL, TensorState.HOLD_AFTER_BWD
_TO_HOLD_AFTER_BWD = SOURCES_OF[TensorState.HOLD_AFTER_BWD]
_graph_task = torch._C._current_graph_task_id  # -1 outside a backward; each backward has its own id


def _weights_replaced(records: Sequence[ParamRecord]) -> None:
    """The param slots of ``records`` hold gradients now (chunk reuse): bump the parameters' version counters, so
    that a view of the slot autograd saved and reads in a later backward (``retain_graph``, a second backward of
    the same graph) raises autograd's in-place error instead of reading a gradient as the weight ([Note:
    gradients land per family])."""
    params = [r.param for r in records]
    for record, param in zip(records, params, strict=True):
        record.replaced_at = param._version  # a weight saved by reference still reads its master (hooks.py)
        record.engine_bumps += 1
    torch.autograd.graph.increment_version(params)
    for record, param in zip(records, params, strict=True):  # the engine's bump ([Note: writes outside a forward])
        if record.known_version == record.replaced_at:
            record.known_version = param._version


class GradStore:
    """Writes, sums and discards the gradients of one model's families."""

    def __init__(self, residency: Residency, *, mixed: bool, simulated: bool) -> None:
        self.residency = residency
        self.mixed = mixed
        self.simulated = simulated
        self.micro_batch = MicroBatch.FINAL
        # [Note: gradients land per family]: final gradients waiting for the rest of their family
        self._waiting: dict[int, list[tuple[ParamRecord, torch.Tensor]]] = {}
        self._waiting_numel = 0
        self._waiting_bound = max((f.capacity for f in residency.families), default=0)  # elements: one chunk
        self._expected = {f.family_id: sum(r.trainable for r in f.records) for f in residency.families}
        self._landing_task = -1  # the backward (autograd graph task) whose end lands what waits
        # [Note: stepping inside the backward] in optim/overlap.py: called with a family whose final gradients
        # of this backward all landed; the families it took (they must receive no further gradient)
        self.on_final: Callable[[ChunkFamily], bool] | None = None
        self.stepped: set[int] = set()
        # some slot may be in HOLD_AFTER_BWD (a final gradient landed and no step or zero_grad consumed it): only then
        # a forward must look for gradients to carry over ([Note: a forward after the gradient] in late_gradients.py)
        self.held = False
        # [Note: sums beside the backward] in grad_sums.py: the sums on a host lane (its `lane` None: sums are added on
        # the calling thread, one parameter at a time); the gradients of accumulating micro-batches waiting for the
        # rest of their family, and the sums in flight
        self._summing: dict[int, list[tuple[ParamRecord, torch.Tensor]]] = {}
        self.sums = HostSums()

    @property
    def accumulating(self) -> bool:
        return self.micro_batch is MicroBatch.ACCUMULATING

    def store_owned(self, records: Sequence[ParamRecord], reduced: torch.Tensor) -> None:
        """Store the gradients averaged over ranks of ``records``, slots of one family this rank owns (ZeRO data
        parallelism), from ``reduced``, laid out as the family's chunks: one ``_foreach`` op per kind of write,
        after every slot's state was checked."""
        if not records:
            return
        final = not self.accumulating
        family = records[0].family
        if self.stepped and family.family_id in self.stepped:
            refuse_late_gradient(records[0])
        if final:
            for record in records:
                if record.slot.state not in _TO_HOLD_AFTER_BWD:
                    record.set_state(_HOLD_AFTER_BWD)  # raises, before anything is written
        pairs = [(r, r.slot.view_in(reduced)) for r in records]
        self._write_final(family, pairs, reuse=self.mixed and final and ChunkKind.GRAD not in family.chunks)
        if final:
            for record in records:
                record.slot.state = _HOLD_AFTER_BWD
            self.held = True
            done = all(r.slot.state is _HOLD_AFTER_BWD for r in family.records if r.trainable)
            if self.on_final is not None and done:
                self._take(family)

    def _write_final(self, family: ChunkFamily, pairs: list[tuple[ParamRecord, torch.Tensor]], *, reuse: bool) -> None:
        """Write gradients of ``family``'s records: into their param slots with chunk ``reuse`` (the parameters then
        read their fp32 masters, and their version counters say the slot changed), else into the GRAD chunk
        (added to an earlier backward's sum there)."""
        if reuse:
            self._write(family.param_chunk, pairs, add=False)  # chunk reuse: 14 bytes/param
            records = [r for r, _ in pairs]
            _weights_replaced(records)
            for record in records:
                self.grad_to_param_slot(record)
            return
        chunk = self.grad_chunk(family)
        fresh = [(r, g) for r, g in pairs if not r.grad_in_grad_chunk]
        summed = [(r, g) for r, g in pairs if r.grad_in_grad_chunk]  # an earlier backward's, not yet stepped
        for part, add in ((fresh, False), (summed, True)):
            if part:
                self._write(chunk, part, add=add)
        for record, _ in pairs:
            record.grad_in_grad_chunk = True

    def store_local(self, record: ParamRecord, grad: torch.Tensor) -> None:
        """One rank: take the gradient of ``record`` (a final one lands with its family's: [Note: gradients land
        per family]; one summed over micro-batches is added to the GRAD chunk now, the slot stays ``HOLD``)."""
        if self.micro_batch is not _FINAL:
            if self.sums.lane is not None and _graph_task() >= 0 and self._sums_aside(record.family):
                self._sum_aside(record, grad)
                return
            self._copy_in(self.grad_chunk(record.family), record.slot, grad, add=record.grad_in_grad_chunk)
            record.grad_in_grad_chunk = True
            record.set_state(TensorState.HOLD)
            return
        if self.stepped and record.family.family_id in self.stepped:
            refuse_late_gradient(record)
        if record.waiting:  # a second gradient in one backward (reentrant checkpoint): the first lands first
            self.settle()
        slot = record.slot
        if slot.state is _HOLD_AFTER_BWD:  # a gradient of an earlier backward that no step consumed yet (a retained
            self.carry_over([record])  # graph's second backward): kept as a sum ([Note: a forward after the gradient])
        if slot.state not in _TO_HOLD_AFTER_BWD:
            record.set_state(_HOLD_AFTER_BWD)  # raises, before anything is kept
        task = _graph_task()
        if task != self._landing_task and task >= 0:  # the first gradient of this backward: land at its end
            Variable._execution_engine.queue_callback(self._at_backward_end)
            self._landing_task = task
        fid = record.family.family_id
        waiting = self._waiting.get(fid)
        if waiting is None:
            waiting = self._waiting[fid] = []
        waiting.append((record, grad))
        record.waiting = True
        numel = self._waiting_numel = self._waiting_numel + slot.numel
        if task < 0 or numel > self._waiting_bound:
            self.settle()  # outside a backward (nothing would land it), or too much waits
        elif len(waiting) >= self._expected[fid]:
            self._land(fid)
            if self.on_final is not None:
                self._take(record.family)

    # ---- [Note: sums beside the backward] ---------------------------------------------------------------------
    def _sums_aside(self, family: ChunkFamily) -> bool:
        """Whether ``family``'s accumulated gradients are summed beside the backward: its GRAD chunk is on the host
        (or will be, allocated there on first use)."""
        chunk = family.chunks.get(ChunkKind.GRAD)
        if chunk is not None:
            return chunk.tier is Tier.HOST
        return self.residency.optimizer_tier is Tier.HOST

    def _sum_aside(self, record: ParamRecord, grad: torch.Tensor) -> None:
        """Keep an accumulating micro-batch's gradient until its family's are all here, then sum them aside."""
        if record.slot.state is not TensorState.HOLD:
            record.set_state(TensorState.HOLD)  # raises, before anything is kept
        task = _graph_task()
        if task != self._landing_task:  # the first gradient of this backward: land at its end
            Variable._execution_engine.queue_callback(self._at_backward_end)
            self._landing_task = task
        fid = record.family.family_id
        if record.waiting:  # a second gradient in one backward (reentrant checkpoint): the first is summed first
            self._sum_family(fid)
        waiting = self._summing.get(fid)
        if waiting is None:
            waiting = self._summing[fid] = []
        waiting.append((record, grad))
        record.waiting = True
        if len(waiting) >= self._expected[fid]:
            self._sum_family(fid)

    def _sum_family(self, fid: int) -> None:
        """Hand the waiting gradients of family ``fid`` to a host lane, which adds them to (or, the first time,
        copies them into) the family's fp32 GRAD chunk; the bookkeeping is done here, now."""
        pairs = self._summing.pop(fid)
        for record, _ in pairs:
            record.waiting = False
        family = pairs[0][0].family
        chunk = self.grad_chunk(family)
        parts = [
            [(r, g) for r, g in pairs if not r.grad_in_grad_chunk],
            [(r, g) for r, g in pairs if r.grad_in_grad_chunk],
        ]
        for record, _ in pairs:
            record.grad_in_grad_chunk = True
        if not self.simulated:
            self.residency.stats.d2h_bytes += sum(g.numel() * g.element_size() for _, g in pairs)
        work = [
            ([chunk.slot_view(r.slot) for r, _ in part], [g for _, g in part], add)
            for part, add in zip(parts, (False, True), strict=True)
            if part
        ]
        self.sums.submit(work)

    def _take(self, family: ChunkFamily) -> None:
        """Offer a family whose final gradients all landed to the step inside the backward."""
        assert self.on_final is not None
        if self.on_final(family):
            self.stepped.add(family.family_id)

    @contextmanager
    def landing_on_error(self) -> Generator[None, None, None]:
        """Around a backward: if it raises (no callback runs then), what arrived lands, and the backward's own error
        is the one raised ([Note: gradients land per family])."""
        try:
            yield
        except BaseException:
            with suppress(Exception):
                self.settle()
            raise

    def _at_backward_end(self) -> None:
        with torch.no_grad():
            self.settle()

    def settle(self) -> None:
        """Land every gradient still waiting ([Note: gradients land per family]): before anything reads them. Outside
        a backward, the sums added beside it end first too ([Note: sums beside the backward])."""
        if self._summing:
            for fid in list(self._summing):
                self._sum_family(fid)
        if self.sums.pending and _graph_task() < 0:
            self.sums.wait()
        if not self._waiting:
            return
        failed: BaseException | None = None
        with torch.no_grad():
            for fid in list(self._waiting):
                try:
                    self._land(fid)
                except Exception as error:  # the family is dropped; the others still land
                    failed = failed or error
        if failed is not None:
            raise failed

    def _land(self, fid: int) -> None:
        """Write the waiting final gradients of family ``fid`` into its chunks and mark their slots. A write that
        raises (no memory for the GRAD chunk, the host budget, an interrupt) drops them, as gradients of a failed
        backward, and raises once: the slots of mixed precision get their weights back from the masters, nothing
        is left waiting."""
        try:
            self._write_family(fid)
        except BaseException:
            dropped = [record for record, _ in self._waiting.pop(fid, ())]
            for record in dropped:
                self._waiting_numel -= record.slot.numel
                record.waiting = False
            if self.mixed:
                with suppress(Exception), torch.no_grad():  # the write's own error is the one to see
                    for record in dropped:
                        self._weight_back(record)
            raise

    def _weight_back(self, record: ParamRecord) -> None:
        """The param slot gets its weight back from the fp32 master; the parameter points at the slot again."""
        chunks = record.family.chunks
        master = chunks[_MASTER]
        if master.tier is Tier.DISK and not master.lent:  # read it for the copy ([Note: disk families])
            disk = self.residency.disk
            assert disk is not None
            with disk.loaded(record.family, write=False, kinds=(_MASTER,)):
                chunks[_PARAM].slot_view(record.slot).copy_(master.slot_view(record.slot))
        else:
            chunks[_PARAM].slot_view(record.slot).copy_(master.slot_view(record.slot))
        self.weight_to_param_slot(record)

    def _write_family(self, fid: int) -> None:
        waiting = self._waiting[fid]  # popped once written
        self._write_final(waiting[0][0].family, waiting, reuse=self.mixed)  # one rank: the final micro-batch reuses
        del self._waiting[fid]
        for record, _ in waiting:
            self._waiting_numel -= record.slot.numel
            record.slot.state = _HOLD_AFTER_BWD
            record.waiting = False
        self.held = True

    def _write(self, chunk: Chunk, pairs: list[tuple[ParamRecord, torch.Tensor]], *, add: bool) -> None:
        """Copy (or add) each gradient into its record's slot of ``chunk``, in one ``_foreach`` op."""
        targets = [chunk.slot_view(r.slot) for r, _ in pairs]
        grads = [g for _, g in pairs]
        if chunk.tier is not _DEVICE and not self.simulated:  # gradients cross to the host, one by one
            self.residency.stats.d2h_bytes += sum(g.numel() * g.element_size() for g in grads)
            if add:
                for target, grad in zip(targets, grads, strict=True):
                    target.add_(grad.to(target.device))
                return
            for target, grad in zip(targets, grads, strict=True):
                target.copy_(grad, non_blocking=True)  # into pinned host memory: queued, not waited for one by one
            if grads and grads[0].is_cuda:  # one wait for the family's copies: the host bytes are read next
                torch.cuda.current_stream(grads[0].device).synchronize()
        elif add:
            torch._foreach_add_(targets, grads)
        else:
            torch._foreach_copy_(targets, grads)

    def grad_to_param_slot(self, record: ParamRecord) -> None:
        """The param slot now holds (a part of) the gradient: the parameter reads its fp32 master meanwhile."""
        if not record.grad_in_param_slot:
            record.grad_in_param_slot = True
            self.residency.point_at_chunk(record)

    def weight_to_param_slot(self, record: ParamRecord) -> None:
        """The param slot holds the weight again (written by the optimizer or a load): the parameter points at it."""
        if record.grad_in_param_slot:
            record.grad_in_param_slot = False
            self.residency.point_at_chunk(record)

    def grad_chunk(self, family: ChunkFamily) -> Chunk:
        chunk = family.chunks.get(ChunkKind.GRAD)
        if chunk is None:
            # mixed precision sums micro-batch gradients in fp32. Declared runs (``accumulates=True``)
            # allocate it at setup within the plan; otherwise it goes to the device only if it fits there
            # without evicting anything in the middle of a backward.
            residency = self.residency
            chunk = residency.new_chunk(family, ChunkKind.GRAD, torch.float32)
            tier = residency.optimizer_tier
            room = residency.chunk_room()
            if tier is Tier.DEVICE and room is not None and residency.device_used() + chunk.nbytes > room:
                tier = Tier.HOST
            try:
                if tier is Tier.HOST:
                    try:
                        residency.check_host_room(chunk.nbytes, chunk=chunk)
                    except MemoryBudgetError as error:
                        raise _unplanned_sums_error(chunk.nbytes, residency) from error
                chunk.allocate(tier)
            except BaseException:
                del family.chunks[ChunkKind.GRAD]  # no chunk without storage is left for a later reader
                raise
        return chunk

    def _copy_in(self, chunk: Chunk, slot: Slot, grad: torch.Tensor, *, add: bool) -> None:
        target = chunk.slot_view(slot)
        if chunk.tier is not _DEVICE and not self.simulated:
            self.residency.stats.d2h_bytes += grad.numel() * grad.element_size()
        if add:
            target.add_(grad.to(target.device))
        else:
            target.copy_(grad)

    def carry_over(self, records: Sequence[ParamRecord]) -> None:
        """A new micro-batch starts while gradients of the last backward wait for a step (manual accumulation:
        ``manual_backward`` on several batches before ``opt.step()``): they are kept for the step, summed with
        the coming ones. A gradient in the param slot moves into the fp32 GRAD chunk and the slot gets its
        weight back from the master, so the next forward computes with the weight."""
        self.settle()
        disk = self.residency.disk
        if disk is not None:  # family by family: each disk family's master is read once ([Note: disk families])
            records = sorted(records, key=lambda r: r.family.family_id)
        masters = disk.one_at_a_time(write=False, kinds=(_MASTER,)) if disk is not None else nullcontext(None)
        with masters as need:
            self._carry_over(records, need)

    def _carry_over(self, records: Sequence[ParamRecord], need: Callable[[ChunkFamily], None] | None) -> None:
        for record in records:
            if record.slot.state is not _HOLD_AFTER_BWD:
                continue
            if record.grad_in_param_slot:
                if need is not None:
                    need(record.family)
                family = record.family
                slot = record.slot
                with torch.no_grad():
                    self._copy_in(
                        self.grad_chunk(family),
                        slot,
                        family.param_chunk.slot_view(slot).float(),
                        add=record.grad_in_grad_chunk,
                    )
                    self._weight_back(record)
                record.grad_in_grad_chunk = True
            record.set_state(TensorState.HOLD)
        self._recount_held()

    def _recount_held(self) -> None:
        if self.held:
            self.held = any(r.slot.state is _HOLD_AFTER_BWD for f in self.residency.families for r in f.records)

    def discard(self, records: Sequence[ParamRecord]) -> None:
        """Forget the gradients of ``records`` (``zero_grad``); weights overwritten by gradients are restored
        from the masters."""
        self.settle()
        disk = self.residency.disk
        if disk is not None:  # family by family: each disk family's master is read once ([Note: disk families])
            records = sorted(records, key=lambda r: r.family.family_id)
        masters = disk.one_at_a_time(write=False, kinds=(_MASTER,)) if disk is not None else nullcontext(None)
        with torch.no_grad(), masters as need:
            for record in records:
                if record.grad_in_param_slot:
                    if need is not None:
                        need(record.family)
                    self._weight_back(record)
                record.grad_in_grad_chunk = False
                if record.slot.state is _HOLD_AFTER_BWD:
                    record.set_state(TensorState.HOLD)
        self._recount_held()


def _unplanned_sums_error(nbytes: int, residency: Residency) -> MemoryBudgetError:
    """The host budget has no room for an fp32 gradient sum the setup plan did not count: mixed precision plans one
    only for declared accumulation (``accumulate_grad_batches``), while a module that computes again after its
    gradient landed ([Note: a forward after the gradient] in late_gradients.py) or micro-batches accumulated without
    declaring it (Fabric) need one per family too."""
    total = sum(f.capacity for f in residency.families if f.trainable) * 4
    return MemoryBudgetError(
        f"PatrickStar: the host budget ({format_bytes(residency.host_budget, exact=True)}) has no room for an fp32"
        f" gradient sum of {format_bytes(nbytes, exact=True)} that the setup plan did not count: mixed precision keeps"
        " one per family where gradients of several backward passes add up before a step (a module computing again"
        " after its gradient landed: a second forward or backward before the step, reentrant activation"
        " checkpointing of a shared module; or accumulation the strategy was not told of). HINT: raise"
        f" host_memory_limit by up to {format_bytes(total)} (4 bytes per trainable parameter), or declare the"
        " accumulation (`accumulate_grad_batches`)."
    )
