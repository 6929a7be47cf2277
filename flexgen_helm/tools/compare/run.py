"""`flexgen-helm compare`: every system on the same setup, one after the other in this run,
each in its own process (own memory, own disk counters), then the table and, from the same
run, the ablation table.

Every one of our policies is decided before anything runs: a policy search that fails stops
the comparison with its reason (which tier is short, by how much) before minutes are spent,
and no row ever benchmarks some other policy in its place. A system whose run fails is a
row saying so, and the command exits non-zero after writing what did finish."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm import tqdm

from flexgen_helm.errors import FlexGenError
from flexgen_helm.memory.devices import DTYPES
from flexgen_helm.planner.hardware_profile import HardwareProfile, load_or_profile, matmul_flops_now
from flexgen_helm.policy.policy import Policy
from flexgen_helm.tools.compare import table
from flexgen_helm.tools.compare.ablations import ablation_policies
from flexgen_helm.tools.compare.accelerate_offload import largest_batch
from flexgen_helm.tools.compare.disk import measure_read_bandwidth
from flexgen_helm.tools.compare.flexgen_reference import PUBLISHED
from flexgen_helm.tools.compare.ours import FOUR_BIT, bench_flags, deepspeed_policy, searched
from flexgen_helm.tools.compare.roofline import ram_resident, roofline
from flexgen_helm.tools.compare.workloads import (
    DEFAULT_SYSTEMS,
    Setup,
    cost_model,
    offload_dir,
    prepare_hf,
    prepare_store,
)
from flexgen_helm.weights.registry import resolve

GPU_ONLY = ("DeepSpeed ZeRO-Inference (needs deepspeed and a CUDA GPU). The FlexGen reference (PyPI flexgen "
            "0.1.8: --systems flexgen-reference flexgen-reference-4bit) runs on the GPU setups only, as it calls "
            "torch.cuda unconditionally.")
LABELS = {"ours-deepspeed-policy": "ours, w/ DeepSpeed policy (row by row)",
          "ours-auto": "ours, --policy auto (searched)",
          "ours-4bit": "ours, --policy auto with 4-bit weights"}


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def run_logged(cmd: list[str], timeout_s: int) -> subprocess.CompletedProcess:
    """Runs one side of a comparison, printing it with the load it starts under; a command
    that fails or overruns is an error naming it (never a row quietly missing)."""
    print(f"load {loadavg():.2f}: {shlex.join(cmd)}", flush=True)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise FlexGenError(f"`{shlex.join(cmd)}` took more than {timeout_s} s") from e
    if done.returncode != 0:
        raise CommandFailed(f"`{shlex.join(cmd)}` failed ({exit_status(done.returncode)}):\n{done.stderr[-3000:]}",
                            done.returncode)
    return done


class CommandFailed(FlexGenError):
    """A comparison's command that exited with an error (returncode: minus a signal's number
    where one killed it)."""

    def __init__(self, message: str, returncode: int):
        super().__init__(message)
        self.returncode = returncode


def exit_status(returncode: int) -> str:
    """A child's exit code in words: subprocess gives a signal's death as minus its number."""
    if returncode >= 0:
        return f"exit {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"


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
        json_path.unlink(missing_ok=True)  # a record left by an earlier run must not pass for this one's
        try:
            done = subprocess.run(cmd, timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            return {"skipped": f"failed: timed out after {self.timeout_s} s"}, load
        if done.returncode != 0 or not json_path.exists():
            return {"skipped": f"failed ({exit_status(done.returncode)}; see the log)"}, load
        return json.loads(json_path.read_text()), load


@dataclass
class Planned:
    """One of our rows, decided before anything runs."""

    system: str
    label: str
    policy: Policy | None  # None: not run (see note)
    note: str = ""


def plan_ours(setup: Setup, systems: tuple[str, ...], ablations: bool, profile: HardwareProfile
              ) -> tuple[list[Planned], list[Planned], Policy | None]:
    """Our rows, the ablation rows and the searched policy (when either needs it). Raises the
    search's PolicyError when it finds nothing."""
    rows, best = [], None
    if "ours-auto" in systems or ablations:
        best = searched(setup, profile).policy
    for system in systems:
        if system == "ours-deepspeed-policy":
            try:  # a row-by-row block that fits nowhere is this row's result, not the comparison's failure
                rows.append(Planned(system, LABELS[system], deepspeed_policy(setup, profile)))
            except ValueError as e:
                rows.append(Planned(system, LABELS[system], None, f"does not fit: {e}"))
        elif system == "ours-auto":
            rows.append(Planned(system, LABELS[system], best))
        elif system == "ours-4bit":
            rows.append(Planned(system, LABELS[system], searched(setup, profile, FOUR_BIT).policy))
    extra = []
    if ablations:
        for i, (label, policy, note) in enumerate(ablation_policies(setup, best, profile)):
            extra.append(Planned(f"ablation-{i + 1}-{label.replace(' ', '-')}", label, policy, note))
    return rows, extra, best


