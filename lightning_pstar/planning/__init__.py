"""Pure planning, shared by the engine and the capacity planner: what a model needs, layouts, capacity."""

from lightning_pstar.planning.capacity import (
    BytesPerElement,
    CapacityPlan,
    LargestModel,
    Scale,
    build_meta_model,
    bytes_per_element,
    main,
    min_device_bytes,
    plan_capacity,
)

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
