"""The fitted quantizer (--quant-method hqq, compression/hqq.py): lower reconstruction error
than min/max RTN in the same codes, computed once into the compressed store, loaded from
there on every tier (packed for the int4 kernel where it can be), and computing exactly
what its own dequantized weights compute."""

from __future__ import annotations

import json

import pytest
import torch

from flexgen_helm.compression.int4 import PackedInt4, pack_int4
from flexgen_helm.compression.quantize import QuantizedTensor, dequantize, quantize, should_compress
from flexgen_helm.engine import Engine
from flexgen_helm.errors import FlexGenError, PolicyError, WeightStoreError
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.policy import Policy, Split
from flexgen_helm.policy.policy import Compression
from flexgen_helm.weights.compressed_store import CompressedStore, store_layout
from flexgen_helm.weights.registry import resolve

CPU = torch.device("cpu")
HQQ = Compression(4, 32, method="hqq")  # the tiny models' dims take groups of 32
PROMPTS = [[5, 17, 3, 44], [12, 7, 9, 1]]
ON_COMPUTE_TIER = Split(1, 0, 0)


def _mse(x: torch.Tensor, cfg: Compression) -> float:
    return (dequantize(quantize(x, cfg, 1)) - x).pow(2).mean().item()


@pytest.mark.parametrize("bits", [4, 3])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_error_on_a_random_matrix_is_below_rtn(bits, group):
    x = torch.randn(256, 512, generator=torch.Generator().manual_seed(bits * group))
    rtn, fitted = _mse(x, Compression(bits, group)), _mse(x, Compression(bits, group, method="hqq"))
    assert fitted < 0.95 * rtn, (fitted, rtn)


