"""An offloaded optimizer step against its stages: the serial step ("off"), the pipeline ("pipeline"), the pipeline
with its tail in the next forward ("next_forward") and the measured choice among them ("auto").

    python benchmarks/offload.py --json /tmp/offload.json                        # compute-heavy: 32 tokens per step
    python benchmarks/offload.py --n-embd 512 --block 8 --json /tmp/adam.json    # host-Adam-heavy, as on a GPU
    python benchmarks/offload.py --quick                                         # seconds: a check that it runs

The demo GPT (``--n-layer`` x ``--n-embd``, fused AdamW) trains on the simulated device with every optimizer-state
family on the host (``optimizer_placement="host"``, ZeRO-Offload style). The device's compute runs on the calling
thread with ``--threads`` intra-op threads (1 by default: on a 2-core machine the other core is the host's), the
step pipeline's stages on their worker threads. Each run is a fresh ``Trainer.fit`` of ``--steps`` optimizer steps
whose first ``--warmup`` are not measured; ``step_ms`` is the median wall time from one batch's start to the
next's, split in phases (``forward``: batch start to the strategy's ``pre_backward``; ``backward``: to the end of
its ``post_backward``; ``step``: the rest, the optimizer step and the batch end).

Stages measured alone, in this process, on the same model (nothing else running, ``--threads`` threads):

- ``forward`` and ``backward``: the phases of a run whose optimizer steps on the device (no transfer, no host
  work: the device's compute alone);
- ``d2h``, ``adam``, ``h2d``: each trainable family's step stages as the pipeline runs them (the copy of its param
  chunk to a host buffer; the gradient conversion, fused AdamW on the host and the compute-dtype write-back; the
  copy back), on copies of its chunks, one family after the other, summed over families.

"auto" times a few steps of each schedule after the warm-up and keeps the fastest ([Note: choosing the schedule] in
``optim/overlap.py``): ``--warmup`` must cover those trials (the default does) so that its figure is the kept
schedule's; the run's ``schedule`` says which it kept.

Targets (issue 27), checked for "pipeline", "auto" and "next_forward" (whose step's tail runs during the next
forward; one of "auto"'s candidates at one rank): without clipping the step is at most 1.15x its longest stage
(``compute`` = forward + backward, ``adam``, ``transfers`` = d2h + h2d); with clipping by norm at most 1.15x
(backward + the longer of forward and adam), the most an exact schedule can overlap when the norm is known only at
the end of the backward. Where host Adam is longer than the backward, or with clipping, only a step whose tail
overlaps the next forward can reach those bounds. Printed as
a table (with the load average) and written as JSON with ``--json``.

Those bounds assume stages that do not slow each other, as on a GPU (its compute on the device, the copies on DMA
engines, Adam on the host). On a CPU every stage streams through the same memory: ``copy_bandwidth`` measures
what one thread and two threads copying at once move per second, and each target row also gives the serial step
over that ratio (``bandwidth_floor_ms``), the fastest any overlap of memory-bound stages can be here.

``beside`` measures that floor directly: three more runs whose optimizer steps on the device, each with one
optimizer step's host work (every family's stages, on copies) on a thread beside the compute and no dependency
between the two (:class:`SideWork`): placed anywhere in the step (the unclipped bound's assumption), from the
backward's start (where gradients first exist), or as the clipped bound places it. Each target row gives the step
over that measured floor (``beside_ratio``): how far the schedule is from the best overlap this machine allows.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import QUIET_TRAINER, make_repo_importable  # noqa: E402

make_repo_importable()

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_pstar import PatrickStarStrategy  # noqa: E402
from lightning_pstar.demos.module import GPTLightningModule  # noqa: E402
from lightning_pstar.optim import kernels  # noqa: E402
from lightning_pstar.optim.kernels import WholeFamilyPlan  # noqa: E402
from lightning_pstar.runtime.chunk import ChunkKind  # noqa: E402
from lightning_pstar.runtime.manager import ChunkManager  # noqa: E402


class PhaseTimer(L.Callback):
    """Wall time per phase of every training batch (see the module docstring). The backward's start and end are
    read by wrapping the strategy's ``pre_backward`` / ``post_backward`` on the instance: a callback overriding
    ``on_after_backward`` would itself turn off the step inside the backward (it could read gradients)."""

    def __init__(self) -> None:
        self.marks: list[dict[str, float]] = []

    def attach(self, strategy: Any) -> None:
        pre, post = strategy.pre_backward, strategy.post_backward

        def pre_backward(*args: Any) -> Any:
            self.marks[-1]["backward"] = time.perf_counter()
            return pre(*args)

        def post_backward(*args: Any) -> Any:
            out = post(*args)
            self.marks[-1]["after"] = time.perf_counter()
            return out

        strategy.pre_backward, strategy.post_backward = pre_backward, post_backward

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        now = time.perf_counter()
        if self.marks:
            self.marks[-1]["next"] = now
        self.marks.append({"start": now})

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.marks:
            self.marks[-1]["next"] = time.perf_counter()

    def every_step(self, window: int = 1) -> list[float]:
        """Milliseconds of every optimizer step of the run, warm-up and trials included (a window of ``window``
        micro-batches each): where the machine had a slow spell, and whether a schedule's steps changed after
        ``"auto"`` chose it."""
        marks = [m for m in self.marks if "next" in m]
        return [
            1e3 * (marks[i + window - 1]["next"] - marks[i]["start"]) for i in range(0, len(marks) - window + 1, window)
        ]

    def medians(self, skip: int, window: int = 1) -> dict[str, float]:
        """Median milliseconds per optimizer step after the first ``skip`` steps, each step a window of ``window``
        micro-batches (gradient accumulation): its forwards and backwards summed, its step phase the last
        micro-batch's (batch end to the next batch's start; the accumulating ones' are the loop's own)."""
        marks = self.marks[skip * window :]
        keys = {"start", "backward", "after", "next"}
        windows = [marks[i : i + window] for i in range(0, len(marks) - window + 1, window)]
        rows = [w for w in windows if all(keys <= set(m) for m in w)]
        if not rows:
            raise SystemExit("no measured step: raise --steps above --warmup")

        def median_ms(a: str, b: str) -> float:
            return 1e3 * statistics.median(sum(m[b] - m[a] for m in w) for w in rows)

        return {
            "step_ms": 1e3 * statistics.median(w[-1]["next"] - w[0]["start"] for w in rows),
            "forward_ms": median_ms("start", "backward"),
            "backward_ms": median_ms("backward", "after"),
            "step_phase_ms": 1e3 * statistics.median(w[-1]["next"] - w[-1]["after"] for w in rows),
        }


class StageProbe(L.Callback):
    """At the end of training, each trainable family's pipeline stages timed alone (see the module docstring)."""

    def __init__(self, repeats: int, accumulate: int = 1) -> None:
        self.repeats = repeats
        self.accumulate = accumulate
        self.stages: dict[str, float] = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        families = FamilyStages.of(trainer)
        totals = {"d2h_ms": [], "adam_ms": [], "h2d_ms": [], "sums_ms": []}  # type: dict[str, list[float]]
        for _ in range(self.repeats):
            d2h = adam = h2d = sums = 0.0
            for family in families:
                a, b, c, d = (_seconds(stage) for stage in (family.d2h, family.adam, family.h2d, family.sum))
                d2h, adam, h2d, sums = d2h + a, adam + b, h2d + c, sums + d
            totals["d2h_ms"].append(1e3 * d2h)
            totals["adam_ms"].append(1e3 * adam)
            totals["h2d_ms"].append(1e3 * h2d)
            totals["sums_ms"].append(1e3 * sums * (self.accumulate - 1))  # one sum per accumulating micro-batch
        self.stages = {k: statistics.median(v) for k, v in totals.items()}


