"""The blocks `--policy auto` weighed for this row's 4-bit plan, from this folder's profile (the
saved one of 16:34, format 8) and the row's disk bandwidth, as the compare planned it before
its speed check (compute_time_scale 1.0): each block shape's best placement and its predicted
token/s, fastest first.

    python runs/compare/olmoe-1b-7b-p512-g32/2026-11-29_evening/search_candidates.py
"""

from __future__ import annotations

import json
from pathlib import Path

from flexgen_helm.planner.hardware_profile import saved_profile
from flexgen_helm.tools.compare.ours import FOUR_BIT, searched
from flexgen_helm.tools.compare.run import with_measured_disk
from flexgen_helm.tools.compare.workloads import SETUPS

HERE = Path(__file__).parent


def main() -> None:
    profile, why = saved_profile(HERE / "hardware-profile-2026-11-29T16-34.json")
    if profile is None:
        raise SystemExit(why)
    with open(HERE / "olmoe-1b-7b-p512-g32" / "bandwidth.json") as f:
        measured = with_measured_disk(profile, json.load(f))
    result = searched(SETUPS["olmoe-1b-7b-p512-g32"], measured, FOUR_BIT)
    for c in result.candidates:
        p, e = c.policy, c.estimate
        print(f"{e.throughput:5.2f} tok/s predicted: gbs {p.gpu_batch_size} x {p.num_gpu_batches}, cache {p.cache}, "
              f"activations {p.activations} (prefill {e.prefill_s:.1f} s, "
              f"decode {e.decode_step_s * 1e3:.0f} ms a step)")


if __name__ == "__main__":
    main()
