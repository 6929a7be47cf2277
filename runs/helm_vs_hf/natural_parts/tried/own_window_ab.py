"""A/B of a few-shot prefill window's own part (executor/attention.FUSED_OWN_WINDOW) on a HELM
scenario's requests: our client in bfloat16 (the machine's saved profile applied, as helm-run
does), the same requests sent again with the setting off and on in alternating rounds, in one
process; the block schedule's prefill and decode, and the prefill windows' attention
(PrefixLayer.attend_window, inside the prefill), timed with perf_counter wrappers.

    git apply runs/helm_vs_hf/natural_parts/tried/own_window_fused.patch  # the setting it flips
    python runs/helm_vs_hf/natural_parts/tried/own_window_ab.py STATE.json [--rounds 3] [--out FILE]

STATE.json: a HELM run's scenario_state.json (parts.py's README says how to make one). Prints
one JSON line (each round's seconds by setting, the medians' ratios, host, load) and appends it
to --out (own_window_ab.jsonl beside this file).
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

REPO = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(REPO / "runs/bench/merged_head"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("state", type=Path)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("own_window_ab.jsonl"))
    args = p.parse_args()
    from helm.common.cache import BlackHoleCacheConfig
    from scenario_client import scenario_requests

    from flexgen_helm.executor import attention, schedule, shared_prefix
    from flexgen_helm.helm.client import FlexGenClient
    from flexgen_helm.memory.machine import machine_label

    spent = collections.Counter()
    for owner, phase in ((schedule.BlockSchedule, "prefill"), (schedule.BlockSchedule, "decode"),
                         (shared_prefix.PrefixLayer, "attend_window")):
        real = getattr(owner, phase)

        def timed(*a, _real=real, _phase=phase, **k):
            t0 = time.perf_counter()
            try:
                return _real(*a, **k)
            finally:
                spent[_phase] += time.perf_counter() - t0
        setattr(owner, phase, timed)

    def loaded_client() -> FlexGenClient:
        """A client of its own each round: one keeps the responses it computed ahead."""
        client = FlexGenClient(BlackHoleCacheConfig(), model="smollm2-135m", deployment="flexgen/smollm2-135m",
                               dtype="bfloat16")
        _ = client.handle, client.handle.tokenizer  # the profile applied here
        return client

    requests = scenario_requests(args.state)
    loaded_client()
    profile_choice = attention.FUSED_OWN_WINDOW["cpu"]
    load = os.getloadavg()[0]
    rounds = {"off": [], "on": []}
    for _ in range(args.rounds):
        for name in rounds:
            client = loaded_client()
            attention.set_fused_own_window("cpu", name == "on")
            spent.clear()
            t0 = time.perf_counter()
            client.prefetch(requests)
            rounds[name].append({"wall_s": round(time.perf_counter() - t0, 2),
                                 **{k: round(v, 2) for k, v in spent.items()}})

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in rounds[name])
    record = {"requests": len(requests), "rounds": rounds,
              "window_attention_off_over_on": round(median("off", "attend_window") / median("on", "attend_window"), 3),
              "prefill_off_over_on": round(median("off", "prefill") / median("on", "prefill"), 3),
              "wall_off_over_on": round(median("off", "wall_s") / median("on", "wall_s"), 3),
              "fused_prefix_part": attention.FUSED_PREFIX_PART["cpu"], "profile_took_own_window": profile_choice,
              "host": machine_label(), "loadavg_1m": round(load, 2),
              "command": f"python runs/helm_vs_hf/natural_parts/tried/own_window_ab.py {args.state.name} "
                         f"--rounds {args.rounds}"}
    print(json.dumps(record, indent=1))
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
