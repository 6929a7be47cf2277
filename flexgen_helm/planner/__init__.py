"""Choosing a policy: the hardware profile (measured speeds), the cost model, memory budgets,
and the linear-programming search behind --policy auto. Layer: beside the engine (both
below the frontends); reads the executor's sizes, never runs the engine."""
