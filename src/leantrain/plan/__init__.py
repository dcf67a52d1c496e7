"""The planner: FLOPs, budget, memory, timing, layout search, storage and checkpoint interval."""
