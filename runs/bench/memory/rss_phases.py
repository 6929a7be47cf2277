"""Where a `flexgen-helm bench` run's resident memory goes: the process's VmRSS and VmHWM
(/proc/self/status), glibc's heap (mallinfo2: bytes in use, freed but kept) and the
engine's own accounting (TierUsage) read at the engine's phase boundaries - weights
converted, weights placed, cache and activation homes made, after every layer of every
GPU batch, after each token step. tracemalloc cannot see torch's allocations; these can.

    PYTHONPATH=. python runs/bench/memory/rss_phases.py --json out.json -- \\
        --model facebook/opt-1.3b --dummy --prompt-len 128 --gen-len 8 --gpu-mem 1GiB --cpu-mem 2GiB --policy auto

Everything after `--` is `flexgen-helm bench`'s own flags. Prints the boundaries at which
the peak (VmHWM) rose and by how much, so the phase that set the peak is named. RSS does
not depend on the machine's load; the timings bench prints do.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from pathlib import Path

GIB = 2**30


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mallinfo2():
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except AttributeError:  # not glibc >= 2.33
        return None
    fn.restype = _MallInfo2
    return fn


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(line.split()[1]) * 1024
    return out


class Recorder:
    def __init__(self):
        self.rows: list[dict] = []
        self.usage = None
        self._mallinfo2 = _mallinfo2()
        self.t0 = time.perf_counter()

    def mark(self, label: str) -> None:
        row = {"label": label, "t_s": time.perf_counter() - self.t0, **_status()}
        if self._mallinfo2 is not None:
            m = self._mallinfo2()
            # heap bytes malloc holds (main arena + others) in use, and freed but kept resident
            row.update(heap_in_use=m.uordblks, heap_free=m.fordblks, mmapped=m.hblkhd)
        if self.usage is not None:
            row["accounted"] = {t: int(v) for t, v in self.usage.current.items()}
        self.rows.append(row)

    def rises(self) -> list[tuple[dict, int]]:
        """(row, bytes the peak rose by since the row before) for every boundary that raised it."""
        out, last = [], 0
        for row in self.rows:
            if row["VmHWM"] > last:
                out.append((row, row["VmHWM"] - last))
                last = row["VmHWM"]
        return out


def install(rec: Recorder) -> None:
    """Wrap the engine's phase boundaries (no behaviour changes: each wrapper calls through)."""
    import flexgen_helm.engine as engine
    from flexgen_helm.executor import schedule

    def after(owner, name, label_of):
        inner = getattr(owner, name)

        def wrapped(*a, **kw):
            out = inner(*a, **kw)
            rec.mark(label_of(*a, **kw))
            return out
        setattr(owner, name, wrapped)

    after(engine, "open_weights", lambda *a, **kw: "weights converted/opened")

    build_homes = engine.build_homes

    def homes(*a, **kw):
        rec.usage = a[4] if len(a) > 4 else kw["usage"]
        out = build_homes(*a, **kw)
        rec.mark("weights placed (build_homes)")
        return out
    engine.build_homes = homes

    after(schedule.BlockSchedule, "__init__", lambda *a, **kw: "block schedule: KV cache and activation homes")
    after(schedule.BlockSchedule, "_run_layer",
          lambda self, layer, k, *a, **kw: f"{'prefill' if a[-1] else 'decode'} {layer.name} batch {k}")
    after(schedule.BlockSchedule, "prefill", lambda *a, **kw: "prefill done")
    after(schedule.BlockSchedule, "decode", lambda *a, **kw: "decode step done")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write every boundary's readings here")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then flexgen-helm bench's flags")
    args = ap.parse_args()
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args

    rec = Recorder()
    rec.mark("start (torch and the engine imported)")
    install(rec)
    from flexgen_helm.cli import main as cli_main

    rc = cli_main(["bench", *bench_args])
    rec.mark("end")
    print("\nwhere the peak RSS (VmHWM) rose:")
    for row, rise in rec.rises():
        acc = row.get("accounted", {})
        print(f"  +{rise / GIB:6.3f} GiB -> {row['VmHWM'] / GIB:6.3f}  at {row['label']:45s} "
              f"rss {row['VmRSS'] / GIB:.3f}, heap in use {row.get('heap_in_use', 0) / GIB:.3f} "
              f"free-kept {row.get('heap_free', 0) / GIB:.3f} mmapped {row.get('mmapped', 0) / GIB:.3f}, "
              "accounted " + " ".join(f"{t} {v / GIB:.3f}" for t, v in acc.items()))
    print(f"load average at the end: {Path('/proc/loadavg').read_text().strip()}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"bench_args": bench_args, "rc": rc, "rows": rec.rows}, indent=1))


if __name__ == "__main__":
    main()
