"""Our engine's rows: the DeepSpeed/Accelerate-style policy (row by row), the searched policy
(`--policy auto`) and the searched policy with 4-bit weights, each run as a
`flexgen-helm bench` in its own process, whose record includes the bytes the process read
from the disk during the timed generation (/proc/self/io), so the table can say whether
weights came from the disk or from the OS page cache."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from flexgen_helm.memory.devices import DTYPES
from flexgen_helm.planner.auto import search_for
from flexgen_helm.planner.hardware_profile import HardwareProfile
from flexgen_helm.planner.search import SearchOptions, SearchResult, default_budgets, fits
from flexgen_helm.policy.policy import Compression, Policy, Split
from flexgen_helm.tools.compare.workloads import Setup, cost_model, offload_dir
from flexgen_helm.weights.registry import resolve

FOUR_BIT = Compression(bits=4, group_size=64)


class BudgetCheck:
    """Whether a policy fits the setup's budgets by the accounting `--policy auto` uses (the
    cost model's peak bytes per tier, loaded weights and working set included, and on a
    CPU-only machine the process's own memory), so every one of our rows is held to the same
    budgets: a fixed policy sized by its stored bytes alone ran at 2.95 GiB RSS under 1 GiB +
    0.75 GiB budgets (runs/compare/opt-1.3b-p512-g32 as run at commit 7ba1ff1, before this check)."""

    def __init__(self, setup: Setup, profile: HardwareProfile):
        self.model = cost_model(setup, profile)
        self.budgets = default_budgets(profile, setup.gpu_bytes, setup.cpu_bytes)

    def __call__(self, policy: Policy) -> bool:
        return fits(self.model.estimate(policy), self.budgets)


def most_weights_in_ram(fits_budgets: BudgetCheck, policy: Policy, use_gpu: bool) -> Policy | None:
    """The policy with as many whole percents of the weights in RAM as the budgets allow (the
    gpu pool first when `use_gpu`, then the cpu tier); the rest on disk. None if nothing fits."""
    def with_weights(g: int, c: int) -> Policy:
        return replace(policy, weights=Split.from_percent(g, c))

    if not fits_budgets(with_weights(0, 0)):
        return None
    g = _largest(lambda p: fits_budgets(with_weights(p, 0)), 100) if use_gpu else 0
    # all the rest in RAM first: a split between RAM and disk stages both ways onto the device,
    # so near the device budget the fit is not monotone in the RAM share (OPT-6.7B, 16 GiB GPU,
    # 36 rows: all in RAM or all on disk fit, half and half does not), and a bisection from
    # the middle put every weight on the disk (runs/gpu/h100-2026-11-26)
    c = 100 - g if fits_budgets(with_weights(g, 100 - g)) else _largest(lambda p: fits_budgets(with_weights(g, p)),
                                                                           100 - g)
    return with_weights(g, c)


def _largest(ok, hi: int) -> int:
    """The largest p in [0, hi] with ok(p), for ok monotone (true then false); ok(0) holds."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def deepspeed_policy(setup: Setup, profile: HardwareProfile) -> Policy:
    """The paper's "w/ DeepSpeed policy": row by row (one GPU batch per block) with the GPU
    batch as large as fits, KV cache and activations on the compute device, weights offloaded
    (none resident on the device; CPU RAM up to its budget, the rest on disk)."""
    fits_budgets = BudgetCheck(setup, profile)
    best = None
    for gbs in range(1, setup.max_batch + 1):
        shape = Policy(gpu_batch_size=gbs, num_gpu_batches=1, weights=Split(0, 0, 1),
                       cache=Split(1, 0, 0), activations=Split(1, 0, 0))
        p = most_weights_in_ram(fits_budgets, shape, use_gpu=False)
        if p is None:
            break
        best = p
    if best is None:
        raise ValueError(f"{setup.name}: not even one sequence fits the budgets ({setup.gpu_mem} device, "
                         f"{setup.cpu_mem} cpu) row by row, with its KV cache and activations on the device")
    return best


def searched(setup: Setup, profile: HardwareProfile, compress_weight: Compression | None = None) -> SearchResult:
    """What `--policy auto` runs (planner/auto.py) under the setup's budgets, with blocks of at
    most `setup.max_batch` sequences (the run's time). A search that fails raises its error
    (PolicyError: which tier is short, by how much): a comparison never benchmarks some other
    policy in its place."""
    cfg = resolve(setup.model, dummy=True).config
    opts = SearchOptions(compress_weight=compress_weight, max_block_size=setup.max_batch,
                         max_gpu_batch_size=min(64, setup.max_batch), max_num_gpu_batches=setup.max_batch)
    return search_for(cfg, setup.prompt_len, setup.gen_len, {"gpu": setup.gpu_bytes, "cpu": setup.cpu_bytes},
                      opts, offload_dir=str(offload_dir(setup)), profile=profile, dtype=DTYPES[setup.dtype])


def bench_flags(setup: Setup, policy: Policy, offload: Path, label: str, json_path: Path, warmup: int) -> list[str]:
    """`flexgen-helm bench` flags that run `policy` on the setup (with --policy FILE next to
    the JSON, so every field of the policy, not only those with flags, is the one run)."""
    policy_file = json_path.with_suffix(".policy.json")
    policy_file.parent.mkdir(parents=True, exist_ok=True)
    policy_file.write_text(policy.to_json())
    return ["bench", "--model", setup.model, "--dummy", "--dtype", setup.dtype, "--device", setup.device,
            "--prompt-len", str(setup.prompt_len), "--gen-len", str(setup.gen_len),
            "--gpu-mem", setup.gpu_mem, "--cpu-mem", setup.cpu_mem, "--offload-dir", str(offload),
            "--policy", str(policy_file), "--warmup", str(warmup), "--label", label, "--json", str(json_path)]
