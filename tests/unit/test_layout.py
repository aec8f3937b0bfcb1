"""Unit tests of lightning_pstar.planning.layout: packing and the chunk-size search (pure, no memory)."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from lightning_pstar.demos.gpt import GPT, GPTConfig
from lightning_pstar.planning.layout import ALIGN, Fit, Layout, ParamSpec, group_of, plan_layout, search_chunk_size
from lightning_pstar.planning.requirements import chunk_layout, collect_parameters


def _p(name: str, numel: int, trainable: bool = True) -> ParamSpec:
    return ParamSpec(name=name, numel=numel, trainable=trainable)


def _check_invariants(params: list[ParamSpec], layout) -> None:  # type: ignore[no-untyped-def]
    """Every parameter lies whole inside one chunk at an aligned offset; slots never overlap."""
    assert len(layout.param_chunk) == len(layout.param_offset) == len(params)
    for index, spec in enumerate(params):
        plan = layout.chunks[layout.param_chunk[index]]
        offset = layout.param_offset[index]
        assert offset % ALIGN == 0
        assert 0 <= offset and offset + spec.numel <= plan.capacity
        assert index in plan.members
        assert plan.offsets[plan.members.index(index)] == offset
        assert plan.trainable == spec.trainable
    for plan in layout.chunks:
        spans = sorted((o, o + params[m].numel) for m, o in zip(plan.members, plan.offsets, strict=True))
        for (_, e0), (s1, _) in zip(spans, spans[1:], strict=False):
            assert e0 <= s1
        assert plan.members == sorted(plan.members)  # module order within a chunk
    assert [c.chunk_id for c in layout.chunks] == list(range(len(layout.chunks)))
    assert layout.payload_elements == sum(p.numel for p in params)


def test_module_order_packing() -> None:
    params = [_p("a", 10), _p("b", 20), _p("c", 30), _p("d", 5)]
    layout = plan_layout(params, 64)
    _check_invariants(params, layout)
    # a@0, b@16 (aligned), c does not fit after b (36 -> 40+30 > 64) -> chunk 1 @0, d@32
    assert layout.param_chunk == [0, 0, 1, 1]
    assert layout.param_offset == [0, 16, 0, 32]
    assert [c.capacity for c in layout.chunks] == [64, 64]
    assert [c.used for c in layout.chunks] == [36, 37]
    assert layout.chunk_size == 64


def test_exact_fit_fills_chunk() -> None:
    params = [_p("a", 32), _p("b", 32), _p("c", 1)]
    layout = plan_layout(params, 64)
    assert layout.param_chunk == [0, 0, 1]
    assert layout.param_offset == [0, 32, 0]
    assert layout.chunks[0].used == 64


def test_offsets_are_aligned() -> None:
    params = [_p(f"p{i}", n) for i, n in enumerate([1, 3, 7, 9, 15, 17, 2])]
    layout = plan_layout(params, 40)
    _check_invariants(params, layout)
    assert all(o % ALIGN == 0 for o in layout.param_offset)
    assert layout.param_offset[:3] == [0, 8, 16]


def test_oversized_parameter_gets_own_aligned_chunk() -> None:
    params = [_p("small", 10), _p("big", 101), _p("after", 4)]
    layout = plan_layout(params, 64)
    _check_invariants(params, layout)
    big = layout.chunks[layout.param_chunk[1]]
    assert big.members == [1]
    assert big.capacity == 104  # aligned up to a multiple of ALIGN
    assert big.capacity % ALIGN == 0
    assert layout.param_chunk[0] != layout.param_chunk[1] != layout.param_chunk[2]
    # the other chunks keep the requested size
    assert {c.capacity for c in layout.chunks if c is not big} == {64}


def test_trainable_and_frozen_in_separate_chunks() -> None:
    params = [_p("t0", 8), _p("f0", 8, False), _p("t1", 8), _p("f1", 8, False)]
    layout = plan_layout(params, 64)
    _check_invariants(params, layout)
    assert layout.param_chunk[0] == layout.param_chunk[2]
    assert layout.param_chunk[1] == layout.param_chunk[3]
    assert layout.param_chunk[0] != layout.param_chunk[1]
    trainable = layout.chunks[layout.param_chunk[0]]
    frozen = layout.chunks[layout.param_chunk[1]]
    assert trainable.trainable and not frozen.trainable
    assert trainable.members == [0, 2] and frozen.members == [1, 3]
    assert frozen.offsets == [0, 8]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_padding_to_world_size_multiple(world_size: int) -> None:
    params = [_p(f"p{i}", 30) for i in range(5)]  # two per chunk of 64 -> 3 chunks
    layout = plan_layout(params, 64, world_size=world_size)
    _check_invariants(params, layout)
    assert len(layout.chunks) % world_size == 0
    assert len(layout.chunks) == -(-3 // world_size) * world_size
    for pad in layout.chunks[3:]:
        assert pad.members == [] and pad.used == 0 and pad.capacity == 64


def test_utilisation_formula() -> None:
    params = [_p("a", 10), _p("b", 20), _p("c", 30)]
    layout = plan_layout(params, 64)
    assert layout.capacity_elements == sum(c.capacity for c in layout.chunks) == 128
    assert layout.utilisation == pytest.approx(60 / 128)
    padded = plan_layout(params, 64, world_size=4)
    assert padded.utilisation == pytest.approx(60 / 256)


def test_family_bytes() -> None:
    params = [_p("t", 10), _p("f", 10, False)]
    layout = plan_layout(params, 16)
    assert layout.family_bytes(trainable_bytes_per_elem=14, frozen_bytes_per_elem=2) == 16 * 14 + 16 * 2


@pytest.mark.parametrize("size", [0, -8])
def test_plan_rejects_bad_chunk_size(size: int) -> None:
    with pytest.raises(ValueError, match="chunk_size must be a positive number of elements"):
        plan_layout([_p("a", 1)], size)


def test_plan_rejects_bad_world_size() -> None:
    with pytest.raises(ValueError, match="world_size must be positive"):
        plan_layout([_p("a", 1)], 8, world_size=0)


def test_plan_rejects_empty_parameter() -> None:
    with pytest.raises(ValueError, match="parameter 'empty' has no elements"):
        plan_layout([_p("a", 1), _p("empty", 0)], 8)


# ---- search_chunk_size ------------------------------------------------------------------------------------
def _mixed_params() -> list[ParamSpec]:
    rng = random.Random(1)
    return [_p(f"p{i}", rng.randint(1, 300), trainable=i % 7 != 3) for i in range(40)]


def test_search_needs_parameters() -> None:
    with pytest.raises(ValueError, match="no parameters"):
        search_chunk_size([], device_budget_bytes=None, compute_itemsize=2)


def test_search_candidates_at_least_largest_param() -> None:
    params = _mixed_params()
    layout = search_chunk_size(params, device_budget_bytes=None, compute_itemsize=2)
    _check_invariants(params, layout)
    largest = max(p.numel for p in params)
    assert layout.chunk_size >= largest
    # nothing is oversized: every chunk has the chosen size
    assert {c.capacity for c in layout.chunks} == {layout.chunk_size}


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@pytest.mark.parametrize("budget", [None, 3200])
def test_search_picks_minimum_capacity_among_candidates(budget: int | None) -> None:
    params = _mixed_params()
    best = search_chunk_size(params, device_budget_bytes=budget, compute_itemsize=2)
    largest = _aligned(max(p.numel for p in params))
    upper = max(largest, _aligned(-(-sum(_aligned(p.numel) for p in params) // 4)))  # >= 4 chunk groups
    if budget is not None:
        upper = min(upper, budget // (2 * 2) // ALIGN * ALIGN)
    assert upper - largest < 512 * ALIGN  # small problem: the search tries every aligned size
    candidates = range(largest, upper + 1, ALIGN)
    capacities = {size: plan_layout(params, size).capacity_elements for size in candidates}
    minimum = min(capacities.values())
    assert best.capacity_elements == minimum
    # ties go to the larger chunk
    assert best.chunk_size == max(size for size, cap in capacities.items() if cap == minimum)
    assert largest <= best.chunk_size <= upper


def test_search_finds_a_perfect_packing() -> None:
    # eight params of 64 elements: chunk sizes 64, 128 and 256 (upper bound: total/4 = 128) waste nothing;
    # ties go to the larger chunk
    params = [_p(f"p{i}", 64) for i in range(8)]
    layout = search_chunk_size(params, device_budget_bytes=None, compute_itemsize=2)
    assert layout.utilisation == 1.0
    assert layout.chunk_size == 128
    assert len(layout.chunks) == 4


def test_search_is_better_than_naive_sizes() -> None:
    params = [_p("a", 100), _p("b", 60), _p("c", 40), _p("d", 100), _p("e", 60), _p("f", 40)]
    best = search_chunk_size(params, device_budget_bytes=None, compute_itemsize=2)
    for size in (104, 120, 160):
        assert best.capacity_elements <= plan_layout(params, size).capacity_elements


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("world_size", [1, 2])
def test_search_respects_device_budget(itemsize: int, world_size: int) -> None:
    params = [_p(f"p{i}", 50) for i in range(200)]
    budget = 4000 * itemsize
    layout = search_chunk_size(params, device_budget_bytes=budget, compute_itemsize=itemsize, world_size=world_size)
    _check_invariants(params, layout)
    # two chunk groups (2 * world_size chunks) fit the device budget
    assert 2 * world_size * layout.chunk_size * itemsize <= budget
    unconstrained = search_chunk_size(
        params, device_budget_bytes=None, compute_itemsize=itemsize, world_size=world_size
    )
    assert unconstrained.chunk_size > layout.chunk_size
    assert len(layout.chunks) % world_size == 0


def test_search_with_too_small_budget_falls_back_to_largest_param() -> None:
    params = [_p("a", 1000), _p("b", 10)]
    layout = search_chunk_size(params, device_budget_bytes=100, compute_itemsize=2)
    assert layout.chunk_size == 1000


def test_search_is_deterministic() -> None:
    params = _mixed_params()
    a = search_chunk_size(params, device_budget_bytes=50_000, compute_itemsize=2)
    b = search_chunk_size(list(params), device_budget_bytes=50_000, compute_itemsize=2)
    assert a == b
    assert a.chunk_size == b.chunk_size and a.param_chunk == b.param_chunk and a.param_offset == b.param_offset


def _gpt_specs(n_layer: int, n_embd: int, vocab: int = 128, block: int = 64) -> list[ParamSpec]:
    """The demo GPT's unique parameters in module order (tied embedding once), by shape only."""
    specs = [_p("wte", vocab * n_embd), _p("wpe", block * n_embd)]
    for i in range(n_layer):
        for name, numel in (
            ("ln_1.w", n_embd), ("ln_1.b", n_embd), ("attn.w", 3 * n_embd * n_embd), ("attn.b", 3 * n_embd),
            ("attn.proj.w", n_embd * n_embd), ("attn.proj.b", n_embd), ("ln_2.w", n_embd), ("ln_2.b", n_embd),
            ("fc.w", 4 * n_embd * n_embd), ("fc.b", 4 * n_embd), ("proj.w", 4 * n_embd * n_embd), ("proj.b", n_embd),
        ):  # fmt: skip
            specs.append(_p(f"h.{i}.{name}", numel))
    return [*specs, _p("ln_f.w", n_embd), _p("ln_f.b", n_embd)]