def _seconds(stage: Any) -> float:
    start = time.perf_counter()
    stage()
    return time.perf_counter() - start


class FamilyStages:
    """The stages of one family's pipelined step, on copies of its chunks (nothing of the run's state changes): the
    same ops on the same sizes as ``optim/host_step.py``'s job (``d2h``: the param chunk's bytes to a host buffer;
    ``adam``: the gradient conversion, fused AdamW on the host and the compute-dtype write-back; ``h2d``: the copy
    back), and one accumulating micro-batch's sum of its gradients into an fp32 buffer on the host
    (``runtime/grads.py``)."""

    def __init__(self, manager: ChunkManager, family: Any, groups: list[dict[str, Any]]) -> None:
        self.mixed, self.groups = manager.mixed, groups
        self.device = family.param_chunk.data.clone()  # the bytes where they are now (after a serial step: the host)
        self.host = torch.empty_like(self.device)
        plan = WholeFamilyPlan.build([(r.slot.offset, r.slot.numel) for r in family.records], [0] * len(family.records))
        assert plan is not None
        self.plan = plan
        master_kind = ChunkKind.MASTER if manager.mixed else ChunkKind.PARAM
        self.master = family.chunks[master_kind].data.float().clone()
        self.states = (family.chunks[ChunkKind.EXP_AVG].data.clone(), family.chunks[ChunkKind.EXP_AVG_SQ].data.clone())
        self.steps = [torch.ones((), dtype=torch.float32) for _ in family.records]
        self.scratch = torch.empty(plan.end - plan.start, dtype=torch.float32)
        self.grads_32 = torch.zeros(plan.end - plan.start, dtype=torch.float32)

    @classmethod
    def of(cls, trainer: L.Trainer) -> list[FamilyStages]:
        """Every trainable family of the run whose optimizer states exist (after its first optimizer step)."""
        manager: ChunkManager = trainer.strategy._manager  # type: ignore[attr-defined]
        groups = trainer.optimizers[0].param_groups
        return [
            cls(manager, family, groups)
            for family in manager.families
            if family.trainable and ChunkKind.EXP_AVG in family.chunks
        ]

    def d2h(self) -> None:
        self.host.copy_(self.device)

    def adam(self) -> None:
        plan = self.plan
        if self.mixed:
            self.scratch.copy_(self.host[plan.start : plan.end])
            grad_range = self.scratch
        else:
            grad_range = self.grads_32
        buffers = (self.master, *self.states)
        masters = kernels.adam_on_plan(plan, self.groups, grad_range, buffers, self.steps, coef=1.0, clip_value=None)
        if self.mixed:
            torch._foreach_copy_(plan.slots(self.host), masters)

    def h2d(self) -> None:
        self.device.copy_(self.host)

    def sum(self) -> None:
        self.grads_32.add_(self.device[self.plan.start : self.plan.end])


