"""The engine's host-allocator setting: applied on glibc, and off when the user says so."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

CHECK = "from flexgen_helm.memory.host_allocator import keep_freed_host_memory as k; print(k())"


def _run(env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "FLEXGEN_HELM_KEEP_FREED_MEMORY"}
    if env_value is not None:
        env["FLEXGEN_HELM_KEEP_FREED_MEMORY"] = env_value
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a glibc setting")
def test_applied_on_glibc():
    assert _run(None) == "True"


def test_off_when_asked():
    assert _run("0") == "False"
