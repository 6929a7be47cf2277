"""`flexgen-helm compare-llamacpp`'s own behaviour, without llama.cpp: how a build is configured
and what a run that dies says."""

from __future__ import annotations

import sys

import pytest

from flexgen_helm.errors import FlexGenError
from flexgen_helm.tools.compare.llamacpp import run_llamacpp
from flexgen_helm.tools.compare.llamacpp_build import isa_args
from flexgen_helm.tools.compare.run import CommandFailed, exit_status, run_logged

DIES_BY_SIGILL = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"]


def test_a_command_killed_by_a_signal_is_named_by_it():
    assert exit_status(3) == "exit 3"
    assert exit_status(-4) == "killed by SIGILL"
    with pytest.raises(CommandFailed, match="failed \\(killed by SIGILL\\)") as failed:
        run_logged(DIES_BY_SIGILL, timeout_s=60)
    assert failed.value.returncode == -4


def test_llamacpp_dying_on_an_illegal_instruction_points_to_a_build_without_amx():
    with pytest.raises(FlexGenError, match="run again with --no-amx"):
        run_llamacpp(DIES_BY_SIGILL, 60, amx=True)
    with pytest.raises(CommandFailed) as failed:  # a build without AMX has nothing more to suggest
        run_llamacpp(DIES_BY_SIGILL, 60, amx=False)
    assert "--no-amx" not in str(failed.value)


def test_a_build_without_amx_names_the_cpus_other_extensions(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx avx2 fma f16c bmi2 avx512f avx512_vnni amx_tile amx_int8\n")
    assert isa_args(True, cpuinfo) == ["-DGGML_NATIVE=ON"]
    args = isa_args(False, cpuinfo)
    assert "-DGGML_NATIVE=OFF" in args
    assert {"-DGGML_AVX2=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=OFF",
            "-DGGML_AVX512_VBMI=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(args)
    cpuinfo.write_text("processor\t: 0\n")
    with pytest.raises(FlexGenError, match="lists no CPU flags"):
        isa_args(False, cpuinfo)
