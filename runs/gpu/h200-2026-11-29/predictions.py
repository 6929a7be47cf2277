"""The cost model's predictions behind README.md, from this run's own profile (call1/profile.json)
with the code as it is now; no GPU needed:

    python runs/gpu/h200-2026-11-29/predictions.py > runs/gpu/h200-2026-11-29/predictions.txt

1. the predicted throughput of each policy that ran, with a GPU's copies on streams (the default
   since this run) and on the worker threads (which charge each transfer the profile's hand-off);
2. the policy the search picks for the setting from the profile, each way.
The profile's fixed costs were measured with the copies on the threads, so they hold hand-offs
that the threads' predictions count again (planner/overhead_profile.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from flexgen_helm.memory.copy_engine import COPIES_SETTING
from flexgen_helm.planner.hardware_profile import HardwareProfile
from flexgen_helm.policy.policy import Policy
from flexgen_helm.tools.compare.ours import searched
from flexgen_helm.tools.compare.workloads import SETUPS, cost_model

HERE = Path(__file__).resolve().parent
SETUP = SETUPS["opt-6.7b-p512-g32-gpu16"]
ROWS = {"--policy auto": HERE / "call2" / "compare" / SETUP.name / "ours-auto",
        "DeepSpeed-style": HERE / "call1" / "compare" / SETUP.name / "ours-deepspeed-policy"}
POLICIES = {"--policy auto": HERE / "call1" / "compare" / SETUP.name / "ours-auto.policy.json",
            "DeepSpeed-style": HERE / "call1" / "compare" / SETUP.name / "ours-deepspeed-policy.policy.json"}


def predicted(profile: HardwareProfile, policy: Policy) -> float:
    return cost_model(SETUP, profile).estimate(policy).throughput


def main() -> None:
    profile = HardwareProfile.from_dict(json.loads((HERE / "call1" / "profile.json").read_text()))
    for way in ("streams", "threads"):
        os.environ[COPIES_SETTING] = way
        print(f"copies on {way}:")
        for name, row in ROWS.items():
            policy = Policy.from_dict(json.loads(POLICIES[name].read_text()))
            measured = json.loads(row.with_suffix(".json").read_text())["total_throughput"]
            print(f"  1. {name} ({policy.describe()}): predicted {predicted(profile, policy):.1f} tok/s, "
                  f"measured {measured:.1f} (copies on streams)")
        choice = searched(SETUP, profile).policy
        print(f"  2. the search: {choice.describe()}: predicted {predicted(profile, choice):.1f} tok/s")


if __name__ == "__main__":
    main()
