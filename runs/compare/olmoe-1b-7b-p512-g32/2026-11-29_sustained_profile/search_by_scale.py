"""The block `--policy auto` plans for the compare's 4-bit row, from this folder's profile and
each row's disk bandwidth, at the compute_time_scale values the rows met (the compare scales the
profile's compute terms by its speed check before planning: tools/compare/run.with_compute_speed_now).

    python runs/compare/olmoe-1b-7b-p512-g32/2026-11-29_sustained_profile/search_by_scale.py
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from flexgen_helm.planner.hardware_profile import saved_profile
from flexgen_helm.tools.compare.ours import FOUR_BIT, searched
from flexgen_helm.tools.compare.run import with_measured_disk
from flexgen_helm.tools.compare.workloads import SETUPS

HERE = Path(__file__).parent


def main() -> None:
    profile, why = saved_profile(HERE / "hardware-profile-2026-11-29T08-54.json")
    if profile is None:
        raise SystemExit(why)
    setup = SETUPS["olmoe-1b-7b-p512-g32"]
    for row in ("a_block16_cebac43", "c_block32_a8e4b6f"):
        with open(HERE / row / "bandwidth.json") as f:
            measured = with_measured_disk(profile, json.load(f))
        for scale in (0.71, 0.93, 1.0, 1.42):
            scaled = replace(measured, time_scale={"prefill.compute": scale, "decode.compute": scale})
            policy = searched(setup, scaled, FOUR_BIT).policy
            print(f"{row} disk, scale {scale}: gbs {policy.gpu_batch_size} x {policy.num_gpu_batches}, "
                  f"cache {policy.cache}", flush=True)


if __name__ == "__main__":
    main()
