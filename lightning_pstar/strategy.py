"""PatrickStarStrategy: the Lightning glue around the chunk engine.

The strategy subclasses :class:`~lightning.pytorch.strategies.DDPStrategy` so that launching, ranks,
nodes and cluster environments behave as users expect, and replaces DDP's model wrapping with the chunk
engine: parameters live in chunks (:mod:`lightning_pstar.runtime.manager`), hooks move them
(:mod:`lightning_pstar.runtime.hooks`), and the user's optimizer is stepped on the chunks
(:mod:`lightning_pstar.optim`).
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from typing_extensions import Unpack, override

from lightning_pstar.checkpoint import INFO_KEY, SHARDED_KEY, full_state_dict
from lightning_pstar.checkpointing import (
    SafeCheckpointIO,
    check_optimizer_groups,
    check_optimizer_states,
    chunked_of,
    load_model_state,
    load_sharded_optimizer_states,
    open_checkpoint,
    refuse_bare_state_dict,
    refuse_io_sharded_bypasses,
    sharded_entries_with_placeholders,
    write_sharded_checkpoint,
)
from lightning_pstar.config import PStarConfig, PStarOptions
from lightning_pstar.data_order import keep_data_order
from lightning_pstar.glue import (
    EngineAccess,
    build_engine,
    hand_back,
    move_buffers,
    quiet_teardown,
    register_names,
    resolve_config,
    wrap_optimizers,
)
from lightning_pstar.hardware import warn_if_slow_bf16
from lightning_pstar.iteration import accumulating, eval_pass, nothing_reads_gradients, optimizer_stepped
from lightning_pstar.precision import PatrickStarPrecision
from lightning_pstar.report import MemoryReport
from lightning_pstar.runtime.hooks import ModelHooks
from lightning_pstar.runtime.manager import ChunkManager
from lightning_pstar.runtime.meta_init import meta_device
from lightning_pstar.runtime.tracer import out_of_memory_as_error
from lightning_pstar.setup_checks import explain_optimizer_setup_error, refuse_no_trainable_parameters
from lightning_pstar.trainer_checks import refuse_unsupported_callbacks

__all__ = ["PatrickStarStrategy", "SafeCheckpointIO"]

log = logging.getLogger(__name__)

# Lightning's own constructor arguments, suggested when one of them is misspelled
_LIGHTNING_ARGUMENTS = (
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision_plugin",
    "process_group_backend",
    "timeout",
    "start_method",
)


class PatrickStarStrategy(EngineAccess, DDPStrategy):
    """Train models larger than the accelerator's memory with chunk-based memory management.

    The PatrickStar options are flat keywords (``chunk_size``, ``placement``, ``device_memory_limit``, ... see
    :class:`~lightning_pstar.config.PStarOptions`; each is documented at its field of
    :class:`~lightning_pstar.config.PStarConfig`, :data:`~lightning_pstar.config.FLAT_OPTIONS` says which), or one
    ``config``, never both. A misspelled keyword raises :class:`~lightning_pstar.config.UnknownOptionError`
    naming the closest option. The remaining arguments are Lightning's own.
    """

    strategy_name = "patrickstar"
    _NOT_SET_UP = (
        "HINT: call this after `trainer.fit/validate/test` has started (e.g. in a callback) or after it has run."
    )

    def __init__(
        self,
        *,
        config: PStarConfig | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **options: Unpack[PStarOptions],
    ) -> None:
        # every check runs before anything is set: a bad option leaves no half-built strategy behind
        self.config = self._resolve_config(config, options)
        self._manager: ChunkManager | None = None
        self._hooks: ModelHooks | None = None
        self._final_report: MemoryReport | None = None
        self._weights_dropped = False  # the last run ended with hand_back_weights=False (its weights are gone)
        self._failed = False  # an exception ended the run: teardown must not start collectives
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,  # None: SafeCheckpointIO once asked ([Note: the checkpoint IO])
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )

    @staticmethod
    def _resolve_config(config: PStarConfig | None, options: PStarOptions) -> PStarConfig:
        return resolve_config(config, options, owner="PatrickStarStrategy", lightning=_LIGHTNING_ARGUMENTS)

    @classmethod
    def from_config(cls, options: Mapping[str, Any] | PStarConfig, **lightning_args: Any) -> PatrickStarStrategy:
        """Build the strategy from a dict or OmegaConf node (e.g. a Hydra group) with the nested keys of
        :class:`~lightning_pstar.config.PStarConfig`, or from a ``PStarConfig``; unknown keys raise."""
        config = options if isinstance(options, PStarConfig) else PStarConfig.from_mapping(options)
        return cls(config=config, **lightning_args)

    # ---- precision ------------------------------------------------------------------------------------
    @property
    def precision_plugin(self) -> PatrickStarPrecision:
        plugin = self._precision_plugin
        if not isinstance(plugin, PatrickStarPrecision):
            plugin = PatrickStarPrecision.from_plugin(plugin or Precision(), self.config.mixed_precision.loss_scale)
            self._precision_plugin = plugin
        return plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning hands over a generic plugin for `Trainer(precision=...)`: convert it (and reject
        # unsupported precisions such as 64-true here, before anything is set up)
        self._precision_plugin = (
            None if plugin is None else PatrickStarPrecision.from_plugin(plugin, self.config.mixed_precision.loss_scale)
        )

    # ---- distributed ----------------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        # before any callback's setup hook: see [Note: callbacks refused at setup_environment]
        refuse_io_sharded_bypasses(self.checkpoint_io, sharded=self._sharded)
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            callbacks = trainer.callbacks  # type: ignore[attr-defined]
            refuse_unsupported_callbacks(callbacks, precision=str(self.precision_plugin.precision))
        super().setup_environment()

    @override
    def setup_distributed(self) -> None:
        if self.num_nodes * self.num_processes > 1:
            super().setup_distributed()
            return
        # one process: no process group (it would hold a port for the life of the process, and every
        # collective of a world of one is the identity)
        self.set_world_ranks()

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self.num_processes == 1 and self._start_method == "popen":
            # one process on this machine: run in place, as Lightning's single-device strategy does. Its
            # launcher would only reset torch's thread count (to cores / processes), changing the user's
            # `torch.set_num_threads` and the arithmetic; where several processes share a machine it stays.
            self._launcher = None

    # ---- model setup ----------------------------------------------------------------------------------
    @override
    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        # models built in `configure_model` are created on the meta device and materialised straight
        # into chunks: the full fp32 model never exists on the device
        with meta_device("`configure_model`"):  # [Note: loading into a meta model] in runtime/meta_init.py
            yield

    _warned_slow_bf16 = False  # bf16-mixed on a CPU without bf16 units: said once per strategy (see setup)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        assert self.lightning_module is not None
        self.accelerator.setup(trainer)
        keep_data_order(trainer, self.world_size)
        precision = self.precision_plugin
        precision.device_type = self.root_device.type
        if self.is_global_zero and not self._warned_slow_bf16:
            self._warned_slow_bf16 = warn_if_slow_bf16(str(precision.precision), precision.device_type)
        module = self.lightning_module
        if trainer.state.fn == TrainerFn.FITTING:
            refuse_no_trainable_parameters(module, entry="trainer.fit")
            if self._layer_sync is not None:  # `Trainer(sync_batchnorm=True)`, as in DDPStrategy.setup (undone there)
                self._layer_sync.apply(module)  # in place: the root, a LightningModule, is no BatchNorm itself
        self._manager, self._hooks = build_engine(
            module,
            config=self.config,
            precision=precision,
            device=self.root_device,
            rank=self.global_rank,
            world_size=self.world_size,
            local_world_size=self.num_processes,
            accumulates=trainer.state.fn == TrainerFn.FITTING and trainer.accumulate_grad_batches > 1,
        )
        self.model = module
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _move_buffers(self, module: nn.Module) -> None:
        """Buffers and parameter-free submodules to the root device (see :func:`~lightning_pstar.glue.move_buffers`)."""
        move_buffers(module, self.root_device)

    @override
    def model_to_device(self) -> None:
        # parameters live in chunks; only buffers follow the module (see `_move_buffers`)
        if self.lightning_module is not None:
            self._move_buffers(self.lightning_module)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        try:
            super().setup_optimizers(trainer)
        except (RuntimeError, ValueError) as err:
            clearer = explain_optimizer_setup_error(err, self.world_size)
            if clearer is None:
                raise
            raise clearer from err
        if any(type(opt).__name__ == "_MockOptimizer" for opt in self.optimizers):
            raise ValueError(
                "`configure_optimizers` returned None (no optimizer), and PatrickStar steps the model's chunks"
                " through an optimizer. HINT: return one, e.g. `return torch.optim.AdamW(self.parameters(),"
                " lr=1e-3)` (torch.optim.Adam, AdamW or SGD)."
            )
        self.optimizers = wrap_optimizers(self.optimizers, self.lightning_module, self._require_manager())

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:  # type: ignore[override]
        return model  # no DDP wrapper: the hooks installed on the model do the work

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the chunks must exist before a checkpoint can be loaded into them

    # ---- iteration ------------------------------------------------------------------------------------
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._manager is not None:
            self._manager.begin_training_batch()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._require_manager()
        assert self._hooks is not None
        with self._hooks.saved_tensors(), out_of_memory_as_error(self._manager):
            return super().training_step(*args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        with out_of_memory_as_error(self._manager):  # the closure runs the backward
            result = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._manager is not None:
            chunked = chunked_of(optimizer)
            if (
                chunked is not None and chunked.consumed_gradients
            ):  # plain PyTorch keeps the step's gradients in p.grad until zero_grad: batch-end
                # hooks may read them; stand-ins refuse that, and show whether user code drops them ([Note: gradients
                # set to None] in runtime/grad_guard.py)
                self._manager.guard_stale_grads(chunked._records)
            module = self.lightning_module
            # one step per iteration ends the warm-up; manual loops may step several optimizers per batch
            one = len(self.optimizers) == 1 and module is not None and module.automatic_optimization
            optimizer_stepped(self._manager, one_per_iteration=one)
        return result

    def _leave_training(self) -> None:
        if self._manager is not None:
            self._manager.end_training()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with eval_pass(self._manager):
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with eval_pass(self._manager):
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with eval_pass(self._manager):
            return super().predict_step(*args, **kwargs)

    @override
    def on_train_end(self) -> None:
        self._leave_training()  # a warm-up whose iteration stepped ends here if no batch followed
        super().on_train_end()

    @override
    def on_validation_start(self) -> None:
        self._leave_training()

    @override
    def on_test_start(self) -> None:
        self._leave_training()

    @override
    def on_predict_start(self) -> None:
        self._leave_training()

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        # Lightning enters this for every micro-batch that only accumulates gradients
        with accumulating(self._require_manager()):
            yield

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._manager is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        try:
            with self._manager.grads.landing_on_error():
                return super().backward(closure_loss, optimizer, *args, **kwargs)
        except BaseException:
            self._manager.torn = sorted(self._manager.grads.stepped)  # stepped inside it: no roll-back possible
            raise

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        if self._manager is not None:
            refuse = getattr(self.precision_plugin, "refuse_backward_after_clipping", None)
            if refuse is not None:
                refuse(self.optimizers)
            self._manager.begin_backward()  # every rank is here: collectives may start (see groups.py)
            self._manager.note_loss(closure_loss)
            chunked = chunked_of(self.optimizers[0]) if self.optimizers else None
            if chunked is None or self._manager.nonfinite_loss:
                return
            if nothing_reads_gradients(self.lightning_module, self.optimizers):
                chunked.step_in_backward()
            elif nothing_reads_gradients(self.lightning_module, self.optimizers, but_clipping_by_norm=True):
                chunked.norms_in_backward()  # [Note: gradient norms inside the backward] in optim/overlap.py
            else:
                chunked.overlap.forget_norms()

    def guard_user_grads(self) -> None:
        """The backward is over and user code may use ``p.grad`` before the step: it gets stand-ins that refuse
        ([Note: gradients user code cannot see] in runtime/grad_guard.py). Called by the precision plugin."""
        module, optimizers = self.lightning_module, self.optimizers  # Lightning's clipping reads no p.grad
        if self._manager is not None and not nothing_reads_gradients(module, optimizers, but_clipping_by_norm=True):
            self._manager.guard_user_grads()

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if self._manager is not None:
            self._manager.finish_backward()
            self._manager.end_backward_steps()

    # ---- checkpoints ----------------------------------------------------------------------------------
    @property
    def _sharded(self) -> bool:
        return self.config.checkpoint == "sharded"

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._manager is None:
            self._refuse_dropped_weights()
            return super().lightning_module_state_dict()
        if self._sharded:
            # the weights go to the sharded store; the checkpoint dict keeps the buffers, and a stand-in per weight
            # for the hooks to edit ([Note: weights in a sharded checkpoint dict] in checkpoint/placeholders.py)
            holder = {"state_dict": {k: v.detach().cpu() for k, v in self._manager.module.named_buffers()}}
            sharded_entries_with_placeholders(holder, self._manager)
            return holder["state_dict"]
        return full_state_dict(self._manager, rank0_only=True)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        inner = chunked_of(optimizer)
        if inner is None:
            if self._manager is None:
                self._refuse_dropped_weights()
            return super().optimizer_state(optimizer)
        if self._sharded:
            return {"state": {}, "param_groups": inner.state_dict(rank0_only=True)["param_groups"]}
        return inner.state_dict(rank0_only=True)

    def _refuse_dropped_weights(self) -> None:
        """A checkpoint asked for after a run that did not hand its weights back: they are gone, say so."""
        if self._weights_dropped:
            raise RuntimeError(
                "PatrickStar: the run ended with hand_back_weights=False, so its weights and optimizer states were"
                " freed with the chunks and the model holds empty tensors: a checkpoint now would be empty. HINT:"
                " save during fit (ModelCheckpoint, or trainer.save_checkpoint in a hook before on_fit_end), or set"
                " hand_back_weights=True."
            )

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if not self._sharded or self._manager is None:
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        write_sharded_checkpoint(
            self._manager, self.optimizers, checkpoint, Path(filepath), rank=self.global_rank, barrier=self.barrier
        )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        self._loading_from = path
        checkpoint = open_checkpoint(
            path,
            self.checkpoint_io,
            is_global_zero=self.is_global_zero,
            barrier=self.barrier,
            weights_only=weights_only,
        )
        refuse_bare_state_dict(checkpoint, path)
        if checkpoint.get(SHARDED_KEY) and isinstance(checkpoint.get(INFO_KEY), dict):
            sharded_entries_with_placeholders(checkpoint)  # for on_load_checkpoint to edit, as a plain file's
        return checkpoint

    def _check_optimizer_states(self, checkpoint: Mapping[str, Any], *, groups: bool = False) -> None:
        """Refuse optimizer states of another optimizer class (or, ``groups``, other param groups) before the
        model state changes."""
        if self.lightning_module is None or self.lightning_module.trainer.state.fn != TrainerFn.FITTING:
            return
        (check_optimizer_groups if groups else check_optimizer_states)(self.optimizers, checkpoint)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._manager is None:
            super().load_model_state_dict(checkpoint, strict=strict)
            return
        source = checkpoint.get(SHARDED_KEY) or getattr(self, "_loading_from", None) or "the checkpoint"
        load_model_state(
            self._manager,
            checkpoint,
            strict=strict,
            source=source,
            before=lambda: self._check_optimizer_states(checkpoint),
            checked=lambda: self._check_optimizer_states(checkpoint, groups=True),
        )

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not checkpoint.get(SHARDED_KEY):
            super().load_optimizer_state_dict(checkpoint)
            return
        load_sharded_optimizer_states(self.optimizers, checkpoint)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)

    # ---- teardown -------------------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        if not self._failed:
            self._teardown()
            return
        # after a failure (setup included) the first error is the one the user sees: nothing here may raise
        # a new one (Lightning's own teardown would call `.cpu()` on meta tensors of a `configure_model` model)
        try:
            self._teardown()
        except Exception as err:  # noqa: BLE001 - logged: the error being raised already is the user's
            module = self.lightning_module
            # a model still on the meta device (setup refused before materialising it) has nothing to hand back:
            # Lightning's `.cpu()` on it fails, which the user cannot act on
            unbuilt = module is not None and any(p.device.type == "meta" for p in module.parameters())
            log.log(
                logging.DEBUG if unbuilt else logging.WARNING,
                "PatrickStar teardown after a failed run: %s: %s",
                type(err).__name__,
                err,
            )
            self._hooks, self._manager = None, None
            quiet_teardown(self.precision_plugin, self.checkpoint_io, self.accelerator)

    def _teardown(self) -> None:
        manager, hooks = self._manager, self._hooks
        self._hooks = None
        if manager is not None:
            end = hand_back(manager, hooks, self.optimizers, failed=self._failed)
            self._weights_dropped = not manager.config.hand_back_weights
            self._manager = None
            self._final_report, self._final_reports, self.optimizers = end.report, end.reports, end.optimizers
        elif hooks is not None:
            hooks.remove()
        super().teardown()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        super().on_exception(exception)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_names(cls, strategy_registry)
