"""RMSNorms and rotary embeddings of large inputs are taken a piece at a time (rows, positions)
so that their float32 copies stay in cache: the same bits as whole. A CPU decode step over a
large bf16 cache reads it a piece of positions at a time: float32's result to rounding."""

from __future__ import annotations

import pytest
import torch

from flexgen_helm.executor.attention import attend
from flexgen_helm.models import cache_pieces, norms, rotary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 700, 64), (1500, 48), (5, 7, 64)])
def test_pieces_give_the_whole_inputs_bits(dtype, shape, monkeypatch):
    monkeypatch.setattr(cache_pieces, "PIECED_FROM", 1000)
    monkeypatch.setattr(cache_pieces, "PIECE_ELEMENTS", 64 * 37)  # pieces that do not divide the rows
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    xf = x.float()
    normalised = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    llama = norms.rms_norm(x, w, 1e-6)
    gemma = norms.rms_norm_plus_one(x, w, 1e-6)
    assert llama.shape == gemma.shape == x.shape and llama.dtype == gemma.dtype == dtype
    assert torch.equal(llama, w * normalised.to(dtype))
    assert torch.equal(gemma, (normalised * (1.0 + w.float())).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, rotated", [((3, 2, 40, 16), 16), ((1, 2, 90, 16), 8)])  # the second: partial rotary
def test_rotary_pieces_give_the_whole_inputs_bits(dtype, shape, rotated, monkeypatch):
    inv = 1.0 / (10000 ** (torch.arange(0, rotated, 2).float() / rotated))
    at = rotary.Rotary.table(inv, 1.0, shape[2], "cpu", dtype).at(torch.arange(shape[2])[None].expand(shape[0], -1))
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    whole = at.apply(x)
    monkeypatch.setattr(cache_pieces, "PIECED_FROM", 100)
    monkeypatch.setattr(cache_pieces, "PIECE_ELEMENTS", 7 * shape[0] * shape[1] * shape[3])  # 7 positions a piece
    assert torch.equal(at.apply(x), whole)
    cos, sin = at.cos, at.sin
    half = rotated // 2
    turned = torch.cat((-x[..., half:rotated], x[..., :half]), -1)
    assert torch.allclose(whole[..., :rotated].float(), (x[..., :rotated] * cos + turned * sin).float(), atol=1e-2)
    assert torch.equal(whole[..., rotated:], x[..., rotated:])


def _decode_cache(units: int, keys: int, d: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """A slot's (rows, units, d) layout (executor/kv_cache.py) read as attention reads it:
    a (units, keys, d) view of its first rows."""
    return torch.randn(keys + 3, units, d, generator=g).to(dtype)[:keys].transpose(0, 1)


@pytest.mark.parametrize("softcap, sinks", [(0.0, False), (20.0, False), (0.0, True)])
@pytest.mark.parametrize("piece_positions", [1, 7, 50])  # 7 does not divide the 50 keys
def test_decode_attention_over_a_large_bf16_cache_by_positions_is_float32_to_rounding(
        softcap, sinks, piece_positions, monkeypatch):
    g = torch.Generator().manual_seed(piece_positions)
    units, r, keys, d = 23, 3, 50, 16
    q = torch.randn(units, r, 1, d, generator=g).bfloat16()
    k, v = _decode_cache(units, keys, d, torch.bfloat16, g), _decode_cache(units, keys, d, torch.bfloat16, g)
    valid = torch.rand(units, keys, generator=g) > 0.3
    valid[:, -1] = True  # each unit's own new key
    unit_sinks = torch.randn(units, r, generator=g) if sinks else None
    monkeypatch.setattr(cache_pieces, "PIECED_FROM", 1000)
    monkeypatch.setattr(cache_pieces, "PIECE_ELEMENTS", piece_positions * units * d)
    out = attend(q, k, v, valid, causal=False, softcap=softcap, sinks=unit_sinks)
    scores = torch.einsum("urd,utd->urt", q[:, :, 0].double(), k.double()) / d ** 0.5
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~valid[:, None], float("-inf"))
    if sinks:
        weights = torch.cat([scores, unit_sinks.double()[..., None]], -1).softmax(-1)[..., :-1]
    else:
        weights = scores.softmax(-1)
    expected = torch.einsum("urt,utd->urd", weights, v.double())[:, :, None]
    assert out.shape == expected.shape and out.dtype == torch.bfloat16
    # float32 arithmetic, then one rounding to bf16: half a bf16 step of the output at most
    assert ((out.double() - expected).abs() <= expected.abs() * 2 ** -8 + 1e-6).all()


def test_decode_attention_over_a_float32_cache_is_not_taken_by_positions(monkeypatch):
    """A float32 cache has no copies to make: its step is the whole one, bit for bit, so
    float32 runs give the same tokens under every placement of the cache."""
    g = torch.Generator().manual_seed(0)
    units, r, keys, d = 23, 3, 50, 16
    q = torch.randn(units, r, 1, d, generator=g)
    k, v = _decode_cache(units, keys, d, torch.float32, g), _decode_cache(units, keys, d, torch.float32, g)
    valid = torch.rand(units, keys, generator=g) > 0.3
    whole = attend(q, k, v, valid, causal=False)
    monkeypatch.setattr(cache_pieces, "PIECED_FROM", 1000)
    monkeypatch.setattr(cache_pieces, "PIECE_ELEMENTS", 7 * units * d)
    assert torch.equal(attend(q, k, v, valid, causal=False), whole)
