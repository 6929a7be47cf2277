"""Where the engine's CPU time goes, by torch operator, on the two HELM workloads of
runs/helm_vs_hf: scoring one long WikiText window (language modeling) and generating a
few tokens for LAMBADA passages in blocks (the HELM client's batches).

    python -m flexgen_helm.tools.compare.op_profile [--dtype float32] [--window 4096] [--passages 128]

Prints each workload's wall time, torch profiler's table of operators by self time, and
the matmul rate it reached, to set against the compute floor (compute_floor.py)."""

from __future__ import annotations

import argparse
import functools
import time

from torch.profiler import ProfilerActivity, profile

from flexgen_helm.data.lambada import split_last_word
from flexgen_helm.data.sources import read_lambada, read_wikitext
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.policy import Policy
from flexgen_helm.text import TextEngine
from flexgen_helm.tools.compare.compute_floor import matmul_params_per_token

MODEL = "smollm2-135m"


def profiled(label: str, run, matmul_flop: float) -> None:
    run()  # warm-up: first-call allocations and kernel selection
    t0 = time.perf_counter()
    run()
    wall = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    ops = prof.key_averages()
    mm_s = sum(e.self_cpu_time_total for e in ops if e.key in ("aten::mm", "aten::addmm", "aten::bmm")) / 1e6
    print(f"\n== {label}: {wall:.2f} s unprofiled; matmuls {mm_s:.2f} s "
          f"({matmul_flop / mm_s / 1e9:.1f} GFLOP/s over the model's matmul FLOPs)")
    print(ops.table(sort_by="self_cpu_time_total", row_limit=15))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", help="compute dtype (default: the engine's for this CPU)")
    p.add_argument("--window", type=int, default=4096, help="tokens of the scored WikiText window")
    p.add_argument("--passages", type=int, default=128, help="LAMBADA passages generated from")
    p.add_argument("--block", type=int, default=64, help="sequences per GPU batch for generation")
    p.add_argument("--data", help="data folder (default: ../shared/data)")
    args = p.parse_args(argv)

    scorer = TextEngine.load(MODEL, Policy(gpu_batch_size=1, num_gpu_batches=1), dtype=args.dtype, progress=False)
    params = matmul_params_per_token(scorer.engine.config)
    text = "\n".join(read_wikitext(args.data)[0])[:40 * args.window]  # ~4 characters a token: ample
    window = scorer.encode([text])[0][:args.window]
    profiled(f"score one {len(window)}-token WikiText window ({scorer.engine.runtime.devices.dtype})",
             functools.partial(scorer.engine.score, [window]), 2.0 * params * len(window))
    del scorer

    gen = TextEngine.load(MODEL, Policy(gpu_batch_size=args.block, num_gpu_batches=1), dtype=args.dtype,
                          progress=False)
    contexts = [split_last_word(t)[0] for t in read_lambada(args.data)[0][:args.passages]]
    tokens = sum(len(ids) for ids in gen.encode(contexts))
    cfg = gen.engine.config
    body = params - cfg.vocab_size * cfg.hidden_size  # the head runs on last positions only
    profiled(f"generate 5 tokens after {len(contexts)} LAMBADA passages ({tokens} prompt tokens, "
             f"blocks of {args.block})", lambda: gen.generate(contexts, SamplingParams(max_new_tokens=5)),
             2.0 * body * tokens)


if __name__ == "__main__":
    main()
