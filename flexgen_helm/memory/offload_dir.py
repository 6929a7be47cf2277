"""The folder that holds the disk tier's files (offloaded weights, KV cache, activations)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from flexgen_helm.errors import OffloadDirError


def default_offload_dir() -> Path:
    """$FLEXGEN_HELM_OFFLOAD, else a folder in the system's temporary directory."""
    return Path(os.environ.get("FLEXGEN_HELM_OFFLOAD", Path(tempfile.gettempdir()) / "flexgen-helm-offload"))


def usable_offload_dir(path: str | os.PathLike | None = None) -> Path:
    """The offload folder (`path`, else the default), created: one that cannot be created or
    written is an error now, before a model is loaded, not when its first file is."""
    out = Path(path) if path else default_offload_dir()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OffloadDirError(f"offload directory {out} is not usable: {e}") from e
    if not os.access(out, os.W_OK | os.X_OK):
        raise OffloadDirError(f"offload directory {out} is not usable: no permission to write in it")
    return out
