"""Folders a run writes into, made ready before any work starts."""

from __future__ import annotations

import os
from pathlib import Path


def unusable_reason(folder: Path) -> str | None:
    """Create `folder` (and its parents); None when it is ready to be written in, else why
    it is not. Callers turn the reason into their own error, naming what the folder is for."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return str(e)
    if not os.access(folder, os.W_OK | os.X_OK):
        return "no permission to write in it"
    return None
