"""Tried, not adopted: a suffix window's prefix part (attention._window_prefix_part on the fused
kernel) as one flash call per GPU batch, by sequence over the prefix keys expanded, with no
float32 round trip of the queries; against the code's slices, at natural-easy's shapes (64
sequences x 3 kv heads x 3 query heads x 105 own positions, 302 prefix keys).

    python runs/helm_vs_hf/natural_parts/tried/prefix_part_batched.py
"""

import math
import time

import torch

from flexgen_helm.executor import attention as A

KVH, R, D, SEQS, S, P = 3, 3, 64, 64, 105, 302


def main() -> None:
    torch.manual_seed(0)
    A.set_fused_prefix_part("cpu", True)
    u, m = SEQS * KVH, R * S
    q = torch.randn(u, R, S, D).to(torch.bfloat16)
    prefix = A.prefix_for_decode(torch.randn(KVH, P, D), torch.randn(KVH, P, D), torch.device("cpu"), torch.bfloat16)

    def current():
        return A._window_prefix_part(q.float().reshape(u, m, D), prefix, 0.0)

    def batched():
        qf = q.float().reshape(u, m, D)  # the caller makes it anyway
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.view(SEQS, KVH, m, D), prefix.keys.expand(SEQS, KVH, P, D), prefix.values.expand(SEQS, KVH, P, D),
            scale=math.log(2))
        shift = torch.matmul(qf.view(SEQS, KVH, m, D), prefix.key_mean.transpose(1, 2))
        return o.float().view(u, m, D), shift.add_(lse[..., None]).view(u, m, 1)

    (a, a_lse), (b, b_lse) = current(), batched()
    print("outputs equal:", torch.equal(a, b), "log-sum-exps equal:", torch.equal(a_lse, b_lse))
    ratios = []
    for rnd in range(12):
        ms = {}
        for name, fn in (("current", current), ("batched", batched))[::1 if rnd % 2 else -1]:
            fn()
            t0 = time.perf_counter()
            for _ in range(10):
                fn()
            ms[name] = (time.perf_counter() - t0) / 10 * 1e3
        ratios.append(ms["batched"] / ms["current"])
    ratios.sort()
    print(f"batched / current over 12 alternating rounds: median {ratios[6]:.3f}, "
          f"range {ratios[0]:.3f}-{ratios[-1]:.3f}")


if __name__ == "__main__":
    main()
