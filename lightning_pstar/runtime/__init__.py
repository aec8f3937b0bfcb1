"""The engine at run time: one object per file (states, chunks, residency, tracer, placement, sharding, hooks)."""
