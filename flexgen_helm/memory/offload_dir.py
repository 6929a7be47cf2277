"""The folder that holds the disk tier's files (offloaded weights, KV cache, activations)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from flexgen_helm.errors import OffloadDirError
from flexgen_helm.memory.folders import unusable_reason


def default_offload_dir() -> Path:
    """$FLEXGEN_HELM_OFFLOAD, else a folder in the system's temporary directory."""
    return Path(os.environ.get("FLEXGEN_HELM_OFFLOAD", Path(tempfile.gettempdir()) / "flexgen-helm-offload"))


def usable_offload_dir(path: str | os.PathLike | None = None) -> Path:
    """The offload folder (`path`, else the default), created: one that cannot be created or
    written is an error now, before a model is loaded, not when its first file is."""
    out = Path(path) if path else default_offload_dir()
    reason = unusable_reason(out)
    if reason is not None:
        raise OffloadDirError(f"offload directory {out} is not usable: {reason}")
    return out
