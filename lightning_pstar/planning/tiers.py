"""What a run needs on each tier: the one function the setup check, the capacity planner and the runtime's host
account take their figures from (:func:`tier_need`), and the check that refuses a budget below them.

[Note: the host need]
The host budget must hold, at the run's fullest moment (the end of an optimizer step that runs on the host):

- the optimizer side of every trainable family this rank owns (fp32 master, fp32 grad, optimizer states), when
  it starts on the host (``optimizer_on_host``: ``auto`` with a device budget, ``static`` when the model data
  does not fit the chunks' share);
- the param chunks of those families: a host step moves a family's param chunk to the host, where it waits for
  the next forward, so after the step every one of them is there at once;
- the other param chunks the device cannot keep: the device guarantees chunks only the least room the placement
  gives them before the warm-up has measured anything (``static_chunk_fraction`` of the budget; under ``auto``
  ``warmup_chunk_fraction`` of it, but at least one module's chunks). An eviction frees whole chunks, so past it
  the chunks on the device fill that room to within two chunks (the one being fetched, still on the host while
  the eviction runs, and the last victim's overshoot), remote chunks gathered from other ranks included;
- fp32 copies of frozen weights (mixed precision, ``frozen_master``) and host-resident embeddings
  (``cpu_embedding``);
- the step's temporaries on the host: the fp32 copy of one family's gradients in mixed precision
  (:func:`step_temporary_bytes`; families step one at a time). The runtime holds this back from the host budget
  (``Residency.host_scratch_bytes``), so its account and this figure are the same sum;
- on CUDA, the rounding of each host buffer to the pinned allocator's power-of-two block ([Note: pinned memory]
  in ``runtime/pinned.py``).

Host copies kept for clean evictions are not part of it: they are dropped whenever the budget needs the room.
A device budget that holds the chunks but not the activations is refused at the end of the warm-up's forward
and backward, before its optimizer step runs (``runtime/warmup.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from lightning_pstar.planning.layout import Layout, owner_of
from lightning_pstar.report import format_bytes

__all__ = [
    "BytesPerElement",
    "MemoryBudgetError",
    "TierNeed",
    "block_bytes",
    "check_budgets",
    "optimizer_starts_on_host",
    "setup_chunk_room",
    "step_temporary_bytes",
    "tier_need",
]


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

    @classmethod
    def of_run(
        cls, *, compute_itemsize: int, optimizer: int, accumulates: bool = False, frozen_master: bool = True
    ) -> BytesPerElement:
        """What ``ChunkManager.materialise`` plus ``add_optimizer_chunks`` allocate per element: mixed
        precision (a compute itemsize below 4) adds an fp32 master; 32-true always has an fp32 grad chunk,
        mixed precision only when it sums micro-batch gradients (``accumulates``)."""
        mixed = compute_itemsize < 4
        return cls(
            param=compute_itemsize,
            master=4 if mixed else 0,
            grad=4 if (not mixed or accumulates) else 0,
            optimizer=optimizer,
            frozen_master=4 if mixed and frozen_master else 0,
        )


class MemoryBudgetError(ValueError):
    """The chunks needed at one moment do not fit the tier budgets (a budget option is too small)."""


def block_bytes(nbytes: int) -> int:
    """The block torch's caching host allocator hands out for a request of ``nbytes``: the next power of two."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def step_temporary_bytes(capacity: int, *, mixed: bool) -> int:
    """Bytes the optimizer step of one family allocates beside its chunks, on the tier where it runs: in mixed
    precision the fp32 copy of the family's compute-dtype gradients (``optim/grads.py``), live until the
    family's update is done (families step one at a time); 32-true steps on views of its fp32 grad chunk."""
    return 4 * capacity if mixed else 0


def optimizer_starts_on_host(
    placement: str,
    *,
    model_data_bytes: int,
    device_budget: int | None,
    static_fraction: float,
    warmup_fraction: float = 1.0,
) -> bool:
    """Whether the fp32 masters, grads and optimizer states start on the host (the placement policies' choice):
    ``auto`` when the model data exceeds the warm-up's share of the budget (a model within it starts and steps on
    the device, so nothing is pinned for optimizer states; the hybrid plan after the warm-up moves what fits the
    margin at the step onto the device, the rest to the host), ``static`` when it exceeds the chunks' share."""
    if device_budget is None:
        return False
    if placement == "static":
        return model_data_bytes > device_budget * static_fraction
    return model_data_bytes > int(device_budget * warmup_fraction)


def setup_chunk_room(
    placement: str, *, device_budget: int | None, min_bytes: int, static_fraction: float, warmup_fraction: float
) -> int | None:
    """The device bytes chunks may use before the warm-up has measured anything (None: unlimited): the
    policies' ``chunk_room`` at setup and during the warm-up."""
    if device_budget is None:
        return None
    if placement == "static":
        return int(device_budget * static_fraction)
    return max(min_bytes, int(device_budget * warmup_fraction))


