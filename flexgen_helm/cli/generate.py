"""`flexgen-helm generate`: text for prompts, printed and optionally saved as JSON."""

from __future__ import annotations

import dataclasses
import json
import sys

from flexgen_helm.cli.options import (
    add_budget_args,
    add_model_args,
    add_policy_args,
    check_budgets_steer,
    checked_output_file,
    policy_from_args,
)
from flexgen_helm.dist.launch import engine_class, is_reporting_rank


def add_command(sub) -> None:
    g = sub.add_parser("generate", help="generate text for prompts")
    add_model_args(g)
    add_policy_args(g)
    add_budget_args(g)
    g.add_argument("--prompt", nargs="+", action="extend", required=True,
                   help="one or more prompts; the flag may be repeated, and every prompt given is kept")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--num-completions", type=int, default=1)
    g.add_argument("--stop", nargs="*", action="extend", help="stop strings")
    g.add_argument("--json", help="write prompts, completions, token ids and logprobs here")
    g.set_defaults(func=run)


def run(args) -> int:
    from flexgen_helm.executor.sampling import SamplingParams
    from flexgen_helm.text import TextEngine, check_text_request

    json_out = checked_output_file(args.json)
    check_budgets_steer(args)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, num_completions=args.num_completions)
    # refused before minutes of loading; the prompts are encoded again by TextEngine (milliseconds)
    stop_strings = tuple(args.stop or ())
    check_text_request(args.model, args.prompt, params, path=args.path, dummy=args.dummy, stop_strings=stop_strings)
    engine = engine_class(args.pipeline).load(args.model, policy_from_args(args), path=args.path, dummy=args.dummy,
                                              offload_dir=args.offload_dir, device=args.device, dtype=args.dtype)
    run = TextEngine(engine).generate(args.prompt, params, stop_strings=stop_strings)
    engine.close()
    if not is_reporting_rank(engine):
        return 0
    out = []
    for r in run.results:
        for c in r.completions:
            print(f"{r.prompt}\033[1m{c.text}\033[0m" if sys.stdout.isatty() else f"{r.prompt}{c.text}")
            print("-" * 40)
        out.append({"prompt": r.prompt, "prompt_token_ids": r.prompt_token_ids,
                    "completions": [dataclasses.asdict(c) for c in r.completions]})
    stats = run.stats
    print(f"{stats.generated_tokens} tokens in {stats.total_s:.2f} s "
          f"({stats.generated_tokens / max(stats.total_s, 1e-9):.1f} token/s); "
          f"policy: {engine.policy.describe()}")
    if json_out:
        json_out.write_text(json.dumps({"results": out, "stats": stats.as_dict(), "policy": engine.policy.to_dict()},
                                       indent=1))
    return 0
