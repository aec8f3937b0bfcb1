"""The bytes a run copies between tiers, counted by the chunks themselves (:class:`TransferStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_pstar.runtime.state import Tier

__all__ = ["TransferStats"]


@dataclass
class TransferStats:
    """Bytes copied between tiers, counted by the chunks themselves."""

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    evictions: int = 0  # param chunks moved off the device because the budget needed their room
    moves_off_device: int = 0  # every chunk move from the device to the host, for any reason
    prefetches: int = 0
    demand_fetches: int = 0  # param chunks a module found on the host and waited for (a stall)
    prefetch_lead_moments: int = 0  # moments between each prefetch and the moment it was for, summed
    prefetch_hits: int = 0  # prefetched param chunks that were on the device (or on their way) when used
    prefetches_wasted: int = 0  # prefetched param chunks evicted before their moment
    early_evictions: int = 0  # evictions the prefetch moved earlier to make room ([Note: fetch and prefetch])
    clean_moves: int = 0  # moves off the device that only freed the device storage (the host copy was current)
    clean_bytes: int = 0  # ... and the bytes those moves did not copy
    dirty_moves: int = 0  # moves off the device that copied the bytes back to the host
    moved_bytes: int = 0  # bytes copied by chunk moves, both directions (what placement decides)
    host_copy_bytes: int = 0  # host copies of device-resident chunks kept for clean evictions
    step_d2h_bytes: int = 0  # copied to the host by host-side optimizer steps that left the chunk on the device
    step_h2d_bytes: int = 0  # ... and copied back by them (runtime/pipeline.py)
    param_chunks_on_host: int = 0  # param chunks whose bytes are on the host now (what a prefetch could bring)
    # DISK gets its entry when a chunk first goes there ([Note: disk families] in disk_tier.py)
    per_tier_bytes: dict[Tier, int] = field(default_factory=lambda: {Tier.DEVICE: 0, Tier.HOST: 0})
    peak_device_bytes: int = 0

    def allocated(self, tier: Tier, nbytes: int) -> None:
        self.per_tier_bytes[tier] = self.per_tier_bytes.get(tier, 0) + nbytes
        if tier is Tier.DEVICE:
            self.peak_device_bytes = max(self.peak_device_bytes, self.per_tier_bytes[tier])

    def freed(self, tier: Tier, nbytes: int) -> None:
        self.per_tier_bytes[tier] -= nbytes
        assert self.per_tier_bytes[tier] >= 0, "tier byte counter went negative"
