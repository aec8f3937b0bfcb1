"""A device budget that holds only part of the model data: chunks are evicted and fetched back, and
the arithmetic does not change at all (losses and final weights equal an unconstrained run bit for bit).

The subject is the ``static`` policy (least recently used eviction within a fixed share of the budget):
its budgets here are fractions of the param-chunk bytes that ignore activations, which ``auto`` would
rightly reject at the end of its warm-up. ``auto`` is covered by ``test_placement.py``.
"""

from __future__ import annotations

import pytest
import torch

from lightning_pstar import PatrickStarStrategy
from tests.helpers import OptimSpec, TinyLM, build_model, fit

STEPS = 20
ACCUM = 2
CLIP = 0.65
CHUNK = 512
"""Elements per chunk: ~60 param chunks for this model, plus oversized ones for the 4096/3072/1024-element weights."""
SPEC = OptimSpec(name="adamw", lr=3e-3, weight_decay=0.1, cosine_t_max=STEPS)

ITEMSIZE = {"32-true": 4, "bf16-mixed": 2}


def _largest_module_param_bytes(itemsize: int) -> int:
    """Bytes of the param chunks one leaf module can touch at once (an upper bound: each of its
    parameters in a chunk of its own, of at least CHUNK elements)."""
    model = build_model()
    best = 0
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if own:
            best = max(best, sum(max(p.numel(), CHUNK) for p in own) * itemsize)
    return best


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.slow
def test_eviction_does_not_change_losses(precision: str) -> None:
    common = {"precision": precision, "max_steps": STEPS, "accumulate_grad_batches": ACCUM, "gradient_clip_val": CLIP}
    free_strategy = PatrickStarStrategy(chunk_size=CHUNK, placement="static")
    free = fit(TinyLM(optim=SPEC), strategy=free_strategy, **common)
    free_report = free_strategy.memory_report()
    assert free_report.evictions == 0
    assert free_report.host_chunk_bytes == 0 or free_report.device_chunk_bytes > 0

    # the param chunks alone (compute dtype), from the unconstrained run's model data
    param_bytes = int(free_report.model_data_bytes * ITEMSIZE[precision] / free_report.model_data_bytes_per_param)
    limit = max(param_bytes // 3, 3 * _largest_module_param_bytes(ITEMSIZE[precision]))
    assert limit < param_bytes, (limit, param_bytes)
    assert limit < free_report.peak_device_chunk_bytes

    tight_strategy = PatrickStarStrategy(chunk_size=CHUNK, placement="static", device_memory_limit=limit)
    tight = fit(TinyLM(optim=SPEC), strategy=tight_strategy, **common)
    report = tight_strategy.memory_report()
    print(f"{precision}: limit {limit} B, unconstrained {free_report}\nconstrained {report}")
    assert report.placement == "static"
    assert report.device_memory_limit == limit
    assert report.evictions > 0
    assert report.h2d_bytes > 0 and report.d2h_bytes > 0
    assert report.peak_device_chunk_bytes <= limit
    assert report.device_chunk_bytes <= limit

    assert tight.trainer.global_step == free.trainer.global_step == STEPS
    assert tight.recorder.losses == free.recorder.losses
    free_sd = free.recorder.final_state
    tight_sd = tight.recorder.final_state
    assert sorted(free_sd) == sorted(tight_sd)
    for name, value in free_sd.items():
        assert torch.equal(tight_sd[name], value), name
