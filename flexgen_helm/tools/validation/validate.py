"""Validation of the cost model against the engine: measured vs predicted generation
throughput and peak memory per tier, for OPT-1.3B (dummy weights) on this machine.

    python -m flexgen_helm.tools.validation.validate measure --out runs/policy/measured   # minutes per config
    python -m flexgen_helm.tools.validation.validate grid --cpu-mem 2GiB                  # auto vs a hand grid
    python -m flexgen_helm.tools.validation.validate report --out runs/policy             # CSV + README table

Each configuration runs in its own process, so that the process's peak RSS is its own.
A run: load, a short warm-up (kernels, files), then `--repeats` timed generations of the
full block; the medians are recorded (the machine is shared and noisy)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from flexgen_helm.policy.policy import Policy, Split
from flexgen_helm.tools.validation.configs import CONFIGS, GEN_LEN, MODEL, PROMPT_LEN
from flexgen_helm.tools.validation.report import write_report


def measure_one(policy: Policy, prompt_len: int, gen_len: int, repeats: int, offload_dir: str | None) -> dict:
    import torch

    from flexgen_helm.engine import Engine
    from flexgen_helm.executor.sampling import SamplingParams
    from flexgen_helm.tools.bench import throughput

    t0 = time.perf_counter()
    engine = Engine.load(MODEL, policy, dummy=True, offload_dir=offload_dir, progress=False)
    load_s = time.perf_counter() - t0
    cfg, batch = engine.config, policy.block_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, cfg.vocab_size, (batch, prompt_len), generator=g).tolist()
    # warm-up at the timed shapes: every kernel, file path and buffer size once (the first run
    # at a new size pays for fresh memory pages: ram-4x1's prefill took 3.8 s, then 1.7 s)
    engine.generate(prompts, SamplingParams(max_new_tokens=2, ignore_eos=True))
    engine.runtime.usage.reset_peak()
    _reset_peak_rss()  # the peak of the timed runs, not of loading (dummy weights are drawn in fp32)
    load_before = os.getloadavg()[0]  # others share this machine: say how busy it was
    runs = []
    for _ in range(repeats):
        s = engine.generate(prompts, SamplingParams(max_new_tokens=gen_len, ignore_eos=True)).stats
        runs.append({**throughput(s.prefill_s, s.decode_s, batch, prompt_len, gen_len), "timers": s.timers})
    mem = s.memory
    med = {k: statistics.median(r[k] for r in runs)
           for k in ("prefill_latency_s", "decode_latency_s", "total_latency_s")}
    return {
        "policy": policy.to_dict(), "prompt_len": prompt_len, "gen_len": gen_len, "block_size": batch,
        "load_s": load_s, "runs": runs, **med,
        "total_throughput": batch * gen_len / med["total_latency_s"],
        "tier_peak_bytes": {t: v["peak_bytes"] for t, v in mem["tiers"].items()},
        "rss_peak_bytes": mem["cpu_peak_rss_bytes"], "rss_peak_scope": "timed runs", "placement": mem["placement"],
        "disk_page_cache_bypass": mem["disk_page_cache_bypass"],
        "loadavg_1min": [load_before, os.getloadavg()[0]],
        "engine_commit": os.environ.get("FLEXGEN_HELM_ENGINE_COMMIT") or _source_commit(),
    }


def _source_commit() -> str:
    """The git commit of the code that measured (with "+" if flexgen_helm/ had local changes), or ""."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no", str(here.parent)],
            capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + ("+" if head and dirty else "")


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: resets VmHWM to the current RSS
    except OSError:
        pass


