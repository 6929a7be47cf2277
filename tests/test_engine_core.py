"""The engine's contract: token ids in, typed results with their RunStats out
(`EngineCore`, kept by the Engine and by the HELM tests' fake engine), a StopCondition
that ends a sequence early, and the text layer's stop strings on top of it."""

from __future__ import annotations

import inspect

import helm_fake_engine
import pytest

from flexgen_helm.engine import Engine, EngineCore
from flexgen_helm.errors import FlexGenError
from flexgen_helm.executor.sampling import GenerationRun, RunStats, SamplingParams, ScoreRun, StopCondition
from flexgen_helm.policy import Policy
from flexgen_helm.text import StopStrings, TextEngine, token_text_for

PROMPTS = [[5, 17, 3, 44], [12, 7], [30, 31, 32]]


def _protocol_methods() -> list[str]:
    return sorted(name for name, v in vars(EngineCore).items() if callable(v) and not name.startswith("_"))


def _parameters(fn) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("impl", [Engine, helm_fake_engine.FakeEngine], ids=["Engine", "FakeEngine"])
def test_engines_keep_to_the_protocol(impl):
    assert _protocol_methods() == ["generate", "score"]
    for name in _protocol_methods():
        assert _parameters(getattr(impl, name)) == _parameters(getattr(EngineCore, name)), name
    instance = impl if impl is Engine else helm_fake_engine.FakeEngine("smollm2-135m")
    for attribute in EngineCore.__annotations__:  # config, tokenizer
        assert hasattr(instance, attribute), attribute


@pytest.fixture(scope="module")
def engine(tiny_llama, tmp_path_factory):
    return Engine.load(str(tiny_llama), Policy(gpu_batch_size=2, num_gpu_batches=2), dtype="float32", device="cpu",
                       offload_dir=tmp_path_factory.mktemp("offload"), progress=False)


def test_results_come_with_their_run_stats(engine):
    run = engine.generate(PROMPTS, SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert isinstance(run, GenerationRun) and isinstance(run.stats, RunStats)
    assert run.stats.generated_tokens == 9 and run.stats.prompt_tokens == 9
    assert run.stats.block_size == 4 and run.stats.memory["placement"]["weight_fractions"]
    scored = engine.score(PROMPTS)
    assert isinstance(scored, ScoreRun) and scored.stats.prompt_tokens == 9 and scored.stats.generated_tokens == 0
    assert not hasattr(engine, "last_stats")


def test_generate_reports_its_token_steps_for_progress_bars(engine):
    """on_step(done, total) after every token step: blocks of 4 sequences, so 6 prompts make two
    blocks of 3 steps; steps an early stop skips are counted when the block ends."""
    calls = []
    engine.generate(PROMPTS * 2, SamplingParams(max_new_tokens=3, ignore_eos=True), on_step=lambda *a: calls.append(a))
    assert calls == [(i, 6) for i in range(1, 7)]
    calls.clear()
    stop_at_once = SamplingParams(max_new_tokens=5, stop_token_ids=tuple(range(300)))  # every token stops
    engine.generate(PROMPTS, stop_at_once, on_step=lambda *a: calls.append(a))
    assert calls == [(1, 5), (5, 5)]


def test_engine_takes_token_ids_only(engine):
    with pytest.raises(FlexGenError, match="prompt 0 is text.*TextEngine"):
        engine.generate(["Once upon a time"])


class AfterTokens:
    """Stops a sequence once it has `n` tokens."""

    def __init__(self, n: int):
        self.n = n

    def reached(self, token_ids) -> bool:
        return len(token_ids) >= self.n


def test_stop_condition_ends_sequences_early(engine):
    assert isinstance(AfterTokens(2), StopCondition)
    params = [SamplingParams(max_new_tokens=6, ignore_eos=True, stop=AfterTokens(n)) for n in (2, 3, 9)]
    run = engine.generate(PROMPTS, params)
    full = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, ignore_eos=True)).results
    got = [r.completions[0] for r in run.results]
    assert [c.finish_reason for c in got] == ["stop_condition", "stop_condition", "length"]
    for c, ref, n in zip(got, full, (2, 3, 6)):
        assert c.token_ids == ref.completions[0].token_ids[:n]
    # every sequence of a block done: its remaining steps are not run
    stopped = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, ignore_eos=True, stop=AfterTokens(2)))
    assert stopped.stats.padded_generated_tokens == 2 * len(PROMPTS)


def test_stop_strings_cut_text_and_tokens_once():
    tt = token_text_for(helm_fake_engine.smollm2_tokenizer())
    ids = tt.encode("Hello world.\n\nNext naïve line")
    stop = StopStrings(tt, ("\n\n", "zzz"))
    cut = stop.cut(ids)
    assert cut.stopped and cut.text == "Hello world."
    assert tt.encode(cut.text) == cut.token_ids[:len(tt.encode(cut.text))]
    assert stop.reached(ids) and not stop.reached(ids[:2])
    straddling = StopStrings(tt, ("orld",)).cut(ids)  # the stop starts inside " world": that token stays
    assert straddling.text == "Hello w" and straddling.token_ids == tt.encode("Hello world")
    assert StopStrings(tt, ("ï",)).cut(ids).text == "Hello world.\n\nNext na"  # inside a multi-byte character
    unstopped = StopStrings(tt, ()).cut(ids)
    assert not unstopped.stopped and unstopped.text == "Hello world.\n\nNext naïve line" == tt.decode(ids)


def test_text_engine_generates_to_a_stop_string(engine):
    texts = TextEngine(engine)
    prompts = ["ab", "hello"]
    full = texts.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert [r.prompt_token_ids for r in full.results] == texts.encode(prompts)
    first = full.results[0].completions[0]
    stop = first.text[3:5]
    run = texts.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True), stop_strings=[stop])
    got = run.results[0].completions[0]
    assert got.finish_reason == "stop_string" and got.text == first.text[:first.text.index(stop)]
    assert len(got.token_ids) < len(first.token_ids)  # generation ended at the stop string
    assert got.token_ids == first.token_ids[:len(got.token_ids)]
