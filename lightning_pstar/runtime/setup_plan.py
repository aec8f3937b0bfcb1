"""What a :class:`~lightning_pstar.runtime.manager.ChunkManager` decides at setup, before it allocates anything.

:func:`plan_setup` finds the parameters and where they go (``cpu_embedding`` keeps embeddings on the host,
outside the chunks), the chunk layout and its parameter table, the budgets of both tiers, the placement policy,
the tier the optimizer side starts on and, where ``disk_path`` is set and the host budget is short, the families
whose optimizer side lives on disk; then it checks that the model fits, with the capacity planner's arithmetic
(:mod:`~lightning_pstar.runtime.budgets`). Bad input fails here, before anything changes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from lightning_pstar.config import OptimizerOverlap, PStarConfig
from lightning_pstar.planning.layout import Layout
from lightning_pstar.planning.requirements import (
    BytesPerElement,
    TierNeed,
    collect_parameters,
    host_embeddings,
    min_device_bytes,
    tier_need,
)
from lightning_pstar.runtime.budgets import (
    check_hand_back_fits,
    check_host_after_warmup,
    check_setup_budgets,
    device_budget_of,
    host_budget_of,
    optimizer_start_tier,
    plan_layout,
    warn_unbound_host_limit,
)
from lightning_pstar.runtime.disk import check_disk_path
from lightning_pstar.runtime.disk_tier import DISK_DEPTH, DiskPlan, plan_disk_tier
from lightning_pstar.runtime.family import ParamTable
from lightning_pstar.runtime.placement import PlacementPolicy, make_policy
from lightning_pstar.runtime.state import Tier
from lightning_pstar.runtime.tracer import MemoryTracer

__all__ = ["ADAM_STATE_BYTES", "SetupPlan", "plan_setup", "run_bytes_per_element"]

log = logging.getLogger(__name__)

ADAM_STATE_BYTES = 8  # what setup assumes before the optimizer is known: the most a supported one needs


@dataclass(kw_only=True, eq=False)
class SetupPlan:
    """Everything setup decided; nothing of it is allocated yet."""

    host_params: dict[str, nn.Parameter]
    """``cpu_embedding``: the parameters kept on the host outside the chunks, by name."""
    named: list[tuple[nn.Parameter, list[str]]]
    """The chunked parameters (each once, with all its names), in layout order."""
    layout: Layout
    table: ParamTable
    bpe: BytesPerElement
    """Bytes per element of each chunk kind, with the optimizer states setup assumes (``ADAM_STATE_BYTES``)."""
    module_need: tuple[int, str]
    """Bytes of param chunks that must be resident at once for one module's forward, and its name."""
    model_data_bytes: int
    """Bytes of the families this rank owns once the optimizer's states exist."""
    device_budget: int | None
    host_budget: int
    policy: PlacementPolicy
    optimizer_start: Tier
    """Where optimizer-side chunks start (:func:`~lightning_pstar.runtime.budgets.optimizer_start_tier`)."""
    need: TierNeed
    """The need per tier; its ``scratch`` and ``disk_buffers`` are held back from the host budget."""
    disk_plan: DiskPlan | None
    """The families on disk ([Note: disk families] in ``runtime/disk_tier.py``); None: the host holds them all."""
    world_size: int
    pinned: bool
    """Host chunks are pinned (CUDA)."""

    def agreement(self) -> tuple[tuple[int, int, int, int], str]:
        """What every rank must have planned alike: a summary (parameters, payload elements, chunk size,
        families) and the detail (every parameter and chunk) that names a difference."""
        detail = repr([(names[0], tuple(p.shape), p.requires_grad) for p, names in self.named])
        detail += repr([(c.capacity, c.trainable, c.members, c.offsets) for c in self.layout.chunks])
        summary = (len(self.named), self.layout.payload_elements, self.layout.chunk_size, len(self.table.families))
        return summary, detail

    def check_host_after_warmup(self, *, room: int, device_budget: int, host_budget: int) -> None:
        """:func:`~lightning_pstar.runtime.budgets.check_host_after_warmup` with what setup planned."""
        check_host_after_warmup(
            self.layout, self.bpe, self.need, world_size=self.world_size, device_budget=device_budget,
            host_budget=host_budget, room=room, pinned=self.pinned,
        )  # fmt: skip


def run_bytes_per_element(
    config: PStarConfig, *, compute_dtype: torch.dtype, accumulates: bool, optimizer: int = ADAM_STATE_BYTES
) -> BytesPerElement:
    """Bytes per element of each chunk kind of a run (``accumulates``: mixed precision keeps an fp32 sum)."""
    return BytesPerElement.of_run(
        compute_itemsize=compute_dtype.itemsize,
        optimizer=optimizer,
        accumulates=compute_dtype != torch.float32 and accumulates,
        frozen_master=config.mixed_precision.frozen_master,
    )


