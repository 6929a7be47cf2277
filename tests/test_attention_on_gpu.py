"""Attention on a GPU keeps off cuDNN's fused kernel, whose host time per call made the H200's
decode steps (executor/attention.py, _GPU_SDPA_BACKENDS), and stays exact. Runs where torch
sees a GPU (`pytest --device cuda` on a lent machine: runs/gpu/h100_checks.sh)."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from flexgen_helm.executor.attention import attend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _reference(q, k, v, valid):
    """float64 causal attention of each unit's queries (its last q_len positions) over its valid keys."""
    q_len, t = q.shape[2], k.shape[1]
    seen = torch.arange(t)[None, :] <= torch.arange(t - q_len, t)[:, None]  # (q_len, t)
    scores = q.double() @ k.double()[:, None].transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~(valid[:, None, None, :] & seen), -torch.inf)
    return scores.softmax(-1) @ v.double()[:, None]


@pytest.mark.parametrize("q_len", [1, 7])  # a decode step; a few positions (speculation, a prefix's tail)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gpu_attention_runs_no_cudnn_kernel_and_equals_the_reference(q_len, dtype):
    g = torch.Generator().manual_seed(q_len)
    u, r, t, d = 8, 4, 300, 128  # units (sequence, kv head), query heads per unit, keys, head size
    q = torch.randn(u, r, q_len, d, generator=g)
    k, v = torch.randn(u, t, d, generator=g), torch.randn(u, t, d, generator=g)
    valid = torch.ones(u, t, dtype=torch.bool)
    valid[1, :40] = False  # a left-padded sequence
    cuda = torch.device("cuda")
    args = [x.to(cuda, dtype) for x in (q, k, v)]
    attend(*args, valid.to(cuda), causal=True)  # warm-up: libraries load on the first call
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = attend(*args, valid.to(cuda), causal=True)
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    assert not [n for n in names if "cudnn" in n.lower()], sorted(names)
    expected = _reference(q, k, v, valid)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu().double(), expected, atol=tol, rtol=tol)