def with_measured_disk(profile: HardwareProfile, bandwidth: dict) -> HardwareProfile:
    """The profile with the disk read speeds measured at this run's start, for the search and the
    predictions. A shared VM's disk moved between 1.0 and 2.5 GB/s within a day, and a day-old
    profile's figure made every disk-bound prediction 1.4-1.75x too fast (runs/compare/NOTES.md)."""
    return replace(profile, disk_read_bytes_per_s=bandwidth["engine_read_bytes_per_s"],
                   disk_device_read_bytes_per_s=bandwidth["device_read_bytes_per_s"],
                   disk_read_modes=dict(bandwidth["read_bytes_per_s"]))


def with_compute_speed_now(profile: HardwareProfile) -> HardwareProfile:
    """The profile with its compute terms (prefill and decode) scaled by how much slower (or
    faster) the device multiplies now than when it was profiled (on top of any refit's scale),
    for the search and each row's prediction, as with_measured_disk does for the disk. Both
    rates are sustained (the profile's over each of its measurements, this one over
    SPEED_CHECK_SECONDS); a shared VM's CPU runs slower at times of the day, and the
    predictions would then read its morning speed as the afternoon's. Only with --speed-check:
    on the 2-core Xeon the check helped one row of four and hurt three (runs/compare/olmoe-1b-7b-
    p512-g32/2026-11-29_sustained_profile/NOTES.md), and since then its scale swung from 0.42 to
    2.41 between rows whose throughput the profile alone predicted within 7-16% (with the
    check: 2.23x and 0.54x; runs/compare/olmoe-1b-7b-p512-g32/2026-11-29_late/NOTES.md): there
    a few seconds do not tell the next minute."""
    now, profiled = matmul_flops_now(profile)
    scale = profiled / now
    time_scale = dict(profile.time_scale)
    for phase in ("prefill", "decode"):
        time_scale[f"{phase}.compute"] = time_scale.get(f"{phase}.compute", 1.0) * scale
    return replace(profile, time_scale=time_scale)


def row_context(setup: Setup, record: dict, policy: Policy | None, profile: HardwareProfile, bandwidth: dict,
                load: float) -> dict:
    """What the table needs besides the record: roofline, the cost model's prediction, RSS limit."""
    ctx = {"loadavg": load, "device_bytes_per_s": bandwidth["device_read_bytes_per_s"],
           "rss_limit_bytes": setup.gpu_bytes + setup.cpu_bytes + table.RSS_SLACK,
           "compute_time_scale": profile.time_scale.get("prefill.compute")}
    if record.get("skipped"):
        return ctx
    cfg = resolve(setup.model, dummy=True).config
    batch = record["effective_batch_size"]
    gpu_batch = policy.gpu_batch_size if policy is not None else batch
    in_ram = ram_resident(cfg, profile, policy, record, batch, setup.prompt_len + setup.gen_len, DTYPES[setup.dtype])
    ctx["roofline"] = roofline(cfg, profile, setup.dtype, batch, gpu_batch, setup.prompt_len, setup.gen_len,
                               table.disk_weight_bytes(record), bandwidth["device_read_bytes_per_s"],
                               table.disk_cache_bytes(record), **in_ram)
    if policy is not None:
        ctx["predicted_tok_s"] = cost_model(setup, profile).estimate(policy).throughput
    return ctx


