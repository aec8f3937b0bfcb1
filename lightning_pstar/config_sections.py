"""The sections of :class:`~lightning_pstar.config.PStarConfig`, one ``kw_only`` dataclass per concern.

``chunks`` (:class:`ChunkConfig`), ``memory`` (:class:`MemoryConfig`), ``placement`` (:class:`PlacementConfig`)
and ``mixed_precision`` (:class:`MixedPrecisionConfig` with its :class:`LossScaleConfig`). Each refuses a wrong
type or range in ``__post_init__`` with a ``ValueError`` naming the option, the value and what is accepted;
:mod:`lightning_pstar.config` puts them together and re-exports them.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from dataclasses import dataclass, field

from lightning_pstar.config_choices import (
    HostMalloc,
    NonFinite,
    OptimizerOverlap,
    OptimizerPlacement,
    Placement,
)
from lightning_pstar.config_values import (
    _byte_limit,
    _caller_stacklevel,
    _flag,
    _fraction,
    _number,
    _section,
    parse_bytes,
)

__all__ = [
    "MAX_CHUNK_ELEMENTS",
    "ChunkConfig",
    "LossScaleConfig",
    "MemoryConfig",
    "MixedPrecisionConfig",
    "PlacementConfig",
]

MAX_CHUNK_ELEMENTS = 2**31
"""Largest explicit ``chunks.size``: a chunk of 2**31 elements is already 4 GiB in bf16 and 8 GiB in fp32, so a
larger value is almost always bytes given where elements are meant."""


@dataclass(kw_only=True)
class ChunkConfig:
    """How parameters are packed into chunks."""

    size: int | str = "auto"
    """Capacity of one chunk in elements (1 to ``MAX_CHUNK_ELEMENTS`` = 2**31), or "auto": the size that
    wastes the fewest bytes while two chunk groups still fit the device budget. A parameter larger than an
    explicit size gets a chunk of its own."""
    cpu_embedding: bool = False
    """Keep ``nn.Embedding`` weights fp32 on the host, outside the chunks: the lookup runs on the host and
    only its output moves to the device. Frees the largest tensor from setting the chunk size. Embeddings
    tied to another module (an output head) stay in the chunks."""
    bucket_bytes: int | str = "4MiB"
    """Several ranks: consecutive chunk groups whose all-gather or reduce-scatter stays within this many bytes
    share one collective, as DDP's gradient buckets do (each collective costs a fixed latency besides its
    bytes); an int (bytes) or a string with a unit. 0 gives every chunk group collectives of its own. A bucket's
    all-gather packs the chunks into buffers of its size for the collective (transient device memory beside the
    chunk budget), so keep it small next to the device budget; every rank must use the same value."""

    def __post_init__(self) -> None:
        size = self.size
        if isinstance(size, str) and size.strip().lstrip("-").isdigit():
            size = int(size)
        valid = isinstance(size, int) and not isinstance(size, bool) and 0 < size <= MAX_CHUNK_ELEMENTS
        if size != "auto" and not valid:
            raise ValueError(
                f"`chunks.size` must be a positive number of elements (at most 2**31 = {MAX_CHUNK_ELEMENTS}) or"
                f" 'auto', got {self.size!r}. HINT: use 'auto' to let the strategy pick it; the size counts"
                " elements, not bytes."
            )
        self.size = size
        _flag(self.cpu_embedding, name="chunks.cpu_embedding")
        self.bucket_bytes = _bucket_bytes(self.bucket_bytes)

    @property
    def bucket_nbytes(self) -> int:
        """``bucket_bytes`` in bytes (0: every chunk group collects alone)."""
        return _bucket_bytes(self.bucket_bytes)

    @property
    def elements(self) -> int | None:
        """The explicit chunk size in elements, or None for "auto"."""
        return None if self.size == "auto" else int(self.size)


_ZERO_BYTES = re.compile(r"\s*0+(\.0*)?\s*(b|kb|mb|gb|tb|kib|mib|gib|tib)?\s*", re.IGNORECASE)


def _bucket_bytes(value: object) -> int:
    """``chunks.bucket_bytes`` in bytes: 0 (or a zero with a unit, "0MiB") turns buckets off."""
    accepted = "0 (no buckets) or a byte count such as 4194304 or '4MiB'"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"`chunks.bucket_bytes` must be {accepted}, got {value!r}.")
    if value == 0 or (isinstance(value, str) and _ZERO_BYTES.fullmatch(value)):
        return 0
    try:
        return parse_bytes(value, name="chunks.bucket_bytes")
    except ValueError as err:
        raise ValueError(f"{err} HINT: `chunks.bucket_bytes` takes {accepted}.") from None


@dataclass(kw_only=True)
class MemoryConfig:
    """Byte budgets of the tiers, where the disk tier lives, and what the C library keeps of freed host memory.
    Limits accept an int (bytes) or a string with a unit ("8GiB")."""

    device_limit: int | str | None = None
    """Device memory PatrickStar may fill. Under ``placement.policy="auto"`` this is the budget for chunks
    AND non-model data (activations, temporaries) together: the warm-up iteration measures non-model memory
    and afterwards chunks get ``device_limit - non_model[t]`` at each moment ``t``. Under ``"static"`` chunks
    may use ``placement.static_chunk_fraction`` of it and the rest is left to non-model data, which is not
    measured. None: unlimited on a simulated (CPU) device, ``device_fraction`` of the accelerator's total
    memory on a GPU."""
    host_limit: int | str | None = None
    """Bytes of chunk data allowed in host RAM. None: ``host_fraction`` of the machine's RAM divided by the
    number of local ranks. Checked at setup against everything the run can hold there at once ([Note: the host
    need] in ``planning/tiers.py``). On a CPU run without ``device_limit`` the simulated device keeps every chunk,
    so the limit bounds only fp32 copies of frozen weights and host embeddings: setting it there warns."""
    device_fraction: float = 0.8
    """Share of the accelerator's total memory used as the default device budget, in (0, 1]."""
    host_fraction: float = 0.8
    """Share of host RAM used as the default host budget, in (0, 1]."""
    host_malloc: HostMalloc = HostMalloc.CACHED
    """"cached" (the default): on a CPU run glibc keeps the host memory a step frees for the next one, so the
    simulated device does not fault its pages in again every step; "system": leave the C library as it is.
    See :class:`HostMalloc`."""
    disk_path: str | None = None
    """An existing directory on a local disk (an SSD) for the disk tier: the fp32 masters and optimizer states of
    the chunk families that do not fit host memory are kept in files of a locked directory of the run's own inside
    it, removed when the run ends. None (the default): no disk tier."""
    disk_limit: int | str | None = None
    """Bytes of files the disk tier may write under ``disk_path``. None: 0.8 of the free space of ``disk_path``
    when training starts. Ignored (with a warning) while ``disk_path`` is unset."""

    def __post_init__(self) -> None:
        self.device_limit = _byte_limit(self.device_limit, name="memory.device_limit")
        self.host_limit = _byte_limit(self.host_limit, name="memory.host_limit")
        self.device_fraction = _fraction(self.device_fraction, name="memory.device_fraction")
        self.host_fraction = _fraction(self.host_fraction, name="memory.host_fraction")
        self.host_malloc = HostMalloc.coerce(self.host_malloc, name="memory.host_malloc")
        self.disk_path = _disk_path(self.disk_path)
        self.disk_limit = _byte_limit(self.disk_limit, name="memory.disk_limit")
        if self.disk_limit is not None and self.disk_path is None:
            warnings.warn(
                f"`memory.disk_limit` (`disk_memory_limit`, {self.disk_limit!r}) is ignored: `memory.disk_path` is"
                " unset, so there is no disk tier. HINT: set disk_path to a directory on a local disk, or drop"
                " disk_limit.",
                UserWarning,
                stacklevel=_caller_stacklevel(),
            )

    @property
    def device_limit_bytes(self) -> int | None:
        """``device_limit`` in bytes, or None when unset."""
        v = self.device_limit
        return None if v is None else parse_bytes(v, name="memory.device_limit")

    @property
    def host_limit_bytes(self) -> int | None:
        """``host_limit`` in bytes, or None when unset."""
        v = self.host_limit
        return None if v is None else parse_bytes(v, name="memory.host_limit")

    @property
    def disk_limit_bytes(self) -> int | None:
        """``disk_limit`` in bytes, or None when unset."""
        v = self.disk_limit
        return None if v is None else parse_bytes(v, name="memory.disk_limit")


