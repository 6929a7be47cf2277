"""`flexgen-helm demo`: the whole product in one command on a small machine.

helm-run (with our BatchingRunner) evaluates the bundled SmolLM2-135M uncompressed, 8-bit
and 4-bit on a small offline suite (LAMBADA, WikiText, synthetic reasoning); helm-summarize
with the plugin's schema makes HELM's leaderboard of it (`helm-server --suite <suite>`),
photographed in headless Chromium where installed; optionally a short bench sweep
measures the latency-throughput points and the runtime breakdown; and the report is
built from all of it: runs/<suite>/report.md.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

from flexgen_helm.errors import BrowserError
from flexgen_helm.planner.hardware_profile import load_or_profile
from flexgen_helm.tools.report.build import (
    build_report,
    end_run_info,
    records_dir_of,
    suite_path,
    write_run_info,
)
from flexgen_helm.tools.report.leaderboard import make_leaderboard

# uncompressed, 8-bit, 4-bit: the paper's Table 5 settings (each deployment runs the policy
# of its entry in flexgen_helm/helm/model_deployments.yaml)
DEPLOYMENTS = ("flexgen/smollm2-135m", "flexgen/smollm2-135m-8bit", "flexgen/smollm2-135m-4bit")
SCENARIOS = ("lambada", "wikitext:unit=paragraph", "synthetic_reasoning:mode=pattern_match")
# bench sweep: (label, policy fields, effective batch sizes); short sequences keep it minutes
BENCH = [
    ("uncompressed", {}, (1, 4, 16)),
    # weights as flexgen/smollm2-135m-4bit computes with them: the GGUF's own codes (groups of 32)
    ("4-bit", {"compress_weight": {"bits": 4, "group_size": 32, "method": "gguf"},
               "compress_cache": {"bits": 4, "group_size": 64}}, (4, 16)),
    ("no overlap", {"overlap": False}, (4,)),
]
BENCH_PROMPT_LEN, BENCH_GEN_LEN = 64, 8


def run_entries(scenarios=SCENARIOS, deployments=DEPLOYMENTS) -> list[str]:
    """HELM run entries: "lambada:model=X", "wikitext:unit=paragraph,model=X", ..."""
    out = []
    for d in deployments:
        for s in scenarios:
            name, _, args = s.partition(":")
            out.append(f"{name}:{args + ',' if args else ''}model={d}")
    return out


BATCHING_RUNNER = "flexgen_helm.helm.runner.BatchingRunner"


def helm_command(entries: list[str], max_instances: int, suite: str, output_path: str, threads: int,
                 runner: str | None = BATCHING_RUNNER, local_path: str | None = None) -> list[str]:
    """helm-run's command line; runner=None keeps HELM's own runner (one request per thread)."""
    exe = shutil.which("helm-run")
    head = [exe] if exe else [sys.executable, "-m", "helm.benchmark.run"]
    cmd = head + ["-r", *entries, "-m", str(max_instances), "--suite", suite, "-o", output_path, "-n", str(threads)]
    if runner:
        cmd += ["--runner-class-name", runner]
    if local_path:
        cmd += ["--local-path", local_path]
    return cmd


def bench_sweep(records_dir: Path) -> list[Path]:
    """One bench per (setting, batch), JSON into the run's records folder, where its report
    finds it."""
    from tqdm import tqdm

    from flexgen_helm.policy.policy import Policy
    from flexgen_helm.tools.bench import run_bench

    points = [(label, fields, b) for label, fields, batches in BENCH for b in batches]
    paths = []
    for label, fields, b in tqdm(points, desc="bench sweep", unit="run"):
        # blocks of up to 4 sequences per GPU batch: the zig-zag schedule covers the rest
        gbs = min(b, 4)
        policy = Policy.from_dict({**fields, "gpu_batch_size": gbs, "num_gpu_batches": b // gbs})
        path = records_dir / f"bench-{label.replace(' ', '-')}-bs{b}.json"
        args = Namespace(model="smollm2-135m", path=None, dummy=False, offload_dir=None, device=None, dtype=None,
                         prompt_len=BENCH_PROMPT_LEN, gen_len=BENCH_GEN_LEN, gpu_mem=None, cpu_mem=None, warmup=1,
                         json=str(path), label=label, pipeline=False, quiet=False, breakdown=False)
        run_bench(args, policy)
        paths.append(path)
    return paths


def run_demo(args) -> Path:
    t0 = time.perf_counter()
    out = Path(args.out) if args.out else Path(args.archives) / args.suite
    records_dir = Path(args.runs_dir) if args.runs_dir else records_dir_of(out)
    write_run_info(records_dir, ["flexgen-helm", *args.argv])
    # every deployment run the planner's block for this machine (helm/model_deployments.yaml), as a
    # user's helm-run would: profile the machine first where no profile is saved (once, under a minute)
    load_or_profile()
    cmd = helm_command(run_entries(), args.max_instances, args.suite, args.output_path, args.threads)
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    helm_s = time.perf_counter() - t0
    try:
        make_leaderboard(args.output_path, args.suite, out)
        browser_error = None
    except BrowserError as e:  # the report is still worth writing; the command fails after it
        browser_error = e
    if args.bench:
        bench_sweep(records_dir)
    end_run_info(records_dir)
    report = build_report(suite_path(args.output_path, args.suite), records_dir, out, archive_root=args.archives)
    total = time.perf_counter() - t0
    print(f"report: {report}  (helm-run {helm_s / 60:.1f} min, total {total / 60:.1f} min)")
    print(f"HELM's web UI on it: helm-server --suite {args.suite} -o {args.output_path}")
    if browser_error is not None:
        raise BrowserError(f"the leaderboard screenshot failed: {browser_error}")
    return report
