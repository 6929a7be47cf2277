"""A HELM scenario's block is planned for its requests: their shared prefix lets it hold more
sequences under the same budget (helm/block_planning.py), with the same float32 results."""

from __future__ import annotations

import pytest

pytest.importorskip("helm")

from helm.common.cache import BlackHoleCacheConfig
from helm.common.request import Request

from flexgen_helm.errors import PolicyError
from flexgen_helm.helm import engines
from flexgen_helm.helm.block_planning import scenario_workload
from flexgen_helm.planner.hardware_profile import DeviceSpeeds, HardwareProfile, default_profile_path
from flexgen_helm.planner.scenario_block import block_for_requests
from flexgen_helm.policy import Policy

DEPLOYMENT = "flexgen/tiny-llama"
# the weights, cache and activations on the top tier, pinned: the load and each scenario plan
# the block alone (the tiny model's max context is 64 tokens)
PLACED = {"percent": [100, 0, 100, 0, 100, 0]}
PREFIX = "Instructions and examples: a=1 b=2 c=3 d=4 e=5 "  # 47 bytes, a token each


def _profile(cpu_bytes: int) -> HardwareProfile:
    speeds = DeviceSpeeds(matmul_flops={"float32": {1: 2e9, 16: 30e9, 256: 100e9}}, attn_prefill_flops=50e9,
                          attn_decode_bytes_per_s=5e9)
    return HardwareProfile(devices={"cpu": speeds}, memcpy_bytes_per_s=5e9, cpu_mem_bytes=cpu_bytes,
                           cpu_available_bytes=cpu_bytes, disk_free_bytes=0)


def _requests(shared: bool) -> list[Request]:
    """16 prompts of 53 tokens (with the BOS): all starting with PREFIX, or each its own."""
    prompts = [PREFIX + f"{i:x} ok?" if shared else f"{i:x}" + PREFIX[i:] + PREFIX[:i] + " ok?" for i in range(16)]
    return [Request(model=DEPLOYMENT, model_deployment=DEPLOYMENT, prompt=p, max_tokens=8, temperature=0.0)
            for p in prompts]


def _client(path, sharing: bool):
    from flexgen_helm.helm.client import FlexGenClient

    return FlexGenClient(BlackHoleCacheConfig(), model="tiny-llama", path=str(path), deployment=DEPLOYMENT,
                         dtype="float32", policy={**PLACED, "prefix_sharing": sharing})


@pytest.fixture
def helm_engines(monkeypatch, tmp_path):
    for var in ("FLEXGEN_HELM_ENGINE_FACTORY", "FLEXGEN_HELM_POLICY", "FLEXGEN_HELM_WEIGHTS_DIR",
                "FLEXGEN_HELM_DEVICE", "FLEXGEN_HELM_DTYPE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FLEXGEN_HELM_CACHE", str(tmp_path / "cache"))  # where the test's profile is saved
    engines.clear()
    yield
    engines.clear()