@dataclass(frozen=True, kw_only=True)
class TierNeed:
    """Model data of the rank whose host need is largest, and how it splits between the tiers
    ([Note: the host need])."""

    per_rank: int
    """Chunk bytes of every family the rank owns (chunk ``i`` is owned by rank ``i % world_size``)."""
    frozen_master: int
    """Of which fp32 copies of frozen weights, which never go to the device."""
    device: int
    """Of ``per_rank``: what the device is guaranteed to keep at the host's fullest moment."""
    host: int
    """Everything the host budget must hold: ``per_rank - device``, host-resident embeddings, the step's
    temporaries on the host and the pinned allocator's rounding."""
    optimizer_side: int = 0
    """Of ``per_rank``: fp32 masters, fp32 grads and optimizer states of trainable families."""
    optimizer_on_host: bool = False
    """The optimizer side starts on the host (counted in ``host`` whatever the device budget)."""
    param_on_host: int = 0
    """Param chunk bytes on the host at its fullest moment (stepped on the host, or evicted)."""
    scratch: int = 0
    """The optimizer step's temporaries on the host (one family's at a time)."""
    rounding: int = 0
    """Bytes the pinned allocator adds to the host chunks (CUDA only)."""
    embeddings: int = 0
    """Host-resident embeddings (``cpu_embedding``): fp32 weight, grad and optimizer states."""
    disk: int = 0
    """Of ``optimizer_side``: fp32 masters and optimizer states of the families on the disk tier (not on the host)."""
    disk_buffers: int = 0
    """Host buffers of the disk tier (its loaded families and its I/O staging), counted in ``host``."""

    def with_disk(self, on_disk: int, buffers: int) -> TierNeed:
        """This need with ``on_disk`` bytes of the optimizer side moved to the disk tier, whose host buffers take
        ``buffers`` bytes ([Note: disk families] in ``runtime/disk_tier.py``)."""
        return replace(self, host=self.host - on_disk + buffers, disk=on_disk, disk_buffers=buffers)


@dataclass
class _Rank:
    """One rank's chunk bytes by kind (summed over the families it owns)."""

    trainable_param: int = 0
    frozen_param: int = 0
    side: int = 0
    frozen_master: int = 0
    largest_trainable: int = 0  # elements of its largest trainable family (the step's temporary)
    # pinned rounding of its trainable param chunks, optimizer side, frozen param chunks and frozen fp32 copies
    waste: dict[str, int] = field(default_factory=lambda: {"tp": 0, "side": 0, "fp": 0, "fm": 0})


