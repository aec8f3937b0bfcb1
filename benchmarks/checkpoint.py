"""Save and load time and peak host memory of consolidated and sharded checkpoints of the example GPT.

    python benchmarks/checkpoint.py                       # 1 and 2 ranks, both formats, checks on and off
    python benchmarks/checkpoint.py --n-layer 8 --n-embd 512 --json /tmp/ckpt.json
    python benchmarks/checkpoint.py --ranks 2 --integrity on  # only the default (checked) saves and loads

Each (format, ranks) pair runs in a fresh process group. A run trains the demo GPT for ``--steps`` steps, then
times ``trainer.save_checkpoint`` on every rank; then a fresh Trainer with ``max_steps`` equal to the saved
step count fits from that checkpoint (so it only restores) and the same fit without a checkpoint is timed
too: the difference is the load time. Peak host memory is the rise of the process's resident-set high-water
mark during the operation (Linux: reset through ``/proc/self/clear_refs``, read from ``VmHWM``), per rank.

The cost of the integrity checks (issue 14) is measured two ways: every pair runs with the checks (the
default) and without them (``--integrity off``: torch writes no record CRC32s, no file checksums are computed
or verified: switched off in the benchmark's processes only, the package has no such option), and after each
checked save rank 0 times the verification alone (``verify_s``: what a load spends checking the files).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def _measure(fn: Any) -> tuple[float, int]:
    _reset_peak()
    before = _rss_kib("VmRSS:")
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    return elapsed, max(0, _rss_kib("VmHWM:") - before) * 1024


def worker(args: argparse.Namespace) -> None:
    import torch

    from lightning_pstar import PatrickStarStrategy
    from lightning_pstar.demos import GPTLightningModule, StdlibCharDataModule

    torch.set_num_threads(1)
    directory = Path(args.dir)
    extra: list[Any] = [] if args.integrity == "on" else [NoIntegrity()]

    def make() -> tuple[Any, Any]:
        L.seed_everything(0)
        module = GPTLightningModule(
            vocab_size=128, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd
        )
        data = StdlibCharDataModule(block_size=args.block_size, batch_size=8, max_chars=200_000)
        return module, data

    def trainer(max_steps: int) -> Any:
        return L.Trainer(
            accelerator="cpu",
            devices=args.ranks,
            strategy=PatrickStarStrategy(checkpoint=args.format, start_method="spawn"),
            max_steps=max_steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
        )

    module, data = make()
    t = trainer(args.steps)
    t.callbacks.extend([*extra, Save(directory, verify=args.integrity == "on")])
    t.fit(module, data)
    module, data = make()
    t = trainer(args.steps)
    t.callbacks.extend([*extra, Load("load")])
    t.fit(module, data, ckpt_path=str(directory / "ckpt"))
    module, data = make()
    t = trainer(0)
    t.callbacks.extend([*extra, Load("baseline")])
    t.fit(module, data)


import lightning as L  # noqa: E402  (after the helpers: the parent process only needs them)


def _record(directory: Path, row: dict[str, Any]) -> None:
    """One JSON line per result, in a file per rank (ranks share stdout, lines could interleave)."""
    with open(directory / f"results-rank{row['rank']}.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


class NoIntegrity(L.Callback):
    """Switches the checksums off in this rank's process (``setup`` runs on every rank before a restore)."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        import torch

        import lightning_pstar.checkpoint.io as io_module
        import lightning_pstar.checkpoint.sharded as sharded_module

        torch.serialization.set_crc32_options(False)  # torch writes no record CRC32s (verify then skips them)
        io_module.verify_torch_file = lambda path: None  # type: ignore[assignment]
        sharded_module.verify_checksums = lambda directory, table: None  # type: ignore[assignment]
        sharded_module.file_checksums = lambda directory, names: {}  # type: ignore[assignment]


def _verify_seconds(path: Path) -> float:
    """How long checking the checksums of the checkpoint at ``path`` takes (what a load spends on them)."""
    import torch

    from lightning_pstar.checkpoint.integrity import verify_checksums, verify_torch_file
    from lightning_pstar.checkpoint.sharded import CHECKSUMS_KEY, META_FILENAME

    start = time.perf_counter()
    if path.is_dir():
        meta = path / META_FILENAME
        verify_torch_file(meta)
        table = torch.load(meta, weights_only=False)[CHECKSUMS_KEY]
        verify_checksums(path, table)
    else:
        verify_torch_file(path)
    return time.perf_counter() - start


