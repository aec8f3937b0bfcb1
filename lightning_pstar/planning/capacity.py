"""Capacity planner: before training, does a model fit, and what is the largest of its family that does?

    python -m lightning_pstar.plan configs/model/gpt_small.yaml --device-memory 80GiB --host-memory 512GiB
    python -m lightning_pstar.plan mypkg.models:build --set n_layer=48 --device-memory 80GiB --host-memory 1TiB

The model is built on the meta device (no memory for weights), laid out in chunks by the engine's own
planner (:func:`~lightning_pstar.planning.layout.search_chunk_size` / :func:`~lightning_pstar.planning.layout.plan_layout`,
trainable and frozen parameters in separate families) and priced with the bytes per element that
:class:`~lightning_pstar.runtime.manager.ChunkManager` allocates once the optimizer has added its states:

    trainable family: compute dtype + 4 (fp32 master in mixed precision, fp32 grad chunk in 32-true)
                      + optimizer states (Adam 8, SGD with momentum 4, SGD 0)
                      + 4 in mixed precision with gradient accumulation (the fp32 gradient sum)
    frozen family:    compute dtype only

times the chunk CAPACITY (padding included), so ``CapacityPlan.model_data_bytes`` equals
``ChunkManager.memory_report().model_data_bytes`` of the same model. Activations (non-model data) are not
part of the plan: they depend on the batch and are measured by the warm-up iteration. With
``cpu_embedding`` untied embedding weights stay fp32 on HOST outside the chunks (weight, gradient and
optimizer states, a replica per rank) and count against the host budget.

Both budgets are per rank and mean what the strategy's ``device_memory_limit`` and ``host_memory_limit`` mean
(the strategy's defaults are 0.8 of the accelerator and 0.8 of the RAM per local rank: pass those figures
to plan for a run with default budgets; the "auto" chunk size depends on the device budget). A model
fits when (1) its model data per rank is at most device + host budget and (2) the parameter chunks that
must be resident at once for one module's forward (its own and its ancestors', whole chunk groups when
ranks gather them) fit the device budget.

Exit status of the command: 0 the model fits, 1 it does not, 2 bad input.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from lightning_pstar.config import PStarConfig, parse_bytes
from lightning_pstar.planning.layout import Layout, ParamSpec, plan_layout, search_chunk_size

if TYPE_CHECKING:
    from lightning_pstar.demos.gpt import GPTConfig

__all__ = [
    "BytesPerElement",
    "CapacityPlan",
    "LargestModel",
    "Scale",
    "build_meta_model",
    "bytes_per_element",
    "main",
    "min_device_bytes",
    "plan_capacity",
]

log = logging.getLogger(__name__)

_COMPUTE_ITEMSIZE: dict[str, int] = {"bf16-mixed": 2, "16-mixed": 2, "32-true": 4}
_OPTIMIZER_STATE_BYTES: dict[str, int] = {"adam": 8, "adamw": 8, "sgd-momentum": 4, "sgd": 0}
_GPT_REQUIRED = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")
_GPT_KEYS = (*_GPT_REQUIRED, "dropout", "bias")

ModelTarget = str | nn.Module | Callable[[], nn.Module]
"""A model config YAML path, an import path ``pkg.module:factory``, a module, or a zero-argument factory."""


class Scale(str, Enum):
    """Which sizes of the demo GPT grow in the largest-model search."""

    BOTH = "both"
    """Depth and width together: ``n_layer = k``, ``n_embd`` grows in proportion (same ``n_embd / n_layer``
    and head size as the given config, so ``n_head`` grows too), as GPT families scale."""
    N_LAYER = "n_layer"
    """Depth only: ``n_layer = k``."""
    N_EMBD = "n_embd"
    """Width only, in steps of ``n_head``: ``n_embd = k * n_head``."""


_SEARCH_LIMIT: dict[Scale, int] = {Scale.BOTH: 1024, Scale.N_LAYER: 1024, Scale.N_EMBD: 1 << 16}
"""Largest ``k`` the search tries; beyond it a meta build and a chunk-size search take too long to be useful."""


@dataclass(frozen=True, kw_only=True)
class BytesPerElement:
    """Bytes the engine allocates per chunk element of each chunk kind of a family."""

    param: int
    """Param chunk in the compute dtype (every family, frozen ones too)."""
    master: int
    """fp32 master chunk (mixed precision, trainable families)."""
    grad: int
    """fp32 grad chunk: 32-true always, mixed precision only when accumulating gradients."""
    optimizer: int
    """Optimizer-state chunks (Adam: exp_avg + exp_avg_sq; SGD with momentum: one buffer)."""
    frozen_master: int = 0
    """fp32 copy of a frozen family's weights on the host (mixed precision, ``frozen_master=True``)."""

    @property
    def trainable(self) -> int:
        return self.param + self.master + self.grad + self.optimizer

    @property
    def frozen(self) -> int:
        return self.param + self.frozen_master