def test_a_scenario_sharing_a_long_prefix_gets_a_bigger_block_under_the_same_budget(tiny_llama, helm_engines,
                                                                                    caplog):
    """Under a budget where the requests' KV binds the block, the scenario whose prompts share
    48 of their 53 tokens gets a bigger block than the same number and lengths of prompts
    sharing nothing; the scenario's batches follow its block; float32 results with sharing on
    (big block) and off (small block, a second engine) are the same tokens, logprobs within
    rounding."""
    import torch

    _profile(8 << 30).save(default_profile_path())  # the engines load under a roomy budget
    client, plain_client = _client(tiny_llama, sharing=True), _client(tiny_llama, sharing=False)
    handle = client.handle
    jobs = {s: [client.make_job(r, client.raw_request(r), handle)[0] for r in _requests(s)] for s in (True, False)}
    work = {s: scenario_workload(j) for s, j in jobs.items()}
    assert work[True].shared_prefix == len(PREFIX) + 1 and work[False].shared_prefix == 0  # the BOS too
    assert {(w.prompt_len, w.gen_len, w.sequences) for w in work.values()} == {(53, 8, 16)}

    # a budget that binds, found with the planner's own search
    loaded, cfg = handle.engine.policy, handle.engine.config
    def unshared_block(budget: int) -> int:
        try:
            return block_for_requests(cfg, loaded, handle.planned_fields, work[False], _profile(budget),
                                      torch.float32).policy.block_size
        except PolicyError:  # not even one sequence fits
            return 0

    # the largest budget (in steps of 2^(1/8)) at which the block of the prompts sharing nothing
    # holds 2 sequences, chosen from that block alone: just short of what 4 of them take
    steps = [int(2 ** (k / 8)) for k in range(120, 280)]
    budget = steps[next(i for i, b in enumerate(steps) if unshared_block(b) > 2) - 1]
    assert unshared_block(budget) == 2
    _profile(budget).save(default_profile_path())

    with caplog.at_level("INFO"):
        shared = client.plan(client.unique_requests(_requests(True)), set())
        plain = client.plan(client.unique_requests(_requests(False)), set())
    big, small = shared.policy.block_size, plain.policy.block_size
    assert big > small >= 2, (budget, shared.policy.describe(), plain.policy.describe())
    assert max(map(len, shared.batches)) == min(big, 16) and max(map(len, plain.batches)) == small
    assert shared.policy.weights == loaded.weights  # the weights stay where loading put them
    said = [r.getMessage() for r in caplog.records if "block for this scenario" in r.getMessage()]
    assert any(f"shared prefix {len(PREFIX) + 1} tokens, block {big} vs " in m for m in said), said

    # the same requests with sharing off plan the unshared block; results equal, and the engine
    # runs its loaded policy again once a scenario's batches are done
    requests = _requests(True)
    assert plain_client.plan(plain_client.unique_requests(requests), set()).policy.block_size < big
    results = {}
    for sharing, c in ((True, client), (False, plain_client)):
        assert c.prefetch(requests) == len(requests)
        results[sharing] = [c.make_request(r) for r in requests]
    assert handle.engine.policy == loaded
    for on, off in zip(results[True], results[False]):
        assert on.success and off.success
        assert [t.text for t in on.completions[0].tokens] == [t.text for t in off.completions[0].tokens]
        # the shared prefix's matmuls run with one row where each prompt's ran with many: rounding
        # (the engine's own on/off check, test_prefix_sharing.py, allows the same)
        assert [t.logprob for t in on.completions[0].tokens] == \
            pytest.approx([t.logprob for t in off.completions[0].tokens], abs=1e-4)
    assert {r.batch_size for r in results[True]} == {big} and {r.batch_size for r in results[False]} == {small}
    batch = results[True][0].completions[0].finish_reason["flexgen"]["batch"]
    assert batch["computed_prompt_tokens"] < batch["padded_prompt_tokens"]  # the prefix computed once


def test_the_weights_stay_where_loading_put_them():
    """Where the planner would place a scenario's weights otherwise, the block is planned under
    the loaded placement and the planner's other choice is returned for the log line."""
    import torch

    from flexgen_helm.models.opt import config_for_size
    from flexgen_helm.planner.auto import CommandWorkload
    from flexgen_helm.policy import Split

    cfg = config_for_size("125m")
    loaded = Policy(weights=Split(0.5, 0.5), cache=Split(0.5, 0.5))  # as a smaller budget had it at load
    work = CommandWorkload(prompt_len=200, gen_len=8, sequences=32, shared_prefix=180)
    block = block_for_requests(cfg, loaded, {}, work, _profile(8 << 30), torch.float32)
    assert block.moved_weights is not None and block.moved_weights.weights != loaded.weights
    assert (block.policy.weights, block.policy.cache, block.policy.activations) == \
        (loaded.weights, loaded.cache, loaded.activations)
    free = block_for_requests(cfg, block.moved_weights, {}, work, _profile(8 << 30), torch.float32)
    assert free.moved_weights is None and free.policy == block.moved_weights