@pytest.mark.parametrize(("n_layer", "n_embd", "world_size"), [(8, 64, 2), (32, 64, 2), (4, 192, 2), (12, 128, 2)])
def test_search_at_several_ranks_keeps_utilisation(n_layer: int, n_embd: int, world_size: int) -> None:
    """Padding groups to the world size must not halve utilisation: within 10 points of the one-rank layout."""
    params = _gpt_specs(n_layer, n_embd)
    one = search_chunk_size(params, device_budget_bytes=None, compute_itemsize=2)
    many = search_chunk_size(params, device_budget_bytes=None, compute_itemsize=2, world_size=world_size)
    _check_invariants(params, many)
    assert len(many.chunks) % world_size == 0 and len(many.chunks) >= 2 * world_size
    assert many.utilisation >= one.utilisation - 0.10, (one.utilisation, many.utilisation)


def test_search_at_several_ranks_few_large_parameters() -> None:
    """compare.py --quick's GPT (2 x 64): in module order with chunks of its largest parameter 8 chunks make the
    fewest whole groups; fitting every group's capacity to what it holds takes it past the 4-group layout of
    57 % that the narrow range forced, and past the 84 % of the least wasteful unfitted layout."""
    params = _gpt_specs(2, 64)
    many = search_chunk_size(params, device_budget_bytes=None, compute_itemsize=2, world_size=2)
    _check_invariants(params, many)
    assert many.utilisation > 0.84


