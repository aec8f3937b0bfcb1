"""Which precision this machine runs fast: bf16 units on the CPU or the GPU, or fp32.

bf16 matmuls are fast on a CPU only with bf16 instructions (x86: AVX512-BF16 or AMX; Arm: the ``bf16``
feature); elsewhere torch emulates them and a bf16-mixed step of the demo GPT is several times slower than a
32-true one (3.6x on an AVX512 CPU without AVX512-BF16, ``benchmarks/overhead.py --threads 1``). CUDA says for
itself (``torch.cuda.is_bf16_supported()``). No Lightning import here: the examples call this before they
build a Trainer, and the strategy calls :func:`warn_if_slow_bf16` from its setup.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "CPU_BF16_FLAGS",
    "PrecisionChoice",
    "SlowPrecisionWarning",
    "choose_precision",
    "cpu_has_bf16",
    "read_cpu_flags",
    "warn_if_slow_bf16",
]

CPUINFO = Path("/proc/cpuinfo")
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
"""``/proc/cpuinfo`` flags of CPUs with bf16 units: x86's AVX512-BF16 and AMX, Arm's ``bf16`` feature."""
_FAST = "bf16-mixed"
_SAFE = "32-true"


class SlowPrecisionWarning(UserWarning):
    """The precision asked for runs much slower on this machine than another one would."""


@dataclass(frozen=True, kw_only=True)
class PrecisionChoice:
    """The precision to train in and why, in words a user can check."""

    precision: str
    """A Lightning precision string: ``"bf16-mixed"`` or ``"32-true"`` when chosen, else what was asked."""
    reason: str
    """One line: what was detected (or that the value was given)."""

    def __str__(self) -> str:
        return f"precision: {self.precision} ({self.reason})"


def read_cpu_flags(path: Path | None = None) -> frozenset[str] | None:
    """The feature flags of the first CPU listed in ``/proc/cpuinfo``; None where there is no such file.

    x86 kernels list them on a ``flags`` line, Arm kernels on a ``Features`` line.
    """
    try:
        text = (path or CPUINFO).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in ("flags", "features"):
            return frozenset(value.split())
    return frozenset()


def cpu_has_bf16(flags: frozenset[str] | None = None) -> bool | None:
    """Whether the CPU has bf16 units (:data:`CPU_BF16_FLAGS`); None when that cannot be read (not Linux)."""
    if flags is None:
        flags = read_cpu_flags()
    if flags is None:
        return None
    return any(flag in flags for flag in CPU_BF16_FLAGS)


def _uses_cuda(accelerator: str) -> bool:
    # Lightning's "auto" picks a CUDA GPU when there is one; "gpu" means CUDA unless on a Mac (MPS)
    return accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()


def choose_precision(requested: str = "auto", accelerator: str = "auto") -> PrecisionChoice:
    """Resolve ``requested`` (``"auto"`` or a Lightning precision string) for ``accelerator``.

    ``"auto"`` is ``bf16-mixed`` where the device has bf16 units (a CUDA GPU with
    ``torch.cuda.is_bf16_supported()``; a CPU whose ``/proc/cpuinfo`` lists one of :data:`CPU_BF16_FLAGS`)
    and ``32-true`` everywhere else. Any other value is returned as it is.
    """
    requested = str(requested)
    if requested != "auto":
        return PrecisionChoice(precision=requested, reason="as configured")
    if _uses_cuda(accelerator):
        name = torch.cuda.get_device_name()
        if torch.cuda.is_bf16_supported():
            return PrecisionChoice(precision=_FAST, reason=f"auto: the GPU ({name}) has bf16 units")
        return PrecisionChoice(precision=_SAFE, reason=f"auto: the GPU ({name}) has no bf16 units")
    if accelerator not in ("auto", "cpu"):
        return PrecisionChoice(precision=_SAFE, reason=f"auto: no bf16 check for accelerator {accelerator!r}")
    flags = " / ".join(CPU_BF16_FLAGS)
    has_bf16 = cpu_has_bf16()
    if has_bf16:
        return PrecisionChoice(precision=_FAST, reason=f"auto: the CPU lists {flags} in {CPUINFO}: bf16 units")
    if has_bf16 is None:
        return PrecisionChoice(precision=_SAFE, reason=f"auto: no {CPUINFO} to tell whether the CPU has bf16 units")
    return PrecisionChoice(
        precision=_SAFE,
        reason=f"auto: the CPU has no bf16 units (none of {flags} in {CPUINFO}), so fp32 runs faster than bf16",
    )


def warn_if_slow_bf16(precision: str, device_type: str) -> bool:
    """Warn when ``bf16-mixed`` runs on a CPU without bf16 units; whether it warned.

    No warning when the CPU's flags cannot be read: it would be a guess.
    """
    if str(precision) != _FAST or device_type != "cpu" or cpu_has_bf16() is not False:
        return False
    warnings.warn(
        SlowPrecisionWarning(
            f"bf16-mixed on a CPU without bf16 units (none of {' / '.join(CPU_BF16_FLAGS)} in {CPUINFO}): torch"
            " emulates bf16 matmuls there, and a step can take several times as long as in 32-true."
            " HINT: train in precision='32-true' on this machine (16 bytes of model data per parameter instead"
            " of 14), or on a CPU with AVX512-BF16 or AMX, or on a GPU."
        ),
        stacklevel=2,
    )
    return True
