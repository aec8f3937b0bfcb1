"""What the Trainer strategy and the Fabric strategy both do with the engine: build it, wrap optimizers,
report, and hand the model back at the end.

Both glues call these in the same order, so a model trained by ``Trainer(strategy="patrickstar")`` and by
``Fabric(strategy="patrickstar")`` goes through the same engine code: :func:`build_engine` (checks, plan,
materialise, hooks, buffers), :func:`wrap_optimizers`, the iteration's manager verbs (each glue finds the
iteration's boundaries its own way), and :func:`hand_back` at teardown.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.device_dtype_mixin import _update_properties
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from torch import nn
from torch.optim import Optimizer

from lightning_pstar.checkpoint import drop_weights, restore_family
from lightning_pstar.checkpointing import SafeCheckpointIO
from lightning_pstar.config import HostMalloc, PStarConfig, check_option_names
from lightning_pstar.host_malloc import applied as host_malloc_applied
from lightning_pstar.host_malloc import keep_freed_host_memory
from lightning_pstar.optim import ChunkedOptimizer
from lightning_pstar.optim.user_optimizer import restore_user_optimizer
from lightning_pstar.precision import ChunkPrecision
from lightning_pstar.report import MemoryReport, format_bytes
from lightning_pstar.runtime.comm import ChunkComm
from lightning_pstar.runtime.hooks import ModelHooks
from lightning_pstar.runtime.manager import ChunkManager
from lightning_pstar.setup_checks import (
    parameter_free_metrics,
    refuse_fp32_parametrizations,
    refuse_shared_parameters,
    refuse_shared_storage,
    refuse_sparse_gradients,
    refuse_unhookable_modules,
    refuse_unsupported_dtypes,
)

__all__ = [
    "EndOfRun",
    "EngineAccess",
    "build_engine",
    "cpu_group",
    "format_rank_summary",
    "hand_back",
    "move_buffers",
    "quiet_teardown",
    "register_names",
    "resolve_config",
    "wrap_optimizers",
]

log = logging.getLogger(__name__)


def resolve_config(
    config: PStarConfig | None, options: Mapping[str, Any], *, owner: str, lightning: Sequence[str]
) -> PStarConfig:
    """The strategy's config from ``config=`` or flat keywords (never both); a misspelled keyword (ours or one of
    Lightning's ``lightning`` arguments) raises naming the closest option. ``owner`` names the strategy class."""
    # `**options` catches every other keyword only to name a misspelled one (ours or Lightning's)
    check_option_names(options, lightning=lightning)
    if config is None:
        return PStarConfig.from_flat(**options)
    if not isinstance(config, PStarConfig):
        raise ValueError(
            f"`config` must be a PStarConfig, got {type(config).__name__}."
            f" HINT: build the strategy from a dict or OmegaConf node with {owner}.from_config(...)."
        )
    if options:
        raise ValueError(
            f"{owner} got `config=` together with {sorted(options)}; the config would silently"
            " win. HINT: set them in the config (for example PStarConfig.from_flat(...) or dataclasses.replace)"
            " or pass keywords only."
        )
    return config


def register_names(cls: type, registry: Any) -> None:
    """Register ``"patrickstar"`` (processes started as scripts, torchrun-style) and ``"patrickstar_spawn"``
    (``torch.multiprocessing``, for notebooks) for ``cls`` in a Trainer or Fabric strategy registry."""
    entries = (
        (getattr(cls, "strategy_name", "patrickstar"), "popen", "PatrickStar chunk-based memory management"),
        ("patrickstar_spawn", "spawn", "PatrickStar, processes started with torch.multiprocessing (notebooks)"),
    )
    for name, start_method, description in entries:
        if name not in registry:
            registry.register(name, cls, description=description, start_method=start_method)


def quiet_teardown(*parts: Any) -> None:
    """Tear down Lightning's parts after a failed run without raising (the error being raised is the user's)."""
    for part in parts:
        if part is None:
            continue
        try:
            part.teardown()
        except Exception as err:  # noqa: BLE001 - logged, see above
            log.warning("PatrickStar teardown after a failed run: %s: %s", type(err).__name__, err)


def cpu_group(world_size: int) -> Any | None:
    """A gloo group beside an NCCL world, for pickled objects (None where the world is gloo already, or one
    rank; tensors go through the world's group: [Note: one group per run] in ``runtime/comm.py``). Every rank
    creates it, in the same order."""
    dist = torch.distributed
    if world_size <= 1 or not dist.is_initialized() or dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")