# ---- issue 18: utilisation at several ranks ([Note: utilisation at several ranks]) ---------------------------
def _check_groups(params: list[ParamSpec], layout: Layout, world_size: int) -> None:
    """What the engine relies on at several ranks: whole groups of one kind and one aligned capacity, the
    largest parameter whole in a chunk, every parameter placed once."""
    _check_invariants(params, layout)
    assert len(layout.chunks) % world_size == 0
    for start in range(0, len(layout.chunks), world_size):
        group = layout.chunks[start : start + world_size]
        assert len({c.capacity for c in group}) == 1, [c.capacity for c in group]
        assert len({c.trainable for c in group}) == 1
        assert all(group_of(c.chunk_id, world_size) == start // world_size for c in group)
        assert group[0].capacity % ALIGN == 0
        assert all(c.used <= c.capacity for c in group)
    placed = sorted(m for c in layout.chunks for m in c.members)
    assert placed == list(range(len(params)))


def _random_specs(seed: int, count: int, decades: float, frozen_every: int) -> list[ParamSpec]:
    """Parameters of log-uniform sizes (1 to 10**decades elements), named as three per module."""
    rng = random.Random(seed)
    return [
        _p(f"m{i // 3}.p{i}", int(10 ** rng.uniform(0, decades)), trainable=i % frozen_every != 2) for i in range(count)
    ]


_SHAPES = {
    "gpt2x64": lambda: _gpt_specs(2, 64),
    "gpt8x64": lambda: _gpt_specs(8, 64),
    "gpt32x64": lambda: _gpt_specs(32, 64),
    "gpt1x64": lambda: _gpt_specs(1, 64),
    "gpt3x96": lambda: _gpt_specs(3, 96),
    "gpt4x192": lambda: _gpt_specs(4, 192),
    "gpt12x128": lambda: _gpt_specs(12, 128),
    "gpt6x48": lambda: _gpt_specs(6, 48),
    "mixed": _mixed_params,
    "random1": lambda: _random_specs(1, 60, 3.7, 5),
    "random2": lambda: _random_specs(2, 25, 4.0, 100),
    "random3": lambda: _random_specs(3, 120, 3.0, 3),
    "huge_embedding": lambda: _gpt_specs(4, 64, vocab=8192),
}


def _bound(params: list[ParamSpec], world_size: int) -> float:
    """The best utilisation any layout can have: a group that holds the largest parameter has ``world_size``
    chunks of at least its size (a parameter lies whole inside one chunk)."""
    payload = sum(p.numel for p in params)
    return payload / max(sum(_aligned(p.numel) for p in params), world_size * _aligned(max(p.numel for p in params)))


@functools.cache
def _one_rank_search(shape: str) -> Layout:
    """The one-rank layout of a shape, searched once for the world sizes that compare with it (read only)."""
    return search_chunk_size(_SHAPES[shape](), device_budget_bytes=None, compute_itemsize=2)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("shape", list(_SHAPES))
def test_utilisation_at_several_ranks_within_ten_points_of_one_rank(shape: str, world_size: int) -> None:
    """Padding groups to the world size must not halve utilisation: at 2, 3 and 4 ranks the search stays within 10
    points of the one-rank layout (of the best any layout can reach, where one parameter is so large that its
    group alone is most of the model: the huge embedding at 3 and 4 ranks); at two ranks a rank's chunks are at
    most 0.55 of the one-rank chunks plus one group."""
    params = _SHAPES[shape]()
    one = _one_rank_search(shape)
    many = search_chunk_size(params, device_budget_bytes=None, compute_itemsize=2, world_size=world_size)
    _check_groups(params, many, world_size)
    assert many.chunk_size >= max(p.numel for p in params)
    target = min(one.utilisation, _bound(params, world_size)) - 0.10
    assert many.utilisation >= target, (one.utilisation, many.utilisation)
    if world_size == 2:
        group = max(c.capacity for c in many.chunks) * world_size
        assert many.capacity_elements / world_size <= 0.55 * one.capacity_elements + group


def test_the_huge_embedding_bound_is_what_limits_it() -> None:
    """The bound the huge embedding is held to is below 10 points of one rank (so the test above needs it), and
    the layout reaches it: the embedding's group holds the rest of the model in its other chunks."""
    params = _SHAPES["huge_embedding"]()
    one = search_chunk_size(params, device_budget_bytes=None, compute_itemsize=2)
    assert _bound(params, 4) < one.utilisation - 0.10
    many = search_chunk_size(params, device_budget_bytes=None, compute_itemsize=2, world_size=4)
    assert many.utilisation == pytest.approx(_bound(params, 4))
    assert len(many.chunks) == 4  # one group: the rest of the model shares the embedding's


def test_a_large_parameters_group_fills_its_other_chunks() -> None:
    params = [_p("big", 200), _p("a", 30), _p("b", 30), _p("c", 30), _p("d", 30), _p("e", 30)]  # an embedding first
    layout = plan_layout(params, 64, world_size=2)
    _check_groups(params, layout, 2)
    big = layout.chunks[layout.param_chunk[0]]
    assert big.capacity == 200
    mate = layout.chunks[big.chunk_id ^ 1]  # the other chunk of its group
    assert mate.capacity == 200 and len(mate.members) > 2  # more than a chunk of 64 would hold
    assert layout.capacity_elements == 2 * 200  # one group holds everything


def test_fitted_groups_shrink_a_short_last_group() -> None:
    params = [_p(f"p{i}", 30) for i in range(9)]  # two per chunk of 64: four full chunks and one short
    plain = plan_layout(params, 64, world_size=2)
    fitted = plan_layout(params, 64, world_size=2, fit_groups=Fit.ALIGNED)
    _check_groups(params, fitted, 2)
    assert [c.capacity for c in plain.chunks] == [64] * 6
    assert [c.capacity for c in fitted.chunks][-2:] == [32, 32]  # the last one's parameter alone
    assert fitted.capacity_elements < plain.capacity_elements
    two = plan_layout(params, 64, world_size=2, fit_groups=Fit.POWER_OF_TWO)
    assert all(c.capacity & (c.capacity - 1) == 0 for c in two.chunks)


def test_largest_first_packing_where_module_order_wastes_too_much() -> None:
    """compare.py --quick's GPT at 4 ranks: any two groups in module order waste more than 14 points, one group
    in module order more; packed largest first, one group of four chunks holds it with little waste."""
    params = _gpt_specs(2, 64)
    one = search_chunk_size(params, device_budget_bytes=None, compute_itemsize=2)
    many = search_chunk_size(params, device_budget_bytes=None, compute_itemsize=2, world_size=4)
    _check_groups(params, many, 4)
    assert many.utilisation >= one.utilisation - 0.10
    order = [m for c in many.chunks for m in c.members]
    assert order != sorted(order)  # not module order across chunks: largest first


@functools.cache
def _cuda_layout(n_layer: int, world_size: int) -> Layout:
    """The allocator-friendly layout of a meta GPT; cached, so the one-rank layout is built once per depth."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=128, block_size=64, n_layer=n_layer, n_head=2, n_embd=64))
    named = collect_parameters(model, exclude=set())  # as the engine sees it: the tied embedding once
    ws = world_size
    return chunk_layout(
        named, chunk_elements=None, device_budget=None, compute_itemsize=2, world_size=ws, allocator_friendly=True
    )


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("n_layer", [2, 8, 32])
def test_cuda_layouts_at_several_ranks_are_powers_of_two_within_ten_points(n_layer: int, world_size: int) -> None:
    """On CUDA (pinned host buffers) every capacity stays a power of two, within 10 points of one rank's."""
    one, many = _cuda_layout(n_layer, 1), _cuda_layout(n_layer, world_size)
    assert all(c.capacity & (c.capacity - 1) == 0 for c in many.chunks)
    assert len(many.chunks) % world_size == 0
    assert many.utilisation >= one.utilisation - 0.10, (one.utilisation, many.utilisation)
