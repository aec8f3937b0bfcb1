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
from typing_extensions import override

from lightning_pstar.checkpoint.io import (
    SHARDED_KEY,
    CheckpointError,
    SafeCheckpointIO,
    read_sharded_tensors,
    stored_keys,
    write_sharded,
)
from lightning_pstar.config import LossScaleConfig, PStarConfig
from lightning_pstar.hardware import warn_if_slow_bf16
from lightning_pstar.optim import ChunkedOptimizer
from lightning_pstar.precision import PatrickStarPrecision
from lightning_pstar.report import MemoryReport, format_bytes
from lightning_pstar.runtime.comm import ChunkComm
from lightning_pstar.runtime.hooks import ModelHooks
from lightning_pstar.runtime.manager import ChunkManager

__all__ = ["PatrickStarStrategy"]

log = logging.getLogger(__name__)

_D = PStarConfig()  # the defaults, stated once in config.py


class PatrickStarStrategy(DDPStrategy):
    """Train models larger than the accelerator's memory with chunk-based memory management.

    Every option is a field of :class:`~lightning_pstar.config.PStarConfig` (documented there); pass them
    as keywords or as one ``config``. The remaining arguments are Lightning's own.
    """

    strategy_name = "patrickstar"

    def __init__(
        self,
        *,
        chunk_size: int | str = _D.chunk_size,
        placement: str = _D.placement,
        device_memory_limit: int | str | None = _D.device_memory_limit,
        host_memory_limit: int | str | None = _D.host_memory_limit,
        device_memory_fraction: float = _D.device_memory_fraction,
        host_memory_fraction: float = _D.host_memory_fraction,
        static_chunk_fraction: float = _D.static_chunk_fraction,
        warmup_chunk_fraction: float = _D.warmup_chunk_fraction,
        cpu_embedding: bool = _D.cpu_embedding,
        checkpoint: str = _D.checkpoint,
        frozen_master: bool = _D.frozen_master,
        loss_scale: LossScaleConfig | Mapping[str, Any] | None = None,
        config: PStarConfig | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        if config is None:
            config = PStarConfig(
                chunk_size=chunk_size,
                placement=placement,
                device_memory_limit=device_memory_limit,
                host_memory_limit=host_memory_limit,
                device_memory_fraction=device_memory_fraction,
                host_memory_fraction=host_memory_fraction,
                static_chunk_fraction=static_chunk_fraction,
                warmup_chunk_fraction=warmup_chunk_fraction,
                cpu_embedding=cpu_embedding,
                checkpoint=checkpoint,
                frozen_master=frozen_master,
                loss_scale=LossScaleConfig(**loss_scale)
                if isinstance(loss_scale, Mapping)
                else (loss_scale or LossScaleConfig()),
            )
        self.config = config
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

    @classmethod
    def from_config(cls, options: Mapping[str, Any], **lightning_args: Any) -> PatrickStarStrategy:
        """Build the strategy from a dict or OmegaConf node (e.g. a Hydra group); unknown keys raise."""
        return cls(config=PStarConfig.from_mapping(options), **lightning_args)

    # ---- precision ------------------------------------------------------------------------------------
    @property
    def precision_plugin(self) -> PatrickStarPrecision:
        plugin = self._precision_plugin
        if not isinstance(plugin, PatrickStarPrecision):
            plugin = PatrickStarPrecision.from_plugin(plugin or Precision(), self.config.loss_scale)
            self._precision_plugin = plugin
        return plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning hands over a generic plugin for `Trainer(precision=...)`: convert it (and reject
        # unsupported precisions such as 64-true here, before anything is set up)
        self._precision_plugin = (
            None if plugin is None else PatrickStarPrecision.from_plugin(plugin, self.config.loss_scale)
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

    def _move_buffers(self, module: nn.Module) -> None:
        device = self.root_device
        for mod in module.modules():
            for name, buf in mod._buffers.items():
                if buf is not None and buf.device != device:
                    mod._buffers[name] = buf.to(device)

    @override
    def model_to_device(self) -> None:
        # parameters live in chunks; only buffers follow the module (see `_move_buffers`)
        if self.lightning_module is not None:
            self._move_buffers(self.lightning_module)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        manager = self._require_manager()
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
        with self._hooks.saved_tensors():
            return super().training_step(*args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._manager is not None:
            self._manager.end_warmup_if_recording()
        return result

    def _leave_training(self) -> None:
        if self._manager is not None:
            self._manager.in_training = False
            self._manager.settle()

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
        manager.accumulating = True
        try:
            yield
        finally:
            manager.accumulating = False

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        if self._manager is not None:
            self._manager.begin_backward()  # every rank is here: collectives may start (see groups.py)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if self._manager is not None:
            self._manager.settle()

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
        return self._manager.full_state_dict(rank0_only=True)

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
        manager = self._manager
        tensors = manager.owned_tensors()
        for k, opt in enumerate(self.optimizers):
            inner = getattr(opt, "_optimizer", opt)
            if isinstance(inner, ChunkedOptimizer):
                tensors.update(inner.owned_state_tensors(f"optim/{k}/"))
        meta = dict(checkpoint)
        info = manager.sharded_info()
        info["param_groups"] = [state["param_groups"] for state in checkpoint.get("optimizer_states", [])]
        meta[SHARDED_KEY + "_info"] = info
        meta[SHARDED_KEY] = True
        meta["optimizer_states"] = []
        write_sharded(Path(filepath), meta=meta, tensors=tensors, rank=self.global_rank, barrier=self.barrier)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        self._loading_from = path
        return self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._manager is None:
            super().load_model_state_dict(checkpoint, strict=strict)
            return
        source = checkpoint.get(SHARDED_KEY) or getattr(self, "_loading_from", None) or "the checkpoint"
        try:
            if checkpoint.get(SHARDED_KEY):
                path = Path(checkpoint[SHARDED_KEY])
                stored = stored_keys(path)
                self._manager.load_owned_tensors(
                    stored, lambda wanted: read_sharded_tensors(path, wanted), checkpoint.get("state_dict", {})
                )
                return
            self._manager.load_full_state_dict(checkpoint["state_dict"], strict=strict)
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
        groups = checkpoint[SHARDED_KEY + "_info"]["param_groups"]
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
            self._manager.restore_module(torch.device("cpu"))
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
