"""Tried, not adopted: a suffix window's own part (attention._own_window_bf16) on torch's fused
flash kernel with an additive mask, merged with the prefix part by log-sum-exp; against the code,
at 8 sequences x 3 kv heads x 3 query heads, 85 or 40 own positions past 300 prefix keys. Also
each path's largest error on the real rows against float64 attention.

    python runs/helm_vs_hf/natural_parts/tried/own_part_flash.py
"""

import math
import time

import torch

from flexgen_helm.executor import attention as A

KVH, R, D, SEQS, P = 3, 3, 64, 8, 300


def own_window_fused(q, qf, k, v, hidden, prefix, sinks, out):
    """_own_window_bf16's signature and result, on the fused kernel (no sinks)."""
    u, m, d = q.shape
    s, t = hidden.shape[-2], hidden.shape[-1]
    r = m // s
    mask = torch.zeros(hidden.shape, dtype=q.dtype).masked_fill_(hidden, -math.inf)  # (u, 1, s, t)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.view(u, r, s, d), k[:, None].expand(u, r, t, d), v[:, None].expand(u, r, t, d), attn_mask=mask,
        scale=1 / math.sqrt(d))
    prefix_out, prefix_lse = prefix
    own_lse = lse.reshape(u, m, 1)
    top = torch.maximum(own_lse, prefix_lse)
    w_own = (own_lse - top).exp_()
    w_pre = (prefix_lse - top).exp_()
    torch.mul(prefix_out, w_pre, out=out).addcmul_(o.reshape(u, m, d).float(), w_own).div_(w_own + w_pre)


def main() -> None:
    torch.manual_seed(0)
    original = A._own_window_bf16
    for s in (85, 40):
        u = SEQS * KVH
        q = torch.randn(u, R, s, D).to(torch.bfloat16)
        k, v = (torch.randn(u, s, D).to(torch.bfloat16) for _ in range(2))
        valid = torch.ones(u, s, dtype=torch.bool)
        valid[::5, :10] = False  # some left padding
        pk, pv = torch.randn(KVH, P, D).to(torch.bfloat16), torch.randn(KVH, P, D).to(torch.bfloat16)
        prefix = A.prefix_for_decode(pk.float(), pv.float(), torch.device("cpu"), torch.bfloat16)

        def attend(own, q=q, k=k, v=v, valid=valid, prefix=prefix):
            A._own_window_bf16 = own
            try:
                return A.attend_window_past_shared_prefix(q, k, v, valid, prefix)
            finally:
                A._own_window_bf16 = original

        head = torch.arange(u) % KVH  # a unit's kv head
        keys, values = torch.cat([pk[head].double(), k.double()], 1), torch.cat([pv[head].double(), v.double()], 1)
        seen = torch.cat([torch.ones(u, s, P, dtype=torch.bool),
                          valid[:, None, :] & torch.ones(s, s, dtype=torch.bool).tril()[None]], 2)
        scores = torch.einsum("ursd,utd->urst", q.double(), keys).div(math.sqrt(D))
        scores = scores.masked_fill(~seen[:, None], -math.inf)
        truth = torch.einsum("urst,utd->ursd", scores.softmax(-1), values)
        real = valid[:, None, :, None].expand(u, R, s, D)
        errors = [float((attend(own).double() - truth)[real].abs().max()) for own in (original, own_window_fused)]
        print(f"{s} own positions: largest error on real rows, current {errors[0]:.4g}, fused {errors[1]:.4g}")
        for _ in range(3):
            ms = {}
            for name, own in (("current", original), ("fused own part", own_window_fused)):
                attend(own)
                t0 = time.perf_counter()
                for _ in range(30):
                    attend(own)
                ms[name] = round((time.perf_counter() - t0) / 30 * 1e3, 2)
            print(f"  {s} own positions, ms a call: {ms}", flush=True)


if __name__ == "__main__":
    main()
