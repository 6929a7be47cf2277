"""How fast this host reads weights from RAM, three ways, for the decode floors of issue 49:
a plain reduction over 2 GiB (torch.sum: the memory's rate as two threads see it), bf16
products of a few rows over an MoE layer's experts (192 distinct 1024 x 2048 weights, 805 MB:
no weight is in the caches when it is used), and torch's int4 CPU kernel over the same
weights at 4 bits (groups of 64). GB/s of weight bytes read (codes and scales for int4).

    python runs/bench/read_rates/bench.py --out runs/bench/read_rates/results.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from flexgen_helm.compression.int4 import CompressedWeight, pack_int4
from flexgen_helm.compression.quantize import quantize
from flexgen_helm.memory.host_allocator import keep_freed_host_memory
from flexgen_helm.memory.machine import machine_label
from flexgen_helm.policy.policy import Compression

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from record import median_seconds

WEIGHTS, OUT_F, IN_F = 192, 1024, 2048  # OLMoE-1B-7B: one block's 64 experts x 3 projections
ROWS = (1, 2, 4, 8, 16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    keep_freed_host_memory()
    row = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": machine_label(), "load_before": os.getloadavg()[0], "threads": torch.get_num_threads()}
    big = torch.ones(1 << 30, dtype=torch.bfloat16)
    row["sum_2gib_gb_s"] = round(big.numel() * 2 / median_seconds(big.sum, 5) / 1e9, 1)
    del big
    g = torch.Generator().manual_seed(0)
    dense = [torch.randn(OUT_F, IN_F, generator=g).to(torch.bfloat16) for _ in range(WEIGHTS)]
    packed = [CompressedWeight([(0, pack_int4(quantize(w, Compression(4, 64, 1), 1), torch.device("cpu")))],
                               w.shape, torch.bfloat16, None) for w in dense]
    int4_bytes = sum(p.parts[0][1].nbytes for p in packed)
    for rows in ROWS:
        x = torch.randn(rows, IN_F, generator=g).to(torch.bfloat16)
        bf16_s = median_seconds(lambda x=x: [F.linear(x, w) for w in dense], 5)
        int4_s = median_seconds(lambda x=x: [p.kernel_linear(x) for p in packed], 5)
        row[f"bf16_rows{rows}_gb_s"] = round(WEIGHTS * OUT_F * IN_F * 2 / bf16_s / 1e9, 1)
        row[f"int4_rows{rows}_gb_s"] = round(int4_bytes / int4_s / 1e9, 1)
        row[f"int4_rows{rows}_us_a_call"] = round(int4_s / WEIGHTS * 1e6, 1)
    print(json.dumps(row))
    with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
