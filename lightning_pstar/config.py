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

The sections are in :mod:`~lightning_pstar.config_sections`, their enums in :mod:`~lightning_pstar.config_choices`
and the value checks in :mod:`~lightning_pstar.config_values`; this module re-exports what users import.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, TypedDict, get_type_hints

from typing_extensions import Unpack

from lightning_pstar.config_choices import (
    CheckpointFormat,
    HostMalloc,
    NonFinite,
    OptimizerOverlap,
    OptimizerPlacement,
    Placement,
)
from lightning_pstar.config_sections import (
    MAX_CHUNK_ELEMENTS,
    ChunkConfig,
    LossScaleConfig,
    MemoryConfig,
    MixedPrecisionConfig,
    PlacementConfig,
)
from lightning_pstar.config_values import (
    UnknownOptionError,
    _caller_stacklevel,
    _flag,
    _section,
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
