"""What one decode step's attention past a bf16 shared prefix costs per layer, by part, and how
many torch ops each part runs: attention.attend_past_shared_prefix at SmolLM2's decode shapes
(32 sequences, 3 key-value heads of 3 query heads, 64 wide, 24 own keys, a 1,000-token prefix
in the bf16 layout), on our products and on torch's fused kernel (attention.FUSED_PREFIX_PART's
"decode": the prefix part and the own keys on the kernel, merged by a lerp), against
attention.attend over the same own keys alone (the step without a prefix). Each row timed over
10 calls, in 150 rounds of all rows in turn (this host's speed swings within seconds): the
medians, and the median of the rounds' ratios of the two whole calls and of their extra over
the step without a prefix; op counts from torch.profiler (ops that run a kernel or copy, not
views); the profile's op latency (us) beside them.

    python runs/prefix_sharing/decode_call_parts.py
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
from pathlib import Path

import torch

from flexgen_helm.executor import attention
from flexgen_helm.memory.machine import machine_label
from flexgen_helm.planner.hardware_profile import HardwareProfile, default_profile_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from record import interleaved_per_call

KV_HEADS, QUERY_HEADS, WIDTH, SEQUENCES, OWN, PREFIX = 3, 3, 64, 32, 24, 1000
OURS = "the whole call (attend_past_shared_prefix)"
FUSED = "the whole call on the fused kernel (_fused_past_prefix)"
BARE = "no prefix: attend over the own keys"
VIEWS = {"aten::view", "aten::transpose", "aten::slice", "aten::as_strided", "aten::reshape", "aten::expand",
         "aten::unsqueeze", "aten::select", "aten::t", "aten::empty", "aten::empty_strided", "aten::empty_like",
         "aten::to", "aten::resolve_conj", "aten::resolve_neg", "aten::lift_fresh", "aten::alias",
         "aten::_unsafe_view", "aten::detach", "aten::result_type", "aten::item", "aten::_local_scalar_dense"}


def ops_per_call(fn, calls: int = 20) -> float:
    with torch.profiler.profile() as prof:
        for _ in range(calls):
            fn()
    return sum(e.count for e in prof.key_averages() if e.key not in VIEWS) / calls


def main() -> None:
    torch.manual_seed(0)
    units = SEQUENCES * KV_HEADS
    q = torch.randn(units, QUERY_HEADS, 1, WIDTH).bfloat16()
    k, v = (torch.randn(units, OWN, WIDTH).bfloat16() for _ in range(2))
    own = torch.ones(units, OWN, dtype=torch.bool)
    own[:, :5] = False  # a block's padding
    prefix_kv = [torch.randn(KV_HEADS, PREFIX, WIDTH) for _ in range(2)]

    def on(uses, fn=None):
        """fn(prefix) over a prefix laid out for `uses`, with them taken while it runs; the prefix if no fn."""
        attention.set_fused_prefix_part("cpu", uses)
        prefix = attention.prefix_for_decode(*prefix_kv, "cpu", torch.bfloat16)
        if fn is None:
            return prefix

        def run():
            attention.set_fused_prefix_part("cpu", uses)
            return fn(prefix)
        return run

    prefix = on(())
    if prefix.key_mean is None:
        raise SystemExit("this CPU has no native bf16 matmuls: the bf16 layout this measures is not made here")
    qf = q.float().view(units, QUERY_HEADS, WIDTH)
    by_head, per_unit = attention._stacked_by_head(qf, 0, KV_HEADS)
    parts = tuple(map(per_unit, attention._bf16_prefix_part(by_head, prefix)))
    whole = functools.partial(attention.attend_past_shared_prefix, q, k, v, own)
    calls = {
        OURS: on((), whole),
        "  its prefix part (_bf16_prefix_part)": functools.partial(attention._bf16_prefix_part, by_head, prefix),
        "  its own keys and the merge (_own_keys_and_prefix)": functools.partial(
            attention._own_keys_and_prefix, qf, k, v, own, 0.0, parts),
        FUSED: on({"decode"}, whole),
        BARE: functools.partial(attention.attend, q, k, v, own, causal=False),
    }
    path = default_profile_path()
    latency = HardwareProfile.load(path).compute.op_latency_s * 1e6 if path.exists() else float("nan")
    print(f"# {machine_label()}, load {os.getloadavg()[0]:.2f}; the saved profile's op latency {latency:.1f} us")
    times = interleaved_per_call(calls, calls=10, rounds=150, warmup=20)
    for name, fn in calls.items():
        print(f"{name:58} {statistics.median(times[name]) * 1e6:7.0f} us  {ops_per_call(fn):5.1f} ops")
    ours, fused, bare = (times[name] for name in (OURS, FUSED, BARE))
    print(f"our products over the fused kernel, the rounds' median: whole call "
          f"{statistics.median(a / b for a, b in zip(ours, fused)):.3f}x, its extra over no prefix "
          f"{statistics.median((a - c) / (b - c) for a, b, c in zip(ours, fused, bare)):.3f}x")


if __name__ == "__main__":
    main()
