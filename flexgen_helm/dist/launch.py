"""Which engine a command runs: the single-process Engine, or one pipeline stage of the
processes torchrun started (`--pipeline`)."""

from __future__ import annotations


def engine_class(pipeline: bool):
    if pipeline:
        from flexgen_helm.dist.pipeline import PipelineEngine

        return PipelineEngine
    from flexgen_helm.engine import Engine

    return Engine


def is_reporting_rank(engine) -> bool:
    """Under a pipeline every rank holds the results; only the first one prints them."""
    return getattr(engine, "rank", 0) == 0
