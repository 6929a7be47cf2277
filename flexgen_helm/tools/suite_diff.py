"""Two HELM suites of the same run specs, compared completion by completion.

    python -m flexgen_helm.tools.suite_diff SUITE_DIR_A SUITE_DIR_B [--json OUT]

For every run of suite A, the run of the same name in B; for every request of a run, its
completions: text, and each token's text and logprob, which must be equal (runs of the same
batches in the same dtype are bitwise equal; anything else is a difference). Exit status 0
when nothing differs and both suites hold the same runs, else 1. Used to check that a suite
run through Slurm (one job per run spec), resumed after a kill, or split over data-parallel
ranks gives what one helm-run process gives.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def runs_of(suite_dir: Path) -> dict[str, Path]:
    """The runs of a suite folder (benchmark_output/runs/<suite>) that finished."""
    if not suite_dir.is_dir():
        raise SystemExit(f"{suite_dir}: no such suite folder (expected benchmark_output/runs/<suite>)")
    return {p.name: p for p in sorted(suite_dir.iterdir()) if (p / "scenario_state.json").is_file()}


def completions_by_request(run_dir: Path) -> dict[str, list]:
    """Each request's completions as (text, [(token text, logprob), ...]), keyed by what
    identifies the request inside its run."""
    state = json.loads((run_dir / "scenario_state.json").read_text())
    out = {}
    for rs in state["request_states"]:
        key = json.dumps([rs["instance"]["id"], rs["train_trial_index"], rs.get("reference_index"),
                          rs.get("request_mode"), rs["request"]["prompt"]])
        result = rs.get("result") or {}
        out[key] = [(c["text"], [(t["text"], t["logprob"]) for t in c["tokens"]])
                    for c in result.get("completions", [])]
    return out


def compare_runs(a: Path, b: Path) -> dict:
    ra, rb = completions_by_request(a), completions_by_request(b)
    differing = [k for k in ra if ra[k] != rb.get(k)]
    worst = 0.0
    for k in ra:
        for (_, ta), (_, tb) in zip(ra[k], rb.get(k, [])):
            worst = max([worst, *(abs(x[1] - y[1]) for x, y in zip(ta, tb))])
    return {"requests": len(ra), "requests_in_b": len(rb), "completions": sum(len(v) for v in ra.values()),
            "differing_requests": len(differing) + len(set(rb) - set(ra)),
            "max_abs_logprob_difference": worst,
            "first_difference": json.loads(differing[0])[:4] if differing else None}


def compare_suites(a: Path, b: Path) -> dict:
    runs_a, runs_b = runs_of(a), runs_of(b)
    runs = {name: compare_runs(runs_a[name], runs_b[name]) for name in runs_a if name in runs_b}
    return {"suite_a": str(a), "suite_b": str(b), "runs": runs,
            "only_in_a": sorted(set(runs_a) - set(runs_b)), "only_in_b": sorted(set(runs_b) - set(runs_a)),
            "requests": sum(r["requests"] for r in runs.values()),
            "completions": sum(r["completions"] for r in runs.values()),
            "differing_requests": sum(r["differing_requests"] for r in runs.values())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("suite_a", type=Path)
    p.add_argument("suite_b", type=Path)
    p.add_argument("--json", type=Path, help="write the comparison here")
    args = p.parse_args(argv)
    result = compare_suites(args.suite_a, args.suite_b)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    same = not result["differing_requests"] and not result["only_in_a"] and not result["only_in_b"]
    print(f"{len(result['runs'])} runs, {result['requests']} requests, {result['completions']} completions: "
          f"{result['differing_requests']} requests differ; only in A: {result['only_in_a']}, "
          f"only in B: {result['only_in_b']}")
    return 0 if same and result["runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
