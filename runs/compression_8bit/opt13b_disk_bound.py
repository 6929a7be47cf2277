"""The most 8-bit weights can gain over BF16 on OPT-1.3B 512/32 with the weights on disk (issue
48's 1.6x goal), from the two bench runs' JSONs and this host's memory read rate.

8-bit weights change the bytes read from disk and the products' inputs, not the products: a
prefill multiplies the same bf16 matmuls after a dequantization, and a decode step's attention
reads the same bf16 KV cache. So an 8-bit run takes at least its own prefill plus the least a
decode can take:
- its linears, 31 steps of 128 rows, at the rate the prefill's matmuls reached in that run;
- its attention's KV-cache reads, at the fastest rate this host reads memory (a sum over
  2 GiB of float32, the fastest of 6), even with the cache 4-bit (a quarter of the bytes).
The bound is taken at each run's host speed: the same matmuls' prefill took 190.6 s in the
BF16 run and 159.7 s in the 8-bit run, 8 minutes apart. At the 8-bit run's speed, BF16's total
is its measured decode (disk-bound: its weight loads outlast its compute at every step) added
to the 8-bit run's prefill.

    python runs/compression_8bit/opt13b_disk_bound.py runs/compression_8bit/opt13b_disk_xeon_2026-11-29
"""

import json
import os
import sys
import time
from pathlib import Path

import torch

from flexgen_helm.memory.machine import machine_label
from flexgen_helm.tools.compare.compute_floor import matmul_params_per_token
from flexgen_helm.weights.registry import resolve

MODEL = "facebook/opt-1.3b"


def main() -> None:
    folder = Path(sys.argv[1])
    bf16, w8 = (json.loads((folder / f"opt-1.3b-disk-{n}.json").read_text()) for n in ("bf16", "8bit-per-channel"))
    cfg = resolve(MODEL, dummy=True).config
    batch, prompt, steps = bf16["effective_batch_size"], bf16["prompt_len"], bf16["gen_len"] - 1
    per_token, head = matmul_params_per_token(cfg), cfg.vocab_size * cfg.hidden_size
    width = cfg.num_heads * cfg.head_dim
    prefill_flop = batch * (2.0 * (per_token - head) * prompt + 2.0 * head
                            + 2.0 * prompt * prompt * width * cfg.num_layers)
    decode_flop = 2.0 * per_token * batch * steps
    kv_bytes = sum(batch * (prompt + i) * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
                   for i in range(1, steps + 1))
    read = memory_read_rate()
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"# {machine_label()}, load {os.getloadavg()[0]:.2f}, {now}")
    print(f"memory read: {read / 1e9:.1f} GB/s; KV cache read by the decode steps: {kv_bytes / 1e9:.0f} GB "
          f"({kv_bytes / read:.1f} s at that rate, {kv_bytes / 4 / read:.1f} s as a 4-bit cache)")
    print(f"weights on disk: BF16 {bf16['disk_read_bytes'] / 1e9:.1f} GB read, 8-bit {w8['disk_read_bytes'] / 1e9:.1f} "
          f"GB ({bf16['disk_read_bytes'] / w8['disk_read_bytes']:.2f}x fewer bytes)")
    for name, run in (("BF16", bf16), ("8-bit", w8)):
        print(f"measured: {name} total {run['total_latency_s']:.1f} s (prefill {run['prefill_latency_s']:.1f}, "
              f"decode {run['decode_latency_s']:.1f})")
    print(f"8-bit over BF16: {bf16['total_latency_s'] / w8['total_latency_s']:.2f}x")
    for label, prefill in (("the BF16 run's", bf16["prefill_latency_s"]), ("the 8-bit run's", w8["prefill_latency_s"])):
        rate = prefill_flop / prefill
        linears = decode_flop / rate
        bf16_total = prefill + bf16["decode_latency_s"]
        for cache, kv in (("bf16 cache", kv_bytes / read), ("4-bit cache", kv_bytes / 4 / read)):
            least = prefill + linears + kv
            print(f"at {label} speed (prefill {prefill:.1f} s, {rate / 1e12:.2f} TFLOP/s), {cache}: 8-bit >= "
                  f"{prefill:.1f} + {linears:.1f} (decode linears) + {kv:.1f} (KV reads) = {least:.1f} s; "
                  f"BF16 {bf16_total:.1f} s; at most {bf16_total / least:.2f}x")


def memory_read_rate() -> float:
    x = torch.ones(512 * 1024 * 1024, dtype=torch.float32)
    best = 0.0
    for _ in range(6):
        t0 = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - t0))
    return best


if __name__ == "__main__":
    main()
