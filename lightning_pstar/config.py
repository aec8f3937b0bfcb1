"""Typed configuration of the PatrickStar strategy.

Every option lives in one ``kw_only`` dataclass tree, nested by concern, so that Python users, OmegaConf
structured configs and Hydra YAML files are validated by the same code::

    PStarConfig
      chunks            ChunkConfig           size, cpu_embedding, bucket_bytes
      memory            MemoryConfig          device_limit, host_limit, device_fraction, host_fraction, host_malloc,
                                              disk_path, disk_limit
      placement         PlacementConfig       policy, static_chunk_fraction, warmup_chunk_fraction
      mixed_precision   MixedPrecisionConfig  frozen_master, loss_scale (LossScaleConfig)
      checkpoint        CheckpointFormat      consolidated | sharded
      hand_back_weights bool                  copy the trained weights out at the end of the run

``__post_init__`` refuses a wrong type or range with a ``ValueError`` naming the option, the value and what
is accepted. The strategy's flat keywords (``PatrickStarStrategy(device_memory_limit="8GiB")``) map onto this
tree through one table, :data:`FLAT_OPTIONS`, used by :meth:`PStarConfig.from_flat`.
"""

from __future__ import annotations

import math
import os
import re
import sys
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, TypedDict, TypeVar, get_type_hints

from typing_extensions import Unpack

from lightning_pstar.config_choices import (
    CheckpointFormat,
    HostMalloc,
    NonFinite,
    OptimizerOverlap,
    OptimizerPlacement,
    Placement,
)
from lightning_pstar.config_values import (
    UnknownOptionError,
    _byte_limit,
    _flag,
    _fraction,
    _number,
    _unknown,
    _ValueEnum,
    parse_bytes,
)

__all__ = [
    "FLAT_OPTIONS",
    "SUPPORTED_PRECISIONS",
    "CheckpointFormat",
    "ChunkConfig",
    "HostMalloc",
    "LossScaleConfig",
    "MAX_CHUNK_ELEMENTS",
    "MemoryConfig",
    "MixedPrecisionConfig",
    "NonFinite",
    "OptimizerOverlap",
    "OptimizerPlacement",
    "PStarConfig",
    "PStarOptions",
    "Placement",
    "PlacementConfig",
    "UnknownOptionError",
    "check_option_names",
    "parse_bytes",
]

SUPPORTED_PRECISIONS: tuple[str, ...] = ("16-mixed", "bf16-mixed", "32-true")
"""The ``Trainer(precision=...)`` values PatrickStar trains with (true half precision keeps no fp32 master)."""

MAX_CHUNK_ELEMENTS = 2**31
"""Largest explicit ``chunks.size``: a chunk of 2**31 elements is already 4 GiB in bf16 and 8 GiB in fp32, so a
larger value is almost always bytes given where elements are meant."""


_S = TypeVar("_S")


