"""Our engine's rows: the searched policy and the DeepSpeed/Accelerate-style policy, each
run as a `flexgen-helm bench` in its own process, whose record includes the bytes the
process read from the disk during the timed generation (/proc/self/io), so the table can
say whether weights came from the disk or from the OS page cache."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from flexgen_helm.memory.devices import DTYPES
from flexgen_helm.planner.budget import planned_bytes
from flexgen_helm.policy.policy import Policy, Split
from flexgen_helm.tools.compare.workloads import Setup
from flexgen_helm.weights.registry import resolve


def fits_budgets(setup: Setup, policy: Policy) -> bool:
    cfg = resolve(setup.model, dummy=True).config
    planned = planned_bytes(cfg, policy, setup.prompt_len + setup.gen_len, DTYPES[setup.dtype])
    return planned["gpu"] <= setup.gpu_bytes and planned["cpu"] <= setup.cpu_bytes


def most_weights_in_ram(setup: Setup, policy: Policy, use_gpu: bool) -> Policy | None:
    """The policy with as many whole percents of the weights in RAM as the budgets allow (the
    gpu pool first when `use_gpu`, then the cpu tier); the rest on disk. None if nothing fits."""
    def with_weights(g: int, c: int) -> Policy:
        return replace(policy, weights=Split.from_percent(g, c))

    if not fits_budgets(setup, with_weights(0, 0)):
        return None
    g = _largest(lambda p: fits_budgets(setup, with_weights(p, 0)), 100) if use_gpu else 0
    c = _largest(lambda p: fits_budgets(setup, with_weights(g, p)), 100 - g)
    return with_weights(g, c)


def _largest(ok, hi: int) -> int:
    """The largest p in [0, hi] with ok(p), for ok monotone (true then false); ok(0) holds."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def deepspeed_policy(setup: Setup) -> Policy:
    """The paper's "w/ DeepSpeed policy": row by row (one GPU batch per block) with the GPU
    batch as large as fits, KV cache and activations on the compute device, weights offloaded
    (none resident on the device; CPU RAM up to its budget, the rest on disk)."""
    best = None
    for gbs in range(1, setup.max_batch + 1):
        shape = Policy(gpu_batch_size=gbs, num_gpu_batches=1, weights=Split(0, 0, 1),
                       cache=Split(1, 0, 0), activations=Split(1, 0, 0))
        p = most_weights_in_ram(setup, shape, use_gpu=False)
        if p is None:
            break
        best = p
    if best is None:
        raise ValueError(f"{setup.name}: not even one sequence's KV cache fits the gpu budget {setup.gpu_mem}")
    return best


def searched_policy(setup: Setup, max_block: int) -> Policy:
    """What `--policy auto` runs (planner/auto.py), with the effective batch capped at
    `max_block` (on 2 CPU cores the prefill of a block costs minutes per sequence, and each
    run must finish in ~10 minutes). A search that fails is an error with its reason: a
    comparison never quietly benchmarks some other policy in its place."""
    from flexgen_helm.planner.auto import search_for
    from flexgen_helm.planner.search import SearchOptions
    from flexgen_helm.tools.compare.workloads import offload_dir

    cfg = resolve(setup.model, dummy=True).config
    opts = SearchOptions(max_gpu_batch_size=max_block, max_num_gpu_batches=max_block)
    result = search_for(cfg, setup.prompt_len, setup.gen_len, {"gpu": setup.gpu_bytes, "cpu": setup.cpu_bytes},
                        opts, offload_dir=str(offload_dir(setup)))
    for cand in result.candidates:  # fastest first (by the cost model)
        if cand.policy.block_size <= max_block and fits_budgets(setup, cand.policy):
            return cand.policy
    raise ValueError(f"no searched candidate with a block of at most {max_block} passes our budget check")


def grid_policy(setup: Setup, max_block: int) -> Policy:
    """Blocks of up to `max_block` sequences; cache on the device pool, else in CPU RAM (with
    attention delegated to the CPU), else on disk; weights fill what RAM is left. Without a
    cost model to rank them, the largest block wins: it amortises each weight read over the
    most sequences, which is what the zig-zag schedule is for."""
    pow2 = [2**i for i in range(max_block.bit_length()) if 2**i <= max_block]
    cache_homes = [Split(1, 0, 0), Split(0, 1, 0), Split(0, 0, 1)]
    for block in sorted({g * n for g in pow2 for n in pow2 if g * n <= max_block}, reverse=True):
        for gbs in sorted({g for g in pow2 if block % g == 0}, reverse=True):
            for cache in cache_homes:
                shape = Policy(gpu_batch_size=gbs, num_gpu_batches=block // gbs, cache=cache,
                               activations=Split(1, 0, 0), cpu_cache_compute=cache.gpu == 0)
                p = most_weights_in_ram(setup, shape, use_gpu=True)
                if p is not None:
                    return p
    raise ValueError(f"{setup.name}: no grid policy fits the budgets")


def bench_flags(setup: Setup, policy: Policy, offload: Path, label: str, json_path: Path, warmup: int) -> list[str]:
    """`flexgen-helm bench` flags that run `policy` on the setup (with --policy FILE next to
    the JSON, so every field of the policy, not only those with flags, is the one run)."""
    policy_file = json_path.with_suffix(".policy.json")
    policy_file.parent.mkdir(parents=True, exist_ok=True)
    policy_file.write_text(policy.to_json())
    return ["bench", "--model", setup.model, "--dummy", "--dtype", setup.dtype, "--device", "cpu",
            "--prompt-len", str(setup.prompt_len), "--gen-len", str(setup.gen_len),
            "--gpu-mem", setup.gpu_mem, "--cpu-mem", setup.cpu_mem, "--offload-dir", str(offload),
            "--policy", str(policy_file), "--warmup", str(warmup), "--label", label, "--json", str(json_path)]
