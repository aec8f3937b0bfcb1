"""ZeRO data parallelism over chunk groups: gather on access, release after use, reduce gradients.

Chunk *i* belongs to communication group ``i // world_size`` and is owned by rank ``i % world_size``
(:mod:`lightning_pstar.runtime.comm`). A rank keeps the param chunk, fp32 master and optimizer states only of the
families it owns. When a module needs a chunk of group *g*, every rank all-gathers the group's param
chunks into local storage; the remote ones are released once the pass has moved on. In backward each rank
writes its local gradients into a temporary fp32 buffer per family; a group complete on every rank is
reduce-scattered to the owners and averaged.

[Note: one collective sequence on every rank]
Ranks need not run the same modules: a mixture-of-experts layer routes different tokens to different
experts on each rank, and a rank may skip an expert that another rank runs. A collective started from
"the module that runs now" would then wait forever for a peer that never starts it, or -- worse -- pair
with a different collective of the peer and exchange the wrong chunks. So every collective is issued at a
point every rank reaches, in an order every rank computes the same way:

- a pass *sweeps* the groups in a fixed order: in forward the order in which the module tree first uses
  them (:func:`~lightning_pstar.runtime.sweep.sweep_plan`; a frozen embedding whose chunks the layout puts last
  is still swept first), and in backward the reverse of the forward's gathers (the tied embedding the head used
  last comes first). A module that needs group *g* ahead of the sweep's cursor advances the cursor to *g*,
  gathering every group on the way: a rank that skipped an expert still gathers that expert's group when it
  moves past it, at the same position in its sequence as the rank that ran the expert;
- before that, a module's forward advances the sweep to the module's own place in the tree (the last group
  any module up to it first uses), so everything it does next starts at the same position on every rank,
  whichever modules a rank skipped before it;
- at the end of a pass (backward start, end of backward, end of an evaluation step) the sweep catches up
  to the last group, so a group only the last modules of one rank needed is gathered everywhere;
- a group is released when the sweep has passed it and no slot in it computes (in backward, nor waits for
  a gradient), so which groups are present -- and so whether a group needs a gather -- is the same on
  every rank for every group the sweep has not passed. A group needed again after the sweep passed it
  (the tied head in forward) is gathered out of order, at the module's place in the sweep: safe when every
  rank runs that module (a module run on some ranks only that reuses a group the sweep passed is not
  supported);
- gradients: each group is reduce-scattered once per backward, asynchronously, at a sweep step every rank
  computes the same way, and whether every rank had all of its gradients by then travels in the reduction's
  own buffer (:mod:`~lightning_pstar.runtime.reduction`, [Note: the agreement in the reduction's buffer]): a
  group some rank was incomplete for gets a second round at the end of the backward;
- what the forward of a training pass gathered stays gathered into the backward for the last groups of the
  forward sweep that fit the device budget (``keep``, agreed once by all ranks after the warm-up: every group
  without a budget), so their backward needs no second all-gather. A kept group the forward would release is
  *parked* instead: present, but a later use in the forward counts as the out-of-order gather it would have
  been (without the collective), so the backward sweeps the groups in the same order as without keeping. A kept
  group is released once the backward sweep has passed it, and at the end of the pass; when every group is kept
  (*holding*: no device budget, or one that holds them all beside the warm-up's peak, agreed, so every rank holds
  alike), none is released before the end of the backward: the plan let all of them be present at every moment,
  no group needs a second gather, and a module's backward only advances the sweep (its reductions);
- the next group of the sweep is all-gathered asynchronously while the current one computes
  (``prefetch``): the decision depends only on the sweep, and whether prefetching fits the device budget
  is agreed once by all ranks after the warm-up iteration;
- small groups share collectives ([Note: buckets of chunk groups]).

[Note: buckets of chunk groups]
A collective costs a fixed latency (a millisecond over gloo on a loaded CPU, tens of microseconds over NCCL)
on top of its bytes, so a model of many small groups pays mostly latency. Consecutive groups of a sweep whose
collective stays within ``bucket_bytes`` share one, as DDP's gradient buckets do:

- all-gather: when a forward gathers a group, the groups that follow it in the sweep and stay gathered into
  the backward anyway (``keeping``) come with it, each rank's chunks packed into one buffer per rank. The
  plan let every kept group be present at the warm-up's peak, so gathering them early needs no room it did
  not count; what decides the bucket (the sweep, what is gathered or in flight ahead of the cursor, the
  agreed ``keep``) is the same on every rank. A group gathered ahead is entered in ``forward_gathers`` when
  the sweep reaches it, so the backward's order is the one it would be without buckets;
- reduce-scatter: the reducer's buckets ([Note: the agreement in the reduction's buffer]).

A forward that keeps every group (the plan kept them all, and prefetching fits) gathers the next bucket as soon
as no gather is in flight, instead of one group before the sweep needs it: the bucket's transfer overlaps the
computation of the one before it (the room is the plan's, since every kept group is present at the warm-up's
peak anyway), and what decides it (the sweep, what is gathered or in flight) is the same on every rank, so the
sequence of all-gathers is unchanged.

Groups larger than ``bucket_bytes`` (a large model's) each keep their own collective, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import torch

from lightning_pstar.runtime.comm import ChunkComm, group_of, owner_of, profiled
from lightning_pstar.runtime.family import ChunkFamily, ParamRecord
from lightning_pstar.runtime.grads import GradStore
from lightning_pstar.runtime.group_gather import GroupGather, pack_bucket, unpack_bucket
from lightning_pstar.runtime.local_sharding import LocalSharding
from lightning_pstar.runtime.model_agreement import agree_on_model
from lightning_pstar.runtime.new_storage import keep_new_storage, moved
from lightning_pstar.runtime.reduction import GroupReducer
from lightning_pstar.runtime.residency import Residency
from lightning_pstar.runtime.state import TensorState, Tier
from lightning_pstar.runtime.sweep import Sweep, sweep_plan

__all__ = ["DEFAULT_BUCKET_BYTES", "GroupCoordinator", "LocalSharding", "Sweep"]

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 4 * 2**20
"""Consecutive chunk groups share a collective up to this many bytes ([Note: buckets of chunk groups]): about
where a collective's bytes start to cost more than its latency, over NCCL and over gloo alike."""