class SideWork(L.Callback):
    """The fastest exact overlap this machine allows, measured: in a run whose optimizer steps on the device (the
    compute alone), every optimizer step's host work (every family's d2h, Adam and h2d, and the accumulating
    micro-batches' sums, on copies: :class:`FamilyStages`) runs on a thread of its own beside the compute, with no
    dependency between the two, placed by ``mode``:

    - ``"anywhere"`` (the issue's bound without clipping): all of it from the window's first batch start, waited
      for at the end of its last backward;
    - ``"backward"`` (the same, where a gradient exists only once the backward made it): each accumulating
      micro-batch's sums from its backward's start, the d2h, Adam and h2d from the last backward's start;
    - ``"clip"`` (the norm known only at the end of the backward): the previous step's Adam and h2d from the
      window's start (the tail in the next forward), waited for at the first backward's start (the window's first
      forward reads every family's new weights), then the sums and the d2h as in ``"backward"``.

    ``bound_ms`` is the median time from a window's start to the later of the compute's and the host work's ends:
    what a schedule could reach here if its stages slowed each other only as much as they do when simply run side
    by side (on a CPU they share the memory bandwidth; on a GPU the compute, the copies and the host Adam use
    different hardware)."""

    MODES = ("anywhere", "backward", "clip")

    def __init__(self, mode: str, accumulate: int, start_step: int) -> None:
        assert mode in self.MODES, mode
        self.mode, self.accumulate, self.start_step = mode, accumulate, start_step
        self.families: list[FamilyStages] | None = None
        self.worker: concurrent.futures.ThreadPoolExecutor | None = None
        self.pending: list[concurrent.futures.Future[float]] = []
        self.window: dict[str, float] | None = None
        self.micro = 0
        self.rows: list[dict[str, float]] = []

    def attach(self, strategy: Any) -> None:
        pre, post = strategy.pre_backward, strategy.post_backward

        def pre_backward(*args: Any) -> Any:
            last = self.micro == self.accumulate - 1
            if self.window is not None and self.mode == "clip":
                if self.micro == 0:
                    self._wait()
                self._submit("d2h" if last else "sum")
            elif self.window is not None and self.mode == "backward":
                self._submit(*(("d2h", "adam", "h2d") if last else ("sum",)))
            return pre(*args)

        def post_backward(*args: Any) -> Any:
            out = post(*args)
            if self.window is not None:
                self.micro += 1
                if self.micro == self.accumulate:
                    self.window["compute_end"] = time.perf_counter()
                    self._wait()
                    self.window["end"] = time.perf_counter()
                    self.rows.append(self.window)
                    self.window = None
            return out

        strategy.pre_backward, strategy.post_backward = pre_backward, post_backward

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx % self.accumulate or trainer.global_step < self.start_step:
            return
        if self.families is None:
            self.families = FamilyStages.of(trainer)
            self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="side-work")
        self.window, self.micro = {"start": time.perf_counter(), "host_ms": 0.0}, 0
        sums = self.accumulate - 1
        if self.mode == "clip":
            self._submit("adam", "h2d")
        elif self.mode == "anywhere":
            self._submit(*["sum"] * sums, "d2h", "adam", "h2d")

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        if self.worker is not None:
            self.worker.shutdown()

    def _submit(self, *stages: str) -> None:
        """One pass over every family, each running ``stages`` (:class:`FamilyStages` methods) in turn, queued on
        the side thread."""
        assert self.worker is not None and self.families is not None
        families = self.families

        def run() -> float:
            start = time.perf_counter()
            for family in families:
                for stage in stages:
                    getattr(family, stage)()
            return time.perf_counter() - start

        self.pending.append(self.worker.submit(run))

    def _wait(self) -> None:
        assert self.window is not None
        self.window["host_ms"] += 1e3 * sum(future.result() for future in self.pending)
        self.pending = []

    def medians(self) -> dict[str, float]:
        if not self.rows:
            raise SystemExit("no measured step beside the host work: raise --steps above --warmup")
        return {
            "bound_ms": 1e3 * statistics.median(r["end"] - r["start"] for r in self.rows),
            "compute_ms": 1e3 * statistics.median(r["compute_end"] - r["start"] for r in self.rows),
            "host_ms": statistics.median(r["host_ms"] for r in self.rows),
        }


