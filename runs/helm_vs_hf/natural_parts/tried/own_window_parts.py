"""Where a few-shot prefill window's attention goes on natural-easy's requests, with its own part
on our products and on torch's flash kernel (own_window_fused.patch applied: it adds
attention.set_fused_own_window and shared_prefix.attend_window_past_prefix_runs), alternating,
a fresh client each run; FP=0/1 sets the prefix part's path, else the saved profile's.

    git apply runs/helm_vs_hf/natural_parts/tried/own_window_fused.patch
    python runs/helm_vs_hf/natural_parts/tried/own_window_parts.py STATE.json
"""

import collections
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "runs/bench/merged_head"))
from helm.common.cache import BlackHoleCacheConfig
from scenario_client import scenario_requests

from flexgen_helm.executor import attention, schedule, shared_prefix
from flexgen_helm.helm.client import FlexGenClient

spent = collections.Counter()


def wrap(owner, name: str, key: str) -> None:
    real = getattr(owner, name)

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            spent[key] += time.perf_counter() - t0
            spent[key + " calls"] += 1
    setattr(owner, name, timed)


def loaded_client() -> FlexGenClient:
    client = FlexGenClient(BlackHoleCacheConfig(), model="smollm2-135m", deployment="flexgen/smollm2-135m",
                           dtype="bfloat16")
    _ = client.handle, client.handle.tokenizer
    return client


def main() -> None:
    wrap(schedule.BlockSchedule, "prefill", "prefill")
    wrap(shared_prefix.PrefixLayer, "attend_window", "window")
    wrap(attention, "_window_prefix_part", "prefix part")
    wrap(attention, "_own_window_bf16", "own (ours)")
    wrap(shared_prefix, "attend_window_past_prefix_runs", "runs path")
    requests = scenario_requests(Path(sys.argv[1]))
    fused_prefix = os.environ.get("FP")
    loaded_client()
    for _ in range(2):
        for on in (False, True):
            client = loaded_client()
            if fused_prefix is not None:
                attention.set_fused_prefix_part("cpu", fused_prefix == "1")
            attention.set_fused_own_window("cpu", on)
            spent.clear()
            client.prefetch(requests)
            print("own fused" if on else "own ours ", {k: round(v, 2) for k, v in spent.items()})


if __name__ == "__main__":
    print("load", os.getloadavg()[0], "fused prefix", attention.FUSED_PREFIX_PART["cpu"])
    main()
