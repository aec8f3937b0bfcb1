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
"""

from __future__ import annotations

import argparse
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
        manager: ChunkManager = trainer.strategy._manager  # type: ignore[attr-defined]
        optimizer = trainer.optimizers[0]
        groups = optimizer.param_groups
        totals = {"d2h_ms": [], "adam_ms": [], "h2d_ms": [], "sums_ms": []}  # type: dict[str, list[float]]
        for _ in range(self.repeats):
            d2h = adam = h2d = sums = 0.0
            for family in manager.families:
                if not family.trainable or ChunkKind.EXP_AVG not in family.chunks:
                    continue
                a, b, c, d = _family_stages(manager, family, groups)
                d2h, adam, h2d, sums = d2h + a, adam + b, h2d + c, sums + d
            totals["d2h_ms"].append(1e3 * d2h)
            totals["adam_ms"].append(1e3 * adam)
            totals["h2d_ms"].append(1e3 * h2d)
            totals["sums_ms"].append(1e3 * sums * (self.accumulate - 1))  # one sum per accumulating micro-batch
        self.stages = {k: statistics.median(v) for k, v in totals.items()}


def _family_stages(
    manager: ChunkManager, family: Any, groups: list[dict[str, Any]]
) -> tuple[float, float, float, float]:
    """Seconds of the three stages of one family's pipelined step, on copies of its chunks (nothing of the run's
    state changes): the same ops on the same sizes as ``optim/host_step.py``'s job; and of one accumulating
    micro-batch's sum of its gradients into an fp32 buffer on the host (``runtime/grads.py``)."""
    chunk = family.param_chunk
    device = chunk.data.clone()  # the bytes where they are now (after a serial step: the host)
    host = torch.empty_like(device)
    plan = WholeFamilyPlan.build([(r.slot.offset, r.slot.numel) for r in family.records], [0] * len(family.records))
    assert plan is not None
    master_kind = ChunkKind.MASTER if manager.mixed else ChunkKind.PARAM
    master = family.chunks[master_kind].data.float().clone()
    states = (family.chunks[ChunkKind.EXP_AVG].data.clone(), family.chunks[ChunkKind.EXP_AVG_SQ].data.clone())
    steps = [torch.ones((), dtype=torch.float32) for _ in family.records]
    scratch = torch.empty(plan.end - plan.start, dtype=torch.float32)
    grads_32 = torch.zeros(plan.end - plan.start, dtype=torch.float32)
    start = time.perf_counter()
    host.copy_(device)
    t_d2h = time.perf_counter() - start
    start = time.perf_counter()
    if manager.mixed:
        scratch.copy_(host[plan.start : plan.end])
        grad_range = scratch
    else:
        grad_range = grads_32
    masters = kernels.adam_on_plan(plan, groups, grad_range, (master, *states), steps, coef=1.0, clip_value=None)
    if manager.mixed:
        torch._foreach_copy_(plan.slots(host), masters)
    t_adam = time.perf_counter() - start
    start = time.perf_counter()
    device.copy_(host)
    t_h2d = time.perf_counter() - start
    start = time.perf_counter()
    grads_32.add_(device[plan.start : plan.end])
    t_sum = time.perf_counter() - start
    return t_d2h, t_adam, t_h2d, t_sum


def _loader(args: argparse.Namespace) -> DataLoader:
    n = (args.steps + 1) * args.batch_size * args.accumulate
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab, (n, args.block), generator=generator)
    return DataLoader(TensorDataset(x, torch.roll(x, -1, dims=1)), batch_size=args.batch_size)


def _fit(args: argparse.Namespace, *, placement: str, overlap: str, clip: bool, probe: bool = False) -> dict[str, Any]:
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
    compute: dict[str, Any], stages: dict[str, float], runs: list[dict[str, Any]], headroom: float
) -> list[dict[str, Any]]:
    f, b = compute["forward_ms"], compute["backward_ms"]
    # host work: Adam, and the sums of the accumulating micro-batches' gradients (none without accumulation)
    adam, transfers = stages["adam_ms"] + stages.get("sums_ms", 0.0), stages["d2h_ms"] + stages["h2d_ms"]
    serial = {run["clip"]: run["step_ms"] for run in runs if run["overlap"] == "off"}
    rows = []
    for run in runs:
        if run["overlap"] == "off":
            continue
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
    parser.add_argument("--steps", type=int, default=50)
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
        help="one run alone (e.g. next_forward or auto:clip): its step and phase times as JSON, no stages or targets",
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
        "runs": runs,
        "targets": _targets(compute, stages, runs, headroom),
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
            f" serial step over the copy bandwidth's headroom ({t['bandwidth_floor_ms']:.1f} ms)"
        )


if __name__ == "__main__":
    main()
