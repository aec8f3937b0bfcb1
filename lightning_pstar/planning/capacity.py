"""Capacity planner: before training, does a model fit, and what is the largest of its family that does?

    python -m lightning_pstar.plan configs/model/gpt_small.yaml --device-memory 80GiB --host-memory 512GiB
    python -m lightning_pstar.plan mypkg.models:build --set n_layer=48 --device-memory 80GiB --host-memory 1TiB

The model is built on the meta device (no memory for weights, :mod:`~lightning_pstar.planning.models`) and
priced by the functions the engine calls at setup (:mod:`~lightning_pstar.planning.requirements`): the same
parameters in the same chunk layout (trainable and frozen parameters in separate families), the same bytes per
element once the optimizer has added its states,

    trainable family: compute dtype + 4 (fp32 master in mixed precision, fp32 grad chunk in 32-true)
                      + optimizer states (Adam 8, SGD with momentum 4, SGD 0)
                      + 4 in mixed precision with gradient accumulation (the fp32 gradient sum)
    frozen family:    compute dtype, + 4 in mixed precision for the fp32 host copy (``frozen_master``)

times the chunk CAPACITY (padding included), so ``CapacityPlan.model_data_bytes`` equals
``ChunkManager.memory_report().model_data_bytes`` of the same model. Activations (non-model data) are not
part of the plan: they depend on the batch and are measured by the warm-up iteration. With
``cpu_embedding`` untied embedding weights stay fp32 on HOST outside the chunks (weight, gradient and
optimizer states, a replica per rank) and count against the host budget.

Both budgets are per rank and mean what the strategy's ``device_memory_limit`` and ``host_memory_limit`` mean
(the strategy's defaults are 0.8 of the accelerator and 0.8 of the RAM per local rank: pass those figures
to plan for a run with default budgets; the "auto" chunk size depends on the device budget). A model
fits when (1) the model data per rank that the device budget leaves to the host fits the host budget and
(2) the parameter chunks that must be resident at once for one module's forward (its own and its
ancestors', whole chunk groups when ranks gather them) fit the device budget: the two checks the engine
makes at setup.

Exit status of the command (:mod:`~lightning_pstar.planning.cli`): 0 the model fits, 1 it does not, 2 bad input.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_pstar.config import SUPPORTED_PRECISIONS, PStarConfig, parse_bytes
from lightning_pstar.planning.capacity_plan import CapacityPlan
from lightning_pstar.planning.disk import DISK_DEPTH, plan_disk_tier
from lightning_pstar.planning.largest import Scale, find_largest
from lightning_pstar.planning.models import ModelTarget, build_gpt, build_meta_model, describe_gpt
from lightning_pstar.planning.requirements import (
    BytesPerElement,
    chunk_layout,
    collect_parameters,
    host_embedding_bytes,
    host_embeddings,
    min_device_bytes,
)
from lightning_pstar.planning.tiers import optimizer_starts_on_host, setup_chunk_room, tier_need

if TYPE_CHECKING:
    from lightning_pstar.demos.gpt import GPTConfig

__all__ = ["OPTIMIZER_STATE_BYTES", "bytes_per_element", "plan_capacity"]

log = logging.getLogger(__name__)

_COMPUTE_ITEMSIZE: dict[str, int] = dict(zip(SUPPORTED_PRECISIONS, (2, 2, 4), strict=True))
"""Bytes per element of the compute dtype of each supported precision (fp16, bf16, fp32)."""
OPTIMIZER_STATE_BYTES: dict[str, int] = {"adam": 8, "adamw": 8, "sgd-momentum": 4, "sgd": 0}
"""Bytes per trainable element of each optimizer's state chunks (Adam: exp_avg + exp_avg_sq)."""


def bytes_per_element(
    precision: str, optimizer: str, *, accumulates: bool = False, frozen_master: bool = True
) -> BytesPerElement:
    """What ``ChunkManager.materialise`` plus ``add_optimizer_chunks`` allocate per chunk element, for a
    ``Trainer(precision=...)`` string and an optimizer name (:data:`OPTIMIZER_STATE_BYTES`)."""
    if precision not in _COMPUTE_ITEMSIZE:
        raise ValueError(
            f"`precision` must be one of {list(_COMPUTE_ITEMSIZE)}, got {precision!r}."
            " HINT: the planner prices the precisions the PatrickStar strategy trains with."
        )
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(
            f"`optimizer` must be one of {list(OPTIMIZER_STATE_BYTES)}, got {optimizer!r}."
            " HINT: use 'sgd-momentum' for SGD with momentum != 0 and 'sgd' for plain SGD."
        )
    return BytesPerElement.of_run(
        compute_itemsize=_COMPUTE_ITEMSIZE[precision],
        optimizer=OPTIMIZER_STATE_BYTES[optimizer],
        accumulates=accumulates,
        frozen_master=frozen_master,
    )


