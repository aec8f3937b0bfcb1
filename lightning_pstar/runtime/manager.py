"""The chunk manager: a thin facade whose verbs are the steps of one iteration.

Setup has two phases so that bad input fails before anything changes: ``ChunkManager(...)`` only plans
(:func:`~lightning_pstar.runtime.setup_plan.plan_setup`, with the planner's functions);
:meth:`ChunkManager.materialise` then allocates chunks and puts every parameter into its slot
(:mod:`~lightning_pstar.runtime.materialise`).

During training the hooks (:mod:`~lightning_pstar.runtime.hooks`) and the strategy call the iteration's
verbs, in this order per micro-batch: :meth:`begin_training_batch`, per module :meth:`pre_forward` /
:meth:`post_forward`, :meth:`begin_backward`, per module :meth:`pre_backward` / :meth:`post_backward`, per
parameter :meth:`grad_ready`, :meth:`finish_backward`; then the optimizer's :meth:`step_moment` and
:meth:`end_warmup_if_recording`. One object per concern does the work: :class:`ParamTable`, :class:`Residency`,
:class:`GradStore`, the sharding (a null object on one rank), the tracer and the placement policy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch
from torch import nn

from lightning_pstar.config import NonFinite, OptimizerOverlap, OptimizerPlacement, PStarConfig
from lightning_pstar.planning.requirements import MemoryBudgetError
from lightning_pstar.report import MemoryReport
from lightning_pstar.runtime import steps_in_flight
from lightning_pstar.runtime.chunk import ChunkKind
from lightning_pstar.runtime.comm import ChunkComm, group_of
from lightning_pstar.runtime.disk_tier import DiskTier, disk_one_at_a_time, open_disk_tier
from lightning_pstar.runtime.family import (
    ChunkFamily,
    ParamRecord,
    copy_forward_writes_to_masters,
    families_of,
    move_slots,
    release_slots,
)
from lightning_pstar.runtime.grad_guard import GradGuard
from lightning_pstar.runtime.grads import GradStore
from lightning_pstar.runtime.late_gradients import forward_after_gradient
from lightning_pstar.runtime.materialise import Materialiser
from lightning_pstar.runtime.new_storage import adopt_new_storage
from lightning_pstar.runtime.outside_writes import check_outside_writes, note_versions
from lightning_pstar.runtime.pipeline import StepPipeline
from lightning_pstar.runtime.placement import PlacementPolicy
from lightning_pstar.runtime.reporting import build_report, module_names
from lightning_pstar.runtime.residency import Residency
from lightning_pstar.runtime.setup_plan import plan_setup
from lightning_pstar.runtime.sharding_factory import Sharding, make_sharding
from lightning_pstar.runtime.state import MicroBatch, Phase, TensorState, Tier
from lightning_pstar.runtime.tracer import MemoryTracer, MomentKind
from lightning_pstar.runtime.warmup import check_before_warmup_step, end_warmup

__all__ = ["ChunkFamily", "ChunkManager", "MemoryBudgetError", "MemoryReport", "ParamRecord"]

log = logging.getLogger(__name__)

_COMPUTE, _FORWARD, _BACKWARD = TensorState.COMPUTE, MomentKind.FORWARD, MomentKind.BACKWARD  # per module: no lookup
_graph_task = torch._C._current_graph_task_id  # each backward's own id (-1 outside one)
_HOLD, _HOLD_AFTER_FWD, _HOLD_AFTER_BWD = TensorState.HOLD, TensorState.HOLD_AFTER_FWD, TensorState.HOLD_AFTER_BWD
_PHASE_TRAINING, _PHASE_BACKWARD = Phase.TRAINING, Phase.BACKWARD


class ChunkManager:
    """Owns every chunk of one model and the table from parameters to slots."""

    def __init__(
        self,
        module: nn.Module,
        *,
        config: PStarConfig,
        compute_dtype: torch.dtype,
        device: torch.device,
        precision: str = "",
        world_size: int = 1,
        local_world_size: int = 1,
        accumulates: bool = False,
        comm: ChunkComm | None = None,
        policy: PlacementPolicy | None = None,
    ) -> None:
        if comm is not None and comm.world_size != world_size and world_size != 1:
            raise ValueError(f"world_size={world_size} disagrees with the communicator's {comm.world_size}")
        self.module = module
        self.config = config
        self.compute_dtype = compute_dtype
        self.mixed = compute_dtype != torch.float32
        self.device = device
        self.simulated = device.type == "cpu"
        self.precision = precision
        self.comm = comm if comm is not None else ChunkComm(rank=0, world_size=world_size)
        self.world_size = self.comm.world_size
        self.rank = self.comm.rank
        self.accumulates = accumulates  # declared at setup: mixed precision keeps an fp32 gradient sum
        self.phase = Phase.IDLE
        self.moment_chunk_bytes: dict[int, int] = {}  # moment index -> chunk bytes on the device (last seen)
        self.stationary = False  # nothing moves this iteration: [Note: stationary chunks]
        self._stepped = False  # an optimizer stepped since training started (the warm-up can end)
        self._module_names: list[str] = []  # by module index, for moment labels (built on first report)
        self._forward_versions: dict[int, list[int]] = {}  # module index -> its weights' versions at pre-forward
        self._materialised = False
        # bumped whenever weights change (optimizer step, load): a weight autograd saved by reference
        # (hooks.py, saved tensors) must read the same version in backward
        self.weights_version = 0

        self.tracer = MemoryTracer(  # residency exists by the time the tracer asks
            device,
            lambda: self.residency.stats.per_tier_bytes[Tier.DEVICE],
            lambda: self.residency.storage_ptrs(list(self.table.iter_chunks())),
        )
        plan = self.setup_plan = plan_setup(
            module, config, compute_dtype=compute_dtype, device=device, rank=self.rank, world_size=self.world_size,
            local_world_size=local_world_size, accumulates=accumulates, tracer=self.tracer, policy=policy,
        )  # fmt: skip
        self.host_params, self.layout, self.table = plan.host_params, plan.layout, plan.table
        self.residency = Residency(
            self.table.families, device=device, device_budget=plan.device_budget, host_budget=plan.host_budget,
            policy=plan.policy, min_device_bytes=plan.module_need[0], owns=lambda family: self.sharding.owns(family),
        )  # fmt: skip
        # [Note: the host need] in planning/tiers.py; the disk tier's buffers: [Note: disk families]
        self.residency.host_scratch_bytes = plan.need.scratch + plan.need.disk_buffers
        if plan.disk_plan is not None and plan.disk_plan.family_ids:  # [Note: disk families] in disk_tier.py
            self.residency.disk = open_disk_tier(plan.disk_plan, config.memory, mixed=self.mixed, device=device)
        self.residency.optimizer_tier = plan.optimizer_start
        self.residency.hybrid_optimizer = config.placement.optimizer is OptimizerPlacement.AUTO
        self.grads = GradStore(self.residency, mixed=self.mixed, simulated=self.simulated)
        # host-side optimizer steps in flight ([Note: the step pipeline] in runtime/pipeline.py)
        self.pipeline = StepPipeline()
        # optimizers told when a module's zero_grad forgot gradients ([Note: a module's zero_grad])
        self.zero_grad_listeners: list[Callable[[set[int]], None]] = []
        self.before_backward: list[Callable[[], None]] = []  # the hooks' checks at each backward's start
        self.grad_guard = GradGuard()  # [Note: gradients user code cannot see] in runtime/grad_guard.py
        self.tailing = False  # an optimizer.step() returned with steps in flight (optimizer_overlap="next_forward")
        self.recomputes = False  # a module's forward ran inside a backward ([Note: copies back inside the backward])
        self.torn: list[int] = []  # families a backward that raised had stepped inside it (a mix of two steps)
        # mixed_precision.nonfinite: a backward since the last step ran from a non-finite loss; steps not applied
        self.nonfinite_loss = False
        self.nonfinite_skipped_steps = 0
        # when room is short, steps in flight end
        self.residency.finish_stepping = lambda: steps_in_flight.finish_steps_for_room(self)
        module_groups = [
            {group_of(r.family.family_id, self.world_size) for r in records}
            for records in self.table.module_records.values()
        ]
        self.sharding: Sharding = make_sharding(
            self.table.families, self.comm, residency=self.residency, grads=self.grads, compute_dtype=compute_dtype,
            module_groups=module_groups, bucket_bytes=config.chunks.bucket_nbytes,
        )  # fmt: skip

    @property
    def disk(self) -> DiskTier | None:
        """The disk tier, when some families are on it ([Note: disk families] in ``runtime/disk_tier.py``)."""
        return self.residency.disk

    # ---- setup ----------------------------------------------------------------------------------------
    def materialise(self) -> None:
        """Allocate chunks, move or initialise every parameter into its slot and re-point the model."""
        assert not self._materialised, "materialise() runs once"
        summary, detail = self.setup_plan.agreement()  # the ranks agree on it
        self._materialiser().run(self.host_params, summary, detail)
        note_versions(self.records)  # every slot equals its master ([Note: writes outside a forward])
        if self.disk is not None:  # the last family's master written ([Note: disk families] in runtime/disk_tier.py)
            self.disk.flush_setup()
        self._materialised = True
        log.log(
            logging.INFO if self.rank == 0 else logging.DEBUG,  # the ranks agree (checked above): one says it
            "PatrickStar: %d parameters in %d chunk families of %d elements (utilisation %.1f%%)",
            self.layout.payload_elements,
            len(self.families),
            self.layout.chunk_size,
            100 * self.layout.utilisation,
        )

    def _materialiser(self) -> Materialiser:
        return Materialiser(
            self.module,
            self.table,
            residency=self.residency,
            sharding=self.sharding,
            compute_dtype=self.compute_dtype,
            frozen_master=self.config.mixed_precision.frozen_master,
            on_write=self._weights_changed,
        )

    def _weights_changed(self) -> None:
        self.weights_version += 1
        self.residency.drop_host_copies()

    def fill_slot(self, record: ParamRecord, value: torch.Tensor) -> None:
        """Write a weight into the record's param slot and fp32 master (a load)."""
        self.finish_steps()
        self._materialiser().fill_slot(record, value)

    def add_optimizer_chunks(self, kinds: Sequence[ChunkKind], families: Sequence[ChunkFamily] | None = None) -> None:
        """Allocate zeroed optimizer-state chunks (e.g. EXP_AVG, EXP_AVG_SQ) for every trainable family of
        ``families`` (default: all; an optimizer passes the families of its parameters) this rank owns."""
        wanted = [*kinds, ChunkKind.GRAD] if not self.mixed or self.accumulates else list(kinds)
        owned = [f for f in (self.families if families is None else families) if f.trainable and self.owns(f)]
        self.residency.add_optimizer_chunks(owned, wanted)

    # ---- the table ------------------------------------------------------------------------------------
    @property
    def families(self) -> list[ChunkFamily]:
        return self.table.families

    @property
    def records(self) -> list[ParamRecord]:
        return self.table.records

    def record_of(self, param: torch.Tensor) -> ParamRecord:
        """The side-table entry of ``param``."""
        return self.table.record_of(param)

    def is_host_param(self, param: torch.Tensor) -> bool:
        """Whether ``param`` lives on HOST outside the chunks (``cpu_embedding``)."""
        return any(param is p for p in self.host_params.values())

    def owns(self, family: ChunkFamily) -> bool:
        """Whether this rank keeps ``family``'s chunks (always, on one rank)."""
        return self.sharding.owns(family)

    # ---- residency (used by the optimizer step, loads and tests) ---------------------------------------
    @property
    def stats(self):  # type: ignore[no-untyped-def]  # TransferStats
        return self.residency.stats

    @property
    def optimizer_tier(self) -> Tier:
        return self.residency.optimizer_tier

    # ---- gradients --------------------------------------------------------------------------------------
    @property
    def micro_batch(self) -> MicroBatch:
        return self.grads.micro_batch

    @micro_batch.setter
    def micro_batch(self, value: MicroBatch) -> None:
        self.grads.micro_batch = value

    def _run_sum_aside(self, task: Callable[[], None]) -> Future[None]:
        """Run a family's gradient sum on a host lane ([Note: sums beside the backward] in grad_sums.py), counted."""
        self.pipeline.times.sums_in_backward += 1
        return self.pipeline.run_aside(task)

    def slot_holds_weight(self, record: ParamRecord) -> None:
        """The param slot holds the weight again (the optimizer or a load wrote it): the parameter points at it."""
        self.grads.weight_to_param_slot(record)

    # ---- the iteration's verbs --------------------------------------------------------------------------
    def begin_training_batch(self) -> None:
        """A training micro-batch starts; the first one of the run starts the warm-up trace."""
        self.finish_steps(keep_tail=True)  # optimizer_overlap="next_forward": its modules wait for their families
        self.finish_backward()
        self.end_warmup_if_stepped()
        self.residency.close_step()
        self.residency.begin_batch(warmed_up=self.tracer.warmed_up)
        # gradients no step consumed yet (manual accumulation); a family still stepping has consumed its own
        stepping = self.residency.stepping
        self.grads.carry_over(
            [r for r in self.records if r.family.family_id not in stepping] if stepping else self.records
        )
        self.phase = Phase.TRAINING
        self.sharding.begin_pass()
        if not self.tracer.warmed_up and not self.tracer.recording:
            self.tracer.start_recording()
        else:
            self.tracer.start_iteration()
        warmed_up = self.tracer.warmed_up and not self.sharding.distributed
        # [Note: sums beside the backward] in grad_sums.py: after the warm-up (its trace measures the serial way),
        # at one rank, where the coming step runs pipelined
        overlap = self.config.placement.optimizer_overlap is not OptimizerOverlap.OFF and self.pipeline.pipelined_next
        self.grads.sums.lane = self._run_sum_aside if warmed_up and overlap else None
        self.stationary = self.tracer.untraced = warmed_up and self.residency.nothing_moves(
            self.tracer.trace.peak_non_model
        )

    def pre_forward(self, records: Sequence[ParamRecord], index: int) -> None:
        """Before module ``index``'s forward: its chunks resident, its slots ``COMPUTE``."""
        # a forward without autograd (an evaluation inside a training step) is not a moment of the iteration
        moment = (_FORWARD, index) if torch.is_grad_enabled() else None
        in_backward = _graph_task() >= 0
        if in_backward:  # recomputed inside a backward (activation checkpointing)
            self.recomputes = True
            steps_in_flight.refuse_early_read(self, records)
        if self.grads.held:  # [Note: a forward after the gradient]
            forward_after_gradient(self, records, in_backward=in_backward)
        if self.residency.kept_values:  # [Note: parameters given new storage]
            adopt_new_storage(self, records)
        else:
            with torch._C.DisableTorchFunctionSubclass():  # the quick test per parameter: its address (no wait)
                moved_any = any(record.param.data_ptr() != record.pointed for record in records)
            if moved_any:
                adopt_new_storage(self, records)
        if self.mixed and not self.sharding.distributed:  # [Note: writes outside a forward]
            check_outside_writes(records, disk=self.disk, in_flight=self.pipeline.in_flight)
        self.access(records, _COMPUTE, moment, module=index)
        if self.residency.kept_values:  # given while its family's step was in flight, which access waited for
            adopt_new_storage(self, records)
        if self.mixed:  # an in-place write to a weight during forward must reach its fp32 master
            self._forward_versions[index] = [r.param._version for r in records]

    def post_forward(self, records: Sequence[ParamRecord], index: int, *, backward_follows: bool) -> None:
        """After a module's forward: its chunks may move again (until its backward, if one follows)."""
        before = self._forward_versions.pop(index, None) if self.mixed else None
        if before is not None and before != [r.param._version for r in records]:
            written = [r for r, v in zip(records, before, strict=True) if r.param._version != v]
            if self.residency.disk is None or self.sharding.distributed:
                copy_forward_writes_to_masters(written, distributed=self.sharding.distributed)
            else:  # family by family: a master on disk is read and written back once ([Note: disk families])
                with disk_one_at_a_time(self.residency.disk, write=True, kinds=(ChunkKind.MASTER,)) as need:
                    for record in sorted(written, key=lambda r: r.family.family_id):
                        need(record.family)
                        copy_forward_writes_to_masters([record], distributed=False)
        if self.mixed:
            note_versions(records)  # the slots equal their masters (a forward's writes reached them)
        release_slots(records, _HOLD_AFTER_FWD if backward_follows else _HOLD)  # what release() does
        if self.sharding.distributed:  # one rank releases nothing
            self.sharding.release_passed()

    def note_loss(self, loss: torch.Tensor) -> None:
        """A backward runs from ``loss``: remember whether it was finite, for the coming step's non-finite check
        (``mixed_precision.nonfinite``; one scalar read, before any gradient exists)."""
        if self.config.mixed_precision.nonfinite is not NonFinite.IGNORE and not bool(torch.isfinite(loss).all()):
            self.nonfinite_loss = True

    def guard_user_grads(self) -> None:
        """User code may use ``p.grad`` until the step: give it stand-ins that refuse ([Note: gradients user code
        cannot see] in runtime/grad_guard.py)."""
        self.remove_grad_guard(check=False)  # stale stand-ins of the last step first (Fabric)
        self.grad_guard.install((r.names[0], r.param) for r in self.records if r.trainable)

    def begin_backward(self) -> None:
        """Every rank starts the backward of a training pass (the strategy's ``pre_backward``)."""
        for check in self.before_backward:
            check()
        self.remove_grad_guard()
        with torch.no_grad():
            self.sharding.begin_backward()

    def pre_backward(self, records: Sequence[ParamRecord], index: int) -> None:
        """Before module ``index``'s backward: its chunks resident again (same storage)."""
        if self.pipeline.early:
            steps_in_flight.refuse_early_read(self, records)
        # a use whose gradient another backward landed first (a module used plainly and under reentrant activation
        # checkpointing, a second backward through a retained graph): [Note: a forward after the gradient]
        if self.grads.held:
            forward_after_gradient(self, records, in_backward=True)
        self.access(records, _COMPUTE, (_BACKWARD, index))

    def access(
        self,
        records: Sequence[ParamRecord],
        new_state: TensorState,
        moment: tuple[MomentKind, int] | None = None,
        *,
        module: int | None = None,
    ) -> None:
        """Make the chunks of ``records`` resident and move their slots to ``new_state``.

        ``moment`` names the point of the iteration (for the warm-up trace and the plan that follows it);
        ``module`` the index of the module whose forward needs them (ZeRO: its place in the sweep).
        """
        residency = self.residency
        if self.tailing:  # optimizer_overlap="next_forward": this module waits for its own families' steps
            steps_in_flight.wait_for_families(self, records)
        if self.stationary and not residency.stats.param_chunks_on_host:  # [Note: stationary chunks]
            if residency.step_open:
                residency.close_step()
            move_slots(records, new_state)
            return
        cached = self.table.families_of_list.get(id(records))  # computed once for the lists the hooks pass
        families, fids = cached[1:] if cached is not None and cached[0] is records else families_of(records)
        if residency.step_open:
            residency.close_step()  # a module runs: any optimizer step is over
        phase = self.phase
        in_backward = phase is _PHASE_BACKWARD
        if moment is not None and moment[0] is _BACKWARD:
            in_backward = True
            if phase is _PHASE_TRAINING:
                self.phase = phase = _PHASE_BACKWARD
        training = phase is _PHASE_TRAINING or phase is _PHASE_BACKWARD
        # without a device budget no room is ever made: a resident chunk needs neither the tide nor a fetch
        bounded = residency.device_budget is not None
        protect = set(fids)
        cursor = -1  # the trace moment this access is, when the iteration follows the trace
        if moment is not None and training:
            cursor = self.tracer.moment(moment[0], moment[1], fids)
            if bounded:
                residency.ensure_device_room(0, protect=protect)  # the tide: the room may have shrunk now
        if self.sharding.distributed:
            self.sharding.ensure_gathered(families, protect, in_backward=in_backward, module=module)
        else:  # one rank owns every family
            for family in families:
                if bounded or not family.param_chunk.ready:
                    residency.fetch(family, protect=protect)
        move_slots(records, new_state)
        if training:
            if cursor >= 0:
                self.moment_chunk_bytes[cursor] = residency.device_used()
            residency.prefetch()

    def release(self, records: Sequence[ParamRecord], new_state: TensorState) -> None:
        """Move slots out of ``COMPUTE``; their chunks become evictable (remote ones: released) once no
        slot computes."""
        release_slots(records, new_state)
        if self.sharding.distributed:  # one rank releases nothing
            self.sharding.release_passed()

    def post_backward(self, records: Sequence[ParamRecord]) -> None:
        """A module's backward is done: frozen slots go to ``HOLD``, trainable ones still waiting for their
        final gradient (tied weights, parameters used again earlier in forward) to ``HOLD_AFTER_FWD``."""
        release_slots(records, _HOLD_AFTER_FWD, frozen=_HOLD)
        if self.sharding.distributed:  # one rank releases nothing
            self.sharding.release_passed()

    def grad_ready(self, record: ParamRecord, grad: torch.Tensor) -> None:
        """Store the final gradient of ``record`` for this backward into the chunks."""
        if torch.is_grad_enabled():  # autograd runs gradient hooks without grad mode unless create_graph
            with torch.no_grad():
                self.grad_ready(record, grad)
            return
        if self.sharding.distributed:
            self.sharding.grad_ready(record, grad)
        else:  # what the one-rank sharding does, one call less per parameter
            self.grads.store_local(record, grad)

    def finish_backward(self) -> None:
        """Slots still in use or waiting for a backward go back to ``HOLD`` (after backward, before a batch).

        Slots in ``HOLD_AFTER_BWD`` keep their gradient for the coming optimizer step.
        """
        if self.phase is Phase.BACKWARD:
            self.phase = Phase.TRAINING
        self.grads.settle()  # a backward that raised left gradients waiting ([Note: gradients land per family])
        if self.sharding.distributed:  # one rank has nothing to reduce
            with torch.no_grad():
                self.sharding.flush()  # reduce groups whose parameters did not all receive a gradient
        unsettled = (_COMPUTE, _HOLD_AFTER_FWD)
        for record in self.records:
            if record.slot.state in unsettled:
                record.set_state(_HOLD)

    def end_training(self) -> None:
        """Training micro-batches are over for now (evaluation, or the end of fit): nothing is traced."""
        self.remove_grad_guard(check=False)
        self.finish_steps()
        self.finish_backward()
        if self.phase.training:
            self.end_warmup_if_stepped()
            self.residency.begin_batch(warmed_up=self.tracer.warmed_up)
        self.residency.close_step()
        self.phase = Phase.IDLE
        self.stationary = self.tracer.untraced = False

    def begin_eval_pass(self) -> None:
        """Every rank starts an evaluation step (validation, test, predict)."""
        self.remove_grad_guard(check=False)
        self.finish_steps()
        self.phase = Phase.EVAL
        self.sharding.begin_pass(training=False)

    def end_eval_pass(self) -> None:
        """Every rank ended an evaluation step: the remote chunks it gathered go."""
        self.sharding.flush()
        self.phase = Phase.IDLE

    def remove_grad_guard(self, records: Sequence[ParamRecord] | None = None, *, check: bool = True) -> None:
        """Take the ``p.grad`` stand-ins of ``records`` (default: all) away; gradients user code dropped meanwhile
        are forgotten ([Note: gradients set to None] in runtime/grad_guard.py): before a step, the engine's copy in
        the chunks; after a step, the optimizers hear that their parameters were zeroed."""
        ids = None if records is None else {id(r.param) for r in records}
        dropped = self.grad_guard.remove(ids, check=check)
        if not dropped:
            return
        by_id = self.table.by_id
        stale = {by_id[id(p)].index for p, after_step in dropped if after_step and id(p) in by_id}
        live = [by_id[id(p)] for p, after_step in dropped if not after_step and id(p) in by_id]
        if stale:
            for listener in self.zero_grad_listeners:
                listener(stale)
        if live:
            self.discard_grads(live)

    def guard_stale_grads(self, records: Sequence[ParamRecord]) -> None:
        """Under Fabric, after a step: stand-ins for the gradients it consumed, until ``zero_grad`` ([Note:
        gradients set to None] in runtime/grad_guard.py)."""
        self.grad_guard.install(((r.names[0], r.param) for r in records if r.trainable), after_step=True)

    def module_zero_grad(self, module: torch.nn.Module) -> None:
        """``module.zero_grad()`` (a user's loop, Lightning's ``on_validation_model_zero_grad``): forget the gradients
        of the module's parameters, as torch sets their ``p.grad`` to None ([Note: a module's zero_grad] in
        module_zero_grad.py)."""
        by_id = self.table.by_id
        records = [by_id[id(p)] for p in module.parameters() if id(p) in by_id and by_id[id(p)].param is p]
        if not records:
            return
        self.nonfinite_loss = False
        self.discard_grads(records)  # a family whose step is in flight consumed its gradients: its job forgets them
        indices = {r.index for r in records}
        for listener in self.zero_grad_listeners:
            listener(indices)

    def discard_grads(self, records: Sequence[ParamRecord] | None = None) -> None:
        """Forget the gradients of ``records`` (default: all; an optimizer's ``zero_grad`` passes its own);
        weights overwritten by gradients are restored from the masters. A family whose step is in flight consumed
        its gradients: its job forgets them when it finishes ([Note: the step pipeline])."""
        self.remove_grad_guard(records, check=False)
        self.sharding.discard()
        records = self.records if records is None else records
        stepping = self.residency.stepping
        self.grads.discard([r for r in records if r.family.family_id not in stepping] if stepping else records)

    # ---- the optimizer step and the end of the warm-up -------------------------------------------------
    def _check_host_after_warmup(self, room: int) -> None:
        assert self.residency.device_budget is not None
        self.setup_plan.check_host_after_warmup(
            room=room, device_budget=self.residency.device_budget, host_budget=self.residency.host_budget
        )

    def step_moment(self) -> None:
        """The optimizer step is a moment of its own (it accesses every trainable family). At the warm-up's, the
        moments recorded so far must fit the device budget: refused before the step changes anything."""
        self.grads.settle()
        training, recording = self.phase.training, self.tracer.recording
        fids = tuple(f.family_id for f in self.families if f.trainable)
        if training and recording:
            self.tracer.moment(MomentKind.STEP, 0, fids)  # closes (measures) the last backward moment
            check_before_warmup_step(self.tracer, self.residency, self.comm, host_check=self._check_host_after_warmup)
        self.residency.open_step(record=recording)
        if training:
            self.residency.note_step()
            if not recording:
                self.tracer.moment(MomentKind.STEP, 0, fids)
            if self.stationary:  # no moment was followed: each held what the device holds now
                used = self.residency.device_used()
                self.moment_chunk_bytes.update((i, used) for i in range(len(self.tracer.trace.moments)))
            elif self.tracer.warmed_up and self.tracer.matches and self.tracer.cursor >= 0:
                self.moment_chunk_bytes[self.tracer.cursor] = self.residency.device_used()

    def optimizer_stepped(self) -> None:
        """An optimizer stepped: the warm-up iteration ends before the next micro-batch (an iteration may hold
        several steps: one per optimizer of a GAN-style recipe)."""
        self._stepped = True

    def end_warmup_if_stepped(self) -> None:
        """Close the warm-up once its iteration had an optimizer step (at the next batch or the end of training)."""
        if self._stepped:
            self.end_warmup_if_recording()

    def end_warmup_if_recording(self) -> None:
        """Close the trace, check the budget, plan optimizer placement (see ``runtime/warmup.py``)."""
        if self.tracer.recording:
            end_warmup(self.tracer, self.residency, self.sharding)

    # ---- reporting ------------------------------------------------------------------------------------
    def end_backward_steps(self) -> None:
        """The backward is over: steps in flight may copy back (``steps_in_flight.end_backward_steps``)."""
        steps_in_flight.end_backward_steps(self)

    def finish_steps(self, *, keep_tail: bool = False) -> None:
        """Finish every host-side optimizer step in flight (``steps_in_flight.finish_steps``)."""
        steps_in_flight.finish_steps(self, keep_tail=keep_tail)

    def memory_report(self) -> MemoryReport:
        if not self._module_names:
            self._module_names = module_names(self.module, self.table)
        return build_report(
            table=self.table,
            layout=self.layout,
            residency=self.residency,
            tracer=self.tracer,
            comm=self.comm,
            sharding=self.sharding,
            precision=self.precision,
            moment_chunk_bytes=self.moment_chunk_bytes,
            names=self._module_names,
            pipeline=self.pipeline,
            overlap=self.config.placement.optimizer_overlap.value,
            nonfinite_skipped_steps=self.nonfinite_skipped_steps,
        )
