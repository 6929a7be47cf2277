"""A bfloat16 decode step's attention on torch's fused kernel, from the cache length where this
machine's profile measured it faster than attend()'s float32 path (executor/attention
.fused_decode): within bf16 rounding of exact attention, masks kept; shorter caches, float32,
soft-capped, sink and sparse steps never take it; the profile measures the choice and
use_profile applies it."""

from __future__ import annotations

import pytest
import torch

from flexgen_helm.executor import attention
from flexgen_helm.executor.attention import attend
from flexgen_helm.memory.machine import machine_info
from flexgen_helm.planner import hardware_profile
from flexgen_helm.planner.hardware_profile import DeviceSpeeds, HardwareProfile, describe, use_profile


def _step(dtype: torch.dtype, seed: int = 0):
    """One decode step's queries (u, r, 1, d) and a slot's keys and values read in place
    ((rows, u, d) viewed as (u, t, d), as the schedule reads a memory tier's cache), with
    padding before some units' keys."""
    g = torch.Generator().manual_seed(seed)
    units, r, keys, d = 12, 3, 40, 16
    q = torch.randn(units, r, 1, d, generator=g).to(dtype)
    k, v = (torch.randn(keys + 2, units, d, generator=g).to(dtype)[:keys].transpose(0, 1) for _ in range(2))
    valid = torch.ones(units, keys, dtype=torch.bool)
    for u in range(0, units, 3):
        valid[u, :5 + u] = False  # left padding of 5..14 keys
    return q, k, v, valid


def _exact(q, k, v, valid, softcap: float = 0.0) -> torch.Tensor:
    scores = torch.einsum("urd,utd->urt", q[:, :, 0].double(), k.double()) / q.shape[-1] ** 0.5
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    weights = scores.masked_fill(~valid[:, None], float("-inf")).softmax(-1)
    return torch.einsum("urt,utd->urd", weights, v.double())[:, :, None]


