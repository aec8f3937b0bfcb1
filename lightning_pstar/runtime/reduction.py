"""Gradient reduction of ZeRO data parallelism: one reduce-scatter per bucket of chunk groups and backward.

[Note: the agreement in the reduction's buffer]
Each rank writes the final local gradients of a backward into an fp32 buffer per family: the chunk's capacity,
then a tail. A group is reduce-scattered to its owners at a backward sweep step that every rank computes the same
way, the group's *due* step. Whether every rank had all of the group's gradients by then is not agreed on first
(before, one ``all_reduce(MIN)`` of a flag per group ran at every sweep step): the reduction itself carries it.
The last element of every member's part of a rank's input is 1 when that rank still waited for a gradient of the
group, so each owner's output holds the number of ranks that were incomplete -- the same number on every rank.
A group reduced while some rank was incomplete gets a second round at the end of the backward with the gradients
that arrived since (zeros where none did), and the owners add the two rounds before averaging. A slot's gradient
from each rank travels in exactly one of the two, so the sum is the same one, up to the reduction's own order of
additions (which NCCL does not fix either; over gloo the owner adds in rank order). The rest of the tail says
which slots had a gradient on any rank: a slot without one is not stepped, as in torch.

Where the due steps come from: before the warm-up's plan, a group is due two steps after the sweep reached it
(the next module's backward can start before the weight gradients of the last one are accumulated, so one step
is often too early). During the warm-up every rank notes the
sweep step at which each group became complete here; the plan after the warm-up (one collective, together with
the prefetch decision) makes a group due one step after the latest such step on any rank, or at the end of the
backward when some rank never completed it (an expert it did not run, a tied embedding whose gradient is final
last). A repeating iteration then reduces each group once and waits on nothing; one that changes (experts that
vary per step) pays a second round for what arrived late, and nothing else.

Buckets ([Note: buckets of chunk groups] in :mod:`~lightning_pstar.runtime.sharding`): consecutive groups of
the backward's order whose reduce-scatter stays within ``bucket_bytes`` share one. Their buffers are views of
one buffer (a part per rank), allocated when the bucket's first gradient arrives; the bucket is due at the
latest due step of its groups, and every group keeps its own tail (flags and counter) in it, so what the owners
learn per group is what a reduction of the group alone tells them. A second round is one group's alone. The
buckets follow from the backward's order and the layout, the same on every rank. Over gloo the reduce-scatter is
an exchange of the buffer's parts, each owner adding what it receives
(:meth:`~lightning_pstar.runtime.comm.ChunkComm.start_reduce_scatter`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_pstar.runtime.comm import ChunkComm, profiled
from lightning_pstar.runtime.family import ChunkFamily, ParamRecord
from lightning_pstar.runtime.grads import GradStore
from lightning_pstar.runtime.state import TensorState

__all__ = ["GroupReducer"]


@dataclass(eq=False)
class _Round:
    """One reduce-scatter of a group in flight (or done, not yet stored)."""

    groups: tuple[int, ...]  # one group, or a bucket of them
    work: Any  # the collective's handle (None with a fake or one rank)
    outputs: list[torch.Tensor]  # per group: its own family's gradients and tail (views of one buffer)
    flat: torch.Tensor  # every rank's part of the input, kept alive until the work is done
    final: bool  # no second round can follow (the end of the backward)
    tails: _HostCopy | None = None  # the outputs' tails on the host, once the work is done: [Note: no host sync]


class _HostCopy:
    """A device tensor's copy on the host, queued without blocking the host: pinned memory and an event on CUDA
    (the CPU reads it once :meth:`ready`), a plain copy elsewhere. [Note: no host sync]"""

    def __init__(self, source: torch.Tensor) -> None:
        self.event: torch.cuda.Event | None = None
        if source.device.type != "cuda":
            self.host = source.clone()
            return
        self.host = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
        self.host.copy_(source, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def values(self) -> list[float]:
        if self.event is not None:
            self.event.synchronize()  # done already where ready() was asked first; waits for this copy only
        return self.host.tolist()


class GroupReducer:
    """Keeps the local gradients of one backward and reduces them to their owners, group by group."""

    def __init__(
        self,
        members: Callable[[int], list[ChunkFamily]],
        num_groups: int,
        comm: ChunkComm,
        grads: GradStore,
        device: torch.device,
        bucket_bytes: int = 0,
    ) -> None:
        self.members = members
        self.num_groups = num_groups
        self.comm = comm
        self.grads = grads
        self.device = device
        self.rank = comm.rank
        self.world_size = comm.world_size
        self.local_grads: dict[int, torch.Tensor] = {}  # family -> fp32 local gradients and tail
        self.local_slots: dict[int, set[int]] = {}  # family -> records with a local gradient in the buffer
        self.bucket_bytes = bucket_bytes
        self.bucket: dict[int, tuple[int, ...]] = {}  # group -> the bucket it is reduced in (this backward)
        self.packed: dict[tuple[int, ...], torch.Tensor] = {}  # bucket -> its buffer: one part per rank
        self.waiting: dict[int, int] = {}  # group -> trainable slots still without a local gradient
        self.reduced: set[int] = set()  # groups whose (first) round started in this backward
        self.received: set[int] = set()  # records with a local gradient in this backward (sent or not)
        self.rounds: list[_Round] = []  # in flight, oldest first
        self.partial: dict[int, torch.Tensor] = {}  # group -> first round's output, waiting for its second
        self.late: set[int] = set()  # groups reduced while some rank was incomplete: a second round follows
        # the schedule ([Note: the agreement in the reduction's buffer])
        self.due: list[int] | None = None  # agreed due step per group (None: before the warm-up's plan)
        self.complete_at: dict[int, int] = {}  # group -> latest sweep step it became complete here (warm-up)
        self._position: dict[int, int] = {}
        self._end = num_groups  # the due step meaning "the end of the backward" (the sweep has every group)
        self.reductions = 0  # reduce-scatters started (memory report, benchmarks)
        self.second_rounds = 0  # ... of which second rounds

    def _tail(self, group: int) -> int:
        """Elements after a family's gradients: a presence flag per record (the most records of a family in the
        group, so that every rank's input has the same size), then the incomplete-ranks counter."""
        return max(len(f.records) for f in self.members(group)) + 1

    # ---- one backward -------------------------------------------------------------------------------------
    def begin(self, order: list[int]) -> None:
        """A backward starts; ``order``: the sweep's groups in order (every rank computes the same)."""
        self._position = {g: i for i, g in enumerate(order)}
        self._end = len(order)
        self.waiting = {}
        for group in range(self.num_groups):
            count = sum(len(f.records) for f in self.members(group) if f.trainable)
            if count:
                self.waiting[group] = count
        self.reduced = set()
        self.received = set()
        self.local_grads.clear()  # nothing of an earlier backward is left (finish() sent it all)
        self.local_slots.clear()
        self.packed.clear()
        self.bucket = {}
        bucket: list[int] = []
        size = 0
        for group in (g for g in order if g in self.waiting):
            nbytes = self._bytes(group)
            if bucket and size + nbytes > self.bucket_bytes:
                self.bucket.update(dict.fromkeys(bucket, tuple(bucket)))
                bucket, size = [], 0
            bucket.append(group)
            size += nbytes
        self.bucket.update(dict.fromkeys(bucket, tuple(bucket)))

    def _bytes(self, group: int) -> int:
        """Bytes one rank sends to the group's reduce-scatter (fp32 gradients and tails of every member)."""
        return sum(f.capacity + self._tail(group) for f in self.members(group)) * 4

    def _allocate(self, group: int) -> None:
        """The local gradient buffers of ``group``'s bucket (of the group alone for a second round): zeros, one
        buffer whose part ``r`` holds, group after group, what rank ``r`` owns."""
        bucket = self.bucket.get(group, (group,)) if group not in self.reduced else (group,)
        width = self.world_size
        families = [f for g in bucket for f in self.members(g)]
        sizes = [f.capacity + self._tail(g) for g in bucket for f in self.members(g)]
        part = sum(sizes[::width])  # the members of a group have one capacity: every part has this size
        flat = self._zeros(width * part)
        for r, buf in enumerate(flat.split(part)):
            for family, view in zip(families[r::width], buf.split(sizes[r::width]), strict=True):
                self.local_grads[family.family_id] = view
        self.packed[bucket] = flat

    def _zeros(self, numel: int) -> torch.Tensor:
        return torch.zeros(numel, dtype=torch.float32, device=self.device)

    def due_step(self, group: int) -> int:
        if self.due is not None:
            return self.due[group]
        return min(self._position.get(group, self._end) + 2, self._end)

    def grad_ready(self, record: ParamRecord, grad: torch.Tensor, cursor: int) -> None:
        """Keep a local gradient until its group's round (``cursor``: the sweep step reached now)."""
        family = record.family
        group = family.family_id // self.world_size
        buf = self.local_grads.get(family.family_id)
        if buf is None:
            self._allocate(group)
            buf = self.local_grads[family.family_id]
        slot = record.slot
        view = slot.view_in(buf)
        slots = self.local_slots.setdefault(family.family_id, set())
        if record.index in slots:  # a second gradient in this backward (a module recomputed inside it), not sent yet
            view.add_(grad)
            return
        if record.index in self.received:
            # the first one was reduced already, and the peers cannot know that a second round is needed
            raise RuntimeError(
                f"parameter '{record.names[0]}' received a second gradient in one backward after its chunk group"
                " was reduced (a module run twice inside the backward, e.g. reentrant activation checkpointing of"
                " a module used twice). With several ranks that gradient would be lost. HINT: use"
                " torch.utils.checkpoint with use_reentrant=False, or train on one rank."
            )
        view.copy_(grad)
        slots.add(record.index)
        self.received.add(record.index)
        self.waiting[group] -= 1
        if self.waiting[group] == 0:
            self.complete_at[group] = max(self.complete_at.get(group, -1), cursor)
        record.slot.set_state(TensorState.HOLD, chunk_id=family.family_id)  # the weight is still in the slot

    def step(self, index: int) -> None:
        """Backward sweep step ``index`` (every rank is here): store finished rounds, start the groups due now."""
        self.store(block=False)
        due = {self.bucket[g] for g in self.waiting if g not in self.reduced}
        due = {b for b in due if self._due(b) <= index}
        for bucket in sorted(due, key=lambda b: (self._due(b), b)):
            self.reduce(bucket, final=False)

    def _due(self, bucket: tuple[int, ...]) -> int:
        return max(self.due_step(g) for g in bucket)

    def finish(self) -> None:
        """The end of the backward: every group not reduced yet gets its (only) round, then the groups some rank
        was incomplete for get their second, and every result is stored. (Only rounds started here are final:
        the sweep's catch-up before it is a module's sweep step on a rank that ran the module, so a round there
        asks for a second one as any other, or the ranks would disagree on it.)"""
        for bucket in sorted({self.bucket[g] for g in self.waiting if g not in self.reduced}):
            self.reduce(bucket, final=True)
        self.store(block=True)
        for group in sorted(self.late):
            self.reduce((group,), final=True)
            self.second_rounds += 1
        self.late.clear()
        self.store(block=True)

    def reduce(self, groups: tuple[int, ...], *, final: bool) -> None:
        """Start reduce-scattering the local gradients (summed) of ``groups`` (one group, or a bucket) to their
        owners, every group with its tail."""
        if groups not in self.packed:  # no gradient of the groups arrived here: zeros
            self._allocate(groups[0])
        flat = self.packed.pop(groups)
        self._write_tails(flat, groups, final=final)
        sizes = [self.members(g)[self.rank].capacity + self._tail(g) for g in groups]
        with profiled("pstar::reduce_scatter"):
            work, mine = self.comm.start_reduce_scatter(flat)
        self.reductions += 1
        self.rounds.append(_Round(groups, work, list(mine.split(sizes)), flat, final))
        self.reduced.update(groups)

    def _write_tails(self, flat: torch.Tensor, groups: tuple[int, ...], *, final: bool) -> None:
        """Every member's tail of ``groups`` in the round's input ([Note: the agreement in the reduction's
        buffer]): built on the host, sent in one copy (from pinned memory on CUDA, so the host does not wait for
        it: [Note: no host sync]) and spread into the tails on the device."""
        views: list[torch.Tensor] = []
        values: list[float] = []
        for group in groups:
            tail = self._tail(group)
            incomplete = 0.0 if final or self.waiting.get(group, 0) == 0 else 1.0
            for family in self.members(group):
                buf = self.local_grads.pop(family.family_id)
                got = self.local_slots.pop(family.family_id, set())
                flags = [1.0 if r.index in got else 0.0 for r in family.records]
                flags += [0.0] * (tail - 1 - len(flags))
                flags.append(incomplete)
                views.append(buf[family.capacity :])
                values += flags
        host = torch.tensor(values, dtype=torch.float32)
        if flat.device.type == "cuda":
            host = host.pin_memory()  # the caching host allocator keeps the block until the copy has read it
        sent = host.to(flat.device, non_blocking=True)
        for view, part in zip(views, sent.split([v.numel() for v in views]), strict=True):
            view.copy_(part)

    def _read_tails(self, done: _Round) -> _HostCopy:
        """Queue the copy of the round's output tails to the host (its work is done or waited for)."""
        tails = []
        for group, output in zip(done.groups, done.outputs, strict=True):
            own = self.members(group)[self.rank]
            tails.append(output[own.capacity :])
        return _HostCopy(torch.cat(tails))

    def store(self, *, block: bool) -> None:
        """Average finished rounds into the owners' chunks, oldest first (all of them if ``block``); a first round
        some rank was incomplete for waits for its second.

        [Note: no host sync]
        What the host must know of a round (which slots had a gradient on any rank, how many ranks were
        incomplete) is in its outputs' tails on the device. Reading them with ``.item()`` / ``.tolist()`` would
        wait for everything queued on the compute stream (the rest of the backward) at every round; instead,
        once the collective is done, one copy of the round's tails to pinned host memory is queued with an event,
        and a later call (the next sweep step) uses them once the event has passed. Only ``block`` (the end of
        the backward) waits, and then for that copy alone."""
        while self.rounds:
            done = self.rounds[0]
            if done.tails is None:
                if done.work is not None:
                    if not block and not done.work.is_completed():
                        return
                    done.work.wait()
                done.tails = self._read_tails(done)
            if not block and not done.tails.ready():
                return
            values = done.tails.values()
            self.rounds.pop(0)
            offset = 0
            for group, output in zip(done.groups, done.outputs, strict=True):
                own = self.members(group)[self.rank]
                tail = values[offset : offset + output.numel() - own.capacity]
                offset += len(tail)
                earlier = self.partial.pop(group, None)
                if earlier is not None:
                    output.add_(earlier)
                elif not done.final and tail[-1] > 0:
                    self.partial[group] = output  # some rank still waited: the second round adds the rest
                    self.late.add(group)
                    continue
                self._store_owned(group, output, tail if earlier is None else None)

    def _store_owned(self, group: int, output: torch.Tensor, tail: list[float] | None) -> None:
        """Average ``output`` and store the slots some rank had a gradient for; ``tail``: the output's tail as read
        on the host (None after a second round, whose sum is then read here, once per late group)."""
        own = self.members(group)[self.rank]
        output.div_(self.world_size)
        if tail is None:
            tail = output[own.capacity :].tolist()  # a late group: at the end of the backward, rare
        present = tail[: len(own.records)]
        self.grads.store_owned([r for r, flag in zip(own.records, present, strict=True) if flag > 0], output)

    def discard(self) -> None:
        """Forget local gradients that were never reduced (zero_grad before a step)."""
        self.store(block=True)  # never drop a buffer a collective still uses
        self.partial.clear()
        self.late.clear()
        self.local_grads.clear()
        self.local_slots.clear()
        self.packed.clear()
        self.waiting.clear()
        self.reduced.clear()
        self.received.clear()

    # ---- the plan after the warm-up -----------------------------------------------------------------------
    def schedule_wanted(self) -> list[int]:
        """Per group, the due step this rank's warm-up asks for: one after the step it became complete here,
        or the end of the backward (``self._end``) if it never did."""
        return [self.complete_at[g] + 1 if g in self.complete_at else self._end for g in range(self.num_groups)]

    def adopt_schedule(self, due: list[int]) -> None:
        """The agreed due steps: the latest any rank asked for."""
        self.due = list(due)
