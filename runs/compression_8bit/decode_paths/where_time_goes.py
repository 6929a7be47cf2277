"""Where each main-job deployment spends the time of the same few-shot requests, by the engine
functions that only a compressed deployment runs (cProfile, cumulative seconds).

    python runs/compression_8bit/decode_paths/where_time_goes.py [--requests 10] [--rounds 2] [--out FILE]

The first --requests of a HELM run's saved pattern_match requests, through our client in
float32 (scenario_paths.py's child, its PATHS), each path in its own process, the paths
rotated round by round. cProfile slows every Python call alike, so read each function's share
of its own run, not absolute seconds. Appends one JSON line per run to --out (default
where_time_goes.jsonl beside this file), with the host and the load average.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from scenario_paths import PATHS, REPO, run_child  # noqa: E402

# The functions whose cumulative time is reported: what the
# block schedule runs (prefill, decode), the linears (dense copies included), attention, and
# what only a compressed KV cache does at a write (store, round).
FUNCTIONS = {  # name -> (the file's path ends with, the function's name)
    "prefill": ("executor/schedule.py", "prefill"),
    "decode": ("executor/schedule.py", "decode"),
    "linears": ("models/linear.py", "linear"),
    "decode_attention": ("executor/schedule.py", "_decode_attention"),
    "cache_writes": ("executor/kv_cache.py", "write"),
    "fake_quantize": ("compression/quantize.py", "fake_quantize"),
    "kivi_group_rounding": ("executor/kv_cache.py", "_round_completed_groups"),
}

CHILD = r"""
import cProfile, json, pstats, sys, time
sys.path.insert(0, sys.argv[1])
from scenario_client import scenario_requests
from helm.common.cache import BlackHoleCacheConfig
from flexgen_helm.helm.client import FlexGenClient

requests = scenario_requests(sys.argv[2])[:int(sys.argv[3])]
name, policy, functions = sys.argv[4], json.loads(sys.argv[5]), json.loads(sys.argv[6])
client = FlexGenClient(BlackHoleCacheConfig(), model="smollm2-135m", deployment=f"flexgen/smollm2-135m-{name}",
                       dtype="float32", **({"policy": policy} if policy else {}))
_ = client.handle, client.handle.tokenizer  # loaded before the clock starts
profile = cProfile.Profile()
t0 = time.perf_counter()
profile.enable()
client.prefetch(requests)
profile.disable()
wall = time.perf_counter() - t0
stats = pstats.Stats(profile).stats  # (file, line, name) -> (calls, primitive calls, tottime, cumtime, callers)
seconds = {}
for key, where in functions.items():
    seconds[key] = round(sum(s[3] for (f, _, fn), s in stats.items() if f.endswith(where[0]) and fn == where[1]), 3)
print(json.dumps({"profiled_wall_s": round(wall, 3), "seconds": seconds}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--paths", nargs="+", default=["fp32", "8-bit-deployment", "4-bit-deployment"],
                   choices=list(PATHS))
    p.add_argument("--out", type=Path, default=HERE / "where_time_goes.jsonl")
    args = p.parse_args()
    for key, (file, function) in FUNCTIONS.items():  # a renamed one would read as 0 s: not called
        if f"def {function}(" not in (REPO / "flexgen_helm" / file).read_text():
            sys.exit(f"{key}: flexgen_helm/{file} defines no {function}(); update FUNCTIONS")
    command = (f"python runs/compression_8bit/decode_paths/where_time_goes.py --requests {args.requests} "
               f"--rounds {args.rounds} --paths {' '.join(args.paths)}")
    for r in range(args.rounds):
        for name in args.paths[r % len(args.paths):] + args.paths[:r % len(args.paths)]:
            run_child(CHILD, name, [json.dumps(PATHS[name]), json.dumps(FUNCTIONS)], args.requests, command, args.out,
                      round=r)


if __name__ == "__main__":
    main()