def test_a_loaded_engine_refuses_a_policy_that_moves_its_weights(tiny_llama, tmp_path):
    from flexgen_helm.engine import Engine
    from flexgen_helm.errors import FlexGenError
    from flexgen_helm.policy import Split

    engine = Engine.load(str(tiny_llama), Policy(gpu_batch_size=2), dtype="float32", offload_dir=tmp_path,
                         progress=False)
    engine.set_policy(Policy(gpu_batch_size=8, num_gpu_batches=2, prefix_sharing=False))  # a block: fine
    assert engine.policy.block_size == 16
    with pytest.raises(FlexGenError, match="keeps its weights .* needs the model loaded again"):
        engine.set_policy(Policy(gpu_batch_size=8, weights=Split(0.5, 0.5)))
    assert engine.policy.block_size == 16


def test_a_scenario_predicted_within_the_floor_runs_in_whole_blocks(tiny_llama, helm_engines, caplog):
    """Capped batches each decode their few long generations apart: where the cost model
    predicts all of a scenario's requests within `uncapped_block_s`, its batches are the
    blocks; with that floor at 0 s, the cap on work at risk (16 requests' here) cuts them."""
    from flexgen_helm.helm.client import FlexGenClient

    _profile(8 << 30).save(default_profile_path())
    requests = [Request(model=DEPLOYMENT, model_deployment=DEPLOYMENT, prompt=f"{i:02x} " + PREFIX, max_tokens=8,
                        temperature=0.0) for i in range(40)]  # of one length, sharing no prefix

    def plan(cached: int = 0, **floor):
        client = FlexGenClient(BlackHoleCacheConfig(), model="tiny-llama", path=str(tiny_llama),
                               deployment=DEPLOYMENT, dtype="float32", policy=PLACED, **floor)
        unique = client.unique_requests(requests)
        return client.plan(unique, set(list(unique)[:cached]))

    with caplog.at_level("INFO"):
        whole = plan()
        capped = plan(uncapped_block_s=0)
    block = whole.policy.block_size
    assert capped.policy.block_size == block > 16, whole.policy.describe()
    assert [len(b) for b in whole.batches] == [min(block, 40)] + [40 - block] * (block < 40)
    assert max(map(len, capped.batches)) == 16
    said = [r.getMessage() for r in caplog.records if "predicted to take" in r.getMessage()]
    assert len(said) == 1 and "within the 300 s a killed run may lose" in said[0], said
    # a resumed run (the first 20 requests in HELM's cache) plans the batches of the run it
    # resumes, and runs those holding an uncached request (capped: not the first 16)
    def prompts(p):
        return [[j.prompt_ids for j in b] for b in p.batches]
    assert prompts(plan(cached=20)) == prompts(whole)
    assert prompts(plan(cached=20, uncapped_block_s=0)) == prompts(capped)[1:]
    # predicted beyond the floor: a batch holds the requests whose share of the prediction is the
    # floor (30 of the 40, pro rata), more than the share's cap allows; a resumed run, the same
    from flexgen_helm.helm.block_planning import plan_block

    client = FlexGenClient(BlackHoleCacheConfig(), model="tiny-llama", path=str(tiny_llama), deployment=DEPLOYMENT,
                           dtype="float32", policy=PLACED)
    jobs = [client.make_job(r, raw, client.handle)[0] for r, raw in client.unique_requests(requests).values()]
    predicted = plan_block(client.handle, jobs).predicted_s
    caplog.clear()
    with caplog.at_level("INFO"):
        within = plan(uncapped_block_s=predicted * 0.76)
    assert max(map(len, within.batches)) == min(block, 30), [len(b) for b in within.batches]
    said = [r.getMessage() for r in caplog.records if "predicted to take" in r.getMessage()]
    assert len(said) == 1 and "a killed run may lose: a batch holds up to 30 of them" in said[0], said
    assert prompts(plan(cached=20, uncapped_block_s=predicted * 0.76)) == prompts(within)[1:]