class Save(L.Callback):
    """Times ``trainer.save_checkpoint`` at the end of training, on every rank (and the verification alone)."""

    def __init__(self, directory: Path, *, verify: bool) -> None:
        self.directory = directory
        self.verify = verify

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        path = self.directory / "ckpt"
        seconds, peak = _measure(lambda: trainer.save_checkpoint(path))
        files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
        size = sum(p.stat().st_size for p in files)
        row = {"op": "save", "rank": trainer.global_rank, "s": seconds, "peak": peak, "bytes": size}
        if self.verify and trainer.global_rank == 0:
            row["verify_s"] = _verify_seconds(path)
        _record(self.directory, row)


class Load(L.Callback):
    """Times a fit from its start to its end (no step is trained: it only sets up and restores)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.start = 0.0
        self.before = 0

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.start = time.perf_counter()
        _reset_peak()
        self.before = _rss_kib("VmRSS:")

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        peak = max(0, _rss_kib("VmHWM:") - self.before) * 1024
        row = {"op": self.label, "rank": trainer.global_rank, "s": time.perf_counter() - self.start, "peak": peak}
        _record(Path(os.environ["PSTAR_BENCH_DIR"]), row)


def run(args: argparse.Namespace, fmt: str, ranks: int, integrity: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, __file__, "--worker", "--format", fmt, "--ranks", str(ranks), "--dir", tmp]
        cmd += ["--integrity", integrity]
        cmd += ["--steps", str(args.steps), "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd)]
        cmd += ["--n-head", str(args.n_head), "--block-size", str(args.block_size)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PSTAR_BENCH_DIR": tmp}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"{fmt} at {ranks} rank(s) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        rows = [
            json.loads(line)
            for f in sorted(Path(tmp).glob("results-rank*.jsonl"))
            for line in f.read_text().splitlines()
        ]
        shutil.rmtree(tmp, ignore_errors=True)
    by_op: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_op.setdefault(row["op"], []).append(row)
    save, load, base = by_op["save"], by_op["load"], by_op["baseline"]
    verify = [r["verify_s"] for r in save if "verify_s" in r]
    return {
        "format": fmt,
        "world_size": ranks,
        "integrity": integrity == "on",
        "verify_s": verify[0] if verify else None,
        "save_s": max(r["s"] for r in save),
        "load_s": max(r["s"] for r in load) - max(r["s"] for r in base),
        "save_peak_host_bytes_per_rank": {r["rank"]: r["peak"] for r in save},
        "load_peak_host_bytes_per_rank": {r["rank"]: r["peak"] for r in load},
        "checkpoint_bytes": max(r["bytes"] for r in save),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=192)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--ranks", default="1,2", help="comma-separated world sizes (default: 1,2)")
    parser.add_argument("--formats", default="consolidated,sharded")
    parser.add_argument(
        "--integrity", default="on,off", help="with the checksums (on), without (off), or both (default: on,off)"
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--format", default="consolidated", help=argparse.SUPPRESS)
    parser.add_argument("--dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.ranks = int(args.ranks)
        worker(args)
        return 0
    results = [
        run(args, fmt, int(r), check)
        for r in args.ranks.split(",")
        for fmt in args.formats.split(",")
        for check in args.integrity.split(",")
    ]

    def mib(n: int) -> str:
        return f"{n / 2**20:8.1f} MiB"

    print(f"demo GPT n_layer={args.n_layer} n_embd={args.n_embd}; times are the slowest rank's")
    print("format        ranks checks  size          save      load    verify  save peak/rank          load peak/rank")
    for r in results:
        save_peak = " ".join(mib(v) for v in r["save_peak_host_bytes_per_rank"].values())
        load_peak = " ".join(mib(v) for v in r["load_peak_host_bytes_per_rank"].values())
        verify = "       -" if r["verify_s"] is None else f"{r['verify_s']:6.3f} s"
        checks = "on" if r["integrity"] else "off"
        print(
            f"{r['format']:<13} {r['world_size']:>5} {checks:>6} {mib(r['checkpoint_bytes'])}"
            f" {r['save_s']:8.3f} s {r['load_s']:8.3f} s {verify}  {save_peak:<22} {load_peak}"
        )
    if args.json:
        args.json.write_text(json.dumps({"runs": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
