"""Where local evaluation data lives.

Default: `../shared/data/` beside the repository (the project's shared data folder);
FLEXGEN_HELM_DATA overrides it. A missing file is reported with both, fast.
"""

from __future__ import annotations

import os

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def data_dir() -> str:
    return os.environ.get("FLEXGEN_HELM_DATA") or os.path.join(os.path.dirname(_REPO), "shared", "data")


def local_file(relative: str, path: str | None = None) -> str | None:
    """`path` if given (must exist), else data_dir()/relative if it exists, else None."""
    if path:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} does not exist")
        return path
    candidate = os.path.join(data_dir(), relative)
    return candidate if os.path.isfile(candidate) else None


def offline() -> bool:
    return any(os.environ.get(v, "") not in ("", "0", "false", "False")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "FLEXGEN_HELM_OFFLINE"))


def missing(what: str, relative: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"{what}: no local file at {os.path.join(data_dir(), relative)} (set FLEXGEN_HELM_DATA to the folder "
        f"that holds {relative}, or pass path=... in the run entry), and the download fallback is unavailable "
        f"(offline, or the `datasets` library could not reach the hub)"
    )
