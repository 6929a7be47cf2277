"""`flexgen-helm <command>`: the command line, one module per subcommand.

This is the top layer: it parses flags and calls the tools (flexgen_helm/tools), the
frontends (evaluation) and the engine; nothing below imports it."""

from __future__ import annotations

import argparse
import sys

from flexgen_helm.cli import bench, compare, compare_llamacpp, convert, deploy, eval, generate, planning, report, verify
from flexgen_helm.cli.options import settle_model_args
from flexgen_helm.errors import FlexGenError

# the order `flexgen-helm --help` lists them in
SUBCOMMANDS = (generate, bench, convert, verify, report, planning, eval, compare, compare_llamacpp, deploy)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flexgen-helm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.add_command(sub)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    settle_model_args(args)
    args.argv = argv  # recorded verbatim by commands that write results
    try:
        return args.func(args)
    except FlexGenError as e:
        print(f"flexgen-helm: error: {e}", file=sys.stderr)
        return 2
