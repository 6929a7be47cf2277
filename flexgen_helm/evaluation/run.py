"""`flexgen-helm eval`: load the engine under a policy, run one task, write a JSON record
(metrics, counts, policy, data provenance, timing, the exact command) and print a summary."""

from __future__ import annotations

import json
import math
import shlex
import time
from collections.abc import Callable
from pathlib import Path

from flexgen_helm.data.sources import read_lambada, read_wikitext
from flexgen_helm.errors import FlexGenError
from flexgen_helm.evaluation import lambada, wikitext
from flexgen_helm.evaluation.resume import ResumeLog
from flexgen_helm.memory.devices import DTYPE_NAMES
from flexgen_helm.planner.auto import CommandWorkload
from flexgen_helm.policy.policy import Policy

TASKS = ("lambada", "wikitext")


def run_eval(args, policy_for: Callable[[CommandWorkload], Policy], argv: list[str]) -> dict:
    """`policy_for(workload)`: the policy to run, given what the evaluation will score (the
    planner's choice where the user left it open)."""
    from flexgen_helm.engine import Engine
    from flexgen_helm.weights.registry import resolve

    if args.limit is not None and args.limit < 1:
        raise FlexGenError(f"--limit must be at least 1, got {args.limit}")
    t0 = time.perf_counter()
    # read the data first: a missing file should fail before the model loads
    if args.task == "lambada":
        texts, source = read_lambada(args.data)
        texts = texts[:args.limit]  # None: all
    else:
        lines, source = read_wikitext(args.data)
    resolved = resolve(args.model, path=args.path, dummy=args.dummy)
    # tokenized before the engine loads: the planner chooses the block for these lengths
    tokenizer = resolved.load_tokenizer()
    documents = args.task == "wikitext" and args.protocol == "documents"
    # a "documents" piece is a window of predicted tokens and the one token before them
    window = min(args.window, resolved.config.max_seq_len - (1 if documents else 0))
    if args.task == "lambada":
        items, merged = lambada.prepare(tokenizer, texts)
        workload = CommandWorkload(max(len(it.full) for it in items), 1, len(items))
    elif documents:
        start_token = resolved.config.document_start_token
        if start_token is None:
            raise FlexGenError(f"{resolved.config.name} names neither a beginning- nor an end-of-text token: the "
                               "documents protocol has no token to start a document after")
        docs, articles = wikitext.tokenize_documents(tokenizer, lines, args.limit)
        pieces = sum(math.ceil(len(d) / window) for d in docs)
        workload = CommandWorkload(min(window + 1, max(len(d) for d in docs) + 1), 1, pieces)
    else:
        ids, text = wikitext.tokenize(tokenizer, lines, args.limit)
        workload = CommandWorkload(min(window, len(ids)), 1, math.ceil(len(ids) / window))
    policy = policy_for(workload)
    engine = Engine.load(args.model, policy, path=args.path, dummy=args.dummy, offload_dir=args.offload_dir,
                         device=args.device, dtype=args.dtype, progress=not args.quiet)
    load_s = time.perf_counter() - t0
    progress = not args.quiet
    record = _setup_record(args, engine, source, window)
    # what decides the numbers; a rerun of the same evaluation resumes from its progress file
    fingerprint = {k: record[k] for k in ("task", "model", "model_name", "policy", "dtype", "limit", "data",
                                          "score_as_decode", "window")}
    if documents:  # (a progress file from before the protocol was recorded is the windows protocol's)
        fingerprint["protocol"] = record["protocol"]
    resume = ResumeLog(args.json + ".partial.jsonl" if args.json else None, {**fingerprint, "path": args.path})
    resumed = len(resume.done)
    if resumed and progress:
        print(f"resuming: {resumed} results from {resume.path}")
    t1 = time.perf_counter()
    if args.task == "lambada":
        out = _evaluate_lambada(args, engine, policy, items, progress, resume)
        out["counts"]["boundary_merges"] = merged
    elif documents:
        out = wikitext.evaluate_documents(engine, docs, articles, window, start_token, policy.block_size, progress,
                                          args.score_as_decode, resume)
    else:
        out = wikitext.evaluate(engine, ids, text, window, policy.block_size, progress, args.score_as_decode, resume)
    eval_s = time.perf_counter() - t1
    tokens = out["counts"]["tokens_scored"] if args.task == "lambada" else out["counts"]["tokens"]
    record.update(metrics=out["metrics"], counts=out["counts"], load_s=load_s, eval_s=eval_s,
                  resumed_results=resumed,
                  wall_s=time.perf_counter() - t0,
                  # a resumed run timed only its own part
                  throughput_tokens_per_s=None if resumed else tokens / eval_s,
                  command="flexgen-helm " + shlex.join(argv))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
        resume.finish()
    print(summary(record))
    return record


