"""The cost model's predictions behind README.md's section 3, from this run's own profile
(call1/profile-h100.json, measured on the H100's machine) and records; no GPU needed:

    python runs/gpu/h100-2026-11-26/predictions.py > runs/gpu/h100-2026-11-26/predictions.txt

1. the predicted throughput of the policy `--policy auto` ran and of FlexGen's published one;
2. the profile refit to this run's bench records (`flexgen-helm profile --refit`'s arithmetic);
3. the policy the search picks for the setting from the refit profile, and its prediction.
"""

from __future__ import annotations

import json
from pathlib import Path

from flexgen_helm.planner.hardware_profile import HardwareProfile
from flexgen_helm.policy.policy import Policy
from flexgen_helm.tools.compare.ours import searched
from flexgen_helm.tools.compare.workloads import SETUPS, cost_model
from flexgen_helm.tools.validation.refit import refit

HERE = Path(__file__).resolve().parent
CALL1 = HERE / "call1"
SETUP = SETUPS["opt-6.7b-p512-g32-gpu16"]
AUTO = CALL1 / "compare" / SETUP.name / "ours-auto"


def predicted(profile: HardwareProfile, policy: Policy) -> float:
    return cost_model(SETUP, profile).estimate(policy).throughput


def main() -> None:
    profile = HardwareProfile.from_dict(json.loads((CALL1 / "profile-h100.json").read_text()))
    auto = Policy.from_dict(json.loads(AUTO.with_suffix(".policy.json").read_text()))
    flexgen = Policy(gpu_batch_size=2, overlap=False)  # --percent 100 0 100 0 100 0 --gpu-batch-size 2
    measured = json.loads(AUTO.with_suffix(".json").read_text())["total_throughput"]
    print(f"1. --policy auto ({auto.describe()}): predicted {predicted(profile, auto):.1f} tok/s, "
          f"measured {measured:.1f}")
    print(f"   FlexGen's published policy: predicted {predicted(profile, flexgen):.1f} tok/s "
          "(FlexGen's own code measured 75.0: call2)")
    records = [AUTO.with_suffix(".json")] + [CALL1 / f"overlap_{n}.json" for n in
                                             ("ram_on", "ram_off", "disk_on", "disk_off")]
    fitted, report = refit(profile, records)
    print("2. " + report)
    choice = searched(SETUP, fitted).policy
    print(f"3. the search from the refit profile: {choice.describe()}: predicted {predicted(fitted, choice):.1f} tok/s")


if __name__ == "__main__":
    main()
