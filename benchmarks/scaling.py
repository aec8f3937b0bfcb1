"""The engine's fixed cost per module and per collective, as a narrow GPT gets deeper (issue 18).

    python benchmarks/scaling.py --repeats 3 --threads 1 --json /tmp/scaling.json   # 2, 8, 32 layers
    python benchmarks/scaling.py --quick                                            # seconds: 2 layers, 2 steps

For every depth in ``--layers`` a narrow demo GPT (``--n-embd`` 64, 2 heads, ``--precision`` bf16-mixed, fused
AdamW) is trained on 1 rank (``patrickstar`` against ``auto``) and on 2 CPU ranks (``patrickstar`` against ``ddp``
and FSDP2, launched as ``benchmarks/distributed.py`` launches them: fresh ``spawn`` processes, a process group of
their own). Reported per run, over the measured steps (the first ``--warmup`` steps dropped):

- ``step_ms``: median training step, the slower rank counting;
- ``engine_us_per_module``: PatrickStar's CPU time (``time.thread_time``, so waiting on a peer does not count)
  inside the manager's per-module and per-parameter verbs (pre/post forward, pre/post backward, gradient
  ready, backward start and end), per step and per module that has chunk parameters;
- ``engine_us_per_call`` / ``engine_calls_per_step``: the same CPU time verb by verb (rank 0), printed under the
  table (the meter's own two ``thread_time`` calls per verb are inside these figures);
- ``collectives_per_step``: collectives PatrickStar's :class:`ChunkComm` starts per step (all-gathers,
  reduce-scatters, all-reduces, broadcasts), next to ``groups`` (chunk groups of the layout);
- ``bytes_per_param``: model data held per rank (PatrickStar: every chunk of its memory report; auto/ddp:
  16 bytes per parameter; FSDP2: 16 bytes per element of the rank's shards);
- ``phase_ms``: where the step's wall time goes (medians, the slower rank's), between Lightning's hooks:
  ``forward`` (batch start to ``on_before_backward``: the training step, and a strategy's work before the
  backward), ``backward`` (the autograd backward, with what runs inside it: DDP's all-reduce, PatrickStar's
  per-module verbs), ``after_backward`` (``on_after_backward`` to ``on_before_optimizer_step``: the strategy's
  ``post_backward``, where PatrickStar waits for its last reduction) and ``optimizer`` (the step, to batch end).
- ``page_faults_per_step``: the process's minor page faults from batch start to batch end (median, the busiest
  rank): pages the C library handed back to the kernel and faulted in again ([Note: --host-malloc cached] in
  ``benchmarks/_launch.py``; ``--host-malloc system`` shows PatrickStar without its cached host memory).

``--precision 32-true`` trains every run in fp32: on a CPU without bf16 units (no AVX512-BF16 or AMX) torch
emulates bf16 matmuls, whose time then dwarfs the fixed costs this script is about.

Measuring wraps the manager's and the communicator's methods on their instances, in the benchmark only.
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import (  # noqa: E402
    QUIET_TRAINER,
    add_host_malloc_option,
    apply_host_malloc,
    make_repo_importable,
    pstar_host_malloc,
    run_ranks,
)
from distributed import _fsdp_module_class  # noqa: E402

ONE_RANK = ("auto", "patrickstar")
TWO_RANKS = ("ddp", "patrickstar", "fsdp")
ENGINE_VERBS = (
    "pre_forward",
    "post_forward",
    "pre_backward",
    "post_backward",
    "grad_ready",
    "begin_backward",
    "finish_backward",
    "begin_training_batch",
)
COMM_VERBS = (
    "all_gather_chunks",
    "start_reduce_scatter",
    "start_all_reduce_min",
    "all_reduce_max_",
    "all_reduce_sum_",
    "broadcast_",
)
RUN_TIMEOUT_S = 900.0
FP32_ADAM_BYTES_PER_PARAM = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="2,8,32", help="comma-separated depths (default: 2,8,32)")
    parser.add_argument("--ranks", default="1,2", help="comma-separated world sizes, 1 and/or 2 (default: 1,2)")
    parser.add_argument("--strategies", default="all", help="comma-separated subset of auto,ddp,patrickstar,fsdp")
    parser.add_argument("--steps", type=int, default=8, help="measured steps per run (default: 8)")
    parser.add_argument("--warmup", type=int, default=3, help="steps run first and not measured (default: 3)")
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--n-head", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=128)
    parser.add_argument(
        "--precision",
        choices=("bf16-mixed", "32-true"),
        default="bf16-mixed",
        help="every run's precision (default: bf16-mixed; 32-true on a CPU without bf16 units, where emulated bf16"
        " matmuls dwarf the engine's fixed costs)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="interleaved runs; the fastest counts (default: 1)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (default: 1)")
    add_host_malloc_option(parser)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--quick", action="store_true", help="2 layers, 2 + 1 steps, no FSDP2: a smoke run")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.steps, args.warmup = "2", 2, 1
        if args.strategies == "all":
            args.strategies = "auto,ddp,patrickstar"
    if args.steps < 1 or args.warmup < 1 or args.repeats < 1 or args.threads < 1:
        parser.error("--steps, --warmup, --repeats and --threads must be >= 1")
    args.layer_list = [int(x) for x in args.layers.split(",")]
    args.rank_list = [int(x) for x in args.ranks.split(",")]
    if set(args.rank_list) - {1, 2}:
        parser.error("--ranks accepts 1 and 2")
    wanted = set(ONE_RANK + TWO_RANKS) if args.strategies == "all" else set(args.strategies.split(","))
    unknown = wanted - set(ONE_RANK + TWO_RANKS)
    if unknown:
        parser.error(f"unknown strategies {sorted(unknown)}")
    args.runs = [(w, s) for w in args.rank_list for s in (ONE_RANK if w == 1 else TWO_RANKS) if s in wanted]
    return args


# ---- instruments (installed on the manager's and the communicator's instances) ------------------------------


class EngineMeter:
    """CPU time inside the manager's verbs and collectives started, while ``active``."""

    def __init__(self) -> None:
        self.active = False
        self.cpu_s = 0.0
        self.by_verb: dict[str, float] = dict.fromkeys(ENGINE_VERBS, 0.0)  # CPU seconds per verb
        self.calls: dict[str, int] = dict.fromkeys(ENGINE_VERBS, 0)
        self.collectives: dict[str, int] = dict.fromkeys(COMM_VERBS, 0)
        self._depth = 0
        self.modules = 0  # modules with chunk parameters

    def install(self, manager: Any) -> None:
        self.modules = len(manager.table.module_records)
        for name in ENGINE_VERBS:
            setattr(manager, name, self._timed(name, getattr(manager, name)))
        for name in COMM_VERBS:
            setattr(manager.comm, name, self._counted(name, getattr(manager.comm, name)))

    def _timed(self, name: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth or not self.active:
                return fn(*args, **kwargs)
            self._depth += 1
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.thread_time() - start
                self.cpu_s += spent
                self.by_verb[name] += spent
                self.calls[name] += 1
                self._depth -= 1

        return timed

    def _counted(self, name: str, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.active and fn.__self__.distributed:  # one rank: every call is the identity
                self.collectives[name] += 1
            return fn(*args, **kwargs)

        return counted


def _meter_callback(meter: EngineMeter, warmup: int) -> Any:
    import lightning as L

    class Meter(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            manager = getattr(trainer.strategy, "_manager", None)
            if manager is not None:
                meter.install(manager)

        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
            meter.active = i >= warmup

        def on_train_batch_end(
            self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, i: int
        ) -> None:
            meter.active = False  # what runs after the last step (the end of fit's state dict) is not a step's

    return Meter()


PHASES = ("forward", "backward", "after_backward", "optimizer")


def _phase_callback(marks: list[list[float]], faults: list[int]) -> Any:
    """Wall-clock marks at the hooks between a training batch's phases (``PHASES``), one list per batch, and the
    process's minor page faults from batch start to batch end, one count per batch."""
    import lightning as L

    class Phases(L.Callback):
        def __init__(self) -> None:
            self.current: list[float] = []
            self.faults_at_start = 0

        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
            self.faults_at_start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            self.current = [time.perf_counter()]

        def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Any) -> None:
            self.current.append(time.perf_counter())

        def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.current.append(time.perf_counter())

        def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
            self.current.append(time.perf_counter())

        def on_train_batch_end(
            self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, i: int
        ) -> None:
            self.current.append(time.perf_counter())
            marks.append(self.current)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - self.faults_at_start)

    return Phases()


def phase_medians(marks: list[list[float]]) -> dict[str, float]:
    """Median milliseconds of each phase over the batches whose marks are complete (one of each hook)."""
    spans = [[b - a for a, b in itertools.pairwise(m)] for m in marks if len(m) == len(PHASES) + 1]
    return {name: statistics.median(s[i] for s in spans) * 1e3 for i, name in enumerate(PHASES)} if spans else {}


# ---- one rank of one run (a spawned process) -------------------------------------------------------------


def train_rank(rank: int, world: int, args: argparse.Namespace, name: str, n_layer: int) -> dict[str, Any]:
    import lightning as L
    import torch

    from lightning_pstar import PatrickStarStrategy
    from lightning_pstar.demos import GPTLightningModule, StdlibCharDataModule
    from lightning_pstar.demos.timing import StepTimer

    torch.set_num_threads(args.threads)
    L.seed_everything(args.seed, verbose=False)
    total = args.warmup + args.steps
    datamodule = StdlibCharDataModule(
        block_size=args.block_size,
        batch_size=args.batch_size,
        max_chars=max(100_000, 2 * total * world * args.batch_size * (args.block_size + 1)),
        val_fraction=0.05,
    )
    kwargs: dict[str, Any] = {
        "vocab_size": args.vocab_size,
        "block_size": args.block_size,
        "n_layer": n_layer,
        "n_head": args.n_head,
        "n_embd": args.n_embd,
        "warmup_steps": min(10, total),
        "fused": True,
        "meta_init": True,
    }
    strategy: Any = "auto"
    module: L.LightningModule = GPTLightningModule(**kwargs)
    if name == "patrickstar":
        strategy = PatrickStarStrategy(**pstar_host_malloc())
    elif name == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        strategy = DDPStrategy(find_unused_parameters=False)
    elif name == "fsdp":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
        module = _fsdp_module_class()(bf16=args.precision == "bf16-mixed", **kwargs)
    meter = EngineMeter()
    timer = StepTimer()
    marks: list[list[float]] = []
    faults: list[int] = []
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        precision=args.precision,
        max_steps=total,
        **QUIET_TRAINER,
        callbacks=[timer, _meter_callback(meter, args.warmup), _phase_callback(marks, faults)],
    )
    trainer.fit(module, datamodule=datamodule)
    params = list(module.gpt.parameters())  # type: ignore[union-attr]
    num_params = sum(p.numel() for p in params)
    local = sum(p.to_local().numel() for p in params) if name == "fsdp" else num_params
    result: dict[str, Any] = {
        "rank": rank,
        "num_params": num_params,
        "step_s": statistics.median(timer.times[args.warmup :]),
        "bytes_per_param": FP32_ADAM_BYTES_PER_PARAM * local / num_params,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "phase_ms": phase_medians(marks[args.warmup :]),
        "page_faults_per_step": statistics.median(faults[args.warmup :]) if faults[args.warmup :] else None,
    }
    if name == "patrickstar" and timer.report is not None and meter.modules:
        modules = meter.modules
        result.update(
            bytes_per_param=timer.report["model_data_bytes"] / num_params,
            modules=modules,
            groups=timer.report["num_chunks"] // world,
            chunk_size=timer.report["chunk_size"],
            chunk_utilisation=timer.report["chunk_utilisation"],
            engine_us_per_module=meter.cpu_s / args.steps / modules * 1e6,
            # per verb: CPU per call, and calls per step (grad_ready: one per parameter)
            engine_us_per_call={k: v / meter.calls[k] * 1e6 for k, v in meter.by_verb.items() if meter.calls[k]},
            engine_calls_per_step={k: v / args.steps for k, v in meter.calls.items() if v},
            collectives_per_step=sum(meter.collectives.values()) / args.steps,
            collectives_by_kind={k: v / args.steps for k, v in meter.collectives.items() if v},
            host_malloc=str(strategy.config.memory.host_malloc),  # what the run's --host-malloc told it
        )
    return result


