"""The disk tier against this machine's own ``O_DIRECT`` ceiling (issue 28; part 1: the I/O layer, part 2 with
``--train``: the demo GPT trained with a host budget below its optimizer states, ``benchmarks/_disk_train.py``).

    python benchmarks/disk_tier.py                          # 2 GiB in the temp dir, table
    python benchmarks/disk_tier.py --dir /nvme/scratch --size 8GiB --json disk.json
    python benchmarks/disk_tier.py --train --dir /nvme/scratch --n-layer 8 --n-embd 1024 --json disk.json
    python benchmarks/disk_tier.py --train --size 256MiB --n-layer 24 --n-embd 3072 --n-head 24 --block 16 \
        --batch-size 1 --families 96 --host-budget 9GiB --device-budget 8GiB --json big.json   # model > 1.5x RAM
    python benchmarks/disk_tier.py --tiny                   # seconds: the script's own check of part 1
    python benchmarks/disk_tier.py --quick                  # ... of both parts (a tiny GPT)

1. The ceiling: raw ``os.pwritev`` / ``os.preadv`` on a fresh file opened with ``O_DIRECT``, from page-aligned
   buffers, on each thread count of ``--threads`` and block size of ``--blocks`` (the threads take blocks in turn).
   Reads are cold: the file's pages are dropped with ``posix_fadvise(POSIX_FADV_DONTNEED)`` first (no root
   ``drop_caches``; ``O_DIRECT`` bypasses the page cache anyway). The best write and read rate over the grid is
   the ceiling.
2. :class:`~lightning_pstar.runtime.disk.DiskStore` with the ceiling's thread count and block size moves the same
   number of bytes as one key: written from an aligned tensor, read back cold into one, and once more through its
   staging buffers (an unaligned tensor). Its achieved GB/s is printed beside the ceiling, with the ratio (the
   issue's target: at least 0.8), and the store's own counters (:class:`~lightning_pstar.runtime.disk.DiskStats`).
3. The page cache (``Cached`` in ``/proc/meminfo``) before and after the store's transfers (target: near zero
   growth) and the load average before and after (other work on the machine lowers every figure).

Each figure is the best of ``--repeat`` runs. GB/s are 1e9 bytes per second. Files go to a directory of their own
inside ``--dir`` and are removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from lightning_pstar.config import parse_bytes
from lightning_pstar.runtime.aligned import align_up, aligned_empty
from lightning_pstar.runtime.disk import DiskStore

MIB = 1 << 20


def _cached_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    return 0


def _open(path: str, *, create: bool) -> tuple[int, bool]:
    flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
    try:
        return os.open(path, flags | os.O_DIRECT, 0o600), True
    except OSError:
        return os.open(path, flags, 0o600), False


def _raw_pass(path: str, size: int, threads: int, block: int, *, write: bool) -> tuple[float, bool]:
    """Seconds to write (a fresh file) or cold-read ``size`` bytes at ``path``; and whether O_DIRECT was used."""
    fd, direct = _open(path, create=write)
    if not write:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    buffers = [aligned_empty(block) for _ in range(threads)]
    for i, b in enumerate(buffers):
        b.copy_(torch.arange(block, dtype=torch.int64).add_(i).remainder_(251).to(torch.uint8))
    offsets = list(range(0, size, block))

    def worker(index: int) -> None:
        view = buffers[index].numpy().data
        for offset in offsets[index::threads]:
            length = align_up(min(block, size - offset))
            moved = (os.pwritev if write else os.preadv)(fd, [view[:length]], offset)
            if moved != length:
                raise OSError(f"{'write' if write else 'read'} of {length} bytes at {offset} moved {moved}")

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(worker, range(threads)))
    seconds = time.perf_counter() - start
    if not direct:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    return seconds, direct


def measure_ceiling(root: str, size: int, threads: Sequence[int], blocks: Sequence[int], repeat: int) -> dict[str, Any]:
    rows = []
    path = os.path.join(root, "raw.bin")
    for t in threads:
        for b in blocks:
            writes, reads = [], []
            for _ in range(repeat):
                if os.path.exists(path):
                    os.unlink(path)  # a fresh file: no block reuse
                seconds, direct = _raw_pass(path, size, t, b, write=True)
                writes.append(seconds)
                reads.append(_raw_pass(path, size, t, b, write=False)[0])
            rows.append(
                {
                    "threads": t,
                    "block_bytes": b,
                    "direct": direct,
                    "write_gbps": size / min(writes) / 1e9,
                    "read_gbps": size / min(reads) / 1e9,
                }
            )
    os.unlink(path)
    best_write = max(rows, key=lambda r: r["write_gbps"])
    best_read = max(rows, key=lambda r: r["read_gbps"])
    best = max(rows, key=lambda r: r["write_gbps"] / best_write["write_gbps"] + r["read_gbps"] / best_read["read_gbps"])
    return {
        "grid": rows,
        "write_gbps": best_write["write_gbps"],
        "read_gbps": best_read["read_gbps"],
        "threads": best["threads"],
        "block_bytes": best["block_bytes"],
        "direct": all(r["direct"] for r in rows),
    }


def measure_store(root: str, size: int, threads: int, block: int, repeat: int) -> dict[str, Any]:
    src = aligned_empty(size)
    src.copy_(torch.arange(size, dtype=torch.int64).remainder_(251).to(torch.uint8))
    out = aligned_empty(size)
    unaligned = torch.empty(size + 8, dtype=torch.uint8)[8:]
    best = {"write": float("inf"), "read": float("inf"), "staged_write": float("inf"), "staged_read": float("inf")}
    cached_before = _cached_bytes()
    with DiskStore(root, threads=threads, block_bytes=block) as store:
        for r in range(repeat):
            key = f"bench{r}"
            for name, tensor, write in (
                ("write", src, True),
                ("read", out, False),
                ("staged_write", unaligned.copy_(src), True),
                ("staged_read", unaligned, False),
            ):
                start = time.perf_counter()
                (store.write if write else store.read)(key, tensor).result()
                best[name] = min(best[name], time.perf_counter() - start)
            store.discard(key)
        stats, direct = store.stats(), store.direct
    growth = _cached_bytes() - cached_before
    if not torch.equal(out, src) or not torch.equal(unaligned, src):
        raise AssertionError("DiskStore round trip is not bitwise")
    record: dict[str, Any] = {"threads": threads, "block_bytes": block}
    record.update({f"{name}_gbps": size / seconds / 1e9 for name, seconds in best.items()})
    record.update(
        {
            "stats_write_gbps": stats.write_gbps,
            "stats_read_gbps": stats.read_gbps,
            "bytes_written": stats.bytes_written,
            "bytes_read": stats.bytes_read,
            "page_cache_growth_bytes": growth,
            "direct": direct,
        }
    )
    return record


def run(args: argparse.Namespace) -> dict[str, Any]:
    size = align_up(parse_bytes(args.size, name="--size"))
    threads = [int(t) for t in args.threads.split(",")]
    blocks = [int(float(b) * MIB) for b in args.blocks.split(",")]
    load_before = os.getloadavg()
    root = tempfile.mkdtemp(prefix="pstar-disk-bench-", dir=args.dir)
    try:
        ceiling = measure_ceiling(root, size, threads, blocks, args.repeat)
        store = measure_store(root, size, ceiling["threads"], ceiling["block_bytes"], args.repeat)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    store["write_ratio"] = store["write_gbps"] / ceiling["write_gbps"]
    store["read_ratio"] = store["read_gbps"] / ceiling["read_gbps"]
    return {
        "dir": os.path.abspath(args.dir),
        "size_bytes": size,
        "repeat": args.repeat,
        "cpu_count": os.cpu_count() or 0,
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
        "ceiling": ceiling,
        "store": store,
    }


def print_table(result: dict[str, Any]) -> None:
    c, s = result["ceiling"], result["store"]
    load = ", ".join(f"{x:.2f}" for x in result["load_average_before"])
    print(f"disk tier I/O in {result['dir']}: {result['size_bytes'] / MIB:.0f} MiB, best of {result['repeat']}")
    print(f"load average before {load}; after {', '.join(f'{x:.2f}' for x in result['load_average_after'])}")
    print(f"{'':28}{'threads':>8}{'block MiB':>10}{'write GB/s':>12}{'read GB/s':>11}")
    for row in c["grid"]:
        name = "raw O_DIRECT" if row["direct"] else "raw buffered (no O_DIRECT)"
        print(
            f"{name:<28}{row['threads']:>8}{row['block_bytes'] / MIB:>10g}"
            f"{row['write_gbps']:>12.2f}{row['read_gbps']:>11.2f}"
        )
    print(f"{'ceiling':<28}{'':>8}{'':>10}{c['write_gbps']:>12.2f}{c['read_gbps']:>11.2f}")
    threads, block = s["threads"], s["block_bytes"] / MIB
    print(f"{'DiskStore, aligned':<28}{threads:>8}{block:>10g}{s['write_gbps']:>12.2f}{s['read_gbps']:>11.2f}")
    staged = f"{s['staged_write_gbps']:>12.2f}{s['staged_read_gbps']:>11.2f}"
    print(f"{'DiskStore, staged':<28}{threads:>8}{block:>10g}{staged}")
    print(f"{'DiskStore / ceiling':<28}{'':>8}{'':>10}{s['write_ratio']:>12.2f}{s['read_ratio']:>11.2f}")
    print(f"DiskStore counters: write {s['stats_write_gbps']:.2f} GB/s, read {s['stats_read_gbps']:.2f} GB/s busy rate")
    print(f"page cache growth during the store's transfers: {s['page_cache_growth_bytes'] / MIB:+.1f} MiB")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the disk to measure")
    parser.add_argument("--size", default="2GiB", help="bytes moved per pass (an int or '2GiB')")
    parser.add_argument("--threads", default="2,4", help="comma-separated thread counts of the raw grid")
    parser.add_argument("--blocks", default="4,16", help="comma-separated block sizes in MiB of the raw grid")
    parser.add_argument("--repeat", type=int, default=2, help="runs per figure; the best is kept")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH")
    parser.add_argument("--tiny", action="store_true", help="16 MiB, 2 threads, 4 MiB blocks, once: a quick check")
    train = parser.add_argument_group("part 2 (--train): the demo GPT with a host budget below its optimizer states")
    train.add_argument("--train", action="store_true", help="also run part 2")
    train.add_argument("--quick", action="store_true", help="--tiny --train: seconds, both parts")
    train.add_argument("--n-layer", type=int, default=4)
    train.add_argument("--n-embd", type=int, default=256)
    train.add_argument("--n-head", type=int, default=4)
    train.add_argument("--vocab", type=int, default=256)
    train.add_argument("--block", type=int, default=128)
    train.add_argument("--batch-size", type=int, default=4)
    train.add_argument("--train-steps", type=int, default=3)
    train.add_argument("--precision", default="bf16-mixed", help="bf16-mixed (default) or 32-true")
    train.add_argument("--host-fraction", type=float, default=0.6, help="host budget / optimizer-state bytes")
    train.add_argument("--families", type=int, default=32, help="chunk families the model is cut into")
    train.add_argument("--host-budget", help="host budget in bytes or '8GiB' (instead of --host-fraction)")
    train.add_argument("--device-budget", help="simulated device budget (default: 4x the model data + 256 MiB)")
    train.add_argument("--skip-without", action="store_true", help="no run without the disk tier")
    args = parser.parse_args(argv)
    if args.quick:
        args.tiny = args.train = True
    if args.tiny:
        args.size, args.threads, args.blocks, args.repeat = "16MiB", "2", "4", 1
        args.n_layer, args.n_embd, args.n_head, args.vocab, args.block, args.batch_size = 4, 64, 2, 64, 32, 2
        args.families, args.host_fraction = 24, 0.7
    result = run(args)
    print_table(result)
    if args.train:
        from _disk_train import print_training, run_training  # benchmarks/ is the script's own directory

        root = tempfile.mkdtemp(prefix="pstar-disk-train-", dir=args.dir)
        try:
            result["training"] = run_training(args, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print_training(result["training"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
