"""The main job's compressed deployments with and without their kernels taking a decode step's few
rows though the weights' dense copies are held (compression/int4.KERNEL_OVER_KEPT_ROWS, as this
machine's saved profile sets it, against 0), beside the BF16 deployment, in bfloat16.

    python runs/compression_8bit/decode_paths/kept_kernel_ab.py [--requests 10] [--rounds 3]

The first --requests of the main job's saved pattern_match requests (scenario_paths.py's STATE)
through our client, SmolLM2 in RAM, each (deployment, setting) in its own process, the order
rotated round by round; the seconds in the block schedule's prefill and decode and the client's
whole prefetch. Needs a saved profile of this machine (`flexgen-helm profile`) that measured
kernel_over_kept_gains: fails otherwise, as "on" would equal "off". Appends one JSON line per run
to kept_kernel_ab.jsonl beside this file, with the host, the load average and the rows in effect.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from scenario_paths import PATHS, TIMED_CHILD_HEAD, run_child  # noqa: E402

CHILD = TIMED_CHILD_HEAD + r"""
from flexgen_helm.compression import int4
name, policy, setting = sys.argv[4], json.loads(sys.argv[5]), sys.argv[6]
client = FlexGenClient(BlackHoleCacheConfig(), model="smollm2-135m", deployment=f"flexgen/smollm2-135m-{name}",
                       dtype="bfloat16", **({"policy": policy} if policy else {}))
_ = client.handle, client.handle.tokenizer  # loaded (and the saved profile applied) before the clock starts
if setting == "off":
    int4.clear_kernel_over_kept_rows()
elif not any(int4.KERNEL_OVER_KEPT_ROWS.values()):
    sys.exit("the saved profile lets no kernel take a held copy's rows: run `flexgen-helm profile` first")
t0 = time.perf_counter()
client.prefetch(requests)
wall = time.perf_counter() - t0
print(json.dumps({"setting": setting, "kernel_over_kept_rows": {k[1]: v for k, v in int4.KERNEL_OVER_KEPT_ROWS.items()},
                  "prefill_s": round(spent["prefill"], 3), "decode_s": round(spent["decode"], 3),
                  "prefetch_s": round(wall, 3)}))
"""

RUNS = [("fp32", "on"), ("4-bit-deployment", "on"), ("4-bit-deployment", "off"),
        ("8-bit-deployment", "on"), ("8-bit-deployment", "off")]  # "fp32": the plain deployment, here in bf16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    command = (f"python runs/compression_8bit/decode_paths/kept_kernel_ab.py --requests {args.requests} "
               f"--rounds {args.rounds}")
    for r in range(args.rounds):
        for name, setting in RUNS[r % len(RUNS):] + RUNS[:r % len(RUNS)]:
            run_child(CHILD, name, [json.dumps(PATHS[name]), setting], args.requests, command,
                      HERE / "kept_kernel_ab.jsonl", round=r)


if __name__ == "__main__":
    main()
