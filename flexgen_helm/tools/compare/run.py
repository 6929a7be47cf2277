"""`flexgen-helm compare`: every system on the same setup, one after the other in this run,
each in its own process (own memory, own disk counters), then the table."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from flexgen_helm.tools.compare import table
from flexgen_helm.tools.compare.ablations import ablation_policies
from flexgen_helm.tools.compare.accelerate_offload import largest_batch
from flexgen_helm.tools.compare.disk import measure_read_bandwidth
from flexgen_helm.tools.compare.ours import bench_flags, deepspeed_policy, grid_policy, searched_policy
from flexgen_helm.tools.compare.workloads import DEFAULT_SYSTEMS, Setup, offload_dir, prepare_hf, prepare_store

GPU_ONLY = ("FlexGen reference (PyPI flexgen 0.1.8) and DeepSpeed ZeRO-Inference need a CUDA GPU "
            "(both call torch.cuda unconditionally); run `flexgen-helm compare` in a GPU session for those rows.")


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


class Runner:
    """Runs commands, records each one (verbatim) and the load average before it."""

    def __init__(self, timeout_s: int):
        self.timeout_s = timeout_s
        self.commands: list[str] = []

    def __call__(self, argv: list[str], json_path: Path) -> tuple[dict, float]:
        load = loadavg()
        cmd = [sys.executable, *argv]
        self.commands.append(f"# load average {load:.2f}\n" + shlex.join(["python", *argv]))
        print(f"[{time.strftime('%H:%M:%S')}] load {load:.2f}: {shlex.join(argv)}", flush=True)
        try:
            done = subprocess.run(cmd, timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            return {"skipped": f"timed out after {self.timeout_s} s"}, load
        if done.returncode != 0 or not json_path.exists():
            return {"skipped": f"failed (exit {done.returncode}; see the log)"}, load
        return json.loads(json_path.read_text()), load


def run_compare(setup: Setup, out: Path, max_block: int, warmup: int, timeout_s: int,
                systems: tuple[str, ...] = DEFAULT_SYSTEMS,
                bandwidth: dict | None = None) -> tuple[list[dict], list[str]]:
    """Rows of `setup` (JSON per system under out/<setup.name>/) and the commands that ran."""
    folder = out / setup.name
    folder.mkdir(parents=True, exist_ok=True)
    prepare_store(setup)
    if any(s.startswith("hf-accelerate") for s in systems):
        prepare_hf(setup)
    bandwidth = bandwidth or measure_read_bandwidth(offload_dir(setup))
    run = Runner(timeout_s)
    rows = []
    # one system after another: tqdm's estimate of the time left is each run's mean so far
    for system in tqdm(systems, desc=f"compare {setup.name}", unit="system"):
        path = folder / f"{system}.json"
        if system.startswith("hf-accelerate"):
            argv = ["-m", "flexgen_helm.tools.compare.accelerate_offload", "--setup", setup.name,
                    "--batch", str(largest_batch(setup)), "--json", str(path)]
            if system == "hf-accelerate-page-cache":  # what accelerate gets when the OS caches its files
                argv.append("--no-evict-each-token")
        else:
            policy, label = our_policy(setup, system, max_block)
            argv = ["-m", "flexgen_helm", *bench_flags(setup, policy, offload_dir(setup), label, path, warmup)]
        record, load = run(argv, path)
        record.setdefault("label", system)
        rows.append(table.row(setup.name, system, record, bandwidth["device_read_bytes_per_s"], load))
    table.add_ratios(rows)
    (folder / "bandwidth.json").write_text(json.dumps(bandwidth, indent=1))
    return rows, run.commands


def our_policy(setup: Setup, system: str, max_block: int):
    """(policy, label) of one of our rows."""
    if system == "ours-deepspeed-policy":
        return deepspeed_policy(setup), "ours, w/ DeepSpeed policy"
    if system == "ours-searched":
        return searched_policy(setup, max_block), "ours, searched (--policy auto's search)"
    return grid_policy(setup, max_block), "ours, best of a grid (largest block that fits)"


def run_ablations(setup: Setup, out: Path, max_block: int, warmup: int, timeout_s: int,
                  bandwidth: dict) -> tuple[list[dict], list[str]]:
    folder = out / "ablations" / setup.name
    folder.mkdir(parents=True, exist_ok=True)
    prepare_store(setup)
    run = Runner(timeout_s)
    rows = []
    settings = ablation_policies(setup, max_block)
    for i, (label, policy, note) in enumerate(tqdm(settings, desc=f"ablations {setup.name}", unit="setting")):
        if policy is None:
            rows.append(table.row(setup.name, label, {"skipped": note, "label": label}, None, None))
            continue
        path = folder / f"{i}-{label.split(' (')[0].replace(' ', '-').lower()}.json"
        record, load = run(["-m", "flexgen_helm",
                            *bench_flags(setup, policy, offload_dir(setup), label, path, warmup)], path)
        record.setdefault("label", label)
        rows.append(table.row(setup.name, label, record, bandwidth["device_read_bytes_per_s"], load))
    return rows, run.commands


def bandwidth_note(bandwidth: dict) -> str:
    ways = ", ".join(f"{m} {v / 1e9:.3f}" for m, v in bandwidth["read_bytes_per_s"].items())
    device = bandwidth["device_read_bytes_per_s"] / 1e9
    return (f"Disk read bandwidth of the device (the roofline's): {device:.3f} GB/s, "
            f"the best of these ways of reading {bandwidth['chunk_bytes'] >> 20} MiB pieces of a fresh "
            f"{bandwidth['file_bytes'] / 2**30:g} GiB file in {bandwidth['directory']} with its pages evicted, "
            f"measured at the start of the run (GB/s): {ways}; ours is direct_in_flight "
            f"({bandwidth['reads_in_flight']} O_DIRECT reads in flight, page cache bypassed).")


def notes(setup_names: list[str], bandwidth: dict | None, extra: list[str]) -> list[str]:
    return [
        f"Setups: {', '.join(setup_names)} "
        "(flexgen_helm/tools/compare/workloads.py: model, prompt/gen lengths, budgets).",
        *([bandwidth_note(bandwidth)] if bandwidth else []),
        "roofline_tok_s = effective batch x bandwidth / disk-resident weight bytes (each token reads them once); "
        "disk_reads_per_token = bytes the process read from storage during the timed generation (/proc/self/io) "
        "/ (disk-resident weight bytes x generated tokens): about 1 means every token's weights came from disk "
        "(KV cache or activations placed on disk add their own reads on top).",
        "throughput = generated tokens / (prefill + decode), FlexGen's definition (flexgen_helm/tools/bench.py).",
        f"Not run here: {GPU_ONLY}",
        *extra,
    ]


def main(args) -> int:
    from flexgen_helm.tools.compare.workloads import SETUPS

    out = Path(args.out)
    setups = [SETUPS[n] for n in args.setup]
    first = setups[0]
    prepare_store(first)
    bandwidth = measure_read_bandwidth(offload_dir(first))
    top = "flexgen-helm " + " ".join(args.argv)
    commands = [f"# load average {loadavg():.2f}\n{top}"]
    if not args.ablations_only:
        for s in setups:
            rows, cmds = run_compare(s, out, args.max_block, args.warmup, args.timeout, tuple(args.systems),
                                     bandwidth=bandwidth)
            table.write(out / s.name, rows, f"{s.name}: ours vs Hugging Face accelerate",
                        notes([s.name], bandwidth, []), [commands[0], *cmds])
        # the top-level table: every setup's rows found under out/ (each from its own run)
        folders = [f.parent for f in sorted(out.glob("*/results.csv")) if f.parent.name != "ablations"]
        all_rows = [r for f in folders for r in table.from_csv((f / "results.csv").read_text())]
        table.write(out, all_rows, "Throughput: ours vs Hugging Face accelerate (same machine)",
                    notes([f.name for f in folders], None,
                          ["Each setup's folder has its JSON records, its commands, the load average before each "
                           "run and the disk bandwidth its roofline used (bandwidth.json)."]),
                    [f"cat {f / 'README.md'}  # the commands of {f.name}" for f in folders])
    if args.ablations:
        s = SETUPS[args.ablations]
        rows, cmds = run_ablations(s, out, args.max_block, args.warmup, args.timeout, bandwidth)
        table.write(out / "ablations", rows, f"Ablations on {s.name}", notes([s.name], bandwidth, []),
                    [f"# load average {loadavg():.2f}\n{top}", *cmds])
    return 0
