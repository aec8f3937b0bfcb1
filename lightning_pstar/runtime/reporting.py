"""The memory report of one chunk manager: what its chunks hold and moved, per tier and per moment."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from lightning_pstar.planning.layout import Layout
from lightning_pstar.report import MemoryReport
from lightning_pstar.runtime.comm import ChunkComm
from lightning_pstar.runtime.family import ParamTable
from lightning_pstar.runtime.optimizer_side import optimizer_placement_summary
from lightning_pstar.runtime.pinned import host_arena
from lightning_pstar.runtime.pipeline import StepPipeline
from lightning_pstar.runtime.residency import Residency
from lightning_pstar.runtime.sharding_factory import Sharding
from lightning_pstar.runtime.state import Tier
from lightning_pstar.runtime.tracer import MemoryTracer, MomentKind

__all__ = ["build_report", "module_names"]


def module_names(module: nn.Module, table: ParamTable) -> list[str]:
    """The name of each module with chunk parameters, by module index (the moments' keys)."""
    names = {mod: name for name, mod in module.named_modules()}
    return [names.get(mod) or "<root>" for mod in table.module_records]


def _label(kind: MomentKind, key: int, names: Sequence[str]) -> str:
    """``"fwd:blocks.0.attn"``, ``"bwd:head"``, ``"step"``: the moment and the module it belongs to."""
    if kind is MomentKind.STEP:
        return "step"
    name = names[key] if key < len(names) else str(key)
    return f"{'fwd' if kind is MomentKind.FORWARD else 'bwd'}:{name}"


def build_report(
    *,
    table: ParamTable,
    layout: Layout,
    residency: Residency,
    tracer: MemoryTracer,
    comm: ChunkComm,
    sharding: Sharding,
    precision: str,
    moment_chunk_bytes: Mapping[int, int],
    names: Sequence[str],
    pipeline: StepPipeline | None = None,
    overlap: str = "auto",
    nonfinite_skipped_steps: int = 0,
) -> MemoryReport:
    trace = tracer.trace
    stats = residency.stats
    bounds = residency.bounds
    allocated = sum(c.nbytes for c in table.iter_chunks() if c.tier is not None)
    payload_bytes = 0
    for family in table.families:
        per_elem = sum(c.dtype.itemsize for c in family.chunks.values() if c.tier is not None)
        payload_bytes += per_elem * sum(s.numel for s in family.slots)
    return MemoryReport(
        precision=precision,
        num_params=layout.payload_elements,
        num_chunks=len(table.families),
        chunk_size=layout.chunk_size,
        larger_chunks=sum(1 for c in layout.chunks if c.capacity > layout.chunk_size),
        largest_chunk=max((c.capacity for c in layout.chunks), default=layout.chunk_size),
        chunk_utilisation=layout.utilisation,
        model_data_bytes=allocated,
        model_data_bytes_per_param=payload_bytes / max(1, layout.payload_elements),
        device_chunk_bytes=stats.per_tier_bytes[Tier.DEVICE],
        host_chunk_bytes=stats.per_tier_bytes[Tier.HOST],
        peak_device_chunk_bytes=stats.peak_device_bytes,
        h2d_bytes=stats.h2d_bytes,
        d2h_bytes=stats.d2h_bytes,
        evictions=stats.evictions,
        moves_off_device=stats.moves_off_device,
        device_memory_limit=residency.device_budget,
        host_memory_limit=residency.host_budget,
        optimizer_tier=optimizer_placement_summary(residency),
        placement=residency.policy.name,
        rank=comm.rank,
        world_size=comm.world_size,
        gathered_bytes=comm.gathered_bytes,
        reduced_bytes=comm.reduced_bytes,
        group_gathers=sharding.gathers,
        group_prefetches=sharding.prefetches,
        group_reductions=sharding.reductions,
        group_second_rounds=sharding.second_rounds,
        groups_kept=len(sharding.keep),
        prefetches=stats.prefetches,
        demand_fetches=stats.demand_fetches,
        prefetch_hits=stats.prefetch_hits,
        prefetch_lead_moments=stats.prefetch_lead_moments,
        prefetches_wasted=stats.prefetches_wasted,
        early_evictions=stats.early_evictions,
        eviction_waits=residency.eviction_waits,
        peak_non_model_bytes=trace.peak_non_model,
        moment_non_model_bytes=[m.non_model_bytes for m in trace.moments],
        moment_device_chunk_bytes=[moment_chunk_bytes.get(i, 0) for i in range(len(trace.moments))],
        moment_labels=[_label(m.kind, m.key, names) for m in trace.moments],
        pinned_bytes=host_arena().held_bytes,
        moved_bytes_per_iteration=residency.last_iteration_moved_bytes,
        optimal_bytes_lower_bound=bounds.lower if bounds is not None else None,
        optimal_bytes_upper_bound=bounds.upper if bounds is not None else None,
        optimal_bytes_per_iteration=bounds.exact if bounds is not None else None,
        clean_moves=stats.clean_moves,
        clean_bytes=stats.clean_bytes,
        dirty_moves=stats.dirty_moves,
        host_copy_bytes=stats.host_copy_bytes,
        optimizer_overlap=overlap,
        nonfinite_skipped_steps=nonfinite_skipped_steps,
        host_step_jobs=pipeline.times.jobs if pipeline is not None else 0,
        host_steps_in_backward=pipeline.times.in_backward if pipeline is not None else 0,
        host_copies_back_in_backward=pipeline.times.back_in_backward if pipeline is not None else 0,
        host_norms_in_backward=pipeline.times.norms_in_backward if pipeline is not None else 0,
        host_sums_in_backward=pipeline.times.sums_in_backward if pipeline is not None else 0,
        step_d2h_bytes=stats.step_d2h_bytes,
        step_h2d_bytes=stats.step_h2d_bytes,
        step_stage_seconds=pipeline.times.seconds() if pipeline is not None else {},
        optimizer_schedule=pipeline.schedule if pipeline is not None else None,
        schedule_trial_ms=dict(pipeline.trial_ms) if pipeline is not None else {},
        **_disk_fields(residency),
    )


def _disk_fields(residency: Residency) -> dict[str, Any]:
    """The report's disk-tier fields (none without a disk tier: the defaults)."""
    disk = residency.disk
    if disk is None:
        return {}
    total = disk.store.stats()
    last = disk.last_iteration
    return {
        "disk_families": len(disk.family_ids),
        "disk_chunk_bytes": residency.stats.per_tier_bytes.get(Tier.DISK, 0),
        "disk_bytes_read": total.bytes_read,
        "disk_bytes_written": total.bytes_written,
        "disk_read_bytes_per_iteration": last.bytes_read if last is not None else None,
        "disk_written_bytes_per_iteration": last.bytes_written if last is not None else None,
        "disk_read_gbps": total.read_gbps,
        "disk_write_gbps": total.write_gbps,
    }