def bytes_per_element(
    precision: str, optimizer: str, *, accumulates: bool = False, frozen_master: bool = True
) -> BytesPerElement:
    """What ``ChunkManager.materialise`` plus ``add_optimizer_chunks`` allocate per chunk element."""
    if precision not in _COMPUTE_ITEMSIZE:
        raise ValueError(
            f"`precision` must be one of {list(_COMPUTE_ITEMSIZE)}, got {precision!r}."
            " HINT: the planner prices the precisions the PatrickStar strategy trains with."
        )
    if optimizer not in _OPTIMIZER_STATE_BYTES:
        raise ValueError(
            f"`optimizer` must be one of {list(_OPTIMIZER_STATE_BYTES)}, got {optimizer!r}."
            " HINT: use 'sgd-momentum' for SGD with momentum != 0 and 'sgd' for plain SGD."
        )
    mixed = precision != "32-true"
    return BytesPerElement(
        param=_COMPUTE_ITEMSIZE[precision],
        master=4 if mixed else 0,
        grad=4 if (not mixed or accumulates) else 0,
        optimizer=_OPTIMIZER_STATE_BYTES[optimizer],
        frozen_master=4 if mixed and frozen_master else 0,
    )


@dataclass(kw_only=True)
class LargestModel:
    """Result of the largest-model search over the demo GPT family."""

    scale: str
    """Which sizes grew (see :class:`Scale`)."""
    config: dict[str, Any] | None
    """GPT config of the largest member that fits; None when not even the smallest member fits."""
    num_params: int
    model_data_bytes_per_rank: int
    next_config: dict[str, Any] | None
    """The member one step up, which does not fit; None when the search stopped at its limit."""
    next_num_params: int
    next_reasons: list[str]
    """Why the next member does not fit."""
    at_search_limit: bool
    """The search stopped at its largest candidate, which still fits: the true answer is larger."""
    candidates_planned: int


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
    device_model_data_bytes: int  # model data per rank that can stay on the device (budget permitting)
    host_model_data_bytes: int  # model data per rank that must live in host RAM (host embeddings included)
    fits_model_data: bool
    fits_min_device: bool
    largest: LargestModel | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.fits_model_data and self.fits_min_device

    @property
    def reasons(self) -> list[str]:
        """Why the model does not fit (empty when it does)."""
        out = []
        if not self.fits_model_data:
            need = self.model_data_bytes_per_rank + self.host_embedding_bytes
            budget, host = self.device_budget + self.host_budget, self.host_budget
            out.append(
                f"model data per rank {_fmt(need)} > device + host budget {_fmt(budget)}"
                if self.host_embedding_bytes <= host
                else f"host-resident embeddings {_fmt(self.host_embedding_bytes)} > host budget {_fmt(host)}"
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
        frozen = self.num_params - self.num_trainable_params
        rows = [
            ("model", self.target),
            ("precision", f"{self.precision}, optimizer {self.optimizer}, world size {self.world_size}"),
            ("parameters", f"{self.num_params:,} ({self.num_trainable_params:,} trainable, {frozen:,} frozen)"),
            (
                "chunks",
                f"{self.num_chunks} x {self.chunk_size:,} elements{' (auto)' if self.chunk_size_auto else ''},"
                f" {self.num_frozen_chunks} frozen; utilisation {self.chunk_utilisation:.1%}",
            ),
            ("model data", f"{_fmt(self.model_data_bytes)}, {self.bytes_per_param:.2f} B/param"),
            *((f"  {name}", _fmt(nbytes)) for name, nbytes in kinds),
            ("model data per rank", _fmt(self.model_data_bytes_per_rank)),
            *(
                [("host embeddings", f"{self.host_embedding_params:,} params, {_fmt(self.host_embedding_bytes)}")]
                if self.host_embedding_params
                else []
            ),
            (
                "DEVICE (per rank)",
                f"must hold {_fmt(self.min_device_bytes)} (module '{self.min_device_module}'), can hold"
                f" {_fmt(self.device_model_data_bytes)} of model data; budget {_fmt(self.device_budget)}",
            ),
            (
                "HOST (per rank)",
                f"must hold {_fmt(self.host_model_data_bytes)}; budget {_fmt(self.host_budget)}",
            ),
            ("fits", "yes" if self.fits else "NO: " + "; ".join(self.reasons)),
        ]
        if self.largest is not None:
            rows.append(("largest that fits", _describe_largest(self.largest)))
        width = max(len(k) for k, _ in rows)
        lines = [f"  {k:<{width}}  {v}" for k, v in rows]
        lines += [f"  note: {n}" for n in self.notes]
        return "PatrickStar capacity plan\n" + "\n".join(lines)


def _fmt(n: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit} ({n:,} B)"
    return f"{n:,} B"


def _describe_gpt(config: Mapping[str, Any]) -> str:
    return "GPT(" + ", ".join(f"{k}={config[k]}" for k in _GPT_REQUIRED) + ")"


def _describe_largest(largest: LargestModel) -> str:
    if largest.config is None:
        return f"none (scaling {largest.scale}: even the smallest member does not fit)"
    text = (
        f"{_describe_gpt(largest.config)}: {largest.num_params:,} parameters,"
        f" {_fmt(largest.model_data_bytes_per_rank)} model data per rank (scaling {largest.scale})"
    )
    if largest.at_search_limit:
        return text + "; the search limit was reached, larger ones fit too"
    assert largest.next_config is not None
    why = "; ".join(largest.next_reasons)
    return text + f"; the next size up, {_describe_gpt(largest.next_config)}, does not ({why})"


# ---- model construction (meta device only) ------------------------------------------------------------
def _parse_value(text: str) -> Any:
    """``--set`` values: int, float, bool or the string itself."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _gpt_config_from_yaml(path: Path, overrides: Mapping[str, Any]) -> GPTConfig:
    from omegaconf import OmegaConf

    from lightning_pstar.demos.gpt import GPTConfig

    try:
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as err:  # yaml and OmegaConf errors alike: report them with the file
        raise ValueError(f"Cannot read the model config {str(path)!r}: {err} HINT: check the YAML syntax.") from err
    if not isinstance(raw, dict):
        raise ValueError(f"The model config {str(path)!r} is not a mapping. HINT: pass a file such as gpt_small.yaml.")
    if not any(k in raw for k in _GPT_REQUIRED) and isinstance(raw.get("model"), dict):
        raw = raw["model"]  # a composed Hydra config (e.g. a run's .hydra/config.yaml)
    values = {k: raw[k] for k in _GPT_KEYS if k in raw}
    unknown = sorted(set(overrides) - set(_GPT_KEYS))
    if unknown:
        raise ValueError(f"Unknown GPT size(s) {unknown} in --set. HINT: the keys are {list(_GPT_KEYS)}.")
    values.update(overrides)
    missing = [k for k in _GPT_REQUIRED if k not in values]
    if missing:
        raise ValueError(
            f"The model config {str(path)!r} does not describe a demo GPT: missing {missing}. HINT: pass a model"
            " config such as configs/model/gpt_small.yaml, add the keys with --set, or give a factory"
            " 'pkg.module:factory'."
        )
    return GPTConfig(**values)


def _import_factory(target: str) -> Callable[..., Any]:
    module_name, _, attr = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"Unknown model target {target!r}: cannot import module {module_name!r} ({err})."
            " HINT: pass 'pkg.module:factory' of an importable module, or a model config YAML path."
        ) from err
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(
                f"Unknown model target {target!r}: module {module_name!r} has no attribute {attr!r}."
                " HINT: name a function or class that returns an nn.Module."
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"Model target {target!r} is not callable. HINT: name a factory returning an nn.Module.")
    return obj


def build_meta_model(
    target: ModelTarget, *, overrides: Mapping[str, Any] | None = None
) -> tuple[nn.Module, str, GPTConfig | None]:
    """Build ``target`` on the meta device; return the module, a description, and its GPT config if any.

    A YAML target is a demo GPT config (``overrides`` replace its sizes); a factory (``pkg.module:factory``
    or a callable) is called with ``overrides`` as keyword arguments. A module with a Lightning-style
    ``configure_model()`` hook gets it called, as the strategy would.
    """
    overrides = dict(overrides or {})
    gpt_config: GPTConfig | None = None
    if isinstance(target, nn.Module):
        if overrides:
            raise ValueError("`overrides` need a target the planner builds. HINT: pass a YAML path or a factory.")
        return target, type(target).__name__, None
    if isinstance(target, str) and (target.endswith((".yaml", ".yml")) or Path(target).is_file()):
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"Model config {target!r} does not exist. HINT: e.g. configs/model/gpt_small.yaml.")
        gpt_config = _gpt_config_from_yaml(path, overrides)
        return _build_gpt(gpt_config), f"{target}: {_describe_gpt(asdict(gpt_config))}", gpt_config
    if isinstance(target, str):
        if ":" not in target:
            raise ValueError(
                f"Unknown model target {target!r}: neither a YAML file nor an import path."
                " HINT: pass a model config such as configs/model/gpt_small.yaml or 'pkg.module:factory'."
            )
        factory, description = _import_factory(target), target
    else:
        factory, description = target, getattr(target, "__qualname__", repr(target))
    with torch.device("meta"):
        try:
            model = factory(**overrides)
        except TypeError as err:
            raise ValueError(
                f"Calling model factory {description!r} with {overrides} failed: {err}."
                " HINT: --set passes keyword arguments to a factory; check their names."
            ) from err
        if not isinstance(model, nn.Module):
            raise ValueError(
                f"Model factory {description!r} returned {type(model).__name__}, not an nn.Module."
                " HINT: the factory must return the model to train."
            )
        configure = getattr(model, "configure_model", None)
        if callable(configure):
            configure()
    return model, f"{description}: {type(model).__name__}", gpt_config


def _build_gpt(config: GPTConfig) -> nn.Module:
    from lightning_pstar.demos.gpt import GPT

    with torch.device("meta"):
        return GPT(config)


# ---- pure planning --------------------------------------------------------------------------------------
def _host_embeddings(module: nn.Module) -> list[tuple[nn.Parameter, str]]:
    """``cpu_embedding``: the embedding weights the engine keeps fp32 on HOST, outside the chunks.

    The rule of ``ChunkManager._host_embeddings``: every ``nn.Embedding`` weight not shared with another
    module (a tied output head computes on the device, so a tied weight stays in the chunks).
    """
    uses: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        uses.setdefault(id(param), []).append(name)
    out: dict[int, tuple[nn.Parameter, str]] = {}
    for mod in module.modules():
        if isinstance(mod, nn.Embedding) and len(uses[id(mod.weight)]) == 1:
            out[id(mod.weight)] = (cast(nn.Parameter, mod.weight), uses[id(mod.weight)][0])
    return list(out.values())


def _collect_parameters(module: nn.Module, exclude: set[int]) -> list[tuple[nn.Parameter, str]]:
    """Unique parameters in the engine's order (``ChunkManager._collect_parameters``), with their first name."""
    seen: dict[int, tuple[nn.Parameter, str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in seen or id(param) in exclude:
            continue
        if not param.is_floating_point():
            raise ValueError(
                f"Parameter '{name}' has dtype {param.dtype}; PatrickStar chunks hold floating-point"
                " parameters only. HINT: register integer tensors as buffers (`register_buffer`)."
            )
        seen[id(param)] = (param, name)
    return list(seen.values())


def min_device_bytes(
    module: nn.Module, layout: Layout, param_index: Mapping[int, int], *, itemsize: int, world_size: int = 1
) -> tuple[int, str]:
    """Bytes of param chunks one module's forward needs resident at once, and the module's name.

    The same walk as ``ChunkManager.min_device_bytes``: a module counts the chunks of its own and its
    ancestors' direct parameters. With several ranks a chunk is gathered with its whole group, so groups
    are counted. ``param_index`` maps ``id(parameter)`` to its index in the layout (parameters outside the
    chunks are left out).
    """
    group_bytes: dict[int, int] = {}
    for chunk in layout.chunks:
        group = chunk.chunk_id // world_size
        group_bytes[group] = group_bytes.get(group, 0) + chunk.capacity * itemsize
    worst, worst_name = 0, ""

    def visit(mod: nn.Module, name: str, inherited: frozenset[int]) -> None:
        nonlocal worst, worst_name
        own = {
            layout.param_chunk[param_index[id(p)]] // world_size
            for p in mod.parameters(recurse=False)
            if id(p) in param_index  # host-resident embeddings have no chunk
        }
        groups = inherited | own
        need = sum(group_bytes[g] for g in groups)
        if need > worst:
            worst, worst_name = need, name or "<root>"
        for child_name, child in mod.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name, groups)

    visit(module, "", frozenset())
    return worst, worst_name


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
) -> _Settings:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"`world_size` must be a positive int, got {world_size!r}. HINT: the number of ranks.")
    if isinstance(accumulate_grad_batches, bool) or accumulate_grad_batches < 1:
        raise ValueError(f"`accumulate_grad_batches` must be >= 1, got {accumulate_grad_batches!r}.")
    device_budget = parse_bytes(device_memory, name="device_memory")
    host_budget = parse_bytes(host_memory, name="host_memory")
    chunk_elements = PStarConfig(chunk_size=chunk_size).chunk_elements  # the strategy's own validation
    mixed = precision != "32-true"
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
    )


