"""Prefetch by bytes along the warm-up trace: which param chunks to fetch ahead now, and which to evict early for them.

Pure arithmetic over the trace and the residency's current state; nothing here touches a chunk.
:class:`~lightning_pstar.runtime.prefetch.Prefetcher` builds a :class:`LookaheadState`, calls :func:`plan_prefetch`
and performs the moves it returns through the residency.

[Note: fetch and prefetch]
A module needs its param chunks on the device when its moment comes. A chunk still on the host then is a *demand
fetch*: the module waits for the copy (a stall). A *prefetch* starts that copy earlier, while other modules
compute, so that the chunk is on the device (or its copy is in flight) when its moment comes.

1. Every fetch is a copy on the copy stream (CUDA; [Note: streams] in ``chunk.py``) that records an event; the
   compute stream waits on that event where the bytes are first read (``Chunk.wait``, from ``Residency.fetch`` or
   any other reader), and the CPU never synchronises for a fetch. A demand fetch waits at once (its module reads
   next); a prefetch is waited on by the module that needs it. The pinned host source is freed only after the
   compute stream's wait, and the host allocator's event (recorded by the non-blocking copy) keeps the block from
   reuse until the copy is done. On the simulated device every copy is synchronous.
2. Parameters never point into a device buffer whose copy is in flight: a fetched chunk's parameters keep
   pointing at the host bytes (where they were) and are re-pointed at the device buffer by the wait itself
   (``Chunk.on_landed``); every other path that points a parameter at its slot does the same
   (``Residency.point_at_chunk``). A read the engine does not see (a parent module's forward reading a child's
   weight that the module tree does not name) therefore reads the host bytes, as it does for a chunk on the host,
   and never device bytes still being written.
3. A device block freed by an eviction is reusable by the allocator only once its copy to the host ends: until its
   event completes its bytes count against the device budget (:class:`~lightning_pstar.runtime.inflight.
   EvictionsInFlight`). A demand fetch or a tide that needs them waits on the CPU for that event (what the
   allocator itself would wait for; counted as ``eviction_waits``); a prefetch does not wait, it takes the room at
   a later moment once the copy has ended.
4. Which chunks to prefetch (this module): the engine simulates what the coming moments would do without any
   further prefetch, with the same rules as the real run (at each moment the tide evicts down to that moment's
   room ``budget - non_model[t]``, then the moment's chunks are fetched, victims chosen as the placement policy
   does: the plan's drops first, then Belady's farthest next use, clean before dirty). That gives the demand
   fetches to come, in order of next use, and the device bytes held at every moment. A demand fetch of chunk
   ``c`` at moment ``s`` becomes a prefetch now when ``c``'s bytes fit the predicted room at every moment from now
   until ``s``. When they do not, a chunk ``v`` that the simulation evicts later anyway at moment ``e``, unused
   until then, is evicted now instead (Belady: it is not needed before ``c``): the same bytes move, only earlier,
   so an early eviction never costs more than the stall it removes. The first demand fetch that does not fit ends
   the plan (prefetch goes in order of next use), and the simulation with it. It stops at the optimizer step
   (which moves and writes chunks) and after :data:`HORIZON` moments. Only one rank plans this way (several ranks
   gather most chunks, and the sharding prefetches groups: ``runtime/sharding.py``); there the next moment's
   chunks are prefetched into free room as before. The static policy prefetches nothing.
5. A prefetched chunk counts as kept by the plan until its moment: the tide evicts it only when nothing else
   frees enough room. Prefetch never changes the arithmetic (it changes when bytes move, never which bytes a
   module reads) and never exceeds the device budget (every move is checked against the room of the moment it
   happens in, in-flight evictions included).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["HORIZON", "LookaheadState", "PrefetchPlan", "plan_prefetch"]

HORIZON = 64
"""Moments simulated ahead at most: each access plans again from the real state, and the simulation costs about the
resident chunks per simulated moment where the room is short (a few blocks of a transformer are plenty of lead for
the copies to overlap compute)."""


@dataclass(frozen=True, kw_only=True)
class LookaheadState:
    """What the planner reads: the trace ahead of the cursor and where the param chunks are now."""

    cursor: int  # the trace moment the iteration is at now
    families: Sequence[tuple[int, ...]]  # per trace moment, the (owned) families it needs
    rooms: Sequence[int]  # per trace moment, the bytes chunks may take on the device then
    stops: frozenset[int]  # trace moments the simulation does not pass (the optimizer step)
    sizes: Mapping[int, int]  # family -> bytes of its param chunk
    resident: frozenset[int]  # families whose param chunk is on the device now (owned, movable)
    busy: frozenset[int] = frozenset()  # ... of which in use now (a module computes with them): they stay now
    on_host: frozenset[int]  # families whose param chunk is on the host now (a fetch can bring them)
    used: int  # device bytes chunks hold now (param and optimizer chunks, evictions in flight included)
    room_now: int  # bytes chunks may hold now
    keep: Mapping[int, frozenset[int]] = field(default_factory=dict)  # the plan's kept families per moment
    clean: frozenset[int] = frozenset()  # resident families whose eviction would copy nothing
    ahead: Mapping[int, int] = field(default_factory=dict)  # prefetched family -> the moment it is due
    next_use: Callable[[int, int], int] = lambda fid, after: 1 << 30  # moments from ``after`` to its next use


@dataclass(kw_only=True)
class PrefetchPlan:
    """Moves to make now, in order: evictions first (they make the room), then the fetches with their due moment."""

    evict: list[int] = field(default_factory=list)
    fetch: list[tuple[int, int]] = field(default_factory=list)  # (family, moment it is needed at)


def plan_prefetch(state: LookaheadState) -> PrefetchPlan:
    """The prefetches (and early evictions) to start now: see [Note: fetch and prefetch], point 4.

    The simulation and the plan go in lockstep, one moment at a time: a decision about a fetch at moment ``s`` only
    changes the bytes held before ``s`` (from ``s`` on the chunk is there either way), so the plan stops at the
    first fetch that cannot move without simulating further."""
    plan = PrefetchPlan()
    sim = _Simulation(state)
    occupied = [state.used]  # device bytes held at each simulated moment, the plan's moves included
    rooms = [state.room_now]
    evictable: dict[int, int] = {}  # resident now, unused until its simulated eviction at that index
    for index, moment in enumerate(sim.moments(), start=1):
        fetched = sim.step(index, moment)
        for fid in sim.evicted_now:
            if fid in state.resident and fid not in state.busy and state.next_use(fid, state.cursor) > index:
                evictable.setdefault(fid, index)
        occupied.append(sim.used)
        rooms.append(state.rooms[moment])
        for fid in fetched:
            if fid not in state.on_host:
                continue  # resident now, evicted and fetched back later: nothing to bring now
            if not _bring_forward(fid, index, moment, state, occupied, rooms, evictable, plan):
                return plan  # in order of next use: the first that cannot move ends the plan
    return plan


def _bring_forward(
    fid: int,
    at: int,
    moment: int,
    state: LookaheadState,
    occupied: list[int],
    rooms: list[int],
    evictable: dict[int, int],
    plan: PrefetchPlan,
) -> bool:
    """Move the demand fetch of ``fid`` at simulated index ``at`` to now, with early evictions where its bytes do
    not fit some moment before; False when they cannot make it fit."""
    size = state.sizes[fid]
    short = [occupied[u] + size - rooms[u] for u in range(at)]
    if any(d > 0 for d in short):
        victims = _early_evictions(short, evictable, state.sizes)
        if victims is None:
            return False
        for victim in victims:
            until = evictable.pop(victim)
            for u in range(until):
                occupied[u] -= state.sizes[victim]
            plan.evict.append(victim)
    for u in range(at):
        occupied[u] += size
    plan.fetch.append((fid, moment))
    return True


def _early_evictions(short: list[int], evictable: dict[int, int], sizes: Mapping[int, int]) -> list[int] | None:
    """Chunks to evict now (each leaves the device later anyway, at its simulated eviction) so that the deficit
    ``short[u]`` of every moment ``u`` before the fetch is covered; None when they cannot cover it. The chunks that
    leave last free the longest stretch: they are taken first."""
    chosen: list[int] = []
    freed = [0] * len(short)
    for fid in sorted(evictable, key=lambda f: (-evictable[f], f)):
        if all(freed[u] >= d for u, d in enumerate(short)):
            break
        chosen.append(fid)
        for u in range(min(evictable[fid], len(short))):
            freed[u] += sizes[fid]
    if all(freed[u] >= d for u, d in enumerate(short)):
        return chosen
    return None


class _Simulation:
    """The coming moments as the engine would run them without further prefetch: at each, the tide evicts down to
    its room, then its chunks are fetched, victims chosen as the policy does (the plan's drops first, then the
    farthest next use, clean before dirty, then by id). Next uses are kept as absolute simulated indices, updated
    when a chunk is used, so that choosing victims reads no trace."""

    def __init__(self, state: LookaheadState) -> None:
        self.state = state
        self.n = len(state.families)
        self.resident = set(state.resident)
        self.used = state.used
        self.evicted_now: list[int] = []
        cursor, n = state.cursor, self.n
        self.next_at = {fid: state.next_use(fid, cursor) for fid in self.resident}
        # a prefetched chunk counts as kept until its moment (then it is used)
        self.ahead_until = {fid: (due - cursor) % n for fid, due in state.ahead.items()}

    def moments(self) -> Iterator[int]:
        """Trace moments ahead, until the optimizer step or :data:`HORIZON` of them."""
        state = self.state
        for k in range(1, min(HORIZON, self.n) + 1):
            moment = (state.cursor + k) % self.n
            if moment in state.stops:
                return
            yield moment

    def step(self, index: int, moment: int) -> list[int]:
        """Run the moment at simulated ``index``; returns the families it fetched (its evictions: ``evicted_now``)."""
        state = self.state
        need = state.families[moment]
        room = state.rooms[moment]
        self.evicted_now = []
        self._evict_to(room, need, moment, index)  # the tide
        fetched: list[int] = []
        sizes = state.sizes
        for fid in need:
            if fid not in sizes:
                continue
            self.next_at[fid] = index + state.next_use(fid, moment)
            if fid in self.resident:
                continue
            self._evict_to(room - sizes[fid], need, moment, index)
            self.resident.add(fid)
            self.used += sizes[fid]
            fetched.append(fid)
        return fetched

    def _evict_to(self, limit: int, need: tuple[int, ...], moment: int, index: int) -> None:
        if self.used <= limit:
            return
        state = self.state
        keep = state.keep.get(moment, frozenset())
        clean, ahead_until, next_at = state.clean, self.ahead_until, self.next_at

        def order(fid: int) -> tuple[bool, int, bool, int]:
            kept = fid in keep or ahead_until.get(fid, -1) >= index
            return (kept, -next_at[fid], fid not in clean, fid)

        for fid in sorted((f for f in self.resident if f not in need), key=order):
            if self.used <= limit:
                break
            self.resident.discard(fid)
            self.used -= state.sizes[fid]
            self.evicted_now.append(fid)
