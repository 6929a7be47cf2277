"""The plans `--policy auto` weighs for a compare setup's 4-bit row: from a saved hardware
profile and a row's disk bandwidth (its bandwidth.json: the compare plans with the disk speeds
measured at its start), at each compute_time_scale given (the compare scales the profile's
compute terms by its speed check before planning: tools/compare/run.with_compute_speed_now).
Per scale, the plan chosen, then with --candidates each block shape's best placement and its
predicted token/s, fastest first.

    python runs/compare/search_candidates.py <hardware-profile.json> <row>/bandwidth.json \
        [--setup olmoe-1b-7b-p512-g32] [--scales 1.0 ...] [--candidates]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from flexgen_helm.planner.hardware_profile import saved_profile
from flexgen_helm.tools.compare.ours import FOUR_BIT, searched
from flexgen_helm.tools.compare.run import with_measured_disk
from flexgen_helm.tools.compare.workloads import SETUPS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("bandwidth", type=Path)
    parser.add_argument("--setup", default="olmoe-1b-7b-p512-g32", choices=sorted(SETUPS))
    parser.add_argument("--scales", type=float, nargs="+", default=[1.0])
    parser.add_argument("--candidates", action="store_true")
    args = parser.parse_args()
    profile, why = saved_profile(args.profile)
    if profile is None:
        raise SystemExit(why)
    measured = with_measured_disk(profile, json.loads(args.bandwidth.read_text()))
    for scale in args.scales:
        scaled = replace(measured, time_scale={"prefill.compute": scale, "decode.compute": scale})
        result = searched(SETUPS[args.setup], scaled, FOUR_BIT)
        p = result.policy
        print(f"scale {scale}: gbs {p.gpu_batch_size} x {p.num_gpu_batches}, cache {p.cache}", flush=True)
        for c in result.candidates if args.candidates else ():
            p, e = c.policy, c.estimate
            print(f"  {e.throughput:5.2f} tok/s predicted: gbs {p.gpu_batch_size} x {p.num_gpu_batches}, "
                  f"cache {p.cache}, activations {p.activations} (prefill {e.prefill_s:.1f} s, "
                  f"decode {e.decode_step_s * 1e3:.0f} ms a step)")


if __name__ == "__main__":
    main()
