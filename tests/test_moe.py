"""Mixtures of experts beyond the transformers comparisons of test_model_families.py: the
checkpoints refused with their reason before any weight is read, and the config rules."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import engine_device, save_tiny
from safetensors.torch import load_file, save_file

from flexgen_helm.errors import ModelNotFoundError, WeightStoreError
from flexgen_helm.models.moe import config_from_hf
from flexgen_helm.weights.hf_checkpoint import HFCheckpoint


def test_unsupported_moe_family_is_named_before_any_weight(tmp_path):
    # no weight file at all: the family is refused from config.json alone
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "n_routed_experts": 256,
                                                      "num_experts_per_tok": 8, "hidden_size": 64}))
    with pytest.raises(ModelNotFoundError) as e:
        HFCheckpoint(tmp_path)
    assert "mixture-of-experts family 'deepseek_v3' is not supported" in str(e.value)
    assert "mixtral, qwen2_moe, qwen3_moe, olmoe" in str(e.value)


def _rewrite(path, change):
    f = path / "model.safetensors"
    state = load_file(f)
    change(state)
    save_file(state, f, metadata={"format": "pt"})


def test_missing_expert_tensor_is_named_with_the_files(tmp_path):
    path = save_tiny("qwen3_moe", tmp_path / "m")
    _rewrite(path, lambda s: s.pop("model.layers.1.mlp.experts.3.down_proj.weight"))
    with pytest.raises(WeightStoreError) as e:
        HFCheckpoint(path)
    assert "'model.layers.1.mlp.experts.3.down_proj.weight'" in str(e.value)
    assert "model.safetensors" in str(e.value)


@pytest.mark.parametrize(("kind", "name", "shape"), [
    ("mixtral", "model.layers.0.block_sparse_moe.gate.weight", (3, 48)),  # a router of 3 experts, not 4
    ("qwen2_moe", "model.layers.2.mlp.experts.0.up_proj.weight", (16, 48)),
    ("qwen2_moe", "model.layers.0.mlp.shared_expert_gate.weight", (2, 48)),
])
def test_misshapen_router_or_expert_is_named_with_its_file(tmp_path, kind, name, shape):
    path = save_tiny(kind, tmp_path / "m")
    _rewrite(path, lambda s: s.__setitem__(name, torch.zeros(shape)))
    with pytest.raises(WeightStoreError) as e:
        HFCheckpoint(path)
    assert f"model.safetensors: tensor {name!r} has shape {list(shape)}" in str(e.value)


def test_qwen_dense_blocks_and_routing_rules():
    hf = {"model_type": "qwen2_moe", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 6,
          "num_attention_heads": 2, "intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2,
          "moe_intermediate_size": 4, "shared_expert_intermediate_size": 8, "decoder_sparse_step": 2,
          "mlp_only_layers": [3]}
    cfg = config_from_hf(hf, "q")
    # every second block is sparse (index 1, 3, 5), but 3 is listed as dense
    assert cfg.dense_blocks == (0, 2, 3, 4)
    assert [cfg.sparse_block(i) for i in range(6)] == [False, True, False, False, False, True]
    assert cfg.attention_bias and not cfg.norm_topk_prob and cfg.shared_expert_ffn_size == 8
    mixtral = config_from_hf({**hf, "model_type": "mixtral", "num_local_experts": 4, "num_experts": None}, "m")
    assert mixtral.norm_topk_prob and mixtral.routing_in_float and mixtral.dense_blocks == ()
    assert mixtral.shared_expert_ffn_size == 0 and mixtral.expert_ffn_size == 4


def test_only_the_chosen_experts_are_read_off_disk(tmp_path):
    """Weights all on disk: a step reads each expert its tokens chose once per layer (the
    router's choices as transformers makes them), never the others, and counts their bytes."""
    from conftest import hf_model

    from flexgen_helm.engine import Engine
    from flexgen_helm.executor.sampling import SamplingParams
    from flexgen_helm.policy import Policy, Split

    path = save_tiny("qwen3_moe", tmp_path / "m")
    prompt = [5, 17, 3]
    with torch.no_grad():
        router_logits = hf_model(path)(torch.tensor([prompt]), output_router_logits=True).router_logits
    engine = Engine.load(str(path), Policy(gpu_batch_size=1, weights=Split(0, 0, 1)), offload_dir=tmp_path,
                         dtype="float32", device=engine_device(), progress=False)
    cfg = engine.runtime.config
    chosen = [set(torch.topk(logits, cfg.experts_per_token, dim=-1).indices.flatten().tolist())
              for logits in router_logits]
    timers = engine.generate([prompt], SamplingParams(max_new_tokens=4, ignore_eos=True)).stats.timers
    expert_bytes = 3 * cfg.expert_ffn_size * cfg.hidden_size * 4  # gate, up, down in float32
    assert timers["prefill_experts_loaded"] == sum(map(len, chosen)) < cfg.num_layers * cfg.num_experts
    assert timers["prefill_expert_read_bytes"] == timers["prefill_experts_loaded"] * expert_bytes
    # a decode step's one token takes exactly k experts in each block
    per_step = cfg.num_layers * cfg.experts_per_token
    assert timers["decode_experts_loaded"] == 3 * per_step
    assert timers["decode_expert_read_bytes"] == 3 * per_step * expert_bytes


def test_a_resident_blocks_experts_load_in_place_beside_its_other_weights(tmp_path, monkeypatch):
    """Weights resident on the compute device: a sparse block's other weights and each of its
    experts (a spec of their own, executor/expert_weights.py) load as their homes, every one
    kept from its first load; loading an expert does not evict the block's entry."""
    from flexgen_helm.engine import Engine
    from flexgen_helm.executor import runtime as runtime_module
    from flexgen_helm.executor.expert_weights import sparse_layer_plan
    from flexgen_helm.policy import Policy, Split

    path = save_tiny("qwen3_moe", tmp_path / "m")
    rt = Engine.load(str(path), Policy(weights=Split(1, 0, 0)), offload_dir=tmp_path, dtype="float32",
                     device="cpu", progress=False).runtime
    block = next(layer for layer in rt.layers if layer.kind == "block" and sparse_layer_plan(rt, layer))
    plan = sparse_layer_plan(rt, block)
    specs = [plan.ahead, plan.experts[0].spec, plan.experts[1].spec]
    first = [rt.load_layer(spec) for spec in specs]
    loads = []
    real = runtime_module.load_layer
    monkeypatch.setattr(runtime_module, "load_layer", lambda *a, **k: loads.append(a[0]) or real(*a, **k))
    for spec, weights in zip(specs * 2, first * 2):
        again = rt.load_layer(spec)
        assert all(again[t.key] is weights[t.key] is rt.homes[t.store_name].data[0] for t in spec.tensors)
    assert loads == []


def test_expected_experts_touched():
    from flexgen_helm.models.moe import expected_experts_touched

    assert expected_experts_touched(64, 8, 1) == pytest.approx(8)  # one token: its k experts
    assert expected_experts_touched(64, 8, 2) == pytest.approx(8 + 8 * 56 / 64)  # the second's new ones
    assert expected_experts_touched(64, 8, 512) == pytest.approx(64)  # a prefill: all of them


def test_cost_model_reads_the_experts_a_step_is_expected_to_touch():
    """OLMoE-1B-7B's geometry, weights on disk: a batch-1 decode step of a block reads its
    attention and router and 8 of its 64 experts; a 512-token prefill (almost) all."""
    from test_policy_search import cpu_profile

    from flexgen_helm.models.moe import geometry
    from flexgen_helm.planner.cost_model import CostModel, Fractions, Workload
    from flexgen_helm.policy import Policy, Split

    cfg = geometry("olmoe-1b-7b")
    model = CostModel(cfg, cpu_profile(), Workload(512, 32))
    policy = Policy(1, 1, weights=Split(0, 0, 1))
    (layer, _), lw = next((g, lw) for g, lw in zip(model.groups, model.weights_per_layer(policy))
                          if g[0].kind == "block")
    expert = 3 * cfg.hidden_size * cfg.expert_ffn_size * 2  # bf16 bytes
    assert lw.experts.stored["disk"] == 64 * expert
    rest = lw.stored["disk"] - 64 * expert
    decode, _ = model._layer_work(layer, lw, policy, Fractions.of(policy), "decode")
    prefill, _ = model._layer_work(layer, lw, policy, Fractions.of(policy), "prefill")
    assert decode["disk_cpu"] == pytest.approx(rest + 8 * expert)
    assert prefill["disk_cpu"] == pytest.approx(rest + 64 * expert, rel=1e-6)


def _block_compute(cfg, policy, workload, phase: str, **device_speeds) -> float:
    """The cost model's compute seconds of one sparse block layer of `cfg` in `phase`, on a
    hand-made CPU profile with `device_speeds` (test_policy_search.speeds) as given."""
    from dataclasses import replace

    from test_policy_search import cpu_profile, speeds

    from flexgen_helm.planner.cost_model import CostModel, Fractions

    model = CostModel(cfg, replace(cpu_profile(), devices={"cpu": speeds(**device_speeds)}), workload)
    (layer, _), lw = next((g, lw) for g, lw in zip(model.groups, model.weights_per_layer(policy))
                          if g[0].kind == "block")
    return model._layer_work(layer, lw, policy, Fractions.of(policy), phase)[0]["compute"]


def test_cost_model_counts_each_chosen_experts_routing_passes():
    """A sparse block's elementwise work per token: the dense block's passes (per hidden-size
    and per MLP-width element, k experts' width), and per chosen expert its row gathered, its
    output weighted and added back (models/moe.expert_mlp), which on OLMoE's geometry is
    as much as the rest (its q/k norms included)."""
    from flexgen_helm.models.moe import geometry
    from flexgen_helm.planner.cost_model import ELEMENTWISE_PASSES, QK_NORM_PASSES, Workload
    from flexgen_helm.policy import Policy

    cfg = geometry("olmoe-1b-7b")

    def block_prefill(elementwise: float) -> float:
        return _block_compute(cfg, Policy(4, 2), Workload(64, 4), "prefill", elementwise_elems_per_s=elementwise)

    per_hidden, per_mlp = ELEMENTWISE_PASSES["llama"]
    k, h = cfg.experts_per_token, cfg.hidden_size
    dense = per_hidden * h + per_mlp * k * cfg.expert_ffn_size
    dense += QK_NORM_PASSES * (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim  # OLMoE's q/k norms
    routing = 5 * k * h  # gather (2), weight (2), add back (1)
    tokens = 2 * 4 * 64  # GPU batches x rows x prompt
    assert block_prefill(1e9) - block_prefill(2e9) == pytest.approx(tokens * (dense + routing) * (1 / 1e9 - 1 / 2e9))
    assert routing >= dense


def test_cost_model_charges_each_touched_expert_its_profiled_fixed_cost():
    """A decode step's call of a sparse block's experts costs, besides their arithmetic, the
    profile's per_expert for each expert its rows are expected to choose (~56 of OLMoE's 64
    at 16 rows x 8 choices); a profile without it counts EXPERT_CALL_OPS tiny ops."""
    from test_policy_search import cpu_profile

    from flexgen_helm.models.moe import expected_experts_touched, geometry
    from flexgen_helm.planner.cost_model import EXPERT_CALL_OPS, Workload
    from flexgen_helm.policy import Policy

    cfg = geometry("olmoe-1b-7b")

    def block_decode(fixed_costs: dict) -> float:
        return _block_compute(cfg, Policy(8, 2), Workload(512, 32), "decode", fixed_costs=fixed_costs)

    def costs(**per_expert) -> dict:
        phase = {"per_layer_batch": 1e-4, "per_step": 1e-3, **per_expert}
        return {"moe": {"prefill": phase, "decode": phase}}

    touched = expected_experts_touched(64, 8, 16)
    assert 55 < touched < 57
    assert block_decode(costs(per_expert=5e-5)) - block_decode(costs(per_expert=0.0)) == pytest.approx(touched * 5e-5)
    tiny_op = cpu_profile().compute.op_latency_s
    assert block_decode(costs()) - block_decode(costs(per_expert=0.0)) == pytest.approx(
        touched * EXPERT_CALL_OPS * tiny_op)


def test_profile_measures_what_each_expert_of_a_call_costs(monkeypatch):
    """The overhead profile's MoE probe: a per-expert figure beside the per-layer and per-step
    ones, in both phases, from the engine's own block driver on a tiny MoE, recovered exactly
    from step times that follow the cost model's formula (the experts only in the blocks that
    have them, which the model charges), and measured for real."""
    from flexgen_helm.memory.devices import pick_devices
    from flexgen_helm.planner import overhead_profile

    devices = pick_devices("cpu", "float32")
    monkeypatch.setattr(overhead_profile, "FAMILIES", ("moe",))
    costs = overhead_profile.measure_fixed_costs(devices, repeats=2)
    for phase in ("prefill", "decode"):
        assert set(costs["moe"][phase]) == {"per_layer_batch", "per_step", "per_expert"}
        assert all(0.0 <= v < 0.1 for v in costs["moe"][phase].values())
    assert costs["moe"]["decode"]["per_expert"] > 0.0  # seven experts more a layer cost something

    truth = {"prefill": (3e-3, 2e-4, 5e-5), "decode": (1e-3, 1e-4, 3e-5)}  # per_step, per_layer_batch, per_expert

    def timed(rt, nb, workdir, prompt=overhead_profile.PROMPT):
        sparse = sum(layer.kind == "block" for layer in rt.layers)
        return tuple(step + nb * len(rt.layers) * layer_batch + sparse * rt.config.experts_per_token * expert
                     for step, layer_batch, expert in truth.values())

    monkeypatch.setattr(overhead_profile, "_run", timed)
    costs = overhead_profile.measure_fixed_costs(devices, repeats=1)
    for phase, (step, layer_batch, expert) in truth.items():
        assert costs["moe"][phase] == pytest.approx({"per_step": step, "per_layer_batch": layer_batch,
                                                     "per_expert": expert})


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss"])
def test_export_hf_gives_transformers_the_same_model(kind, tmp_path):
    """What `flexgen-helm compare` hands HF accelerate: our store written back as a checkpoint
    that transformers runs as the original (config fields and tensor names inverted; gpt-oss's
    per-expert tensors fused back, gate and up interleaved)."""
    from conftest import hf_model

    from flexgen_helm.weights.export_hf import export_hf

    ckpt = save_tiny(kind, tmp_path / "m", **({"sliding_window": None} if kind == "mixtral" else {}))
    out = export_hf(HFCheckpoint(ckpt), tmp_path / "exported", progress=False)
    ids = torch.tensor([[5, 17, 3, 44, 9, 21]])
    with torch.no_grad():
        torch.testing.assert_close(hf_model(out)(ids).logits, hf_model(ckpt)(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["qwen2_moe", "olmoe"])
def test_compute_floor_counts_the_active_parameters(kind, tmp_path):
    """A token multiplies the router, k of the E experts, the shared expert and the rest: the
    model's matrices (embedding aside) with its experts counted k / E."""
    from conftest import hf_model

    from flexgen_helm.tools.compare.compute_floor import matmul_params_per_token

    path = save_tiny(kind, tmp_path / "m")
    cfg = HFCheckpoint(path).config
    share = cfg.experts_per_token / cfg.num_experts
    active = sum(p.numel() * (share if ".experts." in name else 1)
                 for name, p in hf_model(path).named_parameters() if p.dim() >= 2 and "embed_tokens" not in name)
    assert matmul_params_per_token(cfg) == active


def test_a_prefill_reads_each_chosen_expert_once_for_the_whole_block(tmp_path):
    """Two GPU batches: their rows are gathered, so an expert both chose is read once, not per batch."""
    from conftest import hf_model

    from flexgen_helm.engine import Engine
    from flexgen_helm.executor.sampling import SamplingParams
    from flexgen_helm.policy import Policy, Split

    path = save_tiny("olmoe", tmp_path / "m")
    prompts = [[5, 17, 3], [40, 41, 42]]
    with torch.no_grad():
        router_logits = hf_model(path)(torch.tensor(prompts), output_router_logits=True).router_logits
    engine = Engine.load(str(path), Policy(gpu_batch_size=1, num_gpu_batches=2, weights=Split(0, 0, 1)),
                         offload_dir=tmp_path, dtype="float32", device=engine_device(), progress=False)
    k = engine.runtime.config.experts_per_token
    chosen = [set(torch.topk(logits, k, dim=-1).indices.flatten().tolist()) for logits in router_logits]
    timers = engine.generate(prompts, SamplingParams(max_new_tokens=1, ignore_eos=True)).stats.timers
    assert timers["prefill_experts_loaded"] == sum(map(len, chosen))


@pytest.mark.parametrize(("kind", "overrides"), [("olmoe", dict(num_experts=8, intermediate_size=64)),
                                                 ("qwen2_moe", dict(num_experts=8, moe_intermediate_size=64))])
@pytest.mark.parametrize("weights", [(1, 0, 0), (0, 0, 1)])
def test_compressed_experts_hold_one_dense_copy_as_the_planner_counts(kind, overrides, weights, tmp_path):
    """4-bit weights dequantized for their matmuls (the group layout: float32 takes no
    kernel): a sparse block holds its attention's, router's (and shared expert's) dense
    copies and one expert's at a time, whether its experts are used in place or read off
    disk, and the planner's peak counts exactly that, not every expert's copy."""
    from test_policy_search import cpu_profile

    from flexgen_helm.compression.dense_copies import DENSE_COPIES
    from flexgen_helm.engine import Engine
    from flexgen_helm.executor.sampling import SamplingParams
    from flexgen_helm.planner.cost_model import CostModel, Workload
    from flexgen_helm.policy import Policy, Split
    from flexgen_helm.policy.policy import Compression

    path = save_tiny(kind, tmp_path / "m", **overrides)
    policy = Policy(gpu_batch_size=2, num_gpu_batches=2, weights=Split(*weights), compress_weight=Compression(4, 16))
    engine = Engine.load(str(path), policy, offload_dir=tmp_path, dtype="float32", device=engine_device(),
                         progress=False)
    prompts = [[5, 17, 3, 44, 9], [12, 7], [30, 31, 32], [40, 41, 42]]
    DENSE_COPIES.reset_peak()
    engine.generate(prompts, SamplingParams(max_new_tokens=3, ignore_eos=True))
    cfg = engine.runtime.config
    model = CostModel(cfg, cpu_profile(), Workload(5, 3), torch.float32)
    planned = {}  # the largest copy of each kind of layer (Qwen2-MoE's tiny model has a dense block too)
    for (layer, _), lw in zip(model.groups, model.weights_per_layer(policy)):
        planned[layer.kind] = max(planned.get(layer.kind, 0), model.dequantized_numel(lw, 2) * 4)
    every_expert = 3 * cfg.num_experts * cfg.expert_ffn_size * cfg.hidden_size * 4
    assert planned["block"] > planned["head"]  # the block's copy is the peak here
    assert DENSE_COPIES.peak == planned["block"] < every_expert
    assert DENSE_COPIES.current == 0  # every copy dropped with its layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_padded_to_fewer_row_counts_give_each_row_the_same_output(dtype, monkeypatch):
    """A prefill's experts multiply their rows padded to the next of a few counts an octave (fewer
    distinct products for oneDNN to build and cache): every token's output is bit for bit the
    unpadded one's."""
    from flexgen_helm.models import moe

    hf = {"model_type": "mixtral", "vocab_size": 10, "hidden_size": 32, "num_hidden_layers": 1,
          "num_attention_heads": 2, "intermediate_size": 48, "num_local_experts": 2, "num_experts_per_tok": 1}
    cfg = config_from_hf(hf, "m")
    g = torch.Generator().manual_seed(0)
    w = {"router.weight": torch.randn(2, 32, generator=g).to(dtype)}
    for e in range(2):
        for proj, shape in (("gate_proj", (48, 32)), ("up_proj", (48, 32)), ("down_proj", (32, 48))):
            w[moe.expert_key(e, proj)] = (torch.randn(*shape, generator=g) / 6).to(dtype)
    x = torch.randn(301, 32, generator=g).to(dtype)
    padded_rows = []
    monkeypatch.setattr(moe, "GATHERED_ELEMENTS", 0)  # a prefill's: expert by expert, where rows are padded
    monkeypatch.setattr(moe, "EXPERT_PADDED_FROM", 8)
    gated = moe.gated_mlp
    monkeypatch.setattr(moe, "gated_mlp", lambda rows, *rest: padded_rows.append(len(rows)) or gated(rows, *rest))
    padded = moe.expert_mlp(cfg, w, x)
    monkeypatch.setattr(moe, "EXPERT_PADDED_FROM", 10**9)
    plain = moe.expert_mlp(cfg, w, x)
    assert all(moe.padded_row_count(n) == n for n in padded_rows[:2]) and sum(padded_rows[:2]) > 301
    assert torch.equal(padded, plain)


@pytest.mark.parametrize("kind", ["olmoe", "qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_over_rows_gathered_once_give_the_bits_of_experts_one_by_one(kind, dtype, tmp_path, monkeypatch):
    """A decode step's experts take their rows gathered at once (moe.GATHERED_ELEMENTS); a
    prefill's, one expert at a time, each adding its outputs to their tokens in turn. Both
    give the same bits: the same products, and each token's outputs added in the same order
    with the same roundings."""
    from flexgen_helm.models import moe

    # four choices a token: so that the order and rounding of its outputs' sum can matter
    cfg = HFCheckpoint(save_tiny(kind, tmp_path / "m", num_experts_per_tok=4)).config
    assert cfg.experts_per_token == 4
    torch.manual_seed(0)
    w = {t.key: (torch.randn(t.shape) * 0.3).to(dtype) for t in moe.moe_tensors(cfg, "layers.0")
         if t.key.startswith(("experts.", "router.", "shared_expert"))}
    x = torch.randn(3, 7, cfg.hidden_size).to(dtype)
    paths = []
    for name in ("_experts_gathered", "_experts_one_by_one"):
        real = getattr(moe, name)
        monkeypatch.setattr(moe, name, lambda *a, name=name, real=real: paths.append(name) or real(*a))
    gathered = moe.expert_mlp(cfg, w, x)
    monkeypatch.setattr(moe, "GATHERED_ELEMENTS", 0)
    one_by_one = moe.expert_mlp(cfg, w, x)
    assert paths == ["_experts_gathered", "_experts_one_by_one"]
    # no rows at all (a step whose batch has none left): an empty output of the width, either way
    for limit in (0, 1 << 22):
        monkeypatch.setattr(moe, "GATHERED_ELEMENTS", limit)
        assert moe.expert_mlp(cfg, w, x[:0]).shape == (0, 7, cfg.hidden_size)
    as_bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(gathered.view(as_bits), one_by_one.view(as_bits))
