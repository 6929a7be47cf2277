"""`flexgen-helm eval`: LAMBADA last-word accuracy and WikiText perplexity."""

from __future__ import annotations

from flexgen_helm.cli.options import add_model_args, add_policy_args, checked_output_file, policy_from_args
from flexgen_helm.errors import FlexGenError
from flexgen_helm.evaluation.wikitext import PROTOCOLS


def add_command(sub) -> None:
    e = sub.add_parser("eval", help="accuracy: LAMBADA last-word accuracy, WikiText perplexity")
    add_model_args(e)
    add_policy_args(e)
    e.add_argument("--task", choices=["lambada", "wikitext"], required=True)
    e.add_argument("--data", help="the task's data file, or a data folder (default: $FLEXGEN_HELM_DATA, "
                                  "../shared/data, else the hub when online)")
    e.add_argument("--limit", type=int, help="LAMBADA: the first N passages; WikiText: the first N tokens "
                                             "(--protocol documents: the first N articles)")
    e.add_argument("--window", type=int, default=1024, help="WikiText window in tokens (capped at the context)")
    e.add_argument("--protocol", choices=PROTOCOLS, default="windows",
                   help="WikiText: 'windows', the text joined and scored in non-overlapping windows, each "
                        "window's first token unscored; 'documents', lm-evaluation-harness's rolling "
                        "log-likelihood: each article alone after the model's start token, every token scored, "
                        "windows of --window predicted tokens each fed the --window tokens before them")
    e.add_argument("--generate", action="store_true",
                   help="LAMBADA: also measure accuracy by greedy generation (the decode path, where KV-cache "
                        "compression and sparse attention act; a plain score runs the prefill only)")
    e.add_argument("--score-as-decode", action="store_true",
                   help="score every token as if the engine had generated it: attention through the KV cache, "
                        "compressed and sparse as the policy says (a plain score's prefill attends to fresh keys "
                        "and values, where neither acts); the same numbers without cache compression or sparsity")
    e.add_argument("--quiet", action="store_true", help="no progress bars")
    e.add_argument("--json", help="write the record here")
    e.set_defaults(func=run)


def run(args) -> int:
    from flexgen_helm.evaluation.run import run_eval

    checked_output_file(args.json)
    try:
        run_eval(args, lambda workload: policy_from_args(args, workload), args.argv)
    except FileNotFoundError as e:  # missing evaluation data: say which file and how to point at it
        raise FlexGenError(str(e)) from e
    return 0
