"""Run a command and report the peaks of its resident memory by kind, read from
/proc/<pid>/status every 0.1 s: VmRSS, RssAnon (heap, tensors) and RssFile (mapped files,
such as a memory-mapped weight file a conversion read), so a peak can be told apart into
what the process allocated and what it keeps mapped.

    python runs/moe/gathered_prefill_memory/rss_by_kind.py --json out.json -- flexgen-helm bench ...
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

KINDS = ("VmRSS", "RssAnon", "RssFile")
GIB = 2**30


def _status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in KINDS:
                out[key] = int(line.split()[1]) * 1024
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True, help="where to write the peaks and the sampled series")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to run after --")
    proc = subprocess.Popen(command)
    t0, series = time.perf_counter(), []
    while proc.poll() is None:
        try:
            series.append({"t_s": round(time.perf_counter() - t0, 2), **_status(proc.pid)})
        except OSError:  # exited between the poll and the read
            pass
        time.sleep(0.1)
    peaks = {k: max((row.get(k, 0) for row in series), default=0) for k in KINDS}
    print("peaks (GiB): " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in peaks.items()))
    with open(args.json, "w") as f:
        json.dump({"command": command, "rc": proc.returncode, "peaks_bytes": peaks, "series": series}, f)
    raise SystemExit(proc.returncode)


if __name__ == "__main__":
    main()
