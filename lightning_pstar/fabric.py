"""PatrickStarFabricStrategy: the Fabric glue around the chunk engine, ``Fabric(strategy="patrickstar")``.

The same engine as the Trainer strategy (:mod:`lightning_pstar.glue` builds it for both), driven by the same
manager verbs. A Fabric loop has no Trainer callbacks, so the iteration's boundaries are found here:

- start of a training micro-batch: the first forward of the set-up model with grad enabled after a backward or
  a step (or at the start); it opens the micro-batch (``begin_training_batch``) and, as the Trainer's training step
  does, runs under the hooks' saved-tensor handling;
- end of backward: ``fabric.backward`` returning (``begin_backward`` / ``finish_backward`` around it);
- the step: the wrapped optimizer's ``step`` (one optimizer ends the warm-up with its first step, as the
  Trainer's automatic optimization does; with several, the warm-up ends at the next micro-batch).

A forward under ``torch.no_grad()`` while no micro-batch is open is an evaluation pass (``end_training``,
``begin_eval_pass`` / ``end_eval_pass``), so evaluation between steps keeps working; one inside an open
micro-batch (a teacher's output before the backward) is part of it, as in a Trainer training step.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl, _Sharded
from lightning.fabric.utilities.types import _PATH, Optimizable
from lightning.fabric.wrappers import _FabricModule
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import Unpack, override

from lightning_pstar.checkpoint import full_state_dict, load_full_state_dict
from lightning_pstar.checkpointing import chunked_of, refuse_io_sharded_bypasses
from lightning_pstar.config import PStarConfig, PStarOptions
from lightning_pstar.fabric_checkpoint import load_fabric_checkpoint, save_fabric_checkpoint
from lightning_pstar.glue import (
    EngineAccess,
    build_engine,
    hand_back,
    move_buffers,
    register_names,
    resolve_config,
)
from lightning_pstar.iteration import accumulating, eval_pass, optimizer_stepped
from lightning_pstar.optim import ChunkedOptimizer
from lightning_pstar.precision import PatrickStarFabricPrecision
from lightning_pstar.runtime.hooks import ModelHooks
from lightning_pstar.runtime.manager import ChunkManager
from lightning_pstar.runtime.meta_init import meta_device
from lightning_pstar.runtime.tracer import out_of_memory_as_error
from lightning_pstar.setup_checks import refuse_no_trainable_parameters, refuse_shared_parameters

__all__ = ["PatrickStarFabricPrecision", "PatrickStarFabricStrategy"]

_FABRIC_ARGUMENTS = (
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision",
    "process_group_backend",
    "timeout",
    "start_method",
)


class _ChunkedModule(nn.Module):
    """What ``setup_module`` returns (Fabric wraps it in its ``_FabricModule``): the user's module, whose every
    forward goes through :meth:`PatrickStarFabricStrategy._forward_pass` (the iteration's boundaries)."""

    def __init__(self, module: nn.Module, strategy: PatrickStarFabricStrategy) -> None:
        super().__init__()
        self.module = module
        self._strategy = [strategy]  # in a list: not a submodule, and no reference cycle through _modules

    @override
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self._strategy[0]._forward_pass():
            return self.module(*args, **kwargs)


class _ChunkBackwardSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: the micro-batch only accumulates (no reduction, gradients kept in fp32)."""

    def __init__(self, strategy: PatrickStarFabricStrategy) -> None:
        self._strategy = strategy

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        return accumulating(self._strategy.chunk_manager)


class PatrickStarFabricStrategy(EngineAccess, DDPStrategy, _Sharded):
    """``Fabric(strategy="patrickstar")``: models larger than the accelerator's memory, in a Fabric loop.

    The options are those of :class:`~lightning_pstar.strategy.PatrickStarStrategy` (flat keywords or one
    ``config``); the remaining arguments are Fabric's own. One model per strategy: set it up once, with any
    number of optimizers (``fabric.setup(model, opt)`` or ``setup_module`` then ``setup_optimizers``).
    """

    strategy_name = "patrickstar"
    _NOT_SET_UP = "HINT: call `fabric.setup(model, optimizer)` (or `fabric.setup_module(model)`) first."

    def __init__(
        self,
        *,
        config: PStarConfig | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **options: Unpack[PStarOptions],
    ) -> None:
        # every check runs before anything is set: a bad option leaves no half-built strategy behind
        self.config = resolve_config(config, options, owner=type(self).__name__, lightning=_FABRIC_ARGUMENTS)
        self._manager: ChunkManager | None = None
        self._hooks: ModelHooks | None = None
        self._module: nn.Module | None = None
        self._optimizers: list[ChunkedOptimizer] = []
        self._batch_open = False  # a training forward ran and its backward has not
        self._in_forward = False
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,  # None: SafeCheckpointIO once asked ([Note: the checkpoint IO])
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self._backward_sync_control = _ChunkBackwardSync(self)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:  # type: ignore[override]
        # one rank sees the batches `strategy="auto"` sees ([Note: one rank, auto's batches] in data_order.py):
        # Fabric injects a DistributedSampler only where this is not None
        if self.num_nodes * self.num_processes == 1:
            return None
        return super().distributed_sampler_kwargs

    @classmethod
    def from_config(cls, options: Mapping[str, Any] | PStarConfig, **fabric_args: Any) -> PatrickStarFabricStrategy:
        """Build the strategy from a dict or OmegaConf node with the nested keys of
        :class:`~lightning_pstar.config.PStarConfig`, or from a ``PStarConfig``; unknown keys raise."""
        config = options if isinstance(options, PStarConfig) else PStarConfig.from_mapping(options)
        return cls(config=config, **fabric_args)

    # ---- precision ------------------------------------------------------------------------------------
    @property
    @override
    def precision(self) -> PatrickStarFabricPrecision:
        plugin = self._precision
        if not isinstance(plugin, PatrickStarFabricPrecision):
            plugin = PatrickStarFabricPrecision.from_plugin(
                plugin or Precision(), self.config.mixed_precision.loss_scale
            )
            self._precision = plugin
        return plugin

    @precision.setter
    def precision(self, precision: Precision | None) -> None:
        # Fabric hands over a generic plugin for `Fabric(precision=...)`: convert it (and reject unsupported
        # precisions such as 64-true or bf16-true here, before anything is set up)
        self._precision = (
            None
            if precision is None
            else PatrickStarFabricPrecision.from_plugin(precision, self.config.mixed_precision.loss_scale)
        )

    # ---- processes ------------------------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self.num_processes == 1 and self._start_method == "popen":
            self._launcher = None  # one process: run in place (see PatrickStarStrategy._configure_launcher)

    @override
    def _setup_distributed(self) -> None:
        if self.num_nodes * self.num_processes > 1:
            super()._setup_distributed()
            return
        self._set_world_ranks()  # one process: no process group (every collective of a world of one is the identity)

    # ---- model creation -------------------------------------------------------------------------------
    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        # `empty_init=True`: the meta device, materialised into chunks at setup (the full model never exists);
        # otherwise the host: the model moves into chunks at setup, never whole onto the device
        if empty_init:  # [Note: loading into a meta model] in runtime/meta_init.py
            return meta_device("`fabric.init_module(empty_init=True)`")
        return torch.device("cpu")

    @override
    def module_sharded_context(self) -> AbstractContextManager:
        return meta_device("`fabric.init_module(empty_init=True)`")

    # ---- setup ----------------------------------------------------------------------------------------
    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[nn.Module, list[Optimizer], Any | None]:
        if any(p.is_meta for opt in optimizers for group in opt.param_groups for p in group["params"]):
            raise RuntimeError(
                "The optimizer holds the model's meta-device parameters (`fabric.init_module(empty_init=True)`);"
                " they are replaced by chunk-backed ones when the model is set up. HINT: set up the model first,"
                " then build the optimizer: `model = fabric.setup_module(model)`, `optimizer ="
                " fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))`."
            )
        if optimizers:
            refuse_no_trainable_parameters(module, entry="fabric.setup")
        wrapped = self.setup_module(module)
        return wrapped, [self.setup_optimizer(opt) for opt in optimizers], scheduler

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:  # type: ignore[override]
        if self._manager is not None:
            raise RuntimeError(
                "PatrickStarFabricStrategy manages one model and one was set up already. HINT: put the models in one"
                " nn.Module (e.g. an nn.ModuleDict) and set that up once."
            )
        refuse_io_sharded_bypasses(self.checkpoint_io, sharded=self.config.checkpoint == "sharded")
        self._manager, self._hooks = build_engine(
            module,
            config=self.config,
            precision=self.precision,
            device=self.root_device,
            rank=self.global_rank,
            world_size=self.world_size,
            local_world_size=self.num_processes,
            accumulates=False,  # not declared in Fabric: an accumulated fp32 sum is allocated on first use
        )
        self._module = module
        return _ChunkedModule(module, self)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        manager = self._require_manager()
        if self._module is not None:
            refuse_no_trainable_parameters(self._module, entry="fabric.setup_optimizers")
        users = [opt.user_optimizer for opt in self._optimizers]
        refuse_shared_parameters([*users, optimizer], self._module)  # also against those set up before
        chunked = ChunkedOptimizer(optimizer, manager)
        self._optimizers.append(chunked)
        return chunked

    @override
    def module_to_device(self, module: nn.Module) -> None:
        # parameters live in chunks (before setup: where the user built them); only buffers follow the module
        if self._module is not None:
            move_buffers(self._module, self.root_device)

    # ---- the iteration --------------------------------------------------------------------------------
    @contextmanager
    def _forward_pass(self) -> Generator[None, None, None]:
        manager, hooks = self._manager, self._hooks
        if manager is None or hooks is None or self._in_forward:
            yield  # after teardown, or a nested call: nothing to find
            return
        self._in_forward = True
        try:
            if torch.is_grad_enabled():
                if not self._batch_open:
                    self._refuse_stale_clipping("a new training forward started")
                    manager.begin_training_batch()
                    self._batch_open = True
                with hooks.saved_tensors(), out_of_memory_as_error(manager):
                    yield
            elif self._batch_open:
                yield  # a forward without autograd inside the training micro-batch
            else:
                manager.end_training()
                with eval_pass(manager):
                    yield  # a forward that raises ends the pass on this rank only: no collectives after it
        finally:
            self._in_forward = False

    def _refuse_stale_clipping(self, what: str) -> None:
        for policy in (opt.gradient_policy for opt in self._optimizers):
            if policy.clip_norm is not None or policy.clip_value is not None:
                raise RuntimeError(
                    f"`fabric.clip_gradients(...)` was called and {what} before"
                    " `optimizer.step()`. PatrickStar clips inside the step, so the clipping would apply to other"
                    " gradients than those it was called for. HINT: call `fabric.clip_gradients` right before"
                    " `optimizer.step()`, after the last backward of the step."
                )

    @override
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        manager = self._require_manager()
        self._refuse_stale_clipping("a new backward started")  # the norm clip_gradients returned would be stale
        manager.begin_backward()  # every rank is here: collectives may start
        manager.note_loss(tensor)
        with out_of_memory_as_error(manager), manager.grads.landing_on_error():
            self.precision.pre_backward(tensor, module)
            self.precision.backward(tensor, module, *args, **kwargs)
            self.precision.post_backward(tensor, module)
        manager.finish_backward()
        manager.guard_user_grads()  # user code runs before the step: [Note: gradients user code cannot see]
        self._batch_open = False

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        manager = self._require_manager()
        with out_of_memory_as_error(manager):
            result = self.precision.optimizer_step(optimizer, **kwargs)
        # plain PyTorch keeps the step's gradients in p.grad until zero_grad: stand-ins show whether the loop drops
        # them with model.zero_grad() ([Note: gradients set to None] in runtime/grad_guard.py)
        chunked = self._chunked(optimizer)
        if chunked.consumed_gradients:
            manager.guard_stale_grads(chunked._records)
        self._batch_open = False  # a forward after a step starts a micro-batch, even if no backward came between
        # one step per iteration ends the warm-up; several optimizers may step per iteration
        optimizer_stepped(manager, one_per_iteration=len(self._optimizers) == 1)
        return result

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip the coming step's gradients to a global 2-norm of ``max_norm``; returns that norm, as plain Fabric
        does (a 0-d fp32 CPU tensor, global over the ranks: call it on every rank).

        The norm is computed now, from the final gradients in the chunks; the chunked optimizer's step scales
        them by it (the same value, not computed again). A non-finite norm raises here with
        ``error_if_nonfinite`` (as plain Fabric; the coming step, if called, is skipped and changes nothing);
        under loss scaling (16-mixed) it skips the step and lowers the scale instead.
        """
        if float(norm_type) != 2.0:
            raise ValueError(
                f"PatrickStar clips by the global 2-norm only, got norm_type={norm_type!r}. HINT: use norm_type=2.0,"
                " or clip by value (`fabric.clip_gradients(model, optimizer, clip_val=...)`)."
            )
        self._check_clip("max_norm", max_norm)
        chunked = self._chunked(optimizer)
        self.precision.clip_next_step(chunked, float(max_norm), by_norm=True)
        self.precision.begin_step(chunked)  # the step's unscaling and inf check (it sets them again, the same)
        norm = chunked.gradient_norm()
        if error_if_nonfinite and not self.precision.uses_loss_scaling and not bool(torch.isfinite(norm)):
            chunked.skip_next_step()  # nothing is clipped by a nan: a step called anyway leaves the weights
            raise RuntimeError(
                f"The total norm of order 2.0 for gradients is non-finite ({float(norm)}), so it cannot be clipped;"
                " the weights are unchanged (a following `optimizer.step()` is skipped). HINT: check the loss and"
                " the data for inf/nan, or pass `error_if_nonfinite=False` to `fabric.clip_gradients`."
            )
        return norm

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        """Clamp the coming step's gradients to ``[-clip_val, clip_val]`` (applied inside the step)."""
        self._check_clip("clip_val", clip_val)
        self.precision.clip_next_step(self._chunked(optimizer), float(clip_val), by_norm=False)

    @staticmethod
    def _check_clip(name: str, value: float | int) -> None:
        if not value > 0:
            raise ValueError(
                f"`fabric.clip_gradients({name}={value!r})`: PatrickStar clips with a positive {name} only."
                f" HINT: pass {name} > 0, or do not clip this step."
            )

    def _chunked(self, optimizer: Any) -> ChunkedOptimizer:
        chunked = chunked_of(optimizer)
        if chunked is None or chunked not in self._optimizers:
            raise TypeError(
                f"Expected an optimizer set up by this strategy, got {type(optimizer).__name__}. HINT: pass the"
                " optimizer returned by `fabric.setup(...)` / `fabric.setup_optimizers(...)`."
            )
        return chunked

    def last_grad_norm(self, optimizer: Any) -> float | None:
        """The global gradient norm of ``optimizer``'s last step (None when that step did not clip by norm)."""
        return self._chunked(optimizer).last_step.total_norm

    # ---- checkpoints ----------------------------------------------------------------------------------
    def _managed(self, obj: Any) -> bool:
        """Whether ``obj`` is the model this strategy set up (or Fabric's wrapped or unwrapped view of it)."""
        if isinstance(obj, _FabricModule):  # what fabric.setup returned
            obj = obj._forward_module
        if isinstance(obj, _ChunkedModule):
            obj = obj.module
        return self._module is not None and obj is self._module

    @override
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        if self._manager is not None and self._managed(module):
            return full_state_dict(self._manager, rank0_only=True)  # every rank: gathered family by family
        return super().get_module_state_dict(module)

    @override
    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        if self._manager is not None and self._managed(module):
            load_full_state_dict(self._manager, state_dict, strict=strict)
            return
        super().load_module_state_dict(module, state_dict, strict=strict)

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        chunked = chunked_of(optimizer)
        if chunked is not None:
            return chunked.state_dict(rank0_only=True)
        return super().get_optimizer_state(optimizer)

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Any] | None = None,
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options, got {storage_options!r}")
        if self._manager is None or self.config.checkpoint != "sharded":
            super().save_checkpoint(path, state, filter=filter)  # consolidated: Fabric's layout, written by rank 0
            return
        save_fabric_checkpoint(self, Path(path), state, filter=filter)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: nn.Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        if self._manager is None:
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        return load_fabric_checkpoint(
            self, Path(self.broadcast(str(path))), state, strict=strict, weights_only=weights_only
        )

    # ---- teardown -------------------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        """Hand the model back as an ordinary module (fp32 weights on CPU) and the user's optimizers holding the
        trained state; the memory reports stay readable. Call it on every rank (it gathers the reports)."""
        if self._manager is not None:
            end = hand_back(self._manager, self._hooks, self._optimizers, failed=False)
            self._final_report, self._final_reports = end.report, end.reports
            self._manager, self._hooks, self._optimizers = None, None, []
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_names(cls, strategy_registry)