def move_buffers(module: nn.Module, device: torch.device) -> None:
    """Put everything of the module that is not a parameter on ``device``.

    Parameters stay in chunks. Buffers move; parameter-free submodules (torchmetrics metrics, whose states are
    not buffers) move with their own ``.to``; and Lightning's device bookkeeping
    (``_DeviceDtypeModuleMixin._device``, read by ``pl_module.device``) is set to ``device``, so
    ``torch.arange(..., device=self.device)`` lands there. ``.dtype`` stays the fp32 of the weights' truth
    (the masters), as Lightning's own mixed-precision strategies report it.
    """
    for mod in module.modules():
        for name, buf in mod._buffers.items():
            if buf is not None and buf.device != device:
                mod._buffers[name] = buf.to(device)
    for mod in parameter_free_metrics(module):
        mod.to(device)
    _update_properties(module, device=device)


def build_engine(
    module: nn.Module,
    *,
    config: PStarConfig,
    precision: ChunkPrecision,
    device: torch.device,
    rank: int,
    world_size: int,
    local_world_size: int,
    accumulates: bool,
) -> tuple[ChunkManager, ModelHooks]:
    """Plan (every check before anything changes), materialise the model into chunks, install the hooks and
    move the buffers. Called on every rank, in the same order (it may create a process group)."""
    precision.device_type = device.type
    refuse_unhookable_modules(module)
    refuse_unsupported_dtypes(module, precision.compute_dtype)
    refuse_fp32_parametrizations(module, precision.compute_dtype)
    refuse_sparse_gradients(module)
    refuse_shared_storage(module)
    manager = ChunkManager(
        module,
        config=config,
        compute_dtype=precision.compute_dtype,
        device=device,
        precision=str(precision.precision),
        comm=ChunkComm(
            rank=rank,
            world_size=world_size,
            group=torch.distributed.group.WORLD if world_size > 1 else None,
            cpu_group=cpu_group(world_size),
            device=device,
        ),
        local_world_size=local_world_size,
        accumulates=accumulates,
    )  # plans and validates; nothing has changed yet
    if device.type == "cpu":  # [Note: host malloc]
        if config.memory.host_malloc == HostMalloc.CACHED:
            keep_freed_host_memory()
        elif host_malloc_applied():
            log.warning(
                "PatrickStar: memory.host_malloc='system', but an earlier run in this process already told glibc to"
                " keep freed host memory, and glibc has no way back. HINT: start a new process for this run."
            )
    manager.materialise()
    move_buffers(module, device)
    hooks = ModelHooks(manager)
    hooks.install()
    return manager, hooks


def wrap_optimizers(optimizers: Sequence[Optimizer], module: nn.Module | None, manager: ChunkManager) -> list[Any]:
    """The user's optimizers stepped on the chunks (after refusing a parameter shared by two of them)."""
    refuse_shared_parameters(optimizers, module)
    return [ChunkedOptimizer(opt, manager) for opt in optimizers]


@dataclass(kw_only=True)
class EndOfRun:
    """What a run leaves once the engine is gone: its reports and the user's own optimizers."""

    report: MemoryReport
    reports: list[MemoryReport] | None  # every rank's, None after a failure on several ranks (nothing gathered)
    optimizers: list[Any]


def hand_back(manager: ChunkManager, hooks: ModelHooks | None, optimizers: Sequence[Any], *, failed: bool) -> EndOfRun:
    """Remove the hooks and give the model back as an ordinary module (fp32 weights on CPU, as Lightning's own
    teardown leaves it) with the user's optimizers holding the trained state, so a save after the run is
    complete. Called on every rank; after a failure on several ranks nothing is gathered (a rank may be stuck
    in, or gone from, a collective) and the model keeps its chunk views. With ``hand_back_weights=False`` the
    weights and optimizer states are not copied out (:func:`drop_weights`)."""
    manager.grad_guard.remove(check=False)  # no stand-in p.grad leaves with the model ([Note: gradients user ...])
    try:
        return _hand_back(manager, hooks, optimizers, failed=failed)
    finally:
        if manager.disk is not None:  # the disk tier's files and run directory go with the run, whatever happened
            manager.disk.close()


