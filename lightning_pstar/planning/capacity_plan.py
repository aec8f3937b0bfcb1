"""The capacity plan: what a model needs under PatrickStar, whether it fits the budgets, and why not.

:func:`~lightning_pstar.planning.capacity.plan_capacity` computes a :class:`CapacityPlan`; this module is the
result and how it reads: ``str(plan)`` is the table ``python -m lightning_pstar.plan`` prints,
:meth:`CapacityPlan.as_dict` its ``--json``. The figures are the engine's to the byte (printed with the exact
count beside the human one).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_pstar.planning.largest import LargestModel
from lightning_pstar.planning.models import describe_gpt
from lightning_pstar.planning.requirements import BytesPerElement
from lightning_pstar.report import format_bytes, format_chunk_counts

__all__ = ["CapacityPlan"]


@dataclass(kw_only=True)
class CapacityPlan:
    """What a model needs under PatrickStar, and whether it fits the budgets. Bytes unless said otherwise."""

    target: str
    precision: str
    optimizer: str
    world_size: int
    num_params: int  # unique parameter elements (a tied weight counts once)
    num_trainable_params: int
    chunk_size: int  # elements; a chunk holding one oversized parameter may be larger
    chunk_size_auto: bool
    num_chunks: int  # chunk families, padding families for the world size included
    larger_chunks: int  # of num_chunks: families larger than chunk_size (a parameter too big for one chunk)
    largest_chunk: int  # elements of the largest family
    num_frozen_chunks: int
    chunk_utilisation: float  # parameter elements / chunk capacity
    bytes_per_element: BytesPerElement
    param_chunk_bytes: int  # all ranks, like the figures below up to model_data_bytes
    master_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    frozen_master_bytes: int  # fp32 copies of frozen weights (host only), all ranks
    model_data_bytes: int  # every chunk the engine allocates, all ranks
    model_data_bytes_per_rank: int  # the rank owning the most chunk bytes
    host_embedding_params: int  # cpu_embedding: embedding elements kept fp32 on HOST outside the chunks
    host_embedding_bytes: int  # their weights, gradients and optimizer states, per rank (a replica each)
    bytes_per_param: float  # (model_data_bytes + host_embedding_bytes) / num_params, padding included
    device_budget: int  # per rank
    host_budget: int  # per rank
    min_device_bytes: int  # param chunks resident at once for the most demanding module (per rank)
    min_device_module: str
    device_model_data_bytes: int  # model data per rank the device keeps when the host is fullest
    host_model_data_bytes: int  # what host RAM must hold per rank (host embeddings, step temporaries included)
    fits_model_data: bool
    fits_min_device: bool
    host_temporary_bytes: int = 0  # of host_model_data_bytes: the optimizer step's temporaries on the host
    disk_budget: int | None = None  # per rank; None: no disk tier
    disk_model_data_bytes: int = 0  # files of the families whose fp32 masters and optimizer states go to disk
    disk_families: int = 0
    disk_buffer_bytes: int = 0  # of host_model_data_bytes: the disk tier's host buffers
    optimizer_placement: str = "auto"  # the strategy's option
    optimizer_overlap: str = "auto"  # the strategy's option
    optimizer_on_host: bool = False  # where the optimizer side starts (the host step runs where it is on the host)
    fits_optimizer_placement: bool = True  # optimizer_placement="device": every family fits the device budget
    largest: LargestModel | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.fits_model_data and self.fits_min_device and self.fits_optimizer_placement

    @property
    def reasons(self) -> list[str]:
        """Why the model does not fit (empty when it does)."""
        out = []
        disk_short = self.disk_budget is not None and self.disk_model_data_bytes > self.disk_budget
        if disk_short:
            out.append(f"disk need {_fmt(self.disk_model_data_bytes)} > disk budget {_fmt(self.disk_budget or 0)}")
        if not self.fits_model_data and not disk_short and self.disk_budget is not None:
            out.append(
                f"host need {_fmt(self.host_model_data_bytes)} > host budget {_fmt(self.host_budget)} with"
                f" {self.disk_families} families' optimizer side on disk"
            )
        elif not self.fits_model_data and not disk_short:
            need = self.model_data_bytes_per_rank + self.host_embedding_bytes
            budget, host = self.device_budget + self.host_budget, self.host_budget
            out.append(
                f"model data per rank {_fmt(need)} > device + host budget {_fmt(budget)}"
                if self.host_embedding_bytes <= host
                else f"host-resident embeddings {_fmt(self.host_embedding_bytes)} > host budget {_fmt(host)}"
            )
        if not self.fits_optimizer_placement:
            out.append(
                f"optimizer_placement='device' needs model data per rank {_fmt(self.model_data_bytes_per_rank)}"
                f" on the device > device budget {_fmt(self.device_budget)}"
            )
        if not self.fits_min_device:
            out.append(
                f"module '{self.min_device_module}' needs {_fmt(self.min_device_bytes)} of parameter chunks"
                f" resident at once > device budget {_fmt(self.device_budget)}"
            )
        return out

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["fits"] = self.fits
        out["reasons"] = self.reasons
        return out

    def __str__(self) -> str:
        rows = [
            ("model", self.target),
            ("precision", f"{self.precision}, optimizer {self.optimizer}, world size {self.world_size}"),
            ("parameters", f"{self.num_params:,} ({self.num_trainable_params:,} trainable, {self._frozen:,} frozen)"),
            (
                "chunks",
                format_chunk_counts(
                    self.num_chunks,
                    self.chunk_size,
                    larger_chunks=self.larger_chunks,
                    largest_chunk=self.largest_chunk,
                    auto=self.chunk_size_auto,
                )
                + f", {self.num_frozen_chunks} frozen; utilisation {self.chunk_utilisation:.1%}",
            ),
            ("model data", f"{_fmt(self.model_data_bytes)}, {self.bytes_per_param:.2f} B/param"),
            *((f"  {name}", _fmt(nbytes)) for name, nbytes in self._kinds()),
            ("model data per rank", _fmt(self.model_data_bytes_per_rank)),
            *(
                [("host embeddings", f"{self.host_embedding_params:,} params, {_fmt(self.host_embedding_bytes)}")]
                if self.host_embedding_params
                else []
            ),
            (
                "DEVICE (per rank)",
                f"must hold {_fmt(self.min_device_bytes)} (module '{self.min_device_module}'), keeps"
                f" {_fmt(self.device_model_data_bytes)} of model data when the host is fullest (the first optimizer"
                f" step under placement 'auto'); budget {_fmt(self.device_budget)}",
            ),
            (
                "HOST (per rank)",
                f"must hold {_fmt(self.host_model_data_bytes)}"
                + (f" (step temporaries {_fmt(self.host_temporary_bytes)})" if self.host_temporary_bytes else "")
                + f"; budget {_fmt(self.host_budget)}",
            ),
            *self._disk_rows(),
            ("optimizer step", self._step_row()),
            ("fits", "yes" if self.fits else "NO: " + "; ".join(self.reasons)),
        ]
        if self.largest is not None:
            rows.append(("largest that fits", _describe_largest(self.largest)))
        width = max(len(k) for k, _ in rows)
        lines = [f"  {k:<{width}}  {v}" for k, v in rows]
        lines += [f"  note: {n}" for n in self.notes]
        return "PatrickStar capacity plan\n" + "\n".join(lines)

    def _step_row(self) -> str:
        where = "starts on the host" if self.optimizer_on_host else "on the device"
        overlap = {
            "auto": "pipelined, then the fastest of pipelined, serial and tail (one rank) steps, timed from step 10",
            "pipeline": "pipelined (copies and host Adam at once; inside the backward where exact)",
            "next_forward": "pipelined, its tail during the next forward",
            "off": "serial",
        }[self.optimizer_overlap]
        return (
            f"{where} (optimizer_placement={self.optimizer_placement!r}); host-side families: {overlap}"
            f" (optimizer_overlap={self.optimizer_overlap!r})"
        )

    def _disk_rows(self) -> list[tuple[str, str]]:
        if self.disk_budget is None:
            return []
        what = (
            f"holds {_fmt(self.disk_model_data_bytes)} ({self.disk_families} families' fp32 masters and optimizer"
            f" states; their host buffers {_fmt(self.disk_buffer_bytes)} are in HOST)"
            if self.disk_families
            else "holds nothing (the host budget holds the optimizer side)"
        )
        return [("DISK (per rank)", f"{what}; budget {_fmt(self.disk_budget)}")]

    @property
    def _frozen(self) -> int:
        return self.num_params - self.num_trainable_params

    def _kinds(self) -> list[tuple[str, int]]:
        """Model data by chunk kind, the kinds this run allocates only."""
        bpe = self.bytes_per_element
        dtype = {"bf16-mixed": "bf16", "16-mixed": "fp16"}.get(self.precision, "fp32")
        kinds = [(f"param chunks ({dtype})", self.param_chunk_bytes)]
        if bpe.master:
            kinds.append(("fp32 masters", self.master_bytes))
        if bpe.grad:
            kinds.append(("fp32 grads" if bpe.master == 0 else "fp32 grad sums", self.grad_bytes))
        if bpe.optimizer:
            kinds.append((f"{self.optimizer} states", self.optimizer_state_bytes))
        if self.frozen_master_bytes:
            kinds.append(("fp32 frozen weights (host)", self.frozen_master_bytes))
        return kinds


def _fmt(n: int) -> str:
    """:func:`~lightning_pstar.report.format_bytes` followed by the exact count, "1.50 MiB (1,572,864 B)": the
    plan's figures are the engine's to the byte, and readers of the output compare them so."""
    human, exact = format_bytes(n), f"{n:,} B"
    return exact if human == f"{n} B" else f"{human} ({exact})"


def _describe_largest(largest: LargestModel) -> str:
    if largest.config is None:
        return f"none (scaling {largest.scale}: even the smallest member does not fit)"
    text = (
        f"{describe_gpt(largest.config)}: {largest.num_params:,} parameters,"
        f" {_fmt(largest.model_data_bytes_per_rank)} model data per rank (scaling {largest.scale})"
    )
    if largest.at_search_limit:
        return text + "; the search limit was reached, larger ones fit too"
    assert largest.next_config is not None
    why = "; ".join(largest.next_reasons)
    return text + f"; the next size up, {describe_gpt(largest.next_config)}, does not ({why})"
