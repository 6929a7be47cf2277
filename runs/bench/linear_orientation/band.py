"""Where W x^T beats F.linear, by layer shape and row count, on this machine: the band of
decode-sized row counts that `flexgen-helm profile` looks for (dense_linear.py), measured on
the shapes of the models this project runs, not only the profile's two.

    python runs/bench/linear_orientation/band.py [--dtype float32] [--out band_<date>.jsonl]

Each gain is the profile's own measure (planner/hardware_profile.flipped_gains_of: F.linear's
time over W x^T's, the median of 5 pairs of back-to-back calls over 256 MiB of streamed
weights). One JSON line per shape, with the host, the load average before and after, and the
band the profile's rule (DeviceSpeeds.flipped_rows) takes from that shape alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import torch

from flexgen_helm.memory.devices import DTYPES
from flexgen_helm.memory.machine import machine_label
from flexgen_helm.planner.hardware_profile import DeviceSpeeds, flipped_gains_of

HERE = Path(__file__).resolve().parent
ROWS = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
SHAPES = {  # (out, in)
    "smollm2 attention (576, 576)": (576, 576),
    "smollm2 mlp up (1536, 576)": (1536, 576),
    "smollm2 mlp down (576, 1536)": (576, 1536),
    "smollm2 head (49152, 576)": (49152, 576),
    "opt-1.3b (2048, 2048)": (2048, 2048),
    "profile (4096, 2048)": (4096, 2048),
    "opt-1.3b mlp down (2048, 8192)": (2048, 8192),
    "opt-1.3b mlp up (8192, 2048)": (8192, 2048),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--out", type=Path, default=HERE / f"band_{datetime.date.today()}.jsonl")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    with open(args.out, "a") as f:
        for name, shape in SHAPES.items():
            load_before = os.getloadavg()[0]
            gains = flipped_gains_of(torch.device("cpu"), DTYPES[args.dtype], shape, ROWS)
            band = DeviceSpeeds(flipped_gains={args.dtype: gains}).flipped_rows(args.dtype)
            record = {"host": machine_label(), "threads": torch.get_num_threads(), "dtype": args.dtype,
                      "shape": name, "gains": {r: round(g, 2) for r, g in gains.items()}, "band": band,
                      "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                      "command": f"python runs/bench/linear_orientation/band.py --dtype {args.dtype}"}
            print(json.dumps(record), flush=True)
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