def _hand_back(manager: ChunkManager, hooks: ModelHooks | None, optimizers: Sequence[Any], *, failed: bool) -> EndOfRun:
    if hooks is not None:
        hooks.remove()
    for opt in optimizers:  # its own methods again ([Note: the user's own optimizer] in optim/user_optimizer.py)
        if isinstance(opt, ChunkedOptimizer):
            restore_user_optimizer(opt.user_optimizer)
    try:
        manager.finish_steps()  # a step in flight ends before the weights leave
    finally:
        manager.pipeline.close()  # its worker threads end with the run
    report = manager.memory_report()
    if manager.torn:
        log.warning(
            "PatrickStar: a backward raised after %d families had stepped inside it: the model handed back holds a"
            " mix of two steps' weights. HINT: resume from a checkpoint saved before the failure.",
            len(manager.torn),
        )
    if failed and manager.world_size > 1:
        return EndOfRun(report=report, reports=None, optimizers=list(optimizers))
    reports = manager.comm.all_gather_object(report)
    chunked = [opt for opt in optimizers if isinstance(opt, ChunkedOptimizer)]
    if manager.config.hand_back_weights:
        for opt, state in zip(chunked, _stream_back(manager, chunked), strict=True):
            opt.user_optimizer.load_state_dict(state)
    else:
        drop_weights(manager)  # the weights left through a checkpoint: nothing is copied out
    users = [opt.user_optimizer if isinstance(opt, ChunkedOptimizer) else opt for opt in optimizers]
    if manager.world_size > 1 and torch.distributed.is_initialized():
        torch.distributed.barrier()  # no rank leaves (and tears its process group down) while another communicates
    return EndOfRun(report=report, reports=reports, optimizers=users)


def _stream_back(manager: ChunkManager, chunked: Sequence[ChunkedOptimizer]) -> list[dict[str, Any]]:
    """Every optimizer's state dict (torch's layout) and the weights as ordinary CPU tensors, family by family:
    a family's optimizer states and weights are copied out and its chunks freed before the next family is read,
    so the host never holds the chunks and a second copy of the model data (issue 12). Same collectives in the
    same order on every rank (each family: its optimizer's states, then its weights)."""
    read: list[dict[int, dict[str, torch.Tensor]]] = [{} for _ in chunked]
    for family in manager.families:
        for opt, states in zip(chunked, read, strict=True):
            if opt.state_io.covers(family):
                states.update(opt.state_io.family_states(family))
        restore_family(manager, family, torch.device("cpu"))  # gives the family's pinned blocks back too
    return [opt.state_io.assemble(states) for opt, states in zip(chunked, read, strict=True)]


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


class EngineAccess:
    """The engine and its memory reports, as both strategies offer them.

    A strategy sets ``_manager`` while the engine is up and ``_final_report`` / ``_final_reports`` when it hands the
    model back; ``_NOT_SET_UP`` says when the engine exists (the glue's own words)."""

    _manager: ChunkManager | None = None
    _final_report: MemoryReport | None = None
    _final_reports: list[MemoryReport] | None = None  # every rank's report, gathered at the last hand-back
    _NOT_SET_UP = "HINT: call this once the model is set up."
    _checkpoint_io: CheckpointIO | None

    @property
    def checkpoint_io(self) -> CheckpointIO:
        """SafeCheckpointIO unless another was given, also as the base of a wrapping IO given without one
        ([Note: the checkpoint IO] in checkpointing.py): both strategies hold none until asked."""
        io = self._checkpoint_io
        if io is None:
            io = self._checkpoint_io = SafeCheckpointIO()
        elif isinstance(io, _WrappingCheckpointIO) and io.checkpoint_io is None:
            io.checkpoint_io = SafeCheckpointIO()
        return io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    @property
    def chunk_manager(self) -> ChunkManager:
        """The engine behind this strategy (available once the model is set up)."""
        return self._require_manager()

    def _require_manager(self) -> ChunkManager:
        if self._manager is None:
            raise RuntimeError(f"The PatrickStar engine is not set up yet. {self._NOT_SET_UP}")
        return self._manager

    def memory_report(self) -> MemoryReport:
        """Bytes of chunks per tier, peak device bytes, transfer volume, evictions and chunk utilisation.

        After the run has ended, the report as it stood at the end of the run.
        """
        if self._manager is None and self._final_report is not None:
            return self._final_report
        return self._require_manager().memory_report()

    def memory_report_all(self) -> list[MemoryReport]:
        """Every rank's report, in rank order.

        While the engine is up this is a collective: call it on every rank. After the run it returns the reports
        gathered when the model was handed back, without communicating. After a run that ended with an exception on
        several ranks nothing was gathered, and it raises (``memory_report()`` still works).
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
        return format_rank_summary(reports)
