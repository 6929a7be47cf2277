"""Where our engine's time goes on a few-shot HELM scenario's requests, by part (perf_counter
wrappers: the CPU computes synchronously; parts nest, so read them as inclusive times): the
block schedule's prefill and decode, the shared prefix's own prefill, the suffix windows'
attention and its two parts, q/k/v, the block's second half (o_proj, MLP), the head, and every
product on a prepacked weight.

    python runs/helm_vs_hf/natural_parts/parts.py STATE.json [--out FILE]

STATE.json: a HELM run's scenario_state.json (its requests are sent again to
flexgen/smollm2-135m in bfloat16 through our client, HELM's cache off). Prints one JSON line
(seconds and calls per phase and part, host, load) and appends it to --out.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "runs/bench/merged_head"))


PHASE = ["outside"]  # the phase the parts run in: set by the schedule's prefill and decode


def wrap(owner, attr: str, key: str, spent: collections.Counter, phase: bool = False) -> None:
    fn = getattr(owner, attr)

    def timed(*a, **k):
        before = PHASE[0]
        if phase:
            PHASE[0] = key
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[f"{PHASE[0]}: {key}"] += time.perf_counter() - t0
            spent[f"{PHASE[0]}: {key} calls"] += 1
            PHASE[0] = before
    setattr(owner, attr, timed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("state", type=Path)
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("parts.jsonl"))
    args = p.parse_args()
    from helm.common.cache import BlackHoleCacheConfig
    from scenario_client import scenario_requests

    from flexgen_helm import dense_linear
    from flexgen_helm.executor import attention, schedule, shared_prefix
    from flexgen_helm.helm.client import FlexGenClient
    from flexgen_helm.memory.machine import machine_label
    from flexgen_helm.models import gated_mlp, llama

    spent = collections.Counter()
    wrap(schedule.BlockSchedule, "prefill", "prefill", spent, phase=True)
    wrap(schedule.BlockSchedule, "decode", "decode", spent, phase=True)
    wrap(shared_prefix.PrefixLayer, "attend_window", "suffix attention", spent)
    wrap(attention, "_window_prefix_part", "suffix attention: prefix part", spent)
    wrap(attention, "_own_window_bf16", "suffix attention: own part", spent)
    wrap(llama, "qkv", "qkv", spent)
    wrap(llama, "finish_block", "o_proj + MLP", spent)
    wrap(gated_mlp, "gated_mlp", "MLP", spent)
    wrap(llama, "head", "head", spent)
    wrap(dense_linear.PackedLinear, "linear", "products on packed weights", spent)
    # the models import these by name: rebind theirs too
    llama.gated_mlp = gated_mlp.gated_mlp
    requests = scenario_requests(args.state)
    client = FlexGenClient(BlackHoleCacheConfig(), model="smollm2-135m", deployment="flexgen/smollm2-135m",
                           dtype="bfloat16")
    _ = client.handle, client.handle.tokenizer
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    client.prefetch(requests)
    record = {"wall_s": round(time.perf_counter() - t0, 2), **{k: round(v, 3) for k, v in sorted(spent.items())},
              "requests": len(requests), "host": machine_label(), "loadavg_1m": round(load, 2),
              "command": f"python runs/helm_vs_hf/natural_parts/parts.py {args.state.name}"}
    print(json.dumps(record, indent=1))
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