def plan_setup(
    module: nn.Module,
    config: PStarConfig,
    *,
    compute_dtype: torch.dtype,
    device: torch.device,
    rank: int,
    world_size: int,
    local_world_size: int,
    accumulates: bool,
    tracer: MemoryTracer,
    policy: PlacementPolicy | None = None,
) -> SetupPlan:
    """Parameters and where they go, the layout, the budgets and their check: nothing is allocated.

    ``policy``: the placement policy (default: the one ``config`` names, reading ``tracer``).
    """
    host_params = host_embeddings(module) if config.chunks.cpu_embedding else {}
    named = collect_parameters(module, exclude={id(p) for p in host_params.values()})
    if not named:
        raise ValueError("The model has no parameters; there is nothing for PatrickStar to manage.")
    device_budget = device_budget_of(config, device)
    layout = plan_layout(
        named, config, device_budget=device_budget, compute_dtype=compute_dtype, world_size=world_size, device=device
    )
    table = ParamTable(module, layout, named)
    index = {id(p): i for i, (p, _) in enumerate(named)}
    module_need = min_device_bytes(module, layout, index, itemsize=compute_dtype.itemsize, world_size=world_size)
    host_budget = host_budget_of(config, local_world_size)
    if policy is None:
        policy = make_policy(
            config.placement.policy,
            tracer,
            static_chunk_fraction=config.placement.static_chunk_fraction,
            warmup_chunk_fraction=config.placement.warmup_chunk_fraction,
        )
    bpe = run_bytes_per_element(config, compute_dtype=compute_dtype, accumulates=accumulates)
    model_data = tier_need(layout, bpe, world_size=world_size).per_rank
    start = optimizer_start_tier(config, policy, model_data=model_data, device_budget=device_budget)
    warn_unbound_host_limit(config, device)
    split = None
    if config.memory.disk_path is not None and start is Tier.HOST:
        split = _DiskSplit(layout, bpe, config, rank=rank, world_size=world_size)
    need = check_setup_budgets(
        layout,
        bpe,
        module_need=module_need,
        host_params=host_params,
        world_size=world_size,
        device_budget=device_budget,
        host_budget=host_budget,
        optimizer_on_host=start is Tier.HOST,
        static_fraction=config.placement.static_chunk_fraction if policy.name == "static" else None,
        chunk_room=policy.chunk_room(device_budget, module_need[0]),
        pinned=device.type == "cuda",
        disk_split=split,
    )
    disk_plan = split.plan if split is not None else None
    _check_disk(config, disk_plan, layout, bpe)
    return SetupPlan(
        host_params=host_params, named=named, layout=layout, table=table, bpe=bpe, module_need=module_need,
        model_data_bytes=model_data, device_budget=device_budget, host_budget=host_budget, policy=policy,
        optimizer_start=start, need=need, disk_plan=disk_plan, world_size=world_size, pinned=device.type == "cuda",
    )  # fmt: skip


def _check_disk(config: PStarConfig, disk_plan: DiskPlan | None, layout: Layout, bpe: BytesPerElement) -> None:
    """With families on disk, their directory and the hand-back at the end must fit: refused before anything is
    allocated."""
    if disk_plan is not None and disk_plan.family_ids:
        check_disk_path(config.memory.disk_path, disk_plan.file_bytes, config.memory.disk_limit_bytes)
        check_hand_back_fits(config, payload_elements=layout.payload_elements, optimizer_bytes=bpe.optimizer)
    elif config.memory.disk_path is not None:
        log.info("PatrickStar: disk_path is set, but the host budget holds the optimizer side: no disk tier.")


class _DiskSplit:
    """The disk tier's share of the host need (``check_setup_budgets``'s ``disk_split``): :func:`plan_disk_tier`,
    whose plan it keeps for setup to open the tier."""

    def __init__(
        self, layout: Layout, bpe: BytesPerElement, config: PStarConfig, *, rank: int, world_size: int
    ) -> None:
        self._layout, self._bpe, self._rank, self._world_size = layout, bpe, rank, world_size
        self._serial = config.placement.optimizer_overlap is OptimizerOverlap.OFF  # one family loaded at a time
        self.plan: DiskPlan | None = None

    def __call__(self, excess: int) -> tuple[int, int]:
        bpe = self._bpe
        self.plan = plan_disk_tier(
            self._layout, master=bpe.master, optimizer=bpe.optimizer, rank=self._rank, world_size=self._world_size,
            excess=excess, depth=1 if self._serial else DISK_DEPTH,
        )  # fmt: skip
        return self.plan.on_disk, self.plan.buffers
