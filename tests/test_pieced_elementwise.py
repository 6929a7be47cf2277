"""RMSNorms and rotary embeddings of large inputs are taken a piece at a time (rows, positions)
so that their float32 copies stay in cache: the same bits as whole."""

from __future__ import annotations

import pytest
import torch

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