def _loader(args: argparse.Namespace) -> DataLoader:
    n = (args.steps + 1) * args.batch_size * args.accumulate
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab, (n, args.block), generator=generator)
    return DataLoader(TensorDataset(x, torch.roll(x, -1, dims=1)), batch_size=args.batch_size)


def _fit(
    args: argparse.Namespace,
    *,
    placement: str,
    overlap: str,
    clip: bool,
    probe: bool = False,
    beside: str | None = None,
) -> dict[str, Any]:
    """One run; ``beside`` (a :class:`SideWork` mode): the host work placed by that mode on a thread beside it."""
    torch.manual_seed(0)
    module = GPTLightningModule(
        vocab_size=args.vocab, block_size=args.block, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd
    )
    strategy = PatrickStarStrategy(optimizer_placement=placement, optimizer_overlap=overlap, chunk_size=args.chunk_size)
    timer = PhaseTimer()
    timer.attach(strategy)
    callbacks: list[L.Callback] = [timer]
    stage_probe = StageProbe(args.probe_repeats, args.accumulate) if probe else None
    if stage_probe is not None:
        callbacks.append(stage_probe)
    side = SideWork(beside, args.accumulate, args.warmup) if beside is not None else None
    if side is not None:
        side.attach(strategy)
        callbacks.append(side)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=args.clip if clip else None,
        callbacks=callbacks,
        **QUIET_TRAINER,
    )
    torch.set_num_threads(args.threads)
    trainer.fit(module, train_dataloaders=_loader(args))
    report = strategy.memory_report()
    out: dict[str, Any] = {
        "placement": placement,
        "overlap": overlap,
        "clip": clip,
        **timer.medians(args.warmup, args.accumulate),
        "every_step_ms": timer.every_step(args.accumulate),
        "host_step_jobs": report.host_step_jobs,
        "host_sums_in_backward": report.host_sums_in_backward,
        "host_steps_in_backward": report.host_steps_in_backward,
        "host_copies_back_in_backward": report.host_copies_back_in_backward,
        "schedule": report.optimizer_schedule,
        "trial_ms": report.schedule_trial_ms,
        "optimizer_tier": report.optimizer_tier,
        "num_params": report.num_params,
        "num_chunks": report.num_chunks,
    }
    if stage_probe is not None:
        out["stages_alone"] = stage_probe.stages
    if side is not None:
        out["beside"] = {"mode": beside, **side.medians()}
    return out