# ---- the sections ------------------------------------------------------------------------------------------
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
    """How a host-side step overlaps its transfers and the backward: "auto" (the faster of "pipeline" and "off",
    measured after the warm-up), "pipeline" (the pipelined step, inside the backward where exact), "next_forward"
    (opt-in: the step's tail also overlaps the next forward) or "off" (the serial step); see
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


# ---- the whole configuration -------------------------------------------------------------------------------
@dataclass(kw_only=True)
class PStarConfig:
    """All options of :class:`~lightning_pstar.PatrickStarStrategy`, nested by concern.

    Sections may be given as instances or as dicts of their options:
    ``PStarConfig(chunks={"size": 4096}, memory={"device_limit": "8GiB"})``. The strategy's flat keywords
    build one with :meth:`from_flat`; a dict or OmegaConf/Hydra node with :meth:`from_mapping`.
    """

    chunks: ChunkConfig = field(default_factory=ChunkConfig)
    """How parameters are packed into chunks: ``size``, ``cpu_embedding``."""
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """Byte budgets of the device and host tiers: ``device_limit``, ``host_limit`` and the fractions used
    when a limit is unset; ``host_malloc``: what the C library keeps of freed host memory on a CPU run;
    ``disk_path`` and ``disk_limit``: the disk tier."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Which chunks sit on the device at each moment: ``policy`` and its fractions."""
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)
    """Options of ``bf16-mixed`` and ``16-mixed``: ``frozen_master``, ``loss_scale``."""
    checkpoint: CheckpointFormat = CheckpointFormat.CONSOLIDATED
    """How checkpoints are written: "consolidated" (one ordinary Lightning file, gathered to rank 0) or
    "sharded" (every rank writes what it owns; loads at any world size); see :class:`CheckpointFormat`."""
    hand_back_weights: bool = True
    """At the end of the run (``Trainer.fit`` returning, ``Fabric``'s teardown), give the model back as an
    ordinary module with its trained fp32 weights on the host and the user's optimizers holding their states.
    false: skip that copy (for runs whose weights leave through a checkpoint): the chunks are freed family by
    family, the parameters become meta tensors of their shapes and dtypes, and the optimizers keep no state;
    load a checkpoint to use the weights again."""

    def __post_init__(self) -> None:
        self.chunks = _section(self.chunks, ChunkConfig, name="chunks")
        self.memory = _section(self.memory, MemoryConfig, name="memory")
        self.placement = _section(self.placement, PlacementConfig, name="placement")
        self.mixed_precision = _section(self.mixed_precision, MixedPrecisionConfig, name="mixed_precision")
        self.checkpoint = CheckpointFormat.coerce(self.checkpoint, name="checkpoint")
        self.hand_back_weights = _flag(self.hand_back_weights, name="hand_back_weights")

    @classmethod
    def from_flat(cls, **options: Unpack[PStarOptions]) -> PStarConfig:
        """Build a config from the strategy's flat keywords (``chunk_size=4096, placement="static"``).

        Errors name the keywords as given (``chunk_size``, not ``chunks.size``).
        """
        check_option_names(options)
        nested: dict[str, Any] = {}
        for flat, value in options.items():
            if flat == "loss_scale" and value is None:
                continue  # the strategy's "not given"
            section, _, leaf = FLAT_OPTIONS[flat].partition(".")
            if leaf:
                nested.setdefault(section, {})[leaf] = value
            else:
                nested[section] = value
        with _named_as_given({FLAT_OPTIONS[k]: k for k in options}):
            return cls(**nested)

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> PStarConfig:
        """Build a config from a dict or OmegaConf node, validated by OmegaConf's structured schema.

        An unknown key (nested keys too) raises :class:`UnknownOptionError` naming it, its closest accepted
        name and the accepted keys; ``_target_`` (Hydra) is ignored. The flat keys of earlier releases
        (``chunk_size``, ``placement: auto``, ``device_memory_limit``, ...) still work, each with a
        ``DeprecationWarning`` that names its nested key.
        """
        from omegaconf import OmegaConf
        from omegaconf.errors import ValidationError

        container = OmegaConf.to_container(OmegaConf.create(dict(options)), resolve=True) if options else {}
        assert isinstance(container, dict)
        plain = {str(key): value for key, value in container.items() if key != "_target_"}
        renames = _nest_flat_keys(plain)
        with _named_as_given(renames):
            _check_tree(plain, cls, prefix="")
            try:
                merged = OmegaConf.merge(OmegaConf.structured(cls), plain)
            except ValidationError as err:
                try:  # the dataclasses' own checks say what is accepted, in this package's words
                    cls(**plain)
                except ValueError as own:
                    raise own from None
                reason = str(err.msg).splitlines()[0]
                raise ValueError(f"Invalid PatrickStar option `{err.full_key}`: {reason}.") from None
            obj = OmegaConf.to_object(merged)
        assert isinstance(obj, cls)
        return obj


# ---- the strategy's flat keywords --------------------------------------------------------------------------
class PStarOptions(TypedDict, total=False):
    """The flat keywords of ``PatrickStarStrategy(...)``; :data:`FLAT_OPTIONS` says where each one lives."""

    chunk_size: int | str
    cpu_embedding: bool
    bucket_bytes: int | str
    device_memory_limit: int | str | None
    host_memory_limit: int | str | None
    device_memory_fraction: float
    host_memory_fraction: float
    host_malloc: HostMalloc | str
    disk_path: str | os.PathLike[str] | None
    disk_memory_limit: int | str | None
    placement: Placement | str
    static_chunk_fraction: float
    warmup_chunk_fraction: float
    optimizer_placement: OptimizerPlacement | str
    optimizer_overlap: OptimizerOverlap | str
    frozen_master: bool
    nonfinite: NonFinite | str
    loss_scale: LossScaleConfig | Mapping[str, Any] | None
    checkpoint: CheckpointFormat | str
    hand_back_weights: bool


FLAT_OPTIONS: Mapping[str, str] = {
    "chunk_size": "chunks.size",
    "cpu_embedding": "chunks.cpu_embedding",
    "bucket_bytes": "chunks.bucket_bytes",
    "device_memory_limit": "memory.device_limit",
    "host_memory_limit": "memory.host_limit",
    "device_memory_fraction": "memory.device_fraction",
    "host_memory_fraction": "memory.host_fraction",
    "host_malloc": "memory.host_malloc",
    "disk_path": "memory.disk_path",
    "disk_memory_limit": "memory.disk_limit",
    "placement": "placement.policy",
    "static_chunk_fraction": "placement.static_chunk_fraction",
    "warmup_chunk_fraction": "placement.warmup_chunk_fraction",
    "optimizer_placement": "placement.optimizer",
    "optimizer_overlap": "placement.optimizer_overlap",
    "frozen_master": "mixed_precision.frozen_master",
    "nonfinite": "mixed_precision.nonfinite",
    "loss_scale": "mixed_precision.loss_scale",
    "checkpoint": "checkpoint",
    "hand_back_weights": "hand_back_weights",
}
"""Each flat keyword of the strategy (and flat key of earlier configs) -> its dotted path in PStarConfig."""


