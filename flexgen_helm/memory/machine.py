"""A description of the machine a measurement ran on."""

from __future__ import annotations

import os
import platform

import torch

from flexgen_helm.memory.devices import cpu_has_bf16_arithmetic


def machine_info() -> dict:
    info = {
        "cpu": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_bf16_arithmetic": cpu_has_bf16_arithmetic(),
        "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_memory_bytes"] = props.total_memory
    return info


def machine_label(info: dict | None = None) -> str:
    """The machine in a few words, for benchmark rows: results from different hosts differ
    (this project's hosts have changed under it, from an AMX Xeon to an AVX2 EPYC)."""
    info = info or machine_info()
    bf16 = {True: "bf16 arithmetic", False: "no bf16 arithmetic"}.get(info.get("cpu_bf16_arithmetic"), "bf16 unknown")
    label = f"{info.get('cpu', 'unknown CPU')}, {info.get('cpu_cores', '?')} cores, {bf16}"
    return label + (f", {info['gpu']}" if info.get("gpu") else "")


def same_machine(a: dict, b: dict) -> bool:
    """Whether two machine_info records describe the same hardware (speeds can be reused)."""
    keys = ("cpu", "cpu_cores", "gpu")
    return all(a.get(k) == b.get(k) for k in keys)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
