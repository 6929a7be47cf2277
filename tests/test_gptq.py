"""GPTQ (--quant-method gptq, compression/gptq.py, executor/layerwise_gptq.py): a lower
output error than min/max RTN in the same codes, computed once at conversion on text the
model samples itself, loaded from the compressed store through the same kernel path, and
computing exactly what its own dequantized weights compute."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import flexgen_helm.engine as engine_module
from flexgen_helm.compression.gptq import column_blocks, gptq_quantize, input_factors, lower_triangular_inverse
from flexgen_helm.compression.int4 import PackedInt4, pack_int4
from flexgen_helm.compression.quantize import dequantize, quantize
from flexgen_helm.data.sources import LAMBADA_FILE, WIKITEXT_FILE, data_dir
from flexgen_helm.engine import Engine, weight_calibration
from flexgen_helm.errors import PolicyError
from flexgen_helm.executor.calibration_text import CalibrationText
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.policy import Policy, Split
from flexgen_helm.policy.policy import Compression
from flexgen_helm.weights.compressed_store import CompressedStore, store_layout
from flexgen_helm.weights.registry import resolve

GPTQ = Compression(4, 32, method="gptq")  # the tiny models' dims take groups of 32 (llama's 48: 16)
PROMPTS = [[5, 17, 3, 44], [12, 7, 9, 1]]
ON_COMPUTE_TIER = Split(1, 0, 0)


def _correlated_inputs(tokens: int, columns: int, seed: int, samples: int = 0) -> torch.Tensor:
    """Inputs whose channels are correlated and a few much larger (as a layer's are): the
    correlation is the seed's, the tokens drawn from it are the `samples` seed's."""
    mixing = torch.randn(columns, columns, generator=torch.Generator().manual_seed(seed)) / columns ** 0.5
    g = torch.Generator().manual_seed(1_000_003 * seed + samples + 1)
    x = torch.randn(tokens, columns, generator=g) @ mixing
    x += 0.1 * torch.randn(tokens, columns, generator=g)
    x[:, :4] *= 10
    return x


def _output_error(w: torch.Tensor, q, x: torch.Tensor) -> float:
    return (x @ (dequantize(q) - w).t()).pow(2).sum().item()


@pytest.mark.parametrize("group_dim", [1, 0])
@pytest.mark.parametrize("bits,group", [(4, 64), (4, 128), (3, 64)])
def test_output_error_on_a_random_matrix_is_below_rtn(bits, group, group_dim):
    g = torch.Generator().manual_seed(bits * group)
    w = torch.randn(256, 512, generator=g) * 0.02
    x = _correlated_inputs(2048, 512, seed=group)
    cfg = Compression(bits, group, group_dim)
    blocks = column_blocks(512, group, group_dim)
    q = gptq_quantize(w, input_factors(x, blocks), blocks, cfg, group_dim, torch.float32)
    rtn = quantize(w, cfg, group_dim)
    held_out = _correlated_inputs(2048, 512, seed=group, samples=1)  # the same distribution, other tokens
    assert _output_error(w, q, x) < 0.5 * _output_error(w, rtn, x)
    assert _output_error(w, q, held_out) < 0.5 * _output_error(w, rtn, held_out)


def test_uncorrelated_inputs_give_rtns_codes():
    """With H diagonal no error has anywhere to go: every column rounds as RTN does."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    cfg = Compression(4, 64)
    blocks = column_blocks(256, 64, 1, max_block=128)
    q = gptq_quantize(w, [torch.eye(128), torch.eye(128)], blocks, cfg, 1, torch.float32)
    assert torch.equal(dequantize(q), dequantize(quantize(w, cfg, 1)))


@pytest.mark.parametrize("n", [1, 255, 600])
def test_triangular_inverse_by_halves_is_the_inverse(n):
    x = torch.randn(n + 8, n, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    lower = torch.linalg.cholesky(x.t() @ x + torch.eye(n, dtype=torch.float64))
    got = lower_triangular_inverse(lower, leaf=64)
    assert torch.allclose(got, torch.linalg.inv(lower), rtol=0, atol=1e-10)
    assert torch.equal(got.triu(1), torch.zeros_like(got))


@pytest.mark.parametrize("group_dim", [1, 0])
def test_a_wide_input_in_blocks_side_by_side_equals_the_blocks_one_by_one(group_dim):
    """Equal-width column blocks are quantized side by side (a column of each per step):
    each block must come out as it does alone."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(3))
    x = _correlated_inputs(512, 256, seed=3)
    cfg = Compression(4, 32)
    blocks = column_blocks(256, 32, group_dim, max_block=64)
    assert len(blocks) == 4
    together = gptq_quantize(w, input_factors(x, blocks), blocks, cfg, group_dim, torch.float32)
    for a, b in blocks:
        alone = gptq_quantize(w[:, a:b], input_factors(x[:, a:b], [(0, b - a)]), [(0, b - a)], cfg, group_dim,
                              torch.float32)
        assert torch.equal(dequantize(together)[:, a:b], dequantize(alone))


def test_stored_parts_are_the_usual_layout():
    w = torch.randn(64, 96)
    cfg = Compression(4, 32)
    blocks = column_blocks(96, 32, 1)
    q = gptq_quantize(w, input_factors(torch.randn(200, 96), blocks), blocks, cfg, 1, torch.bfloat16)
    r = quantize(w.to(torch.bfloat16), cfg, 1)
    assert [(p.shape, p.dtype) for p in q.parts] == [(p.shape, p.dtype) for p in r.parts]
    assert (q.group_dim, q.dtype, q.shape) == (r.group_dim, r.dtype, r.shape)


def _engine(path, tmp_path, dtype, cfg=GPTQ, weights=ON_COMPUTE_TIER):
    policy = Policy(gpu_batch_size=2, weights=weights, compress_weight=cfg)
    return Engine.load(str(path), policy, offload_dir=tmp_path, dtype=dtype, device="cpu", progress=False)


def _greedy(engine):
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, ignore_eos=True)).results
    return [r.completions[0].token_ids for r in out], [r.completions[0].logprobs for r in out]


def _calibrated(path, tmp_path, cfg, dtype) -> dict:
    """What the layer-wise pass makes of the model's weights, computed apart from any store."""
    resolved = resolve(str(path))
    read = lambda name: resolved.source.read(name).to(dtype)  # noqa: E731
    return weight_calibration(resolved, cfg, tmp_path, progress=False)(read, dtype)


@pytest.mark.parametrize("family", ["tiny_opt", "tiny_llama"])
def test_float32_tokens_equal_its_own_dequantized_weights(family, request, tmp_path, monkeypatch):
    path = request.getfixturevalue(family)
    cfg = GPTQ if family == "tiny_opt" else Compression(4, 16, method="gptq")
    tokens, logprobs = _greedy(_engine(path, tmp_path, "float32", cfg))
    quantized = _calibrated(path, tmp_path, cfg, torch.float32)
    real = engine_module.open_weights

    def simulated(*args, **kwargs):
        store, read_full = real(*args, **kwargs)
        return store, lambda name: dequantize(quantized[name]) if name in quantized else read_full(name)

    monkeypatch.setattr(engine_module, "open_weights", simulated)
    want_tokens, want_logprobs = _greedy(_engine(path, tmp_path, "float32", None))
    assert tokens == want_tokens
    for got, want in zip(logprobs, want_logprobs):
        assert got == pytest.approx(want, abs=1e-5)


def test_bfloat16_loads_the_kernels_packed_bytes_from_the_store(tiny_opt, tmp_path):
    engine = _engine(tiny_opt, tmp_path, "bfloat16", weights=Split(0.5, 0.5, 0))  # nothing on disk
    store = engine.runtime.store
    layout = store_layout(torch.bfloat16, torch.device("cpu"))  # int4cpu, or int4cpu32 on an AVX2 CPU
    assert isinstance(store, CompressedStore) and store.store.root.name.endswith("-gptq-" + layout)
    manifest = json.loads((store.store.root / "manifest.json").read_text())
    assert manifest["compression"]["method"] == "gptq" and manifest["convert_s"] > 0
    assert manifest["calibration"]["text"] == CalibrationText().settings()
    home = engine.runtime.homes["layers.0.fc1.weight"]
    assert home.layout == "cpu" and all(isinstance(p, PackedInt4) for p in home.data)
    want = pack_int4(_calibrated(tiny_opt, tmp_path, GPTQ, torch.bfloat16)["layers.0.fc1.weight"], torch.device("cpu"))
    assert torch.equal(torch.cat([p.packed for p in home.data]), want.packed)
    assert torch.equal(torch.cat([p.scales_zeros for p in home.data], 1), want.scales_zeros)
    tokens, _ = _greedy(engine)
    assert all(len(t) == 4 for t in tokens)


_opened: list[str] = []  # files opened while _recording holds True (an audit hook cannot be removed)
_recording = [False]


def _audit(event: str, args) -> None:
    if _recording[0] and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _opened.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


def test_calibration_text_is_sampled_from_the_model_not_read(tiny_llama, tmp_path):
    """The same model gives the same calibration text every time; it is what the engine
    samples from the model's start token, and no file of the evaluation data is opened."""
    resolved = resolve(str(tiny_llama))
    calibration = weight_calibration(resolved, Compression(4, 16, method="gptq"), tmp_path, progress=False)
    text = calibration.text
    _recording[0] = True
    try:
        first = calibration.sample(text)
    finally:
        _recording[0] = False
    data = os.path.realpath(data_dir())
    assert not [p for p in _opened if os.path.realpath(p).startswith(data) or p.endswith((LAMBADA_FILE, WIKITEXT_FILE))]
    assert calibration.sample(text) == first
    assert len(first) == text.sequences and len(set(map(tuple, first))) == text.sequences
    assert all(s[0] == resolved.config.bos_token_id and len(s) == text.tokens_per_sequence(resolved.config)
               for s in first)
    policy = Policy(gpu_batch_size=4)  # another block shape: sampling is per sequence, in the CPU's default dtype
    engine = Engine.load(str(tiny_llama), policy, offload_dir=tmp_path, dtype=None, device="cpu", progress=False)
    run = engine.generate(*text.requests(resolved.config))
    assert [r.prompt_token_ids + r.completions[0].token_ids for r in run.results] == first


def test_a_cache_cannot_take_gptq():
    with pytest.raises(PolicyError, match="compress_cache: gptq quantizes weights against calibration inputs"):
        Policy(compress_cache=Compression(4, 64, method="gptq"))
    with pytest.raises(ValueError, match="gptq quantizes a weight against its calibration inputs"):
        quantize(torch.randn(4, 64), Compression(4, 64, method="gptq"), 1)


def test_cli_flag_sets_the_method(pinned_by_flags):
    policy = Policy.from_dict(pinned_by_flags(["--compress-weight", "--quant-method", "gptq"]))
    assert policy.compress_weight.method == "gptq" and policy.compress_cache is None
    with pytest.raises(PolicyError, match="compress_cache: gptq"):
        pinned_by_flags(["--compress-weight", "--compress-cache", "--quant-method", "gptq"])


def test_helm_deployment_names_the_method():
    import yaml

    from flexgen_helm.helm import engines

    path = engines.__file__.replace("engines.py", "model_deployments.yaml")
    deployments = {d["name"]: d for d in yaml.safe_load(open(path))["model_deployments"]}
    args = deployments["flexgen/smollm2-135m-4bit-gptq"]["client_spec"]["args"]
    load = engines.resolve_load_args(args["model"], args["deployment"], policy=args["policy"])
    assert load.numerics_key()["compress_weight"]["method"] == "gptq"
    assert Policy.from_dict(json.loads(load.policy_json)).compress_weight == Compression(4, 64, method="gptq")
