"""The HELM leaderboard of a suite as a user sees it: helm-server on the suite, the
Leaderboard page in headless Chromium, saved as a PNG (the report embeds it).

    flexgen-helm leaderboard --suite demo     # helm-summarize, then this

The page is a JavaScript app that fetches the suite's JSON after loading: Chromium first
dumps the rendered page and every expected row name must be in it (else the screenshot
would show a spinner or an empty table, and this fails saying so), then takes the picture.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from flexgen_helm.errors import BrowserError

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
INSTALL_HINT = "install one (Debian: apt-get install -y chromium)"
SERVER_START_S = 120  # helm-server imports HELM before it listens: tens of seconds on a busy machine
RENDER_BUDGET_MS = 15_000  # Chromium's virtual time for the page to fetch and draw its tables
WIDTH = 2400  # wide enough for the leaderboard's nine columns (model, precision, 7 metrics)


def window_height(rows: int) -> int:
    """The page's header and the table's, then one line per row (at WIDTH no model name
    wraps; HELM pages do not scroll in a screenshot: the picture is the window)."""
    return 320 + 60 * rows


def find_browser() -> str | None:
    return next((path for path in map(shutil.which, BROWSERS) if path), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def helm_server(output_path: Path, suite: str):
    """helm-server serving `suite`, stopped on leaving; yields its base URL."""
    port = free_port()
    exe = shutil.which("helm-server")
    head = [exe] if exe else [sys.executable, "-m", "helm.benchmark.server"]
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([*head, "-o", str(output_path), "--suite", suite, "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_until_served(proc, f"{base}/benchmark_output/runs/{suite}/groups.json", log)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _wait_until_served(proc: subprocess.Popen, url: str, log) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise BrowserError(f"helm-server exited with {proc.returncode} before serving {url}:\n{log.read()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not listening yet
        time.sleep(0.5)
    raise BrowserError(f"helm-server did not serve {url} within {SERVER_START_S} s")


def _chromium(browser: str, height: int, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [browser, "--headless", "--disable-gpu", "--hide-scrollbars", f"--window-size={WIDTH},{height}",
           f"--virtual-time-budget={RENDER_BUDGET_MS}", *args]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.insert(1, "--no-sandbox")  # Chromium refuses to start its sandbox as root (containers)
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise BrowserError(f"{browser} did not finish within {timeout:.0f} s: {' '.join(cmd)}") from e


def leaderboard_screenshot(output_path: str | Path, suite: str, png: str | Path, expected_rows: list[str],
                           browser: str | None = None) -> Path:
    """Serve `suite` (already summarized), check that its Leaderboard page shows every name
    in `expected_rows`, and save the page to `png`."""
    browser = browser or find_browser()
    if browser is None:
        raise BrowserError(f"no Chromium on PATH (looked for {', '.join(BROWSERS)}); {INSTALL_HINT}")
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    png.unlink(missing_ok=True)  # never leave an earlier run's picture beside this run's report
    with helm_server(Path(output_path), suite) as base:
        url = f"{base}/#/leaderboard"
        height = window_height(len(expected_rows))
        dom = _chromium(browser, height, "--dump-dom", url)
        missing = [name for name in expected_rows if name not in dom.stdout]
        if dom.returncode != 0 or missing:
            raise BrowserError(f"the leaderboard at {url} did not render rows {missing} within "
                               f"{RENDER_BUDGET_MS / 1000:.0f} s of page time ({browser} exit {dom.returncode}: "
                               f"{dom.stderr.strip()[-500:]})")
        shot = _chromium(browser, height, f"--screenshot={png.resolve()}", url)
        if shot.returncode != 0 or not png.is_file():
            raise BrowserError(f"{browser} wrote no screenshot of {url} (exit {shot.returncode}): "
                               f"{shot.stderr.strip()[-500:]}")
    return png
