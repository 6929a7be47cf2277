"""The random MoE GGUF that the llama.cpp comparison runs on both sides (tools/compare/
random_moe_gguf.py): we read it back as the geometry it was written from, and run it; bad
requests are refused before anything is written."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flexgen_helm.engine import Engine
from flexgen_helm.errors import FlexGenError
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.policy import Policy, Split
from flexgen_helm.tools.compare.random_moe_gguf import file_bytes, main, moe_config, write
from flexgen_helm.weights.gguf_file import GGUFFile


def tiny_olmoe_config():
    return dataclasses.replace(moe_config("olmoe-1b-7b", 2), vocab_size=96, hidden_size=64, num_heads=4,
                               num_kv_heads=4, head_dim=16, num_experts=8, experts_per_token=2, expert_ffn_size=32,
                               ffn_size=32, max_seq_len=256)


def test_written_geometry_reads_back_and_runs(tmp_path):
    cfg = tiny_olmoe_config()
    path = tmp_path / "tiny-olmoe.gguf"
    write(cfg, path)
    read = GGUFFile(path, cache_dir=tmp_path / "meta").config
    for field in ("moe_type", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "num_experts",
                  "experts_per_token", "expert_ffn_size", "vocab_size", "norm_topk_prob", "qk_norm", "qk_norm_whole"):
        assert getattr(read, field) == getattr(cfg, field), field
    # the tensor bytes the disk check counts are the file's, up to its header and alignment
    assert file_bytes(cfg) <= path.stat().st_size < file_bytes(cfg) + (1 << 20)
    policy = Policy(2, 1, weights=Split(1, 0), cache=Split(1, 0), activations=Split(1, 0))
    eng = Engine.load(str(path), policy, offload_dir=tmp_path / "off", dtype="float32", device="cpu", progress=False)
    try:
        out = eng.generate([[5, 7, 9], [3, 4]], SamplingParams(max_new_tokens=3)).results
    finally:
        eng.close()
    completions = [r.completions[0] for r in out]
    assert all(1 <= len(c.token_ids) <= 3 and c.token_ids for c in completions)
    assert all(torch.isfinite(torch.tensor(c.logprobs)).all() for c in completions)


def test_bad_requests_are_refused_before_writing(tmp_path, capsys):
    with pytest.raises(FlexGenError, match="unknown MoE geometry 'nope'"):
        moe_config("nope", None)
    with pytest.raises(FlexGenError, match="not supported"):
        moe_config("mixtral-8x7b", None)
    with pytest.raises(FlexGenError, match=r"--layers must be within 1..16"):
        moe_config("olmoe-1b-7b", 17)
    out = tmp_path / "x.gguf"
    out.write_bytes(b"")
    assert main(["--layers", "1", "--out", str(out)]) == 2
    assert "exists: not overwritten" in capsys.readouterr().err
