"""A few-shot prefill window's whole attention (prefix + each row's own tokens, causal) as ONE
compiled flex_attention call with a document mask, at natural-easy's shapes (64 prompts of 89
own tokens past a 302-token prefix, SmolLM2's heads, bf16): every row's queries against the one
copy of the prefix and its own keys, no log-sum-exp merge (flex on a CPU returns no lse).
Prints the block mask's and the compile's time, the error against float32 SDPA on one row, and
the compiled call's median time (ms, 7 calls) three times, each beside the engine's own path on
the same inputs (PrefixLayer.attend_window, the prefix's part on our products).

    python runs/helm_vs_hf/natural_parts/tried/flex_window.py
"""

import os
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from flexgen_helm.executor.attention import set_fused_prefix_part
from flexgen_helm.executor.shared_prefix import PrefixLayer

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from record import median_seconds

KVH, R, P, D, S, SEQS = 3, 3, 302, 64, 89, 64
L = SEQS * S


def mask_mod(b, h, qi, kj):
    own = kj - P
    return (kj < P) | ((own >= 0) & (own // S == qi // S) & (own <= qi))


def main() -> None:
    torch.manual_seed(0)
    q = torch.randn(1, KVH * R, L, D).bfloat16()
    k, v = (torch.randn(1, KVH, P + L, D).bfloat16() for _ in range(2))
    t0 = time.perf_counter()
    block_mask = create_block_mask(mask_mod, 1, 1, L, P + L, device="cpu")
    print(f"block mask {time.perf_counter() - t0:.2f} s, sparsity {block_mask.sparsity():.1f}%")
    t0 = time.perf_counter()
    compiled = torch.compile(flex_attention, dynamic=False)
    out = compiled(q, k, v, block_mask=block_mask, enable_gqa=True)
    print(f"compile and first call {time.perf_counter() - t0:.1f} s")
    i = 5  # one row against float32 SDPA over its prefix and own keys
    rows = slice(i * S, (i + 1) * S)
    ks, vs = (torch.cat([x[:, :, :P], x[:, :, P + i * S:P + (i + 1) * S]], 2).float().repeat_interleave(R, 1)
              for x in (k, v))
    allowed = torch.ones(S, P + S, dtype=torch.bool)
    allowed[:, P:] = torch.ones(S, S, dtype=torch.bool).tril()
    want = torch.nn.functional.scaled_dot_product_attention(q[:, :, rows].float(), ks, vs, attn_mask=allowed)
    print(f"max error against float32 {(out[:, :, rows].float() - want).abs().max().item():.4f}; "
          f"load {os.getloadavg()[0]:.2f}")
    set_fused_prefix_part("cpu", False)
    prefix = PrefixLayer(k[0, :, :P], v[0, :, :P])
    pad = torch.zeros(SEQS, dtype=torch.long)
    own_k, own_v = (x[0, :, P:].view(KVH, SEQS, S, D).transpose(0, 1).reshape(SEQS * KVH, S, D) for x in (k, v))
    keys, values = prefix.with_context(pad, own_k, own_v)
    units_q = q[0].view(KVH, R, SEQS, S, D).permute(2, 0, 1, 3, 4).reshape(SEQS * KVH, R, S, D)
    valid = torch.ones(SEQS * KVH, P + S, dtype=torch.bool)
    ours = prefix.attend_window(units_q, keys, values, pad, prefix.window_split(pad, q.device), valid)
    mine = ours.view(SEQS, KVH, R, S, D).permute(1, 2, 0, 3, 4).reshape(1, KVH * R, L, D)
    print(f"ours against flex: max difference {(mine.float() - out.float()).abs().max().item():.4f}")
    for _ in range(3):
        ms = 1e3 * median_seconds(lambda: compiled(q, k, v, block_mask=block_mask, enable_gqa=True), 7)
        our_ms = 1e3 * median_seconds(lambda: prefix.attend_window(units_q, keys, values, pad, P, valid), 7)
        print(f"the whole window of {SEQS} prompts: flex compiled {ms:.1f} ms, ours {our_ms:.1f} ms")


if __name__ == "__main__":
    main()
