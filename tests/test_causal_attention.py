"""Prompt attention of a left-padded batch (rows rotated so each sequence's tokens come
first, one fused causal call) equals attention over each sequence alone, to rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flexgen_helm.engine import Engine
from flexgen_helm.executor import attention
from flexgen_helm.executor.attention import attend
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.policy import Policy, Split


def _alone(q, k, v, unit, n, window=0):
    """Causal attention of one unit's last n positions on their own, in float64 (within a
    sliding window of `window` positions, itself included, where window > 0)."""
    t, r, d = k.shape[1], q.shape[1], q.shape[3]
    kk = k[unit, None, None, t - n:].double().expand(1, r, n, d)
    vv = v[unit, None, None, t - n:].double().expand(1, r, n, d)
    qq = q[unit:unit + 1, :, t - n:].double()
    if not window:
        return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)[0]
    pos = torch.arange(n)
    near = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=near)[0]


# lengths around SDPA's CPU block sizes (32..512 queries, 512 keys)
@pytest.mark.parametrize("t", [1, 31, 64, 255, 257, 513, 700])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 3e-2)])
def test_left_padded_causal_attention_equals_each_sequence_alone(t, dtype, tol):
    g = torch.Generator().manual_seed(t)
    u, r, d = 6, 3, 16
    lengths = torch.randint(1, t + 1, (u,), generator=g)
    lengths[0] = t  # the longest row has no padding
    q = torch.randn(u, r, t, d, generator=g).to(dtype)
    k, v = torch.randn(u, t, d, generator=g).to(dtype), torch.randn(u, t, d, generator=g).to(dtype)
    valid = torch.arange(t)[None, :] >= (t - lengths)[:, None]
    out = attend(q, k, v, valid, causal=True)
    assert out.dtype == dtype and torch.isfinite(out).all()  # padding rows too
    for unit in range(u):
        n = int(lengths[unit])
        torch.testing.assert_close(out[unit, :, t - n:].double(), _alone(q, k, v, unit, n), atol=tol, rtol=0)



@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("t,window", [(9, 4), (40, 40), (300, 128)])
def test_sliding_window_prompt_attention_equals_each_sequence_alone(t, window, padded):
    """With and without padding (one fused call either way): each query sees its last
    `window` positions only."""
    g = torch.Generator().manual_seed(t + window)
    u, r, d = 4, 3, 16
    lengths = torch.randint(1, t + 1, (u,), generator=g) if padded else torch.full((u,), t)
    lengths[0] = t
    q = torch.randn(u, r, t, d, generator=g)
    k, v = torch.randn(u, t, d, generator=g), torch.randn(u, t, d, generator=g)
    valid = torch.arange(t)[None, :] >= (t - lengths)[:, None]
    out = attend(q, k, v, valid, causal=True, window=window)
    assert torch.isfinite(out).all()
    for unit in range(u):
        n = int(lengths[unit])
        torch.testing.assert_close(out[unit, :, t - n:].double(), _alone(q, k, v, unit, n, window), atol=2e-6, rtol=0)

POLICIES = [
    Policy(gpu_batch_size=6, num_gpu_batches=1),
    Policy(gpu_batch_size=3, num_gpu_batches=2, cache=Split(0.3, 0.4, 0.3), cpu_cache_compute=True),
    Policy(gpu_batch_size=2, num_gpu_batches=3, cache=Split(0, 1, 0), overlap=False),
]
PROMPTS = [list(range(3, 3 + n)) for n in (1, 17, 31, 32, 33, 50)]


@pytest.mark.parametrize("policy", POLICIES, ids=["gpu", "split-delegated", "cpu"])
def test_padded_batches_score_and_generate_as_each_prompt_alone(tiny_llama, policy, tmp_path):
    engine = Engine.load(str(tiny_llama), policy, dtype="float32", device="cpu", offload_dir=tmp_path,
                         progress=False)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    batched = engine.score(PROMPTS).results
    generated = engine.generate(PROMPTS, params).results
    for prompt, scored, gen in zip(PROMPTS, batched, generated):
        alone = engine.score([prompt]).results[0]
        assert scored.logprobs[1:] == pytest.approx(alone.logprobs[1:], abs=1e-5)
        assert gen.completions[0].token_ids == engine.generate([prompt], params).results[0].completions[0].token_ids


@pytest.fixture
def bf16_rows_path(monkeypatch):
    """The bf16 prompt path on any CPU: where torch emulates bf16 it is only slower, and
    without this these tests would check the fused kernel there instead."""
    monkeypatch.setattr(attention, "_bf16_matmuls_native", lambda: True)


def test_bf16_prompt_attention_on_cpu_stays_exact_to_rounding_when_keys_share_a_large_component(bf16_rows_path):
    """Keys of trained models share a large component; the CPU's bf16 prompt attention rounds
    its scores to bf16 after taking out the keys' mean (which the softmax ignores), so such
    keys cost it no more accuracy than others: without that, this error is ~0.05."""
    g = torch.Generator().manual_seed(0)
    u, r, t, d = 6, 3, 300, 64  # 300 queries: blocks of 128 and a tail
    q = torch.randn(u, r, t, d, generator=g).to(torch.bfloat16)
    k = (8 + torch.randn(u, t, d, generator=g)).to(torch.bfloat16)
    v = torch.randn(u, t, d, generator=g).to(torch.bfloat16)
    out = attend(q, k, v, torch.ones(u, t, dtype=torch.bool), causal=True)
    for unit in range(u):
        torch.testing.assert_close(out[unit].double(), _alone(q, k, v, unit, t), atol=3e-2, rtol=0)


def test_bf16_prompt_attention_of_a_unit_does_not_depend_on_its_batch(bf16_rows_path, monkeypatch):
    """Bit for bit the same output for a sequence alone, in a batch of sequences of its
    length, and with the batch cut into calls of one unit each (the bound on the scores a
    call holds)."""
    g = torch.Generator().manual_seed(1)
    u, r, t, d = 4, 3, 200, 32
    q = torch.randn(u, r, t, d, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(u, t, d, generator=g).to(torch.bfloat16) for _ in range(2))
    valid = torch.ones(u, t, dtype=torch.bool)
    together = attend(q, k, v, valid, causal=True)
    assert torch.equal(attend(q[2:3], k[2:3], v[2:3], valid[2:3], causal=True), together[2:3])
    monkeypatch.setattr(attention, "CAUSAL_ROWS_MAX_SCORES", 1)
    assert torch.equal(attend(q, k, v, valid, causal=True), together)


def test_bf16_prompt_attention_on_cpu_takes_the_mean_of_real_keys_only(bf16_rows_path):
    """Left-padded rows whose padding keys are far from the real ones: the real positions
    still equal each sequence alone to bf16 rounding (a mean over the padding too would
    leave a large shared component in the real keys' scores: error ~0.1)."""
    g = torch.Generator().manual_seed(2)
    u, r, t, d = 4, 3, 300, 64
    lengths = torch.tensor([300, 170, 129, 40])
    valid = torch.arange(t)[None, :] >= (t - lengths)[:, None]
    q = torch.randn(u, r, t, d, generator=g).to(torch.bfloat16)
    k = torch.where(valid[..., None], 4.0, -60.0) + torch.randn(u, t, d, generator=g)
    k, v = k.to(torch.bfloat16), torch.randn(u, t, d, generator=g).to(torch.bfloat16)
    out = attend(q, k, v, valid, causal=True)
    for unit in range(u):
        n = int(lengths[unit])
        torch.testing.assert_close(out[unit, :, t - n:].double(), _alone(q, k, v, unit, n), atol=3e-2, rtol=0)