def _setup_record(args, engine, source: dict, window: int) -> dict:
    """What was evaluated, on what, with which data: the record's head."""
    return {"task": args.task, "model": args.model, "model_name": engine.config.name,
            "policy": engine.policy.to_dict(), "policy_summary": engine.policy.describe(),
            "dtype": DTYPE_NAMES[engine.runtime.devices.dtype],
            "device": str(engine.runtime.devices.compute), "limit": args.limit, "data": source,
            "score_as_decode": args.score_as_decode,
            "window": window if args.task == "wikitext" else None,
            "protocol": args.protocol if args.task == "wikitext" else None}


def _evaluate_lambada(args, engine, policy, items: list[lambada.Item], progress: bool, resume: ResumeLog) -> dict:
    """Scoring accuracy and last-word perplexity, and with --generate the accuracy by generation."""
    chunk = lambada_chunk(policy)
    out = lambada.evaluate(engine, items, chunk, progress, args.score_as_decode, resume)
    if args.generate:
        acc, _ = lambada.generation_accuracy(engine, items, chunk, progress, resume)
        out["metrics"]["generation_accuracy"] = acc
    return out


def lambada_chunk(policy) -> int:
    """Passages per engine call (one progress and resume step): whole blocks, at least 128."""
    return policy.block_size * max(1, math.ceil(128 / policy.block_size))


def approximations(policy: dict) -> str:
    """The numerics-changing part of a policy, short: "W4 g64 dim0 + KV4 g64 + sparse 0.1"."""
    parts = []
    for key, name in (("compress_weight", "W"), ("compress_cache", "KV")):
        c = policy.get(key)
        if c:
            dim = "" if c["group_dim"] is None else f" dim{c['group_dim']}"
            grouping = f" {c['cache_grouping']}" if c.get("cache_grouping") else ""
            parts.append(f"{name}{c['bits']} g{c['group_size']}{dim}{grouping}")
    if policy.get("attn_sparsity", 1.0) < 1.0:
        parts.append(f"sparse {policy['attn_sparsity']:g}")
    return " + ".join(parts) or "none"


def summary(r: dict) -> str:
    m, c = r["metrics"], r["counts"]
    scoring = "as decode (through the cache)" if r.get("score_as_decode") else "one prefill"
    head = (f"{r['task']} | {r['model']} | {r['dtype']} | approximations: {approximations(r['policy'])} "
            f"| scoring: {scoring}")
    if r["task"] == "lambada":
        body = (f"accuracy {m['accuracy']:.4f} ({c['correct']}/{c['passages']} passages), "
                f"last-word perplexity {m['last_word_perplexity']:.3f}")
        if "generation_accuracy" in m:
            body += f", accuracy by greedy generation {m['generation_accuracy']:.4f}"
    else:
        if r.get("protocol") == "documents":
            scored = (f"{c['documents']} documents, every token scored, in {c['windows']} pieces of at most "
                      f"{r['window']} predicted tokens")
        else:
            scored = (f"window {r['window']}, {c['tokens']} tokens ({c['tokens_scored']} scored: the first of each "
                      f"of {c['windows']} windows has no context)")
        body = (f"token perplexity {m['token_perplexity']:.3f}, word perplexity {m['word_perplexity']:.3f}, "
                f"bits/byte {m['bits_per_byte']:.4f}\n  {scored}, {c['words']} words, {c['bytes']} bytes")
    rate = (f"{r['throughput_tokens_per_s']:.0f} tokens/s" if r.get("throughput_tokens_per_s")
            else f"resumed from {r['resumed_results']} earlier results")
    tail = f"{r['eval_s']:.1f} s evaluating ({rate}), {r['load_s']:.1f} s loading; data {r['data']['path']}"
    return f"{head}\n  {body}\n  {tail}"
