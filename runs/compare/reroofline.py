"""The roofline of a compare run's rows recomputed with the current roofline.py (and the saved
hardware profile), beside what each row measured and the roofline its table printed.

    python runs/compare/reroofline.py runs/compare/olmoe-1b-7b-p512-g32/2026-11-29_row_buckets_b/olmoe-1b-7b-p512-g32
"""

import csv
import json
import sys
from pathlib import Path

from flexgen_helm.memory.devices import DTYPES
from flexgen_helm.planner.hardware_profile import load_or_profile
from flexgen_helm.policy import Policy
from flexgen_helm.tools.compare import table
from flexgen_helm.tools.compare.roofline import ram_resident, roofline
from flexgen_helm.tools.compare.workloads import SETUPS
from flexgen_helm.weights.registry import resolve


def main(folder: Path) -> None:
    setup = SETUPS[folder.name]
    bandwidth = json.loads((folder / "bandwidth.json").read_text())
    profile = load_or_profile(None)
    cfg = resolve(setup.model, dummy=True).config
    printed = {r["system"]: r for r in csv.DictReader(open(folder / "results.csv"))}
    print(f"profile measured at {profile.measured_at}; memcpy {profile.memcpy_bytes_per_s / 1e9:.2f} GB/s")
    for system, row in printed.items():
        record = json.loads((folder / f"{system}.json").read_text())
        batch = record["effective_batch_size"]
        policy_path = folder / f"{system}.policy.json"
        policy = Policy.from_dict(json.loads(policy_path.read_text())) if policy_path.exists() else None
        in_ram = ram_resident(cfg, profile, policy, record, batch, setup.prompt_len + setup.gen_len,
                              DTYPES[setup.dtype])
        r = roofline(cfg, profile, setup.dtype, batch, policy.gpu_batch_size if policy else batch, setup.prompt_len,
                     setup.gen_len, table.disk_weight_bytes(record), bandwidth["device_read_bytes_per_s"],
                     table.disk_cache_bytes(record), **in_ram)
        measured = float(row["throughput_tok_s"])
        print(f"{system}: measured {measured:.2f} tok/s; roofline printed {row['roofline_tok_s']} tok/s "
              f"({row['pct_of_roofline']}%, {row['roofline_bound']}); now {r.tokens_per_s:.2f} tok/s "
              f"({100 * measured / r.tokens_per_s:.1f}%; prefill {r.prefill_s:.1f} s {r.prefill_bound}, "
              f"decode step {1e3 * r.decode_step_s:.0f} ms {r.decode_bound}; RAM read a step "
              + (f"{in_ram['ram_weight_bytes'] / 1e9:.2f} GB of weights held, "
                 f"{in_ram['ram_cache_bytes'] / 1e9:.2f} GB of cache at full length)" if in_ram else "not counted)"))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
