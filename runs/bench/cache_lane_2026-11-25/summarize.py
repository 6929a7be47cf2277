"""Print the README's tables from the bench records (`{before,after}-N.json`) of this folder
or of a folder under it.

Usage: python summarize.py [opt67]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).parent


def main() -> None:
    folder = HERE / (sys.argv[1] if len(sys.argv) > 1 else ".")
    print("| side | round | decode (s) | a step (ms) | decode disk reads (GB/s) | compute (ms; unpack) "
          "| cache lane (ms; unpack) | weights lane (ms) | RSS peak (GiB) | load before |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for side in ("before", "after"):
        for path in sorted(folder.glob(f"{side}-*.json")):
            r = json.loads(path.read_text())
            steps = r["gen_len"] - 1
            d = {k: 1000 * v / steps for k, v in r["breakdown"]["decode"].items()}
            # the timed run's reads: the prefill reads every weight once, the decode steps the rest
            weights = sum(r["memory"]["placement"]["weight_bytes"].values())
            decode_gbs = (r["disk_read_bytes"] - weights) / r["decode_latency_s"] / 1e9
            unpack = f"; {d['unpack_cache']:.0f}"
            # before, the cache lane unpacked; after, the compute thread does
            compute = f"{d['compute']:.0f}" + (unpack if side == "after" else "")
            cache_lane = f"{d['load_cache']:.0f}" + (unpack if side == "before" else "")
            cells = [side, path.stem.split("-")[1], f"{r['decode_latency_s']:.2f}",
                     f"{1000 * r['decode_latency_s'] / steps:.0f}", f"{decode_gbs:.2f}", compute, cache_lane,
                     f"{d['load_weight']:.0f}", f"{r['memory']['cpu_peak_rss_bytes'] / 2**30:.2f}",
                     " ".join(f"{x:.2f}" for x in r["load_average_before"])]
            print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
