"""Plain-PyTorch references: what a strategy must reproduce, written without Lightning or chunks.

:func:`reference_mixed_precision` implements the mixed-precision semantics of README.md's "Precision" section
for :class:`~tests.helpers.models.TinyGPT`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from tests.helpers.models import SEED, build_model, lm_loss
from tests.helpers.runs import OptimSpec, make_optimizer, make_scheduler


@dataclass
class ReferenceRun:
    """What :func:`reference_mixed_precision` produced."""

    losses: list[float]
    """Accumulation-normalised loss of every micro-batch (what Lightning reports)."""
    skipped_steps: list[int]
    """0-based optimizer step indices that overflowed and were skipped."""
    scales: list[float]
    """Loss scale in effect at each optimizer step (before its update)."""
    final_scale: float
    masters: dict[str, torch.Tensor]
    """Final fp32 master weights of the trainable parameters, by ``named_parameters`` name."""
    master_history: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Master weights after every optimizer step."""


def _cycle(loader: DataLoader) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for _ in itertools.count():
        yield from loader


def reference_mixed_precision(
    *,
    dtype: torch.dtype,
    optim: OptimSpec,
    loader: DataLoader,
    max_steps: int,
    accumulate: int = 1,
    clip_val: float | None = None,
    initial_scale: float = 2.0**16,
    backoff_factor: float = 0.5,
    growth_factor: float = 2.0,
    growth_interval: int = 2000,
    seed: int = SEED,
    **model_kwargs: Any,
) -> ReferenceRun:
    """Train :class:`TinyGPT` with the exact mixed-precision semantics described in README.md (Precision).

    fp32 masters hold the truth; the model holds ``master.to(dtype)``; forward runs under autocast;
    (fp16 only) the loss is scaled by S before backward; per-micro-batch gradients are summed in fp32;
    at each step they are divided by S, checked for inf/nan (skip + back off on overflow), clipped by
    global norm with ``clip_grad_norm_`` and stepped with the fused optimizer on the masters.
    """
    use_scaler = dtype == torch.float16
    model = build_model(seed, **model_kwargs)
    named = list(model.named_parameters())  # dedups the tied weight
    trainable = [(n, p) for n, p in named if p.requires_grad]
    masters = [nn.Parameter(p.detach().clone().float()) for _, p in trainable]
    model.to(dtype)
    optimizer = make_optimizer(optim, masters)
    scheduler = make_scheduler(optim, optimizer)
    acc: list[torch.Tensor | None] = [None] * len(masters)
    scale = initial_scale if use_scaler else 1.0
    good_steps = 0
    run = ReferenceRun(losses=[], skipped_steps=[], scales=[], final_scale=scale, masters={})
    micro = 0
    step = 0
    for x, y in _cycle(loader):
        if step == max_steps:
            break
        with torch.autocast("cpu", dtype=dtype):
            loss = lm_loss(model(x), y)
        loss = loss / accumulate
        run.losses.append(float(loss.detach()))
        (loss * scale if use_scaler else loss).backward()
        for i, (_, p) in enumerate(trainable):
            if p.grad is not None:
                g = p.grad.float()
                acc[i] = g if acc[i] is None else acc[i] + g  # type: ignore[operator]
                p.grad = None
        micro += 1
        if micro % accumulate:
            continue
        run.scales.append(scale)
        grads = [None if a is None else a / scale for a in acc]
        finite = all(bool(torch.isfinite(g).all()) for g in grads if g is not None)
        if not finite:
            run.skipped_steps.append(step)
            scale *= backoff_factor
            good_steps = 0
        else:
            for m, grad in zip(masters, grads, strict=True):
                m.grad = grad
            if clip_val is not None:
                torch.nn.utils.clip_grad_norm_(masters, clip_val)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for (_, p), m in zip(trainable, masters, strict=True):
                    p.copy_(m.to(dtype))
            if use_scaler:
                good_steps += 1
                if good_steps == growth_interval:
                    scale *= growth_factor
                    good_steps = 0
        if scheduler is not None:
            scheduler.step()
        acc = [None] * len(masters)
        run.master_history.append({n: m.detach().clone() for (n, _), m in zip(trainable, masters, strict=True)})
        step += 1
    run.final_scale = scale
    run.masters = {n: m.detach().clone() for (n, _), m in zip(trainable, masters, strict=True)}
    assert all(math.isfinite(v) for v in run.losses)
    return run
