"""Chunked optimizers: the user's Adam, AdamW or SGD, stepped family by family on the chunks.

:class:`ChunkedOptimizer` is a real :class:`torch.optim.Optimizer`: torch's constructor builds its internals
(hook tables, ``state``, the step wrapper that runs step hooks), so every hook registered on it behaves as
on torch's own optimizers. Its ``param_groups`` are the user's optimizer's list, so LR schedulers created in
``configure_optimizers`` change the learning rate this optimizer uses at every step. The arithmetic is
torch's fused kernels (see :mod:`lightning_pstar.optim.kernels`), run on slot views of the fp32 master,
gradient and state chunks; the state dict layer is :mod:`lightning_pstar.optim.state_dict`.

A step runs one of three paths per parameter set, all with the same kernels (the first two are the serial step
of one family, :mod:`lightning_pstar.optim.serial_step`; its pipelined form is :mod:`lightning_pstar.optim.host_step`):

- whole family (Adam, every record holding exactly this micro-batch's gradient, slots in record order):
  one gradient conversion and one fused call per param group for the whole chunk range;
- record by record (the rest: accumulated or missing gradients, SGD);
- host-resident parameters (``cpu_embedding``), whose state lives beside them in an ordinary dict.

What the setup and a step refuse, before anything changes, is :mod:`lightning_pstar.optim.step_checks`.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.optim import Optimizer

import lightning_pstar.optim.kernels as kernels
import lightning_pstar.optim.step_checks as step_checks
from lightning_pstar.config import NonFinite
from lightning_pstar.optim.grads import family_grads, global_norm, host_grads
from lightning_pstar.optim.host_step import host_job
from lightning_pstar.optim.overlap import StepOverlap
from lightning_pstar.optim.serial_step import SerialFamilyStep, step_host_params
from lightning_pstar.optim.state_dict import ChunkedStateDict, OptimizerBook, ReadTensors
from lightning_pstar.optim.user_optimizer import GroupLayout, redirect_user_optimizer, share_hooks
from lightning_pstar.runtime.chunk import ChunkKind
from lightning_pstar.runtime.disk_tier import DiskTier
from lightning_pstar.runtime.family import ChunkFamily, ParamRecord
from lightning_pstar.runtime.grad_guard import GradientsInChunksError
from lightning_pstar.runtime.manager import ChunkManager
from lightning_pstar.runtime.new_storage import adopt_new_storage
from lightning_pstar.runtime.pipeline import HostJob

__all__ = ["ChunkedOptimizer", "GradientPolicy", "NonFiniteStepError", "SUPPORTED_OPTIMIZERS", "StepResult"]

log = logging.getLogger(__name__)

SUPPORTED_OPTIMIZERS: tuple[type[Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


class NonFiniteStepError(FloatingPointError):
    """A step was not applied because the loss or the gradients were not finite (``mixed_precision.nonfinite``)."""


@dataclass(kw_only=True)
class GradientPolicy:
    """What to do to the gradients before the update: set by the precision plugin every step."""

    inv_scale: float = 1.0  # 1 / loss scale (fp16)
    check_finite: bool = False  # fp16: skip the step on inf/nan
    clip_norm: float | None = None
    clip_value: float | None = None


@dataclass
class StepResult:
    """What the last :meth:`ChunkedOptimizer.step` did."""

    skipped: bool = False  # an inf/nan gradient skipped the update
    total_norm: float | None = None  # the global gradient norm, when clipping by norm


@dataclass
class _ReadNorm:
    """What :meth:`ChunkedOptimizer.gradient_norm` read, for the coming step to use as it is (not read again)."""

    on_host: dict[int, torch.Tensor]  # unscaled gradients of host-resident parameters (averaged over ranks)
    finite: bool
    total: torch.Tensor | None


class _StatesInChunks(defaultdict):  # torch's type for Optimizer.state
    """``optimizer.state`` of a :class:`ChunkedOptimizer`: the states live in chunks, so a read of a parameter's
    entry (``optimizer.state[p]``, ``.get(p)``) is refused with a HINT where torch's empty default would be
    silently wrong (a monitor of Adam moments reading nothing). Iteration sees no entry, as before."""

    def __missing__(self, key: Any) -> Any:
        raise RuntimeError(
            "PatrickStar keeps optimizer states (e.g. Adam's exp_avg) in its chunks, not in `optimizer.state`."
            " HINT: read them with `optimizer.state_dict()['state']` (torch's layout, by parameter index, fp32 on"
            " CPU, consolidated from every rank)."
        )

    def get(self, key: Any, default: Any = None) -> Any:
        if isinstance(key, torch.Tensor):
            self.__missing__(key)
        return super().get(key, default)


class ChunkedOptimizer(Optimizer):
    """Steps ``optimizer``'s hyper-parameters on the chunks of ``manager``."""

    def __init__(self, optimizer: Optimizer, manager: ChunkManager) -> None:
        step_checks.check_supported(optimizer, SUPPORTED_OPTIMIZERS)
        step_checks.check_options(optimizer, manager)
        # torch's constructor builds the internals (it adds copies of the groups through add_param_group, which
        # is open only while it runs); then the user's own list replaces them, so schedulers act here
        self._adding_initial_groups = True
        super().__init__([dict(group) for group in optimizer.param_groups], optimizer.defaults)
        self._adding_initial_groups = False
        self.param_groups = optimizer.param_groups
        share_hooks(self, optimizer)  # [Note: the user's own optimizer] in optim/user_optimizer.py
        self._layout = GroupLayout(self.param_groups)
        self.state = _StatesInChunks(dict)
        self._user_optimizer = optimizer
        self._manager = manager
        self.gradient_policy = GradientPolicy()
        self.last_step = StepResult()
        self._applied_steps = 0  # steps that changed the weights (the non-finite check names the next one)
        self._read_norm: _ReadNorm | None = None  # set by gradient_norm, used by the next step
        # the last step zeroed the gradients and no zero_grad came since ([Note: gradients end with the step]); a
        # one-element list, shared with the copies of this object's __dict__ that LightningOptimizer makes (its
        # zero_grad is this class's, run with the copy as self)
        self._zeroed_by_step = [False]
        self._zeroed_since_step: set[int] = set()  # records a module's zero_grad or p.grad = None zeroed since (shared)
        self._book = OptimizerBook(is_adam=isinstance(optimizer, torch.optim.Adam))  # AdamW subclasses Adam
        self._frozen: list[ParamRecord] = []  # parameters in the groups that were frozen at setup
        self._state_io = ChunkedStateDict(manager, self._book, self.param_groups)
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if manager.is_host_param(p):
                    self._book.host_group[id(p)] = gi
                    continue
                record = manager.record_of(p)
                if record.trainable:
                    self._book.group_of[record.index] = gi
                else:
                    self._frozen.append(record)
        # this optimizer steps and zeroes only its own parameters (several optimizers may share one model)
        self._records = [r for r in manager.records if r.index in self._book.group_of]
        manager.zero_grad_listeners.append(self._module_zeroed)  # [Note: a module's zero_grad]
        own = {r.family.family_id for r in self._records}
        self._families = [f for f in manager.families if f.family_id in own]
        self._own_ids = own
        self._serial = SerialFamilyStep(self, manager, self._book)  # a family's step where no host job runs
        self.overlap = StepOverlap(self, manager)  # the schedule, the step inside the backward, the tail
        kinds = [ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ] if self._book.is_adam else []
        self._momentum = not self._book.is_adam and any(g["momentum"] != 0 for g in self.param_groups)
        if self._momentum:
            kinds = [ChunkKind.EXP_AVG]
        self._kept_zeros: set[int] = set()  # records whose p.grad zero_grad(set_to_none=False) kept as zeros
        self._state_io._has_momentum = self._momentum
        # loaded groups follow the optimizer class's own rules, as torch's load_state_dict applies them (its
        # __setstate__: AdamW keeps decoupled weight decay whatever a loaded Adam group said)
        self._state_io._normalise_groups = lambda: type(optimizer).__setstate__(
            optimizer, {"param_groups": optimizer.param_groups}
        )
        self._stepped_grads: set[int] = set()  # records with a gradient at the last step (torch's p.grad stays)
        manager.add_optimizer_chunks(kinds, self._families)
        redirect_user_optimizer(optimizer, self)

    @property
    def user_optimizer(self) -> Optimizer:
        """The optimizer ``configure_optimizers`` returned (its param_groups are shared with this one)."""
        return self._user_optimizer

    @property
    def optimizer(self) -> Optimizer:
        """The user's optimizer, under the name wrapping optimizers give it (DeepSpeed's, ``LightningOptimizer``):
        ``LearningRateMonitor`` names and matches optimizers through it (otherwise it logs this wrapper as one
        more optimizer, ``lr-ChunkedOptimizer``, beside the user's)."""
        return self._user_optimizer

    # ---- the step ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._refuse_changes_since_setup()
        # p.grad stand-ins ([Note: gradients user code cannot see]); gradients user code set to None are not stepped
        self._manager.remove_grad_guard(self._records)
        with torch._C.DisableTorchFunctionSubclass():  # a parameter parked by a step in flight is read too
            assigned = [r.names[0] for r in self._records if r.param.grad is not None]  # no guard was in place
        if assigned:
            with torch._C.DisableTorchFunctionSubclass():
                for record in self._records:
                    record.param.grad = None
            raise GradientsInChunksError(
                f"PatrickStar keeps gradients in its chunks, not in `p.grad`: `p.grad` of {assigned[:3]} was assigned"
                " (no backward ran since the last step, e.g. gradients from torch.autograd.grad), and the step would"
                " not read it. Nothing was stepped. HINT: compute gradients with `loss.backward()` (Lightning:"
                " `self.manual_backward(loss)`, Fabric: `fabric.backward(loss)`); for a gradient built by hand, add it"
                " to the loss instead (e.g. `(p * g).sum()`)."
            )
        try:
            self._step()
        finally:
            self.overlap.step_ended()
        return loss

    def _step(self) -> None:
        # LR schedulers created on the user's optimizer check that its step ran before theirs
        self._user_optimizer._opt_called = True  # type: ignore[attr-defined]
        manager = self._manager
        manager.step_moment()
        early = set(manager.grads.stepped)
        leftover = set(manager.pipeline.family_ids) - early  # the last step's tail no module waited for
        if leftover:  # before reading gradients: each still holds the last step's until its job ends
            manager.pipeline.drain(only=leftover)
        unfrozen = [r for r in self._frozen if r.param.requires_grad]
        if unfrozen:
            step_checks.refuse_unfrozen(unfrozen)
        families = self._families_with_grads()
        if self._zeroed_by_step[0] and families:
            step_checks.refuse_sum_across_steps(families)
        if self._zeroed_by_step[0] and not families and not early:
            with torch._C.DisableTorchFunctionSubclass():
                host_grads = any(p.grad is not None for p in self._host_params())
            if not host_grads:
                step_checks.refuse_step_again(self._records)
        # a weight given new storage since the backward is what this step updates ([Note: parameters given new
        # storage] in runtime/new_storage.py)
        adopt_new_storage(manager, [r for f in families if f.family_id not in early for r in f.records])
        with torch.profiler.record_function("pstar::optimizer_step"):
            self.last_step = StepResult()
            read, self._read_norm = self._read_norm, None
            on_host = read.on_host if read is not None else self._host_grads()
            coef = self._clip_coefficient(families, on_host, read)
            if coef is not None and self._nonfinite(families):
                return
            if coef is None:
                assert not early, "PatrickStar internal error: a step inside the backward was skipped"
                self.last_step = StepResult(skipped=True)
                self._zero_after_step(consumed=bool(families or on_host))
                return
            assert coef == 1.0 or not early, "PatrickStar internal error: a step inside the backward needed clipping"
            try:
                self._step_families([f for f in families if f.family_id not in early], coef)
            except BaseException:
                manager.finish_steps()
                raise
            if self.overlap.schedule.tail:
                self.overlap.leave_in_flight()
            else:
                manager.finish_steps()  # the jobs in flight end before anything else runs
            manager.weights_version += 1  # weights autograd saved by reference are stale now
            self._applied_steps += 1
            step_host_params(self._book, self.param_groups, on_host, coef, self.gradient_policy.clip_value)
            self._zero_after_step(consumed=bool(families or on_host or early))

    def _refuse_changes_since_setup(self) -> None:
        """Raise, before anything changes, for what the step cannot honour since setup: param groups changed
        ([Note: the user's own optimizer]), SGD momentum turned on where the run has no momentum buffers, or a
        parameter whose gradient ``zero_grad(set_to_none=False)`` kept as zeros and that got none since (torch
        steps it with a zero gradient, moving it by momentum and weight decay)."""
        self._layout.check()
        step_checks.refuse_unsupported_flags(self.param_groups)  # refused at setup too: set since then
        if not self._book.is_adam and not self._momentum:
            step_checks.refuse_momentum_turned_on(self.param_groups)
        self._stepped_grads.clear()  # shared with LightningOptimizer's copies of __dict__: changed in place
        self._stepped_grads.update(r.index for r in self._records if r.has_grad)
        if self._kept_zeros:
            kept = self._kept_zeros
            step_checks.refuse_kept_zeros(
                [r for r in self._records if r.index in kept and r.index not in self._stepped_grads]
            )

    def _nonfinite(self, families: list[ChunkFamily]) -> bool:
        """``mixed_precision.nonfinite``: whether this step must not be applied, because a backward since the last
        step ran from a non-finite loss or the global norm the step computed anyway (clipping by norm) is not
        finite. Then the gradients are forgotten and, under "skip", the step is counted; under "raise" an error
        names the step and the first parameters whose gradients are not finite. 16-mixed keeps loss scaling's own
        rule (its overflow check skips the step and lowers the scale), as does "ignore" (plain Lightning's)."""
        manager = self._manager
        policy = manager.config.mixed_precision.nonfinite
        if policy is NonFinite.IGNORE or self.gradient_policy.check_finite:
            return False
        total = self.last_step.total_norm
        if not manager.nonfinite_loss and (total is None or math.isfinite(total)):
            return False
        assert not manager.grads.stepped, "PatrickStar internal error: a step inside the backward was not finite"
        names = self._nonfinite_names(families) if policy is NonFinite.RAISE else []
        what = "the loss" if manager.nonfinite_loss else f"the global gradient norm ({total})"
        self.last_step = StepResult(skipped=True, total_norm=total)
        self._zero_after_step()
        if policy is NonFinite.SKIP:
            manager.nonfinite_skipped_steps += 1
            log.warning("PatrickStar: %s was not finite; optimizer step %d was skipped.", what, self._applied_steps)
            return True
        shown = ", ".join(f"'{n}'" for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise NonFiniteStepError(
            f"PatrickStar: {what} was not finite at optimizer step {self._applied_steps} (counting from 0), so the"
            " step was not applied: weights and optimizer states are those of the step before."
            + (f" Non-finite gradients: {shown}." if names else " Every gradient was finite.")
            + " HINT: resume from the last checkpoint (lower the learning rate, check the data for inf/nan), or set"
            " mixed_precision.nonfinite='skip' to skip such steps and go on, or 'ignore' to apply them as plain"
            " Lightning does."
        )

    def _nonfinite_names(self, families: list[ChunkFamily]) -> list[str]:
        """Names of the parameters whose gradient holds an inf or nan (family by family: read only on failure)."""
        manager = self._manager
        names = []
        for family in families:
            grads = family_grads(family, self._book.group_of, mixed=manager.mixed, inv_scale=1.0)
            by_index = {r.index: r for r in family.records}
            names += [by_index[i].slot.name for i, g in grads.items() if not bool(torch.isfinite(g).all())]
        return names

    def _step_families(self, families: list[ChunkFamily], coef: float) -> None:
        """Step ``families``: host-side ones through the pipeline where ``optimizer_overlap`` allows (the step
        pipeline's workers), the rest here, serially; the caller finishes the jobs."""
        pipelined = self.overlap.schedule.pipelined
        disk = self._manager.disk
        for family in families:
            if pipelined and disk is not None and disk.holds(family) and not disk.free_sets:
                self._finish_oldest_disk_job(disk)  # its buffer set takes the next disk family
            job = self._host_job(family, coef) if pipelined else None
            if job is not None:
                self._manager.pipeline.submit(job)
            else:
                self._serial.step_family(family, coef)

    def _finish_oldest_disk_job(self, disk: DiskTier) -> None:
        """Finish the disk family's job submitted first (its write-back included): all buffer sets are lent."""
        pipeline = self._manager.pipeline
        oldest = next((fid for fid in pipeline.family_ids if fid in disk.family_ids), None)
        if oldest is not None:
            pipeline.wait(oldest)

    def _host_job(self, family: ChunkFamily, coef: float) -> HostJob | None:
        """The pipelined host step of ``family`` (whole-family Adam), or None where the serial step runs."""
        if not self._book.is_adam:
            return None
        plan = self._serial.whole_family_plan(family)
        if plan is None:
            return None
        manager = self._manager
        policy = self.gradient_policy
        return host_job(
            manager,
            family,
            plan,
            groups=self.overlap.groups(),
            steps_of=lambda: [self._book.step_tensor(r, torch.device("cpu")) for r in family.records],
            inv_scale=policy.inv_scale,
            coef=coef,
            clip_value=policy.clip_value,
            streams=manager.pipeline.streams(manager.device),
        )

    def step_in_backward(self) -> bool:
        """Arm the coming backward to start host-side family steps ([Note: stepping inside the backward] in
        ``optim/overlap.py``); returns whether it is armed."""
        self._layout.check()  # before any family steps: a change of groups is refused with nothing stepped
        return self.overlap.arm_in_backward()

    def norms_in_backward(self) -> bool:
        """Arm the coming backward to compute host-side families' gradient norms as their gradients land
        ([Note: gradient norms inside the backward] in ``optim/overlap.py``); returns whether it is armed."""
        return self.overlap.arm_norms_in_backward()

    def _families_with_grads(self) -> list[ChunkFamily]:
        return [f for f in self._families if any(r.has_grad for r in f.records if r.index in self._book.group_of)]

    def _host_grads(self) -> dict[int, torch.Tensor]:
        return host_grads(self._host_params(), self._manager.comm, self.gradient_policy.inv_scale)

    def _clip_coefficient(
        self, families: list[ChunkFamily], on_host: dict[int, torch.Tensor], read: _ReadNorm | None
    ) -> float | None:
        """The clipping-by-norm factor for every gradient (1 without clipping), None when a gradient is not
        finite and the policy checks (the step is skipped). Records the global norm when clipping; ``read``:
        the norm :meth:`gradient_norm` read from these gradients (used as it is)."""
        policy = self.gradient_policy
        if not policy.check_finite and policy.clip_norm is None:
            return 1.0
        finite, total = (read.finite, read.total) if read is not None else self._global_norm(families, on_host)
        if not finite:
            return None
        if policy.clip_norm is None or total is None:
            return 1.0
        self.last_step.total_norm = float(total)
        return kernels.clip_coefficient(policy.clip_norm, total)

    def _global_norm(
        self, families: list[ChunkFamily], on_host: dict[int, torch.Tensor]
    ) -> tuple[bool, torch.Tensor | None]:
        policy = self.gradient_policy
        norms_of = None if policy.check_finite or policy.inv_scale != 1.0 else self.overlap.norms_of
        return global_norm(
            self._manager, families, on_host, self._book.group_of, policy.inv_scale, policy.check_finite, norms_of
        )

    def _host_params(self) -> list[torch.Tensor]:
        """Host-resident parameters (cpu_embedding), in param-group order."""
        return [p for group in self.param_groups for p in group["params"] if self._book.is_host(p)]

    # ---- the rest of torch's Optimizer interface ---------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_adding_initial_groups", False):
            super().add_param_group(param_group)  # torch's constructor, with copies of the user's groups
            return
        raise NotImplementedError(
            "PatrickStar lays out chunks and optimizer states at setup, so parameter groups cannot be added"
            " during training (e.g. by a fine-tuning callback that unfreezes layers). HINT: put every"
            " parameter in a group in `configure_optimizers` and set requires_grad before `fit` (under Fabric:"
            " in the optimizer given to `fabric.setup`, before that call)."
        )

    def _zero_after_step(self, *, consumed: bool = True) -> None:
        """The step consumed the gradients (applied or skipped): they go, where torch keeps them until
        ``zero_grad``; a step before the user's next ``zero_grad`` is refused ([Note: gradients end with the step] in
        ``optim/step_checks.py``).
        ``consumed=False``: there were none (a step before any backward, or after ``zero_grad``), so torch keeps
        nothing either, and the next step needs no ``zero_grad`` first."""
        self.zero_grad()
        self._zeroed_by_step[0] = consumed
        self._zeroed_since_step.clear()

    @property
    def consumed_gradients(self) -> bool:
        """Whether the last step consumed gradients that torch would keep in ``p.grad`` until ``zero_grad``."""
        return self._zeroed_by_step[0]

    def _module_zeroed(self, indices: set[int]) -> None:
        """``zero_grad`` on a module zeroed the gradients of the records ``indices`` (and the manager forgot them):
        where those are all of this optimizer's, it is as if its own ``zero_grad`` ran."""
        zeroed = self._zeroed_since_step
        zeroed |= indices
        if all(r.index in zeroed for r in self._records):
            self._zeroed_by_step[0] = False
            self._read_norm = None
            self.overlap.forget_norms()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients of this optimizer's parameters (weights overwritten by gradients are restored
        from the masters); another optimizer's gradients stay for its own step."""
        if set_to_none:
            self._kept_zeros.clear()
        else:  # torch keeps a zero p.grad where there was one (the last step's stay in p.grad), and steps it
            self._kept_zeros |= {r.index for r in self._records if r.has_grad}
            if self._zeroed_by_step[0]:
                self._kept_zeros |= self._stepped_grads
        self._zeroed_by_step[0] = False
        self._read_norm = None
        self.overlap.forget_norms()
        self._manager.nonfinite_loss = False  # the gradients of that loss are gone
        self._manager.discard_grads(self._records)
        for p in self._host_params():
            p.grad = None

    # ---- state dict in torch's standard layout (hooks registered on this optimizer run as in torch) --------
    def state_dict(self, *, rank0_only: bool = False) -> dict[str, Any]:
        """torch's layout (``state`` by parameter index, ``param_groups``), consolidated from every rank.

        ``rank0_only`` (what checkpoints use) streams the states to rank 0; other ranks get empty states.
        """
        self._manager.finish_steps()
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state_dict = self._state_io.state_dict(rank0_only=rank0_only)
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's layout (from this optimizer, or from torch's own): validated before anything changes."""
        self._manager.finish_steps()
        state_dict = dict(state_dict)  # shallow copy, as torch's (its hooks may replace entries)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._state_io.load_state_dict(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    @property
    def state_io(self) -> ChunkedStateDict:
        """The state dicts' reader and writer (per family, for the hand-back at teardown)."""
        return self._state_io

    def owned_state_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """``<prefix><index>/<field>`` -> tensor for the states this rank owns (a sharded save)."""
        return self._state_io.owned_state_tensors(prefix)

    def load_owned_state(
        self, stored: dict[str, torch.Size], prefix: str, read: ReadTensors, groups: list[Any]
    ) -> None:
        """Load a sharded checkpoint's optimizer states: the groups' hyper-parameters and this rank's states."""
        self.load_state_dict({"state": self._state_io.read_owned_state(stored, prefix, read), "param_groups": groups})

    # ---- the gradient norm before the step ----------------------------------------------------------------
    @torch.no_grad()
    def gradient_norm(self) -> torch.Tensor:
        """The global 2-norm of this optimizer's gradients as they are now (after the last backward), unscaled
        with the gradient policy's ``inv_scale``: a 0-d fp32 CPU tensor (0 without gradients).

        The same value the step computes (the same kernels and one host synchronisation); the next
        :meth:`step` clips with this very value and does not read the gradients again. With several ranks
        the norm is global (a collective): every rank calls it. Set the gradient policy first (the
        precision plugin's ``begin_step``); a new backward before the step would make it stale.
        """
        self._manager.finish_steps()
        self._manager.grads.settle()  # gradients a raised backward left waiting ([Note: gradients land per family])
        read = self._host_grads()
        finite, total = self._global_norm(self._families_with_grads(), read)
        self._read_norm = _ReadNorm(on_host=read, finite=finite, total=total)
        return total.clone() if total is not None else torch.zeros((), dtype=torch.float32)  # the caller's own

    def skip_next_step(self) -> None:
        """Make the coming step a skipped one (gradients zeroed, weights and states kept), as for a non-finite
        gradient: what a caller that refused the norm :meth:`gradient_norm` read leaves behind."""
        if self._read_norm is not None:
            self._read_norm = replace(self._read_norm, finite=False)

    def __repr__(self) -> str:
        return f"ChunkedOptimizer({type(self._user_optimizer).__name__}, groups={len(self.param_groups)})"
