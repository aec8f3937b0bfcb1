"""Pure planning, shared by the engine and the capacity planner: what a model needs, layouts, capacity.

``requirements`` (what a model needs: the functions the engine and the planner both call), ``layout`` (chunk
layouts and the chunk-size search), ``models`` (meta-device builds of what the planner prices), ``capacity``
(the plan; ``capacity_plan`` its figures and how they read), ``largest`` (the largest GPT that fits), ``cli``
(``python -m lightning_pstar.plan``).
"""

from lightning_pstar.planning.capacity import bytes_per_element, plan_capacity
from lightning_pstar.planning.capacity_plan import CapacityPlan
from lightning_pstar.planning.cli import main
from lightning_pstar.planning.largest import LargestModel, Scale
from lightning_pstar.planning.models import build_meta_model
from lightning_pstar.planning.requirements import BytesPerElement, min_device_bytes

__all__ = [
    "BytesPerElement",
    "CapacityPlan",
    "LargestModel",
    "Scale",
    "build_meta_model",
    "bytes_per_element",
    "main",
    "min_device_bytes",
    "plan_capacity",
]
