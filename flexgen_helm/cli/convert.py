"""`flexgen-helm convert`: a model into the engine's per-tensor store."""

from __future__ import annotations

from flexgen_helm.cli.options import add_model_args


def add_command(sub) -> None:
    c = sub.add_parser("convert", help="convert a model into the engine's per-tensor store")
    add_model_args(c)
    c.add_argument("--out", help="store directory (default: the cache)")
    c.add_argument("--verify", action="store_true",
                   help="re-read every tensor, check its checksum, and rewrite those that do not match")
    c.set_defaults(func=run)


def run(args) -> int:
    from flexgen_helm.weights.loading import convert_named

    out = convert_named(args.model, path=args.path, dummy=args.dummy, dtype=args.dtype or "float16", out_dir=args.out,
                        verify=args.verify)
    print(f"store ready: {out}")
    return 0
