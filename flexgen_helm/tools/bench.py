"""`flexgen-helm bench`: measured generation throughput under a policy (the paper's
definitions), with the placement achieved and the peak memory of each tier."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from flexgen_helm.compression.int4 import MAX_KERNEL_ROWS
from flexgen_helm.dist.launch import engine_class, is_reporting_rank
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.memory.copy_engine import cuda_copies
from flexgen_helm.memory.devices import DTYPE_NAMES, Devices, pick_devices
from flexgen_helm.memory.machine import machine_info
from flexgen_helm.memory.usage import process_disk_read_bytes
from flexgen_helm.planner.budget import check_budgets, parse_size, planned_bytes
from flexgen_helm.policy.policy import Policy
from flexgen_helm.weights.registry import resolve


def throughput(prefill: float, decode: float, batch: int, prompt_len: int, gen_len: int) -> dict:
    """FlexGen's definitions: generation throughput counts generated tokens over the whole
    time (prefill + decode seconds); decode throughput counts the tokens after the first
    over the decode time."""
    return {
        "prefill_latency_s": prefill,
        "prefill_throughput": batch * prompt_len / prefill if prefill else 0.0,
        "decode_latency_s": decode,
        "decode_throughput": batch * (gen_len - 1) / decode if decode else 0.0,
        "total_latency_s": prefill + decode,
        "total_throughput": batch * gen_len / (prefill + decode),
    }


STAGES = ("prefill", "decode")
EVENTS = ("compute", "load_weight", "load_cache", "store_cache", "load_hidden", "store_hidden")
# parts of a decode step's events (executor/schedule.py): attention of compute, the
# dequantization (or copy) into reused buffers of load_cache
DECODE_PARTS = ("attention", "unpack_cache")


def breakdown(timers: dict) -> dict:
    """Seconds per stage and kind of event (the schedule's "{stage}_{event}" timers).

    With overlap off these are the paper's Table 23 columns (compute, weight read, cache
    read, cache write; activations are the rest); with overlap on they overlap compute.
    """
    out = {stage: {e: timers.get(f"{stage}_{e}", 0.0) for e in EVENTS} for stage in STAGES}
    out["decode"].update({e: timers.get(f"decode_{e}", 0.0) for e in DECODE_PARTS})
    return out


def breakdown_clock(devices: Devices, synchronized: bool) -> str:
    """What the breakdown's compute times are (ModelRuntime.sync_stage_timers)."""
    if not devices.is_cuda:
        return "exact: the CPU computes synchronously"
    if synchronized:
        return "the GPU's: synchronized at every stage (--breakdown)"
    return "the host's: the GPU runs behind the host's queue (--breakdown for the GPU's)"


class TokenSteps:
    """The progress of one block's generation on stderr: the prefill, then a bar over the
    decode steps whose clock starts after the prefill, so that its estimate of the time left
    is the remaining steps at the decode steps' own pace (a prefill can take many of them)."""

    def __init__(self, desc: str, sequences: int, prompt_len: int, enabled: bool):
        self.desc, self.sequences, self.prompt_len, self.enabled = desc, sequences, prompt_len, enabled
        self.bar = None

    def __enter__(self) -> "TokenSteps":
        if self.enabled:
            self.bar = tqdm(desc=f"{self.desc}: prefill of {self.sequences} x {self.prompt_len} tokens",
                            unit="step", file=sys.stderr)
        return self

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            return
        if done == 1:  # the prefill made the first token: from here on, the decode steps
            self.bar.set_description(f"{self.desc}: decode")
            self.bar.reset(total=total - 1)
        else:
            self.bar.update(done - 1 - self.bar.n)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()


