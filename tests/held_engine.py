"""The real engine, held still before its second batch, for tests that kill a job mid-run.

Selected with FLEXGEN_HELM_ENGINE_FACTORY=held_engine:load. With FLEXGEN_TEST_HOLD=<folder>,
the engine's second call (the first batch is then in HELM's cache: the client publishes each
batch before the next starts) creates <folder>/held and waits until <folder>/release exists
(at most HOLD_S), then goes on; without it, every call goes straight to the engine. A tiny
model runs a batch in milliseconds: this gives a kill a fixed place to land, the batch
after a finished one.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

HOLD_S = 300


class HeldEngine:
    def __init__(self, engine, hold: str | None):
        self._engine = engine
        self._hold = Path(hold) if hold else None
        self._calls = 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def _enter(self) -> None:
        self._calls += 1
        if self._hold is None or self._calls != 2:
            return
        (self._hold / "held").touch()
        deadline = time.monotonic() + HOLD_S
        while not (self._hold / "release").exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"held engine: neither killed nor released within {HOLD_S} s")
            time.sleep(0.1)

    def generate(self, *args, **kwargs):
        self._enter()
        return self._engine.generate(*args, **kwargs)

    def score(self, *args, **kwargs):
        self._enter()
        return self._engine.score(*args, **kwargs)


def load(model, policy=None, **kwargs):
    from flexgen_helm.engine import Engine

    return HeldEngine(Engine.load(model, policy=policy, **kwargs), os.environ.get("FLEXGEN_TEST_HOLD"))
