"""The HELM plugin against a small fake engine (tests/helm_fake_engine.py): registration,
token alignment, request semantics, batching, failures, accounting. No helm-run here."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("helm")

import helm_fake_engine
from helm.benchmark.metrics.basic_metrics import get_num_bytes
from helm.common.cache import BlackHoleCacheConfig, SqliteCacheConfig
from helm.common.request import Request
from helm.common.tokenization_request import TokenizationRequest

from flexgen_helm.helm import accounting, engines
from flexgen_helm.text import token_text_for

DEPLOYMENT = "flexgen/smollm2-135m"


pytestmark = pytest.mark.usefixtures("fake_helm_engine")  # conftest.py


def client(cache_config=None, **kwargs):
    from flexgen_helm.helm.client import FlexGenClient

    return FlexGenClient(cache_config or BlackHoleCacheConfig(), model="smollm2-135m", deployment=DEPLOYMENT, **kwargs)


def req(prompt, **kw):
    kw.setdefault("temperature", 0.0)
    return Request(model=DEPLOYMENT, model_deployment=DEPLOYMENT, prompt=prompt, **kw)


def engine():
    assert len(helm_fake_engine.LOADS) == 1, "one engine per model per process"
    return helm_fake_engine.LOADS[0]


def helm_ids(text: str) -> list[int]:
    """The token ids the client sends the engine for a prompt (SmolLM2 adds no BOS)."""
    return token_text_for(engine().tokenizer).encode(text)


# ----- registration ---------------------------------------------------------------------


def test_entry_point_registers_deployments_and_run_specs():
    from importlib.metadata import entry_points

    from helm.benchmark.model_deployment_registry import get_model_deployment
    from helm.benchmark.run_spec import get_run_spec_function
    from helm.benchmark.tokenizer_config_registry import get_tokenizer_config

    eps = [ep for ep in entry_points().select(group="helm") if ep.value == "flexgen_helm.helm.plugin"]
    assert eps, "flexgen_helm.helm.plugin is not registered in the `helm` entry-point group (pip install -e .)"
    eps[0].load()
    for name in ["flexgen/smollm2-135m"] + [f"flexgen/opt-{s}" for s in ("125m", "1.3b", "30b", "175b")]:
        d = get_model_deployment(name)
        assert d.client_spec.class_name == "flexgen_helm.helm.client.FlexGenClient"
        assert get_tokenizer_config(d.tokenizer_name).tokenizer_spec.class_name.endswith("FlexGenTokenizer")
    assert get_model_deployment("flexgen/smollm2-135m").max_sequence_length == 8192
    assert get_model_deployment("flexgen/opt-30b").client_spec.args["dummy"] is True
    assert get_run_spec_function("lambada") and get_run_spec_function("wikitext")


def test_helms_slurm_runner_is_swapped_when_imported_not_at_plugin_load(monkeypatch):
    """HELM's slurm_runner imports spacy and nltk (paid by every helm-run if the plugin
    imported it): the plugin leaves it unimported, and HELM's SlurmRunner, once imported (or
    reloaded), still submits flexgen workers."""
    import importlib
    import subprocess
    import sys

    from flexgen_helm.helm import slurm

    loaded = subprocess.run([sys.executable, "-c", "import sys, flexgen_helm.helm.plugin; "
                             "print(sorted({'spacy', 'nltk', 'helm.benchmark.slurm_runner'} & set(sys.modules)))"],
                            capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]", loaded.stdout + loaded.stderr[-2000:]

    monkeypatch.delitem(sys.modules, slurm.HELM_WORKER, raising=False)  # as before this test imported it
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if type(f).__name__ != "_SwapOnImport"])
    slurm.use_for_helm_slurm_runner()
    slurm.use_for_helm_slurm_runner()  # as the plugin's register: idempotent
    assert [type(f).__name__ for f in sys.meta_path].count("_SwapOnImport") == 1
    assert slurm.HELM_WORKER not in sys.modules
    helm_slurm = importlib.import_module(slurm.HELM_WORKER)
    assert helm_slurm.submit_slurm_job.__module__ == slurm.__name__
    helm_slurm = importlib.reload(helm_slurm)
    assert helm_slurm.submit_slurm_job.__module__ == slurm.__name__


def test_local_deployment_of_the_same_name_wins(tmp_path):
    from helm.benchmark import model_deployment_registry as reg

    from flexgen_helm.helm import plugin

    name = "flexgen/opt-13b"
    saved = reg.DEPLOYMENT_NAME_TO_MODEL_DEPLOYMENT.pop(name)
    try:
        mine = reg.ModelDeployment(name=name, client_spec=reg.ClientSpec(
            class_name="flexgen_helm.helm.client.FlexGenClient", args={"model": "facebook/opt-13b", "path": "/w"}))
        reg.register_model_deployment(mine)
        plugin._register_deployments()
        assert reg.get_model_deployment(name).client_spec.args["path"] == "/w"
    finally:
        reg.DEPLOYMENT_NAME_TO_MODEL_DEPLOYMENT[name] = saved


def test_env_vars_configure_path_and_policy(tmp_path, monkeypatch):
    (tmp_path / "opt-30b").mkdir()
    monkeypatch.setenv("FLEXGEN_HELM_WEIGHTS_DIR", str(tmp_path))
    monkeypatch.setenv("FLEXGEN_HELM_POLICY",
                       '{"gpu_batch_size": 4, "num_gpu_batches": 2, "percent": [0, 100, 0, 100, 0, 100]}')
    args = engines.resolve_load_args("facebook/opt-30b", deployment="flexgen/opt-30b", dummy=True)
    assert args.path == str(tmp_path / "opt-30b") and args.dummy is False
    assert '"gpu_batch_size": 4' in args.policy_json and '"cpu": 1.0' in args.policy_json
    assert engines.resolve_load_args("facebook/opt-66b", deployment="flexgen/opt-66b", dummy=True).dummy is True


# ----- tokens -----------------------------------------------------------------------------


def test_tokenizer_and_client_tokens_agree_and_count_bytes():
    from flexgen_helm.helm.tokenizer import FlexGenTokenizer

    text = "Hello world, naïve ’ 日本語 — ok"
    tok = FlexGenTokenizer(BlackHoleCacheConfig(), tokenizer_name=DEPLOYMENT, model="smollm2-135m")
    ids = [t.value for t in tok.tokenize(TokenizationRequest(text, tokenizer=DEPLOYMENT, encode=True)).tokens]
    strs = [t.value for t in tok.tokenize(TokenizationRequest(text, tokenizer=DEPLOYMENT)).tokens]
    assert len(ids) == len(strs) and any(s.startswith("bytes:") for s in strs)
    result = client().make_request(req(text, echo_prompt=True, max_tokens=0))
    tokens = result.completions[0].tokens
    assert [t.text for t in tokens] == strs  # one Token per prompt token, same strings
    assert get_num_bytes(tokens) == len(text.encode("utf-8"))


def test_echo_logprobs_equal_engine_score():
    prompt = "The quick brown fox jumps over the lazy dog."
    result = client().make_request(req(prompt, echo_prompt=True, max_tokens=0))
    assert result.success and result.completions[0].text == prompt
    score = engine().score([helm_ids(prompt)]).results[0]
    got = [t.logprob for t in result.completions[0].tokens]
    assert got[0] == 0.0  # no context for the first token (the LM adapter conditions on it)
    assert got[1:] == pytest.approx(score.logprobs[1:])


# ----- generation semantics ---------------------------------------------------------------


def test_generation_logprobs_stop_and_finish_reasons():
    c = client()
    full = c.make_request(req("Once upon a time", max_tokens=12))
    comp = full.completions[0]
    assert comp.finish_reason["reason"] == "length" and len(comp.tokens) == 12
    assert comp.text == "".join(t.text for t in comp.tokens)
    # per-token logprobs are the engine's, for the engine's tokens
    from flexgen_helm.executor.sampling import SamplingParams

    direct = engine().generate([helm_ids("Once upon a time")], SamplingParams(max_new_tokens=12)).results[0]
    direct = direct.completions[0]
    assert [t.logprob for t in comp.tokens] == pytest.approx(direct.logprobs)
    # a multi-token stop sequence taken from the middle of the greedy text
    words = comp.text.split(" ")
    stop = " " + " ".join(words[3:5])
    stopped = c.make_request(req("Once upon a time", max_tokens=12, stop_sequences=[stop])).completions[0]
    assert stopped.finish_reason["reason"] == "stop"
    assert stopped.text == comp.text[: comp.text.index(stop)]
    assert stopped.logprob == pytest.approx(sum(t.logprob for t in stopped.tokens))
    # each result names the engine that computed it and its load time, the same for every
    # request of the deployment (loaded once per process)
    again = c.make_request(req("Hi", max_tokens=2))
    engines = [r.completions[0].finish_reason["flexgen"]["engine"] for r in (full, again)]
    assert engines[0] == engines[1] and engines[0]["load_s"] > 0 and len(engines[0]["id"]) == 12


def test_num_completions_sampling_and_greedy():
    c = client()
    greedy = c.make_request(req("Hello", max_tokens=6, num_completions=3))
    assert len({x.text for x in greedy.completions}) == 1
    sampled = c.make_request(req("Hello", max_tokens=6, num_completions=3, temperature=1.0, top_p=0.9))
    assert len(sampled.completions) == 3 and len({x.text for x in sampled.completions}) > 1
    again = c.make_request(req("Hello", max_tokens=6, num_completions=3, temperature=1.0, top_p=0.9))
    assert [x.text for x in again.completions] == [x.text for x in sampled.completions]  # seeded by the request


def test_request_time_batch_fields_and_accounting():
    r = client().make_request(req("Hello there", max_tokens=4))
    assert r.request_time > 0 and r.batch_size == 1 and r.batch_request_time > 0
    rec = accounting.from_request_result(dataclasses.asdict(r))  # as the report reads scenario_state.json
    assert rec.prompt_tokens == 2 and rec.generated_tokens == 4
    assert rec.batch.size == 1 and rec.batch.time_s == r.batch_request_time
    assert rec.batch.padded_prompt_tokens >= rec.batch.prompt_tokens == 2


def test_prefetched_requests_report_their_batch_time():
    """The BatchingRunner computes requests ahead; HELM's runtime for each is its batch's."""
    c = client()
    requests = [req(f"Prompt {i} is here", max_tokens=3) for i in range(5)]
    assert c.prefetch(requests) == 5
    results = [c.make_request(r) for r in requests]
    assert {r.batch_size for r in results} == {5}
    assert all(r.request_time == r.batch_request_time > 0 and r.request_datetime > 0 for r in results)


# ----- failures ---------------------------------------------------------------------------


def test_too_long_prompt_fails_non_retriable_non_fatal():
    r = client().make_request(req("word " * 9000, max_tokens=5))
    assert not r.success and "exceeds the model's context of 8192" in r.error
    assert r.error_flags.is_retriable is False and r.error_flags.is_fatal is False


def test_oom_batch_is_split_and_bad_request_isolated():
    from flexgen_helm.helm.batching import run_jobs

    c = client()
    handle = c.handle
    handle.engine.oom_above = 2
    poison = handle.tokenizer.encode(" zebra", add_special_tokens=False)[0]
    handle.engine.fail_token = poison
    prompts = [f"prompt number {i}" for i in range(7)] + ["a zebra here"]
    jobs = [c.make_job(req(p, max_tokens=3), {}, handle)[0] for p in prompts]
    run_jobs(handle, jobs, max_batch=8)
    assert [j.future.exception() is None for j in jobs] == [True] * 7 + [False]
    assert "fake failure" in str(jobs[-1].future.exception())
    assert max(n for kind, n in handle.engine.calls if kind == "generate") <= 2


# ----- batching ---------------------------------------------------------------------------


def test_queue_merges_concurrent_requests_and_groups_by_params():
    c = client(batch_linger_s=0.2, batch_max_wait_s=2.0)
    assert c.handle.engine is not None  # load first, so the requests arrive together
    prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda p: c.make_request(req(p, max_tokens=4)), prompts))
        mixed = list(pool.map(lambda i: c.make_request(req(prompts[i], max_tokens=3 + i % 2)), range(6)))
    assert all(r.success for r in results + mixed)
    assert max(r.batch_size for r in results) >= 3
    assert all(r.batch_size <= 3 for r in mixed)  # max_tokens 3 and 4 never share a batch
    assert len(helm_fake_engine.LOADS) == 1


def _jobs(*lengths):
    from flexgen_helm.helm.batching import Job

    return [Job(prompt_ids=[0] * n, params=None, mode="generate", group=()) for n in lengths]


def _lengths(batches):
    return [[len(j.prompt_ids) for j in b] for b in batches]


def test_batches_are_the_fewest_runs_of_similar_length_within_the_block_and_token_cap():
    """The engine runs a batch as one block (it cuts the GPU batches by padding): a batch is a
    run of the sorted lengths, at most max_batch long and 8192 padded tokens, padded to its
    longest by at most the tolerance (None: any); the fewest such runs, then the least padding."""
    from flexgen_helm.helm.batching import buckets

    out = buckets(_jobs(103, 5, 300, 100, 6, 280, 102, 7, 101, 310), max_batch=4)
    assert _lengths(out) == [[5, 6, 7], [100, 101, 102, 103], [280, 300, 310]]
    assert _lengths(buckets(_jobs(*[50] * 20), max_batch=8)) == [[50] * 4, [50] * 8, [50] * 8]
    # 3 x 2800 passes 8192 padded tokens: long prompts run in smaller batches
    long_ones = _jobs(2700, 2750, 2800, 10)
    assert _lengths(buckets(long_ones, max_batch=8)) == [[10], [2700], [2750, 2800]]
    assert _lengths(buckets(long_ones, max_batch=8, pad_tolerance=None)) == [[10, 2700], [2750, 2800]]


def test_scoring_batches_mix_lengths_and_generating_ones_keep_to_the_tolerance():
    """A scoring batch keeps no KV cache and takes no decode step: the engine pads each of its
    GPU batches alone, so any lengths share it; a generating batch's decode steps attend over
    its longest prompt for every sequence, so it stays within the tolerance."""
    from flexgen_helm.helm.batching import GENERATE, SCORE, Job, plan_batches

    def jobs(mode, *lengths):
        return [Job(prompt_ids=[0] * n, params=None, mode=mode, group=(mode,)) for n in lengths]

    lengths = (5, 40, 300, 80, 12)
    assert [len(b) for b in plan_batches(jobs(SCORE, *lengths), max_batch=8)] == [5]
    assert [len(b) for b in plan_batches(jobs(GENERATE, *lengths), max_batch=8)] == [1, 1, 1, 1, 1]


def test_only_generating_batches_leave_the_token_cap_to_a_planned_block():
    """generate_max_tokens=None (a block planned for the scenario's prompts) lifts the cap of
    MAX_BATCH_TOKENS padded prompt tokens for batches that only generate; scoring batches, and
    score+generate ones (whose first pass scores whole prompts), keep it."""
    from flexgen_helm.helm.batching import GENERATE, MAX_BATCH_TOKENS, SCORE, SCORE_AND_GENERATE, Job, plan_batches

    def sizes(mode, cap):
        jobs = [Job(prompt_ids=[0] * 1000, params=None, mode=mode, group=(mode,)) for _ in range(20)]
        return sorted(len(b) for b in plan_batches(jobs, max_batch=64, generate_max_tokens=cap))

    per_batch = MAX_BATCH_TOKENS // 1000
    assert sizes(GENERATE, MAX_BATCH_TOKENS) == [20 - 2 * per_batch, per_batch, per_batch]
    assert sizes(GENERATE, None) == [20]
    assert sizes(SCORE, None) == sizes(SCORE_AND_GENERATE, None) == [20 - 2 * per_batch, per_batch, per_batch]


def test_a_scenarios_batches_hold_at_most_a_sixteenth_of_it():
    """A killed run loses its batch in progress: planned batches are capped at 1/16 of the
    scenario's requests, never below 16, never above the engine's block."""
    from flexgen_helm.helm.batching import batch_cap

    assert [batch_cap(n, 64) for n in (10, 150, 300, 1024, 5000)] == [16, 16, 19, 64, 64]
    assert batch_cap(150, 4) == 4
    c = client(max_batch_size=64)
    requests = [req(f"Prompt {i} is here", max_tokens=3) for i in range(80)]  # all of one length
    assert c.prefetch(requests) == 80
    assert [n for kind, n in engine().calls] == [16] * 5


def test_a_batch_sharing_a_prefix_holds_the_work_of_sixteen_requests_computed_apart():
    """The cap bounds the work a killed run loses: a batch computes a shared prefix once, so
    the work of 16 requests computed apart holds more requests that share one."""
    from flexgen_helm.helm.batching import batch_cap

    # 16 x 300 tokens computed apart = 200 + n x 100 shared: n = 46
    assert batch_cap(100, 64, tokens_per_request=300, shared_prefix=200) == 46
    assert batch_cap(100, 32, tokens_per_request=300, shared_prefix=200) == 32  # the block still binds
    assert batch_cap(100, 64, tokens_per_request=300, shared_prefix=0) == 16
    # the share of a large scenario grows with it alike: 1024 / 16 = 64 apart -> 190 shared
    assert batch_cap(1024, 512, tokens_per_request=300, shared_prefix=200) == 190


def test_a_shared_prefix_counts_once_in_a_batchs_token_cap():
    from flexgen_helm.executor.length_buckets import cut_by_length

    lengths = [1000] * 12  # 12 x 1000 passes 8192 tokens; 900 shared + 12 x 100 does not
    assert [b - a for a, b in cut_by_length(lengths, 16, 0.25, 8192)] == [4, 8]
    assert [b - a for a, b in cut_by_length(lengths, 16, 0.25, 8192, shared_prefix=900)] == [12]


def test_a_few_shot_scenario_runs_in_fewer_batches_where_the_engine_shares_its_prefix():
    """The scenario's requests share 200 of their ~260 tokens: with sharing its 100 requests
    run as 2 batches instead of 7 of at most 16."""
    from flexgen_helm.executor.sampling import SamplingParams
    from flexgen_helm.helm.batching import GENERATE, SCORE, SCORE_AND_GENERATE, Job
    from flexgen_helm.helm.block_planning import scenario_workload
    from flexgen_helm.helm.scenario_plan import PlannedRequest, plan_scenario

    params = SamplingParams(max_new_tokens=10)
    shared = list(range(1000, 1200))
    planned = {str(i): PlannedRequest(None, {}, Job(shared + [i] * (50 + i % 3), params, GENERATE, ("g",)), 0)
               for i in range(100)}
    sizes = lambda plan: [len(b) for b in plan.batches]  # noqa: E731
    prefix_of = lambda plan: scenario_workload([p.job for p in plan.values()]).shared_prefix  # noqa: E731
    assert prefix_of(planned) == 200
    assert sorted(sizes(plan_scenario(planned, set(), 64, 0.25, 1 / 16))) == [4] + [16] * 6  # no prefix shared
    # 16 x 261 tokens = 200 + n x 61: n = 65, the block (64) binds
    shared_plan = plan_scenario(planned, set(), 64, 0.25, 1 / 16, shared_prefix=prefix_of(planned))
    assert len(shared_plan.batches) == 2 and sum(sizes(shared_plan)) == 100

    # scoring computes every prompt whole, and so does a score+generate batch's first pass:
    # their batches keep the cap of requests computed apart, sharing or not
    for mode in (SCORE, SCORE_AND_GENERATE):
        others = {f"{mode}{i}": PlannedRequest(None, {}, Job(shared + [i] * 50, params, mode, (mode,)), 0)
                  for i in range(100)}
        both = {**planned, **others}
        plan = plan_scenario(both, set(), 256, 0.25, 1 / 16, shared_prefix=prefix_of(both))
        assert max(len(b) for b in plan.batches if b[0].mode == mode) == 16  # as many as 16 computed apart


def test_the_work_of_a_request_counts_each_of_its_sequences():
    """n completions of a prompt are n sequences, each computing the prompt (less the shared
    prefix, with sharing) and its new tokens."""
    from flexgen_helm.executor.sampling import SamplingParams
    from flexgen_helm.helm.batching import GENERATE, SCORE, SCORE_AND_GENERATE, Job, batch_cap, mean_cost

    def job(mode, n=1):
        return Job([0] * 100, SamplingParams(max_new_tokens=10, num_completions=n), mode, ())

    assert mean_cost([job(GENERATE, 3)]) == (330, 3)
    assert mean_cost([job(SCORE)]) == (100, 1)
    assert mean_cost([job(SCORE_AND_GENERATE)]) == (210, 2)
    # 3 sequences of 110 tokens, 80 of them shared: 16 x 330 = 80 + n x (330 - 3 x 80), n = 57
    assert batch_cap(100, 256, tokens_per_request=330, shared_prefix=80, sequences_per_request=3) == 57


def test_cache_makes_reruns_free(tmp_path):
    config = SqliteCacheConfig(str(tmp_path / "flexgen.sqlite"))
    first = client(config).make_request(req("Cache me", max_tokens=3))
    calls = len(engine().calls)
    second = client(config).make_request(req("Cache me", max_tokens=3))
    assert second.cached and not first.cached and len(engine().calls) == calls
    assert second.completions[0].text == first.completions[0].text


def test_engine_registry_is_thread_safe():
    args = engines.resolve_load_args("smollm2-135m", deployment=DEPLOYMENT)
    barrier = threading.Barrier(4)

    def get(_):
        barrier.wait()
        return engines.get_engine(args)

    with ThreadPoolExecutor(4) as pool:
        handles = list(pool.map(get, range(4)))
    assert all(h is handles[0] for h in handles) and len(helm_fake_engine.LOADS) == 1


def test_offline_download_failures_are_recognised_for_a_clear_message():
    import socket
    import urllib.error

    from flexgen_helm.helm.runner import download_failure

    def chained(inner: Exception) -> Exception:
        try:
            try:
                raise inner
            except Exception as e:
                raise RuntimeError("scenario failed") from e
        except RuntimeError as outer:
            return outer

    assert "URLError" in download_failure(chained(urllib.error.URLError(socket.gaierror(-3, "name resolution"))))
    assert "wget" in download_failure(Exception("Failed with exit code 4: wget https://example.org/d.tar -O d.tmp"))
    assert download_failure(chained(ValueError("bad instance"))) is None
    assert download_failure(Exception("Failed with exit code 1: python make_data.py")) is None


def test_batching_runner_runs_everything_on_its_executors_context(tmp_path):
    """The runner's executor batches, and nothing of the runner still holds the context of
    the plain executor HELM's Runner built first (a HELM that adds a service on it shows here)."""
    from helm.benchmark.executor import ExecutionSpec
    from helm.common.context import Context

    from flexgen_helm.helm.runner import BatchingRunner
    from flexgen_helm.helm.scenario_executor import BatchingExecutor

    spec = ExecutionSpec(url=None, auth=None, local_path=str(tmp_path / "prod_env"), parallelism=1, dry_run=True)
    runner = BatchingRunner(spec, str(tmp_path / "out"), "suite", skip_instances=False, cache_instances=False,
                            cache_instances_only=False, skip_completed_runs=False, exit_on_error=True)
    assert isinstance(runner.executor, BatchingExecutor)
    parts = {name: part for name, part in vars(runner).items() if hasattr(part, "__dict__")}
    held = [(name, ctx_name) for name, part in parts.items() for ctx_name, ctx in vars(part).items()
            if isinstance(ctx, Context)]
    assert held, "no context found on the runner's parts"
    for name, ctx_name in held:
        assert getattr(getattr(runner, name), ctx_name) is runner.executor.context, (name, ctx_name)


def test_the_client_tokenizes_with_the_tokenizer_helm_loaded(monkeypatch):
    """One tokenizer object per checkpoint in a helm-run: the window service's (loaded first,
    engines.get_tokenizer), whose encodes the client then finds remembered."""
    loaded = object()
    args = engines.resolve_load_args("smollm2-135m", deployment=DEPLOYMENT)
    monkeypatch.setitem(engines._TOKENIZERS, (args.model, args.path, args.dummy), loaded)
    handle = engines.EngineHandle(args, engine=None)
    assert handle.tokenizer is loaded


def test_a_tokenizer_remembers_recent_encodes_within_its_bound(monkeypatch):
    from flexgen_helm.text import token_text as module

    tt = module.TokenText(helm_fake_engine.smollm2_tokenizer())
    calls = []
    plain = tt.tokenizer.encode
    monkeypatch.setattr(tt.tokenizer, "encode", lambda text, **kw: calls.append(text) or plain(text, **kw))
    monkeypatch.setattr(module, "ENCODED_CHARS", 40)
    first = tt.encode("The quick brown fox")
    first.append(-1)  # the caller's list is its own
    assert tt.encode("The quick brown fox") == first[:-1] and calls == ["The quick brown fox"]
    tt.encode("jumps over the lazy dog, twice")  # 19 + 30 characters > 40: the oldest goes
    assert tt.encode("The quick brown fox") == first[:-1] and len(calls) == 3
