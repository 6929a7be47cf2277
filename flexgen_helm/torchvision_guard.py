"""Keep a torchvision built for another torch from breaking transformers.

transformers imports torchvision whenever it is installed, and a torchvision built for
another torch (the CUDA wheel that crfm-helm pulls in, beside a CPU torch) fails at
import and takes every model config class down with it. Text models never need it, so a
broken one is hidden: `sys.modules["torchvision"] = None` makes find_spec() report it
absent. Either guard must run before transformers first checks for torchvision.
"""

from __future__ import annotations

import logging
import sys
from importlib import metadata


def hide_broken_torchvision() -> None:
    """Tries the import (which loads torch) and hides torchvision if it fails."""
    if "torchvision" not in sys.modules:
        try:
            import torchvision  # noqa: F401
        # what a torchvision built for another torch raises: a missing operator (RuntimeError),
        # an undefined symbol or library (ImportError, OSError), a half-initialised module
        except (ImportError, OSError, RuntimeError, AttributeError) as exc:
            sys.modules["torchvision"] = None
            logging.getLogger(__name__).warning("torchvision hidden: its import fails (%s: %s)",
                                                type(exc).__name__, exc)


def hide_mismatched_torchvision() -> bool:
    """The cheap guard, for start-up paths that must not import torch (our HELM plugin, so
    that HELM's own HuggingFaceClient works in this install too): wheels of one build share
    a local version label ("2.13.0+cpu" goes with "0.28.0+cpu"), so a torchvision whose
    label differs from torch's was built for another torch. Returns whether it hid one."""
    if "torchvision" in sys.modules:
        return False
    try:
        torch_label = metadata.version("torch").partition("+")[2]
        vision_label = metadata.version("torchvision").partition("+")[2]
    except metadata.PackageNotFoundError:
        return False
    if torch_label == vision_label:
        return False
    sys.modules["torchvision"] = None
    return True