# ---- pure planning --------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class _Settings:
    precision: str
    optimizer: str
    bytes_per_element: BytesPerElement
    device_budget: int
    host_budget: int
    world_size: int
    chunk_elements: int | None  # None: auto
    cpu_embedding: bool
    allocator_friendly: bool = False  # CUDA: the engine's pinned-host-friendly chunk sizes ([Note: pinned memory])
    placement: str = "auto"
    static_fraction: float = 1.0
    warmup_fraction: float = 0.25
    disk_budget: int | None = None  # per rank; None: no disk tier
    optimizer_placement: str = "auto"  # the strategy's placement.optimizer
    optimizer_overlap: str = "auto"  # the strategy's placement.optimizer_overlap


def _settings(
    *,
    device_memory: int | str,
    host_memory: int | str,
    world_size: int,
    precision: str,
    chunk_size: int | str,
    optimizer: str,
    accumulate_grad_batches: int,
    cpu_embedding: bool,
    frozen_master: bool = True,
    device_type: str | None = None,
    placement: str = "auto",
    disk_memory: int | str | None = None,
    optimizer_placement: str = "auto",
    optimizer_overlap: str = "auto",
) -> _Settings:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"`world_size` must be a positive int, got {world_size!r}. HINT: the number of ranks.")
    if isinstance(accumulate_grad_batches, bool) or accumulate_grad_batches < 1:
        raise ValueError(f"`accumulate_grad_batches` must be >= 1, got {accumulate_grad_batches!r}.")
    device_budget = parse_bytes(device_memory, name="device_memory")
    host_budget = parse_bytes(host_memory, name="host_memory")
    config = PStarConfig.from_flat(  # the strategy's validation
        chunk_size=chunk_size,
        placement=placement,
        optimizer_placement=optimizer_placement,
        optimizer_overlap=optimizer_overlap,
    )
    chunk_elements = config.chunks.elements
    mixed = precision != "32-true"
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"  # where the strategy would run here
    if device_type not in ("cuda", "cpu"):
        raise ValueError(
            f"`device_type` must be 'cuda' or 'cpu', got {device_type!r}. HINT: the accelerator the run will use"
            " ('cpu' is the simulated device); leave it unset for this machine's."
        )
    return _Settings(
        precision=precision,
        optimizer=optimizer,
        bytes_per_element=bytes_per_element(
            precision, optimizer, accumulates=mixed and accumulate_grad_batches > 1, frozen_master=frozen_master
        ),
        device_budget=device_budget,
        host_budget=host_budget,
        world_size=world_size,
        chunk_elements=chunk_elements,
        cpu_embedding=cpu_embedding,
        allocator_friendly=device_type == "cuda",
        placement=config.placement.policy,
        static_fraction=config.placement.static_chunk_fraction,
        warmup_fraction=config.placement.warmup_chunk_fraction,
        disk_budget=None if disk_memory is None else parse_bytes(disk_memory, name="disk_memory"),
        optimizer_placement=config.placement.optimizer.value,
        optimizer_overlap=config.placement.optimizer_overlap.value,
    )


def _notes(named: Sequence[tuple[nn.Parameter, str]]) -> list[str]:
    notes = ["activations (non-model data) are not included: leave device memory for them"]
    allocated = [name for p, name in named if not p.is_meta]
    if allocated:
        notes.append(f"{len(allocated)} parameter(s) were not built on the meta device (first: '{allocated[0]}')")
        log.warning("the model factory allocated parameters outside the meta device, e.g. '%s'", allocated[0])
    return notes


