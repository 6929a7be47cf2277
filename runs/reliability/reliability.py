"""Measure issue 25's goals with the real engine (SmolLM2-135M, the default deployment).

    python runs/reliability/reliability.py --work /tmp/rel [--instances 150] [--pairs 5]

  resume      helm-run (BatchingRunner) on LAMBADA + synthetic_reasoning, `--instances` each:
              once whole, then killed (SIGKILL) at 60% of the whole run's time and run again;
              what the rerun computed, and whether its completions equal the whole run's.
  convert     `flexgen-helm convert` killed at 4 moments (before its first write, 3 while
              writing); what the next `verify` and `convert` say, and whether the finished
              store equals a clean conversion.
  full_disk   a small tmpfs (needs root) under the store, the offload directory (KV cache on
              disk) and HELM's outputs (with the BatchingRunner and plain helm-run); the
              error each gives, tracebacks, and what a rerun with space had to recompute.
  threads     plain helm-run -n 1 and -n 16 (fresh caches), `--pairs` times: differing
              completions and hangs.
Writes results.json next to this file (or --results), each step with the script's command
line and the load average before and after. Correctness numbers, not timings.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
ENTRIES = ["lambada:model=flexgen/smollm2-135m", "synthetic_reasoning:mode=pattern_match,model=flexgen/smollm2-135m"]
RUNNER = ["--runner-class-name", "flexgen_helm.helm.runner.BatchingRunner"]
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
TRACEBACK = "Traceback (most recent call last)"


def start(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **OFFLINE, **(env or {})})


def finish(proc: subprocess.Popen, timeout: float) -> int | None:
    """The exit code, or None (killed) if it ran past `timeout` seconds: a hang."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None


def helm_cmd(local: Path, out: Path, n: int, instances: int, *extra: str, entries=tuple(ENTRIES)) -> list[str]:
    return [str(BIN / "helm-run"), "-r", *entries, "-m", str(instances), "--suite", "rel", "-o", str(out),
            "--local-path", str(local), "-n", str(n), *extra]


def completions(out: Path) -> dict[str, list]:
    found = {}
    for state in sorted((out / "runs" / "rel").glob("*/scenario_state.json")):
        rs = json.loads(state.read_text())["request_states"]
        found[state.parent.name.split(":")[0]] = [
            [(c["text"], [t["logprob"] for t in c["tokens"]]) for c in r["result"]["completions"]] for r in rs]
    return found


def differing(a: dict, b: dict) -> tuple[int, int]:
    """(requests whose completions differ, requests compared)."""
    diff = total = 0
    for name in set(a) | set(b):
        x, y = a.get(name, []), b.get(name, [])
        total += max(len(x), len(y))
        diff += sum(p != q for p, q in zip(x, y)) + abs(len(x) - len(y))
    return diff, total


def computed(log: Path) -> int:
    """Requests given to the engine, from the client's log lines ("flexgen: running N requests"):
    the planned batches of every scenario the run started (a killed run's unfinished ones too)."""
    return sum(int(m) for m in re.findall(r"flexgen: running (\d+) requests", log.read_text()))


def largest_batch(log: Path) -> int:
    """The largest batch the client planned, from its log lines ("... batches of up to N")."""
    return max(map(int, re.findall(r"batches of up to (\d+)", log.read_text())), default=0)


def cached_requests(local: Path) -> int:
    db = local / "cache" / "flexgen.sqlite"
    if not db.exists():
        return 0
    with sqlite3.connect(db) as con:  # the tokenizer's cache shares the file: count requests only
        return con.execute("SELECT COUNT(*) FROM unnamed WHERE key LIKE '%\"response_format\"%'").fetchone()[0]


# ----- resume after kill -9 -----------------------------------------------------------------


def resume(work: Path, instances: int) -> dict:
    work = work / "resume"
    shutil.rmtree(work, ignore_errors=True)
    t0 = time.time()
    rc = finish(start(helm_cmd(work / "whole-env", work / "whole-out", 4, instances, *RUNNER), work / "whole.log"),
                3600)
    whole_s = time.time() - t0
    whole = completions(work / "whole-out")
    total = sum(map(len, whole.values()))
    cmd = helm_cmd(work / "env", work / "out", 4, instances, *RUNNER)
    proc = start(cmd, work / "killed.log")
    time.sleep(0.6 * whole_s)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    cached_at_kill = cached_requests(work / "env")
    rerun_rc = finish(start(cmd, work / "rerun.log"), 3600)
    rerun_computed = computed(work / "rerun.log")
    diff, compared = differing(whole, completions(work / "out"))
    return {"helm_run": cmd, "requests": total, "whole_rc": rc, "whole_s": round(whole_s, 1),
            "killed_at_s": round(0.6 * whole_s, 1), "largest_batch": largest_batch(work / "whole.log"),
            "cached_at_kill": cached_at_kill, "killed_run_computed": computed(work / "killed.log"),
            "rerun_rc": rerun_rc, "rerun_computed": rerun_computed,
            "rerun_computed_fraction": round(rerun_computed / total, 3) if total else None,
            "completions_differing_from_whole_run": diff, "completions_compared": compared}


