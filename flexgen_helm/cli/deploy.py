"""`flexgen-helm helm-deploy`: a local checkpoint as a `flexgen/<name>` HELM deployment."""

from __future__ import annotations

import json


def add_command(sub) -> None:
    c = sub.add_parser("helm-deploy", help="serve a local checkpoint (HF folder or .gguf) as flexgen/NAME in helm-run")
    c.add_argument("name", help="the deployment is flexgen/NAME")
    c.add_argument("path", help="a Hugging Face checkpoint folder or a .gguf file")
    c.add_argument("--local-path", default="prod_env", help="helm-run's --local-path (default: prod_env)")
    c.add_argument("--policy", help="Policy fields as JSON, e.g. '{\"gpu_batch_size\": 16}' (the planner chooses "
                                    "the fields left out for this machine when the engine loads)")
    c.set_defaults(func=run)


def run(args) -> int:
    from flexgen_helm.errors import PolicyError
    from flexgen_helm.policy import Policy
    from flexgen_helm.tools.helm_deployment import write_deployment

    policy = None
    if args.policy:
        try:
            policy = json.loads(args.policy)
            Policy.from_dict(policy)  # checked before anything is written; the fields left out stay open
        except json.JSONDecodeError as e:
            raise PolicyError(f"--policy is not JSON ({e}): {args.policy!r}") from e
    for f in write_deployment(args.name, args.path, args.local_path, policy):
        print(f"wrote {f}")
    print(f'helm-run -r "lambada:model=flexgen/{args.name}" --local-path {args.local_path} ...')
    return 0
