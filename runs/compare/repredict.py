"""The cost model's predictions for the rows of a compare run, from the saved hardware profile as it
is and with the disk read speeds that run measured at its start (its bandwidth.json), beside what
each row measured.

    python runs/compare/repredict.py runs/compare/opt-1.3b-p512-g32
"""

import json
import sys
from pathlib import Path

from flexgen_helm.memory.devices import DTYPES
from flexgen_helm.planner.cost_model import CostModel, Workload
from flexgen_helm.planner.hardware_profile import load_or_profile
from flexgen_helm.policy import Policy
from flexgen_helm.tools.compare.run import with_measured_disk
from flexgen_helm.tools.compare.workloads import SETUPS
from flexgen_helm.weights.registry import resolve


def main(folder: Path) -> None:
    setup = SETUPS[folder.name]
    bandwidth = json.loads((folder / "bandwidth.json").read_text())
    saved = load_or_profile(None)
    profiles = {"saved profile": saved, "run's disk": with_measured_disk(saved, bandwidth)}
    print(f"saved profile measured at {saved.measured_at}: disk {saved.disk_read_bytes_per_s / 1e9:.2f} GB/s; "
          f"the run's: {bandwidth['engine_read_bytes_per_s'] / 1e9:.2f} GB/s")
    cfg = resolve(setup.model, dummy=True).config
    workload = Workload(setup.prompt_len, setup.gen_len)
    for policy_path in sorted(folder.rglob("*.policy.json")):
        record = json.loads(policy_path.with_name(policy_path.name.replace(".policy", "")).read_text())
        policy = Policy.from_dict(json.loads(policy_path.read_text()))
        measured = record["total_throughput"]
        cells = []
        for name, profile in profiles.items():
            predicted = CostModel(cfg, profile, workload, DTYPES[setup.dtype]).estimate(policy).throughput
            cells.append(f"{name} {predicted:.3f} ({predicted / measured:.2f}x)")
        print(f"{policy_path.name.removesuffix('.policy.json'):32s} measured {measured:.3f} tok/s; " + "; ".join(cells))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
