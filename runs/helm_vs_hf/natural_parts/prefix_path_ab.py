"""A/B of a bf16 shared prefix's part of attention (executor/attention.FUSED_PREFIX_PART: our
products, or torch's fused flash kernel) on a HELM scenario's requests: our client in bfloat16
(the machine's saved profile applied, as helm-run does), the same requests sent again with the
setting off and on (`--uses`: which uses of the part the "on" side puts on the kernel) in
alternating rounds, one process, a fresh client each round (one keeps the
responses it computed ahead); perf_counter wrappers time the block schedule's prefill and
decode, the prefill windows' attention (PrefixLayer.attend_window) and its prefix part.

    python runs/helm_vs_hf/natural_parts/prefix_path_ab.py STATE.json [--rounds 3] [--uses decode,window] [--out FILE]

STATE.json: a HELM run's scenario_state.json (README.md says how to make one). Prints one JSON
line (each round's seconds by path, the medians' ratios, host, load) and appends it to --out
(prefix_path_ab.jsonl beside this file). alternate_rounds() is the A/B itself, for another
setting's (tried/own_window_ab.py).
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
from typing import Callable

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "runs/bench/merged_head"))

PARTS = ("windows: prefix part", "windows", "prefill", "decode", "wall_s")


def alternate_rounds(state: Path, rounds: int, settings: dict[str, Callable[[], None]]) -> dict:
    """Each round sends the scenario's requests once per setting, in the other order every other
    round (its function called first,
    after the client's load applied the saved profile), timed by part (PARTS). Returns the
    record: the rounds by setting, each part's median ratio of the second setting over the
    first, the saved profile's attention choices, the request count, host, load."""
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

    requests = scenario_requests(state)
    loaded_client()
    profile_choices = {"fused_prefix_part": sorted(attention.FUSED_PREFIX_PART["cpu"]),
                       "fused_decode_from_keys": attention.FUSED_DECODE["cpu"]}
    load = os.getloadavg()[0]
    timings = {name: [] for name in settings}
    for i in range(rounds):
        for name in list(settings)[::1 if i % 2 == 0 else -1]:  # either side first in turn
            apply = settings[name]
            client = loaded_client()
            apply()
            spent.clear()
            t0 = time.perf_counter()
            client.prefetch(requests)
            timings[name].append({"wall_s": round(time.perf_counter() - t0, 2),
                                  **{k: round(v, 2) for k, v in spent.items()}})
    first, second = settings

    def ratio(key: str) -> float:
        a, b = (statistics.median(r[key] for r in timings[name]) for name in (first, second))
        return round(b / a, 3)
    return {"requests": len(requests), "rounds": timings,
            **{f"{key}: {second} over {first}": ratio(key) for key in PARTS if key in timings[first][0]},
            "profile_choices": profile_choices, "host": machine_label(), "loadavg_1m": round(load, 2)}


def append(record: dict, out: Path) -> None:
    print(json.dumps(record, indent=1))
    with open(out, "a") as f:
        f.write(json.dumps(record) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("state", type=Path)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--uses", default="decode,window",
                   help="the uses of the prefix part (attention.PREFIX_PART_USES) the fused side runs on the kernel")
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("prefix_path_ab.jsonl"))
    args = p.parse_args()
    from flexgen_helm.executor import attention

    uses = tuple(args.uses.split(","))
    record = alternate_rounds(args.state, args.rounds, {
        "our products": lambda: attention.set_fused_prefix_part("cpu", ()),
        "fused kernel": lambda: attention.set_fused_prefix_part("cpu", uses)})
    append({**record, "fused_side_uses": list(uses),
            "command": f"python runs/helm_vs_hf/natural_parts/prefix_path_ab.py {args.state.name} "
                       f"--rounds {args.rounds} --uses {args.uses}"}, args.out)


if __name__ == "__main__":
    main()
