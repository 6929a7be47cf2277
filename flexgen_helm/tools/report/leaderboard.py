"""A suite's HELM leaderboard: helm-summarize with the plugin's schema, then (where
Chromium is installed) a screenshot of helm-server's Leaderboard page beside the report,
and the report's section about both.

    flexgen-helm leaderboard --suite demo     # benchmark_output/runs/demo -> runs/demo/helm_leaderboard.png
    helm-server --suite demo                  # the same page, live
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from flexgen_helm.errors import FlexGenError
from flexgen_helm.helm.schema import LEADERBOARD_GROUP, summarize_command
from flexgen_helm.tools.report.screenshot import INSTALL_HINT, find_browser, leaderboard_screenshot

PNG_NAME = "helm_leaderboard.png"


def groups_json(suite_dir: Path) -> Path:
    """The leaderboard's table as helm-summarize writes it."""
    return suite_dir / "groups" / f"{LEADERBOARD_GROUP}.json"


def summarize(output_path: str | Path, suite: str) -> Path:
    cmd = summarize_command(suite, str(output_path))
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return groups_json(Path(output_path) / "runs" / suite)


def row_names(table_json: Path) -> list[str]:
    """The leaderboard's row names (one per deployment)."""
    tables = json.loads(table_json.read_text()) if table_json.is_file() else []
    return [str(row[0]["value"]) for table in tables for row in table["rows"]]


def make_leaderboard(output_path: str | Path, suite: str, out: str | Path) -> Path | None:
    """Summarize `suite`, then save its leaderboard page as <out>/helm_leaderboard.png; None
    (with the reason printed) where there is no Chromium."""
    suite_dir = Path(output_path) / "runs" / suite
    if not suite_dir.is_dir():
        raise FlexGenError(f"no HELM suite at {suite_dir.resolve()}: run helm-run with --suite {suite} "
                           f"-o {output_path} first")
    rows = row_names(summarize(output_path, suite))
    if not rows:
        raise FlexGenError(f"helm-summarize put no deployment in the leaderboard ({groups_json(suite_dir)}): the "
                           "suite has no run of its scenarios (lambada, wikitext, synthetic_reasoning "
                           "pattern_match)")
    browser = find_browser()
    if browser is None:
        print(f"leaderboard screenshot skipped: no Chromium on PATH; {INSTALL_HINT}, then "
              f"`flexgen-helm leaderboard --suite {suite}`", flush=True)
        return None
    png = leaderboard_screenshot(output_path, suite, Path(out) / PNG_NAME, rows, browser=browser)
    print(f"leaderboard screenshot: {png} ({len(rows)} rows)")
    return png


def leaderboard_section(suite_dir: Path, out: Path) -> list[str]:
    """The report's section: the screenshot if it is of this summary, else what makes one."""
    md = ["## HELM leaderboard (helm-server)\n"]
    summary, png = groups_json(suite_dir), out / PNG_NAME
    serve = f"`helm-server --suite {suite_dir.name} -o {suite_dir.parent.parent}`"
    if not summary.is_file():
        return md + [f"Not summarized with the plugin's schema: `flexgen-helm leaderboard --suite {suite_dir.name}`, "
                     f"then {serve}.\n"]
    md.append(f"HELM's own web UI on this suite ({serve}, page Leaderboard): one row per deployment, "
              f"{len(row_names(summary))} here; the table is `{summary}`.\n")
    if png.is_file() and png.stat().st_mtime >= summary.stat().st_mtime:
        md.append(f"![HELM leaderboard of suite {suite_dir.name}]({PNG_NAME})\n")
    else:
        md.append(f"No screenshot of this summary: it needs Chromium ({INSTALL_HINT}), then "
                  f"`flexgen-helm leaderboard --suite {suite_dir.name}`.\n")
    return md