def _disk_path(value: object) -> str | None:
    """``memory.disk_path`` as a string: None, or a non-empty path (a str or an ``os.PathLike``)."""
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(
            f"`memory.disk_path` must be None (no disk tier) or a directory path (a non-empty str or os.PathLike),"
            f" got {value!r}."
        )
    return value


@dataclass(kw_only=True)
class PlacementConfig:
    """Which chunks sit on the device at each moment."""

    policy: Placement = Placement.AUTO
    """"auto" (trace-driven, the default) or "static" (a fixed share of the budget, least recently used
    eviction); see :class:`Placement`."""
    static_chunk_fraction: float = 1.0
    """``policy="static"``: share of the device budget chunks may use (the rest is left to activations), in
    (0, 1]."""
    warmup_chunk_fraction: float = 0.25
    """``policy="auto"``: share of the device budget chunks may use during the warm-up iteration, while
    non-model memory is measured, in (0, 1]; never less than one module's chunks."""
    optimizer: OptimizerPlacement = OptimizerPlacement.AUTO
    """Where the optimizer step runs: "auto" (the device where the trace says it fits, else the host), "host"
    (every family, ZeRO-Offload style) or "device" (every family; refused at setup where it does not fit); see
    :class:`OptimizerPlacement`."""
    optimizer_overlap: OptimizerOverlap = OptimizerOverlap.AUTO
    """How a host-side step overlaps its transfers and the backward: "auto" (the fastest of "pipeline", "off" and
    "next_forward", measured after the warm-up), "pipeline" (the pipelined step, inside the backward where exact),
    "next_forward" (the step's tail also overlaps the next forward) or "off" (the serial step); see
    :class:`OptimizerOverlap`."""

    def __post_init__(self) -> None:
        self.policy = Placement.coerce(self.policy, name="placement.policy")
        self.optimizer = OptimizerPlacement.coerce(self.optimizer, name="placement.optimizer")
        self.optimizer_overlap = OptimizerOverlap.coerce(self.optimizer_overlap, name="placement.optimizer_overlap")
        self.static_chunk_fraction = _fraction(self.static_chunk_fraction, name="placement.static_chunk_fraction")
        self.warmup_chunk_fraction = _fraction(self.warmup_chunk_fraction, name="placement.warmup_chunk_fraction")