def test_a_block_planned_for_the_prompts_bounds_a_generating_batch_not_a_token_count(tiny_llama, helm_engines):
    """A generating batch cut by a count of tokens decodes apart (its own steps, its own copy of
    a shared prefix): where the block was planned for the scenario's prompts, which bounds their
    memory, nothing but the batch size cuts them; under a pinned block the cap of
    batching.MAX_BATCH_TOKENS prompt tokens a batch stays."""
    from flexgen_helm.helm.batching import MAX_BATCH_TOKENS
    from flexgen_helm.helm.client import FlexGenClient

    _profile(8 << 30).save(default_profile_path())
    requests = [Request(model=DEPLOYMENT, model_deployment=DEPLOYMENT, prompt=f"{i:03x} " + PREFIX, max_tokens=8,
                        temperature=0.0) for i in range(200)]  # 52 tokens each with the BOS: 10,400 in all

    def batches(**policy):
        # a batch of up to 256 (the engine runs one larger than its block block by block)
        client = FlexGenClient(BlackHoleCacheConfig(), model="tiny-llama", path=str(tiny_llama), deployment=DEPLOYMENT,
                               dtype="float32", policy={**PLACED, **policy}, max_batch_share=None, max_batch_size=256)
        return sorted(len(b) for b in client.plan(client.unique_requests(requests), set()).batches)

    assert batches() == [200]
    per_batch = MAX_BATCH_TOKENS // 52
    assert batches(gpu_batch_size=64, num_gpu_batches=4) == [200 - per_batch, per_batch]


def test_a_gguf_deployments_scenario_block_is_priced_with_its_tensors_as_stored(helm_engines, monkeypatch):
    """The bundled SmolLM2's 4-bit deployment keeps the GGUF's own codes, its Q8_0 table as 8-bit
    groups beside the Q4_1 blocks: a scenario's block is planned with the weights as the loaded
    engine stores them (the cost model's pricing of the table: tests/test_gguf_codes.py), not
    as the setting alone, which stands every weight on the 4-bit grid."""
    from flexgen_helm.compression.grids import WeightGrids
    from flexgen_helm.helm import block_planning
    from flexgen_helm.helm.client import FlexGenClient

    speeds = DeviceSpeeds(matmul_flops={"float32": {1: 2e9, 16: 30e9, 256: 100e9}}, attn_prefill_flops=50e9,
                          attn_decode_bytes_per_s=5e9, int4_matmul_flops={1: 2e9, 128: 100e9},
                          int4_dequant_elems_per_s=1e9)
    HardwareProfile(devices={"cpu": speeds}, memcpy_bytes_per_s=5e9, cpu_mem_bytes=8 << 30,
                    cpu_available_bytes=8 << 30, disk_free_bytes=0).save(default_profile_path())
    priced = []
    plan = block_planning.block_for_requests

    def planned(*args, **kwargs):
        priced.append(args[6] if len(args) > 6 else kwargs.get("weight_grids"))
        return plan(*args, **kwargs)

    monkeypatch.setattr(block_planning, "block_for_requests", planned)
    deployment = "flexgen/smollm2-135m-4bit"
    client = FlexGenClient(BlackHoleCacheConfig(), model="smollm2-135m", deployment=deployment, dtype="float32",
                           policy={"compress_weight": {"bits": 4, "group_size": 32, "method": "gguf"}})
    requests = [Request(model=deployment, model_deployment=deployment, prompt=PREFIX + f"{i:x} ok?", max_tokens=4,
                        temperature=0.0) for i in range(4)]
    jobs = [client.make_job(r, raw, client.handle)[0] for r, raw in client.unique_requests(requests).values()]
    assert block_planning.plan_block(client.handle, jobs) is not None
    [grids] = priced
    assert isinstance(grids, WeightGrids) and grids.setting == client.handle.engine.policy.compress_weight
    assert grids.of("embed.tokens.weight").bits == 8 and grids.of("layers.0.q_proj.weight").bits == 4
