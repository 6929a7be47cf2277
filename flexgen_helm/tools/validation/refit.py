"""Refit the hardware profile to measured runs: one multiplier per (phase, resource) term so
the cost model matches what bench measured.

Each measured phase time is modelled by its bottleneck term: measured ~= k[r] * T[r] where
r is the term with the largest k * T. For every term, k is the least-squares fit of
log m = log k + log T over the runs it is the bottleneck of (k = the geometric mean of m / T:
relative errors count alike, so one slow run does not outweigh the others); the bottlenecks are then re-chosen
with the new k, a few rounds. Terms that bottleneck no run keep their factor. Runs with
overlap off (time = the sum of the terms, no single bottleneck) are predicted, not fitted."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from flexgen_helm.planner.cost_model import CostModel, Workload
from flexgen_helm.planner.hardware_profile import HardwareProfile
from flexgen_helm.policy.policy import Policy
from flexgen_helm.tools.validation.configs import MODEL
from flexgen_helm.weights.registry import resolve

ROUNDS = 5


def _samples(profile: HardwareProfile, paths: list[Path]) -> list[tuple[str, str, dict, float, bool]]:
    """(run, phase, unscaled term times, measured seconds, overlap) for each phase of each run:
    a `flexgen-helm bench --json` result or a validation record (policy/validate.py)."""
    base = replace(profile, time_scale={})
    out = []
    for path in paths:
        d = json.loads(Path(path).read_text())
        cfg = resolve(d.get("model", MODEL), dummy=True).config
        policy = Policy.from_dict(d["policy"])
        s, n = d["prompt_len"], d["gen_len"]
        est = CostModel(cfg, base, Workload(s, n)).estimate(policy)
        out.append((path.name, "prefill", est.prefill_terms, d["prefill_latency_s"], policy.overlap))
        if n > 1:
            out.append((path.name, "decode", est.decode_terms, d["decode_latency_s"] / (n - 1), policy.overlap))
    return out


def refit(profile: HardwareProfile, paths: list[Path]) -> tuple[HardwareProfile, str]:
    samples = _samples(profile, paths)
    scale = dict(profile.time_scale)

    def k(phase, term):
        return scale.get(f"{phase}.{term}", 1.0)

    def predicted(phase, terms, overlap):
        return (max if overlap else sum)(k(phase, t) * v for t, v in terms.items())

    before = [(name, phase, predicted(phase, terms, ov), m) for name, phase, terms, m, ov in samples]
    for _ in range(ROUNDS):
        sums: dict[str, list[float]] = {}
        for _, phase, terms, m, overlap in samples:
            if not overlap:
                continue
            top = max(terms, key=lambda t: k(phase, t) * terms[t])
            if terms[top] <= 0 or m <= 0:
                continue
            acc = sums.setdefault(f"{phase}.{top}", [0.0, 0])
            acc[0] += math.log(m / terms[top])
            acc[1] += 1
        scale.update({key: math.exp(total / n) for key, (total, n) in sums.items()})
    after = [predicted(phase, terms, ov) for _, phase, terms, _, ov in samples]

    lines = ["refit time scales: " + ", ".join(f"{key} x{v:.2f}" for key, v in sorted(scale.items())),
             f"{'run':32s} {'phase':8s} {'measured':>10s} {'before':>10s} {'after':>10s}"]
    for (name, phase, pre, m), post in zip(before, after):
        lines.append(f"{name:32s} {phase:8s} {m:10.3f} {pre:10.3f} {post:10.3f}")
    return replace(profile, time_scale=scale), "\n".join(lines)