def _per_rank_bytes(layout: Layout, bpe: BytesPerElement, world_size: int) -> int:
    """Chunk bytes of the rank that owns the most (chunk ``i`` is owned by rank ``i % world_size``)."""
    owned = [0] * world_size
    for chunk in layout.chunks:
        owned[chunk.chunk_id % world_size] += chunk.capacity * (bpe.trainable if chunk.trainable else bpe.frozen)
    return max(owned)


def _host_embedding_bytes(host: Sequence[tuple[nn.Parameter, str]], bpe: BytesPerElement) -> int:
    """fp32 weight, fp32 gradient and optimizer states of each trainable host-resident embedding (every rank
    keeps a replica); a frozen one is its fp32 weight only."""
    return sum(p.numel() * (4 + 4 + bpe.optimizer if p.requires_grad else 4) for p, _ in host)


def _notes(named: Sequence[tuple[nn.Parameter, str]]) -> list[str]:
    notes = ["activations (non-model data) are not included: leave device memory for them"]
    allocated = [name for p, name in named if not p.is_meta]
    if allocated:
        notes.append(f"{len(allocated)} parameter(s) were not built on the meta device (first: '{allocated[0]}')")
        log.warning("the model factory allocated parameters outside the meta device, e.g. '%s'", allocated[0])
    return notes