# ----- kill -9 during conversion ------------------------------------------------------------


def convert_cmd(out: Path) -> list[str]:
    return [str(BIN / "flexgen-helm"), "convert", "--dtype", "bfloat16", "--out", str(out)]


def store_state(out: Path) -> dict:
    names = [p.name for p in out.iterdir()] if out.is_dir() else []
    return {"tensor_files": sum(n.endswith(".bin") for n in names), "tmp_files": sum(n.endswith(".tmp") for n in names),
            "manifest": "manifest.json" in names}


def opens_as_store(out: Path) -> bool:
    """Whether the engine's store reader accepts the directory as weights."""
    code = ("import sys; from flexgen_helm.weights.store import TensorStore\n"
            f"try:\n TensorStore({str(out)!r})\nexcept Exception as e:\n print(e); sys.exit(1)")
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def run(cmd: list[str], env: dict | None = None, timeout: float = 1800) -> tuple[int, str]:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **OFFLINE, **(env or {})})
    return p.returncode, p.stdout + p.stderr


def timed_clean_conversion(out: Path, log: Path) -> tuple[int, float, float]:
    """A conversion run to its end: (rc, seconds, seconds until its first tensor file
    appeared). Most of a conversion is reading the GGUF and dequantizing before any write."""
    t0 = time.time()
    proc, first_write = start(convert_cmd(out), log), None
    while proc.poll() is None:
        if first_write is None and store_state(out)["tensor_files"]:
            first_write = time.time() - t0
        time.sleep(0.05)
    total = time.time() - t0
    return proc.returncode, total, first_write if first_write is not None else total


def kill_conversion(work: Path, written_fractions=(0.2, 0.5, 0.9)) -> dict:
    """Killed once halfway to the clean conversion's first tensor file, then as soon as
    `written_fractions` of its tensor files are on disk (polled: the timing of a run varies)."""
    work = work / "convert"
    shutil.rmtree(work, ignore_errors=True)
    rc, clean_s, first_write_s = timed_clean_conversion(work / "clean", work / "clean.log")
    clean = json.loads((work / "clean" / "manifest.json").read_text())["tensors"]
    moments = []
    for name, files in [("before-writing", 0)] + [(f"written-{f}", max(1, round(f * len(clean))))
                                                  for f in written_fractions]:
        out = work / f"killed-{name}"
        t0 = time.time()
        proc = start(convert_cmd(out), work / f"killed-{name}.log")
        if files == 0:
            time.sleep(first_write_s / 2)
        else:
            while proc.poll() is None and store_state(out)["tensor_files"] < files:
                time.sleep(0.005)
        kill_s = time.time() - t0
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        state = store_state(out)
        read_half = opens_as_store(out) and not state["manifest"]
        verify_rc, verify_out = run([str(BIN / "flexgen-helm"), "verify", str(out)])
        again_rc, again_out = run(convert_cmd(out))
        final = json.loads((out / "manifest.json").read_text())["tensors"]
        final_verify_rc, _ = run([str(BIN / "flexgen-helm"), "verify", str(out)])
        moments.append({"moment": name, "killed_at_s": round(kill_s, 1), "on_disk_at_kill": state,
                        "store_reader_accepted_half_written": read_half,
                        "verify_after_kill_rc": verify_rc, "verify_after_kill": verify_out.strip().splitlines()[:2],
                        "next_convert_rc": again_rc,
                        "next_convert_said": [ln for ln in again_out.splitlines() if ln.startswith("flexgen-helm:")],
                        "rebuilt_equals_clean": final == clean, "verify_after_rebuild_rc": final_verify_rc})
    return {"clean_rc": rc, "clean_s": round(clean_s, 1), "clean_first_tensor_file_s": round(first_write_s, 1),
            "clean_tensors": len(clean), "moments": moments}


# ----- full disk ----------------------------------------------------------------------------


class SmallFs:
    def __init__(self, where: Path, nbytes: int):
        self.where = where
        where.mkdir(parents=True, exist_ok=True)
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(where)], capture_output=True,
                           text=True)
        if p.returncode:
            raise SystemExit(f"full_disk needs a size-limited tmpfs (root): {p.stderr.strip()}")

    def __enter__(self):
        return self.where

    def __exit__(self, *exc):
        subprocess.run(["umount", "-l", str(self.where)])


def outcome(rc, text: str) -> dict:
    errors = [ln for ln in text.splitlines() if "flexgen-helm: error:" in ln]
    return {"rc": rc, "error": errors[-1] if errors else None, "tracebacks": text.count(TRACEBACK)}


KV_ON_DISK_DEPLOYMENT = """model_deployments:
  - name: flexgen/smollm2-135m
    model_name: flexgen/smollm2-135m
    tokenizer_name: flexgen/smollm2-135m
    max_sequence_length: 8192
    client_spec:
      class_name: flexgen_helm.helm.client.FlexGenClient
      args:
        model: smollm2-135m
        deployment: flexgen/smollm2-135m
        policy: {percent: [100, 0, 0, 0, 100, 0], gpu_batch_size: 64, num_gpu_batches: 1}
"""


