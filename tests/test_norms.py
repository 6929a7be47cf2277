"""RMSNorms of large inputs are taken a piece of rows at a time: the same bits as whole."""

from __future__ import annotations

import pytest
import torch

from flexgen_helm.models import norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 700, 64), (1500, 48), (5, 7, 64)])
def test_pieces_give_the_whole_inputs_bits(dtype, shape, monkeypatch):
    monkeypatch.setattr(norms, "NORM_PIECED_FROM", 1000)
    monkeypatch.setattr(norms, "NORM_PIECE_ELEMENTS", 64 * 37)  # pieces that do not divide the rows
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