def copy_bandwidths(trials: int = 7, *, numel: int = 32 * 2**20) -> dict[str, float]:
    """Bytes per second (read + write, 1e9) that one thread, and two threads at once, move copying their own
    ``numel``-element fp32 tensors: with two against one, how much two memory-bound stages can overlap here.
    Medians of ``trials`` alternate measurements (the machine's bandwidth drifts: one pair can be off by a third)."""
    pairs = [(torch.rand(numel), torch.empty(numel)) for _ in range(2)]
    _copy_rate(pairs)  # the targets' first touch, not timed
    one, two = [], []
    for _ in range(trials):
        one.append(_copy_rate(pairs[:1]))
        two.append(_copy_rate(pairs))
    return {"one_thread_gbps": statistics.median(one), "two_threads_gbps": statistics.median(two)}


def _copy_rate(pairs: list[tuple[torch.Tensor, torch.Tensor]], repeats: int = 4) -> float:
    spent = [0.0] * len(pairs)

    def copy(i: int) -> None:
        source, target = pairs[i]
        start = time.perf_counter()
        for _ in range(repeats):
            target.copy_(source)
        spent[i] = time.perf_counter() - start

    workers = [threading.Thread(target=copy, args=(i,)) for i in range(len(pairs))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return sum(2 * s.numel() * s.element_size() * repeats for s, _ in pairs) / max(spent) / 1e9


def _targets(
    compute: dict[str, Any],
    stages: dict[str, float],
    runs: list[dict[str, Any]],
    headroom: float,
    beside: dict[str, dict[str, Any]],
) -> list[dict[str, Any]]:
    f, b = compute["forward_ms"], compute["backward_ms"]
    # host work: Adam, and the sums of the accumulating micro-batches' gradients (none without accumulation)
    adam, transfers = stages["adam_ms"] + stages.get("sums_ms", 0.0), stages["d2h_ms"] + stages["h2d_ms"]
    serial = {run["clip"]: run["step_ms"] for run in runs if run["overlap"] == "off"}
    rows = []
    for run in runs:
        if run["overlap"] == "off":
            continue
        mine = beside["clip" if run["clip"] else "anywhere"]["bound_ms"]
        if run["clip"]:
            bound, what = b + max(f, adam), "backward + max(forward, host work)"
        else:
            bound, what = max(f + b, adam, transfers), "max(compute, host work, transfers)"
        rows.append(
            {
                "overlap": run["overlap"],
                "clip": run["clip"],
                "bound_ms": bound,
                "bound": what,
                "step_ms": run["step_ms"],
                "ratio": run["step_ms"] / bound,
                "target": 1.15,
                "met": run["step_ms"] <= 1.15 * bound,
                # the contention: how much longer the backward took beside the steps inside it than alone
                "backward_over_alone": run["backward_ms"] / b,
                # the serial step over the machine's overlap headroom: the fastest overlap of stages bound by
                # memory bandwidth (a CPU's simulated device: compute, Adam and the copies all are)
                "bandwidth_floor_ms": serial[run["clip"]] / headroom,
                # the same bound measured with the stages beside each other, no dependency between them (SideWork)
                "beside_bound_ms": mine,
                "beside_ratio": run["step_ms"] / mine,
                "beside_met": run["step_ms"] <= 1.15 * mine,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--block", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument(
        "--accumulate", type=int, default=1, help="micro-batches per optimizer step (accumulate_grad_batches)"
    )
    parser.add_argument("--chunk-size", type=int, default=2**22, help="elements per chunk")
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    parser.add_argument(
        "--steps", type=int, default=60, help="optimizer steps per run (the last --steps minus --warmup are measured)"
    )
    parser.add_argument(
        "--warmup", type=int, default=44, help="steps not measured (the engine's warm-up, then auto's trials)"
    )
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of the device's compute")
    parser.add_argument("--clip", type=float, default=1.0, help="the clipping-by-norm value of the clipped runs")
    parser.add_argument("--probe-repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a tiny model and 4 steps: checks that it runs")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument(
        "--only",
        metavar="OVERLAP[:clip]",
        help="one run alone (e.g. next_forward or auto:clip): its step and phase times (and every step's, "
        "every_step_ms) as JSON, no stages or targets",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.n_layer, args.n_embd, args.steps, args.warmup, args.chunk_size, args.probe_repeats = 2, 64, 45, 43, 8192, 1
    torch.set_num_threads(args.threads)
    if args.only:
        overlap, _, clip = args.only.partition(":")
        run = _fit(args, placement="host", overlap=overlap, clip=clip == "clip")
        one = {k: v for k, v in run.items() if k.endswith("_ms") or k in ("overlap", "clip", "schedule")}
        one["load_average"] = os.getloadavg()
        print(json.dumps(one))
        return one

    compute = _fit(args, placement="device", overlap="off", clip=False)
    runs = [
        _fit(args, placement="host", overlap=overlap, clip=clip, probe=(overlap == "off" and not clip))
        for clip in (False, True)
        for overlap in ("off", "pipeline", "auto", "next_forward")
    ]
    stages = runs[0]["stages_alone"]
    beside: dict[str, dict[str, Any]] = {}
    for mode in SideWork.MODES:
        run = _fit(args, placement="device", overlap="off", clip=False, beside=mode)
        beside[mode] = {**run["beside"], "forward_ms": run["forward_ms"], "backward_ms": run["backward_ms"]}
    bandwidth = copy_bandwidths()
    headroom = bandwidth["two_threads_gbps"] / bandwidth["one_thread_gbps"]
    result = {
        "model": {
            k: getattr(args, k)
            for k in ("n_layer", "n_embd", "block", "batch_size", "accumulate", "precision", "chunk_size")
        },
        "threads": args.threads,
        "load_average": os.getloadavg(),
        "num_params": compute["num_params"],
        "compute": compute,
        "stages_alone": stages,
        "copy_bandwidth": bandwidth,
        "beside": beside,
        "runs": runs,
        "targets": _targets(compute, stages, runs, headroom, beside),
    }
    _print(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return result


def _print(result: dict[str, Any]) -> None:
    compute, stages = result["compute"], result["stages_alone"]
    load = ", ".join(f"{x:.2f}" for x in result["load_average"])
    print(f"\n{result['num_params']:,} parameters, {result['model']}, {result['threads']} thread(s); load {load}")
    print("stages alone (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in {
        "forward": compute["forward_ms"], "backward": compute["backward_ms"],
        "d2h": stages["d2h_ms"], "adam": stages["adam_ms"], "h2d": stages["h2d_ms"], "sums": stages["sums_ms"],
    }.items()))  # fmt: skip
    print(f"optimizer on the device: step {compute['step_ms']:.1f} ms")
    bw = result["copy_bandwidth"]
    print(
        f"copy bandwidth: {bw['one_thread_gbps']:.1f} GB/s on one thread, {bw['two_threads_gbps']:.1f} on two"
        f" ({bw['two_threads_gbps'] / bw['one_thread_gbps']:.2f}x: the most memory-bound stages can overlap here)"
    )

    for mode, b in result["beside"].items():
        print(
            f"the host work beside the compute, no dependency ({mode}): a step {b['bound_ms']:.1f} ms (compute"
            f" {b['compute_ms']:.1f}: forward {b['forward_ms']:.1f}, backward {b['backward_ms']:.1f}; host work"
            f" {b['host_ms']:.1f} ms)"
        )
    print(
        "| clip | overlap | runs | step ms | forward | backward | step phase | in backward (copied back) / jobs"
        " | sums aside |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in result["runs"]:
        jobs = f"{r['host_steps_in_backward']} ({r['host_copies_back_in_backward']}) / {r['host_step_jobs']}"
        jobs += f" | {r['host_sums_in_backward']}"
        trials = ", ".join(f"{k} {v:.1f}" for k, v in r["trial_ms"].items())
        runs = r["schedule"] + (f" (trials: {trials})" if trials else "")
        print(
            f"| {'norm' if r['clip'] else 'no'} | {r['overlap']} | {runs} | {r['step_ms']:.1f} | {r['forward_ms']:.1f}"
            f" | {r['backward_ms']:.1f} | {r['step_phase_ms']:.1f} | {jobs} |"
        )
    for t in result["targets"]:
        verdict = "met" if t["met"] else "NOT met"
        print(
            f"{t['overlap']}, {'clip' if t['clip'] else 'no clip'}: step {t['step_ms']:.1f} ms = {t['ratio']:.2f}x"
            f" {t['bound']} ({t['bound_ms']:.1f} ms); target <= {t['target']}x: {verdict}; backward"
            f" {t['backward_over_alone']:.2f}x its time alone; {t['step_ms'] / t['bandwidth_floor_ms']:.2f}x the"
            f" serial step over the copy bandwidth's headroom ({t['bandwidth_floor_ms']:.1f} ms);"
            f" {t['beside_ratio']:.2f}x the stages beside each other ({t['beside_bound_ms']:.1f} ms):"
            f" {'met' if t['beside_met'] else 'NOT met'} there"
        )


if __name__ == "__main__":
    main()