class GroupCoordinator:
    """Gathers, releases and reduces the chunk groups of one chunk manager."""

    distributed = True

    def __init__(
        self,
        families: list[ChunkFamily],
        comm: ChunkComm,
        *,
        residency: Residency,
        grads: GradStore,
        compute_dtype: torch.dtype,
        module_groups: Sequence[Iterable[int]] = (),
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        self.families = families
        self.residency = residency
        residency.shared_ptrs = self.poison_ptrs  # [Note: parameters given new storage] in new_storage.py
        self.grads = grads
        self.compute_dtype = compute_dtype
        self.device = residency.device
        self.comm = comm
        self.world_size = comm.world_size
        self.rank = comm.rank
        self.gathered: set[int] = set()  # groups whose remote param chunks are present locally
        self.inflight: dict[int, GroupGather] = {}  # group -> the asynchronous gather it is part of (prefetch)
        self.bucket_bytes = bucket_bytes  # [Note: buckets of chunk groups]
        self.ahead: set[int] = set()  # groups a bucket gathered that the forward sweep has not reached yet
        self.pinned = residency.pinned  # families whose param chunk is the send buffer of an in-flight gather
        self.prefetch_enabled = False  # agreed by every rank after the warm-up (plan)
        # the sweep (see the note above)
        self.sweep = Sweep.IDLE
        self.order: list[int] = []
        self.position: dict[int, int] = {}
        self.cursor = -1  # index in ``order`` of the last group the sweep reached
        self.forward_gathers: list[int] = []  # groups gathered by this pass's forward, in order
        self.keep: frozenset[int] = frozenset()  # groups a forward keeps gathered for its backward (plan)
        self.keeping: frozenset[int] = frozenset()  # ... in the current pass (none in an evaluation pass)
        self.parked: set[int] = set()  # kept groups the forward would have released: present, "released" for the order
        self.holding = False  # this backward keeps every group until its end (every group is kept)
        self.reducer = GroupReducer(self.members, self.num_groups(), comm, grads, self.device, bucket_bytes)
        self._poison: dict[torch.Size, torch.Tensor] = {}  # NaN views by shape, in the compute dtype
        self.forward_order, self.module_position = sweep_plan(module_groups, len(families) // self.world_size)
        # counters (memory report, tests)
        self.gathers = 0
        self.prefetches = 0

    # ---- ownership --------------------------------------------------------------------------------------
    def owns(self, family: ChunkFamily) -> bool:
        return owner_of(family.family_id, self.world_size) == self.rank

    def group_of(self, family: ChunkFamily) -> int:
        return group_of(family.family_id, self.world_size)

    def members(self, group: int) -> list[ChunkFamily]:
        start = group * self.world_size
        return self.families[start : start + self.world_size]

    def num_groups(self) -> int:
        return len(self.families) // self.world_size

    # ---- parameters of released chunks ------------------------------------------------------------------
    def point_at_poison(self, record: ParamRecord) -> None:
        """A released remote chunk has no bytes here: its parameters read as NaN (never as stale weights)."""
        if moved(record):
            keep_new_storage(self.residency, record)  # [Note: parameters given new storage] in new_storage.py
        shape = record.slot.shape
        view = self._poison.get(shape)
        if view is None:  # one expanded view per shape, made once (a release re-points every remote parameter)
            one = torch.full((1,), float("nan"), dtype=self.compute_dtype, device=self.device)
            view = self._poison[shape] = one.expand(shape)
        record.param.data = view
        record.pointed, record.strided = view.data_ptr(), not view.is_contiguous()  # [Note: parameters given ...]

    def poison_ptrs(self) -> set[int]:
        """Addresses of the storages of the NaN views remote parameters point at."""
        return {view.untyped_storage().data_ptr() for view in self._poison.values()}

    # ---- passes -----------------------------------------------------------------------------------------
    def _start_sweep(self, order: Iterable[int], *, backward: bool) -> None:
        self.parked.clear()  # a new sweep: what is present is gathered
        self.order = list(order)
        self.position = {g: i for i, g in enumerate(self.order)}
        self.cursor = -1
        self.sweep = Sweep.BACKWARD if backward else Sweep.FORWARD
        self.holding = False

    def begin_pass(self, *, training: bool = True) -> None:
        """Every rank starts a forward pass: a training micro-batch, or (``training=False``) an evaluation step,
        which keeps no group gathered (its activations are not the warm-up's, so the plan's room is not its)."""
        self.flush()
        self.keeping = self.keep if training else frozenset()
        self.forward_gathers = []
        self._start_sweep(self.forward_order, backward=False)
        self._prefetch_next(set())  # the first group, while the step's loose ends finish

    def begin_backward(self) -> None:
        """Every rank starts the backward of the pass: the forward sweep catches up, and the backward sweep
        runs in the reverse order of the forward's gathers."""
        if self.sweep is Sweep.BACKWARD:
            return
        if self.sweep is Sweep.IDLE:
            self.begin_pass()
        self._sweep_to(len(self.order) - 1, protect=set())
        self.release_passed()
        seen: set[int] = set()
        order: list[int] = []
        for group in reversed(self.forward_gathers):
            if group not in seen:
                seen.add(group)
                order.append(group)
        order += [g for g in reversed(range(self.num_groups())) if g not in seen]
        self._start_sweep(order, backward=True)
        self.holding = len(self.keeping) == self.num_groups()  # every rank has the same keep (plan)
        if self.holding and len(self.gathered) != self.num_groups():  # the forward kept all: none may be missing
            missing = sorted(set(range(self.num_groups())) - self.gathered)
            raise RuntimeError(
                f"PatrickStar internal error: a backward that keeps every chunk group found groups {missing} not"
                f" gathered on rank {self.rank}. HINT: please report this with the model and the training loop."
            )
        self.reducer.begin(order)
        self._prefetch_next(set())  # the first group, while the loss's backward starts

    def flush(self) -> None:
        """End of a pass: catch the sweep up (collectives a peer may need), reduce every group not reduced
        yet (parameters without a gradient on some rank), release every remote chunk."""
        if self.sweep is not Sweep.IDLE:
            self._sweep_to(len(self.order) - 1, protect=set())
            if self.sweep is Sweep.BACKWARD:
                self.reducer.finish()
        self.sweep = Sweep.IDLE
        self.holding = False
        self.release_all()

    # ---- forward / backward access ----------------------------------------------------------------------
    def ensure_gathered(
        self, families: list[ChunkFamily], protect: set[int], *, in_backward: bool, module: int | None = None
    ) -> None:
        """Make every group of ``families`` present locally (collectives in sweep order, see the note), and the
        families this rank owns resident on the device.

        ``module`` (the index of the module whose forward needs them) first advances a forward sweep to the
        module's place in the module tree, so that what happens next (a gather of a group the sweep passed)
        starts at the same point of the sequence on every rank, whichever modules a rank skipped before."""
        if self.sweep is Sweep.IDLE:
            self.begin_pass(training=False)  # a forward outside the steps Lightning runs (a callback calling it)
        if in_backward and self.sweep is not Sweep.BACKWARD:
            self.begin_backward()  # a backward not started through the strategy (loss.backward() by hand)
        if self.holding:  # every group is present until the backward ends: the sweep only moves on
            self._advance_held(families, protect)
            return
        groups = sorted({self.group_of(f) for f in families}, key=self.position.__getitem__)
        # every group present and none in flight: nothing is gathered below, so no room is made (no guard), and
        # there is nothing to prefetch
        present = not self.inflight and len(self.gathered) == self.num_groups()
        guard = protect if present else self._guard(groups, protect)
        if module is not None and self.sweep is Sweep.FORWARD and self.module_position[module] > self.cursor:
            self._sweep_to(self.module_position[module], guard)
        for group in groups:
            if self.position[group] > self.cursor:
                self._sweep_to(self.position[group], guard)
            elif group in self.parked:
                self.parked.discard(group)  # kept: the out-of-order gather below, without its collective
                self.forward_gathers.append(group)
            elif group not in self.gathered:
                self._gather(group, guard)  # used again after the sweep passed it (a tied head)
        self.release_passed(keep=set(groups))  # the slots of this access are not marked COMPUTE yet
        if not present:
            self._prefetch_next(guard)
        self._fetch_owned(families, protect)

    def _advance_held(self, families: list[ChunkFamily], protect: set[int]) -> None:
        """A module's access in a backward that holds every group: what :meth:`ensure_gathered` does there, where
        no group is released (so none is gathered, prefetched or released here): the sweep moves on to the
        module's groups (reductions that are due start), and the owned families come to the device."""
        groups = {self.group_of(f) for f in families}
        top = max(self.position[g] for g in groups)
        if top > self.cursor:
            self._sweep_to(top, self._guard(groups, protect))
        self._fetch_owned(families, protect)

    def _guard(self, groups: Iterable[int], protect: set[int]) -> set[int]:
        """Families no room may be made from while ``groups`` are gathered: ``protect``, the send buffers in flight
        and every member of the groups."""
        return protect | self.pinned | {m.family_id for g in groups for m in self.members(g)}

    def _fetch_owned(self, families: list[ChunkFamily], protect: set[int]) -> None:
        for family in families:  # the owned families come to the device
            if self.owns(family):
                self.residency.fetch(family, protect=protect)

    def _sweep_to(self, index: int, protect: set[int]) -> None:
        while self.cursor < index:
            self.cursor += 1
            group = self.order[self.cursor]
            if group not in self.gathered:
                self._gather(group, protect)
            elif group in self.ahead:  # a bucket gathered it: the forward's gathers list it now, in sweep order
                self.ahead.discard(group)
                self.forward_gathers.append(group)
            if self.sweep is Sweep.BACKWARD:
                self.reducer.step(self.cursor)

    def _bucket(self, group: int) -> list[int]:
        """``group`` and the kept groups right after it in a forward sweep that share its all-gather ([Note:
        buckets of chunk groups]); decided from what every rank has the same. The group may be the one the sweep
        reaches now (``start == cursor``) or one ahead of it (a prefetch: the next group, or the next bucket's first
        when every group is kept): a rank that skipped the module before it reaches it by the sweep where a peer
        prefetched it, and both must cut the same bucket."""
        start = self.position.get(group, -1)
        if self.sweep is not Sweep.FORWARD or not self.keeping or start < self.cursor:
            return [group]  # a backward's gathers and an out-of-order one (a tied head) go alone
        bucket, size = [group], self._gather_bytes(group)
        for later in self.order[start + 1 :]:
            size += self._gather_bytes(later)
            if (
                later not in self.keeping
                or later in self.gathered
                or later in self.inflight
                or size > self.bucket_bytes
            ):
                break
            bucket.append(later)
        return bucket

    def _gather_bytes(self, group: int) -> int:
        return sum(f.param_chunk.nbytes for f in self.members(group))

    def _start_gather(self, group: int, protect: set[int]) -> GroupGather:
        residency = self.residency
        groups = self._bucket(group)
        members = [f for g in groups for f in self.members(g)]
        own = [f for f in members if self.owns(f)]
        guard = protect | self.pinned | {f.family_id for f in members}
        for family in own:
            residency.fetch(family, protect=guard)
        for family in members:
            chunk = family.param_chunk
            if not self.owns(family) and chunk.tier is not Tier.DEVICE:
                residency.ensure_device_room(chunk.nbytes, protect=guard)
                chunk.allocate(Tier.DEVICE, zero=False)
        if len(groups) == 1:  # the chunks themselves are the buffers: the send buffer stays in place until done
            self.pinned.add(own[0].family_id)
            packed = None
            buffers = [f.param_chunk.data for f in members]
        else:  # a bucket: this rank's chunks packed into its buffer (a copy: nothing needs to stay in place)
            packed = buffers = pack_bucket([f.param_chunk.data for f in own], self.rank, self.world_size)
        with profiled("pstar::all_gather"):
            work = self.comm.all_gather_chunks(buffers, self.rank)
        self.gathers += 1
        gather = GroupGather(groups, work, packed)
        for g in groups:
            self.inflight[g] = gather
        return gather

    def _gather(self, group: int, protect: set[int]) -> None:
        gather = self.inflight.get(group)
        self._finish_gather(gather if gather is not None else self._start_gather(group, protect))

    def _finish_gather(self, gather: GroupGather) -> None:
        if gather.work is not None:
            with profiled("pstar::all_gather_wait"):
                gather.work.wait()
        if gather.packed is not None:  # unpack every peer's part of the bucket into its chunks
            unpack_bucket(gather.packed, [f for g in gather.groups for f in self.members(g)], self.rank)
        for i, group in enumerate(gather.groups):
            self.inflight.pop(group, None)
            members = self.members(group)
            self.pinned.discard(members[self.rank].family_id)
            for family in members:
                if family is not members[self.rank]:
                    for record in family.records:
                        self.residency.point_at_chunk(record)
            self.gathered.add(group)
            if self.sweep is Sweep.BACKWARD:
                continue
            if i == 0 or self.position.get(group, -1) <= self.cursor:
                self.forward_gathers.append(group)
            else:
                self.ahead.add(group)  # listed when the sweep reaches it (_sweep_to)

    def _prefetch_next(self, protect: set[int]) -> None:
        """Start gathering the sweep's next group while the current one computes; in a forward that keeps every
        group, the next bucket as soon as no gather is in flight ([Note: buckets of chunk groups])."""
        if not self.prefetch_enabled or self.cursor + 1 >= len(self.order):
            return
        group = self.order[self.cursor + 1]
        if group in self.gathered or group in self.inflight:
            every = self.num_groups()
            if self.inflight or self.sweep is not Sweep.FORWARD or len(self.keeping) < every:
                return
            if len(self.gathered) == every:
                return
            # nothing is released in such a forward: the gathered groups are a prefix of the sweep
            later = next((g for g in self.order[self.cursor + 2 :] if g not in self.gathered), None)
            if later is None:
                return
            group = later
        self._start_gather(group, protect)
        self.prefetches += 1

    def plan(self, prefetch_fits: bool, keep_groups: int) -> bool:
        """After the warm-up, one collective (a MIN; the due steps negated, so their maximum): prefetch only if
        it fits the device budget on every rank, keep as many of the forward's last groups gathered into the
        backward as fit on every rank, and reduce each group at the latest step any rank found it complete at
        ([Note: the agreement in the reduction's buffer]). Returns whether prefetching is on."""
        wanted = [1 if prefetch_fits else 0, max(0, min(keep_groups, self.num_groups()))]
        wanted += [-d for d in self.reducer.schedule_wanted()]
        agreed = torch.tensor(wanted, dtype=torch.int32, device=self.device)
        work = self.comm.start_all_reduce_min(agreed)
        if work is not None:
            work.wait()
        values = agreed.tolist()
        self.prefetch_enabled = bool(values[0])
        self.keep = frozenset(self.forward_order[len(self.forward_order) - values[1] :] if values[1] else ())
        self.reducer.adopt_schedule([-v for v in values[2:]])
        return self.prefetch_enabled

    def group_bytes(self) -> int:
        """Device bytes of one group's param chunks (what a prefetch adds)."""
        return max((sum(f.param_chunk.nbytes for f in self.members(g)) for g in range(self.num_groups())), default=0)

    # ---- release ----------------------------------------------------------------------------------------
    def release_passed(self, keep: set[int] | frozenset[int] = frozenset()) -> None:
        if self.holding:  # a backward that holds every group releases them at its end
            return
        # in backward a group also stays while a slot in it waits for its final gradient (a tied weight used
        # again further down), as the original releases a remote chunk
        pending = TensorState.HOLD_AFTER_FWD if self.sweep is Sweep.BACKWARD else TensorState.COMPUTE
        kept = self.keeping if self.sweep is Sweep.FORWARD else frozenset()
        for group in sorted(self.gathered):
            if group in keep or group in self.parked or self.position.get(group, -1) >= self.cursor:
                continue
            members = self.members(group)
            if any(s.state is TensorState.COMPUTE or s.state is pending for f in members for s in f.slots):
                continue
            if group in kept:
                self.parked.add(group)
            else:
                self._release_group(group)

    def _release_group(self, group: int) -> None:
        for family in self.members(group):
            if self.owns(family):
                continue
            family.param_chunk.release()
            for record in family.records:
                self.point_at_poison(record)
        self.gathered.discard(group)

    def release_all(self) -> None:
        while self.inflight:  # never free a buffer a collective still writes
            self._finish_gather(self.inflight[min(self.inflight)])
        self.parked.clear()
        self.ahead.clear()
        for group in sorted(self.gathered):
            members = self.members(group)
            if not any(s.state is TensorState.COMPUTE for f in members for s in f.slots):
                self._release_group(group)

    # ---- gradients ([Note: the agreement in the reduction's buffer]) ---------------------------------------
    def grad_ready(self, record: ParamRecord, grad: torch.Tensor) -> None:
        """Keep a local gradient until its group's reduction (at a sweep step, or the end of the backward)."""
        if self.sweep is not Sweep.BACKWARD:
            self.begin_backward()
        self.reducer.grad_ready(record, grad, self.cursor)

    def discard(self) -> None:
        """Forget local gradients that were never reduced (zero_grad before a step)."""
        self.reducer.discard()

    @property
    def reductions(self) -> int:
        return self.reducer.reductions

    @property
    def second_rounds(self) -> int:
        return self.reducer.second_rounds

    # ---- setup -------------------------------------------------------------------------------------------
    def start(self, records: Sequence[ParamRecord], layout: tuple[int, int, int, int], detail: str) -> None:
        """Setup, before any chunk exists: every rank built the same model and takes rank 0's weights
        (:func:`~lightning_pstar.runtime.model_agreement.agree_on_model`)."""
        agree_on_model(self.comm, records, layout, detail, bucket_bytes=self.bucket_bytes)
