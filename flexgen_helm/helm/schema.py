"""The plugin's HELM schema and the helm-summarize command that uses it (no HELM import:
tools call this before any HELM work).

    python -m flexgen_helm.helm.schema       # prints SCHEMA_PATH, for --schema-path
"""

from __future__ import annotations

import os
import shutil
import sys

SCHEMA_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "schema_flexgen.yaml")
LEADERBOARD_GROUP = "flexgen"  # the schema's first run group: helm-server's Leaderboard page opens on it
ONE_TABLE_CATEGORY = "Leaderboard"  # run groups of this category are drawn as one table (summarizer.py)
SUMMARIZER_CLASS = "flexgen_helm.helm.summarizer.FlexGenSummarizer"


def summarize_command(suite: str, output_path: str) -> list[str]:
    """helm-summarize of `suite` with our schema and summarizer (see summarizer.py); the
    schema is validated strictly, so that a mistake in it fails here, not in the browser.

    One thread: HELM's summarizer compiles mako templates in each of its threads, and CPython
    3.11.7 (this machine's) can fail compiling in two threads at once ("SystemError: AST
    constructor recursion depth mismatch", cpython gh-106905, fixed in later releases; it ended
    one main job here); a demo suite takes a second or two either way."""
    exe = shutil.which("helm-summarize")
    head = [exe] if exe else [sys.executable, "-m", "helm.benchmark.presentation.summarize"]
    return head + ["--suite", suite, "-o", str(output_path), "--schema-path", SCHEMA_PATH,
                   "--schema-validation", "error", "--summarizer-class-name", SUMMARIZER_CLASS,
                   "--num-threads", "1"]


if __name__ == "__main__":
    print(SCHEMA_PATH)