def full_disk(work: Path, instances: int = 10) -> dict:
    work = work / "full_disk"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    results = {}
    # 1. converting: a 64 MiB file system for a 257 MiB store
    with SmallFs(work / "fs-store", 64 << 20) as fs:
        rc, text = run(convert_cmd(fs / "store"))
        left = [p.name for p in (fs / "store").iterdir()] if (fs / "store").exists() else []
        results["conversion"] = {**outcome(rc, text), "partial_files_left": [n for n in left if n.endswith(".tmp")]}
    # 2. the offloaded KV cache: HELM with the whole KV cache on disk (a prod_env deployment of
    #    the same name wins over the plugin's), the offload directory on 1 MiB
    env_dir = work / "kv-env"
    env_dir.mkdir()
    (env_dir / "model_deployments.yaml").write_text(KV_ON_DISK_DEPLOYMENT)
    with SmallFs(work / "fs-offload", 1 << 20) as fs:
        log = work / "kv.log"
        rc = finish(start(helm_cmd(env_dir, work / "kv-out", 4, instances, *RUNNER, entries=ENTRIES[:1]), log,
                          env={"FLEXGEN_HELM_OFFLOAD_DIR": str(fs)}), 1800)
        results["offloaded_kv_cache"] = {**outcome(rc, log.read_text()), "cached_requests": cached_requests(env_dir),
                                         "files_left_in_offload_dir": sum(1 for p in fs.rglob("*") if p.is_file())}
    log = work / "kv-rerun.log"
    rc = finish(start(helm_cmd(env_dir, work / "kv-out", 4, instances, *RUNNER, entries=ENTRIES[:1]), log,
                      env={"FLEXGEN_HELM_OFFLOAD_DIR": str(work / "offload")}), 1800)
    results["offloaded_kv_cache"].update(rerun_with_space_rc=rc, rerun_with_space_computed=computed(log))
    # 3. HELM's outputs: -o on a file system too small for them; the request cache elsewhere
    #    (LAMBADA alone in this part: one scenario shows each moment), with the BatchingRunner
    #    and with plain helm-run
    for name, runner in (("helm_outputs", RUNNER), ("helm_outputs_plain_helm_run", ())):
        with SmallFs(work / f"fs-{name}", 64 << 10) as fs:
            log = work / f"{name}.log"
            rc = finish(start(helm_cmd(work / f"{name}-env", fs, 4, instances, *runner, entries=ENTRIES[:1]), log),
                        1800)
            results[name] = {**outcome(rc, log.read_text()), "cached_requests": cached_requests(work / f"{name}-env"),
                             "helm_outputs_left": sorted(p.name for p in fs.glob("runs/rel/*/*.json"))}
        log = work / f"{name}-rerun.log"
        rc = finish(start(helm_cmd(work / f"{name}-env", work / f"{name}-with-space", 4, instances, *runner,
                                   entries=ENTRIES[:1]), log), 1800)
        results[name].update(rerun_with_space_rc=rc, rerun_with_space_computed=computed(log))
    return results


# ----- many threads -------------------------------------------------------------------------


def threads(work: Path, pairs: int, instances: int) -> dict:
    work = work / "threads"
    shutil.rmtree(work, ignore_errors=True)
    rows = []
    for i in range(pairs):
        got, rcs = {}, {}
        for n in (1, 16):
            tag = f"pair{i}-n{n}"  # a fresh cache each time, or the second run would only read the first
            rcs[n] = finish(start(helm_cmd(work / f"{tag}-env", work / f"{tag}-out", n, instances),
                                  work / f"{tag}.log"), 1800)
            got[n] = completions(work / f"{tag}-out")
        diff, compared = differing(got[1], got[16])
        rows.append({"pair": i, "rc_n1": rcs[1], "rc_n16": rcs[16], "differing": diff, "compared": compared})
    return {"pairs": rows, "differing": sum(r["differing"] for r in rows),
            "hangs": sum(r["rc_n1"] is None or r["rc_n16"] is None for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/flexgen-reliability"))
    ap.add_argument("--results", type=Path, default=HERE / "results.json")
    ap.add_argument("--instances", type=int, default=150, help="per scenario, for the resume experiment")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--thread-instances", type=int, default=24)
    ap.add_argument("--only", nargs="*", default=["convert", "full_disk", "threads", "resume"])
    args = ap.parse_args()
    results = json.loads(args.results.read_text()) if args.results.exists() else {}
    steps = {"convert": lambda: kill_conversion(args.work), "full_disk": lambda: full_disk(args.work),
             "threads": lambda: threads(args.work, args.pairs, args.thread_instances),
             "resume": lambda: resume(args.work, args.instances)}
    for name in args.only:
        print(f"== {name}", flush=True)
        load_before = os.getloadavg()
        results[name] = steps[name]()
        results[name].update(command=[Path(sys.executable).name, *sys.argv], load_average_before=load_before,
                             load_average_after=os.getloadavg())
        print(json.dumps(results[name], indent=1), flush=True)
        args.results.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
