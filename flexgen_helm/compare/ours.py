"""Our engine's rows: the searched policy and the DeepSpeed/Accelerate-style policy, each
run as a `flexgen-helm bench` in its own process (`python -m flexgen_helm.compare.ours
bench ...` takes exactly bench's flags), which also records how many bytes the process
actually read from the disk during the timed generation (/proc/self/io), so the table can
say whether weights came from the disk or from the OS page cache."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

from flexgen_helm.compare.workloads import Setup
from flexgen_helm.memory.budget import planned_bytes
from flexgen_helm.models.registry import resolve
from flexgen_helm.policy.policy import Policy, Split


def _fits(setup: Setup, policy: Policy) -> bool:
    cfg = resolve(setup.model, dummy=True).config
    planned = planned_bytes(cfg, policy, setup.prompt_len + setup.gen_len, getattr(torch, setup.dtype))
    return planned["gpu"] <= setup.gpu_bytes and planned["cpu"] <= setup.cpu_bytes


def _most_weights_in_ram(setup: Setup, policy: Policy, use_gpu: bool) -> Policy | None:
    """The policy with as many whole percents of the weights in RAM as the budgets allow (the
    gpu pool first when `use_gpu`, then the cpu tier); the rest on disk. None if nothing fits."""
    def with_weights(g: int, c: int) -> Policy:
        return replace(policy, weights=Split.from_percent(g, c))

    if not _fits(setup, with_weights(0, 0)):
        return None
    g = _largest(lambda p: _fits(setup, with_weights(p, 0)), 100) if use_gpu else 0
    c = _largest(lambda p: _fits(setup, with_weights(g, p)), 100 - g)
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
        p = _most_weights_in_ram(setup, shape, use_gpu=False)
        if p is None:
            break
        best = p
    if best is None:
        raise ValueError(f"{setup.name}: not even one sequence's KV cache fits the gpu budget {setup.gpu_mem}")
    return best


def searched_policy(setup: Setup, max_block: int) -> tuple[Policy, str]:
    """Our best policy under the budgets, and how it was found: the policy search
    (flexgen_helm/policy/search.py, the `--policy auto` path) when it is importable and its
    choice fits our own budget check, else the best of a small grid ("grid" in the label).
    `max_block` caps the effective batch: on 2 CPU cores the prefill of a block costs minutes
    per sequence, and each run must finish in ~10 minutes."""
    try:
        return _search(setup, max_block), "searched (--policy auto's search)"
    except Exception as e:  # the search is being written concurrently: say why it was not used
        print(f"policy search unavailable ({type(e).__name__}: {e}); using the grid", file=sys.stderr)
        return _grid(setup, max_block), "grid fallback (policy search unavailable)"


def _search(setup: Setup, max_block: int) -> Policy:
    """What `--policy auto` runs (policy/auto.py), with the block capped at `max_block`."""
    from flexgen_helm.compare.workloads import offload_dir
    from flexgen_helm.policy.auto import search_for
    from flexgen_helm.policy.search import SearchOptions

    cfg = resolve(setup.model, dummy=True).config
    opts = SearchOptions(max_gpu_batch_size=max_block, max_num_gpu_batches=max_block)
    result = search_for(cfg, setup.prompt_len, setup.gen_len, {"gpu": setup.gpu_bytes, "cpu": setup.cpu_bytes},
                        opts, offload_dir=str(offload_dir(setup)))
    for cand in result.candidates:  # fastest first (by the cost model)
        if cand.policy.block_size <= max_block and _fits(setup, cand.policy):
            return cand.policy
    raise ValueError(f"no searched candidate with a block of at most {max_block} passes our budget check")


def _grid(setup: Setup, max_block: int) -> Policy:
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
                p = _most_weights_in_ram(setup, shape, use_gpu=True)
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


def _disk_read_bytes() -> int:
    """Bytes this process has caused to be read from storage (not from the page cache)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def main(argv: list[str]) -> int:
    """`flexgen-helm bench ...` plus the disk bytes read during each generate (the last is
    the timed one), added to its JSON as `disk_read_bytes`."""
    from flexgen_helm.cli import main as cli_main
    from flexgen_helm.engine import Engine

    reads = []
    generate = Engine.generate

    def counted(self, *a, **k):  # wraps only this process's Engine, to time-box the counter
        before = _disk_read_bytes()
        try:
            return generate(self, *a, **k)
        finally:
            reads.append(_disk_read_bytes() - before)

    Engine.generate = counted
    rc = cli_main(argv)
    json_path = argv[argv.index("--json") + 1] if "--json" in argv else None
    if rc == 0 and json_path and reads:
        record = json.loads(Path(json_path).read_text())
        record["disk_read_bytes"] = reads[-1]
        Path(json_path).write_text(json.dumps(record, indent=1))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