def _plan_module(module: nn.Module, description: str, settings: _Settings) -> CapacityPlan:
    host = _host_embeddings(module) if settings.cpu_embedding else []
    named = _collect_parameters(module, exclude={id(p) for p, _ in host})
    if not named:
        raise ValueError(f"The model {description!r} has no parameters. HINT: nothing to plan for PatrickStar.")
    specs = [ParamSpec(name=name, numel=p.numel(), trainable=p.requires_grad) for p, name in named]
    bpe, ws, device = settings.bytes_per_element, settings.world_size, settings.device_budget
    if settings.chunk_elements is None:
        layout = search_chunk_size(specs, device_budget_bytes=device, compute_itemsize=bpe.param, world_size=ws)
    else:
        layout = plan_layout(specs, settings.chunk_elements, world_size=ws)
    trainable_cap = sum(c.capacity for c in layout.chunks if c.trainable)
    total = layout.family_bytes(trainable_bytes_per_elem=bpe.trainable, frozen_bytes_per_elem=bpe.frozen)
    per_rank = _per_rank_bytes(layout, bpe, ws)
    embeddings = _host_embedding_bytes(host, bpe)
    frozen_cap = layout.capacity_elements - trainable_cap
    # the fp32 copies of frozen weights never go to the device: the owner with the most of them keeps them on the host
    frozen_master_per_rank = (
        max(sum(c.capacity for c in layout.chunks if not c.trainable and c.chunk_id % ws == r) for r in range(ws))
        * bpe.frozen_master
    )
    host_need = embeddings + frozen_master_per_rank + max(0, per_rank - frozen_master_per_rank - device)
    index = {id(p): i for i, (p, _) in enumerate(named)}
    need, where = min_device_bytes(module, layout, index, itemsize=bpe.param, world_size=ws)
    num_params = layout.payload_elements + sum(p.numel() for p, _ in host)
    return CapacityPlan(
        target=description,
        precision=settings.precision,
        optimizer=settings.optimizer,
        world_size=ws,
        num_params=num_params,
        num_trainable_params=sum(p.numel() for p, _ in [*named, *host] if p.requires_grad),
        chunk_size=layout.chunk_size,
        chunk_size_auto=settings.chunk_elements is None,
        num_chunks=len(layout.chunks),
        num_frozen_chunks=sum(not c.trainable for c in layout.chunks),
        chunk_utilisation=layout.utilisation,
        bytes_per_element=bpe,
        param_chunk_bytes=layout.capacity_elements * bpe.param,
        master_bytes=trainable_cap * bpe.master,
        grad_bytes=trainable_cap * bpe.grad,
        optimizer_state_bytes=trainable_cap * bpe.optimizer,
        frozen_master_bytes=frozen_cap * bpe.frozen_master,
        model_data_bytes=total,
        model_data_bytes_per_rank=per_rank,
        host_embedding_params=sum(p.numel() for p, _ in host),
        host_embedding_bytes=embeddings,
        bytes_per_param=(total + embeddings) / num_params,
        device_budget=device,
        host_budget=settings.host_budget,
        min_device_bytes=need,
        min_device_module=where,
        device_model_data_bytes=min(per_rank - frozen_master_per_rank, device),
        host_model_data_bytes=host_need,
        fits_model_data=host_need <= settings.host_budget,
        fits_min_device=need <= device,
        notes=_notes([*named, *host]),
    )


