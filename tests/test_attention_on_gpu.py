"""Attention on a GPU keeps off cuDNN's fused kernel, whose host time per call made the H200's
decode steps (executor/attention.py, _fused), and stays exact. Runs where torch
sees a GPU (`pytest --device cuda` on a lent machine: runs/gpu/h100_checks.sh)."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from flexgen_helm.executor.attention import attend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _reference(q, k, v, valid, window=0):
    """float64 causal attention of each unit's queries (its last q_len positions) over its valid
    keys (within the last `window` positions, itself included, where window > 0)."""
    q_len, t = q.shape[2], k.shape[1]
    kpos, qpos = torch.arange(t)[None, :], torch.arange(t - q_len, t)[:, None]
    seen = (kpos <= qpos) & ((kpos > qpos - window) if window else True)  # (q_len, t)
    scores = q.double() @ k.double()[:, None].transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~(valid[:, None, None, :] & seen), -torch.inf)
    return scores.softmax(-1) @ v.double()[:, None]


# the masked kernel (a decode step; a few positions: speculation, a prefix's tail), the causal
# flag (a prompt without padding) and a sliding window's mask (a prompt longer than the window)
CASES = {"decode": (1, 300, True, 0), "few": (7, 300, True, 0), "prompt": (64, 64, False, 0),
         "window": (64, 64, False, 16)}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gpu_attention_runs_no_cudnn_kernel_and_equals_the_reference(case, dtype):
    q_len, t, padded, window = CASES[case]
    g = torch.Generator().manual_seed(q_len)
    u, r, d = 8, 4, 128  # units (sequence, kv head), query heads per unit, head size
    q = torch.randn(u, r, q_len, d, generator=g)
    k, v = torch.randn(u, t, d, generator=g), torch.randn(u, t, d, generator=g)
    valid = torch.ones(u, t, dtype=torch.bool)
    if padded:
        valid[1, :40] = False  # a left-padded sequence
    cuda = torch.device("cuda")
    args = [x.to(cuda, dtype) for x in (q, k, v)]
    attend(*args, valid.to(cuda), causal=True, window=window)  # warm-up: libraries load on the first call
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = attend(*args, valid.to(cuda), causal=True, window=window)
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    assert not [n for n in names if "cudnn" in n.lower()], sorted(names)
    expected = _reference(q, k, v, valid, window)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu().double(), expected, atol=tol, rtol=tol)