def run_compare(setup: Setup, out: Path, warmup: int, timeout_s: int, systems: tuple[str, ...] = DEFAULT_SYSTEMS,
                bandwidth: dict | None = None, ablations: bool = True, profile_path: str | None = None,
                speed_check: bool = False) -> tuple[list[dict], list[dict], list[str]]:
    """Rows of `setup` and of its ablations (JSON per run under out/<setup.name>/) and the
    commands that ran. speed_check: plan and predict each row with the compute terms scaled by
    a speed check just before (with_compute_speed_now); else with the profile's as measured."""
    if any(s.startswith("flexgen-reference") for s in systems) and setup.name not in PUBLISHED:
        raise FlexGenError(f"{setup.name}: the FlexGen reference rows need a GPU setup with a policy FlexGen "
                           f"publishes ({', '.join(PUBLISHED)})")
    bandwidth = bandwidth or measure_read_bandwidth(offload_dir(setup))
    measured_disk = with_measured_disk(load_or_profile(profile_path, offload_dir=str(offload_dir(setup))), bandwidth)
    speed_now = with_compute_speed_now if speed_check else (lambda p: p)
    profile = speed_now(measured_disk)
    ours, extra, best = plan_ours(setup, systems, ablations, profile)  # fails here, before any run
    folder = out / setup.name
    folder.mkdir(parents=True, exist_ok=True)
    prepare_store(setup)
    if any(s.startswith("hf-accelerate") for s in systems):
        prepare_hf(setup)
    run = Runner(timeout_s)
    planned = {p.system: p for p in ours}

    def one(system: str, label: str, policy: Policy | None, note: str = "") -> dict:
        if system.startswith("hf-accelerate"):
            path = folder / f"{system}.json"
            argv = ["-m", "flexgen_helm.tools.compare.accelerate_offload", "--setup", setup.name,
                    "--batch", str(largest_batch(setup)), "--json", str(path)]
            if system == "hf-accelerate-page-cache":  # what accelerate gets when the OS caches its files
                argv.append("--no-evict-each-token")
        elif system.startswith("flexgen-reference"):
            path = folder / f"{system}.json"
            argv = ["-m", "flexgen_helm.tools.compare.flexgen_reference", "--setup", setup.name, "--json", str(path),
                    *(["--four-bit"] if system.endswith("-4bit") else [])]
        elif policy is None:
            return table.row(setup.name, system, {"skipped": note, "label": label}, {})
        else:
            path = folder / f"{system}.json"
            argv = ["-m", "flexgen_helm", *bench_flags(setup, policy, offload_dir(setup), label, path, warmup)]
        row_profile = speed_now(measured_disk)  # (with the check: as fast as the machine is just before this row)
        record, load = run(argv, path)
        record.setdefault("label", label)
        return table.row(setup.name, system, record, row_context(setup, record, policy, row_profile, bandwidth, load))

    # every row of both tables, one bar: row i of N, and the time left at the rows' mean so far
    # (each row's bench shows its own decode steps and their time left below it)
    auto_row_apart = ablations and "ours-auto" not in systems  # the ablations' baseline, run on its own
    bar = tqdm(total=len(systems) + auto_row_apart + len(extra), desc=f"compare {setup.name}", unit="row")

    def counted(*row_args) -> dict:
        row = one(*row_args)
        bar.update(1)
        return row

    with bar:
        rows = []
        for system in systems:
            p = planned.get(system)
            rows.append(counted(system, p.label if p else system, p.policy if p else None, p.note if p else ""))
        table.add_ratios(rows)
        ablation_rows = []
        if ablations:
            auto = next((r for r in rows if r["system"] == "ours-auto"), None)
            if auto is None:  # the searched policy's own row, when the main table did not run it
                auto = counted("ours-auto", LABELS["ours-auto"], best)
            ablation_rows.append({**auto, "label": "all optimizations (the ours-auto row)"})
            for p in extra:
                ablation_rows.append(counted(p.system, p.label, p.policy, p.note))
            add_ratio_to(ablation_rows, ablation_rows[0], "vs_all_optimizations")
    (folder / "bandwidth.json").write_text(json.dumps(bandwidth, indent=1))
    return rows, ablation_rows, run.commands


def add_ratio_to(rows: list[dict], base: dict, column: str) -> None:
    """Each row's throughput over `base`'s, in `column` (the ablation table: over all optimizations)."""
    for r in rows:
        r[column] = (round(r["throughput_tok_s"] / base["throughput_tok_s"], 2)
                     if r.get("throughput_tok_s") and base.get("throughput_tok_s") else None)


def bandwidth_note(bandwidth: dict) -> str:
    ways = ", ".join(f"{m} {v / 1e9:.3f}" for m, v in bandwidth["read_bytes_per_s"].items())
    device = bandwidth["device_read_bytes_per_s"] / 1e9
    ours = bandwidth["engine_read_bytes_per_s"] / 1e9
    return (f"Disk read bandwidth of the device (the roofline's): {device:.3f} GB/s, "
            f"the best of these ways of reading {bandwidth['chunk_bytes'] >> 20} MiB pieces of a fresh "
            f"{bandwidth['file_bytes'] / 2**30:g} GiB file in {bandwidth['directory']} with its pages evicted, "
            f"measured at the start of the run (GB/s): {ways}. Ours is the faster O_DIRECT way "
            f"(page cache bypassed; which one the saved profile picked: each row's disk column): "
            f"{ours:.3f} GB/s, {100 * ours / device:.0f}% of the device.")