def _plan_module(module: nn.Module, description: str, settings: _Settings) -> CapacityPlan:
    """Plan one module: the engine's parameters, layout, per-rank need and tiers, from the same functions."""
    host = host_embeddings(module, for_training=False) if settings.cpu_embedding else {}
    named = collect_parameters(module, exclude={id(p) for p in host.values()})
    if not named:
        raise ValueError(f"The model {description!r} has no parameters. HINT: nothing to plan for PatrickStar.")
    bpe, ws, device = settings.bytes_per_element, settings.world_size, settings.device_budget
    layout = chunk_layout(
        named,
        chunk_elements=settings.chunk_elements,
        device_budget=device,
        compute_itemsize=bpe.param,
        world_size=ws,
        allocator_friendly=settings.allocator_friendly,  # the engine's choice on the same device
    )
    embeddings = host_embedding_bytes(host, optimizer=bpe.optimizer)
    index = {id(p): i for i, (p, _) in enumerate(named)}
    need, where = min_device_bytes(module, layout, index, itemsize=bpe.param, world_size=ws)
    # where the optimizer side starts and the device room chunks get before the warm-up: the engine's placement
    # policies' choices, from the same functions ([Note: the host need] in planning/tiers.py)
    model_data = tier_need(layout, bpe, world_size=ws).per_rank
    on_host = optimizer_starts_on_host(
        settings.placement,
        model_data_bytes=model_data,
        device_budget=device,
        static_fraction=settings.static_fraction,
        warmup_fraction=settings.warmup_fraction,
    )
    if settings.optimizer_placement != "auto":  # the engine's runtime/budgets.py optimizer_start_tier
        on_host = settings.optimizer_placement == "host"
    room = setup_chunk_room(
        settings.placement,
        device_budget=device,
        min_bytes=need,
        static_fraction=settings.static_fraction,
        warmup_fraction=settings.warmup_fraction,
    )
    tiers = tier_need(
        layout, bpe, world_size=ws, host_embedding_bytes=embeddings, optimizer_on_host=on_host,
        chunk_room=room, pinned=settings.allocator_friendly,
    )  # fmt: skip
    disk = None  # the engine's choice of disk families (the pipelined step's buffers): planning/disk.py
    if settings.disk_budget is not None and on_host and tiers.host > settings.host_budget:
        disk = plan_disk_tier(
            layout, master=bpe.master, optimizer=bpe.optimizer, rank=0, world_size=ws,
            excess=tiers.host - settings.host_budget, depth=1 if settings.optimizer_overlap == "off" else DISK_DEPTH,
        )  # fmt: skip
        tiers = tiers.with_disk(disk.on_disk, disk.buffers)
    disk_fits = disk is None or settings.disk_budget is None or disk.file_bytes <= settings.disk_budget
    every = [(p, names[0]) for p, names in named] + [(p, name) for name, p in host.items()]
    num_params = layout.payload_elements + sum(p.numel() for p in host.values())
    trainable_cap = sum(c.capacity for c in layout.chunks if c.trainable)
    frozen_cap = layout.capacity_elements - trainable_cap
    total = layout.family_bytes(trainable_bytes_per_elem=bpe.trainable, frozen_bytes_per_elem=bpe.frozen)
    return CapacityPlan(
        target=description,
        precision=settings.precision,
        optimizer=settings.optimizer,
        world_size=ws,
        num_params=num_params,
        num_trainable_params=sum(p.numel() for p, _ in every if p.requires_grad),
        chunk_size=layout.chunk_size,
        chunk_size_auto=settings.chunk_elements is None,
        num_chunks=len(layout.chunks),
        larger_chunks=sum(1 for c in layout.chunks if c.capacity > layout.chunk_size),
        largest_chunk=max((c.capacity for c in layout.chunks), default=layout.chunk_size),
        num_frozen_chunks=sum(not c.trainable for c in layout.chunks),
        chunk_utilisation=layout.utilisation,
        bytes_per_element=bpe,
        param_chunk_bytes=layout.capacity_elements * bpe.param,
        master_bytes=trainable_cap * bpe.master,
        grad_bytes=trainable_cap * bpe.grad,
        optimizer_state_bytes=trainable_cap * bpe.optimizer,
        frozen_master_bytes=frozen_cap * bpe.frozen_master,
        model_data_bytes=total,
        model_data_bytes_per_rank=tiers.per_rank,
        host_embedding_params=sum(p.numel() for p in host.values()),
        host_embedding_bytes=embeddings,
        bytes_per_param=(total + embeddings) / num_params,
        device_budget=device,
        host_budget=settings.host_budget,
        min_device_bytes=need,
        min_device_module=where,
        device_model_data_bytes=tiers.device,
        host_model_data_bytes=tiers.host,
        host_temporary_bytes=tiers.scratch,
        fits_model_data=tiers.host <= settings.host_budget and disk_fits,
        disk_budget=settings.disk_budget,
        disk_model_data_bytes=disk.file_bytes if disk is not None else 0,
        disk_families=len(disk.family_ids) if disk is not None else 0,
        disk_buffer_bytes=disk.buffers if disk is not None else 0,
        fits_min_device=need <= device,
        optimizer_placement=settings.optimizer_placement,
        optimizer_overlap=settings.optimizer_overlap,
        optimizer_on_host=on_host,
        fits_optimizer_placement=settings.optimizer_placement != "device" or model_data <= device,
        notes=_notes(every),
    )


