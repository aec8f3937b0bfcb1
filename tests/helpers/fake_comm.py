"""A recording fake of :class:`lightning_pstar.runtime.comm.ChunkComm`, for process-free tests of the ZeRO sharding
protocol ([Note: one collective sequence on every rank] in ``lightning_pstar/runtime/sharding.py``).

:class:`RecordingComm` moves no data: every collective returns at once (work handle None), an all-gather
zero-fills what the peers would send, a reduce-scatter hands the owner its own part (as if the peers sent zeros),
and each call is appended to :attr:`RecordingComm.calls` as a :class:`Call` (name, shapes, dtypes, and with
:func:`label_groups` the chunk group). Collectives pair by position, so ranks follow the protocol when their lists
are identical.

Two answers are what a rank acts on: each ``all_reduce(MIN)`` (the plan after the warm-up: whether prefetching
fits everywhere, how many groups stay gathered, each group's due step) and the incomplete-ranks counter that ends
every reduce-scatter's buffers (a SUM over ranks: [Note: the agreement in the reduction's buffer] in
``lightning_pstar/runtime/reduction.py``). A real collective gives every rank the same answer, taken from every
rank's values; simulated ranks run one after the other, so :class:`Agreement` finds those answers as a fixed point
instead: each round runs every rank from scratch with the answers of the previous round and records each rank's own
values. The k-th answer depends only on the answers before it, so after round k the first k answers are the ones
real collectives give, and the rounds stop when nothing changes. (A fake that left each rank its own values would
let a rank act on them alone: a rank that ran an expert would find its group complete and skip the second round its
peer issues -- a difference of the harness, not of the protocol.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_pstar.runtime.sharding import GroupCoordinator

__all__ = ["Agreement", "Call", "RecordingComm", "label_groups"]

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Call:
    """One collective as a rank issued it: what must match, position by position, on every rank."""

    op: str
    shapes: tuple[Shape, ...]
    dtype: str
    group: int | tuple[int, ...] | None = None  # the chunk group(s) a collective is for (shapes alone may agree)

    def __str__(self) -> str:
        where = "" if self.group is None else f"@group{self.group}"
        return f"{self.op}{where}{list(self.shapes)}:{self.dtype}"


class Agreement:
    """The answers of the collectives ranks act on in one simulated run, shared by every rank's fake comm.

    ``answers[k]`` is what every rank's k-th such call returns (``("min", values)`` for an ``all_reduce(MIN)``,
    ``("sum", [counter])`` for a reduce-scatter's counter); a call without an answer yet returns zeros (nothing
    agreed, nobody incomplete). :meth:`next_round` reduces the values the ranks passed.
    """

    def __init__(self, world_size: int = 2) -> None:
        self.world_size = world_size
        self.answers: list[tuple[str, list[int]]] = []
        self.flags: dict[int, list[tuple[str, list[int]]]] = {}  # rank -> what it passed to each call, in order

    def start(self) -> None:
        """A round begins: forget the values of the last one."""
        self.flags = {}

    def answer(self, rank: int, op: str, values: list[int]) -> list[int]:
        passed = self.flags.setdefault(rank, [])
        k = len(passed)
        passed.append((op, values))
        if k < len(self.answers) and self.answers[k][0] == op and len(self.answers[k][1]) == len(values):
            return list(self.answers[k][1])
        return [0] * len(values)

    def next_round(self) -> bool:
        """Compute the answers from the values just passed; whether they changed (another round is needed)."""
        per_rank = [self.flags.get(rank, []) for rank in range(self.world_size)]
        answers: list[tuple[str, list[int]]] = []
        for calls in zip(*per_rank, strict=False):
            if len({(op, len(v)) for op, v in calls}) != 1:
                break  # the ranks disagree on the call already: the sequences differ, the test says where
            op = calls[0][0]
            reduce = min if op == "min" else sum
            answers.append((op, [reduce(values) for values in zip(*(v for _, v in calls), strict=True)]))
        changed = answers != self.answers
        self.answers = answers
        return changed


def _shapes(tensors: Sequence[torch.Tensor]) -> tuple[Shape, ...]:
    return tuple(tuple(t.shape) for t in tensors)


class RecordingComm:
    """Duck-types :class:`lightning_pstar.runtime.comm.ChunkComm` for one rank of a simulated run: no data moves,
    every call returns at once (work handle None) and is appended to :attr:`calls`."""

    def __init__(self, *, rank: int, world_size: int, agreement: Agreement | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = None
        self.agreement = agreement if agreement is not None else Agreement(world_size)
        self.calls: list[Call] = []
        self.label: int | tuple[int, ...] | None = None  # the group(s) of the collective about to start (label_groups)
        self.counters: list[int] = [-1]  # where the reduce-scatter about to start keeps its counters (label_groups)
        self.gathered_bytes = 0
        self.reduced_bytes = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def _record(self, op: str, tensors: Sequence[torch.Tensor]) -> None:
        dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors}
        self.calls.append(Call(op, _shapes(tensors), "/".join(sorted(dtypes)), self.label))
        self.label = None

    def all_gather_chunks(self, buffers: Sequence[torch.Tensor], rank_in_group: int) -> Any:
        assert len(buffers) == self.world_size and rank_in_group == self.rank
        assert len({(b.numel(), b.dtype) for b in buffers}) == 1, "all-gather buffers differ in size"
        self._record("all_gather", buffers)
        for i, buf in enumerate(buffers):
            if i != rank_in_group:
                buf.zero_()  # what a peer would send: the numbers are not what is tested
                self.gathered_bytes += buf.numel() * buf.element_size()
        return None

    def start_reduce_scatter(self, flat: torch.Tensor) -> tuple[Any, torch.Tensor]:
        parts = flat.view(self.world_size, -1)  # raises unless the parts have one size
        self._record("reduce_scatter", list(parts))
        self.reduced_bytes += flat.numel() * flat.element_size()
        output = parts[self.rank].clone()  # as if the peers sent zeros (the presence flags stay this rank's) ...
        counters = self.agreement.answer(self.rank, "sum", [int(output[i].item()) for i in self.counters])
        for i, counter in zip(self.counters, counters, strict=True):
            output[i] = counter  # ... but each group's incomplete-ranks counter is every rank's sum
        self.counters = [-1]
        return None, output

    def start_all_reduce_min(self, tensor: torch.Tensor) -> Any:
        self._record("all_reduce_min", [tensor])
        answer = self.agreement.answer(self.rank, "min", [int(v) for v in tensor.tolist()])
        tensor.copy_(torch.tensor(answer, dtype=tensor.dtype))
        return None

    def all_reduce_max_(self, tensor: torch.Tensor) -> torch.Tensor:
        self._record("all_reduce_max", [tensor])
        return tensor

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        self._record("all_reduce_sum", [tensor])
        return tensor

    def broadcast_(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        self._record(f"broadcast<{src}", [tensor])
        return tensor

    def to_rank0_(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        if src != 0:
            self._record(f"to_rank0<{src}", [tensor])
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        self.calls.append(Call("all_gather_object", (), type(obj).__name__))
        return [obj] * self.world_size


def label_groups(sharding: GroupCoordinator, comm: RecordingComm) -> None:
    """Tell ``comm`` which chunk group(s) each all-gather and reduce-scatter is for (two groups of the same capacity
    give collectives of the same shapes, and pairing those of different groups would exchange the wrong chunks),
    and where a reduce-scatter keeps each group's incomplete-ranks counter (a bucket has one per group)."""
    start_gather, reduce_group = sharding._start_gather, sharding.reducer.reduce
    reducer = sharding.reducer

    def label(groups: Sequence[int]) -> int | tuple[int, ...]:
        return groups[0] if len(groups) == 1 else tuple(groups)

    def labelled_gather(group: int, protect: set[int]) -> Any:
        comm.label = label(sharding._bucket(group))
        return start_gather(group, protect)

    def labelled_reduce(groups: tuple[int, ...], *, final: bool) -> None:
        comm.label = label(groups)
        ends, end = [], 0
        for group in groups:
            end += sharding.members(group)[comm.rank].capacity + reducer._tail(group)
            ends.append(end - 1)
        comm.counters = ends
        reduce_group(groups, final=final)

    sharding._start_gather = labelled_gather  # type: ignore[method-assign]
    sharding.reducer.reduce = labelled_reduce  # type: ignore[method-assign]