def test_a_bf16_step_on_the_fused_kernel_is_attention_to_bf16_rounding(monkeypatch):
    q, k, v, valid = _step(torch.bfloat16)
    calls = []
    real = attention._dense_attention
    monkeypatch.setattr(attention, "_dense_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    attention.set_fused_decode("cpu", k.shape[1] + 1)  # from one key more than this cache's
    attend(q, k, v, valid, causal=True)
    assert not calls, "a cache shorter than the setting's took the fused kernel"
    attention.set_fused_decode("cpu", k.shape[1])
    out = attend(q, k, v, valid, causal=True)
    assert calls, "the step did not take the fused kernel"
    want = _exact(q, k, v, valid)
    assert out.shape == want.shape and out.dtype == torch.bfloat16
    # the weights rounded to bf16 before the product with the values (2^-9 each, relative),
    # then the output's own rounding: within a bf16 step of the values' scale
    scale = v.abs().amax(1, keepdim=True).double()[:, :, None]  # (u, 1, 1, d)
    assert ((out.double() - want).abs() <= want.abs() * 2 ** -8 + scale * 2 ** -8).all()
    # the same bound fails if the padding were attended to
    assert not ((out.double() - _exact(q, k, v, torch.ones_like(valid))).abs()
                <= want.abs() * 2 ** -8 + scale * 2 ** -8).all()


@pytest.mark.parametrize("case", ["float32", "float32 cache", "softcap", "sinks", "sparse"])
def test_other_steps_keep_their_path_with_the_fused_kernel_chosen(case):
    """float32 keeps its exact bits (the same tokens under every placement); a cache unpacked
    to float32 (a loaded or compressed one's) is not rounded back; soft caps and sinks are
    what the fused kernel cannot compute; sparse attention picks its own keys."""
    q, k, v, valid = _step(torch.float32 if case == "float32" else torch.bfloat16, seed=1)
    if case == "float32 cache":
        k, v = k.float(), v.float()
    kwargs = {"softcap": {"softcap": 5.0}, "sinks": {"sinks": torch.randn(q.shape[0], q.shape[1])},
              "sparse": {"keep_fraction": 0.5}}.get(case, {})
    attention.set_fused_decode("cpu", None)
    before = attend(q, k, v, valid, causal=False, **kwargs)
    attention.set_fused_decode("cpu", 1)
    assert torch.equal(attend(q, k, v, valid, causal=False, **kwargs), before)


def test_the_choice_is_made_per_device_type():
    assert attention.set_fused_decode("cpu", 100) is None
    assert attention.set_fused_decode("cpu", None) == 100
    with pytest.raises(ValueError, match="not 'cuda'"):
        attention.set_fused_decode("cuda", 1)
    with pytest.raises(ValueError, match="at least 1"):
        attention.set_fused_decode("cpu", 0)


@pytest.mark.parametrize("gains, from_keys", [
    ({32: 0.84, 128: 1.3, 512: 1.8}, 128),
    ({32: 1.2, 128: 1.3, 512: 1.8}, 32),
    ({32: 1.2, 128: 1.02, 512: 1.8}, 512),  # within noise at 128: only from the count above
    ({32: 0.9, 128: 0.95, 512: 1.04}, None),
    ({}, None),  # a profile from before the measurement
])
def test_the_saved_profile_chooses_the_decode_path(tmp_path, gains, from_keys):
    """From the fewest keys measured at which, and above which, the fused kernel gained more
    than the noise threshold (FLIPPED_MIN_GAIN) of a paired timing."""
    path = tmp_path / "hardware.json"
    attention.set_fused_decode("cpu", 7)
    profile = HardwareProfile(machine=machine_info(), devices={"cpu": DeviceSpeeds(attn_decode_fused_gains=gains)})
    profile.save(path)
    assert use_profile(path).compute.attn_decode_fused_gains == gains  # saved and read back by key count
    assert attention.FUSED_DECODE["cpu"] == from_keys
    line = next(x for x in describe(profile).splitlines() if "attention:" in x)
    if gains:
        assert ("never" if from_keys is None else f"from {from_keys} keys") in line


@pytest.mark.parametrize("dtype, measured", [(torch.bfloat16, True), (torch.float32, False)])
def test_the_profile_times_both_paths_and_rates_the_one_it_chooses(dtype, measured, monkeypatch):
    monkeypatch.setattr(hardware_profile, "DECODE_CACHE_LAYERS", 1)
    steps = []  # (keys, whether the fused kernel took it) of each decode step attended
    real = attention.attend
    monkeypatch.setattr(hardware_profile, "attend", lambda q, k, *a, **kw: steps.append(
        (k.shape[1], attention.fused_decode(q, k))) or real(q, k, *a, **kw))
    attention.set_fused_decode("cpu", None)
    _, rate, gains = hardware_profile._attention_speeds(torch.device("cpu"), dtype, None)
    assert rate > 0
    assert list(gains) == (list(hardware_profile.FUSED_DECODE_KEYS) if measured else [])
    decode = [s for s in steps if s[0] != 512]  # the prefill's call attends its 512 keys too
    assert {keys for keys, _ in decode} == ({k + 1 for k in hardware_profile.FUSED_DECODE_KEYS} if measured
                                            else {513})
    assert any(fused for _, fused in decode) == measured  # bf16 timed the fused kernel too
    chosen = hardware_profile._fused_decode_from_keys(gains)
    assert steps[-1] == (513, chosen is not None and chosen <= 513)  # the rate's timing: the path chosen
    assert attention.FUSED_DECODE["cpu"] is None  # the measurement leaves the setting as it was


@pytest.mark.parametrize("gains, taken", [({"decode": 1.31, "window": 1.03}, {"decode"}),
                                          ({"decode": 1.02, "window": 1.2}, {"window"}),
                                          ({"decode": 1.2, "window": 1.2}, {"decode", "window"}),
                                          ({}, set())])
def test_the_saved_profile_chooses_the_prefix_parts_kernel_for_each_use(tmp_path, gains, taken):
    path = tmp_path / "hardware.json"
    attention.set_fused_prefix_part("cpu", {"decode", "window"} - taken)
    profile = HardwareProfile(machine=machine_info(), devices={"cpu": DeviceSpeeds(attn_prefix_fused_gains=gains)})
    profile.save(path)
    assert use_profile(path) is not None
    assert attention.FUSED_PREFIX_PART["cpu"] == taken
    line = next(x for x in describe(profile).splitlines() if "attention:" in x)
    assert ("past a shared prefix" in line) == bool(gains)
    for use in gains:
        assert f"{use} {gains[use]:.2f}x ({'taken' if use in taken else 'not taken'})" in line


def test_an_unknown_use_of_the_prefix_part_is_refused():
    with pytest.raises(ValueError, match="decode, window, not prefill"):
        attention.set_fused_prefix_part("cpu", {"prefill"})
    with pytest.raises(ValueError, match="chosen on cpu, not 'cuda'"):
        attention.set_fused_prefix_part("cuda", {"decode"})


def test_the_profile_times_each_use_of_the_prefix_part_both_ways_where_a_bf16_layout_is_made(monkeypatch):
    calls = []  # (function, the uses taking the fused kernel as it ran)
    for name in ("_fused_past_prefix", "_fused_prefix_part", "_bf16_prefix_part"):
        real = getattr(attention, name)
        monkeypatch.setattr(attention, name, lambda *a, _real=real, _name=name: calls.append(
            (_name, attention.FUSED_PREFIX_PART["cpu"])) or _real(*a))
    gains = hardware_profile.prefix_part_fused_gains(torch.device("cpu"), torch.bfloat16, calls=1)
    if not attention._bf16_matmuls_native():
        assert gains == {} and not calls
        return
    assert set(gains) == {"decode", "window"} and all(g > 0 for g in gains.values())
    assert {("_bf16_prefix_part", frozenset()), ("_fused_past_prefix", frozenset({"decode"})),
            ("_fused_prefix_part", frozenset({"window"}))} <= set(calls)
    assert all(name == "_bf16_prefix_part" for name, uses in calls if not uses)
    assert attention.FUSED_PREFIX_PART["cpu"] == frozenset()  # left as it was
    assert hardware_profile.prefix_part_fused_gains(torch.device("cpu"), torch.float32) == {}


def test_a_prefix_from_a_caches_strided_view_takes_the_fused_kernel_exactly_as_a_contiguous_one():
    """The engine hands prefix_for_decode keys as a view of its cache ((kvh, P, d) with other
    strides); the fused kernel must get them laid out by position and contiguous."""
    g = torch.Generator().manual_seed(3)
    kvh, length, d = 3, 200, 64
    keys, values = (torch.randn(length, kvh, d, generator=g) + 2 for _ in range(2))
    strided = keys.transpose(0, 1)  # (kvh, P, d) with a cache's position-major strides
    assert not strided.is_contiguous()
    attention.set_fused_prefix_part("cpu", {"decode"})
    prefixes = [attention.prefix_for_decode(x, values.transpose(0, 1), torch.device("cpu"), torch.bfloat16)
                for x in (strided, strided.contiguous())]
    if prefixes[0].key_mean is None:
        pytest.skip("this CPU emulates bf16 matmuls: no bf16 layout is made")
    assert all(p.by_position and p.keys.is_contiguous() for p in prefixes)
    q = torch.randn(kvh, 40, d, generator=g)
    (out_a, lse_a), (out_b, lse_b) = (attention._fused_prefix_part(q, p) for p in prefixes)
    assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)
    scores = torch.einsum("hmd,hpd->hmp", q.double(), strided.double()) / d ** 0.5
    want = torch.einsum("hmp,hpd->hmd", scores.softmax(-1), values.transpose(0, 1).double())
    assert (out_a.double() - want).abs().max() < 2e-2
    assert (lse_a[..., 0].double() - scores.logsumexp(-1)).abs().max() < 2e-2

