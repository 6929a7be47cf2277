"""The cost model's prefill seconds and decode step for the policy a compare row ran, from this
machine's saved hardware profile (or --profile, a saved one's copy) as it is (no
compute_time_scale, no disk speed measured at the run's start): what runs/compare/NOTES.md sets
beside a row's measured prefill and decode.

    python runs/compare/cost_terms.py runs/compare/olmoe-1b-7b-p512-g32/2026-11-28_dequant_addcmul/ours-4bit.json \
        [--profile runs/compare/olmoe-1b-7b-p512-g32/2026-11-29_per_expert/hardware-profile-2026-11-28T18-39.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flexgen_helm.planner.cost_model import estimate
from flexgen_helm.planner.hardware_profile import saved_profile
from flexgen_helm.policy.policy import Policy
from flexgen_helm.weights.registry import resolve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("record", help="a row's bench JSON (flexgen-helm bench --json)")
    parser.add_argument("--profile", type=Path, default=None, help="a saved hardware profile (default: this machine's)")
    args = parser.parse_args()
    with open(args.record) as f:
        record = json.load(f)
    profile, why = saved_profile(args.profile)
    if profile is None:
        raise SystemExit(f"no saved hardware profile to price with: {why}")
    cfg = resolve(record["model"], dummy=True).config
    est = estimate(cfg, Policy.from_dict(record["policy"]), profile, record["prompt_len"], record["gen_len"])
    print(f"predicted: prefill {est.prefill_s:.2f} s, decode step {est.decode_step_s * 1e3:.0f} ms "
          f"(measured: prefill {record['prefill_latency_s']:.2f} s, "
          f"decode step {record['decode_latency_s'] / (record['gen_len'] - 1) * 1e3:.0f} ms); "
          f"total {est.total_s:.1f} s predicted, {record['total_latency_s']:.1f} s measured")


if __name__ == "__main__":
    main()