def run_bench(args, policy: Policy) -> dict:
    devices = pick_devices(args.device, args.dtype)
    resolved = resolve(args.model, path=args.path, dummy=args.dummy)
    cfg = resolved.config
    max_len = args.prompt_len + args.gen_len
    shared = args.shared_prefix if policy.prefix_sharing else 0
    planned = planned_bytes(cfg, policy, max_len, devices.dtype, act_len=args.prompt_len,  # as the search plans
                            shared_prefix=shared, gpu_compute=devices.is_cuda)
    check_budgets(planned, {t: parse_size(getattr(args, f"{t}_mem", None)) for t in ("gpu", "cpu", "disk")})

    engine = engine_class(args.pipeline).load(args.model, policy, path=args.path, dummy=args.dummy,
                                              offload_dir=args.offload_dir, device=args.device, dtype=args.dtype,
                                              progress=not args.quiet)
    engine.runtime.sync_stage_timers = args.breakdown
    g = torch.Generator().manual_seed(0)
    batch = policy.block_size
    prompts = torch.randint(10, cfg.vocab_size, (batch, args.prompt_len), generator=g)
    prompts[:, :args.shared_prefix] = prompts[0, :args.shared_prefix]  # a few-shot run's common instructions
    prompts = prompts.tolist()
    params = SamplingParams(max_new_tokens=args.gen_len, ignore_eos=True)
    progress = not args.quiet
    for i in range(args.warmup):
        with TokenSteps(f"bench warmup {i + 1}/{args.warmup}", batch, args.prompt_len, progress) as steps:
            engine.generate(prompts, SamplingParams(max_new_tokens=2, ignore_eos=True), on_step=steps)
    engine.runtime.usage.reset_peak()
    load_before = os.getloadavg()  # others may share this machine: say how busy it was
    reads_before = process_disk_read_bytes()
    with TokenSteps("bench", batch, args.prompt_len, progress) as steps:
        stats = engine.generate(prompts, params, on_step=steps).stats
    disk_read_bytes = process_disk_read_bytes() - reads_before
    result = {
        "label": getattr(args, "label", None),
        "model": cfg.name,
        "dummy": args.dummy,
        "dtype": DTYPE_NAMES[devices.dtype],
        "device": str(devices.compute),
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        "policy": policy.to_dict(),
        "policy_summary": policy.describe(),
        "effective_batch_size": batch,
        **throughput(stats.prefill_s, stats.decode_s, batch, args.prompt_len, args.gen_len),
        "planned_bytes": planned,
        # 4-bit weights: activation rows up to which they multiplied on the int4 kernel (None: all)
        "int4_kernel_max_rows": MAX_KERNEL_ROWS.get(devices.compute.type) if policy.compress_weight else None,
        # what came from storage, not the page cache, during the timed generation
        "disk_read_bytes": disk_read_bytes,
        "memory": stats.memory,
        "timers": stats.timers,
        "breakdown": breakdown(stats.timers),
        "breakdown_clock": breakdown_clock(devices, args.breakdown),
        # FLEXGEN_HELM_CUDA_COPIES as set (memory/copy_engine.py): copies on streams apply only
        # where executor/transfer_ways.copies_on_streams allows them (nothing on disk, no host reads of RAM)
        "cuda_copies_setting": cuda_copies() if devices.is_cuda else None,
        "hardware": machine_info(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "command": shlex.join(["flexgen-helm", *sys.argv[1:]]),
    }
    if getattr(engine, "world", 1) > 1:
        result["pipeline"] = {"stages": engine.world, "layer_bounds": engine.bounds,
                              "memory_of": "stage 0 (each stage holds its own share)"}
    engine.close()
    if not is_reporting_rank(engine):
        return result
    _print(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


def _print(r: dict) -> None:
    gib = 2**30
    mem = r["memory"]
    frac = mem["placement"]["weight_fractions"]
    print(f"model: {r['model']}{' (dummy weights)' if r['dummy'] else ''}, {r['dtype']} on {r['device']}")
    print(f"policy: {r['policy_summary']}; effective batch {r['effective_batch_size']}")
    placed = mem["placement"]["weight_bytes"]
    print("weights placed: " + ", ".join(f"{t} {100 * f:.1f}% ({placed[t] / gib:.2f} GiB)" for t, f in frac.items()))
    print(f"prefill: {r['prefill_latency_s']:.3f} s, {r['prefill_throughput']:.1f} token/s")
    print(f"decode:  {r['decode_latency_s']:.3f} s, {r['decode_throughput']:.2f} token/s")
    print(f"total:   {r['total_latency_s']:.3f} s, {r['total_throughput']:.2f} token/s")
    steps = r["gen_len"] - 1
    if steps > 0:
        d = {k: 1000 * v / steps for k, v in r["breakdown"]["decode"].items()}
        # a load is unpacked by the compute thread on a CPU, on the copy lane on a GPU (executor/schedule.py)
        unpack = f"unpack/dequantize {d['unpack_cache']:.1f}"
        on_cpu = torch.device(r["device"]).type == "cpu"
        compute = f"attention {d['attention']:.1f}" + (f", cache {unpack}" if on_cpu else "")
        load = f"load cache {d['load_cache']:.1f}" + ("" if on_cpu else f" ({unpack})")
        print(f"a decode step (ms, mean of {steps}; with overlap on, loads and stores run beside compute; "
              f"compute times {r['breakdown_clock']}): "
              f"compute {d['compute']:.1f} ({compute}), {load}, store cache {d['store_cache']:.1f}, load weights "
              f"{d['load_weight']:.1f}, load/store hidden {d['load_hidden']:.1f}/{d['store_hidden']:.1f}")
    timers = r["timers"]
    if "prefill_experts_loaded" in timers or "decode_experts_loaded" in timers:
        # executor/expert_weights.py: experts read off a lower tier, as the routers chose them
        per_step = {"prefill": 1, "decode": max(steps, 1)}
        print("experts read off lower tiers per step: " + ", ".join(
            f"{stage} {timers.get(f'{stage}_experts_loaded', 0) / n:.1f} "
            f"({timers.get(f'{stage}_expert_read_bytes', 0) / n / gib:.3f} GiB)" for stage, n in per_step.items()))
    tiers = mem["tiers"]
    peaks = ", ".join(f"{t} {tiers[t]['peak_bytes'] / gib:.2f} GiB" for t in tiers)
    print(f"peak memory (weight homes in RAM, KV cache, activations): {peaks}; "
          f"process RSS peak {mem['cpu_peak_rss_bytes'] / gib:.2f} GiB")
    print(f"disk reads bypass the page cache with: {mem['disk_page_cache_bypass']}")
