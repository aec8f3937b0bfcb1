"""The budgets a :class:`~lightning_pstar.runtime.manager.ChunkManager` plans at setup, before it allocates
(:func:`~lightning_pstar.runtime.setup_plan.plan_setup` calls these).

The device budget (``device_memory_limit``, else a fraction of the GPU; the simulated device has none unless
given), the host budget (``host_memory_limit``, else a fraction of this machine's RAM shared by its ranks),
the layout on this device, and the check that the model fits both, with the capacity planner's arithmetic
(:mod:`lightning_pstar.planning.requirements`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from lightning_pstar.config import OptimizerPlacement, PStarConfig
from lightning_pstar.planning.layout import Layout
from lightning_pstar.planning.requirements import BytesPerElement, chunk_layout, host_embedding_bytes
from lightning_pstar.planning.tiers import MemoryBudgetError, TierNeed, check_budgets, host_breakdown, tier_need
from lightning_pstar.report import format_bytes
from lightning_pstar.runtime.placement import PlacementPolicy
from lightning_pstar.runtime.state import Tier

__all__ = [
    "check_hand_back_fits",
    "optimizer_start_tier",
    "UnboundHostLimitWarning",
    "check_host_after_warmup",
    "check_setup_budgets",
    "device_budget_of",
    "host_budget_of",
    "host_ram_bytes",
    "plan_layout",
    "warn_unbound_host_limit",
]


class UnboundHostLimitWarning(UserWarning):
    """``host_memory_limit`` was set where it bounds little or nothing (a CPU run without a device budget)."""


def host_ram_bytes() -> int:
    """Physical RAM of this machine."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def device_budget_of(config: PStarConfig, device: torch.device) -> int | None:
    """``device_limit``, else ``device_fraction`` of the GPU (None: the simulated device, unlimited)."""
    limit = config.memory.device_limit_bytes
    if limit is not None or device.type == "cpu":
        return limit
    total = torch.cuda.get_device_properties(device).total_memory
    return int(total * config.memory.device_fraction)


def host_budget_of(config: PStarConfig, local_world_size: int) -> int:
    """``host_limit``, else ``host_fraction`` of the RAM shared by the ranks of this machine."""
    limit = config.memory.host_limit_bytes
    if limit is not None:
        return limit
    return int(host_ram_bytes() * config.memory.host_fraction / max(1, local_world_size))


def plan_layout(
    named: Sequence[tuple[nn.Parameter, list[str]]],
    config: PStarConfig,
    *,
    device_budget: int | None,
    compute_dtype: torch.dtype,
    world_size: int,
    device: torch.device,
) -> Layout:
    """The chunk layout of ``named`` on ``device`` (on CUDA, pinned-memory-friendly sizes)."""
    return chunk_layout(
        named,
        chunk_elements=config.chunks.elements,
        device_budget=device_budget,
        compute_itemsize=compute_dtype.itemsize,
        world_size=world_size,
        allocator_friendly=device.type == "cuda",  # pinned host buffers: [Note: pinned memory]
    )


def check_setup_budgets(
    layout: Layout,
    bpe: BytesPerElement,
    *,
    module_need: tuple[int, str],
    host_params: Mapping[str, nn.Parameter],
    world_size: int,
    device_budget: int | None,
    host_budget: int,
    optimizer_on_host: bool,
    static_fraction: float | None,
    chunk_room: int | None,
    pinned: bool,
    disk_split: Callable[[int], tuple[int, int]] | None = None,
) -> TierNeed:
    """Raise a ``MemoryBudgetError`` with the numbers per tier unless the model fits both budgets
    (``module_need``: the bytes one module needs resident, and its name; ``chunk_room``: the device room the
    placement gives chunks before the warm-up; ``pinned``: host chunks are pinned; ``disk_split``: given the host
    need's excess over the budget, the bytes the disk tier takes off the host and its host buffers' bytes, called
    only when the host budget is short: [Note: disk families] in ``runtime/disk_tier.py``). Returns the need, whose
    ``scratch`` the runtime holds back from the host budget ([Note: the host need] in ``planning/tiers.py``)."""
    tiers = tier_need(
        layout,
        bpe,
        world_size=world_size,
        host_embedding_bytes=host_embedding_bytes(host_params, optimizer=bpe.optimizer),
        optimizer_on_host=optimizer_on_host,
        chunk_room=chunk_room,
        pinned=pinned,
    )
    if disk_split is not None and tiers.host > host_budget:
        tiers = tiers.with_disk(*disk_split(tiers.host - host_budget))
    need, where = module_need
    check_budgets(
        need=need,
        where=where,
        tiers=tiers,
        device_budget=device_budget,
        host_budget=host_budget,
        static_fraction=static_fraction,
    )
    return tiers


