"""`flexgen-helm eval`: LAMBADA and WikiText metrics against direct computations with
transformers on a tiny random Llama (byte tokenizer), --limit, data errors, the CLI."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from conftest import hf_model

from flexgen_helm.cli import main
from flexgen_helm.data.lambada import split_last_word
from flexgen_helm.data.sources import local_file, read_lambada, read_wikitext
from flexgen_helm.data.wikitext import join_paragraphs, split_articles
from flexgen_helm.engine import Engine
from flexgen_helm.errors import FlexGenError
from flexgen_helm.evaluation import lambada, wikitext
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.helm.scenarios.lambada import LambadaScenario
from flexgen_helm.helm.scenarios.wikitext import WikiTextScenario
from flexgen_helm.policy.policy import Policy

PASSAGES = ["the cat sat on the mat", "a dog ran far away", "she said hello to him",
            "one two three four five", "we went home at night", "it is a fine day today",
            "rain falls on the hill", "open the door please"]
PARAGRAPHS = [" = Title = ", " The first paragraph , with words . ", " = = Part = = ",
              " Another paragraph ; it is longer than the first one , by a few words . ",
              " A third one closes the text . "]


@pytest.fixture(scope="module")
def engine(tiny_llama):
    # gpu_batch_size 3: blocks mix lengths, so left padding is exercised
    return Engine.load(str(tiny_llama), Policy(gpu_batch_size=3), device="cpu", dtype="float32", progress=False)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    model = hf_model(tiny_llama)

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # row j predicts j+1
    return logprobs


@pytest.fixture
def data_dir(tmp_path):
    (tmp_path / "lambada").mkdir()
    (tmp_path / "lambada" / "lambada_openai_test.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in PASSAGES))
    (tmp_path / "wikitext-2-raw").mkdir()
    # the official layout: CRLF line ends, paragraphs separated by blank lines
    (tmp_path / "wikitext-2-raw" / "wiki.test.raw").write_bytes(
        "".join(p + "\r\n \r\n" for p in PARAGRAPHS).encode())
    return tmp_path


def test_split_last_word_one_meaning_for_eval_and_helm(data_dir):
    assert split_last_word(" the cat sat  on the\tmat\n") == ("the cat sat  on the", "mat")
    with pytest.raises(FlexGenError, match="no context"):
        split_last_word("  alone ")
    # eval scores the text that follows the context; HELM's reference is the bare word
    assert lambada.context_and_target("the cat sat on the mat\n") == ("the cat sat on the", " mat")
    instances = LambadaScenario(path=str(data_dir)).get_instances("unused")
    assert [(i.input.text, i.references[0].output.text) for i in instances] == [
        split_last_word(t) for t in PASSAGES]


def test_wikitext_articles(data_dir):
    lines = ["preface", " = One = ", "a", " = = Section = = ", "b", " = Two = ", "c"]
    assert split_articles(lines) == ["preface", " = One = \n\na\n\n = = Section = = \n\nb", " = Two = \n\nc"]
    articles = WikiTextScenario(path=str(data_dir)).get_instances("unused")
    assert [a.input.text for a in articles] == [join_paragraphs(PARAGRAPHS)]  # one title: one article
    paragraphs = WikiTextScenario(unit="paragraph", path=str(data_dir)).get_instances("unused")
    assert [p.input.text for p in paragraphs] == PARAGRAPHS


def test_split_and_tokenize(engine):
    items, merged = lambada.prepare(engine.tokenizer, ["the cat sat on the mat"])
    assert merged == 0
    assert engine.tokenizer.decode(items[0].target) == " mat"
    assert items[0].context == engine.tokenizer("the cat sat on the")["input_ids"]


def test_lambada_matches_transformers(engine, reference):
    items, _ = lambada.prepare(engine.tokenizer, PASSAGES)
    # Half the targets are the model's own greedy continuation (so accuracy is not 0):
    greedy = engine.generate([it.context for it in items[:4]],
                             SamplingParams(max_new_tokens=3, ignore_eos=True)).results
    items[:4] = [lambada.Item(it.context, r.completions[0].token_ids) for it, r in zip(items[:4], greedy)]
    out = lambada.evaluate(engine, items, chunk=5, progress=False)

    correct, nll = [], []
    for it in items:
        lp = reference(it.full)[len(it.context) - 1:-1]  # rows predicting the target tokens
        target = torch.tensor(it.target)
        correct.append(bool((lp.argmax(-1) == target).all()))
        nll.append(-float(lp.gather(-1, target[:, None]).sum()))
    assert out["correct"] == correct
    assert correct[:4] == [True] * 4 and sum(correct) < len(items)
    assert out["metrics"]["accuracy"] == pytest.approx(sum(correct) / len(items))
    assert out["nll"] == pytest.approx(nll, rel=1e-4)
    assert out["metrics"]["last_word_perplexity"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-4)

    # one scoring pass == greedy decoding of len(target) tokens
    acc, by_generation = lambada.generation_accuracy(engine, items, chunk=5, progress=False)
    assert by_generation == correct and acc == out["metrics"]["accuracy"]


def test_wikitext_matches_transformers(engine, reference, data_dir):
    lines, source = read_wikitext(str(data_dir))
    assert lines == PARAGRAPHS and source["sha256"]
    ids, text = wikitext.tokenize(engine.tokenizer, lines, limit=None)
    assert text == "\n\n".join(PARAGRAPHS)
    window = 40
    out = wikitext.evaluate(engine, ids, text, window, batch=2, progress=False)

    nll, scored = 0.0, 0
    for s in range(0, len(ids), window):
        w = ids[s:s + window]
        if len(w) > 1:
            nll -= float(reference(w)[:-1].gather(-1, torch.tensor(w[1:])[:, None]).sum())
            scored += len(w) - 1
    c, m = out["counts"], out["metrics"]
    assert (c["tokens"], c["tokens_scored"], c["windows"]) == (len(ids), scored, math.ceil(len(ids) / window))
    assert m["token_perplexity"] == pytest.approx(math.exp(nll / scored), rel=1e-4)
    assert c["words"] == len(text.split()) and c["bytes"] == len(text.encode())
    assert m["word_perplexity"] == pytest.approx(math.exp(nll / c["words"]), rel=1e-4)
    assert m["bits_per_byte"] == pytest.approx(nll / math.log(2) / c["bytes"], rel=1e-4)


def test_wikitext_limit_cuts_text_at_token(engine):
    ids, text = wikitext.tokenize(engine.tokenizer, PARAGRAPHS, limit=30)
    full, _ = wikitext.tokenize(engine.tokenizer, PARAGRAPHS, limit=None)
    assert ids == full[:30]
    assert engine.tokenizer(text)["input_ids"] == ids  # the text covers exactly those tokens


def test_rolling_pieces_score_every_token_once():
    """The "documents" protocol's pieces, spelled out: a start token, then windows of 4
    predicted tokens each fed the 4 before them; the last, shorter one keeps a full context."""
    ids = list(range(10, 20))
    pieces = wikitext.rolling_pieces(ids, 99, 4)
    assert pieces == [([99, 10, 11, 12, 13], 1), ([13, 14, 15, 16, 17], 1), ([15, 16, 17, 18, 19], 3)]
    assert [t for seq, first in pieces for t in seq[first:]] == ids
    assert wikitext.rolling_pieces(ids[:3], 99, 4) == [([99, 10, 11, 12], 1)]
    assert wikitext.rolling_pieces([], 99, 4) == []


def test_wikitext_documents_match_transformers(engine, reference, data_dir):
    lines, _ = read_wikitext(str(data_dir))
    lines = lines + [" = Second = ", " Its only paragraph . "]
    docs, texts = wikitext.tokenize_documents(engine.tokenizer, lines, limit=None)
    assert texts == split_articles(lines) and len(docs) == 2
    start = engine.config.document_start_token
    assert start == 1  # the tiny model's beginning-of-text token

    def nll_of(seq, first):
        return -float(reference(seq)[first - 1:-1].gather(-1, torch.tensor(seq[first:])[:, None]).sum())

    # a window longer than the (short) second document: scored whole, every token after the start token
    assert len(docs[1]) < 63 < len(docs[0])
    whole = wikitext.evaluate_documents(engine, docs[1:], texts[1:], 63, start, batch=2, progress=False)
    nll = nll_of([start] + docs[1], 1)
    c, m = whole["counts"], whole["metrics"]
    assert (c["documents"], c["windows"]) == (1, 1) and c["tokens"] == c["tokens_scored"] == len(docs[1])
    assert m["token_perplexity"] == pytest.approx(math.exp(nll / c["tokens"]), rel=1e-4)
    assert (c["words"], c["bytes"]) == (len(texts[1].split()), len(texts[1].encode()))
    assert m["bits_per_byte"] == pytest.approx(nll / math.log(2) / c["bytes"], rel=1e-4)
    # shorter windows: every token of both scored once, in pieces
    out = wikitext.evaluate_documents(engine, docs, texts, 16, start, batch=3, progress=False)
    pieces = [p for d in docs for p in wikitext.rolling_pieces(d, start, 16)]
    assert out["counts"]["windows"] == len(pieces) > 2
    assert out["counts"]["tokens_scored"] == out["counts"]["tokens"] == sum(map(len, docs))
    assert out["counts"]["total_nll"] == pytest.approx(sum(nll_of(*p) for p in pieces), rel=1e-4)


def run_cli(tiny_llama, tmp_path, *extra) -> dict:
    out = tmp_path / "r.json"
    rc = main(["eval", "--model", str(tiny_llama), "--device", "cpu", "--dtype", "float32", "--gpu-batch-size", "4",
               "--quiet", "--json", str(out), *extra])
    assert rc == 0
    return json.loads(out.read_text())


def test_cli_lambada_limit(tiny_llama, tmp_path, data_dir, capsys):
    r = run_cli(tiny_llama, tmp_path, "--task", "lambada", "--data", str(data_dir), "--limit", "5", "--generate")
    assert r["counts"]["passages"] == 5 and r["limit"] == 5
    assert r["metrics"]["generation_accuracy"] == r["metrics"]["accuracy"]
    assert r["data"]["path"].endswith("lambada_openai_test.jsonl") and len(r["data"]["sha256"]) == 64
    assert r["dtype"] == "float32" and r["policy"]["gpu_batch_size"] == 4 and r["window"] is None
    assert r["command"].startswith("flexgen-helm eval --model") and "--limit 5" in r["command"]
    assert r["throughput_tokens_per_s"] > 0 and r["wall_s"] >= r["eval_s"]
    assert "accuracy" in capsys.readouterr().out


def test_cli_wikitext(tiny_llama, tmp_path, data_dir, monkeypatch, capsys):
    monkeypatch.setenv("FLEXGEN_HELM_DATA", str(data_dir))  # found without --data
    r = run_cli(tiny_llama, tmp_path, "--task", "wikitext", "--window", "1024", "--limit", "100")
    assert r["window"] == 64  # capped at the tiny model's context
    assert r["counts"]["tokens"] == 100 and r["counts"]["tokens_scored"] == 100 - 2
    assert r["data"]["path"] == os.path.realpath(data_dir / "wikitext-2-raw" / "wiki.test.raw")
    assert "not scored" in r["counts"]["note"] and "token perplexity" in capsys.readouterr().out


def test_cli_wikitext_documents(tiny_llama, tmp_path, data_dir, capsys):
    r = run_cli(tiny_llama, tmp_path, "--task", "wikitext", "--data", str(data_dir), "--protocol", "documents",
                "--window", "1024", "--limit", "1")
    assert r["protocol"] == "documents" and r["window"] == 63  # a piece is the window and the token before it
    assert r["counts"]["documents"] == 1 and r["counts"]["tokens_scored"] == r["counts"]["tokens"]
    assert "every token scored" in capsys.readouterr().out
    # a record of the default protocol names it
    assert run_cli(tiny_llama, tmp_path, "--task", "wikitext", "--data", str(data_dir))["protocol"] == "windows"


def test_cli_score_as_decode(tiny_llama, tmp_path, data_dir, capsys):
    """--score-as-decode shows a compressed cache in perplexity; without one it changes nothing."""
    base = ["--task", "wikitext", "--data", str(data_dir), "--limit", "200"]
    kv4 = ["--compress-cache", "--compress-bits", "4", "--compress-group-size", "4"]
    plain = run_cli(tiny_llama, tmp_path, *base)
    assert run_cli(tiny_llama, tmp_path, *base, "--score-as-decode")["metrics"] == plain["metrics"]
    assert run_cli(tiny_llama, tmp_path, *base, *kv4)["metrics"] == plain["metrics"]  # a prefill never reads it
    through = run_cli(tiny_llama, tmp_path, *base, *kv4, "--score-as-decode")
    assert through["score_as_decode"] and through["metrics"] != plain["metrics"]
    assert "scoring: as decode" in capsys.readouterr().out


def test_missing_data_is_a_clear_error(tiny_llama, tmp_path, monkeypatch, capsys):
    assert main(["eval", "--model", str(tiny_llama), "--task", "lambada", "--data", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl does not exist" in capsys.readouterr().err
    monkeypatch.setenv("FLEXGEN_HELM_DATA", str(tmp_path))  # an empty data folder, and offline (conftest)
    assert main(["eval", "--model", str(tiny_llama), "--task", "wikitext"]) == 2
    err = capsys.readouterr().err
    assert "wikitext-2-raw/wiki.test.raw" in err and "--data PATH" in err


def test_missing_data_says_why_it_was_not_downloaded(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXGEN_HELM_DATA", str(tmp_path))
    monkeypatch.setenv("FLEXGEN_HELM_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="no local file.*unavailable: offline"):
        read_lambada()


def test_local_file_accepts_a_data_folder(data_dir):
    assert local_file("lambada/lambada_openai_test.jsonl", str(data_dir)).endswith("lambada_openai_test.jsonl")


def test_interrupted_eval_resumes_where_it_stopped(tiny_llama, tmp_path, data_dir, monkeypatch):
    """A killed evaluation keeps its finished chunks; the same command then scores only the rest
    and reports what an uninterrupted run reports."""

    args = ["--task", "wikitext", "--data", str(data_dir), "--gpu-batch-size", "1"]  # 3 windows of 64, one a chunk
    whole = run_cli(tiny_llama, tmp_path / "whole", *args)
    real_score, calls = Engine.score, []

    def dies_on_third_chunk(self, *a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("killed")
        return real_score(self, *a, **kw)

    monkeypatch.setattr(Engine, "score", dies_on_third_chunk)
    with pytest.raises(RuntimeError, match="killed"):
        run_cli(tiny_llama, tmp_path, *args)
    partial = tmp_path / "r.json.partial.jsonl"
    assert len(partial.read_text().splitlines()) == 1 + 2  # the fingerprint, two chunks
    calls.clear()
    resumed = run_cli(tiny_llama, tmp_path, *args)
    assert len(calls) == 1 and resumed["resumed_results"] == 2 and resumed["throughput_tokens_per_s"] is None
    assert resumed["metrics"] == whole["metrics"] and not partial.exists()

    # another evaluation under the same file name does not take those results
    monkeypatch.setattr(Engine, "score", real_score)
    partial.write_text('{"fingerprint": {"task": "other"}}\n{"window:0": [0.0, 63]}\n')
    assert run_cli(tiny_llama, tmp_path, *args)["resumed_results"] == 0
    assert (tmp_path / "r.json.partial.jsonl.stale").exists()


def test_accuracy_findings_rank_weight_groupings_from_the_records():
    """The sweep report's grouping finding is computed from the records: it names the
    better dim-0 group size, says when the two metrics disagree, and only for complete scopes."""
    from flexgen_helm.tools.accuracy_sweep.report import findings

    def rec(ppl, acc):
        return {"wikitext": {"metrics": {"token_perplexity": ppl}}, "lambada": {"metrics": {"accuracy": acc}}}

    runs = {("w4-g64", "full"): rec(40.0, 0.20), ("w4-g32-d0", "full"): rec(30.0, 0.22),
            ("w4-g64-d1", "full"): rec(35.0, 0.21), ("w4-g32-d1", "full"): rec(25.0, 0.27),
            ("w4-g64", "lim"): rec(40.0, 0.20)}
    text = [f for f in findings(runs) if f.startswith("Grouping")]
    assert len(text) == 1 and 'scope "full"' in text[0]  # "lim" lacks three of the rows
    assert "g32 gives the lower perplexity." in text[0] and "Dim 1 gives the lower perplexity at both" in text[0]
    runs[("w4-g32-d0", "full")] = rec(30.0, 0.15)
    assert "moves the other way (0.1500 vs 0.2000)" in [f for f in findings(runs) if f.startswith("Grouping")][0]
    runs[("w4-g64-d1", "full")] = rec(45.0, 0.21)
    assert "does not win at every size (g64: 45.000 along dim 1 vs 40.000" in [
        f for f in findings(runs) if f.startswith("Grouping")][0]


def test_accuracy_sweep_run_reports_a_failed_eval(monkeypatch, capsys):
    """A run that exits non-zero is listed and makes `sweep run` fail; the runs after it still go."""
    import subprocess

    from flexgen_helm.tools.accuracy_sweep import sweep

    calls = []

    def fake_run(cmd, *a, **k):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1 if len(calls) == 1 else 0)

    monkeypatch.setattr(sweep.subprocess, "run", fake_run)
    monkeypatch.setattr(sweep, "json_path", lambda *a: Path("/nonexistent/never.json"))
    assert sweep.main(["run", "--rows", "kv4h-g64", "--scopes", "quick"]) == 1
    assert len(calls) == 2  # lambada failed, wikitext still ran
    err = capsys.readouterr().err
    assert "1 run(s) failed" in err and "--task lambada" in err and "--task wikitext" not in err