def test_groups_min_max_fits_exactly_stay_exact():
    """A group whose values already sit on a 16-level grid spanning its range (a GGUF block,
    say) keeps that grid; a constant group stays exact."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (64, 32), generator=g).float()
    codes[:, 0], codes[:, 1] = 0, 15  # each group spans the whole grid
    x = torch.rand(64, 1, generator=g) - 0.5 + codes * (0.01 + torch.rand(64, 1, generator=g) * 0.01)
    x[7] = 0.25  # constant
    y = dequantize(quantize(x, HQQ, 1))
    assert torch.allclose(y, x, atol=1e-6, rtol=0)


def test_stored_parts_are_the_usual_layout():
    x = torch.randn(64, 96, dtype=torch.bfloat16)
    q, r = quantize(x, HQQ, 1), quantize(x, Compression(4, 32), 1)
    assert isinstance(q, QuantizedTensor)
    assert [(p.shape, p.dtype) for p in q.parts] == [(p.shape, p.dtype) for p in r.parts]
    assert (q.scale >= 0).all()


def _engine(path, tmp_path, dtype, cfg=HQQ, weights=ON_COMPUTE_TIER):
    policy = Policy(gpu_batch_size=2, weights=weights, compress_weight=cfg)
    return Engine.load(str(path), policy, offload_dir=tmp_path, dtype=dtype, device="cpu", progress=False)


def _greedy(engine):
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, ignore_eos=True)).results
    return [r.completions[0].token_ids for r in out], [r.completions[0].logprobs for r in out]


@pytest.mark.parametrize("family", ["tiny_opt", "tiny_llama"])
def test_float32_tokens_equal_its_own_dequantized_weights(family, request, tmp_path, monkeypatch):
    path = request.getfixturevalue(family)
    cfg = HQQ if family == "tiny_opt" else Compression(4, 16, method="hqq")  # llama's 48 takes 16
    tokens, logprobs = _greedy(_engine(path, tmp_path, "float32", cfg))
    # the same model, uncompressed, on weights replaced by quantize -> dequantize
    import flexgen_helm.engine as engine_module

    real = engine_module.open_weights

    def simulated(*args, **kwargs):
        store, read_full = real(*args, **kwargs)
        return store, lambda name: _fake(read_full(name), cfg)

    monkeypatch.setattr(engine_module, "open_weights", simulated)
    want_tokens, want_logprobs = _greedy(_engine(path, tmp_path, "float32", None))
    assert tokens == want_tokens
    for got, want in zip(logprobs, want_logprobs):
        assert got == pytest.approx(want, abs=1e-5)


def _fake(t: torch.Tensor, cfg: Compression) -> torch.Tensor:
    return dequantize(quantize(t, cfg, 1)) if should_compress(t.shape) else t


def test_bfloat16_loads_the_kernels_packed_bytes_from_the_store(tiny_opt, tmp_path):
    engine = _engine(tiny_opt, tmp_path, "bfloat16", weights=Split(0.5, 0.5, 0))  # nothing on disk
    store = engine.runtime.store
    layout = store_layout(torch.bfloat16, torch.device("cpu"))  # int4cpu, or int4cpu32 on an AVX2 CPU
    assert isinstance(store, CompressedStore) and store.store.root.name.endswith("-hqq-" + layout)
    manifest = json.loads((store.store.root / "manifest.json").read_text())
    assert manifest["compression"]["method"] == "hqq" and manifest["convert_s"] > 0
    home = engine.runtime.homes["layers.0.fc1.weight"]
    assert home.layout == "cpu" and all(isinstance(p, PackedInt4) for p in home.data)
    full = resolve(str(tiny_opt)).source.read("layers.0.fc1.weight").to(torch.bfloat16)
    want = pack_int4(quantize(full, HQQ, 1), CPU)
    got = torch.cat([p.packed for p in home.data])
    assert torch.equal(got, want.packed)
    assert torch.equal(torch.cat([p.scales_zeros for p in home.data], 1), want.scales_zeros)
    tokens, _ = _greedy(engine)
    assert all(len(t) == 4 for t in tokens)


def test_rtn_in_memory_still_quantizes_at_load(tiny_opt, tmp_path):
    engine = _engine(tiny_opt, tmp_path, "float32", Compression(4, 32))
    assert engine.runtime.store is None or not isinstance(engine.runtime.store, CompressedStore)


def test_unknown_method_is_refused():
    with pytest.raises(PolicyError, match="unknown quantization method 'awq'"):
        Policy(compress_weight=Compression(4, 64, method="awq"))


def test_cli_flag_sets_the_method_and_needs_compression(pinned_by_flags):
    policy = Policy.from_dict(pinned_by_flags(["--compress-weight", "--quant-method", "hqq"]))
    assert policy.compress_weight.method == "hqq" and policy.compress_cache is None
    with pytest.raises(FlexGenError, match="--quant-method hqq .* add --compress-weight"):
        pinned_by_flags(["--quant-method", "hqq"])


def test_helm_deployment_names_the_method():
    import yaml

    from flexgen_helm.helm import engines

    path = engines.__file__.replace("engines.py", "model_deployments.yaml")
    deployments = {d["name"]: d for d in yaml.safe_load(open(path))["model_deployments"]}
    args = deployments["flexgen/smollm2-135m-4bit-hqq"]["client_spec"]["args"]
    load = engines.resolve_load_args(args["model"], args["deployment"], policy=args["policy"])
    assert load.numerics_key()["compress_weight"]["method"] == "hqq"
    assert Policy.from_dict(json.loads(load.policy_json)).compress_weight == Compression(4, 64, method="hqq")
    assert deployments["flexgen/smollm2-135m-4bit-hqq"]["model_name"] == "flexgen/smollm2-135m-4bit-hqq"


def test_a_second_load_reads_the_fit_and_never_fits_again(tiny_opt, tmp_path, monkeypatch):
    """The fit runs once, at conversion: a later load reads the compressed store (its
    checksums checked, as it is read whole into memory) and computes the same tokens."""
    first = _greedy(_engine(tiny_opt, tmp_path, "float32"))

    def no_fit(*args, **kwargs):
        raise AssertionError("hqq fitted again at load")

    import importlib

    monkeypatch.setattr(importlib.import_module("flexgen_helm.compression.quantize"), "fit_scale_min", no_fit)
    engine = _engine(tiny_opt, tmp_path, "float32")
    assert _greedy(engine) == first
    root = engine.runtime.store.store.root
    victim = root / engine.runtime.store.store.tensors["layers.0.fc1.weight.data"].file
    data = bytearray(victim.read_bytes())
    data[3] ^= 0x10  # same size: only the checksum can tell
    victim.write_bytes(bytes(data))
    with pytest.raises(WeightStoreError, match="checksum .*delete .*the next load writes it again"):
        _engine(tiny_opt, tmp_path, "float32")
