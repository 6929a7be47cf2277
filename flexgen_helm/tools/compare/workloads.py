"""What every system in a comparison gets: the same model (dummy weights, one seed), the
same prompts and the same memory budgets.

Budgets follow the paper's tiers. On a CPU-only machine the "gpu" tier is the pool of host
RAM the compute device works in (the paper's 16 GB T4); "cpu" is the RAM that holds
offloaded weights (and, if a policy says so, KV cache); the disk has no limit.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from flexgen_helm.memory.devices import DTYPES
from flexgen_helm.planner.budget import parse_size
from flexgen_helm.planner.cost_model import CostModel, Workload
from flexgen_helm.planner.hardware_profile import HardwareProfile
from flexgen_helm.weights.convert import convert
from flexgen_helm.weights.export_hf import export_hf
from flexgen_helm.weights.registry import ResolvedModel, resolve, store_dir_for

GIB = 2**30


@dataclass(frozen=True)
class Setup:
    name: str  # folder name under runs/compare
    model: str
    prompt_len: int
    gen_len: int
    gpu_mem: str  # the compute device's pool (host RAM here): cache and activations of row-by-row systems
    cpu_mem: str  # RAM for offloaded weights (accelerate's max_memory={"cpu": ...})
    dtype: str = "bfloat16"  # compute and storage dtype of every system (bf16: fp16 matmuls are slow on CPUs)
    max_batch: int = 64  # the search's and the batch probes' upper bound (compute time on 2 cores)
    device: str = "cpu"  # the compute device every system runs on ("cuda": gpu_mem is the GPU's)

    @property
    def gpu_bytes(self) -> int:
        return parse_size(self.gpu_mem)

    @property
    def cpu_bytes(self) -> int:
        return parse_size(self.cpu_mem)

    def to_dict(self) -> dict:
        return asdict(self)


# The comparisons `flexgen-helm compare --setup NAME` knows. The headline is the issue's:
# OPT-6.7B with a 1.5 GiB device pool and 4 GiB of RAM for weights (the rest of its 12.5 GiB
# on disk). `max_batch` caps every system's block (sequences per block): on 2 CPU cores a
# 512-token prefill is ~8.6 s of matmuls per sequence (~6.9 TFLOP at ~0.8 TFLOP/s), so 32
# sequences are ~5 minutes of prefill; prompt 128 / gen 128 is the decode-heavy workload
# where reusing each weight read over a big block matters most (128 reads of the
# disk-resident weights per row). The device pools are the issue's.
SETUPS = {s.name: s for s in [
    Setup("opt-6.7b-p512-g32", "facebook/opt-6.7b", 512, 32, gpu_mem="1.5GiB", cpu_mem="4GiB", max_batch=32),
    Setup("opt-6.7b-p128-g128", "facebook/opt-6.7b", 128, 128, gpu_mem="1.5GiB", cpu_mem="4GiB", max_batch=128),
    Setup("opt-350m-p128-g128", "facebook/opt-350m", 128, 128, gpu_mem="0.25GiB", cpu_mem="0.2GiB", max_batch=64),
    Setup("opt-1.3b-p512-g32", "facebook/opt-1.3b", 512, 32, gpu_mem="1GiB", cpu_mem="0.75GiB", max_batch=16),
    # issue 49: OLMoE-1B-7B's geometry (6.9B parameters, 8 of 64 experts per token) under the
    # OPT-6.7B budgets
    Setup("olmoe-1b-7b-p512-g32", "allenai/olmoe-1b-7b-0924", 512, 32, gpu_mem="1.5GiB", cpu_mem="4GiB",
          max_batch=32),
    # issue 51, the paper's setting on a lent GPU: 16 GiB of it (the T4's), fp16, weights
    # beyond it in RAM (the paper's machine had 208 GB; the lent one 128 GiB)
    Setup("opt-6.7b-p512-g32-gpu16", "facebook/opt-6.7b", 512, 32, gpu_mem="16GiB", cpu_mem="64GiB",
          dtype="float16", max_batch=256, device="cuda"),
    Setup("opt-13b-p512-g32-gpu16", "facebook/opt-13b", 512, 32, gpu_mem="16GiB", cpu_mem="64GiB",
          dtype="float16", max_batch=256, device="cuda"),
    # the test's: seconds, not minutes
    Setup("tiny", "facebook/opt-125m", 8, 4, gpu_mem="256MiB", cpu_mem="160MiB", max_batch=4),
]}


# The rows a comparison can have, in table order; those after the first four are optional
# (not in the default). ours-4bit: the searched policy with 4-bit group-quantized weights
# (compression/int4.py); flexgen-reference(-4bit): FlexGen's own code on its published policy,
# GPU setups only (flexgen_reference.py).
SYSTEMS = ("hf-accelerate", "ours-deepspeed-policy", "ours-auto", "ours-4bit", "hf-accelerate-page-cache",
           "flexgen-reference", "flexgen-reference-4bit")
DEFAULT_SYSTEMS = SYSTEMS[:4]


def cost_model(setup: Setup, profile: HardwareProfile) -> CostModel:
    """The cost model of the setup's model and workload on `profile`, in the setup's dtype: the
    one the rows' predictions and our rows' budget check use (the search builds its own alike)."""
    cfg = resolve(setup.model, dummy=True).config
    return CostModel(cfg, profile, Workload(setup.prompt_len, setup.gen_len), DTYPES[setup.dtype])


def prompts(setup: Setup, batch: int, vocab_size: int) -> list[list[int]]:
    """The token ids every system gets: those `flexgen-helm bench` draws (seed 0)."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(10, vocab_size, (batch, setup.prompt_len), generator=g).tolist()


def work_dir() -> Path:
    """Big files of a comparison (our store, the HF export, accelerate's offload folder)."""
    return Path(os.environ.get("FLEXGEN_HELM_COMPARE_DIR", "/tmp/flexgen-helm-compare"))


def offload_dir(setup: Setup) -> Path:
    return work_dir() / "offload"


def prepare_store(setup: Setup) -> ResolvedModel:
    """Our dummy store, written once where the engine's disk tier will look for it."""
    resolved = resolve(setup.model, dummy=True)
    convert(resolved.source, store_dir_for(resolved, setup.dtype, cache_dir=offload_dir(setup)), setup.dtype)
    return resolved


def prepare_hf(setup: Setup, dtype: str | None = None) -> Path:
    """The same dummy weights as a Hugging Face checkpoint folder (written once)."""
    return dummy_checkpoint(setup.model, dtype or setup.dtype)


def dummy_checkpoint(model: str, dtype: str) -> Path:
    """`model`'s dummy weights as a Hugging Face checkpoint folder in `dtype` (written once)."""
    resolved = resolve(model, dummy=True)
    out = work_dir() / "hf" / f"{resolved.store_key}-{dtype}"
    if not (out / "config.json").exists():  # config.json is written last: its presence marks completion
        export_hf(resolved.source, out, DTYPES[dtype])
    return out