def launch(args: argparse.Namespace, world: int, name: str, n_layer: int) -> list[dict[str, Any]]:
    print(f"running {name} on {world} rank(s), {n_layer} layers ...", flush=True)
    label = f"{name} ({world} ranks, {n_layer} layers)"
    return run_ranks(world, train_rank, (world, args, name, n_layer), threads=args.threads, label=label,
                     timeout_s=RUN_TIMEOUT_S)  # fmt: skip


def summarise(name: str, world: int, n_layer: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {
        "strategy": name,
        "world_size": world,
        "n_layer": n_layer,
        "params": ranks[0]["num_params"],
        "step_ms": max(r["step_s"] for r in ranks) * 1e3,
        "bytes_per_param": max(r["bytes_per_param"] for r in ranks),
        "phase_ms": max(ranks, key=lambda r: r["step_s"])["phase_ms"],
        "page_faults_per_step": max((r["page_faults_per_step"] or 0) for r in ranks),
    }
    if name == "patrickstar":
        keys = ("modules", "groups", "chunk_size", "chunk_utilisation", "collectives_by_kind", "host_malloc")
        for key in (*keys, "engine_us_per_call", "engine_calls_per_step"):
            row[key] = ranks[0][key]
        row["engine_us_per_module"] = max(r["engine_us_per_module"] for r in ranks)
        row["collectives_per_step"] = ranks[0]["collectives_per_step"]
    return row


def print_table(rows: list[dict[str, Any]], precision: str) -> None:
    ref = {(r["world_size"], r["n_layer"]): r for r in rows if r["strategy"] in ("auto", "ddp")}
    header = (
        f"{'layers':>6} {'ranks':>5} {'strategy':<12} {'step':>9} {'vs ref':>7} {'engine/module':>13}"
        f" {'colls/step':>10} {'groups':>6} {'util':>5} {'B/param':>8}"
    )
    print()
    print(f"precision {precision}")
    print(header)
    print("-" * len(header))
    for r in rows:
        base = ref.get((r["world_size"], r["n_layer"]))
        ratio = f"{r['step_ms'] / base['step_ms']:.2f}x" if base else "-"
        engine = f"{r['engine_us_per_module']:.0f} us" if "engine_us_per_module" in r else "-"
        colls = f"{r['collectives_per_step']:.0f}" if "collectives_per_step" in r else "-"
        groups = str(r.get("groups", "-"))
        util = f"{r['chunk_utilisation']:.2f}" if "chunk_utilisation" in r else "-"
        print(
            f"{r['n_layer']:>6} {r['world_size']:>5} {r['strategy']:<12} {r['step_ms']:>6.1f} ms {ratio:>7}"
            f" {engine:>13} {colls:>10} {groups:>6} {util:>5} {r['bytes_per_param']:>8.2f}"
        )
    for r in rows:  # where each run's step goes, phase by phase (the slower rank)
        if r["phase_ms"]:
            phases = ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in r["phase_ms"].items())
            faults = f"; {r['page_faults_per_step']:,.0f} minor page faults per step"
            print(f"  {r['n_layer']} layers, {r['world_size']} rank(s), {r['strategy']}: {phases} ms{faults}")
    for r in rows:  # where the engine's time goes, verb by verb (rank 0)
        if "engine_us_per_call" in r:
            verbs = ", ".join(
                f"{k} {v:.1f} us x {r['engine_calls_per_step'][k]:.0f}" for k, v in r["engine_us_per_call"].items()
            )
            print(f"  {r['n_layer']} layers, {r['world_size']} rank(s), per call x calls/step: {verbs}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    apply_host_malloc(args.host_malloc)  # the ranks apply it ([Note: --host-malloc cached] in _launch.py)
    make_repo_importable()
    tries: dict[tuple[int, int, str], list[dict[str, Any]]] = {}
    for _ in range(args.repeats):  # interleaved, so a slow phase of the machine hits every run alike
        for n_layer in args.layer_list:
            for world, name in args.runs:
                row = summarise(name, world, n_layer, launch(args, world, name, n_layer))
                tries.setdefault((n_layer, world, name), []).append(row)
    rows = []
    for runs in tries.values():
        best = min(runs, key=lambda r: r["step_ms"])
        best["repeat_step_ms"] = [r["step_ms"] for r in runs]
        rows.append(best)
    print_table(rows, args.precision)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        options = {k: str(v) for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"args": options, "rows": rows}, indent=2))
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