# ---- largest model of the GPT family ----------------------------------------------------------------------
def _family_member(base: GPTConfig, scale: Scale, k: int) -> GPTConfig:
    if scale is Scale.N_LAYER:
        return replace(base, n_layer=k)
    if scale is Scale.N_EMBD:
        return replace(base, n_embd=k * base.n_head)
    head = base.n_embd // base.n_head
    heads = max(1, round(k * base.n_embd / (base.n_layer * head)))
    return replace(base, n_layer=k, n_head=heads, n_embd=heads * head)


def _family_index(base: GPTConfig, scale: Scale) -> int:
    return base.n_embd // base.n_head if scale is Scale.N_EMBD else base.n_layer


def _interpolate(lo: int, lo_plan: CapacityPlan, hi: int, hi_plan: CapacityPlan) -> int | None:
    """Where model data per rank reaches the budget, between ``lo`` (fits) and ``hi`` (too much model data).

    Model data grows as a power of the family index (1 for depth, 2 for width, 3 for both), so a straight line
    through the two points in log-log space lands within a member or two of the answer. None when ``hi`` fails
    for another reason (the minimum device need), where only bisection is sound.
    """
    if not hi_plan.fits_min_device or hi_plan.fits_model_data:
        return None
    budget = hi_plan.device_budget + hi_plan.host_budget
    b_lo, b_hi = lo_plan.model_data_bytes_per_rank, hi_plan.model_data_bytes_per_rank
    if not 0 < b_lo <= budget < b_hi:
        return None
    t = (math.log(budget) - math.log(b_lo)) / (math.log(b_hi) - math.log(b_lo))
    guess = math.floor(math.exp(math.log(lo) + t * (math.log(hi) - math.log(lo))))
    return min(max(guess, lo + 1), hi - 1)