_LS = "mixed_precision.loss_scale"


@dataclass(kw_only=True)
class LossScaleConfig:
    """Dynamic loss scaling for ``16-mixed``; ignored in the other precisions."""

    initial_scale: float = 2.0**16
    """Loss scale at the first step (finite, > 0)."""
    growth_factor: float = 2.0
    """Multiplier applied after ``growth_interval`` steps without inf/nan gradients (finite, > 1)."""
    backoff_factor: float = 0.5
    """Multiplier applied when a step overflows; the step is skipped (between 0 and 1)."""
    growth_interval: int = 2000
    """Number of consecutive finite steps before the scale grows (an int >= 1)."""
    min_scale: float = 1.0
    """Smallest scale allowed, in (0, initial_scale]; reaching it raises an error rather than skipping steps
    forever."""

    def __post_init__(self) -> None:
        # an infinite scale makes every scaled gradient inf: every 16-mixed step would be skipped forever
        self.initial_scale = _number(self.initial_scale, name=f"{_LS}.initial_scale", accepted="> 0, finite")
        if not (self.initial_scale > 0 and math.isfinite(self.initial_scale)):
            raise ValueError(f"`{_LS}.initial_scale` must be > 0 and finite, got {self.initial_scale!r}.")
        self.growth_factor = _number(self.growth_factor, name=f"{_LS}.growth_factor", accepted="> 1, finite")
        if not (self.growth_factor > 1 and math.isfinite(self.growth_factor)):
            raise ValueError(f"`{_LS}.growth_factor` must be > 1 and finite, got {self.growth_factor!r}.")
        self.backoff_factor = _number(self.backoff_factor, name=f"{_LS}.backoff_factor", accepted="in (0, 1)")
        if not 0 < self.backoff_factor < 1:
            raise ValueError(f"`{_LS}.backoff_factor` must be in (0, 1), got {self.backoff_factor!r}.")
        interval = self.growth_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"`{_LS}.growth_interval` must be an int >= 1 (a number of steps), got {interval!r}.")
        self.min_scale = _number(self.min_scale, name=f"{_LS}.min_scale", accepted="in (0, initial_scale]")
        if not 0 < self.min_scale <= self.initial_scale:
            raise ValueError(
                f"`{_LS}.min_scale` must be in (0, initial_scale={self.initial_scale}], got {self.min_scale!r}."
            )


@dataclass(kw_only=True)
class MixedPrecisionConfig:
    """Options of ``bf16-mixed`` and ``16-mixed``; ignored under ``32-true``."""

    frozen_master: bool = True
    """Keep an fp32 copy of every frozen parameter (``requires_grad=False``) in host memory next to its
    compute-dtype chunk, so checkpoints and state dicts return the frozen weights exactly as given (4 host
    bytes per frozen element). False stores them only in the compute dtype (2 bytes per element, as DeepSpeed
    does): saved frozen weights are then rounded to bf16/fp16."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """Dynamic loss scaling for ``16-mixed``."""
    nonfinite: NonFinite = NonFinite.RAISE
    """A non-finite loss or gradient, in every precision: "raise" (the step is not applied and an error says where),
    "skip" (not applied, counted) or "ignore" (applied, as plain Lightning); see :class:`NonFinite`. The check
    reads the loss of each backward (one scalar) and, where the step computes the global norm anyway (clipping by
    norm), that norm: no extra pass over the gradients."""

    def __post_init__(self) -> None:
        _flag(self.frozen_master, name="mixed_precision.frozen_master")
        self.nonfinite = NonFinite.coerce(self.nonfinite, name="mixed_precision.nonfinite")
        self.loss_scale = _section(self.loss_scale, LossScaleConfig, name=_LS)
