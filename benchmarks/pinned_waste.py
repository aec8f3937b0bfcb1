"""Pinned host memory held for chunk buffers, with the chunk sizes the engine picks off CUDA and on CUDA.

    python benchmarks/pinned_waste.py                        # the README's demo GPT shapes
    python benchmarks/pinned_waste.py --shapes 2x64 --json   # any n_layer x n_embd

torch's caching host allocator rounds every pinned request up to a power of two ([Note: pinned memory] in
``lightning_pstar/runtime/pinned.py``). For each demo GPT shape (vocabulary 50304, block 1024, head size 128, on
the meta device) this lays the chunks out as the engine does, once with the searched chunk size (what the
simulated device uses) and once with ``allocator_friendly`` (what CUDA uses), puts every chunk kind of a
bf16-mixed Adam run on the host (bf16 params, fp32 masters, exp_avg, exp_avg_sq), and prints the chunk bytes,
the rounding the allocator would add, and the chunk utilisation. Nothing is allocated.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import torch

from lightning_pstar.demos import GPT, GPTConfig
from lightning_pstar.planning.requirements import chunk_layout, collect_parameters
from lightning_pstar.runtime.pinned import rounding_waste

KIND_ITEMSIZES = (2, 4, 4, 4)  # bf16 param chunk, fp32 master, exp_avg, exp_avg_sq
DEVICE_BUDGET = int(0.8 * 141e9)  # the strategy's default share of one H200


def measure(n_layer: int, n_embd: int) -> dict[str, object]:
    config = GPTConfig(vocab_size=50304, block_size=1024, n_layer=n_layer, n_head=max(1, n_embd // 128), n_embd=n_embd)
    with torch.device("meta"):
        model = GPT(config)
    named = collect_parameters(model, exclude=set())
    row: dict[str, object] = {"shape": f"{n_layer}x{n_embd}", "params": sum(p.numel() for p, _ in named)}
    for name, friendly in (("searched", False), ("cuda", True)):
        layout = chunk_layout(
            named,
            chunk_elements=None,
            device_budget=DEVICE_BUDGET,
            compute_itemsize=2,
            world_size=1,
            allocator_friendly=friendly,
        )
        chunks = sum(c.capacity * size for c in layout.chunks for size in KIND_ITEMSIZES)
        waste = sum(rounding_waste(c.capacity * size) for c in layout.chunks for size in KIND_ITEMSIZES)
        row[name] = {
            "chunk_size": layout.chunk_size,
            "utilisation": layout.utilisation,
            "chunk_bytes": chunks,
            "rounding_bytes": waste,
            "pinned_bytes": chunks + waste,
        }
    return row


def _shape(text: str) -> tuple[int, int]:
    layers, _, embd = text.partition("x")
    return int(layers), int(embd)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="24x2048,32x4096,48x7168", help="comma-separated n_layer x n_embd")
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of the table")
    args = parser.parse_args(argv)
    rows = [measure(*_shape(s)) for s in args.shapes.split(",")]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    gib = float(1 << 30)
    print("shape      params    searched: chunks + rounding = pinned (util)    cuda: pinned (util)")
    for row in rows:
        a, b = row["searched"], row["cuda"]
        assert isinstance(a, dict) and isinstance(b, dict)
        print(
            f"{row['shape']:<9} {row['params'] / 1e9:6.2f}B  {a['chunk_bytes'] / gib:8.1f}"
            f" + {a['rounding_bytes'] / gib:6.1f}"
            f" = {a['pinned_bytes'] / gib:7.1f} GiB ({a['utilisation']:.1%})"
            f"    {b['pinned_bytes'] / gib:7.1f} GiB ({b['utilisation']:.1%})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
