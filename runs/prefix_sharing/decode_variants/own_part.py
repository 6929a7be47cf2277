"""A decode step's own part beside the shared prefix (attention._own_keys_and_prefix, float32)
against two bf16 variants at natural-easy's shapes (96 units = 32 sequences x 3 kv heads, 3
query heads each, ~110 own keys, head dim 64): the window path's bf16 own part with the keys'
mean taken out (attention._own_window_bf16), and a lean one (both products in bf16, scores in
float32, no shift). Median of 200 calls, us, and each one's largest difference from float32.

    python runs/prefix_sharing/decode_variants/own_part.py [--units 96] [--keys 110]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from flexgen_helm.executor import attention
from flexgen_helm.memory.host_allocator import keep_freed_host_memory
from flexgen_helm.memory.machine import machine_label

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from record import median_seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--units", type=int, default=96)
    p.add_argument("--keys", type=int, default=110)
    args = p.parse_args()
    keep_freed_host_memory()
    torch.manual_seed(0)
    u, r, t, d = args.units, 3, args.keys, 64
    q = torch.randn(u, r, d).bfloat16()
    k, v = (torch.randn(u, t, d) + 0.5).bfloat16(), torch.randn(u, t, d).bfloat16()
    valid = torch.rand(u, t) > 0.1
    prefix = (torch.randn(u, r, d), torch.randn(u, r, 1) * 3 + 5)  # its output and log-sum-exp
    qf = q.float()

    def lean() -> torch.Tensor:
        scores = torch.bmm(q * (1 / math.sqrt(d)), k.transpose(1, 2)).float()
        weights = torch.cat([scores.masked_fill_(~valid[:, None, :], -math.inf), prefix[1]], -1).softmax(-1)
        return torch.bmm(weights[..., :t].bfloat16(), v).float().add_(weights[..., t:] * prefix[0])

    runs = {
        "float32 (the engine's)": lambda: attention._own_keys_and_prefix(qf, k, v, valid, 0.0, prefix),
        "bf16, mean shifted": lambda: attention._own_window_bf16(q, qf, k, v, valid[:, None, :].expand(u, r, t),
                                                                prefix),
        "bf16, lean": lean,
    }
    exact = runs["float32 (the engine's)"]()
    print(f"# {machine_label()}: a decode step's own part, {u} units x {r} queries x {t} keys")
    for name, fn in runs.items():
        fn()
        print(f"{name:24s} {median_seconds(fn, 200) * 1e6:6.0f} us, largest difference "
              f"{(fn() - exact).abs().max().item():.4f}")


if __name__ == "__main__":
    main()
