"""llama.cpp's `llama-batched-bench`, built offline from the llama-cpp-python source archive
on PyPI (it vendors llama.cpp): the side-by-side baseline of `flexgen-helm compare-llamacpp`.

The build takes minutes of CPU, so it is done once into a folder outside the repository
and reused; it is never part of the tests or CI."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from flexgen_helm.errors import FlexGenError
from flexgen_helm.tools.compare.run import exit_status

TARGET = "llama-batched-bench"


def _run(cmd: list[str], cwd: Path) -> None:
    print("+", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=cwd)
    if done.returncode != 0:
        raise FlexGenError(f"building llama.cpp failed at `{' '.join(cmd)}` ({exit_status(done.returncode)}; "
                           "see the log above)")


def _source_archive(root: Path) -> Path:
    archives = sorted(root.glob("llama_cpp_python-*.tar.gz"))
    if not archives:
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              "llama-cpp-python", "-d", str(root)], root)
        archives = sorted(root.glob("llama_cpp_python-*.tar.gz"))
    if not archives:
        raise FlexGenError(f"pip download left no llama_cpp_python-*.tar.gz in {root}")
    return archives[-1]


# ggml's cmake options for the x86 extensions a build without AMX still compiles for, by the
# /proc/cpuinfo flag that says this CPU has each
_ISA_OPTIONS = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "bmi2": "GGML_BMI2", "fma": "GGML_FMA", "f16c": "GGML_F16C",
                "avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI", "avx512_vnni": "GGML_AVX512_VNNI",
                "avx512_bf16": "GGML_AVX512_BF16", "avx_vnni": "GGML_AVX_VNNI"}


def isa_args(amx: bool, cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """ggml's build options: native CPU code, as a user building it here would get; or, without
    AMX, each extension this CPU lists on (-march=native would compile ggml's AMX kernels in
    whatever options follow it, so the native build is off and the extensions are named)."""
    if amx:
        return ["-DGGML_NATIVE=ON"]
    flags = next((set(line.split(":", 1)[1].split()) for line in cpuinfo.read_text().splitlines()
                  if line.startswith("flags")), None)
    if flags is None:
        raise FlexGenError(f"{cpuinfo} lists no CPU flags: a llama.cpp build without AMX names this CPU's "
                           "extensions from them")
    return ["-DGGML_NATIVE=OFF", *(f"-D{option}={'ON' if flag in flags else 'OFF'}" for flag, option in
                                   _ISA_OPTIONS.items()),
            "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def batched_bench_binary(root: Path, jobs: int = 2, amx: bool = True) -> Path:
    """The built llama-batched-bench under `root` (building it first if it is not there); without
    AMX (amx=False) a build of its own beside it, root/build-no-amx."""
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise FlexGenError(f"building llama.cpp needs `{tool}` on PATH")
    root.mkdir(parents=True, exist_ok=True)
    archive = _source_archive(root)
    source = root / archive.name.removesuffix(".tar.gz")
    if not source.exists():
        _run(["tar", "xzf", archive.name], root)
    llama = source / "vendor" / "llama.cpp"
    build = root / ("build" if amx else "build-no-amx")
    binary = build / "bin" / TARGET
    if binary.exists():
        return binary
    if not (llama / "CMakeLists.txt").exists():
        raise FlexGenError(f"{archive.name} holds no vendored llama.cpp at {llama}")
    # no network features, static
    _run(["cmake", "-S", str(llama), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", *isa_args(amx),
          "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"], root)
    _run(["cmake", "--build", str(build), "--target", TARGET, "-j", str(jobs)], root)
    if not binary.exists():
        raise FlexGenError(f"the build finished but {binary} is not there")
    return binary
