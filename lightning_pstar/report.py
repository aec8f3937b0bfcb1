"""The memory report: what the engine holds and moved, per tier, per moment and per rank."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["MemoryReport", "format_bytes", "format_chunk_counts"]

_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(n: int | float | None, *, exact: bool = False) -> str:
    """The one byte formatter: ``"512 B"``, ``"1.50 KiB"``, ``"29.5 MiB"``, ``"287 MiB"``, ``"18.8 GiB"``.

    Binary units, three significant digits, the largest unit the count reaches (so a small count reads in
    KiB or B, never as "0.0 MiB"); None reads "unlimited" (a budget that is not set). ``exact`` (error
    messages, where the count is what a user copies) leads with the count: ``"1,572,864 bytes (1.50 MiB)"``.
    """
    if n is None:
        return "unlimited"
    human = f"{n:.0f} B"
    for unit, size in _UNITS:
        if abs(n) >= size:
            value = n / size
            digits = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
            human = f"{value:.{digits}f} {unit}"
            break
    return f"{int(n):,} bytes ({human})" if exact else human


def format_chunk_counts(
    num_chunks: int, chunk_size: int, *, larger_chunks: int = 0, largest_chunk: int = 0, auto: bool = False
) -> str:
    """The one chunk line of the memory report and the planner: ``"8 x 4,096 elements"``, or
    ``"10: 8 of 4,096 elements, 2 larger (up to 65,536)"`` where parameters larger than the chunk size got
    chunks of their own; ``auto`` marks a chunk size the engine chose (``"4,096 elements (auto)"``)."""
    size = f"{chunk_size:,} elements{' (auto)' if auto else ''}"
    if larger_chunks == 0:
        return f"{num_chunks} x {size}"
    return f"{num_chunks}: {num_chunks - larger_chunks} of {size}, {larger_chunks} larger (up to {largest_chunk:,})"


@dataclass(kw_only=True)
class MemoryReport:
    """What the engine holds and moved. Bytes unless said otherwise."""

    precision: str
    num_params: int  # unique parameter elements
    num_chunks: int  # chunk families
    chunk_size: int  # elements
    larger_chunks: int = 0  # chunk families with a larger capacity (a parameter larger than chunk_size, its group)
    largest_chunk: int = 0  # elements of the largest chunk capacity (chunk_size when none is larger)
    chunk_utilisation: float  # parameter elements / param-chunk capacity
    model_data_bytes: int  # every chunk allocated, all tiers
    model_data_bytes_per_param: float  # slot bytes per parameter element, padding excluded (see the property below)
    device_chunk_bytes: int
    host_chunk_bytes: int
    peak_device_chunk_bytes: int
    h2d_bytes: int
    d2h_bytes: int
    evictions: int  # param chunks moved off the device because the budget needed their room
    device_memory_limit: int | None
    host_memory_limit: int | None
    optimizer_tier: str  # where the optimizer step runs, per chunk family
    placement: str = "static"
    prefetches: int = 0  # chunks fetched ahead of their moment
    # [Note: fetch and prefetch] in runtime/lookahead.py
    demand_fetches: int = 0  # param chunks a module found on the host and waited for (stalls)
    prefetch_lead_moments: int = 0  # moments between each prefetch and the moment it was for, summed
    prefetch_hits: int = 0  # prefetched param chunks on the device (or on their way) when a module needed them
    prefetches_wasted: int = 0  # prefetched param chunks evicted before their moment
    early_evictions: int = 0  # evictions the prefetch moved earlier to make room (the same bytes, sooner)
    eviction_waits: int = 0  # CUDA: fetches that waited for an eviction's copy to free its device block
    moves_off_device: int = 0  # every chunk move from the device to the host (evictions, offloaded steps, ...)
    peak_non_model_bytes: int = 0  # warm-up peak of non-model memory on the device
    moment_non_model_bytes: list[int] = field(default_factory=list)  # per moment of the warm-up trace
    moment_device_chunk_bytes: list[int] = field(default_factory=list)  # per moment, last iteration seen
    moment_labels: list[str] = field(default_factory=list)  # "fwd:blocks.0.attn", "bwd:head", "step"
    rank: int = 0
    world_size: int = 1
    gathered_bytes: int = 0  # received by all-gathers of chunk groups (ZeRO data parallelism)
    reduced_bytes: int = 0  # sent to reduce-scatters of gradients
    group_gathers: int = 0  # all-gathers of chunk groups started (prefetches included)
    group_prefetches: int = 0  # ... of which started ahead of use, overlapping the current group's compute
    group_reductions: int = 0  # reduce-scatters of chunk groups' gradients started
    group_second_rounds: int = 0  # ... of which second rounds (gradients some rank had after the group's first)
    groups_kept: int = 0  # chunk groups a training forward keeps gathered for its backward (agreed after warm-up)
    pinned_bytes: int = 0  # pinned host memory torch's host allocator holds for chunk buffers (runtime/pinned.py)
    # placement's traffic against the yardstick ([Note: the yardstick] in runtime/yardstick.py); None: not known
    # (no device budget, before the first iteration after the warm-up, several ranks or optimizer steps)
    moved_bytes_per_iteration: int | None = None  # bytes chunk moves copied in the last iteration after warm-up
    optimal_bytes_lower_bound: int | None = None  # no placement can move fewer bytes per iteration
    optimal_bytes_upper_bound: int | None = None  # what a feasible plan moves (the one auto follows)
    optimal_bytes_per_iteration: int | None = None  # the optimum, where the two bounds meet
    clean_moves: int = 0  # moves off the device that copied nothing (the host copy was current)
    clean_bytes: int = 0  # bytes those clean moves did not copy
    dirty_moves: int = 0  # moves off the device that copied the bytes back
    host_copy_bytes: int = 0  # host copies of device-resident chunks, kept for clean evictions
    # the host-side optimizer step ([Note: the step pipeline] in runtime/pipeline.py)
    optimizer_overlap: str = "auto"  # the schedule asked for: "auto", "pipeline", "next_forward" or "off"
    optimizer_schedule: str | None = (
        None  # what runs: "pipeline", "serial" or "next_forward"; None while "auto" times them
    )
    schedule_trial_ms: dict[str, float] = field(default_factory=dict)  # "auto": median ms per step of each
    host_step_jobs: int = 0  # family steps that ran through the pipeline
    host_steps_in_backward: int = 0  # ... of which started during the backward
    host_copies_back_in_backward: int = 0  # ... of which copied back during it (see optim/overlap.py)
    host_norms_in_backward: int = 0  # families whose gradient norms (clipping) were computed during the backward
    host_sums_in_backward: int = 0  # families' accumulated gradients summed on a host lane during the backward
    step_d2h_bytes: int = 0  # copied to the host by those steps (also counted in d2h_bytes)
    step_h2d_bytes: int = 0  # copied back to the device by them (also counted in h2d_bytes)
    step_stage_seconds: dict[str, float] = field(default_factory=dict)  # worker seconds per stage, and the wait
    nonfinite_skipped_steps: int = 0  # steps not applied for a non-finite loss or gradient (nonfinite="skip")
    # the disk tier ([Note: disk families] in runtime/disk_tier.py); zeros without one
    disk_families: int = 0  # families whose fp32 master and optimizer states live on disk
    disk_chunk_bytes: int = 0  # bytes of their chunks on disk (also counted in model_data_bytes)
    disk_bytes_read: int = 0  # read from the disk since setup
    disk_bytes_written: int = 0  # written to the disk since setup (setup's own writes included)
    disk_read_bytes_per_iteration: int | None = None  # in the last whole iteration after the warm-up
    disk_written_bytes_per_iteration: int | None = None
    disk_read_gbps: float = 0.0  # achieved rate while reading (1e9 bytes per second), since setup
    disk_write_gbps: float = 0.0  # ... while writing

    @property
    def padded_bytes_per_param(self) -> float:
        """Model data per parameter element with chunk padding: every byte of chunk storage this rank holds
        (``model_data_bytes``) over the parameters. ``model_data_bytes_per_param`` counts only the slots."""
        return self.model_data_bytes / self.num_params if self.num_params else 0.0

    def _optimum(self) -> str:
        if self.optimal_bytes_per_iteration is not None:
            return format_bytes(self.optimal_bytes_per_iteration)
        if self.optimal_bytes_lower_bound is None or self.optimal_bytes_upper_bound is None:
            return "unknown"
        low, high = format_bytes(self.optimal_bytes_lower_bound), format_bytes(self.optimal_bytes_upper_bound)
        return f"between {low} and {high}"

    def _disk_rows(self, fmt: Any) -> list[tuple[str, str]]:
        """The disk tier's rows (none without one)."""
        if not self.disk_families:
            return []
        read, written = self.disk_read_bytes_per_iteration, self.disk_written_bytes_per_iteration
        per_iteration = "unknown" if read is None or written is None else f"{fmt(read)} / {fmt(written)}"
        return [
            ("chunks on disk", f"{fmt(self.disk_chunk_bytes)} ({self.disk_families} families)"),
            ("disk read / written", f"{fmt(self.disk_bytes_read)} / {fmt(self.disk_bytes_written)}"),
            ("disk read / written / iteration", per_iteration),
            ("disk GB/s read / write", f"{self.disk_read_gbps:.2f} / {self.disk_write_gbps:.2f}"),
        ]

    def _chunks_line(self) -> str:
        return format_chunk_counts(
            self.num_chunks, self.chunk_size, larger_chunks=self.larger_chunks, largest_chunk=self.largest_chunk
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        def fmt(n: int | None) -> str:
            return format_bytes(n) if n is None or abs(n) < 2**10 else f"{format_bytes(n)} ({n:,} B)"

        per_param = (
            f"{self.model_data_bytes_per_param:.2f} B excluding chunk padding,"
            f" {self.padded_bytes_per_param:.2f} B with it (model data / parameters)"
        )
        rows = [
            ("precision", self.precision),
            ("parameters", f"{self.num_params:,}"),
            ("chunks (families)", self._chunks_line()),
            ("chunk utilisation", f"{self.chunk_utilisation:.1%}"),
            ("model data", fmt(self.model_data_bytes)),
            ("model data / param", per_param),
            ("chunks on device", fmt(self.device_chunk_bytes)),
            ("chunks on host", fmt(self.host_chunk_bytes)),
            ("peak device chunks", fmt(self.peak_device_chunk_bytes)),
            ("device budget", fmt(self.device_memory_limit)),
            ("host budget", fmt(self.host_memory_limit)),
            ("host -> device", fmt(self.h2d_bytes)),
            ("device -> host", fmt(self.d2h_bytes)),
            ("evictions (budget)", str(self.evictions)),
            ("moves off the device", str(self.moves_off_device)),
            ("prefetches", str(self.prefetches)),
            (
                "demand fetches / prefetch hits",
                f"{self.demand_fetches} / {self.prefetch_hits} ({self.prefetches_wasted} wasted,"
                f" {self.early_evictions} early evictions)",
            ),
            ("clean / dirty moves off", f"{self.clean_moves} / {self.dirty_moves} ({fmt(self.clean_bytes)} uncopied)"),
            ("host copies kept", fmt(self.host_copy_bytes)),
            (
                "moved / iteration",
                "unknown" if self.moved_bytes_per_iteration is None else fmt(self.moved_bytes_per_iteration),
            ),
            ("optimum / iteration", self._optimum()),
            ("placement", self.placement),
            ("peak non-model (warm-up)", fmt(self.peak_non_model_bytes)),
            ("optimizer runs on", self.optimizer_tier),
            ("steps skipped (non-finite)", str(self.nonfinite_skipped_steps)),
            (
                "host steps (in backward)",
                f"{self.host_step_jobs} ({self.host_steps_in_backward}, {self.host_copies_back_in_backward} copied"
                f" back; {self.host_norms_in_backward} norms; {self.host_sums_in_backward} sums), overlap"
                f" {self.optimizer_overlap}" + (f" ({self.optimizer_schedule})" if self.optimizer_schedule else ""),
            ),
            *self._disk_rows(fmt),
            ("rank / world size", f"{self.rank} / {self.world_size}"),
            ("all-gathered", fmt(self.gathered_bytes)),
            ("reduce-scattered", fmt(self.reduced_bytes)),
            ("group gathers (ahead of use)", f"{self.group_gathers} ({self.group_prefetches})"),
            ("group reductions (second rounds)", f"{self.group_reductions} ({self.group_second_rounds})"),
            ("groups kept for backward", str(self.groups_kept)),
        ]
        width = max(len(k) for k, _ in rows)
        return "PatrickStar memory report\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
