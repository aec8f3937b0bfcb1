"""Typed configuration of the PatrickStar strategy.

Every option lives in one ``kw_only`` dataclass tree so that Python users, OmegaConf structured configs
and Hydra YAML files are validated by the same code: OmegaConf rejects unknown keys and wrong types,
``__post_init__`` rejects bad values with a message naming the field, the value and what is accepted.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = ["LossScaleConfig", "PStarConfig", "Placement", "parse_bytes"]


class Placement(str, Enum):
    """How chunks are placed between the DEVICE and HOST tiers."""

    AUTO = "auto"
    """PatrickStar's policy: a warm-up iteration records non-model memory and chunk accesses per moment;
    afterwards chunks use ``budget - non_model[t]`` at moment ``t``, the chunk used farthest in the future
    is evicted first, the next moment's chunks are prefetched, and optimizer-state families that fit the
    margin at the optimizer step run on the device."""
    STATIC = "static"
    """ZeRO-Offload style baseline: chunks may use ``static_chunk_fraction`` of the device budget; when it
    is full the least recently used ``HOLD*`` chunk is evicted to HOST. Optimizer states stay on DEVICE only
    if all model data fits that share."""


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BYTES_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str, *, name: str) -> int:
    """Turn ``123``, ``"512MiB"``, ``"8GiB"`` or ``"1.5GB"`` into a positive number of bytes.

    ``name`` is the option being parsed; it is named in the error.
    """
    if isinstance(value, bool):
        raise ValueError(f"`{name}` must be a byte count such as 8589934592 or '8GiB', got {value!r}.")
    if isinstance(value, int):
        nbytes = value
    elif isinstance(value, str):
        match = _BYTES_RE.match(value)
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"`{name}` must be a byte count such as 8589934592 or '8GiB', got {value!r}."
                " HINT: accepted units are B, KB, MB, GB, TB, KiB, MiB, GiB, TiB."
            )
        nbytes = int(float(match.group(1)) * _UNITS[unit])
    else:
        raise ValueError(f"`{name}` must be an int or a string such as '8GiB', got {type(value).__name__}.")
    if nbytes <= 0:
        raise ValueError(f"`{name}` must be positive, got {value!r}.")
    return nbytes


@dataclass(kw_only=True)
class LossScaleConfig:
    """Dynamic loss scaling for ``16-mixed``; ignored in the other precisions."""

    initial_scale: float = 2.0**16
    """Loss scale at the first step."""
    growth_factor: float = 2.0
    """Multiplier applied after ``growth_interval`` steps without inf/nan gradients (> 1)."""
    backoff_factor: float = 0.5
    """Multiplier applied when a step overflows; the step is skipped (between 0 and 1)."""
    growth_interval: int = 2000
    """Number of consecutive finite steps before the scale grows (>= 1)."""
    min_scale: float = 1.0
    """Smallest scale allowed; reaching it raises an error rather than skipping steps forever."""

    def __post_init__(self) -> None:
        if not self.initial_scale > 0:
            raise ValueError(f"`loss_scale.initial_scale` must be > 0, got {self.initial_scale!r}.")
        if not self.growth_factor > 1:
            raise ValueError(f"`loss_scale.growth_factor` must be > 1, got {self.growth_factor!r}.")
        if not 0 < self.backoff_factor < 1:
            raise ValueError(f"`loss_scale.backoff_factor` must be in (0, 1), got {self.backoff_factor!r}.")
        if self.growth_interval < 1:
            raise ValueError(f"`loss_scale.growth_interval` must be >= 1, got {self.growth_interval!r}.")
        if not 0 < self.min_scale <= self.initial_scale:
            raise ValueError(
                f"`loss_scale.min_scale` must be in (0, initial_scale={self.initial_scale}], got {self.min_scale!r}."
            )


@dataclass(kw_only=True)
class PStarConfig:
    """All options of :class:`~lightning_pstar.PatrickStarStrategy`.

    Byte budgets accept an int (bytes) or a string with a unit ("512MiB", "8GiB").
    """

    chunk_size: int | str = "auto"
    """Capacity of one chunk in elements, or "auto": the size that wastes the fewest bytes while two
    chunk groups still fit the device budget. A parameter larger than an explicit size gets a chunk of
    its own."""
    placement: str = "auto"
    """Placement policy of chunks between DEVICE and HOST: "auto" (trace-driven, the default) or "static"
    (a fixed share of the budget, least recently used eviction)."""
    device_memory_limit: int | str | None = None
    """Bytes of chunk data allowed on the device. None: unlimited on a simulated (CPU) device,
    ``device_memory_fraction`` of the accelerator's memory on a GPU."""
    host_memory_limit: int | str | None = None
    """Bytes of chunk data allowed in host RAM. None: ``host_memory_fraction`` of the machine's RAM
    divided by the number of local ranks."""
    device_memory_fraction: float = 0.8
    """Share of the accelerator's total memory used as the default device budget (0, 1]."""
    host_memory_fraction: float = 0.8
    """Share of host RAM used as the default host budget (0, 1]."""
    static_chunk_fraction: float = 1.0
    """``placement="static"``: share of the device budget chunks may use (the rest is left to activations)
    (0, 1]."""
    warmup_chunk_fraction: float = 0.25
    """``placement="auto"``: share of the device budget chunks may use during the warm-up iteration, while
    non-model memory is measured (0, 1]; never less than one module's chunks."""
    checkpoint: str = "consolidated"
    """How checkpoints are written: "consolidated" (one ordinary Lightning file with the model's own names and
    torch's optimizer layout, gathered family by family to rank 0) or "sharded" (a directory in which every
    rank writes what it owns with torch.distributed.checkpoint; loads at any world size; turn it into one file
    with ``python -m lightning_pstar.consolidate DIR OUT.ckpt``)."""
    cpu_embedding: bool = False
    """Keep ``nn.Embedding`` weights fp32 on the host, outside the chunks: the lookup runs on the host and
    only its output moves to the device. Frees the largest tensor from setting the chunk size. Embeddings
    tied to another module (an output head) stay in the chunks."""
    frozen_master: bool = True
    """Mixed precision: keep an fp32 copy of every frozen parameter (``requires_grad=False``) in host memory
    next to its compute-dtype chunk, so checkpoints and state dicts return the frozen weights exactly as
    given (4 host bytes per frozen element). False stores them only in the compute dtype (2 bytes per
    element, as DeepSpeed does): saved frozen weights are then rounded to bf16/fp16."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """Dynamic loss scaling for ``16-mixed``."""

    def __post_init__(self) -> None:
        if isinstance(self.loss_scale, Mapping):
            known = set(LossScaleConfig.__dataclass_fields__)
            unknown = sorted(set(self.loss_scale) - known)
            if unknown:
                raise ValueError(f"Unknown `loss_scale` option(s) {unknown}. HINT: the options are {sorted(known)}.")
            self.loss_scale = LossScaleConfig(**self.loss_scale)
        if not isinstance(self.loss_scale, LossScaleConfig):
            raise ValueError(
                f"`loss_scale` must be a LossScaleConfig or a dict of its options, got {self.loss_scale!r}."
            )
        if isinstance(self.chunk_size, str) and self.chunk_size.strip().lstrip("-").isdigit():
            self.chunk_size = int(self.chunk_size)
        if isinstance(self.chunk_size, bool) or not (
            self.chunk_size == "auto" or (isinstance(self.chunk_size, int) and self.chunk_size > 0)
        ):
            raise ValueError(
                f"`chunk_size` must be a positive number of elements or 'auto', got {self.chunk_size!r}."
                " HINT: use chunk_size='auto' to let the strategy pick it."
            )
        for name in ("cpu_embedding", "frozen_master"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be true or false, got {getattr(self, name)!r}.")
        if self.checkpoint not in ("consolidated", "sharded"):
            raise ValueError(f"`checkpoint` must be 'consolidated' or 'sharded', got {self.checkpoint!r}.")
        accepted = [p.value for p in Placement]
        if self.placement not in accepted:
            raise ValueError(f"`placement` must be one of {accepted}, got {self.placement!r}.")
        for name in ("device_memory_limit", "host_memory_limit"):
            value = getattr(self, name)
            if value is not None:
                parse_bytes(value, name=name)
        for name in (
            "device_memory_fraction",
            "host_memory_fraction",
            "static_chunk_fraction",
            "warmup_chunk_fraction",
        ):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"`{name}` must be in (0, 1], got {value!r}.")

    @property
    def chunk_elements(self) -> int | None:
        """The explicit chunk size in elements, or None for "auto"."""
        return None if self.chunk_size == "auto" else int(self.chunk_size)

    @property
    def device_limit_bytes(self) -> int | None:
        """``device_memory_limit`` in bytes, or None when unset."""
        v = self.device_memory_limit
        return None if v is None else parse_bytes(v, name="device_memory_limit")

    @property
    def host_limit_bytes(self) -> int | None:
        """``host_memory_limit`` in bytes, or None when unset."""
        v = self.host_memory_limit
        return None if v is None else parse_bytes(v, name="host_memory_limit")

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> PStarConfig:
        """Build a config from a dict or OmegaConf node, validated by OmegaConf's structured schema.

        A misspelled key raises an error that names the key; ``_target_`` (Hydra) is ignored.
        """
        from omegaconf import OmegaConf
        from omegaconf.errors import ConfigKeyError, ValidationError

        schema = OmegaConf.structured(cls)
        plain = OmegaConf.to_container(OmegaConf.create(dict(options)), resolve=True) if options else {}
        assert isinstance(plain, dict)
        plain.pop("_target_", None)
        try:
            merged = OmegaConf.merge(schema, plain)
        except ConfigKeyError as err:
            node = schema
            parts = str(err.full_key).split(".")
            for part in parts[:-1]:
                node = node[part]
            known = sorted(str(k) for k in node.keys())
            raise ValueError(f"Unknown PatrickStar option '{err.full_key}'. HINT: the options are {known}.") from err
        except ValidationError as err:
            raise ValueError(f"Invalid PatrickStar option: {err.msg}") from err
        obj = OmegaConf.to_object(merged)
        assert isinstance(obj, cls)
        return obj
