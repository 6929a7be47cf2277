"""bf16 weights that live in a CPU's memory are held in oneDNN's blocked layout (dense_linear.
PackedLinear): the same products, bit for bit, without reordering the weight at every call."""

import pytest
import torch
import torch.nn.functional as F
from conftest import save_tiny

from flexgen_helm.dense_linear import PackedLinear, packs_linear_weights
from flexgen_helm.engine import Engine
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.policy import Policy, Split

needs_bf16_onednn = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="this CPU's oneDNN has no native bf16: weights stay plain (packs_linear_weights)")

PROMPTS = [[5, 17, 33, 2, 9, 41, 8], [7, 7, 12], [101, 3, 55, 60, 2]]


@needs_bf16_onednn
@pytest.mark.parametrize("rows", [1, 4, 37, 300])
def test_a_packed_product_is_f_linears_bit_for_bit(rows):
    torch.manual_seed(rows)
    w, b = torch.randn(96, 80, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)
    x = torch.randn(rows, 80, dtype=torch.bfloat16)
    packed = PackedLinear(w)
    assert torch.equal(packed.linear(x), F.linear(x, w))
    assert torch.equal(packed.linear(x.view(1, rows, 80), b), F.linear(x.view(1, rows, 80), w, b))


def _run(path, tmp_path, monkeypatch, setting: str):
    monkeypatch.setenv("FLEXGEN_HELM_PACKED_WEIGHTS", setting)
    engine = Engine.load(str(path), Policy(gpu_batch_size=4), dtype="bfloat16", device="cpu", offload_dir=tmp_path,
                         progress=False)
    return engine, engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, ignore_eos=True)).results


@needs_bf16_onednn
def test_a_bf16_model_in_memory_multiplies_packed_weights_and_computes_the_same(tmp_path, monkeypatch):
    """Every block and head weight held in memory is packed, the tied embedding (also looked
    up) is not; tokens and log-probs equal those of the plain weights exactly."""
    path = save_tiny("llama", tmp_path / "tied", tie_word_embeddings=True)
    engine, packed = _run(path, tmp_path, monkeypatch, "on")
    homes = engine.runtime.homes
    kinds = {name: type(home.data[0]) for name, home in homes.items() if len(home.spec.shape) == 2}
    lookups = [name for name in kinds if "embed" in name]
    assert lookups and all(kinds[name] is torch.Tensor for name in lookups)
    assert {kinds[name] for name in kinds if name not in lookups} == {PackedLinear}
    _, plain = _run(path, tmp_path, monkeypatch, "off")
    for a, b in zip(packed, plain):
        assert a.completions[0].token_ids == b.completions[0].token_ids
        assert a.completions[0].logprobs == b.completions[0].logprobs


@needs_bf16_onednn
def test_weights_streamed_from_another_tier_stay_plain(tmp_path, monkeypatch):
    """Only a weight kept whole in the compute device's memory is packed (once, at placement);
    one read off disk at every use is multiplied as it comes."""
    monkeypatch.setenv("FLEXGEN_HELM_PACKED_WEIGHTS", "on")
    path = save_tiny("llama", tmp_path / "m")
    engine = Engine.load(str(path), Policy(gpu_batch_size=4, weights=Split(0, 0, 1)), dtype="bfloat16",
                         device="cpu", offload_dir=tmp_path, progress=False)
    assert not any(isinstance(p, PackedLinear) for home in engine.runtime.homes.values() for p in home.data)


def test_the_switch_takes_on_or_off_and_float32_stays_plain(monkeypatch):
    monkeypatch.setenv("FLEXGEN_HELM_PACKED_WEIGHTS", "yes")
    with pytest.raises(ValueError, match="FLEXGEN_HELM_PACKED_WEIGHTS='yes': use 'on'"):
        packs_linear_weights(torch.device("cpu"), torch.bfloat16)
    monkeypatch.setenv("FLEXGEN_HELM_PACKED_WEIGHTS", "on")
    assert not packs_linear_weights(torch.device("cpu"), torch.float32)
    monkeypatch.setenv("FLEXGEN_HELM_PACKED_WEIGHTS", "off")
    assert not packs_linear_weights(torch.device("cpu"), torch.bfloat16)


@needs_bf16_onednn
def test_dense_copies_kept_for_every_block_are_packed_and_compute_the_same(tmp_path, monkeypatch):
    """A compressed deployment's dense copies kept across blocks (keep_dense_weights, every
    weight in memory) are packed in their place; the tokens and log-probs are the plain
    copies' exactly (the embedding's table is looked up in its stored rows, no copy)."""
    from flexgen_helm.compression.int4 import CompressedWeight
    from flexgen_helm.policy import Compression

    path = save_tiny("llama", tmp_path / "m", tie_word_embeddings=True)
    policy = Policy(gpu_batch_size=4, compress_weight=Compression(4, 16), keep_dense_weights=True)
    runs = {}
    for setting in ("on", "off"):
        monkeypatch.setenv("FLEXGEN_HELM_PACKED_WEIGHTS", setting)
        engine = Engine.load(str(path), policy, dtype="bfloat16", device="cpu", offload_dir=tmp_path, progress=False)
        runs[setting] = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, ignore_eos=True)).results
        kept = [w for (kind, _), layer in engine.runtime.kept._layers.items() if kind != "embed"
                for w in layer.values() if isinstance(w, CompressedWeight)]
        assert kept and all(w.dense_nbytes for w in kept)
        assert all((w._packed is not None) == (setting == "on") for w in kept)
    for a, b in zip(runs["on"], runs["off"]):
        assert a.completions[0].token_ids == b.completions[0].token_ids
        assert a.completions[0].logprobs == b.completions[0].logprobs
