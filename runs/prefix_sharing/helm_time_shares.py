"""Where one few-shot helm-run's time goes: model load, shared-prefix prefill, the rest of the
prefill (each prompt's own tokens), decode, the engine calls' time outside their prefill and
decode, and HELM's own (start, scenario, tokenization, metrics, writing).

    python runs/prefix_sharing/helm_time_shares.py --system ours-float32 --out runs/prefix_sharing/helm_shares

helm-run runs in this process (BatchingRunner, -n 1, a fresh prod_env under the comparison's
work folder, $FLEXGEN_HELM_COMPARE_DIR/helm_shares: HELM's cache empty),
on the local deployments of runs/helm_vs_hf (tools/compare/helm_clients.py). Engine.load,
Engine.generate and Engine.score are wrapped to keep each call's wall time and RunStats
(its prefill and decode seconds and the schedule's timers: executor/schedule.py). Shares of
the wall time, one JSON per run; they are indicative where the machine was not idle (its
load average is in the record), and say nothing about speed against other runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from flexgen_helm.engine import Engine
from flexgen_helm.executor.shared_prefix import common_prefix_len
from flexgen_helm.memory.machine import machine_label
from flexgen_helm.tools.compare.helm_clients import SCENARIOS, SYSTEMS, export_checkpoint, prod_env_yaml
from flexgen_helm.tools.compare.run import loadavg
from flexgen_helm.tools.compare.workloads import work_dir
from flexgen_helm.tools.report.demo import helm_command

CALLS: list[dict] = []


def _wrap(name: str):
    plain = getattr(Engine, name)

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        run = plain(self, *args, **kwargs)
        CALLS.append({"call": name, "wall_s": time.perf_counter() - t0, "stats": run.stats.as_dict(),
                      "prompts": _lengths(args[0] if args else kwargs["prompts"])})
        return run

    setattr(Engine, name, timed)


def _lengths(prompts) -> dict:
    """A call's prompts: how many, the tokens they all begin with, and each one's own tokens after them."""
    shared = common_prefix_len(prompts) if len(prompts) > 1 else 0
    own = [len(p) - shared for p in prompts]
    return {"count": len(prompts), "common_prefix": shared, "own_min": min(own), "own_max": max(own),
            "own_sum": sum(own)}


def _wrap_load():
    plain = Engine.load.__func__

    def timed(cls, *args, **kwargs):
        t0 = time.perf_counter()
        engine = plain(cls, *args, **kwargs)
        CALLS.append({"call": "load", "wall_s": time.perf_counter() - t0})
        return engine

    Engine.load = classmethod(timed)


def shares(wall: float) -> dict:
    runs = [c for c in CALLS if c["call"] != "load"]
    stats = [c["stats"] for c in runs]
    timer = lambda k: sum(s["timers"].get(k, 0.0) for s in stats)  # noqa: E731
    prefill, decode = sum(s["prefill_s"] for s in stats), sum(s["decode_s"] for s in stats)
    parts = {
        "model_load": sum(c["wall_s"] for c in CALLS if c["call"] == "load"),
        "prefill_shared_prefix": timer("prefill_shared_prefix"),
        "prefill_rest": prefill - timer("prefill_shared_prefix"),  # prompts' own tokens, waits, per-layer costs
        "decode": decode,
        "engine_calls_outside_prefill_decode": sum(c["wall_s"] for c in runs) - prefill - decode,
    }
    parts["helm_and_plugin"] = wall - sum(parts.values())  # helm-run's own time, the plugin's batching and records
    return {
        "wall_s": round(wall, 2),
        "seconds": {k: round(v, 2) for k, v in parts.items()},
        "share": {k: round(v / wall, 3) for k, v in parts.items()},
        "decode_detail_s": {k: round(timer(k), 2) for k in ("decode_compute", "decode_attention")},
        "prefill_compute_s": round(timer("prefill_compute"), 2),
        "engine_calls": len(runs),
        "batch_sequences": [s["sequences"] for s in stats],
        "calls_prompts": [c["prompts"] for c in runs],
        "block_sizes": sorted({s["block_size"] for s in stats}),
        "prompt_tokens": sum(s["prompt_tokens"] for s in stats),
        "padded_prompt_tokens": sum(s["padded_prompt_tokens"] for s in stats),
        "computed_prompt_tokens": sum(s["computed_prompt_tokens"] for s in stats),
        "generated_tokens": sum(s["generated_tokens"] for s in stats),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--system", default="ours-float32", choices=[s.name for s in SYSTEMS if s.runner])
    p.add_argument("--scenario", default="synthetic_reasoning-pattern_match", choices=list(SCENARIOS))
    p.add_argument("--max-instances", type=int, default=None, help="default: the scenario's in runs/helm_vs_hf")
    p.add_argument("--max-batch-share", type=float, default=None,
                   help="the flexgen deployments' max_batch_share (helm/batching.batch_cap; default theirs, 1/16): "
                        "1 lets a scenario's planned block hold all of its requests")
    p.add_argument("--label", default="", help="a tag for the record's file name (e.g. before / after)")
    p.add_argument("--out", default="runs/prefix_sharing/helm_shares")
    args = p.parse_args()
    system = next(s for s in SYSTEMS if s.name == args.system)
    entry, default_instances = SCENARIOS[args.scenario]
    instances = args.max_instances or default_instances
    out = Path(args.out)
    tag = f"{system.name}-{args.scenario}{'-' + args.label if args.label else ''}"
    local = work_dir() / "helm_shares" / tag / "prod_env"
    if local.exists():
        raise SystemExit(f"{local} exists: remove it first (HELM's cache must start empty)")
    local.mkdir(parents=True)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in prod_env_yaml(export_checkpoint()).items():
        if args.max_batch_share is not None:  # one more client arg under each flexgen deployment's own
            text = text.replace("        deployment: flexgen/", f"        max_batch_share: {args.max_batch_share}\n"
                                                                 "        deployment: flexgen/")
        (local / name).write_text(text)
    name, _, spec_args = entry.partition(":")
    run_entry = f"{name}:{spec_args + ',' if spec_args else ''}model={system.deployment}"
    cmd = helm_command([run_entry], instances, tag, str(local.parent / "helm_output"), threads=1,
                       runner=system.runner, local_path=str(local))
    _wrap_load()
    _wrap("generate")
    _wrap("score")
    from helm.benchmark.run import main as helm_run

    load = loadavg()
    sys.argv = ["helm-run", *cmd[cmd.index("-r"):]]
    t0 = time.perf_counter()
    helm_run()
    wall = time.perf_counter() - t0
    record = {"host": machine_label(), "system": system.name, "scenario": args.scenario, "instances": instances,
              "label": args.label, "max_batch_share": args.max_batch_share, "loadavg_1m_before": load,
              "loadavg_1m_after": loadavg(),
              **shares(wall), "command": " ".join(["python", *map(str, sys.orig_argv[1:])])}
    (out / f"{tag}.json").write_text(json.dumps(record, indent=1))
    print(json.dumps({k: record[k] for k in ("wall_s", "seconds", "share", "block_sizes", "batch_sequences")}))


if __name__ == "__main__":
    main()
