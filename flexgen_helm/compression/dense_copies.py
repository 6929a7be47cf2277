"""The dense copies compressed weights hold, counted: bytes alive now and at peak.

A CompressedWeight dequantizes itself once per use of its layer (compression/int4.py) and
holds that copy until it is dropped (the layer's weights released; a mixture-of-experts
block's expert released after its rows, executor/expert_weights.py). The planner counts
these copies in the memory a block needs (planner/cost_model.py); this count is the
engine's side of that figure, which tests hold the planner to."""

from __future__ import annotations

import threading
import weakref


class DenseCopies:
    def __init__(self):
        self._lock = threading.Lock()
        self.current = 0
        self.peak = 0

    def track(self, owner, nbytes: int) -> None:
        """`owner` now holds a dense copy of `nbytes`, counted until it is garbage."""
        with self._lock:
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        weakref.finalize(owner, self._release, nbytes)

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self.current -= nbytes

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.current


# the process's count (every CompressedWeight's copy, whichever thread made it)
DENSE_COPIES = DenseCopies()
