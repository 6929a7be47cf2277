"""The folder that holds the disk tier's files (offloaded weights, KV cache, activations)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def default_offload_dir() -> Path:
    """$FLEXGEN_HELM_OFFLOAD, else a folder in the system's temporary directory."""
    return Path(os.environ.get("FLEXGEN_HELM_OFFLOAD", Path(tempfile.gettempdir()) / "flexgen-helm-offload"))