def warn_unbound_host_limit(config: PStarConfig, device: torch.device) -> bool:
    """Warn when ``host_memory_limit`` is set on a CPU run without ``device_memory_limit``; whether it warned.

    The simulated device then has no budget and keeps every chunk, so nothing is ever offloaded and the host
    budget bounds only what lives on the host whatever the device (fp32 copies of frozen weights, host-resident
    embeddings). The limit is kept, not widened: it still refuses those at setup (after this warning).
    """
    limit = config.memory.host_limit_bytes
    if limit is None or device.type != "cpu" or config.memory.device_limit_bytes is not None:
        return False
    warnings.warn(
        UnboundHostLimitWarning(
            f"host_memory_limit={config.memory.host_limit!r} barely binds on this CPU run: without"
            " device_memory_limit the simulated device has no budget and keeps every chunk, so nothing is offloaded"
            " to the host and the limit bounds only what lives there whatever the device (fp32 copies of frozen"
            " weights, cpu_embedding). HINT: set device_memory_limit to simulate a device"
            " of that size (the host budget then bounds what is offloaded), or drop host_memory_limit."
        ),
        stacklevel=2,
    )
    return True


def check_host_after_warmup(
    layout: Layout,
    bpe: BytesPerElement,
    setup: TierNeed,
    *,
    world_size: int,
    device_budget: int,
    host_budget: int,
    room: int,
    pinned: bool,
) -> None:
    """At the warm-up's optimizer step, before it runs: the host need again, with the least device room chunks
    get once the warm-up has measured the activations (``room``: the budget less their peak) instead of the room
    setup knew of. Activations above the setup's share push more param chunks to the host; a host budget that
    then cannot hold them is refused now, while the weights are still the initial ones ([Note: the host need] in
    ``planning/tiers.py``)."""
    tiers = tier_need(
        layout,
        bpe,
        world_size=world_size,
        host_embedding_bytes=setup.embeddings,
        optimizer_on_host=setup.optimizer_on_host,
        chunk_room=max(room, 0),
        pinned=pinned,
    )
    tiers = tiers.with_disk(setup.disk, setup.disk_buffers)
    if tiers.host <= host_budget:
        return
    raise MemoryBudgetError(
        f"host_memory_limit is too small for this model's iteration: the warm-up measured activations that leave"
        f" chunks {format_bytes(max(room, 0), exact=True)} of the {format_bytes(device_budget, exact=True)} device"
        f" budget at their peak, so the host must hold {format_bytes(tiers.host, exact=True)}"
        f" ({host_breakdown(tiers)}; setup counted {format_bytes(setup.host, exact=True)} before the activations"
        f" were known), but host_memory_limit is {format_bytes(host_budget, exact=True)}. The optimizer step did"
        " not run. HINT: raise host_memory_limit or device_memory_limit, or lower the batch size."
    )


def optimizer_start_tier(
    config: PStarConfig, policy: PlacementPolicy, *, model_data: int, device_budget: int | None
) -> Tier:
    """Where optimizer-side chunks start: the policy's choice under ``placement.optimizer="auto"``, else the tier
    the user named ("device" is refused here, before anything is allocated, where ``model_data``, this rank's
    bytes of every family, cannot fit the device budget)."""
    choice = config.placement.optimizer
    if choice is OptimizerPlacement.HOST:
        return Tier.HOST
    if choice is OptimizerPlacement.DEVICE:
        if device_budget is not None and model_data > device_budget:
            raise MemoryBudgetError(
                f"optimizer_placement='device' needs all model data of this rank on the device:"
                f" {format_bytes(model_data, exact=True)} (params, fp32 masters/grads and optimizer states),"
                f" but device_memory_limit is {format_bytes(device_budget, exact=True)}, before any"
                " activation. HINT: use optimizer_placement='auto' (the families that fit run on the device)"
                " or 'host', raise device_memory_limit, or train on more ranks."
            )
        return Tier.DEVICE
    return policy.optimizer_tier(model_data_bytes=model_data, device_budget=device_budget)


def check_hand_back_fits(config: PStarConfig, *, payload_elements: int, optimizer_bytes: int) -> None:
    """With families on disk, ``hand_back_weights=True`` would copy every fp32 weight and optimizer state
    (``optimizer_bytes`` per element) into host memory at the end of the run (the user's module and optimizer hold
    ordinary tensors): refuse that at setup where it exceeds the machine's RAM, instead of failing after training."""
    if not config.hand_back_weights:
        return
    need = payload_elements * (4 + optimizer_bytes)
    ram = host_ram_bytes()
    if need > ram:
        raise MemoryBudgetError(
            f"hand_back_weights=True would copy the trained fp32 weights and optimizer states into host memory at"
            f" the end of the run: {format_bytes(need)}, more than this machine's RAM ({format_bytes(ram)}); the"
            " disk tier holds them during the run. HINT: pass hand_back_weights=False and take the weights"
            " from a checkpoint (ModelCheckpoint or trainer.save_checkpoint read the disk tier one family at a"
            " time)."
        )
