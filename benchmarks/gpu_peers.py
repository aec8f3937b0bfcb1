"""The peers of benchmarks/gpu_check.py and compare.py: the demo GPT under FSDP2 (with or without
``CPUOffloadPolicy``) and under DeepSpeed's ZeRO-3 offload (``DeepSpeedCPUAdam``)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from typing_extensions import override

from lightning_pstar.demos import GPT, GPTLightningModule
from lightning_pstar.demos.module import param_groups

__all__ = ["DeepSpeedGPTModule", "FSDPGPTModule", "FSDPStrategy"]


class FSDPGPTModule(GPTLightningModule):
    """The demo GPT under FSDP2: ``fully_shard`` on every block and on the root, built on the meta device and
    materialised into its shards (on the host when offloading, so the full model never exists anywhere)."""

    def __init__(self, *, offload: bool, param_dtype: torch.dtype | None, **kwargs: Any) -> None:
        super().__init__(**kwargs, meta_init=True)  # the GPT is built in configure_model, never in __init__
        self.offload = offload
        self.param_dtype = param_dtype

    @override
    def configure_model(self) -> None:
        if self.model is not None:
            return
        mesh = self.device_mesh
        assert mesh is not None, "ModelParallelStrategy sets the device mesh before configure_model"
        with torch.device("meta"):
            model = GPT(self.gpt_config)
        options: dict[str, Any] = {"mesh": mesh["data_parallel"]}
        device = self.trainer.strategy.root_device
        if self.param_dtype is not None:
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32)
        if self.offload:
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        for block in model.h:
            fully_shard(block, **options)
        fully_shard(model, **options)
        model.to_empty(device="cpu" if self.offload else device)
        with torch.no_grad():
            for module in model.modules():
                if next(module.parameters(recurse=False), None) is not None:
                    module.reset_parameters()  # type: ignore[operator]
        self.model = model


class FSDPStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` that leaves CPU-offloaded shards on the host (its ``model_to_device`` would
    move every parameter to the accelerator)."""

    def __init__(self, *, offload: bool, data_parallel_size: int) -> None:
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=1)
        self.offload = offload

    @override
    def model_to_device(self) -> None:
        if not self.offload:
            super().model_to_device()


class DeepSpeedGPTModule(GPTLightningModule):
    """The demo GPT with DeepSpeed's CPU Adam, which ZeRO-Offload steps on the host."""

    @override
    def configure_optimizers(self) -> Any:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(param_groups(self.gpt, self.weight_decay), lr=self.lr, betas=self.betas)
