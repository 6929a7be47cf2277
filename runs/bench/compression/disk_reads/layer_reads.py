"""How fast the blocks' weights come off disk, one tensor at a time against all of a layer's
reads in flight together (memory/weight_homes.load_layer), with a bf16 matmul loop running
beside them in another process, as compute does in a decode step.

    python runs/bench/compression/disk_reads/layer_reads.py --weights {bf16,4bit} [--json PATH]

OPT-1.3B dummy weights, bf16, every weight on disk (O_DIRECT; one read in flight per tensor
read, as this host's profile picks). Each round reads every block once each way; the first
round warms up and is dropped. Run it alone."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from flexgen_helm.engine import Engine
from flexgen_helm.memory import weight_homes
from flexgen_helm.memory.direct_io import set_reads_in_flight
from flexgen_helm.memory.machine import machine_label
from flexgen_helm.policy import Compression, Policy, Split

BURN = "import torch\na = torch.randn(2048, 2048, dtype=torch.bfloat16)\nwhile True:\n    a @ a\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", choices=["bf16", "4bit"], required=True)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--offload-dir", default="/tmp/flexgen-helm-offload")
    parser.add_argument("--json")
    args = parser.parse_args()
    compression = Compression(4, 64) if args.weights == "4bit" else None
    engine = Engine.load("facebook/opt-1.3b", Policy(4, 2, weights=Split(0, 0, 1), compress_weight=compression),
                         dummy=True, dtype="bfloat16", device="cpu", offload_dir=args.offload_dir, progress=False)
    set_reads_in_flight(1)
    rt = engine.runtime
    blocks = [[t.store_name for t in layer.tensors] for layer in rt.layers if layer.kind == "block"]
    nbytes = sum(weight_homes.segment_nbytes(rt.homes[n].spec, s, compression, torch.bfloat16)
                 for names in blocks for n in names for s in rt.homes[n].segments)
    pool = ThreadPoolExecutor(16)

    def read(name):
        return weight_homes.read_parts(rt.homes[name], rt.store)

    ways = {"one at a time": lambda names: [read(n) for n in names],
            "together": lambda names: list(pool.map(read, names))}
    speeds = {way: [] for way in ways}
    burn = subprocess.Popen([sys.executable, "-c", BURN])
    load = os.getloadavg()
    try:
        for r in range(args.rounds):
            for way, fn in ways.items():
                t0 = time.perf_counter()
                for names in blocks:
                    fn(names)
                if r:
                    speeds[way].append(nbytes / (time.perf_counter() - t0) / 1e9)
    finally:
        burn.kill()
        engine.close()
    out = {"host": machine_label(), "weights": args.weights, "bytes_per_pass": nbytes, "load_average_before": load,
           "gb_per_s": {way: [round(s, 3) for s in v] for way, v in speeds.items()},
           "median_gb_per_s": {way: round(statistics.median(v), 3) for way, v in speeds.items()},
           "command": " ".join(["python", *sys.argv])}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
