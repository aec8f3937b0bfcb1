"""The closed choices of PatrickStar's options (enums whose values are the strings users write), kept apart from the
dataclass tree of :mod:`lightning_pstar.config`, which re-exports them."""

from __future__ import annotations

from lightning_pstar.config_values import _ValueEnum

__all__ = ["CheckpointFormat", "HostMalloc", "NonFinite", "OptimizerOverlap", "OptimizerPlacement", "Placement"]


class Placement(_ValueEnum):
    """How chunks are placed between the DEVICE and HOST tiers."""

    AUTO = "auto"
    """PatrickStar's policy: a warm-up iteration records non-model memory and chunk accesses per moment;
    afterwards chunks use ``budget - non_model[t]`` at moment ``t``, the chunk used farthest in the future
    is evicted first, the next moment's chunks are prefetched, and optimizer-state families that fit the
    margin at the optimizer step run on the device."""
    STATIC = "static"
    """ZeRO-Offload style baseline: chunks may use ``static_chunk_fraction`` of the device budget; when it
    is full the least recently used ``HOLD*`` chunk is evicted to HOST. Optimizer states stay on DEVICE only
    if all model data fits that share."""
    auto = "auto"  # alias, see [Note: enums in OmegaConf]
    static = "static"  # alias


class OptimizerPlacement(_ValueEnum):
    """Where the optimizer step (fp32 masters, gradients and optimizer states) runs."""

    AUTO = "auto"
    """Without a device budget on the device; with one, on the host during the warm-up, then on the device for
    every family that fits the margin the warm-up trace measured at the step (the hybrid plan)."""
    HOST = "host"
    """Every family on the host, as ZeRO-Offload does: the device keeps only the compute-dtype parameters, and
    the step runs as a pipeline of gradient copies, host Adam and parameter copies (``optimizer_overlap``)."""
    DEVICE = "device"
    """Every family on the device; refused at setup, with the figures, where model data does not fit the device
    budget."""
    auto = "auto"  # alias, see [Note: enums in OmegaConf]
    host = "host"  # alias
    device = "device"  # alias


class OptimizerOverlap(_ValueEnum):
    """How the host-side optimizer step overlaps transfers and compute ([Note: the step pipeline] in
    :mod:`lightning_pstar.runtime.pipeline`). Every schedule gives bitwise the serial step's weights."""

    AUTO = "auto"
    """The fastest of "pipeline", "off" and (one rank, no compiled module) "next_forward" for this run, measured:
    after the warm-up and 8 more steps of "pipeline" (a short run keeps that one schedule), a few optimizer steps of
    each run, in turn, and the one with the lowest median time per step is kept ([Note: choosing the schedule] in
    :mod:`lightning_pstar.optim.overlap`; the choice is in the memory report). On a GPU that is a pipelined one;
    where the device's compute shares the host's cores (a CPU) it may be the serial step."""
    PIPELINE = "pipeline"
    """Gradient copies, host Adam and parameter copies of different families run at once on worker threads, and
    where nothing can read or change gradients between the backward and the step (Trainer, automatic
    optimization, no clipping, no fp16 loss scaling, no hook overridden between them) a family
    steps while the backward goes on, as soon as its gradients are final. The step is over when
    ``optimizer.step()`` returns."""
    OFF = "off"
    """The serial step: each family's gradients go to the host, Adam runs, the parameters come back, family
    after family, on the calling thread."""
    NEXT_FORWARD = "next_forward"
    """"pipeline", and ``optimizer.step()`` returns while the last families still step; the next forward runs
    meanwhile, each module waiting only for its own families. Every reader the engine sees (a module's forward,
    state dicts, checkpoints, evaluation, zero_grad, teardown) waits for all of them; a weight read outside its own
    module's forward on the training loop's thread (in ``training_step``, a callback, a parent module's forward)
    waits for its family's step first ([Note: a read that waits] in :mod:`lightning_pstar.runtime.parked`); a read
    from another thread raises an error that says so, instead of reading a half-updated weight. One rank, no
    compiled modules (elsewhere it runs as "pipeline")."""
    auto = "auto"  # alias, see [Note: enums in OmegaConf]
    pipeline = "pipeline"  # alias
    off = "off"  # alias
    next_forward = "next_forward"  # alias


class NonFinite(_ValueEnum):
    """What a step does when the loss or the gradients are not finite (inf or nan), in every precision. 16-mixed's
    loss scaling keeps its own rule for overflowing gradients (skip the step, lower the scale)."""

    RAISE = "raise"
    """The step is not applied (weights and optimizer states stay as they were) and an error names the step and
    the first parameters whose gradients were not finite: resume from the last checkpoint."""
    SKIP = "skip"
    """The step is not applied, and training goes on; skipped steps are counted in the memory report
    (``nonfinite_skipped_steps``) and the ``pstar/nonfinite_skipped_steps`` metric."""
    IGNORE = "ignore"
    """Plain Lightning's behaviour: the step is applied (the weights become non-finite)."""
    raise_ = "raise"  # alias, see [Note: enums in OmegaConf]
    skip = "skip"  # alias
    ignore = "ignore"  # alias


class CheckpointFormat(_ValueEnum):
    """How checkpoints are written."""

    CONSOLIDATED = "consolidated"
    """One ordinary Lightning file with the model's own names and torch's optimizer layout, gathered family
    by family to rank 0."""
    SHARDED = "sharded"
    """A directory in which every rank writes what it owns with torch.distributed.checkpoint; loads at any
    world size; ``python -m lightning_pstar.consolidate DIR OUT.ckpt`` turns it into one file."""
    consolidated = "consolidated"  # alias, see [Note: enums in OmegaConf]
    sharded = "sharded"  # alias


class HostMalloc(_ValueEnum):
    """What the C library does with host memory freed on a CPU run ([Note: host malloc] in
    :mod:`lightning_pstar.host_malloc`)."""

    CACHED = "cached"
    """On a CPU (the simulated device) glibc keeps freed memory for the process, as CUDA's caching allocator
    keeps device memory: no mmap below 32 MiB, no trimming of the heap below 1 GiB. Applied once per process
    when the engine is built on a CPU; nothing changes on a GPU run."""
    SYSTEM = "system"
    """The C library as the process has it."""
    cached = "cached"  # alias, see [Note: enums in OmegaConf]
    system = "system"  # alias
