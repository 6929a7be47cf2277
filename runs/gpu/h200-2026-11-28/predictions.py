"""The cost model's predictions behind README.md, from this run's own profile
(call1/profile-h100.json: the script's file name, measured on the H200's machine) and
records; no GPU needed:

    python runs/gpu/h200-2026-11-28/predictions.py > runs/gpu/h200-2026-11-28/predictions.txt

1. the predicted throughput of each policy that ran (`--policy auto`'s, the DeepSpeed-style
   row's) and of FlexGen's published one;
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
SETUP = SETUPS["opt-6.7b-p512-g32-gpu16"]
ROWS = {"--policy auto": HERE / "call1" / "compare" / SETUP.name / "ours-auto",
        "DeepSpeed-style": HERE / "call2" / "compare" / SETUP.name / "ours-deepspeed-policy"}


def predicted(profile: HardwareProfile, policy: Policy) -> float:
    return cost_model(SETUP, profile).estimate(policy).throughput


def main() -> None:
    profile = HardwareProfile.from_dict(json.loads((HERE / "call1" / "profile-h100.json").read_text()))
    print("1. from the profile as measured:")
    for name, row in ROWS.items():
        policy = Policy.from_dict(json.loads(row.with_suffix(".policy.json").read_text()))
        measured = json.loads(row.with_suffix(".json").read_text())["total_throughput"]
        print(f"   {name} ({policy.describe()}): predicted {predicted(profile, policy):.1f} tok/s, "
              f"measured {measured:.1f}")
    flexgen = Policy(gpu_batch_size=2, overlap=False)  # --percent 100 0 100 0 100 0 --gpu-batch-size 2
    print(f"   FlexGen's published policy: predicted {predicted(profile, flexgen):.1f} tok/s "
          "(FlexGen's own code measured 107.3: call1/compare)")
    records = [row.with_suffix(".json") for row in ROWS.values()] + \
        [HERE / "call1" / f"overlap_ram_{n}.json" for n in ("on", "off")]
    fitted, report = refit(profile, records)
    print("2. " + report)
    choice = searched(SETUP, fitted).policy
    print(f"3. the search from the refit profile: {choice.describe()}: predicted {predicted(fitted, choice):.1f} tok/s")
    print(f"   FlexGen's published policy from the refit profile: predicted {predicted(fitted, flexgen):.1f} tok/s")


if __name__ == "__main__":
    main()
