"""Where evaluation data lives, and reading it (shared by `flexgen-helm eval` and the
HELM scenarios).

Lookup order: an explicit path; else FLEXGEN_HELM_DATA; else `../shared/data/` beside
the repository (or beside the working directory, for an installed package); else, when
online, the canonical copy on the Hugging Face hub through `datasets`. The project never
copies the data into its repository (see ../shared/data/README.md).
"""

from __future__ import annotations

import hashlib
import json
import os

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAMBADA_FILE = "lambada/lambada_openai_test.jsonl"
WIKITEXT_FILE = "wikitext-2-raw/wiki.test.raw"


def _candidate_dirs() -> list[str]:
    if os.environ.get("FLEXGEN_HELM_DATA"):
        return [os.environ["FLEXGEN_HELM_DATA"]]
    return [os.path.join(os.path.dirname(_REPO), "shared", "data"),
            os.path.join(os.path.dirname(os.getcwd()), "shared", "data")]


def data_dir() -> str:
    """The first candidate data folder that exists (else the first one, for messages)."""
    dirs = _candidate_dirs()
    return next((d for d in dirs if os.path.isdir(d)), dirs[0])


def local_file(relative: str, path: str | None = None) -> str | None:
    """`path` if given (a file, or a data folder holding `relative`; must exist), else
    data_dir()/relative if it exists, else None."""
    if path:
        if os.path.isdir(path) and os.path.isfile(os.path.join(path, relative)):
            return os.path.join(path, relative)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} does not exist (expected the file {os.path.basename(relative)} "
                                    f"or a data folder holding {relative})")
        return path
    candidate = os.path.join(data_dir(), relative)
    return candidate if os.path.isfile(candidate) else None


def offline() -> bool:
    return any(os.environ.get(v, "") not in ("", "0", "false", "False")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "FLEXGEN_HELM_OFFLINE"))


def missing(what: str, relative: str, hint: str, why_no_download: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"{what}: no local file at {os.path.join(data_dir(), relative)} (set FLEXGEN_HELM_DATA to the folder "
        f"that holds {relative}, or {hint}), and the download fallback is unavailable: {why_no_download}"
    )


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _from_hub(what: str, relative: str, hint: str, repo: str, config: str) -> list[str]:
    if offline():
        raise missing(what, relative, hint, "offline (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE or FLEXGEN_HELM_OFFLINE)")
    try:
        import datasets
    except ImportError as exc:
        raise missing(what, relative, hint, f"the `datasets` library does not import ({exc})") from exc
    try:
        return list(datasets.load_dataset(repo, config, split="test")["text"])
    except OSError as exc:  # the hub's errors: connection, HTTP, offline mode, dataset not found
        raise missing(what, relative, hint, f"{repo} could not be loaded ({type(exc).__name__}: {exc})") from exc


def read_lambada(path: str | None = None, hint: str = "pass --data PATH") -> tuple[list[str], dict]:
    """The passages, and where they came from ({"path", "sha256"})."""
    local = local_file(LAMBADA_FILE, path)
    if local:
        with open(local, encoding="utf-8") as f:
            texts = [json.loads(line)["text"] for line in f if line.strip()]
        return texts, {"path": os.path.realpath(local), "sha256": sha256_of(local)}
    texts = _from_hub("LAMBADA", LAMBADA_FILE, hint, "EleutherAI/lambada_openai", "default")
    digest = hashlib.sha256("\n".join(texts).encode()).hexdigest()
    return texts, {"path": "hf:EleutherAI/lambada_openai (test)", "sha256": digest, "sha256_of": "joined texts"}


def read_wikitext(path: str | None = None, hint: str = "pass --data PATH") -> tuple[list[str], dict]:
    """The non-empty lines of the test split without their line ends (the official file
    ends lines with CRLF and separates paragraphs by blank lines), and their source."""
    local = local_file(WIKITEXT_FILE, path)
    if local:
        with open(local, encoding="utf-8", newline="") as f:
            lines = f.read().replace("\r\n", "\n").split("\n")
        source = {"path": os.path.realpath(local), "sha256": sha256_of(local)}
    else:
        lines = _from_hub("WikiText-2", WIKITEXT_FILE, hint, "Salesforce/wikitext", "wikitext-2-raw-v1")
        source = {"path": "hf:Salesforce/wikitext wikitext-2-raw-v1 (test)",
                  "sha256": hashlib.sha256("\n".join(lines).encode()).hexdigest(), "sha256_of": "joined lines"}
    return [line.rstrip("\n") for line in lines if line.strip()], source
