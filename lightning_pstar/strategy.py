"""PatrickStarStrategy: the Lightning glue around the chunk engine.

The strategy subclasses :class:`~lightning.pytorch.strategies.DDPStrategy` so that launching, ranks,
nodes and cluster environments behave as users expect, and replaces DDP's model wrapping with the chunk
engine: parameters live in chunks (:mod:`lightning_pstar.runtime.manager`), hooks move them
(:mod:`lightning_pstar.runtime.hooks`), and the user's optimizer is stepped on the chunks
(:mod:`lightning_pstar.optim`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.device_dtype_mixin import _update_properties
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from typing_extensions import Unpack, override

from lightning_pstar.checkpoint import (
    INFO_KEY,
    SHARDED_KEY,
    CheckpointError,
    full_state_dict,
    is_sharded_checkpoint,
    load_checkpoint_file,
    load_full_state_dict,
    load_owned_tensors,
    owned_tensors,
    read_sharded_meta,
    read_sharded_tensors,
    remove_checkpoint_path,
    remove_leftovers,
    restore_module,
    save_checkpoint_file,
    sharded_info,
    sharded_meta,
    stored_keys,
    write_sharded,
)
from lightning_pstar.config import PStarConfig, PStarOptions, check_option_names
from lightning_pstar.hardware import warn_if_slow_bf16
from lightning_pstar.optim import ChunkedOptimizer
from lightning_pstar.optim.state_dict import check_optimizer_class
from lightning_pstar.precision import PatrickStarPrecision
from lightning_pstar.report import MemoryReport, format_bytes
from lightning_pstar.runtime.comm import ChunkComm
from lightning_pstar.runtime.hooks import ModelHooks
from lightning_pstar.runtime.manager import ChunkManager
from lightning_pstar.runtime.state import MicroBatch
from lightning_pstar.runtime.tracer import out_of_memory_as_error
from lightning_pstar.setup_checks import (
    explain_optimizer_setup_error,
    parameter_free_metrics,
    refuse_shared_parameters,
    refuse_unsupported_dtypes,
)

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


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's torch checkpoint IO with atomic writes and clear errors on unreadable files.

    A process killed in the middle of a save leaves the previous checkpoint intact, and a sharded checkpoint
    directory loads as its checkpoint dict (the tensors stay in the store); see :mod:`lightning_pstar.checkpoint`.
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options, got {storage_options!r}")
        save_checkpoint_file(checkpoint, path)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        target = Path(path)
        if is_sharded_checkpoint(target):
            return read_sharded_meta(target)
        return load_checkpoint_file(target, map_location=map_location, weights_only=weights_only)

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        remove_checkpoint_path(path)


class PatrickStarStrategy(DDPStrategy):
    """Train models larger than the accelerator's memory with chunk-based memory management.

    The PatrickStar options are flat keywords (``chunk_size``, ``placement``, ``device_memory_limit``, ... see
    :class:`~lightning_pstar.config.PStarOptions`; each is documented at its field of
    :class:`~lightning_pstar.config.PStarConfig`, :data:`~lightning_pstar.config.FLAT_OPTIONS` says which), or one
    ``config``, never both. A misspelled keyword raises :class:`~lightning_pstar.config.UnknownOptionError`
    naming the closest option. The remaining arguments are Lightning's own.
    """

    strategy_name = "patrickstar"

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
        self._failed = False  # an exception ended the run: teardown must not start collectives
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io if checkpoint_io is not None else SafeCheckpointIO(),
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )

    @staticmethod
    def _resolve_config(config: PStarConfig | None, options: PStarOptions) -> PStarConfig:
        # `**options` catches every other keyword only to name a misspelled one (ours or Lightning's)
        check_option_names(options, lightning=_LIGHTNING_ARGUMENTS)
        if config is None:
            return PStarConfig.from_flat(**options)
        if not isinstance(config, PStarConfig):
            raise ValueError(
                f"`config` must be a PStarConfig, got {type(config).__name__}."
                " HINT: build the strategy from a dict or OmegaConf node with PatrickStarStrategy.from_config(...)."
            )
        if options:
            raise ValueError(
                f"PatrickStarStrategy got `config=` together with {sorted(options)}; the config would silently"
                " win. HINT: set them in the config (for example PStarConfig.from_flat(...) or dataclasses.replace)"
                " or pass keywords only."
            )
        return config

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
        with torch.device("meta"):
            yield

    _warned_slow_bf16 = False  # bf16-mixed on a CPU without bf16 units: said once per strategy (see setup)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        assert self.lightning_module is not None
        self.accelerator.setup(trainer)
        precision = self.precision_plugin
        precision.device_type = self.root_device.type
        if self.is_global_zero and not self._warned_slow_bf16:
            self._warned_slow_bf16 = warn_if_slow_bf16(str(precision.precision), precision.device_type)
        module = self.lightning_module
        refuse_unsupported_dtypes(module)
        manager = ChunkManager(
            module,
            config=self.config,
            compute_dtype=precision.compute_dtype,
            device=self.root_device,
            precision=str(precision.precision),
            comm=ChunkComm(
                rank=self.global_rank,
                world_size=self.world_size,
                group=torch.distributed.group.WORLD if self.world_size > 1 else None,
                cpu_group=self._cpu_group(),
            ),
            local_world_size=self.num_processes,
            accumulates=trainer.state.fn == TrainerFn.FITTING and trainer.accumulate_grad_batches > 1,
        )  # plans and validates; nothing has changed yet
        manager.materialise()
        self._manager = manager
        self._move_buffers(module)
        self._hooks = ModelHooks(manager)
        self._hooks.install()
        self.model = module
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _cpu_group(self) -> Any | None:
        """A gloo group beside an NCCL world, for collectives on host tensors (None where the world is gloo
        already, or one rank). Every rank creates it here, in the same order."""
        dist = torch.distributed
        if self.world_size <= 1 or not dist.is_initialized() or dist.get_backend() == "gloo":
            return None
        return dist.new_group(backend="gloo")

    def _move_buffers(self, module: nn.Module) -> None:
        """Put everything of the module that is not a parameter on the root device, and say so.

        Parameters stay in chunks. Buffers move; parameter-free submodules (torchmetrics metrics, whose
        states are not buffers) move with their own ``.to``; and Lightning's device bookkeeping
        (``_DeviceDtypeModuleMixin._device``, read by ``pl_module.device``) is set to the root device, so
        ``torch.arange(..., device=self.device)`` lands there. ``.dtype`` stays the fp32 of the weights'
        truth (the masters), as Lightning's own mixed-precision strategies report it.
        """
        device = self.root_device
        for mod in module.modules():
            for name, buf in mod._buffers.items():
                if buf is not None and buf.device != device:
                    mod._buffers[name] = buf.to(device)
        for mod in parameter_free_metrics(module):
            mod.to(device)
        _update_properties(module, device=device)

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
        manager = self._require_manager()
        refuse_shared_parameters(self.optimizers, self.lightning_module)
        self.optimizers = [ChunkedOptimizer(opt, manager) for opt in self.optimizers]

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
            module = self.lightning_module
            if len(self.optimizers) == 1 and module is not None and module.automatic_optimization:
                self._manager.end_warmup_if_recording()  # one step per iteration: the warm-up ends with it
            else:
                self._manager.optimizer_stepped()  # manual loops may step several optimizers per batch
        return result

    def _leave_training(self) -> None:
        if self._manager is not None:
            self._manager.end_training()

    @contextmanager
    def _eval_pass(self) -> Generator[None, None, None]:
        # with several ranks, an evaluation step is a pass of its own: its gathers start and end on every rank
        manager = self._manager
        if manager is not None:
            manager.begin_eval_pass()
        yield  # a step that raises ends the pass on this rank only: no collectives after it
        if manager is not None:
            manager.end_eval_pass()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._eval_pass():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._eval_pass():
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._eval_pass():
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
        manager = self._require_manager()
        manager.micro_batch = MicroBatch.ACCUMULATING
        try:
            yield
        finally:
            manager.micro_batch = MicroBatch.FINAL

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        if self._manager is not None:
            self._manager.begin_backward()  # every rank is here: collectives may start (see groups.py)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if self._manager is not None:
            self._manager.finish_backward()

    # ---- checkpoints ----------------------------------------------------------------------------------
    @property
    def _sharded(self) -> bool:
        return self.config.checkpoint == "sharded"

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._manager is None:
            return super().lightning_module_state_dict()
        if self._sharded:
            # the weights go to the sharded store; the checkpoint dict keeps the buffers
            return {k: v.detach().cpu() for k, v in self._manager.module.named_buffers()}
        return full_state_dict(self._manager, rank0_only=True)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        inner = getattr(optimizer, "_optimizer", optimizer)
        if not isinstance(inner, ChunkedOptimizer):
            return super().optimizer_state(optimizer)
        if self._sharded:
            return {"state": {}, "param_groups": inner.state_dict(rank0_only=True)["param_groups"]}
        return inner.state_dict(rank0_only=True)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if not self._sharded or self._manager is None:
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        tensors = owned_tensors(self._manager)
        for k, opt in enumerate(self.optimizers):
            inner = getattr(opt, "_optimizer", opt)
            if isinstance(inner, ChunkedOptimizer):
                tensors.update(inner.owned_state_tensors(f"optim/{k}/"))
        meta = sharded_meta(checkpoint, sharded_info(self._manager))
        write_sharded(Path(filepath), meta=meta, tensors=tensors, rank=self.global_rank, barrier=self.barrier)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        self._loading_from = path
        if self.is_global_zero:
            remove_leftovers(path.parent)  # what killed saves left beside it (only this package's entries)
        self.barrier()
        checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        if (
            "state_dict" not in checkpoint
            and checkpoint
            and all(isinstance(v, torch.Tensor) for v in checkpoint.values())
        ):
            raise CheckpointError(
                f"'{path}' holds a bare state_dict ({len(checkpoint)} tensors), not a Lightning checkpoint."
                " HINT: load the weights before fit (`model.load_state_dict(torch.load(path))`) and call fit"
                " without ckpt_path; ckpt_path takes a file written by trainer.save_checkpoint or ModelCheckpoint."
            )
        return checkpoint

    def _check_optimizer_states(self, checkpoint: Mapping[str, Any]) -> None:
        """Refuse optimizer states of another optimizer class before the model state changes."""
        if self.lightning_module is None or self.lightning_module.trainer.state.fn != TrainerFn.FITTING:
            return
        if checkpoint.get(SHARDED_KEY):
            stored = stored_keys(Path(checkpoint[SHARDED_KEY]))
            groups = checkpoint[INFO_KEY]["param_groups"]
            states = [
                ({key.rsplit("/", 1)[1] for key in stored if key.startswith(f"optim/{k}/")}, groups[k])
                for k in range(len(groups))
            ]
        else:
            states = [
                ({f for entry in opt["state"].values() for f in entry}, opt["param_groups"])
                for opt in checkpoint.get("optimizer_states", [])
                if isinstance(opt, Mapping) and isinstance(opt.get("state"), Mapping)
            ]
        for k, (opt, (fields, groups)) in enumerate(zip(self.optimizers, states, strict=False)):
            user = opt.user_optimizer if isinstance(opt, ChunkedOptimizer) else opt
            check_optimizer_class(user, fields, groups, f"optimizer {k} state in the checkpoint")

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._manager is None:
            super().load_model_state_dict(checkpoint, strict=strict)
            return
        source = checkpoint.get(SHARDED_KEY) or getattr(self, "_loading_from", None) or "the checkpoint"
        try:
            self._check_optimizer_states(checkpoint)
            if checkpoint.get(SHARDED_KEY):
                path = Path(checkpoint[SHARDED_KEY])
                load_owned_tensors(
                    self._manager,
                    stored_keys(path),
                    lambda wanted: read_sharded_tensors(path, wanted),
                    checkpoint.get("state_dict", {}),
                )
                return
            load_full_state_dict(self._manager, checkpoint["state_dict"], strict=strict)
        except (KeyError, ValueError) as err:
            message = err.args[0] if err.args else str(err)
            raise CheckpointError(f"cannot load '{source}': {message}") from err

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not checkpoint.get(SHARDED_KEY):
            super().load_optimizer_state_dict(checkpoint)
            return
        path = Path(checkpoint[SHARDED_KEY])
        stored = stored_keys(path)
        groups = checkpoint[INFO_KEY]["param_groups"]
        for k, opt in enumerate(self.optimizers):
            inner = getattr(opt, "_optimizer", opt)
            if isinstance(inner, ChunkedOptimizer):
                inner.load_owned_state(
                    stored, f"optim/{k}/", lambda wanted: read_sharded_tensors(path, wanted), groups[k]
                )

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)

    # ---- reporting ------------------------------------------------------------------------------------
    def memory_report(self) -> MemoryReport:
        """Bytes of chunks per tier, peak device bytes, transfer volume, evictions and chunk utilisation.

        After the run has ended, the report as it stood at the end of the run.
        """
        if self._manager is None and self._final_report is not None:
            return self._final_report
        return self._require_manager().memory_report()

    @property
    def chunk_manager(self) -> ChunkManager:
        """The engine behind this strategy (available once the Trainer has set it up)."""
        return self._require_manager()

    def _require_manager(self) -> ChunkManager:
        if self._manager is None:
            raise RuntimeError(
                "The PatrickStar engine is not set up yet. HINT: call this after `trainer.fit/validate/test`"
                " has started (e.g. in a callback) or after it has run."
            )
        return self._manager

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
            log.warning("PatrickStar teardown after a failed run: %s: %s", type(err).__name__, err)
            self._hooks, self._manager = None, None
            for step in (self.precision_plugin.teardown, self.checkpoint_io.teardown):
                try:
                    step()
                except Exception as inner:  # noqa: BLE001
                    log.warning("PatrickStar teardown after a failed run: %s: %s", type(inner).__name__, inner)
            if self.accelerator is not None:
                try:
                    self.accelerator.teardown()
                except Exception as inner:  # noqa: BLE001
                    log.warning("PatrickStar teardown after a failed run: %s: %s", type(inner).__name__, inner)

    def _teardown(self) -> None:
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        if self._manager is not None and self._failed and self._manager.world_size > 1:
            # another rank may be stuck in (or gone from) a collective: no gathering now
            self._final_report = self._manager.memory_report()
            self._final_reports = None
            self._manager = None
        if self._manager is not None:
            # hand back an ordinary module (fp32 weights on CPU, as Lightning's own teardown leaves it) and
            # the user's own optimizers holding the trained state, so that `trainer.save_checkpoint` after
            # `fit` writes a complete checkpoint; the reports of the run stay readable (every rank is here)
            self._final_report = self._manager.memory_report()
            self._final_reports = self._manager.comm.all_gather_object(self._final_report)
            chunked = [opt for opt in self.optimizers if isinstance(opt, ChunkedOptimizer)]
            states = [opt.state_dict() for opt in chunked]
            restore_module(self._manager, torch.device("cpu"))
            self._manager = None
            for opt, state in zip(chunked, states, strict=True):
                opt.user_optimizer.load_state_dict(state)
            self.optimizers = [
                opt.user_optimizer if isinstance(opt, ChunkedOptimizer) else opt for opt in self.optimizers
            ]
            if self.world_size > 1 and torch.distributed.is_initialized():
                # no rank leaves (and tears its process group down) while another still communicates
                torch.distributed.barrier()
        super().teardown()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        super().on_exception(exception)

    _final_reports: list[MemoryReport] | None = None  # every rank's report, gathered at the last teardown

    def memory_report_all(self) -> list[MemoryReport]:
        """Every rank's report, in rank order.

        While the Trainer runs (from the strategy's setup in ``fit``/``validate``/``test``/``predict`` to its
        teardown) this is a collective: call it on every rank. After the run it returns the reports gathered
        at teardown, as they stood at the end of the run, without communicating. After a run that ended with
        an exception on several ranks nothing was gathered, and it raises (``memory_report()`` still works).
        """
        if self._manager is None and self._final_reports is not None:
            return list(self._final_reports)
        if self._manager is None and self._final_report is not None:
            raise RuntimeError(
                "The ranks' memory reports were not gathered: the run ended with an exception, and a rank may"
                " have left its collectives. HINT: `memory_report()` returns this rank's report of that run."
            )
        manager = self._require_manager()
        return manager.comm.all_gather_object(manager.memory_report())

    @staticmethod
    def format_rank_summary(reports: list[MemoryReport]) -> str:
        """One line per rank and the totals, for rank 0 to print."""
        fmt = format_bytes
        lines = ["rank  model data   device chunks  host chunks  h2d        d2h        evictions"]
        for r in reports:
            lines.append(
                f"{r.rank:>4}  {fmt(r.model_data_bytes):>11}  {fmt(r.device_chunk_bytes):>13}"
                f"  {fmt(r.host_chunk_bytes):>11}  {fmt(r.h2d_bytes):>9}  {fmt(r.d2h_bytes):>9}  {r.evictions:>9}"
            )
        total = sum(r.model_data_bytes for r in reports)
        lines.append(f"total model data over {len(reports)} ranks: {fmt(total)}")
        return "\n".join(lines)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        entries = (
            (cls.strategy_name, "popen", "PatrickStar chunk-based memory management"),
            ("patrickstar_spawn", "spawn", "PatrickStar, processes started with torch.multiprocessing (notebooks)"),
        )
        for name, start_method, description in entries:
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, start_method=start_method)
