"""A bf16 decode step's attention past a shared prefix at one layer, SmolLM2's shapes (32
sequences, 3 kv heads x 3 query heads, a --prefix-position prefix, 16 positions of their own):
ours whole (attention.attend_past_shared_prefix: the prefix part, the own keys and the merge)
against torch's fused CPU flash kernel over the prefix part alone (it returns the log-sum-exp
a merge needs; the own part and the merge would come on top); and the prefix's QK product
(bmm) on one thread and on two. Median of 200 calls, us.

    python runs/prefix_sharing/prefix_part_kernels.py [--prefix 1000]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

from flexgen_helm.executor.attention import attend_past_shared_prefix, prefix_for_decode
from flexgen_helm.memory.host_allocator import keep_freed_host_memory
from flexgen_helm.memory.machine import machine_label

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from record import median_seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefix", type=int, default=1000)
    args = p.parse_args()
    keep_freed_host_memory()
    torch.manual_seed(0)
    sequences, kvh, r, d, own = 32, 3, 3, 64, 16
    u, m = sequences * kvh, sequences * r
    keys, values, q = torch.randn(kvh, args.prefix, d), torch.randn(kvh, args.prefix, d), torch.randn(kvh, m, d)
    ours = prefix_for_decode(keys, values, torch.device("cpu"), torch.bfloat16)
    step_q = torch.randn(u, r, 1, d).bfloat16()
    own_k, own_v = torch.randn(u, own, d).bfloat16(), torch.randn(u, own, d).bfloat16()
    own_valid = torch.ones(u, own, dtype=torch.bool)
    if ours.key_mean is None:
        sys.exit("this CPU has no bf16 arithmetic: the bf16 prefix layout is not used here, nothing to compare")
    fused_keys = (keys / math.sqrt(d) - ours.key_mean).bfloat16()[None]  # the same shifted keys, scale folded in
    fused_values, fused_q = values.bfloat16()[None], q.bfloat16()[None]

    def fused():
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(fused_q, fused_keys, fused_values, 0.0,
                                                                           False, attn_mask=None, scale=1.0)

    qb, kt = q.bfloat16(), ours.keys
    print(f"# {machine_label()}, load {os.getloadavg()[0]:.2f}")
    whole = median_seconds(lambda: attend_past_shared_prefix(step_q, own_k, own_v, own_valid, ours), 200)
    print(f"ours, whole {whole * 1e6:.1f} us; fused flash kernel, prefix part alone "
          f"{median_seconds(fused, 200) * 1e6:.1f} us")
    threads = torch.get_num_threads()
    for n in (1, threads):
        torch.set_num_threads(n)
        print(f"QK bmm {tuple(qb.shape)} x {tuple(kt.shape)}, {n} thread(s): "
              f"{median_seconds(lambda: torch.bmm(qb, kt), 200) * 1e6:.1f} us")
    torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
