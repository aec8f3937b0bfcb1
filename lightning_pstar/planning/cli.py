"""``python -m lightning_pstar.plan``: the capacity planner's command line.

Exit status: 0 the model fits, 1 it does not, 2 bad input (argparse's status, with its usage line).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from lightning_pstar.config import SUPPORTED_PRECISIONS, parse_bytes
from lightning_pstar.planning.capacity import OPTIMIZER_STATE_BYTES, plan_capacity
from lightning_pstar.planning.largest import Scale

__all__ = ["main"]


def _byte_size(text: str) -> int:
    try:
        return parse_bytes(text, name="size")
    except ValueError as err:
        raise argparse.ArgumentTypeError(
            f"invalid byte size {text!r}. HINT: a number with an optional unit, e.g. 80GiB, 512MiB, 1.5TB."
        ) from err


def _chunk_size(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"invalid chunk size {text!r}. HINT: 'auto' or a positive element count.")
    return value


def _parse_value(text: str) -> Any:
    """``--set`` values: int, float, bool or the string itself."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _assignment(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"invalid --set {text!r}. HINT: write KEY=VALUE, e.g. n_layer=48.")
    return key.strip(), _parse_value(value)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_pstar.plan",
        description="Will a model fit under PatrickStar? Builds it on the meta device and plans its chunks."
        " Exit status: 0 fits, 1 does not fit, 2 bad input.",
    )
    parser.add_argument("target", help="model config YAML (e.g. configs/model/gpt_small.yaml) or pkg.module:factory")
    parser.add_argument(
        "--device-memory", type=_byte_size, required=True,
        help="chunk budget per rank on the device, e.g. 80GiB: the strategy's device_memory_limit (its default is"
        " device_memory_fraction=0.8 of the accelerator)",
    )  # fmt: skip
    parser.add_argument(
        "--host-memory", type=_byte_size, required=True,
        help="chunk budget per rank in host RAM, e.g. 512GiB: the strategy's host_memory_limit (its default is"
        " host_memory_fraction=0.8 of the RAM divided by the ranks of a node)",
    )  # fmt: skip
    parser.add_argument(
        "--disk-memory", type=_byte_size, default=None,
        help="disk budget per rank, e.g. 2TB: with it, the families whose optimizer side the host cannot hold keep it"
        " on disk (the strategy's disk_path with disk_memory_limit); the largest-model search counts the three tiers",
    )  # fmt: skip
    parser.add_argument("--world-size", type=int, default=1, help="number of ranks (ZeRO-DP over chunks)")
    parser.add_argument("--precision", choices=list(SUPPORTED_PRECISIONS), default="bf16-mixed")
    parser.add_argument("--chunk-size", type=_chunk_size, default="auto", help="'auto' or elements per chunk")
    parser.add_argument("--optimizer", choices=list(OPTIMIZER_STATE_BYTES), default="adam")
    parser.add_argument(
        "--placement", choices=["auto", "static"], default="auto",
        help="the strategy's placement: where the optimizer side starts and the device share chunks get at first",
    )  # fmt: skip
    parser.add_argument(
        "--optimizer-placement", choices=["auto", "host", "device"], default="auto",
        help="the strategy's optimizer_placement: where the fp32 masters and optimizer states start",
    )  # fmt: skip
    parser.add_argument(
        "--optimizer-overlap", choices=["auto", "pipeline", "next_forward", "off"], default="auto",
        help="the strategy's optimizer_overlap: the host-side step's schedule (the disk tier loads 1 family at once"
        " when 'off', 3 otherwise)",
    )  # fmt: skip
    parser.add_argument("--accumulate-grad-batches", type=int, default=1, help="> 1 adds fp32 gradient sums")
    parser.add_argument("--cpu-embedding", action="store_true", help="embeddings fp32 on HOST, outside chunks")
    parser.add_argument(
        "--no-frozen-master", action="store_true", help="frozen parameters only in the compute dtype (no fp32 copy)"
    )
    parser.add_argument(
        "--set", dest="overrides", type=_assignment, action="append", default=[], metavar="KEY=VALUE",
        help="override a GPT size (n_layer, n_embd, n_head, vocab_size, block_size) or pass a factory argument",
    )  # fmt: skip
    parser.add_argument("--scale", choices=[s.value for s in Scale], default=Scale.BOTH.value, help="largest search")
    parser.add_argument("--no-largest", action="store_true", help="skip the largest-model search")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--device-type",
        choices=["cuda", "cpu"],
        default=None,
        help="the accelerator the run will use (default: this machine's); cuda picks pinned-memory-friendly chunks",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        plan = plan_capacity(
            args.target,
            device_memory=args.device_memory,
            host_memory=args.host_memory,
            world_size=args.world_size,
            precision=args.precision,
            chunk_size=args.chunk_size,
            optimizer=args.optimizer,
            accumulate_grad_batches=args.accumulate_grad_batches,
            cpu_embedding=args.cpu_embedding,
            frozen_master=not args.no_frozen_master,
            overrides=dict(args.overrides),
            search_largest=not args.no_largest,
            scale=args.scale,
            device_type=args.device_type,
            placement=args.placement,
            disk_memory=args.disk_memory,
            optimizer_placement=args.optimizer_placement,
            optimizer_overlap=args.optimizer_overlap,
        )
    except ValueError as err:
        parser.error(str(err))  # exits with status 2
    print(json.dumps(plan.as_dict(), indent=2) if args.json else plan)
    return 0 if plan.fits else 1