def notes(setup_names: list[str], bandwidth: dict | None, extra: list[str]) -> list[str]:
    return [
        f"Setups: {', '.join(setup_names)} "
        "(flexgen_helm/tools/compare/workloads.py: model, prompt/gen lengths, budgets, the cap on blocks).",
        *([bandwidth_note(bandwidth)] if bandwidth else []),
        "roofline_tok_s (flexgen_helm/tools/compare/roofline.py): per phase, time >= max(the matmuls at the "
        "profiled matmul rate for the rows one GPU batch multiplies, the disk-resident weights - and in decode "
        "the KV cache on disk, as long as it is so far - at the device's bandwidth, and on a CPU, for our rows, "
        "the weights and KV cache a pass reads from RAM at twice the profile's memcpy rate); "
        "pct_of_roofline = measured / roofline throughput. predicted_tok_s: the cost model's prediction "
        "for the policy that ran, from this machine's hardware profile with the disk read speeds measured at the "
        "run's start (above), which the search planned with too, and its compute terms scaled by "
        "compute_time_scale (empty: none): any refit's scale, times, with --speed-check, the profile's matmul "
        "rate over the one sustained for a few seconds just before the row "
        "(planner/hardware_profile.matmul_flops_now; > 1: the machine multiplies slower than when profiled). "
        "The roofline keeps the profile's rates: what the hardware sustained when profiled (each rate the mean "
        "call of its measurement, not its fastest: a shared host's fastest call can be 2.4x what it sustains, "
        "runs/bench/matmul_sustained).",
        "disk_reads_per_token = bytes the process read from storage during the timed generation (/proc/self/io) "
        "/ (disk-resident weight bytes x generated tokens): about 1 means every token's weights came from disk "
        "(KV cache or activations placed on disk add their own reads on top).",
        "peak_rss_gib: the process's peak resident memory (VmHWM, loading included); rss_limit_gib = gpu + cpu "
        "budgets + 0.5 GiB.",
        "throughput = generated tokens / (prefill + decode), FlexGen's definition (flexgen_helm/tools/bench.py).",
        f"Not run here: {GPU_ONLY}",
        *extra,
    ]


ABLATION_COLUMNS = ["setup", "system", "label", "policy", "effective_batch", "total_s", "throughput_tok_s",
                    "vs_all_optimizations", "pct_of_roofline", "peak_rss_gib", "weights_read_from", "loadavg_1m",
                    "host"]


def main(args) -> int:
    from flexgen_helm.tools.compare.workloads import SETUPS

    out = Path(args.out)
    setups = [SETUPS[n] for n in args.setup]
    first = setups[0]
    prepare_store(first)
    bandwidth = measure_read_bandwidth(offload_dir(first))
    top = "flexgen-helm " + " ".join(args.argv)
    commands = [f"# load average {loadavg():.2f}\n{top}"]
    failed = 0
    for s in setups:
        rows, ablation_rows, cmds = run_compare(s, out, args.warmup, args.timeout, tuple(args.systems),
                                                bandwidth=bandwidth, ablations=not args.no_ablations,
                                                profile_path=args.profile, speed_check=args.speed_check)
        table.write(out / s.name, rows, f"{s.name}: ours vs Hugging Face accelerate",
                    notes([s.name], bandwidth, []), [commands[0], *cmds])
        if ablation_rows:
            table.write(out / s.name / "ablations", ablation_rows,
                        f"Ablations on {s.name} (from the same run as its comparison)",
                        notes([s.name], bandwidth, []), [commands[0], *cmds], columns=ABLATION_COLUMNS)
        failed += sum(1 for r in rows + ablation_rows if str(r.get("weights_read_from", "")).startswith("failed"))
    # the top-level table: every setup's rows found under out/ (each from its own run)
    folders = [f.parent for f in sorted(out.glob("*/results.csv"))]
    all_rows = [r for f in folders for r in table.from_csv((f / "results.csv").read_text())]
    archived = (["Runs of older code: archive/ (labelled with their date, host and commit; not in this table)."]
                if (out / "archive").is_dir() else [])
    if (out / "NOTES.md").is_file():  # written by hand beside the tables; compare never rewrites it
        archived.append("Analysis of these tables (what bounds each row, this machine's limits): NOTES.md.")
    table.write(out, all_rows, "Throughput: ours vs Hugging Face accelerate (same machine)",
                notes([f.name for f in folders], None,
                      ["Each setup's folder has its JSON records, its commands, the load average before each "
                       "run, the disk bandwidth its roofline used (bandwidth.json) and its ablations.",
                       *archived]),
                [f"cat {f / 'README.md'}  # the commands of {f.name}" for f in folders])
    if failed:
        print(f"compare: {failed} run(s) failed; their rows say so (see the log above)", file=sys.stderr)
        return 1
    return 0