def tier_need(
    layout: Layout,
    bpe: BytesPerElement,
    *,
    world_size: int,
    host_embedding_bytes: int = 0,
    optimizer_on_host: bool = False,
    chunk_room: int | None = None,
    pinned: bool = False,
) -> TierNeed:
    """Where the model data of the fullest rank is at the host's fullest moment ([Note: the host need]).

    ``chunk_room``: the least device room the placement gives chunks (:func:`setup_chunk_room`; None: nothing
    is ever evicted). ``pinned``: host chunks are pinned (CUDA), each rounded to its allocator block.
    """
    room = chunk_room
    ranks = [_Rank() for _ in range(world_size)]
    all_params = largest = 0
    side_bpe = bpe.master + bpe.grad + bpe.optimizer
    for chunk in layout.chunks:
        r = ranks[owner_of(chunk.chunk_id, world_size)]
        param = chunk.capacity * bpe.param
        all_params += param
        largest = max(largest, param)
        if chunk.trainable:
            r.trainable_param += param
            r.side += chunk.capacity * side_bpe
            r.largest_trainable = max(r.largest_trainable, chunk.capacity)
            r.waste["tp"] += block_bytes(param) - param
            for kind_bpe in (bpe.master, bpe.grad, *([4] * (bpe.optimizer // 4))):
                r.waste["side"] += block_bytes(chunk.capacity * kind_bpe) - chunk.capacity * kind_bpe
        else:
            r.frozen_param += param
            r.frozen_master += chunk.capacity * bpe.frozen_master
            r.waste["fp"] += block_bytes(param) - param
            fm = chunk.capacity * bpe.frozen_master
            r.waste["fm"] += block_bytes(fm) - fm
    needs = [
        _rank_need(r, bpe, room=room, all_params=all_params, largest=largest, on_host=optimizer_on_host, pinned=pinned)
        for r in ranks
    ]
    need = max(needs, key=lambda n: (n.host, n.per_rank))
    return TierNeed(
        per_rank=max(n.per_rank for n in needs),
        frozen_master=need.frozen_master,
        device=need.device,
        host=host_embedding_bytes + need.host,
        optimizer_side=need.optimizer_side,
        optimizer_on_host=optimizer_on_host,
        param_on_host=need.param_on_host,
        scratch=need.scratch,
        rounding=need.rounding,
        embeddings=host_embedding_bytes,
    )


def _rank_need(
    r: _Rank, bpe: BytesPerElement, *, room: int | None, all_params: int, largest: int, on_host: bool, pinned: bool
) -> TierNeed:
    """One rank's :class:`TierNeed` (without host embeddings)."""
    owned = r.trainable_param + r.frozen_param + r.side + r.frozen_master
    stepped = r.trainable_param if on_host else 0  # a host step leaves every trainable param chunk on the host
    evictable = r.frozen_param + (0 if on_host else r.trainable_param)
    side_on_device = 0 if on_host else r.side
    evicted = 0
    if room is not None and all_params + side_on_device > room:
        # an eviction makes room for the chunk being fetched, which is still on the host meanwhile: the device then
        # holds at least the room less that chunk and the last victim's overshoot; the rest of it may be others'
        kept = room - 2 * largest - side_on_device - (all_params - evictable)
        evicted = evictable - min(max(kept, 0), evictable)
    fixed = r.frozen_master + (r.side if on_host else 0)
    rounding = 0
    if pinned:
        rounding = r.waste["fm"] + (r.waste["side"] + r.waste["tp"] if on_host else 0)
        if evicted:
            rounding += r.waste["fp"] + (0 if on_host else r.waste["tp"])
    scratch = step_temporary_bytes(r.largest_trainable, mixed=bpe.master > 0) if on_host else 0
    host = fixed + stepped + evicted
    return TierNeed(
        per_rank=owned,
        frozen_master=r.frozen_master,
        device=owned - host,
        host=host + scratch + rounding,
        optimizer_side=r.side,
        optimizer_on_host=on_host,
        param_on_host=stepped + evicted,
        scratch=scratch,
        rounding=rounding,
    )


def check_budgets(
    *,
    need: int,
    where: str,
    tiers: TierNeed,
    device_budget: int | None,
    host_budget: int,
    static_fraction: float | None,
) -> None:
    """Refuse at setup, with the numbers per tier, a model whose chunks cannot fit: one module's chunks
    (``need`` bytes, module ``where``) above the device budget (or above the static share of it:
    ``static_fraction`` is given only under ``placement='static'``), or model data above the two tiers."""
    if device_budget is not None and need > device_budget:
        raise MemoryBudgetError(
            f"device_memory_limit is too small: module '{where}' needs parameter chunks of"
            f" {format_bytes(need, exact=True)} resident at once for its forward, but the device budget is"
            f" {format_bytes(device_budget, exact=True)}. The budget covers chunks and, under placement='auto', the"
            " non-model memory (activations) the warm-up measures as well; under 'static', chunks get"
            f" static_chunk_fraction of it. HINT: raise device_memory_limit to at least {need} bytes plus the"
            " activations' peak, or use a smaller chunk_size."
        )
    if static_fraction is not None and device_budget is not None and need > device_budget * static_fraction:
        share = format_bytes(int(device_budget * static_fraction), exact=True)
        raise MemoryBudgetError(
            f"placement='static' gives chunks {share} (static_chunk_fraction={static_fraction} of the"
            f" {format_bytes(device_budget, exact=True)} device budget), but module '{where}' needs"
            f" {format_bytes(need, exact=True)} of chunks resident at once. HINT: raise device_memory_limit or"
            " static_chunk_fraction, use a smaller chunk_size, or use placement='auto', which gives chunks the"
            " room activations leave at each moment."
        )
    if tiers.host > host_budget:
        raise MemoryBudgetError(
            f"model data does not fit: this rank needs {format_bytes(tiers.per_rank, exact=True)} of chunks"
            " (params, fp32 masters/grads and optimizer states); the device can keep"
            f" {format_bytes(tiers.device, exact=True)} of them (device budget"
            f" {format_bytes(device_budget, exact=True)}), which leaves {format_bytes(tiers.host, exact=True)} for"
            f" the host ({host_breakdown(tiers)}), but host_memory_limit is"
            f" {format_bytes(host_budget, exact=True)}.{_optimizer_note(tiers)} HINT: raise host_memory_limit,"
            f" {_device_hint(tiers)}, or train on more ranks."
        )


def host_breakdown(tiers: TierNeed) -> str:
    """The parts of the host need, for messages: "params 1 KiB, optimizer side 3 KiB, ..."."""
    side = tiers.optimizer_side - tiers.disk if tiers.optimizer_on_host else 0
    parts = [
        ("param chunks", tiers.param_on_host),
        ("fp32 masters/grads and optimizer states", side),
        ("disk-tier buffers", tiers.disk_buffers),
        ("fp32 frozen weights", tiers.frozen_master),
        ("host embeddings", tiers.embeddings),
        ("the step's temporaries", tiers.scratch),
        ("pinned-block rounding", tiers.rounding),
    ]
    return ", ".join(f"{name} {format_bytes(n, exact=True)}" for name, n in parts if n)


def _device_hint(tiers: TierNeed) -> str:
    if tiers.optimizer_on_host:
        return (
            "use placement='static' with a device_memory_limit that holds all model data (the optimizer side then"
            " stays on the device)"
        )
    return "raise device_memory_limit"


def _optimizer_note(tiers: TierNeed) -> str:
    if not tiers.optimizer_on_host:
        return ""
    return (
        " The optimizer side starts on the host whatever the device budget, and a step on the host leaves the"
        " param chunks it updated there until the next forward (placement 'auto' with a device budget moves the"
        " families that fit onto the device only after the warm-up)."
    )
