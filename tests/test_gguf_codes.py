"""A GGUF's own codes kept (compression method gguf): every held block format decodes as gguf
does, the bundled SmolLM2's Q4_1 / Q8_0 weights are the file's exactly in float32 and within
the bfloat16 rounding of the kernel's scale and zero in bfloat16, types without codes are
re-quantized with a log line, and a source without codes is refused before any weight is read."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
from conftest import save_tiny
from gguf.quants import dequantize as gguf_dequantize
from test_gguf_families import write_gguf

from flexgen_helm.compression.int4 import PackedInt4, dequantize_packed
from flexgen_helm.compression.quantize import QuantizedTensor, dequantize, fake_quantize
from flexgen_helm.engine import Engine
from flexgen_helm.errors import PolicyError
from flexgen_helm.memory.weight_homes import load_home
from flexgen_helm.policy import Policy
from flexgen_helm.policy.policy import Compression
from flexgen_helm.weights.gguf_codes import held_types, read_codes

GGUF_4BIT = Compression(bits=4, group_size=32, method="gguf")


@pytest.mark.parametrize("kind", held_types())
def test_held_types_dequantize_bit_for_bit_as_gguf(kind):
    rng = np.random.default_rng(0)
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n, k = 4, 512
    raw = rng.integers(0, 256, (n, k // block * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    halves = 1 if kind in ("Q4_0", "Q5_0", "Q8_0") else 2  # d (and m or dmin) lead each block
    scales = (rng.standard_normal((len(blocks), halves)) * 0.05).astype(np.float16)
    blocks[:, :2 * halves] = scales.view(np.uint8)
    q = read_codes(raw, kind, (n, k))
    assert (q.group_size, q.group_dim) == (32, 1)
    assert torch.equal(dequantize(q, torch.float32), torch.from_numpy(gguf_dequantize(raw, qtype)).view(n, k))


def _weights(engine):
    """(store name, the weight the engine computes with, as float32, its stored form)."""
    rt = engine.runtime
    for name, home in rt.homes.items():
        if home.group_dim is None:
            continue
        w = load_home(home, rt.devices, rt.store)
        part = w.parts[0][1]
        yield name, dequantize_packed(part, torch.float32) if isinstance(part, PackedInt4) else w.dense(), part


@pytest.fixture(scope="module")
def bundled(smollm2_gguf):
    return smollm2_gguf


def test_bundled_q4_1_codes_are_the_file_exactly_in_float32(bundled, tmp_path):
    engine = Engine.load("smollm2-135m", Policy(compress_weight=GGUF_4BIT), offload_dir=tmp_path, device="cpu",
                         dtype="float32", progress=False)
    widths = {}
    for name, w, part in _weights(engine):
        assert isinstance(part, QuantizedTensor) and part.group_size == 32
        widths[bundled.tensor_type(name)] = part.bits
        assert torch.equal(w, bundled.read(name)), name
    assert widths == {"Q4_1": 4, "Q8_0": 8}  # the tied embedding and head keep the file's 8 bits


def test_bundled_codes_in_bfloat16_differ_by_the_kernels_rounding_alone(bundled, tmp_path):
    """The int4 kernel takes scale and zero = min + 8 scale in bfloat16: each weight moves by at
    most half a bfloat16 step of each (times |code - 8| for the scale); Q8_0's group layout
    keeps the file's float16 scales, so only the weight's own bfloat16 rounding is left."""
    engine = Engine.load("smollm2-135m", Policy(compress_weight=GGUF_4BIT), offload_dir=tmp_path, device="cpu",
                         dtype="bfloat16", progress=False)
    packed = 0
    for name, w, part in _weights(engine):
        want = bundled.read(name)
        if isinstance(part, PackedInt4):
            packed += 1
            q = bundled.read_codes(name)
            scale, zero = q.scale.float(), q.min.float() + 8 * q.scale.float()
            step = lambda x: x.abs() * 2.0 ** -8  # noqa: E731 (a bfloat16 step is at most |x| 2^-7; half of it)
            # (+ float32 rounding of the arithmetic itself)
            bound = (8 * step(scale) + step(zero)).repeat_interleave(32, dim=1) + want.abs() * 2.0 ** -22
            assert bool(((w - want).abs() <= bound).all()), name
        else:
            assert torch.equal(w, want.to(torch.bfloat16).float()), name
    assert packed == 210


def test_a_type_without_codes_is_requantized_with_a_log_line(tmp_path, caplog):
    ckpt = save_tiny("llama", tmp_path / "hf")
    path = write_gguf(ckpt, tmp_path / "f32.gguf", "llama")  # every tensor F32
    cfg = Compression(bits=4, group_size=16, method="gguf")
    with caplog.at_level(logging.WARNING):
        engine = Engine.load(str(path), Policy(compress_weight=cfg), offload_dir=tmp_path / "o", device="cpu",
                             dtype="float32", progress=False)
    assert any("GGUF F32" in r.message and "re-quantized by min/max onto 4-bit groups of 16" in r.message
               for r in caplog.records)
    source = engine.resolved.source
    for name, w, _ in _weights(engine):
        assert torch.equal(w, fake_quantize(source.read(name), Compression(4, 16), 1)), name


def test_gguf_codes_of_a_float_checkpoint_are_refused_before_reading(tmp_path):
    ckpt = save_tiny("llama", tmp_path / "hf")
    with pytest.raises(PolicyError, match="takes a GGUF file's own codes"):
        Engine.load(str(ckpt), Policy(compress_weight=GGUF_4BIT), offload_dir=tmp_path / "o", device="cpu",
                    dtype="float32", progress=False)


def test_a_kv_cache_takes_no_source_codes():
    with pytest.raises(PolicyError, match="compress_cache: gguf"):
        Policy(compress_cache=GGUF_4BIT)


def test_a_scenarios_block_is_priced_with_the_gguf_tensors_as_stored(smollm2_gguf):
    """The planner prices a loaded engine's weights as it stores them (SearchOptions.weight_grids,
    from the engine's resolved compression: helm/block_planning.py): the bundled GGUF keeps its
    Q8_0 table as 8-bit groups beside the Q4_1 blocks, so a block that does not keep dense copies
    dequantizes the whole table at every decode step (the tied head), which the setting alone
    (4-bit for every weight, the table on the int4 kernel) leaves out. Planned from the setting
    alone, a few-shot scenario of the main job ran its decode on such a block at twice the
    time of the block that keeps the copies."""
    from test_policy_search import cpu_profile

    from flexgen_helm.models import family_of
    from flexgen_helm.models.spec import all_store_tensors
    from flexgen_helm.planner.cost_model import CostModel, Workload
    from flexgen_helm.weights.source_grids import weight_grids

    cfg = smollm2_gguf.config
    grids = weight_grids(GGUF_4BIT, smollm2_gguf, all_store_tensors(family_of(cfg).layer_specs(cfg)))
    profile = cpu_profile()
    work = Workload(235, 50, 197)  # the main job's pattern_match
    setting_alone = CostModel(cfg, profile, work, torch.bfloat16)
    as_stored = CostModel(cfg, profile, work, torch.bfloat16, weight_grids=grids)
    apart = Policy(16, 1, compress_weight=GGUF_4BIT, keep_dense_weights=False)
    head = next(i for i, (layer, _) in enumerate(as_stored.groups) if layer.kind == "head")
    table = cfg.vocab_size * cfg.hidden_size
    assert setting_alone.weights_per_layer(apart)[head].grouped_numel == 0
    assert as_stored.weights_per_layer(apart)[head].grouped_numel == table
    extra = as_stored.estimate(apart).decode_step_s - setting_alone.estimate(apart).decode_step_s
    assert extra >= table / profile.compute.dequant_elems_per_s
    # and held as stored: one byte a code, not half of one (the budget's weight bytes)
    held = as_stored.accounted_bytes(apart)["gpu"] - setting_alone.accounted_bytes(apart)["gpu"]
    assert 0.45 * table < held < 0.6 * table


def test_the_load_time_plan_prices_the_gguf_tensors_as_stored_too(smollm2_gguf, tmp_path, monkeypatch):
    """A deployment's (or `--policy auto` command's) plan, before the engine loads, prices the
    GGUF's own codes tensor by tensor as the scenario's does (planner/auto.stored_grids,
    quietly: the load says it); a checkpoint without codes is refused there, as at load."""
    from test_policy_search import cpu_profile

    from flexgen_helm.compression.grids import WeightGrids
    from flexgen_helm.planner import auto
    from flexgen_helm.planner.hardware_profile import default_profile_path

    monkeypatch.setenv("FLEXGEN_HELM_CACHE", str(tmp_path / "cache"))
    cpu_profile().save(default_profile_path())
    priced = []
    search = auto.searched_policy

    def searched(*args, **kwargs):
        priced.append(kwargs.get("weight_grids"))
        return search(*args, **kwargs)

    monkeypatch.setattr(auto, "searched_policy", searched)
    pinned = {"compress_weight": {"bits": 4, "group_size": 32, "method": "gguf"}}
    policy = auto.policy_for_model("smollm2-135m", pinned=pinned, dtype="float32")
    assert policy.compress_weight == GGUF_4BIT
    [grids] = priced
    assert isinstance(grids, WeightGrids)
    assert grids.of("embed.tokens.weight").bits == 8 and grids.of("layers.0.q_proj.weight").bits == 4
    ckpt = save_tiny("llama", tmp_path / "hf")
    with pytest.raises(PolicyError, match="takes a GGUF file's own codes"):
        auto.policy_for_model("tiny-llama", path=str(ckpt), pinned=pinned, dtype="float32")