def plan_capacity(
    target: ModelTarget,
    *,
    device_memory: int | str,
    host_memory: int | str,
    world_size: int = 1,
    precision: str = "bf16-mixed",
    chunk_size: int | str = "auto",
    optimizer: str = "adam",
    accumulate_grad_batches: int = 1,
    cpu_embedding: bool = False,
    frozen_master: bool = True,
    overrides: Mapping[str, Any] | None = None,
    search_largest: bool = True,
    scale: Scale | str = Scale.BOTH,
    device_type: str | None = None,
    placement: str = "auto",
    disk_memory: int | str | None = None,
    optimizer_placement: str = "auto",
    optimizer_overlap: str = "auto",
) -> CapacityPlan:
    """Plan the chunks of ``target`` and say whether it fits ``device_memory`` + ``host_memory`` per rank.

    ``target``: a demo GPT config YAML path, ``pkg.module:factory``, a zero-argument factory or a module
    (any of them built on the meta device; a module given as such is read, never copied). For a demo GPT,
    ``search_largest`` also finds the largest member of its family that fits, growing ``scale``.
    The other options are the strategy's (``chunk_size``, ``cpu_embedding``, ``frozen_master``) and the run's
    (precision, optimizer, gradient accumulation, number of ranks); both budgets are per rank. ``device_type``
    ('cuda' or 'cpu', default: this machine's accelerator) picks the chunk sizes the engine picks there (on CUDA,
    sizes that pinned host memory holds without rounding). ``placement`` ('auto' or 'static', with the
    strategy's default fractions) decides, as in the engine, where the optimizer side starts and how much of the
    device budget chunks may use before the warm-up. ``disk_memory`` (per rank; None: no disk tier) plans the disk
    tier as the engine does with ``disk_path`` set: where the host budget cannot hold the optimizer side, the last
    families keep their fp32 masters and optimizer states on disk, and the largest-model search counts that in.
    ``optimizer_placement`` and ``optimizer_overlap`` are the strategy's options of the same names: where the
    optimizer side starts ("device" does not fit where the model data exceeds the device budget) and how many
    families the disk tier loads at once (one for the serial step, ``DISK_DEPTH`` for the pipelined one).
    """
    try:
        scale = Scale(scale)
    except ValueError:
        accepted = [s.value for s in Scale]
        raise ValueError(
            f"`scale` must be one of {accepted}, got {scale!r}. HINT: 'both' grows depth and width together."
        ) from None
    settings = _settings(
        device_memory=device_memory,
        host_memory=host_memory,
        world_size=world_size,
        precision=precision,
        chunk_size=chunk_size,
        optimizer=optimizer,
        accumulate_grad_batches=accumulate_grad_batches,
        cpu_embedding=cpu_embedding,
        frozen_master=frozen_master,
        device_type=device_type,
        placement=placement,
        disk_memory=disk_memory,
        optimizer_placement=optimizer_placement,
        optimizer_overlap=optimizer_overlap,
    )
    module, description, gpt_config = build_meta_model(target, overrides=overrides)
    plan = _plan_module(module, description, settings)
    if search_largest and gpt_config is not None:

        def plan_member(config: GPTConfig) -> CapacityPlan:
            return _plan_module(build_gpt(config), describe_gpt(asdict(config)), settings)

        plan.largest = find_largest(gpt_config, scale, plan_member, base_plan=plan)
    elif search_largest:
        plan.notes.append("the largest-model search covers the demo GPT family (a model config YAML target)")
    return plan
