"""A/B of a bf16 shared prefix's part of attention (executor/attention.FUSED_PREFIX_PART: our
products, or torch's fused flash kernel) on a HELM scenario's requests: our client in bfloat16
(the machine's saved profile applied, as helm-run does), the same requests sent again with the
setting off and on in alternating rounds, one process, a fresh client each round (one keeps the
responses it computed ahead); perf_counter wrappers time the block schedule's prefill and
decode, the prefill windows' attention (PrefixLayer.attend_window) and its prefix part.

    python runs/helm_vs_hf/natural_parts/prefix_path_ab.py STATE.json [--rounds 3] [--out FILE]

STATE.json: a HELM run's scenario_state.json (README.md says how to make one). Prints one JSON
line (each round's seconds by path, the medians' ratios, host, load) and appends it to --out
(prefix_path_ab.jsonl beside this file).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "runs/bench/merged_head"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("state", type=Path)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("prefix_path_ab.jsonl"))
    args = p.parse_args()
    from helm.common.cache import BlackHoleCacheConfig
    from scenario_client import scenario_requests

    from flexgen_helm.executor import attention, schedule, shared_prefix
    from flexgen_helm.helm.client import FlexGenClient
    from flexgen_helm.memory.machine import machine_label

    spent = collections.Counter()
    for owner, name, key in ((schedule.BlockSchedule, "prefill", "prefill"),
                             (schedule.BlockSchedule, "decode", "decode"),
                             (shared_prefix.PrefixLayer, "attend_window", "windows"),
                             (attention, "_window_prefix_part", "windows: prefix part")):
        real = getattr(owner, name)

        def timed(*a, _real=real, _key=key, **k):
            t0 = time.perf_counter()
            try:
                return _real(*a, **k)
            finally:
                spent[_key] += time.perf_counter() - t0
        setattr(owner, name, timed)

    def loaded_client() -> FlexGenClient:
        client = FlexGenClient(BlackHoleCacheConfig(), model="smollm2-135m", deployment="flexgen/smollm2-135m",
                               dtype="bfloat16")
        _ = client.handle, client.handle.tokenizer  # the saved profile applied here
        return client

    requests = scenario_requests(args.state)
    loaded_client()
    profile_choice = attention.FUSED_PREFIX_PART["cpu"]
    load = os.getloadavg()[0]
    rounds = {"our products": [], "fused kernel": []}
    for _ in range(args.rounds):
        for name in rounds:
            client = loaded_client()
            attention.set_fused_prefix_part("cpu", name == "fused kernel")
            spent.clear()
            t0 = time.perf_counter()
            client.prefetch(requests)
            rounds[name].append({"wall_s": round(time.perf_counter() - t0, 2),
                                 **{k: round(v, 2) for k, v in spent.items()}})

    def ratio(key: str) -> float:
        ours, fused = (statistics.median(r[key] for r in rounds[name]) for name in rounds)
        return round(fused / ours, 3)
    record = {"requests": len(requests), "rounds": rounds,
              **{f"{key}: fused over ours": ratio(key) for key in ("windows: prefix part", "windows", "prefill",
                                                                    "decode", "wall_s")},
              "profile_took_fused": profile_choice, "host": machine_label(), "loadavg_1m": round(load, 2),
              "command": f"python runs/helm_vs_hf/natural_parts/prefix_path_ab.py {args.state.name} "
                         f"--rounds {args.rounds}"}
    print(json.dumps(record, indent=1))
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
