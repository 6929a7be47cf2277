"""Where a decode step's time goes: a torch.profiler trace of a few decode steps of one policy,
summed by operation and by thread. Written for issue 51's question (runs/gpu/h200-2026-11-28/
README.md, sections 2 and 3): on a GPU our decode steps are bound by the host, and overlap made
them slower. This trace shows which host work a layer spends its time on (the kernels launched,
the Python around them, the copy engine's threads beside the compute thread), with the GPU's
own time beside it. It runs on a CPU too (the same host-side tables, no GPU column).

    python runs/gpu/decode_trace.py --model facebook/opt-6.7b --dummy --device cuda --dtype float16 \
        --prompt-len 512 --policy '{"gpu_batch_size": 16, ...}' --label searched --out DIR

Writes DIR/LABEL.txt: per decode step, the wall time, the operations launched and the
host time by thread; the operations by host time and by GPU time.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from flexgen_helm.engine import Engine
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.policy.policy import Policy

WARMUP_STEPS, TRACED_STEPS = 2, 3  # decode steps skipped (the prefill counts as one), then traced


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dummy", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--policy", required=True, help="the policy as JSON (Policy.to_dict), or a file holding it")
    p.add_argument("--label", required=True)
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args()


def read_policy(text: str) -> Policy:
    path = Path(text)
    return Policy.from_dict(json.loads(path.read_text() if path.is_file() else text))


def per_thread_cpu(events) -> dict[int, float]:
    """Self host time (ms) of the operations each thread ran."""
    totals: dict[int, float] = collections.defaultdict(float)
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU:
            totals[e.thread] += e.self_cpu_time_total / 1e3
    return dict(totals)


def is_top_level_op(e) -> bool:
    """An aten operation called from Python (not from inside another one)."""
    return e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))


def table(averages, key: str, limit: int) -> str:
    return averages.table(sort_by=key, row_limit=limit, max_name_column_width=60)


def main() -> None:
    args = parse()
    policy = read_policy(args.policy)
    engine = Engine.load(args.model, policy, dummy=args.dummy, device=args.device, dtype=args.dtype, progress=False)
    cfg = engine.runtime.config
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, cfg.vocab_size, (policy.block_size, args.prompt_len), generator=g).tolist()
    steps = 1 + WARMUP_STEPS + TRACED_STEPS + 1
    engine.generate(prompts, SamplingParams(max_new_tokens=2, ignore_eos=True))  # warm-up
    cuda = engine.runtime.devices.compute.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    walls: list[float] = []
    with profile(activities=activities, schedule=schedule(wait=WARMUP_STEPS, warmup=1, active=TRACED_STEPS),
                 record_shapes=False) as prof:
        last = [time.perf_counter()]

        def on_step(done: int, total: int) -> None:
            now = time.perf_counter()
            walls.append(now - last[0])
            last[0] = now
            prof.step()

        engine.generate(prompts, SamplingParams(max_new_tokens=steps, ignore_eos=True), on_step=on_step)
    events = prof.events()
    averages = prof.key_averages()
    traced = walls[1 + WARMUP_STEPS:1 + WARMUP_STEPS + TRACED_STEPS]
    top_level = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CPU and is_top_level_op(e))
    threads = per_thread_cpu(events)
    # the step's own self time: the host's time outside every operation (Python, waits)
    outside = sum(a.self_cpu_time_total for a in averages if a.key.startswith("ProfilerStep")) / 1e3
    lines = [
        f"{args.label}: {cfg.name}, {policy.describe()}, {args.dtype} on {engine.runtime.devices.compute}",
        f"decode steps traced: {TRACED_STEPS} (after the prefill and {WARMUP_STEPS} more); wall per step (ms, "
        f"with the profiler's own cost): {', '.join(f'{w * 1e3:.1f}' for w in traced)}",
        f"top-level aten operations per step: {top_level / TRACED_STEPS:.0f} "
        f"({top_level / TRACED_STEPS / cfg.num_layers:.1f} per layer)",
        f"host time outside the operations (the Python around them, waits): {outside / TRACED_STEPS:.1f} ms per step",
        "host time by thread (ms per step, self time of the operations it ran): "
        + ", ".join(f"{tid}: {ms / TRACED_STEPS:.1f}" for tid, ms in sorted(threads.items(), key=lambda x: -x[1])),
        "",
        "operations by host time (self):",
        table(averages, "self_cpu_time_total", 40),
    ]
    if cuda:
        lines += ["operations by GPU time (self):", table(averages, "self_device_time_total", 25)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.label}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:4]))


if __name__ == "__main__":
    main()
