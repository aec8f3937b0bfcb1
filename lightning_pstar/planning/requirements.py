"""What a model needs: which parameters go where, bytes per element per chunk kind, what one module needs
resident, and what the model data needs per tier.

Pure functions over a module, a :class:`~lightning_pstar.planning.layout.Layout` and numbers: the engine
(:func:`~lightning_pstar.runtime.setup_plan.plan_setup`) calls them at setup and the capacity planner
(:mod:`lightning_pstar.planning.capacity`) calls them before training, so every figure both compute is the
same function's result. What the run needs per tier is :mod:`lightning_pstar.planning.tiers`' (re-exported here).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import cast

from torch import nn

from lightning_pstar.planning.layout import Fit, Layout, ParamSpec, group_of, plan_layout, search_chunk_size
from lightning_pstar.planning.tiers import (
    BytesPerElement,
    MemoryBudgetError,
    TierNeed,
    check_budgets,
    step_temporary_bytes,
    tier_need,
)

__all__ = [
    "BytesPerElement",
    "MemoryBudgetError",
    "TierNeed",
    "check_budgets",
    "chunk_layout",
    "collect_parameters",
    "friendly_chunk_elements",
    "host_embedding_bytes",
    "host_embeddings",
    "min_device_bytes",
    "module_parameters",
    "step_temporary_bytes",
    "tier_need",
]

log = logging.getLogger(__name__)


def host_embeddings(module: nn.Module, *, for_training: bool = True) -> dict[str, nn.Parameter]:
    """``cpu_embedding``: the embedding weights that stay fp32 on HOST, outside the chunks, by name.

    Every ``nn.Embedding`` weight not shared with another module: a weight tied to an output head computes on
    the device too and stays in the chunks (logged, never silent). ``for_training`` (the engine) refuses a
    meta-device embedding, whose values would be lost; the planner prices meta models and passes False.
    """
    uses: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        uses.setdefault(id(param), []).append(name)
    out: dict[str, nn.Parameter] = {}
    for name, mod in module.named_modules():
        if not isinstance(mod, nn.Embedding):
            continue
        names = uses[id(mod.weight)]
        if len(names) > 1:
            if for_training:
                log.warning(
                    "cpu_embedding: '%s' is shared with %s and stays in the chunks (a tied weight is used on the"
                    " device too).",
                    names[0],
                    names[1:],
                )
            continue
        if for_training and mod.weight.is_meta:
            raise ValueError(
                f"cpu_embedding: embedding '{name}' was built on the meta device. HINT: build embeddings in"
                " `__init__`, or set cpu_embedding=False."
            )
        out[names[0]] = cast(nn.Parameter, mod.weight)
    return out


FUNCTIONAL_CHILDREN: dict[type[nn.Module], tuple[str, ...]] = {nn.MultiheadAttention: ("out_proj",)}
"""Modules whose forward uses the parameters of these children without calling them: torch's
``nn.MultiheadAttention`` passes ``out_proj.weight``/``bias`` to ``F.multi_head_attention_forward``, so
``out_proj``'s own forward (and its hooks) never run ([Note: weights used by another module's forward])."""


def module_parameters(module: nn.Module) -> dict[nn.Module, list[nn.Parameter]]:
    """The parameters each module's forward computes with: its direct ones, plus the parameters of children it
    uses without calling them (:data:`FUNCTIONAL_CHILDREN`). Their chunks must be resident in its moment."""
    out: dict[nn.Module, list[nn.Parameter]] = {}
    for mod in module.modules():
        params = [p for p in mod.parameters(recurse=False)]
        for cls, children in FUNCTIONAL_CHILDREN.items():
            if isinstance(mod, cls):
                for name in children:
                    child = getattr(mod, name, None)
                    if isinstance(child, nn.Module):
                        params += [p for p in child.parameters() if all(p is not q for q in params)]
        if params:
            out[mod] = params
    return out


def collect_parameters(module: nn.Module, exclude: set[int]) -> list[tuple[nn.Parameter, list[str]]]:
    """Unique parameters in module order with every name each has (tied weights have several); parameters
    whose id is in ``exclude`` (host-resident embeddings) are left out."""
    seen: dict[int, tuple[nn.Parameter, list[str]]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in exclude:
            continue
        if id(param) in seen:
            seen[id(param)][1].append(name)
            continue
        if not param.is_floating_point():
            raise ValueError(
                f"Parameter '{name}' has dtype {param.dtype}; PatrickStar chunks hold floating-point"
                " parameters only. HINT: register integer tensors as buffers (`register_buffer`)."
            )
        seen[id(param)] = (param, [name])
    return list(seen.values())


def chunk_layout(
    named: Sequence[tuple[nn.Parameter, list[str]]],
    *,
    chunk_elements: int | None,
    device_budget: int | None,
    compute_itemsize: int,
    world_size: int,
    allocator_friendly: bool = False,
) -> Layout:
    """The chunk layout of the parameters :func:`collect_parameters` returned, each under its first name,
    trainable and frozen ones in separate families. ``chunk_elements=None`` ("auto") searches the chunk size
    that suits ``device_budget`` (None: unlimited).

    ``allocator_friendly`` (CUDA, where host buffers are pinned): "auto" takes the power-of-two chunk size next to
    the searched one (below when every parameter still fits whole, or above) that wastes fewer bytes, so every
    chunk kind's bytes are a power of two and torch's host allocator pins no byte more than the chunk
    ([Note: pinned memory] in ``runtime/pinned.py``). An explicit ``chunk_elements`` is kept as given.
    """
    specs = [ParamSpec(name=names[0], numel=p.numel(), trainable=p.requires_grad) for p, names in named]
    if chunk_elements is None and allocator_friendly and world_size > 1:
        # powers of two throughout, within 10 points of the one-rank friendly layout ([Note: utilisation at
        # several ranks] in planning/layout.py)
        one_rank = chunk_layout(
            named,
            chunk_elements=None,
            device_budget=device_budget,
            compute_itemsize=compute_itemsize,
            world_size=1,
            allocator_friendly=True,
        )
        return search_chunk_size(
            specs,
            device_budget_bytes=device_budget,
            compute_itemsize=compute_itemsize,
            world_size=world_size,
            fit=Fit.POWER_OF_TWO,
            reference=one_rank.utilisation,
        )
    if chunk_elements is None:
        layout = search_chunk_size(
            specs, device_budget_bytes=device_budget, compute_itemsize=compute_itemsize, world_size=world_size
        )
        if not allocator_friendly:
            return layout
        sizes = {friendly_chunk_elements(layout.chunk_size, specs), 1 << max(0, layout.chunk_size - 1).bit_length()}
        if device_budget is not None:  # two chunk groups must still fit the budget, as the search required
            fit = {n for n in sizes if 2 * world_size * n * compute_itemsize <= device_budget}
            sizes = fit or {min(sizes)}
        candidates = [plan_layout(specs, size, world_size=world_size) for size in sorted(sizes)]
        return min(candidates, key=lambda c: c.capacity_elements)  # the fewest bytes; the smaller size on a tie
    return plan_layout(specs, chunk_elements, world_size=world_size)


def friendly_chunk_elements(chunk_size: int, specs: Sequence[ParamSpec]) -> int:
    """The power of two nearest ``chunk_size`` from below that still holds the largest parameter whole (so no
    parameter gets a chunk of its own, odd, size), else the one above."""
    up = 1 << max(0, chunk_size - 1).bit_length()
    down = up if up == chunk_size else up // 2
    largest = max((s.numel for s in specs), default=1)
    return down if down >= largest else up


def min_device_bytes(
    module: nn.Module, layout: Layout, param_index: Mapping[int, int], *, itemsize: int, world_size: int = 1
) -> tuple[int, str]:
    """Bytes of param chunks one module's forward needs resident at once, and the module's name.

    A module's own parameters stay in use while its children run, so each module counts the chunks of its
    ancestors' direct parameters too. With several ranks a chunk arrives with its whole communication group,
    so groups are counted. ``param_index`` maps ``id(parameter)`` to its index in the layout (parameters
    outside the chunks are left out).
    """
    group_bytes: dict[int, int] = {}
    for chunk in layout.chunks:
        group = group_of(chunk.chunk_id, world_size)
        group_bytes[group] = group_bytes.get(group, 0) + chunk.capacity * itemsize
    worst, worst_name = 0, ""
    uses = module_parameters(module)

    def visit(mod: nn.Module, name: str, inherited: frozenset[int]) -> None:
        nonlocal worst, worst_name
        own = {
            group_of(layout.param_chunk[param_index[id(p)]], world_size)
            for p in uses.get(mod, [])
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


def host_embedding_bytes(params: Mapping[str, nn.Parameter], *, optimizer: int) -> int:
    """fp32 weight, fp32 gradient and optimizer states of each trainable host-resident embedding (every rank
    keeps a replica); a frozen one is its fp32 weight only."""
    return sum(p.numel() * (4 + 4 + optimizer if p.requires_grad else 4) for p in params.values())
