"""HELM runs that survive: a killed run resumes by batch with the results of an uninterrupted
one, `-n` changes no result, and bad requests fail alone. Against the fake engine
(tests/helm_fake_engine.py) with FLEXGEN_FAKE_BATCH_SHIFT=1, whose logprobs move with the
batch (as bf16 results do), so that any change of batches shows in the results."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("helm")

import helm_fake_engine
from helm.common.cache import BlackHoleCacheConfig, SqliteCacheConfig
from helm.common.key_value_store import SqliteKeyValueStore
from helm.common.request import Request
from test_helm_e2e import ENTRIES, helm_run, run_dirs

from flexgen_helm.helm import engines

DEPLOYMENT = "flexgen/smollm2-135m"


@pytest.fixture(autouse=True)
def fake_engine(fake_helm_engine, monkeypatch):  # conftest.py
    monkeypatch.setenv("FLEXGEN_FAKE_BATCH_SHIFT", "1")


def fresh_client(cache_config, **kwargs):
    """A client on a newly loaded engine: what a new helm-run process gets."""
    from flexgen_helm.helm.client import FlexGenClient

    engines.clear()
    return FlexGenClient(cache_config, model="smollm2-135m", deployment=DEPLOYMENT, max_batch_size=3, **kwargs)


def req(prompt, **kw):
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 3)
    return Request(model=DEPLOYMENT, model_deployment=DEPLOYMENT, prompt=prompt, **kw)


def answers(client, requests):
    out = []
    for r in requests:
        res = client.make_request(r)
        assert res.success, res.error
        out.append([(c.text, [t.logprob for t in c.tokens]) for c in res.completions])
    return out


REQUESTS = [req(("word " * (1 + i % 5)) + f"number {i}") for i in range(11)]


def test_killed_run_resumes_by_batch_with_an_uninterrupted_runs_results(tmp_path):
    whole = fresh_client(SqliteCacheConfig(str(tmp_path / "whole.sqlite")))
    assert whole.prefetch(REQUESTS) == len(REQUESTS)
    expected = answers(whole, REQUESTS)
    batches = helm_fake_engine.LOADS[-1].batches
    assert len(batches) >= 4

    cache = SqliteCacheConfig(str(tmp_path / "killed.sqlite"))
    killed = fresh_client(cache)
    killed.handle.engine.crash_after = 2  # "killed" while the third batch runs
    with pytest.raises(KeyboardInterrupt):
        killed.prefetch(REQUESTS)
    with SqliteKeyValueStore(cache.path) as store:
        assert len(list(store.get_all())) == len(batches[0]) + len(batches[1])  # both finished batches

    resumed = fresh_client(cache)
    assert resumed.prefetch(REQUESTS) == len(REQUESTS) - len(batches[0]) - len(batches[1])
    assert helm_fake_engine.LOADS[-1].batches == batches[2:]  # the same batches as the whole run
    assert answers(resumed, REQUESTS) == expected
    assert fresh_client(cache).prefetch(REQUESTS) == 0 and len(helm_fake_engine.LOADS) == 3  # no engine load


def test_prefetched_results_report_computed_and_land_in_the_cache(tmp_path):
    cache = SqliteCacheConfig(str(tmp_path / "c.sqlite"))
    client = fresh_client(cache)
    client.prefetch(REQUESTS[:4])
    assert not any(client.make_request(r).cached for r in REQUESTS[:4])
    assert all(client.make_request(r).cached for r in REQUESTS[:4])


def test_bad_requests_fail_alone_with_helms_semantics_elsewhere():
    client = fresh_client(BlackHoleCacheConfig())
    good = REQUESTS[:3]
    bad = {
        "prompt longer than the context": req("word " * 9000),
        "max_tokens beyond the context": req("hello", max_tokens=9000),
        "negative max_tokens": req("hello", max_tokens=-1),
    }
    helm_semantics = {
        "empty stop sequence": req("hello there", stop_sequences=[""]),
        "num_completions 3 at temperature 0": req("hello there", num_completions=3),
        "top_k_per_token beyond the vocabulary": req("hello there", top_k_per_token=10**6),
    }
    everything = good + list(bad.values()) + list(helm_semantics.values())
    assert client.prefetch(everything) == len(good) + len(helm_semantics)
    results = {name: client.make_request(r) for name, r in {**bad, **helm_semantics}.items()}
    assert "exceeds the model's context of 8192" in results["prompt longer than the context"].error
    assert "9000 = 9001 exceeds" in results["max_tokens beyond the context"].error
    assert "max_tokens=-1" in results["negative max_tokens"].error
    for name in bad:
        assert not results[name].success and results[name].error_flags.is_fatal is False, name
    plain = client.make_request(req("hello there"))
    assert results["empty stop sequence"].completions[0].text == plain.completions[0].text
    assert [c.text for c in results["num_completions 3 at temperature 0"].completions] == [
        plain.completions[0].text] * 3
    assert results["top_k_per_token beyond the vocabulary"].completions[0].text == plain.completions[0].text
    assert all(client.make_request(r).success for r in good)


def completions(run_dir):
    state = json.loads((run_dir / "scenario_state.json").read_text())
    return [[(c["text"], [t["logprob"] for t in c["tokens"]]) for c in rs["result"]["completions"]]
            for rs in state["request_states"]]


def test_helm_run_n16_gives_the_completions_of_n1(tmp_path, monkeypatch):
    """Plain helm-run (no --runner-class-name): batches of 4 planned from each scenario's
    requests (8: two batches), so 16 threads meet the same batches as one."""
    monkeypatch.setenv("FLEXGEN_FAKE_BLOCK", "4")
    entries = [ENTRIES[2]]
    # two independent processes, each mostly one core's work (imports, HELM's configuration): side by side
    with ThreadPoolExecutor(2) as both:
        runs = {n: both.submit(helm_run, tmp_path / f"n{n}", entries, "-n", str(n), fake=True, max_instances=8)
                for n in (1, 16)}
        for run in runs.values():
            run.result()
    results = {n: {name: completions(d) for name, d in run_dirs(tmp_path / f"n{n}").items()} for n in (1, 16)}
    assert set(results[1]) == {"synthetic_reasoning"}
    assert all(len(v) == 8 for v in results[1].values())
    assert results[16] == results[1]