def _find_largest(base: GPTConfig, scale: Scale, settings: _Settings, *, base_plan: CapacityPlan) -> LargestModel:
    """Gallop up from ``base`` by doubling, then narrow down (interpolation, bisection as the safeguard) to the
    member ``k`` that fits while ``k + 1`` does not. Each candidate is built on the meta device and planned."""
    plans: dict[int, CapacityPlan] = {_family_index(base, scale): base_plan}

    def plan_of(k: int) -> CapacityPlan:
        if k not in plans:
            config = _family_member(base, scale, k)
            plans[k] = _plan_module(_build_gpt(config), _describe_gpt(asdict(config)), settings)
        return plans[k]

    limit = _SEARCH_LIMIT[scale]
    k0 = min(_family_index(base, scale), limit)
    if plan_of(k0).fits:
        lo, hi = k0, None
        while hi is None and lo < limit:
            k = min(2 * lo, limit)
            lo, hi = (k, None) if plan_of(k).fits else (lo, k)
    elif k0 == 1 or not plan_of(1).fits:
        return LargestModel(
            scale=scale.value,
            config=None,
            num_params=0,
            model_data_bytes_per_rank=0,
            next_config=asdict(_family_member(base, scale, 1)),
            next_num_params=plan_of(1).num_params,
            next_reasons=plan_of(1).reasons,
            at_search_limit=False,
            candidates_planned=len(plans),
        )
    else:
        lo, hi = 1, k0
    interpolate = True
    while hi is not None and hi - lo > 1:
        width = hi - lo
        guess = _interpolate(lo, plan_of(lo), hi, plan_of(hi)) if interpolate else None
        mid = guess if guess is not None else (lo + hi) // 2
        lo, hi = (mid, hi) if plan_of(mid).fits else (lo, mid)
        # bisect next whenever interpolating did not halve the interval (slow one-sided convergence)
        interpolate = guess is None or 2 * (hi - lo) <= width
    best = plan_of(lo)
    nxt = plan_of(hi) if hi is not None else None
    return LargestModel(
        scale=scale.value,
        config=asdict(_family_member(base, scale, lo)),
        num_params=best.num_params,
        model_data_bytes_per_rank=best.model_data_bytes_per_rank,
        next_config=asdict(_family_member(base, scale, hi)) if hi is not None else None,
        next_num_params=nxt.num_params if nxt is not None else 0,
        next_reasons=nxt.reasons if nxt is not None else [],
        at_search_limit=hi is None,
        candidates_planned=len(plans),
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
) -> CapacityPlan:
    """Plan the chunks of ``target`` and say whether it fits ``device_memory`` + ``host_memory`` per rank.

    ``target``: a demo GPT config YAML path, ``pkg.module:factory``, a zero-argument factory or a module
    (any of them built on the meta device; a module given as such is read, never copied). For a demo GPT,
    ``search_largest`` also finds the largest member of its family that fits, growing ``scale``.
    The other options are the strategy's (``chunk_size``, ``cpu_embedding``) and the run's (precision,
    optimizer, gradient accumulation, number of ranks); both budgets are per rank.
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
    )
    module, description, gpt_config = build_meta_model(target, overrides=overrides)
    plan = _plan_module(module, description, settings)
    if search_largest and gpt_config is not None:
        plan.largest = _find_largest(gpt_config, scale, settings, base_plan=plan)
    elif search_largest:
        plan.notes.append("the largest-model search covers the demo GPT family (a model config YAML target)")
    return plan


# ---- command line -------------------------------------------------------------------------------------------
def _byte_size(text: str) -> int:
    try:
        return parse_bytes(text, name="size")
    except ValueError as err:
        raise argparse.ArgumentTypeError(
            f"invalid byte size {text!r}. HINT: a number with an optional unit, e.g. 80GiB, 512MiB, 1.5TB."
        ) from err


def _chunk_size(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"invalid chunk size {text!r}. HINT: 'auto' or a positive element count.")
    return value


def _assignment(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"invalid --set {text!r}. HINT: write KEY=VALUE, e.g. n_layer=48.")
    return key.strip(), _parse_value(value)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_pstar.plan",
        description="Will a model fit under PatrickStar? Builds it on the meta device and plans its chunks."
        " Exit status: 0 fits, 1 does not fit, 2 bad input.",
    )
    parser.add_argument("target", help="model config YAML (e.g. configs/model/gpt_small.yaml) or pkg.module:factory")
    parser.add_argument(
        "--device-memory", type=_byte_size, required=True,
        help="chunk budget per rank on the device, e.g. 80GiB: the strategy's device_memory_limit (its default is"
        " device_memory_fraction=0.8 of the accelerator)",
    )  # fmt: skip
    parser.add_argument(
        "--host-memory", type=_byte_size, required=True,
        help="chunk budget per rank in host RAM, e.g. 512GiB: the strategy's host_memory_limit (its default is"
        " host_memory_fraction=0.8 of the RAM divided by the ranks of a node)",
    )  # fmt: skip
    parser.add_argument("--world-size", type=int, default=1, help="number of ranks (ZeRO-DP over chunks)")
    parser.add_argument("--precision", choices=list(_COMPUTE_ITEMSIZE), default="bf16-mixed")
    parser.add_argument("--chunk-size", type=_chunk_size, default="auto", help="'auto' or elements per chunk")
    parser.add_argument("--optimizer", choices=list(_OPTIMIZER_STATE_BYTES), default="adam")
    parser.add_argument("--accumulate-grad-batches", type=int, default=1, help="> 1 adds fp32 gradient sums")
    parser.add_argument("--cpu-embedding", action="store_true", help="embeddings fp32 on HOST, outside chunks")
    parser.add_argument(
        "--no-frozen-master", action="store_true", help="frozen parameters only in the compute dtype (no fp32 copy)"
    )
    parser.add_argument(
        "--set", dest="overrides", type=_assignment, action="append", default=[], metavar="KEY=VALUE",
        help="override a GPT size (n_layer, n_embd, n_head, vocab_size, block_size) or pass a factory argument",
    )  # fmt: skip
    parser.add_argument("--scale", choices=[s.value for s in Scale], default=Scale.BOTH.value, help="largest search")
    parser.add_argument("--no-largest", action="store_true", help="skip the largest-model search")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        plan = plan_capacity(
            args.target,
            device_memory=args.device_memory,
            host_memory=args.host_memory,
            world_size=args.world_size,
            precision=args.precision,
            chunk_size=args.chunk_size,
            optimizer=args.optimizer,
            accumulate_grad_batches=args.accumulate_grad_batches,
            cpu_embedding=args.cpu_embedding,
            frozen_master=not args.no_frozen_master,
            overrides=dict(args.overrides),
            search_largest=not args.no_largest,
            scale=args.scale,
        )
    except ValueError as err:
        parser.error(str(err))  # exits with status 2
    print(json.dumps(plan.as_dict(), indent=2) if args.json else plan)
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