def check_option_names(names: Iterable[str], *, lightning: Iterable[str] = ()) -> None:
    """Raise :class:`UnknownOptionError` for the first name that is not a flat option (nor in ``lightning``)."""
    lightning = sorted(lightning)
    for name in names:
        if name in FLAT_OPTIONS or name in lightning:
            continue
        hint = f"the options are {sorted(FLAT_OPTIONS)}" + (f"; Lightning's own are {lightning}" if lightning else "")
        if name in {f.name for f in fields(PStarConfig)}:  # a section: the nested form is a config
            hint = f"`{name}` is a section of PStarConfig: pass config=PStarConfig({name}=...)"
            hint += " or use PatrickStarStrategy.from_config"
        raise _unknown(name, {n: f"`{n}`" for n in [*FLAT_OPTIONS, *lightning]}, hint=hint + ".")


def _section(value: object, cls: type[_S], *, name: str) -> _S:
    """``value`` as a ``cls`` section: an instance, or a mapping of its fields (unknown keys raise)."""
    if isinstance(value, Mapping):
        known = sorted(f.name for f in fields(cls))  # type: ignore[arg-type]
        for key in value:
            if key not in known:
                suggestions = {k: f"`{name}.{k}`" for k in known}
                raise _unknown(f"{name}.{key}", suggestions, hint=f"the options of `{name}` are {known}.")
        return cls(**value)
    if not isinstance(value, cls):
        raise ValueError(f"`{name}` must be a {cls.__name__} or a dict of its options, got {value!r}.")
    return value


def _check_tree(plain: dict[str, Any], cls: type, *, prefix: str) -> None:
    """Unknown keys and enum values of ``plain`` against ``cls``; enum strings become members in place."""
    hints = get_type_hints(cls)
    known = sorted(f.name for f in fields(cls))
    for key, value in plain.items():
        name = f"{prefix}{key}"
        if key not in known:
            suggestions = {k: f"`{prefix}{k}`" for k in known}
            if not prefix:  # the flat keys of earlier releases are accepted too: point at their new home
                suggestions.update({k: f"`{k}` (now `{v}`)" for k, v in FLAT_OPTIONS.items() if k != v})
            where = f"the options of `{prefix[:-1]}` are" if prefix else "the options are"
            raise _unknown(name, suggestions, hint=f"{where} {known}.")
        kind = hints[key]
        if isinstance(kind, type) and is_dataclass(kind):
            if not isinstance(value, dict):
                raise ValueError(f"`{name}` must be a mapping of its options, got {value!r}.")
            _check_tree(value, kind, prefix=f"{name}.")
        elif isinstance(kind, type) and issubclass(kind, _ValueEnum):
            plain[key] = kind.coerce(value, name=name)


def _nest_flat_keys(plain: dict[str, Any]) -> dict[str, str]:
    """Move the flat keys of earlier releases to their nested place, warning for each; nested -> flat name."""
    renames: dict[str, str] = {}
    for flat, path in FLAT_OPTIONS.items():
        if flat == path or flat not in plain or (flat == "placement" and isinstance(plain[flat], dict)):
            continue
        section, _, leaf = path.partition(".")
        value = plain.pop(flat)
        target = plain.setdefault(section, {})
        if not isinstance(target, dict):
            raise ValueError(f"`{section}` must be a mapping of its options, got {target!r}.")
        if leaf in target:
            raise ValueError(f"PatrickStar option `{path}` is given twice: as `{path}` and as `{flat}`.")
        target[leaf] = value
        renames[path] = flat
        warnings.warn(
            f"The flat PatrickStar option `{flat}` is deprecated: write `{path}` instead"
            " (configs/strategy/patrickstar.yaml shows every option in its nested place).",
            DeprecationWarning,
            stacklevel=_caller_stacklevel(),
        )
    return renames


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside this package (the user's call)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and str(frame.f_globals.get("__name__", "")).startswith("lightning_pstar"):
        frame, level = frame.f_back, level + 1
    return level


@contextmanager
def _named_as_given(renames: Mapping[str, str]) -> Iterator[None]:
    """Errors inside name each option as the user wrote it: ``renames`` maps nested paths to flat names."""
    try:
        yield
    except ValueError as err:
        message = str(err)
        for path, flat in renames.items():
            if path != flat:
                message = message.replace(f"`{path}`", f"`{flat}`").replace(f"`{path}.", f"`{flat}.")
        err.args = (message,)
        raise