def measure_all(configs: dict, out: Path, prompt_len: int, gen_len: int, repeats: int, offload_dir: str | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, (policy, what) in configs.items():
        path = out / f"{name}.json"
        if path.exists():
            earlier = Policy.from_dict(json.loads(path.read_text())["policy"])
            if earlier == policy:
                continue
            # the search now picks another policy: keep the measured one as a grid point
            w = round(earlier.weights.gpu * 100)
            path.rename(out / f"earlier-{name}-{earlier.gpu_batch_size}x{earlier.num_gpu_batches}-w{w}.json")
        cmd = [sys.executable, "-m", "flexgen_helm.tools.validation.validate", "one", "--policy-json", policy.to_json(),
               "--prompt-len", str(prompt_len), "--gen-len", str(gen_len), "--repeats", str(repeats),
               "--json", str(path)] + (["--offload-dir", offload_dir] if offload_dir else [])
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {what}", flush=True)
        subprocess.run(cmd, check=False)


GRID_SHAPES = ((2, 1), (4, 1), (8, 1), (4, 2))


def grid_configs(profile_path: str, cpu_mem: str, max_block: int) -> dict[str, tuple[Policy, str]]:
    """The auto policy for a RAM budget that forces part of the weights to disk, and a small
    hand-made grid: each block shape with the most weights in RAM (in steps of 10%) that the
    budget allows."""
    from flexgen_helm.planner.budget import parse_size
    from flexgen_helm.planner.cost_model import CostModel, Workload
    from flexgen_helm.planner.hardware_profile import HardwareProfile
    from flexgen_helm.planner.search import SearchOptions, default_budgets, fits, search
    from flexgen_helm.weights.registry import resolve

    cfg = resolve(MODEL, dummy=True).config
    profile = HardwareProfile.load(profile_path)
    budgets = default_budgets(profile, cpu=parse_size(cpu_mem))
    best = search(cfg, profile, PROMPT_LEN, GEN_LEN, budgets, SearchOptions(max_block_size=max_block))
    out = {"auto": (best.policy, f"searched: {best.policy.describe()}")}
    model = CostModel(cfg, profile, Workload(PROMPT_LEN, GEN_LEN))
    for gbs, nb in GRID_SHAPES:
        for wg in range(90, -1, -10):
            p = Policy(gbs, nb, weights=Split(wg / 100, 0, 1 - wg / 100))
            if fits(model.estimate(p), budgets):
                out[f"grid-{gbs}x{nb}-w{wg}"] = (p, f"hand grid: {p.describe()}")
                break
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flexgen_helm.tools.validation.validate")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--out", default="runs/policy/measured")
    m.add_argument("--only", nargs="*", help="config names (default: all)")
    o = sub.add_parser("one")
    o.add_argument("--policy-json", required=True)
    o.add_argument("--json", required=True)
    g = sub.add_parser("grid", help="the auto policy vs a grid, under a RAM budget")
    g.add_argument("--out", default="runs/policy/grid")
    g.add_argument("--profile", default="runs/policy/hardware.json")
    g.add_argument("--cpu-mem", default="2GiB")
    g.add_argument("--max-block", type=int, default=8, help="sequences per block (a run must finish in minutes)")
    r = sub.add_parser("report")
    r.add_argument("--out", default="runs/policy")
    r.add_argument("--profile", help="hardware profile JSON (default: the saved one)")
    for q in (m, o, g):
        q.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
        q.add_argument("--gen-len", type=int, default=GEN_LEN)
        q.add_argument("--repeats", type=int, default=2)
        q.add_argument("--offload-dir")
    args = p.parse_args(argv)
    if args.cmd == "one":
        result = measure_one(Policy.from_dict(json.loads(args.policy_json)), args.prompt_len, args.gen_len,
                             args.repeats, args.offload_dir)
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"  {result['total_throughput']:.2f} token/s, total {result['total_latency_s']:.1f} s", flush=True)
    elif args.cmd == "measure":
        configs = {k: v for k, v in CONFIGS.items() if not args.only or k in args.only}
        measure_all(configs, Path(args.out), args.prompt_len, args.gen_len, args.repeats, args.offload_dir)
    elif args.cmd == "grid":
        configs = grid_configs(args.profile, args.cpu_mem, args.max_block)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "grid.json").write_text(json.dumps({"cpu_mem": args.cpu_mem, "max_block": args.max_block,
                                                   "configs": {k: p.to_dict() for k, (p, _) in configs.items()}},
                                                  indent=1))
        measure_all(configs, out, args.prompt_len, args.gen_len, args.repeats, args.offload_dir)
    else:
        write_report(Path(args.out), args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
